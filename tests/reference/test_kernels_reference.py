"""Rung 2 of the ladder: the runtime's per-matrix kernels equal the independent references within
fp32 round-off, and to 1e-12 relative in fp64, over several steps including preconditioner
refreshes, unpreconditioned sides and weight decay."""

from __future__ import annotations

import math
from dataclasses import asdict, replace

import pytest
import torch

import reference
from canzona.optimizers import AdamWConfig, MuonConfig, ShampooConfig, SOAPConfig
from canzona.runtime.kernels import adamw_step_, apply_update_, matrix_kernel

STEPS = 12
SHAPES = [(24, 16), (16, 24), (20, 20)]
CONFIGS = {
    "muon": [replace(MuonConfig(), ns_dtype="fp64", weight_decay=0.1),
             replace(MuonConfig(), ns_dtype="fp64", nesterov=False, adjust_lr_fn="match_rms_adamw")],
    "soap": [replace(SOAPConfig(), precondition_frequency=3, weight_decay=0.05),
             replace(SOAPConfig(), precondition_frequency=2, max_precond_dim=20, correct_bias=False),
             replace(SOAPConfig(), precondition_frequency=4, max_precond_dim=0)],
    "shampoo": [replace(ShampooConfig(), precondition_frequency=3, weight_decay=0.05),
                replace(ShampooConfig(), precondition_frequency=2, max_preconditioner_dim=20),
                replace(ShampooConfig(), grafting=False, betas=(0.9, 1.0), precondition_frequency=5)],
}
REFERENCE = {"muon": reference.Muon, "soap": reference.SOAP, "shampoo": reference.Shampoo}
TOL = {torch.float64: 1e-12, torch.float32: 2e-5}


def _run(name, cfg, shape, dtype, lr=0.01, inf_at: int | None = None):
    """The worst relative difference of the kernel's weights from the reference's over STEPS
    calls; `inf_at`: +Inf put into one element of both states' exp_avg_sq before that call."""
    gen = torch.Generator().manual_seed(hash((name, shape)) % 2**31)
    p_ref = torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=dtype))
    p_ker = p_ref.detach().clone()
    opt = REFERENCE[name]([p_ref], **{**asdict(cfg), "lr": lr})
    state: dict = {}
    worst = 0.0
    for k in range(STEPS):
        if k == inf_at:
            for s in (state, opt.state[p_ref]):
                s["exp_avg_sq"].view(-1)[5] = math.inf
        g = torch.randn(shape, generator=gen, dtype=dtype)
        p_ref.grad = g.clone()
        opt.step()
        update = matrix_kernel(name)(g.clone(), state, cfg, lr)
        if update is not None:
            apply_update_(p_ker, update.direction.to(dtype), update)
        assert bool(torch.isfinite(p_ker).all()) and bool(torch.isfinite(p_ref).all())
        scale = p_ref.detach().abs().max().item()
        worst = max(worst, (p_ker - p_ref.detach()).abs().max().item() / scale)
    if inf_at is not None:  # kept, as the reference keeps it (in the rotated basis, wherever a refresh moved it)
        assert int(torch.isposinf(state["exp_avg_sq"]).sum()) == int(torch.isposinf(opt.state[p_ref]["exp_avg_sq"]).sum()) == 1
    return worst


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name,index", [(n, i) for n, cs in CONFIGS.items() for i in range(len(cs))])
def test_kernel_equals_reference(name, index, shape, dtype):
    cfg = CONFIGS[name][index]
    if name == "muon" and dtype == torch.float32:
        cfg = replace(cfg, ns_dtype="fp32")
    assert _run(name, cfg, shape, dtype) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("name,index", [(n, i) for n in ("soap", "shampoo") for i in range(len(CONFIGS[n]))
                                        if not (n == "shampoo" and not CONFIGS[n][i].grafting)])
def test_a_plus_inf_second_moment_keeps_the_kernel_finite_and_equal_to_the_reference(name, index, dtype):
    """+Inf in SOAP's (rotated) and Shampoo's grafting exp_avg_sq, which the load check accepts
    (`nonfinite.SECOND_MOMENTS`, as torch's AdamW keeps an overflowed one): that element's update
    is 0, every weight stays finite and equals the reference's within the usual round-off, over
    refreshes after it."""
    assert _run(name, CONFIGS[name][index], (24, 16), dtype, inf_at=4) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_a_plus_inf_adamw_second_moment_steps_bit_for_bit_as_the_reference(dtype):
    """The AdamW kernel from an exp_avg_sq holding +Inf: bit for bit as the reference (torch's
    single-tensor AdamW), finite. (fp16 parameters, whose reference runs in fp32, against
    torch.optim.AdamW's pure-fp16 step: tests/runtime/test_nonfinite_state.py.)"""
    cfg = replace(AdamWConfig(), weight_decay=0.05, eps=1e-4)
    gen = torch.Generator().manual_seed(7)
    p_ref = torch.nn.Parameter(torch.randn(19, 11, generator=gen).to(dtype))
    p_ker = p_ref.detach().clone()
    opt = reference.AdamW([p_ref], **{**asdict(cfg), "lr": 2e-3})
    state: dict = {}
    for k in range(6):
        if k == 2:
            for s in (state, opt.state[p_ref]):
                s["exp_avg_sq"].view(-1)[5] = math.inf
        g = torch.randn(19, 11, generator=gen).to(dtype)
        p_ref.grad = g.clone()
        opt.step()
        adamw_step_(p_ker, g, state, cfg, 2e-3)
        assert torch.equal(p_ker, p_ref.detach()) and bool(torch.isfinite(p_ker).all())
    assert torch.equal(state["exp_avg_sq"], opt.state[p_ref]["exp_avg_sq"])


def test_adamw_kernel_equals_reference_bit_for_bit():
    cfg = replace(AdamWConfig(), weight_decay=0.05)
    gen = torch.Generator().manual_seed(7)
    p_ref = torch.nn.Parameter(torch.randn(19, 11, generator=gen))
    p_ker = p_ref.detach().clone()
    opt = reference.AdamW([p_ref], **{**asdict(cfg), "lr": 2e-3})
    state: dict = {}
    for _ in range(STEPS):
        g = torch.randn(19, 11, generator=gen)
        p_ref.grad = g.clone()
        opt.step()
        adamw_step_(p_ker, g, state, cfg, 2e-3)
        assert torch.equal(p_ker, p_ref.detach())


def test_soap_first_call_initialises_without_updating():
    state: dict = {}
    assert matrix_kernel("soap")(torch.randn(6, 4), state, SOAPConfig(), 0.1) is None
    assert state["step"] == 0 and state["Q_L"].shape == (6, 6) and state["Q_R"].shape == (4, 4)


def test_shampoo_kernel_rejects_grafting_with_sum_statistics():
    with pytest.raises(ValueError):
        matrix_kernel("shampoo")(torch.randn(4, 4), {}, replace(ShampooConfig(), betas=(0.9, 1.0)), 0.1)
