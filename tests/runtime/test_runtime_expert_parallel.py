"""Expert parallelism in the runtime (issue 20; docs/design.md §2.7, `canzona/runtime/expert_part.py`):
a mixture-of-experts model whose experts are split over EP groups (`reference/tiny_moe_ep.py`: its
tokens dispatched to the experts' ranks and back by differentiable all-to-alls) trains under
`DistributedOptimizer(..., expert_mesh=...)` with the dense part over DP and each expert matrix
owned whole within its EDP group, bit for bit what the same kernels compute in one process given
the global gradients the ranks' backward produced (rung 3, as under TP: the recorded gradients
summed as the reductions sum them), and within 1e-5 of the independent references.

Checkpoints under EP keep every expert matrix under the model's name: taken at DP 4 x EP 2 (full
and sharded), they load at EP 4, at EP 1 on 2 ranks (no expert parallelism) and at EP 2 again, and
continue bit for bit.

One spawn of 4 ranks (DP 4 = EDP 2 x EP 2, and EP 4) runs every configuration and the refusals;
three more resume from its checkpoints.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest

from canzona.harness.launch import run_ranks
from canzona.harness.training import (
    TrainSpec,
    build_model,
    many_specs_worker,
)
from tests.runtime.expert_runs import (
    check_resumed,
    check_same_kernels,
    replay,
    resumed_runs,
    saving_spawn,
)

pytestmark = pytest.mark.distributed  # spawns gloo process groups

WORLD = 4
DEADLINE_S = 180.0
MATRIX_CONFIG = {"muon": {"ns_dtype": "fp32"}, "normuon": {"ns_dtype": "fp32"},
                 "soap": {"precondition_frequency": 2}, "shampoo": {"precondition_frequency": 2}, "adamw": {}}
REL_TOL = 1e-5


def spec_for(optimizer: str, **changes) -> TrainSpec:
    base = TrainSpec(preset="tiny-moe", optimizer=optimizer, ep=2, steps=3, global_batch=8, seq_len=8,
                     bucket_size=1024, matrix_config=dict(MATRIX_CONFIG[optimizer]))
    return replace(base, **changes)


JOBS = {
    **{opt: spec_for(opt) for opt in MATRIX_CONFIG},
    "zero1-gather": spec_for("muon", policy="zero1-gather"),
    "layerwise": spec_for("soap", policy="layerwise"),
    "sc": spec_for("muon", policy="sc"),
    "ep4": spec_for("shampoo", ep=4, bucket_size=None),
    "habits": spec_for("muon", accumulation=2, global_batch=16, clip_norm=0.05, zero_grad="model"),
    "bf16": spec_for("muon", dtype="bf16"),
    # the experts' updates computed as their EDP buckets land (and dropped when clipping scales them)
    "overlap": spec_for("normuon", overlap_step=True),
    "overlap-clip": spec_for("muon", overlap_step=True, accumulation=2, global_batch=16, clip_norm=0.05),
}


def refusals_worker(rank: int, world: int) -> dict[str, str]:
    """Each mistake's error on this rank (local, before any collective that could hang)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from canzona.errors import CanzonaError
    from canzona.runtime.optimizer import DistributedOptimizer
    from reference.tiny_moe import MOE_PRESETS
    from reference.tiny_moe_ep import TinyMoeEP

    out = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    wrong = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def build(**kw):
        model = TinyMoeEP(MOE_PRESETS["tiny-moe"], mesh.get_group("ep"))
        return DistributedOptimizer(model.named_parameters(), model.spec(), "muon", **kw)

    def dtensor_experts(**kw):  # torchtitan's layout: each stack a DTensor sharded over the EP mesh
        from torch import nn
        from torch.distributed.tensor import DTensor, Shard

        model = TinyMoeEP(MOE_PRESETS["tiny-moe"], mesh.get_group("ep"))
        for layer in model.model.layers:
            for name in ("gate_up_proj", "down_proj"):
                local = getattr(layer.mlp.experts, name).detach()
                setattr(layer.mlp.experts, name, nn.Parameter(DTensor.from_local(local, mesh["ep"], [Shard(0)])))
        return DistributedOptimizer(model.named_parameters(), model.spec(), "muon", **kw)

    def local_spec(**kw):  # the spec read from the EP-sharded model (its local stacks)
        from canzona.spec import ModelSpec

        model = TinyMoeEP(MOE_PRESETS["tiny-moe"], mesh.get_group("ep"))
        return DistributedOptimizer(model.named_parameters(), ModelSpec.from_module(model), "muon", **kw)

    for label, make, kw in (("mesh", build, {"expert_mesh": wrong}),
                            ("local shapes", build, {}),  # EP-local stacks given without the expert mesh
                            ("dtensor experts", dtensor_experts, {"expert_mesh": mesh}),
                            ("local spec", local_spec, {"expert_mesh": mesh})):
        try:
            make(**kw)
            out[label] = "no error"
        except (CanzonaError, ValueError) as e:
            out[label] = str(e)
    dist.barrier()
    return out


SAVED = ("muon", "soap", "adamw")  # checkpointed at DP 4 x EP 2
RESUMED = ((4, 4), (2, 1), (4, 2))  # (world, ep) of the runs that load them


@functools.cache
def runs() -> dict:
    labels = list(JOBS)
    try:
        results, folder = saving_spawn(many_specs_worker, WORLD, JOBS, SAVED, "canzona-ep-", DEADLINE_S)
        refused = run_ranks(refusals_worker, WORLD, deadline_s=DEADLINE_S, collective_timeout_s=60)
        out = {label: [results[r][i] for r in range(WORLD)] for i, label in enumerate(labels)}
        out["refusals"] = refused
        for world, ep in RESUMED:
            out.update(resumed_runs(out, JOBS, SAVED, folder, world, (world, ep), DEADLINE_S, ep=ep, bucket_size=None))
    except Exception as e:  # noqa: BLE001 - replayed by every test that needs it
        return {"error": e}
    return out


def run(label):
    return replay(runs(), label)


@pytest.mark.parametrize("label", list(JOBS))
def test_expert_parallel_training_is_the_same_kernels_in_one_process_bit_for_bit(label):
    check_same_kernels(JOBS[label], run(label), WORLD, label, REL_TOL)


def test_an_overlapped_step_commits_the_experts_updates_it_computed_early():
    """overlap_step under EP: every step commits what it computed as the buckets landed, the
    experts' included; a step that clips drops them and runs the plain step (bit for bit either
    way: the same-kernels test above)."""
    steps = JOBS["overlap"].steps
    assert all(r["overlapped_steps"] == r["expert_overlapped_steps"] == steps for r in run("overlap"))
    assert all(r["expert_overlapped_steps"] < steps for r in run("overlap-clip"))
    assert all(r["expert_overlapped_steps"] == 0 for r in run("muon"))


def test_each_expert_matrix_is_owned_whole_by_one_rank_of_its_edp_group():
    from canzona.experts import expert_part

    spec = JOBS["muon"]
    ranks = run("muon")
    local = {m.name for m in expert_part(build_model(spec).spec(), spec.ep).matrix_params()}
    for j in range(spec.ep):
        owned = [set(r["expert_owned"]) for r in ranks if r["ep_rank"] == j]
        assert len(owned) == WORLD // spec.ep and all(owned), f"EP rank {j}: {owned}"
        assert not owned[0] & owned[1] and owned[0] | owned[1] == local, f"EP rank {j}: {owned}"


def test_expert_parallel_mistakes_are_one_error_each():
    refused = run("refusals")
    for messages in refused:
        assert "dimensions named 'edp' and 'ep'" in messages["mesh"]
        assert "shape (2, 32, 32)" in messages["local shapes"] and "give expert_mesh" in messages["local shapes"]
        assert "is a DTensor" in messages["dtensor experts"] and "plain tensor" in messages["dtensor experts"]
        assert "the whole model's spec" in messages["local spec"], messages["local spec"]



@pytest.mark.parametrize("form", ["full", "sharded"])
@pytest.mark.parametrize("optimizer", SAVED)
@pytest.mark.parametrize("world,ep", RESUMED)
def test_a_checkpoint_under_ep_resumes_at_another_ep_size_bit_for_bit(world, ep, optimizer, form):
    check_resumed(run((world, ep, optimizer, form)), run(optimizer), f"EP 2 -> {world} ranks, EP {ep}")


def test_every_rank_holds_the_same_layout_independent_state_under_ep():
    ranks = run("soap")
    first = ranks[0]["state"]
    for res in ranks[1:]:
        assert res["state"]["state"].keys() == first["state"].keys()
        for k, entry in first["state"].items():
            assert entry.keys() == res["state"]["state"][k].keys()
