"""The TP phase of the optimizer step three ways, side by side in one run (docs/design.md §6.3, §10):
`tp-sync` (every TP rank all-gathers every shard and computes every update), canzona's micro-groups
run serially (gather, compute, scatter, apply, one group after another) and the same micro-groups
pipelined (the gather of group g+1 and the scatter of g in flight while g+1 computes).

On spawned gloo ranks (CPU, one torch thread per rank; TP 2 by default on a 2-core machine), a
Qwen3-style decoder scaled up from the tiny preset (hidden 384, four layers, ffn 1024: 28 matrices
from 128 x 384 to 1024 x 384), split over TP Megatron-style (`reference.tiny_model_tp`), is trained
by three optimizers on three copies of the model, all from the same weights on the same batches.
Rounds are interleaved (each round every contender runs one iteration, in an order rotated each
round, after a barrier), so load from other processes hits all of them alike. Timed: `step()` (the
slowest rank's), and inside it the matrix phase by stage: issuing collectives (packing included),
waiting for them, host compute, applying chunks.

Reported: median step times, ratios against tp-sync and against serial, and the share of
communication the pipeline hides: 1 - (time the pipelined run waits for collectives) / (time the
serial run waits for them; serial waits for every collective as soon as it is issued). With 2 ranks
on 2 cores, gloo's communication threads compete with compute for the same cores: the hidden
share is what this machine allows, not a property of the schedule.

Run: python3 benchmarks/bench_tp.py [--tp 2] [--dp 1] [--rounds 12] [--warmup 2] [--optimizer muon]
     [--capacity-groups 6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmark this checkout (spawned ranks inherit sys.path)
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from bench_runtime import BATCH_PER_RANK, MODEL, SEQ_LEN  # noqa: E402 - the same model and batches
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from canzona.harness.launch import run_ranks  # noqa: E402
from canzona.optimizers import MATRIX_OPTIMIZERS  # noqa: E402
from canzona.plan import make_plan  # noqa: E402
from canzona.tp import Capacity  # noqa: E402
from reference.tiny_model import model_spec  # noqa: E402

CONTENDERS = (("tp-sync", "tp-sync", "pipelined"), ("serial", "greedy-rollback", "serial"),
              ("pipelined", "greedy-rollback", "pipelined"))
STAGES = ("issue", "wait", "compute", "apply")


def plans(dp: int, tp: int, optimizer: str, groups: int):
    """tp-sync's plan, and the micro-group plan with a capacity that gives about `groups` groups per
    DP rank (the default capacity, one largest task, would give a group per couple of tasks)."""
    spec = model_spec(MODEL)
    sync = make_plan(spec, dp, tp, optimizer, "alpha-balanced", "tp-sync")
    per_rank = max(sum(c for g in rank for c in g.costs) for rank in sync.tp_plan.groups)
    micro = make_plan(spec, dp, tp, optimizer, "alpha-balanced", "greedy-rollback",
                      capacity=Capacity(per_rank / (tp * groups)))
    return {"tp-sync": sync, "greedy-rollback": micro}


def worker(rank: int, world: int, tp: int, optimizer: str, rounds: int, warmup: int, by_policy: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from canzona.runtime.optimizer import DistributedOptimizer
    from reference.data import shard_batch, synthetic_batches
    from reference.tiny_model_tp import TinyQwen3TP

    dp = world // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    contenders = []
    for name, tp_policy, mode in CONTENDERS:
        model = TinyQwen3TP(MODEL, mesh.get_group("tp"), seed=0)
        opt = DistributedOptimizer(model.named_parameters(), model.spec(), optimizer, plan=by_policy[tp_policy],
                                   group=mesh, tp_mode=mode)
        contenders.append({"name": name, "model": model, "opt": opt, "step": [], "stages": {s: [] for s in STAGES},
                           "groups": len(opt.schedule.groups)})
    batches = synthetic_batches(MODEL.vocab, BATCH_PER_RANK * dp, SEQ_LEN, warmup + rounds, seed=1)
    for i, tokens in enumerate(batches):
        mine = shard_batch(tokens, mesh.get_local_rank("dp"), dp)
        for k in range(len(contenders)):
            c = contenders[(i + k) % len(contenders)]
            c["opt"].zero_grad()
            c["model"].loss(mine).backward()
            profile: dict[str, float] = {}
            c["opt"].matrix_step.profile = profile
            dist.barrier()
            t0 = time.perf_counter()
            c["opt"].step()
            elapsed = time.perf_counter() - t0
            c["opt"].matrix_step.profile = None
            if i >= warmup:
                c["step"].append(elapsed)
                for s in STAGES:
                    c["stages"][s].append(profile.get(s, 0.0))
    for c in contenders:
        c["opt"].wait_params()  # the last step's parameter all-gathers run under the next forward
    first = contenders[0]["model"]
    same = all(torch.equal(p, q) for c in contenders[1:]
               for p, q in zip(c["model"].parameters(), first.parameters()))
    return {"contenders": [{k: c[k] for k in ("name", "step", "stages", "groups")} for c in contenders],
            "identical": same}


def merged(per_rank: list[dict]) -> list[dict]:
    """Per round the slowest rank's step time; stage times of that same rank."""
    out = []
    for rows in zip(*(r["contenders"] for r in per_rank)):
        rounds = len(rows[0]["step"])
        slowest = [max(range(len(rows)), key=lambda r: rows[r]["step"][i]) for i in range(rounds)]
        out.append({"name": rows[0]["name"], "groups": "/".join(str(r["groups"]) for r in rows),
                    "step": [rows[s]["step"][i] for i, s in enumerate(slowest)],
                    "stages": {st: [rows[s]["stages"][st][i] for i, s in enumerate(slowest)] for st in STAGES}})
    return out


def ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--optimizer", default="muon", choices=MATRIX_OPTIMIZERS)
    parser.add_argument("--capacity-groups", type=int, default=6,
                        help="micro-groups per DP rank the capacity aims at (pipelining needs several)")
    args = parser.parse_args()
    world = args.dp * args.tp
    by_policy = plans(args.dp, args.tp, args.optimizer, args.capacity_groups)
    console = Console(width=140)
    console.print(f"TP step benchmark: DP {args.dp} x TP {args.tp} gloo ranks x 1 thread, {MODEL.name}, "
                  f"{args.optimizer}, {args.rounds} interleaved rounds after {args.warmup} ...")
    per_rank = run_ranks(worker, world, args.tp, args.optimizer, args.rounds, args.warmup, by_policy,
                         deadline_s=1800)
    rows = merged(per_rank)
    by_name = {r["name"]: r for r in rows}
    t = Table(title=f"Optimizer step (matrix phase, AdamW, parameter all-gather), median of {args.rounds} rounds, "
                    "slowest rank per round")
    for col in ("contender", "groups / rank", "step ms", "issue ms", "wait ms", "compute ms", "apply ms",
                "this / tp-sync", "this / serial"):
        t.add_column(col, justify="left" if col == "contender" else "right")
    for r in rows:
        step = ms(r["step"])
        t.add_row(r["name"], r["groups"], f"{step:.1f}", *(f"{ms(r['stages'][s]):.1f}" for s in STAGES),
                  f"{step / ms(by_name['tp-sync']['step']):.2f}", f"{step / ms(by_name['serial']['step']):.2f}")
    console.print(t)
    serial_wait = ms(by_name["serial"]["stages"]["wait"])
    pipelined_wait = ms(by_name["pipelined"]["stages"]["wait"])
    hidden = 1 - pipelined_wait / serial_wait if serial_wait > 0 else float("nan")
    console.print(f"communication hidden by the pipeline: {hidden:.0%} (waiting {pipelined_wait:.1f} ms pipelined "
                  f"against {serial_wait:.1f} ms serial)")
    console.print(f"pipelined step / serial step: {ms(by_name['pipelined']['step']) / ms(by_name['serial']['step']):.2f}; "
                  f"pipelined / tp-sync: {ms(by_name['pipelined']['step']) / ms(by_name['tp-sync']['step']):.2f}")
    console.print("all three trained bit-identical models" if all(r["identical"] for r in per_rank)
                  else "[bold red]the contenders' models differ[/]")


if __name__ == "__main__":
    main()
