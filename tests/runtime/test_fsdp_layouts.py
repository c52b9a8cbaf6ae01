"""FSDP2 as people run it (docs/design.md §2.8), each case trained by `DistributedOptimizer` on the
tiny model `fully_shard`-ed per decoder layer and at the root, and compared, bit for bit, with the
same kernels in one process fed the global gradients the ranks saw (`harness.training.emulate`):

- plain FSDP over 4 ranks (and over 2 and 3 in tests/runtime/test_fsdp_runtime.py);
- HSDP: a 2 x 2 mesh (replicate x shard); each replica's shard group runs the step alike;
- `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`: fp32 shards, bf16 compute;
- a model cast to bf16 before `fully_shard`: fp32 masters of the local shards, fp32 gradients on
  the wire and fp32 state;
- gradient accumulation with `set_requires_gradient_sync(False)` on all but the last micro-batch;
- `reshard_after_forward=False`;
- FSDP x TP on a 2 x 2 mesh as torchtitan composes them (`parallelize_module` over `tp`, then
  `fully_shard` over `dp`): each rank's piece is a TP shard's row block; and HSDP x TP on a
  2 x 2 x 2 mesh, whose exchange groups (dp x tp, one per replica) each replica's ranks make alone;
- pipeline stages (PP x HSDP): one optimizer per stage over its part of a 2 x 2 x 2 mesh, the
  second stage's built after the first trained;
- PP x FSDP as torchtitan runs it (pp 2 x dp 2): each stage's layers `fully_shard`-ed over its DP
  pair, trained by torch's Schedule1F1B, one optimizer a stage (Muon, AdamW): each rank holds, by
  category, what `sim.fsdp_pipeline.fsdp_stage_memories` reports of its stage;
- torch's own `clip_grad_norm_` on the sharded model before `step()` (the step takes the
  gradients it clipped);
- a frozen embedding, left out of the optimizer and the spec (`from_module` and
  `canzona.runtime.modules.named_parameters` skip it): unchanged, no state;
- torch.amp.GradScaler under FSDP x TP (2**10; `unscale_`, the clip, `scaler.step`, `update`), the
  norms and the tied embedding in the first param group (as "no weight decay" groups come), an Inf
  in rank 1's TP shard of q_proj at the second step: skipped on every rank, every rank's scale
  halved alike; the other steps the same kernels' on the unscaled gradients. GradScaler's foreach
  list then starts with the embedding, on `mesh['dp']` alone, and torch's own DTensor unscale
  all-reduces `found_inf` over that gradient's mesh only: ranks 0 and 2 found no Inf, 1 and 3 did.
"""

from __future__ import annotations

import datetime
import functools
from dataclasses import replace

import pytest
import torch

from canzona.harness.launch import run_ranks
from canzona.harness.training import (
    TrainSpec,
    build_model,
    compare,
    emulate,
    global_batches,
    micro_batches,
)

pytestmark = pytest.mark.distributed  # spawns gloo process groups

BASE = TrainSpec(optimizer="muon", matrix_config={"ns_dtype": "fp32"}, steps=3, global_batch=8, clip_norm=0.05)
CASES: dict[str, tuple[int, TrainSpec, dict]] = {
    # name: (world, spec, how the model is sharded)
    "fsdp-4": (4, BASE, {}),
    "hsdp": (4, BASE, {"mesh": (2, 2), "names": ("replicate", "shard"), "checkpoint": True}),
    "mixed-precision": (2, BASE, {"mp": True}),
    "bf16-shards": (2, replace(BASE, dtype="bf16"), {}),
    "accumulate": (2, replace(BASE, accumulation=2), {}),
    "no-reshard": (2, BASE, {"reshard": False}),
    "fsdp-tp": (4, BASE, {"mesh": (2, 2), "names": ("dp", "tp"), "tp": True, "checkpoint": True}),
    # torch's own clip_grad_norm_ on the sharded model (DTensor gradients) before step()
    "torch-clip": (2, replace(BASE, clip_norm=None), {"torch_clip": 0.05}),
    "frozen-embedding": (2, BASE, {"frozen": "model.embed_tokens.weight"}),
    "fsdp-tp-scaler": (4, BASE, {"mesh": (2, 2), "names": ("dp", "tp"), "tp": True, "scaler": True}),
    "soap-hsdp": (4, replace(BASE, optimizer="soap", matrix_config={"precondition_frequency": 2}),
                  {"mesh": (2, 2), "names": ("replicate", "shard")}),
}


def shard_model(spec: TrainSpec, how: dict):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from canzona.spec import ModelSpec
    from reference.tiny_model_tp import parallelize_tiny

    model = build_model(spec)
    mspec = model.spec()
    if how.get("frozen"):  # left out of the spec and the optimizer, as from_module leaves it
        model.get_parameter(how["frozen"]).requires_grad_(False)
        mspec = ModelSpec.from_module(model, name=mspec.name)
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", how.get("mesh", (world,)), mesh_dim_names=how.get("names"))
    options = {"reshard_after_forward": how.get("reshard", True)}
    if how.get("mp"):
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if how.get("tp"):
        model = parallelize_tiny(model, mesh["tp"])
        mesh = mesh["replicate", "dp"] if "replicate" in how["names"] else mesh["dp"]
    if how.get("compile"):  # torchtitan's order: each block compiled (in place), then sharded
        for layer in model.model.layers:
            layer.compile()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model, mspec


def data_rank(how: dict) -> tuple[int, int]:
    """This rank's share of the batch: every rank its own, except TP peers (one DP rank's)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    return (rank // 2, world // 2) if how.get("tp") else (rank, world)


def case_run(rank: int, world: int, spec: TrainSpec, how: dict) -> dict:
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters

    model, mspec = shard_model(spec, how)
    params = list(named_parameters(model))
    if how.get("scaler"):  # the norms and the embedding first, the matrices after
        matrices = {p.name for p in mspec.params if p.uses_matrix_optimizer}
        params = [{"params": [(n, p) for n, p in params if n not in matrices]},
                  {"params": [(n, p) for n, p in params if n in matrices]}]
    opt = DistributedOptimizer(params, mspec, spec.optimizer, spec.matrix_config, spec.adamw_config)
    vocab = model.model.embed_tokens.weight.shape[0]
    me, dp = data_rank(how)
    grads, norms, scales = [], [], []
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if how.get("scaler") else None
    for step, tokens in enumerate(global_batches(spec, vocab)):
        opt.zero_grad()
        mbs = micro_batches(tokens, me, dp, spec.accumulation)
        for k, mb in enumerate(mbs):
            model.set_requires_gradient_sync(k == len(mbs) - 1)
            loss = model.loss(mb) / spec.accumulation
            (loss if scaler is None else scaler.scale(loss)).backward()
        if how.get("torch_clip"):
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), how["torch_clip"])))
        named = dict(named_parameters(model))
        poisoned = scaler is not None and step == 1
        if poisoned and rank == 1:  # rank 1's TP shard (on the dp x tp mesh) of one weight's gradient
            with torch.no_grad():
                named["model.layers.0.self_attn.q_proj.weight"].grad.to_local()[0, 0] = float("inf")
        if scaler is not None:
            scaler.unscale_(opt)
        if not poisoned:  # the gradients the step takes (unscaled)
            grads.append(({n: p.grad.full_tensor().float() for n, p in named.items()}, set(named)))
        if spec.clip_norm is not None:
            opt.clip_grad_norm_(spec.clip_norm)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    resumed = checkpoint_round_trip(model, opt, spec, how) if how.get("checkpoint") else None
    return {"resumed": resumed, "params": params, "grads": grads, "owned": sorted(opt.matrix_state), "norms": norms,
            "scales": scales, "skipped": opt.skipped_steps,
            "exchange": opt.size, "dtypes": {str(p.dtype) for p in model.parameters()}}


def checkpoint_round_trip(model, opt, spec: TrainSpec, how: dict) -> dict:
    """The layout-independent checkpoint under this layout: a fresh model of other weights loads
    the parameters and `opt.state_dict()`; its own state_dict() is the same checkpoint, and one more
    step on both (the same data) leaves them equal, bit for bit."""
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters
    from tests.runtime.test_fsdp_checkpoint import full_params, load_params, nested_equal

    sd = opt.state_dict()
    other, mspec = shard_model(replace(spec, model_seed=spec.model_seed + 5), how)
    opt2 = DistributedOptimizer(named_parameters(other), mspec, spec.optimizer, spec.matrix_config,
                                spec.adamw_config)
    load_params(other, full_params(model))
    opt2.load_state_dict(sd)
    same_checkpoint = nested_equal(opt2.state_dict(), sd)
    me, dp = data_rank(how)
    tokens = global_batches(replace(spec, data_seed=9, steps=1), model.model.embed_tokens.weight.shape[0])[0]
    for m, o in ((model, opt), (other, opt2)):
        o.zero_grad()
        m.loss(micro_batches(tokens, me, dp, 1)[0]).backward()
        o.step()
    a, b = full_params(model), full_params(other)
    return {"difference": same_checkpoint, "equal": a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)}


# larger variants (torch.compile takes about a minute per rank on a 2-core machine; 8 ranks)
SLOW_CASES: dict[str, tuple[int, TrainSpec, dict]] = {
    "compiled-blocks": (2, BASE, {"compile": True}),
    # HSDP x TP: the exchange groups (dp x tp, one per replica) are no dimension of the mesh (8 ranks)
    "hsdp-tp": (8, BASE, {"mesh": (2, 2, 2), "names": ("replicate", "dp", "tp"), "tp": True}),
}


def cases_worker(rank: int, world: int, names: list[str]) -> dict[str, dict]:
    every = {**CASES, **SLOW_CASES}
    return {n: case_run(rank, world, every[n][1], every[n][2]) for n in names}


@functools.cache
def _runs(world: int) -> dict[str, list[dict]]:
    names = [n for n, (w, _, _) in CASES.items() if w == world]
    per_rank = run_ranks(cases_worker, world, names, deadline_s=400.0)
    return {n: [r[n] for r in per_rank] for n in names}


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_layout_exact(case: str) -> None:
    world, spec, how = CASES[case]
    check_case(case, _runs(world)[case], world, spec, how)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SLOW_CASES))
def test_fsdp_slow_layout_exact(case: str) -> None:
    """The larger layouts: torch.compile'd decoder blocks under fully_shard (the step is the same:
    the parameters the optimizer holds are FSDP2's DTensors either way), HSDP x TP on 8 ranks."""
    world, spec, how = SLOW_CASES[case]
    results = [r[case] for r in run_ranks(cases_worker, world, [case], deadline_s=600.0)]
    check_case(case, results, world, spec, how)


def check_case(case: str, results: list[dict], world: int, spec: TrainSpec, how: dict) -> None:
    grads = results[0]["grads"]
    for r in results[1:]:  # every rank saw the same global gradients (replicas included)
        for (a, _), (b, _) in zip(grads, r["grads"]):
            assert all(torch.equal(a[n], b[n]) for n in a)
    want = emulate(spec, world, grads=grads)
    for rank, r in enumerate(results):
        exact = compare(r["params"], want)
        assert exact["bit_identical"], (case, rank, exact)
    init = {n: p.detach() for n, p in build_model(spec).named_parameters()}
    frozen = how.get("frozen")
    assert not any(torch.equal(results[0]["params"][n], init[n]) for n in init if n != frozen)
    if frozen is not None:  # untouched, and no state for it anywhere
        assert torch.equal(results[0]["params"][frozen], init[frozen])
        assert frozen not in results[0]["grads"][0][0]
    # each matrix's state lives on one rank of each exchange group (replicas: one per replica)
    exchange = results[0]["exchange"]
    assert exchange == (2 if how.get("names") == ("replicate", "shard") else world // 2 if case == "hsdp-tp" else world)
    matrices = {p.name for p in build_model(spec).spec().params if p.uses_matrix_optimizer}
    replicas = world // exchange
    owned = [n for r in results for n in r["owned"]]
    assert sorted(owned) == sorted(list(matrices) * replicas)
    if how.get("checkpoint"):  # the checkpoint round trip under this layout
        for r in results:
            assert r["resumed"]["difference"] is None and r["resumed"]["equal"], r["resumed"]
    if how.get("torch_clip"):  # torch's clipping really clipped, and the step took the clipped gradients
        assert all(n > how["torch_clip"] for n in results[0]["norms"])
    if how.get("scaler"):  # the Inf step skipped on every rank, every rank's scale halved
        for r in results:
            assert r["skipped"] == 1 and r["scales"] == [2.0 ** 10, 2.0 ** 9, 2.0 ** 9], (r["skipped"], r["scales"])
    if case == "bf16-shards":
        assert results[0]["dtypes"] == {"torch.bfloat16"}
    if case == "mixed-precision":
        assert results[0]["dtypes"] == {"torch.float32"}


# --- pipeline stages: one optimizer per stage, each over its own multi-dimensional mesh ---------

PP_SPEC = replace(BASE, steps=2)
LAST = "model.layers.1.mlp.down_proj.weight"


def train_stage(model, opt, spec: TrainSpec, me: int, dp: int) -> list:
    """A stage's training loop (its own batch each step, clipped): each step's full gradients (fp32)
    and the names they were taken over."""
    vocab = model.model.embed_tokens.weight.shape[0]
    grads = []
    for tokens in global_batches(spec, vocab):
        opt.zero_grad()
        model.loss(micro_batches(tokens, me, dp, 1)[0]).backward()
        named = dict(model.named_parameters())
        grads.append(({n: p.grad.full_tensor().float() for n, p in named.items()}, set(named)))
        opt.clip_grad_norm_(spec.clip_norm)
        opt.step()
    return grads


def stage_run(rank: int, world: int, pp: int, flatten: bool) -> dict:
    """torchtitan's PP x HSDP: a (pp, dp_replicate, dp_shard) world mesh, each stage's model (its own
    seed and data) `fully_shard`ed over `mesh['dp_replicate', 'dp_shard']`, one optimizer per stage.
    Stage 1 builds its optimizer only once stage 0 has trained (it waits on a store key that stage 0
    sets), so nothing in stage 0's construction or steps may wait for stage 1's ranks. `flatten`:
    torchtitan's `dp`, flattened on every rank at the start, given as the group (its group serves)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from canzona.runtime import DistributedOptimizer

    mesh = init_device_mesh("cpu", (pp, 2, world // pp // 2), mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
    stage = mesh["pp"].get_local_rank()
    sub = mesh["dp_replicate", "dp_shard"]
    flat = sub._flatten("dp") if flatten else None
    spec = replace(PP_SPEC, model_seed=stage, data_seed=1 + stage)
    model = build_model(spec)
    for layer in model.model.layers:
        fully_shard(layer, mesh=sub)
    fully_shard(model, mesh=sub)
    store = dist.distributed_c10d._get_default_store()
    if stage == 1:
        store.wait(["stage 0 trained"], datetime.timedelta(seconds=100))
    opt = DistributedOptimizer(model.named_parameters(), model.spec(), spec.optimizer, spec.matrix_config,
                               group=sub if flat is None else flat)
    replica, shard = sub.get_coordinate()
    grads = train_stage(model, opt, spec, replica * sub.size(1) + shard, sub.size())
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    dist.barrier(group=opt.world.group)  # the whole stage has trained
    if stage == 0:
        store.set("stage 0 trained", "1")
    return {"stage": stage, "params": params, "grads": grads, "exchange": opt.size, "world": opt.world.size,
            "flat group": flat is not None and opt.world.group is flat.get_group()}


def tp_stage_spec(stage: int) -> TrainSpec:
    return replace(PP_SPEC, preset="tiny-untied", tp=2, tp_style="dtensor", global_batch=4, seq_len=16,
                   model_seed=stage, data_seed=1 + stage)


def tp_stage_run(rank: int, world: int) -> dict:
    """torchtitan's PP x TP, no data parallelism: a (pp, tp) world mesh of TP 2, each stage's model
    (its own seed and data) `parallelize_module`-d over `mesh['tp']` (DTensors, no fully_shard: the
    ZeRO-1 step), one optimizer per stage given `group=mesh['tp']` (a 1-D mesh named 'tp': DP of
    one rank). The other stages build theirs only once stage 0 has trained."""
    import contextlib

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from canzona.harness.training import GradientRecorder, build_tp_model, train_steps
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.shards import local_tensor

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("pp", "tp"))
    stage = mesh["pp"].get_local_rank()
    spec = tp_stage_spec(stage)
    model, mspec = build_tp_model(spec, mesh)
    recorder = GradientRecorder(model.named_parameters(), spec.master_weights)
    store = dist.distributed_c10d._get_default_store()
    if stage > 0:
        store.wait(["tp stage 0 trained"], datetime.timedelta(seconds=100))
    try:
        opt = DistributedOptimizer(model.named_parameters(), mspec, spec.optimizer, spec.matrix_config,
                                   group=mesh["tp"])
        vocab = mspec.param("model.embed_tokens.weight").shape[0]
        _, _, grads = train_steps(model, opt, spec, vocab, 0, 1, lambda k, n: contextlib.nullcontext(),
                                  recorder.take)
        opt.wait_params()
        dist.barrier(group=mesh["tp"].get_group())  # the whole stage has trained
    finally:  # (refused too: the other stages go on to their own refusal)
        if stage == 0:
            store.set("tp stage 0 trained", "1")
    return {"stage": stage, "params": {n: local_tensor(p).detach().clone() for n, p in model.named_parameters()},
            "grads": grads, "dp_rank": opt.rank, "dp": opt.dp, "tp_rank": opt.tp_rank,
            "tp_dims": {p.name: p.tp_dim for p in mspec.params}}


def fsdp_tp_stage_run(rank: int, world: int) -> dict:
    """torchtitan's PP x FSDP x TP: a (pp, dp_shard, tp) world mesh with dp_shard flattened as 'dp'
    on every rank at the start (as torchtitan's ParallelDims does), each stage's model
    `parallelize_module`-d over `mesh['tp']` and `fully_shard`ed over `mesh['dp']`, one optimizer
    per stage given `group=mesh['dp', 'tp']` (what the SpecError for `mesh['dp_shard', 'tp']` asks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from canzona.runtime import DistributedOptimizer
    from reference.tiny_model_tp import parallelize_tiny

    mesh = init_device_mesh("cpu", (2, 2, world // 4), mesh_dim_names=("pp", "dp_shard", "tp"))
    mesh["dp_shard"]._flatten("dp")
    stage = mesh["pp"].get_local_rank()
    spec = replace(PP_SPEC, model_seed=stage, data_seed=1 + stage)
    model = parallelize_tiny(build_model(spec), mesh["tp"])
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = DistributedOptimizer(model.named_parameters(), model.spec(), spec.optimizer, spec.matrix_config,
                               group=mesh["dp", "tp"])
    grads = train_stage(model, opt, spec, mesh["dp"].get_local_rank(), mesh["dp"].size())
    return {"stage": stage, "grads": grads, "params": {n: p.full_tensor() for n, p in model.named_parameters()},
            "kind": type(opt).__name__, "exchange": opt.size}


def stages_run(rank: int, world: int, pp: int, flatten: bool) -> dict:
    """PP x HSDP's stages, then (the same spawn, unless `flatten`) PP x TP's and PP x FSDP x TP's."""
    from canzona.errors import CanzonaError

    out = {"hsdp": stage_run(rank, world, pp, flatten)}
    if flatten:  # (the slow variant: PP x TP runs in the other)
        return out
    try:
        out["tp"] = tp_stage_run(rank, world)
    except CanzonaError as e:  # refused on every rank (before: the 1-D 'tp' mesh)
        out["tp"] = {"error": f"{type(e).__name__}: {e}"}
    out["fsdp tp"] = fsdp_tp_stage_run(rank, world)
    return out


@functools.cache
def _stage_runs(flatten: bool) -> list[dict]:
    return run_ranks(stages_run, 8, 2, flatten, deadline_s=200.0)


def test_pipeline_stages_of_tensor_parallel_models_without_dp() -> None:
    """8 ranks = pp 4 x tp 2, no DP (torchtitan's mesh has no 'dp' dimension then): each stage's
    optimizer over `mesh['tp']` steps its DTensor TP model (Muon, clipping) bit for bit as the
    single-process reference fed that stage's global gradients. Before: refused ('a 1-D device mesh
    named 'tp' holds no data-parallel dimension: give the 2-D mesh with dimensions 'dp' and 'tp''),
    a mesh torchtitan's PP x TP never builds."""
    from canzona.harness.training import expected_shards, global_gradients_from

    results = [r["tp"] for r in _stage_runs(False)]
    assert all("error" not in r for r in results), results[0]
    for stage in range(4):
        mine = [r for r in results if r["stage"] == stage]
        assert len(mine) == 2 and all(r["dp"] == 1 and r["dp_rank"] == 0 for r in mine)
        spec = tp_stage_spec(stage)
        want = emulate(spec, 1, grads=global_gradients_from(mine, spec))
        for r in mine:
            exact = compare(r["params"], expected_shards(want, r["tp_dims"], 2, r["tp_rank"]))
            assert exact["bit_identical"], (stage, r["tp_rank"], exact)
    assert not torch.equal(results[0]["params"][LAST], results[2]["params"][LAST])


def test_pipeline_stages_of_fsdp_tp_given_torchtitans_flattened_dp_beside_tp() -> None:
    """8 ranks = pp 2 x dp_shard 2 x tp 2, `group=mesh['dp', 'tp']`: each stage bit for bit the
    single-process reference fed its global gradients (the mesh the SpecError of
    `mesh['dp_shard', 'tp']` names, `test_mesh_axes.py`)."""
    results = [r["fsdp tp"] for r in _stage_runs(False)]
    assert all(r["kind"] == "FsdpOptimizer" and r["exchange"] == 4 for r in results)
    for stage in (0, 1):
        mine = [r for r in results if r["stage"] == stage]
        spec = replace(PP_SPEC, model_seed=stage, data_seed=1 + stage)
        want = emulate(spec, 2, grads=mine[0]["grads"])
        for r in mine:
            exact = compare(r["params"], want)
            assert exact["bit_identical"], (stage, exact)


@pytest.mark.parametrize("flatten", [False, pytest.param(True, marks=pytest.mark.slow)])  # 8 ranks each
def test_pipeline_stages_build_their_groups_alone(flatten: bool) -> None:
    """8 ranks = pp 2 x dp_replicate 2 x dp_shard 2: each stage's optimizer spans its 4 ranks (its
    world group, over two mesh dimensions: a group the DeviceMesh lacks unless `flatten`) and exchanges over its shard
    pairs; stage 1's built after stage 0 trained. Each stage's parameters are, bit for bit, the
    single-process reference's fed that stage's global gradients."""
    results = [r["hsdp"] for r in _stage_runs(flatten)]
    assert all(r["flat group"] == flatten for r in results)
    for stage in (0, 1):
        mine = [r for r in results if r["stage"] == stage]
        assert len(mine) == 4 and all(r["exchange"] == 2 and r["world"] == 4 for r in mine)
        spec = replace(PP_SPEC, model_seed=stage, data_seed=1 + stage)
        want = emulate(spec, 4, grads=mine[0]["grads"])
        for r in mine:
            exact = compare(r["params"], want)
            assert exact["bit_identical"], (stage, exact)
    assert not torch.equal(results[0]["params"][LAST], results[4]["params"][LAST])


# --- PP x FSDP: torch's pipelining over fully_shard-ed stages, against the simulator's memory -------

PIPE_WORLD, PIPE_PP = 4, 2  # pp 2 x dp 2
PIPE_SPEC = TrainSpec(preset="tiny-untied", steps=2, global_batch=8, seq_len=8)
PIPE_OPTIMIZERS = {"muon": {"ns_dtype": "fp32"}, "adamw": None}


def pipeline_stage_module(spec: TrainSpec, pp: int, stage: int):
    """Stage `stage` of the tiny model as torchtitan cuts it (`pipeline_module_split`): its layers
    (`canzona.pipeline.rank_layers`, kept under their global names in a ModuleDict), the embedding
    on the first stage, the final norm and head on the last; the parameters
    `canzona.pipeline.stage_spec` gives the stage."""
    from torch import nn

    from canzona.pipeline import rank_layers
    from reference.tiny_model import rope_cos_sin

    model = build_model(spec)
    cfg = model.cfg
    mine = rank_layers(cfg.layers, pp, stage)
    model.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in mine})
    first, last = stage == 0, stage == pp - 1
    if not first:
        model.model.embed_tokens = None
    if not last:
        model.model.norm, model.lm_head = None, None

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.lm_head = model.model, model.lm_head

        def forward(self, x):
            if first:
                x = self.model.embed_tokens(x)
            cos, sin = rope_cos_sin(torch.arange(x.shape[1]), cfg.head_dim, cfg.rope_theta, x.dtype)
            for layer in self.model.layers.values():
                x = layer(x, cos, sin)
            return self.lm_head(self.model.norm(x)) if last else x

    return Stage()


def pipeline_run(rank: int, world: int) -> dict[str, dict]:
    """Each optimizer of PIPE_OPTIMIZERS on torchtitan's PP x FSDP: a (pp, dp) mesh, each stage
    `fully_shard`-ed per layer and at its root over `mesh['dp']`, trained by torch's Schedule1F1B
    (2 micro-batches a rank) and one DistributedOptimizer a stage; each rank's held bytes after
    the steps (`held_bytes`)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from canzona.pipeline import stage_spec
    from canzona.runtime import DistributedOptimizer
    from tests.runtime.test_fsdp_runtime import held_bytes

    mesh = init_device_mesh("cpu", (PIPE_PP, world // PIPE_PP), mesh_dim_names=("pp", "dp"))
    stage, dp = mesh["pp"].get_local_rank(), mesh["dp"]
    out = {}
    for name, matrix_config in PIPE_OPTIMIZERS.items():
        spec = replace(PIPE_SPEC, optimizer=name, matrix_config=matrix_config)
        module = pipeline_stage_module(spec, PIPE_PP, stage)
        for layer in module.model.layers.values():
            fully_shard(layer, mesh=dp)
        fully_shard(module, mesh=dp)
        mspec = stage_spec(build_model(spec).spec(), PIPE_PP, stage)
        opt = DistributedOptimizer(module.named_parameters(), mspec, spec.optimizer, spec.matrix_config,
                                   spec.adamw_config, group=dp)
        pipe = PipelineStage(module, stage, PIPE_PP, torch.device("cpu"), group=mesh["pp"].get_group())

        def loss_fn(logits, target):
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

        schedule = Schedule1F1B(pipe, n_microbatches=2, loss_fn=loss_fn)
        vocab = build_model(spec).cfg.vocab
        for tokens in global_batches(spec, vocab):
            opt.zero_grad()
            (mb,) = micro_batches(tokens, dp.get_local_rank(), dp.size(), 1)
            if stage == 0:
                schedule.step(mb[:, :-1])
            else:
                schedule.step(target=mb[:, 1:])
            opt.step()
        out[name] = {"stage": stage, "member": opt.rank, "held": held_bytes(opt)}
    return out


@functools.cache
def _pipeline_runs() -> list[dict[str, dict]]:
    return run_ranks(pipeline_run, PIPE_WORLD, deadline_s=120.0)


@pytest.mark.parametrize("optimizer", list(PIPE_OPTIMIZERS))
def test_the_simulator_reports_each_pipeline_stage_ranks_holding(optimizer: str) -> None:
    """`canzona simulate --fsdp --pp 2` of the tiny model at 4 ranks (DP 2; fp32, `param_bytes=4`):
    per stage and rank, every persistent category (weights, gradients, masters, matrix and AdamW
    state) is what torch's pipelining over the fully_shard-ed stage and its DistributedOptimizer
    hold after the steps."""
    from canzona.catalog import build_decoder
    from canzona.models import ModelSource
    from reference.tiny_model import PRESETS
    from sim.fsdp_pipeline import fsdp_stage_memories
    from sim.simulate import SimConfig, simulate
    from sim.workload import Workload

    cfg = PRESETS[PIPE_SPEC.preset].as_catalog()
    model = (build_model(PIPE_SPEC).spec(), ModelSource(build_decoder(cfg), "catalog", cfg).architecture())
    sim = SimConfig(model=cfg.name, gpus=PIPE_WORLD, tp=1, pp=PIPE_PP, fsdp=True, optimizer=optimizer,
                    matrix_config=PIPE_OPTIMIZERS[optimizer],
                    workload=Workload(global_batch=PIPE_SPEC.global_batch, seq_len=PIPE_SPEC.seq_len, param_bytes=4))
    stages = fsdp_stage_memories(sim, model)
    assert simulate(sim, model=model).memory in stages  # simulate reports the fullest of them
    runs = [r[optimizer] for r in _pipeline_runs()]
    assert [r["stage"] for r in runs] == [0, 0, 1, 1] and [r["member"] for r in runs] == [0, 1, 0, 1]
    for r in runs:
        want = stages[r["stage"]].ranks[r["member"]]
        for k, v in r["held"].items():
            assert v == getattr(want, k), (optimizer, r["stage"], r["member"], k, v, getattr(want, k))
    assert runs[0]["held"]["weights"] != runs[2]["held"]["weights"]  # the stages hold different parts
