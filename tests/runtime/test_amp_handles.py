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
