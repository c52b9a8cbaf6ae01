"""Per-matrix optimizer kernel time for Qwen3 shapes on the local device, beside the H100 roofline.

For each distinct matrix shape of a catalog model and each matrix optimizer, time one steady-state
step of the runtime kernel (`canzona.runtime.kernels`) plus its apply, median of a few repeats
(`canzona.runtime.calibrate.time_step`, which `canzona calibrate` uses too), and print it beside the
analytic cost model's prediction for the H100 profile. `--out table.json` writes
the measurements as `[optimizer, m, n, dtype, seconds]` rows, the format `TableCost` reads.

Run: python3 benchmarks/bench_kernels.py [--model qwen3-0.6b] [--device cpu|cuda] [--repeats 3]
(on CPU the default model's shapes take about a minute; qwen3-32b shapes want a GPU)
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from rich.console import Console
from rich.table import Table

from canzona.catalog import get_model
from canzona.cost import AnalyticCost, step_dtype
from canzona.runtime.calibrate import time_step  # the one timing definition (`canzona calibrate`)


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


if __name__ == "__main__":
    sys.exit(main())
