"""The step's parameter all-gathers under the next forward (`overlap_param_gather`, issue 18 #1):
`step()` returns with them in flight, and every documented path that reads the parameters waits
for them first: a module's forward (eval under `no_grad` too), `model.state_dict()`,
`model.load_state_dict()`, the optimizer's own methods and `opt.wait_params()`; a forward of a
`torch.compile`d model traced before the optimizer existed too. Training is bit for bit the
training with the gathers inside the step.

A gather that is still in flight on rank 0 is made certain: rank 1 sleeps before its step, so
rank 1's segments cannot reach rank 0 until it wakes; whatever rank 0 reads meanwhile without
waiting would be last step's values (and a load would be overwritten when they land).
"""

from __future__ import annotations

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


def _train(model, opt, batches, late_rank: int | None = None) -> list[float]:
    losses = []
    for k, tokens in enumerate(batches):
        opt.zero_grad()
        loss = model.loss(tokens)
        loss.backward()
        losses.append(float(loss))
        if late_rank == opt.rank and k == len(batches) - 1:
            time.sleep(LATE_S)
        opt.step()
    return losses


def training_job(rank: int, world: int) -> dict:
    """The same training with the gathers overlapped and inside the step; then an eval forward."""
    out = {}
    for overlap in (True, False):
        model = build_model(SPEC)
        opt = _optimizer(model, overlap_param_gather=overlap)
        losses = _train(model, opt, _batches(rank, world))
        in_flight = opt._in_flight is not None and opt._in_flight.in_flight
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


class ReadsOutsideForward(torch.nn.Module):
    """Its loss reads its own parameters in a method of its own, never through forward."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(0.3 * torch.randn(32, 16, generator=g))
        self.w = torch.nn.Parameter(0.3 * torch.randn(16, 16, generator=g))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        return (self.embed[tokens] @ self.w.T).square().mean()

    @staticmethod
    def spec() -> ModelSpec:
        return ModelSpec("reads-outside-forward", (ParamSpec("embed", (32, 16), Role.EMBEDDING, dtype="fp32"),
                                                   ParamSpec("w", (16, 16), Role.MATRIX, dtype="fp32")))


def outside_forward_job(rank: int, world: int) -> dict:
    from canzona.runtime import DistributedOptimizer

    model = ReadsOutsideForward()
    opt = DistributedOptimizer(list(model.named_parameters()), model.spec())
    tokens = torch.arange(8).reshape(2, 4) + 4 * rank
    model.loss(tokens).backward()
    opt.step()
    opt.zero_grad()
    return outcome(lambda: model.loss(tokens).backward())  # read before the gathers landed


def test_a_read_outside_any_forward_is_one_error_in_the_next_backward():
    for r in run_ranks(outside_forward_job, DP, deadline_s=120.0):
        assert r["error"] == "CanzonaError", r
        assert "was read before the last step's all-gather" in r["message"] and "wait_params" in r["message"]


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
