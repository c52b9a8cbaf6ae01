"""Reference AdamW: the update of `torch.optim.AdamW` (single-tensor path), written out.

Defaults come from `canzona.optimizers.AdamWConfig`. Compute dtype: the wider of the parameter's
dtype and `compute_dtype` (default "fp32"), so fp32 and fp64 parameters are updated in their own
dtype (bit-identical to torch.optim.AdamW) and bf16/fp16 parameters are updated in fp32 with fp32
state and the result rounded back into the parameter (torch.optim.AdamW would compute in bf16).

This module also holds the dtype helpers the other reference optimizers share.
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from canzona.optimizers import AdamWConfig

DTYPES: dict[str, torch.dtype] = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called `name` ("fp64", "fp32", "bf16", "fp16"); ValueError otherwise."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype name {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def compute_dtype(param_dtype: torch.dtype, floor: str) -> torch.dtype:
    """The dtype optimizer math runs in: the wider of the parameter's dtype and `floor`."""
    lo = torch_dtype(floor)
    return param_dtype if torch.finfo(param_dtype).bits >= torch.finfo(lo).bits else lo


def check_betas(betas, closed_beta2: bool = False) -> None:
    """betas = (beta1, beta2) with beta1 in [0, 1) and beta2 in [0, 1) (or [0, 1] if closed_beta2)."""
    if len(betas) != 2:
        raise ValueError(f"betas must be a pair, got {betas!r}")
    b1, b2 = betas
    if not 0.0 <= b1 < 1.0:
        raise ValueError(f"betas[0] must be in [0, 1), got {b1}")
    if not (0.0 <= b2 <= 1.0 if closed_beta2 else 0.0 <= b2 < 1.0):
        raise ValueError(f"betas[1] must be in [0, {'1]' if closed_beta2 else '1)'}, got {b2}")


def check_common(group: dict) -> None:
    """lr >= 0, weight_decay >= 0, a known compute_dtype (when the group has one)."""
    if not group["lr"] >= 0.0:
        raise ValueError(f"lr must be >= 0, got {group['lr']}")
    if not group["weight_decay"] >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {group['weight_decay']}")
    if "compute_dtype" in group:
        torch_dtype(group["compute_dtype"])


def check_positive_int(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


class ReferenceOptimizer(torch.optim.Optimizer):
    """Shared plumbing: defaults from the optimizer's config dataclass (`config`), validation on
    every param group, defaults restored on load_state_dict."""

    config: type

    def __init__(self, params, **hyper) -> None:
        defaults = asdict(self.config())
        unknown = set(hyper) - set(defaults)
        if unknown:
            raise ValueError(f"{type(self).__name__} has no hyper-parameter(s) {', '.join(sorted(unknown))}")
        defaults.update(hyper)
        super().__init__(params, defaults)

    def _check_group(self, group: dict) -> None:
        raise NotImplementedError

    def _step_group(self, group: dict) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise

    def __setstate__(self, state: dict) -> None:
        # A state dict saved by another optimizer (e.g. torch.optim.Muon) may lack our keys.
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)


class AdamW(ReferenceOptimizer):
    """AdamW as `torch.optim.AdamW`; state keys `step` (fp32 0-d tensor), `exp_avg`, `exp_avg_sq`."""

    config = AdamWConfig

    def _check_group(self, group: dict) -> None:
        check_common(group)
        check_betas(group["betas"])
        if not group["eps"] > 0.0:
            raise ValueError(f"eps must be > 0, got {group['eps']}")

    def _step_group(self, group: dict) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            dtype = compute_dtype(p.dtype, group["compute_dtype"])
            w = p if p.dtype == dtype else p.to(dtype)
            g = p.grad.to(dtype)
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(w)
                state["exp_avg_sq"] = torch.zeros_like(w)
            m, v = state["exp_avg"], state["exp_avg_sq"]
            state["step"] += 1
            t = state["step"].item()

            w.mul_(1 - lr * wd)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            step_size = lr / (1 - beta1**t)
            denom = (v.sqrt() / (1 - beta2**t) ** 0.5).add_(eps)
            w.addcdiv_(m, denom, value=-step_size)
            if w is not p:
                p.copy_(w)
