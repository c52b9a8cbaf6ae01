"""FSDP2 under pipeline parallelism in the simulator (sim.fsdp_pipeline): torchtitan's PP x FSDP
layout as torch's pipelining runs it. Relations and counts, no absolute times."""

from __future__ import annotations

from dataclasses import replace

import pytest

from canzona.errors import SpecError
from canzona.models import resolve_model
from canzona.pipeline import stage_spec
from sim.fsdp import gathered_elements, unit_elements
from sim.fsdp_pipeline import pipeline_in_flight_bytes
from sim.simulate import SimConfig, simulate
from sim.workload import Workload
from tests.cli_helpers import error_line, invoke

# qwen3-1.7b: 28 layers, 14 a stage at PP 2; DP 8 at 16 GPUs
BASE = SimConfig(model="qwen3-1.7b", gpus=16, tp=1, pp=2, fsdp=True, optimizer="adamw", policy=None,
                 workload=Workload(seq_len=1024, global_batch=64, micro_batch=1))


def _batch(cfg: SimConfig, global_batch: int) -> SimConfig:
    return replace(cfg, workload=replace(cfg.workload, global_batch=global_batch))


@pytest.fixture(scope="module")
def base():
    return simulate(BASE)


def _bubble(r) -> float:
    """Stage 0's share of phase A without compute (its first rank: rank 0)."""
    busy = sum(s.end - s.start for s in r.spans if s.phase == "A" and s.rank == 0 and s.kind == "compute")
    return 1 - busy / r.grad_sync_end_s


def test_bubble_shrinks_with_more_micro_batches(base):
    runs = [simulate(_batch(BASE, g)) for g in (16, 32)] + [base]  # 2, 4, 8 micro-batches a DP rank
    bubbles = [_bubble(r) for r in runs]
    assert bubbles[0] > bubbles[1] > bubbles[2] > 0
    per_micro_batch = [r.grad_sync_end_s / m for r, m in zip(runs, (2, 4, 8))]
    assert per_micro_batch[0] > per_micro_batch[1] > per_micro_batch[2]
    # both stages run phase A (stage 1 on its first rank, 8) and talk point to point
    assert {s.rank for s in base.spans if s.phase == "A" and s.kind == "compute"} == {0, 8}
    sends = [s.name for s in base.spans if s.phase == "A" and s.rank == 0 and "send" in s.name]
    assert sum("activations 0->1" in n for n in sends) == 8 and sum("gradients 1->0" in n for n in sends) == 8


def test_four_stages_each_pass_each_link():
    # 28 layers over 4 stages (7 each), 6 micro-batches a DP rank: every stage runs every pass, and
    # each link carries every micro-batch's activations forward and its gradients back, once
    r = simulate(replace(BASE, gpus=8, pp=4, workload=Workload(seq_len=512, global_batch=12, micro_batch=1)))
    assert {s.rank for s in r.spans if s.phase == "A" and s.kind == "compute"} == {0, 2, 4, 6}
    for s in range(3):
        for rank in (2 * s, 2 * s + 2):  # the sender's and the receiver's part of each transfer
            assert _comm(r, f"activations {s}->{s + 1}", rank) == 6 and _comm(r, f"gradients {s + 1}->{s}", rank) == 6
    assert _comm(r, "bwd all-gather layer", 6) == 7 * 6  # the last stage: F and B in turn from the start


def _comm(r, needle: str, rank: int = 0) -> int:
    return sum(needle in s.name for s in r.spans if s.phase == "A" and s.rank == rank and s.kind == "comm")


def test_gathers_and_reductions_as_torch_pipelining_runs_them(base):
    # stage 0 (14 layers and the embedding's root), 8 micro-batches, 1F1B: F0 F1 B0 F2 ... F7 B6 B7.
    # reshard after forward: every forward before a backward gathers, and every backward after a
    # forward (not B7, after B6: reshard_after_backward=False keeps the units gathered)
    assert _comm(base, "fwd all-gather layer") == 14 * 2
    assert _comm(base, "bwd all-gather layer") == 14 * 7
    assert _comm(base, "fwd all-gather root") == 1
    # the gradients accumulate unsharded; one reduce-scatter a unit after the last backward
    assert _comm(base, "reduce-scatter") == 15
    kept = simulate(replace(BASE, reshard_after_forward=False))  # torchtitan's default under PP
    assert _comm(kept, "all-gather layer") == 14 and _comm(kept, "bwd all-gather") == 0
    assert kept.grad_sync_end_s < base.grad_sync_end_s


def test_stage_memory_below_pp1_at_the_same_shard(base):
    pp1 = simulate(replace(BASE, gpus=8, pp=1))  # DP 8: the same shard group as each stage's
    assert base.memory.pp == 2 and pp1.memory.pp == 1
    w, w1 = base.memory.worst, pp1.memory.worst
    for part in ("grads", "master_weights", "adamw_state"):  # the stage holds its own layers' shards only
        assert getattr(w, part) < getattr(w1, part)
    # in flight: every unit of the stage gathered, with its unsharded gradient (torch keeps both
    # from the first backward to the reductions), not two units as at PP 1
    spec, arch = resolve_model(BASE.model)
    local, experts = unit_elements(stage_spec(spec, 2, base.memory.stage, arch.layers), 1, 1)
    setup = BASE.memory_setup(arch)
    assert w.reduction == pipeline_in_flight_bytes(gathered_elements(local, experts, 8), setup.param_bytes,
                                                   setup.grad_bytes) > w1.reduction
    # at a small shard group the whole stage's parameters in flight cost less than the other half's shards
    two = simulate(_batch(replace(BASE, gpus=4), 16))  # 8 micro-batches a DP rank, as below
    assert two.memory.worst.total < simulate(_batch(replace(BASE, gpus=2, pp=1), 16)).memory.worst.total


def test_fullest_stage(base):
    # qwen3-1.7b's head (a 151,936-token vocabulary, tied: the last stage holds its copy) and the
    # logits outweigh the first stage's micro-batches in flight
    assert base.memory.stage == 1 and base.memory.worst.rank == 8
    # qwen3-8b at PP 4: the first stage's 4 micro-batches of activations outweigh the head
    deep = simulate(replace(BASE, model="qwen3-8b", gpus=32, pp=4, workload=Workload(seq_len=4096, global_batch=32,
                                                                                     micro_batch=1)))
    assert deep.memory.stage == 0 and len(deep.memory.ranks) == 8


def test_owner_policy_steps_each_stage():
    r = simulate(_batch(replace(BASE, optimizer="muon", policy="canzona"), 16))
    assert r.optimizer_step_s > 0 and r.iteration_time_s > r.grad_sync_end_s
    assert {s.rank for s in r.spans if s.phase == "B"} == set(range(8))  # the slowest stage's exchange group


@pytest.mark.parametrize("changes, needle", [
    (dict(vp=2), "without --vp, --ep or --hsdp-replicate"),
    (dict(gpus=32, hsdp_replicate=2), "without --vp, --ep or --hsdp-replicate"),
    (dict(fsdp_impl="megatron-fsdp"), "under --fsdp-impl fsdp2"),
    (dict(workload=Workload(seq_len=1024, global_batch=8, micro_batch=1)), "1 micro-batches per DP rank, fewer than"),
])
def test_bad_layouts_refused(changes, needle):
    with pytest.raises(SpecError, match=needle):
        simulate(replace(BASE, **changes))


def test_cli_runs_fsdp_with_pp_and_refuses_in_one_line():
    args = ("simulate", "--model", "qwen3-1.7b", "--gpus", 16, "--tp", 1, "--fsdp", "--optimizer", "adamw",
            "--global-batch", 16, "--seq-len", 1024)
    result = invoke(*args, "--pp", 2)
    assert result.exit_code == 0, result.output
    assert "PP 2" in result.stdout
    error_line(invoke(*args, "--pp", 2, "--global-batch", 8), "fewer than the stages")
