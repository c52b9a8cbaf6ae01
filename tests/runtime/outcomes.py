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
