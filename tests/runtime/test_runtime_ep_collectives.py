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
from canzona.harness.training import TrainSpec, many_specs_worker
from tests.runtime.expert_runs import check_logged_collectives, check_simulated_collectives, replay

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
    "overlap": replace(BASE, overlap_step=True),
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
    return replay(runs(), label)


@pytest.mark.parametrize("label", list(JOBS))
def test_every_ranks_logs_are_the_step_collectives_of_its_dp_and_edp_ranks(label):
    ranks = run(label)
    for res in ranks:
        assert res["edp_rank"] == res["dp_rank"] // EP and res["ep_rank"] == res["dp_rank"] % EP
    check_logged_collectives(JOBS[label], ranks, label)


@pytest.mark.parametrize("label", list(JOBS))
def test_the_simulator_in_the_runtimes_collectives_mode_issues_the_logged_collectives(label):
    """The simulator plans the dense part and the experts itself (no plan file under EP): the same
    plans as the runtime's, and on every rank the records of a step after the first."""
    check_simulated_collectives(JOBS[label], run(label), label)
