"""Cost of collectives (docs/design.md §9.2), as closed forms.

Even collectives are priced as NCCL prices them (`sim.nccl`: the cheapest algorithm and protocol
for the size and the group's geometry): `t = latency + S * factor / B`, `S` the collective's
buffer (the full reduce-scatter input or all-gather output, the all-reduce buffer). All-to-all is
hierarchical: bytes between GPUs of one node cross NVLink, bytes between nodes the sender's and the
receiver's NICs; the busiest port decides.

Uneven (-v) collectives are priced by their implementation (`UNEVEN_IMPLS`):
- `padded`: the even collective over `n` times the largest segment;
- `loops`: one reduce (reduce-scatter) or broadcast (all-gather) per non-empty segment in one NCCL
  group, what `torch.distributed` issues on NCCL for uneven tensor lists and what canzona's runtime
  runs with `reduce_scatter="loops"`; NCCL itself charges the latency of every grouped ring
  operation (`numPipeOps` in `ncclTopoGetAlgoTime`), and each link carries every segment once;
- `runtime`: what canzona's runtime does by default (`canzona.runtime.comm`, `reduce_scatter=
  "exact"`): reduce-scatter as one all-to-all (rank `r` receives every rank's copy of segment `r`),
  all-gather as a broadcast loop.
A profile with a measured collective table (`canzona calibrate --world-size`) replaces the model
for the ops and group sizes it measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from canzona.errors import SpecError
from canzona.hardware import COLLECTIVE_OPS, HardwareProfile
from sim import nccl
from sim.topology import GroupGeometry

OPS = (*COLLECTIVE_OPS, "broadcast", "reduce")
UNEVEN_IMPLS = ("runtime", "loops", "padded")
DEFAULT_UNEVEN = "runtime"


@dataclass(frozen=True)
class CollectiveCost:
    latency_s: float
    transfer_s: float  # at the full bus bandwidth; shared links stretch it
    link: str  # "nvlink", "network" or "none"
    algorithm: str = ""  # e.g. "ring/LL128", "tree/Simple", "nvls/Simple", "p2p"

    @property
    def seconds(self) -> float:
        return self.latency_s + self.transfer_s


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


def check_uneven_impl(impl: str) -> str:
    if impl not in UNEVEN_IMPLS:
        raise SpecError(f"unknown uneven-collective implementation {impl!r}; choose one of {', '.join(UNEVEN_IMPLS)}")
    return impl


def uneven_cost(op: str, segment_bytes: Sequence[float], geo: GroupGeometry, hw: HardwareProfile,
                impl: str = DEFAULT_UNEVEN) -> CollectiveCost:
    """Reduce-scatter-v / all-gather-v over segments of `segment_bytes` (in rank order)."""
    if op not in ("reduce-scatter", "all-gather"):
        raise ValueError(f"uneven collectives are reduce-scatter or all-gather, got {op!r}")
    check_uneven_impl(impl)
    segments = [float(s) for s in segment_bytes]
    if geo.size <= 1 or max(segments, default=0.0) <= 0:
        return FREE
    if len(set(segments)) == 1 and len(segments) == geo.size:
        return collective_cost(op, sum(segments), geo, hw)  # even: every implementation runs the collective
    if impl == "padded":
        return collective_cost(op, max(segments) * geo.size, geo, hw)
    if impl == "runtime" and op == "reduce-scatter":
        total = sum(segments)
        send = [total - s for s in segments]  # every other rank's segment
        recv = [s * (geo.size - 1) for s in segments]  # its own segment from every other rank
        return all_to_all_cost(send, recv, geo, hw)
    # a loop of rooted collectives, one per non-empty segment, in one group
    rooted = "reduce" if op == "reduce-scatter" else "broadcast"
    costs = [collective_cost(rooted, s, geo, hw) for s in segments if s > 0]
    return CollectiveCost(sum(c.latency_s for c in costs), sum(c.transfer_s for c in costs), _link(geo),
                          f"{rooted} loop")
