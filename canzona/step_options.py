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

from dataclasses import dataclass

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
