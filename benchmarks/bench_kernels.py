"""Optimizer kernel time on the local device: per matrix beside the H100 roofline, or batched.

For each distinct matrix shape of a catalog model and each matrix optimizer, time one steady-state
step of the runtime kernel (`canzona.runtime.kernels`) plus its apply, median of a few repeats
(`canzona.harness.calibrate.time_step`, which `canzona calibrate` uses too), and print it beside the
analytic cost model's prediction for the H100 profile. `--out table.json` writes
the measurements as `[optimizer, m, n, dtype, seconds]` rows, the format `TableCost` reads.

`--batched`: for a few (shape, k) combinations, k same-shape matrices orthogonalised one
`newton_schulz` call each against one `newton_schulz_batched` call (`canzona.runtime.batched`,
what `batch_kernels=True` runs), in fp32 on CPU and bf16 on CUDA. Rounds are interleaved (each
round times every combination both ways, in an order alternated each round), so load from other
processes hits both alike; printed: medians and per-matrix / batched ratios (above 1: batching is
faster), and whether the two results are bit-identical.

Run: python3 benchmarks/bench_kernels.py [--model qwen3-0.6b] [--device cpu|cuda] [--repeats 3]
(on CPU the default model's shapes take about a minute; qwen3-32b shapes want a GPU)
     python3 benchmarks/bench_kernels.py --batched [--device cpu|cuda] [--rounds 15] [--warmup 2] [--threads N]
(about a minute on CPU)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmark this checkout
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from canzona.catalog import get_model  # noqa: E402
from canzona.cost import AnalyticCost, step_dtype  # noqa: E402
from canzona.harness.calibrate import time_step  # noqa: E402 - the one timing definition (`canzona calibrate`)
from canzona.optimizers import MATRIX_OPTIMIZERS, MuonConfig  # noqa: E402
from canzona.runtime.batched import newton_schulz_batched  # noqa: E402
from canzona.runtime.kernels import newton_schulz  # noqa: E402

# (rows, cols, k): many small matrices (launch- and dispatch-bound), mid-size, tall and wide
BATCHED_CASES = {
    "cpu": [(32, 32, 32), (64, 64, 16), (128, 128, 8), (7, 300, 8), (256, 256, 4), (512, 128, 4), (128, 512, 4)],
    "cuda": [(64, 64, 64), (128, 128, 32), (256, 256, 16), (1024, 1024, 8), (4096, 1024, 4), (1024, 4096, 4),
             (4096, 4096, 2)],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--optimizers", default=",".join(MATRIX_OPTIMIZERS))
    ap.add_argument("--out", default=None, help="write a measured table (TableCost format) here")
    ap.add_argument("--batched", action="store_true", help="per-matrix against batched Newton-Schulz instead")
    ap.add_argument("--rounds", type=int, default=15, help="--batched: measured rounds")
    ap.add_argument("--warmup", type=int, default=2, help="--batched: rounds before measuring")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.batched:
        return batched_main(device, args.rounds, args.warmup)
    torch.manual_seed(0)
    shapes = sorted({p.shape for p in get_model(args.model).matrix_params()})
    analytic = AnalyticCost()
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    t = Table(title=f"Kernel step time: {args.model} shapes on {device_name}, torch {torch.__version__}")
    for col in ("optimizer", "shape", "dtype", "measured ms", "analytic H100 ms", "measured / analytic"):
        t.add_column(col, justify="right" if "ms" in col or "/" in col else "left")
    rows = []
    for optimizer in args.optimizers.split(","):
        dtype = step_dtype(optimizer)
        for shape in shapes:
            seconds = time_step(optimizer, shape, device, args.repeats)
            predicted = analytic.seconds(optimizer, shape)
            rows.append([optimizer, shape[0], shape[1], dtype, seconds])
            t.add_row(optimizer, f"{shape[0]}x{shape[1]}", dtype, f"{seconds * 1e3:.2f}",
                      f"{predicted * 1e3:.3f}", f"{seconds / predicted:.1f}x")
    Console(width=140).print(t)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device_name, "torch": torch.__version__, "model": args.model,
                       "rows": rows}, f, indent=1)
        print(f"measured table written to {args.out}")
    return 0


def _seconds(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def batched_main(device: torch.device, rounds: int, warmup: int) -> int:
    """Per-matrix against batched Newton-Schulz, interleaved rounds, medians and ratios."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = MuonConfig()
    args = (cfg.ns_coefficients, cfg.ns_steps, cfg.eps, dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    cases = BATCHED_CASES["cuda" if device.type == "cuda" else "cpu"]
    inputs = {c: [torch.randn(c[:2], device=device, generator=gen) for _ in range(c[2])] for c in cases}
    ways: dict[str, Callable[[list[torch.Tensor]], object]] = {
        "per-matrix": lambda us: [newton_schulz(u, *args) for u in us],
        "batched": lambda us: newton_schulz_batched(us, *args),
    }
    times: dict[tuple, dict[str, list[float]]] = {c: {w: [] for w in ways} for c in cases}
    for r in range(warmup + rounds):
        for c in cases:
            order = list(ways) if r % 2 == 0 else list(reversed(ways))  # neither always goes first
            for way in order:
                t = _seconds(lambda way=way, c=c: ways[way](inputs[c]), device)
                if r >= warmup:
                    times[c][way].append(t)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    table = Table(title=f"Newton-Schulz ({cfg.ns_steps} steps, {str(dtype).removeprefix('torch.')}): k matrices one "
                        f"call each vs one batched call; {name}, torch {torch.__version__}; median of {rounds} "
                        f"interleaved rounds after {warmup}")
    for col in ("shape", "k", "per-matrix ms", "batched ms", "per-matrix / batched", "bit-identical"):
        table.add_column(col, justify="left" if col == "shape" else "right")
    for c in cases:
        one, many = (statistics.median(times[c][w]) for w in ways)
        same = all(torch.equal(a, b) for a, b in zip(ways["per-matrix"](inputs[c]), ways["batched"](inputs[c])))
        table.add_row(f"{c[0]}x{c[1]}", str(c[2]), f"{one * 1e3:.2f}", f"{many * 1e3:.2f}", f"{one / many:.2f}x",
                      "yes" if same else "no")
    Console(width=140).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
