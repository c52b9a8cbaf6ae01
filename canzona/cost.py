"""Optimizer cost models (docs/design.md §4): FLOPs, memory traffic, state bytes and time in seconds.

Each optimizer step on one full `m x n` matrix is decomposed into kernels (GEMMs, elementwise
passes, eigendecompositions / QR). A kernel's time is a roofline `max(flops/rate, bytes/bw)` plus a
launch overhead; kernels that run every `f` steps carry an amortised `count = 1/f`. The simulator
applies its own hardware profile to the same kernels, so the formulas live here only.

Allocation loops use `CostModel.seconds`, never raw element counts.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from canzona.errors import SpecError
from canzona.gemm_model import GemmModel, square
from canzona.hardware import (
    DEFAULT_PROFILE,
    HardwareProfile,
    efficiency_on,
    load_profile,
    parse_cost_rows,
)
from canzona.optimizers import (
    OPTIMIZERS,
    AdamWConfig,
    MuonConfig,
    ShampooConfig,
    SOAPConfig,
    default_config,
    matrix_optimizer,
)
from canzona.spec import DTYPE_BYTES, ParamSpec

FP32 = DTYPE_BYTES["fp32"]


@dataclass(frozen=True)
class Kernel:
    """One kernel launch of an optimizer step. `gemm` is (M, N, K) for GEMMs, (k,) for solvers."""

    name: str
    kind: str  # "gemm" | "elementwise" | "solver"
    flops: float
    bytes: float
    dtype: str
    count: float = 1.0
    gemm: tuple[int, ...] = ()
    solver: str = ""  # "eigh" or "qr" for solver kernels
    # a GEMM adding into its output (`C += A B`): the bytes of an element of that output (its
    # accumulator's dtype, read and written by the epilogue); 0: a GEMM writing a fresh output
    accumulate: int = 0
    # (chunks, at once): `gemm` is one of `chunks` same-shape GEMMs run on `at once` streams
    # (`chunked_gemm_kernel`); (): one GEMM
    chunks: tuple[int, int] = ()


def gemm_output_bytes(dtype: str) -> int:
    """Bytes a GEMM of `dtype` operands writes an output element: an fp8 GEMM writes bf16
    (Transformer Engine, torch._scaled_mm), so no GEMM writes fewer than 2."""
    return max(DTYPE_BYTES[dtype], DTYPE_BYTES["bf16"])


def gemm_kernel(name: str, m: int, n: int, k: int, dtype: str, count: float = 1.0, *, accumulate: int = 0) -> Kernel:
    """`accumulate`: the GEMM adds into an `m x n` output of `accumulate`-byte elements, which its
    epilogue reads and writes (Megatron's weight gradient into `main_grad`: `layer_kernels`)."""
    b = DTYPE_BYTES[dtype]
    out = 2 * accumulate if accumulate else gemm_output_bytes(dtype)
    return Kernel(name, "gemm", 2.0 * m * n * k, float(b * (m * k + k * n) + out * m * n), dtype, count, (m, n, k),
                  accumulate=accumulate)


def grouped_gemm_kernel(name: str, m: int, n: int, k: int, groups: int, dtype: str, count: float = 1.0, *,
                        accumulate: int = 0) -> Kernel:
    """`groups` same-shape `m x n x k` GEMMs as one launch (a grouped GEMM: a mixture-of-experts
    layer's experts, a batched kernel's matrices): their tiles fill the SM waves together, and
    each group reads its own operands (and adds into its own output under `accumulate`)."""
    one = gemm_kernel(name, m, n, k, dtype, accumulate=accumulate)
    return Kernel(name, "gemm", one.flops * groups, one.bytes * groups, dtype, count, (m * groups, n, k),
                  accumulate=accumulate)


def chunked_gemm_kernel(name: str, m: int, n: int, k: int, chunks: int, at_once: int, dtype: str) -> Kernel:
    """A GEMM issued as `chunks` same-shape `m x n x k` GEMMs round-robin on `at_once` streams
    (Transformer Engine's userbuffers overlap): their tiles fill the waves together, at most
    `at_once` chunks' tiles in a wave (`canzona.gemm_model.GemmModel.seconds`)."""
    one = gemm_kernel(name, m, n, k, dtype)
    return Kernel(name, "gemm", one.flops * chunks, one.bytes * chunks, dtype, 1.0, (m, n, k),
                  chunks=(chunks, min(at_once, chunks)))


def elementwise_kernel(name: str, numel: int, flops_per: float, bytes_per: float, dtype: str = "fp32") -> Kernel:
    return Kernel(name, "elementwise", flops_per * numel, bytes_per * numel, dtype)


def _solver(name: str, op: str, k: int, flops: float, count: float, dtype: str) -> Kernel:
    return Kernel(name, "solver", flops, float(DTYPE_BYTES[dtype] * 2 * k * k), dtype, count, (k,), op)


@dataclass(frozen=True)
class StepDtypes:
    """Bytes an element of what a matrix optimizer's own elementwise passes read and write, where
    they follow the run's dtypes (the registry's `cost_kernels` take it; `MemorySetup.step_dtypes`
    makes it from a run's):
    - `grad`: the reduced gradient the step reads (and what Muon's Nesterov blend writes: it takes
      the gradient's dtype);
    - `state`: the state that follows the update (the registry's `update_dtype_state_bytes`: Muon's
      momentum, and its variants');
    - `param`: what the update is applied to: the fp32 master, or the parameter itself without one.
    fp32 everywhere (`FP32_STEP`) is how the planner prices every step (its plan's per-matrix
    seconds, `canzona plan` and the runtime's own plan alike), and what a run with masters keeps;
    without masters (`DistributedOptimizer(master_weights=False)`) the three are the parameters'
    dtype. What the kernels compute in stays theirs: Newton-Schulz in `ns_dtype`, SOAP's and
    Shampoo's statistics, moments and projections in at least fp32 (`kernels.work_dtype`), a
    registry entry's own passes on the fp32 update (its module says which)."""

    grad: int = FP32
    state: int = FP32
    param: int = FP32


FP32_STEP = StepDtypes()


def muon_kernels(m: int, n: int, cfg: MuonConfig, dtypes: StepDtypes = FP32_STEP) -> list[Kernel]:
    """Momentum, Nesterov blend, normalisation, `ns_steps` quintic iterations, decay and update.

    The momentum pass reads the momentum buffer and the gradient, writes the buffer, then the
    Nesterov blend reads both again and writes what Newton-Schulz takes (in the gradient's dtype);
    the normalisation reads that and writes and rescales the `ns_dtype` copy; the apply reads and
    writes the parameter (`dtypes.param`) and reads the `ns_dtype` direction."""
    s, big = min(m, n), max(m, n)
    mn, dt = m * n, cfg.ns_dtype
    nb = DTYPE_BYTES[dt]
    ks = [
        elementwise_kernel("momentum", mn, 4, 3 * dtypes.state + 3 * dtypes.grad),
        elementwise_kernel("normalize", mn, 3, dtypes.grad + 2 * nb),
    ]
    for i in range(cfg.ns_steps):
        ks += [
            gemm_kernel(f"ns{i}.gram", s, s, big, dt),  # A = X Xᵀ
            gemm_kernel(f"ns{i}.square", s, s, s, dt),  # B = bA + cA²
            gemm_kernel(f"ns{i}.update", s, big, s, dt),  # X = aX + BX
        ]
    ks.append(elementwise_kernel("apply", mn, 4, 2 * dtypes.param + nb))
    return ks


def _preconditioned_sides(m: int, n: int, max_dim: int) -> list[tuple[int, int]]:
    """(k, other) for each side whose dimension k may carry a preconditioner."""
    return [(k, (m * n) // k) for k in (m, n) if k <= max_dim]


def soap_kernels(m: int, n: int, cfg: SOAPConfig, dtypes: StepDtypes = FP32_STEP) -> list[Kernel]:
    """Statistics, projections into and out of the eigenbasis, rotated Adam, amortised refresh.

    Rotated Adam is AdamW's fused pass (the parameter read and written, the gradient read, the two
    fp32 moments read and written) and a read of the rotated gradient: 8 elements, of which the
    gradient's read is at `dtypes.grad` (the runtime casts it to fp32 once) and the parameter's
    two at `dtypes.param`; the moments and the rotated gradient stay fp32."""
    dt, f = cfg.compute_dtype, cfg.precondition_frequency
    ks: list[Kernel] = []
    for side, (k, other) in enumerate(_preconditioned_sides(m, n, cfg.max_precond_dim)):
        ks += [
            gemm_kernel(f"side{side}.stats", k, k, other, dt),
            gemm_kernel(f"side{side}.project_grad", k, other, k, dt),
            gemm_kernel(f"side{side}.project_exp_avg", k, other, k, dt),
            gemm_kernel(f"side{side}.project_back", k, other, k, dt),
            gemm_kernel(f"side{side}.power_iter", k, k, k, dt, count=1.0 / f),
            _solver(f"side{side}.qr", "qr", k, 4.0 / 3.0 * k**3, 1.0 / f, dt),
        ]
    ks.append(elementwise_kernel("rotated_adam", m * n, 12, dtypes.grad + 2 * dtypes.param + 5 * FP32))
    return ks


def shampoo_kernels(m: int, n: int, cfg: ShampooConfig, dtypes: StepDtypes = FP32_STEP) -> list[Kernel]:
    """Statistics, two-sided preconditioning, amortised inverse roots, AdamW grafting.

    Grafting reads the gradient (at `dtypes.grad`: the runtime casts it to fp32 once) and seven
    fp32 elements (the moments read and written, the preconditioned direction, the grafted one);
    the apply reads and writes the parameter (`dtypes.param`) and reads the fp32 direction."""
    dt, f = cfg.compute_dtype, cfg.precondition_frequency
    ks: list[Kernel] = []
    for side, (k, other) in enumerate(_preconditioned_sides(m, n, cfg.max_preconditioner_dim)):
        ks += [
            gemm_kernel(f"side{side}.stats", k, k, other, dt),
            gemm_kernel(f"side{side}.precondition", k, other, k, dt),
            _solver(f"side{side}.eigh_root", "eigh", k, 9.0 * k**3, 1.0 / f, dt),
        ]
    if cfg.grafting:
        ks.append(elementwise_kernel("adam_grafting", m * n, 12, dtypes.grad + 7 * FP32))
    ks.append(elementwise_kernel("apply", m * n, 3, 2 * dtypes.param + FP32))
    return ks


def adamw_kernels(numel: int, cfg: AdamWConfig, element_bytes: int = FP32) -> list[Kernel]:
    """One fused pass: read param, grad, two moments; write param and moments (`element_bytes` each:
    fp32, or a bf16 model's under torch's AdamW, which keeps its state in the parameters' dtype)."""
    return [elementwise_kernel("adamw", numel, 10, 7 * element_bytes)]


def adamw_matrix_kernels(m: int, n: int, cfg: AdamWConfig, dtypes: StepDtypes = FP32_STEP) -> list[Kernel]:
    """AdamW as the optimizer of an m x n matrix (the elementwise baseline's registry entry): its
    moments follow the update (`dtypes.state`), as the simulator's AdamW pass prices them."""
    return adamw_kernels(m * n, cfg, dtypes.state)


def adamw_state_bytes(m: int, n: int, cfg: AdamWConfig) -> int:
    return 2 * FP32 * m * n  # the two moments


def adamw_moments_bytes(numel: int, moment_bytes: int = FP32) -> int:
    """AdamW's two moments of `numel` elements at `moment_bytes` an element: fp32, or a bf16 model's
    under torch's AdamW, which keeps its state in the parameters' dtype."""
    return state_bytes("adamw", (numel,)) * moment_bytes // FP32


def gradient_norm_kernels(numel: int, clip: bool, element_bytes: int = FP32) -> list[Kernel]:
    """A rank's share of the global gradient norm, every step (the runtime checks it is finite
    before any update): one read of its reduced gradients (`element_bytes` each); and, with
    `max_grad_norm`, the clip: one scaling pass over them."""
    out = [elementwise_kernel("gradient norm", numel, 2, element_bytes)]
    if clip:
        out.append(elementwise_kernel("gradient clip", numel, 1, 2 * element_bytes))
    return out


def optimizer_kernels(optimizer: str, shape: tuple[int, ...], cfg: object | None = None,
                      dtypes: StepDtypes = FP32_STEP) -> list[Kernel]:
    """Kernels of one step of `optimizer` on one full parameter of `shape` (a matrix optimizer's
    registry entry says how: `MatrixOptimizer.cost_kernels`), its elementwise passes at `dtypes`
    (fp32 everywhere: the planner's pricing)."""
    cfg = cfg if cfg is not None else default_config(optimizer)
    if optimizer == "adamw":  # any shape: norms and biases too
        return adamw_kernels(math.prod(shape), cfg, dtypes.state)
    return matrix_optimizer(optimizer).part("cost_kernels")(*_matrix_shape(optimizer, shape), cfg, dtypes)


def _matrix_shape(optimizer: str, shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) != 2:
        raise SpecError(f"{optimizer} needs a 2-D matrix, got shape {shape}")
    return shape[0], shape[1]


def init_kernels(optimizer: str, shape: tuple[int, int], cfg: object | None = None) -> list[Kernel]:
    """One-off work at the first step (SOAP's initial eigendecomposition, ~9k³ per side)."""
    cfg = cfg if cfg is not None else default_config(optimizer)
    build = matrix_optimizer(optimizer).part("init_kernels")
    return [] if build is None else build(*shape, cfg)


def soap_init_kernels(m: int, n: int, cfg: SOAPConfig) -> list[Kernel]:
    return [
        _solver(f"side{i}.eigh_init", "eigh", k, 9.0 * k**3, 1.0, cfg.compute_dtype)
        for i, (k, _) in enumerate(_preconditioned_sides(m, n, cfg.max_precond_dim))
    ]


def step_flops(optimizer: str, shape: tuple[int, ...], cfg: object | None = None) -> float:
    return sum(k.flops * k.count for k in optimizer_kernels(optimizer, shape, cfg))


def row_state_bytes(optimizer: str, shape: tuple[int, ...], cfg: object | None = None) -> int:
    """The part of `state_bytes` that a shard of the matrix's rows holds its share of (the
    registry's `row_state_bytes`; all of it where the entry has none)."""
    cfg = cfg if cfg is not None else default_config(optimizer)
    part = None if optimizer == "adamw" else matrix_optimizer(optimizer).part("row_state_bytes")
    return state_bytes(optimizer, shape, cfg) if part is None else part(*_matrix_shape(optimizer, shape), cfg)


def state_bytes(optimizer: str, shape: tuple[int, ...], cfg: object | None = None) -> int:
    """fp32 optimizer state of one full parameter (docs/design.md §4.2)."""
    cfg = cfg if cfg is not None else default_config(optimizer)
    if optimizer == "adamw":  # any shape
        return adamw_state_bytes(1, math.prod(shape), cfg)
    return matrix_optimizer(optimizer).part("state_bytes")(*_matrix_shape(optimizer, shape), cfg)


def state_difference(optimizer: str, params: Iterable[ParamSpec], before: object | None,
                     now: object | None) -> str | None:
    """The first of `params` (matrices) whose optimizer state differs between two configurations of
    `optimizer` (`state_bytes`, as a plan prices it: `canzona.plan.check_plan_config`), or None:
    state kept under one fits the other (they differ at most in hyper-parameters that change seconds)."""
    if matrix_optimizer(optimizer).elementwise:  # AdamW's state has one form
        return None
    for p in one_per_shape(params):  # state is priced by shape: one comparison each
        shape = p.matrix_shape or p.shape
        there, here = state_bytes(optimizer, shape, before), state_bytes(optimizer, shape, now)
        if there != here:
            return f"{p.name}: {there} bytes of state there, {here} here"
    return None


def one_per_shape(params: Iterable[ParamSpec]) -> list[ParamSpec]:
    """The first of `params` of each matrix shape (a stack's: each of its matrices'), in order: what
    `state_difference` compares. A scheduler's lr change reaches that comparison every step
    (`groups.GroupConfigs`, which keeps its groups reduced so), over models of tens of thousands of
    expert matrices."""
    first: dict[tuple[int, ...], ParamSpec] = {}
    for p in params:
        first.setdefault(tuple(p.matrix_shape or p.shape), p)
    return list(first.values())


def update_dtype_state_bytes(optimizer: str, shape: tuple[int, ...], cfg: object | None = None) -> int:
    """Of `state_bytes`, the fp32 bytes the runtime keeps in the dtype of the update it accumulates
    (the registry entry's `update_dtype_state_bytes`; 0 where every part stays in at least fp32)."""
    cfg = cfg if cfg is not None else default_config(optimizer)
    part = matrix_optimizer(optimizer).part("update_dtype_state_bytes")
    if part is None:
        return 0
    if optimizer == "adamw":  # any shape, as `state_bytes`
        return part(1, math.prod(shape), cfg)
    return part(*_matrix_shape(optimizer, shape), cfg)


def muon_state_bytes(m: int, n: int, cfg: MuonConfig) -> int:
    return FP32 * m * n  # the momentum buffer


def soap_state_bytes(m: int, n: int, cfg: SOAPConfig) -> int:
    sides = _preconditioned_sides(m, n, cfg.max_precond_dim)
    return soap_row_state_bytes(m, n, cfg) + 2 * FP32 * sum(k * k for k, _ in sides)  # GG and Q per side


def soap_row_state_bytes(m: int, n: int, cfg: SOAPConfig) -> int:
    return 2 * FP32 * m * n  # the two moments


def shampoo_state_bytes(m: int, n: int, cfg: ShampooConfig) -> int:
    sides = _preconditioned_sides(m, n, cfg.max_preconditioner_dim)
    return 2 * FP32 * sum(k * k for k, _ in sides) + shampoo_row_state_bytes(m, n, cfg)  # statistics and root per side


def shampoo_row_state_bytes(m: int, n: int, cfg: ShampooConfig) -> int:
    return 2 * FP32 * m * n if cfg.grafting else 0  # AdamW grafting's moments


@dataclass(frozen=True)
class DeviceRate:
    """Achieved rates of one accelerator, enough to turn kernels into seconds.

    `gemm_flops` is per compute dtype: the tensor-core rate of the whole GPU at the boost clock
    (the largest GEMMs approach it times `gemm_model.sustained_clock`, the power-limited clock). With `sms` set, a GEMM is priced by its shape (`canzona.gemm_model`:
    the fastest of `gemm_model`'s tile shapes and splits, whole waves over the SMs at that rate or
    the L2 operand feed, a fixed traffic a tile and a latency a GEMM, the HBM roofline), so a small
    or short-K GEMM uses the machine less well and time never falls as a dimension grows. `solver_flops` covers eigh / QR (far below GEMM speed on GPUs and
    version dependent: a calibrated table should replace it).
    """

    name: str
    gemm_flops: dict[str, float]
    elementwise_flops: float
    hbm_bytes_per_s: float
    solver_flops: float
    launch_s: float
    source: str = ""
    sms: int | None = None
    tile: int = 128
    solver_seconds: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    # measured efficiency (of `peak_flops`) by FLOPs of one GEMM, per dtype: replaces the
    # GEMM model (canzona.gemm_model) for the dtypes it covers
    gemm_curve: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    peak_flops: dict[str, float] = field(default_factory=dict)
    # fraction of `hbm_bytes_per_s` that memory-bound (elementwise) kernels reach: the profile's
    # published copy / STREAM-style measurement (`GPUSpec.hbm_efficiency`)
    hbm_efficiency: float = 1.0
    # the GEMM model's tiles, splits, feed and fixed costs; None: square `tile` tiles, no fixed cost
    gemm_model: GemmModel | None = None
    # seconds by kernel, filled as kernels are priced: a mixture-of-experts model has tens of
    # thousands of matrices of a few shapes, priced again by every planner and simulator pass
    _seconds: dict[tuple, float] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_profile(cls, profile: HardwareProfile) -> DeviceRate:
        g = profile.gpu
        return cls(profile.name, g.gemm_flops(), g.elementwise_flops, g.hbm_bytes_per_s, g.solver_flops,
                   g.launch_s, "; ".join(profile.sources), g.sms, g.gemm_tile, profile.solver_seconds,
                   dict(profile.gemm_curve), dict(g.peak_flops), gemm_model=profile.gemm_kernels(),
                   hbm_efficiency=g.hbm_efficiency)

    def curve_efficiency(self, dtype: str, flops: float) -> float | None:
        """Measured efficiency at `flops` (the profile's `gemm_curve`); None without one."""
        return efficiency_on(self.gemm_curve.get(dtype, ()), flops)

    def solver_time(self, k: Kernel) -> float | None:
        """Measured seconds of one eigh / QR of size k, interpolated log-log in the profile's table
        and extrapolated as k**3 beyond it; None without a table for that solver."""
        table = self.solver_seconds.get(k.solver)
        if not table:
            return None
        size = k.gemm[0]
        pts = sorted(table)
        if size <= pts[0][0]:
            return pts[0][1] * (size / pts[0][0]) ** 3 if size < pts[0][0] else pts[0][1]
        if size >= pts[-1][0]:
            return pts[-1][1] * (size / pts[-1][0]) ** 3
        for (k0, t0), (k1, t1) in zip(pts, pts[1:]):
            if k0 <= size <= k1:
                w = math.log(size / k0) / math.log(k1 / k0)
                return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))
        return None

    def _gemm_seconds(self, k: Kernel) -> float:
        """One GEMM: its shape on the SMs (`canzona.gemm_model`) when `sms` is set, else the
        roofline of its FLOPs at the sustained rate and its bytes at the HBM bandwidth."""
        rate = self.gemm_flops.get(k.dtype)
        if rate is None:
            raise SpecError(f"{self.name} has no {k.dtype} GEMM rate (its profile's gpu.peak_flops has "
                            f"{', '.join(self.gemm_flops)})")
        if self.sms is None:
            return max(k.flops / rate, k.bytes / self.hbm_bytes_per_s)
        m, n, depth = k.gemm
        model = self.gemm_model if self.gemm_model is not None else square(self.tile)
        # an accumulating GEMM's epilogue reads and writes its output at the accumulator's dtype
        # where the fitted GEMMs wrote a bf16 one (canzona.gemm_model)
        extra = 2 * k.accumulate - gemm_output_bytes(k.dtype) if k.accumulate else 0.0
        chunks, at_once = k.chunks or (1, 1)
        return model.seconds(m, n, depth, rate, self.sms, k.bytes, self.hbm_bytes_per_s, DTYPE_BYTES[k.dtype],
                             epilogue_bytes=extra, chunks=chunks, at_once=at_once)

    def kernel_seconds(self, k: Kernel) -> float:
        key = (k.kind, k.flops, k.bytes, k.dtype, k.count, k.gemm, k.solver, k.accumulate,
               k.chunks)  # what prices it: not its name
        seconds = self._seconds.get(key)
        if seconds is None:
            seconds = self._seconds[key] = self._kernel_seconds(k)
        return seconds

    def _kernel_seconds(self, k: Kernel) -> float:
        if k.kind == "gemm":
            measured = self.curve_efficiency(k.dtype, k.flops)
            if measured is None or k.dtype not in self.peak_flops:
                return k.count * (self._gemm_seconds(k) + self.launch_s)
            work, rate = k.flops, self.peak_flops[k.dtype] * measured
        elif k.kind == "solver":
            measured = self.solver_time(k)
            if measured is not None:
                return k.count * (measured + self.launch_s)
            work, rate = k.flops, self.solver_flops
        else:  # memory-bound: at the bandwidth a streaming kernel achieves, not the datasheet's
            moved = k.bytes / (self.hbm_bytes_per_s * self.hbm_efficiency)
            return k.count * (max(k.flops / self.elementwise_flops, moved) + self.launch_s)
        return k.count * (max(work / rate, k.bytes / self.hbm_bytes_per_s) + self.launch_s)


    def batched_seconds(self, kernels: Sequence[Kernel], batch: int) -> float:
        """Seconds of `batch` same-shape matrices' kernels run as one batched kernel
        (`canzona.batching`): each GEMM one launch over all of them (its tiles fill the waves
        together), everything else per matrix, as the runtime's batched kernels do."""
        total = 0.0
        for k in kernels:
            if k.kind == "gemm" and batch > 1:
                m, n, depth = k.gemm
                total += self.kernel_seconds(grouped_gemm_kernel(k.name, m, n, depth, batch, k.dtype, k.count,
                                                                 accumulate=k.accumulate))
            else:
                total += batch * self.kernel_seconds(k)
        return total

    def batch_saving(self, optimizer: str, shape: tuple[int, ...], count: int, cfg: object | None = None) -> float:
        """Seconds one batched kernel over `count` matrices of `shape` saves over `count` calls
        (`cfg`: the optimizer's configuration, None: its defaults)."""
        kernels = optimizer_kernels(optimizer, shape, cfg)
        return count * sum(self.kernel_seconds(k) for k in kernels) - self.batched_seconds(kernels, count)

    def dtype_saving(self, optimizer: str, shape: tuple[int, ...], dtypes: StepDtypes,
                     cfg: object | None = None) -> float:
        """Seconds a step on one matrix of `shape` saves at a run's `dtypes` (`StepDtypes`: its
        elementwise passes on bf16 without masters) over the planner's pricing at fp32, which the
        plan's per-matrix seconds carry: what the simulator takes off each matrix's seconds. 0.0 at
        `FP32_STEP` (with masters: every figure as the plan's). Only elementwise passes depend on
        `dtypes`, and a batched kernel runs those per matrix (`batched_seconds`), so the saving
        does not change with batching."""
        if dtypes == FP32_STEP:
            return 0.0
        return sum(self.kernel_seconds(k) for k in optimizer_kernels(optimizer, shape, cfg)) \
            - sum(self.kernel_seconds(k) for k in optimizer_kernels(optimizer, shape, cfg, dtypes))


@functools.cache
def default_rate() -> DeviceRate:
    """The rates of the default hardware profile (`hardware.DEFAULT_PROFILE`), read on first use:
    what `AnalyticCost()` prices with when no profile is given (say `cost_model_for(profile)` to
    plan for another device)."""
    return DeviceRate.from_profile(load_profile(DEFAULT_PROFILE))


class CostModel(Protocol):
    """Seconds of one optimizer step on one full matrix."""

    @property
    def name(self) -> str: ...

    def seconds(self, optimizer: str, shape: tuple[int, ...]) -> float: ...


@dataclass(frozen=True)
class AnalyticCost:
    """Roofline over the kernel decomposition on a `DeviceRate`."""

    rate: DeviceRate = field(default_factory=default_rate)
    configs: dict[str, object] = field(default_factory=dict)
    # by (optimizer, shape): a model's matrices come in a few shapes
    _seconds: dict[tuple[str, tuple[int, ...]], float] = field(default_factory=dict, init=False, repr=False,
                                                              compare=False)

    @property
    def name(self) -> str:
        # the configurations are not named: a plan's placements carry the seconds and state they
        # priced (its hash changes where the configuration changes them), and a configuration that
        # changes no work (a learning rate: every runtime's matrix_config) plans as the defaults do
        return f"analytic:{self.rate.name}"

    def seconds(self, optimizer: str, shape: tuple[int, ...]) -> float:
        key = (optimizer, tuple(shape))
        if key not in self._seconds:
            cfg = self.configs.get(optimizer)
            self._seconds[key] = sum(self.rate.kernel_seconds(k) for k in optimizer_kernels(optimizer, shape, cfg))
        return self._seconds[key]


@dataclass(frozen=True)
class TableCost:
    """Measured seconds per `(optimizer, m, n, dtype)`; shapes not in the table use `fallback`."""

    table: dict[tuple[str, int, int, str], float]
    dtypes: dict[str, str]  # optimizer -> compute dtype used as the table key
    fallback: CostModel = field(default_factory=AnalyticCost)
    label: str = "measured"

    @property
    def name(self) -> str:
        return f"table:{self.label}"

    def seconds(self, optimizer: str, shape: tuple[int, ...]) -> float:
        if len(shape) == 2:
            key = (optimizer, shape[0], shape[1], self.dtypes.get(optimizer, "fp32"))
            if key in self.table:
                return self.table[key]
        return self.fallback.seconds(optimizer, shape)


def step_dtype(optimizer: str, cfg: object | None = None) -> str:
    """The dtype an optimizer's step computes in (the key of its rows in a measured table)."""
    cfg = cfg if cfg is not None else default_config(optimizer)
    return getattr(cfg, "ns_dtype", None) or getattr(cfg, "compute_dtype", "fp32")


def load_cost_table(path: str, fallback: CostModel | None = None) -> TableCost:
    """A measured table written by `benchmarks/bench_kernels.py --out` (rows of optimizer, m, n,
    dtype, seconds); shapes it lacks fall back to the analytic model."""
    from canzona.fileio import read_json

    data = read_json(path, "cost table", SpecError)
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise SpecError(f"cost table {path}: expected an object with 'rows': [[optimizer, m, n, dtype, seconds], ...]")
    table = parse_cost_rows(rows, f"cost table {path}")
    dtypes = {o: d for o, _, _, d in table}
    label = str(data.get("device", path))
    return TableCost(table, dtypes, fallback or AnalyticCost(), label)


def profile_cost_table(profile: HardwareProfile, fallback: CostModel) -> TableCost:
    """A calibrated profile's measured `optimizer_seconds`, keyed by each optimizer's default compute
    dtype (Muon's rows in bf16, not its fp32 ones); shapes and optimizers it lacks use `fallback`."""
    table = {(o, m, n, d): s for o, m, n, d, s in profile.optimizer_seconds}
    dtypes = {o: step_dtype(o) for o, _, _, _ in table if o in OPTIMIZERS}
    return TableCost(table, dtypes, fallback, profile.name)


def cost_model_for(hardware: str | Path | HardwareProfile = DEFAULT_PROFILE, table: str | Path | None = None) -> CostModel:
    """The analytic model on a hardware profile (a name, a path, or one already loaded), or measured
    seconds falling back to it: the explicit `table` when given, else the profile's own
    `optimizer_seconds` when it has them (calibrated)."""
    profile = hardware if isinstance(hardware, HardwareProfile) else load_profile(hardware)
    analytic = AnalyticCost(DeviceRate.from_profile(profile))
    if table is not None:
        return load_cost_table(str(table), fallback=analytic)
    if profile.optimizer_seconds:
        return profile_cost_table(profile, analytic)
    return analytic


def priced_with(cost_model: CostModel, optimizer: str, cfg: object | None) -> CostModel:
    """`cost_model` pricing `optimizer`'s step at configuration `cfg` (None: its defaults, and the
    model unchanged: the default path stays bit for bit what it was). The one place the planner and
    the simulator (through the planner) turn a `matrix_config` into seconds:
    - the analytic model prices the configuration's kernels (`AnalyticCost.configs`);
    - a measured table (`TableCost`: a `--cost-table`, a calibrated profile's `optimizer_seconds`) was
      measured at the optimizer's default configuration, and a row of it says nothing of another
      (five Newton-Schulz iterations timed are not ten; a larger `max_precond_dim` adds eigensolves
      the row never ran): the step is priced by the table's analytic fallback at `cfg` instead, and
      the plan records that cost model's name, not the table's;
    - any other cost model (the caller's own `CostModel`) is the caller's pricing, returned as it is."""
    if cfg is None or cfg == default_config(optimizer):
        return cost_model
    if isinstance(cost_model, AnalyticCost):
        return replace(cost_model, configs={**cost_model.configs, optimizer: cfg})
    if isinstance(cost_model, TableCost):
        return priced_with(cost_model.fallback, optimizer, cfg)
    return cost_model
