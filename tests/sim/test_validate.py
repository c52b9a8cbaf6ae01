"""The simulator against the runtime (`canzona validate`, sim.validate): the comparison logic on
given figures, and one small end-to-end run on spawned gloo ranks."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from sim.validate import NOISE, Comparison, Report, compare, runtime_config
from tests.cli_helpers import error_line, invoke


@dataclass
class M:
    step_s: float
    iteration_s: float


@dataclass
class P:
    iteration_time_s: float
    forward_backward_s: float


def report(measured: dict[str, float], predicted: dict[str, float]) -> Report:
    return compare({k: M(v, 2 * v) for k, v in measured.items()},
                   {k: P(v + 0.1, 0.1) for k, v in predicted.items()})


def test_errors_and_tau():
    r = report({"a": 1.0, "b": 2.0, "c": 3.0}, {"a": 1.1, "b": 1.8, "c": 3.3})
    assert [round(x.step_error, 6) for x in r.rows] == [0.1, -0.1, 0.1]
    assert r.step_tau == 1.0 and r.ranking_preserved and r.discordant == []
    assert r.worst_step_error == pytest.approx(0.1)
    d = r.to_dict()
    assert d["ranking_preserved"] and d["step_kendall_tau"] == 1.0 and len(d["rows"]) == 3


def test_a_clear_flip_breaks_the_ranking_a_tie_does_not():
    flipped = report({"a": 1.0, "b": 2.0}, {"a": 2.5, "b": 2.0})
    assert not flipped.ranking_preserved and flipped.discordant == [("a", "b")] and flipped.step_tau < 1
    # measured within the noise band, predicted the other way: a tie, not an error
    close = report({"a": 1.0, "b": 1.0 + NOISE / 2}, {"a": 1.2, "b": 1.1})
    assert close.ranking_preserved and close.step_tau < 1
    tied = report({"a": 1.0, "b": 1.5}, {"a": 1.2, "b": 1.2})
    assert tied.ranking_preserved


def test_simulated_counterpart_runs_as_the_runtime_does():
    cfg = runtime_config("canzona", 2, 32, 4, "muon", "h100-sxm", "m")
    assert cfg.gpus == 2 and cfg.tp == 1 and cfg.workload.global_batch == 8 and cfg.workload.micro_batch == 4
    assert cfg.options.overlap_param_gather and not cfg.zero1_fallback  # the runtime's default
    assert cfg.workload.dtype == "fp32" and cfg.workload.param_bytes == 4 and cfg.workload.grad_bytes == 4
    assert Comparison("x", 2.0, 3.0, 4.0, 2.0).iteration_error == -0.5


@pytest.mark.distributed
def test_validate_end_to_end_on_two_gloo_ranks(monkeypatch):
    """Calibrate this machine (quick), train under two policies, predict, compare: the command runs
    and reports every figure; the aims (ranking, 30%) are printed, not asserted (shared machine).
    The model is shrunk: the real one's bf16 Newton-Schulz takes seconds per step on CPUs without
    native bf16, and every path of the command runs the same on a small one."""
    from canzona.harness import validate as runtime_validation
    from reference.tiny_model import TinyQwen3Config

    monkeypatch.setattr(runtime_validation, "VALIDATION_MODEL", TinyQwen3Config(
        vocab=256, hidden=96, layers=2, q_heads=3, kv_heads=1, head_dim=32, ffn=256, tied_embeddings=True,
        max_seq_len=64, name="validate-96"))
    result = invoke("validate", "--policies", "sc,canzona", "--rounds", "3", "--json")
    assert result.exit_code == 0, result.stderr
    d = json.loads(result.stdout)
    assert [r["policy"] for r in d["rows"]] == ["sc", "canzona"]
    for r in d["rows"]:
        assert r["measured_step_s"] > 0 and r["predicted_step_s"] > 0
    assert isinstance(d["ranking_preserved"], bool) and isinstance(d["aims_met"], bool)
    assert d["model"] == "validate-96"


@pytest.mark.parametrize("args,needle", [
    (["--dp", "1"], "--dp must be in"),
    (["--policies", "fast"], "unknown policy 'fast'"),
    (["--rounds", "1"], "--rounds"),
    (["--optimizer", "sgd"], "sgd"),
    (["--hardware", "/nonexistent.json"], "/nonexistent.json"),
    (["--profile-out", "/tmp/x.txt"], ".json"),
])
def test_bad_input_is_one_line(args, needle):
    error_line(invoke("validate", *args), needle)


def test_profile_out_with_a_given_hardware_is_one_line_before_measuring(monkeypatch, tmp_path):
    """--profile-out keeps the profile `canzona validate` calibrates; with --hardware nothing is
    calibrated, and the validation ran and wrote no file, without a word. One line, before any
    rank is spawned."""
    from canzona.harness import validate as runtime_validation

    def refuse(*args, **kwargs):
        raise AssertionError("bad input must be rejected before measuring")

    monkeypatch.setattr(runtime_validation, "measure", refuse)
    error_line(invoke("validate", "--hardware", "h100-sxm", "--profile-out", tmp_path / "p.json"),
               "--profile-out", "--hardware")
    assert list(tmp_path.iterdir()) == []


def test_all_policies_are_those_that_run_the_optimizer_and_a_policy_that_does_not_is_one_line(monkeypatch):
    """`canzona validate` (README) measures every policy that runs the optimizer: zero1 runs AdamW
    only, and "all" took it too, so the default command failed on a rank after calibrating
    ('policy zero1 runs elementwise optimizers'). A policy named that cannot run the optimizer is
    one line before anything is measured."""
    from canzona.errors import SpecError
    from canzona.harness import validate as runtime_validation

    asked = []

    def record(policies, *args, **kwargs):
        asked.append(list(policies))
        raise SpecError("stop after choosing")  # the command's own one-line error path; nothing spawned

    monkeypatch.setattr(runtime_validation, "measure", record)
    error_line(invoke("validate", "--hardware", "h100-sxm"), "stop after choosing", code=1)
    assert asked == [["sc", "zero1-gather", "layerwise", "canzona"]]
    error_line(invoke("validate", "--hardware", "h100-sxm", "--policies", "canzona,zero1"), "policy zero1 runs")
    assert len(asked) == 1  # refused before measuring
