"""Reference Muon: the update of `torch.optim.Muon` (docs/design.md §3.1, `MuonConfig`), written out.

With ns_dtype="bf16" (the default) this performs the same operations in the same order as
torch/optim/_muon.py (torch 2.13), so the results are bit-identical. Other ns_dtype values
("fp32", "fp64", "fp16") run Newton-Schulz in that dtype instead. The momentum buffer lives in the
parameter's dtype (as in torch).

One deliberate difference: torch's `grad.bfloat16()` returns the buffer itself when the buffer is
already bf16 (bf16 parameters, nesterov=False), and its in-place normalisation then rescales the
momentum buffer; here Newton-Schulz always works on a copy.
"""

from __future__ import annotations

import math

import torch

from canzona.optimizers import NS_COEFFICIENT_TYPES, MuonConfig, coefficient_schedule
from reference.adamw import ReferenceOptimizer, check_common, check_positive_int, torch_dtype

ADJUST_LR_FNS = ("original", "match_rms_adamw")


def zeropower_via_newtonschulz(
    G: torch.Tensor, ns_coefficients, ns_steps: int, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """Approximate U V^T of G = U S V^T by `ns_steps` quintic Newton-Schulz steps in `dtype`;
    `ns_coefficients`: one (a, b, c) for every step, or one per step."""
    per_step = isinstance(ns_coefficients[0], (tuple, list))
    X = G.to(dtype, copy=True)
    if G.size(0) > G.size(1):
        X = X.T
    X = X / X.norm().clamp(min=eps)
    for i in range(ns_steps):
        a, b, c = ns_coefficients[i] if per_step else ns_coefficients
        A = X @ X.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)  # b A + c A A
        X = torch.addmm(X, B, X, beta=a)  # a X + B X
    if G.size(0) > G.size(1):
        X = X.T
    return X


def coefficients_of(group: dict):
    """A group's Newton-Schulz coefficients: its `ns_coefficients` triple ("simple", torch's), or
    the named set's per iteration (`canzona.optimizers.ns_schedule`)."""
    if group["ns_coefficient_type"] == "simple":
        return group["ns_coefficients"]
    return coefficient_schedule(group["ns_coefficient_type"], group["ns_coefficients"], group["ns_steps"])


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape) -> float:
    """lr * sqrt(max(1, rows / cols)) ("original") or lr * 0.2 * sqrt(max(rows, cols))."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    else:
        ratio = 0.2 * math.sqrt(max(rows, cols))
    return lr * ratio


class Muon(ReferenceOptimizer):
    """Muon for 2-D parameters; state key `momentum_buffer` (as torch.optim.Muon).

    adjust_lr_fn None is accepted and means "original" (torch's convention).
    """

    config = MuonConfig

    def _check_group(self, group: dict) -> None:
        check_common(group)
        if not 0.0 <= group["momentum"] < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {group['momentum']}")
        if not group["eps"] > 0.0:
            raise ValueError(f"eps must be > 0, got {group['eps']}")
        check_positive_int("ns_steps", group["ns_steps"])
        if len(group["ns_coefficients"]) != 3:
            raise ValueError(f"ns_coefficients must be 3 numbers, got {group['ns_coefficients']!r}")
        if group["ns_coefficient_type"] not in NS_COEFFICIENT_TYPES:
            raise ValueError(f"unknown ns_coefficient_type {group['ns_coefficient_type']!r}; choose one of "
                             f"{', '.join(NS_COEFFICIENT_TYPES)}")
        if group["adjust_lr_fn"] is not None and group["adjust_lr_fn"] not in ADJUST_LR_FNS:
            raise ValueError(
                f"unknown adjust_lr_fn {group['adjust_lr_fn']!r}; choose one of {', '.join(ADJUST_LR_FNS)}"
            )
        torch_dtype(group["ns_dtype"])
        for p in group["params"]:
            if p.ndim != 2:
                raise ValueError(f"Muon only takes 2-D parameters, got one of shape {tuple(p.shape)}")

    def _step_group(self, group: dict) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(g)
            buf = state["momentum_buffer"]
            buf.lerp_(g, 1 - mu)
            u = g.lerp(buf, mu) if group["nesterov"] else buf
            ns_dtype = torch_dtype(group["ns_dtype"])
            ortho = zeropower_via_newtonschulz(u, coefficients_of(group), group["ns_steps"], group["eps"], ns_dtype)
            p.mul_(1 - lr * wd)
            p.add_(ortho, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
