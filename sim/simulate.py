"""`simulate()`: one iteration of a layout under a policy; `compare()`: every policy side by side.

Definitions (stated in every result): iteration time runs from the start of the first forward to
the parameters being ready for the next iteration; optimizer-step latency runs from the end of
gradient synchronisation to the parameters being updated and gathered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from canzona.cost import AnalyticCost, DeviceRate
from canzona.errors import SpecError
from canzona.fileio import dumps_json, write_text_atomic
from canzona.hardware import DEFAULT_PROFILE, load_profile
from canzona.models import resolve_model
from canzona.optimizers import check_matrix_optimizer
from canzona.plan import Plan, make_plan
from canzona.spec import ModelSpec
from canzona.step_policies import STEP_POLICIES
from canzona.step_schedule import PIPELINED, check_tp_mode
from canzona.tp import Capacity
from sim.engine import Engine, Span
from sim.iteration import Context, forward_backward, optimizer_step
from sim.topology import Cluster
from sim.workload import Workload

DEFINITIONS = {
    "iteration_time_s": "start of the first forward to parameters ready for the next iteration",
    "optimizer_step_s": "end of gradient synchronisation to parameters updated and gathered",
}


@dataclass(frozen=True)
class SimConfig:
    model: str = "qwen3-32b"  # catalog name, Hugging Face config.json or spec file (canzona.models)
    gpus: int = 256
    tp: int = 8
    optimizer: str = "muon"
    policy: str = "canzona"
    dp_policy: str = "alpha-balanced"
    tp_policy: str = "greedy-rollback"
    tp_mode: str = PIPELINED  # or "serial": the order of the micro-groups' operations
    alpha: float = 1.0
    bucket_size: int | None = None
    capacity: Capacity | None = None
    hardware: str = DEFAULT_PROFILE
    workload: Workload = field(default_factory=Workload)

    def check(self) -> Cluster:
        """Validate everything that can be wrong before any simulation; returns the cluster."""
        if self.policy not in STEP_POLICIES:
            raise SpecError(f"unknown policy {self.policy!r}; choose one of {', '.join(STEP_POLICIES)}")
        check_matrix_optimizer(self.optimizer)
        STEP_POLICIES[self.policy].check_dp_policy(self.dp_policy)
        check_tp_mode(self.tp_mode)
        cluster = Cluster(self.gpus, self.tp, load_profile(self.hardware).node.gpus)
        resolve_model(self.model, self.tp)
        self.workload.micro_batches(cluster.dp)
        return cluster


@dataclass(frozen=True)
class SimResult:
    config: SimConfig
    plan: Plan
    iteration_time_s: float
    optimizer_step_s: float
    forward_backward_s: float
    grad_sync_end_s: float
    breakdown: dict[str, float]
    optimizer_breakdown: dict[str, float]
    rank_optimizer_s: tuple[float, ...]
    spans: tuple[Span, ...] = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "policy": cfg.policy,
            "model": self.plan.model,
            "model_source": cfg.model,
            "gpus": cfg.gpus,
            "tp": cfg.tp,
            "dp": cfg.gpus // cfg.tp,
            "optimizer": cfg.optimizer,
            "dp_policy": self.plan.dp_plan.policy,
            "tp_policy": self.plan.tp_plan.policy,
            "tp_mode": cfg.tp_mode,
            "hardware": cfg.hardware,
            "workload": asdict(cfg.workload),
            "iteration_time_s": self.iteration_time_s,
            "optimizer_step_s": self.optimizer_step_s,
            "forward_backward_s": self.forward_backward_s,
            "grad_sync_end_s": self.grad_sync_end_s,
            "breakdown": self.breakdown,
            "optimizer_breakdown": self.optimizer_breakdown,
            "rank_optimizer_s": list(self.rank_optimizer_s),
            "definitions": DEFINITIONS,
        }


def _plan_for(cfg: SimConfig, cluster: Cluster, spec: ModelSpec) -> Plan:
    policy = STEP_POLICIES[cfg.policy]
    dp = 1 if policy.replicated else cluster.dp
    return make_plan(spec, dp, cfg.tp, cfg.optimizer, policy.dp_policy or cfg.dp_policy,
                     policy.tp_policy or cfg.tp_policy, cfg.alpha, cfg.bucket_size,
                     capacity=cfg.capacity, cost_model=AnalyticCost(DeviceRate.from_profile(load_profile(cfg.hardware))))


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if hi > lo:
            total += hi - lo
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def _window_breakdown(spans: list[Span], start: float, end: float) -> dict[str, float]:
    """Compute busy time, communication not hidden behind compute, and idle time inside a window."""
    comp = _union((max(s.start, start), min(s.end, end)) for s in spans if s.kind == "compute")
    comm = _union((max(s.start, start), min(s.end, end)) for s in spans if s.kind == "comm")
    compute = _length(comp)
    exposed = _length(comm) - _overlap(comp, comm)
    idle = max(0.0, (end - start) - compute - exposed)  # >= 0 up to rounding
    return {"compute_s": compute, "exposed_comm_s": exposed, "idle_s": idle}


def simulate(cfg: SimConfig, plan: Plan | None = None, replicate_phase_a: bool = True) -> SimResult:
    """Simulate one iteration. `plan` overrides the plan the policy would make (it must match).

    With `replicate_phase_a`, forward / backward / gradient sync runs on rank 0 only and stands for
    every rank (they are identical); without it every rank runs it, for checking that claim."""
    cluster = cfg.check()
    hw = load_profile(cfg.hardware)
    spec, arch = resolve_model(cfg.model, cfg.tp)
    plan = plan or _plan_for(cfg, cluster, spec)
    STEP_POLICIES[cfg.policy].check_dp_plan(plan.dp_plan)
    STEP_POLICIES[cfg.policy].check_tp_plan(plan.tp_plan.policy, plan.tp)
    engine = Engine()
    ctx = Context(engine, cluster, hw, DeviceRate.from_profile(hw), arch, spec, cfg.workload,
                  plan, STEP_POLICIES[cfg.policy], cfg.tp_mode)

    _, synced = forward_backward(ctx, (0,) if replicate_phase_a else range(cluster.gpus))
    engine.run()
    t_sync = engine.now
    phase_a = [s for s in engine.spans if s.rank == 0]
    n_phase_a = len(engine.spans)
    fb_end = max((s.end for s in phase_a if s.kind == "compute"), default=0.0)

    start = engine.env.event().succeed()
    optimizer_step(ctx, start)
    t_end = engine.run()
    assert synced.triggered

    phase_b = engine.spans[n_phase_a:]
    by_rank: dict[int, list[Span]] = {r: [] for r in range(cluster.gpus)}
    for s in phase_b:
        by_rank[s.rank].append(s)
    a = _window_breakdown(phase_a, 0.0, t_sync)
    opt = [_window_breakdown(by_rank[r], t_sync, t_end) for r in range(cluster.gpus)]
    mean = {k: sum(o[k] for o in opt) / len(opt) for k in opt[0]}
    return SimResult(
        config=cfg,
        plan=plan,
        iteration_time_s=t_end,
        optimizer_step_s=t_end - t_sync,
        forward_backward_s=fb_end,
        grad_sync_end_s=t_sync,
        breakdown={k: a[k] + mean[k] for k in a},
        optimizer_breakdown=mean,
        rank_optimizer_s=tuple(o["compute_s"] for o in opt),
        spans=tuple(phase_a) + tuple(phase_b),
    )


def compare(base: SimConfig, policies: Iterable[str] = tuple(STEP_POLICIES),
            progress: Callable[[str], None] | None = None) -> list[SimResult]:
    from dataclasses import replace

    out = []
    for name in policies:
        if progress:
            progress(name)
        out.append(simulate(replace(base, policy=name)))
    return out


def write_trace(result: SimResult, path: str | Path) -> None:
    """Chrome / Perfetto trace: one process per rank, one thread per stream. Phase A is simulated on
    rank 0 and identical elsewhere: other ranks show it as one span per stream kind."""
    events: list[dict[str, Any]] = []
    t_sync = result.grad_sync_end_s
    gpus = result.config.gpus
    phase_a = [s for s in result.spans if s.end <= t_sync and s.rank == 0]
    for s in result.spans:
        events.append({"name": s.name, "cat": s.kind, "ph": "X", "ts": s.start * 1e6,
                       "dur": (s.end - s.start) * 1e6, "pid": s.rank, "tid": s.stream})
    fb_end = result.forward_backward_s
    dp_spans = [s for s in phase_a if s.stream == "dp-comm"]
    for r in range(1, gpus):
        events.append({"name": "forward/backward (as rank 0)", "cat": "compute", "ph": "X", "ts": 0.0,
                       "dur": fb_end * 1e6, "pid": r, "tid": "compute"})
        for s in dp_spans:
            events.append({"name": s.name, "cat": s.kind, "ph": "X", "ts": s.start * 1e6,
                           "dur": (s.end - s.start) * 1e6, "pid": r, "tid": s.stream})
    for r in range(gpus):
        events.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
    write_text_atomic(path, dumps_json({"traceEvents": events, "displayTimeUnit": "ms",
                                        "otherData": {"definitions": DEFINITIONS}}), "trace")
