"""Simulator collective model (docs/design.md §9.2) against its closed forms, and cluster placement."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canzona.errors import SpecError
from canzona.hardware import bus_factor, load_profile
from canzona.reductions import PADDING_LIMIT, REDUCE_SCATTER_IMPLS
from sim import nccl
from sim.collectives import (
    OPS,
    CollectiveCost,
    all_gather_v_cost,
    all_to_all_cost,
    bus_bandwidth,
    collective_cost,
    reduce_scatter_v_cost,
)
from sim.topology import Cluster, GroupGeometry

HW = load_profile("h100-sxm")
NODE = HW.node.gpus

# Figures of the h100-sxm profile (docs/design.md §4.5, §9.2) the closed forms below are built from.
BASE = 8.4e-6
NVL_STEP = 3.4e-6
NET_STEP = 14e-6
RING = 370e9
NVLS = 480e9
NIC = 48e9


def test_profile_numbers_used_here_are_the_shipped_ones():
    assert HW.nccl.base_latency_s == BASE
    assert HW.nccl.nvlink_step_latency_s == NVL_STEP
    assert HW.nccl.network_step_latency_s == NET_STEP
    assert HW.node.nvlink_ring_busbw == RING
    assert HW.node.nvls_allreduce_busbw == NVLS
    assert HW.network.nic_busbw == NIC
    assert NODE == 8


def intra(n: int) -> GroupGeometry:
    return GroupGeometry(n, 1, n)


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)


# --- NCCL's algorithm / protocol selection --------------------------------------------------


def ring_simple(op: str, n: int, nodes: int) -> nccl.Choice:
    return next(c for c in nccl.candidates(op, n, nodes, n // nodes, HW)
                if (c.algorithm, c.protocol) == (nccl.RING, nccl.SIMPLE))


@pytest.mark.parametrize("op,n,nodes,steps,net_steps", [
    ("reduce-scatter", 8, 1, 7, 0),
    ("all-gather", 32, 4, 31, 3),
    ("reduce-scatter", 32, 32, 31, 31),
    ("all-reduce", 8, 1, 14, 0),
    ("all-reduce", 64, 8, 126, 16),  # NCCL counts 2 nNodes network steps for a ring all-reduce
])
def test_ring_simple_latency_charges_network_latency_only_on_steps_that_cross_nodes(op, n, nodes, steps, net_steps):
    intra_step = NVL_STEP if nodes == 1 else max(NVL_STEP, 3e-6)  # NCCL floors it at 3x the net overhead
    want = BASE + (steps - net_steps) * intra_step + net_steps * NET_STEP
    assert close(ring_simple(op, n, nodes).latency_s, want)


@pytest.mark.parametrize("op", ["all-reduce", "reduce-scatter", "all-gather"])
@pytest.mark.parametrize("geo", [GroupGeometry(8, 1, 8), GroupGeometry(32, 32, 1), GroupGeometry(64, 8, 8),
                                 GroupGeometry(2, 1, 2), GroupGeometry(1024, 128, 8)])
@pytest.mark.parametrize("size", [64.0, 4096.0, 1e6, 1e8, 4e9])
def test_the_cheapest_candidate_is_chosen(op, geo, size):
    c = collective_cost(op, size, geo, HW)
    others = [nccl.sized(x, op, size, geo.size, geo.nodes).seconds(op, size, geo.size)
              for x in nccl.candidates(op, geo.size, geo.nodes, geo.per_node, HW)]
    assert c.seconds <= min(others) * (1 + 1e-12)
    assert c.seconds > 0


def test_small_messages_take_ll_large_ones_full_bandwidth():
    small = collective_cost("all-gather", 4096.0, intra(8), HW)
    assert small.algorithm == "ring/LL"
    large = collective_cost("all-gather", 4e9, intra(8), HW)
    assert large.algorithm in ("ring/Simple", "nvls/Simple")
    assert close(large.transfer_s, 4e9 * 7 / 8 / RING)
    ar = collective_cost("all-reduce", 4e9, intra(8), HW)
    assert ar.algorithm == "nvls/Simple" and close(ar.transfer_s, 4e9 * 2 * 7 / 8 / NVLS)


def test_a_1mb_collective_across_nodes_costs_far_less_than_every_step_at_network_latency():
    """The audit's finding: charging every ring step the network latency priced a 1 MB collective
    2x-9x above NCCL's own model."""
    for geo in (GroupGeometry(32, 4, 8), GroupGeometry(64, 8, 8), GroupGeometry(256, 32, 8)):
        for op in ("reduce-scatter", "all-gather", "all-reduce"):
            steps = 2 * (geo.size - 1) if op == "all-reduce" else geo.size - 1
            old = BASE + steps * NET_STEP + 1e6 * bus_factor(op, geo.size) / bus_bandwidth(op, geo, HW)
            assert collective_cost(op, 1e6, geo, HW).seconds < old / 2


def test_all_reduce_across_many_nodes_uses_a_tree_for_medium_sizes():
    geo = GroupGeometry(128, 128, 1)
    assert collective_cost("all-reduce", 1e6, geo, HW).algorithm.startswith("tree/")
    assert collective_cost("all-reduce", 1e10, geo, HW).algorithm.startswith("ring/")


def test_dp_group_of_tp8_layout_uses_one_nic():
    """256 GPUs at TP 8: the DP group has one GPU on each of 32 nodes, so its bus is one NIC."""
    cl = Cluster(256, 8, NODE)
    geo = cl.dp_geometry()
    assert (geo.size, geo.nodes, geo.per_node) == (32, 32, 1)
    rs = collective_cost("reduce-scatter", 2.5e9, geo, HW)
    assert rs.link == "network" and rs.algorithm == "ring/Simple"
    assert close(rs.latency_s, BASE + 31 * NET_STEP)
    assert close(rs.transfer_s, 2.5e9 * 31 / 32 / NIC)
    assert close(collective_cost("all-gather", 2.5e9, geo, HW).seconds, rs.seconds)


def test_cross_node_bandwidth_scales_with_members_per_node_and_is_capped_by_nvlink():
    # TP 2 on 16 GPUs: DP group of 8 has 4 members on each of 2 nodes -> 4 NICs.
    geo = Cluster(16, 2, NODE).dp_geometry()
    assert (geo.size, geo.nodes, geo.per_node) == (8, 2, 4)
    for op in ("all-reduce", "reduce-scatter", "all-gather"):
        assert close(bus_bandwidth(op, geo, HW), 4 * NIC)
    # TP 1 on 16 GPUs: 8 members per node -> 8 * 48 = 384 GB/s, capped by the NVLink ring figure.
    geo1 = Cluster(16, 1, NODE).dp_geometry()
    assert 8 * NIC > RING
    for op in ("all-reduce", "reduce-scatter", "all-gather"):
        assert close(bus_bandwidth(op, geo1, HW), RING)
    assert close(ring_simple("reduce-scatter", 16, 2).busbw, RING)


# --- all-to-all: hierarchical -----------------------------------------------------------------


def test_all_to_all_inside_a_node_pays_one_step():
    c = collective_cost("all-to-all", 1e8, intra(8), HW)
    assert close(c.latency_s, BASE + NVL_STEP)
    assert close(c.transfer_s, 1e8 * 7 / 8 / RING)


def test_all_to_all_across_nodes_splits_nvlink_and_nic_bytes():
    """16 GPUs on 2 nodes: 7 of a rank's 15 peers are on its node (NVLink), 8 are not (its NIC)."""
    geo = Cluster(16, 1, NODE).dp_geometry()
    c = collective_cost("all-to-all", 1.6e9, geo, HW)
    out = 1.6e9 * 15 / 16
    assert c.link == "network"
    assert close(c.latency_s, BASE + NET_STEP)
    assert close(c.transfer_s, max(out * 7 / 15 / RING, out * 8 / 15 / NIC))
    assert c.transfer_s < out / NIC  # the old model ran every byte at NIC speed
    # one GPU per node: everything crosses
    one = collective_cost("all-to-all", 1e9, GroupGeometry(4, 4, 1), HW)
    assert close(one.transfer_s, 1e9 * 3 / 4 / NIC)


def test_uneven_all_to_all_pays_the_busiest_port():
    geo = intra(4)
    c = all_to_all_cost([1e6, 3e6, 2e6, 0], [2e6, 2e6, 1e6, 1e6], geo, HW)
    assert close(c.latency_s, BASE + NVL_STEP)
    assert close(c.transfer_s, 3e6 / RING)
    c2 = all_to_all_cost([1e6, 1e6, 1e6, 1e6], [0, 5e6, 0, 0], geo, HW)
    assert close(c2.transfer_s, 5e6 / RING)
    cross = all_to_all_cost([1e6, 1e6], [1e6, 1e6], GroupGeometry(2, 2, 1), HW)
    assert cross.link == "network"
    assert close(cross.seconds, BASE + NET_STEP + 1e6 / NIC)
    # explicit off-node bytes: 1 MB over NVLink and 1 MB over the NIC, the NIC decides
    mixed = all_to_all_cost([2e6, 0], [0, 2e6], GroupGeometry(2, 1, 2), HW, [1e6, 0], [0, 1e6])
    assert close(mixed.transfer_s, 1e6 / NIC)


# --- uneven collectives, as the runtime runs them ---------------------------------------------


def uneven(op, segments, geo, impl="native"):
    if op == "reduce-scatter":
        return reduce_scatter_v_cost(segments, geo, HW, impl)
    return all_gather_v_cost(segments, geo, HW)


@pytest.mark.parametrize("op", ["reduce-scatter", "all-gather"])
@pytest.mark.parametrize("impl", [i for i in REDUCE_SCATTER_IMPLS if i != "exact"])
def test_even_segments_are_the_even_collective(op, impl):
    geo = Cluster(256, 8, NODE).dp_geometry()
    assert uneven(op, [3e6] * 32, geo, impl) == collective_cost(op, 3e6 * 32, geo, HW)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 10**9), min_size=2, max_size=32).filter(lambda s: len(set(s)) > 1), st.booleans())
def test_each_reduce_scatter_route_is_priced_as_the_runtime_runs_it(segments, cross):
    n = len(segments)
    geo = GroupGeometry(n, n, 1) if cross else GroupGeometry(n, 1, n)
    hbm = HW.gpu.hbm_bytes_per_s
    total, widest = sum(segments), max(segments)
    padded = reduce_scatter_v_cost(segments, geo, HW, "padded")
    even = collective_cost("reduce-scatter", n * widest, geo, HW)
    assert (padded.latency_s, padded.transfer_s) == (even.latency_s, even.transfer_s)
    assert close(padded.local_s, (total + (n + 2) * widest) / hbm)  # the padded copy in, the sum out
    assert padded.seconds >= collective_cost("reduce-scatter", total, geo, HW).seconds - 1e-18
    parts = [collective_cost("reduce", x, geo, HW) for x in segments if x > 0]
    loops = reduce_scatter_v_cost(segments, geo, HW, "loops")
    assert close(loops.seconds, sum(c.seconds for c in parts))
    assert close(loops.latency_s, sum(c.latency_s for c in parts))  # every grouped operation's latency
    exact = reduce_scatter_v_cost(segments, geo, HW, "exact")  # one all-to-all, then the owner's sum
    a2a = all_to_all_cost([total - x for x in segments], [x * (n - 1) for x in segments], geo, HW)
    assert (exact.latency_s, exact.transfer_s) == (a2a.latency_s, a2a.transfer_s)
    assert close(exact.local_s, (n + 2) * widest / hbm)
    native = reduce_scatter_v_cost(segments, geo, HW, "native")
    assert native == (padded if n * widest - total <= PADDING_LIMIT * total else loops)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 10**9), min_size=2, max_size=32).filter(lambda s: len(set(s)) > 1))
def test_an_uneven_all_gather_is_a_broadcast_per_owner(segments):
    geo = GroupGeometry(len(segments), 1, len(segments))
    parts = [collective_cost("broadcast", x, geo, HW) for x in segments if x > 0]
    assert close(all_gather_v_cost(segments, geo, HW).seconds, sum(c.seconds for c in parts))


def test_loops_beat_padding_when_one_segment_dwarfs_the_rest():
    """canzona's owners hold whole matrices: one 64 MB segment among small ones is padded to
    n x 64 MB by an even collective, while a loop of reduces moves each byte once; native takes
    the loop."""
    geo = Cluster(1024, 8, NODE).dp_geometry()
    segments = [64e6] + [0.0] * 127
    loops = reduce_scatter_v_cost(segments, geo, HW, "loops")
    assert loops.seconds < reduce_scatter_v_cost(segments, geo, HW, "padded").seconds / 10
    assert reduce_scatter_v_cost(segments, geo, HW, "native") == loops


def test_unknown_reduce_scatter_is_one_line():
    with pytest.raises(SpecError, match="unknown reduce_scatter 'magic'"):
        reduce_scatter_v_cost([1, 2], intra(2), HW, "magic")


# --- basics -----------------------------------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
def test_bus_factors(op):
    for n in (2, 3, 8, 64):
        if op == "all-reduce":
            expected = 2 * (n - 1) / n
        elif op in ("broadcast", "reduce"):
            expected = 1.0
        else:
            expected = (n - 1) / n
        assert close(bus_factor(op, n), expected)
    assert bus_factor(op, 1) == 0.0


@pytest.mark.parametrize("op", OPS)
def test_trivial_collectives_cost_nothing(op):
    assert collective_cost(op, 1e9, GroupGeometry(1, 1, 1), HW) == CollectiveCost(0.0, 0.0, "none")
    assert collective_cost(op, 0.0, intra(8), HW).seconds == 0.0
    assert collective_cost(op, 0.0, Cluster(256, 8, NODE).dp_geometry(), HW).seconds == 0.0
    if op in ("reduce-scatter", "all-gather"):
        for impl in REDUCE_SCATTER_IMPLS:
            assert uneven(op, [], intra(4), impl).seconds == 0.0
            assert uneven(op, [0, 0, 0, 0], intra(4), impl).seconds == 0.0
            assert uneven(op, [5e6], GroupGeometry(1, 1, 1), impl).seconds == 0.0


def test_all_to_all_cost_trivial_cases():
    assert all_to_all_cost([1e6], [1e6], GroupGeometry(1, 1, 1), HW).seconds == 0.0
    assert all_to_all_cost([0, 0], [0, 0], intra(2), HW).seconds == 0.0


def test_unknown_collective_is_rejected():
    with pytest.raises(ValueError):
        collective_cost("gather", 1e6, intra(2), HW)
    with pytest.raises(ValueError):
        bus_factor("scatter", 4)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(OPS), st.sampled_from([GroupGeometry(4, 1, 4), GroupGeometry(8, 1, 8),
                                              GroupGeometry(32, 32, 1), GroupGeometry(64, 8, 8)]),
       st.floats(1.0, 1e10), st.floats(1.0, 1e10))
def test_cost_is_monotone_in_bytes(op, geo, a, b):
    lo, hi = sorted((a, b))
    assert collective_cost(op, lo, geo, HW).seconds <= collective_cost(op, hi, geo, HW).seconds * (1 + 1e-12)


# --- cluster placement ------------------------------------------------------------------------


@pytest.mark.parametrize("gpus,tp", [(8, 1), (16, 2), (32, 4), (64, 8), (256, 8), (4, 2), (2, 2)])
def test_rank_order_is_tp_fastest_and_tp_groups_stay_in_a_node(gpus, tp):
    cl = Cluster(gpus, tp, NODE)
    assert cl.dp == gpus // tp
    assert cl.nodes == max(1, gpus // NODE)
    seen = set()
    for i in range(cl.dp):
        group = cl.tp_group(i)
        assert group == list(range(i * tp, (i + 1) * tp))
        assert len({cl.node_of(r) for r in group}) == 1
        assert cl.geometry(group) == GroupGeometry(tp, 1, tp)
        seen |= set(group)
    assert seen == set(range(gpus))
    for t in range(tp):
        assert cl.dp_group(t) == [i * tp + t for i in range(cl.dp)]
    assert cl.tp_geometry() == GroupGeometry(tp, 1, tp)
    assert cl.rank(cl.dp - 1, tp - 1) == gpus - 1


@pytest.mark.parametrize("gpus", [16, 64, 256, 1024])
def test_dp_group_at_tp8_has_one_gpu_per_node(gpus):
    cl = Cluster(gpus, 8, NODE)
    for t in range(8):
        group = cl.dp_group(t)
        nodes = [cl.node_of(r) for r in group]
        assert sorted(nodes) == list(range(cl.nodes))
    assert cl.dp_geometry() == GroupGeometry(gpus // 8, gpus // 8, 1)
    assert cl.dp_geometry().crosses_nodes


def test_single_node_dp_group_does_not_cross_nodes():
    cl = Cluster(8, 2, NODE)
    assert cl.dp_geometry() == GroupGeometry(4, 1, 4)
    assert not cl.dp_geometry().crosses_nodes


@pytest.mark.parametrize("gpus,tp,needle", [
    (100, 8, "not divisible"),  # gpus not divisible by tp
    (12, 8, "not divisible"),
    (32, 16, "inside a node"),  # tp larger than a node
    (24, 3, "inside a node"),  # tp does not divide the node
    (12, 4, "whole nodes"),  # partial node
    (20, 2, "whole nodes"),
    (0, 1, ">= 1"),
    (8, 0, ">= 1"),
])
def test_bad_layouts_are_spec_errors(gpus, tp, needle):
    with pytest.raises(SpecError) as e:
        Cluster(gpus, tp, NODE)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


# --- a calibrated profile's measured collectives ----------------------------------------------


def test_measured_collectives_replace_the_model_where_measured():
    from dataclasses import replace as dc_replace

    from canzona.hardware import CollectiveTable

    table = CollectiveTable("gloo", rows=(("all-reduce", 2, 1000, 1e-4), ("all-reduce", 2, 3000, 3e-4)),
                            fits=(("all-reduce", 2, 5e-5, 1e7),))
    hw = dc_replace(HW, collectives=table)
    geo = GroupGeometry(2, 1, 2)
    assert close(collective_cost("all-reduce", 2000, geo, hw).seconds, 2e-4)  # between measured sizes
    assert close(collective_cost("all-reduce", 1e6, geo, hw).seconds, 5e-5 + 1e6 * 1.0 / 1e7)  # the fitted line
    assert collective_cost("all-reduce", 2000, geo, hw).algorithm == "measured (gloo)"
    # not measured: the model
    assert collective_cost("all-gather", 2000, geo, hw) == collective_cost("all-gather", 2000, geo, HW)
    assert collective_cost("all-reduce", 2000, intra(4), hw) == collective_cost("all-reduce", 2000, intra(4), HW)
