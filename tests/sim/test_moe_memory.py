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
    fullest_rank_load,
    layer_activation_bytes,
)
from canzona.models import resolve_model
from canzona.pipeline import combined_order, peak_in_flight
from canzona.routing import BALANCED, busiest_rank
from sim import published
from sim.ep_dispatch import EpDispatcher
from sim.options import RunOptions
from sim.simulate import SimConfig, layer_dims, simulate
from sim.workload import Workload

RUNS, _ = published.load()
BY_ID = {r.id: r for r in RUNS}
GIB = 2**30

# Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): 48 layers, hidden 2048, 128 experts, 8 a token
L, H, E, K = 48, 2048, 128, 8
DENSE = LayerDims(L, H, 32, K * 768, 151936, 4, 128, gated_mlp=True, dropout=False, qk_norm=True)
MOE = replace(DENSE, experts=E, experts_per_token=K)
PER_PAIR = K * H * 2 + 3 * 2 * K * 768  # a token's routed copies, their gate / up outputs and product (bf16)


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
    # the per-pair terms (the routed copies, their gate / up outputs and product) at the fullest of
    # the 16 EP ranks' load: random routing's fluctuation over the 49 layers' independent draws
    # (`fullest_rank_load`: +0.14%, where one layer's busiest rank is +0.95%)
    load = busiest_rank(experts=E, top_k=K, ep=16, tokens=(L + 1) * tokens).pairs
    assert load == pytest.approx(1.001355, abs=1e-6)
    per_pair = K * H * e + 3 * e * ffn
    assert per_pair == PER_PAIR
    # 48 layers of one micro-batch, and one more under the EP overlap (the combined schedule's pair)
    assert m["activations"] == pytest.approx(
        math.ceil((L + 1) * tokens * (dense + moe + (load - 1) * per_pair) + head), abs=2)
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
    # one layer more, and the per-pair terms at the fullest EP rank's load over 49 layers' draws, not 48
    # (`fullest_rank_load`: random routing's fluctuation averages over one draw more)
    over = [busiest_rank(experts=E, top_k=K, ep=16, tokens=n * 4096).pairs - 1 for n in (L, L + 1)]
    more = ((L + 1) * over[1] - L * over[0]) * 4096 * PER_PAIR
    assert r.memory["activations"] - f.memory["activations"] == pytest.approx(one_layer + more, abs=2)


def test_bad_ep_overlap_is_one_line_error():
    with pytest.raises(SpecError, match="ep_overlap must be true or false"):
        MemorySetup(ep_overlap=1)


# --- the fullest EP rank's expert activations ---------------------------------------------------

EP16 = MemorySetup(seq_len=4096, micro_batches=64, ep=16)  # PP 1: one micro-batch's 48 layers held


def _expert_part(setup: MemorySetup) -> float:
    """What the per-pair terms of the 48 layers hold at the mean load."""
    return L * setup.seq_len * PER_PAIR


def test_router_imbalance_scales_the_expert_activations():
    """A persistent skew of 2 (`--router-imbalance 2`: the busiest EP rank has twice the mean
    pairs, in every layer) doubles the per-pair terms of the fullest rank, and nothing else: the
    router's maps, the attention and the head are per token of the rank's own."""
    mean = sum(activation_breakdown(MOE, replace(EP16, routing=BALANCED), 1).values())
    for routing in (BALANCED, "random"):
        skewed = replace(EP16, router_imbalance=2.0, routing=routing)
        assert fullest_rank_load(MOE, skewed, 1, L) == 2.0
        assert sum(activation_breakdown(MOE, skewed, 1).values()) == pytest.approx(
            mean + _expert_part(skewed), rel=1e-12)
    # a router histogram: the EP ranks' sums of their experts' shares, rank 0's the busiest
    hist = tuple([3.0] * 8 + [1.0] * (E - 8))  # rank 0's 8 experts three times the others'
    skewed = replace(EP16, router_imbalance=hist, routing=BALANCED)
    share = 24 / (sum(hist) / 16)
    assert fullest_rank_load(MOE, skewed, 1, L) == pytest.approx(share)
    assert sum(activation_breakdown(MOE, skewed, 1).values()) == pytest.approx(
        mean + (share - 1) * _expert_part(skewed), rel=1e-12)


def test_balanced_routing_and_ep1_leave_the_mean():
    """Exact balance (`--routing balanced`), EP 1 (every rank computes every expert on its own
    tokens) and a dense model: the activations are the mean rank's, as before."""
    mean = activation_breakdown(MOE, replace(EP16, ep=1), 1)
    assert activation_breakdown(MOE, replace(EP16, routing=BALANCED), 1) == mean
    assert activation_breakdown(MOE, replace(EP16, ep=1, router_imbalance=2.0), 1) == mean
    assert activation_breakdown(DENSE, replace(EP16, router_imbalance=2.0), 1) == \
        activation_breakdown(DENSE, replace(EP16, ep=1), 1)
    assert fullest_rank_load(DENSE, EP16, 1) == 1.0


def test_random_routing_fluctuates_less_over_the_held_layers():
    """Random routing draws each layer's top-k afresh: a rank's held expert activations are a sum
    of 48 independent draws, whose busiest is one draw of 48 times the tokens (`busiest_rank`):
    +0.14%, where one layer's busiest rank (what the timing waits for) is +0.95%."""
    one = busiest_rank(experts=E, top_k=K, ep=16, tokens=4096).pairs
    held = busiest_rank(experts=E, top_k=K, ep=16, tokens=4096 * L).pairs
    assert fullest_rank_load(MOE, EP16, 1, 1) == one == pytest.approx(1.0095, abs=1e-4)
    assert fullest_rank_load(MOE, EP16, 1, L) == held == pytest.approx(1.00137, abs=1e-5)
    mean = sum(activation_breakdown(MOE, replace(EP16, routing=BALANCED), 1).values())
    assert sum(activation_breakdown(MOE, EP16, 1).values()) == pytest.approx(
        mean + (held - 1) * _expert_part(EP16), rel=1e-12)
    # under full recompute only the recomputed layer holds expert activations: one draw
    full = replace(EP16, recompute="full")
    assert activation_breakdown(MOE, full, 1)["recompute_working_set"] == pytest.approx(
        layer_activation_bytes(MOE, full, 1, "none") - layer_activation_bytes(MOE, full, 1)
        + (one - 1) * 4096 * PER_PAIR, rel=1e-12)
    # expert TP 2 at TP 2: each TP rank routes half the tokens, its ETP group gathers two ranks'
    # (two draws at one position, as the timing sums them): the same tokens a draw as at TP 1
    assert fullest_rank_load(MOE, replace(EP16, expert_tp=2), 2, L) == held


def _sim(**kw) -> int:
    base = dict(model="qwen3-30b-a3b", gpus=16, tp=1, ep=16, optimizer="adamw", policy="zero1",
                workload=Workload(seq_len=4096, global_batch=16), gpu_variability=0.0)
    return simulate(SimConfig(**{**base, **kw})).memory.worst.activations


def test_the_simulator_reports_the_fullest_rank():
    """`canzona simulate --ep 16 --router-imbalance 2` reports the fullest rank's doubled per-pair
    terms; AutoModel's deterministic FakeBalancedGate routes evenly: the balanced routing's figure
    (the load's routing is one definition with the timing's, `EpDispatcher.load_routing`)."""
    balanced = RunOptions(ep_dispatcher=EpDispatcher(routing=BALANCED))
    mean = _sim(options=balanced)
    assert _sim(options=balanced, router_imbalance=2.0) == pytest.approx(mean + _expert_part(EP16), abs=2)
    assert _sim() > mean
    gate = RunOptions(ep_dispatcher=EpDispatcher(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep",
                                                 fake_balanced_gate=True))
    assert _sim(options=gate) == mean
