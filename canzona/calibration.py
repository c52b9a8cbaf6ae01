"""Turning calibration measurements into a hardware profile (docs/design.md §4.5): pure and torch-free.

`canzona.harness.calibrate` measures the machine (GEMMs, optimizer steps, solvers, launch overhead,
memory bandwidth, collectives) into a `Measurements`; `assemble_profile` turns those into the JSON
of a `canzona.hardware` profile, starting from a base profile's JSON for whatever was not measured
and saying, in `sources`, how every figure was obtained. The fits live here so that they can be
tested on synthetic data:

- `fit_alpha_beta`: the line `t = alpha + beta * S` through one op's times at one group size;
- `fit_latency`: NCCL's latency model `alpha(op, n) = base + steps(op, n) * step` through the
  alphas of every op and group size;
- `gemm_curve`: the best GEMM rate (the profile's peak) and every point's efficiency against it.
"""

from __future__ import annotations

import copy
import json
import math
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from canzona.errors import CanzonaError
from canzona.fileio import dumps_json, write_text_atomic
from canzona.hardware import (
    COLLECTIVE_OPS,
    LOWEST,
    SCHEMA,
    VERSION,
    bus_factor,
    latency_steps,
    profile_from_dict,
)

DEFAULT_MODEL = "qwen3-0.6b"  # the smallest catalog model: a CPU calibration takes about a minute
MAX_SPAWNED_RANKS = 16  # `--world-size` ranks spawned on one machine, each a process with torch

# (dtype, m, n, k, seconds): one GEMM `(m x k) @ (k x n)`
GemmPoint = tuple[str, int, int, int, float]
# (op, group size, bytes, seconds)
CollectiveRow = tuple[str, int, int, float]


@dataclass
class Measurements:
    """Everything `canzona calibrate` measured, as plain data (no torch)."""

    device: str  # "cpu" or "cuda"
    device_name: str
    hostname: str
    repeats: int
    warmup: int
    gemm_points: list[GemmPoint] = field(default_factory=list)
    optimizer_rows: list[tuple[str, int, int, str, float]] = field(default_factory=list)
    solver_rows: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    launch_s: float | None = None
    copy_bytes: int = 0
    copy_s: float | None = None
    memory_bytes: int | None = None
    sms: int | None = None
    collective_rows: list[CollectiveRow] = field(default_factory=list)
    backend: str = ""
    world_size: int = 1
    local_size: int = 1  # ranks per machine during the collective measurement
    launcher: str = ""  # "spawned" (gloo ranks on this machine) or "torchrun"
    versions: dict[str, str] = field(default_factory=dict)  # torch, python, canzona
    date: str = ""
    command: str = ""
    threads: int | None = None  # torch's CPU threads
    matmul_precision: str = ""  # torch.get_float32_matmul_precision(): "highest" is true fp32 (no TF32)
    model: str | None = None
    shapes: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class CollectiveFit:
    op: str
    group_size: int
    alpha_s: float
    beta_s_per_byte: float
    points: int

    @property
    def busbw(self) -> float:
        """Bus bandwidth (nccl-tests convention): `S * bus_factor / (t - alpha)` on the fitted line."""
        return bus_factor(self.op, self.group_size) / self.beta_s_per_byte


# A fitted line whose size term is less than this share of the time at the largest message reads
# no bandwidth: measure larger messages instead.
MIN_SIZE_SHARE = 0.05


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares line `t = alpha + beta * S`, weighted by 1/t (relative errors, so the small
    messages that fix alpha count as much as the large ones that fix beta), with alpha >= 0.

    Raises `CanzonaError` with fewer than two distinct sizes or when the times do not grow with size,
    or grow so little that the size term is under `MIN_SIZE_SHARE` of the largest message's time (no
    bandwidth can be read from them)."""
    s = np.asarray(sizes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if s.shape != t.shape or len(set(s.tolist())) < 2:
        raise CanzonaError("an alpha-beta fit needs times at two or more message sizes")
    if not (np.all(np.isfinite(t)) and np.all(t > 0) and np.all(s > 0)):
        raise CanzonaError("an alpha-beta fit needs positive sizes and times")
    w = 1.0 / t
    a = np.stack([w, s * w], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if alpha < 0:  # constrained: the line through the origin
        alpha = 0.0
        beta = float(np.sum(s * w) / np.sum((s * w) ** 2))
    if not beta > 0:
        raise CanzonaError("collective times do not grow with the message size: no bandwidth to fit")
    largest = int(np.argmax(s))
    if beta * s[largest] < MIN_SIZE_SHARE * t[largest]:
        # Near-flat times (noise at the small sizes pressed down by the envelope) leave beta at the
        # rounding level, and the bandwidth it implies is absurd (1e25 B/s was seen).
        raise CanzonaError(f"the size term explains under {MIN_SIZE_SHARE:.0%} of the time at the largest "
                           "message: the times are latency or noise, no bandwidth to fit")
    return float(alpha), float(beta)


def monotone_envelope(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """(size, seconds) sorted by size, each time replaced by the least time at that size or any
    larger one: moving more bytes never takes less time, so a larger time at a smaller size is noise
    (a rank descheduled during that repeat), not a property of the fabric."""
    out: list[tuple[float, float]] = []
    least = math.inf
    for size, t in sorted(points, reverse=True):
        least = min(least, t)
        out.append((size, least))
    return out[::-1]


def fit_collectives(rows: Iterable[CollectiveRow]) -> tuple[list[CollectiveFit], list[str]]:
    """One alpha-beta fit per (op, group size), in op then size order, through the times made
    non-decreasing in size (`monotone_envelope`); and a note for each pair that could not be fitted."""
    groups: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for op, n, nbytes, t in rows:
        groups.setdefault((op, n), []).append((nbytes, t))
    fits, skipped = [], []
    for (op, n), pts in sorted(groups.items(), key=lambda kv: (COLLECTIVE_OPS.index(kv[0][0]), kv[0][1])):
        pts = monotone_envelope(pts)
        try:
            alpha, beta = fit_alpha_beta([p[0] for p in pts], [p[1] for p in pts])
        except CanzonaError as e:
            skipped.append(f"{op} on {n} ranks: {e}")
            continue
        fits.append(CollectiveFit(op, n, alpha, beta, len(pts)))
    return fits, skipped


def fit_latency(fits: Sequence[CollectiveFit]) -> tuple[float, float]:
    """(base, per-step) latency: least squares `alpha = base + latency_steps(op, n) * step` over the
    fits (the simulator's latency model, docs/design.md §9.2), both kept >= 0."""
    if not fits:
        raise CanzonaError("no collective fits to read a latency from")
    steps = np.array([latency_steps(f.op, f.group_size) for f in fits], dtype=float)
    alphas = np.array([f.alpha_s for f in fits], dtype=float)
    if len(set(steps.tolist())) < 2:
        return float(np.mean(alphas)), 0.0
    (base, step), *_ = np.linalg.lstsq(np.stack([np.ones_like(steps), steps], axis=1), alphas, rcond=None)
    if step < 0:
        base, step = float(np.mean(alphas)), 0.0
    if base < 0:
        base, step = 0.0, float(np.sum(steps * alphas) / np.sum(steps * steps))
    return float(base), float(step)


def gemm_curve(points: Iterable[GemmPoint], dtype: str) -> tuple[float, list[list[float]]]:
    """(best FLOP/s, [[flops of one GEMM, efficiency], ...] sorted by flops) for one dtype; several
    shapes of the same FLOPs keep their best rate."""
    best: dict[float, float] = {}
    for dt, m, n, k, seconds in points:
        if dt == dtype and seconds > 0:
            flops = 2.0 * m * n * k
            best[flops] = max(best.get(flops, 0.0), flops / seconds)
    if not best:
        raise CanzonaError(f"no {dtype} GEMM was measured")
    peak = max(best.values())
    return peak, [[f, best[f] / peak] for f in sorted(best)]


def _largest_group(fits: Sequence[CollectiveFit], ops: Sequence[str], limit: int | None = None
                   ) -> list[CollectiveFit]:
    """For each op, its fit at the largest group size (at most `limit`)."""
    out = []
    for op in ops:
        mine = [f for f in fits if f.op == op and (limit is None or f.group_size <= limit)]
        if mine:
            out.append(max(mine, key=lambda f: f.group_size))
    return out


def collective_figures(fits: Sequence[CollectiveFit], local_size: int, single_machine: bool
                       ) -> dict[str, tuple[float, str]]:
    """Profile figures from the fits: {"node.nvlink_ring_busbw": (value, how), ...}.

    Groups of at most `local_size` ranks lie on one machine (the profile's node figures): all-reduce
    gives `node.nvls_allreduce_busbw`, reduce-scatter and all-gather (their median) give
    `node.nvlink_ring_busbw`, each read at the largest such group; their alphas give
    `nccl.base_latency_s` and `nccl.nvlink_step_latency_s`. Larger groups cross machines: their
    all-to-all gives `network.nic_busbw` (the simulator gives a cross-node all-to-all one NIC) and
    their alphas `nccl.network_step_latency_s`. With every rank on one machine (`single_machine`,
    gloo on CPU) that machine is also the network: the network figures are read from the same
    groups."""
    out: dict[str, tuple[float, str]] = {}
    intra = [f for f in fits if f.group_size <= local_size]
    cross = [f for f in fits if f.group_size > local_size]

    def describe(chosen: Sequence[CollectiveFit]) -> str:
        return ", ".join(f"{f.op} on {f.group_size} ranks ({f.busbw / 1e9:.3g} GB/s)" for f in chosen)

    ar = _largest_group(intra, ["all-reduce"])
    if ar:
        out["node.nvls_allreduce_busbw"] = (ar[0].busbw, f"bus bandwidth of the fitted {describe(ar)}")
    ring = _largest_group(intra, ["reduce-scatter", "all-gather"])
    if ring:
        out["node.nvlink_ring_busbw"] = (statistics.median(f.busbw for f in ring),
                                         f"median bus bandwidth of the fitted {describe(ring)}")
    if intra:
        base, step = fit_latency(intra)
        how = (f"least squares alpha = base + steps x step over the {len(intra)} fitted alphas of groups "
               f"of <= {local_size} ranks (steps: 2(n-1) all-reduce, n-1 reduce-scatter / all-gather, 1 "
               "all-to-all), both kept >= 0 (a 0 is written as 1e-9, the smallest figure a profile holds)")
        out["nccl.base_latency_s"] = (base, how)
        out["nccl.nvlink_step_latency_s"] = (step, how)
    network = cross or (intra if single_machine else [])
    a2a = _largest_group(network, ["all-to-all"])
    if a2a:
        where = "groups crossing machines" if cross else "the one machine (it is also the network here)"
        out["network.nic_busbw"] = (a2a[0].busbw, f"bus bandwidth of the fitted {describe(a2a)}, {where}")
    if cross:
        base = out.get("nccl.base_latency_s", (0.0, ""))[0]
        steps = np.array([latency_steps(f.op, f.group_size) for f in cross], dtype=float)
        extra = np.array([f.alpha_s - base for f in cross], dtype=float)
        step = max(0.0, float(np.sum(steps * extra) / np.sum(steps * steps)))
        out["nccl.network_step_latency_s"] = (step, f"least squares (alpha - base) / steps over the {len(cross)} "
                                                    "fitted alphas of groups crossing machines")
    elif single_machine and "nccl.nvlink_step_latency_s" in out:
        step, how = out["nccl.nvlink_step_latency_s"]
        out["nccl.network_step_latency_s"] = (step, how + "; the one machine is also the network here")
    return out


# --- the profile --------------------------------------------------------------------------------

MEASURED_SECTIONS = ("gemm_curve", "gemm_points", "optimizer_seconds", "solver_seconds", "collectives",
                     "calibration")


def _set(raw: dict[str, Any], path: str, value: Any) -> None:
    section, _, key = path.partition(".")
    raw.setdefault(section, {})[key] = value


def _floor(value: float) -> float:
    """Profiles hold figures in [1e-9, 1e18]: a fitted zero (no measurable latency) becomes 1e-9."""
    return max(float(value), LOWEST)


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e6:.3g} us" if seconds < 1e-3 else f"{seconds * 1e3:.3g} ms"


def assemble_profile(m: Measurements, base: dict[str, Any], base_name: str, name: str | None = None,
                     description: str | None = None) -> dict[str, Any]:
    """The JSON of a measured hardware profile: `base` (a profile's JSON, already validated) with the
    measured figures written over it, the measured sections added, and one source per figure."""
    raw = copy.deepcopy(base)
    for key in MEASURED_SECTIONS:
        raw.pop(key, None)  # the base's own measurements describe another machine
    how = (f"`{m.command}`" if m.command else "canzona calibrate") + f" on {m.device_name} ({m.hostname}, {m.date})"
    timing = f"median of {m.repeats} timed repeats after {m.warmup} warm-ups"
    sources: list[str] = []
    measured: set[str] = set()

    # GEMMs
    curves = {}
    for dtype in sorted({p[0] for p in m.gemm_points}):
        peak, curve = gemm_curve(m.gemm_points, dtype)
        curves[dtype] = curve
        raw["gpu"]["peak_flops"][dtype] = peak
        raw["gpu"]["gemm_efficiency"][dtype] = 1.0
        measured |= {f"gpu.peak_flops.{dtype}", f"gpu.gemm_efficiency.{dtype}"}
        shapes = sorted({(mm, nn, kk) for dt, mm, nn, kk, _ in m.gemm_points if dt == dtype})
        sources.append(
            f"gpu.peak_flops.{dtype} {peak:.4g} and gpu.gemm_efficiency.{dtype} 1.0: the best rate of "
            f"{len(shapes)} {dtype} GEMMs (m x n x k from {'x'.join(map(str, shapes[0]))} to "
            f"{'x'.join(map(str, shapes[-1]))}: square, k = 4n and n = 4m), each the {timing}, {how}; "
            f"every point's efficiency against it is in gemm_curve.{dtype} (raw times in gemm_points)")
    if curves:
        raw["gemm_curve"] = curves
        raw["gemm_points"] = [[dt, mm, nn, kk, s] for dt, mm, nn, kk, s in m.gemm_points]

    if m.launch_s is not None:
        raw["gpu"]["launch_s"] = _floor(m.launch_s)
        measured.add("gpu.launch_s")
        sync = "synchronised after each batch" if m.device == "cuda" else "on the CPU"
        sources.append(f"gpu.launch_s {_fmt(m.launch_s)}: time per kernel of a batch of back-to-back "
                       f"in-place additions to a one-element tensor ({sync}), {timing}, {how}")
    if m.copy_s is not None and m.copy_bytes:
        bw = 2.0 * m.copy_bytes / m.copy_s
        raw["gpu"]["hbm_bytes_per_s"] = bw
        raw["gpu"]["hbm_efficiency"] = 1.0  # the copy measured is already what streaming kernels reach
        measured.add("gpu.hbm_bytes_per_s")
        sources.append(f"gpu.hbm_bytes_per_s {bw:.4g}: 2 x {m.copy_bytes} bytes (read and write) over the "
                       f"{timing} of copying one {m.copy_bytes}-byte fp32 buffer into another, {how}")
    if m.memory_bytes:
        raw["gpu"]["memory_bytes"] = float(m.memory_bytes)
        measured.add("gpu.memory_bytes")
        what = ("torch.cuda.get_device_properties().total_memory" if m.device == "cuda"
                else "the machine's RAM, os.sysconf('SC_PHYS_PAGES') x os.sysconf('SC_PAGE_SIZE')")
        sources.append(f"gpu.memory_bytes {m.memory_bytes}: {what}")
    if m.sms:
        raw["gpu"]["sms"] = int(m.sms)
        measured.add("gpu.sms")
        what = ("multi_processor_count of torch.cuda.get_device_properties()" if m.device == "cuda"
                else f"os.cpu_count() (logical CPUs; torch threads while measuring: {m.threads})")
        sources.append(f"gpu.sms {m.sms}: {what}")

    if m.solver_rows:
        raw["solver_seconds"] = {op: [[k, s] for k, s in sorted(rows)] for op, rows in m.solver_rows.items()}
        sizes = sorted({k for rows in m.solver_rows.values() for k, _ in rows})
        sources.append(f"solver_seconds ({', '.join(sorted(m.solver_rows))}): torch.linalg.eigh of a symmetric "
                       f"positive definite and torch.linalg.qr of a random fp32 k x k matrix, k in "
                       f"{', '.join(map(str, sizes))}, each the {timing}, {how}")
    if m.optimizer_rows:
        raw["optimizer_seconds"] = [list(r) for r in m.optimizer_rows]
        what = f"the distinct matrix shapes of {m.model}" if m.model else "the shapes given"
        sources.append(f"optimizer_seconds: one steady-state step of canzona.runtime.kernels plus its apply "
                       f"(state initialised by the warm-ups; amortised preconditioner refreshes not included) "
                       f"for {what}, Muon with Newton-Schulz in bf16 and in fp32, SOAP and Shampoo in their "
                       f"default dtypes, each the {timing}, {how}")

    if m.collective_rows:
        fits, skipped = fit_collectives(m.collective_rows)
        raw["collectives"] = {"backend": m.backend, "rows": [list(r) for r in m.collective_rows],
                              "fits": [[f.op, f.group_size, f.alpha_s, f.busbw] for f in fits]}
        single = m.local_size >= m.world_size
        ranks = f"{m.world_size} ranks ({m.launcher or 'launched'}, {m.local_size} per machine) on {m.backend}"
        sizes = sorted({r[2] for r in m.collective_rows})
        groups = sorted({r[1] for r in m.collective_rows})
        sources.append(
            f"collectives: {', '.join(COLLECTIVE_OPS)} on {ranks}, groups of {', '.join(map(str, groups))} "
            f"ranks, {sizes[0]} to {sizes[-1]} bytes (all-reduce buffer, full reduce-scatter input, full "
            f"all-gather output, bytes one rank sends in an all-to-all), each the {timing} of the slowest "
            f"rank, {how}; fits: t = alpha + S x busfactor / busbw, least squares weighted by 1/t with "
            "alpha >= 0, through the times made non-decreasing in size (a larger time at a smaller size "
            "is taken as noise)"
            + (f"; not fitted: {'; '.join(skipped)}" if skipped else ""))
        for path, (value, why) in collective_figures(fits, m.local_size, single).items():
            value = _floor(value)
            _set(raw, path, value)
            measured.add(path)
            unit = _fmt(value) if path.endswith("_s") else f"{value:.4g}"
            sources.append(f"{path} {unit}: {why}")

    copied = [f for f in _figures(base) if f not in measured]
    if copied:
        sources.append(f"copied from base profile {base_name!r}, not measured: {', '.join(copied)}; "
                       f"their sources there follow, marked [base {base_name}]")
        sources += [f"[base {base_name}] {s}" for s in base.get("sources", [])]

    raw.update({
        "schema": SCHEMA,
        "version": VERSION,
        "name": name or default_name(m),
        "description": description or (f"Measured by canzona calibrate on {m.device_name} ({m.hostname}), "
                                       f"{m.date}; figures not measured come from {base_name}"),
        "measured": True,
        "sources": sources,
        "calibration": {
            "device": m.device_name, "device_type": m.device, "hostname": m.hostname,
            "torch": m.versions.get("torch", ""), "canzona": m.versions.get("canzona", ""),
            "python": m.versions.get("python", ""), "date": m.date, "world_size": m.world_size,
            "backend": m.backend or None, "launcher": m.launcher or None, "ranks_per_machine": m.local_size if m.collective_rows else None,
            "threads": m.threads, "fp32_matmul_precision": m.matmul_precision or None,
            "repeats": m.repeats, "warmup": m.warmup, "command": m.command,
            "base": base_name, "model": m.model, "shapes": [list(s) for s in m.shapes],
        },
    })
    return raw


def default_name(m: Measurements) -> str:
    """`cpu-<host>` or `<gpu>-<host>`, in the characters profile names use."""
    host = re.sub(r"[^a-z0-9.-]+", "-", m.hostname.lower()).strip("-") or "host"
    if m.device == "cpu":
        return f"cpu-{host}"
    gpu = re.sub(r"[^a-z0-9]+", "-", m.device_name.lower()).strip("-") or "cuda"
    return f"{gpu}-{host}"


def _figures(profile: dict[str, Any]) -> list[str]:
    """Every figure of a profile's sections (gpu, node, network, nccl, ...) as a dotted path; a
    per-dtype map gives one path per dtype."""
    out = []
    for section, figures in profile.items():
        if not isinstance(figures, dict) or section in MEASURED_SECTIONS:
            continue
        for key, value in figures.items():
            if isinstance(value, dict):
                out += [f"{section}.{key}.{k}" for k in value]
            else:
                out.append(f"{section}.{key}")
    return out


# A list of numbers and short names (a row, a pair) on one line; tokens hold no spaces or quotes.
_TOKEN = r'(?:-?[0-9][0-9.eE+-]*|"[A-Za-z0-9_.+-]*"|true|false|null)'
_FLAT_LIST = re.compile(rf"\[\s*({_TOKEN}(?:,\s*{_TOKEN})*)\s*\]")


def dumps_profile(profile: dict[str, Any]) -> str:
    """Indented strict JSON with each row of numbers on one line."""
    text = dumps_json(profile, indent=1)
    return _FLAT_LIST.sub(lambda m: "[" + ", ".join(t.strip() for t in m[1].split(",")) + "]", text) + "\n"


def write_profile(profile: dict[str, Any], path: str | Path) -> None:
    """Validate (a profile that would not load is never written) and write atomically."""
    profile_from_dict(json.loads(dumps_json(profile)), str(path))
    write_text_atomic(path, dumps_profile(profile), "hardware profile")
