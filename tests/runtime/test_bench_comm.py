"""benchmarks/bench_comm.py's columns time the routes they name: "a2a" the all-to-all (`exact`)
route, "loops" a reduce per owner. The runtime's default (`native`) routes a 30/70 split to the
loop, so a column on the default Comm timed the loop twice."""

from __future__ import annotations

from canzona.reductions import EXACT, LOOPS, bucket_route
from tests.scripts import load_script


def test_columns_measure_their_routes(one_rank, monkeypatch) -> None:
    bench = load_script("benchmarks/bench_comm.py", "bench_comm")
    seen = []
    monkeypatch.setattr(bench, "_measure", lambda comm, loops, *rest: seen.append((comm, loops)) or [])
    bench.worker(0, 1, [10], 0.3, 1)
    (a2a, loops), = seen
    split = [3, 7]  # the benchmark's default 30/70 split
    assert bucket_route(a2a.reduce_scatter_impl, split) == EXACT
    assert bucket_route(loops.reduce_scatter_impl, split) == LOOPS
