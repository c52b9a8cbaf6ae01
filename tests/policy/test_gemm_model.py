"""The GEMM model (`canzona.gemm_model`, docs/design.md §4.3): it reproduces the published GEMM
measurements it was fitted to and checked against, time never falls as a dimension grows, fp8 beats
bf16 where the tensor cores bind, and a device without fp8 refuses to price it."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from importlib import resources

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canzona.cost import DeviceRate, gemm_kernel
from canzona.errors import SpecError
from canzona.gemm_measurements import (
    loop_mean_seconds,
    measurements,
    model_tflops,
    shape_label,
    shapes,
)
from canzona.gemm_model import GemmModel
from canzona.hardware import load_profile, profile_from_dict

# Every row of a shipped profile's device, fitted or not, within these bounds: the fit leaves at
# most +19% (the longest H100 GEMMs of the sweep, 4096 x 8192 x 14336 at 651 TFLOP/s, which run
# slower than shorter ones of the same shape: the power limit, which the model does not have) and
# -11%; the memory-bound rows (a few rows of activations against a large weight, not fitted) within
# 10%. The H200 rows (checked, never fitted: the H200 profile reuses the H100 fit) are held to the
# same bounds, set before they were added.
COMPUTE_TOLERANCE = 0.20
MEMORY_TOLERANCE = 0.12

ROWS = [r for r in measurements() if r["profile"] is not None]


def rate(name: str) -> DeviceRate:
    return DeviceRate.from_profile(load_profile(name))


def seconds(r: DeviceRate, m: int, n: int, k: int, dtype: str = "bf16") -> float:
    return r._gemm_seconds(gemm_kernel("g", m, n, k, dtype))


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r['profile']}-{r['dtype']}-{r['source']}-{shape_label(r)}")
def test_model_reproduces_each_published_measurement(row):
    error = model_tflops(row) / row["tflops"] - 1
    tolerance = COMPUTE_TOLERANCE if row["regime"] == "compute" else MEMORY_TOLERANCE
    assert abs(error) <= tolerance, f"{error:+.1%} from {row['cite']}"


def test_the_fit_is_good_on_average():
    errors = [abs(model_tflops(r) / r["tflops"] - 1) for r in ROWS if r["use"] == "fit"]
    assert len(errors) >= 40 and sum(errors) / len(errors) < 0.07


def test_measurements_name_their_sources_and_shipped_profiles():
    data = json.loads((resources.files("canzona") / "data" / "gemm_measurements.json").read_text())
    assert data["rows"] and all(r["source"] in data["sources"] for r in data["rows"])
    for r in data["rows"]:
        assert r["regime"] in ("compute", "memory") and r["use"] in ("fit", "check", "context")
        assert r["tflops"] > 0 and shapes(r) and all(min(shape) >= 1 for shape in shapes(r))
        assert ("best_of" in r) != ("M" in r)  # one shape, or the shapes of a best-of figure
        if r["profile"] is not None:
            load_profile(r["profile"])
            assert r["use"] != "context"
    # every shipped device with a fitted figure has a row it was fitted to
    assert {r["profile"] for r in data["rows"] if r["use"] == "fit"} == {"h100-sxm", "a100-sxm"}


def test_h200_rows_are_checked_not_fitted():
    # published H200 GEMMs (canzona/data/gemm_measurements.json): each from a cited source whose
    # benchmark loop is known, none fitted (the H200 profile reuses the H100 fit)
    h200 = [r for r in ROWS if r["profile"] == "h200"]
    assert {r["dtype"] for r in h200} >= {"bf16", "fp8"}
    for r in h200:
        assert r["use"] == "check" and r["cite"] and r["protocol"] is not None


def test_a_best_of_row_is_the_best_of_its_shapes():
    row = next(r for r in ROWS if "best_of" in r)
    singles = [model_tflops({k: v for k, v in row.items() if k != "best_of"} | {"M": m, "N": n, "K": k})
               for m, n, k in shapes(row)]
    assert len(singles) > 1 and model_tflops(row) == max(singles)


def test_a_grouped_row_is_priced_as_the_experts_grouped_gemm():
    # an M-grouped row (source tileops1467: torch._grouped_mm over uniformly routed experts) is the
    # simulator's grouped GEMM of its groups (canzona.cost.grouped_gemm_kernel), not one expert's GEMM
    row = next(r for r in ROWS if "groups" in r)
    single = {k: v for k, v in row.items() if k != "groups"}
    assert row["groups"] > 1 and shape_label(row).startswith(f"{row['groups']}x(")
    assert model_tflops(row) != model_tflops(single)
    assert model_tflops(single | {"M": row["M"] * row["groups"]}) == pytest.approx(model_tflops(row), rel=0.02)


def test_h200_matches_h100_in_the_same_benchmark():
    # the same script and torch release on an H200 and an H100 (sources zzc45, zzc39): the same
    # GH100 compute and 700 W limit, so the model's H200 / H100 ratio (faster HBM only) stays within
    # the run-to-run spread of one GPU's sustained matmul rate, up to 5% (S. Bekman, ml-engineering
    # compute/accelerator/benchmarks/README.md: 8 H200s, "a single GPU's MSMF moved by up to 5%")
    pair = {(r["profile"], r["dtype"]): r for r in ROWS if r["source"] in ("zzc45", "zzc39")}
    for dtype in ("bf16", "fp16"):
        h200, h100 = pair[("h200", dtype)], pair[("h100-sxm", dtype)]
        measured = h200["tflops"] / h100["tflops"]
        modelled = model_tflops(h200) / model_tflops(h100)
        assert modelled >= 1.0 and abs(modelled / measured - 1) <= 0.05


def test_the_largest_gemms_approach_the_sustained_rate():
    # gemm_flops is the boost-clock rate; sustained load runs at the power-limited clock
    r = rate("h100-sxm")
    assert r.gemm_model is not None and r.gemm_model.sustained_clock < 1.0
    sustained = r.gemm_model.sustained_clock * r.gemm_flops["bf16"]
    m = n = k = 16384
    achieved = 2.0 * m * n * k / seconds(r, m, n, k)
    assert 0.9 * sustained < achieved <= sustained


def test_the_power_limit_slows_a_long_loop_not_a_short_burst():
    # the boost window: a loop whose warmup outlasts it is timed at the sustained clock only; one
    # that ends within it is timed at the boost clock (canzona.gemm_measurements.loop_mean_seconds)
    assert loop_mean_seconds(1.0, 2.0, 0.5, 1, 10) == 2.0
    assert loop_mean_seconds(1.0, 2.0, 100.0, 1, 10) == 1.0
    assert loop_mean_seconds(1.0, 2.0, 6.0, 1, 10) == 1.5
    r = rate("h100-sxm")
    assert r.gemm_model is not None
    boost = replace(r, gemm_model=replace(r.gemm_model, sustained_clock=1.0))
    assert seconds(r, 8192, 8192, 8192) > 1.05 * seconds(boost, 8192, 8192, 8192)


def test_a100_power_limit_is_the_zero_and_randn_pair():
    # one A100 at one shape (H. He, gemm_measurements.json source "horace"): all-zero inputs keep the
    # boost clock, randn inputs hold the 400 W limit; the model prices the first at boost (its
    # "clock": "boost") and the second at the sustained clock, and both within 2%
    pair = {r.get("clock", "sustained"): r for r in ROWS if r["source"] == "horace"}
    assert set(pair) == {"boost", "sustained"}
    for row in pair.values():
        assert abs(model_tflops(row) / row["tflops"] - 1) < 0.02
    assert model_tflops(pair["sustained"]) / model_tflops(pair["boost"]) == pytest.approx(257 / 295, rel=0.01)
    r = rate("a100-sxm")
    assert r.gemm_model is not None and r.gemm_model.sustained_clock < 0.9
    m = n = k = 16384  # a training step's GEMMs run at the sustained clock: well under the boost-clock rate
    assert 2.0 * m * n * k / seconds(r, m, n, k) < 0.9 * r.gemm_flops["bf16"]


def test_short_k_loses_efficiency():
    # a tile's traffic outside the main loop does not shrink with K: a short-K GEMM does less work
    # for it
    r = rate("h100-sxm")

    def efficiency(k: int) -> float:
        return 2.0 * 8192 * 8192 * k / seconds(r, 8192, 8192, k) / r.gemm_flops["bf16"]

    assert efficiency(256) < efficiency(1024) < efficiency(8192)
    assert efficiency(256) < 0.7


dims = st.integers(min_value=1, max_value=20000)


@settings(max_examples=150, deadline=None)
@given(m=dims, n=dims, k=dims, grow=st.integers(min_value=1, max_value=4096), axis=st.sampled_from("mnk"),
       dtype=st.sampled_from(["bf16", "fp8", "fp32"]))
def test_time_never_falls_as_a_dimension_grows(m, n, k, grow, axis, dtype):
    r = rate("h100-sxm")
    bigger = {"m": m, "n": n, "k": k}
    bigger[axis] += grow
    assert seconds(r, bigger["m"], bigger["n"], bigger["k"], dtype) >= seconds(r, m, n, k, dtype)


@pytest.mark.parametrize("name", ["h100-sxm", "h200"])
@pytest.mark.parametrize("shape", [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 28672, 4096), (16384, 4096, 14336)])
def test_fp8_is_faster_than_bf16_on_big_shapes(name, shape):
    r = rate(name)
    speedup = seconds(r, *shape, "bf16") / seconds(r, *shape, "fp8")
    assert 1.5 < speedup < 2.0  # twice the peak, a lower sustained fraction (Bekman: 70.9% against 80.3%)


@settings(max_examples=60, deadline=None)
@given(m=dims, n=dims, k=dims)
def test_h200_is_never_slower_than_h100(m, n, k):
    # the same compute; faster HBM for the roofline and for every tile's traffic outside the main loop
    assert seconds(rate("h200"), m, n, k) <= seconds(rate("h100-sxm"), m, n, k)


def test_fp8_on_a100_is_a_spec_error():
    r = rate("a100-sxm")
    with pytest.raises(SpecError, match="fp8"):
        r.kernel_seconds(gemm_kernel("g", 4096, 4096, 4096, "fp8"))


def test_an_fp8_gemm_writes_a_bf16_output():
    k = gemm_kernel("g", 10, 20, 30, "fp8")
    assert k.bytes == 10 * 30 + 30 * 20 + 2 * 10 * 20


def _raw(name: str) -> dict:
    return json.loads((resources.files("canzona") / "profiles" / f"{name}.json").read_text())


def test_a_profile_without_gemm_model_keeps_square_tiles_and_no_fixed_cost():
    data = copy.deepcopy(_raw("h100-sxm"))
    del data["gemm_model"]
    p = profile_from_dict(data)
    assert p.gemm_model is None
    model = p.gemm_kernels()
    assert model == GemmModel(tiles=((128, 128),), splits=(1, 2, 4, 8, 16), l2_bytes_per_s=0.0,
                              tile_fixed_bytes=0.0, fixed_s=0.0)
    # one 128 x 128 tile a wave: 4096^3 is 1024 tiles, 8 waves of 132 SMs
    per_sm = p.gpu.gemm_flops()["bf16"] / 132
    expected = max(8 * 2.0 * 128 * 128 * 4096 / per_sm, (2 * 3 * 4096 * 4096) / p.gpu.hbm_bytes_per_s)
    assert DeviceRate.from_profile(p)._gemm_seconds(gemm_kernel("g", 4096, 4096, 4096, "bf16")) == \
        pytest.approx(expected, rel=1e-12)


def test_the_best_tile_is_chosen():
    # one candidate of the list alone is never faster than the whole list
    p = load_profile("h100-sxm")
    full = p.gemm_kernels()
    for tile in full.tiles:
        alone = replace(full, tiles=(tile,))
        for m, n, k in [(4096, 6144, 4096), (1024, 9216, 14336), (64, 12288, 5376), (300, 500, 700)]:
            args = (p.gpu.gemm_flops()["bf16"], p.gpu.sms, 2.0 * (m * k + k * n + m * n), p.gpu.hbm_bytes_per_s, 2)
            assert full.seconds(m, n, k, *args) <= alone.seconds(m, n, k, *args)


@pytest.mark.parametrize("bad", [
    {"tiles": []},
    {"tiles": [[128]]},
    {"tiles": [[128, 0]]},
    {"tiles": [[128, 2048]]},
    {"tiles": [[128, 128.5]]},
    {"tiles": [[128, True]]},
    {"tiles": [[128, 128]], "tile_fixed_bytes": -1},
    {"tiles": [[128, 128]], "splits": []},
    {"tiles": [[128, 128]], "splits": [0]},
    {"tiles": [[128, 128]], "splits": [1.5]},
    {"tiles": [[128, 128]], "l2_bytes_per_s": -1},
    {"tiles": [[128, 128]], "fixed_s": 1.0},
    {"tiles": [[128, 128]], "fixed_s": None},
    {"tiles": [[128, 128]], "tile_fixed_bytes": 1e6},
    {"tiles": [[128, 128]], "tile_fixed_bytes": "8 B"},
    {"tiles": [[128, 128]], "other": 1},
    {"tiles": [[128, 128]], "sustained_clock": 0.1},
    {"tiles": [[128, 128]], "sustained_clock": 1.5},
    {"tiles": [[128, 128]], "boost_window_s": -1},
    {"tiles": [[128, 128]], "boost_window_s": 100},
    {"tile_fixed_bytes": 8},
    [[128, 128]],
])
def test_malformed_gemm_model_is_a_spec_error(bad):
    data = copy.deepcopy(_raw("h100-sxm"))
    data["gemm_model"] = bad
    with pytest.raises(SpecError, match="gemm_model"):
        profile_from_dict(data)


# --- accumulating GEMMs (a weight gradient added into main_grad) -------------------------------


@pytest.mark.parametrize("acc, extra", [(4, 6), (2, 2)])
def test_an_accumulating_gemm_moves_its_output_twice_at_the_accumulator_dtype(acc, extra):
    """`C += A B` reads and writes C: fp32 8 bytes an output element (6 more than a bf16 write),
    bf16 4 (2 more); the epilogue's extra bytes cost their HBM time once a tile, all else equal."""
    plain = gemm_kernel("w", 4096, 14336, 4096, "bf16")
    fused = gemm_kernel("w", 4096, 14336, 4096, "bf16", accumulate=acc)
    assert fused.bytes - plain.bytes == extra * 4096 * 14336 and fused.flops == plain.flops
    r = rate("h100-sxm")
    # at least the output's extra bytes at the HBM bandwidth, at most its padded tiles' (the library
    # may pick another tile once the epilogue costs more)
    gained = r._gemm_seconds(fused) - r._gemm_seconds(plain)
    assert extra * 4096 * 14336 / r.hbm_bytes_per_s * (1 - 1e-9) <= gained
    assert gained <= extra * (4096 + 256) * (14336 + 256) / r.hbm_bytes_per_s
    # the cache tells them apart (same FLOPs, shape and dtype)
    assert r.kernel_seconds(fused) > r.kernel_seconds(plain)


def test_an_fp8_weight_gradient_accumulates_like_a_bf16_one():
    """An fp8 GEMM writes bf16 (2 bytes): adding into fp32 main_grad costs the same 6 bytes more."""
    plain = gemm_kernel("w", 8192, 8192, 4096, "fp8")
    fused = gemm_kernel("w", 8192, 8192, 4096, "fp8", accumulate=4)
    assert fused.bytes - plain.bytes == 6 * 8192 * 8192


def test_grouped_and_batched_gemms_keep_the_accumulation():
    from canzona.cost import grouped_gemm_kernel

    one = gemm_kernel("w", 768, 2048, 4096, "bf16", accumulate=4)
    grouped = grouped_gemm_kernel("w", 768, 2048, 4096, 8, "bf16", accumulate=4)
    assert grouped.accumulate == 4 and grouped.bytes == 8 * one.bytes
    r = rate("h100-sxm")
    assert r.batched_seconds([one], 8) == r.kernel_seconds(grouped)


def test_the_epilogue_bytes_grow_the_time_by_their_hbm_time_on_every_tile():
    model = GemmModel(tiles=((128, 128),), splits=(1,), tile_fixed_bytes=2.0)
    base = model.seconds(1000, 1000, 4096, 500e12, 100, 0.0, 1e12, 2)
    more = model.seconds(1000, 1000, 4096, 500e12, 100, 0.0, 1e12, 2, epilogue_bytes=6.0)
    tiles = 8 * 8  # 1000 / 128 rounded up, each way: the padded tiles move their bytes too
    assert more - base == pytest.approx(tiles * 128 * 128 * 6.0 / 1e12, rel=1e-9)


# --- a measured loop converted to the sustained clock ------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.floats(1e-5, 0.1), st.floats(0.5, 0.99), st.floats(0.0, 0.05), st.integers(0, 5), st.integers(1, 100))
def test_sustained_seconds_inverts_the_loop(boost_s, clock, window, warmup, iters):
    """The loop that `sustained_seconds` infers, run again, measures what was measured."""
    from canzona.gemm_model import sustained_seconds

    measured = loop_mean_seconds(boost_s, boost_s / clock, window, warmup, iters)
    got = sustained_seconds(measured, clock, window, warmup, iters)
    assert got == pytest.approx(boost_s / clock, rel=1e-6)


def test_a_loop_within_the_boost_window_ran_at_boost():
    from canzona.gemm_model import sustained_seconds

    assert sustained_seconds(1e-3, 0.91, 1.0, 2, 30) == pytest.approx(1e-3 / 0.91, rel=1e-9)  # all at boost
    assert sustained_seconds(1e-3, 0.91, 0.0, 2, 30) == pytest.approx(1e-3, rel=1e-9)  # all sustained
    assert sustained_seconds(1e-3, 1.0, 1.0, 2, 30) == 1e-3  # no power limit
