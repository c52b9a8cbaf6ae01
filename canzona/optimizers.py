"""Optimizer names and hyper-parameters (docs/design.md §3), defined once, and the registry of
matrix optimizers (`MATRIX_REGISTRY`): one entry per optimizer naming everything the toolkit
dispatches on (docs/extending.md: adding one).

The cost model reads the fields that drive work (NS steps, preconditioner dims and frequencies,
compute dtypes); the reference optimizers and runtime kernels take their defaults from here too.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from canzona.choices import check_choice
from canzona.errors import SpecError

# Newton-Schulz coefficients per iteration, by name (`ns_coefficient_type`; "simple" is the
# config's one `ns_coefficients` triple at every iteration, as torch.optim.Muon runs it)
NS_COEFFICIENT_SETS: dict[str, tuple[tuple[float, float, float], ...]] = {
    # five iterations tuned by You Jiacheng for modded-nanogpt (bf16), each its own quintic
    "quintic": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)),
    # Polar Express (Amsel et al. 2025, arXiv 2505.16932): minimax-optimal quintics per iteration,
    # five of them as the authors' sets run in nanochat and modded-nanogpt
    "polar_express": ((8.156554524902461, -22.48329292557795, 15.878769915207462),
                      (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                      (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                      (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                      (2.3465413258596377, -1.7097828382687081, 0.42323551169305323)),
}
NS_COEFFICIENT_TYPES = ("simple", *NS_COEFFICIENT_SETS)


def ns_schedule(cfg: Any) -> tuple[tuple[float, float, float], ...]:
    """The (a, b, c) of each of `cfg.ns_steps` Newton-Schulz iterations (`coefficient_schedule`)."""
    return coefficient_schedule(cfg.ns_coefficient_type, cfg.ns_coefficients, cfg.ns_steps)


def coefficient_schedule(kind: str, coefficients: Any, steps: int) -> tuple[tuple[float, float, float], ...]:
    """"simple" repeats `coefficients`; a named set gives the i-th of its quintics, its last one
    repeating beyond its end."""
    if kind == "simple":
        return (tuple(coefficients),) * steps
    sets = NS_COEFFICIENT_SETS[kind]
    return tuple(sets[min(i, len(sets) - 1)] for i in range(steps))


@dataclass(frozen=True)
class MuonConfig:
    """Same defaults and math as `torch.optim.Muon`. One step on a matrix p with gradient G:

        buf <- buf.lerp(G, 1 - momentum)                      (buf starts at zero)
        u   <- G.lerp(buf, momentum) if nesterov else buf
        X   <- u in ns_dtype, transposed if rows > cols, divided by max(||X||_F, eps)
        ns_steps times:  A = X X^T;  B = b A + c A A;  X = a X + B X
            ((a, b, c): `ns_coefficients` at every iteration with ns_coefficient_type "simple",
            torch's; else iteration i's of the named set, `ns_schedule`)
        O   <- X transposed back if it was transposed
        r   <- sqrt(max(1, rows / cols))  ("original")  or  0.2 sqrt(max(rows, cols))  ("match_rms_adamw")
        p   <- p * (1 - lr * weight_decay);   p <- p - lr * r * O
    """

    lr: float = 1e-3
    weight_decay: float = 0.1
    momentum: float = 0.95
    nesterov: bool = True
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    eps: float = 1e-7
    ns_steps: int = 5
    adjust_lr_fn: str = "original"  # or "match_rms_adamw"; None (torch.optim.Muon's default): "original"
    ns_dtype: str = "bf16"
    ns_coefficient_type: str = "simple"  # or "quintic", "polar_express" (NS_COEFFICIENT_SETS)


@dataclass(frozen=True)
class SOAPConfig:
    """Defaults and math of the SOAP paper's reference code (Vyas et al. 2024), 2-D case.

    A side of size k (rows: L, m x m; columns: R, n x n) is preconditioned iff k <= max_precond_dim;
    other sides use the identity. beta_s = shampoo_beta if shampoo_beta >= 0 else betas[1].
    project(X) = Q_L^T X Q_R;  project_back(X) = Q_L X Q_R^T  (identity factors skipped).

    First call (state empty): exp_avg, exp_avg_sq = 0 (m x n); GG_L, GG_R = 0; step = 0;
        GG_L <- GG_L.lerp(G G^T, 1 - beta_s);  GG_R <- GG_R.lerp(G^T G, 1 - beta_s);
        Q_d <- eigenvectors of (GG_d + eig_eps I) by descending eigenvalue;  NO parameter update
        (no weight decay either).
    Later calls:
        Gp = project(G);  step += 1
        exp_avg    <- betas[0] exp_avg + (1 - betas[0]) G            (unrotated)
        exp_avg_sq <- betas[1] exp_avg_sq + (1 - betas[1]) Gp^2     (rotated)
        N = project_back(project(exp_avg) / (sqrt(exp_avg_sq) + eps))
        s = lr * sqrt(1 - betas[1]^step) / (1 - betas[0]^step)  if correct_bias else lr
        p <- p - s N;   p <- p - lr * weight_decay * p
        GG_d <- lerp as above with this G;
        if step % precondition_frequency == 0, for each preconditioned side d (L: dim 0, R: dim 1):
            order = argsort(diag(Q_d^T GG_d Q_d), descending);  Q_d <- Q_d[:, order];
            exp_avg_sq <- exp_avg_sq permuted along dim d by order;  Q_d <- qr(GG_d Q_d).Q
    """

    lr: float = 3e-3
    betas: tuple[float, float] = (0.95, 0.95)
    shampoo_beta: float = -1.0  # < 0: use betas[1]
    eps: float = 1e-8
    weight_decay: float = 0.01
    precondition_frequency: int = 10
    max_precond_dim: int = 10000
    correct_bias: bool = True
    eig_eps: float = 1e-30  # added to GG's diagonal before the first eigendecomposition
    compute_dtype: str = "fp32"


@dataclass(frozen=True)
class ShampooConfig:
    """Shampoo as pinned here (defaults of the Distributed Shampoo README example), 2-D case.

    A side of size k is preconditioned iff k <= max_preconditioner_dim; other sides use the
    identity. root(S) = V diag((max(lambda, 0) + epsilon)^(-1 / root_order)) V^T from eigh(S).
    State: step = 0; L = 0 (m x m), R = 0 (n x n); L_root = R_root = I; m_g = v_g = 0 (m x n).

    Each call with gradient G:
        step += 1
        L <- L + G G^T,  R <- R + G^T G             if betas[1] == 1
        L <- b L + (1 - b) G G^T (same for R)       otherwise, b = betas[1]
        if (step - 1) % precondition_frequency == 0:  L_root <- root(L);  R_root <- root(R)
        P = L_root G R_root
        if grafting (AdamW direction, bias-corrected):
            m_g <- betas[0] m_g + (1 - betas[0]) G;   v_g <- betas[1] v_g + (1 - betas[1]) G^2
            A = (m_g / (1 - betas[0]^step)) / (sqrt(v_g / (1 - betas[1]^step)) + graft_eps)
            D = P * ||A||_F / ||P||_F            (D = 0 where ||P||_F == 0)
        else:  D = P
        p <- p * (1 - lr * weight_decay);   p <- p - lr * D
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    epsilon: float = 1e-12
    weight_decay: float = 0.0
    precondition_frequency: int = 100
    max_preconditioner_dim: int = 8192
    root_order: int = 4  # update L^{-1/root_order} G R^{-1/root_order}
    grafting: bool = True
    graft_eps: float = 1e-8
    compute_dtype: str = "fp32"


@dataclass(frozen=True)
class NorMuonConfig(MuonConfig):
    """NorMuon (Li et al. 2025, arXiv 2510.05491): Muon whose orthogonalised update is normalised
    per neuron (row) by a running second moment, then rescaled to the norm it had (as the authors'
    code does), then applied as Muon's. One step on a matrix p (rows x cols) with gradient G:

        buf <- buf.lerp(G, 1 - momentum)                      (buf starts at zero)
        u   <- G.lerp(buf, momentum) if nesterov else buf
        O   <- Newton-Schulz of u exactly as Muon's (ns_dtype, ns_coefficients or its type, ns_steps, eps),
               then in fp32 (fp64 for fp64 gradients)
        v   <- v.lerp(mean over columns of O * O, 1 - beta2)  (v: rows x 1, starts at zero)
        N   <- O / (sqrt(v) + normuon_eps)                     (each row by its own v)
        N   <- N * (||O||_F / (||N||_F + normuon_eps))
        r   <- as Muon's adjust_lr_fn ("original": sqrt(max(1, rows / cols)))
        p   <- p * (1 - lr * weight_decay);   p <- p - lr * r * N
    """

    # Muon's fields and defaults (inherited), and:
    beta2: float = 0.95
    normuon_eps: float = 1e-10


@dataclass(frozen=True)
class AdamWConfig:
    """Same defaults as `torch.optim.AdamW`."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    compute_dtype: str = "fp32"


# --- the registry of matrix optimizers --------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MatrixOptimizer:
    """Everything the toolkit dispatches on for one matrix optimizer. Its parts are named as
    `module:attribute` and imported when first used, so that this torch-free module names the
    runtime's kernels without importing torch, and no part imports another's module at load time.

    Torch-free (the planner, the simulator, the memory model):
    - `cost_kernels(m, n, cfg, dtypes=cost.FP32_STEP) -> list[cost.Kernel]`: one step on a full
      m x n matrix, its elementwise passes reading and writing the gradient, the update-following
      state and the parameter at `dtypes` (`cost.StepDtypes`: fp32, the planner's pricing; a run's
      without masters, the simulator's);
    - `init_kernels(m, n, cfg)`: one-off work of the first step (None: nothing);
    - `state_bytes(m, n, cfg) -> int`: optimizer state of one matrix;
    - `row_state_bytes(m, n, cfg) -> int`: the part of it that lives with the matrix's elements
      and rows (moments, momentum, per-row statistics), which a shard of rows holds its share of
      (FSDP2's `Shard(0)`; None: all of it; a Kronecker factor does not shard that way);
    - `workspace_bytes(m, n, grad_bytes, cfg) -> int`: the kernel's temporaries at its peak;
    - `stack_bytes(m, n) -> int`: what a batched kernel copies per matrix beyond that (None: 0).
    Runtime (torch):
    - `kernel(grad, state, cfg, lr) -> kernels.Update | None`: one full matrix;
    - `scalars(shape, cfg, lr, steps) -> kernels.Scalars | None`: the scale, decay and decay order
      of the kernel's update at the matrix's step number `steps` (None: no update), from what every
      TP rank knows, never from the state: the TP ranks that receive chunks of an update compute
      them themselves, so that no rank reads them back from the device (`kernels.ScalarsFn`);
    - `steps_taken(state) -> int`: the steps a saved, non-empty state took, read from its scalar
      fields only (None: `scalars` does not depend on the step);
    - `initial_state(grad, cfg)`: the state before its first step (checkpoint loading);
    - `batched(grads, states, cfg, lr) -> list[Update | None]`: same-shape matrices as one call,
      bit for bit the per-matrix kernel on CPU (None: every matrix alone; the simulator then
      prices no batching);
    - `compiled() -> (kernel, batched)`: the kernels with `torch.compile` (None: run eager).
    Reference (the single-process check, `reference/`): `reference`, a `torch.optim.Optimizer`
    taking the config's fields as keyword arguments.

    An `elementwise` entry (AdamW: the baseline every published run used) needs no whole matrix:
    its `kernel` is `(param, grad, state, cfg, lr) -> None`, in place on any slice, and it runs
    under the step policies that say so (`StepPolicy.elementwise`: ZeRO-1's even segments, each
    rank updating the pieces of matrices its segments hold, as Megatron's distributed optimizer
    does); every parameter then takes its AdamW hyper-parameters (`adamw_config`).
    """

    name: str
    config: type
    summary: str  # one line for the CLI's help
    cost_kernels: str
    state_bytes: str
    workspace_bytes: str
    kernel: str
    initial_state: str
    reference: str
    scalars: str | None = None  # every whole-matrix optimizer has one (an elementwise one needs none)
    steps_taken: str | None = None
    init_kernels: str | None = None
    row_state_bytes: str | None = None
    stack_bytes: str | None = None
    batched: str | None = None
    compiled: str | None = None
    elementwise: bool = False
    # `(m, n, cfg) -> bytes`: the part of `state_bytes` (counted in fp32) the runtime keeps in the
    # dtype of the update it accumulates: fp32 beside fp32 masters, the parameters' own dtype without
    # (DistributedOptimizer(master_weights=False)); None: every part is computed in at least fp32
    # (`canzona.runtime.kernels.work_dtype`: SOAP's and Shampoo's statistics and moments)
    update_dtype_state_bytes: str | None = None
    # the state's matrix fields the kernel keeps column-major, as eigh and QR leave them (SOAP's
    # eigenbases): state dicts save every tensor contiguous, and a load restores this layout, since
    # the kernel's products round by their operands' layout (resumed bit for bit, not within rounding)
    column_major_state: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.elementwise and self.scalars is None:
            # without it a TP rank could not apply the chunks it receives (docs/design.md §6.3)
            raise SpecError(f"matrix optimizer {self.name!r} has no scalars part")

    def part(self, name: str) -> Callable[..., Any] | None:
        """The entry's part `name`, imported (None where the entry has none)."""
        where = getattr(self, name)
        return None if where is None else _resolve(where)

    @property
    def batchable(self) -> bool:
        return self.batched is not None

    @property
    def title(self) -> str:
        """The optimizer's name as its summary spells it (the words before the parenthesis)."""
        return self.summary.partition(" (")[0]


@functools.cache
def _resolve(where: str) -> Any:
    module, _, attribute = where.partition(":")
    return getattr(importlib.import_module(module), attribute)


MATRIX_REGISTRY: dict[str, MatrixOptimizer] = {
    "muon": MatrixOptimizer(
        name="muon", config=MuonConfig, summary="Muon (momentum, Newton-Schulz orthogonalisation)",
        cost_kernels="canzona.cost:muon_kernels", state_bytes="canzona.cost:muon_state_bytes",
        workspace_bytes="canzona.memory:muon_workspace_bytes", kernel="canzona.runtime.kernels:muon_update",
        initial_state="canzona.runtime.kernels:muon_state", batched="canzona.runtime.batched:muon_update_batched",
        compiled="canzona.runtime.batched:muon_compiled", scalars="canzona.runtime.kernels:muon_apply_scalars",
        reference="reference.muon:Muon", update_dtype_state_bytes="canzona.cost:muon_state_bytes"),
    "soap": MatrixOptimizer(
        name="soap", config=SOAPConfig, summary="SOAP (Adam in Shampoo's eigenbasis)",
        column_major_state=("Q_L", "Q_R"),
        cost_kernels="canzona.cost:soap_kernels", init_kernels="canzona.cost:soap_init_kernels",
        state_bytes="canzona.cost:soap_state_bytes", row_state_bytes="canzona.cost:soap_row_state_bytes",
        workspace_bytes="canzona.memory:soap_workspace_bytes",
        stack_bytes="canzona.memory:soap_stack_bytes", kernel="canzona.runtime.kernels:soap_update",
        initial_state="canzona.runtime.kernels:soap_state", batched="canzona.runtime.batched:soap_update_batched",
        scalars="canzona.runtime.kernels:soap_apply_scalars", steps_taken="canzona.runtime.kernels:soap_steps_taken",
        reference="reference.soap:SOAP"),
    "shampoo": MatrixOptimizer(
        name="shampoo", config=ShampooConfig, summary="Shampoo (Kronecker-factored, AdamW grafting)",
        cost_kernels="canzona.cost:shampoo_kernels", state_bytes="canzona.cost:shampoo_state_bytes",
        row_state_bytes="canzona.cost:shampoo_row_state_bytes",
        workspace_bytes="canzona.memory:shampoo_workspace_bytes", stack_bytes="canzona.memory:shampoo_stack_bytes",
        kernel="canzona.runtime.kernels:shampoo_update", initial_state="canzona.runtime.kernels:shampoo_state",
        batched="canzona.runtime.batched:shampoo_update_batched",
        scalars="canzona.runtime.kernels:shampoo_apply_scalars", reference="reference.shampoo:Shampoo"),
    "normuon": MatrixOptimizer(
        name="normuon", config=NorMuonConfig, summary="NorMuon (Muon with a per-neuron second moment)",
        cost_kernels="canzona.normuon:cost_kernels", state_bytes="canzona.normuon:state_bytes",
        workspace_bytes="canzona.normuon:workspace_bytes", kernel="canzona.runtime.normuon:normuon_update",
        initial_state="canzona.runtime.normuon:normuon_state", scalars="canzona.runtime.kernels:muon_apply_scalars",
        reference="reference.normuon:NorMuon",
        # the momentum buffer follows the gradient (`normuon_state`); the per-row second moment is fp32
        update_dtype_state_bytes="canzona.cost:muon_state_bytes"),
    "adamw": MatrixOptimizer(
        name="adamw", config=AdamWConfig, summary="AdamW on every parameter (ZeRO-1, the baseline)",
        cost_kernels="canzona.cost:adamw_matrix_kernels", state_bytes="canzona.cost:adamw_state_bytes",
        workspace_bytes="canzona.memory:adamw_workspace_bytes", kernel="canzona.runtime.kernels:adamw_step_",
        initial_state="canzona.runtime.kernels:adamw_initial_state", reference="reference.adamw:AdamW",
        elementwise=True, update_dtype_state_bytes="canzona.cost:adamw_state_bytes"),
}
OPTIMIZERS = tuple(MATRIX_REGISTRY)  # what `optimizer=` / `--optimizer` accepts
MATRIX_OPTIMIZERS = tuple(name for name, e in MATRIX_REGISTRY.items() if not e.elementwise)  # whole-matrix ones


def matrix_optimizer(name: str) -> MatrixOptimizer:
    """The registry entry of matrix optimizer `name` (SpecError, one line, for an unknown one)."""
    return MATRIX_REGISTRY[check_matrix_optimizer(name)]


_CONFIGS: dict[str, type] = {name: e.config for name, e in MATRIX_REGISTRY.items()}


def check_matrix_optimizer(name: str) -> str:
    return check_choice(name.lower(), MATRIX_REGISTRY, "optimizer")


def default_config(name: str) -> Any:
    try:
        return _CONFIGS[name.lower()]()
    except KeyError:
        raise SpecError(f"unknown optimizer {name!r}; choose one of {', '.join(_CONFIGS)}") from None


def config_from_dict(name: str, values: dict[str, Any]) -> Any:
    """A config of optimizer `name` with `values` overriding defaults; unknown keys are an error,
    and the result is validated (`check_config`)."""
    cfg = default_config(name)
    known = {f.name for f in fields(cfg)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise SpecError(f"{name} has no hyper-parameter(s) {', '.join(unknown)}")
    cast = {k: tuple(v) if isinstance(getattr(cfg, k), (tuple, list)) and isinstance(v, (tuple, list)) else v
            for k, v in values.items()}
    return check_config(name, replace(cfg, **cast))


def resolve_config(name: str, given: Any) -> Any:
    """Optimizer `name`'s config from what the user gave: None (the defaults), a mapping of fields,
    or a config object (validated). The one reading of `matrix_config` / `adamw_config`: the
    runtime's (`canzona.runtime.options.optimizer_config`), the planner's and the simulator's."""
    if given is None:
        return default_config(name)
    if isinstance(given, Mapping):
        return config_from_dict(name, dict(given))
    return check_config(name, given)


def matrix_config_for(optimizer: str, given: Any) -> Any:
    """The planner's and the simulator's `matrix_config` of `optimizer`: None where it is the
    optimizer's defaults (so that a default given explicitly prices bit for bit as none given), else
    the validated config. Refused for an elementwise optimizer (AdamW), as `DistributedOptimizer`
    refuses it: AdamW's hyper-parameters are `adamw_config`'s, and they change no plan."""
    if given is None:
        return None
    if matrix_optimizer(optimizer).elementwise:
        raise SpecError(f"matrix_config is for a matrix optimizer; {optimizer} is elementwise "
                        "(its hyper-parameters are adamw_config's)")
    cfg = resolve_config(optimizer, given)
    return None if cfg == default_config(optimizer) else cfg


def config_changes(name: str, cfg: Any) -> dict[str, Any]:
    """The fields of `cfg` that differ from optimizer `name`'s defaults (tuples as lists): what a
    `--matrix-config` JSON object holds to build `cfg` again, and what the simulator's and the
    search's results show of it."""
    default = default_config(name)
    return {f.name: list(v) if isinstance(v, tuple) else v
            for f in fields(cfg) if (v := getattr(cfg, f.name)) != getattr(default, f.name)}


def matrix_config_json(name: str, cfg: Any) -> str:
    """`cfg` as the JSON object `--matrix-config` takes (its fields off the defaults, in name order):
    read back by `config_from_dict`, it builds `cfg` again (JSON writes floats exactly)."""
    return json.dumps(config_changes(name, cfg), sort_keys=True, separators=(", ", ": "))


COMPUTE_DTYPES = ("fp64", "fp32", "bf16", "fp16")
RUNTIME_COMPUTE_DTYPE = "fp32"  # the one `compute_dtype` the runtime runs (`check_config`)
LR_ADJUSTMENTS = ("original", "match_rms_adamw")

# Newton-Schulz iterations a config may ask for (exclusive): converged long before (5 to 10 is usual)
MAX_NS_STEPS = 1000

# Per field, beyond its type: (lowest, highest, whether the lowest itself is allowed).
_RANGES: dict[str, tuple[float, float, bool]] = {
    "lr": (0.0, math.inf, True),
    "weight_decay": (0.0, math.inf, True),
    "momentum": (0.0, 1.0, True),
    "eps": (0.0, math.inf, False),
    "normuon_eps": (0.0, math.inf, False),
    "beta2": (0.0, 1.0, True),
    "epsilon": (0.0, math.inf, False),
    "graft_eps": (0.0, math.inf, False),
    "eig_eps": (0.0, math.inf, False),
    # bounded: the cost model prices the step kernel by kernel, one set per iteration (and the
    # runtime builds a schedule of that many): a billion of them never finished pricing
    "ns_steps": (0.0, float(MAX_NS_STEPS), False),
    "precondition_frequency": (1.0, math.inf, True),
    "max_precond_dim": (0.0, math.inf, True),
    "max_preconditioner_dim": (0.0, math.inf, True),
    "root_order": (1.0, math.inf, True),
}


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_config(name: str, cfg: Any) -> Any:
    """Raise SpecError (one line) on the first hyper-parameter of the wrong type or out of range;
    return `cfg`. Runs at construction on every rank, before any collective."""
    default = default_config(name)
    whole: dict[str, int] = {}  # 5.0 for ns_steps means 5: kernels count with it
    if type(cfg) is not type(default):
        raise SpecError(f"{name} config must be a {type(default).__name__} or a dict, got {type(cfg).__name__}")
    if hasattr(cfg, "adjust_lr_fn") and cfg.adjust_lr_fn is None:  # torch.optim.Muon's default, its "original"
        cfg = replace(cfg, adjust_lr_fn="original")
    for f in fields(cfg):
        v, d = getattr(cfg, f.name), getattr(default, f.name)
        what = f"{name} {f.name}"
        if isinstance(d, bool):
            ok, kind = isinstance(v, bool), "true or false"
        elif isinstance(d, int):
            ok, kind = _finite(v) and float(v).is_integer(), "a whole number"
            if ok:
                whole[f.name] = int(v)
        elif isinstance(d, float):
            ok, kind = _finite(v), "a finite number"
        elif isinstance(d, tuple):
            ok = isinstance(v, tuple) and len(v) == len(d) and all(_finite(x) for x in v)
            kind = f"{len(d)} finite numbers"
        else:
            ok, kind = isinstance(v, str), "a string"
        if not ok:
            raise SpecError(f"{what} must be {kind}, got {v!r}")
        if f.name in _RANGES:
            lo, hi, closed = _RANGES[f.name]
            if not ((lo <= v if closed else lo < v) and v < hi):
                raise SpecError(f"{what} must be {'>=' if closed else '>'} {lo:g}"
                                f"{f' and < {hi:g}' if math.isfinite(hi) else ''}, got {v!r}")
    if hasattr(cfg, "betas") and not all(0.0 <= b < 1.0 for b in cfg.betas) \
            and not (name == "shampoo" and 0.0 <= cfg.betas[0] < 1.0 and cfg.betas[1] == 1.0):
        raise SpecError(f"{name} betas must lie in [0, 1), got {cfg.betas!r}")
    if getattr(cfg, "shampoo_beta", -1.0) >= 1.0:
        raise SpecError(f"{name} shampoo_beta must be < 1 (negative: use betas[1]), got {cfg.shampoo_beta!r}")
    if getattr(cfg, "adjust_lr_fn", "original") not in LR_ADJUSTMENTS:
        raise SpecError(f"{name} adjust_lr_fn must be one of {', '.join(LR_ADJUSTMENTS)}, got {cfg.adjust_lr_fn!r}")
    if getattr(cfg, "ns_coefficient_type", "simple") not in NS_COEFFICIENT_TYPES:
        raise SpecError(f"{name} ns_coefficient_type must be one of {', '.join(NS_COEFFICIENT_TYPES)}, "
                        f"got {cfg.ns_coefficient_type!r}")
    for key in ("ns_dtype", "compute_dtype"):
        if getattr(cfg, key, "fp32") not in COMPUTE_DTYPES:
            raise SpecError(f"{name} {key} must be one of {', '.join(COMPUTE_DTYPES)}, got {getattr(cfg, key)!r}")
    # the runtime's kernels compute SOAP's, Shampoo's and AdamW's steps in the dtype of what they
    # update (SOAP's and Shampoo's at least fp32: `canzona.runtime.kernels.work_dtype`) whatever this
    # field says, and the cost model prices the field: another floor (the references' option) would
    # be priced and not run
    if getattr(cfg, "compute_dtype", RUNTIME_COMPUTE_DTYPE) != RUNTIME_COMPUTE_DTYPE:
        raise SpecError(f"{name} compute_dtype must be {RUNTIME_COMPUTE_DTYPE}, got {cfg.compute_dtype!r}: the runtime "
                        "computes the step in the dtype of what it updates, whatever this field says (the reference "
                        "optimizers take other floors)")
    return replace(cfg, **whole)
