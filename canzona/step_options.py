"""What the runtime does in a step, with each option's default defined once (issue 19, part 2).

`DistributedOptimizer`'s keyword arguments of these names, the simulator's `RunOptions` /
`SimConfig` / `Workload`, the memory model's `MemorySetup`, the harness's `TrainSpec` and the CLI's flags take
their defaults from `STEP_DEFAULTS`, so that "simulate, then deploy what you simulated" holds by
construction: an option that changes what the runtime does has the same name and default wherever
it appears (`tests/policy/test_registries.py` checks every consumer). The one deliberate exception is
`TrainSpec.reduce_scatter`, the verification harness's `exact` (bit for bit at any DP size).
Planning settings (DP and TP policies, alpha, buckets, capacity) are `canzona.plan.PlanSettings`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from canzona.errors import SpecError
from canzona.optimizers import matrix_optimizer
from canzona.plan import DEFAULT_GEOMETRY, PLAN_DEFAULTS
from canzona.reductions import DEFAULT_REDUCE_SCATTER
from canzona.step_schedule import PIPELINED


@dataclass(frozen=True, kw_only=True)
class StepOptions:
    tp_mode: str = PIPELINED  # order of the TP micro-groups' operations: pipelined or serial
    reduce_scatter: str = DEFAULT_REDUCE_SCATTER  # the gradient reduce-scatter (canzona.reductions)
    overlap_param_gather: bool = True  # the step's parameter all-gathers run under the next forward
    overlap_step: bool = False  # updates computed as their buckets land, applied after the check
    batch_kernels: bool = True  # same-shape matrices of a host as one batched kernel
    compile_kernels: bool = False  # Newton-Schulz through torch.compile
    max_grad_norm: float | None = None  # clip inside the step (None: measure the norm only)
    # bf16 / fp16 parameters: fp32 masters of what a rank updates, gradients reduced and the state that
    # follows the update kept in fp32 (False: all of it in the parameters' dtype); the memory model's
    # `MemorySetup` and the simulator's `Workload` count what it keeps
    master_weights: bool = True


STEP_DEFAULTS = StepOptions()


# canzona's plan settings and step options that an elementwise optimizer's (AdamW's) step does not
# read: its one step policy (zero1) plans with its own DP and TP policies and computes no whole
# matrix. Field and default; off its default, each is refused on a run of one
# (`check_elementwise_options`), by the simulator and the runtime alike
ELEMENTWISE_IGNORED: tuple[tuple[str, Any], ...] = (
    ("alpha", PLAN_DEFAULTS.alpha), ("geometry", DEFAULT_GEOMETRY), ("tp_policy", PLAN_DEFAULTS.tp_policy),
    ("tp_mode", STEP_DEFAULTS.tp_mode), ("capacity", PLAN_DEFAULTS.capacity))


def spelt(name: str, value: Any, flags: bool) -> str:
    """An option as an error names it: the CLI's flag (`--tp-mode serial`, `--no-batch-kernels`;
    `flags`, the simulator's errors) or the keyword argument (`tp_mode='serial'`, the runtime's)."""
    if not flags:
        return f"{name}={value!r}"
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    return flag if name == "capacity" else f"{flag} {value}"


def check_batch_kernels(optimizer: str, batch_kernels: bool, *, flags: bool = False) -> None:
    """`batch_kernels=False` with an optimizer that has no batched kernel (AdamW's elementwise
    step, any entry without `batched`: `canzona.optimizers.MatrixOptimizer.batchable`) would
    change nothing: one SpecError (`flags`: named as `canzona simulate / search` take it, else as
    the runtime does)."""
    if not batch_kernels and not matrix_optimizer(optimizer).batchable:
        named = f"--optimizer {optimizer}" if flags else f"optimizer {optimizer!r}"
        raise SpecError(f"{spelt('batch_kernels', False, flags)} changes nothing with {named}: it has no batched "
                        "kernel (batch_kernels stacks a whole-matrix optimizer's same-shape matrices)")


def check_compile_kernels(optimizer: str, compile_kernels: bool, *, flags: bool = False) -> None:
    """`compile_kernels=True` with an optimizer whose entry has no compiled form (every one but
    Muon: SOAP's and Shampoo's steps are GEMMs, eigh and QR, which inductor would call as they are;
    AdamW's is elementwise) would change nothing: one SpecError, as `check_batch_kernels`."""
    if compile_kernels and matrix_optimizer(optimizer).compiled is None:
        named = f"--optimizer {optimizer}" if flags else f"optimizer {optimizer!r}"
        raise SpecError(f"{spelt('compile_kernels', True, flags)} changes nothing with {named}: it has no compiled "
                        "kernel (compile_kernels runs Muon's Newton-Schulz iterations through torch.compile)")


def check_kernel_options(optimizer: str, batch_kernels: bool, compile_kernels: bool, *, flags: bool = False) -> None:
    """The kernel options `optimizer` has no use for, off their defaults (`check_batch_kernels`,
    `check_compile_kernels`): the check both layouts make, ZeRO-1's through
    `check_elementwise_options`, FSDP2's directly (its other options are `ZERO1_ONLY`'s and
    `check_owner_plan_settings`'s)."""
    check_batch_kernels(optimizer, batch_kernels, flags=flags)
    check_compile_kernels(optimizer, compile_kernels, flags=flags)


def check_elementwise_options(optimizer: str, given: Mapping[str, Any], *, flags: bool = False) -> None:
    """The options a run of `optimizer` does not read, off their defaults, as one SpecError: under
    an elementwise optimizer `ELEMENTWISE_IGNORED`'s (named at their defaults they are accepted),
    `batch_kernels=False` without a batched kernel and `compile_kernels=True` without a compiled one
    (`check_kernel_options`). `given`: the
    values by field name. The one check `canzona simulate` (`sim.simulate.SimConfig`) and
    `DistributedOptimizer` make; `flags`: name them as the CLI's flags."""
    if matrix_optimizer(optimizer).elementwise:
        changed = [spelt(name, given[name], flags) for name, default in ELEMENTWISE_IGNORED if given[name] != default]
        if changed:
            named = f"--optimizer {optimizer}" if flags else f"optimizer {optimizer!r}"
            raise SpecError(f"{', '.join(changed)}: canzona's plan settings change nothing with {named} "
                            "(elementwise: its step policy plans with its own DP and TP policies)")
    check_kernel_options(optimizer, given["batch_kernels"], given["compile_kernels"], flags=flags)


# `DistributedOptimizer`'s keyword arguments that are neither a step option above nor a planning
# setting (`canzona.plan.PlanSettings`) and have no simulator option, each with why: what the
# simulator prices (a finite step's time and memory) is the same whatever they are. Every other
# keyword argument is a `SimConfig` field (or `sim.simulate.simulate`'s) of the same name and default
# (tests/policy/test_registries.py fails on a new one that is neither).
RUNTIME_ONLY: dict[str, str] = {
    **dict.fromkeys(("params", "spec"), "the model: the simulator's --model builds both"),
    **dict.fromkeys(("group", "tp_group", "expert_mesh"),
                    "the process groups: the simulator's layout (--gpus, --tp, --ep, --etp, --hsdp-replicate)"),
    "timeout_s": "how long a rank waits for its peers before one error: a step that runs is no different",
    "nonfinite": "what a step whose gradient norm is not finite does (raise or skip): a finite step, the one "
                 "priced, runs the same check, collectives and update either way",
    "adamw_config": "AdamW's hyper-parameters change its numbers, not its work: the runtime runs it at fp32 "
                    "whatever is given (canzona.optimizers.check_config), as the simulator prices it",
}
