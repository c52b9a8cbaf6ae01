"""What every layout's optimizer (`DistributedOptimizer`'s ZeRO-1 path, `canzona.runtime.fsdp`'s
FSDP step) checks of its options alike, written once."""

from __future__ import annotations

from typing import Any

from canzona.errors import SpecError
from canzona.fileio import is_finite_number
from canzona.optimizers import resolve_config
from canzona.runtime.gradients import NONFINITE_POLICIES


def optimizer_config(name: str, given: Any) -> Any:
    """Optimizer `name`'s config from what the user gave: None (the defaults), a mapping of fields,
    or a config object (validated): `canzona.optimizers.resolve_config`, which the planner and the
    simulator read `matrix_config` with too."""
    return resolve_config(name, given)


def check_step_options(*, timeout_s: Any, max_grad_norm: Any, nonfinite: Any, **flags: Any) -> None:
    """The options every layout's optimizer takes, checked alike (one SpecError line); `flags`:
    options that are True or False."""
    if not (is_finite_number(timeout_s) and timeout_s > 0):
        raise SpecError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if max_grad_norm is not None and not (is_finite_number(max_grad_norm) and max_grad_norm > 0):
        raise SpecError(f"max_grad_norm must be a positive number (or None: no clipping), got {max_grad_norm!r}")
    if nonfinite not in NONFINITE_POLICIES:
        raise SpecError(f"nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, got {nonfinite!r}")
    for option, value in flags.items():
        if not isinstance(value, bool):
            raise SpecError(f"{option} must be True or False, got {value!r}")
