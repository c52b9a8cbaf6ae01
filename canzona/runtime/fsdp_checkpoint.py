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

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from canzona.errors import CanzonaError
from canzona.optimizers import matrix_optimizer
from canzona.runtime.checkpoint import _to_cpu, _to_device, full_state, read_state, restore_settings

if TYPE_CHECKING:
    from canzona.runtime.fsdp import FsdpOptimizer


def gather_state(opt: FsdpOptimizer) -> dict[str, Any]:
    """The whole state, identical on every rank. Collective over the exchange group."""
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
    for name in opt.elementwise_names:
        pieces = {m: member["adamw"][name] for m, member in enumerate(every) if name in member["adamw"]}
        if pieces:
            first = next(iter(pieces.values()))
            entry = {k: v for k, v in first.items() if not isinstance(v, Tensor)}
            for key in (k for k, v in first.items() if isinstance(v, Tensor)):
                entry[key] = _stitch(opt, name, {m: s[key] for m, s in pieces.items()})
            state[name] = entry
    for name in opt.params:
        pieces = {m: member["master"][name] for m, member in enumerate(every) if name in member["master"]}
        if pieces:
            state.setdefault(name, {})["master"] = _stitch(opt, name, pieces)
    return full_state(opt, state)


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
    then this rank's pieces. Local: no collective."""
    state, masters = restore_settings(opt, *read_state(opt, state_dict))
    device = next(iter(opt.params.values())).to_local().device
    opt.matrix_state.clear()
    opt.matrix_state.update({n: _to_device(state[n], device) if n in state else {} for n in opt.hosted})
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
