"""The decoder layer's attention and memory-bound kernels (sim/layer_kernels.py,
canzona/attention_rate.py): the published attention table reproduced, the bytes each kernel moves
computed here independently for a small layer, the context-parallel ring's steps, and the
profiles' achievable HBM bandwidth."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from importlib import resources

import pytest

from canzona.attention_rate import (
    TABLE_PEAK_FLOPS,
    check_attention_backend,
    efficiency,
    table_from_dict,
)
from canzona.cost import DeviceRate, elementwise_kernel
from canzona.errors import SpecError
from canzona.hardware import load_profile, profile_from_dict
from canzona.models import resolve_model
from sim import layer_kernels as lk
from sim.model_work import micro_batch_work

RAW = json.loads((resources.files("canzona") / "data" / "attention_throughput.json").read_text())


# --- attention: the published table ---------------------------------------------------------


def test_every_published_point_is_reproduced():
    """At each measured (pass, mask, head dim, sequence) the efficiency is the figure's TFLOP/s
    over the H100's 989 TFLOP/s."""
    points = 0
    for row in RAW["series"]:
        for seq, tflops in zip(RAW["seqlens"], row["tflops"]):
            got = efficiency(row["pass"], row["causal"], seq, row["head_dim"], implementation=row["implementation"])
            assert got == pytest.approx(tflops * 1e12 / 989e12, rel=1e-12)
            points += 1
    assert points == 19 * 6  # cuDNN 8 series, FlashAttention-3 8, FlashAttention-2 3 (head dim 128)


def test_interpolation_is_log_linear_and_held_at_the_ends():
    """Between 4k (518) and 8k (529), causal forward at head dim 128: halfway in log2 at
    sqrt(4k x 8k); beyond the table the end points hold; head dim 96 lies halfway (log2) between
    64 and 128."""
    mid = math.sqrt(4096 * 8192)
    assert efficiency("forward", True, mid, 128) * 989 == pytest.approx((518 + 529) / 2)
    assert efficiency("forward", True, 100_000, 128) * 989 == pytest.approx(539)
    assert efficiency("forward", True, 128, 128) * 989 == pytest.approx(315)
    hd96 = efficiency("forward", False, 2048, 96) * 989
    assert hd96 == pytest.approx(395 + (617 - 395) * math.log2(96 / 64))


def test_causal_backward_is_derived_from_the_published_ratios():
    """No published causal backward: the unmasked backward times what the mask costs the forward."""
    for seq in (512, 4096, 16384):
        i = RAW["seqlens"].index(seq)
        series = {(r["pass"], r["causal"]): r["tflops"][i] for r in RAW["series"]
                  if r["implementation"] == "cudnn" and r["head_dim"] == 128}
        want = series[("backward", False)] * series[("forward", True)] / series[("forward", False)]
        assert efficiency("backward", True, seq, 128) * TABLE_PEAK_FLOPS / 1e12 == pytest.approx(want)


def test_flash_backend_is_flash_attention_2():
    """Megatron's --attention-backend: fused is cuDNN's series, flash the paper's FlashAttention-2
    (Transformer Engine 1.x's FlashAttention backend), which at 8k causal reaches 333 of cuDNN's
    529 TFLOP/s forward; its causal backward is derived as cuDNN's is, and its one head dimension
    (128) stands for the others."""
    assert check_attention_backend("fused") == "cudnn" and check_attention_backend("flash") == "fa2"
    peak = TABLE_PEAK_FLOPS / 1e12
    assert efficiency("forward", True, 8192, 128, implementation="fa2") * peak == pytest.approx(333)
    assert efficiency("forward", True, 8192, 128, implementation="cudnn") * peak == pytest.approx(529)
    assert efficiency("backward", True, 8192, 128, implementation="fa2") * peak == pytest.approx(318 * 333 / 370)
    assert efficiency("forward", False, 4096, 64, implementation="fa2") == \
        efficiency("forward", False, 4096, 128, implementation="fa2")
    with pytest.raises(SpecError, match="attention backend must be one of fused, flash"):
        check_attention_backend("sdpa")


def test_flash_backend_slows_only_the_attention_core():
    """The same micro-batch under flash: the attention core's seconds grow by cuDNN's throughput
    over FlashAttention-2's at each ring step; nothing else of the layer moves."""
    spec, arch = resolve_model("qwen3-0.6b")
    rate = DeviceRate.from_profile(load_profile("h100-sxm"))
    args = (spec, 1, 4096, 4096, arch.q_dim, arch.hidden, arch.vocab, rate)
    fused = micro_batch_work(*args, kv_dim=arch.kv_dim, head_dim=arch.head_dim)
    flash = micro_batch_work(*args, kv_dim=arch.kv_dim, head_dim=arch.head_dim, attention_backend="flash")
    flops = 4.0 * 4096 * 4096 * arch.q_dim * 0.5  # one causal sequence of 4096, every head
    peak = rate.peak_flops["bf16"]
    for backward, fused_layers, flash_layers in ((False, fused.forward, flash.forward),
                                                 (True, fused.backward, flash.backward)):
        core = [sum(lk.attention_steps(flops, 4096, 1, True, arch.head_dim, peak, backward=backward,
                                       implementation=impl, **H100_CLOCK)) for impl in ("cudnn", "fa2")]
        assert core[1] > 1.4 * core[0]  # FlashAttention-2 reaches about 60% of cuDNN's throughput at 4k
        for a_blocks, b_blocks in zip(fused_layers, flash_layers):  # per layer: one block (attention) moves
            moved = [(a, b) for a, b in zip(a_blocks, b_blocks) if a != b]
            assert len(moved) == 1 and moved[0][0].middle_s != moved[0][1].middle_s  # the core is in middle_s
            assert moved[0][1].seconds - moved[0][0].seconds == pytest.approx(core[1] - core[0])
    with pytest.raises(SpecError, match="attention backend"):
        micro_batch_work(*args, attention_backend="sdpa")


def test_bad_tables_and_calls_are_refused():
    with pytest.raises(SpecError, match="pass"):
        efficiency("sideways", True, 4096, 128)
    with pytest.raises(SpecError, match="positive"):
        efficiency("forward", True, 0, 128)
    bad = dict(RAW, series=[dict(RAW["series"][0], tflops=[1e6] * 6)])
    with pytest.raises(SpecError, match="below the peak"):
        table_from_dict(bad)
    with pytest.raises(SpecError, match="no published"):
        efficiency("backward", False, 4096, 128, implementation="fa3",
                   table=table_from_dict(dict(RAW, series=RAW["series"][:8])))


# --- attention: the measured loops at the power-limited clock -----------------------------------


H100_CLOCK = dict(clock=0.91, window_s=0.022)  # profiles/h100-sxm.json, gemm_model


def _loop_ms(pass_: str, causal: bool, seq: int, head_dim: int = 128) -> float:
    """Milliseconds of one measured call: 16k tokens of a 2048-wide attention at the figure's rate."""
    row = next(r for r in RAW["series"] if (r["pass"], r["causal"], r["head_dim"]) == (pass_, causal, head_dim)
               and r["implementation"] == "cudnn")
    flops = 4.0 * 16384 * seq * 2048 * (0.5 if causal else 1.0) * (2.5 if pass_ == "backward" else 1.0)
    return flops / (row["tflops"][RAW["seqlens"].index(seq)] * 1e12) * 1e3


def test_the_tables_loop_is_stated():
    assert RAW["protocol"]["warmup"] == 2 and RAW["protocol"]["iters"] == 30
    assert RAW["protocol"]["tokens"] == 16384 and RAW["protocol"]["hidden"] == 2048
    assert "sleep" in RAW["protocol"]["source"]


def test_a_loop_inside_the_boost_window_ran_at_boost():
    """Forward, causal, 512 tokens: 32 calls of about 0.07 ms, well inside 22 ms, so the figure is
    a boost-clock one and a training step gets 0.91 of it."""
    assert 32 * _loop_ms("forward", True, 512) < 22
    ratio = efficiency("forward", True, 512, 128, **H100_CLOCK) / efficiency("forward", True, 512, 128)
    assert ratio == pytest.approx(0.91, rel=1e-9)


def test_a_long_loop_ran_mostly_at_the_sustained_clock():
    """Backward, unmasked, 16k tokens: about 9 ms a call, so only a few timed calls ran at boost:
    the figure is nearly a sustained one (the ratio between 0.91 and 1, near 1)."""
    assert _loop_ms("backward", False, 16384) > 8
    ratio = efficiency("backward", False, 16384, 128, **H100_CLOCK) / efficiency("backward", False, 16384, 128)
    assert 0.99 < ratio < 1.0


def test_the_sustained_clock_never_speeds_attention_and_one_keeps_the_table():
    for row in RAW["series"]:
        for seq in RAW["seqlens"]:
            args = (row["pass"], row["causal"], seq, row["head_dim"])
            kw = dict(implementation=row["implementation"])
            table = efficiency(*args, **kw)
            assert efficiency(*args, **kw, clock=1.0, window_s=0.022) == table
            assert 0.91 * table * (1 - 1e-9) <= efficiency(*args, **kw, **H100_CLOCK) <= table


def test_without_a_protocol_the_figures_are_taken_as_sustained():
    table = table_from_dict({k: v for k, v in RAW.items() if k != "protocol"})
    assert table.protocol is None
    assert efficiency("forward", True, 512, 128, table=table, **H100_CLOCK) == efficiency("forward", True, 512, 128)


@pytest.mark.parametrize("bad", [{"tokens": 0}, {"iters": "30"}, {"warmup": -1}, {"hidden": True}])
def test_bad_protocols_and_clocks_are_refused(bad):
    with pytest.raises(SpecError, match="protocol"):
        table_from_dict(dict(RAW, protocol=dict(RAW["protocol"], **bad)))
    with pytest.raises(SpecError, match="clock"):
        efficiency("forward", True, 4096, 128, clock=1.5)


def test_micro_batch_attention_runs_at_the_profiles_sustained_clock():
    """The simulator's attention core is the converted table's (h100-sxm: 0.91, 22 ms)."""
    spec, arch = resolve_model("qwen3-1.7b")
    rate = DeviceRate.from_profile(load_profile("h100-sxm"))
    work = micro_batch_work(spec, 1, 4096, 4096, arch.q_dim, arch.hidden, arch.vocab, rate, kv_dim=arch.kv_dim)
    flops = 4.0 * 4096 * 4096 * arch.q_dim * 0.5
    core = flops / (rate.peak_flops["bf16"] * efficiency("forward", True, 4096, 128, **H100_CLOCK))
    boost = flops / (rate.peak_flops["bf16"] * efficiency("forward", True, 4096, 128))
    assert core > boost
    # the same device without a power limit: the attention block differs by the cores alone
    assert rate.gemm_model is not None
    cool = replace(rate, gemm_model=replace(rate.gemm_model, sustained_clock=1.0))
    free = micro_batch_work(spec, 1, 4096, 4096, arch.q_dim, arch.hidden, arch.vocab, cool, kv_dim=arch.kv_dim)
    assert work.forward[0][0].middle_s - free.forward[0][0].middle_s == pytest.approx(core - boost, rel=1e-9)


# --- attention under context parallelism -----------------------------------------------------


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_steps_price_each_shape(cp: int):
    """Equal FLOPs per step; step 0 is the causal diagonal over seq / cp keys, the later ones the
    slower of the two unmasked shapes (seq / 2cp or seq / cp keys); no mask: every step unmasked
    over seq / cp keys. Without CP: one call over the sequence."""
    seq, flops, peak, hd = 8192, 1e12, 989e12, 128
    steps = lk.attention_steps(flops, seq, cp, True, hd, peak, backward=False)
    assert len(steps) == cp
    assert steps[0] == pytest.approx(flops / cp / (peak * efficiency("forward", True, seq / cp, hd)))
    slow = min(efficiency("forward", False, seq / cp / 2, hd), efficiency("forward", False, seq / cp, hd))
    assert all(s == pytest.approx(flops / cp / (peak * slow)) for s in steps[1:])
    back = lk.attention_steps(flops, seq, cp, True, hd, peak, backward=True)
    assert back[0] == pytest.approx(2.5 * flops / cp / (peak * efficiency("backward", True, seq / cp, hd)))
    unmasked = lk.attention_steps(flops, seq, cp, False, hd, peak, backward=False)
    assert unmasked == pytest.approx((flops / cp / (peak * efficiency("forward", False, seq / cp, hd)),) * cp)
    whole = lk.attention_steps(flops, seq, 1, True, hd, peak, backward=False)
    assert whole == pytest.approx((flops / (peak * efficiency("forward", True, seq, hd)),))


def test_micro_batch_ring_steps_sum_to_the_core():
    spec, arch = resolve_model("qwen3-0.6b", 1)
    rate = DeviceRate.from_profile(load_profile("h100-sxm"))
    for cp in (2, 4):
        work = micro_batch_work(spec, 1, 8192, 8192, arch.q_dim, arch.hidden, arch.vocab, rate, cp=cp,
                                kv_dim=arch.kv_dim, head_dim=arch.head_dim)
        for block in (work.forward[0][0], work.backward[0][-1]):
            assert len(block.ring_step_s) == block.ring_steps == cp
            assert sum(block.step_seconds(i) for i in range(cp)) == pytest.approx(block.core_s)


# --- the memory-bound kernels' bytes ----------------------------------------------------------


def test_layer_bytes_for_a_small_layer():
    """A Llama-style layer, hidden 64, q 64, kv 32, ffn 128, TP 2 (sequence parallel), 16 tokens,
    bf16: each block's passes counted here by hand."""
    t, tp, h, q, kv, f, b, sms = 16, 2, 64, 64 // 2, 32 // 2, 128 // 2, 2, 4
    rows = t / tp
    s = lk.LayerShape(tokens=t, tp=tp, hidden=h, act_bytes=b, sms=sms)
    norm_f = rows * h * b * 2 + rows * 4  # read x, write y, write fp32 1/rms
    norm_b = rows * h * b * 3 + rows * 4 + 2 * sms * h * 4  # read x, dy, write dx; 1/rms; dgamma partials
    rope = t * (q + kv) * b * 2  # read and write q and k
    add = rows * h * b * 3
    attn_f = [k.bytes for k in lk.attention_block(s, q, kv, False, "a")]
    attn_b = [k.bytes for k in lk.attention_block(s, q, kv, True, "a")]
    assert attn_f == pytest.approx([norm_f, rope, add]) and attn_b == pytest.approx([add, rope, norm_b])
    swiglu_f = t * (2 * f + f) * b  # read gate and up, write the product
    swiglu_b = t * (3 * f + 2 * f) * b  # read gate, up, dy; write d(gate), d(up)
    qk = [k.bytes for k in lk.attention_block(s, q, kv, False, "a", with_qk_norm=True)]
    assert qk == pytest.approx([norm_f, t * (q + kv) * b * 2, rope, add])
    qk_b = [k.bytes for k in lk.attention_block(s, q, kv, True, "a", with_qk_norm=True)]
    assert qk_b == pytest.approx([add, rope, t * (q + kv) * b * 3, norm_b])
    mlp_f = [k.bytes for k in lk.mlp_block(s, 2 * f, True, False, "m")]
    mlp_b = [k.bytes for k in lk.mlp_block(s, 2 * f, True, True, "m")]
    assert mlp_f == pytest.approx([norm_f, swiglu_f, add]) and mlp_b == pytest.approx([add, swiglu_b, norm_b])
    # context parallelism 3: two merges forward (output), two of dQ and two of dK/dV backward
    assert [k.bytes for k in lk.ring_merges(s, q, kv, 3, False, "a")] == pytest.approx([3 * t * q * b] * 2)
    assert sum(k.bytes for k in lk.ring_merges(s, q, kv, 3, True, "a")) == pytest.approx(2 * 3 * t * (q + 2 * kv) * b)
    # the loss over 16 tokens x a vocab slice of 100: fp32, 38 bytes a logit forward, 14 backward
    assert lk.loss_kernels(t, 100, False)[0].bytes == pytest.approx(t * 100 * 38)
    assert lk.loss_kernels(t, 100, True)[0].bytes == pytest.approx(t * 100 * 14)
    # the embedding: gather; backward zero-fill, scatter-add, fp32 main_grad accumulation
    assert sum(k.bytes for k in lk.embedding_kernels(t, 100, h, b, False)) == pytest.approx(2 * t * h * b)
    assert sum(k.bytes for k in lk.embedding_kernels(t, 100, h, b, True)) == \
        pytest.approx(100 * h * b + 3 * t * h * b + 100 * h * (b + 8))


def test_a_moe_layer_keeps_the_dense_mlp_blocks_norm_and_residual_add():
    """Megatron's TransformerLayer runs `pre_mlp_layernorm` and `mlp_bda` around a MoELayer as around
    a dense MLP: the MoE side moves the dense MLP block's norm and residual-add bytes, without its
    activation (the experts' SwiGLU is the expert block's)."""
    s = lk.LayerShape(tokens=16, tp=2, hidden=64, act_bytes=2, sms=4)
    dense_f = [k.bytes for k in lk.mlp_block(s, 128, True, False, "m")]
    dense_b = [k.bytes for k in lk.mlp_block(s, 128, True, True, "m")]
    assert [k.bytes for k in lk.moe_mlp_side(s, False, "m")] == pytest.approx([dense_f[0], dense_f[2]])
    assert [k.bytes for k in lk.moe_mlp_side(s, True, "m")] == pytest.approx([dense_b[0], dense_b[2]])


@pytest.mark.parametrize("recompute", ["none", "full", "selective-op"])
def test_micro_batch_prices_the_moe_layers_norm_and_residual_add(recompute: str):
    """Every expert block of Qwen3-30B-A3B carries the layer's pre-MLP norm and residual add on top
    of `_expert_block`'s router, grouped GEMMs and passes (forward, and backward with its redo
    under selective-op recompute; under full recompute the backward runs the whole forward block
    again first, `Block.recompute`); the attention block is unchanged."""
    from sim.model_work import _expert_block

    spec, arch = resolve_model("qwen3-30b-a3b", 1)
    rate = DeviceRate.from_profile(load_profile("h100-sxm"))
    t, ep = 4096, 16
    work = micro_batch_work(spec, 1, t, 4096, arch.q_dim, arch.hidden, arch.vocab, rate, recompute=recompute,
                            experts=arch.moe, ep=ep, kv_dim=arch.kv_dim)
    layer = work.layer_ids[0]
    fwd, bwd = work.forward[0][-1], work.backward[0][0]
    assert fwd.name == bwd.name == f"layer {layer}.experts"
    params = [p for p in spec.params if p.layer == layer and p.role.name in ("EXPERT", "ROUTER")
              and (p.matrix_shape or len(p.shape) == 2)]
    bare_f, bare_b = _expert_block(fwd.name, params, float(t), arch.hidden, arch.moe, rate, "bf16", recompute, ep=ep)
    s = lk.LayerShape(tokens=t, tp=1, hidden=arch.hidden, act_bytes=2)
    side_f = sum(rate.kernel_seconds(k) for k in lk.moe_mlp_side(s, False, fwd.name))
    side_b = sum(rate.kernel_seconds(k) for k in lk.moe_mlp_side(s, True, fwd.name))
    redo = side_f if recompute == "selective-op" else 0.0
    assert side_f > 0 and side_b > side_f
    assert fwd.middle_s == pytest.approx(bare_f.middle_s + side_f)
    assert bwd.middle_s == pytest.approx(bare_b.middle_s + side_b + redo)
    assert bwd.recompute == (fwd if recompute == "full" else None)


def test_micro_batch_prices_the_layer_kernels_at_achievable_bandwidth():
    """The MLP block's middle (no attention core) is exactly its three passes at the profile's
    achievable bandwidth, each paying one launch."""
    spec, arch = resolve_model("qwen3-0.6b", 1)
    rate = DeviceRate.from_profile(load_profile("h100-sxm"))
    t = 1024
    work = micro_batch_work(spec, 1, t, 1024, arch.q_dim, arch.hidden, arch.vocab, rate, kv_dim=arch.kv_dim)
    mlp = work.forward[0][1]
    bw = 3.35e12 * 0.9
    h, f = arch.hidden, arch.ffn
    want = sum(x / bw + rate.launch_s for x in (t * h * 2 * 2 + t * 4, t * 3 * f * 2, t * h * 3 * 2))
    assert mlp.middle_s == pytest.approx(want)


# --- achievable HBM bandwidth in the profiles -------------------------------------------------


def test_profiles_carry_a_sourced_hbm_efficiency():
    for name, want in (("h100-sxm", 0.9), ("h200", 0.8865), ("a100-sxm", 0.753)):
        p = load_profile(name)
        assert p.gpu.hbm_efficiency == want
        assert any(src.startswith("gpu.hbm_efficiency") and "https://" in src for src in p.sources)
        rate = DeviceRate.from_profile(p)
        k = elementwise_kernel("copy", 10**9, 1, 8)
        assert rate.kernel_seconds(k) == pytest.approx(8e9 / (p.gpu.hbm_bytes_per_s * want) + rate.launch_s)


def test_hbm_efficiency_is_optional_and_a_fraction():
    raw = json.loads((resources.files("canzona") / "profiles" / "h100-sxm.json").read_text())
    del raw["gpu"]["hbm_efficiency"]
    assert profile_from_dict(raw).gpu.hbm_efficiency == 1.0  # the datasheet without a measurement
    raw["gpu"]["hbm_efficiency"] = 1.2
    with pytest.raises(SpecError, match="hbm_efficiency"):
        profile_from_dict(raw)


def test_the_loops_are_converted_on_the_measured_gpu_only():
    """H100 SXM ran the loops and H200 shares its die: their attention is priced at their
    sustained clock; on the A100 the fractions are a proxy, checked against its own power-limited
    measurements (canzona.attention_checks), and used as they are."""
    from canzona.attention_rate import measured_on

    assert measured_on("h100-sxm") and measured_on("h200") and not measured_on("a100-sxm")
    spec, arch = resolve_model("qwen3-1.7b")
    for name, converted in (("h100-sxm", True), ("a100-sxm", False)):
        rate = DeviceRate.from_profile(load_profile(name))
        assert rate.gemm_model is not None and rate.gemm_model.sustained_clock < 1.0  # both power-limited
        work = micro_batch_work(spec, 1, 4096, 4096, arch.q_dim, arch.hidden, arch.vocab, rate, kv_dim=arch.kv_dim)
        cool = replace(rate, gemm_model=replace(rate.gemm_model, sustained_clock=1.0))
        free = micro_batch_work(spec, 1, 4096, 4096, arch.q_dim, arch.hidden, arch.vocab, cool, kv_dim=arch.kv_dim)
        grown = work.forward[0][0].middle_s - free.forward[0][0].middle_s
        assert (grown > 0.0) is converted and grown >= 0.0
