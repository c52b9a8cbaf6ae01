"""What a call in a spawned rank came to, as data the parent can assert on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from canzona.errors import CanzonaError


def outcome(fn: Callable[[], Any]) -> dict:
    """`fn()`'s value, or the type and message of what it raised (and whether it is canzona's)."""
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 - the test inspects the type and message
        return {"error": type(e).__name__, "canzona": isinstance(e, CanzonaError), "message": str(e)}
    return {"error": None, "value": value}


def weights(model: Any) -> dict:
    """A copy of the model's parameters, read as user code must read them after `step()`: through
    `model.state_dict()`, which waits for the step's parameter all-gathers (overlap_param_gather)."""
    model.state_dict()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def same(a: Any, b: Any, nan_equal: bool = False) -> bool:
    """Nested dicts, lists and tensors equal, tensors bit for bit (`nan_equal`: a NaN equal to a NaN,
    for weights or witnesses that were NaN before and are after)."""
    import torch

    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(same(a[k], b[k], nan_equal) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y, nan_equal) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape):
            return False
        return torch.equal(a, b) or (nan_equal and a.is_floating_point()
                                     and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))
    return a == b
