"""Megatron-core's unfused RoPE and SwiGLU (sim/unfused_kernels.py; Workload's apply_rope_fusion and
bias_activation_fusion): bytes counted here by hand, op by op, from Megatron's code, where they
enter the simulation and the memory model, and the published row whose recipe leaves them off."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from canzona.cost import DeviceRate
from canzona.errors import SpecError
from canzona.hardware import load_profile
from canzona.memory import LayerDims, MemorySetup, layer_activation_bytes
from canzona.models import resolve_model
from sim import layer_kernels as lk
from sim import published
from sim import unfused_kernels as uk
from sim.model_work import micro_batch_work
from sim.workload import Workload

RUNS, SOURCES = published.load()
RAW = json.loads(published.PUBLISHED_RUNS.read_text())
QWEN3_8B_ROW = "qwen3-8b-16xh100-mb"


def test_unfused_bytes_by_hand():
    """16 tokens, q 64 wide, k 16, head dim 8 over 16 positions, an MLP 2 x 32 wide, bf16 (b = 2)."""
    t, q, k, f, b, d, pos = 16, 64, 16, 32, 2, 8, 16
    s = lk.LayerShape(tokens=t, tp=1, hidden=64, act_bytes=b)
    fwd = uk.rope(s, q, k, False, "a", positions=pos, head_dim=d)
    bwd = uk.rope(s, q, k, True, "a", positions=pos, head_dim=d)
    # per tensor: cos and sin, each function (4+4), * mscale (4+4), .to(bf16) (4+2) over pos x d
    table = 2 * pos * d * (8 + 8 + 6)
    # t * cos 2+2, -x2 over half 2, cat 2+2, * sin 2+2, + 2+2+2, cat with the empty t_pass 2+2
    assert sum(x.bytes for x in fwd) == pytest.approx(2 * table + t * (q + k) * (4 + 2 + 4 + 4 + 6 + 4))
    assert len(fwd) == 2 * 12
    # backward: * sin 4, neg 2, chunk's cat 4, * cos 4, the two paths added 6, t_pass zeros 2 and added 6
    assert sum(x.bytes for x in bwd) == pytest.approx(t * (q + k) * (4 + 2 + 4 + 4 + 6 + 2 + 6))
    assert len(bwd) == 2 * 7
    # SwiGLU over 2f columns: silu 2+2, + 0.0 2+2, product 2+2+2; backward the product's two
    # gradients 6 each, silu's 6, chunk's cat of both halves 4 + 4
    assert sum(x.bytes for x in uk.swiglu(s, 2 * f, False, "m")) == pytest.approx(t * f * 14)
    assert sum(x.bytes for x in uk.swiglu(s, 2 * f, True, "m")) == pytest.approx(t * f * (18 + 8))
    # the fused kernels they replace move 4 / 4 (RoPE) and 6 / 10 (SwiGLU) bytes an element
    assert lk.rope(s, q, k, "a").bytes == pytest.approx(t * (q + k) * 4)
    assert lk.activation(s, 2 * f, True, False, "m").bytes == pytest.approx(t * f * 6)


def _work(**fusions):
    spec, arch = resolve_model("qwen3-0.6b")
    rate = DeviceRate.from_profile(load_profile("h100-sxm"))
    return micro_batch_work(spec, 1, 4096, 4096, arch.q_dim, arch.hidden, arch.vocab, rate,
                            kv_dim=arch.kv_dim, **fusions), rate, arch


def test_unfused_kernels_enter_the_layer():
    """Each option off adds exactly its kernels' seconds beyond the fused kernel's, to the
    attention block (RoPE) or the MLP block (SwiGLU) of every layer, forward and backward."""
    fused, rate, arch = _work()
    rope_off, _, _ = _work(apply_rope_fusion=False)
    glu_off, _, _ = _work(bias_activation_fusion=False)
    s = lk.LayerShape(tokens=4096, tp=1, hidden=arch.hidden, act_bytes=2, sms=rate.sms or 132)
    q, kv = arch.q_dim, arch.kv_dim

    def secs(ks):
        return sum(rate.kernel_seconds(k) for k in ks)

    for backward, blocks in ((False, "forward"), (True, "backward")):
        extra_rope = secs(uk.rope(s, q, kv, backward, "x", positions=4096, head_dim=128)) - secs([lk.rope(s, q, kv, "x")])
        extra_glu = secs(uk.swiglu(s, 2 * arch.ffn, backward, "x")) - secs([lk.activation(s, 2 * arch.ffn, True, backward, "x")])
        assert extra_rope > 0 and extra_glu > 0
        for layer_f, layer_r, layer_g in zip(getattr(fused, blocks), getattr(rope_off, blocks), getattr(glu_off, blocks)):
            by = {b.name: b.middle_s for b in layer_f}
            attn = [b for b in layer_r if b.name.endswith(".0")][0]
            mlp = [b for b in layer_g if b.name.endswith(".1")][0]
            assert attn.middle_s - by[attn.name] == pytest.approx(extra_rope)
            assert mlp.middle_s - by[mlp.name] == pytest.approx(extra_glu)
            # the other block does not move
            assert [b.middle_s for b in layer_r if b.name.endswith(".1")] == [by[b.name] for b in layer_f if b.name.endswith(".1")]


def test_unfused_swiglu_saves_two_more_tensors():
    """Megatron's unfused glu keeps the silu output and the offset-added up half for the product's
    backward: 2 e ffn bytes a token more than the fused kernel (split over TP)."""
    dims = LayerDims(layers=28, hidden=1024, q_heads=16, ffn=3072, vocab=151936, kv_heads=8, head_dim=128,
                     gated_mlp=True, dropout=False, qk_norm=True)
    fused = layer_activation_bytes(dims, MemorySetup(seq_len=4096), tp=2)
    unfused = layer_activation_bytes(dims, MemorySetup(seq_len=4096, bias_activation_fusion=False), tp=2)
    assert unfused - fused == pytest.approx(4096 * 2 * 2 * 3072 / 2)
    assert MemorySetup.from_workload(Workload(bias_activation_fusion=False)).bias_activation_fusion is False


def test_checks():
    with pytest.raises(SpecError, match="eager"):
        Workload(kernels="eager", apply_rope_fusion=False)
    with pytest.raises(SpecError, match="true or false"):
        Workload(bias_activation_fusion=0)
    spec, arch = resolve_model("qwen3-30b-a3b")
    rate = DeviceRate.from_profile(load_profile("h100-sxm"))
    with pytest.raises(SpecError, match="experts"):
        micro_batch_work(spec, 1, 4096, 4096, arch.q_dim, arch.hidden, arch.vocab, rate, kv_dim=arch.kv_dim,
                         experts=arch.moe, bias_activation_fusion=False)


def test_published_row_states_what_its_recipe_ran():
    """The Qwen3-8B Megatron-Bridge row runs both unfused (its recipe and bridge set neither option:
    Megatron's defaults) and is simulated so; a fused setting is refused without a recipe source;
    turning both back on gives the fused simulation back, slower unfused by both effects."""
    run = next(r for r in RUNS if r.id == QWEN3_8B_ROW)
    assert run.apply_rope_fusion is False and run.bias_activation_fusion is False
    wl = run.sim_config().workload
    assert not wl.apply_rope_fusion and not wl.bias_activation_fusion
    others = [r for r in RUNS if r.id != QWEN3_8B_ROW]
    assert all(r.sim_config().workload.apply_rope_fusion and r.sim_config().workload.bias_activation_fusion
               for r in others)
    raw = next(r for r in RAW["rows"] if r["id"] == QWEN3_8B_ROW)
    with pytest.raises(SpecError, match="recipe_source"):
        published.parse_run({**raw, "recipe_source": ""}, SOURCES, "row")
    with pytest.raises(SpecError, match="apply_rope_fusion"):
        published.parse_run({**raw, "apply_rope_fusion": "no"}, SOURCES, "row")
    fused = published.compare_run(replace(run, apply_rope_fusion=None, bias_activation_fusion=None))
    rope = published.compare_run(replace(run, bias_activation_fusion=None))
    both = published.compare_run(run)
    assert fused.iteration_s < rope.iteration_s < both.iteration_s
    assert both.memory_bytes > fused.memory_bytes and both.fits


def test_cli_options():
    """`canzona simulate --no-apply-rope-fusion --no-bias-activation-fusion` runs the unfused kernels
    (slower than the default fused ones); with eager kernels either is one error line."""
    from tests.cli_helpers import error_line, invoke

    base = ("simulate", "--model", "qwen3-0.6b", "--gpus", 8, "--tp", 1, "--optimizer", "adamw", "--global-batch", 8,
            "--json")
    fused = json.loads(invoke(*base).stdout)
    unfused = json.loads(invoke(*base, "--no-apply-rope-fusion", "--no-bias-activation-fusion").stdout)
    assert unfused["iteration_time_s"] > fused["iteration_time_s"]
    error_line(invoke(*base, "--kernels", "eager", "--no-bias-activation-fusion"), "bias_activation_fusion",
               "unfused already")


def test_fsdp_runs_them_too():
    """The FSDP simulation prices the same unfused kernels (a Megatron-FSDP recipe may leave them off)."""
    from sim.simulate import SimConfig, simulate

    base = SimConfig(model="qwen3-0.6b", gpus=8, tp=1, optimizer="adamw", fsdp=True, fsdp_impl="megatron-fsdp",
                     workload=Workload(global_batch=8))
    off = replace(base, workload=Workload(global_batch=8, apply_rope_fusion=False, bias_activation_fusion=False))
    assert simulate(off).iteration_time_s > simulate(base).iteration_time_s
