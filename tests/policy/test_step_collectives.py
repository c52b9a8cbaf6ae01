"""The collectives of a step (canzona/step_collectives.py, docs/design.md §8.6): one torch-free
definition of what every rank sends in a training step, which the simulator prices and the
runtime's collective logs must equal record for record.

- Pure: known answers on a four-parameter model for every step policy; properties on random small
  models (bytes add up to the buckets and the AdamW buffer, -v segments add up to the buffer, one
  reduce-scatter-v per bucket, DP records the same on every rank, TP records the schedule's, the
  phases in the runtime's order); first step and clipping; bad arguments; expert parallelism (the
  dense part's and the experts' collectives merged in the runtime's order; the EP logs themselves:
  tests/runtime/test_runtime_ep_collectives.py).
- Distributed: the logs of spawned gloo runs, DP and TP interleaved by their issue order, equal
  `step_collectives(...)` on every rank and every step: DP 2 for every step policy (and DP policy
  of canzona), with accumulation and with an idle owner; DP 2 x TP 2 (Megatron-style and DTensor
  models) for canzona with every TP scheduler, pipelined and serial, the baselines, accumulation,
  bf16 weights and clipping. The checks are defined here (`check_dp2_logs_are_the_step_collectives`,
  `check_dp2xtp2_logs_are_the_step_collectives`) and run by tests of
  `tests/runtime/test_runtime_equivalence.py` (DP 2) and `tests/runtime/test_runtime_tp.py`
  (DP 2 x TP 2) on those files' cached rung-3 runs, whose results hold the logs: `make test` hands
  each file to one worker (`--dist loadfile`), so tests here reused those runs only where the same
  worker had run that file, and otherwise spawned both groups again.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canzona.dp.layout import ceil_to, even_cuts
from canzona.dp.policies import KEEPS_GEOMETRY
from canzona.errors import PlanError, SpecError
from canzona.plan import make_plan
from canzona.spec import ModelSpec, ParamSpec, Role
from canzona.step_collectives import (
    ALL_GATHER_V,
    BACKWARD,
    CHECK,
    CLIP,
    DP_GROUP,
    PARAMS,
    REDUCE_SCATTER_V,
    STEP,
    StepCollective,
    step_collectives,
    step_records,
)
from canzona.step_policies import STEP_POLICIES
from canzona.step_schedule import ALL_GATHER, ALL_TO_ALL, PIPELINED, SERIAL, TP_GROUP, tp_schedule
from canzona.tp import TP_POLICIES
from tests.policy.strategies import models

# --- known answers ----------------------------------------------------------------------------

# an embedding (16 x 8) and a norm (8) for AdamW; w1 (8 x 16) and w2 (8 x 8) for the matrix optimizer
SMALL = ModelSpec("small", (ParamSpec("embed", (16, 8), Role.EMBEDDING, dtype="fp32"),
                            ParamSpec("w1", (8, 16), Role.MATRIX, 0, dtype="fp32"),
                            ParamSpec("w2", (8, 8), Role.MATRIX, 0, dtype="fp32"),
                            ParamSpec("norm", (8,), Role.VECTOR, 0, dtype="fp32")))


def small_plan(dp_policy: str):
    # one bucket in backward order: w2 at [0, 64), w1 at [64, 192), padded to a multiple of 8 x 2
    return make_plan(SMALL, 2, 1, "muon", dp_policy, align=8)


def test_known_answers_on_a_small_model():
    """Bucket: 192 fp32 elements, 768 bytes. AdamW buffer: 128 + 8 elements padded to 144 (576
    bytes), even halves of 288. Step check: 4 parameters + 6 more 8-byte words = 80 bytes."""
    bucket = ("reduce-scatter-v", "dp", "bucket 0", (768, 768))
    adamw = ("reduce-scatter-v", "dp", "adamw", (576, 576))
    check = ("all-gather", "dp", "step check", (80, 80))
    adamw_params = ("all-gather-v", "dp", "adamw parameters", (288, 288))
    # canzona on alpha-balanced: w2 on rank 0 ([0, 64)), w1 on rank 1 ([64, 192))
    plan = small_plan("alpha-balanced")
    assert plan.dp_plan.buckets[0].cuts == (0, 64, 192)
    got = step_collectives(plan, SMALL, "canzona")
    assert step_records(got) == [bucket, adamw, check,
                                 ("all-gather-v", "dp", "parameters of bucket 0", (256, 512)), adamw_params]
    assert [c.phase for c in got] == [BACKWARD, STEP, CHECK, PARAMS, PARAMS]
    assert got[0].segments == (256, 512) and got[0].bucket == 0 and got[1].segments == (288, 288)
    # zero1-gather: even cuts at 96 split w1; the whole bucket's gradients are gathered
    even = ("all-gather-v", "dp", "gradients of bucket 0", (384, 384))
    assert step_records(step_collectives(small_plan("zero1-even"), SMALL, "zero1-gather")) == [
        bucket, adamw, even, check, ("all-gather-v", "dp", "parameters of bucket 0", (384, 384)), adamw_params]
    # layerwise: LPT puts w1 (128 elements) on rank 0 and w2 (64) on rank 1; each packs what it owns
    assert step_records(step_collectives(small_plan("layerwise"), SMALL, "layerwise")) == [
        bucket, adamw, even, check, ("all-gather-v", "dp", "owned parameters of bucket 0", (512, 256)),
        adamw_params]
    # sc: an all-reduce as reduce-scatter + all-gather, the AdamW gradients too, no parameter gather
    assert step_records(step_collectives(small_plan("whole-start"), SMALL, "sc")) == [
        bucket, adamw, even, ("all-gather-v", "dp", "adamw gradients", (288, 288)), check]


def test_known_answers_of_the_megatron_style():
    """What the simulator prices by default: each policy's DP collectives as Megatron-LM runs them.
    AdamW's 136 elements (unpadded) = 544 bytes; the bucket 192 elements = 768 bytes."""
    def dp_part(plan, policy):
        return [(c.op, c.name, c.bytes_per_rank, c.phase, c.total)
                for c in step_collectives(plan, SMALL, policy, style="megatron")]

    grads_ar = ("all-reduce", "grad sync bucket 0", (768, 768), BACKWARD, 768)
    adamw_ar = ("all-reduce", "grad sync adamw", (544, 544), BACKWARD, 544)
    adamw_rs = ("reduce-scatter", "grad sync adamw", (544, 544), BACKWARD, 544)
    adamw_ag = ("all-gather", "param gather adamw", (544, 544), PARAMS, 544)
    assert dp_part(small_plan("whole-start"), "sc") == [grads_ar, adamw_ar]  # nothing gathered after
    assert dp_part(small_plan("alpha-balanced"), "canzona") == [
        ("reduce-scatter-v", "grad sync bucket 0", (256, 512), BACKWARD, None), adamw_rs,
        ("all-gather-v", "param gather bucket 0", (256, 512), PARAMS, None), adamw_ag]
    assert dp_part(small_plan("layerwise"), "layerwise") == [
        grads_ar, adamw_ar, ("all-gather-v", "param gather bucket 0", (512, 256), PARAMS, None), adamw_ag]
    # zero1-gather: the even cut at 96 splits w1 ([64, 192)); both ranks compute it, each fetching
    # the other's part: 32 elements from rank 0 to 1, 96 from rank 1 to 0
    zero1 = step_collectives(small_plan("zero1-even"), SMALL, "zero1-gather", style="megatron")
    (split,) = [c for c in zero1 if c.phase == STEP]
    assert split.op == "all-to-all" and split.sent == ((0, 128), (384, 0)) and split.bytes_per_rank == (128, 384)
    with pytest.raises(SpecError, match="unknown collectives style 'nccl'"):
        step_collectives(small_plan("zero1-even"), SMALL, "zero1-gather", style="nccl")


def test_an_empty_segment_sends_nothing():
    """whole-start gives both matrices to rank 0 here (w1 starts in rank 0's even half)."""
    got = step_collectives(small_plan("whole-start"), SMALL, "canzona")
    assert got[0].segments == (768, 0) and got[0].bytes_per_rank == (768, 768)
    assert got[3].logged() == ("all-gather-v", "dp", "parameters of bucket 0", (768, 0))


def test_bf16_weights_reduce_in_fp32_and_gather_in_bf16():
    bf16 = ModelSpec("small", tuple(replace(p, dtype="bf16") for p in SMALL.params))
    plan = make_plan(bf16, 2, 1, "muon", "alpha-balanced", align=8)
    got = {c.name: c for c in step_collectives(plan, bf16, "canzona")}
    assert got["bucket 0"].bytes_per_rank == (768, 768)  # fp32 master gradients
    assert got["parameters of bucket 0"].bytes_per_rank == (128, 256)  # bf16 working copy
    assert got["adamw parameters"].bytes_per_rank == (144, 144)
    plain = {c.name: c for c in step_collectives(plan, bf16, "canzona", master_weights=False)}
    assert plain["bucket 0"].bytes_per_rank == (384, 384)
    forced = {c.name: c for c in step_collectives(plan, bf16, "canzona", grad_bytes=8, param_bytes=4)}
    assert forced["bucket 0"].bytes_per_rank == (1536, 1536)
    assert forced["parameters of bucket 0"].bytes_per_rank == (256, 512)


def test_tp_first_step_and_clipping():
    model = ModelSpec("small-tp", (ParamSpec("embed", (16, 8), Role.EMBEDDING, tp_dim=0, dtype="fp32"),
                                   ParamSpec("w1", (8, 16), Role.MATRIX, 0, tp_dim=0, dtype="fp32"),
                                   ParamSpec("w2", (8, 8), Role.MATRIX, 0, tp_dim=1, dtype="fp32"),
                                   ParamSpec("norm", (8,), Role.VECTOR, 0, dtype="fp32")))
    plan = make_plan(model, 2, 2, "muon", "alpha-balanced", align=8)
    normal = step_collectives(plan, model, "canzona", 1, 1)
    first = step_collectives(plan, model, "canzona", 1, 1, first_step=True)
    assert first[0].logged() == ("all-gather", "dp", "agreement verdict", (8, 8)) and first[1:] == normal
    # checks: DP step check (4 parameters, the model-loaded mark, 3 flags, norm and clip threshold);
    # TP step check with 2 flags, norm and clip threshold, 4 parameters, the mark and 2 words per
    # replicated one
    checks = [c.logged() for c in normal if c.phase == CHECK]
    assert checks == [("all-gather", "dp", "step check", (80, 80)), ("all-gather", "tp", "tp step check", (88, 88)),
                      ("all-gather", "dp", "tp verdict", (8, 8))]
    # the TP schedule's prefetched gathers (the ones ahead of its first compute) come before the
    # checks, as their buckets land; the rest of its exchanges after them
    sched = tp_schedule(plan, model, STEP_POLICIES["canzona"], 1)
    early = [c for c in normal[:normal.index(next(c for c in normal if c.phase == CHECK))] if c.group == TP_GROUP]
    assert sched.prefetched and [(c.op, c.name, c.sent) for c in early] == \
        [(e.op, e.name, e.sent) for e in sched.exchanges[:len(sched.prefetched)]]
    assert all(e.name.endswith("gather") for e in sched.exchanges[:len(sched.prefetched)])
    # an overlapped step issues every exchange before the checks, and prefetches nothing more
    overlapped = step_collectives(plan, model, "canzona", 1, 1, overlap_step=True)
    before = overlapped[:overlapped.index(next(c for c in overlapped if c.phase == CHECK))]
    assert [c.name for c in before if c.group == TP_GROUP] == [e.name for e in sched.exchanges]
    assert not tp_schedule(plan, model, STEP_POLICIES["canzona"], 1, overlap_step=True).prefetched
    clipped = step_collectives(plan, model, "canzona", 1, 1, inf_norm=True)
    at = max(k for k, c in enumerate(normal) if c.phase == CHECK) + 1
    # step() after the clip rechecks the digest and threshold its reused check saw, and a local
    # problem since, and the model-loaded mark (4 words over DP; 4 over TP: digest, threshold, the
    # DP verdict and the mark); a clip by
    # the 2-norm issues the recheck alone
    recheck = [("all-gather", "dp", "step recheck", (32, 32)), ("all-gather", "tp", "tp step recheck", (32, 32))]
    assert [c.logged() for c in clipped[at:at + 4]] == [("all-gather", "dp", "gradient norm", (8, 8)),
                                                        ("all-gather", "tp", "gradient norm", (8, 8)), *recheck]
    assert clipped[:at] + clipped[at + 4:] == normal
    two_norm = step_collectives(plan, model, "canzona", 1, 1, clipped=True)
    assert [c.logged() for c in two_norm[at:at + 2]] == recheck and two_norm[:at] + two_norm[at + 2:] == normal
    # DP 1 x TP 1 plans give no agreement verdict (it is spread over DP only under TP)
    assert step_collectives(small_plan("alpha-balanced"), SMALL, "canzona", first_step=True) == \
        step_collectives(small_plan("alpha-balanced"), SMALL, "canzona")


def test_a_skipped_step_looks_at_the_weights_and_sends_nothing_after_the_checks():
    """`skipped=True` (a non-finite norm, finite weights: the step skipped): after the checks the
    weights' finiteness, one word over DP then over TP (the runtime's `nonfinite_weights_error`),
    before a clip's records; nothing after the checks (the TP exchanges still to run, the
    parameter gathers); what came before them as in a regular step. The runtime's log of a
    skipped step: tests/runtime/test_runtime_habits.py."""
    model = ModelSpec("small-tp", (ParamSpec("embed", (16, 8), Role.EMBEDDING, tp_dim=0, dtype="fp32"),
                                   ParamSpec("w1", (8, 16), Role.MATRIX, 0, tp_dim=0, dtype="fp32"),
                                   ParamSpec("w2", (8, 8), Role.MATRIX, 0, tp_dim=1, dtype="fp32"),
                                   ParamSpec("norm", (8,), Role.VECTOR, 0, dtype="fp32")))
    plan = make_plan(model, 2, 2, "muon", "alpha-balanced", align=8)
    weights = [("all-gather", "dp", "non-finite weights", (8, 8)), ("all-gather", "tp", "non-finite weights", (8, 8))]
    for options in ({}, {"inf_norm": True}, {"overlap_step": True}, {"first_step": True}):
        normal = step_collectives(plan, model, "canzona", 1, 1, **options)
        skipped = step_collectives(plan, model, "canzona", 1, 1, skipped=True, **options)
        at = max(k for k, c in enumerate(normal) if c.phase == CHECK and not c.name.endswith("recheck")) + 1
        clip = [c for c in normal[at:] if c.phase == CLIP or c.name.endswith("recheck")]
        assert skipped == normal[:at] + [c for c in skipped[at:at + 2]] + clip, options
        assert [c.logged() for c in skipped[at:at + 2]] == weights and all(c.phase == CHECK for c in skipped[at:at + 2])
    # DP alone: one word over DP; the Megatron style lists no checks
    plan = small_plan("alpha-balanced")
    assert [c.logged() for c in step_collectives(plan, SMALL, "canzona", skipped=True) if c.phase == CHECK][-1] == \
        ("all-gather", "dp", "non-finite weights", (8, 8))
    with pytest.raises(SpecError, match="skipped step's collectives are the runtime's"):
        step_collectives(plan, SMALL, "canzona", skipped=True, style="megatron")


def test_bad_arguments():
    plan = small_plan("alpha-balanced")
    with pytest.raises(SpecError, match="tp rank 1 is outside"):
        step_collectives(plan, SMALL, "canzona", tp_rank=1)
    with pytest.raises(SpecError, match="dp rank 2 is outside"):
        step_collectives(plan, SMALL, "canzona", dp_rank=2)
    with pytest.raises(SpecError, match="keeps every matrix whole"):
        step_collectives(small_plan("layerwise"), SMALL, "canzona")
    with pytest.raises(SpecError, match="needs a zero1-even plan"):
        step_collectives(plan, SMALL, "zero1-gather")
    with pytest.raises(SpecError, match="unknown policy"):
        step_collectives(plan, SMALL, "zero2")
    with pytest.raises(SpecError, match="unknown TP mode"):
        step_collectives(plan, SMALL, "canzona", tp_mode="eager")
    with pytest.raises(PlanError, match="plan was made for model"):
        step_collectives(plan, ModelSpec("other", SMALL.params[:3]), "canzona")
    mixed = ModelSpec("small", (*SMALL.params[:2], replace(SMALL.params[2], dtype="bf16"), SMALL.params[3]))
    with pytest.raises(SpecError, match="must share a dtype"):
        step_collectives(make_plan(mixed, 2, 1, "muon", "alpha-balanced", align=8), mixed, "canzona")


def test_expert_parallelism_known_answers():
    """A dense part of two matrices (one bucket each, DP 4) and an EP rank's two expert stacks of
    two 8 x 8 matrices (four buckets, EDP 2), bf16 with fp32 masters. Backward's reductions merge
    by layer, the experts' first at each; then the experts' AdamW buffer (no parameter: one padded
    fp32 slice per rank) and check over EDP, the dense part's over DP, the dense gathers, the
    experts'. Megatron's style has no expert AdamW buffer and no checks."""
    from canzona.experts import dense_part, expert_part
    from canzona.plan import PlanSettings, plan_for
    from canzona.step_collectives import EDP_GROUP, Experts, check_runtime_experts

    params = [ParamSpec("embed", (16, 8), Role.EMBEDDING, dtype="bf16")]
    for i in range(2):
        params += [ParamSpec(f"l{i}.attn", (8, 8), Role.MATRIX, i, dtype="bf16"),
                   ParamSpec(f"l{i}.router", (4, 8), Role.ROUTER, i, dtype="bf16"),
                   ParamSpec(f"l{i}.experts", (4, 8, 8), Role.EXPERT, i, dtype="bf16", matrix_shape=(8, 8))]
    model = ModelSpec("moe", tuple(params))
    dense, experts = dense_part(model), expert_part(model, 2)
    settings = PlanSettings(bucket_size=64, align=8)
    plan, expert_plan = plan_for(dense, 4, 1, "muon", "canzona", settings), plan_for(experts, 2, 1, "muon", "canzona",
                                                                                      settings)
    got = step_collectives(plan, dense, "canzona", 1, experts=Experts(expert_plan, experts, 0))
    assert [(c.group, c.name) for c in got if c.phase == BACKWARD] == [
        (EDP_GROUP, "bucket 0"), (EDP_GROUP, "bucket 1"), ("dp", "bucket 0"),  # layer 1
        (EDP_GROUP, "bucket 2"), (EDP_GROUP, "bucket 3"), ("dp", "bucket 1")]  # layer 0
    assert step_records([c for c in got if c.phase != BACKWARD]) == [
        ("reduce-scatter-v", "edp", "adamw", (64, 64)),  # 8 x 2 fp32 elements
        ("all-gather", "edp", "step check", (64, 64)),  # 2 expert stacks + 6 words
        ("reduce-scatter-v", "dp", "adamw", (768, 768, 768, 768)),
        # 5 dense parameters + the 2 expert stacks' flags (combined over the cluster) + 6 words
        ("all-gather", "dp", "step check", (104, 104, 104, 104)),
        ("all-gather-v", "dp", "parameters of bucket 0", (128, 0, 0, 0)),
        ("all-gather-v", "dp", "parameters of bucket 1", (0, 128, 0, 0)),
        ("all-gather-v", "dp", "adamw parameters", (96, 96, 96, 96)),
        *[("all-gather-v", "edp", f"parameters of bucket {k}", (128, 0) if k % 2 == 0 else (0, 128)) for k in range(4)],
        ("all-gather-v", "edp", "adamw parameters", (32, 32))]  # fp32, whatever the forced bytes
    forced = step_collectives(plan, dense, "canzona", 1, param_bytes=2, experts=Experts(expert_plan, experts, 0))
    assert forced[-1].logged() == ("all-gather-v", "edp", "adamw parameters", (32, 32))
    megatron = step_collectives(plan, dense, "canzona", 1, experts=Experts(expert_plan, experts, 0), style="megatron")
    assert not [c for c in megatron if c.group == EDP_GROUP and "adamw" in c.name]
    assert [c.name for c in megatron if c.phase == BACKWARD][-1] == "grad sync adamw"  # at the end of backward
    # what the runtime does not run of expert parallelism
    # an overlapped step: the experts exchange nothing at expert TP 1, so their records are the same
    overlapped = step_collectives(plan, dense, "canzona", experts=Experts(expert_plan, experts), overlap_step=True)
    plain = step_collectives(plan, dense, "canzona", experts=Experts(expert_plan, experts))
    assert [c for c in overlapped if c.group == EDP_GROUP] == [c for c in plain if c.group == EDP_GROUP]
    with pytest.raises(SpecError, match="the runtime runs one step policy"):
        step_collectives(plan, dense, "canzona", experts=Experts(expert_plan, experts, policy="layerwise"))
    with pytest.raises(SpecError, match="at etp 1"):
        check_runtime_experts(2, 2)
    check_runtime_experts(2, 1)  # a TP dense part runs (tests/runtime/test_runtime_expert_parallel_tp.py)


# --- properties on random models --------------------------------------------------------------

PHASE_CODE = {BACKWARD: "b", STEP: "s", CHECK: "c", CLIP: "n", PARAMS: "p"}


@st.composite
def setups(draw):
    model, tp = draw(models())
    dtype = draw(st.sampled_from(["fp32", "bf16"]))
    model = ModelSpec(model.name, tuple(replace(p, dtype=dtype) for p in model.params))
    policy = STEP_POLICIES[draw(st.sampled_from(sorted(STEP_POLICIES)))]
    dp = draw(st.integers(1, 4))
    largest = max(p.local_numel(tp) for p in model.matrix_params())
    bucket_size = draw(st.sampled_from([None, largest, 3 * largest]))
    plan = make_plan(model, dp, tp, "muon", policy.dp_policy or draw(st.sampled_from(sorted(KEEPS_GEOMETRY))),
                     policy.tp_policy or draw(st.sampled_from(sorted(TP_POLICIES))), align=8,
                     bucket_size=bucket_size)
    return {"model": model, "plan": plan, "policy": policy, "mode": draw(st.sampled_from([PIPELINED, SERIAL])),
            "master": draw(st.booleans()), "first": draw(st.booleans()), "clip": draw(st.booleans())}


@settings(max_examples=80, deadline=None)
@given(setups())
def test_step_collectives_on_random_models(s):
    model, plan, policy, mode = s["model"], s["plan"], s["policy"], s["mode"]
    dp, tp = plan.dp, plan.tp
    low = model.params[0].dtype == "bf16"
    pbytes = 2 if low else 4
    gbytes = 4 if s["master"] or not low else 2
    buckets = plan.dp_plan.buckets
    adamw_numel = sum(p.local_numel(tp) for p in model.adamw_params())
    adamw_size = ceil_to(max(adamw_numel, 1), 8 * dp)
    dp_part = None
    for i in range(dp):
        for t in range(tp):
            got = step_collectives(plan, model, policy, i, t, tp_mode=mode, master_weights=s["master"],
                                   first_step=s["first"], inf_norm=s["clip"])
            assert all(isinstance(c, StepCollective) for c in got)
            # the phases come in the runtime's order
            codes = "".join(PHASE_CODE[c.phase] for c in got)
            first = "c" if s["first"] and tp > 1 else ""
            assert re.fullmatch(f"{first}b+s+c+{'n+c+' if s['clip'] else ''}s*p*", codes), codes
            assert ("p" in codes) == policy.gathers_params
            # the DP collectives are the same on every rank of the cluster
            dp_records = [c for c in got if c.group == DP_GROUP]
            if dp_part is None:
                dp_part = dp_records
            assert dp_records == dp_part
            # every bucket: one reduce-scatter-v of the whole bucket, launched in bucket order
            rs = [c for c in got if c.op == REDUCE_SCATTER_V and c.bucket is not None]
            assert [c.bucket for c in rs] == [b.index for b in buckets]
            for c, b in zip(rs, buckets):
                assert c.bytes_per_rank == (b.size * gbytes,) * dp
                assert sum(c.segments) == b.size * gbytes
                cuts = b.cuts if policy.grad_sync == "reduce-scatter" else even_cuts(b.size, dp)
                assert c.segments == tuple(gbytes * (y - x) for x, y in zip(cuts, cuts[1:]))
            # the AdamW buffer: padded to a multiple of align x dp, reduced whole, even segments
            (adamw,) = [c for c in got if c.name == "adamw"]
            assert adamw.bytes_per_rank == (adamw_size * gbytes,) * dp
            assert sum(adamw.segments) == adamw_size * gbytes
            assert adamw_numel <= adamw_size < max(adamw_numel, 1) + 8 * dp
            # what each bucket's collectives move adds up to the bucket
            for b in buckets:
                mine = [c for c in got if c.bucket == b.index]
                kinds = [c.name.removesuffix(f" of bucket {b.index}") for c in mine]
                want = [f"bucket {b.index}"]
                if policy.grad_sync == "all-reduce" or policy.gather_split:
                    want.append("gradients")
                if policy.gathers_params:
                    want.append("owned parameters" if policy.name == "layerwise" else "parameters")
                assert kinds == want
                for c in mine[1:]:
                    assert c.op == ALL_GATHER_V and c.bytes_per_rank == c.segments
                    if c.phase == STEP:
                        assert sum(c.bytes_per_rank) == b.size * gbytes
                    elif policy.name == "layerwise":  # only the parameters, packed without padding
                        assert sum(c.bytes_per_rank) == sum(p.numel for p in b.params) * pbytes
                    else:
                        assert c.bytes_per_rank == tuple(pbytes * (y - x) for x, y in zip(b.cuts, b.cuts[1:]))
            # the step check carries one int64 per parameter and six more words (the model-loaded
            # mark, three flags, the rank's share of the gradient norm, its clip threshold)
            (check,) = [c for c in got if c.name == "step check"]
            assert check.bytes_per_rank == (8 * (len(model.params) + 6),) * dp
            # the TP records are the schedule's, in its order; an all-to-all logs the row this rank sends
            tp_records = [c for c in got if c.group == TP_GROUP and c.phase == STEP]
            sched = tp_schedule(plan, model, policy, i, mode, gbytes, 4 if s["master"] and low else gbytes)
            assert [(c.op, c.name, c.sent) for c in tp_records] == [(e.op, e.name, e.sent) for e in sched.exchanges]
            for c in tp_records:
                if c.op == ALL_TO_ALL:
                    assert c.bytes_per_rank == c.sent[t] and c.sent[t][t] == 0
                else:
                    assert c.op == ALL_GATHER and len(set(c.bytes_per_rank)) == 1
            if tp == 1:
                assert all(c.group == DP_GROUP for c in got)


# --- the runtime's logs -----------------------------------------------------------------------


def runtime_steps(result: dict) -> list[list[tuple]]:
    """Per step, (op, group, name, bytes per rank) of every collective a rank logged, DP and TP
    together in the order it issued them; each log's own `order` counts its records."""
    for log in (result["log"], result["tp_log"]):
        assert [x["order"] for x in log] == list(range(len(log)))
    records = sorted(result["log"] + result["tp_log"], key=lambda x: x["seq"])
    assert [x["seq"] for x in records] == list(range(len(records)))
    steps = 1 + max(x["step"] for x in records)
    assert [x["step"] for x in records] == sorted(x["step"] for x in records)
    return [[(x["op"], x["group"], x["name"], tuple(x["bytes_per_rank"])) for x in records if x["step"] == s]
            for s in range(steps)]


def assert_logs_are_the_step_collectives(results: list[dict], train) -> None:
    from reference.tiny_model import get_preset, model_spec

    model = model_spec(get_preset(train.preset), train.dtype)
    for res in results:
        steps = runtime_steps(res)
        assert len(steps) == train.steps
        for s, got in enumerate(steps):
            want = step_collectives(res["plan"], model, train.policy, res["dp_rank"], res["tp_rank"],
                                    tp_mode=train.tp_mode, master_weights=train.master_weights,
                                    first_step=s == 0, overlap_step=train.overlap_step,
                                    clipped=train.clip_norm is not None)
            assert got == step_records(want), (res["dp_rank"], res["tp_rank"], s)


def _import(name: str):
    """A runtime test module (they import torch, so only inside the distributed tests): the module
    pytest imported (by its basename, `tests/runtime/` on sys.path) when it collected it, whose
    spawned runs are cached (the checks below run from its tests); else imported from the package."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:  # tests/runtime/ not collected in this session
        return importlib.import_module(f"tests.runtime.{name}")


TP_LAYOUT = "dp2xtp2"


def check_dp2_logs_are_the_step_collectives() -> None:
    """Every step policy and DP policy of canzona (each with Muon, SOAP and Shampoo), accumulation
    over two micro-batches, a plan with an idle owner: both ranks' logs, step by step; and what the
    simulator issues on the same plan in the runtime's collectives mode (the structure half of
    validating the simulator against the runtime)."""
    equivalence = _import("test_runtime_equivalence")
    jobs = {label: spec for label, spec, extra in equivalence.jobs_for(2) if not extra["state_dict"]}
    assert {spec.policy for spec in jobs.values()} == set(STEP_POLICIES)
    assert any(spec.accumulation > 1 for spec in jobs.values())
    for label, train in jobs.items():
        try:
            assert_logs_are_the_step_collectives(equivalence.distributed(2, label), train)
            assert_simulator_issues_the_logged_collectives(equivalence.distributed(2, label), train)
        except AssertionError as e:
            raise AssertionError(f"{label}: {e}") from None


def check_dp2xtp2_logs_are_the_step_collectives() -> None:
    """Every rank of DP 2 x TP 2, DP and TP collectives interleaved as the step issues them:
    canzona with every TP scheduler, pipelined and serial, the baselines, capacity extremes, the
    DTensor model, accumulation, bf16 weights and clipping."""
    tp = _import("test_runtime_tp")
    cases = tp.fast_cases(TP_LAYOUT)  # SOAP / Shampoo at DP x TP: make test-all (their logs: the random models above)
    specs = [spec for spec, _ in cases.values()]
    assert {("greedy-rollback", PIPELINED), ("greedy-rollback", SERIAL)} <= \
        {(s.tp_policy, s.tp_mode) for s in specs if s.policy == "canzona"}
    assert {s.policy for s in specs} == set(STEP_POLICIES)
    assert {s.tp_style for s in specs} == {"megatron", "dtensor"}
    assert any(s.accumulation > 1 for s in specs) and any(s.clip_norm for s in specs)
    assert any(s.dtype == "bf16" for s in specs)
    for key, (train, _) in cases.items():
        try:
            assert_logs_are_the_step_collectives(tp.runs(TP_LAYOUT, key), train)
            if train.tp_style == "megatron":  # the simulator's spec is the Megatron-style model's
                assert_simulator_issues_the_logged_collectives(tp.runs(TP_LAYOUT, key), train)
        except AssertionError as e:
            raise AssertionError(f"{key}: {e}") from None


# --- the simulator issues the same collectives -------------------------------------------------


def simulated_step(res: dict, train) -> list[tuple]:
    """What the simulator, run in the runtime's collectives mode on the run's own plan, issues on
    that rank in one step (the simulator does not model the first step's agreement verdict; an
    explicit `clip_grad_norm_` it models as `explicit_clip`)."""
    from canzona.spec import DTYPE_BYTES
    from reference.tiny_model import get_preset, model_spec
    from sim.engine import issued_records
    from sim.options import RunOptions
    from sim.simulate import SimConfig, simulate
    from sim.workload import Workload

    plan, model = res["plan"], model_spec(get_preset(train.preset), train.dtype)
    arch = get_preset(train.preset).as_catalog().architecture()
    low = train.dtype in ("bf16", "fp16") and train.master_weights
    wl = Workload(seq_len=16, global_batch=plan.dp, grad_bytes=4 if low else DTYPE_BYTES[train.dtype],
                  param_bytes=DTYPE_BYTES[train.dtype], dtype="fp32")
    cfg = SimConfig(model=model.name, gpus=plan.dp * plan.tp, tp=plan.tp, optimizer=plan.optimizer,
                    policy=train.policy, tp_mode=train.tp_mode, workload=wl, zero1_fallback=False,
                    options=RunOptions(overlap_param_gather=False, collectives="runtime",
                                       overlap_step=train.overlap_step, explicit_clip=train.clip_norm is not None))
    result = simulate(cfg, plan=plan, model=(model, arch), replicate_phase_a=False)  # every rank's own records
    rank = res["dp_rank"] * plan.tp + res["tp_rank"]  # TP fastest, as the simulator orders ranks
    return [tuple(r) for r in issued_records(result.collective_records, rank)]


def assert_simulator_issues_the_logged_collectives(results: list[dict], train) -> None:
    for res in results:
        logged = runtime_steps(res)[-1]  # a step after the first
        assert simulated_step(res, train) == logged, (res["dp_rank"], res["tp_rank"])
