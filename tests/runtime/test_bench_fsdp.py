"""benchmarks/bench_fsdp.py end to end, as a user runs it: canzona's FSDP optimizer step against
`muon_fsdp2.Muon` on the same fully_shard model, 2 gloo ranks, one measured round on a one-layer
model. Checked: it exits 0, both sides put the same parameters on Muon, muon_fsdp2's Newton-Schulz
ran eager (no frame compiled), and the ratio and the parameter difference are printed. No timing
is checked (one round on a shared machine means nothing)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("muon_fsdp2")

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # spawns gloo ranks; a benchmark's smoke run

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_fsdp.py"


def test_bench_fsdp_runs_and_prints_the_ratio() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--ranks", "2", "--rounds", "1", "--warmup", "1",
                          "--hidden", "64", "--head-dim", "16", "--layers", "1", "--vocab", "256"],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "the two sides put the same parameters on Muon" in out.stdout, out.stdout
    assert "torch.compile was used" not in out.stdout, out.stdout
    m = re.search(r"2 ranks: canzona / muon_fsdp2 = (\d+\.\d+) \(median step [\d.]+ / [\d.]+ ms, "
                  r"max \|p_a - p_b\| (\S+)\)", out.stdout)
    assert m, out.stdout
    assert float(m.group(1)) > 0
    diff = float(m.group(2))
    assert diff == diff  # printed and finite-looking (NaN would mean a broken side); its size is not checked
