"""Muon's (and NorMuon's) Newton-Schulz coefficient sets (`ns_coefficient_type`, issue 19):
"simple" (the config's one triple at every iteration, torch.optim.Muon's), "quintic" (You
Jiacheng's five per-iteration quintics) and "polar_express" (arXiv 2505.16932).

- The schedule: which (a, b, c) each iteration uses, the last of a set repeating past its end; an
  unknown type is one line.
- What the sets are for: after eight iterations the named sets leave every singular value near 1,
  where the simple quintic stays in its wide band.
- Every implementation runs the schedule: the runtime kernel equals the reference optimizer (1e-12
  in fp64, bit for bit in fp32), the batched kernel the per-matrix one bit for bit, for Muon and
  NorMuon.
"""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest
import torch

import reference
from canzona.errors import SpecError
from canzona.optimizers import (
    NS_COEFFICIENT_SETS,
    MuonConfig,
    NorMuonConfig,
    config_from_dict,
    matrix_optimizer,
    ns_schedule,
)
from canzona.runtime.kernels import apply_update_, matrix_kernel, newton_schulz

TYPES = ("simple", "quintic", "polar_express")


def test_the_schedule_of_each_type():
    simple = MuonConfig()
    assert ns_schedule(simple) == (simple.ns_coefficients,) * simple.ns_steps
    custom = replace(simple, ns_coefficients=(2.0, -1.5, 0.5), ns_steps=3)
    assert ns_schedule(custom) == ((2.0, -1.5, 0.5),) * 3
    for kind, sets in NS_COEFFICIENT_SETS.items():
        assert len(sets) == 5 and all(len(abc) == 3 for abc in sets)
        long = replace(simple, ns_coefficient_type=kind, ns_steps=7)
        assert ns_schedule(long) == sets + (sets[-1],) * 2  # the last one repeats
        assert ns_schedule(replace(long, ns_steps=2)) == sets[:2]
        assert ns_schedule(replace(long, ns_coefficients=(9.0, 9.0, 9.0))) == ns_schedule(long)  # a set ignores it


def test_an_unknown_type_is_one_line():
    with pytest.raises(SpecError, match="muon ns_coefficient_type must be one of simple, quintic, polar_express, "
                                        "got 'cubic'"):
        config_from_dict("muon", {"ns_coefficient_type": "cubic"})
    assert config_from_dict("normuon", {"ns_coefficient_type": "quintic"}).ns_coefficient_type == "quintic"


def test_the_named_sets_orthogonalise_more_tightly_than_the_simple_quintic():
    g = torch.randn(48, 160, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    spread = {}
    for kind in TYPES:
        cfg = replace(MuonConfig(), ns_coefficient_type=kind, ns_steps=8)
        s = torch.linalg.svdvals(newton_schulz(g, ns_schedule(cfg), cfg.ns_steps, cfg.eps, torch.float64))
        spread[kind] = (s.max() - s.min()).item()
        assert 0.6 < s.min() and s.max() < 1.2, (kind, s.min(), s.max())
    assert spread["quintic"] < 0.2 * spread["simple"] and spread["polar_express"] < 0.2 * spread["simple"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("optimizer", ["muon", "normuon"])
def test_the_runtime_kernel_equals_the_reference(optimizer, kind, dtype):
    base = MuonConfig() if optimizer == "muon" else NorMuonConfig()
    cfg = replace(base, ns_coefficient_type=kind, ns_steps=6, ns_dtype="fp64" if dtype == torch.float64 else "fp32")
    gen = torch.Generator().manual_seed(11)
    p = torch.nn.Parameter(torch.randn(20, 12, generator=gen, dtype=dtype))
    mine = p.detach().clone()
    opt = matrix_optimizer(optimizer).part("reference")([p], **{**asdict(cfg), "lr": 0.01})
    state: dict = {}
    for _ in range(4):
        g = torch.randn(20, 12, generator=gen, dtype=dtype)
        p.grad = g.clone()
        opt.step()
        update = matrix_kernel(optimizer)(g.clone(), state, cfg, 0.01)
        apply_update_(mine, update.direction.to(dtype), update)
    if dtype == torch.float32:
        assert torch.equal(mine, p.detach())
    else:
        assert (mine - p.detach()).abs().max() <= 1e-12 * p.detach().abs().max()


@pytest.mark.parametrize("kind", TYPES)
def test_the_batched_kernel_is_the_per_matrix_one_bit_for_bit(kind):
    cfg = replace(MuonConfig(), ns_coefficient_type=kind, ns_dtype="fp32")
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(24, 40, generator=gen) for _ in range(3)]
    alone = [matrix_kernel("muon")(g.clone(), {}, cfg, 0.01) for g in grads]
    together = matrix_optimizer("muon").part("batched")([g.clone() for g in grads], [{} for _ in grads], cfg, 0.01)
    for a, b in zip(alone, together):
        assert torch.equal(a.direction, b.direction)


def test_torch_muons_own_coefficients_are_the_simple_type():
    """The reference stays torch.optim.Muon's, bit for bit, with the default ("simple") type."""
    cfg = replace(MuonConfig(), ns_dtype="bf16")
    p_torch = torch.nn.Parameter(torch.randn(16, 24, generator=torch.Generator().manual_seed(4)))
    p_ref = torch.nn.Parameter(p_torch.detach().clone())
    torch_opt = torch.optim.Muon([p_torch], lr=0.02, weight_decay=cfg.weight_decay, momentum=cfg.momentum,
                                 nesterov=cfg.nesterov, ns_coefficients=cfg.ns_coefficients, eps=cfg.eps,
                                 ns_steps=cfg.ns_steps, adjust_lr_fn=cfg.adjust_lr_fn)
    ref_opt = reference.Muon([p_ref], **{**asdict(cfg), "lr": 0.02})
    for k in range(3):
        g = torch.randn(16, 24, generator=torch.Generator().manual_seed(10 + k))
        p_torch.grad, p_ref.grad = g.clone(), g.clone()
        torch_opt.step()
        ref_opt.step()
    assert torch.equal(p_torch.detach(), p_ref.detach())
