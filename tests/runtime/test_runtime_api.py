"""The torch.optim-style surface of DistributedOptimizer on real gloo ranks: DeviceMesh groups,
LR schedulers driving param_groups, and the plan file path."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from canzona.harness.launch import run_ranks
from canzona.runtime import DistributedOptimizer  # the documented import
from reference.data import fixed_batch
from reference.tiny_model import TinyQwen3
from tests.runtime.outcomes import weights

pytestmark = pytest.mark.distributed  # spawns gloo process groups


class _RecordingSource:
    """A gradient source plugged in front of the default one (the seam FSDP2's will use)."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def launch(self, buffer, cuts, name):
        self.calls.append(("launch", name))
        return self.inner.launch(buffer, cuts, name)

    def gather_rest(self, buffer, cuts, name, *, matrices):
        self.calls.append(("gather_rest", name))
        return self.inner.gather_rest(buffer, cuts, name, matrices=matrices)


def _mesh_and_scheduler_worker(rank: int, world: int, plan_path: str | None) -> dict:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = TinyQwen3("tiny", seed=0)
    opt = DistributedOptimizer(model.named_parameters(), model.spec(), "muon", {"lr": 0.02}, {"lr": 1e-3},
                               plan=plan_path, group=mesh)
    source = opt.grads.source = _RecordingSource(opt.grads.source)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    lrs = []
    tokens = fixed_batch(256, 2 * world, 16, seed=3)
    for _ in range(3):
        opt.zero_grad()
        model.loss(tokens[rank * 2:(rank + 1) * 2]).backward()
        opt.step()
        sched.step()
        lrs.append([g["lr"] for g in opt.param_groups])
    saved = opt.state_dict()
    last = [(r.op, r.group, r.name, r.bytes_per_rank) for r in opt.comm.log.for_step(2)]
    return {"log": last, "rank": opt.rank, "lrs": lrs, "saved_lrs": [g["lr"] for g in saved["param_groups"]],
            "plan_hash": opt.plan.hash(), "params": weights(model), "layout": opt.mesh.layout,
            "calls": source.calls, "buckets": len(opt.plan.dp_plan.buckets)}


def test_device_mesh_lr_scheduler_and_plan_file(tmp_path):
    """A plan file laid out with an alignment other than the runtime's default (`canzona plan
    --align 128`): the runtime lays out every buffer as the plan says, its AdamW buffer included,
    so its collectives are the plan's (`step_collectives`). It padded the AdamW buffer to its own
    `align` argument (a planning setting) until 2026-11-30: 64 x dp, where the plan, the memory
    model and the simulator said 128 x dp."""
    from canzona.plan import make_plan
    from canzona.step_collectives import step_collectives, step_records

    spec = TinyQwen3("tiny", seed=0).spec()
    plan = make_plan(spec, 2, 1, "muon", "alpha-balanced-reorder", align=128)
    path = tmp_path / "plan.json"
    plan.save(path)
    results = run_ranks(_mesh_and_scheduler_worker, 2, str(path), deadline_s=120)
    for r in results:
        assert r["lrs"] == [[0.01, 5e-4], [0.005, 2.5e-4], [0.0025, 1.25e-4]]
        assert r["saved_lrs"] == [0.0025, 1.25e-4]
        assert r["plan_hash"] == plan.hash()
        assert r["layout"] == {"dp": 2, "tp": 1}
        # the gradient source was asked for every buffer of every step, in order
        buckets = [f"bucket {k}" for k in range(r["buckets"])]
        one_step = [("launch", b) for b in buckets] + [("launch", "adamw")] + \
            [("gather_rest", f"gradients of {b}") for b in buckets] + [("gather_rest", "adamw gradients")]
        assert r["calls"] == one_step * 3
        assert r["log"] == step_records(step_collectives(plan, spec, "canzona", r["rank"]), "dp")
    for name, p in results[0]["params"].items():
        assert torch.equal(p, results[1]["params"][name]), name


def test_checks_travel_on_cuda_where_the_group_has_nccl(monkeypatch):
    """`init_process_group("nccl")` carries CUDA tensors only: the runtime's small check and
    agreement tensors then go through the current CUDA device. So they do on a mixed
    "cpu:gloo,cuda:nccl" group (torch's recipe for `dcp.async_save`), where on the CPU they would
    meet a background save's gloo collectives in no agreed order, and the data collectives would be
    polled from the host; under gloo alone they stay on the CPU."""
    import torch

    from canzona.runtime import comm

    monkeypatch.setattr(comm.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert comm._check_device(None) == torch.device("cuda", 3)
    for mixed in ("cpu:gloo,cuda:nccl", "cuda:nccl,cpu:gloo", "cpu:gloo, cuda:nccl"):
        monkeypatch.setattr(comm.dist, "get_backend", lambda group=None, mixed=mixed: mixed)
        assert comm._check_device(None) == torch.device("cuda", 3), mixed
    monkeypatch.setattr(comm.dist, "get_backend", lambda group=None: "gloo")
    assert comm._check_device(None) == torch.device("cpu")
    monkeypatch.setattr(comm.dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert comm._check_device(None) == torch.device("cpu")
