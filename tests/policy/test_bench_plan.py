"""benchmarks/bench_plan.py's verdict line names the optimizers it checked: every registered
matrix optimizer (`OPTIMIZERS`), not a list written once for three."""

from __future__ import annotations

import sys

from rich.table import Table

from canzona.optimizers import MATRIX_OPTIMIZERS
from tests.scripts import load_script


def test_the_verdict_names_every_optimizer_checked(monkeypatch, capsys) -> None:
    bench = load_script("benchmarks/bench_plan.py", "bench_plan")
    checked = []
    monkeypatch.setattr(bench, "make_plan", lambda *a, **k: None)  # the timed and planned work is not this test's
    monkeypatch.setattr(bench, "timing_table", lambda repeats: (Table(), True))
    monkeypatch.setattr(bench, "quality_table", lambda optimizer, dp: checked.append(optimizer) or (Table(), True))
    monkeypatch.setattr(sys, "argv", ["bench_plan.py"])
    assert bench.main() == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert checked == list(MATRIX_OPTIMIZERS)
    assert f"({', '.join(checked)})" in " ".join(last.split()), last
