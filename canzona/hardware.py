"""Hardware profiles: versioned JSON files of datasheet or measured figures, each naming its sources.

One definition of each hardware fact: the cost model (policy core) and the simulator both read
these profiles. Measured profiles use the same format and say so (`"measured": true`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from canzona.errors import SpecError
from canzona.fileio import is_finite_number, parse_json, read_text

SCHEMA = "canzona.hardware"
VERSION = 1
DEFAULT_PROFILE = "h100-sxm"


@dataclass(frozen=True)
class GPUSpec:
    memory_bytes: float
    sms: int
    gemm_tile: int  # output tile edge used for wave quantisation
    peak_flops: dict[str, float]  # dense GEMM peak per dtype
    gemm_efficiency: dict[str, float]  # fraction of peak reached by large GEMMs
    elementwise_flops: float
    hbm_bytes_per_s: float
    solver_flops: float  # eigh / QR rate (cuSOLVER; version dependent: calibrate)
    launch_s: float
    model_flops_utilization: float  # of bf16 peak, for the model's forward and backward

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


def profile_names() -> list[str]:
    folder = resources.files("canzona") / "profiles"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def _section(data: dict[str, Any], key: str, cls: type, where: str) -> Any:
    raw = data.get(key)
    if not isinstance(raw, dict):
        raise SpecError(f"{where}: missing section {key!r}")
    names = [f for f in cls.__dataclass_fields__]
    missing = [n for n in names if n not in raw]
    if missing:
        raise SpecError(f"{where}: section {key!r} lacks {', '.join(missing)}")
    values = {}
    for n in names:
        v = raw[n]
        if isinstance(v, dict):
            if not all(_plausible(x) for x in v.values()):
                raise SpecError(f"{where}: {key}.{n} must map to numbers in [{LOWEST:g}, {HIGHEST:g}]")
            v = {k: float(x) for k, x in v.items()}
        elif not _plausible(v):
            raise SpecError(f"{where}: {key}.{n} must be a number in [{LOWEST:g}, {HIGHEST:g}], got {v!r}")
        values[n] = v
    return cls(**values)


# Every figure of a profile (rates, bandwidths, latencies, fractions, counts) lies far inside this
# range; beyond it, times computed from the profile overflow to inf or underflow to 0.
LOWEST, HIGHEST = 1e-9, 1e18


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
        out[op] = tuple(sorted((int(k), float(t)) for k, t in rows))
    return out


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
    fractions = [("gpu.model_flops_utilization", gpu.model_flops_utilization)]
    fractions += [(f"gpu.gemm_efficiency.{k}", v) for k, v in gpu.gemm_efficiency.items()]
    for name, value in fractions:
        if value > 1:
            raise SpecError(f"{where}: {name} is a fraction of peak and must be <= 1, got {value}")


def profile_from_dict(data: Any, where: str = "profile") -> HardwareProfile:
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise SpecError(f"{where}: not a canzona hardware profile (schema {SCHEMA!r} expected)")
    if data.get("version") != VERSION or isinstance(data.get("version"), bool):
        raise SpecError(f"{where}: unsupported profile version {data.get('version')!r} (expected {VERSION})")
    name = data.get("name")
    sources = data.get("sources")
    if not isinstance(name, str) or not name:
        raise SpecError(f"{where}: a profile needs a name")
    if not isinstance(sources, list) or not sources or not all(isinstance(s, str) for s in sources):
        raise SpecError(f"{where}: a profile must name its sources (a non-empty list of strings)")
    measured = data.get("measured", False)
    if not isinstance(measured, bool):
        raise SpecError(f"{where}: measured must be true or false, got {measured!r}")
    gpu = _section(data, "gpu", GPUSpec, where)
    node = _section(data, "node", NodeSpec, where)
    _check_gpu(gpu, node, where)
    return HardwareProfile(
        solver_seconds=_solver_table(data.get("solver_seconds", {}), where),
        name=name,
        description=str(data.get("description", "")),
        measured=measured,
        sources=tuple(sources),
        gpu=gpu,
        node=node,
        network=_section(data, "network", NetworkSpec, where),
        nccl=_section(data, "nccl", NCCLSpec, where),
    )


def load_profile(name_or_path: str | Path = DEFAULT_PROFILE) -> HardwareProfile:
    """A shipped profile by name (`h100-sxm`, `h200`, `a100-sxm`) or a JSON file by path."""
    text = str(name_or_path)
    if text in profile_names():
        raw = (resources.files("canzona") / "profiles" / f"{text}.json").read_text()
        where = text
    elif text.endswith(".json") or os.path.lexists(text):
        raw = read_text(text, "hardware profile", SpecError)
        where = text
    else:
        raise SpecError(f"unknown hardware {text!r}; known profiles: {', '.join(profile_names())} (or a .json path)")
    return profile_from_dict(parse_json(raw, where, SpecError), where)
