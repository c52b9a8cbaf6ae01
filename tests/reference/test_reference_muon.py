"""reference.Muon against torch.optim.Muon (bit for bit) and a closed-form Newton-Schulz in fp64."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from canzona.optimizers import MuonConfig
from reference.muon import Muon, adjusted_lr, zeropower_via_newtonschulz

SHAPES = [(32, 16), (16, 48), (24, 24)]  # tall, wide, square
CONFIGS = [
    {},  # MuonConfig defaults: nesterov, "original", weight decay 0.1
    {"lr": 0.02, "nesterov": False, "adjust_lr_fn": "match_rms_adamw", "weight_decay": 0.0},
    {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.05, "ns_steps": 3},
    {"lr": 0.01, "nesterov": False, "eps": 1e-3, "ns_coefficients": (2.0, -1.5, 0.5)},
]


def torch_kwargs(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k != "ns_dtype"}


def run_pair(ours, theirs, p_ours, p_theirs, steps, seed=0):
    """Feed both optimizers the same gradients (noise + the current weights) for `steps` steps."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        noise = torch.randn(p_ours.shape, generator=gen, dtype=torch.float64)
        p_ours.grad = (noise + p_ours.detach()).to(p_ours.dtype)
        p_theirs.grad = (noise + p_theirs.detach()).to(p_theirs.dtype)
        ours.step()
        theirs.step()


def make_params(shape, dtype=torch.float32, seed=1):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)
    return torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("cfg", CONFIGS)
def test_bit_identical_to_torch_muon(shape, cfg):
    a, b = make_params(shape)
    ours, theirs = Muon([a], **cfg), torch.optim.Muon([b], **torch_kwargs(cfg))
    run_pair(ours, theirs, a, b, steps=20)
    assert torch.equal(a, b)
    assert torch.equal(ours.state[a]["momentum_buffer"], theirs.state[b]["momentum_buffer"])
    assert not torch.equal(a, make_params(shape)[0])  # it moved


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_bit_identical_to_torch_muon_other_param_dtypes(dtype):
    # bf16 parameters only with nesterov: torch's nesterov=False path rescales a bf16 buffer in
    # place (its grad.bfloat16() is the buffer itself), which ours deliberately does not copy.
    a, b = make_params((20, 12), dtype=dtype)
    ours, theirs = Muon([a], lr=0.02), torch.optim.Muon([b], lr=0.02)
    run_pair(ours, theirs, a, b, steps=20)
    assert a.dtype == dtype and torch.equal(a, b)


def test_lr_is_read_from_param_groups_each_step():
    a, b = make_params((16, 8))
    ours, theirs = Muon([a], lr=0.05), torch.optim.Muon([b], lr=0.05)
    sched = [torch.optim.lr_scheduler.LambdaLR(o, lambda k: 0.8**k) for o in (ours, theirs)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(10):
        g = torch.randn(a.shape, generator=gen)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
        for s in sched:
            s.step()
    assert torch.equal(a, b)
    assert ours.param_groups[0]["lr"] == pytest.approx(0.05 * 0.8**10)

    ours.param_groups[0]["lr"] = 0.0  # lr 0: no update and no weight decay
    before = a.detach().clone()
    a.grad = torch.randn(a.shape)
    ours.step()
    assert torch.equal(a, before)


@pytest.mark.parametrize("direction", ["ours_to_torch", "torch_to_ours"])
def test_state_dicts_interchange_with_torch(direction):
    cfg = {"lr": 0.02, "weight_decay": 0.01}
    a, b = make_params((24, 10))
    ours, theirs = Muon([a], **cfg), torch.optim.Muon([b], **cfg)
    run_pair(ours, theirs, a, b, steps=5)
    # A fresh optimizer of the other kind continues from the saved state; it must track the
    # original one bit for bit.
    if direction == "ours_to_torch":
        c = torch.nn.Parameter(a.detach().clone())
        other = torch.optim.Muon([c], lr=1.0)
        other.load_state_dict(copy.deepcopy(ours.state_dict()))
        run_pair(ours, other, a, c, steps=5, seed=7)
        assert torch.equal(a, c)
    else:
        c = torch.nn.Parameter(b.detach().clone())
        other = Muon([c], lr=1.0)
        other.load_state_dict(copy.deepcopy(theirs.state_dict()))
        assert other.param_groups[0]["ns_dtype"] == "bf16"  # filled in from the defaults
        run_pair(theirs, other, b, c, steps=5, seed=7)
        assert torch.equal(b, c)


def ns_by_svd(G: torch.Tensor, coeffs, steps: int) -> torch.Tensor:
    """The quintic applied to the singular values: U p^(steps)(S / ||G||_F) V^T."""
    a, b, c = coeffs
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    s = S / G.norm()
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return U @ torch.diag(s) @ Vh


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("steps", [1, 5])
def test_newton_schulz_fp64_equals_polynomial_of_singular_values(shape, steps):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    coeffs = MuonConfig().ns_coefficients
    X = zeropower_via_newtonschulz(G, coeffs, steps, 1e-7, torch.float64)
    assert X.dtype == torch.float64 and X.shape == G.shape
    torch.testing.assert_close(X, ns_by_svd(G, coeffs, steps), rtol=0, atol=1e-12)


def test_ns_dtype_fp64_one_step_closed_form():
    shape, lr, wd = (12, 5), 0.03, 0.1
    p = torch.nn.Parameter(torch.randn(shape, dtype=torch.float64))
    p0 = p.detach().clone()
    G = torch.randn(shape, dtype=torch.float64)
    opt = Muon([p], lr=lr, weight_decay=wd, momentum=0.0, ns_dtype="fp64")
    p.grad = G
    opt.step()
    r = math.sqrt(12 / 5)  # "original": sqrt(max(1, rows / cols))
    expected = p0 * (1 - lr * wd) - lr * r * ns_by_svd(G, MuonConfig().ns_coefficients, 5)
    torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-13)


def test_ns_dtype_fp32_is_closer_to_fp64_than_bf16():
    G = torch.randn(40, 24, generator=torch.Generator().manual_seed(5))
    coeffs = MuonConfig().ns_coefficients
    exact = zeropower_via_newtonschulz(G.double(), coeffs, 5, 1e-7, torch.float64)
    err = {
        d: (zeropower_via_newtonschulz(G, coeffs, 5, 1e-7, d).double() - exact).abs().max().item()
        for d in (torch.float32, torch.bfloat16)
    }
    assert err[torch.float32] < 1e-5 < err[torch.bfloat16] < 0.1


def test_adjusted_lr():
    assert adjusted_lr(0.1, "original", (8, 2)) == pytest.approx(0.2)
    assert adjusted_lr(0.1, "original", (2, 8)) == 0.1
    assert adjusted_lr(0.1, "match_rms_adamw", (2, 16)) == pytest.approx(0.1 * 0.2 * 4)


def test_defaults_come_from_muon_config():
    opt = Muon([torch.nn.Parameter(torch.zeros(3, 4))])
    group = opt.param_groups[0]
    for k, v in MuonConfig().__dict__.items():
        assert group[k] == v


@pytest.mark.parametrize(
    "bad",
    [
        {"lr": -1e-3},
        {"momentum": 1.0},
        {"momentum": -0.1},
        {"weight_decay": -0.1},
        {"eps": 0.0},
        {"ns_steps": 0},
        {"ns_steps": 2.5},
        {"ns_coefficients": (1.0, 2.0)},
        {"adjust_lr_fn": "spectral"},
        {"ns_dtype": "fp8"},
        {"betas": (0.9, 0.99)},
    ],
)
def test_invalid_hyper_parameters(bad):
    with pytest.raises(ValueError):
        Muon([torch.nn.Parameter(torch.zeros(3, 4))], **bad)


@pytest.mark.parametrize("shape", [(5,), (2, 3, 4)])
def test_non_matrix_parameters_are_rejected(shape):
    with pytest.raises(ValueError, match="2-D"):
        Muon([torch.nn.Parameter(torch.zeros(shape))])
    opt = Muon([torch.nn.Parameter(torch.zeros(3, 3))])
    with pytest.raises(ValueError, match="2-D"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(shape))]})
    assert len(opt.param_groups) == 1
