"""`Plan`: what the simulator and the runtime execute. Built from specs by the policies, saved as
versioned JSON, and validated on load (structure, and agreement with the model it is used with).

Metrics are derived from the plan's structure, never trusted from the file.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from canzona.batching import MAX_BATCH_NUMEL
from canzona.choices import check_choice
from canzona.cost import AnalyticCost, CostModel, priced_with, state_bytes
from canzona.dp import DEFAULT_ALIGN, DPItem, DPPlan, check_dp_policy, plan_dp
from canzona.dp.layout import (
    DEFAULT_EXPERT_BUCKETS,
    BucketPlan,
    DPMetrics,
    Placement,
    check_expert_buckets,
    make_buckets,
)
from canzona.dp.policies import (
    BALANCE_UNITS,
    DEFAULT_DP_POLICY,
    DP_REGISTRY,
    default_bucket_size,
    keeps_geometry,
)
from canzona.errors import PlanError, SpecError
from canzona.experts import check_ep, dense_part, expert_part
from canzona.fileio import (
    dumps_json,
    is_finite_number,
    is_whole_number,
    parse_json,
    read_text,
    write_text_atomic,
)
from canzona.optimizers import check_matrix_optimizer, matrix_config_for, matrix_optimizer
from canzona.spec import DTYPE_BYTES, ModelSpec, parametrized_routing
from canzona.step_policies import StepPolicy, get_step_policy
from canzona.tp import (
    DEFAULT_TP_POLICY,
    EVERY_RANK,
    TP_REGISTRY,
    Capacity,
    MicroGroup,
    TPPlan,
    TPTask,
    check_tp_policy,
    plan_tp,
)

SCHEMA = "canzona.plan"
PLAN_AXES = ("dp", "tp")  # the named parallel axes of a plan's `layout` (and the runtime's mesh)
# the axes a plan of a mixture-of-experts model adds under expert parallelism (`Plan.experts`)
EXPERT_AXES = ("ep", "etp")
VERSION = 1
MAX_DP = 65536  # planned in about half a second; far beyond any cluster a plan is made for
MAX_TP = 1024  # TP groups live inside a node (and must divide the attention heads)
MAX_ELEMENTS = 2**50  # bucket sizes, offsets and alignment, in elements (a petabyte of fp32)
MAX_ALIGN = 2**20
MAX_STATE_BYTES = 2**62


@dataclass(frozen=True)
class Plan:
    model: str
    fingerprint: str
    dp: int
    tp: int
    optimizer: str
    cost_model: str
    dp_plan: DPPlan
    tp_plan: TPPlan
    # under expert parallelism (`canzona.experts`): this plan is the dense part's, on DP x TP, and
    # `experts` one EP rank's experts' on its own axes, EDP x ETP (its `dp` and `tp`)
    experts: Plan | None = None
    ep: int = 1

    @property
    def dense(self) -> Plan:
        """The dense part's plan alone (under expert parallelism; otherwise the plan itself)."""
        return replace(self, experts=None, ep=1) if self.experts is not None else self

    @property
    def etp(self) -> int:
        return self.experts.tp if self.experts is not None else 1

    @property
    def layout(self) -> dict[str, int]:
        """The size of each named axis (`PLAN_AXES`, and `EXPERT_AXES` under expert parallelism),
        as the file records it."""
        return {"dp": self.dp, "tp": self.tp, **({"ep": self.ep, "etp": self.etp} if self.experts else {})}

    @property
    def elementwise(self) -> bool:
        """Whether the optimizer updates pieces where they lie (AdamW) rather than whole matrices."""
        return matrix_optimizer(self.optimizer).elementwise

    @property
    def dp_metrics(self) -> DPMetrics:
        """The DP plan's metrics for this plan's optimizer (pieces for an elementwise one)."""
        return self.dp_plan.piece_metrics if self.elementwise else self.dp_plan.metrics

    @property
    def optimizer_compute_s(self) -> float:
        """Optimizer compute on the slowest GPU: after TP scheduling, or for an elementwise
        optimizer the slowest DP rank's pieces, spread over its TP group (each GPU updates its
        TP shard of them)."""
        return self.dp_metrics.makespan / self.tp if self.elementwise else self.tp_plan.metrics.makespan

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "version": VERSION, **_body(self), "metrics": self.summary()}

    def to_json(self, indent: int | None = None) -> str:
        return dumps_json(self.to_dict(), indent=indent)

    def save(self, path: str | Path) -> None:
        """Write atomically: a failed write never leaves a truncated plan over a good one."""
        write_text_atomic(path, self.to_json(indent=1) + "\n", "plan")

    def hash(self) -> str:
        """Identity of what ranks execute (metrics excluded): ranks compare it before collectives."""
        blob = json.dumps(_body(self), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    def summary(self) -> dict[str, Any]:
        """The `canzona plan --json` object (under expert parallelism: the dense part's, with the
        experts' under `experts`)."""
        out = self._summary()
        if self.experts is not None:
            out.update(ep_size=self.ep, etp_size=self.etp, experts=self.experts._summary())
        return out

    def _summary(self) -> dict[str, Any]:
        d, t = self.dp_metrics, self.tp_plan.metrics
        return {
            "model": self.model,
            "dp_size": self.dp,
            "tp_size": self.tp,
            "optimizer": self.optimizer,
            "cost_model": self.cost_model,
            "dp": {
                "policy": self.dp_plan.policy,
                "alpha": self.dp_plan.alpha,
                "buckets": len(self.dp_plan.buckets),
                "bucket_size": self.dp_plan.bucket_size,
                "makespan_s": d.makespan,
                "mean_s": d.mean,
                "imbalance": d.imbalance,
                "lower_bound_s": d.lower_bound,
                "lower_bound_gap": d.lower_bound_gap,
                "comm_ratio": d.comm_ratio,
                "state_imbalance": d.state_imbalance,
                "atomic": d.atomic,
                "atomicity_violations": d.atomicity_violations,
                "extra_comm_elements": d.extra_comm_elements,
                "redundant_s": d.redundant_s,
                "fell_back": self.dp_plan.fell_back,
                "balance_by": self.dp_plan.balance_by,
                "rank_loads": list(d.rank_loads),
                "rank_state_bytes": list(d.rank_state_bytes),
            },
            "tp": {
                "policy": self.tp_plan.policy,
                "capacity": _capacity_dict(self.tp_plan.capacity),
                "groups": t.groups,
                "max_groups_per_rank": t.max_groups_per_rank,
                "efficiency": t.efficiency,
                "mean_group_imbalance": t.mean_group_imbalance,
                "optimizer_compute_s": self.optimizer_compute_s,
            },
        }


def _capacity_dict(c: Capacity | None) -> dict[str, Any] | None:
    return None if c is None else {"value": c.value, "unit": c.unit}


def _body(plan: Plan) -> dict[str, Any]:
    """What a plan file holds, metrics aside (a plan without experts: exactly as before expert
    parallelism, so its hash is unchanged)."""
    body = _part_body(plan)
    if plan.experts is not None:
        body["experts"] = _part_body(plan.experts)
    return body


def _part_body(plan: Plan) -> dict[str, Any]:
    dpp, tpp = plan.dp_plan, plan.tp_plan
    return {
        "model": {"name": plan.model, "fingerprint": plan.fingerprint},
        "layout": plan.layout,
        "optimizer": plan.optimizer,
        "cost_model": plan.cost_model,
        "dp_plan": {
            "policy": dpp.policy,
            "alpha": dpp.alpha,
            "align": dpp.align,
            "bucket_size": dpp.bucket_size,
            "split_compute": dpp.split_compute,
            "fell_back": dpp.fell_back,
            "balance_by": dpp.balance_by,
            "buckets": [
                {
                    "index": b.index,
                    "size": b.size,
                    "cuts": list(b.cuts),
                    "params": [[p.name, p.offset, p.numel, p.cost, p.state_bytes, p.owner] for p in b.params],
                }
                for b in dpp.buckets
            ],
        },
        "tp_plan": {
            "policy": tpp.policy,
            "capacity": _capacity_dict(tpp.capacity),
            "groups": [
                [{"tasks": list(g.tasks), "hosts": list(g.hosts), "costs": list(g.costs)} for g in rank]
                for rank in tpp.groups
            ],
        },
    }


def dp_items(model: ModelSpec, tp: int, optimizer: str, cost_model: CostModel,
             matrix_config: object | None = None) -> list[DPItem]:
    """Matrices in forward order: local shard size for the buffer, full-matrix cost and state
    (`matrix_config`: the optimizer's configuration, None: its defaults; `cost_model` already prices it)."""
    items = [DPItem(p.name, p.local_numel(tp), float(cost_model.seconds(optimizer, p.shape)),
                    state_bytes(optimizer, p.shape, matrix_config), stack=p.stacked_in[0] if p.stacked_in else None)
             for p in model.matrix_params()]
    for it in items:  # extreme hardware or table figures must not become inf / NaN plans
        if not (is_finite_number(it.cost) and it.cost >= 0):
            raise SpecError(f"the cost model {cost_model.name} gives {it.cost} s for {it.name}: check the "
                            "hardware profile's or cost table's figures")
    if not is_finite_number(sum(it.cost for it in items)):
        raise SpecError(f"the cost model {cost_model.name} gives an infinite total: check its figures")
    return items


# A host's workspace per element of a matrix it computes: the full gradient and the full update,
# in fp32 (`TPTask.bytes`)
HOST_BYTES_PER_ELEMENT = 2 * DTYPE_BYTES["fp32"]
# Micro-groups in which each host's share is at most one batch (`canzona.batching`: same-shape
# matrices up to MAX_BATCH_NUMEL elements run as one kernel): the capacity the simulator tries for
# an EP rank's experts under expert TP beside the searched one, whose search prices matrices one
# by one and so, among many alike ones, cuts groups of one or two tasks a host
BATCH_CAPACITY = Capacity(float(HOST_BYTES_PER_ELEMENT * MAX_BATCH_NUMEL), "bytes")


def tp_tasks(model: ModelSpec, dp_plan: DPPlan, optimizer: str, tp: int = 0) -> list[list[TPTask]]:
    """Per DP rank, the matrices it computes whole, in forward order: none under an elementwise
    optimizer (each rank updates the pieces its segments hold, with no TP exchange). At `tp` 1
    nothing is exchanged, so the order only decides what is batched (`canzona.batching`: a batch
    is same-shape matrices of consecutive groups): same-shape matrices together, each shape's in
    forward order, the shapes in the order they first appear (an overlapped step reorders them by
    bucket: `step_schedule.tp_schedule`)."""
    if matrix_optimizer(optimizer).elementwise:
        return [[] for _ in range(dp_plan.dp)]
    matrices = model.matrix_params()  # a stack's matrices one by one
    order = {p.name: i for i, p in enumerate(matrices)}
    full = {p.name: p for p in matrices}
    per_rank: list[list[Placement]] = [[] for _ in range(dp_plan.dp)]
    for b in dp_plan.buckets:
        for p in b.params:
            for r in dp_plan.computing_ranks(b, p):
                per_rank[r].append(p)
    first_of_shape: dict[tuple[int, ...], int] = {}
    for i, p in enumerate(matrices):
        first_of_shape.setdefault(p.shape, i)

    def key(p: Placement) -> tuple[int, int]:
        i = order[p.name]
        return (first_of_shape[full[p.name].shape], i) if tp == 1 else (0, i)

    return [
        [TPTask(p.name, p.cost, HOST_BYTES_PER_ELEMENT * full[p.name].numel) for p in sorted(rank, key=key)]
        for rank in per_rank
    ]


@dataclass(frozen=True, kw_only=True)
class PlanSettings:
    """How to plan, with its defaults defined once: the DP policy, the TP scheduler and their
    knobs. A step policy with its own DP or TP policy (the baselines) overrides those two
    (`plan_for`)."""

    dp_policy: str = DEFAULT_DP_POLICY
    tp_policy: str = DEFAULT_TP_POLICY
    alpha: float = 1.0  # compute (1) vs segment-size (0) balance of the alpha policies
    bucket_size: int | None = None  # elements; None: about MATRICES_PER_RANK matrices per rank per bucket
    align: int = DEFAULT_ALIGN
    capacity: Capacity | None = None  # micro-group capacity of greedy-rollback; None: searched (tp.plan_tp)
    balance_by: str = "seconds"  # or "elements", as the authors' code balances
    # how buckets of stacked expert matrices are sized (canzona.dp.layout.EXPERT_BUCKETS)
    expert_buckets: str = DEFAULT_EXPERT_BUCKETS


# What the plan of a whole-matrix DP policy may become (`plan_for`, `make_plan`):
# - "auto": ZeRO-1's even segments (`zero1-even`: a matrix that straddles a cut is computed by every
#   rank whose segment holds part of it, which fetches the other parts) where whole-matrix segments
#   plan no shorter step compute under the same TP scheduler. Whole matrices buy balance only; when
#   each DP rank's few matrices are spread over its TP ranks the step is the largest matrix either
#   way, and even segments are what the reduce-scatters and all-gathers cost least with (the
#   segments of whole matrices are uneven, up to a matrix longer than the even one);
# - "whole": always the DP policy's whole-matrix segments (the paper's geometry).
# canzona plans with "auto" (`DEFAULT_GEOMETRY`: the runtime, the simulator and the CLI take it
# from here); `make_plan` plans the DP policy it is given unless told "auto".
GEOMETRIES = ("auto", "whole")
AUTO_GEOMETRY, WHOLE_GEOMETRY = GEOMETRIES
DEFAULT_GEOMETRY = AUTO_GEOMETRY
EVEN_GEOMETRY_POLICY = "zero1-even"  # the DP policy of ZeRO-1's even segments
TIE = 1e-9  # relative: makespans this close plan the same step (sums in another order)


def check_geometry(name: str) -> str:
    return check_choice(name, GEOMETRIES, "geometry")


# The one definition of the planning defaults: the runtime, the simulator, the harness and the CLI
# take theirs from here (tests/policy/test_registries.py checks every consumer).
PLAN_DEFAULTS = PlanSettings()


# the plan's settings among those (`check_one_rank_settings`): field, flag, default (the simulator
# adds its run options, `sim.simulate.ONE_RANK_SETTINGS`)
ONE_RANK_PLAN_SETTINGS: tuple[tuple[str, str, Any], ...] = (
    ("alpha", "--alpha", PLAN_DEFAULTS.alpha), ("balance_by", "--balance-by", PLAN_DEFAULTS.balance_by),
    ("bucket_size", "--bucket-size", PLAN_DEFAULTS.bucket_size))


def check_one_rank_settings(changed: Sequence[str], groups: Sequence[int]) -> None:
    """Settings off their defaults (`changed`, each as its flag reads) that change nothing where
    every plan's DP group is one rank (`groups`: the dense part's DP x CP, and under EP the
    experts' EDP): that rank computes every matrix, reduces its gradients and gathers its
    parameters with no other rank, so there is no balance to weigh and nothing to reduce or
    gather. One SpecError naming them, as other settings that change nothing; the simulator
    (`sim.simulate.SimConfig`) and `canzona plan` share it. What each caller passes is what it
    measured to change nothing there."""
    if changed and max(groups) == 1:
        raise SpecError(f"{', '.join(changed)} change{'s' if len(changed) == 1 else ''} nothing where each plan's "
                        f"DP group is one rank (dp x cp = 1{', edp = 1' if len(groups) > 1 else ''}): that rank "
                        "computes every matrix, with no balance to weigh and no gradient to reduce or parameter to "
                        "gather with another")


def plan_for(model: ModelSpec, dp: int, tp: int, optimizer: str, policy: StepPolicy | str,
             settings: PlanSettings = PlanSettings(), cost_model: CostModel | None = None, *,
             empty_ok: bool = False, ep: int = 1, etp: int = 1, hidden: int | None = None,
             geometry: str = DEFAULT_GEOMETRY, overlap_step: bool = False,
             matrix_config: object | None = None) -> Plan:
    """The plan step policy `policy` executes: its own DP and TP policies where it has them
    (`StepPolicy.dp_policy` / `tp_policy`), the settings' otherwise. The one place the runtime,
    `canzona verify` and the simulator make a policy's plan. `geometry` (`GEOMETRIES`): whether
    a policy that takes the settings' DP policy (canzona) keeps ZeRO-1's even segments where whole
    matrices plan no shorter step; the baselines' plans are their own policies'. The settings'
    `expert_buckets`: how buckets of stacked expert matrices are sized
    (`canzona.dp.layout.EXPERT_BUCKETS`). `empty_ok`: a model without matrices gets a plan of no buckets (the dense part
    of a mixture-of-experts model whose only matrices are its experts) instead of an error.
    `overlap_step`: the step starts each owner's update from its bucket's reduce-scatter, which
    needs every matrix whole in its owner's segment: the whole-matrix geometry.

    `ep` > 1 (expert parallelism, `canzona.experts`; `etp`: expert TP, which needs `hidden`): the
    dense part's plan on DP x TP, holding one EP rank's experts' plan over EDP x ETP (`Plan.experts`),
    both made by the same policies.

    `matrix_config`: the matrix optimizer's configuration the step runs (the runtime's option of that
    name: None, a mapping of fields or a config object), which the cost model and the optimizer state
    are priced at (`make_plan`)."""
    policy = get_step_policy(policy) if isinstance(policy, str) else policy
    policy.check_optimizer(optimizer)
    if ep > 1 or etp > 1:
        edp = check_ep(model, ep, dp, tp, etp, hidden)
        parts = dict(geometry=geometry, overlap_step=overlap_step, matrix_config=matrix_config)
        dense = plan_for(dense_part(model), dp, tp, optimizer, policy, settings, cost_model, empty_ok=True, **parts)
        experts = plan_for(expert_part(model, ep, etp, hidden), edp, etp, optimizer, policy, settings, cost_model,
                           **parts)
        return replace(dense, experts=experts, ep=ep)
    geometry = check_geometry(geometry) if policy.dp_policy is None and not overlap_step else WHOLE_GEOMETRY
    return make_plan(model, dp, tp, optimizer, policy.dp_policy or settings.dp_policy,
                     policy.tp_policy or settings.tp_policy, settings.alpha, settings.bucket_size, settings.align,
                     capacity=settings.capacity, cost_model=cost_model, balance_by=settings.balance_by,
                     expert_buckets=settings.expert_buckets, geometry=geometry, empty_ok=empty_ok,
                     matrix_config=matrix_config)


def bucket_names(model: ModelSpec, dp: int, tp: int, bucket_size: int | None = PLAN_DEFAULTS.bucket_size,
                 expert_buckets: str = DEFAULT_EXPERT_BUCKETS) -> tuple[tuple[str, ...], ...]:
    """The matrices of each bucket (before a DP policy orders them), which depend on sizes only:
    whether two bucket sizings give the same buckets, without planning either."""
    check_expert_buckets(expert_buckets)
    items = [DPItem(p.name, p.local_numel(tp), 0.0, 0, stack=p.stacked_in[0] if p.stacked_in else None)
             for p in model.matrix_params()]
    size = bucket_size if bucket_size is not None else default_bucket_size(items, dp)
    buckets = make_buckets(items, size, dp if expert_buckets == "dp-multiple" else None)
    return tuple(tuple(it.name for it in b) for b in buckets)


def make_plan(model: ModelSpec, dp: int, tp: int, optimizer: str = "muon",
              dp_policy: str = PLAN_DEFAULTS.dp_policy, tp_policy: str = PLAN_DEFAULTS.tp_policy,
              alpha: float = PLAN_DEFAULTS.alpha, bucket_size: int | None = PLAN_DEFAULTS.bucket_size,
              align: int = PLAN_DEFAULTS.align, capacity: Capacity | None = PLAN_DEFAULTS.capacity,
              cost_model: CostModel | None = None, balance_by: str = PLAN_DEFAULTS.balance_by,
              expert_buckets: str = DEFAULT_EXPERT_BUCKETS, geometry: str = WHOLE_GEOMETRY, *,
              empty_ok: bool = False, matrix_config: object | None = None) -> Plan:
    """Run the DP policy, then the TP policy on each DP rank's matrices (`expert_buckets`: how
    buckets of stacked expert matrices are sized, `canzona.dp.layout.EXPERT_BUCKETS`; `empty_ok`:
    a model without matrices gets a plan of no buckets).

    `geometry` "auto" (`GEOMETRIES`): a whole-matrix DP policy's plan whose segments are uneven is
    replaced by ZeRO-1's even segments (`zero1-even`, the same buckets) when those, under the same
    TP scheduler, plan a step compute no longer than it (`TPMetrics.makespan`) and put no more
    optimizer state on the fullest GPU (`fullest_state`): the same step in no more memory, with the
    cheapest DP collectives.

    `matrix_config` (None, a mapping of fields or a config object; refused for an elementwise
    optimizer): the configuration the matrices' step runs at. Its seconds (`canzona.cost.priced_with`:
    a measured table's rows are the default configuration's) and its state are what the DP policy
    balances, as the runtime runs it; the defaults given explicitly plan as none given."""
    check_sizes(dp=dp, tp=tp)
    if not is_whole_number(align, 1, MAX_ALIGN):
        raise SpecError(f"align must be a whole number of elements in 1..{MAX_ALIGN}, got {align}")
    if bucket_size is not None and not is_whole_number(bucket_size, 1, MAX_ELEMENTS):
        raise SpecError(f"bucket size must be in 1..{MAX_ELEMENTS} elements, got {bucket_size}")
    optimizer = check_matrix_optimizer(optimizer)
    check_dp_policy(dp_policy)
    check_tp_policy(tp_policy)
    check_geometry(geometry)
    model.check_tp(tp)
    if not model.matrix_params() and not empty_ok:
        raise SpecError(f"model {model.name!r} has no matrix parameters to plan")
    matrix_config = matrix_config_for(optimizer, matrix_config)
    cost_model = priced_with(cost_model or AnalyticCost(), optimizer, matrix_config)
    items = dp_items(model, tp, optimizer, cost_model, matrix_config)

    def planned(name: str) -> tuple[DPPlan, TPPlan]:
        dpp = plan_dp(items, dp, name, alpha, bucket_size, align, balance_by, expert_buckets)
        return dpp, plan_tp(tp_tasks(model, dpp, optimizer, tp), tp, tp_policy, capacity)

    dpp, tpp = planned(dp_policy)
    if geometry == AUTO_GEOMETRY and keeps_geometry(dpp) and not matrix_optimizer(optimizer).elementwise \
            and not evenly_cut(dpp):
        even, even_tp = planned(EVEN_GEOMETRY_POLICY)
        if even_tp.metrics.makespan <= tpp.metrics.makespan * (1 + TIE) and \
                fullest_state(even, even_tp) <= fullest_state(dpp, tpp):
            dpp, tpp = even, even_tp
    return Plan(model.name, model.fingerprint(tp), dp, tp, optimizer, cost_model.name, dpp, tpp)


def evenly_cut(dp_plan: DPPlan) -> bool:
    """Every bucket's segments are as long as each other (its collectives take the even route)."""
    return all(len(set(b.segment_lengths())) <= 1 for b in dp_plan.buckets)


def fullest_state(dp_plan: DPPlan, tp_plan: TPPlan) -> int:
    """Optimizer-state bytes of the GPU that holds the most: each matrix's full state on its host
    TP rank (every TP rank under tp-sync) of each DP rank that computes it."""
    state = dp_plan.state_bytes
    most = 0
    for rank in tp_plan.groups:
        held = [0] * tp_plan.tp
        for g in rank:
            for name, host in zip(g.tasks, g.hosts):
                for t in range(tp_plan.tp) if host == EVERY_RANK else (host,):
                    held[t] += state[name]
        most = max(most, *held)
    return most


# --- loading and validation -------------------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _get(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise PlanError(f"{where}: missing field {key!r}")
    value = obj[key]
    if kind is float:
        if not is_finite_number(value):
            raise PlanError(f"{where}: field {key!r} must be a finite number")
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise PlanError(f"{where}: field {key!r} has the wrong type")
    return value


def _placement(row: Any, where: str) -> Placement:
    if not (isinstance(row, list) and len(row) == 6):
        raise PlanError(f"{where}: each parameter must be [name, offset, numel, cost, state_bytes, owner]")
    name, offset, numel, cost, sbytes, owner = row
    if not isinstance(name, str) or not all(_is_int(v) for v in (offset, numel, sbytes, owner)) \
            or not is_finite_number(cost):
        raise PlanError(f"{where}: parameter {row[0]!r} has a field of the wrong type")
    if offset < 0 or numel < 1 or cost < 0 or sbytes < 0:
        raise PlanError(f"{where}: parameter {name} has a negative offset, cost or size")
    if offset > MAX_ELEMENTS or numel > MAX_ELEMENTS or sbytes > MAX_STATE_BYTES or not 0 <= owner <= MAX_DP:
        raise PlanError(f"{where}: parameter {name} has an offset, size or owner beyond any real model")
    return Placement(name, offset, numel, float(cost), sbytes, owner)


def _dp_from(d: dict[str, Any], dp: int) -> DPPlan:
    where = "dp_plan"
    policy = _get(d, "policy", str, where)
    try:
        check_dp_policy(policy)
    except SpecError as e:
        raise PlanError(f"{where}: {e}") from None
    alpha = d.get("alpha")
    if alpha is not None and not (is_finite_number(alpha) and 0 <= alpha <= 1):
        raise PlanError(f"{where}: alpha must be a number in [0, 1], got {alpha!r}")
    align = _get(d, "align", int, where)
    if align < 1:
        raise PlanError(f"{where}: alignment must be >= 1 element, got {align}")
    buckets = []
    for i, b in enumerate(_get(d, "buckets", list, where)):
        bw = f"{where}: bucket {i}"
        params = tuple(_placement(row, bw) for row in _get(b, "params", list, bw))
        cuts = tuple(_get(b, "cuts", list, bw))
        if not all(isinstance(c, int) and not isinstance(c, bool) for c in cuts):
            raise PlanError(f"{bw}: cut points must be integers")
        buckets.append(BucketPlan(_get(b, "index", int, bw), params, _get(b, "size", int, bw), cuts))
    return DPPlan(policy, dp, None if alpha is None else float(alpha), align,
                  _get(d, "bucket_size", int, where), _get(d, "split_compute", bool, where),
                  tuple(buckets), _get(d, "fell_back", bool, where), _get(d, "balance_by", str, where))


def _tp_from(d: dict[str, Any], tp: int) -> TPPlan:
    where = "tp_plan"
    policy = _get(d, "policy", str, where)
    try:
        check_tp_policy(policy)
    except SpecError as e:
        raise PlanError(f"{where}: {e}") from None
    cap = d.get("capacity")
    capacity = None
    if cap is not None:
        try:
            capacity = Capacity(_get(cap, "value", float, where), _get(cap, "unit", str, where))
        except SpecError as e:
            raise PlanError(f"{where}: {e}") from None
    groups = []
    for r, rank in enumerate(_get(d, "groups", list, where)):
        rw = f"{where}: DP rank {r}"
        if not isinstance(rank, list):
            raise PlanError(f"{rw}: groups must be a list")
        row = []
        for g in rank:
            tasks, hosts, costs = (_get(g, k, list, rw) for k in ("tasks", "hosts", "costs"))
            if not (len(tasks) == len(hosts) == len(costs)):
                raise PlanError(f"{rw}: a micro-group's tasks, hosts and costs differ in length")
            if not all(isinstance(t, str) for t in tasks) or not all(_is_int(h) for h in hosts) \
                    or not all(is_finite_number(c) and c >= 0 for c in costs):
                raise PlanError(f"{rw}: micro-group tasks must be names, hosts integers, costs non-negative numbers")
            row.append(MicroGroup(tuple(tasks), tuple(hosts), tuple(float(c) for c in costs)))
        groups.append(tuple(row))
    return TPPlan(policy, tp, capacity, tuple(groups))


def plan_from_dict(data: Any) -> Plan:
    """Build and validate a plan from parsed JSON; anything malformed is a one-line PlanError."""
    try:
        return _plan_from_dict(data)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        if isinstance(e, PlanError):
            raise
        raise PlanError(f"plan: malformed ({type(e).__name__}: {e})") from None


def _plan_from_dict(data: Any) -> Plan:
    if not isinstance(data, dict):
        raise PlanError("plan: not a JSON object")
    if data.get("schema") != SCHEMA:
        raise PlanError(f"plan: not a canzona plan (schema {data.get('schema')!r}, expected {SCHEMA!r})")
    version = data.get("version")
    if not _is_int(version) or version != VERSION:
        raise PlanError(f"plan: unsupported version {version!r} (this canzona reads version {VERSION})")
    layout = _get(data, "layout", dict, "plan")
    unknown = sorted(set(layout) - set(PLAN_AXES) - set(EXPERT_AXES))
    if unknown:
        raise PlanError(f"layout: axis {unknown[0]!r} is not one this canzona plans for "
                        f"({', '.join(PLAN_AXES + EXPERT_AXES)})")
    plan = _part_from(data, {k: v for k, v in layout.items() if k in PLAN_AXES}, "plan")
    if set(EXPERT_AXES) & set(layout) or "experts" in data:
        ep, etp = (_get(layout, axis, int, "layout") for axis in EXPERT_AXES)
        if not (2 <= ep <= MAX_DP and 1 <= etp <= MAX_TP):
            raise PlanError(f"layout: ep must be in 2..{MAX_DP} and etp in 1..{MAX_TP}, got ep={ep} etp={etp}")
        experts_body = _get(data, "experts", dict, "plan")
        experts = _part_from(experts_body, _get(experts_body, "layout", dict, "experts"), "experts")
        plan = replace(plan, experts=experts, ep=ep)
    validate_plan(plan)
    return plan


def _part_from(data: dict[str, Any], layout: dict[str, Any], where: str) -> Plan:
    """One part of a plan file (the whole plan, or the experts' under expert parallelism): its
    model, axes, optimizer, cost model and DP and TP plans."""
    model = _get(data, "model", dict, where)
    unknown = sorted(set(layout) - set(PLAN_AXES))
    if unknown:
        raise PlanError(f"{where}: layout axis {unknown[0]!r} is not one of {', '.join(PLAN_AXES)}")
    dp, tp = _get(layout, "dp", int, "layout"), _get(layout, "tp", int, "layout")
    if not (1 <= dp <= MAX_DP and 1 <= tp <= MAX_TP):
        raise PlanError(f"layout: dp must be in 1..{MAX_DP} and tp in 1..{MAX_TP}, got dp={dp} tp={tp}")
    return Plan(
        _get(model, "name", str, "model"),
        _get(model, "fingerprint", str, "model"),
        dp,
        tp,
        _get(data, "optimizer", str, where),
        _get(data, "cost_model", str, where),
        _dp_from(_get(data, "dp_plan", dict, where), dp),
        _tp_from(_get(data, "tp_plan", dict, where), tp),
    )


def validate_plan(plan: Plan, model: ModelSpec | None = None) -> None:
    """Raise PlanError, in one line, on the first inconsistency (or mismatch with `model`)."""
    try:
        check_matrix_optimizer(plan.optimizer)
    except SpecError as e:
        raise PlanError(f"plan: {e}") from None
    _validate_dp(plan.dp_plan)
    _validate_tp(plan)
    if plan.experts is not None:
        e = plan.experts
        if e.experts is not None:
            raise PlanError("experts: an expert plan holds no experts of its own")
        if e.optimizer != plan.optimizer:
            raise PlanError(f"experts: planned for {e.optimizer}, the dense part for {plan.optimizer}")
        if e.dp * plan.ep * e.tp != plan.dp * plan.tp:
            raise PlanError(f"layout: edp x ep x etp = {e.dp} x {plan.ep} x {e.tp} must be the dp x tp = "
                            f"{plan.dp} x {plan.tp} GPUs (canzona.experts)")
        validate_plan(e)
    elif plan.ep != 1:
        raise PlanError(f"layout: ep={plan.ep} without an expert plan")
    if model is not None:
        check_plan_matches(plan, model)


def _validate_dp(d: DPPlan) -> None:
    seen: set[str] = set()
    if d.balance_by not in BALANCE_UNITS:
        raise PlanError(f"dp_plan: balance unit must be one of {', '.join(BALANCE_UNITS)}, got {d.balance_by!r}")
    if not 1 <= d.align <= MAX_ALIGN or not 1 <= d.bucket_size <= MAX_ELEMENTS:
        raise PlanError(f"dp_plan: align must be in 1..{MAX_ALIGN} and bucket_size in 1..{MAX_ELEMENTS}")
    check_choice(d.policy, DP_REGISTRY, "DP policy", error=PlanError, where="dp_plan")
    if d.split_compute != DP_REGISTRY[d.policy].splits_compute:
        splitting = ", ".join(n for n, e in DP_REGISTRY.items() if e.splits_compute)
        raise PlanError(f"dp_plan: split_compute is {d.split_compute} under {d.policy} (only {splitting} splits)")
    indices = [b.index for b in d.buckets]
    if len(set(indices)) != len(indices):
        raise PlanError("dp_plan: bucket indices repeat")
    if not is_finite_number(sum(p.cost for p in d.placements())):
        raise PlanError("dp_plan: the costs add up to more than a float holds")
    for b in d.buckets:
        w = f"dp_plan: bucket {b.index}"
        if not 1 <= b.size <= MAX_ELEMENTS:
            raise PlanError(f"{w}: size must be in 1..{MAX_ELEMENTS} elements, got {b.size}")
        if len(b.cuts) != d.dp + 1:
            raise PlanError(f"{w}: has {len(b.cuts)} cut points, expected dp + 1 = {d.dp + 1}")
        if b.cuts[0] != 0 or b.cuts[-1] != b.size or any(x > y for x, y in zip(b.cuts, b.cuts[1:])):
            raise PlanError(f"{w}: segments must be contiguous, in rank order, and cover [0, {b.size})")
        end = 0
        for p in b.params:
            if p.name in seen:
                raise PlanError(f"{w}: parameter {p.name} appears more than once in the plan")
            seen.add(p.name)
            # a stack's matrices are packed as the stacked parameter holds them (`make_buckets`):
            # a start off the alignment is one that follows the previous matrix directly
            if p.numel < 1 or p.offset < end or (p.offset % d.align and p.offset != end) or p.end > b.size:
                raise PlanError(f"{w}: parameter {p.name} is misplaced (overlap, misalignment or overflow)")
            if not 0 <= p.owner < d.dp:
                raise PlanError(f"{w}: parameter {p.name} has owner {p.owner} outside 0..{d.dp - 1}")
            if keeps_geometry(d) and list(b.ranks_overlapping(p)) != [p.owner]:
                raise PlanError(f"{w}: parameter {p.name} is not whole inside its owner's segment")
            end = p.end


def _validate_tp(plan: Plan) -> None:
    t, d = plan.tp_plan, plan.dp_plan
    if len(t.groups) != plan.dp:
        raise PlanError(f"tp_plan: has groups for {len(t.groups)} DP ranks, expected {plan.dp}")
    if not is_finite_number(sum(c for rank in t.groups for g in rank for c in g.costs)):
        raise PlanError("tp_plan: the micro-group costs add up to more than a float holds")
    expected: list[set[str]] = [set() for _ in range(plan.dp)]
    if not matrix_optimizer(plan.optimizer).elementwise:  # which computes no matrix whole
        for b in d.buckets:
            for p in b.params:
                for r in d.computing_ranks(b, p):
                    expected[r].add(p.name)
    for r, rank in enumerate(t.groups):
        got = [name for g in rank for name in g.tasks]
        if len(got) != len(set(got)) or set(got) != expected[r]:
            raise PlanError(f"tp_plan: DP rank {r}'s micro-groups do not hold exactly the matrices it computes")
        for g in rank:
            for h in g.hosts:
                if not (0 <= h < plan.tp or (h == EVERY_RANK and t.policy in TP_REGISTRY and TP_REGISTRY[t.policy].every_rank)):
                    raise PlanError(f"tp_plan: DP rank {r} has host {h} outside 0..{plan.tp - 1}")


# the largest size of each parallel axis a plan is made or checked for (EP ranks are DP x TP ranks)
MAX_SIZES = {"dp": MAX_DP, "tp": MAX_TP, "ep": MAX_DP}


def check_sizes(**sizes: int | None) -> None:
    """Each given parallel size (`dp=`, `tp=`, `ep=`; None: not given) a whole number in 1..its
    maximum (`MAX_SIZES`): a plan's, or a job's a plan is checked against (`canzona inspect --dp 0`
    said "plan is for dp=4, but the job has dp=0")."""
    for name, size in sizes.items():
        if size is not None and not is_whole_number(size, 1, MAX_SIZES[name]):
            raise SpecError(f"{name} must be in 1..{MAX_SIZES[name]}, got {size}")


def check_plan_matches(plan: Plan, model: ModelSpec, dp: int | None = None, tp: int | None = None, *,
                       ep: int | None = None, hidden: int | None = None) -> None:
    """The plan was made for this model (and, if given, this layout); a mismatch says what differs.
    Given a layout (a job's, as the runtime checks its plan), a plan that splits expert stacks over
    TP is refused: expert TP is planned and simulated only. Under expert parallelism
    (`plan.experts`) `model` is the whole model: its dense part is checked against the plan and one
    EP rank's experts against the expert plan (`hidden`: the model's hidden size, which an expert
    plan with expert TP needs to tell each matrix's split)."""
    check_sizes(dp=dp, tp=tp, ep=ep)
    if ep is not None and plan.ep != ep:
        raise PlanError(f"plan is for ep={plan.ep}, but the job has ep={ep}")
    if plan.experts is None:
        _check_part(plan, model, dp, tp)
        return
    job = dp is not None or tp is not None or ep is not None
    if job and plan.etp > 1:
        raise PlanError(f"plan has expert TP (etp={plan.etp}): expert tensor parallelism is planned and simulated, "
                        "not run; a job holds each of its experts whole (etp 1)")
    try:
        check_ep(model, plan.ep, plan.dp, plan.tp, plan.etp, hidden)
        experts = expert_part(model, plan.ep, plan.etp, hidden)
    except SpecError as e:
        raise PlanError(f"plan is for ep={plan.ep}, etp={plan.etp}: {e}") from None
    _check_part(plan.dense, dense_part(model), dp, tp)
    _check_part(plan.experts, experts, None, None)


def check_plan_config(plan: Plan, model: ModelSpec, matrix_config: object | None = None, *,
                      hidden: int | None = None) -> None:
    """The plan was priced at `matrix_config` (the runtime's option of that name: None, a mapping of
    fields or a config object), as far as a plan can tell: it records each matrix's optimizer state
    (what its DP policy balanced, and what every memory figure made from it counts), so a
    configuration that keeps other state (SOAP's or Shampoo's `max_precond_dim`) is a PlanError
    naming the first such matrix. Hyper-parameters that change only seconds (a learning rate, NS
    steps) leave no trace in a plan. `model` as `check_plan_matches` takes it, which runs first."""
    if plan.elementwise:  # an elementwise optimizer's plan is priced at its defaults (matrix_config_for)
        return
    cfg = matrix_config_for(plan.optimizer, matrix_config)
    parts = [(plan, model)] if plan.experts is None else \
        [(plan.dense, dense_part(model)), (plan.experts, expert_part(model, plan.ep, plan.etp, hidden))]
    for part, spec in parts:
        shapes = {p.name: p.shape for p in spec.matrix_params()}
        for p in part.dp_plan.placements():
            kept = state_bytes(plan.optimizer, shapes[p.name], cfg)
            if p.state_bytes != kept:
                raise PlanError(f"plan was made for another {plan.optimizer} configuration: it prices {p.name}'s "
                                f"optimizer state at {p.state_bytes} bytes, matrix_config keeps {kept} (plan with the "
                                "job's configuration: canzona plan --matrix-config)")


def check_plan_settings(plan: Plan, policy: StepPolicy, settings: PlanSettings,
                        geometry: str = DEFAULT_GEOMETRY) -> None:
    """Planning settings given beside a plan (the runtime's `plan=` with `dp_policy=`, `bucket_size=`,
    ...) plan nothing: a setting off its default (`PLAN_DEFAULTS`) that the step policy takes and the
    plan records otherwise is a PlanError naming both values, not a setting silently run otherwise.
    A policy with its own DP policy (the baselines) takes neither `dp_policy` nor `geometry`, and one
    with its own TP scheduler neither `tp_policy` nor `capacity` (as `plan_for` plans them): not
    compared. Under "auto" geometry a plan of ZeRO-1's even segments is what any whole-matrix DP
    policy may become."""
    for part in (plan.dense, plan.experts) if plan.experts is not None else (plan,):
        dpp, tpp, given = part.dp_plan, part.tp_plan, []
        if policy.dp_policy is None:
            even_ok = geometry == AUTO_GEOMETRY or settings.dp_policy == EVEN_GEOMETRY_POLICY
            if dpp.policy != settings.dp_policy and not (dpp.policy == EVEN_GEOMETRY_POLICY and even_ok):
                given.append(("dp_policy", settings.dp_policy, dpp.policy))
            if not even_ok and dpp.policy == EVEN_GEOMETRY_POLICY:  # "whole" asked, ZeRO-1's even segments given
                given.append(("geometry", geometry, AUTO_GEOMETRY))
        if dpp.alpha is not None:  # a DP policy that balances by alpha
            given.append(("alpha", settings.alpha, dpp.alpha))
        if settings.bucket_size is not None:
            given.append(("bucket_size", settings.bucket_size, dpp.bucket_size))
        given += [("align", settings.align, dpp.align), ("balance_by", settings.balance_by, dpp.balance_by)]
        if policy.tp_policy is None:
            given.append(("tp_policy", settings.tp_policy, tpp.policy))
            if settings.capacity is not None and tpp.capacity is not None:  # a scheduler that cuts by capacity
                given.append(("capacity", settings.capacity, tpp.capacity))
        for name, value, planned in given:
            default = DEFAULT_GEOMETRY if name == "geometry" else getattr(PLAN_DEFAULTS, name)
            if value != default and value != planned:
                raise PlanError(f"{name}={value!r} was given with a plan made with {name}={planned!r}: a plan fixes "
                                f"its settings (give the plan alone, or plan with {name}={value!r})")


def _check_part(plan: Plan, model: ModelSpec, dp: int | None, tp: int | None) -> None:
    detail = _placement_difference(plan, model)
    # a TP-1 plan written before its fingerprint left the TP dims out records them: the same model too
    if plan.fingerprint not in (model.fingerprint(plan.tp), model.fingerprint()):
        why = detail or "the same matrices, but other AdamW parameters, roles or tensor-parallel dims"
        why += parametrized_routing(model, "a plan", "make the plan again", plan.fingerprint, plan.tp)
        raise PlanError(f"plan was made for model {plan.model!r} ({plan.fingerprint}), not {model.name!r} "
                        f"({model.fingerprint(plan.tp)}): {why}")
    if dp is not None and plan.dp != dp:
        raise PlanError(f"plan is for dp={plan.dp}, but the job has dp={dp}")
    if tp is not None and plan.tp != tp:
        raise PlanError(f"plan is for tp={plan.tp}, but the job has tp={tp}")
    split = next((p for p in model.stacks if p.tp_dim is not None), None) if plan.tp > 1 and tp is not None else None
    if split is not None:
        # a job runs experts whole on every TP rank: expert TP (stacks split by TP) is planned and
        # simulated (`canzona simulate --etp`), and no runtime executes it yet
        raise PlanError(f"stack {split.name!r} is split by TP (tp_dim {split.tp_dim}): expert tensor parallelism is "
                        "planned and simulated, not run; a job holds its experts whole on every TP rank")
    if detail:
        raise PlanError(f"plan does not match model {model.name!r}: {detail}")


def _placement_difference(plan: Plan, model: ModelSpec) -> str:
    """The first matrix the plan places differently from the model ('' if none)."""
    try:
        want = {p.name: p.local_numel(plan.tp) for p in model.matrix_params()}
    except SpecError as e:
        return str(e)
    got = {p.name: p.numel for p in plan.dp_plan.placements()}
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    wrong = sorted(n for n in set(got) & set(want) if got[n] != want[n])
    if missing:
        return f"the plan lacks {missing[0]}"
    if extra:
        return f"the model has no matrix {extra[0]}"
    if wrong:
        return f"{wrong[0]} has {got[wrong[0]]} elements per shard in the plan, {want[wrong[0]]} in the model"
    return ""


def plan_from_json(text: str) -> Plan:
    return plan_from_dict(parse_json(text, "plan", PlanError))


def load_plan(path: str | Path, model: ModelSpec | None = None) -> Plan:
    text = read_text(path, "plan file", PlanError)
    try:
        plan = plan_from_json(text)
        if model is not None:
            check_plan_matches(plan, model)
    except PlanError as e:
        raise PlanError(f"{path}: {e}") from None
    return plan

