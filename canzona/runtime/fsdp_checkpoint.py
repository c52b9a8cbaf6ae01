"""Checkpoints of `canzona.runtime.fsdp.FsdpOptimizer` in the layout-independent form of
`canzona.runtime.checkpoint` (full tensors, torch.optim's layout, canzona's header in every group):
one format for both layouts, so that a checkpoint taken under FSDP2 at one size loads under FSDP2 at
another, or into `DistributedOptimizer`'s ZeRO-1 layout, and back.

Where the full tensors come from: a matrix's optimizer state is whole already, on its owner in the
exchange group; AdamW state (kept flat) and fp32 masters are per rank, each rank's piece a box of
the global tensor (`canzona.runtime.fsdp_layout`), and are stitched from every member's box. Both travel in
one object all-gather over the exchange group (bounded by the optimizer's timeout); HSDP replicas
hold the same state and gather alike, each replica within its own exchange group. Loading cuts
each full tensor to this rank's box, the matrices' state where this rank owns them, and counts
every matrix's steps from its saved state (every rank computes the update's scalars).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from canzona.errors import CanzonaError, SpecError
from canzona.optimizers import matrix_optimizer
from canzona.runtime.checkpoint import (
    DCP_PREFIX,
    STACK_KEY,
    WITNESS_KEY,
    _overlaps,
    _to_cpu,
    agree_on_save,
    check_loaded_weights,
    check_same_save,
    full_state,
    join_stack,
    matrix_state_to_device,
    piece_key,
    read_sharded,
    read_state_together,
    restore_settings,
    same_as_master,
    sharded_meta,
    split_stack,
    state_dict_witness_to_check,
    take_witness,
    witness_to_check,
)
from canzona.runtime.fsdp_layout import Box
from canzona.runtime.kernels import update_target
from canzona.spec import stacked_matrices

if TYPE_CHECKING:
    from canzona.runtime.fsdp import FsdpOptimizer


def current_masters(opt: FsdpOptimizer) -> None:
    """Before the masters are saved: each of this rank's is the master of its weights as they are
    now (`checkpoint.current_masters`, why: weights written into the model since the last step win,
    and a save of stale masters fails its own `check_weights`)."""
    for name, master in opt.master.items():
        update_target(master, opt.params[name].to_local().detach())


def gather_state(opt: FsdpOptimizer) -> dict[str, Any]:
    """The whole state, identical on every rank. Collective over the exchange group."""
    current_masters(opt)
    mine = {
        "matrix": {n: _to_cpu(s) for n, s in opt.matrix_state.items() if s},
        "adamw": {n: _to_cpu(s) for n, s in opt.adamw_state.items() if s},
        "master": {n: m.detach().to("cpu", copy=True) for n, m in opt.master.items()},
    }
    try:
        every = opt.comm.all_gather_object(mine, "optimizer state")  # by member of the exchange group
    except CanzonaError as e:
        raise CanzonaError(f"{e}; state_dict() is collective: call it on every rank (each gets the whole "
                           "state)") from None
    state: dict[str, dict] = {}
    for member in every:
        state.update(member["matrix"])
    stitched: dict[str, dict] = {}  # by parameter: a stack's state whole, as FSDP2's pieces are of it
    for name in opt.elementwise_names:
        pieces = {m: member["adamw"][name] for m, member in enumerate(every) if name in member["adamw"]}
        if pieces:
            first = next(iter(pieces.values()))
            entry = {k: v for k, v in first.items() if not isinstance(v, Tensor)}
            for key in (k for k, v in first.items() if isinstance(v, Tensor)):
                entry[key] = _stitch(opt, name, {m: s[key] for m, s in pieces.items()})
            stitched[name] = entry
    for name in opt.params:
        pieces = {m: member["master"][name] for m, member in enumerate(every) if name in member["master"]}
        if pieces:
            stitched.setdefault(name, {})["master"] = _stitch(opt, name, pieces)
    for name, entry in stitched.items():
        for key, part in _by_matrix(opt, name, entry).items():
            state.setdefault(key, {}).update(part)  # a matrix's master beside its owner's state
    return full_state(opt, state, take_witness(opt, _held(opt), [opt.world], call="state_dict()"))


def _by_matrix(opt: FsdpOptimizer, name: str, entry: Mapping[str, Any]) -> dict[str, dict]:
    """A parameter's whole state under the names the layout-independent form keys it by: a
    stack's under its matrices' (`'<param>[k]'`, each its slice; `full_state` stacks them again
    into the stack's entry, as the ZeRO-1 layout's), any other's under its own. Keyed by the
    stack's name, `full_state` found no matrix's state and saved the stack as a template of zeros:
    a resume restarted its moments."""
    spec = opt.spec.param(name)
    if spec.matrix_shape is None:
        return {name: dict(entry)}
    # the matrices lie one after another in the stack (a fused gate_up: two an expert)
    matrices = (spec.stack_size, *spec.matrix_shape)
    return split_stack(name, {**{k: v.reshape(matrices) if isinstance(v, Tensor) else v for k, v in entry.items()},
                              STACK_KEY: spec.stack_size})


def _by_stack(opt: FsdpOptimizer, by_name: Mapping[str, Any]) -> dict[str, Any]:
    """`_by_matrix` undone for a state by name (`checkpoint.state_by_name`'s form, or a sharded
    checkpoint's as read): each stack's matrices' entries stacked into the stack's, as FSDP2
    shards it (a matrix this rank read nothing of: zeros, outside its box)."""
    out = dict(by_name)
    for name in opt.params:
        spec = opt.spec.param(name)
        if spec.matrix_shape is None:
            continue
        matrices = [m.name for m in stacked_matrices(spec)]
        parts = [out.pop(m, None) for m in matrices]
        present = [p for p in parts if p]
        if not present:
            continue
        like = {k: v for p in present for k, v in p.items()}  # every field some matrix holds
        joined = join_stack(name, [
            {k: (p or {}).get(k, torch.zeros_like(v) if isinstance(v, Tensor) else v) for k, v in like.items()}
            for p in parts])
        out[name] = {k: v.reshape(spec.shape) if isinstance(v, Tensor) else v for k, v in joined.items()}
    return out


def _stitch(opt: FsdpOptimizer, name: str, pieces: Mapping[int, Tensor]) -> Tensor:
    """A full tensor of `name`'s global shape from members' local pieces (each at its box)."""
    lay = opt.layout[name]
    dtype = next(iter(pieces.values())).dtype
    full = torch.zeros(lay.shape, dtype=dtype)
    for member, piece in pieces.items():
        box = lay.boxes[member]
        if box.numel and lay.sources[member]:
            full[box.index()] = piece.reshape(box.shape)
    return full


def load_state(opt: FsdpOptimizer, state_dict: Mapping[str, Any]) -> None:
    """Load a layout-independent state dict (taken under FSDP2 at any size, or under ZeRO-1 at any
    DP x TP layout): checks first (a checkpoint of another model or optimizer: one PlanError),
    then this rank's pieces. Collective over the mesh (`read_state_together`): a refusal on one
    rank, or ranks given different state dicts, is one error on every rank, nothing loaded."""
    load_by_name(opt, *read_state_together(opt, state_dict, [opt.world]))
    opt.loaded_witness = state_dict_witness_to_check(state_dict, _shapes(opt))


def load_by_name(opt: FsdpOptimizer, header: Mapping[str, Any], groups: list[Mapping[str, Any]],
                 state: Mapping[str, dict]) -> None:
    """Load a state given by name (`checkpoint.state_by_name`'s form): checks, then this rank's
    pieces of it (full tensors, or zeros outside what this rank holds)."""
    state, masters = restore_settings(opt, header, groups, _by_stack(opt, state))
    device = next(iter(opt.params.values())).to_local().device
    opt.matrix_state.clear()
    opt.matrix_state.update({n: matrix_state_to_device(opt.optimizer, state[n], device) if n in state else {}
                             for n in opt.hosted})
    # every rank applies every matrix's update with scalars from its step count
    taken = matrix_optimizer(opt.optimizer).part("steps_taken")
    opt.matrix_steps.clear()
    opt.matrix_steps.update({n: taken(state[n]) if taken is not None and state.get(n) else 0 for n in opt.matrices})
    opt.adamw_state.clear()
    for name in opt.elementwise_names:
        local = opt.params[name].to_local()
        if name in state and local.numel():
            # kept flat, as the step keeps them (`adamw_step_` on the flat local shard)
            opt.adamw_state[name] = {k: _cut(opt, name, v, local).reshape(-1).to(device)
                                     if isinstance(v, Tensor) else v for k, v in state[name].items()}
    if opt.master_weights:
        opt.reset_master_weights()  # from the model's weights, then the saved fp32 masters where kept
        for name, full in masters.items():
            if name in opt.params:
                opt.master[name] = _cut(opt, name, full, opt.params[name].to_local()).float().to(device)
    opt.checked = None


def _cut(opt: FsdpOptimizer, name: str, full: Tensor, local: Tensor) -> Tensor:
    """This rank's box of a full tensor, shaped as its local shard."""
    box = opt.layout[name].boxes[opt.rank]
    return full.reshape(opt.layout[name].shape)[box.index()].reshape(local.shape).clone()


# --- torch.distributed.checkpoint: every rank writes only what it holds -------------------------


def sharded_state(opt: FsdpOptimizer, prefix: str = DCP_PREFIX) -> dict[str, Any]:
    """This rank's part of the state as flat `torch.distributed.checkpoint` entries, keyed as the
    ZeRO-1 layout's (`checkpoint.sharded_state`: a checkpoint written under one layout loads under
    the other): the whole state of the matrices it owns, its pieces of AdamW state and masters
    (the masters of the weights as they are now, `current_masters`; each piece the flat range of
    the full tensor its box is; the lowest member holding a box writes it;
    HSDP replicas write the same entries, which dcp saves once), and the metadata with the
    witness of the weights as they are now (`checkpoint.take_witness`: one small all-gather over
    the optimizer's mesh, `opt.world`; collective, as `dcp.save` is)."""
    current_masters(opt)
    out = sharded_meta(opt, prefix, take_witness(opt, _held(opt), [opt.world]))
    for name, state in opt.matrix_state.items():
        for key, value in state.items():
            out[f"{prefix}/matrix/{name}/{key}"] = value
    for name in opt.params:
        lay = opt.layout[name]
        box = lay.boxes[opt.rank]
        if not box.numel or not lay.sources[opt.rank]:
            continue
        lo, hi = _flat_bounds(box, lay.shape)
        if hi - lo != box.numel:
            raise SpecError(f"sharded_state_dict(): {name}'s piece on this rank ({box}) is not a contiguous range "
                            f"of its {lay.shape} (FSDP x TP): save with state_dict() (full tensors)")
        kind = "matrix" if name in opt.owner else "adamw"
        for entry, start, end, offset in _pieces(opt, name, lo, hi):
            if name in opt.master:
                out[piece_key(prefix, kind, entry, "master", offset)] = opt.master[name].reshape(-1)[start:end]
            for key, value in opt.adamw_state.get(name, {}).items():
                piece = value.reshape(-1)[start:end] if isinstance(value, Tensor) else value
                out[piece_key(prefix, "adamw", entry, key, offset)] = piece
    return out


def _pieces(opt: FsdpOptimizer, name: str, lo: int, hi: int) -> Iterator[tuple[str, int, int, int]]:
    """(entry, start, end, offset): parameter `name`'s flat range [lo, hi) as the entries the
    sharded form keys (the ZeRO-1 layout's: a stack's matrices, `'<param>[k]'`, any other
    parameter itself), each part [start, end) of this rank's flat piece at `offset` in its entry."""
    spec = opt.spec.param(name)
    if spec.matrix_shape is None:
        yield name, 0, hi - lo, lo
        return
    size = math.prod(spec.matrix_shape)
    for k, matrix in enumerate(stacked_matrices(spec)):
        first, last = max(lo, k * size), min(hi, (k + 1) * size)
        if first < last:
            yield matrix.name, first - lo, last - lo, first - k * size


def load_sharded(opt: FsdpOptimizer, checkpoint_id: Any, prefix: str = DCP_PREFIX, *,
                 check_weights: bool | None = None) -> None:
    """Read what this rank needs from a checkpoint written by `sharded_state` under FSDP2 at any
    size or under the ZeRO-1 layout at any DP x TP layout: the state of the matrices it owns, every
    matrix's step count, and the pieces that overlap its boxes (every piece of a parameter written
    at TP > 1); then load it as `load_state` does. `check_weights`: the model's weights were just
    loaded from the same save; refuse (collective, before anything is changed) if they are not its
    masters cast or differ from its witness (`check_weights_match`); None (the default): the first
    step checks them; False: not checked (weights changed on purpose)."""
    needs = {}
    for name in opt.params:
        lo, hi = _flat_bounds(opt.layout[name].boxes[opt.rank], opt.layout[name].shape)
        # by each entry this rank's piece spans (`_pieces`; a save that keyed a stack by its own
        # name, as sharded saves did before stacks were written by matrix, is read by matrix too:
        # `checkpoint._stack_pieces_by_matrix`)
        for entry, start, end, offset in _pieces(opt, name, lo, hi):
            first, last = offset, offset + end - start
            needs[entry] = lambda t, tp, at, meta, lo=first, hi=last: tp != 1 or _overlaps(meta, at, lo, hi)
    header, state, stepped_names = read_sharded(opt, checkpoint_id, prefix, list(opt.hosted), list(opt.matrices),
                                                needs, [opt.world])
    state = _by_stack(opt, state)
    state = agree_on_save(opt, header, [opt.world], state)  # checks compatibility first
    if check_weights:
        check_weights_match(opt, state, header.get(WITNESS_KEY))
    load_by_name(opt, header, header.get("param_groups", []), state)
    # unchecked here (the model may be loaded after it): the first step checks (`check_loaded_weights`)
    opt.loaded_witness = witness_to_check(header.get(WITNESS_KEY), stepped_names) if check_weights is None else None


def check_weights_at_step(opt: FsdpOptimizer) -> None:
    """`checkpoint.check_loaded_weights` under FSDP2 (what `step()` calls first)."""
    check_loaded_weights(opt, lambda: _held(opt), _shapes(opt), [opt.world])


def check_weights_match(opt: FsdpOptimizer, state: Mapping[str, dict], witness: Mapping[str, Any] | None) -> None:
    """`checkpoint.check_weights_match` under FSDP2 (collective over the optimizer's mesh, `opt.world`,
    one CheckpointError on every rank, nothing loaded): where this optimizer keeps fp32 masters
    and the checkpoint has them, this rank's box of each equals its weights cast from it; every
    other parameter's sampled elements in this rank's box equal the checkpoint's witness."""

    def compare_masters() -> set[str]:
        compared: set[str] = set()
        for name, saved in state.items():
            if name not in opt.params or not isinstance(saved, Mapping) or "master" not in saved:
                continue
            local = opt.params[name].to_local()
            if local.numel():
                same_as_master(name, _cut(opt, name, saved["master"], local), local)
                compared.add(name)
        return compared

    check_same_save(compare_masters if opt.master_weights else set, lambda: _held(opt), _shapes(opt), witness,
                    [opt.world])


def _shapes(opt: FsdpOptimizer) -> dict[str, tuple[int, ...]]:
    return {n: tuple(opt.layout[n].shape) for n in opt.params}


def _held(opt: FsdpOptimizer) -> dict[str, tuple[tuple[int, ...], Tensor]]:
    """Every parameter's box on this rank (its start in the global tensor) and local tensor, shaped as the box."""
    out = {}
    for name, p in opt.params.items():
        box = opt.layout[name].boxes[opt.rank]
        local = p.to_local()
        if box.numel and local.numel() == box.numel:
            out[name] = (tuple(box.start), local.reshape(box.shape))
    return out


def _flat_bounds(box: Box, shape: tuple[int, ...]) -> tuple[int, int]:
    """[first, last + 1) of the box's elements in the full tensor, flattened (row-major); the box
    is a contiguous range when that is its size."""
    if not box.numel:
        return 0, 0
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    first = sum(a * s for a, s in zip(box.start, strides))
    last = sum((a + n - 1) * s for a, n, s in zip(box.start, box.shape, strides))
    return first, last + 1
