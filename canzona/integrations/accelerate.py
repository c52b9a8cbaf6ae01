"""`CanzonaAccelerator`: accelerate's training loop over canzona's `DistributedOptimizer`.

A canzona optimizer owns its parameters' storage (`.data` is a view into its flat buffers, and
backward hooks move each gradient into them) and reduces the gradients itself. A plain `accelerate.Accelerator`
breaks both: `prepare()` moves the model to `accelerator.device` (on CPU that is `cpu:0`, and
`tensor.to("cpu:0")` copies even a CPU tensor), which takes the parameters out of the buffers, and
wraps it in `DistributedDataParallel`, which would reduce the gradients a second time; its
`clip_grad_norm_` would clip each rank's local gradients by a local norm.

`CanzonaAccelerator` is a drop-in subclass: a standard loop changes in the class name only.

    accelerator = CanzonaAccelerator(gradient_accumulation_steps=2)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    for batch in loader:
        with accelerator.accumulate(model):           # micro-batches run under opt.no_sync()
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:            # the global norm of the reduced gradients
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step(); sched.step(); opt.zero_grad()

For a model whose parameters a canzona optimizer holds:
- `prepare` (in one call with its optimizer, or before it in another) neither moves it (its
  parameters must be on `accelerator.device` already, in any
  spelling: `cpu` is `cpu:0`) nor wraps it in DDP; mixed-precision autocast and `torch.compile`
  still apply. fp16 (its GradScaler), DeepSpeed, FSDP, Megatron-LM, XLA and a
  `parallelism_config` are refused: each reduces or shards gradients or parameters itself; so is
  canzona's FSDP2 layout (`FsdpOptimizer`, a `fully_shard`ed model's): the ZeRO-1 layout only;
- `no_sync(model)` and `accumulate(model)` enter `opt.no_sync()` (`accumulate` on every micro-batch
  before the last, `GradientAccumulationPlugin(sync_each_batch=True)` too: the optimizer reduces
  the accumulated gradient once);
- `clip_grad_norm_(model.parameters(), max_norm)` is `opt.clip_grad_norm_(max_norm)`: clips by the
  global norm of the reduced gradients and returns it (`max_norm=inf`: the norm only); on a
  micro-batch before the last (`accelerator.sync_gradients` False) it is one error. Any other
  set of parameters (a subset, or one mixing in another optimizer's) is refused;
- `clip_grad_value_(model.parameters(), clip_value)` is `opt.clip_grad_value_(clip_value)` (clamps
  the reduced gradients), refused as `clip_grad_norm_` is on a micro-batch before the last or
  another set of parameters;
- `get_state_dict` (and so `save_model` and `save_state`) gives tensors with storage of their own:
  accelerate's safetensors writer drops every tensor that shares storage with another, and all the
  parameters share the optimizer's buffers. The copies are on the CPU, on the ranks that write
  the files; a model of plain tensors (each rank holds every parameter) gets its parameters
  themselves on the other ranks, as accelerate gives under DDP (no host copy per rank). A DTensor
  parameter (a TP model's) is gathered whole, one at a time (a collective: every rank calls them,
  as accelerate asks), and kept only on the ranks that write the files (the main process; each
  node's with `save_on_each_node`): elsewhere the state is empty, as accelerate's FSDP2 state dict
  is off rank 0; within `save_state` and `save_model` the other ranks copy nothing either.
  `load_state` cuts this rank's part of the file's tensor and copies it in place, with no gather;
- `save_state` / `load_state` write and read the optimizer with `torch.distributed.checkpoint`
  (`canzona_optimizer_<i>/` beside accelerate's files): each rank writes what it holds and any DP
  size reads it back. Each folder is written by `save_checkpoint` (a staging folder, a manifest of
  sha256s, one atomic rename or swap): a save killed midway into a reused `output_dir` leaves the
  previous optimizer state complete, and `load_state` verifies the folder before reading it (a
  damaged or foreign file: one `CheckpointError`, nothing loaded). A folder of an older canzona
  (no manifest) still loads; saving over one is refused with a `CheckpointError` saying to move it
  aside (`canzona.integrations.optimizer_state`). Each optimizer reads the folder whose manifest
  records its model's fingerprint (names, shapes, roles), so several canzona optimizers may be
  prepared in another order at the load than at the save; among models of one architecture (one
  fingerprint) the folder saved for the prepared model it steps (its index among accelerate's
  models, which accelerate loads by order: models prepared in another order get each other's
  weights, and their optimizers follow those weights). The manifest records too which
  `scheduler_<k>.bin` the schedulers wrapping the optimizer wrote: accelerate loads its schedulers
  by prepare order, and the load hands each scheduler of a canzona optimizer the file saved with
  that optimizer's folder (the optimizer its own `optimizer` is or wraps: one built on the
  `AcceleratedOptimizer` prepare returned too), and each other scheduler the files no folder
  recorded, in order (the manifests record how many folders and scheduler files the save wrote,
  and the folders of optimizers not prepared now are read too: their files are no other
  scheduler's). accelerate reads the first files, one per scheduler in order (fewer schedulers than
  files leave the last unread): schedulers that cannot take exactly those (one without a file of
  its own, one needing a file past those read or one the save did not write) are one
  `CanzonaError` on every rank before anything is loaded. A save without these records (an older
  canzona's) takes folders of one fingerprint in order and its scheduler files by position: where
  the optimizers take their folders in another order than they were prepared in, a scheduler over
  one of them is one `CanzonaError` before anything is loaded, as are fewer scheduler files than
  schedulers, a file whose state contradicts the scheduler prepared in its place (`contradiction`:
  public keys of a class's own, all but `SHARED_SCHEDULER_KEYS`, none in common, a StepLR's file
  for a LambdaLR, or each side holding some the other lacks, a StepLR's for a MultiStepLR; a list
  of the prepared optimizer's group count against the file's of another length) and another count
  of registered objects than the save's (`check_older_save`); what such a save cannot tell (files
  whose states read alike, a LambdaLR's and a MultiplicativeLR's; one whose keys are a part of the
  other's, an ExponentialLR's and a StepLR's; a state of private keys alone; files not read weights-only or left unread; what each registered
  object was) is one warning, and each takes its position's file. Objects given to
  `accelerator.register_for_checkpointing` (a scheduler too) are accelerate's own
  `custom_checkpoint_<i>.pkl`, loaded by registration order: the manifest records what each was
  (its type; a scheduler's optimizer, a canzona one by its folder, another by its type and group
  count: `registered_object`), and objects registered in another order or not the save's are one
  `CanzonaError` before anything is loaded (not told apart: two schedulers of one type over plain
  optimizers of one type and group count; a save of an older canzona is checked as said above). Call both on every rank, as
  accelerate asks.
  `load_state()` under automatic checkpoint naming takes the latest folder whose optimizer folders
  are in (a `save_state` killed midway left its own without them; one warning names those
  skipped); a folder without them is one
  `CanzonaError` before anything is loaded.

- a transformers schedule with a floor (`get_scheduler("cosine_with_min_lr", opt,
  scheduler_specific_kwargs={"min_lr": x})`, `cosine_warmup_with_min_lr`, `polynomial`'s `lr_end`
  other than transformers' default 1e-7) over a canzona optimizer whose rates differ (any group's)
  is one warning at `prepare` (the main process's, once per scheduler, at the caller's line) naming
  the floor each kind of group ends at: transformers divides the floor by
  `optimizer.defaults["lr"]`, the matrix rate, so the matrices end at `x` and the AdamW groups at
  `adamw lr * x / matrix lr`. The schedule is left as built (`prepare_scheduler` says why);
  `min_lr_rate=F / adamw lr` ends the AdamW groups at `F`. Likewise a plateau scheduler the user
  built with one absolute bound for every group (torch's `ReduceLROnPlateau(opt, min_lr=x)` or a
  list of equal values, transformers' `GreedyLR`, whose default `min_lr=1e-3` is such a bound, its
  default `max_lr=1.0` only where not above every rate; GreedyLR is
  no `LRScheduler`, which accelerate passes through, and is warned of all the same): one warning
  naming where each kind of group stops (a `min_lr` at or above the AdamW rate: never reduced) and
  the per-group `min_lr=[...]` lists (both take one) measured against either rate
  (`bound_warning`; a `min_lr` at or below `eps / (1 - factor)`, which cannot bind, is not told
  of: `floor_cannot_bind`). Their `eps`, absolute too, stops a reduction only below about
  `eps / (1 - factor)` (1.1e-8 at torch's defaults: far under an AdamW rate of 3e-4) and is named
  only where a group starts there.

Everything else (data loaders, schedulers, other models and optimizers) is accelerate's own.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
import sys
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import SCHEDULER_NAME, DistributedType
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from canzona.errors import CanzonaError, CheckpointError
from canzona.integrations.optimizer_state import (
    check_replaceable,
    fingerprint,
    latest_whole,
    load_optimizer,
    outside_level,
    save_optimizer,
    written_whole,
)
from canzona.runtime.checkpoint_files import MANIFEST, Ranks, read_manifest
from canzona.runtime.fsdp import FsdpOptimizer
from canzona.runtime.fsdp_layout import local_box
from canzona.runtime.optimizer import DistributedOptimizer, _holder
from canzona.runtime.shards import local_tensor

TESTED_ACCELERATE = "1.15.0"
OPTIMIZER_DIR = "canzona_optimizer"  # save_state writes canzona optimizer i to <dir>/canzona_optimizer_<i>
# what an optimizer folder's manifest records of its save (`saved_links`)
FINGERPRINT, MODEL_LINK, SCHEDULER_LINKS = "fingerprint", "prepared_model", "schedulers"
# and of the whole save: how many optimizer folders and scheduler files it wrote
FOLDER_COUNT, SCHEDULER_COUNT = "optimizer_folders", "scheduler_files"
# and what each object given to register_for_checkpointing was (`registered_object`), in order
REGISTERED = "registered_objects"
# Distributed types that reduce or shard gradients or parameters themselves
REFUSED_TYPES = {
    DistributedType.DEEPSPEED: "DeepSpeed",
    DistributedType.FSDP: "FSDP",
    DistributedType.MEGATRON_LM: "Megatron-LM",
    DistributedType.XLA: "XLA",
}
DDP_REFUSED = ("the model is wrapped in DistributedDataParallel, which would reduce the gradients a second "
               "time: give the plain model and its canzona optimizer to one accelerator.prepare(model, optimizer, "
               "...) call")
# an FSDP2 model's optimizer (`DistributedOptimizer` on a `fully_shard`ed model returns this layout):
# its accumulation, clipping and checkpoints are not what these integrations drive
FSDP_LAYOUT_REFUSED = ("the optimizer is canzona's FSDP2 layout (FsdpOptimizer: DistributedOptimizer on a model "
                       "sharded by fully_shard), whose accumulation, clipping and checkpoints CanzonaAccelerator and "
                       "CanzonaTrainer do not drive: give them the model "
                       "unsharded (the ZeRO-1 layout), or train the FSDP2 model in a loop of your own "
                       "(examples/fsdp2_train.py: opt.clip_grad_norm_, torch's get_state_dict(model, opt) / "
                       "set_state_dict with torch.distributed.checkpoint; accumulate under "
                       "model.set_requires_gradient_sync(False))")


def canzona_optimizer(optimizer: Any) -> DistributedOptimizer | None:
    """The canzona optimizer `optimizer` is or wraps (accelerate's `AcceleratedOptimizer` keeps
    the wrapped one in `.optimizer`), else None. The FSDP2 layout is one `CanzonaError` (on every
    rank alike: each built the same layout): it is not a `DistributedOptimizer` subclass, and
    passed over as a foreign optimizer it was wrapped for DDP or checkpointed by accelerate."""
    for _ in range(8):  # a wrapper of a wrapper at most, in practice
        if optimizer is None or isinstance(optimizer, DistributedOptimizer):
            return optimizer
        if isinstance(optimizer, FsdpOptimizer):
            raise CanzonaError(FSDP_LAYOUT_REFUSED)
        optimizer = getattr(optimizer, "optimizer", None)
    return None


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether `a` and `b` name the same memory: `cpu` and `cpu:0` do (yet `.to()` between them
    copies), as do `cuda` and `cuda:<current device>`."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    return a.type == "cpu" or _index(a) == _index(b)


def _index(device: torch.device) -> int:
    if device.index is not None:
        return device.index
    current = getattr(getattr(torch, device.type, None), "current_device", None)
    return int(current()) if current is not None else 0


def check_on_device(params: Iterable[tuple[str, Tensor]], device: torch.device | str) -> None:
    """Every parameter already lives on `device`: a canzona model cannot be moved after its
    optimizer was built (the move would copy the parameters out of the optimizer's buffers)."""
    for name, p in params:
        where = local_tensor(p).device
        if not same_device(where, device):
            raise CanzonaError(f"parameter {name!r} is on {where} but training runs on {device}: move the model "
                               "there before building the DistributedOptimizer (a move afterwards would copy the "
                               "parameters out of the optimizer's buffers)")


def _same_key(value: Tensor) -> tuple:
    """What tells one state entry's tensor from another's on this rank: its local data's address
    and layout (tied weights: one key). An empty part has no address of its own: never taken for
    another entry's."""
    local = local_tensor(value)
    if not local.numel():
        return (id(value),)
    return (local.device, local.dtype, local.data_ptr(), tuple(value.shape), tuple(local.stride()))


def own_storage(state: Mapping[str, Any], keep: bool = True) -> OrderedDict[str, Any]:
    """`state` with every tensor copied to the CPU, into storage of its own; entries that were one
    tensor (tied weights) stay one copy, so that safetensors writers drop the duplicate as usual. A
    DTensor (a TP model's parameter, or one `fully_shard` over one rank) is gathered whole: the files
    hold plain tensors (safetensors cannot take a DTensor). That is a collective over its mesh, in
    the state's order on every rank, as accelerate's `get_state_dict` is called (`save_state`,
    `save_model`). Each whole tensor goes to the CPU as soon as it is gathered (the device holds one
    at a time), and only where `keep` (the ranks that write the files): elsewhere it is dropped at
    once and the result is empty, as torch's full state dict with `cpu_offload` is off rank 0."""
    copies: dict[tuple, Tensor] = {}
    out: OrderedDict[str, Any] = OrderedDict()  # accelerate's writer cleans aliases of OrderedDicts only
    for key, value in state.items():
        if isinstance(value, Tensor):
            same = _same_key(value)
            # every DTensor entry is gathered, tied or not: the same collectives on every rank, where
            # whether two entries are one tensor cannot be told on a rank whose part is empty
            whole = value.full_tensor() if isinstance(value, DTensor) else value
            if not keep:
                continue
            if same not in copies:  # (full_tensor over one rank may be the local view: copy=True)
                copies[same] = whole.detach().to("cpu", copy=True)
            value = copies[same]
        if keep:
            out[key] = value
    return out


def stand_ins(state: Mapping[str, Any]) -> OrderedDict[str, Any]:
    """`state` for a look at its names and which entries are one tensor (safetensors' `load_model`
    takes no more from the model's `state_dict()`): each tensor a one-element CPU tensor of its own,
    tied entries one object (keyed as `own_storage` keys them). No copy and no collective: a
    DTensor is not gathered."""
    made: dict[tuple, Tensor] = {}
    return OrderedDict((key, made.setdefault(_same_key(v), torch.empty(1, dtype=v.dtype)))
                       if isinstance(v, Tensor) else (key, v) for key, v in state.items())


def placed_like(target: Any, value: Any) -> Any:
    """`value`, a whole tensor read from a file, as `target` (a model's DTensor parameter) is laid
    out: this rank's box of it (DTensor's own offset rule) cut where the file was read, and only
    that part moved to the parameter's device, so that loading it copies into the parameter in
    place with no collective; anything else as it is."""
    if isinstance(target, DTensor) and isinstance(value, Tensor) and not isinstance(value, DTensor):
        box = local_box(target)
        part = value[tuple(slice(start, start + size) for start, size in zip(box.start, box.shape))]
        return DTensor.from_local(part.to(local_tensor(target).device), target.device_mesh, target.placements,
                                  run_check=False, shape=target.shape, stride=target.stride())
    return value


def latest_state(checkpoints: str, count: int) -> str:
    """`load_state()` under automatic checkpoint naming: the folder of `checkpoints` with the highest
    number (accelerate's rule) among those holding every canzona optimizer folder written whole.
    `save_state` writes those last: a save killed midway left its folder without them."""
    numbered = []
    for name in os.listdir(checkpoints) if os.path.isdir(checkpoints) else []:
        digits = re.findall(r"([0-9]+)(?=[^/]*$)", name)
        if digits and os.path.isdir(os.path.join(checkpoints, name)):
            numbered.append((int(digits[0]), name))

    def problem(folder: str) -> str | None:
        missing = [i for i in range(count) if not written_whole(os.path.join(folder, f"{OPTIMIZER_DIR}_{i}"))]
        return f"no {OPTIMIZER_DIR}_{missing[0]}/{MANIFEST}" if missing else None

    return latest_whole(checkpoints, numbered, problem, asked="load_state()", killed="a save_state killed midway",
                        none=f"load_state(): no whole checkpoint in {checkpoints}")


def saved_links(folder: str) -> dict[str, Any]:
    """What an optimizer folder's manifest records of its save (`save_state`): `fingerprint`, the
    fingerprint of the model the optimizer stepped (`optimizer_info`); `model`, that model's index
    among the prepared models; `schedulers`, the indices of the schedulers (`scheduler_<k>.bin`)
    that wrapped the optimizer; `folders` and `scheduler_files`, how many optimizer folders and
    `scheduler_<k>.bin` the whole save wrote; `registered`, what each object given to
    `register_for_checkpointing` was (`registered_object`). Each None where not recorded: a folder of an older
    canzona (no manifest, or none of these in it), or one the load's own verification will refuse
    (an unreadable manifest)."""
    try:
        info = read_manifest(folder).info
    except CheckpointError:
        info = {}
    found, model, schedulers = info.get(FINGERPRINT), info.get(MODEL_LINK), info.get(SCHEDULER_LINKS)
    folders, files, registered = info.get(FOLDER_COUNT), info.get(SCHEDULER_COUNT), info.get(REGISTERED)
    return {"fingerprint": found if isinstance(found, str) else None,
            "registered": registered if isinstance(registered, list) and all(isinstance(r, str) for r in registered)
            else None,
            "model": model if type(model) is int else None,
            "folders": folders if type(folders) is int else None,
            "scheduler_files": files if type(files) is int else None,
            "schedulers": schedulers if isinstance(schedulers, list) and all(type(k) is int for k in schedulers)
            else None}


def registered_object(obj: Any, opts: list[DistributedOptimizer], folders: list[int] | None = None) -> str:
    """What `save_state` records of an object given to `register_for_checkpointing` (accelerate's
    `custom_checkpoint_<i>.pkl`, loaded by registration order), and `load_state` compares: its type,
    and for a scheduler the optimizer it steps, a canzona one by its folder (`folders[p]`: the folder
    `opts[p]` reads; at the save its own index) and any other by its type and group count. Two
    schedulers of one type over plain optimizers of one type and group count read the same."""
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.scheduler import AcceleratedScheduler

    if isinstance(obj, AcceleratedScheduler):
        obj = obj.scheduler
    own = canzona_optimizer(obj) if isinstance(obj, (DistributedOptimizer, AcceleratedOptimizer)) else None
    if own is None and isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer):
        stepped = obj.optimizer
        own = canzona_optimizer(stepped)
        if own is None:
            while isinstance(stepped, AcceleratedOptimizer):
                stepped = stepped.optimizer
            return f"{type(obj).__name__} over {type(stepped).__name__} ({len(stepped.param_groups)} group(s))"
        over = " over"
    else:
        over = ""
    if own is None:
        return type(obj).__name__
    p = next((i for i, o in enumerate(opts) if o is own), None)
    where = "not saved" if p is None else f"{OPTIMIZER_DIR}_{p if folders is None else folders[p]}/"
    return f"{type(obj).__name__ + ' over the' if over else 'the'} canzona optimizer ({where})"


def match_folders(mine: list[str | None], saved: list[str | None], my_models: list[int | None] | None = None,
                  saved_models: list[int | None] | None = None) -> list[int]:
    """Which saved optimizer folder each optimizer reads (`mine`: each optimizer's model
    fingerprint; `saved`: each folder's, in folder order): the folder of the same fingerprint.
    Among optimizers of equal fingerprints (two models of one architecture), each first takes the
    folder saved for the same prepared model (`my_models`: the index of the model each optimizer
    steps among the prepared models; `saved_models`: each folder's, recorded at the save), the rest
    those folders in order. Where a fingerprint is missing or has no folder (a folder of an older
    canzona, another model), every optimizer takes its folder by order, as before fingerprints
    were saved, and the load's own checks say what is wrong."""
    my_models = my_models or [None] * len(mine)
    saved_models = saved_models or [None] * len(saved)
    taken: dict[int, int] = {}
    for k, (print_, model) in enumerate(zip(mine, my_models)):  # fingerprint and model link both agree
        found = next((i for i, (s, m) in enumerate(zip(saved, saved_models)) if print_ is not None and s == print_
                      and model is not None and m == model and i not in taken.values()), None)
        if found is not None:
            taken[k] = found
    for k, print_ in enumerate(mine):
        if k in taken:
            continue
        found = next((i for i, s in enumerate(saved) if print_ is not None and s == print_
                      and i not in taken.values()), None)
        if found is None:
            return list(range(len(mine)))
        taken[k] = found
    return [taken[k] for k in range(len(mine))]


def saved_records(where: str, count: int) -> list[dict[str, Any]]:
    """Rank 0's reading of `saved_links` of every optimizer folder the save in `where` wrote: the
    `count` that the optimizers prepared now read, and those beyond them where fewer are prepared than
    were saved (the manifests record how many the save wrote; an older save's: the `count` alone),
    whose scheduler files are no plain scheduler's. A folder the save wrote without its record is
    one `CanzonaError`."""
    saved = [saved_links(os.path.join(where, f"{OPTIMIZER_DIR}_{i}")) for i in range(count)]
    for i in range(count, saved[0]["folders"] or 0):
        saved.append(saved_links(os.path.join(where, f"{OPTIMIZER_DIR}_{i}")))
        if saved[-1]["schedulers"] is None:
            raise CanzonaError(f"{where}: the save wrote {saved[0]['folders']} canzona optimizer folders, and "
                               f"{OPTIMIZER_DIR}_{i}/ records none of its schedulers: load a checkpoint that "
                               "CanzonaAccelerator.save_state wrote whole")
    return saved


def scheduler_order(wraps: list[int | None], folders: list[int],
                    saved: list[list[int] | None], files: int | None = None) -> list[int] | None:
    """Which prepared scheduler takes each saved `scheduler_<k>.bin` (accelerate loads them by
    prepare order): `wraps[j]`, the canzona optimizer (its prepare position) scheduler j wraps, or
    None; `folders[p]`, the folder optimizer p reads; `saved[f]`, the schedulers recorded in folder
    f's manifest as wrapping its optimizer at the save (None: not recorded, an older save), every
    folder the save wrote, those no optimizer reads now too; `files`, how many scheduler files the
    save wrote (None: not recorded). A scheduler of a canzona optimizer takes a file saved with that
    optimizer's folder (several: in order), any other scheduler the files no folder recorded, in
    order. accelerate loads the first `len(wraps)` files, so the schedulers must take exactly those:
    fewer schedulers than files is a load where the files left unread are the last (a dropped
    optimizer's, a plain scheduler's at the end). Returns the schedulers in file order, or None
    where the save has no record (an older canzona's); where it has one and no such assignment
    exists (no file for a scheduler, a scheduler that would need a file past those accelerate
    reads, or a file the save did not write), one `CanzonaError`."""
    if any(s is None for s in saved):
        return None
    recorded = {k for s in saved for k in s}  # type: ignore[union-attr]
    free = iter(k for k in range(len(wraps) if files is None else files) if k not in recorded)
    target: dict[int, int] = {}
    used: dict[int, int] = {}
    for j, p in enumerate(wraps):
        if p is None:
            target[j] = next(free, -1)
            continue
        mine: list[int] = saved[folders[p]]  # type: ignore[assignment]
        nth = used.get(folders[p], 0)
        used[folders[p]] = nth + 1
        target[j] = mine[nth] if nth < len(mine) else -1
    if sorted(target.values()) != list(range(len(wraps))):
        raise CanzonaError(
            f"load_state(): the {len(wraps)} learning-rate scheduler(s) prepared are not those of the save (whose "
            f"optimizer folders {OPTIMIZER_DIR}_<i> record the scheduler files of their optimizers: {list(saved)}"
            f"{'' if files is None else f' of the {files} it wrote'}; "
            f"now over the canzona optimizers: {['-' if p is None else p for p in wraps]}), and accelerate loads "
            "scheduler_<k>.bin into its k-th scheduler, so a scheduler would take another's schedule: prepare the "
            "schedulers of the save, each over its own optimizer")
    return sorted(target, key=target.__getitem__)


def scheduler_file(k: int) -> str:
    """accelerate's name of the k-th scheduler's file (`scheduler.bin`, then `scheduler_<k>.bin`)."""
    return f"{SCHEDULER_NAME}.bin" if k == 0 else f"{SCHEDULER_NAME}_{k}.bin"


# What tells one scheduler's state from another's (an older save's file against the state_dict()
# of the scheduler prepared in its place), in one place. A state's own keys are its public keys but
# these, which any LRScheduler's state may carry whatever its class (torch's base class sets them;
# `verbose` was written up to torch 2.6): two states whose own keys share none are two classes'
# (a LambdaLR's lr_lambdas, a StepLR's step_size and gamma), and so are two whose own keys each
# hold one the other lacks, a torch version's (`VERSION_SCHEDULER_KEYS`) aside: classes sharing a
# generic name (a StepLR's step_size and gamma, a MultiStepLR's milestones and gamma; CyclicLR's
# and ReduceLROnPlateau's mode). A list of the prepared optimizer's group count (one entry per
# group) beside the file's list of another length at the same key is another group count. Nothing
# else contradicts: keys on one side only (one set lazily; an ExponentialLR's gamma beside a
# StepLR's: warned of, not verified) and lists of other lengths (a metric history) load all the
# same (torch's load_state_dict is __dict__.update). Private keys (`_last_lr`, a
# ChainedScheduler's `_schedulers`) come and go between versions: not read.
SHARED_SCHEDULER_KEYS = frozenset({"base_lrs", "last_epoch", "verbose"})
# keys of a class's own that one torch version writes and another not (ReduceLROnPlateau's since 2.6)
VERSION_SCHEDULER_KEYS = frozenset({"default_min_lr"})


def state_shape(state: Any) -> dict[str, int | None] | None:
    """What a scheduler's state dict says of the scheduler: its public keys, each with the length of
    its list where it is one (`SHARED_SCHEDULER_KEYS` says what of it is compared). None: not a
    mapping."""
    if not isinstance(state, Mapping):
        return None
    return {str(k): len(v) if isinstance(v, (list, tuple)) else None
            for k, v in state.items() if not str(k).startswith("_")}


def own_keys(shape: Mapping[str, int | None]) -> set[str]:
    return set(shape) - SHARED_SCHEDULER_KEYS


def one_side_keys(saved: Mapping[str, int | None], now: Mapping[str, int | None]) -> tuple[set[str], set[str]]:
    """The keys of a class's own (a torch version's aside) that the prepared scheduler's state `now`
    holds and the file's `saved` lacks, and those `saved` holds and `now` lacks."""
    mine, theirs = own_keys(saved) - VERSION_SCHEDULER_KEYS, own_keys(now) - VERSION_SCHEDULER_KEYS
    return theirs - mine, mine - theirs


def contradiction(saved: Mapping[str, int | None], now: Mapping[str, int | None], groups: int | None) -> str | None:
    """Why a file's state (`saved`, a `state_shape`) cannot be the state of the scheduler prepared in
    its place (`now`, over an optimizer of `groups` param groups; None: not known), or None
    (`SHARED_SCHEDULER_KEYS` says what counts)."""
    mine, theirs = own_keys(saved), own_keys(now)
    if mine and theirs and not mine & theirs:
        return "another class's: no key of its class's own in common"
    lacking, extra = one_side_keys(saved, now)
    if lacking and extra:
        return (f"another class's: its {', '.join(sorted(extra))} the prepared one's state lacks, and it lacks "
                f"{', '.join(sorted(lacking))}")
    for key in sorted(set(saved) & set(now)):
        if groups is not None and now[key] == groups and saved[key] is not None and saved[key] != groups:
            return f"{saved[key]} group(s) in its {key}, not {groups}"
    return None


def _shape_text(shape: Mapping[str, int | None]) -> str:
    lists = {n for n in shape.values() if n is not None}
    return f"keys {', '.join(sorted(shape)) or 'none public'}" + \
        (f"; {lists.pop()} group(s)" if len(lists) == 1 else "")


def _groups(sched: Any) -> int | None:
    """The group count of the optimizer a prepared scheduler steps (None: none known)."""
    inner = getattr(sched, "scheduler", sched)
    groups = getattr(getattr(inner, "optimizer", None), "param_groups", None)
    return len(groups) if isinstance(groups, list) else None


def check_older_save(where: str, schedulers: list[Any], registered: int, schedulers_recorded: bool,
                     registered_recorded: bool) -> str | None:
    """A save of an older canzona (its manifests record no scheduler of each optimizer, or no
    registered objects): what can be checked of it, on rank 0, before anything is loaded.
    accelerate loads `scheduler_<k>.bin` into its k-th prepared scheduler and `custom_checkpoint_<i>.pkl`
    into its i-th registered object: fewer files than schedulers (or another count of objects than
    the save registered) is one `CanzonaError`, as is a scheduler file whose state is another
    scheduler's (`contradiction`: another class, or another group count). Returns the warning for
    what could not be verified (None: nothing): schedulers whose files read alike (two of one
    class and group count could be swapped), files left unread, objects registered (the save
    records not what each was; the files are pickles, not opened before accelerate loads them)."""
    unverified = []
    if not schedulers_recorded and schedulers:
        files = 0
        while os.path.isfile(os.path.join(where, scheduler_file(files))):
            files += 1
        if files < len(schedulers):
            raise CanzonaError(
                f"load_state(): {len(schedulers)} learning-rate schedulers are prepared, and the save in {where} "
                f"wrote {files} scheduler file(s): accelerate loads scheduler_<k>.bin into its k-th scheduler; "
                "prepare the schedulers of the save, in the order of the save")
        shapes: list[dict | None] = []  # each file's, None where unread (not readable weights-only)
        states = [sched.state_dict() for sched in schedulers]
        nows = [state_shape(state) for state in states]
        for k, sched in enumerate(schedulers):
            try:
                saved = state_shape(torch.load(os.path.join(where, scheduler_file(k)), weights_only=True))
            except Exception:  # noqa: BLE001 - a state torch will not read weights-only: not checked here
                saved = None
            shapes.append(saved)
            why = contradiction(saved, nows[k], _groups(sched)) if saved is not None and nows[k] is not None \
                else None
            if why is not None:
                raise CanzonaError(
                    f"load_state(): {scheduler_file(k)} of the save in {where} holds another scheduler's state "
                    f"({_shape_text(saved)}) than the {type(getattr(sched, 'scheduler', sched)).__name__} prepared "
                    f"as scheduler {k} ({_shape_text(nows[k])}: {why}), and accelerate loads scheduler_<k>.bin "
                    "into its k-th scheduler: prepare the schedulers of the save, in the order of the save")
        # a file is its scheduler's where its own keys meet the scheduler's and contradict every other's
        unread, why_not = [], []
        for k, saved in enumerate(shapes):
            if nows[k] is None:  # the prepared scheduler's own state: nothing to compare the file with
                why_not.append(f"scheduler {k}'s state_dict() is a {type(states[k]).__name__}, no mapping to compare "
                               f"{scheduler_file(k)} with")
            elif saved is None:
                unread.append(scheduler_file(k))
            elif not own_keys(saved) & own_keys(nows[k]):
                why_not.append(f"{scheduler_file(k)} shows no key of a scheduler class's own")
            else:
                lacking, extra = one_side_keys(saved, nows[k])
                if lacking or extra:  # (both: refused above) one class's keys a part of another's, or one set lazily
                    which = f"lacks {', '.join(sorted(lacking))}" if lacking else f"holds {', '.join(sorted(extra))}"
                    why_not.append(f"{scheduler_file(k)} {which} of its class's own, which scheduler {k}'s state "
                                   f"{'holds' if lacking else 'lacks'}: another class's, or a key set lazily")
                also = [j for j, (other, now) in enumerate(zip(schedulers, nows))
                        if j != k and (now is None or contradiction(saved, now, _groups(other)) is None)]
                if also:
                    why_not.append(f"{scheduler_file(k)} could be scheduler {', '.join(map(str, also))}'s too")
        if unread:
            one = len(unread) == 1
            unverified.append(f"what {', '.join(unread)} hold{'s' if one else ''} ({'it' if one else 'they'} could not "
                              f"be read weights-only, and {'is' if one else 'are'} not checked before accelerate loads "
                              f"{'it' if one else 'them'})")
        if why_not:
            unverified.append(f"which scheduler file each scheduler takes ({'; '.join(why_not)})")
        if files > len(schedulers):
            unverified.append(f"that the {files - len(schedulers)} scheduler file(s) left unread are none of "
                              "these schedulers'")
    if not registered_recorded:
        # (counted as accelerate counts them, which refuses another count only after loading the rest)
        saved_objects = sum(1 for n in os.listdir(where) if re.search(r"^custom_checkpoint_\d+\.pkl$", n))
        if saved_objects != registered:
            raise CanzonaError(
                f"load_state(): {registered} object(s) are given to accelerator.register_for_checkpointing, and the "
                f"save in {where} wrote {saved_objects} custom_checkpoint_<i>.pkl: accelerate loads them into the "
                "registered objects by order; register the objects of the save, in the order of the save")
        if registered:
            unverified.append(f"that the {registered} object(s) registered for checkpointing are the save's, in its "
                              "order")
    if not unverified:
        return None
    unrecorded = [what for what, recorded in (("which scheduler file is whose", schedulers_recorded),
                                              ("what each registered object was", registered_recorded))
                  if not recorded]
    return (f"load_state(): {where} was saved by an older canzona, whose manifests do not record "
            f"{' nor '.join(unrecorded)}: could not verify {'; nor '.join(unverified)}. Each takes its position's "
            "file, as accelerate loads them; save again to record them")


POLYNOMIAL_LR_END = 1e-7  # transformers' default lr_end: every polynomial schedule carries one


def floor_ratio(scheduler: Any) -> float | None:
    """The ratio of each group's rate a transformers schedule with a floor ends at (a `LambdaLR`
    of `get_scheduler`'s `cosine_with_min_lr`, `cosine_warmup_with_min_lr`: `min_lr_rate`, which an
    absolute `min_lr` was turned into by dividing it by `optimizer.defaults["lr"]`; `polynomial`:
    `lr_end / lr_init`, `lr_init` being that rate), or None: another schedule, no floor, or
    polynomial's default `lr_end` (1e-7, which every polynomial schedule carries: one given equal to
    it cannot be told from it)."""
    lambdas = getattr(scheduler, "lr_lambdas", None) or [None]
    fn = lambdas[0]
    if not isinstance(fn, functools.partial) or getattr(fn.func, "__module__", "") != "transformers.optimization":
        return None
    kw = fn.keywords
    if "min_lr_rate" in kw:
        ratio = kw["min_lr_rate"]
    elif "lr_end" in kw and kw.get("lr_init") and kw["lr_end"] != POLYNOMIAL_LR_END:
        ratio = kw["lr_end"] / kw["lr_init"]
    else:
        ratio = None
    return float(ratio) if ratio else None


def _kind_rates(base: list[float], opt: DistributedOptimizer) -> tuple[list[float], list[float]]:
    """The distinct rates (`base`: each group's) of the matrix groups and of the AdamW groups, in
    group order, those of 0 left out: a frozen group stays at 0 whatever a schedule's bound or
    floor (0 times any factor), so it is nothing to tell of."""
    rates: dict[Any, list[float]] = {"matrix": [], "adamw": []}
    for r, group in zip(base, opt.param_groups):
        if r > 0 and r not in rates.setdefault(group.get("kind"), []):
            rates[group.get("kind")].append(r)
    return rates["matrix"], rates["adamw"]


def _plateau(scheduler: Any) -> bool:
    """Whether `scheduler` is torch's ReduceLROnPlateau or transformers' GreedyLR, the plateau
    schedulers whose `min_lrs` / `max_lrs` are absolute bounds (others keep such lists too: torch's
    CyclicLR its `max_lrs`). GreedyLR by type where transformers is imported: a GreedyLR comes
    from there, so none exists where it is not."""
    greedy = getattr(sys.modules.get("transformers.optimization"), "GreedyLR", None)
    return isinstance(scheduler, tuple(t for t in (torch.optim.lr_scheduler.ReduceLROnPlateau, greedy)
                                       if isinstance(t, type)))


def _uniform_bound(scheduler: Any, key: str) -> float | None:
    """The one absolute bound (`min_lrs` / `max_lrs`) a plateau scheduler applies to every group, or
    None: bounds that differ per group, or a floor of 0. A list of equal bounds reads as one, for both
    schedulers: GreedyLR keeps no record of whether one number or a list was given (ReduceLROnPlateau
    does, `default_min_lr`, not read, so that both say the same of the same bounds)."""
    bounds = getattr(scheduler, key, None)
    one = bounds[0] if isinstance(bounds, list) and bounds and len(set(map(float, bounds))) == 1 else None
    return float(one) if one else None


def floor_cannot_bind(scheduler: Any, floor: float) -> bool:
    """Whether a plateau scheduler's absolute floor (`min_lr`) is negligible: at or below
    `eps / (1 - factor)`. Both schedulers apply a reduction only where it changes a rate by more
    than `eps`, so a group stops being reduced at about that rate floor or none (1.1e-8 at
    ReduceLROnPlateau's defaults, 2e-7 at GreedyLR's); a floor under it changes where a group stops
    only below about that rate plus `eps`, where the training has stopped anyway (`min_lr=1e-8`
    beside rates of 3e-4 and 0.02), so it cannot bind in practice. Every floor can where `eps` is 0."""
    eps, factor = getattr(scheduler, "eps", None), getattr(scheduler, "factor", None)
    if not eps or factor is None or not 0 <= factor < 1:
        return False
    return floor <= eps / (1 - factor)


def bound_warning(scheduler: Any, opt: DistributedOptimizer) -> str | None:
    """What `prepare` warns of for a plateau scheduler built by the user (torch's ReduceLROnPlateau,
    transformers' GreedyLR) that bounds every group by one absolute rate (`min_lr`, its default too;
    GreedyLR's `max_lr`, its default 1.0 only where not above every rate; a `min_lr` that cannot bind,
    `floor_cannot_bind`, not told of) over a canzona optimizer
    whose rates differ (groups at 0 left out: `_kind_rates`): the rate each kind of
    group stops at, and the per-group lists (which both take) that bound every group at one ratio
    of its own rate. Its `eps` (the smallest change applied, absolute too) stops a reduction only at
    rates below about `eps / (1 - factor)` (1.1e-8 for ReduceLROnPlateau's defaults, 2e-7 for
    GreedyLR's): named only where a group starts there (never reduced at all). None where there is
    nothing to tell."""
    if not _plateau(scheduler):
        return None
    name = type(scheduler).__name__
    low, high = _uniform_bound(scheduler, "min_lrs"), _uniform_bound(scheduler, "max_lrs")
    negligible = low is not None and floor_cannot_bind(scheduler, low)
    if negligible:
        low = None  # no floor of the user's that binds: nothing to tell of it
    base = getattr(scheduler, "_init_lrs", None)
    if not isinstance(base, list) or len(base) != len(opt.param_groups):
        base = [g.get("initial_lr", g["lr"]) for g in opt.param_groups]
    base = [float(r) for r in base]
    default = inspect.signature(type(scheduler)).parameters.get("max_lr")
    if high is not None and default is not None and high == default.default and high > max(base):
        high = None  # GreedyLR's default cap (1.0), above every rate: no bound of the user's to tell of
    if low is None and high is None:
        return None
    matrix, adamw = _kind_rates(base, opt)
    if not matrix or not adamw or len(set(matrix) | set(adamw)) == 1:
        return None

    # a group whose rate min_lr is not below: ReduceLROnPlateau only reduces; GreedyLR raises too
    never = ("are never reduced below their rate (min_lr is not below it): GreedyLR's increases raise them, and "
             f"its reductions bring them back no lower than {low or 0:g}" if hasattr(scheduler, "max_lrs")
             else "are never reduced (min_lr is not below their rate)")

    def stops(kind: list[float], verb: str, theirs: str) -> str:
        if low is None:
            kept = "reach no floor that binds" if negligible else "keep the floors given per group"
            return f"(rate {', '.join(f'{r:g}' for r in kind)}) {kept}"
        parts = [(f"(rate {r:g}) {never}" if low >= r else f"(rate {r:g}) {verb}{low:g} ({low / r:.3g} of {theirs})")
                 for r in kind]
        return ", ".join(parts)

    bounds = " and ".join(f"{k} {v:g}" for k, v in (("min_lr", low), ("max_lr", high)) if v is not None)
    told = (f"this {name} bounds every group's rate by one absolute {bounds}, alike whatever the group's rate: "
            f"the matrix groups {stops(matrix, 'stop at ', 'their rate')}, "
            f"the AdamW groups {stops(adamw, 'at ', 'theirs')}")
    if high is not None:
        told += f"; max_lr {high:g} is {high / max(matrix):.3g} times the matrix rate, {high / max(adamw):.3g} times the AdamW rate"

    def lists(against: float) -> str:
        return " and ".join(f"{k}=[{', '.join(f'{v * r / against:g}' for r in base)}]"
                            for k, v in (("min_lr", low), ("max_lr", high)) if v is not None)

    told += (f". To bound every group at one ratio of its own rate, pass one bound per param group (torch and "
             f"transformers take a list): measured against the AdamW rate ({adamw[0]:g}), {lists(adamw[0])}; "
             f"against the matrix rate ({matrix[0]:g}), {lists(matrix[0])}")
    eps, factor = getattr(scheduler, "eps", None), getattr(scheduler, "factor", None)
    if eps and factor is not None and factor < 1:
        stuck = [(kind, r) for kind, kind_rates in (("matrix", matrix), ("AdamW", adamw)) for r in kind_rates
                 if r * (1 - factor) <= eps]
        if stuck:
            told += (f". Its eps {eps:g} (the smallest change applied, absolute too) leaves the "
                     + ", ".join(f"{kind} groups at {r:g}" for kind, r in stuck)
                     + f" never reduced (a reduction by factor {factor:g} changes them by no more than eps): give "
                     "an eps below the smallest rate's change")
    return told + ". CanzonaTrainer makes these bounds one per group, measured against the AdamW rate " \
        "(learning_rate), itself"


def floor_warning(scheduler: Any, opt: DistributedOptimizer) -> str | None:
    """What `prepare` warns of for a transformers schedule with a floor (`floor_ratio`) over a
    canzona optimizer whose rates differ (every group's: the matrix and AdamW rates): the floors each
    kind of group ends at, and how to set the AdamW groups' own. None where there is nothing to tell."""
    if _plateau(scheduler):
        return bound_warning(scheduler, opt)
    ratio = floor_ratio(scheduler)
    base = getattr(scheduler, "base_lrs", None)
    if ratio is None or not base or len(base) != len(opt.param_groups):
        return None
    matrix, adamw = _kind_rates([float(r) for r in base], opt)
    if not matrix or not adamw or len(set(matrix) | set(adamw)) == 1:
        return None

    def floors(kind: list[float]) -> str:
        return ", ".join(f"{r * ratio:g}" for r in kind)

    defaults = float(opt.defaults.get("lr", matrix[0]))
    named = ", ".join(f"{r:g}" for r in adamw)
    return (f"this transformers schedule ends every group at {ratio:g} of its own rate: the matrix groups at "
            f"{floors(matrix)}, the AdamW groups at {floors(adamw)}. If that ratio was made of an absolute floor "
            f"(min_lr, lr_end), transformers divided it by optimizer.defaults['lr'], which for a canzona "
            f"optimizer is the matrix rate ({defaults:g}), not the AdamW rate ({named}): to end the AdamW groups "
            f"at a floor F (with the matrices at the same ratio of theirs), pass min_lr_rate=F/{adamw[0]:g} (cosine "
            f"schedules) or lr_end=F*{defaults / adamw[0]:g} (polynomial)"
            + (" for the first AdamW rate (one ratio serves every group)" if len(adamw) > 1 else "")
            + "; a min_lr_rate given as advised ends them at the floors above, as meant. CanzonaTrainer measures "
            "min_lr against the AdamW rate (learning_rate) itself")


def _outside_frame() -> int:
    """The `stacklevel` of a warning raised by the caller that points at the first frame outside
    canzona, accelerate and transformers (the user's `prepare` call): `outside_level`."""
    return outside_level(2)


def _as_number(value: Any) -> Any:
    """A clip threshold as a float where it reads as one (a 0-dim tensor, a NumPy scalar, as torch's
    clips take them); anything else as given, for the optimizer's step check to refuse on every rank
    alike (a `float(None)` here raised on the one rank given it, its peers left in the check)."""
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return value

def parameter_list(parameters: Tensor | Iterable[Tensor]) -> list[Tensor]:
    return [parameters] if isinstance(parameters, Tensor) else list(parameters)


def _ids(opt: DistributedOptimizer) -> set[int]:
    return {id(p) for p in opt.params.values()}


class _LoadInPlace(nn.Module):
    """What `load_state` hands accelerate in place of a model whose parameters a canzona optimizer
    holds. safetensors' `load_model` refuses a model whose tensors are views of a larger storage
    (it looks for one covering the whole storage to keep); this stand-in shows it `stand_ins` of the
    model's state (names and ties only: no copy, no gather) and loads into the real parameters in
    place (no `assign`)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._model = [model]  # a list, so that the model is not registered as a submodule

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return stand_ins(self._model[0].state_dict(*args, **kwargs))

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        if assign:
            raise CanzonaError("load_state_dict(assign=True) would take the parameters out of the canzona "
                               "optimizer's buffers: load without assign")
        model = self._model[0]
        own = model.state_dict()  # (the model's DTensors take the file's whole tensors cut to their layout)
        return model.load_state_dict({k: placed_like(own.get(k), v) for k, v in state_dict.items()}, strict=strict)


class CanzonaAccelerator(Accelerator):
    """`accelerate.Accelerator` for models whose parameters a canzona `DistributedOptimizer` holds
    (see the module's docstring). It keeps no state of its own beyond what `prepare` is given, so
    that `CanzonaTrainer` can make the Trainer's accelerator one after the Trainer built it."""

    # --- preparation -------------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        given = [o for o in map(canzona_optimizer, args) if o is not None]
        for obj in args:  # a scheduler accelerate does not prepare (transformers' GreedyLR: no LRScheduler)
            if not isinstance(obj, torch.optim.lr_scheduler.LRScheduler) and hasattr(obj, "min_lrs"):
                self._warn_schedule(obj)
        # prepare_model may run before prepare_optimizer (argument order): it looks here too
        self._canzona_given = given
        try:
            return super().prepare(*args, device_placement=device_placement)
        finally:
            self._canzona_given = []

    def canzona_optimizers(self) -> list[DistributedOptimizer]:
        """The canzona optimizers prepared so far (and those of the `prepare` call under way)."""
        out: list[DistributedOptimizer] = list(getattr(self, "_canzona_given", []))
        for o in getattr(self, "_optimizers", []):
            inner = canzona_optimizer(o)
            if inner is not None and all(inner is not x for x in out):
                out.append(inner)
        return out

    def _holders(self, params: Iterable[Tensor]) -> list[DistributedOptimizer]:
        """The canzona optimizers holding any of `params`."""
        ids = {id(p) for p in params}
        return [o for o in self.canzona_optimizers() if ids & _ids(o)]

    def _check_supported(self) -> None:
        kind = REFUSED_TYPES.get(self.distributed_type)
        if kind is not None:
            raise CanzonaError(f"{kind} is not supported with a canzona DistributedOptimizer, which reduces the "
                               "gradients and shards the optimizer state itself: run accelerate's plain multi-GPU "
                               "(or multi-CPU) data parallelism")
        if self.scaler is not None:
            raise CanzonaError("mixed_precision='fp16' (accelerate's GradScaler) is not supported by CanzonaAccelerator: "
                               "use mixed_precision='bf16' or 'no' (a torch.amp.GradScaler of your own works with "
                               "the DistributedOptimizer itself)")
        if getattr(self, "parallelism_config", None) is not None:
            raise CanzonaError("accelerate's parallelism_config is not supported with a canzona DistributedOptimizer: "
                               "give the optimizer its data- and tensor-parallel groups (group=mesh) instead")

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> nn.Module:
        holders = self._holders(model.parameters())
        if not holders:  # prepare(model) before prepare(optimizer): a live optimizer holding it counts
            live = _holder(dict(enumerate(model.parameters())))
            holders = [live[1]] if live is not None else []
        if not holders:
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        self._check_supported()
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise CanzonaError(DDP_REFUSED)
        held = set().union(*map(_ids, holders))
        loose = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
        if loose:
            raise CanzonaError(f"parameter {loose[0]!r} requires gradients but no canzona optimizer holds it "
                               f"({len(loose)} such): without DDP nothing would reduce its gradient; give every "
                               "trainable parameter to the DistributedOptimizer, or freeze it")
        if self.device_placement if device_placement is None else device_placement:
            for opt in holders:
                check_on_device(opt.params.items(), self.device)
        # the optimizer reduces the gradients (DDP would reduce them again) and holds the parameters
        # (a move would copy them out): autocast and torch.compile are all accelerate adds here
        return super().prepare_model(model, device_placement=False, evaluation_mode=True)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """accelerate's `prepare_scheduler`; a transformers schedule with a floor (`min_lr`, `lr_end`)
        over a canzona optimizer whose matrix and AdamW rates differ is warned of, naming the floor
        each kind of group ends at (`floor_warning`). It is left as built: the schedule holds one
        ratio for every group (an absolute `min_lr` divided by `optimizer.defaults["lr"]`, canzona's
        matrix rate, which cannot be told from a `min_lr_rate` given as such), and the accelerate
        path has no `learning_rate` saying which rate an absolute floor was meant against, so the
        matrix groups end at the `min_lr` given, as transformers documents, and the AdamW groups at
        the same ratio of theirs. (CanzonaTrainer, whose `learning_rate` is the AdamW rate, builds
        its schedule with the floor measured against that rate.)"""
        self._warn_schedule(scheduler)
        return super().prepare_scheduler(scheduler)

    def _warn_schedule(self, scheduler: Any) -> None:
        """`floor_warning` of `scheduler`, once, on the main process, at the user's line."""
        inner = canzona_optimizer(getattr(scheduler, "optimizer", None))
        again = getattr(scheduler, "_is_accelerate_prepared", False) or getattr(scheduler, "_canzona_floor_told", False)
        told = floor_warning(scheduler, inner) if inner is not None and not again else None
        if told is not None:
            with contextlib.suppress(AttributeError):
                scheduler._canzona_floor_told = True  # prepared again: told once
            if self.is_main_process:
                warnings.warn(told, stacklevel=_outside_frame())

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        inner = canzona_optimizer(optimizer)
        if inner is None:
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        self._check_supported()
        ids = _ids(inner)
        for model in self._models:
            if isinstance(model, nn.parallel.DistributedDataParallel) and any(id(p) in ids for p in model.parameters()):
                raise CanzonaError(DDP_REFUSED)
        # its state lives with its parameters already; accelerate's placement would send the whole
        # state through state_dict() (a collective gather) and load_state_dict() for nothing
        return super().prepare_optimizer(optimizer, device_placement=False)

    # --- gradients ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        holders = self._holders(model.parameters())
        if not holders:
            with super().no_sync(model):
                yield
            return
        with contextlib.ExitStack() as stack:
            for opt in holders:
                stack.enter_context(opt.no_sync())
            yield

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        with super().accumulate(*models), self.micro_batch(*models):
            yield

    @contextlib.contextmanager
    def micro_batch(self, *models: nn.Module) -> Iterator[None]:
        """A micro-batch before the last of an optimizer step (`sync_gradients` False) runs under
        the `no_sync()` of the canzona optimizers holding `models`, whatever the accumulation
        plugin's `sync_each_batch` says: that option has DDP reduce each micro-batch (to free
        memory under FSDP), while a canzona optimizer reduces the accumulated gradient once, into
        the buffers it holds anyway; reducing before the last backward would fail it."""
        with contextlib.ExitStack() as stack:
            if not self.sync_gradients:
                for opt in self._holders(p for m in models for p in m.parameters()):
                    stack.enter_context(opt.no_sync())
            yield

    def clip_grad_norm_(self, parameters: Tensor | Iterable[Tensor], max_norm: float, norm_type: float = 2) -> Any:
        params = parameter_list(parameters)
        opt = self._clipped_optimizer(params)
        if opt is None:
            return super().clip_grad_norm_(params, max_norm, norm_type)
        return opt.clip_grad_norm_(_as_number(max_norm), _as_number(norm_type))

    def _clipped_optimizer(self, params: list[Tensor], what: str = "clip_grad_norm_") -> DistributedOptimizer | None:
        """The canzona optimizer holding exactly the trainable ones of `params`, or None if none
        holds any; refuses anything in between (`what`: the clip asked for)."""
        holders = self._holders(params)
        if not holders:
            return None
        how = "max_norm" if what == "clip_grad_norm_" else "clip_value"
        if len(holders) > 1:
            raise CanzonaError(f"{what} got the parameters of several canzona optimizers: clip each with its "
                               f"own optimizer.{what}({how})")
        opt = holders[0]
        given = {id(p) for p in params}
        missing = [n for n, p in opt.params.items() if id(p) not in given]
        if missing:
            whole = "by the global norm of all of them" if what == "clip_grad_norm_" else "all of them together"
            raise CanzonaError(f"{what} got a subset of the canzona optimizer's parameters ({missing[0]!r} "
                               f"and {len(missing) - 1} more are missing): it clips {whole}; pass model.parameters()")
        ids = _ids(opt)
        foreign = [p for p in params if id(p) not in ids and p.requires_grad]
        if foreign:
            raise CanzonaError(f"{what} got {len(foreign)} trainable parameter(s) the canzona optimizer does "
                               f"not hold (the first of shape {tuple(foreign[0].shape)}) with those it holds: clip "
                               "each optimizer's parameters on their own")
        return opt

    def clip_grad_value_(self, parameters: Tensor | Iterable[Tensor], clip_value: float) -> None:
        params = parameter_list(parameters)
        opt = self._clipped_optimizer(params, "clip_grad_value_")
        if opt is None:
            return super().clip_grad_value_(params, clip_value)
        return opt.clip_grad_value_(_as_number(clip_value))

    # --- checkpoints -------------------------------------------------------------------------

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> Any:
        """accelerate's `get_state_dict` (see the module's docstring): on the ranks that write the
        files, each tensor a CPU copy of its own; elsewhere, for a model of plain tensors (ZeRO-1:
        each rank holds every parameter) the parameters themselves, as accelerate gives under DDP
        (no host copy of the whole model on every rank of a node), and for a model of DTensors
        (gathered), or inside `save_state` / `save_model`, nothing."""
        holders = self._holders(model.parameters())
        for opt in holders:  # the step's weights, not an all-gather still landing in them
            opt.wait_params()
        state = super().get_state_dict(model, unwrap=unwrap)
        if state is None or not holders:
            return state
        # only the ranks that write the files keep gathered tensors, or copies for a save (accelerate's `save` rule)
        writes = self.is_local_main_process if self.project_configuration.save_on_each_node else self.is_main_process
        gathered = any(isinstance(v, DTensor) for v in state.values())
        if not (writes or gathered or getattr(self, "_canzona_saving", False)):
            return state
        return own_storage(state, keep=writes)

    @contextlib.contextmanager
    def _saving(self) -> Iterator[None]:
        """accelerate's writers call `get_state_dict` on every rank and write from some: the others
        copy nothing meanwhile."""
        kept, self._canzona_saving = getattr(self, "_canzona_saving", False), True
        try:
            yield
        finally:
            self._canzona_saving = kept

    def save_model(self, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with self._saving():
            return super().save_model(model, *args, **kwargs)

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> Any:
        """accelerate's `save_state`, with each canzona optimizer written sharded (every rank its
        share) to `<dir>/canzona_optimizer_<i>` by `save_checkpoint`: complete (with a manifest
        recording the model's fingerprint, the prepared model it steps and its schedulers' files) or
        not at all, the previous folder of that name kept until the new one is in. An optimizer
        folder of an older canzona there (no manifest) is refused before anything is written
        (`canzona.integrations.optimizer_state`). Every rank."""
        opts = self.canzona_optimizers()
        if not opts:
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        for opt in opts:
            opt.wait_params()  # the model files hold the step's weights, as the optimizer state does
        if output_dir is not None:  # (with automatic naming, accelerate picks a new folder)
            check_replaceable([os.path.join(str(output_dir), f"{OPTIMIZER_DIR}_{i}") for i in range(len(opts))])
        with self._without(opts), self._saving():
            location = super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        # which prepared model each optimizer steps and which schedulers wrap it: what tells the load
        # which folder each takes (models of one architecture) and which scheduler file each scheduler
        models, wraps = self._model_links(opts), self._scheduler_links(opts)
        registered = [registered_object(o, opts) for o in getattr(self, "_custom_objects", [])]
        for i, opt in enumerate(opts):
            links = {MODEL_LINK: models[i], SCHEDULER_LINKS: [k for k, p in enumerate(wraps) if p == i],
                     FOLDER_COUNT: len(opts), SCHEDULER_COUNT: len(wraps), REGISTERED: registered}
            save_optimizer(opt, os.path.join(str(location), f"{OPTIMIZER_DIR}_{i}"),
                           {k: v for k, v in links.items() if v is not None})
        return location

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs: Any) -> None:
        """accelerate's `load_state`; each canzona optimizer reads what its layout needs from
        the `<dir>/canzona_optimizer_<i>` saved for its model (found by the fingerprint in its
        manifest, ties by the prepared model it steps; by order where none is; saved at any DP
        size), each scheduler of one the `scheduler_<k>.bin` saved with that folder, and the models
        whose parameters they hold are loaded in place, from files read to the CPU unless
        `map_location` says otherwise. Every rank."""
        opts = self.canzona_optimizers()
        if not opts:
            return super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        if input_dir is None and self.project_configuration.automatic_checkpoint_naming:
            # accelerate takes the highest number, a killed save's folder too: the latest whole one
            checkpoints = os.path.join(self.project_dir, "checkpoints")
            input_dir = Ranks().together(lambda: latest_state(checkpoints, len(opts)), rank0_only=True)[0]
        found: dict[str, Any] = {}

        def in_place(models: list[nn.Module], where: str) -> None:  # a public pre-hook: sees the resolved dir
            found["dir"] = str(where)

            def folders_there() -> None:  # before anything is loaded; a rank that lacks one fails every rank
                for i in range(len(opts)):
                    if not os.path.isdir(os.path.join(found["dir"], f"{OPTIMIZER_DIR}_{i}")):
                        raise CanzonaError(f"{found['dir']} holds no {OPTIMIZER_DIR}_{i}/: load a checkpoint that "
                                           "CanzonaAccelerator.save_state wrote")

            Ranks().together(folders_there)
            # each optimizer's folder by its model's fingerprint (prepared in another order than at
            # the save), ties by the prepared model it steps, as rank 0 reads the manifests: the same
            # choice on every rank (among the folders this load checked; `saved` holds every folder the
            # save wrote, fewer optimizers prepared now than then too)
            saved = Ranks().together(lambda: saved_records(found["dir"], len(opts)), rank0_only=True)[0]
            mine = saved[:len(opts)]
            found["folders"] = match_folders([fingerprint(o) for o in opts], [s["fingerprint"] for s in mine],
                                             self._model_links(opts), [s["model"] for s in mine])
            # each scheduler of a canzona optimizer the file saved with that optimizer's folder:
            # accelerate loads scheduler_<k>.bin into its k-th scheduler, so they are put in that order;
            # the files of a folder no optimizer reads now are no other scheduler's
            order = scheduler_order(self._scheduler_links(opts), found["folders"], [s["schedulers"] for s in saved],
                                    saved[0]["scheduler_files"])
            Ranks().together(lambda: self._check_registered(saved[0]["registered"], found["folders"], opts))
            if order is None or saved[0]["registered"] is None:  # an older canzona's save: what can be checked
                if order is None:
                    self._check_schedulers_follow(found["folders"], opts)
                told = Ranks().together(lambda: check_older_save(
                    found["dir"], list(self._schedulers), len(getattr(self, "_custom_objects", [])),
                    order is not None, saved[0]["registered"] is not None), rank0_only=True)[0]
                if told is not None and self.is_main_process:
                    warnings.warn(told, stacklevel=outside_level())
            if order is not None and order != sorted(order):
                found["schedulers"] = list(self._schedulers)
                self._schedulers[:] = [found["schedulers"][j] for j in order]  # the list accelerate loads
            for i, model in enumerate(models):
                if self._holders(model.parameters()):
                    models[i] = _LoadInPlace(model)

        for opt in opts:  # a pending parameter all-gather must not land on the weights loaded now
            opt.wait_params()
        # the model files read to the CPU, not whole onto every rank's device (accelerate's default
        # with several devices): the load copies each rank's part into its parameters in place
        load_model_func_kwargs.setdefault("map_location", "cpu")
        handle = self.register_load_state_pre_hook(in_place)
        try:
            with self._without(opts):
                super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        finally:
            handle.remove()
            if "schedulers" in found:
                self._schedulers[:] = found["schedulers"]
        for i, opt in zip(found["folders"], opts):
            load_optimizer(opt, os.path.join(found["dir"], f"{OPTIMIZER_DIR}_{i}"))

    def _model_links(self, opts: list[DistributedOptimizer]) -> list[int | None]:
        """For each of `opts`, the index among the prepared models (`_models`, accelerate's model file
        order) of the first one holding its parameters, or None."""
        models = getattr(self, "_models", [])
        return [next((m for m, model in enumerate(models) if any(id(p) in ids for p in model.parameters())), None)
                for ids in map(_ids, opts)]

    def _scheduler_links(self, opts: list[DistributedOptimizer]) -> list[int | None]:
        """For each prepared scheduler (accelerate's scheduler file order), the index in `opts` of
        the canzona optimizer it wraps, or None: the one its scheduler's own `optimizer` is or wraps
        (the optimizer given, or the `AcceleratedOptimizer` prepare returned); the one accelerate
        linked it to only where the scheduler names none and accelerate linked exactly one (built
        on the prepared optimizer, or prepared before it, accelerate links every optimizer)."""
        out: list[int | None] = []
        for sched in getattr(self, "_schedulers", []):
            inner = getattr(sched, "scheduler", sched)
            given = getattr(inner, "optimizer", None)
            if given is None:
                linked = getattr(sched, "optimizers", [])
                given = linked[0] if len(linked) == 1 else None
            own = canzona_optimizer(given)
            out.append(next((i for i, o in enumerate(opts) if o is own), None) if own is not None else None)
        return out

    def _check_registered(self, saved: list[str] | None, folders: list[int], opts: list[DistributedOptimizer]) -> None:
        """accelerate loads `custom_checkpoint_<i>.pkl` into the i-th object given to
        `register_for_checkpointing`: objects registered now that are not the save's, in its order
        (`saved`, recorded by `save_state`; None: an older canzona's save, not checked), would each
        take another's state (a scheduler another's base rates and step count, silently); fewer or more
        than the save's, the error names the counts. One `CanzonaError` before anything is loaded."""
        now = [registered_object(o, opts, folders) for o in getattr(self, "_custom_objects", [])]
        if saved is None or now == saved:
            return
        listed = f"(saved: {'; '.join(saved) or 'none'}; registered now: {'; '.join(now) or 'none'})"
        if len(now) != len(saved):
            raise CanzonaError(
                f"load_state(): {len(now)} object{' is' if len(now) == 1 else 's are'} given to accelerator."
                f"register_for_checkpointing, the save registered {len(saved) or 'none'} {listed}, and accelerate "
                "loads custom_checkpoint_<i>.pkl into the i-th registered object: register the objects of the "
                "save, in the order of the save")
        swapped = sorted(now) == sorted(saved)
        raise CanzonaError(
            f"load_state(): the objects given to accelerator.register_for_checkpointing are "
            f"{'those of the save in another order' if swapped else 'not those of the save'} {listed}, and accelerate loads "
            "custom_checkpoint_<i>.pkl into the i-th registered object, so each would take another's state: "
            "register the objects of the save, in the order of the save")

    def _check_schedulers_follow(self, folders: list[int], opts: list[DistributedOptimizer]) -> None:
        """accelerate loads `scheduler_<i>.bin` by prepare order: where the canzona optimizers take
        their folders in another order than they were prepared in (`folders`) and the save recorded
        no scheduler of each (an older canzona's save), a scheduler of one of them would take
        another optimizer's schedule (its base rates, its step count) silently. Refused, alike on
        every rank (`folders` is rank 0's choice), before anything is loaded. Not detected: the
        schedulers alone prepared in another order (the optimizers' folders in order), which load
        by position as accelerate loads them; the save records nothing that tells them apart."""
        if folders == list(range(len(opts))) or all(p is None for p in self._scheduler_links(opts)):
            return
        raise CanzonaError(
            f"the canzona optimizers were prepared in another order than at the save (they read the folders "
            f"{OPTIMIZER_DIR}_{folders}), and accelerate loads the learning-rate schedulers by prepare order, so a "
            "scheduler would take another optimizer's schedule (this save records no scheduler of each optimizer: "
            "an older canzona's, or other schedulers than the save's): prepare the optimizers and their schedulers "
            "in the order of the save")

    @contextlib.contextmanager
    def _without(self, opts: list[DistributedOptimizer]) -> Iterator[None]:
        """accelerate's own checkpointing skips the canzona optimizers: it would save their whole
        state from every rank with torch.save."""
        if not isinstance(getattr(self, "_optimizers", None), list):
            raise CanzonaError("this accelerate keeps no Accelerator._optimizers list: canzona.integrations.accelerate "
                               f"was tested with accelerate {TESTED_ACCELERATE}")
        kept, given = self._optimizers, getattr(self, "_canzona_given", [])
        self._optimizers = [o for o in kept if all(canzona_optimizer(o) is not c for c in opts)]
        self._canzona_given = opts  # still known to get_state_dict and the load hook meanwhile
        try:
            yield
        finally:
            self._optimizers, self._canzona_given = kept, given
