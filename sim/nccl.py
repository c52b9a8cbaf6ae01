"""NCCL's algorithm and protocol selection (docs/design.md §9.2), after NCCL's own tuning model.

NCCL prices every (algorithm, protocol) pair of a collective as `latency + bytes / bandwidth` and
runs the cheapest (`src/graph/tuning.cc`, `ncclTopoTuneModel` / `ncclTopoGetAlgoTime`, NCCL
2.18-2.21). This module follows that model on the simulator's group geometry:

- algorithms: ring (every collective), tree (all-reduce), NVLS (NVLink SHARP, inside one node) and
  NVLS-tree (all-reduce across nodes);
- protocols: LL (8-byte flag+data stores: lowest latency, a quarter of the bandwidth), LL128
  (128-byte lines, ~92% of the bandwidth) and Simple (full bandwidth, highest latency);
- ring latency charges NCCL's per-step latency for the intra-node steps and the network latency
  only for the `nNodes - 1` (reduce-scatter, all-gather) or `2 nNodes` (all-reduce) steps that
  cross nodes, as NCCL does; a tree pays `2 (ppn - 1)` intra steps and `2 log2(nNodes)` network
  steps.

The Ring/Simple latencies and the large-message bus bandwidths come from the hardware profile (so
calibration replaces them); the other entries are NCCL's constants, quoted below with their table
names. A measured collective table in the profile replaces the whole model (`sim.collectives`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from canzona.hardware import HardwareProfile, bus_factor

RING, TREE, NVLS, NVLS_TREE = "ring", "tree", "nvls", "nvls-tree"
LL, LL128, SIMPLE = "LL", "LL128", "Simple"
PROTOCOLS = (LL, LL128, SIMPLE)

# baseLat (us): per algorithm, LL / LL128 / Simple. Ring/Simple comes from the profile.
_BASE_US = {TREE: (6.8, 14.0, 0.0), RING: (6.6, 14.0, None), NVLS: (0.0, 0.0, 0.0), NVLS_TREE: (0.0, 0.0, 0.0)}
# hwLat (us) of one step on NVLink and on the network. Ring/Simple comes from the profile.
_NVLINK_US = {TREE: (0.6, 1.25, 28.0), RING: (0.6, 1.9, None), NVLS: (0.0, 0.0, 23.0), NVLS_TREE: (0.0, 0.0, 23.0)}
_NET_US = {TREE: (5.0, 8.5, 28.0), RING: (2.7, 4.0, None), NVLS: (0.0, 0.0, 18.0), NVLS_TREE: (0.0, 0.0, 14.0)}
# llMaxBws (GB/s), Hopper inside a node; Intel hosts for 2 and for more nodes
_LL_MAX_BUSBW = (87.7e9, 39.0e9, 20.4e9)
# network post overhead: 1 us on Intel hosts, x3 for Simple; it floors the intra-node step of a
# ring that also crosses nodes
_NET_OVERHEAD_US = 1.0
# treeCorrectionFactor: bandwidth correction of trees by log2(bytes / 64), LL / LL128 / Simple
_TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9),
)
# ring all-reduce across nodes: "plateau effect" latency factor on Hopper, above 64 bytes per
# channel and rank; the channel count is this project's assumption (NCCL picks 16-32 on H100)
_PLATEAU, _CHANNELS = 1.4, 16


@dataclass(frozen=True)
class Choice:
    """What NCCL would run: algorithm, protocol, latency and bus bandwidth."""

    algorithm: str
    protocol: str
    latency_s: float
    busbw: float  # bytes/s; transfer = bytes * factor / busbw
    shape: str = "ring"  # factor: "ring" the ring's bus factor, "tree" 2 (NCCL's algBw = busBw / 2), "alg" 1

    def transfer_s(self, op: str, nbytes: float, n: int) -> float:
        factor = {"ring": bus_factor(op, n), "tree": 2.0, "alg": 1.0}[self.shape]
        return nbytes * factor / self.busbw

    def seconds(self, op: str, nbytes: float, n: int) -> float:
        return self.latency_s + self.transfer_s(op, nbytes, n)


def _steps(op: str, n: int, nodes: int) -> tuple[int, int]:
    """(all ring steps, steps that cross nodes), as NCCL counts them."""
    if op == "all-reduce":
        return 2 * (n - 1), (2 * nodes if nodes > 1 else 0)
    return n - 1, nodes - 1


def _ring(op: str, proto: int, n: int, nodes: int, per_node: int, busbw: float, hw: HardwareProfile) -> Choice:
    nccl = hw.nccl
    base = nccl.base_latency_s * 1e6 if proto == 2 else _BASE_US[RING][proto]
    intra = nccl.nvlink_step_latency_s * 1e6 if proto == 2 else _NVLINK_US[RING][proto]
    inter = nccl.network_step_latency_s * 1e6 if proto == 2 else _NET_US[RING][proto]
    steps, net_steps = _steps(op, n, nodes)
    if nodes > 1:
        intra = max(intra, _NET_OVERHEAD_US * (3 if proto == 2 else 1))
    latency = base + (steps - net_steps) * intra + net_steps * inter
    if proto == 0:
        share = 0.25 if (nodes > 1 or op == "all-reduce") else 1 / 3
        bw = min(_ll_cap(nodes), busbw * share)
    elif proto == 1:
        bw = busbw * (0.7 if per_node < 2 else 0.92)
    else:
        bw = busbw
    return Choice(RING, PROTOCOLS[proto], latency * 1e-6, bw)


def _tree(proto: int, n: int, nodes: int, busbw: float) -> Choice:
    ppn = n // nodes
    latency = _BASE_US[TREE][proto] + 2 * ((ppn - 1) * _NVLINK_US[TREE][proto]
                                           + math.log2(nodes) * _NET_US[TREE][proto])
    bw = busbw * 0.92
    if proto == 0:
        bw = min(bw / 3.8, _ll_cap(nodes))
    elif proto == 1:
        bw *= 7 / 9 if nodes == 1 else 120 / 128
    return Choice(TREE, PROTOCOLS[proto], latency * 1e-6, bw, "tree")


def _ll_cap(nodes: int) -> float:
    return _LL_MAX_BUSBW[min(nodes, 3) - 1]


def _tree_correction(choice: Choice, nbytes: float) -> Choice:
    if choice.algorithm != TREE:
        return choice
    log_size = int(math.log2(max(nbytes, 64) / 64))
    if log_size >= len(_TREE_CORRECTION[0]):
        return choice
    factor = _TREE_CORRECTION[PROTOCOLS.index(choice.protocol)][log_size]
    return Choice(choice.algorithm, choice.protocol, choice.latency_s, choice.busbw * factor, choice.shape)


def sized(c: Choice, op: str, nbytes: float, n: int, nodes: int) -> Choice:
    """NCCL's size-dependent corrections: tree bandwidth at medium sizes, and the ring all-reduce
    latency plateau across nodes."""
    c = _tree_correction(c, nbytes)
    if (c.algorithm == RING and c.protocol == SIMPLE and nodes > 1 and op == "all-reduce"
            and nbytes / (_CHANNELS * n) >= 64):
        c = Choice(c.algorithm, c.protocol, c.latency_s * _PLATEAU, c.busbw, c.shape)
    return c


def candidates(op: str, n: int, nodes: int, per_node: int, hw: HardwareProfile) -> list[Choice]:
    """Every (algorithm, protocol) NCCL would consider for `op` on this group, before sizes."""
    node, net = hw.node, hw.network
    ring_bw = node.nvlink_ring_busbw if nodes == 1 else min(node.nvlink_ring_busbw, per_node * net.nic_busbw)
    out = [_ring(op, p, n, nodes, per_node, ring_bw, hw) for p in range(3)]
    if op == "all-reduce" and nodes > 1:
        out += [_tree(p, n, nodes, ring_bw) for p in range(3)]
    if nodes == 1 and op in ("all-reduce", "reduce-scatter", "all-gather"):
        # NVLink SHARP: the profile's measured NVLS all-reduce bus bandwidth; the switch reduces, so
        # reduce-scatter / all-gather reach the ring figure at a fixed, n-independent latency
        bw = node.nvls_allreduce_busbw if op == "all-reduce" else node.nvlink_ring_busbw
        out.append(Choice(NVLS, SIMPLE, (_BASE_US[NVLS][2] + _NVLINK_US[NVLS][2]) * 1e-6, bw))
    if op == "all-reduce" and nodes > 1 and per_node > 1:
        inter = per_node * net.nic_busbw if nodes <= 2 else per_node * net.nic_busbw / 2
        # NCCL gives NVLS-tree an algorithm bandwidth directly (5/6 of its graph bandwidth)
        bw = min(node.nvls_allreduce_busbw, inter) * 5 / 6
        latency = _NVLINK_US[NVLS_TREE][2] + 2 * math.log2(nodes) * _NET_US[NVLS_TREE][2]
        out.append(Choice(NVLS_TREE, SIMPLE, latency * 1e-6, bw, "alg"))
    return out


def choose(op: str, nbytes: float, n: int, nodes: int, per_node: int, hw: HardwareProfile) -> Choice:
    """The cheapest (algorithm, protocol) for `nbytes` (NCCL's `nBytes`: the full buffer)."""
    best: Choice | None = None
    best_t = math.inf
    for c in candidates(op, n, nodes, per_node, hw):
        c = sized(c, op, nbytes, n, nodes)
        t = c.seconds(op, nbytes, n)
        if t < best_t:
            best, best_t = c, t
    assert best is not None
    return best
