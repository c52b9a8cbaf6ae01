"""Many micro-batches: the iteration extrapolated from two shorter ones (docs/design.md §9.3).

Every micro-batch of an iteration is the same work, so once the pipeline's warm-up is over each
further group of micro-batches adds the same time: the simulated times are affine in the
micro-batches per DP rank. Above `EXACT_MICRO_BATCHES` the simulator runs the iteration at two
shorter lengths `m1 < m2` (both past the warm-up, multiples of PP as the interleaved schedule
needs) and extends their difference to the `m` asked for, instead of running `m` micro-batches
one by one (the engine's time and memory grow linearly with them: Qwen3-235B-A22B at PP 8 x VP 4,
512 micro-batches, 58 s and 1.5 GB; from 32 and 64, 10 s).

Measured error (2026-11-28, against the exact simulation): that layout's iteration time from 32
and 64 micro-batches is within 3e-5 of the simulated one at 128, 256 and 512 (FP8 weight casts,
priced per micro-batch as 1/m of a cast, differ slightly between the lengths; the rest is the
steady state's own small drift). `tests/sim/test_steady.py` checks the bound on small layouts.

Not extrapolated (the exact run instead): an explicit plan, the runtime's collectives (their
records name every collective issued) and lengths whose short runs would not be shorter.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sim.simulate import SimConfig, SimResult

# micro-batches per DP rank simulated one by one; above, the iteration is extrapolated
EXACT_MICRO_BATCHES = 256
# the shorter runs: at least this many micro-batches and 4 x PP (past any warm-up: Megatron's
# interleaved warm-up is under 2 x PP micro-batches), a multiple of PP
SHORT_MICRO_BATCHES = 32


def short_lengths(m: int, pp: int) -> tuple[int, int] | None:
    """The two shorter lengths `m` is extrapolated from, or None when it is simulated exactly."""
    if m <= EXACT_MICRO_BATCHES:
        return None
    m1 = pp * math.ceil(max(SHORT_MICRO_BATCHES, 4 * pp) / pp)
    m2 = 2 * m1
    return (m1, m2) if m2 < m else None


def with_micro_batches(cfg: SimConfig, m: int, batch_dp: int) -> SimConfig:
    """`cfg` with `m` micro-batches per DP rank (the global batch that gives them)."""
    wl = cfg.workload
    return replace(cfg, workload=replace(wl, global_batch=m * batch_dp * wl.micro_batch))


def extrapolate(cfg: SimConfig, short: SimResult, long: SimResult, lengths: tuple[int, int], m: int) -> SimResult:
    """The result at `m` micro-batches from the runs at `lengths` (`short`, `long`): every time and
    breakdown extended along their difference, the MFU for `m`'s FLOPs over that time; the memory,
    plans and spans are the longer run's (its spans are what was simulated: `extrapolated_from`
    says so)."""
    m1, m2 = lengths
    k = (m - m2) / (m2 - m1)

    def ext(a: float, b: float) -> float:
        return b + k * (b - a)

    t_end = ext(short.iteration_time_s, long.iteration_time_s)
    t_sync = ext(short.grad_sync_end_s, long.grad_sync_end_s)
    return replace(
        long, config=cfg,
        iteration_time_s=t_end, grad_sync_end_s=t_sync, optimizer_step_s=t_end - t_sync,
        forward_backward_s=ext(short.forward_backward_s, long.forward_backward_s),
        param_gather_exposed_s=ext(short.param_gather_exposed_s, long.param_gather_exposed_s),
        breakdown={key: ext(short.breakdown[key], v) for key, v in long.breakdown.items()},
        optimizer_breakdown={key: ext(short.optimizer_breakdown[key], v) for key, v in long.optimizer_breakdown.items()},
        mfu=long.mfu * (m / m2) * (long.iteration_time_s / t_end),
        extrapolated_from=lengths)


def same_choice(a: SimResult, b: SimResult) -> bool:
    """The two runs chose the same plans (a policy's fallback, the expert plan): else their
    difference is not one iteration's growth and the exact run is needed."""
    return a.fell_back_to == b.fell_back_to and a.expert_choice == b.expert_choice and \
        a.plan.hash() == b.plan.hash()
