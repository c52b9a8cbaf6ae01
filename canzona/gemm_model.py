"""Seconds of one GEMM from its shape and dtype (docs/design.md §4.3): tiles, waves, split-K, the
operand feed, a per-tile and a per-GEMM fixed cost, and the HBM roofline.

A cuBLAS / cuBLASLt GEMM on a GPU of `sms` streaming multiprocessors cuts its `M x N` output into
tiles of one of a few shapes (the kernel's CTA tile: 128 x 256, 256 x 128, 128 x 192, 128 x 128
on Hopper), runs the tiles in whole waves over the SMs (a partial wave costs a full one: NVIDIA's
Matrix Multiplication Background guide, "wave quantization"), and may split the depth `K` of each
tile into `s` slices (split-K) to fill more SMs, paying for the fp32 partial sums it writes and
reads back. Each SM computes its tile at its share of the tensor-core rate (`rate / sms` at the
boost clock, times `sustained_clock` once the board's power limit has slowed the clock, as it has
all through a training step), unless the L2 cache cannot feed the operands of
all the wave's tiles that fast: a wave moves `(tm + tn) x K` operand elements a tile through L2,
so small tiles (less reuse) and low-precision operands are fed, not computed, at the limit.
Every tile also moves bytes its main loop does not hide, in proportion to its area and
independent of `K`: draining the finished output tile (the epilogue) and refilling the operand
pipeline (`tile_fixed_bytes` an output element, at the HBM bandwidth); and each GEMM pays a fixed
latency (`fixed_s`: the first fill and the last drain, which nothing overlaps). A GEMM that adds
into its output (`C += A B`, beta = 1: Megatron's weight gradients accumulating into `main_grad`)
moves more in its epilogue than the fitted bf16-output GEMMs did: it reads `C` and writes `D` at
the accumulator's dtype instead of writing a bf16 `D`, `epilogue_bytes` more an output element,
priced like the rest of the epilogue (unhidden, at the HBM bandwidth). A short-`K` or
small GEMM therefore loses efficiency, and a faster memory (H200) loses less. The library picks
the fastest tile and split, so the model does too: the minimum over candidates, each of which
grows with every dimension, so time never falls as a dimension grows.

The parameters live in the hardware profile (`gemm_model` section, with their sources); without
one, a profile keeps the former model: square `gpu.gemm_tile` tiles, split-K up to 16, no feed
limit and no fixed cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from canzona.errors import SpecError

SPLITS = (1, 2, 4, 8, 16)  # split-K slices of the former model (small powers of two)
PARTIAL_BYTES = 4  # an fp32 partial sum, written once and read back once per extra slice
MAX_TILE = 1024  # a CTA tile edge beyond this is not a GPU kernel
MAX_FIXED_BYTES = 1024  # a tile's unhidden traffic an output element: tens of bytes at most
MAX_FIXED_S = 1e-3  # a GEMM's fixed latency: microseconds, never milliseconds
MIN_CLOCK = 0.3  # a sustained clock below 30% of boost is not a power limit but a fault
MAX_WINDOW_S = 10.0  # the power controller's boost window: milliseconds, never minutes


@dataclass(frozen=True, kw_only=True)
class GemmModel:
    """One device's GEMM kernels.

    `tiles`: (rows, cols) of the output tile of each kernel the library chooses among; `splits`:
    the split-K slice counts it may use; `l2_bytes_per_s`: the rate at which L2 feeds operands to
    all SMs together (0: no limit); `tile_fixed_bytes`: HBM bytes an output element of every tile
    moves outside the main loop (epilogue and pipeline refill); `fixed_s`: seconds every GEMM pays
    once (its first fill and last drain); `sustained_clock`: the fraction of the boost clock the SMs
    and L2 keep under the board power limit once a GEMM stream has run `boost_window_s` seconds
    (the rate a training iteration, GEMMs back to back for seconds, gets: docs/design.md §4.3;
    1.0: no power limit modelled). `rate` and `l2_bytes_per_s` are the boost-clock figures."""

    tiles: tuple[tuple[int, int], ...]
    splits: tuple[int, ...] = SPLITS
    l2_bytes_per_s: float = 0.0
    tile_fixed_bytes: float = 0.0
    fixed_s: float = 0.0
    sustained_clock: float = 1.0
    boost_window_s: float = 0.0

    def seconds(self, m: int, n: int, k: int, rate: float, sms: int, nbytes: float, hbm_bytes_per_s: float,
                operand_bytes: int, *, boost: bool = False, epilogue_bytes: float = 0.0,
                chunks: int = 1, at_once: int = 1) -> float:
        """Seconds of one `m x n x k` GEMM of `operand_bytes`-byte inputs moving `nbytes`
        (operands and output) at a boost-clock whole-GPU tensor rate `rate` FLOP/s: the fastest
        (tile, split) candidate, each the larger of its compute time and its HBM time, plus the
        fixed latency. The SMs and L2 run at `sustained_clock` x boost (the power-limited clock of
        sustained load, which a training step is) unless `boost` (a short burst on a cool GPU);
        HBM does not slow with the SM clock. `epilogue_bytes`: what each output element's
        epilogue moves beyond a bf16 output's (an accumulating GEMM: the module docstring), once
        a tile (after its split-K slices are reduced). `chunks`: `m x n x k` is one of that many
        same-shape GEMMs (`nbytes` all of theirs) issued on `at_once` streams (Transformer Engine's
        userbuffers chunks): their tiles fill the waves together, at most `at_once` chunks' tiles
        in a wave, and each `at_once` of them pays the fixed latency."""
        clock = 1.0 if boost else self.sustained_clock
        per_sm = clock * rate / sms
        best = math.inf
        for tm, tn in self.tiles:
            per_chunk = -(-m // tm) * -(-n // tn)
            tiles = per_chunk * chunks
            for split in self.splits:
                depth = -(-k // split)
                wide = min(sms, at_once * per_chunk * split)  # the most tiles a wave holds
                full, last = divmod(tiles * split, wide)
                compute = full * self._wave(tm, tn, depth, wide, per_sm, operand_bytes, clock)
                if last:
                    compute += self._wave(tm, tn, depth, last, per_sm, operand_bytes, clock)
                compute += tiles * tm * tn * (split * self.tile_fixed_bytes + epilogue_bytes) / hbm_bytes_per_s
                memory = (nbytes + 2 * PARTIAL_BYTES * (split - 1) * m * n * chunks) / hbm_bytes_per_s
                best = min(best, max(compute, memory))
        return best + self.fixed_s * -(-chunks // at_once)

    def _wave(self, tm: int, tn: int, depth: int, active: int, per_sm: float, operand_bytes: int,
              clock: float) -> float:
        """One wave of `active` tiles: each SM's tensor time, or L2's time to feed every tile's
        operands when that is longer (both grow with `active` and `depth`; L2 runs at `clock` x its
        boost-clock rate)."""
        compute = 2.0 * tm * tn * depth / per_sm
        if not self.l2_bytes_per_s:
            return compute
        return max(compute, active * (tm + tn) * operand_bytes * depth / (clock * self.l2_bytes_per_s))


def loop_mean_seconds(boost_s: float, sustained_s: float, window_s: float, warmup: int, iters: int) -> float:
    """Mean seconds of the `iters` timed calls of a benchmark loop that runs `warmup` untimed calls
    first, back to back from a cool GPU: calls run at the boost clock for the power controller's
    `window_s` seconds of load, then at the sustained (power-limited) clock."""
    at_boost = min(max(window_s / boost_s - warmup, 0.0), float(iters))  # timed calls before the limit bites
    return (at_boost * boost_s + (iters - at_boost) * sustained_s) / iters


def sustained_seconds(measured_s: float, clock: float, window_s: float, warmup: int, iters: int) -> float:
    """Seconds one call takes under sustained load (the power-limited clock, `clock` x boost) when a
    benchmark loop of `warmup` untimed then `iters` timed calls from a cool GPU measured a mean of
    `measured_s` (`loop_mean_seconds` solved for the call's boost-clock seconds; a call's time
    scales as 1 / clock, as a tensor-core-bound kernel's does)."""
    if clock >= 1.0:
        return measured_s
    lo, hi = measured_s * clock, measured_s  # all calls sustained .. all at boost
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if loop_mean_seconds(mid, mid / clock, window_s, warmup, iters) < measured_s:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi) / clock


def square(tile: int) -> GemmModel:
    """The model of a profile without a `gemm_model` section: one square tile, split-K, no fixed cost."""
    return GemmModel(tiles=((tile, tile),))


KEYS = ("tiles", "splits", "l2_bytes_per_s", "tile_fixed_bytes", "fixed_s", "sustained_clock", "boost_window_s")


def parse_gemm_model(raw: Any, where: str) -> GemmModel:
    """A profile's optional `gemm_model`: {"tiles": [[rows, cols], ...], "splits": [1, ...],
    "l2_bytes_per_s": bw, "tile_fixed_bytes": b, "fixed_s": s, "sustained_clock": c,
    "boost_window_s": w} (all but tiles optional)."""
    if not isinstance(raw, dict) or set(raw) - set(KEYS) or "tiles" not in raw:
        raise SpecError(f"{where}: gemm_model must be an object with tiles ([[rows, cols], ...]) and optionally "
                        "splits ([1, 2, ...]), l2_bytes_per_s, tile_fixed_bytes (bytes an output element) and "
                        "fixed_s (seconds), sustained_clock (fraction of boost) and boost_window_s (seconds)")

    def whole(x: Any, hi: int) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= hi

    tiles = raw["tiles"]
    if not (isinstance(tiles, list) and tiles
            and all(isinstance(t, list) and len(t) == 2 and all(whole(x, MAX_TILE) for x in t) for t in tiles)):
        raise SpecError(f"{where}: gemm_model.tiles must be a non-empty list of [rows, cols] whole numbers "
                        f"in 1..{MAX_TILE}")
    splits = raw.get("splits", list(SPLITS))
    if not (isinstance(splits, list) and splits and all(whole(x, 64) for x in splits)):
        raise SpecError(f"{where}: gemm_model.splits must be a non-empty list of whole numbers in 1..64")

    def number(key: str, hi: float, lo: float = 0.0, default: float = 0.0) -> float:
        v = raw.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
            raise SpecError(f"{where}: gemm_model.{key} must be a number in [{lo:g}, {hi:g}], got {v!r}")
        return float(v)

    return GemmModel(tiles=tuple((int(a), int(b)) for a, b in tiles), splits=tuple(int(x) for x in splits),
                     l2_bytes_per_s=number("l2_bytes_per_s", 1e15),
                     tile_fixed_bytes=number("tile_fixed_bytes", MAX_FIXED_BYTES),
                     fixed_s=number("fixed_s", MAX_FIXED_S),
                     sustained_clock=number("sustained_clock", 1.0, MIN_CLOCK, 1.0),
                     boost_window_s=number("boost_window_s", MAX_WINDOW_S))

