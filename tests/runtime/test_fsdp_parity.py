"""FSDP2's optimizer step against the simulator's model of it (docs/design.md §2.8, §9.5): the tiny
model `fully_shard`-ed per decoder layer and at the root, trained by `DistributedOptimizer` on
spawned gloo ranks (S = 2 and 3, HSDP 2 x 2; Muon and SOAP; fp32 shards, fp32 shards under
`MixedPrecisionPolicy`, bf16 shards with fp32 masters).

- Memory: per rank and per category, the bytes the runtime holds — its parameter and gradient
  shards, fp32 masters, AdamW state of its local shards, the matrix optimizer's state of the
  matrices it owns — equal `canzona.fsdp_plan.fsdp_persistent_memory`, which `sim.fsdp` reports.
- Collectives: every rank's logs (`opt.world.log`, `opt.comm.log`, in issue order) equal
  `canzona.fsdp_plan.fsdp_step_collectives` record for record, step by step (the step check, the
  clip thresholds, the micro-groups' all-to-alls with their bytes per destination); the simulator
  prices the same all-to-alls' bytes.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest

from canzona.fsdp_collectives import PARAMETERS_VERDICT, fsdp_step_collectives
from canzona.fsdp_plan import (
    backward_order,
    fsdp_matrices,
    fsdp_persistent_memory,
    fsdp_units,
    owner_micro_groups,
)
from canzona.harness.launch import run_ranks
from canzona.harness.training import TrainSpec
from canzona.step_policies import get_fsdp_policy

pytestmark = pytest.mark.distributed  # spawns gloo process groups

DEADLINE_S = 300.0
TIMEOUT_S = 60.0
MUON = TrainSpec(optimizer="muon", matrix_config={"ns_steps": 1}, steps=2, global_batch=6, seq_len=8)
SOAP = TrainSpec(optimizer="soap", matrix_config={"precondition_frequency": 2}, steps=2, global_batch=6, seq_len=8)
# name: (train spec, how the model is sharded, clipping calls before each step: (max_norm, norm_type))
CASES: dict[str, tuple[TrainSpec, dict, tuple]] = {
    "muon": (MUON, {}, ()),
    "soap": (SOAP, {}, ()),
    "muon-clip": (MUON, {}, ((0.05, 2.0), (0.04, 2.0), (1e9, float("inf")))),
    "muon-mixed-precision": (MUON, {"mp": True}, ()),
    "muon-bf16-shards": (replace(MUON, dtype="bf16"), {}, ((0.05, 2.0),)),
    "soap-unbalanced": (SOAP, {"policy": "fsdp-owners-unbalanced"}, ()),
    # the optimizer's own clipping after a call of clip_grad_norm_ with another threshold
    "muon-max-grad-norm": (MUON, {"max_grad_norm": 0.05}, ((0.04, 2.0),)),
}
HSDP_CASES: dict[str, tuple[TrainSpec, dict, tuple]] = {
    "hsdp-muon": (MUON, {"mesh": (2, 2), "names": ("replicate", "shard")}, ((0.05, 2.0),)),
    "hsdp-soap": (SOAP, {"mesh": (2, 2), "names": ("replicate", "shard")}, ()),
}

# bf16 shards with DistributedOptimizer(master_weights=False): no fp32 copy, bf16 gradient shards
# and exchanges, the state that follows the update (Muon's and NorMuon's momentum, AdamW's moments)
# in bf16; every optimizer of the registry (SOAP's and Shampoo's statistics stay fp32)
NO_MASTER_CASES: dict[str, tuple[TrainSpec, dict, tuple]] = {
    name: (replace(spec, dtype="bf16", master_weights=False), {}, ())
    for name, spec in (("muon", MUON), ("normuon", replace(MUON, optimizer="normuon")), ("soap", SOAP),
                       ("shampoo", TrainSpec(optimizer="shampoo", steps=2, global_batch=6, seq_len=8)))}
# round-robin owners (fsdp-gather-all is a simulator baseline the runtime refuses)
NO_MASTER_CASES.update({f"{name}-unbalanced": (spec, {"policy": "fsdp-owners-unbalanced"}, ())
                        for name, (spec, _, _) in list(NO_MASTER_CASES.items()) if name in ("normuon", "soap")})


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run_case(spec: TrainSpec, how: dict, clips: tuple) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from canzona.harness.training import (
        build_model,
        global_batches,
        matrix_state_bytes,
        micro_batches,
    )
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.shards import local_tensor

    world = torch.distributed.get_world_size()
    model = build_model(spec)
    mspec = model.spec()
    mesh = init_device_mesh("cpu", how.get("mesh", (world,)), mesh_dim_names=how.get("names"))
    options = {}
    if how.get("mp"):
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    opt = DistributedOptimizer(model.named_parameters(), mspec, spec.optimizer, spec.matrix_config, spec.adamw_config,
                               policy=how.get("policy"), max_grad_norm=how.get("max_grad_norm"),
                               master_weights=spec.master_weights, timeout_s=TIMEOUT_S)
    built = (len(opt.world.log.records), len(opt.comm.log.records))
    vocab = mspec.param("model.embed_tokens.weight").shape[0]
    rank = torch.distributed.get_rank()
    replicas = world // opt.size
    data_rank, data_ranks = rank, world  # every rank its own share of the batch (replicas too)
    for tokens in global_batches(spec, vocab):
        opt.zero_grad()
        (mb,) = micro_batches(tokens, data_rank, data_ranks, 1)
        model.loss(mb).backward()
        for max_norm, norm_type in clips:
            opt.clip_grad_norm_(max_norm, norm_type)
        opt.step()
    params = dict(model.named_parameters())
    logs = sorted([r for r in opt.world.log.records[built[0]:]] + [r for r in opt.comm.log.records[built[1]:]],
                  key=lambda r: r.seq)
    return {
        "spec": mspec, "rank": opt.rank, "size": opt.size, "replicas": replicas, "owner": dict(opt.owner),
        "micro_groups": [list(g) for g in opt.micro_groups],
        "params": nbytes(local_tensor(p) for p in params.values()),
        "param_dtype": str(next(iter(params.values())).dtype),
        "grads": nbytes(local_tensor(p.grad) for p in params.values()),
        "master": nbytes(opt.master.values()),
        "matrix_state": matrix_state_bytes(opt.matrix_state),
        "adamw_state": sum(nbytes(v for v in s.values() if hasattr(v, "numel")) for s in opt.adamw_state.values()),
        "log": [(r.step, r.op, r.group, r.name, r.bytes_per_rank) for r in logs],
    }


def cases_worker(rank: int, world: int, cases: dict) -> dict[str, dict]:
    return {name: run_case(*case) for name, case in cases.items()}


@functools.cache
def runs(world: int, hsdp: bool = False, no_masters: bool = False) -> dict[str, list[dict]]:
    cases = NO_MASTER_CASES if no_masters else HSDP_CASES if hsdp else CASES
    per_rank = run_ranks(cases_worker, world, cases, deadline_s=DEADLINE_S, collective_timeout_s=TIMEOUT_S)
    return {n: [r[n] for r in per_rank] for n in cases}


# --- what the runtime holds ------------------------------------------------------------------------


def element_bytes(spec: TrainSpec) -> int:
    """Bytes per element of the gradients and updates on the wire and of the optimizer state:
    fp32 (a bf16 model keeps fp32 masters)."""
    return 4


def predicted_memory(run: dict, spec: TrainSpec, how: dict):
    """`fsdp_persistent_memory` of the run's layout, in the dtypes it keeps: fp32 shards; fp32
    shards under MixedPrecisionPolicy, which are the masters (the simulator's convention: FSDP2
    gathers bf16 copies of them); bf16 shards and gradients with fp32 masters."""
    if how.get("mp"):
        sizes = dict(weight_bytes=0, grad_bytes=4, master_bytes=4)
    elif spec.dtype == "bf16":
        sizes = dict(weight_bytes=2, grad_bytes=2, master_bytes=4)
    else:
        sizes = dict(weight_bytes=4, grad_bytes=4, master_bytes=0)
    return fsdp_persistent_memory(run["spec"], run["size"], planned(run, spec, how), **sizes)


def planned(run: dict, spec: TrainSpec, how: dict):
    """The owners `canzona.fsdp_plan` gives the run's shard group (the runtime's, asserted)."""
    matrices, _ = fsdp_matrices(run["spec"], run["size"], spec.optimizer,
                                get_fsdp_policy(how.get("policy") or "canzona"),
                                matrix_config=spec.matrix_config or None)  # the runtime's owners are its config's
    assert {n: m.owner for n, m in matrices.items()} == run["owner"]
    groups = owner_micro_groups(backward_order(fsdp_units(run["spec"], matrices)))
    assert [[m.name for m in g] for g in groups] == run["micro_groups"]
    return matrices


def runtime_memory(run: dict, how: dict) -> dict[str, int]:
    """The runtime's tensors by the memory model's categories (FSDP2's fp32 shards under
    MixedPrecisionPolicy are the masters)."""
    shards_are_masters = bool(how.get("mp"))
    return {"weights": 0 if shards_are_masters else run["params"], "grads": run["grads"],
            "master_weights": run["master"] + (run["params"] if shards_are_masters else 0),
            "matrix_state": run["matrix_state"], "adamw_state": run["adamw_state"]}


# construction's gathers (step 0's log): the parameters' verdict, the layout's
CONSTRUCTION = (PARAMETERS_VERDICT, "fsdp layout sizes", "fsdp layout")
CATEGORIES = ("weights", "grads", "master_weights", "matrix_state", "adamw_state")
ALL = [(2, False, n) for n in CASES] + [(3, False, n) for n in CASES] + [(4, True, n) for n in HSDP_CASES]


def case_of(hsdp: bool, name: str):
    return (HSDP_CASES if hsdp else CASES)[name]


@pytest.mark.parametrize(("world", "hsdp", "case"), ALL)
def test_every_rank_holds_what_the_memory_model_counts(world, hsdp, case):
    spec, how, _ = case_of(hsdp, case)
    results = runs(world, hsdp)[case]
    want = predicted_memory(results[0], spec, how)
    assert len(want) == results[0]["size"] == world // results[0]["replicas"]
    for got in results:
        have = runtime_memory(got, how)
        for k in CATEGORIES:
            assert have[k] == getattr(want[got["rank"]], k), (case, got["rank"], k)
    if world == 3:  # uneven row blocks: the last rank holds less, and the model says so
        assert want[2].grads < want[0].grads


SIMULATED = [(2, False, "muon-mixed-precision"), (3, False, "muon-mixed-precision"), (2, False, "soap"),
             (3, False, "soap"), (3, False, "soap-unbalanced"), (4, True, "hsdp-soap")]


@pytest.mark.parametrize(("world", "hsdp", "case"), SIMULATED)
def test_the_simulator_reports_what_the_runtime_holds(world, hsdp, case):
    """`canzona simulate --fsdp` of the tiny model: per rank of the shard group, every persistent
    category is the runtime's (bf16 parameters with fp32 masters: MixedPrecisionPolicy; fp32:
    `param_bytes=4`)."""
    from canzona.catalog import build_decoder
    from canzona.models import ModelSource
    from reference.tiny_model import PRESETS
    from sim.simulate import SimConfig, simulate
    from sim.workload import Workload

    spec, how, _ = case_of(hsdp, case)
    results = runs(world, hsdp)[case]
    cfg = PRESETS[spec.preset].as_catalog()
    model = (results[0]["spec"], ModelSource(build_decoder(cfg), "catalog", cfg).architecture())
    workload = Workload(global_batch=world * 2, seq_len=8, **({} if how.get("mp") else {"param_bytes": 4}))
    sim = simulate(SimConfig(model=cfg.name, gpus=world, tp=1, fsdp=True, hsdp_replicate=world // results[0]["size"],
                             optimizer=spec.optimizer, policy=how.get("policy") or "canzona", workload=workload,
                             matrix_config=spec.matrix_config or None),
                   model=model)
    assert len(sim.memory.ranks) == results[0]["size"]
    for got in results:
        have = runtime_memory(got, how)
        for k in CATEGORIES:
            assert have[k] == getattr(sim.memory.ranks[got["rank"]], k), (case, got["rank"], k)


# --- what the runtime sends ------------------------------------------------------------------------


@pytest.mark.parametrize(("world", "hsdp", "case"), ALL)
def test_every_ranks_logs_are_the_fsdp_step_collectives(world, hsdp, case):
    spec, how, clips = case_of(hsdp, case)
    results = runs(world, hsdp)[case]
    matrices = planned(results[0], spec, how)
    for got in results:
        for step in range(spec.steps):
            want = fsdp_step_collectives(
                got["spec"], got["size"], got["rank"], got["owner"], got["micro_groups"],
                element_bytes=element_bytes(spec), world=world, clips=clips, max_grad_norm=how.get("max_grad_norm"),
                no_update=matrices if spec.optimizer == "soap" and step == 0 else ())
            have = [r[1:] for r in got["log"] if r[0] == step]
            assert have == [c.logged() for c in want], (case, got["rank"], step)
    # the simulator prices these bytes: member s's records are row s of the whole group's
    want = fsdp_step_collectives(results[0]["spec"], results[0]["size"], 0, results[0]["owner"],
                                 results[0]["micro_groups"], element_bytes=element_bytes(spec), world=world)
    for c in want:
        if c.op == "all-to-all":
            assert [list(row) for row in c.sent] == [
                list(next(r[4] for r in got["log"] if r[0] == spec.steps - 1 and r[3] == c.name))
                for got in results[:results[0]["size"]]]  # the first replica's members, in member order


# --- master_weights=False ----------------------------------------------------------------------


@pytest.mark.parametrize("case", list(NO_MASTER_CASES))
def test_without_masters_the_simulator_reports_what_the_runtime_holds(case):
    """`canzona simulate --fsdp --no-master-weights` of the tiny model: per rank, every persistent
    category is what FSDP2's bf16 shards and DistributedOptimizer(master_weights=False) hold."""
    from canzona.catalog import build_decoder
    from canzona.models import ModelSource
    from reference.tiny_model import PRESETS
    from sim.simulate import SimConfig, simulate
    from sim.workload import Workload

    spec, how, _ = NO_MASTER_CASES[case]
    world = 2
    results = runs(world, no_masters=True)[case]
    assert results[0]["param_dtype"] == "torch.bfloat16" and results[0]["master"] == 0
    cfg = PRESETS[spec.preset].as_catalog()
    model = (results[0]["spec"], ModelSource(build_decoder(cfg), "catalog", cfg).architecture())
    sim = simulate(SimConfig(model=cfg.name, gpus=world, tp=1, fsdp=True, optimizer=spec.optimizer,
                             policy=how.get("policy") or "canzona",
                             workload=Workload(global_batch=world * 2, seq_len=8, master_weights=False),
                             matrix_config=spec.matrix_config or None),
                   model=model)
    for got in results:
        have = runtime_memory(got, how)
        for k in CATEGORIES:
            assert have[k] == getattr(sim.memory.ranks[got["rank"]], k), (case, got["rank"], k)


@pytest.mark.parametrize("case", list(NO_MASTER_CASES))
def test_without_masters_every_ranks_logs_are_the_fsdp_step_collectives_in_bf16(case):
    """Without masters the gradients gathered to the owners and the updates scattered back are the
    bf16 parameters' (FsdpOptimizer's grad_dtype and update_dtype; `sim.fsdp`'s phase B prices 2 bytes)."""
    spec, how, clips = NO_MASTER_CASES[case]
    results = runs(2, no_masters=True)[case]
    matrices = planned(results[0], spec, how)
    for got in results:
        for step in range(spec.steps):
            want = fsdp_step_collectives(
                got["spec"], got["size"], got["rank"], got["owner"], got["micro_groups"], element_bytes=2, world=2,
                clips=clips, no_update=matrices if spec.optimizer == "soap" and step == 0 else ())
            have = [r[1:] for r in got["log"] if r[0] == step]
            assert have == [c.logged() for c in want], (case, got["rank"], step)
