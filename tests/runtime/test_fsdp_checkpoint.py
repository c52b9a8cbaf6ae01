"""Checkpoints of the FSDP2 runtime (`FsdpOptimizer.state_dict` / `load_state_dict`,
`canzona.runtime.fsdp_checkpoint`): the layout-independent form of the ZeRO-1 path (full tensors,
torch.optim's layout, canzona's header in every group), so that a checkpoint moves between FSDP
sizes and between FSDP2 and the ZeRO-1 `DistributedOptimizer`, and torch's own API
(`get_state_dict` / `set_state_dict`, `get/set_optimizer_state_dict` with `dcp.save` / `dcp.load`)
takes it.

Two spawned groups (the tiny model, `fully_shard` per decoder layer and at the root, fp32 Muon with
fp32 Newton-Schulz and SOAP; SAVE steps, a checkpoint, RESUME more on fresh data):
- FSDP 2: the uninterrupted runs (checkpoints taken mid-run: state_dict(), torch's full state dict,
  a DCP directory), resumed from each in a fresh model of other weights (bit for bit equal to the
  uninterrupted run); a ZeRO-1 run at DP 2 on the unsharded model resumed from the FSDP checkpoint,
  and an FSDP run resumed from a ZeRO-1 checkpoint (both bit for bit equal to the same kernels in
  one process continuing from the checkpoint); bf16 parameters with fp32 masters; a checkpoint of
  another model refused; every sharded load with `check_weights=True` (its own weights pass at
  every size and layout), and the weights of a later step beside a sharded checkpoint refused
  (fp32: the weights witness; bf16: the fp32 masters); bf16 weights loaded into the model after
  steps, then saved (the masters of those weights, the sharded save passing its own check), and
  the state dict beside weights of no save (the step starts from them); a fresh optimizer's
  state_dict() and sharded form loaded back after steps (torch's reset: a fresh optimizer's run);
  `dcp.async_save` of the model and both forms, its files written after RESUME more steps.
- FSDP 3: the FSDP 2 checkpoint resharded (state_dict() after loading it is the same checkpoint, bit
  for bit), and resumed from it and from the DCP directory.
"""

from __future__ import annotations

import functools
import re
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions

from canzona.harness.launch import run_ranks
from canzona.harness.training import (
    TrainSpec,
    build_model,
    compare,
    distributed_worker,
    emulate,
    global_batches,
    micro_batches,
)
from canzona.runtime.checkpoint import state_by_name, without_weights_witness
from tests.runtime.outcomes import outcome

pytestmark = pytest.mark.distributed  # spawns gloo process groups

SAVE, RESUME = 2, 2
SPECS = {
    "muon": TrainSpec(optimizer="muon", matrix_config={"ns_dtype": "fp32"}, steps=SAVE, global_batch=6),
    # SOAP: the first step only initialises (no update); the step count travels in the checkpoint
    "soap": TrainSpec(optimizer="soap", matrix_config={"precondition_frequency": 2}, steps=SAVE, global_batch=6),
}
BF16 = replace(SPECS["muon"], dtype="bf16")
# SOAP keeping one-sided factors of the 64-wide matrices where SPECS["soap"]'s keeps both: another state
OTHER_SOAP_STATE = replace(SPECS["soap"], matrix_config={**SPECS["soap"].matrix_config, "max_precond_dim": 48})
# AdamW on every parameter (no owners: each rank steps its own shards)
ADAMW = TrainSpec(optimizer="adamw", steps=SAVE, global_batch=6)
DEADLINE_S = 240.0
# torchtitan's OptimizersContainer (torchtitan/components/optimizer.py): get/set_optimizer_state_dict
# with this option, its checkpointer's default
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def resume_spec(spec: TrainSpec) -> TrainSpec:
    """The continuation: fresh data (another seed), RESUME steps."""
    return replace(spec, steps=RESUME, data_seed=7)


# --- in the ranks ---------------------------------------------------------------------------------


def fsdp_model(spec: TrainSpec, world: int, seed: int | None = None, hsdp: bool = False):
    """The tiny model under fully_shard over every rank (`hsdp`: replicated over every rank, as
    HSDP with one shard per replica), and its optimizer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from canzona.runtime import DistributedOptimizer

    model = build_model(spec if seed is None else replace(spec, model_seed=seed))
    mspec = model.spec()
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard")) if hsdp else \
        init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = DistributedOptimizer(model.named_parameters(), mspec, spec.optimizer, spec.matrix_config or None,
                               spec.adamw_config)
    return model, opt


def train(model, opt, spec: TrainSpec, rank: int, world: int, record: bool = False) -> list:
    """`spec.steps` steps on `spec`'s data; each step's global gradients when `record`."""
    grads = []
    vocab = model.spec().param("model.embed_tokens.weight").shape[0]
    for tokens in global_batches(spec, vocab):
        opt.zero_grad()
        (mb,) = micro_batches(tokens, rank, world, 1)
        model.loss(mb).backward()
        if record:
            named = dict(model.named_parameters())
            grads.append(({n: p.grad.full_tensor() for n, p in named.items()}, set(named)))
        opt.step()
    return grads


def full_params(model) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


@torch.no_grad()
def load_params(model, full: dict[str, torch.Tensor]) -> None:
    from canzona.runtime.fsdp_layout import local_box

    for n, p in model.named_parameters():
        p.to_local().copy_(full[n][local_box(p).index()].to(p.dtype))


def nested_equal(a: Any, b: Any, where: str = "state") -> str | None:
    """Where `a` and `b` differ (tensors: dtype, shape, bits), or None."""
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b)) if isinstance(b, dict) else b}"
        return next((d for k in a if (d := nested_equal(a[k], b[k], f"{where}.{k}"))), None)
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return where
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := nested_equal(x, y, f"{where}[{i}]"))), None)
    if isinstance(a, torch.Tensor):
        ok = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return None if ok else where
    return None if a == b else f"{where}: {a!r} != {b!r}"


def straight(spec: TrainSpec, rank: int, world: int, path: str | None = None) -> dict:
    """SAVE steps, the checkpoints (state_dict(); torch's full state dict; a DCP directory when
    `path`), RESUME more: the uninterrupted run."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, opt = fsdp_model(spec, world)
    train(model, opt, spec, rank, world)
    ckpt = (full_params(model), opt.state_dict())
    out: dict[str, Any] = {"ckpt": ckpt}
    if path is not None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        out["torch"] = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
        # as torchtitan saves: on rank 0 only, offloaded to the CPU
        rank0 = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        out["torch rank 0"] = rank0 if rank == 0 else ({}, {})
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=path)
        # as torchtitan's OptimizersContainer saves: flattened (`state.<name>.<field>` keys)
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt, options=FLAT)},
                 checkpoint_id=path + "-flat")
        sharded = opt.sharded_state_dict()
        out["sharded keys"] = sorted(sharded)
        dcp.save(sharded, checkpoint_id=path + "-sharded")  # each rank its own pieces
        out["untouched"] = nested_equal(opt.state_dict(), ckpt[1])  # None: taking them changed nothing
    train(model, opt, resume_spec(spec), rank, world)
    out["final"] = full_params(model)
    return out


def resumed(spec: TrainSpec, rank: int, world: int, ckpt: tuple[dict, dict | str], record: bool = False,
            like: dict | None = None, hsdp: bool = False, save: str | None = None,
            optimizer_first: bool = False) -> dict:
    """A fresh model of other weights loads the checkpoint (a state_dict(), or the directory of a
    sharded one) and runs RESUME steps; state_dict() right after loading is compared with `like`
    (default: the state dict loaded); `save`: a sharded checkpoint of the state after the steps;
    `optimizer_first`: the state dict loaded before the model's weights (torch's set_state_dict's order)."""
    model, opt = fsdp_model(spec, world, seed=7, hsdp=hsdp)
    if optimizer_first:
        opt.load_state_dict(ckpt[1])
        load_params(model, ckpt[0])
    elif isinstance(ckpt[1], str):  # the weights it was saved with: not refused
        load_params(model, ckpt[0])
        opt.load_sharded_state_dict(ckpt[1], check_weights=True)
    else:
        load_params(model, ckpt[0])
        opt.load_state_dict(ckpt[1])
    again = nested_equal(opt.state_dict(), like if like is not None else ckpt[1])
    grads = train(model, opt, resume_spec(spec), rank, world, record=record)
    out = {"final": full_params(model), "round trip": again, "grads": grads}
    if save is not None:
        import torch.distributed.checkpoint as dcp

        dcp.save(opt.sharded_state_dict(), checkpoint_id=save)
        out["state"] = opt.state_dict()
    return out


def torch_api_resumed(spec: TrainSpec, rank: int, world: int, full: tuple[dict, dict] | None,
                      path: str | None, from_rank0: bool = False, options: Any = None) -> dict:
    """Resumed through torch's API: set_state_dict from a full state dict (every rank's, or rank
    0's broadcast), or dcp.load into the template get_model/optimizer_state_dict give (with
    `options`: torchtitan's FLAT, the template and the load flattened)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
        set_state_dict,
    )

    model, opt = fsdp_model(spec, world, seed=7)
    out: dict[str, Any] = {}
    if from_rank0:  # one call each (set_state_dict takes a rank's empty model state dict for optim_only)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full[0], options=options)
        set_optimizer_state_dict(model, opt, full[1], options=options)
    elif full is not None:
        set_state_dict(model, opt, model_state_dict=full[0], optim_state_dict=full[1],
                       options=StateDictOptions(full_state_dict=True))
    else:
        template = get_optimizer_state_dict(model, opt, options=options)
        entries = template["state"].values() if "state" in template else \
            [{"canzona_stepped": v} for k, v in template.items() if k.endswith(".canzona_stepped")]
        out["template stepped"] = any(s["canzona_stepped"] for s in entries)
        state = {"model": get_model_state_dict(model), "optim": template}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"], options=options)
    out["state"] = opt.state_dict()
    train(model, opt, resume_spec(spec), rank, world)
    out["final"] = full_params(model)
    return out


def rank0_full_state(spec: TrainSpec, rank: int, world: int, ckpt: tuple[dict, dict]) -> tuple[dict, dict]:
    """Torch's full state dicts of a model and optimizer given the checkpoint, on rank 0 only
    (`full_state_dict=True, cpu_offload=True`: as torchtune saves, to broadcast them on resume)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = fsdp_model(spec, world, seed=7)
    load_params(model, ckpt[0])
    opt.load_state_dict(ckpt[1])
    full = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return full if rank == 0 else ({}, {})


def _flat_resumed(spec: TrainSpec, rank: int, world: int, path: str) -> dict:
    """torchtitan's flattened checkpoint, resumed as torchtitan does (`outcome`: before, torch's
    unflattening was a raw KeyError)."""
    got = outcome(lambda: torch_api_resumed(spec, rank, world, None, path, options=FLAT))
    return got["value"] if got["error"] is None else got


class _HeldWriter:
    """DCP's file writer whose write waits until `release` is set (the training loop stepped):
    then the files hold what the stager kept at `async_save`, whatever the step wrote since."""

    def __new__(cls, path: str, release: Any):
        from torch.distributed.checkpoint import FileSystemWriter

        class Held(FileSystemWriter):
            def write_data(self, plan, planner):
                if not release.wait(60):  # written before the loop stepped on: the test would prove nothing
                    raise RuntimeError("the training loop did not step on within 60 s of async_save")
                return super().write_data(plan, planner)

        return Held(path)


def async_saved(spec: TrainSpec, rank: int, world: int, path: str, stager: Any = None) -> dict:
    """torchtitan's async checkpoint under FSDP2: `straight`'s SAVE steps, then one `dcp.async_save`
    of the model's state dict (DTensors over the live shards), torch's optimizer state dict and
    canzona's sharded form (views of the live state) on a gloo group of its own, RESUME steps while
    it writes (its files written only after them: `_HeldWriter`), then the wait; each form resumed
    by a fresh model. `stager`: DCP's `async_stager` (default: the one `async_save` builds without
    one, `DefaultStager` with every option off, which copies the tensors before it returns)."""
    import threading

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
    )

    model, opt = fsdp_model(spec, world)
    train(model, opt, spec, rank, world)
    saves = dist.new_group(backend="gloo")
    at_save = opt.state_dict()
    stepped = threading.Event()
    stager = stager or DefaultStager(StagingOptions(False, False, False, False))
    pending = dcp.async_save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
                              **opt.sharded_state_dict()}, storage_writer=_HeldWriter(path, stepped),
                             process_group=saves, async_stager=stager)
    train(model, opt, resume_spec(spec), rank, world)  # RESUME steps while the save waits to write
    stepped.set()
    pending.result()
    stager.close()
    moved_on = nested_equal(opt.state_dict(), at_save) is not None
    out = {"moved on": moved_on, "final": full_params(model), "at save": at_save,
           "dcp": torch_api_resumed(spec, rank, world, None, path)}
    # the model from the save, canzona's sharded form beside it (checked against its weights)
    model, opt = fsdp_model(spec, world, seed=7)
    weights = {"model": get_model_state_dict(model)}
    dcp.load(weights, checkpoint_id=path)
    set_model_state_dict(model, weights["model"])
    opt.load_sharded_state_dict(path, check_weights=True)
    out["sharded"] = {"round trip": nested_equal(opt.state_dict(), at_save)}
    train(model, opt, resume_spec(spec), rank, world)
    out["sharded"]["final"] = full_params(model)
    return out


def refused(spec: TrainSpec, rank: int, world: int, other: dict | None = None) -> str:
    """The error loading `other` (default: a checkpoint of another model) raises."""
    if other is None:
        other = fsdp_model(replace(spec, preset="tiny-untied"), world)[1].state_dict()
    _, opt = fsdp_model(spec, world)
    try:
        opt.load_state_dict(other)
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "loaded"


def with_a_field_of_no_optimizer(spec: TrainSpec, rank: int, world: int, ckpt: tuple[dict, dict]) -> dict:
    """A fresh model given the checkpoint's weights loads its state_dict() with a field no optimizer
    keeps added to every entry (a hand edit, a converter's extra): what loading raised, and where
    state_dict() after it differs from the checkpoint (None: nowhere)."""
    model, opt = fsdp_model(spec, world, seed=7)
    load_params(model, ckpt[0])
    edited = {**ckpt[1], "state": {k: {**s, "note": torch.zeros(1)} for k, s in ckpt[1]["state"].items()}}
    got = outcome(lambda: opt.load_state_dict(edited))
    return {"error": got.get("message"), "state": nested_equal(opt.state_dict(), ckpt[1])}


def mixed(spec: TrainSpec, rank: int, world: int, params: dict, path: str) -> dict:
    """A fresh model given `params`, which are not the weights the sharded checkpoint at `path`
    was saved with, loads it with `check_weights`: the error, and the state before and after."""
    model, opt = fsdp_model(spec, world, seed=7)
    load_params(model, params)
    before = opt.state_dict()
    try:
        opt.load_sharded_state_dict(path, check_weights=True)
        refused = "loaded"
    except Exception as e:  # noqa: BLE001 - the message is the result
        refused = f"{type(e).__name__}: {e}"
    return {"refused": refused, "unchanged": nested_equal(opt.state_dict(), before)}


def stepped_beside(spec: TrainSpec, rank: int, world: int, params: dict, state: dict | str, torch_api: bool = False,
                   check_weights: bool | None = None) -> dict:
    """A fresh model given `params`, which are not the weights `state` (a state_dict(), a sharded
    checkpoint's folder, or with `torch_api` torch's full state dicts of model and optimizer) was
    saved with: `load_state_dict` (`load_sharded_state_dict(check_weights=...)`) after the model,
    or torch's `set_state_dict` (the optimizer first), then one step: its error, and whether the
    weights stayed as they were (None: they did)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    model, opt = fsdp_model(spec, world, seed=7)
    if torch_api:
        set_state_dict(model, opt, model_state_dict={**state[0], **params}, optim_state_dict=state[1],
                       options=StateDictOptions(full_state_dict=True))
    else:
        load_params(model, params)
        if isinstance(state, str):
            opt.load_sharded_state_dict(state, check_weights=check_weights)
        else:
            opt.load_state_dict(state)
    before = full_params(model)
    try:
        train(model, opt, replace(resume_spec(spec), steps=1), rank, world)
        refused = "stepped"
    except Exception as e:  # noqa: BLE001 - the message is the result
        refused = f"{type(e).__name__}: {e}"
    return {"refused": refused, "unchanged": nested_equal(full_params(model), before)}


def weights_checked(spec: TrainSpec, rank: int, world: int, path: str) -> dict:
    """SAVE steps and a sharded checkpoint, one step more: that step's weights beside the
    checkpoint are refused (`mixed`), the checkpoint's own load (the state it saved)."""
    import torch.distributed.checkpoint as dcp

    model, opt = fsdp_model(spec, world)
    train(model, opt, spec, rank, world)
    saved, state = full_params(model), opt.state_dict()
    dcp.save(opt.sharded_state_dict(), checkpoint_id=path)
    train(model, opt, replace(resume_spec(spec), steps=1), rank, world)
    out = mixed(spec, rank, world, full_params(model), path)
    fresh_model, fresh = fsdp_model(spec, world, seed=7)
    load_params(fresh_model, saved)
    fresh.load_sharded_state_dict(path, check_weights=True)
    out["whole"] = nested_equal(fresh.state_dict(), state)
    return out


def loaded_then_saved(spec: TrainSpec, rank: int, world: int, path: str) -> dict:
    """bf16 (fp32 masters): SAVE steps, then weights of another source loaded into the model (a
    rollback, pretrained weights) and the state saved, full and sharded: each holds the masters
    of the weights as they are, and the sharded one loads beside them with `check_weights`. Then
    the full state beside weights of no save (every tensor off its master's cast), written into
    the model before or after `load_state_dict` (which checks no weights, as torch's): one step
    from them, as from fresh masters of them."""
    import torch.distributed.checkpoint as dcp

    model, opt = fsdp_model(spec, world)
    train(model, opt, spec, rank, world)
    load_params(model, build_model(replace(spec, model_seed=3)).state_dict())
    full = opt.state_dict()
    dcp.save(opt.sharded_state_dict(), checkpoint_id=path)
    weights = full_params(model)
    masters = {n: s["master"] for n, s in state_by_name(full)[2].items()}
    out: dict[str, Any] = {"stale masters": sorted(n for n, w in weights.items() if not masters[n].to(w.dtype).equal(w))}
    fresh_model, fresh = fsdp_model(spec, world, seed=7)
    load_params(fresh_model, weights)
    try:
        fresh.load_sharded_state_dict(path, check_weights=True)
        out["sharded"] = nested_equal(fresh.state_dict(), full)
    except Exception as e:  # noqa: BLE001 - the message is the result
        out["sharded"] = f"{type(e).__name__}: {e}"
    other = {n: w * 1.5 for n, w in weights.items()}
    full = without_weights_witness(full)  # beside other weights on purpose: its first step would refuse them

    def beside_other(order: str) -> dict[str, torch.Tensor]:
        model, opt = fsdp_model(spec, world, seed=7)
        if order == "optimizer first":
            opt.load_state_dict(full)
        load_params(model, other)
        if order != "optimizer first":
            opt.load_state_dict(full)
        if order == "fresh masters":
            opt.reset_master_weights()
        train(model, opt, replace(resume_spec(spec), steps=1), rank, world)
        return full_params(model)

    want = beside_other("fresh masters")
    for order in ("model first", "optimizer first"):
        out[f"other weights, {order}"] = compare(beside_other(order), want)["bit_identical"]
    return out


def reset(spec: TrainSpec, rank: int, world: int, path: str) -> dict:
    """torch.optim's reset (`opt.load_state_dict(initial)`, `initial` taken before the first step:
    after a loss spike, between tasks): the optimizer's state_dict() and its sharded form (saved
    at `path`) taken before any step, SAVE steps, then each loaded back into it and RESUME steps
    on (the weights set back between the two), against a fresh optimizer beside the same weights
    (torch's empty state: moments from zero, step counts from 1)."""
    import torch.distributed.checkpoint as dcp

    model, opt = fsdp_model(spec, world)
    initial = opt.state_dict()
    dcp.save(opt.sharded_state_dict(), checkpoint_id=path)
    train(model, opt, spec, rank, world)
    weights = full_params(model)
    fresh_model, fresh = fsdp_model(spec, world, seed=7)
    load_params(fresh_model, weights)
    train(fresh_model, fresh, resume_spec(spec), rank, world)
    want = full_params(fresh_model)
    out: dict[str, Any] = {}
    for how in ("state_dict", "sharded"):
        load_params(model, weights)
        try:
            if how == "state_dict":
                opt.load_state_dict(initial)
            else:
                opt.load_sharded_state_dict(path)
            train(model, opt, resume_spec(spec), rank, world)
            out[how] = compare(full_params(model), want)["bit_identical"]
        except Exception as e:  # noqa: BLE001 - the message is the result
            out[how] = f"{type(e).__name__}: {e}"
    return out


def adamw_forms(rank: int, world: int, path: str) -> dict:
    """AdamW's FSDP2 step through every checkpoint form, each resumed by a fresh model of other
    weights: state_dict(), the sharded form, torch's full state dict (set_state_dict), dcp of
    get_optimizer_state_dict, and torchtitan's flattened one."""
    run = straight(ADAMW, rank, world, path)
    return {"straight": run, "resumed": resumed(ADAMW, rank, world, run["ckpt"]),
            "sharded": resumed(ADAMW, rank, world, (run["ckpt"][0], path + "-sharded"), like=run["ckpt"][1]),
            "torch full": torch_api_resumed(ADAMW, rank, world, run["torch"], None),
            "dcp": torch_api_resumed(ADAMW, rank, world, None, path),
            "dcp flat": _flat_resumed(ADAMW, rank, world, path + "-flat")}


def fsdp2_worker(rank: int, world: int, path: str) -> dict:
    out: dict[str, Any] = {"adamw": adamw_forms(rank, world, path + "-adamw")}
    for name, spec in SPECS.items():
        run = straight(spec, rank, world, path if name == "muon" else None)
        out[name] = {"straight": run, "resumed": resumed(spec, rank, world, run["ckpt"])}
    muon, run = SPECS["muon"], out["muon"]["straight"]
    out["torch full"] = torch_api_resumed(muon, rank, world, run["torch"], None)
    out["torch rank 0"] = torch_api_resumed(muon, rank, world, run["torch rank 0"], None, from_rank0=True)
    out["dcp"] = torch_api_resumed(muon, rank, world, None, path)
    out["dcp flat"] = _flat_resumed(muon, rank, world, path + "-flat")
    out["async"] = async_saved(muon, rank, world, path + "-async")
    # FSDP -> ZeRO-1 (the unsharded model, DP 2), and ZeRO-1 -> FSDP
    out["zero1 from fsdp"] = distributed_worker(rank, world, resume_spec(muon), {"load": run["ckpt"]})["params"]
    zero1 = distributed_worker(rank, world, muon, {"save_sharded": path + "-zero1"})
    out["zero1 ckpt"] = (zero1["params"], zero1["state"])
    out["fsdp from zero1"] = resumed(muon, rank, world, out["zero1 ckpt"], record=True)
    # the sharded form (sharded_state_dict / load_sharded_state_dict): FSDP 2 -> FSDP 2, FSDP -> ZeRO-1,
    # ZeRO-1 -> FSDP
    params = run["ckpt"][0]
    out["sharded"] = resumed(muon, rank, world, (params, path + "-sharded"), like=run["ckpt"][1])
    out["zero1 from fsdp sharded"] = distributed_worker(rank, world, resume_spec(muon),
                                                        {"load": (params, path + "-sharded"),
                                                         "check_weights": True})["params"]
    # the weights of RESUME steps later beside the sharded checkpoint (fp32: no masters, the
    # witness); bf16 with fp32 masters, the weights of one step later
    out["mix"] = mixed(muon, rank, world, run["final"], path + "-sharded")
    out["bf16 mix"] = weights_checked(BF16, rank, world, path + "-bf16")
    # the checkpoint's state_dict() (torch's full state dicts) beside the weights of RESUME steps
    # later: refused at the first step, loaded after the model and before it (torch's order)
    out["state dict mix"] = stepped_beside(muon, rank, world, run["final"], run["ckpt"][1])
    out["torch mix"] = stepped_beside(muon, rank, world, run["final"], run["torch"], torch_api=True)
    # the sharded form without check_weights (refused at the first step), and with
    # check_weights=False (beside those weights on purpose: steps on)
    out["unchecked mix"] = stepped_beside(muon, rank, world, run["final"], path + "-sharded")
    out["unchecked on purpose"] = stepped_beside(muon, rank, world, run["final"], path + "-sharded", check_weights=False)
    out["bf16 loaded then saved"] = loaded_then_saved(BF16, rank, world, path + "-bf16-loaded")
    out["reset"] = reset(muon, rank, world, path + "-initial")
    out["fsdp from zero1 sharded"] = resumed(muon, rank, world, (zero1["params"], path + "-zero1"),
                                             like=zero1["state"])
    # HSDP (every rank a replica of one shard): the FSDP checkpoint in, its sharded one out to FSDP
    out["hsdp"] = resumed(muon, rank, world, run["ckpt"], record=True, hsdp=True, save=path + "-hsdp")
    out["fsdp from hsdp"] = resumed(muon, rank, world, (out["hsdp"]["final"], path + "-hsdp"),
                                    like=out["hsdp"]["state"])
    bf16 = straight(BF16, rank, world)
    out["bf16"] = {"straight": bf16, "resumed": resumed(BF16, rank, world, bf16["ckpt"]),
                   # the same state dict again (the run before must have left it as it was)
                   "optimizer first": resumed(BF16, rank, world, bf16["ckpt"], optimizer_first=True)}
    # SOAP's eigenbases through rank 0's broadcast (torch's `_broadcast_tensors` sends a tensor's
    # storage as it lies: a transposed one arrived transposed)
    soap = SPECS["soap"]
    full = rank0_full_state(soap, rank, world, out["soap"]["straight"]["ckpt"])
    got = outcome(lambda: torch_api_resumed(soap, rank, world, full, None, from_rank0=True))
    out["soap torch rank 0"] = got["value"] if got["error"] is None else got
    out["other model"] = refused(muon, rank, world)
    out["extra field"] = with_a_field_of_no_optimizer(muon, rank, world, run["ckpt"])
    out["other optimizer"] = refused(muon, rank, world, out["soap"]["straight"]["ckpt"][1])
    out["other soap state"] = refused(OTHER_SOAP_STATE, rank, world, out["soap"]["straight"]["ckpt"][1])
    # rank 0 given the checkpoint, rank 1 a later state of the same run (files of two saves)
    out["two saves"] = refused(muon, rank, world, run["ckpt"][1] if rank == 0 else out["hsdp"]["state"])
    return out


def fsdp3_worker(rank: int, world: int, ckpt: tuple[dict, dict], path: str) -> dict:
    muon = SPECS["muon"]
    return {"resumed": resumed(muon, rank, world, ckpt, record=True),
            "sharded": resumed(muon, rank, world, (ckpt[0], path + "-sharded"), like=ckpt[1]),
            "dcp": torch_api_resumed(muon, rank, world, None, path)}


# --- the runs -----------------------------------------------------------------------------------


STAGES = replace(SPECS["muon"], steps=3, global_batch=4)  # the save after step 2, the resume runs step 3
STAGE_TIMEOUT_S = 10.0
STAGE_WAIT_S = 100.0  # how long the second stage waits for the first to be done


def stages_worker(rank: int, world: int, root: str) -> dict:
    """Pipeline stages under FSDP2 (torchtitan's PP x FSDP: a (pp, dp) mesh, each stage's model
    sharded over its `dp` row, an FsdpOptimizer of its half of the parameters): each stage trains,
    `dcp.save`s its weights and sharded optimizer state over its own group, resumes from them (a
    fresh model of other weights and optimizer, `load_sharded_state_dict(check_weights=True)`) and
    steps: bit for bit the stage trained without a break. The second stage starts only when the
    first is done (a file says so). Before, building an FsdpOptimizer created its process groups
    with `dist.new_group`, a collective over every rank, and the load's checks and `dcp.load` ran
    over every rank: the first stage waited for the second, which never came."""
    import time
    from pathlib import Path

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from canzona.runtime import DistributedOptimizer

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    stage, dp = mesh.get_local_rank("pp"), mesh["dp"]
    group, folder, done = dp.get_group(), Path(root) / f"stage{stage}", Path(root) / "stage0.done"

    def fresh(seed: int):
        model = build_model(replace(STAGES, model_seed=seed))
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp)
        fully_shard(model, mesh=dp)
        names = [n for n, _ in model.named_parameters()]
        mine = set(names[:len(names) // 2] if stage == 0 else names[len(names) // 2:])
        spec = model.spec()
        spec = replace(spec, params=tuple(p for p in spec.params if p.name in mine))
        params = {n: p for n, p in model.named_parameters() if n in mine}
        opt = DistributedOptimizer(list(params.items()), spec, STAGES.optimizer, STAGES.matrix_config,
                                   group=dp, timeout_s=STAGE_TIMEOUT_S)
        return model, params, opt

    vocab = build_model(STAGES).spec().param("model.embed_tokens.weight").shape[0]
    batches = global_batches(STAGES, vocab)

    def train(model, opt, steps) -> None:
        for k in steps:
            opt.zero_grad()
            model.zero_grad()
            (mb,) = micro_batches(batches[k], dp.get_local_rank(), dp.size(), 1)
            model.loss(mb).backward()
            opt.step()

    try:
        if stage == 1:
            end = time.monotonic() + STAGE_WAIT_S
            while not done.exists() and time.monotonic() < end:
                time.sleep(0.05)
        model, params, opt = fresh(stage)
        train(model, opt, range(STAGES.steps))
        want = {n: p.full_tensor().detach().clone() for n, p in params.items()}
        model, params, opt = fresh(stage)
        train(model, opt, range(STAGES.steps - 1))
        # the whole model's weights (the other stage's half, not stepped here, feeds this one's loss)
        dcp.save({**dict(model.named_parameters()), **opt.sharded_state_dict()}, checkpoint_id=folder,
                 process_group=group)
        model, params, opt = fresh(7 + stage)
        dcp.load(dict(model.named_parameters()), checkpoint_id=folder, process_group=group)
        opt.load_sharded_state_dict(folder, check_weights=True)
        train(model, opt, range(STAGES.steps - 1, STAGES.steps))
        got = {n: p.full_tensor().detach() for n, p in params.items()}
        return {"bit for bit": compare(got, want)["bit_identical"]}
    except Exception as e:  # noqa: BLE001 - the test reads it
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    finally:
        if stage == 0:
            dist.barrier(group=group)
            if dp.get_local_rank() == 0:
                done.touch()


def test_fsdp_pipeline_stages_each_save_and_resume_on_their_own_ranks() -> None:
    """Each stage's optimizer is built, saved and loaded by its own ranks alone (its groups are its
    mesh's), at its own time: bit for bit the uninterrupted stage."""
    import tempfile

    runs = run_ranks(stages_worker, 4, tempfile.mkdtemp(prefix="canzona-fsdp-stages-"), deadline_s=DEADLINE_S)
    assert runs == [{"bit for bit": True}] * 4


@functools.cache
def _dcp_dir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="canzona-fsdp-ckpt-")


@functools.cache
def run2() -> list[dict]:
    return run_ranks(fsdp2_worker, 2, _dcp_dir() + "/dcp", deadline_s=DEADLINE_S)


@functools.cache
def run3() -> list[dict]:
    return run_ranks(fsdp3_worker, 3, run2()[0]["muon"]["straight"]["ckpt"], _dcp_dir() + "/dcp",
                     deadline_s=DEADLINE_S)


# --- same FSDP size -----------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", list(SPECS))
def test_resume_at_the_same_size_is_bit_for_bit(optimizer: str) -> None:
    ranks = run2()
    for rank, r in enumerate(ranks):
        run = r[optimizer]
        assert run["resumed"]["round trip"] is None, (rank, run["resumed"]["round trip"])
        exact = compare(run["resumed"]["final"], run["straight"]["final"])
        assert exact["bit_identical"], (rank, exact)
        # identical on every rank, in torch.optim's layout, every parameter stepped
        assert nested_equal(run["straight"]["ckpt"][1], ranks[0][optimizer]["straight"]["ckpt"][1]) is None
    sd = ranks[0][optimizer]["straight"]["ckpt"][1]
    header, _, state = state_by_name(sd)
    assert header["optimizer"] == optimizer
    assert [g["kind"] for g in sd["param_groups"]] == ["matrix", "adamw"]
    shapes = {n: tuple(p.shape) for n, p in build_model(SPECS[optimizer]).named_parameters()}
    assert set(state) == set(shapes) and all(sd["state"][i]["canzona_stepped"] for i in sd["state"])
    for name, s in state.items():
        assert all(v.shape[0] in (shapes[name][0], shapes[name][-1]) for v in s.values()
                   if isinstance(v, torch.Tensor) and v.dim()), name


def test_state_dict_equals_the_zero1_form() -> None:
    """The same fields, shapes and dtypes as the ZeRO-1 layout's state dict of the same model."""
    ranks = run2()
    fsdp = state_by_name(ranks[0]["muon"]["straight"]["ckpt"][1])
    zero1 = state_by_name(ranks[0]["zero1 ckpt"][1])
    assert fsdp[0] == zero1[0] and fsdp[1] == zero1[1]
    for name, s in zero1[2].items():
        got = fsdp[2][name]
        assert set(got) == set(s), name
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                assert got[k].shape == v.shape and got[k].dtype == v.dtype, (name, k)
            else:
                assert got[k] == v, (name, k)


def test_bf16_masters_round_trip() -> None:
    ranks = run2()
    for rank, r in enumerate(ranks):
        run = r["bf16"]
        assert run["resumed"]["round trip"] is None, (rank, run["resumed"]["round trip"])
        for how in ("resumed", "optimizer first"):  # the latter: torch's set_state_dict's order
            exact = compare(run[how]["final"], run["straight"]["final"])
            assert exact["bit_identical"], (rank, how, exact)
    state = state_by_name(ranks[0]["bf16"]["straight"]["ckpt"][1])[2]
    shapes = {n: tuple(p.shape) for n, p in build_model(BF16).named_parameters()}
    assert set(state) == set(shapes)
    for name, s in state.items():  # fp32 masters and state, the model bf16
        assert s["master"].dtype == torch.float32 and tuple(s["master"].shape) == shapes[name], name
        assert all(v.dtype == torch.float32 for v in s.values() if isinstance(v, torch.Tensor)), name
        assert s["master"].bfloat16().equal(ranks[0]["bf16"]["straight"]["ckpt"][0][name]), name


# --- torch's API --------------------------------------------------------------------------------


def test_torch_get_set_state_dict_resumes_bit_for_bit() -> None:
    for rank, r in enumerate(run2()):
        want = r["muon"]["straight"]
        assert want["untouched"] is None, (rank, want["untouched"])  # no zero-gradient step of torch's
        model_sd, optim_sd = want["torch"]
        # keyed by the parameters' names (the model's state dict adds the tied lm_head), full tensors
        assert set(optim_sd["state"]) == {n for n, _ in build_model(SPECS["muon"]).named_parameters()} < set(model_sd)
        shapes = {n: tuple(p.shape) for n, p in build_model(SPECS["muon"]).named_parameters()}
        assert all(tuple(optim_sd["state"][n]["exp_avg" if "norm" in n or "embed" in n else "momentum_buffer"].shape)
                   == shape for n, shape in shapes.items())
        for how in ("torch full", "torch rank 0"):  # every rank's full state dict, or rank 0's broadcast
            assert nested_equal(r[how]["state"], want["ckpt"][1]) is None, how
            exact = compare(r[how]["final"], want["final"])
            assert exact["bit_identical"], (rank, how, exact)
    assert run2()[1]["muon"]["straight"]["torch rank 0"] == ({}, {})  # offloaded to rank 0 alone


def test_soaps_state_broadcast_from_rank_0_resumes_bit_for_bit() -> None:
    """torchtune's resume: rank 0's full state dicts (`cpu_offload=True`) handed to `set_model_state_dict`
    / `set_optimizer_state_dict` with `broadcast_from_rank0=True`. Before: SOAP's eigenbases were
    transposed views (`state_dict()` kept eigh's column-major layout), which torch's broadcast sent
    as they lie in memory, so the other ranks received them transposed: 'rank(s) [0] ... were given
    another state dict than this rank' on every rank, nothing loaded."""
    for rank, r in enumerate(run2()):
        got, want = r["soap torch rank 0"], r["soap"]["straight"]
        assert "error" not in got, (rank, got)
        assert nested_equal(got["state"], want["ckpt"][1]) is None, rank
        exact = compare(got["final"], want["final"])
        assert exact["bit_identical"], (rank, exact)


@pytest.mark.parametrize("how", ["dcp", "dcp flat"])
def test_dcp_save_load_resumes_bit_for_bit(how: str) -> None:
    """"dcp flat": torchtitan's `flatten_optimizer_state_dict=True` (before: a raw KeyError)."""
    for rank, r in enumerate(run2()):
        want = r["muon"]["straight"]
        assert "error" not in r[how], r[how]
        assert r[how]["template stepped"] is False  # a fresh optimizer's template of zeros
        assert nested_equal(r[how]["state"], want["ckpt"][1]) is None
        exact = compare(r[how]["final"], want["final"])
        assert exact["bit_identical"], (rank, exact)


def test_an_async_save_holds_the_state_at_the_call_while_the_loop_steps_on() -> None:
    """`dcp.async_save` of the model and the optimizer (torch's form and canzona's sharded one, in
    one save, on a gloo group of its own, CPU tensors), its files written only after the loop took
    RESUME more steps: each form resumes bit for bit as the synchronous save taken at that point
    (`straight`'s), the state loaded equal to the state at the call. DCP's staging copies the
    tensors before `async_save` returns, on the CPU too (found so; a stager that copies nothing, in
    place of torch's, writes the weights of two steps later and the resume is refused at its first
    step by the weights' witness)."""
    for rank, r in enumerate(run2()):
        want, got = r["muon"]["straight"], r["async"]
        assert got["moved on"] and compare(got["final"], want["final"])["bit_identical"], rank
        assert nested_equal(got["at save"], want["ckpt"][1]) is None, rank  # the state the sync save holds
        assert nested_equal(got["dcp"]["state"], r["dcp"]["state"]) is None, rank
        assert got["sharded"]["round trip"] is None, (rank, got["sharded"]["round trip"])
        for how in ("dcp", "sharded"):
            exact = compare(got[how]["final"], want["final"])
            assert exact["bit_identical"], (rank, how, exact)


@pytest.mark.parametrize("how", ["resumed", "sharded", "torch full", "dcp", "dcp flat"])
def test_adamw_resumes_bit_for_bit_from_every_form(how: str) -> None:
    """`optimizer="adamw"` under FSDP2: every parameter's AdamW state in each form (before: the
    optimizer was refused at construction), resumed bit for bit."""
    shapes = {n: tuple(p.shape) for n, p in build_model(ADAMW).named_parameters()}
    for rank, r in enumerate(run2()):
        want, got = r["adamw"]["straight"], r["adamw"][how]
        assert "error" not in got, got
        header, _, state = state_by_name(want["ckpt"][1])
        assert header["optimizer"] == "adamw" and set(state) == set(shapes)
        assert all(tuple(s["exp_avg"].shape) == shapes[n] for n, s in state.items())
        again = got["round trip"] if "round trip" in got else nested_equal(got["state"], want["ckpt"][1])
        assert again is None, (rank, again)
        exact = compare(got["final"], want["final"])
        assert exact["bit_identical"], (rank, exact)


def test_checkpoint_of_another_model_or_optimizer_is_refused_in_one_line() -> None:
    for r in run2():
        msg = r["other model"]
        assert msg.startswith("PlanError: checkpoint is of model 'tiny-untied'"), msg
        assert "\n" not in msg
        assert r["other optimizer"] == "PlanError: checkpoint is for soap, this optimizer runs muon"
        # the checkpoint's matrix_config keeps state this optimizer's plan did not price
        msg = r["other soap state"]
        assert msg.startswith(
            'PlanError: checkpoint was saved with soap matrix_config {"precondition_frequency": 2}, which keeps other '
            'optimizer state than this optimizer\'s {"max_precond_dim": 48, "precondition_frequency": 2} '), msg
        assert msg.endswith("build the optimizer with the checkpoint's matrix_config and a plan made for it"), msg
        assert "\n" not in msg


def test_a_field_no_optimizer_keeps_is_dropped_by_the_load() -> None:
    """A state_dict() whose entries carry a field the optimizer does not keep loads as the
    checkpoint without it (torch's load keeps such a field; canzona's state has no place for it).
    Before: FSDP2's loader cut the field as a shard of the parameter, a RuntimeError ('shape ... is
    invalid for input of size 1') with the matrices' state already replaced."""
    for rank, r in enumerate(run2()):
        assert r["extra field"] == {"error": None, "state": None}, (rank, r["extra field"])


def test_state_dicts_of_two_saves_across_the_ranks_are_one_error_on_every_rank() -> None:
    """Before: each rank took its own boxes of its own state dict (FSDP's load was local), silently
    mixing two saves."""
    for r in run2():
        msg = r["two saves"]
        assert msg.startswith("CheckpointError: optimizer state not loaded, nothing changed: rank(s) "), msg
        assert "were given another state dict than this rank" in msg and "\n" not in msg, msg


# --- across layouts -----------------------------------------------------------------------------


def test_fsdp_checkpoint_resumes_under_zero1() -> None:
    ckpt = run2()[0]["muon"]["straight"]["ckpt"]
    want = emulate(resume_spec(SPECS["muon"]), 2, load=ckpt)
    for rank, r in enumerate(run2()):
        exact = compare(r["zero1 from fsdp"], want)
        assert exact["bit_identical"], (rank, exact)


def test_zero1_checkpoint_resumes_under_fsdp() -> None:
    ranks = run2()
    ckpt = ranks[0]["zero1 ckpt"]
    res = ranks[0]["fsdp from zero1"]
    assert res["round trip"] is None, res["round trip"]  # the ZeRO-1 checkpoint, bit for bit
    want = emulate(resume_spec(SPECS["muon"]), 2, load=ckpt, grads=res["grads"])
    for rank, r in enumerate(ranks):
        exact = compare(r["fsdp from zero1"]["final"], want)
        assert exact["bit_identical"], (rank, exact)


def test_fsdp2_checkpoint_resumes_at_fsdp3() -> None:
    ckpt = run2()[0]["muon"]["straight"]["ckpt"]
    ranks = run3()
    res = ranks[0]["resumed"]
    want = emulate(resume_spec(SPECS["muon"]), 3, load=ckpt, grads=res["grads"])
    for rank, r in enumerate(ranks):
        assert r["resumed"]["round trip"] is None, (rank, r["resumed"]["round trip"])  # resharded exactly
        exact = compare(r["resumed"]["final"], want)
        assert exact["bit_identical"], (rank, exact)
        # the DCP directory written at FSDP 2, read at FSDP 3 through torch's API, and the sharded
        # form written at FSDP 2: the same run
        assert nested_equal(r["dcp"]["state"], ckpt[1]) is None
        assert compare(r["dcp"]["final"], r["resumed"]["final"])["bit_identical"], rank
        assert r["sharded"]["round trip"] is None, (rank, r["sharded"]["round trip"])
        assert compare(r["sharded"]["final"], r["resumed"]["final"])["bit_identical"], rank


# --- the sharded form ---------------------------------------------------------------------------


def test_sharded_state_dict_resumes_bit_for_bit() -> None:
    """Each rank writes its pieces; read back at FSDP 2 it is the same checkpoint and the same run."""
    for rank, r in enumerate(run2()):
        assert r["sharded"]["round trip"] is None, (rank, r["sharded"]["round trip"])
        assert compare(r["sharded"]["final"], r["muon"]["straight"]["final"])["bit_identical"], rank


def test_sharded_state_dict_holds_only_what_each_rank_holds() -> None:
    ranks = run2()
    keys = [set(r["muon"]["straight"]["sharded keys"]) for r in ranks]
    matrices = {p.name for p in build_model(SPECS["muon"]).spec().matrix_params()}
    whole = [{k.split("/")[2] for k in ks if k.startswith("canzona_optimizer/matrix/") and "@" not in k}
             for ks in keys]
    assert not whole[0] & whole[1] and whole[0] | whole[1] == matrices  # each matrix from its owner alone
    pieces = [{k for k in ks if "@" in k} for ks in keys]
    assert pieces[0] and pieces[1] and not pieces[0] & pieces[1]  # each rank its own pieces


def test_hsdp_replicas_load_and_save_alike() -> None:
    """HSDP (replicas of one shard): the FSDP 2 checkpoint loads (the same run as the same kernels
    in one process continuing from it), and its sharded checkpoint, written by both replicas, loads
    back at FSDP 2 as the same state."""
    ranks = run2()
    ckpt = ranks[0]["muon"]["straight"]["ckpt"]
    want = emulate(resume_spec(SPECS["muon"]), 2, load=ckpt, grads=ranks[0]["hsdp"]["grads"])
    for rank, r in enumerate(ranks):
        assert r["hsdp"]["round trip"] is None, (rank, r["hsdp"]["round trip"])
        assert compare(r["hsdp"]["final"], want)["bit_identical"], rank
        assert nested_equal(r["hsdp"]["state"], ranks[0]["hsdp"]["state"]) is None
        assert r["fsdp from hsdp"]["round trip"] is None, (rank, r["fsdp from hsdp"]["round trip"])


WEIGHTS_MIX = "CheckpointError: the model's weights differ from those the optimizer checkpoint was saved with"


@pytest.mark.parametrize("case, what", [("mix", "sampled elements"), ("bf16 mix", "fp32 master weights")])
def test_weights_of_another_save_are_refused(case: str, what: str) -> None:
    """Model weights from a later step beside a sharded checkpoint, loaded with `check_weights`: one
    CheckpointError on every rank (fp32: the witness; bf16: the fp32 masters), the optimizer's
    state as it was; the checkpoint beside its own weights loads (every sharded load in these runs
    checks the weights: FSDP 2 -> 2, -> 3, -> ZeRO-1, ZeRO-1 -> FSDP, HSDP -> FSDP)."""
    ranks = run2()
    texts = {re.sub(r"^CheckpointError: rank \d+: ", "CheckpointError: ", r[case]["refused"]) for r in ranks}
    assert len(texts) == 1, texts
    text = texts.pop()
    assert text.startswith(WEIGHTS_MIX) and what in text and "different saves" in text, text
    for rank, r in enumerate(ranks):
        assert r[case]["unchanged"] is None, (rank, r[case]["unchanged"])
    for rank, r in enumerate(ranks):
        assert r["bf16 mix"]["whole"] is None, (rank, r["bf16 mix"]["whole"])


@pytest.mark.parametrize("case", ["state dict mix", "torch mix", "unchecked mix"])
def test_a_state_dict_beside_weights_of_another_save_is_refused_at_the_first_step(case: str) -> None:
    """The same mix through `load_state_dict` (after the model) and torch's `set_state_dict` (the
    optimizer first): the first step refuses it, one CheckpointError on every rank, no weight
    updated. Before, both stepped unnoticed. The state dicts beside their own weights step on
    (`resumed`, "torch full", "dcp": bit for bit)."""
    ranks = run2()
    texts = {re.sub(r"^CheckpointError: rank \d+: ", "CheckpointError: ", r[case]["refused"]) for r in ranks}
    assert len(texts) == 1, texts
    text = texts.pop()
    assert text.startswith(WEIGHTS_MIX) and "sampled elements" in text and "step() refused" in text, text
    assert "check_weights=False" in text and "without_weights_witness(" in text, text  # the ways past it
    for rank, r in enumerate(ranks):
        assert r[case]["unchanged"] is None, (rank, r[case]["unchanged"])


@pytest.mark.parametrize("how", ["state_dict", "sharded"])
def test_a_fresh_optimizers_state_loaded_later_resets_the_state_as_torch(how: str) -> None:
    """`load_state_dict(initial)` / `load_sharded_state_dict()` of the state taken before the first
    step resets the optimizer, as torch's optimizers reset with their initial (empty) state dict:
    bit for bit a fresh optimizer beside the weights as they are. Its entries never stepped: the
    weights beside it are not another save's (stepped state beside them still is: the mixes
    above). Before: the first step refused them, 'the model's weights differ from those the
    optimizer checkpoint was saved with'."""
    assert [r["reset"][how] for r in run2()] == [True] * 2


def test_a_sharded_load_with_check_weights_false_steps_beside_other_weights() -> None:
    """`load_sharded_state_dict(check_weights=False)`: weights changed on purpose step on. Before,
    False was the default, meaning 'checked at the first step': refused, with no way past."""
    assert [r["unchecked on purpose"]["refused"] for r in run2()] == ["stepped"] * 2


def test_masters_saved_after_weights_were_loaded_into_the_model_are_theirs() -> None:
    """Weights loaded into a bf16 model after steps, then the state saved: its masters are those
    of the weights as they are (`state_dict()` and the sharded form), and the sharded save loads
    beside them with `check_weights`. Before: the stale masters were saved, and the save, whole,
    failed its own check."""
    for rank, r in enumerate(run2()):
        run = r["bf16 loaded then saved"]
        assert run["stale masters"] == [], (rank, run["stale masters"])
        assert run["sharded"] is None, (rank, run["sharded"])


def test_a_state_dict_beside_other_weights_steps_from_the_models_weights() -> None:
    """A state dict without the weights' witness (`checkpoint.without_weights_witness`: loaded
    beside other weights on purpose) checks no weights: fp32 masters loaded beside weights that
    are not their cast are not trained from; the step starts from the model's weights, whichever
    was loaded first (`kernels.update_target`), as under ZeRO-1."""
    for rank, r in enumerate(run2()):
        run = r["bf16 loaded then saved"]
        assert run["other weights, model first"] and run["other weights, optimizer first"], (rank, run)


def test_sharded_state_dict_moves_between_fsdp_and_zero1() -> None:
    ranks = run2()
    for rank, r in enumerate(ranks):  # the same runs as from the full state dicts
        assert compare(r["zero1 from fsdp sharded"], r["zero1 from fsdp"])["bit_identical"], rank
        assert r["fsdp from zero1 sharded"]["round trip"] is None, (rank, r["fsdp from zero1 sharded"]["round trip"])
        assert compare(r["fsdp from zero1 sharded"]["final"], r["fsdp from zero1"]["final"])["bit_identical"], rank
