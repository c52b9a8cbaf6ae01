"""Weights loaded into the model on some ranks only, after the optimizer was built (docs/design.md
§8.3, "Never guess").

Under ZeRO-1 every DP rank holds the whole model, and the step's all-gather sends each rank's
updated shards to the others: where rank 0 alone ran `model.load_state_dict(...)` (a resume or a
fine-tune's pretrained weights, loaded `if rank == 0`), the next step would silently train a model
made of rank 0's loaded shards and the other ranks' old ones. (DDP keeps each rank's own weights
instead, and trains the replicas apart.) Construction compares the ranks' weights
(`DistributedOptimizer._check_agreement`); a load after it is seen here: every module holding a
parameter gets a `load_state_dict` post-hook (torch runs it for each module the load walks), which
marks the optimizer, and the next step check carries the mark to every rank of the cluster
(`GradientSync.prepare`'s `loaded`), where the ranks compare their weights again before anything
is updated. Under FSDP2 each rank holds its own shards, so their checksums cannot be compared: a
load that marks some ranks and not the others is refused (`loaded_on_some_ranks`). What writes
weights without `load_state_dict` (`p.copy_(...)`) is not seen.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

from torch import nn

from canzona.runtime.param_gather import Hook

LOADED_ADVICE = ("the model's weights were loaded (load_state_dict) on some ranks since the last step, or differ "
                 "between the ranks: load them on every rank (under TP each rank its own shards), or, for whole or "
                 "DTensor parameters, broadcast rank 0's (torch.distributed.checkpoint.state_dict.set_model_state_dict("
                 "model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)))")


def loaded_on_some_ranks(loaded: list[int], others: list[int]) -> str:
    """FSDP2's refusal of a load that reached some ranks only: each holds its own shards, so the
    model would train a mix of two sets of weights, and no checksum of the ranks' weights can say
    so (they differ by design)."""
    return (f"the model's weights were loaded (load_state_dict) since the last step on rank(s) {loaded} and not on "
            f"rank(s) {others}: each rank holds its own shards of them, so the model now mixes two sets of weights. "
            "Load them on every rank (torch.distributed.checkpoint.state_dict.set_model_state_dict, with "
            "broadcast_from_rank0=True for a full state dict held by rank 0); nothing was updated")


def mark_loaded(owner: object) -> None:
    """What the hooks of an optimizer do: mark it (`_model_loaded`), for its next step check."""
    owner._model_loaded = True


def watch_loads(modules: Iterable[nn.Module], owner: object, mark: Callable[[object], None]) -> None:
    """Call `mark(owner)` after each `load_state_dict` that reaches one of `modules`, while `owner`
    lives: the hooks hold it weakly, and are removed when it is collected."""
    ref = weakref.ref(owner)

    def hook(module: nn.Module, incompatible_keys: object) -> None:
        held = ref()
        if held is not None:
            mark(held)

    # a model pickled or deep-copied holds a no-op in its place (`Hook`): a load into the copy is not
    # a load into the model this optimizer steps
    handles = [m.register_load_state_dict_post_hook(Hook(hook)) for m in dict.fromkeys(modules)]
    weakref.finalize(owner, _remove, handles)


def _remove(handles: list) -> None:
    for handle in handles:
        handle.remove()


__all__ = ["LOADED_ADVICE", "loaded_on_some_ranks", "mark_loaded", "watch_loads"]
