"""NorMuon's runtime kernel (`canzona.optimizers.NorMuonConfig`): Muon's momentum and
Newton-Schulz (`kernels`), then each row of the orthogonalised update divided by the root of its
running second moment and the whole rescaled to the norm it had."""

from __future__ import annotations

import torch
from torch import Tensor

from canzona.optimizers import NorMuonConfig, ns_schedule
from canzona.runtime.kernels import (
    TORCH_DTYPES,
    State,
    Update,
    muon_apply_scalars,
    muon_momentum,
    newton_schulz,
    work_dtype,
)


def normuon_state(grad: Tensor, cfg: NorMuonConfig) -> State:
    """The state a first step starts from (zeros): the momentum buffer in the gradient's dtype, one
    second moment per row in the work dtype."""
    return {"momentum_buffer": torch.zeros_like(grad),
            "second_moment": torch.zeros(grad.shape[0], 1, dtype=work_dtype(grad), device=grad.device)}


def normuon_update(grad: Tensor, state: State, cfg: NorMuonConfig, lr: float) -> Update:
    if not state:
        state.update(normuon_state(grad, cfg))
    u = muon_momentum(grad, state, cfg)
    ortho = newton_schulz(u, ns_schedule(cfg), cfg.ns_steps, cfg.eps, TORCH_DTYPES[cfg.ns_dtype])
    o = ortho.to(work_dtype(grad))
    second = state["second_moment"]
    second.lerp_((o * o).mean(dim=1, keepdim=True), 1 - cfg.beta2)
    normalized = o / (second.sqrt() + cfg.normuon_eps)
    normalized.mul_(o.norm() / (normalized.norm() + cfg.normuon_eps))
    return Update.of(normalized, muon_apply_scalars(tuple(grad.shape), cfg, lr, 0))
