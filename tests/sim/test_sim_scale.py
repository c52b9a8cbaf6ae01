"""Simulating the optimizer step once per class of identical ranks (`sim.classes`, docs/design.md
§9.8) changes no result: every configuration of `scale_configs.CONFIGS` gives, bit for bit, the
`to_dict()`, the spans (as a set) and the runtime-mode collective records recorded before the
change (tests/sim/data), and others the same as with every rank simulated (`by_class=False`)."""

from __future__ import annotations

import json

import pytest

from sim.classes import StepClasses
from sim.options import RunOptions
from sim.simulate import SimConfig, simulate
from sim.workload import Workload
from tests.sim.scale_configs import CONFIGS, DATA, record, spans_digest

GOLDEN = json.loads(DATA.read_text())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_same_result_as_before(name: str) -> None:
    got = record(simulate(CONFIGS[name]))
    want = GOLDEN[name]
    assert got["result"] == want["result"]  # floats through repr: bit for bit
    assert got["spans"] == want["spans"]
    assert got["records"] == want["records"]


def _same(a, b) -> None:
    assert json.dumps(a.to_dict()) == json.dumps(b.to_dict())
    assert spans_digest(a) == spans_digest(b)


REFERENCE = {  # beside the recorded ones: other optimizers, modes and layouts against every rank simulated
    "shampoo-tp4-pp2": SimConfig(model="qwen3-4b", gpus=64, tp=4, pp=2, optimizer="shampoo",
                                 workload=Workload(seq_len=256, global_batch=32)),
    "normuon-tp2-overlap-step": SimConfig(model="qwen3-1.7b", gpus=64, tp=2, optimizer="normuon",
                                          workload=Workload(seq_len=256, global_batch=64),
                                          options=RunOptions(overlap_step=True, overlap_param_gather=False)),
    "moe-etp2-layerwise": SimConfig(model="qwen3-30b-a3b", gpus=64, tp=2, ep=4, etp=2, policy="layerwise",
                                    workload=Workload(seq_len=256, global_batch=32)),
    "tp1-serial-unbatched": SimConfig(model="qwen3-0.6b", gpus=32, tp=1, tp_mode="serial",
                                      workload=Workload(seq_len=256, global_batch=32),
                                      options=RunOptions(batch_kernels=False, reduce_scatter="exact")),
    # zero1-gather's split gathers are point-to-point over the network: their kernel's SMs follow
    # the whole DP group's size, not the simulated members' (which once slowed the norm beside them)
    "zero1-gather-split-p2p": SimConfig(model="qwen3-0.6b", gpus=32, tp=4, policy="zero1-gather",
                                        workload=Workload(seq_len=256, global_batch=32)),
}


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_classes_match_every_rank(name: str) -> None:
    cfg = REFERENCE[name]
    _same(simulate(cfg), simulate(cfg, by_class=False))


def test_few_classes_stand_for_many_ranks() -> None:
    """At DP 128 most DP ranks own no matrix: a few units are simulated, and the result still has
    every rank's step (spans, per-rank optimizer compute)."""
    cfg = SimConfig(model="qwen3-8b", gpus=1024, tp=8, zero1_fallback=False, workload=Workload(seq_len=256, global_batch=128))
    r = simulate(cfg)
    simulated = {s.rank for s in r.spans.simulated if s.phase == "B"}
    assert len(simulated) < cfg.gpus // 4
    assert {s.rank for s in r.spans if s.phase == "B"} == set(range(cfg.gpus))
    assert len(r.rank_optimizer_s) == cfg.gpus


def test_step_classes_units() -> None:
    c = StepClasses(first=64, unit=8, of_unit=(0, 1, 1, 0))
    assert c.ranks == list(range(64, 80)) and c.classes == 2
    assert [c.rep(r) for r in (64, 79, 80, 87, 95)] == [64, 79, 72, 79, 71]
    assert StepClasses.every_rank(0, 4).ranks == [0, 1, 2, 3]
