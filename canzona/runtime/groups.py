"""Parameter groups: the user's groups (as for any torch optimizer) split by the routing rule into
matrix-optimizer and AdamW groups, each carrying every hyper-parameter of its optimizer.

Every hyper-parameter in `param_groups` is live, as users of torch optimizers expect: an LR
scheduler, a weight-decay schedule or a hand edit of `momentum` changes the next step. Groups are
how users give norms, biases and embeddings no weight decay:

    DistributedOptimizer([
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0},
    ], spec, "muon")

A key applies to the parameters of the group whose optimizer has that hyper-parameter (`lr` and
`weight_decay` to both); a key no optimizer of the group's parameters has is an error. A key that
changes what optimizer state a group's matrices keep (SOAP's `max_precond_dim`) is the plan's, not
the group's: the plan priced every matrix's state at `matrix_config` (`canzona.plan.check_plan_config`),
so a group giving it another value is an error at construction, and a group edited to one at the
next step (`kept_state_change`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, fields, replace
from typing import TYPE_CHECKING, Any

from torch import Tensor

from canzona.cost import one_per_shape, state_difference
from canzona.errors import CanzonaError, PlanError, SpecError
from canzona.optimizers import check_config
from canzona.spec import ModelSpec, ParamSpec

if TYPE_CHECKING:
    from canzona.runtime.comm import Comm

KINDS = ("matrix", "adamw")
# torch.optim.AdamW's flags that change what its step computes, each with the value canzona's AdamW
# runs (torch's default): an AdamW group carrying another (a hand edit of `param_groups`, a group
# copied from torch's AdamW) is one error at the next step, not a flag silently ignored. `foreach`
# and `fused` only choose torch's kernels: any value is accepted and canzona runs its own.
TORCH_ADAMW_FLAGS = {"maximize": False, "amsgrad": False, "decoupled_weight_decay": True,
                     "differentiable": False, "capturable": False}
NamedParams = Iterable[tuple[str, Tensor]]


def user_groups(given: NamedParams | Iterable[Mapping[str, Any]],
                spec: ModelSpec) -> list[tuple[list[tuple[str, Tensor]], dict]]:
    """(named parameters, overrides) per user group; a plain iterable of pairs is one group. A name
    that reaches the parameter through a wrapper (`model.named_parameters()` of a model with
    torch.compile'd or activation-checkpointed blocks), which the spec names without it, is one
    error naming `canzona.runtime.modules.named_parameters(model)`."""
    from canzona.runtime.modules import WRAPPER_INSERTED_BY, canonical_name

    known = {p.name for p in spec.params}
    items = list(given)
    if not items:
        raise SpecError("the optimizer got no parameters")
    groups = [dict(g) for g in items] if isinstance(items[0], Mapping) else [{"params": items}]
    out = []
    for i, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise SpecError(f"parameter group {i} must be a dict with 'params' (mixing groups and pairs?)")
        pairs = list(group.pop("params"))
        for pair in pairs:
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                    and isinstance(pair[1], Tensor)):
                raise SpecError("give parameters as (name, parameter) pairs, e.g. model.named_parameters(): "
                                "the plan refers to parameters by name")
            name = pair[0]
            if name not in known and canonical_name(name) in known:
                # the wrappers actually in the name: a DDP model's `module.` is not torch.compile's
                inserted = dict.fromkeys(WRAPPER_INSERTED_BY[p] for p in name.split(".") if p in WRAPPER_INSERTED_BY)
                raise SpecError(f"parameter {name!r} is named through a wrapper ({', '.join(inserted)}); the model "
                                "spec names it "
                                f"{canonical_name(name)!r}: give the optimizer canzona.runtime.modules."
                                "named_parameters(model), which names every parameter as the spec does")
        out.append((pairs, group))
    return out


def build_param_groups(groups: list[tuple[list[tuple[str, Tensor]], dict]], matrix_names: set[str],
                       optimizer: str, matrix_cfg: Any, adamw_cfg: Any, spec: ModelSpec) -> list[dict[str, Any]]:
    """torch-style param_groups: per user group, one group per kind that has parameters. A matrix
    group's overrides that keep other optimizer state than `matrix_cfg` (what the plan prices) are
    a PlanError naming the group, the key and both values."""
    out = []
    for i, (pairs, overrides) in enumerate(groups):
        usable: set[str] = set()
        for kind, name, cfg in (("matrix", optimizer, matrix_cfg), ("adamw", "adamw", adamw_cfg)):
            members = [p for n, p in pairs if (n in matrix_names) == (kind == "matrix")]
            if not members:
                continue
            own = {f.name for f in fields(cfg)}
            usable |= own
            values = {**asdict(cfg), **{k: v for k, v in overrides.items() if k in own}}
            mine = check_config(name, replace(cfg, **{k: config_value(v) for k, v in values.items()}))
            if kind == "matrix":
                change = kept_state_change(optimizer, [spec.param(n) for n, _ in pairs if n in matrix_names],
                                           mine, matrix_cfg)
                if change is not None:
                    raise PlanError(f"parameter group {i} sets {change}: give the value in matrix_config, with "
                                    "a plan made for it, or leave the key out of the group")
            group = {"params": members, "kind": kind, "optimizer": name, **values}
            out.append(BetaOneGroup(group) if kind == "adamw" and momentum_is_beta1(matrix_cfg) else group)
        unknown = sorted(set(overrides) - usable)
        if unknown:
            raise SpecError(f"parameter group {i}: no optimizer of its parameters has hyper-parameter(s) "
                            f"{', '.join(unknown)}")
    return out


class GroupConfigs:
    """The config of each param group as it stands now, validated once per change."""

    def __init__(self, base: Mapping[str, Any], matrices: Mapping[int, list[ParamSpec]] | None = None) -> None:
        self.base = dict(base)  # kind -> default config object (the matrix one: what the plan priced)
        # each matrix group's matrices (`group_matrices`), one per shape (state is priced by shape, and
        # a scheduler's change reaches the check every step): a group edited to keep other state is refused
        self.matrices = {g: one_per_shape(ms) for g, ms in (matrices or {}).items()}
        self._cache: dict[int, tuple[tuple, Any]] = {}
        # beside a momentum optimizer (Muon) an AdamW group's `momentum` is its beta1 (`BetaOneGroup`);
        # elsewhere (SOAP, Shampoo, AdamW alone: `defaults` has `betas`, which the schedulers cycle)
        # it is no AdamW hyper-parameter, and ignored, as torch.optim.AdamW ignores it
        self.momentum_is_beta1 = momentum_is_beta1(self.base["matrix"])

    def config(self, index: int, group: Mapping[str, Any]) -> Any:
        if self.momentum_is_beta1 and group["kind"] == "adamw" and "momentum" in group:
            _check_beta1(index, group)
        cfg = self.base[group["kind"]]
        names = [f.name for f in fields(cfg)]
        key = tuple(config_value(group[n]) for n in names)
        if group["kind"] == "adamw":
            key += tuple(config_value(group.get(flag, default)) for flag, default in TORCH_ADAMW_FLAGS.items())
        cached = self._cache.get(index)
        if cached is None or cached[0] != key:
            if group["kind"] == "adamw":
                _check_torch_flags(index, group)
            current = check_config(group["optimizer"], replace(cfg, **dict(zip(names, key))))
            if index in self.matrices:  # a step would run state its plan did not price (nor its executor hold)
                change = kept_state_change(group["optimizer"], self.matrices[index], current, cfg)
                if change is not None:
                    raise PlanError(f"param_groups[{index}] was set to {change}: a key that keeps other state is "
                                    "fixed at construction (set it back; to run it, build the optimizer with it in "
                                    "matrix_config and a plan made for it)")
            cached = (key, current)
            self._cache[index] = cached
        return cached[1]


def group_matrices(param_groups: list[dict[str, Any]], params: Mapping[str, Tensor],
                   spec: ModelSpec) -> dict[int, list[ParamSpec]]:
    """Each matrix group's matrices (a stack: its ParamSpec, whose state counts per matrix), by
    group index; `params`: the optimizer's parameters by name (the tensors in `param_groups`)."""
    name_of = {id(p): n for n, p in params.items()}
    return {g: [spec.param(name_of[id(p)]) for p in group["params"]]
            for g, group in enumerate(param_groups) if group["kind"] == "matrix"}


def kept_state_change(optimizer: str, members: list[ParamSpec], cfg: Any, priced: Any) -> str | None:
    """How a matrix group's config `cfg` keeps other optimizer state than `priced` (the
    matrix_config its plan priced) for its matrices `members` (`state_difference`, which stacks
    count per matrix): the keys that do, each with both values, and the first matrix that differs;
    None where the two differ at most in hyper-parameters (a learning rate, a frequency)."""
    differs = state_difference(optimizer, members, priced, cfg)
    if differs is None:
        return None
    changed = [f.name for f in fields(cfg) if getattr(cfg, f.name) != getattr(priced, f.name)]
    # the keys that change state alone; a state changed only by keys together names them all
    keys = [k for k in changed if state_difference(
        optimizer, members, priced, replace(priced, **{k: getattr(cfg, k)})) is not None] or changed
    values = ", ".join(f"{k}={getattr(cfg, k)!r} (matrix_config has {getattr(priced, k)!r})" for k in keys)
    return f"{values}, which keeps other {optimizer} optimizer state than the plan priced ({differs})"


def momentum_is_beta1(matrix_cfg: Any) -> bool:
    """Whether an AdamW group's `momentum` is its beta1: beside a matrix optimizer whose config has
    `momentum` (Muon and its kin), which momentum-cycling schedulers then set in every group."""
    return any(f.name == "momentum" for f in fields(matrix_cfg))


class BetaOneGroup(dict):
    """An AdamW param group beside a momentum optimizer (Muon): `momentum`, which momentum-cycling
    schedulers (OneCycleLR, CyclicLR) set in every group as `defaults` has it, and `betas[0]`, which
    torch.optim.AdamW reads (a hand edit sets it), are one value, its beta1: once the group has both
    keys, a write of either sets the other, so that the last write wins, as in torch's AdamW, whose
    beta1 those schedulers cycle through `betas` (a scheduler's next step overrides a hand edit of
    `betas`, as there). A save holds them agreeing; a load writes them back through here."""

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        if key == "momentum" and "betas" in self:
            super().__setitem__("betas", (value, *tuple(self["betas"])[1:]))
        elif key == "betas" and "momentum" in self and isinstance(value, (tuple, list)) and value:
            super().__setitem__("momentum", value[0])  # anything else: check_config names it

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def __ior__(self, other: Any) -> BetaOneGroup:
        self.update(other)
        return self


def _check_beta1(index: int, group: Mapping[str, Any]) -> None:
    """The two beta1 keys of an AdamW group beside Muon agree (`BetaOneGroup`; a group replaced
    by a plain dict, or written through `dict`'s own methods, may not): SpecError otherwise."""
    momentum, betas = config_value(group["momentum"]), config_value(group["betas"])
    if isinstance(betas, tuple) and betas and momentum != betas[0]:
        raise SpecError(f"parameter group {index} (AdamW beside Muon): momentum ({momentum!r}) and betas[0] "
                        f"({betas[0]!r}) are both its beta1 and disagree; set one of them (the other follows)")


def _check_torch_flags(index: int, group: Mapping[str, Any]) -> None:
    """SpecError (one line) for a torch.optim.AdamW flag canzona's AdamW does not run."""
    for flag, default in TORCH_ADAMW_FLAGS.items():
        if flag in group and bool(config_value(group[flag])) != default:
            raise SpecError(f"parameter group {index}: {flag}={group[flag]!r} is torch.optim.AdamW's flag; "
                            f"canzona's AdamW runs {flag}={default} only (remove the key or set it to {default})")


def defaults_of(configs: Mapping[str, Any]) -> dict[str, Any]:
    """torch.optim's `defaults` for a matrix optimizer routed beside AdamW: every hyper-parameter of
    the matrix optimizer's config, then AdamW's that it lacks (what LR schedulers look up). A
    momentum optimizer (Muon) hides AdamW's `betas`, so that OneCycleLR / CyclicLR cycle the
    `momentum` key of every group (AdamW groups read it as beta1) instead of a `betas` key Muon's
    groups do not have."""
    matrix, adamw = asdict(configs["matrix"]), asdict(configs["adamw"])
    if "momentum" in matrix:
        adamw.pop("betas", None)
    return {**adamw, **matrix}


def group_members(param_groups: list[dict[str, Any]]) -> list[tuple[int, frozenset[int]]]:
    """Which tensors each group holds (how many, and which by id; in any order, which the step and
    the checkpoints follow): what `members_changed` compares against."""
    return [(len(g["params"]), frozenset(map(id, g["params"]))) for g in param_groups]


def members_changed(param_groups: list[dict[str, Any]], built: list[tuple[int, frozenset[int]]]) -> str | None:
    """What is wrong when `param_groups` no longer hold the parameters the optimizer was built with
    (`built`: `group_members` at construction), None when they do. torch.optim steps whatever a
    group's `params` holds at each step; the plan lays out the parameters given at construction and
    the step runs each in the group it was built in, so an edit there would be silently ignored."""
    if len(param_groups) != len(built):
        return (f"param_groups has {len(param_groups)} groups, the optimizer was built with {len(built)}: groups "
                "cannot be added or removed after construction (its plan lays out every parameter; "
                "add_param_group is refused too): build the optimizer with all of them")
    for i, (now, members) in enumerate(zip(group_members(param_groups), built)):
        if now != members:
            return (f"param_groups[{i}]['params'] was changed after construction (a parameter removed, added or "
                    "moved to another group), which the step would ignore (its plan lays out the parameters it "
                    "was built with): put it back; freeze a parameter with requires_grad_(False), and give a "
                    "group other hyper-parameters through its keys")
    return None


def check_groups_now(param_groups: list[dict[str, Any]], built: list[tuple[int, frozenset[int]]],
                     group_config: Callable[[int], Any]) -> None:
    """Every param group valid now, before a step changes anything: over the parameters it was built
    with (`members_changed`), its hyper-parameters (`group_config(g)` validates group `g`'s). One
    CanzonaError otherwise."""
    changed = members_changed(param_groups, built)
    if changed is not None:
        raise CanzonaError(changed)
    for g in range(len(param_groups)):
        group_config(g)


def check_members(param_groups: list[dict[str, Any]], built: list[tuple[int, frozenset[int]]],
                  comms: Sequence[Comm | None], call: str) -> None:
    """`members_changed` on any rank of `comms` (a save or load after such an edit), as the same
    CanzonaError on every rank, before the call's own collectives: an edit made on some ranks only
    (a rank's own code path) would otherwise fail there alone, and the others would wait out
    `timeout_s` in the call's collectives, then blame a rank that did not call it. Collective: one
    small all-gather in each group of `comms` (this process alone without torch.distributed)."""
    import torch.distributed as dist

    changed = members_changed(param_groups, built)
    found = None if changed is None else (dist.get_rank() if dist.is_initialized() else 0, changed)
    for comm in (c for c in comms if c is not None):
        try:
            every = comm.all_gather_object(found, f"{call} param_groups check")
        except CanzonaError as e:
            raise CanzonaError(f"{e}; {call} is collective: call it on every rank") from None
        found = next((f for f in every if f is not None), None)  # the same on every rank of the group
    if found is not None:
        raise CanzonaError(f"rank {found[0]}: {found[1]}")


class GroupsDigest(int):
    """`hyper_parameters_digest`'s value, with what it digests (`rows`: per group its sorted
    (key, repr) pairs, then the sorted names of the frozen parameters), for a disagreement to name
    what differs (`groups_apart`, on that failure path only)."""

    rows: tuple = ()


def hyper_parameters_digest(param_groups: list[dict[str, Any]], params: Mapping[str, Tensor],
                            ungraded: Iterable[str] | None = None) -> GroupsDigest:
    """A signed 64-bit digest of every group's hyper-parameters and of which parameters are frozen
    (`requires_grad_(False)` after construction; `params`: the optimizer's, by name): ranks compare
    it each step. A parameter frozen on some ranks only gets no gradient there, which the step would
    take for a branch unused there and step it on every rank from the others' gradients alone. By
    name, not by position in a group: a group's `params` may be reordered on one rank
    (`group_members` takes them in any order). `ungraded`: the parameters no gradient reached on
    this rank (the step's check: the others were trainable at their backward, and step as torch
    steps a parameter holding a gradient, whatever its requires_grad since), so that a step reads
    `requires_grad` (about 0.1 us a tensor) of those alone; None: of every parameter."""
    groups = tuple(tuple(sorted((k, repr(config_value(v))) for k, v in g.items() if k != "params"))
                   for g in param_groups)
    rows = (groups, tuple(sorted(n for n in (params if ungraded is None else ungraded)
                                 if not params[n].requires_grad)))
    digest = GroupsDigest(int.from_bytes(hashlib.sha256(repr(rows).encode()).digest()[:8], "little", signed=True))
    digest.rows = rows
    return digest


def groups_apart(every: Sequence[Any], member: str = "rank") -> str:
    """What differs between the ranks' `GroupsDigest.rows` (`every`: one per rank, in rank order;
    `member`: how a rank is called), from `{member}s disagree`: the frozen parameters (the first,
    by name, frozen on some ranks and not the others) before the hyper-parameters (the first group
    and key that differ)."""
    ranks = range(len(every))
    if any(not isinstance(r, tuple) or len(r) != 2 for r in every):  # not a digest's rows: the generic words
        return (f"{member}s disagree on the hyper-parameters in param_groups or on which parameters are frozen "
                "(requires_grad)")
    frozen = [set(r[1]) for r in every]
    name = next((n for n in sorted(set().union(*frozen)) if len({n in f for f in frozen}) > 1), None)
    if name is not None:
        on = [r for r in ranks if name in frozen[r]]
        return (f"{member}s disagree on which parameters are frozen (requires_grad_(False)): {name!r} is frozen on "
                f"{member}(s) {on} and not on {member}(s) {[r for r in ranks if r not in on]}")
    groups = [r[0] for r in every]
    if len({len(g) for g in groups}) > 1:
        return (f"{member}s disagree on the hyper-parameters in param_groups: the number of groups "
                f"({[len(g) for g in groups]})")
    for i in range(len(groups[0])):
        values = [dict(g[i]) for g in groups]
        key = next((k for k in sorted(set().union(*values)) if len({v.get(k) for v in values}) > 1), None)
        if key is not None:
            held = [v.get(key, "(no such key)") for v in values]
            return (f"{member}s disagree on the hyper-parameters in param_groups: param_groups[{i}][{key!r}] is "
                    + ", ".join(f"{h} on {member}(s) {[r for r in ranks if held[r] == h]}" for h in dict.fromkeys(held)))
    return f"{member}s disagree on the hyper-parameters in param_groups"


def group_lr(group: Mapping[str, Any]) -> Any:
    """`group['lr']` as the kernels take it: a number, or a one-element tensor as torch's optimizers
    take one; a NumPy scalar (a schedule computed with NumPy) as the Python number it holds."""
    return _kernel_scalar(group["lr"])


def group_betas(group: Mapping[str, Any]) -> tuple[Any, Any]:
    """An AdamW group's `betas` as `adamw_step_` takes them: each a number, or a one-element tensor
    (0-d), which torch.optim.AdamW computes its bias corrections with in the tensor's dtype; a
    NumPy scalar as it is, as torch's step takes it (np.float32's bias corrections in float32)."""
    beta1, beta2 = group["betas"]
    return _kernel_scalar(beta1, numpy=True), _kernel_scalar(beta2, numpy=True)


def _kernel_scalar(v: Any, *, numpy: bool = False) -> Any:
    if isinstance(v, Tensor) and v.dim() > 0 and v.numel() == 1:
        return v.reshape(())  # a `[1]` value, as torch's `_to_scalar` takes it: `add_(alpha=)` takes 0-d only
    return v.item() if _is_numpy_scalar(v) and not (numpy and isinstance(v, _np_generic())) else v


def _np_generic() -> type:
    """NumPy's scalar type (numpy imported only where a NumPy value is there already)."""
    import numpy

    return numpy.generic


def _is_numpy_scalar(v: Any) -> bool:
    return type(v).__module__ == "numpy" and getattr(v, "shape", None) == () and hasattr(v, "item")


def config_value(v: Any) -> Any:
    """A hyper-parameter as a config field holds it (lists as tuples, one-element tensors and NumPy
    scalars as numbers)."""
    if isinstance(v, Tensor):  # some schedulers store tensor lrs
        return v.item() if v.numel() == 1 else tuple(v.flatten().tolist())
    if _is_numpy_scalar(v):
        return v.item()
    return tuple(config_value(x) for x in v) if isinstance(v, (list, tuple)) else v
