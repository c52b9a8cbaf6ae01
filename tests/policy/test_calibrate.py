"""`canzona calibrate`: measured hardware profiles (docs/design.md §4.5).

The measurements run on tiny sizes; no test asserts an absolute time, only that every measured
figure is there, positive and consistent, that the profile loads and drives the cost model and the
simulator, and that the fits recover known lines from synthetic data."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace

import pytest

from canzona.calibration import (
    Measurements,
    assemble_profile,
    collective_figures,
    default_name,
    dumps_profile,
    fit_alpha_beta,
    fit_collectives,
    fit_latency,
    gemm_curve,
    monotone_envelope,
    write_profile,
)
from canzona.cost import AnalyticCost, TableCost, cost_model_for
from canzona.errors import CanzonaError, SpecError
from canzona.hardware import (
    COLLECTIVE_OPS,
    bus_factor,
    latency_steps,
    load_profile,
    load_profile_data,
    profile_from_dict,
)
from canzona.optimizers import MATRIX_OPTIMIZERS, default_config
from tests.cli_helpers import error_line, invoke

SHAPES = ((32, 64), (64, 64))


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """One quick CPU calibration on tiny sizes, shared by the tests below: (profile JSON, path)."""
    from canzona.harness.calibrate import calibrate, prepare

    settings = prepare("cpu", shapes="32x64,64x64", quick=True, name="test-cpu", threads=1)
    settings = replace(settings, gemm_sizes=(32, 64), solver_sizes=(16, 32), copy_bytes=4 * 2**20)
    seen = []
    profile = calibrate(settings, progress=lambda done, total, what: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1]  # the progress ends at its total
    path = tmp_path_factory.mktemp("calibrate") / "cpu.json"
    write_profile(profile, path)
    return profile, path


def test_quick_cpu_calibration_writes_a_profile_that_loads(measured):
    raw, path = measured
    p = load_profile(path)
    assert p.measured and p.name == "test-cpu"
    for dtype in ("bf16", "fp32"):
        assert p.gpu.peak_flops[dtype] > 0 and p.gpu.gemm_efficiency[dtype] == 1.0
        curve = p.gemm_curve[dtype]
        flops = [f for f, _ in curve]
        assert flops == sorted(flops) and len(curve) >= 2
        assert all(0 < e <= 1 for _, e in curve) and max(e for _, e in curve) == 1.0
        assert raw["gemm_curve"][dtype] == [list(pt) for pt in curve]  # written sorted
    assert {pt[0] for pt in raw["gemm_points"]} == {"bf16", "fp32"}
    assert all(s > 0 for *_, s in raw["gemm_points"])
    assert p.gpu.launch_s > 0 and p.gpu.hbm_bytes_per_s > 0 and p.gpu.memory_bytes > 0
    assert p.gpu.sms == os.cpu_count()
    assert set(p.solver_seconds) == {"eigh", "qr"}
    assert [k for k, _ in p.solver_seconds["eigh"]] == [16, 32]
    assert all(s > 0 for rows in p.solver_seconds.values() for _, s in rows)
    rows = {(o, m, n, d) for o, m, n, d, _ in p.optimizer_seconds}
    # every registered optimizer; those with a Newton-Schulz dtype in bf16 (their default) and fp32
    want = {(o, m, n, d) for m, n in SHAPES for o in MATRIX_OPTIMIZERS
            for d in (("bf16", "fp32") if hasattr(default_config(o), "ns_dtype") else ("fp32",))}
    assert rows == want and all(s > 0 for *_, s in p.optimizer_seconds)
    assert p.collectives.rows == ()  # no --world-size
    cal = raw["calibration"]
    assert cal["device_type"] == "cpu" and cal["world_size"] == 1 and cal["backend"] is None
    assert cal["torch"] and cal["python"] and cal["canzona"] and cal["date"].endswith("+00:00")
    assert cal["threads"] == 1


def test_a_dtype_whose_gemm_is_slow_stops_growing_and_the_progress_still_ends(monkeypatch):
    """bf16 on a CPU without native bf16 takes 100x fp32's time: once one of a dtype's GEMMs takes
    longer than the cap, its larger shapes are skipped (the smaller ones still make its curve)."""
    from canzona.harness import calibrate as measuring

    monkeypatch.setattr(measuring, "time_gemm", lambda m, n, k, dtype, device, repeats:
                        (1.0 if dtype == "bf16" and m * n * k > 64**3 else 1e-4) * m * n * k / 64**3)
    settings = replace(measuring.prepare("cpu", shapes="32x64", quick=True, threads=1),
                       gemm_sizes=(32, 64, 128), solver_sizes=(16,), copy_bytes=2**20)
    seen = []
    profile = measuring.calibrate(settings, progress=lambda done, total, what: seen.append((done, total, what)))
    sizes = {dt: sorted(m * n * k for d, m, n, k, _ in profile["gemm_points"] if d == dt) for dt in ("bf16", "fp32")}
    assert len(sizes["fp32"]) == 9  # three shapes per size, none over the cap
    # bf16: every shape up to the first one over the cap (64x64x256: 1 s), and nothing larger
    assert sizes["bf16"][-1] == 64 * 64 * 256 and len(sizes["bf16"]) < len(sizes["fp32"])
    assert any("skipped" in what for *_, what in seen) and seen[-1][0] == seen[-1][1]
    assert len(profile["gemm_curve"]["bf16"]) >= 2


def test_sources_say_how_each_figure_was_measured_and_which_were_copied(measured):
    raw, _ = measured
    sources = raw["sources"]
    for figure in ("gpu.peak_flops.bf16", "gpu.launch_s", "gpu.hbm_bytes_per_s", "gpu.memory_bytes",
                   "gpu.sms", "solver_seconds", "optimizer_seconds"):
        assert any(s.startswith(figure) for s in sources), figure
    copied = next(s for s in sources if s.startswith("copied from base profile 'h100-sxm'"))
    for figure in ("gpu.gemm_tile", "gpu.elementwise_flops", "node.gpus", "network.nic_busbw",
                   "nccl.base_latency_s", "gpu.peak_flops.fp64"):
        assert figure in copied
    assert "gpu.launch_s" not in copied and "gpu.peak_flops.bf16" not in copied
    assert any(s.startswith("[base h100-sxm] ") for s in sources)
    # without collectives the network figures are the base profile's
    base = load_profile("h100-sxm")
    p = profile_from_dict(raw)
    assert p.node == base.node and p.network == base.network and p.nccl == base.nccl


def test_profile_drives_the_simulator_and_the_planner(measured):
    from sim.simulate import SimConfig, simulate
    from sim.workload import Workload

    _, path = measured
    result = simulate(SimConfig(model="qwen3-0.6b", gpus=8, tp=1, hardware=str(path),
                                workload=Workload(seq_len=512, global_batch=8)))
    assert result.iteration_time_s > result.optimizer_step_s > 0
    assert result.plan.cost_model == "table:test-cpu"


def test_cost_model_uses_the_measured_optimizer_seconds(measured, tmp_path):
    raw, path = measured
    costs = cost_model_for(path)
    assert isinstance(costs, TableCost) and costs.name == "table:test-cpu"
    seconds = {(o, m, n, d): s for o, m, n, d, s in raw["optimizer_seconds"]}
    assert costs.seconds("muon", (32, 64)) == seconds[("muon", 32, 64, "bf16")]  # Muon's default dtype
    assert costs.seconds("soap", (64, 64)) == seconds[("soap", 64, 64, "fp32")]
    analytic = AnalyticCost(costs.fallback.rate)
    assert costs.seconds("shampoo", (128, 64)) == analytic.seconds("shampoo", (128, 64))  # not measured
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"rows": [["muon", 32, 64, "bf16", 0.5]]}))
    assert cost_model_for(path, table).seconds("muon", (32, 64)) == 0.5  # an explicit table wins
    assert isinstance(cost_model_for("h100-sxm"), AnalyticCost)  # datasheet profiles: unchanged


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_world_size_2_measures_collectives_and_fits_them(tmp_path):
    out = tmp_path / "gloo.json"
    result = invoke("calibrate", "--quick", "--shapes", "32x64", "--threads", "1", "--world-size", 2,
                    "--out", out, "--json")
    assert result.exit_code == 0, (result.stderr, result.exception)
    raw = json.loads(result.stdout)
    assert json.loads(out.read_text()) == raw
    p = load_profile(out)
    coll = p.collectives
    assert coll.backend == "gloo"
    assert {(op, n) for op, n, _, _ in coll.rows} == {(op, 2) for op in COLLECTIVE_OPS}
    assert len(coll.rows) == 4 * 4  # --quick: four message sizes
    assert all(b > 0 and t > 0 for _, _, b, t in coll.rows)
    # On a loaded machine an op's times can come out flat (its small messages as slow as its large
    # ones): that op is then named as not fitted and its figure copied from the base profile; every
    # op is either fitted to a plausible bandwidth or named.
    fits = {op: (alpha, busbw) for op, n, alpha, busbw in coll.fits if n == 2}
    collectives_source = next(s for s in raw["sources"] if s.startswith("collectives:"))
    for op in COLLECTIVE_OPS:
        assert op in fits or f"{op} on 2 ranks" in collectives_source.partition("not fitted:")[2]
    assert fits and all(0 < bw < 1e15 for _, bw in fits.values())
    if "all-reduce" in fits:
        assert p.node.nvls_allreduce_busbw == pytest.approx(fits["all-reduce"][1])
    if "all-to-all" in fits:
        assert p.network.nic_busbw == pytest.approx(fits["all-to-all"][1])
    assert p.nccl.base_latency_s > 0
    assert raw["calibration"]["world_size"] == 2 and raw["calibration"]["backend"] == "gloo"
    assert raw["calibration"]["launcher"] == "spawned"
    assert any(s.startswith("collectives:") for s in raw["sources"])
    assert any(s.startswith("node.nvlink_ring_busbw") for s in raw["sources"])


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_under_torchrun_the_launched_group_is_measured_and_rank_0_writes(tmp_path):
    """torchrun on CPU (gloo): the same command as on a GPU node, where the group is NCCL's."""
    import subprocess
    from pathlib import Path

    from tests.launchers import torchrun_command

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "launched.json"
    done = subprocess.run(
        torchrun_command(2, "-m", "cli.main", "calibrate", "--device", "cpu", "--quick", "--shapes", "32x64",
                         "--threads", "1", "--out", out, "--json"),
        cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    raw = json.loads(done.stdout)  # rank 0 alone prints the profile
    assert raw == json.loads(out.read_text())
    assert raw["calibration"]["world_size"] == 2 and raw["collectives"]["backend"] == "gloo"
    assert {row[1] for row in raw["collectives"]["rows"]} == {2}
    assert raw["calibration"]["launcher"] == "torchrun"


def test_default_names_use_the_device_and_host():
    m = Measurements(device="cpu", device_name="x", hostname="My_Host.lab", repeats=1, warmup=2)
    assert default_name(m) == "cpu-my-host.lab"
    gpu = replace(m, device="cuda", device_name="NVIDIA H100 80GB HBM3")
    assert default_name(gpu) == "nvidia-h100-80gb-hbm3-my-host.lab"


# --- the fits, on synthetic data -----------------------------------------------------------------


def _synthetic_rows(alpha_of, busbw_of, groups=(2, 4, 8), sizes=(4096, 65536, 2**20, 16 * 2**20)):
    return [(op, n, s, alpha_of(op, n) + s * bus_factor(op, n) / busbw_of(op, n))
            for op in COLLECTIVE_OPS for n in groups for s in sizes]


def test_fit_recovers_alpha_and_bandwidth_from_alpha_beta_data():
    alpha, beta = fit_alpha_beta([1e3, 1e4, 1e6], [20e-6 + 1e3 / 5e9, 20e-6 + 1e4 / 5e9, 20e-6 + 1e6 / 5e9])
    assert alpha == pytest.approx(20e-6, rel=1e-9) and 1 / beta == pytest.approx(5e9, rel=1e-9)
    base, step = 9e-6, 4e-6
    rows = _synthetic_rows(lambda op, n: base + latency_steps(op, n) * step,
                           lambda op, n: 40e9 if op == "all-reduce" else 25e9)
    fits, skipped = fit_collectives(rows)
    assert not skipped and len(fits) == len(COLLECTIVE_OPS) * 3
    for f in fits:
        assert f.alpha_s == pytest.approx(base + latency_steps(f.op, f.group_size) * step, rel=1e-6)
        assert f.busbw == pytest.approx(40e9 if f.op == "all-reduce" else 25e9, rel=1e-6)
    assert fit_latency(fits) == pytest.approx((base, step), rel=1e-6)
    figures = collective_figures(fits, local_size=8, single_machine=True)
    assert figures["node.nvls_allreduce_busbw"][0] == pytest.approx(40e9, rel=1e-6)
    assert figures["node.nvlink_ring_busbw"][0] == pytest.approx(25e9, rel=1e-6)
    assert figures["network.nic_busbw"][0] == pytest.approx(25e9, rel=1e-6)
    assert figures["nccl.base_latency_s"][0] == pytest.approx(base, rel=1e-6)
    assert figures["nccl.network_step_latency_s"][0] == pytest.approx(step, rel=1e-6)


def test_groups_across_machines_set_the_network_figures():
    base, step, net_step = 8e-6, 3e-6, 15e-6
    rows = _synthetic_rows(lambda op, n: base + latency_steps(op, n) * (step if n <= 4 else net_step),
                           lambda op, n: 300e9 if n <= 4 else 45e9)
    figures = collective_figures(fit_collectives(rows)[0], local_size=4, single_machine=False)
    assert figures["node.nvlink_ring_busbw"][0] == pytest.approx(300e9, rel=1e-6)
    assert figures["network.nic_busbw"][0] == pytest.approx(45e9, rel=1e-6)
    assert figures["nccl.nvlink_step_latency_s"][0] == pytest.approx(step, rel=1e-6)
    assert figures["nccl.network_step_latency_s"][0] == pytest.approx(net_step, rel=1e-6)
    # one machine only: no network figure is invented
    intra = [r for r in rows if r[1] <= 4]
    assert not any("network" in k for k in collective_figures(fit_collectives(intra)[0], 4, single_machine=False))


def test_fit_keeps_alpha_non_negative_and_refuses_what_it_cannot_fit():
    alpha, beta = fit_alpha_beta([1e3, 1e6], [1e3 / 1e9 - 1e-7, 1e6 / 1e9])  # the line would cross below 0
    assert alpha == 0.0 and beta > 0
    with pytest.raises(CanzonaError):
        fit_alpha_beta([1e3, 1e3], [1e-5, 2e-5])  # one size
    with pytest.raises(CanzonaError):
        fit_alpha_beta([1e3, 1e6], [2e-3, 1e-3])  # slower for less data
    fits, skipped = fit_collectives([("all-reduce", 2, 1000, 1e-5), ("all-reduce", 2, 1000, 2e-5)])
    assert fits == [] and "all-reduce on 2 ranks" in skipped[0]


def test_a_slow_outlier_at_a_small_size_does_not_spoil_the_fit():
    rows = [("all-gather", 2, s, 50e-6 + s * 0.5 / 1e9) for s in (4096, 65536, 2**20, 4 * 2**20)]
    rows[1] = ("all-gather", 2, 65536, 5e-3)  # a descheduled repeat: slower than 1 MiB
    assert monotone_envelope([(r[2], r[3]) for r in rows])[1] == (65536, rows[2][3])
    (fit,), skipped = fit_collectives(rows)
    assert not skipped and fit.busbw == pytest.approx(1e9, rel=0.05) and fit.alpha_s > 0


def test_near_flat_times_are_not_read_as_a_huge_bandwidth(tmp_path):
    """CI once saw `node.nvls_allreduce_busbw` 1.2e25: noisy small-message times, pressed down by the
    envelope, left the all-reduce times flat to rounding and beta at 1e-25 s/byte."""
    flat = [("all-reduce", 2, s, 3e-3 + s * 1e-25) for s in (4096, 65536, 2**20, 4 * 2**20)]
    with pytest.raises(CanzonaError, match="no bandwidth"):
        fit_alpha_beta([r[2] for r in flat], [r[3] for r in flat])
    good = [r for r in _synthetic_rows(lambda op, n: 50e-6, lambda op, n: 2e9, groups=(2,)) if r[0] != "all-reduce"]
    fits, skipped = fit_collectives(flat + good)
    assert [f.op for f in fits] == [op for op in COLLECTIVE_OPS if op != "all-reduce"]
    assert len(skipped) == 1 and skipped[0].startswith("all-reduce on 2 ranks")
    raw = _assembled(collective_rows=flat + good, backend="gloo", world_size=2, local_size=2)
    path = tmp_path / "p.json"
    write_profile(raw, path)  # validates: every figure in range
    base, _ = load_profile_data("h100-sxm")
    assert load_profile(path).node.nvls_allreduce_busbw == base["node"]["nvls_allreduce_busbw"]
    assert any("not fitted: all-reduce on 2 ranks" in s for s in raw["sources"])
    assert any(s.startswith("copied from base profile") and "node.nvls_allreduce_busbw" in s for s in raw["sources"])


def test_gemm_curve_is_sorted_and_relative_to_the_best_rate():
    points = [("fp32", 64, 64, 64, 1e-4), ("fp32", 32, 32, 32, 1e-4), ("fp32", 128, 128, 128, 2e-4),
              ("bf16", 64, 64, 64, 1e-5)]
    peak, curve = gemm_curve(points, "fp32")
    assert peak == pytest.approx(2 * 128**3 / 2e-4)
    assert [f for f, _ in curve] == sorted(f for f, _ in curve)
    assert curve[-1][1] == 1.0 and all(0 < e <= 1 for _, e in curve)
    with pytest.raises(CanzonaError):
        gemm_curve(points, "fp16")


def test_gemm_efficiency_is_interpolated_log_linearly_in_flops():
    raw, where = load_profile_data("h100-sxm")
    p = profile_from_dict({**raw, "gemm_curve": {"bf16": [[1e9, 1.0], [1e6, 0.2]]}}, where)
    assert p.gemm_curve["bf16"] == ((1e6, 0.2), (1e9, 1.0))  # sorted on load
    assert p.gemm_efficiency_at("bf16", math.sqrt(1e6 * 1e9)) == pytest.approx(0.6)
    assert p.gemm_efficiency_at("bf16", 1e3) == 0.2 and p.gemm_efficiency_at("bf16", 1e12) == 1.0
    assert p.gemm_efficiency_at("fp32", 1e9) is None


def _assembled(**changes) -> dict:
    m = Measurements(device="cpu", device_name="test CPU", hostname="box", repeats=3, warmup=2,
                     gemm_points=[("bf16", 64, 64, 64, 1e-4), ("fp32", 64, 64, 64, 2e-4)],
                     launch_s=3e-6, copy_bytes=2**20, copy_s=1e-4, memory_bytes=2**34, sms=8,
                     date="2026-01-01T00:00:00+00:00")
    for k, v in changes.items():
        setattr(m, k, v)
    base, _ = load_profile_data("h100-sxm")
    return assemble_profile(m, base, "h100-sxm")


def test_assembled_profile_writes_rows_on_one_line_and_loads(tmp_path):
    rows = _synthetic_rows(lambda op, n: 50e-6, lambda op, n: 2e9, groups=(2,))
    raw = _assembled(collective_rows=rows, backend="gloo", world_size=2, local_size=2)
    text = dumps_profile(raw)
    assert '["all-reduce", 2, 4096, ' in text
    path = tmp_path / "p.json"
    write_profile(raw, path)
    p = load_profile(path)
    assert p.name == "cpu-box" and p.gpu.hbm_bytes_per_s == pytest.approx(2 * 2**20 / 1e-4)
    assert p.network.nic_busbw == pytest.approx(2e9, rel=1e-6)
    assert p.nccl.base_latency_s == pytest.approx(50e-6, rel=1e-6)
    assert p.nccl.nvlink_step_latency_s >= 1e-9  # a zero step is floored to the profile minimum


# --- malformed sections ---------------------------------------------------------------------------


@pytest.mark.parametrize("key, bad", [
    ("gemm_curve", []),
    ("gemm_curve", {"bf17": [[1e9, 1.0]]}),
    ("gemm_curve", {"bf16": []}),
    ("gemm_curve", {"bf16": [[1e9, 1.5]]}),
    ("gemm_curve", {"bf16": [[1e9, 0]]}),
    ("gemm_curve", {"bf16": [[1e9]]}),
    ("optimizer_seconds", {}),
    ("optimizer_seconds", [["muon", 64, 64, "bf16"]]),
    ("optimizer_seconds", [["muon", 64.5, 64, "bf16", 1.0]]),
    ("optimizer_seconds", [["muon", 64, 64, "bf17", 1.0]]),
    ("optimizer_seconds", [["muon", 64, 64, "bf16", -1.0]]),
    ("optimizer_seconds", [["", 64, 64, "bf16", 1.0]]),
    ("collectives", []),
    ("collectives", {"rows": [["all-reduce", 2, 4096, 1e-4]]}),
    ("collectives", {"backend": "gloo", "rows": []}),
    ("collectives", {"backend": "gloo", "rows": [["broadcast", 2, 4096, 1e-4]]}),
    ("collectives", {"backend": "gloo", "rows": [["all-reduce", 1, 4096, 1e-4]]}),
    ("collectives", {"backend": "gloo", "rows": [["all-reduce", 2, 4096, 0]]}),
    ("collectives", {"backend": "gloo", "rows": [["all-reduce", 2, 4096, 1e-4]], "fits": [["all-reduce", 2]]}),
    ("collectives", {"backend": "gloo", "rows": [["all-reduce", 2, 4096, 1e-4]], "extra": 1}),
])
def test_malformed_new_sections_are_rejected_in_one_line(key, bad):
    raw, where = load_profile_data("h100-sxm")
    with pytest.raises(SpecError) as err:
        profile_from_dict({**raw, key: bad}, where)
    assert "\n" not in str(err.value) and key in str(err.value)


# --- bad CLI input --------------------------------------------------------------------------------


@pytest.mark.parametrize("args, needle", [
    (["--device", "tpu"], "unknown device"),
    (["--world-size", 1], "--world-size"),
    (["--world-size", 100000], "--world-size"),
    (["--out", "profile.txt"], "extension"),
    (["--out", "/no/such/folder/profile.json"], "does not exist"),
    (["--model", "qwen9"], "unknown model"),
    (["--shapes", "64by64"], "--shapes"),
    (["--shapes", "0x64"], "--shapes"),
    (["--repeats", 0], "--repeats"),
    (["--base", "no-such-profile"], "unknown hardware"),
    # an empty name was taken as the default and calibrated for a minute
    (["--base", ""], "unknown hardware ''"),
    (["--model", ""], "unknown model ''"),
    (["--name", "a b"], "--name"),
    (["--threads", 0], "--threads"),
])
def test_bad_cli_input_is_one_error_line_and_exit_2(args, needle):
    error_line(invoke("calibrate", *args), needle)


def test_cuda_on_a_machine_without_it_is_refused():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    error_line(invoke("calibrate", "--device", "cuda"), "CUDA is not available")


def test_world_size_on_cuda_asks_for_torchrun(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    error_line(invoke("calibrate", "--device", "cuda", "--world-size", 2), "torchrun")


def test_a_failed_measurement_is_one_error_line_and_exit_1(monkeypatch):
    from canzona.harness import calibrate as measuring

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore details")

    monkeypatch.setattr(measuring, "measure", out_of_memory)
    error_line(invoke("calibrate", "--quick", "--shapes", "8x8"), "measurement failed: CUDA out of memory", code=1)


@pytest.mark.parametrize("model", ["qwen3-8b", "qwen3-0.6b", "qwen9"])
def test_model_with_shapes_is_one_error_line_before_measuring(monkeypatch, model):
    """`--shapes` times its shapes instead of `--model`'s: `calibrate --model qwen3-8b --shapes 64x64`
    measured 64x64 and dropped the model without a word (an unknown one too), so the profile's
    optimizer seconds were not the model's the user asked for. Both given is one error line, before
    anything is measured; the catalog default named explicitly as well."""
    from canzona.harness import calibrate as measuring

    def refuse(*args, **kwargs):
        raise AssertionError("bad input must be rejected before measuring")

    monkeypatch.setattr(measuring, "calibrate", refuse)
    error_line(invoke("calibrate", "--model", model, "--shapes", "64x64"), "--model", "--shapes")
