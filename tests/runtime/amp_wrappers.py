"""Wrappers of an optimizer that users hand torch.amp.GradScaler in its place (canzona's must
behave as the optimizer itself: `canzona.runtime.amp_handles`)."""

from __future__ import annotations

from typing import Any

import torch


class Forwarding:
    """Lightning-style (`LightningOptimizer`): the optimizer as `._optimizer`, every other attribute
    forwarded, `_step_supports_amp_scaling` too (GradScaler.step then sets `grad_scale` on the wrapper)."""

    def __init__(self, optimizer: Any) -> None:
        self._optimizer = optimizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)

    def step(self, closure: Any = None) -> Any:
        return self._optimizer.step(closure)


class Proxy:
    """A user's own thin proxy under a name canzona does not know: `param_groups`, `step` and
    `zero_grad` forwarded, nothing else (GradScaler takes its unscale-then-step path)."""

    def __init__(self, optimizer: Any) -> None:
        self.inner = optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def step(self, closure: Any = None) -> Any:
        return self.inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)


class Opaque(Proxy):
    """A proxy canzona cannot resolve: the optimizer under a name of its own, `param_groups` a list
    of its own (the same groups)."""

    @property
    def param_groups(self) -> list[dict]:
        return list(self.inner.param_groups)


class TorchOpaque(torch.optim.Optimizer):
    """A torch optimizer subclass wrapping the optimizer under a name canzona does not follow,
    `param_groups` a list of its own (torch.optim.Optimizer.__init__ not called: it would take the
    groups over)."""

    def __init__(self, optimizer: Any) -> None:
        self.inner = optimizer
        self.defaults, self.state = optimizer.defaults, optimizer.state
        self.param_groups = list(optimizer.param_groups)

    def step(self, closure: Any = None) -> Any:
        return self.inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)


WRAPPERS = {"forwarding": Forwarding, "proxy": Proxy, "opaque": Opaque, "torch-opaque": TorchOpaque}
