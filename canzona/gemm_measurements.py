"""The published GEMM measurements the GEMM model is fitted to and checked against
(canzona/data/gemm_measurements.json, docs/design.md §4.3), and the model beside them:
`python -m canzona.gemm_measurements` prints every row with the model's TFLOP/s and its error."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from canzona.cost import DeviceRate, gemm_kernel
from canzona.hardware import load_profile

MEASUREMENTS = "gemm_measurements.json"  # canzona/data: published GEMM throughput by shape


def measurements() -> list[dict[str, Any]]:
    """The published GEMM measurements (canzona/data/gemm_measurements.json), each row with its
    source's citation under `cite`."""
    data = json.loads((resources.files("canzona") / "data" / MEASUREMENTS).read_text())
    return [dict(row, cite=data["sources"][row["source"]]) for row in data["rows"]]


def model_tflops(row: dict[str, Any]) -> float:
    """TFLOP/s the row's profile's GEMM model gives its shape, launch included: the seconds the
    simulator charges for that GEMM (`DeviceRate.kernel_seconds`)."""
    rate = DeviceRate.from_profile(load_profile(row["profile"]))
    k = gemm_kernel("row", row["M"], row["N"], row["K"], row["dtype"])
    return k.flops / rate.kernel_seconds(k) / 1e12


def main() -> None:
    """Print each measured row beside the model (`python -m canzona.gemm_measurements`)."""
    print(f"{'profile':9} {'dtype':5} {'M':>6} {'N':>6} {'K':>6} {'measured':>9} {'model':>7} {'error':>7}  regime  use")
    for row in measurements():
        if row["profile"] is None:
            continue
        got = model_tflops(row)
        print(f"{row['profile']:9} {row['dtype']:5} {row['M']:6} {row['N']:6} {row['K']:6} {row['tflops']:9.1f} "
              f"{got:7.1f} {got / row['tflops'] - 1:+7.1%}  {row['regime']:7} {row['use']}")


if __name__ == "__main__":
    main()
