"""Mistakes under tensor parallelism end in one clear error on every rank, never a hang and never
silently wrong numbers: plans for another TP size, ranks that disagree, unsharded weights given to
a TP job, DTensors placed against the spec or without a TP group, groups that mix DP indices, a
model that forgets to reduce a replicated weight's gradient over TP, a TP rank that skips
backward. All jobs run in ONE spawned group of 4 ranks (DP 2 x TP 2); after each, a fresh
all-reduce over the world still pairs up, so no rank was left inside a collective."""

from __future__ import annotations

import functools
import math
import time

import pytest
import torch
import torch.distributed as dist

from canzona.errors import CanzonaError, PlanError, SpecError
from canzona.harness.launch import run_ranks

pytestmark = pytest.mark.distributed  # spawns gloo process groups

WORLD, DP, TP = 4, 2, 2
LATE_S = 0.5  # DP index 1's delay launching its parameter gathers (dtensor_read_with_gathers_in_flight)


def _outcome(fn) -> dict:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects the type and message
        return {"type": type(e).__name__, "canzona": isinstance(e, CanzonaError), "message": str(e)}
    return {"type": None, "canzona": False, "message": ""}


def _healthy() -> bool:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item() == WORLD


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))


def _tp_model(mesh, preset: str = "tiny"):
    from reference.tiny_model_tp import TinyQwen3TP

    return TinyQwen3TP(preset, mesh.get_group("tp"))


def _optimizer(model, spec, group, **kwargs):
    from canzona.runtime.optimizer import DistributedOptimizer

    return DistributedOptimizer(model.named_parameters(), spec, group=group, timeout_s=20, **kwargs)


def _train_step(model, opt, mesh, backward: bool = True, between=None) -> None:
    """One step; `between(opt)` runs between backward and step()."""
    from reference.data import fixed_batch

    tokens = fixed_batch(256, 4, 16, seed=1)
    i = mesh.get_local_rank("dp")
    opt.zero_grad()
    if backward:
        model.loss(tokens[2 * i:2 * i + 2]).backward()
    if between is not None:
        between(opt)
    opt.step()


# --- the jobs (each runs on every rank) ---------------------------------------------------------


def plan_for_another_tp(rank: int) -> dict:
    from canzona.plan import make_plan

    mesh = _mesh()
    model = _tp_model(mesh)
    plan = make_plan(model.spec(), DP, 1, "muon")
    return _outcome(lambda: _optimizer(model, model.spec(), mesh, plan=plan))


def ranks_disagree_on_the_mode(rank: int) -> dict:
    mesh = _mesh()
    model = _tp_model(mesh)
    mode = "serial" if mesh.get_local_rank("tp") == 1 else "pipelined"
    return _outcome(lambda: _optimizer(model, model.spec(), mesh, tp_mode=mode))


def unsharded_weights(rank: int) -> dict:
    from reference.tiny_model import TinyQwen3

    mesh = _mesh()
    model = TinyQwen3("tiny")  # the whole model on every rank, but a TP mesh
    return _outcome(lambda: _optimizer(model, model.spec(), mesh))


def spec_of_the_local_shards(rank: int) -> dict:
    """`ModelSpec.from_module` on Megatron-style shards without `tp_size`: the local shapes as global."""
    from canzona.spec import ModelSpec

    mesh = _mesh()
    model = _tp_model(mesh)
    return _outcome(lambda: _optimizer(model, ModelSpec.from_module(model), mesh))


def dtensor_against_the_spec(rank: int) -> dict:
    from dataclasses import replace

    from canzona.spec import ModelSpec
    from reference.tiny_model import TinyQwen3
    from reference.tiny_model_tp import parallelize_tiny

    mesh = _mesh()
    model = parallelize_tiny(TinyQwen3("tiny-untied"), mesh["tp"])
    spec = model.spec()
    name = "model.layers.0.self_attn.o_proj.weight"  # rowwise: Shard(1); the spec now says dim 0
    wrong = ModelSpec(spec.name, tuple(replace(p, tp_dim=0) if p.name == name else p for p in spec.params))
    return _outcome(lambda: _optimizer(model, wrong, mesh))


def dtensor_without_a_tp_group(rank: int) -> dict:
    from canzona.spec import ModelSpec
    from reference.tiny_model import TinyQwen3
    from reference.tiny_model_tp import parallelize_tiny

    mesh = _mesh()
    model = parallelize_tiny(TinyQwen3("tiny-untied"), mesh["tp"])
    return _outcome(lambda: _optimizer(model, ModelSpec.from_module(model), mesh["dp"]))


def mesh_with_another_dimension(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "cp"))
    model = _tp_model(_mesh())
    return _outcome(lambda: _optimizer(model, model.spec(), mesh))


def groups_mixing_dp_indices(rank: int) -> dict:
    """DP groups {0, 1}, {2, 3} but TP groups {0, 3}, {1, 2}: TP peers of different DP indices."""
    dp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    tp_groups = [dist.new_group([0, 3]), dist.new_group([1, 2])]
    dp_group = dp_groups[rank // 2]
    tp_group = tp_groups[0 if rank in (0, 3) else 1]
    model = _tp_model_on(tp_group)
    return _outcome(lambda: _optimizer(model, model.spec(), dp_group, tp_group=tp_group))


def _tp_model_on(group):
    from reference.tiny_model_tp import TinyQwen3TP

    return TinyQwen3TP("tiny", group)


def replicated_gradient_not_reduced(rank: int) -> dict:
    """A model whose per-head QK norm forgets to sum its weight's gradient over TP."""
    from reference.tiny_model import RMSNorm

    mesh = _mesh()
    model = _tp_model(mesh)
    norm = model.model.layers[1].self_attn.k_norm
    norm.forward = lambda x: RMSNorm.forward(norm, x)  # the plain norm: no reduction over TP
    opt = _optimizer(model, model.spec(), mesh)
    return _outcome(lambda: _train_step(model, opt, mesh))


def tp_rank_skips_backward(rank: int) -> dict:
    """TP rank 1 of each DP index runs no backward; TP rank 0 runs one that needs no TP peer."""
    mesh = _mesh()
    model = _tp_model(mesh)
    opt = _optimizer(model, model.spec(), mesh)

    def step() -> None:
        opt.zero_grad()
        if mesh.get_local_rank("tp") == 0:
            sum(p.sum() for p in model.parameters()).backward()
        opt.step()
    return _outcome(step)


def one_rank_another_tp_policy(rank: int) -> dict:
    """One rank plans with another TP scheduler: its DP group finds out first, and everyone else
    must hear of it at once rather than wait out the timeout."""
    import time

    mesh = _mesh()
    model = _tp_model(mesh)
    scheduler = "tp-chunk" if rank == WORLD - 1 else "greedy-rollback"
    start = time.monotonic()
    out = _outcome(lambda: _optimizer(model, model.spec(), mesh, tp_policy=scheduler))
    out["seconds"] = time.monotonic() - start
    return out


def ranks_plan_on_other_gpus(rank: int) -> dict:
    """cost_model=None on rank 3 alone on an H200 (stood in: `gpu_name`), its peers on the CPU's
    default profile: the plans differ, and the errors name the profile each side planned with."""
    from canzona.runtime import options

    mesh = _mesh()
    model = _tp_model(mesh)
    asked = options.gpu_name
    if rank == WORLD - 1:
        options.gpu_name = lambda device: "NVIDIA H200"
    try:
        return _outcome(lambda: _optimizer(model, model.spec(), mesh))
    finally:
        options.gpu_name = asked


def scheduler_on_one_tp_rank(rank: int) -> dict:
    """An LR edit on TP rank 0 only (a `if rank == 0: scheduler.step()` habit): the replicated norms
    would get different updates on the two TP ranks."""
    mesh = _mesh()
    model = _tp_model(mesh)
    opt = _optimizer(model, model.spec(), mesh)
    _train_step(model, opt, mesh)
    if mesh.get_local_rank("tp") == 0:
        for group in opt.param_groups:
            group["lr"] *= 0.5
    return _outcome(lambda: _train_step(model, opt, mesh))


def _sharded_weights_changed_on_one_tp_rank(load: bool) -> dict:
    """A DTensor TP model's TP-sharded weights changed after a step on TP rank 0 only, alike on its
    two DP replicas (`load`: by `model.load_state_dict` of those weights, strict=False; else written
    in place into their local shards): every checksum the ranks compare stays equal (the DP
    replicas of TP rank 0 hold the same new shards, the TP-replicated weights are untouched), and
    the step trained TP rank 0's new shards with TP rank 1's old ones silently."""
    from canzona.runtime.shards import is_dtensor
    from reference.tiny_model import TinyQwen3
    from reference.tiny_model_tp import parallelize_tiny

    mesh = _mesh()
    model = parallelize_tiny(TinyQwen3("tiny-untied"), mesh["tp"])
    opt = _optimizer(model, model.spec(), mesh)
    _train_step(model, opt, mesh)
    sharded = {n: p for n, p in model.named_parameters()
               if is_dtensor(p) and any(pl.is_shard() for pl in p.placements)}
    if mesh.get_local_rank("tp") == 0:
        # the step's gathers land first (the reads and the load below wait by themselves now: a
        # DTensor is marked pending, `load_state_dict` has its pre-hook; before, new values read while
        # a gather was still landing differed between the DP replicas, CI saw it once)
        opt.wait_params()
        with torch.no_grad():
            if load:
                model.load_state_dict({n: p.detach() + 1.0 for n, p in sharded.items()}, strict=False)
            else:
                for p in sharded.values():
                    p.to_local().add_(1.0)
    return _outcome(lambda: _train_step(model, opt, mesh))


def sharded_load_on_one_tp_rank(rank: int) -> dict:
    return _sharded_weights_changed_on_one_tp_rank(load=True)


def sharded_write_on_one_tp_rank(rank: int) -> dict:
    return _sharded_weights_changed_on_one_tp_rank(load=False)


def _state_key_edit(on_every_rank: bool) -> dict:
    """SOAP's max_precond_dim edited in param_groups after a step (48: one-sided factors of the
    64-wide matrices, other state than the plan priced), on every rank or on the last only."""
    mesh = _mesh()
    model = _tp_model(mesh)
    opt = _optimizer(model, model.spec(), mesh, optimizer="soap")
    _train_step(model, opt, mesh)
    if on_every_rank or dist.get_rank() == WORLD - 1:
        for group in opt.param_groups:
            if group["kind"] == "matrix":
                group["max_precond_dim"] = 48
    return _outcome(lambda: _train_step(model, opt, mesh))


def state_key_edit_on_every_rank(rank: int) -> dict:
    return _state_key_edit(True)


def state_key_edit_on_one_rank(rank: int) -> dict:
    return _state_key_edit(False)


def lr_edit_after_clip_on_one_rank(rank: int) -> dict:
    """A learning rate halved on one rank of the grid after `clip_grad_norm_()`, whose check step()
    reuses: its DP group sees the difference at step(), its TP peers learn that group failed (and
    the other DP group from its own TP peers), before any update."""
    mesh = _mesh()
    model = _tp_model(mesh)
    opt = _optimizer(model, model.spec(), mesh)
    _train_step(model, opt, mesh)

    def clip_then_edit(o) -> None:
        o.clip_grad_norm_(1.0)
        if rank == WORLD - 1:
            for group in o.param_groups:
                group["lr"] *= 0.5
    return _outcome(lambda: _train_step(model, opt, mesh, between=clip_then_edit))


def retried_after_the_scheduler_on_one_tp_rank(rank: int) -> dict:
    """`scheduler_on_one_tp_rank` under overlap_step (each TP rank computed its updates before the
    check, TP rank 0 with its halved learning rate), the learning rate put back and `step()` called
    again: the step of those gradients, on every rank alike, as a straight run's."""
    mesh = _mesh()
    straight = _tp_model(mesh)
    straight_opt = _optimizer(straight, straight.spec(), mesh, overlap_step=True)
    for _ in range(2):
        _train_step(straight, straight_opt, mesh)
    model = _tp_model(mesh)
    opt = _optimizer(model, model.spec(), mesh, overlap_step=True)
    _train_step(model, opt, mesh)
    lrs = [group["lr"] for group in opt.param_groups]
    if mesh.get_local_rank("tp") == 0:
        for group in opt.param_groups:
            group["lr"] *= 0.5
    out = _outcome(lambda: _train_step(model, opt, mesh))
    for group, lr in zip(opt.param_groups, lrs):
        group["lr"] = lr
    out["retried"] = _outcome(opt.step)
    straight.state_dict(), model.state_dict()  # the step's parameter gathers are waited for
    out["exact"] = all(torch.equal(a, b) for a, b in zip(straight.parameters(), model.parameters()))
    return out


def backward_without_zero_grad(rank: int) -> dict:
    from reference.data import fixed_batch

    mesh = _mesh()
    model = _tp_model(mesh)
    opt = _optimizer(model, model.spec(), mesh)
    _train_step(model, opt, mesh)
    i = mesh.get_local_rank("dp")
    tokens = fixed_batch(256, 4, 16, seed=2)
    before = [q.detach().clone() for q in model.parameters()]

    def step() -> None:  # no zero_grad since the step: refused by the step's check (before: in the backward)
        model.loss(tokens[2 * i:2 * i + 2]).backward()
        opt.step()

    out = _outcome(step)
    out["unchanged"] = all(torch.equal(q, b) for q, b in zip(model.parameters(), before))
    return out


def step_twice(rank: int) -> dict:
    """step() called again after a completed step, with no backward (nor zero_grad) in between."""
    mesh = _mesh()
    model = _tp_model(mesh)
    opt = _optimizer(model, model.spec(), mesh)
    _train_step(model, opt, mesh)
    return _outcome(opt.step)


def grad_scaler(rank: int) -> dict:
    """torch.amp.GradScaler under TP with overlap_step, scale 2**10: the unscaled step's weights bit
    for bit, through `scaler.step` alone and through `unscale_` first, the early updates made from
    the gradients times the inverse scale and kept either way (`overlapped`; `scaler.step` alone:
    the scale its inf check's GradScaler holds). Before: 'GradScaler is not supported'; then the
    first step through `scaler.step` alone dropped them (made at no known scale)."""
    from reference.data import fixed_batch

    mesh = _mesh()
    i = mesh.get_local_rank("dp")
    tokens = fixed_batch(256, 4, 16, seed=1)[2 * i:2 * i + 2]
    straight = _tp_model(mesh)
    _train_step(straight, _optimizer(straight, straight.spec(), mesh, overlap_step=True), mesh)
    exact, overlapped = [], []

    def scaled(unscale: bool) -> None:
        model = _tp_model(mesh)
        opt = _optimizer(model, model.spec(), mesh, overlap_step=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        opt.zero_grad()
        scaler.scale(model.loss(tokens)).backward()
        if unscale:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        straight.state_dict(), model.state_dict()  # the step's parameter gathers are waited for
        exact.append(all(torch.equal(a, b) for a, b in zip(straight.parameters(), model.parameters())))
        overlapped.append(opt.overlapped_steps)
    out = _outcome(lambda: [scaled(unscale) for unscale in (False, True)])
    out["exact"], out["overlapped"] = exact, overlapped
    return out


def grad_scaler_dtensor(rank: int) -> dict:
    """torch.amp.GradScaler on a TP model of DTensors (`parallelize_tiny`, torch's parallel styles),
    scale 2**10, two steps: through `scaler.step` alone and through `unscale_` first, the unscaled
    run's weights bit for bit (`exact`); an Inf in rank 1's loss at the second step skipped on every
    rank, the scale 2**10 -> 2**9 alike (`scales`, `skipped`, `kept`); `unscale_` after a clip one
    error (`clip`). Before: DTensor's own error at the unscale ('got mixed torch.Tensor and
    DTensor': GradScaler's one op over guards and DTensors wrapping guards). The same handed a
    wrapper of the optimizer (`wrapped`: `scaler.step` alone through a Lightning-style one, `unscale_`
    through a user's proxy; tests/runtime/amp_wrappers.py): before, the op went to torch's handler
    and met DTensor's error."""
    from canzona.runtime.grad_guard import AMP_AFTER_CLIP
    from canzona.runtime.shards import local_tensor
    from reference.data import fixed_batch
    from reference.tiny_model import TinyQwen3
    from reference.tiny_model_tp import parallelize_tiny
    from tests.runtime.amp_wrappers import WRAPPERS

    mesh = _mesh()
    i = mesh.get_local_rank("dp")
    batches = [fixed_batch(256, 4, 16, seed=s)[2 * i:2 * i + 2] for s in (1, 2)]

    def run(how: str, wrap: str | None = None) -> tuple[list[torch.Tensor], list[float], int, list[bool]]:
        model = parallelize_tiny(TinyQwen3("tiny-untied"), mesh["tp"])
        opt = _optimizer(model, model.spec(), mesh)
        given = opt if wrap is None else WRAPPERS[wrap](opt)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        scales, kept = [], []
        for step, tokens in enumerate(batches):
            before = [local_tensor(p).clone() for p in model.parameters()]
            opt.zero_grad()
            loss = model.loss(tokens)
            if how == "plain":
                loss.backward()
                opt.step()
                continue
            scaler.scale(loss * math.inf if how == "inf" and step == 1 and rank == 1 else loss).backward()
            if how != "step":
                scaler.unscale_(given)
            scaler.step(given)
            scaler.update()
            opt.wait_params()
            scales.append(scaler.get_scale())
            kept.append(all(torch.equal(a, local_tensor(b)) for a, b in zip(before, model.parameters())))
        opt.wait_params()
        return [local_tensor(p).clone() for p in model.parameters()], scales, opt.skipped_steps, kept

    def clipped_first() -> None:
        model = parallelize_tiny(TinyQwen3("tiny-untied"), mesh["tp"])
        opt = _optimizer(model, model.spec(), mesh)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        scaler.scale(model.loss(batches[0])).backward()
        opt.clip_grad_norm_(0.05)
        scaler.unscale_(opt)

    out: dict = {}

    def runs() -> None:
        plain = run("plain")[0]
        out["exact"] = [all(torch.equal(a, b) for a, b in zip(plain, run(how)[0])) for how in ("step", "unscale")]
        out["wrapped"] = [all(torch.equal(a, b) for a, b in zip(plain, run(how, wrap)[0]))
                          for how, wrap in (("step", "forwarding"), ("unscale", "proxy"))]
        _, out["scales"], out["skipped"], out["kept"] = run("inf")
        clip = _outcome(clipped_first)
        out["clip"] = clip["canzona"] and clip["message"] == AMP_AFTER_CLIP
    out.update(_outcome(runs))
    return out


def scalars_under_tp(rank: int) -> dict:
    """`tests.runtime.scalars.Scaled` split by DTensor TP (a column-, b row-parallel), its 0-d gate
    and logit_scale left plain (replicated): three steps; the spec's TP dims, the full parameters
    and the scalars' full state."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from canzona.spec import ModelSpec
    from tests.runtime import scalars

    mesh = _mesh()
    got: dict = {}

    def train() -> None:
        model = scalars.Scaled()
        parallelize_module(model, mesh["tp"], {"a": ColwiseParallel(), "b": RowwiseParallel()})
        spec = ModelSpec.from_module(model)
        got["tp_dims"] = {p.name: p.tp_dim for p in spec.params}
        opt = _optimizer(model, spec, mesh, adamw_config={"weight_decay": scalars.WEIGHT_DECAY})
        for step in range(3):
            opt.zero_grad()
            scalars.backward(model, step, mesh.get_local_rank("dp"), DP)
            opt.step()
        model.state_dict()  # waits for the last step's parameter gathers
        got["params"] = {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
                         for n, p in model.named_parameters()}
        got["state"] = {n: s for n, s in scalars.by_name(opt.state_dict()).items() if n in ("gate", "logit_scale")}

    return {**_outcome(train), **got}


def _late(launch):
    time.sleep(LATE_S)
    return launch()


def dtensor_read_with_gathers_in_flight(rank: int) -> dict:
    """A DTensor TP model's step under overlap_param_gather (the default), DP index 1 launching its
    parameter all-gathers `LATE_S` late: on DP index 0 its segments' gathers are in flight when
    step() returns. Every DTensor parameter is marked pending then (`pending`: the wrapper's class and
    its local tensor's), and `p.to_local().clone()` read then waits: each parameter bit for bit the
    step with the gathers inside it (`exact`). Before DTensors were marked, the read saw last
    step's values of the late rank's segments."""
    from canzona.runtime.shards import is_dtensor
    from reference.tiny_model import TinyQwen3
    from reference.tiny_model_tp import parallelize_tiny

    mesh = _mesh()
    got: dict = {}

    def run() -> None:
        reads = {}
        for overlap in (False, True):
            model = parallelize_tiny(TinyQwen3("tiny-untied"), mesh["tp"])
            opt = _optimizer(model, model.spec(), mesh, overlap_param_gather=overlap)
            if overlap and mesh.get_local_rank("dp") == 1:
                opt._launch_gathers = functools.partial(_late, opt._launch_gathers)
            _train_step(model, opt, mesh)
            dtensors = {n: p for n, p in model.named_parameters() if is_dtensor(p)}
            if overlap:
                got["in flight"] = opt._in_flight.in_flight
                got["pending"] = bool(dtensors) and all(  # pending_params' classes
                    (type(p).__name__, type(p._local_tensor).__name__) == ("PendingDTensor", "PendingLocal")
                    for p in dtensors.values())
            reads[overlap] = {n: p.to_local().clone() for n, p in dtensors.items()}
        got["exact"] = all(torch.equal(reads[True][n], t) for n, t in reads[False].items())
    return {**_outcome(run), **got}


def skipped_step_collectives(rank: int) -> dict:
    """Three steps under nonfinite="skip", rank 3's loss NaN at the second (the step skipped on
    every rank), under canzona's default policy (Muon) and zero1 (AdamW): each step's collectives, DP and TP
    interleaved in issue order, for `step_collectives(..., skipped=True)`."""
    from reference.data import fixed_batch

    mesh = _mesh()
    i = mesh.get_local_rank("dp")
    tokens = fixed_batch(256, 4, 16, seed=1)[2 * i:2 * i + 2]
    got: dict = {"runs": []}

    def run(policy: str | None) -> None:
        model = _tp_model(mesh)
        opt = _optimizer(model, model.spec(), mesh, nonfinite="skip", policy=policy,
                         optimizer="adamw" if policy == "zero1" else "muon")
        for s in range(3):
            opt.zero_grad()
            loss = model.loss(tokens)
            (loss * math.nan if s == 1 and rank == 3 else loss).backward()
            opt.step()
        records = sorted(opt.comm.log.records + opt.tp_comm.log.records, key=lambda r: r.seq)
        got["runs"].append({
            "log": [[(r.op, r.group, r.name, tuple(r.bytes_per_rank)) for r in records if r.step == s]
                    for s in range(3)],
            "plan": opt.plan, "policy": opt.policy.name, "tp_mode": opt.tp_mode, "spec": model.spec(),
            "skipped": opt.skipped_steps})
        got["dp_rank"], got["tp_rank"] = i, mesh.get_local_rank("tp")
    return {**_outcome(lambda: [run(policy) for policy in (None, "zero1")]), **got}


def unlinked_on_one_rank(rank: int) -> dict:
    """Rank 3's copy of one weight assigned through `.data` after the optimizer was built (it keeps
    the optimizer's gradient hook, out of its buffers): backward runs on, and the step's check
    names it on every rank, nothing updated. Before: rank 3 raised inside backward (`_arrive`), its
    peers waiting in the step's collectives until the timeout."""
    mesh = _mesh()
    model = _tp_model(mesh)
    opt = _optimizer(model, model.spec(), mesh)
    p = model.get_parameter("model.layers.0.mlp.down_proj.weight")
    if rank == 3:
        p.data = p.detach().clone()
    before = [q.detach().clone() for q in model.parameters()]
    out = _outcome(lambda: _train_step(model, opt, mesh))
    out["unchanged"] = all(torch.equal(q, b) for q, b in zip(model.parameters(), before))
    return out


def stepped_again_on_one_rank(rank: int) -> dict:
    """After a step on every rank, DP index 1 (ranks 2 and 3: its TP group, which must run the
    model's forward together) skips a batch's zero_grad() and backward (a branch taken on that DP
    rank only) and calls step() again, DP index 0 stepping a fresh backward: the step's check names
    the left gradient on DP index 1 and fails on every rank, nothing updated. Before: DP index 1
    raised before its first bucket's reduction (`_take_all`), its DP peers waiting in it until the
    timeout."""
    mesh = _mesh()
    model = _tp_model(mesh)
    opt = _optimizer(model, model.spec(), mesh)
    _train_step(model, opt, mesh)
    before = [q.detach().clone() for q in model.parameters()]
    out = _outcome(opt.step if mesh.get_local_rank("dp") == 1 else lambda: _train_step(model, opt, mesh))
    out["unchanged"] = all(torch.equal(q, b) for q, b in zip(model.parameters(), before))
    return out


def dropped_mid_step_on_one_rank(rank: int) -> dict:
    """DP index 1 (ranks 2 and 3, its TP group) drops its batch after backward with model.zero_grad()
    and runs another backward, DP index 0 stepping its one backward: the step's check names the
    dropped gradient on DP index 1 and fails on every rank, nothing updated. Before: DP index 1
    raised inside its second backward (`_arrive`), DP index 0 waiting in the step's collectives
    until the timeout."""
    from reference.data import fixed_batch

    mesh = _mesh()
    model = _tp_model(mesh)
    opt = _optimizer(model, model.spec(), mesh)
    i = mesh.get_local_rank("dp")
    tokens = fixed_batch(256, 4, 16, seed=1)[2 * i:2 * i + 2]
    before = [q.detach().clone() for q in model.parameters()]

    def step() -> None:
        opt.zero_grad()
        model.loss(tokens).backward()
        if i == 1:
            model.zero_grad()
            model.loss(tokens).backward()
        opt.step()

    out = _outcome(step)
    out["unchanged"] = all(torch.equal(q, b) for q, b in zip(model.parameters(), before))
    return out


def jobs_worker(rank: int, world: int, jobs: list[str]) -> list[dict]:
    out = []
    for name in jobs:
        result = globals()[name](rank)
        result["healthy"] = _healthy()
        out.append(result)
    return out


JOBS = {
    "plan_for_another_tp": (PlanError, "plan is for tp=1, but the job has tp=2"),
    "ranks_disagree_on_the_mode": (PlanError, "ranks disagree on the policy"),
    "unsharded_weights": (PlanError, "'model.embed_tokens.weight': its local shard has shape (256, 64), but the "
                                     "model spec at tp=2 needs (128, 64)"),
    "spec_of_the_local_shards": (PlanError, "the spec must describe the global model: "
                                            "ModelSpec.from_module(model, tp_size=tp)"),
    "dtensor_against_the_spec": (PlanError, "'model.layers.0.self_attn.o_proj.weight' is placed S(1), but the model "
                                            "spec splits dimension 0"),
    "dtensor_without_a_tp_group": (PlanError, "the optimizer has no TP group: a tensor-parallel model needs"),
    "mesh_with_another_dimension": (SpecError, "canzona runs over dp, tp only"),
    "groups_mixing_dp_indices": (PlanError, "ranks disagree on the DP rank"),
    # the TP group that holds the norm's slice finds it; the others learn it failed
    "replicated_gradient_not_reduced": (CanzonaError, ("the gradient of TP-replicated parameter "
                                                       "'model.layers.1.self_attn.k_norm.weight' differs between TP "
                                                       "ranks", "the TP group of DP rank(s) [1] failed")),
    # the ranks that skipped, and their TP peers, whose own DP group was fine
    "tp_rank_skips_backward": (CanzonaError, ("found no gradient on any rank", "failed this step's check")),
    "one_rank_another_tp_policy": (PlanError, ("ranks disagree on the plan", "ranks disagree on the data-parallel "
                                               "agreement check", "failed the agreement check")),
    # rank 3's DP group (ranks 1, 3) and TP group (ranks 2, 3) find it; rank 0 learns it over TP
    "ranks_plan_on_other_gpus": (PlanError, ("ranks disagree on the plan's cost model", "ranks disagree on the "
                                             "data-parallel agreement check")),
    "scheduler_on_one_tp_rank": (CanzonaError, "TP ranks disagree on the hyper-parameters in param_groups"),
    # rank 3's DP group finds it; the others learn it over TP (the DP group of TP rank 1 failed)
    "lr_edit_after_clip_on_one_rank": (CanzonaError, ("ranks disagree on the hyper-parameters in param_groups",
                                                      "the data-parallel group of TP rank(s) [1] failed the "
                                                      "step's recheck")),
    # a key that keeps other state: the step's own check on every rank (before: stepped silently)
    "state_key_edit_on_every_rank": (PlanError, "was set to max_precond_dim=48 (matrix_config has 10000), which "
                                                "keeps other soap optimizer state than the plan priced"),
    # edited on rank 3 alone: the ranks' digest comparison, which runs first (its DP group finds it)
    "state_key_edit_on_one_rank": (CanzonaError, ("ranks disagree on the hyper-parameters in param_groups",
                                                  "the data-parallel group of TP rank(s) [1] failed this step's "
                                                  "check")),
    "backward_without_zero_grad": (CanzonaError, "onto the last step's: call optimizer.zero_grad() or "
                                                 "model.zero_grad() between steps"),
    # no backward ran: before, the message above ("backward would accumulate ...")
    # TP rank 0's sharded weights loaded (or written in place) on both its DP replicas alike: the TP
    # ranks' marks disagree (before: trained silently)
    "sharded_load_on_one_tp_rank": (PlanError, "ranks disagree on the mark of weights loaded (load_state_dict) or "
                                               "written in place on this rank since the last step"),
    "sharded_write_on_one_tp_rank": (PlanError, "ranks disagree on the mark of weights loaded (load_state_dict) or "
                                                "written in place on this rank since the last step"),
    "step_twice": (CanzonaError, "step() was called again with no backward since the last step(): the gradient of "),
    # rank 3 names it; its DP peer and the other TP rank learn it (a hang before: rank 3 raised
    # inside backward)
    "unlinked_on_one_rank": (CanzonaError, ("no longer lives in the optimizer's buffers",
                                            "found a broken step", "failed this step's check")),
    # DP index 1 names it; DP index 0 learns it (a hang before: DP index 1 raised before its first
    # bucket's reduction)
    "stepped_again_on_one_rank": (CanzonaError, ("step() was called again with no backward since the last step()",
                                                 "found a broken step")),
    # DP index 1 names it; DP index 0 learns it (before: DP index 0 timed out in the step's reduction)
    "dropped_mid_step_on_one_rank": (CanzonaError, ("was set to None (model.zero_grad(), or .grad = None) after this "
                                                    "step's gradients went to the reduction", "found a broken step")),
}


RETRIES = ["retried_after_the_scheduler_on_one_tp_rank"]  # a mistake, then the step made right
WORKS = ["skipped_step_collectives", "grad_scaler", "grad_scaler_dtensor", "scalars_under_tp", "dtensor_read_with_gathers_in_flight"]  # habits that must simply work


@functools.cache
def outcomes() -> dict:
    names = [*JOBS, *RETRIES, *WORKS]
    try:
        per_rank = run_ranks(jobs_worker, WORLD, names, deadline_s=240, collective_timeout_s=60)
    except Exception as e:  # noqa: BLE001 - replayed by every test
        return {"error": e}
    return {name: [r[i] for r in per_rank] for i, name in enumerate(names)}


@pytest.mark.parametrize("job", list(JOBS))
def test_mistake_is_one_error_on_every_rank(job):
    got = outcomes()
    if "error" in got:
        pytest.fail(f"the spawned group failed: {got['error']}\n{getattr(got['error'], 'trace', '')}")
    kind, needle = JOBS[job]
    for rank, out in enumerate(got[job]):
        assert out["type"] == kind.__name__ or (out["canzona"] and issubclass(kind, CanzonaError)), (rank, out)
        assert any(n in out["message"] for n in ((needle,) if isinstance(needle, str) else needle)), \
            (rank, out["message"])
        assert "\n" not in out["message"]
        assert out["healthy"], rank
    if not isinstance(needle, str):  # the cause is named where it was found
        assert any(needle[0] in out["message"] for out in got[job])
    assert not any("timed out" in out["message"] for out in got[job])  # nobody waited for a silent peer


def test_ranks_planning_on_other_gpus_profiles_name_both_profiles():
    """Each side's error says which profile it planned with and which its peer did (before: \"ranks
    disagree on the plan\", a digest's first 16 characters here)."""
    got = outcomes()
    if "error" in got:
        pytest.fail(f"the spawned group failed: {got['error']}")
    from canzona.runtime.options import COST_MODEL_ADVICE, COST_MODEL_FACT

    messages = [out["message"] for out in got["ranks_plan_on_other_gpus"]]
    remedy = f": {COST_MODEL_ADVICE[COST_MODEL_FACT]}"  # and what to do about it
    assert messages[3] == ("ranks disagree on the plan's cost model: rank 1 differs from rank(s) [0] (plan's cost "
                           "model analytic:h200 here; rank(s) [0]: analytic:h100-sxm)" + remedy)
    assert messages[1] == ("ranks disagree on the plan's cost model: rank 0 differs from rank(s) [1] (plan's cost "
                           "model analytic:h100-sxm here; rank(s) [1]: analytic:h200)" + remedy)
    assert messages[2] == messages[1]  # rank 3's TP peer: the same ranks in its TP group


def test_a_step_called_again_after_a_refused_overlapped_step_is_the_step_of_those_gradients():
    """Before: the TP rank whose learning rate had changed since its early updates dropped them and
    ran the plain step while its peer committed its own: the peer's collectives timed out, the TP
    ranks' weights apart."""
    got = outcomes()
    if "error" in got:
        pytest.fail(f"the spawned group failed: {got['error']}\n{getattr(got['error'], 'trace', '')}")
    for rank, out in enumerate(got["retried_after_the_scheduler_on_one_tp_rank"]):
        assert out["canzona"] and "failed" not in out["retried"]["message"], (rank, out)
        assert out["retried"]["type"] is None and out["exact"] and out["healthy"], (rank, out)


def test_grad_scaler_steps_as_the_unscaled_step_under_tp():
    got = outcomes()
    if "error" in got:
        pytest.fail(f"the spawned group failed: {got['error']}\n{getattr(got['error'], 'trace', '')}")
    for rank, out in enumerate(got["grad_scaler"]):
        assert out["type"] is None and out["exact"] == [True, True] and out["healthy"], (rank, out)
        assert out["overlapped"] == [1, 1], (rank, out["overlapped"])  # before: [0, 0], then [0, 1]


def test_grad_scaler_steps_a_dtensor_tp_model_as_the_unscaled_step():
    got = outcomes()
    if "error" in got:
        pytest.fail(f"the spawned group failed: {got['error']}\n{getattr(got['error'], 'trace', '')}")
    for rank, out in enumerate(got["grad_scaler_dtensor"]):
        assert out["type"] is None and out["healthy"], (rank, out)  # before: DTensor's 'got mixed ...'
        assert out["exact"] == [True, True], (rank, out["exact"])
        assert out["wrapped"] == [True, True], (rank, out["wrapped"])
        # the Inf on rank 1 alone: every rank skips the second step and halves its scale
        assert out["scales"] == [2.0 ** 10, 2.0 ** 9] and out["skipped"] == 1, (rank, out)
        assert out["kept"] == [False, True], (rank, out["kept"])
        assert out["clip"], rank


def test_0d_parameters_are_replicated_under_dtensor_tp_and_train_as_torch():
    """0-d parameters beside DTensor TP: replicated (no TP dim), the same on every rank, AdamW's
    state of shape (), and the model within 1e-6 of torch's optimizers in one process (TP's split
    matrix products sum in another order)."""
    from canzona.harness.training import compare
    from tests.runtime import scalars

    got = outcomes()
    if "error" in got:
        pytest.fail(f"the spawned group failed: {got['error']}\n{getattr(got['error'], 'trace', '')}")
    want, opts = scalars.torch_reference(3, DP)
    ours = got["scalars_under_tp"]
    for rank, out in enumerate(ours):
        assert out["type"] is None and out["healthy"], (rank, out)
        assert out["tp_dims"] == {"gate": None, "logit_scale": None, "a.weight": 0, "a.bias": 0, "b.weight": 1,
                                  "b.bias": None}
        assert compare(out["params"], ours[0]["params"])["bit_identical"], rank
        assert compare(out["params"], {n: p.detach() for n, p in want.named_parameters()})["max_rel_diff"] < 1e-6
        for name, state in out["state"].items():
            assert state["step"] == 3 and state["exp_avg"].shape == state["exp_avg_sq"].shape == (), name
            assert torch.allclose(state["exp_avg"], scalars.adamw_state(opts, want, name)["exp_avg"], rtol=1e-6)


def test_a_dtensor_parameter_read_with_its_gathers_in_flight_is_pending_and_reads_the_gathered_values():
    got = outcomes()
    if "error" in got:
        pytest.fail(f"the spawned group failed: {got['error']}\n{getattr(got['error'], 'trace', '')}")
    outs = got["dtensor_read_with_gathers_in_flight"]
    for rank, out in enumerate(outs):
        assert out["type"] is None and out["healthy"], (rank, out)
        assert out["pending"], rank  # before: plain DTensors
        assert out["exact"], rank  # before: last step's values of the late rank's segments
    assert outs[0]["in flight"] and outs[1]["in flight"]  # step() returned with DP index 0's gathers in flight


def test_a_skipped_steps_collectives_are_step_collectives_skipped_at_dp2xtp2():
    """The skipped step (rank 3's loss NaN, nonfinite="skip") sends on every rank of DP 2 x TP 2
    what `step_collectives(skipped=True)` lists (the step checks, then the weights' finiteness: one
    word over DP, then TP, and nothing after); the steps around it what a regular step lists.
    Before, a skipped step's collectives were checked against the runtime at TP 1 only
    (test_runtime_habits), at TP 2 by known answers (tests/policy/test_step_collectives.py)."""
    from canzona.fsdp_collectives import WEIGHTS_CHECK
    from canzona.step_collectives import step_collectives, step_records

    got = outcomes()
    if "error" in got:
        pytest.fail(f"the spawned group failed: {got['error']}\n{getattr(got['error'], 'trace', '')}")
    for rank, out in enumerate(got["skipped_step_collectives"]):
        assert out["type"] is None and out["healthy"], (rank, out)
        assert [run["policy"] for run in out["runs"]] == ["canzona", "zero1"]
        for run in out["runs"]:
            assert run["skipped"] == 1, (rank, run["policy"])
            want = {skipped: step_records(step_collectives(run["plan"], run["spec"], run["policy"], out["dp_rank"],
                                                           out["tp_rank"], tp_mode=run["tp_mode"], skipped=skipped))
                    for skipped in (False, True)}
            assert run["log"][1] == want[True], (rank, run["policy"])
            assert run["log"][2] == want[False], (rank, run["policy"])
            assert [r[1] for r in want[True] if r[2] == WEIGHTS_CHECK] == ["dp", "tp"]


def test_a_weight_out_of_the_buffers_on_one_rank_is_refused_before_any_update():
    got = outcomes()
    if "error" in got:
        pytest.fail(f"the spawned group failed: {got['error']}\n{getattr(got['error'], 'trace', '')}")
    assert all(out["unchanged"] for out in got["unlinked_on_one_rank"])


def test_a_step_again_without_backward_or_a_batch_dropped_on_one_rank_is_refused_before_any_update():
    got = outcomes()
    if "error" in got:
        pytest.fail(f"the spawned group failed: {got['error']}\n{getattr(got['error'], 'trace', '')}")
    assert all(out["unchanged"] for out in got["stepped_again_on_one_rank"])
    assert all(out["unchanged"] for out in got["dropped_mid_step_on_one_rank"])
    assert all(out["unchanged"] for out in got["backward_without_zero_grad"])
