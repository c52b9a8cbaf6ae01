"""The harness's training spec under FSDP2 refuses the ZeRO-1 layout's TP scheduling options, which
its FSDP worker's optimizer (`FsdpOptimizer`) would refuse (`canzona.runtime.fsdp.ZERO1_ONLY`)."""

from __future__ import annotations

import pytest

from canzona.errors import SpecError
from canzona.harness.training import TrainSpec
from canzona.plan import PLAN_DEFAULTS
from canzona.step_options import STEP_DEFAULTS


@pytest.mark.parametrize("changes", [{"tp_policy": "tp-sync"}, {"tp_mode": "serial"}])
def test_fsdp_refuses_the_tp_schedule_options(changes):
    with pytest.raises(SpecError, match="under --fsdp they change nothing"):
        TrainSpec(fsdp=True, **changes).check(2)
    TrainSpec(**changes).check(2)  # the ZeRO-1 layout takes them


def test_fsdp_takes_their_defaults_named():
    TrainSpec(fsdp=True, tp_policy=PLAN_DEFAULTS.tp_policy, tp_mode=STEP_DEFAULTS.tp_mode).check(2)
