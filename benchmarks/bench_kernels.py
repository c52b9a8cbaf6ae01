"""Per-matrix optimizer kernel time for Qwen3 shapes on the local device: the seed of calibration.

For each distinct matrix shape of a catalog model and each matrix optimizer, time one steady-state
step of the runtime kernel (`canzona.runtime.kernels`) plus its apply, median of a few repeats, and
print it beside the analytic cost model's prediction for the H100 profile. `--out table.json` writes
the measurements as `[optimizer, m, n, dtype, seconds]` rows, the format `TableCost` reads.

Run: python3 benchmarks/bench_kernels.py [--model qwen3-0.6b] [--device cpu|cuda] [--repeats 3]
(on CPU the default model's shapes take about a minute; qwen3-32b shapes want a GPU)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

from canzona.catalog import get_model
from canzona.cost import AnalyticCost
from canzona.optimizers import default_config
from canzona.runtime.kernels import MATRIX_KERNELS, apply_update_

DTYPE_KEYS = {"muon": "ns_dtype", "soap": "compute_dtype", "shampoo": "compute_dtype"}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(optimizer: str, shape: tuple[int, int], device: torch.device, repeats: int) -> float:
    """Median seconds of one steady-state step (state already initialised)."""
    cfg = default_config(optimizer)
    kernel = MATRIX_KERNELS[optimizer]
    gen = torch.Generator(device=device).manual_seed(0)
    param = torch.randn(shape, device=device, generator=gen)
    grad = torch.randn(shape, device=device, generator=gen)
    state: dict = {}
    for _ in range(2):  # initialise state (SOAP's first call) and warm up
        update = kernel(grad, state, cfg, 1e-3)
        if update is not None:
            apply_update_(param, update.direction, update)
    runs = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        update = kernel(grad, state, cfg, 1e-3)
        apply_update_(param, update.direction, update)
        sync(device)
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--optimizers", default="muon,soap,shampoo")
    ap.add_argument("--out", default=None, help="write a measured table (TableCost format) here")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    shapes = sorted({p.shape for p in get_model(args.model).matrix_params()})
    analytic = AnalyticCost()
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    t = Table(title=f"Kernel step time: {args.model} shapes on {device_name}, torch {torch.__version__}")
    for col in ("optimizer", "shape", "dtype", "measured ms", "analytic H100 ms", "measured / analytic"):
        t.add_column(col, justify="right" if "ms" in col or "/" in col else "left")
    rows = []
    for optimizer in args.optimizers.split(","):
        dtype = getattr(default_config(optimizer), DTYPE_KEYS[optimizer])
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


if __name__ == "__main__":
    sys.exit(main())
