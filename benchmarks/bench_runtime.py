"""Optimizer-step time of the DP runtime, every policy side by side in one run (docs/design.md §10).

On spawned gloo ranks (CPU, one torch thread per rank; DP 2 on a 2-core machine), a Qwen3-style
decoder scaled up from the tiny preset so its matrices have a few hundred rows (hidden 384, four
layers, ffn 1024: 28 matrices from 128 x 384 to 1024 x 384) is trained by `DistributedOptimizer`
under `sc`, `zero1-gather` and `canzona` (and `layerwise` with `--policies`). Gradients come from a
real forward / backward whose reduce-scatters overlap the backward as in training; after a barrier
each rank times `optimizer.step()` (gradient-sync tail, matrix kernels, AdamW slice, parameter
all-gather), and a step's time is the slowest rank's. The policies' steps are interleaved (each has
its own model and optimizer), so load from other processes hits them alike. Reported: the median
over the measured steps after warm-up, and the ratios sc / canzona and zero1-gather / canzona. The bar: canzona's step beats
sc's.

Run: python3 benchmarks/bench_runtime.py [--optimizers muon,soap] [--steps 8] [--warmup 2]
(about a minute for Muon and SOAP on 2 cores)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmark this checkout (spawned ranks inherit sys.path)
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from canzona.runtime.launch import run_ranks  # noqa: E402
from reference.tiny_model import TinyQwen3Config  # noqa: E402

MODEL = TinyQwen3Config(vocab=1024, hidden=384, layers=4, q_heads=6, kv_heads=2, head_dim=64, ffn=1024,
                        tied_embeddings=True, max_seq_len=64, name="bench-384")
SEQ_LEN = 32
BATCH_PER_RANK = 4
POLICIES = ("sc", "zero1-gather", "canzona")


def worker(rank: int, world: int, cfg: TinyQwen3Config, jobs: list[tuple[str, str]], steps: int,
           warmup: int) -> list[dict]:
    """Every (optimizer, policy) gets its own model and optimizer; their steps are interleaved
    (step i of every job, in an order rotated each step), so a change in machine load hits every
    policy alike. Returns per job the slowest rank's `step()` seconds of each measured step."""
    from canzona.runtime.optimizer import DistributedOptimizer
    from reference.data import synthetic_batches
    from reference.tiny_model import TinyQwen3

    runs = []
    for optimizer, policy in jobs:
        model = TinyQwen3(cfg, seed=0)
        opt = DistributedOptimizer(model.named_parameters(), model.spec(), optimizer, policy=policy)
        runs.append({"model": model, "opt": opt, "times": [], "loss": None})
    batches = list(synthetic_batches(cfg.vocab, BATCH_PER_RANK * world, SEQ_LEN, warmup + steps, seed=1))
    for i, tokens in enumerate(batches):
        mine = tokens[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK]
        for k in range(len(runs)):
            run = runs[(i + k) % len(runs)]
            run["opt"].zero_grad()
            loss = run["model"].loss(mine)
            loss.backward()  # reduce-scatters launch from the hooks, overlapping backward
            dist.barrier()
            t0 = time.perf_counter()
            run["opt"].step()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            run["loss"] = loss.item()
            if i >= warmup:
                run["times"].append(dt.item())
    return [{"optimizer": o, "policy": p, "plan": r["opt"].plan.dp_plan.policy, "times": r["times"],
             "computes": len(r["opt"]._computes), "loss": r["loss"]}
            for (o, p), r in zip(jobs, runs)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--optimizers", default="muon,soap")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="measured steps per policy")
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    optimizers = args.optimizers.split(",")
    policies = args.policies.split(",")
    if "canzona" not in policies:
        policies.append("canzona")
    jobs = [(o, p) for o in optimizers for p in policies]
    load = os.getloadavg()
    t0 = time.perf_counter()
    per_rank = run_ranks(worker, args.dp, MODEL, jobs, args.steps, args.warmup, deadline_s=1800.0)
    wall = time.perf_counter() - t0
    results = {(r["optimizer"], r["policy"]): r for r in per_rank[0]}  # times are already max over ranks
    computes = {key: [rank_rows[i]["computes"] for rank_rows in per_rank] for i, key in enumerate(results)}

    n_matrices = 7 * MODEL.layers
    t = Table(title=f"Optimizer step on gloo: DP {args.dp} spawned ranks x 1 thread, {MODEL.name} "
                    f"(hidden {MODEL.hidden}, {MODEL.layers} layers, ffn {MODEL.ffn}, {n_matrices} matrices), "
                    f"median of {args.steps} interleaved steps after {args.warmup}")
    for col in ("optimizer", "policy", "DP plan", "matrices per rank", "step ms", "min ms", "max ms",
                "sc / this", "zero1-gather / this"):
        t.add_column(col, justify="left" if col in ("optimizer", "policy", "DP plan") else "right")
    verdicts = []
    for optimizer in optimizers:
        med = {p: statistics.median(results[(optimizer, p)]["times"]) for p in policies}
        for p in policies:
            r = results[(optimizer, p)]

            def ratio(base: str, p: str = p, med: dict = med) -> str:
                return f"{med[base] / med[p]:.2f}x" if base in med else "-"

            t.add_row(optimizer, p, r["plan"], "/".join(map(str, computes[(optimizer, p)])),
                      f"{med[p] * 1e3:.1f}", f"{min(r['times']) * 1e3:.1f}", f"{max(r['times']) * 1e3:.1f}",
                      ratio("sc"), ratio("zero1-gather"), style="bold green" if p == "canzona" else None)
        if "sc" in med:
            verdicts.append((optimizer, med["sc"] / med["canzona"], med["sc"] > med["canzona"]))
        t.add_section()
    t.caption = ("step ms: slowest rank's optimizer.step() (gradient-sync tail + matrix kernels + AdamW "
                 "slice + parameter all-gather). Ratios: baseline time / this policy's (higher: this is faster).")
    console = Console(width=160)
    console.print(t)
    ok = True
    for optimizer, speedup, passed in verdicts:
        ok &= passed
        console.print(f"{optimizer}: canzona step {speedup:.2f}x faster than sc -> "
                      f"{'[bold green]PASS[/]' if passed else '[bold red]FAIL[/]'} (bar: canzona beats sc)")
    console.print(f"wall {wall:.1f} s, torch {torch.__version__}, load average before / after "
                  f"{load[0]:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
