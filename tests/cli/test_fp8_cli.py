"""`--precision fp8` on the command line: accepted by simulate and compare, bad values and a GPU
without FP8 refused with one error line."""

from __future__ import annotations

import json

from tests.cli_helpers import error_line, help_text, invoke

SIM = ["--model", "qwen3-0.6b", "--gpus", "8", "--tp", "8", "--seq-len", "128", "--global-batch", "1",
       "--optimizer", "adamw"]


def test_simulate_accepts_fp8():
    result = invoke("simulate", *SIM, "--precision", "fp8", "--fp8-recipe", "current", "--json")
    assert result.exit_code == 0, result.stderr
    d = json.loads(result.stdout)
    assert d["workload"]["precision"] == "fp8" and d["workload"]["fp8_recipe"] == "current"
    assert d["iteration_time_s"] > 0


def test_fp8_options_are_documented():
    for command in ("simulate", "compare", "search"):
        text = help_text(command)
        assert "--precision" in text and (command == "search" or "--fp8-recipe" in text)


def test_bad_precision_is_one_error_line():
    error_line(invoke("simulate", *SIM, "--precision", "fp4"), "precision must be one of bf16, fp8", "'fp4'")
    error_line(invoke("compare", *SIM, "--precision", "int8"), "precision must be one of bf16, fp8")
    error_line(invoke("simulate", *SIM, "--precision", "fp8", "--fp8-recipe", "mx"), "fp8 recipe must be one of")
    error_line(invoke("simulate", *SIM, "--precision", "fp8", "--hardware", "a100-sxm"),
               "a100-sxm has no FP8 tensor cores")
