"""transformers' tensor-parallel styles as the optimizer meets them (docs/design.md §2.5).

A model sharded by transformers' own TP plan (`from_pretrained(..., distributed_config=
DistributedConfig(tp_size=N))`) holds DTensors for the styles that split a weight (`colwise`
Shard(0), `rowwise` Shard(1), `embedding_rowwise` Shard(0)), which `canzona.runtime.shards` reads
like any other. One style cannot be trained by canzona: `replicated_with_grad_allreduce` (Qwen3's
per-head `q_norm` / `k_norm`) keeps a plain replicated weight whose gradient covers this rank's
heads only, and sums it over TP in a post-accumulate-grad hook on `param.grad`. Under canzona the
gradient lives in the optimizer's buffers (a guard stands in `.grad`): that hook fails in
backward, and without it each rank would step its own part of the gradient. Such a parameter is
refused at construction, naming what transformers offers instead: the norm's weight a Replicate
DTensor over head-sharded input (its `SequenceParallel` style over the head dimension), whose
Partial gradient the optimizer sums over TP as it does for `parallelize_module`'s.

Read from the module's installed forward (transformers replaces `module.forward` with a function
of the style's `install_forward`): no import of transformers, which is looked for only where it is loaded.
"""

from __future__ import annotations

import re
import sys

from torch import nn

from canzona.errors import PlanError
from canzona.runtime.param_gather import Holders

GRAD_ALLREDUCE_STYLE = "replicated_with_grad_allreduce"
# where transformers defines the style's class: 5.x, and the module 4.x and 5.x both export it from
STYLE_MODULES = ("transformers.distributed.tensor_parallel", "transformers.integrations.tensor_parallel")


def _grad_allreduce_class() -> type | None:
    for module in STYLE_MODULES:
        cls = getattr(sys.modules.get(module), "ReplicatedWithGradAllReduce", None)
        if isinstance(cls, type):
            return cls
    return None


def _installed(module: nn.Module | None, style: type) -> bool:
    """Whether transformers installed `style` on `module`: its forward is a function defined in
    one of the style's methods (`install_forward`), or closes over the style."""
    forward = vars(module).get("forward") if module is not None else None
    if forward is None:
        return False
    if getattr(forward, "__module__", None) == style.__module__ and \
            getattr(forward, "__qualname__", "").startswith(style.__qualname__ + "."):
        return True
    for cell in getattr(forward, "__closure__", None) or ():
        try:
            if isinstance(cell.cell_contents, style):
                return True
        except ValueError:  # an empty cell
            continue
    return False


def check_tp_styles(holders: Holders) -> None:
    """One PlanError (every rank alike, before any collective) for the first parameter held by a
    module transformers sharded with `replicated_with_grad_allreduce`."""
    style = _grad_allreduce_class()
    if style is None:
        return
    for name, refs in holders.items():
        if any(_installed(ref(), style) for ref, _ in refs):
            pattern = re.sub(r"\.\d+\.", ".*.", name.rpartition(".")[0])
            raise PlanError(
                f"parameter {name!r} is sharded by transformers' TP style '{GRAD_ALLREDUCE_STYLE}', whose hook "
                "sums its gradient over TP in .grad, where canzona's optimizer keeps none: give that module a "
                "Replicate DTensor weight over head-sharded input instead, e.g. ALL_PARALLEL_STYLES.register("
                "'head_norm', SequenceParallel(sequence_dim=2)) from transformers.distributed.tensor_parallel and "
                f"DistributedConfig(tp_plan={{'{pattern}': 'head_norm', ...}}) (docs/design.md §2.5)")
