"""Optimizer names and hyper-parameters (docs/design.md §3), defined once.

The cost model reads the fields that drive work (NS steps, preconditioner dims and frequencies,
compute dtypes); the reference optimizers and runtime kernels take their defaults from here too.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from canzona.errors import SpecError

MATRIX_OPTIMIZERS = ("muon", "soap", "shampoo")


@dataclass(frozen=True)
class MuonConfig:
    """Same defaults and math as `torch.optim.Muon`. One step on a matrix p with gradient G:

        buf <- buf.lerp(G, 1 - momentum)                      (buf starts at zero)
        u   <- G.lerp(buf, momentum) if nesterov else buf
        X   <- u in ns_dtype, transposed if rows > cols, divided by max(||X||_F, eps)
        ns_steps times:  A = X X^T;  B = b A + c A A;  X = a X + B X      ((a, b, c) = ns_coefficients)
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
    adjust_lr_fn: str = "original"  # or "match_rms_adamw"
    ns_dtype: str = "bf16"


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
class AdamWConfig:
    """Same defaults as `torch.optim.AdamW`."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    compute_dtype: str = "fp32"


OptimizerConfig = MuonConfig | SOAPConfig | ShampooConfig | AdamWConfig

_CONFIGS: dict[str, type] = {
    "muon": MuonConfig,
    "soap": SOAPConfig,
    "shampoo": ShampooConfig,
    "adamw": AdamWConfig,
}


def check_matrix_optimizer(name: str) -> str:
    name = name.lower()
    if name not in MATRIX_OPTIMIZERS:
        raise SpecError(f"unknown matrix optimizer {name!r}; choose one of {', '.join(MATRIX_OPTIMIZERS)}")
    return name


def default_config(name: str) -> Any:
    try:
        return _CONFIGS[name.lower()]()
    except KeyError:
        raise SpecError(f"unknown optimizer {name!r}; choose one of {', '.join(_CONFIGS)}") from None


def config_from_dict(name: str, values: dict[str, Any]) -> Any:
    """A config of optimizer `name` with `values` overriding defaults; unknown keys are an error."""
    cfg = default_config(name)
    known = {f.name for f in fields(cfg)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise SpecError(f"{name} has no hyper-parameter(s) {', '.join(unknown)}")
    cast = {k: tuple(v) if isinstance(getattr(cfg, k), tuple) else v for k, v in values.items()}
    return replace(cfg, **cast)
