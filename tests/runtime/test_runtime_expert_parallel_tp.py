"""Expert parallelism with a tensor-parallel dense part (issue 20; docs/design.md §2.7,
`canzona/runtime/expert_part.py`): Megatron's MoE parallel folding with expert TP 1 at DP 2 x TP 2,
the experts' EP groups of 2 and EDP groups of 2 folded over the 4 ranks (EP 4, EDP 1 too). The
tiny MoE with attention (`tiny-moe-attn`, `reference/tiny_moe_ep.py`): q, k, v and the head
column-parallel, o row-parallel, the embedding vocabulary-parallel, the router and norms
replicated, each TP rank dispatching its share of its DP rank's tokens to the experts' EP ranks.

- the global gradients the ranks' reductions assemble are the single-process model's global mean
  loss's (within rounding): the experts' `edp / dp` scale is exact; the global gradient norm on
  every rank is theirs, every element counted once;
- training is bit for bit what the same kernels compute in one process fed those gradients, and
  within 1e-5 of the independent references, for Muon, NorMuon, SOAP, Shampoo and AdamW, with
  accumulation and clipping, at EP 4, and on the attention-free `tiny-moe` (whose dense part is
  AdamW's alone); in bf16 with fp32 masters (Muon), bit for bit the same kernels too;
- every rank's DP, TP and EDP logs are `step_collectives` of its ranks, record for record, and the
  simulator in the runtime's collectives mode plans the same two plans and issues the same records;
- a NaN in one rank's expert gradient skips (or fails) the step on every rank, nothing updated;
- a decoder layer no rank's forward runs in a step (LayerDrop): its expert stacks, which no rank of
  the cluster reached, are skipped as one process skips them, bit for bit the same kernels (Muon);
- an expert mesh that does not fold the dense mesh's ranks is one `SpecError` on every rank, and
  experts that differ within an EDP group one `PlanError` on every rank;
- checkpoints taken at DP 2 x TP 2 x EP 2 (full and sharded) resume bit for bit at DP 4 x EP 2
  (TP 1) and at TP 2 x EP 2 on 2 ranks.

One spawn of 4 ranks runs every job, the NaN jobs and the refusal; one of 4 and one of 2 resume.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import pytest
import torch

from canzona.harness.training import (
    TrainSpec,
    build_model,
    compare,
    global_batches,
    global_gradients,
    global_gradients_from,
    many_specs_worker,
    torch_threads,
)
from tests.runtime.expert_runs import (
    check_logged_collectives,
    check_resumed,
    check_same_kernels,
    check_simulated_collectives,
    replay,
    resumed_runs,
    saving_spawn,
    skipped_layer_job,
)
from tests.runtime.outcomes import outcome

pytestmark = pytest.mark.distributed  # spawns gloo process groups

WORLD, DP = 4, 2  # DP 2 x TP 2
DEADLINE_S = 240.0
MATRIX_CONFIG = {"muon": {"ns_dtype": "fp32"}, "normuon": {"ns_dtype": "fp32"},
                 "soap": {"precondition_frequency": 2}, "shampoo": {"precondition_frequency": 2}, "adamw": {}}
REL_TOL = 1e-5


def spec_for(optimizer: str, **changes) -> TrainSpec:
    base = TrainSpec(preset="tiny-moe-attn", optimizer=optimizer, tp=2, ep=2, steps=3, global_batch=8, seq_len=8,
                     bucket_size=1024, matrix_config=dict(MATRIX_CONFIG[optimizer]))
    return replace(base, **changes)


JOBS = {
    **{opt: spec_for(opt) for opt in MATRIX_CONFIG},
    "habits": spec_for("muon", accumulation=2, global_batch=16, clip_norm=0.05, zero_grad="model"),
    "ep4": spec_for("soap", ep=4, clip_norm=0.05),  # EDP 1: the experts' scale tp / ep = 1 / 2
    "tiny-moe": spec_for("shampoo", preset="tiny-moe"),  # no attention: the dense part is AdamW's
    # both parts' updates computed as their buckets land: the dense part's TP exchanges before the
    # step check, the experts' (TP 1) with none
    "overlap": spec_for("muon", overlap_step=True),
    "bf16": spec_for("muon", dtype="bf16"),  # fp32 masters, main grads and reductions
}
SAVED = ("muon", "soap", "adamw")  # checkpointed at DP 2 x TP 2 x EP 2
RESUMED = ((4, 1), (2, 2))  # (world, tp) of the runs that load them, at EP 2
SKIPPED = spec_for("muon", steps=2)  # layer 1 skipped by every rank in the first step


def nonfinite_job(rank: int, world: int, policy: str) -> dict:
    """The last rank's gradient of one expert stack is NaN at the second step (nothing else is)."""
    from canzona.harness.training import micro_batches, parallel_model
    from canzona.runtime.optimizer import DistributedOptimizer

    spec = JOBS["muon"]
    model, mspec, group, expert_mesh, dp_rank = parallel_model(spec, rank, world)
    opt = DistributedOptimizer(model.named_parameters(), mspec, "muon", spec.matrix_config, group=group,
                               expert_mesh=expert_mesh, nonfinite=policy, reduce_scatter=spec.reduce_scatter,
                               bucket_size=spec.bucket_size)
    poisoned = [False]
    if rank == world - 1:
        stack = model.model.layers[1].mlp.experts.down_proj
        stack.register_hook(lambda g: torch.full_like(g, math.nan) if poisoned[0] else g)
    batches = [micro_batches(t, dp_rank, spec.dp_size(world), 1)[0] for t in global_batches(spec, 64)]

    def step(tokens: torch.Tensor) -> None:
        opt.zero_grad()
        model.loss(tokens).backward()
        opt.step()
        opt.wait_params()

    def weights() -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    step(batches[0])
    before = weights()
    poisoned[0] = True
    out = outcome(lambda: step(batches[1]))
    poisoned[0] = False
    out["unchanged"] = compare(weights(), before)["bit_identical"]
    out["skipped"] = opt.skipped_steps
    if out["error"] is None:  # skipped: training goes on
        step(batches[2])
        out["finite after"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return out


def refusal_job(rank: int, world: int) -> dict:
    """An expert mesh over the 4 ranks given with a dense group of 2 (dp x tp = 2, edp x ep = 4)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from canzona.runtime.optimizer import DistributedOptimizer
    from reference.tiny_moe import MOE_PRESETS
    from reference.tiny_moe_ep import TinyMoeEP

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both, in order
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    model = TinyMoeEP(MOE_PRESETS["tiny-moe"], mesh.get_group("ep"))
    out = outcome(lambda: DistributedOptimizer(model.named_parameters(), model.spec(), "muon",
                                               group=pairs[rank // 2], expert_mesh=mesh))
    dist.barrier()
    return out


def disagreement_job(rank: int, world: int) -> dict:
    """The last rank's experts differ from its EDP peer's: construction fails on every rank."""
    from canzona.harness.training import parallel_model
    from canzona.runtime.optimizer import DistributedOptimizer

    spec = JOBS["muon"]
    model, mspec, group, expert_mesh, _ = parallel_model(spec, rank, world)
    if rank == world - 1:
        with torch.no_grad():
            model.model.layers[0].mlp.experts.down_proj.mul_(2.0)
    return outcome(lambda: DistributedOptimizer(model.named_parameters(), mspec, "muon", group=group,
                                                expert_mesh=expert_mesh))


def expert_write_job(rank: int, world: int) -> dict:
    """EP rank 0's experts written in place after a step, alike on both its EDP replicas (ranks 0
    and 2): a legitimate write (one comparison, which agrees). The TP ranks of DP rank 0 (ranks 0
    and 1) hold EP ranks 0 and 1's experts, so a TP mark counting expert writes would differ."""
    from canzona.harness.training import micro_batches, parallel_model
    from canzona.runtime.optimizer import DistributedOptimizer

    spec = JOBS["muon"]
    model, mspec, group, expert_mesh, dp_rank = parallel_model(spec, rank, world)
    opt = DistributedOptimizer(model.named_parameters(), mspec, "muon", spec.matrix_config, group=group,
                               expert_mesh=expert_mesh, reduce_scatter=spec.reduce_scatter,
                               bucket_size=spec.bucket_size)
    batches = [micro_batches(t, dp_rank, spec.dp_size(world), 1)[0] for t in global_batches(spec, 64)]
    compared = []
    check = opt._check_agreement
    opt._check_agreement = lambda *a, **k: (compared.append(k.get("weights")), check(*a, **k))[1]

    def step(tokens: torch.Tensor) -> None:
        opt.zero_grad()
        model.loss(tokens).backward()
        opt.step()
        opt.wait_params()
    step(batches[0])
    if expert_mesh.get_local_rank("ep") == 0:
        with torch.no_grad():
            model.model.layers[0].mlp.experts.down_proj.mul_(0.5)
    out = outcome(lambda: step(batches[1]))
    out["compared"] = compared
    # EP rank 0's experts loaded (load_state_dict) on its EDP replicas only: the model trains with
    # half its experts loaded; the DP ranks compare the experts' load mark (review: since the TP mark
    # counts dense weights only, nothing caught it; under TP 1 nothing ever did)
    experts = model.model.layers[0].mlp.experts
    if expert_mesh.get_local_rank("ep") == 0:
        experts.load_state_dict(experts.state_dict())
    out["experts loaded on one EP rank"] = outcome(lambda: step(batches[1]))
    return out


def everything_worker(rank: int, world: int, specs: list[TrainSpec], extras: list[dict]) -> dict:
    return {"jobs": many_specs_worker(rank, world, specs, extras),
            "nan skip": nonfinite_job(rank, world, "skip"),
            "nan raise": nonfinite_job(rank, world, "raise"),
            "refusal": refusal_job(rank, world),
            "disagreement": disagreement_job(rank, world),
            "expert write": expert_write_job(rank, world),
            "skipped layer": skipped_layer_job(rank, world, SKIPPED, layer=1, skipped_steps=(0,))}


@functools.cache
def runs() -> dict:
    labels = list(JOBS)
    try:
        results, folder = saving_spawn(everything_worker, WORLD, JOBS, SAVED, "canzona-ep-tp-", DEADLINE_S)
        out = {label: [results[r]["jobs"][i] for r in range(WORLD)] for i, label in enumerate(labels)}
        for key in ("nan skip", "nan raise", "refusal", "disagreement", "expert write", "skipped layer"):
            out[key] = [results[r][key] for r in range(WORLD)]
        for world, tp in RESUMED:
            out.update(resumed_runs(out, JOBS, SAVED, folder, world, (world, tp), DEADLINE_S, tp=tp))
    except Exception as e:  # noqa: BLE001 - replayed by every test that needs it
        return {"error": e}
    return out


def run(label):
    return replay(runs(), label)


@pytest.mark.parametrize("label", ["muon", "ep4", "habits"])
def test_the_reductions_make_the_global_mean_loss_gradient(label):
    """Each step's assembled gradients against the single-process model's global gradients (fed
    the weights each step started from: the emulation's, bit for bit the ranks')."""
    spec = JOBS[label]
    grads = global_gradients_from(run(label), spec)
    with torch_threads():
        model = build_model(spec)  # the first step's weights: the initial model
        want, got = global_gradients(model, spec, global_batches(spec, 64)[0], DP)
    assert set(grads[0][0]) == set(want) and grads[0][1] == got
    for name, g in grads[0][0].items():
        scale = want[name].abs().max().item() or 1.0
        assert (g - want[name]).abs().max().item() <= 1e-6 * scale, name


@pytest.mark.parametrize("label", ["habits", "ep4"])
def test_the_global_gradient_norm_counts_every_gradient_element_once(label):
    """`clip_grad_norm_`'s norm on every rank: the global gradients' (each expert element once,
    on whichever TP rank its EDP segment lives; each TP-replicated dense element once)."""
    ranks = run(label)
    want = [math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
            for grads, _ in global_gradients_from(ranks, JOBS[label])]
    for res in ranks:
        assert res["norms"] == ranks[0]["norms"]
        # (returned as an fp32 tensor, as torch's clip_grad_norm_ returns it)
        assert all(abs(a - b) <= 1e-7 * b for a, b in zip(res["norms"], want)), (res["norms"], want)


@pytest.mark.parametrize("label", list(JOBS))
def test_expert_parallel_training_with_a_tp_dense_part_is_the_same_kernels_in_one_process(label):
    ranks = run(label)
    want = {torch.bfloat16} if JOBS[label].dtype == "bf16" else {torch.float32}
    assert {p.dtype for res in ranks for p in res["params"].values()} == want, label
    check_same_kernels(JOBS[label], ranks, DP, label, REL_TOL)


def test_an_expert_stack_no_rank_reached_is_skipped_as_one_process_skips_it():
    """Layer 1 skipped by every rank in the first step: its stacks got no gradient on any rank of
    the cluster (which the TP ranks of a DP rank, holding different EP ranks' experts, see only
    together), so they are skipped there, as one process skips them (Muon: no weight decay)."""
    ranks = run("skipped layer")
    stacks = {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"}
    assert all(not stacks & set(r["grads"][0]) and stacks <= set(r["grads"][1]) for r in ranks)  # as staged
    check_same_kernels(SKIPPED, ranks, DP, "layer 1 skipped in step 1", REL_TOL)


@pytest.mark.parametrize("label", list(JOBS))
def test_every_ranks_logs_are_the_step_collectives_of_its_dp_tp_and_edp_ranks(label):
    check_logged_collectives(JOBS[label], run(label), label)


@pytest.mark.parametrize("label", ["muon", "ep4", "adamw", "bf16"])
def test_the_simulator_in_the_runtimes_collectives_mode_issues_the_logged_collectives(label):
    check_simulated_collectives(JOBS[label], run(label), label)


def test_an_overlapped_step_commits_both_parts():
    steps = JOBS["overlap"].steps
    assert all(r["overlapped_steps"] == r["expert_overlapped_steps"] == steps for r in run("overlap"))


def test_the_layout_folds_ep_over_dp_x_tp():
    ranks = run("muon")
    assert [(r["dp_rank"], r["tp_rank"], r["ep_rank"]) for r in ranks] == [(0, 0, 0), (0, 1, 1), (1, 0, 0), (1, 1, 1)]
    # the dense matrices owned over DP (their TP hosts beside), each expert matrix whole by one EDP rank
    for j in range(2):
        owned = [set(r["expert_owned"]) for r in ranks if r["ep_rank"] == j]
        assert all(owned) and not owned[0] & owned[1], owned
    assert any(r["owned"] for r in ranks)


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_a_nan_expert_gradient_on_one_rank_is_one_verdict_on_every_rank(policy):
    outs = run(f"nan {policy}")
    for r, out in enumerate(outs):
        assert out["unchanged"], f"rank {r} updated its weights from a NaN gradient"
        if policy == "skip":
            assert out["error"] is None and out["skipped"] == 1 and out["finite after"], (r, out)
        else:
            assert out["canzona"] and "global gradient norm is nan" in out["message"], (r, out)


def test_an_expert_mesh_that_does_not_fold_the_dense_mesh_is_one_error_on_every_rank():
    for out in run("refusal"):
        assert out["error"] == "SpecError" and "edp x ep = dp x tp" in out["message"], out


def test_experts_that_differ_within_an_edp_group_fail_construction_on_every_rank():
    outs = run("disagreement")
    for out in outs:
        assert out["error"] == "PlanError", out
    assert "initial expert parameters" in outs[-1]["message"]


def test_experts_written_alike_on_their_edp_replicas_are_one_comparison_not_a_tp_disagreement():
    """The TP mark counts writes of the dense weights only: before, EP rank 0's experts written on
    both its EDP replicas set the mark on TP rank 0 of each DP rank and not on TP rank 1 (which
    holds EP rank 1's experts): 'ranks disagree on the mark of weights loaded ...' on every rank."""
    for r, out in enumerate(run("expert write")):
        assert out["error"] is None and out["compared"][:1] == ["loaded"], (r, out)
        loaded = out["experts loaded on one EP rank"]
        assert loaded["error"] is not None and "experts loaded" in loaded["message"], (r, loaded)


@pytest.mark.parametrize("form", ["full", "sharded"])
@pytest.mark.parametrize("optimizer", SAVED)
@pytest.mark.parametrize("world,tp", RESUMED)
def test_a_checkpoint_under_ep_x_tp_resumes_at_another_layout_bit_for_bit(world, tp, optimizer, form):
    check_resumed(run((world, tp, optimizer, form)), run(optimizer), f"DP 2 x TP 2 x EP 2 -> {world} ranks at TP {tp}")
