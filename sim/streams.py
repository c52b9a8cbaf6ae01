"""The names of the simulated GPUs' streams besides compute: one definition, for the iteration
(`sim.iteration`), the EP all-to-all overlap (`sim.ep_overlap`) and FSDP (`sim.fsdp`), so that
none of them imports another for a name."""

from __future__ import annotations

TP_COMM, DP_COMM, EP_COMM = "tp-comm", "dp-comm", "ep-comm"
PP_COMM = "pp-comm"  # the pipeline's point-to-point: one stream per NCCL communicator (sim.pipeline_p2p.p2p_stream)
CP_COMM = "cp-comm"  # the context-parallel attention's ring exchanges (point-to-point, beside compute)
# the expert part's TP exchanges (expert TP): their own communicator and stream, beside the dense
# part's TP exchanges, sharing the GPUs' links with them
ETP_COMM = "etp-comm"
