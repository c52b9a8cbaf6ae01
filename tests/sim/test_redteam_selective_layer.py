"""Red-team regressions of torchtitan's selective-layer recompute (canzona.recompute) beside the
rest of the simulator: what a user hit, pinned by a test that failed before its fix."""

from __future__ import annotations

from dataclasses import replace

from canzona.memory import (
    LayerDims,
    MemorySetup,
    activation_breakdown,
    fullest_rank_load,
    layer_activation_bytes,
)
from canzona.models import resolve_model
from canzona.recompute import FULL, SELECTIVE_LAYER
from sim.search import Question, candidates, config_of, memory_floor

L, H, E, K = 48, 2048, 128, 8  # Qwen3-30B-A3B's layers, hidden size, experts, experts a token
MOE = LayerDims(L, H, 32, K * 768, 151936, 4, 128, gated_mlp=True, dropout=False, qk_norm=True, experts=E,
                experts_per_token=K)


def test_ep_overlap_layer_under_selective_layer_is_a_whole_layer():
    """Megatron's EP overlap holds one layer more; under selective-layer (no one layer's figure: a
    layer stores by its position) that layer is priced whole, the most any layer stores, instead of
    the breakdown raising (it raised 'under selective-layer a layer stores everything or only its
    input by its position')."""
    setup = MemorySetup(seq_len=4096, micro_batches=16, ep=16, recompute=SELECTIVE_LAYER, ep_overlap=True,
                        routing="balanced")  # the mean load: the layer's figure by hand
    parts = activation_breakdown(MOE, setup, 1)
    assert parts["ep_overlap_layer"] == layer_activation_bytes(MOE, setup, 1, "none")
    assert parts["layers"] == activation_breakdown(MOE, replace(setup, ep_overlap=False), 1)["layers"]
    # under random routing, at the fullest EP rank's load
    random = replace(setup, routing="random")
    assert fullest_rank_load(MOE, random, 1, L) > 1
    assert activation_breakdown(MOE, random, 1)["ep_overlap_layer"] > parts["ep_overlap_layer"]


def test_an_overlapped_moe_search_prices_selective_layer_floors():
    """`canzona search --model qwen3-30b-a3b --gpus 16 --optimizer adamw --global-batch 16
    --overlap-moe-expert-parallel-comm` failed at once with that error (it ran in a minute before
    selective-layer joined the recompute modes): a layout whose full-recompute floor does not fit
    (EP 2: half the experts' weights and gradients a GPU) has the next mode's floor asked for, on
    the overlapped configuration the search builds for it."""
    q = Question(model="qwen3-30b-a3b", gpus=16, optimizer="adamw", global_batch=16,
                 overlap_moe_expert_parallel_comm=True)
    model = resolve_model(q.model)
    layout = next(c for c in candidates(q) if (c["tp"], c["pp"], c["ep"], c["micro_batch"]) == (1, 1, 2, 1))
    cfg = config_of(q, {**layout, "recompute": SELECTIVE_LAYER})
    assert cfg.options.overlap_moe_expert_parallel_comm  # the search turns the overlap on for it
    floor = memory_floor(cfg, model)
    assert floor > memory_floor(config_of(q, {**layout, "recompute": FULL}), model)
