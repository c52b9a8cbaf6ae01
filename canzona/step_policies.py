"""The optimizer-step policies compared by the simulator and run by the runtime (DESIGN section 8).

One definition, shared: how each policy synchronises gradients, which DP and TP plans it uses, and
what it communicates around the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from canzona.errors import SpecError


@dataclass(frozen=True)
class StepPolicy:
    name: str
    grad_sync: str  # "all-reduce" or "reduce-scatter"
    replicated: bool  # every DP rank computes every matrix (sc)
    dp_policy: str | None  # None: the user's choice (canzona)
    tp_policy: str | None
    gather_split: bool  # zero1-gather: fetch the other ranks' parts of split matrices
    gather_params: bool  # all-gather updated parameters over DP after the step


STEP_POLICIES: dict[str, StepPolicy] = {
    "sc": StepPolicy("sc", "all-reduce", True, "whole-start", "tp-sync", False, False),
    "zero1-gather": StepPolicy("zero1-gather", "reduce-scatter", False, "zero1-even", "tp-sync", True, True),
    "layerwise": StepPolicy("layerwise", "all-reduce", False, "layerwise", "tp-sync", False, True),
    "canzona": StepPolicy("canzona", "reduce-scatter", False, None, None, False, True),
}


def get_step_policy(name: str) -> StepPolicy:
    try:
        return STEP_POLICIES[name]
    except KeyError:
        raise SpecError(f"unknown policy {name!r}; choose one of {', '.join(STEP_POLICIES)}") from None
