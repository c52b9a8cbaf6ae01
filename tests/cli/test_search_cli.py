"""`canzona search`: the table, --json, the plan command of the best layout, bad input."""

from __future__ import annotations

import json
import shlex

import pytest

from tests.cli_helpers import error_line, invoke

SMALL = ("--model", "qwen3-0.6b", "--gpus", 8, "--seq-len", 1024, "--global-batch", 8, "--workers", 2)


@pytest.fixture(scope="module")
def as_json():
    r = invoke("search", *SMALL, "--top", 3, "--json")
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def test_json_schema(as_json):
    assert {"model", "gpus", "hardware", "optimizer", "seq_len", "global_batch", "searched", "layouts"} <= set(as_json)
    # the whole question the layouts were searched under, every setting a Question carries
    from sim.search import Question

    asked = set(Question.__dataclass_fields__)
    assert asked <= set(as_json), asked - set(as_json)
    assert as_json["ep_dispatcher"]["moe_token_dispatcher_type"] == "alltoall"
    assert {"candidates", "pruned_by_checks", "pruned_by_memory", "pruned_by_bound", "simulated", "fit",
            "workers", "wall_s"} <= set(as_json["searched"])
    assert 1 <= len(as_json["layouts"]) <= 3
    for i, row in enumerate(as_json["layouts"]):
        assert row["rank"] == i + 1
        for key in ("tp", "pp", "vp", "ep", "dp", "micro_batch", "recompute", "policy", "reduce_scatter",
                    "iteration_time_s", "mfu", "memory_bytes", "fits", "optimizer_step_s", "plan_command",
                    "not_in_plan"):
            assert key in row
        assert row["fits"]
    times = [r["iteration_time_s"] for r in as_json["layouts"]]
    assert times == sorted(times)


def test_plan_command_of_the_best_runs(as_json, tmp_path):
    command = as_json["layouts"][0]["plan_command"]
    args = shlex.split(command)
    assert args[:2] == ["canzona", "plan"]
    out = tmp_path / "plan.json"
    args = [a if a != "plan.json" else str(out) for a in args[2:]]
    r = invoke("plan", *args)
    assert r.exit_code == 0, r.stderr
    assert out.exists()


def test_table_and_plan_line():
    r = invoke("search", *SMALL, "--top", 2)
    assert r.exit_code == 0, r.stderr
    assert "best: canzona plan --model qwen3-0.6b" in r.stdout
    assert "--out plan.json" in r.stdout


@pytest.mark.parametrize("args, needle", [
    (("--gpus", 0), "gpus"),
    (("--model", "no-such-model"), "no-such-model"),
    (("--optimizer", "sgd"), "sgd"),
    (("--top", 0), "--top"),
    (("--gpus", 3, "--model", "qwen3-0.6b", "--global-batch", 8), "no layout"),
])
def test_bad_input_is_one_line(args, needle):
    error_line(invoke("search", *args), needle)


@pytest.mark.parametrize("name", ["overlap_moe_expert_parallel_comm", "delay_wgrad_compute", "tp_comm_overlap"])
def test_run_settings_of_the_question_are_options_as_in_simulate(name):
    """The run settings `Question` carries that `simulate` and `compare` take are `search` options
    of the same name and default (`--tp-comm-overlap` was a Question field no command line set)."""
    import inspect

    from cli import main

    defaults = {c: inspect.signature(getattr(main, c)).parameters[name].default
                for c in ("simulate", "compare", "search")}
    assert len(set(defaults.values())) == 1, defaults


def test_no_tp_comm_overlap_reaches_the_question():
    r = invoke("search", *SMALL, "--top", 1, "--no-tp-comm-overlap", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["tp_comm_overlap"] is False
