"""FSDP2 / ZeRO-3 and HSDP in the simulator (docs/design.md §2.8): one iteration of a layout whose
parameters, gradients and optimizer state are sharded over a shard group of S ranks (HSDP: R
replicas of it, DP = R x S), under one of `canzona.step_policies.FSDP_POLICIES`, alone or composed
with TP as torchtitan composes them (`--tp T`: `parallelize_module` over the TP dimension, then
`fully_shard` over DP).

Phase A (forward / backward, identical on every rank, simulated on rank 0): per FSDP unit (one
decoder layer; the root unit holds the embedding, the final norm and the head) the bf16 parameters
are all-gathered before the unit's forward and again before its backward (FSDP2 reshards after
forward; with `reshard_after_forward=False` they stay gathered from the forward to the backward,
which gathers nothing), one unit ahead of the compute (FSDP2's prefetch: at most two units
unsharded); each
unit's gradient is reduce-scattered after its backward (every micro-batch, FSDP2's default), and
under HSDP the reduced shard is all-reduced over the replicate group after the last micro-batch's.
Under TP the layers' compute is the ZeRO-1 layout's at that TP (`micro_batch_work`, its blocks with
their sequence-parallel all-gathers and reduce-scatters over the TP group) and the FSDP collectives
run over each TP rank's DP shard group on its TP-local parameters (`ParamSpec.local_numel`).

Phase B (the step, simulated on every rank of one exchange group: the shard group, under TP its
S x T ranks, as the runtime's): each micro-group under owner policies goes to its owners (among the
exchange group's ranks) by one variable-size all-to-all of the gradient pieces, is computed by
them, and comes back by one all-to-all of the update pieces; under gather-all every rank
all-gathers the unit's full gradients and computes them all. Micro-groups are pipelined: the next
one's exchange runs under this one's compute. A rank's piece of a TP-sharded matrix is 1 / (S x T)
of it; of a TP-replicated one 1 / S, sent by the lowest TP rank holding it (the runtime's dedup) and
its update received by every TP rank."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import simpy

from canzona.batching import shape_batches
from canzona.cost import (
    DeviceRate,
    adamw_kernels,
    elementwise_kernel,
    gradient_norm_kernels,
    state_bytes,
)
from canzona.decoder import Architecture
from canzona.errors import SpecError
from canzona.experts import dense_part, expert_part
from canzona.fsdp_collectives import ALL_GATHER, exchange_bytes, fsdp_step_collectives
from canzona.fsdp_plan import (
    MAX_OWNER_GROUPS,
    ROOT,
    FsdpMatrix,
    FsdpRankBytes,
    FsdpUnit,
    backward_order,
    check_hsdp,
    check_owner_plan_settings,
    fsdp_matrices,
    fsdp_persistent_memory,
    fsdp_policy,
    fsdp_units,
    owner_micro_groups,
    stacked_experts_refusal,
)
from canzona.fsdp_plan import owner_plan_defaults as policy_plan_defaults
from canzona.hardware import HardwareProfile
from canzona.memory import (
    LayerDims,
    LayoutMemory,
    MemorySetup,
    RankMemory,
    activation_bytes,
    batched_stack_bytes,
    kernel_workspace_bytes,
    state_saving_bytes,
)
from canzona.optimizers import default_config, matrix_optimizer
from canzona.pipeline import stage_spec
from canzona.plan import DEFAULT_GEOMETRY, PLAN_DEFAULTS, Plan, plan_for
from canzona.recompute import (
    MEGATRON_CHECKPOINT,
    SELECTIVE_LAYER,
    TORCH_CHECKPOINT,
    forward_without_grad,
    inside_layers,
    layout_recompute_modes,
    rerun_stops_early,
)
from canzona.spec import ModelSpec, Role
from canzona.step_collectives import RUNTIME_STYLE
from canzona.step_options import STEP_DEFAULTS
from canzona.step_policies import (
    FSDP_POLICIES,
)
from sim.collectives import CollectiveCost, collective_cost, matrix_all_to_all_cost
from sim.engine import Engine
from sim.ep_dispatch import dispatcher_sms, ep_costs
from sim.fp8 import fp8_setup
from sim.fsdp_copies import FSDP2, check_fsdp_impl, copy_in_bytes, copy_out_bytes
from sim.iteration import APPLY_PASSES, DtypeSavings
from sim.model_work import Block, MicroBatchWork, micro_batch_work
from sim.streams import DP_COMM, EP_COMM, TP_COMM
from sim.topology import Cluster

AG_STREAM, RS_STREAM = "fsdp-all-gather", "fsdp-reduce-scatter"  # FSDP2's two communication streams
# the activation recompute modes an FSDP layout is simulated with (the search's FSDP recompute axis
# reads them here): every mode of `canzona.recompute` (`layout_recompute_modes`), each a
# checkpoint policy of torch's non-reentrant checkpoint wrapper as torchtitan and NeMo AutoModel
# apply them per decoder layer; Megatron's --recompute-method is not among them (`SimConfig.check`)
FSDP_RECOMPUTE_MODES: tuple[str, ...] = layout_recompute_modes(fsdp=True)


def fsdp_recompute_modes(impl: str) -> tuple[str, ...]:
    """The modes of `FSDP_RECOMPUTE_MODES` a layout of FSDP implementation `impl` runs: every one
    under FSDP2 (torchtitan's and NeMo AutoModel's wrappers); under Megatron-FSDP not torchtitan's
    selective-layer (every K-th layer checkpointed), which neither framework that runs
    Megatron-FSDP offers: Megatron-LM's recompute is --recompute-granularity full / selective with
    --recompute-method uniform / block (megatron/training/arguments.py), and NeMo AutoModel's
    `activation_checkpointing` is one switch for every layer (docs/guides/gradient_checkpointing.md,
    NVIDIA-NeMo/Automodel, for its FSDP2 and Megatron-FSDP managers alike)."""
    if check_fsdp_impl(impl) == FSDP2:
        return FSDP_RECOMPUTE_MODES
    return tuple(m for m in FSDP_RECOMPUTE_MODES if m != SELECTIVE_LAYER)


def fsdp_checkpoint(impl: str) -> str:
    """Whose checkpoint re-runs an FSDP layout's recomputed layers (`canzona.recompute`): under
    FSDP2, torchtitan's and NeMo AutoModel's wrappers, torch's non-reentrant one (which stops
    early); under Megatron-FSDP, Megatron-LM's and Megatron-Bridge's `CheckpointFunction` (the
    whole forward again). NeMo AutoModel's Megatron-FSDP manager wraps layers in torch's, which
    this prices whole: conservative there."""
    return TORCH_CHECKPOINT if check_fsdp_impl(impl) == FSDP2 else MEGATRON_CHECKPOINT


def fsdp_forward_without_grad(cfg) -> bool:
    """Whether an FSDP layout's checkpointed layers run their first forward without autograd:
    under Megatron's checkpoint (`fsdp_checkpoint`: Megatron-FSDP's) with full recompute
    (`canzona.recompute.forward_without_grad`); torch's non-reentrant wrapper keeps grad on."""
    return (fsdp_checkpoint(cfg.fsdp_impl) == MEGATRON_CHECKPOINT
            and forward_without_grad(cfg.options.recompute))


def check_fsdp(cfg, cluster: Cluster, spec: ModelSpec) -> int:
    """The FSDP layout of `cfg` is one the simulator runs; returns the shard size S. One SpecError
    (one line) otherwise."""
    if not cfg.fsdp:
        return check_hsdp(False, cluster.dp, cfg.hsdp_replicate)
    if cfg.tp > 1 and any(p.role in (Role.EXPERT, Role.ROUTER) for p in spec.params):
        raise SpecError(f"--fsdp with --tp {cfg.tp} is simulated for dense models; {spec.name!r} has experts "
                        "(run it at --tp 1)")
    policy = fsdp_policy(cfg.optimizer, cfg.policy)
    if cfg.ep > 1:
        if policy is not None:
            raise SpecError(f"--fsdp with --ep is simulated with an elementwise optimizer (adamw); got "
                            f"{cfg.optimizer}")
        if cfg.etp > 1 or cfg.hsdp_replicate > 1:
            raise SpecError(f"--fsdp with --ep is simulated at etp 1 without HSDP (got etp {cfg.etp}, "
                            f"hsdp-replicate {cfg.hsdp_replicate})")
        if cfg.router_imbalance != 1.0:
            raise SpecError("--fsdp with --ep is simulated without a persistent router skew (no --router-imbalance; "
                            "--routing prices the random routing)")
    if policy is not None and spec.stacks:
        # FsdpOptimizer refuses stacked parameters; priced, the step ran the matrix optimizer on
        # every expert matrix while the memory kept AdamW's moments of the stacks
        raise SpecError(f"--fsdp: {stacked_experts_refusal(cfg.optimizer, spec.stacks[0].name)}")
    if cfg.options.overlap_step:
        raise SpecError("--fsdp runs without --overlap-step")
    if cfg.options.recompute not in FSDP_RECOMPUTE_MODES:
        raise SpecError(f"--fsdp runs --recompute {' / '.join(FSDP_RECOMPUTE_MODES)}, got {cfg.options.recompute!r}")
    if cfg.options.recompute not in fsdp_recompute_modes(cfg.fsdp_impl):
        raise SpecError(f"--recompute {cfg.options.recompute} is torchtitan's, over FSDP2: neither Megatron-LM nor NeMo "
                        f"AutoModel runs it under --fsdp-impl {cfg.fsdp_impl} (Megatron's partial checkpointing is "
                        "--recompute full --recompute-method block, a ZeRO-1 layout's)")
    # options of the ZeRO-1 layout that would change nothing here, refused rather than echoed back
    if not cfg.options.overlap_grad_reduce:
        raise SpecError("--no-overlap-grad-reduce is the distributed optimizer's (ZeRO-1) bucket overlap: under --fsdp "
                        "each unit's gradients are reduce-scattered on FSDP's own stream as its backward ends (torch's "
                        "fully_shard has no switch to hold them back), as the simulator runs them")
    if not cfg.options.overlap_param_gather:
        raise SpecError("--no-overlap-param-gather is the distributed optimizer's (ZeRO-1) step overlap: under --fsdp "
                        "each unit's parameters are all-gathered one unit ahead of its compute (FSDP's prefetch), as "
                        "the simulator runs them")
    if not cfg.zero1_fallback:
        raise SpecError("--no-zero1-fallback is for the ZeRO-1 layout: under --fsdp canzona's owners have no ZeRO-1 "
                        "fallback to report")
    _check_zero1_step_options(cfg)
    # before the run plans its owners; AdamW's (policy None) has none, and its other settings have
    # their own rule (SimConfig._check_elementwise_settings)
    check_owner_plan_settings(policy, cfg.settings)
    shard = check_hsdp(True, cluster.dp, cfg.hsdp_replicate)
    if cfg.pp > 1:  # after the shard group's check: a stage's DP of 1 is FSDP's refusal, whatever the PP
        _check_pipeline(cfg, cluster)
    check_fsdp_impl(cfg.fsdp_impl)
    if policy is not None and len(spec.matrix_params()) < 1:
        raise SpecError(f"model {spec.name!r} has no matrices for a matrix optimizer")
    return shard


def _check_pipeline(cfg, cluster: Cluster) -> None:
    """FSDP2 under PP as the simulator runs it (sim.fsdp_pipeline): torchtitan's 1F1B schedule over
    torch's FSDP2, without a virtual pipeline, EP or HSDP; torch's `Schedule1F1B` needs as many
    micro-batches as stages. One SpecError (one line) otherwise."""
    if cfg.vp > 1 or cfg.ep > 1 or cfg.hsdp_replicate > 1 or cfg.fsdp_impl != FSDP2:
        raise SpecError(f"--fsdp with --pp {cfg.pp} is simulated as torchtitan runs it with torch's 1F1B schedule, "
                        f"under --fsdp-impl {FSDP2}, without --vp, --ep or --hsdp-replicate (got vp {cfg.vp}, "
                        f"ep {cfg.ep}, hsdp-replicate {cfg.hsdp_replicate}, fsdp-impl {cfg.fsdp_impl})")
    m = cfg.workload.micro_batches(cluster.dp)
    if m < cfg.pp:
        raise SpecError(f"--fsdp with --pp {cfg.pp}: {m} micro-batches per DP rank, fewer than the stages (torch's "
                        "Schedule1F1B needs at least one a stage): raise --global-batch or lower --micro-batch")


def _check_zero1_step_options(cfg) -> None:
    """`DistributedOptimizer`'s options of the ZeRO-1 layout that `FsdpOptimizer`
    (canzona.runtime.fsdp) takes and does nothing with: FSDP2 reduce-scatters the gradients, the
    owners are planned over the exchange group at TP 1 with whole matrices
    (`canzona.fsdp_plan.fsdp_matrices`: no segments, no TP schedule) and the step's micro-groups are
    each owner's matrices cut by cost (`owner_micro_groups`), which no capacity sizes and no TP mode
    orders, and no expert buckets are sized (`--expert-buckets`). Each set off its default is one
    SpecError; named at its default it is accepted."""
    if cfg.options.reduce_scatter != STEP_DEFAULTS.reduce_scatter:
        raise SpecError(f"--reduce-scatter {cfg.options.reduce_scatter} is the distributed optimizer's (ZeRO-1) "
                        "gradient reduce-scatter: under --fsdp torch's fully_shard reduce-scatters each unit's "
                        "gradients itself (FsdpOptimizer has no reduce_scatter to run), as the simulator runs them")
    if cfg.geometry != DEFAULT_GEOMETRY:
        raise SpecError(f"--geometry {cfg.geometry} chooses the ZeRO-1 layout's segments: under --fsdp every matrix "
                        "is whole at its one owner whatever the geometry (canzona.fsdp_plan.fsdp_matrices)")
    if cfg.tp_policy != PLAN_DEFAULTS.tp_policy:
        raise SpecError(f"--tp-policy {cfg.tp_policy} schedules the ZeRO-1 layout's TP micro-groups: under --fsdp the "
                        "owners are planned over the exchange group at TP 1 and each computes its matrices whole "
                        "(canzona.fsdp_plan.fsdp_matrices), with no TP schedule")
    if cfg.tp_mode != STEP_DEFAULTS.tp_mode:
        raise SpecError(f"--tp-mode {cfg.tp_mode} orders the ZeRO-1 layout's TP micro-groups: under --fsdp the step's "
                        "micro-groups are the owners' all-to-all exchanges (canzona.fsdp_plan.owner_micro_groups), "
                        "pipelined one ahead, with no TP mode")
    if cfg.expert_buckets != PLAN_DEFAULTS.expert_buckets:
        raise SpecError(f"--expert-buckets {cfg.expert_buckets} sizes the ZeRO-1 layout's buckets of stacked expert "
                        "matrices: under --fsdp the experts are sharded with their units and each rank steps its own "
                        "shards, with no expert buckets to size")
    if cfg.capacity != PLAN_DEFAULTS.capacity:
        raise SpecError(f"--capacity sizes the ZeRO-1 layout's TP micro-groups: under --fsdp the step's micro-groups "
                        f"are each owner's matrices cut by cost into at most {MAX_OWNER_GROUPS} "
                        "(canzona.fsdp_plan.owner_micro_groups), which no capacity sizes")


def owner_plan_defaults(optimizer: str, policy: str) -> dict[str, object]:
    """`canzona.fsdp_plan.owner_plan_defaults` of the FSDP `policy` by name under `optimizer` (empty
    for AdamW's, which has no owner plan): what `compare` runs a baseline with beside canzona at the
    settings given (`sim.simulate.with_policy`)."""
    step = fsdp_policy(optimizer, policy)
    return {} if step is None else policy_plan_defaults(step)


# --- one definition each, for the run (`_FsdpRun`) and the search's floors (`sim.search`) ------------


def unit_elements(spec: ModelSpec, tp: int, ep: int) -> tuple[dict[int, int], dict[int, int]]:
    """Each FSDP unit's elements on one TP rank (TP-sharded parameters' 1 / T): what FSDP shards
    over S; under EP its experts apart: an EP rank's experts / ep of each stack, FSDP'd over the
    EDP group. Keyed by unit (`ROOT` or the decoder layer)."""
    local: dict[int, int] = {}
    expert_local: dict[int, int] = {}
    for p in spec.params:
        key = ROOT if p.layer is None else p.layer
        local.setdefault(key, 0)
        expert_local.setdefault(key, 0)
        if ep > 1 and p.role is Role.EXPERT:
            expert_local[key] += p.numel // ep
        else:
            local[key] += p.local_numel(tp)
    return local, expert_local


def gathered_elements(local: dict[int, int], expert_local: dict[int, int], edp: int) -> dict[int, int]:
    """Each unit's elements one all-gather unshards: its experts' too where they are FSDP'd (EDP >
    1; at EDP 1 they stay whole in place, their gradients the persistent ones)."""
    return {k: local[k] + (expert_local[k] if edp > 1 else 0) for k in local}


def in_flight_bytes(gathered: dict[int, int], reshard_after_forward: bool, param_bytes: int, grad_bytes: int) -> int:
    """The transient bytes beside the activations: with reshard after forward at most two units
    gathered (the prefetch); without it every unit's gathered parameters are held from its forward
    to its backward, all of them at the backward's start; beside the largest unit's unsharded
    gradient."""
    largest = max(gathered.values())
    held = 2 * largest if reshard_after_forward else sum(gathered.values())
    return held * param_bytes + largest * grad_bytes


def pipeline_in_flight_bytes(gathered: dict[int, int], param_bytes: int, grad_bytes: int) -> int:
    """The transient bytes beside a stage's activations under torch's pipelining: every unit's
    gathered parameters and unsharded gradient, held from the stage's first backward to the
    reductions after its last (sim.fsdp_pipeline)."""
    return sum(gathered.values()) * (param_bytes + grad_bytes)


def copy_seconds(cfg, rate: DeviceRate, gathered: dict[int, int]) -> tuple[dict[int, float], dict[int, float]]:
    """The implementation's copies on the compute stream (sim.fsdp_copies), per unit, before the
    engine's slowdown: after each all-gather of its parameters (copy-out), and before each
    reduce-scatter of its gradients (copy-in)."""
    wl = cfg.workload

    def seconds(nbytes: int, numel: int) -> float:
        return rate.kernel_seconds(elementwise_kernel("fsdp copy", numel, 0.0, nbytes / numel)) \
            if nbytes and numel else 0.0

    out = {k: seconds(copy_out_bytes(cfg.fsdp_impl, n, wl.param_bytes), n) for k, n in gathered.items()}
    into = {k: seconds(copy_in_bytes(cfg.fsdp_impl, n, wl.param_bytes, wl.grad_bytes), n) for k, n in gathered.items()}
    return out, into


def fsdp_micro_batch_work(cfg, model: tuple[ModelSpec, Architecture], cluster: Cluster, hw: HardwareProfile,
                          rate: DeviceRate, head_dim: int, stage: int = 0) -> MicroBatchWork:
    """One micro-batch's kernels on a rank of an FSDP layout (`micro_batch_work` at the layout's TP
    and EP, the whole model; under PP pipeline stage `stage`'s part, `model` its stage's spec: the
    head on the last stage only). FP8 under FSDP: the weights are gathered again for every
    micro-batch, so each is cast to FP8 for every micro-batch (no cache across them). The
    re-run of a checkpointed layer stops early under torch's checkpoint (`fsdp_checkpoint`,
    `canzona.recompute.rerun_stops_early`). `head_dim`: the attention heads' dimension (`LayerDims.head_dim`)."""
    spec, arch = model
    wl = cfg.workload
    o = cfg.options
    fp8 = fp8_setup(wl, hw, cluster, spec)
    # torchtitan's selective-layer: every K-th layer in a checkpoint wrapper (canzona.recompute)
    inside = inside_layers(o.recompute, o.recompute_method, o.recompute_num_layers, o.selective_ac_option,
                           cfg.chunks(arch.layers, stage))
    return micro_batch_work(spec, cluster.tp, wl.tokens_per_micro_batch, wl.seq_len, arch.q_dim,
                            arch.hidden, arch.vocab, rate, recompute=o.recompute, checkpointed=inside,
                            causal=wl.causal, dtype=wl.dtype, head=stage == cfg.pp - 1, experts=arch.moe,
                            ep=cfg.ep, kv_dim=arch.kv_dim, head_dim=head_dim,
                            fp8=None if fp8 is None else replace(fp8, micro_batches=1),
                            attention_backend=cfg.options.attention_backend,
                            kernels=wl.kernels, dispatcher=cfg.options.ep_dispatcher,
                            cross_entropy=wl.cross_entropy, apply_rope_fusion=wl.apply_rope_fusion,
                            bias_activation_fusion=wl.bias_activation_fusion,
                            early_stop=rerun_stops_early(fsdp_checkpoint(cfg.fsdp_impl)),
                            torch_loss=cfg.loss_autograd, loss_bytes=wl.loss_bytes)


class _FsdpRun:
    def __init__(self, cfg, model: tuple[ModelSpec, Architecture], cluster: Cluster, hw: HardwareProfile,
                 shard: int) -> None:
        self.cfg, self.cluster, self.hw, self.shard = cfg, cluster, hw, shard
        self.spec, self.arch = model
        self.policy = fsdp_policy(cfg.optimizer, cfg.policy)  # None: AdamW, each rank steps its shards
        self.rate = DeviceRate.from_profile(hw)
        self.wl = cfg.workload
        # a job waits for its slowest GPU (canzona.variability); communication kernels take SMs from compute (sim.comm_sms)
        self.engine = Engine(slowdown=cfg.slowdown(hw, cluster.gpus), sms=hw.gpu.sms)
        self.tp = cluster.tp
        self.size = shard * self.tp  # the exchange group: the shard group's DP ranks x TP (the runtime's)
        self.ep = cfg.ep
        if self.policy is None:  # no matrix has an owner; the plan reported is ZeRO-1's over the shard group
            self.matrices: dict[str, FsdpMatrix] = {}
            self.plan = plan_for(self.spec, self.size, 1, cfg.optimizer, cfg.policy, cfg.settings, cfg.planning_costs(hw),
                                 ep=self.ep, hidden=self.arch.hidden, matrix_config=cfg.matrix_config)
        else:
            self.matrices, self.plan = fsdp_matrices(self.spec, self.size, cfg.optimizer, self.policy, cfg.settings,
                                                     cfg.planning_costs(hw), matrix_config=cfg.matrix_config)
        self.units = fsdp_units(self.spec, self.matrices)
        self.local, self.expert_local = unit_elements(self.spec, self.tp, self.ep)
        self.edp = cluster.dp * self.tp // self.ep  # the DP ranks outside EP, over which the experts are sharded
        if self.ep > 1:
            experts = cfg.expert_cluster(cluster)  # the GPUs in expert order: EP groups, EDP groups
            self.experts_cluster, self.edp_geo = experts, experts.dp_geometry()
        # matrices TP replicates: a piece of 1 / S, held alike by a DP rank's TP ranks (sent by the lowest)
        self.replicated = {m for m in self.matrices if self.tp > 1 and self.spec.param(m).tp_dim is None}
        # TP rank 0's shard group and replicas (Megatron order: TP fastest, then DP); replica 0's exchange group
        self.shard_geo = cluster.geometry([cluster.rank(i, 0) for i in range(shard)])
        self.replicate_geo = cluster.geometry([cluster.rank(k * shard, 0) for k in range(cfg.hsdp_replicate)])
        self.members = list(range(self.size))
        self.exchange_geo = cluster.geometry(self.members)
        self.stalls: list[float] = []
        # the rank phase A is simulated on: 0 (it stands for every rank); under PP each stage's first
        # (sim.fsdp_pipeline), which share one engine
        self.rank_a = 0
        # by shape, what the run's dtypes (bf16 without masters) take off the plan's fp32-priced
        # seconds (`compute_seconds`)
        self.dtype_savings = DtypeSavings(self.rate, cfg.optimizer, MemorySetup.dtypes_of(self.wl).step_dtypes,
                                          cfg.matrix_config)
        self.copy_out_s, self.copy_in_s = copy_seconds(cfg, self.rate, self.gathered_elements())

    def gathered_elements(self) -> dict[int, int]:
        """Each unit's elements one all-gather unshards (`gathered_elements`)."""
        return gathered_elements(self.local, self.expert_local, self.edp)

    def piece(self, m: FsdpMatrix) -> int:
        """The elements of member's piece of `m`: 1 / (S x T) of a TP-sharded matrix, 1 / S of a
        TP-replicated one."""
        return -(-m.numel // self.shard) if m.name in self.replicated else -(-m.numel // self.size)

    # --- phase A ----------------------------------------------------------------------------

    def rs_cost(self, unit: FsdpUnit) -> CollectiveCost:
        """The reduce-scatter of `unit`'s gradients over the shard group (phase A's, at PP 1 after each
        micro-batch, under PP once after the stage's last backward: sim.fsdp_pipeline)."""
        return collective_cost("reduce-scatter", self.local[unit.key] * self.wl.grad_bytes, self.shard_geo, self.hw)

    def _collective_a(self, name: str, cost: CollectiveCost, stream: str, after: list[simpy.Event],
                      sms: int | None = None) -> simpy.Event:
        """One collective of phase A on the rank it is simulated on (`rank_a`); its done event."""
        return self.engine.collective(name, [self.rank_a], cost, stream, {self.rank_a: after}, sms=sms)[self.rank_a]

    def _gather(self, name: str, unit: FsdpUnit, after: list[simpy.Event]) -> simpy.Event:
        cost = collective_cost("all-gather", self.local[unit.key] * self.wl.param_bytes, self.shard_geo, self.hw)
        done = self._collective_a(name, cost, AG_STREAM, after)
        if self.expert_local[unit.key] and self.edp > 1:  # the experts' own fully_shard, over the EDP group
            cost = collective_cost("all-gather", self.expert_local[unit.key] * self.wl.param_bytes, self.edp_geo,
                                   self.hw)
            done = self.engine.env.all_of([done, self._collective_a(f"{name} experts", cost, AG_STREAM, after)])
        return done

    def _probe(self, before: simpy.Event, wanted: simpy.Event):
        yield before
        t0 = self.engine.now
        yield wanted
        self.stalls.append(self.engine.now - t0)

    def _unit_compute(self, name: str, blocks: Sequence[Block], last: simpy.Event, gathered: simpy.Event,
                      gathers_input: int, copy_s: float = 0.0, no_grad: bool = False) -> simpy.Event:
        """The unit's blocks after `last` and its gather, the gather's copy-out (`copy_s`) first;
        `no_grad`: a forward without autograd (`_tp_block`)."""
        self.engine.env.process(self._probe(last, gathered))
        if self.tp == 1 and not any(b.ep_bytes or b.recompute for b in blocks):
            return self.engine.compute(self.rank_a, name, copy_s + sum(b.seconds for b in blocks), [last, gathered])
        if copy_s:
            last = gathered = self.engine.compute(self.rank_a, f"{name} all-gather copy-out", copy_s, [last, gathered])
        if self.tp == 1:  # expert parallelism: each expert block between its dispatch and combine all-to-alls
            last = self.engine.env.all_of([last, gathered])
            for b in blocks:
                label = f"{name}.{b.name.rsplit('.', 1)[-1]}"
                if b.recompute is not None:  # full recompute: the forward block again first, with its collectives
                    last = self._expert_pass(f"{label} recompute", b.recompute, last)
                last = self._expert_pass(label, b, last)
            return last
        last = self.engine.env.all_of([last, gathered])
        for b in blocks:
            last = self._tp_block(f"{name}.{b.name.rsplit('.', 1)[-1]}", b, gathers_input, last, no_grad)
        return last

    def _expert_pass(self, label: str, b: Block, last: simpy.Event) -> simpy.Event:
        """Block `b` on rank 0 at TP 1 after `last`: an expert block between its dispatch and
        combine (on the EP stream, as `sim.iteration._Stage.block`), any other its compute alone."""
        if not b.ep_bytes:
            return self.engine.compute(self.rank_a, label, b.seconds, [last])
        dispatch, combine = ep_costs(b.ep_bytes, b.ep_received, b.ep_flex, self.experts_cluster, self.hw,
                                     b.ep_meta)
        held = dispatcher_sms(b.ep_flex)  # the flex kernel's own SMs; None: NCCL's
        last = self._collective_a(f"{label} dispatch", dispatch, EP_COMM, [last], sms=held)
        last = self.engine.compute(self.rank_a, label, b.seconds, [last])
        if not b.sends_output:  # a re-run stopped before its combine (torch's early stop)
            return last
        return self._collective_a(f"{label} combine", combine, EP_COMM, [last], sms=held)

    def _tp_block(self, name: str, b: Block, gathers_input: int, last: simpy.Event,
                  no_grad: bool = False) -> simpy.Event:
        """A sequence-parallel block on rank 0 (TP > 1) as the ZeRO-1 layout runs it
        (`sim.iteration._Stage.block`): all-gather(s) of the input over the TP group, the GEMMs, a
        reduce-scatter of the output; overlapped as Transformer Engine's TP communication overlap
        does (`tp_comm_overlap`), or in series. `no_grad`: the first forward of a layer inside
        Megatron's checkpoint (`canzona.recompute.forward_without_grad`, Megatron-FSDP's
        `fsdp_checkpoint`), where TE's LayerNormLinear gathers its input with NCCL before its
        GEMMs even under the overlap; the re-run has grad."""
        eng = self.engine
        if b.recompute is not None:  # full recompute (torchtitan's checkpoint wrapper): the forward block again first
            last = self._tp_block(f"{name} recompute", b.recompute, 1, last)
        if not b.tp_collectives:
            return eng.compute(self.rank_a, name, b.seconds, [last])
        if not self.cfg.options.tp_comm_overlap:
            for _ in range(gathers_input):
                last = self._collective_a(f"{name} tp all-gather", self.tp_ag, TP_COMM, [last])
            last = eng.compute(self.rank_a, name, b.seconds, [last])
            if not b.sends_output:  # a re-run stopped before its row GEMMs (torch's early stop)
                return last
            return self._collective_a(f"{name} tp reduce-scatter", self.tp_rs, TP_COMM, [last])
        if no_grad:  # TE's LayerNormLinear turns its userbuffers all-gather off without grad
            for _ in range(gathers_input):
                last = self._collective_a(f"{name} tp all-gather", self.tp_ag, TP_COMM, [last])
            gathers_input = 0
        gathered = last
        for _ in range(gathers_input):
            gathered = self._collective_a(f"{name} tp all-gather", self.tp_ag, TP_COMM, [gathered])
        last = eng.compute(self.rank_a, f"{name} first", b.first_s, [last])
        last = eng.compute(self.rank_a, f"{name} middle", b.middle_s, [last, gathered])
        if not b.sends_output:
            return last
        before_last = last
        last = eng.compute(self.rank_a, f"{name} last", b.last_s, [last])
        scattered = self._collective_a(f"{name} tp reduce-scatter", self.tp_rs, TP_COMM, [before_last])
        return eng.env.all_of([last, scattered])

    def _pass(self, name: str, units: Sequence[FsdpUnit], blocks: dict[int, Sequence[Block]], last: simpy.Event,
              gathers_input: int, then=None, gathered: bool = False,
              no_grad: Callable[[int], bool] | None = None) -> simpy.Event:
        """One pass over `units` in order: each unit's all-gather one unit ahead of its compute
        (issued once the unit two back is computed: at most two units unsharded), its compute after
        the previous unit's and its gather; `then(unit, computed)` after each compute. `gathered`:
        the units are still gathered (a backward without `reshard_after_forward`): no all-gather."""
        gathers: list[simpy.Event] = []
        computed: list[simpy.Event] = []
        for k in range(len(units) + 1):
            if k < len(units):
                freed = [computed[k - 2]] if k >= 2 else []
                gathers.append(self.engine.env.event().succeed() if gathered else
                               self._gather(f"{name} all-gather {_label(units[k])}", units[k], freed))
            if k >= 1:
                unit = units[k - 1]
                # no gather, no copy-out: a unit still gathered from its forward keeps its parameters
                last = self._unit_compute(f"{name} {_label(unit)}", blocks[unit.key], last, gathers[k - 1],
                                          gathers_input, 0.0 if gathered else self.copy_out_s[unit.key],
                                          no_grad is not None and no_grad(unit.key))
                computed.append(last)
                if then is not None:
                    then(unit, last)
        return last

    def micro_batch_work(self, head_dim: int, stage: int = 0) -> MicroBatchWork:
        """One micro-batch of this run's model (under PP its stage's, `stage`) on a rank
        (`fsdp_micro_batch_work`); sets the TP collectives' costs, as sim.iteration's."""
        wl = self.wl
        act = wl.tokens_per_micro_batch * self.arch.hidden * wl.activation_bytes
        self.tp_ag = collective_cost("all-gather", act, self.cluster.tp_geometry(), self.hw)
        self.tp_rs = collective_cost("reduce-scatter", act, self.cluster.tp_geometry(), self.hw)
        return fsdp_micro_batch_work(self.cfg, (self.spec, self.arch), self.cluster, self.hw, self.rate, head_dim,
                                     stage)

    def phase_a(self, head_dim: int) -> simpy.Event:
        """Forward and backward of every micro-batch on rank 0; the event: every gradient reduced.
        `head_dim`: the attention heads' dimension (`LayerDims.head_dim`), which the fused
        attention's efficiency depends on."""
        eng, wl, cfg = self.engine, self.wl, self.cfg
        work = self.micro_batch_work(head_dim)
        fwd = dict(zip(work.layer_ids, work.forward))
        bwd = dict(zip(work.layer_ids, work.backward))
        layers = [u for u in self.units if u.key != ROOT]
        root = next((u for u in self.units if u.key == ROOT), None)
        m = wl.micro_batches(self.cluster.dp)
        # inside Megatron's checkpoint (Megatron-FSDP's) a layer's first forward runs without grad
        without_grad = fsdp_forward_without_grad(cfg)

        def no_grad(layer: int) -> bool:  # a unit's key: its layer's id
            return without_grad and layer not in work.uncheckpointed

        last = eng.env.event().succeed()
        reduced: list[simpy.Event] = []
        rs_cost = {u.key: self.rs_cost(u) for u in self.units}
        ar_cost = {u.key: collective_cost("all-reduce", -(-self.local[u.key] // self.shard) * wl.grad_bytes,
                                          self.replicate_geo, self.hw) for u in self.units}
        expert_rs = {u.key: collective_cost("reduce-scatter", self.expert_local[u.key] * wl.grad_bytes, self.edp_geo,
                                            self.hw) for u in self.units if self.expert_local[u.key] and self.edp > 1}

        def reduce(unit: FsdpUnit, mb: int, after: simpy.Event) -> None:
            if self.copy_in_s[unit.key]:  # on the compute stream, before the next unit's backward
                after = eng.compute(self.rank_a, f"mb{mb} reduce-scatter copy-in {_label(unit)}", self.copy_in_s[unit.key],
                                    [after])
            done = self._collective_a(f"mb{mb} reduce-scatter {_label(unit)}", rs_cost[unit.key], RS_STREAM, [after])
            if unit.key in expert_rs:  # the experts' gradients over the EDP group (at EDP 1 they are whole)
                reduced.append(self._collective_a(f"mb{mb} reduce-scatter {_label(unit)} experts", expert_rs[unit.key], RS_STREAM, [after]))
            if cfg.hsdp_replicate > 1 and mb == m - 1:  # the replicas' all-reduce of the reduced shard
                done = self._collective_a(f"all-reduce {_label(unit)} over replicas", ar_cost[unit.key], RS_STREAM, [done])
            reduced.append(done)

        for mb in range(m):
            # the root's parameters (the embedding first) stay gathered through the micro-batch
            root_gathered = self._gather(f"mb{mb} fwd all-gather root", root, [last]) if root else last
            if root and self.copy_out_s[root.key]:
                root_gathered = eng.compute(self.rank_a, f"mb{mb} fwd all-gather copy-out root", self.copy_out_s[root.key],
                                            [last, root_gathered])
            if work.embed_forward_s:
                root_gathered = eng.compute(self.rank_a, f"mb{mb} fwd embedding", work.embed_forward_s, [root_gathered])
            last = self._pass(f"mb{mb} fwd", layers, fwd, eng.env.all_of([last, root_gathered]), 1,
                              no_grad=no_grad)
            last = eng.compute(self.rank_a, f"mb{mb} fwd head", work.head_forward_s, [last])
            last = eng.compute(self.rank_a, f"mb{mb} bwd head", work.head_backward_s, [last])
            # backward re-gathers each block's input for the weight gradients (sequence parallel)
            # without reshard_after_forward the layers are still gathered from their forward
            last = self._pass(f"mb{mb} bwd", list(reversed(layers)), bwd, last, 2,
                              lambda unit, done, mb=mb: reduce(unit, mb, done),
                              gathered=not cfg.reshard_after_forward)
            if work.embed_backward_s:
                last = eng.compute(self.rank_a, f"mb{mb} bwd embedding", work.embed_backward_s, [last])
            if root:
                reduce(root, mb, last)
        return eng.env.all_of(reduced + [last])

    # --- phase B ----------------------------------------------------------------------------

    def micro_groups(self) -> list[tuple[FsdpMatrix, ...]]:
        """The step's micro-groups, in order. Gather-all: one unit's matrices each, in backward
        order. Owners: `canzona.fsdp_plan.owner_micro_groups`, as the runtime runs them."""
        if self.policy is None:
            return []
        if self.policy.gathers_all:
            return [u.matrices for u in reversed(self.units) if u.matrices]
        return owner_micro_groups(backward_order(self.units))

    def compute_seconds(self, mats: Sequence[FsdpMatrix]) -> float:
        """One rank's compute of its matrices of a micro-group: owner policies batch same-shape
        matrices as the runtime does (`batch_kernels`, `canzona.batching`); gather-all runs each
        alone, as `muon_fsdp2` does. Each matrix's seconds are the plan's (priced at fp32), less
        what the run's dtypes save (`DeviceRate.dtype_saving`: bf16 passes without masters)."""
        total = sum(m.cost for m in mats)
        if self.dtype_savings.saves:
            for m in mats:  # one at a time, in order: the same sum to the last bit
                total -= self.dtype_savings(m.shape)
        if self.policy.gathers_all or not self.batching:
            return total
        for batch in shape_batches(mats, True):
            if len(batch) > 1:
                saving = self.rate.batch_saving(self.cfg.optimizer, tuple(batch[0].shape), len(batch),
                                                self.cfg.matrix_config)
                total -= max(saving, 0.0)
        return total

    @property
    def batching(self) -> bool:
        return self.cfg.options.batch_kernels and matrix_optimizer(self.cfg.optimizer).batchable

    def phase_b(self, start: simpy.Event) -> None:
        eng, wl, s = self.engine, self.wl, self.shard
        eng.phase = "B"
        ranks = self.members
        setup = MemorySetup.dtypes_of(wl)
        # the gradients exchanged, the updates sent and applied, the kept gradient shards and AdamW's
        # moments: FsdpOptimizer's grad_dtype and update_dtype, fp32 beside masters, else the
        # parameters' dtype (whatever the reduction's; Workload.master_weights)
        ub = setup.update_state_bytes
        total = sum(self.local.values())  # one TP rank's elements: its shard group holds them
        # each rank's own torch.chunk piece of its EP rank's experts (rank r: EDP member r // ep, as
        # `_persistent`): uneven where they do not divide by EDP, the fullest rank's step the slowest
        experts = expert_shard_elements(self.spec, self.ep, self.edp, setup) if self.ep > 1 else []
        pieces = {r: experts[r // self.ep] if experts else 0 for r in ranks}
        clip = self.cfg.options.max_grad_norm is not None

        def norm_s(r: int) -> float:
            return sum(self.rate.kernel_seconds(k) for k in gradient_norm_kernels(-(-total // s) + pieces[r], clip, ub))

        begin = self.step_check({r: eng.compute(r, "gradient norm", norm_s(r), [start]) for r in ranks})
        local_matrices = sum(self.spec.param(m).local_numel(self.tp) for m in self.matrices)

        def adamw_s(r: int) -> float:
            elementwise = -(-(total - local_matrices) // s) + pieces[r]
            return sum(self.rate.kernel_seconds(k) for k in adamw_kernels(elementwise, default_config("adamw"), ub))

        done = [eng.compute(r, "adamw step", adamw_s(r), [begin[r]]) for r in ranks]
        groups = self.micro_groups()
        nodes = [self.cluster.node_of(r) for r in ranks]
        gathered: list[dict[int, simpy.Event]] = []
        computed: list[dict[int, simpy.Event]] = []

        def gather(g: int) -> None:
            mats = groups[g]
            after = {r: [begin[r]] + ([computed[g - 2][r]] if g >= 2 else []) for r in ranks}
            if self.policy.gathers_all:
                cost = collective_cost("all-gather", sum(x.numel for x in mats) * ub, self.exchange_geo, self.hw)
            else:
                cost = matrix_all_to_all_cost(self.to_owners(mats, ub), nodes, self.exchange_geo, self.hw)
            gathered.append(eng.collective(f"group {g} gather", ranks, cost, DP_COMM, after))

        if groups:
            gather(0)
        for g, mats in enumerate(groups):
            if g + 1 < len(groups):
                gather(g + 1)
            computed.append({r: eng.compute(r, f"group {g} compute", self.compute_seconds(
                [x for x in mats if x.owner in (None, r)]), [gathered[g][r]]) for r in ranks})
            applied_after = computed[g]
            if not self.policy.gathers_all:
                cost = matrix_all_to_all_cost(self.from_owners(mats, ub), nodes, self.exchange_geo, self.hw)
                applied_after = eng.collective(f"group {g} scatter", ranks, cost, DP_COMM,
                                               {r: [computed[g][r]] for r in ranks})
            shard_numel = -(-sum(self.spec.param(x.name).local_numel(self.tp) for x in mats) // s)
            # the shards and updates in fp32 beside masters, in the parameters' dtype without (as ZeRO-1's)
            apply_s = shard_numel * APPLY_PASSES * ub / self.rate.hbm_bytes_per_s + self.rate.launch_s
            done += [eng.compute(r, f"group {g} apply", apply_s, [applied_after[r]]) for r in ranks]

    def step_check(self, normed: dict[int, simpy.Event]) -> dict[int, simpy.Event]:
        """Under the runtime's collectives (`--collectives runtime`, as the ZeRO-1 layout prices its
        own checks: `canzona.step_collectives`), `FsdpOptimizer.check`'s all-gathers over every rank
        of the mesh (replicas and TP ranks too), from their one definition
        (`canzona.fsdp_collectives.fsdp_step_collectives`: the step check, and after an explicit
        `clip_grad_norm_` the step recheck), each after the rank's norm term and before its
        exchanges and AdamW, priced as the ZeRO-1 layout's checks (`sim.iteration.record_cost`: an
        all-gather of every member's words); recorded as the runtime logs them. Megatron-style
        collectives (the default) run none, as the ZeRO-1 layout's."""
        o = self.cfg.options
        if o.collectives != RUNTIME_STYLE:
            return normed
        clips = [(1.0, 2.0)] if o.explicit_clip else []  # the loop's clip_grad_norm_ (its threshold: no record's)
        world = list(self.cluster.stage_ranks(0))
        geo = self.cluster.geometry(world)
        done = normed
        for c in fsdp_step_collectives(self.spec, self.shard, 0, {}, (), element_bytes=0, world=len(world),
                                       clips=clips, max_grad_norm=o.max_grad_norm):
            if c.op == ALL_GATHER:  # the check's (the exchanges are `phase_b`'s own)
                cost = collective_cost(ALL_GATHER, sum(c.bytes_per_rank), geo, self.hw)
                done = self.engine.collective(c.name, self.members, cost, DP_COMM, {r: [done[r]] for r in self.members},
                                              record=c.logged(), members=len(world))
        return done

    def _per_owner(self, mats: Sequence[FsdpMatrix], nbytes: int) -> tuple[list[float], list[float]]:
        """Per owner, the bytes of one member's pieces of the TP-sharded matrices it owns, and of
        the TP-replicated ones (which only the lowest TP rank of each DP rank sends)."""
        sharded, replicated = [0.0] * self.size, [0.0] * self.size
        for m in mats:
            (replicated if m.name in self.replicated else sharded)[m.owner] += self.piece(m) * nbytes
        return sharded, replicated

    def to_owners(self, mats: Sequence[FsdpMatrix], nbytes: int) -> list[list[float]]:
        """sent[s][d]: the bytes of member s's pieces of the matrices member d owns (none to itself).
        At TP 1 as the runtime sends them (`canzona.fsdp_collectives.exchange_bytes`: its row
        blocks); under TP numel / (S x T) a piece."""
        if self.tp == 1:
            return _to_owners(mats, self.shard, nbytes)
        sharded, replicated = self._per_owner(mats, nbytes)
        return [[0.0 if d == src else sharded[d] + (replicated[d] if src % self.tp == 0 else 0.0)
                 for d in range(self.size)] for src in range(self.size)]

    def from_owners(self, mats: Sequence[FsdpMatrix], nbytes: int) -> list[list[float]]:
        """sent[o][d]: the bytes of member d's pieces of the updates member o owns, which o sends it
        (every TP rank receives its TP-replicated pieces)."""
        if self.tp == 1:
            return _to_owners(mats, self.shard, nbytes, updates=True)
        sharded, replicated = self._per_owner(mats, nbytes)
        return [[0.0 if d == o else sharded[o] + replicated[o] for d in range(self.size)] for o in range(self.size)]

    # --- memory -----------------------------------------------------------------------------

    def memory(self, setup: MemorySetup, dims: LayerDims) -> LayoutMemory:
        """Every rank of the exchange group (the shard group, under TP its S x T ranks): its shards
        of the parameters (1 / S of their TP-local elements: numel / (S x T) of a TP-sharded one;
        fp32 when mixed precision keeps masters: FSDP2 gathers bf16 copies of fp32 shards),
        gradients and elementwise state;
        the matrix optimizer's state of the matrices it owns whole (owner policies), or under
        gather-all its shard of every matrix's row state (moments and momentum, as muon_fsdp2 keeps
        Muon's on the DTensor shard) and the whole of every matrix's Kronecker factors (Shampoo's
        and SOAP's, which every rank computing every matrix holds); transient: two units' gathered
        parameters (every unit's without `reshard_after_forward`) and one unit's unsharded gradient
        beside the activations, or the step's buffers."""
        opt, tp = self.cfg.optimizer, self.tp
        pb, gb = setup.param_bytes, setup.grad_bytes
        ub = setup.update_state_bytes  # the exchanged gradients and updates (`phase_b`)
        kept = self._persistent(setup)
        in_flight = in_flight_bytes(self.gathered_elements(), self.cfg.reshard_after_forward, pb, gb)
        acts = activation_bytes(dims, setup, tp)
        work = {m.name: kernel_workspace_bytes(opt, m.shape, ub, self.cfg.matrix_config) for m in self.matrices.values()}
        stacks = {m.name: batched_stack_bytes(opt, m.shape) for m in self.matrices.values()}
        groups = self.micro_groups()
        ranks = []
        for r in self.members:
            if self.policy is None:
                # **Assumption**: AdamW's step on the shards (torch's foreach implementation) adds
                # temporaries per tensor list that are small beside the transient above: none counted
                step = 0
            elif self.policy.gathers_all:
                # two micro-groups' gathered gradients, and one matrix's update and workspace
                held = [sum(m.numel for m in g) * ub for g in groups]
                step = max(a + b for a, b in zip(held, held[1:] + [0])) + \
                    max(m.numel * ub + work[m.name] for m in self.matrices.values())
            else:
                held = [sum(m.numel * 2 * ub for m in g if m.owner == r) for g in groups]  # gradient and update
                # the largest kernel's temporaries: a batch's are its matrices' and its stacks
                ws = max((sum(work[m.name] + (stacks[m.name] if len(batch) > 1 else 0) for m in batch)
                          for g in groups for batch in shape_batches([m for m in g if m.owner == r], self.batching)),
                         default=0)
                step = max(a + b for a, b in zip(held, held[1:] + [0])) + ws
            h = kept[r]
            ranks.append(RankMemory(r, 0, r // tp, r % tp, h.weights, h.grads, h.master_weights, h.matrix_state,
                                    h.adamw_state, acts, in_flight, step, setup.overhead(max(acts + in_flight, step)),
                                    setup.userbuffers, setup.dispatcher_buffers))
        return LayoutMemory(self.cfg.policy, opt, self.cluster.dp, tp, 1, 0, tuple(ranks))

    def _persistent(self, setup: MemorySetup) -> list[FsdpRankBytes]:
        """Each member's shards, masters and state. At TP 1 exactly what the runtime allocates
        (`fsdp_persistent_memory`: each rank's torch.chunk row blocks); under TP 1 / S of each TP
        rank's local elements (`_StridedShard`'s exact pieces are not modelled). A bf16 model
        without masters (`MemorySetup.master_weights`) keeps its gradient shards, AdamW's moments and
        the matrix state that follows the update in the parameters' dtype (`kept_state_bytes`)."""
        gb, mb = setup.shard_grad_bytes, setup.master_bytes
        weight_bytes = 0 if mb else setup.param_bytes  # with masters, the fp32 shard is the parameter
        matrices = kept_matrices(self.cfg.optimizer, self.matrices, setup, self.cfg.matrix_config)
        if self.tp == 1:
            dense = dense_part(self.spec) if self.ep > 1 else self.spec
            held = fsdp_persistent_memory(dense, self.shard, matrices, weight_bytes=weight_bytes,
                                          grad_bytes=gb, master_bytes=mb,
                                          moment_bytes=setup.update_state_bytes)
            if self.ep == 1:
                return held
            # rank r: EP rank r % ep, EDP member r // ep, as the runtime's (efsdp, ep) mesh
            experts = expert_shard_memory(self.spec, self.ep, self.edp, setup)
            return [replace(h, weights=h.weights + e.weights, grads=h.grads + e.grads,
                            master_weights=h.master_weights + e.master_weights,
                            adamw_state=h.adamw_state + e.adamw_state)
                    for h, e in ((h, experts[r // self.ep]) for r, h in enumerate(held))]
        s, tp = self.shard, self.tp
        total = sum(self.local.values())  # one TP rank's elements (TP-sharded parameters' 1 / T)
        matrix_numel = sum(self.spec.param(m).local_numel(tp) for m in self.matrices)
        shard = -(-total // s)
        adamw_state = setup.adamw_state_bytes(-(-(total - matrix_numel) // s))
        out = []
        for r in self.members:
            if self.policy is None:
                state = 0
            elif self.policy.gathers_all:
                state = -(-sum(m.row_state for m in matrices.values()) // self.size) + \
                    sum(m.state - m.row_state for m in matrices.values())
            else:
                state = sum(m.state for m in matrices.values() if m.owner == r)
            out.append(FsdpRankBytes(weights=shard * weight_bytes, grads=shard * gb, master_weights=shard * mb,
                                     matrix_state=state, adamw_state=adamw_state))
        return out


def kept_matrices(optimizer: str, matrices: dict[str, FsdpMatrix], setup: MemorySetup,
                  matrix_config: object | None = None) -> dict[str, FsdpMatrix]:
    """`matrices` with their state as the runtime keeps it (`FsdpMatrix.state` is the plan's fp32
    count): without masters the part that follows the update (the registry's `update_dtype_state_bytes`,
    Muon's momentum, which lives with the matrix's rows) in the parameters' dtype
    (`canzona.memory.state_saving_bytes`)."""
    out = {}
    for name, m in matrices.items():
        saved = state_saving_bytes(optimizer, m.shape, setup, matrix_config)
        out[name] = replace(m, state=m.state - saved, row_state=m.row_state - min(saved, m.row_state)) if saved else m
    return out


def expert_shard_memory(spec: ModelSpec, ep: int, edp: int, setup: MemorySetup) -> list[FsdpRankBytes]:
    """Under FSDP + EP, each EDP member's persistent bytes of its experts: its own torch.chunk piece
    of each of its EP rank's stacks over the EDP group (`fsdp_persistent_memory` of
    `expert_part`; AdamW's state), as the runtime holds them: uneven where the EP rank's experts do
    not divide by EDP (3 over 2 ranks: 2 and 1), member 0 the fullest. One definition for the run
    (`_FsdpRun._persistent`), its step (`expert_shard_elements`) and the search's floor
    (`fsdp_memory_floor`)."""
    mb = setup.master_bytes
    return fsdp_persistent_memory(expert_part(spec, ep), edp, {}, weight_bytes=0 if mb else setup.param_bytes,
                                  grad_bytes=setup.shard_grad_bytes, master_bytes=mb,
                                  moment_bytes=setup.update_state_bytes)


def expert_shard_elements(spec: ModelSpec, ep: int, edp: int, setup: MemorySetup) -> list[int]:
    """Each EDP member's elements of its experts: `expert_shard_memory`'s pieces (their gradient
    shards' bytes over an element's), which each rank's gradient norm and AdamW step cover
    (`_FsdpRun.phase_b`)."""
    return [e.grads // setup.shard_grad_bytes for e in expert_shard_memory(spec, ep, edp, setup)]


def fsdp_memory_floor(cfg, model: tuple[ModelSpec, Architecture], dims: LayerDims, stage: int = 0) -> int:
    """A lower bound of the fullest GPU's bytes of an FSDP layout (`_FsdpRun.memory`), without its
    plan or owners (for the search's pruning, `sim.search.memory_floor`): the fullest rank of the
    exchange group holds at least the group's mean of each persistent term (its shards of the
    TP-local elements, 1 / S of them with their gradients and masters; under EP the fullest rank's
    piece of its EP rank's experts, `expert_shard_memory`; AdamW's moments of the elementwise parameters' shards; the matrix optimizer's
    state, which the owners, or under gather-all every rank, hold: at least 1 / (S x T) of every
    matrix's), the flex token dispatcher's buffers, the activations, the units in flight beside them (`in_flight_bytes`) and the
    allowance on that transient peak (the step's buffers, which it may exceed, only add). Under PP
    pipeline stage `stage`'s (sim.fsdp_pipeline.stage_memory): its parameters (`stage_spec`) over
    its DP group, its 1F1B activations and every unit's gathered parameters and unsharded gradient."""
    spec, arch = model
    if cfg.pp > 1:
        spec = stage_spec(spec, cfg.pp, stage, arch.layers, split=cfg.pipeline_split)
    tp, ep = cfg.tp, cfg.ep
    dp = cfg.gpus // (tp * cfg.pp)
    shard = dp // cfg.hsdp_replicate
    edp = dp * tp // ep
    setup = cfg.memory_setup(arch, tp_mode=STEP_DEFAULTS.tp_mode)
    pb, gb, mb = setup.param_bytes, setup.grad_bytes, setup.master_bytes
    weight_bytes = 0 if mb else pb  # with masters, the fp32 shard is the parameter
    local, expert_local = unit_elements(spec, tp, ep)
    total = sum(local.values())
    # the matrices `_persistent` keeps matrix state for: `fsdp_persistent_memory` reads the spec's
    # parameters, and an expert stack keeps AdamW's state there (only AdamW runs stacks under FSDP2:
    # `check_fsdp` refuses a whole-matrix optimizer over them, as the runtime does)
    matrices = [p for p in spec.matrix_params() if p.stacked_in is None] \
        if fsdp_policy(cfg.optimizer, cfg.policy) is not None else ()
    matrix_state = sum(state_bytes(cfg.optimizer, tuple(p.shape), cfg.matrix_config)
                       - state_saving_bytes(cfg.optimizer, tuple(p.shape), setup, cfg.matrix_config)
                       for p in matrices) // (shard * tp)
    elementwise = total - sum(p.local_numel(tp) for p in matrices)
    # the fullest rank's own piece of its EP rank's experts (`expert_shard_memory`, as `_persistent`)
    experts = max((e.total for e in expert_shard_memory(spec, ep, edp, setup)), default=0) if ep > 1 else 0
    persistent = (total // shard * (weight_bytes + setup.shard_grad_bytes + mb) + matrix_state
                  + setup.adamw_state_bytes(elementwise // shard) + experts + setup.dispatcher_buffers)
    gathered = gathered_elements(local, expert_local, edp)
    transient = activation_bytes(dims, setup, tp, cfg.pp, stage, split=cfg.pipeline_split) + (
        pipeline_in_flight_bytes(gathered, pb, gb) if cfg.pp > 1 else
        in_flight_bytes(gathered, cfg.reshard_after_forward, pb, gb))
    return persistent + transient + setup.overhead(transient)


def _label(unit: FsdpUnit) -> str:
    return "root" if unit.key == ROOT else f"layer {unit.key}"


def _to_owners(mats: Sequence[FsdpMatrix], shard: int, nbytes: int, updates: bool = False) -> list[list[float]]:
    """sent[s][d]: the bytes rank s sends rank d in a micro-group's all-to-all, as the runtime sends
    them (`canzona.fsdp_collectives.exchange_bytes`: its row blocks of the matrices d owns, or of
    the `updates` of those s owns, to d), less its own piece, which no link carries."""
    sent = exchange_bytes(mats, shard, nbytes, updates=updates)
    return [[0.0 if d == src else float(b) for d, b in enumerate(row)] for src, row in enumerate(sent)]


@dataclass(frozen=True)
class FsdpOutcome:
    """One simulated FSDP iteration, before `sim.simulate` makes it a `SimResult`."""

    engine: Engine
    plan: Plan  # canzona's owner plan for the shard group (the owners canzona's policy uses)
    shard: int
    members: int  # the exchange group's ranks (S x T), whose step is simulated
    t_sync: float
    t_end: float
    stalls: float  # the forward's waits for its unit gathers
    memory: LayoutMemory


def simulate_fsdp(cfg, model: tuple[ModelSpec, Architecture], cluster: Cluster, hw: HardwareProfile,
                  dims: LayerDims) -> FsdpOutcome:
    """One iteration of `cfg` (checked, `cfg.fsdp`) under its FSDP policy."""
    spec, arch = model
    shard = check_fsdp(cfg, cluster, spec)
    run = _FsdpRun(cfg, model, cluster, hw, shard)
    synced = run.phase_a(dims.head_dim)
    sync_times: list[float] = []
    synced.callbacks.append(lambda _: sync_times.append(run.engine.now))
    run.phase_b(synced)
    t_end = run.engine.run()
    setup = cfg.memory_setup(arch, tp_mode=STEP_DEFAULTS.tp_mode)
    return FsdpOutcome(run.engine, run.plan, shard, run.size, sync_times[0], t_end, sum(run.stalls), run.memory(setup, dims))


__all__ = ["FSDP_POLICIES", "FSDP_RECOMPUTE_MODES", "check_fsdp", "fsdp_checkpoint", "fsdp_forward_without_grad",
           "fsdp_memory_floor",
           "fsdp_micro_batch_work", "fsdp_policy", "fsdp_recompute_modes", "owner_plan_defaults", "simulate_fsdp"]
