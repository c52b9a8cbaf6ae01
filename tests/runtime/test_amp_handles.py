"""canzona.runtime.amp_handles: which objects GradScaler may be handed in an optimizer's place."""

from __future__ import annotations

import pytest
import torch

from canzona.errors import CanzonaError
from canzona.runtime.amp_handles import handles, holds
from canzona.runtime.grad_guard import handed_inverse_scale
from tests.runtime.amp_wrappers import Forwarding, Proxy, TorchOpaque


class _Attr:  # accelerate-style: `.optimizer`, param_groups a list of its own
    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer
        self.param_groups = list(optimizer.param_groups)


def _sgd() -> torch.optim.SGD:
    return torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)


def test_a_wrapper_chain_or_a_forwarding_proxy_is_the_optimizer_and_another_optimizer_is_not():
    opt = _sgd()
    assert handles(opt, opt)
    assert handles(_Attr(opt), opt) and handles(Forwarding(_Attr(opt)), opt) and handles(Proxy(opt), opt)
    # torch's own optimizer over the same parameters keeps its own state: not a handle of `opt`
    assert not handles(torch.optim.SGD(opt.param_groups[0]["params"], lr=0.1), opt)
    # `holds`: kept in any attribute (a wrapper canzona cannot resolve, e.g. amp_wrappers.TorchOpaque)
    assert holds(TorchOpaque(opt), [opt]) and not handles(TorchOpaque(opt), opt)
    assert not holds(torch.optim.SGD(opt.param_groups[0]["params"], lr=0.1), [opt])
    several = TorchOpaque(opt)
    several.inner = [_sgd(), opt]  # a wrapper of several optimizers (before: not seen to hold it)
    assert holds(several, [opt])
    looped = _Attr(opt)
    looped.optimizer = looped  # a cycle ends
    assert not handles(looped, opt) and not handles(object(), opt)


class _Stepping(torch.optim.SGD):  # reads the handed scale as canzona's step() does
    _step_supports_amp_scaling = True

    def step(self, closure=None):
        self.seen = handed_inverse_scale(self)


class _Hidden:  # forwards GradScaler's fused step under a name canzona cannot follow
    _step_supports_amp_scaling = True

    def __init__(self, optimizer) -> None:
        self.hidden = optimizer

    @property
    def param_groups(self) -> list[dict]:
        return list(self.hidden.param_groups)

    def step(self, closure=None):
        return self.hidden.step(closure)


@pytest.mark.parametrize("wrap", ["itself", "forwarding", "hidden"])
def test_a_scale_handed_to_a_wrapper_is_read_and_one_canzona_cannot_resolve_is_one_error(wrap):
    """GradScaler.step sets `grad_scale` on the object it was given: before, a wrapper forwarding
    `_step_supports_amp_scaling` kept it, and the optimizer stepped the scaled gradients."""
    param = torch.nn.Parameter(torch.ones(2))
    opt = _Stepping([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scaler.scale(param.sum()).backward()
    given = {"itself": opt, "forwarding": Forwarding(opt), "hidden": _Hidden(opt)}[wrap]
    if wrap == "hidden":
        with pytest.raises(CanzonaError, match=r"^GradScaler.step handed its scale to a wrapper \(_Hidden\) canzona cannot tell wraps "):
            scaler.step(given)
        return
    scaler.step(given)
    assert opt.seen == 2.0 ** -10  # before: None through the wrapper (the scaled gradients stepped)


@pytest.mark.parametrize("beside", ["canzona", "torch"])
def test_an_unscale_over_canzona_gradients_beside_others_is_one_error(one_rank, beside):
    """GradScaler handed one object over two optimizers' parameters (a user's combined wrapper, its
    `param_groups` both lists): one op over the gradients of canzona's optimizer and of another
    canzona optimizer (or torch's). Before: the first gradient's optimizer unscaled its own, the
    others stayed scaled (the second optimizer's clip saw 1024x its norm, its step the scaled
    gradients; an Inf among them raised at its step where GradScaler skips), silently."""
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters
    from canzona.spec import ModelSpec

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    first = DistributedOptimizer(named_parameters(model[0]), ModelSpec.from_module(model[0]))
    second = DistributedOptimizer(named_parameters(model[1]), ModelSpec.from_module(model[1])) if beside == "canzona" \
        else torch.optim.SGD(model[1].parameters(), lr=0.1)
    combined = _Attr(first)  # the first as `.optimizer`, both optimizers' groups in a list of its own
    combined.param_groups += second.param_groups
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    with pytest.raises(CanzonaError, match=r"^GradScaler's unscale met gradients of canzona's optimizer beside others") as e:
        scaler.unscale_(combined)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("wrap", "clip"), [("proxy", False), ("forwarding", True)])
def test_a_model_load_between_a_wrapped_unscale_and_the_step_unscales_once(one_rank, wrap, clip):
    """GradScaler's `unscale_` through a wrapper, then `model.load_state_dict` (every rank, the
    same weights: the step compares them), then `step`: the same weights as without the load.
    Review: the load's mark replaced the step check, which GradScaler's marks know by identity, so
    the step applied the handed inverse scale a second time, silently."""
    from canzona.runtime import DistributedOptimizer
    from tests.runtime.amp_wrappers import WRAPPERS
    from tests.runtime.test_fsdp_runtime import Small, small_batch, small_spec

    def run(load: bool) -> dict[str, torch.Tensor]:
        model = Small()
        opt = DistributedOptimizer(model.named_parameters(), small_spec(), "adamw", None)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        given = WRAPPERS[wrap](opt)
        for step in range(2):
            opt.zero_grad()
            scaler.scale(model(small_batch(step, 0))).backward()
            scaler.unscale_(given)
            if clip:
                opt.clip_grad_norm_(1e9)
            if load and step == 1:
                model.load_state_dict(model.state_dict())
            scaler.step(opt)
            scaler.update()
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    plain, loaded = run(False), run(True)
    assert all(torch.equal(plain[n], loaded[n]) for n in plain)
