"""Megatron's expert-parallel communication overlap: `overlap_moe_expert_parallel_comm` (docs/design.md §9.3).

Megatron-Core's "EP A2A overlap" (`--overlap-moe-expert-parallel-comm`, Megatron-Bridge's
`CommOverlapConfig.overlap_moe_expert_parallel_comm`, formerly `moe_a2a_overlap`; off by default)
replaces the 1F1B schedule with the *combined* 1F1B schedule
(megatron/core/pipeline_parallel/combined_1f1b.py; its steps: `canzona.pipeline.combined_order`).
With PP 1 (`combined_1f1b_schedule_for_no_pipelining`) micro-batch 0's forward runs alone, then
each step runs micro-batch i's forward beside micro-batch i - 1's backward, and the last backward
runs alone. With PP > 1 it runs inside the interleaved schedule (schedules.py
`forward_backward_pipelining_with_interleaving`, whose `forward_backward_helper_wrapper` calls
`combined_1f1b_schedule_for_interleaved_pipelining`): the warm-up forwards one more than the
interleaved schedule's, each alone, then each steady step a forward micro-batch-chunk beside a
backward one, then the cool-down backwards alone. Inside a step
(megatron/core/models/common/model_chunk_schedule_plan.py, `TransformerModelChunkSchedulePlan.run`)
the forward's receive and embedding run, then the backward's receive and head (loss gradient), then
forward layer i of its chunk is paired with backward layer n - 1 - i of the backward's chunk (for
min(n_f, n_b) layers; the backward's remaining layers, then the forward's, run alone), then the
sends (the forward's activations, the backward's gradient), then the forward's head and the
backward's embedding gradient; the next step starts once both passes are done.
Each layer is split into nodes (`TransformerLayerSchedulePlan`): `attn` (attention, the MLP's norm,
the router and the dispatch preprocessing) and `mlp` (the experts) on the compute stream,
`moe_dispatch` and `moe_combine` (the all-to-alls) on a second, communication stream. A pair runs
them in this order (`TransformerLayerSchedulePlan.run`):

    comm stream:    combine_bwd | dispatch_fwd -> dispatch_bwd   | combine_fwd
    compute stream: attn_fwd    | mlp_bwd (-> mlp_bwd_dw) -> mlp_fwd | attn_bwd

so the forward's dispatch runs under the backward's experts, its combine under the backward's
attention, the backward's combine under the forward's attention and its dispatch under the forward's
experts. Each stream runs its work in the order it was enqueued, and each node waits for the one
before it in its own pass (one CUDA event per micro-batch's schedule plan,
megatron/core/pipeline_parallel/utils.py `stream_acquire_context`): the two passes only meet on the
two streams. `delay_wgrad_compute` (Megatron's option, `RunOptions.delay_wgrad_compute`, off by
default; Megatron-Bridge's performance scripts turn it on with the overlap, `_set_moe_a2a_overlap_
overrides`): off, the experts' weight gradients are computed inside `mlp_bwd`, before the backward's
dispatch; on, `mlp_bwd` computes the data gradients, the dispatch gradient waits for them only, and
`mlp_bwd_dw` (the experts' weight-gradient GEMMs, `Block.wgrad_s`) runs on the compute stream under
it; a backward layer run alone keeps that order (`_backward_alone`, and a step's backward layers
left past its forward's under unequal chunks). Megatron passes the option to every Transformer
Engine linear module (megatron/core/extensions/transformer_engine.py), whose backward puts its
weight-gradient GEMM in its `wgrad_store` and goes on with the data gradients; the layer's nodes
run the stored GEMMs in their `backward_dw` (megatron/core/models/gpt/fine_grained_callables.py:
`attn` the self-attention's `backward_dw`, linear_qkv's then linear_proj's; `mlp` the MLP's or
the experts'). So `attn_bwd` computes the attention's data gradients only, with TE's order around
them: without userbuffers the column module's data-gradient reduce-scatter, which otherwise runs
beside its weight-gradient GEMM (`sim.iteration._Stage.nccl_block`), has nothing beside it on the
compute stream and the norm's backward waits for it (`_data_gradients`); `attn_bwd_dw` runs the
row and column modules' weight-gradient GEMMs (`Block.first_wgrad_s`, `Block.last_wgrad_s`) at
the end of the pair, on the compute stream after the node's event is recorded, so the next
layer's combine gradient leaves under them; the backward chunk's first layer's run after the
step's sends (which leave beside them) and before the forward's head and the backward's embedding
gradient (`TransformerModelChunkSchedulePlan.run`, "Delay the last attn_dw in backward pass ...
for overlapping with the p2p comm"; `_first_layer_weights`); a dense layer's `mlp` node runs its
MLP's after its data gradients. The gradient reductions a layer completes wait for its delayed
GEMMs (TE calls the gradient hooks in `backward_dw`). With userbuffers (tp_comm_overlap at TP >
1) TE refuses a delayed weight gradient (NotImplementedError, `USERBUFFERS_REFUSE`): such a run
does not start, and the simulator refuses it (`check_delay_wgrad`). Under the option the
sequence-parallel blocks' weight-gradient GEMMs take the same seconds, in another place.

The simulator runs the same nodes with its own blocks (`sim.model_work`): a layer's blocks before
its expert block are `attn` (with their TP collectives where TP > 1), the expert block's grouped
GEMMs and passes are `mlp`, its dispatch and combine all-to-alls (under expert TP with the ETP
group's all-gather after the dispatch and reduce-scatter before the combine, as Megatron's
dispatcher runs them inside `token_dispatch` / `token_combine`) are issued on the EP stream
(`sim.streams.EP_COMM`), which stands for Megatron's communication stream. The all-to-alls keep
their price and the SMs their kernels hold (`sim.comm_sms`), which slow the compute beside them
(`sim.engine`). A layer without experts has no dispatch or combine (Megatron's NoopScheduleNode):
its last block is `mlp`.

What Megatron requires (TransformerConfig.__post_init__, megatron/core/transformer/
transformer_config.py; `check_ep_overlap` raises each as an `error:` line): expert parallelism
(EP > 1); PP 1, or PP > 1 with a virtual pipeline (`virtual_pipeline_model_parallel_size` set:
the interleaved combined schedule above); no full activation recompute (granularity, method and
layer count unset) and no recompute of the MoE module (the simulator's `selective-op` recomputes
the experts); a bf16 / fp16 model (every simulated run is; FP8 runs are bf16 models with FP8 GEMMs);
the alltoall or flex token dispatcher (each priced as `sim.ep_dispatch` prices it); no shared-expert
overlap (not modelled). Megatron-FSDP runs it too; the simulator's FSDP path does not (refused).
The two streams must really run concurrently: CUDA_DEVICE_MAX_CONNECTIONS > 1 (Megatron otherwise
asks for 1 under TP / CP to order its kernels; NVIDIA's recipe sets 32) — an environment setting,
**assumed** here (the simulator's streams are independent).

Memory: the simulator keeps its activation model (`canzona.memory`). PP 1: at pair k the forward
holds k + 1 layers of its micro-batch and the backward L - k of the other's (its layer L - 1 - k
freed at the pair's end), one micro-batch's layers and one in all. PP > 1: the one more warm-up
forward holds one chunk more before the first step, and each step then frees the backward chunk's
layers as it fills the forward chunk's: the plain interleaved schedule's peak (its warm-up plus one
chunk, `canzona.pipeline.peak_in_flight`) and the one layer a pair's forward makes before the
backward's layer is freed (an **assumption** either way, that layer not counted: Megatron's node
boundaries also detach and hold a few more transient tensors). Not counted: under
delay_wgrad_compute, the inputs TE keeps for a delayed weight gradient until it runs (a layer's
gathered input and output gradient, freed at the pair's end).

canzona's runtime does not run this schedule: its `DistributedOptimizer` does not own the model's
forward / backward, and the token dispatch is the model's (reference/tiny_moe_ep.py dispatches
and combines synchronously); the option is the simulator's, describing Megatron's schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import simpy

from canzona.errors import SpecError
from canzona.pipeline import Slot, combined_order
from canzona.recompute import FULL, SELECTIVE_OP
from sim.ep_dispatch import dispatcher_sms
from sim.streams import EP_COMM

if TYPE_CHECKING:  # the stage's program: sim.iteration imports this module, not the other way round
    from sim.iteration import _Stage
    from sim.model_work import Block

OPTION = "--overlap-moe-expert-parallel-comm"
# recompute modes Megatron refuses with the overlap: full (granularity "full") and the simulator's
# selective-op, which recomputes the experts (Megatron's recompute_modules "moe")
REFUSED_RECOMPUTE = (FULL, SELECTIVE_OP)


def check_ep_overlap(*, ep: int, pp: int, vp: int, recompute: str, fsdp: bool, moe: bool = True) -> None:
    """Megatron's requirements of `overlap_moe_expert_parallel_comm`, and what the simulator
    models of it (the module docstring); a SpecError naming the first one not met."""
    if not moe:
        raise SpecError(f"{OPTION} overlaps the expert all-to-alls of a mixture-of-experts model; this model has "
                        "no experts")
    if ep <= 1:
        raise SpecError(f"{OPTION} needs expert parallelism (--ep > 1): Megatron's overlap_moe_expert_parallel_comm "
                        "is only supported with expert model parallelism")
    if pp > 1 and vp <= 1:
        raise SpecError(f"{OPTION} with --pp {pp} needs a virtual pipeline (--vp > 1): Megatron requires "
                        "virtual_pipeline_model_parallel_size when pipeline_model_parallel_size > 1")
    if recompute in REFUSED_RECOMPUTE:
        raise SpecError(f"{OPTION} does not run with --recompute {recompute}: Megatron refuses full recompute and "
                        "the recompute of the MoE module (selective-op recomputes the experts) with "
                        "overlap_moe_expert_parallel_comm")
    if fsdp:
        raise SpecError(f"{OPTION} is not modelled under --fsdp (the simulator runs it on the ZeRO-1 layout)")


# Transformer Engine's linear modules refuse a delayed weight gradient whose GEMM is a userbuffers
# one (TP communication overlap): `raise NotImplementedError("Delayed weight grad computation is not
# supported with Userbuffers (tensor-parallel communication overlapping)")` in their backward
# (transformer_engine/pytorch/module/linear.py and layernorm_linear.py at 3ec8787); Megatron's
# column-parallel modules run their weight-gradient GEMM with userbuffers' bulk overlap under
# tp_comm_overlap (tp_comm_bulk_wgrad, on by default) wherever TP > 1
USERBUFFERS_REFUSE = ("Transformer Engine refuses a delayed weight gradient beside userbuffers' TP communication "
                      "overlap (NotImplementedError: 'Delayed weight grad computation is not supported with "
                      "Userbuffers')")


def delay_wgrad_runs(*, tp: int, tp_comm_overlap: bool) -> bool:
    """Whether Transformer Engine runs delay_wgrad_compute on this layout: not beside userbuffers
    (`USERBUFFERS_REFUSE`), which TP communication overlap uses at TP > 1."""
    return tp == 1 or not tp_comm_overlap


def check_delay_wgrad(*, tp: int, tp_comm_overlap: bool, delay_wgrad_compute: bool) -> None:
    """`--delay-wgrad-compute` on a layout Transformer Engine refuses it on: one SpecError."""
    if delay_wgrad_compute and not delay_wgrad_runs(tp=tp, tp_comm_overlap=tp_comm_overlap):
        raise SpecError(f"--delay-wgrad-compute with --tp {tp} needs --no-tp-comm-overlap: {USERBUFFERS_REFUSE}")


def allowed(*, ep: int, pp: int, vp: int, recompute: str, fsdp: bool, moe: bool = True) -> bool:
    """Whether `check_ep_overlap` accepts this layout (the search turns the option on only there)."""
    try:
        check_ep_overlap(ep=ep, pp=pp, vp=vp, recompute=recompute, fsdp=fsdp, moe=moe)
    except SpecError:
        return False
    return True


def _split(blocks: Sequence[Block]) -> tuple[tuple[Block, ...], Block | None, tuple[Block, ...]]:
    """A layer's blocks in one pass's order as Megatron's nodes: those before the expert block
    (`attn` in forward; in backward the ones after it are `attn`), the expert block, those after
    it. A layer without experts: its last block (forward; first in backward) stands for `mlp`."""
    for i, b in enumerate(blocks):
        if b.ep_bytes:
            assert b.recompute is None  # full recompute is refused with the overlap (check_ep_overlap)
            return tuple(blocks[:i]), b, tuple(blocks[i + 1:])
    return (), None, tuple(blocks)


class _Pass:
    """One micro-batch's pass through the stage in the combined schedule: its own chain of
    dependencies (`last`, per rank), swapped into the stage while its nodes are issued."""

    def __init__(self, stage: _Stage) -> None:
        self.stage = stage
        self.last = dict(stage.last)
        # delay_wgrad_compute: when the weight-gradient GEMMs the pass deferred and has issued are
        # done (outside `last`: Megatron records a node's event before its `backward_dw`), and the
        # chunk's first layer's attention ones, which Megatron runs after the step's sends
        self.weights: list[dict[int, simpy.Event]] = []
        self.pending: tuple[tuple[str, float], ...] = ()

    def __enter__(self) -> _Stage:
        self._saved = self.stage.last
        self.stage.last = self.last
        return self.stage

    def __exit__(self, *exc: object) -> None:
        self.last = self.stage.last
        self.stage.last = self._saved


def _expert_comm(stage: _Stage, name: str, b: Block, into_experts: bool) -> None:
    """An expert block's all-to-all on the EP stream after what the pass has done: into the
    experts (the forward's dispatch, the backward's combine gradient) with expert TP's all-gather
    after it, or out of them (the forward's combine, the backward's dispatch gradient) with the
    reduce-scatter before it; all on the EP stream, Megatron's communication stream."""
    # into the experts moves tokens as a dispatch does (the backward's combine gradient too), out of
    # them as a combine (`sim.ep_dispatch.ep_costs`: the flex dispatcher prices the two apart)
    dispatch, combine = stage._ep_cost(b)
    cost = dispatch if into_experts else combine
    if not into_experts and b.etp_bytes:
        stage.last.update(stage.collective(f"{name} etp reduce-scatter", stage.etp_groups,
                                           stage._etp_cost("reduce-scatter", b.etp_bytes), EP_COMM))
    label = "dispatch" if into_experts else "combine"
    stage.last.update(stage.collective(f"{name} {label}", stage.ep_groups, cost, EP_COMM,
                                       sms=dispatcher_sms(b.ep_flex)))
    if into_experts and b.etp_bytes:
        stage.last.update(stage.collective(f"{name} etp all-gather", stage.etp_groups,
                                           stage._etp_cost("all-gather", b.etp_bytes), EP_COMM))


def _blocks(stage: _Stage, prefix: str, blocks: Sequence[Block], gathers: int) -> None:
    for b in blocks:
        stage.block(f"{prefix} {b.name}", b, gathers)


def _data_gradients(stage: _Stage, blocks: Sequence[Block]) -> tuple[tuple[Block, ...], tuple[tuple[str, float], ...]]:
    """A backward node's sequence-parallel blocks under delay_wgrad_compute: Megatron passes the
    option to every Transformer Engine linear module, whose backward puts its weight-gradient GEMM
    in its `wgrad_store` (the row-parallel one's `Block.first_wgrad_s`, the column-parallel one's
    `Block.last_wgrad_s`) and goes on: the blocks without those GEMMs, so that the column module's
    data-gradient reduce-scatter has no GEMM beside it and the norm's backward waits for it, and
    (block name, seconds) of the GEMMs, which Megatron runs in the node's `backward_dw`. Under
    userbuffers (tp_comm_overlap at TP > 1) Transformer Engine refuses a delayed weight gradient
    (`check_delay_wgrad`: no such run is simulated). Off: as given."""
    if not stage.ctx.options.delay_wgrad_compute:
        return tuple(blocks), ()
    data: list[Block] = []
    deferred: list[tuple[str, float]] = []
    for b in blocks:
        data.append(replace(b, first_s=b.first_s - b.first_wgrad_s, last_s=b.last_s - b.last_wgrad_s,
                            first_wgrad_s=0.0, last_wgrad_s=0.0))
        if b.first_wgrad_s + b.last_wgrad_s:
            deferred.append((b.name, b.first_wgrad_s + b.last_wgrad_s))
    return tuple(data), tuple(deferred)


def _weight_gradients(p: _Pass, prefix: str, deferred: Sequence[tuple[str, float]]) -> None:
    """A node's `backward_dw`: the deferred weight-gradient GEMMs on the compute stream after what
    the pass has issued. The pass's chain stays at its data gradients (its node's event was
    recorded before them): the next node on the communication stream does not wait for them, the
    next one on the compute stream does (the stream runs its kernels in order)."""
    if not deferred:
        return
    with p as st:
        data = dict(st.last)
        for name, seconds in deferred:
            st.compute(f"{prefix} {name} delayed wgrad", seconds)
        p.weights.append(dict(st.last))
        st.last.update(data)


def _grads_done(p: _Pass) -> dict[int, simpy.Event]:
    """When the pass's chain and every weight-gradient GEMM it deferred are done (`_Pass.weights`)."""
    env = p.stage.eng.env
    return {r: env.all_of([p.last[r]] + [w[r] for w in p.weights]) for r in p.last}


def _layer_done(stage: _Stage, p: _Pass, mb: int, kb: int, micro_batches: int, syncs: list[simpy.Event]) -> None:
    """What backward layer `kb` completes starts (`_Stage.backward_layer_done`: the last
    micro-batch's gradient reductions), after its deferred weight gradients too."""
    if not p.weights:
        with p:
            stage.backward_layer_done(mb, kb, micro_batches, syncs)
        return
    done = _grads_done(p)
    with p as st:
        data = dict(st.last)
        st.last.update(done)
        st.backward_layer_done(mb, kb, micro_batches, syncs)
        st.last.update(data)


def _first_layer_weights(stage: _Stage, p: _Pass, mb: int, kb: int, micro_batches: int,
                         syncs: list[simpy.Event]) -> None:
    """The backward chunk's first layer (the last its backward reaches): Megatron runs its
    attention's `backward_dw` after the step's sends and before the head's forward and the
    embedding's gradient (`TransformerModelChunkSchedulePlan.run`, "Delay the last attn_dw ...
    for overlapping with the p2p comm"). Issued before the sends here: they wait for the pass's
    chain, not for these GEMMs, and the compute stream runs them before the head and the embedding."""
    _weight_gradients(p, f"mb{mb} bwd", p.pending)
    p.pending = ()
    _layer_done(stage, p, mb, kb, micro_batches, syncs)


def _layer_pair(stage: _Stage, f: _Pass | None, kf: int | None, b: _Pass, kb: int,
                needed: dict[int, list[simpy.Event]], fmb: int | None, bmb: int, first: bool = False) -> None:
    """Forward layer `kf` of pass `f` beside backward layer `kb` of pass `b`, issued in
    Megatron's order (the module docstring); `f` None: the backward layer alone (under
    delay_wgrad_compute, whose order differs from `_Stage.backward_layer`'s). `first`: `kb` is
    the backward chunk's first layer, whose attention weight gradients (delay_wgrad_compute) are
    left in `b.pending` for after the step's sends (`_first_layer_weights`)."""
    work = stage.ctx.work
    b_before, b_exp, b_attn = _split(work.backward[kb])  # backward order: the expert block, then attention
    b_mlp: tuple[Block, ...] = ()  # a dense layer's `mlp` node: its first block in backward
    if b_exp is None:
        b_mlp, b_attn = b_attn[:1], b_attn[1:]
    # delay_wgrad_compute: the attention's (and a dense MLP's) TE modules defer their weight gradients
    b_mlp, mlp_dw = _data_gradients(stage, b_mlp)
    b_attn, attn_dw = _data_gradients(stage, b_attn)
    f_attn: tuple[Block, ...] = ()
    f_exp: Block | None = None
    f_rest: tuple[Block, ...] = ()  # after the experts: a dense layer's `mlp` node, its last block
    if f is not None and kf is not None:
        f_attn, f_exp, f_rest = _split(work.forward[kf])
        if f_exp is None:
            f_attn, f_rest = f_rest[:-1], f_rest[-1:]
    fp, bp = f"mb{fmb} fwd", f"mb{bmb} bwd"
    # delay_wgrad_compute: the experts' weight gradients after the dispatch gradient is issued
    delayed = b_exp.wgrad_s if b_exp is not None and stage.ctx.options.delay_wgrad_compute else 0.0
    with b as st:  # combine_bwd: the output gradient into the experts
        _blocks(st, bp, b_before, 2)
        if b_exp is not None:
            _expert_comm(st, f"{bp} {b_exp.name}", b_exp, into_experts=True)
    if f is not None:
        with f as st:  # attn_fwd
            st.forward_layer_gathers(fmb, kf, needed)
            _blocks(st, fp, f_attn, 1)
    with b as st:  # mlp_bwd (with the weight gradients unless delayed)
        if b_exp is not None:
            st.compute(f"{bp} {b_exp.name}", b_exp.seconds - delayed)
        _blocks(st, bp, b_mlp, 2)
    if f is not None:
        with f as st:  # dispatch_fwd
            if f_exp is not None:
                _expert_comm(st, f"{fp} {f_exp.name}", f_exp, into_experts=True)
    _weight_gradients(b, bp, mlp_dw)  # a dense layer's mlp_bwd_dw (its dispatch gradient: none)
    with b as st:  # mlp_bwd_dw (delayed), then dispatch_bwd: the input gradients back to their tokens' ranks
        if b_exp is not None and delayed:  # the dispatch gradient waits for the data gradients only
            data = dict(st.last)
            st.compute(f"{bp} {b_exp.name} wgrad", delayed)
            weights = dict(st.last)
            st.last.update(data)
            _expert_comm(st, f"{bp} {b_exp.name}", b_exp, into_experts=False)
            for r in st.ranks:
                st.last[r] = st.eng.env.all_of([st.last[r], weights[r]])
        elif b_exp is not None:
            _expert_comm(st, f"{bp} {b_exp.name}", b_exp, into_experts=False)
    if f is not None:
        with f as st:  # mlp_fwd, then combine_fwd
            if f_exp is not None:
                st.compute(f"{fp} {f_exp.name}", f_exp.seconds)
                _expert_comm(st, f"{fp} {f_exp.name}", f_exp, into_experts=False)
            _blocks(st, fp, f_rest, 1)
    with b as st:  # attn_bwd
        _blocks(st, bp, b_attn, 2)
    if first:  # the chunk's first layer: after the step's sends
        b.pending = attn_dw
    else:  # attn_bwd_dw at the end of the pair
        _weight_gradients(b, bp, attn_dw)


def _delayed_backward_layer(stage: _Stage, b: _Pass, mb: int, kb: int, micro_batches: int,
                            syncs: list[simpy.Event], first: bool) -> None:
    """Backward layer `kb` of micro-batch `mb` with no forward beside it, under
    delay_wgrad_compute: `_layer_pair`'s order without a forward, then what its completion starts
    (for the chunk's `first` layer, once its attention's weight gradients have run:
    `_first_layer_weights`)."""
    _layer_pair(stage, None, None, b, kb, {}, None, mb, first=first)
    if not first:
        _layer_done(stage, b, mb, kb, micro_batches, syncs)


def _backward_alone(stage: _Stage, mb: int, c: int, micro_batches: int, syncs: list[simpy.Event]) -> None:
    """A backward chunk run alone under delay_wgrad_compute: each layer as `_layer_pair` orders
    it without a forward (Megatron's `TransformerLayerSchedulePlan.run` with no forward layer),
    the first layer's attention weight gradients after the send."""
    b = _Pass(stage)
    with b:
        stage.backward_start(mb, c)
    backward = stage.chunk_list[c][::-1]
    for kb in backward:
        _delayed_backward_layer(stage, b, mb, kb, micro_batches, syncs, first=kb == backward[-1])
    if backward:
        _first_layer_weights(stage, b, mb, backward[-1], micro_batches, syncs)
    grads = _grads_done(b) if b.weights else None
    with b:
        stage.backward_end(mb, c, grads)
    stage.last.update(_grads_done(b) if b.weights else b.last)


def _step(stage: _Stage, fwd: Slot, bwd: Slot, needed: dict[int, list[simpy.Event]], micro_batches: int,
          syncs: list[simpy.Event]) -> None:
    """One step of the combined schedule: forward micro-batch-chunk `fwd` beside backward `bwd`
    (Megatron's `TransformerModelChunkSchedulePlan.run`, the module docstring)."""
    (_, fmb, fc), (_, bmb, bc) = fwd, bwd
    f, b = _Pass(stage), _Pass(stage)
    delay = stage.ctx.options.delay_wgrad_compute
    with f:  # the forward's input (its receive), its embedding
        stage.forward_start(fmb, fc)
    with b:  # the backward's output gradient (its receive), its head's backward
        stage.backward_start(bmb, bc)
    for r in stage.ranks:  # both receives are waited for on the compute stream before the layers
        f.last[r] = b.last[r] = stage.eng.env.all_of([f.last[r], b.last[r]])
    forward, backward = stage.chunk_list[fc], stage.chunk_list[bc][::-1]
    paired = min(len(forward), len(backward))
    for kf, kb in zip(forward[:paired], backward[:paired]):
        first = delay and kb == backward[-1]
        _layer_pair(stage, f, kf, b, kb, needed, fmb, bmb, first=first)
        if not first:
            _layer_done(stage, b, bmb, kb, micro_batches, syncs)
    # chunks of unequal sizes: the backward's layers left, then the forward's. Megatron runs each
    # left backward layer as a pair without a forward (`TransformerLayerSchedulePlan.run(None,
    # b_layer)`), so under delay_wgrad_compute in the delayed order, as `_backward_alone`
    for kb in backward[paired:]:
        if delay:
            _delayed_backward_layer(stage, b, bmb, kb, micro_batches, syncs, first=kb == backward[-1])
        else:
            with b:
                stage.backward_layer(bmb, kb, micro_batches, syncs)
    with f:
        for kf in forward[paired:]:
            stage.forward_layer(fmb, kf, needed)
    if delay and backward:  # the first layer's attention weight gradients: after the sends (on their streams)
        _first_layer_weights(stage, b, bmb, backward[-1], micro_batches, syncs)
    # the exchanges as `TransformerModelChunkSchedulePlan.run` makes them: the forward's
    # (post_forward: its send, the next forward's receive), then the backward's (post_backward),
    # then the head's forward and the embedding's gradient. So the last stage posts its next
    # forward's receive before it sends its backward's gradient to the same peer: on the pair's
    # one stream (`sim.pipeline_p2p.p2p_stream`) that peer sends its forward first, too
    grads = _grads_done(b) if b.weights else None  # the reductions the schedule launches wait for them
    with f:  # post_forward on the communication stream: its kernels behind the all-to-alls, its send wait holding them
        stage.forward_end(fmb, fc, post_first=True, on=EP_COMM)
    with b:
        stage.backward_end(bmb, bc, grads, post_first=True)
    done = _grads_done(b) if b.weights else b.last  # the next step's nodes wait on the compute stream
    for r in stage.ranks:  # the next step starts once both passes are issued and done
        stage.last[r] = stage.eng.env.all_of([f.last[r], done[r]])


def run_combined(stage: _Stage, micro_batches: int, needed: dict[int, list[simpy.Event]],
                 syncs: list[simpy.Event]) -> None:
    """Phase A of a stage under the combined 1F1B schedule (`canzona.pipeline.combined_order`):
    a forward or a backward alone as the plain schedule runs it, or a step of the two together."""
    pp = len(stage.all_ranks)
    for fwd, bwd in combined_order(stage.stage, pp, micro_batches, stage.vp):
        if bwd is None:
            stage.forward_pass(fwd[1], fwd[2], needed)
        elif fwd is None and stage.ctx.options.delay_wgrad_compute:
            _backward_alone(stage, bwd[1], bwd[2], micro_batches, syncs)
        elif fwd is None:
            stage.backward_pass(bwd[1], bwd[2], micro_batches, syncs)
        else:
            _step(stage, fwd, bwd, needed, micro_batches, syncs)
