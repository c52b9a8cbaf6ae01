"""The named userbuffers configurations of Transformer Engine's TP overlap (`sim.userbuffers`,
`RunOptions.tp_comm_overlap_cfg`, docs/design.md §9.3): every entry parses and maps to the SMs the
simulator charges (`sim.comm_sms.TPOverlapSMs`), the default is what ran before (bit for bit),
fewer SMs never make a run slower, and a configuration is refused where it changes nothing."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from canzona.cost import (
    DeviceRate,
    chunked_gemm_kernel,
    elementwise_kernel,
    gemm_kernel,
)
from canzona.errors import SpecError
from canzona.hardware import load_profile
from canzona.models import resolve_model
from sim.comm_sms import TPOverlapSMs
from sim.fp8 import FP8Setup
from sim.model_work import micro_batch_work
from sim.options import RunOptions
from sim.search import time_floor
from sim.simulate import SimConfig, simulate
from sim.userbuffers import (
    BULK,
    DEFAULT_UB_CONFIG,
    PIPELINE,
    RING_EXCHANGE,
    UB_CONFIGS,
    UB_STREAMS,
    GemmOverlap,
    UserbuffersConfig,
    block_overlaps,
    gemm_chunks,
)
from sim.workload import Workload

FP8_405B = "userbuffers_fp8_h100_h16384_tp8_cp2_mbs1_seqlen8192"
BF16_405B = "userbuffers_bf16_h100_h16384_tp8_cp2_mbs1_seqlen8192"
FP8_70B = "userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192"
LAUNCHER_BF16 = "ub_cfg_h100_h8192_tp4_mbs1_seqlen8192"
LAUNCHER_405B = "ub_cfg_h100_bf16_h16384_tp8_cp2_mbs1_seqlen8192"

# a small layout whose TP exchanges the overlap hides (TP 4 inside a node)
CFG = SimConfig(model="qwen3-0.6b", gpus=8, tp=4, optimizer="adamw", workload=Workload(seq_len=1024, global_batch=8),
                options=RunOptions(overlap_param_gather=False))


def _with(cfg: SimConfig, name: str) -> SimConfig:
    return replace(cfg, options=replace(cfg.options, tp_comm_overlap_cfg=name))


def _timed(result) -> dict:
    """What a run computed, without the options it echoes."""
    out = result.to_dict()
    del out["options"]
    return out


@pytest.mark.parametrize("name", sorted(UB_CONFIGS))
def test_every_entry_parses_and_maps_to_the_sms_the_simulator_charges(name):
    config = UB_CONFIGS[name]
    assert config.name == name
    assert config.source.startswith("https://github.com/") and re.search(r"/blob/[0-9a-f]{40}/", config.source)
    attention, mlp = block_overlaps(name)
    for sms, fprop, dgrad, wgrad in ((attention, config.proj_fprop, config.qkv_dgrad, config.qkv_wgrad),
                                     (mlp, config.fc2_fprop, config.fc1_dgrad, config.fc1_wgrad)):
        assert isinstance(sms, TPOverlapSMs)
        assert (sms.backward_gather, sms.backward_reduce_scatter) == (dgrad.num_sm, wgrad.num_sm)
        assert sms.forward_sm_margin == fprop.set_sm_margin
        if fprop.method == PIPELINE:  # a kernel on num_sm SMs, the GEMM in num_splits chunks
            assert (sms.forward_reduce_scatter, sms.forward_splits) == (fprop.num_sm, fprop.num_splits)
        else:  # copy-engine sends, the GEMM in TP chunks; num_sm only a margin
            assert fprop.method == RING_EXCHANGE and sms.forward_splits is None
            assert sms.forward_reduce_scatter == (fprop.num_sm if fprop.set_sm_margin else 0)
    for gather in (config.qkv_fprop, config.proj_dgrad, config.fc1_fprop, config.fc2_dgrad):
        assert gather.method == RING_EXCHANGE and not gather.set_sm_margin


def test_the_figures_are_the_sources():
    """Spot checks against Megatron-Bridge's comm_overlap.py (0685ff5d) and the launcher's yaml."""
    a, m = block_overlaps(DEFAULT_UB_CONFIG)
    assert (a.forward_reduce_scatter, a.backward_gather, a.backward_reduce_scatter, a.forward_splits) == (24, 4, 24, 4)
    assert (m.forward_reduce_scatter, m.backward_gather, m.backward_reduce_scatter, m.forward_splits) == (16, 2, 4, 4)
    a, m = block_overlaps(FP8_405B)  # Llama 3.1 405B's FP8 recipe: ring-exchange reduce-scatters, 1 SM margin
    assert (a.forward_reduce_scatter, a.backward_gather, a.backward_reduce_scatter, a.forward_splits) == (1, 2, 24, None)
    assert (m.forward_reduce_scatter, m.backward_gather, m.backward_reduce_scatter, m.forward_splits) == (1, 2, 2, None)
    assert a.forward_sm_margin and m.forward_sm_margin
    a, m = block_overlaps(BF16_405B)
    assert (a.forward_reduce_scatter, m.forward_reduce_scatter, a.forward_splits) == (24, 8, 4)
    assert block_overlaps(LAUNCHER_BF16) == block_overlaps(DEFAULT_UB_CONFIG)  # the launcher's: the same figures
    # recorded, not priced: the launcher's FP8 buffers change no SM
    assert UB_CONFIGS["ub_cfg_h100_fp8_h8192_tp4_mbs1_seqlen8192"].proj_fprop.fp8_buf
    assert block_overlaps("ub_cfg_h100_fp8_h8192_tp4_mbs1_seqlen8192") == block_overlaps(DEFAULT_UB_CONFIG)


def test_malformed_entries_are_refused():
    with pytest.raises(SpecError, match="num_splits"):
        GemmOverlap(method=PIPELINE, num_sm=8)
    with pytest.raises(SpecError, match="num_splits"):
        GemmOverlap(method=BULK, num_sm=8, num_splits=4)
    with pytest.raises(SpecError, match="unknown userbuffers overlap method"):
        GemmOverlap(method="atomic", num_sm=8)
    with pytest.raises(SpecError, match="aggregate"):
        GemmOverlap(method=BULK, num_sm=8, aggregate=True)
    good = UB_CONFIGS[DEFAULT_UB_CONFIG]
    with pytest.raises(SpecError, match="qkv_fprop must be a ring exchange without set_sm_margin"):
        replace(good, qkv_fprop=GemmOverlap(method=RING_EXCHANGE, num_sm=1, set_sm_margin=True))
    with pytest.raises(SpecError, match="fc1_wgrad must be a bulk"):
        replace(good, fc1_wgrad=GemmOverlap(method=PIPELINE, num_sm=4, num_splits=4))
    with pytest.raises(SpecError, match="fc2_fprop must be a pipeline or ring-exchange"):
        replace(good, fc2_fprop=GemmOverlap(method=BULK, num_sm=4))
    assert isinstance(good, UserbuffersConfig)


def test_the_default_is_the_run_before_bit_for_bit():
    """Naming the default, or a configuration of the same figures, changes no computed figure (the
    golden scale tests hold the default to the figures recorded before the registry)."""
    base = simulate(CFG)
    assert CFG.options.tp_comm_overlap_cfg == DEFAULT_UB_CONFIG
    assert simulate(_with(CFG, DEFAULT_UB_CONFIG)).to_dict() == base.to_dict()
    assert _timed(simulate(_with(CFG, LAUNCHER_BF16))) == _timed(base)


def test_fewer_sms_make_no_run_slower():
    """The 405B's bf16 configuration holds at most the default's SMs in every GEMM (fewer in three),
    the same chunks and margins: at the same layout it is no slower, and its forward and backward
    show the SMs given back."""
    base, fewer = simulate(CFG), simulate(_with(CFG, BF16_405B))
    assert fewer.iteration_time_s <= base.iteration_time_s
    assert fewer.forward_backward_s < base.forward_backward_s  # the SMs do show


def test_a_ring_exchange_reduce_scatter_runs_in_tp_chunks_on_a_one_sm_margin(monkeypatch):
    """Megatron-Bridge's FP8 configurations at TP 8: the down projection loses one SM, not 16 (as
    a pipeline of as many chunks does), and the reduce-scatter's last chunk, which follows it, is
    one of 8 (TP), not of 4 (num_splits)."""
    tp8 = replace(CFG, tp=8).at_one_rank_defaults()  # DP 1: no parameter gather to overlap or not
    default = UB_CONFIGS[DEFAULT_UB_CONFIG]
    eight = replace(default, name="test-pipeline-8", fc2_fprop=replace(default.fc2_fprop, num_splits=8))
    monkeypatch.setitem(UB_CONFIGS, eight.name, eight)

    def spans(cfg: SimConfig):
        return {s.name: s for s in simulate(cfg).spans if s.rank == 0 and s.phase == "A"}

    ring, pipeline, pipeline8 = spans(_with(tp8, FP8_70B)), spans(tp8), spans(_with(tp8, eight.name))

    def took(run, name: str) -> float:
        return run[f"mb0 fwd layer 0.1 {name}"].end - run[f"mb0 fwd layer 0.1 {name}"].start

    assert took(ring, "last") < took(pipeline8, "last")
    assert took(ring, "reduce-scatter (last chunk)") < took(pipeline, "reduce-scatter (last chunk)")
    assert ring["mb0 fwd layer 0.1 reduce-scatter (last chunk)"].start >= ring["mb0 fwd layer 0.1 last"].end - 1e-12
    # the ring's last step: the received TP partial sums of the rank's slice reduced on the compute
    # stream once the last chunk is in (TE's reduce_bf16): 8 slices read, one written, bf16
    total = ring["mb0 fwd layer 0.1 reduce-scatter sum"]
    assert total.start >= ring["mb0 fwd layer 0.1 reduce-scatter (last chunk)"].end - 1e-12
    rate = DeviceRate.from_profile(load_profile(tp8.hardware))
    numel = 1024 * resolve_model(tp8.model)[1].hidden // 8
    alone = rate.kernel_seconds(elementwise_kernel("sum", numel, 7, 9 * 2))
    assert total.end - total.start == pytest.approx(alone * tp8.slowdown(load_profile(tp8.hardware), tp8.gpus))
    assert not any(n.endswith("reduce-scatter sum") for n in pipeline)  # a pipeline kernel reduces as it sends


def test_the_search_floor_stays_below_the_run():
    model = resolve_model(CFG.model)
    hw = load_profile(CFG.hardware)
    for name in (FP8_70B, BF16_405B):
        cfg = _with(CFG, name)
        assert time_floor(cfg, model, DeviceRate.from_profile(hw), hw) <= simulate(cfg).iteration_time_s


def test_a_configuration_is_refused_where_it_changes_nothing():
    with pytest.raises(SpecError, match="unknown userbuffers config .userbuffers_bf16_h100_h9999.; choose one of .*" + FP8_405B):
        RunOptions(tp_comm_overlap_cfg="userbuffers_bf16_h100_h9999").check()
    with pytest.raises(SpecError, match="changes nothing with --no-tp-comm-overlap"):
        RunOptions(tp_comm_overlap=False, tp_comm_overlap_cfg=FP8_405B).check()
    RunOptions(tp_comm_overlap=False).check()  # the default name: nothing was set
    with pytest.raises(SpecError, match="changes nothing at --tp 1"):
        replace(_with(CFG, FP8_405B), tp=1).check()
    with pytest.raises(SpecError, match="not under --fsdp"):
        replace(_with(CFG, FP8_405B), fsdp=True).check()


def test_overlapped_gemms_run_in_the_chunks_transformer_engine_cuts_them_into():
    """TE issues a ring exchange's GEMM as one cuBLAS call per TP rank's share of the tokens (two
    shares a call under `aggregate`), a `pipeline`'s as `num_splits` calls; `bulk` overlaps (the
    column GEMMs' backward) run whole. Per block: forward column GEMMs, forward row GEMMs, backward
    row data-gradient GEMMs."""
    assert UB_STREAMS == 3  # TE's _NUM_MAX_UB_STREAMS
    assert gemm_chunks(FP8_405B, 8) == {"attention": (8, 8, 8, False), "mlp": (8, 8, 8, False)}
    # aggregate; 4 splits, each of the output columns
    assert gemm_chunks(LAUNCHER_405B, 8) == {"attention": (4, 4, 4, True), "mlp": (4, 4, 4, True)}
    assert gemm_chunks(DEFAULT_UB_CONFIG, 4) == {"attention": (4, 4, 4, True), "mlp": (4, 4, 4, True)}
    assert gemm_chunks(FP8_70B, 4) == {"attention": (4, 4, 4, False), "mlp": (4, 4, 4, False)}


def test_chunked_gemms_share_the_waves_three_at_a_time():
    """Llama 3.1 405B's MLP at TP 8, 4096 tokens a rank (sequence 8192 over CP 2): under
    Megatron-Bridge's FP8 configuration each overlapped GEMM runs as 8 chunks of 512 rows, three at
    at most on TE's streams, slower than the whole GEMM; the backward's
    weight-gradient GEMMs and the column GEMMs' data gradients (bulk overlaps) are unchanged."""
    spec, arch = resolve_model("canzona/data/models/llama3.1-405b.json")
    rate = DeviceRate.from_profile(load_profile("h100-sxm"))
    args = (spec, 8, 8192, 8192, arch.q_dim, arch.hidden, arch.vocab, rate)
    kw = dict(kv_dim=arch.kv_dim, cp=2, head=False)
    whole = micro_batch_work(*args, **kw)
    chunked = micro_batch_work(*args, **kw, overlap_chunks=gemm_chunks(FP8_405B, 8))
    mlp = [p for p in spec.own_matrices() if p.layer == 0 and ".mlp." in p.name]
    column = [p for p in mlp if p.tp_dim == 0]
    row = [p for p in mlp if p.tp_dim == 1]
    assert len(column) == 2 and len(row) == 1
    tokens = 4096

    def priced(params, dgrad=False):
        """The chunking's extra seconds over the whole GEMMs: Megatron runs gate and up as one
        fused GEMM (linear_fc1), which TE chunks."""
        widths = [p.local_shape(8)[1 if dgrad else 0] for p in params]
        k = params[0].local_shape(8)[0 if dgrad else 1]
        n = sum(widths)
        chunks = rate.kernel_seconds(chunked_gemm_kernel("c", tokens // 8, n, k, 8, 3, "bf16"))
        return max(0.0, chunks - rate.kernel_seconds(gemm_kernel("w", tokens, n, k, "bf16")))

    f0, f1 = whole.forward[0][1], chunked.forward[0][1]
    assert f1.first_s == pytest.approx(f0.first_s + priced(column))
    assert f1.last_s == pytest.approx(f0.last_s + priced(row))
    assert f1.middle_s == f0.middle_s
    assert f1.first_s > f0.first_s and f1.last_s > f0.last_s
    b0, b1 = whole.backward[0][0], chunked.backward[0][0]  # the MLP's backward comes first
    out, inp = row[0].local_shape(8)
    wgrad = rate.kernel_seconds(gemm_kernel("w", out, inp, tokens, "bf16"))
    assert b1.first_s == pytest.approx(b0.first_s + priced(row, dgrad=True))
    assert b0.first_s == pytest.approx(rate.kernel_seconds(gemm_kernel("d", tokens, inp, out, "bf16")) + wgrad)
    assert b1.last_s == b0.last_s and b1.middle_s == b0.middle_s
    assert b1.first_s > b0.first_s


def test_aggregate_halves_only_the_all_gathers_chunks():
    """TE's `aggregate` sends two ranks' shares at a time in a ring exchange's all-gather
    (`split_overlap_ag`: tp / 2 GEMM calls); its ring-exchange reduce-scatter (`split_overlap_rs`)
    ignores it and always runs tp calls."""
    ring = replace(UB_CONFIGS[FP8_405B].proj_fprop, aggregate=True)
    both = replace(UB_CONFIGS[LAUNCHER_405B], name="test-aggregate-rs", proj_fprop=ring, fc2_fprop=ring)
    assert both.gemm_chunks(8) == {"attention": (4, 8, 4, False), "mlp": (4, 8, 4, False)}


@pytest.mark.parametrize("model, tp, seq, cp, name", [
    ("canzona/data/models/llama3.1-405b.json", 8, 8192, 2, LAUNCHER_405B),
    ("canzona/data/models/llama3.1-405b.json", 8, 8192, 2, FP8_405B),
    ("canzona/data/models/llama3-70b.json", 4, 8192, 1, FP8_70B),
    ("qwen3-32b", 8, 1024, 1, DEFAULT_UB_CONFIG)])
def test_chunks_never_run_faster_than_the_whole_gemm(model, tp, seq, cp, name):
    """Cutting a GEMM into chunks never makes it faster: a grouped GEMM of the chunks on the
    streams at best fills the waves as the whole GEMM does (before: 4 chunks were priced as 4/3 of
    a group of 3, below the whole GEMM at Llama 3 70B TP 4)."""
    spec, arch = resolve_model(model)
    rate = DeviceRate.from_profile(load_profile("h100-sxm"))
    args = (spec, tp, seq, seq, arch.q_dim, arch.hidden, arch.vocab, rate)
    kw = dict(kv_dim=arch.kv_dim, cp=cp, head=False)
    for dtype in ("bf16", "fp8"):
        fp8 = {} if dtype == "bf16" else dict(fp8=FP8Setup())
        whole = micro_batch_work(*args, **kw, **fp8)
        chunked = micro_batch_work(*args, **kw, **fp8, overlap_chunks=gemm_chunks(name, tp))
        for w, c in zip(whole.forward[0] + whole.backward[0], chunked.forward[0] + chunked.backward[0]):
            assert c.first_s >= w.first_s and c.last_s >= w.last_s, (dtype, w.name)


def test_a_pipeline_reduce_scatter_chunks_the_output_columns():
    """`CommOverlapBase::split_overlap_rs` cuts the weight into `num_splits` row blocks: each call
    is all the tokens times `1 / num_splits` of the output columns (Qwen3-32B's o projection at TP 8,
    1024 tokens, 4 splits: 1024 x 1280 x 1024 chunks, not 256 x 5120 x 1024)."""
    spec, arch = resolve_model("qwen3-32b")
    rate = DeviceRate.from_profile(load_profile("h100-sxm"))
    args = (spec, 8, 1024, 1024, arch.q_dim, arch.hidden, arch.vocab, rate)
    kw = dict(kv_dim=arch.kv_dim, head=False)
    whole = micro_batch_work(*args, **kw).forward[0][0]
    chunked = micro_batch_work(*args, **kw, overlap_chunks=gemm_chunks(DEFAULT_UB_CONFIG, 8)).forward[0][0]
    n, k = arch.hidden, arch.q_dim // 8
    one = rate.kernel_seconds(gemm_kernel("w", 1024, n, k, "bf16"))
    groups = rate.kernel_seconds(chunked_gemm_kernel("c", 1024, n // 4, k, 4, 3, "bf16"))
    assert chunked.last_s == pytest.approx(whole.last_s + max(0.0, groups - one))


def test_chunks_fill_the_waves_together_at_most_three_chunks_a_wave():
    """All the chunks' tiles share the waves, at most 3 chunks' tiles (TE's streams) and the SMs
    in one: Llama 3.1 405B's fused gate/up at TP 8 (512-row chunks of 13312 columns) fills the GPU
    with one chunk, so its 8 chunks run the whole GEMM's waves and pay only the fixed latency of
    each 3 (before: a partly empty last wave for every group of 3); Qwen3-32B's 128-row chunks
    at TP 8 (1024 tokens) fill 3 chunks' tiles a wave, no more: dearer than the whole GEMM,
    cheaper than the 8 run one after another."""
    rate = DeviceRate.from_profile(load_profile("h100-sxm"))
    model = rate.gemm_model
    whole = rate.kernel_seconds(gemm_kernel("w", 4096, 13312, 16384, "fp8"))
    chunks = rate.kernel_seconds(chunked_gemm_kernel("c", 512, 13312, 16384, 8, 3, "fp8"))
    assert chunks == pytest.approx(whole + 2 * model.fixed_s)
    assert chunked_gemm_kernel("c", 512, 13312, 16384, 8, 3, "fp8").chunks == (8, 3)
    whole = rate.kernel_seconds(gemm_kernel("w", 1024, 1280, 5120, "bf16"))
    chunks = rate.kernel_seconds(chunked_gemm_kernel("c", 128, 1280, 5120, 8, 3, "bf16"))
    alone = 8 * rate.kernel_seconds(gemm_kernel("c", 128, 1280, 5120, "bf16"))
    assert whole < chunks < alone


def test_a_forward_without_grad_runs_its_column_gemms_whole():
    """Under full recompute the first forward runs without grad, where TE turns the all-gather's
    userbuffers overlap off (`ub_overlap_ag_fprop and is_grad_enabled`): its column GEMMs run
    whole after an NCCL all-gather; the re-run in the backward, with grad, runs them in chunks."""
    cfg = replace(CFG, options=replace(CFG.options, recompute="full")).at_one_rank_defaults()
    plain = replace(cfg, options=replace(cfg.options, recompute="none"))

    def took(cfg: SimConfig, name: str) -> float:
        span = next(s for s in simulate(cfg).spans if s.rank == 0 and s.phase == "A" and s.name == name)
        return span.end - span.start

    no_grad = took(cfg, "mb0 fwd layer 0.1 first")
    rerun = took(cfg, "mb0 bwd layer 0.1 recompute first")
    chunked = took(plain, "mb0 fwd layer 0.1 first")
    assert rerun == pytest.approx(chunked)
    assert no_grad < chunked
