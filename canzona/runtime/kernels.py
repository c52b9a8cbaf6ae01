"""Per-matrix update kernels: what a host runs on one full matrix (docs/design.md §3; rung 2 of docs/architecture.md §5).

Written from the pinned math in `canzona.optimizers` (the config docstrings), independently of
`reference/`, so that the two check each other. A kernel maps `(grad, state, config, lr)` to an
`Update`: a full-matrix direction plus the scalars that say how every TP rank applies its chunk of
it to its own shard (`apply_update_`). State lives only with the host; the scalars do not need it:
each optimizer's `*_apply_scalars` computes them from what every TP rank knows (the matrix's shape,
its hyper-parameters and how many steps it took), so TP hosts send no scalars and receivers read
nothing back from the device (docs/design.md §6.3).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from canzona.errors import CanzonaError
from canzona.optimizers import (
    AdamWConfig,
    MuonConfig,
    ShampooConfig,
    SOAPConfig,
    matrix_optimizer,
    ns_schedule,
)

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


# The optimizer's entry points are collectives and host logic, not a graph: a compiled caller
# (`torch.compile(opt.step)`, torch's recipe for compiling an optimizer) runs them eagerly, a graph
# break, instead of dynamo failing inside them. Their kernels compile on their own (compile_kernels).
eager_only = torch.compiler.disable(
    reason="canzona's DistributedOptimizer step is collectives and host logic and runs eagerly; compile its "
           "Newton-Schulz kernels with compile_kernels=True")


@contextlib.contextmanager
def autocast_off() -> Iterator[None]:
    """The optimizer's arithmetic in the dtypes it chose, not the model's autocast dtype: loops often
    call step() inside the `torch.autocast` region of forward and backward, where matmuls would run
    in bf16 (SOAP's and Shampoo's preconditioners then fail on mixed dtypes inside the step, or a
    kernel would silently compute in lower precision). A decorator too (a fresh region per call)."""
    accelerator = torch.accelerator.current_accelerator()
    devices = ["cpu"] + ([accelerator.type] if accelerator is not None else [])
    with contextlib.ExitStack() as stack:
        for device in devices:
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def run_step(optimizer: object, closure: Callable[[], Any] | None, body: Callable[[], None]) -> Any:
    """torch.optim's `step(closure)` around the optimizer's own step (`body`): the closure in the
    caller's autocast region, as its forward expects, the step outside it (`autocast_off`). A step
    that raises drops the scale GradScaler handed over (`grad_scale`, `found_inf`): GradScaler deletes
    them only when step() returns, and left behind its next call would unscale by the product of the
    two (torch's rule for a scale set). A step refused (a CanzonaError) after GradScaler's unscale
    or inf check is a skipped step for its `update()` (`AmpMarks.refused`)."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    amp = getattr(optimizer, "_amp", None)  # GradScaler's marks (`amp_marks.AmpMarks`)
    try:
        with autocast_off():
            body()
    except BaseException as e:
        for handed in ("grad_scale", "found_inf"):
            optimizer.__dict__.pop(handed, None)
        if amp is not None and isinstance(e, CanzonaError):
            amp.refused()  # a skipped step for GradScaler's update(), as an Inf step is
        raise
    if amp is not None:
        amp.stepped()
    return loss


State = dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class Scalars:
    """How a chunk of an update is applied (`Update`'s scalars without its direction)."""

    scale: float
    decay: float
    decay_first: bool = True


@dataclass
class Update:
    """`p <- p - scale * direction`, with decoupled decay `p *= 1 - decay` before (decay_first) or
    `p -= decay * p` after the step (SOAP's order)."""

    direction: Tensor
    scale: float
    decay: float
    decay_first: bool = True

    @property
    def scalars(self) -> Scalars:
        return Scalars(scale=self.scale, decay=self.decay, decay_first=self.decay_first)

    @classmethod
    def of(cls, direction: Tensor, scalars: Scalars) -> Update:
        return cls(direction, scalars.scale, scalars.decay, scalars.decay_first)


# The registry's `scalars` part: `(shape, cfg, lr, steps) -> Scalars | None`, how every TP rank
# applies its chunk of the update a matrix of global `shape` takes at its step number `steps` (the
# steps it took before: its kernel's earlier calls with a gradient; 0: the first), None where the
# kernel returns no update. It must equal the kernel's own `Update` (the executor checks that on
# the host, each step) and read nothing the host alone holds: the receivers of the chunks compute
# it themselves, so that no TP rank reads scalars back from the device (docs/design.md §6.3).
ScalarsFn = Callable[[tuple[int, ...], Any, float, int], Scalars | None]


def update_target(master: Tensor | None, working: Tensor) -> Tensor:
    """The tensor an update goes to: the fp32 master of `working`, or `working` itself (no master).
    Weights written into the model since the last step (model.load_state_dict, a hand edit) win
    over a master that no longer matches them."""
    if master is None:
        return working
    if not torch.equal(master.to(working.dtype), working):
        master.copy_(working)
    return master


def apply_update_(param: Tensor, direction: Tensor, update: Update) -> None:
    """Apply (a chunk of) an update to (the matching shard of) a parameter, in place.

    The direction is rounded to the parameter's dtype first, so that what a TP host sends (its
    chunks, in the dtype of the parameters they update) is exactly what it applies itself; Muon's
    bf16 Newton-Schulz result widens exactly, as in `torch.optim.Muon`. A bf16 / fp16 parameter is
    updated in fp32 and rounded once: CPU kernels round half-precision arithmetic differently on
    their vectorised and scalar paths, so the result would otherwise depend on where a chunk starts
    in memory, and a shard would not equal the same rows of the whole matrix."""
    direction = direction.to(param.dtype)
    if param.dtype in (torch.bfloat16, torch.float16):
        work = param.float()
        _apply_(work, direction.float(), update)
        param.copy_(work)
        return
    _apply_(param, direction, update)


def _apply_(param: Tensor, direction: Tensor, update: Update) -> None:
    if update.decay_first:
        if update.decay:
            param.mul_(1 - update.decay)
        param.add_(direction, alpha=-update.scale)
    else:
        param.add_(direction, alpha=-update.scale)
        if update.decay:
            param.add_(param, alpha=-update.decay)


def work_dtype(t: Tensor) -> torch.dtype:
    """Second-order statistics run in the parameter's dtype, never below fp32."""
    return torch.promote_types(t.dtype, torch.float32)


# --- Muon -------------------------------------------------------------------------------------


def quintic_steps(x: Tensor, coefficients: Sequence[float] | Sequence[Sequence[float]], steps: int,
                  mm: Callable[[Tensor, Tensor], Tensor], addmm: Callable[..., Tensor]) -> Tensor:
    """`steps` quintic Newton-Schulz steps X <- a X + (b A + c A A) X, A = X X^T, on a normalised X;
    `coefficients`: one (a, b, c) for every step, or one per step (`optimizers.ns_schedule`).

    The one formulation of every Newton-Schulz here: the per-matrix kernel passes `torch.mm` /
    `torch.addmm` (the operations, in the order, of `reference/muon.py` and `torch.optim.Muon`),
    the batched one products over [k, m, n] stacks that equal them slice for slice
    (`canzona.runtime.batched`), the compiled one torch's own (`torch.compile` traces this)."""
    per_step = isinstance(coefficients[0], (tuple, list))
    for i in range(steps):
        a, b, c = coefficients[i] if per_step else coefficients
        gram = mm(x, x.mT)
        poly = addmm(gram, gram, gram, beta=b, alpha=c)
        x = addmm(x, poly, x, beta=a)
    return x


def constant_coefficients(coefficients: Sequence[float] | Sequence[Sequence[float]]) -> tuple:
    """The coefficients as nested tuples: what `torch.compile` takes as a constant (a guard on
    their values, not a graph input)."""
    return tuple(tuple(c) if isinstance(c, (tuple, list)) else c for c in coefficients)


def newton_schulz(u: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype, iterate: Callable[..., Tensor] | None = None) -> Tensor:
    """Quintic Newton-Schulz orthogonalisation of a matrix, computed in `dtype`. `iterate(x,
    coefficients, steps)` runs the iterations (default: `quintic_steps` with `torch.mm` /
    `torch.addmm`; `canzona.runtime.batched` passes a compiled one)."""
    x = u.to(dtype, copy=True)
    tall = u.size(0) > u.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    if iterate is None:
        x = quintic_steps(x, coefficients, steps, torch.mm, torch.addmm)
    else:
        x = iterate(x, constant_coefficients(coefficients), steps)
    return x.T if tall else x


def muon_lr_ratio(shape: tuple[int, ...], adjust_lr_fn: str) -> float:
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"unknown adjust_lr_fn {adjust_lr_fn!r}")


def muon_state(grad: Tensor, cfg: MuonConfig) -> State:
    """The state a first step starts from (zeros)."""
    return {"momentum_buffer": torch.zeros_like(grad)}


def muon_momentum(grad: Tensor, state: State, cfg: MuonConfig) -> Tensor:
    """Advance the momentum buffer; return what Newton-Schulz orthogonalises (Nesterov or not)."""
    if "momentum_buffer" not in state:
        state.update(muon_state(grad, cfg))
    buf = state["momentum_buffer"]
    buf.lerp_(grad, 1 - cfg.momentum)
    return grad.lerp(buf, cfg.momentum) if cfg.nesterov else buf


def muon_scalars(shape: tuple[int, ...], cfg: MuonConfig, lr: float) -> tuple[float, float]:
    """(scale, decay) of a Muon update of a matrix of `shape`."""
    return lr * muon_lr_ratio(shape, cfg.adjust_lr_fn), lr * cfg.weight_decay


def muon_apply_scalars(shape: tuple[int, ...], cfg: MuonConfig, lr: float, steps: int) -> Scalars:
    """The registry's `scalars` (see `ScalarsFn`): Muon's depend on no step (and serve its variants)."""
    scale, decay = muon_scalars(tuple(shape), cfg, lr)
    return Scalars(scale=scale, decay=decay)


def muon_update(grad: Tensor, state: State, cfg: MuonConfig, lr: float,
                orthogonalize: Callable[..., Tensor] = newton_schulz) -> Update:
    """`orthogonalize`: `newton_schulz`, or its compiled form (`canzona.runtime.batched`)."""
    u = muon_momentum(grad, state, cfg)
    ortho = orthogonalize(u, ns_schedule(cfg), cfg.ns_steps, cfg.eps, TORCH_DTYPES[cfg.ns_dtype])
    return Update.of(ortho, muon_apply_scalars(tuple(grad.shape), cfg, lr, 0))


# --- SOAP -------------------------------------------------------------------------------------


def _soap_sides(shape: tuple[int, ...], max_dim: int) -> tuple[bool, bool]:
    return shape[0] <= max_dim, shape[1] <= max_dim


def _rotate(x: Tensor, q_left: Tensor | None, q_right: Tensor | None) -> Tensor:
    """Q_L^T x Q_R (identity where a side has no preconditioner)."""
    if q_left is not None:
        x = q_left.T @ x
    if q_right is not None:
        x = x @ q_right
    return x


def _rotate_back(x: Tensor, q_left: Tensor | None, q_right: Tensor | None) -> Tensor:
    """Q_L x Q_R^T."""
    if q_left is not None:
        x = q_left @ x
    if q_right is not None:
        x = x @ q_right.T
    return x


def _soap_statistics_(g: Tensor, state: State, beta: float) -> None:
    if state["GG_L"] is not None:
        state["GG_L"].lerp_(g @ g.T, 1 - beta)
    if state["GG_R"] is not None:
        state["GG_R"].lerp_(g.T @ g, 1 - beta)


def _descending_eigenvectors(m: Tensor, eps: float) -> Tensor:
    _, vectors = torch.linalg.eigh(m + eps * torch.eye(m.size(0), dtype=m.dtype, device=m.device))
    return torch.flip(vectors, dims=[1])


def soap_refresh_(state: State) -> None:
    """One power iteration + QR per preconditioned side, with exp_avg_sq following the new order."""
    for key, gg_key, dim in (("Q_L", "GG_L", 0), ("Q_R", "GG_R", 1)):
        q, gg = state[key], state[gg_key]
        if q is None:
            continue
        order = torch.argsort(torch.diag(q.T @ gg @ q), descending=True, stable=True)
        q = q[:, order]
        state["exp_avg_sq"] = state["exp_avg_sq"].index_select(dim, order)
        state[key] = torch.linalg.qr(gg @ q).Q


def soap_state(grad: Tensor, cfg: SOAPConfig) -> State:
    """The state's fields, zero (the eigenbases too: the first call sets them)."""
    dtype = work_dtype(grad)
    left, right = _soap_sides(tuple(grad.shape), cfg.max_precond_dim)
    m, n = grad.shape

    def square(k: int, used: bool) -> Tensor | None:
        return torch.zeros(k, k, dtype=dtype, device=grad.device) if used else None
    exp = torch.zeros(grad.shape, dtype=dtype, device=grad.device)
    return {"step": 0, "exp_avg": exp, "exp_avg_sq": exp.clone(), "GG_L": square(m, left), "GG_R": square(n, right),
            "Q_L": square(m, left), "Q_R": square(n, right)}


def soap_betas(cfg: SOAPConfig) -> tuple[float, float, float]:
    """(beta1, beta2, beta_s): the moments' and the statistics' (`shampoo_beta`, or beta2) rates."""
    beta1, beta2 = cfg.betas
    return beta1, beta2, cfg.shampoo_beta if cfg.shampoo_beta >= 0 else beta2


def soap_moments_(g: Tensor, g_rot: Tensor, state: State, cfg: SOAPConfig) -> Tensor:
    """Advance the step and both moments (exp_avg unrotated, exp_avg_sq rotated); return the
    rotated denominator sqrt(exp_avg_sq) + eps."""
    beta1, beta2, _ = soap_betas(cfg)
    state["step"] += 1
    state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
    state["exp_avg_sq"].mul_(beta2).add_(g_rot * g_rot, alpha=1 - beta2)
    return state["exp_avg_sq"].sqrt().add_(cfg.eps)


def soap_scale(cfg: SOAPConfig, lr: float, step: int) -> float:
    beta1, beta2, _ = soap_betas(cfg)
    return lr * math.sqrt(1 - beta2**step) / (1 - beta1**step) if cfg.correct_bias else lr


def soap_apply_scalars(shape: tuple[int, ...], cfg: SOAPConfig, lr: float, steps: int) -> Scalars | None:
    """The registry's `scalars` (see `ScalarsFn`): no update on the first call (it only sets the
    eigenbases), then the bias-corrected scale of step `steps` (the state's `step` counts the calls
    after the first), decay after the step."""
    if steps == 0:
        return None
    return Scalars(scale=soap_scale(cfg, lr, steps), decay=lr * cfg.weight_decay, decay_first=False)


def soap_steps_taken(state: State) -> int:
    """The registry's `steps_taken`: the steps a saved, non-empty SOAP state took (its first call
    leaves `step` at 0). Reads only the scalar field, which a rank that does not host the matrix
    reads from a sharded checkpoint."""
    return int(state["step"]) + 1 if "step" in state else 0


def soap_first_call(g: Tensor, state: State, cfg: SOAPConfig) -> None:
    """The first call: statistics of the first gradient and the eigenbases from them."""
    left, right = _soap_sides(tuple(g.shape), cfg.max_precond_dim)
    state.update(soap_state(g, cfg))
    _soap_statistics_(g, state, soap_betas(cfg)[2])
    state["Q_L"] = _descending_eigenvectors(state["GG_L"], cfg.eig_eps) if left else None
    state["Q_R"] = _descending_eigenvectors(state["GG_R"], cfg.eig_eps) if right else None


def soap_update(grad: Tensor, state: State, cfg: SOAPConfig, lr: float) -> Update | None:
    """None on the first call, which only initialises the eigenbases (no update, no decay)."""
    g = grad.to(work_dtype(grad))
    if "step" not in state:
        soap_first_call(g, state, cfg)
        return None
    q_left, q_right = state["Q_L"], state["Q_R"]
    g_rot = _rotate(g, q_left, q_right)
    denom = soap_moments_(g, g_rot, state, cfg)
    step = state["step"]
    direction = _rotate_back(_rotate(state["exp_avg"], q_left, q_right) / denom, q_left, q_right)
    _soap_statistics_(g, state, soap_betas(cfg)[2])
    if step % cfg.precondition_frequency == 0:
        soap_refresh_(state)
    return Update.of(direction, soap_apply_scalars(tuple(g.shape), cfg, lr, step))


# --- Shampoo ----------------------------------------------------------------------------------


def inverse_root(s: Tensor, root: int, eps: float) -> Tensor:
    """(S + eps I)^(-1/root) of a symmetric PSD matrix, eigenvalues clamped at zero first."""
    values, vectors = torch.linalg.eigh(s)
    powered = (values.clamp(min=0) + eps).pow(-1.0 / root)
    return (vectors * powered) @ vectors.T


def shampoo_state(grad: Tensor, cfg: ShampooConfig) -> State:
    """The state a first step starts from: zero statistics, identity roots."""
    dtype = work_dtype(grad)
    m, n = grad.shape
    max_dim = cfg.max_preconditioner_dim
    eye = lambda k: torch.eye(k, dtype=dtype, device=grad.device)  # noqa: E731
    zeros = lambda k: torch.zeros(k, k, dtype=dtype, device=grad.device)  # noqa: E731
    exp = torch.zeros(grad.shape, dtype=dtype, device=grad.device)
    return {"step": 0, "L": zeros(m) if m <= max_dim else None, "R": zeros(n) if n <= max_dim else None,
            "L_root": eye(m) if m <= max_dim else None, "R_root": eye(n) if n <= max_dim else None,
            "exp_avg": exp, "exp_avg_sq": exp.clone()}


def check_shampoo(cfg: ShampooConfig) -> None:
    if cfg.grafting and cfg.betas[1] == 1:
        raise ValueError("Shampoo grafting needs betas[1] < 1 (its AdamW second moment would be 0/0)")


def shampoo_accumulate_(statistic: Tensor, outer: Tensor, cfg: ShampooConfig) -> None:
    """L (or R) <- L + G G^T if betas[1] == 1, else the moving average with rate betas[1]."""
    beta2 = cfg.betas[1]
    if beta2 == 1:
        statistic.add_(outer)
    else:
        statistic.mul_(beta2).add_(outer, alpha=1 - beta2)


def shampoo_step(g: Tensor, state: State, cfg: ShampooConfig) -> int:
    """Start the state on the first call; advance and return the step."""
    if "step" not in state:
        state.update(shampoo_state(g, cfg))
    state["step"] += 1
    return state["step"]


def shampoo_refresh_(state: State, cfg: ShampooConfig, step: int) -> None:
    """New inverse roots every `precondition_frequency` steps, from the first."""
    if (step - 1) % cfg.precondition_frequency == 0:
        for key in ("L", "R"):
            if state[key] is not None:
                state[f"{key}_root"] = inverse_root(state[key], cfg.root_order, cfg.epsilon)


def shampoo_graft(p: Tensor, g: Tensor, state: State, cfg: ShampooConfig, step: int) -> Tensor:
    """P rescaled to the norm of the bias-corrected AdamW direction (grafting), or P."""
    if not cfg.grafting:
        return p
    beta1, beta2 = cfg.betas
    state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
    state["exp_avg_sq"].mul_(beta2).add_(g * g, alpha=1 - beta2)
    adam = (state["exp_avg"] / (1 - beta1**step)) / ((state["exp_avg_sq"] / (1 - beta2**step)).sqrt() + cfg.graft_eps)
    p_norm = p.norm()
    return p * (adam.norm() / p_norm) if p_norm > 0 else torch.zeros_like(p)


def shampoo_apply_scalars(shape: tuple[int, ...], cfg: ShampooConfig, lr: float, steps: int) -> Scalars:
    """The registry's `scalars` (see `ScalarsFn`): the learning rate and decay, at every step."""
    return Scalars(scale=lr, decay=lr * cfg.weight_decay)


def shampoo_update(grad: Tensor, state: State, cfg: ShampooConfig, lr: float) -> Update:
    check_shampoo(cfg)
    g = grad.to(work_dtype(grad))
    step = shampoo_step(g, state, cfg)
    for key, outer in (("L", lambda: g @ g.T), ("R", lambda: g.T @ g)):
        if state[key] is not None:
            shampoo_accumulate_(state[key], outer(), cfg)
    shampoo_refresh_(state, cfg, step)
    p = g
    if state["L_root"] is not None:
        p = state["L_root"] @ p
    if state["R_root"] is not None:
        p = p @ state["R_root"]
    return Update.of(shampoo_graft(p, g, state, cfg, step), shampoo_apply_scalars(tuple(g.shape), cfg, lr, step))


# --- AdamW (elementwise, applied to shards directly) ------------------------------------------


def adamw_state(param: Tensor) -> State:
    """The state a first step starts from (zeros, in the dtype of what it updates)."""
    return {"step": 0, "exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}


def adamw_initial_state(grad: Tensor, cfg: AdamWConfig) -> State:
    """AdamW as the matrices' optimizer (its registry entry's `initial_state`)."""
    return adamw_state(grad)


class StepBetas:
    """A group's AdamW betas for one step (`groups.group_betas`'s), given to `adamw_step_` for each
    of the group's pieces: a tensor beta1 is cast to the moments' device and dtype once per (device,
    dtype), `non_blocking`, as torch.optim.AdamW's single-tensor step casts it once (its
    `beta1_dict`), not once per piece (CPU betas of CUDA parameters: a blocking copy each)."""

    def __init__(self, betas: tuple[Any, Any]) -> None:
        self.beta1, self.beta2 = betas
        self._beta1_as: dict[tuple[torch.device, torch.dtype], Tensor] = {}

    def beta1_as(self, like: Tensor) -> Any:
        """beta1 for the lerp of `like` (a moment): a tensor in its device and dtype, or the number."""
        if not isinstance(self.beta1, Tensor):
            return self.beta1
        key = (like.device, like.dtype)
        cast = self._beta1_as.get(key)
        if cast is None:
            cast = self._beta1_as[key] = self.beta1.to(device=like.device, dtype=like.dtype, non_blocking=True)
        return cast


def adamw_step_(param: Tensor, grad: Tensor, state: State, cfg: AdamWConfig, lr: float,
                betas: tuple[Any, Any] | StepBetas | None = None) -> None:
    """torch.optim.AdamW's single-tensor step, in the same operation order. `betas`: the group's
    as given (`groups.group_betas`, or a `StepBetas` of them shared by the group's pieces in a
    step; None: `cfg.betas`): a 0-d tensor beta computes as torch's step computes with it (beta1 in
    the state's dtype for the lerp, the bias corrections in its dtype)."""
    if "step" not in state:
        state.update(adamw_state(param))
    given = StepBetas(cfg.betas if betas is None else betas) if not isinstance(betas, StepBetas) else betas
    beta1, beta2 = given.beta1, given.beta2
    state["step"] += 1
    step = state["step"]
    param.mul_(1 - lr * cfg.weight_decay)
    exp_avg = state["exp_avg"]
    exp_avg.lerp_(grad, 1 - given.beta1_as(exp_avg))
    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    denom = (state["exp_avg_sq"].sqrt() / (1 - beta2**step) ** 0.5).add_(cfg.eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def matrix_kernel(optimizer: str) -> Callable[..., Update | None]:
    """The runtime kernel of a matrix optimizer (its registry entry's `kernel`)."""
    return matrix_optimizer(optimizer).part("kernel")


def initial_state(optimizer: str, grad: Tensor, cfg: Any) -> State:
    """A matrix's state before its first step, from a gradient of its shape and dtype."""
    return matrix_optimizer(optimizer).part("initial_state")(grad, cfg)
