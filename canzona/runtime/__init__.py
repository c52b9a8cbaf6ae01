"""The torch.distributed runtime that executes a `Plan` (docs/architecture.md).

`from canzona.runtime import DistributedOptimizer` is the entry point; it is imported on first use
so that `canzona.harness.verify`'s limits and the CLI load without torch.
"""

from typing import Any

__all__ = ["DistributedOptimizer"]


def __getattr__(name: str) -> Any:
    if name == "DistributedOptimizer":
        from canzona.runtime.optimizer import DistributedOptimizer

        return DistributedOptimizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
