"""One training iteration as SimPy programs: forward / backward with gradient sync (phase A), then
the optimizer step of a step policy (docs/design.md §7) (phase B).

Phase A is identical on every rank of a pipeline stage: micro-batches, layers, TP collectives and
the DP gradient collectives (which finish at the same moment for all members) do not depend on the
rank. It is simulated once per stage, on the stage's first rank (rank 0 without pipeline
parallelism), with each collective priced for its real group. Phase B differs between
ranks (who owns which matrix, which TP rank hosts it): it is simulated once per class of ranks whose
steps are the same (`sim.classes`), every rank when asked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import simpy

from canzona.batching import compute_windows, shape_batches
from canzona.cost import (
    FP32_STEP,
    DeviceRate,
    StepDtypes,
    adamw_kernels,
    elementwise_kernel,
    gradient_norm_kernels,
)
from canzona.decoder import Architecture
from canzona.hardware import HardwareProfile
from canzona.memory import MemorySetup
from canzona.optimizers import default_config, matrix_optimizer
from canzona.pipeline import EVEN_SPLIT, PipelineSplit, Slot, chunk_layers, pipeline_order
from canzona.plan import Plan
from canzona.spec import DTYPE_BYTES, ModelSpec
from canzona.step_collectives import (
    ALL_GATHER_V,
    BACKWARD,
    CHECK,
    DATA_GROUPS,
    DP_ALL_TO_ALL,
    DP_GROUP,
    EDP_GROUP,
    PARAMS,
    REDUCE_SCATTER_V,
    STEP,
    Experts,
    StepCollective,
    backward_layers,
    step_collectives,
)
from canzona.step_policies import StepPolicy
from canzona.step_schedule import (
    ALL_TO_ALL,
    APPLY,
    COMPUTE,
    GATHER,
    SCATTER,
    TP_GROUP,
    Exchange,
    GroupStep,
    ScheduleKeys,
    Task,
    TPSchedule,
    tp_schedule,
)
from sim.classes import StepClasses
from sim.collectives import (
    CollectiveCost,
    all_gather_v_cost,
    all_to_all_cost,
    collective_cost,
    matrix_all_to_all_cost,
    reduce_scatter_v_cost,
)
from sim.comm_sms import TPOverlapSMs
from sim.engine import Collective, Engine
from sim.ep_dispatch import dispatcher_sms, ep_costs
from sim.ep_overlap import run_combined
from sim.fp8 import FP8
from sim.model_work import MicroBatchWork
from sim.options import RunOptions
from sim.param_sync import aligned as aligned_param_sync
from sim.param_sync import chunk_issued_before
from sim.pipeline_p2p import Posting, p2p_cost, p2p_stream, posting
from sim.streams import CP_COMM, DP_COMM, EP_COMM, ETP_COMM, TP_COMM
from sim.topology import Cluster
from sim.userbuffers import block_overlaps
from sim.workload import Workload

APPLY_PASSES = 3  # applying an update chunk reads the shard and the chunk and writes the shard


class DtypeSavings:
    """Seconds a run's step dtypes (`MemorySetup.step_dtypes`: bf16 without masters) take off one
    matrix's fp32-priced plan seconds (`DeviceRate.dtype_saving`), by shape, each priced once: the
    ZeRO-1 TP schedule (`Context.dtype_saving`) and the FSDP owners (`sim.fsdp`) ask for the same
    few shapes thousands of times. Nothing to take off beside masters (`saves` False)."""

    def __init__(self, rate: DeviceRate, optimizer: str, dtypes: StepDtypes, matrix_config: object | None) -> None:
        self.rate, self.optimizer, self.dtypes, self.matrix_config = rate, optimizer, dtypes, matrix_config
        self.saves = dtypes != FP32_STEP
        self._by_shape: dict[tuple[int, ...], float] = {}

    def __call__(self, shape: Sequence[int]) -> float:
        key = tuple(shape)
        if key not in self._by_shape:
            self._by_shape[key] = self.rate.dtype_saving(self.optimizer, key, self.dtypes, self.matrix_config)
        return self._by_shape[key]


@dataclass
class Context:
    engine: Engine
    cluster: Cluster
    hw: HardwareProfile
    rate: DeviceRate
    cfg: Architecture  # the model's sizes (canzona.models.resolve_model)
    spec: ModelSpec
    workload: Workload
    plan: Plan
    policy: StepPolicy
    work: MicroBatchWork
    tp_mode: str = "pipelined"
    options: RunOptions = RunOptions()
    stage: int = 0  # pipeline stage: `spec`, `plan` and `work` are this stage's
    # expert parallelism (canzona.experts): the expert part's context, whose cluster is the same
    # GPUs in expert order (ETP groups as its TP groups, EP groups between them, EDP groups as its
    # DP groups) and whose plan owns one EP rank's expert matrices over EDP x ETP; `spec` and
    # `plan` above are the dense part
    experts: Context | None = None
    tp_stream: str = TP_COMM  # the stream of the step's TP exchanges (the expert part's: ETP_COMM)
    # the matrix optimizer's configuration (SimConfig.matrix_config; None: its defaults), which the
    # plan's seconds are priced at: the batched kernels' saving is priced at it too
    matrix_config: object | None = None

    def expert_records(self, *phases: str) -> list[StepCollective]:
        """The expert part's collectives of these phases over EDP (`step_collectives` of the whole
        step: its buckets', and in runtime mode its AdamW buffer's and its step check); priced
        and issued on the expert part's context (`experts`)."""
        return [r for r in self.records if r.phase in phases and r.group == EDP_GROUP]

    @property
    def runtime_mode(self) -> bool:
        """Issue exactly the runtime's collectives (`canzona.step_collectives`)."""
        return self.options.collectives == "runtime"

    @cached_property
    def records(self) -> list[StepCollective]:
        """The collectives of one step of DP rank 0, TP rank 0 (and EDP rank 0, ETP rank 0 under
        expert parallelism), as the runtime issues them (the DP and EDP ones are the same on every
        rank of their group; TP exchanges come from each group's own schedule)."""
        experts = Experts(self.experts.plan, self.experts.spec, policy=self.experts.policy) \
            if self.experts is not None else None
        return step_collectives(self.plan, self.spec, self.policy, 0, 0, tp_mode=self.tp_mode,
                                grad_bytes=self.workload.grad_bytes, param_bytes=self.workload.param_bytes,
                                master_weights=self.workload.master_weights, overlap_step=self.options.overlap_step, experts=experts,
                                clipped=self.options.explicit_clip, style=self.options.collectives)

    def dp_records(self, *phases: str) -> list[StepCollective]:
        """The dense part's collectives of these phases other than the TP schedule's exchanges."""
        return [r for r in self.records if r.phase in phases and (r.group == DP_GROUP or
                                                                    (r.group == TP_GROUP and r.phase != STEP))]

    @property
    def batching(self) -> bool:
        """`batch_kernels`, where the optimizer has a batched kernel (as the runtime's executor)."""
        return self.options.batch_kernels and matrix_optimizer(self.plan.optimizer).batchable

    @property
    def hidden(self) -> int:
        return self.cfg.hidden

    @property
    def tp(self) -> int:
        return self.cluster.tp

    def local_numel(self, name: str) -> int:
        return self.spec.param(name).local_numel(self.tp)

    def full_numel(self, name: str) -> int:
        return self.spec.param(name).numel

    def adamw_local_numel(self) -> int:
        return self._adamw_local_numel

    @cached_property
    def _adamw_local_numel(self) -> int:
        return sum(p.local_numel(self.tp) for p in self.spec.adamw_params())

    def dp_index(self, rank: int) -> int:
        """`rank`'s DP rank in its stage (ranks go TP fastest, then DP)."""
        return self.cluster.dp_index(rank)

    def elementwise_numel(self, i: int) -> int:
        """Under an elementwise optimizer, the matrices' elements DP rank `i` updates with AdamW:
        their pieces inside its segments (none otherwise)."""
        if not matrix_optimizer(self.plan.optimizer).elementwise:
            return 0
        return sum(self.plan.dp_plan.piece_lengths(i))

    def batch_saving(self, shape: tuple[int, ...], count: int) -> float:
        """Seconds one batched kernel over `count` matrices of `shape` saves over `count` calls
        (kept: a mixture-of-experts plan asks for the same few batches thousands of times)."""
        key = (shape, count)
        if key not in self._batch_savings:
            self._batch_savings[key] = self.rate.batch_saving(self.plan.optimizer, shape, count, self.matrix_config)
        return self._batch_savings[key]

    @cached_property
    def _batch_savings(self) -> dict[tuple[tuple[int, ...], int], float]:
        return {}

    def dtype_saving(self, tasks: Sequence[Task]) -> float:
        """Seconds the run's dtypes take off the plan's fp32-priced seconds of these matrices
        (`DtypeSavings`; 0.0 with masters)."""
        savings = self._dtype_savings
        if not savings.saves:
            return 0.0
        total = 0.0
        for t in tasks:
            total += savings(t.shape)
        return total

    @cached_property
    def _dtype_savings(self) -> DtypeSavings:
        return DtypeSavings(self.rate, self.plan.optimizer, self.memory.step_dtypes, self.matrix_config)

    @cached_property
    def memory(self) -> MemorySetup:
        """The workload's dtypes as the memory model reads them: with or without master weights, the
        bytes the step's passes move (`update_state_bytes`, `update_bytes`)."""
        return MemorySetup.dtypes_of(self.workload)

    def adamw_seconds(self, numel: int) -> float:
        return sum(self.rate.kernel_seconds(k) for k in adamw_kernels(numel, default_config("adamw"),
                                                                      self.memory.update_state_bytes))

    def step_schedule(self, i: int, overlap_step: bool) -> TPSchedule:
        """DP (EDP) rank `i`'s TP schedule of the step (a replicated policy's plan is made for one
        DP rank, sim.simulate: every group runs DP rank 0's), kept: the step's classes
        (`step_classes`) read every rank's, the simulated ranks again."""
        key = (0 if self.policy.replicated else i, overlap_step)
        if key not in self._schedules:
            self._schedules[key] = tp_schedule(self.plan, self.spec, self.policy, key[0], self.tp_mode,
                                               self.workload.grad_bytes, self.workload.grad_bytes,
                                               overlap_step=overlap_step)
        return self._schedules[key]

    @cached_property
    def _schedules(self) -> dict[tuple[int, bool], TPSchedule]:
        return {}

    @cached_property
    def norm_numels(self) -> list[int]:
        """Per DP (EDP) rank, the elements of its share of the gradient norm (`_gradient_norm`): its
        segment of every bucket (an even share where the policy does not reduce-scatter by the
        plan) and its slice of the AdamW buffer."""
        dp, buckets = self.cluster.dp, self.plan.dp_plan.buckets
        adamw = -(-self.adamw_local_numel() // dp)
        if self.policy.grad_sync == "reduce-scatter" and self.plan.dp == dp:
            lengths = [b.segment_lengths() for b in buckets]
            return [sum(seg[i] for seg in lengths) + adamw for i in range(dp)]
        return [sum(-(-b.size // dp) for b in buckets) + adamw] * dp

    def adamw_share(self, i: int) -> int:
        """Elements DP (EDP) rank `i` updates with AdamW: the vectors and embeddings (all of them
        under a replicated policy, else its slice), and under an elementwise optimizer its pieces
        of the matrices."""
        numel = self.adamw_local_numel()
        share = numel if self.policy.replicated else -(-numel // self.cluster.dp)
        return share + self.elementwise_numel(i)


# --- phase A ----------------------------------------------------------------------------------


def _bucket_first_layers(ctx: Context) -> list[int]:
    """Forward needs a bucket's parameters at the lowest layer it holds (backward completes its
    gradients there too, or lower: `canzona.step_collectives.backward_layers`)."""
    firsts = []
    for b in ctx.plan.dp_plan.buckets:
        layers = [ctx.spec.param(p.name).layer for p in b.params]
        firsts.append(min((x for x in layers if x is not None), default=0))
    return firsts


def param_gather_costs(ctx: Context) -> list[tuple[str, CollectiveCost]]:
    """The all-gather(-v)s of the updated parameters over one DP group: AdamW's, then each bucket's."""
    recs = ctx.dp_records(PARAMS)
    return [(r.name, record_cost(ctx, r)) for r in recs[-1:] + recs[:-1]]


def record_cost(ctx: Context, rec: StepCollective) -> CollectiveCost:
    """A collective priced on its group: -v ops as the runtime runs them on their segments, the
    Megatron style's even ones by their whole buffer, a DP all-to-all by what each member sends and
    receives (and how much of it crosses nodes), the others as even collectives of their bytes."""
    geo = ctx.cluster.dp_geometry() if rec.group in DATA_GROUPS else ctx.cluster.tp_geometry()
    if rec.op == REDUCE_SCATTER_V:
        return reduce_scatter_v_cost(rec.segments, geo, ctx.hw, ctx.options.reduce_scatter)
    if rec.op == ALL_GATHER_V:
        return all_gather_v_cost(rec.segments, geo, ctx.hw)
    if rec.total is not None:
        return collective_cost(rec.op, rec.total, geo, ctx.hw)
    if rec.op == DP_ALL_TO_ALL and rec.group in DATA_GROUPS and rec.sent:
        return _dp_all_to_all_cost(ctx, rec.sent)
    if rec.op == "all-gather":
        return collective_cost("all-gather", sum(rec.bytes_per_rank), geo, ctx.hw)
    return collective_cost("all-to-all", sum(rec.bytes_per_rank), geo, ctx.hw)


def _dp_all_to_all_cost(ctx: Context, sent: Sequence[Sequence[int]]) -> CollectiveCost:
    """`sent[s][d]` bytes from DP rank s to DP rank d, the part between nodes on the NICs."""
    cl = ctx.cluster
    nodes = [cl.node_of(cl.rank(i, 0)) for i in range(len(sent))]
    return matrix_all_to_all_cost(sent, nodes, cl.dp_geometry(), ctx.hw)


def issue_records(ctx: Context, records: Sequence[StepCollective], begin: dict[int, simpy.Event]) -> dict[int, simpy.Event]:
    """The collectives `records` one after another on every group of the stage (in runtime mode
    each recorded as the runtime logs it); per-rank events of the last one. `ctx`: the part whose
    groups they run on (the expert part's for EDP records). Each runs on the members `begin` holds
    (the simulated ones, `sim.classes`), priced for its whole group."""
    cl, eng = ctx.cluster, ctx.engine
    done = dict(begin)
    for rec in records:
        data = rec.group in DATA_GROUPS
        groups = cl.dp_groups(ctx.stage) if data else cl.tp_groups(ctx.stage)
        cost = record_cost(ctx, rec)
        stream = DP_COMM if data else ctx.tp_stream
        for group in groups:
            g = group if len(done) == cl.stage_gpus else [r for r in group if r in done]
            if not g:
                continue
            done.update(eng.collective(rec.name, g, cost, stream, {r: [done[r]] for r in g},
                                       record=rec.logged() if ctx.runtime_mode else None, members=len(group)))
    return done


def _groups(ranks: Sequence[int], groups: Sequence[Sequence[int]]) -> list[list[int]]:
    chosen = set(ranks)
    return [[r for r in g if r in chosen] for g in groups if any(r in chosen for r in g)]


@dataclass
class PhaseA:
    synced: simpy.Event  # every gradient of every stage synchronised
    stalls: list[float]  # forward waits for parameters still being gathered (stage 0's first rank)
    # per stage: each bucket's gradient sync done, and the stage's last backward kernel done (on the
    # stage's simulated rank, which stands for all): where an overlapped step may start
    bucket_synced: list[dict[int, simpy.Event]]
    backward_done: list[simpy.Event]



def cp_ring_cost(sent: float, cluster: Cluster, hw: HardwareProfile) -> CollectiveCost:
    """One step of a CP ring (`_Stage.core`): every rank sends `sent` bytes to the next CP rank and
    receives as many from the previous, priced on the ring's slowest hop (`Cluster.cp_geometry`)."""
    return all_to_all_cost([sent, sent], [sent, sent], cluster.cp_geometry(), hw)


def forward_backward(ctxs: Sequence[Context], all_ranks: bool = False, vp: int = 1,
                     split: PipelineSplit = EVEN_SPLIT) -> PhaseA:
    """Phase A: every pipeline stage runs its micro-batches in 1F1B order (`canzona.pipeline`;
    with `vp` > 1 model chunks per stage, Megatron's interleaved order), one virtual stage's
    activations reaching the next by point-to-point sends (under interleaving every chunk boundary
    crosses ranks, the last rank's chunk c sending to the first rank's chunk c + 1). Each stage is
    simulated on its first rank, which stands for the stage's ranks (see the module docstring),
    unless `all_ranks`; collectives are priced for their real groups either way. With overlapped
    parameter gathers (steady state), the previous step's all-gathers run under this forward,
    bucket by bucket in the order the forward needs them. `split`: how the layers are cut over
    the model chunks (`canzona.pipeline.PipelineSplit`; a chunk may hold none)."""
    eng, cl, wl = ctxs[0].engine, ctxs[0].cluster, ctxs[0].workload
    pp, m = len(ctxs), wl.micro_batches(cl.batch_dp)
    virtual = pp * vp  # virtual stage c * pp + s: chunk c of stage s
    ranks = [list(cl.stage_ranks(s)) if all_ranks else [cl.rank(0, 0, s)] for s in range(pp)]
    done = eng.env.event().succeed()
    # activation (gradient) of micro-batch i arrived at virtual stage v: set by the neighbour's send
    fwd_in = [[done if v == 0 else eng.env.event() for _ in range(m)] for v in range(virtual)]
    bwd_in = [[done if v == virtual - 1 else eng.env.event() for _ in range(m)] for v in range(virtual)]
    stalls: list[float] = []
    syncs: list[simpy.Event] = []
    transfers = _Transfers(eng)
    stages = [_Stage(ctx, s, ranks, fwd_in, bwd_in, stalls, vp, split, transfers) for s, ctx in enumerate(ctxs)]
    for stage in stages:
        syncs += stage.run(m)
    return PhaseA(eng.env.all_of(syncs), stalls,
                  [{k: eng.env.all_of(evs) for k, evs in st.bucket_synced.items()} for st in stages],
                  [eng.env.all_of([st.last[r] for r in st.ranks]) for st in stages])


@dataclass(frozen=True, eq=False)
class _Gather:
    """One parameter all-gather of the steady state's forward (the dense part's over DP, the
    expert part's over EDP, `_Stage.param_gathers`)."""

    name: str
    groups: list[list[int]]
    cost: CollectiveCost
    layer: int  # the layer whose first forward waits for it (the stage's first where it holds none)


class _Transfers:
    """Each pipeline transfer, by its receive (kind, virtual stage, micro-batch) and the position of
    the receiving rank in its stage: the rendezvous its sender's and its receiver's kernels join
    (`Engine.join`, each where its own program issues it), made by whichever of the two asks first
    (the stages' programs are issued a stage at a time, so a send may be issued before its
    receiver's program exists, and a receive posted before its sender's)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.transfers: dict[tuple[str, int, int, int], Collective] = {}

    def get(self, key: tuple[str, int, int], position: int, ranks: list[int], cost: CollectiveCost) -> Collective:
        """The transfer of `key` to the rank at `position`; `ranks`: its sender and receiver."""
        full = (*key, position)
        transfer = self.transfers.get(full)
        if transfer is None:
            transfer = self.transfers[full] = self.engine.rendezvous("", ranks, cost)  # named by its send
        return transfer


class _Stage:
    """The program of one pipeline stage's ranks: forwards and backwards with their TP
    collectives, sends to the neighbouring stages, DP gradient and parameter collectives."""

    def __init__(self, ctx: Context, stage: int, ranks: list[list[int]], fwd_in: list[list[simpy.Event]],
                 bwd_in: list[list[simpy.Event]], stalls: list[float], vp: int = 1,
                 split: PipelineSplit = EVEN_SPLIT, transfers: _Transfers | None = None):
        self.ctx, self.stage, self.all_ranks, self.vp, self.split = ctx, stage, ranks, vp, split
        self.transfers = transfers or _Transfers(ctx.engine)
        self.posting: Posting | None = None  # set by `run`: Megatron's receive posts and send waits
        self.sent: dict[Slot, dict[int, simpy.Event]] = {}  # a pass's send, per sending rank, until waited for
        self.ranks = ranks[stage]
        self.fwd_in, self.bwd_in, self.stalls = fwd_in, bwd_in, stalls
        self.eng = ctx.engine
        cl, wl = ctx.cluster, ctx.workload
        # a rank's part of a micro-batch: its CP rank's tokens (all of them without CP)
        act = self.act = wl.tokens_per_micro_batch // cl.cp * ctx.hidden * wl.activation_bytes
        self.ag = collective_cost("all-gather", act, cl.tp_geometry(), ctx.hw)
        self.rs = collective_cost("reduce-scatter", act, cl.tp_geometry(), ctx.hw)
        # without userbuffers, NCCL's all-gathers of what the GEMMs take (`tp_gather_bytes`)
        gathered = wl.tokens_per_micro_batch // cl.cp * ctx.hidden * tp_gather_bytes(wl, ctx.options.tp_comm_overlap)
        self.nccl_ag = collective_cost("all-gather", gathered, cl.tp_geometry(), ctx.hw)
        self.p2p = p2p_cost(act, cl, ctx.hw)
        self.tp_groups = _groups(self.ranks, cl.tp_groups(stage))
        self.dp_groups = _groups(self.ranks, cl.dp_groups(stage))
        self.cp_groups = _groups(self.ranks, cl.cp_groups(stage)) if cl.cp > 1 else []
        self.ring_costs: dict[float, CollectiveCost] = {}
        self.rs_chunks: dict[int, tuple[CollectiveCost | None, CollectiveCost]] = {}
        self.firsts = _bucket_first_layers(ctx)
        self.completed = backward_layers(ctx.plan, ctx.spec)  # bucket index -> the layer completing it
        self.bucket_synced: dict[int, list[simpy.Event]] = {}
        # aligned launches (`aligned`): each finished backward's (micro-batch, chunk) in order, the
        # chunks launched, and their reductions
        self.backwards: list[tuple[int, int]] = []
        self.chunks_launched: set[int] = set()
        self.chunk_syncs: list[simpy.Event] = []
        self.experts = ctx.experts
        if self.experts is not None:
            ecl = self.experts.cluster
            self.ep_groups = _groups(self.ranks, ecl.ep_groups(stage))
            self.etp_groups = _groups(self.ranks, ecl.tp_groups(stage))
            self.edp_groups = _groups(self.ranks, ecl.dp_groups(stage))
            self.expert_firsts = _bucket_first_layers(self.experts)
            self.expert_completed = backward_layers(self.experts.plan, self.experts.spec)
            self.ep_costs: dict[tuple, tuple[CollectiveCost, CollectiveCost]] = {}
            self.etp_costs: dict[tuple[str, float], CollectiveCost] = {}
        done = self.eng.env.event().succeed()
        self.last: dict[int, simpy.Event] = {r: done for r in self.ranks}
        # Megatron's combined 1F1B schedule (sim.ep_overlap): one micro-batch's forward beside another's backward
        self.combined = ctx.options.overlap_moe_expert_parallel_comm and self.experts is not None

    def collective(self, name: str, groups: list[list[int]], cost, stream: str,
                   after: dict[int, list[simpy.Event]] | None = None, sms: int | None = None) -> dict[int, simpy.Event]:
        """`sms`: the SMs its kernel holds (default: NCCL's, `sim.comm_sms.nccl_sms`)."""
        out: dict[int, simpy.Event] = {}
        for g in groups:
            out.update(self.eng.collective(name, g, cost, stream, {r: (after or {}).get(r, [self.last[r]]) for r in g},
                                           sms=sms))
        return out

    def compute(self, name: str, seconds: float, extra: dict[int, list[simpy.Event]] | None = None,
                margin: int = 0) -> None:
        """`margin`: SMs the kernels leave to a communication kernel (`Engine.compute`)."""
        for r in self.ranks:
            self.last[r] = self.eng.compute(r, name, seconds, [self.last[r]] + (extra or {}).get(r, []), margin=margin)

    def wait(self, events: list[simpy.Event]) -> None:
        for r in self.ranks:
            self.last[r] = self.eng.env.all_of([self.last[r]] + events)

    def block(self, name: str, b, gathers_input: int, no_grad: bool = False) -> None:
        """A sequence-parallel block (TP > 1): all-gather(s) in, GEMMs, reduce-scatter out;
        overlapped as Transformer Engine's TP communication overlap does, or in series.
        `no_grad`: the forward runs without autograd (the first forward of a layer under full
        recompute, `forward_layer`), where TE gathers the input with NCCL before the first GEMMs
        even under the overlap and runs the column GEMMs whole (`Block.without_grad`); the
        reduce-scatter overlaps as ever."""
        ctx, ranks = self.ctx, self.ranks
        if no_grad:
            b = b.without_grad()
        # torch's early stop (a block that does not scatter its output) re-runs under FSDP only
        assert b.sends_output, "a stopped-early re-run on the ZeRO-1 layout"
        if b.recompute is not None:  # full recompute: the forward block again first, its collectives with it
            self.block(f"{name} recompute", b.recompute, 1)
        if b.ep_bytes and self.experts is not None:  # token dispatch to the experts' ranks and back
            dispatch, combine = self._ep_cost(b)
            held = dispatcher_sms(b.ep_flex)  # the flex kernel's own SMs; None: NCCL's
            self.last.update(self.collective(f"{name} dispatch", self.ep_groups, dispatch, EP_COMM, sms=held))
            if b.etp_bytes:  # expert TP: the ETP group's tokens gathered, the outputs reduce-scattered
                gather = self._etp_cost("all-gather", b.etp_bytes)
                self.last.update(self.collective(f"{name} etp all-gather", self.etp_groups, gather, ETP_COMM))
            self.compute(name, b.seconds)
            if b.etp_bytes:
                scatter = self._etp_cost("reduce-scatter", b.etp_bytes)
                self.last.update(self.collective(f"{name} etp reduce-scatter", self.etp_groups, scatter, ETP_COMM))
            self.last.update(self.collective(f"{name} combine", self.ep_groups, combine, EP_COMM, sms=held))
            return
        if ctx.tp == 1 or not b.tp_collectives:
            self.core(name, b.seconds, b)
            return
        if not ctx.options.tp_comm_overlap:
            self.nccl_block(name, b, gathers_input)
            return
        # userbuffers' SMs (sim.comm_sms): the first gather is a copy-engine ring exchange; the
        # backward's second re-gathers the block input, a `bulk` kernel
        sm = _tp_overlap_sms(b, ctx.options.tp_comm_overlap_cfg)
        backward = gathers_input > 1
        if no_grad:  # TE's LayerNormLinear turns its userbuffers all-gather off without grad
            self.last.update(self.collective(f"{name} all-gather", self.tp_groups, self.ag, TP_COMM))
            gathers_input = 0
        gathered = dict(self.last)
        for i in range(gathers_input):
            gathered = self.collective(f"{name} all-gather", self.tp_groups, self.ag, TP_COMM,
                                       {r: [gathered[r]] for r in ranks}, sms=sm.backward_gather if i else 0)
        self.compute(f"{name} first", b.first_s)
        self.core(f"{name} middle", b.middle_s, b, {r: [gathered[r]] for r in ranks})
        before_last = dict(self.last)
        if backward:  # a `bulk` reduce-scatter beside the weight-gradient GEMMs, on SMs it takes from them
            self.compute(f"{name} last", b.last_s)
            scattered = self.collective(f"{name} reduce-scatter", self.tp_groups, self.rs, TP_COMM,
                                        {r: [before_last[r]] for r in ranks}, sms=sm.backward_reduce_scatter)
        else:  # a `pipeline` reduce-scatter: the chunks' under the GEMM, the last chunk's after it
            # under set_sm_margin the GEMM runs without the kernel's SMs, which the kernel then uses
            margin = sm.forward_reduce_scatter if sm.forward_sm_margin else 0
            self.compute(f"{name} last", b.last_s, margin=margin)
            head, tail = self._rs_chunks(sm.forward_splits or ctx.tp)  # None: a ring exchange's TP chunks
            sms = 0 if margin else sm.forward_reduce_scatter
            scattered = self.collective(f"{name} reduce-scatter", self.tp_groups, head, TP_COMM,
                                        {r: [before_last[r]] for r in ranks}, sms=sms) if head is not None else {}
            if tail is not None:
                scattered = self.collective(f"{name} reduce-scatter (last chunk)", self.tp_groups, tail, TP_COMM,
                                            {r: [self.last[r]] + ([scattered[r]] if scattered else []) for r in ranks},
                                            sms=sms)
            if sm.forward_splits is None:  # a ring exchange: the received partial sums reduced on the compute stream
                self.compute(f"{name} reduce-scatter sum", self._ring_rs_sum_s,
                             {r: [scattered[r]] for r in ranks})
        self.last.update({r: self.eng.env.all_of([self.last[r], scattered[r]]) for r in ranks})

    def nccl_block(self, name: str, b, gathers_input: int) -> None:
        """A sequence-parallel block as Transformer Engine runs it without userbuffers: its TP
        collectives are NCCL's, on their own stream. The forward's all-gather of the input and
        reduce-scatter of the output, and the backward's all-gather of the output gradient, run in
        series with the GEMMs (synchronous: `gather_along_first_dim` / `reduce_scatter_along_first_dim`
        without `async_op`, and `grad_output_preprocess`). A column-parallel module's backward
        overlaps two: the re-gather of its saved input, issued asynchronously before and waited
        after its data-gradient GEMM ("Overlap input AG with dgrad"), and the reduce-scatter of
        that data gradient, issued asynchronously before and waited after its weight-gradient
        GEMM ("Overlap dgrad-RS/AR with wgrad"): module/linear.py and layernorm_linear.py
        `backward`, TE 1.x (NVIDIA/TransformerEngine 0004dbd) and TE 2.x alike
        (`column_parallel_comm_input`, `column_parallel_comm_dgrad`). Each NCCL kernel holds its
        SMs beside the GEMM (`sim.comm_sms.nccl_sms`). The norm's backward, which waits for the
        reduce-scatter, is priced in `middle_s`, before the column GEMMs: its seconds are the
        same, its place an approximation."""
        ranks = self.ranks
        self.last.update(self.collective(f"{name} all-gather", self.tp_groups, self.nccl_ag, TP_COMM))
        if gathers_input < 2:  # forward
            self.core(name, b.seconds, b)
            self.last.update(self.collective(f"{name} reduce-scatter", self.tp_groups, self.rs, TP_COMM))
            return
        self.compute(f"{name} first", b.first_s)  # the row-parallel module's data and weight gradients
        self.core(f"{name} middle", b.middle_s, b)
        issued = dict(self.last)
        gathered = self.collective(f"{name} all-gather (input)", self.tp_groups, self.nccl_ag, TP_COMM,
                                   {r: [issued[r]] for r in ranks})
        self.compute(f"{name} dgrad", b.last_s - b.last_wgrad_s)
        self.wait_each(gathered)
        issued = dict(self.last)
        scattered = self.collective(f"{name} reduce-scatter", self.tp_groups, self.rs, TP_COMM,
                                    {r: [issued[r]] for r in ranks})
        self.compute(f"{name} wgrad", b.last_wgrad_s)
        self.wait_each(scattered)

    @cached_property
    def _ring_rs_sum_s(self) -> float:
        """A ring-exchange reduce-scatter's last step (Transformer Engine's
        `CommOverlapP2PBase::split_overlap_rs`: `reduce_bf16` on the main stream once every chunk has
        been sent and received): the TP partial sums of this rank's slice of the block output read
        (`tp` slices) and their sum written (one), in the activations' dtype."""
        tp, slice_bytes = self.ctx.tp, self.act / self.ctx.tp
        numel = int(slice_bytes // self.ctx.workload.activation_bytes)
        return self.ctx.rate.kernel_seconds(elementwise_kernel("reduce-scatter sum", numel, tp - 1,
                                                               (tp + 1) * self.ctx.workload.activation_bytes))

    def _rs_chunks(self, splits: int) -> tuple[CollectiveCost | None, CollectiveCost]:
        """A `pipeline` reduce-scatter of the block output in `splits` chunks: the first `splits - 1`
        chunks' (one collective; None for one chunk), and the last chunk's (the whole at 1)."""
        if splits not in self.rs_chunks:
            cl, ctx, act = self.ctx.cluster, self.ctx, self.act
            head = collective_cost("reduce-scatter", act * (splits - 1) / splits, cl.tp_geometry(), ctx.hw) \
                if splits > 1 else None
            tail = collective_cost("reduce-scatter", act / splits, cl.tp_geometry(), ctx.hw) if splits > 1 else self.rs
            self.rs_chunks[splits] = (head, tail)
        return self.rs_chunks[splits]

    def core(self, name: str, seconds: float, b, extra: dict[int, list[simpy.Event]] | None = None) -> None:
        """`seconds` of the block's compute holding its attention core; under context parallelism
        the core runs last, as its ring (`Block.ring_steps`): step i computes against the K/V
        block it holds while exchange i, on the CP stream, sends it to the next CP rank (and
        receives the one step i + 1 needs); the pass ends when its last exchange is done."""
        if not b.ring_steps:
            self.compute(name, seconds, extra)
            return
        ranks = self.ranks
        self.compute(name, seconds - b.core_s, extra)
        pending: dict[int, simpy.Event] | None = None
        for i in range(b.ring_steps):
            sent = None
            if i < len(b.ring_bytes):
                sent = self.collective(f"{name} cp ring {i}", self.cp_groups, self._ring_cost(b.ring_bytes[i]), CP_COMM,
                                       {r: [self.last[r]] for r in ranks})
            self.compute(f"{name} attention step {i}", b.step_seconds(i), None if pending is None else
                         {r: [pending[r]] for r in ranks})
            pending = sent
        if pending is not None:
            self.wait_each(pending)

    def wait_each(self, events: dict[int, simpy.Event]) -> None:
        for r in self.ranks:
            self.last[r] = self.eng.env.all_of([self.last[r], events[r]])

    def _ring_cost(self, sent: float) -> CollectiveCost:
        """One step of the CP ring: every rank sends `sent` bytes to the next CP rank and receives
        as many from the previous, priced on the ring's slowest hop (`Cluster.cp_geometry`)."""
        if sent not in self.ring_costs:
            self.ring_costs[sent] = cp_ring_cost(sent, self.ctx.cluster, self.ctx.hw)
        return self.ring_costs[sent]

    def _ep_cost(self, b) -> tuple[CollectiveCost, CollectiveCost]:
        """An expert block's dispatch and combine (`sim.ep_dispatch.ep_costs`: the all-to-all of
        every pair, or the flex dispatcher's)."""
        key = (b.ep_bytes, b.ep_received, b.ep_flex, b.ep_meta)
        if key not in self.ep_costs:
            self.ep_costs[key] = ep_costs(b.ep_bytes, b.ep_received, b.ep_flex, self.experts.cluster, self.ctx.hw,
                                          b.ep_meta)
        return self.ep_costs[key]

    def _etp_cost(self, op: str, total: float) -> CollectiveCost:
        """An ETP group's all-gather (reduce-scatter) of `total` gathered bytes: the expert
        activations of its ranks (expert TP, `sim.model_work.Block.etp_bytes`)."""
        key = (op, total)
        if key not in self.etp_costs:
            self.etp_costs[key] = collective_cost(op, total, self.experts.cluster.tp_geometry(), self.ctx.hw)
        return self.etp_costs[key]

    def send(self, to: int, name: str, arrived: simpy.Event, receive: tuple[str, int, int],
             at: dict[int, simpy.Event] | None = None) -> dict[int, simpy.Event]:
        """Point-to-point sends of every rank's activation (gradient) slice to stage `to`, each a
        rendezvous with the receive `receive` (kind, virtual stage, micro-batch) its peer posts
        (`post`), on the stream of their communicator (`p2p_stream`), issued after `at` (default:
        what the pass has done); when each sender's send is done."""
        stream = p2p_stream(self.stage, to, len(self.all_ranks), self.vp)
        at = at or self.last
        evs, sent = [], {}
        for i, (src, dst) in enumerate(zip(self.ranks, self.all_ranks[to])):
            transfer = self.transfers.get(receive, i, [src, dst], self.p2p)
            transfer.name = name
            sent[src] = self.eng.join(transfer, src, stream, [at[src]])
            evs += [sent[src], transfer.done]
        self.eng.env.process(_relay(self.eng.env.all_of(evs), arrived))
        return sent

    def post(self, slots: Sequence[Slot], at: dict[int, simpy.Event] | None = None) -> None:
        """Each rank posts the receives of `slots` (its passes) after `at` (default: where its
        stream is now): the receive kernel, on the stream of the communicator it shares with the
        sender (`p2p_stream`)."""
        pp = len(self.all_ranks)
        at = at or self.last
        for kind, mb, c in slots:
            key = (kind, c * pp + self.stage, mb)
            src = (self.stage - 1) % pp if kind == "F" else (self.stage + 1) % pp
            stream = p2p_stream(src, self.stage, pp, self.vp)
            for i, r in enumerate(self.ranks):
                transfer = self.transfers.get(key, i, [self.all_ranks[src][i], r], self.p2p)
                self.eng.join(transfer, r, stream, [at[r]])

    def arrival(self, slot: Slot) -> simpy.Event:
        """When the input (output gradient) of pass `slot` has arrived."""
        kind, mb, c = slot
        v = c * len(self.all_ranks) + self.stage
        return self.fwd_in[v][mb] if kind == "F" else self.bwd_in[v][mb]

    def exchange_point(self, on: str | None) -> dict[int, simpy.Event] | None:
        """Where an exchange issued on stream `on` starts, per rank: that stream waits for what the
        pass has done (Megatron's `wait_current_stream` before the combined schedule's
        post_forward, on its communication stream), and the exchange's kernels start once it has
        reached that point (ProcessGroupNCCL's `syncStream`: the NCCL stream waits for the stream
        current at the call). None (`on` None): the pass's own point, `last`."""
        if on is None:
            return None
        return {r: self.eng.stream_wait(r, on, [self.last[r]]) for r in self.ranks}

    def after_pass(self, slot: Slot, sent: dict[int, simpy.Event] | None, on: str | None = None,
                   at: dict[int, simpy.Event] | None = None) -> None:
        """Pass `slot`'s exchange once its send (`sent`; None: it sends nothing) is issued: the
        receives it posts, the waits of a blocking exchange, an earlier send waited for
        (`sim.pipeline_p2p`). `on`: the stream the exchange is issued on (`exchange_point`, `at`
        its start), whose waits (PyTorch's `Work.wait()`: the current stream waits for the
        kernel's end) then hold that stream, not the pass: the combined schedule's post_forward
        (sim.ep_overlap) holds the communication stream, the next all-to-alls behind it."""
        if self.posting is None:  # no pipeline
            return
        step = self.posting.after[slot]
        if sent:
            self.sent[slot] = sent
        self.post(step.posts, at)

        def wait(events: dict[int, list[simpy.Event]]) -> dict[int, simpy.Event] | None:
            if on is None:
                for r, evs in events.items():
                    if evs:
                        self.last[r] = self.eng.env.all_of([self.last[r], *evs])
                return None
            return {r: self.eng.stream_wait(r, on, evs) for r, evs in events.items()}

        if step.blocking:
            arrivals = [self.arrival(s) for s in step.posts]
            at = wait({r: arrivals + ([sent[r]] if sent else []) for r in self.ranks}) or at
            self.sent.pop(slot, None)
            if sent or step.posts:
                self.batch_sync()
        self.post(step.then_posts, at)
        if step.then_posts and self.host_syncs:  # a blocking recv_forward / recv_backward
            self.wait([self.arrival(s) for s in step.then_posts])
            self.batch_sync()
        if step.waits_for is not None and step.waits_for in self.sent:
            earlier = self.sent.pop(step.waits_for)
            wait({r: [earlier[r]] for r in self.ranks})

    @property
    def host_syncs(self) -> bool:
        """Whether each of the rank's pipeline exchanges ends in `torch.cuda.synchronize()`: plain
        1F1B batches every exchange (`batch_p2p_comm`, on where `overlap_p2p_comm` is off, which
        it must be without a virtual pipeline), and Megatron's `_communicate`
        (megatron/core/pipeline_parallel/p2p_communication.py) then synchronises the device under
        `batch_p2p_sync` ("to protect against race condition when using batch_isend_irecv()"; on
        by default in ModelParallelConfig, every stored version). The interleaved schedule runs
        `overlap_p2p_comm` (unbatched ops, no synchronisation) and the combined one inside it."""
        return self.posting is not None and self.vp == 1

    def batch_sync(self) -> None:
        """After an exchange this rank took part in (Megatron calls `_communicate` only where the
        rank sends or receives something), under `host_syncs`: the host waits for every stream
        of the GPU to be done, the first kernel it issues next one launch later."""
        if not self.host_syncs:
            return
        for r in self.ranks:
            self.last[r] = self.eng.host_sync(r, [self.last[r]], self.ctx.hw.gpu.launch_s)

    def param_gathers(self) -> dict[int, list[simpy.Event]]:
        """Steady state: the last step's parameter all-gathers under this forward, issued where
        Megatron issues them (`sim.param_sync`): a model chunk at a time by the interleaved
        schedule (chunks 0 and 1 now), else each a bucket ahead of the forward (`forward_start`,
        `forward_layer_gathers`). Per layer, the gathers its first forward waits for, as issued."""
        self.needed: dict[int, list[simpy.Event]] = {}
        self.chains: list[list[_Gather]] = []  # the dense part's gathers in forward order, the expert part's
        self.issued: dict[tuple[int, int], list[simpy.Event]] = {}  # (chain, position) -> its events
        self.forwards = 0  # forwards started (the aligned dispatch counts them)
        if not self.ctx.options.overlap_param_gather:
            return self.needed
        self.chains = self._gather_chains()
        if self.gather_mode == "prefetched":  # canzona's runtime: step() issued them all (§8.2)
            for ci, chain in enumerate(self.chains):
                for pos in range(len(chain)):
                    self._issue(ci, pos, {r: [] for r in self.ranks})
        elif self.gather_mode == "aligned":
            for c in (0, 1):  # before the warm-up
                self._issue_chunk(c, {r: [] for r in self.ranks})
        return self.needed

    @property
    def gather_mode(self) -> str:
        """How the steady state's parameter gathers are issued: "prefetched" (canzona's runtime,
        every one at the step's end), "aligned" (Megatron's interleaved schedule, a model chunk at
        a time) or "chained" (Megatron's pre-hooks, a bucket ahead; `sim.param_sync`)."""
        if self.ctx.runtime_mode:
            return "prefetched"
        return "aligned" if aligned_param_sync(len(self.all_ranks), self.vp) else "chained"

    def _gather_chains(self) -> list[list[_Gather]]:
        """The dense part's gathers in forward order, AdamW's first (the stage's first layer waits
        for it), and the expert part's over EDP (on the same stream), in forward order."""
        layers = set(self.ctx.work.layer_ids)
        first_layer = self.ctx.work.layer_ids[0] if self.ctx.work.layer_ids else 0

        def at(layer: int) -> int:
            return layer if layer in layers else first_layer

        gathers = param_gather_costs(self.ctx)
        order = sorted(range(1, len(gathers)), key=lambda i: self.firsts[i - 1])  # forward order
        dense = [_Gather(gathers[i][0], self.dp_groups, gathers[i][1], first_layer if i == 0 else at(self.firsts[i - 1]))
                 for i in ([0] + order if gathers else [])]
        experts: list[_Gather] = []
        if self.experts is not None:
            first = {b.index: layer for b, layer in zip(self.experts.plan.dp_plan.buckets, self.expert_firsts)}
            first[None] = first_layer  # (runtime mode) the experts' empty AdamW buffer, as the dense part's
            experts = [_Gather(f"experts {rec.name}", self.edp_groups, record_cost(self.experts, rec), at(first[rec.bucket]))
                       for rec in sorted(self.ctx.expert_records(PARAMS), key=lambda rec: first[rec.bucket])]
        return [dense, experts]

    def _issue(self, chain: int, pos: int, after: dict[int, list[simpy.Event]] | None = None) -> None:
        """Gather `pos` of `chain` on the DP stream, after `after` (None: the compute so far)."""
        g = self.chains[chain][pos]
        evs = list(self.collective(g.name, g.groups, g.cost, DP_COMM, after).values())
        self.issued[(chain, pos)] = evs
        self.needed.setdefault(g.layer, []).extend(evs)

    def _issue_chunk(self, c: int, after: dict[int, list[simpy.Event]] | None = None) -> None:
        """Model chunk `c`'s gathers at once (`align_param_gather`): the dense part's in bucket
        order (the chunk's last layers first; AdamW's, which the simulator keeps apart, first of
        chunk 0), then the expert part's. A gather belongs to the chunk of the layer waiting for it."""
        chunk_of = {self.ctx.work.layer_ids[k]: i for i, ks in enumerate(self.chunk_list) for k in ks}
        for ci, chain in enumerate(self.chains):
            mine = [pos for pos, g in enumerate(chain) if chunk_of.get(g.layer, 0) == c]
            adamw = [0] if ci == 0 and 0 in mine else []
            for pos in adamw + [p for p in reversed(mine) if p not in adamw]:
                self._issue(ci, pos, after)

    def _await(self, events: list[simpy.Event]) -> None:
        """The compute stream waits for parameter gathers (the time stage 0 waits is reported)."""
        if self.stage == 0 and self.ranks:
            self.eng.env.process(self._probe(self.last[self.ranks[0]], events))
        self.wait(events)

    def _probe(self, before: simpy.Event, wanted: list[simpy.Event]):
        yield before
        t0 = self.eng.now
        yield self.eng.env.all_of(wanted)
        self.stalls.append(self.eng.now - t0)

    def grad_syncs(self, layer: int) -> list[simpy.Event]:
        """The reductions of the buckets whose gradients this layer's backward completes, in the
        order `canzona.step_collectives` lists them: the expert buckets' over EDP first, then the
        dense part's over DP, each part's in bucket order."""
        out: list[simpy.Event] = []
        if self.experts is not None:
            for rec in self.ctx.expert_records(BACKWARD):
                if rec.bucket is not None and self.expert_completed[rec.bucket] == layer:
                    out += self.collective_record(rec, self.experts, self.edp_groups, "experts ").values()
        position = {b.index: bi for bi, b in enumerate(self.ctx.plan.dp_plan.buckets)}
        for rec in self.ctx.dp_records(BACKWARD):
            if rec.bucket is not None and self.completed[rec.bucket] == layer:
                bucket = list(self.collective_record(rec).values())
                self.bucket_synced.setdefault(position[rec.bucket], []).extend(bucket)
                out += bucket
        return out

    def collective_record(self, rec: StepCollective, ctx: Context | None = None, groups: list[list[int]] | None = None,
                          prefix: str = "") -> dict[int, simpy.Event]:
        """`rec` on each of `groups` (the dense part's DP groups; the expert part's EDP groups,
        priced on its context `ctx`), after what each member has enqueued."""
        ctx = ctx or self.ctx
        out: dict[int, simpy.Event] = {}
        for g in self.dp_groups if groups is None else groups:
            out.update(self.eng.collective(f"{prefix}{rec.name}", g, record_cost(ctx, rec), DP_COMM,
                                           {r: [self.last[r]] for r in g},
                                           record=rec.logged() if ctx.runtime_mode else None))
        return out

    @property
    def aligned(self) -> bool:
        """Whether the schedule launches this stage's gradient reductions a model chunk at a time
        (`RunOptions.align_grad_reduce` under overlap_grad_reduce, Megatron's `grad_sync_func`).
        Megatron-LM's pipeline schedules (megatron/core/pipeline_parallel/schedules.py): interleaved,
        chunk c's `start_grad_sync` (every bucket at once) after backward step k_c + r of rank r,
        k_c the step of the chunk's last micro-batch, those past the last step at the end; plain
        1F1B, rank 0 keeps the backward hooks and the others launch everything after their last
        backward, in the bubble; without pipelining nothing changes (no schedule function)."""
        o = self.ctx.options
        return o.overlap_grad_reduce and o.align_grad_reduce and len(self.all_ranks) > 1 and \
            (self.vp > 1 or self.stage > 0)

    def chunk_grad_syncs(self, c: int) -> list[simpy.Event]:
        """Chunk `c`'s `start_grad_sync`: the reductions of the buckets its layers complete, all
        enqueued now, in bucket order (last layers first)."""
        self.chunks_launched.add(c)
        out: list[simpy.Event] = []
        for k in reversed(self.chunk_list[c]):
            out += self.grad_syncs(self.ctx.work.layer_ids[k])
        return out

    def aligned_launch(self, mb: int, c: int) -> None:
        """After the backward of micro-batch `mb` on chunk `c` (`aligned`): the chunk whose last
        micro-batch ran `stage` backward steps ago is launched. The combined 1F1B schedule
        (sim.ep_overlap) calls Megatron's `backward_step_helper_postprocess` only `if
        b_model_chunk_id:` (`combined_1f1b_schedule_for_interleaved_pipelining`): after a backward
        of chunk 0 the launch due then is left to the end ("any remaining grad reductions")."""
        self.backwards.append((mb, c))
        if self.combined and c == 0:
            return
        j = len(self.backwards) - 1 - self.stage
        if j >= 0 and self.backwards[j][0] == self.micro_batches - 1:
            self.chunk_syncs += self.chunk_grad_syncs(self.backwards[j][1])

    def chunks(self) -> list[list[int]]:
        """Per model chunk, the indices into the stage's work of its layers (one chunk at vp 1)."""
        work = self.ctx.work
        if self.vp == 1:
            return [list(range(len(work.layer_ids)))]
        pp, layers = len(self.all_ranks), self.ctx.cfg.layers
        return [[k for k, layer in enumerate(work.layer_ids)
                 if layer in chunk_layers(layers, pp, self.stage, c, self.vp, self.split)] for c in range(self.vp)]

    def run(self, micro_batches: int) -> list[simpy.Event]:
        ctx, s, vp = self.ctx, self.stage, self.vp
        pp = len(self.all_ranks)
        self.chunk_list = self.chunks()
        needed = self.param_gathers()
        self.micro_batches = micro_batches
        syncs: list[simpy.Event] = []
        combined = self.combined
        if pp > 1:
            self.posting = posting(s, pp, micro_batches, vp, combined)
            self.post(self.posting.at_start)
            if self.posting.at_start and self.host_syncs:  # plain 1F1B's first recv_forward blocks
                self.wait([self.arrival(slot) for slot in self.posting.at_start])
                self.batch_sync()
        if combined:
            # Megatron's combined 1F1B: one micro-batch(-chunk)'s forward beside another's backward
            run_combined(self, micro_batches, needed, syncs)
        else:
            for kind, mb, c in pipeline_order(s, pp, micro_batches, vp):
                if kind == "F":
                    self.forward_pass(mb, c, needed)
                else:
                    self.backward_pass(mb, c, micro_batches, syncs)
        if not ctx.options.overlap_grad_reduce:
            for layer in reversed(ctx.work.layer_ids):
                syncs += self.grad_syncs(layer)
        elif self.aligned:  # the chunks not launched yet, in chunk order ("any remaining grad reductions")
            for c in range(vp):
                if c not in self.chunks_launched:
                    self.chunk_syncs += self.chunk_grad_syncs(c)
            syncs += self.chunk_syncs
        for rec in ctx.dp_records(BACKWARD):  # Megatron reduces AdamW's in backward (the runtime: in step())
            if rec.bucket is None:
                syncs += self.collective_record(rec).values()
        return syncs

    def _tag(self, c: int) -> str:
        return "" if self.vp == 1 else f" chunk {c}"

    def virtual(self, c: int) -> tuple[int, bool]:
        """Chunk `c`'s virtual stage (it receives from v - 1 and sends to v + 1) and whether it
        holds the output layer."""
        pp = len(self.all_ranks)
        v = c * pp + self.stage
        return v, v == pp * self.vp - 1

    def forward_start(self, mb: int, c: int) -> None:
        """Micro-batch `mb`'s forward of chunk `c` up to its first layer: the parameter gathers the
        schedule issues before it (`sim.param_sync`), its input, the embedding, whose pre-hook
        issues the first bucket's gather where none is issued ahead."""
        v, _ = self.virtual(c)
        mode = self.gather_mode if self.chains else None
        if mode == "aligned":
            chunk = chunk_issued_before(self.forwards, self.stage, len(self.all_ranks), self.vp)
            if chunk is not None:
                self._issue_chunk(chunk)
        self.forwards += 1
        self.wait([self.fwd_in[v][mb]])
        if mode == "chained" and self.chains[0] and (0, 0) not in self.issued:
            self._issue(0, 0)
        if v == 0 and self.ctx.work.embed_forward_s:
            self.compute(f"mb{mb} fwd embedding", self.ctx.work.embed_forward_s)

    def forward_layer_gathers(self, mb: int, k: int, needed: dict[int, list[simpy.Event]]) -> None:
        """The first forward waits for the parameter gathers of layer `k` (the stage's work index);
        where the schedule does not issue them ahead, each wait issues the next gather of its part
        (`finish_param_sync`), and a gather not issued yet is issued first."""
        layer = self.ctx.work.layer_ids[k]
        if mb != 0:
            return
        if not self.chains or self.gather_mode != "chained":
            if layer in needed:
                self._await(needed[layer])
            return
        for ci, chain in enumerate(self.chains):
            for pos, g in enumerate(chain):
                if g.layer != layer:
                    continue
                if (ci, pos) not in self.issued:
                    self._issue(ci, pos)
                self._await(self.issued[(ci, pos)])
                if pos + 1 < len(chain) and (ci, pos + 1) not in self.issued:
                    self._issue(ci, pos + 1)

    def forward_end(self, mb: int, c: int, post_first: bool = False, on: str | None = None) -> None:
        """After chunk `c`'s last layer: the head (and loss), or the send to the next stage; then
        the pass's exchange (`after_pass`), before the head where `post_first` (the combined
        schedule runs its post_forward before the head, sim.ep_overlap). `on`: the stream the
        exchange is issued on where not the pass's (`after_pass`)."""
        v, last_head = self.virtual(c)
        slot = ("F", mb, c)
        if last_head:
            if post_first:
                self.after_pass(slot, None, on, self.exchange_point(on))
            self.compute(f"mb{mb} fwd head", self.ctx.work.head_forward_s)
            if not post_first:
                self.after_pass(slot, None)
        else:
            pp = len(self.all_ranks)
            at = self.exchange_point(on)
            self.after_pass(slot, self.send((self.stage + 1) % pp, f"mb{mb}{self._tag(c)} send activations",
                                            self.fwd_in[v + 1][mb], ("F", v + 1, mb), at), on, at)

    def forward_layer(self, mb: int, k: int, needed: dict[int, list[simpy.Event]]) -> None:
        """Micro-batch `mb`'s forward of layer `k` (the stage's work index), after its gathers."""
        self.forward_layer_gathers(mb, k, needed)
        # under full recompute Megatron runs each layer's first forward inside its checkpoint
        # function under torch.no_grad() (`tensor_parallel.checkpoint`, TE's `checkpoint` under
        # FP8: `canzona.recompute`), and the re-run in the backward with grad
        # (a layer outside any checkpoint, Megatron's block method past its first N, with grad)
        no_grad = self.ctx.work.no_grad(k, self.ctx.options.recompute)
        for b in self.ctx.work.forward[k]:
            self.block(f"mb{mb} fwd {b.name}", b, 1, no_grad=no_grad)

    def forward_pass(self, mb: int, c: int, needed: dict[int, list[simpy.Event]]) -> None:
        self.forward_start(mb, c)
        for k in self.chunk_list[c]:
            self.forward_layer(mb, k, needed)
        self.forward_end(mb, c)

    def backward_start(self, mb: int, c: int) -> None:
        """Micro-batch `mb`'s backward of chunk `c` up to its last layer: its output gradient, the head."""
        v, last_head = self.virtual(c)
        self.wait([self.bwd_in[v][mb]])
        if last_head:
            self.compute(f"mb{mb} bwd head", self.ctx.work.head_backward_s)

    def backward_layer_done(self, mb: int, k: int, micro_batches: int, syncs: list[simpy.Event]) -> None:
        """After layer `k`'s backward: the last micro-batch's completes buckets, reduced at once
        under --overlap-grad-reduce (by the backward hooks: not where the schedule launches them, `aligned`)."""
        if mb == micro_batches - 1 and self.ctx.options.overlap_grad_reduce and not self.aligned:
            syncs += self.grad_syncs(self.ctx.work.layer_ids[k])

    def backward_end(self, mb: int, c: int, grads: dict[int, simpy.Event] | None = None,
                     post_first: bool = False) -> None:
        """After chunk `c`'s first layer: the embedding's gradient, the gradient reductions the
        schedule launches there (`aligned`), the send to the stage before and the pass's exchange
        (`after_pass`); the exchange first where `post_first` (the combined schedule's
        post_backward runs inside its step, before the embedding's gradient, and
        backward_step_helper_postprocess after it: sim.ep_overlap). `grads`: when the weight
        gradients finish where later than `last` (delay_wgrad_compute's deferred GEMMs,
        sim.ep_overlap): the reductions wait for them, the send does not."""
        if post_first:
            self._backward_exchange(mb, c)
        v, _ = self.virtual(c)
        if v == 0 and self.ctx.work.embed_backward_s:
            self.compute(f"mb{mb} bwd embedding", self.ctx.work.embed_backward_s)
        if self.aligned and grads is not None:
            data = dict(self.last)
            self.wait_each(grads)
            self.aligned_launch(mb, c)
            self.last.update(data)
        elif self.aligned:
            self.aligned_launch(mb, c)
        if not post_first:
            self._backward_exchange(mb, c)

    def _backward_exchange(self, mb: int, c: int) -> None:
        """The backward's send to the stage before (none from the first virtual stage) and its
        exchange (`after_pass`)."""
        v, _ = self.virtual(c)
        sent = None
        if v > 0:
            pp = len(self.all_ranks)
            sent = self.send((self.stage - 1) % pp, f"mb{mb}{self._tag(c)} send gradients", self.bwd_in[v - 1][mb],
                             ("B", v - 1, mb))
        self.after_pass(("B", mb, c), sent)

    def backward_layer(self, mb: int, k: int, micro_batches: int, syncs: list[simpy.Event]) -> None:
        """Micro-batch `mb`'s backward of layer `k`, then what its completion starts."""
        for b in self.ctx.work.backward[k]:
            # backward re-gathers the block input for the weight gradients (sequence parallel)
            self.block(f"mb{mb} bwd {b.name}", b, 2)
        self.backward_layer_done(mb, k, micro_batches, syncs)

    def backward_pass(self, mb: int, c: int, micro_batches: int, syncs: list[simpy.Event]) -> None:
        self.backward_start(mb, c)
        for k in reversed(self.chunk_list[c]):
            self.backward_layer(mb, k, micro_batches, syncs)
        self.backward_end(mb, c)


def tp_gather_bytes(wl: Workload, userbuffers: bool) -> int:
    """Bytes an element of a sequence-parallel all-gather moves. Without userbuffers under FP8,
    Transformer Engine gathers what its GEMMs take, the FP8 cast, 1 byte: the norm writes its
    output in FP8 before the forward's gather and the backward re-gathers that saved FP8 input
    (TE 1.x module/layernorm_linear.py `_LayerNormLinear.forward`, `ln_out_dtype = torch.uint8`
    under fp8; NVIDIA/TransformerEngine 0004dbd), and the row-parallel backward casts the output
    gradient to FP8 before gathering it (module/base.py `grad_output_preprocess`, "FP8 case with
    gather"). TE 2.x quantizes the input before its gather as well (module/linear.py, the
    `with_input_all_gather_nccl` path, per-tensor Float8 / Float8CurrentScaling quantizers); its
    output gradient's gather is taken to follow (an assumption). With userbuffers the simulator
    gathers the activation dtype (`_Stage.ag`), unexamined under FP8."""
    return DTYPE_BYTES[FP8] if wl.precision == FP8 and not userbuffers else wl.activation_bytes


def _tp_overlap_sms(b, config: str) -> TPOverlapSMs:
    """The SMs of block `b`'s TP exchanges under the userbuffers configuration named `config`
    (`sim.userbuffers`): a layer's first block (`layer L.0`, `sim.model_work`) is its attention
    (q, k, v | o), the others its MLP."""
    attention, mlp = block_overlaps(config)
    return attention if b.name.endswith(".0") else mlp


def _relay(source: simpy.Event, target: simpy.Event):
    yield source
    target.succeed()


# --- phase B ----------------------------------------------------------------------------------


def _gradient_norm(ctx: Context, rank: int, start: simpy.Event) -> simpy.Event:
    """Each rank's share of the global gradient norm (and the clip), on its share of the reduced
    gradients: its segment of every bucket and its slice of the AdamW buffer."""
    # on the fp32 main gradients beside masters (Megatron copies a bf16 reduction's shard into them),
    # on the reduced gradients themselves without
    kernels = gradient_norm_kernels(ctx.norm_numels[ctx.dp_index(rank)], ctx.options.max_grad_norm is not None,
                                    ctx.memory.update_bytes)
    return ctx.engine.compute(rank, "gradient norm", sum(ctx.rate.kernel_seconds(k) for k in kernels), [start])


def _adamw_step(ctx: Context, rank: int, after: list[simpy.Event]) -> simpy.Event:
    return ctx.engine.compute(rank, "adamw step", ctx.adamw_seconds(ctx.adamw_share(ctx.dp_index(rank))), after)


@dataclass(frozen=True)
class EarlyStart:
    """Where an overlapped step (`RunOptions.overlap_step`) may start a micro-group, and a plain
    step its prefetched gathers: once the buckets holding its matrices are reduced and the stage's
    backward kernels are done (the runtime enqueues the step after backward, on the same compute
    stream)."""

    bucket_synced: dict[int, simpy.Event]
    backward_done: simpy.Event


def every_rank(ctx: Context) -> StepClasses:
    """A stage's ranks each simulated (`sim.classes`)."""
    cl = ctx.cluster
    return StepClasses.every_rank(cl.stage_ranks(ctx.stage).start, cl.stage_gpus)


def _step_key(ctx: Context, i: int, schedules: ScheduleKeys) -> tuple:
    """What the simulator does of DP (EDP) rank `i`'s step: its TP schedule but for the matrices'
    names (`ScheduleKeys`: outside runtime mode a name only says which bucket's reduction an early
    start waits for, and the key keeps the bucket), its share of the gradient norm and its AdamW
    elements."""
    return schedules(i), ctx.norm_numels[i], ctx.adamw_share(i)


def step_classes(ctx: Context) -> StepClasses:
    """The classes of a stage's ranks whose steps are the same (`sim.classes`): units of
    lcm(TP, EP x ETP) ranks keyed by their DP ranks' steps and their EDP ranks' (`_step_key`),
    unit 0 (phase A's simulated rank) on its own. Not for runtime mode, whose records name the
    matrices of every rank's step."""
    cl, ectx = ctx.cluster, ctx.experts
    block = ectx.cluster.ep * ectx.cluster.tp if ectx is not None else cl.tp
    unit = math.lcm(cl.tp, block)

    def ids(c: Context) -> list[int]:
        schedules = ScheduleKeys(c.plan, c.spec, c.policy)
        seen: dict[tuple, int] = {}
        return [seen.setdefault(_step_key(c, i, schedules), len(seen)) for i in range(c.cluster.dp)]

    dense, dense_per = ids(ctx), unit // cl.tp
    experts, experts_per = (ids(ectx), unit // block) if ectx is not None else ([], 0)
    first: dict[tuple, int] = {}
    of_unit = [first.setdefault(("phase A",) if u == 0 else
                                (tuple(dense[u * dense_per:(u + 1) * dense_per]),
                                 tuple(experts[u * experts_per:(u + 1) * experts_per])), u)
               for u in range(cl.stage_gpus // unit)]
    return StepClasses(cl.stage_ranks(ctx.stage).start, unit, tuple(of_unit))


def optimizer_step(ctx: Context, start: simpy.Event, early: EarlyStart | None = None,
                   classes: StepClasses | None = None) -> list[simpy.Event]:
    """Phase B of every policy: the DP-level extras (zero1-gather's split gathers), then each DP
    rank's TP group runs its step schedule (`canzona.step_schedule`: micro-groups under canzona, one
    tp-sync group under the baselines), then AdamW and the parameter all-gather.

    With `overlap_step` (and `early`), each micro-group's gather, compute and scatter start as soon
    as its buckets are reduced, before the gradient norm and the step check, and every apply waits
    for the check (the runtime computes the updates early and commits them after it). Without it,
    the schedule's prefetched gathers (`TPSchedule.prefetched`) start as soon as their buckets are
    reduced (given `early`), and the rest waits for the check.

    `classes`: the ranks simulated (`step_classes`; default every rank), the others' steps being
    theirs."""
    cl = ctx.cluster
    classes = classes or every_rank(ctx)
    ranks = classes.ranks
    runs = [_ScheduleRun(ctx, cl.tp_group(i, ctx.stage), ctx.step_schedule(i, ctx.options.overlap_step))
            for i in sorted({cl.dp_index(r) for r in ranks})]
    ectx = ctx.experts
    expert_records: list[StepCollective] = []  # the expert part's step collectives over EDP, issued by _ExpertStep
    if ectx is not None and ctx.runtime_mode:
        # the runtime checks the experts first: their step collectives, their share of the norm
        # and their check over EDP, before the dense part's (whose check carries that norm)
        reduced = issue_records(ectx, ctx.expert_records(STEP), {r: start for r in ranks})
        start_of = issue_records(ectx, ctx.expert_records(CHECK), {r: _gradient_norm(ectx, r, reduced[r]) for r in ranks})
    else:
        start_of = {r: start for r in ranks}
        if ectx is not None:
            expert_records = ctx.expert_records(STEP)
    # the step's DP collectives first: the runtime's reductions (AdamW's, the baselines' gathers),
    # which the norm reads; Megatron's split gather of zero1-gather, which the schedule waits for
    step_records = ctx.dp_records(STEP)
    reduced = issue_records(ctx, step_records, start_of)
    if early is not None and ctx.options.overlap_step:
        ready = _group_ready(ctx, early, start)
        for run in runs:
            run.early = True
            for op in run.schedule.ops:
                if op.kind != APPLY:
                    # a compute window (TP 1: consecutive groups) starts when all of its groups can
                    together = run.windows.get(op.group, (op.group,)) if op.kind == COMPUTE else (op.group,)
                    event = ready([run.schedule.groups[g] for g in together])
                    run.issue(op, {r: event for r in run.members})
    elif early is not None:  # the prefetched gathers, on the TP streams ahead of the TP step check
        ready = _group_ready(ctx, early, start)
        for run in runs:
            for op in run.schedule.prefetched:
                event = ready([run.schedule.groups[op.group]])
                run.issue(op, {r: event for r in run.members})
    def norm(r: int, after: simpy.Event) -> simpy.Event:  # over the dense part's gradients, then the experts'
        done = _gradient_norm(ctx, r, after)
        return _gradient_norm(ectx, r, done) if ectx is not None and not ctx.runtime_mode else done

    if ctx.runtime_mode:
        checked = issue_records(ctx, ctx.dp_records(CHECK), {r: norm(r, reduced[r]) for r in ranks})
    else:  # Megatron: the norm beside the split gather; no checks
        checked = {r: norm(r, start) for r in ranks}
        if step_records:
            checked.update(reduced)
    params_ready: dict[int, simpy.Event] = {}
    # the expert part (expert parallelism) on each rank's compute stream right after the dense
    # part's last compute: its exchanges (expert TP) are another group's, so the dense part's
    # last scatter and applies run under it instead of after it
    expert_step = _ExpertStep(ectx, checked, expert_records) if ectx is not None else None
    for run in runs:
        begin = {r: checked[r] for r in run.members}
        computes = [k for k, op in enumerate(run.schedule.ops) if op.kind == COMPUTE]
        if expert_step is not None and not computes:
            expert_step.reach(run.members)
        adamw: dict[int, simpy.Event] = {}  # AdamW, where the schedule runs it (under its last scatter)
        for k, op in enumerate(run.schedule.ops):
            if k == run.schedule.elementwise_at:
                adamw = {r: _adamw_step(ctx, r, [checked[r]]) for r in run.members}
            if op.kind == APPLY:
                run.apply(op, begin if run.early else None)
            elif not run.early and (early is None or op not in run.schedule.prefetched):
                run.issue(op, begin)  # else issued as its buckets landed
            if expert_step is not None and computes and k == computes[-1]:
                expert_step.reach(run.members)
        if not adamw:  # no op to run it before
            adamw = {r: _adamw_step(ctx, r, [checked[r]]) for r in run.members}
        for r in run.members:
            params_ready[r] = ctx.engine.env.all_of(run.applied[r] + [adamw[r]])
    experts = expert_step.done if expert_step is not None else {}
    if ctx.options.overlap_param_gather:  # they run under the next forward (phase A)
        return list(params_ready.values()) + list(experts.values())
    gathered = issue_records(ctx, ctx.dp_records(PARAMS), params_ready)
    if experts:
        gathered.update(issue_records(ectx, ctx.expert_records(PARAMS), experts))
    return list(gathered.values()) + list(experts.values())


class _ExpertStep:
    """The expert part's step (expert parallelism): the expert plan's collectives of the step over
    EDP (`records`: zero1-gather's split gathers; in runtime mode none, issued before the dense
    part's check), then on each ETP group the step schedule of its
    EDP rank (`canzona.step_schedule`, as a dense DP rank's on its TP group: at ETP 1 the matrices
    it owns, computed whole and applied with no exchange; under expert TP canzona's micro-groups,
    or the baselines' tp-sync, on the ETP group's links), with the dense part's batching."""

    def __init__(self, ectx: Context, begin: dict[int, simpy.Event], records: Sequence[StepCollective]) -> None:
        self.ectx = ectx
        self.reduced = issue_records(ectx, records, begin)
        self.done: dict[int, simpy.Event] = {}  # per rank: its last expert update
        self.reached: set[int] = set()
        cl = ectx.cluster
        self.group_of = {r: g for g in cl.tp_groups(ectx.stage) for r in g}

    def reach(self, ranks: Sequence[int]) -> None:
        """`ranks` have their dense part's step enqueued up to its last compute: an ETP group's
        schedule is issued once all its members are (an ETP group inside a dense TP group: at once)."""
        self.reached.update(ranks)
        for g in {tuple(self.group_of[r]) for r in ranks}:
            if g[0] not in self.done and all(r in self.reached for r in g):
                self._issue(list(g))

    def _issue(self, members: list[int]) -> None:
        ectx = self.ectx
        run = _ScheduleRun(ectx, members, ectx.step_schedule(ectx.dp_index(members[0]), False))
        begin = {r: self.reduced[r] for r in members}
        for op in run.schedule.ops:
            if op.kind == APPLY:
                run.apply(op)
            else:
                run.issue(op, begin)
        for r in members:
            if matrix_optimizer(ectx.plan.optimizer).elementwise:  # AdamW on the pieces of its segments
                self.done[r] = _adamw_step(ectx, r, [self.reduced[r]])
            else:
                self.done[r] = ectx.engine.env.all_of(run.applied[r] or [self.reduced[r]])


def _group_ready(ctx: Context, early: EarlyStart, synced: simpy.Event):
    """When micro-groups (their gathers, without `overlap_step`) may start: their buckets reduced,
    backward's kernels done."""
    bucket_of = {p.name: k for k, b in enumerate(ctx.plan.dp_plan.buckets) for p in b.params}
    env = ctx.engine.env
    cache: dict[tuple[int, ...], simpy.Event] = {}

    def ready(groups: Sequence[GroupStep]) -> simpy.Event:
        key = tuple(g.index for g in groups)
        if key not in cache:
            buckets = sorted({bucket_of[t.name] for g in groups for t in g.tasks})
            cache[key] = env.all_of([early.backward_done] + [early.bucket_synced.get(k, synced) for k in buckets])
        return cache[key]
    return ready


class _ScheduleRun:
    """One DP rank's TP schedule on its TP group (docs/design.md §6.3), operation by operation, in
    the schedule's order. Streams run in enqueue order, so a collective issued before a compute
    overlaps it; each compute waits for its group's gather, each apply for its group's scatter."""

    def __init__(self, ctx: Context, members: Sequence[int], schedule: TPSchedule) -> None:
        self.ctx, self.members, self.schedule = ctx, list(members), schedule
        self.gathered: dict[int, dict[int, simpy.Event]] = {}
        self.computed: dict[int, dict[int, simpy.Event]] = {}
        self.scattered: dict[int, dict[int, simpy.Event]] = {}
        self.applied: dict[int, list[simpy.Event]] = {r: [] for r in members}
        self.early = False  # gathers, computes and scatters issued before the step check (overlap_step)
        # the groups each COMPUTE batches together (TP 1: consecutive groups, as the runtime's executor)
        self.windows = compute_windows(schedule.groups, 0, ctx.batching)
        self.saving = {r: 0.0 for r in members}

    def issue(self, op, begin: dict[int, simpy.Event]) -> None:
        """A gather, compute or scatter (applies: `apply`), its group's inputs ready at `begin`."""
        ctx, eng, members = self.ctx, self.ctx.engine, self.members
        group = self.schedule.groups[op.group]
        if op.kind == GATHER:
            self.gathered[op.group] = _exchange(ctx, members, group.gather, begin)
        elif op.kind == COMPUTE:
            after = self.gathered.get(op.group, begin)
            self.computed[op.group] = {}
            for t, r in enumerate(members):
                if op.group in self.windows:  # a window's first group: what batching saves over the window
                    self.saving[r] = batching_saving(ctx, [task for g in self.windows[op.group]
                                                           for task in self.schedule.groups[g].hosted(t)])
                # the plan's seconds at fp32, less what the run's dtypes save (without masters)
                load = group.loads[t] - ctx.dtype_saving(group.hosted(t))
                seconds = max(load - self.saving[r], 0.0)
                self.saving[r] -= load - seconds  # the rest comes off the window's next groups
                self.computed[op.group][r] = eng.compute(r, f"group {op.group} compute", seconds, [after[r]])
        elif op.kind == SCATTER:
            self.scattered[op.group] = _exchange(ctx, members, group.scatter, self.computed[op.group])

    def apply(self, op, commit: dict[int, simpy.Event] | None = None) -> None:
        """Every TP rank applies the group's update to its shards: where the schedule says (inside
        the host's task cost, or after the scatter), or, with `commit` (an overlapped step), as one
        pass over its shards once the step check is done."""
        eng, members = self.ctx.engine, self.members
        group = self.schedule.groups[op.group]
        # one memory-bound pass: read the shard and the update chunk, write the shard, in fp32 beside
        # masters, in the parameters' dtype without
        apply_s = group.apply_numel * APPLY_PASSES * self.ctx.memory.update_bytes / self.ctx.rate.hbm_bytes_per_s \
            + self.ctx.rate.launch_s
        if commit is not None:
            for r in members:
                after = [commit[r], self.computed[op.group][r]]
                if op.group in self.scattered:
                    after.append(self.scattered[op.group][r])
                self.applied[r].append(eng.compute(r, f"group {op.group} apply", apply_s, after))
        elif group.scatter is None:  # where the computing rank applies: inside the task's cost
            self.applied.update({r: self.applied[r] + [self.computed[op.group][r]] for r in members})
        else:  # scattered chunks: every TP rank adds its chunks to its shards (memory-bound)
            for r in members:
                self.applied[r].append(eng.compute(r, f"group {op.group} apply", apply_s,
                                                   [self.scattered[op.group][r]]))


def batching_saving(ctx: Context, hosted: Sequence[Task]) -> float:
    """Seconds `batch_kernels` saves on a host's matrices of one micro-group: per batch of `k`
    same-shape matrices (`canzona.batching`), `k` matrices' kernels less the batched ones
    (`DeviceRate.batched_seconds`: one launch per GEMM, tiles filling the waves together)."""
    if not ctx.batching:
        return 0.0
    saving = 0.0
    for batch in shape_batches(hosted, True):
        if len(batch) > 1:
            saving += ctx.batch_saving(tuple(batch[0].shape), len(batch))
    return max(saving, 0.0)


def _exchange(ctx: Context, members: Sequence[int], exchange: Exchange,
              after: dict[int, simpy.Event]) -> dict[int, simpy.Event]:
    """One collective of the TP group, priced from the schedule's bytes."""
    if exchange.op == ALL_TO_ALL:
        send = [float(exchange.bytes_out(t)) for t in range(ctx.tp)]
        recv = [float(exchange.bytes_in(t)) for t in range(ctx.tp)]
        cost = all_to_all_cost(send, recv, ctx.cluster.tp_geometry(), ctx.hw)
    else:  # all-gather: the collective model takes the gathered total
        full = exchange.bytes_in(0) + max(exchange.sent[0])
        cost = collective_cost("all-gather", full, ctx.cluster.tp_geometry(), ctx.hw)
    record = ({r: (exchange.op, TP_GROUP, exchange.name, exchange.record(t)) for t, r in enumerate(members)}
              if ctx.runtime_mode else None)
    return ctx.engine.collective(exchange.name, members, cost, ctx.tp_stream, {r: [after[r]] for r in members},
                                 record=record)
