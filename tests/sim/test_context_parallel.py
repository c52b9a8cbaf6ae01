"""Context parallelism (`--cp C`, Megatron's context-parallel-size with ring attention): the rank
order and groups, the compute of a micro-batch on seq / C tokens with the ring's steps and sends,
the DP x CP group of the optimizer step, activations / C, the checks; relations only, no
absolute times."""

from __future__ import annotations

import json

import pytest

from canzona.attention_rate import efficiency as attention_efficiency
from canzona.errors import SpecError
from canzona.models import resolve_model
from sim import published
from sim.model_work import micro_batch_work
from sim.simulate import SimConfig, simulate
from sim.topology import Cluster
from sim.workload import Workload
from tests.cli_helpers import error_line, invoke

SMALL = dict(model="qwen3-0.6b", optimizer="adamw", zero1_fallback=False)


def _config(gpus: int = 8, tp: int = 1, cp: int = 1, seq: int = 4096, batch: int = 8, **kw) -> SimConfig:
    return SimConfig(gpus=gpus, tp=tp, cp=cp, workload=Workload(seq_len=seq, global_batch=batch), **{**SMALL, **kw})


# --- the rank order --------------------------------------------------------------------------


def test_rank_order_is_tp_then_cp_then_dp_then_pp():
    """Megatron's "tp-cp-ep-dp-pp": a CP group is the ranks at one TP index of `cp` consecutive
    TP groups; the gradients' data-parallel group (dp-cp) is every DP x CP rank at one TP index."""
    cl = Cluster(32, 2, 8, pp=2, cp=2)
    assert (cl.dp, cl.batch_dp, cl.stage_gpus) == (8, 4, 16)
    assert cl.cp_group(0, 0) == [0, 2] and cl.cp_group(0, 1) == [1, 3] and cl.cp_group(1, 0) == [4, 6]
    assert cl.cp_group(0, 0, stage=1) == [16, 18]
    assert cl.dp_group(0) == list(range(0, 16, 2))  # DP x CP = 8 ranks
    groups = cl.cp_groups()
    assert len(groups) == cl.batch_dp * cl.tp and sorted(r for g in groups for r in g) == list(cl.stage_ranks())
    assert not cl.cp_geometry().crosses_nodes  # TP x CP = 4 ranks inside an 8-GPU node
    assert Cluster(32, 8, 8, cp=2).cp_geometry().crosses_nodes  # TP 8 x CP 2 spans two nodes


def test_cp_1_is_todays_cluster():
    a, b = Cluster(64, 4, 8, pp=2), Cluster(64, 4, 8, pp=2, cp=1)
    assert a == b and b.batch_dp == b.dp and all(len(g) == 1 for g in b.cp_groups())


# --- the compute of a micro-batch ------------------------------------------------------------


def test_micro_batch_at_cp_runs_its_share_of_the_tokens():
    """GEMMs and the head run on tokens / C (as CP 1 on the fewer tokens); attention is 1 / C of
    the whole micro-batch's, as C ring steps; the ring sends K and V of the rank's tokens."""
    spec, arch = resolve_model("qwen3-0.6b", 1)
    from canzona.cost import DeviceRate
    from canzona.hardware import load_profile

    rate = DeviceRate.from_profile(load_profile("h100-sxm"))
    args = (spec, 1)
    tail = (4096, arch.q_dim, arch.hidden, arch.vocab, rate)
    full = micro_batch_work(*args, 4096, *tail)
    cp2 = micro_batch_work(*args, 4096, *tail, cp=2, kv_dim=arch.kv_dim)
    half = micro_batch_work(*args, 2048, *tail, kv_dim=arch.kv_dim)  # kv_dim: RoPE's k width
    attention, mlp = cp2.forward[0]
    assert attention.first_s == half.forward[0][0].first_s and attention.last_s == half.forward[0][0].last_s
    assert mlp == half.forward[0][1] and cp2.head_forward_s == half.head_forward_s
    # at 2048 tokens of a 4096-token sequence CP 1 still computes the whole sequence's attention;
    # CP 2's core is its two ring steps, each a quarter of the causal sequence's FLOPs at the
    # efficiency of its shape: the diagonal causal over the rank's 2048 tokens, then the slower of
    # 2048 x 1024 and 1024 x 2048 unmasked (keys 1024 or 2048)
    peak = rate.peak_flops["bf16"]
    power = rate.gemm_model
    assert power is not None

    def efficiency(pass_: str, causal: bool, seq: float, head_dim: int) -> float:
        """At the power-limited clock of a training step (canzona.attention_rate)."""
        return attention_efficiency(pass_, causal, seq, head_dim, clock=power.sustained_clock,
                                    window_s=power.boost_window_s)

    step = 4.0 * 4096 * 4096 * arch.q_dim * 0.5 / 2 / 2
    diag = step / (peak * efficiency("forward", True, 2048, 128))
    later = max(step / (peak * efficiency("forward", False, k, 128)) for k in (1024, 2048))
    assert attention.ring_step_s == pytest.approx((diag, later)) and attention.core_s == pytest.approx(diag + later)
    back = cp2.backward[0][-1]
    diag_b = 2.5 * step / (peak * efficiency("backward", True, 2048, 128))
    later_b = max(2.5 * step / (peak * efficiency("backward", False, k, 128)) for k in (1024, 2048))
    assert back.ring_step_s == pytest.approx((diag_b, later_b))
    # the rest of the block: CP 1's memory-bound kernels at 2048 tokens plus the ring step's merge
    # of its partial output (read it, read and write the running output: 3 x tokens x q x 2 bytes)
    whole = 4.0 * 4096 * 4096 * arch.q_dim * 0.5 / (peak * efficiency("forward", True, 4096, 128))
    rest_cp1 = half.forward[0][0].middle_s - whole
    merge = 3 * 2048 * arch.q_dim * 2 / (rate.hbm_bytes_per_s * rate.hbm_efficiency) + rate.launch_s
    assert attention.middle_s - attention.core_s == pytest.approx(rest_cp1 + merge)
    assert full.forward[0][0].middle_s > whole
    assert attention.ring_steps == 2 and attention.ring_bytes == (2048 * 2 * arch.kv_dim * 2,)
    back = cp2.backward[0][-1]  # backward: attention's block last
    assert back.ring_steps == 2 and back.ring_bytes == (2048 * 2 * arch.kv_dim * 2,) * 2
    cp4 = micro_batch_work(*args, 4096, *tail, cp=4, kv_dim=arch.kv_dim)
    kv = 1024 * 2 * arch.kv_dim * 2
    assert cp4.forward[0][0].ring_bytes == (kv,) * 3 and cp4.backward[0][-1].ring_bytes == (kv, 2 * kv, 2 * kv, kv)
    assert micro_batch_work(*args, 4096, *tail, cp=1) == full


# --- the simulation --------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_steps_and_sends_appear(cp: int):
    """Per layer and micro-batch: C attention steps forward and C backward on the compute stream,
    C - 1 K/V sends forward and C backward (K/V, K/V with dK/dV, dK/dV home) on the CP stream."""
    cfg = _config(cp=cp)
    r = simulate(cfg)
    layers = resolve_model("qwen3-0.6b", 1)[1].layers
    m = cfg.workload.micro_batches(8 // cp)
    rank0 = [s for s in r.spans if s.phase == "A" and s.rank == 0]
    steps = [s for s in rank0 if "attention step" in s.name]
    sends = [s for s in rank0 if "cp ring" in s.name]
    assert len([s for s in steps if " fwd " in s.name]) == cp * layers * m
    assert len([s for s in steps if " bwd " in s.name]) == cp * layers * m
    assert len([s for s in sends if " fwd " in s.name]) == (cp - 1) * layers * m
    assert len([s for s in sends if " bwd " in s.name]) == cp * layers * m
    assert {s.stream for s in sends} == {"cp-comm"} and all(s.kind == "comm" for s in sends)
    assert not any("cp ring" in s.name or "attention step" in s.name for s in simulate(_config()).spans)


def test_cp_halves_activations_and_plans_over_dp_x_cp():
    """At the same GPUs: the optimizer step's data-parallel group is DP x CP (the same plan and
    per-GPU weights, gradients and optimizer state as CP 1 at DP x CP), the batch splits over DP
    only, and each GPU's activations are those of seq / C tokens: exactly half at C 2 (every
    activation term is per token with flash attention; up to the byte rounding)."""
    one, two = simulate(_config(cp=1)), simulate(_config(cp=2))
    assert one.plan.dp == two.plan.dp == 8
    w1, w2 = one.memory.worst, two.memory.worst
    assert (w1.weights, w1.grads, w1.master_weights, w1.adamw_state) == \
        (w2.weights, w2.grads, w2.master_weights, w2.adamw_state)
    assert abs(2 * w2.activations - w1.activations) <= 2
    d = two.to_dict()
    assert (d["cp"], d["dp"], d["dp_cp"]) == (2, 4, 8) and "dp_cp" not in one.to_dict()
    # the same work per GPU: the MFU's model FLOPs count each micro-batch once over its C ranks
    assert two.mfu * two.iteration_time_s == pytest.approx(one.mfu * one.iteration_time_s)


def test_ring_across_nodes_costs_more_than_inside_one():
    """TP 8 x CP 2 puts every ring hop on the NICs; TP 4 x CP 2 keeps it on NVLink. The sends
    are slower across nodes (per byte: TP 8 halves each rank's bytes)."""
    inside = simulate(_config(gpus=16, tp=4, cp=2, batch=4, model="qwen3-8b"))
    across = simulate(_config(gpus=16, tp=8, cp=2, batch=8, model="qwen3-8b"))

    def per_send(r):
        sends = [s for s in r.spans if s.phase == "A" and s.rank == 0 and "cp ring" in s.name and " fwd " in s.name]
        return sum(s.end - s.start for s in sends) / len(sends)

    assert per_send(across) > per_send(inside) / 2


# --- the checks ------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,needle", [
    (dict(cp=2, seq=4098), "not divisible by 2 x cp"),
    (dict(gpus=8, tp=4, cp=4), "not divisible by tp x cp x pp"),
    (dict(cp=0), "must be >= 1"),
    (dict(gpus=16, tp=4, cp=2, seq=4100), "4100 / cp 2 is not divisible by tp 4"),  # 2050 tokens over 4 TP ranks
    (dict(gpus=8, tp=2, seq=4097, cp=1), "sequence parallelism"),
    (dict(cp=2, fsdp=True, optimizer="muon", policy="canzona"), "--fsdp with cp > 1"),
])
def test_bad_inputs_are_spec_errors(kw, needle):
    with pytest.raises(SpecError, match=needle):
        _config(**kw).check()


def test_cp_with_ep_is_refused():
    with pytest.raises(SpecError, match="expert parallelism"):
        SimConfig(model="qwen3-30b-a3b", gpus=16, tp=1, cp=2, ep=8, optimizer="adamw").check()


@pytest.mark.parametrize("args,needle", [
    (("--cp", "2", "--seq-len", "4098"), "2 x cp"),
    (("--cp", "3"), "tp x cp x pp"),
    (("--cp", "0"), "cp="),
])
def test_cli_bad_cp_is_one_error_line(args, needle):
    error_line(invoke("simulate", "--model", "qwen3-0.6b", "--gpus", "8", "--tp", "1", *args), needle)


def test_cli_cp_in_json():
    out = invoke("simulate", "--model", "qwen3-0.6b", "--gpus", "8", "--tp", "1", "--cp", "2",
                 "--optimizer", "adamw", "--global-batch", "8", "--json")
    assert out.exit_code == 0, out.output
    d = json.loads(out.stdout)
    assert (d["cp"], d["dp"], d["dp_cp"]) == (2, 4, 8)


# --- published rows --------------------------------------------------------------------------


def test_published_cp_rows_simulate_when_only_cp_stood_in_the_way():
    runs, _ = published.load()
    rows = [r for r in runs if r.cp > 1]
    assert rows and all("--cp" not in r.needs() for r in rows)
    run = next(r for r in rows if not r.needs())
    cfg = run.sim_config()
    assert cfg.cp == run.cp > 1
    result = published.compare_run(run)
    assert result.expressible and result.simulated_tokens_per_s_per_gpu > 0


def test_every_rank_agrees_with_the_replicated_phase_a():
    """The ring's exchanges synchronise a CP group's ranks: simulating every rank (the ring a
    collective of the whole CP group, across nodes at TP 4 x CP 4) gives rank 0's times."""
    cfg = _config(gpus=16, tp=4, cp=4, optimizer="muon", policy="canzona")
    a, b = simulate(cfg), simulate(cfg, replicate_phase_a=False)
    assert (a.iteration_time_s, a.grad_sync_end_s) == (b.iteration_time_s, b.grad_sync_end_s)
