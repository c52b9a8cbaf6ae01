"""Accidents under expert parallelism (issue 20; docs/design.md §2.7): DP 4 = EDP 2 x EP 2 with the
tiny mixture of experts (`reference/tiny_moe_ep.py`).

- A NaN in one expert's gradient on one rank: the experts' norm reaches the one global verdict, so
  `nonfinite="raise"` stops every rank with the same error and nothing is updated, and
  `nonfinite="skip"` skips the step on every rank alike (counted), after which training goes on.
- A step broken on the ranks of one EDP group only (an expert gradient dropped between backward and
  step): the experts' check fails there, and the dense check over DP carries that failure to the
  other EDP group, so every rank stops at once with an error, instead of the healthy group waiting
  in the step's collectives until the timeout.
- A rank that dies before step(): its peers get an error within the collective timeout, not a hang.
- An EP rank whose experts got no tokens in a step, on one rank, in every layer (its experts
  module skipping them, as transformers' loops over experts do): their gradients are None there,
  which is a zero contribution to the EDP sum, as a zero gradient is; the step runs, bit for bit
  as the same step with those gradients zeros. On every rank of one EP rank (no gradient in the
  EDP group), those experts still step with zeros, as one process steps the stack whole, bit for
  bit the same kernels in one process, and the state dict holds the stack as one entry (AdamW:
  its steps in line).
- A decoder layer that no rank's forward runs in a step (LayerDrop): its expert stacks got no
  gradient on any rank of the cluster, and are skipped as one process skips them (AdamW: no weight
  decay, no step counted), bit for bit the same kernels in one process.
- Only the experts trained (the rest frozen): the step runs (every rank's backward reached its
  experts), as with the rest given at lr 0.
- torch.amp.GradScaler: its unscale reaches the experts' buffers (the unscaled clipped loop bit for
  bit), and an Inf in one expert's gradient on one rank is skipped by every rank's scaler alike.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from pathlib import Path

import pytest

from canzona.errors import CanzonaError
from canzona.harness.launch import run_ranks
from canzona.harness.training import TrainSpec
from tests.runtime.expert_runs import check_same_kernels, idle_ep_rank_job, skipped_layer_job

pytestmark = pytest.mark.distributed  # spawns gloo process groups

WORLD, EP = 4, 2
TIMEOUT_S = 20.0  # the optimizer's collective timeout: a failure must come well before it
DEADLINE_S = 120.0
EXPERT = "model.layers.0.mlp.experts.down_proj"  # a stack every rank holds experts of
SICK = 3  # the rank (EDP 1, EP 1) whose expert gradient goes wrong
# layer 1 skipped by every rank in the first step, run in the second (AdamW: a step taken with zero
# gradients moves the weights by weight decay and counts in the bias correction)
SKIPPED = TrainSpec(preset="tiny-moe", optimizer="adamw", ep=EP, steps=2, global_batch=8, seq_len=8, bucket_size=1024)


def _setup(rank: int, nonfinite: str = "raise", optimizer: str = "muon"):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from canzona.runtime.optimizer import DistributedOptimizer
    from reference.tiny_moe import MOE_PRESETS
    from reference.tiny_moe_ep import TinyMoeEP

    mesh = init_device_mesh("cpu", (WORLD // EP, EP), mesh_dim_names=("edp", "ep"))
    model = TinyMoeEP(MOE_PRESETS["tiny-moe"], mesh.get_group("ep"))
    opt = DistributedOptimizer(model.named_parameters(), model.spec(), optimizer,
                               {"ns_dtype": "fp32"} if optimizer == "muon" else None,
                               timeout_s=TIMEOUT_S, nonfinite=nonfinite, bucket_size=1024, expert_mesh=mesh)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 64, (2, 9), generator=gen) for _ in range(2)]
    return torch, model, opt, batches


def _snapshot(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _unchanged(before: dict, model) -> bool:
    import torch

    return all(torch.equal(before[n], p.detach()) for n, p in model.named_parameters())


def _outcome(fn) -> dict:
    start = time.monotonic()
    try:
        fn()
        return {"error": None, "elapsed_s": time.monotonic() - start}
    except CanzonaError as e:
        return {"error": str(e), "elapsed_s": time.monotonic() - start}


def nan_job(rank: int, world: int, nonfinite: str) -> dict:
    torch, model, opt, batches = _setup(rank, nonfinite)
    before = _snapshot(model)
    params = dict(model.named_parameters())
    if rank == SICK:  # NaN in one expert's gradient, before the optimizer's hooks reduce it
        handle = params[EXPERT].register_hook(lambda g: torch.full_like(g, math.nan))
    model.loss(batches[0]).backward()
    if rank == SICK:
        handle.remove()
    out = _outcome(opt.step)
    out["unchanged"] = _unchanged(before, model)
    out["skipped"] = opt.skipped_steps
    if out["error"] is None:  # skipped: the next step trains as usual
        opt.zero_grad()
        model.loss(batches[1]).backward()
        opt.step()
        out["finite_after"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        out["changed_after"] = not _unchanged(before, model)
    return out


def grad_scaler_job(rank: int, world: int) -> dict:
    """torch.amp.GradScaler (scale 2**10) over the dense and the experts' parts: `unscale_`, clip,
    `step` against the unscaled clipped loop (bit for bit: a power-of-two scale is exact), and an
    Inf in one expert's gradient on one rank at the second step (`scaler.step` alone, the default
    nonfinite='raise'): skipped on every rank, the scale halved alike."""
    torch, model, opt, batches = _setup(rank)
    for tokens in batches:
        opt.zero_grad()
        model.loss(tokens).backward()
        opt.clip_grad_norm_(0.05)
        opt.step()
    opt.wait_params()
    want = _snapshot(model)
    out: dict = {}
    for how in ("unscale", "inf"):
        _, model, opt, batches = _setup(rank)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        changed = []
        for i, tokens in enumerate(batches * (1 if how == "unscale" else 2)):
            before = _snapshot(model)
            opt.zero_grad()
            sick = how == "inf" and i == 1 and rank == SICK
            if sick:
                handle = dict(model.named_parameters())[EXPERT].register_hook(lambda g: torch.full_like(g, math.inf))
            scaler.scale(model.loss(tokens)).backward()
            if sick:
                handle.remove()
            if how == "unscale":
                scaler.unscale_(opt)
                opt.clip_grad_norm_(0.05)
            scaler.step(opt)
            scaler.update()
            opt.wait_params()
            changed.append(not _unchanged(before, model))
        out[how] = {"changed": changed, "scale": scaler.get_scale(), "skipped": opt.skipped_steps,
                    "exact": how == "unscale" and all(torch.equal(want[n], p.detach())
                                                      for n, p in model.named_parameters())}
    return out


def broken_group_job(rank: int, world: int) -> dict:
    torch, model, opt, batches = _setup(rank)
    before = _snapshot(model)
    model.loss(batches[0]).backward()
    if rank == SICK:  # the gradient dropped after backward handed it to the reduction
        dict(model.named_parameters())[EXPERT].grad = None
    out = _outcome(opt.step)
    out["unchanged"] = _unchanged(before, model)
    return out


def disagreement_job(rank: int, world: int) -> dict:
    """A learning rate set on rank 0 alone, then a clip threshold that differs on rank 0: refused on
    every rank as a disagreement, not a broken step; the gradients stay for a retry (the lr put
    back; the clip called again alike), which steps."""
    torch, model, opt, batches = _setup(rank)
    model.loss(batches[0]).backward()
    lr = opt.param_groups[0]["lr"]
    if rank == 0:
        opt.param_groups[0]["lr"] = lr * 2
    out = {"lr": _outcome(opt.step)}
    opt.param_groups[0]["lr"] = lr
    before = _snapshot(model)
    out["retry"] = _outcome(opt.step)
    out["changed"] = not _unchanged(before, model)
    opt.zero_grad()
    model.loss(batches[1]).backward()
    out["clip"] = _outcome(lambda: opt.clip_grad_norm_(1.0 if rank == 0 else 2.0))
    out["clip again"] = _outcome(lambda: opt.clip_grad_norm_(1.0))
    out["clipped step"] = _outcome(opt.step)
    return out


def dying_job(rank: int, world: int, outdir: str) -> str:
    torch, model, opt, batches = _setup(rank)
    model.loss(batches[0]).backward()
    if rank == SICK:
        os._exit(3)
    out = _outcome(opt.step)
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(out))
    raise CanzonaError(out["error"] or "stepped without its peer")


def idle_experts_job(rank: int, world: int, reads_weights: bool, idle: tuple[int, ...] = (SICK,),
                     optimizer: str = "muon") -> dict:
    """The experts of the ranks `idle` get no tokens in the first step: their output is zeros, which
    reads the weights (a zero gradient) or not (no gradient, as an experts module that skips an
    expert without tokens)."""
    torch, model, opt, batches = _setup(rank, optimizer=optimizer)
    real = [layer.mlp.experts.expert for layer in model.model.layers]
    if rank in idle:
        for layer in model.model.layers:
            experts = layer.mlp.experts
            experts.expert = (lambda e, x, real=experts.expert: 0 * real(e, x)) if reads_weights else \
                (lambda e, x, experts=experts: x.new_zeros(x.shape[0], experts.down_proj.shape[1]) + 0 * x[:, :1])
    out = {}
    for s, batch in enumerate(batches):
        opt.zero_grad()
        model.loss(batch).backward()
        out[s] = _outcome(opt.step)
        for layer, forward in zip(model.model.layers, real):
            layer.mlp.experts.expert = forward
    out["state"] = _outcome(opt.state_dict)  # the experts' state of every EP rank under one name
    opt.wait_params()
    out["params"] = _snapshot(model)
    return out


def experts_only_job(rank: int, world: int, frozen: bool) -> dict:
    """Only the experts train: the rest frozen (left out of the optimizer and its spec), or given
    with lr 0, which leaves it as it is and the experts' updates the same, bit for bit."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from canzona.runtime.optimizer import DistributedOptimizer
    from canzona.spec import ModelSpec, Role
    from reference.tiny_moe import MOE_PRESETS
    from reference.tiny_moe_ep import TinyMoeEP

    mesh = init_device_mesh("cpu", (WORLD // EP, EP), mesh_dim_names=("edp", "ep"))
    model = TinyMoeEP(MOE_PRESETS["tiny-moe"], mesh.get_group("ep"))
    spec = model.spec()
    experts = {p.name for p in spec.params if p.role is Role.EXPERT}
    named = list(model.named_parameters())
    if frozen:
        for name, p in named:
            p.requires_grad_(name in experts)
        spec = ModelSpec(spec.name, tuple(p for p in spec.params if p.name in experts))
        groups = [(n, p) for n, p in named if n in experts]
    else:
        groups = [{"params": [(n, p) for n, p in named if n not in experts], "lr": 0.0},
                  {"params": [(n, p) for n, p in named if n in experts]}]
    opt = DistributedOptimizer(groups, spec, "muon", {"ns_dtype": "fp32"}, timeout_s=TIMEOUT_S, bucket_size=1024,
                               expert_mesh=mesh)
    gen = torch.Generator().manual_seed(rank)
    out = {}
    for s in range(2):
        opt.zero_grad()
        model.loss(torch.randint(0, 64, (2, 9), generator=gen)).backward()
        out[s] = _outcome(opt.step)
    opt.wait_params()
    out["params"] = _snapshot(model)
    return out


def jobs_worker(rank: int, world: int) -> dict:
    return {"raise": nan_job(rank, world, "raise"), "skip": nan_job(rank, world, "skip"),
            "broken": broken_group_job(rank, world), "disagree": disagreement_job(rank, world),
            "idle": idle_experts_job(rank, world, False),
            "grad scaler": grad_scaler_job(rank, world),
            "idle-zeros": idle_experts_job(rank, world, True),
            # every rank of EP rank 1 (its EDP group): no rank holding those experts got a gradient
            "idle-ep-rank": idle_ep_rank_job(rank, world, SKIPPED, idle_ep_rank=1, idle_steps=(0,)),
            "experts-only": experts_only_job(rank, world, True),
            "dense-lr-0": experts_only_job(rank, world, False),
            "skipped-layer": skipped_layer_job(rank, world, SKIPPED, layer=1, skipped_steps=(0,))}


@functools.cache
def outcomes() -> list[dict]:
    return run_ranks(jobs_worker, WORLD, deadline_s=DEADLINE_S, collective_timeout_s=60)


def test_a_nan_expert_gradient_on_one_rank_stops_every_rank_before_any_update():
    got = [o["raise"] for o in outcomes()]
    assert all(o["error"] is not None and "global gradient norm is nan" in o["error"] for o in got), got
    assert all(o["unchanged"] for o in got)


def test_a_nan_expert_gradient_on_one_rank_is_skipped_on_every_rank_alike():
    got = [o["skip"] for o in outcomes()]
    assert all(o["error"] is None and o["skipped"] == 1 and o["unchanged"] for o in got), got
    assert all(o["finite_after"] and o["changed_after"] for o in got), got


def test_grad_scaler_unscales_the_experts_and_skips_their_inf_on_every_rank():
    """GradScaler's unscale reaches the experts' buffers too (their guards hand it to the same
    optimizer): the unscaled loop's weights bit for bit; an Inf in one expert's gradient on one rank
    is found by every rank's scaler (the global norm carries the experts' share), every rank skips
    that step and halves its scale."""
    for rank, o in enumerate(o["grad scaler"] for o in outcomes()):
        assert o["unscale"]["exact"] and o["unscale"]["changed"] == [True, True], (rank, o)
        assert o["inf"]["changed"] == [True, False, True, True] and o["inf"]["skipped"] == 1, (rank, o)
        assert o["inf"]["scale"] == 2.0 ** 9, (rank, o)


def test_a_step_broken_in_one_edp_group_stops_every_rank_at_once():
    got = [o["broken"] for o in outcomes()]
    for rank, o in enumerate(got):
        assert o["error"] is not None and o["unchanged"], (rank, o)
        assert o["elapsed_s"] < TIMEOUT_S / 2, (rank, o)  # nobody waited for the timeout
        if rank == SICK:
            assert f"{EXPERT!r} was dropped" in o["error"]
        else:
            # the sick rank's EDP peers (told over EDP, then over DP) and the healthy EDP group (told
            # by the dense check over DP) alike: the sick rank named once, by its DP rank, and its
            # line. Before: the EDP peer's 'rank(s) [1] found a broken step: ...' (1: an EDP rank)
            # nested in 'rank(s) [1, 3] found a broken step: ...' on the healthy group
            assert o["error"] == f"rank(s) [{SICK}] found a broken step: {got[SICK]['error']}", (rank, o)


def test_a_disagreement_seen_by_the_experts_check_is_refused_alike_and_a_retry_steps():
    """The experts' check over EDP fails on one EDP group only (lr or threshold differs on rank 0):
    every rank says the disagreement over DP, none that a step is broken, and the gradients stay
    for a retry. Before: the experts' failure counted as a broken step ('rank(s) [0, 2] found a
    broken step: ranks disagree ...'), the step was dropped, and the retry was refused."""
    for rank, o in enumerate(o["disagree"] for o in outcomes()):
        assert "param_groups[0]['lr'] is" in o["lr"]["error"] and "broken" not in o["lr"]["error"], (rank, o)
        assert o["retry"]["error"] is None and o["changed"], (rank, o)
        assert "clip threshold" in o["clip"]["error"] and "broken" not in o["clip"]["error"], (rank, o)
        assert o["clip again"]["error"] is None and o["clipped step"]["error"] is None, (rank, o)


def test_experts_that_got_no_tokens_on_one_rank_are_a_zero_gradient_not_an_error():
    import torch

    for rank, (idle, zeros) in enumerate(zip((o["idle"] for o in outcomes()), (o["idle-zeros"] for o in outcomes()))):
        assert [idle[s]["error"] for s in (0, 1)] == [None, None], (rank, idle)
        assert all(torch.equal(idle["params"][n], zeros["params"][n]) for n in zeros["params"]), rank


def test_experts_that_got_no_tokens_on_any_rank_of_their_ep_rank_step_as_the_whole_stack_does():
    """A stack is one tensor of the model: one process steps all of its experts whenever any got a
    token (the others' gradients zeros). Under EP the experts of EP rank 1, which no rank of its EDP
    group gave a gradient in the first step, step so too (AdamW: weight decay, their steps in line
    with EP rank 0's), bit for bit the same kernels in one process fed the global gradients with
    zeros there; the state dict holds each stack as one entry."""
    ranks = [o["idle-ep-rank"] for o in outcomes()]
    stacks = {"model.layers.0.mlp.experts.down_proj", "model.layers.1.mlp.experts.gate_up_proj"}
    assert all(bool(stacks & set(r["grads"][0])) == (r["ep_rank"] == 0) for r in ranks)  # as staged
    check_same_kernels(SKIPPED, ranks, WORLD, "EP rank 1 idle in step 1", 1e-5)
    for r in ranks:
        names = [n for group in r["state entries"] for n in group]
        assert len(names) == len(set(names)) and stacks <= set(names)


def test_an_expert_stack_no_rank_reached_is_skipped_as_one_process_skips_it():
    """Layer 1 skipped by every rank in the first step: its stacks (and its router and norm) got no
    gradient anywhere, so one process's optimizer leaves them and their state alone, and the
    second step is their first; the runtime does the same, bit for bit."""
    ranks = [o["skipped-layer"] for o in outcomes()]
    stacks = {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"}
    assert all(not stacks & set(r["grads"][0]) and stacks <= set(r["grads"][1]) for r in ranks)  # as staged
    check_same_kernels(SKIPPED, ranks, WORLD, "layer 1 skipped in step 1", 1e-5)


def test_training_only_the_experts_under_ep_steps_them_as_with_the_rest_at_lr_0():
    import torch

    for rank, o in enumerate(outcomes()):
        only, still = o["experts-only"], o["dense-lr-0"]
        assert [only[s]["error"] for s in (0, 1)] == [None, None], (rank, only[0], only[1])
        assert all(torch.equal(only["params"][n], still["params"][n]) for n in still["params"]), rank
        assert not torch.equal(only["params"][EXPERT], _setup_free_initial(rank)[EXPERT]), rank  # they trained


def _setup_free_initial(rank: int) -> dict:
    """This rank's initial parameters, without a process group (EP rank `rank % EP`'s experts)."""
    from reference.tiny_moe import MOE_PRESETS, TinyMoe

    whole = dict(TinyMoe(MOE_PRESETS["tiny-moe"]).named_parameters())
    out = {n: p.detach() for n, p in whole.items()}
    k = out[EXPERT].shape[0] // EP
    out[EXPERT] = out[EXPERT][rank % EP * k:(rank % EP + 1) * k]
    return out


def test_a_rank_that_dies_before_step_is_an_error_on_its_peers_not_a_hang(tmp_path):
    start = time.monotonic()
    with pytest.raises(CanzonaError):
        run_ranks(dying_job, WORLD, str(tmp_path), deadline_s=DEADLINE_S, collective_timeout_s=60)
    assert time.monotonic() - start < DEADLINE_S
    for rank in range(WORLD):
        if rank != SICK and (tmp_path / f"rank{rank}.json").exists():
            out = json.loads((tmp_path / f"rank{rank}.json").read_text())
            assert out["error"] is not None and out["elapsed_s"] < TIMEOUT_S + 10, (rank, out)
