"""Fluid link sharing (`sim.fabric.Fabric`) and CUDA-like streams / collectives (`sim.engine.Engine`)."""

from __future__ import annotations

import gc
import math
from collections import defaultdict

import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.collectives import CollectiveCost
from sim.engine import Engine, cyclic_gc_paused
from sim.fabric import Fabric

W = 2.0  # work of one transfer, seconds at full rate


def approx(x: float) -> object:
    return pytest.approx(x, rel=1e-12, abs=1e-12)


class Recorder:
    """Starts transfers at given times and records when each finishes."""

    def __init__(self) -> None:
        self.env = simpy.Environment()
        self.fabric = Fabric(self.env)
        self.ends: dict[str, float] = {}

    def add(self, name: str, links: list[str], work: float, at: float = 0.0) -> None:
        def proc():
            if at > 0:
                yield self.env.timeout(at)
            yield self.fabric.transfer(links, work)
            self.ends[name] = self.env.now

        self.env.process(proc())

    def run(self) -> dict[str, float]:
        self.env.run()
        return self.ends


# --- fabric -----------------------------------------------------------------------------------


def test_lone_transfer_finishes_at_its_work():
    r = Recorder()
    r.add("a", ["x"], W)
    assert r.run() == {"a": approx(W)}


def test_two_equal_transfers_share_the_link():
    r = Recorder()
    r.add("a", ["x"], W)
    r.add("b", ["x"], W)
    ends = r.run()
    assert ends["a"] == approx(2 * W)
    assert ends["b"] == approx(2 * W)


def test_transfer_joined_halfway():
    r = Recorder()
    r.add("first", ["x"], W)
    r.add("second", ["x"], W, at=W / 2)
    ends = r.run()
    assert ends["first"] == approx(1.5 * W)
    assert ends["second"] == approx(2 * W)


def test_link_is_idle_after_sharing_ends():
    """A transfer started after the others finished runs at full rate again."""
    r = Recorder()
    r.add("a", ["x"], W)
    r.add("b", ["x"], W)
    r.add("c", ["x"], W, at=3 * W)
    ends = r.run()
    assert ends["c"] == approx(4 * W)
    assert r.fabric.active("x") == 0


def test_disjoint_links_do_not_interfere():
    r = Recorder()
    r.add("a", ["x"], W)
    r.add("b", ["y"], W)
    r.add("c", ["z1", "z2"], W)
    ends = r.run()
    assert ends == {"a": approx(W), "b": approx(W), "c": approx(W)}


def test_multi_link_transfer_moves_at_its_most_crowded_links_share():
    r = Recorder()
    r.add("wide", ["x", "y"], W)  # x carries only it, y carries three transfers
    r.add("b", ["y"], W)
    r.add("c", ["y"], W)
    ends = r.run()
    assert ends["wide"] == approx(3 * W)
    assert ends["b"] == approx(3 * W)
    assert ends["c"] == approx(3 * W)


def test_multi_link_transfer_rescheduled_when_its_bottleneck_clears():
    r = Recorder()
    r.add("wide", ["x", "y"], W)  # rate 1/2 while "short" shares y, then 1
    r.add("short", ["y"], W / 2)
    ends = r.run()
    # short: W/2 at rate 1/2 -> ends at W; wide has W/2 left, alone -> ends at 1.5 W
    assert ends["short"] == approx(W)
    assert ends["wide"] == approx(1.5 * W)


def test_duplicate_links_count_once_and_zero_work_is_instant():
    r = Recorder()
    r.add("dup", ["x", "x"], W)
    r.add("zero", ["x"], 0.0)
    r.add("nolinks", [], W)
    ends = r.run()
    assert ends["dup"] == approx(W)
    assert ends["zero"] == 0.0
    assert ends["nolinks"] == 0.0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0.1, 5.0), st.floats(0.0, 5.0)), min_size=1, max_size=6))
def test_single_link_work_is_conserved(flows):
    """On one shared link the total work moves at rate 1 whenever the link is busy: the last transfer
    ends no earlier than sum(work) after the first start, and each ends no earlier than its own
    start plus its work."""
    r = Recorder()
    for i, (work, at) in enumerate(flows):
        r.add(str(i), ["x"], work, at)
    ends = r.run()
    assert len(ends) == len(flows)
    for i, (work, at) in enumerate(flows):
        assert ends[str(i)] >= at + work - 1e-9
    first = min(at for _, at in flows)
    assert max(ends.values()) >= first + sum(w for w, _ in flows) - 1e-9
    # Busy link never idles while work is pending: if every flow starts at once, the last ends at
    # exactly the total work.
    if all(at == flows[0][1] for _, at in flows):
        assert max(ends.values()) == pytest.approx(first + sum(w for w, _ in flows), rel=1e-9)


def processor_sharing(flows: list[tuple[float, float]]) -> list[float]:
    """Reference: one link shared equally by the transfers present (work, start) -> end times."""
    remaining = {i: w for i, (w, _) in enumerate(flows)}
    pending = sorted(range(len(flows)), key=lambda i: flows[i][1])
    active: set[int] = set()
    ends = [0.0] * len(flows)
    now = 0.0
    while pending or active:
        while pending and flows[pending[0]][1] <= now:
            i = pending.pop(0)
            if remaining[i] <= 0:
                ends[i] = now
            else:
                active.add(i)
        if not active:
            now = flows[pending[0]][1]
            continue
        k = len(active)
        t_done = now + min(remaining[i] for i in active) * k
        t_next = flows[pending[0]][1] if pending else math.inf
        t = min(t_done, t_next)
        for i in active:
            remaining[i] -= (t - now) / k
        now = t
        for i in [i for i in active if remaining[i] <= 1e-12]:
            active.discard(i)
            ends[i] = now
    return ends


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.1, 5.0), st.floats(0.0, 5.0)), min_size=1, max_size=6))
def test_single_link_matches_processor_sharing(flows):
    r = Recorder()
    for i, (work, at) in enumerate(flows):
        r.add(str(i), ["x"], work, at)
    ends = r.run()
    want = processor_sharing(flows)
    for i in range(len(flows)):
        assert ends[str(i)] == pytest.approx(want[i], rel=1e-9, abs=1e-9)


# --- engine: streams --------------------------------------------------------------------------


def spans_by_name(eng: Engine) -> dict[str, list]:
    out: dict[str, list] = defaultdict(list)
    for s in eng.spans:
        out[s.name].append(s)
    return out


def test_lone_compute_span():
    eng = Engine()
    eng.compute(0, "k", 1.5)
    assert eng.run() == approx(1.5)
    (s,) = eng.spans
    assert (s.rank, s.stream, s.name, s.kind) == (0, "compute", "k", "compute")
    assert (s.start, s.end) == (0.0, approx(1.5))


def test_stream_keeps_enqueue_order():
    """A later op with no dependencies does not overtake an earlier op that waits on an event."""
    eng = Engine()
    gate = eng.env.timeout(5.0)
    eng.compute(0, "waits", 1.0, after=[gate])
    eng.compute(0, "free", 1.0)
    eng.run()
    s = spans_by_name(eng)
    assert (s["waits"][0].start, s["waits"][0].end) == (approx(5.0), approx(6.0))
    assert (s["free"][0].start, s["free"][0].end) == (approx(6.0), approx(7.0))


def test_other_streams_and_ranks_are_not_blocked():
    eng = Engine()
    gate = eng.env.timeout(5.0)
    eng.compute(0, "waits", 1.0, after=[gate])
    eng.compute(0, "side", 1.0, stream="copy")
    eng.compute(1, "other rank", 1.0)
    eng.run()
    s = spans_by_name(eng)
    assert s["side"][0].start == 0.0
    assert s["other rank"][0].start == 0.0
    assert s["side"][0].stream == "copy"


def test_dependencies_chain_across_ranks():
    eng = Engine()
    a = eng.compute(0, "a", 2.0)
    eng.compute(1, "b", 1.0, after=[a])
    assert eng.run() == approx(3.0)
    assert spans_by_name(eng)["b"][0].start == approx(2.0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["compute", "aux"]),
                          st.floats(0.0, 3.0), st.integers(-1, 20)), min_size=1, max_size=25))
def test_compute_conservation(ops):
    """Every kernel's span lasts exactly its requested seconds; a stream never runs two at once;
    busy time per rank equals the sum of its ops."""
    eng = Engine()
    events = []
    requested: dict[int, float] = defaultdict(float)
    for i, (rank, stream, seconds, dep) in enumerate(ops):
        after = [events[dep]] if 0 <= dep < len(events) else []
        events.append(eng.compute(rank, f"op{i}", seconds, after=after, stream=stream))
        requested[rank] += seconds
    end = eng.run()
    assert len(eng.spans) == len(ops)
    for s in eng.spans:
        i = int(s.name[2:])
        assert s.end - s.start == pytest.approx(ops[i][2], abs=1e-12)
        assert s.end <= end + 1e-12
    for rank, total in requested.items():
        assert sum(s.end - s.start for s in eng.spans if s.rank == rank) == pytest.approx(total, abs=1e-9)
    by_stream: dict[tuple[int, str], list] = defaultdict(list)
    for s in eng.spans:
        by_stream[(s.rank, s.stream)].append(s)
    for spans in by_stream.values():
        spans.sort(key=lambda s: int(s.name[2:]))  # enqueue order
        for prev, nxt in zip(spans, spans[1:]):
            assert nxt.start >= prev.end - 1e-12


# --- engine: collectives ----------------------------------------------------------------------


def test_collective_starts_when_the_last_participant_arrives():
    eng = Engine()
    arrivals = {0: 1.0, 1: 3.0, 2: 2.0}
    pre = {r: eng.compute(r, "pre", t) for r, t in arrivals.items()}
    cost = CollectiveCost(0.5, 2.0, "nvlink")
    done = eng.collective("ar", [0, 1, 2], cost, "comm", {r: [e] for r, e in pre.items()})
    eng.run()
    comm = spans_by_name(eng)["ar"]
    assert len(comm) == 3
    for s in comm:
        assert s.kind == "comm" and s.stream == "comm"
        assert s.start == approx(max(arrivals.values()))
        assert s.end == approx(3.0 + 0.5 + 2.0)
    assert all(e.triggered for e in done.values())


def test_collective_waits_behind_earlier_ops_on_its_stream():
    eng = Engine()
    eng.compute(0, "busy", 4.0, stream="comm")
    eng.collective("c", [0, 1], CollectiveCost(0.0, 1.0, "nvlink"), "comm")
    eng.run()
    for s in spans_by_name(eng)["c"]:
        assert (s.start, s.end) == (approx(4.0), approx(5.0))


def test_concurrent_collectives_on_the_same_links_share_bandwidth():
    eng = Engine()
    cost = CollectiveCost(0.0, W, "nvlink")
    eng.collective("a", [0, 1], cost, "s1")
    eng.collective("b", [0, 1], cost, "s2")
    assert eng.run() == approx(2 * W)
    for name in ("a", "b"):
        for s in spans_by_name(eng)[name]:
            assert s.end == approx(2 * W)


def test_latency_is_not_shared_only_transfer_is():
    eng = Engine()
    cost = CollectiveCost(1.0, W, "nvlink")
    eng.collective("a", [0, 1], cost, "s1")
    eng.collective("b", [0, 1], cost, "s2")
    assert eng.run() == approx(1.0 + 2 * W)


def test_collectives_on_disjoint_ranks_or_different_links_do_not_interfere():
    eng = Engine()
    eng.collective("a", [0, 1], CollectiveCost(0.0, W, "nvlink"), "s")
    eng.collective("b", [2, 3], CollectiveCost(0.0, W, "nvlink"), "s")
    eng.collective("c", [0, 1], CollectiveCost(0.0, W, "network"), "net")  # NIC, not NVLink
    assert eng.run() == approx(W)


def test_collective_sharing_one_rank_is_slowed():
    eng = Engine()
    eng.collective("a", [0, 1], CollectiveCost(0.0, W, "nvlink"), "s1")
    eng.collective("b", [1, 2], CollectiveCost(0.0, W, "nvlink"), "s2")
    eng.run()
    for s in eng.spans:
        assert s.end == approx(2 * W)


def test_free_collective_ends_at_the_arrival():
    eng = Engine()
    pre = eng.compute(0, "pre", 1.25)
    eng.collective("free", [0, 1], CollectiveCost(0.0, 0.0, "none"), "s", {0: [pre]})
    eng.run()
    for s in spans_by_name(eng)["free"]:
        assert (s.start, s.end) == (approx(1.25), approx(1.25))


def test_single_rank_collective_is_just_its_cost():
    eng = Engine()
    eng.collective("solo", [5], CollectiveCost(0.25, 0.5, "network"), "s")
    assert eng.run() == approx(0.75)
    (s,) = eng.spans
    assert s.rank == 5 and math.isclose(s.end - s.start, 0.75)


def test_iteration_ends_with_its_last_op_not_a_stale_timeout():
    """A transfer that sped up (its link's other transfer ended) leaves its interrupted timeout in
    SimPy's queue: B (0 -> 1.5 s) and A (from 0.5 s) share a link; A's first timeout, at half rate,
    was for 2.5 s, but A ends at 2.0 s, and so does the run."""
    eng = Engine()
    cost = CollectiveCost(0.0, 1.0, "nvlink")
    eng.collective("b", [0, 1], cost, "dp-comm")
    gate = eng.env.timeout(0.5)
    eng.collective("a", [0, 1], cost, "tp-comm", after={0: [gate], 1: [gate]})
    assert eng.run() == approx(2.0)
    assert eng.env.now == approx(2.5)  # the clock went on to the stale timeout
    s = spans_by_name(eng)
    assert s["b"][0].end == approx(1.5) and s["a"][0].end == approx(2.0)


# --- the garbage collector --------------------------------------------------------------------


def test_the_collector_is_paused_inside_and_left_as_it_was():
    """`cyclic_gc_paused` turns Python's cyclic collector off inside and restores it after, also
    when the body raises, and leaves it off when it was off (a paused caller's nested simulation)."""
    assert gc.isenabled()
    with cyclic_gc_paused():
        assert not gc.isenabled()
        with cyclic_gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause holds
    assert gc.isenabled()
    with pytest.raises(ValueError), cyclic_gc_paused():
        raise ValueError("a refused layout")
    assert gc.isenabled()
    gc.disable()
    try:
        with cyclic_gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_simulation_runs_with_the_collector_paused(monkeypatch):
    """`sim.simulate.simulate` runs its engine with the collector off (the engine's garbage is freed
    by reference counting; the collector only walked the live spans) and turns it on again after."""
    import sim.simulate as simulate_module
    from sim.simulate import SimConfig, simulate

    seen: list[bool] = []

    class Watched(Engine):
        def run(self) -> float:
            seen.append(gc.isenabled())
            return super().run()

    monkeypatch.setattr(simulate_module, "Engine", Watched)
    simulate(SimConfig(model="qwen3-0.6b", gpus=8, policy="zero1-gather"))
    assert seen and not any(seen)
    assert gc.isenabled()
