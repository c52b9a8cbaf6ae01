"""Simulator bars (docs/design.md §10) and the paper's headline ratios, measured in one run.

1. Wall time to simulate one iteration of Qwen3-32B on 256 GPUs (bar < 2 s) and 4096 GPUs
   (bar < 30 s), every policy, on one core.
2. The paper's setup (Qwen3-32B, 256 H100, TP 8, sequence 2048, global batch 128, Muon): simulated
   canzona-vs-baseline ratios of iteration time and optimizer-step latency for every baseline, next
   to the paper's 1.57x and 5.8x, under three bucket settings:
   - planner defaults (about four matrices per rank per bucket, for every policy);
   - the authors' scripts (400M-element buckets, for every policy);
   - baselines at stock Megatron buckets (max(40M, 1M x dp)), canzona at the planner default.
   Parameters are datasheet values from the h100-sxm profile; nothing is fitted to the paper.

Run: python3 benchmarks/bench_sim.py   (about 40 s)
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace

from rich.console import Console
from rich.table import Table

from canzona.step_policies import STEP_POLICIES
from sim.simulate import SimConfig, SimResult, simulate
from sim.workload import Workload

PAPER = {"iteration": 1.57, "optimizer": 5.8}
WALL_BARS = {256: 2.0, 4096: 30.0}
PAPER_SETUP = SimConfig(model="qwen3-32b", gpus=256, tp=8, optimizer="muon",
                        workload=Workload(seq_len=2048, global_batch=128))
BASELINES = ("sc", "zero1-gather", "layerwise")
CANZONA_DP = ("alpha-balanced", "alpha-balanced-reorder")


def verdict(ok: bool) -> str:
    return "[bold green]PASS[/]" if ok else "[bold red]FAIL[/]"


def wall_table() -> tuple[Table, bool]:
    t = Table(title="Simulator wall time per iteration (Qwen3-32B, TP 8, seq 2048, one core)")
    for col in ("GPUs", "policy", "wall s", "simulated iteration s", "bar", "result"):
        t.add_column(col, justify="right" if col != "policy" else "left")
    ok_all = True
    for gpus, bar in WALL_BARS.items():
        cfg = replace(PAPER_SETUP, gpus=gpus, workload=Workload(seq_len=2048, global_batch=max(128, gpus // 4)))
        for policy in STEP_POLICIES:
            t0 = time.perf_counter()
            r = simulate(replace(cfg, policy=policy))
            wall = time.perf_counter() - t0
            ok = wall < bar
            ok_all &= ok
            t.add_row(str(gpus), policy, f"{wall:.2f}", f"{r.iteration_time_s:.3f}", f"< {bar:g} s", verdict(ok))
    return t, ok_all


def run_setting(baseline_bucket: int | None, canzona_bucket: int | None) -> dict[str, SimResult]:
    out = {}
    for policy in BASELINES:
        out[policy] = simulate(replace(PAPER_SETUP, policy=policy, bucket_size=baseline_bucket))
    for dp_policy in CANZONA_DP:
        out[f"canzona ({dp_policy})"] = simulate(replace(PAPER_SETUP, policy="canzona", dp_policy=dp_policy,
                                                         bucket_size=canzona_bucket))
    return out


def ratio_table(title: str, results: dict[str, SimResult]) -> Table:
    t = Table(title=title)
    t.add_column("canzona plan", no_wrap=True)
    t.add_column("vs baseline", no_wrap=True)
    for col in ("baseline iter ms", "canzona iter ms", "iteration ratio", "paper",
                "baseline opt ms", "canzona opt ms", "optimizer ratio", "paper "):
        t.add_column(col, justify="right")
    for name in (k for k in results if k.startswith("canzona")):
        c = results[name]
        for base in BASELINES:
            b = results[base]
            t.add_row(name, base, f"{b.iteration_time_s * 1e3:.0f}", f"{c.iteration_time_s * 1e3:.0f}",
                      f"{b.iteration_time_s / c.iteration_time_s:.2f}x", f"{PAPER['iteration']}x",
                      f"{b.optimizer_step_s * 1e3:.0f}", f"{c.optimizer_step_s * 1e3:.0f}",
                      f"{b.optimizer_step_s / c.optimizer_step_s:.2f}x", f"{PAPER['optimizer']}x")
    return t


def main() -> int:
    console = Console(width=170)
    table, ok = wall_table()
    console.print(table)
    settings = [
        ("planner default buckets for every policy", None, None),
        ("authors' scripts: 400M-element buckets for every policy", 400_000_000, 400_000_000),
        ("baselines at stock Megatron buckets (max(40M, 1M x dp)); canzona at the planner default",
         max(40_000_000, 1_000_000 * PAPER_SETUP.gpus // PAPER_SETUP.tp), None),
    ]
    for title, base_bucket, canzona_bucket in settings:
        console.print(ratio_table(f"Paper setup (Qwen3-32B, 256 x H100, TP 8, seq 2048, GBS 128, Muon): {title}",
                                  run_setting(base_bucket, canzona_bucket)))
    console.print(f"simulator wall-time bars: {verdict(ok)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
