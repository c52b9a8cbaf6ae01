"""Measured eigh / QR tables in hardware profiles replace the solver FLOP rate."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from canzona.cost import default_rate, optimizer_kernels
from canzona.errors import SpecError
from canzona.hardware import load_profile, profile_from_dict

TABLE = {"eigh": ((1024, 0.02), (4096, 0.5)), "qr": ((2048, 0.004),)}


def _solver(opt: str, shape: tuple[int, int], op: str, size: int):
    return next(k for k in optimizer_kernels(opt, shape) if k.solver == op and k.gemm == (size,))


def test_table_points_are_returned_exactly_and_interpolated_log_log():
    rate = replace(default_rate(), solver_seconds=TABLE)
    assert rate.solver_time(_solver("shampoo", (1024, 4096), "eigh", 1024)) == 0.02
    assert rate.solver_time(_solver("shampoo", (1024, 4096), "eigh", 4096)) == 0.5
    mid = rate.solver_time(_solver("shampoo", (2048, 4096), "eigh", 2048))
    assert mid == pytest.approx((0.02 * 0.5) ** 0.5)  # halfway in log k between 1024 and 4096


def test_outside_the_table_time_scales_as_k_cubed():
    rate = replace(default_rate(), solver_seconds=TABLE)
    assert rate.solver_time(_solver("soap", (4096, 8192), "qr", 4096)) == pytest.approx(0.004 * 8)
    assert rate.solver_time(_solver("soap", (1024, 512), "qr", 1024)) == pytest.approx(0.004 / 8)


def test_table_replaces_the_rate_and_keeps_amortisation():
    k = _solver("shampoo", (1024, 4096), "eigh", 1024)
    rate = replace(default_rate(), solver_seconds=TABLE)
    assert rate.kernel_seconds(k) == pytest.approx(k.count * (0.02 + default_rate().launch_s))
    assert default_rate().kernel_seconds(k) != rate.kernel_seconds(k)  # datasheet profile: no table


def test_profiles_carry_tables_and_reject_malformed_ones():
    data = json.loads(json.dumps({**_raw("h100-sxm"), "solver_seconds": {"eigh": [[1024, 0.02]]}}))
    assert profile_from_dict(data).solver_seconds == {"eigh": ((1024, 0.02),)}
    assert load_profile("h100-sxm").solver_seconds == {}
    for bad in ({"svd": [[1, 1.0]]}, {"eigh": []}, {"eigh": [[1024]]}, {"eigh": [[1024, -1.0]]}, []):
        with pytest.raises(SpecError) as err:
            profile_from_dict({**_raw("h100-sxm"), "solver_seconds": bad})
        assert "\n" not in str(err.value)


def _raw(name: str) -> dict:
    from importlib import resources

    return json.loads((resources.files("canzona") / "profiles" / f"{name}.json").read_text())


def test_measured_kernel_tables_load_and_fall_back(tmp_path):
    from canzona.cost import AnalyticCost, load_cost_table

    path = tmp_path / "table.json"
    path.write_text(json.dumps({"device": "test", "rows": [["muon", 64, 32, "bf16", 0.5]]}))
    table = load_cost_table(str(path))
    assert table.seconds("muon", (64, 32)) == 0.5
    assert table.seconds("muon", (32, 64)) == AnalyticCost().seconds("muon", (32, 64))
    for bad in ("not json", json.dumps({"rows": [["muon", 64]]}), json.dumps({"rows": [["muon", 1, 1, "bf16", 0]]})):
        path.write_text(bad)
        with pytest.raises(SpecError):
            load_cost_table(str(path))
