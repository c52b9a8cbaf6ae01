"""Reference Shampoo (Gupta et al. 2018), 2-D parameters, exactly the math in `ShampooConfig`'s docstring.

Compute dtype: the wider of the parameter's dtype and `compute_dtype` (default "fp32"): fp32 and fp64
parameters run in their own dtype (eigh included), bf16/fp16 ones in fp32 with fp32 state, the new
value rounded back into the parameter. Statistics: `L.add_(G G^T)` if betas[1] == 1, else
`L.mul_(b).add_(G G^T, alpha=1-b)`; grafting moments `m.mul_(b1).add_(G, alpha=1-b1)`,
`v.mul_(b2).addcmul_(G, G, value=1-b2)`; P = (L_root G) R_root; D = P * (||A||_F / ||P||_F).
Grafting needs betas[1] < 1 (with betas[1] == 1 the AdamW second moment and its bias correction
are both 0), so grafting=True with betas[1] == 1 is rejected.

State per parameter: `step` (int), `exp_avg`, `exp_avg_sq` (the grafting moments m_g, v_g) and, for
each preconditioned side d in {"L", "R"}, the statistic `d` and its inverse root `d_root`. A side
with more than `max_preconditioner_dim` rows/columns has neither (identity).

heavyball 3.2.1 has no Shampoo with this rule. Its closest optimizer, `heavyball.KLShampoo`,
differs in (labels as in tests/reference/test_reference_heavyball.py):
 K1. Statistics: KL-corrected two-sided factor updates (each side's G G^T weighted by the other
     side's inverse eigenvalues; plain G G^T only when the other side is unpreconditioned),
     bias-corrected EMA with shampoo_beta, seeded with init_factor I (or the first G G^T when
     init_factor = 0); ours: sums (betas[1] == 1) or EMA with betas[1], from 0.
 K2. Preconditioner: Q diag(max(d, eps)^(-1/2)) Q^T, d = diag(Q^T GG Q), Q tracked by one QR
     power iteration per refresh (exact only after the initial eigh), inverse square roots only;
     ours: exact (GG + epsilon I)^(-1/root_order) from eigh.
 K3. It preconditions a momentum EMA of G; ours preconditions G.
 K4. It skips the first call (initialisation only); ours updates on step 1.
 K5. No grafting; factor norm balancing; dampened gradient for the statistics; the refresh
     counter and dtype/shape/API differences of heavyball.SOAP (S3, S9-S12 in reference/soap.py).
 The tests compare the parts that coincide: KLShampoo's first real update (call 2; root_order 2,
 betas[0] = 0, init_factor = 0, no grafting) with ours at step 2 (sum statistics, roots from
 step 1), to 1e-10; our EMA statistics with heavyball.SOAP's GG * (1 - b^t); and the grafting
 magnitude ||A||_F with heavyball.AdamW's update norm.
"""

from __future__ import annotations

import torch

from canzona.optimizers import ShampooConfig
from reference.adamw import (
    ReferenceOptimizer,
    check_betas,
    check_common,
    check_positive_int,
    compute_dtype,
)


def inverse_root(S: torch.Tensor, root_order: int, epsilon: float) -> torch.Tensor:
    """V diag((max(lambda, 0) + epsilon)^(-1 / root_order)) V^T from eigh(S)."""
    lam, V = torch.linalg.eigh(S)
    return V @ torch.diag((lam.clamp(min=0) + epsilon) ** (-1.0 / root_order)) @ V.T


class Shampoo(ReferenceOptimizer):
    """Shampoo for 2-D parameters with AdamW grafting (on by default)."""

    config = ShampooConfig

    def _check_group(self, group: dict) -> None:
        check_common(group)
        check_betas(group["betas"], closed_beta2=True)
        if group["grafting"] and group["betas"][1] == 1.0:
            raise ValueError("grafting needs betas[1] < 1 (AdamW's second moment); got betas[1] == 1")
        if not group["epsilon"] > 0.0:
            raise ValueError(f"epsilon must be > 0, got {group['epsilon']}")
        if not group["graft_eps"] > 0.0:
            raise ValueError(f"graft_eps must be > 0, got {group['graft_eps']}")
        check_positive_int("precondition_frequency", group["precondition_frequency"])
        check_positive_int("max_preconditioner_dim", group["max_preconditioner_dim"], minimum=0)
        check_positive_int("root_order", group["root_order"])
        for p in group["params"]:
            if p.ndim != 2:
                raise ValueError(f"Shampoo only takes 2-D parameters, got one of shape {tuple(p.shape)}")

    def _step_group(self, group: dict) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            dtype = compute_dtype(p.dtype, group["compute_dtype"])
            G = p.grad.to(dtype)
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(G)
                state["exp_avg_sq"] = torch.zeros_like(G)
                for side, k in (("L", G.shape[0]), ("R", G.shape[1])):
                    if k <= group["max_preconditioner_dim"]:
                        state[side] = torch.zeros(k, k, dtype=dtype)
                        state[f"{side}_root"] = torch.eye(k, dtype=dtype)

            state["step"] += 1
            t = state["step"]
            for side in ("L", "R"):
                if side not in state:
                    continue
                GGT = G @ G.T if side == "L" else G.T @ G
                if beta2 == 1.0:
                    state[side].add_(GGT)
                else:
                    state[side].mul_(beta2).add_(GGT, alpha=1 - beta2)
                if (t - 1) % group["precondition_frequency"] == 0:
                    state[f"{side}_root"] = inverse_root(
                        state[side], group["root_order"], group["epsilon"]
                    )

            P = G
            if "L" in state:
                P = state["L_root"] @ P
            if "R" in state:
                P = P @ state["R_root"]

            D = P
            if group["grafting"]:
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(G, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(G, G, value=1 - beta2)
                A = (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + group["graft_eps"])
                norm_P = P.norm()
                D = P * (A.norm() / norm_P) if norm_P > 0 else torch.zeros_like(P)

            w = p if p.dtype == dtype else p.to(dtype)
            w.mul_(1 - lr * wd)
            w.add_(D, alpha=-lr)
            if w is not p:
                p.copy_(w)
