"""reference.SOAP: known answers in fp64 (a direct numpy transcription of the pinned rule),
first-call initialisation, refresh schedule, unpreconditioned sides, state dicts, validation."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from canzona.optimizers import SOAPConfig
from reference.soap import SOAP


def soap_direct(W0, grads, lr, betas, shampoo_beta, eps, wd, f, max_dim, correct_bias=True):
    """SOAPConfig's docstring in numpy, fp64, written out without reference/: the weights after
    each call. A side larger than max_dim uses Q = I (so its GG is never needed)."""
    b1, b2 = betas
    bs = shampoo_beta if shampoo_beta >= 0 else b2
    m_rows, n_cols = W0.shape
    W = W0.copy()
    G = grads[0]  # first call: statistics and eigenbases only
    GL, GR = (1 - bs) * G @ G.T, (1 - bs) * G.T @ G
    use_L, use_R = m_rows <= max_dim, n_cols <= max_dim
    QL = np.linalg.eigh(GL + 1e-30 * np.eye(m_rows))[1][:, ::-1] if use_L else np.eye(m_rows)
    QR = np.linalg.eigh(GR + 1e-30 * np.eye(n_cols))[1][:, ::-1] if use_R else np.eye(n_cols)
    m, v = np.zeros_like(W), np.zeros_like(W)
    out = [W.copy()]
    for t, G in enumerate(grads[1:], start=1):
        Gp = QL.T @ G @ QR
        m = b1 * m + (1 - b1) * G
        v = b2 * v + (1 - b2) * Gp**2
        N = QL @ ((QL.T @ m @ QR) / (np.sqrt(v) + eps)) @ QR.T
        s = lr * np.sqrt(1 - b2**t) / (1 - b1**t) if correct_bias else lr
        W = W - s * N
        W = W - lr * wd * W
        GL = bs * GL + (1 - bs) * G @ G.T
        GR = bs * GR + (1 - bs) * G.T @ G
        if t % f == 0:
            if use_L:
                order = np.argsort(-np.diag(QL.T @ GL @ QL), kind="stable")
                v = v[order, :]
                QL = np.linalg.qr(GL @ QL[:, order])[0]
            if use_R:
                order = np.argsort(-np.diag(QR.T @ GR @ QR), kind="stable")
                v = v[:, order]
                QR = np.linalg.qr(GR @ QR[:, order])[0]
        out.append(W.copy())
    return out


def random_problem(shape, calls, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape), [rng.standard_normal(shape) for _ in range(calls)]


def run_ours(W0, grads, **hyper):
    p = torch.nn.Parameter(torch.tensor(W0, dtype=torch.float64))
    opt = SOAP([p], **hyper)
    out = []
    for G in grads:
        p.grad = torch.tensor(G)
        opt.step()
        out.append(p.detach().numpy().copy())
    return out, opt, p


# Shapes whose preconditioned factors are full rank after the first gradient (a degenerate
# eigenspace has no unique basis, and Adam in the rotated basis depends on that choice).
CASES = [
    # shape, max_precond_dim, precondition_frequency, weight_decay, shampoo_beta, correct_bias
    ((6, 6), 10000, 1, 0.0, -1.0, True),
    ((5, 9), 5, 2, 0.01, 0.9, True),  # R (9 > 5) unpreconditioned
    ((9, 4), 4, 3, 0.1, -1.0, True),  # L (9 > 4) unpreconditioned
    ((7, 7), 10000, 2, 0.0, 0.5, False),
    ((6, 8), 5, 1, 0.01, -1.0, True),  # both sides unpreconditioned: Adam
]


@pytest.mark.parametrize(("shape", "max_dim", "f", "wd", "bs", "correct_bias"), CASES)
def test_matches_direct_fp64_computation(shape, max_dim, f, wd, bs, correct_bias):
    W0, grads = random_problem(shape, calls=7, seed=sum(shape) + f)
    hyper = dict(lr=0.05, betas=(0.9, 0.95), shampoo_beta=bs, eps=1e-8, weight_decay=wd)
    hyper.update(precondition_frequency=f, max_precond_dim=max_dim, correct_bias=correct_bias)
    ours, opt, p = run_ours(W0, grads, **hyper)
    direct = soap_direct(W0, grads, 0.05, (0.9, 0.95), bs, 1e-8, wd, f, max_dim, correct_bias)
    for k, (a, b) in enumerate(zip(ours, direct)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-11, err_msg=f"call {k + 1}")
    assert np.abs(ours[-1] - W0).max() > 1e-3
    assert opt.state[p]["step"] == len(grads) - 1


def test_two_steps_written_out():
    """Two updates with explicit formulas (no loop): eigenbases of the first gradient's
    statistics, then Adam in that basis (precondition_frequency large: no refresh)."""
    W0, (G1, G2, G3) = random_problem((4, 4), calls=3, seed=11)
    lr, b1, b2, eps = 0.1, 0.9, 0.95, 1e-8
    QL = np.linalg.eigh((1 - b2) * G1 @ G1.T)[1][:, ::-1]
    QR = np.linalg.eigh((1 - b2) * G1.T @ G1)[1][:, ::-1]
    m1, v1 = (1 - b1) * G2, (1 - b2) * (QL.T @ G2 @ QR) ** 2
    W1 = W0 - lr * np.sqrt(1 - b2) / (1 - b1) * QL @ ((QL.T @ m1 @ QR) / (np.sqrt(v1) + eps)) @ QR.T
    m2 = b1 * m1 + (1 - b1) * G3
    v2 = b2 * v1 + (1 - b2) * (QL.T @ G3 @ QR) ** 2
    W2 = W1 - lr * np.sqrt(1 - b2**2) / (1 - b1**2) * QL @ ((QL.T @ m2 @ QR) / (np.sqrt(v2) + eps)) @ QR.T
    ours, _, _ = run_ours(W0, [G1, G2, G3], lr=lr, betas=(b1, b2), weight_decay=0.0)
    np.testing.assert_array_equal(ours[0], W0)
    np.testing.assert_allclose(ours[1], W1, rtol=0, atol=1e-12)
    np.testing.assert_allclose(ours[2], W2, rtol=0, atol=1e-12)


def test_first_call_initialises_and_skips():
    W0, (G,) = random_problem((5, 3), calls=1, seed=2)
    ours, opt, p = run_ours(W0, [G], lr=1.0, weight_decay=0.5, betas=(0.9, 0.8), shampoo_beta=-1.0)
    np.testing.assert_array_equal(ours[0], W0)  # no update, no weight decay
    st = opt.state[p]
    assert st["step"] == 0
    assert not st["exp_avg"].any() and not st["exp_avg_sq"].any()
    for side, gg in (("L", G @ G.T), ("R", G.T @ G)):
        GG, Q = st[f"GG_{side}"].numpy(), st[f"Q_{side}"].numpy()
        np.testing.assert_allclose(GG, (1 - 0.8) * gg, rtol=1e-14, atol=1e-15)  # beta_s = betas[1]
        np.testing.assert_allclose(Q.T @ Q, np.eye(len(Q)), atol=1e-13)
        D = Q.T @ GG @ Q
        np.testing.assert_allclose(D, np.diag(np.diag(D)), atol=1e-13)
        assert np.all(np.diff(np.diag(D)) <= 1e-15)  # descending eigenvalues


def test_refresh_happens_exactly_on_multiples_of_the_frequency():
    W0, grads = random_problem((6, 4), calls=11, seed=3)
    p = torch.nn.Parameter(torch.tensor(W0))
    opt = SOAP([p], lr=0.01, precondition_frequency=3)
    changed = []
    for G in grads:
        before = {k: opt.state[p][k].clone() for k in ("Q_L", "Q_R")} if opt.state[p] else None
        p.grad = torch.tensor(G)
        opt.step()
        if before is not None:
            step = opt.state[p]["step"]
            same = [torch.equal(before[k], opt.state[p][k]) for k in before]
            assert same[0] == same[1]
            changed.append((step, not same[0]))
    assert changed == [(s, s % 3 == 0) for s in range(1, 11)]


def test_unpreconditioned_sides_reduce_to_adam():
    """max_precond_dim below both sides: identity bases, so SOAP (after its skipped first call) is
    Adam with eps scaled by sqrt(1 - beta2^t) (torch: eps added to sqrt(v_hat)); eps -> 0 equal."""
    W0, grads = random_problem((6, 8), calls=8, seed=4)
    ours, opt, p = run_ours(W0, grads, lr=0.02, betas=(0.9, 0.99), eps=1e-30, weight_decay=0.0, max_precond_dim=5)
    assert not any(k.startswith(("GG_", "Q_")) for k in opt.state[p])
    q = torch.nn.Parameter(torch.tensor(W0))
    adam = torch.optim.Adam([q], lr=0.02, betas=(0.9, 0.99), eps=1e-30)
    for G, expected in zip(grads[1:], ours[1:]):
        q.grad = torch.tensor(G)
        adam.step()
        np.testing.assert_allclose(q.detach().numpy(), expected, rtol=0, atol=1e-13)


def test_state_dict_round_trip_continues_identically():
    W0, grads = random_problem((5, 7), calls=10, seed=5)
    a = torch.nn.Parameter(torch.tensor(W0))
    opt = SOAP([a], lr=0.02, precondition_frequency=2, weight_decay=0.01)
    for G in grads[:4]:
        a.grad = torch.tensor(G)
        opt.step()
    b = torch.nn.Parameter(a.detach().clone())
    other = SOAP([b], lr=1.0)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert other.param_groups[0]["precondition_frequency"] == 2
    for G in grads[4:]:
        a.grad, b.grad = torch.tensor(G), torch.tensor(G)
        opt.step()
        other.step()
    assert torch.equal(a, b)


def test_compute_dtypes():
    gen = torch.Generator().manual_seed(6)
    W0 = torch.randn(6, 6, generator=gen, dtype=torch.float64)  # full-rank factors (see CASES)
    grads = [torch.randn(6, 6, generator=gen, dtype=torch.float64) for _ in range(6)]
    results = {}
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        p = torch.nn.Parameter(W0.to(dtype, copy=True))
        opt = SOAP([p], lr=0.05, precondition_frequency=2)
        for G in grads:
            p.grad = G.to(dtype)
            opt.step()
        assert p.dtype == dtype
        expected_state = torch.float64 if dtype == torch.float64 else torch.float32
        assert all(v.dtype == expected_state for v in opt.state[p].values() if torch.is_tensor(v))
        results[dtype] = p.detach().double()
    torch.testing.assert_close(results[torch.float32], results[torch.float64], rtol=0, atol=1e-5)
    torch.testing.assert_close(results[torch.bfloat16], results[torch.float64], rtol=0, atol=5e-2)

    p = torch.nn.Parameter(W0.float())
    opt = SOAP([p], compute_dtype="fp64")
    p.grad = grads[0].float()
    opt.step()
    assert opt.state[p]["Q_L"].dtype == torch.float64


def test_lr_is_read_each_step():
    W0, grads = random_problem((4, 3), calls=3, seed=7)
    p = torch.nn.Parameter(torch.tensor(W0))
    opt = SOAP([p], lr=0.1, weight_decay=0.1)
    for G in grads[:2]:
        p.grad = torch.tensor(G)
        opt.step()
    opt.param_groups[0]["lr"] = 0.0
    before = p.detach().clone()
    p.grad = torch.tensor(grads[2])
    opt.step()
    assert torch.equal(p, before)


def test_defaults_come_from_soap_config():
    group = SOAP([torch.nn.Parameter(torch.zeros(3, 2))]).param_groups[0]
    for k, v in SOAPConfig().__dict__.items():
        assert group[k] == v


@pytest.mark.parametrize(
    "bad",
    [
        {"lr": -1.0},
        {"betas": (1.0, 0.95)},
        {"betas": (0.9, 1.0)},
        {"shampoo_beta": 1.0},
        {"eps": 0.0},
        {"eig_eps": -1.0},
        {"weight_decay": -0.1},
        {"precondition_frequency": 0},
        {"precondition_frequency": 1.5},
        {"max_precond_dim": -1},
        {"compute_dtype": "double"},
        {"root_order": 4},
    ],
)
def test_invalid_hyper_parameters(bad):
    with pytest.raises(ValueError):
        SOAP([torch.nn.Parameter(torch.zeros(3, 2))], **bad)


def test_non_matrix_parameters_are_rejected():
    with pytest.raises(ValueError, match="2-D"):
        SOAP([torch.nn.Parameter(torch.zeros(4))])


def test_zero_gradients_only_decay_the_weights():
    p = torch.nn.Parameter(torch.ones(4, 3, dtype=torch.float64))
    opt = SOAP([p], lr=0.1, weight_decay=0.5, precondition_frequency=2)
    for _ in range(6):
        p.grad = torch.zeros(4, 3, dtype=torch.float64)
        opt.step()
    # five updates (the first call only initialises): N = 0, so p = (1 - lr wd)^5
    torch.testing.assert_close(p.detach(), torch.full((4, 3), 0.95**5, dtype=torch.float64), rtol=1e-15, atol=0)
    assert all(torch.isfinite(v).all() for v in opt.state[p].values() if torch.is_tensor(v))
