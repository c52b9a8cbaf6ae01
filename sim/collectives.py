"""Alpha-beta cost of NCCL collectives (docs/design.md §9.2), as closed forms.

`t = alpha + S * f / B_bus`: `S` is the collective's buffer size (the full reduce-scatter input or
all-gather output), `f` the bus factor of the algorithm, `B_bus` the bus bandwidth NCCL reaches on
the links the group crosses. Ring latency follows NCCL's tuning model: a base latency plus one
per-step latency for each of the ring's steps. Uneven (-v) variants pay for their largest segment,
as a padded ring would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from canzona.hardware import COLLECTIVE_OPS as OPS  # one definition, shared with calibration
from canzona.hardware import HardwareProfile, bus_factor, latency_steps
from sim.topology import GroupGeometry


@dataclass(frozen=True)
class CollectiveCost:
    latency_s: float
    transfer_s: float  # at the full bus bandwidth; shared links stretch it
    link: str  # "nvlink", "network" or "none"

    @property
    def seconds(self) -> float:
        return self.latency_s + self.transfer_s


def bus_bandwidth(op: str, geo: GroupGeometry, hw: HardwareProfile) -> float:
    """NVLink inside a node; across nodes the NICs, of which a ring uses one per member on each
    node (multi-rail), capped by NVLink. All-to-all cannot combine several NICs."""
    if not geo.crosses_nodes:
        if op == "all-reduce":
            return hw.node.nvls_allreduce_busbw
        return hw.node.nvlink_ring_busbw
    if op == "all-to-all":
        return hw.network.nic_busbw
    return min(hw.node.nvlink_ring_busbw, geo.per_node * hw.network.nic_busbw)


def latency(op: str, geo: GroupGeometry, hw: HardwareProfile) -> float:
    if geo.size <= 1:
        return 0.0
    step = hw.nccl.network_step_latency_s if geo.crosses_nodes else hw.nccl.nvlink_step_latency_s
    return hw.nccl.base_latency_s + latency_steps(op, geo.size) * step


def collective_cost(op: str, nbytes: float, geo: GroupGeometry, hw: HardwareProfile) -> CollectiveCost:
    """Even collective over a buffer of `nbytes` (all-to-all: bytes each rank sends in total)."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}")
    if geo.size <= 1 or nbytes <= 0:
        return CollectiveCost(0.0, 0.0, "none")
    link = "network" if geo.crosses_nodes else "nvlink"
    transfer = nbytes * bus_factor(op, geo.size) / bus_bandwidth(op, geo, hw)
    return CollectiveCost(latency(op, geo, hw), transfer, link)


def uneven_cost(op: str, segment_bytes: Sequence[float], geo: GroupGeometry, hw: HardwareProfile) -> CollectiveCost:
    """Reduce-scatter-v / all-gather-v: priced as the even collective padded to the largest segment."""
    return collective_cost(op, max(segment_bytes, default=0.0) * geo.size, geo, hw)


def all_to_all_cost(send_bytes: Sequence[float], recv_bytes: Sequence[float], geo: GroupGeometry,
                    hw: HardwareProfile) -> CollectiveCost:
    """Uneven all-to-all: the busiest port (bytes a rank sends or receives, to or from others)."""
    busiest = max(max(send_bytes, default=0.0), max(recv_bytes, default=0.0))
    if geo.size <= 1 or busiest <= 0:
        return CollectiveCost(0.0, 0.0, "none")
    link = "network" if geo.crosses_nodes else "nvlink"
    return CollectiveCost(latency("all-to-all", geo, hw), busiest / bus_bandwidth("all-to-all", geo, hw), link)
