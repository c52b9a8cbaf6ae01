"""The options an optimizer's step does not read, refused alike by the runtime and the simulator
(no spawned ranks): `DistributedOptimizer` refuses each at construction, before it reads a
parameter, wherever `canzona simulate` refuses it, through the one check both make
(`canzona.step_options.check_elementwise_options`): an elementwise optimizer's (AdamW's) plan
settings, and `batch_kernels=False` with an optimizer that has no batched kernel (AdamW, NorMuon).
and `compile_kernels=True` with one that has no compiled form (every one but Muon). Before: the
runtime accepted each and ignored it (and both sides accepted compile_kernels=True with SOAP,
Shampoo, NorMuon and AdamW, compiling nothing)."""

from __future__ import annotations

import pytest

from canzona.errors import SpecError
from canzona.optimizers import OPTIMIZERS
from canzona.runtime.optimizer import DistributedOptimizer
from canzona.step_options import ELEMENTWISE_IGNORED
from canzona.tp import Capacity
from sim.options import RunOptions
from sim.simulate import SimConfig
from sim.workload import Workload
from tests.sim.small_models import EIGHT_LAYERS

# a value off the default of each
OFF = {"alpha": 0.5, "geometry": "whole", "tp_policy": "tp-chunk", "tp_mode": "serial", "capacity": Capacity(0.02),
       "batch_kernels": False, "compile_kernels": True}
STEP_OPTIONS = ("batch_kernels", "compile_kernels")  # RunOptions' fields, the others SimConfig's
REFUSED = {("adamw", name) for name in OFF} | {("normuon", "batch_kernels")} | \
    {(o, "compile_kernels") for o in OPTIMIZERS if o != "muon"}


def test_every_ignored_option_has_a_value_here():
    assert {name for name, _ in ELEMENTWISE_IGNORED} | set(STEP_OPTIONS) == set(OFF)


def _runtime_refuses(optimizer: str, name: str) -> bool:
    try:
        DistributedOptimizer([], None, optimizer, **{name: OFF[name]})
    except SpecError as e:
        if str(e).startswith(f"{name}="):  # its own error, not the missing parameters' after it
            assert f"changes nothing with optimizer '{optimizer}'" in str(e) or \
                f"change nothing with optimizer '{optimizer}'" in str(e), str(e)
            return True
    except Exception:  # noqa: BLE001 - accepted: the constructor went on to the (missing) parameters
        pass
    return False


def _simulator_refuses(optimizer: str, name: str) -> bool:
    options = {name: OFF[name]} if name in STEP_OPTIONS else {}
    config = SimConfig(model=EIGHT_LAYERS, gpus=4, tp=2, optimizer=optimizer, workload=Workload(512, 4, 1),
                       options=RunOptions(**options), **({} if options else {name: OFF[name]}))
    try:
        config.check()
    except SpecError as e:
        assert name.replace("_", "-") in str(e) and f"nothing with --optimizer {optimizer}" in str(e), str(e)
        return True
    return False


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_the_runtime_refuses_what_the_simulator_refuses(optimizer):
    for name in OFF:
        refused = (optimizer, name) in REFUSED
        assert _simulator_refuses(optimizer, name) == refused, (optimizer, name)
        assert _runtime_refuses(optimizer, name) == refused, (optimizer, name)


@pytest.mark.parametrize("name", STEP_OPTIONS)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_fsdp_refuses_kernel_options_where_the_simulator_does(optimizer, name):
    """Under FSDP2 the plan settings above are ZeRO-1's options or owner plan settings, refused
    by their own checks (tests/runtime/test_fsdp_zero1_options.py); batch_kernels=False and
    compile_kernels=True are the step's, refused without a batched / compiled kernel as `canzona
    simulate --fsdp` refuses them."""
    import inspect

    from canzona.runtime.fsdp import FsdpOptimizer

    refused = (optimizer, name) in REFUSED
    defaults = {k: p.default for k, p in inspect.signature(DistributedOptimizer).parameters.items()}
    with pytest.raises(Exception) as failed:  # accepted, it goes on to the (missing) parameters
        FsdpOptimizer({**defaults, "params": [], "spec": None, "optimizer": optimizer, name: OFF[name]},
                      defaults)
    assert str(failed.value).startswith(f"{name}={OFF[name]!r} changes nothing") == refused, str(failed.value)
    assert not refused or failed.type is SpecError
    config = SimConfig(model=EIGHT_LAYERS, gpus=4, tp=1, fsdp=True, optimizer=optimizer,
                       policy="zero1" if optimizer == "adamw" else None, workload=Workload(512, 4, 1),
                       options=RunOptions(**{name: OFF[name]}))
    if refused:
        flag = "--no-batch-kernels" if name == "batch_kernels" else "--compile-kernels"
        with pytest.raises(SpecError, match=f"^{flag} changes nothing with --optimizer {optimizer}"):
            config.check()
    else:
        config.check()


def test_canzona_verify_runs_adamw_at_tp_2_with_the_settings_the_runtime_takes():
    """`canzona verify --optimizer adamw --tp 2` handed its ranks zero1's own TP scheduler (tp-sync)
    as tp_policy, which the runtime now refuses (it changes nothing there): the TP choices collapse
    to their defaults under an elementwise optimizer, as at TP 1 (`canzona.harness.verify.prepare`),
    and every case passes the runtime's check."""
    from canzona.harness.verify import prepare
    from canzona.step_options import check_elementwise_options

    cases = prepare(2, "adamw", tp=2, tp_policy="all", tp_mode="all")
    assert len(cases) == 1 and cases[0].plan.tp_plan.policy == "tp-sync"  # what zero1 runs, as before
    # and `--optimizer all --alpha 0.5`: the matrix optimizers' cases at it, AdamW's at the default
    # (its ranks were handed alpha=0.5, which the runtime refuses there)
    every = prepare(2, "all", tp=2, alpha=0.5, tp_policy="all", tp_mode="all")
    assert {c.spec.alpha for c in every if c.spec.optimizer != "adamw"} == {0.5}
    for spec in [c.spec for c in (*cases, *every)]:
        given = dict(ELEMENTWISE_IGNORED)  # what the harness's ranks pass: the spec's fields, the defaults else
        given.update(alpha=spec.alpha, tp_policy=spec.tp_policy, tp_mode=spec.tp_mode, batch_kernels=spec.batch_kernels,
                     compile_kernels=spec.compile_kernels)
        check_elementwise_options(spec.optimizer, given)
