"""`canzona validate --published`: the table and JSON, and its bad input (one error line, exit 2)."""

from __future__ import annotations

import json

from tests.cli_helpers import error_line, invoke

FEW = "qwen3-30b-a3b,llama3-8b-8xh100-nemo24.07"  # one simulated row, one FP8 row: fast


def test_published_table_prints_errors_mae_and_tau():
    result = invoke("validate", "--published", "--rows", FEW, env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "Mean absolute error" in text and "Kendall tau overall" in text
    assert "not expressible:" in text and "fp8" in text  # the table wraps the cell (140 columns off a terminal)
    assert "qwen3-30b-a3b-16xh100-mb" in text


def test_published_json():
    result = invoke("validate", "--published", "--rows", FEW, "--json")
    assert result.exit_code == 0, result.stderr
    d = json.loads(result.stdout)
    assert d["expressible"] >= 1 and d["not_expressible"] >= 1
    assert d["mean_abs_error"] is not None and "kendall_tau_overall" in d and "kendall_tau_by_model" in d
    skipped = [r for r in d["rows"] if not r["expressible"]]
    assert all(r["error"] is None and r["not_expressible"].startswith("not expressible: needs") for r in skipped)
    assert all(d["sources"][r["source"]]["url"].startswith("https://") for r in d["rows"])


def test_published_bad_input():
    error_line(invoke("validate", "--published", "--rows", "no-such-row"), "no published row matches")
    error_line(invoke("validate", "--published", "--rows", " , "), "--rows names no row")
    error_line(invoke("validate", "--rows", "qwen3"), "--rows selects published rows")
    error_line(invoke("validate", "--search"), "--search ranks published rows' layouts")
    error_line(invoke("validate", "--published", "--workers", 2), "--workers is for --published --search")
    error_line(invoke("validate", "--published", "--search", "--workers", 0), "--workers must be in")
