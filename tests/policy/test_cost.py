"""Cost models (docs/design.md §4): FLOP formulas, state bytes, seconds, measured tables."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canzona.cost import (
    AnalyticCost,
    DeviceRate,
    TableCost,
    default_rate,
    init_kernels,
    optimizer_kernels,
    state_bytes,
    step_flops,
)
from canzona.errors import SpecError
from canzona.optimizers import MuonConfig, ShampooConfig, SOAPConfig

SHAPES = [(1, 1), (7, 3), (3, 7), (128, 128), (1024, 5120), (5120, 1024), (8192, 5120),
          (5120, 25600), (25600, 5120), (96, 4000)]
SMALL = [(7, 3), (3, 7), (128, 128), (1024, 5120), (5120, 1024), (96, 4000), (8192, 5120)]


REFRESH = (".power_iter", ".qr", ".eigh_root")


def gemm_flops(kernels) -> float:
    """Sum of the per-step GEMM flops (the amortised preconditioner refresh excluded)."""
    return sum(k.flops * k.count for k in kernels if k.kind == "gemm" and not k.name.endswith(REFRESH))


def refresh_flops(kernels) -> float:
    """Amortised flops of the preconditioner refresh (power iteration + QR, or eigh roots)."""
    return sum(k.flops * k.count for k in kernels if k.name.endswith(REFRESH))


def kinds(kernels, kind):
    return [k for k in kernels if k.kind == kind]


# --- Muon -------------------------------------------------------------------------------------


@pytest.mark.parametrize("m, n", SHAPES)
@pytest.mark.parametrize("ns_steps", [1, 5])
def test_muon_ns_gemm_flops_equal_closed_form(m, n, ns_steps):
    cfg = MuonConfig(ns_steps=ns_steps)
    ks = optimizer_kernels("muon", (m, n), cfg)
    s, big = min(m, n), max(m, n)
    assert gemm_flops(ks) == ns_steps * (4 * s * s * big + 2 * s**3)
    assert len(kinds(ks, "gemm")) == 3 * ns_steps
    # GEMM shapes are those of the transposed-to-wide problem: Gram s x s (inner l), square, update.
    assert {k.gemm for k in kinds(ks, "gemm")} == {(s, s, big), (s, s, s), (s, big, s)}
    # The rest is elementwise work linear in the matrix (momentum, normalise, apply).
    elementwise = sum(k.flops for k in kinds(ks, "elementwise"))
    assert 0 < elementwise <= 20 * m * n
    assert step_flops("muon", (m, n), cfg) == gemm_flops(ks) + elementwise
    assert all(k.count == 1.0 for k in ks)


@pytest.mark.parametrize("m, n", SHAPES)
def test_muon_cost_is_transpose_symmetric(m, n):
    assert step_flops("muon", (m, n)) == step_flops("muon", (n, m))
    cost = AnalyticCost()
    assert cost.seconds("muon", (m, n)) == cost.seconds("muon", (n, m))


def test_muon_ns_dominates_large_matrices():
    m, n = 8192, 5120
    s, big = n, m
    ns = 5 * (4 * s * s * big + 2 * s**3)
    assert ns < step_flops("muon", (m, n)) < ns * (1 + 1e-3)


# --- SOAP -------------------------------------------------------------------------------------


@pytest.mark.parametrize("m, n", SMALL)
@pytest.mark.parametrize("f", [1, 10, 37])
def test_soap_flops_both_sides_preconditioned(m, n, f):
    cfg = SOAPConfig(precondition_frequency=f)
    ks = optimizer_kernels("soap", (m, n), cfg)
    assert gemm_flops(ks) == 8 * m * n * (m + n)
    expected_refresh = sum((2 * k**3 + 4 / 3 * k**3) / f for k in (m, n))
    assert refresh_flops(ks) == pytest.approx(expected_refresh, rel=1e-12)
    assert all(k.count == 1.0 / f for k in ks if k.name.endswith(REFRESH))
    elementwise = sum(k.flops for k in kinds(ks, "elementwise"))
    assert step_flops("soap", (m, n), cfg) == pytest.approx(
        8 * m * n * (m + n) + expected_refresh + elementwise, rel=1e-12)
    assert step_flops("soap", (m, n), cfg) == pytest.approx(step_flops("soap", (n, m), cfg), rel=1e-12)


@pytest.mark.parametrize("m, n", [(20000, 512), (512, 20000), (12000, 11000)])
def test_soap_side_above_max_precond_dim_is_dropped(m, n):
    cfg = SOAPConfig()  # max_precond_dim 10000
    ks = optimizer_kernels("soap", (m, n), cfg)
    kept = [k for k in (m, n) if k <= cfg.max_precond_dim]
    f = cfg.precondition_frequency
    assert gemm_flops(ks) == sum(8 * k * m * n for k in kept)
    assert refresh_flops(ks) == pytest.approx(
        sum((2 * k**3 + 4 / 3 * k**3) / f for k in kept), rel=1e-12)
    assert len(init_kernels("soap", (m, n), cfg)) == len(kept)
    assert state_bytes("soap", (m, n), cfg) == 8 * m * n + 8 * sum(k * k for k in kept)
    # A larger limit brings the side back.
    wide = replace(cfg, max_precond_dim=30000)
    assert gemm_flops(optimizer_kernels("soap", (m, n), wide)) == 8 * m * n * (m + n)


def test_soap_initial_eigh_is_one_off_9k3_per_side():
    ks = init_kernels("soap", (300, 700))
    assert sorted(k.flops for k in ks) == [9.0 * 300**3, 9.0 * 700**3]
    assert all(k.count == 1.0 and k.kind == "solver" for k in ks)
    assert init_kernels("muon", (300, 700)) == [] and init_kernels("shampoo", (300, 700)) == []


# --- Shampoo ----------------------------------------------------------------------------------


@pytest.mark.parametrize("m, n", SMALL)
@pytest.mark.parametrize("f", [1, 100])
def test_shampoo_flops(m, n, f):
    """Statistics (G Gᵀ, Gᵀ G) and two-sided preconditioning are 2 GEMMs per side, each 2·k·m·n:
    4·m·n·(m+n) in all. An earlier design note (docs/design.md §4.1) quoted 2·m·n·(m+n) "for statistics and preconditioning";
    that figure is the statistics alone (or counts multiply-adds, not FLOPs)."""
    cfg = ShampooConfig(precondition_frequency=f)
    ks = optimizer_kernels("shampoo", (m, n), cfg)
    per_step_gemm = sum(k.flops for k in kinds(ks, "gemm"))
    assert per_step_gemm == 4 * m * n * (m + n)
    stats = sum(k.flops for k in ks if k.name.endswith(".stats"))
    assert stats == 2 * m * n * (m + n)  # the earlier note's figure (docs/design.md §4.1)
    roots = [k for k in kinds(ks, "solver")]
    assert sum(k.flops * k.count for k in roots) == pytest.approx((9 * m**3 + 9 * n**3) / f, rel=1e-12)
    assert all(k.count == 1.0 / f for k in roots)


def test_shampoo_side_above_max_dim_is_dropped_and_grafting_optional():
    cfg = ShampooConfig()  # max_preconditioner_dim 8192
    m, n = 8193, 100
    ks = optimizer_kernels("shampoo", (m, n), cfg)
    assert sum(k.flops for k in kinds(ks, "gemm")) == 4 * m * n * n
    assert [k.gemm for k in kinds(ks, "solver")] == [(n,)]
    with_graft = step_flops("shampoo", (64, 32), cfg)
    no_graft = step_flops("shampoo", (64, 32), replace(cfg, grafting=False))
    assert with_graft - no_graft == 12 * 64 * 32
    assert state_bytes("shampoo", (64, 32), replace(cfg, grafting=False)) == 8 * (64**2 + 32**2)


# --- AdamW ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1,), (5120,), (151936, 1024), (3, 4, 5)])
def test_adamw_is_ten_flops_per_element(shape):
    numel = 1
    for d in shape:
        numel *= d
    assert step_flops("adamw", shape) == 10 * numel
    ks = optimizer_kernels("adamw", shape)
    assert len(ks) == 1 and ks[0].kind == "elementwise"
    assert state_bytes("adamw", shape) == 8 * numel


# --- state bytes ------------------------------------------------------------------------------


@pytest.mark.parametrize("m, n", SMALL)
def test_state_bytes_formulas(m, n):
    assert state_bytes("muon", (m, n)) == 4 * m * n
    assert state_bytes("adamw", (m, n)) == 8 * m * n
    assert state_bytes("soap", (m, n)) == 8 * m * n + 8 * (m * m + n * n)
    assert state_bytes("shampoo", (m, n)) == 8 * (m * m + n * n) + 8 * m * n
    for opt in ("muon", "adamw", "soap", "shampoo"):
        assert state_bytes(opt, (m, n)) == state_bytes(opt, (n, m))


def test_unknown_optimizer_and_bad_shapes_raise_spec_error():
    for call in (lambda: optimizer_kernels("sgd", (4, 4)), lambda: state_bytes("sgd", (4, 4)),
                 lambda: step_flops("lion", (4, 4)), lambda: optimizer_kernels("muon", (4,)),
                 lambda: optimizer_kernels("soap", (2, 3, 4)),
                 lambda: AnalyticCost().seconds("nope", (4, 4))):
        with pytest.raises(SpecError) as err:
            call()
        assert "\n" not in str(err.value)


# --- seconds ----------------------------------------------------------------------------------


@pytest.mark.parametrize("opt", ["muon", "soap", "shampoo", "adamw"])
@pytest.mark.parametrize("m, n", SHAPES)
def test_seconds_positive_and_at_least_launch_overhead(opt, m, n):
    cost = AnalyticCost()
    ks = optimizer_kernels(opt, (m, n))
    t = cost.seconds(opt, (m, n))
    assert t > 0
    assert t >= sum(k.count for k in ks) * default_rate().launch_s * (1 - 1e-12)
    assert t == pytest.approx(sum(default_rate().kernel_seconds(k) for k in ks), rel=1e-12)


def fixed_seconds(kernels) -> float:
    """What kernels cost whatever their size: a launch each, and a GEMM's fixed latency
    (`gemm_model.fixed_s`, its first fill and last drain: docs/design.md §4.3)."""
    r = default_rate()
    return sum(k.count * (r.launch_s + (r.gemm_model.fixed_s if k.kind == "gemm" else 0.0)) for k in kernels)


@pytest.mark.parametrize("opt, n_kernels", [("muon", 18), ("adamw", 1)])
def test_small_matrices_are_dominated_by_launch_overhead(opt, n_kernels):
    cost = AnalyticCost()
    assert len(optimizer_kernels(opt, (16, 16))) == n_kernels
    overhead = fixed_seconds(optimizer_kernels(opt, (16, 16)))
    t = cost.seconds(opt, (16, 16))
    assert overhead <= t <= 1.05 * overhead
    # A large matrix is not: its time is far above its launch overhead.
    n_big = len(optimizer_kernels(opt, (8192, 8192)))
    assert cost.seconds(opt, (8192, 8192)) > 20 * n_big * default_rate().launch_s


def test_small_soap_counts_amortised_launches():
    cost = AnalyticCost()
    ks = optimizer_kernels("soap", (8, 8))
    launches = sum(k.count for k in ks)
    assert launches == pytest.approx(2 * (4 + 2 / 10) + 1)
    # one wave of one 128x128 tile per GEMM on top of each launch and GEMM latency
    assert fixed_seconds(ks) <= cost.seconds("soap", (8, 8)) <= 1.2 * fixed_seconds(ks)


def test_kernel_seconds_is_roofline_plus_launch():
    rate = DeviceRate("toy", {"fp32": 1e12, "bf16": 1e12}, 1e11, 1e11, 1e10, 1e-6)
    for k in optimizer_kernels("soap", (256, 512)):
        r = {"gemm": 1e12, "solver": 1e10, "elementwise": 1e11}[k.kind]
        assert rate.kernel_seconds(k) == pytest.approx(
            k.count * (max(k.flops / r, k.bytes / 1e11) + 1e-6), rel=1e-12)


def test_analytic_cost_uses_given_configs():
    base = AnalyticCost()
    fewer = AnalyticCost(configs={"muon": MuonConfig(ns_steps=1)})
    assert fewer.seconds("muon", (4096, 4096)) < base.seconds("muon", (4096, 4096))
    assert base.name == "analytic:h100-sxm"


dims = st.integers(min_value=1, max_value=8192)


@settings(max_examples=150, deadline=None)
@given(opt=st.sampled_from(["muon", "soap", "shampoo", "adamw"]), m=dims, n=dims,
       dm=st.integers(0, 4096), dn=st.integers(0, 4096))
def test_seconds_monotone_in_matrix_size(opt, m, n, dm, dn):
    """Below the preconditioner limits (8192 for Shampoo, 10000 for SOAP), a larger matrix never
    costs less. (Above them a side is dropped by design, so the cost may fall.)"""
    cost = AnalyticCost()
    m2, n2 = min(m + dm, 8192), min(n + dn, 8192)
    small, large = cost.seconds(opt, (m, n)), cost.seconds(opt, (m2, n2))
    assert 0 < small <= large * (1 + 1e-12)


@settings(max_examples=80, deadline=None)
@given(m=st.integers(1, 65536), n=st.integers(1, 65536), dm=st.integers(0, 65536))
def test_muon_seconds_monotone_for_any_size(m, n, dm):
    cost = AnalyticCost()
    assert cost.seconds("muon", (m, n)) <= cost.seconds("muon", (m + dm, n)) * (1 + 1e-12)
    assert cost.seconds("muon", (m, n)) <= cost.seconds("muon", (m, n + dm)) * (1 + 1e-12)


def test_soap_cost_falls_when_a_side_crosses_the_limit():
    """Documents the non-monotone step at max_precond_dim (a side stops being preconditioned)."""
    cost = AnalyticCost()
    assert cost.seconds("soap", (10001, 4096)) < cost.seconds("soap", (10000, 4096))


# --- measured tables --------------------------------------------------------------------------


def test_table_cost_returns_table_values_and_falls_back():
    fallback = AnalyticCost()
    table = TableCost(
        table={("muon", 1024, 5120, "bf16"): 0.123, ("soap", 64, 64, "fp32"): 4.5},
        dtypes={"muon": "bf16", "soap": "fp32"},
        fallback=fallback,
        label="lab",
    )
    assert table.name == "table:lab"
    assert table.seconds("muon", (1024, 5120)) == 0.123
    assert table.seconds("soap", (64, 64)) == 4.5
    # Not listed: transposed shape, other shape, other optimizer, 1-D parameter.
    for opt, shape in (("muon", (5120, 1024)), ("muon", (64, 64)), ("shampoo", (64, 64)),
                       ("adamw", (5120,)), ("adamw", (1024, 5120))):
        assert table.seconds(opt, shape) == fallback.seconds(opt, shape)


def test_table_cost_dtype_is_part_of_the_key():
    table = TableCost(table={("muon", 8, 8, "bf16"): 1.0}, dtypes={})  # muon keyed as fp32
    assert table.seconds("muon", (8, 8)) == AnalyticCost().seconds("muon", (8, 8))
    assert TableCost(table={("muon", 8, 8, "bf16"): 1.0}, dtypes={"muon": "bf16"}).seconds(
        "muon", (8, 8)) == 1.0


def test_table_cost_drives_a_plan():
    from canzona.catalog import get_model
    from canzona.plan import make_plan

    model = get_model("qwen3-0.6b", 2)
    q = model.param("model.layers.0.self_attn.q_proj.weight").shape
    table = TableCost(table={("muon", q[0], q[1], "bf16"): 1.0}, dtypes={"muon": "bf16"})
    plan = make_plan(model, 4, 2, cost_model=table)
    assert plan.cost_model == "table:measured"
    costs = {p.name: p.cost for p in plan.dp_plan.placements()}
    assert costs["model.layers.0.self_attn.q_proj.weight"] == 1.0
    other = model.param("model.layers.0.mlp.down_proj.weight").shape
    assert costs["model.layers.0.mlp.down_proj.weight"] == AnalyticCost().seconds("muon", other)


def test_a_calibrated_gemm_curve_replaces_the_wave_model():
    """With a measured curve, a GEMM runs at peak x the curve's efficiency at its FLOPs (log-linear
    between points), never also paying wave quantisation; dtypes without a curve keep the model."""
    from canzona.cost import gemm_kernel
    from canzona.hardware import load_profile

    hw = load_profile("h100-sxm")
    rate = DeviceRate.from_profile(replace(hw, gemm_curve={"bf16": ((1e6, 0.1), (1e12, 0.7))}))
    k = gemm_kernel("g", 1000, 1000, 500, "bf16")  # 1e9 FLOPs: halfway in log between the points
    assert rate.kernel_seconds(k) == pytest.approx(k.flops / (hw.gpu.peak_flops["bf16"] * 0.4) + rate.launch_s)
    tiny = gemm_kernel("t", 1, 1, 1, "bf16")
    assert rate.curve_efficiency("bf16", tiny.flops) == 0.1  # held at the end points
    fp32 = gemm_kernel("f", 1000, 1000, 500, "fp32")
    assert rate.kernel_seconds(fp32) == DeviceRate.from_profile(hw).kernel_seconds(fp32)
