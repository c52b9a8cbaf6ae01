"""Reference SOAP (Vyas et al. 2024), 2-D parameters, exactly the math in `SOAPConfig`'s docstring.

Compute dtype: the wider of the parameter's dtype and `compute_dtype` (default "fp32"): fp32 and fp64
parameters run in their own dtype (fp64 for exactness tests, eigh/QR included), bf16/fp16 ones in
fp32 with fp32 state, the new value rounded back into the parameter. (The paper's code always
runs eigh / QR in fp32.) Moments use the paper code's forms: `m.mul_(b1).add_(G, alpha=1-b1)`,
`v.mul_(b2).addcmul_(Gp, Gp, value=1-b2)`, `GG.lerp_(G G^T, 1-beta_s)`; projections multiply the
left factor first: project(X) = (Q_L^T X) Q_R, project_back(X) = (Q_L X) Q_R^T. The refresh's
argsort is stable (ties, e.g. the zero estimates of a zero gradient's GG, keep their order).

State per parameter: `step` (int, 0 after the initialising call), `exp_avg` (unrotated),
`exp_avg_sq` (rotated basis), and for each preconditioned side d in {"L", "R"}: `GG_d`, `Q_d`.
A side with more than `max_precond_dim` rows/columns has no GG/Q entry (identity).

Differences from heavyball 3.2.1's `heavyball.SOAP` (labels as in
tests/reference/test_reference_heavyball.py, which checks that with eps -> 0, wd = 0, f = 1 (or its
counter offset) the updates agree to 1e-6, and to 1e-10 with heavyball's QR lift removed):
 S1. heavyball seeds GG with the first G G^T, then lerps with the bias-corrected
     beta_debias(shampoo_beta, t): its GG = ours / (1 - beta_s^t), a scalar (same bases).
 S2. Its Adam step is m_hat / max(sqrt(v_hat), eps), always bias-corrected; ours is
     lr sqrt(1-b2^t)/(1-b1^t) * m / (sqrt(v) + eps), correct_bias optional (the paper's form).
 S3. Its refresh counter counts the skipped first call: refresh on calls c % f == 0 (ours: update
     steps s = c - 1, s % f == 0); 1/f accumulates in floating point (f = 10 drifts late).
 S4. Its QR refresh factorises (GG + lift |lambda|_max I) Q, lift >= 1e-8; ours GG Q.
 S5. It fixes QR signs (R diagonal > 0) and keeps column positions instead of permuting Q and
     exp_avg_sq; neither changes the update.
 S6. It keeps exp_avg in the rotated basis (rotated at each refresh); ours is unrotated.
 S7. Weight decay: p (1 - lr wd) - lr N there; p - s N, then p - lr wd p here (paper code).
 S8. Defaults differ (betas (0.9, 0.95), shampoo_beta 0.95, f 2, max dim 2048 there).
 S9. It stores moments in storage_dtype (fp32 by default, even for fp64 parameters), merges /
     splits / buckets dimensions, skips 1-D parameters, and has optional caution, MARS, PaLM,
     warmup, clipping and gradient accumulation; ours: 2-D parameters, compute-dtype state.
 S10. Its debiased betas are `float ** int64 tensor`, i.e. in torch's default dtype (fp32 unless set).
 S11. Its initial eigh retries in fp64 and with a growing eps on failure; ours calls eigh once.
 S12. It consumes p.grad (sets None) and warns when lr changes between steps; ours reads lr
     from param_groups at every step.
"""

from __future__ import annotations

import torch

from canzona.optimizers import SOAPConfig
from reference.adamw import (
    ReferenceOptimizer,
    check_betas,
    check_common,
    check_positive_int,
    compute_dtype,
)


def eigenbasis(GG: torch.Tensor, eig_eps: float) -> torch.Tensor:
    """Eigenvectors of GG + eig_eps I, columns by descending eigenvalue."""
    _, Q = torch.linalg.eigh(GG + eig_eps * torch.eye(GG.shape[0], dtype=GG.dtype))
    return Q.flip(1)


def project(X, Q_L, Q_R):
    """Q_L^T X Q_R, a None factor being the identity."""
    if Q_L is not None:
        X = Q_L.T @ X
    if Q_R is not None:
        X = X @ Q_R
    return X


def project_back(X, Q_L, Q_R):
    """Q_L X Q_R^T, a None factor being the identity."""
    if Q_L is not None:
        X = Q_L @ X
    if Q_R is not None:
        X = X @ Q_R.T
    return X


class SOAP(ReferenceOptimizer):
    """SOAP for 2-D parameters. The first call per parameter only initialises (no update)."""

    config = SOAPConfig

    def _check_group(self, group: dict) -> None:
        check_common(group)
        check_betas(group["betas"])
        if not group["shampoo_beta"] < 1.0:
            raise ValueError(f"shampoo_beta must be < 1 (< 0: use betas[1]), got {group['shampoo_beta']}")
        if not group["eps"] > 0.0:
            raise ValueError(f"eps must be > 0, got {group['eps']}")
        if not group["eig_eps"] >= 0.0:
            raise ValueError(f"eig_eps must be >= 0, got {group['eig_eps']}")
        check_positive_int("precondition_frequency", group["precondition_frequency"])
        check_positive_int("max_precond_dim", group["max_precond_dim"], minimum=0)
        for p in group["params"]:
            if p.ndim != 2:
                raise ValueError(f"SOAP only takes 2-D parameters, got one of shape {tuple(p.shape)}")

    @staticmethod
    def _update_statistics(state, G, beta_s) -> None:
        if "GG_L" in state:
            state["GG_L"].lerp_(G @ G.T, 1 - beta_s)
        if "GG_R" in state:
            state["GG_R"].lerp_(G.T @ G, 1 - beta_s)

    def _step_group(self, group: dict) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        beta_s = group["shampoo_beta"] if group["shampoo_beta"] >= 0 else beta2
        for p in group["params"]:
            if p.grad is None:
                continue
            dtype = compute_dtype(p.dtype, group["compute_dtype"])
            G = p.grad.to(dtype)
            state = self.state[p]

            if not state:  # initialising call: statistics and eigenbases, no update
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(G)
                state["exp_avg_sq"] = torch.zeros_like(G)
                for side, k in (("L", G.shape[0]), ("R", G.shape[1])):
                    if k <= group["max_precond_dim"]:
                        state[f"GG_{side}"] = torch.zeros(k, k, dtype=dtype)
                self._update_statistics(state, G, beta_s)
                for side in ("L", "R"):
                    if f"GG_{side}" in state:
                        state[f"Q_{side}"] = eigenbasis(state[f"GG_{side}"], group["eig_eps"])
                continue

            Q_L, Q_R = state.get("Q_L"), state.get("Q_R")
            m, v = state["exp_avg"], state["exp_avg_sq"]
            Gp = project(G, Q_L, Q_R)
            state["step"] += 1
            t = state["step"]
            m.mul_(beta1).add_(G, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(Gp, Gp, value=1 - beta2)
            N = project_back(project(m, Q_L, Q_R) / (v.sqrt() + eps), Q_L, Q_R)
            s = lr
            if group["correct_bias"]:
                s = lr * (1 - beta2**t) ** 0.5 / (1 - beta1**t)

            w = p if p.dtype == dtype else p.to(dtype)
            w.add_(N, alpha=-s)
            w.add_(w, alpha=-lr * wd)
            if w is not p:
                p.copy_(w)

            self._update_statistics(state, G, beta_s)
            if t % group["precondition_frequency"] == 0:
                for dim, side in ((0, "L"), (1, "R")):
                    if f"Q_{side}" not in state:
                        continue
                    GG, Q = state[f"GG_{side}"], state[f"Q_{side}"]
                    order = torch.argsort(torch.diag(Q.T @ GG @ Q), descending=True, stable=True)
                    Q = Q[:, order]
                    state["exp_avg_sq"] = state["exp_avg_sq"].index_select(dim, order)
                    state[f"Q_{side}"] = torch.linalg.qr(GG @ Q).Q
