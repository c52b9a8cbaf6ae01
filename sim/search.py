"""`search`: the fastest layouts of a model on a number of GPUs (docs/design.md §9.7).

The space is data: `LAYOUT_AXES` (TP, PP, VP, EP, micro-batch, recompute; DP follows from them)
and `REFINE_AXES` (step policy, reduce-scatter implementation), each an `Axis` with its candidate
generator and the `SimConfig` field it sets. A new simulator dimension (context parallelism) is
one more entry.

1. **Enumerate** every combination of the layout axes (`candidates`).
2. **Prune** without simulating: the simulator's own checks (`SimConfig.check`: divisibility of
   heads, layers, experts, the batch; Megatron's interleaving rules), then a lower bound of the
   memory per GPU from `canzona.memory` (weights, gradients, activations and the allowance; the
   plan-dependent parts only add to it) against the profile's capacity.
3. **Simulate** the survivors over a process pool (one worker per core). Recompute is tried in
   rounds: it only adds compute, so a layout is simulated with the least recompute its memory bound
   admits, and with the next one only if that did not fit.
4. **Refine** the best `refine_top` fitting layouts over the other step policies and reduce-scatter
   implementations (the defaults are searched first). `zero1-gather` is not tried beside canzona:
   canzona's ZeRO-1 fallback already simulates it and keeps the faster.
5. **Rank** the layouts that fit by iteration time.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from typing import Any

from canzona.catalog import DEFAULT_MODEL
from canzona.errors import SpecError
from canzona.experts import dense_part
from canzona.hardware import DEFAULT_PROFILE, load_profile
from canzona.memory import RECOMPUTE_MODES, MemorySetup, activation_bytes
from canzona.models import resolve_model
from canzona.pipeline import stage_spec
from canzona.plan import PLAN_DEFAULTS
from canzona.reductions import DEFAULT_REDUCE_SCATTER, REDUCE_SCATTER_IMPLS
from canzona.step_policies import STEP_POLICIES, default_policy, policies_running
from sim.options import RunOptions
from sim.simulate import DENSE_FALLBACK, SimConfig, layer_dims, simulate
from sim.workload import Workload

# canzona's ZeRO-1 fallback simulates zero1-gather and keeps the faster: trying it again is redundant
COVERED_BY_FALLBACK = {"canzona": ("zero1-gather",)}


@dataclass(frozen=True)
class Question:
    """What is searched for: a model on `gpus` GPUs of a hardware profile."""

    model: str = DEFAULT_MODEL
    gpus: int = 256
    hardware: str = DEFAULT_PROFILE
    optimizer: str = "muon"
    seq_len: int = 4096
    global_batch: int = 128

    def __post_init__(self) -> None:
        if not (isinstance(self.gpus, int) and self.gpus >= 1):
            raise SpecError(f"gpus must be a whole number >= 1, got {self.gpus!r}")


@dataclass(frozen=True)
class Facts:
    """What the candidate generators read: the model's and the node's sizes."""

    layers: int
    experts: int  # 0: a dense model
    gpus: int
    gpus_per_node: int
    global_batch: int


def facts_of(q: Question) -> Facts:
    _, arch = resolve_model(q.model)
    return Facts(arch.layers, arch.moe[0] if arch.moe else 0, q.gpus, load_profile(q.hardware).node.gpus,
                 q.global_batch)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# --- the axes ------------------------------------------------------------------------------------

Layout = dict[str, Any]


@dataclass(frozen=True)
class Axis:
    """One searched dimension: `values(facts, chosen)` its candidates given the axes before it,
    `apply(kwargs, value)` how a value enters the `SimConfig` keyword arguments (default: the
    field named like the axis)."""

    name: str
    values: Callable[[Facts, Layout], Iterable[Any]]
    apply: Callable[[dict[str, Any], Any], None] | None = None

    def set(self, kwargs: dict[str, Any], value: Any) -> None:
        if self.apply is None:
            kwargs[self.name] = value
        else:
            self.apply(kwargs, value)


def _workload(kwargs: dict[str, Any], **changes: Any) -> None:
    kwargs["workload"] = replace(kwargs["workload"], **changes)


def _options(kwargs: dict[str, Any], **changes: Any) -> None:
    kwargs["options"] = replace(kwargs["options"], **changes)


def _dp(f: Facts, c: Layout) -> int:
    return f.gpus // (c["tp"] * c["pp"])


# TP: inside a node (the simulator's rule); heads, KV heads, ffn and vocabulary by SimConfig.check
# PP: dividing the layers; VP: dividing each stage's layers (Megatron's interleaving, checked again
# with the micro-batches by check_vp); EP: dividing the experts, MoE only; micro-batch: dividing
# each DP rank's share of the batch. DP = GPUs / (TP x PP) is what is left.
LAYOUT_AXES: tuple[Axis, ...] = (
    Axis("tp", lambda f, c: [t for t in divisors(f.gpus_per_node) if f.gpus % t == 0]),
    Axis("pp", lambda f, c: [p for p in divisors(f.layers) if f.gpus % (c["tp"] * p) == 0]),
    Axis("vp", lambda f, c: [1] if c["pp"] == 1 else
         [v for v in divisors(f.layers // c["pp"]) if v <= MAX_VP]),
    Axis("ep", lambda f, c: [1] if not f.experts else
         [e for e in divisors(f.experts) if (_dp(f, c) * c["tp"]) % e == 0]),
    Axis("micro_batch", lambda f, c: [] if f.global_batch % _dp(f, c) else
         [m for m in divisors(f.global_batch // _dp(f, c)) if m <= MAX_MICRO_BATCH],
         lambda kw, v: _workload(kw, micro_batch=v)),
    # ordered by cost: each mode only adds compute to the one before (the rounds of `search`)
    Axis("recompute", lambda f, c: RECOMPUTE_MODES, lambda kw, v: _options(kw, recompute=v)),
)
MAX_VP = 8  # model chunks per stage: beyond, each micro-batch crosses ranks 8 x PP times
MAX_MICRO_BATCH = 8  # sequences per micro-batch
RECOMPUTE_AXIS = "recompute"

# tried on the best layouts, each value beside the defaults (the first of each)
REFINE_AXES: tuple[Axis, ...] = (
    Axis("policy", lambda f, c: ()),  # filled per question: `refine_values`
    Axis("reduce_scatter", lambda f, c: REDUCE_SCATTER_IMPLS, lambda kw, v: _options(kw, reduce_scatter=v)),
)


def refine_values(q: Question, axis: Axis, facts: Facts, layout: Layout) -> list[Any]:
    if axis.name == "policy":
        own = default_policy(q.optimizer)
        skip = COVERED_BY_FALLBACK.get(own, ())
        return [own] + [p for p in policies_running(q.optimizer) if p != own and p not in skip]
    return list(axis.values(facts, layout))


def candidates(q: Question, facts: Facts | None = None) -> list[Layout]:
    """Every combination of the layout axes, before any check (recompute at its cheapest: the
    other modes are tried in rounds)."""
    facts = facts or facts_of(q)
    out: list[Layout] = [{}]
    for axis in LAYOUT_AXES:
        if axis.name == RECOMPUTE_AXIS:
            out = [{**c, axis.name: RECOMPUTE_MODES[0]} for c in out]
            continue
        out = [{**c, axis.name: v} for c in out for v in axis.values(facts, c)]
    for c in out:
        c["dp"] = _dp(facts, c)
    return out


def config_of(q: Question, layout: Layout) -> SimConfig:
    """The simulator's configuration of one layout (and refinement values, when set)."""
    kwargs: dict[str, Any] = dict(model=q.model, gpus=q.gpus, hardware=q.hardware, optimizer=q.optimizer,
                                  workload=Workload(seq_len=q.seq_len, global_batch=q.global_batch),
                                  options=RunOptions())
    for axis in LAYOUT_AXES + REFINE_AXES:
        if axis.name in layout:
            axis.set(kwargs, layout[axis.name])
    return SimConfig(**kwargs)


# --- pruning -------------------------------------------------------------------------------------


def memory_floor(cfg: SimConfig, model) -> int:
    """A lower bound of the fullest GPU's bytes (`canzona.memory`'s terms that need no plan): each
    stage's dense weights and gradient buffers (the plan's buckets only pad them; experts add to
    them), its activations, and the allowance on top (which grows with what it is added to)."""
    spec, arch = model
    dims = layer_dims(arch, spec)
    wl = cfg.workload
    setup = MemorySetup.from_workload(wl, recompute=cfg.options.recompute,
                                      micro_batches=wl.micro_batches(cfg.gpus // (cfg.tp * cfg.pp)))
    worst = 0
    for stage in range(cfg.pp):
        part = dense_part(stage_spec(spec, cfg.pp, stage, arch.layers, cfg.vp))
        elements = sum(p.local_numel(cfg.tp) for p in part.params)
        counted = elements * (setup.param_bytes + setup.grad_bytes) + \
            activation_bytes(dims, setup, cfg.tp, cfg.pp, stage, cfg.vp)
        worst = max(worst, counted + setup.overhead(counted))
    return worst


# --- simulation ----------------------------------------------------------------------------------


def plan_command(q: Question, row: dict[str, Any], out: str = "plan.json") -> str:
    """The `canzona plan` command line that writes this layout's plan file."""
    parts = ["canzona plan", f"--model {q.model}", f"--dp {row['dp']}", f"--tp {row['tp']}",
             f"--optimizer {q.optimizer}"]
    if row["dp_policy"] != PLAN_DEFAULTS.dp_policy:
        parts.append(f"--dp-policy {row['dp_policy']}")
    if row["tp_policy"] != PLAN_DEFAULTS.tp_policy:
        parts.append(f"--tp-policy {row['tp_policy']}")
    if q.hardware != DEFAULT_PROFILE:
        parts.append(f"--hardware {q.hardware}")
    if row["ep"] > 1:
        parts.append(f"--ep {row['ep']}")
        if row["expert_buckets"] != PLAN_DEFAULTS.expert_buckets:
            parts.append(f"--expert-buckets {row['expert_buckets']}")
    parts.append(f"--out {out}")
    return " ".join(parts)


def not_in_plan(row: dict[str, Any]) -> list[str]:
    """What of a layout its plan file does not carry (the launcher's settings)."""
    out = []
    if row["pp"] > 1:
        out.append(f"pp {row['pp']} (canzona plan plans the whole model over DP x TP; the runtime has no pipeline)")
    if row["vp"] > 1:
        out.append(f"vp {row['vp']}")
    if row["micro_batch"] > 1:
        out.append(f"micro-batch {row['micro_batch']}")
    if row["recompute"] != "none":
        out.append(f"recompute {row['recompute']}")
    if row["reduce_scatter"] != DEFAULT_REDUCE_SCATTER:
        out.append(f"reduce_scatter={row['reduce_scatter']!r} (DistributedOptimizer's option)")
    if row["fell_back_to"] == DENSE_FALLBACK:
        out.append("canzona's experts with zero1-gather's dense part (two plans)")
    return out


def run_one(cfg: SimConfig, layout: Layout) -> dict[str, Any]:
    """Simulate one configuration (in a worker): the row of the results, small enough to send back."""
    r = simulate(cfg)
    used = r.fell_back_to if r.fell_back_to in STEP_POLICIES else cfg.policy
    step = STEP_POLICIES[used]
    return {
        **{k: layout[k] for k in (*(a.name for a in LAYOUT_AXES), "dp")},
        "policy": cfg.policy,
        # a value of the refinement axes other than the default (ties go to the defaults)
        "refined": any(a.name in layout for a in REFINE_AXES),
        "reduce_scatter": cfg.options.reduce_scatter,
        "fell_back_to": r.fell_back_to,
        # the DP / TP policies the plan is made with (the deployed step policy's own, else canzona's settings)
        "dp_policy": step.dp_policy or cfg.dp_policy,
        "tp_policy": step.tp_policy or cfg.tp_policy,
        "expert_buckets": r.expert_choice.buckets,
        "iteration_time_s": r.iteration_time_s,
        "optimizer_step_s": r.optimizer_step_s,
        "mfu": r.mfu,
        "memory_bytes": float(r.memory.worst.total),
        "memory_capacity_bytes": float(r.memory_capacity_bytes),
        "fits": r.fits,
    }


def _run_task(args: tuple[SimConfig, Layout]) -> dict[str, Any]:
    cfg, layout = args
    try:
        return run_one(cfg, layout)
    except SpecError as e:  # a rule only the run itself knows: pruned, with its reason
        return {"error": str(e), **layout}


@dataclass
class SearchResult:
    question: Question
    ranked: list[dict[str, Any]]  # the simulated layouts that fit, fastest first
    not_fitting: list[dict[str, Any]]
    candidates: int
    pruned_checks: int
    pruned_memory: int
    simulated: int
    reasons: dict[str, int] = field(default_factory=dict)  # first words of each check's error: count
    wall_s: float = 0.0
    workers: int = 1

    def to_dict(self, top: int | None = None) -> dict[str, Any]:
        rows = self.ranked if top is None else self.ranked[:top]
        q = self.question
        return {
            "model": q.model, "gpus": q.gpus, "hardware": q.hardware, "optimizer": q.optimizer,
            "seq_len": q.seq_len, "global_batch": q.global_batch,
            "searched": {"candidates": self.candidates, "pruned_by_checks": self.pruned_checks,
                         "pruned_by_memory": self.pruned_memory, "simulated": self.simulated,
                         "fit": len(self.ranked), "workers": self.workers, "wall_s": self.wall_s},
            "layouts": [{"rank": i + 1, **row, "plan_command": plan_command(q, row), "not_in_plan": not_in_plan(row)}
                        for i, row in enumerate(rows)],
        }


Progress = Callable[[int, int, str], None]


def search(q: Question, refine_top: int = 3, workers: int | None = None,
           progress: Progress | None = None) -> SearchResult:
    """Search `q`'s layouts (module docstring); `progress(done, total, what)` after each simulation."""
    import time

    start = time.perf_counter()
    facts = facts_of(q)
    model = resolve_model(q.model)
    capacity = load_profile(q.hardware).gpu.memory_bytes
    cands = candidates(q, facts)
    reasons: dict[str, int] = {}
    pruned_checks = pruned_memory = 0

    def admissible(layout: Layout, modes: Sequence[str]) -> tuple[SimConfig, Layout] | None:
        """The first recompute mode of `modes` whose memory floor fits (None: none does)."""
        nonlocal pruned_memory
        for mode in modes:
            chosen = {**layout, RECOMPUTE_AXIS: mode}
            cfg = config_of(q, chosen)
            if memory_floor(cfg, model) <= capacity:
                return cfg, chosen
        pruned_memory += 1
        return None

    first: list[tuple[SimConfig, Layout]] = []
    for layout in cands:
        try:
            config_of(q, layout).check()  # the simulator's own rules
        except SpecError as e:
            pruned_checks += 1
            key = " ".join(str(e).split()[:4])
            reasons[key] = reasons.get(key, 0) + 1
            continue
        task = admissible(layout, RECOMPUTE_MODES)
        if task is not None:
            first.append(task)

    workers = workers or os.cpu_count() or 1
    rows: list[dict[str, Any]] = []
    done = 0
    total = len(first)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        def run(tasks: list[tuple[SimConfig, Layout]]) -> list[dict[str, Any]]:
            nonlocal done
            out = []
            futures = {pool.submit(_run_task, t): t for t in tasks}
            for fut in as_completed(futures):
                row = fut.result()
                done += 1
                if progress:
                    progress(done, total, describe(futures[fut][1]))
                if "error" in row:
                    key = " ".join(row["error"].split()[:4])
                    reasons[key] = reasons.get(key, 0) + 1
                    continue
                out.append(row)
            return out

        # rounds of recompute: a layout that did not fit is tried with the next mode its floor admits
        tasks = first
        while tasks:
            got = run(tasks)
            rows += got
            tasks = []
            for row in got:
                if row["fits"]:
                    continue
                modes = RECOMPUTE_MODES[RECOMPUTE_MODES.index(row[RECOMPUTE_AXIS]) + 1:]
                layout = {k: row[k] for k in (*(a.name for a in LAYOUT_AXES), "dp")}
                task = admissible(layout, modes) if modes else None
                if task is not None:
                    tasks.append(task)
            total += len(tasks)
        # refinement: the best layouts under the other step policies and reduce-scatters
        best = sorted((r for r in rows if r["fits"]), key=lambda r: r["iteration_time_s"])[:refine_top]
        tasks = []
        for row in best:
            layout = {k: row[k] for k in (*(a.name for a in LAYOUT_AXES), "dp")}
            for axis in REFINE_AXES:
                for value in refine_values(q, axis, facts, layout)[1:]:
                    chosen = {**layout, axis.name: value}
                    tasks.append((config_of(q, chosen), chosen))
        total += len(tasks)
        rows += run(tasks)

    fit = sorted((r for r in rows if r["fits"]), key=lambda r: (r["iteration_time_s"], _order(r)))
    not_fitting = sorted((r for r in rows if not r["fits"]), key=lambda r: r["memory_bytes"])
    return SearchResult(q, fit, not_fitting, len(cands), pruned_checks, pruned_memory, len(rows), reasons,
                        time.perf_counter() - start, workers)


def _order(row: dict[str, Any]) -> tuple:
    """Ties broken towards the simpler layout."""
    return (row["refined"], row["pp"], row["vp"], row["ep"], RECOMPUTE_MODES.index(row["recompute"]), row["tp"])


def describe(layout: Layout) -> str:
    """A layout on one line (the progress bar's and the table's)."""
    parts = [f"TP{layout['tp']}", f"PP{layout['pp']}"]
    parts += [f"VP{layout['vp']}"] if layout["vp"] > 1 else []
    parts += [f"EP{layout['ep']}"] if layout["ep"] > 1 else []
    parts += [f"DP{layout['dp']}", f"mb{layout['micro_batch']}", layout[RECOMPUTE_AXIS]]
    if layout.get("policy"):
        parts.append(layout["policy"])
    if layout.get("reduce_scatter"):
        parts.append(layout["reduce_scatter"])
    return " ".join(parts)


__all__ = ["Axis", "LAYOUT_AXES", "REFINE_AXES", "Question", "SearchResult", "candidates", "config_of",
           "memory_floor", "plan_command", "search"]
