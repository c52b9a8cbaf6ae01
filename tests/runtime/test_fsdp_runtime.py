"""The FSDP2 prototype runtime (`canzona.runtime.fsdp.FsdpOptimizer`, docs/design.md §2.8): the tiny
model under torch's `fully_shard` (per decoder layer and at the root, 1-D mesh over every rank, fp32)
at S = 2 and 3 ranks (uneven row blocks: 32 rows over 3 ranks are 11, 11, 10), Muon with fp32
Newton-Schulz, 3 steps. Every rank's full parameters equal, bit for bit, the same kernels run in one
process on the global gradients the ranks saw (`p.grad.full_tensor()` each step), and are within
1e-5 of the reference optimizers; with `clip_grad_norm_` too. A small module at S = 3 leaves rank 2 an
EMPTY shard of a 2 x 16 matrix and a 2-vector (exact, with and without clipping), and carries the
step check's cases: a NaN in one rank's shard (skipped on every rank, or the same error on every
rank), a gradient missing on one rank or a broken one (every rank fails at once), clip thresholds
that differ between ranks, and a dead peer (a CanzonaError within timeout_s); and torch.amp.GradScaler
at 2**10 (the unscaled run bit for bit, an Inf on one rank skipped on every rank with the scale
halved alike, the clip before the unscale one error)."""

from __future__ import annotations

import functools
import math
import time
import weakref
from typing import Any

import pytest
import torch

from canzona.harness.launch import run_ranks
from canzona.harness.training import (
    TrainSpec,
    build_model,
    clip_,
    compare,
    emulate,
    global_batches,
    micro_batches,
    reference_run,
)
from canzona.runtime.gradients import combine_norm_terms, local_norm_term
from canzona.tp import Capacity

pytestmark = pytest.mark.distributed  # spawns gloo process groups

SPEC = TrainSpec(optimizer="muon", matrix_config={"ns_dtype": "fp32"}, steps=3, global_batch=6)
# SOAP / Shampoo (refresh every 2 steps; SOAP's first step has no update, so nothing is sent back)
SPECS = {
    "muon": SPEC,
    "soap": TrainSpec(optimizer="soap", matrix_config={"precondition_frequency": 2}, steps=3, global_batch=6),
    "shampoo": TrainSpec(optimizer="shampoo", matrix_config={"precondition_frequency": 2}, steps=3, global_batch=6),
    # clip_grad_norm_ before each step, a threshold below every step's norm (so it really clips)
    "muon-clip": TrainSpec(optimizer="muon", matrix_config={"ns_dtype": "fp32"}, steps=3, global_batch=6,
                           clip_norm=0.05),
}


def many_worker(rank: int, world: int, specs: list[TrainSpec]) -> list[dict]:
    return [fsdp_worker(rank, world, spec) for spec in specs]


def fsdp_worker(rank: int, world: int, spec: TrainSpec) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from canzona.runtime import DistributedOptimizer

    model = build_model(spec)
    mspec = model.spec()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = DistributedOptimizer(model.named_parameters(), mspec, spec.optimizer, spec.matrix_config, spec.adamw_config)
    local_rows = {n: p.to_local().shape[0] for n, p in model.named_parameters()}
    vocab = mspec.param("model.embed_tokens.weight").shape[0]
    grads, norms = [], []
    # the clipped run at world 2 steps through torch's recipe for compiling an optimizer (dynamo runs
    # it eagerly; once: importing dynamo costs each spawned group seconds)
    step = torch.compile(opt.step, backend="eager") if spec.clip_norm is not None and world == 2 else opt.step
    for tokens in global_batches(spec, vocab):
        opt.zero_grad()
        (mb,) = micro_batches(tokens, rank, world, 1)
        model.loss(mb).backward()
        named = dict(model.named_parameters())
        grads.append(({n: p.grad.full_tensor() for n, p in named.items()}, set(named)))
        # inside an autocast region, as loops often call them (the forward's dtype is not the step's)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if spec.clip_norm is not None:
                norms.append(float(opt.clip_grad_norm_(spec.clip_norm)))
            step()
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    owned = sorted(opt.matrix_state)
    return {"params": params, "grads": grads, "local_rows": local_rows, "owned": owned, "norms": norms}


@functools.cache
def _run(world: int) -> dict[str, list[dict]]:
    """Every optimizer's run in one spawned group per world size, by optimizer."""
    per_rank = run_ranks(many_worker, world, list(SPECS.values()), deadline_s=240.0)
    return {o: [r[i] for r in per_rank] for i, o in enumerate(SPECS)}


@pytest.mark.parametrize("optimizer", list(SPECS))
@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_owners_exact(world: int, optimizer: str) -> None:
    spec = SPECS[optimizer]
    results = _run(world)[optimizer]
    shapes = {p.name: p.shape for p in build_model(spec).spec().params}
    for rank, r in enumerate(results):  # torch.chunk's row blocks, as chunk_rows says
        for n, rows in r["local_rows"].items():
            start, end = chunk_rows(shapes[n][0], world, rank)
            assert rows == end - start, n
    grads = results[0]["grads"]
    for r in results[1:]:  # every rank saw the same global gradients
        for (a, _), (b, _) in zip(grads, r["grads"]):
            assert all(torch.equal(a[n], b[n]) for n in a)
    want = emulate(spec, world, grads=grads)
    ref = reference_run(spec, world, grads=grads)
    for rank, r in enumerate(results):
        exact = compare(r["params"], want)
        assert exact["bit_identical"], (rank, exact)
        close = compare(r["params"], ref)
        assert close["max_rel_diff"] < 1e-5, (rank, close)
    if spec.clip_norm is not None:  # the norm the ranks agreed on: each rank's shards summed, then the ranks'
        names = [p.name for p in build_model(spec).spec().params]
        for step, (g, _) in enumerate(grads):
            want_norm = fsdp_norm(g, names, world)
            assert want_norm > spec.clip_norm
            assert all(r["norms"][step] == float(torch.tensor(want_norm, dtype=torch.float32)) for r in results)
            assert math.isclose(want_norm, clip_({n: t.clone() for n, t in g.items()}.values(), 1e9), rel_tol=1e-12)
    # the parameters moved, and each matrix's state lives on exactly one rank
    init = {n: p.detach() for n, p in build_model(spec).named_parameters()}
    assert not any(torch.equal(results[0]["params"][n], init[n]) for n in init)
    owned = [n for r in results for n in r["owned"] if "norm" not in n and "embed" not in n]
    assert len(owned) == len(set(owned)) == sum(1 for p in build_model(spec).spec().params if p.uses_matrix_optimizer)


@pytest.mark.parametrize("rows", [0, 1, 4, 7, 16, 30, 32])
@pytest.mark.parametrize("shards", [1, 2, 3, 4, 5])
def test_chunk_rows_is_torch_chunk(rows: int, shards: int) -> None:
    """FSDP2 cuts Shard(0) as torch.chunk does, the last ranks fewer or none (4 rows over 3: 2, 2, 0)."""
    chunks = list(torch.arange(rows).chunk(shards)) if rows else []
    for rank in range(shards):
        start, end = chunk_rows(rows, shards, rank)
        want = chunks[rank].tolist() if rank < len(chunks) else []
        assert list(range(start, end)) == want


def chunk_rows(rows: int, shards: int, rank: int) -> tuple[int, int]:
    """The rows [start, end) of shard `rank` when `torch.chunk` cuts `rows` into `shards`."""
    per = math.ceil(rows / shards) if rows else 0
    start = min(rank * per, rows)
    return start, min(start + per, rows)


def fsdp_norm(grads: dict[str, torch.Tensor], names: list[str], world: int) -> float:
    """The global norm as FsdpOptimizer takes it: each rank's row blocks (spec order) summed in fp64,
    the ranks' sums added in rank order."""
    terms = []
    for rank in range(world):
        segments = []
        for n in names:
            start, end = chunk_rows(grads[n].shape[0], world, rank)
            segments.append(grads[n][start:end].reshape(-1))
        terms.append(local_norm_term(segments))
    return math.sqrt(float(combine_norm_terms(torch.stack(terms))))


# --- a model with EMPTY local shards, the step check, clipping ------------------------------------

SMALL_WORLD = 3
MUON = {"ns_dtype": "fp32"}
OPTIMIZER_CONFIGS = {"muon": MUON, "adamw": None}  # each optimizer's matrix_config in the small runs


class Small(torch.nn.Module):
    """b.weight is 2 x 16 and b.bias 2: at S = 3 rank 2 holds no row of either (torch.chunk: 1, 1, 0)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 16, bias=False)
        self.norm = torch.nn.LayerNorm(16)
        self.b = torch.nn.Linear(16, 2)
        self.c = torch.nn.Linear(2, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(self.norm(self.a(x))))).square().mean()


def small_batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + rank))


def gather_rows(t) -> torch.Tensor:
    """A Shard(0) DTensor whole (DTensor.full_tensor's gloo all-gather fails on an empty shard);
    under HSDP (a 2-D mesh, `small_run`'s `unreduced`: no empty shard) DTensor's own."""
    import torch.distributed as dist

    if t.device_mesh.ndim > 1:  # a copy: full_tensor() of a replicated piece may be that piece itself
        return t.full_tensor().detach().clone()
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, t.to_local().detach().clone())
    return torch.cat(parts)


def small_run(rank: int, world: int, steps: int, *, clip: float | None = None, nonfinite: str = "raise",
              poison: int | None = None, drop: int | None = None, timeout_s: float = 60.0,
              clips: dict[int, float | None] | None = None, plain_grad: int | None = None,
              absent: int | None = None, assign: int | None = None, unsynced: int | None = None,
              cast: bool = False, evaluate: int | None = None, bf16: bool = False,
              retry: int | None = None, again: int | None = None, edit: int | None = None,
              discard: int | None = None, drop_after_clip: int | None = None,
              torch_clip_after_clip: int | None = None, nan_after_clip: int | None = None,
              scaler: str | None = None, max_grad_norm: float | None = None, poison_with: float = math.nan,
              norm_type: float = 2.0, fp16: bool = False, beside: bool = False, zero_model: bool = False,
              wrap: str | None = None, wrap_step: bool = True, optimizer: str = "muon",
              regroup: int | None = None, regroup_rank: int | None = None, unreduced: int | None = None,
              unsynced_after_clip: int | None = None, nan_weight: int | None = None,
              replace: int | None = None, replace_how: str = "attr", kept: str | None = None,
              discarded: int | None = None, offload: bool = False, tensor_betas: bool = False) -> dict:
    """`steps` steps of Small under fully_shard; at step `poison` rank 1 puts a NaN in its shard of
    b.weight's gradient, at step `drop` rank 1 drops b.weight's gradient. Returns the full parameters,
    the global gradients of the steps taken, the norms, the error (and how long it took) if one was raised.
    `clips`: per rank, its own clip threshold (None: no clip_grad_norm_ call); at step `plain_grad`
    rank 1 replaces b.weight's gradient by a plain tensor; rank 2 sleeps through step `absent`
    (a dead peer) and returns; before step `assign` every rank loads a.weight's own values with
    `load_state_dict(strict=False, assign=True)` (FSDP2 then shards the new tensor); step `unsynced`
    zeroes with `set_to_none=False` and runs its backward under `set_requires_gradient_sync(False)`
    (the user forgot to turn it back on for the last micro-batch); `cast`: the model is cast to bf16
    after the optimizer was built, before the first forward; at step `evaluate` a forward under
    no_grad runs between backward and step() (FSDP2 keeps the root unsharded after it), and after
    the step a forward's output is compared with the updated weights' (`stale`). `bf16`: the model
    in bf16 from the start (fp32 masters); at step `retry` every rank's learning rate is NaN at its
    first step() (refused), then put back and step() called again (`refused`: the first error); at
    step `again` a second backward (and clip) of the same batch comes before that step() (after the
    refused one, with `retry`); at step `edit` rank 1 halves its learning rate after the clip, before
    step() (`refused`: its error), then puts it back and calls step() again. At step `discard` a
    batch of its own is run and its norm measured (`clip_grad_norm_(inf)`) first, then discarded
    with `model.zero_grad()` (a loss spike a run drops) before the step's own backward. At step
    `drop_after_clip` rank 1 drops b.weight's gradient between the clip and step(). At step
    `torch_clip_after_clip` every rank runs torch's `clip_grad_norm_` (to 0.01, in place: no version
    counter moves) after the clip, then clips again; at step `nan_after_clip` rank 1 multiplies its
    b.weight gradient by NaN with `torch._foreach_mul_` (what torch's clip scales by) after the clip.
    `scaler`: a torch.amp.GradScaler at 2**10 scales each loss and steps (`scaler.step`, `update`;
    `scales`: its scale after each step), after `unscale_` then the clip (`unscale`; its scale grows
    every step), alone (`step`: the clip is `max_grad_norm`'s), or after the clip (`clip-unscale`:
    the clip, then `unscale_`; `clip-step`: the clip, then `scaler.step` alone). `poison_with`: what
    rank 1 writes into its shard at step `poison`; `norm_type`: the clip's (`clip`); `fp16`: the
    model in fp16 from the start (fp32 masters); `beside`: a second optimizer over the same model,
    built after the one stepped and kept alive, never stepped (GradScaler unscales the first);
    `zero_model`: each step begins with `model.zero_grad()`, not the optimizer's. `scaler`
    `unscale-skip`: `unscale_`, the clip, and a step whose clip norm is not finite skipped by the
    loop itself (`update` only, no `scaler.step`). `wrap`: the scaler is handed that wrapper of the
    optimizer (tests/runtime/amp_wrappers.py), not the optimizer (`wrap_step=False`: `scaler.step`
    is handed the optimizer itself, as accelerate's step after `scaler.unscale_(accelerated_opt)`).
    `optimizer`: "muon" (Muon's owners) or "adamw" (every parameter elementwise on its own shard).
    At step `regroup` every rank removes the last parameter of the last param group before step()
    (torch.optim would stop stepping it; the optimizer's plan cannot follow), then saves and loads
    the state saved before the edit (`regroup_save`, `regroup_load`: their errors, and how long each
    took); `regroup_rank`: that rank alone edits its groups. `unreduced`: HSDP (every rank a replica,
    a shard group of one), each step a micro-batch under `set_requires_all_reduce(False)` first (HSDP's
    accumulation), and step `unreduced` zeroes with `set_to_none=False` and runs its last backward
    under it too (not turned back on for the last micro-batch). At step `unsynced_after_clip` a
    backward under `set_requires_gradient_sync(False)` comes between the clip and step(). Before step
    `nan_weight`'s forward rank 1 writes a NaN into its shard of b.weight (the weights, not a gradient;
    through `.data`, unseen by the version counters). Before step `replace`'s forward every rank puts
    a new `fully_shard` Linear in `model.a`'s place (a.weight's current values): the old module
    lives on in FSDP2's record of its parameter, no reference of the user's needed. `replace_how`:
    "attr" (`model.a = new`), "backup" (the same while a ModuleList of the user's, made before the
    optimizer, holds the old `model.a`), "insert" (`model._modules["a"] = new`, which registers no module, as
    `ModuleList.insert` and `del` do not: the old a.weight gets no gradient), "swap" (no new module:
    `model.a` and `model.c` swapped after that step's backward, swapped back after the step). `kept`:
    every step zeroes the gradients in place, "opt" (`opt.zero_grad(set_to_none=False)`) or "model"
    (`model.zero_grad(set_to_none=False)`): a gradient no backward reached stays a zero tensor. At
    step `discarded` a batch's backward runs first, discarded by that step's zeroing (no step).
    `offload`: FSDP2's CPU offload (`CPUOffloadPolicy(pin_memory=False)`), the replacement's too;
    `hooks`: the post-accumulate-grad hooks on each parameter after the optimizer's construction."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from canzona.errors import CanzonaError
    from canzona.runtime import DistributedOptimizer
    from tests.runtime.amp_wrappers import WRAPPERS

    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}

    model = Small().to(torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32)
    mspec = small_spec()
    mesh = init_device_mesh("cpu", (world,)) if unreduced is None else \
        init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    fully_shard(model, mesh=mesh, **policy)
    backup = torch.nn.ModuleList([model.a]) if replace_how == "backup" else None  # noqa: F841
    opt = DistributedOptimizer(model.named_parameters(), mspec, optimizer, OPTIMIZER_CONFIGS[optimizer],
                               timeout_s=timeout_s, nonfinite=nonfinite, max_grad_norm=max_grad_norm)
    if tensor_betas:  # one-element tensors, as torch.optim.AdamW takes them
        for g in opt.param_groups:
            g["betas"] = TENSOR_BETAS()
    hooks = {n: len(p._post_accumulate_grad_hooks or {}) for n, p in model.named_parameters()}
    unstepped = DistributedOptimizer(model.named_parameters(), mspec, "muon", MUON) if beside else None  # noqa: F841
    amp = None if scaler is None else torch.amp.GradScaler("cpu", init_scale=2.0 ** 10,
                                                           growth_interval=1 if scaler == "unscale" else 2000)
    given = opt if wrap is None else WRAPPERS[wrap](opt)
    refused, scales = None, []
    local_rows = {n: p.to_local().shape[0] for n, p in model.named_parameters()}
    if cast:
        model.to(torch.bfloat16)
    grads, norms, error, took, stale = [], [], None, None, None
    for step in range(steps):
        if step == assign:
            model.load_state_dict({"a.weight": model.a.weight.detach().clone()}, strict=False, assign=True)
        if step == discarded:
            model(small_batch(70 + step, rank)).backward()
        if kept == "model":
            model.zero_grad(set_to_none=False)
        else:
            model.zero_grad() if zero_model else \
                opt.zero_grad(set_to_none=kept is None and step not in (unsynced, unreduced))
        model.set_requires_gradient_sync(step != unsynced)
        if unreduced is not None:  # HSDP's accumulation: a first micro-batch reduce-scattered only
            model.set_requires_all_reduce(False)
            model(small_batch(50 + step, rank)).backward()
            model.set_requires_all_reduce(step != unreduced)
        if step == discard:
            (model(small_batch(99, rank).to(model.a.weight.dtype)).float() * 10).backward()
            norms.append(float(opt.clip_grad_norm_(math.inf)))  # measured only: nothing scaled
            model.zero_grad()
        if step == replace and replace_how != "swap":
            new = torch.nn.Linear(16, 16, bias=False)
            with torch.no_grad():
                new.weight.copy_(gather_rows(model.a.weight))
            fully_shard(new, mesh=mesh, **policy)
            if replace_how == "insert":
                model._modules["a"] = new
            else:
                model.a = new
        if rank == 1 and step == nan_weight:
            # below the version counters, as a faulty kernel or device would (a write of the user's,
            # through the parameter, is a write on one rank only: `WeightVersions`, its own error)
            model.b.weight.to_local().data[0, 0] = math.nan
        loss = model(small_batch(step, rank).to(model.a.weight.dtype)).float()
        (loss if amp is None else amp.scale(loss)).backward()
        named = dict(model.named_parameters())
        if rank == 1 and step == poison:
            with torch.no_grad():
                named["b.weight"].grad.to_local()[0, 0] = poison_with
        full = {n: gather_rows(p.grad) for n, p in named.items() if p.grad is not None}
        if step == replace and replace_how == "swap":
            model.a, model.c = model.c, model.a
        if rank == 1 and step == drop:
            named["b.weight"].grad = None
        if rank == 1 and step == plain_grad:
            named["b.weight"].grad = torch.zeros(named["b.weight"].shape)
        if step == evaluate:
            with torch.no_grad():
                model(small_batch(step, rank))
        if step == regroup:
            regroup_state = opt.state_dict()
            if regroup_rank in (None, rank):
                opt.param_groups[-1]["params"].pop()
        if rank == 2 and step == absent:
            time.sleep(3 * timeout_s)
            break
        start = time.monotonic()
        try:
            threshold = clips.get(rank) if clips is not None else clip
            if scaler in ("unscale", "unscale-skip"):
                amp.unscale_(given)
            if threshold is not None:
                norms.append(float(opt.clip_grad_norm_(threshold, norm_type)))
            if scaler == "unscale-skip" and not math.isfinite(norms[-1]):  # the loop's own skip
                amp.update()
                scales.append(amp.get_scale())
                continue
            if scaler == "clip-unscale":
                amp.unscale_(opt)
            if rank == 1 and step == drop_after_clip:
                named["b.weight"].grad = None
            if step == torch_clip_after_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
                norms.append(float(opt.clip_grad_norm_(threshold)))
            if rank == 1 and step == nan_after_clip:
                torch._foreach_mul_([named["b.weight"].grad], float("nan"))
            if step == retry:
                lrs = [group["lr"] for group in opt.param_groups]
                opt.param_groups[0]["lr"] = float("nan")
                try:
                    opt.step() if amp is None else amp.step(opt)
                except CanzonaError as e:
                    refused = str(e)
                for group, lr in zip(opt.param_groups, lrs):
                    group["lr"] = lr
            if step == edit:
                lr = opt.param_groups[0]["lr"]
                opt.param_groups[0]["lr"] = lr * (0.5 if rank == 1 else 1)
                try:
                    opt.step()
                except CanzonaError as e:
                    refused = str(e)
                opt.param_groups[0]["lr"] = lr
            if step == again:
                model(small_batch(step, rank).to(model.a.weight.dtype)).float().backward()
                if threshold is not None:
                    norms.append(float(opt.clip_grad_norm_(threshold)))
            if step == unsynced_after_clip:
                model.set_requires_gradient_sync(False)
                model(small_batch(60 + step, rank)).backward()
                model.set_requires_gradient_sync(True)
            if amp is None:
                opt.step()
            else:
                amp.step(given if wrap_step else opt)
                amp.update()
                scales.append(amp.get_scale())
        except (CanzonaError, ValueError) as e:  # ValueError: torch's own refusals (GradScaler's fp16 unscale_)
            error, took = str(e), time.monotonic() - start
            break
        if step == replace and replace_how == "swap":
            model.a, model.c = model.c, model.a
        if step != poison:
            grads.append(full)
        if step == evaluate:
            with torch.no_grad():
                fresh = Small()
                fresh.load_state_dict({n: gather_rows(p) for n, p in opt.params.items()})
                x = small_batch(step, rank)
                stale = not torch.allclose(model(x), fresh(x), rtol=0, atol=1e-6)
    if error is not None and step == replace and replace_how == "swap":
        model.a, model.c = model.c, model.a  # back in their places, for the weights' names
    regroup_save = regroup_load = None
    if regroup is not None:  # a save and a load after the edit: the step's error, on every rank
        regroup_save, regroup_load = [], []
        for call, out in ((opt.state_dict, regroup_save), (lambda: opt.load_state_dict(regroup_state), regroup_load)):
            start = time.monotonic()
            try:
                call()
            except CanzonaError as e:
                out += [str(e), time.monotonic() - start]
    others = None
    if scaler == "unscale":  # a DTensor no canzona optimizer steps: unscaled by torch's own handler
        from torch.distributed.tensor import Shard, distribute_tensor

        other = distribute_tensor(torch.ones(world, 2), init_device_mesh("cpu", (world,)), [Shard(0)])
        found = torch.zeros(())
        torch._amp_foreach_non_finite_check_and_unscale_([other], found, torch.full((), 0.5))
        others = (float(other.to_local().sum()), float(found))
    # after a dead peer, no more collectives (the survivors' timed-out all-gather is still on the wire)
    params = {} if absent is not None else {n: gather_rows(p) for n, p in model.named_parameters()}
    return {"params": params, "grads": grads, "norms": norms, "error": error, "took": took, "hooks": hooks,
            "skipped": opt.skipped_steps, "stale": stale, "refused": refused, "regroup_save": regroup_save, "regroup_load": regroup_load, "scales": scales, "others": others, "local_rows": local_rows, "held": held_bytes(opt),
            "owner": dict(opt.owner), "micro_groups": [list(g) for g in opt.micro_groups],
            "log": [(r.step, r.op, r.group, r.name, r.bytes_per_rank)
                    for r in sorted(opt.world.log.records + opt.comm.log.records, key=lambda r: r.seq)]}


def held_bytes(opt) -> dict[str, int]:
    """The bytes `opt`'s rank holds, by the memory model's persistent categories (its parameter
    and gradient shards, masters, states): tests/runtime/test_fsdp_parity.py compares them with
    `canzona.fsdp_plan.fsdp_persistent_memory`."""
    from canzona.harness.training import matrix_state_bytes
    from canzona.runtime.shards import local_tensor

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    params = list(opt.params.values())
    return {"weights": nbytes(local_tensor(p) for p in params),
            "grads": nbytes(local_tensor(p.grad) for p in params if p.grad is not None),
            "master_weights": nbytes(opt.master.values()), "matrix_state": matrix_state_bytes(opt.matrix_state),
            "adamw_state": sum(nbytes(v for v in s.values() if hasattr(v, "numel")) for s in opt.adamw_state.values())}


def TENSOR_BETAS() -> tuple[torch.Tensor, torch.Tensor]:  # noqa: N802 - a constant, made anew
    return torch.tensor(0.9), torch.tensor(0.999)


def small_spec():
    from canzona.spec import ModelSpec

    return ModelSpec.from_module(Small())


SMALL_CASES = {
    "plain": {"steps": 3},
    "clip": {"steps": 3, "clip": 0.05},
    "skip": {"steps": 3, "nonfinite": "skip", "poison": 1},
    # the same after clip_grad_norm_: the look at the weights is inside the clip's check (review)
    "clip-skip": {"steps": 3, "nonfinite": "skip", "poison": 1, "clip": 0.05},
    # NaN weights on rank 1 alone (rank 2 holds no row of b.weight): every rank names them, under skip too
    "nan-weight": {"steps": 2, "nonfinite": "skip", "nan_weight": 1},
    "raise": {"steps": 3, "poison": 1},
    "drop": {"steps": 3, "drop": 1, "timeout_s": 60.0},
    "clip-disagree": {"steps": 2, "clips": {0: 0.05, 1: 0.1, 2: 0.05}},
    "clip-on-one": {"steps": 2, "clips": {0: 0.05}},
    # a bad max_norm on one rank alone, then on every rank: refused after the check, on every rank
    "clip-bad-on-one": {"steps": 2, "clips": {0: 0.0, 1: 1.0, 2: 1.0}},
    "clip-bad-everywhere": {"steps": 2, "clips": {0: -1.0, 1: -1.0, 2: -1.0}},
    "local-problem": {"steps": 2, "plain_grad": 1},
    "assign": {"steps": 3, "assign": 1},
    "replace": {"steps": 3, "replace": 1},
    "replace-backup": {"steps": 3, "replace": 1, "replace_how": "backup"},
    "replace-insert": {"steps": 3, "replace": 1, "replace_how": "insert"},
    "replace-swap": {"steps": 3, "replace": 1, "replace_how": "swap"},
    "replace-insert-zeroed": {"steps": 3, "replace": 1, "replace_how": "insert", "kept": "opt"},
    "replace-insert-model-zeroed": {"steps": 3, "replace": 1, "replace_how": "insert", "kept": "model"},
    "replace-insert-model-discarded": {"steps": 3, "replace": 1, "replace_how": "insert", "kept": "model",
                                       "discarded": 1},
    # under FSDP2's CPU offload, where the optimizer registers no arrival hook
    "offload": {"steps": 3, "offload": True},
    "rebuilt": {"rebuilt": True},
    "offload-model-zeroed": {"steps": 3, "offload": True, "kept": "model"},
    "replace-insert-offload": {"steps": 3, "replace": 1, "replace_how": "insert", "offload": True},
    "replace-insert-model-zeroed-offload": {"steps": 3, "replace": 1, "replace_how": "insert", "kept": "model",
                                            "offload": True},
    "replace-insert-model-discarded-offload": {"steps": 3, "replace": 1, "replace_how": "insert",
                                               "kept": "model", "discarded": 1, "offload": True},
    "unsynced": {"steps": 3, "unsynced": 1},
    "unreduced": {"steps": 3, "unreduced": 1},
    "unsynced-after-clip": {"steps": 3, "clip": 1e9, "unsynced_after_clip": 1},
    "cast": {"steps": 2, "cast": True},
    "regroup": {"steps": 2, "regroup": 1},
    "regroup-one-after-clip": {"steps": 2, "regroup": 1, "regroup_rank": 1, "clip": 0.05, "timeout_s": 8.0},
    "evaluate": {"steps": 3, "evaluate": 1},
    "bf16-clip": {"steps": 3, "clip": 0.05, "bf16": True},
    "bf16-clip-retried": {"steps": 3, "clip": 0.05, "bf16": True, "retry": 1},
    "clip-twice": {"steps": 3, "clip": 0.05, "again": 1},
    "clip-retried-twice": {"steps": 3, "clip": 0.05, "retry": 1, "again": 1},
    "clip-edit-retried": {"steps": 3, "clip": 0.05, "edit": 1},
    "clip-discarded": {"steps": 3, "clip": 0.05, "discard": 1},
    "drop-after-clip": {"steps": 3, "clip": 0.05, "drop_after_clip": 1},
    "bf16-clip-twice": {"steps": 3, "clip": 0.05, "bf16": True, "again": 1},
    # the same after GradScaler's unscale_: opt.clip_grad_norm_ clipped, so the error is the backward's
    "bf16-scaler-clip-twice": {"steps": 3, "clip": 0.05, "bf16": True, "scaler": "unscale", "again": 1},
    "torch-clip-after-clip": {"steps": 3, "clip": 0.05, "torch_clip_after_clip": 1},
    "bf16-torch-clip-after-clip": {"steps": 3, "clip": 0.05, "bf16": True, "torch_clip_after_clip": 1},
    "nan-after-clip": {"steps": 3, "clip": 0.05, "nan_after_clip": 1},
    # torch.amp.GradScaler at 2**10: unscale_, clip, step (fp32; bf16 with fp32 masters); step alone
    # (max_grad_norm clips); an Inf in rank 1's shard through step alone (nonfinite='raise');
    # the clip before the unscale
    "scaler-unscale": {"steps": 3, "clip": 0.05, "scaler": "unscale"},
    "bf16-scaler-unscale": {"steps": 3, "clip": 0.05, "bf16": True, "scaler": "unscale"},
    # the same beside a second optimizer over the model, newer, never stepped
    "scaler-unscale-beside": {"steps": 3, "clip": 0.05, "scaler": "unscale", "beside": True},
    "bf16-scaler-unscale-beside": {"steps": 3, "clip": 0.05, "bf16": True, "scaler": "unscale", "beside": True},
    "bf16-clip-inf": {"steps": 2, "clip": 0.01, "bf16": True, "norm_type": math.inf},
    "bf16-scaler-unscale-inf": {"steps": 2, "clip": 0.01, "bf16": True, "scaler": "unscale", "norm_type": math.inf},
    "scaler-step": {"steps": 3, "max_grad_norm": 0.05, "scaler": "step"},
    "scaler-step-retried": {"steps": 3, "max_grad_norm": 0.05, "scaler": "step", "retry": 1},
    "scaler-inf": {"steps": 3, "scaler": "step", "poison": 1, "poison_with": math.inf},
    # the Inf step skipped by the loop (no scaler.step), gradients zeroed by model.zero_grad()
    "scaler-inf-skipped-by-loop": {"steps": 3, "scaler": "unscale-skip", "clip": math.inf, "poison": 1,
                                   "poison_with": math.inf, "zero_model": True},
    "fp16-scaler-step": {"steps": 3, "max_grad_norm": 0.05, "scaler": "step", "fp16": True},
    "fp16-scaler-unscale": {"steps": 1, "scaler": "unscale", "fp16": True},
    "scaler-clip-unscale": {"steps": 2, "clip": 0.05, "scaler": "clip-unscale"},
    # the scaler handed a wrapper of the optimizer: step alone through a Lightning-style one; an
    # Inf in rank 1's shard through unscale_ and the clip, by the optimizer and through a user's proxy
    "scaler-step-forwarding": {"steps": 3, "max_grad_norm": 0.05, "scaler": "step", "wrap": "forwarding"},
    "scaler-unscale-inf": {"steps": 3, "clip": 0.05, "scaler": "unscale", "poison": 1, "poison_with": math.inf},
    # unscale_ through a proxy canzona cannot resolve (tests/runtime/amp_wrappers.Opaque)
    "scaler-unscale-opaque": {"steps": 1, "clip": 0.05, "scaler": "unscale", "wrap": "opaque"},
    # the same through a torch.optim.Optimizer subclass (amp_wrappers.TorchOpaque), an Inf in rank 1's shard
    "scaler-unscale-torch-opaque": {"steps": 1, "clip": 0.05, "scaler": "unscale", "wrap": "torch-opaque",
                                    "poison": 0, "poison_with": math.inf},
    # unscale_ through a user's proxy, no clip, then scaler.step handed the optimizer itself
    "scaler-unscale-proxy-then-optimizer": {"steps": 3, "scaler": "unscale", "wrap": "proxy", "wrap_step": False},
    "scaler-unscale-inf-proxy": {"steps": 3, "clip": 0.05, "scaler": "unscale", "poison": 1,
                                 "poison_with": math.inf, "wrap": "proxy"},
    "scaler-clip-step": {"steps": 2, "clip": 0.05, "scaler": "clip-step"},
    # DistributedOptimizer's ZeRO-1 options off their defaults (canzona.runtime.fsdp.ZERO1_ONLY), and one at it
    "zero1-options": {"refuse": {"reduce_scatter": "exact", "tp_policy": "tp-sync", "tp_mode": "serial",
                                 "capacity": Capacity(0.02), "overlap_param_gather": False, "geometry": "whole",
                                 "expert_buckets": "dp-multiple", "bucket_size": 4096}},
    # canzona's owner plan settings under round-robin owners, which no plan places
    "unbalanced-plan-settings": {"refuse": {"alpha": 0.5, "dp_policy": "whole-start", "align": 128},
                                 "base": {"policy": "fsdp-owners-unbalanced"}},
    # AdamW on every parameter under FSDP2 (no owners, no exchange): clipped, a NaN skipped, GradScaler's
    # unscale_ then the clip, as the Muon runs above
    "adamw-clip": {"steps": 3, "clip": 0.05, "optimizer": "adamw"},
    "adamw-skip": {"steps": 3, "nonfinite": "skip", "poison": 1, "optimizer": "adamw"},
    "adamw-scaler-unscale": {"steps": 3, "clip": 0.05, "scaler": "unscale", "optimizer": "adamw"},
    # AdamW's betas as one-element tensors (the group's, set by hand), against torch's AdamW with them
    "adamw-tensor-betas": {"steps": 3, "optimizer": "adamw", "tensor_betas": True},
    # what AdamW's step refuses (it has no owners to plan or matrices to configure), and what it takes
    "adamw-options": {"optimizer": "adamw", "refuse": {
        "policy": "canzona", "matrix_config": {"lr": 0.1}, "bucket_size": 4096, "alpha": 0.5}},
    "adamw-policies": {"optimizer": "adamw", "refuse": {"policy": "zero1"}},
    # AdamW over a mixture-of-experts model's stacked experts (reference.tiny_moe), against torch's
    "adamw-moe": {"moe_adamw": True},
    # torch's SGD under GradScaler over a model a canzona optimizer was built on (kept alive)
    "torch-sgd-scaler-beside": {"torch_sgd": True},
    # 0-d parameters, which fully_shard refuses: canzona's refusal of them left beside its DTensors,
    # and the same model with one-element vectors instead, against torch's AdamW
    "scalars": {"scalars": True},
    # the optimizer built over a model still on the meta device (torchtitan's init, out of order)
    "meta": {"meta": True},
    # the same on rank 1 alone, the other ranks' model materialized (to_empty): a short timeout_s,
    # which the ranks that passed waited out in the layout's gather before
    "meta-on-one-rank": {"meta": True, "only": 1},
    # the model's weights loaded on rank 0 alone after the optimizer was built, then on every rank
    "load-on-one-rank": {"load_on": 0},
}


def small_worker(rank: int, world: int, cases: dict[str, dict]) -> dict[str, dict]:
    def one(kw: dict) -> dict:
        if "refuse" in kw:
            return refusals(**kw)
        if "moe_adamw" in kw:
            return moe_adamw_runs(rank, world)
        if "scalars" in kw:
            return scalars_runs(world)
        if "meta" in kw:
            return meta_refusal(world, rank, kw.get("only"))
        if "load_on" in kw:
            return load_refusal(world, rank, kw["load_on"])
        if "rebuilt" in kw:
            return rebuilt_hooks(world)
        return torch_sgd_runs(rank, world) if "torch_sgd" in kw else small_run(rank, world, **kw)
    return {k: one(kw) for k, kw in cases.items()}


def rebuilt_hooks(world: int) -> dict[str, Any]:
    """Small under fully_shard: an optimizer built, stepped once and dropped (`del`, gc disabled), then
    another built on the same model: the post-accumulate-grad hooks on each parameter after each
    build and after the drop, and whether the first optimizer is gone."""
    import gc

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from canzona.runtime import DistributedOptimizer

    def hooks() -> list[int]:
        return [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()]

    model = Small()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = DistributedOptimizer(model.named_parameters(), small_spec(), "muon", MUON)
    out: dict[str, Any] = {"built": hooks()}
    model(small_batch(0, torch.distributed.get_rank())).backward()
    opt.step()
    gone = weakref.ref(opt)
    gc.disable()  # dropped without gc: freed by its reference count
    try:
        del opt
        out["dropped"], out["gone"] = hooks(), gone() is None
    finally:
        gc.enable()
    again = DistributedOptimizer(model.named_parameters(), small_spec(), "muon", MUON)
    out["rebuilt"] = hooks()
    del again
    return out


def torch_sgd_runs(rank: int, world: int) -> dict[str, dict]:
    """torch's SGD over Small under fully_shard, a GradScaler at 2**10 (`unscale_`, `step`, `update`),
    3 steps: the full parameters after them (`alone`), and the same beside a canzona optimizer built
    over that model first and kept alive, never stepped (`beside`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from canzona.runtime import DistributedOptimizer

    out = {}
    for how in ("alone", "beside"):
        model = Small()
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        built = DistributedOptimizer(model.named_parameters(), small_spec(), "muon", MUON) if how == "beside" else None
        opt, amp = torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        for step in range(3):
            opt.zero_grad()
            amp.scale(model(small_batch(step, rank))).backward()
            amp.unscale_(opt)
            amp.step(opt)
            amp.update()
        out[how] = {n: gather_rows(p) for n, p in model.named_parameters()}
        del built
    return out


def moe_adamw_runs(rank: int, world: int) -> dict[str, dict]:
    """The tiny MoE (stacked experts) under fully_shard per layer and at the root, 3 steps with
    clipping, by canzona's AdamW (`optimizer="adamw"`) and by torch's AdamW (foreach): the full
    parameters after them, by who stepped; or the error canzona's construction raised."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from canzona.errors import CanzonaError
    from canzona.runtime import DistributedOptimizer
    from reference.tiny_moe import MOE_PRESETS, TinyMoe

    out: dict[str, Any] = {}
    for who in ("canzona", "torch"):
        model = TinyMoe(MOE_PRESETS["tiny-moe"], seed=0)
        spec = model.spec()
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if who == "torch":
            opt = torch.optim.AdamW(model.parameters(), foreach=True)
        else:
            try:
                opt = DistributedOptimizer(model.named_parameters(), spec, "adamw")
            except CanzonaError as e:
                return {"error": str(e)}
        gen = torch.Generator().manual_seed(5)
        for _ in range(3):
            tokens = torch.randint(0, MOE_PRESETS["tiny-moe"].vocab, (world * 2, 9), generator=gen)
            opt.zero_grad()
            model.loss(tokens[2 * rank:2 * rank + 2]).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, foreach=True)
            opt.step()
        out[who] = {n: p.full_tensor() for n, p in model.named_parameters()}
    out["error"] = None
    return out


def scalars_runs(world: int) -> dict[str, Any]:
    """`tests.runtime.scalars.Scaled` (a 0-d gate and logit_scale) under FSDP2: torch's fully_shard
    of the root (`torch`: its error); the linears sharded, the scalars left plain beside them
    (`canzona`: DistributedOptimizer's error); the scalars as one-element vectors, the root
    sharded, 3 steps by canzona's AdamW and by torch's (foreach), the full parameters after them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from canzona.errors import CanzonaError
    from canzona.runtime import DistributedOptimizer
    from canzona.spec import ModelSpec
    from tests.runtime import scalars

    out: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (world,))
    try:
        fully_shard(scalars.Scaled(), mesh=mesh)
        out["torch"] = None
    except ValueError as e:
        out["torch"] = str(e)
    model = scalars.Scaled()
    spec = ModelSpec.from_module(model)
    fully_shard(model.a, mesh=mesh)
    fully_shard(model.b, mesh=mesh)
    try:
        DistributedOptimizer(model.named_parameters(), spec, "adamw")
        out["canzona"] = None
    except CanzonaError as e:
        out["canzona"] = str(e)
    for who in ("canzona", "torch"):
        model = scalars.Scaled()
        with torch.no_grad():
            model.gate, model.logit_scale = (torch.nn.Parameter(p.reshape(1)) for p in (model.gate, model.logit_scale))
        spec = ModelSpec.from_module(model)
        fully_shard(model, mesh=mesh)
        opt = DistributedOptimizer(model.named_parameters(), spec, "adamw") if who == "canzona" else \
            torch.optim.AdamW(model.parameters(), foreach=True)
        for step in range(3):
            opt.zero_grad()
            scalars.backward(model, step, torch.distributed.get_rank(), world)
            opt.step()
        out[f"vectors {who}"] = {n: gather_rows(p) for n, p in model.named_parameters()}
    return out


def meta_refusal(world: int, rank: int, only: int | None = None) -> dict:
    """Small built under torch.device("meta") and fully_shard-ed, the optimizer built before
    `model.to_empty()` (`only`: on that rank alone; the others' model materialized first, within a
    timeout_s of 5 s): the error construction raises (None: it was built) and the seconds it took."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from canzona.errors import CanzonaError
    from canzona.runtime import DistributedOptimizer

    with torch.device("meta"):
        model = Small()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    if only is not None and rank != only:
        model.to_empty(device="cpu")
    error, start = None, time.perf_counter()
    try:
        DistributedOptimizer(model.named_parameters(), small_spec(), "muon", MUON, timeout_s=5.0)
    except CanzonaError as e:
        error = str(e)
    return {"error": error, "took": time.perf_counter() - start}


def load_refusal(world: int, rank: int, only: int) -> dict:
    """Small under fully_shard with its optimizer; another Small's weights (their sharded state
    dict) loaded by `model.load_state_dict` on rank `only` alone, then a step (`one rank`, its
    outcome, and whether this rank's shards stayed as they were before the step), with and without
    clip_grad_norm_ between the load and the step (`after clip`); then loaded on every rank and
    a step (`every rank`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from canzona.runtime import DistributedOptimizer
    from tests.runtime.outcomes import outcome

    mesh = init_device_mesh("cpu", (world,))
    model, other = Small(), Small()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    fully_shard(model, mesh=mesh)
    fully_shard(other, mesh=mesh)
    opt = DistributedOptimizer(model.named_parameters(), small_spec(), "muon", MUON, timeout_s=10.0)

    def step(clip: bool) -> None:
        opt.zero_grad()
        model(small_batch(0, rank)).backward()
        if clip:
            opt.clip_grad_norm_(1.0)
        if rank == only:
            model.load_state_dict(other.state_dict())
        opt.step()

    def shards() -> dict[str, torch.Tensor]:
        return {n: p.to_local().clone() for n, p in model.named_parameters()}
    out = {}
    for how, clip in (("one rank", False), ("after clip", True)):
        before = shards()
        out[how] = outcome(lambda clip=clip: step(clip))
        out[f"{how} untouched"] = rank == only or all(torch.equal(before[n], t) for n, t in shards().items())
        model.load_state_dict(model.state_dict())  # every rank loads (its own weights): the marks agree again
        opt.zero_grad()
    model.load_state_dict(other.state_dict())
    opt.zero_grad()
    model(small_batch(0, rank)).backward()
    out["every rank"] = outcome(opt.step)

    # written in place, without load_state_dict (the parameters' version counters): through the
    # DTensor, or into its local shard; on rank `only` alone, then on every rank; every parameter
    # but the first (a.weight), so that the error names the first written, norm.weight
    def write(p: torch.Tensor, q: torch.Tensor, local: bool) -> None:
        if local:
            p.to_local().copy_(q.to_local())
        else:
            p.copy_(q)

    def written(ranks: tuple[int, ...], local: bool) -> dict:
        opt.zero_grad()
        model(small_batch(0, rank)).backward()
        if rank in ranks:
            with torch.no_grad():
                for p, q in list(zip(model.parameters(), other.parameters()))[1:]:
                    write(p, q, local)
        return outcome(opt.step)
    for how, local in (("written on one rank", False), ("written locally on one rank", True)):
        before = shards()
        out[how] = written((only,), local)
        out[f"{how} untouched"] = rank == only or all(torch.equal(before[n], t) for n, t in shards().items())
        out[f"{how}, then on every rank"] = written(tuple(range(world)), local)
    return out


def refusals(refuse: dict[str, object], base: dict[str, object] | None = None,
             optimizer: str = "muon") -> dict[str, str | None]:
    """For each of `refuse`'s options set off its default (beside `base`'s), the error
    `DistributedOptimizer` raises building its FSDP2 step for `optimizer` on Small under fully_shard
    (None: it was built)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from canzona.errors import CanzonaError
    from canzona.runtime import DistributedOptimizer

    model = Small()
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    out: dict[str, str | None] = {}
    for option, value in refuse.items():
        try:
            kw = {"matrix_config": OPTIMIZER_CONFIGS[optimizer], **(base or {}), option: value}
            DistributedOptimizer(model.named_parameters(), small_spec(), optimizer, **kw)
            out[option] = None
        except CanzonaError as e:
            out[option] = str(e)
    return out


@functools.cache
def _small() -> dict[str, list[dict]]:
    per_rank = run_ranks(small_worker, SMALL_WORLD, SMALL_CASES, deadline_s=240.0)
    return {k: [r[k] for r in per_rank] for k in SMALL_CASES}


def emulate_small(grads: list[dict[str, torch.Tensor]], clip: float | None = None,
                  optimizer: str = "muon") -> dict[str, torch.Tensor]:
    """The same kernels in one process on the global gradients (as harness.training.emulate);
    `optimizer` "adamw": AdamW on every parameter."""
    from canzona.harness.training import _flat_state, torch_threads
    from canzona.optimizers import config_from_dict, matrix_optimizer
    from canzona.runtime.kernels import adamw_step_, apply_update_

    with torch_threads():
        model, mspec = Small(), small_spec()
        kernel = matrix_optimizer("muon").part("kernel")
        mcfg, acfg = config_from_dict("muon", MUON), config_from_dict("adamw", {})
        states: dict[str, dict] = {}
        with torch.no_grad():
            for step_grads in grads:
                step_grads = {n: g.clone() for n, g in step_grads.items()}
                if clip is not None:
                    clip_(step_grads.values(), clip)
                for name, p in model.named_parameters():
                    state, grad = states.setdefault(name, {}), step_grads[name]
                    if mspec.param(name).uses_matrix_optimizer and optimizer != "adamw":
                        update = kernel(grad, state, mcfg, mcfg.lr)
                        if update is not None:
                            apply_update_(p, update.direction, update)
                    else:
                        adamw_step_(p.view(-1), grad.view(-1), _flat_state(state), acfg, acfg.lr)
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same_everywhere(results: list[dict]) -> None:
    for r in results[1:]:
        for a, b in zip(results[0]["grads"], r["grads"]):
            assert all(torch.equal(a[n], b[n]) for n in a)


def test_fsdp_adamw_with_tensor_betas_steps_bit_for_bit_as_torch_adamw() -> None:
    """AdamW's `betas` as one-element tensors in the groups (torch.optim.AdamW computes its bias
    corrections with them in their dtype): every rank's parameters are torch's AdamW's with them,
    fed the global gradients, bit for bit. Before: FsdpOptimizer stepped with the betas as Python
    numbers, off in the last bits."""
    results = _small()["adamw-tensor-betas"]
    assert all(r["error"] is None for r in results) and len(results[0]["grads"]) == 3
    model = Small()
    ref = torch.optim.AdamW(model.parameters(), betas=TENSOR_BETAS())
    for step_grads in results[0]["grads"]:
        for n, p in model.named_parameters():
            p.grad = step_grads[n].clone()
        ref.step()
    want = {n: p.detach() for n, p in model.named_parameters()}
    for r in results:
        assert compare(r["params"], want)["bit_identical"], compare(r["params"], want)


@pytest.mark.parametrize("case", ["plain", "clip"])
def test_fsdp_empty_local_shard_exact(case: str) -> None:
    """Rank 2 of 3 holds no row of b.weight (2 x 16) nor of b.bias (2): sends and receives empty
    blocks, yet every rank's parameters equal the one-process kernels bit for bit (with clipping too)."""
    results = _small()[case]
    assert results[2]["local_rows"]["b.weight"] == 0 and results[2]["local_rows"]["b.bias"] == 0
    assert results[0]["local_rows"]["b.weight"] == 1
    _same_everywhere(results)
    assert all(r["error"] is None for r in results) and len(results[0]["grads"]) == 3
    clip = SMALL_CASES[case].get("clip")
    want = emulate_small(results[0]["grads"], clip)
    init = dict(Small().named_parameters())
    for r in results:
        assert compare(r["params"], want)["bit_identical"], compare(r["params"], want)
        assert not any(torch.equal(r["params"][n], init[n]) for n in init)
    if clip is not None:
        names = [p.name for p in small_spec().params]
        for step, g in enumerate(results[0]["grads"]):
            norm = fsdp_norm(g, names, SMALL_WORLD)
            assert norm > clip
            assert all(r["norms"][step] == float(torch.tensor(norm, dtype=torch.float32)) for r in results)


# --- empty shards, skipped steps: memory and logs (here, beside `_small`'s other tests: `--dist loadfile`
# runs a file on one worker, so its cached spawned run is made once, where a second file made it again) --


@pytest.mark.parametrize("case", ["plain", "clip", "skip", "clip-skip", "adamw-clip", "adamw-skip"])
def test_empty_shards_and_skipped_steps(case):
    """At S = 3 rank 2 holds no row of b.weight (2 x 16) nor of b.bias: no AdamW state for the
    bias, nothing sent of the matrix; a skipped step (a NaN, `nonfinite="skip"`) issues only its
    step check, the look at the weights right after it (inside the clip's check where a clip
    comes first) and its recheck. Memory and logs as the model and `fsdp_step_collectives` say; under AdamW (no
    owners: what `canzona simulate --fsdp --optimizer adamw` prices) AdamW's moments of every local
    shard and no matrix state, the step check and the clip's threshold its only collectives."""
    from canzona.fsdp_collectives import fsdp_step_collectives
    from canzona.fsdp_plan import fsdp_matrices, fsdp_persistent_memory, shard_numel
    from canzona.step_policies import get_fsdp_policy
    from tests.runtime.test_fsdp_parity import CATEGORIES, CONSTRUCTION

    results = _small()[case]
    spec, kw = small_spec(), SMALL_CASES[case]
    matrices = {} if kw.get("optimizer") == "adamw" else \
        fsdp_matrices(spec, SMALL_WORLD, "muon", get_fsdp_policy("canzona"), matrix_config=MUON)[0]
    assert {n: m.owner for n, m in matrices.items()} == results[0]["owner"]
    want = fsdp_persistent_memory(spec, SMALL_WORLD, matrices, weight_bytes=4, grad_bytes=4, master_bytes=0)
    assert shard_numel((2, 16), SMALL_WORLD, 2) == 0 and want[2].adamw_state < want[1].adamw_state
    for rank, got in enumerate(results):
        for k in CATEGORIES:
            assert got["held"][k] == getattr(want[rank], k), (case, rank, k)
        for step in range(kw["steps"]):
            collectives = fsdp_step_collectives(spec, SMALL_WORLD, rank, got["owner"], got["micro_groups"],
                                                element_bytes=4, clips=((kw["clip"], 2.0),) if "clip" in kw else (),
                                                skipped=step == kw.get("poison"))
            have = [r[1:] for r in got["log"] if r[0] == step and r[3] not in CONSTRUCTION]
            assert have == [c.logged() for c in collectives], (case, rank, step)


def test_fsdp_nonfinite_skip() -> None:
    """A NaN in ONE rank's shard: every rank skips that step (skipped_steps 1), the others are exact."""
    results = _small()["skip"]
    assert [r["skipped"] for r in results] == [1] * SMALL_WORLD
    assert all(r["error"] is None for r in results) and len(results[0]["grads"]) == 2
    _same_everywhere(results)
    want = emulate_small(results[0]["grads"])
    for r in results:
        assert compare(r["params"], want)["bit_identical"]


def test_fsdp_nonfinite_raise() -> None:
    """nonfinite="raise": every rank raises the same CanzonaError at that step, nothing updated by it."""
    results = _small()["raise"]
    errors = {r["error"] for r in results}
    assert len(errors) == 1 and "global gradient norm is nan" in errors.pop()
    want = emulate_small(results[0]["grads"])  # step 0 only
    for r in results:
        assert compare(r["params"], want)["bit_identical"]


def test_fsdp_nan_weights_on_one_rank_are_named_on_every_rank_under_skip() -> None:
    """Rank 1's shard of b.weight NaN: every rank's gradient is NaN, and every rank raises the same
    error naming b.weight's weights (the others hold finite ones: the check's agreement), not the
    data; no step skipped. Before: skipped, and every later step with it, silently."""
    results = _small()["nan-weight"]
    errors = {r["error"] for r in results}
    assert len(errors) == 1, errors
    error = errors.pop()
    assert error.startswith("the weights of 'b.weight' are not finite") and "not the data" in error, error
    assert [r["skipped"] for r in results] == [0] * SMALL_WORLD


def test_fsdp_missing_gradient_on_one_rank() -> None:
    """Rank 1 lacks b.weight's gradient: every rank raises the same error at once (the step check's
    all-gather), instead of waiting in the all-to-all until the timeout."""
    results = _small()["drop"]
    errors = {r["error"] for r in results}
    assert len(errors) == 1
    error = errors.pop()
    assert "'b.weight' has a gradient on rank(s) [0, 2] and none on rank(s) [1]" in error, error
    assert all(r["took"] < 10.0 for r in results), [r["took"] for r in results]


def test_fsdp_a_step_called_again_after_a_refused_one_keeps_its_clip() -> None:
    """bf16 weights (fp32 masters), clip_grad_norm_, a step() refused (a NaN learning rate), the
    learning rate put back, step() again: the clipped step, as the run without the refusal. Before:
    the refusal forgot the clip (kept as a scale for the masters), and the step went unclipped."""
    straight, retried = _small()["bf16-clip"], _small()["bf16-clip-retried"]
    for a, b in zip(straight, retried):
        assert b["error"] is None and "lr must be a finite number" in b["refused"], b["refused"]
        assert compare(b["params"], a["params"])["bit_identical"], compare(b["params"], a["params"])


def test_fsdp_a_learning_rate_edited_on_one_rank_after_the_clip_is_refused_before_any_update() -> None:
    """clip_grad_norm_, rank 1 halves its learning rate, step(): one error on every rank (the clip's
    check, which step() reuses, is rechecked), nothing updated; the rate put back, step() again:
    the clipped step, as the run without the edit. Before: step() reused the check and the ranks
    stepped their shards with different learning rates."""
    straight, edited = _small()["clip"], _small()["clip-edit-retried"]
    for a, b in zip(straight, edited):
        assert b["refused"] is not None and "disagree on the hyper-parameters" in b["refused"], b["refused"]
        assert "\n" not in b["refused"] and b["error"] is None, b
        assert compare(b["params"], a["params"])["bit_identical"], compare(b["params"], a["params"])


def test_fsdp_a_backward_after_a_clip_is_checked_anew() -> None:
    """clip_grad_norm_, a second backward adding to the clipped gradients (no zero_grad), clip and
    step() (with a refused step() before that backward, or not): the second clip measures the sum,
    as torch's does, and clips it. Before: it returned the first clip's result and did not clip.
    With bf16 gradients (the clip kept as a scale for the masters) that backward is one error."""
    straight, retried = _small()["clip-twice"], _small()["clip-retried-twice"]
    for a, b in zip(straight, retried):
        assert a["error"] is None and a["norms"][2] > 0.05 and a["norms"][2] != a["norms"][1], a["norms"]
        assert b["error"] is None and b["refused"] is not None and b["norms"] == a["norms"], (a["norms"], b["norms"])
        assert compare(b["params"], a["params"])["bit_identical"], compare(b["params"], a["params"])
    for case in ("bf16-clip-twice", "bf16-scaler-clip-twice"):  # under GradScaler too: not the unscale_'s error
        for r in _small()[case]:
            assert "a backward added to gradients clip_grad_norm_() had already clipped" in r["error"], r["error"]


def test_fsdp_a_batch_discarded_with_model_zero_grad_after_its_clip_is_not_the_next_clips() -> None:
    """A batch's norm measured (`clip_grad_norm_(inf)`), the batch discarded with `model.zero_grad()`
    (a spike), then the step's own batch's backward, clip and step(): that clip measures the new
    gradients, as torch's does, and the run is the one without the discarded batch. Before: the new
    gradients' version counters equalled the discarded ones' (one backward each, nothing scaled),
    so the clip returned the discarded batch's norm (1.83 against 0.15) and clipped by its factor."""
    straight, discarded = _small()["clip"], _small()["clip-discarded"]
    for a, b in zip(straight, discarded):
        assert b["error"] is None and b["norms"][:1] + b["norms"][2:] == a["norms"], (a["norms"], b["norms"])
        assert b["norms"][1] > 10 * a["norms"][1], (a["norms"], b["norms"])
        assert compare(b["params"], a["params"])["bit_identical"], compare(b["params"], a["params"])


def test_fsdp_a_gradient_dropped_on_one_rank_after_the_clip_is_the_step_checks_error_on_every_rank() -> None:
    """clip_grad_norm_, then rank 1 drops b.weight's gradient, step(): rank 1 alone sees its
    gradients changed since the clip's check, and would take the step check where the others
    recheck; the recheck carries that word, so every rank takes the check anew and fails it with
    the same line, nothing updated past step 0. Before: rank 1's step check met the others' recheck
    (40 bytes against 8): gloo aborted the processes (SIGABRT)."""
    for r in _small()["drop-after-clip"]:
        assert r["error"] == ("'b.weight' has a gradient on rank(s) [0, 2] and none on rank(s) [1]: every rank must "
                              "run the same backward (FSDP reduces every gradient over all ranks)"), r["error"]
        assert len(r["grads"]) == 1, len(r["grads"])


def test_fsdp_gradients_scaled_in_place_after_the_clip_are_measured_anew() -> None:
    """clip_grad_norm_(0.05), torch's own clip_grad_norm_(0.01) on the same DTensor gradients (in
    place, through torch._foreach_mul_: no version counter moves), clip_grad_norm_(0.05) again: the
    second clip returns the norm the gradients have now (0.01), as torch's would, and the run stays
    alike on every rank. Before: it returned the first clip's kept norm (0.05). With bf16 gradients
    (the first clip kept as a scale for the fp32 masters) the in-place change is one error on every
    rank, nothing updated by that step."""
    for r in _small()["torch-clip-after-clip"]:
        assert r["error"] is None, r["error"]
        first, second = r["norms"][1:3]
        assert first > 0.05 and second == pytest.approx(0.01, rel=1e-4), r["norms"]
    _same_everywhere(_small()["torch-clip-after-clip"])
    for r in _small()["bf16-torch-clip-after-clip"]:
        assert r["error"] is not None and "changed in place" in r["error"] and "\n" not in r["error"], r["error"]
        assert len(r["grads"]) == 1, len(r["grads"])


def test_fsdp_a_nan_written_in_place_after_the_clip_is_the_step_checks_error_on_every_rank() -> None:
    """clip_grad_norm_, then rank 1 multiplies its b.weight gradient by NaN in place (no version
    counter moves), step(): the recheck sees rank 1's gradients changed, every rank takes the
    check anew and raises the non-finite norm's error, nothing updated by that step. Before: step()
    reused the clip's finite verdict and stepped the NaN into the weights."""
    results = _small()["nan-after-clip"]
    for r in results:
        assert r["error"] is not None and "global gradient norm is nan" in r["error"], r["error"]
        assert len(r["grads"]) == 1, len(r["grads"])
    want = emulate_small(results[0]["grads"], 0.05)  # step 0 taken, step 1 not
    for r in results:
        assert compare(r["params"], want)["bit_identical"]


def test_fsdp_grad_scaler_unscale_clip_step_trains_as_the_unscaled_loop() -> None:
    """torch.amp.GradScaler at 2**10 (a power of two: every gradient scaled exactly), `unscale_`,
    `opt.clip_grad_norm_`, `scaler.step`, `update`: the clipped run without a scaler bit for bit,
    the same norms, the scale grown alike on every rank (fp32; bf16 with fp32 masters, whose
    unscale is a scale kept for the step, which the inf-norm clip now measures too: it measured the
    scaled gradients, 1024 x); a DTensor no canzona optimizer steps is still unscaled by
    torch's handler. Before: `scaler.step` was refused ('GradScaler is not supported'). The same
    beside a second optimizer over the model, built later and never stepped (`beside`): before,
    the unscale went to that one, whose stale check left the gradients scaled (norms 2048 x)."""
    for plain, scaled in (("clip", "scaler-unscale"), ("bf16-clip", "bf16-scaler-unscale"),
                          ("bf16-clip-inf", "bf16-scaler-unscale-inf"), ("clip", "scaler-unscale-beside"),
                          ("bf16-clip", "bf16-scaler-unscale-beside")):
        for a, b in zip(_small()[plain], _small()[scaled]):
            assert b["error"] is None, b["error"]
            assert b["norms"] == a["norms"], (a["norms"], b["norms"])
            assert compare(b["params"], a["params"])["bit_identical"], compare(b["params"], a["params"])
            assert b["scales"] == [2.0 ** (11 + k) for k in range(len(b["scales"]))], b["scales"]
            assert b["others"] == (1.0, 0.0), b["others"]  # other DTensors' unscale is still torch's


def test_fsdp_grad_scaler_of_a_torch_optimizer_is_torchs_beside_a_canzona_optimizer() -> None:
    """torch's SGD under GradScaler over a model a canzona optimizer was built on (kept alive, not
    stepped): the weights of the same run with no canzona optimizer, bit for bit. Before: the unscale
    of SGD's gradients went to the canzona optimizer holding them, whose check ran at the first step
    only: from the second step SGD stepped by gradients still scaled (1024 x; weights 3.9e4 off)."""
    for r in _small()["torch-sgd-scaler-beside"]:
        assert compare(r["beside"], r["alone"])["bit_identical"], compare(r["beside"], r["alone"])


def test_fsdp_grad_scaler_step_alone_unscales_before_max_grad_norm_clips() -> None:
    """`scaler.step(opt)` alone hands the scale to step(), which unscales before its own clip
    (`max_grad_norm=0.05`): the run clipped by `clip_grad_norm_(0.05)` without a scaler, bit for bit.
    The same through a wrapper forwarding `_step_supports_amp_scaling` (Lightning-style), on which
    GradScaler sets its scale: before, step() never saw it and stepped the scaled gradients."""
    for a, b in zip(_small()["clip"] * 2, _small()["scaler-step"] + _small()["scaler-step-forwarding"]):
        assert b["error"] is None and b["skipped"] == 0, b["error"]
        assert compare(b["params"], a["params"])["bit_identical"], compare(b["params"], a["params"])
        assert b["scales"] == [2.0 ** 10] * 3, b["scales"]


def test_fsdp_grad_scaler_step_retried_after_a_refusal_unscales_once() -> None:
    """`scaler.step` refused before any update (a NaN learning rate), the rate put back, `scaler.step`
    again: the step of those gradients unscaled once, as the run without the refusal (the refused
    call drops the scale GradScaler set on the optimizer, which it deletes only when step() returns:
    left, the next call would unscale by the product of the two)."""
    for a, b in zip(_small()["scaler-step"], _small()["scaler-step-retried"]):
        assert b["error"] is None and "lr must be a finite number" in b["refused"], b["refused"]
        assert compare(b["params"], a["params"])["bit_identical"], compare(b["params"], a["params"])
        assert b["scales"] == a["scales"], b["scales"]


def test_fsdp_grad_scaler_skips_an_inf_on_one_rank_on_every_rank_and_backs_off() -> None:
    """An Inf in rank 1's shard of b.weight's gradient at step 1, `scaler.step` alone, nonfinite='raise':
    every rank's scaler finds it (the optimizer's global norm decides, not a rank's own unscale),
    every rank skips that step (counted in skipped_steps) and halves its scale; the other steps are
    the unscaled run's with that step skipped, bit for bit."""
    results, want = _small()["scaler-inf"], _small()["skip"]
    for r, w in zip(results, want):
        assert r["error"] is None and r["skipped"] == 1, (r["error"], r["skipped"])
        assert r["scales"] == [2.0 ** 10, 2.0 ** 9, 2.0 ** 9], r["scales"]
        assert compare(r["params"], w["params"])["bit_identical"], compare(r["params"], w["params"])


def test_fsdp_grad_scaler_handed_a_proxy_of_the_optimizer_unscales_as_the_optimizer() -> None:
    """`unscale_`, the clip and `scaler.step` through a user's proxy of the optimizer (forwarding
    `param_groups`, `step`, `zero_grad`), an Inf in rank 1's shard at step 1: the run handed the
    optimizer itself, bit for bit, the same skipped step and scales. Before: the unscale went to
    torch's handler, the optimizer's check never saw it, and the clip raised the Inf as an error."""
    for r, w in zip(_small()["scaler-unscale-inf-proxy"], _small()["scaler-unscale-inf"]):
        assert r["error"] is None and w["error"] is None, (r["error"], w["error"])
        assert r["scales"] == w["scales"] == [2.0 ** 11, 2.0 ** 10, 2.0 ** 11], (r["scales"], w["scales"])
        assert compare(r["params"], w["params"])["bit_identical"], compare(r["params"], w["params"])


def test_fsdp_grad_scaler_handed_a_wrapper_canzona_cannot_resolve_is_one_error_before_any_update() -> None:
    """`scaler.unscale_` through a proxy that hides the optimizer (another attribute name, a list
    of its own as `param_groups`): one error on every rank, nothing stepped. Before: torch's handler
    unscaled the gradients outside the optimizer's step check (a clip before it unseen, `found_inf`
    over the first gradient's mesh only). The same through a torch.optim.Optimizer subclass holding
    the optimizer (an Inf in rank 1's shard): before, exempt as a torch optimizer, the clip raised
    the Inf as an error ('the global gradient norm is inf'), where GradScaler skips the step."""
    init = {n: p.detach() for n, p in Small().named_parameters()}
    runs = {"Opaque": _small()["scaler-unscale-opaque"], "TorchOpaque": _small()["scaler-unscale-torch-opaque"]}
    for name, r in ((name, r) for name, rs in runs.items() for r in rs):
        assert r["error"] is not None and r["error"].startswith(f"GradScaler was handed a wrapper ({name}) that unscales"), \
            r["error"]
        assert "\n" not in r["error"]
        assert compare(r["params"], init)["bit_identical"]


def test_fsdp_grad_scaler_unscale_through_a_proxy_then_step_of_the_optimizer_unscales_once() -> None:
    """`scaler.unscale_(proxy)`, then `scaler.step(opt)` (accelerate's step after the user's
    `scaler.unscale_(accelerated_opt)`): GradScaler keys its state on the object, so the step of the
    optimizer itself hands the scale again. The run without a scaler, bit for bit. Before: step()
    unscaled the unscaled gradients again (by 2**-11, 2**-12, 2**-13), silently."""
    for r, w in zip(_small()["scaler-unscale-proxy-then-optimizer"], _small()["plain"]):
        assert r["error"] is None, r["error"]
        assert r["scales"] == [2.0 ** 11, 2.0 ** 12, 2.0 ** 13], r["scales"]
        assert compare(r["params"], w["params"])["bit_identical"], compare(r["params"], w["params"])


def test_fsdp_grad_scaler_after_a_step_the_loop_skipped_unscales_the_next() -> None:
    """An Inf in rank 1's shard at step 1; the loop measures (`clip_grad_norm_(inf)`) after
    `unscale_` and skips that step itself (`scaler.update()`, no `scaler.step`), zeroing with
    `model.zero_grad()`: the next steps are unscaled, the unscaled run with that step skipped bit for
    bit, the scale halved once. Before: the next `unscale_` reused the skipped step's check (kept:
    no step() ended it): no unscale, `found_inf` from that Inf, the step taken on gradients 512 x
    (clip norm 115 against 0.23 at world 2) and the scale halved again."""
    results, want = _small()["scaler-inf-skipped-by-loop"], _small()["skip"]
    for r, w in zip(results, want):
        assert r["error"] is None, r["error"]
        assert r["scales"] == [2.0 ** 10, 2.0 ** 9, 2.0 ** 9], r["scales"]
        assert compare(r["params"], w["params"])["bit_identical"], compare(r["params"], w["params"])


def test_fsdp_grad_scaler_steps_an_fp16_model_with_fp32_masters() -> None:
    """An fp16 model (fp32 masters), `scaler.step` alone with `max_grad_norm`: every step taken, the
    weights finite and alike on every rank; `unscale_` on its fp16 gradients is torch's own
    ValueError, as under torch's optimizers."""
    init = {n: p.detach().half() for n, p in Small().named_parameters()}
    results = _small()["fp16-scaler-step"]
    for r in results:
        assert r["error"] is None and r["skipped"] == 0 and r["scales"] == [2.0 ** 10] * 3, (r["error"], r["scales"])
        assert all(torch.isfinite(p).all() and not torch.equal(p, init[n]) for n, p in r["params"].items())
        assert compare(r["params"], results[0]["params"])["bit_identical"]
    for r in _small()["fp16-scaler-unscale"]:
        assert r["error"] == "Attempting to unscale FP16 gradients.", r["error"]


@pytest.mark.parametrize("case", ["scaler-clip-unscale", "scaler-clip-step"])
def test_fsdp_grad_scaler_after_a_clip_of_the_scaled_gradients_is_one_error(case: str) -> None:
    """`opt.clip_grad_norm_` before `scaler.unscale_` (or before `scaler.step` alone) measured and
    clipped the scaled gradients: one error on every rank, nothing updated. Before: torch's unscale
    ran after the clip (gradients clipped to max_norm / scale), then `scaler.step` was refused."""
    init = {n: p.detach() for n, p in Small().named_parameters()}
    for r in _small()[case]:
        assert r["error"] is not None and r["error"].startswith("GradScaler's unscale after a clip in the same step"), \
            r["error"]
        assert "clip_grad_value_" not in r["error"], r["error"]  # FsdpOptimizer has none
        assert "\n" not in r["error"] and not r["grads"]
        assert all(torch.equal(r["params"][n], init[n]) for n in init)


@pytest.mark.parametrize("case", ["clip-disagree", "clip-on-one"])
def test_fsdp_clip_threshold_agreement(case: str) -> None:
    """Ranks that clip by different thresholds (or only some of them) fail the step check, all of them."""
    results = _small()[case]
    assert all(r["error"] is not None and "disagree on the clip threshold" in r["error"] for r in results)
    assert all(len(r["grads"]) == 0 for r in results)  # at the first step, nothing updated


@pytest.mark.parametrize("case,message", [
    ("clip-bad-on-one", "disagree on the clip threshold (per rank: a bad value (a threshold not a positive number, or "
                        "norm_type not 2.0 or inf), max_norm=1"),
    ("clip-bad-everywhere", "max_norm must be a positive number (inf: measure only), got -1.0"),
])
def test_fsdp_a_bad_clip_threshold_fails_every_rank_after_the_check(case: str, message: str) -> None:
    """max_norm=0 on one rank alone (or -1 on every rank) is one error on every rank, after the step
    check, nothing updated. Before: the rank raised SpecError alone before the check while its peers
    waited in the check's all-gather (a hang until the timeout)."""
    results = _small()[case]
    assert all(r["error"] is not None and message in r["error"] for r in results), [r["error"] for r in results]
    assert all(r["took"] < 10.0 for r in results)
    assert all(len(r["grads"]) == 0 for r in results)  # at the first step, nothing updated


def test_fsdp_local_problem_fails_every_rank() -> None:
    """Rank 1's b.weight gradient is a plain tensor: rank 1 names it, the others name rank 1, all at once."""
    results = _small()["local-problem"]
    assert "b.weight: its gradient on rank 1 is Tensor" in results[1]["error"]
    assert all(results[r]["error"] == "rank(s) [1] found a broken step (see their error)" for r in (0, 2))
    assert all(r["took"] < 10.0 for r in results) and all(len(r["grads"]) == 1 for r in results)
    want = emulate_small(results[0]["grads"])  # step 0 taken, step 1 not
    for r in results:
        assert compare(r["params"], want)["bit_identical"]


@pytest.mark.parametrize("case,named", [
    # `load_state_dict(..., strict=False, assign=True)` of a.weight after the optimizer was built:
    # FSDP2 shards (and trains) the new tensor, which the optimizer never steps; it stepped the
    # rest and silently left a.weight unchanged
    ("assign", "parameter 'a.weight' was replaced"),
    # a new (fully_shard) module put in model.a's place: FSDP2's record of the old a.weight keeps the
    # old module alive, so no holder of the optimizer's changed; the step ran without the new
    # module's gradient (FSDP2 reduced it, nothing stepped it) and its weights never trained
    ("replace", "parameter 'a.weight' was replaced after the optimizer was built (FSDPSmall.a now holds another module)"),
    # the same while a ModuleList of the user's (a backup) holds the old module: a live module
    # still holding a.weight is no root of the model's (the gc walk's acceptance took it for one)
    ("replace-backup", "parameter 'a.weight' was replaced after the optimizer was built"),
    # `model._modules["a"] = new` (as `ModuleList.insert`, `del`): no module registered, so only
    # the old a.weight's missing gradient sends the check to walk the links
    ("replace-insert", "parameter 'a.weight' was replaced after the optimizer was built"),
    # the same with every step's gradients zeroed in place (the optimizer's or the model's
    # `zero_grad(set_to_none=False)`): the old a.weight's gradient stays a zero tensor, which no
    # backward reached (its local version as the last step left it). Before: no error, the new
    # module trained unstepped until some module was registered
    ("replace-insert-zeroed", "parameter 'a.weight' was replaced after the optimizer was built"),
    ("replace-insert-model-zeroed", "parameter 'a.weight' was replaced after the optimizer was built"),
    # the same after a batch's backward discarded by `model.zero_grad(set_to_none=False)` (no step)
    # just before the replacement: that backward's arrivals are not this step's. Before: the new
    # module trained one step unstepped, the error at the next
    ("replace-insert-model-discarded", "parameter 'a.weight' was replaced after the optimizer was built"),
    # the same three under FSDP2's CPU offload, which the optimizer hooks no parameter of (a hook
    # would make FSDP2's device-to-host copy blocking): the gradients' values tell
    ("replace-insert-offload", "parameter 'a.weight' was replaced after the optimizer was built"),
    ("replace-insert-model-zeroed-offload", "parameter 'a.weight' was replaced after the optimizer was built"),
    ("replace-insert-model-discarded-offload", "parameter 'a.weight' was replaced after the optimizer was built"),
    # two modules swapped between the backward and step(): every parameter still in the model,
    # under another name than the optimizer's state is keyed by (a resume would pair other weights)
    ("replace-swap", "moved in the model after the optimizer was built"),
    # the last micro-batch's backward ran under `set_requires_gradient_sync(False)` (turning it
    # back on forgotten): FSDP2 holds the gradient unsharded and unreduced; after
    # `zero_grad(set_to_none=False)` the step silently ran on zeros (and FSDP2 would add the held
    # gradient to the next step's)
    ("unsynced", "set_requires_gradient_sync(True) before step()"),
    # HSDP's accumulation: the last micro-batch's backward ran under `set_requires_all_reduce(False)`:
    # FSDP2 holds its reduce-scattered gradient, not all-reduced over the replicas nor written to
    # `.grad`; after `zero_grad(set_to_none=False)` the step silently ran on zeros (torch's optimizers
    # too), and FSDP2 added the held gradient to the next step's
    ("unreduced", "set_requires_all_reduce(True) before step()"),
    # the same held gradient from a backward between the clip and step() (whose recheck found the
    # gradients unchanged: FSDP2 left `.grad` alone), the clipped step run without it
    ("unsynced-after-clip", "set_requires_gradient_sync(True) before step()"),
    # a parameter removed from its param group, which torch.optim would stop stepping: the step
    # ran every parameter as built, silently
    ("regroup", "['params'] was changed after construction"),
])
def test_fsdp_a_step_the_model_no_longer_feeds_is_one_error_before_any_update(case: str, named: str) -> None:
    """Every rank fails the step check, naming the cause, nothing updated by that step."""
    results = _small()[case]
    for r in results:
        assert r["error"] is not None and named in r["error"], r["error"]
        assert len(r["grads"]) == 1
    want = emulate_small(results[0]["grads"])  # step 0 taken, step 1 not
    for r in results:
        assert compare(r["params"], want)["bit_identical"]


@pytest.mark.parametrize("case", ["offload", "offload-model-zeroed"])
def test_fsdp_cpu_offload_trains_as_without_and_gets_no_arrival_hook(case: str) -> None:
    """FSDP2's CPU offload (`CPUOffloadPolicy`): the optimizer registers no post-accumulate-grad
    hook on its parameters (one turns FSDP2's device-to-host copy of the reduced gradient
    blocking, torch 2.13), and 3 steps, zeroed to None or in place by the model, train bit for bit
    as the same kernels on the global gradients (no false replacement: every gradient counts as
    reached). Before: one hook per parameter."""
    for r in _small()[case]:
        assert r["error"] is None, r["error"]
        assert set(r["hooks"].values()) == {0}, r["hooks"]
        assert len(r["grads"]) == 3
    want = emulate_small(_small()[case][0]["grads"])
    for r in _small()[case]:
        assert compare(r["params"], want)["bit_identical"]

def test_fsdp_an_optimizer_dropped_takes_its_arrival_hooks_with_it() -> None:
    """An optimizer built, stepped, dropped (`del`, gc disabled), then another built on the same
    model: the dropped one freed at once, one post-accumulate-grad hook per parameter after each
    build, none between. Before: the dropped optimizer's hooks stayed on the parameters (two after
    the second build), each run by every backward after; and until 2026-12-03 (second fix) it
    lived on until gc ran (its checks held its bound methods), its hooks with it."""
    for r in _small()["rebuilt"]:
        assert r["gone"]
        assert r["built"] == r["rebuilt"] == [1] * 6 and r["dropped"] == [0] * 6, r


def test_fsdp_a_model_cast_after_building_the_optimizer_is_one_error_before_any_update() -> None:
    """`model.to(torch.bfloat16)` after the optimizer was built (fp32 then: no masters, fp32 state):
    the step failed in AdamW with torch's dtype error, after applying every micro-group's updates
    but the last's. Now every rank fails in the step check, naming the cast, nothing updated."""
    results = _small()["cast"]
    init = {n: p.detach().to(torch.bfloat16) for n, p in Small().named_parameters()}
    for r in results:
        assert r["error"] is not None and "cast or moved after building the optimizer" in r["error"], r["error"]
        assert r["took"] < 10.0 and not r["grads"]
        assert all(torch.equal(r["params"][n], init[n]) for n in init)


def test_fsdp_an_optimizer_built_over_a_meta_model_is_one_error_at_construction() -> None:
    """torchtitan builds the model under torch.device("meta"), shards it, then `to_empty()` and
    `init_weights()`; an optimizer built before `to_empty()` was accepted, and its first step blamed
    a cast or move "before fully_shard" (bf16: masters of meta tensors). Now construction refuses
    it on every rank, naming to_empty()."""
    for r in _small()["meta"]:
        assert r["error"] is not None and "meta device" in r["error"] and "to_empty" in r["error"], r["error"]


def test_fsdp_weights_loaded_on_one_rank_only_are_one_error_on_every_rank_before_any_update() -> None:
    """Each rank holds its own shards, so a load (model.load_state_dict) on rank 0 alone would train
    a mix of two sets of weights: the next step check (or step()'s recheck after clip_grad_norm_)
    refuses it on every rank, nothing updated; loaded on every rank, the step runs. Before, the
    step ran silently."""
    for r, out in enumerate(_small()["load-on-one-rank"]):
        for how in ("one rank", "after clip"):
            error = out[how]
            assert error["canzona"] and "loaded (load_state_dict) or written in place since the last step on " \
                "rank(s) [0] and not on rank(s) [1, 2] (the first that differs: 'a.weight')" in error["message"], \
                (r, how, error)
            assert out[f"{how} untouched"], (r, how)
        assert out["every rank"]["error"] is None, (r, out["every rank"])


def test_fsdp_weights_written_in_place_on_one_rank_only_are_one_error_on_every_rank_before_any_update() -> None:
    """`p.copy_(...)` without load_state_dict on rank 0 alone, through the DTensor or into its local
    shard (`p.to_local().copy_`): its version counters mark it as a load does, and the next step
    refuses it on every rank, nothing updated, naming the first parameter written on rank 0 alone
    (before, the error named none). Written on every rank, the step runs. Before, the step trained
    a mix of two sets of weights silently."""
    for r, out in enumerate(_small()["load-on-one-rank"]):
        for how in ("written on one rank", "written locally on one rank"):
            error = out[how]
            assert error["canzona"] and "written in place since the last step on rank(s) [0] and not on " \
                "rank(s) [1, 2] (the first that differs: 'norm.weight')" in error["message"], (r, how, error)
            assert out[f"{how} untouched"], (r, how)
            assert out[f"{how}, then on every rank"]["error"] is None, (r, how, out)


def test_fsdp_a_model_on_the_meta_device_on_one_rank_only_is_one_error_on_every_rank_at_once() -> None:
    """Rank 1's model was not materialized (to_empty() on the others only): rank 1's construction
    refused it, and the others waited in the layout's gather until timeout_s (5 s here), then
    raised a timeout naming no cause. Now every rank raises at once: rank 1 its own error, the
    others one naming rank 1."""
    results = _small()["meta-on-one-rank"]
    assert "meta device" in results[1]["error"], results[1]["error"]
    for rank in (0, 2):
        error = results[rank]["error"]
        assert error is not None and "rank(s) [1]" in error and "see their error" in error, error
    assert all(r["took"] < 4.0 for r in results), [r["took"] for r in results]


def test_fsdp_a_forward_between_backward_and_step_reads_the_updated_weights() -> None:
    """An evaluation forward under no_grad between backward and step(): FSDP2 keeps the root
    (reshard_after_forward=False, its default there) unsharded after it, and its next forward read
    those unsharded weights, from before the step, silently (torch's optimizers too). The step now
    reshards what FSDP2 holds unsharded: the next forward reads the updated weights, and training
    stays exact."""
    results = _small()["evaluate"]
    assert all(r["error"] is None and r["stale"] is False for r in results), [(r["error"], r["stale"]) for r in results]
    _same_everywhere(results)
    want = emulate_small(results[0]["grads"])
    for r in results:
        assert compare(r["params"], want)["bit_identical"]


def dead_peer_worker(rank: int, world: int) -> dict:
    return small_run(rank, world, 2, absent=1, timeout_s=2.0)


def test_fsdp_dead_peer_times_out() -> None:
    """Rank 2 never calls step 1: ranks 0 and 1 raise a CanzonaError within about timeout_s (2 s)."""
    results = run_ranks(dead_peer_worker, SMALL_WORLD, deadline_s=120.0)
    for r in results[:2]:
        assert r["error"] is not None and "timed out" in r["error"], r["error"]
        assert r["took"] < 10.0, r["took"]
    assert results[2]["error"] is None


def test_fsdp_refuses_the_zero1_layouts_options_on_every_rank() -> None:
    """Under FSDP2 the ZeRO-1 layout's options change nothing: set off their defaults, each is one
    SpecError on every rank, at construction (as `canzona simulate --fsdp` refuses them); an option
    FsdpOptimizer acts on (bucket_size) is taken."""
    from canzona.runtime.fsdp import ZERO1_ONLY

    results = _small()["zero1-options"]
    assert set(ZERO1_ONLY) <= set(results[0])
    for r in results:
        assert r == results[0]
        for option in ZERO1_ONLY:
            assert r[option] is not None and r[option].startswith(f"{option}=") and "changes nothing" in r[option]
        assert r["bucket_size"] is None


def test_fsdp_refuses_owner_plan_settings_under_round_robin_owners_on_every_rank() -> None:
    """fsdp-owners-unbalanced places matrix i on rank i mod S: canzona's owner plan settings change
    nothing there (they were taken and ignored); each is one SpecError on every rank, at
    construction, as `canzona simulate --fsdp` and `canzona verify --fsdp` refuse them."""
    results = _small()["unbalanced-plan-settings"]
    for r in results:
        assert r == results[0]
        for option, value in (("alpha", 0.5), ("dp_policy", "whole-start"), ("align", 128)):
            assert r[option] is not None and r[option].startswith(f"{option} {value}: canzona's owner plan"), r[option]


def test_fsdp_adamw_steps_every_parameter_on_its_own_shard() -> None:
    """`optimizer="adamw"` under FSDP2 (`canzona simulate --fsdp --optimizer adamw`): no owners, no
    all-to-all (the step check and the clip's threshold are its only collectives), every parameter
    stepped by AdamW on its local shard, equal to the one-process AdamW on the global gradients bit
    for bit (clipped: the same agreed norm; a NaN on one rank skipped on every rank; GradScaler's
    unscale_ then the clip: the unscaled run bit for bit). Before: one SpecError ("adamw needs no
    owners: use torch's own optimizer")."""
    for case in ("adamw-clip", "adamw-skip"):
        results = _small()[case]
        assert all(r["error"] is None for r in results), [r["error"] for r in results]
        _same_everywhere(results)
        want = emulate_small(results[0]["grads"], SMALL_CASES[case].get("clip"), optimizer="adamw")
        for r in results:
            assert compare(r["params"], want)["bit_identical"], (case, compare(r["params"], want))
            assert r["owner"] == {} and r["micro_groups"] == [] and r["held"]["matrix_state"] == 0
            assert not any(op == "all-to-all" for _, op, *_ in r["log"]), r["log"]
    assert [r["skipped"] for r in _small()["adamw-skip"]] == [1] * SMALL_WORLD
    for a, b in zip(_small()["adamw-clip"], _small()["adamw-scaler-unscale"]):
        assert b["error"] is None and b["norms"] == a["norms"], b["error"]
        assert compare(b["params"], a["params"])["bit_identical"], compare(b["params"], a["params"])


def test_fsdp_adamw_refuses_what_it_has_no_use_for_on_every_rank() -> None:
    """AdamW's FSDP2 step has no owners and no matrices: an owner policy, matrix_config and canzona's
    owner plan settings are each one SpecError on every rank, at construction (as `canzona simulate
    --fsdp --optimizer adamw` refuses them); its own policy (zero1) is taken."""
    for r in _small()["adamw-options"]:
        assert r == _small()["adamw-options"][0]
        assert "each rank steps its own shards (FSDP2's), policy zero1; got 'canzona'" in r["policy"]
        assert r["matrix_config"].startswith("adamw runs every parameter with adamw_config")
        for option, value in (("bucket_size", 4096), ("alpha", 0.5)):
            assert r[option].startswith(f"{option} {value}: canzona's owner plan settings change nothing under "
                                        "an elementwise optimizer's FSDP step"), r[option]
    assert all(r == {"policy": None} for r in _small()["adamw-policies"])


def test_fsdp_adamw_steps_stacked_experts_as_torch_adamw() -> None:
    """A mixture-of-experts model's stacked experts under FSDP2 with `optimizer="adamw"` (what
    `canzona simulate --fsdp --optimizer adamw` prices for qwen3-30b-a3b): AdamW on each rank's rows
    of the stacks, torch's AdamW (foreach) bit for bit. Before: "stacks matrices (experts): not run
    under FSDP2 yet", whatever the optimizer."""
    for r in _small()["adamw-moe"]:
        assert r["error"] is None, r["error"]
        assert any(n.endswith("gate_up_proj") for n in r["canzona"])
        assert compare(r["canzona"], r["torch"])["bit_identical"], compare(r["canzona"], r["torch"])


def test_fsdp_loads_with_the_arguments_the_integrations_pass() -> None:
    """CanzonaTrainer and CanzonaAccelerator call `load_sharded_state_dict(reader, check_weights=True)`
    on whichever optimizer DistributedOptimizer built: the FSDP one takes the same arguments (it
    raised a TypeError on check_weights), so a resume reaches its load."""
    import inspect

    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.fsdp import FsdpOptimizer

    zero1 = inspect.signature(DistributedOptimizer.load_sharded_state_dict).parameters
    fsdp = inspect.signature(FsdpOptimizer.load_sharded_state_dict).parameters
    assert list(fsdp) == list(zero1)
    assert all(fsdp[k].kind == zero1[k].kind and fsdp[k].default == zero1[k].default for k in zero1)


def test_fsdp_a_save_after_a_param_group_was_edited_is_the_steps_error_on_every_rank() -> None:
    """Before: `state_dict()` wrote a checkpoint without the removed parameter, which no optimizer
    of the model loads."""
    for r in _small()["regroup"]:
        assert r["regroup_save"] and "['params'] was changed after construction" in r["regroup_save"][0]


def test_fsdp_one_rank_editing_its_param_groups_is_one_error_on_every_rank_at_once() -> None:
    """Rank 1 alone removed a parameter from its groups between the clip and step(): before,
    rank 1 raised after the clip's check while its peers went on into the step's all-to-all and
    waited out timeout_s ("all-to-all of gradients ... timed out"); a save or load after it raised
    on rank 1 before the collective, and the peers timed out blaming a rank that did not call it.
    Now the step's recheck, the save and the load carry it: every rank, the same error, at once."""
    results = _small()["regroup-one-after-clip"]
    for r in results:
        assert r["error"] is not None and ("['params'] was changed after construction" in r["error"]
                                           or "rank(s) [1] found a broken step" in r["error"]), r["error"]
        assert r["took"] < 8.0 and len(r["grads"]) == 1  # not the collectives' timeout_s (8 s)
        for message, took in (r["regroup_save"], r["regroup_load"]):
            assert "['params'] was changed after construction" in message and "timed out" not in message
            assert took < 8.0
    assert "['params'] was changed after construction" in results[1]["error"]
    assert len({r["regroup_save"][0] for r in results}) == 1 and len({r["regroup_load"][0] for r in results}) == 1
    want = emulate_small(results[0]["grads"], clip=0.05)  # step 0 taken, step 1 not
    for r in results:
        assert compare(r["params"], want)["bit_identical"]


def test_fsdp_0d_parameters_are_refused_naming_the_one_element_vector_they_can_be() -> None:
    """torch's fully_shard refuses a 0-d parameter; one left beside FSDP2's DTensors is one
    SpecError at construction on every rank, naming what to do: a one-element vector, which FSDP2
    shards and canzona's AdamW steps bit for bit as torch's (at S = 3 two ranks hold none of it)."""
    for r in _small()["scalars"]:
        assert "scalar" in r["torch"] and "'gate'" in r["canzona"], r
        assert "0-d" in r["canzona"] and "one-element" in r["canzona"] and "\n" not in r["canzona"], r["canzona"]
        assert compare(r["vectors canzona"], r["vectors torch"])["bit_identical"]
