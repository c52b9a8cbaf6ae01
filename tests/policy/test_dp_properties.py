"""Property tests for the DP partitioning policies (docs/design.md §5) on random instances."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from canzona.dp import DP_POLICIES, DPItem, plan_dp
from canzona.errors import SpecError
from canzona.scheduling import lpt_assign
from tests.policy.strategies import close, dp_instances, overlap

ATOMIC = ("whole-start", "alpha-balanced", "alpha-balanced-reorder")
TOL = 1e-9

SETTINGS = settings(max_examples=120, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _run(inst, policy: str):
    return plan_dp(inst["items"], inst["dp"], policy, alpha=inst["alpha"],
                   bucket_size=inst["bucket_size"], align=inst["align"])


def _blended(plan, alpha: float) -> float:
    """The objective alpha-balanced trades (docs/design.md §5.4): compute balance vs segment-length balance."""
    m = plan.metrics
    lb_ratio = m.makespan / m.lower_bound if m.lower_bound > 0 else 1.0
    return alpha * lb_ratio + (1 - alpha) * m.comm_ratio


def _check_geometry(plan, inst) -> None:
    items, dp, align = inst["items"], inst["dp"], inst["align"]
    by_name = {it.name: it for it in items}
    assert plan.dp == dp and plan.align == align
    if inst["bucket_size"] is not None:
        assert plan.bucket_size == inst["bucket_size"]

    # every matrix in exactly one bucket, exactly once, with its own numel/cost/state
    names = [p.name for p in plan.placements()]
    assert sorted(names) == sorted(by_name)
    for p in plan.placements():
        it = by_name[p.name]
        assert (p.numel, p.cost, p.state_bytes) == (it.numel, it.cost, it.state_bytes)
        assert 0 <= p.owner < dp

    for bi, b in enumerate(plan.buckets):
        assert b.index == bi
        assert b.size >= 1 and b.size % (align * dp) == 0
        cuts = b.cuts
        assert len(cuts) == dp + 1
        assert cuts[0] == 0 and cuts[-1] == b.size
        assert all(x <= y for x, y in zip(cuts, cuts[1:]))
        assert sum(b.segment_lengths()) == b.size
        spans = sorted((p.offset, p.end) for p in b.params)
        for (_, e1), (s2, _) in zip(spans, spans[1:]):
            assert e1 <= s2, "placements overlap"
        for p in b.params:
            assert p.offset % align == 0
            assert 0 <= p.offset and p.end <= b.size
        # unpadded parameter elements never exceed the bucket size
        assert sum(p.numel for p in b.params) <= plan.bucket_size


def _check_backward_order(plan, inst) -> None:
    rev = list(reversed(inst["items"]))
    pos = 0
    for b in plan.buckets:
        got = {p.name for p in b.params}
        run = rev[pos:pos + len(b.params)]
        assert got == {it.name for it in run}, "bucket is not a contiguous run of the backward order"
        pos += len(b.params)
    assert pos == len(rev)
    # buckets are filled greedily: the next parameter would have overflowed the previous bucket
    pos = 0
    for b, nxt in zip(plan.buckets, plan.buckets[1:]):
        pos += len(b.params)
        filled = sum(p.numel for p in b.params)
        assert filled + rev[pos].numel > plan.bucket_size
        assert nxt.params


def _check_policy_geometry(plan, inst) -> None:
    """What each policy promises about order, cuts and owners (docs/design.md §5.4)."""
    dp, align = inst["dp"], inst["align"]
    rev = [it.name for it in reversed(inst["items"])]
    layout = [p.name for b in plan.buckets for p in b.params]
    if plan.policy == "alpha-balanced-reorder":
        for b in plan.buckets:  # laid out grouped by owner, in rank order
            owners = [p.owner for p in b.params]
            assert owners == sorted(owners)
    else:  # fixed order: the backward order itself, packed with aligned starts
        assert layout == rev
    for b in plan.buckets:
        pos = 0
        for p in b.params:
            pos = -(-pos // align) * align
            if plan.policy != "alpha-balanced-reorder":
                assert p.offset == pos, "fixed-order layouts are packed"
            pos = p.offset + p.numel
        boundaries = {p.offset for p in b.params} | {b.size}
        even = tuple(r * b.size // dp for r in range(dp + 1))
        if plan.policy in ("zero1-even", "layerwise"):
            assert b.cuts == even
        if plan.policy in ATOMIC:  # cuts only at parameter boundaries
            assert set(b.cuts) <= boundaries | {0}
        if plan.policy in ("zero1-even", "whole-start"):
            for p in b.params:  # owner: the even segment holding the first element
                assert p.owner == p.offset * dp // b.size
        if plan.policy == "whole-start":
            starts = [p.offset for p in b.params]
            for r in range(1, dp):
                want = min((s for s in starts if s >= even[r]), default=b.size)
                assert b.cuts[r] == want
    if plan.policy == "layerwise":  # global LPT, geometry ignored
        flat = plan.placements()
        assert [p.owner for p in flat] == lpt_assign([p.cost for p in flat], dp)


def _check_alpha_cuts(plan, inst) -> None:
    """alpha-balanced (docs/design.md §5.4): buckets largest first, loads carried; for rank r the target is
    t_r = (1-a) S/d + a S deficit_r / sum(deficit); each cut sits at the legal boundary (at or after
    the previous cut) nearest the blended running target. Checked against every legal boundary."""
    if plan.fell_back:
        return
    dp, alpha = inst["dp"], inst["alpha"]
    target = sum(it.cost for it in inst["items"]) / dp
    loads = [0.0] * dp
    bcost = [sum(p.cost for p in b.params) for b in plan.buckets]
    for bi in sorted(range(len(plan.buckets)), key=lambda i: (-bcost[i], i)):
        b = plan.buckets[bi]
        starts = [p.offset for p in b.params] + [b.size]
        cum = [0.0]
        for p in b.params:
            cum.append(cum[-1] + p.cost)
        deficits = [max(0.0, target - x) for x in loads]
        tot = sum(deficits)
        shares = [cum[-1] * d / tot for d in deficits] if tot > 1e-15 else [cum[-1] / dp] * dp
        idx = [starts.index(c) for c in b.cuts]
        assert idx[0] == 0 and idx[-1] == len(b.params)
        cost_target = 0.0
        for r in range(dp - 1):
            cost_target += shares[r]
            even_target = (r + 1) * b.size / dp
            scores = [(1 - alpha) * abs(starts[i] - even_target) / b.size
                      + alpha * (abs(cum[i] - cost_target) / cum[-1] if cum[-1] > 0 else 0.0)
                      for i in range(len(starts))]
            best = min(scores[idx[r]:])
            assert scores[idx[r + 1]] <= best + 1e-9, f"cut {r + 1} of bucket {bi} is not nearest"
        for p in b.params:
            loads[p.owner] += p.cost


def _check_loads(plan, inst) -> None:
    items, dp = inst["items"], inst["dp"]
    m = plan.metrics
    total = sum(it.cost for it in items)
    largest = max(it.cost for it in items)
    loads = [0.0] * dp
    state = [0] * dp
    redundant = 0.0
    spanning = not_in_owner = extra = 0
    for b in plan.buckets:
        for p in b.params:
            ranks = [r for r in range(dp) if overlap(p.offset, p.end, *b.segment(r)) > 0]
            spanning += len(ranks) > 1
            lo, hi = b.segment(p.owner)
            not_in_owner += not (lo <= p.offset and p.end <= hi)
            computing = ranks if plan.policy == "zero1-even" else [p.owner]
            if plan.policy == "zero1-even":
                assert p.owner == ranks[0]
                redundant += p.cost * (len(ranks) - 1)
            for r in computing:
                loads[r] += p.cost
                state[r] += p.state_bytes
                extra += p.numel - overlap(p.offset, p.end, *b.segment(r))
    assert m.rank_state_bytes == tuple(state)
    assert m.extra_comm_elements == extra
    longest = sum(max(b.segment_lengths()) for b in plan.buckets)
    assert close(m.comm_ratio, longest / sum(b.size / dp for b in plan.buckets))
    assert m.comm_ratio >= 1 - 1e-12
    assert len(m.rank_loads) == dp
    for a, e in zip(m.rank_loads, loads):
        assert close(a, e)
    assert close(m.total, total)
    assert close(sum(m.rank_loads), total + m.redundant_s)
    assert close(m.redundant_s, redundant)
    assert close(m.makespan, max(loads))
    assert close(m.lower_bound, max(total / dp, largest))
    assert m.lower_bound <= m.makespan * (1 + TOL) + TOL
    if plan.policy == "zero1-even":
        assert plan.split_compute
        assert m.atomicity_violations == spanning
        assert m.atomic == (spanning == 0)
    else:
        assert not plan.split_compute
        assert m.redundant_s == 0
        assert m.atomicity_violations == not_in_owner
    if plan.policy in ATOMIC:
        assert not_in_owner == 0, "a placement is not wholly inside its owner's segment"
        assert m.atomicity_violations == 0 and m.atomic
        assert m.extra_comm_elements == 0


@pytest.mark.parametrize("policy", sorted(DP_POLICIES))
@SETTINGS
@given(inst=dp_instances())
def test_dp_policy_invariants(policy, inst):
    plan = _run(inst, policy)
    assert plan.policy == policy
    _check_geometry(plan, inst)
    _check_backward_order(plan, inst)
    _check_policy_geometry(plan, inst)
    if policy == "alpha-balanced":
        _check_alpha_cuts(plan, inst)
    _check_loads(plan, inst)
    # determinism
    assert _run(inst, policy) == plan


@SETTINGS
@given(inst=dp_instances())
def test_alpha_balanced_never_worse_than_whole_start(inst):
    alpha = inst["alpha"]
    plan = _run(inst, "alpha-balanced")
    base = _run(inst, "whole-start")
    assert plan.alpha == alpha
    score, base_score = _blended(plan, alpha), _blended(base, alpha)
    assert score <= base_score + 1e-9
    if plan.fell_back:
        assert plan.buckets == base.buckets
    else:
        assert score < base_score


def _segment_numels(plan):
    """Unpadded elements each rank owns in each bucket."""
    return [[sum(p.numel for p in b.params if p.owner == r) for r in range(plan.dp)]
            for b in plan.buckets]


@SETTINGS
@given(inst=dp_instances(), alpha=st.floats(min_value=0.0, max_value=0.999))
def test_reorder_cap_bound(inst, alpha):
    """alpha < 1 caps each rank's share of a bucket at (bucket / dp) * dp**alpha elements; when no
    rank has room, the item goes to the shortest segment, so a share can exceed the cap by less than
    one matrix."""
    inst = {**inst, "alpha": alpha}
    plan = _run(inst, "alpha-balanced-reorder")
    dp = inst["dp"]
    for b, shares in zip(plan.buckets, _segment_numels(plan)):
        numel = sum(p.numel for p in b.params)
        cap = numel / dp * dp**alpha
        biggest = max(p.numel for p in b.params)
        for s in shares:
            assert s <= cap + biggest + 1e-6


@st.composite
def _uniform_numel_instances(draw):
    """Every matrix the same size, every bucket holding a multiple of dp matrices: the cap is
    feasible, so it must hold exactly."""
    dp = draw(st.integers(1, 6))
    per_rank = draw(st.integers(1, 4))  # matrices per rank per bucket
    nbuckets = draw(st.integers(1, 3))
    k = draw(st.integers(1, 300))
    costs = draw(st.lists(st.floats(0.01, 100.0), min_size=dp * per_rank * nbuckets,
                          max_size=dp * per_rank * nbuckets))
    items = [DPItem(f"p{i}", k, c, 1) for i, c in enumerate(costs)]
    alpha = draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0)))
    return items, dp, per_rank * dp * k, alpha


@SETTINGS
@given(case=_uniform_numel_instances())
def test_reorder_cap_holds_when_feasible(case):
    items, dp, bucket_size, alpha = case
    plan = plan_dp(items, dp, "alpha-balanced-reorder", alpha=alpha, bucket_size=bucket_size, align=1)
    k = items[0].numel
    for b, shares in zip(plan.buckets, _segment_numels(plan)):
        assert len(b.params) == bucket_size // k
        cap = sum(p.numel for p in b.params) / dp * dp**alpha
        assert max(shares) <= cap + 1e-6
    if alpha == 0.0:
        # equal segments: each rank gets exactly its even share, so communication is balanced
        for b in plan.buckets:
            assert len(set(b.segment_lengths())) == 1
        assert plan.metrics.comm_ratio == pytest.approx(1.0)


@pytest.mark.parametrize("policy", sorted(DP_POLICIES))
def test_single_rank_owns_everything(policy):
    items = [DPItem(f"p{i}", n, c, 1) for i, (n, c) in enumerate([(10, 1.0), (7, 2.0), (64, 0.5)])]
    plan = plan_dp(items, 1, policy, bucket_size=64, align=8)
    assert all(p.owner == 0 for p in plan.placements())
    assert plan.metrics.makespan == pytest.approx(3.5)
    assert plan.metrics.atomic
    assert [len(b.params) for b in plan.buckets] == [1, 2]  # backward: p2 alone, then p1, p0


@pytest.mark.parametrize("policy", sorted(DP_POLICIES))
def test_determinism_on_ties(policy):
    items = [DPItem(f"p{i}", 100, 1.0, 8) for i in range(13)]
    a = plan_dp(items, 4, policy, alpha=0.5, bucket_size=400, align=8)
    b = plan_dp(list(items), 4, policy, alpha=0.5, bucket_size=400, align=8)
    assert a == b


def test_bad_inputs_raise():
    items = [DPItem("a", 100, 1.0, 1), DPItem("b", 50, 1.0, 1)]
    with pytest.raises(SpecError):
        plan_dp(items, 2, "no-such-policy")
    with pytest.raises(SpecError):
        plan_dp(items, 0, "whole-start")
    with pytest.raises(SpecError):
        plan_dp(items, 2, "alpha-balanced", alpha=1.5)
    with pytest.raises(SpecError):
        plan_dp(items, 2, "alpha-balanced-reorder", alpha=-0.1)
    with pytest.raises(SpecError):
        plan_dp(items, 2, "whole-start", bucket_size=99)  # smaller than the largest parameter
    with pytest.raises(SpecError):
        plan_dp(items, 2, "whole-start", align=0)


def test_an_exact_resplit_enumerates_each_union_once(monkeypatch):
    """`reorder._best_split` (alpha-balanced's exact re-split, up to 4**10 rows) is the enumeration's
    optimum, and a union met again (round after round, plan after plan: 31 distinct ones in a
    search's 2,341 calls) is not enumerated again: its answer, bit for bit, is remembered."""
    import itertools

    import numpy as np

    from canzona.dp import reorder

    costs = np.array([2.0, 5.0, 5.0, 6.0, 6.0, 11.0, 0.75])
    enumerated = []
    labels = reorder._labels
    monkeypatch.setattr(reorder, "_labels", lambda ways, n: enumerated.append((ways, n)) or labels(ways, n))
    reorder._best_split_of.cache_clear()
    peak, owners = reorder._best_split(costs, 3)
    brute = min(max(sum(c for c, o in zip(costs, split) if o == q) for q in range(3))
                for split in itertools.product(range(3), repeat=costs.size))
    assert peak == brute and max(costs[owners == q].sum() for q in range(3)) == peak
    again = reorder._best_split(costs[np.arange(costs.size)], 3)  # another array of the same costs
    assert enumerated == [(3, costs.size)] and again[0] == peak and np.array_equal(again[1], owners)
    assert not owners.flags.writeable  # shared between the callers: nobody writes into it
