"""The step's parameter all-gathers under the next forward (`overlap_param_gather`, issue 18 #1):
`step()` returns with them in flight, and every documented path that reads the parameters waits
for them first: a module's forward (eval under `no_grad` too), `model.state_dict()`,
`model.load_state_dict()`, the optimizer's own methods and `opt.wait_params()`; a forward of a
`torch.compile`d model traced before the optimizer existed too; and any other read of a parameter's
values (torch's EMA, `copy.deepcopy`, pickling, a hand loop, a custom method, a forward reading
another module's weight), through the parameter's pending mark (`pending_params`). Training is bit
for bit the training with the gathers inside the step.

A gather that is still in flight on rank 0 is made certain: rank 1 sleeps before its step, so
rank 1's segments cannot reach rank 0 until it wakes; whatever rank 0 reads meanwhile without
waiting would be last step's values (and a load would be overwritten when they land). Where each
step must leave gathers in flight, rank 1 launches its gathers late instead (`_late_gathers`): the
step's own checks are collectives, which a rank sleeping before its step holds up too.
"""

from __future__ import annotations

import copy
import functools
import io
import time

import pytest
import torch

from canzona.harness.launch import run_ranks
from canzona.harness.training import TrainSpec, build_model, compare, global_batches, micro_batches
from canzona.spec import ModelSpec, ParamSpec, Role
from tests.runtime.outcomes import outcome, weights

pytestmark = pytest.mark.distributed  # spawns gloo process groups

DP = 2
SPEC = TrainSpec(steps=3, global_batch=4 * DP)
LATE_S = 1.0  # rank 1's delay before its last step


def _optimizer(model, **kwargs):
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters

    return DistributedOptimizer(list(named_parameters(model)), model.spec(), **kwargs)


def _batches(rank: int, world: int) -> list[torch.Tensor]:
    return [micro_batches(t, rank, world, 1)[0] for t in global_batches(SPEC, 256)]


def _train(model, opt, batches, late_rank: int | None = None, after_step=None) -> list[float]:
    """`late_rank` sleeps before the last step; `after_step(k)` reads the parameters after step k."""
    losses = []
    for k, tokens in enumerate(batches):
        opt.zero_grad()
        loss = model.loss(tokens)
        loss.backward()
        losses.append(float(loss))
        if late_rank == opt.rank and k == len(batches) - 1:
            time.sleep(LATE_S)
        opt.step()
        if after_step is not None:
            after_step(k)
    return losses


def _late_gathers(opt) -> None:
    """This rank launches each step's parameter gathers `LATE_S` late (its reductions on time): the
    other ranks' gathers of its segments are in flight for that long after their `step()` returns."""
    launch = opt._launch_gathers

    def late():
        time.sleep(LATE_S)
        return launch()
    opt._launch_gathers = late


def training_job(rank: int, world: int) -> dict:
    """The same training with the gathers overlapped and inside the step; then an eval forward."""
    out = {}
    for overlap in (True, False):
        model = build_model(SPEC)
        opt = _optimizer(model, overlap_param_gather=overlap)
        losses = _train(model, opt, _batches(rank, world))
        in_flight = opt._in_flight is not None and opt._in_flight.in_flight
        opt.zero_grad()  # reads no parameter values: the gathers stay in flight
        in_flight = in_flight and opt._in_flight is not None and opt._in_flight.in_flight
        with torch.no_grad():
            model.eval()
            eval_loss = float(model.loss(_batches(rank, world)[0]))  # the forward waits
        out[overlap] = {"losses": losses, "eval": eval_loss, "params": weights(model),
                        "in flight after step": in_flight, "overlap": opt.overlap_param_gather}
    from canzona.runtime import DistributedOptimizer

    model = build_model(SPEC)
    out["sc"] = _optimizer(model, policy="sc").overlap_param_gather  # gathers nothing
    bare = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in model.named_parameters()]
    out["bare"] = DistributedOptimizer(bare, model.spec()).overlap_param_gather  # no module to hook
    return out


def reading_job(rank: int, world: int, how: str) -> dict:
    """Rank 1 is late to the last step: on rank 0 the gathers of rank 1's segments are in flight
    when `how` reads (or writes) the parameters."""
    model = build_model(SPEC)
    tokens = _batches(rank, world)[0][:, :-1]
    if how == "compiled forward":
        # torch.compile traced the model (a warm-up or an evaluation) before the optimizer hooked it
        torch.compiler.reset()
        compiled = torch.compile(model, backend="eager")  # dynamo's tracing, eager kernels: bit for bit
        with torch.no_grad():
            compiled(tokens)
    opt = _optimizer(model)
    _train(model, opt, _batches(rank, world), late_rank=1)
    loaded = {n: torch.full_like(p, 0.5) for n, p in model.named_parameters()}
    seen = None
    if how == "model.state_dict":
        seen = {n: t.clone() for n, t in model.state_dict().items() if n in loaded}
    elif how == "model.load_state_dict":
        model.load_state_dict(loaded, strict=False)
    elif how == "opt.state_dict":
        opt.state_dict()
    elif how == "wait_params":
        opt.wait_params()
    elif how == "forward":
        with torch.no_grad():
            model.loss(_batches(rank, world)[0])
    elif how == "compiled forward":
        with torch.no_grad():
            seen = {"logits": compiled(tokens)}
    in_flight = opt._in_flight.in_flight
    opt.wait_params()
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    if how == "compiled forward":
        with torch.no_grad():
            seen["eager logits"] = model(tokens)
    return {"seen": seen, "final": final, "in flight": in_flight,
            "loaded kept": all(torch.equal(final[n], loaded[n]) for n in loaded)}


HABITS = ("ema", "ema with buffers", "deepcopy", "pickle", "pickle model", "parameters loop")  # each the first read after one step


def habits_job(rank: int, world: int) -> dict:
    """The reads that go through no hook of the optimizer's, right after each step: torch's EMA
    (`AveragedModel`, with and without its buffers), `copy.deepcopy(model)`, `torch.save` of the
    parameters and of the model, and their norms by hand. Each step rank 1 launches its gathers
    late, and a different habit reads first while rank 0's gathers of rank 1's segments are in
    flight; the same reads with the gathers inside the step."""
    spec = TrainSpec(steps=len(HABITS), global_batch=4 * DP)
    batches = [micro_batches(t, rank, world, 1)[0] for t in global_batches(spec, 256)]
    return {overlap: _habits(spec, batches, overlap, late=overlap and rank == 1) for overlap in (True, False)}


def _habits(spec: TrainSpec, batches: list[torch.Tensor], overlap: bool, late: bool) -> dict:
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model = build_model(spec)
    emas = {use: AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99), use_buffers=use) for use in (False, True)}
    opt = _optimizer(model, overlap_param_gather=overlap)
    if late:
        _late_gathers(opt)
    seen: dict = {}
    in_flight = []

    def read(how: str) -> None:
        if how.startswith("ema"):
            emas[how == "ema with buffers"].update_parameters(model)
        elif how == "deepcopy":
            seen[how] = {n: p.detach().clone() for n, p in copy.deepcopy(model).named_parameters()}
        elif how == "pickle":  # the parameters
            buffer = io.BytesIO()
            torch.save(dict(model.named_parameters()), buffer)
            buffer.seek(0)
            seen[how] = {n: p.detach() for n, p in torch.load(buffer).items()}
        elif how == "pickle model":  # the whole module, with the optimizer's hooks on its modules
            buffer = io.BytesIO()
            torch.save(model, buffer)
            buffer.seek(0)
            seen[how] = {n: p.detach() for n, p in torch.load(buffer, weights_only=False).named_parameters()}
        else:
            seen[how] = {n: p.norm() for n, p in model.named_parameters()}

    def after_step(k: int) -> None:
        in_flight.append(opt._in_flight is not None and opt._in_flight.in_flight)
        for how in HABITS[k:] + HABITS[:k]:  # HABITS[k] first, while the gathers are in flight
            if how.startswith("ema") or how == HABITS[k]:
                read(how)

    _train(model, opt, batches, after_step=after_step)
    for use, ema in emas.items():
        seen["ema with buffers" if use else "ema"] = {n: p.detach().clone() for n, p in ema.module.named_parameters()}
    return {"seen": seen, "in flight": in_flight}


def test_reads_that_pass_no_hook_wait_for_the_gathers():
    """An EMA, a deepcopy, a pickle and a hand loop over the parameters right after `step()` read this step's
    weights, bit for bit as with the gathers inside the step, not a mix with the last step's."""
    mixed = []
    for rank, r in enumerate(run_ranks(habits_job, DP, deadline_s=240.0)):
        on, off = r[True], r[False]
        if rank == 0:  # rank 1 was late: its segments' gathers were in flight when each habit read
            assert all(on["in flight"]), on["in flight"]
        assert not any(off["in flight"])
        mixed += [(rank, how) for how in HABITS if not compare(on["seen"][how], off["seen"][how])["bit_identical"]]
    assert not mixed


class ReadsFirst(torch.nn.Module):
    """Its forward reads another module's weight (`first`, run after it), as a tied head may."""

    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.mix = torch.nn.Parameter(0.3 * torch.randn(16, 16, generator=g))

    def forward(self, x: torch.Tensor, first: torch.nn.Linear) -> torch.Tensor:
        return torch.nn.functional.linear(x, first.weight) @ self.mix


class ReadsOutsideForward(torch.nn.Module):
    """Its loss reads its own parameters in a method of its own, never through forward, and a
    child's forward reads another child's weight before that child runs."""

    def __init__(self, param=torch.nn.Parameter) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = param(0.3 * torch.randn(32, 16, generator=g))
        self.w = param(0.3 * torch.randn(16, 16, generator=g))
        self.reads_first = ReadsFirst(g)
        self.first = torch.nn.Linear(16, 16, bias=False)
        with torch.no_grad():
            self.first.weight.copy_(0.3 * torch.randn(16, 16, generator=g))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed[tokens] @ self.w.T
        return self.first(self.reads_first(h, self.first)).square().mean()

    @staticmethod
    def spec() -> ModelSpec:
        return ModelSpec("reads-outside-forward", (
            ParamSpec("embed", (32, 16), Role.EMBEDDING, dtype="fp32"), ParamSpec("w", (16, 16), Role.MATRIX, dtype="fp32"),
            ParamSpec("reads_first.mix", (16, 16), Role.MATRIX, dtype="fp32"),
            ParamSpec("first.weight", (16, 16), Role.MATRIX, dtype="fp32")))


class OwnParameter(torch.nn.Parameter):
    """A parameter class of the user's own, marked pending as `nn.Parameter` is (a subclass of its class)."""


class FinalParameter(torch.nn.Parameter):
    """A parameter class that takes no subclass: left unmarked (`pending_params.markable`), its
    reads outside the forwards are not waited for."""

    def __init_subclass__(cls, **kwargs):
        raise TypeError("FinalParameter takes no subclass")


def outside_forward_job(rank: int, world: int) -> dict:
    """Reads outside the forwards of the modules holding the parameters, right after `step()`: of
    plain parameters (they wait), with the gathers overlapped (eager and compiled) and inside the
    step, and of the user's own parameter class (they wait too); "final class on rank 1": rank 1's
    model alone holds a parameter class that takes no subclass, left unmarked, so its read is not
    waited for (one error at the step, on every rank, nothing updated)."""
    from canzona.runtime import DistributedOptimizer

    tokens = torch.arange(8).reshape(2, 4) + 4 * rank
    out = {}
    for case in ("overlap", "inside", "own class", "compiled", "final class on rank 1"):
        cls = (OwnParameter if case == "own class" else FinalParameter if case == "final class on rank 1" and rank == 1
               else torch.nn.Parameter)
        model = ReadsOutsideForward(cls)
        # a bucket per matrix: `first.weight`'s gather is not one that reads_first's hook waits for
        opt = DistributedOptimizer(list(model.named_parameters()), model.spec(), overlap_param_gather=case != "inside",
                                   bucket_size=256)
        # dynamo's tracing, eager kernels: bit for bit (not fullgraph: the waits break the graph)
        loss_of = torch.compile(model.loss, backend="eager") if case == "compiled" else model.loss
        losses, after = [], []
        for _ in range(3):
            loss = loss_of(tokens)  # the later ones read before the last step's gathers landed
            losses.append(outcome(lambda loss=loss, opt=opt: (loss.backward(), opt.step())) | {"loss": float(loss)})
            if losses[-1]["error"]:
                break
            opt.zero_grad()
            if case == "inside":  # no gathers in flight after step(): read as they are
                after.append({n: p.detach().clone() for n, p in model.named_parameters()})
        out[case] = {"losses": losses, "after": after,
                     "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    return out


@functools.cache
def _outside_forward() -> list[dict]:
    return run_ranks(outside_forward_job, DP, deadline_s=120.0, collective_timeout_s=20)


def test_reads_outside_any_forward_wait_for_plain_and_users_own_parameter_classes():
    """A parameter class of the user's own waits as `nn.Parameter` does (before 2026-12-03 it was
    left unmarked: its read outside the forwards was one error in backward where it fed the loss,
    and silent where it did not: test_pending_params.py)."""
    for r in _outside_forward():
        off = r["inside"]
        for on in (r["overlap"], r["compiled"], r["own class"]):
            assert on["losses"] == off["losses"] and not any(x["error"] for x in on["losses"]), r
            assert compare(on["params"], off["params"])["bit_identical"]


def test_a_read_before_its_gather_landed_on_one_rank_alone_is_one_error_on_every_rank_nothing_updated():
    """Rank 1's model alone holds a parameter class that takes no subclass (left unmarked), read before the last step's
    gather landed: rank 1 records it as the gradient arrives (`check_read`, inside backward) and
    issues the same collectives as rank 0; step()'s check fails on both, rank 1 naming the read and
    rank 0 naming rank 1 and its error, nothing updated. Before: rank 1 raised inside backward, alone, and rank 0
    waited in the step's collectives."""
    peer, mistaken = (r["final class on rank 1"] for r in _outside_forward())
    off = _outside_forward()[0]["inside"]
    assert "was read before the last step's all-gather" in mistaken["losses"][-1]["message"], mistaken["losses"]
    said = mistaken["losses"][-1]["message"]
    assert peer["losses"][-1]["message"] == f"rank(s) [1] found a broken step: {said}", peer["losses"]
    assert len(peer["losses"]) == len(mistaken["losses"]) == 2
    for out in (peer, mistaken):
        assert compare(out["params"], off["after"][0])["bit_identical"]


@pytest.fixture(scope="module")
def trained() -> list[dict]:
    return run_ranks(training_job, DP, deadline_s=240.0)


def test_overlapped_gathers_train_bit_for_bit_as_gathers_inside_the_step(trained):
    for r in trained:
        on, off = r[True], r[False]
        assert on["overlap"] and not off["overlap"]
        assert on["in flight after step"] and not off["in flight after step"]
        assert on["losses"] == off["losses"] and on["eval"] == off["eval"]
        assert compare(on["params"], off["params"])["bit_identical"]
    assert compare(trained[0][True]["params"], trained[1][True]["params"])["bit_identical"]


def test_no_overlap_where_nothing_is_gathered_or_no_module_could_wait(trained):
    for r in trained:
        assert r["sc"] is False and r["bare"] is False


@pytest.mark.parametrize("how", ["model.state_dict", "model.load_state_dict", "opt.state_dict", "wait_params",
                                 "forward", "compiled forward"])
def test_every_documented_read_waits_for_the_gathers(how, trained):
    rank0, rank1 = run_ranks(reading_job, DP, how, deadline_s=240.0)
    want = trained[0][False]["params"]  # the same three steps, gathered inside the step
    assert not rank0["in flight"] and not rank1["in flight"]
    if how == "model.load_state_dict":
        assert rank0["loaded kept"] and rank1["loaded kept"]  # not overwritten by a late gather
        return
    for r in (rank0, rank1):
        assert compare(r["final"], want)["bit_identical"]
    if how == "model.state_dict":
        assert compare(rank0["seen"], want)["bit_identical"]
    if how == "compiled forward":  # traced before the optimizer's hooks existed, and still waits
        for r in (rank0, rank1):
            assert torch.equal(r["seen"]["logits"], r["seen"]["eager logits"])
