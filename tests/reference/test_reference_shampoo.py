"""reference.Shampoo: inverse roots against scipy, known answers in fp64 (a direct numpy/scipy
transcription of the pinned rule), root refresh schedule, grafting, unpreconditioned sides."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import scipy.linalg
import torch

from canzona.optimizers import ShampooConfig
from reference.shampoo import Shampoo, inverse_root


def frac_power(S, eps, root_order):
    return np.real(scipy.linalg.fractional_matrix_power(S + eps * np.eye(len(S)), -1.0 / root_order))


@pytest.mark.parametrize("n", [3, 8])
@pytest.mark.parametrize("root_order", [2, 4, 6])
@pytest.mark.parametrize("rank", ["full", "deficient"])
def test_inverse_root_matches_scipy(n, root_order, rank):
    rng = np.random.default_rng(n * root_order)
    A = rng.standard_normal((n, n if rank == "full" else n - 2))
    S = A @ A.T  # PSD
    eps = 1e-6 if rank == "full" else 1e-2
    ours = inverse_root(torch.tensor(S), root_order, eps).numpy()
    expected = frac_power(S, eps, root_order)
    np.testing.assert_allclose(ours, expected, rtol=1e-9, atol=1e-9 * np.abs(expected).max())
    # and it is what it claims: (S + eps I)^(-1) when raised to root_order
    np.testing.assert_allclose(
        np.linalg.matrix_power(ours, root_order) @ (S + eps * np.eye(n)), np.eye(n), atol=1e-8
    )


def shampoo_direct(W0, grads, lr, betas, epsilon, wd, f, max_dim, root_order, grafting, graft_eps):
    """ShampooConfig's docstring in numpy + scipy, fp64: the weights after each step."""
    b1, b2 = betas
    m_rows, n_cols = W0.shape
    W = W0.copy()
    L, R = np.zeros((m_rows, m_rows)), np.zeros((n_cols, n_cols))
    L_root, R_root = np.eye(m_rows), np.eye(n_cols)
    mg, vg = np.zeros_like(W), np.zeros_like(W)
    out = []
    for t, G in enumerate(grads, start=1):
        if b2 == 1:
            L, R = L + G @ G.T, R + G.T @ G
        else:
            L, R = b2 * L + (1 - b2) * G @ G.T, b2 * R + (1 - b2) * G.T @ G
        if (t - 1) % f == 0:
            if m_rows <= max_dim:
                L_root = frac_power(L, epsilon, root_order)
            if n_cols <= max_dim:
                R_root = frac_power(R, epsilon, root_order)
        P = L_root @ G @ R_root
        D = P
        if grafting:
            mg = b1 * mg + (1 - b1) * G
            vg = b2 * vg + (1 - b2) * G**2
            A = (mg / (1 - b1**t)) / (np.sqrt(vg / (1 - b2**t)) + graft_eps)
            D = P * np.linalg.norm(A) / np.linalg.norm(P)
        W = W * (1 - lr * wd) - lr * D
        out.append(W.copy())
    return out


def run_ours(W0, grads, **hyper):
    p = torch.nn.Parameter(torch.tensor(W0, dtype=torch.float64))
    opt = Shampoo([p], **hyper)
    out = []
    for G in grads:
        p.grad = torch.tensor(G)
        opt.step()
        out.append(p.detach().numpy().copy())
    return out, opt, p


CASES = [
    # shape, betas, max_preconditioner_dim, precondition_frequency, root_order, grafting, wd
    ((6, 4), (0.9, 0.999), 8192, 1, 4, True, 0.0),
    ((5, 7), (0.9, 0.99), 8192, 2, 4, True, 0.1),
    ((4, 9), (0.9, 1.0), 6, 3, 4, False, 0.0),  # sum statistics; R (9 > 6) unpreconditioned
    ((8, 3), (0.5, 0.9), 4, 2, 2, True, 0.01),  # L (8 > 4) unpreconditioned
    ((5, 5), (0.9, 0.95), 8192, 2, 6, False, 0.0),
]


@pytest.mark.parametrize(("shape", "betas", "max_dim", "f", "root_order", "grafting", "wd"), CASES)
def test_matches_direct_fp64_computation(shape, betas, max_dim, f, root_order, grafting, wd):
    rng = np.random.default_rng(sum(shape))
    W0, grads = rng.standard_normal(shape), [rng.standard_normal(shape) for _ in range(6)]
    hyper = dict(lr=0.02, betas=betas, epsilon=1e-4, weight_decay=wd, precondition_frequency=f)
    hyper.update(max_preconditioner_dim=max_dim, root_order=root_order, grafting=grafting)
    ours, opt, p = run_ours(W0, grads, **hyper)
    direct = shampoo_direct(W0, grads, 0.02, betas, 1e-4, wd, f, max_dim, root_order, grafting, 1e-8)
    for k, (a, b) in enumerate(zip(ours, direct)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-10, err_msg=f"step {k + 1}")
    assert np.abs(ours[-1] - W0).max() > 1e-3
    st = opt.state[p]
    assert ("L" in st) == (shape[0] <= max_dim) and ("R" in st) == (shape[1] <= max_dim)


def test_roots_recomputed_on_steps_one_plus_multiples_of_the_frequency():
    rng = np.random.default_rng(1)
    p = torch.nn.Parameter(torch.tensor(rng.standard_normal((5, 4))))
    opt = Shampoo([p], lr=0.01, precondition_frequency=3)
    changed = []
    for _ in range(10):
        before = (opt.state[p]["L_root"].clone(), opt.state[p]["R_root"].clone()) if opt.state[p] else None
        p.grad = torch.tensor(rng.standard_normal((5, 4)))
        opt.step()
        if before is not None:
            same = [torch.equal(b, opt.state[p][k]) for b, k in zip(before, ("L_root", "R_root"))]
            assert same[0] == same[1]
            changed.append(not same[0])
    assert changed == [(t - 1) % 3 == 0 for t in range(2, 11)]  # steps 4, 7, 10
    torch.testing.assert_close(opt.state[p]["L_root"], inverse_root(opt.state[p]["L"], 4, 1e-12))


def test_grafting_gives_the_adamw_norm():
    rng = np.random.default_rng(2)
    lr, (b1, b2), graft_eps = 0.03, (0.8, 0.9), 1e-8
    p = torch.nn.Parameter(torch.tensor(rng.standard_normal((6, 3))))
    opt = Shampoo([p], lr=lr, betas=(b1, b2), weight_decay=0.0, graft_eps=graft_eps)
    m, v = np.zeros((6, 3)), np.zeros((6, 3))
    for t in range(1, 6):
        G = rng.standard_normal((6, 3))
        before = p.detach().numpy().copy()
        p.grad = torch.tensor(G)
        opt.step()
        m, v = b1 * m + (1 - b1) * G, b2 * v + (1 - b2) * G**2
        A = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + graft_eps)
        step = p.detach().numpy() - before
        assert np.linalg.norm(step) == pytest.approx(lr * np.linalg.norm(A), rel=1e-12)


def test_zero_gradient_gives_a_zero_update():
    p = torch.nn.Parameter(torch.ones(3, 4, dtype=torch.float64))
    opt = Shampoo([p], lr=0.1, weight_decay=0.0)
    p.grad = torch.zeros(3, 4, dtype=torch.float64)
    opt.step()
    assert torch.equal(p, torch.ones(3, 4, dtype=torch.float64))


def test_both_sides_unpreconditioned_is_the_gradient_at_the_adamw_norm():
    rng = np.random.default_rng(3)
    G = rng.standard_normal((5, 6))
    ours, opt, p = run_ours(np.zeros((5, 6)), [G], lr=0.1, weight_decay=0.0, max_preconditioner_dim=4)
    assert not {"L", "R", "L_root", "R_root"} & set(opt.state[p])
    # step 1: A = g / (|g| + eps) elementwise, so ||A||_F ~ sqrt(numel)
    A = G / (np.abs(G) + 1e-8)
    np.testing.assert_allclose(ours[0], -0.1 * G * np.linalg.norm(A) / np.linalg.norm(G), rtol=1e-13)


def test_state_dict_round_trip_continues_identically():
    rng = np.random.default_rng(4)
    grads = [torch.tensor(rng.standard_normal((4, 6))) for _ in range(8)]
    a = torch.nn.Parameter(torch.tensor(rng.standard_normal((4, 6))))
    opt = Shampoo([a], lr=0.02, precondition_frequency=2, weight_decay=0.01)
    for G in grads[:3]:
        a.grad = G.clone()
        opt.step()
    b = torch.nn.Parameter(a.detach().clone())
    other = Shampoo([b], lr=1.0)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    for G in grads[3:]:
        a.grad, b.grad = G.clone(), G.clone()
        opt.step()
        other.step()
    assert torch.equal(a, b)


def test_compute_dtypes():
    gen = torch.Generator().manual_seed(5)
    W0 = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    grads = [torch.randn(6, 4, generator=gen, dtype=torch.float64) for _ in range(5)]
    results = {}
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        p = torch.nn.Parameter(W0.to(dtype, copy=True))
        opt = Shampoo([p], lr=0.05, epsilon=1e-6)
        for G in grads:
            p.grad = G.to(dtype)
            opt.step()
        assert p.dtype == dtype
        expected_state = torch.float64 if dtype == torch.float64 else torch.float32
        assert all(v.dtype == expected_state for v in opt.state[p].values() if torch.is_tensor(v))
        results[dtype] = p.detach().double()
    torch.testing.assert_close(results[torch.float32], results[torch.float64], rtol=0, atol=1e-5)
    torch.testing.assert_close(results[torch.bfloat16], results[torch.float64], rtol=0, atol=5e-2)


def test_defaults_come_from_shampoo_config():
    group = Shampoo([torch.nn.Parameter(torch.zeros(3, 2))]).param_groups[0]
    for k, v in ShampooConfig().__dict__.items():
        assert group[k] == v


@pytest.mark.parametrize(
    "bad",
    [
        {"lr": -1.0},
        {"betas": (1.0, 0.999)},
        {"betas": (0.9, 1.5)},
        {"betas": (0.9, 1.0)},  # grafting (on by default) needs betas[1] < 1
        {"epsilon": 0.0},
        {"graft_eps": -1e-8},
        {"weight_decay": -0.1},
        {"precondition_frequency": 0},
        {"max_preconditioner_dim": -1},
        {"root_order": 0},
        {"compute_dtype": "fp128"},
        {"shampoo_beta": 0.9},
    ],
)
def test_invalid_hyper_parameters(bad):
    with pytest.raises(ValueError):
        Shampoo([torch.nn.Parameter(torch.zeros(3, 2))], **bad)


def test_sum_statistics_without_grafting_are_allowed():
    Shampoo([torch.nn.Parameter(torch.zeros(3, 2))], betas=(0.9, 1.0), grafting=False)


def test_non_matrix_parameters_are_rejected():
    with pytest.raises(ValueError, match="2-D"):
        Shampoo([torch.nn.Parameter(torch.zeros(2, 2, 2))])
