"""Memory of the published runs (docs/design.md §7.1, §9.6): the runs that ran fit in the model,
its terms for one of them follow from the recipe by hand, and a layout that cannot run still does
not fit. The model is Megatron's as each recipe states it (`grad_reduce_in_fp32`), the GPU's
capacity what CUDA gives a process; nothing is fitted per row."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from canzona.errors import SpecError
from canzona.memory import DEFAULT_FIXED_OVERHEAD, DEFAULT_FRAGMENTATION
from canzona.models import resolve_model
from sim import published
from sim.simulate import SimConfig, simulate
from sim.workload import Workload

RUNS, _ = published.load()
BY_ID = {r.id: r for r in RUNS}
H100_BYTES = round(79.11 * 2**30)  # what CUDA gives a process on an "80 GB" H100 SXM (canzona/profiles/h100-sxm.json)

# Llama 3.1 8B (canzona/data/models/llama3-8b.json): 32 layers, h 4096, 32 query heads of 128,
# 8 KV heads, SwiGLU FFN 14336, vocabulary 128256, untied embeddings
L, H, A, KV, FFN, V = 32, 4096, 32, 1024, 14336, 128256
LLAMA_8B_PARAMS = V * H * 2 + L * (H * (H + 2 * KV) + H * H + 3 * H * FFN + 2 * H) + H


def test_llama_8b_8_gpu_row_terms_by_hand():
    """The DGX Cloud row (8 H100s, TP 1, CP 2, DP 4, sequence 8192, micro-batch 1), every term:
    bf16 weights, fp32 gradient buffers (the recipe leaves Megatron's default), fp32 masters and
    the two AdamW moments sharded over DP x CP = 8 ranks (Megatron's distributed optimizer), no
    reduce-scatter buffer (Megatron reduces into the bucket), and the activations of one
    micro-batch's 4096 tokens a CP rank (TE's saved tensors, flash attention, no dropout)."""
    run = BY_ID["llama3.1-8b-8xh100-dgxc-bf16"]
    assert run.grad_reduce_in_fp32 is None and run.grad_bytes == 4
    r = published.compare_run(run)
    m = r.memory
    n = LLAMA_8B_PARAMS
    assert m["weights"] == pytest.approx(2 * n, rel=1e-4)  # the plan pads buckets by a few elements
    assert m["grads"] == pytest.approx(4 * n, rel=1e-4)
    assert m["master_weights"] == pytest.approx(4 * n / 8, rel=1e-4)
    assert m["adamw_state"] == pytest.approx(8 * n / 8, rel=1e-4)
    assert m["matrix_state"] == 0 and m["reduction"] == 0
    tokens, e = 8192 // 2, 2
    # per token and layer: both norms' inputs and outputs (4eh), Q and K after RoPE, V, the
    # attention output (e(q + 2kv + q)), the gate and up outputs and their product (3e ffn), the
    # log-sum-exp (4 bytes a head)
    layer = e * (4 * H + (H + KV) + KV + H + 3 * FFN) + 4 * A
    # the final norm's and head's inputs, the bf16 logits and the fp32 copy the loss keeps
    head = tokens * 2 * e * H + tokens * V * (4 + e)
    assert m["activations"] == math.ceil(L * tokens * layer + head)
    assert m["activations"] > m["step_buffers"]
    assert m["overhead"] == DEFAULT_FIXED_OVERHEAD + math.ceil(DEFAULT_FRAGMENTATION * m["activations"])
    persistent = m["weights"] + m["grads"] + m["master_weights"] + m["adamw_state"]
    assert m["total"] == persistent + m["activations"] + m["overhead"]
    assert r.capacity_bytes == H100_BYTES and r.fits
    detail = r.memory_detail()
    assert detail["free"] == pytest.approx(H100_BYTES - m["total"]) and detail["transient_peak"] == "activations + reduction"


@pytest.mark.parametrize("row", ["llama3.1-8b-8xh100-dgxc-bf16", "llama3.1-8b-16xh100-dgxc-bf16",
                                 "qwen3-8b-16xh100-mb", "llama3-8b-8xh100-nemo24.07-fp8"])
def test_published_runs_fit(row):
    """Runs that ran fit in the model: it fails if the model says one of them does not."""
    r = published.compare_run(BY_ID[row])
    assert r.fits, (row, r.memory_detail())


def test_zero1_holds_the_same_buffers_under_either_collectives():
    """Megatron's zero1 reduce-scatters each bucket into itself, and so does canzona's runtime
    (docs/design.md §7.1, §8.1): the simulated memory is one fact, the same under Megatron's
    collectives (the default) and the runtime's, to the byte; an even bucket's reduce-scatter
    holds no receive buffer under either."""
    from sim.options import RunOptions

    cfg = SimConfig(model="qwen3-0.6b", gpus=8, tp=1, policy="zero1", optimizer="adamw",
                    workload=Workload(seq_len=1024, global_batch=16))
    megatron, runtime = (simulate(replace(cfg, options=RunOptions(collectives=c))).memory
                         for c in ("megatron", "runtime"))
    assert megatron.ranks == runtime.ranks
    assert all(r.reduction == 0 for r in megatron.ranks)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # every row simulated: three minutes on a quiet machine
def test_every_simulated_published_run_fits_and_the_dense_rows_meet_the_bars():
    """Issue 22's bars over the whole table: every run that ran fits; over the dense rows the mean
    absolute error of tokens/s/GPU is at most 10%; within each dense model, no two runs the source
    orders (a tie orders nothing) are simulated the other way round."""
    results = [published.compare_run(run) for run in RUNS if not run.needs()]
    for r in results:
        assert r.fits, (r.run.id, r.memory_detail())
    dense = [r for r in results if not resolve_model(r.run.model_ref)[1].moe]
    assert len(dense) >= 20
    assert sum(abs(r.error) for r in dense) / len(dense) <= 0.10
    for a in dense:
        for b in dense:
            if a.run.model_name == b.run.model_name and a.run.tokens_per_s_per_gpu < b.run.tokens_per_s_per_gpu:
                assert a.simulated_tokens_per_s_per_gpu < b.simulated_tokens_per_s_per_gpu, (a.run.id, b.run.id)


def test_recipe_grad_dtype_halves_the_gradient_buffers():
    """Qwen3-8B's Megatron-Bridge recipe sets grad_reduce_in_fp32 = False (its recipe_source): bf16
    gradient buffers, half of Megatron's fp32 default, and nothing else of the layout moves."""
    run = BY_ID["qwen3-8b-16xh100-mb"]
    assert run.grad_reduce_in_fp32 is False and run.recipe_source.startswith("https://")
    bf16 = published.compare_run(run).memory
    fp32 = published.compare_run(replace(run, grad_reduce_in_fp32=None)).memory
    assert fp32["grads"] == 2 * bf16["grads"]
    assert fp32["weights"] == bf16["weights"] and fp32["activations"] == bf16["activations"]


def test_nemo_24_07_fp8_row_terms_by_hand():
    """NeMo 24.07's Llama 3 8B FP8 row (8 H100s, TP 1, CP 2, DP 4): the launcher script that runs
    it sets Apex distributed_fused_adam's grad_sync_dtype to bf16 (its recipe_source), so the
    gradient buffer is 2 bytes a parameter; the weights are bf16 plus Transformer Engine's cached
    FP8 copy and transpose of every linear weight (2 bytes each); NeMo has Apex keep only the low
    16 bits of each fp32 master (store_param_remainders, bf16 model and fp32 optimizer): 2 bytes a
    parameter over DP x CP. With Megatron's fp32 default instead the same layout does not fit: the
    recipe setting, not an allowance, makes it fit."""
    run = BY_ID["llama3-8b-8xh100-nemo24.07-fp8"]
    assert run.grad_reduce_in_fp32 is False and "grad_sync_dtype=bf16" in run.recipe_source
    r = published.compare_run(run)
    m = r.memory
    n = LLAMA_8B_PARAMS
    linear = L * (H * (H + 2 * KV) + H * H + 3 * H * FFN)  # q, k, v, o, gate, up, down: the FP8 GEMMs
    assert m["weights"] == pytest.approx(2 * n + 2 * linear, rel=1e-4)
    assert m["grads"] == pytest.approx(2 * n, rel=1e-4)
    assert run.store_param_remainders and "store_param_remainders=True" in run.recipe_source
    assert m["master_weights"] == pytest.approx(2 * n / 8, rel=1e-4)
    assert m["adamw_state"] == pytest.approx(8 * n / 8, rel=1e-4)
    assert r.fits
    full = published.compare_run(replace(run, store_param_remainders=None)).memory
    assert full["master_weights"] == 2 * m["master_weights"] and full["total"] - m["total"] == m["master_weights"]
    fp32 = published.compare_run(replace(run, grad_reduce_in_fp32=None))
    assert fp32.memory["grads"] == 2 * m["grads"] and not fp32.fits


def test_a_layout_that_cannot_fit_still_does_not():
    """Llama 3.1 70B on 8 H100s with DP only: 70.6B bf16 weights alone are 141 GB a GPU."""
    cfg = SimConfig(model=str(published.DATA_DIR / "models" / "llama3-70b.json"), gpus=8, tp=1, pp=1,
                    optimizer="adamw", policy="zero1", hardware="h100-sxm",
                    workload=Workload(seq_len=8192, global_batch=8, micro_batch=1))
    result = simulate(cfg)
    assert not result.memory.fits(result.memory_capacity_bytes)
    assert result.memory.worst.weights > result.memory_capacity_bytes


def test_bad_recipe_settings_are_one_line_errors():
    raw = next(r for r in json.loads(published.PUBLISHED_RUNS.read_text())["rows"]
               if r["id"] == "qwen3-8b-16xh100-mb")
    sources = published.load()[1]
    with pytest.raises(SpecError, match="grad_reduce_in_fp32 must be"):
        published.parse_run({**raw, "grad_reduce_in_fp32": "no"}, sources, "row")
    with pytest.raises(SpecError, match="needs recipe_source"):
        published.parse_run({**raw, "recipe_source": ""}, sources, "row")


def test_recipe_reshard_after_forward_is_the_automodel_rows_and_checked():
    """NeMo AutoModel's MoE recipe keeps every FSDP unit gathered from forward to backward
    (`reshard_after_forward` false, its recipe_source); the row is simulated so, the others keep
    FSDP2's default; false on a row without FSDP, or without a recipe source, is one line."""
    run = BY_ID["qwen3-30b-a3b-8xh100-automodel"]
    assert run.fsdp and run.reshard_after_forward is False and "parallelizer.py" in run.recipe_source
    assert run.sim_config().reshard_after_forward is False
    assert all(r.reshard_after_forward for r in RUNS if r.id != run.id)
    raws = {r["id"]: r for r in json.loads(published.PUBLISHED_RUNS.read_text())["rows"]}
    sources = published.load()[1]
    with pytest.raises(SpecError, match="false on an fsdp row only"):
        published.parse_run({**raws["qwen3-8b-16xh100-mb"], "reshard_after_forward": False}, sources, "row")
    with pytest.raises(SpecError, match="needs recipe_source"):
        published.parse_run({**raws[run.id], "recipe_source": ""}, sources, "row")
    assert published.compare_run(run).to_dict()["reshard_after_forward"] is False


def test_recipe_loss_without_fp32_upcast_keeps_a_bf16_copy_of_the_logits():
    """AutoModel's benchmark recipe sets MaskedCrossEntropy(fp32_upcast=False): PyTorch's
    F.cross_entropy runs on the bf16 logits, so the three tensors of the logits' shape it holds at
    its backward (the saved log-softmax, nll_loss's gradient, log_softmax's; `loss_logit_bytes`)
    are bf16, not fp32: the row's activations are 3 x 2 bytes a logit smaller (Qwen3's
    151,936-token vocabulary over 4 x 4096 tokens) and nothing else moves."""
    run = BY_ID["qwen3-30b-a3b-8xh100-automodel"]
    assert run.loss_fp32_upcast is False and "fp32_upcast: false" in run.recipe_source
    assert run.sim_config().workload.loss_bytes == 2
    bf16 = published.compare_run(run).memory
    fp32 = published.compare_run(replace(run, loss_fp32_upcast=None)).memory
    assert fp32["activations"] - bf16["activations"] == 4 * 4096 * 151936 * 3 * (4 - 2)
    assert fp32["grads"] == bf16["grads"] and fp32["reduction"] == bf16["reduction"]
    assert all(r.loss_fp32_upcast is None for r in RUNS if r.id != run.id)
    raw = next(r for r in json.loads(published.PUBLISHED_RUNS.read_text())["rows"] if r["id"] == run.id)
    with pytest.raises(SpecError, match="loss_fp32_upcast must be"):
        published.parse_run({**raw, "loss_fp32_upcast": "no"}, published.load()[1], "row")
    with pytest.raises(SpecError, match="loss bytes must be"):
        Workload(loss_bytes=0)


@pytest.mark.parametrize(("row", "setting", "message"), [
    # Megatron-FSDP's row: a loop holding the logits and a loss without the upcast (beside its fused
    # cross-entropy) are the simulator's refusals, not the parser's own rules
    ("llama3-8b-8xh100-mb25.11-fp8", {"loss_holds_logits": True}, "--loss-holds-logits describes"),
    ("llama3-8b-8xh100-mb25.11-fp8", {"loss_fp32_upcast": False}, "a loss without the fp32 upcast"),
    # a ZeRO-1 row without masters reducing in fp32: canzona's DistributedOptimizer reduces in bf16 there
    ("llama3.1-8b-8xh100-dgxc-bf16", {"master_weights": False, "grad_reduce_in_fp32": True,
                                      "recipe_source": "https://example.org (a test)"}, "--no-master-weights with"),
    # NeMo's master remainders need the masters they are half of
    ("llama3-8b-8xh100-nemo24.07-fp8", {"master_weights": False}, "--store-param-remainders describes"),
])
def test_a_row_the_simulator_refuses_is_refused_when_read_naming_it(row, setting, message):
    """A row whose settings the simulator refuses (`SimConfig.check_settings`) is one error naming
    the row when the table is read, not an error of `validate --published` naming no row."""
    raw = next(r for r in json.loads(published.PUBLISHED_RUNS.read_text())["rows"] if r["id"] == row)
    with pytest.raises(SpecError, match=f"^row 7: {message}"):
        published.parse_run({**raw, **setting}, published.load()[1], "row 7")
    assert published.parse_run(raw, published.load()[1], "row 7").id == row


def test_nemo_24_07_llama3_70b_needs_its_context_parallelism():
    """NeMo 24.07's Llama 3 70B FP8 layout (TP 4, PP 4, VP 5, CP 2) fits; the same layout without
    CP (DP 4) holds two micro-batch-chunks' worth of 8192-token activations per chunk in flight and
    does not: under FP8 every layer keeps the attention's bf16 output beside the output
    projection's FP8 copy of it (canzona.memory.layer_activation_bytes), 3.1 GB on stage 0 there."""
    from sim.published_search import layout_of, question_of
    from sim.search import config_of

    run = BY_ID["llama3-70b-64xh100-nemo24.07-fp8"]
    assert (run.tp, run.pp, run.vp, run.cp, run.precision) == (4, 4, 5, 2, "fp8")
    q = question_of(run)
    cp1 = simulate(config_of(q, {**layout_of(run), "cp": 1, "dp": 4}))
    assert not cp1.fits, cp1.memory.worst
    w = cp1.memory.worst
    attention_output = 92 * 8192 * 2 * 8192 // 4  # 92 layers' worth in flight on stage 0, e * q / tp a token
    assert w.total - attention_output - math.ceil(DEFAULT_FRAGMENTATION * attention_output) < H100_BYTES
