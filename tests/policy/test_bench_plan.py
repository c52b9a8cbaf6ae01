"""benchmarks/bench_plan.py's verdict line names the optimizers it checked: every registered
matrix optimizer (`OPTIMIZERS`), not a list written once for three."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from rich.table import Table

from canzona.optimizers import MATRIX_OPTIMIZERS

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_plan.py"


def test_the_verdict_names_every_optimizer_checked(monkeypatch, capsys) -> None:
    spec = importlib.util.spec_from_file_location("bench_plan", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    checked = []
    monkeypatch.setattr(bench, "make_plan", lambda *a, **k: None)  # the timed and planned work is not this test's
    monkeypatch.setattr(bench, "timing_table", lambda repeats: (Table(), True))
    monkeypatch.setattr(bench, "quality_table", lambda optimizer, dp: checked.append(optimizer) or (Table(), True))
    monkeypatch.setattr(sys, "argv", ["bench_plan.py"])
    assert bench.main() == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert checked == list(MATRIX_OPTIMIZERS)
    assert f"({', '.join(checked)})" in " ".join(last.split()), last
