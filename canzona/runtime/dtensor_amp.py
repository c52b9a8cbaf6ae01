"""torch.amp.GradScaler's unscale of DTensor gradients (FSDP2's; a DTensor TP model's guards),
handed to the optimizer that steps them (docs/design.md §2.8, §8.3).

GradScaler unscales with one foreach op over the `.grad` of every parameter of the optimizer,
`aten._amp_foreach_non_finite_check_and_unscale_` (its `unscale_`, and the inf check `step` makes
first with an inverse scale of 1). FSDP2's gradients are DTensors, and DTensor runs that op through a
handler of its own (`DTensor._op_dispatcher._custom_op_handlers`, torch 2.13's
`found_inf_reduce_handler`): it unscales each rank's local pieces, then all-reduces `found_inf`
(a max) over the first gradient's mesh, outside canzona's step check: no timeout, a rank with no
gradient never joins it, and the unscale cannot tell a clip that came before it. `FsdpOptimizer`
owns the step's global norm and its check, so the op on its gradients is its own: `install` puts a
handler in DTensor's table (the mechanism torch's `loss_parallel` uses) that gives the op to the
optimizer GradScaler is unscaling (`FsdpOptimizer._amp_unscale`: the step check, then the unscale,
`found_inf` from the global norm), and leaves every other DTensor's op to torch's handler.

A TP model of DTensors on the ZeRO-1 path (`parallelize_module`) gives the op one list of guards
(`grad_guard`: its replicated norms' `.grad`) and DTensors wrapping guards, which DTensor's dispatch
takes and refuses ('got mixed torch.Tensor and DTensor'): `DistributedOptimizer` over DTensor
parameters installs itself too, so the op reaches its `_amp_unscale` whichever tensor dispatches it
(§8.3).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import Tensor

from canzona.errors import CanzonaError
from canzona.runtime import amp_handles
from canzona.runtime.grad_guard import AMP_BESIDE_OTHERS

_UNSCALE = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default
_ARGUMENTS = ("self", "found_inf", "inv_scale")  # its schema's, in order


class AmpOwner(Protocol):
    """What the handler asks of an optimizer (`FsdpOptimizer` and `DistributedOptimizer` implement it)."""

    params: Mapping[str, Tensor]  # its parameters by name, whose `.grad` it steps

    def _amp_unscale(self, found_inf: Tensor, inv_scale: Tensor) -> None:
        """Unscale its gradients by `inv_scale`; set `found_inf` to 1 where any is not finite, alike
        on every rank."""


# the optimizers whose gradients' unscale is theirs, oldest first (a dropped one leaves by itself)
_OWNERS: list[weakref.ref] = []
# torch's handler, kept where `install` found it: every other DTensor's unscale runs it
_TORCH: list[Callable[..., Any]] = []


def install(owner: AmpOwner) -> None:
    """Route GradScaler's unscale of `owner`'s gradients to it (the handler goes in once)."""
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    if handlers.get(_UNSCALE) is not _handler:
        _TORCH[:] = [handlers[_UNSCALE]] if _UNSCALE in handlers else []
        handlers[_UNSCALE] = _handler
    _OWNERS[:] = [ref for ref in _OWNERS if ref() is not None] + [weakref.ref(owner)]


def _handler(op: Any, args: tuple, kwargs: dict) -> Any:
    bound = {**dict(zip(_ARGUMENTS, args)), **kwargs}
    named = {id(g) for g in bound["self"]}
    owners = [owner for owner in (ref() for ref in reversed(_OWNERS)) if owner is not None]
    unscaled = _unscaled_optimizer()
    if unscaled is not None:
        # GradScaler says whose gradients these are: that optimizer's unscale, not that of another
        # over the same gradients (a second one built over the model, never stepped, took them, and
        # answered with its own stale check); a torch optimizer's is torch's
        # (or a wrapper of it: accelerate's AcceleratedOptimizer, a Lightning-style or user's proxy,
        # which is that optimizer: before, torch's handler took its gradients)
        handled = [owner for owner in owners if amp_handles.handles(unscaled, owner)]
        # a torch optimizer's own gradients are torch's; a torch.optim.Optimizer subclass holding
        # canzona's optimizer under a name canzona does not follow is an opaque wrapper all the same
        torch_own = isinstance(unscaled, torch.optim.Optimizer) and not amp_handles.holds(unscaled, owners)
        if not handled and not torch_own:
            _refuse_opaque(unscaled, named, owners)
        owners = handled
    # else the newest first: an optimizer built again over the same model (a resume) while the old
    # one is still referenced steps those gradients now
    for owner in owners:
        mine = {id(p.grad) for p in owner.params.values() if p.grad is not None}  # as they are now
        if named <= mine:
            owner._amp_unscale(bound["found_inf"], bound["inv_scale"])
            return None
        if named & mine:  # GradScaler unscales one optimizer's gradients per call
            raise CanzonaError(AMP_BESIDE_OTHERS)
    if not _TORCH:
        raise CanzonaError("this torch's DTensor has no unscale handler for canzona to leave other gradients to")
    return _TORCH[0](op, args, kwargs)


def _refuse_opaque(given: Any, named: set[int], owners: list[AmpOwner]) -> None:
    """GradScaler was handed `given`, no optimizer and no wrapper canzona can resolve (its wrapped
    optimizer under another name, its `param_groups` a list of its own): where it unscales a canzona
    optimizer's gradients, torch's handler would unscale them outside that optimizer's step check
    (a clip before it unseen, `found_inf` reduced over the first gradient's mesh only, or DTensor's
    'got mixed' error): one error instead, on every rank alike (no collective has run)."""
    for owner in owners:
        if named & {id(p.grad) for p in owner.params.values() if p.grad is not None}:
            raise CanzonaError(f"GradScaler was handed a wrapper ({type(given).__name__}) that unscales the gradients of "
                               "canzona's optimizer, but canzona cannot tell it wraps that optimizer: pass the optimizer "
                               "itself to the scaler, or expose it as the wrapper's .optimizer")


def _unscaled_optimizer() -> Any:
    """The optimizer GradScaler is unscaling (the `optimizer` argument of its `_unscale_grads_`, a
    caller of this op: GradScaler hands the op only the gradients; a wrapper of canzona's optimizer
    as given), or None where the op came from elsewhere."""
    return amp_handles.scaler_argument("_unscale_grads_")
