"""PyTorch's eager kernels of a Llama layer (sim/eager_kernels.py, `Workload.kernels`) and FSDP2's
copies on the compute stream (sim/fsdp_copies.py, `SimConfig.fsdp_impl`): bytes counted here by
hand, op by op, from torchtitan's model code, and where they enter the simulation."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from canzona.cost import DeviceRate, elementwise_kernel
from canzona.errors import SpecError
from canzona.hardware import load_profile
from canzona.models import resolve_model
from sim import eager_kernels as ek
from sim import layer_kernels as lk
from sim import published
from sim.fsdp_copies import FSDP2, MEGATRON_FSDP, copy_in_bytes, copy_out_bytes
from sim.model_work import micro_batch_work
from sim.published import DATA_DIR
from sim.simulate import SimConfig, simulate
from sim.workload import Workload
from tests.cli_helpers import error_line, invoke

RUNS, SOURCES = published.load()
RAW = json.loads(published.PUBLISHED_RUNS.read_text())

LLAMA3_8B = str(DATA_DIR / "models" / "llama3-8b.json")  # the published rows' spec file


def test_eager_layer_bytes_by_hand():
    """One Llama layer, hidden 64, q 64, kv 16 (GQA, 4 query heads a KV head), ffn 128, 16 tokens,
    bf16, TP 1: every op of torchtitan's layer counted by hand (b = 2, fp32 = 4)."""
    t, h, q, kv, f, b = 16, 64, 64, 16, 128, 2
    s = lk.LayerShape(tokens=t, tp=1, hidden=h, act_bytes=b)
    # RMSNorm forward: x.float() 2+4, pow 4+4, mean 4, * rsqrt 4+4, type_as 4+2, * weight 2+2
    norm_f = t * h * ((2 + 4) + 8 + 4 + 8 + (4 + 2) + 4)
    # backward: * weight (dx 2+2, dw 2+2+2 and its row sum 2), type_as 2+4, * rsqrt (4+4 and 4+4+4 +
    # sum 4), mean's expand 4, pow (pow(1) 4+4, * 2 4+4, * grad 4+4+4), the two x grads added 4+4+4,
    # x.float()'s 4+2
    norm_b = t * h * (4 + 8 + 6 + 8 + 16 + 4 + 8 + 8 + 12 + 12 + 6)
    assert norm_f == t * h * 36 and norm_b == t * h * 92
    rope = t * (q + kv) * ((2 + 4) + (4 + 4) + (4 + 2))  # cast, complex multiply, cast back
    repeat = 2 * t * kv * (1 + 4) * b  # K and V: read once, written 4 times
    add = 3 * t * h * b
    attn_f = [k.bytes for k in ek.attention_block(s, q, kv, False, "a")]
    attn_b = [k.bytes for k in ek.attention_block(s, q, kv, True, "a")]
    assert attn_f == pytest.approx([norm_f, rope, repeat / 2, repeat / 2, add])  # the output transpose: no copy
    assert attn_b == pytest.approx([add, repeat / 2, repeat / 2, rope, norm_b])
    mlp_f = [k.bytes for k in ek.mlp_block(s, 2 * f, True, False, "m")]
    mlp_b = [k.bytes for k in ek.mlp_block(s, 2 * f, True, True, "m")]
    swiglu_f = t * f * ((2 + 2) + (2 + 2 + 2))  # silu, then the product
    swiglu_b = t * f * (6 + 6 + 6)  # the product's two gradients, silu's backward
    assert mlp_f == pytest.approx([norm_f, swiglu_f, add]) and mlp_b == pytest.approx([add, swiglu_b, norm_b])
    # without GQA no repeat_kv copies
    assert len(ek.attention_block(s, q, q, False, "a")) == 3
    # the loss over a vocab of 100: cast 2+4, log_softmax 3 reads + 1 write of fp32; backward zeros 4,
    # log_softmax's backward 4 + 4+4+4, the cast back 4+2
    assert ek.loss_kernels(t, 100, False)[0].bytes == pytest.approx(t * 100 * 22)
    assert ek.loss_kernels(t, 100, True)[0].bytes == pytest.approx(t * 100 * 26)
    # every eager kernel moves at least the fused one's bytes
    assert sum(attn_f) + sum(mlp_f) > sum(k.bytes for k in lk.attention_block(s, q, kv, False, "a")
                                           + lk.mlp_block(s, 2 * f, True, False, "m"))


def test_eager_kernels_enter_the_micro_batch_and_its_recompute():
    spec, arch = resolve_model(LLAMA3_8B, 1)
    rate = DeviceRate.from_profile(load_profile("a100-sxm"))
    t = 8192

    def work(kernels: str, recompute: str = "none"):
        return micro_batch_work(spec, 1, t, t, arch.q_dim, arch.hidden, arch.vocab, rate, recompute=recompute,
                                kv_dim=arch.kv_dim, kernels=kernels)

    fused, eager = work("fused"), work("eager")
    s = lk.LayerShape(tokens=t, tp=1, hidden=arch.hidden, act_bytes=2, sms=rate.sms)
    f = arch.ffn

    def run(ks):
        return sum(rate.kernel_seconds(k) for k in ks)

    # the MLP block's middle is exactly its kernels: eager's in place of the fused ones
    assert eager.forward[0][1].middle_s - fused.forward[0][1].middle_s == pytest.approx(
        run(ek.mlp_block(s, 2 * f, True, False, "m")) - run(lk.mlp_block(s, 2 * f, True, False, "m")))
    assert eager.head_backward_s - fused.head_backward_s == pytest.approx(
        run(ek.loss_kernels(t, arch.vocab, True)) - run(lk.loss_kernels(t, arch.vocab, True)))
    # selective-op recomputes the forward's memory-bound kernels in backward: eager's, not the fused ones
    redo_eager = work("eager", "selective-op").backward[0][0].middle_s - eager.backward[0][0].middle_s
    redo_fused = work("fused", "selective-op").backward[0][0].middle_s - fused.backward[0][0].middle_s
    assert redo_eager - redo_fused == pytest.approx(
        run(ek.mlp_block(s, 2 * f, True, False, "m")) - run(lk.mlp_block(s, 2 * f, True, False, "m")))
    with pytest.raises(SpecError, match="unknown kernels"):
        work("compiled")
    qwen, qarch = resolve_model("qwen3-8b", 1)  # per-head q / k norms: not modelled eager
    with pytest.raises(SpecError, match="dense Llama layers"):
        micro_batch_work(qwen, 1, 1024, 1024, qarch.q_dim, qarch.hidden, qarch.vocab, rate, kernels="eager")
    with pytest.raises(SpecError, match="unknown kernels"):
        Workload(kernels="jit")


def test_fsdp2_copies_by_hand():
    n = 1000
    assert copy_out_bytes(FSDP2, n, 2) == n * (2 + 2)  # read the flat buffer, write the parameters
    assert copy_in_bytes(FSDP2, n, 2, 4) == n * (2 + 4)  # read bf16 gradients, write the fp32 input
    assert copy_in_bytes(FSDP2, n, 2, 2) == n * (2 + 2)
    assert copy_out_bytes(MEGATRON_FSDP, n, 2) == copy_in_bytes(MEGATRON_FSDP, n, 2, 4) == 0
    with pytest.raises(SpecError, match="unknown fsdp implementation"):
        copy_out_bytes("fsdp1", n, 2)


def test_fsdp2_copies_run_on_the_compute_stream():
    base = SimConfig(model=LLAMA3_8B, gpus=8, tp=1, optimizer="adamw", fsdp=True, hardware="a100-sxm",
                     workload=Workload(seq_len=2048, global_batch=8, micro_batch=1), gpu_variability=0.0)
    fsdp2, mfsdp = simulate(base), simulate(replace(base, fsdp_impl=MEGATRON_FSDP))
    copies = [s for s in fsdp2.spans if "copy-in" in s.name]
    spec, _ = resolve_model(LLAMA3_8B, 1)
    layer = sum(p.numel for p in spec.params if p.layer == 0)
    rate = DeviceRate.from_profile(load_profile("a100-sxm"))
    want = rate.kernel_seconds(elementwise_kernel("c", layer, 0.0, (2 + 4)))  # bf16 in, fp32 reduce input
    assert len(copies) == 32 + 1 and all(s.kind == "compute" for s in copies)
    # a layer's copy-in: its bytes at the achievable bandwidth, slower only while NCCL kernels hold SMs
    # (sim.comm_sms: 16 of the A100's 108 while a collective runs, 108 / 92 = 1.17)
    for c in copies[:-1]:
        assert want * (1 - 1e-9) <= c.end - c.start <= want * 108 / 92 * (1 + 1e-9)
    assert not any("copy" in s.name for s in mfsdp.spans)
    assert fsdp2.iteration_time_s > mfsdp.iteration_time_s
    with pytest.raises(SpecError, match="unknown fsdp implementation"):
        simulate(replace(base, fsdp_impl="zero3"))


def test_bad_settings_are_one_line_errors():
    base = ("simulate", "--model", "qwen3-0.6b", "--gpus", 8, "--tp", 1, "--optimizer", "adamw", "--global-batch", 8)
    error_line(invoke(*base, "--kernels", "compiled"), "unknown kernels 'compiled'")
    error_line(invoke(*base, "--fsdp", "--fsdp-impl", "fsdp1"), "unknown fsdp implementation 'fsdp1'")
    # qwen3's per-head q / k norms are not modelled eager
    error_line(invoke(*base, "--kernels", "eager"), "dense Llama layers")


def test_published_rows_record_kernels_and_fsdp_impl():
    rows = {r.id: r for r in RUNS}
    for rid in ("llama3-8b-64xa100-torchtitan", "llama3-70b-64xa100-torchtitan"):
        assert rows[rid].kernels == "eager" and rows[rid].fsdp_impl == FSDP2
        assert rows[rid].sim_config().workload.kernels == "eager" and rows[rid].sim_config().fsdp_impl == FSDP2
    assert rows["llama3-8b-8xh100-mb25.11-fp8"].fsdp_impl == MEGATRON_FSDP
    assert rows["qwen3-30b-a3b-8xh100-automodel"].fsdp_impl == FSDP2
    # every other row: the defaults, fused kernels (Megatron / Transformer Engine)
    assert all(r.kernels == "fused" for r in RUNS if "torchtitan" not in r.id)
    raw = next(r for r in RAW["rows"] if r["id"] == "qwen3-8b-16xh100-mb")
    with pytest.raises(SpecError, match="kernels must be one of"):
        published.parse_run({**raw, "kernels": "jit"}, SOURCES, "row")
    with pytest.raises(SpecError, match="on an fsdp row"):
        published.parse_run({**raw, "fsdp_impl": MEGATRON_FSDP}, SOURCES, "row")
    with pytest.raises(SpecError, match="needs recipe_source"):
        published.parse_run({**{k: v for k, v in raw.items() if k != "recipe_source"}, "grad_reduce_in_fp32": None,
                             "cross_entropy_loss_fusion": None, "cross_entropy_fusion_impl": None,
                             "store_param_remainders": None, "kernels": "eager"}, SOURCES, "row")
