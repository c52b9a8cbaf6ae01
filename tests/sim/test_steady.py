"""Many micro-batches (sim.steady): the iteration extrapolated from two shorter ones is the exact
simulation's within a small bound, its memory the same; at most EXACT_MICRO_BATCHES nothing
changes; the result says it was extrapolated and refuses a trace."""

from __future__ import annotations

from dataclasses import replace

import pytest

import sim.steady as steady
from canzona.errors import SpecError
from sim.simulate import SimConfig, simulate, write_trace
from sim.workload import Workload
from tests.sim.small_models import EIGHT_LAYERS

# Qwen3-0.6B's shape at 8 layers: 96 micro-batches simulated one by one in seconds
LAYOUTS = {
    "pp2-vp2": SimConfig(model=EIGHT_LAYERS, gpus=8, tp=2, pp=2, vp=2, policy="layerwise", zero1_fallback=False,
                         workload=Workload(256, 2 * 96)),
    "pp4-1f1b": SimConfig(model=EIGHT_LAYERS, gpus=8, tp=2, pp=4, optimizer="adamw",
                          workload=Workload(256, 96)),
}


@pytest.fixture
def small_bounds(monkeypatch):
    """Extrapolate above 40 micro-batches, from 16 and 32 (the real bounds, 256 and 32, made small)."""
    monkeypatch.setattr(steady, "EXACT_MICRO_BATCHES", 40)
    monkeypatch.setattr(steady, "SHORT_MICRO_BATCHES", 16)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_extrapolated_is_the_exact_simulation(name, small_bounds, monkeypatch):
    cfg = LAYOUTS[name]
    got = simulate(cfg)
    assert got.extrapolated_from == (16, 32) and got.config == cfg
    monkeypatch.setattr(steady, "EXACT_MICRO_BATCHES", 10**6)
    want = simulate(cfg)
    assert want.extrapolated_from is None
    for field in ("iteration_time_s", "forward_backward_s", "grad_sync_end_s", "mfu"):
        assert getattr(got, field) == pytest.approx(getattr(want, field), rel=1e-4), field
    assert got.optimizer_step_s == pytest.approx(want.optimizer_step_s, rel=1e-3)
    for key in want.breakdown:
        assert got.breakdown[key] == pytest.approx(want.breakdown[key], rel=1e-3, abs=1e-6), key
    assert got.memory.worst.total == want.memory.worst.total  # past the warm-up the activations are the same
    assert got.to_dict()["extrapolated_from_micro_batches"] == [16, 32]
    assert got.to_dict()["workload"]["global_batch"] == cfg.workload.global_batch


def test_up_to_the_bound_nothing_is_extrapolated():
    assert steady.short_lengths(steady.EXACT_MICRO_BATCHES, 8) is None
    assert steady.short_lengths(512, 8) == (32, 64)  # Megatron-Bridge's Qwen3-235B GBS 8192 row
    assert steady.short_lengths(300, 64) is None  # 256 and 512: not shorter
    assert steady.short_lengths(512, 12) == (48, 96)  # multiples of PP, at least 4 x PP


def test_an_extrapolated_run_has_no_trace(small_bounds, tmp_path):
    r = simulate(LAYOUTS["pp4-1f1b"])
    with pytest.raises(SpecError, match="no trace of an iteration extrapolated"):
        write_trace(r, tmp_path / "t.json")


def test_an_explicit_plan_is_simulated_exactly(small_bounds):
    cfg = replace(LAYOUTS["pp4-1f1b"], pp=1, workload=Workload(256, 4 * 48))
    r = simulate(cfg, plan=simulate(cfg).plan)
    assert r.extrapolated_from is None


def test_the_cli_refuses_a_trace_of_an_extrapolated_run_before_simulating(tmp_path, monkeypatch):
    """One `error:` line before any work (no simulation is run: it would fail the test), naming
    the configured count; no trace file."""
    from sim import simulate as simulate_module
    from tests.cli_helpers import error_line, invoke

    def never(*args, **kwargs):
        raise AssertionError("simulated before refusing the trace")

    monkeypatch.setattr(simulate_module, "simulate", never)
    out = tmp_path / "t.json"
    result = invoke("simulate", "--model", "qwen3-0.6b", "--gpus", 8, "--tp", 2, "--seq-len", 256,
                    "--global-batch", 4 * 300, "--trace", str(out))
    error_line(result, "--trace: 300 micro-batches per DP rank are simulated by extrapolation")
    assert not out.exists()
