"""benchmarks/bench_sim.py (`make bench`): its wall-time table runs the policies `compare` runs for
its optimizer (`compared_policies`, through `with_policy`), not every step policy: zero1 under
Muon was refused ("policy zero1 runs elementwise optimizers") and crashed the script."""

from __future__ import annotations

from dataclasses import replace

from sim.simulate import SimConfig, compared_policies
from sim.workload import Workload
from tests.scripts import load_script


def _bench_sim():
    return load_script("benchmarks/bench_sim.py", "bench_sim")


def test_wall_table_runs_the_compared_policies(monkeypatch) -> None:
    bench = _bench_sim()
    small = SimConfig(model="qwen3-0.6b", gpus=8, tp=2, optimizer="muon", workload=Workload(seq_len=256, global_batch=8))
    monkeypatch.setattr(bench, "PAPER_SETUP", small)
    monkeypatch.setattr(bench, "WALL_BARS", {8: 1e6})
    monkeypatch.setattr(bench, "Workload", lambda **kw: replace(small.workload, global_batch=8))
    table, ok = bench.wall_table()
    assert ok
    policies = [str(cell) for cell in table.columns[1].cells]
    assert policies == [bench.policy_label(small, p) for p in compared_policies("muon")]
    assert any("adamw" in p for p in policies)  # the AdamW baseline beside the matrix policies
