"""Uneven ("-v") reduce-scatter and all-gather on gloo: the measurement behind `canzona.runtime.comm`.

gloo has no reduce-scatter-v and fails on `all_gather` of uneven tensors (docs/design.md §8.1), so a
segment split like canzona's (cut points at parameter boundaries) must be built portably. On
2 spawned gloo ranks, for a few flat buffer sizes split unevenly (30 / 70 by default), in one run:

reduce-scatter (every rank ends with the mean of its own segment)
  a2a     `Comm.reduce_scatter_v` with `reduce_scatter="exact"`: one `all_to_all_single` with uneven
          splits, then a local sum in rank order (deterministic, so rung 3 can be bit for bit; the
          runtime's default, `native`, pads a near-even split and loops over owners otherwise)
  loops   `Comm.reduce_scatter_v` with `reduce_scatter="loops"`: one reduce per owner (the runtime's
          multi-NIC option; on gloo this shows its overhead, not its NIC gain)
  padded  every segment padded to the longest, one `reduce_scatter_tensor` (SUM), divide, unpack
  even    `reduce_scatter_tensor` on the same bytes split evenly (the native even collective: the
          floor an uneven method would hope for; on gloo the all-to-all route can beat it)
all-gather (every rank ends with every segment)
  a2a     `Comm.all_gather_v`: one in-place broadcast per owner (the column keeps its name)
  padded  own segment padded to the longest, `all_gather_into_tensor`, unpack
  even    `all_gather_into_tensor` of even segments (the floor)

Times are the median over repeats of the slowest rank (a barrier before each repeat); packing
and unpacking copies count. Each method's result is checked against the a2a method's.

Run: python3 benchmarks/bench_comm.py [--sizes 1,4,16] [--split 0.3] [--repeats 7]   (about a minute)
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
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from canzona.harness.launch import run_ranks  # noqa: E402
from canzona.reductions import EXACT, LOOPS  # noqa: E402
from canzona.runtime.comm import Comm  # noqa: E402

WARMUP = 2
# torch >= 2.13 names (the *_tensor names are deprecated aliases of the same collectives)
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _cuts(n: int, split: float, world: int) -> list[int]:
    """First segment `split` of the buffer, the rest shared evenly by the other ranks."""
    first = int(n * split)
    rest = n - first
    cuts = [0, first]
    for r in range(1, world):
        cuts.append(first + rest * r // (world - 1))
    return cuts


def _timed(fn, repeats: int) -> tuple[list[float], torch.Tensor]:
    out = None
    runs = []
    for i in range(WARMUP + repeats):
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        if i >= WARMUP:
            runs.append(dt)
    return runs, out


def worker(rank: int, world: int, sizes: list[int], split: float, repeats: int) -> list[dict]:
    # each column on the route it names: the default (`native`) routes an uneven split to the loop
    comm, loops = Comm(None, 120.0, reduce_scatter=EXACT), Comm(None, 120.0, reduce_scatter=LOOPS)
    return [row for n in sizes for row in _measure(comm, loops, rank, world, n, split, repeats)]


def _measure(comm: Comm, loops: Comm, rank: int, world: int, n: int, split: float, repeats: int) -> list[dict]:
    """Every method on one buffer of `n` floats, in the same order on every rank."""
    results = []
    cuts = _cuts(n, split, world)
    lengths = [b - a for a, b in zip(cuts, cuts[1:])]
    longest = max(lengths)
    a, b = cuts[rank], cuts[rank + 1]
    gen = torch.Generator().manual_seed(1000 + rank)
    source = torch.randn(n, generator=gen)
    flat = source.clone()
    even = n // world

    # --- reduce-scatter ------------------------------------------------------------------
    def rs_a2a():
        flat.copy_(source)  # the method writes in place; start each repeat from the same data
        comm.reduce_scatter_v(flat, cuts, "bench").wait()
        return flat[a:b]

    def rs_loops():
        flat.copy_(source)
        loops.reduce_scatter_v(flat, cuts, "bench").wait()
        return flat[a:b]

    padded_in = torch.zeros(world * longest)
    padded_out = torch.empty(longest)
    result = torch.empty(b - a)

    def rs_padded():
        flat.copy_(source)  # same extra copy as rs_a2a, so the comparison stays fair
        for r in range(world):
            padded_in[r * longest:r * longest + lengths[r]].copy_(flat[cuts[r]:cuts[r + 1]])
        REDUCE_SCATTER(padded_out, padded_in, op=dist.ReduceOp.SUM)
        result.copy_(padded_out[:b - a]).div_(world)
        flat[a:b].copy_(result)
        return flat[a:b]

    even_out = torch.empty(even)

    def rs_even():
        flat.copy_(source)
        REDUCE_SCATTER(even_out, flat[:even * world], op=dist.ReduceOp.SUM)
        flat[rank * even:(rank + 1) * even].copy_(even_out.div_(world))
        return flat[rank * even:(rank + 1) * even]

    # --- all-gather ----------------------------------------------------------------------
    def ag_a2a():
        comm.all_gather_v(flat, cuts, "bench").wait()
        return flat

    ag_in = torch.zeros(longest)
    ag_out = torch.empty(world * longest)

    def ag_padded():
        ag_in[:b - a].copy_(flat[a:b])
        ALL_GATHER(ag_out, ag_in)
        for r in range(world):
            flat[cuts[r]:cuts[r + 1]].copy_(ag_out[r * longest:r * longest + lengths[r]])
        return flat

    ag_even_out = torch.empty(even * world)

    def ag_even():
        ALL_GATHER(ag_even_out, flat[rank * even:(rank + 1) * even])
        flat[:even * world].copy_(ag_even_out)
        return flat

    want = {}
    for op, method, fn in (("reduce-scatter", "a2a", rs_a2a), ("reduce-scatter", "loops", rs_loops),
                           ("reduce-scatter", "padded", rs_padded),
                           ("reduce-scatter", "even", rs_even), ("all-gather", "a2a", ag_a2a),
                           ("all-gather", "padded", ag_padded), ("all-gather", "even", ag_even)):
        if op == "all-gather":
            flat.copy_(source)  # every rank gathers the others' original segments
        runs, out = _timed(fn, repeats)
        out = out.clone()
        if method == "a2a":
            want[op] = out
        # loops sums in the backend's order: equal within rounding (bit for bit at 2 ranks)
        same = (None if method == "even" else bool(torch.allclose(out, want[op], rtol=1e-6, atol=1e-7))
                if method == "loops" else bool(torch.equal(out, want[op])))
        results.append({"n": n, "op": op, "method": method, "runs": runs, "same": same})
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,4,16", help="buffer sizes in millions of fp32 elements")
    ap.add_argument("--split", type=float, default=0.3, help="share of the buffer in rank 0's segment")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    if not 0 < args.split < 1:
        print("error: --split must be in (0, 1)", file=sys.stderr)
        return 2
    sizes = [int(float(s) * 2**20) for s in args.sizes.split(",")]
    t0 = time.perf_counter()
    per_rank = run_ranks(worker, args.world, sizes, args.split, args.repeats, deadline_s=1200.0)
    wall = time.perf_counter() - t0

    # slowest rank per repeat, then the median over repeats
    table: dict[tuple[int, str, str], float] = {}
    same: dict[tuple[int, str, str], bool | None] = {}
    for i, row in enumerate(per_rank[0]):
        key = (row["n"], row["op"], row["method"])
        slowest = [max(r[i]["runs"][k] for r in per_rank) for k in range(len(row["runs"]))]
        table[key] = statistics.median(slowest)
        same[key] = all(r[i]["same"] for r in per_rank) if row["same"] is not None else None

    split = f"{args.split * 100:.0f}/{(1 - args.split) * 100:.0f}" if args.world == 2 else f"{args.split:.2f} + even"
    t = Table(title=f"Uneven collectives on gloo, {args.world} spawned ranks, split {split}, "
                    f"torch {torch.__version__} (median of {args.repeats}, slowest rank)")
    for col in ("floats", "MB", "collective", "a2a ms", "loops ms", "padded ms", "even ms", "loops / a2a",
                "padded / a2a", "a2a / even", "padded same"):
        t.add_column(col, justify="left" if col == "collective" else "right")
    verdicts = []
    for n in sizes:
        for op in ("reduce-scatter", "all-gather"):
            a2a, padded, even = (table[(n, op, m)] for m in ("a2a", "padded", "even"))
            verdicts.append(a2a <= padded)
            lp = table.get((n, op, "loops"))  # all-gather's a2a column is already a broadcast loop
            if lp is not None and not same[(n, op, "loops")]:
                raise SystemExit(f"error: loops reduce-scatter differs from a2a beyond rounding at {n} floats")
            t.add_row(f"{n / 2**20:g}M", f"{n * 4 / 2**20:.0f}", op, f"{a2a * 1e3:.2f}",
                      f"{lp * 1e3:.2f}" if lp else "-", f"{padded * 1e3:.2f}", f"{even * 1e3:.2f}",
                      f"{lp / a2a:.2f}x" if lp else "-", f"{padded / a2a:.2f}x", f"{a2a / even:.2f}x",
                      "yes" if same[(n, op, "padded")] else "[bold red]NO[/]")
    t.caption = ("a2a: canzona.runtime.comm (reduce-scatter: reduce_scatter=\"exact\", all_to_all_single + ordered "
                 "local sum; all-gather: "
                 "an in-place broadcast per owner); loops: reduce_scatter=\"loops\", one reduce per owner "
                 "(its gain is NIC spread across nodes, which one machine cannot show); padded: segments "
                 "padded to the longest, reduce_scatter_tensor / all_gather_into_tensor; even: the same "
                 "bytes split evenly through the native collective. padded / a2a > 1: canzona's route is faster. "
                 "'padded same': padded result equals the a2a result bit for bit.")
    console = Console(width=140)
    console.print(t)
    console.print(f"canzona's collectives no slower than padding in {sum(verdicts)} of {len(verdicts)} cases "
                  f"(wall {wall:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
