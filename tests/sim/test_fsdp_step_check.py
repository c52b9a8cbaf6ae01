"""The FSDP step check in the simulator (sim.fsdp, phase B): under `--collectives runtime`, as the
ZeRO-1 layout prices its own checks (`canzona.step_collectives`, CHECK), the all-gather over every
rank of the mesh that `canzona.fsdp_collectives.fsdp_step_collectives` defines, issued where the
runtime issues it (`FsdpOptimizer.check`: after each rank's norm term, before the exchanges and
AdamW), recorded as the runtime logs it; under the default Megatron-style collectives, as the
ZeRO-1 layout's, no check."""

from __future__ import annotations

from dataclasses import replace

import pytest

from canzona.fsdp_collectives import (
    CHECK_EXTRA_WORDS,
    CHECK_WORD_BYTES,
    FSDP_WORLD_GROUP,
    RECHECK_WORDS,
)
from canzona.models import resolve_model
from sim.options import RunOptions
from sim.simulate import SimConfig, simulate
from sim.workload import Workload

SMALL = Workload(seq_len=1024, global_batch=16, micro_batch=1)
ADAMW = SimConfig(model="qwen3-1.7b", gpus=8, tp=1, optimizer="adamw", fsdp=True, workload=SMALL)
RUNTIME = RunOptions(collectives="runtime")


@pytest.fixture(scope="module")
def adamw():
    return simulate(ADAMW), simulate(replace(ADAMW, options=RUNTIME))


def _checks(result, rank: int = 0) -> list:
    return [s for s in result.spans if s.phase == "B" and s.rank == rank and "check" in s.name]


def test_runtime_collectives_price_the_step_check(adamw):
    megatron, runtime = adamw
    words = len(resolve_model("qwen3-1.7b")[0].params) + CHECK_EXTRA_WORDS
    record = ("all-gather", FSDP_WORLD_GROUP, "step check", (words * CHECK_WORD_BYTES,) * 8)
    assert list(runtime.collective_records) == [(tuple(range(8)), record)]
    [check] = _checks(runtime)
    assert check.kind == "comm" and check.end > check.start
    # after the rank's norm term, before AdamW's step (what waits for it)
    norm = next(s for s in runtime.spans if s.phase == "B" and s.rank == 0 and s.name == "gradient norm")
    step = next(s for s in runtime.spans if s.phase == "B" and s.rank == 0 and s.name == "adamw step")
    assert norm.end <= check.start and check.end <= step.start
    # on the step's critical path: the iteration grows by the check's time
    assert not _checks(megatron) and not megatron.collective_records
    assert runtime.iteration_time_s - megatron.iteration_time_s == pytest.approx(check.end - check.start, rel=1e-9)


def test_hsdp_checks_every_replica_and_rechecks_after_an_explicit_clip():
    cfg = SimConfig(model="qwen3-0.6b", gpus=16, tp=1, fsdp=True, hsdp_replicate=2, workload=SMALL,
                    options=RunOptions(collectives="runtime", explicit_clip=True))
    r = simulate(cfg)
    words = len(resolve_model("qwen3-0.6b")[0].params) + CHECK_EXTRA_WORDS
    members = tuple(range(8))  # the shard group simulated; the gathers span both replicas
    assert list(r.collective_records) == [
        (members, ("all-gather", FSDP_WORLD_GROUP, "step check", (words * CHECK_WORD_BYTES,) * 16)),
        (members, ("all-gather", FSDP_WORLD_GROUP, "step recheck", (RECHECK_WORDS * CHECK_WORD_BYTES,) * 16))]
    check, recheck = _checks(r)
    first = min(s.start for s in r.spans if s.phase == "B" and s.rank == 0 and s.name == "group 0 gather")
    assert check.end <= recheck.start and recheck.end <= first  # before the owners' exchange


def test_pipeline_stages_record_the_slowest_stages_check():
    # under --pp the outcome's engine holds the slowest stage's phase B: its check recorded as at PP 1,
    # over that stage's ranks (one FsdpOptimizer a stage), its members numbered from 0 as its spans
    cfg = SimConfig(model="qwen3-0.6b", gpus=16, tp=1, fsdp=True, workload=SMALL, options=RUNTIME)
    flat, piped = simulate(cfg), simulate(replace(cfg, pp=2))
    assert len(flat.collective_records) == 1
    [(members, record)] = piped.collective_records
    assert members == tuple(range(8))
    assert record[:3] == ("all-gather", FSDP_WORLD_GROUP, "step check") and len(record[3]) == 8
    [check] = _checks(piped)
    assert check.end > check.start
