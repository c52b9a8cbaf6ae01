"""How much of a rank's communication the simulated schedule hides under compute, measured the
way NVIDIA measures it on a real run (docs/design.md §9.6).

Megatron-Bridge's MoE communication-overlap guidance judges the EP overlap from a rank's Nsight
Systems trace by interval unions, not summed kernel times: the union of the communication
kernels, the union of the GEMM / attention kernels, their intersection ("communication
concurrent with GEMM/attention"), the share of the communication union inside it ("communication
time hidden by compute") and the union of everything ("GPU-active interval union")
(NVIDIA-NeMo/Megatron-Bridge `skills/nemo-mbridge-perf-moe-comm-overlap/SKILL.md`, "HybridEP
production-shape validation", and its verification steps: "Compare communication and compute
interval unions and their intersection, not only summed kernel durations"). `overlap_report`
computes the same figures from the simulator's spans, so a simulated run can be put beside a
published trace; `python -m sim.overlap_report ROW [--no-overlap] [--rank R]` does it for a
published row (`canzona validate --published`'s rows), with or without Megatron's EP overlap.

Only the iteration's forward / backward / gradient-sync phase counts (the spans of phase "A"):
the optimizer step has no EP communication. A diagnostic: nothing here changes a simulated time.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace

from sim.engine import Span
from sim.simulate import _length, _overlap, _union
from sim.streams import EP_COMM

COMPUTE = "compute"


@dataclass(frozen=True, kw_only=True)
class OverlapReport:
    """One rank's interval unions, in seconds: its compute stream's, its `streams`' communication
    (the EP stream by default), their intersection and everything it ran."""

    rank: int
    streams: tuple[str, ...]
    compute_s: float
    comm_s: float
    concurrent_s: float  # communication concurrent with compute
    active_s: float  # the union of every span of the rank, any stream

    @property
    def hidden(self) -> float:
        """The share of the communication union inside compute (0 without communication)."""
        return self.concurrent_s / self.comm_s if self.comm_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "hidden": self.hidden}


def overlap_report(spans: Iterable[Span], rank: int, streams: Sequence[str] = (EP_COMM,)) -> OverlapReport:
    """`rank`'s interval unions over its phase-A `spans` (the module docstring); `streams`: the
    communication streams whose union is compared with the compute stream's."""
    mine = [s for s in spans if s.rank == rank and s.phase == "A"]
    compute = _union((s.start, s.end) for s in mine if s.stream == COMPUTE)
    comm = _union((s.start, s.end) for s in mine if s.stream in streams)
    active = _union((s.start, s.end) for s in mine)
    return OverlapReport(rank=rank, streams=tuple(streams), compute_s=_length(compute), comm_s=_length(comm),
                         concurrent_s=_overlap(compute, comm), active_s=_length(active))


def main(argv: Sequence[str] | None = None) -> dict:
    """A published row's report (the module docstring), printed as JSON and returned."""
    from sim.published import load, select  # the data layer only where the command runs
    from sim.simulate import simulate

    parser = argparse.ArgumentParser(prog="python -m sim.overlap_report")
    parser.add_argument("row", help="a published row id (or a term matching one row only)")
    parser.add_argument("--no-overlap", action="store_true",
                        help="simulate without Megatron's EP overlap (and delay_wgrad_compute, which needs it)")
    parser.add_argument("--rank", type=int, default=None, help="the rank to report (default: the first simulated)")
    args = parser.parse_args(argv)
    runs, _ = load()
    exact = [r for r in runs if r.id == args.row]
    matched = exact or select(runs, args.row)
    if len(matched) != 1:
        parser.error(f"{args.row!r} matches {len(matched)} published rows; name one")
    run = matched[0]
    cfg = run.sim_config()
    if args.no_overlap:
        cfg = replace(cfg, options=replace(cfg.options, overlap_moe_expert_parallel_comm=False,
                                           delay_wgrad_compute=False))
    result = simulate(cfg)
    rank = min(s.rank for s in result.spans) if args.rank is None else args.rank
    report = overlap_report(result.spans, rank)
    out = {"id": run.id, "overlap_moe_expert_parallel_comm": cfg.options.overlap_moe_expert_parallel_comm,
           "iteration_s": result.iteration_time_s, **report.to_dict()}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
