"""DP partitioning policies (docs/design.md §5): pure functions from buckets of items to a DPPlan.

All costs are seconds. Buckets arrive in backward order; loads carry across buckets.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate

from canzona.choices import check_choice
from canzona.dp.layout import (
    DEFAULT_EXPERT_BUCKETS,
    BucketPlan,
    DPItem,
    DPPlan,
    check_expert_buckets,
    even_cuts,
    is_stack_run,
    make_buckets,
    owner_of,
    place,
)
from canzona.dp.reorder import reorder_assign
from canzona.errors import SpecError
from canzona.scheduling import lpt_assign

Buckets = Sequence[Sequence[DPItem]]

DEFAULT_ALIGN = 64  # elements; Megatron pads each parameter start to 64 elements
MIN_BUCKET = 40_000_000  # Megatron's default bucket size in elements


MATRICES_PER_RANK = 4  # per bucket, by default


def default_bucket_size(items: Sequence[DPItem], dp: int) -> int:
    """About four average matrices per rank per bucket, never below Megatron's `max(40M, 1M * dp)`
    or the largest matrix.

    Whole-matrix segments are only as even as their granularity: with one matrix per rank per
    bucket the longest segment is about 2.5x the even one on Qwen3-32B at DP 32, with four it is
    about 1.2-1.4x (the authors, too, size buckets in whole matrices per rank). Fewer, larger
    buckets overlap less with the last backward; `--bucket-size` trades the two.
    """
    if not items:
        return MIN_BUCKET
    largest = max(it.numel for it in items)
    per_rank = MATRICES_PER_RANK * dp * sum(it.numel for it in items) // len(items)
    return max(MIN_BUCKET, 1_000_000 * dp, largest, per_rank)


def _plan(policy: str, dp: int, alpha: float | None, align: int, bucket_size: int,
          buckets: list[BucketPlan], split_compute: bool = False, fell_back: bool = False) -> DPPlan:
    return DPPlan(policy, dp, alpha, align, bucket_size, split_compute, tuple(buckets), fell_back)


def _fixed_order(index: int, items: Sequence[DPItem], dp: int, align: int,
                 cuts_of: Callable[[Sequence[int], int], tuple[int, ...]],
                 owners: Sequence[int] | None = None) -> BucketPlan:
    """Bucket in its given order; cut points from `cuts_of(starts, size)`; owner = first element's
    rank unless `owners` are given."""
    placements, size = place(items, [0] * len(items), align, dp)
    starts = [p.offset for p in placements]
    cuts = cuts_of(starts, size)
    own = owners if owners is not None else [owner_of(s, cuts) for s in starts]
    placements, _ = place(items, own, align, dp)
    return BucketPlan(index, placements, size, cuts)


def zero1_even(buckets: Buckets, dp: int, align: int, bucket_size: int) -> DPPlan:
    """Stock ZeRO-1: even segments; a matrix may straddle ranks, each of which then computes it."""
    plans = [_fixed_order(i, b, dp, align, lambda starts, size: even_cuts(size, dp))
             for i, b in enumerate(buckets)]
    return _plan("zero1-even", dp, None, align, bucket_size, plans, split_compute=True)


def whole_start_cuts(starts: Sequence[int], size: int, dp: int) -> tuple[int, ...]:
    """Rank r's segment starts at the first parameter whose first element lies in even segment r."""
    cuts = [0]
    for r in range(1, dp):
        i = bisect.bisect_left(starts, r * size // dp)
        cuts.append(starts[i] if i < len(starts) else size)
    return tuple(cuts + [size])


def whole_start(buckets: Buckets, dp: int, align: int, bucket_size: int) -> DPPlan:
    plans = [_fixed_order(i, b, dp, align, lambda starts, size: whole_start_cuts(starts, size, dp))
             for i, b in enumerate(buckets)]
    return _plan("whole-start", dp, None, align, bucket_size, plans)


def layerwise(buckets: Buckets, dp: int, align: int, bucket_size: int) -> DPPlan:
    """Whole matrices to owners by global LPT; the buffer keeps even ZeRO segments, so owners
    must fetch the parts of their gradients that other ranks hold (extra communication)."""
    flat = [it for b in buckets for it in b]
    owners = lpt_assign([it.cost for it in flat], dp)
    plans, k = [], 0
    for i, b in enumerate(buckets):
        own = owners[k:k + len(b)]
        k += len(b)
        plans.append(_fixed_order(i, b, dp, align, lambda starts, size: even_cuts(size, dp), own))
    return _plan("layerwise", dp, None, align, bucket_size, plans)


def _check_alpha(alpha: float) -> float:
    if not 0.0 <= alpha <= 1.0:
        raise SpecError(f"alpha must be in [0, 1], got {alpha}")
    return float(alpha)


def _blended_score(plan: DPPlan, alpha: float) -> float:
    """What alpha trades: compute balance (alpha = 1) against segment-length balance (alpha = 0)."""
    m = plan.metrics
    return alpha * (m.makespan / m.lower_bound if m.lower_bound > 0 else 1.0) + (1 - alpha) * m.comm_ratio


def _nearest_cut(starts: Sequence[int], cum: Sequence[float], lo: int, even_target: float,
                 cost_target: float, size: int, bucket_cost: float, alpha: float) -> int:
    """Index of the legal boundary (>= lo) nearest the blended target.

    Boundary i sits before parameter i (i == len: the bucket end). Its distance blends how far it
    is from the even cut in elements and from the deficit-fill target in seconds, each normalised by
    the bucket's total. Both coordinates grow with i, so the minimum lies between the two crossings.
    """
    def score(i: int) -> float:
        d_even = abs(starts[i] - even_target) / size
        d_cost = abs(cum[i] - cost_target) / bucket_cost if bucket_cost > 0 else 0.0
        return (1 - alpha) * d_even + alpha * d_cost

    i_even = bisect.bisect_left(starts, even_target)
    i_cost = bisect.bisect_left(cum, cost_target)
    first = max(lo, min(i_even, i_cost) - 1)
    last = min(len(starts) - 1, max(i_even, i_cost))
    best = max(first, lo)
    for i in range(first, max(last, first) + 1):
        if score(i) < score(best):
            best = i
    return best


def alpha_balanced(buckets: Buckets, dp: int, align: int, bucket_size: int, alpha: float = 1.0) -> DPPlan:
    """The paper's policy: cut points at parameter boundaries, targets blending an even split with a
    deficit fill of the global per-rank target; largest buckets first; kept only if it beats
    `whole-start` on the same blended objective."""
    alpha = _check_alpha(alpha)
    total = sum(it.cost for b in buckets for it in b)
    target = total / dp
    loads = [0.0] * dp
    plans: list[BucketPlan | None] = [None] * len(buckets)
    order = sorted(range(len(buckets)), key=lambda i: (-sum(it.cost for it in buckets[i]), i))
    for bi in order:
        items = buckets[bi]
        placements, size = place(items, [0] * len(items), align, dp)
        starts = [p.offset for p in placements] + [size]
        cum = [0.0, *accumulate(it.cost for it in items)]
        bucket_cost = cum[-1]
        deficits = [max(0.0, target - load) for load in loads]
        total_deficit = sum(deficits)
        shares = ([bucket_cost * d / total_deficit for d in deficits] if total_deficit > 1e-15
                  else [bucket_cost / dp] * dp)
        idx, cost_target = [0], 0.0
        for r in range(dp - 1):
            cost_target += shares[r]
            idx.append(_nearest_cut(starts, cum, idx[-1], (r + 1) * size / dp, cost_target,
                                    size, bucket_cost, alpha))
        idx.append(len(items))
        cuts = tuple(starts[i] for i in idx)
        owners = [owner_of(p.offset, cuts) for p in placements]
        for it, r in zip(items, owners):
            loads[r] += it.cost
        placements, _ = place(items, owners, align, dp)
        plans[bi] = BucketPlan(bi, placements, size, cuts)
    plan = _plan("alpha-balanced", dp, alpha, align, bucket_size, plans)
    baseline = whole_start(buckets, dp, align, bucket_size)
    if _blended_score(plan, alpha) < _blended_score(baseline, alpha):
        return plan
    return _plan("alpha-balanced", dp, alpha, align, bucket_size, list(baseline.buckets), fell_back=True)


def alpha_balanced_reorder(buckets: Buckets, dp: int, align: int, bucket_size: int,
                           alpha: float = 1.0) -> DPPlan:
    """Ours: the order inside a bucket is free, so pick each rank's subset by LPT with loads carried
    across buckets (plus local search), then lay each bucket out grouped by owner. `alpha` caps each
    segment at `(bucket / dp) * dp**alpha` elements: alpha = 0 asks for even segments, 1 for none."""
    alpha = _check_alpha(alpha)
    owners = reorder_assign(buckets, dp, alpha)
    plans = []
    for bi, (items, own) in enumerate(zip(buckets, owners)):
        if is_stack_run(items):
            # matrices of as many elements (alike, for every stack's matrices): the same owners in
            # rank order keep every segment (and load), and the stacks' memory order
            own = sorted(own)
        order = sorted(range(len(items)), key=lambda i: (own[i], i))
        ordered = [items[i] for i in order]
        ordered_owners = [own[i] for i in order]
        placements, size = place(ordered, ordered_owners, align, dp)
        cuts = [0]
        for r in range(1, dp):
            k = bisect.bisect_left(ordered_owners, r)
            cuts.append(placements[k].offset if k < len(placements) else size)
        plans.append(BucketPlan(bi, placements, size, tuple(cuts + [size])))
    return _plan("alpha-balanced-reorder", dp, alpha, align, bucket_size, plans)


@dataclass(frozen=True, kw_only=True)
class DPPolicy:
    """A DP policy's registry entry: how it plans and the properties the rest of the toolkit asks
    of its plans (nothing outside this registry compares policy names)."""

    name: str
    build: Callable[..., DPPlan]  # (buckets, dp, align, bucket size[, alpha]) -> DPPlan
    # every matrix lies whole inside its owner's contiguous segment, so the reduce-scatter lands
    # each gradient on the rank that updates it (ZeRO-1's geometry kept; canzona's step needs it)
    keeps_geometry: bool
    # matrices are cut by even segments: every rank whose segment overlaps one computes it
    splits_compute: bool = False
    takes_alpha: bool = False  # balances compute against segment size by `alpha`


DP_REGISTRY: dict[str, DPPolicy] = {
    "zero1-even": DPPolicy(name="zero1-even", build=zero1_even, keeps_geometry=False, splits_compute=True),
    "whole-start": DPPolicy(name="whole-start", build=whole_start, keeps_geometry=True),
    # owners scattered over the buffer, one matrix's segment is not its owner's
    "layerwise": DPPolicy(name="layerwise", build=layerwise, keeps_geometry=False),
    "alpha-balanced": DPPolicy(name="alpha-balanced", build=alpha_balanced, keeps_geometry=True, takes_alpha=True),
    "alpha-balanced-reorder": DPPolicy(name="alpha-balanced-reorder", build=alpha_balanced_reorder,
                                       keeps_geometry=True, takes_alpha=True),
}
DP_POLICIES = tuple(DP_REGISTRY)
# canzona's default: never worse than the paper's alpha-balanced and often better, as simulated
# (Qwen3-32B / 256 H100 / TP 8, Muon: step 25.2 -> 22.3 ms, reduce-scatter longest / even segment
# 1.44 -> 1.23; Qwen3-14B / 128: step 30.0 -> 20.7 ms; Qwen3-4B / 64 / TP 4, Shampoo: 27.5 -> 23.3
# ms; equal on Qwen3-8B / 64 and Qwen3-32B / 1024). The paper's stays one flag away.
DEFAULT_DP_POLICY = "alpha-balanced-reorder"
PAPER_DP_POLICY = "alpha-balanced"  # the Canzona paper's (arXiv 2602.06079)
ALPHA_POLICIES = tuple(name for name, e in DP_REGISTRY.items() if e.takes_alpha)
KEEPS_GEOMETRY = frozenset(name for name, e in DP_REGISTRY.items() if e.keeps_geometry)


def keeps_geometry(plan: DPPlan) -> bool:
    """Every matrix of `plan` lies whole inside its owner's contiguous segment (its policy's
    `DPPolicy.keeps_geometry`, and nothing split)."""
    entry = DP_REGISTRY.get(plan.policy)
    return entry is not None and entry.keeps_geometry and not plan.split_compute


def check_dp_policy(name: str) -> str:
    return check_choice(name, DP_REGISTRY, "DP policy")


def dp_policy(name: str) -> DPPolicy:
    """The registry entry of DP policy `name` (SpecError, one line, for an unknown one)."""
    return DP_REGISTRY[check_dp_policy(name)]


BALANCE_UNITS = ("seconds", "elements")


def _with_costs(plan: DPPlan, items: Sequence[DPItem], balance_by: str) -> DPPlan:
    """The same layout with each placement's real cost and state: how an element-balanced plan
    really performs."""
    real = {it.name: it for it in items}
    buckets = tuple(
        replace(b, params=tuple(replace(p, cost=real[p.name].cost, state_bytes=real[p.name].state_bytes)
                                for p in b.params))
        for b in plan.buckets
    )
    return replace(plan, buckets=buckets, balance_by=balance_by)


def plan_dp(items: Sequence[DPItem], dp: int, policy: str, alpha: float = 1.0,
            bucket_size: int | None = None, align: int = DEFAULT_ALIGN,
            balance_by: str = "seconds", expert_buckets: str = DEFAULT_EXPERT_BUCKETS) -> DPPlan:
    """Plan the matrices `items` (forward order) over `dp` ranks with `policy`.

    `balance_by="elements"` reproduces the authors' code, which balances element counts inside the
    allocation loop; the returned plan carries the real costs so its metrics are in seconds.
    `expert_buckets`: how buckets of stack matrices are sized (`canzona.dp.layout.EXPERT_BUCKETS`).
    """
    check_dp_policy(policy)
    check_expert_buckets(expert_buckets)
    if dp < 1:
        raise SpecError(f"dp must be >= 1, got {dp}")
    if align < 1:
        raise SpecError(f"alignment must be >= 1 element, got {align}")
    _check_alpha(alpha)
    size = bucket_size if bucket_size is not None else default_bucket_size(items, dp)
    if size < 1:
        raise SpecError(f"bucket size must be positive, got {size}")
    if balance_by not in BALANCE_UNITS:
        raise SpecError(f"balance unit must be one of {', '.join(BALANCE_UNITS)}, got {balance_by!r}")
    planned = items if balance_by == "seconds" else [replace(it, cost=float(it.numel)) for it in items]
    buckets = make_buckets(planned, size, dp if expert_buckets == "dp-multiple" else None)
    entry = DP_REGISTRY[policy]
    plan = entry.build(buckets, dp, align, size, alpha) if entry.takes_alpha else entry.build(buckets, dp, align, size)
    return plan if balance_by == "seconds" else _with_costs(plan, items, balance_by)
