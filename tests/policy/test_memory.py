"""The memory model (canzona/memory.py, docs/design.md §7.1): hand-computed figures for every step
policy, conservation of optimizer state over the cluster on random models, the activation formulas
against Korthikanti et al. 2022 (arXiv 2205.05198), Qwen3-32B on 256 H100s, and speed."""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canzona.catalog import get_config, get_model
from canzona.cost import state_bytes
from canzona.errors import SpecError
from canzona.hardware import load_profile
from canzona.memory import (
    GB,
    LayerDims,
    MemorySetup,
    _group_bytes,
    activation_breakdown,
    kernel_workspace_bytes,
    layer_activation_bytes,
    memory_per_gpu,
    worst_rank,
)
from canzona.optimizers import MuonConfig, SOAPConfig
from canzona.pipeline import stage_layers, stage_spec
from canzona.plan import make_plan
from canzona.spec import ModelSpec, ParamSpec, Role
from canzona.step_policies import STEP_POLICIES, policy_optimizer
from canzona.step_schedule import PIPELINED, SERIAL, tp_schedule
from canzona.tp import EVERY_RANK
from tests.policy.strategies import models


def plan_for(spec, policy, dp, tp, optimizer="muon", align=8, dp_policy="alpha-balanced"):
    p = STEP_POLICIES[policy]
    optimizer = policy_optimizer(policy, optimizer)  # zero1 runs the AdamW baseline
    return make_plan(spec, dp, tp, optimizer, p.dp_policy or dp_policy, p.tp_policy or "greedy-rollback",
                     align=align)


# --- hand-computed figures ----------------------------------------------------------------------

# One layer: a norm and two matrices; embedding vocab-parallel. TP 2, DP 2, alignment 1.
HAND = ModelSpec("hand", (
    ParamSpec("embed", (16, 8), Role.EMBEDDING, None, tp_dim=0),  # local 8 x 8 = 64
    ParamSpec("norm", (8,), Role.VECTOR, 0),  # replicated: 8
    ParamSpec("w0", (16, 8), Role.MATRIX, 0, tp_dim=0),  # local 8 x 8 = 64, full 128
    ParamSpec("w1", (8, 24), Role.MATRIX, 0, tp_dim=1),  # local 8 x 12 = 96, full 192
))
HAND_DIMS = LayerDims.gpt(layers=1, hidden=8, heads=2, vocab=16)
HAND_SETUP = MemorySetup(seq_len=4, flash_attention=False, fixed_overhead_bytes=0, fragmentation=0.0)

# Shared by every policy (Muon, bf16 weights, fp32 gradients, masters and updates):
# - one bucket of both matrices: 64 + 96 = 160 elements (a multiple of align x dp = 2);
#   AdamW buffer: 64 + 8 = 72 elements, 36 per DP rank
# - weights (160 + 72) x 2 = 464; gradients (160 + 72) x 4 = 928; AdamW state 36 x 8 = 288
# - activations (GPT layer, s = 4, b = 1, h = 8, a = 2, t = 2, sequence parallel, no flash):
#   layer s*b*(34h + 5as)/t = 4 x (272 + 40) / 2 = 624; embedding dropout mask s*b*h/t = 16;
#   final norm and head inputs s*b*4h/t = 64; logits s*b*V*(4 + 2)/t = 192; total 896
# - Muon kernel workspace (Nesterov blend fp32, two bf16 iterates, two bf16 s x s):
#   w0 (16 x 8): 4*128 + 2*2*128 + 2*2*64 = 1280; w1 (8 x 24): 4*192 + 2*2*192 + 2*2*64 = 1792
# - Muon state, full matrices: w0 128 x 4 = 512, w1 192 x 4 = 768
COMMON = {"weights": 464, "grads": 928, "activations": 896, "overhead": 0}

# The plans these figures assume (checked in the test): w1 opens the bucket at offset 0, w0 follows.
HAND_EXPECTED = {
    # replicated: every rank masters everything (160 + 72 elements x 4 = 928), holds both states
    # (1280) and all of AdamW (72 x 8 = 576). One tp-sync group of both matrices: send 160 x 4 =
    # 640, receive 2 x 640; full gradients and updates (128 + 192) x 4 = 1280 each; the larger
    # workspace 1792: 640 + 1280 + 1280 + 1280 + 1792 = 6272
    "sc": [dict(master_weights=928, matrix_state=1280, adamw_state=576, step_buffers=6272)] * 4,
    # even cuts [0, 80, 160): w1 (offset 0, 96 elements) straddles both segments, w0 (96..160) is
    # rank 1's. DP rank 0 computes w1: masters (96 + 36) x 4 = 528, state 768, tp-sync of w1:
    # 96x4x3 + 768 + 768 + 1792 = 4480. DP rank 1 computes both: masters (160 + 36) x 4 = 784,
    # state 1280, step 6272 as under sc.
    "zero1-gather": [dict(master_weights=528, matrix_state=768, adamw_state=288, step_buffers=4480)] * 2
    + [dict(master_weights=784, matrix_state=1280, adamw_state=288, step_buffers=6272)] * 2,
    # owners: w1 on DP rank 0 (as above: 4480), w0 on DP rank 1: masters (64 + 36) x 4 = 400,
    # state 512 on both TP ranks, tp-sync of w0: 64x4x3 + 512 + 512 + 1280 = 3072 (the packed
    # parameter gather, 160 x 2 = 320, is smaller)
    "layerwise": [dict(master_weights=528, matrix_state=768, adamw_state=288, step_buffers=4480)] * 2
    + [dict(master_weights=400, matrix_state=512, adamw_state=288, step_buffers=3072)] * 2,
    # owners as layerwise, each matrix hosted on TP rank 0, state on the host only.
    # w1's host: receive 96 x 4 = 384, full gradient 768, update 768, workspace 1792 -> 3712
    # (the scatter phase: update 768 + 384 = 1152). Its other TP rank: the prefetched gather's send
    # 384 under the reductions in flight (none, below: `REDUCTION`), then receive the chunk, 384.
    # w0's host: 256 + 512 + 512 + 1280 = 2560; the other: send 256, then receive 256 (its AdamW
    # temporaries, 2 x 4 x 28 = 224, are smaller)
    "canzona": [dict(master_weights=528, matrix_state=768, adamw_state=288, step_buffers=3712),
                dict(master_weights=528, matrix_state=0, adamw_state=288, step_buffers=384),
                dict(master_weights=400, matrix_state=512, adamw_state=288, step_buffers=2560),
                dict(master_weights=400, matrix_state=0, adamw_state=288, step_buffers=256)],
    # AdamW on every parameter, even cuts [0, 80, 160): DP rank 0 updates w1[0:80), rank 1 w1[80:96)
    # and w0; each its 36 of the AdamW buffer. Masters (80 + 36) x 4 = 464, state (80 + 36) x 8 =
    # 928, no matrix state; the step's temporaries are AdamW's, 2 x 4 x the largest piece: rank 0's
    # 80 elements of w1 (640), rank 1's w0 (64: 512)
    "zero1": [dict(master_weights=464, matrix_state=0, adamw_state=928, step_buffers=640)] * 2
    + [dict(master_weights=464, matrix_state=0, adamw_state=928, step_buffers=512)] * 2,
}

# The gradient reduce-scatters in flight at the end of backward (canzona.reductions), fp32:
# native: the AdamW buffer is even (36 per rank), as is the bucket under zero1-gather and the
# all-reduce policies (80 each): each reduce-scatters into the buffer itself, so nothing; [96, 64]
# under canzona's owners, which native reduces in place with one reduce per owner (padding 32 > 160 / 16)
REDUCTION = {policy: [0] * 4 for policy in STEP_POLICIES}
# exact receives both ranks' copies of its segment (summed in place): 2 x (80 + 36) x 4 = 928,
# canzona's owner of w1 2 x (96 + 36) x 4 = 1056, of w0 2 x (64 + 36) x 4 = 800
EXACT_REDUCTION = {"sc": [928] * 4, "zero1-gather": [928] * 4, "layerwise": [928] * 4,
                   "canzona": [1056, 1056, 800, 800], "zero1": [928] * 4}


@pytest.mark.parametrize("policy", list(STEP_POLICIES))
def test_hand_computed_figures_for_every_policy(policy):
    plan = plan_for(HAND, policy, 1 if STEP_POLICIES[policy].replicated else 2, 2, align=1)
    (bucket,) = plan.dp_plan.buckets
    assert [(p.name, p.offset) for p in bucket.params] == [("w1", 0), ("w0", 96)], "the plan changed"
    if not STEP_POLICIES[policy].replicated:
        assert plan.dp_plan.owners() == {"w1": 0, "w0": 1}, "the plan changed"
    if policy == "canzona":
        assert [g.hosts for rank in plan.tp_plan.groups for g in rank] == [(0,), (0,)], "the plan changed"
    got = memory_per_gpu(HAND, plan, policy, HAND_DIMS, HAND_SETUP, dp=2)
    assert [(r.rank, r.dp_rank, r.tp_rank) for r in got.ranks] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    for r, want, reduction in zip(got.ranks, HAND_EXPECTED[policy], REDUCTION[policy]):
        want = {**COMMON, **want, "reduction": reduction}
        assert {k: getattr(r, k) for k in want} == want, r
        assert r.total == (464 + 928 + want["master_weights"] + want["matrix_state"] + want["adamw_state"]
                           + max(896 + reduction, want["step_buffers"]))
    assert got.worst.total == max(r.total for r in got.ranks)
    exact = memory_per_gpu(HAND, plan, policy, HAND_DIMS, replace(HAND_SETUP, reduce_scatter="exact"), dp=2)
    assert [r.reduction for r in exact.ranks] == EXACT_REDUCTION[policy]


@pytest.mark.parametrize("policy", ["zero1", "canzona"])
def test_only_the_copies_of_a_reduce_scatter_are_counted(policy):
    """Like Megatron's distributed optimizer, the runtime reduce-scatters an even bucket into the
    bucket itself (no receive buffer: `REDUCTION`), and a padded one into its padded copy: canzona's
    bucket [96, 64] under `padded` holds 2 x 96 fp32 (768 bytes) and no receive buffer beside it
    (it held 96 more before); the AdamW buffer (36 + 36) is even under every implementation but exact."""
    plan = plan_for(HAND, policy, 2, 2, align=1)
    padded = memory_per_gpu(HAND, plan, policy, HAND_DIMS, replace(HAND_SETUP, reduce_scatter="padded"), dp=2)
    assert [r.reduction for r in padded.ranks] == ([2 * 96 * 4] * 4 if policy == "canzona" else [0] * 4)
    exact = memory_per_gpu(HAND, plan, policy, HAND_DIMS, replace(HAND_SETUP, reduce_scatter="exact"), dp=2)
    assert [r.reduction for r in exact.ranks] == EXACT_REDUCTION[policy]


def test_hand_overhead_and_streamed_tp_sync():
    plan = plan_for(HAND, "sc", 1, 2, align=1)
    # the fixed allowance plus a fraction of the transient peak: the step's 6272 bytes (above the
    # activations, 896, and the reductions, none); the persistent buffers are allocated once
    lm = memory_per_gpu(HAND, plan, "sc", HAND_DIMS, MemorySetup(seq_len=4, flash_attention=False,
                                                                 fixed_overhead_bytes=1000, fragmentation=0.5), dp=2)
    assert lm.ranks[0].overhead == 1000 + math.ceil(0.5 * 6272)
    # streamed tp-sync: one matrix at a time, the larger being w1: 96x4x3 + 768 + 768 + 1792 = 4480
    lm = memory_per_gpu(HAND, plan, "sc", HAND_DIMS, replace(HAND_SETUP, stream_tp_sync=True), dp=2)
    assert lm.ranks[0].step_buffers == 4480


def test_kernel_workspace_by_hand():
    assert kernel_workspace_bytes("muon", (16, 8)) == 4 * 128 + 2 * 2 * 128 + 2 * 2 * 64
    # SOAP: 4 m x n and 4 k x k fp32, k the largest preconditioned side (both sides here)
    assert kernel_workspace_bytes("soap", (16, 8)) == 4 * (4 * 128 + 4 * 256)
    # Shampoo: a side above max_preconditioner_dim (8192) drops out
    assert kernel_workspace_bytes("shampoo", (10000, 8)) == 4 * (4 * 80000 + 3 * 64)


# --- conservation on random models --------------------------------------------------------------

DIMS = LayerDims.gpt(layers=4, hidden=8, heads=1, vocab=8)


@settings(max_examples=40, deadline=None)
@given(models(), st.integers(1, 4), st.sampled_from(["muon", "soap", "shampoo"]), st.sampled_from([PIPELINED, SERIAL]),
       st.booleans())
def test_state_and_masters_are_conserved_over_the_cluster(model_tp, dp, optimizer, mode, sc_plan_for_one_rank):
    model, tp = model_tp
    total_state = sum(state_bytes(optimizer, p.shape) for p in model.matrix_params())
    local = sum(p.local_numel(tp) for p in model.matrix_params())
    adamw_used = sum(p.local_numel(tp) for p in model.adamw_params())
    setup = MemorySetup(seq_len=8, tp_mode=mode)
    for policy in STEP_POLICIES:
        replicated = STEP_POLICIES[policy].replicated
        plan = plan_for(model, policy, 1 if replicated and sc_plan_for_one_rank else dp, tp, optimizer)
        lm = memory_per_gpu(model, plan, policy, DIMS, setup, dp=dp)
        assert len(lm.ranks) == dp * tp
        assert [r.rank for r in lm.ranks] == list(range(dp * tp))
        assert len({(r.weights, r.grads, r.activations) for r in lm.ranks}) == 1
        state = sum(r.matrix_state for r in lm.ranks)
        if policy == "canzona":  # each matrix's state exactly once in the cluster
            assert state == total_state
        elif policy == "sc":  # on every GPU
            assert state == dp * tp * total_state
        elif policy == "layerwise":  # once per DP owner, on every TP rank of its group
            assert state == tp * total_state
        elif STEP_POLICIES[policy].elementwise:  # AdamW on the pieces: no matrix state, each element once
            assert state == 0
            pieces = sum(r.adamw_state for r in lm.ranks) // (8 * tp)
            assert local + adamw_used <= pieces < local + adamw_used + plan.dp_plan.align * dp
            assert sum(r.master_weights for r in lm.ranks) == 4 * tp * pieces
            continue
        else:  # zero1-gather: on every TP rank of every DP rank whose segment the matrix touches
            dpp = plan.dp_plan
            want = tp * sum(p.state_bytes * len(dpp.computing_ranks(b, p)) for b in dpp.buckets for p in b.params)
            assert state == want >= tp * total_state
        if replicated:
            assert all(r.master_weights == 4 * (local + adamw_used) for r in lm.ranks)
            assert all(r.adamw_state == 8 * adamw_used for r in lm.ranks)
            continue
        adamw_padded = sum(r.adamw_state for r in lm.ranks) // (8 * tp)
        assert adamw_used <= adamw_padded < adamw_used + plan.dp_plan.align * dp
        masters = sum(r.master_weights for r in lm.ranks) // tp - 4 * adamw_padded
        if policy == "zero1-gather":
            assert masters >= 4 * local
        else:  # every matrix shard mastered once per TP index
            assert masters == 4 * local


@settings(max_examples=30, deadline=None)
@given(models(), st.integers(1, 3), st.sampled_from(["canzona", "zero1-gather"]))
def test_buffers_are_the_schedules_byte_counts(model_tp, dp, policy):
    """The gather and scatter buffers counted are the bytes the step schedule moves (the one
    definition the runtime's collective log is checked against)."""
    model, tp = model_tp
    plan = plan_for(model, policy, dp, tp)
    for i in range(dp):
        sched = tp_schedule(plan, model, STEP_POLICIES[policy], i)
        for g in sched.groups:
            for r in range(tp):
                got = _group_bytes(g.tasks, tp, r, 4, 4, {t.name: 0 for t in g.tasks})
                if g.tasks[0].host == EVERY_RANK:  # all-gather: own shards, and tp x them received
                    sent = g.gather.bytes_out(r) // (tp - 1) if g.gather else 0
                    assert got.gather == (tp + 1) * sent
                    assert got.scatter == 0
                else:
                    assert got.gather == (g.gather.bytes_out(r) + g.gather.bytes_in(r) if g.gather else 0)
                    assert got.scatter == (g.scatter.bytes_out(r) + g.scatter.bytes_in(r) if g.scatter else 0)


# --- activations against the paper -------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4096), st.integers(1, 8), st.integers(1, 64), st.integers(1, 32), st.sampled_from([1, 2, 4, 8]))
def test_gpt_layer_is_the_papers_formula(s, b, head_dim, a, t):
    h = a * head_dim
    dims = LayerDims.gpt(layers=2, hidden=h, heads=a, vocab=64)

    def layer(**kw):
        return layer_activation_bytes(dims, MemorySetup(seq_len=s, micro_batch=b, flash_attention=False, **kw), t)

    sbh = s * b * h
    assert math.isclose(layer(), sbh * (34 + 5 * a * s / h) / t)  # tensor + sequence parallel
    assert math.isclose(layer(sequence_parallel=False), sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert math.isclose(layer(recompute="selective"), 34 * sbh / t)
    assert math.isclose(layer(recompute="full"), 2 * sbh / t)
    assert math.isclose(layer(recompute="full", sequence_parallel=False), 2 * sbh)
    # flash attention stores no score matrix, only a fp32 log-sum-exp per head and token
    flash = layer_activation_bytes(dims, MemorySetup(seq_len=s, micro_batch=b), t)
    assert math.isclose(flash, (34 * sbh + 4 * a * s * b) / t)


GPT3_175B = LayerDims.gpt(layers=96, hidden=12288, heads=96, vocab=51200)
MT_NLG_530B = LayerDims.gpt(layers=105, hidden=20480, heads=128, vocab=51200)
PAPER = MemorySetup(seq_len=2048, flash_attention=False)


def test_the_papers_worked_numbers():
    # 5as/h, the attention-score term relative to 34: 80 for GPT-3, 64 for MT-NLG (s = 2048)
    for dims, ratio in ((GPT3_175B, 80), (MT_NLG_530B, 64)):
        sbh = 2048 * dims.hidden
        per_layer = layer_activation_bytes(dims, PAPER, 8)
        assert math.isclose(per_layer * 8 / sbh - 34, ratio)
        # "reduces activation memory by 5x": TP alone (no sequence parallelism, no recompute)
        # against sequence parallelism with selective recompute, t = 8
        tp_only = layer_activation_bytes(dims, MemorySetup(seq_len=2048, flash_attention=False,
                                                           sequence_parallel=False), 8)
        both = layer_activation_bytes(dims, MemorySetup(seq_len=2048, recompute="selective"), 8)
        assert math.isclose(tp_only / sbh, 10 + 24 / 8 + ratio / 8)
        assert math.isclose(both / sbh, 34 / 8)
        assert 4.9 < tp_only / both < 5.5
    # 1F1B: the first stage keeps p micro-batches of its L/p layers, L layers' worth in all, so
    # its layer activations do not depend on p (GPT-3: p = 8, 12 layers a stage)
    one = activation_breakdown(GPT3_175B, PAPER, 8, pp=1)["layers"]
    eight = activation_breakdown(GPT3_175B, PAPER, 8, pp=8, stage=0)["layers"]
    assert math.isclose(one, eight)
    assert math.isclose(activation_breakdown(GPT3_175B, PAPER, 8, pp=8, stage=7)["layers"], one / 8)
    # output layer (last stage): norm and projection inputs 4sbh/t, fp32 logits 4sbv/t (the
    # paper's) and the bf16 logits they come from, 2sbv/t
    out = activation_breakdown(GPT3_175B, PAPER, 8, pp=8, stage=7)["output"]
    assert math.isclose(out, 2048 * (4 * 12288 + 6 * 51200) / 8)
    assert activation_breakdown(GPT3_175B, PAPER, 8, pp=8, stage=0)["output"] == 0


QWEN32_DIMS = LayerDims.from_config(get_config("qwen3-32b"))


def test_recompute_and_flash_reduce_activations():
    def act(**kw):
        return activation_breakdown(QWEN32_DIMS, MemorySetup(**kw), 8)

    for flash in (False, True):
        none = sum(act(flash_attention=flash).values())
        selective = sum(act(flash_attention=flash, recompute="selective").values())
        full = sum(act(flash_attention=flash, recompute="full").values())
        assert none > selective > full
    assert sum(act(flash_attention=True).values()) < sum(act(flash_attention=False).values())
    # without flash attention, selective recompute is what removes the s x s scores
    assert math.isclose(sum(act(flash_attention=False, recompute="selective").values()),
                        sum(act(flash_attention=True, recompute="selective").values()))
    # full recompute: the layer inputs, plus one layer's working set beyond its input (the re-run's
    # first op saves the checkpoint's input again, the same tensor)
    full = act(recompute="full")
    assert math.isclose(full["layers"], 64 * 4096 * 2 * 5120 / 8)
    assert math.isclose(full["recompute_working_set"],
                        layer_activation_bytes(QWEN32_DIMS, MemorySetup(), 8) - 4096 * 2 * 5120 / 8)
    assert sum(act(sequence_parallel=False).values()) > sum(act().values())


def test_qwen3_layer_counts_swiglu_gqa_and_qk_norm():
    """Per token of one Qwen3-32B layer at t = 1 (h 5120, q 8192, kv 1024, ffn 25600, 64 heads):
    norms 2*2h, QKV input 2h, Q and K 2(q + kv), V 2kv, projection input 2q, MLP input 2h,
    gate / up / product 3*2*ffn, QK-norm inputs 2(q + kv), flash log-sum-exp 4*64."""
    per_token = 4 * 5120 + 2 * 5120 + 2 * 9216 + 2 * 1024 + 2 * 8192 + 2 * 5120 + 6 * 25600 + 2 * 9216 + 256
    assert layer_activation_bytes(QWEN32_DIMS, MemorySetup(seq_len=1), 1) == per_token


# --- pipeline stages ---------------------------------------------------------------------------


def test_pipeline_stages_split_layers_and_parameters():
    assert [len(stage_layers(64, 4, s)) for s in range(4)] == [16] * 4
    assert [list(stage_layers(10, 4, s)) for s in range(4)] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    with pytest.raises(SpecError, match="stage 4"):
        stage_layers(10, 4, 4)
    spec = get_model("qwen3-8b", 8)
    stages = [stage_spec(spec, 4, s) for s in range(4)]
    assert sorted(p.name for st_ in stages for p in st_.params) == sorted(p.name for p in spec.params)
    assert stages[0].params[0].name == "model.embed_tokens.weight"
    assert {p.name for p in stages[3].params} >= {"model.norm.weight", "lm_head.weight"}
    tied = get_model("qwen3-0.6b", 1)
    last = stage_spec(tied, 2, 1)
    assert "model.embed_tokens.weight" in {p.name for p in last.params}  # the output layer's copy

    dims = LayerDims.from_config(get_config("qwen3-8b"))
    whole = memory_per_gpu(spec, plan_for(spec, "canzona", 4, 8), "canzona", dims)
    first = memory_per_gpu(stages[0], plan_for(stages[0], "canzona", 4, 8), "canzona", dims, pp=4, stage=0)
    last = memory_per_gpu(stages[3], plan_for(stages[3], "canzona", 4, 8), "canzona", dims, pp=4, stage=3)
    assert first.ranks[0].rank == 0 and last.ranks[0].rank == 3 * 32
    assert 0.2 < first.worst.weights / whole.worst.weights < 0.35
    # stage 0 keeps 4 micro-batches of its 9 layers: as many layer activations as the whole model
    assert math.isclose(activation_breakdown(dims, MemorySetup(), 8, 4, 0)["layers"],
                        activation_breakdown(dims, MemorySetup(), 8)["layers"])
    assert last.worst.activations < first.worst.activations
    assert worst_rank([first, last]) == max(first.worst, last.worst, key=lambda r: r.total)
    # the micro-batches of an iteration cap what is in flight
    capped = activation_breakdown(dims, MemorySetup(micro_batches=2), 8, 4, 0)["layers"]
    assert math.isclose(capped, activation_breakdown(dims, MemorySetup(), 8, 4, 0)["layers"] / 2)
    with pytest.raises(SpecError, match="stage_spec"):
        memory_per_gpu(spec, plan_for(spec, "canzona", 4, 8), "canzona", dims, pp=4, stage=0)


# --- Qwen3-32B on 256 H100s --------------------------------------------------------------------

QWEN32 = get_model("qwen3-32b", 8)


@pytest.mark.parametrize("stream", [False, True])
def test_qwen3_32b_sc_does_not_fit_an_h100_and_canzona_does(stream):
    capacity = load_profile("h100-sxm").gpu.memory_bytes
    setup = MemorySetup(seq_len=4096, micro_batch=1, stream_tp_sync=stream)
    sc = memory_per_gpu(QWEN32, plan_for(QWEN32, "sc", 1, 8), "sc", QWEN32_DIMS, setup, dp=32)
    canzona = memory_per_gpu(QWEN32, plan_for(QWEN32, "canzona", 32, 8), "canzona", QWEN32_DIMS, setup)
    assert not sc.fits(capacity) and canzona.fits(capacity)
    assert sc.worst.total > 125 * GB
    # sc's Muon state alone: every full matrix on every GPU
    assert sc.worst.matrix_state == sum(state_bytes("muon", p.shape) for p in QWEN32.matrix_params())
    assert "matrix-optimizer state" in sc.explain(capacity) and "does not fit" in sc.explain(capacity)
    assert "canzona fits" in canzona.explain(capacity)
    assert canzona.worst.matrix_state < 2 * GB < sc.worst.matrix_state
    blob = json.loads(json.dumps(sc.to_dict(capacity, ranks=True)))
    assert blob["fits"] is False and len(blob["ranks"]) == 256
    assert blob["worst"]["total"] == sc.worst.total


def test_4096_gpus_in_well_under_five_seconds():
    for policy in STEP_POLICIES:
        replicated = STEP_POLICIES[policy].replicated
        plan = plan_for(QWEN32, policy, 1 if replicated else 512, 8, dp_policy="whole-start")
        start = time.perf_counter()
        lm = memory_per_gpu(QWEN32, plan, policy, QWEN32_DIMS, dp=512)
        lm.to_dict(80 * GB)
        assert time.perf_counter() - start < 5.0
        assert len(lm.ranks) == 4096


# --- inputs -------------------------------------------------------------------------------------


def test_bad_inputs_are_one_line_errors():
    with pytest.raises(SpecError, match="recompute"):
        MemorySetup(recompute="partial")
    with pytest.raises(SpecError, match="seq len"):
        MemorySetup(seq_len=0)
    with pytest.raises(SpecError, match="fragmentation"):
        MemorySetup(fragmentation=1.5)
    with pytest.raises(SpecError, match="TP mode"):
        MemorySetup(tp_mode="eager")
    plan = plan_for(HAND, "canzona", 2, 2, align=1)
    with pytest.raises(SpecError, match="dp=2, not dp=4"):
        memory_per_gpu(HAND, plan, "canzona", HAND_DIMS, dp=4)
    with pytest.raises(SpecError, match="unknown policy"):
        memory_per_gpu(HAND, plan, "zero3", HAND_DIMS)
    with pytest.raises(SpecError, match="needs a layerwise plan"):
        memory_per_gpu(HAND, plan, "layerwise", HAND_DIMS)
    with pytest.raises(SpecError, match="matrix_config is a SOAPConfig"):
        memory_per_gpu(HAND, plan, "canzona", HAND_DIMS, matrix_config=SOAPConfig())
    # a configuration changes the workspace: Newton-Schulz in fp32 doubles its iterates
    fp32 = memory_per_gpu(HAND, plan, "canzona", HAND_DIMS, HAND_SETUP, matrix_config=MuonConfig(ns_dtype="fp32"))
    assert fp32.ranks[0].step_buffers == 3712 - 1792 + kernel_workspace_bytes("muon", (8, 24), 4, MuonConfig(ns_dtype="fp32"))


def test_setup_from_the_simulators_workload():
    from sim.workload import Workload

    setup = MemorySetup.from_workload(Workload(seq_len=2048, micro_batch=2, grad_bytes=2), recompute="full")
    assert (setup.seq_len, setup.micro_batch, setup.grad_bytes, setup.recompute) == (2048, 2, 2, "full")
    with pytest.raises(SpecError, match="unknown memory setting"):
        MemorySetup.from_workload(Workload(), recompute_all=True)


def test_without_masters_the_state_that_follows_the_update_is_in_the_parameters_dtype():
    """`kept_state_bytes`: beside fp32 masters every state in fp32 (the plan's count); without them
    Muon's momentum and AdamW's moments in the parameters' bf16, SOAP's state in fp32, and NorMuon's
    momentum in bf16 beside its per-row second moment in fp32 (`canzona.runtime.normuon.normuon_state`)."""
    from canzona.memory import MemorySetup, kept_state_bytes
    from canzona.step_schedule import Task

    m, n = 64, 48
    bf16 = MemorySetup(master_weights=False, grad_bytes=2)
    for optimizer, without in (("muon", 2 * m * n), ("adamw", 2 * 2 * m * n), ("normuon", 2 * m * n + 4 * m)):
        task = Task("w", 0, (m, n), None, 1.0, 1, state_bytes(optimizer, (m, n)))
        assert kept_state_bytes(optimizer, [task], MemorySetup()) == task.state_bytes
        assert kept_state_bytes(optimizer, [task], bf16) == without, optimizer
    soap = Task("w", 0, (m, n), None, 1.0, 1, state_bytes("soap", (m, n)))
    assert kept_state_bytes("soap", [soap], bf16) == soap.state_bytes
