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
load that marks some ranks and not the others is refused (`loaded_on_some_ranks`), naming the first
parameter written on some ranks only (`first_written_apart`). Under ZeRO-1
with TP, each TP rank's sharded weights are compared across its DP replicas, and the TP ranks of a
DP rank must agree on whether they were marked: a load of TP-sharded weights on some TP ranks only
(alike on their DP replicas) leaves every checksum they could compare equal.

Weights written in place without `load_state_dict` (`with torch.no_grad(): p.copy_(t)` on rank 0
only: a resume of the user's own, an EMA swap) are seen by their version counters
(`WeightVersions`): the sum of the parameters' `_version`s (a DTensor's and its local tensor's),
recorded at construction and after each step's own writes, read at each step check (and at the
recheck of `step()` after `clip_grad_norm_()`); a change marks the optimizer as a load does. A write
on every rank alike (a load on all ranks, a reset) costs one comparison, and training goes on; a
write on every rank at every step (nGPT's normalisation, clamping, Lookahead's sync) costs one
comparison a step (an fp64 checksum pass over the weights and the agreement all-gathers). Under
EP the expert weights are recorded apart: the mark the TP ranks compare counts the dense weights
only (`mark_loaded`'s `dense`); a load marks by the parameters it wrote (the state dict's keys:
`watch_model_loads`), so that one of experts alone into a module holding dense weights too sets
no dense mark.

Not seen: writes through `p.data` (the common `p.data.copy_(t)` included) or any tensor sharing
the storage under another version counter; c10d collectives into the parameters
(`dist.broadcast(p, 0)` moves no version counter); `dcp.load` into a DTensor model's `state_dict()`
(the detached DTensor's local tensor has a counter of its own; DCP is collective, so in practice
every rank loads alike). Left out on purpose: the weight of an embedding with `max_norm`, which its
forward writes at every step (`renormed_in_forward`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import Tensor, nn

from canzona.runtime.param_gather import Hook
from canzona.runtime.shards import is_dtensor

LOADED_ADVICE = ("the model's weights were loaded (load_state_dict) or written in place on some ranks since the last "
                 "step, or differ between the ranks: load them on every rank (under TP each rank its own shards), "
                 "or, for whole or DTensor parameters, broadcast rank 0's (torch.distributed.checkpoint.state_dict.set_model_state_dict("
                 "model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)))")


def loaded_on_some_ranks(loaded: list[int], others: list[int], first: str | None = None) -> str:
    """FSDP2's refusal of a load that reached some ranks only: each holds its own shards, so the
    model would train a mix of two sets of weights, and no checksum of the ranks' weights can say
    so (they differ by design). `first`: the first parameter written on some ranks and not the
    others (`first_written_apart`), where one is known."""
    named = f" (the first that differs: {first!r})" if first is not None else ""
    return (f"the model's weights were loaded (load_state_dict) or written in place since the last step on rank(s) "
            f"{loaded} and not on rank(s) {others}{named}: each rank holds its own shards of them, so the model now mixes "
            "two sets of weights. "
            "Load them on every rank (torch.distributed.checkpoint.state_dict.set_model_state_dict, with "
            "broadcast_from_rank0=True for a full state dict held by rank 0); nothing was updated")


def mark_loaded(owner: object, dense: bool = True, renormed: bool = False, experts: bool = False) -> None:
    """What the hooks of an optimizer do: mark it (`_model_loaded`), for its next step check; and,
    unless the write reached expert parameters only (`dense=False`), `_dense_loaded`, the mark that
    the TP ranks of a DP rank compare (under EP they may hold different EP ranks' experts, which a
    load on one EP rank's EDP replicas changes on some of them only, rightly); `renormed`: a load
    of a weight `renormed_in_forward` (`_renormed_loaded`); `experts`: a load of experts only
    (`_experts_loaded`). `clear_marks` clears them all."""
    owner._model_loaded = True
    if renormed:  # a module holding a weight `renormed_in_forward`: its load is compared by this mark
        owner._renormed_loaded = True
    if experts:  # a load of experts only (not a write): the DP ranks, every EP rank's, compare this mark
        owner._experts_loaded = True
    if dense:
        owner._dense_loaded = True


def clear_marks(owner: object) -> None:
    """`owner` unmarked (every mark `mark_loaded` sets): at construction, and once its ranks compared."""
    owner._model_loaded = owner._dense_loaded = owner._renormed_loaded = owner._experts_loaded = False


def renormed_in_forward(holders: Mapping[str, Iterable[nn.Module | None]]) -> set[str]:
    """The parameters (by name; `holders`: the modules holding each) that their module writes in
    place in its forward: the weight of an `nn.Embedding` / `nn.EmbeddingBag` with `max_norm`,
    whose looked-up rows `torch.embedding_renorm_` rescales under no_grad. The rows differ between
    ranks (their tokens do), so the version counters would mark every step on every rank, and the
    comparison would find the ranks' weights apart at each: such a weight is left out of
    `WeightVersions`. Under ZeRO-1 the step's all-gather puts each row's owner's values back on
    every rank, as before. Its `load_state_dict` on some ranks only is one error on every rank by a
    mark of its own that the ranks compare (`mark_loaded(renormed=True)`); a write of it alone in
    place on some ranks is not seen. The module's `max_norm` is read at construction."""
    renormed = set()
    for name, modules in holders.items():
        for m in modules:
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None \
                    and getattr(m, "weight", None) is not None:
                renormed.add(name)
    return renormed


def record_writes(owner: object) -> None:
    """The weights as they are now are `owner`'s own (after its step's writes, a comparison): both
    records (`_weight_versions`, and `_expert_versions` where it keeps one)."""
    owner._weight_versions.record()
    if getattr(owner, "_expert_versions", None) is not None:
        owner._expert_versions.record()


class WeightVersions:
    """The parameters' version counters, summed: one integer that any in-place write through a
    parameter (or a view of it, a DTensor's local tensor) moves. About 60 ns a parameter on CPU (a
    DTensor's ~160), read at each step check and after each step; reading `_version` keeps a
    pending parameter's gathers in flight (`pending_params._METADATA`).

    A DTensor's in-place op moves the wrapper's counter, a write into `to_local()` its local
    tensor's: both are summed. FSDP2 may put another local tensor in place (re-padded at its lazy
    init, the same values): a local tensor replaced resets the record rather than marking a write."""

    def __init__(self, params: Iterable[Tensor] | Mapping[str, Tensor]) -> None:
        named = list(params.items()) if isinstance(params, Mapping) else [(str(k), p) for k, p in enumerate(params)]
        self._plain = [p for _, p in named if not is_dtensor(p)]
        self._dtensors = [p for _, p in named if is_dtensor(p)]
        # the names, in the order `_now` reads the counters (plain parameters first): `written_since_record`
        self._names = [n for n, p in named if not is_dtensor(p)] + [n for n, p in named if is_dtensor(p)]
        self._seen = self._recorded = self._now()

    def _now(self) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        # below `__torch_function__`: a parameter marked pending (`pending_params`, after step())
        # is read as a plain one, not through its handler (ten times the cost)
        with torch._C.DisableTorchFunctionSubclass():
            versions = [p._version for p in self._plain]
            locals_ = []
            for p in self._dtensors:
                local = p._local_tensor
                versions.append(p._version + local._version)
                locals_.append(id(local))  # each in its place: a sum of ids could collide
        return sum(versions), tuple(locals_), tuple(versions)

    def record(self) -> None:
        """The weights as they are now are this rank's own (after a step's writes, a comparison)."""
        self._seen = self._recorded = self._now()

    def written(self) -> bool:
        """Whether a parameter was written in place since the last record (which this takes anew)."""
        now, seen = self._now(), self._seen
        self._seen = now
        return now[0] != seen[0] and now[1] == seen[1]

    def written_since_record(self) -> list[str]:
        """The parameters (by name, as given) written in place since the last `record` (not since the
        last `written`): a disagreement's error names the first (read on that failure path only). A
        DTensor whose local tensor was put in place since is not counted."""
        _, ids, versions = self._now()
        _, ids0, versions0 = self._recorded
        same = [True] * len(self._plain) + [a == b for a, b in zip(ids, ids0)]
        return [n for n, v, v0, s in zip(self._names, versions, versions0, same) if s and v != v0]


def first_written_apart(order: Iterable[str], written: list[list[str]]) -> str | None:
    """The first parameter of `order` that some ranks wrote (`written`: each rank's
    `WeightVersions.written_since_record`) and the others did not; None where none is."""
    sets = [set(w) for w in written]
    return next((n for n in order if len({n in s for s in sets}) > 1), None)


def note_writes(owner: object) -> None:
    """Mark `owner` (`mark_loaded`) where its parameters were written in place since its last record
    (`owner._weight_versions`, a `WeightVersions`; and `owner._expert_versions`, where it keeps one
    of the expert parameters apart: a write there marks `dense=False`)."""
    if owner._weight_versions.written():
        mark_loaded(owner)
    experts = getattr(owner, "_expert_versions", None)
    if experts is not None and experts.written():
        mark_loaded(owner, dense=False)


def watch_loads(modules: Iterable[nn.Module] | Mapping[nn.Module, Mapping[str, Mapping[str, bool]]], owner: object,
                mark: Callable[..., None]) -> None:
    """Call `mark(owner)` after each `load_state_dict` that reaches one of `modules`, while `owner`
    lives: the hooks hold it weakly, and are removed when it is collected. `modules` given as a
    mapping (each module: its own parameters' attribute names, each with the keyword arguments
    `mark` takes for it): by what the load wrote, `mark(owner, **kw)` for each of the module's
    parameters the load wrote (none: no mark; read in the post-hook, from the load's missing keys:
    a key-renaming pre-hook of the user's registered after this one counts), so that a load of a
    module's experts alone (strict=False) marks what `mark_loaded(dense=False, experts=True)` marks, not a
    load of its dense weights too. A module whose own `_load_from_state_dict` ran no pre-hook is
    marked for every parameter it holds."""
    ref = weakref.ref(owner)
    attrs_of = modules if isinstance(modules, Mapping) else dict.fromkeys(modules)

    def watch(attrs: Mapping[str, Mapping[str, bool]] | None) -> tuple[Callable[..., None], Callable[..., None]]:
        # for the post-hook: the keys the load will report missing (from where they start), or what
        # the pre-hook found in the state dict
        keyed: list[tuple[str, list[str], int] | list[Mapping[str, bool]]] = []

        def before(module: nn.Module, state_dict: Mapping[str, object], prefix: str, *args: object) -> None:
            # the step's parameter all-gathers land first (`wait_params`): a gather still in flight would
            # write the old weights over the loaded ones (a load through `.data`, or a parameter class
            # `pending_params` leaves unmarked, would not wait for it otherwise)
            held = ref()
            if held is not None:
                held.wait_params()
            if attrs is None:
                return
            # (local_metadata, strict, missing_keys, ...): `load_state_dict` passes strict=True
            # below, so each key of the module's the state dict lacks once the pre-hooks ran (a
            # user's, registered after this one, renaming old keys) is listed missing: read in the
            # post-hook, after them all
            if len(args) >= 3 and args[1] is True and isinstance(args[2], list):
                keyed[:] = [(prefix, args[2], len(args[2]))]
            else:
                keyed[:] = [[kw for attr, kw in attrs.items() if prefix + attr in state_dict]]

        def hook(module: nn.Module, incompatible_keys: object) -> None:
            held = ref()
            found = keyed.pop() if keyed else None
            if held is None:
                return
            if attrs is None:
                mark(held)
                return
            if isinstance(found, tuple):
                prefix, missing, start = found
                skipped = set(missing[start:])
                found = [kw for attr, kw in attrs.items() if prefix + attr not in skipped]
            for kw in (list(attrs.values()) if found is None else found):
                mark(held, **kw)
        return before, hook

    # a model pickled or deep-copied holds a no-op in its place (`Hook`): a load into the copy is not
    # a load into the model this optimizer steps
    handles = []
    for m, attrs in attrs_of.items():
        if m is None:
            continue
        before, hook = watch(attrs)
        handles.append(m.register_load_state_dict_pre_hook(Hook(before)))
        handles.append(m.register_load_state_dict_post_hook(Hook(hook)))
    weakref.finalize(owner, _remove, handles)


def watch_model_loads(owner: object, holders: Mapping[str, Iterable[tuple[Callable[[], nn.Module | None], str]]],
                      renormed: set[str], expert_names: set[str]) -> None:
    """The load hooks of a ZeRO-1 optimizer (`owner`) on every module holding one of its parameters
    (`holders`: name -> (weak reference to a module, its attribute)): each load marks by the
    parameters it wrote (the state dict's keys, `watch_loads`), a weight `renormed_in_forward`
    (`renormed`) as such, an expert (`expert_names`) with `dense=False, experts=True`, a dense weight
    plainly. So a module holding experts and dense weights (an MoE block's router beside its
    stacked experts) loaded with its experts alone (strict=False) sets no dense mark, the mark the
    TP ranks compare (under EP they may hold different EP ranks' experts)."""
    kinds: dict[nn.Module, dict[str, dict[str, bool]]] = {}
    for name, refs in holders.items():
        kw = {"renormed": True} if name in renormed else \
            {"dense": False, "experts": True} if name in expert_names else {}
        for held, attr in refs:
            if (m := held()) is not None:
                kinds.setdefault(m, {})[attr] = kw
    watch_loads(kinds, owner, mark_loaded)


def _remove(handles: list) -> None:
    for handle in handles:
        handle.remove()


__all__ = ["LOADED_ADVICE", "WeightVersions", "clear_marks", "first_written_apart", "loaded_on_some_ranks", "mark_loaded", "note_writes", "record_writes",
           "renormed_in_forward", "watch_loads", "watch_model_loads"]
