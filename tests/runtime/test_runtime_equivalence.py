"""Rung 3 of the verification ladder (docs/architecture.md §5): the DP runtime on gloo equals the same
kernels run in one process, bit for bit in fp32, when given the same global gradients; and it
stays within 1e-5 relative of the reference optimizers over a multi-step run of the tiny model.

Every DP size runs all of its configurations in ONE spawned process group (`many_specs_worker`):
spawning costs seconds, a tiny training run a fraction of one. The spawned runs are cached per DP
size, and the single-process comparators per (optimizer, DP size, accumulation), because neither
depends on the step policy or the bucket layout.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from canzona.harness.launch import run_ranks
from canzona.harness.training import (
    TrainSpec,
    build_model,
    compare,
    emulate,
    many_specs_worker,
    reference_run,
)
from canzona.plan import Plan, make_plan, tp_tasks, validate_plan
from canzona.spec import ModelSpec
from canzona.tp import plan_tp

pytestmark = pytest.mark.distributed  # spawns gloo process groups

DEADLINE_S = 120.0  # per spawned group: a hang fails the test instead of the suite
COLLECTIVE_TIMEOUT_S = 60.0
DPS = (1, 2, 3, 4)
OPTIMIZERS = ("muon", "soap", "shampoo")
# (step policy, DP policy): the DP policy only matters for canzona; the baselines pick their own.
VARIANTS = (
    ("canzona", "whole-start"),
    ("canzona", "alpha-balanced"),
    ("canzona", "alpha-balanced-reorder"),
    ("zero1-gather", None),
    ("layerwise", None),
    ("sc", None),
)
# AdamW on every parameter (the baseline: Megatron's distributed optimizer), its one policy
ELEMENTWISE = ("adamw", "zero1")
CASES = [(o, p, d) for o in OPTIMIZERS for p, d in VARIANTS] + [(*ELEMENTWISE, None)]

# fp32 Newton-Schulz; SOAP / Shampoo refresh their preconditioners every 2 steps, so a 4-step run
# initialises, updates, refreshes and updates with the refreshed bases.
MATRIX_CONFIG = {
    "muon": {"ns_dtype": "fp32"},
    "soap": {"precondition_frequency": 2},
    "shampoo": {"precondition_frequency": 2},
}
STEPS = 4
GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4
ACC_BATCH = 24  # divisible by dp x 2 for every dp
BUCKET = 16384  # five buckets on the tiny model: several reduce-scatters launched from hooks
REL_TOL = 1e-5

ACCUMULATION_DPS = (2, 3)
IDLE_OWNER_DPS = (2, 4)


ONE_MATRIX_BUCKET_OPTIMIZERS = ("muon",)  # whole-start at dp 4 with one matrix per bucket: rank 1 idle


def idle_plan_optimizers(dp: int) -> tuple[str, ...]:
    return OPTIMIZERS if dp == 4 else ("muon",)


def spec_for(optimizer: str, policy: str | None = None, dp_policy: str | None = None, *,
             accumulation: int = 1, bucket_size: int | None = BUCKET) -> TrainSpec:
    return TrainSpec(
        optimizer=optimizer,
        policy=policy,
        dp_policy=dp_policy or "alpha-balanced",
        steps=STEPS,
        global_batch=ACC_BATCH if accumulation > 1 else GLOBAL_BATCH,
        seq_len=16,
        accumulation=accumulation,
        bucket_size=bucket_size,
        matrix_config=dict(MATRIX_CONFIG.get(optimizer, {})),
    )


def tiny_model_spec() -> ModelSpec:
    return build_model(TrainSpec()).spec()


def plan_with_idle_rank(model: ModelSpec, dp: int, optimizer: str, idle: int) -> Plan:
    """A hand-built plan that keeps the buffer geometry (each rank's share of a bucket is one
    contiguous segment, in rank order) but gives rank `idle` nothing: an empty segment and no
    matrix to compute."""
    base = make_plan(model, dp, 1, optimizer, "whole-start")
    active = [r for r in range(dp) if r != idle]
    buckets = []
    for b in base.dp_plan.buckets:
        n, k = len(b.params), len(active)
        owners = [r for i, r in enumerate(active) for _ in range((i + 1) * n // k - i * n // k)]
        params = tuple(replace(p, owner=o) for p, o in zip(b.params, owners))
        cuts = [0] * (dp + 1)
        cuts[dp] = b.size
        for r in range(dp - 1, 0, -1):
            mine = [p for p in params if p.owner == r]
            cuts[r] = mine[0].offset if mine else cuts[r + 1]
        buckets.append(replace(b, params=params, cuts=tuple(cuts)))
    dpp = replace(base.dp_plan, buckets=tuple(buckets))
    tpp = plan_tp(tp_tasks(model, dpp, optimizer), 1, "greedy-rollback")
    plan = Plan(base.model, base.fingerprint, dp, 1, optimizer, base.cost_model, dpp, tpp)
    validate_plan(plan, model)
    return plan


def one_matrix_bucket_plan(optimizer: str) -> Plan:
    return make_plan(tiny_model_spec(), 4, 1, optimizer, "whole-start", bucket_size=8192)


def owners_of(plan: Plan) -> list[list[str]]:
    """Per rank, the matrices the plan gives it to compute."""
    per_rank: list[list[str]] = [[] for _ in range(plan.dp)]
    for b in plan.dp_plan.buckets:
        for p in b.params:
            for r in plan.dp_plan.computing_ranks(b, p):
                per_rank[r].append(p.name)
    return per_rank


def jobs_for(dp: int) -> list[tuple[tuple, TrainSpec, dict]]:
    """(label, spec, extra) of every distributed run at this DP size."""
    jobs = [(("variant", opt, policy, dp_policy), spec_for(opt, policy, dp_policy), {})
            for opt, policy, dp_policy in CASES]
    if dp in ACCUMULATION_DPS:
        for opt, (policy, dp_policy) in zip(OPTIMIZERS, VARIANTS[1:4]):
            jobs.append((("accumulation", opt), spec_for(opt, policy, dp_policy, accumulation=2), {}))
    if dp in IDLE_OWNER_DPS:
        model = tiny_model_spec()
        for opt in idle_plan_optimizers(dp):
            plan = plan_with_idle_rank(model, dp, opt, idle=dp - 2)  # a middle rank when dp > 2
            jobs.append((("idle-plan", opt), spec_for(opt, "canzona", "whole-start", bucket_size=None),
                         {"plan": plan}))
    if dp == 4:
        for opt in ONE_MATRIX_BUCKET_OPTIMIZERS:
            # the whole-start plan itself: canzona's geometry would keep even segments for it (as many
            # matrices on the fullest rank, and even reduce-scatters)
            jobs.append((("one-matrix-buckets", opt), spec_for(opt, "canzona", "whole-start", bucket_size=8192),
                         {"plan": one_matrix_bucket_plan(opt)}))
            # the plan canzona makes itself there: ZeRO-1's even segments (geometry "auto")
            jobs.append((("even-geometry", opt), spec_for(opt, "canzona", "whole-start", bucket_size=8192), {}))
    for _, _, extra in jobs:
        extra["state_dict"] = False
    # the AdamW pieces' state, stitched by state_dict() (a collective after the steps)
    jobs.append((("adamw-state",), spec_for(*ELEMENTWISE), {"state_dict": True}))
    return jobs


@functools.cache
def _distributed(dp: int) -> dict:
    """Run every job of this DP size in one spawned group; cache the outcome (errors included, so a
    broken runtime fails each test once, quickly, instead of respawning)."""
    jobs = jobs_for(dp)
    try:
        results = run_ranks(many_specs_worker, dp, [s for _, s, _ in jobs], [e for _, _, e in jobs],
                            deadline_s=DEADLINE_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - replayed by every test that needs it
        return {"error": e}
    return {label: [results[r][i] for r in range(dp)] for i, (label, _, _) in enumerate(jobs)}


def distributed(dp: int, label: tuple) -> list[dict]:
    runs = _distributed(dp)
    if "error" in runs:
        err = runs["error"]
        pytest.fail(f"the spawned dp={dp} group failed: {err}\n{getattr(err, 'trace', '')}")
    return runs[label]


@functools.cache
def emulated(optimizer: str, dp: int, accumulation: int = 1) -> dict[str, torch.Tensor]:
    return emulate(spec_for(optimizer, accumulation=accumulation), dp)


@functools.cache
def referenced(optimizer: str, dp: int) -> dict[str, torch.Tensor]:
    return reference_run(spec_for(optimizer), dp)


def assert_bit_identical(ranks: list[dict], want: dict[str, torch.Tensor]) -> None:
    assert set(ranks[0]["params"]) == set(want)
    for r, res in enumerate(ranks):
        cmp = compare(res["params"], want)
        assert cmp["bit_identical"], f"rank {r} differs from the single-process run: {cmp}"


def assert_ranks_agree(ranks: list[dict]) -> None:
    first = ranks[0]["params"]
    for r, res in enumerate(ranks[1:], start=1):
        for name, t in first.items():
            assert torch.equal(res["params"][name], t), f"rank {r} ends with a different {name}"


# --- the full matrix: DP 1-4 x optimizers x step policies ------------------------------------


@pytest.mark.parametrize("optimizer,policy,dp_policy", CASES, ids=[f"{o}-{p}-{d}" if d else f"{o}-{p}" for o, p, d in CASES])
@pytest.mark.parametrize("dp", DPS)
def test_distributed_equals_single_process_bit_for_bit(dp, optimizer, policy, dp_policy):
    ranks = distributed(dp, ("variant", optimizer, policy, dp_policy))
    assert len(ranks) == dp
    assert_ranks_agree(ranks)
    want = emulated(optimizer, dp)
    assert_bit_identical(ranks, want)
    # the run trained: every parameter moved away from its initial value
    init = dict(build_model(TrainSpec()).named_parameters())
    moved = [n for n, t in ranks[0]["params"].items() if not torch.equal(t, init[n].detach())]
    assert len(moved) == len(init)


@pytest.mark.parametrize("optimizer", (*OPTIMIZERS, ELEMENTWISE[0]))
@pytest.mark.parametrize("dp", DPS)
def test_distributed_within_tolerance_of_reference_optimizers(dp, optimizer):
    ref = referenced(optimizer, dp)
    for _, policy, dp_policy in [c for c in CASES if c[0] == optimizer]:
        ranks = distributed(dp, ("variant", optimizer, policy, dp_policy))
        cmp = compare(ranks[0]["params"], ref)
        assert cmp["max_rel_diff"] <= REL_TOL, (policy, dp_policy, cmp)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("dp", DPS)
def test_each_rank_computes_what_the_plan_gives_it(dp, optimizer):
    """Owners compute (canzona, layerwise: each matrix exactly once in the group); sc computes
    everything everywhere; zero1-gather computes every matrix its even segment touches."""
    model = tiny_model_spec()
    matrices = sorted(p.name for p in model.matrix_params())
    for policy, dp_policy in VARIANTS:
        ranks = distributed(dp, ("variant", optimizer, policy, dp_policy))
        owned = [sorted(r["owned"]) for r in ranks]
        if policy == "sc":
            assert owned == [matrices] * dp
            continue
        plan_policy = {"zero1-gather": "zero1-even", "layerwise": "layerwise"}.get(policy, dp_policy)
        # the runtime plans at the configuration it runs (its matrix_config's seconds and state)
        plan = make_plan(model, dp, 1, optimizer, plan_policy, bucket_size=BUCKET,
                         matrix_config=MATRIX_CONFIG.get(optimizer))
        assert owned == [sorted(names) for names in owners_of(plan)], (policy, dp_policy)
        if policy != "zero1-gather":
            assert sorted(n for names in owned for n in names) == matrices, (policy, dp_policy)


@pytest.mark.parametrize("dp", DPS)
def test_adamw_ranks_update_the_pieces_their_even_segments_hold(dp):
    """AdamW on every parameter (zero1): no rank computes a matrix whole; each keeps AdamW state for
    exactly the elements of its even segments, split matrices included, and the layout-independent
    state dict stitches the pieces back into full tensors equal on every rank."""
    ranks = distributed(dp, ("adamw-state",))
    assert_bit_identical(ranks, emulated(ELEMENTWISE[0], dp))
    model = tiny_model_spec()
    plan = ranks[0]["plan"]
    assert plan.dp_plan.policy == "zero1-even" and plan.optimizer == "adamw"
    assert all(r["owned"] == [] and r["hosted"] == [] for r in ranks)
    if dp > 1:  # the layout splits matrices between ranks, which then update one piece each
        assert any(len(b.ranks_overlapping(p)) > 1 for b in plan.dp_plan.buckets for p in b.params)
    from canzona.runtime.checkpoint import state_by_name

    state = state_by_name(ranks[0]["state"])[2]
    for r in ranks[1:]:
        other = state_by_name(r["state"])[2]
        assert all(torch.equal(other[n]["exp_avg"], s["exp_avg"]) for n, s in state.items())
    for p in model.params:
        assert state[p.name]["exp_avg"].shape == p.shape and state[p.name]["step"] == STEPS
        assert bool(state[p.name]["exp_avg_sq"].gt(0).all())  # every element stepped, on some rank


# --- gradient accumulation -------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("dp", ACCUMULATION_DPS)
def test_gradient_accumulation_equals_single_process_bit_for_bit(dp, optimizer):
    ranks = distributed(dp, ("accumulation", optimizer))
    assert_ranks_agree(ranks)
    assert_bit_identical(ranks, emulated(optimizer, dp, accumulation=2))
    if optimizer == "muon":
        # accumulating averages the same global batch: only the rounding of the mean gradient
        # changes (SOAP / Shampoo eigenbases of near-degenerate statistics amplify that round-off
        # far beyond 1e-5 in a few steps, so the check is Muon's)
        cmp = compare(ranks[0]["params"], emulate(replace(spec_for(optimizer), global_batch=ACC_BATCH), dp))
        assert cmp["max_rel_diff"] <= REL_TOL, cmp


# --- layouts where a rank owns nothing ------------------------------------------------------


@pytest.mark.parametrize("dp,optimizer", [(d, o) for d in IDLE_OWNER_DPS for o in idle_plan_optimizers(d)])
def test_hand_built_plan_with_an_idle_rank_finishes_bit_identical(dp, optimizer):
    idle = dp - 2
    plan = plan_with_idle_rank(tiny_model_spec(), dp, optimizer, idle)
    assert owners_of(plan)[idle] == []
    assert all(b.cuts[idle] == b.cuts[idle + 1] for b in plan.dp_plan.buckets)  # empty segment
    ranks = distributed(dp, ("idle-plan", optimizer))
    assert ranks[idle]["owned"] == []
    assert all(ranks[r]["owned"] for r in range(dp) if r != idle)
    assert_ranks_agree(ranks)
    assert_bit_identical(ranks, emulated(optimizer, dp))


@pytest.mark.parametrize("optimizer", ONE_MATRIX_BUCKET_OPTIMIZERS)
def test_one_matrix_buckets_leave_a_rank_idle_and_still_match(optimizer):
    """whole-start with one matrix per bucket puts every matrix on the rank whose even segment
    holds its first element: rank 1 of 4 owns nothing in any bucket."""
    plan = one_matrix_bucket_plan(optimizer)
    idle = [r for r, names in enumerate(owners_of(plan)) if not names]
    assert idle, "the layout was meant to leave a rank without matrices"
    ranks = distributed(4, ("one-matrix-buckets", optimizer))
    for r in idle:
        assert ranks[r]["owned"] == []
    assert_ranks_agree(ranks)
    assert_bit_identical(ranks, emulated(optimizer, 4))


@pytest.mark.parametrize("optimizer", ONE_MATRIX_BUCKET_OPTIMIZERS)
def test_canzona_runs_the_even_segments_its_planner_keeps(optimizer):
    """On the same layout canzona's planner keeps ZeRO-1's even segments (whole matrices plan no
    shorter step, canzona.plan.GEOMETRIES): each rank computes every matrix its segment touches,
    after fetching the other parts, and the run still equals one process bit for bit."""
    ranks = distributed(4, ("even-geometry", optimizer))
    plan = ranks[0]["plan"]
    assert plan.dp_plan.policy == "zero1-even" and plan.tp_plan.policy == "greedy-rollback"
    assert any(len(b.ranks_overlapping(p)) > 1 for b in plan.dp_plan.buckets for p in b.params)
    assert [sorted(r["owned"]) for r in ranks] == [sorted(names) for names in owners_of(plan)]
    assert_ranks_agree(ranks)
    assert_bit_identical(ranks, emulated(optimizer, 4))


def test_dp2_logs_are_the_step_collectives():
    """The DP 2 group's collective logs, step by step on both ranks, are `step_collectives(...)`,
    and the simulator issues them on the same plan (tests/policy/test_step_collectives.py's check,
    run here on this file's cached DP 2 group: from that file, a worker without it spawned it again)."""
    from tests.policy.test_step_collectives import check_dp2_logs_are_the_step_collectives

    check_dp2_logs_are_the_step_collectives()
