"""Cost of collectives (docs/design.md §9.2), as closed forms.

Even collectives are priced as NCCL prices them (`sim.nccl`: the cheapest algorithm and protocol
for the size and the group's geometry): `t = latency + S * factor / B`, `S` the collective's
buffer (the full reduce-scatter input or all-gather output, the all-reduce buffer). All-to-all is
hierarchical: bytes between GPUs of one node cross NVLink, bytes between nodes the sender's and the
receiver's NICs; the busiest port decides.

Uneven (-v) collectives are priced as the runtime runs them (`canzona.runtime.comm`). A
reduce-scatter-v takes the route `canzona.reductions.bucket_route` gives the `reduce_scatter`
implementation (the same option, name and default as `DistributedOptimizer`'s):
- `even`: the even collective over the whole buffer;
- `padded`: the even collective over `n` times the largest segment, plus the passes that copy the
  buffer into the padded one and the owner's sum out of it;
- `loops`: one reduce per non-empty segment in one NCCL group (the coalescing manager); NCCL
  charges the latency of every grouped ring operation (`numPipeOps` in `ncclTopoGetAlgoTime`), and
  each link carries every segment once;
- `exact`: one all-to-all (rank `r` receives every rank's copy of segment `r`), then the owner's
  sum in rank order: `n` passes over its received copies and one write, at HBM bandwidth.
An all-gather-v is the runtime's broadcast per owner (the even all-gather when segments are even).
A profile with a measured collective table (`canzona calibrate --world-size`) replaces the model
for the ops and group sizes it measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress

from canzona.hardware import COLLECTIVE_OPS, HardwareProfile
from canzona.reductions import DEFAULT_REDUCE_SCATTER, EVEN, EXACT, PADDED, bucket_route
from sim import nccl
from sim.topology import GroupGeometry

OPS = (*COLLECTIVE_OPS, "broadcast", "reduce")


@dataclass(frozen=True)
class CollectiveCost:
    latency_s: float
    transfer_s: float  # at the full bus bandwidth; shared links stretch it
    link: str  # "nvlink", "network" or "none"
    algorithm: str = ""  # e.g. "ring/LL128", "tree/Simple", "nvls/Simple", "p2p"
    local_s: float = 0.0  # passes over device memory around the transfer (copies, sums), no link used

    @property
    def seconds(self) -> float:
        return self.latency_s + self.transfer_s + self.local_s


FREE = CollectiveCost(0.0, 0.0, "none")


def bus_bandwidth(op: str, geo: GroupGeometry, hw: HardwareProfile) -> float:
    """Large-message bus bandwidth of a ring / NVLS on this group (Simple protocol): NVLink inside a
    node (NVLS for all-reduce); across nodes the NICs, of which a ring uses one per member on each
    node, capped by NVLink. All-to-all cannot combine several NICs."""
    if not geo.crosses_nodes:
        return hw.node.nvls_allreduce_busbw if op == "all-reduce" else hw.node.nvlink_ring_busbw
    if op == "all-to-all":
        return hw.network.nic_busbw
    return min(hw.node.nvlink_ring_busbw, geo.per_node * hw.network.nic_busbw)


def _link(geo: GroupGeometry) -> str:
    return "network" if geo.crosses_nodes else "nvlink"


def collective_cost(op: str, nbytes: float, geo: GroupGeometry, hw: HardwareProfile) -> CollectiveCost:
    """Even collective over a buffer of `nbytes` (all-to-all: bytes each rank sends in total, spread
    evenly over the members)."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}")
    if geo.size <= 1 or nbytes <= 0:
        return FREE
    measured = _measured(op, nbytes, geo, hw)
    if measured is not None:
        return measured
    if op == "all-to-all":
        off_node = (geo.size - geo.per_node) / (geo.size - 1)
        out_bytes = nbytes * (geo.size - 1) / geo.size  # its own share stays
        return _all_to_all([out_bytes * (1 - off_node)], [out_bytes * off_node], geo, hw)
    steps_op = "all-gather" if op in ("broadcast", "reduce") else op
    choice = nccl.choose(steps_op, nbytes, geo.size, geo.nodes, geo.per_node, hw)
    if op in ("broadcast", "reduce"):
        transfer = nbytes / choice.busbw
    else:
        transfer = choice.transfer_s(op, nbytes, geo.size)
    return CollectiveCost(choice.latency_s, transfer, _link(geo), f"{choice.algorithm}/{choice.protocol}")


def _measured(op: str, nbytes: float, geo: GroupGeometry, hw: HardwareProfile) -> CollectiveCost | None:
    """A calibrated profile's measured time for this op and group size (`CollectiveTable.seconds`)."""
    seconds = hw.collectives.seconds(op, geo.size, nbytes)
    if seconds is None:
        return None
    return CollectiveCost(seconds, 0.0, _link(geo), f"measured ({hw.collectives.backend})")


def _all_to_all(intra: Sequence[float], inter: Sequence[float], geo: GroupGeometry,
                hw: HardwareProfile) -> CollectiveCost:
    """Busiest port of a hierarchical all-to-all: NVLink bytes at the NVLink rate, network bytes at
    one NIC's (all-to-all cannot combine NICs)."""
    nvl = max(intra, default=0.0) / hw.node.nvlink_ring_busbw
    net = max(inter, default=0.0) / hw.network.nic_busbw
    if nvl <= 0 and net <= 0:
        return FREE
    step = hw.nccl.network_step_latency_s if net > 0 else hw.nccl.nvlink_step_latency_s
    link = "network" if net >= nvl else "nvlink"
    return CollectiveCost(hw.nccl.base_latency_s + step, max(nvl, net), link, "p2p")


def all_to_all_cost(send: Sequence[float], recv: Sequence[float], geo: GroupGeometry,
                    hw: HardwareProfile, send_off_node: Sequence[float] | None = None,
                    recv_off_node: Sequence[float] | None = None) -> CollectiveCost:
    """Uneven all-to-all: `send[r]` / `recv[r]` bytes rank r sends to / receives from the others,
    of which `*_off_node[r]` cross nodes (default: none inside one node, all when every member is
    on its own node, else spread in proportion to the peers on other nodes)."""
    if geo.size <= 1 or max(max(send, default=0.0), max(recv, default=0.0)) <= 0:
        return FREE
    if send_off_node is None or recv_off_node is None:
        share = (geo.size - geo.per_node) / (geo.size - 1)
        send_off_node = [s * share for s in send]
        recv_off_node = [r * share for r in recv]
    intra = [max(s - so, r - ro) for s, r, so, ro in zip(send, recv, send_off_node, recv_off_node)]
    inter = [max(so, ro) for so, ro in zip(send_off_node, recv_off_node)]
    return _all_to_all(intra, inter, geo, hw)


def matrix_all_to_all_cost(sent: Sequence[Sequence[float]], nodes: Sequence[int], geo: GroupGeometry,
                           hw: HardwareProfile) -> CollectiveCost:
    """An all-to-all where member s sends `sent[s][d]` bytes to member d (the diagonal counts:
    leave it 0 for what stays on the rank), `nodes[s]` the node of member s: the part between
    nodes goes on the NICs."""
    d = len(sent)
    send, recv, send_off, recv_off = [0.0] * d, [0.0] * d, [0.0] * d, [0.0] * d
    for j in range(d):
        row = sent[j]
        for r in compress(range(d), row):  # the non-zero parts only (DP 2048: a few of 4M)
            part = row[r]
            if part:
                send[j] += part
                recv[r] += part
                if nodes[j] != nodes[r]:
                    send_off[j] += part
                    recv_off[r] += part
    return all_to_all_cost(send, recv, geo, hw, send_off, recv_off)


def reduce_scatter_v_cost(segment_bytes: Sequence[float], geo: GroupGeometry, hw: HardwareProfile,
                          impl: str = DEFAULT_REDUCE_SCATTER) -> CollectiveCost:
    """Reduce-scatter-v over segments of `segment_bytes` (in rank order), by the route the runtime
    takes for `impl`. Segments proportional to elements: the route depends on their ratios only."""
    segments = [float(s) for s in segment_bytes]
    if geo.size <= 1 or max(segments, default=0.0) <= 0:
        return FREE
    route = bucket_route(impl, segments)
    total, widest = sum(segments), max(segments)
    if route == EVEN:
        return collective_cost("reduce-scatter", total, geo, hw)
    if route == PADDED:
        cost = collective_cost("reduce-scatter", widest * geo.size, geo, hw)
        copies = (total + widest * geo.size + 2 * widest) / hw.gpu.hbm_bytes_per_s  # pad in, sum out
        return CollectiveCost(cost.latency_s, cost.transfer_s, cost.link, f"padded {cost.algorithm}", copies)
    if route == EXACT:
        send = [total - s for s in segments]  # every other rank's segment
        recv = [s * (geo.size - 1) for s in segments]  # its own segment from every other rank
        cost = all_to_all_cost(send, recv, geo, hw)
        passes = (geo.size + 2) * widest / hw.gpu.hbm_bytes_per_s  # read every copy, write the sum, the mean
        return CollectiveCost(cost.latency_s, cost.transfer_s, cost.link, "all-to-all + sum", passes)
    return _rooted_loop("reduce", segments, geo, hw)


def all_gather_v_cost(segment_bytes: Sequence[float], geo: GroupGeometry, hw: HardwareProfile) -> CollectiveCost:
    """All-gather-v over segments of `segment_bytes`: the even all-gather when they are even, else
    one broadcast per owner, in place (the runtime's `Comm.all_gather_v`)."""
    segments = [float(s) for s in segment_bytes]
    if geo.size <= 1 or max(segments, default=0.0) <= 0:
        return FREE
    if len(set(segments)) == 1 and len(segments) == geo.size:
        return collective_cost("all-gather", sum(segments), geo, hw)
    return _rooted_loop("broadcast", segments, geo, hw)


def _rooted_loop(rooted: str, segments: Sequence[float], geo: GroupGeometry, hw: HardwareProfile) -> CollectiveCost:
    """One rooted collective per non-empty segment, grouped: every latency, every segment's bytes."""
    costs = [collective_cost(rooted, s, geo, hw) for s in segments if s > 0]
    return CollectiveCost(sum(c.latency_s for c in costs), sum(c.transfer_s for c in costs), _link(geo),
                          f"{rooted} loop")
