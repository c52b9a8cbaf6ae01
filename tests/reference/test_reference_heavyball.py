"""reference.SOAP / reference.Shampoo against heavyball 3.2.1 (an independent implementation).

Every difference between heavyball's rules and ours that we found (reading heavyball/chainable.py,
heavyball/utils.py and heavyball/__init__.py of 3.2.1):

heavyball.SOAP (`scale_by_soap`) vs reference.SOAP (SOAPConfig's docstring):
 S1. Statistics: heavyball seeds GG with the first G G^T (a lerp with weight 1) and then lerps with
     the bias-corrected beta_debias(shampoo_beta, t) = 1 - (1 - b) / (1 - b^t); ours lerps from 0
     with 1 - b. So GG_heavyball = GG_ours / (1 - b^t) after t calls: a positive scalar, which
     changes neither the eigenvectors, nor the argsort, nor QR(GG Q) (checked below).
 S2. Adam denominator: heavyball uses bias-corrected moments and max(sqrt(v_hat), eps); ours
     lr sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps) (the paper's form). Same as eps -> 0,
     so the comparisons use eps = 1e-30. heavyball always bias-corrects (its correct_bias
     argument was removed in 3.0); ours has correct_bias (default True).
 S3. Refresh schedule: heavyball's cumulative-probability counter (`psgd_should_update`, prob
     1/f) also counts the skipped first call, so it refreshes on calls c with c % f == 0; ours on
     update steps s = c - 1 with s % f == 0. Identical only for f = 1; for f = 4 we offset
     heavyball's counter by one call to line them up (tested both ways). For f whose 1/f is not
     a binary fraction (e.g. our default 10) its float accumulation also drifts (0.1 * 10 < 1).
     heavyball can instead use a probabilistic schedule (use_precond_schedule); ours cannot.
 S4. QR refresh: heavyball factorises (GG + lift |lambda|_max I) Q, lift = max(1e-8,
     min(64 n eps_dtype, 0.125)), i.e. a relative shift of 1e-8 in fp64 (and ~1e-5 for n ~ 100 in
     fp32); ours factorises GG Q. This is the only source of disagreement beyond round-off in the
     SOAP comparison (removing the floor from heavyball brings it to ~1e-12, tested).
 S5. Basis bookkeeping: heavyball makes R's diagonal positive and scatters the new columns back to
     the old column positions (exp_avg_sq not permuted); ours keeps QR's signs, permutes Q's
     columns into descending estimated-eigenvalue order (stable argsort) and permutes exp_avg_sq
     to match. Column signs and order do not change the update.
 S6. First moment: heavyball keeps exp_avg in the rotated basis and rotates it at each refresh;
     ours keeps it unrotated and projects it each step (equal for square orthogonal Q).
 S7. Weight decay: heavyball p <- p (1 - lr wd) - lr N; ours p <- p - s N, then p <- p - lr wd p
     (paper code). Compared with wd = 0.
 S8. Defaults: heavyball betas (0.9, 0.95), shampoo_beta 0.95, precondition_frequency 2,
     max_precond_dim 2048; ours (SOAPConfig) betas (0.95, 0.95), shampoo_beta = betas[1],
     frequency 10, max dim 10000. A side is preconditioned iff its size <= max dim in both
     (heavyball also skips size-1 sides).
 S9. Dtypes and shapes: heavyball stores moments in storage_dtype (float32 by default, so fp64
     runs need storage_dtype="float64"; bf16 storage uses stochastic rounding), merges/splits
     dimensions (merge_dims, split; turned off here), buckets same-shape parameters, skips 1-D
     parameters by default, and has optional caution, MARS, PaLM beta2, warmup, gradient/update
     clipping and precond_grad_accum (all off here). Ours takes 2-D parameters only.
 S10. heavyball computes beta_debias(beta, step) as `python_float ** int64_tensor`, which has
     torch's default dtype: its EMA weights are fp32 (~1e-8 relative error) even for fp64
     parameters unless the default dtype is float64 (as in these tests).
 S11. Initial eigh: heavyball retries a failed eigh in fp64 and then with eps grown from 1e-30
     towards 1e-3; ours calls eigh(GG + eig_eps I) once in the compute dtype.
 S12. API: heavyball sets p.grad = None after each step (consume_grad) and warns when lr changes
     between steps (LR schedules are "experimental" unless multi_tensor); ours leaves grads and
     reads lr from param_groups each step.

heavyball has no Shampoo with our rule. heavyball.KLShampoo vs reference.Shampoo:
 K1. Factor statistics are KL-corrected (each side's G G^T is weighted by the other side's inverse
     eigenvalues) unless the other side is unpreconditioned; bias-corrected EMA with shampoo_beta;
     seeded with init_factor I (default 0.1) or, with init_factor = 0, with the first G G^T.
     Ours: plain G G^T sums (betas[1] == 1) or EMA with betas[1], starting from 0.
 K2. Preconditioner: Q diag(max(d, eps)^(-1/2)) Q^T with d = diag(Q^T GG Q) in a basis Q
     refreshed by one QR power iteration (an exact eigenbasis only after the initial eigh); ours
     the exact (GG + epsilon I)^(-1/root_order) from eigh, root_order 4 by default.
 K3. It preconditions a momentum EMA of G (betas[0]); ours preconditions G.
 K4. It skips the first call (initialisation only); ours updates on step 1.
 K5. No grafting (ours: AdamW grafting by default); factor norm balancing across sides
     (psgd_balance_Q); the gradient fed to the statistics is dampened (dampening 1e-9); same
     refresh-schedule counter as S3 and S9-S12; weight decay p (1 - lr wd) before the update
     (as ours).
 So only parts can be compared: the first real KLShampoo update (call 2: the seeded statistics
 G1 G1^T, exact eigenbasis, root_order = 2, betas[0] = 0) against our step-2 update with sum
 statistics whose roots were computed at step 1; Shampoo's EMA statistics against
 heavyball.SOAP's GG (S1); and the grafting magnitude against heavyball.AdamW's update norm.

Tolerances: with eps -> 0 the rules are algebraically equal except for S4, so updates agree to
fp64 round-off amplified by the factors' conditioning (1e-10 relative); with heavyball's lift on,
the basis of a well-conditioned factor moves by O(lift * condition number) ~ 1e-8 .. 1e-7,
hence 1e-6 relative.
"""

from __future__ import annotations

import re

import pytest
import torch

from reference.shampoo import Shampoo
from reference.soap import SOAP

heavyball = pytest.importorskip("heavyball")

F64 = torch.float64


@pytest.fixture(autouse=True)
def eager_fp64_heavyball(monkeypatch):
    """heavyball compiles its kernels with torch.compile unless utils.compile_mode is None, and
    computes its debiased betas in torch's default dtype (S10), so fp64 runs need that too."""
    monkeypatch.setattr(heavyball.utils, "compile_mode", None)
    monkeypatch.setattr(heavyball.utils, "compile_mode_recommended_to_none", None)
    default = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    yield
    torch.set_default_dtype(default)


def hb_state(opt, p, name: str):
    """heavyball keeps per-parameter state under state[p][view index]['<fn>_<name>_<idx>']."""
    (value,) = [v for k, v in opt.state[p][0].items() if re.fullmatch(rf".+_{name}_\d+", k)]
    return value


def problem(shape, calls, seed, shift=0.0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen, dtype=F64)
    eye = torch.eye(*shape, dtype=F64)
    return w, [torch.randn(shape, generator=gen, dtype=F64) + shift * eye for _ in range(calls)]


def hb_soap(p, **kw):
    return heavyball.SOAP(
        [p], merge_dims=False, storage_dtype="float64", multi_tensor=False, weight_decay=0.0, **kw
    )


def compare_soap(shape, max_dim, f=1, calls=10, seed=0, offset_heavyball_schedule=False):
    """Max relative difference of the weight change over `calls` identical-gradient calls."""
    w0, grads = problem(shape, calls, seed)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    hyper = dict(lr=0.1, betas=(0.9, 0.95), shampoo_beta=0.9, eps=1e-30, precondition_frequency=f, max_precond_dim=max_dim)
    ours, theirs = SOAP([a], weight_decay=0.0, **hyper), hb_soap(b, **hyper)
    if offset_heavyball_schedule:  # see S3: make heavyball's counter skip its initialising call
        theirs.inner_group["cumulative_prob"] = 1 - 1 / f
    worst = 0.0
    for G in grads:
        a.grad, b.grad = G.clone(), G.clone()
        ours.step()
        theirs.step()
        moved = (a - w0).norm().item()
        if moved > 0:
            worst = max(worst, (a - b).norm().item() / moved)
        else:
            assert torch.equal(a, b)  # both skip the first call
    assert torch.isfinite(a).all()
    return worst


# Factors full rank from the first gradient on: square, or the larger side unpreconditioned.
SOAP_CASES = [((8, 8), 8), ((6, 10), 8), ((12, 5), 6), ((16, 16), 100), ((6, 10), 4)]


@pytest.mark.parametrize(("shape", "max_dim"), SOAP_CASES)
def test_soap_matches_heavyball(shape, max_dim):
    assert compare_soap(shape, max_dim) < 1e-6


@pytest.fixture
def no_lift(monkeypatch):
    """heavyball's refresh with its 1e-8 floor removed (lift = 64 n eps_fp64 ~ 1e-13)."""
    original = heavyball.utils.get_orthogonal_matrix_QR

    def qr_without_floor(*args, **kwargs):
        return original(*args, **{**kwargs, "floor": 0.0})

    monkeypatch.setattr(heavyball.utils, "get_orthogonal_matrix_QR", qr_without_floor)


@pytest.mark.parametrize(("shape", "max_dim"), SOAP_CASES)
def test_soap_matches_heavyball_without_its_lift(shape, max_dim, no_lift):
    assert compare_soap(shape, max_dim) < 1e-10


def test_soap_refresh_schedules_differ_by_one_call(no_lift):
    assert compare_soap((8, 8), 8, f=4, calls=12, offset_heavyball_schedule=True) < 1e-10
    assert compare_soap((8, 8), 8, f=4, calls=12) > 1e-3  # S3: without the offset they differ


def test_soap_statistics_and_initial_eigenbasis():
    shape, beta = (7, 5), 0.9
    w0, grads = problem(shape, 6, seed=1)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    hyper = dict(lr=0.01, shampoo_beta=beta, precondition_frequency=100)
    ours, theirs = SOAP([a], **hyper), hb_soap(b, **hyper)
    for t, G in enumerate(grads, start=1):
        a.grad, b.grad = G.clone(), G.clone()
        ours.step()
        theirs.step()
        GG_L, GG_R = hb_state(theirs, b, "GG")
        torch.testing.assert_close(GG_L[0] * (1 - beta**t), ours.state[a]["GG_L"], rtol=1e-13, atol=0)
        torch.testing.assert_close(GG_R[0] * (1 - beta**t), ours.state[a]["GG_R"], rtol=1e-13, atol=1e-15)
        if t == 1:  # eigh of the seeded factor: the same eigenvectors up to sign (R: full rank)
            Q_R = hb_state(theirs, b, "Q")[1][0]
            ours_Q = ours.state[a]["Q_R"]
            torch.testing.assert_close((Q_R.T @ ours_Q).abs(), torch.eye(5, dtype=F64), rtol=0, atol=1e-10)


def test_shampoo_statistics_match_heavyball_soap():
    """Our Shampoo's EMA statistics are SOAP's GG (S1): heavyball's GG * (1 - b^t)."""
    beta = 0.95
    w0, grads = problem((6, 9), 5, seed=2)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    ours = Shampoo([a], lr=0.01, betas=(0.9, beta))
    theirs = hb_soap(b, lr=0.0, shampoo_beta=beta, max_precond_dim=100, precondition_frequency=1)
    for t, G in enumerate(grads, start=1):
        a.grad, b.grad = G.clone(), G.clone()
        ours.step()
        theirs.step()
        GG_L, GG_R = hb_state(theirs, b, "GG")
        torch.testing.assert_close(GG_L[0] * (1 - beta**t), ours.state[a]["L"], rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(GG_R[0] * (1 - beta**t), ours.state[a]["R"], rtol=1e-13, atol=1e-15)


def test_shampoo_grafting_magnitude_matches_heavyball_adamw():
    """||our update|| / lr = ||A||_F, A = heavyball.AdamW's direction (lr 1, eps -> 0, see S2)."""
    lr, betas = 0.1, (0.9, 0.95)
    w0, grads = problem((6, 9), 6, seed=3)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    ours = Shampoo([a], lr=lr, betas=betas, weight_decay=0.0, graft_eps=1e-30)
    theirs = heavyball.AdamW([b], lr=1.0, betas=betas, eps=1e-30, weight_decay=0.0, storage_dtype="float64", multi_tensor=False)
    for G in grads:
        a0, b0 = a.detach().clone(), b.detach().clone()
        a.grad, b.grad = G.clone(), G.clone()
        ours.step()
        theirs.step()
        assert (a - a0).norm().item() / lr == pytest.approx((b - b0).norm().item(), rel=1e-13)


@pytest.mark.parametrize(("shape", "max_dim"), [((8, 8), 8), ((6, 10), 8), ((12, 5), 6), ((7, 7), 100)])
def test_shampoo_inverse_square_root_update_matches_kl_shampoo(shape, max_dim):
    """Our step 2 with sum statistics and roots from step 1 is (G1 G1^T + eps)^(-1/2) G2 (...)^(-1/2);
    KLShampoo's first update (call 2) is Q diag(d^(-1/2)) Q^T G2 (...) with Q, d from the seeded
    G1 G1^T (K1-K4 with root_order 2, betas[0] 0, init_factor 0, no grafting)."""
    w0, grads = problem(shape, 2, seed=4, shift=3.0)  # G + 3I: well-conditioned factors
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    ours = Shampoo([a], lr=0.1, betas=(0.0, 1.0), weight_decay=0.0, precondition_frequency=100,
                   max_preconditioner_dim=max_dim, root_order=2, grafting=False)
    theirs = heavyball.KLShampoo([b], lr=0.1, betas=(0.0, 0.95), eps=1e-30, weight_decay=0.0,
                                 precondition_frequency=100, max_precond_dim=max_dim, merge_dims=False,
                                 storage_dtype="float64", multi_tensor=False, init_factor=0.0)
    steps = []
    for G in grads:
        a0, b0 = a.detach().clone(), b.detach().clone()
        a.grad, b.grad = G.clone(), G.clone()
        ours.step()
        theirs.step()
        steps.append((a - a0, b - b0))
    assert not steps[0][1].any()  # K4: heavyball's first call only initialises
    ours_step, their_step = steps[1]
    assert (ours_step - their_step).norm() / ours_step.norm() < 1e-10
