"""Hardware profiles: versioned JSON files of datasheet or measured figures, each naming its sources.

One definition of each hardware fact: the cost model (policy core) and the simulator both read
these profiles. Measured profiles use the same format and say so (`"measured": true`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from canzona.errors import SpecError
from canzona.fileio import is_finite_number, is_whole_number, parse_json, read_text
from canzona.gemm_model import MAX_TILE, GemmModel, parse_gemm_model, square
from canzona.spec import DTYPE_BYTES
from canzona.variability import parse_variability

SCHEMA = "canzona.hardware"
VERSION = 1
DEFAULT_PROFILE = "h100-sxm"


@dataclass(frozen=True)
class GPUSpec:
    memory_bytes: float
    sms: int
    gemm_tile: int  # square output tile of the GEMM model when a profile has no gemm_model section
    peak_flops: dict[str, float]  # dense GEMM peak per dtype
    gemm_efficiency: dict[str, float]  # tensor-core fraction of peak at the boost clock (gemm_model.sustained_clock slows it)
    elementwise_flops: float
    hbm_bytes_per_s: float
    solver_flops: float  # eigh / QR rate (cuSOLVER; version dependent: calibrate)
    launch_s: float
    # fraction of `hbm_bytes_per_s` a streaming (memory-bound) kernel reaches: a published copy /
    # STREAM-style measurement over the datasheet figure (optional: 1.0, the datasheet, without one)
    hbm_efficiency: float = 1.0

    @property
    def hbm_achievable_bytes_per_s(self) -> float:
        return self.hbm_bytes_per_s * self.hbm_efficiency

    def gemm_flops(self) -> dict[str, float]:
        return {k: v * self.gemm_efficiency.get(k, 1.0) for k, v in self.peak_flops.items()}


@dataclass(frozen=True)
class NodeSpec:
    gpus: int
    nvlink_bytes_per_s: float  # per direction, per GPU
    nvlink_ring_busbw: float
    nvls_allreduce_busbw: float


@dataclass(frozen=True)
class NetworkSpec:
    nic_bytes_per_s: float  # one NIC per GPU
    nic_busbw: float  # reached by NCCL


@dataclass(frozen=True)
class NCCLSpec:
    base_latency_s: float
    nvlink_step_latency_s: float
    network_step_latency_s: float


COLLECTIVE_OPS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all")


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: `busbw = S * f / t` for a buffer of S bytes on n ranks."""
    if n <= 1:
        return 0.0
    if op == "all-reduce":
        return 2.0 * (n - 1) / n
    if op in ("reduce-scatter", "all-gather", "all-to-all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce"):
        return 1.0  # a pipelined chain: every link carries the buffer once
    raise ValueError(f"unknown collective {op!r}")


def ring_steps(op: str, n: int) -> int:
    return 2 * (n - 1) if op == "all-reduce" else n - 1


def latency_steps(op: str, n: int) -> int:
    """Steps that pay the per-step latency: a ring's steps, one for an all-to-all (docs/design.md §9.2)."""
    return 1 if op == "all-to-all" else ring_steps(op, n)


@dataclass(frozen=True)
class CollectiveTable:
    """Measured collective times (`canzona calibrate --world-size N`).

    `rows`: (op, group size, bytes, median seconds), bytes by the simulator's convention (the
    all-reduce buffer, the full reduce-scatter input, the full all-gather output, the bytes one rank
    sends in an all-to-all); `fits`: (op, group size, alpha seconds, bus bandwidth in bytes/s) of the
    line `t = alpha + S * bus_factor / busbw` fitted to the rows of that op and group size."""

    backend: str = ""
    rows: tuple[tuple[str, int, int, float], ...] = ()
    fits: tuple[tuple[str, int, float, float], ...] = ()

    def seconds(self, op: str, group_size: int, nbytes: float) -> float | None:
        """Measured time of `op` over `nbytes` on `group_size` ranks: interpolated linearly between
        the measured sizes, the fitted line beyond them; None where this op and group size were
        not measured (the simulator then uses its model)."""
        points = sorted((b, t) for o, n, b, t in self.rows if o == op and n == group_size)
        if not points:
            return None
        if points[0][0] <= nbytes <= points[-1][0]:
            for (b0, t0), (b1, t1) in zip(points, points[1:]):
                if b0 <= nbytes <= b1:
                    return t0 if b1 == b0 else t0 + (nbytes - b0) / (b1 - b0) * (t1 - t0)
            return points[0][1]
        fit = next(((a, bw) for o, n, a, bw in self.fits if o == op and n == group_size), None)
        if fit is None:  # no line: scale the nearest measurement by its bytes
            b, t = points[0] if nbytes < points[0][0] else points[-1]
            return t * max(nbytes, 1.0) / max(b, 1.0) if nbytes > b else t
        alpha, busbw = fit
        return alpha + nbytes * bus_factor(op, group_size) / busbw


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    measured: bool
    sources: tuple[str, ...]
    gpu: GPUSpec
    node: NodeSpec
    network: NetworkSpec
    nccl: NCCLSpec
    # measured seconds of one fp32 eigh / QR per size: {"eigh": ((k, s), ...), "qr": (...)}
    solver_seconds: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    # measured GEMM efficiency against the size of one GEMM: {"bf16": ((flops, efficiency), ...)}
    gemm_curve: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    # measured seconds of one optimizer step: ((optimizer, m, n, dtype, seconds), ...)
    optimizer_seconds: tuple[tuple[str, int, int, str, float], ...] = ()
    collectives: CollectiveTable = field(default_factory=CollectiveTable)
    # the per-GPU compute time's standard deviation over its median across GPUs of this model
    # (canzona.variability: a synchronous job waits for its slowest GPU); 0 prices every GPU alike
    gpu_time_cv: float = 0.0
    # the GEMM model's tiles, splits, feed and fixed costs (canzona.gemm_model); None: square gpu.gemm_tile tiles
    gemm_model: GemmModel | None = None

    def gemm_kernels(self) -> GemmModel:
        return self.gemm_model if self.gemm_model is not None else square(self.gpu.gemm_tile)

    def gemm_efficiency_at(self, dtype: str, flops: float) -> float | None:
        """Measured efficiency of one GEMM of `flops` FLOPs, interpolated linearly in log(flops)
        between the curve's points and held at its end points; None without a curve for `dtype`."""
        return efficiency_on(self.gemm_curve.get(dtype, ()), flops)


def efficiency_on(curve: tuple[tuple[float, float], ...], flops: float) -> float | None:
    """A GEMM efficiency curve's value at `flops`: linear in log(flops) between its sorted points,
    held at its end points; None for an empty curve."""
    if not curve:
        return None
    if flops <= curve[0][0]:
        return curve[0][1]
    if flops >= curve[-1][0]:
        return curve[-1][1]
    for (f0, e0), (f1, e1) in zip(curve, curve[1:]):
        if f0 <= flops <= f1:
            if f1 == f0:
                return e1
            w = math.log(flops / f0) / math.log(f1 / f0)
            return e0 + w * (e1 - e0)
    return curve[-1][1]  # pragma: no cover - the points are sorted


def profile_names() -> list[str]:
    folder = resources.files("canzona") / "profiles"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


# The shipped profile of each GPU, by the name CUDA gives it (`torch.cuda.get_device_name`), matched
# whole: a name is one product, and another product of the same family is another GPU (the H100
# PCIe and NVL, the H200 NVL: lower power limits and clocks; the A100 40 GB and PCIe: other HBM).
# What is not here plans with the default profile (the runtime warns) or a profile the user names.
DEVICE_PROFILES: dict[str, str] = {
    "NVIDIA H100 80GB HBM3": "h100-sxm",  # H100 SXM5 80 GB
    "NVIDIA H200": "h200",  # H200 SXM 141 GB
    "NVIDIA A100-SXM4-80GB": "a100-sxm",  # A100 SXM4 80 GB
}


def profile_for_device(device_name: str) -> str | None:
    """The shipped profile (`profile_names()`) of the GPU CUDA names `device_name`, or None where
    none is that GPU: what `DistributedOptimizer(cost_model=None)` plans with on CUDA, as
    `canzona plan / simulate --hardware` would for that GPU."""
    return DEVICE_PROFILES.get(" ".join(device_name.split()))


def _section(data: dict[str, Any], key: str, cls: type, where: str) -> Any:
    raw = data.get(key)
    if not isinstance(raw, dict):
        raise SpecError(f"{where}: missing section {key!r}")
    fields = cls.__dataclass_fields__
    # an unknown field is a misspelt one whose figure would silently be its default
    # (`hbm_efficency`: hbm_efficiency 1.0), so it is refused, as unknown sections are
    unknown = sorted(str(f) for f in set(raw) - set(fields) - RETIRED_FIELDS.get(key, frozenset()))
    if unknown:
        raise SpecError(f"{where}: unknown field{'s' if len(unknown) > 1 else ''} "
                        f"{', '.join(f'{key}.{f}' for f in unknown)}; section {key!r} has {', '.join(fields)}")
    names = [f for f in fields if f in raw or fields[f].default is dataclasses.MISSING]  # defaulted: optional
    missing = [n for n in names if n not in raw]
    if missing:
        raise SpecError(f"{where}: section {key!r} lacks {', '.join(missing)}")
    values = {}
    for n in names:
        v = raw[n]
        # the per-dtype fields (annotated dict[...]) take a map and every other field a number: a map
        # where a number belongs reached the simulator as a bandwidth, a number for a map a traceback
        is_map = str(fields[n].type).startswith("dict")
        if is_map != isinstance(v, dict):
            want = "a map of dtype to number" if is_map else "a number"
            raise SpecError(f"{where}: {key}.{n} must be {want}, got {str(v)[:80]}")
        if isinstance(v, dict):
            if not all(_plausible(x) for x in v.values()):
                raise SpecError(f"{where}: {key}.{n} must map to numbers in [{LOWEST:g}, {HIGHEST:g}]")
            # per-dtype figures: a misspelt dtype (`bf61`) would never be read, and its dtype would
            # silently take another's rate
            odd = sorted(str(k) for k in set(v) - set(DTYPE_BYTES))
            if odd:
                raise SpecError(f"{where}: {key}.{n} has unknown dtype{'s' if len(odd) > 1 else ''} "
                                f"{', '.join(repr(k) for k in odd)}; dtypes are {', '.join(DTYPE_BYTES)}")
            v = {k: float(x) for k, x in v.items()}
        elif not _plausible(v):
            raise SpecError(f"{where}: {key}.{n} must be a number in [{LOWEST:g}, {HIGHEST:g}], got {v!r}")
        values[n] = v
    return cls(**values)


# fields a profile written by an older canzona may have, which no longer mean anything: ignored
# (the simulator no longer takes an MFU factor, docs/design.md §9.3)
RETIRED_FIELDS = {"gpu": frozenset({"model_flops_utilization"})}

# Every figure of a profile (rates, bandwidths, latencies, fractions, counts) lies far inside this
# range; beyond it, times computed from the profile overflow to inf or underflow to 0.
LOWEST, HIGHEST = 1e-9, 1e18


# Figures bounded by what a device is, not by the float range above: within [LOWEST, HIGHEST] these
# still simulated machines no one builds, as a figure's exponent typed one too many would. Each bound
# is orders of magnitude above any current device (rates, bandwidths and memory need none: at
# HIGHEST they price their work at about nothing, a finite and sensible limit)
MAX_SMS = 2**16  # SMs of one GPU (H100 SXM 132, B200 148): the GEMM model gives each SM peak / sms,
# so 1e18 SMs priced qwen3-0.6b's iteration on 16 GPUs at 1.7e14 s
MAX_LATENCY_S = 1.0  # a kernel launch or an NCCL latency: microseconds on GPUs, at most milliseconds on
# gloo over CPUs (`canzona calibrate`); at 1e18 s one swamped every other term of an iteration
# field: (bound, unit, what it is); `gemm_tile` a CTA tile's edge as the GEMM model's (`MAX_TILE`)
DEVICE_BOUNDS: dict[str, tuple[float, str, str]] = {
    "gpu.sms": (MAX_SMS, "", "SMs of one GPU"),
    "gpu.gemm_tile": (MAX_TILE, "", "a GEMM kernel's CTA tile edge"),
    "gpu.launch_s": (MAX_LATENCY_S, " s", "a kernel launch"),
    "nccl.base_latency_s": (MAX_LATENCY_S, " s", "an NCCL latency"),
    "nccl.nvlink_step_latency_s": (MAX_LATENCY_S, " s", "an NCCL latency"),
    "nccl.network_step_latency_s": (MAX_LATENCY_S, " s", "an NCCL latency"),
}


# One measured time in a profile's tables (`solver_seconds`, `optimizer_seconds`, `collectives.rows`)
# and a cost table's rows, a day: `canzona calibrate` times each kernel or collective in 7 runs at
# its defaults (warm-ups and repeats), so a day each is a week of calibration, not a measurement. Its
# slowest CPU figures on a loaded 2-core machine took seconds (eigh of 512: 3.1 s; SOAP on 3072 x
# 1024: 2.5 s), and SOAP at the largest --shapes it takes (65536 x 4096) would take about 1.3 h there
# by its FLOPs, so an hour would refuse what a slow CPU can measure (docs/design.md §4.5). At 1e18 s
# one eigh priced an iteration at 7.6e21 s. A collective fit's alpha is a latency: `MAX_LATENCY_S`
MAX_MEASURED_S = 86400.0


def check_measured_seconds(seconds: float, where: str) -> None:
    """One measured time within `MAX_MEASURED_S`, else one SpecError naming the field (`where`)."""
    if seconds > MAX_MEASURED_S:
        raise SpecError(f"{where}: {seconds:g} s must be at most {MAX_MEASURED_S:g} s (a day: one measured "
                        "kernel or collective, of which a calibration times several)")


def _check_device_bounds(sections: dict[str, Any], where: str) -> None:
    """`DEVICE_BOUNDS` on the parsed sections (`gpu`, `nccl`, ...): one SpecError naming the field
    and its bound."""
    for path, (bound, unit, what) in DEVICE_BOUNDS.items():
        section, _, name = path.partition(".")
        value = getattr(sections[section], name)
        if value > bound:
            raise SpecError(f"{where}: {path} must be at most {bound:g}{unit} ({what}; orders of magnitude above any "
                            f"current device), got {value:g}")


def _plausible(v: Any) -> bool:
    return is_finite_number(v) and LOWEST <= v <= HIGHEST


SOLVERS = ("eigh", "qr")


def _solver_table(raw: Any, where: str) -> dict[str, tuple[tuple[int, float], ...]]:
    """Optional measured solver times: {"eigh": [[k, seconds], ...], "qr": [[k, seconds], ...]}."""
    if not isinstance(raw, dict) or set(raw) - set(SOLVERS):
        raise SpecError(f"{where}: solver_seconds must map {' / '.join(SOLVERS)} to [[size, seconds], ...]")
    out = {}
    for op, rows in raw.items():
        ok = isinstance(rows, list) and rows and all(
            isinstance(r, list) and len(r) == 2 and all(_plausible(x) for x in r)
            and float(r[0]).is_integer() for r in rows)
        if not ok:
            raise SpecError(f"{where}: solver_seconds.{op} must be a non-empty list of [size, seconds] pairs")
        for _, t in rows:
            check_measured_seconds(t, f"{where}: solver_seconds.{op}")
        out[op] = tuple(sorted((int(k), float(t)) for k, t in rows))
    return out


def _gemm_curve(raw: Any, where: str) -> dict[str, tuple[tuple[float, float], ...]]:
    """Optional measured GEMM curve: {"bf16": [[flops, efficiency], ...], ...}, efficiency in (0, 1]."""
    if not isinstance(raw, dict) or set(raw) - set(DTYPE_BYTES):
        raise SpecError(f"{where}: gemm_curve must map dtypes ({', '.join(DTYPE_BYTES)}) to "
                        "[[flops, efficiency], ...]")
    out = {}
    for dtype, rows in raw.items():
        ok = isinstance(rows, list) and rows and all(
            isinstance(r, list) and len(r) == 2 and all(_plausible(x) for x in r) and r[1] <= 1
            for r in rows)
        if not ok:
            raise SpecError(f"{where}: gemm_curve.{dtype} must be a non-empty list of [flops, efficiency] "
                            "pairs with efficiency in (0, 1]")
        out[dtype] = tuple(sorted((float(f), float(e)) for f, e in rows))
    return out


def parse_cost_rows(rows: Any, where: str) -> dict[tuple[str, int, int, str], float]:
    """Measured optimizer-step seconds, `[[optimizer, m, n, dtype, seconds], ...]`: the rows of a
    profile's `optimizer_seconds` and of a cost table (`canzona.cost.load_cost_table`)."""
    if not isinstance(rows, list):
        raise SpecError(f"{where}: expected a list of [optimizer, m, n, dtype, seconds] rows")
    table = {}
    for i, row in enumerate(rows):
        ok = isinstance(row, list) and len(row) == 5 and isinstance(row[0], str) and row[0] \
            and row[3] in DTYPE_BYTES and all(is_whole_number(x, 1, 2**31) for x in row[1:3]) \
            and _plausible(row[4])
        if not ok:
            raise SpecError(f"{where}: row {i} must be [optimizer, rows, cols, dtype, positive seconds] "
                            f"with whole sizes and a dtype of {', '.join(DTYPE_BYTES)}, got {str(row)[:80]}")
        check_measured_seconds(row[4], f"{where}: row {i}")
        table[(row[0], row[1], row[2], row[3])] = float(row[4])
    return table


def _optimizer_seconds(raw: Any, where: str) -> tuple[tuple[str, int, int, str, float], ...]:
    table = parse_cost_rows(raw, f"{where}: optimizer_seconds")
    return tuple(sorted((*key, seconds) for key, seconds in table.items()))


MAX_GROUP = 2**20  # ranks in one measured collective group


def _collectives(raw: Any, where: str) -> CollectiveTable:
    """Optional measured collectives: {"backend": name, "rows": [[op, group, bytes, seconds], ...],
    "fits": [[op, group, alpha_s, busbw], ...] (optional)}."""
    if not isinstance(raw, dict) or set(raw) - {"backend", "rows", "fits"}:
        raise SpecError(f"{where}: collectives must be an object with backend, rows and (optionally) fits")
    backend, rows, fits = raw.get("backend"), raw.get("rows"), raw.get("fits", [])
    if not isinstance(backend, str) or not backend:
        raise SpecError(f"{where}: collectives.backend must name the backend (gloo, nccl, ...)")

    def row_ok(r: Any, whole_third: bool) -> bool:
        return isinstance(r, list) and len(r) == 4 and r[0] in COLLECTIVE_OPS \
            and is_whole_number(r[1], 2, MAX_GROUP) \
            and (is_whole_number(r[2], 1, 2**62) if whole_third else _plausible(r[2])) and _plausible(r[3])

    if not isinstance(rows, list) or not rows or not all(row_ok(r, True) for r in rows):
        raise SpecError(f"{where}: collectives.rows must be a non-empty list of [op, group size >= 2, bytes, "
                        f"seconds] with op one of {', '.join(COLLECTIVE_OPS)}")
    if not isinstance(fits, list) or not all(row_ok(r, False) for r in fits):
        raise SpecError(f"{where}: collectives.fits must be a list of [op, group size >= 2, alpha seconds, "
                        "bus bytes/s]")
    for i, r in enumerate(rows):
        check_measured_seconds(r[3], f"{where}: collectives.rows: row {i}")
    for i, r in enumerate(fits):
        if r[2] > MAX_LATENCY_S:
            raise SpecError(f"{where}: collectives.fits: row {i}: a latency of {r[2]:g} s must be at most "
                            f"{MAX_LATENCY_S:g} s (alpha, the fitted latency, as an NCCL latency)")
    return CollectiveTable(backend, tuple((o, int(n), int(b), float(t)) for o, n, b, t in rows),
                           tuple((o, int(n), float(a), float(bw)) for o, n, a, bw in fits))


# The memory model's fixed allowance for the CUDA context, NCCL and the allocator beside the counted
# tensors (canzona.memory gives its grounds): a GPU with no more memory than this fits nothing at all
DEFAULT_FIXED_OVERHEAD = 750_000_000

REQUIRED_DTYPES = ("bf16", "fp32")  # the model's GEMMs and the optimizers' default compute dtypes


def _check_gpu(gpu: GPUSpec, node: NodeSpec, where: str) -> None:
    for name, value in (("gpu.sms", gpu.sms), ("gpu.gemm_tile", gpu.gemm_tile), ("node.gpus", node.gpus)):
        if value != int(value):
            raise SpecError(f"{where}: {name} must be a whole number, got {value}")
    object.__setattr__(gpu, "sms", int(gpu.sms))
    object.__setattr__(gpu, "gemm_tile", int(gpu.gemm_tile))
    object.__setattr__(node, "gpus", int(node.gpus))
    missing = [d for d in REQUIRED_DTYPES if d not in gpu.peak_flops]
    if missing:
        raise SpecError(f"{where}: gpu.peak_flops lacks {', '.join(missing)}")
    if gpu.memory_bytes <= DEFAULT_FIXED_OVERHEAD:  # every layout would be reported as not fitting
        raise SpecError(f"{where}: gpu.memory_bytes {gpu.memory_bytes:g} leaves nothing beside the "
                        f"{DEFAULT_FIXED_OVERHEAD:g} bytes the CUDA context, NCCL and the allocator take; "
                        "give the capacity CUDA reports to a process, in bytes")
    fractions = [(f"gpu.gemm_efficiency.{k}", v) for k, v in gpu.gemm_efficiency.items()]
    fractions.append(("gpu.hbm_efficiency", gpu.hbm_efficiency))
    for name, value in fractions:
        if value > 1:
            raise SpecError(f"{where}: {name} is a fraction of peak and must be <= 1, got {value}")


# a profile's sections: an unknown one is a misspelt section whose figures would silently be the
# defaults (`gemm-model` for `gemm_model`: no GEMM model at all), so it is refused, as a spec
# file's unknown fields are; `calibration` and `gemm_points` are what `canzona calibrate` records of
# its run and of the GEMMs it timed (`canzona.calibration.MEASURED_SECTIONS`)
PROFILE_KEYS = frozenset({"schema", "version", "name", "description", "measured", "sources", "calibration",
                          "gemm_points", "gpu", "node", "network", "nccl", "solver_seconds", "gemm_curve",
                          "optimizer_seconds", "collectives", "gemm_model", "variability"})


def profile_from_dict(data: Any, where: str = "profile") -> HardwareProfile:
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise SpecError(f"{where}: not a canzona hardware profile (schema {SCHEMA!r} expected)")
    unknown = sorted(str(k) for k in set(data) - PROFILE_KEYS)
    if unknown:
        raise SpecError(f"{where}: unknown profile section{'s' if len(unknown) > 1 else ''} "
                        f"{', '.join(repr(k) for k in unknown)}; a profile has {', '.join(sorted(PROFILE_KEYS))}")
    if data.get("version") != VERSION or isinstance(data.get("version"), bool):
        raise SpecError(f"{where}: unsupported profile version {data.get('version')!r} (expected {VERSION})")
    name = data.get("name")
    sources = data.get("sources")
    if not isinstance(name, str) or not name:
        raise SpecError(f"{where}: a profile needs a name")
    if not isinstance(sources, list) or not sources or not all(isinstance(s, str) and s.strip() for s in sources):
        raise SpecError(f"{where}: a profile must name its sources (a non-empty list of non-empty strings)")
    description = data.get("description", "")
    if not isinstance(description, str):  # str() would print a number or a list as the profile's description
        raise SpecError(f"{where}: description must be a string, got {description!r:.80}")
    measured = data.get("measured", False)
    if not isinstance(measured, bool):
        raise SpecError(f"{where}: measured must be true or false, got {measured!r}")
    gpu = _section(data, "gpu", GPUSpec, where)
    node = _section(data, "node", NodeSpec, where)
    nccl = _section(data, "nccl", NCCLSpec, where)
    _check_device_bounds({"gpu": gpu, "nccl": nccl}, where)
    _check_gpu(gpu, node, where)
    return HardwareProfile(
        solver_seconds=_solver_table(data.get("solver_seconds", {}), where),
        gemm_curve=_gemm_curve(data.get("gemm_curve", {}), where),
        optimizer_seconds=_optimizer_seconds(data.get("optimizer_seconds", []), where),
        collectives=_collectives(data["collectives"], where) if "collectives" in data else CollectiveTable(),
        gemm_model=parse_gemm_model(data["gemm_model"], where) if "gemm_model" in data else None,
        gpu_time_cv=parse_variability(data["variability"], where) if "variability" in data else 0.0,
        name=name,
        description=description,
        measured=measured,
        sources=tuple(sources),
        gpu=gpu,
        node=node,
        network=_section(data, "network", NetworkSpec, where),
        nccl=nccl,
    )


def load_profile(name_or_path: str | Path = DEFAULT_PROFILE) -> HardwareProfile:
    """A shipped profile by name (`h100-sxm`, `h200`, `a100-sxm`) or a JSON file by path."""
    data, where = load_profile_data(name_or_path)
    return profile_from_dict(data, where)


def profile_file(name_or_path: str | Path | None) -> Path | None:
    """The file `load_profile_data` reads for `name_or_path` (a shipped profile's own file for its
    name): what an output must not replace. None for None."""
    if name_or_path is None:
        return None
    text = str(name_or_path)
    if text in profile_names():
        return Path(str(resources.files("canzona") / "profiles" / f"{text}.json"))
    return Path(text)


def load_profile_data(name_or_path: str | Path = DEFAULT_PROFILE) -> tuple[Any, str]:
    """The parsed but unvalidated JSON of a profile (by name or path), and where it came from."""
    text = str(name_or_path)
    if text in profile_names():
        raw = profile_file(text).read_text()
        where = text
    elif text.endswith(".json") or os.path.lexists(text):
        raw = read_text(text, "hardware profile", SpecError)
        where = text
    else:
        raise SpecError(f"unknown hardware {text!r}; known profiles: {', '.join(profile_names())} (or a .json path)")
    return parse_json(raw, where, SpecError), where
