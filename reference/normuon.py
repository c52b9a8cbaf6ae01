"""Reference NorMuon (Li et al. 2025, arXiv 2510.05491; `NorMuonConfig` pins the math): the
reference Muon's momentum and Newton-Schulz, then the per-neuron normalisation, written out.
The momentum buffer lives in the parameter's dtype (as Muon's); the second moment, one value per
row, in fp32 (fp64 for fp64 parameters)."""

from __future__ import annotations

import torch

from canzona.optimizers import NorMuonConfig
from reference.adamw import ReferenceOptimizer, torch_dtype
from reference.muon import Muon, adjusted_lr, coefficients_of, zeropower_via_newtonschulz


class NorMuon(ReferenceOptimizer):
    """NorMuon for 2-D parameters; state keys `momentum_buffer` and `second_moment`."""

    config = NorMuonConfig

    def _check_group(self, group: dict) -> None:
        Muon._check_group(self, group)
        if not 0.0 <= group["beta2"] < 1.0:
            raise ValueError(f"beta2 must be in [0, 1), got {group['beta2']}")
        if not group["normuon_eps"] > 0.0:
            raise ValueError(f"normuon_eps must be > 0, got {group['normuon_eps']}")

    def _step_group(self, group: dict) -> None:
        lr, wd, mu, beta2 = group["lr"], group["weight_decay"], group["momentum"], group["beta2"]
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad
            state = self.state[p]
            wide = torch.promote_types(g.dtype, torch.float32)
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(g)
                state["second_moment"] = torch.zeros(g.shape[0], 1, dtype=wide, device=g.device)
            buf = state["momentum_buffer"]
            buf.lerp_(g, 1 - mu)
            u = g.lerp(buf, mu) if group["nesterov"] else buf
            ortho = zeropower_via_newtonschulz(u, coefficients_of(group), group["ns_steps"], group["eps"],
                                               torch_dtype(group["ns_dtype"])).to(wide)
            second = state["second_moment"]
            second.lerp_((ortho * ortho).mean(dim=1, keepdim=True), 1 - beta2)
            normalized = ortho / (second.sqrt() + group["normuon_eps"])
            normalized = normalized * (ortho.norm() / (normalized.norm() + group["normuon_eps"]))
            p.mul_(1 - lr * wd)
            p.add_(normalized.to(p.dtype), alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
