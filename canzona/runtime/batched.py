"""Batched kernels: same-shape matrices of one host as one kernel (docs/design.md §8.7).

The executor (`executor.MatrixStep`) hands a batched kernel the matrices of one compute window that
share shape, dtype, hyper-parameters and state layout; the kernel runs their GEMMs as one `bmm` /
`baddbmm` over a [k, m, n] stack, and returns what the per-matrix kernel (the registry's `kernel`)
returns for each matrix, bit for bit on CPU (tests/runtime/test_batched_kernels.py). What that
takes:

- every matrix of a stack starts 64-byte aligned, as a fresh allocation does (`empty_stack`): MKL's
  GEMM rounds differently when an operand or the result is not (e.g. A @ A^T of a 7 x 300 matrix
  stored one float off its alignment), and `torch.stack` packs matrices back to back;
- every matrix of a stack keeps the layout (row- or column-major) of the tensor it copies, so BLAS
  gets the same transposes as in the per-matrix call;
- a product of fewer than 400 multiply-adds per matrix runs per matrix (`bmm`, `baddbmm`): below
  that, torch's CPU `bmm` / `baddbmm` run a plain loop of their own instead of BLAS, which sums in
  another order than `mm`'s GEMM (and rounds `beta * C + alpha * AB` on its own);
- elementwise work and reductions (momentum, Adam moments, norms, grafting) stay per matrix, on
  slices of the stacks: they cost little, and a slice is exactly the tensor the per-matrix kernel
  sees, so their vectorised loops split the same way;
- eigendecompositions and QR stay per matrix (`soap_update_batched`, `shampoo_update_batched`).

On CUDA the same code runs; cuBLAS picks its batched algorithms on its own, so there batching is
exact only up to rounding. `compiled_kernels` wraps the Newton-Schulz iterations in `torch.compile`
instead (numerically close, not bit-identical: inductor fuses and reorders the arithmetic).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from canzona.batching import MAX_BATCH_NUMEL, batches  # noqa: F401  (re-exported: the runtime's batching rules)
from canzona.errors import CanzonaError
from canzona.optimizers import MuonConfig, ShampooConfig, SOAPConfig, matrix_optimizer, ns_schedule
from canzona.runtime.kernels import (
    TORCH_DTYPES,
    State,
    Update,
    check_shampoo,
    constant_coefficients,
    muon_apply_scalars,
    muon_momentum,
    muon_update,
    newton_schulz,
    quintic_steps,
    shampoo_accumulate_,
    shampoo_apply_scalars,
    shampoo_graft,
    shampoo_refresh_,
    shampoo_step,
    soap_apply_scalars,
    soap_betas,
    soap_first_call,
    soap_moments_,
    soap_refresh_,
    work_dtype,
)

ALIGN_BYTES = 64  # c10's CPU allocator starts every allocation on a 64-byte boundary
# aten's bmm_out_or_baddbmm_ (LinearAlgebra.cpp): below this many multiply-adds per matrix, CPU bmm
# and baddbmm run their own triple loop, not BLAS
CPU_BMM_LOOP_BELOW = 400

Kernel = Callable[[Tensor, State, Any, float], Update | None]
BatchedKernel = Callable[[Sequence[Tensor], Sequence[State], Any, float], list[Update | None]]


# --- aligned stacks and the products over them ------------------------------------------------


def _layout(t: Tensor) -> str | None:
    """The layout of a matrix: row-major ("row"), column-major ("col") or neither (None)."""
    rows, cols = t.shape
    if t.stride() == (cols, 1):
        return "row"
    if t.stride() == (1, rows):
        return "col"
    return None


def empty_stack(k: int, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                layout: str = "row") -> Tensor:
    """An empty [k, rows, cols] stack whose matrices each start 64-byte aligned (the batch stride
    rounded up), laid out row- or column-major. Contiguous where no rounding was needed."""
    rows, cols = shape
    unit = max(1, ALIGN_BYTES // dtype.itemsize)
    stride = -(-rows * cols // unit) * unit
    inner = (1, rows) if layout == "col" else (cols, 1)
    return torch.empty(k * stride, dtype=dtype, device=device).as_strided((k, rows, cols), (stride, *inner))


def stack(ts: Sequence[Tensor], dtype: torch.dtype | None = None) -> Tensor:
    """The matrices `ts` (one shape and layout) as an aligned stack, converted to `dtype` as `.to`
    converts."""
    like = ts[0]
    layout = _layout(like)
    if layout is None or any(t.shape != like.shape or t.stride() != like.stride() for t in ts):
        raise RuntimeError("batched kernels stack matrices of one shape and layout (the batch key says so)")
    out = empty_stack(len(ts), like.shape, dtype or like.dtype, like.device, layout)
    for o, t in zip(out, ts):
        o.copy_(t)
    return out


def _per_matrix(a: Tensor, b: Tensor) -> bool:
    # On CPU with more than one thread, torch's GEMM of one matrix splits it across the threads
    # with other kernels than a batched GEMM, which gives each matrix one thread: measured on an
    # AVX-512 / AMX Xeon (2 threads, 96 x 96 x 96: baddbmm and addmm round differently), though
    # not on an AVX2 EPYC. In bf16 / fp16 the batched GEMM (oneDNN's) rounds otherwise than the
    # single one even on one thread: on the same Xeon about 1 in 500 products of 16 x 16 x 16
    # bf16 matrices differ in a last bit (tests/runtime/test_batched_kernels.py). The per-matrix
    # products are then the only bit-identical batch.
    return a.device.type == "cpu" and (a.size(1) * a.size(2) * b.size(2) < CPU_BMM_LOOP_BELOW
                                       or torch.get_num_threads() > 1
                                       or a.dtype in (torch.bfloat16, torch.float16))


def bmm(a: Tensor, b: Tensor) -> Tensor:
    """a @ b over stacks, each matrix bit-identical to `torch.mm` of the slices (on CPU)."""
    out = empty_stack(a.size(0), (a.size(1), b.size(2)), a.dtype, a.device)
    if _per_matrix(a, b):
        for o, x, y in zip(out, a, b):
            torch.mm(x, y, out=o)
    else:
        torch.bmm(a, b, out=out)
    return out


def baddbmm(c: Tensor, a: Tensor, b: Tensor, *, beta: float, alpha: float = 1.0) -> Tensor:
    """beta c + alpha a @ b over stacks, each matrix bit-identical to `torch.addmm` (on CPU).
    Where the output is padded (not contiguous) torch's CPU baddbmm runs `addmm_` per matrix
    itself; where it is contiguous, MKL's strided batched GEMM, which equals its GEMM on aligned
    matrices."""
    out = empty_stack(a.size(0), (a.size(1), b.size(2)), a.dtype, a.device)
    if _per_matrix(a, b):
        for o, z, x, y in zip(out, c, a, b):
            torch.addmm(z, x, y, beta=beta, alpha=alpha, out=o)
    else:
        torch.baddbmm(c, a, b, beta=beta, alpha=alpha, out=out)
    return out


# --- Muon -------------------------------------------------------------------------------------


def newton_schulz_batched(us: Sequence[Tensor], coefficients: tuple[float, float, float], steps: int,
                          eps: float, dtype: torch.dtype) -> Tensor:
    """`kernels.newton_schulz` of k same-shape matrices at once: a [k, m, n] stack whose matrix i is
    `newton_schulz(us[i], ...)` bit for bit (on CPU)."""
    x = stack(us, dtype)
    tall = x.size(1) > x.size(2)
    if tall:
        x = x.mT
    # each matrix's own Frobenius norm, reduced exactly as the per-matrix kernel reduces it (one
    # reduction over all dimensions splits across threads differently from one per matrix)
    norms = torch.stack([m.norm() for m in x]).clamp(min=eps)
    x.div_(norms.view(-1, 1, 1))
    x = quintic_steps(x, coefficients, steps, bmm, baddbmm)
    return x.mT if tall else x


def muon_update_batched(grads: Sequence[Tensor], states: Sequence[State], cfg: MuonConfig, lr: float,
                        orthogonalize: Callable[..., Tensor] = newton_schulz_batched) -> list[Update]:
    """`kernels.muon_update` of same-shape matrices: momentum per matrix (elementwise), one batched
    Newton-Schulz."""
    us = [muon_momentum(g, s, cfg) for g, s in zip(grads, states)]
    ortho = orthogonalize(us, ns_schedule(cfg), cfg.ns_steps, cfg.eps, TORCH_DTYPES[cfg.ns_dtype])
    scalars = muon_apply_scalars(tuple(grads[0].shape), cfg, lr, 0)
    return [Update.of(o, scalars) for o in ortho]


# --- SOAP -------------------------------------------------------------------------------------


def _rotate(x: Tensor, q_left: Tensor | None, q_right: Tensor | None) -> Tensor:
    """Q_L^T x Q_R over stacks (`kernels._rotate`)."""
    if q_left is not None:
        x = bmm(q_left.mT, x)
    if q_right is not None:
        x = bmm(x, q_right)
    return x


def _rotate_back(x: Tensor, q_left: Tensor | None, q_right: Tensor | None) -> Tensor:
    """Q_L x Q_R^T over stacks (`kernels._rotate_back`)."""
    if q_left is not None:
        x = bmm(q_left, x)
    if q_right is not None:
        x = bmm(x, q_right.mT)
    return x


def _stacked(states: Sequence[State], key: str) -> Tensor | None:
    """The field `key` of every state as a stack (None where the matrices have no such side)."""
    return None if states[0][key] is None else stack([s[key] for s in states])


def soap_update_batched(grads: Sequence[Tensor], states: Sequence[State], cfg: SOAPConfig,
                        lr: float) -> list[Update | None]:
    """`kernels.soap_update` of same-shape matrices at one step: the eight products of a step
    (rotations in and out, statistics) batched; moments per matrix. Per matrix, too: the first
    call and the refresh every `precondition_frequency` steps, whose eigh and QR torch batches by
    copying the matrices back to back (misaligned, see the module's docstring: measured to round
    differently for odd sizes) and, on CUDA, by another algorithm (Jacobi) for small matrices."""
    gs = [g.to(work_dtype(g)) for g in grads]
    if "step" not in states[0]:  # every state of a batch is at the same step (the batch key)
        for g, s in zip(gs, states):
            soap_first_call(g, s, cfg)
        return [None] * len(gs)
    q_left, q_right = _stacked(states, "Q_L"), _stacked(states, "Q_R")
    g_stack = stack(gs)
    g_rot = _rotate(g_stack, q_left, q_right)
    denoms = [soap_moments_(g, r, s, cfg) for g, r, s in zip(gs, g_rot, states)]
    step = states[0]["step"]
    rotated = _rotate(stack([s["exp_avg"] for s in states]), q_left, q_right)
    quotient = empty_stack(len(gs), rotated.shape[1:], rotated.dtype, rotated.device)
    for out, r, d in zip(quotient, rotated, denoms):
        torch.div(r, d, out=out)
    directions = _rotate_back(quotient, q_left, q_right)
    _statistics_(g_stack, states, soap_betas(cfg)[2])
    if step % cfg.precondition_frequency == 0:
        for s in states:
            soap_refresh_(s)
    scalars = soap_apply_scalars(tuple(gs[0].shape), cfg, lr, step)
    return [Update.of(d, scalars) for d in directions]


def _statistics_(g: Tensor, states: Sequence[State], beta: float) -> None:
    """`kernels._soap_statistics_` with the outer products batched."""
    for key, left, right in (("GG_L", g, g.mT), ("GG_R", g.mT, g)):
        if states[0][key] is not None:
            for s, outer in zip(states, bmm(left, right)):
                s[key].lerp_(outer, 1 - beta)


# --- Shampoo ----------------------------------------------------------------------------------


def shampoo_update_batched(grads: Sequence[Tensor], states: Sequence[State], cfg: ShampooConfig,
                           lr: float) -> list[Update]:
    """`kernels.shampoo_update` of same-shape matrices: the statistics' outer products and the
    preconditioning L_root G R_root batched; the inverse roots per matrix (eigh, as SOAP's); the
    grafting per matrix (elementwise and norms)."""
    check_shampoo(cfg)
    gs = [g.to(work_dtype(g)) for g in grads]
    step = [shampoo_step(g, s, cfg) for g, s in zip(gs, states)][0]
    g_stack = stack(gs)
    for key, left, right in (("L", g_stack, g_stack.mT), ("R", g_stack.mT, g_stack)):
        if states[0][key] is not None:
            for s, outer in zip(states, bmm(left, right)):
                shampoo_accumulate_(s[key], outer, cfg)
    for s in states:
        shampoo_refresh_(s, cfg, step)
    p = g_stack
    left, right = _stacked(states, "L_root"), _stacked(states, "R_root")
    if left is not None:
        p = bmm(left, p)
    if right is not None:
        p = bmm(p, right)
    scalars = shampoo_apply_scalars(tuple(gs[0].shape), cfg, lr, step)
    return [Update.of(shampoo_graft(d, g, s, cfg, step), scalars) for d, g, s in zip(p, gs, states)]


# --- which matrices batch together ------------------------------------------------------------


_ALONE = object()  # a tensor a stack cannot copy as it is


def batch_key(grad: Tensor, state: State) -> Hashable | None:
    """What matrices of one batch share besides hyper-parameters: shape, dtype, device and layout of
    the gradient and of every tensor of the state, and the state's scalars by value (SOAP's and
    Shampoo's step decides what a call does). None: the matrix runs alone (a matrix neither row- nor
    column-major, which a stack cannot copy as it is; a field that is not hashable)."""
    fields: list[Hashable] = [("", _tensor_key(grad))]
    for name in sorted(state):
        value = state[name]
        if isinstance(value, Tensor):
            value = value.item() if value.dim() == 0 else _tensor_key(value)
        fields.append((name, value))
    key = tuple(fields)
    if any(value is _ALONE for _, value in fields):
        return None
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _tensor_key(t: Tensor) -> Hashable:
    layout = _layout(t) if t.dim() == 2 else tuple(t.stride())
    return _ALONE if layout is None else (tuple(t.shape), t.dtype, t.device, layout)


# --- torch.compile ----------------------------------------------------------------------------


def check_compile(device_types: Iterable[str]) -> None:
    """Raise one `CanzonaError` when `torch.compile`'s default backend (inductor) cannot run here:
    at construction, not at the first step. Inductor compiles C++ on CPU and Triton on CUDA."""
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        raise CanzonaError("compile_kernels=True: torch.compile does not support this Python / torch build "
                           "(torch._dynamo.is_dynamo_supported() is False); leave compile_kernels off")
    for device in sorted(set(device_types)):
        reason = _inductor_missing(device)
        if reason is not None:
            raise CanzonaError(f"compile_kernels=True: torch.compile (inductor) cannot compile for {device}: "
                               f"{reason}; leave compile_kernels off or install it")


def _inductor_missing(device: str) -> str | None:
    if device == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()  # runs `<compiler> --version` for each candidate
        except Exception as e:  # noqa: BLE001 - InvalidCxxCompiler, or an internal API that moved
            return f"no working C++ compiler ({type(e).__name__}: {e}; inductor uses $CXX or g++)"
        return None
    if device == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "Triton is not installed"
    return None  # other devices: torch.compile says for itself at the first step


def _quintic_mm(x: Tensor, coefficients: tuple[float, float, float], steps: int) -> Tensor:
    return quintic_steps(x, coefficients, steps, torch.mm, torch.addmm)


def _quintic_bmm(x: Tensor, coefficients: tuple[float, float, float], steps: int) -> Tensor:
    return quintic_steps(x, coefficients, steps, torch.bmm, torch.baddbmm)


@functools.cache
def _compiled(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    # one compiled function per process (cache): every optimizer shares its compiled graphs
    return torch.compile(fn)


def newton_schulz_compiled(u: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                           dtype: torch.dtype) -> Tensor:
    """`kernels.newton_schulz` with its iterations compiled."""
    return newton_schulz(u, coefficients, steps, eps, dtype, iterate=_compiled(_quintic_mm))


def newton_schulz_batched_compiled(us: Sequence[Tensor], coefficients: tuple[float, float, float], steps: int,
                                   eps: float, dtype: torch.dtype) -> Tensor:
    """`newton_schulz_batched` with its iterations compiled (torch's own bmm: nothing to align)."""
    x = torch.stack([u.to(dtype) for u in us])
    tall = x.size(1) > x.size(2)
    if tall:
        x = x.mT
    x = x / torch.stack([m.norm() for m in x]).clamp(min=eps).view(-1, 1, 1)
    x = _compiled(_quintic_bmm)(x, constant_coefficients(coefficients), steps)
    return x.mT if tall else x


def muon_compiled() -> tuple[Kernel, BatchedKernel]:
    """Muon's kernels with the Newton-Schulz iterations through `torch.compile` (the registry's
    `compiled`)."""
    return (functools.partial(muon_update, orthogonalize=newton_schulz_compiled),
            functools.partial(muon_update_batched, orthogonalize=newton_schulz_batched_compiled))


def matrix_kernels(optimizer: str, *, batch: bool, compile: bool) -> tuple[Kernel, BatchedKernel | None]:
    """The per-matrix kernel and the batched one (None: every matrix alone, also for an optimizer
    without one) the executor runs. `compile`: through `torch.compile` where the optimizer's entry
    has a compiled form (Muon's Newton-Schulz); SOAP and Shampoo run eager: their time is GEMMs,
    eigh and QR, which inductor calls as they are."""
    entry = matrix_optimizer(optimizer)
    kernel: Kernel = entry.part("kernel")
    batched: BatchedKernel | None = entry.part("batched") if batch else None
    compiled = entry.part("compiled") if compile else None
    if compiled is not None:
        kernel, compiled_batched = compiled()
        if batched is not None:
            batched = compiled_batched
    return kernel, batched
