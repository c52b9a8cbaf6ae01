"""TP micro-group scheduling (docs/design.md §6): properties on random inputs and known answers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canzona.errors import SpecError
from canzona.scheduling import bin_loads, lpt_assign
from canzona.tp import (
    CAPACITY_STEPS,
    EVERY_RANK,
    TP_POLICIES,
    Capacity,
    MicroGroup,
    TPTask,
    plan_tp,
)
from tests.policy.strategies import close, tp_tasks_by_rank

SETTINGS = settings(max_examples=150, deadline=None)


@st.composite
def tp_cases(draw):
    tasks = draw(tp_tasks_by_rank())
    tp = draw(st.integers(1, 8))
    unit = draw(st.sampled_from(["s", "bytes"]))
    if unit == "s":
        value = draw(st.floats(min_value=0.5, max_value=3000.0))
    else:
        value = float(draw(st.integers(1, 30_000)))
    return tasks, tp, Capacity(value, unit)


def _measure(task: TPTask, cap: Capacity) -> float:
    return task.cost if cap.unit == "s" else float(task.bytes)


def _check_common(plan, tasks_by_rank, tp) -> None:
    assert plan.tp == tp
    assert len(plan.groups) == len(tasks_by_rank)
    for rank_tasks, groups in zip(tasks_by_rank, plan.groups):
        by_name = {t.name: t for t in rank_tasks}
        got = [n for g in groups for n in g.tasks]
        assert sorted(got) == sorted(by_name), "each task exactly once per DP rank"
        for g in groups:
            assert g.tasks, "no empty micro-groups"
            assert len(g.tasks) == len(g.hosts) == len(g.costs)
            assert list(g.costs) == [by_name[n].cost for n in g.tasks]
            for h in g.hosts:
                assert 0 <= h < tp or (h == EVERY_RANK and plan.policy == "tp-sync")
            eff = g.efficiency(tp)
            assert 0 < eff <= 1 + 1e-12
            loads = g.host_loads(tp)
            assert close(g.makespan(tp), max(loads))
    m = plan.metrics
    assert m.groups == sum(len(r) for r in plan.groups)
    assert 0 < m.efficiency <= 1 + 1e-12
    spans = [sum(g.makespan(tp) for g in rank) for rank in plan.groups]
    for a, e in zip(m.rank_seconds, spans):
        assert close(a, e)
    assert close(m.makespan, max(spans, default=0.0))


@pytest.mark.parametrize("policy", sorted(TP_POLICIES))
@SETTINGS
@given(case=tp_cases())
def test_tp_policy_invariants(policy, case):
    tasks_by_rank, tp, cap = case
    plan = plan_tp(tasks_by_rank, tp, policy, cap)
    assert plan.policy == policy
    _check_common(plan, tasks_by_rank, tp)
    assert plan_tp(tasks_by_rank, tp, policy, cap) == plan  # deterministic


@SETTINGS
@given(case=tp_cases())
def test_greedy_rollback_properties(case):
    tasks_by_rank, tp, cap = case
    plan = plan_tp(tasks_by_rank, tp, "greedy-rollback", cap)
    assert plan.capacity == cap
    for rank_tasks, groups in zip(tasks_by_rank, plan.groups):
        by_name = {t.name: t for t in rank_tasks}
        index = {t.name: i for i, t in enumerate(rank_tasks)}
        firsts = []
        for g in groups:
            sizes = [_measure(by_name[n], cap) for n in g.tasks]
            # tasks inside a group come in non-increasing size
            assert all(a >= b for a, b in zip(sizes, sizes[1:]))
            # host assignment = LPT of the group's tasks in that order
            assert list(g.hosts) == lpt_assign(sizes, tp)
            span = max(bin_loads(sizes, g.hosts, tp))
            if len(g.tasks) > 1:
                assert span <= cap.value * (1 + 1e-12)
            if any(s > cap.value for s in sizes):
                assert len(g.tasks) == 1, "a task larger than the capacity must be alone"
            firsts.append(sizes[0])
        assert all(a >= b for a, b in zip(firsts, firsts[1:])), "groups in non-increasing size order"
        # concatenated, the groups are the tasks sorted by size descending
        flat = [n for g in groups for n in g.tasks]
        sizes = [_measure(by_name[n], cap) for n in flat]
        assert all(a >= b for a, b in zip(sizes, sizes[1:]))
        if cap.unit == "s":  # ties by index
            assert [index[n] for n in flat] == sorted(
                range(len(rank_tasks)), key=lambda i: (-rank_tasks[i].cost, i))
        # rollback happens only when needed: the next group's first task would not have fit
        for g, nxt in zip(groups, groups[1:]):
            sizes = [_measure(by_name[n], cap) for n in g.tasks]
            more = sizes + [_measure(by_name[nxt.tasks[0]], cap)]
            peak = max(bin_loads(more, lpt_assign(more, tp), tp))
            assert peak > cap.value


@SETTINGS
@given(tasks_by_rank=tp_tasks_by_rank(), tp=st.integers(1, 8))
def test_tp_chunk_groups(tasks_by_rank, tp):
    plan = plan_tp(tasks_by_rank, tp, "tp-chunk")
    assert plan.capacity is None
    for rank_tasks, groups in zip(tasks_by_rank, plan.groups):
        assert len(groups) == -(-len(rank_tasks) // tp)
        for gi, g in enumerate(groups):
            expect = [t.name for t in rank_tasks[gi * tp:(gi + 1) * tp]]
            assert list(g.tasks) == expect
            assert list(g.hosts) == list(range(len(expect)))
            if gi < len(groups) - 1:
                assert len(g.tasks) == tp


@SETTINGS
@given(tasks_by_rank=tp_tasks_by_rank(), tp=st.integers(1, 8))
def test_tp_sync(tasks_by_rank, tp):
    plan = plan_tp(tasks_by_rank, tp, "tp-sync")
    for rank_tasks, groups in zip(tasks_by_rank, plan.groups):
        if not rank_tasks:
            assert groups == ()
            continue
        assert len(groups) == 1
        assert list(groups[0].tasks) == [t.name for t in rank_tasks]
        assert set(groups[0].hosts) == {EVERY_RANK}
        assert close(groups[0].efficiency(tp), 1 / tp)
        assert close(groups[0].makespan(tp), sum(t.cost for t in rank_tasks))
    if any(tasks_by_rank):
        assert close(plan.metrics.efficiency, 1 / tp)


@SETTINGS
@given(tasks_by_rank=tp_tasks_by_rank(), tp=st.integers(1, 8))
def test_greedy_rollback_default_capacity(tasks_by_rank, tp):
    """Without a capacity, the multiple of the largest task's seconds (never below it: no task is
    isolated by size) whose plan finishes soonest, the smallest among equals."""
    plan = plan_tp(tasks_by_rank, tp, "greedy-rollback")
    if not any(tasks_by_rank):  # nothing computed whole (AdamW's plans): no capacity to search
        assert plan.capacity is None and all(groups == () for groups in plan.groups)
        return
    largest = max((t.cost for r in tasks_by_rank for t in r), default=0.0)
    base = largest if largest > 0 else 1.0
    tried = [plan_tp(tasks_by_rank, tp, "greedy-rollback", Capacity(base * k, "s")) for k in CAPACITY_STEPS]
    best = tried[0]
    for p in tried[1:]:  # a later (larger) capacity only when it is really shorter
        if p.metrics.makespan < best.metrics.makespan * (1 - 1e-9):
            best = p
    assert plan.capacity == best.capacity and plan.groups == best.groups
    assert plan.metrics.makespan <= min(p.metrics.makespan for p in tried) * (1 + 1e-9)
    assert plan.capacity.value >= base
    _check_common(plan, tasks_by_rank, tp)
    for groups in plan.groups:
        for g in groups:
            assert g.makespan(tp) <= plan.capacity.value * (1 + 1e-12)


def _tasks(costs, nbytes=None):
    nbytes = nbytes or [1] * len(costs)
    return [TPTask(f"t{i}", float(c), b) for i, (c, b) in enumerate(zip(costs, nbytes))]


def test_known_answer_seconds():
    # Sorted: 5,4,3,3,2,1 on 2 hosts, C = 7 s.
    # {5} -> (5,0); +4 -> (5,4); +3 -> (5,7) peak 7 <= 7; +3 -> (8,7) > 7: roll back, emit.
    # {3} -> (3,0); +2 -> (3,2); +1 -> (3,3).
    plan = plan_tp([_tasks([5, 4, 3, 3, 2, 1])], 2, "greedy-rollback", Capacity(7.0, "s"))
    (groups,) = plan.groups
    assert groups == (
        MicroGroup(("t0", "t1", "t2"), (0, 1, 1), (5.0, 4.0, 3.0)),
        MicroGroup(("t3", "t4", "t5"), (0, 1, 1), (3.0, 2.0, 1.0)),
    )
    m = plan.metrics
    assert m.groups == 2 and m.max_groups_per_rank == 2
    assert m.rank_seconds == (10.0,) and m.makespan == 10.0
    assert m.efficiency == pytest.approx(18 / 20)


def test_known_answer_seconds_shuffled_and_oversized():
    # Same costs in another order plus a 9 s task larger than the capacity: it leads, alone.
    tasks = _tasks([2, 9, 3, 5, 1, 3, 4])
    plan = plan_tp([tasks], 2, "greedy-rollback", Capacity(7.0, "s"))
    (groups,) = plan.groups
    assert [g.tasks for g in groups] == [("t1",), ("t3", "t6", "t2"), ("t5", "t0", "t4")]
    assert [g.hosts for g in groups] == [(0,), (0, 1, 1), (0, 1, 1)]


def test_known_answer_bytes():
    # Capacity 100 bytes on 2 hosts. By bytes: e 150 (over capacity, alone), a 100, b 60, c 50, d 40.
    # {a} -> (100,0); +b -> (100,60); +c -> (100,110) > 100: roll back. {c} -> (50,0); +d -> (50,40).
    tasks = [TPTask("a", 1.0, 100), TPTask("b", 5.0, 60), TPTask("c", 2.0, 50),
             TPTask("d", 3.0, 40), TPTask("e", 1.0, 150)]
    plan = plan_tp([tasks], 2, "greedy-rollback", Capacity(100, "bytes"))
    (groups,) = plan.groups
    assert [g.tasks for g in groups] == [("e",), ("a", "b"), ("c", "d")]
    assert [g.hosts for g in groups] == [(0,), (0, 1), (0, 1)]
    assert [g.costs for g in groups] == [(1.0,), (1.0, 5.0), (2.0, 3.0)]
    # group makespans are in seconds: 1, 5, 3
    assert plan.metrics.rank_seconds == (9.0,)
    assert plan.metrics.efficiency == pytest.approx(12 / 18)


def test_known_answer_per_rank_independent():
    ranks = [_tasks([4, 4, 4, 4]), [], _tasks([1])]
    plan = plan_tp(ranks, 2, "greedy-rollback", Capacity(8.0, "s"))
    assert plan.groups[0] == (MicroGroup(("t0", "t1", "t2", "t3"), (0, 1, 0, 1), (4.0,) * 4),)
    assert plan.groups[1] == ()
    assert plan.groups[2] == (MicroGroup(("t0",), (0,), (1.0,)),)
    assert plan.metrics.rank_seconds == (8.0, 0.0, 1.0)
    assert plan.metrics.makespan == 8.0


def test_tp_chunk_and_sync_known_answer():
    tasks = _tasks([5, 4, 3, 3, 2])
    chunk = plan_tp([tasks], 2, "tp-chunk")
    assert chunk.groups[0] == (
        MicroGroup(("t0", "t1"), (0, 1), (5.0, 4.0)),
        MicroGroup(("t2", "t3"), (0, 1), (3.0, 3.0)),
        MicroGroup(("t4",), (0,), (2.0,)),
    )
    assert chunk.metrics.rank_seconds == (5.0 + 3.0 + 2.0,)
    sync = plan_tp([tasks], 4, "tp-sync")
    assert sync.groups[0][0].hosts == (EVERY_RANK,) * 5
    assert sync.metrics.makespan == 17.0
    assert sync.metrics.efficiency == pytest.approx(0.25)


def test_bad_inputs_raise():
    with pytest.raises(SpecError):
        Capacity(1.0, "flops")
    with pytest.raises(SpecError):
        Capacity(0.0, "s")
    with pytest.raises(SpecError):
        plan_tp([_tasks([1])], 2, "no-such-policy")
    with pytest.raises(SpecError):
        plan_tp([_tasks([1])], 0, "tp-chunk")
