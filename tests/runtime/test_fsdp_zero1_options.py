"""The ZeRO-1 layout's options under FSDP2, refused alike by the runtime and the simulator (no
spawned ranks): `FsdpOptimizer` refuses each of `canzona.runtime.fsdp.ZERO1_ONLY` off its default
at construction, before it reads a parameter, and `canzona simulate --fsdp` refuses the same
option (`sim.fsdp.check_fsdp`): set, it would change nothing. expert_buckets was accepted by the
runtime and ignored (the simulator refused it)."""

from __future__ import annotations

import inspect

import pytest

from canzona.errors import SpecError
from canzona.runtime.fsdp import ZERO1_ONLY, FsdpOptimizer
from canzona.runtime.optimizer import DistributedOptimizer
from canzona.tp import Capacity
from sim.options import RunOptions
from sim.simulate import SimConfig
from sim.workload import Workload
from tests.sim.small_models import EIGHT_LAYERS, MOE_FOUR_LAYERS

# a value off the default of each (the spawned FSDP test's, tests/runtime/test_fsdp_runtime.py)
OFF = {"reduce_scatter": "exact", "tp_policy": "tp-sync", "tp_mode": "serial", "capacity": Capacity(0.02),
       "overlap_param_gather": False, "geometry": "whole", "expert_buckets": "dp-multiple"}
RUN_OPTIONS = ("reduce_scatter", "overlap_param_gather")  # sim.options.RunOptions' fields, the rest SimConfig's


def test_every_zero1_only_option_has_a_value_here():
    assert set(ZERO1_ONLY) == set(OFF)


@pytest.mark.parametrize("name", sorted(OFF))
def test_the_runtime_and_the_simulator_refuse_it_under_fsdp(name):
    defaults = {k: p.default for k, p in inspect.signature(DistributedOptimizer).parameters.items()}
    with pytest.raises(SpecError, match=f"^{name}=.* under FSDP2 it changes nothing"):
        FsdpOptimizer({**defaults, "params": [], "spec": None, name: OFF[name]}, defaults)
    given = {name: OFF[name]}
    config = SimConfig(model=MOE_FOUR_LAYERS if name == "expert_buckets" else EIGHT_LAYERS, gpus=4, tp=1, fsdp=True,
                       optimizer="adamw" if name == "expert_buckets" else "muon", workload=Workload(512, 4, 1),
                       options=RunOptions(**{k: v for k, v in given.items() if k in RUN_OPTIONS}),
                       **{k: v for k, v in given.items() if k not in RUN_OPTIONS})
    with pytest.raises(SpecError, match=name.replace("_", "-")):
        config.check()
