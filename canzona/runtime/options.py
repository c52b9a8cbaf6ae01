"""What every layout's optimizer (`DistributedOptimizer`'s ZeRO-1 path, `canzona.runtime.fsdp`'s
FSDP step) checks of its options alike, written once."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from canzona.cost import CostModel, cost_model_for
from canzona.errors import SpecError
from canzona.fileio import is_finite_number
from canzona.hardware import DEFAULT_PROFILE, profile_for_device
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


def gpu_name(device: torch.device) -> str | None:
    """The name CUDA gives `device`, None for a device that is not a GPU: the one place the runtime
    asks it (tests stand a GPU in here)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


_WARNED: set[str] = set()  # the GPUs warned of in this process (once each)

# the agreement fact of the profile a plan was priced on, and what to do where ranks disagree on it
# (cost_model=None on GPUs of different profiles: each plans on its own)
COST_MODEL_FACT = "plan's cost model"
COST_MODEL_ADVICE = {COST_MODEL_FACT: "on GPUs of different kinds give every rank the same cost_model "
                                      "(canzona.cost.cost_model_for(...)) or the same plan (canzona plan --hardware ...)"}


def planning_cost_model(cost_model: CostModel | None, device: torch.device) -> CostModel | None:
    """What an optimizer given `cost_model` plans its owners with, its parameters on `device`: the
    given model; None (the default profile's, `canzona.cost.default_rate`) off a GPU; on a GPU the
    shipped profile of that GPU (`canzona.hardware.profile_for_device`), so that the runtime runs
    the plan `canzona plan / simulate --hardware` make for it. A GPU no profile is keeps the
    default profile's, with one warning a process saying so."""
    name = gpu_name(device) if cost_model is None else None
    if name is None:
        return cost_model
    profile = profile_for_device(name)
    if profile is not None:
        return cost_model_for(profile)
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(f"no hardware profile is the GPU {name!r}: canzona plans the owners with the "
                      f"{DEFAULT_PROFILE} profile's costs; give cost_model=canzona.cost.cost_model_for(...) "
                      "(a profile's name or a `canzona calibrate` profile's path, as --hardware takes) or a plan "
                      "from `canzona plan --hardware ...`", stacklevel=4)
    return None
