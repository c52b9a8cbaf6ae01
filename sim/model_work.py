"""The compute of one micro-batch, kernel by kernel, on one TP rank (docs/design.md §9.3).

Every layer is a run of sequence-parallel blocks as Megatron builds them: an all-gather of the
block input, the column-parallel GEMMs (q, k, v; gate, up), the block's core (attention; the
activation function), the row-parallel GEMMs (o; down), a reduce-scatter of the output. Blocks are
read off the spec (a run of column-parallel matrices closed by a row-parallel one), so any
Megatron-style dense model works, not only the catalog.

Each GEMM is priced by the device's GEMM model (`canzona.cost.DeviceRate`: wave quantisation on the
SMs and the datasheet efficiency, or a calibrated efficiency curve), on its real shape: forward
`tokens x out/t x in`, backward a data-gradient and a weight-gradient GEMM of the same FLOPs.
Attention runs at a flash-attention efficiency; norms, rotary embeddings, SwiGLU and residual adds
are memory-bound passes over the activations.

A mixture-of-experts layer's experts are one more block without the dense TP collectives: each
TP rank routes its own sequence-parallel tokens, `tokens / tp x experts_per_token` token-expert
pairs, spread evenly over the experts (a balanced router; under expert parallelism its local
experts receive as many pairs, through the EP group's dispatch and combine all-to-alls, and the
busiest rank of an unbalanced router sets the pace); each stacked expert weight is one grouped
GEMM of its experts,
every expert's weights read once (at the experts' few rows each, the weights' reads dominate). The
router is a GEMM over the rank's tokens; the tokens' local permutation to and from expert order
and SwiGLU are memory-bound passes (under HybridEP the permutation is the dispatcher's own, priced
with its dispatch and combine: `sim.ep_dispatch`), and so are the layer's pre-MLP RMSNorm and
residual add, which Megatron's TransformerLayer runs around a MoELayer as around a dense MLP
(`pre_mlp_layernorm`, `mlp_bda`: `lk.moe_mlp_side`). Under expert TP (`etp` > 1) the ETP group all-gathers the
pairs its ranks received and each rank runs the grouped GEMMs on all of them with its shard of
the weights (gate / up rows, down columns: `canzona.experts.expert_tp_dim`), then the outputs
are reduce-scattered back (Megatron's MoEAlltoAllTokenDispatcher: docs/design.md §2.7).

Under context parallelism (`cp` > 1, Megatron's `--context-parallel-size` with Transformer
Engine's `cp_comm_type="p2p"`) each rank holds seq / cp tokens of every sequence (2 x cp chunks,
chunks i and 2cp-1-i on CP rank i, which balances the causal mask), so every GEMM, norm and the
head run on tokens / cp; the attention core is a ring of `cp` steps (`Block.ring_steps`), each
computing its query chunks against one rank's K/V block, 1 / cp of the attention's FLOPs (exactly,
for the balanced causal split), while the next block travels the ring (`Block.ring_bytes`, one
exchange per step that has a next: forward cp - 1 sends of K and V; backward cp sends: K/V, then
K/V with the travelling dK/dV, then dK/dV home: TE's AttnFuncWithCPAndKVP2P).

Weight gradients accumulate into the gradient buffer inside their GEMMs (`accumulate`: Megatron's
`gradient_accumulation_fusion`, on in every NVIDIA recipe and Megatron's default: TE's
`fuse_wgrad_accumulation` and Megatron's `wgrad_gemm_accum_fp32` / `_fp16` add each micro-batch's
weight gradient into `main_grad` with a beta = 1 GEMM), so each weight-gradient GEMM's epilogue
reads and writes the buffer's elements (fp32 `main_grad`: 8 bytes an element where a plain GEMM
writes 2; `canzona.gemm_model`). FSDP's weight gradients are fresh `.grad`s (no accumulation).

Under FP8 (`fp8`, `sim.fp8`) the layers' linear GEMMs (the experts' too, not the router's nor the
head's) run in FP8 and each block pays Transformer Engine's casts, transposes and scaling beside
them (`_fp8_block`); attention stays in the model's dtype.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from canzona.attention_rate import DEFAULT_ATTENTION_BACKEND, check_attention_backend, measured_on
from canzona.cost import (
    DeviceRate,
    Kernel,
    chunked_gemm_kernel,
    elementwise_kernel,
    gemm_kernel,
    grouped_gemm_kernel,
)
from canzona.errors import SpecError
from canzona.experts import expert_tp_dim, rank_shares
from canzona.memory import fp8_linear_params
from canzona.recompute import (
    SELECTIVE,
    SELECTIVE_LAYER,
    SELECTIVE_OP,
    check_recompute,
    forward_without_grad,
    mm_saved,
    reruns_whole,
)
from canzona.routing import RANDOM, busiest_rank
from canzona.spec import DTYPE_BYTES, ModelSpec, ParamSpec, Role
from sim import cross_entropy as ce
from sim import eager_kernels as ek
from sim import layer_kernels as lk
from sim import unfused_kernels as uk
from sim.cross_entropy import CROSS_ENTROPY_PATHS, UNFUSED
from sim.eager_kernels import EAGER, FUSED, check_kernels
from sim.ep_dispatch import (
    DEEPEP,
    HYBRIDEP,
    PROBS_BYTES,
    AlltoallMetadata,
    EpDispatcher,
    FlexTraffic,
)
from sim.fp8 import CURRENT, DELAYED, FP8, FP8Setup
from sim.userbuffers import UB_STREAMS, GemmChunks

# the head dimension when a caller gives none (every catalog model's: Llama 3, Qwen3)
DEFAULT_HEAD_DIM = 128


@dataclass(frozen=True)
class Block:
    """One sequence-parallel block of one pass: `first` (the GEMMs the input all-gather overlaps),
    `middle`, `last` (the GEMMs the output reduce-scatter overlaps), in seconds."""

    name: str
    first_s: float
    middle_s: float
    last_s: float
    tp_collectives: bool = True  # False: the block moves nothing across TP (experts at expert TP 1)
    # expert parallelism: bytes each rank sends in the token dispatch all-to-all before the block
    # and in the combine after it (forward; backward sends the gradients back the same way)
    ep_bytes: float = 0.0
    ep_received: float = 0.0  # what the busiest rank of the EP group receives (an unbalanced router)
    # under a flex token dispatcher (DeepEP, HybridEP: sim.ep_dispatch), what it moves, which
    # prices the dispatch and combine in place of the all-to-all of `ep_bytes`; None: all-to-all
    ep_flex: FlexTraffic | None = None
    # under the `alltoall` dispatcher, what Megatron exchanges beside the tokens (the count
    # all-gather and host sync before the forward's dispatch, the probabilities' all-to-all:
    # sim.ep_dispatch.AlltoallMetadata); None: a flex dispatcher, or no EP
    ep_meta: AlltoallMetadata | None = None
    # expert TP: the bytes an ETP group's all-gather of the received pairs gathers (its whole
    # output), and its reduce-scatter of the experts' outputs reduces, around the grouped GEMMs
    etp_bytes: float = 0.0
    # context parallelism: the attention core (`core_s`, inside `middle_s`) as a ring of
    # `ring_steps` equal steps, `ring_bytes[i]` the bytes each rank sends to the next CP rank while
    # step i computes (the block step i + 1 needs; the last backward one the dK/dV going home)
    core_s: float = 0.0
    ring_steps: int = 0
    ring_bytes: tuple[float, ...] = ()
    # each ring step's seconds (summing to `core_s`): a step runs at the efficiency of its shape
    ring_step_s: tuple[float, ...] = ()
    # of `seconds`, an expert block's backward's expert weight-gradient GEMMs: what Megatron's
    # delay_wgrad_compute runs after the dispatch gradient is issued (sim.ep_overlap)
    wgrad_s: float = 0.0
    # a backward block under full recompute whose forward has collectives (`rerun_forward`): that
    # forward block, which the backward runs again first with its collectives (TP's all-gather and
    # reduce-scatter, the CP ring's K/V exchanges, an expert block's token dispatch, ETP
    # collectives and combine), on the forward's streams at the forward's prices
    # (`canzona.recompute`); not in `seconds`. None: no collective re-runs (any recompute is
    # inside `middle_s`)
    recompute: Block | None = None
    # of `last_s`, a sequence-parallel block's backward's column-parallel weight-gradient GEMMs (the
    # rest, their data-gradient GEMMs): without userbuffers, Transformer Engine runs the input's
    # re-gather beside the data-gradient GEMM and the data gradient's reduce-scatter beside the
    # weight-gradient GEMM (sim.iteration._Stage.nccl_block)
    last_wgrad_s: float = 0.0
    # of `first_s`, a backward block's row-parallel weight-gradient GEMMs (the rest, their
    # data-gradient GEMMs): with `last_wgrad_s`, what Transformer Engine stashes under Megatron's
    # delay_wgrad_compute and Megatron runs in the node's `backward_dw` (sim.ep_overlap)
    first_wgrad_s: float = 0.0
    # False: a forward block re-run by torch's checkpoint up to its early stop, which ends before
    # the collective that sends the block's output: a dense block's TP reduce-scatter after the
    # row-parallel GEMMs the stop skips (`_stopped_early`), an expert block's DeepEP combine
    # (`_expert_rerun`)
    sends_output: bool = True
    # a forward block's first GEMMs whole where `first_s` prices them in userbuffers chunks: what
    # a forward without grad runs (TE turns the all-gather's overlap off there: `without_grad`)
    whole_first_s: float | None = None

    def without_grad(self) -> Block:
        """The block as a forward without autograd runs it (the first forward of a layer under full
        recompute): Transformer Engine's `ub_overlap_ag_fprop and is_grad_enabled` runs the
        column GEMMs whole, not in the userbuffers chunks (`whole_first_s`)."""
        return self if self.whole_first_s is None else replace(self, first_s=self.whole_first_s, whole_first_s=None)

    def step_seconds(self, i: int) -> float:
        """Seconds of ring step `i` of the attention core."""
        return self.ring_step_s[i] if self.ring_step_s else self.core_s / self.ring_steps

    @property
    def seconds(self) -> float:
        return self.first_s + self.middle_s + self.last_s


@dataclass(frozen=True)
class MicroBatchWork:
    layer_ids: tuple[int, ...]  # the model's layer indices this work covers (a pipeline stage's)
    forward: tuple[tuple[Block, ...], ...]  # per layer, blocks in forward order
    backward: tuple[tuple[Block, ...], ...]  # per layer, blocks in backward order
    head_forward_s: float  # 0 on a pipeline stage without the output layer
    head_backward_s: float
    # the input embedding's lookup and its gradient (0 on a stage without the embedding)
    embed_forward_s: float = 0.0
    embed_backward_s: float = 0.0
    # under full recompute, the layer ids that run outside any checkpoint (Megatron's block method:
    # past the first N of a model chunk; torchtitan's selective-layer: all but every K-th): stored
    # whole, their forward with grad, not re-run
    uncheckpointed: frozenset[int] = frozenset()

    def checkpointed(self, k: int) -> bool:
        """Whether layer `k` (the stage's work index) is not left outside a checkpoint (under full
        recompute: inside one; Megatron's block method leaves the layers past its first N out)."""
        return self.layer_ids[k] not in self.uncheckpointed

    def no_grad(self, k: int, recompute: str) -> bool:
        """Whether layer `k` (the stage's work index) runs its first forward without autograd under
        `recompute` (`canzona.recompute.forward_without_grad`: inside Megatron's checkpoint)."""
        return forward_without_grad(recompute) and self.checkpointed(k)


def rerun_forward(fwd: Block, bwd: Block, tp: int) -> Block:
    """Backward block `bwd` under full recompute, which runs its forward block `fwd` again first
    (Megatron's `_checkpointed_forward` re-runs each checkpointed layer's whole forward, torch's
    checkpoint wrappers likewise: `canzona.recompute`): as `Block.recompute` where the forward has
    collectives of its own (at TP > 1 its sequence-parallel all-gather and reduce-scatter, under
    CP its attention ring, under EP its token dispatch and combine), which then run again on their
    streams; else the forward's kernels inside `bwd`'s middle. Each block's forward re-runs just
    before its own backward; Megatron re-runs a layer's blocks together before the layer's
    backward: the same work on the same chain, in another order."""
    if fwd.ep_bytes or fwd.ring_steps or (tp > 1 and fwd.tp_collectives):
        return replace(bwd, recompute=fwd)
    return replace(bwd, middle_s=bwd.middle_s + fwd.seconds)


def _stopped_early(fwd: Block, add_s: float) -> Block:
    """A layer's last forward block as torch's non-reentrant checkpoint re-runs it
    (`canzona.recompute.rerun_stops_early`): without its row-parallel GEMMs (`last_s`: the down
    projection, whose `mm` saves its input and weight before it runs, the last tensors the layer
    saves) and the residual add after them (`add_s`). Under TP the block keeps its input's
    all-gather (`rerun_forward`) but not its output's reduce-scatter, which follows the GEMMs the
    stop skips (`sends_output`)."""
    return replace(fwd, middle_s=fwd.middle_s - add_s, last_s=0.0, sends_output=False)


def _expert_rerun(fwd: Block, add_s: float) -> Block:
    """An expert block (with the layer's norm and residual add, `add_s` of it) as torch's
    non-reentrant checkpoint re-runs it (`canzona.recompute.rerun_stops_early`). Under the flex
    dispatcher's DeepEP backend the combine is an autograd function that saves no tensor
    (`FusedCombine` keeps the handle as a Python attribute), so the layer's last saving op is the
    unpermute before it (its scatter-add saves the indices; TE's fused one its row map): the
    re-run ends there, without the combine and the residual add after it. HybridEP unpermutes
    inside its combine and the `alltoall` dispatcher's unpermute follows its combine: their
    re-runs are priced whole (what they save is not read here: conservative)."""
    if fwd.ep_flex is None or fwd.ep_flex.backend != DEEPEP or not fwd.ep_bytes:
        return fwd
    return replace(fwd, middle_s=fwd.middle_s - add_s, sends_output=False)


def _blocks_of(params: Sequence[ParamSpec]) -> list[list[ParamSpec]]:
    """Runs of matrices closed by a row-parallel one (tp_dim 1); a trailing run stands alone."""
    out: list[list[ParamSpec]] = [[]]
    for p in params:
        out[-1].append(p)
        if p.tp_dim == 1:
            out.append([])
    return [b for b in out if b]


def _is_expert_gemm(p: ParamSpec) -> bool:
    """A mixture-of-experts layer's router or expert weight (a whole stack, not its matrices)."""
    return p.role in (Role.EXPERT, Role.ROUTER)


def micro_batch_work(spec: ModelSpec, tp: int, tokens: int, seq_len: int, q_dim: int, hidden: int,
                     vocab: int, rate: DeviceRate, recompute: str = "none",
                     checkpointed: Collection[int] | None = None, causal: bool = True, dtype: str = "bf16",
                     head: bool = True, experts: tuple[int, int] | None = None, ep: int = 1,
                     router_imbalance: float | tuple[float, ...] = 1.0, etp: int = 1, cp: int = 1,
                     kv_dim: int | None = None, head_dim: int = DEFAULT_HEAD_DIM,
                     fp8: FP8Setup | None = None,
                     attention_backend: str = DEFAULT_ATTENTION_BACKEND, kernels: str = FUSED,
                     accumulate: int = 0, dispatcher: EpDispatcher | None = None,
                     cross_entropy: str = UNFUSED, apply_rope_fusion: bool = True,
                     bias_activation_fusion: bool = True, early_stop: bool = False,
                     torch_loss: bool = False, loss_bytes: int = DTYPE_BYTES["fp32"],
                     overlap_chunks: Mapping[str, GemmChunks] | None = None) -> MicroBatchWork:
    """Per layer and block, the seconds of one micro-batch of `tokens` on one of `tp` ranks, for
    the layers of `spec` (a pipeline stage's spec holds only its own); `head`: the stage runs the
    output layer and the loss; `experts`: (experts, experts_per_token) of a mixture-of-experts
    model (`Architecture`); `ep`: its expert parallelism (each rank computes `experts / ep` of
    the experts, on the token-expert pairs dispatched to them); `router_imbalance`: the router's
    persistent skew, the busiest EP rank's mean pairs over the mean or the router's histogram
    (`canzona.experts.router_imbalance`), on which the dispatcher's `routing` adds each micro-batch's
    random fluctuation (`canzona.routing`): every rank of an EP group waits for its busiest; `etp`: expert TP (each
    rank computes its shard of its experts on its ETP group's pairs); `cp`: context parallelism
    (each rank computes `tokens / cp` of the micro-batch, attention as a ring of `cp` steps
    exchanging K/V blocks of `kv_dim` wide keys and values: the module docstring); `head_dim`: the
    attention heads' dimension (the fused attention's efficiency depends on it); `fp8`: the linear layers'
    GEMMs in FP8 with Transformer Engine's overheads (`sim.fp8`); `attention_backend`: Megatron's
    `--attention-backend` (`canzona.attention_rate.ATTENTION_BACKENDS`: fused, cuDNN's kernels;
    flash, flash-attn 2); `kernels`: the memory-bound kernels fused (`sim.layer_kernels`) or
    PyTorch's eager ops (`sim.eager_kernels`); `accumulate`: the bytes of a gradient buffer element
    every weight-gradient GEMM adds into (`Workload.grad_bytes` under Megatron's gradient
    accumulation fusion; 0: fresh gradients, as FSDP's); `dispatcher`: Megatron's token dispatcher
    under EP (`sim.ep_dispatch`; None: the all-to-all of every pair); `cross_entropy`: the loss's
    path (`sim.cross_entropy`: unfused, or Megatron's fused native / te; fused kernels only);
    `apply_rope_fusion`, `bias_activation_fusion`: Megatron's options of those names, off: its
    unfused RoPE and SwiGLU (`sim.unfused_kernels`); `checkpointed`: under full recompute the layer
    ids run inside a checkpoint, whose forward is re-run before the backward (Megatron's block
    method: `canzona.recompute.checkpointed_layers`); the others as without recompute (None: every
    layer); under torchtitan's selective-layer likewise, and required (every K-th layer:
    `canzona.recompute.selective_layers`); `early_stop`: the checkpoint's re-run stops at the
    layer's last op that saves a tensor, as torch's non-reentrant checkpoint does
    (`canzona.recompute.rerun_stops_early`): a dense layer's down projection GEMM and residual add
    are not run again (`_stopped_early`); False: the whole forward again, as Megatron's checkpoint;
    `overlap_chunks`: under Transformer Engine's userbuffers overlap, per block ("attention",
    "mlp") the chunks of its forward column GEMMs, forward row GEMMs and backward row
    data-gradient GEMMs (`sim.userbuffers.GemmChunks`; None: every GEMM whole);
    `torch_loss`: the loss is PyTorch's `F.cross_entropy` (`SimConfig.loss_autograd`: the FSDP2
    frameworks'), priced as `sim.eager_kernels` prices it on logits of `loss_bytes` (fp32 where the
    loss upcasts them), as under eager kernels."""
    check_recompute(recompute)
    if recompute == SELECTIVE_LAYER and checkpointed is None:
        raise SpecError("selective-layer recompute needs the checkpointed layers (canzona.recompute.selective_layers)")
    eager = check_kernels(kernels) == EAGER
    if cross_entropy not in CROSS_ENTROPY_PATHS:
        raise SpecError(f"unknown cross-entropy path {cross_entropy!r}; choose one of {', '.join(CROSS_ENTROPY_PATHS)}")
    if eager and cross_entropy != UNFUSED:
        raise SpecError("Megatron's fused cross-entropy runs with fused kernels, not eager ones")
    if accumulate not in (0, DTYPE_BYTES["bf16"], DTYPE_BYTES["fp32"]):
        raise SpecError(f"weight gradients accumulate into bf16 (2) or fp32 (4) buffers, got {accumulate!r} bytes")
    full_tokens, tokens = tokens, tokens // cp
    # each EP rank's persistent mean share of the pairs (mean 1), which the routing's fluctuation rides on
    shares = rank_shares(router_imbalance, experts[0], ep) if experts is not None and ep > 1 else (1.0,)
    layer_ids = sorted({p.layer for p in spec.params if p.layer is not None})
    by_id: dict[int, list[ParamSpec]] = {i: [] for i in layer_ids}
    moe_by_id: dict[int, list[ParamSpec]] = {i: [] for i in layer_ids}
    for p in spec.own_matrices():
        if p.layer is not None and not _is_expert_gemm(p):
            by_id[p.layer].append(p)
    for p in spec.params:
        if p.layer is not None and _is_expert_gemm(p) and (p.matrix_shape or len(p.shape) == 2):
            moe_by_id[p.layer].append(p)
    if any(moe_by_id.values()) and experts is None:
        raise SpecError(f"model {spec.name!r} has experts: its architecture must give experts and experts_per_token")
    for i in layer_ids:
        if moe_by_id[i]:  # a router on the matrix optimizer is still the router: it runs with the experts
            replicated = [p for p in by_id[i] if p.tp_dim is None]
            by_id[i] = [p for p in by_id[i] if p.tp_dim is not None]
            moe_by_id[i] = replicated + moe_by_id[i]
    by_layer = [by_id[i] for i in layer_ids]

    def run(kernels: Sequence[Kernel]) -> float:
        return sum(rate.kernel_seconds(k) for k in kernels)

    linear = FP8 if fp8 is not None else dtype  # the layers' linear GEMMs

    def gemm_kernels(params: Sequence[ParamSpec], backward: bool, grads: str = "both") -> list[Kernel]:
        """The GEMMs of `params`: forward, or backward's data-gradient ("dgrad"), weight-gradient
        ("wgrad") or both ones."""
        ks = []
        for p in params:
            out, inp = p.local_shape(tp)
            if backward:
                if grads in ("both", "dgrad"):
                    ks.append(gemm_kernel(f"{p.name}.dgrad", tokens, inp, out, linear))
                if grads in ("both", "wgrad"):
                    ks.append(gemm_kernel(f"{p.name}.wgrad", out, inp, tokens, linear, accumulate=accumulate))
            else:
                ks.append(gemm_kernel(p.name, tokens, out, inp, linear))
        return ks

    def gemms(params: Sequence[ParamSpec], backward: bool) -> float:
        return run(gemm_kernels(params, backward))

    def chunked(params: Sequence[ParamSpec], chunks: int, dgrad: bool = False, by_columns: bool = False) -> float:
        """The forward GEMMs of `params` (`dgrad`: their data-gradient GEMMs) as Transformer
        Engine runs them under a userbuffers overlap (`sim.userbuffers.UserbuffersConfig.gemm_chunks`):
        the whole GEMMs plus what chunking costs. Megatron runs the column GEMMs sharing an input
        as one fused GEMM (`linear_qkv`: q, k and v; `linear_fc1`: gate and up), which TE cuts into
        `chunks` GEMMs of `tokens / chunks` rows (`by_columns`: of all the tokens and `1 / chunks`
        of the output columns, a `pipeline` reduce-scatter's) round-robin on `UB_STREAMS` streams:
        all the chunks' tiles, at most `UB_STREAMS` chunks' tiles (and the SMs) in a wave
        (`canzona.cost.chunked_gemm_kernel`), never faster than the whole fused GEMM; one chunk:
        the whole GEMMs."""
        whole = run(gemm_kernels(params, dgrad, "dgrad"))
        if chunks <= 1:
            return whole
        fused: dict[int, int] = {}  # the fused GEMMs: output width by input width
        for p in params:
            out, inp = p.local_shape(tp)
            n, k = (inp, out) if dgrad else (out, inp)
            fused[k] = fused.get(k, 0) + n
        name = f"{params[0].name if len(params) == 1 else 'fused'}{'.dgrad' if dgrad else ''}.chunk"
        for k, n in fused.items():
            m_c, n_c = (tokens, n // chunks) if by_columns else (tokens // chunks, n)  # a chunk's shape
            whole += max(0.0, run([chunked_gemm_kernel(name, m_c, n_c, k, chunks, UB_STREAMS, linear)])
                         - run([gemm_kernel(name, tokens, n, k, linear)]))
        return whole

    # FP8's per-micro-batch scaling work of the whole stage (delayed scaling: the amax all-reduce
    # and the history / scale update, after each forward and each backward of every model chunk),
    # spread evenly over the stage's layers
    fp8_fwd = fp8_bwd = 0.0
    if fp8 is not None and fp8.recipe == DELAYED and layer_ids:
        n_gemms = len(fp8_linear_params(spec))
        per_pass = fp8.chunks / len(layer_ids)
        fp8_fwd = per_pass * (fp8.amax_reduce_s + rate.kernel_seconds(fp8.scale_update(3 * n_gemms)))
        fp8_bwd = per_pass * (fp8.amax_reduce_s + rate.kernel_seconds(fp8.scale_update(2 * n_gemms)))

    seqs = full_tokens // seq_len if full_tokens >= seq_len else 1
    attn_flops = 4.0 * seq_len * seq_len * (q_dim / tp) * seqs * (0.5 if causal else 1.0)
    if cp > 1:  # this rank's share: its query chunks against every K/V block
        attn_flops /= cp
    peak = rate.peak_flops.get(dtype, rate.gemm_flops[dtype])
    impl = check_attention_backend(attention_backend)
    # attention runs at the clock the GEMMs sustain under the power limit, on the GPU whose
    # measured loops the table holds (canzona.attention_rate)
    power = rate.gemm_model
    clock = dict(clock=power.sustained_clock, window_s=power.boost_window_s) \
        if power is not None and measured_on(rate.name) else {}
    steps_f = lk.attention_steps(attn_flops, seq_len, cp, causal, head_dim, peak, backward=False,
                                 implementation=impl, **clock) if q_dim else ()
    steps_b = lk.attention_steps(attn_flops, seq_len, cp, causal, head_dim, peak, backward=True,
                                 implementation=impl, **clock) if q_dim else ()
    two = DTYPE_BYTES[dtype]  # activations in the model's dtype
    shape = lk.LayerShape(tokens=tokens, tp=tp, hidden=hidden, act_bytes=two, sms=rate.sms or 132)
    q_width, kv_width = q_dim / tp, (kv_dim or q_dim) / tp
    qk_norm = any(p.name.endswith(("q_norm.weight", "k_norm.weight")) for p in spec.params)
    if eager and (qk_norm or cp > 1 or experts is not None):
        raise SpecError("eager kernels are modelled for dense Llama layers (no q/k norms, experts or context "
                        "parallelism)")
    if eager and not (apply_rope_fusion and bias_activation_fusion):
        raise SpecError("apply_rope_fusion / bias_activation_fusion are Megatron's fused kernels; eager kernels "
                        "are unfused already")
    if experts is not None and not bias_activation_fusion:
        raise SpecError("bias_activation_fusion off is modelled for dense MLPs, not for experts")
    positions = max(1, seq_len // cp)  # the rows of a rank's RoPE frequency table

    def rope_kernels(backward: bool, name: str) -> list[Kernel] | None:
        if apply_rope_fusion:
            return None
        return uk.rope(shape, q_width, kv_width, backward, name, positions=positions, head_dim=head_dim)

    def elementwise(block: Sequence[ParamSpec], attention: bool, backward: bool, name: str) -> float:
        """The block's memory-bound kernels (`sim.layer_kernels`): norm, RoPE or the activation,
        the residual add, and under CP the ring steps' merges."""
        if attention and eager:
            return run(ek.attention_block(shape, q_width, kv_width, backward, name))
        if attention:
            return run(lk.attention_block(shape, q_width, kv_width, backward, name, with_qk_norm=qk_norm,
                                          rope_kernels=rope_kernels(backward, name))
                       + lk.ring_merges(shape, q_width, kv_width, cp, backward, name))
        column = [p.local_shape(tp)[0] for p in block if p.tp_dim == 0]
        gated = len(column) == 2 and column[0] == column[1]  # gate and up: SwiGLU
        if eager:
            return run(ek.mlp_block(shape, sum(column), gated, backward, name))
        unfused = uk.swiglu(shape, sum(column), backward, name) if gated and not bias_activation_fusion else None
        return run(lk.mlp_block(shape, sum(column), gated, backward, name, activation_kernels=unfused))

    forward, backward = [], []
    outside = frozenset(i for i in layer_ids if reruns_whole(recompute) and checkpointed is not None
                        and i not in checkpointed)
    for layer, params in zip(layer_ids, by_layer):
        fwd_blocks, bwd_blocks = [], []
        rerun = reruns_whole(recompute) and layer not in outside  # the forward re-run before the backward
        # selective-op: the layer's mms whose outputs are not saved run again (`canzona.recompute`)
        unsaved = {p.name for i, p in enumerate(params) if not mm_saved(i)}
        blocks = _blocks_of(params)
        for i, block in enumerate(blocks):
            column = [p for p in block if p.tp_dim != 1]
            row = [p for p in block if p.tp_dim == 1]
            attention = i == 0 and bool(q_dim)
            core_f = sum(steps_f) if attention else 0.0
            core_b = sum(steps_b) if attention else 0.0
            ring_f: dict = {}
            ring_b: dict = {}
            if cp > 1 and core_f:  # K and V of this rank's tokens, its TP rank's heads
                kv = tokens * 2 * kv_width * two
                ring_f = dict(core_s=core_f, ring_steps=cp, ring_bytes=(kv,) * (cp - 1), ring_step_s=steps_f)
                ring_b = dict(core_s=core_b, ring_steps=cp, ring_bytes=(kv,) + (2 * kv,) * (cp - 2) + (kv,),
                              ring_step_s=steps_b)
            cast_f, cast_b = _fp8_block(fp8, column, row, tokens, tp, rate) if fp8 is not None else (0.0, 0.0)
            name = f"layer {layer}.{i}"
            # the overlapped GEMMs' chunks under userbuffers (1: the whole GEMM)
            ag_f, rs_f, ag_b, rs_by_columns = (overlap_chunks or {}).get("attention" if attention else "mlp",
                                                                         GemmChunks(1, 1, 1))
            fwd = Block(name, chunked(column, ag_f), core_f + elementwise(block, attention, False, name) + cast_f,
                        chunked(row, rs_f, by_columns=rs_by_columns),
                        whole_first_s=gemms(column, False) if ag_f > 1 else None, **ring_f)
            # the layer's last op that saves a tensor is this block's row GEMM (no experts after it):
            # torch's early stop ends the re-run on entering it (`canzona.recompute.rerun_stops_early`)
            stops_here = early_stop and i == len(blocks) - 1 and not moe_by_id[layer]
            skipped_add = run([lk.residual_add(shape, name)]) if stops_here else 0.0
            redo = 0.0  # full recompute: the whole forward block again (`rerun_forward`), below
            if recompute == SELECTIVE:
                redo = core_f  # the attention core is recomputed, the rest stored (Korthikanti et al. 2022)
            elif recompute == SELECTIVE_OP:  # every other mm and the memory-bound passes; attention is saved
                redo = gemms([p for p in block if p.name in unsaved], False) + elementwise(block, attention, False,
                                                                                          name) - skipped_add
            bwd = Block(name, chunked(row, ag_b, dgrad=True) + run(gemm_kernels(row, True, "wgrad")), core_b + redo + elementwise(block, attention, True, name) + cast_b,
                        gemms(column, True), last_wgrad_s=run(gemm_kernels(column, True, "wgrad")),
                        first_wgrad_s=run(gemm_kernels(row, True, "wgrad")), **ring_b)
            if rerun:
                bwd = rerun_forward(_stopped_early(fwd, skipped_add) if stops_here else fwd, bwd, tp)
            fwd_blocks.append(fwd)
            bwd_blocks.append(bwd)
        if moe_by_id[layer]:
            assert experts is not None
            name = f"layer {layer}.experts"
            fwd, bwd = _expert_block(name, moe_by_id[layer], tokens / tp, hidden, experts,
                                     rate, dtype, recompute, ep, shares, etp, fp8, accumulate,
                                     dispatcher)
            # the layer's pre-MLP norm and residual add, as a dense MLP block's (`lk.moe_mlp_side`);
            # recomputed with the experts under full and selective-op recompute. Under the EP
            # overlap Megatron issues the add after the combine, on its communication stream
            # (fine_grained_callables.py, submodule_combine_forward): priced on the compute
            # stream here, an approximation
            side = run(lk.moe_mlp_side(shape, False, name))
            redo = side if recompute == SELECTIVE_OP else 0.0
            fwd = replace(fwd, middle_s=fwd.middle_s + side)
            bwd = replace(bwd, middle_s=bwd.middle_s + run(lk.moe_mlp_side(shape, True, name)) + redo)
            if rerun:  # the whole forward block again (its collectives too, where it has any), or to its early stop
                again = fwd
                # with a shared expert beside the routed ones (`len(blocks) > 1`), which may run
                # after the combine and save its inputs there, the re-run is priced whole
                if early_stop and len(blocks) == 1:
                    again = _expert_rerun(fwd, run([lk.residual_add(shape, name)]))
                bwd = rerun_forward(again, bwd, tp)
            fwd_blocks.append(fwd)
            bwd_blocks.append(bwd)
        if fp8_fwd:
            fwd_blocks[-1] = replace(fwd_blocks[-1], middle_s=fwd_blocks[-1].middle_s + fp8_fwd)
            bwd_blocks[0] = replace(bwd_blocks[0], middle_s=bwd_blocks[0].middle_s + fp8_bwd)
        forward.append(tuple(fwd_blocks))
        backward.append(tuple(reversed(bwd_blocks)))
    embed = [p for p in spec.params if p.role is Role.EMBEDDING]
    embed_f = embed_b = 0.0
    if embed:  # the first stage: the rank's vocabulary slice of the table (vocab-parallel)
        rows = embed[0].local_shape(tp)[0]
        embed_f = run(lk.embedding_kernels(tokens, rows, hidden, two, backward=False))
        embed_b = run(lk.embedding_kernels(tokens, rows, hidden, two, backward=True))
    if not head:
        return MicroBatchWork(tuple(layer_ids), tuple(forward), tuple(backward), 0.0, 0.0, embed_f, embed_b, outside)

    def loss(tokens: int, vocab_slice: int, backward: bool) -> list[Kernel]:
        if eager or torch_loss:  # PyTorch's F.cross_entropy, on logits of `loss_bytes`
            return ek.loss_kernels(tokens, vocab_slice, backward, loss_bytes)
        return ce.loss_kernels(tokens, vocab_slice, backward, cross_entropy)

    head_f = run([gemm_kernel("head", tokens, vocab // tp, hidden, dtype),
                  *loss(tokens, vocab // tp, backward=False)])
    head_b = run([gemm_kernel("head.dgrad", tokens, hidden, vocab // tp, dtype),
                  gemm_kernel("head.wgrad", vocab // tp, hidden, tokens, dtype, accumulate=accumulate),
                  *loss(tokens, vocab // tp, backward=True)])
    return MicroBatchWork(tuple(layer_ids), tuple(forward), tuple(backward), head_f, head_b, embed_f, embed_b, outside)


def _expert_block(name: str, params: Sequence[ParamSpec], tokens: float, hidden: int, experts: tuple[int, int],
                  rate: DeviceRate, dtype: str, recompute: str, ep: int = 1,
                  shares: tuple[float, ...] = (1.0,), etp: int = 1, fp8: FP8Setup | None = None,
                  accumulate: int = 0, dispatcher: EpDispatcher | None = None) -> tuple[Block, Block]:
    """A mixture-of-experts MLP on one rank's `tokens` (forward, backward): the router and every
    other replicated matrix over the tokens, each expert weight as one grouped GEMM over the
    token-expert pairs of its experts (a stack of `[experts, out, in]`, or one expert's linear).
    Under expert parallelism the rank holds `experts / ep` of each stack and, on average, receives
    as many pairs as its tokens make (`tokens x experts_per_token`), of which `(ep - 1) / ep` come
    from the other ranks of its EP group (and return there). The block is the busiest rank's,
    received and computed, which its EP group waits for (under EP only: at EP 1 every rank
    computes every expert on its own tokens): `shares`, each EP rank's persistent mean share of
    the pairs (mean 1; `canzona.experts.rank_shares`), with the random fluctuation of the
    dispatcher's `routing` on top (`canzona.routing.busiest_rank`: the busiest rank's expected
    pairs, and for a flex dispatcher distinct tokens, over the mean; none under AutoModel's
    deterministic FakeBalancedGate). Under
    expert TP each rank computes its ETP group's `etp` times the pairs on `1 / etp` of each
    expert's weights: the same FLOPs in GEMMs `etp` times taller and thinner, and the sorts of
    the gathered pairs by expert and back on `etp` times the pairs, around the ETP group's
    all-gather and reduce-scatter of the pairs (`Block.etp_bytes`). Under FP8 the expert GEMMs run
    in FP8 (TE's GroupedLinear), each casting its input, its output gradient and (once per
    iteration) its weights; the router stays in `dtype`. `accumulate`: as `micro_batch_work`'s (the
    weight gradients added into the gradient buffer inside their GEMMs). Under a flex
    `dispatcher` the block carries the tokens it dispatches (`Block.ep_flex`, priced by
    `sim.ep_dispatch`: each token once per destination rank and node); under its
    `fake_balanced_gate` (AutoModel's) the router runs no GEMM."""
    count, per_token = experts
    # AutoModel's FakeBalancedGate computes its routing from token indices: it has no weight and runs
    # no router GEMM (nemo_automodel/components/moe/layers.py); the router's weights still count in
    # memory and FSDP's gathers here (a simplification: 128 x 2048 of Qwen3-30B-A3B's weights a layer).
    # Its routing is deterministic and balanced: no fluctuation (`canzona.routing`)
    fake_gate = dispatcher is not None and dispatcher.fake_balanced_gate
    routing = dispatcher.load_routing if dispatcher is not None else RANDOM
    skew = max(shares) if ep > 1 else 1.0
    # the busiest EP rank's expected pairs and distinct tokens over the mean, and (under expert TP)
    # the busiest ETP group's gathered pairs: the sum of `etp` EP groups' independent draws at one
    # position, as one group of `etp` times the tokens
    busy = busiest_rank(experts=count, top_k=per_token, ep=ep, tokens=tokens, routing=routing, shares=shares)
    gathered_busy = busy if etp == 1 else busiest_rank(experts=count, top_k=per_token, ep=ep, tokens=tokens * etp,
                                                       routing=routing, shares=shares)
    flex = None
    if ep > 1 and dispatcher is not None and dispatcher.flex:
        backend = dispatcher.moe_flex_dispatcher_backend
        assert backend is not None  # EpDispatcher.check
        flex = FlexTraffic(backend, dispatcher.sms,
                           tokens * hidden * DTYPE_BYTES[dtype], count, per_token, skew, tokens, forward=True,
                           fake_balanced_gate=dispatcher.fake_balanced_gate, busiest=busy)
    pairs = tokens * per_token  # token-expert pairs this rank sends out
    busiest = pairs * (busy.pairs if ep > 1 else 1.0)  # ... and what the busiest rank receives
    computed = pairs * etp * (gathered_busy.pairs if ep > 1 else 1.0)  # the pairs the rank computes: its ETP group's
    local = count // ep  # the experts this rank computes
    fwd_k: list[Kernel] = []
    bwd_k: list[Kernel] = []
    wgrad_s = 0.0  # the expert weight-gradient GEMMs' seconds (Block.wgrad_s)
    width = 0
    gemm_dtype = FP8 if fp8 is not None else dtype
    for p in params:
        out, inp = p.shape[-2], p.shape[-1]
        if p.role is Role.EXPERT:
            if etp > 1 and p.matrix_shape is not None:  # this rank's shard of every expert (as expert_part)
                axis = expert_tp_dim(p, hidden) - (len(p.shape) - 2)
                out, inp = (out // etp, inp) if axis == 0 else (out, inp // etp)
            groups = p.shape[0] // ep if len(p.shape) == 3 else 1
            rows = max(1, round(computed / local))  # each expert's share of the pairs
            fwd_k.append(grouped_gemm_kernel(p.name, rows, out, inp, groups, gemm_dtype))
            wgrad = grouped_gemm_kernel(f"{p.name}.wgrad", out, inp, rows, groups, gemm_dtype, accumulate=accumulate)
            bwd_k += [grouped_gemm_kernel(f"{p.name}.dgrad", rows, inp, out, groups, gemm_dtype), wgrad]
            wgrad_s += rate.kernel_seconds(wgrad)
            if fp8 is not None:  # per expert GEMM: its input, its output gradient, its weights
                fwd_k += [fp8.cast(p.name, rows * groups, inp), fp8.weight_cast(p.name, out * inp * groups)]
                bwd_k.append(fp8.cast(f"{p.name}.grad", rows * groups, out))
            if out != hidden:
                width = max(width, out)
        elif not (fake_gate and p.role is Role.ROUTER):
            m = max(1, round(tokens))
            fwd_k.append(gemm_kernel(p.name, m, out, inp, dtype))
            bwd_k += [gemm_kernel(f"{p.name}.dgrad", m, inp, out, dtype),
                      gemm_kernel(f"{p.name}.wgrad", out, inp, m, dtype, accumulate=accumulate)]
    two = DTYPE_BYTES[dtype]
    # permute the tokens to expert order and back (read + write hidden per pair, each way), SwiGLU
    # over the fc1 output (read 2 x ffn, write ffn per pair), the weighted sum of the experts'
    # outputs; under expert TP the sort of the received pairs into expert order and back (read +
    # write hidden) and SwiGLU (on its shard of the width) run on the ETP group's gathered pairs.
    # HybridEP permutes and unpermutes (summing each token's experts) inside its own dispatch and
    # combine (`sim.ep_dispatch.hybridep_permute_s`): here only SwiGLU (and ETP's sort) remain
    hybridep = flex is not None and flex.backend == HYBRIDEP
    moved = (0.0 if hybridep else busiest * 4 * hidden) + computed * (
        (0.0 if hybridep and etp == 1 else 2 * hidden) + 1.5 * width)
    n_pairs = max(1, round(computed))
    passes = elementwise_kernel(f"{name} permute", n_pairs, 1, moved * two / n_pairs, dtype)
    fwd_s = sum(rate.kernel_seconds(k) for k in fwd_k)
    bwd_s = sum(rate.kernel_seconds(k) for k in bwd_k)
    ew = rate.kernel_seconds(passes)
    # selective-op saves no grouped GEMM's output (not `aten.mm`) nor any permutation or SwiGLU
    # output: the experts' GEMMs and passes run again, not the dispatch and combine, whose outputs it
    # saves (`canzona.recompute`). Full recompute runs the whole forward block again: the caller's
    # (`micro_batch_work`)
    redo = fwd_s + ew if recompute == SELECTIVE_OP else 0.0
    sent = pairs * hidden * two * (ep - 1) / ep
    received = busiest * hidden * two * (ep - 1) / ep
    gathered = computed * hidden * two if etp > 1 else 0.0
    # Megatron's alltoall dispatcher: the counts' all-gather, the host sync and each pair's routing
    # probability sent beside its token (sim.ep_dispatch.AlltoallMetadata)
    meta = None
    if ep > 1 and flex is None:
        meta = AlltoallMetadata(experts=count, probs_sent=pairs * PROBS_BYTES * (ep - 1) / ep,
                                probs_received=busiest * PROBS_BYTES * (ep - 1) / ep, forward=True)
    return (Block(name, 0.0, fwd_s + ew, 0.0, tp_collectives=False, ep_bytes=sent, ep_received=received,
                  etp_bytes=gathered, ep_flex=flex, ep_meta=meta),
            Block(name, 0.0, bwd_s + redo + 2 * ew, 0.0, tp_collectives=False, ep_bytes=sent,
                  ep_received=received, etp_bytes=gathered,
                  ep_flex=None if flex is None else replace(flex, forward=False), wgrad_s=wgrad_s,
                  ep_meta=None if meta is None else replace(meta, forward=False)))


def _fp8_block(fp8: FP8Setup, column: Sequence[ParamSpec], row: Sequence[ParamSpec], tokens: int, tp: int,
               rate: DeviceRate) -> tuple[float, float]:
    """Seconds of Transformer Engine's FP8 casts around one block's GEMMs (forward, backward), on
    one TP rank of a micro-batch of `tokens` (`sim.fp8`). Forward: the column GEMMs' shared input,
    cast on the rank's sequence-parallel share of the tokens before its all-gather (as TE
    quantizes before gathering; the simulated all-gather still moves bf16, `activation_bytes`:
    conservative), the row GEMM's input (all tokens, the rank's columns), every weight once per
    iteration; backward: the row GEMM's output gradient (on the rank's share, before the gather),
    the column GEMMs' output gradients (all tokens, the rank's rows). Current scaling all-reduces
    the amax of each gathered tensor over TP first."""
    share = tokens / tp
    fwd: list[Kernel] = []
    bwd: list[Kernel] = []
    gathered = 0
    if column:
        fwd.append(fp8.cast(f"{column[0].name}.input", share, column[0].local_shape(tp)[1]))
        bwd.append(fp8.cast(f"{column[0].name}.grad", tokens, sum(p.local_shape(tp)[0] for p in column)))
        gathered += 1
    for p in row:
        out, inp = p.local_shape(tp)
        fwd.append(fp8.cast(f"{p.name}.input", tokens, inp))
        bwd.append(fp8.cast(f"{p.name}.grad", share, out))
    fwd += [fp8.weight_cast(p.name, p.local_numel(tp)) for p in (*column, *row)]
    tp_amax = fp8.tp_amax_s if fp8.recipe == CURRENT and tp > 1 else 0.0
    return (sum(rate.kernel_seconds(k) for k in fwd) + gathered * tp_amax,
            sum(rate.kernel_seconds(k) for k in bwd) + len(row) * tp_amax)
