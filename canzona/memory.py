"""Memory per GPU of a DP x TP (x PP) layout under each step policy (docs/design.md §7.1).

A pure model, no torch: it counts what each policy stores, as the runtime (`canzona/runtime/`)
stores it, so that a layout that cannot fit is reported before anything is launched.

Per GPU, in bytes:

- persistent: bf16 weights (the local TP shards, in the plan's padded buckets), gradient buffers
  (whole buckets on every rank, `grad_bytes` per element: Megatron's fp32 main grads, into which
  the runtime accumulates backward's bf16 gradients directly), fp32 master
  weights of what the rank updates, matrix-optimizer state (by owner: `TPSchedule.state_bytes`),
  AdamW state (sharded over DP except under `sc`); the AdamW buffer is padded to `align x dp`
  elements even when it holds no parameter (an EP rank's experts), and is then fp32, as the
  runtime allocates it;
- the larger of two transient peaks that never coexist: the activations of forward / backward
  (Korthikanti et al. 2022, arXiv 2205.05198) with the buffers of the gradient reduce-scatters in
  flight during backward (`canzona.reductions.temporary_elements`: every bucket's, as the runtime
  waits for them all before the step), and the buffers of the optimizer step (TP gather /
  scatter buffers, full gradients and updates, kernel workspace, AdamW temporaries, packed
  parameter gathers);
- an allowance for the CUDA context, NCCL buffers and allocator fragmentation.

Under expert parallelism a GPU holds two parts, each counted as above on its own layout (the
dense part over DP x TP, its EP rank's experts over EDP x ETP) and added (`LayoutMemory.with_experts`,
what the simulator reports under `--ep`); with ETP 1, at TP 1 and with a TP-split dense part (DP 2 x
TP 2 x EP 2), every persistent component and the reduce-scatter buffers are those the runtime
allocates, rank by rank (`tests/runtime/test_memory_runtime_ep.py`). The token dispatch all-to-alls' buffers are the
model's forward / backward, not the optimizer's: they belong to `activations` (whose MoE MLP term
counts the routed copies' gate / up outputs and product, and the dispatched copies the grouped fc1
saves with the router's maps: `_moe_saved_bytes`), at the fullest EP rank's pairs (`fullest_rank_load`:
the router's skew and random routing's fluctuation, as the timing's busiest rank). The flex dispatchers'
own communication buffers (DeepEP's, HybridEP's), allocated once for the run, are persistent
(`dispatcher_buffers`: `deepep_buffer_bytes`, `hybridep_buffer_bytes`).

`memory_per_gpu` returns a `LayoutMemory`: one `RankMemory` per GPU of a pipeline stage, the worst
rank, `fits(capacity)` and a one-line explanation. Computing 4096 ranks takes a fraction of a second.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from functools import cached_property
from typing import Any

from canzona.batching import compute_windows, shape_batches
from canzona.cost import (
    FP32_STEP,
    StepDtypes,
    adamw_moments_bytes,
    state_bytes,
    update_dtype_state_bytes,
)
from canzona.decoder import Architecture
from canzona.dp.layout import ceil_to, even_cuts
from canzona.errors import SpecError
from canzona.experts import expert_params, expert_width, rank_shares
from canzona.hardware import DEFAULT_FIXED_OVERHEAD
from canzona.optimizers import (
    AdamWConfig,
    MuonConfig,
    ShampooConfig,
    SOAPConfig,
    default_config,
    matrix_optimizer,
)
from canzona.pipeline import (
    EVEN_SPLIT,
    PipelineSplit,
    chunk_layers,
    peak_in_flight,
    peak_layers_in_flight,
    rank_layers,
)
from canzona.plan import Plan, check_plan_config, check_plan_matches
from canzona.recompute import (
    FULL,
    RECOMPUTE_MODES,
    SELECTIVE_LAYER,
    SELECTIVE_OP,
    check_recompute,
    check_recompute_method,
    check_selective_ac_option,
    checkpoint_groups,
    checkpointed,
    saved_mm_widths,
    selective_layer_checkpointed,
)
from canzona.reductions import check_reduce_scatter, temporary_elements_by_rank
from canzona.routing import RANDOM, busiest_rank, check_routing
from canzona.spec import DTYPE_BYTES, ModelSpec, ParamSpec, Role
from canzona.step_options import STEP_DEFAULTS
from canzona.step_policies import PARAMS_BY_OWNER, StepPolicy, get_step_policy
from canzona.step_schedule import (
    PIPELINED,
    SERIAL,
    GroupStep,
    ScheduleKeys,
    Task,
    check_tp_mode,
    tp_schedule,
)
from canzona.tp import EVERY_RANK

FP8_BYTES = DTYPE_BYTES["fp8"]
# bytes per linear-weight element Transformer Engine keeps under FP8 beside the bf16 weight: the FP8
# cast cached across micro-batches and its transpose (the data gradient's operand)
FP8_WEIGHT_CACHE = 2 * FP8_BYTES


def fp8_linear_params(spec: ModelSpec) -> list[ParamSpec]:
    """The weights of the linear modules that run in FP8 (`--precision fp8`): the layers'
    matrices and expert stacks, not the routers, embedding, head or vectors."""
    return [p for p in spec.params if p.layer is not None and p.role in (Role.MATRIX, Role.EXPERT)
            and len(p.shape) >= 2]


FP32 = DTYPE_BYTES["fp32"]
BF16 = DTYPE_BYTES["bf16"]
EMPTY_BUFFER_BYTES = FP32  # a flat buffer of no parameter: fp32 in the runtime (as `canzona.step_collectives` sends it)
GB = 10**9  # capacities print in decimal GB (hardware profiles: `gpu.memory_bytes` 84.9e9, 79.11 GiB, for an H100 SXM)

# What no tensor count gives (docs/design.md §7.1). A roughly fixed amount per process outside
# PyTorch's caching allocator: the CUDA context with its loaded kernels, measured at 287 MB (lazy
# module loading, PyTorch's default since 1.13) to 667 MB (eager) for PyTorch alone
# (https://github.com/pytorch/pytorch/pull/86509), and NCCL's communicator buffers (cuBLAS's
# workspaces come from the caching allocator). Fragmentation: the caching allocator splits and
# reuses the blocks of what is freed and allocated again every iteration (activations,
# reduce-scatter and step buffers); the persistent buffers (weights, gradient buffers, masters,
# optimizer state) are a few flat tensors allocated once, at start, so the fraction applies to the
# transient peak only: 5% of it, the factor Megatron-LM's own estimate puts on activations for
# "optimizer and miscellaneous temporaries" (megatron/training/theoretical_memory_usage.py,
# compute_activation_memory_without_sp; https://github.com/NVIDIA/Megatron-LM), which torchtitan's
# published peaks (max reserved: the allocator's memory with its fragmentation) bear out within 2%
# (tests/sim/test_loss_memory.py). Both are **assumptions** bounded by the published runs, which
# ran: the tightest is DGX Cloud's Llama 3.1 405B bf16 run on 576 H100s (NeMo 24.09, TP 8 x PP 9 x
# VP 7 x CP 2, docs/design.md §9.6), whose counted tensors, 82.27 GB, leave 2.67 GB of the 84.94 a
# process is given, of which 5% of its 38.16 GB transient peak is 1.91 GB, so the fixed part is at
# most 0.76 GB: 0.75 GB, the round figure under that bound (it was 1.95 GB, bounded by NeMo
# AutoModel's Qwen3-30B-A3B until that row's persistent bytes and loss were counted as the
# framework holds them, and 2 GB before). The next tightest: DGX Cloud's Llama 3.1 8B at CP 2 on 8
# H100s, 3.23 GB left over a 21.49 GB transient peak (at most 2.15 GB fixed).
# (The fixed part is defined in canzona.hardware, which refuses a profile with no memory beside it.)
DEFAULT_FRAGMENTATION = 0.05

# Transformer Engine's userbuffers (the TP communication overlap, `tp_comm_overlap`): `initialize_ub`
# registers one buffer of the launcher's `shape` per overlapped GEMM, `[seq_length x micro_batch_size
# / context_parallel_size, hidden_size]` (Megatron-LM `megatron/training/initialize.py`
# `_initialize_tp_communicators`, NeMo 1.x `MegatronGPTModel.initialize_ub_func`), each allocated
# outside PyTorch's caching allocator for the whole run (`register_user_buffer_collective`, cudaMalloc).
# Ten of them (NVIDIA/TransformerEngine `transformer_engine/pytorch/module/base.py` `initialize_ub`,
# the names of NeMo-Framework-Launcher's `ub_cfg_h100_h8192_tp4_mbs1_seqlen8192.yaml`): the six
# all-gather buffers (qkv_fprop, qkv_dgrad, proj_dgrad, fc1_fprop, fc1_dgrad, fc2_dgrad), in FP8
# under FP8; the two pipelined reduce-scatters of the forward (proj_fprop, fc2_fprop), in FP8 under
# FP8 as the launcher's FP8 configuration sets (`fp8_buf: 1`, `ub_cfg_h100_fp8_h8192_tp4_mbs1_seqlen8192.yaml`);
# the two bulk reduce-scatters of the backward (qkv_wgrad, fc1_wgrad), in the activations' dtype.
UB_FP8_BUFFERS = 8  # in FP8 under FP8, else in the activations' dtype
UB_WIDE_BUFFERS = 2  # always in the activations' dtype

# The communication buffers of Megatron's flex token dispatchers (`sim.ep_dispatch`), allocated once
# for the run outside PyTorch's caching allocator and kept (`deepep_buffer_bytes`, `hybridep_buffer_bytes`).
# DeepEP's normal (high-throughput) mode: Megatron-LM `megatron/core/transformer/moe/fused_a2a.py`
# `get_buffer` (NeMo AutoModel's `nemo_automodel/components/moe/megatron/fused_a2a.py` `get_buffer`
# alike) sizes one `deep_ep.Buffer` per EP group by the largest of
# `Config.get_nvl_buffer_size_hint` / `get_rdma_buffer_size_hint` over `Buffer.get_dispatch_config(n)`
# and `Buffer.get_combine_config(n)`, with `hidden_bytes = hidden x max(element_size, 2)`
# (`get_hidden_bytes`: 2 x hidden for bf16 and FP8 tokens alike). The configs' token counts, per EP
# size: (NVL send, NVL receive, RDMA send, RDMA receive) chunked tokens, dispatch then combine
# (deepseek-ai/DeepEP `deep_ep/buffer.py` `Buffer.get_dispatch_config` / `get_combine_config`, commit
# dcfd954851157f0bf683e1c3f1a7778f78344759); any other EP size DeepEP refuses ("Unsupported number of EP ranks").
DEEPEP_CONFIGS = {
    2: ((24, 256, 6, 128), (10, 256, 6, 128)),
    4: ((6, 256, 6, 128), (9, 256, 6, 128)),
    8: ((6, 256, 6, 128), (4, 256, 6, 128)),
    16: ((36, 288, 20, 128), (4, 288, 12, 128)),
    24: ((8, 288, 32, 128), (1, 288, 8, 128)),
    32: ((32, 288, 32, 128), (1, 288, 8, 128)),
    64: ((20, 288, 28, 128), (1, 288, 20, 128)),
    128: ((20, 560, 32, 128), (1, 560, 12, 128)),
    144: ((32, 720, 12, 128), (2, 720, 8, 128)),
    160: ((28, 720, 12, 128), (2, 720, 8, 128)),
}
# deepseek-ai/DeepEP `csrc/kernels/configs.cuh`: NUM_MAX_NVL_PEERS (ranks of one NVLink domain) and the
# workspace every `Buffer` cudaMallocs beside its NVL buffer (NUM_WORKSPACE_BYTES, "Create 32 MiB workspace",
# `csrc/deep_ep.cpp` `Buffer::Buffer`)
DEEPEP_NVL_PEERS = 8
DEEPEP_WORKSPACE_BYTES = 32 * 1024 * 1024
# `csrc/config.hpp` `Config::get_nvl_buffer_size_hint` / `get_rdma_buffer_size_hint` (commit
# 030cdf0ad4538c1d9ee92872b5be77d01b067a60): room per received token for kNumMaxTopK (128) int64
# expert indices and float weights and kNumMaxScales (128) float scales, and a `SourceMeta` (two ints,
# `csrc/kernels/internode.cu` `internode::get_source_meta_bytes`, counted where DeepEP is built with
# NVSHMEM, as it is for EP across nodes)
DEEPEP_MAX_TOPK = 128
DEEPEP_MAX_SCALES = 128
DEEPEP_SOURCE_META_BYTES = 8
# HybridEP (deepseek-ai/DeepEP's hybrid_ep): `deep_ep/hybrid_ep_buffer.py` `HybridEPBuffer.__init__` (commit
# 098da2a6dee107028535a5776248891d6e376918) sizes its buffers for max(tokens, 512) tokens per rank and
# shares one NVL buffer between dispatch and combine (`use_shared_buffer = True`)
HYBRIDEP_MIN_TOKENS = 512


def _align(value: int, step: int) -> int:
    return -(-value // step) * step


def deepep_buffer_bytes(ranks: int, hidden: int, sms: int) -> int:
    """Bytes of DeepEP's normal-mode `Buffer` on each GPU of an EP group of `ranks` GPUs, whose
    kernels run on `sms` SMs (`Buffer.num_sms`, `set_deepep_num_sms`), for tokens `hidden` wide:
    the NVL buffer at the largest hint of the dispatch and combine configs, its barrier signals and
    peer pointers (`csrc/deep_ep.cpp` `Buffer::Buffer`: one cudaMalloc of num_nvl_bytes + 8 ints + 16
    pointers), the 32 MiB workspace, and across nodes (more than `DEEPEP_NVL_PEERS` ranks) the RDMA
    buffer (`Buffer::sync`: `internode::alloc`, nvshmem_align in NVSHMEM's symmetric heap). Not counted:
    NVSHMEM's own heap and state beyond that buffer (DeepEP sets NVSHMEM_CUMEM_GRANULARITY to 512 MiB;
    how much of it NVSHMEM maps is not in DeepEP's source)."""
    if ranks not in DEEPEP_CONFIGS:
        raise SpecError(f"DeepEP has no dispatch / combine config for {ranks} EP ranks (deep_ep.Buffer."
                        f"get_dispatch_config: {', '.join(map(str, DEEPEP_CONFIGS))})")
    if not (isinstance(sms, int) and sms >= 2 and sms % 2 == 0):
        raise SpecError(f"DeepEP runs an even number of SMs (two per channel), got {sms!r}")
    hidden_bytes = 2 * hidden  # get_hidden_bytes: hidden x max(element_size, 2)
    channels = sms // 2
    rdma_ranks = max(ranks // DEEPEP_NVL_PEERS, 1)
    nvl_ranks = min(ranks, DEEPEP_NVL_PEERS)
    per_token = (hidden_bytes + DEEPEP_SOURCE_META_BYTES + DEEPEP_MAX_TOPK * (8 + 4) + DEEPEP_MAX_SCALES * 4)
    nvl = rdma = 0
    for _, nvl_recv, rdma_send, rdma_recv in DEEPEP_CONFIGS[ranks]:
        hint = channels * nvl_ranks * ((2 * rdma_ranks + 3) * 4 + nvl_recv * per_token)
        nvl = max(nvl, _align(hint, 128))
        if ranks > DEEPEP_NVL_PEERS:  # "Legacy mode": no RDMA buffer within one NVLink domain
            recv = _align(rdma_recv, rdma_send)  # Config::Config rounds it up to a whole number of sends
            hint = channels * rdma_ranks * ((DEEPEP_NVL_PEERS * 2 + 2) * 2 * 4 + recv * 2 * (per_token + 16))
            # no 1 MiB "to be safe" margin: one stored revision (030cdf0) adds it, the later
            # config.hpp (3861241, with topk_idx_t) and every other stored copy do not
            rdma = max(rdma, _align(hint, 128))
    signals = DEEPEP_NVL_PEERS * (4 + 8 + 8)  # barrier signals, buffer and signal pointers
    return nvl + signals + DEEPEP_WORKSPACE_BYTES + rdma


def hybridep_buffer_bytes(ranks: int, ranks_per_node: int, tokens: int, hidden: int, local_experts: int) -> int:
    """Bytes of HybridEP's buffers on each GPU of an EP group of `ranks` GPUs in NVLink domains of
    `ranks_per_node`, for `tokens` tokens per rank of one dispatch (the micro-batch's tokens on the
    rank), `hidden` wide, bf16 (HybridEP's UINT16 tokens), with `local_experts` experts per rank.
    The NVL buffers (deepseek-ai/DeepEP `csrc/hybrid_ep/buffer/intranode.cu` `NVLCoordinator::
    allocate_combine_buffers` / `allocate_dispatch_buffers`, commit 2540b8abfc7551597b259c05132ef1d995f0885f),
    for the worst case of every token of the group routed to this rank (max(tokens, 512) x `ranks`
    tokens): the tokens (2 bytes a value), the probabilities (a float per expert of the NVLink domain),
    the FP8 scaling factors (a float per 128 values, allocated whatever the dtype), the dispatch sharing
    the combine's token and probability buffers. Across NVLink domains the RDMA buffers, cudaMalloc'd
    (`csrc/hybrid_ep/buffer/internode.cu` `RDMACoordinator::allocate_dispatch_buffers` /
    `allocate_combine_buffers`, commit 2410713f4ad880e30a5e03d0a487637598aed6ab): the dispatch's
    attention-side input (the rank's tokens, probabilities over every expert, scaling factors) and its
    staging for the other domains' tokens, probabilities and scaling factors; the combine's intra-node
    reduction and inter-node staging of tokens and probabilities, one per other domain. Not counted:
    the preprocessing scratch, the flags (bytes), the queue pairs."""
    if ranks % ranks_per_node:  # as Megatron asserts (fused_a2a.py `_hybrid_ep_num_nodes`)
        raise SpecError(f"HybridEP's {ranks} ranks are not whole NVLink domains of {ranks_per_node}")
    nodes = ranks // ranks_per_node
    per_rank = max(tokens, HYBRIDEP_MIN_TOKENS)
    scales = hidden // 128
    domain_experts = local_experts * ranks_per_node
    worst = per_rank * ranks  # NVLCoordinator::max_num_of_tokens
    nvl = worst * (hidden * 2 + domain_experts * 4 + scales * 4)
    others = nodes - 1
    dispatch = per_rank * (hidden * 2 + local_experts * ranks * 4 + scales * 4) \
        + per_rank * others * (hidden * 2 + domain_experts * 4 + scales * 4) if others else 0
    combine = 2 * per_rank * others * (hidden * 2 + domain_experts * 4)
    return nvl + dispatch + combine


# --- inputs -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerDims:
    """The architecture numbers activations depend on. Decoupled from the catalog: `from_config`
    reads any object with the fields of `canzona.catalog.Qwen3Config`.

    The defaults describe the paper's GPT layer (multi-head attention, a 4h GeLU MLP, dropout after
    attention scores and after each block), for which the per-layer count is exactly
    `s*b*h*(34 + 5*a*s/h)` bytes; `from_config` describes a Qwen3 layer (grouped-query attention,
    SwiGLU MLP, no dropout, RMSNorm on q and k)."""

    layers: int
    hidden: int
    q_heads: int
    ffn: int
    vocab: int
    kv_heads: int | None = None  # None: as many as q_heads
    head_dim: int | None = None  # None: hidden // q_heads
    gated_mlp: bool = False  # SwiGLU: gate and up projections feed an elementwise product
    dropout: bool = True  # 1-byte dropout masks (the paper's GPT); Qwen3 trains without dropout
    qk_norm: bool = False  # per-head norms on q and k store their inputs
    # a mixture-of-experts MLP (0: a dense MLP): the router's width and the experts each token is
    # routed to; `ffn` is then experts_per_token x one expert's width (`sim.simulate.layer_dims`)
    experts: int = 0
    experts_per_token: int = 0

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "q_heads", "ffn", "vocab"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise SpecError(f"{name} must be a whole number >= 1, got {getattr(self, name)!r}")
        for name in ("experts", "experts_per_token"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                raise SpecError(f"{name} must be a whole number >= 0, got {value!r}")
        if (self.experts == 0) != (self.experts_per_token == 0) or self.experts_per_token > self.experts:
            raise SpecError(f"a mixture-of-experts layer routes each token to 1..experts of its experts: got "
                            f"experts_per_token {self.experts_per_token} of {self.experts} experts")
        for name in ("kv_heads", "head_dim"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise SpecError(f"{name} must be a whole number >= 1 or None, got {value!r}")

    @property
    def q_dim(self) -> int:
        return self.q_heads * (self.head_dim or self.hidden // self.q_heads)

    @property
    def kv_dim(self) -> int:
        return (self.kv_heads or self.q_heads) * (self.head_dim or self.hidden // self.q_heads)

    @classmethod
    def gpt(cls, layers: int, hidden: int, heads: int, vocab: int) -> LayerDims:
        """The paper's GPT layer: `h = heads * head_dim`, MLP width 4h, GeLU, dropout."""
        return cls(layers, hidden, heads, 4 * hidden, vocab)

    @classmethod
    def from_config(cls, cfg: Any) -> LayerDims:
        """A Qwen3 configuration (`layers`, `hidden`, `q_heads`, `ffn`, `vocab`, `kv_heads`,
        `head_dim`); the layer flags may be overridden by fields of the same names on `cfg`."""
        return cls(cfg.layers, cfg.hidden, cfg.q_heads, cfg.ffn, cfg.vocab,
                   getattr(cfg, "kv_heads", None), getattr(cfg, "head_dim", None),
                   gated_mlp=bool(getattr(cfg, "gated_mlp", True)), dropout=bool(getattr(cfg, "dropout", False)),
                   qk_norm=bool(getattr(cfg, "qk_norm", True)))


@dataclass(frozen=True)
class MemorySetup:
    """Workload and implementation choices the memory depends on (defaults: the simulator's
    workload, Megatron's mixed precision, flash attention, sequence parallelism)."""

    seq_len: int = 4096
    micro_batch: int = 1  # sequences per micro-batch
    param_bytes: int = 2  # working weights (bf16)
    grad_bytes: int = 4  # main gradients, reduced and read by the optimizer (Megatron: fp32)
    activation_bytes: int = 2
    # fp32 masters of what a rank updates, when param_bytes < 4 (DistributedOptimizer(master_weights=...),
    # `sim.workload.Workload.master_weights`); without them no fp32 copy: the state that follows the
    # update, AdamW's moments and the kept gradient shards in the parameters' dtype (`update_state_bytes`,
    # `shard_grad_bytes`), as the runtime keeps them and a model built in bf16 under FSDP2 with
    # torch's AdamW (NeMo AutoModel's)
    master_weights: bool = STEP_DEFAULTS.master_weights
    reduce_scatter: str = STEP_DEFAULTS.reduce_scatter  # the gradient reduce-scatter (canzona.reductions)
    recompute: str = "none"  # one of canzona.recompute.RECOMPUTE_MODES
    # under full recompute, Megatron's --recompute-method and --recompute-num-layers
    # (canzona.recompute.RECOMPUTE_METHODS; None: every layer checkpointed on its own)
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    # under selective-layer, torchtitan's selective_ac_option K (None: its default, 2)
    selective_ac_option: int | None = None
    flash_attention: bool = True  # no s x s attention scores are stored
    sequence_parallel: bool = True  # with TP, norms / dropout / block inputs are split over TP too
    micro_batches: int | None = None  # per DP rank per iteration: caps the 1F1B micro-batches in flight
    tp_mode: str = STEP_DEFAULTS.tp_mode  # the order of the micro-groups' operations (step_schedule)
    batch_kernels: bool = STEP_DEFAULTS.batch_kernels  # same-shape matrices of a host as one kernel (canzona.batching)
    # overlap_step: every micro-group's updates, its scatter buffers and a copy of the state they
    # advance are held until the step check commits them, while the reduce-scatters are in flight
    overlap_step: bool = STEP_DEFAULTS.overlap_step
    # torch.amp.GradScaler around the step: under overlap_step each early update reads its landed
    # gradient times the inverse scale (`MatrixStep.speculate(scale=)`), a product per hosted piece
    grad_scaler: bool = False
    stream_tp_sync: bool = False  # tp-sync one matrix at a time, instead of the schedule's one group
    fixed_overhead_bytes: int = DEFAULT_FIXED_OVERHEAD
    fragmentation: float = DEFAULT_FRAGMENTATION  # fraction of the transient peak (`overhead`)
    # Transformer Engine's userbuffers (`userbuffer_bytes`), allocated for the run when the TP
    # communication overlap is on; 0: none (TP 1, the overlap off, FSDP, the runtime's own layouts)
    userbuffers: int = 0
    # the flex token dispatcher's communication buffers (`deepep_buffer_bytes`, `hybridep_buffer_bytes`),
    # allocated for the run; 0: none (the alltoall dispatcher, EP 1)
    dispatcher_buffers: int = 0
    # FP8 linear layers (Transformer Engine, `--precision fp8`): their inputs are saved for the
    # backward in FP8 and every linear weight keeps a cached FP8 copy and transpose (`fp8_linear_params`)
    fp8: bool = False
    # bytes a logit of the copy the loss keeps for its backward: fp32 (Megatron's, the paper's
    # `4*s*b*V`: the loss upcasts the logits), or the logits' own dtype for a loss that does not
    # upcast (NeMo AutoModel's MaskedCrossEntropy(fp32_upcast=False) saves its log-softmax in bf16)
    # (0: the loss keeps no copy: Transformer Engine's fused cross-entropy overwrites the logits
    # with their gradient, sim.cross_entropy)
    loss_bytes: int = FP32
    # the loss is PyTorch's composite `F.cross_entropy` (`log_softmax` then `nll_loss`, two autograd
    # nodes), as the FSDP2 frameworks' training loops run it (torchtitan, NeMo AutoModel, Hugging
    # Face); False: Megatron's vocab-parallel cross-entropy, whose backward works in place on the
    # softmax it saved (`loss_logit_bytes`)
    loss_autograd: bool = False
    # under `loss_autograd`, the training loop keeps the model's logits alive through the backward
    # (NeMo AutoModel's loop holds the model's output; torchtitan deletes `pred` before
    # `loss.backward()`, and Hugging Face's Trainer drops the output once `compute_loss` returns)
    loss_holds_logits: bool = False
    # Megatron's store_param_remainders (precision-aware optimizer) / Apex DistributedFusedAdam's:
    # of each fp32 master only the 16 bits the bf16 weight lacks are kept (2 bytes, not 4)
    store_param_remainders: bool = False
    # FP8 primary weights (NeMo 1.x's fp8_params, Transformer Engine's fp8_model_init): under `fp8` each
    # linear weight is kept in FP8 with its cached transpose and no bf16 copy (`FP8_WEIGHT_CACHE` in all,
    # not on top of the working weight), and the optimizer keeps full fp32 masters
    fp8_params: bool = False
    # Megatron's bias_activation_fusion (sim.workload.Workload): off, its unfused SwiGLU saves the
    # silu output and the offset-added up half besides fc1's output (sim.unfused_kernels)
    bias_activation_fusion: bool = True
    # expert tensor parallelism (Megatron's expert_tensor_parallel_size): the routed tokens are
    # gathered over the ETP group before the column-parallel fc1, whose saved input grows by it
    expert_tp: int = 1
    # Megatron's EP all-to-all overlap (`overlap_moe_expert_parallel_comm`, sim.ep_overlap): the
    # combined 1F1B schedule pairs a forward layer with a backward one, the forward's built first
    ep_overlap: bool = False
    # expert parallelism and how the router loads the EP ranks, as the timing takes them
    # (`sim.model_work._expert_block`): the fullest EP rank saves the expert activations of the
    # pairs it receives, above the mean rank's (`fullest_rank_load`). `router_imbalance`: the persistent
    # skew (`canzona.experts.rank_shares`: a number or the router's histogram); `routing`: the
    # routing the loads follow (`canzona.routing`; balanced under AutoModel's FakeBalancedGate:
    # `sim.ep_dispatch.EpDispatcher.load_routing`)
    ep: int = 1
    router_imbalance: float | tuple[float, ...] = 1.0
    routing: str = RANDOM

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch", "param_bytes", "grad_bytes", "activation_bytes", "expert_tp", "ep"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise SpecError(f"{name.replace('_', ' ')} must be a whole number >= 1, got {value!r}")
        if not isinstance(self.master_weights, bool):
            raise SpecError(f"master_weights must be true or false, got {self.master_weights!r}")
        if not (isinstance(self.loss_bytes, int) and self.loss_bytes >= 0):
            raise SpecError(f"loss bytes must be a whole number >= 0, got {self.loss_bytes!r}")
        for name in ("loss_autograd", "loss_holds_logits"):
            if not isinstance(getattr(self, name), bool):
                raise SpecError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.loss_holds_logits and not self.loss_autograd:
            raise SpecError("loss_holds_logits describes a training loop around PyTorch's F.cross_entropy "
                            "(loss_autograd); Megatron's loss holds no logits past its forward")
        if self.loss_autograd and not self.loss_bytes:
            raise SpecError("PyTorch's F.cross_entropy saves its log-softmax: loss bytes must be >= 1 under "
                            "loss_autograd")
        if self.store_param_remainders and not (self.master_weights and self.param_bytes == BF16):
            raise SpecError("store_param_remainders keeps the low half of fp32 masters beside bf16 weights: it needs "
                            f"master weights and 2-byte parameters, got {self.param_bytes}-byte parameters"
                            f"{'' if self.master_weights else ' without masters'}")
        if self.fp8_params and not self.fp8:
            raise SpecError("fp8_params keeps the linear weights in FP8: it needs fp8")
        if self.fp8_params and self.store_param_remainders:
            raise SpecError("fp8_params with store_param_remainders: an FP8 weight does not hold an fp32 master's "
                            "high half, so the masters are kept whole")
        if not isinstance(self.bias_activation_fusion, bool):
            raise SpecError(f"bias_activation_fusion must be true or false, got {self.bias_activation_fusion!r}")
        if not isinstance(self.ep_overlap, bool):
            raise SpecError(f"ep_overlap must be true or false, got {self.ep_overlap!r}")
        if not isinstance(self.grad_scaler, bool):
            raise SpecError(f"grad_scaler must be true or false, got {self.grad_scaler!r}")
        check_routing(self.routing)
        check_recompute(self.recompute)
        check_recompute_method(self.recompute, self.recompute_method, self.recompute_num_layers)
        check_selective_ac_option(self.recompute, self.selective_ac_option)
        check_reduce_scatter(self.reduce_scatter)
        if self.micro_batches is not None and not (isinstance(self.micro_batches, int) and self.micro_batches >= 1):
            raise SpecError(f"micro batches must be a whole number >= 1, got {self.micro_batches!r}")
        check_tp_mode(self.tp_mode)
        if not (isinstance(self.fixed_overhead_bytes, int) and self.fixed_overhead_bytes >= 0):
            raise SpecError(f"fixed overhead must be a whole number of bytes >= 0, got {self.fixed_overhead_bytes!r}")
        if not (isinstance(self.fragmentation, (int, float)) and 0 <= self.fragmentation < 1):
            raise SpecError(f"fragmentation must be a fraction in [0, 1), got {self.fragmentation!r}")
        if not (isinstance(self.userbuffers, int) and self.userbuffers >= 0):
            raise SpecError(f"userbuffers must be a whole number of bytes >= 0, got {self.userbuffers!r}")
        if not (isinstance(self.dispatcher_buffers, int) and self.dispatcher_buffers >= 0):
            raise SpecError(f"dispatcher buffers must be a whole number of bytes >= 0, got {self.dispatcher_buffers!r}")

    @property
    def has_masters(self) -> bool:
        return self.master_weights and self.param_bytes < FP32

    @property
    def update_state_bytes(self) -> int:
        """Bytes an element of the optimizer state that follows the update takes (the registry's
        `update_dtype_state_bytes`: Muon's momentum, AdamW's moments): fp32 beside fp32 masters, else
        the parameters' own dtype, as DistributedOptimizer(master_weights=False) keeps everything."""
        return FP32 if self.has_masters else self.param_bytes

    @property
    def shard_grad_bytes(self) -> int:
        """Bytes of an element of a rank's kept gradient shards: the reduction's dtype (`grad_bytes`),
        or the parameters' own without masters where it is lower (FSDP2 casts each reduced shard to
        its parameter's dtype)."""
        return self.grad_bytes if self.has_masters else min(self.grad_bytes, self.param_bytes)

    @property
    def step_dtypes(self) -> StepDtypes:
        """The bytes a matrix optimizer's own elementwise passes read and write an element of the
        gradient, the state that follows the update and the parameter (`canzona.cost.StepDtypes`):
        fp32 beside fp32 masters (the planner's pricing, which the plan's per-matrix seconds carry),
        and for fp32 parameters; else the kept gradient shards' dtype (`shard_grad_bytes`), the
        update-following state's (`update_state_bytes`) and the parameters' own, as
        DistributedOptimizer(master_weights=False) and FsdpOptimizer keep them."""
        if self.has_masters or self.param_bytes >= FP32:
            return FP32_STEP
        return StepDtypes(grad=self.shard_grad_bytes, state=self.update_state_bytes, param=self.param_bytes)

    def adamw_state_bytes(self, numel: int) -> int:
        """AdamW's two moments of `numel` elements, in the dtype they follow (`update_state_bytes`)."""
        return adamw_moments_bytes(numel, self.update_state_bytes)

    @property
    def master_bytes(self) -> int:
        """Bytes a master weight takes beside its working weight: fp32, or its low half under
        `store_param_remainders` (the bf16 weight holds the high half)."""
        if not self.has_masters:
            return 0
        return FP32 - self.param_bytes if self.store_param_remainders else FP32

    @property
    def update_bytes(self) -> int:
        """Bytes per element of an update direction as sent and applied (the runtime: fp32 with
        masters, the gradients' dtype without)."""
        return FP32 if self.has_masters else self.grad_bytes

    def overhead(self, transient: int) -> int:
        """The allowance for the CUDA context, NCCL and the allocator's fragmentation beside the
        counted tensors, of which `transient` bytes (the larger transient peak, `RankMemory.
        transient`) are freed and allocated again every iteration (`DEFAULT_FRAGMENTATION`)."""
        return self.fixed_overhead_bytes + math.ceil(self.fragmentation * transient)

    @classmethod
    def dtypes_of(cls, workload: Any) -> MemorySetup:
        """The dtypes of an object with the fields of `sim.workload.Workload` and nothing else: what
        the step's passes read of it (`update_bytes`, `update_state_bytes`), for a caller with no
        activation settings to give."""
        return cls(param_bytes=workload.param_bytes, grad_bytes=workload.grad_bytes,
                   master_weights=workload.master_weights)

    @classmethod
    def from_workload(cls, workload: Any, **overrides: Any) -> MemorySetup:
        """From an object with the fields of `sim.workload.Workload` (read by name; not imported)."""
        names = {f.name for f in fields(cls)}
        values = {k: getattr(workload, k) for k in ("seq_len", "micro_batch", "param_bytes", "grad_bytes",
                                                    "activation_bytes", "loss_bytes", "loss_holds_logits",
                                                    "master_weights", "store_param_remainders",
                                                    "fp8_params", "bias_activation_fusion")
                  if hasattr(workload, k)}
        if hasattr(workload, "loss_copy_bytes"):  # the copy its loss path keeps (Workload.loss_copy_bytes)
            values["loss_bytes"] = workload.loss_copy_bytes
        values["fp8"] = getattr(workload, "precision", "bf16") == "fp8"
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise SpecError(f"unknown memory setting {unknown[0]!r}")
        return cls(**{**values, **overrides})


def userbuffer_bytes(tokens: int, hidden: int, activation_bytes: int, fp8: bool) -> int:
    """Bytes of Transformer Engine's userbuffers on each GPU of a TP group that overlaps its
    communication (`UB_FP8_BUFFERS` + `UB_WIDE_BUFFERS` buffers of `tokens x hidden`, `tokens` a
    micro-batch's on one CP rank: sequence x micro-batch / CP). They do not depend on the TP size:
    each holds the whole gathered input (or the whole output before its reduce-scatter)."""
    narrow = 1 if fp8 else activation_bytes
    return tokens * hidden * (UB_FP8_BUFFERS * narrow + UB_WIDE_BUFFERS * activation_bytes)


# --- outputs ------------------------------------------------------------------------------------

PERSISTENT = ("weights", "grads", "master_weights", "matrix_state", "adamw_state")
LABELS = {
    "weights": "weights",
    "grads": "gradient buffers",
    "master_weights": "fp32 master weights",
    "matrix_state": "matrix-optimizer state",
    "adamw_state": "AdamW state",
    "activations": "activations",
    "reduction": "reduce-scatter buffers",
    "step_buffers": "optimizer-step buffers",
    "overhead": "CUDA/NCCL/fragmentation allowance",
    "userbuffers": "Transformer Engine userbuffers",
    "dispatcher_buffers": "EP token dispatcher buffers (DeepEP / HybridEP)",
}


@dataclass(frozen=True)
class RankMemory:
    """Bytes on one GPU. `total` = the persistent components + the larger of `activations` with
    `reduction` (the gradient reduce-scatters in flight during backward) and `step_buffers`
    (forward / backward and the optimizer step never overlap) + `overhead`."""

    rank: int  # Megatron order: TP fastest, then DP, then the pipeline stage
    stage: int
    dp_rank: int
    tp_rank: int
    weights: int
    grads: int
    master_weights: int
    matrix_state: int
    adamw_state: int
    activations: int
    reduction: int
    step_buffers: int
    overhead: int
    userbuffers: int = 0  # Transformer Engine's, for the whole run (`MemorySetup.userbuffers`)
    dispatcher_buffers: int = 0  # the flex token dispatcher's, for the whole run (`MemorySetup.dispatcher_buffers`)

    @property
    def persistent(self) -> int:
        return (self.weights + self.grads + self.master_weights + self.matrix_state + self.adamw_state
                + self.userbuffers + self.dispatcher_buffers)

    @property
    def transient(self) -> int:
        return max(self.activations + self.reduction, self.step_buffers)

    @property
    def total(self) -> int:
        return self.persistent + self.transient + self.overhead

    def components(self) -> dict[str, int]:
        """What `total` adds up, largest first (the smaller transient peak left out)."""
        parts = {k: getattr(self, k) for k in PERSISTENT}
        if self.userbuffers:
            parts["userbuffers"] = self.userbuffers
        if self.dispatcher_buffers:
            parts["dispatcher_buffers"] = self.dispatcher_buffers
        if self.activations + self.reduction >= self.step_buffers:
            parts["activations"], parts["reduction"] = self.activations, self.reduction
        else:
            parts["step_buffers"] = self.step_buffers
        parts["overhead"] = self.overhead
        return dict(sorted(parts.items(), key=lambda kv: -kv[1]))

    def fits(self, capacity_bytes: float) -> bool:
        return self.total <= capacity_bytes

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["total"] = self.total
        return out


@dataclass(frozen=True)
class LayoutMemory:
    """Every GPU of one pipeline stage (`dp * tp` ranks, in rank order) under one step policy."""

    policy: str
    optimizer: str
    dp: int
    tp: int
    pp: int
    stage: int
    ranks: tuple[RankMemory, ...]
    vp: int = 1  # model chunks per pipeline rank (the interleaved schedule)

    def with_experts(self, experts: LayoutMemory, ep: int, setup: MemorySetup) -> LayoutMemory:
        """This dense part's memory with the expert part of the same GPUs added (expert
        parallelism, `canzona.experts`): `experts` is the expert plan's memory over EDP x ETP
        (`experts.tp` is the expert TP size), where stage rank `s` is EDP rank
        `s // (ep x etp)`, ETP rank `s % etp`. Weights, gradients, masters and state add (under
        expert TP each rank holds its shards, and its hosted matrices' state); the expert
        gradients' reductions are in flight with the dense ones; the step buffers are the larger
        of the two steps'; activations are the dense part's (the whole model's layers)."""
        ranks = []
        etp = experts.tp
        for r in self.ranks:
            s = r.dp_rank * self.tp + r.tp_rank
            e = experts.ranks[(s // (ep * etp)) * etp + s % etp]
            merged = replace(r, weights=r.weights + e.weights, grads=r.grads + e.grads,
                             master_weights=r.master_weights + e.master_weights,
                             matrix_state=r.matrix_state + e.matrix_state, adamw_state=r.adamw_state + e.adamw_state,
                             reduction=r.reduction + e.reduction, step_buffers=max(r.step_buffers, e.step_buffers))
            ranks.append(replace(merged, overhead=setup.overhead(merged.transient)))
        return replace(self, ranks=tuple(ranks))

    @cached_property
    def worst(self) -> RankMemory:
        """The rank that needs the most (the lowest such rank); kept (16384 ranks are asked often)."""
        return max(self.ranks, key=lambda r: (r.total, -r.rank))

    def fits(self, capacity_bytes: float) -> bool:
        return self.worst.fits(capacity_bytes)

    def explain(self, capacity_bytes: float) -> str:
        """One line: why the layout does not fit (its largest components), or its headroom."""
        w = self.worst
        where = f"rank {w.rank} (stage {w.stage}, dp {w.dp_rank}, tp {w.tp_rank})"
        if w.fits(capacity_bytes):
            return (f"{self.policy} fits: the fullest GPU, {where}, needs {_gb(w.total)} of "
                    f"{_gb(capacity_bytes)}")
        largest = ", ".join(f"{LABELS[k]} {_gb(v)}" for k, v in list(w.components().items())[:3])
        return (f"{self.policy} does not fit: {where} needs {_gb(w.total)} > {_gb(capacity_bytes)} per GPU; "
                f"largest: {largest}")

    def to_dict(self, capacity_bytes: float | None = None, ranks: bool = False) -> dict[str, Any]:
        totals = [r.total for r in self.ranks]
        out: dict[str, Any] = {
            "policy": self.policy,
            "optimizer": self.optimizer,
            "layout": {"dp": self.dp, "tp": self.tp, "pp": self.pp, "vp": self.vp, "stage": self.stage},
            "worst": self.worst.to_dict(),
            "min_total": min(totals),
            "mean_total": sum(totals) / len(totals),
            "units": "bytes",
        }
        if capacity_bytes is not None:
            out["capacity"] = capacity_bytes
            out["fits"] = self.fits(capacity_bytes)
            out["explanation"] = self.explain(capacity_bytes)
        if ranks:
            out["ranks"] = [r.to_dict() for r in self.ranks]
        return out


def worst_rank(layouts: Sequence[LayoutMemory]) -> RankMemory:
    """The fullest GPU over several stages (or layouts)."""
    return max((lm.worst for lm in layouts), key=lambda r: (r.total, -r.rank))


def _gb(n: float) -> str:
    return f"{n / GB:.1f} GB"


# --- activations --------------------------------------------------------------------------------


def layer_activation_bytes(dims: LayerDims, setup: MemorySetup, tp: int, recompute: str | None = None,
                           expert_load: float = 1.0) -> float:
    """Bytes one transformer layer stores for the backward of one micro-batch on one GPU.

    Per token, with e = activation bytes and 1-byte dropout masks (Korthikanti et al. 2022, §4.1,
    generalised to grouped-query attention, SwiGLU and QK norms): two norm inputs `2eh`; attention:
    the QKV input `eh`, Q and K `e(q+kv)`, V `e*kv`, the output projection's input `e*q`, a dropout
    mask `h`; MLP: its input `eh`, then `2*e*ffn` (GeLU input, second linear's input) or `3*e*ffn`
    gated (gate and up outputs, the product; `5*e*ffn` under Megatron's unfused SwiGLU,
    `setup.bias_activation_fusion` off: its product also keeps the silu output and the up half plus
    its offset), a dropout mask `h`; QK norms: their inputs `e(q+kv)`.
    Under FP8 (`setup.fp8`) the linear layers' inputs (the QKV and MLP inputs, the output
    projection's input, the second MLP linear's input) are saved as Transformer Engine keeps them
    for the weight gradient, in FP8: one byte instead of `e` (this project's reading of TE's
    Linear / LayerNormLinear, which save the FP8 cast of their input; the other saved tensors are
    the bf16 ones of the attention core, the norms and the activation function). The fused
    attention kernel still keeps its own bf16 output for its backward (sources in the code below), so
    under FP8 the attention output is held twice, `e*q` by the attention and `q` by the output
    projection, where in bf16 the two are one tensor.
    Attention scores: `a*s*(2e + 1)` with dropout (softmax output, mask, dropout output), `a*s*e`
    without; flash attention stores only a fp32 log-sum-exp per head and token instead (`4a`).
    For a GPT layer this is the paper's `s*b*h*(34 + 5*a*s/h)`.

    With TP (t), the matrices' outputs and the scores are split over t; with sequence parallelism
    everything is. Selective recompute drops the scores (and the log-sum-exp); full recompute
    stores only the layer's input `e*h` (split over t with sequence parallelism); torchtitan's
    selective-op keeps what `_selective_op_bytes` counts (`canzona.recompute`). Under selective-layer
    a layer stores as without recompute or as under full by its position (`activation_breakdown`):
    no one layer's figure, refused here.

    In a mixture-of-experts layer the MLP terms and the routed copies are per token-expert pair the
    rank computes: `expert_load` scales them, the rank's pairs over the mean rank's (1: the mean;
    `activation_breakdown` prices the fullest EP rank's, `fullest_rank_load`).
    """
    recompute = check_recompute(recompute or setup.recompute)
    if recompute == SELECTIVE_LAYER:
        raise SpecError("under selective-layer a layer stores everything or only its input by its position "
                        "(canzona.memory.activation_breakdown counts a stage's layers)")
    e, h, s, a = setup.activation_bytes, dims.hidden, setup.seq_len, dims.q_heads
    tokens = s * setup.micro_batch
    mask = 1 if dims.dropout else 0
    sp_div = tp if setup.sequence_parallel else 1
    if recompute == "full":
        return tokens * e * h / sp_div
    li = FP8_BYTES if setup.fp8 else e  # a linear layer's saved input
    q, kv = dims.q_dim, dims.kv_dim
    if recompute == SELECTIVE_OP:
        return tokens * _selective_op_bytes(dims, setup, tp, sp_div, expert_load)
    # split over TP only with sequence parallelism: norm inputs, block inputs, dropout masks
    replicated = 2 * e * h + li * h + li * h + 2 * mask * h
    mlp = ((2 if dims.gated_mlp else 1) * e + li) * dims.ffn
    if dims.gated_mlp and not setup.bias_activation_fusion:  # Megatron's unfused glu's two saved operands
        mlp += 2 * e * dims.ffn
    if dims.experts_per_token:  # the experts' MLP terms, per pair: at the rank's pairs
        mlp *= expert_load
    sharded = e * (q + kv) + e * kv + li * q + mlp
    if dims.qk_norm:
        sharded += e * (q + kv)
    if dims.experts_per_token:  # a token's routed copies and its router's maps, per token of the TP rank
        replicated += _moe_saved_bytes(dims, setup, li, expert_load)
    if recompute == "none":
        sharded += 4 * a if setup.flash_attention else a * s * ((2 * e + 1) if dims.dropout else e)
        # Under FP8 the output projection saves the FP8 cast of its input (TE's `_Linear.forward` saves
        # `inputmat` / `inputmat_t`, the FP8 tensors, and its bf16 `inputmat_no_fp8` only without FP8:
        # transformer_engine/pytorch/module/linear.py, NVIDIA/TransformerEngine release 1.x), while the
        # fused attention that produced that input saves its bf16 output for its own backward (flash-attn
        # 2's `FlashAttnFunc.forward`: `ctx.save_for_backward(q, k, v, out_padded, softmax_lse, rng_state)`,
        # Dao-AILab/flash-attention flash_attn/flash_attn_interface.py; Transformer Engine's context-parallel
        # ring `AttnFuncWithCPAndKVP2P`: `save_for_backward(q, kv, out, softmax_lse, ...)`; its cuDNN
        # `FusedAttnFunc`: `qkvo_tensors = (q, k, v, out_save)` unless the attention itself runs in FP8,
        # which no modelled recipe does: transformer_engine/pytorch/attention.py). In bf16 the projection saves that same tensor, counted once (the
        # paper's output-projection input); in FP8 both copies live: the attention's counts `e*q` per token
        # beside the projection's `q` (FP8_BYTES). Not when the attention core is recomputed (its output
        # is then not saved) or without flash attention (the unfused softmax-times-V saves its inputs).
        if setup.fp8 and setup.flash_attention:
            sharded += e * q
    return tokens * (replicated / sp_div + sharded / tp)


# What a mixture-of-experts layer saves beyond a dense MLP's terms (whose `ffn` counts the routed
# copies' gate / up outputs and their product), per token the TP rank routes (its sequence-parallel
# share: every TP rank dispatches its own tokens, `sim.model_work`):
# - the routed copies themselves, `experts_per_token x hidden` a token, as the grouped fc1 keeps
#   them for its weight gradient: Transformer Engine's `_GroupedLinear.forward` saves `*inputmats`,
#   the dispatched (permuted) tokens split per expert, as its FP8 cast under FP8 and as they are in
#   bf16 (transformer_engine/pytorch/module/grouped_linear.py, NVIDIA/TransformerEngine); under
#   expert TP the copies are first gathered over the ETP group (Megatron-LM
#   `token_dispatcher.py`, `gather_from_sequence_parallel_region` over the expert TP group), so a
#   rank saves `expert_tp` times its own. The dispatch's and permutation's own outputs before fc1
#   are freed (their backward needs only the routing handle), so the copies count once.
# - the router's maps over all `experts`, from Transformer Engine's fused router
#   (transformer_engine/pytorch/router.py, Megatron's `moe_router_fusion`): the top-k with its score
#   function saves the routing map (bool, 1 byte an expert) and its fp32 intermediate output, and
#   the aux loss's scores save another fp32 intermediate (`FusedComputeScoresForMoEAuxLoss`); the
#   aux loss itself keeps only per-expert counts. 9 bytes an expert and token. An **assumption**
#   for a recipe without the fused router or the aux loss (the unfused one keeps more), and for
#   runtimes other than Megatron's (NeMo AutoModel's routers), which keep maps of the same size.
MOE_ROUTER_MAP_BYTES = 1 + FP32 + FP32


def _moe_saved_bytes(dims: LayerDims, setup: MemorySetup, linear_input_bytes: int, expert_load: float = 1.0) -> float:
    """Bytes a mixture-of-experts layer saves per token beyond the dense terms (see above): the
    routed copies at the rank's pairs over the mean (`expert_load`), the router's maps of its own
    tokens."""
    routed = linear_input_bytes * dims.experts_per_token * dims.hidden * setup.expert_tp
    return routed * expert_load + MOE_ROUTER_MAP_BYTES * dims.experts


def _selective_op_bytes(dims: LayerDims, setup: MemorySetup, tp: int, sp_div: int, expert_load: float = 1.0) -> float:
    """Per token, what torchtitan's per-op selective checkpointing keeps of one layer
    (`canzona.recompute`): the layer's input (the checkpoint's), the outputs of every other matrix
    multiply (wq, wk, wv, wo, then the MLP's in forward order: column-parallel outputs split over
    TP, a row-parallel one a whole partial sum on each TP rank), the attention kernel's output and
    its fp32 log-sum-exp (4 bytes per head; without flash attention the scores, as stored without
    recompute), and under sequence parallelism the two reduce-scatters' outputs. Nothing else:
    norms, rotary embedding, the activation function and dropout masks are recomputed. In a
    mixture-of-experts layer the MLP's outputs are per pair: at `expert_load` times the mean."""
    e, h, q, kv = setup.activation_bytes, dims.hidden, dims.q_dim, dims.kv_dim
    mlp = [dims.ffn / tp, dims.ffn / tp, h] if dims.gated_mlp else [dims.ffn / tp, h]
    if dims.experts_per_token and expert_load != 1:
        mlp = [w * expert_load for w in mlp]
    widths = [q / tp, kv / tp, kv / tp, h] + mlp
    attention = e * q / tp + (4 * dims.q_heads / tp if setup.flash_attention else
                              dims.q_heads / tp * setup.seq_len * ((2 * e + 1) if dims.dropout else e))
    scattered = 2 * e * h / tp if setup.sequence_parallel and tp > 1 else 0.0
    return e * h / sp_div + e * saved_mm_widths(widths) + attention + scattered


def activation_breakdown(dims: LayerDims, setup: MemorySetup, tp: int, pp: int = 1, stage: int = 0,
                         vp: int = 1, split: PipelineSplit = EVEN_SPLIT) -> dict[str, float]:
    """The activation peak of one GPU of pipeline stage `stage`, by part (bytes), as
    `_breakdown` counts it, a mixture-of-experts layer's expert activations at the fullest EP
    rank's load (`fullest_rank_load`, over the layers' expert activations held at that peak; 1: a dense
    model, EP 1, or balanced routing without skew)."""
    mean = _breakdown(dims, setup, tp, pp, stage, vp, split)
    if not dims.experts_per_token or setup.ep <= 1:
        return mean
    # the expert activations held at the peak, in units of one layer's of one micro-batch: the
    # layer-micro-batches whose pairs the fullest rank's sum is over (`fullest_rank_load`)
    held = sum(mean.values()) - sum(_breakdown(dims, setup, tp, pp, stage, vp, split, 0.0).values())
    one = layer_activation_bytes(dims, setup, tp, "none") - layer_activation_bytes(dims, setup, tp, "none", 0.0)
    load = fullest_rank_load(dims, setup, tp, held / one)
    return mean if load == 1 else _breakdown(dims, setup, tp, pp, stage, vp, split, load)


def fullest_rank_load(dims: LayerDims, setup: MemorySetup, tp: int, layers: float = 1.0) -> float:
    """The fullest EP rank's expert activations over the mean rank's, at a peak that holds
    `layers` layer-micro-batches' worth of them.

    A rank saves each expert layer's activations per token-expert pair it computes (the routed
    copies fc1 keeps, fc1's outputs, fc2's input: `layer_activation_bytes`), so its expert
    activations follow its pairs, which the timing prices at the busiest EP rank's
    (`sim.model_work._expert_block`): the router's persistent skew (`setup.router_imbalance`,
    `canzona.experts.rank_shares`) with each micro-batch's random fluctuation on top
    (`canzona.routing.busiest_rank`, `setup.routing`; none under balanced routing or AutoModel's
    deterministic gate). The same functions price it here. A layer's draw is independent of the
    other layers' and micro-batches' (random routing draws afresh for each), so the rank's held
    activations are a sum of `layers` draws, whose fluctuation is that of one draw of `layers`
    times the tokens (as the timing sums an ETP group's `etp` draws: `tokens x etp`); the skew is
    the same in every layer and adds in full. Tokens: each TP rank's sequence-parallel share of the
    micro-batch, as the timing passes them; under expert TP the ETP group's gathered pairs."""
    if not dims.experts_per_token or setup.ep <= 1:
        return 1.0
    tokens = setup.seq_len * setup.micro_batch / tp * setup.expert_tp * max(layers, 1.0)
    shares = rank_shares(setup.router_imbalance, dims.experts, setup.ep)
    return busiest_rank(experts=dims.experts, top_k=dims.experts_per_token, ep=setup.ep, tokens=tokens,
                        routing=setup.routing, shares=shares).pairs


def _breakdown(dims: LayerDims, setup: MemorySetup, tp: int, pp: int = 1, stage: int = 0, vp: int = 1,
               split: PipelineSplit = EVEN_SPLIT, expert_load: float = 1.0) -> dict[str, float]:
    """The activation peak of one GPU of pipeline stage `stage`, by part (bytes), each expert
    layer's expert activations at `expert_load` times the mean rank's:

    - `layers`: the stage's layers times the micro-batches in flight (1F1B: stage i holds up to
      `pp - i` micro-batches, capped by `setup.micro_batches`; one at a time without pipelining);
      under the interleaved schedule (`vp` > 1), a chunk's layers times the micro-batch-chunks in
      flight (`canzona.pipeline.peak_in_flight`: stage 0 holds `layers * (1 + (pp - 1) / (pp * vp))`
      layers' worth, Korthikanti et al. 2022, section 4.2.3); under an uneven `split`
      (`canzona.pipeline.PipelineSplit`) the most layers held at once, each chunk by its own size
      (`canzona.pipeline.peak_layers_in_flight`);
      Under full recompute with Megatron's method (`setup.recompute_method`,
      `canzona.recompute.checkpoint_groups`), a chunk's layers hold, per micro-batch, one layer
      input for each checkpoint (a uniform group's, a block's checkpointed layer's) and the whole
      activations of the layers outside any checkpoint (block's past the first N), each chunk by
      its own size; under torchtitan's selective-layer likewise, a layer input for each of every
      K-th layer (`canzona.recompute.selective_layer_checkpointed`, its counter running on over the
      rank's chunks) and the whole activations of the others;
    - `recompute_working_set`: under full recompute, one layer's activations while it is recomputed
      (a uniform group's N layers': its re-run makes them all before their backwards); under
      Megatron's block method and torchtitan's selective-layer, less the layers stored whole after
      the chunk's last checkpointed one, which the backward frees first (`_method_working_set`:
      none for block N below the chunk's layers, or where the chunk's last layer is not checkpointed);
      under selective-op, what one layer recomputes beside what it saved;
    - `ep_overlap_layer`: under Megatron's EP all-to-all overlap (`setup.ep_overlap`), one layer
      more. Its combined 1F1B schedule (`canzona.pipeline.combined_order`) runs one warm-up forward
      more than the schedule above, alone, so at the granularity of micro-batch-chunks it holds the
      same peak (the first steady forward of the plain schedule also runs before its backward);
      inside a step it pairs forward layer i with backward layer n - 1 - i and runs the forward's
      attention and experts before the backward's attention frees its layer
      (`TransformerLayerSchedulePlan.run`, sim.ep_overlap): one layer's activations beyond that
      peak. Megatron-LM's measurements of a DeepSeek-V3 proxy (14 layers, TP 1, PP 4, EP 16, no
      recompute) agree that the overlap holds no micro-batch more: 70,279 MB peak allocated with
      it (PR #6429) against 68,704 MB without (PR #6311), 2.3% more;
    - `embedding`: the embedding's dropout mask per micro-batch in flight (first stage);
    - `output`: the final norm's and the head's inputs `2*e*h` per token, and the logits at the
      loss's peak (`loss_logit_bytes`: under Megatron's loss the fp32 copy it keeps, `4*s*b*V`,
      the paper's, or `setup.loss_bytes` a logit for a loss that keeps it in another dtype, plus
      the bf16 logits it is made from; under PyTorch's `F.cross_entropy` three tensors of the
      logits' shape at its backward), split over t by the vocabulary-parallel head (last stage)."""
    # the micro-batch(-chunk)s in flight at the peak that hold the embedding's output: chunk 0's
    if vp == 1:
        embedded = pp - stage if setup.micro_batches is None else min(pp - stage, setup.micro_batches)
    else:
        embedded = peak_in_flight(stage, pp, setup.micro_batches, vp, chunk=0)
    if setup.recompute_method is not None or setup.recompute == SELECTIVE_LAYER:  # each chunk by its checkpoints
        sizes = [len(chunk_layers(dims.layers, pp, stage, c, vp, split)) for c in range(vp)]
        starts = [sum(sizes[:c]) for c in range(vp)]  # the rank's layers before each chunk
        layers = peak_layers_in_flight(stage, pp, setup.micro_batches, vp,
                                       [_chunk_activation_bytes(dims, setup, tp, n, a, expert_load=expert_load)
                                        for n, a in zip(sizes, starts)])
        working = max(_method_working_set(dims, setup, tp, n, a, expert_load=expert_load) for n, a in zip(sizes, starts))
    else:
        if vp == 1:  # 1F1B: a micro-batch's layers for each in flight
            held = len(chunk_layers(dims.layers, pp, stage, 0, 1, split)) * embedded
        elif split.even:  # the micro-batch-chunks in flight at the interleaved order's peak, each a chunk's layers
            held = len(chunk_layers(dims.layers, pp, stage, 0, vp)) * peak_in_flight(stage, pp, setup.micro_batches, vp)
        else:
            sizes = [len(chunk_layers(dims.layers, pp, stage, c, vp, split)) for c in range(vp)]
            held = peak_layers_in_flight(stage, pp, setup.micro_batches, vp, sizes)
        layers = held * layer_activation_bytes(dims, setup, tp, expert_load=expert_load)
        working = _recompute_working_set(dims, setup, tp, expert_load)
    tokens = setup.seq_len * setup.micro_batch
    sp_div = tp if setup.sequence_parallel else 1
    e = setup.activation_bytes
    out = {
        "layers": layers,
        "recompute_working_set": working,
        "ep_overlap_layer": _overlap_layer_bytes(dims, setup, tp, expert_load) if setup.ep_overlap else 0.0,
        "embedding": embedded * tokens * dims.hidden / sp_div if stage == 0 and dims.dropout else 0.0,
        "output": 0.0,
    }
    if stage == pp - 1:
        out["output"] = tokens * 2 * e * dims.hidden / sp_div + tokens * dims.vocab * loss_logit_bytes(setup) / tp
    return out


def loss_logit_bytes(setup: MemorySetup) -> int:
    """Bytes a logit holds at the loss's peak, beside every layer's activations (the backward starts
    there, before it frees any). Megatron's vocab-parallel cross-entropy: the bf16 logits and the copy
    the loss keeps (`loss_bytes`: its fp32 softmax, which its backward turns into the gradient in
    place). PyTorch's `F.cross_entropy` (`loss_autograd`) on logits of `loss_bytes` (fp32 where the
    loop upcasts them): at `log_softmax`'s backward, its saved output, the dense gradient `nll_loss`'s
    backward made and the gradient it makes, three tensors of the logits' shape (what torch allocates:
    `tests/sim/test_loss_memory.py` measures it on CPU), plus the model's logits where the loop holds
    them (`loss_holds_logits`). Before 2026-11-30 the FSDP2 frameworks' loss was counted as Megatron's:
    on torchtitan's Llama 3.1 8B runs (16,384 tokens a micro-batch) 12.6 GB short of the peak."""
    if setup.loss_autograd:
        return 3 * setup.loss_bytes + (setup.activation_bytes if setup.loss_holds_logits else 0)
    return setup.loss_bytes + setup.activation_bytes


def _overlap_layer_bytes(dims: LayerDims, setup: MemorySetup, tp: int, expert_load: float = 1.0) -> float:
    """The one layer more Megatron's EP overlap holds (`activation_breakdown`), as the recompute
    mode stores a layer. Under selective-layer, where a layer stores by its position, a whole
    layer: the most any of them stores. The overlap never runs with it (selective-layer is
    torchtitan's, under --fsdp, where the overlap is refused), but a search that tries the mode on
    an overlapped layout asks for the pair's memory floor: it must get a number, not an error."""
    mode = "none" if setup.recompute == SELECTIVE_LAYER else None
    return layer_activation_bytes(dims, setup, tp, mode, expert_load)


def _chunk_checkpoints(setup: MemorySetup, size: int, start: int) -> tuple[int, int, int, int]:
    """Of a model chunk of `size` layers, `start` layers of the rank before it: (the checkpoints
    whose input is stored, the layers inside one, the layers one re-run makes alive at once, the
    layers after the last checkpointed one), by Megatron's method (`canzona.recompute.checkpoint_groups`)
    or torchtitan's selective-layer (every K-th of the rank's layers, each alone). The layers after
    the last checkpointed one store everything, and the backward, which runs them first, has
    freed them before that layer's re-run."""
    if setup.recompute == SELECTIVE_LAYER:
        inside_flags = [selective_layer_checkpointed(setup.selective_ac_option, start + i) for i in range(size)]
        stored = sum(inside_flags)
        alive = min(1, stored)
    else:
        method, n = setup.recompute_method, setup.recompute_num_layers
        stored, alive = checkpoint_groups(method, n, size)
        inside_flags = [checkpointed(method, n, i) for i in range(size)]
    last = max((i for i, inside in enumerate(inside_flags) if inside), default=size - 1)
    return stored, sum(inside_flags), alive, size - 1 - last


def _chunk_activation_bytes(dims: LayerDims, setup: MemorySetup, tp: int, size: int, start: int = 0,
                            expert_load: float = 1.0) -> float:
    """What a model chunk of `size` layers holds for one micro-batch with some of its layers
    checkpointed (`_chunk_checkpoints`): a layer input per checkpoint, whole activations for the
    layers outside any."""
    stored, inside, _, _ = _chunk_checkpoints(setup, size, start)
    return (stored * layer_activation_bytes(dims, setup, tp, FULL)
            + (size - inside) * layer_activation_bytes(dims, setup, tp, "none", expert_load))


def _method_working_set(dims: LayerDims, setup: MemorySetup, tp: int, size: int, start: int = 0,
                        expert_load: float = 1.0) -> float:
    """The activations one re-run makes in a chunk of `size` layers beyond the peak of its held
    layers (`_chunk_checkpoints`): a uniform group's N layers' whole activations, else one
    layer's (none without a checkpoint), less the checkpoint's input, which the re-run's first op
    saves again as the same tensor, and less the stored layers after the last checkpointed one,
    which the backward frees before that layer's re-run: none under block with N below the
    chunk's layers, nor under selective-layer where the chunk's last layer is not checkpointed.
    (The re-runs of lower checkpoints come after more is freed.)"""
    _, _, alive, above = _chunk_checkpoints(setup, size, start)
    return _rerun_bytes(dims, setup, tp, alive - above, expert_load) if alive > above else 0.0


def _rerun_bytes(dims: LayerDims, setup: MemorySetup, tp: int, layers: int, expert_load: float = 1.0) -> float:
    """What a full-recompute re-run of `layers` layers makes beyond its checkpoint: their whole
    activations less the checkpoint's input, which the re-run's first op saves again as the same
    tensor."""
    return (layers * layer_activation_bytes(dims, setup, tp, "none", expert_load)
            - layer_activation_bytes(dims, setup, tp, FULL))


def _recompute_working_set(dims: LayerDims, setup: MemorySetup, tp: int, expert_load: float = 1.0) -> float:
    """The activations one layer's recompute makes in the backward, beyond what it stored."""
    if setup.recompute == "full":
        return _rerun_bytes(dims, setup, tp, 1, expert_load)
    if setup.recompute == SELECTIVE_OP:
        return (layer_activation_bytes(dims, setup, tp, "none", expert_load)
                - layer_activation_bytes(dims, setup, tp, expert_load=expert_load))
    return 0.0


def activation_bytes(dims: LayerDims, setup: MemorySetup, tp: int, pp: int = 1, stage: int = 0, vp: int = 1,
                     split: PipelineSplit = EVEN_SPLIT) -> int:
    return math.ceil(sum(activation_breakdown(dims, setup, tp, pp, stage, vp, split).values()))


# --- optimizer step -----------------------------------------------------------------------------


def kernel_workspace_bytes(optimizer: str, shape: tuple[int, ...], grad_bytes: int = 4,
                           cfg: object | None = None) -> int:
    """Temporaries of one full-matrix update beyond its input gradient, its state and its output
    direction (the optimizer's registry entry: `MatrixOptimizer.workspace_bytes`)."""
    cfg = cfg if cfg is not None else default_config(optimizer)
    m, n = shape
    return matrix_optimizer(optimizer).part("workspace_bytes")(m, n, grad_bytes, cfg)


def muon_workspace_bytes(m: int, n: int, grad_bytes: int, cfg: MuonConfig) -> int:
    """Counted from `canzona/runtime/kernels.py` as written (whole tensors alive at the kernel's
    peak): the Nesterov blend `u` (gradient dtype), the NS iterate and the next one (`ns_dtype`),
    the Gram matrix and the polynomial (`s x s`, s = min(m, n), `ns_dtype`)."""
    nb = DTYPE_BYTES[cfg.ns_dtype]
    s = min(m, n)
    return (grad_bytes * m * n if cfg.nesterov else 0) + 2 * nb * m * n + 2 * nb * s * s


def soap_workspace_bytes(m: int, n: int, grad_bytes: int, cfg: SOAPConfig) -> int:
    """Four `m x n` fp32 temporaries (rotated gradient, denominator, rotated moment, the quotient)
    and four `k x k` of the refresh (k the largest preconditioned side)."""
    k = max([d for d in (m, n) if d <= cfg.max_precond_dim], default=0)
    return max(FP32, grad_bytes) * (4 * m * n + 4 * k * k)


def shampoo_workspace_bytes(m: int, n: int, grad_bytes: int, cfg: ShampooConfig) -> int:
    """Four `m x n` fp32 temporaries (preconditioned gradient, grafting's Adam terms) and three
    `k x k` of the inverse root."""
    k = max([d for d in (m, n) if d <= cfg.max_preconditioner_dim], default=0)
    return max(FP32, grad_bytes) * (4 * m * n + 3 * k * k)


def adamw_workspace_bytes(m: int, n: int, grad_bytes: int, cfg: AdamWConfig) -> int:
    """`adamw_step_`'s two fp32 temporaries of the piece it updates (the root and the denominator)."""
    return 2 * FP32 * m * n


def batched_stack_bytes(optimizer: str, shape: tuple[int, ...]) -> int:
    """Copies a batched kernel stacks per matrix beyond the per-matrix kernel's temporaries
    (`canzona.runtime.batched`; the registry's `stack_bytes`): Muon's stack replaces the copy it
    makes anyway."""
    stack = matrix_optimizer(optimizer).part("stack_bytes")
    return 0 if stack is None else stack(*shape)


def soap_stack_bytes(m: int, n: int) -> int:
    return FP32 * (2 * m * n + m * m + n * n)  # the gradient, its first moment and both eigenbases


def shampoo_stack_bytes(m: int, n: int) -> int:
    return FP32 * (m * n + m * m + n * n)  # the gradient and both roots


@dataclass(frozen=True)
class _GroupBytes:
    gather: int  # send and receive buffers of the gather (all-to-all, or tp-sync's all-gather)
    full: int  # full gradients assembled from shards on the host
    updates: int  # full update directions the host keeps until they are applied
    workspace: int  # the largest hosted kernel's temporaries
    scatter: int  # send and receive buffers of the update chunks


def _group_bytes(tasks: Sequence[Task], tp: int, me: int, gb: int, ub: int,
                 workspace: dict[str, int], batched: bool = False, stack: dict[str, int] | None = None) -> _GroupBytes:
    """What TP rank `me` allocates for one micro-group (or compute window), as
    `canzona.runtime.executor` does: the kernel's temporaries are the largest batch's, `k` times
    one matrix's plus the stacked copies a batched kernel makes (`stack`, per matrix)."""
    split = [t for t in tasks if t.tp_dim is not None]
    hosted = [t for t in tasks if t.hosted_on(me)]
    ws = max((sum(workspace[t.name] for t in batch) + (sum((stack or {}).get(t.name, 0) for t in batch)
                                                         if len(batch) > 1 else 0)
              for batch in shape_batches(hosted, batched)), default=0)
    updates = sum(t.shape[0] * t.shape[1] for t in hosted) * ub
    if tasks and tasks[0].host == EVERY_RANK:  # tp-sync: all-gather of every shard, no scatter
        mine = sum(t.shard_numel for t in split) * gb
        full = sum(t.shape[0] * t.shape[1] for t in split) * gb
        return _GroupBytes(mine * (1 + tp) if tp > 1 else 0, full, updates, ws, 0)
    if tp == 1:
        return _GroupBytes(0, 0, updates, ws, 0)
    send = sum(t.shard_numel for t in split if t.host != me) * gb
    recv = sum((tp - 1) * t.shard_numel for t in split if t.host == me) * gb
    full = sum(t.shape[0] * t.shape[1] for t in split if t.host == me) * gb
    chunk = {t.name: t.shard_numel * ub for t in tasks}
    scatter = sum((tp - 1) * chunk[t.name] for t in hosted) + sum(chunk[t.name] for t in tasks if t.host != me)
    return _GroupBytes(send + recv, full, updates, ws, scatter)


def _early_product_bytes(tasks: Sequence[Task], tp: int, me: int, gb: int) -> int:
    """overlap_step under GradScaler: the products (landed gradient x inverse scale) one micro-group
    (or compute window) holds while it computes, as `MatrixStep._full_grads` reads them: every
    hosted task's piece from this rank's own buffers (the whole gradient at TP 1 or unsplit, its
    own shard of a split one), in the gradients' dtype."""
    return gb * sum(t.shard_numel if t.tp_dim is not None and tp > 1 else t.shape[0] * t.shape[1]
                    for t in tasks if t.hosted_on(me))


def _tp_phase_peak(groups: Sequence[_GroupBytes], mode: str) -> int:
    """Peak of the matrix phase. A group computes with its gather buffers, full gradients, updates
    and the kernel's workspace alive (upper bound: all at once), then scatters with its updates and
    scatter buffers alive. Pipelined, group g computes and scatters while group g-1 waits for its
    apply (updates and scatter buffers) and group g+1's gather is in flight."""
    peak = 0
    for g, cur in enumerate(groups):
        own = max(cur.gather + cur.full + cur.updates + cur.workspace, cur.updates + cur.scatter)
        if mode == PIPELINED:
            if g > 0:
                own += groups[g - 1].updates + groups[g - 1].scatter
            if g + 1 < len(groups):
                own += groups[g + 1].gather
        peak = max(peak, own)
    return peak


def _deferred_peak(groups: Sequence[_GroupBytes], state: int, mode: str, products: Sequence[int] = ()) -> int:
    """Peak of an overlapped step (`overlap_step`): a copy of the hosted state (advanced on the
    copy, adopted at the commit) and every group's updates and scatter buffers held until the
    check, plus the largest group's compute buffers (and, pipelined, the next gather); under
    GradScaler, with each group's early products (`products`, `_early_product_bytes`)."""
    held = sum(g.updates + g.scatter for g in groups)
    products = products or [0] * len(groups)
    computing = max((g.gather + g.full + g.workspace + p for g, p in zip(groups, products)), default=0)
    ahead = max((g.gather for g in groups), default=0) if mode == PIPELINED else 0
    return state + held + computing + ahead


def _adamw_slices(sizes: Sequence[int], dp: int, align: int, replicated: bool) -> tuple[int, list[int], list[int]]:
    """The flat AdamW buffer as the runtime lays it out: (padded size, and per DP rank the
    parameters' elements inside its slice, which it keeps state and masters for, and the largest
    piece of one parameter there)."""
    used = sum(sizes)
    size = ceil_to(max(used, 1), align * dp)
    if replicated:
        return size, [used] * dp, [max(sizes, default=0)] * dp
    share = size // dp
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    inside, largest = [], []
    for r in range(dp):
        lo, hi = r * share, (r + 1) * share
        inside.append(max(0, min(hi, used) - lo))  # the padding at the end holds no parameter
        best = 0
        i = max(0, bisect.bisect_right(starts, lo) - 1)
        while i < len(sizes) and starts[i] < hi:
            best = max(best, min(hi, starts[i + 1]) - max(lo, starts[i]))
            i += 1
        largest.append(best)
    return size, inside, largest


# --- the model ----------------------------------------------------------------------------------


def state_saving_bytes(optimizer: str, shape: tuple[int, ...], setup: MemorySetup, cfg: object | None = None) -> int:
    """Bytes of one whole parameter's optimizer state (`state_bytes`, counted in fp32) that the
    runtime does not allocate without masters: the part that follows the update
    (`canzona.cost.update_dtype_state_bytes`) kept in `setup.update_state_bytes` instead of fp32."""
    if setup.update_state_bytes == FP32:
        return 0
    return update_dtype_state_bytes(optimizer, shape, cfg) * (FP32 - setup.update_state_bytes) // FP32


def kept_state_bytes(optimizer: str, tasks: Sequence[Task], setup: MemorySetup, cfg: object | None = None) -> int:
    """The optimizer state of `tasks` (each task's `state_bytes`, the plan's fp32 count) as the
    runtime keeps it: each task's share of its whole parameter's `state_saving_bytes` taken off."""
    full = sum(t.state_bytes for t in tasks)
    if setup.update_state_bytes == FP32:
        return full
    saved = 0
    for t in tasks:  # a task may hold part of a parameter: it saves that part's share
        whole = state_bytes(optimizer, t.shape, cfg)
        saved += state_saving_bytes(optimizer, t.shape, setup, cfg) * t.state_bytes // whole if whole else 0
    return full - saved


def memory_per_gpu(spec: ModelSpec, plan: Plan, policy: StepPolicy | str, dims: LayerDims,
                   setup: MemorySetup | None = None, *, dp: int | None = None, pp: int = 1, stage: int = 0,
                   matrix_config: object | None = None, vp: int = 1,
                   split: PipelineSplit = EVEN_SPLIT) -> LayoutMemory:
    """Memory of every GPU of one pipeline stage (`dp x tp` ranks) running `plan` under `policy`.

    `spec` and `plan` are the stage's (with `pp > 1`: `stage_spec(...)` and a plan made for it;
    `dims` describes the whole model; `vp` > 1: the interleaved schedule, the stage holding its
    `vp` model chunks' layers; `split`: how the layers are cut over the chunks,
    `canzona.pipeline.PipelineSplit`). `dp` is the cluster's DP size: by default the plan's; a
    replicated policy's plan may be made for one DP rank (as the simulator makes `sc`'s).
    `matrix_config` overrides the optimizer's default configuration for the kernel workspace; the
    plan must have been priced at it (`check_plan_config`).
    """
    setup = setup or MemorySetup()
    policy = get_step_policy(policy) if isinstance(policy, str) else policy
    tp = plan.tp
    dp = plan.dp if dp is None else dp
    if not (isinstance(dp, int) and dp >= 1):
        raise SpecError(f"dp must be a whole number >= 1, got {dp!r}")
    if plan.dp != dp and not (policy.replicated and plan.dp == 1):
        raise SpecError(f"the plan is for dp={plan.dp}, not dp={dp}")
    check_plan_matches(plan, spec)
    policy.check_dp_plan(plan.dp_plan)
    policy.check_tp_plan(plan.tp_plan.policy, tp)
    if vp == 1:
        rng = chunk_layers(dims.layers, pp, stage, 0, 1, split)
        where = f"layers {rng.start}..{rng.stop - 1}"
    else:
        rng = rank_layers(dims.layers, pp, stage, vp, split)
        where = ", ".join(f"layers {c.start}..{c.stop - 1}" for c in (chunk_layers(dims.layers, pp, stage, k, vp, split)
                                                                      for k in range(vp)))
    outside = next((p.name for p in spec.params if p.layer is not None and p.layer not in rng), None)
    if outside is not None:
        raise SpecError(f"{outside} is not in pipeline stage {stage} of {pp}{f' (vp {vp})' if vp > 1 else ''} "
                        f"({where}): give the stage's spec and plan (canzona.pipeline.stage_spec)")

    if matrix_config is not None and type(matrix_config) is not type(default_config(plan.optimizer)):
        raise SpecError(f"matrix_config is a {type(matrix_config).__name__}, but the plan is for {plan.optimizer}")
    check_plan_config(plan, spec, matrix_config)  # the state counted is the plan's, priced at matrix_config

    pb, gb, mb, ub = setup.param_bytes, setup.grad_bytes, setup.master_bytes, setup.update_bytes
    adamw_sizes = _adamw_sizes(spec, tp)
    adamw_size, adamw_inside, adamw_largest = _adamw_slices(adamw_sizes, dp, plan.dp_plan.align, policy.replicated)
    # an AdamW buffer of no parameter (an EP rank's experts: `canzona.experts.expert_part`) is still
    # one padded slice per rank, in fp32: the runtime's `FlatBuffer` has no parameter to take a dtype from
    adamw_pb, adamw_gb = (pb, gb) if adamw_sizes else (EMPTY_BUFFER_BYTES, EMPTY_BUFFER_BYTES)
    if matrix_optimizer(plan.optimizer).elementwise:  # AdamW also on the matrices' pieces in each segment
        for i in range(dp):
            pieces = plan.dp_plan.piece_lengths(i)
            adamw_inside[i] += sum(pieces)
            adamw_largest[i] = max([adamw_largest[i], *pieces])
    buckets = sum(b.size for b in plan.dp_plan.buckets)
    weights = buckets * pb + adamw_size * adamw_pb
    if setup.fp8:  # Transformer Engine's cached FP8 weight and its transpose, per linear weight
        fp8_numel = sum(p.local_numel(tp) for p in fp8_linear_params(spec))
        # under fp8_params the FP8 weight and its transpose are the weight: no bf16 copy beside them
        weights += (FP8_WEIGHT_CACHE - (pb if setup.fp8_params else 0)) * fp8_numel
    grads = buckets * gb + adamw_size * adamw_gb
    activations = activation_bytes(dims, setup, tp, pp, stage, vp, split)
    gathered = sum(p.numel for p in plan.dp_plan.placements()) * pb if policy.param_gather == PARAMS_BY_OWNER else 0
    workspace = {p.name: kernel_workspace_bytes(plan.optimizer, p.shape, gb, matrix_config)
                 for p in spec.matrix_params()}
    stack = {p.name: batched_stack_bytes(plan.optimizer, p.shape) for p in spec.matrix_params()}
    batching = setup.batch_kernels and matrix_optimizer(plan.optimizer).batchable  # as the runtime's executor

    reductions = reduction_bytes(plan, policy, dp, adamw_size, setup.reduce_scatter, gb, adamw_grad_bytes=adamw_gb)
    if setup.overlap_step:
        policy.check_overlap_step(True)
    # per DP rank (one under a replicated policy: every DP rank runs the same schedule), per TP rank
    rows: list[list[tuple[int, int, int]]] = []  # (master, matrix state, step buffers)
    # a row is a function of the DP rank's schedule but for the matrices' names (by their shapes:
    # the workspaces), its AdamW slice and its reductions: computed once per kind (ScheduleKeys)
    schedules = ScheduleKeys(plan, spec, policy)
    seen: dict[tuple, list[tuple[int, int, int]]] = {}
    for i in range(1 if policy.replicated else dp):
        key = (schedules(i), adamw_inside[i], adamw_largest[i], reductions[i])
        if key in seen:
            rows.append(seen[key])
            continue
        sched = tp_schedule(plan, spec, policy, 0 if policy.replicated else i, setup.tp_mode, gb, ub,
                            overlap_step=setup.overlap_step)
        master = sum(t.shard_numel for t in sched.tasks()) * mb + adamw_inside[i] * mb
        adamw_temps = 2 * FP32 * adamw_largest[i]
        tasks, mode = _streamed(sched.groups, setup)
        if batching and len(tasks) == len(sched.groups):  # TP 1: consecutive groups compute together
            windows = compute_windows(sched.groups, 0, True)
            tasks = [tuple(t for g in members for t in tasks[g]) for members in windows.values()]
        row = []
        state = [kept_state_bytes(plan.optimizer, sched.hosted(r), setup, matrix_config) for r in range(tp)]
        for r in range(tp):
            groups = [_group_bytes(g, tp, r, gb, ub, workspace, batching, stack) for g in tasks]
            if setup.overlap_step:  # under the reductions still in flight
                products = [_early_product_bytes(g, tp, r, gb) for g in tasks] if setup.grad_scaler else ()
                step = max(_deferred_peak(groups, state[r], mode, products) + reductions[i], adamw_temps, gathered)
            else:
                step = max(_tp_phase_peak(groups, mode), adamw_temps, gathered)
                if sched.prefetched:  # the prefetched gathers' buffers, under the reductions still in flight
                    early = sum(_group_bytes(sched.groups[op.group].tasks, tp, r, gb, ub, workspace).gather
                                for op in sched.prefetched)
                    step = max(step, early + reductions[i])
            row.append((master, state[r], step))
        rows.append(row)
        seen[key] = row

    ranks = []
    for i in range(dp):
        row = rows[0 if policy.replicated else i]
        reduction = reductions[i]
        adamw_state = setup.adamw_state_bytes(adamw_inside[i])  # its moments follow its update
        for r in range(tp):
            master, state, step = row[r]
            overhead = setup.overhead(max(activations + reduction, step))
            ranks.append(RankMemory(stage * dp * tp + i * tp + r, stage, i, r, weights, grads, master, state,
                                    adamw_state, activations, reduction, step, overhead, setup.userbuffers,
                                    setup.dispatcher_buffers))
    return LayoutMemory(policy.name, plan.optimizer, dp, tp, pp, stage, tuple(ranks), vp)


def reduction_bytes(plan: Plan, policy: StepPolicy, dp: int, adamw_size: int, impl: str, grad_bytes: int, *,
                    scratch: bool = False, adamw_grad_bytes: int | None = None) -> list[int]:
    """What each DP rank allocates for the gradient reduce-scatters of one step, all in flight at
    once at the end of backward (each bucket's by its plan cuts, or evenly under an all-reduce
    policy, then the AdamW buffer's even slices), as `canzona.runtime.comm` runs them. `scratch`:
    the backend writes a non-root's buffer during a reduce (gloo). `adamw_grad_bytes`: the AdamW
    buffer's bytes per element, where they differ from the buckets' (an empty one is fp32). An
    even reduce-scatter writes into the bucket itself (as Megatron's distributed optimizer does)
    and counts nothing."""
    lengths = reduction_lengths(plan, policy, dp, adamw_size)
    adamw_bytes = grad_bytes if adamw_grad_bytes is None else adamw_grad_bytes
    total = [0] * dp
    for i, seg in enumerate(lengths):
        nbytes = adamw_bytes if i == len(lengths) - 1 else grad_bytes
        for r, n in enumerate(temporary_elements_by_rank(impl, seg, scratch=scratch)):
            total[r] += n * nbytes
    return total


def reduction_lengths(plan: Plan, policy: StepPolicy, dp: int, adamw_size: int) -> list[list[int]]:
    """The segments (elements per DP rank, in rank order) of one step's gradient reduce-scatters
    as `canzona.runtime.comm` runs them: each bucket's by its plan cuts (evenly under an all-reduce
    policy), then, last, the AdamW buffer's even slices."""
    lengths = [b.segment_lengths() if policy.grad_sync == "reduce-scatter" else _even_lengths(b.size, dp)
               for b in plan.dp_plan.buckets]
    lengths.append(_even_lengths(adamw_size, dp))
    return lengths


def reduce_scatter_lengths(spec: ModelSpec, plan: Plan, policy: StepPolicy, dp: int) -> list[list[int]]:
    """`reduction_lengths` of `plan` for `spec` on a DP group of `dp` (the cluster's: a replicated
    policy's plan may be made for one DP rank), its AdamW buffer laid out as `memory_per_gpu` lays
    it out: every segment list a run of that plan routes (`canzona.reductions.bucket_route`), in
    the memory model and in the simulator's prices of the same reduce-scatters. A list of one
    segment is left out: one rank alone reduces nothing, and nothing routes it."""
    adamw_size = _adamw_slices(_adamw_sizes(spec, plan.tp), dp, plan.dp_plan.align, policy.replicated)[0]
    return [s for s in reduction_lengths(plan, policy, dp, adamw_size) if len(s) > 1]


def _adamw_sizes(spec: ModelSpec, tp: int) -> list[int]:
    """The elements of each AdamW parameter on a TP rank, in the flat buffer's order."""
    return [p.local_numel(tp) for p in spec.adamw_params()]


def _even_lengths(size: int, dp: int) -> list[int]:
    cuts = even_cuts(size, dp)
    return [b - a for a, b in zip(cuts, cuts[1:])]


def _streamed(groups: Sequence[GroupStep], setup: MemorySetup) -> tuple[list[tuple[Task, ...]], str]:
    """The tasks of each group as the schedule runs them, and the order; with `stream_tp_sync`, a
    tp-sync group is run one matrix at a time, serially (what a streaming implementation needs)."""
    if setup.stream_tp_sync and any(g.tasks and g.tasks[0].host == EVERY_RANK for g in groups):
        return [(t,) for g in groups for t in g.tasks], SERIAL
    return [g.tasks for g in groups], setup.tp_mode


def layer_dims(arch: Architecture, spec: ModelSpec) -> LayerDims:
    """What the memory model needs of the architecture: a SwiGLU decoder without dropout, with
    per-head q/k norms when the spec has them."""
    qk_norm = any(p.name.endswith(("q_norm.weight", "k_norm.weight")) for p in spec.params)
    # A spec without head counts (e.g. from ModelSpec.from_module) still gives q_dim and kv_dim; the
    # head count then only sizes flash attention's log-sum-exp (4 bytes per head and token), so
    # 128-wide heads, the common width, are assumed.
    head_dim = arch.head_dim or (arch.q_dim // arch.q_heads if arch.q_heads else min(128, arch.q_dim))
    q_heads = arch.q_heads or max(1, arch.q_dim // head_dim)
    kv_heads = arch.kv_heads or (max(1, arch.kv_dim // head_dim) if arch.kv_dim else None)
    # a mixture-of-experts MLP holds each token's activations in each of the experts it is routed
    # to: experts_per_token x an expert's width (Qwen3-MoE publishes that as its ffn; Mixtral's
    # intermediate_size is one expert's)
    ffn = round(arch.moe[1] * expert_width(spec, arch.moe, arch.hidden)) if arch.moe and expert_params(spec) \
        else arch.require("ffn")
    experts, per_token = arch.moe if arch.moe and expert_params(spec) else (0, 0)
    return LayerDims(arch.layers, arch.hidden, q_heads, ffn, arch.vocab, kv_heads, head_dim,
                     gated_mlp=True, dropout=False, qk_norm=qk_norm, experts=experts, experts_per_token=per_token)


__all__ = [
    "DEFAULT_FIXED_OVERHEAD", "DEFAULT_FRAGMENTATION", "GB", "RECOMPUTE_MODES", "check_recompute", "LayerDims", "LayoutMemory",
    "MemorySetup", "RankMemory", "activation_breakdown", "activation_bytes", "kernel_workspace_bytes",
    "layer_activation_bytes", "layer_dims", "loss_logit_bytes", "memory_per_gpu", "reduce_scatter_lengths", "reduction_bytes", "reduction_lengths",
    "userbuffer_bytes", "worst_rank", "deepep_buffer_bytes", "hybridep_buffer_bytes",
]
