"""FSDP2 with expert parallelism (`canzona.runtime.fsdp_ep`, torchtitan's layout: the stacks
Shard(0) over ep, fully_shard over efsdp, the dense part over dp) where users go next, at world 4 =
EP 2 x EFSDP 2 (`tests.runtime.test_fsdp_ep`'s model, 6 experts, unless said):

- bf16 weights with fp32 masters (`master_weights=True`): each step is torch's AdamW (foreach) on
  fp32 masters of the same DTensors fed the bf16 gradients widened, the weights the masters cast,
  bit for bit; `state_dict()` holds the masters, and a fresh model resumed from it, or from
  `sharded_state_dict` + dcp, ends as the uninterrupted run, weights and state (masters) bit for bit;
- torch.amp.GradScaler at 2**10 (`scale(loss).backward`, `unscale_`, `clip_grad_norm_`, `step`,
  `update`) steps as the unscaled run, bit for bit; an Inf in one rank's expert gradient skips the
  step on every rank and the scale backs off alike on all;
- both together, and fp16 weights with fp32 masters under GradScaler (`scaler.step` alone: torch's
  `unscale_` refuses fp16 gradients): each step torch's AdamW (foreach) on fp32 masters fed the
  scaled gradients widened and unscaled in fp32, bit for bit; an Inf in one rank's expert gradient
  skips the step on every rank; the optimizer and the scaler resumed mid-run end as the run;
- across layouts (the `tiny-moe` preset, 4 experts: 1 a rank): a `state_dict()` saved under EP 2 x
  EFSDP 2 resumes under FSDP2 without EP (the experts fully_shard over all 4) and under ZeRO-1 (dp 4)
  bit for bit as the same kernels in one process fed the same gradients
  (`canzona.harness.training.emulate`); a state saved with another number of experts is one
  CheckpointError on every rank.
"""

from __future__ import annotations

import functools
import math
import tempfile
from typing import Any

import pytest
import torch

from canzona.harness.launch import run_ranks
from canzona.harness.training import TrainSpec, compare, emulate
from tests.runtime.test_fsdp_checkpoint import nested_equal, resume_spec
from tests.runtime.test_fsdp_ep import (
    CLIP,
    EP,
    POISON,
    SAVE,
    STEPS,
    WORLD,
    _batches,
    _full,
    _train,
    config,
)

pytestmark = pytest.mark.distributed  # spawns gloo process groups

SCALE = 2.0 ** 10
MOE = TrainSpec(preset="tiny-moe", optimizer="adamw", steps=SAVE, global_batch=8)
DEADLINE_S = 300.0


# --- in the ranks ---------------------------------------------------------------------------------


def _ep(cfg=None, seed: int = 0, dtype: torch.dtype = torch.float32, **kw):
    from canzona.runtime import DistributedOptimizer
    from reference.tiny_moe_fsdp_ep import fsdp_ep_model

    model, _, _ = fsdp_ep_model(cfg or config(), EP, seed=seed, dtype=dtype)
    return model, DistributedOptimizer(model.named_parameters(), model.spec(), "adamw", **kw)


def _bf16_torch(batches: list[torch.Tensor], dtype: torch.dtype = torch.bfloat16,
                scales: list[float] | None = None, clip: float | None = None,
                norms: list[float] | None = None) -> dict[str, torch.Tensor]:
    """torch's AdamW (foreach) on fp32 masters of the `dtype` DTensors, fed the low-precision
    gradients widened; the weights are the masters cast. `scales`: the loss scaled by each step's
    (GradScaler's: the gradients widened, then unscaled in fp32; an Inf scale is a skipped step).
    `clip`: the unscaled fp32 gradients then clipped by torchtitan's EP rule (`clip_named_with_ep`),
    each step's norm appended to `norms`."""
    from reference.tiny_moe_fsdp_ep import clip_named_with_ep, fsdp_ep_model

    model, _, _ = fsdp_ep_model(config(), EP, dtype=dtype)
    names, params = zip(*model.named_parameters())
    masters = [p.detach().float() for p in params]
    opt = torch.optim.AdamW(masters, foreach=True)
    for step, tokens in enumerate(batches):
        scale = 1.0 if scales is None else scales[step]
        if math.isinf(scale):
            continue
        model.zero_grad()
        (model.loss(tokens) * scale).backward()
        for m, p in zip(masters, params):
            m.grad = p.grad.float() * (1.0 / scale)
        if clip is not None:
            norms.append(clip_named_with_ep(list(zip(names, masters)), clip))
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, params):
                p.to_local().copy_(m.to_local().to(dtype))
    return _full(model)


def bf16(rank: int, world: int, path: str) -> dict[str, Any]:
    from tests.runtime.test_fsdp_checkpoint import load_params

    batches = _batches(rank, world, STEPS)
    out: dict[str, Any] = {"torch": _bf16_torch(batches)}
    model, opt = _ep(dtype=torch.bfloat16, master_weights=True)
    out["masters"] = opt.master_weights
    _train(model, opt, batches)
    out["straight"], out["end state"] = _full(model), opt.state_dict()
    model, opt = _ep(dtype=torch.bfloat16, master_weights=True)
    _train(model, opt, batches[:SAVE])
    params, state = _full(model), opt.state_dict()
    out["saved"] = (params, state)
    import torch.distributed.checkpoint as dcp

    dcp.save(opt.sharded_state_dict(), checkpoint_id=path)
    for form in ("full", "sharded"):
        model, opt = _ep(seed=7, dtype=torch.bfloat16, master_weights=True)
        load_params(model, params)
        if form == "full":
            opt.load_state_dict(state)
        else:
            opt.load_sharded_state_dict(path, check_weights=True)
        out[f"{form} round trip"] = nested_equal(opt.state_dict(), state)
        _train(model, opt, batches[SAVE:])
        out[f"resumed {form}"], out[f"resumed {form} state"] = _full(model), opt.state_dict()
    return out


def scaled(rank: int, world: int) -> dict[str, Any]:
    """GradScaler's loop (unscale_, clip, step, update) beside the unscaled one; `poison`: an Inf
    in rank 1's expert gradient at step POISON."""
    batches = _batches(rank, world, STEPS)
    out: dict[str, Any] = {}
    for label, skip in (("plain", frozenset()), ("plain skipped", {POISON})):
        model, opt = _ep()
        out[f"{label} norms"] = _train(model, opt, batches, own_clip=True, skip=skip)
        out[label] = _full(model)
    for label, poison in (("scaled", None), ("poisoned", POISON)):
        model, opt = _ep()
        amp = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1)
        norms, scales = [], []
        for step, tokens in enumerate(batches):
            opt.zero_grad()
            amp.scale(model.loss(tokens)).backward()
            if step == poison and rank == 1:
                with torch.no_grad():
                    model.model.layers[0].mlp.experts.down_proj.grad.to_local()[0, 0, 0] = float("inf")
            amp.unscale_(opt)
            norms.append(float(opt.clip_grad_norm_(CLIP)))
            amp.step(opt)
            amp.update()
            scales.append(float(amp.get_scale()))
        out[label], out[f"{label} norms"], out[f"{label} scales"] = _full(model), norms, scales
    return out


def _scaled_steps(model, opt, amp, batches, poison: int | None = None, unscale: bool = True,
                  saved: dict | None = None) -> list[float]:
    """GradScaler's loop (`unscale_` unless not `unscale`, `step`, `update`); an Inf in rank 1's
    expert gradient at step `poison`; the scales after each step. `saved` gets the weights, the
    optimizer's and the scaler's state after SAVE steps."""
    import torch.distributed as dist

    scales = []
    for step, tokens in enumerate(batches):
        if saved is not None and step == SAVE:
            saved.update(params=_full(model), state=opt.state_dict(), scaler=amp.state_dict())
        opt.zero_grad()
        amp.scale(model.loss(tokens)).backward()
        if step == poison and dist.get_rank() == 1:
            with torch.no_grad():
                model.model.layers[0].mlp.experts.down_proj.grad.to_local()[0, 0, 0] = float("inf")
        if unscale:
            amp.unscale_(opt)
        amp.step(opt)
        amp.update()
        scales.append(float(amp.get_scale()))
    return scales


# the scale each step's backward ran at, from SCALE, growing each step; an Inf at POISON (skipped,
# the scale halved)
POISONED_SCALES = [SCALE, math.inf, SCALE, SCALE * 2]


def low_scaled(rank: int, world: int, bf16_torch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """bf16 weights with fp32 masters (`unscale_` then `step`), and fp16 weights with fp32 masters
    (`step` alone: `unscale_` of fp16 gradients is torch's own ValueError) under GradScaler:
    straight, an Inf on rank 1 at POISON, and resumed after SAVE steps (optimizer and scaler).
    `bf16_torch`: the unscaled bf16 reference (a power-of-two scale is exact within bf16's range)."""
    from tests.runtime.test_fsdp_checkpoint import load_params

    batches = _batches(rank, world, STEPS)
    out: dict[str, Any] = {}
    for dtype in (torch.bfloat16, torch.float16):
        unscale = dtype == torch.bfloat16
        got: dict[str, Any] = {"torch skipped": _bf16_torch(batches, dtype, POISONED_SCALES)}
        # fp16's range: the reference runs at the scales (the gradients' subnormals differ unscaled)
        got["torch"] = bf16_torch if unscale else _bf16_torch(batches, dtype, [SCALE * 2 ** k for k in range(STEPS)])
        saved: dict[str, Any] = {}
        for label, poison in (("scaled", None), ("poisoned", POISON)):
            model, opt = _ep(dtype=dtype, master_weights=True)
            amp = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1)
            got[f"{label} scales"] = _scaled_steps(model, opt, amp, batches, poison, unscale,
                                                   saved if poison is None else None)
            got[label], got[f"{label} skipped"] = _full(model), opt.skipped_steps
        model, opt = _ep(seed=7, dtype=dtype, master_weights=True)
        load_params(model, saved["params"])
        opt.load_state_dict(saved["state"])
        amp = torch.amp.GradScaler("cpu")
        amp.load_state_dict(saved["scaler"])
        got["resumed scales"] = _scaled_steps(model, opt, amp, batches[SAVE:], unscale=unscale)
        got["resumed"] = _full(model)
        out[str(dtype).removeprefix("torch.")] = got
    return out


def clipped(rank: int, world: int) -> dict[str, Any]:
    """bf16 weights with fp32 masters under GradScaler with the user's clip after `unscale_`:
    canzona's `opt.clip_grad_norm_`, straight and with an Inf on rank 1 at POISON, beside torch's
    AdamW on fp32 masters fed the unscaled gradients clipped by torchtitan's EP rule; and
    torchtitan's clip itself (`clip_with_ep`, on the model's gradients) in its place."""
    import torch.distributed as dist

    from canzona.errors import CanzonaError
    from reference.tiny_moe_fsdp_ep import clip_with_ep

    batches = _batches(rank, world, STEPS)
    out: dict[str, Any] = {}
    for label, scales in (("torch", [SCALE * 2 ** k for k in range(STEPS)]), ("torch skipped", POISONED_SCALES)):
        norms: list[float] = []
        out[label] = _bf16_torch(batches, torch.bfloat16, scales, clip=CLIP, norms=norms)
        out[f"{label} norms"] = norms
    for how, label, poison in (("canzona", "clipped", None), ("canzona", "poisoned", POISON),
                               ("torchtitan", "clipped", None)):
        model, opt = _ep(dtype=torch.bfloat16, master_weights=True)
        amp = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1)
        start, norms, error = _full(model), [], None
        try:
            for step, tokens in enumerate(batches):
                opt.zero_grad()
                amp.scale(model.loss(tokens)).backward()
                if step == poison and dist.get_rank() == 1:
                    with torch.no_grad():
                        model.model.layers[0].mlp.experts.down_proj.grad.to_local()[0, 0, 0] = float("inf")
                amp.unscale_(opt)
                norms.append(float(opt.clip_grad_norm_(CLIP)) if how == "canzona" else clip_with_ep(model, CLIP))
                amp.step(opt)
                amp.update()
        except CanzonaError as e:  # reported: every rank raises it alike
            error = f"{type(e).__name__}: {e}"
        out[f"{how} {label}"] = {"weights": _full(model), "start": start, "norms": norms,
                                 "skipped": opt.skipped_steps, "error": error}
    return out


def layouts(rank: int, world: int, path: str) -> dict[str, Any]:
    """The tiny-moe preset (4 experts) under EP 2 x EFSDP 2, SAVE steps, saved; resumed under FSDP2
    without EP and under ZeRO-1; and the save loaded by a model of 6 experts."""
    import torch.distributed.checkpoint as dcp

    from canzona.errors import CanzonaError
    from canzona.harness.training import distributed_worker
    from reference.tiny_moe import MOE_PRESETS
    from tests.runtime.test_fsdp_checkpoint import resumed, train

    model, opt = _ep(MOE_PRESETS["tiny-moe"])
    train(model, opt, MOE, rank, world)
    ckpt = (_full(model), opt.state_dict())
    dcp.save(opt.sharded_state_dict(), checkpoint_id=path)
    out: dict[str, Any] = {"ckpt": ckpt}
    out["fsdp"] = resumed(MOE, rank, world, ckpt, record=True)
    out["fsdp sharded"] = resumed(MOE, rank, world, (ckpt[0], path), record=True, like=ckpt[1])
    out["zero1"] = distributed_worker(rank, world, resume_spec(MOE), {"load": ckpt})["params"]
    out["zero1 sharded"] = distributed_worker(rank, world, resume_spec(MOE),
                                              {"load": (ckpt[0], path), "check_weights": True})["params"]
    errors = {}
    for form in ("full", "sharded"):
        model, opt = _ep()  # 6 experts
        try:
            opt.load_state_dict(ckpt[1]) if form == "full" else opt.load_sharded_state_dict(path)
            errors[form] = "no error"
        except CanzonaError as e:
            errors[form] = f"{type(e).__name__}: {e}"
    out["other experts"] = errors
    return out


def worker(rank: int, world: int, root: str) -> dict[str, Any]:
    out = {"bf16": bf16(rank, world, f"{root}/bf16"), "scaled": scaled(rank, world)}
    out["low scaled"] = low_scaled(rank, world, out["bf16"]["torch"])
    out["clipped"] = clipped(rank, world)
    return out | {"layouts": layouts(rank, world, f"{root}/layouts")}


@functools.cache
def runs() -> list[dict]:
    return run_ranks(worker, WORLD, tempfile.mkdtemp(prefix="canzona-fsdp-ep-amp-"), deadline_s=DEADLINE_S,
                     collective_timeout_s=60)


# --- checks ---------------------------------------------------------------------------------------


def _unequal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert set(a) == set(b)
    return [n for n in a if not torch.equal(a[n], b[n])]


def test_bf16_with_fp32_masters_steps_as_torch_adamw_on_the_masters() -> None:
    for rank, r in enumerate(runs()):
        got = r["bf16"]
        assert got["masters"] and next(iter(got["straight"].values())).dtype == torch.bfloat16
        assert not _unequal(got["straight"], got["torch"]), (rank, _unequal(got["straight"], got["torch"]))


@pytest.mark.parametrize("form", ["full", "sharded"])
def test_bf16_resume_is_bit_for_bit_masters_included(form: str) -> None:
    from tests.runtime.test_fsdp_ep import _entries

    for rank, r in enumerate(runs()):
        got = r["bf16"]
        params, state = got["saved"]
        entries = _entries(state)
        assert set(entries) == set(params)
        for name, entry in entries.items():  # the fp32 masters of the saved weights (a stack's whole)
            assert entry["master"].dtype == torch.float32, name
            assert torch.equal(entry["master"].reshape(params[name].shape).bfloat16(), params[name]), (rank, name)
        assert got[f"{form} round trip"] is None, (rank, form, got[f"{form} round trip"])
        assert not _unequal(got[f"resumed {form}"], got["straight"]), (rank, form)
        assert nested_equal(got[f"resumed {form} state"], got["end state"]) is None, \
            (rank, form, nested_equal(got[f"resumed {form} state"], got["end state"]))


def test_grad_scaler_at_a_power_of_two_steps_as_the_unscaled_run() -> None:
    for rank, r in enumerate(runs()):
        got = r["scaled"]
        assert got["scaled norms"] == got["plain norms"], rank
        assert not _unequal(got["scaled"], got["plain"]), (rank, _unequal(got["scaled"], got["plain"]))
        assert got["scaled scales"] == [SCALE * 2 ** (k + 1) for k in range(STEPS)], got["scaled scales"]


def test_an_inf_in_one_ranks_expert_gradient_skips_the_step_and_backs_off_on_every_rank() -> None:
    ranks = runs()
    want = [SCALE * 2, SCALE, SCALE * 2, SCALE * 4]  # grown, halved at POISON, grown
    assert POISON == 1
    for rank, r in enumerate(ranks):
        got = r["scaled"]
        assert got["poisoned scales"] == want, (rank, got["poisoned scales"])
        assert math.isinf(got["poisoned norms"][POISON]), (rank, got["poisoned norms"])
        assert not _unequal(got["poisoned"], got["plain skipped"]), \
            (rank, _unequal(got["poisoned"], got["plain skipped"]))


@pytest.mark.parametrize("form", ["", " sharded"])
def test_an_ep_checkpoint_resumes_under_fsdp_without_ep(form: str) -> None:
    ranks = runs()
    ckpt = ranks[0]["layouts"]["ckpt"]
    res = ranks[0]["layouts"]["fsdp" + form]
    want = emulate(resume_spec(MOE), WORLD, load=ckpt, grads=res["grads"])
    for rank, r in enumerate(ranks):
        got = r["layouts"]["fsdp" + form]
        assert got["round trip"] is None, (rank, form, got["round trip"])
        exact = compare(got["final"], want)
        assert exact["bit_identical"], (rank, form, exact)


@pytest.mark.parametrize("form", ["", " sharded"])
def test_an_ep_checkpoint_resumes_under_zero1(form: str) -> None:
    ranks = runs()
    want = emulate(resume_spec(MOE), WORLD, load=ranks[0]["layouts"]["ckpt"])
    for rank, r in enumerate(ranks):
        exact = compare(r["layouts"]["zero1" + form], want)
        assert exact["bit_identical"], (rank, form, exact)


def test_a_state_of_another_number_of_experts_is_one_error() -> None:
    ranks = runs()
    for r in ranks:
        got = r["layouts"]["other experts"]
        assert got == ranks[0]["layouts"]["other experts"]
        for form, error in got.items():
            assert error.startswith("PlanError: checkpoint is of model 'tiny-moe'"), (form, error)
            # the difference named: each stack's experts (gate_up_proj stacks gate and up: 2 a expert)
            assert "model.layers.0.mlp.experts.down_proj is [4, 32, 16] there, [6, 32, 16] here" in error \
                or "model.layers.0.mlp.experts.down_proj stacks 4 matrices there, 6 here" in error, (form, error)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_weights_with_masters_under_grad_scaler_step_as_torch_adamw_on_the_masters(dtype: str) -> None:
    for rank, r in enumerate(runs()):
        got = r["low scaled"][dtype]
        assert next(iter(got["scaled"].values())).dtype == getattr(torch, dtype)
        assert got["scaled scales"] == [SCALE * 2 ** (k + 1) for k in range(STEPS)], (rank, got["scaled scales"])
        assert not _unequal(got["scaled"], got["torch"]), (rank, _unequal(got["scaled"], got["torch"]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_an_inf_in_one_ranks_expert_gradient_skips_the_step_on_every_rank(dtype: str) -> None:
    for rank, r in enumerate(runs()):
        got = r["low scaled"][dtype]
        assert got["poisoned scales"] == [SCALE * 2, SCALE, SCALE * 2, SCALE * 4], (rank, got["poisoned scales"])
        assert got["poisoned skipped"] == 1 and got["scaled skipped"] == 0, rank
        assert not _unequal(got["poisoned"], got["torch skipped"]), (rank, _unequal(got["poisoned"],
                                                                                    got["torch skipped"]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_under_grad_scaler_resumes_bit_for_bit(dtype: str) -> None:
    for rank, r in enumerate(runs()):
        got = r["low scaled"][dtype]
        assert got["resumed scales"] == got["scaled scales"][SAVE:], (rank, got["resumed scales"])
        assert not _unequal(got["resumed"], got["scaled"]), (rank, _unequal(got["resumed"], got["scaled"]))


def test_bf16_with_masters_under_grad_scaler_clipped_after_unscale_steps_as_torch_adamw() -> None:
    """The users' AMP loop (`scale(loss).backward`, `unscale_`, `opt.clip_grad_norm_`, `step`,
    `update`), bf16 weights with fp32 masters: each step torch's AdamW (foreach) on the masters fed
    the unscaled gradients clipped, bit for bit; the clip returns the unscaled gradients' norm (in
    fp32, as clip_grad_norm_ returns it); an Inf on rank 1 skips that step on every rank."""
    for rank, r in enumerate(runs()):
        got = r["clipped"]
        straight, poisoned = got["canzona clipped"], got["canzona poisoned"]
        assert straight["error"] is None and poisoned["error"] is None, (rank, straight["error"], poisoned["error"])
        want = [float(torch.tensor(n, dtype=torch.float32)) for n in got["torch norms"]]
        assert len(want) == STEPS and all(n > CLIP for n in want)  # every step clipped
        assert straight["norms"] == want, (rank, straight["norms"], want)
        assert not _unequal(straight["weights"], got["torch"]), (rank, _unequal(straight["weights"], got["torch"]))
        assert straight["skipped"] == 0 and poisoned["skipped"] == 1, rank
        assert math.isinf(poisoned["norms"][POISON]), (rank, poisoned["norms"])
        kept = [n for k, n in enumerate(poisoned["norms"]) if k != POISON]
        assert kept == [float(torch.tensor(n, dtype=torch.float32)) for n in got["torch skipped norms"]], rank
        assert not _unequal(poisoned["weights"], got["torch skipped"]), \
            (rank, _unequal(poisoned["weights"], got["torch skipped"]))


def test_bf16_with_masters_a_clip_of_the_grads_after_unscale_is_one_error_naming_opts_clip() -> None:
    """With fp32 masters GradScaler's unscale is a scale the step applies where the bf16 gradients
    widen: `.grad` still holds the scaled values, which a clip of the user's own (torchtitan's EP
    clip here; torch's `clip_grad_norm_` over FSDP2 + EP's two meshes is torch's own DTensor error)
    measures 2**10 too large. step() is then one error on every rank naming that and
    `opt.clip_grad_norm_`, nothing updated (before: 'a backward added to gradients
    clip_grad_norm_() had already clipped', neither of which had happened)."""
    ranks = runs()
    for rank, r in enumerate(ranks):
        got = r["clipped"]["torchtitan clipped"]
        assert got["error"] == ranks[0]["clipped"]["torchtitan clipped"]["error"], (rank, got["error"])
        assert got["error"].startswith("CanzonaError: gradients changed after GradScaler's unscale_"), got["error"]
        assert "opt.clip_grad_norm_" in got["error"], got["error"]
        # the one clip it ran measured the scaled gradients: 2**10 x the unscaled norm canzona's returns
        unscaled = r["clipped"]["canzona clipped"]["norms"][0]
        assert len(got["norms"]) == 1 and math.isclose(got["norms"][0], SCALE * unscaled, rel_tol=1e-6), got["norms"]
        assert not _unequal(got["weights"], got["start"]), rank
