"""FSDP2 with expert parallelism under `optimizer="adamw"` (`canzona.runtime.fsdp_ep`): the tiny MoE
with 6 stacked experts a layer in torchtitan's layout (`reference.tiny_moe_fsdp_ep`: the stacks
Shard(0) over ep, fully_shard over efsdp, the dense part over every rank) at world 4 = EP 2 x
EFSDP 2: each EP rank's 3 experts split 2 / 1 between its efsdp pair.

- AdamW with torchtitan's EP clip (`clip_with_ep`, the user's) is torch's AdamW (foreach) on the
  same model, bit for bit; canzona's own clip (`max_grad_norm`, `clip_grad_norm_`) measures the
  same norm (every gradient element once: the experts over ep x efsdp, the dense part over dp) and
  steps alike, bit for bit;
- a NaN in one rank's expert gradient skips the step on every rank (`nonfinite="skip"`);
- `state_dict()` holds each stack's state under its global name and shape (torch's AdamW's, bit
  for bit), and a fresh model resumed from it, or from `sharded_state_dict` + dcp, ends as the
  uninterrupted run, bit for bit;
- what is not run is one SpecError on every rank at construction: a matrix optimizer over the
  experts, HSDP beside them, expert tensor parallelism, an expert_mesh that is not the experts'.

Before: every construction was "expert parallelism with FSDP is not run yet" or a mesh error.
"""

from __future__ import annotations

import functools
import math
import tempfile
from dataclasses import replace
from typing import Any

import pytest
import torch

from canzona.harness.launch import run_ranks

pytestmark = pytest.mark.distributed  # spawns gloo process groups

WORLD, EP = 4, 2
STEPS, SAVE, POISON = 4, 2, 1
CLIP = 0.05
DEADLINE_S = 300.0


def config():
    from reference.tiny_moe import MOE_PRESETS

    return replace(MOE_PRESETS["tiny-moe"], experts=6)


# --- in the ranks ---------------------------------------------------------------------------------


def _batches(rank: int, world: int, steps: int, seed: int = 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, config().vocab, (world * 2, 9), generator=gen)
        out.append(tokens[2 * rank:2 * rank + 2])
    return out


def _build(who: str, seed: int = 0, **kw):
    from canzona.runtime import DistributedOptimizer
    from reference.tiny_moe_fsdp_ep import fsdp_ep_model

    model, mesh, _ = fsdp_ep_model(config(), EP, seed=seed)
    if who == "torch":
        return model, torch.optim.AdamW(model.parameters(), foreach=True)
    return model, DistributedOptimizer(model.named_parameters(), model.spec(), "adamw", **kw)


def _train(model, opt, batches, *, user_clip: bool = False, own_clip: bool = False, poison: int | None = None,
           skip: set[int] = frozenset()) -> list[float]:
    """Steps over `batches`; the norms clipped by (torchtitan's clip or canzona's)."""
    import torch.distributed as dist

    from reference.tiny_moe_fsdp_ep import clip_with_ep

    norms = []
    for step, tokens in enumerate(batches):
        opt.zero_grad()
        model.loss(tokens).backward()
        if poison == step and dist.get_rank() == 1:
            with torch.no_grad():
                model.model.layers[0].mlp.experts.down_proj.grad.to_local()[0, 0, 0] = float("nan")
        if step in skip:  # the reference's skipped step
            continue
        if user_clip:
            norms.append(clip_with_ep(model, CLIP))
        if own_clip:
            norms.append(float(opt.clip_grad_norm_(CLIP)))
        opt.step()
    return norms


def _full(model) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _torch_norm(model) -> float:
    """torchtitan's `_clip_grad_norm_with_ep` measure, as it computes it (fp32, torch's total norm of
    each part's DTensor gradients, the parts combined)."""
    from reference.tiny_moe_fsdp_ep import is_expert

    parts = []
    for experts in (True, False):
        grads = [p.grad for n, p in model.named_parameters() if is_expert(n) == experts and p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        parts.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    return float(torch.stack(parts).norm())


def worker(rank: int, world: int, path: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from canzona.errors import CanzonaError
    from tests.runtime.test_fsdp_checkpoint import load_params

    out: dict[str, Any] = {}
    batches = _batches(rank, world, STEPS)
    try:
        _build("canzona")
    except CanzonaError as e:  # the unfixed runtime
        return {"error": str(e)}
    # torch's AdamW, torchtitan's clip; and the step a NaN skipped left out
    model, opt = _build("torch")
    out["torch norms"] = _train(model, opt, batches, user_clip=True)
    out["torch"] = _full(model)
    out["torch state"] = {n: {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
                              for k, v in opt.state[p].items()}
                          for n, p in model.named_parameters()}
    model, opt = _build("torch")
    _train(model, opt, batches, user_clip=True, skip={POISON})
    out["torch skipped"] = _full(model)
    # the measure torchtitan's clip takes (fp32), on the first step's gradients
    model, _ = _build("torch")
    model.loss(batches[0]).backward()
    out["torchtitan norm"] = _torch_norm(model)
    from canzona.harness.training import gather_whole

    out["grads"] = gather_whole({n: p.grad for n, p in model.named_parameters()})

    model, opt = _build("canzona")
    out["kind"] = type(opt).__name__
    _train(model, opt, batches, user_clip=True)
    out["user clip"] = _full(model)
    model, opt = _build("canzona")
    out["own norms"] = _train(model, opt, batches, own_clip=True)
    out["own clip"] = _full(model)
    model, opt = _build("canzona", max_grad_norm=CLIP)
    _train(model, opt, batches)
    out["max_grad_norm"] = _full(model)
    out["end state"] = opt.state_dict()
    out["held"] = held(model, opt)
    model, opt = _build("canzona", nonfinite="skip")
    _train(model, opt, batches, user_clip=True, poison=POISON)
    out["skip"], out["skipped"] = _full(model), opt.skipped_steps

    # checkpoints after SAVE steps: a fresh model of other weights resumes from each form
    model, opt = _build("canzona", max_grad_norm=CLIP)
    _train(model, opt, batches[:SAVE])
    params, state = _full(model), opt.state_dict()
    out["saved state"] = state
    dcp.save(opt.sharded_state_dict(), checkpoint_id=path)
    for form in ("full", "sharded"):
        model, opt = _build("canzona", seed=7, max_grad_norm=CLIP)
        load_params(model, params)
        if form == "full":
            opt.load_state_dict(state)
        else:
            opt.load_sharded_state_dict(path, check_weights=True)
        _train(model, opt, batches[SAVE:])
        out[f"resumed {form}"] = _full(model)
        out[f"resumed {form} state"] = opt.state_dict()
    out["refusals"] = refusals()
    return out


def held(model, opt) -> dict[str, Any]:
    """The bytes this rank holds after its steps, by `canzona.memory.RankMemory`'s persistent
    categories, and its experts' pieces (weights)."""
    from canzona.runtime.shards import local_tensor
    from reference.tiny_moe_fsdp_ep import is_expert

    params = dict(model.named_parameters())

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    return {"rank": opt.rank, "weights": nbytes(local_tensor(p) for p in params.values()),
            "grads": nbytes(local_tensor(p.grad) for p in params.values()),
            "master_weights": nbytes(opt.master.values()), "matrix_state": 0,
            "adamw_state": sum(nbytes(v for v in s.values() if isinstance(v, torch.Tensor))
                               for s in opt.adamw_state.values()),
            "experts": nbytes(local_tensor(p) for n, p in params.items() if is_expert(n))}


def refusals() -> dict[str, str]:
    """Each configuration not run, on this rank: its error (local, before any collective)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from canzona.errors import CanzonaError
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.fsdp_ep import expert_mesh_of

    out = {}

    def attempt(label: str, make) -> None:
        try:
            make()
            out[label] = "no error"
        except CanzonaError as e:
            out[label] = str(e)

    model, mesh, _ = _build_model()
    attempt("muon", lambda: DistributedOptimizer(model.named_parameters(), model.spec(), "muon"))
    attempt("expert_mesh taken", lambda: DistributedOptimizer(model.named_parameters(), model.spec(), "adamw",
                                                              expert_mesh=mesh))
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    attempt("expert_mesh", lambda: DistributedOptimizer(model.named_parameters(), model.spec(), "adamw",
                                                        expert_mesh=other))
    # HSDP: the dense part replicated over one axis, sharded over the other, beside the experts
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    attempt("hsdp", lambda: _hsdp_optimizer(hsdp))
    # expert TP: a stack sharded on its rows too, over a third axis
    etp = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("efsdp", "ep", "etp"))
    stack = DTensor.from_local(torch.zeros(3, 4, 2), etp, [Shard(0), Shard(0), Shard(1)], shape=(6, 8, 2),
                               stride=(16, 2, 1))
    attempt("etp", lambda: expert_mesh_of({"mlp.experts.down_proj": stack}, "adamw", True))
    dist.barrier()
    return out


def _build_model():
    from reference.tiny_moe_fsdp_ep import fsdp_ep_model

    return fsdp_ep_model(config(), EP)


def _hsdp_optimizer(hsdp):
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    from canzona.runtime import DistributedOptimizer
    from reference.tiny_moe_ep import TinyMoeEP

    mesh = hsdp  # the experts on an (efsdp, ep) mesh of the same ranks
    from torch.distributed.device_mesh import init_device_mesh

    experts_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    model = TinyMoeEP(config(), experts_mesh.get_group("ep"))
    for layer in model.model.layers:
        for name in ("gate_up_proj", "down_proj"):
            local = getattr(layer.mlp.experts, name).detach()
            setattr(layer.mlp.experts, name, nn.Parameter(DTensor.from_local(
                local, experts_mesh["ep"], [Shard(0)], shape=(6, *local.shape[1:]),
                stride=torch.empty(6, *local.shape[1:], device="meta").stride())))
        fully_shard(layer.mlp.experts, mesh=experts_mesh["efsdp"])
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return DistributedOptimizer(model.named_parameters(), model.spec(), "adamw")


@functools.cache
def runs() -> list[dict]:
    path = tempfile.mkdtemp(prefix="canzona-fsdp-ep-") + "/ckpt"
    return run_ranks(worker, WORLD, path, deadline_s=DEADLINE_S, collective_timeout_s=60)


# --- checks ---------------------------------------------------------------------------------------


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert set(a) == set(b)
    return [n for n in a if not torch.equal(a[n], b[n])]


def _ok(r: dict) -> None:
    assert "error" not in r, r.get("error")
    assert r["kind"] == "FsdpOptimizer"


def test_adamw_under_fsdp_ep_equals_torch_adamw_with_torchtitans_clip() -> None:
    for rank, r in enumerate(runs()):
        _ok(r)
        assert not _equal(r["user clip"], r["torch"]), (rank, _equal(r["user clip"], r["torch"]))
        assert any(not torch.equal(r["torch"][n], r["torch skipped"][n]) for n in r["torch"])


def test_the_layouts_gradients_are_the_global_mean_losss() -> None:
    """The reference layout's gradients (experts: the dispatch's sum over the EP group, scaled by
    1 / ep, FSDP2's mean over efsdp) are the whole model's on the global batch, within 1e-5."""
    from reference.tiny_moe import TinyMoe

    model = TinyMoe(config(), seed=0)
    model.loss(torch.cat([_batches(r, WORLD, 1)[0] for r in range(WORLD)])).backward()
    got = runs()[0]
    _ok(got)
    for n, p in model.named_parameters():
        scale = float(p.grad.abs().max())
        assert scale > 0 and float((got["grads"][n] - p.grad).abs().max()) <= 1e-5 * scale, n


def test_canzonas_clip_counts_every_gradient_element_once() -> None:
    """The norm canzona measures is torchtitan's EP clip's (every expert element over ep x efsdp,
    the dense part over dp, once), and the clipped step is the same, bit for bit."""
    for rank, r in enumerate(runs()):
        _ok(r)
        assert len(r["own norms"]) == STEPS and all(n > CLIP for n in r["own norms"])  # every step clipped
        for mine, theirs in zip(r["own norms"], r["torch norms"]):  # clip_grad_norm_ returns it in fp32
            assert math.isclose(mine, theirs, rel_tol=1e-7), (rank, mine, theirs)
        assert math.isclose(r["own norms"][0], r["torchtitan norm"], rel_tol=1e-5), (rank, r["torchtitan norm"])
        for how in ("own clip", "max_grad_norm"):
            assert not _equal(r[how], r["torch"]), (rank, how, _equal(r[how], r["torch"]))


def test_a_nan_on_one_rank_skips_the_step_on_every_rank() -> None:
    for rank, r in enumerate(runs()):
        _ok(r)
        assert r["skipped"] == 1, rank
        assert not _equal(r["skip"], r["torch skipped"]), (rank, _equal(r["skip"], r["torch skipped"]))


def _entries(state_dict: dict) -> dict[str, dict]:
    names = [n for group in state_dict["param_names"] for n in group]
    keys = [k for g in state_dict["param_groups"] for k in g["params"]]
    return {n: state_dict["state"][k] for n, k in zip(names, keys)}


def test_state_dict_keys_the_experts_state_by_global_name_and_shape() -> None:
    from canzona.runtime.checkpoint import STACK_KEY
    from reference.tiny_moe import TinyMoe
    from reference.tiny_moe_fsdp_ep import is_expert

    spec = TinyMoe(config()).spec()
    for rank, r in enumerate(runs()):
        _ok(r)
        entries = _entries(r["end state"])
        assert set(entries) == set(r["torch state"])
        stacks = [n for n in entries if is_expert(n)]
        assert len(stacks) == 4
        for name, theirs in r["torch state"].items():
            mine = entries[name]
            for field in ("exp_avg", "exp_avg_sq"):
                got = mine[field]
                if name in stacks:  # the whole stack, every EP rank's experts: [matrices, m, n]
                    p = spec.param(name)
                    assert p.shape[0] == 6 and mine[STACK_KEY] == p.stack_size, (name, p.shape)
                    assert got.shape == (p.stack_size, *p.matrix_shape), (name, got.shape)
                    got = got.reshape(theirs[field].shape)
                assert torch.equal(got, theirs[field]), (rank, name, field)


@pytest.mark.parametrize("form", ["full", "sharded"])
def test_resumed_run_equals_the_uninterrupted_run_bit_for_bit(form: str) -> None:
    from tests.runtime.test_fsdp_checkpoint import nested_equal

    for rank, r in enumerate(runs()):
        _ok(r)
        assert not _equal(r[f"resumed {form}"], r["max_grad_norm"]), (rank, form)
        assert nested_equal(r[f"resumed {form} state"], r["end state"]) is None, (rank, form)


def test_what_is_not_run_is_one_error_on_every_rank() -> None:
    ranks = runs()
    for r in ranks:
        _ok(r)
        got = r["refusals"]
        assert got == ranks[0]["refusals"]  # every rank alike
        assert "muon over stacked experts is not run under FSDP2" in got["muon"], got["muon"]
        assert "is not the mesh the experts live on" in got["expert_mesh"], got["expert_mesh"]
        assert got["expert_mesh taken"] == "no error"  # the experts' own mesh, named
        assert "HSDP (or TP) beside expert parallelism is not run" in got["hsdp"], got["hsdp"]
        assert "expert tensor parallelism (ETP > 1) is not" in got["etp"], got["etp"]


def test_the_simulator_reports_each_ranks_own_piece_of_its_experts() -> None:
    """`canzona simulate --fsdp --ep 2 --optimizer adamw` of this model at 4 ranks: per rank, every
    persistent category is what the runtime holds. Each EP rank's 3 experts a stack are torch.chunk'ed
    2 / 1 over its efsdp pair (ranks 0, 1 hold two, ranks 2, 3 one); before, the simulator gave every
    rank an even, rounded-up share of its EP rank's experts."""
    from dataclasses import replace

    from reference.tiny_moe import TinyMoe
    from sim.simulate import SimConfig, simulate
    from sim.workload import Workload
    from tests.runtime.expert_runs import moe_architecture

    spec = TinyMoe(config()).spec()
    arch = replace(moe_architecture(spec.name, "tiny-moe"), experts=config().experts)
    cfg = SimConfig(model=spec.name, gpus=WORLD, tp=1, ep=EP, fsdp=True, optimizer="adamw", policy="zero1",
                    workload=Workload(global_batch=2 * WORLD, seq_len=8, param_bytes=4))
    sim = simulate(cfg, model=(spec, arch)).memory
    ranks = [r["held"] for r in runs()]
    experts = [r["experts"] for r in ranks]
    assert experts[0] == experts[1] == 2 * experts[2] == 2 * experts[3] > 0, experts  # uneven pieces
    for got in ranks:
        for k in ("weights", "grads", "master_weights", "matrix_state", "adamw_state"):
            assert got[k] == getattr(sim.ranks[got["rank"]], k), (got["rank"], k, got[k],
                                                                   getattr(sim.ranks[got["rank"]], k))
