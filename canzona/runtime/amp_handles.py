"""What torch.amp.GradScaler was handed in canzona's optimizer's place: the optimizer itself, or a
wrapper of it (accelerate's `AcceleratedOptimizer`, a Lightning-style `LightningOptimizer`, a
user's own proxy), which must behave as the optimizer itself (docs/design.md §8.3).

GradScaler keys its per-optimizer state, its unscale and the scale `step` hands over on the object
it was given: its `_unscale_grads_(optimizer, ...)` hands the op only the gradients, and its
`step(optimizer)` sets `optimizer.grad_scale` on that object. So canzona reads the object from
GradScaler's own frame and recognises a wrapper of its optimizer generically, not by class name:
a chain of `.optimizer` / `._optimizer` attributes reaching it, or `param_groups` that are its
very list (what a forwarding proxy returns; an optimizer of its own, torch's over the same
parameters, has its own list).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from canzona.errors import CanzonaError

_WRAPPED = ("optimizer", "_optimizer")  # what wrappers name the object they wrap
_DEPTH = 8  # a chain longer than this is no wrapper stack met in practice (and a cycle ends)


def handles(obj: Any, optimizer: Any) -> bool:
    """Whether `obj` is `optimizer` or a wrapper of it."""
    if obj is optimizer:
        return True
    if getattr(obj, "param_groups", None) is optimizer.param_groups:  # a forwarding proxy
        return True
    seen = obj
    for _ in range(_DEPTH):
        seen = next((w for w in (_attribute(seen, a) for a in _WRAPPED) if w is not None), None)
        if seen is None:
            return False
        if seen is optimizer:
            return True
    return False


def holds(obj: Any, optimizers: Any) -> bool:
    """Whether `obj` keeps one of `optimizers` in an attribute of its own, whatever its name, or in
    a list, tuple or dict there (a wrapper of several): a wrapper of it, resolvable or not (a torch
    optimizer stepping its own gradients keeps none)."""
    kept = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
    kept += [v for value in kept if isinstance(value, (list, tuple, dict))
             for v in (value.values() if isinstance(value, dict) else value)]
    return any(value is opt for value in kept for opt in optimizers)


def _attribute(obj: Any, name: str) -> Any:
    # an attribute that fails to read (a property raising) is no wrapped optimizer
    try:
        return getattr(obj, name, None)
    except Exception:  # noqa: BLE001 - any failure means: not a wrapper through this name
        return None


def _scaler_frame(method: str) -> tuple[torch.amp.GradScaler, Any] | None:
    """The GradScaler whose `method` this call runs under (the nearest), with that method's
    `optimizer` argument; None where it runs under none."""
    frame = sys._getframe(1)
    while frame is not None:
        scaler = frame.f_locals.get("self") if frame.f_code.co_name == method else None
        if isinstance(scaler, torch.amp.GradScaler):
            return scaler, frame.f_locals.get("optimizer")
        frame = frame.f_back
    return None


def scaler_argument(method: str) -> Any:
    """The `optimizer` argument of the GradScaler `method` ("_unscale_grads_", "step") this call
    runs under (the nearest), or None where it runs under none."""
    found = _scaler_frame(method)
    return None if found is None else found[1]


def scaler_stepping() -> tuple[torch.amp.GradScaler, Any] | None:
    """The GradScaler whose `step` this call runs under (the nearest), with the object it was handed
    to step; None where it runs under none."""
    return _scaler_frame("step")


def inverse_of(scale: Any) -> float:
    """The inverse of a GradScaler scale as GradScaler computes it (the reciprocal in double, then
    float32), so that the product is its `unscale_`'s."""
    return float(torch.as_tensor(scale).double().reciprocal().float())


def inf_check_inverse() -> float | None:
    """Under `GradScaler.step`'s inf check (`_check_inf_per_device`, which runs the unscale op at a
    dummy inverse scale of 1): the inverse of the scale that step then hands the optimizer (its
    `_scale`, as `grad_scale`); None under no inf check."""
    found = _scaler_frame("_check_inf_per_device")
    scale = None if found is None else found[0]._scale
    return None if scale is None else inverse_of(scale)


def handed_scale(optimizer: Any) -> Any:
    """The scale `GradScaler.step` handed `optimizer` for this `step()` call (None where none was):
    set on the optimizer, or on the wrapper of it GradScaler was given (a wrapper forwarding
    `_step_supports_amp_scaling` takes the fused path, and GradScaler sets `grad_scale` on the
    wrapper, where the optimizer never saw it: it stepped the scaled gradients)."""
    scale = getattr(optimizer, "grad_scale", None)
    if scale is not None:
        return scale
    given = scaler_argument("step")
    if given is None or given is optimizer:
        return None
    scale = vars(given).get("grad_scale") if hasattr(given, "__dict__") else None
    if scale is not None and not handles(given, optimizer):
        raise CanzonaError(f"GradScaler.step handed its scale to a wrapper ({type(given).__name__}) canzona cannot "
                           "tell wraps this optimizer: its gradients would be stepped scaled. Pass the optimizer "
                           "itself to scaler.step, or expose it as the wrapper's .optimizer")
    return scale
