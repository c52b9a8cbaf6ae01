"""What a mixture-of-experts layer saves for its backward (docs/design.md §7.1): the routed
copies the grouped fc1 keeps (Transformer Engine's `_GroupedLinear`), the router's maps (TE's
fused router), and the tuned Qwen3-30B-A3B row against its published peak allocated memory
(Megatron-Bridge PR #5123: 62.166 GiB a GPU), which the model's counted tensors must not exceed."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from canzona.errors import SpecError
from canzona.memory import (
    MOE_ROUTER_MAP_BYTES,
    LayerDims,
    MemorySetup,
    activation_breakdown,
    layer_activation_bytes,
)
from canzona.models import resolve_model
from canzona.pipeline import combined_order, peak_in_flight
from sim import published
from sim.simulate import layer_dims

RUNS, _ = published.load()
BY_ID = {r.id: r for r in RUNS}
GIB = 2**30

# Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): 48 layers, hidden 2048, 128 experts, 8 a token
L, H, E, K = 48, 2048, 128, 8
DENSE = LayerDims(L, H, 32, K * 768, 151936, 4, 128, gated_mlp=True, dropout=False, qk_norm=True)
MOE = replace(DENSE, experts=E, experts_per_token=K)


def test_moe_terms_by_hand():
    """Per token a TP rank routes: 8 bf16 copies of the hidden vector (fc1's saved input) and 9
    bytes an expert of router maps; FP8 keeps the copies' FP8 cast; expert TP gathers the copies
    over its group first; sequence parallelism splits the tokens over TP."""
    s = 4096
    bf16 = MemorySetup(seq_len=s)
    moe_bytes = K * H * 2 + 9 * E
    assert MOE_ROUTER_MAP_BYTES == 9
    assert layer_activation_bytes(MOE, bf16, 1) - layer_activation_bytes(DENSE, bf16, 1) == s * moe_bytes
    fp8 = replace(bf16, fp8=True)
    assert layer_activation_bytes(MOE, fp8, 1) - layer_activation_bytes(DENSE, fp8, 1) == s * (K * H + 9 * E)
    assert layer_activation_bytes(MOE, bf16, 2) - layer_activation_bytes(DENSE, bf16, 2) == s * moe_bytes / 2
    etp2 = replace(bf16, expert_tp=2)
    assert layer_activation_bytes(MOE, etp2, 2) - layer_activation_bytes(DENSE, etp2, 2) == \
        s * (2 * K * H * 2 + 9 * E) / 2
    # full recompute keeps only the layer's input; its recomputed layer holds the copies again
    full = replace(bf16, recompute="full")
    assert layer_activation_bytes(MOE, full, 1) == layer_activation_bytes(DENSE, full, 1) == s * 2 * H


def test_catalog_moe_dims_carry_the_router():
    spec, arch = resolve_model("qwen3-30b-a3b", 1)
    dims = layer_dims(arch, spec)
    assert (dims.experts, dims.experts_per_token, dims.ffn) == (E, K, K * 768)
    spec, arch = resolve_model("qwen3-8b", 1)
    assert layer_dims(arch, spec).experts_per_token == 0


def test_tuned_30b_row_against_its_published_peak():
    """The tuned row's activations are the dense terms plus the MoE terms of 48 layers of one
    micro-batch of 4096 tokens (PP 1, TP 1), and one layer more (its EP overlap); its counted tensors (the total less the allowance for
    what torch's allocator does not count: CUDA context, NCCL, fragmentation) stay below the
    published peak allocated memory, 62.166 GiB a GPU (Megatron-Bridge PR #5123)."""
    r = published.compare_run(BY_ID["qwen3-30b-a3b-16xh100-mb-perf"])
    m = r.memory
    tokens, e, q, kv, a, ffn, vocab = 4096, 2, 4096, 512, 32, K * 768, 151936
    # per token and layer: the dense terms (norms' and block inputs 4eh, Q and K, V, the attention
    # output, the routed copies' gate / up outputs and product, the QK norms' inputs, the
    # log-sum-exp), then the MoE terms: 8 routed copies of h, 9 bytes an expert of router maps
    dense = e * (4 * H + (q + kv) + kv + q + 3 * ffn + (q + kv)) + 4 * a
    moe = K * H * e + 9 * E
    # the final norm's and head's inputs and the bf16 logits (TE's fused cross-entropy keeps no copy)
    head = tokens * 2 * e * H + tokens * vocab * e
    # 48 layers of one micro-batch, and one more under the EP overlap (the combined schedule's pair)
    assert m["activations"] == math.ceil((L + 1) * tokens * (dense + moe) + head)
    assert L * tokens * moe / GIB == pytest.approx(6.21, abs=0.01)
    counted = m["total"] - m["overhead"]
    assert counted <= 62.166 * GIB, counted / GIB
    assert r.fits


@pytest.mark.parametrize("kw", [dict(experts=4, experts_per_token=0), dict(experts=0, experts_per_token=2),
                                dict(experts=4, experts_per_token=8), dict(experts=-1, experts_per_token=1),
                                dict(experts=True, experts_per_token=1)])
def test_bad_moe_dims_are_one_line_errors(kw):
    with pytest.raises(SpecError) as err:
        replace(DENSE, **kw)
    assert "\n" not in str(err.value)


def test_bad_expert_tp_is_one_line_error():
    with pytest.raises(SpecError, match="expert tp must be a whole number >= 1"):
        MemorySetup(expert_tp=0)


def _combined_peak(stage: int, pp: int, micro_batches: int, vp: int) -> int:
    """Micro-batch-chunks held between the combined schedule's steps, its fullest such moment
    (inside a step a forward layer is paired with a backward one: at most one layer more, which
    is the extra layer counted)."""
    held = peak = 0
    for f, b in combined_order(stage, pp, micro_batches, vp):
        held += (f is not None) - (b is not None)
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("pp,vp,m", [(1, 1, 1), (1, 1, 64), (2, 2, 4), (4, 2, 8), (8, 4, 16), (8, 4, 64), (4, 3, 4)])
def test_combined_schedule_holds_the_plain_schedules_chunks(pp, vp, m):
    """Megatron's combined 1F1B runs one warm-up forward more than the plain (interleaved)
    schedule, alone; its fullest moment in micro-batch-chunks is the plain schedule's
    (`canzona.pipeline.peak_in_flight`), which is why the EP overlap adds one layer, not a chunk."""
    for stage in range(pp):
        assert _combined_peak(stage, pp, m, vp) == peak_in_flight(stage, pp, m, vp), stage


def test_ep_overlap_adds_one_layer():
    setup = MemorySetup(seq_len=4096, micro_batches=64)
    plain = activation_breakdown(MOE, setup, 1)
    overlap = activation_breakdown(MOE, replace(setup, ep_overlap=True), 1)
    one_layer = layer_activation_bytes(MOE, setup, 1)
    assert overlap["ep_overlap_layer"] == one_layer and plain["ep_overlap_layer"] == 0
    assert sum(overlap.values()) - sum(plain.values()) == one_layer
    assert plain["layers"] == L * one_layer  # PP 1: one micro-batch's 48 layers
    r = published.compare_run(BY_ID["qwen3-30b-a3b-16xh100-mb-perf"])
    f = published.compare_run(BY_ID["qwen3-30b-a3b-16xh100-mb"])  # the same layout without the overlap
    assert r.memory["activations"] - f.memory["activations"] == pytest.approx(one_layer, abs=1)


def test_bad_ep_overlap_is_one_line_error():
    with pytest.raises(SpecError, match="ep_overlap must be true or false"):
        MemorySetup(ep_overlap=1)
