"""Checkpoints of stacked experts under FSDP2 (`FsdpOptimizer`, `optimizer="adamw"`): the tiny MoE
(`[experts, m, n]` parameters, 4 experts) under `fully_shard` per layer and at the root, SAVE steps,
a checkpoint, RESUME more on fresh data.

Before, `state_dict()` dropped the stacks' AdamW state (and fp32 masters): FSDP2 keeps it under
the stack's name, the layout-independent form under its matrices' (`'<param>[k]'`), so every
stack was saved as a template of zeros, and a resume silently restarted its moments. Here:
- the state dict holds every parameter's exp_avg / exp_avg_sq / step, each equal (torch.equal, in
  torch's shapes) to torch's AdamW (foreach) under the same fully_shard, fed the same data;
- a fresh model of other weights resumed from `state_dict()`, and from the sharded form
  (`sharded_state_dict` + `dcp.save`, `load_sharded_state_dict`), ends bit for bit as the
  uninterrupted run, parameters and state (fp32, and bf16 with fp32 masters);
- across layouts: the FSDP checkpoints (both forms) resume under ZeRO-1 at the same DP size bit
  for bit as the same kernels in one process, and ZeRO-1's resume under FSDP2;
- torch's API (get/set_state_dict, dcp of get_optimizer_state_dict, flattened or not) resumes bit
  for bit; a sharded save keyed by the stack's name (as written until 2026-12-02) still loads.

World 2 (two experts a rank) and 4 (one a rank; the larger variant). And memory: at 3 ranks
(each stack's 4 experts torch.chunk'ed 2, 2, 0) every rank's bytes are what `canzona simulate
--fsdp --optimizer adamw` reports for it.
"""

from __future__ import annotations

import functools
import tempfile
from dataclasses import replace
from typing import Any

import pytest
import torch

from canzona.harness.launch import run_ranks
from canzona.harness.training import TrainSpec, build_model, compare, distributed_worker, emulate
from canzona.runtime.checkpoint import STACK_KEY, state_by_name
from tests.runtime.test_fsdp_checkpoint import (
    _flat_resumed,
    fsdp_model,
    load_params,
    nested_equal,
    resume_spec,
    resumed,
    straight,
    torch_api_resumed,
    train,
)

pytestmark = pytest.mark.distributed  # spawns gloo process groups

SAVE = 2
MOE = TrainSpec(preset="tiny-moe", optimizer="adamw", steps=SAVE, global_batch=8)
BF16 = replace(MOE, dtype="bf16")
STACKS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
DEADLINE_S = 300.0


# --- in the ranks ---------------------------------------------------------------------------------


def torch_adamw_state(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    """torch's AdamW (foreach) over the same model under the same fully_shard, SAVE steps on the
    same data: its state, full tensors, by parameter name."""
    model, _ = fsdp_model(MOE, world)
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    train(model, opt, MOE, rank, world)
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone() for k, v in s.items()}
            for p, s in opt.state.items()}


def worker(rank: int, world: int, path: str) -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch_adamw_state(rank, world)}
    for label, spec in (("fp32", MOE), ("bf16", BF16)):
        run = straight(spec, rank, world, f"{path}-{label}")
        params = run["ckpt"][0]
        out[label] = {
            "straight": run,
            "full": resumed(spec, rank, world, run["ckpt"]),
            "sharded": resumed(spec, rank, world, (params, f"{path}-{label}-sharded"), like=run["ckpt"][1]),
        }
    # torch's API (get/set_state_dict with full state dicts; dcp of get_optimizer_state_dict, and
    # torchtitan's flattened form)
    run = out["fp32"]["straight"]
    out["torch api"] = {"torch full": torch_api_resumed(MOE, rank, world, run["torch"], None),
                        "dcp": torch_api_resumed(MOE, rank, world, None, f"{path}-fp32"),
                        "dcp flat": _flat_resumed(MOE, rank, world, f"{path}-fp32-flat")}
    # a sharded save written before stacks were saved by matrix (keyed by the stack's name)
    out["stack-keyed"] = resumed(MOE, rank, world, (run["ckpt"][0], stack_keyed_save(rank, world, f"{path}-old")),
                                 like=run["ckpt"][1])
    out["zero1 from stack-keyed"] = distributed_worker(
        rank, world, resume_spec(MOE), {"load": (run["ckpt"][0], f"{path}-old"), "check_weights": True})["params"]
    # the uninterrupted run's state at its end, to compare the resumed runs' with
    out["fp32"]["end"] = _end_state(MOE, rank, world)
    out["fp32"]["full end"] = _resumed_end_state(MOE, rank, world, out["fp32"]["straight"]["ckpt"])
    params, ckpt = out["fp32"]["straight"]["ckpt"][0], out["fp32"]["straight"]["ckpt"]
    out["fp32"]["sharded end"] = _resumed_end_state(MOE, rank, world, (params, f"{path}-fp32-sharded"))
    # FSDP -> ZeRO-1 (the unsharded model, the same DP size), both forms; ZeRO-1 -> FSDP
    out["zero1 from fsdp"] = distributed_worker(rank, world, resume_spec(MOE), {"load": ckpt})["params"]
    out["zero1 from fsdp sharded"] = distributed_worker(
        rank, world, resume_spec(MOE), {"load": (params, f"{path}-fp32-sharded"), "check_weights": True})["params"]
    zero1 = distributed_worker(rank, world, MOE, {"save_sharded": f"{path}-zero1"})
    out["zero1 ckpt"] = (zero1["params"], zero1["state"])
    out["fsdp from zero1"] = resumed(MOE, rank, world, out["zero1 ckpt"], record=True)
    out["fsdp from zero1 sharded"] = resumed(MOE, rank, world, (zero1["params"], f"{path}-zero1"),
                                             like=zero1["state"])
    return out


def stack_keyed_save(rank: int, world: int, path: str) -> str:
    """SAVE steps, then a sharded save as `sharded_state_dict()` wrote one until 2026-12-02: each
    stack's pieces under the stack's name, at its flat offset (`_flat_bounds` of this rank's box)."""
    import torch.distributed.checkpoint as dcp

    from canzona.runtime.checkpoint import piece_key
    from canzona.runtime.fsdp_checkpoint import _flat_bounds

    model, opt = fsdp_model(MOE, world)
    train(model, opt, MOE, rank, world)
    entries = {k: v for k, v in opt.sharded_state_dict().items() if "_proj[" not in k}
    for name in opt.params:
        if name.endswith(STACKS) and name in opt.adamw_state:
            lo, _ = _flat_bounds(opt.layout[name].boxes[opt.rank], opt.layout[name].shape)
            for key, value in opt.adamw_state[name].items():
                entries[piece_key("canzona_optimizer", "adamw", name, key, lo)] = \
                    value.reshape(-1) if isinstance(value, torch.Tensor) else value
    dcp.save(entries, checkpoint_id=path)
    return path


def _end_state(spec: TrainSpec, rank: int, world: int) -> dict:
    """The uninterrupted run again (SAVE then RESUME steps): its state dict at the end."""
    model, opt = fsdp_model(spec, world)
    train(model, opt, spec, rank, world)
    train(model, opt, resume_spec(spec), rank, world)
    return opt.state_dict()


def _resumed_end_state(spec: TrainSpec, rank: int, world: int, ckpt: tuple) -> dict:
    """A fresh model resumed from `ckpt` (`resumed`'s way), RESUME steps: its state dict at the end."""
    model, opt = fsdp_model(spec, world, seed=7)
    load_params(model, ckpt[0])
    if isinstance(ckpt[1], str):
        opt.load_sharded_state_dict(ckpt[1], check_weights=True)
    else:
        opt.load_state_dict(ckpt[1])
    train(model, opt, resume_spec(spec), rank, world)
    return opt.state_dict()


@functools.cache
def runs(world: int) -> list[dict]:
    path = tempfile.mkdtemp(prefix="canzona-fsdp-stacks-") + "/ckpt"
    return run_ranks(worker, world, path, deadline_s=DEADLINE_S, collective_timeout_s=60)


WORLDS = [2, pytest.param(4, marks=pytest.mark.slow)]


# --- checks ---------------------------------------------------------------------------------------


def _entries(state_dict: dict) -> dict[str, dict]:
    """The state dict's entries by parameter name, as written (stacks whole)."""
    names = [n for group in state_dict["param_names"] for n in group]
    keys = [k for g in state_dict["param_groups"] for k in g["params"]]
    return {n: state_dict["state"][k] for n, k in zip(names, keys)}


@pytest.mark.parametrize("world", WORLDS)
def test_state_dict_holds_every_parameters_adamw_state_as_torch_adamw(world: int) -> None:
    ranks = runs(world)
    spec = build_model(MOE).spec()
    for rank, r in enumerate(ranks):
        entries = _entries(r["fp32"]["straight"]["ckpt"][1])
        want = r["torch"]
        assert set(entries) == set(want), rank
        stacked = [n for n in entries if n.endswith(STACKS)]
        assert len(stacked) == 4, stacked  # two layers, two stacks each
        for name, theirs in want.items():
            mine = entries[name]
            assert mine["canzona_stepped"], (rank, name)
            assert float(mine["step"]) == float(theirs["step"]) == SAVE, (rank, name, mine["step"])
            for field in ("exp_avg", "exp_avg_sq"):
                got = mine[field]
                if name in stacked:  # the layout-independent form's stack: [matrices, m, n], in memory order
                    p = spec.param(name)
                    assert mine[STACK_KEY] == p.stack_size and got.shape == (p.stack_size, *p.matrix_shape), name
                    got = got.reshape(theirs[field].shape)
                assert got.shape == theirs[field].shape, (rank, name, field, got.shape)
                assert torch.equal(got, theirs[field]), (rank, name, field)
                assert got.abs().sum() > 0, (rank, name, field)  # moved: not a template of zeros


@pytest.mark.parametrize("world", WORLDS)
def test_bf16_state_dict_holds_the_stacks_masters(world: int) -> None:
    for rank, r in enumerate(runs(world)):
        entries = _entries(r["bf16"]["straight"]["ckpt"][1])
        params = r["bf16"]["straight"]["ckpt"][0]
        for name, entry in entries.items():
            master = entry["master"].reshape(params[name].shape)  # a stack's: [matrices, m, n]
            assert master.dtype == torch.float32, name
            # the masters of the weights: the weights are them cast
            assert torch.equal(master.to(torch.bfloat16), params[name]), (rank, name)
            assert entry["exp_avg"].abs().sum() > 0, (rank, name)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("form", ["full", "sharded"])
def test_resumed_run_equals_the_uninterrupted_run_bit_for_bit(world: int, dtype: str, form: str) -> None:
    for rank, r in enumerate(runs(world)):
        run, res = r[dtype]["straight"], r[dtype][form]
        assert run["untouched"] is None, (rank, run["untouched"])
        assert res["round trip"] is None, (rank, form, res["round trip"])  # loaded, then saved: the same state
        cmp = compare(res["final"], run["final"])
        assert cmp["bit_identical"], (rank, dtype, form, cmp)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("form", ["full", "sharded"])
def test_resumed_state_equals_the_uninterrupted_state_bit_for_bit(world: int, form: str) -> None:
    for rank, r in enumerate(runs(world)):
        end, got = r["fp32"]["end"], r["fp32"][f"{form} end"]
        assert nested_equal(got, end) is None, (rank, form, nested_equal(got, end))
        assert all(e["exp_avg"].abs().sum() > 0 for e in _entries(got).values()), rank


@pytest.mark.parametrize("world", WORLDS)
def test_fsdp_checkpoints_of_stacks_resume_under_zero1(world: int) -> None:
    ranks = runs(world)
    ckpt = ranks[0]["fp32"]["straight"]["ckpt"]
    want = emulate(resume_spec(MOE), world, load=ckpt)
    for rank, r in enumerate(ranks):
        for form in ("zero1 from fsdp", "zero1 from fsdp sharded"):
            exact = compare(r[form], want)
            assert exact["bit_identical"], (rank, form, exact)


@pytest.mark.parametrize("world", WORLDS)
def test_zero1_checkpoints_of_stacks_resume_under_fsdp(world: int) -> None:
    ranks = runs(world)
    zero1 = ranks[0]["zero1 ckpt"]
    # the ZeRO-1 state dict and FSDP2's hold the same entries (fields, shapes, dtypes)
    mine, theirs = state_by_name(ranks[0]["fp32"]["straight"]["ckpt"][1]), state_by_name(zero1[1])
    assert sorted(mine[2]) == sorted(theirs[2])
    for name, entry in theirs[2].items():
        assert {k: (v.shape, v.dtype) if isinstance(v, torch.Tensor) else type(v) for k, v in entry.items()} == \
            {k: (v.shape, v.dtype) if isinstance(v, torch.Tensor) else type(v) for k, v in mine[2][name].items()}, name
    res = ranks[0]["fsdp from zero1"]
    want = emulate(resume_spec(MOE), world, load=zero1, grads=res["grads"])
    for rank, r in enumerate(ranks):
        for form in ("fsdp from zero1", "fsdp from zero1 sharded"):
            assert r[form]["round trip"] is None, (rank, form, r[form]["round trip"])
            exact = compare(r[form]["final"], want)
            assert exact["bit_identical"], (rank, form, exact)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("how", ["torch full", "dcp", "dcp flat"])
def test_torch_api_resumes_stacks_bit_for_bit(world: int, how: str) -> None:
    """torch's get/set_state_dict, dcp of get_optimizer_state_dict and torchtitan's flattened form."""
    for rank, r in enumerate(runs(world)):
        got = r["torch api"][how]
        assert "error" not in got, (rank, how, got.get("error"))
        assert nested_equal(got["state"], r["fp32"]["straight"]["ckpt"][1]) is None, (rank, how)
        exact = compare(got["final"], r["fp32"]["straight"]["final"])
        assert exact["bit_identical"], (rank, how, exact)


@pytest.mark.parametrize("world", WORLDS)
def test_a_sharded_save_keyed_by_stack_still_resumes_bit_for_bit(world: int) -> None:
    for rank, r in enumerate(runs(world)):
        got = r["stack-keyed"]
        assert got["round trip"] is None, (rank, got["round trip"])
        exact = compare(got["final"], r["fp32"]["straight"]["final"])
        assert exact["bit_identical"], (rank, exact)


@pytest.mark.parametrize("world", WORLDS)
def test_a_sharded_save_keyed_by_stack_resumes_under_zero1_bit_for_bit(world: int) -> None:
    """The ZeRO-1 layout reads a stack by its matrices' keys: a save keyed by the stack's name (FSDP2's
    until 2026-12-02) gave it no piece of any matrix, and it resumed the stacks' moments from zeros,
    silently. Each saved piece of a stack is now read as the parts of the matrices it spans."""
    ranks = runs(world)
    want = emulate(resume_spec(MOE), world, load=ranks[0]["fp32"]["straight"]["ckpt"])
    for rank, r in enumerate(ranks):
        exact = compare(r["zero1 from stack-keyed"], want)
        assert exact["bit_identical"], (rank, exact)


# --- memory: what `canzona simulate --fsdp --optimizer adamw` reports of the stacks ----------------


def held_worker(rank: int, world: int) -> dict[str, Any]:
    """One step of the tiny MoE under fully_shard at `world` ranks (4 experts over 3: torch.chunk
    gives each stack's experts as 2, 2, 0): the bytes this rank holds, by category."""
    from canzona.runtime.shards import local_tensor

    model, opt = fsdp_model(replace(MOE, steps=1), world)
    train(model, opt, replace(MOE, steps=1, global_batch=2 * world), rank, world)
    params = dict(model.named_parameters())

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    return {"rank": opt.rank, "spec": model.spec(),
            "weights": nbytes(local_tensor(p) for p in params.values()),
            "grads": nbytes(local_tensor(p.grad) for p in params.values()),
            "master_weights": nbytes(opt.master.values()), "matrix_state": 0,
            "adamw_state": sum(nbytes(v for v in s.values() if isinstance(v, torch.Tensor))
                               for s in opt.adamw_state.values()),
            "experts": nbytes(local_tensor(p) for n, p in params.items() if n.endswith(STACKS))}


def test_the_simulator_reports_each_ranks_own_piece_of_the_stacks() -> None:
    """Per rank, every persistent category `canzona simulate --fsdp --optimizer adamw` reports of
    the tiny MoE at 3 ranks is what the runtime holds: each rank its own torch.chunk piece of each
    stack (the third none), not an even share."""
    from sim.simulate import SimConfig, simulate
    from sim.workload import Workload
    from tests.runtime.expert_runs import moe_architecture

    world = 3
    ranks = run_ranks(held_worker, world, deadline_s=DEADLINE_S, collective_timeout_s=60)
    spec = ranks[0]["spec"]
    cfg = SimConfig(model=spec.name, gpus=world, tp=1, fsdp=True, optimizer="adamw", policy="zero1",
                    workload=Workload(global_batch=2 * world, seq_len=8, param_bytes=4))
    sim = simulate(cfg, model=(spec, moe_architecture(spec.name, "tiny-moe"))).memory
    assert ranks[0]["experts"] == ranks[1]["experts"] > 0 and ranks[2]["experts"] == 0  # uneven pieces
    for got in ranks:
        for k in ("weights", "grads", "master_weights", "matrix_state", "adamw_state"):
            assert got[k] == getattr(sim.ranks[got["rank"]], k), (got["rank"], k, got[k])
