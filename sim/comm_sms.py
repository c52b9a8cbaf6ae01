"""SMs a communication kernel holds while it runs (docs/design.md §9.1, §9.2).

An NCCL collective is a CUDA kernel with one thread block per channel, and a block holds its SM
for the whole kernel: an NCCL developer, https://github.com/NVIDIA/nccl/issues/689 ("NCCL CTAs
won't share an SM with compute kernels"; "one NCCL block will occupy one SM exclusively"). A GEMM
overlapped with it runs on the SMs left. The engine (`sim.engine`) charges that: while kernels
holding `k` of the GPU's `sms` SMs run on a rank, its compute proceeds at `(sms - k) / sms` of its
rate. Copy-engine transfers hold no SM.

Channel counts NCCL picks on an H100 node (NCCL 2.18-2.21; they follow the topology, not the
size, above NCCL's small-message channel reduction, which this model leaves out):
- a ring or tree over NVLink: 24. NCCL searches 12 one-direction rings on an 8-GPU H100 NVSwitch
  node and runs each twice (https://github.com/NVIDIA/nccl/issues/1367, NCCL 2.19.3 log: 24
  channels); HGX A100 logs show 24 as well (https://github.com/NVIDIA/nccl-tests/issues/100).
- NVLS / NVLS-tree (NVLink SHARP): 16. NCCL's source: "NVLS should not need more than 16
  channels to get peak BW" (quoted in https://github.com/NVIDIA/nccl/issues/1041).
- a ring or tree across nodes over the NICs: 16. An NCCL developer: "on DGX with 8 NICs and a
  top speed of 190 GB/s, then it would use 16 SMs" (https://github.com/NVIDIA/nccl/issues/689).
- point-to-point and all-to-all (`p2p`: pipeline sends, context-parallel ring exchanges, expert
  dispatch) across nodes: 2 channels per peer (`NCCL_NCHANNELS_PER_NET_PEER`, "typically 2", an
  NCCL developer in https://github.com/NVIDIA/nccl/issues/1424), one peer per other member, up to
  NCCL's 32 channels (MAXCHANNELS; p2p channels are capped by `NCCL_MAX_P2P_NCHANNELS`, whose
  default is that, https://github.com/NVIDIA/nccl/issues/1598).
- point-to-point and all-to-all over NVLink: **assumption**, the NVLink ring figure, 24. NCCL
  gives an NVLink peer channels in proportion to the path's bandwidth (many on an NVSwitch node),
  then uses fewer for small messages; this model does not follow it peer by peer.

Transformer Engine's userbuffers (TP communication overlap, `--tp-comm-overlap`) do not use NCCL
for the TP exchanges: an all-gather overlapped by `ring_exchange` moves its chunks with the copy
engines (`use_ce=True`, TE's default: `transformer_engine/pytorch/module/base.py`,
`initialize_ub`'s `get_default_config`), no SM; a `pipeline` or `bulk` overlap runs a
communication kernel on `num_sm` SMs, and the GEMM beside it is launched on the rest
(`set_sm_margin`). With `set_sm_margin` (the forward's `pipeline` reduce-scatters in NVIDIA's H100
configurations) the GEMM is launched on `sms - num_sm` SMs for its whole length, not only while
the communication kernel runs (TE's CommOverlapCore: `_math_sms = set_sm_margin ? sm_count -
num_comm_sm : sm_count`, transformer_engine/common/comm_gemm_overlap/comm_gemm_overlap.cpp), and
the GEMM runs as `num_splits` chunks, the reduce-scatter of each chunk starting once it is done,
so the last chunk's reduce-scatter follows the GEMM (`split_overlap_rs`). Which SMs each block's
exchanges take is the run's named configuration (`sim.userbuffers`, `RunOptions.tp_comm_overlap_cfg`;
by default `userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192`, Megatron-Bridge
`src/megatron/bridge/training/comm_overlap.py`, used by its Llama 3 70B H100 bf16 recipe; TE's own
default is 16 SMs for `pipeline` / `bulk`).
"""

from __future__ import annotations

from dataclasses import dataclass

from canzona.errors import SpecError
from sim.collectives import CollectiveCost

NVLINK_RING_SMS = 24  # NCCL ring / tree channels over NVLink on an 8-GPU H100 node
NVLS_SMS = 16  # NCCL NVLS / NVLS-tree channels
NETWORK_SMS = 16  # NCCL ring / tree channels across nodes, 8 NICs a node
NET_PEER_SMS = 2  # NCCL send / recv channels per network peer
MAX_CHANNELS = 32  # NCCL's MAXCHANNELS


def nccl_sms(cost: CollectiveCost, members: int = 2) -> int:
    """SMs the NCCL kernel of a collective priced `cost` over `members` ranks holds while it runs."""
    if cost.link == "none" or cost.seconds <= 0:
        return 0
    if cost.algorithm.startswith("nvls"):
        return NVLS_SMS
    if cost.link != "network":
        return NVLINK_RING_SMS
    if cost.algorithm == "p2p":
        return min(NET_PEER_SMS * max(members - 1, 1), MAX_CHANNELS)
    return NETWORK_SMS


@dataclass(frozen=True, kw_only=True)
class TPOverlapSMs:
    """SMs of the userbuffers kernels of one sequence-parallel block's overlapped TP exchanges
    (`sim.iteration._Stage.block`), as a named configuration sets them (`sim.userbuffers`): the
    forward's output reduce-scatter (under the block's last GEMMs: TE's `proj_fprop` / `fc2_fprop`;
    `forward_reduce_scatter` is a `pipeline` kernel's SMs, or a `ring_exchange`'s margin, whose
    copy-engine transfers hold none), the backward's re-gather of the block
    input for the weight gradients (`bulk`, under the data-gradient GEMMs: `qkv_dgrad` /
    `fc1_dgrad`) and its input-gradient reduce-scatter (`bulk`, under the weight-gradient GEMMs:
    `qkv_wgrad` / `fc1_wgrad`). The all-gathers of the forward input and of the backward output
    gradient are `ring_exchange` on the copy engines: no SM."""

    forward_reduce_scatter: int
    backward_gather: int
    backward_reduce_scatter: int
    # the forward's reduce-scatter: its GEMM on the SMs the communication leaves (`set_sm_margin`), in
    # `forward_splits` chunks (a `pipeline`'s `num_splits`; None: TP chunks, a `ring_exchange`'s)
    forward_sm_margin: bool = True
    forward_splits: int | None = 4

    def __post_init__(self) -> None:
        if self.forward_splits is not None and self.forward_splits < 1:
            raise SpecError(f"forward_splits must be >= 1 or None (TP chunks), got {self.forward_splits}")
