"""The published GEMM measurements the GEMM model is fitted to and checked against
(canzona/data/gemm_measurements.json, docs/design.md §4.3), and the model beside them:
`python -m canzona.gemm_measurements` prints every row with the model's TFLOP/s and its error.

A row gives one shape (`M`, `N`, `K`), or, where its source published only the best of several
shapes it timed (a benchmark that prints the maximum TFLOP/s over a list of sizes), every shape
it timed under `best_of`: the model's figure for such a row is its best over the same shapes.
A row with `groups` is an M-grouped GEMM (a mixture-of-experts layer's experts): `groups` GEMMs of
`M x N x K` each in one launch, priced as the simulator prices the experts' GEMMs
(`canzona.cost.grouped_gemm_kernel`), its TFLOP/s over all the groups' FLOPs."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from canzona.cost import DeviceRate, Kernel, gemm_kernel, grouped_gemm_kernel
from canzona.gemm_model import loop_mean_seconds
from canzona.hardware import load_profile
from canzona.spec import DTYPE_BYTES

MEASUREMENTS = "gemm_measurements.json"  # canzona/data: published GEMM throughput by shape


def measurements() -> list[dict[str, Any]]:
    """The published GEMM measurements (canzona/data/gemm_measurements.json), each row with its
    source's citation under `cite` and its benchmark loop under `protocol` (None: not known)."""
    data = json.loads((resources.files("canzona") / "data" / MEASUREMENTS).read_text())
    protocols = data.get("protocols", {})
    return [dict(row, cite=data["sources"][row["source"]], protocol=protocols.get(row["source"]))
            for row in data["rows"]]


def shapes(row: dict[str, Any]) -> list[tuple[int, int, int]]:
    """The (M, N, K) shapes a row's figure was taken over: its one shape, or every shape of its
    `best_of` list (the figure is the best of them)."""
    if "best_of" in row:
        return [(int(m), int(n), int(k)) for m, n, k in row["best_of"]]
    return [(int(row["M"]), int(row["N"]), int(row["K"]))]


def shape_label(row: dict[str, Any]) -> str:
    """`MxNxK`; for a row over several shapes `best of A^3..B^3` (squares) or `best of n shapes`."""
    found = shapes(row)
    if len(found) == 1:
        one = "x".join(str(d) for d in found[0])
        return f"{row['groups']}x({one})" if "groups" in row else one
    if all(m == n == k for m, n, k in found):
        return f"best of {found[0][0]}^3..{found[-1][0]}^3"
    return f"best of {len(found)} shapes"


def _boost_seconds(rate: DeviceRate, k: Kernel) -> float:
    """One GEMM at the boost clock (a cool GPU), launch included."""
    assert rate.gemm_model is not None and rate.sms is not None and k.gemm is not None
    m, n, depth = k.gemm
    return rate.gemm_model.seconds(m, n, depth, rate.gemm_flops[k.dtype], rate.sms, k.bytes, rate.hbm_bytes_per_s,
                                   DTYPE_BYTES[k.dtype], boost=True) + rate.launch_s


def model_tflops(row: dict[str, Any]) -> float:
    """TFLOP/s the row's profile's GEMM model gives its shape as the row's benchmark ran it,
    launch included (a `best_of` row: the best over its shapes, as its source reported). Sustained load (what the simulator charges, `DeviceRate.kernel_seconds`)
    unless the source's loop (`protocol`: warmup and timed calls) is short enough to run partly
    at the boost clock (`GemmModel.boost_window_s`), or the row's inputs kept the board under its
    power limit (`clock` "boost": all-zero inputs), which runs every call at the boost clock."""
    rate = DeviceRate.from_profile(load_profile(row["profile"]))
    return max(_shape_tflops(row, rate, m, n, depth) for m, n, depth in shapes(row))


def _shape_tflops(row: dict[str, Any], rate: DeviceRate, m: int, n: int, depth: int) -> float:
    """`model_tflops` of one shape of the row."""
    groups = int(row.get("groups", 1))
    k = (grouped_gemm_kernel("row", m, n, depth, groups, row["dtype"]) if groups > 1
         else gemm_kernel("row", m, n, depth, row["dtype"]))
    seconds = rate.kernel_seconds(k)
    protocol = row.get("protocol")
    model = rate.gemm_model
    if row.get("clock") == "boost" and model is not None and rate.sms is not None:
        seconds = _boost_seconds(rate, k)
    elif protocol is not None and model is not None and model.sustained_clock < 1.0 and rate.sms is not None:
        seconds = loop_mean_seconds(_boost_seconds(rate, k), seconds, model.boost_window_s,
                                    protocol["warmup"], protocol["iters"])
    return k.flops / seconds / 1e12


def main() -> None:
    """Print each measured row beside the model (`python -m canzona.gemm_measurements`)."""
    print(f"{'profile':9} {'dtype':5} {'M x N x K':>20} {'measured':>9} {'model':>7} {'error':>7}  regime  use")
    for row in measurements():
        if row["profile"] is None:
            continue
        got = model_tflops(row)
        print(f"{row['profile']:9} {row['dtype']:5} {shape_label(row):>20} {row['tflops']:9.1f} "
              f"{got:7.1f} {got / row['tflops'] - 1:+7.1%}  {row['regime']:7} {row['use']}")


if __name__ == "__main__":
    main()
