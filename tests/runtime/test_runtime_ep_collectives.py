"""The collective logs under expert parallelism (issue 20; docs/design.md §2.7, §8.6): what every
rank logs, on the DP group (the dense part) and on its EDP group (its EP rank's experts),
interleaved by issue order, equals `canzona.step_collectives.step_collectives(...)` of its DP and
EDP ranks record for record, on the first step and on later ones; and the simulator, in the
runtime's collectives mode (`--collectives runtime --ep`) on the same model, plans the same two
plans and issues the same records on every rank.

One spawn of 4 ranks (DP 4 = EDP 2 x EP 2, the tiny MoE of `reference/tiny_moe_ep.py`) trains every
case: each step policy (canzona, zero1-gather, layerwise with SOAP, sc), AdamW on every parameter
(zero1), bf16 weights with fp32 masters, and accumulation over two micro-batches with clipping.
The tiny MoE's dense part has no matrices (no attention: embeddings, routers, norms and the head
go to AdamW), so its DP log holds the AdamW buffer's collectives and the step check; how a dense
part's bucket reductions interleave with the experts' in backward is checked on the simulator's
side, torch-free (tests/sim/test_expert_parallel.py), against the same definition.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest

from canzona.harness.launch import run_ranks
from canzona.harness.training import TrainSpec, build_model, many_specs_worker

pytestmark = pytest.mark.distributed  # spawns gloo process groups

WORLD, EP = 4, 2
DEADLINE_S = 180.0
BASE = TrainSpec(preset="tiny-moe", optimizer="muon", ep=EP, steps=3, global_batch=8, seq_len=8, bucket_size=1024,
                 matrix_config={"ns_dtype": "fp32"})
JOBS = {
    "canzona": BASE,
    "zero1-gather": replace(BASE, policy="zero1-gather"),
    "layerwise": replace(BASE, optimizer="soap", policy="layerwise", matrix_config={"precondition_frequency": 2}),
    "sc": replace(BASE, policy="sc"),
    "zero1": replace(BASE, optimizer="adamw", policy="zero1", matrix_config={}),
    "bf16": replace(BASE, dtype="bf16"),
    "habits": replace(BASE, accumulation=2, global_batch=16, clip_norm=0.05),
}


@functools.cache
def runs() -> dict:
    labels = list(JOBS)
    try:
        results = run_ranks(many_specs_worker, WORLD, [JOBS[k] for k in labels], [{"state_dict": False}] * len(labels),
                            deadline_s=DEADLINE_S, collective_timeout_s=60)
    except Exception as e:  # noqa: BLE001 - replayed by every test that needs it
        return {"error": e}
    return {label: [results[r][i] for r in range(WORLD)] for i, label in enumerate(labels)}


def run(label: str) -> list[dict]:
    got = runs()
    if "error" in got:
        err = got["error"]
        pytest.fail(f"the spawned group failed: {err}\n{getattr(err, 'trace', '')}")
    return got[label]


def logged_steps(res: dict) -> list[list[tuple]]:
    """Per step, (op, group, name, bytes per rank) of every collective the rank logged, its DP and
    EDP logs together in the order it issued them (their shared `seq`)."""
    for log in (res["log"], res["edp_log"]):
        assert [x["order"] for x in log] == list(range(len(log)))
    records = sorted(res["log"] + res["edp_log"], key=lambda x: x["seq"])
    assert [x["seq"] for x in records] == list(range(len(records)))
    assert [x["step"] for x in records] == sorted(x["step"] for x in records)
    return [[(x["op"], x["group"], x["name"], tuple(x["bytes_per_rank"])) for x in records if x["step"] == s]
            for s in range(1 + max(x["step"] for x in records))]


@functools.cache
def model_of(label: str):
    return build_model(JOBS[label]).spec()


@pytest.mark.parametrize("label", list(JOBS))
def test_every_ranks_logs_are_the_step_collectives_of_its_dp_and_edp_ranks(label):
    from canzona.experts import dense_part, expert_part
    from canzona.step_collectives import EDP_GROUP, Experts, step_collectives, step_records

    train, model = JOBS[label], model_of(label)
    for res in run(label):
        assert res["edp_rank"] == res["dp_rank"] // EP and res["ep_rank"] == res["dp_rank"] % EP
        steps = logged_steps(res)
        assert len(steps) == train.steps
        experts = Experts(res["expert_plan"], expert_part(model, EP), res["edp_rank"])
        for s, got in enumerate(steps):
            want = step_collectives(res["plan"].dense, dense_part(model), train.policy, res["dp_rank"],
                                    master_weights=train.master_weights, first_step=s == 0, experts=experts)
            assert got == step_records(want), (label, res["dp_rank"], s)
            assert {g for _, g, _, _ in got} == {"dp", EDP_GROUP}


@pytest.mark.parametrize("label", list(JOBS))
def test_the_simulator_in_the_runtimes_collectives_mode_issues_the_logged_collectives(label):
    """The simulator plans the dense part and the experts itself (no plan file under EP): the same
    plans as the runtime's, and on every rank the records of a step after the first."""
    from canzona.decoder import Architecture
    from canzona.dp.layout import DEFAULT_EXPERT_BUCKETS
    from canzona.spec import DTYPE_BYTES
    from reference.tiny_moe import MOE_PRESETS
    from sim.engine import issued_records
    from sim.options import RunOptions
    from sim.simulate import SimConfig, simulate
    from sim.workload import Workload

    train, model = JOBS[label], model_of(label)
    moe = MOE_PRESETS[train.preset]
    arch = Architecture(model.name, moe.layers, moe.hidden, moe.vocab, moe.hidden, experts=moe.experts,
                        experts_per_token=moe.experts_per_token)
    low = train.dtype in ("bf16", "fp16") and train.master_weights
    wl = Workload(seq_len=train.seq_len, global_batch=WORLD, grad_bytes=4 if low else DTYPE_BYTES[train.dtype],
                  param_bytes=DTYPE_BYTES[train.dtype], dtype="fp32")
    cfg = SimConfig(model=model.name, gpus=WORLD, tp=1, ep=EP, optimizer=train.optimizer, policy=train.policy,
                    workload=wl, bucket_size=train.bucket_size, expert_buckets=DEFAULT_EXPERT_BUCKETS,
                    zero1_fallback=False, options=RunOptions(overlap_param_gather=False, collectives="runtime"))
    result = simulate(cfg, model=(model, arch), replicate_phase_a=False)  # every rank's own records
    ranks = run(label)
    # the runtime's plan: the dense part's, holding the experts' (one plan file under EP)
    assert result.plan.hash() == ranks[0]["plan"].dense.hash() and result.expert_plan.hash() == ranks[0]["expert_plan"].hash()
    assert replace(result.plan, experts=result.expert_plan, ep=EP).hash() == ranks[0]["plan"].hash()
    for res in ranks:
        simulated = [tuple(r) for r in issued_records(result.collective_records, res["dp_rank"])]
        assert simulated == logged_steps(res)[-1], (label, res["dp_rank"])
