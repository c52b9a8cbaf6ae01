"""Checkpoints of `DistributedOptimizer` that load at any DP x TP layout (docs/design.md §8.4).

The layout-independent form (`gather_state` / `load_state`) holds full tensors, identical on every
rank, in torch.optim's layout, so that torch's own tools take it (`torch.save`,
`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` / `set_optimizer_state_dict`):
`state` by parameter index (the order of the parameters in `param_groups`), each group with its
hyper-parameters, `params` (the indices) and canzona's header (format, model, optimizer and
configurations, as JSON: small, whatever the model), where torch's tools carry it along, and the
groups' `param_names` once at the top (torch's tools drop it and name the members in `params`:
`group_names`). No group key grows with the model: torch's `flatten_optimizer_state_dict` writes
each once per parameter. Every parameter has an entry, with every field its optimizer's state
will have: those that never stepped hold zeros marked `canzona_stepped: False`, so that a state
dict taken from a fresh optimizer is a complete template for `torch.distributed.checkpoint.load`
to fill. Loading maps entries to parameters by position and checks the names. Versions 2 (by
name) and 3 (names and shapes in every group) still load.

Where the full tensors come from:
- a matrix's optimizer state is full-matrix already (it lives on the matrix's host) and is taken
  from the lowest DP rank that computes it, from its host TP rank;
- fp32 master weights of matrices are per TP shard (every TP rank of the owning DP rank updates its
  shard) and are stitched along `tp_dim`;
- AdamW state and masters are per (TP shard, DP slice of the flat AdamW buffer; under an
  elementwise optimizer also DP piece of a bucket, `DistributedOptimizer.adamw_parts`) and are
  stitched back: pieces into shards, shards along `tp_dim` (a TP-replicated parameter from TP rank 0).
Loading cuts each full tensor to what this rank's layout holds. The checkpoint records which model
it belongs to; a checkpoint of another model or optimizer is refused with one line.

The sharded form (`sharded_state` / `load_sharded`) goes through `torch.distributed.checkpoint`:
each rank writes only what it holds (the matrix states it hosts first, its pieces of shards), keyed
so that any layout can find what it needs. At the same TP size a rank reads only the pieces that
overlap its own; at another TP size it reads every piece of the parameters it needs. Its
metadata holds the weights' witness (`take_witness`: a few elements of every parameter, exact, by
global index), which `load_sharded(check_weights=True)` compares with the model's weights where the
checkpoint has no masters to compare (`check_weights_match`), at any layout; a checkpoint of an
older canzona has none and still loads. The layout-independent form carries the same witness in
each entry (`WITNESS_FIELD`); `load_state_dict`, and `load_sharded` without `check_weights`, leave it
for the first step after them to check (`check_loaded_weights`: the model may be loaded after the
optimizer, as torch's `set_state_dict` does), of the parameters whose state stepped alone
(`witness_to_check`: a fresh optimizer's state, loaded to reset it, goes with any weights).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import warnings
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, fields, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
from torch import Tensor

from canzona.cost import state_difference
from canzona.errors import CanzonaError, CheckpointError, PlanError, SpecError
from canzona.optimizers import check_config, matrix_config_json, matrix_optimizer
from canzona.runtime.groups import config_value, group_matrices
from canzona.runtime.kernels import adamw_state, initial_state, update_target
from canzona.runtime.mesh import DP, TP
from canzona.runtime.modules import canonical_name
from canzona.runtime.nonfinite import nonfinite_state_error
from canzona.runtime.shards import local_tensor, shard_of, unshard
from canzona.spec import STACK_CLOSE, STACK_OPEN, parametrized_routing, stacked_matrices
from canzona.tp import EVERY_RANK

if TYPE_CHECKING:
    from canzona.plan import Plan
    from canzona.runtime.buffers import Piece
    from canzona.runtime.comm import Comm
    from canzona.runtime.mesh import Mesh
    from canzona.spec import ModelSpec
    from canzona.step_policies import StepPolicy
    from canzona.step_schedule import TPSchedule


class Described(Protocol):
    """What the layout-independent form reads of any canzona optimizer, whatever its layout
    (`DistributedOptimizer`'s ZeRO-1 layout, `canzona.runtime.fsdp.FsdpOptimizer`'s FSDP2 one):
    the model, the optimizer and its configurations (the header, the checks), the parameters and
    groups (torch.optim's layout), and the dtype and initial form of the state (the templates).
    The layout's own module gathers the full tensors (`full_state` takes them by name) and cuts
    them (`read_state` / `restore_settings` give them by name)."""

    spec: ModelSpec
    optimizer: str  # the matrix optimizer's name
    matrix_cfg: Any
    adamw_cfg: Any
    params: dict[str, Tensor]  # this rank's parameters, by name (the tensors in `param_groups`)
    param_groups: list[dict[str, Any]]
    master_weights: bool
    timeout_s: float  # how long its collective calls wait for the other ranks
    # the witness of the weights a state loaded unchecked (`load_state_dict`, `load_sharded` without
    # `check_weights`) was saved with, checked at the next step (`check_loaded_weights`)
    loaded_witness: dict[str, Any] | None

    def state_dtype(self, name: str) -> torch.dtype: ...

    def group_config(self, g: int) -> Any: ...


class Checkpointable(Described, Protocol):
    """What this module reads and writes of an optimizer in the ZeRO-1 layout, all of it public:
    `DistributedOptimizer` is one (this module never imports it). Beyond `Described`: the plan,
    policy and schedule, and the mesh: this rank's place (its dp and tp ranks and sizes) and the
    communicators a layout-independent `state_dict()` gathers over; state: the containers it fills
    on load. `tests/runtime/test_runtime_checkpoint.py` saves, loads and shards through an object
    that offers nothing else."""

    plan: Plan
    policy: StepPolicy
    schedule: TPSchedule
    hosted: list[str]  # matrices whose full update and state this rank computes
    applies: list[str]  # matrices whose shards this rank updates
    matrix_state: dict[str, dict]
    matrix_steps: dict[str, int]  # steps each matrix in `applies` took, kept alike on its TP ranks
    adamw_state: dict[str, dict]
    master: dict[str, Tensor]  # fp32 masters by name (empty without master weights)
    mesh: Mesh  # this rank's place (dp and tp ranks and sizes); a state dict gathers over dp, then tp

    def adamw_parts(self) -> Iterator[Piece]: ...

    def tensor(self, entry: str) -> Tensor: ...  # this rank's local tensor of a plan entry

    # under expert parallelism, the experts' part (the same protocol; its `spec` is this EP rank's
    # experts and its names local), whose entries a checkpoint keeps under the model's names
    experts: Checkpointable | None

    def global_name(self, name: str) -> str: ...  # an entry's name in the whole model

    def reset_master_weights(self) -> None: ...


class StateNotHereError(CheckpointError, AttributeError):
    """A value of `opt.state[param]` used as a tensor. An AttributeError too, so that code probing
    attributes (`hasattr`, `getattr(..., default)`, `copy`) sees none, as on any object."""


class HeldElsewhere:
    """The value of each field of `opt.state[param]`: the state lives sharded in the optimizer's own
    structures, so any use of it as a tensor (`.norm()`, `torch.norm(...)`, `.item()`) is one
    error naming where the values are, not an AttributeError of a None."""

    __slots__ = ("field",)

    def __init__(self, field: str) -> None:
        self.field = field

    def __repr__(self) -> str:
        return f"<{self.field}: held sharded by the optimizer; read it from opt.state_dict()['state']>"

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") or attr == "field":  # protocol probes (copy, pickle), a copy not yet filled
            raise AttributeError(attr)
        raise StateNotHereError(_held_elsewhere(repr(self.field)))

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise StateNotHereError(_held_elsewhere("a field"))


def _held_elsewhere(field: str) -> str:
    return (f"opt.state[param] names the fields of a parameter's state only ({field} of it here): canzona keeps "
            "the values sharded across the ranks, each on the rank that computes it; read them from "
            "opt.state_dict()['state'] (a collective: every rank calls it), which holds each parameter's "
            "full values by its position in param_groups, as torch's optimizers do")


class StateHeldElsewhere(dict):
    """torch.optim's `state` of a canzona optimizer: empty, and always true.
    `torch.distributed.checkpoint.state_dict`'s get/set_optimizer_state_dict take an empty `state`
    for an optimizer that never stepped and run a zero-gradient step to fill it (collectives, and a
    change of momentum); the state lives in `matrix_state`, `adamw_state` and `master`, on the
    ranks that hold it, and `state_dict()` gathers it.
    `state[param]` of a parameter of the optimizer's is a read-only mapping naming the fields its
    `state_dict()` entry holds (`entry_fields`), each a `HeldElsewhere` (any use of it as a
    tensor is one error naming `state_dict()`): torch's
    `flatten_optimizer_state_dict=True` (torchtitan's checkpointer) rebuilds an entry from the
    keys `state.<name>.<field>` of exactly those fields."""

    def __init__(self, owner: Described | None = None) -> None:
        super().__init__()
        self._owner = owner  # the optimizer (which refuses pickling: `not_pickled`)
        self._fields = FieldsIndex()  # `entry_fields` in O(1) per parameter

    def __bool__(self) -> bool:
        return True

    def __missing__(self, key: Any) -> Mapping[str, None]:
        names = entry_fields(self._owner, key, self._fields) if self._owner is not None and isinstance(key, Tensor) else None
        if names is None:
            raise KeyError(key)
        return MappingProxyType({name: HeldElsewhere(name) for name in names})


class FieldsIndex:
    """What `entry_fields` looks up, kept between its calls: torch's unflattening asks for every
    parameter in turn, and a scan of the parameters and a template per call made a load quadratic
    in the parameters (3.1 of 4.4 s of `set_optimizer_state_dict` at 4,000). The parameters and
    their groups are fixed at construction (`add_param_group` is refused after it); so are the fields
    of their state: a template is taken from the configuration of its kind, not from the group's
    hyper-parameters (`_template`), which change (and may hold, before a load undoes it, what a
    step refuses)."""

    def __init__(self) -> None:
        self.place: dict[int, tuple[str, int]] | None = None  # id(parameter) -> (name, group index)
        self.used: dict[tuple[int, tuple[int, ...], torch.dtype], list[str]] = {}

    def locate(self, opt: Described, param: Tensor) -> tuple[str, int] | None:
        if self.place is None:
            name_of = {id(p): n for n, p in opt.params.items()}
            self.place = {id(p): (name_of[id(p)], g) for g, group in enumerate(opt.param_groups)
                          for p in group["params"] if id(p) in name_of}
        found = self.place.get(id(param))
        # an id outlives its tensor: the hit must still be the optimizer's parameter
        return found if found is not None and opt.params.get(found[0]) is param else None

    def used_fields(self, opt: Described, g: int, name: str) -> list[str]:
        """The fields of `name`'s state template its group's configuration uses (not None): the
        configuration of its kind (`_template`), whatever the group's values hold now."""
        key = (g, tuple(opt.spec.param(name).shape), opt.state_dtype(name))
        cached = self.used.get(key)
        if cached is None:
            cached = self.used[key] = [k for k, v in _template_on_meta(opt, g, name).items() if v is not None]
        return cached


def entry_fields(opt: Described, param: Tensor, index: FieldsIndex | None = None) -> list[str] | None:
    """The fields `state_dict()`'s entry of `param` holds (None: not the optimizer's): its
    optimizer state's (`_template`, but those its configuration leaves unused), the fp32 master
    under master weights, the stack count on a stack, and canzona's marks. Only those: torch's
    unflattening scans every key of the state dict for each named field an entry lacks (quadratic
    in the parameters) and gives `{}` for it, which loading drops (`state_by_name`: a fresh
    optimizer's template has no master for a parameter that never stepped). `index`: the lookups
    kept between calls (`StateHeldElsewhere`'s)."""
    index = index or FieldsIndex()
    found = index.locate(opt, param)
    if found is None:
        return None
    name, g = found
    spec = opt.spec.param(name)
    first = stacked_matrices(spec)[0].name if spec.matrix_shape is not None else name
    stack = [STACK_KEY] if spec.matrix_shape is not None else []
    master = ["master"] if opt.master_weights else []
    return [*index.used_fields(opt, g, first), *master, STEPPED_KEY, *stack, WITNESS_FIELD]


def label_groups(opt: Described) -> None:
    """Give the live `param_groups` the key `state_dict()` adds to each group (canzona's header):
    torch's unflattening of a `flatten_optimizer_state_dict=True` state dict takes from the saved
    groups only the keys the live groups have. The live header is a placeholder (`LIVE_HEADER`),
    never read: `state_dict()` writes the header as it stands then. The members' names are no
    group key: torch's flattening writes every group key once per member (a list of the group's
    names in each: quadratic), and its forms name the members in `params` (`group_names`)."""
    for group in opt.param_groups:
        group[HEADER_KEY] = LIVE_HEADER

STATE_FORMAT = "canzona.optimizer_state"
# 4: the groups' names at the top and no shapes in the header (3: both in every group, which
# torch's flattening wrote once per parameter); 3: torch.optim's layout (2: keyed by name, header at the top)
STATE_VERSION = 4
READABLE_VERSIONS = (2, 3, 4)
HEADER_KEY = "canzona"  # in every param group: the header, as JSON
LIVE_HEADER = "see state_dict()"  # the live groups' (`label_groups`): a slot, not a header
NAMES_KEY = "param_names"  # torch.optim's own key for named parameters: each group's, at the top
STEPPED_KEY = "canzona_stepped"  # in every state entry: False for a template of zeros (`stepped`)
STACK_KEY = "canzona_matrices"  # in a stacked parameter's entry: how many matrices its fields stack
SLICED = ("exp_avg", "exp_avg_sq", "master")  # AdamW fields kept as per-rank slices of the flat buffer


def entry_stepped(entry: Mapping[str, Any]) -> bool:
    """A state-dict entry's `STEPPED_KEY` as every load reads it: as a bool (a converter may leave
    `tensor(False)` or `np.False_`), absent as stepped (an older canzona wrote none). One reading, so
    that the state an entry loads and the weights checked beside it agree."""
    flag = entry.get(STEPPED_KEY, True)
    # `{}`: torch's unflattening of a flattened state dict writes it for a field it did not find,
    # read as absent (as `state_by_name` drops such fields before it reads the flag)
    return True if isinstance(flag, Mapping) and not flag else bool(flag)


def stepped(fields: Iterable[str]) -> bool:
    """Whether a parameter's saved state (its fields' names) is that of one that stepped: any
    field but its fp32 master, which a fresh optimizer keeps too (its weights' own). The one
    definition of `STEPPED_KEY` (the layout-independent form) and of what the sharded form's
    pieces say (`read_sharded`)."""
    return any(f != "master" for f in fields)


def witness_to_check(witness: Mapping[str, Any] | None, stepped_names: Container[str]) -> dict[str, Any]:
    """What a load leaves for its first step to check (`loaded_witness`), under every layout and
    form: the save's weights' witness of the parameters whose state stepped. One that never
    stepped (a fresh optimizer's state, loaded to reset it after a loss spike or between tasks,
    as torch's optimizers reset with their initial, empty state dict) holds nothing of the weights
    it was saved beside: any weights go on from it, as from a new optimizer (its fp32 master, if
    any, gives way to them: `kernels.update_target`). Stepped state beside weights of another
    save is what the check is for."""
    return {n: w for n, w in (witness or {}).items() if n in stepped_names}


# --- who holds what ---------------------------------------------------------------------------


def _saved_here(opt: Checkpointable) -> tuple[set[str], set[str]]:
    """(matrices whose full-matrix optimizer state this rank saves, matrices whose master-weight
    shard it saves). Each matrix is saved from the lowest DP rank that computes it: its state from
    the host TP rank (TP rank 0 under tp-sync), its masters from every TP rank."""
    first: dict[str, int] = {}
    if not opt.policy.replicated:
        dpp = opt.plan.dp_plan
        first = {p.name: min(dpp.computing_ranks(b, p)) for b in dpp.buckets for p in b.params}
    dp_rank, tp_rank = opt.mesh.rank(DP), opt.mesh.rank(TP)
    mine = {t.name for t in opt.schedule.tasks() if first.get(t.name, 0) == dp_rank}
    hosts = {t.name: 0 if t.host == EVERY_RANK else t.host for t in opt.schedule.tasks()}
    state = {n for n in mine if n in opt.matrix_state and hosts[n] == tp_rank}
    return state, {n for n in mine if n in opt.master}


def _tp_dim(opt: Checkpointable, name: str) -> int | None:
    return opt.spec.param(name).tp_dim if opt.mesh.size(TP) > 1 else None


def _adamw_pieces(opt: Checkpointable) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """(name, offset within the local tensor, state with master) of the AdamW slices this rank
    saves: under a replicated policy DP rank 0's; a TP-replicated parameter's from TP rank 0."""
    if opt.policy.replicated and opt.mesh.rank(DP) != 0:
        return
    for piece in opt.adamw_parts():
        name = piece.name
        if name in opt.adamw_state and (opt.mesh.rank(TP) == 0 or _tp_dim(opt, name) is not None):
            yield name, piece.offset, _with_master(opt, name, opt.adamw_state[name])


def _with_master(opt: Checkpointable, name: str, state: Mapping[str, Any]) -> dict[str, Any]:
    """The optimizer state of `name` plus its fp32 master weights, when it has them."""
    return {**state, "master": opt.master[name]} if name in opt.master else dict(state)


# --- layout-independent state dicts -----------------------------------------------------------


def _parts(opt: Checkpointable) -> list[Checkpointable]:
    """The optimizer, and its experts' part under expert parallelism."""
    return [opt] if opt.experts is None else [opt, opt.experts]


def current_masters(opt: Checkpointable) -> None:
    """Before the masters are saved: each is the master of the weights as they are now. Weights
    written into the model since the last step (`model.load_state_dict`, a hand edit), or since
    this parameter's last gradient, win over a master that no longer matches them, as the next
    step's `kernels.update_target` would have it; saved stale, the checkpoint would resume from
    the old weights' masters, and the model files saved beside them would fail the check that
    they come from the same save (`check_weights_match`). An optimizer state loaded into a model
    holding other weights so saves the masters of those weights: the ones its next step would
    take."""
    for part in _parts(opt):
        if not part.master:
            continue
        for name, working in _working(part).items():
            master = part.master.get(name)
            if master is not None:
                update_target(master, working.detach())


def gather_state(opt: Checkpointable) -> dict[str, Any]:
    current_masters(opt)
    mine: dict[str, Any] = {"matrix": {}, "masters": {}, "adamw": []}
    for part in _parts(opt):  # every entry under the model's name
        states, masters = _saved_here(part)
        g = part.global_name
        mine["matrix"].update({g(n): _to_cpu(s) for n, s in part.matrix_state.items() if s and n in states})
        mine["masters"].update({g(n): part.master[n].detach().cpu().clone() for n in sorted(masters)})
        mine["adamw"] += [(g(n), off, _to_cpu(s)) for n, off, s in _adamw_pieces(part)]
    try:
        every = opt.mesh.comm("dp").all_gather_object(mine, "optimizer state")  # per DP rank
        tp = opt.mesh.comm("tp")
        by_tp = tp.all_gather_object(every, "optimizer state") if tp is not None else [every]
    except CanzonaError as e:
        raise CanzonaError(f"{e}; state_dict() is collective: call it on every rank (each gets the whole "
                           "state), or save with sharded_state_dict()") from None
    state: dict[str, dict] = {}
    for per_dp in by_tp:
        for part in per_dp:
            state.update(part["matrix"])
    for name in sorted({n for per_dp in by_tp for part in per_dp for n in part["masters"]}):
        shards = [part["masters"][name] for per_dp in by_tp for part in per_dp if name in part["masters"]]
        if shards:
            state.setdefault(name, {})["master"] = unshard(shards, _tp_dim(opt, name))
    # AdamW's pieces: of its parameters, and of every entry under an elementwise optimizer; a
    # TP-split parameter's stitched per TP rank, any other's from every rank's pieces together
    # (a TP-replicated one's come from TP rank 0 alone; an expert matrix's, under expert
    # parallelism with TP, from the ranks of its EDP group, which may be on several TP ranks)
    for name in sorted({p[0] for per_dp in by_tp for part in per_dp for p in part["adamw"]}):
        groups = by_tp if _tp_dim(opt, name) is not None else [[part for per_dp in by_tp for part in per_dp]]
        shards = [_stitch(opt, name, [p for part in per_dp for p in part["adamw"] if p[0] == name])
                  for per_dp in groups]
        shards = [s for s in shards if s is not None]
        if shards:
            full = {k: v for k, v in shards[0].items() if k not in SLICED}
            for key in SLICED:
                if key in shards[0]:
                    full[key] = unshard([s[key] for s in shards], _tp_dim(opt, name))
            state[name] = full
    return full_state(opt, state, take_witness(opt, _held(opt), own_comms(opt), call="state_dict()"))


def full_state(opt: Described, by_name: Mapping[str, dict], witness: Mapping[str, Any]) -> dict[str, Any]:
    """The full state by name (full tensors, masters under `master`), in torch.optim's layout
    (see the module's docstring): what `state_dict()` returns under every layout. Each entry holds
    its parameter's `witness` values under `WITNESS_FIELD` (a tensor: torch's tools and `dcp` carry
    it as any state, and a template's is filled in place)."""
    # small, and the same whatever the model's size: torch's flattening writes it once per parameter;
    # WITNESS_KEY in it: this save wrote the entries' witness. A template's witness that a partial
    # `dcp.load` of an older save (none) left in place is then not taken for the save's
    header = json.dumps({**_header(opt, shapes=False), WITNESS_KEY: True}, default=_json_scalar)
    name_of = {id(p): n for n, p in opt.params.items()}
    state: dict[int, dict] = {}
    groups, members = [], []
    for g, group in enumerate(opt.param_groups):
        names = [name_of[id(p)] for p in group["params"]]
        members.append(names)
        first = len(state)
        for name in names:
            if opt.spec.param(name).matrix_shape is not None:
                entry = _stacked_entry(opt, g, name, by_name)
            else:
                saved = dict(by_name.get(name, {}))
                entry = {} if (did := stepped(saved)) else _template(opt, g, name)
                entry.update(saved)
                entry[STEPPED_KEY] = did
            values = _witness_values(name, math.prod(opt.spec.param(name).shape), witness.get(name))
            if values is not None:
                entry[WITNESS_FIELD] = values
            # a field its configuration leaves unused (SOAP's one-sided factors) is left out, not
            # None: torch's flattening (`flatten_optimizer_state_dict`) refuses None; loading reads
            # an absent unused field as None (`_checked_field`). Each tensor contiguous (gathered ones
            # are already, `_to_cpu`: then a no-op): torch's `set_optimizer_state_dict(
            # broadcast_from_rank0=True)` broadcasts rank 0's memory as it lies, so SOAP's column-major
            # eigenbases reached the other ranks transposed; a load restores the kernel's layout
            # (`matrix_state_to_device`)
            state[len(state)] = {k: v.contiguous() if isinstance(v, Tensor) else v
                                 for k, v in entry.items() if v is not None}
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": list(range(first, len(state))), HEADER_KEY: header})
    # the names at the top, once: torch's tools keep only `state` and `param_groups`, and name the
    # members in `params` instead (`group_names`)
    return {"state": state, "param_groups": groups, NAMES_KEY: members}


def _stacked_entry(opt: Described, g: int, name: str, by_name: Mapping[str, dict]) -> dict[str, Any]:
    """A stacked parameter's entry: its matrices' states (or templates), each tensor field stacked
    over the matrices in memory order (`[matrices, ...]`), each scalar field the one value they
    share (the matrices of a stack step together), and `STACK_KEY` saying how many there are."""
    matrices = [m.name for m in stacked_matrices(opt.spec.param(name))]
    saved = [dict(by_name.get(m, {})) for m in matrices]
    any_stepped = stepped(k for s in saved for k in s)
    entry = join_stack(name, [{**({} if any_stepped else _template(opt, g, m)), **s} for m, s in zip(matrices, saved)])
    entry[STEPPED_KEY] = any_stepped
    entry[STACK_KEY] = len(matrices)
    return entry


def join_stack(name: str, parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Stack `name`'s matrices' states (in memory order) as one: each tensor field stacked over
    them (`[matrices, ...]`), each scalar field the one value they share (`split_stack` undone)."""
    entry: dict[str, Any] = {}
    for field in parts[0]:
        values = [p[field] for p in parts]
        if isinstance(values[0], Tensor):
            entry[field] = torch.stack(values)
        elif all(v == values[0] for v in values):
            entry[field] = values[0]
        else:
            raise CanzonaError(f"the matrices of stack {name!r} hold different {field!r} ({values[:4]}...): "
                               "they step together, so the state cannot be saved as one entry")
    return entry


def split_stack(name: str, entry: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """`_stacked_entry` undone: each matrix's state by its name (`'<param>[k]'`)."""
    count = entry[STACK_KEY]
    if not (isinstance(count, int) and count >= 1) or any(
            isinstance(v, Tensor) and (v.dim() == 0 or v.shape[0] != count) for v in entry.values()):
        raise PlanError(f"optimizer state of stack {name!r} is damaged: its fields do not stack {count!r} matrices")
    return {f"{name}{STACK_OPEN}{k}{STACK_CLOSE}": {
        field: v[k].clone() if isinstance(v, Tensor) else v for field, v in entry.items() if field != STACK_KEY}
        for k in range(count)}


def _template(opt: Described, g: int, name: str) -> dict[str, Any]:
    """Zeros in the shape and dtype of every field `name`'s optimizer state will have. Taken from
    the configuration of the group's kind (`matrix_cfg`), never from the group's values as they
    stand: every group keeps that configuration's state (`groups.GroupConfigs` refuses an edit
    that keeps other), and a load replaces the values (a NaN rate, a hand edit out of range, which
    a step refuses and the load of a good checkpoint undoes; before, such a group made
    `load_state_dict` of a stepped checkpoint, and torch's flattened forms, raise the step's error)."""
    shape = opt.spec.param(name).shape
    like = torch.zeros(shape, dtype=opt.state_dtype(name))
    group = opt.param_groups[g]
    if group["kind"] == "adamw":
        return adamw_state(like)
    return initial_state(opt.optimizer, like, opt.matrix_cfg)


def state_by_name(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, dict]]:
    """(header, hyper-parameters of each group, state of each parameter that has one, by name) of
    a state dict of either version, as written (templates of zeros dropped, masters kept)."""
    if not isinstance(state_dict, Mapping) or "param_groups" not in state_dict or "state" not in state_dict:
        raise PlanError("not a canzona optimizer state (no state and param_groups)")
    groups = state_dict["param_groups"]
    if state_dict.get("format") == STATE_FORMAT:  # version 2: by name, header at the top
        header = {k: v for k, v in state_dict.items() if k not in ("state", "param_groups")}
        return header, [dict(g) for g in groups], {n: dict(s) for n, s in state_dict["state"].items()}
    if not groups or not all(isinstance(g, Mapping) and HEADER_KEY in g for g in groups):
        raise PlanError("not a canzona optimizer state (format mismatch: no canzona header in param_groups); a "
                        "torch.optim optimizer's state dict (torch.optim.AdamW's, say), whose state torch keeps by "
                        "parameter index in its own groups, does not load into a DistributedOptimizer: load that "
                        "run's weights with model.load_state_dict() and go on with this optimizer's fresh state")
    try:
        header = json_load(groups[0][HEADER_KEY])
    except (TypeError, ValueError):
        raise PlanError("not a canzona optimizer state (its header is not JSON)") from None
    by_name: dict[str, dict] = {}
    for group, names in zip(groups, group_names(state_dict)):
        keys = list(group.get("params", []))
        if len(keys) != len(names):
            raise PlanError(f"optimizer state: a parameter group lists {len(keys)} parameters and {len(names)} names")
        for key, name in zip(keys, names):
            entry = _entry(state_dict["state"], key)
            if entry is None:
                continue
            # `{}`: a field torch's unflattening of a flattened state dict did not find (`entry_fields`)
            entry = {k: v for k, v in entry.items() if not (isinstance(v, Mapping) and not v)}
            entry.pop(WITNESS_FIELD, None)  # the weights', not the optimizer's (`loaded_witness`)
            stepped = entry_stepped(entry)
            entry.pop(STEPPED_KEY, None)
            for key, part in (split_stack(name, entry) if STACK_KEY in entry else {name: entry}).items():
                if not stepped:
                    part = {k: v for k, v in part.items() if k == "master"}
                if part:
                    by_name[key] = part
    hyper = [{k: v for k, v in g.items() if k not in ("params", NAMES_KEY, HEADER_KEY)} for g in groups]
    return header, hyper, by_name


def group_names(state_dict: Mapping[str, Any]) -> list[list[str]]:
    """Each group's member names in a state dict in torch.optim's layout: `state_dict()`'s list
    them at the top (version 4), version 3 in each group; torch's forms (`get_optimizer_state_dict`,
    flattened or not) keep neither but key the members by name in `params` (torch's names: the
    model's, without wrapper components, as canzona's)."""
    groups = state_dict["param_groups"]
    top = state_dict.get(NAMES_KEY)
    if top is not None:
        if len(top) != len(groups):
            raise PlanError(f"optimizer state: {len(top)} lists of names for {len(groups)} parameter groups")
        return [list(names) for names in top]
    out = []
    for group in groups:
        if NAMES_KEY in group:
            out.append(list(group[NAMES_KEY]))
        elif all(isinstance(k, str) for k in group.get("params", [])):
            out.append([canonical_name(k) for k in group.get("params", [])])
        else:
            raise PlanError("not a canzona optimizer state (its parameter groups list indices but no names)")
    return out


def _entry(states: Mapping[Any, Any], key: Any) -> Mapping[str, Any] | None:
    """The state entry of parameter index `key`. `dcp.load` into a state dict keyed by int (this
    one's, or any torch optimizer's, without torch's `get_optimizer_state_dict`) fills its tensors in
    place but sets its non-tensor values under the key's string (`state["0"]`, the path of its
    flattening): those are the saved values (`step`, `canzona_stepped`), over the template's."""
    entry = states.get(key)
    moved = None if isinstance(key, str) else states.get(str(key))
    if not isinstance(moved, Mapping) or not isinstance(entry, Mapping):
        return entry if entry is not None else moved
    return {**entry, **moved}


def _stitch(opt: Checkpointable, name: str, pieces: list) -> dict[str, Any] | None:
    """One TP shard of an AdamW parameter's state from its DP slices (None: none were saved)."""
    if not pieces:
        return None
    shape = opt.spec.param(name).local_shape(opt.mesh.size(TP))
    numel = math.prod(shape)
    out: dict[str, Any] = {"step": pieces[0][2]["step"]}
    for _, offset, part in pieces:
        for key in SLICED:
            if key in part:
                out.setdefault(key, torch.zeros(numel, dtype=part[key].dtype))[offset:offset + part[key].numel()] = part[key]
    return {k: v.view(shape) if isinstance(v, Tensor) else v for k, v in out.items()}


def load_state(opt: Checkpointable, state_dict: Mapping[str, Any]) -> None:
    """`state_dict()`'s form, loaded on every rank of the optimizer's DP and TP groups (collective:
    `read_state_together`)."""
    load_by_name(opt, *read_state_together(opt, state_dict, own_comms(opt)))
    opt.loaded_witness = state_dict_witness_to_check(state_dict, _global_shapes(opt))


def own_comms(opt: Checkpointable) -> list[Comm | None]:
    """The groups that reach every rank holding a piece of `opt`'s parameters, in turn: DP, then TP
    (under expert parallelism the experts' EDP x EP mesh folds the same DP x TP ranks,
    `check_expert_layout`). A checkpoint's collectives of one optimizer run over these, never over
    the default process group, whose other ranks may train another model (a replica on its own DP
    group, another pipeline stage) and call nothing at that moment."""
    return [opt.mesh.comm(DP), opt.mesh.comm(TP)]


def read_state(opt: Described, state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]],
                                                                     dict[str, dict]]:
    """`state_by_name` of a state dict checked against `opt` (one PlanError line for a checkpoint
    of another model or optimizer, or whose groups hold other parameters); changes nothing."""
    header, groups, state = state_by_name(state_dict)
    names = group_names(state_dict) if state_dict.get("format") != STATE_FORMAT else None
    # another model or optimizer first: the likelier mistake
    _check_compatible(opt, header, groups, state, [n for group in names or [] for n in group])
    if names is not None:  # torch's layout: the names travel beside the groups
        _check_members(opt, names)
    return header, groups, checked_entries(opt, state)


def read_state_together(opt: Described, state_dict: Mapping[str, Any], comms: list[Comm | None]) -> tuple[
        dict[str, Any], list[dict[str, Any]], dict[str, dict]]:
    """`read_state` on every rank of `comms` (the groups whose ranks hold the same state dict),
    agreed on (`agree`) with a digest of what was read: a refusal on one rank, or ranks given
    different state dicts (each rank loading its own file of another save, or `load_state_dict` on
    rank 0 alone: each rank takes only its own pieces of it, so before, the optimizer's state was
    silently mixed), is one error on every rank before anything is changed."""
    error: CanzonaError | None = None
    read: Any = None
    digest = b""
    try:
        read = read_state(opt, state_dict)
        digest = _state_digest(*read)
    except CanzonaError as e:
        error = e
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, RuntimeError) as e:
        # a hand-built dict of the wrong form: still one line, on every rank alike
        error = PlanError(f"not a canzona optimizer state ({type(e).__name__}: {next(iter(str(e).splitlines()), '')})")
    agree(comms, error, digest, "load_state_dict()", "were given another state dict than this rank: every rank must "
          "load the same save (the state dict is the same on every rank)")
    return read


def agree(comms: list[Comm | None], error: Exception | None, digest: bytes, call: str, differ: str) -> None:
    """One small all-gather in each group of `comms` of whether this rank refused what it is loading
    and of a digest of it (what every rank of the group must have alike); raise on every rank if
    any refused (its own error there: a refusal, or an unexpected exception in its checks, which
    the others name by its type and first line) or the digests differ (`differ` says how), else
    return. Collective, bounded by the groups' timeouts; every rank joins every group's round, so
    none is left waiting."""
    from canzona.runtime.checkpoint_files import first_line

    word = int.from_bytes(hashlib.sha256(digest).digest()[:8], "little", signed=True)
    # what the first refusal said, carried to every rank
    cause = None if error is None else str(error) if isinstance(error, CanzonaError) else \
        f"{type(error).__name__}: {first_line(error)}"
    for comm in (c for c in comms if c is not None):
        try:
            table = comm.all_gather_values(torch.tensor([int(error is not None), word]), f"{call} check")
        except CanzonaError as e:
            raise CanzonaError(f"{e}; {call} is collective: call it on every rank") from None
        if table[:, 0].any():
            # a refusal: its reason to every rank (one more small all-gather of an object, its sizes
            # then its bytes, on this path only), so that a rank that read nothing wrong (a sharded
            # load reads its own pieces) names it too; a refusal an earlier group's round made (the
            # digests differed there) is carried as its message
            said = [c for c in comm.all_gather_object(cause, f"{call} refusal") if c is not None]
            cause = said[0] if said else "see their error"
        if error is None and table[:, 0].any():
            ranks = [int(r) for r in torch.nonzero(table[:, 0]).flatten()]
            error = CheckpointError(f"optimizer state not loaded, nothing changed: rank(s) {ranks} of group "
                                    f"{comm.name} refused it: {cause}")
        elif error is None and not torch.all(table[:, 1] == word):
            ranks = [int(r) for r in torch.nonzero(table[:, 1] != word).flatten()]
            error = CheckpointError(f"optimizer state not loaded, nothing changed: rank(s) {ranks} of group "
                                    f"{comm.name} {differ}")
        if error is not None and cause is None:
            cause = str(error)  # what the next group's round carries to its ranks
    if error is not None:
        raise error


def _state_digest(header: Mapping[str, Any], groups: list[Mapping[str, Any]], state: Mapping[str, dict]) -> bytes:
    """A digest of a state read by `read_state`: the header, the groups' hyper-parameters, every
    field's shape and dtype, every scalar, and the bytes of a few elements of every tensor (those
    `_spread` picks: cheap at any size; two saves differ in nearly all of them)."""
    h = hashlib.sha256(json.dumps([header, groups], sort_keys=True, default=_digest_value).encode())
    for name in sorted(state):
        picks: dict[int, Tensor] = {}  # the fields of an entry share its elements' positions (a cost per entry)
        for field in sorted(state[name]):
            value = state[name][field]
            if isinstance(value, Tensor):
                flat = value.detach().reshape(-1)
                if flat.numel() not in picks:
                    picks[flat.numel()] = _spread(name, flat.numel())
                picked = flat[picks[flat.numel()].to(flat.device)].cpu().contiguous()
                h.update(f"{name}/{field} {list(value.shape)} {value.dtype} ".encode())
                h.update(picked.view(torch.uint8).numpy().tobytes())  # exact bits, NaN payloads too
            else:
                h.update(f"{name}/{field} {value!r}".encode())
    return h.digest()


def _spread(name: str, numel: int) -> Tensor:
    """`WITNESS_SIZE` flat positions spread evenly over `numel` elements from an offset hashed from
    `name` (one hash: `witness_indices`' 32 per field were most of a large MoE's load check)."""
    if numel <= WITNESS_SIZE:
        return torch.arange(numel)
    stride = numel // WITNESS_SIZE
    start = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") % stride
    return start + torch.arange(WITNESS_SIZE) * stride


def _group_of(opt: Described) -> dict[str, int]:
    """The group index of every parameter and of every matrix of a stack, by name."""
    name_of = {id(p): n for n, p in opt.params.items()}
    out: dict[str, int] = {}
    for g, group in enumerate(opt.param_groups):
        for p in group["params"]:
            out.update({m.name: g for m in stacked_matrices(opt.spec.param(name_of[id(p)]))})
            out[name_of[id(p)]] = g
    return out


def checked_entries(opt: Described, state: Mapping[str, dict]) -> dict[str, dict]:
    """Each saved entry against the state its optimizer keeps (`initial_state`'s fields, shapes
    taken on the meta device, nothing allocated): a field missing or of another shape is one
    PlanError naming it, before anything is loaded (a hand-edited or damaged `torch.save` file;
    before, a wrong shape failed halfway through the load, the optimizer's state half replaced, on
    the ranks that hold that entry alone). Floating-point fields in another dtype are cast to the
    state's, as torch.optim's `load_state_dict` casts them to the parameter's; a field the state
    does not keep is dropped."""
    group_of = _group_of(opt)
    # the template depends on the group, shape and state dtype alone: taken once for each (the
    # experts of a stack share one; per entry it was most of a large MoE's load time)
    templates: dict[tuple[int, tuple[int, ...], torch.dtype], dict[str, Any]] = {}
    out: dict[str, dict] = {}
    for name, entry in state.items():
        entry = dict(entry)
        shape = tuple(opt.spec.param(name).shape)
        master = entry.get("master")
        if master is not None and (not isinstance(master, Tensor) or tuple(master.shape) != shape):
            raise PlanError(f"optimizer state of {name!r} is damaged: its master is {_described(master)}, "
                            f"the parameter {list(shape)}")
        if any(k != "master" for k in entry):  # a stepped entry: every field of its state
            key = (group_of[name], shape, opt.state_dtype(name))
            if key not in templates:
                templates[key] = _template_on_meta(opt, group_of[name], name)
            # the template's fields only: a field this optimizer does not keep (a hand edit, a
            # converter's extra) is dropped, as the ZeRO-1 layout's AdamW slices dropped it; before,
            # FSDP2's loader cut it like the state's own, a RuntimeError halfway through the load
            # (the matrices' state already replaced), and the ZeRO-1 layout saved it again
            entry = {**({"master": master} if "master" in entry else {}),
                     **{field: _checked_field(name, field, want, entry) for field, want in templates[key].items()}}
        out[name] = entry
    # a NaN / Inf anywhere (one reduction per tensor): torch's load takes it, and the next step
    # writes it into the weights, whose NaN the step after blames on the data
    error = nonfinite_state_error(out.items())
    if error is not None:
        raise CheckpointError(error)
    return out


def _template_on_meta(opt: Described, g: int, name: str) -> dict[str, Any]:
    with torch.device("meta"):
        return _template(opt, g, name)


def _checked_field(name: str, field: str, want: Any, entry: Mapping[str, Any]) -> Any:
    """The saved value of `field`, checked against the template's `want` (cast to its dtype)."""
    got = entry.get(field)
    if want is None:  # a field this configuration leaves unused (SOAP's one-sided preconditioner)
        return got
    if field not in entry:
        raise PlanError(f"optimizer state of {name!r} is damaged: it has no {field!r}")
    if not isinstance(want, Tensor):  # a step count
        if not (isinstance(got, (int, float)) or (isinstance(got, Tensor) and got.numel() == 1)):
            raise PlanError(f"optimizer state of {name!r} is damaged: its {field!r} is {_described(got)}, "
                            "not a number")
        return got
    if not isinstance(got, Tensor) or got.shape != want.shape or got.is_floating_point() != want.is_floating_point():
        raise PlanError(f"optimizer state of {name!r} is damaged: its {field!r} is {_described(got)}, this "
                        f"optimizer keeps {_described(want)}")
    return cast_field(name, field, got, want.dtype)


def cast_field(name: str, field: str, got: Tensor, dtype: torch.dtype) -> Tensor:
    """A saved floating field in the state's `dtype` (torch.optim's `load_state_dict` casts alike,
    to the parameter's). A finite value the cast overflows (fp32 above 65504 into an fp16 state)
    is one CheckpointError naming the field, the value and the dtype's largest: the Inf it becomes
    would be refused as damaged, naming nothing of the cause, or written into the weights. In a
    second moment too (`SECOND_MOMENTS`): before, it loaded there as +Inf (as torch's load makes
    it), which froze the element, one of those with the largest gradients, for the rest of the run
    (its update exactly 0), silently. A +Inf already in the saved second moment (an overflowed g^2
    of a pure-fp16 run) is no overflow of the cast: it loads, as `nonfinite_state_error` allows.
    The check is one `aminmax` of the cast (no Inf: done); the masks that find the value are
    built only when it holds an Inf (before, on every cast: 7x the cast's own time)."""
    if got.dtype == dtype:
        return got
    cast = got.to(dtype)
    largest = torch.finfo(dtype).max
    if largest < torch.finfo(got.dtype).max and got.element_size() > 1 and cast.numel():
        lo, hi = torch.aminmax(cast)  # a NaN makes both NaN: refused as damaged after the cast
        if bool((hi == math.inf) | (lo == -math.inf)):
            over = torch.isinf(cast) & torch.isfinite(got)
            if bool(over.any()):
                value = float(got[over].reshape(-1)[0])
                wider = " or ".join(n for n, d in (("fp32", torch.float32), ("bf16", torch.bfloat16))
                                    if torch.finfo(d).max > largest)
                raise CheckpointError(
                    f"optimizer state of {name!r} does not fit this optimizer's state dtype: its {field!r} holds "
                    f"{value:g} (saved as {_dtype_name(got.dtype)}), beyond {_dtype_name(dtype)}'s largest finite "
                    f"value {largest:g}, the dtype this configuration keeps it in, so the cast would make it Inf: "
                    "nothing was loaded. Resume it with a state dtype that holds it"
                    + (f" (fp32: master weights, or an {wider} model)" if wider else ""))
    return cast


def cast_to_live(opt: Described, state: Mapping[str, dict]) -> dict[str, dict]:
    """A state read by a sharded load (`read_sharded`, by entry: a stack's matrices by theirs,
    `'<param>[k]'`; FSDP2's AdamW stacks by the stack's name), each floating field cast
    (`cast_field`) to the dtype the live configuration keeps it in: its template's
    (`initial_state` of the matrix optimizer for a matrix, AdamW's for the rest), taken from the
    entry's name alone (`state_dtype`, the base configurations), never from the param groups'
    values, which the load may be about to replace. The full form casts alike
    (`checked_entries`). Before, a field saved in another dtype (a bf16 state resumed with an fp32
    one, a converted shard) loaded as saved, and the next step failed mid-step in the kernels.
    The fp32 masters and the fields the template does not hold are left as read."""
    matrices = {p.name for p in opt.spec.matrix_params()}
    templates: dict[tuple[bool, tuple[int, ...], torch.dtype], dict[str, Any]] = {}
    out: dict[str, dict] = {}
    for name, entry in state.items():
        shape = tuple(opt.spec.param(name).shape)
        key = (name in matrices, shape, opt.state_dtype(name))
        if key not in templates:
            with torch.device("meta"):
                like = torch.zeros(shape, dtype=key[2])
                templates[key] = initial_state(opt.optimizer, like, opt.matrix_cfg) if key[0] else adamw_state(like)
        want = templates[key]
        out[name] = {field: cast_field(name, field, value, want[field].dtype)
                     if isinstance(value, Tensor) and value.is_floating_point() and isinstance(want.get(field), Tensor)
                     and want[field].is_floating_point() else value for field, value in entry.items()}
    return out


def _described(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    return type(value).__name__


def _check_members(opt: Described, saved: list[list[str]]) -> None:
    """The checkpoint's groups hold the parameters this optimizer's do: each group's
    hyper-parameters are restored into the group at its position."""
    name_of = {id(p): n for n, p in opt.params.items()}
    mine = [[name_of[id(p)] for p in g["params"]] for g in opt.param_groups]
    if len(saved) == len(mine) and saved != mine:
        raise PlanError(f"checkpoint's parameter groups hold other parameters: {_first_name_difference(saved, mine)}")


def _first_name_difference(saved: list[list[str]], mine: list[list[str]]) -> str:
    for i, (a, b) in enumerate(zip(saved, mine)):
        if a != b:
            extra = sorted(set(a) - set(b))
            missing = sorted(set(b) - set(a))
            if extra or missing:
                return f"group {i} has {extra[:1] or 'no'} there and {missing[:1] or 'no'} here"
            return f"group {i} lists them in another order"
    return "another number of groups"


def load_by_name(opt: Checkpointable, header: Mapping[str, Any], groups: list[Mapping[str, Any]],
                 state: Mapping[str, dict]) -> None:
    """Load a state given by name (`state_by_name`'s form): checks first, then everything."""
    state, masters = restore_settings(opt, header, groups, state)
    device = local_tensor(next(iter(opt.params.values()))).device
    opt.adamw_state.clear()  # shared by the parts: each fills its own
    for part in _parts(opt):
        _load_part(part, _local(part, state), device)
    if opt.master_weights:
        opt.reset_master_weights()  # from the model's weights, then the saved fp32 masters where kept
        for part in _parts(opt):
            _load_masters(part, _local(part, masters), device)


def restore_settings(opt: Described, header: Mapping[str, Any], groups: list[Mapping[str, Any]],
                     state: Mapping[str, dict]) -> tuple[dict[str, dict], dict[str, Tensor]]:
    """Check a state given by name (`state_by_name`'s form), then restore what every layout
    restores alike (the configurations, each group's hyper-parameters); return (the state by name
    without masters, the fp32 masters by name) for the layout to cut to what its rank holds."""
    _check_compatible(opt, header, groups, state)
    sharded = bool(groups) and all(NAMES_KEY in g for g in groups)  # a sharded checkpoint's groups name their members
    if sharded:
        _check_members(opt, [list(g[NAMES_KEY]) for g in groups])
    # copies, as torch's load copies the groups: a tensor lr the scheduler fills in place is the
    # optimizer's own, not the state dict's (which may be loaded again, or into another optimizer).
    # One deepcopy of every group's values, as torch's one of the list: a tensor the groups shared
    # (a user group's, split by kind) stays shared; and taken before anything changes
    values = copy.deepcopy([{k: v for k, v in saved.items() if k not in ("params", NAMES_KEY, HEADER_KEY)}
                            for saved in groups])
    if sharded:  # the full form keeps the device saved, as torch's load does
        _onto_held_devices(opt.param_groups, values)
        _tuples_again(opt, values)
    opt.matrix_cfg = saved_config(opt.optimizer, opt.matrix_cfg, header.get("matrix_config"), "matrix_config")
    opt.adamw_cfg = saved_config("adamw", opt.adamw_cfg, header.get("adamw_config"), "adamw_config")
    for group, saved in zip(opt.param_groups, values):
        group.update(saved)
    state = {n: dict(s) for n, s in state.items()}
    masters = {n: s.pop("master") for n, s in state.items() if "master" in s}
    return state, masters


def _tuples_again(opt: Described, values: list[dict[str, Any]]) -> None:
    """A sharded checkpoint's groups (JSON) give lists where the groups held tuples: a
    configuration's tuple field (AdamW's `betas`, Muon's `ns_coefficients`) a tuple again, in
    place, where the live group holds a tuple (or, not holding the key, its configuration does),
    as torch's load of the full form restores it (before, `betas` came back a list: equal to
    nothing the loop compared it with, silently); a list the user's group held stays a list."""
    bases = {"matrix": opt.matrix_cfg, "adamw": opt.adamw_cfg}
    for group, saved in zip(opt.param_groups, values):
        base = bases.get(group.get("kind"))
        for key, value in saved.items():
            held = group[key] if key in group else getattr(base, key, None)
            if isinstance(value, list) and isinstance(held, tuple):
                saved[key] = tuple(value)


def _local(part: Checkpointable, by_name: Mapping[str, Any]) -> dict[str, Any]:
    """`by_name` (the model's names) under the part's own names, for the entries it holds."""
    names = {*part.hosted, *part.applies, *(p.name for p in part.adamw_parts())}
    return {n: by_name[part.global_name(n)] for n in names if part.global_name(n) in by_name}


def _load_part(opt: Checkpointable, state: Mapping[str, dict], device: torch.device) -> None:
    opt.matrix_state.clear()  # the executor holds this dict: fill it in place
    opt.matrix_state.update({n: matrix_state_to_device(opt.optimizer, state[n], device) if n in state else {}
                             for n in opt.hosted})
    # every TP rank that applies a matrix's chunks counts its steps from the same saved state (the
    # host's own state must agree, which the executor checks each step): the scalars it applies
    # them with depend on it (SOAP's bias correction, its first step without an update)
    taken = matrix_optimizer(opt.optimizer).part("steps_taken")
    opt.matrix_steps.clear()  # the executor holds this dict too
    opt.matrix_steps.update({n: taken(state[n]) if taken is not None and state.get(n) else 0 for n in opt.applies})
    for name, _, s, e, off in opt.adamw_parts():
        if name in state:
            full = state[name]
            opt.adamw_state[name] = {"step": full["step"], **{
                key: _slice(opt, name, full[key], off, e - s).clone().to(device)
                for key in ("exp_avg", "exp_avg_sq")}}


def _load_masters(opt: Checkpointable, masters: Mapping[str, Tensor], device: torch.device) -> None:
    opt.master.update(_local_masters(opt, masters, device))


def _local_masters(opt: Checkpointable, masters: Mapping[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    """This rank's fp32 masters of the entries of `masters` (full tensors, the part's own names):
    copies, never views of `masters` (a same-dtype, same-device `.to()` is none): the steps
    train the masters in place, and the state dict they came from must stay as it was given."""
    out: dict[str, Tensor] = {}
    for name, _, s, e, off in opt.adamw_parts():
        if name in masters:
            out[name] = _owned_fp32(_slice(opt, name, masters[name], off, e - s), device)
    for name in opt.applies:
        if name in masters:
            shard = shard_of(masters[name], _tp_dim(opt, name), opt.mesh.size(TP), opt.mesh.rank(TP))
            out[name] = _owned_fp32(shard, device)
    return out


def _owned_fp32(t: Tensor, device: torch.device) -> Tensor:
    """A new contiguous fp32 tensor on `device` holding `t`'s values."""
    return t.detach().to(device, torch.float32, memory_format=torch.contiguous_format, copy=True)


def _working(opt: Checkpointable) -> dict[str, Tensor]:
    """The local weights each master of this rank is the master of (as `reset_master_weights` takes them)."""
    out = {name: buffer.data[s:e] for name, buffer, s, e, _ in opt.adamw_parts()}
    out.update({name: opt.tensor(name) for name in opt.applies})
    return out


WEIGHTS_FROM_ANOTHER_SAVE = (
    "the model's weights differ from those the optimizer checkpoint was saved with ({detail}): the model files "
    "and the optimizer state come from different saves (a save killed between them, or files copied from two "
    "checkpoints); {outcome}. Resume from a checkpoint saved whole{hint}")
NOTHING_LOADED = "nothing of the optimizer state was loaded"
# `load_state_dict` cannot check the weights: torch's `set_state_dict` loads the optimizer before
# the model. The first step after it checks them (`check_loaded_weights`), before any update.
NOTHING_STEPPED = ("step() refused before any update (a state loaded by load_state_dict(), or by "
                   "load_sharded_state_dict() without check_weights, is checked against the weights at the first "
                   "step after it)")
# the way past that refusal where the weights were changed on purpose after the save
NOT_BY_CHANCE = ("; or, for weights changed on purpose (surgery, a merge, EMA weights), load the state dict through "
                 "canzona.runtime.checkpoint.without_weights_witness(state_dict), or load_sharded_state_dict(..., "
                 "check_weights=False)")


def check_weights_match(opt: Checkpointable, state: Mapping[str, dict], witness: Mapping[str, Any] | None) -> None:
    """Collective (the optimizer's own ranks, `own_comms`): the model's weights as they are now (just loaded)
    are those the checkpoint was saved with, or one CheckpointError on every rank before anything
    is loaded. Where this optimizer keeps fp32 masters and the checkpoint has them, every element
    this rank keeps a master of equals the master cast to the parameter's dtype (it holds after
    every step, `kernels.update_target`, and after weights written into the model since: a save
    takes the masters of the weights as they are, `current_masters`); every other parameter's
    sampled elements this rank holds equal the checkpoint's `witness` (`take_witness`; none in a
    checkpoint of an older canzona: those parameters are not checked). Both hold at any layout."""

    def compare_masters() -> set[str]:
        compared: set[str] = set()
        masters = {n: s["master"] for n, s in state.items() if isinstance(s, Mapping) and "master" in s}
        device = local_tensor(next(iter(opt.params.values()))).device
        for part in _parts(opt):
            weights = _working(part)
            for name, master in _local_masters(part, _local(part, masters), device).items():
                same_as_master(part.global_name(name), master, weights[name])
                compared.add(part.global_name(name).split(STACK_OPEN)[0])  # a stack's matrix: its stack
        return compared

    check_same_save(compare_masters if opt.master_weights else set, lambda: _held(opt), _global_shapes(opt), witness,
                    own_comms(opt))


def same_as_master(name: str, master: Tensor, working: Tensor) -> None:
    """`working` is `master` cast to its dtype, or the CheckpointError of weights from another save."""
    bad = mismatches(master, working)
    if bad:
        raise CheckpointError(WEIGHTS_FROM_ANOTHER_SAVE.format(
            detail=f"{name}: {bad} of {master.numel()} elements of its fp32 master weights", outcome=NOTHING_LOADED, hint=""))


def check_same_save(compare_masters: Callable[[], set[str]], held: Callable[[], Held],
                    shapes: Mapping[str, tuple[int, ...]], witness: Mapping[str, Any] | None,
                    comms: Sequence[Comm | None], *, call: str = "load_sharded_state_dict()",
                    outcome: str = NOTHING_LOADED, hint: str = "") -> None:
    """Collective over `comms` (the optimizer's own groups, `together_over`): `compare_masters`
    (each layout's: raises `same_as_master`'s error, returns the parameters it compared), then
    every other parameter this rank holds (`held`) against the witness; one CheckpointError on
    every rank of the optimizer if either finds weights from another save."""
    from canzona.runtime.checkpoint_files import together_over

    def check() -> None:
        compared = compare_masters()
        detail = witness_mismatch({n: h for n, h in held().items() if n not in compared}, shapes, witness or {})
        if detail is not None:
            raise CheckpointError(WEIGHTS_FROM_ANOTHER_SAVE.format(detail=detail, outcome=outcome, hint=hint))

    together_over(comms, check, lambda _: None, call=call)


def check_loaded_weights(opt: Described, held: Callable[[], Held], shapes: Mapping[str, tuple[int, ...]],
                         comms: Sequence[Comm | None]) -> None:
    """At a step: where a load left the witness of the weights its state was saved with
    (`loaded_witness`), the weights this rank holds (`held`) equal it, or one CheckpointError on
    every rank before anything is updated (kept for a step called again). Collective over the
    optimizer's own groups (`comms`), once after each such load; nothing to do otherwise."""
    if not opt.loaded_witness:
        return
    check_same_save(set, held, shapes, opt.loaded_witness, comms, call="step()", outcome=NOTHING_STEPPED,
                    hint=NOT_BY_CHANCE)
    opt.loaded_witness = None


def check_weights_at_step(opt: Checkpointable) -> None:
    """`check_loaded_weights` in the ZeRO-1 layout (what `step()` calls first)."""
    check_loaded_weights(opt, lambda: _held(opt), _global_shapes(opt), own_comms(opt))


# --- the weights' witness: a few elements of every parameter, at any layout ----------------------

WITNESS_KEY = "weights_witness"  # in the sharded form's metadata (`sharded_meta`); True in state_dict()'s header
WITNESS_SIZE = 32  # elements of each parameter (all of a smaller one)

# per parameter this rank holds: (global offset of its local tensor's box, the local tensor, shaped as the box)
Held = Mapping[str, tuple[tuple[int, ...], Tensor]]


def witness_indices(name: str, numel: int) -> list[int]:
    """The elements of parameter `name` (global flat indices) its witness records: the first, the
    last, and others picked by a hash of the name (the same in every process and at any layout)."""
    return list(_picked(name, numel))


@functools.lru_cache(maxsize=1 << 16)  # a save and a load ask for each parameter's several times (hashes: 1 s at 4,000)
def _picked(name: str, numel: int) -> tuple[int, ...]:
    if numel <= WITNESS_SIZE:
        return tuple(range(numel))
    picked = {0, numel - 1}
    k = 0
    while len(picked) < WITNESS_SIZE:
        digest = hashlib.sha256(f"{name}#{k}".encode()).digest()
        picked.add(int.from_bytes(digest[:8], "little") % numel)
        k += 1
    return tuple(sorted(picked))


def _locate(index: list[int], shape: tuple[int, ...], start: tuple[int, ...],
            box: tuple[int, ...]) -> list[tuple[int, int]]:
    """(position in `index`, flat index in the box) of the global flat indices inside the box at `start`."""
    out = []
    for k, flat in enumerate(index):
        local, stride = 0, 1
        for d in range(len(shape) - 1, -1, -1):
            flat, coord = divmod(flat, shape[d])
            c = coord - start[d]
            if not 0 <= c < box[d]:
                break
            local += c * stride
            stride *= box[d]
        else:
            out.append((k, local))
    return out


def _values(local: Tensor, at: list[tuple[int, int]]) -> Tensor:
    """The elements of `local` at the box's flat indices of `at`, on the CPU."""
    where = torch.tensor([i for _, i in at], dtype=torch.long, device=local.device)
    return local.detach().reshape(-1)[where].cpu()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _bits(values: Tensor) -> list[str]:
    """Each value's bytes, in hex (exact, NaN payloads too)."""
    raw = values.contiguous().view(torch.uint8).reshape(values.numel(), -1)
    return [bytes(row.tolist()).hex() for row in raw]


def _from_bits(bits: list[str], dtype: torch.dtype) -> Tensor:
    return torch.frombuffer(bytearray.fromhex("".join(bits)), dtype=dtype).clone()


def take_witness(opt: Described, held: Held, comms: Sequence[Comm | None], *,
                 call: str = "sharded_state_dict()") -> dict[str, Any]:
    """Collective over the optimizer's own groups (`comms`, `together_over`; this process alone
    without torch.distributed): the witness of the weights as they are now (until a step has
    checked them, the one `load_state_dict` left: the loaded state still belongs to those weights,
    so a save before that step round-trips and keeps the check), identical on the optimizer's
    ranks, for the checkpoint's metadata: per parameter its dtype, the elements `witness_indices`
    picks and their values (bytes in hex), each from a rank that holds it. Only the optimizer's
    ranks: the default group's others may train another model (a replica on its own DP group,
    another pipeline stage: other values at the same names) and call nothing at that moment."""
    from canzona.runtime.checkpoint_files import together_over

    if opt.loaded_witness:  # the loaded state still belongs to those weights (no step checked them yet)
        return dict(opt.loaded_witness)
    shapes = _global_shapes(opt)

    def mine() -> dict[str, tuple[str, dict[int, str]]]:
        out = {}
        for name, (start, local) in held.items():
            shape = shapes[name]
            index = witness_indices(name, math.prod(shape))
            at = _locate(index, shape, start, tuple(local.shape))
            if at:
                out[name] = (_dtype_name(local.dtype), dict(zip((index[k] for k, _ in at), _bits(_values(local, at)))))
        return out

    def merge(every: list[dict[str, tuple[str, dict[int, str]]]]) -> dict[str, tuple[str, dict[int, str]]]:
        # each rank's elements (a TP shard's), the first holder's value of each (DP replicas alike)
        out: dict[str, tuple[str, dict[int, str]]] = {}
        for per in every:
            for name, (dtype, got) in per.items():
                values = out.setdefault(name, (dtype, {}))[1]
                for i, v in got.items():
                    values.setdefault(i, v)
        return out

    found = together_over(comms, mine, merge, call=call)
    return {name: {"dtype": found[name][0], "index": sorted(found[name][1]),
                   "bits": [found[name][1][i] for i in sorted(found[name][1])]} for name in sorted(found)}


WITNESS_FIELD = "canzona_weights_witness"  # in each entry of the layout-independent form


def _witness_values(name: str, numel: int, entry: Mapping[str, Any] | None) -> Tensor | None:
    """A parameter's witness (`take_witness`'s entry) as the tensor of its values, in its dtype, at
    `witness_indices` (None where it has no whole witness)."""
    if entry is None or list(entry["index"]) != witness_indices(name, numel):
        return None
    return _from_bits(list(entry["bits"]), getattr(torch, entry["dtype"]))


def state_dict_witness_to_check(state_dict: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """What `load_state_dict` of the layout-independent form leaves for the first step to check,
    under either layout: `witness_to_check` of the entries that stepped (`STEPPED_KEY`; one
    without it, of an older canzona, did)."""
    witness = saved_witness(state_dict, shapes)
    if not witness:
        return witness
    stepped_names = set()
    for group, names in zip(state_dict["param_groups"], group_names(state_dict)):
        for key, name in zip(group.get("params", []), names):
            entry = _entry(state_dict["state"], key)
            if not isinstance(entry, Mapping) or entry_stepped(entry):
                stepped_names.add(name)
    return witness_to_check(witness, stepped_names)


def saved_witness(state_dict: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """The witness a layout-independent state dict holds (`_witness_values` undone), in
    `take_witness`'s form; empty for one of an older canzona (or version 2; its header does not
    say it wrote one: a witness in it is a template's, left by a partial `dcp.load`) or with the
    fields dropped, which are not checked."""
    out: dict[str, Any] = {}
    if state_dict.get("format") == STATE_FORMAT or not _header_of(state_dict).get(WITNESS_KEY):
        return out
    for group, names in zip(state_dict["param_groups"], group_names(state_dict)):
        for key, name in zip(group.get("params", []), names):
            entry = _entry(state_dict["state"], key)
            values = entry.get(WITNESS_FIELD) if isinstance(entry, Mapping) else None
            if isinstance(values, Tensor) and name in shapes:
                index = witness_indices(name, math.prod(shapes[name]))
                if values.numel() == len(index):
                    out[name] = {"dtype": _dtype_name(values.dtype), "index": index, "bits": _bits(values.detach().reshape(-1).cpu())}
    return out


def _header_of(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The header a layout-independent state dict's groups carry (empty where none is readable)."""
    groups = state_dict.get("param_groups") or [{}]
    try:
        return dict(json_load(groups[0][HEADER_KEY]))
    except (KeyError, TypeError, ValueError):
        return {}


def without_weights_witness(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """`state_dict` (the layout-independent form) without the weights' witness: it loads beside
    any weights unchecked, as a state dict of an older canzona (on purpose: say, another model's
    weights under the same optimizer state). The entries are new dicts; their tensors are shared."""
    return {**state_dict, "state": {k: {f: v for f, v in e.items() if f != WITNESS_FIELD} if isinstance(e, Mapping)
                                    else e for k, e in state_dict["state"].items()}}


def witness_mismatch(held: Held, shapes: Mapping[str, tuple[int, ...]], witness: Mapping[str, Any]) -> str | None:
    """Where the weights this rank holds differ from the witness (None: nowhere). The witness's
    values are cast to each parameter's dtype now (a checkpoint loaded into another dtype: the
    weights were cast alike); NaN equals NaN."""
    for name in sorted(held):
        entry = witness.get(name)
        dtype = getattr(torch, entry.get("dtype", ""), None) if isinstance(entry, Mapping) else None
        if not isinstance(dtype, torch.dtype):
            continue  # no witness of it (a checkpoint of an older canzona)
        start, local = held[name]
        index, bits = list(entry["index"]), list(entry["bits"])
        at = _locate(index, shapes[name], start, tuple(local.shape))
        if not at or len(bits) != len(index):
            continue
        saved = _from_bits([bits[k] for k, _ in at], dtype)
        bad = mismatches(saved, _values(local, at))
        if bad:
            return f"{name}: {bad} of {len(at)} sampled elements here"
    return None


def mismatches(saved: Tensor, working: Tensor) -> int:
    """Elements of `working` that are not `saved` cast to its dtype (NaN equals NaN); where
    `saved` is the narrower float (a state dict cast to bf16 by hand, its witness with it),
    `working` cast to `saved`'s."""
    working = working.detach().reshape(-1)
    if saved.is_floating_point() and working.is_floating_point() and \
            torch.finfo(saved.dtype).bits < torch.finfo(working.dtype).bits:
        working = working.to(saved.dtype)
    cast = saved.reshape(-1).to(device=working.device, dtype=working.dtype)
    same = cast == working
    if working.is_floating_point():
        same |= cast.isnan() & working.isnan()
    return int((~same).sum())


def _held(opt: Checkpointable) -> dict[str, tuple[tuple[int, ...], Tensor]]:
    """Every parameter this rank holds, with its box in the global tensor: its TP shard (the
    whole parameter at TP 1), under expert parallelism a stack's experts of this EP rank."""
    ep_rank: dict[str, int] = {}  # a stack of this EP rank's experts: that EP rank
    if opt.experts is not None:
        for p in opt.experts.spec.stacks:
            first = opt.experts.global_name(stacked_matrices(p)[0].name)  # '<stack>[ep_rank x matrices]'
            ep_rank[p.name] = int(first[first.rindex(STACK_OPEN) + 1:-len(STACK_CLOSE)]) // p.stack_size
    tp, t = opt.mesh.size(TP), opt.mesh.rank(TP)
    out: dict[str, tuple[tuple[int, ...], Tensor]] = {}
    for name, p in opt.params.items():
        local, shape = local_tensor(p), opt.spec.param(name).shape
        if local.dim() != len(shape):
            continue
        start = [0] * len(shape)
        if name in ep_rank:
            start[0] = ep_rank[name] * local.shape[0]
        elif tuple(local.shape) != shape:
            dim = _tp_dim(opt, name)
            if dim is None:
                continue  # not a box this rank can place: not checked here
            start[dim] = t * -(-shape[dim] // tp)  # torch.chunk's (`shard_of`)
        if any(s + n > m for s, n, m in zip(start, local.shape, shape)):
            continue  # not a box inside the parameter: not checked here
        out[name] = (tuple(start), local)
    return out


def _slice(opt: Checkpointable, name: str, full: Tensor, offset: int, length: int) -> Tensor:
    """This rank's piece of a full tensor: its TP shard, flattened, `[offset, offset + length)`."""
    shard = shard_of(full.reshape(opt.spec.param(name).shape), _tp_dim(opt, name), opt.mesh.size(TP), opt.mesh.rank(TP))
    return shard.reshape(-1)[offset:offset + length]


def _check_compatible(opt: Described, sd: Mapping[str, Any], groups: list[Mapping[str, Any]],
                      state: Mapping[str, dict], names: list[str] | None = None) -> None:
    """Everything a wrong checkpoint gets wrong, checked before anything is changed (`sd`: the
    header; `names`: the checkpoint's parameters, which name the difference from another model
    where the header has no shapes)."""
    if not isinstance(sd, Mapping) or sd.get("format") != STATE_FORMAT:
        raise PlanError("not a canzona optimizer state (format mismatch)")
    if sd.get("version") not in READABLE_VERSIONS:
        raise PlanError(f"optimizer state version {sd.get('version')!r}; this canzona reads versions "
                        f"{', '.join(map(str, READABLE_VERSIONS))}")
    if sd.get("optimizer") != opt.optimizer:
        raise PlanError(f"checkpoint is for {sd.get('optimizer')}, this optimizer runs {opt.optimizer}")
    model = sd.get("model", {})
    mine = _global_shapes(opt)
    # the shapes: a sharded checkpoint's header and version 3's (for the message; the fingerprint covers them)
    shapes = {n: tuple(s) for n, s in model["shapes"].items()} if "shapes" in model else None
    if model.get("fingerprint") != opt.spec.fingerprint() or shapes not in (None, mine):
        detail = _first_difference(shapes, mine) if shapes is not None else \
            _stack_difference(opt, state) or _first_name_difference_of_model(names or [], mine)
        if model.get("fingerprint") != opt.spec.fingerprint():
            detail += parametrized_routing(opt.spec, "an optimizer state",
                                           "load the model's weights, and start the optimizer's state afresh",
                                           model.get("fingerprint"))
        raise PlanError(f"checkpoint is of model {model.get('name')!r} ({model.get('fingerprint')}), not "
                        f"{opt.spec.name!r} ({opt.spec.fingerprint()}): {detail}")
    unknown = sorted(set(state) - set(mine) - {m.name for m in opt.spec.matrix_params()})
    if unknown:
        raise PlanError(f"checkpoint has state for unknown parameter {unknown[0]!r}")
    saved_groups = [(g.get("kind"), g.get("optimizer")) for g in groups]
    my_groups = [(g["kind"], g["optimizer"]) for g in opt.param_groups]
    if saved_groups != my_groups:
        raise PlanError(f"checkpoint has parameter groups {saved_groups}, this optimizer {my_groups}")
    _check_kept_state(opt, sd, groups)


def saved_config(name: str, mine: Any, saved: Mapping[str, Any] | None, what: str) -> Any:
    """`mine` (a config of optimizer `name`) with the values a checkpoint's `what` records (None:
    none recorded, `mine` kept), validated as construction validates them: a key this version's
    config lacks (a checkpoint of another canzona) or a value of the wrong type or range is one
    PlanError naming it, before the state comparison computes with it or loading changes anything."""
    if saved is None:
        return mine
    unknown = sorted(set(saved) - {f.name for f in fields(mine)})
    if unknown:
        raise PlanError(f"checkpoint's {what} has {unknown[0]!r}, which this canzona's {name} configuration does "
                        "not have (saved by another canzona version?)")
    try:
        # as a group's values are read at a step (`groups.config_value`): lists as tuples, a tensor
        # or NumPy learning rate (torch keeps a tensor lr in the groups it saves) as its number
        return check_config(name, replace(mine, **{k: config_value(v) for k, v in saved.items()}))
    except SpecError as e:
        raise PlanError(f"checkpoint's {what} is not valid here: {e}") from None


def _check_kept_state(opt: Described, header: Mapping[str, Any], groups: list[Mapping[str, Any]]) -> None:
    """Loading restores the checkpoint's matrix_config and each group's hyper-parameters (as
    torch.optim's load_state_dict restores them), each validated first (`saved_config`): a
    configuration that keeps other optimizer state (SOAP's max_precond_dim) is not what this
    optimizer's plan priced (its memory, its step time: `check_plan_config`), so it is refused; one
    that changes only hyper-parameters wins. A header without a config keeps this optimizer's; a
    group's field it lacks is read as this optimizer's configuration has it."""
    saved = header.get("matrix_config")
    there = saved_config(opt.optimizer, opt.matrix_cfg, saved, "matrix_config")
    saved_config("adamw", opt.adamw_cfg, header.get("adamw_config"), "adamw_config")
    # each group's over the optimizer's configuration of its kind, not over the group as it stands:
    # loading replaces whatever the group holds now (a NaN rate, a refused edit: what a load may be
    # meant to undo), and every group keeps the state of that configuration (`groups.GroupConfigs`)
    bases = {"matrix": opt.matrix_cfg, "adamw": opt.adamw_cfg}
    theirs = [saved_config(group["optimizer"], bases[group["kind"]],
                           {f.name: kept[f.name] for f in fields(bases[group["kind"]]) if f.name in kept},
                           f"param group {g}") for g, (group, kept) in enumerate(zip(opt.param_groups, groups))]
    if matrix_optimizer(opt.optimizer).elementwise:  # AdamW's state has one form
        return
    if saved is not None:
        differs = state_difference(opt.optimizer, opt.spec.matrix_params(), there, opt.matrix_cfg)
        if differs is not None:
            raise PlanError(f"checkpoint was saved with {opt.optimizer} matrix_config "
                            f"{matrix_config_json(opt.optimizer, there)}, which keeps other optimizer state than "
                            f"this optimizer's {matrix_config_json(opt.optimizer, opt.matrix_cfg)} ({differs}): "
                            "build the optimizer with the checkpoint's matrix_config and a plan made for it")
    members = group_matrices(opt.param_groups, opt.params, opt.spec)  # a stack's matrices counted too
    for g, there in enumerate(theirs):
        if g not in members:
            continue
        differs = state_difference(opt.optimizer, members[g], there, opt.matrix_cfg)
        if differs is not None:
            raise PlanError(f"checkpoint was saved with {opt.optimizer} param group {g} at "
                            f"{matrix_config_json(opt.optimizer, there)}, which keeps other optimizer state than "
                            f"this optimizer's group {g} at {matrix_config_json(opt.optimizer, opt.matrix_cfg)} "
                            f"({differs}): build the optimizer with the checkpoint's param groups and a plan "
                            "made for them")


def _global_shapes(opt: Described) -> dict[str, tuple[int, ...]]:
    """Every parameter's global shape (what the checkpoint's full tensors have)."""
    return {n: opt.spec.param(n).shape for n in opt.params}


def _first_difference(saved: dict[str, tuple], mine: dict[str, tuple]) -> str:
    for name in sorted(set(saved) | set(mine)):
        if name not in mine:
            return f"this model has no parameter {name!r}"
        if name not in saved:
            return f"the checkpoint has no parameter {name!r}"
        if saved[name] != mine[name]:
            return f"{name} is {list(saved[name])} there, {list(mine[name])} here"
    return "same parameter names and shapes, but other roles or tensor-parallel layout"


def _stack_difference(opt: Described, state: Mapping[str, dict]) -> str | None:
    """The first stack whose saved matrices (`state_by_name`'s `'<stack>[k]'` entries) number other
    than here: a checkpoint of another number of experts, whose header names no shapes."""
    for name in sorted(opt.params):
        here = opt.spec.param(name).stack_size
        there = sum(1 for key in state if key.startswith(f"{name}{STACK_OPEN}"))
        if here and there and there != here:
            return f"{name} stacks {there} matrices there, {here} here (another number of experts)"
    return None


def _first_name_difference_of_model(saved: list[str], mine: Mapping[str, tuple]) -> str:
    """`_first_difference` where the checkpoint names its parameters but not their shapes."""
    extra, missing = sorted(set(saved) - set(mine)), sorted(set(mine) - set(saved))
    if extra:
        return f"this model has no parameter {extra[0]!r}"
    if missing and saved:
        return f"the checkpoint has no parameter {missing[0]!r}"
    return "other parameter shapes, roles or tensor-parallel layout"


def _to_cpu(state: Mapping[str, Any]) -> dict[str, Any]:
    """CPU copies, contiguous in the one copy (what `full_state` saves: no second copy of a
    column-major field there)."""
    return {k: v.detach().to("cpu", memory_format=torch.contiguous_format, copy=True) if isinstance(v, Tensor) else v
            for k, v in state.items()}


def _to_device(state: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.detach().to(device, copy=True) if isinstance(v, Tensor) else v for k, v in state.items()}


def matrix_state_to_device(optimizer: str, state: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """A loaded matrix state on `device`, in the layout its kernel keeps
    (`MatrixOptimizer.column_major_state`: SOAP's eigenbases column-major, as eigh and QR leave
    them): saved contiguous, they would load row-major, and the resumed kernel's products would
    round otherwise than the uninterrupted run's. Every layout's load places its state through it."""
    out = _to_device(state, device)
    for key in matrix_optimizer(optimizer).column_major_state:
        t = out.get(key)
        if isinstance(t, Tensor) and t.dim() >= 2:
            out[key] = t.mT.contiguous().mT
    return out


def _header(opt: Described, shapes: bool = True) -> dict[str, Any]:
    """Everything but the tensors: what `load_state` checks and restores (identical on every rank).
    `shapes`: every parameter's, which name the first difference from another model (the
    fingerprint alone refuses it)."""
    model = {"name": opt.spec.name, "fingerprint": opt.spec.fingerprint()}
    if shapes:
        model["shapes"] = {n: list(s) for n, s in _global_shapes(opt).items()}
    return {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "model": model,
        "optimizer": opt.optimizer,
        "matrix_config": asdict(opt.matrix_cfg),
        "adamw_config": asdict(opt.adamw_cfg),
    }


# --- torch.distributed.checkpoint: every rank writes only what it holds -------------------------

DCP_PREFIX = "canzona_optimizer"


def _piece_key(prefix: str, kind: str, name: str, field: str, tp_rank: int, tp: int, offset: int) -> str:
    """A flat piece of TP shard `tp_rank` of `tp` of a full tensor, starting at element `offset`."""
    return f"{prefix}/{kind}/{name}/{field}@{tp_rank}.{tp}:{offset}"


def _parse_piece(rest: str) -> tuple[str, int, int, int]:
    """`field@t.T:offset` -> (field, t, T, offset); `field@offset` (written at TP = 1) is shard 0 of 1."""
    field, where = rest.rsplit("@", 1)
    if ":" not in where:
        return field, 0, 1, int(where)
    shard, offset = where.split(":")
    t, tp = shard.split(".")
    return field, int(t), int(tp), int(offset)


def meta_key(opt: Described, prefix: str = DCP_PREFIX) -> str:
    """The key of an optimizer's metadata entry: one per optimizer (a digest of its parameters'
    names, alike on each of its ranks), so that optimizers of distinct parameters saved in one
    `dcp.save` (one per pipeline stage, as torchtitan saves them) each keep theirs. Under one key,
    dcp's planner wrote one of them: the save succeeded and the other stage's resume was refused
    (or loaded another stage's groups). Saves before it wrote `{prefix}/meta` (`read_sharded`
    still reads it)."""
    digest = hashlib.sha256("\n".join(sorted(opt.params)).encode()).hexdigest()[:16]
    return f"{prefix}/meta/{digest}"


def _saved_meta_key(opt: Described, prefix: str, entries: Mapping[str, Any]) -> str:
    """The metadata key of `opt`'s in a checkpoint's entries: its own (`meta_key`), the one
    written before there was one per optimizer, or the only one there (another model's, which
    loading refuses naming the difference)."""
    own, older = meta_key(opt, prefix), f"{prefix}/meta"
    if own in entries or older in entries:
        return own if own in entries else older
    others = sorted(k for k in entries if k.startswith(f"{older}/"))
    if not others:
        raise PlanError(f"no canzona optimizer state under {prefix!r} in this checkpoint")
    if len(others) > 1:
        raise PlanError(f"this checkpoint holds the state of {len(others)} canzona optimizers under {prefix!r}, "
                        "none over this optimizer's parameters (names): load each with the optimizer it was saved "
                        "with (a pipeline stage's with its stage's)")
    return others[0]


def sharded_meta(opt: Described, prefix: str = DCP_PREFIX, witness: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The small metadata entry every rank holds alike: the header, the groups' hyper-parameters
    and members (by name: a loader checks that its groups hold the same), and the weights' witness
    (`take_witness`, for `check_weights`; a loader that knows none ignores it)."""
    # JSON text: a leaf for dcp (a dict would be flattened into one entry per field)
    name_of = {id(p): n for n, p in opt.params.items()}
    meta = {**_header(opt), "param_groups": [{**{k: v for k, v in g.items() if k not in ("params", HEADER_KEY)},
                                              NAMES_KEY: [name_of[id(p)] for p in g["params"]]}
                                             for g in opt.param_groups]}
    if witness is not None:
        meta[WITNESS_KEY] = dict(witness)
    encode = _SharedTensors()
    text = json.dumps(meta, default=encode)
    numpy_types = [{k: t for k, v in g.items() if (t := _numpy_type(v)) is not None} for g in meta["param_groups"]]
    beside = {**({TENSOR_DEVICES_KEY: encode.devices} if encode.devices else {}),
              **({NUMPY_TYPES_KEY: numpy_types} if any(numpy_types) else {})}
    if beside:  # beside the values, not in them: an older loader takes them and ignores the keys
        text = json.dumps({**json.loads(text), **beside})
    return {meta_key(opt, prefix): text}


def piece_key(prefix: str, kind: str, name: str, field: str, offset: int) -> str:
    """A flat piece of a full tensor (a TP size 1 piece) starting at element `offset`."""
    return _piece_key(prefix, kind, name, field, 0, 1, offset)


def sharded_state(opt: Checkpointable, prefix: str = DCP_PREFIX) -> dict[str, Any]:
    """This rank's part of the state as flat `torch.distributed.checkpoint` entries: the matrix
    states it saves (full), its shards of their master weights, its AdamW pieces, and the small
    metadata every rank holds alike, with the witness of the weights as they are now. Compose
    with the model's entries in one `dcp.save`. Collective (the witness: a small all-gather over
    the optimizer's DP group, then its TP group, `own_comms`), as `dcp.save` is."""
    current_masters(opt)
    out = sharded_meta(opt, prefix, take_witness(opt, _held(opt), own_comms(opt)))
    for part in _parts(opt):  # every entry under the model's name
        g = part.global_name
        states, masters = _saved_here(part)
        t, tp = part.mesh.rank(TP), part.mesh.size(TP)
        for name, state in part.matrix_state.items():
            if state and name in states:
                for key, value in state.items():
                    out[f"{prefix}/matrix/{g(name)}/{key}"] = value
        for name in sorted(masters):
            out[_piece_key(prefix, "matrix", g(name), "master", t, tp, 0)] = part.master[name]
        for name, off, state in _adamw_pieces(part):
            for key, value in state.items():
                out[_piece_key(prefix, "adamw", g(name), key, t, tp, off)] = value
    return out


def load_sharded(opt: Checkpointable, checkpoint_id: Any, prefix: str = DCP_PREFIX, *,
                 check_weights: bool | None = None) -> None:
    """Read what this rank needs under its own layout from a checkpoint written by `sharded_state`
    at any DP x TP layout, rebuild the layout-independent form for it, and load that.
    `check_weights`: the model's weights were just loaded from the same save; refuse (collective,
    before anything is changed) if they are not its masters cast or differ from its witness
    (`check_weights_match`). None (the default): the first step after the load checks them
    (`check_loaded_weights`: the model may be loaded after it); False: not checked (weights
    changed on purpose, as `without_weights_witness` for the layout-independent form)."""
    # every part's entries under the model's names
    hosted = [part.global_name(n) for part in _parts(opt) for n in part.hosted]
    applies = [part.global_name(n) for part in _parts(opt) for n in part.applies]
    tp_rank, tp_size = opt.mesh.rank(TP), opt.mesh.size(TP)

    def wants(name: str, lo: int, hi: int) -> Wants:
        # a TP-replicated parameter's pieces were written by TP rank 0 only
        source = tp_rank if _tp_dim(opt, name) is not None else 0
        return lambda t, tp, offset, meta: tp != tp_size or (t == source and _overlaps(meta, offset, lo, hi))

    needs = {part.global_name(n): wants(part.global_name(n), *r) for part in _parts(opt)
             for n, r in _local_ranges(part).items()}
    meta, state, stepped_names = read_sharded(opt, checkpoint_id, prefix, hosted, applies, needs, own_comms(opt))
    state = agree_on_save(opt, meta, own_comms(opt), state)  # checks compatibility first
    if check_weights:
        check_weights_match(opt, state, meta.get(WITNESS_KEY))
    load_by_name(opt, meta, meta.get("param_groups", []), state)
    # unchecked here (the model may be loaded after it): the first step checks (`check_loaded_weights`)
    opt.loaded_witness = witness_to_check(meta.get(WITNESS_KEY), stepped_names) if check_weights is None else None


def agree_on_save(opt: Described, meta: Mapping[str, Any], comms: list[Comm | None],
                  state: Mapping[str, dict]) -> dict[str, dict]:
    """The ranks of `comms` read the same save: its metadata entry (the header, the groups and the
    weights' witness: another save's differs) alike on each. Before, ranks given folders of two
    saves (a path that differs by rank, `latest_checkpoint` looked up on each while a save landed)
    each loaded their own pieces of their own, silently mixing the saves. And none read a NaN or
    Inf in what it read of the state (`state`, its own pieces), which every rank then refuses. An
    exception in those checks on one rank (a bug, a dtype the reduction cannot read) is raised
    there and named on the others at once, in the same round (before, it was raised outside it:
    the others waited in it until timeout_s, and the group broke). Returns `state` with each
    floating field in the dtype the live configuration keeps it in (`cast_to_live`, in the same
    round: a refusal of the cast, a value it overflows, is one error on every rank too). Before
    the cast, the save is checked to be of this model and configuration (`_check_compatible`, as
    the full form's `read_state` checks first): before, a save of another model into an fp16
    state was refused naming a value the cast overflows, not the other model."""
    error: Exception | None = None
    digest = b""
    try:
        _check_compatible(opt, meta, meta.get("param_groups", []), state)  # the likelier mistake first
        state = cast_to_live(opt, state)
        refused = nonfinite_state_error(state.items())
        error = None if refused is None else CheckpointError(refused)
        digest = json.dumps(meta, sort_keys=True, default=_json_scalar).encode()
    except Exception as e:  # noqa: BLE001 - spread to every rank by `agree`, raised here as it is
        error = e
    agree(comms, error, digest, "load_sharded_state_dict()",
          "read another checkpoint than this rank (their optimizer metadata differ): every rank must load the "
          "same save")
    return dict(state)


Wants = Callable[[int, int, int, Any], bool]  # (saved TP rank, TP size, offset, its metadata) -> read it


def read_sharded(opt: Described, checkpoint_id: Any, prefix: str, hosted: list[str], applies: list[str],
                 needs: Mapping[str, Wants], comms: Sequence[Comm | None]) -> tuple[dict[str, Any],
                                                                                 dict[str, dict[str, Any]], set[str]]:
    """(the header with the groups, the state by name, the parameters whose saved state stepped:
    `stepped`, alike on every rank, from the checkpoint's entries, a rank reading only its own
    pieces) of what a rank needs, read from a checkpoint
    written by `sharded_state` (or FSDP's) at any layout: the full-matrix state of the matrices in
    `hosted`, the scalar fields (step counts) of the others in `applies`, and of each parameter in
    `needs` the pieces its predicate wants, assembled into full tensors (zeros where none was
    read). Collective over the ranks of `comms` (the optimizer's own groups, `OwnRanks`) alone:
    each rank reads its pieces by itself (`dcp.load(no_dist=True)`; a collective `dcp.load` spans
    the default process group, whose other ranks, another replica or pipeline stage, may be
    loading their own checkpoint later or never), and a failure on any is one error on all."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    # the reader runs no code from the files
    from canzona.runtime.checkpoint_files import OwnRanks, first_line, verified_reader

    # a folder: checked against its manifest where it has one (every rank calls this, collective)
    call = "load_sharded_state_dict()"
    own = OwnRanks(comms, timeout_s=opt.timeout_s, call=call)
    reader = checkpoint_id if hasattr(checkpoint_id, "read_metadata") else \
        verified_reader(checkpoint_id, comms=comms, timeout_s=opt.timeout_s, call=call)
    # read by each rank, failing on every rank alike: a rank that cannot read it (a folder on
    # node-local disk) would otherwise raise alone, its peers waiting in the next collective
    metadata: list[Any] = []
    own.together(lambda: metadata.append(_pieces_fit(opt, prefix, reader.read_metadata())))
    entries = metadata[0].state_dict_metadata

    def placeholder(key: str) -> Any:
        m = entries[key]
        if isinstance(m, TensorStorageMetadata):
            return torch.empty(tuple(m.size), dtype=m.properties.dtype)
        return None  # a pickled object: dcp.load replaces the entry

    meta_entry = _saved_meta_key(opt, prefix, entries)
    full_keys: dict[str, list[str]] = {}  # matrix name -> keys of its full-matrix state fields
    # name -> (field, t, T, offset, key, the part of the saved piece that is this entry's: None, all of it)
    pieces: dict[str, list[tuple[str, int, int, int, str, tuple[int, int] | None]]] = {}
    saved_fields: dict[str, set[str]] = {}  # parameter (a stack's matrices: the stack) -> its saved fields
    for key in entries:
        for kind in ("matrix", "adamw"):
            head = f"{prefix}/{kind}/"
            if key.startswith(head):
                name, rest = key[len(head):].rsplit("/", 1)
                saved_fields.setdefault(name.split(STACK_OPEN)[0], set()).add(rest.split("@", 1)[0])
                if "@" in rest:
                    pieces.setdefault(name, []).append((*_parse_piece(rest), key, None))
                else:
                    full_keys.setdefault(name, []).append(key)
    wanted: dict[str, Any] = {meta_entry: placeholder(meta_entry)}
    for name in hosted:
        wanted.update({k: placeholder(k) for k in full_keys.get(name, [])})
    # of a matrix whose chunks this rank applies but does not host, the scalar fields (its step):
    # the step count the rank applies them by comes from them (`load_by_name`)
    scalar_fields: dict[str, list[str]] = {
        name: [k for k in full_keys.get(name, []) if not isinstance(entries[k], TensorStorageMetadata)]
        for name in applies if name not in hosted}
    wanted.update({k: placeholder(k) for keys in scalar_fields.values() for k in keys})
    _stack_pieces_by_matrix(opt, pieces, entries, needs)
    for name, want in needs.items():
        for _field, t, tp, offset, key, part in pieces.get(name, []):
            if want(t, tp, offset, entries[key] if part is None else _Extent((part[1] - part[0],))):
                wanted[key] = placeholder(key)
    def load_here() -> None:
        try:
            with warnings.catch_warnings():
                # that it loads in this process alone: as meant (each rank its own pieces)
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                dcp.load(wanted, storage_reader=reader, no_dist=True)
        except dcp.CheckpointException as e:
            # DCP's error is a BaseException, past `except Exception`, whose message is a
            # traceback: its cause, on one line (this rank alone failed: no rank to name)
            cause = min(e.failures.items(), key=lambda item: item[0])[1][0] if e.failures else e
            raise CheckpointError(first_line(cause)) from None

    try:
        own.together(load_here)
    except CheckpointError as e:
        raise CheckpointError(f"optimizer state not loaded, nothing changed: {e}") from None

    state: dict[str, dict[str, Any]] = {}
    for name, keys in [*((n, full_keys.get(n, [])) for n in hosted), *scalar_fields.items()]:
        if keys:
            state[name] = {k.rsplit("/", 1)[1]: wanted[k] for k in keys}
    for name in needs:
        got = [(f, t, tp, off, _part_of(wanted[key], part)) for f, t, tp, off, key, part in pieces.get(name, [])
               if key in wanted]
        if got:
            state.setdefault(name, {}).update(_assemble(opt, name, got))
    # tensor hyper-parameters on this rank's device of the type saved (`restore_settings` then
    # moves them to the group's own tensor's device, once the ranks agree on what they read)
    own = local_tensor(next(iter(opt.params.values()))).device
    meta = json_load(wanted[meta_entry], functools.partial(saved_tensor_device, own=own))
    return meta, state, {n for n, f in saved_fields.items() if stepped(f)}


def _pieces_fit(opt: Described, prefix: str, metadata: Any) -> Any:
    """`metadata`, each of its pieces of a parameter of this model (`<field>@t.T:offset`) checked to
    lie inside that parameter's flat shard at TP size T (a stack saved under its own name: the
    stack's matrices) before any is allocated: a piece claiming more (a crafted entry, which a
    stream-transformed one is not held to by its stored bytes) is one CheckpointError."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stacks = {s.name: s for s in opt.spec.stacks}
    for key, m in metadata.state_dict_metadata.items():
        for kind in ("matrix", "adamw"):
            head = f"{prefix}/{kind}/"
            if not key.startswith(head) or not isinstance(m, TensorStorageMetadata) or "@" not in key[len(head):]:
                continue
            name, rest = key[len(head):].rsplit("/", 1)
            try:
                _, _, tp, offset = _parse_piece(rest)
                bound = math.prod(opt.spec.param(name).local_shape(tp)) if name not in stacks else \
                    len(stacked_matrices(stacks[name])) * math.prod(stacks[name].matrix_shape)
            except (ValueError, SpecError):
                continue  # not a piece of this model's: the checks after the read name it
            if offset + math.prod(m.size) > bound:
                raise CheckpointError(f"optimizer state not loaded, nothing changed: the checkpoint's entry {key!r} "
                                      f"claims {list(m.size)} at offset {offset}, past its parameter's {bound} "
                                      "elements (a damaged or crafted .metadata)")
    return metadata


class _Extent(NamedTuple):
    """The size of the part of a saved piece an entry reads (`_overlaps` reads `size`)."""

    size: tuple[int, ...]


def _part_of(value: Any, part: tuple[int, int] | None) -> Any:
    return value if part is None or not isinstance(value, Tensor) else value.reshape(-1)[part[0]:part[1]]


def _stack_pieces_by_matrix(opt: Described, pieces: dict[str, list], entries: Mapping[str, Any],
                            needs: Mapping[str, Wants]) -> None:
    """A stack's pieces saved under the stack's own name (FSDP2's sharded form until 2026-12-02:
    each rank's flat range of the whole stack) as the parts of the matrices each spans, for a
    reader that asks for the matrices (`'<param>[k]'`: the ZeRO-1 layout's). Before, that reader
    found no piece of them and resumed the stacks' state from zeros, silently."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for spec in opt.spec.stacks:
        if spec.name in needs or spec.name not in pieces:  # a reader of the stack itself joins them
            continue
        size = math.prod(spec.matrix_shape)
        for field, t, tp, offset, key, _ in pieces[spec.name]:
            if tp != 1:  # FSDP2 wrote whole-stack ranges at TP 1 only
                continue
            meta = entries[key]
            numel = math.prod(meta.size) if isinstance(meta, TensorStorageMetadata) else None
            for k, matrix in enumerate(stacked_matrices(spec)):
                if numel is None:  # a scalar field (the step count): every matrix's
                    pieces.setdefault(matrix.name, []).append((field, t, tp, 0, key, None))
                    continue
                first, last = max(offset, k * size), min(offset + numel, (k + 1) * size)
                if first < last:
                    pieces.setdefault(matrix.name, []).append(
                        (field, t, tp, first - k * size, key, (first - offset, last - offset)))


def _local_ranges(opt: Checkpointable) -> dict[str, tuple[int, int]]:
    """Per parameter whose pieces this rank needs, the range of its local tensor it holds."""
    out = {name: (off, off + e - s) for name, _, s, e, off in opt.adamw_parts()}
    for name in opt.applies:
        out[name] = (0, math.prod(opt.spec.param(name).local_shape(opt.mesh.size(TP))))
    return out


def _overlaps(meta: Any, offset: int, lo: int, hi: int) -> bool:
    """Whether a piece at `offset` (its elements, whatever its shape) overlaps [lo, hi)."""
    size = getattr(meta, "size", None)
    return size is None or (offset < hi and offset + math.prod(size) > lo)


def _assemble(opt: Described, name: str, got: list) -> dict[str, Any]:
    """A parameter's pieces in the layout-independent form: full tensors (zeros where no piece was
    read, outside what this rank loads) and the scalars. A field's pieces saved in several dtypes
    (one DP rank's slices converted) are assembled in their promoted dtype, each exactly, and cast
    once to the live one (`cast_to_live`); before, in the dtype of the piece read first, which
    rounded the others twice, by read order."""
    spec = opt.spec.param(name)
    out: dict[str, Any] = {}
    shards: dict[str, dict[int, Tensor]] = {}  # field -> saved TP rank -> its flat shard
    dtypes: dict[str, torch.dtype] = {}  # field -> the promoted dtype of its pieces
    for field, _, _, _, value in got:
        if isinstance(value, Tensor):
            dtypes[field] = torch.promote_types(dtypes.get(field, value.dtype), value.dtype)
    saved_tp = 1
    for field, t, tp, offset, value in got:
        if not isinstance(value, Tensor):
            out[field] = value
            continue
        saved_tp = tp
        numel = math.prod(spec.local_shape(tp))
        flat = shards.setdefault(field, {}).setdefault(t, torch.zeros(numel, dtype=dtypes[field]))
        flat[offset:offset + value.numel()] = value.reshape(-1)
    shape = spec.local_shape(saved_tp)
    for field, by_rank in shards.items():
        dtype = next(iter(by_rank.values())).dtype
        parts = [by_rank.get(t, torch.zeros(math.prod(shape), dtype=dtype)).view(shape) for t in range(saved_tp)]
        out[field] = unshard(parts, spec.tp_dim if saved_tp > 1 else None)
    return out


# a one-element tensor in the JSON metadata: its number, dtype and shape (`_json_scalar`)
TENSOR_VALUE_KEY = "canzona_tensor"


def _json_scalar(value: Any) -> Any:
    """A one-element tensor (a scheduler's tensor learning rate) as its number, dtype and shape,
    which `json_load` makes a tensor again (the step computes with a tensor rate in its dtype: a
    float in its place would resume within rounding only), or a NumPy scalar (a schedule computed
    with NumPy; before, a TypeError) as the number it holds, as a step reads it."""
    if isinstance(value, Tensor) and value.numel() == 1:
        return {TENSOR_VALUE_KEY: value.item(), "dtype": str(value.dtype).removeprefix("torch."),
                "shape": list(value.shape)}
    plain = config_value(value)
    if isinstance(plain, (bool, int, float)):
        return plain
    raise TypeError(f"cannot store {type(value).__name__} in the checkpoint's metadata")


def _digest_value(value: Any) -> Any:
    """A value the ranks' state dicts are compared by: a tensor hyper-parameter by its number, dtype
    and shape (its repr names its device, which differs by rank on GPUs, and rounds to 4 digits)."""
    try:
        return _json_scalar(value)
    except TypeError:
        return repr(value)


# the sharded metadata's map of each tensor's `ref` to its device's type (`_SharedTensors`)
TENSOR_DEVICES_KEY = "tensor_devices"


class _SharedTensors:
    """`_json_scalar` numbering each tensor (`ref`), so that `json_load` gives the groups that held
    one tensor one tensor again (a user group's rate, split by kind, as torch's defaults share one),
    and keeping its device's type by ref (`devices`, for `TENSOR_DEVICES_KEY`: the metadata is alike
    on every rank, so not the index; kept beside the tensor's own object, whose exact keys a loader
    of canzona before 2026-12-02 checks; only here, not in what the ranks compare, where a
    placement is no difference)."""

    def __init__(self) -> None:
        self.refs: dict[int, int] = {}
        self.devices: dict[str, str] = {}

    def __call__(self, value: Any) -> Any:
        out = _json_scalar(value)
        if isinstance(value, Tensor):
            out["ref"] = self.refs.setdefault(id(value), len(self.refs))
            self.devices[str(out["ref"])] = value.device.type
        return out


# the sharded metadata's record of each group's NumPy hyper-parameters' types (`_numpy_type`), by
# group, beside the numbers themselves (which a loader that knows no record takes as they are)
NUMPY_TYPES_KEY = "numpy_types"


def _numpy_type(value: Any) -> Any:
    """The record of a NumPy hyper-parameter's type: its dtype's name (`"float32"`) for a NumPy
    scalar, `"ndarray:<dtype>"` for a 0-d array (as torch's own state_dict round trip keeps it), a
    list of records (None for a plain element) for a tuple or list holding one (AdamW's `betas`);
    None where there is no NumPy value."""
    if isinstance(value, (tuple, list)):
        inner = [_numpy_type(v) for v in value]
        return inner if any(t is not None for t in inner) else None
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == () and hasattr(value, "dtype"):
        return f"ndarray:{value.dtype.name}" if type(value).__name__ == "ndarray" else value.dtype.name
    return None


def _numpy_again(value: Any, record: Any, where: str) -> Any:
    """`value` (a number, or a list of them, as JSON gives it) of the NumPy type `record` names
    (`_numpy_type`); exactly the number saved, else one CheckpointError (a record that does not
    fit its number: an edited file)."""
    if record is None:
        return value
    if isinstance(record, list):
        if not isinstance(value, (list, tuple)) or len(value) != len(record):
            raise CheckpointError(f"the sharded checkpoint's NumPy record for {where} does not fit its value {value!r}")
        return type(value)(_numpy_again(v, r, where) for v, r in zip(value, record))
    import numpy

    array, _, name = str(record).rpartition(":")
    try:
        dtype = numpy.dtype(name)
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in "biuf" or array not in ("", "ndarray") or \
            isinstance(value, bool) != (dtype.kind == "b") or not isinstance(value, (bool, int, float)):
        raise CheckpointError(f"the sharded checkpoint records {where} as NumPy {record!r}, "
                              f"which its value {value!r} is not")
    with warnings.catch_warnings(), numpy.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        try:
            made = numpy.array(value, dtype=dtype)
        except (OverflowError, ValueError):
            made = None
    if made is None or made.item() != value:
        raise CheckpointError(f"the sharded checkpoint records {where} as NumPy {record!r}, "
                              f"which its value {value!r} is not")
    return made if array else made[()]


def _numpy_types_again(meta: Any) -> None:
    """The sharded metadata's groups' NumPy hyper-parameters of the type saved (`NUMPY_TYPES_KEY`),
    in place; a save that recorded none (before 2026-12-03) keeps the plain numbers."""
    if not isinstance(meta, dict) or NUMPY_TYPES_KEY not in meta:
        return
    records, groups = meta[NUMPY_TYPES_KEY], meta.get("param_groups")
    if not isinstance(records, list) or not isinstance(groups, list) or len(records) != len(groups) or \
            not all(isinstance(r, dict) and isinstance(g, dict) for r, g in zip(records, groups)):
        raise CheckpointError("the sharded checkpoint's NumPy records do not match its param_groups")
    for i, (record, group) in enumerate(zip(records, groups)):
        for key, kind in record.items():
            if key not in group:
                raise CheckpointError(f"the sharded checkpoint records param_groups[{i}][{key!r}] as NumPy, "
                                      "which it does not hold")
            group[key] = _numpy_again(group[key], kind, f"param_groups[{i}][{key!r}]")


def saved_tensor_device(saved_type: str | None, own: torch.device) -> torch.device:
    """Where a tensor hyper-parameter of the sharded form is read to: this rank's device (`own`,
    the parameters') where it was saved from one of that type (a CUDA save onto this rank's GPU);
    else the CPU, as a scheduler makes them (a save that recorded no type, before there was one,
    or a type this rank does not run on). A group that holds a tensor under the key then takes it
    on that tensor's device (`_onto_held_devices`); the full form keeps the tensor it saved, device
    and all, as torch's load does."""
    return own if saved_type is not None and saved_type == own.type else torch.device("cpu")


def json_load(text: str, device_of: Callable[[str | None], torch.device] | None = None) -> Any:
    """The metadata `json.dumps(..., default=_json_scalar)` wrote, its tensors tensors again (one
    tensor for each `ref`), on `device_of(the type saved, or None)` (`TENSOR_DEVICES_KEY`), by
    default the CPU."""
    made: dict[Any, Tensor] = {}
    devices = json.loads(text).get(TENSOR_DEVICES_KEY, {}) if TENSOR_DEVICES_KEY in text else {}

    def tensor(obj: dict[str, Any]) -> Any:
        if set(obj) - {"ref"} != {TENSOR_VALUE_KEY, "dtype", "shape"} or \
                not isinstance(getattr(torch, str(obj["dtype"]), None), torch.dtype):
            return obj
        ref = obj.get("ref", object())
        if ref not in made:
            saved = devices.get(str(ref)) if "ref" in obj else None
            device = device_of(saved) if device_of is not None else torch.device("cpu")
            made[ref] = torch.tensor(obj[TENSOR_VALUE_KEY], dtype=getattr(torch, obj["dtype"]),
                                     device=device).reshape(obj["shape"])
        return made[ref]
    out = json.loads(text, object_hook=tensor)
    _numpy_types_again(out)
    return out


def _onto_held_devices(groups: Sequence[Mapping[str, Any]], values: list[dict[str, Any]]) -> None:
    """The sharded form's tensor hyper-parameters `values` (by group) moved to the device of the
    tensor each group holds now under the key (what the resumed run built it with, on the device its
    scheduler and kernels use), once each: shared stays shared."""
    moved: dict[int, Tensor] = {}
    for group, saved in zip(groups, values):
        for key, value in saved.items():
            held = group.get(key)
            if isinstance(value, Tensor) and isinstance(held, Tensor):
                saved[key] = moved.setdefault(id(value), value.to(held.device))
