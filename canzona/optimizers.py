"""Optimizer names and hyper-parameters (DESIGN section 4), defined once.

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
    """Same defaults as `torch.optim.Muon`."""

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
    """Defaults of the SOAP paper's reference code (Vyas et al. 2024)."""

    lr: float = 3e-3
    betas: tuple[float, float] = (0.95, 0.95)
    shampoo_beta: float = -1.0  # < 0: use betas[1]
    eps: float = 1e-8
    weight_decay: float = 0.01
    precondition_frequency: int = 10
    max_precond_dim: int = 10000
    correct_bias: bool = True
    compute_dtype: str = "fp32"


@dataclass(frozen=True)
class ShampooConfig:
    """Defaults of the Distributed Shampoo README example (grafted to AdamW)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    epsilon: float = 1e-12
    weight_decay: float = 0.0
    precondition_frequency: int = 100
    max_preconditioner_dim: int = 8192
    root_order: int = 4  # update L^{-1/root_order} G R^{-1/root_order}
    grafting: bool = True
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
