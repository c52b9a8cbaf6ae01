"""Seconds of one GEMM from its shape and dtype (docs/design.md §4.3): tiles, waves, split-K, a
per-tile fixed cost and the HBM roofline.

A cuBLAS / cuBLASLt GEMM on a GPU of `sms` streaming multiprocessors cuts its `M x N` output into
tiles of one of a few shapes (the kernel's CTA tile: 128 x 256, 256 x 128, 128 x 128, 64 x 256, ...
on Hopper), runs the tiles in whole waves over the SMs (a partial wave costs a full one: NVIDIA's
Matrix Multiplication Background guide, "wave quantization"), and may split the depth `K` of each
tile into `s` slices (split-K) to fill more SMs, paying for the fp32 partial sums it writes and
reads back. Each SM computes its tile at the sustained tensor-core rate (`rate / sms`: the rate
under the power limit, below the datasheet peak). Every tile also moves bytes that its main loop
does not hide, in proportion to the tile's area and independent of `K`: draining the finished
output tile to memory (the epilogue) and refilling the operand pipeline for the next tile
(`tile_fixed_bytes` an output element, at the HBM bandwidth). A short-`K` GEMM therefore loses
efficiency, and a faster memory (H200) loses less. The library picks the fastest tile and split,
so the model does too: the minimum over candidates, each of which grows with every dimension, so
time never falls as a dimension grows.

The parameters live in the hardware profile (`gemm_model` section, with their sources); without
one, a profile keeps the former model: square `gpu.gemm_tile` tiles and no per-tile cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from canzona.errors import SpecError

SPLITS = (1, 2, 4, 8, 16)  # split-K slices tried (cuBLAS's split-K kernels use small powers of two)
PARTIAL_BYTES = 4  # an fp32 partial sum, written once and read back once per extra slice
MAX_TILE = 1024  # a CTA tile edge beyond this is not a GPU kernel
MAX_FIXED_BYTES = 1024  # a tile's unhidden traffic an output element: tens of bytes at most


@dataclass(frozen=True, kw_only=True)
class GemmModel:
    """Tile candidates and the per-tile fixed cost of one device's GEMM kernels.

    `tiles`: (rows, cols) of the output tile of each kernel the library chooses among;
    `tile_fixed_bytes`: HBM bytes an output element of every tile moves outside the main loop
    (epilogue and pipeline refill), paid at the HBM bandwidth."""

    tiles: tuple[tuple[int, int], ...]
    tile_fixed_bytes: float = 0.0

    def seconds(self, m: int, n: int, k: int, rate: float, sms: int, nbytes: float, hbm_bytes_per_s: float) -> float:
        """Seconds of one `m x n x k` GEMM moving `nbytes` (operands and output) at a sustained
        whole-GPU tensor rate `rate` FLOP/s: the fastest (tile, split) candidate, each the
        larger of its compute time and its HBM time."""
        per_sm = rate / sms
        best = math.inf
        for tm, tn in self.tiles:
            tiles = -(-m // tm) * -(-n // tn)
            for split in SPLITS:
                waves = -(-(tiles * split) // sms)
                depth = -(-k // split)
                fixed = tiles * split * tm * tn * self.tile_fixed_bytes / hbm_bytes_per_s
                compute = waves * 2.0 * tm * tn * depth / per_sm + fixed
                memory = (nbytes + 2 * PARTIAL_BYTES * (split - 1) * m * n) / hbm_bytes_per_s
                best = min(best, max(compute, memory))
        return best


def square(tile: int) -> GemmModel:
    """The model of a profile without a `gemm_model` section: one square tile, no fixed cost."""
    return GemmModel(tiles=((tile, tile),), tile_fixed_bytes=0.0)


def parse_gemm_model(raw: Any, where: str) -> GemmModel:
    """A profile's optional `gemm_model`: {"tiles": [[rows, cols], ...], "tile_fixed_bytes": b}."""
    if not isinstance(raw, dict) or set(raw) - {"tiles", "tile_fixed_bytes"} or "tiles" not in raw:
        raise SpecError(f"{where}: gemm_model must be an object with tiles ([[rows, cols], ...]) and "
                        "optionally tile_fixed_bytes (bytes an output element)")
    tiles = raw["tiles"]
    ok = isinstance(tiles, list) and tiles and all(
        isinstance(t, list) and len(t) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= MAX_TILE for x in t)
        for t in tiles)
    if not ok:
        raise SpecError(f"{where}: gemm_model.tiles must be a non-empty list of [rows, cols] whole numbers "
                        f"in 1..{MAX_TILE}")
    fixed = raw.get("tile_fixed_bytes", 0.0)
    if isinstance(fixed, bool) or not isinstance(fixed, (int, float)) or not 0 <= fixed <= MAX_FIXED_BYTES:
        raise SpecError(f"{where}: gemm_model.tile_fixed_bytes must be bytes in [0, {MAX_FIXED_BYTES}], got {fixed!r}")
    return GemmModel(tiles=tuple((int(a), int(b)) for a, b in tiles), tile_fixed_bytes=float(fixed))


MEASUREMENTS = "gemm_measurements.json"  # canzona/data: published GEMM throughput by shape


def measurements() -> list[dict[str, Any]]:
    """The published GEMM measurements (canzona/data/gemm_measurements.json), each row with its
    source's citation under `cite`."""
    import json
    from importlib import resources

    data = json.loads((resources.files("canzona") / "data" / MEASUREMENTS).read_text())
    return [dict(row, cite=data["sources"][row["source"]]) for row in data["rows"]]


def model_tflops(row: dict[str, Any]) -> float:
    """TFLOP/s the row's profile's GEMM model gives its shape (the kernel alone, no launch: the
    benchmarks time GEMMs back to back, which hides the launch)."""
    from canzona.cost import DeviceRate, gemm_kernel
    from canzona.hardware import load_profile

    rate = DeviceRate.from_profile(load_profile(row["profile"]))
    k = gemm_kernel("row", row["M"], row["N"], row["K"], row["dtype"])
    return k.flops / rate._gemm_seconds(k) / 1e12


def main() -> None:
    """Print each measured row beside the model (`python -m canzona.gemm_model`)."""
    print(f"{'profile':9} {'dtype':5} {'M':>6} {'N':>6} {'K':>6} {'measured':>9} {'model':>7} {'error':>7}  regime  use")
    for row in measurements():
        if row["profile"] is None:
            continue
        got = model_tflops(row)
        print(f"{row['profile']:9} {row['dtype']:5} {row['M']:6} {row['N']:6} {row['K']:6} {row['tflops']:9.1f} "
              f"{got:7.1f} {got / row['tflops'] - 1:+7.1%}  {row['regime']:7} {row['use']}")


if __name__ == "__main__":
    main()
