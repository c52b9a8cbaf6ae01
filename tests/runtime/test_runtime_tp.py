"""Rung 3 under tensor parallelism (docs/architecture.md §5): the DP x TP runtime on gloo equals the
same kernels run in one process, bit for bit in fp32, when given the same global gradients (the
gradients each rank's own hooks recorded, reduced over DP in rank order and concatenated over TP),
and stays within 1e-5 relative of the reference optimizers.

Three layouts, each ONE spawned group running every configuration: TP 2 (tiny model), TP 4 (the
tiny-tp4 preset: the tiny one has 2 KV heads) and DP 2 x TP 2 (tiny). Per layout: every optimizer
under canzona with every TP scheduler, pipelined and serial, and the baselines (tp-sync); on top,
micro-groups of one task each (capacity below every task), one group of every shape (capacity
above all), the DTensor model, gradient accumulation, bf16 weights and the overlapped step. Besides the numbers, each
run's TP collectives equal the step schedule (`canzona.step_schedule`) record for record, every
matrix is computed exactly once in the cluster, and each rank's optimizer state is the plan's
prediction to the byte.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from canzona.harness.launch import run_ranks
from canzona.harness.training import (
    TrainSpec,
    compare,
    emulate,
    expected_shards,
    global_gradients_from,
    many_specs_worker,
    reference_run,
)
from canzona.step_collectives import STEP, step_collectives, step_records
from canzona.step_policies import STEP_POLICIES
from canzona.step_schedule import PIPELINED, SERIAL, TP_GROUP, tp_schedule
from canzona.tp import EVERY_RANK, Capacity
from reference.tiny_model import get_preset, model_spec

pytestmark = pytest.mark.distributed  # spawns gloo process groups

DEADLINE_S = 300.0
OPTIMIZERS = ("muon", "soap", "shampoo")
SCHEDULERS = ("tp-sync", "tp-chunk", "greedy-rollback")
MODES = (PIPELINED, SERIAL)
BASELINES = ("sc", "zero1-gather", "layerwise")
# fp32 Newton-Schulz; SOAP / Shampoo refresh every 2 steps: initialise, update, refresh, update
MATRIX_CONFIG = {"muon": {"ns_dtype": "fp32"}, "soap": {"precondition_frequency": 2},
                 "shampoo": {"precondition_frequency": 2}}
STEPS = 4
REL_TOL = 1e-5
LAYOUTS = {"tp2": (1, 2, "tiny"), "tp4": (1, 4, "tiny-tp4"), "dp2xtp2": (2, 2, "tiny")}
SLOW_LAYOUTS = {"tp4"}  # four ranks on one machine: `make test-all` (tp2 and dp2xtp2 check the same)


def slow_case(layout: str, key: tuple) -> bool:
    """Cases left to `make test-all`: every case of a slow layout; under DP x TP, SOAP and Shampoo
    (tp2 runs them through every scheduler and policy; dp2xtp2 runs Muon through every one, and
    SOAP in bf16), which halves the DP x TP spawn of `make test`."""
    return layout in SLOW_LAYOUTS or (layout == "dp2xtp2" and len(key) == 4 and key[1] != "muon")


def _marked(value, layout: str, key: tuple = ()):
    return pytest.param(value, marks=pytest.mark.slow) if slow_case(layout, key) else value


def fast_cases(layout: str) -> dict[tuple, tuple[TrainSpec, dict]]:
    return {k: v for k, v in cases(layout).items() if not slow_case(layout, k)}


def base_spec(layout: str, optimizer: str = "muon") -> TrainSpec:
    dp, tp, preset = LAYOUTS[layout]
    return TrainSpec(preset=preset, optimizer=optimizer, steps=STEPS, global_batch=4 * dp, seq_len=16, tp=tp,
                     matrix_config=dict(MATRIX_CONFIG[optimizer]))


def capacity_plan(layout: str, capacity: Capacity):
    from canzona.plan import make_plan

    dp, tp, preset = LAYOUTS[layout]
    return make_plan(model_spec(get_preset(preset)), dp, tp, "muon", "alpha-balanced", "greedy-rollback",
                     capacity=capacity)


def cases(layout: str) -> dict[tuple, tuple[TrainSpec, dict]]:
    out: dict[tuple, tuple[TrainSpec, dict]] = {}
    for opt in OPTIMIZERS:
        base = base_spec(layout, opt)
        for scheduler in SCHEDULERS:
            for mode in MODES:
                out[("canzona", opt, scheduler, mode)] = (replace(base, tp_policy=scheduler, tp_mode=mode), {})
        for policy in BASELINES:
            out[(policy, opt, "tp-sync", PIPELINED)] = (replace(base, policy=policy), {})
    base = base_spec(layout)
    out[("alone",)] = (base, {"plan": capacity_plan(layout, Capacity(1e-12))})  # every task > capacity
    out[("one group",)] = (base, {"plan": capacity_plan(layout, Capacity(1e9))})  # every shape in one group
    if layout != "tp4":
        dp = LAYOUTS[layout][0]
        out[("dtensor",)] = (replace(base, preset="tiny-untied", tp_style="dtensor"), {})
        out[("accumulation",)] = (replace(base, accumulation=2, global_batch=8 * dp), {})
        out[("bf16",)] = (replace(base, dtype="bf16", optimizer="soap", matrix_config=MATRIX_CONFIG["soap"]), {})
        out[("clip",)] = (replace(base, clip_norm=0.05), {})
        out[("overlap step",)] = (replace(base, overlap_step=True), {})
        if dp > 1:  # canzona's geometry keeps ZeRO-1's even segments there, under its micro-groups
            out[("even geometry",)] = (replace(base, dp_policy="alpha-balanced", bucket_size=8192), {})
        # AdamW on every parameter: each TP rank's pieces of its shards, no TP exchange
        out[("adamw",)] = (replace(base, optimizer="adamw", policy="zero1", matrix_config={}), {})
    return out


@functools.cache
def spawned(layout: str, slow: bool) -> dict:
    """One spawn per layout for its `make test` cases, one for the others (`slow_case`)."""
    dp, tp, _ = LAYOUTS[layout]
    jobs = {k: v for k, v in cases(layout).items() if slow_case(layout, k) == slow}
    try:
        results = run_ranks(many_specs_worker, dp * tp, [s for s, _ in jobs.values()],
                            [{**e, "state_dict": False} for _, e in jobs.values()], deadline_s=DEADLINE_S)
    except Exception as e:  # noqa: BLE001 - replayed by every test that needs it
        return {"error": e}
    return {key: [r[i] for r in results] for i, key in enumerate(jobs)}


@functools.cache
def expected(layout: str, key: tuple) -> tuple[dict, dict | None]:
    spec = cases(layout)[key][0]
    results = runs(layout, key)
    grads = global_gradients_from(results, spec)
    dp = spec.dp_size(len(results))
    # the references keep the model's dtype: a bf16 run has no fp32 reference to stay near
    reference = reference_run(spec, dp, grads=grads) if spec.dtype == "fp32" else None
    return emulate(spec, dp, grads=grads), reference


def runs(layout: str, key: tuple) -> list[dict]:
    got = spawned(layout, slow_case(layout, key))
    if "error" in got:
        err = got["error"]
        pytest.fail(f"the spawned group failed: {err}\n{getattr(err, 'trace', '')}")
    return got[key]


def all_keys() -> list:
    return [_marked((layout, key), layout, key) for layout in LAYOUTS for key in cases(layout)]


def ids(pair: tuple[str, tuple]) -> str:
    return f"{pair[0]}-{'-'.join(pair[1])}"


@pytest.mark.parametrize("layout_key", all_keys(), ids=ids)
def test_rung3_bit_identical_to_the_same_kernels_in_one_process(layout_key):
    layout, key = layout_key
    results = runs(layout, key)
    emulated, reference = expected(layout, key)
    spec = cases(layout)[key][0]
    for r in results:
        mine = expected_shards(emulated, r["tp_dims"], spec.tp, r["tp_rank"])
        c = compare(r["params"], mine)
        if spec.clip_norm is None:
            assert c["bit_identical"], (r["dp_rank"], r["tp_rank"], c)
        else:  # the norm is summed in another order than in one process: the clip factor differs in round-off
            assert c["max_rel_diff"] <= REL_TOL, (r["dp_rank"], r["tp_rank"], c)
        if reference is not None:
            ref = compare(r["params"], expected_shards(reference, r["tp_dims"], spec.tp, r["tp_rank"]))
            assert ref["max_rel_diff"] <= REL_TOL, (r["dp_rank"], r["tp_rank"], ref)
    # DP peers hold the same shards, bit for bit
    first = {r["tp_rank"]: r["params"] for r in results if r["dp_rank"] == 0}
    for r in results:
        assert compare(r["params"], first[r["tp_rank"]])["bit_identical"]


def _schedule(r: dict, spec: TrainSpec):
    from canzona.spec import ModelSpec  # noqa: F401 - the plan's model, global shapes

    mspec = model_spec(get_preset(spec.preset))
    grad_bytes = 4  # fp32 reductions and fp32 masters, also for bf16 weights
    return tp_schedule(r["plan"], mspec, STEP_POLICIES[spec.policy], r["dp_rank"], spec.tp_mode, grad_bytes,
                       grad_bytes, overlap_step=spec.overlap_step)


@pytest.mark.parametrize("layout_key", all_keys(), ids=ids)
def test_tp_collectives_are_the_schedules(layout_key):
    """The TP log of each step is the TP part of `step_collectives` (the step checks, the gradient
    norm when clipping, then the schedule's exchanges in order);
    tests/policy/test_step_collectives.py checks the DP and TP logs together, interleaved, at
    DP 2 x TP 2."""
    layout, key = layout_key
    spec = cases(layout)[key][0]
    mspec = model_spec(get_preset(spec.preset), spec.dtype)
    for r in runs(layout, key):
        want = step_collectives(r["plan"], mspec, spec.policy, r["dp_rank"], r["tp_rank"], tp_mode=spec.tp_mode,
                                overlap_step=spec.overlap_step, clipped=spec.clip_norm is not None)
        exchanges = [(c.op, c.name, c.sent) for c in want if c.group == TP_GROUP and c.phase == STEP]
        assert exchanges == [(e.op, e.name, e.sent) for e in _schedule(r, spec).exchanges]
        for step in range(spec.steps):
            records = [(x["op"], x["group"], x["name"], tuple(x["bytes_per_rank"]))
                       for x in r["tp_log"] if x["step"] == step]
            assert records == step_records(want, TP_GROUP), (r["dp_rank"], r["tp_rank"], step)


@pytest.mark.parametrize("layout_key", all_keys(), ids=ids)
def test_each_matrix_is_computed_once_and_state_bytes_match_the_plan(layout_key):
    layout, key = layout_key
    spec = cases(layout)[key][0]
    results = runs(layout, key)
    if spec.policy == "zero1":  # elementwise: no rank computes a matrix whole
        assert all(r["hosted"] == [] and r["owned"] == [] for r in results)  # (its TP log: test_step_collectives)
        return
    hosts: dict[str, list[tuple[int, int]]] = {}
    for r in results:
        sched = _schedule(r, spec)
        assert sorted(r["hosted"]) == sorted(t.name for t in sched.hosted(r["tp_rank"]))
        if spec.dtype == "fp32":  # the plan prices fp32 state
            assert r["state_bytes"] == sched.state_bytes(r["tp_rank"]), (r["dp_rank"], r["tp_rank"])
        for name in r["hosted"]:
            hosts.setdefault(name, []).append((r["dp_rank"], r["tp_rank"]))
    matrices = {p.name for p in model_spec(get_preset(spec.preset)).matrix_params()}
    assert set(hosts) == matrices
    plan = results[0]["plan"]
    tp_sync = plan.tp_plan.policy == "tp-sync"
    dp = spec.dp_size(len(results))
    computing = {p.name: set(plan.dp_plan.computing_ranks(b, p)) for b in plan.dp_plan.buckets for p in b.params}
    for name, where in hosts.items():
        dps = {d for d, _ in where}
        if spec.policy == "sc":
            assert dps == set(range(dp))
        elif plan.dp_plan.split_compute and spec.policy != "zero1-gather":
            assert dps == computing[name]  # canzona's even segments: every DP rank the matrix overlaps ...
        elif spec.policy != "zero1-gather":
            assert len(dps) == 1  # one DP owner ...
        # ... and within it one host, or every TP rank under tp-sync
        assert len(where) == len(dps) * (spec.tp if tp_sync else 1), name


def test_dp2xtp2_logs_are_the_step_collectives():
    """Every rank's DP and TP logs of the DP 2 x TP 2 group, interleaved as the step issues them,
    are `step_collectives(...)`, and the simulator issues them (tests/policy/test_step_collectives.py's
    check, run here on this file's cached DP 2 x TP 2 group: from that file, a worker without it
    spawned it again)."""
    from tests.policy.test_step_collectives import check_dp2xtp2_logs_are_the_step_collectives

    check_dp2xtp2_logs_are_the_step_collectives()


def test_canzona_even_geometry_really_ran_split_under_tp():
    """The "even geometry" case ran the plan canzona's geometry makes: ZeRO-1's even segments, some
    matrix split between the two DP ranks (each computes it, on a host of its own TP group)."""
    plan = runs("dp2xtp2", ("even geometry",))[0]["plan"]
    assert plan.dp_plan.policy == "zero1-even" and plan.tp_plan.policy == "greedy-rollback"
    assert any(len(b.ranks_overlapping(p)) > 1 for b in plan.dp_plan.buckets for p in b.params)


def test_capacity_extremes_really_ran_as_planned():
    for layout in ("tp2", "dp2xtp2"):
        alone = runs(layout, ("alone",))[0]["plan"]
        one = runs(layout, ("one group",))[0]["plan"]
        for rank_groups in alone.tp_plan.groups:
            assert all(len(g.tasks) == 1 for g in rank_groups)
        for rank_groups in one.tp_plan.groups:
            assert len(rank_groups) == 1
            spec = model_spec(get_preset("tiny"))
            assert len({spec.param(n).shape for n in rank_groups[0].tasks}) > 2
            assert EVERY_RANK not in rank_groups[0].hosts


@pytest.mark.parametrize("layout,slow", [
    pytest.param(layout, slow, marks=pytest.mark.slow) if slow or layout in SLOW_LAYOUTS else (layout, slow)
    for layout in LAYOUTS for slow in (False, True)])
def test_pipelined_and_serial_train_the_same_model(layout, slow):
    for key in cases(layout):
        if key[-1] == SERIAL and slow_case(layout, key) == slow:
            a, b = runs(layout, key[:-1] + (PIPELINED,)), runs(layout, key)
            for x, y in zip(a, b):
                assert compare(x["params"], y["params"])["bit_identical"]


def test_clip_grad_norm_counts_every_element_once_across_dp_and_tp():
    import math

    for layout in ("tp2", "dp2xtp2"):
        results = runs(layout, ("clip",))
        spec = cases(layout)[("clip",)][0]
        norms = [r["norms"] for r in results]
        assert all(n == norms[0] for n in norms) and len(norms[0]) == spec.steps  # every rank clips alike
        grads, _ = global_gradients_from(results, spec)[0]
        want = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
        assert norms[0][0] == pytest.approx(want, rel=1e-6)
        assert norms[0][0] > spec.clip_norm  # so it really clipped


def test_bf16_weights_keep_fp32_masters_under_tp():
    for r in runs("dp2xtp2", ("bf16",)):
        assert all(p.dtype == torch.bfloat16 for p in r["params"].values())
