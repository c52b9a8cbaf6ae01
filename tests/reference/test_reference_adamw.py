"""reference.AdamW against torch.optim.AdamW, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch

from canzona.optimizers import AdamWConfig
from reference.adamw import AdamW, compute_dtype, torch_dtype

SHAPES = [(7, 5), (33,), (4, 3, 2)]


def make_params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ws = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in SHAPES]
    return [torch.nn.Parameter(w.clone()) for w in ws], [torch.nn.Parameter(w.clone()) for w in ws]


def run_pair(ours, theirs, pa, pb, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for a, b in zip(pa, pb):
            noise = torch.randn(a.shape, generator=gen, dtype=torch.float64)
            a.grad = (noise + a.detach()).to(a.dtype)
            b.grad = (noise + b.detach()).to(b.dtype)
        ours.step()
        theirs.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "cfg",
    [
        {},  # AdamWConfig defaults (weight decay 0.01)
        {"lr": 0.01, "weight_decay": 0.0},
        {"lr": 0.003, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1},
    ],
)
def test_bit_identical_to_torch_adamw(cfg, dtype):
    pa, pb = make_params(dtype)
    ours, theirs = AdamW(pa, **cfg), torch.optim.AdamW(pb, foreach=False, **cfg)
    run_pair(ours, theirs, pa, pb, steps=20)
    for a, b in zip(pa, pb):
        assert a.dtype == dtype and torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ours.state[a][key], theirs.state[b][key])


def test_lr_scheduler_and_param_groups():
    pa, pb = make_params()
    ours = AdamW([{"params": pa[:1], "lr": 0.02}, {"params": pa[1:]}], weight_decay=0.05)
    theirs = torch.optim.AdamW([{"params": pb[:1], "lr": 0.02}, {"params": pb[1:]}], weight_decay=0.05, foreach=False)
    scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10) for o in (ours, theirs)]
    gen = torch.Generator().manual_seed(2)
    for _ in range(10):
        for a, b in zip(pa, pb):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
        for s in scheds:
            s.step()
    for a, b in zip(pa, pb):
        assert torch.equal(a, b)


@pytest.mark.parametrize("direction", ["ours_to_torch", "torch_to_ours"])
def test_state_dicts_interchange_with_torch(direction):
    pa, pb = make_params()
    ours, theirs = AdamW(pa, lr=0.01), torch.optim.AdamW(pb, lr=0.01, foreach=False)
    run_pair(ours, theirs, pa, pb, steps=5)
    src, src_params = (ours, pa) if direction == "ours_to_torch" else (theirs, pb)
    pc = [torch.nn.Parameter(p.detach().clone()) for p in src_params]
    other = torch.optim.AdamW(pc, lr=1.0, foreach=False) if direction == "ours_to_torch" else AdamW(pc, lr=1.0)
    other.load_state_dict(copy.deepcopy(src.state_dict()))
    run_pair(src, other, src_params, pc, steps=5, seed=9)
    for a, c in zip(src_params, pc):
        assert torch.equal(a, c)


def test_bf16_parameters_update_in_fp32():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(6, 4, generator=gen).bfloat16()
    p = torch.nn.Parameter(w.clone())
    opt = AdamW([p], lr=0.1, weight_decay=0.1)
    g = torch.randn(6, 4, generator=gen).bfloat16()
    p.grad = g
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.float32 and p.dtype == torch.bfloat16
    # Step 1 by hand in fp32: m_hat / sqrt(v_hat) = g / |g| = sign(g) (|g| >> eps).
    g32, w32 = g.float(), w.float()
    expected = w32 * (1 - 0.1 * 0.1) - 0.1 * g32 / (g32.abs() + 1e-8)
    # fp32 math, then one rounding to bf16 (at most one bf16 ulp from rounding `expected`)
    torch.testing.assert_close(p.detach().float(), expected, rtol=2**-8, atol=0)


def test_compute_dtype_rule():
    assert compute_dtype(torch.float32, "fp32") == torch.float32
    assert compute_dtype(torch.float64, "fp32") == torch.float64
    assert compute_dtype(torch.bfloat16, "fp32") == torch.float32
    assert compute_dtype(torch.float32, "fp64") == torch.float64
    assert compute_dtype(torch.float32, "bf16") == torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        torch_dtype("float32")


def test_defaults_come_from_adamw_config():
    group = AdamW([torch.nn.Parameter(torch.zeros(3))]).param_groups[0]
    for k, v in AdamWConfig().__dict__.items():
        assert group[k] == v


@pytest.mark.parametrize(
    "bad",
    [
        {"lr": -0.1},
        {"betas": (1.0, 0.999)},
        {"betas": (0.9, 1.0)},
        {"betas": (-0.1, 0.9)},
        {"betas": (0.9,)},
        {"eps": 0.0},
        {"weight_decay": -1.0},
        {"compute_dtype": "fp8"},
        {"momentum": 0.9},
    ],
)
def test_invalid_hyper_parameters(bad):
    with pytest.raises(ValueError):
        AdamW([torch.nn.Parameter(torch.zeros(3))], **bad)
