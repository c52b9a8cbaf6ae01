"""GPU-to-GPU speed variability (canzona.variability, docs/design.md §9.3): a synchronous job waits
for its slowest GPU, the expected maximum of N draws of the per-GPU compute time."""

from __future__ import annotations

import json
import math

import pytest

from canzona.errors import SpecError
from canzona.hardware import load_profile, load_profile_data, profile_from_dict
from canzona.variability import MAX_CV, check_cv, expected_max_normal, straggler_slowdown
from sim.simulate import SimConfig, simulate
from sim.workload import Workload
from tests.cli_helpers import error_line, invoke


def test_expected_max_of_normals_known_values() -> None:
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-9)
    assert expected_max_normal(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), abs=1e-9)
    # E[max of 4] = 1.0293753730 and E[max of 8] = 1.4236003060 (tables of normal order statistics)
    assert expected_max_normal(4) == pytest.approx(1.0293753730, abs=1e-8)
    assert expected_max_normal(8) == pytest.approx(1.4236003060, abs=1e-8)
    # it grows without bound, about as sqrt(2 ln n), and ever more slowly
    values = [expected_max_normal(2**k) for k in range(15)]
    assert all(b > a for a, b in zip(values, values[1:]))
    steps = [b - a for a, b in zip(values, values[1:])]
    assert all(b < a for a, b in zip(steps, steps[1:]))
    assert values[-1] < math.sqrt(2 * math.log(2**14))


@pytest.mark.parametrize("n", [0, -1, 2.5, True])
def test_expected_max_needs_a_whole_count(n) -> None:
    with pytest.raises(ValueError):
        expected_max_normal(n)


@pytest.mark.parametrize("cv", [-0.01, float("nan"), float("inf"), MAX_CV * 1.01, True, "0.01"])
def test_bad_variability_is_one_error(cv) -> None:
    with pytest.raises(SpecError, match="gpu variability must be a number"):
        check_cv(cv)
    with pytest.raises(SpecError, match="gpu variability must be a number"):
        SimConfig(model="qwen3-0.6b", gpus=8, tp=1, optimizer="adamw", gpu_variability=cv).check()


def test_slowdown_is_one_for_one_gpu_or_no_spread() -> None:
    assert straggler_slowdown(0.0148, 1) == 1.0
    assert straggler_slowdown(0.0, 4096) == 1.0
    assert straggler_slowdown(0.02, 2) == pytest.approx(1 + 0.02 / math.sqrt(math.pi))


def test_profiles_carry_their_variability() -> None:
    hw = load_profile("h100-sxm")
    assert 0 < hw.gpu_time_cv < 0.05
    assert any(s.startswith("variability.time_cv") for s in hw.sources)
    data, where = load_profile_data("h100-sxm")
    del data["variability"]
    assert profile_from_dict(data, where).gpu_time_cv == 0.0  # a profile without it: GPUs alike
    for bad in ({"time_cv": -1}, {"cv": 0.01}, [0.01], {"time_cv": 0.01, "x": 1}):
        data["variability"] = bad
        with pytest.raises(SpecError, match="variability"):
            profile_from_dict(data, where)


def _config(gpus: int, **kw) -> SimConfig:
    """AdamW data parallelism at fixed work per GPU: 4 sequences of 256 tokens each."""
    return SimConfig(model="qwen3-0.6b", gpus=gpus, tp=1, optimizer="adamw",
                     workload=Workload(seq_len=256, global_batch=4 * gpus), **kw)


def test_zero_variability_is_the_profile_without_it(tmp_path) -> None:
    """`gpu_variability=0` gives, bit for bit, the result of a profile without variability: the
    simulator of before this model."""
    data, _ = load_profile_data("h100-sxm")
    del data["variability"]
    path = tmp_path / "alike.json"
    path.write_text(json.dumps(data))
    a = simulate(_config(16, gpu_variability=0.0)).to_dict()
    b = simulate(_config(16, hardware=str(path))).to_dict()
    assert a.pop("hardware") == "h100-sxm" and b.pop("hardware") == str(path)
    assert json.dumps(a) == json.dumps(b)
    assert a["gpu_slowdown"] == 1.0


def test_phase_a_compute_scales_by_the_slowdown(full_rate_compute) -> None:
    # without SM sharing, whose stretch of a kernel depends on what overlaps it (sim.comm_sms)
    base = simulate(_config(16, gpu_variability=0.0))
    slow = simulate(_config(16, gpu_variability=0.02))
    assert slow.gpu_slowdown == pytest.approx(1 + 0.02 * expected_max_normal(16))
    a = [s.end - s.start for s in base.spans.simulated if s.phase == "A" and s.kind == "compute"]
    b = [s.end - s.start for s in slow.spans.simulated if s.phase == "A" and s.kind == "compute"]
    assert len(a) == len(b) and sum(b) == pytest.approx(sum(a) * slow.gpu_slowdown, rel=1e-12)
    # the optimizer step (phase B) is priced as before
    sa = [s.end - s.start for s in base.spans.simulated if s.phase == "B" and s.kind == "compute"]
    sb = [s.end - s.start for s in slow.spans.simulated if s.phase == "B" and s.kind == "compute"]
    assert sa == sb
    assert slow.iteration_time_s > base.iteration_time_s


def test_one_gpu_is_the_median_gpu() -> None:
    """The profile's kernel rates are one GPU's: a one-GPU job is not slowed."""
    assert simulate(_config(1)).iteration_time_s == simulate(_config(1, gpu_variability=0.0)).iteration_time_s


def test_tokens_per_gpu_fall_as_dp_grows() -> None:
    """At fixed work per GPU, a larger job waits for a slower slowest GPU: tokens / s / GPU never
    rise with DP (the published AdamW runs' trend), and strictly fall with the profile's spread."""
    per_gpu = []
    for gpus in (2, 4, 8, 16, 32, 64):  # 8 sequences of 1024 tokens per GPU: compute dominates
        cfg = SimConfig(model="qwen3-0.6b", gpus=gpus, tp=1, optimizer="adamw",
                        workload=Workload(seq_len=1024, global_batch=8 * gpus))
        per_gpu.append(8 * 1024 / simulate(cfg).iteration_time_s)
    assert all(b < a for a, b in zip(per_gpu, per_gpu[1:])), per_gpu


def test_the_slowest_of_all_gpus_whatever_syncs_them() -> None:
    """The statistic (docs/design.md §9.3): with a persistent factor per GPU, a TP / CP group runs at
    its slowest member (a collective every layer), a pipeline at its slowest stage (1F1B's steady
    state), and the step at its slowest DP replica (the gradient reduction, once a step): the max
    of maxima is the max over all N GPUs, however they are grouped, and the model's factor is its
    expectation. Per-iteration noise would instead average within a replica's sum (its spread
    shrinks with the kernels summed) and not grow with N. Monte Carlo over layouts of 256 GPUs."""
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(7)
    cv, n, draws = 0.0148, 256, 4000
    factors = 1.0 + cv * rng.standard_normal((draws, n))
    for group in (1, 8, 32, 256):  # GPUs of one replica (TP x CP x PP), n / group replicas
        replicas = factors.reshape(draws, n // group, group).max(axis=2)  # each replica: its slowest
        step = replicas.max(axis=1).mean()  # the step: the slowest replica
        assert step == pytest.approx(straggler_slowdown(cv, n), abs=3e-4)
    # a per-iteration (transient) factor averaged over k kernels per replica grows far less with N
    k = 100
    transient = (1.0 + cv * rng.standard_normal((400, n, k))).mean(axis=2).max(axis=1).mean()
    assert transient - 1.0 < 0.2 * (straggler_slowdown(cv, n) - 1.0)
    # and the simulator's factor depends on the GPU count only, not on the layout
    cfgs = [SimConfig(model="qwen3-0.6b", gpus=64, tp=tp, pp=pp, optimizer="adamw") for tp, pp in ((1, 1), (8, 1), (2, 4))]
    hw = load_profile("h100-sxm")
    assert len({c.slowdown(hw, 64) for c in cfgs}) == 1


@pytest.mark.parametrize("value", ["-0.1", "0.5", "nan"])
def test_cli_bad_gpu_variability_is_one_error_line(value) -> None:
    error_line(invoke("simulate", "--model", "qwen3-0.6b", "--gpus", "8", "--tp", "1", "--optimizer", "adamw",
                      "--gpu-variability", value), "gpu variability must be a number")


def test_cli_gpu_variability_in_json() -> None:
    def slowdown(*extra: str) -> float:
        out = invoke("simulate", "--model", "qwen3-0.6b", "--gpus", "8", "--tp", "1", "--optimizer", "adamw",
                     "--seq-len", "256", "--global-batch", "8", *extra, "--json")
        assert out.exit_code == 0, out.output
        return json.loads(out.stdout)["gpu_slowdown"]

    assert slowdown() == pytest.approx(1 + load_profile("h100-sxm").gpu_time_cv * expected_max_normal(8))
    assert slowdown("--gpu-variability", "0") == 1.0
    assert slowdown("--gpu-variability", "0.03") == pytest.approx(1 + 0.03 * expected_max_normal(8))
