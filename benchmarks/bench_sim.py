"""Simulator bars (docs/design.md §10) and the paper's headline ratios, measured in one run.

1. Wall time to simulate one iteration of Qwen3-32B on 256 GPUs (bar < 2 s) and 4096 GPUs
   (bar < 30 s), every policy `compare` runs (zero1: the AdamW baseline), on one core.
2. The issue's bar: `canzona compare` on Qwen3-32B, 256 H100, TP 8, seq 4096, GBS 128: the best
   policy's iteration MFU within 30-50% (published Megatron on H100: 38-47%), every policy's memory
   and fit, canzona's ratios against layerwise (the paper's baseline) and zero1-gather.
3. The paper's setup (Qwen3-32B, 256 H100, TP 8, sequence 2048, global batch 128, Muon): simulated
   canzona-vs-baseline ratios of iteration time and optimizer-step latency, next to the paper's
   1.57x and 5.8x, as Megatron runs (parameter all-gather overlapped with the next forward) and
   with the all-gather inside the step (the optimizer-step definition that includes it), under
   three bucket settings:
   - planner defaults (about four matrices per rank per bucket, for every policy);
   - the authors' scripts (400M-element buckets, for every policy);
   - baselines at stock Megatron buckets (max(40M, 1M x dp)), canzona at the planner default.
4. NVIDIA's published layout for Qwen3-32B: TP 8 x PP 2 with full activation recompute.
5. Scale (docs/design.md §9.8): `canzona simulate --model qwen3-32b --tp 8 --global-batch GPUS`
   from 256 to 16384 GPUs (bar: 16384 under 5 s), the optimizer step simulated once per class of
   identical ranks against every rank simulated (`by_class=False`), side by side: wall and CPU
   seconds, their ratio, how many ranks stood for how many, and whether the results are the same
   (they must be, bit for bit). No assert on time: the machine's load decides.
   Parameters are datasheet values from the h100-sxm profile; nothing is fitted to the paper.
6. The engine (`sim.engine`): each op chained after its stream's previous op, the garbage
   collector paused through a simulation (`cyclic_gc_paused`), against the same with the collector
   on and against the engine until 2026-11-30 (streams as SimPy resources of capacity one, the
   collector on), in interleaved rounds on layouts of the published table and the search: wall
   seconds of each, their ratios, and whether the results are the same (they must be, bit for bit).
   Parameters are datasheet values from the h100-sxm profile; nothing is fitted to the paper.

Run: python3 benchmarks/bench_sim.py   (a few minutes; --scale: the scale table alone; --streams:
the streams table alone)
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import replace

import simpy
from rich.console import Console
from rich.table import Table

import sim.simulate as simulate_module
from sim.engine import Engine, Span, _Kernel
from sim.options import RunOptions
from sim.published import load, select
from sim.simulate import SimConfig, SimResult, compare, compared_policies, simulate, with_policy
from sim.workload import Workload

PAPER = {"iteration": 1.57, "optimizer": 5.8}
WALL_BARS = {256: 2.0, 4096: 30.0}
SCALE_GPUS = (256, 1024, 4096, 16384)
SCALE_BAR = {16384: 5.0}
MFU_BAR = (0.30, 0.50)
ISSUE_SETUP = SimConfig(model="qwen3-32b", gpus=256, tp=8, optimizer="muon",
                        workload=Workload(seq_len=4096, global_batch=128))
PAPER_SETUP = SimConfig(model="qwen3-32b", gpus=256, tp=8, optimizer="muon",
                        workload=Workload(seq_len=2048, global_batch=128))
BASELINES = ("sc", "zero1-gather", "layerwise")
CANZONA_DP = ("alpha-balanced", "alpha-balanced-reorder")


def verdict(ok: bool) -> str:
    return "[bold green]PASS[/]" if ok else "[bold red]FAIL[/]"


def policy_label(cfg: SimConfig, policy: str) -> str:
    """A row's policy, with the optimizer `with_policy` runs it with where that is not `cfg`'s."""
    optimizer = with_policy(cfg, policy).optimizer
    return policy if optimizer == cfg.optimizer else f"{policy} ({optimizer})"


def wall_table() -> tuple[Table, bool]:
    t = Table(title="Simulator wall time per iteration (Qwen3-32B, TP 8, seq 2048, one core)")
    for col in ("GPUs", "policy", "wall s", "simulated iteration s", "MFU", "bar", "result"):
        t.add_column(col, justify="right" if col != "policy" else "left")
    ok_all = True
    for gpus, bar in WALL_BARS.items():
        cfg = replace(PAPER_SETUP, gpus=gpus, workload=Workload(seq_len=2048, global_batch=max(128, gpus // 4)))
        for policy in compared_policies(cfg.optimizer):  # what `compare` runs: zero1 as the AdamW baseline
            t0 = time.perf_counter()
            r = simulate(with_policy(cfg, policy))
            wall = time.perf_counter() - t0
            ok = wall < bar
            ok_all &= ok
            t.add_row(str(gpus), policy_label(cfg, policy), f"{wall:.2f}", f"{r.iteration_time_s:.3f}", f"{r.mfu * 100:.1f}%",
                      f"< {bar:g} s", verdict(ok))
    return t, ok_all


def _timed(cfg: SimConfig, repeat: int, **kw) -> tuple[float, float, SimResult]:
    """Median wall and CPU seconds of `repeat` runs of `simulate(cfg, **kw)`, and the last result."""
    walls, cpus = [], []
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        result = simulate(cfg, **kw)
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return statistics.median(walls), statistics.median(cpus), result


def scale_table(repeat: int = 3) -> Table:
    t = Table(title="Scale: Qwen3-32B, TP 8, global batch = GPUs, canzona (and its ZeRO-1 fallback), in process "
                    f"(median of {repeat}; every rank: one run)")
    for col in ("GPUs", "classes: wall s", "cpu s", "every rank: wall s", "cpu s", "wall ratio", "cpu ratio",
                "simulated ranks", "same result", "bar"):
        t.add_column(col, justify="right")
    for gpus in SCALE_GPUS:
        cfg = SimConfig(model="qwen3-32b", gpus=gpus, tp=8, workload=Workload(global_batch=gpus))
        wall, cpu, fast = _timed(cfg, repeat)
        ref_wall, ref_cpu, ref = _timed(cfg, 1, by_class=False)
        same = json.dumps(fast.to_dict()) == json.dumps(ref.to_dict())
        simulated = len({s.rank for s in fast.spans.simulated if s.phase == "B"})
        bar = SCALE_BAR.get(gpus)
        t.add_row(str(gpus), f"{wall:.2f}", f"{cpu:.2f}", f"{ref_wall:.2f}", f"{ref_cpu:.2f}",
                  f"{ref_wall / wall:.1f}x", f"{ref_cpu / cpu:.1f}x", f"{simulated} of {gpus}",
                  verdict(same), "" if bar is None else f"< {bar:g} s: {verdict(wall < bar)}")
    return t


class ResourceStreamEngine(Engine):
    """The engine with each stream a SimPy resource of capacity one, which each op requests when it
    starts and holds until it ends: the engine's code until 2026-11-30, kept here as the baseline of
    `streams_table` (`_enqueue` hands each op its stream's resource where the engine hands it the
    stream's previous op)."""

    def _enqueue(self, rank, stream, proc_of):
        resources = self.__dict__.setdefault("_resources", {})
        return self.env.process(proc_of(resources.setdefault((rank, stream), simpy.Resource(self.env, capacity=1))))

    def _compute(self, rank, stream, name, seconds, prev, after, phase, margin=0):
        with prev.request() as req:
            yield req
            if after:
                yield self.env.all_of(after)
            start = self.env.now
            if seconds > 0:
                if self.sms:
                    k = _Kernel(seconds, self._rate(rank, margin), start, self.env.active_process, margin)
                    running = self._kernels.setdefault(rank, [])
                    running.append(k)
                    while True:
                        try:
                            yield self.env.timeout(k.remaining / k.rate)
                            break
                        except simpy.Interrupt:
                            continue
                    running.remove(k)
                else:
                    yield self.env.timeout(seconds)
            self._record(Span(rank, stream, name, "compute", start, self.env.now, phase))

    def _participate(self, coll, rank, stream, prev, after, phase):
        with prev.request() as req:
            yield req
            if after:
                yield self.env.all_of(after)
            coll.arrive()
            yield coll.done
            self._record(Span(rank, stream, coll.name, "comm", coll.start, self.env.now, phase))


# the engine as it is; without pausing the garbage collector; and as it was until 2026-11-30 (both)
VARIANTS = {"now": (Engine, True), "collector on": (Engine, False), "before": (ResourceStreamEngine, False)}


# the published rows whose layouts the table runs: TP 8 x PP 8 x VP 8 x CP 2 (FP8, userbuffers), TP 4 x
# PP 4 x VP 5 x CP 2, and EP 16 with the EP overlap
STREAM_ROWS = ("llama3.1-405b-1024xh100-mb25.11-fp8", "llama3.1-70b-256xh100-dgxc-bf16",
               "qwen3-30b-a3b-16xh100-mb-perf")


def _stream_cases() -> list[tuple[str, SimConfig]]:
    runs, _ = load()
    cases = [(row, select(runs, row)[0].sim_config()) for row in STREAM_ROWS]
    cases.append(("search best: qwen3-32b, 256 GPUs, TP 8 x PP 2 x VP 16",
                  replace(ISSUE_SETUP, pp=2, vp=16, workload=Workload(seq_len=4096, global_batch=128, micro_batch=4))))
    return cases


def _stream_run(variant: str, case: int) -> None:
    """One measurement, in its own process (`streams_table`): the wall seconds of simulating case
    `case` with `variant`'s engine and collector, and the result's digest."""
    import hashlib

    cfg = _stream_cases()[case][1]
    engine, paused = VARIANTS[variant]
    simulate_module.Engine = engine
    if not paused:  # the simulation as it ran before `cyclic_gc_paused`, its own recursive calls too
        simulate_module.simulate = simulate.__wrapped__
    w = time.perf_counter()
    result = simulate_module.simulate(cfg)
    wall = time.perf_counter() - w
    print(wall, hashlib.sha256(json.dumps(result.to_dict()).encode()).hexdigest())


def streams_table(rounds: int = 3) -> Table:
    """Each measurement in a fresh process (what is left of one run, the garbage collector's work on
    it included, would be charged to the next), the variants alternating."""
    import subprocess

    t = Table(title=f"Engine: chained streams with the garbage collector paused, against the collector on and the "
                    f"engine before (SimPy resources, collector on); median wall s of {rounds} interleaved rounds, "
                    "each run in its own process")
    for col in ("layout", *(f"{v} s" for v in VARIANTS), "collector on / now", "before / now", "same result"):
        t.add_column(col, justify="right" if col != "layout" else "left")
    for case, (name, _) in enumerate(_stream_cases()):
        walls: dict[str, list[float]] = {v: [] for v in VARIANTS}
        digests: set[str] = set()
        for _ in range(rounds):
            for variant in VARIANTS:
                out = subprocess.run([sys.executable, __file__, "--stream-run", variant, str(case)], check=True,
                                     capture_output=True, text=True).stdout.split()
                walls[variant].append(float(out[0]))
                digests.add(out[1])
        now, gc_on, before = (statistics.median(walls[v]) for v in VARIANTS)
        t.add_row(name, f"{now:.2f}", f"{gc_on:.2f}", f"{before:.2f}", f"{gc_on / now:.2f}x", f"{before / now:.2f}x",
                  verdict(len(digests) == 1))
    return t


def run_setting(baseline_bucket: int | None, canzona_bucket: int | None,
                options: RunOptions) -> dict[str, SimResult]:
    out = {}
    for policy in BASELINES:
        out[policy] = simulate(replace(PAPER_SETUP, policy=policy, bucket_size=baseline_bucket, options=options))
    for dp_policy in CANZONA_DP:
        out[f"canzona ({dp_policy})"] = simulate(replace(PAPER_SETUP, policy="canzona", dp_policy=dp_policy,
                                                         bucket_size=canzona_bucket, options=options))
    return out


def issue_table() -> tuple[Table, bool]:
    results = compare(ISSUE_SETUP)
    by = {r.config.policy: r for r in results}
    t = Table(title="canzona compare: Qwen3-32B, 256 x H100, TP 8, seq 4096, GBS 128, Muon (Megatron overlap options on)")
    for col in ("policy", "iteration ms", "MFU", "GB per GPU", "fits", "optimizer ms", "iter vs layerwise",
                "opt vs layerwise", "iter vs zero1", "opt vs zero1"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for r in results:
        row = [r.config.policy, f"{r.iteration_time_s * 1e3:.0f}", f"{r.mfu * 100:.1f}%",
               f"{r.memory.worst.total / 1e9:.1f}", "yes" if r.fits else "NO", f"{r.optimizer_step_s * 1e3:.1f}"]
        for base in ("layerwise", "zero1-gather"):
            row += [f"{by[base].iteration_time_s / r.iteration_time_s:.2f}x",
                    f"{by[base].optimizer_step_s / r.optimizer_step_s:.2f}x"]
        t.add_row(*row)
    best = max((r for r in results if r.fits), key=lambda r: r.mfu)
    ok = MFU_BAR[0] <= best.mfu <= MFU_BAR[1]
    t.caption = (f"Best fitting policy {best.config.policy}: MFU {best.mfu * 100:.1f}% (bar {MFU_BAR[0]:.0%}-{MFU_BAR[1]:.0%}; "
                 f"published Megatron on H100 38-47%) {verdict(ok)}. Paper: canzona vs layerwise "
                 f"{PAPER['iteration']}x iteration, {PAPER['optimizer']}x optimizer step.")
    return t, ok


def recipe_table() -> Table:
    cfg = replace(ISSUE_SETUP, pp=2, options=RunOptions(recompute="full"))
    t = Table(title="NVIDIA's Qwen3-32B layout: 256 x H100, TP 8 x PP 2, full recompute, seq 4096, GBS 128")
    for col in ("policy", "iteration ms", "MFU", "GB per GPU", "fits", "optimizer ms"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for r in compare(cfg):
        t.add_row(r.config.policy, f"{r.iteration_time_s * 1e3:.0f}", f"{r.mfu * 100:.1f}%",
                  f"{r.memory.worst.total / 1e9:.1f}", "yes" if r.fits else "NO", f"{r.optimizer_step_s * 1e3:.1f}")
    return t


def ratio_table(title: str, results: dict[str, SimResult]) -> Table:
    t = Table(title=title)
    t.add_column("canzona plan", no_wrap=True)
    t.add_column("vs baseline", no_wrap=True)
    for col in ("baseline iter ms", "canzona iter ms", "iteration ratio", "paper",
                "baseline opt ms", "canzona opt ms", "optimizer ratio", "paper "):
        t.add_column(col, justify="right")
    for key in (k for k in results if k.startswith("canzona")):
        c = results[key]
        name = key + (f" -> {c.fell_back_to} (faster)" if c.fell_back_to else "")
        for base in BASELINES:
            b = results[base]
            t.add_row(name, base, f"{b.iteration_time_s * 1e3:.0f}", f"{c.iteration_time_s * 1e3:.0f}",
                      f"{b.iteration_time_s / c.iteration_time_s:.2f}x", f"{PAPER['iteration']}x",
                      f"{b.optimizer_step_s * 1e3:.0f}", f"{c.optimizer_step_s * 1e3:.0f}",
                      f"{b.optimizer_step_s / c.optimizer_step_s:.2f}x", f"{PAPER['optimizer']}x")
    return t


def main() -> int:
    console = Console(width=170)
    if sys.argv[1:2] == ["--stream-run"]:
        _stream_run(sys.argv[2], int(sys.argv[3]))
        return 0
    if "--streams" in sys.argv[1:]:
        console.print(streams_table())
        return 0
    console.print(scale_table())
    if "--scale" in sys.argv[1:]:
        return 0
    table, ok = wall_table()
    console.print(table)
    issue, mfu_ok = issue_table()
    console.print(issue)
    console.print(recipe_table())
    settings = [
        ("planner default buckets for every policy", None, None),
        ("authors' scripts: 400M-element buckets for every policy", 400_000_000, 400_000_000),
        ("baselines at stock Megatron buckets (max(40M, 1M x dp)); canzona at the planner default",
         max(40_000_000, 1_000_000 * PAPER_SETUP.gpus // PAPER_SETUP.tp), None),
    ]
    for gather, options in (("parameter all-gather overlapped with the next forward", RunOptions()),
                            ("parameter all-gather inside the optimizer step", RunOptions(overlap_param_gather=False))):
        for title, base_bucket, canzona_bucket in settings:
            console.print(ratio_table(f"Paper setup (Qwen3-32B, 256 x H100, TP 8, seq 2048, GBS 128, Muon), {gather}: "
                                      f"{title}", run_setting(base_bucket, canzona_bucket, options)))
    console.print(f"simulator wall-time bars: {verdict(ok)}; MFU bar: {verdict(mfu_ok)}")
    return 0 if ok and mfu_ok else 1


if __name__ == "__main__":
    sys.exit(main())
