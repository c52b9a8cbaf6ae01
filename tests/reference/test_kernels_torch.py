"""Rung 1-2 of the ladder for the runtime kernels against torch's own optimizers: Muon and AdamW
kernels equal torch.optim.Muon / torch.optim.AdamW bit for bit (same operation order)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from canzona.optimizers import AdamWConfig, MuonConfig
from canzona.runtime.kernels import adamw_step_, apply_update_, muon_update

SHAPES = [(48, 32), (32, 48), (40, 40), (7, 96)]


def _grads(shape, steps, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=dtype) for _ in range(steps)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_muon_kernel_is_torch_muon_bit_for_bit(shape, nesterov, adjust, wd):
    cfg = replace(MuonConfig(), nesterov=nesterov, adjust_lr_fn=adjust, weight_decay=wd)
    p_torch = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(1)))
    p_ours = p_torch.detach().clone()
    opt = torch.optim.Muon([p_torch], lr=0.02, weight_decay=wd, momentum=cfg.momentum, nesterov=nesterov,
                           ns_coefficients=cfg.ns_coefficients, eps=cfg.eps, ns_steps=cfg.ns_steps,
                           adjust_lr_fn=adjust)
    state: dict = {}
    for g in _grads(shape, 20, seed=2):
        p_torch.grad = g.clone()
        opt.step()
        update = muon_update(g.clone(), state, cfg, lr=0.02)
        apply_update_(p_ours, update.direction, update)
        assert torch.equal(p_ours, p_torch.detach())
    assert torch.equal(state["momentum_buffer"], opt.state[p_torch]["momentum_buffer"])


def test_muon_kernel_fp32_and_fp64_ns_do_not_touch_the_momentum_buffer():
    g = _grads((16, 24), 1, seed=3, dtype=torch.float64)[0]
    for ns_dtype in ("fp32", "fp64"):
        cfg = replace(MuonConfig(), nesterov=False, ns_dtype=ns_dtype)
        state: dict = {}
        muon_update(g, state, cfg, lr=0.1)
        assert torch.equal(state["momentum_buffer"], g * (1 - cfg.momentum))


@pytest.mark.parametrize("wd", [0.0, 0.01, 0.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adamw_kernel_is_torch_adamw_bit_for_bit(wd, dtype):
    cfg = replace(AdamWConfig(), weight_decay=wd, betas=(0.9, 0.95))
    p_torch = torch.nn.Parameter(torch.randn(33, 17, dtype=dtype, generator=torch.Generator().manual_seed(4)))
    p_ours = p_torch.detach().clone()
    opt = torch.optim.AdamW([p_torch], lr=3e-3, betas=cfg.betas, eps=cfg.eps, weight_decay=wd)
    state: dict = {}
    for g in _grads((33, 17), 20, seed=5, dtype=dtype):
        p_torch.grad = g.clone()
        opt.step()
        adamw_step_(p_ours, g, state, cfg, lr=3e-3)
        assert torch.equal(p_ours, p_torch.detach())
