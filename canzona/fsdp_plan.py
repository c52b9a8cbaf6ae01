"""Who computes each matrix under FSDP2 / ZeRO-3, and in which order (docs/design.md §2.8): the
torch-free policy that the simulator prices (`sim/fsdp.py`) and the runtime runs
(`canzona.runtime.fsdp`), written once.

Under FSDP every rank holds a row shard of every parameter. A step policy with owners
(`FsdpStepPolicy.owners`: balanced or round-robin) gives each matrix one owner in the shard group,
which receives every rank's shard of its gradient, computes the whole update and sends each rank
its shard of it; gather-all has every rank compute every matrix. The exchanges go in micro-groups
(`owner_micro_groups`): each owner's matrices, in backward order, cut into K chunks of about equal
cost, so that the next micro-group's all-to-all runs under this one's compute.

Each rank's piece of a parameter is `torch.chunk`'s row block (`chunk_rows`: FSDP2's `Shard(0)`,
possibly empty), so what a rank holds is known exactly per rank (`fsdp_persistent_memory`, which
the simulator reports and tests/runtime/test_fsdp_parity.py checks against the runtime's tensors),
and so are the exchanges' bytes (`canzona.fsdp_collectives`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from canzona.cost import CostModel, adamw_moments_bytes, row_state_bytes
from canzona.errors import SpecError
from canzona.optimizers import matrix_config_for, matrix_optimizer
from canzona.plan import PLAN_DEFAULTS, WHOLE_GEOMETRY, Plan, PlanSettings, plan_for
from canzona.spec import DTYPE_BYTES, ModelSpec
from canzona.step_policies import (
    OWNERS_BALANCED,
    OWNERS_ROUND_ROBIN,
    FsdpStepPolicy,
    default_policy,
    get_fsdp_policy,
)

ROOT = -1  # the root unit's key: the parameters outside the decoder layers
MAX_OWNER_GROUPS = 8  # owner policies' micro-groups: at most this many (`owner_micro_groups`)


def check_hsdp(fsdp: bool, dp: int, replicate: int) -> int:
    """The FSDP / HSDP layout of `dp` data-parallel ranks with `replicate` replicas (HSDP's replicate
    axis, `--hsdp-replicate`): the shard size S = dp / R (0 without FSDP), or one SpecError (one
    line). The simulator (`sim.fsdp.check_fsdp`) and `canzona verify --fsdp` run the same layouts."""
    r = replicate
    if isinstance(r, bool) or not (isinstance(r, int) and r >= 1):
        raise SpecError(f"--hsdp-replicate must be a whole number >= 1, got {r!r}")
    if not fsdp:
        if r != 1:
            raise SpecError("--hsdp-replicate is HSDP's replicate axis: it needs --fsdp")
        return 0
    if dp < 2:  # before the replicas' rules: no --hsdp-replicate makes a shard group of one rank
        raise SpecError(f"--fsdp shards over the data-parallel ranks and the layout leaves {dp}: lower --tp (or "
                        "raise --gpus) so that at least 2 remain")
    if dp % r:
        raise SpecError(f"--hsdp-replicate {r} must divide the {dp} data-parallel ranks")
    shard = dp // r
    if shard < 2:
        raise SpecError(f"--hsdp-replicate {r} leaves a shard group of {shard} rank: shard over at least 2 "
                        f"(replicate at most {dp // 2})")
    return shard


@dataclass(frozen=True, kw_only=True)
class FsdpMatrix:
    """One matrix of an FSDP step: who computes it and what it costs."""

    name: str
    numel: int
    shape: tuple[int, ...]
    cost: float  # seconds of one full-matrix update (the planner's cost model)
    state: int  # bytes of its full optimizer state
    row_state: int  # of which the part a shard of rows holds its share of (`cost.row_state_bytes`)
    owner: int | None  # None: every rank computes it (gather-all)


@dataclass(frozen=True, kw_only=True)
class FsdpUnit:
    """One FSDP unit (a `fully_shard` call): the parameters gathered and reduced together."""

    key: int  # the decoder layer, or ROOT
    numel: int  # every parameter's elements (matrices and the rest)
    matrices: tuple[FsdpMatrix, ...]


def fsdp_units(spec: ModelSpec, matrices: dict[str, FsdpMatrix]) -> list[FsdpUnit]:
    """The FSDP units in forward order, as torchtitan wraps a decoder: the root first (the
    embedding is its first use), then every decoder layer."""
    numel: dict[int, int] = {}
    mats: dict[int, list[FsdpMatrix]] = {}
    for p in spec.params:
        key = ROOT if p.layer is None else p.layer
        numel[key] = numel.get(key, 0) + p.numel
        if p.name in matrices:
            mats.setdefault(key, []).append(matrices[p.name])
    keys = [ROOT] + sorted(k for k in numel if k != ROOT) if ROOT in numel else sorted(numel)
    return [FsdpUnit(key=k, numel=numel[k], matrices=tuple(mats.get(k, ()))) for k in keys]


def backward_order(units: Sequence[FsdpUnit]) -> list[FsdpMatrix]:
    """Every matrix in the order backward reduces them: the units reversed."""
    return [m for u in reversed(units) for m in u.matrices]


# the planning settings canzona's owner plan reads (`fsdp_matrices`: its placements give canzona's
# owners); a policy whose owners no plan places (round-robin, every rank) reads none of them
OWNER_PLAN_SETTINGS = ("dp_policy", "alpha", "balance_by", "bucket_size", "align")


def stacked_experts_refusal(optimizer: str, stack: str) -> str:
    """Why a whole-matrix optimizer over stacked experts is refused under FSDP2, by the runtime
    (`FsdpOptimizer`) and the simulator (`--fsdp`) alike: FSDP2 shards a stack's rows, the experts'
    matrices with them, and canzona's owners gather whole parameters, not a stack's matrices."""
    return (f"{optimizer} over stacked experts is not run under FSDP2 yet ({stack!r} stacks matrices): use "
            "optimizer adamw, or the ZeRO-1 layout")


def fsdp_policy(optimizer: str, policy: str | None) -> FsdpStepPolicy | None:
    """The step policy of an FSDP layout (`policy` as `canzona.step_policies.resolve_policy` names
    it): one of `FSDP_POLICIES` for a whole-matrix optimizer; None for an elementwise one (AdamW),
    which each rank steps on its own shards with no owners and no exchange: its policy is its ZeRO-1
    default (`default_policy`: each rank its shard of the state), and nothing else. One SpecError
    (one line) otherwise. The runtime's FsdpOptimizer and `canzona simulate --fsdp` alike."""
    if not matrix_optimizer(optimizer).elementwise:
        return get_fsdp_policy(policy)
    own = default_policy(optimizer)
    if policy != own:
        raise SpecError(f"FSDP with {optimizer}: each rank steps its own shards (FSDP2's), policy {own}; "
                        f"got {policy!r}")
    return None


def check_owner_plan_settings(policy: FsdpStepPolicy | None, settings: PlanSettings) -> None:
    """`settings`' `OWNER_PLAN_SETTINGS` off their defaults under a policy whose owners no plan
    places change nothing: one SpecError naming them (the runtime's FsdpOptimizer, `canzona verify
    --fsdp` and `canzona simulate --fsdp` alike, through `fsdp_matrices` or before it). `policy`
    None: an elementwise optimizer's step (`fsdp_policy`), which has no owners at all."""
    if policy is not None and policy.owners == OWNERS_BALANCED:
        return
    changed = [f"{name} {getattr(settings, name)}" for name in OWNER_PLAN_SETTINGS
               if getattr(settings, name) != getattr(PLAN_DEFAULTS, name)]
    if changed:
        where = "an elementwise optimizer's FSDP step, which has no owners" if policy is None else \
            f"FSDP policy {policy.name}, whose owners ({policy.owners}) no plan places"
        raise SpecError(f"{', '.join(changed)}: canzona's owner plan settings change nothing under {where}")


def owner_plan_defaults(policy: FsdpStepPolicy) -> dict[str, object]:
    """`OWNER_PLAN_SETTINGS` at their defaults, by field, for a policy whose owners no plan places
    (empty for canzona's): what such a baseline runs with beside canzona at the settings given
    (`canzona compare --fsdp`, `canzona verify --fsdp --policy all`)."""
    if policy.owners == OWNERS_BALANCED:
        return {}
    return {name: getattr(PLAN_DEFAULTS, name) for name in OWNER_PLAN_SETTINGS}


def fsdp_matrices(spec: ModelSpec, shard: int, optimizer: str, policy: FsdpStepPolicy,
                  settings: PlanSettings | None = None,
                  cost_model: CostModel | None = None, *,
                  matrix_config: object | None = None) -> tuple[dict[str, FsdpMatrix], Plan]:
    """Every matrix of `spec` with its owner in a shard group of `shard` ranks under `policy`, and
    canzona's owner plan: the planner's, made for the shard group at TP 1 with whole matrices (its
    placements' owners are balanced by cost, `alpha` blending in the bytes each owner receives).
    Round-robin owners are matrix i's rank i mod `shard`, in the spec's order. `matrix_config`: the
    optimizer's configuration (the runtime's option; None: its defaults), which the costs and the
    state are priced at."""
    check_owner_plan_settings(policy, settings or PlanSettings())
    plan = plan_for(spec, shard, 1, optimizer, "canzona", settings or PlanSettings(), cost_model,
                    geometry=WHOLE_GEOMETRY, matrix_config=matrix_config)
    matrix_config = matrix_config_for(optimizer, matrix_config)
    placed = {p.name: p for p in plan.dp_plan.placements()}
    out: dict[str, FsdpMatrix] = {}
    for i, p in enumerate(spec.matrix_params()):
        pl = placed[p.name]
        owner = pl.owner if policy.owners == OWNERS_BALANCED else i % shard if policy.owners == OWNERS_ROUND_ROBIN \
            else None
        out[p.name] = FsdpMatrix(name=p.name, numel=p.numel, shape=tuple(p.shape), cost=pl.cost,
                                 state=pl.state_bytes, row_state=row_state_bytes(optimizer, tuple(p.shape), matrix_config),
                                 owner=owner)
    return out, plan


M = TypeVar("M", bound=FsdpMatrix)


def owner_micro_groups(backward: Sequence[M], max_groups: int = MAX_OWNER_GROUPS) -> list[tuple[M, ...]]:
    """Owner policies' micro-groups, in order: every owner's matrices (in the backward order
    given) cut into K chunks of about equal cost, K the most matrices an owner has (at most
    `max_groups`); micro-group k is every owner's k-th chunk, so that each exchange spreads over
    all the owners' ports and every owner computes in every micro-group it can."""
    mine: dict[int | None, list[M]] = {}
    for m in backward:
        mine.setdefault(m.owner, []).append(m)
    if not mine:
        return []
    k = min(max_groups, max(len(v) for v in mine.values()))
    chunks: list[list[M]] = [[] for _ in range(k)]
    for mats in mine.values():
        total, before = sum(m.cost for m in mats) or 1.0, 0.0
        for m in mats:
            chunks[min(k - 1, int(k * (before + m.cost / 2) / total))].append(m)
            before += m.cost
    return [tuple(c) for c in chunks if c]


def chunk_rows(rows: int, shard: int, member: int) -> tuple[int, int]:
    """The rows [start, end) of `member`'s piece when `torch.chunk` cuts `rows` into `shard` blocks,
    as FSDP2's `Shard(0)` does: `ceil(rows / shard)` rows each, the last members fewer or none."""
    per = -(-rows // shard) if rows else 0
    start = min(member * per, rows)
    return start, min(start + per, rows)


def shard_numel(shape: Sequence[int], shard: int, member: int) -> int:
    """Elements of `member`'s row block of a parameter of `shape` (a 0-d parameter: member 0's)."""
    if not shape:
        return 1 if member == 0 else 0
    start, end = chunk_rows(shape[0], shard, member)
    return (end - start) * math.prod(shape[1:])


@dataclass(frozen=True, kw_only=True)
class FsdpRankBytes:
    """What one rank of a shard group holds across steps (bytes), by `canzona.memory.RankMemory`'s
    persistent categories."""

    weights: int  # its parameter shards, where they are not the fp32 masters
    grads: int  # its gradient shards
    master_weights: int  # fp32 masters of its shards (FSDP2's fp32 shards under MixedPrecisionPolicy)
    matrix_state: int  # the matrix optimizer's state: of the matrices it owns (or its rows' share)
    adamw_state: int  # AdamW's moments of its shards of the other parameters

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.master_weights + self.matrix_state + self.adamw_state


def fsdp_persistent_memory(spec: ModelSpec, shard: int, matrices: dict[str, FsdpMatrix], *, weight_bytes: int,
                           grad_bytes: int, master_bytes: int,
                           moment_bytes: int = DTYPE_BYTES["fp32"]) -> list[FsdpRankBytes]:
    """Every rank of a shard group of `shard` ranks, in member order: its `torch.chunk` row blocks
    of every parameter (`weight_bytes` per element of the shards themselves, 0 where they are the
    masters; `grad_bytes` of its gradient shards; `master_bytes` of fp32 masters), AdamW's two
    moments of its non-empty blocks of the parameters outside `matrices` (`moment_bytes` an element:
    fp32, or a bf16 model's under torch's AdamW), and the matrix
    optimizer's state: the whole state of the matrices it owns, or, under gather-all (owner None),
    its rows' share of every matrix's row state (`FsdpMatrix.row_state`) and the rest of every
    matrix's state whole. What the runtime allocates (`FsdpOptimizer`: the parameters' and
    gradients' local tensors, `master`, `adamw_state`, `matrix_state`)."""
    out = []
    for r in range(shard):
        held = adamw = state = 0
        for p in spec.params:
            n = shard_numel(p.shape, shard, r)
            held += n
            m = matrices.get(p.name)
            if m is None:
                adamw += adamw_moments_bytes(n, moment_bytes) if n else 0
            elif m.owner is None:  # its rows' share of the row state (a multiple of the rows)
                start, end = chunk_rows(p.shape[0], shard, r)
                state += m.row_state * (end - start) // p.shape[0] + m.state - m.row_state
            elif m.owner == r:
                state += m.state
        out.append(FsdpRankBytes(weights=held * weight_bytes, grads=held * grad_bytes,
                                 master_weights=held * master_bytes, matrix_state=state, adamw_state=adamw))
    return out
