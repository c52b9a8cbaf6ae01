"""The step overlapped with the gradient reductions (`overlap_step`, issue 18 part 5).

- Simulator: on the demo layout (Qwen3-32B, 256 H100, TP 8) canzona's step shrinks and its
  iteration with it, backward and the last bucket's reduction unchanged; every micro-group's
  compute starts once its buckets are reduced and backward is done, every apply after the step
  check; `compare` runs the baselines without it; a baseline asked to run it is one error
  (simulator, memory model, CLI and runtime alike); the memory model holds the state copies and
  the updates until the check.
- Runtime (gloo, DP 2 and TP 2, one spawn): bit for bit the plain step with Muon, SOAP and
  Shampoo; with clipping that scales the gradients (the early updates are dropped and the plain
  step runs) and clipping that does not (they are committed); hyper-parameters changed between
  the check and `step()`; a NaN step skipped; a matrix without a gradient in a step; the same
  collectives as the plain step, the TP exchanges before the checks. At TP 2 with clipping this
  also checks the plain step's prefetched gathers (docs/design.md §6.3): scaled by the clip where
  they arrived, they give bit for bit what the dropped overlapped step's gathers, issued again
  after the clip, give.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from canzona.errors import SpecError
from canzona.harness.launch import run_ranks
from canzona.harness.training import TrainSpec, build_model, compare, global_batches, micro_batches
from canzona.memory import MemorySetup, memory_per_gpu
from canzona.models import resolve_model
from canzona.plan import make_plan
from canzona.runtime.checkpoint import without_weights_witness
from canzona.step_policies import STEP_POLICIES
from sim.options import RunOptions
from sim.simulate import SimConfig, layer_dims, simulate
from sim.simulate import compare as compare_policies
from tests.cli_helpers import error_line, invoke
from tests.runtime.outcomes import weights

DEADLINE_S = 240.0
OVERLAP = RunOptions(overlap_step=True)

# --- the simulator ------------------------------------------------------------------------------


def test_on_the_demo_layout_the_step_hides_under_the_remaining_reductions():
    plain, overlapped = simulate(SimConfig()), simulate(SimConfig(options=OVERLAP))
    assert plain.fell_back_to is None and overlapped.fell_back_to is None
    assert overlapped.grad_sync_end_s == pytest.approx(plain.grad_sync_end_s)
    assert overlapped.forward_backward_s == pytest.approx(plain.forward_backward_s)
    assert overlapped.optimizer_step_s < 0.6 * plain.optimizer_step_s
    assert overlapped.iteration_time_s < plain.iteration_time_s - 0.01  # > 10 ms of a 30 ms step hidden
    assert overlapped.memory.worst.total >= plain.memory.worst.total


SMALL = SimConfig(model="qwen3-0.6b", gpus=16, tp=2, options=RunOptions(overlap_step=True, collectives="runtime"))


def _spans(result, rank: int, pattern: str):
    import re

    return [s for s in result.spans if s.rank == rank and re.fullmatch(pattern, s.name)]


def test_groups_start_as_their_buckets_land_and_apply_after_the_check():
    # every rank's phase A simulated: one micro-batch a DP rank keeps it to seconds
    result = simulate(replace(SMALL, workload=replace(SMALL.workload, global_batch=8)), replicate_phase_a=False)
    for rank in (0, 1, 5):
        (check,) = _spans(result, rank, "step check")
        computes = _spans(result, rank, r"group \d+ compute")
        applies = _spans(result, rank, r"group \d+ apply")
        assert computes and len(applies) == len({s.name for s in computes})
        assert all(a.start >= check.end - 1e-12 for a in applies)
        backward_end = max(s.end for s in result.spans if s.rank == rank and s.phase == "A" and s.kind == "compute")
        assert all(c.start >= backward_end - 1e-12 for c in computes)
    # the overlap is real: some micro-group computed before the last reduction landed
    assert any(c.start < result.grad_sync_end_s for c in _spans(result, 0, r"group \d+ compute"))


def test_compare_runs_the_baselines_without_it_and_a_baseline_asked_for_it_is_one_error():
    results = compare_policies(replace(SMALL, options=OVERLAP))
    assert {r.config.policy: r.config.options.overlap_step for r in results} == \
        {name: name == "canzona" for name in STEP_POLICIES}
    for name in ("sc", "zero1-gather", "layerwise"):
        with pytest.raises(SpecError, match=f"overlap_step needs .* {name} does not"):
            replace(SMALL, policy=name).check()
    error_line(invoke("simulate", "--policy", "sc", "--overlap-step", "--model", "qwen3-0.6b", "--gpus", 16,
                      "--tp", 2), "overlap_step needs a policy whose owners read their gradients straight from "
               "the reduce-scatter (canzona); sc does not")


def test_the_memory_model_holds_the_state_copies_and_updates_until_the_check():
    spec, arch = resolve_model("qwen3-0.6b", 2)
    plan = make_plan(spec, 8, 2, "muon", "alpha-balanced", "greedy-rollback")
    dims = layer_dims(arch, spec)
    plain = memory_per_gpu(spec, plan, "canzona", dims, MemorySetup())
    held = memory_per_gpu(spec, plan, "canzona", dims, MemorySetup(overlap_step=True))
    for a, b in zip(plain.ranks, held.ranks):
        # a copy of the hosted state, and at least every hosted update, on top of the plain peak's groups
        assert b.step_buffers >= b.matrix_state + a.reduction
        assert b.step_buffers > a.step_buffers
    with pytest.raises(SpecError, match="overlap_step needs"):
        memory_per_gpu(spec, make_plan(spec, 8, 2, "muon", "zero1-even", "tp-sync"), "zero1-gather", dims,
                       MemorySetup(overlap_step=True))


# --- the runtime --------------------------------------------------------------------------------

DP = 2
BASE = TrainSpec(steps=3, global_batch=4 * DP)
CONFIGS = {"muon": {"ns_dtype": "fp32"}, "soap": {"precondition_frequency": 2},
           "shampoo": {"precondition_frequency": 2}}


def _optimizer(model, overlap: bool, **kwargs):
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters

    spec = kwargs.pop("spec", None) or model.spec()
    return DistributedOptimizer(list(named_parameters(model)), spec, overlap_step=overlap, **kwargs)


def _tokens(rank: int, world: int) -> list[torch.Tensor]:
    return [micro_batches(t, rank, world, 1)[0] for t in global_batches(BASE, 256)]




def optimizer_job(rank: int, world: int, overlap: bool, optimizer: str, clip: float | None,
                  lr_change: bool = False) -> dict:
    """Three steps of the usual loop; `clip` by `opt.clip_grad_norm_` before each step (0.05
    scales every step's gradients, 1e6 none); `lr_change`: the learning rates halved between the
    clip (which checked the step) and `step()`."""
    model = build_model(BASE)
    opt = _optimizer(model, overlap, optimizer=optimizer, matrix_config=CONFIGS[optimizer])
    norms = []
    for tokens in _tokens(rank, world):
        opt.zero_grad()
        model.loss(tokens).backward()
        if clip is not None:
            norms.append(float(opt.clip_grad_norm_(clip)))
        if lr_change:
            for group in opt.param_groups:
                group["lr"] *= 0.5
        opt.step()
    return {"params": weights(model), "norms": norms, "log": opt.comm.log.to_dicts(),
            "state": opt.state_dict(), "overlapped_steps": opt.overlapped_steps}


def nan_skip_job(rank: int, world: int, overlap: bool) -> dict:
    """Rank 1's loss is NaN at the second step (nonfinite="skip"), then training goes on."""
    model = build_model(BASE)
    opt = _optimizer(model, overlap, nonfinite="skip", matrix_config=CONFIGS["muon"])
    for k, tokens in enumerate(_tokens(rank, world)):
        opt.zero_grad()
        loss = model.loss(tokens)
        (loss * math.nan if k == 1 and rank == 1 else loss).backward()
        opt.step()
    return {"params": weights(model), "skipped": opt.skipped_steps, "log": opt.comm.log.to_dicts(),
            "overlapped_steps": opt.overlapped_steps}


def mid_step_checkpoint_job(rank: int, world: int, overlap: bool) -> dict:
    """A checkpoint taken between the step check and `step()` (after `clip_grad_norm_`, which
    reduces the gradients: an overlapped step's updates are computed then, not applied) holds the
    state before the step; one loaded there drops the early updates, and the step runs from the
    loaded state."""
    model = build_model(BASE)
    opt = _optimizer(model, overlap, matrix_config=CONFIGS["muon"])
    saved, shards = None, None
    for k, tokens in enumerate(_tokens(rank, world)):
        opt.zero_grad()
        model.loss(tokens).backward()
        opt.clip_grad_norm_(1e6)  # scales nothing: the early updates stand
        if k == 1:  # cloned: a sharded state dict holds the live tensors, as torch.distributed.checkpoint reads them
            saved = opt.state_dict()
            shards = {key: v.clone() for key, v in opt.sharded_state_dict().items() if isinstance(v, torch.Tensor)}
        if k == 2:  # beside the weights of a step later, on purpose: without the weights' witness
            opt.load_state_dict(without_weights_witness(saved))
        opt.step()
    return {"params": weights(model), "state": opt.state_dict(), "saved": saved, "shards": shards,
            "log": opt.comm.log.to_dicts(), "overlapped_steps": opt.overlapped_steps}


class _Branches(torch.nn.Module):
    """Three matrices; `b` takes part only when asked (a step where it gets no gradient anywhere)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 16, bias=False)
        self.b = torch.nn.Linear(16, 16, bias=False)
        self.c = torch.nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_b:
            h = torch.tanh(self.b(h))
        return self.c(h)


def unused_matrix_job(rank: int, world: int, overlap: bool) -> dict:
    from canzona.spec import ModelSpec

    model = _Branches()
    opt = _optimizer(model, overlap, spec=ModelSpec.from_module(model), matrix_config=CONFIGS["muon"])
    gen = torch.Generator().manual_seed(rank)
    for use_b in (True, False, True):  # b's momentum must stay as it was through the middle step
        opt.zero_grad()
        model(torch.randn(4, 16, generator=gen), use_b).square().mean().backward()
        opt.step()
    return {"params": weights(model), "state": opt.state_dict(), "log": opt.comm.log.to_dicts(),
            "overlapped_steps": opt.overlapped_steps}


def tp_job(rank: int, world: int, overlap: bool, clip: float | None) -> dict:
    """TP 2 (DP 1): the micro-groups' exchanges run before the checks; clipping (0.05) drops them."""
    from canzona.harness.training import distributed_worker

    spec = TrainSpec(steps=3, global_batch=4, tp=2, matrix_config=CONFIGS["muon"], clip_norm=clip,
                     overlap_step=overlap)
    return distributed_worker(rank, world, spec, {"state_dict": False})


JOBS = {
    **{("plain", opt): ("optimizer_job", (opt, None)) for opt in CONFIGS},
    ("clipped", "muon"): ("optimizer_job", ("muon", 0.05)),
    ("clipped", "soap"): ("optimizer_job", ("soap", 0.05)),
    ("not clipped", "muon"): ("optimizer_job", ("muon", 1e6)),
    ("lr changed", "muon"): ("optimizer_job", ("muon", math.inf, True)),
    ("nan skipped", "muon"): ("nan_skip_job", ()),
    ("unused matrix", "muon"): ("unused_matrix_job", ()),
    ("checkpoint mid-step", "muon"): ("mid_step_checkpoint_job", ()),
    ("tp", "muon"): ("tp_job", (None,)),
    ("tp clipped", "muon"): ("tp_job", (0.05,)),
}


def jobs_worker(rank: int, world: int) -> dict:
    return {(key, overlap): globals()[fn](rank, world, overlap, *args)
            for key, (fn, args) in JOBS.items() for overlap in (False, True)}


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(jobs_worker, DP, deadline_s=DEADLINE_S, collective_timeout_s=60)


def _state_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_state_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_state_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.distributed
@pytest.mark.parametrize("key", list(JOBS), ids=lambda k: "-".join(k))
def test_bit_for_bit_the_plain_step(runs, key):
    for rank in runs:
        plain, overlapped = rank[key, False], rank[key, True]
        assert compare(overlapped["params"], plain["params"])["bit_identical"], key
        for field in ("norms", "skipped"):
            if field in plain:
                assert overlapped[field] == plain[field], (key, field)
        assert _records(overlapped["log"]) == _records(plain["log"]), key  # the DP log: the same collectives
        for field in ("state", "saved", "shards"):
            if field in plain:
                assert _state_equal(overlapped[field], plain[field]), (key, field)
        if key[0].startswith("tp"):
            early = _tp_step(overlapped, 1)
            check = early.index("tp step check")
            if key[0] == "tp":  # the same exchanges, all issued before the checks
                assert sorted(early) == sorted(_tp_step(plain, 1)) and check == len(early) - 1
            else:  # clipped: the early exchanges are dropped, then the plain step's run after the checks
                # (all of them: the plain step prefetches its first gathers before the check, scales
                # what they brought when clipping, and the parameters above are bit for bit the same)
                plain_tp = _tp_step(plain, 1)
                prefetched = plain_tp[:plain_tp.index("tp step check")]
                assert prefetched and all(name.endswith("gather") for name in prefetched)
                # step() after the clip rechecks the hyper-parameters first (`GradientSync._recheck`)
                assert plain_tp[len(prefetched):len(prefetched) + 2] == ["tp step check", "tp step recheck"]
                assert early[check:] == ["tp step check", "tp step recheck"] + prefetched + \
                    plain_tp[len(prefetched) + 2:] and check > 0


def _records(log: list[dict]) -> list[dict]:
    """A log's records without their place in the issue order shared with the TP log."""
    return [{k: v for k, v in x.items() if k != "seq"} for x in log]


def _tp_step(result: dict, step: int) -> list[str]:
    return [x["name"] for x in result["tp_log"] if x["step"] == step]


# steps whose early updates were committed (the rest dropped them and ran the plain step)
COMMITTED = {"plain": 3, "clipped": 0, "not clipped": 3, "lr changed": 0, "nan skipped": 2, "unused matrix": 3,
             "checkpoint mid-step": 2, "tp": 3, "tp clipped": 0}


@pytest.mark.distributed
def test_the_cases_exercise_what_they_name(runs):
    for rank in runs:
        for key in JOBS:
            assert rank[key, False]["overlapped_steps"] == 0
            assert rank[key, True]["overlapped_steps"] == COMMITTED[key[0]], key
        assert rank[("nan skipped", "muon"), True]["skipped"] == 1
        clipped, free = rank[("clipped", "muon"), True]["norms"], rank[("not clipped", "muon"), True]["norms"]
        assert all(n > 0.05 for n in clipped) and all(n < 1e6 for n in free)


def test_a_baseline_policy_refuses_it_at_construction():
    from canzona.runtime import DistributedOptimizer

    model = build_model(BASE)
    with pytest.raises(SpecError, match="overlap_step needs a policy .*; sc does not"):
        DistributedOptimizer(list(model.named_parameters()), model.spec(), policy="sc", overlap_step=True)
    with pytest.raises(SpecError, match="overlap_step must be True or False"):
        DistributedOptimizer(list(model.named_parameters()), model.spec(), overlap_step="yes")
