"""`canzona validate --published`: the table and JSON, and its bad input (one error line, exit 2)."""

from __future__ import annotations

import json

from tests.cli_helpers import error_line, invoke

FEW = "qwen3-30b-a3b-16xh100-mb,qwen3-8b"  # three fast rows: the Qwen3-30B-A3B functional and tuned runs, Qwen3-8B


def test_published_table_prints_errors_mae_and_tau():
    result = invoke("validate", "--published", "--rows", FEW, env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "Mean absolute error" in text and "Kendall tau overall" in text
    assert "qwen3-30b-a3b-16xh100-mb" in text and "qwen3-8b-16xh100-mb" in text


def test_a_row_the_simulator_cannot_express_is_listed_with_what_it_needs():
    """No published row needs a missing layout today; one that does (CP with EP) is listed with
    its needs and no error figure, and left out of the errors."""
    from dataclasses import replace

    from rich.console import Console

    from cli.render import published_table
    from sim import published

    runs, sources = published.load()
    run = replace(next(r for r in runs if r.ep > 1 and not r.fsdp), cp=2)
    assert run.needs() == ("--cp with --ep",)
    report = published.PublishedReport(rows=(published.compare_run(run),), sources=sources)
    assert report.skipped and report.mean_abs_error is None
    console = Console(width=250, record=True)
    console.print(published_table(report))
    assert "not expressible: needs --cp with --ep" in " ".join(console.export_text().split())


def test_published_json():
    result = invoke("validate", "--published", "--rows", FEW, "--json")
    assert result.exit_code == 0, result.stderr
    d = json.loads(result.stdout)
    assert d["expressible"] == 3 and d["not_expressible"] == 0
    assert d["mean_abs_error"] is not None and "kendall_tau_overall" in d and "kendall_tau_by_model" in d
    assert all(d["sources"][r["source"]]["url"].startswith("https://") for r in d["rows"])


def test_published_bad_input():
    error_line(invoke("validate", "--published", "--rows", "no-such-row"), "no published row matches")
    error_line(invoke("validate", "--published", "--rows", " , "), "--rows names no row")
    error_line(invoke("validate", "--rows", "qwen3"), "--rows selects published rows")
    error_line(invoke("validate", "--search"), "--search ranks published rows' layouts")
    error_line(invoke("validate", "--workers", 2), "--workers is for --published")
    # the runtime validation's options would be dropped without a word, --strict's gate always passing
    error_line(invoke("validate", "--published", "--strict"), "--strict is for the runtime validation")
    error_line(invoke("validate", "--published", "--rows", "qwen3-8b", "--hardware", "a100-sxm", "--dp", 3),
               "--hardware, --dp are for the runtime validation")
    error_line(invoke("validate", "--published", "--workers", 0), "--workers must be in")
    error_line(invoke("validate", "--published", "--search", "--workers", 0), "--workers must be in")
