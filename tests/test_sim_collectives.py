"""Simulator collective model (docs/design.md §9.2) against its closed forms, and cluster placement."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canzona.errors import SpecError
from canzona.hardware import load_profile
from sim.collectives import (
    OPS,
    CollectiveCost,
    all_to_all_cost,
    bus_bandwidth,
    bus_factor,
    collective_cost,
    latency,
    uneven_cost,
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


# --- closed forms -----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("size", [1.0, 4096.0, 1e6, 3.7e9])
def test_all_reduce_inside_a_node_is_alpha_plus_ring_over_nvls(n, size):
    c = collective_cost("all-reduce", size, intra(n), HW)
    alpha = BASE + 2 * (n - 1) * NVL_STEP
    assert c.link == "nvlink"
    assert close(c.latency_s, alpha)
    assert close(c.transfer_s, size * 2 * (n - 1) / n / NVLS)
    assert close(c.seconds, alpha + size * 2 * (n - 1) / n / NVLS)


@pytest.mark.parametrize("op", ["reduce-scatter", "all-gather"])
@pytest.mark.parametrize("n", [2, 3, 8])
def test_reduce_scatter_and_all_gather_inside_a_node(op, n):
    size = 123_456_789.0
    c = collective_cost(op, size, intra(n), HW)
    assert c.link == "nvlink"
    assert close(c.latency_s, BASE + (n - 1) * NVL_STEP)
    assert close(c.transfer_s, size * (n - 1) / n / RING)


def test_all_to_all_inside_a_node_pays_one_step():
    size = 1e8
    c = collective_cost("all-to-all", size, intra(8), HW)
    assert close(c.latency_s, BASE + NVL_STEP)
    assert close(c.transfer_s, size * 7 / 8 / RING)


def test_dp_group_of_tp8_layout_uses_one_nic():
    """256 GPUs at TP 8: the DP group has one GPU on each of 32 nodes, so its bus is one NIC."""
    cl = Cluster(256, 8, NODE)
    geo = cl.dp_geometry()
    assert (geo.size, geo.nodes, geo.per_node) == (32, 32, 1)
    n, size = 32, 2.5e9
    ar = collective_cost("all-reduce", size, geo, HW)
    assert ar.link == "network"
    assert close(ar.latency_s, BASE + 2 * (n - 1) * NET_STEP)
    assert close(ar.transfer_s, size * 2 * (n - 1) / n / NIC)
    rs = collective_cost("reduce-scatter", size, geo, HW)
    assert close(rs.latency_s, BASE + (n - 1) * NET_STEP)
    assert close(rs.transfer_s, size * (n - 1) / n / NIC)
    ag = collective_cost("all-gather", size, geo, HW)
    assert close(ag.seconds, rs.seconds)


def test_cross_node_bandwidth_scales_with_members_per_node_and_is_capped_by_nvlink():
    # TP 2 on 16 GPUs: DP group of 8 has 4 members on each of 2 nodes -> 4 NICs.
    geo = Cluster(16, 2, NODE).dp_geometry()
    assert (geo.size, geo.nodes, geo.per_node) == (8, 2, 4)
    for op in ("all-reduce", "reduce-scatter", "all-gather"):
        assert close(bus_bandwidth(op, geo, HW), 4 * NIC)
    # TP 1 on 16 GPUs: 8 members per node -> 8 * 48 = 384 GB/s, capped by the NVLink ring figure.
    geo1 = Cluster(16, 1, NODE).dp_geometry()
    assert geo1.per_node == 8
    assert 8 * NIC > RING
    for op in ("all-reduce", "reduce-scatter", "all-gather"):
        assert close(bus_bandwidth(op, geo1, HW), RING)
    c = collective_cost("all-reduce", 1e9, geo1, HW)
    assert close(c.transfer_s, 1e9 * 2 * 15 / 16 / RING)
    assert close(c.latency_s, BASE + 2 * 15 * NET_STEP)


def test_all_to_all_across_nodes_uses_a_single_nic():
    geo = Cluster(16, 1, NODE).dp_geometry()  # 8 members per node
    assert close(bus_bandwidth("all-to-all", geo, HW), NIC)
    c = collective_cost("all-to-all", 1e9, geo, HW)
    assert c.link == "network"
    assert close(c.latency_s, BASE + NET_STEP)
    assert close(c.transfer_s, 1e9 * 15 / 16 / NIC)


def test_inside_a_node_all_reduce_uses_nvls_others_ring():
    geo = intra(8)
    assert bus_bandwidth("all-reduce", geo, HW) == NVLS
    for op in ("reduce-scatter", "all-gather", "all-to-all"):
        assert bus_bandwidth(op, geo, HW) == RING


@pytest.mark.parametrize("op", OPS)
def test_bus_factors(op):
    for n in (2, 3, 8, 64):
        expected = 2 * (n - 1) / n if op == "all-reduce" else (n - 1) / n
        assert close(bus_factor(op, n), expected)
    assert bus_factor(op, 1) == 0.0


@pytest.mark.parametrize("op", OPS)
def test_trivial_collectives_cost_nothing(op):
    assert collective_cost(op, 1e9, GroupGeometry(1, 1, 1), HW) == CollectiveCost(0.0, 0.0, "none")
    assert collective_cost(op, 0.0, intra(8), HW).seconds == 0.0
    assert collective_cost(op, 0.0, Cluster(256, 8, NODE).dp_geometry(), HW).seconds == 0.0
    assert latency(op, GroupGeometry(1, 1, 1), HW) == 0.0
    assert uneven_cost(op, [], intra(4), HW).seconds == 0.0
    assert uneven_cost(op, [0, 0, 0, 0], intra(4), HW).seconds == 0.0
    assert uneven_cost(op, [5e6], GroupGeometry(1, 1, 1), HW).seconds == 0.0


def test_all_to_all_cost_trivial_cases():
    assert all_to_all_cost([1e6], [1e6], GroupGeometry(1, 1, 1), HW).seconds == 0.0
    assert all_to_all_cost([0, 0], [0, 0], intra(2), HW).seconds == 0.0


def test_unknown_collective_is_rejected():
    with pytest.raises(ValueError):
        collective_cost("broadcast", 1e6, intra(2), HW)
    with pytest.raises(ValueError):
        bus_factor("broadcast", 4)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["reduce-scatter", "all-gather"]),
       st.lists(st.integers(0, 10**9), min_size=2, max_size=32),
       st.booleans())
def test_uneven_cost_is_even_cost_of_n_times_largest_segment(op, segments, cross):
    n = len(segments)
    geo = GroupGeometry(n, n, 1) if cross else GroupGeometry(n, 1, n)
    got = uneven_cost(op, segments, geo, HW)
    want = collective_cost(op, n * max(segments), geo, HW)
    assert got == want
    # Padding never makes it cheaper than the even collective of the same total.
    assert got.seconds >= collective_cost(op, sum(segments), geo, HW).seconds - 1e-18


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


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(OPS), st.integers(2, 8), st.floats(1.0, 1e10), st.floats(1.0, 1e10))
def test_cost_is_monotone_in_bytes(op, n, a, b):
    lo, hi = sorted((a, b))
    assert collective_cost(op, lo, intra(n), HW).seconds <= collective_cost(op, hi, intra(n), HW).seconds


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
