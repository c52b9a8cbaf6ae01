"""`CanzonaTrainer`: transformers' `Trainer` training with canzona's `DistributedOptimizer`.

A plain `Trainer` cannot drive a canzona optimizer: its accelerator moves the model to
`cpu:0` (a copy, which takes the parameters out of the optimizer's buffers) and wraps it in DDP
(which would reduce the gradients twice), it clips with `accelerator.clip_grad_norm_` on each
rank's local gradients, and it checkpoints the optimizer with `torch.save(optimizer.state_dict())`
from rank 0 alone, while canzona's `state_dict()` is a collective every rank must join.

    trainer = CanzonaTrainer(model=model, args=TrainingArguments(output_dir="out", max_grad_norm=1.0),
                             train_dataset=data, matrix_config={"lr": 0.02})
    trainer.train()                    # under torchrun, on CPU (gloo) or GPUs (NCCL) alike

`CanzonaTrainer`:
- trains with the `DistributedOptimizer` given in `optimizers=(optimizer, scheduler)` (a scheduler
  over another optimizer, as any in `(None, scheduler)`, is one error at construction), or builds
  one in `create_optimizer` (`build_optimizer`): `matrix_optimizer` (Muon by default) with
  `matrix_config` on the 2-D weights, AdamW with the arguments' `learning_rate`, `adam_beta1`,
  `adam_beta2` and `adam_epsilon` on the rest (an `optim` other than torch's AdamW, e.g. sgd or
  adafactor, is one error; a subclass's own `create_optimizer` ignores it, as the plain Trainer's), `weight_decay` on the Trainer's decay parameters (not on norms and biases; a `weight_decay`
  in `matrix_config` is the matrices' own), the spec read from the module (`spec=` to give one, e.g. in backward
  order), and `optimizer_kwargs` for the rest (`policy`, `plan`, `reduce_scatter`, ...);
- builds the Trainer's schedule (`lr_scheduler_type`) with one factor for every group; an absolute
  floor (`min_lr` of `cosine_with_min_lr` / `cosine_warmup_with_min_lr`, `lr_end` of `polynomial`)
  is measured against the AdamW rate (`learning_rate`), not the matrix rate transformers would read
  from `optimizer.defaults["lr"]`: the AdamW groups end at `min_lr`, the matrices at
  `matrix lr * min_lr / learning_rate` (`create_scheduler`); the absolute bounds of
  `reduce_lr_on_plateau` (`min_lr`) and `greedy` (`min_lr`, `max_lr`, their defaults too), which
  torch and transformers apply to every group alike, likewise: one per group, the given one times
  the group's initial rate over `learning_rate` (`per_group_bounds`; a list is kept as given; a
  checkpoint saved before canzona did so resumes with the uniform bounds in its `scheduler.pt`,
  which ReduceLROnPlateau's and GreedyLR's `load_state_dict` restore: `min_lrs`, `max_lrs`); a
  schedule given in `optimizers=` is left as built, with `CanzonaAccelerator.prepare`'s warning
  where its floor was read of the matrix rate (or, a plateau schedule's, is one absolute bound), as is one a subclass's own `create_scheduler`
  builds without calling this one (not warned of); a callback that sets the groups' rates acts
  as under the plain Trainer (a `LambdaLR` schedule writes them again at its next step, and the
  logged rates are the schedule's; a plateau schedule's bounds stay those computed at its build);
- logs `learning_rate` as transformers does (the first group's rate: the matrices' where the first
  group holds any) and the AdamW groups' rate beside it as `learning_rate_adamw`, taken at the
  same moment; an AdamW group at another base rate than every earlier one (a group of its own
  `lr`) as `learning_rate_adamw_<its index in param_groups>` after it (`_adamw_keys`);
- runs on `CanzonaAccelerator` (`canzona.integrations.accelerate`): no DDP, no copying move,
  accumulation micro-batches under `opt.no_sync()` (with `sync_each_batch` too), `max_grad_norm` clipping by the global norm of
  the reduced gradients (`max_grad_norm=0`: the norm is only measured), which is the `grad_norm`
  the Trainer logs;
- checkpoints (`save_strategy`, `resume_from_checkpoint`) the optimizer sharded: every rank writes
  its share to `<checkpoint>/canzona_optimizer/` (`torch.distributed.checkpoint`, readable at any
  DP size); the scheduler and the model are saved as the Trainer saves them. The folder is written
  by `save_checkpoint` (staging folder, manifest of sha256s, one atomic rename or swap: a step saved
  again and killed midway keeps the previous optimizer state complete) and verified before it is
  read (a damaged or foreign file: one `CheckpointError`, nothing loaded). A folder of an older
  canzona (no manifest) still loads; saving over one is refused with a `CheckpointError` before
  the step's model files are written (`canzona.integrations.optimizer_state`).
  `resume_from_checkpoint=True` resumes from the latest whole `checkpoint-<step>` (optimizer
  folder with its manifest, `scheduler.pt`, `trainer_state.json`; those and the RNG state file
  each rank reads readable: `damaged_file`, `rng_file`), skipping those of saves killed midway or damaged, which transformers
  would pick (and fail on, or restart at step 0 from), with one warning naming the folder taken
  and those skipped; a named folder that is not whole is one `CheckpointError` before anything is
  loaded.

It overrides five private Trainer methods (`_move_model_to_device`, `_save_checkpoint`,
`_save_optimizer_and_scheduler`, `_load_optimizer_and_scheduler`, `_get_learning_rate`) and calls `_get_output_dir`,
each checked at construction; it was tested with transformers 5.23.0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import pickle
import re
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import transformers
from accelerate import Accelerator
from torch import nn
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

try:  # the schedulers whose rates transformers reads from the groups, not get_last_lr()
    from transformers.optimization import GreedyLR
except ImportError:  # an older transformers
    GreedyLR = None

from canzona.errors import CanzonaError, CheckpointError
from canzona.integrations.accelerate import (
    CanzonaAccelerator,
    canzona_optimizer,
    check_on_device,
    floor_warning,
    same_device,
)
from canzona.integrations.optimizer_state import (
    Named,
    check_replaceable,
    latest_whole,
    load_optimizer,
    save_optimizer,
    written_whole,
)
from canzona.optimizers import check_matrix_optimizer
from canzona.runtime.checkpoint_files import MANIFEST, Ranks, first_line
from canzona.runtime.optimizer import DistributedOptimizer
from canzona.runtime.shards import local_tensor
from canzona.spec import ModelSpec

TESTED_TRANSFORMERS = "5.23.0"
# the private Trainer methods CanzonaTrainer overrides, with the parameters it overrides them with
PRIVATE_METHODS = {
    "_move_model_to_device": ("self", "model", "device"),
    "_save_checkpoint": ("self", "model", "trial"),
    "_get_output_dir": ("self", "trial"),  # called, not overridden: where `_save_checkpoint` writes
    "_save_optimizer_and_scheduler": ("self", "output_dir"),
    "_load_optimizer_and_scheduler": ("self", "checkpoint"),
    "_get_learning_rate": ("self",),  # also records the AdamW groups' rate, logged beside it
}
ADAMW_RATE_KEY = "learning_rate_adamw"  # logged beside transformers' learning_rate (the first group's)
OPTIMIZER_DIR = "canzona_optimizer"  # in each checkpoint-<step>/: the sharded optimizer state
SCHEDULER_FILE = "scheduler.pt"  # the Trainer's own name for it
TORCH_OPTIMIZER_FILE = "optimizer.pt"  # what transformers' own Trainer saves a torch optimizer's state as
TRAINER_STATE_FILE = "trainer_state.json"  # the Trainer's own name for it, written last
RNG_STATE_FILE = re.compile(r"^rng_state(_\d+)?\.pth$")  # the Trainer's RNG states (one per rank, or one)
STEP_DIR = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")  # as transformers' get_last_checkpoint
# TrainingArguments.optim values naming torch's AdamW arithmetic (fused, or a device's kernel of it):
# the optimizer CanzonaTrainer builds steps the non-matrix parameters with it
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused", "adamw_torch_xla", "adamw_torch_npu_fused")
# DistributedOptimizer arguments that CanzonaTrainer fills in itself
BUILT_ARGUMENTS = ("self", "params", "spec", "optimizer", "matrix_config", "adamw_config")


def check_trainer(trainer_cls: type = Trainer) -> None:
    """The installed Trainer still has the private methods CanzonaTrainer overrides, with the
    same parameters."""
    for name, params in PRIVATE_METHODS.items():
        method = getattr(trainer_cls, name, None)
        if not callable(method):
            problem = f"has no Trainer.{name}"
        elif tuple(inspect.signature(method).parameters) != params:
            problem = f"changed Trainer.{name}{inspect.signature(method)}"
        else:
            continue
        raise CanzonaError(f"transformers {transformers.__version__} {problem}: canzona.integrations.hf."
                           f"CanzonaTrainer overrides it and was tested with transformers {TESTED_TRANSFORMERS}")


def check_optimizer_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    known = set(inspect.signature(DistributedOptimizer.__init__).parameters) - set(BUILT_ARGUMENTS)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise CanzonaError(f"optimizer_kwargs: DistributedOptimizer has no argument {unknown[0]!r} "
                           f"(it takes {', '.join(sorted(known))})")
    return dict(kwargs)


def check_optim(optim: Any, matrix_optimizer: str) -> None:
    """`TrainingArguments.optim` when CanzonaTrainer builds the optimizer: AdamW is what it steps
    the non-matrix parameters with, so another choice (sgd, adafactor, lion, ...), which the plain
    Trainer would train, is one error rather than silently AdamW."""
    name = str(getattr(optim, "value", optim))
    if name not in ADAMW_OPTIMS:
        raise CanzonaError(f"TrainingArguments(optim={name!r}): CanzonaTrainer builds {matrix_optimizer} on the matrices "
                           f"and torch's AdamW on the rest (optim={ADAMW_OPTIMS[0]!r}, the default "
                           f"{ADAMW_OPTIMS[1]!r} alike), not {name}: leave optim at its default, or pass "
                           "optimizers=(DistributedOptimizer, scheduler)")


def check_not_tensor_parallel(model: Any) -> None:
    """A model sharded by transformers' TP plan (`tp_plan="auto"`, `DistributedConfig(tp_size=N)`)
    takes the Trainer's own tensor-parallel path, which reaches what canzona owns: the Trainer
    builds accelerate's `ParallelismConfig` for it (which accelerate refuses on CPU and canzona's
    accelerator refuses anywhere: its data and loss handling assume the gradients are the Trainer's
    to reduce), all-reduces the gradients of its plain (non-DTensor) parameters in hooks of its
    own, and clips mixed-mesh gradients on `.grad` itself. One error at construction, on every rank
    alike (the model's own attribute), naming what runs such a model instead."""
    tp = getattr(model, "tp_size", None) or 1
    if tp > 1:
        raise CanzonaError(f"CanzonaTrainer does not train a model sharded by transformers' TP plan (tp_size {tp}): "
                           "the Trainer runs it under accelerate's ParallelismConfig, reduces its replicated "
                           "parameters' gradients and clips its gradients itself, where the DistributedOptimizer "
                           "does; train it with DistributedOptimizer(named_parameters(model), "
                           "ModelSpec.from_module(model), group=<a ('dp', 'tp') DeviceMesh>, plan=...) in a loop of "
                           "your own (docs/design.md §2.5)")


def per_group_bounds(kind: Any, kwargs: Any, opt: DistributedOptimizer, base: list[float] | None = None) -> Any:
    """`lr_scheduler_kwargs` for a schedule that bounds each group's rate by an absolute rate
    (`reduce_lr_on_plateau`: torch's ReduceLROnPlateau `min_lr`; `greedy`: GreedyLR's `min_lr`
    and `max_lr`), with each bound measured against the AdamW rate as `CanzonaTrainer.create_scheduler`
    measures the cosine and polynomial floors: a bound `x` becomes one per group, `x` times the
    group's initial rate over the AdamW rate (the AdamW groups at that rate: `x` itself; the
    matrices: `x * matrix lr / learning_rate`; a group of its own rate: by its own). A bound left
    out is its class's default, scaled alike where it is not 0 (GreedyLR's `min_lr` 1e-3 and
    `max_lr` 1.0), so that every group moves by one factor between bounds where the plain Trainer
    would bound torch's AdamW. A list (one per group) is the user's own and kept; other schedules,
    and an AdamW rate of 0, leave `kwargs` as given. `base`: each group's initial rate (default:
    its `initial_lr`, else its rate now), which a schedule built again over rates the first one
    reduced (a second `train()`) must be given."""
    kind = str(getattr(kind, "value", kind))
    cls = {"reduce_lr_on_plateau": torch.optim.lr_scheduler.ReduceLROnPlateau, "greedy": GreedyLR}.get(kind)
    adamw_lr = float(opt.adamw_cfg.lr)
    if cls is None or adamw_lr == 0.0 or not isinstance(kwargs or {}, Mapping):
        return kwargs
    out = dict(kwargs or {})
    defaults = inspect.signature(cls).parameters
    for key in ("min_lr", "max_lr"):
        if key not in defaults:
            continue
        bound = out.get(key, defaults[key].default)
        if isinstance(bound, (list, tuple)) or bound in (None, inspect.Parameter.empty) or bound == 0:
            continue
        rates = base if base is not None else [float(g.get("initial_lr", g["lr"])) for g in opt.param_groups]
        out[key] = [bound * (rate / adamw_lr) for rate in rates]
    return out


def check_given_scheduler(optimizer: Any, scheduler: Any) -> None:
    """`optimizers=(optimizer, scheduler)`: the scheduler must step the optimizer trained with. One
    over another optimizer (always so for `(None, scheduler)`: the one CanzonaTrainer builds does
    not exist yet) would move that one's rates while the model trains at constant ones, and the
    logged rates would be read from its list by this optimizer's group indices. One error at
    construction (on every rank alike: each is given its own pair); a scheduler that names no
    optimizer (not torch's or transformers' kind) is the user's to vouch for."""
    stepped = getattr(scheduler, "optimizer", None)
    if scheduler is None or stepped is None:
        return
    mine = canzona_optimizer(optimizer) if optimizer is not None else None
    if mine is not None and canzona_optimizer(stepped) is mine:
        return
    pair = f"optimizers=({type(optimizer).__name__ if optimizer is not None else None}, {type(scheduler).__name__})"
    if mine is None:
        raise CanzonaError(f"{pair}: the scheduler steps a {type(stepped).__name__}, not the DistributedOptimizer "
                           "CanzonaTrainer trains with (it builds that one when training starts): give no scheduler "
                           "(lr_scheduler_type builds one over it), or pass (DistributedOptimizer, a scheduler of it)")
    raise CanzonaError(f"{pair}: the scheduler steps another optimizer ({type(stepped).__name__}) than the "
                       "DistributedOptimizer given: build the scheduler over that DistributedOptimizer")


def other_backend(folder: str) -> tuple[str, str] | None:
    """The optimizer state another backend of transformers' Trainer saved in `folder`, as `(its
    file or folder, the backend)`: accelerate's FSDP (`optimizer.bin`, `optimizer_<i>.bin`, or a
    sharded `optimizer_<i>/`), DeepSpeed (`global_step<N>/`); None where there is none."""
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if re.fullmatch(r"optimizer(_[0-9]+)?\.bin", name):
            return name, "FSDP"
        if os.path.isdir(os.path.join(folder, name)):
            if re.fullmatch(r"optimizer_[0-9]+", name):
                return f"{name}/", "FSDP"
            if re.fullmatch(r"global_step[0-9]+", name):
                return f"{name}/", "DeepSpeed"
    return None


def checkpoint_problem(folder: str, rng: str = "rng_state.pth", *, files: bool = True) -> str | None:
    """Why `folder` is not a whole CanzonaTrainer checkpoint (None if it is): the Trainer writes the
    model files, then the optimizer folder and the scheduler, and `trainer_state.json` last. A
    folder without canzona's optimizer state but another's (`optimizer.pt`, `other_backend`) is
    named as that one's; with none at all beside `trainer_state.json`, as likely a
    `save_only_model` one (`Named`: no save killed midway). `files`: the files read after the
    optimizer state checked too (`damaged_file`)."""
    if not written_whole(os.path.join(folder, OPTIMIZER_DIR)):
        if os.path.isfile(os.path.join(folder, TORCH_OPTIMIZER_FILE)):
            return Named(f"no {OPTIMIZER_DIR}/ but {TORCH_OPTIMIZER_FILE}: saved by transformers' own Trainer")
        other = other_backend(folder)
        if other is not None:
            return Named(f"no {OPTIMIZER_DIR}/ but {other[0]}: saved by another optimizer/backend ({other[1]})")
        if not os.path.exists(os.path.join(folder, OPTIMIZER_DIR)) and \
                os.path.isfile(os.path.join(folder, TRAINER_STATE_FILE)):  # written last: no killed save
            return Named(f"no {OPTIMIZER_DIR}/ beside {TRAINER_STATE_FILE}: likely saved with save_only_model=True, "
                         "which keeps no optimizer state to resume from")
        return f"no {OPTIMIZER_DIR}/{MANIFEST}"
    for name in (SCHEDULER_FILE, TRAINER_STATE_FILE):
        if not os.path.isfile(os.path.join(folder, name)):
            return f"no {name}"
    try:
        with open(os.path.join(folder, TRAINER_STATE_FILE), encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError) as e:
        return f"an unreadable {TRAINER_STATE_FILE} ({type(e).__name__})"
    return damaged_file(folder, rng) if files else None


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")  # torch's weights-only error sets a phrase in bold
BLOCKED_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")  # the global torch's weights-only load refused


class NotWeightsOnly(CheckpointError):
    """A checkpoint file the Trainer's weights-only load refuses for the objects it holds (a global
    torch blocks): trusted and whole, not damaged, so a resume stops at it (the user allows the
    globals) instead of skipping to an older checkpoint."""


def blocked_globals(path: str, first: str) -> list[str]:
    """The globals of the file at `path` that torch's weights-only load refuses in the current
    context, `first` (the one torch's error named: it names one at a time) first; `[first]` where
    they cannot be listed."""
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 - an older torch, or a file it cannot list: torch's one
        found = []
    return [first] + [g for g in found if g != first]


def read_resumed(folder: str, name: str) -> Any:
    """`name` of checkpoint `folder`, one of the files the resume reads after the optimizer state
    (`scheduler.pt`, an `rng_state*.pth`), read as the Trainer reads it (`torch.load`, weights only;
    the RNG states with numpy's types allowed). One `CheckpointError` naming the file where it
    cannot be read: a file holding objects torch does not load weights-only (a LambdaLR's callable
    object keeping a numpy scalar), which the Trainer would not load either, named with the globals
    torch blocks (every one: torch's error names one at a time), as `NotWeightsOnly`; any other, a
    damaged file."""
    from transformers.trainer_pt_utils import safe_globals

    path = os.path.join(folder, name)
    allowed = safe_globals if RNG_STATE_FILE.match(name) else contextlib.nullcontext
    try:
        with allowed():
            return torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever torch raises for a damaged file: named in one line
        blocked = BLOCKED_GLOBAL.search(str(e)) if isinstance(e, pickle.UnpicklingError) else None
        if blocked is not None:
            with allowed():
                names = ", ".join(blocked_globals(path, blocked.group(1)))
            raise NotWeightsOnly(
                f"{name} holds objects torch does not load weights-only ({names}), as the Trainer loads it: "
                f"if you trust the file, allow them before train() with torch.serialization.add_safe_globals"
                f"([{names}])") from None
        raise CheckpointError(f"{name} cannot be read ({type(e).__name__}: {ANSI_ESCAPE.sub('', first_line(e))}): "
                              "a damaged file") from None


def rng_file(args: Any) -> str:
    """The RNG state file the Trainer reads on this process (`_load_rng_state`): `rng_state.pth` at
    world size 1, else `rng_state_<process_index>.pth` (a missing one only logged)."""
    return "rng_state.pth" if args.world_size <= 1 else f"rng_state_{args.process_index}.pth"


def damaged_file(folder: str, rng: str = "rng_state.pth") -> Named | None:
    """Why the first of the files the resume reads after the optimizer state (`read_resumed`) that
    cannot be read is refused, or None: `scheduler.pt`, and the RNG state file `rng` this process
    reads (`rng_file`; others' are no concern of this run's, and a missing one only logged). Read
    before anything of the checkpoint is loaded: else torch's own error (a traceback) came at the
    Trainer's load, with the model's weights and the optimizer state loaded already. A file torch
    does not load weights-only is no damage: `NotWeightsOnly`, raised (naming `folder`)."""
    for name in (SCHEDULER_FILE, rng):
        if not os.path.isfile(os.path.join(folder, name)):
            if name == rng:
                continue
            return Named(f"{name} missing")  # (on a rank whose disk lacks it: the caller names the rank)
        try:
            read_resumed(folder, name)
        except NotWeightsOnly as e:  # trusted, not damaged: no reason to skip to an older checkpoint
            raise NotWeightsOnly(f"{folder}: {e}") from None
        except CheckpointError as e:
            return Named(str(e))
    return None


def check_whole(folder: str, rng: str = "rng_state.pth") -> None:
    """`resume_from_checkpoint=<folder>`: one `CheckpointError` before anything is loaded if it is
    not a whole checkpoint (a save killed midway, a `save_only_model` one; `rng`: the RNG state
    file this process reads)."""
    if not os.path.isdir(folder):
        return  # the Trainer's own error
    problem = checkpoint_problem(folder, rng)
    if problem is None:
        return
    if not written_whole(os.path.join(folder, OPTIMIZER_DIR)) and \
            os.path.isfile(os.path.join(folder, TORCH_OPTIMIZER_FILE)):
        # (not a save killed midway: a torch optimizer's state, which canzona's cannot take; beside
        # a whole canzona_optimizer/, optimizer.pt is an earlier plain Trainer's, and the save killed)
        raise CheckpointError(f"{folder} is not a CanzonaTrainer checkpoint ({problem} with a torch optimizer, whose "
                              "state a canzona optimizer cannot resume from): to start from its weights, load the "
                              "model from it (from_pretrained) and train without resume_from_checkpoint")
    if not written_whole(os.path.join(folder, OPTIMIZER_DIR)) and other_backend(folder) is not None:
        raise CheckpointError(f"{folder} is not a CanzonaTrainer checkpoint ({problem}, whose optimizer state a "
                              "canzona optimizer cannot resume from): train without resume_from_checkpoint")
    why = "" if isinstance(problem, Named) else ": a save killed midway, or save_only_model=True"
    raise CheckpointError(f"{folder} is not a whole CanzonaTrainer checkpoint ({problem}{why}): resume from another, "
                          "or resume_from_checkpoint=True for the latest whole one")


def latest_checkpoint(output_dir: str, rng: str = "rng_state.pth") -> str:
    """`resume_from_checkpoint=True`: the `checkpoint-<step>` of `output_dir` with the highest step
    among the whole ones (a save killed midway leaves its folder without trainer_state.json or
    without the optimizer state; transformers would pick it and fail, or start again at step 0).
    Collective: rank 0 lists the folders, and of each, newest first, every rank checks the files it
    reads itself (`rng`: its RNG state file, `scheduler.pt`; rank 0 the rest), agreed on every rank,
    so that all take the same folder (the Trainer writes the RNG files per rank without a barrier: a
    save killed midway may leave one rank's damaged). Rank 0 warns of the folders skipped, naming
    the rank whose file was refused."""
    ranks = Ranks()

    def listed() -> list[tuple[int, str]]:
        names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
        return [(int(m.group(1)), name) for name in names
                if (m := STEP_DIR.match(name)) and os.path.isdir(os.path.join(output_dir, name))]

    def problem(folder: str) -> str | None:
        def mine() -> str | None:
            if ranks.rank == 0:
                found = checkpoint_problem(folder, rng, files=False)
                if found is not None:
                    return found
            elif not os.path.isdir(folder):
                return Named(f"not on rank {ranks.rank}'s disk")
            found = damaged_file(folder, rng)
            return Named(f"rank {ranks.rank}: {found}") if found is not None and ranks.world > 1 else found

        return next((found for found in ranks.together(mine) if found is not None), None)

    steps = ranks.together(listed, rank0_only=True)[0]
    with warnings.catch_warnings():
        if ranks.rank != 0:
            warnings.simplefilter("ignore")  # said once, by rank 0
        return latest_whole(output_dir, steps, problem,
                            asked="resume_from_checkpoint=True",
                            killed="a save killed midway",
                            none=f"resume_from_checkpoint=True: no checkpoint-<step> folder in {output_dir}")


def _gives_weight_decay(matrix_config: Any) -> bool:
    """Whether `matrix_config` states the matrices' weight decay: a mapping with the key, or a
    config object whose `weight_decay` is off its class's default. An object states every field, so
    its default cannot tell a decay the user chose from one left alone: there the Trainer's
    `weight_decay` decides, as for a mapping without the key (`MuonConfig(lr=0.02)` beside
    `TrainingArguments(weight_decay=0.0)` would otherwise decay the matrices at MuonConfig's 0.1)."""
    if matrix_config is None:
        return False
    if isinstance(matrix_config, Mapping):
        return "weight_decay" in matrix_config
    if not dataclasses.is_dataclass(matrix_config):
        return False  # not a config: the optimizer's own check says so
    default = next((f.default for f in dataclasses.fields(matrix_config) if f.name == "weight_decay"), None)
    return getattr(matrix_config, "weight_decay", default) != default


def _unread_decay_warning(matrix_config: Any, trainer_decay: float) -> str | None:
    """What a config object whose `weight_decay` is its class's default, beside the Trainer's other
    `weight_decay`, is told (None: nothing to tell): that default reads as unset
    (`_gives_weight_decay`), so a user who set it on purpose would see their matrices decay at the
    Trainer's value, silently."""
    if not dataclasses.is_dataclass(matrix_config) or not hasattr(matrix_config, "weight_decay") or \
            _gives_weight_decay(matrix_config):
        return None
    default = matrix_config.weight_decay
    if default == trainer_decay:
        return None
    name = type(matrix_config).__name__
    return (f"matrix_config's weight_decay {default} is {name}'s default, which CanzonaTrainer takes as unset: the "
            f"matrices decay at TrainingArguments.weight_decay {trainer_decay}; to decay them at {default}, give "
            f"matrix_config as a mapping with 'weight_decay' (or set TrainingArguments.weight_decay)")


class CanzonaTrainer(Trainer):
    """`transformers.Trainer` whose optimizer is a canzona `DistributedOptimizer` (see the
    module's docstring). Takes every `Trainer` argument, plus:

    `matrix_optimizer`: muon | soap | shampoo, for the optimizer built when none is given;
    `matrix_config`: its configuration (a mapping or a config object; e.g. `{"lr": 0.02}`);
    `spec`: the `ModelSpec` to build it with (default: `ModelSpec.from_module(model)`);
    `optimizer_kwargs`: further `DistributedOptimizer` arguments (`policy`, `plan`, ...)."""

    def __init__(self, *args: Any, matrix_optimizer: str = "muon", matrix_config: Any = None,
                 spec: ModelSpec | None = None, optimizer_kwargs: Mapping[str, Any] | None = None,
                 **kwargs: Any) -> None:
        check_trainer()
        given = inspect.signature(Trainer.__init__).bind(None, *args, **kwargs).arguments
        optimizer, scheduler = given.get("optimizers") or (None, None)
        if optimizer is not None and canzona_optimizer(optimizer) is None:
            raise CanzonaError(f"CanzonaTrainer trains with a canzona DistributedOptimizer, but optimizers= holds a "
                               f"{type(optimizer).__name__}: pass (DistributedOptimizer, scheduler), or no optimizer to "
                               "have one built from the TrainingArguments")
        check_given_scheduler(optimizer, scheduler)
        if scheduler is not None and canzona_optimizer(optimizer) is not None:
            # the Trainer does not `prepare` a given scheduler: the accelerate path's warning, here
            told = floor_warning(scheduler, canzona_optimizer(optimizer))
            # once a job, as accelerate's prepare warns (its main process: global rank 0)
            if told is not None and (not dist.is_initialized() or dist.get_rank() == 0):
                warnings.warn(f"the scheduler given in optimizers=: {told} when it builds the schedule "
                              "(lr_scheduler_type, lr_scheduler_kwargs)", stacklevel=2)
        if given.get("optimizer_cls_and_kwargs") is not None:
            raise CanzonaError("CanzonaTrainer does not take optimizer_cls_and_kwargs: it builds a DistributedOptimizer "
                               "(matrix_optimizer=, matrix_config=, optimizer_kwargs=) or takes one in optimizers=")
        check_not_tensor_parallel(given.get("model"))  # a model_init= one: `call_model_init`
        # the Trainer's constructor moves the model (_move_model_to_device) before it stores the
        # optimizer: what was given must be known by then
        self._given_optimizer = canzona_optimizer(optimizer)
        self.matrix_optimizer = check_matrix_optimizer(matrix_optimizer)
        self.matrix_config = matrix_config
        self.canzona_spec = spec
        self.optimizer_kwargs = check_optimizer_kwargs(optimizer_kwargs or {})
        super().__init__(*args, **kwargs)
        # early, where the optimizer will be CanzonaTrainer's own build; a given one, or a subclass's
        # own create_optimizer / build_optimizer, ignores `optim` (as the plain Trainer's does)
        builds = all(getattr(type(self), m) is getattr(CanzonaTrainer, m) for m in ("create_optimizer", "build_optimizer"))
        if self._given_optimizer is None and builds:
            check_optim(self.args.optim, self.matrix_optimizer)

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """`Trainer.call_model_init`, its model checked as a `model=` one is: the Trainer calls it
        in its constructor and again at the start of `train()`, past the constructor's check (a
        transformers-TP model went on into training, failing in its first step's backward)."""
        model = super().call_model_init(trial)
        check_not_tensor_parallel(model)
        return model

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """`Trainer.train`; `resume_from_checkpoint=True` resumes from the latest whole checkpoint of
        `output_dir`, skipping the folders of saves killed midway (`latest_checkpoint`: the same on
        every rank; none: one `CheckpointError` on every rank). The RNG state file each rank reads
        (`rng_file`) is checked by that rank, agreed on every rank: in the search, or in the folder
        named (a damaged one is one `CheckpointError` on every rank). Every
        rank joins the check whatever its own disk shows: a folder missing on some rank (one disk
        per node) is one error on every rank, naming the rank."""
        rng = rng_file(self.args)
        if isinstance(resume_from_checkpoint, bool) and resume_from_checkpoint:
            resume_from_checkpoint = latest_checkpoint(self.args.output_dir, rng)  # (every rank's files checked)
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
            path = os.fspath(resume_from_checkpoint)
            ranks = Ranks()

            def own_files() -> None:
                # every rank joins, whatever it sees: a folder on rank 0's disk but not on another
                # rank's (one disk per node) is one error on every rank, not rank 0 left waiting
                if not os.path.isdir(path):
                    raise CheckpointError(f"{path}: no such folder")  # (the rank named where others have it)
                if ranks.rank == 0:
                    check_whole(path, rng)
                else:  # (rank 0's own files: in check_whole)
                    problem = damaged_file(path, rng)
                    if problem is not None:
                        raise CheckpointError(f"{path}: {problem}")

            ranks.together(own_files)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    # --- the accelerator and the model's place ----------------------------------------------

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if isinstance(self.accelerator, CanzonaAccelerator):
            return
        if type(self.accelerator) is not Accelerator:
            raise CanzonaError(f"the Trainer built a {type(self.accelerator).__name__}, not an accelerate.Accelerator: "
                               f"CanzonaTrainer was tested with transformers {TESTED_TRANSFORMERS}")
        # CanzonaAccelerator adds behaviour and no state, so the Trainer's accelerator, built with
        # all of the Trainer's arguments, can simply become one
        self.accelerator.__class__ = CanzonaAccelerator

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        params = list(model.parameters())
        if params and all(same_device(local_tensor(p).device, device) for p in params):
            return  # there already (cpu is cpu:0): .to() would copy every parameter
        if self._given_optimizer is not None:
            check_on_device(self._given_optimizer.params.items(), device)
        super()._move_model_to_device(model, device)

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> Any:
        # the Trainer enters accelerator.no_sync itself for each micro-batch before the last, but
        # not when the accumulation plugin says sync_each_batch: the canzona optimizer still
        # reduces the accumulated gradient once
        each = self.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False)
        with self.accelerator.micro_batch(model) if each else contextlib.nullcontext():
            return super().training_step(model, inputs, num_items_in_batch)

    # --- the optimizer -----------------------------------------------------------------------

    def create_optimizer(self, model: nn.Module | None = None) -> Any:
        if self.optimizer is None:
            self.optimizer = self.build_optimizer(self.model if model is None else model)
        return self.optimizer

    def build_optimizer(self, model: nn.Module) -> DistributedOptimizer:
        """The optimizer trained with when none is given: the matrix optimizer on the 2-D weights,
        AdamW from the TrainingArguments on the rest; weight decay as the Trainer applies it."""
        from canzona.runtime.modules import named_parameters

        check_optim(self.args.optim, self.matrix_optimizer)  # also reached through a subclass's create_optimizer
        if not (dist.is_available() and dist.is_initialized()):
            raise CanzonaError("CanzonaTrainer needs torch.distributed initialised (the DistributedOptimizer's process "
                               "group), and a plain `python script.py` run leaves it not: launch with torchrun "
                               "--nproc-per-node N (1 for one process; the TrainingArguments then set the group up), or "
                               "call torch.distributed.init_process_group('gloo') before training")
        args = self.args
        decay_names = set(self.get_decay_parameter_names(model))
        decay = {id(p) for n, p in model.named_parameters() if n in decay_names}
        pairs = list(named_parameters(model))
        groups = [{"params": [(n, p) for n, p in pairs if id(p) in decay], "weight_decay": args.weight_decay},
                  {"params": [(n, p) for n, p in pairs if id(p) not in decay], "weight_decay": 0.0}]
        adamw = {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}
        unread = _unread_decay_warning(self.matrix_config, args.weight_decay)
        if unread is not None:
            warnings.warn(unread, stacklevel=2)
        if _gives_weight_decay(self.matrix_config):
            # the matrices decay as matrix_config says, which a group override would replace (for
            # both kinds): the Trainer's weight decay goes to the other decay parameters by AdamW's config
            del groups[0]["weight_decay"]
            adamw["weight_decay"] = args.weight_decay
        spec = self.canzona_spec if self.canzona_spec is not None else ModelSpec.from_module(model)
        return DistributedOptimizer([g for g in groups if g["params"]], spec, self.matrix_optimizer,
                                    self.matrix_config, adamw, **self.optimizer_kwargs)

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """`Trainer.create_scheduler`, with a schedule's absolute floor measured against the AdamW
        rate. transformers' `cosine_with_min_lr` and `cosine_warmup_with_min_lr` (`min_lr`) and
        `polynomial` (`lr_end`) turn it into a ratio of `optimizer.defaults["lr"]`, which for a
        canzona optimizer is the matrix rate: the AdamW groups would bottom out at
        `learning_rate * min_lr / matrix lr`. Here the ratio is taken of the optimizer's AdamW rate
        (the `learning_rate` it was built with; a given optimizer's own `adamw_config` lr), so the
        AdamW groups follow, bit for bit, what the plain Trainer gives torch's AdamW at that rate
        (floor `min_lr`), and the matrix groups the same factor of their rate (floor
        `matrix lr * min_lr / learning_rate`). One factor for every group keeps the matrix rate's
        ratio to the AdamW rate, which is what the two rates were tuned as; the `min_lr` named in
        the arguments is a rate of `learning_rate`, whose parameters the plain Trainer would step. The
        plateau schedules' absolute bounds (`reduce_lr_on_plateau`, `greedy`) become one per group
        by the same rule (`per_group_bounds`)."""
        opt = canzona_optimizer(self.optimizer if optimizer is None else optimizer)
        if self.lr_scheduler is not None or opt is None or self._group_index(opt, "adamw") is None:
            # (no AdamW group: the rate that would set the floor steps nothing; the matrix rate does)
            return super().create_scheduler(num_training_steps, optimizer)
        kept, kept_kwargs = opt.defaults["lr"], self.args.lr_scheduler_kwargs
        cached = getattr(self, "_base_rates_of", None)
        if cached is None or cached[0]() is not opt:  # each group's rate before any schedule of this trainer's
            # (a weak reference: an optimizer transformers drops, as between hyperparameter_search
            # trials, is freed with its state and the previous model's parameters)
            cached = self._base_rates_of = (weakref.ref(opt), [float(g.get("initial_lr", g["lr"]))
                                                                for g in opt.param_groups])
        bounds = per_group_bounds(self.args.lr_scheduler_type, kept_kwargs, opt, cached[1])  # before the swap
        opt.defaults["lr"] = opt.adamw_cfg.lr  # read while transformers builds the schedule only
        self.args.lr_scheduler_kwargs = bounds
        try:
            return super().create_scheduler(num_training_steps, optimizer)
        finally:
            opt.defaults["lr"] = kept
            self.args.lr_scheduler_kwargs = kept_kwargs

    # --- the logged learning rates --------------------------------------------------------------

    def _get_learning_rate(self) -> float:
        """`Trainer._get_learning_rate` (the first group's rate, which transformers logs as
        `learning_rate`), recording the AdamW groups' rates at the same moment: the training loop
        takes it before the scheduler steps, so the rates logged belong to one step."""
        rate = super()._get_learning_rate()
        self._adamw_rates = [(key, self._group_rate(index)) for key, index in self._adamw_keys()]
        return rate

    def _adamw_keys(self) -> list[tuple[str, int]]:
        """The logged key of each AdamW group that has one: the first AdamW group's rate is
        `learning_rate_adamw`; each later one at a base rate no earlier AdamW group has (a group of
        its own `lr`) `learning_rate_adamw_<its index in param_groups>` (canzona's groups carry no
        names); groups at an earlier one's rate (the Trainer's no-decay group) add none. Fixed per
        optimizer by the base rates (those `create_scheduler` built the schedule over, a given
        GreedyLR's initial ones, else `initial_lr`, which a schedule sets, else the rate as first
        read), so that every step logs the same keys, a warm-up's 0 and a resume's loaded rates included."""
        opt = canzona_optimizer(self.optimizer)
        if opt is None:
            return []
        cached = getattr(self, "_adamw_keys_of", None)
        if cached is not None and cached[0]() is opt:
            return cached[1]
        # the rates the schedule was built over: a resume loads the reached rates after the build,
        # and a plateau schedule sets no initial_lr (this trainer's: the base rates create_scheduler
        # kept; a given GreedyLR: its _init_lrs)
        built = getattr(self, "_base_rates_of", None)
        built = built[1] if built is not None and built[0]() is opt else getattr(self.lr_scheduler, "_init_lrs", None)
        if not isinstance(built, list) or len(built) != len(opt.param_groups):
            built = None
        keys, seen = [], []
        for index, g in enumerate(opt.param_groups):
            if g.get("kind") != "adamw":
                continue
            base = built[index] if built is not None else g.get("initial_lr", g["lr"])
            base = float(base.item() if torch.is_tensor(base) else base)
            if base in seen:
                continue
            keys.append((ADAMW_RATE_KEY if not seen else f"{ADAMW_RATE_KEY}_{index}", index))
            seen.append(base)
        self._adamw_keys_of = (weakref.ref(opt), keys)  # (weak: see create_scheduler)
        return keys

    @staticmethod
    def _group_index(opt: DistributedOptimizer, kind: str) -> int | None:
        """The index of `opt`'s first group of `kind`; None where it has none."""
        return next((i for i, g in enumerate(opt.param_groups) if g.get("kind") == kind), None)

    def _group_rate(self, index: int) -> float:
        """The rate of the canzona optimizer's group `index`, read as transformers reads the first
        group's (the scheduler's last rates; a plateau scheduler's group itself)."""
        opt = canzona_optimizer(self.optimizer)
        plateau = tuple(t for t in (torch.optim.lr_scheduler.ReduceLROnPlateau, GreedyLR) if t is not None)
        if self.lr_scheduler is None or isinstance(self.lr_scheduler, plateau):
            rate = opt.param_groups[index]["lr"]
        else:
            rate = self.lr_scheduler.get_last_lr()[index]
        return rate.item() if torch.is_tensor(rate) else rate

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """`Trainer.log`, with the AdamW rates recorded with transformers' `learning_rate` right
        after it (`learning_rate_adamw`, then any `learning_rate_adamw_<index>`; once: a later
        `learning_rate` of the user's gets none)."""
        adamw = [(k, v) for k, v in getattr(self, "_adamw_rates", None) or () if k not in logs]
        if "learning_rate" in logs and adamw:
            items = list(logs.items())
            at = [k for k, _ in items].index("learning_rate") + 1
            logs.clear()
            logs.update(items[:at] + adamw + items[at:])
            self._adamw_rates = None
        super().log(logs, *args, **kwargs)

    def distributed_optimizer(self) -> DistributedOptimizer:
        """The canzona optimizer trained with (the Trainer's `optimizer` wraps it)."""
        opt = canzona_optimizer(self.optimizer)
        if opt is None:
            raise CanzonaError("CanzonaTrainer has no DistributedOptimizer yet: it is built when training starts")
        return opt

    # --- checkpoints -------------------------------------------------------------------------

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        # refuse an older in-place optimizer folder where this step's checkpoint goes before the
        # Trainer writes its model files there (the folder name is the Trainer's own rule)
        run_dir = self._get_output_dir(trial=trial)
        step_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        check_replaceable([os.path.join(step_dir, OPTIMIZER_DIR)])
        super()._save_checkpoint(model, trial)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # every rank writes its share (the Trainer saves optimizer.state_dict() from one rank, and
        # canzona's state_dict() is a collective the others would never join), complete or not at
        # all: a step saved again keeps the previous folder until the new one is in
        folder = os.path.join(output_dir, OPTIMIZER_DIR)
        try:
            check_replaceable([folder])
        except CheckpointError as e:  # reached another way than `_save_checkpoint`: the model files are written
            raise CheckpointError(f"{e}; {output_dir} now holds this step's model files beside that older "
                                  "optimizer state: do not resume from it") from None
        save_optimizer(self.distributed_optimizer(), folder)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        state = os.path.join(checkpoint, OPTIMIZER_DIR)
        scheduler = os.path.join(checkpoint, SCHEDULER_FILE)
        # read before the optimizer state is loaded (`train` checked it on rank 0 already): a file
        # this rank lacks or cannot read is one error on every rank, nothing loaded
        read: dict[str, Any] = {}

        def read_scheduler() -> None:
            for path, what in ((state, f"{OPTIMIZER_DIR}/"), (scheduler, SCHEDULER_FILE)):
                if not os.path.exists(path):
                    raise CanzonaError(f"{checkpoint} holds no {what}: resume from a checkpoint that CanzonaTrainer "
                                       "saved")
            try:
                read["state"] = read_resumed(checkpoint, SCHEDULER_FILE)
            except CheckpointError as e:
                raise CheckpointError(f"{checkpoint}: {e}") from None

        Ranks().together(read_scheduler)
        load_optimizer(self.distributed_optimizer(), state)
        self.lr_scheduler.load_state_dict(read["state"])
