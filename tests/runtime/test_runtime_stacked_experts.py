"""Stacked experts in the runtime (issue 20; docs/design.md §2.6, §8.2): a mixture-of-experts model
whose experts are `[experts, m, n]` tensors trains under `DistributedOptimizer` with each expert
matrix owned whole, bit for bit what the same kernels compute in one process (rung 3 of the
verification ladder, docs/architecture.md §5), within 1e-5 of the independent references; its
checkpoints (full and sharded) load at another DP size and bucket layout and continue bit for bit.

The stacks' buckets are views of the stacked parameters (no copy of the experts' weights): checked
on the plans (every stack bucket a consecutive, unpadded run in memory order) and on a live
optimizer (the parameter's storage is the buckets' storage).

One DP 2 spawn runs every training configuration; one DP 1 spawn resumes from its checkpoints.
"""

from __future__ import annotations

import functools
import os
import tempfile
from dataclasses import replace

import pytest
import torch

from canzona.harness.launch import run_ranks
from canzona.harness.training import (
    TrainSpec,
    build_model,
    compare,
    emulate,
    many_specs_worker,
    reference_run,
)
from canzona.plan import make_plan
from canzona.runtime.checkpoint import STACK_KEY

pytestmark = pytest.mark.distributed  # spawns gloo process groups

DEADLINE_S = 180.0
BUCKET = 1024  # two 16 x 32 expert matrices: every stack spans several buckets
MATRIX_CONFIG = {"muon": {"ns_dtype": "fp32"}, "normuon": {"ns_dtype": "fp32"},
                 "soap": {"precondition_frequency": 2}, "shampoo": {"precondition_frequency": 2}, "adamw": {}}
OPTIMIZERS = ("muon", "normuon", "soap", "shampoo", "adamw")
REL_TOL = 1e-5  # against the independent references (SOAP's and Shampoo's eigensolvers differ)
SAVED = ("muon", "soap", "adamw")  # checkpointed at DP 2, resumed at DP 1


def spec_for(optimizer: str, **changes) -> TrainSpec:
    base = TrainSpec(preset="tiny-moe", optimizer=optimizer, steps=3, global_batch=8, seq_len=8,
                     bucket_size=BUCKET, matrix_config=dict(MATRIX_CONFIG[optimizer]))
    return replace(base, **changes)


def jobs(checkpoints: str) -> list[tuple[str, TrainSpec, dict]]:
    out = []
    for opt in OPTIMIZERS:
        extra = {"save_sharded": os.path.join(checkpoints, opt)} if opt in SAVED else {}
        out.append((opt, spec_for(opt), extra))
    out += [
        ("paper-dp-policy", spec_for("muon", dp_policy="alpha-balanced"), {}),
        ("zero1-gather", spec_for("muon", policy="zero1-gather"), {}),
        ("layerwise", spec_for("soap", policy="layerwise"), {}),
        ("sc", spec_for("muon", policy="sc"), {}),
        ("one-bucket-per-stack", spec_for("shampoo", bucket_size=None), {}),
        ("habits", spec_for("muon", accumulation=2, clip_norm=0.05, zero_grad="model"), {}),
        ("overlap-step", spec_for("soap", overlap_step=True), {}),
        ("bf16", spec_for("muon", dtype="bf16"), {}),
        ("hf-qwen3-moe", spec_for("muon", preset="hf-qwen3-moe", bucket_size=None), {}),
    ]
    return out


@functools.cache
def runs() -> dict:
    checkpoints = tempfile.mkdtemp(prefix="canzona-stacks-")
    todo = jobs(checkpoints)
    try:
        results = run_ranks(many_specs_worker, 2, [s for _, s, _ in todo], [e for _, _, e in todo],
                            deadline_s=DEADLINE_S, collective_timeout_s=60)
    except Exception as e:  # noqa: BLE001 - replayed by every test that needs it
        return {"error": e}
    out = {label: (spec, extra, [results[r][i] for r in range(2)]) for i, (label, spec, extra) in enumerate(todo)}
    resume = []
    for opt in SAVED:
        spec, extra, ranks = out[opt]
        params = ranks[0]["params"]
        later = replace(spec, steps=2, data_seed=7, bucket_size=None)  # another layout of the buckets
        resume += [((opt, "full"), later, {"load": (params, ranks[0]["state"])}),
                   ((opt, "sharded"), later, {"load": (params, extra["save_sharded"]), "check_weights": True})]
    try:
        resumed = run_ranks(many_specs_worker, 1, [s for _, s, _ in resume], [e for _, _, e in resume],
                            deadline_s=DEADLINE_S, collective_timeout_s=60)
    except Exception as e:  # noqa: BLE001
        return {"error": e}
    for i, (label, spec, extra) in enumerate(resume):
        out[label] = (spec, extra, [resumed[0][i]])
    return out


def run(label) -> tuple[TrainSpec, dict, list[dict]]:
    got = runs()
    if "error" in got:
        err = got["error"]
        pytest.fail(f"a spawned group failed: {err}\n{getattr(err, 'trace', '')}")
    return got[label]


LABELS = [*OPTIMIZERS, "paper-dp-policy", "zero1-gather", "layerwise", "sc", "one-bucket-per-stack", "habits",
          "overlap-step", "bf16", "hf-qwen3-moe"]


@pytest.mark.parametrize("label", LABELS)
def test_stacked_experts_train_bit_for_bit_as_the_same_kernels_in_one_process(label):
    spec, _, ranks = run(label)
    want = emulate(spec, 2)
    for r, res in enumerate(ranks):
        cmp = compare(res["params"], want)
        assert cmp["bit_identical"], f"{label}, rank {r}: {cmp}"
    if spec.dtype == "fp32":
        cmp = compare(ranks[0]["params"], reference_run(spec, 2))
        assert cmp["max_rel_diff"] <= REL_TOL, f"{label} against the references: {cmp}"
    if label == "overlap-step":
        assert ranks[0]["overlapped_steps"] == spec.steps


def test_each_expert_matrix_is_owned_whole_by_one_rank():
    spec, _, ranks = run("muon")
    model = build_model(spec).spec()
    matrices = {m.name for p in model.stacks for m in model.matrix_params() if m.stacked_in and m.stacked_in[0] == p.name}
    owned = [set(r["owned"]) & matrices for r in ranks]
    assert owned[0] and owned[1] and not owned[0] & owned[1] and owned[0] | owned[1] == matrices


@pytest.mark.parametrize("optimizer", SAVED)
@pytest.mark.parametrize("form", ["full", "sharded"])
def test_a_checkpoint_with_stacks_resumes_at_another_dp_size_bit_for_bit(optimizer, form):
    saved_spec, _, saved = run(optimizer)
    spec, _, ranks = run((optimizer, form))
    want = emulate(spec, 1, load=(saved[0]["params"], saved[0]["state"]))
    cmp = compare(ranks[0]["params"], want)
    assert cmp["bit_identical"], f"{optimizer} resumed from the {form} checkpoint: {cmp}"


def test_the_state_dict_holds_one_entry_per_stacked_parameter():
    spec, _, ranks = run("soap")
    state = ranks[0]["state"]
    names = [n for group in state["param_names"] for n in group]
    model = build_model(spec)
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())  # one entry per parameter
    stacks = {p.name: p for p in model.spec().stacks}
    entries = dict(zip(names, (state["state"][k] for g in state["param_groups"] for k in g["params"])))
    for name, p in stacks.items():
        entry = entries[name]
        assert entry[STACK_KEY] == p.stack_size
        assert entry["exp_avg"].shape == (p.stack_size, *p.matrix_shape)
        assert entry["GG_L"].shape == (p.stack_size, p.matrix_shape[0], p.matrix_shape[0])
        assert entry["step"] == spec.steps - 1  # SOAP's first step only sets up its preconditioners
    assert ranks[1]["state"]["state"].keys() == state["state"].keys()


# --- layout, without spawning -------------------------------------------------------------------


@pytest.mark.parametrize("dp_policy", ["alpha-balanced-reorder", "alpha-balanced", "whole-start", "zero1-even",
                                       "layerwise"])
@pytest.mark.parametrize("bucket_size", [BUCKET, 1536, None])
def test_stack_buckets_read_last_to_first_hold_the_stacks_as_they_lie(dp_policy, bucket_size):
    """Buckets of stack matrices only, unpadded, and a run of them, read from the last to the
    first, holds each stack's matrices one after another in memory order: what lets the runtime
    keep the stacks and those buckets in one storage."""
    model = build_model(spec_for("muon")).spec()
    plan = make_plan(model, 3, 1, "muon", dp_policy, bucket_size=bucket_size)
    order: list[tuple[str, int]] = []  # (stack, k) as the runs lay them out
    run: list = []
    for b in [*plan.dp_plan.buckets, None]:
        stacked = b is not None and model.param(b.params[0].name).stacked_in is not None
        if stacked:
            assert all(model.param(p.name).stacked_in for p in b.params), f"bucket {b.index} mixes kinds"
            assert b.size == sum(p.numel for p in b.params)  # unpadded
            assert len({p.numel for p in b.params}) == 1  # alike matrices only
            run.append(b)
            continue
        for r in reversed(run):
            order += [model.param(p.name).stacked_in for p in sorted(r.params, key=lambda p: p.offset)]
        run = []
    stacks = [p for p in model.params if p.matrix_shape is not None]
    assert order == [(p.name, k) for p in stacks for k in range(p.stack_size)]


def test_the_buckets_are_views_of_the_stacked_parameters():
    """A world of one rank in this process: the stack's storage is its buckets' storage."""
    import torch.distributed as dist

    from canzona.runtime.optimizer import DistributedOptimizer

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # no port to race for
    try:
        model = build_model(spec_for("muon"))
        opt = DistributedOptimizer(model.named_parameters(), model.spec(), "muon", bucket_size=BUCKET)
        stack = model.model.layers[0].mlp.experts.gate_up_proj
        base = stack.data_ptr()
        end = base + stack.numel() * stack.element_size()
        inside = [b for b in opt.grads.buckets if base <= b.data.data_ptr() < end]
        assert len(inside) == stack.numel() // BUCKET  # the stack spans several buckets
        assert sum(b.data.numel() for b in inside) == stack.numel()
        before = stack.detach().clone()
        inside[0].data.add_(1.0)  # writes through the bucket reach the parameter
        assert not torch.equal(stack.detach(), before)
        # one bucket of every stack (the default size): the stacks lie one after another in it
        model = build_model(spec_for("muon"))
        opt = DistributedOptimizer(model.named_parameters(), model.spec(), "muon")
        stacks = [p for n, p in model.named_parameters() if n.endswith("_proj")]
        assert [a.data_ptr() + a.numel() * a.element_size() for a in stacks[:-1]] == [b.data_ptr() for b in stacks[1:]]
    finally:
        dist.destroy_process_group()


def test_a_plan_that_lays_a_stack_out_otherwise_is_refused():
    """A hand-made plan (or one from before stacks had buckets of their own) whose stack bucket
    holds the matrices in another order: one error at construction."""
    import torch.distributed as dist

    from canzona.errors import PlanError
    from canzona.runtime.optimizer import DistributedOptimizer

    model = build_model(spec_for("muon"))
    spec = model.spec()
    plan = make_plan(spec, 1, 1, "muon", "alpha-balanced-reorder", bucket_size=BUCKET)
    buckets = list(plan.dp_plan.buckets)
    k = next(i for i, b in enumerate(buckets) if "[" in b.params[0].name)
    b = buckets[k]
    swapped = (replace(b.params[0], name=b.params[1].name), replace(b.params[1], name=b.params[0].name), *b.params[2:])
    buckets[k] = replace(b, params=swapped)
    bad = replace(plan, dp_plan=replace(plan.dp_plan, buckets=tuple(buckets)))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # no port to race for
    try:
        with pytest.raises(PlanError, match="does not lay the matrices of stack .* out as the parameter holds them"):
            DistributedOptimizer(model.named_parameters(), spec, "muon", plan=bad)
    finally:
        dist.destroy_process_group()
