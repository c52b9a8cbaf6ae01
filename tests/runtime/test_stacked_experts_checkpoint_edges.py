"""FSDP2 checkpoints of stacked experts (the tiny MoE, `optimizer="adamw"`) at their edges, where
`test_fsdp_stacked_experts.py` does not go (a red team's, 2026-12-02); every run compared bit for bit with the uninterrupted run,
`emulate()` or torch's AdamW (foreach):
- 3 ranks: torch.chunk gives each stack's 4 experts as 2, 2, 0 (the third rank holds no expert
  row); resumes from state_dict(), the sharded form, DCP of torch's API (flattened or not), and a
  bf16 sharded save keyed by the stack's name (as written before stacks were keyed by matrix);
- other sizes and layouts: FSDP 2 -> FSDP 3, FSDP 3 -> FSDP 2, FSDP 4 -> FSDP 2 (slow), FSDP 2 -> ZeRO-1 at 3, ZeRO-1 at
  3 -> FSDP 2, FSDP 3 -> ZeRO-1 at 2, FSDP 2 -> HSDP (2 x 1) -> FSDP 2;
- a 4-expert checkpoint into a 2-expert model (whose gate_up matrices are named and shaped as the
  first 4 of the saved 8): one canzona error alike on every rank, the state untouched;
- damaged folders (a .distcp or the .metadata cut in half, a byte flipped under a manifest), a
  rank late past the timeout, a rank killed: one error, within the timeout;
- GradScaler (unscale_ -> clip -> scaler.step) with a skipped inf step then a resume, FSDP2 and
  ZeRO-1; stacks sharded along their rows (shard_placement_fn Shard(1)); stacks in a param group
  of their own.
"""

from __future__ import annotations

import functools
import tempfile
from dataclasses import replace
from typing import Any

import pytest
import torch

from canzona.harness.launch import run_ranks
from canzona.harness.training import TrainSpec, compare, emulate
from tests.runtime.outcomes import outcome
from tests.runtime.test_fsdp_checkpoint import (
    _flat_resumed,
    fsdp_model,
    nested_equal,
    resume_spec,
    resumed,
    straight,
    torch_api_resumed,
)

# spawns gloo process groups; slow: the edges beyond test_fsdp_stacked_experts.py, run by `make test-all`
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# 6 sequences a step: divisible by 2 and by 3 ranks
MOE = TrainSpec(preset="tiny-moe", optimizer="adamw", steps=2, global_batch=6)
BF16 = replace(MOE, dtype="bf16")
TWO_EXPERTS = "tiny-moe-2x"  # the tiny MoE with 2 experts a stack (registered in the ranks)
DEADLINE_S = 400.0


def _register_two_experts() -> None:
    from reference.tiny_moe import MOE_PRESETS

    MOE_PRESETS[TWO_EXPERTS] = replace(MOE_PRESETS["tiny-moe"], experts=2)


def save_worker(rank: int, world: int, path: str) -> dict[str, Any]:
    """FSDP 2: the uninterrupted run, its checkpoints (state_dict(), DCP of torch's API, sharded)."""
    return straight(MOE, rank, world, path)


def other_experts(rank: int, world: int, ckpt: tuple[dict, dict], path: str) -> dict[str, Any]:
    """A model whose stacks hold 2 experts (not 4) loads the 4-expert checkpoint: each form's
    outcome, and whether the optimizer's state changed."""
    _register_two_experts()
    spec = replace(MOE, preset=TWO_EXPERTS)
    out: dict[str, Any] = {}
    for form, load in (
        ("full", lambda opt: opt.load_state_dict(ckpt[1])),
        ("sharded", lambda opt: opt.load_sharded_state_dict(path + "-sharded")),
        ("sharded checked", lambda opt: opt.load_sharded_state_dict(path + "-sharded", check_weights=True)),
    ):
        for layout in ("fsdp", "zero1"):
            opt = fsdp_model(spec, world)[1] if layout == "fsdp" else _zero1(spec)
            before = opt.state_dict()
            got = outcome(lambda load=load, opt=opt: load(opt))
            got.pop("value", None)
            got["untouched"] = nested_equal(opt.state_dict(), before)
            out[form if layout == "fsdp" else f"zero1 {form}"] = got
    # torch's API: dcp.load of the 4-expert directory into the 2-expert model's templates
    try:  # dcp's CheckpointException is a BaseException
        torch_api_resumed(spec, rank, world, None, path)
        out["dcp"] = {"error": None}
    except BaseException as e:  # noqa: BLE001 - the type and message are the result
        out["dcp"] = {"error": type(e).__name__, "message": str(e)}
    return out


def _zero1(spec: TrainSpec, model: Any = None):
    """`spec`'s model (or `model`) unsharded, under the ZeRO-1 layout over every rank."""
    from canzona.harness.training import build_model
    from canzona.runtime import DistributedOptimizer

    model = build_model(spec) if model is None else model
    return DistributedOptimizer(model.named_parameters(), model.spec(), spec.optimizer, None, spec.adamw_config)


def stack_keyed_save(rank: int, world: int, path: str) -> str:
    """BF16's SAVE steps, then a sharded save as `sharded_state_dict()` wrote one before stacks were
    keyed by matrix: each stack's AdamW state and fp32 master under the stack's name, at its flat
    offset."""
    import torch.distributed.checkpoint as dcp

    from canzona.runtime.checkpoint import piece_key
    from canzona.runtime.fsdp_checkpoint import _flat_bounds
    from tests.runtime.test_fsdp_checkpoint import train

    model, opt = fsdp_model(BF16, world)
    train(model, opt, BF16, rank, world)
    entries = {k: v for k, v in opt.sharded_state_dict().items() if "_proj[" not in k}
    for name in opt.params:
        box = opt.layout[name].boxes[opt.rank]
        if opt.spec.param(name).matrix_shape is None or not box.numel or not opt.layout[name].sources[opt.rank]:
            continue  # as the old writer: no piece where this rank holds none (the third rank's experts)
        lo, _ = _flat_bounds(box, opt.layout[name].shape)
        entries[piece_key("canzona_optimizer", "adamw", name, "master", lo)] = opt.master[name].reshape(-1)
        for key, value in opt.adamw_state.get(name, {}).items():
            entries[piece_key("canzona_optimizer", "adamw", name, key, lo)] = \
                value.reshape(-1) if isinstance(value, torch.Tensor) else value
    dcp.save(entries, checkpoint_id=path)
    return path


def resume_worker(rank: int, world: int, ckpt: tuple[dict, dict], path: str, here: str) -> dict[str, Any]:
    from canzona.harness.training import distributed_worker

    out: dict[str, Any] = {}
    # FSDP 2's checkpoint under ZeRO-1 at 3 ranks (state_dict(), the sharded form)
    out["zero1 from 2"] = {
        "full": outcome(lambda: distributed_worker(rank, world, resume_spec(MOE), {"load": ckpt})["params"]),
        "sharded": outcome(lambda: distributed_worker(rank, world, resume_spec(MOE), {
            "load": (ckpt[0], path + "-sharded"), "check_weights": True})["params"])}
    # at 3 ranks: the uninterrupted run and its resumes (the third rank holds no expert row)
    for label, spec in (("fp32", MOE), ("bf16", BF16)):
        run = straight(spec, rank, world, f"{here}-{label}")
        out[label] = {"straight": run,
                      "full": resumed(spec, rank, world, run["ckpt"]),
                      "sharded": resumed(spec, rank, world, (run["ckpt"][0], f"{here}-{label}-sharded"),
                                         like=run["ckpt"][1])}
    # a sharded save of bf16 stacks as written before stacks were keyed by matrix: masters too
    run = out["bf16"]["straight"]
    out["bf16"]["stack-keyed"] = resumed(BF16, rank, world, (run["ckpt"][0], stack_keyed_save(rank, world, here + "-old")),
                                         like=run["ckpt"][1])
    out["fp32"]["dcp"] = outcome(lambda: torch_api_resumed(MOE, rank, world, None, f"{here}-fp32"))
    out["fp32"]["dcp flat"] = _flat_resumed(MOE, rank, world, f"{here}-fp32-flat")  # torchtitan's form
    # FSDP 2's checkpoint at FSDP 3: state_dict(), the sharded form, DCP of torch's API
    out["from 2"] = {"full": resumed(MOE, rank, world, ckpt, record=True),
                     "sharded": resumed(MOE, rank, world, (ckpt[0], path + "-sharded"), like=ckpt[1]),
                     "dcp": outcome(lambda: torch_api_resumed(MOE, rank, world, None, path))}
    out["other experts"] = other_experts(rank, world, ckpt, path)
    # ZeRO-1 at 3 ranks: a sharded save, resumed at FSDP 2 (`across`)
    zero1 = distributed_worker(rank, world, MOE, {"save_sharded": here + "-zero1"})
    out["zero1 ckpt"] = (zero1["params"], zero1["state"])
    return out


def _state_after_sharded_load(rank: int, world: int, params: dict, path: str) -> dict:
    """A fresh FSDP model given `params` loads the sharded checkpoint at `path`: its state dict."""
    from tests.runtime.test_fsdp_checkpoint import load_params

    model, opt = fsdp_model(MOE, world, seed=7)
    load_params(model, params)
    opt.load_sharded_state_dict(path, check_weights=True)
    return opt.state_dict()


def across_worker(rank: int, world: int, zero1: tuple[dict, dict], fsdp3: tuple[dict, dict], here: str,
                  fsdp2: tuple[dict, dict]) -> dict:
    """At 2 ranks: ZeRO-1's checkpoint of 3 ranks under FSDP2, FSDP 3's under ZeRO-1 (both forms);
    FSDP 2's under HSDP and back."""
    from canzona.harness.training import distributed_worker

    two = here.removesuffix("three") + "two"
    # HSDP (2 replicas of 1 shard) resumes FSDP 2's checkpoint, saves its state sharded (each
    # replica the same entries), which FSDP 2 then loads
    hsdp = resumed(MOE, rank, world, (fsdp2[0], two + "-sharded"), like=fsdp2[1], hsdp=True, save=here + "-hsdp")
    # FSDP 3's checkpoint (its third rank wrote no stack piece) at FSDP 2
    fsdp_from_3 = {"full": resumed(MOE, rank, world, fsdp3, record=True),
                   "sharded": resumed(MOE, rank, world, (fsdp3[0], here + "-fp32-sharded"), like=fsdp3[1])}
    return {"fsdp from fsdp@3": fsdp_from_3, "hsdp": hsdp, "fsdp from hsdp": _state_after_sharded_load(rank, world, hsdp["final"], here + "-hsdp"),
            "fsdp from zero1@3": {"full": resumed(MOE, rank, world, zero1, record=True),
                                  "sharded": resumed(MOE, rank, world, (zero1[0], here + "-zero1"), like=zero1[1])},
            "zero1 from fsdp@3": {
                "full": distributed_worker(rank, world, resume_spec(MOE), {"load": fsdp3})["params"],
                "sharded": distributed_worker(rank, world, resume_spec(MOE), {
                    "load": (fsdp3[0], here + "-fp32-sharded"), "check_weights": True})["params"]}}



def _spawned(worker, world: int) -> list[dict]:
    """`worker` on `world` spawned ranks, writing under a fresh folder."""
    path = tempfile.mkdtemp(prefix="canzona-stack-edges-") + "/ckpt"
    return run_ranks(worker, world, path, deadline_s=DEADLINE_S, collective_timeout_s=60)

@functools.cache
def runs() -> tuple[list[dict], list[dict]]:
    root = tempfile.mkdtemp(prefix="canzona-stack-edges-")
    saved = run_ranks(save_worker, 2, root + "/two", deadline_s=DEADLINE_S, collective_timeout_s=60)
    ckpt = saved[0]["ckpt"]
    got = run_ranks(resume_worker, 3, ckpt, root + "/two", root + "/three", deadline_s=DEADLINE_S,
                    collective_timeout_s=60)
    return saved, got, root + "/three"


@functools.cache
def across() -> list[dict]:
    two, three, here = runs()
    return run_ranks(across_worker, 2, three[0]["zero1 ckpt"], three[0]["fp32"]["straight"]["ckpt"], here,
                     two[0]["ckpt"],
                     deadline_s=DEADLINE_S, collective_timeout_s=60)


def test_stacks_move_between_fsdp2_and_hsdp_bit_for_bit() -> None:
    two, _, _ = runs()
    ckpt = two[0]["ckpt"]
    want = emulate(resume_spec(MOE), 2, load=ckpt)
    for rank, r in enumerate(across()):
        assert r["hsdp"]["round trip"] is None, (rank, r["hsdp"]["round trip"])
        exact = compare(r["hsdp"]["final"], want)
        assert exact["bit_identical"], (rank, exact)
        assert nested_equal(r["fsdp from hsdp"], r["hsdp"]["state"]) is None, \
            (rank, nested_equal(r["fsdp from hsdp"], r["hsdp"]["state"]))


@pytest.mark.parametrize("form", ["full", "sharded"])
def test_zero1_at_3_resumes_at_fsdp2_and_fsdp3_under_zero1_at_2_bit_for_bit(form: str) -> None:
    _, three, _ = runs()
    ranks = across()
    zero1 = three[0]["zero1 ckpt"]
    want = emulate(resume_spec(MOE), 2, load=zero1, grads=ranks[0]["fsdp from zero1@3"]["full"]["grads"])
    fsdp3 = emulate(resume_spec(MOE), 2, load=three[0]["fp32"]["straight"]["ckpt"])
    for rank, r in enumerate(ranks):
        got = r["fsdp from zero1@3"][form]
        assert got["round trip"] is None, (rank, form, got["round trip"])
        exact = compare(got["final"], want)
        assert exact["bit_identical"], (rank, form, exact)
        exact = compare(r["zero1 from fsdp@3"][form], fsdp3)
        assert exact["bit_identical"], (rank, form, exact)


@pytest.mark.parametrize("form", ["full", "sharded"])
def test_fsdp3_with_a_rank_without_experts_resumes_at_fsdp2_bit_for_bit(form: str) -> None:
    _, three, _ = runs()
    ranks = across()
    want = emulate(resume_spec(MOE), 2, load=three[0]["fp32"]["straight"]["ckpt"],
                   grads=ranks[0]["fsdp from fsdp@3"]["full"]["grads"])
    for rank, r in enumerate(ranks):
        got = r["fsdp from fsdp@3"][form]
        assert got["round trip"] is None, (rank, form, got["round trip"])
        exact = compare(got["final"], want)
        assert exact["bit_identical"], (rank, form, exact)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("form", ["full", "sharded"])
def test_three_ranks_one_without_experts_resume_bit_for_bit(dtype: str, form: str) -> None:
    _, ranks, _ = runs()
    for rank, r in enumerate(ranks):
        run, res = r[dtype]["straight"], r[dtype][form]
        assert run["untouched"] is None, (rank, run["untouched"])
        assert res["round trip"] is None, (rank, dtype, form, res["round trip"])
        exact = compare(res["final"], run["final"])
        assert exact["bit_identical"], (rank, dtype, form, exact)


def test_a_bf16_sharded_save_keyed_by_stack_still_resumes_bit_for_bit() -> None:
    _, ranks, _ = runs()
    for rank, r in enumerate(ranks):
        got = r["bf16"]["stack-keyed"]
        assert got["round trip"] is None, (rank, got["round trip"])
        exact = compare(got["final"], r["bf16"]["straight"]["final"])
        assert exact["bit_identical"], (rank, exact)


def test_three_ranks_dcp_of_torchs_api_resumes_bit_for_bit() -> None:
    _, ranks, _ = runs()
    for rank, r in enumerate(ranks):
        got = r["fp32"]["dcp"]
        assert got["error"] is None, (rank, got)
        assert nested_equal(got["value"]["state"], r["fp32"]["straight"]["ckpt"][1]) is None, rank
        assert compare(got["value"]["final"], r["fp32"]["straight"]["final"])["bit_identical"], rank
        flat = r["fp32"]["dcp flat"]
        assert "error" not in flat, (rank, flat)
        assert nested_equal(flat["state"], r["fp32"]["straight"]["ckpt"][1]) is None, rank
        assert compare(flat["final"], r["fp32"]["straight"]["final"])["bit_identical"], rank


@pytest.mark.parametrize("form", ["full", "sharded", "dcp"])
def test_a_checkpoint_of_fsdp2_resumes_at_fsdp3_bit_for_bit(form: str) -> None:
    saved, ranks, _ = runs()
    ckpt = saved[0]["ckpt"]
    want = emulate(resume_spec(MOE), 3, load=ckpt, grads=ranks[0]["from 2"]["full"]["grads"])
    for rank, r in enumerate(ranks):
        got = r["from 2"][form]
        if form == "dcp":
            assert got["error"] is None, (rank, got)
            assert nested_equal(got["value"]["state"], ckpt[1]) is None, rank
            got = got["value"]
        else:
            assert got["round trip"] is None, (rank, form, got["round trip"])
        exact = compare(got["final"], want)
        assert exact["bit_identical"], (rank, form, exact)


@pytest.mark.parametrize("form", ["full", "sharded"])
def test_a_checkpoint_of_fsdp2_resumes_under_zero1_at_3_ranks_bit_for_bit(form: str) -> None:
    saved, ranks, _ = runs()
    want = emulate(resume_spec(MOE), 3, load=saved[0]["ckpt"])
    for rank, r in enumerate(ranks):
        got = r["zero1 from 2"][form]
        assert got["error"] is None, (rank, form, got)
        exact = compare(got["value"], want)
        assert exact["bit_identical"], (rank, form, exact)


@pytest.mark.parametrize("form", ["full", "sharded", "sharded checked", "zero1 full", "zero1 sharded",
                                  "zero1 sharded checked", "dcp"])
def test_a_checkpoint_of_other_expert_counts_is_one_clear_error(form: str) -> None:
    _, ranks, _ = runs()
    got = [r["other experts"][form] for r in ranks]
    for rank, g in enumerate(got):
        assert g["error"] is not None, (rank, form, g)
        if form == "dcp":  # torch's own dcp.load refuses the model's stacks before canzona is asked
            assert "Size mismatch" in g["message"], (rank, g)
            continue
        assert g["canzona"], (rank, form, g)
        assert g["untouched"] is None, (rank, form, g["untouched"])
        assert "\n" not in g["message"], (rank, form, g["message"])
    if form != "dcp":
        assert len({g["message"] for g in got}) == 1, [g["message"] for g in got]  # the same on every rank


# --- damaged files, a late rank, GradScaler's skipped step then a resume (3 ranks) -----------------

AMP = replace(MOE, dtype="bf16", steps=3)  # torch refuses to unscale fp16 gradients
INF_STEP = 1  # GradScaler's step skipped (an inf in rank 0's piece of a stack's gradient)
LATE_TIMEOUT_S = 5.0


def _fresh(spec: TrainSpec, world: int, timeout_s: float = 120.0):
    """`fsdp_model`'s model and an optimizer of its own `timeout_s` (seed 7: other weights)."""
    from canzona.harness.training import build_model
    from canzona.runtime import DistributedOptimizer

    model, _ = fsdp_model(spec, world, seed=7)
    opt = DistributedOptimizer(model.named_parameters(), build_model(spec).spec(), spec.optimizer, None,
                               spec.adamw_config, timeout_s=timeout_s)
    return model, opt


def scaled_run(spec: TrainSpec, rank: int, world: int, model, opt, steps: range, amp, sharded: bool = True) -> None:
    """GradScaler: scale, backward, unscale_, clip to 1.0, scaler.step, update; at INF_STEP an inf
    in rank 0's piece of the first stack's gradient (the step skipped on every rank)."""
    from canzona.harness.training import global_batches, micro_batches

    vocab = model.spec().param("model.embed_tokens.weight").shape[0]
    batches = global_batches(replace(spec, steps=steps.stop), vocab)
    for step in steps:
        opt.zero_grad()
        (mb,) = micro_batches(batches[step], rank, world, 1)
        loss = model.loss(mb).float()
        if step == INF_STEP and rank == 0 and not sharded:  # ZeRO-1 guards .grad until step(): an inf loss
            loss = loss * float("inf")
        amp.scale(loss).backward()
        if step == INF_STEP and rank == 0 and sharded:
            from canzona.runtime.shards import local_tensor

            grad = dict(model.named_parameters())["model.layers.0.mlp.experts.down_proj"].grad
            local_tensor(grad).view(-1)[0] = float("inf")
        amp.unscale_(opt)
        opt.clip_grad_norm_(1.0)
        amp.step(opt)
        amp.update()


def damaged_worker(rank: int, world: int, here: str) -> dict[str, Any]:
    import os
    import shutil
    import time

    import torch.distributed as dist

    out: dict[str, Any] = {}
    # GradScaler (bf16 weights, fp32 masters): SAVE steps with a skipped one, a checkpoint, one more
    new = functools.partial(torch.amp.GradScaler, "cpu", init_scale=2.0 ** 10)
    model, opt = fsdp_model(AMP, world)
    amp = new()
    scaled_run(AMP, rank, world, model, opt, range(2), amp)
    ckpt = ({n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}, opt.state_dict(),
            amp.state_dict())
    out["scale"] = amp.get_scale()
    scaled_run(AMP, rank, world, model, opt, range(2, 3), amp)
    out["amp straight"] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    model, opt = fsdp_model(AMP, world, seed=7)
    from tests.runtime.test_fsdp_checkpoint import load_params

    load_params(model, ckpt[0])
    opt.load_state_dict(ckpt[1])
    amp = new()
    amp.load_state_dict(ckpt[2])
    scaled_run(AMP, rank, world, model, opt, range(2, 3), amp)
    out["amp resumed"] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}

    # the same under ZeRO-1 (the model whole on every rank)
    from canzona.harness.training import build_model

    model = build_model(AMP)
    opt = _zero1(AMP, model)
    amp = new()
    scaled_run(AMP, rank, world, model, opt, range(2), amp, sharded=False)
    ckpt = ({n: p.detach().clone() for n, p in model.named_parameters()}, opt.state_dict(), amp.state_dict())
    out["zero1 scale"] = amp.get_scale()
    scaled_run(AMP, rank, world, model, opt, range(2, 3), amp, sharded=False)
    out["zero1 amp straight"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    model = build_model(replace(AMP, model_seed=7))
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(ckpt[0][n])
    opt = _zero1(AMP, model)
    opt.load_state_dict(ckpt[1])
    amp = new()
    amp.load_state_dict(ckpt[2])
    scaled_run(AMP, rank, world, model, opt, range(2, 3), amp, sharded=False)
    out["zero1 amp resumed"] = {n: p.detach().clone() for n, p in model.named_parameters()}

    # a sharded save, then damaged copies: rank 1's file cut in half, the metadata cut
    model, opt = fsdp_model(MOE, world)
    from tests.runtime.test_fsdp_checkpoint import train

    train(model, opt, MOE, rank, world)
    import torch.distributed.checkpoint as dcp

    dcp.save(opt.sharded_state_dict(), checkpoint_id=here + "-sharded")
    dist.barrier()
    if rank == 0:
        for cut, name in (("-cut", "__1_0.distcp"), ("-meta", ".metadata")):
            shutil.copytree(here + "-sharded", here + cut)
            size = os.path.getsize(f"{here}{cut}/{name}")
            os.truncate(f"{here}{cut}/{name}", size // 2)
    dist.barrier()
    # save_checkpoint's folder (a manifest of hashes): one byte of the third rank's file flipped
    from canzona.runtime.checkpoint_files import save_checkpoint

    save_checkpoint(opt.sharded_state_dict(), here + "-flip")
    dist.barrier()
    if rank == 0:
        with open(f"{here}-flip/__2_0.distcp", "r+b") as f:
            f.seek(os.path.getsize(f"{here}-flip/__2_0.distcp") // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    for cut in ("-cut", "-meta", "-flip"):
        model, opt = _fresh(MOE, world)
        before = opt.state_dict()
        got = outcome(lambda cut=cut, opt=opt: opt.load_sharded_state_dict(here + cut))
        got["untouched"] = nested_equal(opt.state_dict(), before)
        out[cut] = got
    # a late rank: rank 2 comes to the load only after the others' timeout
    model, opt = _fresh(MOE, world, timeout_s=LATE_TIMEOUT_S)
    dist.barrier()
    if rank == 2:
        time.sleep(3 * LATE_TIMEOUT_S)
    start = time.monotonic()
    out["late"] = outcome(lambda: opt.load_sharded_state_dict(here + "-sharded"))
    out["late"].pop("value", None)
    out["late"]["took"] = time.monotonic() - start
    return out


@functools.cache
def damaged() -> list[dict]:
    return _spawned(damaged_worker, 3)


def test_gradscaler_with_a_skipped_step_then_a_resume_is_the_uninterrupted_run() -> None:
    for rank, r in enumerate(damaged()):
        assert r["scale"] == 2.0 ** 9, (rank, r["scale"])  # the inf step was skipped, the scale halved
        exact = compare(r["amp resumed"], r["amp straight"])
        assert exact["bit_identical"], (rank, exact)
        assert r["zero1 scale"] == 2.0 ** 9, (rank, r["zero1 scale"])
        exact = compare(r["zero1 amp resumed"], r["zero1 amp straight"])
        assert exact["bit_identical"], (rank, "zero1", exact)


@pytest.mark.parametrize("cut", ["-cut", "-meta", "-flip"])
def test_a_truncated_dcp_file_is_one_error_on_every_rank(cut: str) -> None:
    got = [r[cut] for r in damaged()]
    for rank, g in enumerate(got):
        assert g["error"] == "CheckpointError", (rank, cut, g)
        assert g["untouched"] is None, (rank, cut, g["untouched"])
        assert "\n" not in g["message"], (rank, cut, g["message"])
    assert len({g["message"] for g in got}) == 1, [g["message"] for g in got]


def test_a_late_rank_is_an_error_within_the_timeout() -> None:
    got = [r["late"] for r in damaged()]
    for rank, g in enumerate(got[:2]):
        assert g["error"] is not None and g["canzona"], (rank, g)
        assert g["took"] < 3 * LATE_TIMEOUT_S, (rank, g)


# --- stacks sharded along their rows (fully_shard's shard_placement_fn: Shard(1), torchtitan's way
# when the experts are fewer than the FSDP ranks) --------------------------------------------------


def dim1_model(spec: TrainSpec, world: int, seed: int | None = None, torch_adamw: bool = False):
    """`fsdp_model`'s, each stack sharded along dim 1 (its matrices' rows, 32 over 2 ranks: FSDP2
    shards dims other than 0 evenly only) rather than its experts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from canzona.harness.training import build_model
    from canzona.runtime import DistributedOptimizer

    model = build_model(spec if seed is None else replace(spec, model_seed=seed))
    mesh = init_device_mesh("cpu", (world,))

    def place(p):
        return Shard(1) if p.ndim == 3 else None

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, shard_placement_fn=place)
    fully_shard(model, mesh=mesh, shard_placement_fn=place)
    if torch_adamw:
        return model, torch.optim.AdamW(model.parameters(), foreach=True)
    return model, DistributedOptimizer(model.named_parameters(), model.spec(), spec.optimizer, None, spec.adamw_config)


def dim1_worker(rank: int, world: int, path: str) -> dict[str, Any]:
    from tests.runtime.test_fsdp_checkpoint import full_params, load_params, train

    out: dict[str, Any] = {}
    model, opt = dim1_model(MOE, world, torch_adamw=True)
    train(model, opt, MOE, rank, world)
    names = {id(p): n for n, p in model.named_parameters()}
    out["torch"] = {names[id(p)]: {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in s.items()}
                    for p, s in opt.state.items()}
    for label, spec in (("fp32", MOE), ("bf16", BF16)):
        model, opt = dim1_model(spec, world)
        train(model, opt, spec, rank, world)
        ckpt = (full_params(model), opt.state_dict())
        sharded = outcome(lambda opt=opt: opt.sharded_state_dict())
        sharded.pop("value", None)
        train(model, opt, resume_spec(spec), rank, world)
        straight_final = full_params(model)
        model, opt = dim1_model(spec, world, seed=7)
        load_params(model, ckpt[0])
        opt.load_state_dict(ckpt[1])
        again = nested_equal(opt.state_dict(), ckpt[1])
        train(model, opt, resume_spec(spec), rank, world)
        out[label] = {"state": ckpt[1], "straight": straight_final, "resumed": full_params(model),
                      "round trip": again, "sharded": sharded}
    return out


@functools.cache
def dim1() -> list[dict]:
    return _spawned(dim1_worker, 2)


def test_stacks_sharded_along_rows_hold_torch_adamws_state() -> None:
    from canzona.runtime.checkpoint import state_by_name

    for rank, r in enumerate(dim1()):
        _, _, state = state_by_name(r["fp32"]["state"])
        for name, theirs in r["torch"].items():
            if theirs["exp_avg"].ndim != 3:
                continue
            count = sum(k.startswith(name + "[") for k in state)
            got = {f: torch.stack([state[f"{name}[{k}]"][f] for k in range(count)]).reshape(theirs[f].shape)
                   for f in ("exp_avg", "exp_avg_sq")}
            for f in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(got[f], theirs[f]), (rank, name, f)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_stacks_sharded_along_rows_resume_bit_for_bit(dtype: str) -> None:
    for rank, r in enumerate(dim1()):
        got = r[dtype]
        assert got["round trip"] is None, (rank, dtype, got["round trip"])
        exact = compare(got["resumed"], got["straight"])
        assert exact["bit_identical"], (rank, dtype, exact)
        # the sharded form refuses a piece that is no contiguous range, in one line
        assert got["sharded"]["error"] is None or got["sharded"]["canzona"], (rank, got["sharded"])


# --- a rank killed before a load: the others' error within the timeout, never a hang -------------


def killed_worker(rank: int, world: int, root: str) -> str:
    """Rank 2 dies (os._exit) before load_sharded_state_dict; the others write their outcome and
    how long it took to `root`/<rank>.json (the harness reports the death)."""
    import json
    import os
    import time

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from tests.runtime.test_fsdp_checkpoint import train

    model, opt = fsdp_model(MOE, world)
    train(model, opt, MOE, rank, world)
    dcp.save(opt.sharded_state_dict(), checkpoint_id=root + "/ckpt")
    model, opt = _fresh(MOE, world, timeout_s=LATE_TIMEOUT_S)
    dist.barrier()
    if rank == 2:
        os._exit(1)
    start = time.monotonic()
    got = outcome(lambda: opt.load_sharded_state_dict(root + "/ckpt"))
    got.pop("value", None)
    got["took"] = time.monotonic() - start
    with open(f"{root}/{rank}.json", "w") as f:
        json.dump(got, f)
    return "done"


def test_a_killed_rank_is_an_error_on_the_others_within_the_timeout() -> None:
    import json
    import os

    root = tempfile.mkdtemp(prefix="canzona-stack-edges-")
    with pytest.raises(Exception, match="rank 2"):  # the harness names the dead rank
        run_ranks(killed_worker, 3, root, deadline_s=DEADLINE_S, collective_timeout_s=60)
    for rank in (0, 1):
        path = f"{root}/{rank}.json"
        assert os.path.exists(path), (rank, "no outcome: killed by the harness while waiting (a hang)")
        with open(path) as f:
            got = json.load(f)
        assert got["error"] is not None and got["canzona"], (rank, got)
        assert got["took"] < 3 * LATE_TIMEOUT_S, (rank, got)


# --- the stacks in a param group of their own (other lr, no weight decay) ---------------------------

STACK_GROUP = {"lr": 3e-3, "weight_decay": 0.0}


def grouped(model, spec: TrainSpec):
    """The canzona optimizer over two groups: the stacks (STACK_GROUP), the rest (defaults)."""
    from canzona.runtime import DistributedOptimizer

    named = list(model.named_parameters())
    stacks = [(n, p) for n, p in named if p.ndim == 3]
    groups = [{"params": [(n, p) for n, p in named if p.ndim != 3]}, {"params": stacks, **STACK_GROUP}]
    return DistributedOptimizer(groups, model.spec(), spec.optimizer, None, spec.adamw_config)


def grouped_worker(rank: int, world: int, path: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from canzona.harness.training import build_model
    from tests.runtime.test_fsdp_checkpoint import full_params, load_params, train

    out: dict[str, Any] = {}
    for label, spec in (("fp32", MOE), ("bf16", BF16)):
        model, _ = fsdp_model(spec, world)
        opt = grouped(model, spec)
        train(model, opt, spec, rank, world)
        ckpt = (full_params(model), opt.state_dict())
        dcp.save(opt.sharded_state_dict(), checkpoint_id=f"{path}-{label}")
        train(model, opt, resume_spec(spec), rank, world)
        straight_final = full_params(model)
        res = {}
        for form in ("full", "sharded"):
            model, _ = fsdp_model(spec, world, seed=7)
            opt = grouped(model, spec)
            load_params(model, ckpt[0])
            opt.load_state_dict(ckpt[1]) if form == "full" else \
                opt.load_sharded_state_dict(f"{path}-{label}", check_weights=True)
            again = nested_equal(opt.state_dict(), ckpt[1])
            train(model, opt, resume_spec(spec), rank, world)
            res[form] = {"round trip": again, "final": full_params(model)}
            # the same checkpoint under ZeRO-1 (the whole model on every rank): loaded, the same state
            whole = build_model(replace(spec, model_seed=7))
            with torch.no_grad():
                for n, p in whole.named_parameters():
                    p.copy_(ckpt[0][n])
            zero1 = grouped(whole, spec)
            zero1.load_state_dict(ckpt[1]) if form == "full" else \
                zero1.load_sharded_state_dict(f"{path}-{label}", check_weights=True)
            res[f"zero1 {form}"] = nested_equal(zero1.state_dict(), ckpt[1])
        out[label] = {"straight": straight_final, **res}
    return out


@functools.cache
def grouped_runs() -> list[dict]:
    return _spawned(grouped_worker, 3)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("form", ["full", "sharded"])
def test_stacks_in_their_own_group_resume_bit_for_bit_and_load_under_zero1(dtype: str, form: str) -> None:
    for rank, r in enumerate(grouped_runs()):
        got = r[dtype]
        assert got[form]["round trip"] is None, (rank, dtype, form, got[form]["round trip"])
        exact = compare(got[form]["final"], got["straight"])
        assert exact["bit_identical"], (rank, dtype, form, exact)
        assert got[f"zero1 {form}"] is None, (rank, dtype, form, got[f"zero1 {form}"])


# --- FSDP 4 -> FSDP 2 --------------------------------------------------------------------------------

MOE8 = replace(MOE, global_batch=8)  # divisible by 4 and 2 ranks


def four_worker(rank: int, world: int, path: str) -> dict[str, Any]:
    return straight(MOE8, rank, world, path)


def four_to_two_worker(rank: int, world: int, ckpt: tuple[dict, dict], path: str) -> dict[str, Any]:
    return {"full": resumed(MOE8, rank, world, ckpt, record=True),
            "sharded": resumed(MOE8, rank, world, (ckpt[0], path + "-sharded"), like=ckpt[1]),
            "dcp": outcome(lambda: torch_api_resumed(MOE8, rank, world, None, path))}


@functools.cache
def four_to_two() -> tuple[tuple[dict, dict], list[dict]]:
    path = tempfile.mkdtemp(prefix="canzona-stack-edges-") + "/four"
    ckpt = run_ranks(four_worker, 4, path, deadline_s=DEADLINE_S, collective_timeout_s=60)[0]["ckpt"]
    return ckpt, run_ranks(four_to_two_worker, 2, ckpt, path, deadline_s=DEADLINE_S, collective_timeout_s=60)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["full", "sharded", "dcp"])
def test_a_checkpoint_of_fsdp4_resumes_at_fsdp2_bit_for_bit(form: str) -> None:
    ckpt, ranks = four_to_two()
    want = emulate(resume_spec(MOE8), 2, load=ckpt, grads=ranks[0]["full"]["grads"])
    for rank, r in enumerate(ranks):
        got = r[form]
        if form == "dcp":
            assert got["error"] is None, (rank, got)
            assert nested_equal(got["value"]["state"], ckpt[1]) is None, rank
            got = got["value"]
        else:
            assert got["round trip"] is None, (rank, form, got["round trip"])
        exact = compare(got["final"], want)
        assert exact["bit_identical"], (rank, form, exact)
