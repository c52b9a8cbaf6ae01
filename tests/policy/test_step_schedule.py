"""The step schedule (canzona/step_schedule.py, docs/design.md §6.3): the TP phase of the optimizer
step as ordered operations with exact byte counts, shared by the simulator and the runtime.
Properties on random models and plans, known answers, and the simulator executing it."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canzona.catalog import get_model
from canzona.errors import SpecError
from canzona.plan import make_plan
from canzona.step_policies import STEP_POLICIES
from canzona.step_schedule import (
    ALL_GATHER,
    ALL_TO_ALL,
    APPLY,
    COMPUTE,
    GATHER,
    PIPELINED,
    SCATTER,
    SERIAL,
    tp_schedule,
)
from canzona.tp import EVERY_RANK, TP_POLICIES, Capacity
from sim.simulate import SimConfig, simulate
from sim.workload import Workload
from tests.policy.strategies import models

CANZONA = STEP_POLICIES["canzona"]


def plan_and_schedules(model, dp, tp, tp_policy, mode, policy=CANZONA, capacity=None, grad_bytes=4, update_bytes=4):
    plan = make_plan(model, dp, tp, "muon", policy.dp_policy or "alpha-balanced", policy.tp_policy or tp_policy,
                     align=8, capacity=capacity)
    return plan, [tp_schedule(plan, model, policy, i, mode, grad_bytes, update_bytes) for i in range(dp)]


def position(ops, kind, g):
    return ops.index(next(op for op in ops if op.kind == kind and op.group == g))


@settings(max_examples=60, deadline=None)
@given(models(), st.integers(1, 4), st.sampled_from(list(TP_POLICIES)), st.sampled_from([PIPELINED, SERIAL]),
       st.sampled_from([2, 4]), st.sampled_from([2, 4]))
def test_schedule_properties_on_random_models(model_tp, dp, tp_policy, mode, grad_bytes, update_bytes):
    model, tp = model_tp
    plan, schedules = plan_and_schedules(model, dp, tp, tp_policy, mode, grad_bytes=grad_bytes,
                                         update_bytes=update_bytes)
    for i, sched in enumerate(schedules):
        # the schedule runs exactly the plan's micro-groups of this DP rank
        assert [g.tasks for g in plan.tp_plan.groups[i]] == [tuple(t.name for t in g.tasks) for g in sched.groups]
        for group, planned in zip(sched.groups, plan.tp_plan.groups[i]):
            assert group.loads == tuple(planned.host_loads(tp))
            for t in group.tasks:
                assert t.shard_numel * (tp if t.tp_dim is not None else 1) == model.param(t.name).numel
        # every group is computed once and applied once, after its compute; each collective is
        # issued once, a gather before its compute and a scatter after it and before its apply
        for g, group in enumerate(sched.groups):
            kinds = [op.kind for op in sched.ops if op.group == g]
            assert kinds.count(COMPUTE) == kinds.count(APPLY) == 1
            assert position(sched.ops, COMPUTE, g) < position(sched.ops, APPLY, g)
            assert kinds.count(GATHER) == (group.gather is not None)
            assert kinds.count(SCATTER) == (group.scatter is not None)
            if group.gather is not None:
                assert position(sched.ops, GATHER, g) < position(sched.ops, COMPUTE, g)
            if group.scatter is not None:
                assert position(sched.ops, COMPUTE, g) < position(sched.ops, SCATTER, g) < position(sched.ops, APPLY, g)
        if tp == 1:
            assert sched.exchanges == ()
        # prefetched: the gathers ahead of the first compute (canzona, which reads its gradients
        # straight from the reduce-scatters), issued before the step check; AdamW runs before the
        # last op, an apply
        lead = sched.ops[:next((k for k, op in enumerate(sched.ops) if op.kind != GATHER), len(sched.ops))]
        assert sched.prefetched == lead and all(op.kind == GATHER for op in lead)
        assert len(lead) <= (2 if mode == PIPELINED else 1) and (tp > 1 or lead == ())
        if sched.ops:
            assert sched.elementwise_at == len(sched.ops) - 1 and sched.ops[-1].kind == APPLY
        else:  # a DP rank that computes nothing: AdamW alone
            assert sched.elementwise_at == 0
        # byte counts follow from the shards: hosts receive every other rank's shard, and send
        # back a chunk (nothing else: its scalars the receivers compute) to every other rank
        for group in sched.groups:
            if group.gather is None:
                continue
            for s in range(tp):
                assert group.gather.sent[s][s] == 0
            if group.gather.op == ALL_GATHER:
                assert all(t.host == EVERY_RANK for t in group.tasks) and group.scatter is None
                shards = sum(t.shard_numel for t in group.tasks if t.tp_dim is not None) * grad_bytes
                assert all(group.gather.sent[s][d] == shards for s in range(tp) for d in range(tp) if s != d)
            else:
                for d in range(tp):
                    hosted = [t for t in group.tasks if t.host == d and t.tp_dim is not None]
                    assert group.gather.bytes_in(d) == (tp - 1) * sum(t.shard_numel for t in hosted) * grad_bytes
                for s in range(tp):
                    mine = [t for t in group.tasks if t.host == s]
                    per_peer = sum(t.shard_numel * update_bytes for t in mine)
                    assert group.scatter.bytes_out(s) == (tp - 1) * per_peer


def test_pipelined_order_overlaps_each_collective_with_a_compute():
    model = get_model("qwen3-0.6b", 4)
    plan, (sched,) = plan_and_schedules(model, 1, 4, "tp-chunk", PIPELINED)
    g = len(sched.groups)
    assert g > 3
    ops = [(op.kind, op.group) for op in sched.ops]
    # gather 0, then per group: gather g+1, compute g, scatter g, apply g-1; apply of the last
    want = [(GATHER, 0)]
    for k in range(g):
        want += [(GATHER, k + 1)] if k + 1 < g else []
        want += [(COMPUTE, k), (SCATTER, k)]
        want += [(APPLY, k - 1)] if k > 0 else []
    want.append((APPLY, g - 1))
    assert ops == want
    # canzona prefetches the gathers of groups 0 and 1 (ahead of the first compute); AdamW runs
    # before the last apply, under the last scatter; the baselines, and an overlapped step, prefetch none
    assert [(op.kind, op.group) for op in sched.prefetched] == [(GATHER, 0), (GATHER, 1)]
    assert sched.elementwise_at == len(ops) - 1
    assert not tp_schedule(plan, model, CANZONA, 0, PIPELINED, overlap_step=True).prefetched
    _, (sync,) = plan_and_schedules(model, 1, 4, "tp-sync", PIPELINED, policy=STEP_POLICIES["zero1-gather"])
    assert sync.ops[0].kind == GATHER and sync.prefetched == ()
    _, (serial,) = plan_and_schedules(model, 1, 4, "tp-chunk", SERIAL)
    assert [(op.kind, op.group) for op in serial.ops] == [
        (kind, k) for k in range(g) for kind in (GATHER, COMPUTE, SCATTER, APPLY)]
    assert serial.exchanges != sched.exchanges and sorted(serial.exchanges, key=lambda e: e.name) == \
        sorted(sched.exchanges, key=lambda e: e.name)  # the same collectives, issued in another order


def test_known_bytes_of_a_two_task_group():
    """q (2048 x 1024) on host 0 and k (1024 x 1024) on host 1, both column-parallel, TP 2."""
    model = get_model("qwen3-0.6b", 2)
    plan, (sched,) = plan_and_schedules(model, 1, 2, "tp-chunk", SERIAL)
    group = next(g for g in sched.groups if {t.name for t in g.tasks} == {
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"})
    q, k = group.tasks
    assert (q.host, k.host) == (0, 1) and q.shard_shape == (1024, 1024) and k.shard_shape == (512, 1024)
    assert group.gather.sent == ((0, 512 * 1024 * 4), (1024 * 1024 * 4, 0))
    assert group.scatter.sent == ((0, 1024 * 1024 * 4), (512 * 1024 * 4, 0))  # the chunks alone
    assert group.gather.op == group.scatter.op == ALL_TO_ALL
    assert group.index == 0  # tp-chunk: the first tp tasks in forward order
    # what TP rank 0 logs (canzona.step_collectives): the bytes it sends to each member
    assert [(ex.op, ex.name, ex.record(0)) for ex in sched.exchanges[:2]] == [
        (ALL_TO_ALL, "group 0 gather", (0, 512 * 1024 * 4)), (ALL_TO_ALL, "group 0 scatter", (0, 1024 * 1024 * 4))]


def test_baselines_run_one_tp_sync_group():
    model = get_model("qwen3-0.6b", 2)
    for name in ("zero1-gather", "layerwise"):
        policy = STEP_POLICIES[name]
        plan, schedules = plan_and_schedules(model, 4, 2, "greedy-rollback", PIPELINED, policy=policy)
        for sched in schedules:
            assert len(sched.groups) <= 1
            for group in sched.groups:
                assert group.gather.op == ALL_GATHER and group.scatter is None
                assert all(t.host == EVERY_RANK for t in group.tasks)
    # sc: every DP rank computes every matrix
    sc = STEP_POLICIES["sc"]
    plan, schedules = plan_and_schedules(model, 4, 2, "greedy-rollback", PIPELINED, policy=sc)
    for sched in schedules:
        (group,) = sched.groups
        assert {t.name for t in group.tasks} == {p.name for p in model.matrix_params()}
        assert sched.state_bytes(0) == sched.state_bytes(1) == sum(p.state_bytes for p in plan.dp_plan.placements())


def test_capacity_extremes():
    model = get_model("qwen3-0.6b", 2)
    names = {p.name for p in model.matrix_params()}
    # a capacity below every task: each task forms its own group
    _, (alone,) = plan_and_schedules(model, 1, 2, "greedy-rollback", PIPELINED, capacity=Capacity(1e-12))
    assert len(alone.groups) == len(names) and all(len(g.tasks) == 1 for g in alone.groups)
    # a capacity above everything: one group holding every shape and both split dimensions
    _, (one,) = plan_and_schedules(model, 1, 2, "greedy-rollback", PIPELINED, capacity=Capacity(1e9))
    (group,) = one.groups
    assert {t.name for t in group.tasks} == names
    assert len({t.shape for t in group.tasks}) == 5 and {t.tp_dim for t in group.tasks} == {0, 1}
    assert one.state_bytes(0) + one.state_bytes(1) == sum(t.state_bytes for t in group.tasks)


def test_bad_arguments():
    model = get_model("qwen3-0.6b", 2)
    plan = make_plan(model, 2, 2)
    with pytest.raises(SpecError, match="unknown TP mode"):
        tp_schedule(plan, model, CANZONA, 0, "eager")
    with pytest.raises(SpecError, match="dp rank 2 is outside"):
        tp_schedule(plan, model, CANZONA, 2)


# --- the simulator executes the schedule ------------------------------------------------------


SIM = SimConfig(model="qwen3-0.6b", gpus=8, tp=4, workload=Workload(seq_len=512, global_batch=8))


@pytest.mark.parametrize("mode", [PIPELINED, SERIAL])
@pytest.mark.parametrize("tp_policy", sorted(TP_POLICIES))
def test_simulator_issues_the_schedules_collectives(mode, tp_policy):
    cfg = replace(SIM, tp_policy=tp_policy, tp_mode=mode)
    r = simulate(cfg)
    for i in range(cfg.gpus // cfg.tp):
        sched = tp_schedule(r.plan, get_model(cfg.model, cfg.tp), CANZONA, i, mode)
        for t in range(cfg.tp):
            rank = i * cfg.tp + t
            spans = sorted((s for s in r.spans if s.rank == rank and s.stream == "tp-comm"
                            and re.fullmatch(r"group \d+ \w+(-\w+)?", s.name)), key=lambda s: s.start)
            assert [s.name for s in spans] == [ex.name for ex in sched.exchanges]


def test_pipelining_is_never_slower_in_the_simulator():
    cfg = replace(SIM, tp_policy="tp-chunk")
    pipelined, serial = simulate(cfg), simulate(replace(cfg, tp_mode=SERIAL))
    assert pipelined.optimizer_step_s < serial.optimizer_step_s
    assert simulate(cfg).optimizer_step_s == pipelined.optimizer_step_s  # deterministic
