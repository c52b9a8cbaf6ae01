"""Communication kernels take SMs from compute (`sim.engine`, `sim.comm_sms`, docs/design.md §9.1):
a compute kernel overlapped with a collective that holds `k` of `sms` SMs runs at `(sms - k) / sms`
of its rate, and pays nothing when nothing overlaps it."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canzona.errors import SpecError
from sim.collectives import FREE, CollectiveCost
from sim.comm_sms import (
    NETWORK_SMS,
    NVLINK_RING_SMS,
    NVLS_SMS,
    TPOverlapSMs,
    nccl_sms,
)
from sim.engine import Engine
from sim.options import RunOptions
from sim.simulate import SimConfig, simulate
from sim.userbuffers import DEFAULT_UB_CONFIG, block_overlaps
from sim.workload import Workload

SMS = 100


def approx(x: float) -> object:
    return pytest.approx(x, rel=1e-12, abs=1e-12)


def _spans(eng: Engine) -> dict[str, list]:
    out: dict[str, list] = defaultdict(list)
    for s in eng.spans:
        out[s.name].append(s)
    return out


def _overlapped(held: int, sms: int = SMS, work: float = 10.0, comm: float = 4.0, at: float = 0.0) -> Engine:
    """`work` seconds of compute on rank 0 from 0; a collective over ranks 0 and 1 holding `held`
    SMs for `comm` seconds from `at`."""
    eng = Engine(sms=sms)
    eng.compute(0, "gemm", work)
    gate = eng.env.timeout(at)
    eng.collective("rs", [0, 1], CollectiveCost(0.0, comm, "nvlink"), "tp-comm", {0: [gate], 1: [gate]}, sms=held)
    eng.run()
    return eng


@pytest.mark.parametrize("held", [0, 10, 25, 50, 99])
def test_overlapped_compute_pays_the_occupied_sms(held):
    """4 s of a collective on `held` of 100 SMs under a 10 s kernel: the kernel does 4 (100 -
    held) / 100 s of work meanwhile and ends 4 held / 100 s late; the collective is not slowed."""
    eng = _overlapped(held)
    s = _spans(eng)
    assert s["gemm"][0].end == approx(10.0 + 4.0 * held / SMS)
    for c in s["rs"]:
        assert (c.start, c.end) == (approx(0.0), approx(4.0))


def test_cost_is_in_proportion_to_the_sms_and_the_overlap():
    late = {held: _spans(_overlapped(held))["gemm"][0].end - 10.0 for held in (8, 16, 32)}
    assert late[16] == pytest.approx(2 * late[8]) and late[32] == pytest.approx(4 * late[8])
    half = _spans(_overlapped(16, at=8.0))["gemm"][0]  # the collective starts 8 s in: 2 s of overlap at 84%
    assert half.end == approx(8.0 + 2.0 / 0.84)


def test_collective_outlasting_the_kernel_slows_all_of_it():
    eng = _overlapped(20, work=2.0, comm=5.0)
    assert _spans(eng)["gemm"][0].end == approx(2.0 / 0.8)


def test_nothing_overlapping_changes_nothing():
    """Compute, then the collective, then compute that waits for it: the same spans, bit for bit,
    as an engine without SM sharing."""
    def run(sms: int) -> list:
        eng = Engine(sms=sms)
        done = eng.compute(0, "gemm", 3.0)
        synced = eng.collective("ar", [0, 1], CollectiveCost(1e-5, 2.0, "network", "ring/Simple"), "dp-comm",
                                {0: [done], 1: []})
        eng.compute(0, "next", 1.5, after=[synced[0]])
        eng.compute(1, "other", 0.5, after=[synced[1]])
        eng.run()
        return sorted((s.rank, s.stream, s.name, s.start, s.end) for s in eng.spans)

    shared = run(132)
    assert shared == run(0)
    assert [(name, start, end) for _, _, name, start, end in shared if name == "next"] == [("next", 3.0 + 1e-5 + 2.0,
                                                                                              3.0 + 1e-5 + 2.0 + 1.5)]


def test_run_ends_with_the_last_kernel():
    """A collective that ends mid-kernel speeds it up: its first timeout (at the slow rate) is left
    in SimPy's queue, and the run still ends when the kernel does."""
    eng = Engine(sms=SMS)
    eng.compute(0, "gemm", 10.0)
    eng.collective("rs", [0, 1], CollectiveCost(0.0, 4.0, "nvlink"), "tp-comm", sms=50)
    assert eng.run() == approx(12.0)
    assert eng.env.now > 12.0  # the stale timeout: 10 s of work at half rate, 20 s


def test_copy_engine_transfer_takes_no_sm():
    assert _spans(_overlapped(0))["gemm"][0].end == approx(10.0)


def test_engine_without_sms_ignores_held_counts():
    eng = Engine()
    eng.compute(0, "gemm", 10.0)
    eng.collective("rs", [0, 1], CollectiveCost(0.0, 4.0, "nvlink"), "tp-comm", sms=64)
    eng.run()
    assert _spans(eng)["gemm"][0].end == approx(10.0)


def test_default_is_nccls_channel_count():
    eng = Engine(sms=132)
    eng.compute(0, "gemm", 10.0)
    eng.collective("ar", [0, 1], CollectiveCost(0.0, 4.0, "nvlink", "ring/Simple"), "dp-comm")
    eng.run()
    assert _spans(eng)["gemm"][0].end == approx(10.0 + 4.0 * NVLINK_RING_SMS / 132)


def test_nccl_channel_counts():
    assert nccl_sms(CollectiveCost(1e-5, 1e-3, "nvlink", "ring/LL128")) == NVLINK_RING_SMS == 24
    assert nccl_sms(CollectiveCost(1e-5, 1e-3, "nvlink", "nvls/Simple")) == NVLS_SMS == 16
    assert nccl_sms(CollectiveCost(1e-5, 1e-3, "network", "nvls-tree/Simple")) == NVLS_SMS
    assert nccl_sms(CollectiveCost(1e-5, 1e-3, "network", "ring/Simple")) == NETWORK_SMS == 16
    assert nccl_sms(CollectiveCost(1e-5, 1e-3, "network", "p2p")) == 2  # a send to one network peer
    assert nccl_sms(CollectiveCost(1e-5, 1e-3, "network", "p2p"), 8) == 14  # an all-to-all over 8: 2 a peer
    assert nccl_sms(CollectiveCost(1e-5, 1e-3, "network", "p2p"), 64) == 32  # NCCL's channel cap
    assert nccl_sms(CollectiveCost(1e-5, 1e-3, "nvlink", "p2p"), 8) == NVLINK_RING_SMS
    assert nccl_sms(FREE) == 0


def test_userbuffers_configuration_is_the_h100_recipes():
    """userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192 (Megatron-Bridge), the default."""
    assert DEFAULT_UB_CONFIG == "userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192"
    a, m = block_overlaps(DEFAULT_UB_CONFIG)
    assert (a.forward_reduce_scatter, a.backward_gather, a.backward_reduce_scatter) == (24, 4, 24)
    assert (m.forward_reduce_scatter, m.backward_gather, m.backward_reduce_scatter) == (16, 2, 4)
    # proj_fprop and fc2_fprop: pipeline, num_splits 4, set_sm_margin
    assert (a.forward_sm_margin, a.forward_splits) == (m.forward_sm_margin, m.forward_splits) == (True, 4)
    with pytest.raises(SpecError, match="forward_splits"):
        TPOverlapSMs(forward_reduce_scatter=16, backward_gather=2, backward_reduce_scatter=4, forward_splits=0)


def _margin_run(margin: int, held: int, sms: int = SMS) -> Engine:
    """A 10 s kernel launched without `margin` SMs, beside a 4 s collective holding `held`."""
    eng = Engine(sms=sms)
    eng.compute(0, "gemm", 10.0, margin=margin)
    eng.collective("rs", [0, 1], CollectiveCost(0.0, 4.0, "nvlink"), "tp-comm", sms=held)
    eng.run()
    return eng


def test_a_kernel_launched_with_a_margin_runs_on_the_rest_all_along():
    """TE's set_sm_margin: the GEMM on 100 - 24 SMs for its whole length; the reduce-scatter
    beside it runs on the margin (holding no more); another kernel's SMs come off the rest."""
    assert _spans(_margin_run(24, 0))["gemm"][0].end == approx(10.0 / 0.76)
    both = _spans(_margin_run(24, 10))["gemm"][0].end  # 4 s at 66%, then the rest at 76%
    assert both == approx(4.0 + (10.0 - 4.0 * 0.66) / 0.76)
    assert _spans(_margin_run(0, 24))["gemm"][0].end == approx(10.0 + 4.0 * 0.24)  # no margin: as before
    assert _spans(_margin_run(24, 0, sms=0))["gemm"][0].end == approx(10.0)  # no SM sharing modelled


def test_pipeline_reduce_scatter_follows_its_last_chunk(with_sharing):
    """Forward at TP 2: the row GEMMs run beside the first chunks' reduce-scatter and the last
    chunk's reduce-scatter starts once they end; the block then waits for it."""
    spans = [s for s in with_sharing.spans if s.rank == 0 and s.phase == "A"]
    by = {s.name: s for s in spans}
    last = by["mb0 fwd layer 0.1 last"]
    head = by["mb0 fwd layer 0.1 reduce-scatter"]
    tail = by["mb0 fwd layer 0.1 reduce-scatter (last chunk)"]
    assert head.start == approx(last.start) and tail.start >= last.end - 1e-12
    assert head.end - head.start > tail.end - tail.start  # three chunks against one
    after = min((s for s in spans if s.kind == "compute" and s.start >= last.end and s.name.startswith("mb0 fwd")),
                key=lambda s: s.start)
    assert after.start >= tail.end - 1e-12
    assert not any(s.name.endswith("(last chunk)") for s in spans if " bwd " in s.name)  # backward: bulk


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 5.0), st.floats(0.0, 3.0), st.integers(0, 60)), max_size=6),
       st.lists(st.floats(0.0, 3.0), min_size=1, max_size=6))
def test_work_is_conserved_under_any_overlap(colls, kernels):
    """Invariants: each kernel's work, integrated at the rate the SMs left give it over its span,
    is its requested seconds; kernels never finish earlier than alone; collectives keep their own
    times; every SM is given back at the end."""
    eng = Engine(sms=SMS)
    for i, seconds in enumerate(kernels):
        eng.compute(0, f"k{i}", seconds)
    for j, (at, seconds, held) in enumerate(colls):
        gate = eng.env.timeout(at)
        # all latency: concurrent collectives do not share it, so each keeps its own time
        eng.collective(f"c{j}", [0, 1], CollectiveCost(seconds, 0.0, "nvlink"), f"s{j}", {0: [gate], 1: [gate]}, sms=held)
    eng.run()
    comm = [(s.start, s.end, colls[int(s.name[1:])][2]) for s in eng.spans if s.kind == "comm" and s.rank == 0]
    for s in (s for s in eng.spans if s.kind == "compute"):
        seconds = kernels[int(s.name[1:])]
        cuts = sorted({s.start, s.end} | {t for a, b, _ in comm for t in (a, b) if s.start < t < s.end})
        work = 0.0
        for a, b in zip(cuts, cuts[1:]):
            mid = (a + b) / 2
            held = sum(h for c0, c1, h in comm if c0 <= mid < c1)
            work += (b - a) * max(SMS - held, 1) / SMS
        assert work == pytest.approx(seconds, rel=1e-9, abs=1e-9)
        assert s.end - s.start >= seconds - 1e-9
    for s in eng.spans:
        if s.kind == "comm":
            j = int(s.name[1:])
            assert s.end - s.start == pytest.approx(colls[j][1], abs=1e-9)
    assert all(v == 0 for v in eng._held.values())
    assert not any(eng._kernels.values())


CFG = SimConfig(model="qwen3-1.7b", gpus=8, tp=2, workload=Workload(seq_len=512, global_batch=16),
                options=RunOptions(overlap_param_gather=False))


@pytest.fixture
def with_sharing():
    return simulate(CFG)


@pytest.fixture
def at_full_rate(full_rate_compute):
    return simulate(CFG)


def test_tp_overlap_now_costs_compute_time(with_sharing, at_full_rate):
    """An iteration with TP overlap: the userbuffers and NCCL kernels' SMs lengthen the compute
    spans; an engine without SM sharing gives the old times. (Fixtures in this order: the shared
    run is made before `full_rate_compute` patches the engine.)"""
    shared, free = with_sharing, at_full_rate

    def compute(r) -> float:
        return sum(s.end - s.start for s in r.spans if s.kind == "compute" and s.rank == 0 and s.phase == "A")

    assert compute(shared) > compute(free)
    assert shared.iteration_time_s > free.iteration_time_s
    assert shared.iteration_time_s < free.iteration_time_s * 1.1  # a few percent, not a different machine
