"""The `canzona` CLI: models, plan, inspect; every bad input ends in one `error:` line, exit code 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from canzona.catalog import QWEN3_DENSE
from canzona.dp import DP_POLICIES
from canzona.plan import load_plan
from canzona.tp import TP_POLICIES
from tests.cli_helpers import error_line, invoke

SMALL = ["--model", "qwen3-0.6b", "--dp", "4", "--tp", "2"]
REQUIRED = {
    "dp": {"policy", "imbalance", "lower_bound_gap", "comm_ratio", "atomic", "rank_loads"},
    "tp": {"policy", "groups", "efficiency"},
}


def run(*args: str):
    result = invoke(*args)
    return result, result.stdout, result.stderr


def assert_one_error_line(result, stdout: str, stderr: str, *needles: str) -> str:
    return error_line(result, *needles)


@pytest.fixture(scope="module")
def good_plan(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plans") / "plan.json"
    result, out, err = run("plan", *SMALL, "--out", path, "--json")
    assert result.exit_code == 0, err
    return path


def test_models_lists_all_six():
    result, out, err = run("models")
    assert result.exit_code == 0, err
    for name in QWEN3_DENSE:
        assert name in out
    assert "32.76B" in out  # qwen3-32b's parameter count
    assert err == ""


def test_plan_default_shows_every_policy():
    result, out, err = run("plan")
    assert result.exit_code == 0, err
    assert "qwen3-32b, dp=32, tp=8, muon" in out
    for name in DP_POLICIES:
        assert name in out, name
    for name in TP_POLICIES:
        assert name in out, name
    assert err == ""


def test_plan_json_prints_exactly_one_object():
    result, out, err = run("plan", *SMALL, "--optimizer", "soap", "--dp-policy", "alpha-balanced-reorder",
                           "--json")
    assert result.exit_code == 0, err
    text = out.strip()
    assert len(text.splitlines()) == 1
    obj, end = json.JSONDecoder().raw_decode(text)
    assert end == len(text)  # nothing after the object
    assert isinstance(obj, dict)
    for section, keys in REQUIRED.items():
        assert keys <= set(obj[section])
    assert (obj["model"], obj["dp_size"], obj["tp_size"], obj["optimizer"]) == ("qwen3-0.6b", 4, 2, "soap")
    assert obj["dp"]["policy"] == "alpha-balanced-reorder"
    assert obj["tp"]["policy"] == "greedy-rollback"
    assert len(obj["dp"]["rank_loads"]) == 4


def test_plan_out_is_accepted_by_inspect(good_plan):
    plan = load_plan(good_plan)
    result, out, err = run("inspect", good_plan)
    assert result.exit_code == 0, err
    assert "valid plan" in out and plan.hash()[:12] in out
    result, out, err = run("inspect", good_plan, "--model", "qwen3-0.6b", "--dp", "4", "--tp", "2",
                           "--json")
    assert result.exit_code == 0, err
    obj = json.loads(out)
    assert obj["hash"] == plan.hash()
    assert obj["dp"] == plan.summary()["dp"]


def test_plan_out_with_tables(tmp_path):
    path = tmp_path / "p.json"
    result, out, err = run("plan", *SMALL, "--tp-policy", "tp-chunk", "--capacity", "4GiB", "--out", path)
    assert result.exit_code == 0, err
    plan = load_plan(path)
    compact = "".join(out.split())  # rich may wrap the line at any width
    assert "".join(f"plan written to {path}".split()) in compact
    assert plan.tp_plan.policy == "tp-chunk" and plan.tp_plan.capacity is None


def _malformed(tmp_path: Path, good_plan: Path) -> Path:
    d = json.loads(good_plan.read_text())
    d["dp_plan"]["buckets"][0]["params"][0][5] = 99  # owner out of range
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    return path


ERRORS = {
    "unknown model": (["plan", "--model", "qwen3-999b"], ["qwen3-999b", *QWEN3_DENSE]),
    "tp 3": (["plan", "--tp", "3"], ["tp=3", "attention heads"]),
    "tp 5 on 14b": (["plan", "--model", "qwen3-14b", "--tp", "5"], ["KV heads"]),
    "dp 0": (["plan", *SMALL[:2], "--dp", "0", "--tp", "2"], ["dp must be in 1..65536"]),
    "alpha 1.5": (["plan", *SMALL, "--alpha", "1.5"], ["alpha must be in [0, 1]"]),
    "alpha -0.1": (["plan", *SMALL, "--alpha=-0.1"], ["alpha must be in [0, 1]"]),
    "alpha -0.1 separate": (["plan", *SMALL, "--alpha", "-0.1"], ["alpha must be in [0, 1]"]),
    "small bucket": (["plan", *SMALL, "--bucket-size", "1000"], ["smaller than the largest parameter"]),
    "zero bucket": (["plan", *SMALL, "--bucket-size", "0"], ["bucket size"]),
    "zero align": (["plan", *SMALL, "--align", "0"], ["align must be"]),
    "unknown optimizer": (["plan", *SMALL, "--optimizer", "lion"], ["lion", "muon, soap, shampoo"]),
    "capacity not a number": (["plan", *SMALL, "--capacity", "lots"], ["capacity 'lots'"]),
    "capacity unit": (["plan", *SMALL, "--capacity", "5parsec"], ["unit 'parsec'"]),
    "capacity zero": (["plan", *SMALL, "--capacity", "0ms"], ["capacity must be a positive finite number"]),
    "unknown dp policy": (["plan", *SMALL, "--dp-policy", "magic"], ["unknown DP policy 'magic'"]),
    "unknown tp policy": (["plan", *SMALL, "--tp-policy", "magic"], ["unknown TP policy 'magic'"]),
}


@pytest.mark.parametrize("what", list(ERRORS))
def test_plan_errors_are_one_line(what):
    args, needles = ERRORS[what]
    assert_one_error_line(*run(*args), *needles)


def test_plan_unwritable_out(tmp_path):
    assert_one_error_line(*run("plan", *SMALL, "--out", tmp_path / "no" / "dir" / "p.json"),
                          "cannot write")


def test_inspect_unreadable_paths(tmp_path):
    assert_one_error_line(*run("inspect", tmp_path / "missing.json"), "cannot read plan file")
    assert_one_error_line(*run("inspect", tmp_path), "cannot read plan file")


def test_inspect_malformed_plans(tmp_path, good_plan):
    bad = _malformed(tmp_path, good_plan)
    assert_one_error_line(*run("inspect", bad), str(bad), "owner 99 outside 0..3")
    not_json = tmp_path / "nj.json"
    not_json.write_text("{ nope")
    assert_one_error_line(*run("inspect", not_json), "not valid JSON")
    array = tmp_path / "arr.json"
    array.write_text("[]")
    assert_one_error_line(*run("inspect", array), "not a JSON object")


def test_inspect_plan_for_another_model(good_plan):
    assert_one_error_line(*run("inspect", good_plan, "--model", "qwen3-1.7b"),
                          "plan was made for model 'qwen3-0.6b'", "qwen3-1.7b")
    assert_one_error_line(*run("inspect", good_plan, "--model", "qwen3-999b"), "unknown model")


def test_inspect_layout_checks(good_plan):
    assert_one_error_line(*run("inspect", good_plan, "--model", "qwen3-0.6b", "--dp", "8"),
                          "plan is for dp=4, but the job has dp=8")
    assert_one_error_line(*run("inspect", good_plan, "--model", "qwen3-0.6b", "--tp", "1"),
                          "plan is for tp=2")
    assert_one_error_line(*run("inspect", good_plan, "--dp", "4"), "--model")


@pytest.mark.parametrize("flag,value,needle", [("--dp", "0", "dp must be in 1..65536, got 0"),
                                               ("--tp", "-2", "tp must be in 1..1024, got -2"),
                                               ("--ep", "0", "ep must be in 1..65536, got 0")])
def test_inspect_a_size_below_one_is_named_as_such(good_plan, flag, value, needle):
    """Before: "plan is for dp=4, but the job has dp=0", as if 0 were a layout."""
    assert_one_error_line(*run("inspect", good_plan, "--model", "qwen3-0.6b", flag, value), needle)


def test_inspect_plan_with_string_host(tmp_path, good_plan):
    d = json.loads(good_plan.read_text())
    d["tp_plan"]["groups"][0][0]["hosts"][0] = "0"
    path = tmp_path / "host.json"
    path.write_text(json.dumps(d))
    assert_one_error_line(*run("inspect", path))


def _executable() -> list[str]:
    exe = shutil.which("canzona")
    return [exe] if exe else [sys.executable, "-m", "cli.main"]


def test_real_executable_plan_json_and_error(tmp_path):
    cmd = _executable()
    ok = subprocess.run([*cmd, "plan", *SMALL, "--json"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    obj = json.loads(ok.stdout)
    assert REQUIRED["dp"] <= set(obj["dp"]) and REQUIRED["tp"] <= set(obj["tp"])
    assert ok.stderr == ""
    bad = subprocess.run([*cmd, "plan", "--tp", "3"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.splitlines() == ["error: tp=3 does not divide the 64 attention heads of qwen3-32b"]
    assert bad.stdout == "" and "Traceback" not in bad.stderr


def test_plan_prices_work_on_the_given_hardware_or_measured_table(tmp_path):
    result, out, err = run("plan", *SMALL, "--hardware", "a100-sxm", "--json")
    assert result.exit_code == 0, err
    a100 = json.loads(out)
    assert a100["cost_model"] == "analytic:a100-sxm"
    h100 = json.loads(run("plan", *SMALL, "--json")[1])
    assert a100["dp"]["makespan_s"] > h100["dp"]["makespan_s"]  # the slower GPU takes longer
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"device": "cpu-test", "rows": [["muon", 1024, 1024, "bf16", 1.0]]}))
    result, out, err = run("plan", *SMALL, "--cost-table", table, "--json")
    assert result.exit_code == 0, err
    measured = json.loads(out)
    assert measured["cost_model"] == "table:cpu-test"
    assert measured["dp"]["makespan_s"] > 1.0  # the measured 1 s matrices dominate
    assert_one_error_line(*run("plan", *SMALL, "--cost-table", tmp_path / "missing.json"), "cost table")
