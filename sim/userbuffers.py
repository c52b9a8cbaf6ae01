"""The named userbuffers configurations of Transformer Engine's TP communication overlap
(`RunOptions.tp_comm_overlap_cfg`, `canzona simulate --tp-comm-overlap-cfg`; docs/design.md §9.3).

A recipe that turns the overlap on also picks a configuration: for each of a transformer layer's
ten overlapped GEMMs, how its TP exchange runs beside it (`method`: `ring_exchange`, `pipeline` or
`bulk`), on how many SMs (`num_sm`), in how many chunks (`num_splits`, `pipeline`), and whether
the GEMM is launched without the communication's SMs (`set_sm_margin`). The figures below are
written as data from their sources, each entry naming its file and commit:

- Megatron-Bridge `src/megatron/bridge/training/comm_overlap.py` (NVIDIA-NeMo/Megatron-Bridge,
  commits 0685ff5d5e636e06193291eb13b6bae531e958b4 and aae82005904475c0eeb5054ee5e9f78ffb6c5c76,
  whose H100 configurations agree): the `userbuffers_*_h100_*` ones, which Megatron-Bridge's
  performance recipes pick (`scripts/performance/configs/llama/llama3_llm_pretrain.py`: Llama 3
  70B on H100, bf16 or fp8 `h8192_tp4`; `llama31_llm_pretrain.py`: Llama 3.1 405B, fp8
  `h16384_tp8_cp2`).
- NeMo-Framework-Launcher `launcher_scripts/conf/training/tp_overlap/*.yaml` (NeMo 1.x, the
  `ub_cfg_*` names): the two its Llama 3 / 3.1 70B H100 configs load (NeMo 24.07 / 24.09) and the
  one its Llama 3.1 405B config loads (NeMo 24.09, DGX Cloud's recipe).

NVIDIA/NeMo's NeMo 2.0 copy (`nemo/collections/llm/recipes/tp_overlap_configs/userbuffers.py`,
commit 0594a700a7d4c17384982e4be3847f8ef2865f67) uses the same names with other figures for the
FP8 ones (`pipeline` forward reduce-scatters with `fp8_buf`, `aggregate` ring exchanges for the
405B): it is not a source here, and its names would clash; the launcher's FP8 `h8192_tp4` yaml
holds NeMo 2.0's figures under its own name.

How the simulator prices a configuration (`UserbuffersConfig.block_sms`, `sim.comm_sms.TPOverlapSMs`,
`sim.iteration._Stage.block`), per sequence-parallel block (attention: `qkv_*` / `proj_*`; MLP:
`fc1_*` / `fc2_*`):
- the forward input's and the backward output gradient's all-gathers (`qkv_fprop` / `fc1_fprop`,
  `proj_dgrad` / `fc2_dgrad`) must be `ring_exchange` without `set_sm_margin`: copy-engine
  transfers holding no SM, as the simulator runs them (every configuration here);
- the backward's input re-gather (`qkv_dgrad` / `fc1_dgrad`) and input-gradient reduce-scatter
  (`qkv_wgrad` / `fc1_wgrad`) must be `bulk`: a kernel on `num_sm` SMs beside the GEMMs;
- the forward's output reduce-scatter (`proj_fprop` / `fc2_fprop`): `pipeline`, a kernel on
  `num_sm` SMs, the GEMM in `num_splits` chunks (under `set_sm_margin` launched without those SMs);
  or `ring_exchange` (Transformer Engine's `CommOverlapP2PBase::split_overlap_rs`,
  transformer_engine/common/comm_gemm_overlap/comm_gemm_overlap.cpp): the GEMM in TP chunks, each
  chunk's output sent point to point on the copy engines (TE's default `use_ce`), no SM held by the
  transfers, the GEMM launched without `num_sm` SMs under `set_sm_margin`.
The overlapped GEMMs run in chunks (since 2026-12-03: `UserbuffersConfig.gemm_chunks`,
`sim.model_work`): Transformer Engine issues a ring exchange's GEMM as `tp` cuBLAS calls, one per
rank's share of the tokens (`CommOverlapP2PBase::split_overlap_ag` / `split_overlap_rs`; an
all-gather's two shares a call under `aggregate`, which the reduce-scatter ignores), and a
`pipeline`'s as `num_splits` calls of all the tokens, each `1 / num_splits` of the output columns
(`CommOverlapBase::split_overlap_rs` cuts the weight into row blocks: `GemmChunks.row_by_columns`),
round-robin on its `_NUM_MAX_UB_STREAMS` = 3 compute streams (transformer_engine/pytorch/module/base.py),
the ring-exchange reduce-scatter's chunks as the all-gathers'. Megatron's fused GEMMs (`linear_qkv`,
`linear_fc1`) are what TE chunks. Priced (`canzona.cost.chunked_gemm_kernel`): all the chunks'
tiles share the waves, at most three chunks' tiles (`UB_STREAMS`) and the SMs in one, the fixed
latency once per three chunks, never faster than the whole GEMM: a chunk that fills the GPU alone
costs little, chunks of few rows (Qwen3-32B at TP 8, 1024 tokens: 128) leave waves partly empty.
`bulk` overlaps, and a forward without grad (TE's `ub_overlap_ag_fprop and is_grad_enabled`:
`sim.model_work.Block.without_grad`), run the column GEMMs whole.
Not priced, recorded only: `fp8_buf` (the reduce-scatter's buffer in FP8; the simulator moves the
activation dtype under userbuffers, `sim.iteration.tp_gather_bytes`) and `atomic_gemm` (false in
every configuration here). The ring exchange's last step is priced (since 2026-11-30): once every
chunk is sent and received, `reduce_bf16` sums the TP partial outputs of the rank's slice on the
main stream, `tp` slices read and one written (`sim.iteration._Stage._ring_rs_sum_s`). `cga_size` (2 for every `bulk` and `pipeline` GEMM here, 1 for the ring
exchanges) is the communication kernel's cluster shape: not recorded, not priced.
Left out of the registry: the LoRA configurations (no weight-gradient overlap: `qkv_wgrad` /
`fc1_wgrad` unset, the frozen weights take none) and the B200 ones (no B200 hardware profile).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

from canzona.choices import check_choice
from canzona.errors import SpecError
from sim.comm_sms import TPOverlapSMs

RING_EXCHANGE, PIPELINE, BULK = "ring_exchange", "pipeline", "bulk"
# Transformer Engine's compute streams for an overlapped GEMM's chunks (`_NUM_MAX_UB_STREAMS`,
# transformer_engine/pytorch/module/base.py; the chunks go to them round-robin)
UB_STREAMS = 3
METHODS = (RING_EXCHANGE, PIPELINE, BULK)


class GemmChunks(NamedTuple):
    """One block's overlapped GEMMs' cuBLAS calls (`UserbuffersConfig.gemm_chunks`): its forward
    column GEMMs' (under the input's all-gather), its forward row GEMMs' (under the output's
    reduce-scatter) and its backward row data-gradient GEMMs' (under the output gradient's
    all-gather); 1: the GEMM whole. `row_by_columns`: the forward row GEMM's chunks are slices of
    its output columns over all the tokens (a `pipeline`: `CommOverlapBase::split_overlap_rs` cuts
    the weight into `num_splits` row blocks); else slices of the tokens (a ring exchange's)."""

    column: int
    row: int
    row_dgrad: int
    row_by_columns: bool = False


@dataclass(frozen=True, kw_only=True)
class GemmOverlap:
    """One GEMM's overlapped TP exchange as a configuration states it."""

    method: str
    num_sm: int  # the communication's SMs (a ring exchange's: TE's default 1, a margin only)
    num_splits: int | None = None  # `pipeline` only: the GEMM's chunks
    set_sm_margin: bool = False  # the GEMM launched on the SMs the communication leaves
    aggregate: bool = False  # a `ring_exchange` all-gather only: its GEMM in tp / 2 chunks of two shares (gemm_chunks)
    fp8_buf: bool = False  # not priced
    atomic_gemm: bool = False  # not priced

    def __post_init__(self) -> None:
        check_choice(self.method, METHODS, "userbuffers overlap method")
        if not (isinstance(self.num_sm, int) and self.num_sm >= 1):
            raise SpecError(f"num_sm must be a whole number >= 1, got {self.num_sm!r}")
        if (self.num_splits is not None) != (self.method == PIPELINE):
            raise SpecError(f"num_splits is a pipeline overlap's (and it needs one), got {self.num_splits!r} "
                            f"for {self.method}")
        if self.num_splits is not None and self.num_splits < 1:
            raise SpecError(f"num_splits must be >= 1, got {self.num_splits}")
        if self.aggregate and self.method != RING_EXCHANGE:
            raise SpecError(f"aggregate is a ring exchange's, not {self.method}'s")


@dataclass(frozen=True, kw_only=True)
class UserbuffersConfig:
    """A named configuration: its ten GEMMs' overlaps and where the figures come from."""

    name: str
    source: str  # the file and commit the figures are written from
    qkv_fprop: GemmOverlap  # attention forward: the input's all-gather under the q, k, v GEMMs
    qkv_dgrad: GemmOverlap  # attention backward: the input's re-gather under the data-gradient GEMMs
    qkv_wgrad: GemmOverlap  # attention backward: the input gradient's reduce-scatter under the weight-gradient GEMMs
    proj_fprop: GemmOverlap  # attention forward: the output's reduce-scatter under the o projection
    proj_dgrad: GemmOverlap  # attention backward: the output gradient's all-gather under the o projection
    fc1_fprop: GemmOverlap  # MLP forward: the input's all-gather under the gate / up GEMMs
    fc1_dgrad: GemmOverlap
    fc1_wgrad: GemmOverlap
    fc2_fprop: GemmOverlap  # MLP forward: the output's reduce-scatter under the down projection
    fc2_dgrad: GemmOverlap

    def __post_init__(self) -> None:
        for gemm in ("qkv_fprop", "proj_dgrad", "fc1_fprop", "fc2_dgrad"):
            g: GemmOverlap = getattr(self, gemm)
            if g.method != RING_EXCHANGE or g.set_sm_margin:
                raise SpecError(f"{self.name}: {gemm} must be a ring exchange without set_sm_margin, the all-gather "
                                f"the simulator prices (copy engines, no SM), got {g.method}")
        for gemm in ("qkv_dgrad", "qkv_wgrad", "fc1_dgrad", "fc1_wgrad"):
            if getattr(self, gemm).method != BULK:
                raise SpecError(f"{self.name}: {gemm} must be a bulk overlap, got {getattr(self, gemm).method}")
        for gemm in ("proj_fprop", "fc2_fprop"):
            if getattr(self, gemm).method == BULK:
                raise SpecError(f"{self.name}: {gemm} must be a pipeline or ring-exchange reduce-scatter")

    def gemm_chunks(self, tp: int) -> dict[str, GemmChunks]:
        """Per block ("attention", "mlp"), the cuBLAS calls Transformer Engine cuts each overlapped
        GEMM into at TP `tp` (`GemmChunks`). A ring exchange: `tp` chunks of one rank's share of the
        tokens (an all-gather's: `tp / 2` of two shares under `aggregate`; TE's ring-exchange
        reduce-scatter ignores `aggregate`); a `pipeline`: `num_splits` chunks of the output
        columns, all the tokens each; `bulk` overlaps run the GEMM whole."""
        def chunks(g: GemmOverlap, gather: bool) -> int:
            if g.method == RING_EXCHANGE:
                return max(1, tp // 2) if g.aggregate and gather else tp
            return g.num_splits if g.method == PIPELINE and g.num_splits else 1

        def block(ag_f: GemmOverlap, rs_f: GemmOverlap, ag_b: GemmOverlap) -> GemmChunks:
            return GemmChunks(chunks(ag_f, True), chunks(rs_f, False), chunks(ag_b, True), rs_f.method == PIPELINE)

        return {"attention": block(self.qkv_fprop, self.proj_fprop, self.proj_dgrad),
                "mlp": block(self.fc1_fprop, self.fc2_fprop, self.fc2_dgrad)}

    def block_sms(self, *, attention: bool) -> TPOverlapSMs:
        """The SMs the simulator charges a block's overlapped exchanges (attention's or the MLP's)."""
        fprop, dgrad, wgrad = ((self.proj_fprop, self.qkv_dgrad, self.qkv_wgrad) if attention else
                               (self.fc2_fprop, self.fc1_dgrad, self.fc1_wgrad))
        if fprop.method == PIPELINE:
            return TPOverlapSMs(forward_reduce_scatter=fprop.num_sm, backward_gather=dgrad.num_sm,
                                backward_reduce_scatter=wgrad.num_sm, forward_sm_margin=fprop.set_sm_margin,
                                forward_splits=fprop.num_splits)
        # a ring exchange's transfers hold no SM: its num_sm only leaves a margin under set_sm_margin;
        # the GEMM in TP chunks (forward_splits None)
        return TPOverlapSMs(forward_reduce_scatter=fprop.num_sm if fprop.set_sm_margin else 0,
                            backward_gather=dgrad.num_sm, backward_reduce_scatter=wgrad.num_sm,
                            forward_sm_margin=fprop.set_sm_margin, forward_splits=None)


# --- the figures ---------------------------------------------------------------------------------

def _bulk(num_sm: int) -> GemmOverlap:
    return GemmOverlap(method=BULK, num_sm=num_sm)


def _pipeline(num_sm: int, num_splits: int, *, set_sm_margin: bool, fp8_buf: bool = False) -> GemmOverlap:
    return GemmOverlap(method=PIPELINE, num_sm=num_sm, num_splits=num_splits, set_sm_margin=set_sm_margin,
                       fp8_buf=fp8_buf)


def _ring(*, num_sm: int = 1, set_sm_margin: bool = False, aggregate: bool = False) -> GemmOverlap:
    return GemmOverlap(method=RING_EXCHANGE, num_sm=num_sm, set_sm_margin=set_sm_margin, aggregate=aggregate)


def _config(name: str, source: str, *, qkv_dgrad: int, qkv_wgrad: int, fc1_dgrad: int, fc1_wgrad: int,
            proj_fprop: GemmOverlap, fc2_fprop: GemmOverlap, gathers: GemmOverlap) -> UserbuffersConfig:
    """An entry whose four all-gathers (`qkv_fprop`, `proj_dgrad`, `fc1_fprop`, `fc2_dgrad`) are
    alike (`gathers`), as in every source here, and whose backward overlaps are `bulk` on the SMs given."""
    return UserbuffersConfig(name=name, source=source, qkv_fprop=gathers, proj_dgrad=gathers, fc1_fprop=gathers,
                             fc2_dgrad=gathers, qkv_dgrad=_bulk(qkv_dgrad), qkv_wgrad=_bulk(qkv_wgrad),
                             fc1_dgrad=_bulk(fc1_dgrad), fc1_wgrad=_bulk(fc1_wgrad), proj_fprop=proj_fprop,
                             fc2_fprop=fc2_fprop)


MEGATRON_BRIDGE = ("https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/0685ff5d5e636e06193291eb13b6bae531e958b4/"
                   "src/megatron/bridge/training/comm_overlap.py (the same at aae82005904475c0eeb5054ee5e9f78ffb6c5c76)")
_LAUNCHER = "https://github.com/NVIDIA/NeMo-Framework-Launcher/blob/{commit}/launcher_scripts/conf/training/tp_overlap/{file}"
_RING_AG = _ring()  # the all-gathers of every entry but the 405B launcher one: aggregate false, no margin
_RING_RS = _ring(num_sm=1, set_sm_margin=True)  # Megatron-Bridge's FP8 forward reduce-scatters

# the default: NVIDIA's bf16 H100 Llama 3 70B configuration, what the simulator ran before the registry
DEFAULT_UB_CONFIG = "userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192"

UB_CONFIGS: dict[str, UserbuffersConfig] = {c.name: c for c in (
    # Megatron-Bridge, H100 (its comment: Llama 3 70B)
    _config(DEFAULT_UB_CONFIG, MEGATRON_BRIDGE, qkv_dgrad=4, qkv_wgrad=24, fc1_dgrad=2, fc1_wgrad=4,
            proj_fprop=_pipeline(24, 4, set_sm_margin=True), fc2_fprop=_pipeline(16, 4, set_sm_margin=True),
            gathers=_RING_AG),
    _config("userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192", MEGATRON_BRIDGE, qkv_dgrad=4, qkv_wgrad=24,
            fc1_dgrad=2, fc1_wgrad=4, proj_fprop=_RING_RS, fc2_fprop=_RING_RS, gathers=_RING_AG),
    # Llama 3.1 405B
    _config("userbuffers_bf16_h100_h16384_tp8_cp2_mbs1_seqlen8192", MEGATRON_BRIDGE, qkv_dgrad=2, qkv_wgrad=24,
            fc1_dgrad=2, fc1_wgrad=2, proj_fprop=_pipeline(24, 4, set_sm_margin=True),
            fc2_fprop=_pipeline(8, 4, set_sm_margin=True), gathers=_RING_AG),
    _config("userbuffers_fp8_h100_h16384_tp8_cp2_mbs1_seqlen8192", MEGATRON_BRIDGE, qkv_dgrad=2, qkv_wgrad=24,
            fc1_dgrad=2, fc1_wgrad=2, proj_fprop=_RING_RS, fc2_fprop=_RING_RS, gathers=_RING_AG),
    # GPT-3 20B
    _config("userbuffers_bf16_h100_h6144_tp2_mbs2_seqlen2048", MEGATRON_BRIDGE, qkv_dgrad=8, qkv_wgrad=16,
            fc1_dgrad=4, fc1_wgrad=16, proj_fprop=_pipeline(16, 4, set_sm_margin=True),
            fc2_fprop=_pipeline(24, 4, set_sm_margin=True), gathers=_RING_AG),
    _config("userbuffers_fp8_h100_h6144_tp2_mbs2_seqlen2048", MEGATRON_BRIDGE, qkv_dgrad=8, qkv_wgrad=16,
            fc1_dgrad=4, fc1_wgrad=16, proj_fprop=_pipeline(16, 4, set_sm_margin=True, fp8_buf=True),
            fc2_fprop=_pipeline(24, 4, set_sm_margin=True, fp8_buf=True), gathers=_RING_AG),
    # GPT-3 175B
    _config("userbuffers_bf16_h100_h12288_tp4_mbs1_seqlen2048", MEGATRON_BRIDGE, qkv_dgrad=4, qkv_wgrad=4,
            fc1_dgrad=2, fc1_wgrad=4, proj_fprop=_pipeline(24, 4, set_sm_margin=True), fc2_fprop=_RING_RS,
            gathers=_RING_AG),
    _config("userbuffers_fp8_h100_h12288_tp4_mbs1_seqlen2048", MEGATRON_BRIDGE, qkv_dgrad=4, qkv_wgrad=4,
            fc1_dgrad=2, fc1_wgrad=4, proj_fprop=_RING_RS, fc2_fprop=_RING_RS, gathers=_RING_AG),
    # NeMo-Framework-Launcher (NeMo 1.x): the bf16 one Llama 3.1 70B's config loads by default
    # (training/llama/llama3_1_70b.yaml), the FP8 one NeMo 24.07's Llama 3 70B FP8 example names
    # (examples/training/llama/h100/llama3_70b_fp8.sh)
    _config("ub_cfg_h100_h8192_tp4_mbs1_seqlen8192",
            _LAUNCHER.format(commit="a3f310000241e33d93d3516495b786b253ebf760",
                             file="ub_cfg_h100_h8192_tp4_mbs1_seqlen8192.yaml"),
            qkv_dgrad=4, qkv_wgrad=24, fc1_dgrad=2, fc1_wgrad=4, proj_fprop=_pipeline(24, 4, set_sm_margin=True),
            fc2_fprop=_pipeline(16, 4, set_sm_margin=True), gathers=_RING_AG),
    _config("ub_cfg_h100_fp8_h8192_tp4_mbs1_seqlen8192",
            _LAUNCHER.format(commit="1015f23bae7ab496ff16adea23184572675aa0df",
                             file="ub_cfg_h100_fp8_h8192_tp4_mbs1_seqlen8192.yaml"),
            qkv_dgrad=4, qkv_wgrad=24, fc1_dgrad=2, fc1_wgrad=4,
            proj_fprop=_pipeline(24, 4, set_sm_margin=True, fp8_buf=True),
            fc2_fprop=_pipeline(16, 4, set_sm_margin=True, fp8_buf=True), gathers=_RING_AG),
    # NeMo-Framework-Launcher, Llama 3.1 405B (training/llama/llama3_1_405b.yaml loads the bf16 one; DGX
    # Cloud's NeMo 24.09 recipe runs it for FP8 too, with `fp8_buf` on for proj_fprop / fc2_fprop,
    # llama3.1/configure.sh): the all-gathers' ring exchanges with `aggregate` (GEMMs in tp / 2 chunks)
    _config("ub_cfg_h100_bf16_h16384_tp8_cp2_mbs1_seqlen8192",
            _LAUNCHER.format(commit="0937882d3a796237e2943c26088be7d3ea1b00a0",
                             file="ub_cfg_h100_bf16_h16384_tp8_cp2_mbs1_seqlen8192.yaml"),
            qkv_dgrad=2, qkv_wgrad=24, fc1_dgrad=2, fc1_wgrad=2, proj_fprop=_pipeline(24, 4, set_sm_margin=True),
            fc2_fprop=_pipeline(8, 4, set_sm_margin=True), gathers=_ring(aggregate=True)),
)}


def check_ub_config(name: str, *, where: str = "") -> str:
    """`name` if it is a registered configuration; otherwise one SpecError listing them."""
    return check_choice(name, UB_CONFIGS, "userbuffers config", where=where)


@functools.cache
def gemm_chunks(name: str, tp: int) -> dict[str, GemmChunks]:
    """Configuration `name`'s overlapped GEMMs' chunks at TP `tp` (`UserbuffersConfig.gemm_chunks`)."""
    return UB_CONFIGS[check_ub_config(name)].gemm_chunks(tp)


@functools.cache
def block_overlaps(name: str) -> tuple[TPOverlapSMs, TPOverlapSMs]:
    """Configuration `name`'s SMs of an attention block and of an MLP block (cached: the simulator
    asks once per block)."""
    config = UB_CONFIGS[check_ub_config(name)]
    return config.block_sms(attention=True), config.block_sms(attention=False)


def check_ub_config_applies(name: str, *, tp_comm_overlap: bool, tp: int | None = None, fsdp: bool = False) -> None:
    """A configuration other than the default where it can change nothing, one SpecError: it sets
    the userbuffers overlap of Megatron's sequence-parallel TP exchanges, which run only with
    `tp_comm_overlap`, at TP > 1, on the ZeRO-1 layout (under FSDP the simulator runs TP's overlap
    without userbuffers' SMs, `sim.fsdp`). `tp` None: no layout yet (the options' own rule only),
    as `RunOptions.check` and the search's question ask."""
    if name == DEFAULT_UB_CONFIG:
        return
    if not tp_comm_overlap:
        raise SpecError(f"--tp-comm-overlap-cfg {name} changes nothing with --no-tp-comm-overlap: it configures "
                        "Transformer Engine's userbuffers, which run only with the TP communication overlap")
    if tp == 1:
        raise SpecError(f"--tp-comm-overlap-cfg {name} changes nothing at --tp 1: there are no TP exchanges to "
                        "overlap")
    if fsdp:
        raise SpecError(f"--tp-comm-overlap-cfg {name}: Megatron's userbuffers configuration, not under --fsdp "
                        "(torch's fully_shard with TP, whose overlap the simulator runs without userbuffers)")
