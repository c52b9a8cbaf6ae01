"""Hostile and mistaken input found by trying the CLI hard: each case ends in one `error:` line and
exit code 2 before any work starts, and leaves no partial file behind."""

from __future__ import annotations

import errno
import json
import os
from importlib import resources
from pathlib import Path

import pytest

import canzona.fileio as fileio
import sim.simulate
from canzona.errors import CanzonaError, PlanError, SpecError
from canzona.fileio import parse_json, read_text, write_atomic, write_text_atomic
from canzona.hardware import load_profile
from canzona.plan import load_plan

try:
    from cli_helpers import error_line, help_text, invoke
except ImportError:  # run from the repository root as a package
    from tests.cli_helpers import error_line, help_text, invoke

PLAN = ["--model", "qwen3-0.6b", "--dp", "4", "--tp", "2"]
SIM = ["--model", "qwen3-0.6b", "--gpus", "8", "--tp", "8", "--seq-len", "128", "--global-batch", "1"]


@pytest.fixture
def no_simulation(monkeypatch):
    """Output paths are checked before the (long) simulation: running it is a failure here."""
    def refuse(*a, **k):
        raise AssertionError("bad input must be rejected before simulating")

    monkeypatch.setattr(sim.simulate, "simulate", refuse)
    monkeypatch.setattr(sim.simulate, "compare", refuse)


# --- output paths -------------------------------------------------------------------------------


@pytest.mark.parametrize("name, needle", [
    ("x.xyz", "unsupported extension '.xyz'"),
    ("noext", "no extension"),
    ("missing/x.png", "does not exist"),
])
def test_plot_path_is_checked_before_simulating(tmp_path, no_simulation, name, needle):
    error_line(invoke("compare", *SIM, "--plot", tmp_path / name), needle)
    assert list(tmp_path.iterdir()) == []


def test_plot_formats_by_extension(tmp_path):
    for name in ("cmp.svg", "cmp.pdf"):
        result = invoke("compare", *SIM, "--plot", tmp_path / name)
        assert result.exit_code == 0, result.stderr
        assert f"plot written to {tmp_path / name}" in result.stdout
    assert (tmp_path / "cmp.svg").read_text().lstrip().startswith(("<?xml", "<svg"))
    assert (tmp_path / "cmp.pdf").read_bytes().startswith(b"%PDF")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cmp.pdf", "cmp.svg"]  # no temporaries left


def test_trace_and_plan_paths_are_checked_first(tmp_path, no_simulation):
    error_line(invoke("simulate", *SIM, "--trace", tmp_path / "no" / "t.json"), "does not exist")
    error_line(invoke("simulate", *SIM, "--trace", tmp_path), "is a directory")
    error_line(invoke("plan", *PLAN, "--out", tmp_path), "is a directory")


# --- files read: size, kind, nesting, numbers ---------------------------------------------------


def _file(tmp_path: Path, text: str, name: str = "f.json") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, needle", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"schema": "canzona.plan", "version": ' + "9" * 5000 + "}", "too many digits"),
    ('{"schema": "canzona.plan", "version": 1, "x": NaN}', "NaN"),
    ('{"schema": "canzona.plan", "version": 1, "x": -Infinity}', "-Infinity"),
    ("\xff\xfe", "not valid JSON"),
])
def test_inspect_hostile_json(tmp_path, text, needle):
    error_line(invoke("inspect", _file(tmp_path, text)), needle)


def test_inspect_rejects_what_is_not_a_regular_file(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it would block until a writer appears
    for path in (fifo, "/dev/zero", tmp_path):
        error_line(invoke("inspect", path), "not a regular file")
    error_line(invoke("simulate", *SIM, "--hardware", "/dev/zero"), "not a regular file")
    error_line(invoke("simulate", *SIM, "--hardware", fifo), "not a regular file")


def test_size_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(fileio, "MAX_INPUT_BYTES", 100)
    error_line(invoke("inspect", _file(tmp_path, " " * 101 + "{}")), "more than the 100")
    with pytest.raises(PlanError, match="more than the 100"):
        load_plan(_file(tmp_path, " " * 200))


def test_read_text_bounds_a_growing_file(tmp_path):
    path = _file(tmp_path, "x" * 64)
    assert read_text(path, "file", max_bytes=64) == "x" * 64
    with pytest.raises(CanzonaError, match="64 bytes"):
        read_text(path, "file", max_bytes=63)


def test_parse_json_is_strict():
    assert parse_json('{"a": [1, 2.5, "x"]}', "doc") == {"a": [1, 2.5, "x"]}
    for text in ("NaN", "Infinity", "[1, -Infinity]"):
        with pytest.raises(CanzonaError, match="not a number JSON allows"):
            parse_json(text, "doc")


def _profile(tmp_path: Path, path: tuple[str, ...], value_json: str) -> Path:
    data = json.loads((resources.files("canzona") / "profiles" / "h100-sxm.json").read_text())
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = "__VALUE__"
    return _file(tmp_path, json.dumps(data).replace('"__VALUE__"', value_json), "profile.json")


@pytest.mark.parametrize("path, value", [
    (("gpu", "launch_s"), "NaN"),
    (("gpu", "hbm_bytes_per_s"), "Infinity"),
    (("gpu", "sms"), "true"),
    (("gpu", "peak_flops", "bf16"), "Infinity"),
    (("gpu", "peak_flops", "fp32"), "false"),
    (("network", "nic_busbw"), "1e999"),
    (("measured",), '"yes"'),
    (("solver_seconds",), '{"eigh": [[true, 0.1]]}'),
    (("solver_seconds",), '{"eigh": [[64.5, 0.1]]}'),
])
def test_profiles_reject_non_finite_and_boolean_numbers(tmp_path, path, value):
    profile = _profile(tmp_path, path, value)
    with pytest.raises(SpecError):
        load_profile(profile)
    error_line(invoke("simulate", *SIM, "--hardware", profile))


def test_profile_from_python_rejects_non_finite_numbers():
    from canzona.hardware import profile_from_dict

    data = json.loads((resources.files("canzona") / "profiles" / "h100-sxm.json").read_text())
    data["gpu"]["elementwise_flops"] = float("inf")
    with pytest.raises(SpecError, match="positive finite number"):
        profile_from_dict(data)


def test_cost_table_rejects_non_finite_and_boolean_times(tmp_path):
    from canzona.cost import load_cost_table

    for value in ("1e999", "true", "NaN"):
        path = _file(tmp_path, '{"rows": [["muon", 8, 8, "fp32", ' + value + "]]}", "table.json")
        with pytest.raises(SpecError):
            load_cost_table(str(path))
    with pytest.raises(SpecError, match="not a regular file"):
        load_cost_table("/dev/zero")


# --- values: finite, bounded --------------------------------------------------------------------


def test_infinite_capacity_is_rejected_and_plans_are_strict_json(tmp_path):
    error_line(invoke("plan", *PLAN, "--capacity", "1e999GiB", "--out", tmp_path / "p.json"), "finite")
    assert not (tmp_path / "p.json").exists()
    result = invoke("plan", *PLAN, "--capacity", "1.5GiB", "--out", tmp_path / "p.json", "--json")
    assert result.exit_code == 0, result.stderr
    parse_json((tmp_path / "p.json").read_text(), "plan")  # strict: no NaN / Infinity anywhere


@pytest.mark.parametrize("args, needle", [
    (["plan", "--dp", "10000000"], "dp must be in 1..65536"),
    (["simulate", "--global-batch", "100000"], "at most 256"),
    (["compare", "--global-batch", "100000"], "at most 256"),
    (["simulate", "--gpus", "100000"], "at most 16384 GPUs"),
    (["simulate", "--seq-len", "100000000"], "seq len must be <="),
    (["plan", "--alpha", "nan"], "alpha"),
    (["plan", "--dp", "abc"], "Invalid value for '--dp'"),
    (["simulate", "--gpus", "1.5"], "Invalid value for '--gpus'"),
    (["plan", "--bogus"], "No such option: --bogus"),
    (["frobnicate"], "No such command"),
    (["inspect"], "Missing argument"),
])
def test_sizes_and_usage_errors_are_one_line(no_simulation, args, needle):
    error_line(invoke(*args), needle)


def test_limits_are_stated_in_help():
    assert "(1..65536)" in help_text("plan")
    sim_help = help_text("simulate")
    assert "at most 16384" in sim_help and "256 micro-batches" in sim_help
    verify_help = help_text("verify")
    assert "1..16" in verify_help and "at most 1000" in verify_help and "at most 1024" in verify_help


@pytest.mark.parametrize("args, needle", [
    (["--global-batch", "1000000"], "global batch must be <= 1024"),
    (["--steps", "1000000"], "steps must be <= 1000"),
    (["--dp", "17"], "dp must be <= 16"),
    (["--dp-policy", "layerwise"], "needs a DP plan that keeps every matrix whole"),
    (["--dp-policy", "zero1-even", "--policy", "all"], "zero1-even does not"),
])
def test_verify_rejects_before_spawning(monkeypatch, args, needle):
    from canzona.runtime import verify as checks

    def no_spawn(*a, **k):
        raise AssertionError("bad input must fail before any spawn")

    monkeypatch.setattr(checks, "run", no_spawn)
    error_line(invoke("verify", *args), needle)


def test_simulator_rejects_plans_its_policy_cannot_execute(no_simulation):
    error_line(invoke("simulate", "--dp-policy", "layerwise"), "layerwise does not")
    error_line(invoke("compare", "--dp-policy", "zero1-even"), "zero1-even does not")


# --- writes are atomic --------------------------------------------------------------------------


def _no_space(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    good = tmp_path / "plan.json"
    assert invoke("plan", *PLAN, "--out", good, "--json").exit_code == 0
    before = good.read_bytes()
    monkeypatch.setattr(fileio.os, "fsync", _no_space)  # the disk fills up while writing
    error_line(invoke("plan", *PLAN, "--dp", "2", "--out", good), "No space left on device")
    error_line(invoke("simulate", *SIM, "--trace", tmp_path / "t.json"), "No space left on device")
    error_line(invoke("compare", *SIM, "--plot", tmp_path / "c.png"), "No space left on device")
    assert good.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_write_atomic_cleans_up_after_any_error(tmp_path):
    target = tmp_path / "out.txt"
    write_text_atomic(target, "old")

    def half_then_fail(tmp: Path) -> None:
        tmp.write_text("partial")
        raise RuntimeError("writer crashed")

    with pytest.raises(RuntimeError):
        write_atomic(target, half_then_fail)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]
    mask = os.umask(0)
    os.umask(mask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~mask  # as open() would create it, not 0600
