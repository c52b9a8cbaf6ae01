"""The habits and tools of common training stacks against the runtime (issue 17): each is right, or
one error on every rank before anything is updated; none is silently wrong.

- torch's `clip_grad_norm_` / `clip_grad_value_`, scaling or reading `.grad` between backward and
  `step()` (what HF Trainer, accelerate and GradScaler do) meet a guard, not memory a collective
  may still touch; clipping goes through `opt.clip_grad_norm_()` or `max_grad_norm=`;
- a model wrapped in DistributedDataParallel or sharded by FSDP is refused, naming the wrapper;
- torch's `get_optimizer_state_dict` / `set_optimizer_state_dict` with `dcp.save` / `dcp.load`;
- `model.zero_grad(set_to_none=False)`, `OneCycleLR` with its defaults;
- a NaN / Inf gradient never reaches the weights or the state (`nonfinite="raise"` or `"skip"`);
- a parameter replaced in the model after the optimizer was built (`load_state_dict(assign=True)`,
  an untied head) is one error, not a tensor silently never trained;
- ranks that disagree on the clip threshold.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import pytest
import torch

from canzona.errors import CanzonaError, SpecError
from canzona.harness.launch import run_ranks
from canzona.harness.training import (
    TrainSpec,
    build_model,
    compare,
    emulate,
    global_batches,
    micro_batches,
)
from tests.runtime import scalars
from tests.runtime.outcomes import outcome as _outcome
from tests.runtime.outcomes import weights

pytestmark = pytest.mark.distributed  # spawns gloo process groups

DP = 2
DEADLINE_S = 240.0
BASE = TrainSpec(steps=3, global_batch=4 * DP)


def _optimizer(model, **kwargs):
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters

    return DistributedOptimizer(list(named_parameters(model)), model.spec(), **kwargs)


def _batches(rank: int, world: int, spec: TrainSpec = BASE) -> list[torch.Tensor]:
    return [micro_batches(t, rank, world, 1)[0] for t in global_batches(spec, 256)]


def _params(model) -> dict[str, torch.Tensor]:
    return weights(model)


def _train(model, opt, batches, between=None, zero="optimizer") -> list[float]:
    """Steps of the usual loop; `between(model, opt)` runs between backward and step()."""
    norms = []
    for tokens in batches:
        (model if zero == "model" else opt).zero_grad()
        if zero == "model-false":
            model.zero_grad(set_to_none=False)
        model.loss(tokens).backward()
        if between is not None:
            norms.append(between(model, opt))
        opt.step()
    return norms


# --- jobs, run in one spawned group --------------------------------------------------------------


def touched_grad_job(rank: int, world: int, how: str) -> dict:
    """Something between backward and step() that reads or writes `.grad`: one error, nothing updated."""
    model = build_model(BASE)
    opt = _optimizer(model)
    before = _params(model)
    touch = {
        "torch clip": lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0),
        "torch clip value": lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), 0.1),
        "scale": lambda m: [p.grad.mul_(0.5) for p in m.parameters()],
        "log norm": lambda m: torch.stack([p.grad.norm() for p in m.parameters()]).norm().item(),
        "zero between": lambda m: m.zero_grad(),
        "assign between": lambda m: [setattr(p, "grad", torch.zeros_like(p)) for p in m.parameters()],
        # zero gradients, as torch leaves them; a step no backward fed is still a forgotten backward
        "opt zero between": lambda m: opt.zero_grad(set_to_none=False),
    }[how]
    out = _outcome(lambda: _train(model, opt, _batches(rank, world)[:1], lambda m, o: touch(m)))
    out["unchanged"] = compare(_params(model), before)["bit_identical"]
    return out


# a mistake of one step made on rank 1 alone (its loop took a branch its peers did not): what rank 1's
# error says; its peers' names rank 1
ONE_RANK_MISTAKES = {
    # a backward after step() with no zero_grad() since
    "stale": "backward would accumulate the gradient of ",
    # a second backward without no_sync()
    "synced twice": "gradients were synchronised twice in one step: wrap the backward of accumulation micro-batches",
    # model.zero_grad(set_to_none=False) between backward and step()
    "zeroed in place": "cannot be zeroed in place (zero_.default: model.zero_grad(set_to_none=False) within a step?)",
    # the same by `fill_(0)`, and by torch._foreach_zero_ (torch.optim's zero_grad(set_to_none=False))
    "filled with zero": "cannot be zeroed in place (fill_(0): model.zero_grad(set_to_none=False) within a step?)",
    "foreach zeroed": "cannot be zeroed in place (_foreach_zero_.default: model.zero_grad(set_to_none=False) within",
    # a gradient scaled in place between backward and step()
    "filled": "is being reduced across ranks by the optimizer: nothing may read or change .grad between backward and "
              "step() (fill_.Scalar)",
    # a p.register_hook(fn) whose fn edits `.grad` in place (after zero_grad(set_to_none=False): the guard)
    "hook edits grad": "a gradient hook edited the gradient of 'model.embed_tokens.weight' (mul_.Tensor) inside "
                       "backward before autograd accumulated into it",
    # a post-accumulate-grad hook registered after the optimizer adding into `.grad`
    "hook adds after": "a gradient hook used the gradient of 'model.embed_tokens.weight' (add_.Tensor) after the "
                       "optimizer took it into its buffers",
    # a parameter reached by two re-entrant activation-checkpoint segments
    "reentrant checkpoint": "the gradient of 'model.embed_tokens.weight' was reached twice in one backward",
}


# what a loop may call after a refused step before its next backward (each recovers)
RECOVERIES = {"opt.zero_grad()": lambda model, opt: opt.zero_grad(),
              "model.zero_grad()": lambda model, opt: model.zero_grad(),
              "model.zero_grad(set_to_none=False)": lambda model, opt: model.zero_grad(set_to_none=False)}


def _edits_grad(weight: torch.Tensor):
    def hook(grad: torch.Tensor) -> None:  # returns None: the gradient autograd accumulates is unchanged
        weight.grad.mul_(0.5)
    return hook


def _adds_into_grad(weight: torch.Tensor) -> None:
    weight.grad.add_(1.0)


def _scales_grad(weight: torch.Tensor) -> None:
    weight.grad.mul_(2.0)


def _two_reentrant_segments(weight: torch.Tensor) -> torch.Tensor:
    """Two re-entrant activation-checkpoint segments that both use `weight` (each runs a backward of
    its own, which accumulates into `weight.grad`)."""
    from torch.utils.checkpoint import checkpoint

    t = torch.ones((), requires_grad=True)
    segment = lambda t: t * weight.float().square().mean()  # noqa: E731
    return checkpoint(segment, t, use_reentrant=True) + checkpoint(segment, t, use_reentrant=True)


def one_rank_mistake_job(rank: int, world: int, how: str) -> dict:
    """After a sound step on both ranks, rank 1 alone makes `how`'s mistake in the next: step()'s
    check fails on every rank, nothing updated, rank 1 naming its mistake; then opt.zero_grad() and
    a sound step go on alike on both. The same mistake twice more, each followed by a recovery of
    RECOVERIES' and a sound step (`again`); the weights against a reference that trained the sound
    steps alone (`reference`)."""
    model = build_model(BASE)
    opt = _optimizer(model)
    batches = _batches(rank, world)
    _train(model, opt, batches[:1])
    before = _params(model)
    mistaken = rank == 1

    def step() -> None:
        if not (mistaken and how == "stale"):
            opt.zero_grad(set_to_none=not (mistaken and how == "hook edits grad"))
        weight = next(model.parameters())
        handles = [] if not mistaken else \
            [weight.register_hook(_edits_grad(weight))] if how == "hook edits grad" else \
            [weight.register_post_accumulate_grad_hook(_adds_into_grad)] if how == "hook adds after" else []
        loss = model.loss(batches[1])
        if mistaken and how == "reentrant checkpoint":
            loss = loss + 0 * _two_reentrant_segments(weight)
        try:
            loss.backward()
        finally:
            for handle in handles:
                handle.remove()
        if mistaken and how == "synced twice":
            model.loss(batches[1]).backward()
        if mistaken and how == "zeroed in place":
            model.zero_grad(set_to_none=False)
        if mistaken and how in ("filled with zero", "filled"):
            next(model.parameters()).grad.fill_(0.0 if how == "filled with zero" else 1.0)
        if mistaken and how == "foreach zeroed":
            torch._foreach_zero_([p.grad for p in model.parameters()])
        opt.step()

    out = _outcome(step)
    out["unchanged"] = compare(_params(model), before)["bit_identical"]
    out["then"] = _outcome(lambda: _train(model, opt, batches[2:3]))
    out["again"] = {}
    for k, (name, recover) in enumerate(RECOVERIES.items()):
        refused = _outcome(step)

        def recovered(recover=recover, tokens=batches[k]) -> None:
            recover(model, opt)
            model.loss(tokens).backward()
            opt.step()

        out["again"][name] = (refused.get("message"), _outcome(recovered))
    out["params"] = _params(model)
    reference = build_model(BASE)
    _train(reference, _optimizer(reference), [batches[0], batches[2], *batches[:len(RECOVERIES)]])
    out["reference"] = compare(out["params"], _params(reference))["bit_identical"]
    return out


def kept_refusal_job(rank: int, world: int, zero: str) -> dict:
    """A step refused without being broken (rank 1's learning rate doubled: kept for a retry), the lr
    put back, then `zero` (model.zero_grad() on both ranks, either setting, or on rank 0 alone) and a
    backward of the next batch and step(): on both ranks, that step trains as a run that skipped the
    refused batch (`reference`, bit for bit), or, zeroed on rank 0 alone, is one error on both ranks,
    nothing updated, and opt.zero_grad() and a sound step go on. "mixed": opt.zero_grad() on rank 0,
    model.zero_grad() on rank 1: both end the refused step alike. "twice": model.zero_grad(set_to_none=False)
    then opt.zero_grad() on rank 0, opt.zero_grad() on rank 1: a second zeroing after the first ended
    the kept step leaves it ended (every rank reduces at the check alike)."""
    model = build_model(BASE)
    opt = _optimizer(model)
    batches = _batches(rank, world)
    _train(model, opt, batches[:1])
    opt.zero_grad()
    model.loss(batches[1]).backward()
    lr = opt.param_groups[0]["lr"]
    if rank == 1:
        opt.param_groups[0]["lr"] = 2 * lr
    out = {"refused": _outcome(opt.step)}
    opt.param_groups[0]["lr"] = lr
    if zero == "mixed" and rank == 0:
        opt.zero_grad()
    elif zero == "twice":
        if rank == 0:
            model.zero_grad(set_to_none=False)
        opt.zero_grad()
    elif zero == "part":  # one submodule's gradients dropped, the rest kept: refused on both ranks
        model.lm_head.zero_grad()
    elif zero != "rank 0" or rank == 0:
        model.zero_grad(set_to_none=zero != "model-false")
    before = _params(model)
    model.loss(batches[2]).backward()
    out["next"] = _outcome(opt.step)
    out["unchanged"] = compare(_params(model), before)["bit_identical"]
    sound = [batches[0], batches[2]]
    if zero in ("rank 0", "part"):
        out["then"] = _outcome(lambda: _train(model, opt, batches[1:2]))
        sound = [batches[0], batches[1]]
    reference = build_model(BASE)
    _train(reference, _optimizer(reference), sound)
    out["reference"] = compare(_params(model), _params(reference))["bit_identical"]
    return out


def clip_job(rank: int, world: int, how: str) -> dict:
    spec = replace(BASE, clip_norm=0.05)
    model = build_model(spec)
    if how == "max_grad_norm":
        opt = _optimizer(model, max_grad_norm=0.05)
        norms = _train(model, opt, _batches(rank, world, spec))
    elif how == "explicit":
        opt = _optimizer(model)
        norms = _train(model, opt, _batches(rank, world, spec), lambda m, o: float(o.clip_grad_norm_(0.05)))
    elif how == "twice":  # as torch's: the second call sees (and returns) the clipped norm
        opt = _optimizer(model)
        norms = _train(model, opt, _batches(rank, world, spec),
                       lambda m, o: [float(o.clip_grad_norm_(0.05)), float(o.clip_grad_norm_(0.05))])
    else:  # measure only: inf
        opt = _optimizer(model)
        norms = _train(model, opt, _batches(rank, world, spec), lambda m, o: float(o.clip_grad_norm_(math.inf)))
    return {"params": _params(model), "norms": norms}


def zero_grad_habit_job(rank: int, world: int, zero: str) -> dict:
    model = build_model(BASE)
    opt = _optimizer(model)
    _train(model, opt, _batches(rank, world), zero=zero)
    return _params(model)


def dropped_micro_batch_job(rank: int, world: int, drop: bool) -> dict:
    """Accumulate micro-batch A under no_sync(), then (drop) model.zero_grad(), then B: torch drops A."""
    model = build_model(BASE)
    opt = _optimizer(model)
    a, b = _batches(rank, world)[:2]
    opt.zero_grad()
    if drop:
        with opt.no_sync():
            model.loss(a).backward()
        model.zero_grad(set_to_none=rank == 0)  # either way: the accumulated gradient is gone
    model.loss(b).backward()
    opt.step()
    return _params(model)


def one_cycle_job(rank: int, world: int) -> dict:
    model = build_model(BASE)
    opt = _optimizer(model, matrix_config={"lr": 0.02})
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.02, 0.003], total_steps=BASE.steps)
    seen = [[(g["kind"], g["lr"], g["momentum"], opt._configs.config(i, g)) for i, g in enumerate(opt.param_groups)]]
    for tokens in _batches(rank, world):
        opt.zero_grad()
        model.loss(tokens).backward()
        opt.step()
        sched.step()
        seen.append([(g["kind"], g["lr"], g["momentum"], opt._configs.config(i, g))
                     for i, g in enumerate(opt.param_groups)])
    return {"seen": [[(k, lr, m, getattr(c, "betas", None), getattr(c, "momentum", None)) for k, lr, m, c in s]
                     for s in seen], "finite": all(torch.isfinite(p).all() for p in model.parameters())}


def ddp_after_job(rank: int, world: int) -> dict:
    """The habit: build the optimizer, then wrap the model in DDP as always."""
    model = build_model(BASE)
    opt = _optimizer(model)
    before = _params(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model)

    def train() -> None:
        tokens = _batches(rank, world)[0]
        opt.zero_grad()
        logits = ddp(tokens[:, :-1])  # through DDP's forward, which arms its reducer
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
    out = _outcome(train)
    out["unchanged"] = compare(_params(model), before)["bit_identical"]
    return out


def ddp_before_job(rank: int, world: int) -> dict:
    from canzona.spec import ModelSpec

    ddp = torch.nn.parallel.DistributedDataParallel(build_model(BASE))
    return _outcome(lambda: ModelSpec.from_module(ddp))


def fsdp2_job(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters
    from canzona.spec import ModelSpec

    model = build_model(BASE)
    spec = model.spec()
    before = ModelSpec.from_module(model)
    fully_shard(model)
    # the sharded model's spec is the unsharded one's (global shapes; FSDP's Shard(0) is not TP)
    return _outcome(lambda: (type(DistributedOptimizer(list(named_parameters(model)), spec)).__name__,
                             ModelSpec.from_module(model) == before))


def fsdp1_job(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel

    from canzona.runtime import DistributedOptimizer
    from canzona.spec import ModelSpec

    model = build_model(BASE)
    spec = model.spec()
    fsdp = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    return {"from_module": _outcome(lambda: ModelSpec.from_module(fsdp)),
            "optimizer": _outcome(lambda: DistributedOptimizer(list(fsdp.named_parameters()), spec))}


def nonfinite_job(rank: int, world: int, policy: str, what: float, weight: bool = False) -> dict:
    """Rank 1's loss is NaN / Inf at the second step; with `weight`, rank 1's copy of one weight is,
    before that step's forward (the loss is rank 1's only; the other ranks' weights are finite)."""
    model = build_model(BASE)
    opt = _optimizer(model, nonfinite=policy)
    batches = _batches(rank, world)
    _train(model, opt, batches[:1])
    if weight and rank == 1:
        with torch.no_grad():
            model.get_parameter(NAN_WEIGHT)[0, 0] = what
    before, state = _params(model), opt.state_dict()
    records = opt.comm.log.records
    logs = [[r for r in records if r.step == 0]]  # each step's records alone (not the state dicts')
    start = len(records)
    opt.zero_grad()
    loss = model.loss(batches[1])
    (loss * what if rank == 1 and not weight else loss).backward()
    out = _outcome(opt.step)
    logs.append(records[start:])
    # NaN weights equal to themselves
    out["unchanged"] = _nested_equal(_params(model), before) if weight else \
        compare(_params(model), before)["bit_identical"]
    out["state unchanged"] = _nested_equal(opt.state_dict(), state)
    out["skipped"] = opt.skipped_steps
    if out["error"] is None:  # skipped: training goes on
        start = len(records)
        _train(model, opt, batches[2:3])
        logs.append(records[start:])
        out["finite after"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        # what each step sent (the second skipped), for `step_collectives(skipped=...)`
        out["log"] = [[(r.op, r.group, r.name, tuple(r.bytes_per_rank)) for r in log] for log in logs]
        out["plan"], out["policy"] = opt.plan, opt.policy.name
    return out


def grad_scaler_job(rank: int, world: int, how: str, wrap: str | None = None, then: str = "given") -> dict:
    """torch.amp.GradScaler's loop (`scale(loss).backward()`, `unscale_`, clip, `step`, `update`),
    scale 2**10: scaling a loss by a power of two scales every gradient exactly, so the weights
    are the unscaled run's bit for bit. `how`: `unscale` (unscale_, then opt.clip_grad_norm_),
    `step` (scaler.step only, clipped by max_grad_norm: the scaler hands its scale to step()),
    `inf` (rank 1's loss is Inf at the second step: skipped on every rank, the scale halved; `step
    inf`: the same through scaler.step alone, whose step() skips it),
    `fp16` (an fp16 model, fp32 masters: scaler.step only; unscale_ is torch's refusal). `wrap`: the
    scaler is handed that wrapper of the optimizer (tests/runtime/amp_wrappers.py), not the optimizer;
    `then="optimizer"`: `scaler.step` is handed the optimizer itself (accelerate's step after
    `scaler.unscale_(accelerated_opt)`); `error`: a CanzonaError that ended the loop."""
    from tests.runtime.amp_wrappers import WRAPPERS

    spec = replace(BASE, clip_norm=0.05)
    model = build_model(replace(spec, dtype="fp16") if how == "fp16" else spec)
    opt = _optimizer(model, max_grad_norm=0.05 if how in ("step", "step inf", "fp16") else None)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1 if how == "unscale" else 2000)
    given = opt if wrap is None else WRAPPERS[wrap](opt)
    out: dict = {"scales": [], "norms": [], "changed": []}
    out["error"] = None
    for i, tokens in enumerate(_batches(rank, world, spec)):
        before = _params(model)
        opt.zero_grad()
        loss = model.loss(tokens)
        scaler.scale(loss * math.inf if how.endswith("inf") and i == 1 and rank == 1 else loss).backward()
        try:
            if how in ("unscale", "inf"):
                scaler.unscale_(given)
                out["norms"].append(float(opt.clip_grad_norm_(0.05)))
            scaler.step(opt if then == "optimizer" else given)
        except CanzonaError as e:
            out["error"] = str(e)
            break
        scaler.update()
        out["scales"].append(scaler.get_scale())
        out["changed"].append(not compare(_params(model), before)["bit_identical"])
    out["params"] = _params(model)
    out["finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    out["skipped"] = opt.skipped_steps
    return out


def compiled_job(rank: int, world: int, overlap: bool) -> dict:
    """`torch.compile(model, fullgraph=True)` (dynamo's tracing, eager kernels) built after the
    optimizer, trained through its forward with an evaluation forward under `no_grad` after each
    step; without overlap_param_gather, the weights and losses against the same loop uncompiled."""
    def run(compiled: bool) -> dict:
        model = build_model(BASE)
        opt = _optimizer(model, overlap_param_gather=overlap)
        forward = torch.compile(model, backend="eager", fullgraph=True) if compiled else model

        def loss(tokens: torch.Tensor) -> torch.Tensor:
            logits = forward(tokens[:, :-1])
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        evals: list[float] = []

        def train() -> None:
            for tokens in _batches(rank, world)[:2]:
                opt.zero_grad()
                loss(tokens).backward()
                opt.step()
                with torch.no_grad():
                    evals.append(float(loss(tokens)))
        return {**_outcome(train), "params": _params(model), "evals": evals}
    compiled = run(True)
    if overlap:  # refused
        return compiled
    eager = run(False)
    return {**compiled, "exact": compare(compiled["params"], eager["params"])["bit_identical"]
            and compiled["evals"] == eager["evals"]}


def retried_step_job(rank: int, world: int, overlap_step: bool, clip: float | None = None) -> dict:
    """A step refused by its check (rank 1 doubled its learning rate), the learning rate put back,
    `step()` called again on the same gradients: the step of those gradients, as if the first call
    had not happened (the error said nothing was updated). `clip`: every rank clips with
    `clip_grad_norm_(clip)` after backward, and rank 1 edits its learning rate after that clip
    (whose check step() reuses), before step()."""
    batches = _batches(rank, world)
    between = None if clip is None else (lambda m, o: float(o.clip_grad_norm_(clip)))
    straight = build_model(BASE)
    _train(straight, _optimizer(straight, overlap_step=overlap_step), batches[:2], between)
    model = build_model(BASE)
    opt = _optimizer(model, overlap_step=overlap_step)
    _train(model, opt, batches[:1], between)
    opt.zero_grad()
    model.loss(batches[1]).backward()
    if clip is not None:
        opt.clip_grad_norm_(clip)
    before = _params(model)
    lr = opt.param_groups[0]["lr"]
    opt.param_groups[0]["lr"] = lr * (2 if rank == 1 else 1)
    refused = _outcome(opt.step)
    refused["unchanged"] = compare(_params(model), before)["bit_identical"]
    opt.param_groups[0]["lr"] = lr
    retried = _outcome(opt.step)
    return {"refused": refused, "retried": retried,
            "exact": compare(_params(model), _params(straight))["bit_identical"]}


def unseen_checkpoint_job(rank: int, world: int, path: str) -> dict:
    """A plain `dcp.save` of `sharded_state_dict()` (no manifest) that rank 1 cannot see (node-local
    disks, a path that differs by rank): one error on every rank, at once, nothing loaded."""
    import time

    import torch.distributed.checkpoint as dcp

    model = build_model(BASE)
    opt = _optimizer(model)
    _train(model, opt, _batches(rank, world)[:1])
    dcp.save(opt.sharded_state_dict(), checkpoint_id=f"{path}-unseen")
    before = opt.state_dict()
    start = time.monotonic()
    out = _outcome(lambda: opt.load_sharded_state_dict(f"{path}-unseen" if rank == 0 else f"{path}-elsewhere"))
    out["seconds"] = time.monotonic() - start
    out["state unchanged"] = _nested_equal(opt.state_dict(), before)
    return out


def two_saves_sharded_job(rank: int, world: int, path: str) -> dict:
    """`load_sharded_state_dict` of folders of two saves, rank r given step r + 1's (a path that
    differs by rank): with manifests (`save_checkpoint`) and without (a plain `dcp.save`), and
    `verify_checkpoint` of them. One error on every rank, nothing loaded."""
    from functools import partial

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from canzona.runtime.checkpoint_files import save_checkpoint, verify_checkpoint

    model = build_model(BASE)
    opt = _optimizer(model)
    for step in (1, 2):
        _train(model, opt, _batches(rank, world)[step - 1:step])
        save_checkpoint(opt.sharded_state_dict(), f"{path}-two/step_{step}")
        dcp.save(opt.sharded_state_dict(), checkpoint_id=f"{path}-two/plain_{step}")
    out = {}
    for kind in ("step", "plain"):
        fresh = _optimizer(build_model(BASE))
        before = fresh.state_dict()
        out[kind] = _outcome(partial(fresh.load_sharded_state_dict, f"{path}-two/{kind}_{rank + 1}"))
        out[kind]["unchanged"] = _nested_equal(fresh.state_dict(), before)
    out["verify"] = _outcome(lambda: verify_checkpoint(f"{path}-two/step_{rank + 1}", process_group=dist.group.WORLD)
                             and None)
    return out


class _Branchy(torch.nn.Module):
    """A branch that some steps leave unused (its parameters get no gradient there)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.branch, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 8)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h + torch.tanh(self.branch(h)) if use else h)


BRANCH_USED = (True, False, False, True)  # per step: whether the branch runs


def _branchy_adamw() -> tuple:
    """A `_Branchy` model and a one-process AdamW DistributedOptimizer over it."""
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters
    from canzona.spec import ModelSpec

    model = _Branchy()
    return model, DistributedOptimizer(list(named_parameters(model)), ModelSpec.from_module(model), "adamw")


def _branchy_loss(model, k: int) -> torch.Tensor:
    """Batch `k`'s loss, the branch used."""
    g = torch.Generator().manual_seed(k)
    return torch.nn.functional.mse_loss(model(torch.randn(4, 16, generator=g), True), torch.randn(4, 8, generator=g))


def _assert_trained_as_the_run_that_skipped_batch_1(model, reference, ropt) -> None:
    """`reference` steps the sound batches 0 and 2 (batch 1 skipped, as a refused then dropped step
    leaves it); `model` must hold those weights bit for bit."""
    _sound_step(reference, ropt, 0)
    _sound_step(reference, ropt, 2)
    assert compare(_params(model), _params(reference))["bit_identical"]


def _sound_step(model, opt, k: int) -> None:
    opt.zero_grad()
    _branchy_loss(model, k).backward()
    opt.step()


def _branchy_steps(model, opt, zero, rank: int, world: int) -> None:
    """Steps zeroing with `zero(model, opt)`; each rank's share of one global batch per step."""
    for step, use in enumerate(BRANCH_USED):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
        share = slice(rank * 8 // world, (rank + 1) * 8 // world)
        zero(model, opt)
        torch.nn.functional.mse_loss(model(x[share], use), y[share]).backward()
        opt.step()


BRANCHY_ZEROS = {
    "opt set_to_none=False": lambda m, o: o.zero_grad(set_to_none=False),
    "model set_to_none=False": lambda m, o: m.zero_grad(set_to_none=False),
    "opt": lambda m, o: o.zero_grad(),
}


def branchy_zero_job(rank: int, world: int, zero: str) -> dict:
    """An unused branch after zero_grad(set_to_none=False): torch keeps its zero gradient and steps
    it (momentum, weight decay); after set_to_none it skips it."""
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters
    from canzona.spec import ModelSpec

    model = _Branchy()
    opt = DistributedOptimizer(list(named_parameters(model)), ModelSpec.from_module(model), "adamw",
                               adamw_config={"weight_decay": 0.1})
    _branchy_steps(model, opt, BRANCHY_ZEROS[zero], rank, world)
    return _params(model)


def branchy_clip_value_job(rank: int, world: int) -> dict:
    """`_branchy_steps` (opt.zero_grad()) with opt.clip_grad_value_(0.02) between backward and step."""
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters
    from canzona.spec import ModelSpec

    model = _Branchy()
    opt = DistributedOptimizer(list(named_parameters(model)), ModelSpec.from_module(model), "adamw",
                               adamw_config={"weight_decay": 0.1})
    clip = opt.clip_grad_value_
    _branchy_steps(model, _Clipping(opt, lambda: clip(0.02)), lambda m, o: o.zero_grad(), rank, world)
    return _params(model)


class _Clipping:
    """An optimizer whose step() runs `clip` first (between backward and the step)."""

    def __init__(self, opt, clip) -> None:
        self.opt, self.clip = opt, clip

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def step(self) -> None:
        self.clip()
        self.opt.step()


def branchy_clip_value_reference(world: int) -> dict:
    """torch's loop for `branchy_clip_value_job`: each rank's share's gradient averaged as DDP does,
    torch.nn.utils.clip_grad_value_(0.02), torch.optim.AdamW."""
    model = _Branchy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    for step, use in enumerate(BRANCH_USED):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
        shares = []
        for rank in range(world):
            share = slice(rank * 8 // world, (rank + 1) * 8 // world)
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x[share], use), y[share]).backward()
            shares.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        for p, grads in zip(model.parameters(), zip(*shares)):
            p.grad = None if grads[0] is None else sum(grads) / world
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.02)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def zeroed_taken_as_zero_job(rank: int, world: int) -> dict:
    """zero_grad(set_to_none=False), a backward that leaves the branch unused, clip_grad_norm_()
    (which takes the branch's gradient to the reduction as zero), then a no_sync() backward that
    reaches the branch and nothing the first reached, then step(); then opt.zero_grad() and a sound
    step."""
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters
    from canzona.spec import ModelSpec

    model = _Branchy()
    opt = DistributedOptimizer(list(named_parameters(model)), ModelSpec.from_module(model))
    g = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)

    def loss(use: bool) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(x, use), y)

    opt.zero_grad()
    loss(True).backward()
    opt.step()
    before = _params(model)

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        loss(False).backward()
        opt.clip_grad_norm_(1e9)
        with opt.no_sync():  # a backward reaching the branch alone (an auxiliary loss on it)
            model.branch(torch.tanh(model.a(x)).detach()).square().mean().backward()
        opt.step()

    out = _outcome(step)
    out["unchanged"] = compare(_params(model), before)["bit_identical"]
    out["then"] = _outcome(lambda: (opt.zero_grad(), loss(True).backward(), opt.step()) and None)
    return out


def branchy_torch_reference(zero: str) -> dict:
    model = _Branchy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    _branchy_steps(model, opt, BRANCHY_ZEROS[zero], 0, 1)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def scalars_job(rank: int, world: int, path: str) -> dict:
    """A model with 0-d parameters (`tests.runtime.scalars`): three steps, its full state, then one
    more step straight on and from its full and its sharded checkpoint."""
    import torch.distributed.checkpoint as dcp

    def train(model, opt, steps) -> list[float]:
        norms = []
        for step in steps:
            opt.zero_grad()
            scalars.backward(model, step, rank, world)
            norms.append(float(opt.clip_grad_norm_(math.inf)))  # by inf: it only measures
            opt.step()
        return norms

    model = scalars.Scaled()
    opt = scalars.canzona_optimizer(model)
    norms = train(model, opt, range(3))
    out = {"three": _params(model), "full": opt.state_dict(), "norms": norms}
    dcp.save(opt.sharded_state_dict(), checkpoint_id=f"{path}-scalars")
    for form in ("full", "sharded"):
        resumed = scalars.Scaled()
        resumed.load_state_dict(model.state_dict())
        again = scalars.canzona_optimizer(resumed)
        if form == "full":
            again.load_state_dict(out["full"])
        else:
            again.load_sharded_state_dict(f"{path}-scalars")
        train(resumed, again, [3])
        out[f"resumed {form}"] = _params(resumed)
    train(model, opt, [3])
    out["four"] = _params(model)
    return out


def second_optimizer_job(rank: int, world: int) -> dict:
    """A new optimizer on the same model after a step (phase two of training, a notebook cell run
    again): refused while the first is alive, whose backward hooks and in-flight parameter gathers
    still write into its buffers; built once the first is dropped (`del`, no gc.collect()), training
    on from the first's weights exactly."""
    import gc

    def phase_two(wait: bool, drop: bool) -> dict:
        model = build_model(BASE)
        first = _optimizer(model)
        _train(model, first, _batches(rank, world)[:1])
        if wait:
            first.wait_params()
        out = {}
        if not drop:
            out["kept"] = _outcome(lambda: _optimizer(model, optimizer="adamw"))
            return out
        del first
        second = _optimizer(model, optimizer="adamw")
        _train(model, second, _batches(rank, world)[1:])
        return {"params": _params(model)}

    kept = phase_two(wait=False, drop=False)
    dropped = phase_two(wait=False, drop=True)
    gc.collect()
    waited = phase_two(wait=True, drop=True)
    return {"kept": kept["kept"], "exact": compare(dropped["params"], waited["params"])["bit_identical"]}


CLIP_DISAGREEMENTS = {  # per case: what rank 0 and the others call between backward and step()
    "norm": (lambda o: o.clip_grad_norm_(1.0), lambda o: o.clip_grad_norm_(0.5)),
    "value": (lambda o: o.clip_grad_value_(0.01), lambda o: o.clip_grad_value_(0.02)),
    "value inf": (lambda o: o.clip_grad_value_(math.inf), lambda o: o.clip_grad_value_(0.01)),
    "value bad": (lambda o: o.clip_grad_value_(-1.0), lambda o: o.clip_grad_value_(0.01)),
    "norm nan": (lambda o: o.clip_grad_norm_(math.nan), lambda o: o.clip_grad_norm_(1.0)),
    "norm or value": (lambda o: o.clip_grad_norm_(0.01), lambda o: o.clip_grad_value_(0.01)),
    # a bad norm_type on one rank alone: before, SpecError there alone while the others waited in the check
    "norm type bad": (lambda o: o.clip_grad_norm_(1.0, norm_type=1.0), lambda o: o.clip_grad_norm_(1.0)),
}


def clip_disagreement_job(rank: int, world: int, how: str = "norm") -> dict:
    model = build_model(BASE)
    opt = _optimizer(model)
    before = _params(model)
    clip = CLIP_DISAGREEMENTS[how][0 if rank == 0 else 1]
    out = _outcome(lambda: _train(model, opt, _batches(rank, world)[:1], lambda m, o: clip(o)))
    out["unchanged"] = compare(_params(model), before)["bit_identical"]
    return out


def max_grad_norm_disagreement_job(rank: int, world: int) -> dict:
    return _outcome(lambda: _optimizer(build_model(BASE), max_grad_norm=1.0 + rank))


def add_param_group_job(rank: int, world: int) -> dict:
    opt = _optimizer(build_model(BASE))
    return _outcome(lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]}))


def replaced_parameter_job(rank: int, world: int, how: str) -> dict:
    """A parameter replaced in the model after the optimizer was built: the model would train a
    tensor no hook sees and the optimizer step one the model no longer uses."""
    model = build_model(BASE)  # tied embeddings: lm_head.weight is model.embed_tokens.weight
    opt = _optimizer(model)
    if how == "assign one":  # load one weight with assign=True (a new Parameter in its place)
        name = "model.layers.0.mlp.up_proj.weight"
        model.load_state_dict({name: model.get_parameter(name).detach() * 0.5}, strict=False, assign=True)
    elif how == "assign all":
        model.load_state_dict({n: t.clone() for n, t in model.state_dict().items()}, assign=True)
    else:  # untie the head: a new Parameter of its own
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    before = _params(model)
    out = _outcome(lambda: _train(model, opt, _batches(rank, world)[:1]))
    out["unchanged"] = compare(_params(model), before)["bit_identical"]
    return out


def numpy_lr_job(rank: int, world: int) -> dict:
    """Learning rates as NumPy scalars (a schedule computed with NumPy), as torch's optimizers take
    them: the step of the same Python numbers, bit for bit."""
    import numpy as np

    def run(numpy: bool) -> dict:
        model = build_model(BASE)
        opt = _optimizer(model)
        for group in opt.param_groups:
            lr = np.float32(group["lr"] / 2)
            group["lr"] = lr if numpy else lr.item()
        out = _outcome(lambda: _train(model, opt, _batches(rank, world)[:2]))
        return {**out, "params": _params(model)}

    return {numpy: run(numpy) for numpy in (True, False)}


def dcp_job(rank: int, world: int, path: str) -> dict:
    """torch's state-dict API: save after 2 steps, load into a fresh model and optimizer, one more
    step; against three steps straight through. Also: taking the state dict changes nothing."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    batches = _batches(rank, world)
    model = build_model(BASE)
    opt = _optimizer(model)
    _train(model, opt, batches[:2])
    before = opt.state_dict()
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=path)
    untouched = _nested_equal(opt.state_dict(), before)
    # without torch's helpers: the optimizer's own state dict, int keys and Python scalars as it has them
    dcp.save({"model": model.state_dict(), "optim": before}, checkpoint_id=f"{path}-plain")
    _train(model, opt, batches[2:])

    resumed = build_model(replace(BASE, model_seed=7))  # other weights until the checkpoint loads
    opt2 = _optimizer(resumed)
    fresh = get_optimizer_state_dict(resumed, opt2)
    template = (len(fresh["state"]), any(s["canzona_stepped"] for s in fresh["state"].values()))
    state = {"model": get_model_state_dict(resumed), "optim": fresh}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(resumed, state["model"])
    set_optimizer_state_dict(resumed, opt2, state["optim"])
    _train(resumed, opt2, batches[2:])

    plain = build_model(replace(BASE, model_seed=7))
    opt3 = _optimizer(plain)
    state = {"model": plain.state_dict(), "optim": opt3.state_dict()}
    dcp.load(state, checkpoint_id=f"{path}-plain")
    plain.load_state_dict(state["model"])
    opt3.load_state_dict(state["optim"])
    loaded = _nested_equal(opt3.state_dict(), before)
    _train(plain, opt3, batches[2:])
    return {"straight": _params(model), "resumed": _params(resumed), "untouched": untouched,
            "template entries": template[0], "template stepped": template[1],
            "plain loaded": loaded, "plain resumed": _params(plain)}


class _TorchtitanOptimizers:
    """torchtitan's `OptimizersContainer` (torchtitan/components/optimizer.py), a Stateful its
    checkpointer hands to dcp: `state_dict()` is `get_optimizer_state_dict` per model part with
    `flatten_optimizer_state_dict=True`, merged; `load_state_dict` gives the merged dict to
    `set_optimizer_state_dict` of each part with the same option."""

    def __init__(self, model, opt) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        self.parts, self.options = [(model, opt)], StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return {k: v for m, o in self.parts for k, v in get_optimizer_state_dict(m, o, options=self.options).items()}

    def load_state_dict(self, state_dict: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        for m, o in self.parts:
            set_optimizer_state_dict(m, o, optim_state_dict=state_dict, options=self.options)


def flat_dcp_job(rank: int, world: int, path: str) -> dict:
    """torchtitan's checkpoint of the optimizer (`_TorchtitanOptimizers`: flattened state dicts,
    keyed `state.<name>.<field>` and `param_groups.<name>.<key>`) through dcp, against three steps
    straight through; the flattened and nested forms given to the other's call; the flattened
    state beside other weights (the witness survives the flattening)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    batches = _batches(rank, world)
    model = build_model(BASE)
    opt = _optimizer(model)
    _train(model, opt, batches[:2])
    before = opt.state_dict()
    # torchtitan's CheckpointManager: the container is a Stateful that dcp calls itself
    out = {"saved": _outcome(lambda: bool(dcp.save({"model": get_model_state_dict(model),
                                                     "optimizer": _TorchtitanOptimizers(model, opt)},
                                                    checkpoint_id=f"{path}-flat")))}
    out["untouched"] = _nested_equal(opt.state_dict(), before)
    flat_sd = _outcome(lambda: get_optimizer_state_dict(model, opt, options=flat))
    nested_sd = get_optimizer_state_dict(model, opt)
    _train(model, opt, batches[2:])
    out["straight"] = _params(model)

    def resume() -> dict:
        resumed = build_model(replace(BASE, model_seed=7))
        opt2 = _optimizer(resumed)
        state = {"model": get_model_state_dict(resumed), "optimizer": _TorchtitanOptimizers(resumed, opt2)}
        dcp.load(state, checkpoint_id=f"{path}-flat")  # loads the optimizer first, then the model here
        set_model_state_dict(resumed, state["model"])
        loaded = _nested_equal(opt2.state_dict(), before)
        _train(resumed, opt2, batches[2:])
        return {"loaded": loaded, "params": _params(resumed)}

    out["resumed"] = _outcome(resume)

    def crossed(state: dict, options) -> bool:
        other = build_model(replace(BASE, model_seed=7))
        opt3 = _optimizer(other)
        set_optimizer_state_dict(other, opt3, state, options=options)
        return _nested_equal(opt3.state_dict(), before)

    out["flat without the option"] = _outcome(lambda: crossed(flat_sd["value"], None))
    out["nested with the option"] = _outcome(lambda: crossed(nested_sd, flat))

    def beside_other_weights() -> None:
        other = build_model(replace(BASE, model_seed=7))
        opt3 = _optimizer(other)
        set_optimizer_state_dict(other, opt3, flat_sd["value"], options=flat)
        _train(other, opt3, batches[2:])

    out["other weights"] = _outcome(beside_other_weights)

    def one_sided_soap() -> bool:
        """SOAP keeping one-sided factors of the 64-wide matrices (a field it leaves unused)."""
        soap = {"optimizer": "soap", "matrix_config": {"precondition_frequency": 2, "max_precond_dim": 48}}
        model = build_model(BASE)
        opt = _optimizer(model, **soap)
        _train(model, opt, batches[:1])
        other = build_model(replace(BASE, model_seed=7))
        opt3 = _optimizer(other, **soap)
        set_optimizer_state_dict(other, opt3, get_optimizer_state_dict(model, opt, options=flat), options=flat)
        return _nested_equal(opt3.state_dict(), opt.state_dict())

    out["one-sided soap"] = _outcome(one_sided_soap)
    return out


def dcp_other_layout_job(rank: int, world: int, path: str) -> dict:
    """The DP 2 checkpoint of `dcp_job`, loaded at another DP size, one more step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model = build_model(replace(BASE, model_seed=7))
    opt = _optimizer(model)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    _train(model, opt, _batches(rank, world)[2:])
    return _params(model)


def torch_save_job(rank: int, world: int, path: str) -> dict:
    """`torch.save(opt.state_dict(), ...)` on every rank and `torch.load` back, as users checkpoint
    without DCP: another rank's file, `weights_only=True`, loaded twice, resumes bit for bit; files
    of two saves (rank 0 loads step 1's, rank 1 step 2's), or a file damaged on one rank, are one
    error on every rank with nothing changed; state saved in bf16 loads into the fp32 state."""
    import os

    folder = f"{path}-files"
    os.makedirs(folder, exist_ok=True)
    batches = _batches(rank, world)
    model = build_model(BASE)
    opt = _optimizer(model)
    _train(model, opt, batches[:1])
    torch.save(opt.state_dict(), f"{folder}/a{rank}.pt")
    _train(model, opt, batches[1:2])
    torch.save(opt.state_dict(), f"{folder}/b{rank}.pt")
    torch.save(model.state_dict(), f"{folder}/model{rank}.pt")
    _train(model, opt, batches[2:])

    def fresh():
        m = build_model(replace(BASE, model_seed=7))
        m.load_state_dict(torch.load(f"{folder}/model{rank}.pt", weights_only=True))
        return m, _optimizer(m)

    resumed, opt2 = fresh()
    other = torch.load(f"{folder}/b{world - 1 - rank}.pt", weights_only=True)  # the other rank's file
    opt2.load_state_dict(other)
    opt2.load_state_dict(other)
    _train(resumed, opt2, batches[2:])
    out = {"resumed exact": compare(_params(resumed), _params(model))["bit_identical"]}

    def refused(state_dict) -> dict:
        m, o = fresh()
        before = o.state_dict()
        got = _outcome(lambda: o.load_state_dict(state_dict))
        return {**got, "unchanged": _nested_equal(o.state_dict(), before)}

    out["two saves"] = refused(torch.load(f"{folder}/{'ab'[rank]}{rank}.pt", weights_only=True))
    damaged = torch.load(f"{folder}/b{rank}.pt", weights_only=True)
    if rank == 1:
        entry = damaged["state"][max(damaged["state"])]
        field = next(k for k, v in entry.items() if isinstance(v, torch.Tensor) and v.dim())
        entry[field] = entry[field].reshape(-1)[:-1]  # one element short
    out["damaged on one rank"] = refused(damaged)
    poisoned = torch.load(f"{folder}/b{rank}.pt", weights_only=True)
    if rank == 1:  # a NaN in rank 1's copy of one moment
        poisoned["state"][max(poisoned["state"])]["exp_avg"].view(-1)[3] = math.nan
    out["nan on one rank"] = refused(poisoned)
    low = torch.load(f"{folder}/b{rank}.pt", weights_only=True)
    for entry in low["state"].values():
        entry.update({k: v.bfloat16() for k, v in entry.items() if isinstance(v, torch.Tensor) and v.dim()})
    m, o = fresh()
    out["bf16 state"] = _outcome(lambda: (o.load_state_dict(low), _train(m, o, batches[2:]))[1])
    out["bf16 state dtypes"] = sorted({str(v.dtype) for e in o.state_dict()["state"].values()
                                       for v in e.values() if isinstance(v, torch.Tensor) and v.dim()})
    return out


def optimizer_hooks_job(rank: int, world: int, fsdp: bool) -> dict:
    """torch.optim.Optimizer's hooks, as libraries register them (HF's, torchtitan's), on both
    layouts: each fires once per call, given the optimizer (and the step's args, the state dict),
    and what a state-dict hook returns is what the call gives or loads, as on a torch optimizer."""
    import torch.optim.optimizer as torch_optim

    model = build_model(BASE)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        spec = model.spec()
        fully_shard(model)
        from canzona.runtime import DistributedOptimizer
        from canzona.runtime.modules import named_parameters

        opt = DistributedOptimizer(list(named_parameters(model)), spec)
    else:
        opt = _optimizer(model)
    seen: list = []

    def record(what):
        return lambda o, *rest: seen.append((what, o is opt, len(rest)))

    def tag(o, state_dict):  # a post hook's return value is the state dict
        seen.append(("state_dict post", o is opt, 1))
        return {**state_dict, "tagged": True}

    def untag(o, state_dict):  # a pre hook's return value is what loads
        seen.append(("load pre", o is opt, 1))
        return {k: v for k, v in state_dict.items() if k != "tagged"}

    handles = [opt.register_step_pre_hook(record("step pre")), opt.register_step_post_hook(record("step post")),
               torch_optim.register_optimizer_step_pre_hook(record("global step pre")),
               torch_optim.register_optimizer_step_post_hook(record("global step post")),
               opt.register_state_dict_pre_hook(record("state_dict pre")), opt.register_state_dict_post_hook(tag),
               opt.register_load_state_dict_pre_hook(untag),
               opt.register_load_state_dict_post_hook(record("load post"))]
    try:
        _train(model, opt, _batches(rank, world)[:1])
        state = opt.state_dict()
        out = _outcome(lambda: opt.load_state_dict(state))
    finally:
        for handle in handles:
            handle.remove()
    return {**out, "seen": seen, "tagged": state.get("tagged")}


FROZEN = (False, True, True, False)  # per step: whether the branch is frozen (requires_grad_(False))


def _full_params(model) -> dict[str, torch.Tensor]:
    """`_params`, an FSDP2 model's DTensors gathered whole (collective: every rank reads them)."""
    from torch.distributed.tensor import DTensor

    return {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in _params(model).items()}


def _shard(model, fsdp: bool):
    """The model's spec, taken before `fully_shard` when `fsdp` (the unsharded model's: global shapes)."""
    from canzona.spec import ModelSpec

    spec = ModelSpec.from_module(model)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    return spec


def _freezing_steps(model, opt, rank: int, world: int) -> list[bool]:
    """The branch frozen mid-training and unfrozen again; per frozen step, whether it stayed as it was."""
    kept = []
    for step, frozen in enumerate(FROZEN):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
        share = slice(rank * 8 // world, (rank + 1) * 8 // world)
        model.branch.requires_grad_(not frozen)
        before = _full_params(model)["branch.weight"]  # read after the last step's gathers landed
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[share], True), y[share]).backward()
        opt.step()
        if frozen:
            kept.append(torch.equal(_full_params(model)["branch.weight"], before))
    return kept


def frozen_job(rank: int, world: int, optimizer: str, fsdp: bool = False) -> dict:
    """A layer frozen after the optimizer was built (`requires_grad_(False)`), then unfrozen: while
    frozen it gets no gradient, and is neither stepped nor decayed, as torch's optimizers skip a
    parameter whose grad is None. `fsdp`: the model `fully_shard`ed (the FSDP step)."""
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters

    model = _Branchy()
    spec = _shard(model, fsdp)
    opt = DistributedOptimizer(list(named_parameters(model)), spec, optimizer, adamw_config={"weight_decay": 0.1})
    out = _outcome(lambda: _freezing_steps(model, opt, rank, world))
    return {**out, "layout": type(opt).__name__, "params": _full_params(model)}


def frozen_torch_reference() -> dict:
    model = _Branchy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    _freezing_steps(model, opt, 0, 1)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def frozen_on_one_rank_job(rank: int, world: int) -> dict:
    """The branch frozen on rank 0 only (a schedule of unfreezing kept per rank): the ranks would
    step it from the others' gradients alone, the frozen rank's copy too. One error on every rank
    at the first step that differs, nothing updated. (Under FSDP2 torch's own reduce-scatter in
    backward fails first, its sizes differing across the ranks, as beside torch's optimizers.)"""
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters

    model = _Branchy()
    opt = DistributedOptimizer(list(named_parameters(model)), _shard(model, False), "muon", adamw_config={"weight_decay": 0.1})
    seen = {}

    def steps() -> None:
        for step, frozen in enumerate(FROZEN):
            g = torch.Generator().manual_seed(100 + step)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
            share = slice(rank * 8 // world, (rank + 1) * 8 // world)
            if rank == 0:
                model.branch.requires_grad_(not frozen)
            seen["step"], seen["before"] = step, _full_params(model)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[share], True), y[share]).backward()
            opt.step()

    out = _outcome(steps)
    return {**out, "step": seen["step"], "unchanged": compare(_full_params(model), seen["before"])["bit_identical"]}


def frozen_reordered_job(rank: int, world: int) -> dict:
    """`frozen_job` (muon), rank 1 rotating each group's `params` after construction (accepted: a
    group's members in any order; the branch's weight and bias move from second to first) before
    freezing the branch on every rank alike."""
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters

    model = _Branchy()
    opt = DistributedOptimizer(list(named_parameters(model)), _shard(model, False), "muon", adamw_config={"weight_decay": 0.1})
    if rank == 1:
        for group in opt.param_groups:
            group["params"].append(group["params"].pop(0))
    out = _outcome(lambda: _freezing_steps(model, opt, rank, world))
    return {**out, "params": _full_params(model)}


def frozen_after_backward_job(rank: int, world: int) -> dict:
    """The branch frozen on rank 0 alone between backward and step() (it holds its gradient there,
    as on rank 1): stepped on both, as torch's optimizers step a parameter holding a gradient."""
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters

    model = _Branchy()
    opt = DistributedOptimizer(list(named_parameters(model)), _shard(model, False), "muon", adamw_config={"weight_decay": 0.1})
    stepped = []

    def steps() -> None:
        for step in range(2):
            g = torch.Generator().manual_seed(100 + step)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
            share = slice(rank * 8 // world, (rank + 1) * 8 // world)
            before = model.branch.weight.detach().clone()
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[share], True), y[share]).backward()
            if rank == 0 and step == 1:
                model.branch.requires_grad_(False)
            opt.step()
            stepped.append(not torch.equal(model.branch.weight, before))

    out = _outcome(steps)
    return {**out, "stepped": stepped, "params": _full_params(model)}


class _Lora(torch.nn.Module):
    """LoRA by hand (peft is not installed here): frozen base weights, trainable low-rank adapters
    (B zero at the start, as LoRA initialises it), frozen before the optimizer is built."""

    def __init__(self, rank: int = 4) -> None:
        super().__init__()
        self.base, self.head = torch.nn.Linear(16, 16), torch.nn.Linear(16, 8)
        self.lora_a, self.lora_b = torch.nn.Linear(16, rank, bias=False), torch.nn.Linear(rank, 16, bias=False)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            self.lora_b.weight.zero_()
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.base(x) + self.lora_b(self.lora_a(x))))


def _lora_steps(model, opt, rank: int, world: int) -> None:
    for step in range(3):
        g = torch.Generator().manual_seed(200 + step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
        share = slice(rank * 8 // world, (rank + 1) * 8 // world)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[share]), y[share]).backward()
        opt.step()


def lora_job(rank: int, world: int, optimizer: str, fsdp: bool = False) -> dict:
    """A LoRA-style model: the optimizer and spec take the trainable adapters only (`named_parameters`
    and `ModelSpec.from_module` skip frozen parameters); the base weights stay as they were.
    `fsdp`: the model `fully_shard`ed, frozen weights and adapters in one unit (the FSDP step)."""
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters

    model = _Lora()
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    spec = _shard(model, fsdp)
    opt = DistributedOptimizer(list(named_parameters(model)), spec, optimizer, adamw_config={"weight_decay": 0.1})
    out = _outcome(lambda: _lora_steps(model, opt, rank, world))
    after = _full_params(model)  # the frozen weights too: every parameter, once the step's gathers landed
    return {**out, "given": sorted(p.name for p in spec.params), "matrices": sorted(p.name for p in spec.matrix_params()),
            "base kept": all(torch.equal(after[n], t) for n, t in base.items()), "params": after,
            "layout": type(opt).__name__}


def lora_torch_reference() -> dict:
    model = _Lora()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.1)
    _lora_steps(model, opt, 0, 1)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def async_save_job(rank: int, world: int, path: str) -> dict:
    """torchtitan's async checkpointing: `dcp.async_save` of torch's helper's state dict after step 1,
    of `opt.state_dict()` after step 2 (and after step 4 written by a process of its own) and of
    `opt.sharded_state_dict()` after step 3, with a process group of its own (torchtitan's), each
    followed by a step while the background thread writes; then each loaded into a fresh optimizer.
    (One save at a time: two in flight on one group would interleave its collectives.)"""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    batches = _batches(rank, world)
    model = build_model(BASE)
    opt = _optimizer(model)
    saves = dist.new_group(backend="gloo")
    _train(model, opt, batches[:1])
    at_helper = opt.state_dict()
    pending = dcp.async_save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=f"{path}-async-helper",
                             process_group=saves)
    _train(model, opt, batches[1:2])
    pending.result()
    given, at_plain = opt.state_dict(), opt.state_dict()
    pending = dcp.async_save({"optim": given}, checkpoint_id=f"{path}-async-plain", process_group=saves)
    _train(model, opt, batches[2:3])
    pending.result()
    out = {"given kept": _nested_equal(given, at_plain)}  # no step wrote into the dict handed over
    # canzona's own sharded form holds views of the live state: DCP's staging copies it before returning
    at_sharded = opt.state_dict()
    pending = dcp.async_save(opt.sharded_state_dict(), checkpoint_id=f"{path}-async-sharded", process_group=saves)
    _train(model, opt, batches[:1])  # a fourth step (BASE has three batches)
    pending.result()
    # the write in a process of its own (AsyncCheckpointerType.PROCESS), a fifth step meanwhile
    at_process = opt.state_dict()
    pending = dcp.async_save({"optim": opt.state_dict()}, checkpoint_id=f"{path}-async-process", process_group=saves,
                             async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    _train(model, opt, batches[1:2])
    pending.result()
    out["moved on"] = not _nested_equal(opt.state_dict(), at_process)
    fresh = build_model(BASE)
    opt2 = _optimizer(fresh)
    state = {"optim": get_optimizer_state_dict(fresh, opt2)}
    dcp.load(state, checkpoint_id=f"{path}-async-helper")
    set_optimizer_state_dict(fresh, opt2, state["optim"])
    out["helper at save"] = _nested_equal(opt2.state_dict(), at_helper)

    def plain_loaded(folder: str) -> dict:  # a fresh optimizer's state dict after dcp.load of `opt.state_dict()`
        fresh = _optimizer(build_model(BASE))
        state = {"optim": fresh.state_dict()}
        dcp.load(state, checkpoint_id=folder)
        fresh.load_state_dict(state["optim"])
        return fresh.state_dict()

    out["plain at save"] = _nested_equal(plain_loaded(f"{path}-async-plain"), at_plain)
    opt4 = _optimizer(build_model(BASE))
    opt4.load_sharded_state_dict(f"{path}-async-sharded")
    out["sharded at save"] = _nested_equal(opt4.state_dict(), at_sharded)
    out["process at save"] = _nested_equal(plain_loaded(f"{path}-async-process"), at_process)
    return out


def _nested_equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_nested_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_nested_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):  # a NaN where it was (NaN weights, their witness) is unchanged
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and (torch.equal(a, b) or (
            a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)))
    return a == b


REPLACEMENTS = ("assign one", "assign all", "untied head")
TOUCHES = ("torch clip", "torch clip value", "scale", "log norm", "zero between", "assign between", "opt zero between")
JOBS = {
    **{f"touch {how}": ("touched_grad_job", (how,)) for how in TOUCHES},
    **{f"clip {how}": ("clip_job", (how,)) for how in ("max_grad_norm", "explicit", "twice", "measure")},
    **{f"zero {z}": ("zero_grad_habit_job", (z,)) for z in ("optimizer", "model", "model-false")},
    "micro-batch dropped": ("dropped_micro_batch_job", (True,)),
    "micro-batch kept": ("dropped_micro_batch_job", (False,)),
    "one cycle": ("one_cycle_job", ()),
    "ddp after": ("ddp_after_job", ()),
    "ddp before": ("ddp_before_job", ()),
    "fsdp2": ("fsdp2_job", ()),
    "fsdp1": ("fsdp1_job", ()),
    "nan raise": ("nonfinite_job", ("raise", math.nan)),
    "inf raise": ("nonfinite_job", ("raise", math.inf)),
    "nan skip": ("nonfinite_job", ("skip", math.nan)),
    "nan weight skip": ("nonfinite_job", ("skip", math.nan, True)),
    **{f"scaler {how}": ("grad_scaler_job", (how,)) for how in ("unscale", "step", "inf", "step inf", "fp16")},
    # scaler.step alone handed a wrapper forwarding every attribute (Lightning-style)
    "scaler step forwarding": ("grad_scaler_job", ("step", "forwarding")),
    # unscale_ and the clip through a user's proxy, then scaler.step handed the optimizer itself
    "scaler unscale proxy then optimizer": ("grad_scaler_job", ("unscale", "proxy", "optimizer")),
    **{f"retried {o}": ("retried_step_job", (o == "overlapped",)) for o in ("plain", "overlapped")},
    # the clip's check ran before the edit: step() must still see it (0.05 scales these gradients)
    **{f"retried {o} clipped": ("retried_step_job", (o == "overlapped", 0.05)) for o in ("plain", "overlapped")},
    **{f"clip disagreement {how}": ("clip_disagreement_job", (how,)) for how in CLIP_DISAGREEMENTS},
    "max_grad_norm disagreement": ("max_grad_norm_disagreement_job", ()),
    "add_param_group": ("add_param_group_job", ()),
    "numpy lr": ("numpy_lr_job", ()),
    **{f"frozen {o}": ("frozen_job", (o,)) for o in ("adamw", "muon")},
    **{f"lora {o}": ("lora_job", (o,)) for o in ("adamw", "muon")},
    # under FSDP2 (the matrix optimizer only: canzona refuses AdamW alone there)
    "frozen muon fsdp": ("frozen_job", ("muon", True)),
    "lora muon fsdp": ("lora_job", ("muon", True)),
    "frozen on one rank": ("frozen_on_one_rank_job", ()),
    "frozen reordered": ("frozen_reordered_job", ()),
    "frozen after backward on one rank": ("frozen_after_backward_job", ()),
    **{f"hooks {k}": ("optimizer_hooks_job", (k == "fsdp",)) for k in ("zero1", "fsdp")},
    **{f"replaced {how}": ("replaced_parameter_job", (how,)) for how in REPLACEMENTS},
    **{f"branchy {z}": ("branchy_zero_job", (z,)) for z in BRANCHY_ZEROS},
    "branchy clip value": ("branchy_clip_value_job", ()),
    "second optimizer": ("second_optimizer_job", ()),
    **{f"one rank {how}": ("one_rank_mistake_job", (how,)) for how in ONE_RANK_MISTAKES},
    "zeroed taken as zero": ("zeroed_taken_as_zero_job", ()),
    **{f"kept refusal {z}": ("kept_refusal_job", (z,)) for z in ("model", "model-false", "rank 0", "mixed", "part",
                                                                          "twice")},
    # last: compiling clears dynamo's caches and recompiles, which the jobs above need not see
    "compiled fullgraph": ("compiled_job", (True,)),
    "compiled fullgraph no overlap": ("compiled_job", (False,)),
}


def jobs_worker(rank: int, world: int, names: list[str], path: str) -> dict:
    out = {name: globals()[JOBS[name][0]](rank, world, *JOBS[name][1]) for name in names}
    out["dcp"] = dcp_job(rank, world, path)
    out["dcp flat"] = flat_dcp_job(rank, world, path)
    out["unseen checkpoint"] = unseen_checkpoint_job(rank, world, path)
    out["torch.save"] = torch_save_job(rank, world, path)
    out["two saves sharded"] = two_saves_sharded_job(rank, world, path)
    out["async save"] = async_save_job(rank, world, path)
    out["scalars"] = scalars_job(rank, world, path)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    path = str(tmp_path_factory.mktemp("dcp") / "ckpt")
    ranks = run_ranks(jobs_worker, DP, list(JOBS), path, deadline_s=DEADLINE_S, collective_timeout_s=60)
    out = {name: [ranks[r][name] for r in range(DP)] for name in [*JOBS, "dcp", "dcp flat", "unseen checkpoint", "torch.save", "two saves sharded",
                                                            "async save", "scalars"]}
    out["dcp other layout"] = run_ranks(dcp_other_layout_job, 1, path, deadline_s=DEADLINE_S)
    return out


@pytest.mark.parametrize("how", list(ONE_RANK_MISTAKES))
def test_a_mistake_on_one_rank_alone_is_one_error_on_every_rank_at_the_step_nothing_updated(runs, how):
    """A backward after step() without zero_grad(), a second backward without no_sync(), or
    model.zero_grad(set_to_none=False) between backward and step(), on rank 1 alone: rank 1 records
    it (inside backward, or at the zeroing) and issues the same collectives as rank 0; step()'s check
    then fails on both ranks, rank 1 naming the mistake and rank 0 naming rank 1 and its line, every weight
    unchanged bit for bit; opt.zero_grad() and the next step go on alike on both. Before: rank 1
    raised there, alone, and rank 0 waited in the step's collectives until the timeout."""
    mistaken, peer = runs[f"one rank {how}"][1], runs[f"one rank {how}"][0]
    assert mistaken["canzona"] and ONE_RANK_MISTAKES[how] in mistaken["message"], mistaken
    # rank 1's line on rank 0 too (before this session: '(see their error)', the reason on rank 1 only)
    assert peer["canzona"] and peer["message"] == f"rank(s) [1] found a broken step: {mistaken['message']}", peer
    for out in (mistaken, peer):
        assert "\n" not in out["message"] and out["unchanged"], out
        assert out["then"]["error"] is None, out["then"]
        # the mistake again, then each recovery a loop may use: the same refusal, then a sound step
        # (before: after model.zero_grad(), either setting, every later step repeated the refusal)
        for name, (message, recovered) in out["again"].items():
            assert message == out["message"] and recovered["error"] is None, (name, message, recovered)
        # the refused steps left nothing behind: the weights of the sound steps alone, bit for bit
        assert out["reference"], out
    assert compare(mistaken["params"], peer["params"])["bit_identical"]


def test_model_zero_grad_after_a_refused_and_kept_step_drops_it_alike_on_every_rank(runs):
    """A step refused for a learning rate set on one rank (gradients kept for a retry), the lr put
    back, then model.zero_grad() (either setting) on both ranks and the next batch's backward and
    step(): trained as a run that skipped the refused batch, bit for bit. model.zero_grad() on rank
    0 alone: one error on both ranks naming it, nothing updated (no hang), and opt.zero_grad() goes
    on. Before: refused again on both ranks ('set to None after this step's gradients went to the
    reduction' / 'cannot be zeroed in place'). opt.zero_grad() on one rank and model.zero_grad() on
    the other end it alike (before the review's fix: the first launched its reductions in backward,
    the second waited in the agreement's collective, a timeout on both); so do model.zero_grad(
    set_to_none=False) then opt.zero_grad() on rank 0 and opt.zero_grad() on rank 1 ("twice"; before:
    the second zeroing forgot that the kept step ended, the same timeout)."""
    for zero in ("model", "model-false", "mixed", "twice"):
        for rank, out in enumerate(runs[f"kept refusal {zero}"]):
            assert "param_groups[0]['lr']" in out["refused"]["message"], (zero, rank, out)
            assert out["next"]["error"] is None and out["reference"], (zero, rank, out)
    for rank, out in enumerate(runs["kept refusal rank 0"]):
        assert "ran on some ranks and not on others" in out["next"]["message"] and out["unchanged"], (rank, out)
        assert out["then"]["error"] is None and out["reference"], (rank, out)
    # lm_head.zero_grad() alone on both ranks (its weight tied to the embedding's): KEPT_NOT_DROPPED
    # naming the part dropped on both (before: SYNCED_TWICE), nothing updated, and opt.zero_grad() goes on
    for rank, out in enumerate(runs["kept refusal part"]):
        said = out["next"]["message"]
        assert "dropped in part only ('model.embed_tokens.weight'" in said and "the rest still kept (" in said, (rank, said)
        assert out["unchanged"] and out["then"]["error"] is None and out["reference"], (rank, out)


def test_a_backward_onto_a_zeroed_gradient_the_clip_reduced_as_zero_is_one_error_before_any_update(runs):
    """zero_grad(set_to_none=False), a backward that leaves a branch unused, clip_grad_norm_() (the
    branch's gradient goes to the reduction as zero), then a no_sync() backward reaching the branch:
    step() is one error on every rank, nothing updated, and opt.zero_grad() recovers. Before: that
    backward wrote its local, unreduced gradient over the reduced one in the buffer, and step()
    applied it, silently."""
    for out in runs["zeroed taken as zero"]:
        assert out["canzona"] and out["unchanged"], out
        assert out["message"].startswith("a backward reached the gradient of 'branch.") and \
            "taken it to the reduction as zero" in out["message"] and "\n" not in out["message"], out
        assert out["then"]["error"] is None, out["then"]


# --- reading or writing .grad between backward and step ------------------------------------------


@pytest.mark.parametrize("how", TOUCHES)
def test_touching_grad_between_backward_and_step_is_one_error_before_any_update(runs, how):
    for out in runs[f"touch {how}"]:
        assert out["canzona"] and out["unchanged"], out
        assert "\n" not in out["message"]
        if how in ("zero between", "assign between"):
            assert "between backward and step()" in out["message"], out
        elif how == "opt zero between":
            assert "found no gradient on any rank" in out["message"], out
        else:
            assert "opt.clip_grad_norm_" in out["message"] and "canzona.integrations.hf" in out["message"], out
        if how == "torch clip value":
            assert "opt.clip_grad_value_(clip_value)" in out["message"], out


@pytest.mark.parametrize("how", ["max_grad_norm", "explicit"])
def test_clipping_by_the_optimizer(runs, how):
    want = emulate(replace(BASE, clip_norm=0.05), DP)
    explicit = runs["clip explicit"][0]["params"]
    for r, out in enumerate(runs[f"clip {how}"]):
        assert compare(out["params"], want)["max_rel_diff"] < 1e-5, r
        assert compare(out["params"], explicit)["bit_identical"], r  # one rule, wherever it is asked for
    norms = [out["norms"] for out in runs["clip explicit"]]
    assert norms[0] == norms[1] and all(n > 0.05 for n in norms[0])  # it really clipped, alike on every rank


def test_clipping_twice_sees_the_clipped_norm_as_torch_does(runs):
    explicit = runs["clip explicit"][0]
    for out in runs["clip twice"]:
        assert out["norms"][0][0] == explicit["norms"][0]  # the same first step (then they part, slightly)
        assert all(second == pytest.approx(0.05, rel=1e-5) for _, second in out["norms"])
        assert compare(out["params"], explicit["params"])["max_rel_diff"] < 1e-3


def test_clip_by_inf_only_measures(runs):
    want = emulate(BASE, DP)
    measured = runs["clip measure"]
    for out in measured:
        assert compare(out["params"], want)["bit_identical"]
    assert measured[0]["norms"][0] == runs["clip explicit"][0]["norms"][0]  # the same first step


# --- habits that must simply work ---------------------------------------------------------------


@pytest.mark.parametrize("zero", ["optimizer", "model", "model-false"])
def test_every_zero_grad_habit_trains_exactly(runs, zero):
    want = emulate(BASE, DP)
    for out in runs[f"zero {zero}"]:
        assert compare(out, want)["bit_identical"]


@pytest.mark.parametrize("zero", list(BRANCHY_ZEROS))
def test_an_unused_parameter_steps_as_torch_steps_it_after_either_zero_grad(runs, zero):
    want = branchy_torch_reference(zero)
    for out in runs[f"branchy {zero}"]:
        assert compare(out, want)["max_rel_diff"] < 1e-6, zero
    kept, dropped = branchy_torch_reference("opt set_to_none=False"), branchy_torch_reference("opt")
    assert not torch.equal(kept["branch.weight"], dropped["branch.weight"])  # the habit matters


def test_opt_clip_grad_value_under_dp_steps_as_torch_ddp_clip_grad_value_and_adamw(runs):
    """DP 2: opt.clip_grad_value_(0.02) between backward and step(), the branch unused in two steps:
    bit for bit torch's AdamW after torch.nn.utils.clip_grad_value_ on the gradient DDP averages."""
    want = branchy_clip_value_reference(DP)
    for out in runs["branchy clip value"]:
        assert compare(out, want)["bit_identical"]
    assert not compare(want, branchy_torch_reference("opt"))["bit_identical"]  # the clamp matters


def test_0d_parameters_train_and_resume_under_dp_as_torch(runs):
    """0-d parameters under DP 2: AdamW's, bit for bit torch's optimizers (the single-process
    reference fed the reduced gradients), in the clip's norm as in torch's (to the order of its
    sum), their full state torch's (shape ()), and resumed exactly from the full and the sharded
    checkpoint."""
    want = scalars.Scaled()
    opts, norms = scalars.torch_optimizers(want), []
    for step in range(3):
        scalars.torch_step(want, opts, step, DP)
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in want.parameters()])))
    for out in runs["scalars"]:
        assert compare(out["three"], weights(want))["bit_identical"]
        assert out["norms"] == pytest.approx(norms, rel=1e-6)  # the clip's norm counts the scalars
        saved = scalars.by_name(out["full"])
        for name in ("gate", "logit_scale"):
            state = scalars.adamw_state(opts, want, name)
            assert saved[name]["step"] == int(state["step"])
            for field in ("exp_avg", "exp_avg_sq"):
                assert saved[name][field].shape == () and torch.equal(saved[name][field], state[field]), name
    scalars.torch_step(want, opts, 3, DP)
    for out in runs["scalars"]:
        for form in ("four", "resumed full", "resumed sharded"):
            assert compare(out[form], weights(want))["bit_identical"], form


def test_zeroing_between_micro_batches_drops_the_accumulated_gradient_as_torch_does(runs):
    for dropped, kept in zip(runs["micro-batch dropped"], runs["micro-batch kept"]):
        assert compare(dropped, kept)["bit_identical"]


def test_one_cycle_lr_with_its_defaults_cycles_momentum_and_beta1(runs):
    out = runs["one cycle"]
    assert out[0]["seen"] == out[1]["seen"] and out[0]["finite"]
    first, last = out[0]["seen"][0], out[0]["seen"][-1]
    for (kind, lr, momentum, betas, muon_momentum), (_, lr2, momentum2, _, _) in zip(first, last):
        assert lr != lr2 and momentum != momentum2  # both cycle
        if kind == "adamw":
            assert betas[0] == momentum  # AdamW's beta1 is what OneCycleLR cycles
        else:
            assert muon_momentum == momentum


# --- wrappers -----------------------------------------------------------------------------------


def test_a_model_wrapped_in_ddp_after_the_optimizer_is_refused_on_every_rank(runs):
    for out in runs["ddp after"]:
        assert out["canzona"] and out["unchanged"], out
        assert "DistributedDataParallel" in out["message"] and "reduced twice" in out["message"], out


def test_a_ddp_model_is_refused_by_from_module(runs):
    for out in runs["ddp before"]:
        assert out["error"] == "SpecError" and "DistributedDataParallel" in out["message"], out


def test_an_fsdp1_model_is_refused_naming_fsdp(runs):
    for out in runs["fsdp1"]:
        for what in ("from_module", "optimizer"):
            assert out[what]["error"] == "SpecError" and "sharded by FSDP" in out[what]["message"], out


def test_an_fsdp2_model_takes_the_fsdp_step(runs):
    """A fully_shard model is not refused: DistributedOptimizer runs its FSDP step
    (tests/runtime/test_fsdp_*.py train it), and its spec from the sharded module is the model's."""
    for out in runs["fsdp2"]:
        assert out["error"] is None and out["value"] == ("FsdpOptimizer", True), out


# --- non-finite gradients -----------------------------------------------------------------------


@pytest.mark.parametrize("case", ["nan raise", "inf raise"])
def test_a_nonfinite_gradient_on_one_rank_is_an_error_on_every_rank_before_any_update(runs, case):
    for out in runs[case]:
        assert out["canzona"] and "global gradient norm is" in out["message"], out
        assert out["unchanged"] and out["state unchanged"], out


NAN_WEIGHT = "model.layers.0.mlp.up_proj.weight"  # `nonfinite_job`'s weight made NaN on rank 1


def test_nan_weights_on_one_rank_are_named_on_every_rank_under_skip(runs):
    """Rank 1's copy of one weight NaN: the global norm is NaN, and every rank raises the same error
    naming those weights (rank 0's are finite: the check's agreement), not the data, nothing
    updated, no step skipped. Before: skipped, and every step after it (rank 1's NaN loss each time)."""
    for out in runs["nan weight skip"]:
        assert out["canzona"] and out["message"].startswith(f"the weights of {NAN_WEIGHT!r} are not finite"), out
        assert "not the data" in out["message"] and out["skipped"] == 0, out
        assert out["unchanged"] and out["state unchanged"], out
    assert runs["nan weight skip"][0]["message"] == runs["nan weight skip"][1]["message"]


def test_a_nonfinite_step_can_be_skipped_on_every_rank(runs):
    for out in runs["nan skip"]:
        assert out["error"] is None and out["skipped"] == 1, out
        assert out["unchanged"] and out["state unchanged"] and out["finite after"], out


def test_a_skipped_steps_collectives_are_step_collectives_skipped(runs):
    """The skipped step (rank 1's loss NaN) sends what `step_collectives(skipped=True)` lists, the
    simulator's definition: the step check, then the weights' finiteness (one word over DP, the
    runtime's `nonfinite_weights_error`), and nothing after (no parameter gathers); the steps
    around it what a regular step lists. Before, step_collectives had no skipped step: the
    weights check, which FSDP2's plan lists (`fsdp_collectives`), was missing from it."""
    from canzona.step_collectives import step_collectives, step_records

    for r, out in enumerate(runs["nan skip"]):
        spec = build_model(BASE).spec()
        regular = step_records(step_collectives(out["plan"], spec, out["policy"], dp_rank=r))
        skipped = step_records(step_collectives(out["plan"], spec, out["policy"], dp_rank=r, skipped=True))
        assert len(out["log"]) == 3
        assert out["log"][1] == skipped, f"rank {r}"
        assert out["log"][0] == out["log"][2] == regular, f"rank {r}"
        assert skipped != regular


# --- torch.amp.GradScaler -----------------------------------------------------------------------


def test_grad_scaler_unscale_clip_step_update_trains_as_the_unscaled_loop(runs):
    """Before: scaler.unscale_ met the guard and scaler.step was refused ('GradScaler is not
    supported'). unscale_ now unscales the reduced gradients (a collective, as the clip is); the
    clip then sees the unscaled global norm; the scale grows as GradScaler grows it."""
    explicit = runs["clip explicit"][0]
    # the same with unscale_ through a proxy, then scaler.step(opt): GradScaler's state for the
    # optimizer itself is still READY, its inf check came after the clip and its scale a second
    # time. Before: 'GradScaler's unscale after clip_grad_norm_()' (without the clip: unscaled twice)
    for out in runs["scaler unscale"] + runs["scaler unscale proxy then optimizer"]:
        assert out["error"] is None, out["error"]
        assert compare(out["params"], explicit["params"])["bit_identical"], out["norms"]
        assert out["norms"] == explicit["norms"]
        assert out["scales"] == [2.0 ** 11, 2.0 ** 12, 2.0 ** 13]


def test_grad_scaler_step_alone_unscales_before_the_optimizers_clip(runs):
    """The same through a wrapper forwarding `_step_supports_amp_scaling` (Lightning-style): GradScaler
    sets its scale on the wrapper. Before: step() never saw it and stepped the scaled gradients."""
    want = runs["clip max_grad_norm"][0]["params"]
    for out in runs["scaler step"] + runs["scaler step forwarding"]:
        assert compare(out["params"], want)["bit_identical"]
        assert out["scales"] == [2.0 ** 10] * 3


def test_grad_scaler_skips_an_inf_step_on_every_rank_and_backs_off(runs):
    """Rank 1's gradients are Inf at the second step: every rank's scaler finds it (the check is
    global) and skips that step, with the default nonfinite='raise' (GradScaler's skip is not an error)."""
    for out in runs["scaler inf"]:  # scaler.step still calls step() (it takes the scale), which counts the skip
        assert out["changed"] == [True, False, True] and out["finite"] and out["skipped"] == 1, out
        assert out["scales"] == [2.0 ** 10, 2.0 ** 9, 2.0 ** 9]
        assert not math.isfinite(out["norms"][1]) and math.isfinite(out["norms"][2])
    a, b = runs["scaler inf"]
    assert compare(a["params"], b["params"])["bit_identical"]
    for out in runs["scaler step inf"]:  # scaler.step alone: step() gets the verdict and skips
        assert out["changed"] == [True, False, True] and out["finite"] and out["skipped"] == 1, out
        assert out["scales"] == [2.0 ** 10, 2.0 ** 9, 2.0 ** 9]


@pytest.mark.parametrize("how", ["step", "unscale_", "step at scale 1", "step after a resume"])
def test_overlap_step_under_a_grad_scaler_keeps_the_updates_it_computed_early(one_rank, how):
    """overlap_step computes the updates as the buckets land, inside the first step check, which
    GradScaler's unscale runs: `unscale_` hands its inverse scale over first, so the early updates
    are computed from the gradients unscaled as the buffers then are (the same product), and kept:
    every step overlapped. `scaler.step` alone runs the check from its inf check (a dummy inverse
    of 1), whose GradScaler holds the scale step() is then handed: the early updates are computed
    at its inverse and kept, the first step too, and after `scaler.load_state_dict` (a resume, here
    at 2**6), and at a scale of exactly 1 (no unscale: multiplying by 1 is the identity). Before:
    GradScaler's unscale dropped every early update (3 computed, 0 kept); then `scaler.step` alone
    computed them at the scale the last step() took (the first step's, and a resumed run's first,
    dropped: 2 kept), and at scale 1 step() multiplied by 1, which dropped every one (0 kept). The
    weights bit for bit the run without overlap_step."""
    def run(overlap: bool) -> tuple[dict, int, int]:
        model = build_model(BASE)
        opt = _optimizer(model, overlap_step=overlap)
        calls = []
        speculate = opt.matrix_step.speculate
        opt.matrix_step.speculate = lambda *a, **k: (calls.append(1), speculate(*a, **k))[1]
        scaler = torch.amp.GradScaler("cpu", init_scale=1.0 if how == "step at scale 1" else 2.0 ** 10)
        if how == "step after a resume":
            saved = torch.amp.GradScaler("cpu", init_scale=2.0 ** 6)
            saved._lazy_init_scale_growth_tracker(torch.device("cpu"))
            scaler.load_state_dict(saved.state_dict())
        for tokens in _batches(0, 1):
            opt.zero_grad()
            scaler.scale(model.loss(tokens)).backward()
            if how == "unscale_":
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        return _params(model), len(calls), opt.overlapped_steps

    (overlapped, speculated, kept), (plain, _, _) = run(True), run(False)
    assert speculated == 3, speculated  # before: 3 computed, 3 dropped (then at most 1)
    assert kept == 3, kept  # before: 2 through scaler.step alone (0 at scale 1)
    assert compare(overlapped, plain)["bit_identical"]


def test_grad_scaler_unscale_inside_no_sync_is_one_error(one_rank):
    from canzona.errors import CanzonaError

    model = build_model(BASE)
    opt = _optimizer(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    with opt.no_sync():
        scaler.scale(model.loss(_batches(0, 1)[0])).backward()
        with pytest.raises(CanzonaError, match=r"^GradScaler.unscale_ inside no_sync\(\) .*unscale once, after"):
            scaler.unscale_(opt)


@pytest.mark.parametrize("then", ["unscale_", "step"])
def test_grad_scaler_after_a_clip_of_the_scaled_gradients_is_one_error(one_rank, then):
    """opt.clip_grad_norm_() before scaler.unscale_ (or before scaler.step alone) measured and clipped
    the scaled gradients (norm 1646 against 1.6 at scale 2**10): before, the step went on with
    gradients clipped to max_norm / scale, silently. Now the scaler's unscale refuses, nothing updated."""
    from canzona.errors import CanzonaError

    model = build_model(BASE)
    opt = _optimizer(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    before = _params(model)
    scaler.scale(model.loss(_batches(0, 1)[0])).backward()
    opt.clip_grad_norm_(0.05)
    with pytest.raises(CanzonaError, match=r"^GradScaler's unscale after a clip in the same step .*scaler.unscale_\(opt\) first"):
        scaler.unscale_(opt) if then == "unscale_" else scaler.step(opt)
    assert compare(_params(model), before)["bit_identical"]


def test_grad_scaler_step_retried_after_a_refusal_unscales_once(one_rank):
    """scaler.step refused before any update (a negative learning rate), the learning rate put back,
    scaler.step again: the step of those gradients unscaled once. Before: the refused call left the
    scale GradScaler hands over (`opt.grad_scale`, deleted only when step() returns), and the next
    call took the product of the two (torch's rule for a scale already set): gradients divided by
    the scale twice, silently."""
    from canzona.errors import SpecError

    tokens = _batches(0, 1)[:2]

    def run(refuse: bool) -> dict:
        model = build_model(BASE)
        opt = _optimizer(model)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        for i, t in enumerate(tokens):
            opt.zero_grad()
            scaler.scale(model.loss(t)).backward()
            if refuse and i == 1:
                lr = opt.param_groups[0]["lr"]
                opt.param_groups[0]["lr"] = -1.0
                with pytest.raises(SpecError, match="lr must be >= 0"):
                    scaler.step(opt)
                opt.param_groups[0]["lr"] = lr
            scaler.step(opt)
            scaler.update()
        return _params(model)

    assert compare(run(True), run(False))["bit_identical"]


def test_grad_scaler_steps_an_fp16_model_with_fp32_masters(runs):
    a, b = runs["scaler fp16"]
    for out in (a, b):
        assert out["changed"] == [True] * 3 and out["finite"], out
    assert compare(a["params"], b["params"])["bit_identical"]


@pytest.mark.parametrize("overlap", ["plain", "overlapped", "plain clipped", "overlapped clipped"])
def test_a_step_called_again_after_its_check_refused_it_steps_those_gradients_once(runs, overlap):
    """Before: the retried step reduced the AdamW buffer a second time (the reduction is in place),
    and stepped by a gradient no rank had: silently wrong weights. Clipped: a learning rate edited
    on one rank after `clip_grad_norm_()` (whose check step() reused) went unseen, and the ranks
    stepped with different learning rates; now step() refuses on every rank, nothing updated, and
    the retried step takes the clipped gradients once."""
    for out in runs[f"retried {overlap}"]:
        refused = out["refused"]
        # the key that differs named (before: 'rank(s) [1] differ from rank 0')
        assert refused["canzona"] and refused["message"].startswith(
            "ranks disagree on the hyper-parameters in param_groups: param_groups[0]['lr'] is "), out
        assert "\n" not in refused["message"] and refused["unchanged"], out
        assert out["retried"]["error"] is None and out["exact"], out


# --- agreement ----------------------------------------------------------------------------------


@pytest.mark.parametrize("how", list(CLIP_DISAGREEMENTS))
def test_ranks_clipping_by_different_thresholds_fail_before_any_update(runs, how):
    # clip_grad_value_ too: 0.01 vs 0.02 would clamp each shard apart, inf vs 0.01 (no clamp, so no
    # collective, on one rank) would hang; a bad value on one rank alone is the same one error
    outs = runs[f"clip disagreement {how}"]
    for out in outs:
        assert out["canzona"] and "disagree on the clip threshold" in out["message"] and out["unchanged"], out
        assert "\n" not in out["message"], out
    assert len({out["message"].split("; rank ")[0] for out in outs}) == 1, outs


def test_a_second_optimizer_on_a_model_another_holds_is_one_error_and_takes_over_once_it_is_dropped(runs):
    for out in runs["second optimizer"]:
        kept = out["kept"]
        assert kept["error"] == "SpecError" and "held by another DistributedOptimizer" in kept["message"], kept
        assert "\n" not in kept["message"]
        assert out["exact"]


def test_parameters_cannot_be_added_after_construction(runs):
    for out in runs["add_param_group"]:
        assert out["error"] == "SpecError" and "cannot be added" in out["message"], out


@pytest.mark.parametrize("how", REPLACEMENTS)
def test_a_parameter_replaced_in_the_model_is_one_error_before_any_update(runs, how):
    """Before: a parameter replaced with assign=True or untied was silently never trained (the
    optimizer stepped the tensor the model no longer used); all of them replaced said 'call
    backward()'."""
    for out in runs[f"replaced {how}"]:
        assert out["error"] == "CanzonaError" and "was replaced after the optimizer was built" in out["message"], out
        assert "\n" not in out["message"] and out["unchanged"], out


def test_numpy_learning_rates_step_as_the_numbers_they_hold(runs):
    """Before: 'lr must be a finite number, got np.float32(...)' at the first step."""
    for out in runs["numpy lr"]:
        assert out[True]["error"] is None, out[True]
        assert compare(out[True]["params"], out[False]["params"])["bit_identical"]


def test_ranks_with_different_max_grad_norm_fail_at_construction(runs):
    for out in runs["max_grad_norm disagreement"]:
        assert out["error"] == "PlanError" and "gradient clipping" in out["message"], out


@pytest.mark.parametrize("layout", ["zero1", "fsdp"])
def test_torch_optimizer_hooks_fire_once_per_call_as_on_a_torch_optimizer(runs, layout):
    """Before: the step hooks fired, the state-dict and load hooks never did (state_dict() and
    load_state_dict() are canzona's own), silently: a hook's edit of the state dict was lost."""
    want = [("global step pre", True, 2), ("step pre", True, 2), ("step post", True, 2), ("global step post", True, 2),
            ("state_dict pre", True, 0), ("state_dict post", True, 1), ("load pre", True, 1),
            ("load post", True, 0)]
    for out in runs[f"hooks {layout}"]:
        assert out["error"] is None, out  # the tag the post hook added was removed before loading
        assert out["seen"] == want and out["tagged"] is True, out


# --- freezing, LoRA -------------------------------------------------------------------------------


def _one_rank_run(job, *args) -> dict:
    """`job` at DP 1 in this process (the `one_rank` fixture's group): the single-process result."""
    return job(0, 1, *args)


def test_a_layer_frozen_mid_training_is_neither_stepped_nor_decayed_and_trains_again_once_unfrozen(runs):
    want = frozen_torch_reference()
    for out in runs["frozen adamw"]:
        assert out["error"] is None and out["value"] == [True, True], out.get("message")
        assert compare(out["params"], want)["max_rel_diff"] < 1e-6
    for out in runs["frozen muon"]:  # the matrix optimizer skips it alike (its momentum too: torch's Muon does)
        assert out["error"] is None and out["value"] == [True, True], out.get("message")
    assert compare(runs["frozen muon"][0]["params"], runs["frozen muon"][1]["params"])["bit_identical"]


@pytest.mark.parametrize("layout", ["", " fsdp"])
def test_a_frozen_layer_under_the_matrix_optimizer_trains_as_in_one_process(runs, one_rank, layout):
    want = _one_rank_run(frozen_job, "muon")
    for out in runs[f"frozen muon{layout}"]:  # the AdamW biases' DP sum rounds otherwise (7e-10 measured)
        assert out["error"] is None and out["value"] == [True, True], out.get("message")
        assert out["layout"] == ("FsdpOptimizer" if layout else "DistributedOptimizer")
        assert compare(out["params"], want["params"])["max_rel_diff"] < 1e-6


def test_a_layer_frozen_on_one_rank_only_is_one_error_on_every_rank_before_any_update(runs):
    """Before: the step took the frozen rank's missing gradient for a branch unused there, and
    stepped the layer on every rank (the frozen rank's copy too) from the others' gradients alone."""
    for out in runs["frozen on one rank"]:
        assert out["error"] == "CanzonaError" and out["step"] == 1, out
        # the frozen set named as what differs, and its first parameter (before: 'the hyper-parameters
        # in param_groups or which parameters are frozen', no name)
        assert out["message"].startswith("ranks disagree on which parameters are frozen (requires_grad_(False)): "
                                          "'branch.bias' is frozen on rank(s) [0] and not on rank(s) [1]"), out["message"]
        assert "\n" not in out["message"], out["message"]
        assert out["unchanged"], out


def test_a_group_reordered_on_one_rank_then_frozen_on_every_rank_trains_as_in_order(runs):
    """Before: the digest recorded the frozen parameters by position in their group, so a group
    whose `params` one rank had rotated (accepted: in any order) disagreed once a parameter was
    frozen on every rank alike: 'ranks disagree ... frozen' on every rank. Now by name."""
    for out in runs["frozen reordered"]:
        assert out["error"] is None, out.get("message")
        assert compare(out["params"], runs["frozen muon"][0]["params"])["bit_identical"]


def test_a_layer_frozen_between_backward_and_step_on_one_rank_is_stepped_as_torch_steps_it(runs):
    """It holds its gradient on every rank (reduced in that backward): torch's optimizers step it,
    whatever its requires_grad since. Before (review): 'ranks disagree ... frozen' on every rank
    (the step's digest read every parameter's requires_grad; now those no gradient reached alone)."""
    rank0, rank1 = runs["frozen after backward on one rank"]
    for out in (rank0, rank1):
        assert out["error"] is None and out["stepped"] == [True, True], out
    assert compare(rank0["params"], rank1["params"])["bit_identical"]


def test_the_groups_digest_names_frozen_parameters_whatever_their_order_in_a_group():
    from canzona.runtime.groups import groups_apart, hyper_parameters_digest

    params = {n: torch.nn.Parameter(torch.zeros(2)) for n in "abcd"}
    params["c"].requires_grad_(False)
    groups = [{"params": list(params.values()), "lr": 0.1}]
    reordered = [{"params": list(params.values())[::-1], "lr": 0.1}]
    assert hyper_parameters_digest(groups, params) == hyper_parameters_digest(reordered, params)
    mine = hyper_parameters_digest(groups, params)
    params["a"].requires_grad_(False)
    theirs = hyper_parameters_digest(groups, params)
    assert mine != theirs
    assert groups_apart([mine.rows, theirs.rows]) == ("ranks disagree on which parameters are frozen "
                                                      "(requires_grad_(False)): 'a' is frozen on rank(s) [1] and not "
                                                      "on rank(s) [0]")
    params["a"].requires_grad_(True)
    groups[0]["lr"] = 0.2
    assert groups_apart([mine.rows, hyper_parameters_digest(groups, params).rows], "TP rank") == \
        "TP ranks disagree on the hyper-parameters in param_groups: param_groups[0]['lr'] is 0.1 on TP rank(s) [0], " \
        "0.2 on TP rank(s) [1]"


def test_a_lora_model_trains_its_adapters_only(runs, one_rank):
    """Frozen base weights stay out of the spec and the optimizer; the adapters train as torch's
    AdamW trains them, or as the matrix optimizer does in one process (ZeRO-1 and FSDP2 alike)."""
    want = lora_torch_reference()
    for out in runs["lora adamw"]:
        assert out["error"] is None and out["base kept"], out.get("message")
        assert out["given"] == ["head.bias", "head.weight", "lora_a.weight", "lora_b.weight"]
        assert compare(out["params"], want)["max_rel_diff"] < 1e-6
    alone = _one_rank_run(lora_job, "muon")
    for out in runs["lora muon"] + runs["lora muon fsdp"]:
        assert out["error"] is None and out["base kept"] and "lora_a.weight" in out["matrices"], out.get("message")
        assert compare(out["params"], alone["params"])["bit_identical"]
        assert not torch.equal(out["params"]["lora_b.weight"], torch.zeros(16, 4))  # the adapters trained
    assert [out["layout"] for out in runs["lora muon fsdp"]] == ["FsdpOptimizer"] * DP  # frozen weights in the unit


def test_async_save_with_a_group_of_its_own_holds_the_state_at_save_time(runs):
    """`dcp.async_save` (torchtitan's async checkpoint), the step run while it writes: the file holds
    the state when it was called, in both forms (the state dict canzona gives is full tensors of its
    own, which no later step writes into)."""
    for out in runs["async save"]:
        assert out == {"given kept": True, "moved on": True, "helper at save": True, "plain at save": True,
                       "sharded at save": True, "process at save": True}, out


# --- torch.compile --------------------------------------------------------------------------------


def test_a_fullgraph_compiled_model_without_overlap_param_gather_trains_as_the_eager_one(runs):
    """What the error below advises (a model compiled without fullgraph: test_param_gather_overlap.py)."""
    for out in runs["compiled fullgraph no overlap"]:
        assert out["error"] is None and out["exact"], out.get("message")


def test_fullgraph_compile_with_gathers_in_flight_names_overlap_param_gather(runs):
    """The second forward meets the first step's gathers in flight, which a graph cannot wait for.
    Before: dynamo's 'Dynamo does not know how to trace method `wait` of class `Work`' alone."""
    for out in runs["compiled fullgraph"]:
        assert out["error"] == "Unsupported", out
        assert "fullgraph=True cannot wait for the parameter all-gathers" in out["message"], out["message"]
        assert "overlap_param_gather=False" in out["message"]


# --- torch's state-dict API ---------------------------------------------------------------------


def test_torch_state_dict_api_resumes_bit_for_bit(runs):
    for out in runs["dcp"]:
        assert out["untouched"]  # get_optimizer_state_dict ran no step of its own
        assert out["template entries"] > 0 and not out["template stepped"]  # a fresh optimizer's template
        assert compare(out["resumed"], out["straight"])["bit_identical"]


def test_torchtitans_flattened_optimizer_state_resumes_bit_for_bit(runs):
    """torchtitan's checkpointer (`flatten_optimizer_state_dict=True`, its default) through dcp.
    Before: `set_optimizer_state_dict` was a raw KeyError (torch's unflattening reads
    `optimizer.state[param]` for the field names)."""
    for out in runs["dcp flat"]:
        assert out["saved"] == {"error": None, "value": True} and out["untouched"], out["saved"]
        assert out["resumed"]["error"] is None, out["resumed"]
        assert out["resumed"]["value"]["loaded"]  # the same state as saved, every field
        assert compare(out["resumed"]["value"]["params"], out["straight"])["bit_identical"]


@pytest.mark.parametrize("case", ["flat without the option", "nested with the option", "one-sided soap"])
def test_a_flattened_or_nested_state_dict_loads_whatever_the_option(runs, case):
    """"one-sided soap": flattened round trip of a state with fields its configuration leaves unused
    (before: torch's flattening refused their None, NotImplementedError)."""
    for out in runs["dcp flat"]:
        assert out[case] == {"error": None, "value": True}, out[case]


class _Blocks(torch.nn.Module):
    """`layers` Llama-like decoder blocks of width 4 (nine parameters each): a realistic count of
    parameters at no cost."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList()
        for _ in range(layers):
            block = torch.nn.Module()
            block.attention_norm, block.ffn_norm = torch.nn.RMSNorm(4), torch.nn.RMSNorm(4)
            for name in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):
                setattr(block, name, torch.nn.Linear(4, 4, bias=False))
            self.layers.append(block)


def _flat_group_bytes(model, opt) -> int:
    """Bytes of the `param_groups.<name>.<key>` entries of the flattened state dict, each (key,
    value) pickled on its own, as dcp writes each (one pickle of them all stores a shared value once)."""
    import pickle

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    flat = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    return sum(len(pickle.dumps((k, v))) for k, v in flat.items() if k.startswith("param_groups."))


def test_a_flattened_state_dicts_group_entries_grow_as_the_parameters_do(one_rank):
    """torch's flattening writes every group key once per parameter: a key whose value grows with
    the model is stored quadratically. Before: each member carried its group's names and a header
    listing every parameter's shape (723 parameters: 25 MB of group entries against torch AdamW's
    89 kB; 4000 parameters: ~0.8 GB)."""
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters
    from canzona.spec import ModelSpec

    def measured(layers: int) -> tuple[int, int]:
        model = _Blocks(layers)
        mine = DistributedOptimizer(list(named_parameters(model)), ModelSpec.from_module(model))
        return _flat_group_bytes(model, mine), _flat_group_bytes(model, torch.optim.AdamW(model.parameters()))

    (small, _), (large, torch_large) = measured(20), measured(40)
    assert large < 2.5 * small, (small, large)
    assert large < 2 * torch_large, (large, torch_large)  # torch's own AdamW, as torchtitan builds it


def test_the_fields_a_flattened_entry_is_rebuilt_from_are_the_ones_it_holds(one_rank):
    """torch's unflattening scans every key of the state dict for each field `optimizer.state[param]`
    names that the entry lacks (a nested field, it supposes): a name the save never holds costs
    a scan per parameter, quadratic. Before: `master` (without master weights) and the stack count
    (but on a stack) were named for every parameter; 3999 parameters loaded in 76 s against 10 s
    for torch's AdamW (`benchmarks/bench_flat_state.py llama444`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters
    from canzona.spec import ModelSpec

    model = _Blocks(2)
    opt = DistributedOptimizer(list(named_parameters(model)), ModelSpec.from_module(model))
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    flat = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    absent = sorted({f for n, p in model.named_parameters() for f in opt.state[p] if f"state.{n}.{f}" not in flat})
    assert absent == [], absent


def test_the_fields_of_each_entry_are_looked_up_once_and_follow_the_state(one_rank):
    """`opt.state[p]` (what torch's unflattening asks for each parameter) answers from an index
    kept between calls (before: a scan of the parameters and a template per call, 3.1 of 4.4 s of
    `set_optimizer_state_dict` at 3999 parameters, `benchmarks/bench_flat_state.py llama444`):
    the same fields as a fresh lookup, SOAP's one-sided matrices (`max_precond_dim`) naming only
    the side they keep; a tensor not the optimizer's is no entry; the flattened form round-trips."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.checkpoint import entry_fields
    from canzona.runtime.modules import named_parameters
    from canzona.spec import ModelSpec

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 12, bias=False), torch.nn.Linear(12, 4, bias=False),
                                torch.nn.Linear(4, 4))
    opt = DistributedOptimizer(list(named_parameters(model)), ModelSpec.from_module(model), optimizer="soap",
                               matrix_config={"max_precond_dim": 4})
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    fields = {n: list(opt.state[p]) for n, p in model.named_parameters()}
    assert fields == {n: entry_fields(opt, p) for n, p in model.named_parameters()}
    assert "GG_R" in fields["0.weight"] and "GG_L" not in fields["0.weight"]  # 12 x 4: the columns' side only
    assert "GG_L" in fields["1.weight"] and "GG_R" not in fields["1.weight"]
    assert entry_fields(opt, torch.zeros(4, 4)) is None
    with pytest.raises(KeyError):
        opt.state[torch.zeros(4, 4)]
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    saved = get_optimizer_state_dict(model, opt, options=flat)
    set_optimizer_state_dict(model, opt, saved, options=flat)
    again = get_optimizer_state_dict(model, opt, options=flat)
    assert saved.keys() == again.keys()
    assert all(torch.equal(v, again[k]) if isinstance(v, torch.Tensor) else v == again[k] for k, v in saved.items())


def test_a_version_3_state_dict_with_names_and_shapes_in_every_group_still_loads(one_rank):
    """Version 3 (before the names moved to the top and the shapes out of the header) loads as
    saved; a state dict whose groups list indices but no names is one PlanError line."""
    import json

    from canzona.errors import PlanError
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters
    from canzona.spec import ModelSpec

    def optimizer():
        model = _Blocks(2)
        return model, DistributedOptimizer(list(named_parameters(model)), ModelSpec.from_module(model))

    model, opt = optimizer()
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    saved = opt.state_dict()
    header = json.loads(saved["param_groups"][0]["canzona"])
    header["version"] = 3
    header["model"]["shapes"] = {n: list(p.shape) for n, p in model.named_parameters()}
    old = {"state": saved["state"], "param_groups": [
        {**g, "param_names": names, "canzona": json.dumps(header)} for g, names in zip(saved["param_groups"], saved["param_names"])]}
    _, fresh = optimizer()
    fresh.load_state_dict(old)
    assert _nested_equal(fresh.state_dict(), saved)
    _, other = optimizer()
    with pytest.raises(PlanError, match="^not a canzona optimizer state .*indices but no names"):
        other.load_state_dict({k: v for k, v in saved.items() if k != "param_names"})


def test_a_flattened_state_dict_beside_other_weights_is_refused_at_the_first_step(runs):
    for out in runs["dcp flat"]:
        assert out["other weights"]["error"] == "CheckpointError", out["other weights"]
        assert "\n" not in out["other weights"]["message"]


def test_dcp_of_the_optimizers_own_state_dict_resumes_bit_for_bit(runs):
    """`dcp.save({"optim": opt.state_dict()})` and `dcp.load` into a fresh optimizer's: DCP loads the
    tensors in place but puts each entry's Python scalars (`step`, `canzona_stepped`) under the
    key's string (`state["0"]`). Before: loading read `canzona_stepped: False` from the template and
    dropped every entry's state (momentum zeroed, steps from 0), silently."""
    for out in runs["dcp"]:
        assert out["plain loaded"]
        assert compare(out["plain resumed"], out["straight"])["bit_identical"]


def test_a_checkpoint_one_rank_cannot_read_is_one_error_on_every_rank_at_once(runs):
    """Before: rank 1 raised alone and rank 0 waited in DCP's collectives for the process group's
    timeout (30 minutes by default), then raised DCP's CheckpointException."""
    for out in runs["unseen checkpoint"]:
        assert out["error"] == "CheckpointError" and "-elsewhere/.metadata: cannot read" in out["message"], out
        assert "\n" not in out["message"] and out["seconds"] < 30 and out["state unchanged"], out


def test_torch_save_files_resume_bit_for_bit_from_any_ranks_file_loaded_twice(runs):
    for out in runs["torch.save"]:
        assert out["resumed exact"], out


def test_torch_save_files_of_two_saves_are_one_error_on_every_rank_nothing_loaded(runs):
    """Before: each rank took its own pieces of its own file, silently mixing two saves' state."""
    for out in runs["torch.save"]:
        got = out["two saves"]
        assert got["error"] == "CheckpointError" and "were given another state dict" in got["message"], got
        assert "\n" not in got["message"] and got["unchanged"], got


def test_a_state_dict_damaged_on_one_rank_is_one_error_on_every_rank_nothing_loaded(runs):
    """Before: rank 1 failed halfway with torch's RuntimeError (its state half replaced) and rank 0,
    which holds no piece of the damaged entry, loaded it."""
    damaged, peer = runs["torch.save"][1]["damaged on one rank"], runs["torch.save"][0]["damaged on one rank"]
    assert damaged["error"] == "PlanError" and "is damaged: its 'exp_avg'" in damaged["message"], damaged
    assert peer["error"] == "CheckpointError" and "rank(s) [1] of group dp refused it" in peer["message"], peer
    # the refusing rank's reason too (before: '(see their error)', the reason on rank 1 only)
    assert peer["message"].endswith(damaged["message"]), peer
    assert damaged["unchanged"] and peer["unchanged"]


def test_a_nan_in_one_ranks_state_dict_is_one_error_on_every_rank_naming_it_nothing_loaded(runs):
    """Before: loaded (rank 1 took the NaN, rank 0 its own finite copy), and the next step wrote it
    into the weights; torch's optimizers load it alike."""
    nan, peer = runs["torch.save"][1]["nan on one rank"], runs["torch.save"][0]["nan on one rank"]
    assert nan["error"] == "CheckpointError" and "is damaged: its 'exp_avg' holds NaN or Inf" in nan["message"], nan
    assert peer["error"] == "CheckpointError" and peer["message"].endswith(nan["message"]), peer
    assert nan["unchanged"] and peer["unchanged"]


def test_a_state_dict_in_bf16_is_cast_to_the_state_dtype_as_torch_casts(runs):
    """Before: it loaded as bf16 and the next step failed in torch ('expected dtype BFloat16')."""
    for out in runs["torch.save"]:
        assert out["bf16 state"]["error"] is None and out["bf16 state dtypes"] == ["torch.float32"], out


@pytest.mark.parametrize("kind", ["step", "plain"])
def test_sharded_folders_of_two_saves_across_the_ranks_are_one_error_nothing_loaded(runs, kind):
    """Before: each rank loaded its own pieces of its own folder, silently mixing two saves. With
    manifests the verification refuses them (their manifests differ), without it the folders'
    .metadata files differ (the plain folder's check, before any entry is read)."""
    needle = "their manifest differs" if kind == "step" else "their .metadata differs"
    for out in runs["two saves sharded"]:
        got = out[kind]
        assert got["error"] == "CheckpointError" and needle in got["message"], got
        assert "every rank must load the same save" in got["message"], got
        assert "\n" not in got["message"] and got["unchanged"], got


def test_verify_checkpoint_of_two_saves_across_the_ranks_is_one_error(runs):
    """Before: each rank hashed a share of its own folder and every share passed."""
    for out in runs["two saves sharded"]:
        got = out["verify"]
        assert got["error"] == "CheckpointError" and "were given another checkpoint" in got["message"], got


def test_torch_state_dict_api_resumes_at_another_layout(runs):
    """DP 2's checkpoint, one more step at DP 1: that step's gradient is the same sum in another
    order, so the weights part in the last bits (README: Muon 3.4e-4 after 10 steps of DP 1 vs 2)."""
    straight = runs["dcp"][0]["straight"]
    assert compare(runs["dcp other layout"][0], straight)["max_rel_diff"] < 1e-3


# --- configuration errors, before any collective ------------------------------------------------


@pytest.mark.parametrize("kwargs, needle", [
    ({"max_grad_norm": 0}, "max_grad_norm must be a positive number"),
    ({"max_grad_norm": float("nan")}, "max_grad_norm must be a positive number"),
    ({"nonfinite": "ignore"}, "nonfinite must be one of raise, skip"),
])
def test_bad_clip_and_nonfinite_settings_fail_before_any_collective(kwargs, needle):
    with pytest.raises(SpecError, match=needle):
        _optimizer(build_model(BASE), **kwargs)


# --- one rank ------------------------------------------------------------------------------------


# (a step refused for its lr before: kept since, which model.zero_grad() ends,
# test_a_step_refused_for_its_learning_rate_is_kept_and_model_zero_grad_ends_it)
@pytest.mark.parametrize("before, set_to_none", [("backward", True), ("clip", True), ("clip", False)])
def test_model_zero_grad_within_a_step_then_a_backward_names_optimizer_zero_grad(one_rank, before, set_to_none):
    """A batch dropped mid-step (a spike seen at the clip) with `model.zero_grad()`, then another
    backward: its gradients went to the reduction, whose buffers the new backward would overwrite
    (under the collective, or after the check read them), so it is refused with its own line that
    says what discards them (optimizer.zero_grad(), with which the same loop runs); the buffers as
    they were; `set_to_none=False` is refused at the zeroing, naming the same remedy. Before:
    'gradients were synchronised twice in one step: wrap ... in no_sync()', and for the zeroing
    'nothing may read or change .grad between backward and step() ... Clip with ...'. The dropped
    gradient written anew is refused by the step's check, which every rank runs together, not inside
    that backward (one rank raising there, its loop having dropped a batch, left its peers waiting in
    the step's collectives), nothing updated; so is the zeroing in place (before: raised at
    `model.zero_grad(set_to_none=False)`, on one rank alone too)."""
    from canzona.errors import CanzonaError

    model = build_model(BASE)
    opt = _optimizer(model)
    tokens = _batches(0, 1)[0]
    model.loss(tokens).backward()
    if before == "clip":
        opt.clip_grad_norm_(math.inf)
    with pytest.raises(CanzonaError) as refused:
        model.zero_grad(set_to_none=set_to_none)
        model.loss(tokens).backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
    assert refused.traceback[-1].name != "_arrive" and any(e.name == "_step" for e in refused.traceback)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    said = str(refused.value)
    assert ("was set to None (model.zero_grad(), or .grad = None) after this step's gradients went to the "
            "reduction" if set_to_none else "cannot be zeroed in place (zero_.default: "
            "model.zero_grad(set_to_none=False) within a step?)") in said, said
    assert said.endswith("discard a step's gradients with optimizer.zero_grad(), which ends their reduction too")
    assert "\n" not in said, said
    opt.zero_grad()  # what the error says: the loop goes on
    model.loss(tokens).backward()
    assert math.isfinite(float(opt.clip_grad_norm_(math.inf)))
    opt.step()


def _foreach_zero(grads: list[torch.Tensor]) -> None:
    if grads:  # none before the first backward
        torch._foreach_zero_(grads)


# zeroing `.grad` in place as torch.optim's zero_grad(set_to_none=False) does (`_foreach_zero_`) or by
# `fill_(0)`: each gradient that is not None
GRAD_ZEROINGS = {
    "foreach_zero_": lambda m, o: _foreach_zero([p.grad for p in m.parameters() if p.grad is not None]),
    "fill_(0)": lambda m, o: [p.grad.fill_(0) for p in m.parameters() if p.grad is not None],
    "fill_(tensor(0.))": lambda m, o: [p.grad.fill_(torch.tensor(0.0)) for p in m.parameters() if p.grad is not None],
}


@pytest.mark.parametrize("zero", list(GRAD_ZEROINGS))
def test_zeroing_grad_with_foreach_zero_or_fill_zero_steps_as_torch(one_rank, zero):
    """`torch._foreach_zero_` over the gradients (what torch's zero_grad(set_to_none=False) runs) or
    `fill_(0)` on each, between steps, is zeroing as `zero_()` is: the unused branch's zero gradient is
    stepped (momentum, weight decay) as torch's AdamW steps it, the trained weights as torch's. Before:
    refused at the op ('after step() ... is not readable as .grad'), on that rank alone."""
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters
    from canzona.spec import ModelSpec

    model = _Branchy()
    opt = DistributedOptimizer(list(named_parameters(model)), ModelSpec.from_module(model), "adamw",
                               adamw_config={"weight_decay": 0.1})
    reference = _Branchy()
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1)
    _branchy_steps(model, opt, GRAD_ZEROINGS[zero], 0, 1)
    _branchy_steps(reference, torch_opt, GRAD_ZEROINGS[zero], 0, 1)
    assert compare(_params(model), {n: p.detach() for n, p in reference.named_parameters()})["max_rel_diff"] < 1e-6
    assert compare(_params(model), branchy_torch_reference("opt set_to_none=False"))["bit_identical"]


@pytest.mark.parametrize("write", ["fill_(1)", "foreach_zero_", "clamp_"])
def test_an_in_place_write_between_backward_and_step_is_refused_by_the_step_nothing_updated(one_rank, write):
    """`fill_(1)`, `torch._foreach_zero_` or `clamp_` on a gradient being reduced: not done, recorded,
    and refused by step()'s check (which every rank runs together), nothing updated; opt.zero_grad()
    and a backward then go on. Before: raised at the op, on that rank alone (its peers then waited in
    the step's collectives until the timeout)."""
    (model, opt), (reference, ropt) = _branchy_adamw(), _branchy_adamw()
    _sound_step(model, opt, 0)
    opt.zero_grad()
    _branchy_loss(model, 1).backward()
    {"fill_(1)": lambda: model.a.weight.grad.fill_(1.0),
     "foreach_zero_": lambda: torch._foreach_zero_([p.grad for p in model.parameters()]),
     "clamp_": lambda: model.a.weight.grad.clamp_(-1, 1)}[write]()
    before = _params(model)
    with pytest.raises(CanzonaError) as refused:
        opt.step()
    assert any(e.name == "_step" for e in refused.traceback), refused.traceback
    said = str(refused.value)
    assert "'a.weight'" in said and "\n" not in said, said
    assert ("cannot be zeroed in place" if write == "foreach_zero_" else "nothing may read or change .grad") in said
    assert compare(_params(model), before)["bit_identical"]
    _sound_step(model, opt, 2)
    _assert_trained_as_the_run_that_skipped_batch_1(model, reference, ropt)


@pytest.mark.parametrize("when", ["between backward and step", "after the step"])
def test_a_foreach_write_over_guards_and_plain_tensors_runs_on_the_plain_ones(one_rank, when):
    """`torch._foreach_mul_` / `_foreach_add_` over a list mixing guarded gradients and plain tensors:
    the op runs on the plain ones (each list argument taken at the same places), the guards' part is
    recorded as any write to a guard (refused by step() between backward and step, nothing updated;
    without effect on the last step's gradient). Before: the whole op returned without running,
    the plain tensors silently unchanged."""
    (model, opt), _ = _branchy_adamw(), None
    _sound_step(model, opt, 0)
    if when == "between backward and step":
        opt.zero_grad()
        _branchy_loss(model, 1).backward()
    plain, other = torch.full((3,), 4.0), torch.full((2,), 1.0)
    grads = [model.a.weight.grad, model.b.bias.grad]
    torch._foreach_mul_([grads[0], plain, grads[1], other], 0.5)
    assert torch.equal(plain, torch.full((3,), 2.0)) and torch.equal(other, torch.full((2,), 0.5))
    torch._foreach_add_([plain, grads[0], other], [torch.ones(3), torch.ones(grads[0].shape), torch.full((2,), 3.0)],
                        alpha=2)
    assert torch.equal(plain, torch.full((3,), 4.0)) and torch.equal(other, torch.full((2,), 6.5))
    if when == "after the step":
        return
    before = _params(model)
    with pytest.raises(CanzonaError, match="'a.weight'.*_foreach_mul_") as refused:
        opt.step()
    assert any(e.name == "_step" for e in refused.traceback), refused.traceback
    assert compare(_params(model), before)["bit_identical"]


WRITE_THEN_DROP = {
    "no_sync, mul_, zero_()": ("no_sync", lambda m, o: [p.grad.zero_() for p in m.parameters()]),
    "no_sync, mul_, model.zero_grad()": ("no_sync", lambda m, o: m.zero_grad()),
    "no_sync, mul_, opt.zero_grad()": ("no_sync", lambda m, o: o.zero_grad()),
    "zeroed, mul_, model.zero_grad()": ("zeroed", lambda m, o: m.zero_grad()),
    "zeroed, mul_, fill_(0)": ("zeroed", lambda m, o: [p.grad.fill_(0) for p in m.parameters()]),
}


@pytest.mark.parametrize("case", list(WRITE_THEN_DROP))
def test_a_write_to_a_gradient_then_dropped_steps_as_torch(one_rank, case):
    """An in-place write (`mul_(0.5)`) to a gradient accumulating under no_sync() or zeroed
    (zero_grad(set_to_none=False)), then that gradient dropped (`zero_()`, `fill_(0)`,
    model.zero_grad(), opt.zero_grad()), a backward and step(): the step goes on as torch's (the
    write dropped with the gradient), bit for bit a run without the write. Before: the write's record
    outlived the gradient and step() was refused ('nothing may read or change .grad ... (mul_.Tensor)')."""
    (model, opt), (reference, ropt) = _branchy_adamw(), _branchy_adamw()
    _sound_step(model, opt, 0)
    habit, drop = WRITE_THEN_DROP[case]
    if habit == "no_sync":
        opt.zero_grad()
        with opt.no_sync():
            _branchy_loss(model, 1).backward()
    else:
        opt.zero_grad(set_to_none=False)
    for p in model.parameters():
        p.grad.mul_(0.5)
    drop(model, opt)
    _branchy_loss(model, 2).backward()
    opt.step()
    _assert_trained_as_the_run_that_skipped_batch_1(model, reference, ropt)


def test_a_write_to_a_gradient_dropped_for_another_parameter_is_still_refused(one_rank):
    """The write's record goes with its own gradient only: `mul_` on one gradient under no_sync(),
    another one zeroed, then a backward and step(): refused naming the written one, nothing updated."""
    model, opt = _branchy_adamw()
    _sound_step(model, opt, 0)
    opt.zero_grad()
    with opt.no_sync():
        _branchy_loss(model, 1).backward()
    model.a.weight.grad.mul_(0.5)
    model.b.weight.grad.zero_()
    _branchy_loss(model, 2).backward()
    before = _params(model)
    with pytest.raises(CanzonaError, match="'a.weight'.*mul_"):
        opt.step()
    assert compare(_params(model), before)["bit_identical"]


def test_telling_a_nested_backward_apart_without_torchs_private_attribute_says_no(monkeypatch):
    """`_in_nested_backward` reads torch's private BackwardCFunction.apply: a torch without it (or
    with a builtin there, no `__code__`) gives False (only a refusal's message degrades), not an
    AttributeError raised from inside a backward on one rank (its peers then waiting)."""
    from torch.autograd.function import BackwardCFunction

    from canzona.runtime.gradients import _in_nested_backward

    monkeypatch.setattr(BackwardCFunction, "apply", len)
    assert _in_nested_backward() is False
    monkeypatch.delattr(BackwardCFunction, "apply")
    assert _in_nested_backward() is False


def _reentrant(fn, x: torch.Tensor) -> torch.Tensor:
    from torch.utils.checkpoint import checkpoint

    return checkpoint(fn, x, use_reentrant=True)


def _reentrant_losses(model, how: str) -> list[torch.Tensor]:
    """The losses of `how`'s backwards (each built just before its backward)."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(5), requires_grad=True)
    w = model.a.weight
    if how == "outside, then a segment, one backward":
        return [lambda: _reentrant(lambda x: x @ w.t(), x).sum() + (w * w).sum()]
    if how == "a segment, then outside, one backward":
        return [lambda: model.b(_reentrant(lambda h: torch.tanh(model.branch(h)) + w.sum() * h,
                                           torch.tanh(model.a(x)))).sum()]
    if how == "whole model in a segment, two backwards":
        return [lambda: _reentrant(lambda x: model(x, True), x).sum()] * 2
    assert how == "whole model in a segment, then plain, two backwards"
    return [lambda: _reentrant(lambda x: model(x, True), x).sum(), lambda: model(x, True).sum()]


REENTRANT_SAYS = {
    "outside, then a segment, one backward": ("reached twice in one backward", "no_sync"),
    "a segment, then outside, one backward": ("reached twice in one backward", "no_sync"),
    "whole model in a segment, two backwards": ("with optimizer.no_sync()", None),
    "whole model in a segment, then plain, two backwards": ("synchronised twice", "use_reentrant"),
}


@pytest.mark.parametrize("how", list(REENTRANT_SAYS))
def test_a_gradient_reached_twice_with_reentrant_checkpoints_names_the_cause_it_can_tell(one_rank, how):
    """A second accumulation onto a gradient handed to the reduction, with re-entrant checkpoint
    segments about: one backward reaching a parameter inside a segment and outside it (either order)
    is REACHED_TWICE (use_reentrant=False, not no_sync()); two backwards without no_sync() where the
    second is outside any segment is SYNCED_TWICE; where both are inside segments (the whole model
    checkpointed, two backwards) the graph tasks cannot tell them apart: one line naming both causes
    and both remedies. Before: the whole-model case said REACHED_TWICE alone (the mistake was the
    missing no_sync()), the segment-then-outside one SYNCED_TWICE (one backward)."""
    model, opt = _branchy_adamw()
    opt.zero_grad()
    for loss in _reentrant_losses(model, how):
        loss().backward()
    with pytest.raises(CanzonaError) as refused:
        opt.step()
    said, absent = str(refused.value), REENTRANT_SAYS[how][1]
    assert REENTRANT_SAYS[how][0] in said and (absent is None or absent not in said), said
    if absent is None:
        assert "use_reentrant=False" in said, said


def test_opt_clip_grad_value_steps_as_torch_clip_grad_value_and_adamw(one_rank):
    """`opt.clip_grad_value_(v)` between backward and step() clamps the reduced gradients to [-v, v]:
    the weights bit for bit torch's AdamW after torch.nn.utils.clip_grad_value_ (one rank: the
    gradient DDP averages is the rank's own), the branch's steps without a gradient included, and
    the norm a clip_grad_norm_ after it measures is the clamped gradients'. torch's own
    clip_grad_value_ on the model is refused at step() naming opt.clip_grad_value_ (before: a new
    method, and the refusal named only `clamp_.default` and clip_grad_norm_)."""
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters
    from canzona.spec import ModelSpec

    model = _Branchy()
    opt = DistributedOptimizer(list(named_parameters(model)), ModelSpec.from_module(model), "adamw",
                               adamw_config={"weight_decay": 0.1})
    reference = _Branchy()
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1)
    clipped = []
    for step, use in enumerate(BRANCH_USED):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
        for m, o in ((model, opt), (reference, torch_opt)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x, use), y).backward()
            if o is opt:
                opt.clip_grad_value_(0.02)
                norm = float(opt.clip_grad_norm_(math.inf))
            else:
                clipped.append(any(bool((p.grad.abs() > 0.02).any()) for p in m.parameters() if p.grad is not None))
                torch.nn.utils.clip_grad_value_(m.parameters(), 0.02)
                grads = [p.grad.double() for p in m.parameters() if p.grad is not None]
                assert norm == pytest.approx(float(torch.cat([t.flatten() for t in grads]).norm()), rel=1e-6)
            o.step()
    assert any(clipped)
    assert compare(_params(model), {n: p.detach() for n, p in reference.named_parameters()})["bit_identical"]
    opt.zero_grad()
    _branchy_loss(model, 9).backward()
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.02)
    with pytest.raises(CanzonaError, match=r"clamp.*opt\.clip_grad_value_\(clip_value\)"):
        opt.step()
    # GradScaler: unscale_ before the clamp (torch's order) steps; after it, one error
    from canzona.runtime.grad_guard import AMP_AFTER_CLIP
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for order in ("unscale first", "clip first"):
        opt.zero_grad()
        scaler.scale(_branchy_loss(model, 10)).backward()
        if order == "clip first":
            opt.clip_grad_value_(0.02)
            with pytest.raises(CanzonaError) as refused:
                scaler.unscale_(opt)
            assert str(refused.value) == AMP_AFTER_CLIP
            break
        scaler.unscale_(opt)
        opt.clip_grad_value_(0.02)
        scaler.step(opt)
        scaler.update()
        # torch's order on torch's optimizer (the refused step above updated neither model)
        torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        torch_opt.zero_grad()
        torch_scaler.scale(_branchy_loss(reference, 10)).backward()
        torch_scaler.unscale_(torch_opt)
        assert any(bool((p.grad.abs() > 0.02).any()) for p in reference.parameters() if p.grad is not None)
        torch.nn.utils.clip_grad_value_(reference.parameters(), 0.02)
        torch_scaler.step(torch_opt)
        torch_scaler.update()
        assert compare(_params(model), {n: p.detach() for n, p in reference.named_parameters()})["bit_identical"]


def test_clip_grad_value_inf_before_grad_scaler_unscale_is_no_clip(one_rank):
    """opt.clip_grad_value_(inf) clamps nothing, as clip_grad_norm_(inf) only measures: an unscale_
    after it is not the clip-then-unscale mistake (before: refused with AMP_AFTER_CLIP). The step
    is bit for bit one without the call."""
    weights = []
    for call in (True, False):
        model, opt = _branchy_adamw()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        opt.zero_grad()
        scaler.scale(_branchy_loss(model, 0)).backward()
        if call:
            opt.clip_grad_value_(math.inf)
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        weights.append(_params(model))
    assert compare(weights[0], weights[1])["bit_identical"]


def test_clip_grad_value_that_clamps_nothing_keeps_the_early_work(one_rank, monkeypatch):
    """The early work of the step (overlap_step's updates, prefetched gathers) is dropped only when
    some rank had an element over clip_value (a flag in the norm's all-gather): a clamp that changes
    nothing keeps it and the check's norm, and steps bit for bit as no call (before: dropped
    whenever the norm was finite)."""
    from canzona.runtime.executor import MatrixStep

    dropped = []
    discard = MatrixStep.discard
    monkeypatch.setattr(MatrixStep, "discard", lambda self: (dropped.append(1), discard(self))[1])
    weights = []
    for value in (1e9, None, 1e-4):
        model, opt = _branchy_adamw()
        opt.zero_grad()
        _branchy_loss(model, 0).backward()
        if value is not None:
            dropped.clear()
            opt.clip_grad_value_(value)
            assert bool(dropped) == (value < 1), value
        opt.step()
        weights.append(_params(model))
    assert compare(weights[0], weights[1])["bit_identical"]
    assert not compare(weights[2], weights[1])["bit_identical"]


def test_clip_grad_value_that_clamps_nothing_keeps_overlap_steps_matrix_updates(one_rank):
    """The same under Muon with overlap_step, where there is early work to keep: a clamp that
    changes nothing commits the matrices' updates computed at the check (`overlapped_steps` counts
    them) and steps bit for bit as no call; one that clamps drops them and runs the plain step."""
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters
    from canzona.spec import ModelSpec

    weights, overlapped = [], []
    for value in (1e9, None, 1e-4):
        torch.manual_seed(0)
        model = _Branchy()
        opt = DistributedOptimizer(list(named_parameters(model)), ModelSpec.from_module(model), "muon",
                                   overlap_step=True)
        for k in (0, 1):
            opt.zero_grad()
            _branchy_loss(model, k).backward()
            if value is not None:
                opt.clip_grad_value_(value)
            opt.step()
        weights.append(_params(model))
        overlapped.append(opt.overlapped_steps)
    assert compare(weights[0], weights[1])["bit_identical"]
    assert overlapped[0] == overlapped[1] > 0 and overlapped[2] == 0, overlapped
    assert not compare(weights[2], weights[1])["bit_identical"]


@pytest.mark.parametrize("call", ["clip_grad_value_", "clip_grad_norm_"])
@pytest.mark.parametrize("bad", [0, -1.0, math.nan, "0.1"])
def test_a_bad_clip_threshold_agreed_on_every_rank_is_one_spec_error_nothing_updated(one_rank, call, bad):
    """A threshold that is not a positive number goes through the step check's agreement (a bad one
    on one rank alone is its disagreement: the 'clip disagreement value bad' run), then is refused
    on every rank; step() was not run, so nothing is updated (before: raised before the check, on
    the bad rank alone, its peers left waiting in the check's collective)."""
    model, opt = _branchy_adamw()
    before = _params(model)
    opt.zero_grad()
    _branchy_loss(model, 0).backward()
    with pytest.raises(SpecError, match=r"must be a positive number"):
        getattr(opt, call)(bad)
    assert compare(_params(model), before)["bit_identical"]


@pytest.mark.parametrize("zero", list(RECOVERIES))
def test_a_write_to_the_last_steps_gradient_then_zero_grad_steps_as_torch(one_rank, zero):
    """After step(), `fill_(1)` on a gradient (consumed: the buffers hold the last step's), then any
    zero_grad() and a backward: the step goes on as torch's, bit for bit a run without the write.
    Before this session's recording of in-place writes: refused after model.zero_grad() ('after
    step() the gradient ... is not readable as .grad (fill_.Scalar)')."""
    (model, opt), (reference, ropt) = _branchy_adamw(), _branchy_adamw()
    _sound_step(model, opt, 0)
    model.a.weight.grad.fill_(1.0)
    RECOVERIES[zero](model, opt)
    _branchy_loss(model, 1).backward()
    opt.step()
    _sound_step(reference, ropt, 0)
    _sound_step(reference, ropt, 1)
    assert compare(_params(model), _params(reference))["bit_identical"]


@pytest.mark.parametrize("how", ["register_hook edits .grad", "post hook after adds", "post hook after scales",
                                 "reentrant checkpoint"])
def test_a_gradient_edited_inside_backward_is_refused_at_the_step_naming_its_cause(one_rank, how):
    """Inside backward: a `p.register_hook(fn)` whose fn edits `.grad` in place (the optimizer's guard
    after zero_grad(set_to_none=False)), a post-accumulate-grad hook registered after the optimizer
    that adds into or scales `.grad`, or a parameter used by two re-entrant checkpoint segments (a
    second accumulation in the same backward): recorded, and step() refuses it naming that cause and
    what to do, nothing updated; opt.zero_grad() and a sound step then go on. Before: the pre-hook's
    edit raised inside backward on that rank alone, naming register_post_accumulate_grad_hook; the
    post hook's add_ and the checkpoint's second accumulation were named 'gradients were synchronised
    twice in one step: wrap ... in no_sync()', a loop that never accumulated."""
    (model, opt), (reference, ropt) = _branchy_adamw(), _branchy_adamw()
    _sound_step(model, opt, 0)
    weight = model.a.weight
    opt.zero_grad(set_to_none=how != "register_hook edits .grad")
    handle = weight.register_hook(_edits_grad(weight)) if how == "register_hook edits .grad" else \
        weight.register_post_accumulate_grad_hook(_adds_into_grad) if how == "post hook after adds" else \
        weight.register_post_accumulate_grad_hook(_scales_grad) if how == "post hook after scales" else None
    loss = _branchy_loss(model, 1)
    if how == "reentrant checkpoint":
        loss = loss + _two_reentrant_segments(weight)
    loss.backward()
    if handle is not None:
        handle.remove()
    before = _params(model)
    with pytest.raises(CanzonaError) as refused:
        opt.step()
    said = str(refused.value)
    assert "\n" not in said and "'a.weight'" in said and "synchronised twice" not in said, said
    assert {"register_hook edits .grad": "inside backward before autograd accumulated into it",
            "post hook after adds": "after the optimizer took it into its buffers",
            "post hook after scales": "after the optimizer took it into its buffers",
            "reentrant checkpoint": "use_reentrant=False"}[how] in said, said
    assert compare(_params(model), before)["bit_identical"]
    _sound_step(model, opt, 2)
    _assert_trained_as_the_run_that_skipped_batch_1(model, reference, ropt)


@pytest.mark.parametrize("recover", list(RECOVERIES))
def test_after_a_step_refused_as_broken_a_zero_grad_and_a_backward_go_on_as_after_a_step(one_rank, recover):
    """A backward after step() without zero_grad() (STALE_GRADIENTS) refuses the step; step() again
    with no backward names that refused step (not 'already applied'); then `recover` and a backward:
    the step goes on, the weights bit for bit those of a run without the refused step. Before: after
    model.zero_grad() (either setting) every later step repeated STALE_GRADIENTS, whose line advises
    model.zero_grad()."""
    from canzona.errors import CanzonaError
    (model, opt), (reference, ropt) = _branchy_adamw(), _branchy_adamw()
    _sound_step(model, opt, 0)
    _branchy_loss(model, 1).backward()  # no zero_grad() since the step
    with pytest.raises(CanzonaError, match="^backward would accumulate the gradient of .* onto the last step's"):
        opt.step()
    with pytest.raises(CanzonaError) as again:
        opt.step()
    assert str(again.value).startswith("step() was called again with no backward since the last step() was "
                                       "refused (backward would accumulate the gradient of "), again.value
    RECOVERIES[recover](model, opt)
    _branchy_loss(model, 2).backward()
    opt.step()
    _assert_trained_as_the_run_that_skipped_batch_1(model, reference, ropt)


def test_after_a_step_refused_as_dropped_mid_step_a_backward_without_zero_grad_is_refused(one_rank):
    """backward; model.zero_grad(); backward; step() is refused (DROPPED_MID_STEP, broken): step()
    again names that refusal, the same line however often (not nested); a backward with no
    zero_grad() since is STALE_GRADIENTS, nothing updated; model.zero_grad() and a backward then
    train as a run without the refused step, bit for bit. Before: the refused step's `.grad` stayed
    plain tensors, so that backward added onto them and step() applied the sum silently; each
    step() again nested 'step() was called again ... (step() was called again ... (...))'."""
    from canzona.errors import CanzonaError
    (model, opt), (reference, ropt) = _branchy_adamw(), _branchy_adamw()
    _sound_step(model, opt, 0)
    opt.zero_grad()
    _branchy_loss(model, 1).backward()
    model.zero_grad()
    _branchy_loss(model, 2).backward()
    with pytest.raises(CanzonaError, match="was set to None .* and a backward wrote a new one") as refused:
        opt.step()
    again = "step() was called again with no backward since the last step() was refused ("
    for _ in range(2):
        with pytest.raises(CanzonaError) as e:
            opt.step()
        assert str(e.value).startswith(again + str(refused.value) + "): "), e.value
    before = _params(model)
    _branchy_loss(model, 3).backward()  # no zero_grad() since the refused step
    with pytest.raises(CanzonaError, match="^backward would accumulate the gradient of .* onto the last step's"):
        opt.step()
    assert compare(_params(model), before)["bit_identical"]
    model.zero_grad()
    _branchy_loss(model, 4).backward()
    opt.step()
    _sound_step(reference, ropt, 0)
    _sound_step(reference, ropt, 4)
    assert compare(_params(model), _params(reference))["bit_identical"]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_model_zero_grad_after_a_step_refused_and_kept_drops_that_step(one_rank, set_to_none):
    """A step() refused without being broken (a NaN gradient norm, nonfinite='raise') keeps its
    reduced gradients for a retry; model.zero_grad() (either setting) then ends that step, as
    optimizer.zero_grad() does: the next backward and step() train as a run that skipped that
    batch, bit for bit. Before: refused again, 'was set to None after this step's gradients went to
    the reduction' / 'cannot be zeroed in place'."""
    from canzona.errors import CanzonaError
    (model, opt), (reference, ropt) = _branchy_adamw(), _branchy_adamw()
    _sound_step(model, opt, 0)
    for k in (1, 3):
        model.zero_grad(set_to_none=set_to_none)
        (_branchy_loss(model, k) * math.nan).backward()
        with pytest.raises(CanzonaError, match="global gradient norm is nan"):
            opt.step()
        model.zero_grad(set_to_none=set_to_none)
        _branchy_loss(model, k + 1).backward()
        opt.step()
    for k in (0, 2, 4):
        _sound_step(reference, ropt, k)
    assert compare(_params(model), _params(reference))["bit_identical"]


def test_a_no_sync_backward_after_the_synchronising_one_leaves_the_gradients_under_their_reduction(one_rank):
    """A synchronising backward, then a backward under no_sync() (accumulation in the wrong order),
    then another: the no_sync() one is recorded as a second synchronisation (not taken) and its
    gradients stay `REDUCING`, so the next backward's accumulation is not written into buffers
    under their collective either; step() refuses with SYNCED_TWICE, nothing updated, and
    opt.zero_grad() lets the loop go on. Before the record (this session): that backward raised;
    with the record alone, the gradients turned `ACCUMULATING` and the next backward added into
    the launched buckets' buffers."""
    from canzona.runtime.grad_guard import GradState

    model = build_model(BASE)
    opt = _optimizer(model)
    tokens = _batches(0, 1)[0]
    model.loss(tokens).backward()
    with opt.no_sync():
        model.loss(tokens).backward()
    assert {opt.grads.guard_state(n) for n in opt.grads.params} == {GradState.REDUCING}
    held = [b.grad.clone() for b in opt.grads.buckets]
    model.loss(tokens).backward()
    assert all(torch.equal(b.grad, h) for b, h in zip(opt.grads.buckets, held))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CanzonaError, match="gradients were synchronised twice in one step"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    opt.zero_grad()
    model.loss(tokens).backward()
    opt.step()


@pytest.mark.parametrize("second", ["none", "another parameter"])
def test_a_gradient_left_from_the_last_step_names_whether_a_backward_ran(one_rank, second):
    """No zero_grad() after a step whose backward reached one parameter: step() again with no
    backward is STEPPED_TWICE ('called again with no backward'); with a backward that reached only
    another parameter (whose gradient was None), the left gradient is refused with a line that says
    that backward did not reach it. Before: both said no backward had run. Both come from the step's
    check, which every rank runs together, not from taking the gradients in before a bucket's launch
    (`_take_all`: one rank raising there, its loop having skipped a backward and zero_grad(), left
    its peers waiting in the collective); nothing is updated."""
    from canzona.errors import CanzonaError

    model = build_model(BASE)
    opt = _optimizer(model, overlap_param_gather=False)  # the parameters read outside a forward
    params = list(opt.params.values())
    first, last = params[0], params[-1]
    first.pow(2).sum().backward()
    opt.step()
    if second == "another parameter":
        last.pow(2).sum().backward()
    before = [p.detach().clone() for p in params]
    with pytest.raises(CanzonaError) as refused:
        opt.step()
    assert not any(entry.name == "_take_all" for entry in refused.traceback)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    said = str(refused.value)
    name = next(n for n, p in opt.params.items() if p is first)
    if second == "none":
        assert said.startswith(f"step() was called again with no backward since the last step(): the gradient of "
                               f"{name!r}"), said
    else:
        assert said == (f"the gradient of {name!r} is still the last step's, already applied: this step's backward "
                        "did not reach it and no zero_grad() cleared it since (torch would apply it again): call "
                        "zero_grad() before each step's backward"), said


@pytest.mark.parametrize("change", ["assigned", "set to None", "dropped, then a backward"])
def test_a_stack_spanning_buckets_changed_after_its_first_bucket_launched_is_refused(one_rank, change):
    """A stacked parameter whose matrices span two buckets (tiny-moe, 1536-element buckets: layer
    1's down_proj lies in buckets 0 and 1, bucket 1 shared with gate_up_proj). Its backward
    launches bucket 0; then its `.grad` is assigned by hand, set to None, or set to None and
    written anew by a backward (a batch dropped with model.zero_grad() on one rank), and bucket 1
    launches at step(). Before: bucket 1's launch took the new `.grad` in whole, over bucket 0's
    entries under their reduction, or (None) zeroed bucket 1's entries only; assigned or None, the
    step went ahead with a torn gradient, silently. Now the step is refused from its check (on
    every rank together), nothing updated, and the loop goes on after optimizer.zero_grad()."""
    model = build_model(replace(BASE, preset="tiny-moe"))
    opt = _optimizer(model, bucket_size=1536, overlap_param_gather=False)
    name = "model.layers.1.mlp.experts.down_proj"
    stack = opt.params[name]
    assert opt.grads.buckets_of[name] == [0, 1]
    stack.pow(2).sum().backward()
    assert opt.grads._launched[0] is not None and opt.grads._launched[1] is None
    if change == "assigned":
        stack.grad = torch.ones_like(stack)
    else:
        stack.grad = None
        if change == "dropped, then a backward":
            stack.pow(3).sum().backward()
    before = {n: q.detach().clone() for n, q in opt.params.items()}
    with pytest.raises(CanzonaError) as refused:
        opt.step()
    assert all(torch.equal(q, before[n]) for n, q in opt.params.items())
    said = str(refused.value)
    assert f"the gradient of {name!r}" in said and "\n" not in said, said
    opt.zero_grad()  # what the error says: the loop goes on
    stack.pow(2).sum().backward()
    opt.step()
    assert not torch.equal(stack.detach(), before[name])


def test_a_gradient_dropped_between_the_clip_and_the_step_is_the_rechecks_error(one_rank):
    """clip_grad_norm_(), then `.grad = None` on one parameter, then step(): the step reuses the
    clip's check, and its recheck carries the rank's local problem, so the drop is the same error
    a full check gives (one line, nothing updated), not a step that applies the gradient the
    buffers still hold (torch skips a parameter whose .grad is None). Before: the parameter was
    updated from the reduced gradient, silently."""
    from canzona.errors import CanzonaError

    model = build_model(BASE)
    opt = _optimizer(model)
    model.loss(_batches(0, 1)[0]).backward()
    opt.clip_grad_norm_(1.0)
    name, p = next((n, p) for n, p in opt.params.items() if p.dim() == 2 and "embed" not in n)
    before = {n: q.detach().clone() for n, q in opt.params.items()}
    p.grad = None
    with pytest.raises(CanzonaError) as refused:
        opt.step()
    assert str(refused.value).startswith(f"the gradient of {name!r} was dropped (zero_grad() or .grad = None) "
                                         "between backward and step()"), str(refused.value)
    assert all(torch.equal(q, before[n]) for n, q in opt.params.items())


def test_torch_clip_after_the_optimizers_clip_is_refused_before_it_changes_a_gradient(one_rank):
    """opt.clip_grad_norm_(), then torch's own clip_grad_norm_ on the same gradients (the FSDP2
    path's in-place edit its version counters miss): on the ZeRO-1 path `.grad` is still a guard,
    so torch's clip is one CanzonaError before any gradient changes, and the next clip returns
    what the first left (the clipped norm), not a norm of gradients edited behind its back."""
    from canzona.errors import CanzonaError

    model = build_model(BASE)
    opt = _optimizer(model)
    model.loss(_batches(0, 1)[0]).backward()
    first = float(opt.clip_grad_norm_(0.05))
    with pytest.raises(CanzonaError) as refused:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    assert "nothing may read or change .grad between backward and step" in str(refused.value), str(refused.value)
    assert first > 0.05 and float(opt.clip_grad_norm_(0.05)) == pytest.approx(0.05, rel=1e-5)


@pytest.mark.parametrize("damage", ["entry not a dict", "step not a number"])
def test_a_hand_built_state_dict_of_the_wrong_form_is_one_planerror(one_rank, damage):
    """Before: a TypeError from deep in the load (`dict()` of a list), or a step count of two
    elements loaded as it was; now one PlanError line, before anything is loaded."""
    from canzona.errors import PlanError

    model = build_model(BASE)
    opt = _optimizer(model)
    _train(model, opt, _batches(0, 1)[:1])
    saved = opt.state_dict()
    entry = next(k for k, e in saved["state"].items() if "step" in e)
    if damage == "entry not a dict":
        saved["state"][entry] = [v for v in saved["state"][entry].values()]
    else:
        saved["state"][entry]["step"] = torch.zeros(2)
    before = opt.state_dict()
    with pytest.raises(PlanError) as refused:
        opt.load_state_dict(saved)
    assert "\n" not in str(refused.value) and _nested_equal(opt.state_dict(), before), str(refused.value)


@pytest.mark.parametrize("optimizer", ["soap", "shampoo", "muon"])
def test_a_step_inside_the_loops_autocast_region_steps_as_outside_it(one_rank, optimizer):
    """`with torch.autocast(...):` around forward, backward and step(), as many loops write it: the
    step's own arithmetic is not the model's to cast. Before: SOAP and Shampoo failed inside their
    first step() with torch's dtype errors ('expected m1 and m2 to have the same dtype'), no weight
    changed but one or two matrices' state already initialised."""
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters

    spec = replace(BASE, optimizer=optimizer)

    def train(inside: bool) -> dict:
        model = build_model(spec)
        opt = DistributedOptimizer(list(named_parameters(model)), model.spec(), optimizer)
        for tokens in _batches(0, 1, spec)[:2]:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model.loss(tokens).backward()
                if inside:
                    opt.step()
            if not inside:
                opt.step()
        return _params(model)
    assert compare(train(True), train(False))["bit_identical"]


def test_a_compiled_step_runs_eagerly_as_the_step(one_rank):
    """`torch.compile(opt.step)` (torch's recipe for compiling an optimizer): canzona's step is
    collectives and host logic, so dynamo runs it eagerly (its Newton-Schulz compiles with
    compile_kernels=True). Before: dynamo's InternalTorchDynamoError tracing param_groups."""
    def train(compiled: bool) -> dict:
        model = build_model(BASE)
        opt = _optimizer(model)
        step = torch.compile(opt.step, backend="eager") if compiled else opt.step
        for tokens in _batches(0, 1)[:2]:
            opt.zero_grad()
            model.loss(tokens).backward()
            step()
        return _params(model)
    assert compare(train(True), train(False))["bit_identical"]


# --- torch.compile(model) with the gathers in flight; the optimizer pickled; model.share_memory() --


# aot_eager and the in-place step are slow (make test-all): the eager compiles before the gathers and
# per block make the same check at a third of the time (CI time)
@pytest.mark.parametrize("backend, when", [("eager", "before"),
                                           pytest.param("aot_eager", "after", marks=pytest.mark.slow),
                                           pytest.param("eager", "in place", marks=pytest.mark.slow),
                                           ("eager", "blocks")])
def test_a_model_compiled_without_fullgraph_trains_as_the_eager_one_with_the_gathers_in_flight(one_rank, backend,
                                                                                             when):
    """`model = torch.compile(model)` (before or after the optimizer is built, `model.compile()`, or
    each block's `compile()` as torchtitan does),
    trained and evaluated under `no_grad` with overlap_param_gather (the default): two graphs at most
    (the eval forward's grad mode), no graph break, and each loss and weight the eager loop's. Before: dynamo's
    SpeculationLogDivergence in the second forward, tracing the model's `self.dtype` (a read of a
    parameter still marked pending) ahead of a module's wait, which broke the graph."""
    from torch._dynamo.utils import counters

    spec = replace(BASE, steps=4)

    def train(compiled: bool) -> dict:
        model = build_model(spec)
        forward = torch.compile(model, backend=backend) if compiled and when == "before" else model
        opt = _optimizer(model)
        if compiled and when == "after":
            forward = torch.compile(model, backend=backend)
        elif compiled and when == "blocks":  # before: 6 graph breaks, 5 graphs
            for block in model.model.layers:
                block.compile(backend=backend)
        elif compiled:
            model.compile(backend=backend)

        def loss(tokens: torch.Tensor) -> torch.Tensor:
            logits = forward(tokens[:, :-1])
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        losses = []
        for tokens in _batches(0, 1, spec):
            opt.zero_grad()
            losses.append(loss(tokens))
            losses[-1].backward()
            opt.step()
            with torch.no_grad():
                losses.append(loss(tokens))
        return {"overlap": opt.overlap_param_gather, "losses": [float(x.detach()) for x in losses], "params": _params(model)}
    torch.compiler.reset()
    counters.clear()
    try:
        compiled = train(True)
        breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    finally:
        torch.compiler.reset()
    eager = train(False)
    assert compiled["overlap"] and eager["overlap"]
    assert compiled["losses"] == eager["losses"]
    assert compare(compiled["params"], eager["params"])["bit_identical"]
    # the first forward (nothing in flight) and the later ones (every gather landed before them)
    assert breaks == 0 and graphs <= 2, (breaks, graphs)


@pytest.mark.parametrize("dynamic", [False, pytest.param(True, marks=pytest.mark.slow)])  # dynamic: make test-all
def test_a_compiled_model_accumulating_under_no_sync_trains_as_the_eager_one(one_rank, dynamic):
    """Two forwards of a compiled model (the first under `no_sync()`) before one step, the step's
    gathers in flight at the next step's first forward: each weight the eager loop's, bit for bit."""
    def train(compiled: bool) -> dict:
        model = build_model(BASE)
        opt = _optimizer(model)
        forward = torch.compile(model, backend="eager", dynamic=dynamic) if compiled else model

        def backward(tokens: torch.Tensor) -> None:
            logits = forward(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        for tokens in _batches(0, 1):
            opt.zero_grad()
            half = tokens.shape[0] // 2
            with opt.no_sync():
                backward(tokens[:half])
            backward(tokens[half:])
            opt.step()
        return _params(model)
    torch.compiler.reset()
    try:
        compiled = train(True)
    finally:
        torch.compiler.reset()
    assert compare(compiled, train(False))["bit_identical"]


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "copy", "torch.save", "torch.save nested"])
def test_pickling_or_copying_the_optimizer_is_one_checkpointerror_naming_state_dict(one_rank, tmp_path, how):
    """`torch.save(optimizer, path)`, `pickle.dumps(optimizer)`, `copy.deepcopy(optimizer)`: its
    state lives in flat buffers shared with the model's hooks and its process group, which no
    pickle of the object carries. Before: each succeeded silently (a 366 kB file that loads as an
    optimizer no rank can step)."""
    import copy
    import pickle

    from canzona.errors import CheckpointError

    model = build_model(BASE)
    opt = _optimizer(model)
    _train(model, opt, _batches(0, 1)[:1])
    path = tmp_path / "opt.pt"
    act = {"pickle": lambda: pickle.dumps(opt), "deepcopy": lambda: copy.deepcopy(opt),
           "copy": lambda: copy.copy(opt), "torch.save": lambda: torch.save(opt, path),
           # the optimizer inside the user's checkpoint dict, beside the model's weights
           "torch.save nested": lambda: torch.save({"model": model.state_dict(), "opt": opt}, path)}[how]
    with pytest.raises(CheckpointError) as refused:
        act()
    message = str(refused.value)
    assert "state_dict()" in message and "\n" not in message, message
    assert not path.exists()  # torch.save left no partial file behind
    _train(model, opt, _batches(0, 1)[1:2])  # the optimizer still steps


def _file_objects(tmp_path) -> dict:
    """Each kind of file object a user hands torch.save, already holding the user's own first bytes:
    {kind: (the object, what reads back all that reached its destination)}."""
    import io
    import os

    tmp_path.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    opened = open(tmp_path / "user.pt", "wb")  # noqa: SIM115 - closed by the reader
    read_fd, write_fd = os.pipe()  # not seekable: no truncating back
    pipe = os.fdopen(write_fd, "wb")

    def read_file() -> bytes:
        opened.close()
        return (tmp_path / "user.pt").read_bytes()

    def read_pipe() -> bytes:
        pipe.close()
        with os.fdopen(read_fd, "rb") as reader:
            return reader.read()

    objects = {"BytesIO": (buffer, buffer.getvalue), "file": (opened, read_file), "pipe": (pipe, read_pipe)}
    for target, _ in objects.values():
        target.write(b"mine:")
    return objects


def saved_into_file_objects(opt, tmp_path) -> dict:
    """torch.save(opt, f) into each kind of file object (the optimizer alone and in a dict): the
    error, and every byte that reached f (the user's before it, and after it a write of theirs)."""
    out = {}
    for nested in (False, True):
        for kind, (target, read) in _file_objects(tmp_path).items():
            obj = {"opt": opt, "t": torch.ones(2)} if nested else opt
            error = _outcome(functools.partial(torch.save, obj, target))
            target.write(b":after")
            out[f"{kind}{' nested' if nested else ''}"] = {"error": error, "bytes": read()}
    return out


def test_torch_save_of_the_optimizer_into_a_file_object_writes_nothing(one_rank, tmp_path):
    """`torch.save(opt, f)` with a file object the caller opened (io.BytesIO, a file, a pipe), the
    optimizer alone or in a dict: the CheckpointError, and not a byte of torch's in f: what the user
    wrote before and after is all it holds, the object still writes. Before: torch's zip directory
    (674 bytes, a partial archive) stayed in it."""
    model = build_model(BASE)
    opt = _optimizer(model)
    for kind, got in saved_into_file_objects(opt, tmp_path).items():
        assert got["error"]["error"] == "CheckpointError" and "state_dict()" in got["error"]["message"], (kind, got)
        assert got["bytes"] == b"mine::after", (kind, got["bytes"][:80])


def shared_memory_job(rank: int, world: int) -> dict:
    """`model.share_memory()` between step() and zero_grad() (a guard in every `.grad`), then the
    loop goes on; what a guard says of its memory."""
    model = build_model(BASE)
    opt = _optimizer(model)
    seen: dict = {}
    for i, tokens in enumerate(_batches(rank, world)):
        opt.zero_grad()
        model.loss(tokens).backward()
        opt.step()
        if i == 0:
            grad = next(iter(model.parameters())).grad
            seen["guard"] = type(grad).__name__
            seen["guard returned"] = grad.share_memory_() is grad
            model.share_memory()
            seen["params shared"] = all(p.is_shared() for p in model.parameters())
            seen["grads shared"] = [p.grad.is_shared() for p in model.parameters() if p.grad is not None]
            seen["storage"] = _outcome(grad._typed_storage)
    return {**seen, "params": _params(model)}


def test_model_share_memory_between_step_and_zero_grad_trains_as_torch(one_rank):
    """Before: a segfault (`share_memory_()` of a guard's `.grad`: a storage with no memory)."""
    out = run_ranks(shared_memory_job, 1, deadline_s=DEADLINE_S)[0]
    assert out["guard"] == "GradGuard" and out["guard returned"] and out["params shared"]
    # the gradient's memory is the optimizer's buffer, which share_memory() does not move
    assert out["grads shared"] and not any(out["grads shared"])
    assert out["storage"]["error"] == "CanzonaError" and "\n" not in out["storage"]["message"], out["storage"]
    assert compare(out["params"], emulate(BASE, 1))["bit_identical"]


def fsdp_pickled_job(rank: int, world: int, path: str) -> dict:
    """Under FSDP2 (the matrix optimizer): the optimizer saved or copied as an object after a step.
    (`model.share_memory()` is not tried: torch's own `share_memory_()` of an FSDP2 model's DTensor
    parameters, a storage without memory, segfaults, optimizer or not.)"""
    import copy
    import os
    import pathlib

    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters

    spec = replace(BASE, optimizer="muon")
    model = build_model(spec)
    model_spec = _shard(model, True)
    opt = DistributedOptimizer(list(named_parameters(model)), model_spec, "muon")
    _train(model, opt, _batches(rank, world, spec)[:1])
    target = f"{path}-fsdp-opt-{rank}.pt"
    return {"layout": type(opt).__name__, "torch.save": _outcome(lambda: torch.save(opt, target)),
            "left behind": os.path.exists(target), "deepcopy": _outcome(lambda: copy.deepcopy(opt)),
            "file objects": saved_into_file_objects(opt, pathlib.Path(f"{path}-objects-{rank}"))}


def test_under_fsdp2_the_optimizer_object_is_not_pickled_either(tmp_path):
    for out in run_ranks(fsdp_pickled_job, DP, str(tmp_path / "ckpt"), deadline_s=DEADLINE_S):
        assert out["layout"] == "FsdpOptimizer"
        for how in ("torch.save", "deepcopy"):
            assert out[how]["error"] == "CheckpointError" and "state_dict()" in out[how]["message"], out[how]
        assert not out["left behind"]
        for kind, got in out["file objects"].items():  # nothing of torch's in the caller's file objects
            assert got["error"]["error"] == "CheckpointError" and got["bytes"] == b"mine::after", (kind, got)


def _scaled_run(model, opt, refuse: str | None, bad: int = 3, steps: int = 7, wrap=None) -> list[tuple[float, int]]:
    """GradScaler's loop (scale 16, growth every 2 steps) over `_Branchy`'s batches, `refuse` at step
    `bad`: "nan" (a NaN loss: torch's skipped step), "zeroed in place" (model.zero_grad(set_to_none=False)
    between unscale_ and scaler.step: a broken step), "lr" / "lr, step alone" (a NaN learning rate set
    after unscale_ / with no unscale_: refused by step(), the gradients kept), "lr, retried" / "lr, step
    alone, retried" (the lr put back and scaler.step called again: taken). `wrap`: GradScaler handed
    `wrap(opt)` in its place. The (scale, growth tracker) after each update()."""
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=2)
    given = opt if wrap is None else wrap(opt)
    out = []
    for k in range(steps):
        opt.zero_grad()
        loss = _branchy_loss(model, k)
        scaler.scale(loss * math.nan if k == bad and refuse == "nan" else loss).backward()
        if not (k == bad and refuse is not None and refuse.startswith("lr, step alone")):
            scaler.unscale_(given)
        if k == bad and refuse == "zeroed in place":
            model.zero_grad(set_to_none=False)
        if k == bad and refuse is not None and refuse.startswith("lr"):
            opt.param_groups[0]["lr"] = math.nan
        try:
            scaler.step(given)
        except CanzonaError:
            opt.param_groups[0]["lr"] = 1e-3
            if refuse is not None and refuse.endswith("retried"):
                scaler.step(given)
        scaler.update()
        out.append((scaler.get_scale(), int(scaler._growth_tracker)))
    return out


@pytest.mark.parametrize("refuse", ["zeroed in place", "lr", "lr, step alone", "lr, retried"])
def test_a_step_refused_under_grad_scaler_is_a_skipped_step_for_its_update(one_rank, refuse):
    """A step() refused after GradScaler's unscale_ (or inf check), then scaler.update() and the loop
    going on: the scale and its growth tracker after each update() are torch's (torch.optim.AdamW +
    GradScaler) with a NaN loss at that step (skipped: the scale backed off, the growth count
    restarted), and so are the weights, bit for bit; a step() called again once mended and taken is
    counted as taken. Before: the refused step counted as a step taken (16 -> 64, not 16)."""
    model, opt = _branchy_adamw()
    reference = _Branchy()
    ropt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01)
    torch_said = _scaled_run(reference, ropt, None if refuse == "lr, retried" else "nan")
    assert _scaled_run(model, opt, refuse) == torch_said
    assert compare(_params(model), _params(reference))["bit_identical"]


@pytest.mark.parametrize("refuse", ["lr", "lr, step alone", "lr, retried", "lr, step alone, retried"])
def test_a_step_refused_under_grad_scaler_through_a_proxy_is_skipped_or_retried_as_torch(one_rank, refuse):
    """GradScaler handed a user's proxy that does not forward `_step_supports_amp_scaling` (its
    unscale-then-step path: it reads found_inf itself before calling step()): a step() refused
    (a NaN lr) is a skipped step for update(), and called again once the lr is put back it is taken:
    scale, growth tracker and weights bit for bit as torch.optim.AdamW + GradScaler('cpu') with a NaN
    loss there / with no refusal at all. Before: the refusal left found_inf set, so GradScaler skipped
    the step called again without calling it (no weight changed, update() counted a skip)."""
    from tests.runtime.amp_wrappers import Proxy

    model, opt = _branchy_adamw()
    reference = _Branchy()
    ropt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01)
    torch_said = _scaled_run(reference, ropt, None if refuse.endswith("retried") else "nan")
    assert _scaled_run(model, opt, refuse, wrap=Proxy) == torch_said
    assert compare(_params(model), _params(reference))["bit_identical"]


@pytest.mark.parametrize("end", ["model.zero_grad()", "model.zero_grad(set_to_none=False)", "opt.zero_grad()", "none"])
@pytest.mark.parametrize("then", ["backward twice", "zeroed in place", "no_sync after"])
def test_a_step_after_a_kept_step_was_ended_refuses_what_a_fresh_step_refuses(one_rank, end, then):
    """A step refused and kept (a NaN norm), ended by `end` ("none": a fresh step after a sound one),
    then a backward and `then`: a second backward without no_sync(), model.zero_grad(set_to_none=False)
    between backward and step(), or a no_sync() backward after the synchronising one. step() refuses
    each with the line a fresh step gives, nothing updated, and opt.zero_grad() goes on. Before: after
    model.zero_grad() ended the kept step the next backward was taken as under no_sync(), so a second
    one was summed (as DDP would) and the zeroing dropped it, silently."""
    model, opt = _branchy_adamw()
    _sound_step(model, opt, 0)
    if end != "none":
        opt.zero_grad()
        (_branchy_loss(model, 1) * math.nan).backward()
        with pytest.raises(CanzonaError, match="global gradient norm is nan"):
            opt.step()
        {"model.zero_grad()": lambda: model.zero_grad(), "opt.zero_grad()": lambda: opt.zero_grad(),
         "model.zero_grad(set_to_none=False)": lambda: model.zero_grad(set_to_none=False)}[end]()
    else:
        opt.zero_grad()
    _branchy_loss(model, 2).backward()
    if then == "backward twice":
        _branchy_loss(model, 3).backward()
    elif then == "zeroed in place":
        model.zero_grad(set_to_none=False)
    else:
        with opt.no_sync():
            _branchy_loss(model, 3).backward()
    before = _params(model)
    with pytest.raises(CanzonaError) as refused:
        opt.step()
    assert compare(_params(model), before)["bit_identical"]
    said = {"backward twice": "gradients were synchronised twice in one step",
            "zeroed in place": "cannot be zeroed in place (zero_.default: model.zero_grad(set_to_none=False) within",
            "no_sync after": "gradients were synchronised twice in one step"}[then]
    assert said in str(refused.value), refused.value
    opt.zero_grad()
    _branchy_loss(model, 4).backward()
    opt.step()


@pytest.mark.parametrize("lr", [math.nan, -1.0])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_step_refused_for_its_learning_rate_is_kept_and_model_zero_grad_ends_it(one_rank, lr, set_to_none):
    """step() refused by the hyper-parameters' validation (a NaN or negative lr), the lr put back,
    then model.zero_grad() (either setting), the next batch's backward and step(): trained as a run
    that skipped the refused batch, bit for bit, as after a step refused for a NaN norm. Before: the
    refusal came after the check, unmarked as kept: DROPPED_MID_STEP ('was set to None after this
    step's gradients went to the reduction') / 'cannot be zeroed in place'; only opt.zero_grad() went on."""
    (model, opt), (reference, ropt) = _branchy_adamw(), _branchy_adamw()
    for k in (0, 2):
        _sound_step(reference, ropt, k)
    _sound_step(model, opt, 0)
    opt.zero_grad()
    _branchy_loss(model, 1).backward()
    opt.param_groups[0]["lr"] = lr
    before = _params(model)
    with pytest.raises(CanzonaError, match="lr must be"):
        opt.step()
    assert compare(_params(model), before)["bit_identical"]
    opt.param_groups[0]["lr"] = 1e-3
    model.zero_grad(set_to_none=set_to_none)
    _branchy_loss(model, 2).backward()
    opt.step()
    assert compare(_params(model), _params(reference))["bit_identical"]


@pytest.mark.parametrize("clip", ["clip_grad_norm_(0)", "clip_grad_value_(-1)"])
def test_a_bad_clip_threshold_keeps_the_step_and_model_zero_grad_ends_it(one_rank, clip):
    """A threshold every rank passes alike and the check then refuses (SpecError after the agreement)
    keeps the step, as a refused rate does: model.zero_grad(), the next batch's backward and step()
    train as a run that skipped the batch, bit for bit. Before (review): the step was left unmarked,
    so model.zero_grad() then a backward was DROPPED_MID_STEP."""
    (model, opt), (reference, ropt) = _branchy_adamw(), _branchy_adamw()
    for k in (0, 2):
        _sound_step(reference, ropt, k)
    _sound_step(model, opt, 0)
    opt.zero_grad()
    _branchy_loss(model, 1).backward()
    with pytest.raises(SpecError):
        opt.clip_grad_norm_(0) if clip.startswith("clip_grad_norm_") else opt.clip_grad_value_(-1)
    model.zero_grad()
    _branchy_loss(model, 2).backward()
    opt.step()
    assert compare(_params(model), _params(reference))["bit_identical"]


def test_overlap_steps_early_updates_of_a_step_refused_for_its_rate_are_not_committed_later(one_rank):
    """overlap_step: the check before step() (a clip) computes the matrices' updates early with rate L;
    the rate made NaN, step() is refused and kept; model.zero_grad() drops the batch; the next batch's
    check runs with the rate still NaN (no early work), then the rate is put back and step() taken:
    trained as a run that skipped the refused batch, bit for bit. Before (review of the kept lr
    refusal): the first batch's early updates survived the second check and were committed, the
    matrices stepping batch 1 and AdamW batch 2 (max difference 7.9e-4)."""

    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters
    from canzona.spec import ModelSpec

    def make():
        torch.manual_seed(0)
        model = _Branchy()
        return model, DistributedOptimizer(
            list(named_parameters(model)), ModelSpec.from_module(model), "muon", overlap_step=True
        )

    (model, opt), (reference, ropt) = make(), make()
    rate = opt.param_groups[0]["lr"]
    for k in (0, 2):
        ropt.zero_grad()
        _branchy_loss(reference, k).backward()
        ropt.step()
    opt.zero_grad()
    _branchy_loss(model, 0).backward()
    opt.step()
    opt.zero_grad()
    _branchy_loss(model, 1).backward()
    opt.clip_grad_norm_(math.inf)
    for group in opt.param_groups:
        group["lr"] = math.nan
    with pytest.raises(CanzonaError, match="lr must be"):
        opt.step()
    model.zero_grad()
    _branchy_loss(model, 2).backward()
    opt.clip_grad_norm_(math.inf)
    for group in opt.param_groups:
        group["lr"] = rate
    opt.step()
    assert compare(_params(model), _params(reference))["bit_identical"]


@pytest.mark.parametrize("first", ["model.zero_grad(set_to_none=False)", "opt.zero_grad()"])
def test_a_second_zero_grad_after_a_kept_step_was_ended_leaves_it_ended(one_rank, first):
    """A step refused and kept (a NaN norm), ended by `first`, then opt.zero_grad() again: the next
    backward is still reduced at the check (`_deferred`), as every rank that ended the kept step
    reduces it, and the step trains as a run that skipped the refused batch, bit for bit. Before: the
    second zero_grad() forgot it (the backward launched its reductions while a peer that zeroed once
    waited in the check's agreement: a collective timeout, spawned 'kept refusal twice')."""
    (model, opt), (reference, ropt) = _branchy_adamw(), _branchy_adamw()
    for k in (0, 2):
        _sound_step(reference, ropt, k)
    _sound_step(model, opt, 0)
    opt.zero_grad()
    (_branchy_loss(model, 1) * math.nan).backward()
    with pytest.raises(CanzonaError, match="global gradient norm is nan"):
        opt.step()
    (model.zero_grad if first.startswith("model") else opt.zero_grad)(set_to_none=False)
    opt.zero_grad()
    assert opt.grads._deferred
    _branchy_loss(model, 2).backward()
    opt.step()
    assert compare(_params(model), _params(reference))["bit_identical"]


@pytest.mark.parametrize("then", ["backward", "step() again"])
@pytest.mark.parametrize("part", ["set to None", "zeroed in place"])
def test_dropping_part_of_a_kept_step_is_refused_naming_the_part_dropped(one_rank, part, then):
    """A step refused and kept (a NaN norm), then one submodule's zero_grad() (`part`: either
    setting) drops part of its gradients only, then a backward and step(), or step() again: refused
    with KEPT_NOT_DROPPED naming the part dropped and the part still kept, nothing updated; then
    model.zero_grad() and a backward train as a run that skipped the refused batch, bit for bit.
    Before: the backward's line was a fresh step's (SYNCED_TWICE, or STALE_GRADIENTS after
    zero_grad(set_to_none=False) had ended the whole kept step at its first zeroing), step() again
    'was dropped between backward and step()' / 'step() was called again with no backward'."""
    (model, opt), (reference, ropt) = _branchy_adamw(), _branchy_adamw()
    _sound_step(model, opt, 0)
    opt.zero_grad()
    (_branchy_loss(model, 1) * math.nan).backward()
    with pytest.raises(CanzonaError, match="global gradient norm is nan") as kept:
        opt.step()
    model.a.zero_grad(set_to_none=part == "set to None")
    if then == "backward":
        _branchy_loss(model, 2).backward()
    before = _params(model)
    with pytest.raises(CanzonaError) as refused:
        opt.step()
    assert compare(_params(model), before)["bit_identical"]
    said = str(refused.value)
    assert said.startswith(f"the last step() was refused ({kept.value}) and its gradients were kept"), said
    assert "dropped in part only ('a.weight', 'a.bias'" in said and "the rest still kept ('branch.weight'" in said, said
    assert "with model.zero_grad() or optimizer.zero_grad()" in said and "\n" not in said, said
    model.zero_grad()
    _branchy_loss(model, 3).backward()
    opt.step()
    _sound_step(reference, ropt, 0)
    _sound_step(reference, ropt, 3)
    assert compare(_params(model), _params(reference))["bit_identical"]


def test_a_backward_onto_a_kept_step_not_dropped_names_the_kept_step(one_rank):
    """A step refused and kept (a NaN norm), then a backward with no zero_grad() at all: refused
    naming the kept step (KEPT_NOT_DROPPED), not as a second synchronisation (before: SYNCED_TWICE,
    whose advice, no_sync(), is not the mistake); opt.zero_grad() and a step go on."""
    model, opt = _branchy_adamw()
    _sound_step(model, opt, 0)
    opt.zero_grad()
    (_branchy_loss(model, 1) * math.nan).backward()
    with pytest.raises(CanzonaError, match="global gradient norm is nan"):
        opt.step()
    _branchy_loss(model, 2).backward()
    with pytest.raises(CanzonaError) as refused:
        opt.step()
    assert "they were then not dropped (no zero_grad() since) and a backward added to them" in str(refused.value)
    opt.zero_grad()
    _branchy_loss(model, 3).backward()
    opt.step()
