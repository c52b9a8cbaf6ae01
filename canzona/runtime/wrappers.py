"""Data-parallel wrappers that cannot share a model with `DistributedOptimizer`.

The optimizer synchronises gradients itself (reduce-scatter from its backward hooks) and keeps
whole parameters on every data-parallel rank. A model also wrapped in `DistributedDataParallel`
would have its gradients reduced twice (DDP's all-reduce, then ours), and one sharded by FSDP v1
(`FullyShardedDataParallel`) hides its matrices in flat parameters. FSDP2's `fully_shard` is
not refused: its DTensor parameters take the FSDP step (`canzona.runtime.fsdp`).
Each is refused with one line naming the wrapper, wherever it is first seen: `from_module` and
`named_parameters` look at the module they are given; the optimizer, which sees parameters only,
looks for a wrapper holding them when something touched a gradient it guards (DDP's reducer does,
at the first backward) or moved a parameter's storage (FSDP does).
"""

from __future__ import annotations

import gc
from collections.abc import Iterable

from torch import Tensor, nn


def wrapper_kind(module: nn.Module) -> str | None:
    """The data-parallel wrapper `module` is, if any."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        return "DistributedDataParallel"
    if isinstance(module, DataParallel):
        return "DataParallel"
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - builds without distributed support
        return None
    if isinstance(module, FullyShardedDataParallel):  # FSDP2 (fully_shard) runs: canzona.runtime.fsdp
        return "FSDP (FullyShardedDataParallel)"
    return None


def wrapper_message(kind: str) -> str:
    """Why the wrapper `kind` is refused, and what to do instead."""
    if kind.startswith("FSDP"):
        return (f"the model is sharded by {kind}, whose flat parameters hide the matrices: shard it with "
                "FSDP2's fully_shard instead (DistributedOptimizer runs those models), or give the optimizer "
                "the model without FSDP")
    return (f"the model is wrapped in {kind}, which reduces the gradients that canzona's DistributedOptimizer "
            "already reduces (they would be reduced twice): give the optimizer the unwrapped model and train "
            "that; the optimizer's backward hooks synchronise the gradients, and opt.no_sync() replaces "
            "DDP's no_sync(). Hugging Face Trainer and accelerate wrap the model in DDP themselves: use "
            "canzona.integrations.hf.CanzonaTrainer or canzona.integrations.accelerate.CanzonaAccelerator")


def module_wrapper(model: nn.Module) -> str | None:
    """The first data-parallel wrapper in `model` (itself or a submodule)."""
    return next((kind for m in model.modules() if (kind := wrapper_kind(m)) is not None), None)


def wrapper_holding(params: Iterable[Tensor]) -> str | None:
    """The data-parallel wrapper that holds any of `params`, found among live objects. It walks
    the garbage collector's objects (a fraction of a second in a large process): call it on an
    error path, to name the cause, not on every step."""
    ids = {id(p) for p in params}
    for obj in gc.get_objects():
        if issubclass(type(obj), nn.Module):  # not isinstance: it reads __class__, which lazy modules warn on
            kind = wrapper_kind(obj)
            if kind is not None and any(id(p) in ids for p in obj.parameters()):
                return kind
    return None
