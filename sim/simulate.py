"""`simulate()`: one iteration of a layout under a policy; `compare()`: every policy side by side.

Definitions (stated in every result): iteration time runs from the start of the first forward to
the parameters being ready for the next iteration; optimizer-step latency runs from the end of
gradient synchronisation to the parameters being updated and gathered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from operator import attrgetter
from pathlib import Path
from typing import Any

from canzona.choices import check_choice
from canzona.cost import CostModel, DeviceRate, cost_model_for
from canzona.decoder import Architecture
from canzona.dp.layout import (
    AUTO_EXPERT_BUCKETS,
    EXPERT_BUCKETS,
    check_expert_buckets,
    check_expert_buckets_apply,
)
from canzona.errors import SpecError
from canzona.experts import (
    check_ep,
    check_experts,
    dense_part,
    expert_params,
    expert_part,
    router_imbalance,
)
from canzona.fileio import dumps_json, write_text_atomic
from canzona.hardware import DEFAULT_PROFILE, HardwareProfile, load_profile
from canzona.memory import (
    LayoutMemory,
    MemorySetup,
    deepep_buffer_bytes,
    hybridep_buffer_bytes,
    layer_dims,
    memory_per_gpu,
    reduce_scatter_lengths,
    userbuffer_bytes,
)
from canzona.models import resolve_model
from canzona.optimizers import (
    check_matrix_optimizer,
    config_changes,
    matrix_config_for,
    matrix_optimizer,
)
from canzona.pipeline import (
    EVEN_SPLIT,
    PipelineSplit,
    check_split,
    check_vp,
    chunk_layers,
    stage_layers,
    stage_spec,
)
from canzona.plan import (
    BATCH_CAPACITY,
    DEFAULT_GEOMETRY,
    ONE_RANK_PLAN_SETTINGS,
    PLAN_DEFAULTS,
    Plan,
    PlanSettings,
    bucket_names,
    check_geometry,
    check_one_rank_settings,
    plan_for,
)
from canzona.recompute import check_method_layers, check_selective_ac_option, inside_layers
from canzona.routing import RANDOM
from canzona.spec import DTYPE_BYTES, ModelSpec
from canzona.step_collectives import RUNTIME_STYLE, check_runtime_experts
from canzona.step_options import ELEMENTWISE_IGNORED, STEP_DEFAULTS, check_elementwise_options
from canzona.step_policies import (
    FSDP_POLICIES,
    STEP_POLICIES,
    default_policy,
    policies_running,
    policy_optimizer,
    resolve_policy,
)
from canzona.step_schedule import check_tp_mode
from canzona.tp import TP_REGISTRY, Capacity, check_tp_policy
from canzona.variability import check_cv, straggler_slowdown
from sim.classes import RankSpans
from sim.cross_entropy import UNFUSED
from sim.engine import Engine, Span, cyclic_gc_paused
from sim.ep_dispatch import DEEPEP
from sim.ep_overlap import check_delay_wgrad, check_ep_overlap
from sim.fp8 import FP8, FP8Setup, check_fp8_device, fp8_setup
from sim.fsdp import check_fsdp, fsdp_policy, owner_plan_defaults, simulate_fsdp
from sim.fsdp_copies import FSDP2, check_fsdp_impl, reshard_options
from sim.fsdp_pipeline import simulate_fsdp_pipeline
from sim.iteration import (
    ETP_COMM,
    Context,
    EarlyStart,
    every_rank,
    forward_backward,
    optimizer_step,
    step_classes,
)
from sim.model_work import MicroBatchWork, micro_batch_work
from sim.options import RunOptions, check_align_grad_reduce
from sim.steady import (
    EXACT_MICRO_BATCHES,
    extrapolate,
    same_choice,
    short_lengths,
    with_micro_batches,
)
from sim.topology import Cluster, dp_size
from sim.userbuffers import check_ub_config_applies, gemm_chunks
from sim.workload import Workload, forward_flops

DEFINITIONS = {
    "iteration_time_s": "start of the first forward to parameters ready for the next iteration (steady "
                        "state: with overlapped parameter gathers, the previous step's all-gathers run "
                        "under this forward and the iteration ends when every rank has updated its parameters)",
    "optimizer_step_s": "end of gradient synchronisation to parameters updated (and all-gathered, when the "
                        "parameter all-gather is not overlapped with the next forward)",
    "param_gather_exposed_s": "time the forward waited for parameters still being all-gathered (overlapped "
                              "parameter gathers only)",
    "memory": "bytes per GPU of the fullest GPU (weights, gradient buffers, fp32 masters, optimizer state "
              "by owner, Transformer Engine's userbuffers under the TP overlap, the flex token dispatcher's "
              "communication buffers (DeepEP / HybridEP), the larger of activations and "
              "optimizer-step buffers, an allowance for the CUDA context, NCCL and fragmentation); fits: every "
              "GPU within the profile's memory",
    "mfu": "model FLOPs (3 x forward: matrices, attention scores and values as computed, the head) per "
           "second per GPU, over the dense peak of the model dtype (bf16 by default; under --precision fp8 "
           "still that peak, though the linear GEMMs run at the FP8 rate)",
}


# the settings that weigh how a DP group's ranks share the matrices, how its gradients are reduced
# and its updated parameters gathered: with one rank in every plan's group
# (`SimConfig._check_one_rank_settings`) there is nothing to share, reduce or gather, and they change
# nothing (`canzona simulate --json` the same with and without each, docs/design.md §4.4). Field
# (under `options.` a run option's), flag, default. Not --align: it pads each parameter's start in
# the buffers at any DP, so memory and time differ at DP 1
ONE_RANK_SETTINGS: tuple[tuple[str, str, Any], ...] = (
    *ONE_RANK_PLAN_SETTINGS,
    ("options.reduce_scatter", "--reduce-scatter", RunOptions.reduce_scatter),
    ("options.overlap_grad_reduce", "--no-overlap-grad-reduce", RunOptions.overlap_grad_reduce),
    # the pipeline's launch of those reductions and where the step's parameter gathers run: there
    # are none (qwen3-0.6b, 8 GPUs, TP 4 x PP 2, Megatron's and the runtime's collectives alike)
    ("options.align_grad_reduce", "--no-align-grad-reduce", RunOptions.align_grad_reduce),
    ("options.overlap_param_gather", "--no-overlap-param-gather", RunOptions.overlap_param_gather))


@dataclass(frozen=True)
class SimConfig:
    model: str = "qwen3-32b"
    gpus: int = 256
    tp: int = 8
    optimizer: str = "muon"
    policy: str | None = None  # None: the optimizer's default (canzona; zero1 for adamw)
    dp_policy: str = PLAN_DEFAULTS.dp_policy
    tp_policy: str = PLAN_DEFAULTS.tp_policy
    tp_mode: str = STEP_DEFAULTS.tp_mode  # or "serial": the order of the micro-groups' operations
    alpha: float = PLAN_DEFAULTS.alpha
    bucket_size: int | None = PLAN_DEFAULTS.bucket_size
    capacity: Capacity | None = PLAN_DEFAULTS.capacity
    align: int = PLAN_DEFAULTS.align
    balance_by: str = PLAN_DEFAULTS.balance_by
    geometry: str = DEFAULT_GEOMETRY  # canzona's: canzona.plan.GEOMETRIES
    hardware: str = DEFAULT_PROFILE
    workload: Workload = field(default_factory=Workload)
    options: RunOptions = field(default_factory=RunOptions)
    zero1_fallback: bool = True  # canzona: report its ZeRO-1 fallback when that is faster
    pp: int = 1  # pipeline stages (1F1B); GPUs = DP x TP x PP
    # model chunks per pipeline stage (Megatron's virtual pipeline, the interleaved 1F1B schedule:
    # canzona.pipeline); 1: plain 1F1B
    vp: int = 1
    # how the layers are cut over the pp x vp model chunks (canzona.pipeline.PipelineSplit:
    # Megatron's account_for_embedding/loss_in_pipeline_split and first / last stage layer counts,
    # each off by default as in Megatron); the simulator only: the runtime has no pipeline
    pipeline_split: PipelineSplit = EVEN_SPLIT
    # context parallelism (Megatron's --context-parallel-size, ring attention: sim.model_work):
    # GPUs = DP x CP x TP x PP, each CP rank seq / cp tokens of every micro-batch, the gradients
    # reduced and the optimizer step planned over the DP x CP ranks; 1: none
    cp: int = 1
    ep: int = 1  # expert parallelism of a mixture-of-experts model (canzona.experts)
    etp: int = 1  # expert TP (Megatron's expert_tensor_parallel_size): dp x tp = edp x ep x etp
    # how the buckets of stacked expert matrices are sized (canzona.dp.layout.EXPERT_BUCKETS: the
    # runtime's option of the same name and default); AUTO_EXPERT_BUCKETS: under EP each sizing the
    # expert plans differ by is simulated and the faster kept (`expert_buckets` in the result says
    # which, to give the runtime or `canzona plan`), at EP 1 the default
    expert_buckets: str = PLAN_DEFAULTS.expert_buckets
    # the busiest EP rank's token-expert pairs over the mean (>= 1), or the router's histogram of
    # tokens per expert (canzona.experts.router_imbalance): a persistent skew; 1: none. Each
    # micro-batch's random fluctuation on top is the dispatcher's `routing` (canzona.routing)
    router_imbalance: float | tuple[float, ...] = 1.0
    # FSDP2 / ZeRO-3 (sim.fsdp, docs/design.md §2.8): parameters, gradients and optimizer state
    # sharded over the DP group, the policy one of `FSDP_POLICIES`; `hsdp_replicate` R > 1: HSDP,
    # R replicas of shard groups of DP / R ranks, the reduced gradient shards all-reduced over them
    fsdp: bool = False
    hsdp_replicate: int = 1
    # FSDP2's `fully_shard(reshard_after_forward=...)` on every unit: True (FSDP2's default, and
    # what canzona's runtime examples and harness run) frees each unit's gathered parameters after
    # its forward and gathers them again for its backward; False keeps them from the forward to
    # the backward (NeMo AutoModel's MoE `apply_fsdp`): one all-gather fewer per unit and
    # micro-batch, every unit's gathered parameters held at the backward's start (sim.fsdp)
    reshard_after_forward: bool = True
    # which FSDP runs it (sim.fsdp_copies): torch's FSDP2 (`fully_shard`, canzona's runtime's) or
    # Megatron-FSDP, which differ by FSDP2's copies on the compute stream around its collectives
    fsdp_impl: str = FSDP2
    # the per-GPU compute time's standard deviation over its median (canzona.variability): phase
    # A's compute waits for the expected slowest of the job's GPUs; None: the hardware profile's
    # (`variability.time_cv`), 0: every GPU alike (comparisons with one runtime measurement)
    gpu_variability: float | None = None
    # the matrix optimizer's configuration (DistributedOptimizer's `matrix_config`, same name and
    # default: None, a mapping of fields or a config object): the step's kernels and the optimizer
    # state and workspace are priced at it, through the planner (`canzona.plan.plan_for`). Held as
    # None or a config off the defaults (`canzona.optimizers.matrix_config_for`): the defaults given
    # are the same configuration as none given; refused for an elementwise optimizer (AdamW)
    matrix_config: Any = None
    # what the planner prices each matrix's step with (DistributedOptimizer's `cost_model`, same
    # name and default; `canzona simulate --cost-table`, as `canzona plan`'s): a measured table
    # changes the plan the runtime runs, and the plan's seconds price the step's matrix work. None:
    # the hardware profile's (`cost_model_for(hardware)`; the runtime's None is the profile of the
    # GPU it runs on, `canzona.runtime.options.planning_cost_model`, and the default profile's on the
    # CPU or a GPU no profile is: give it cost_model_for(hardware) there)
    cost_model: Any = None

    def __post_init__(self) -> None:
        if self.policy is None or not self.fsdp:  # the runtime's resolution (zero1-gather with adamw: zero1)
            object.__setattr__(self, "policy", resolve_policy(self.policy, self.optimizer))
        if self.matrix_config is not None:
            object.__setattr__(self, "matrix_config", matrix_config_for(self.optimizer, self.matrix_config))

    @property
    def settings(self) -> PlanSettings:
        """The planning settings of this configuration."""
        return PlanSettings(dp_policy=self.dp_policy, tp_policy=self.tp_policy, alpha=self.alpha,
                            bucket_size=self.bucket_size, align=self.align, capacity=self.capacity,
                            balance_by=self.balance_by, expert_buckets=self._sizing())

    def planning_costs(self, hw: HardwareProfile) -> CostModel:
        """The cost model the owners are planned with (`cost_model`), on the loaded profile `hw`."""
        return cost_model_for(hw) if self.cost_model is None else self.cost_model

    def _sizing(self) -> str:
        """The expert bucket sizing the settings plan with (under `auto`, the default's)."""
        return PLAN_DEFAULTS.expert_buckets if self.expert_buckets == AUTO_EXPERT_BUCKETS else self.expert_buckets

    def check(self, model: tuple[ModelSpec, Architecture] | None = None) -> Cluster:
        """Validate everything that can be wrong before any simulation; returns the cluster."""
        return self.checked(model)[0]

    def check_settings(self) -> None:
        """The rules between the run's own settings (FSDP's options, the model's dtype, the loss's
        loop, the step policy), which need neither the model nor the hardware profile: `checked`
        runs them first, and a published row is held to them when it is read (`sim.published`)."""
        if not isinstance(self.reshard_after_forward, bool):
            raise SpecError(f"reshard_after_forward must be True or False, got {self.reshard_after_forward!r}")
        if not self.reshard_after_forward and not self.fsdp:
            raise SpecError("--no-reshard-after-forward is an option of FSDP2's fully_shard: it needs --fsdp")
        check_fsdp_impl(self.fsdp_impl)
        if self.reshard_after_forward not in reshard_options(self.fsdp_impl):
            raise SpecError(f"--no-reshard-after-forward is an option of FSDP2's fully_shard; --fsdp-impl "
                            f"{self.fsdp_impl} has none (Megatron-FSDP releases each unit's parameters after its "
                            "forward and gathers them again for its backward)")
        if self.fsdp_impl != FSDP2 and not self.fsdp:  # as --no-reshard-after-forward: not a silent no-op
            raise SpecError(f"--fsdp-impl {self.fsdp_impl} names which FSDP shards the model: it needs --fsdp")
        wl = self.workload
        if not wl.master_weights and not self.fsdp and wl.grad_bytes > wl.param_bytes:
            # under FSDP the reduction is the user's fully_shard's (MixedPrecisionPolicy.reduce_dtype)
            raise SpecError(f"--no-master-weights with --grad-reduce-in-fp32 ({wl.grad_bytes}-byte gradients, "
                            f"Workload.grad_bytes; grad_bytes_for(None, False) gives the parameters' "
                            f"{wl.param_bytes}): without master weights canzona's DistributedOptimizer reduces and "
                            "keeps the gradients in the parameters' dtype")
        if self.workload.loss_bytes != DTYPE_BYTES["fp32"] and not self.loss_autograd:
            raise SpecError("--no-loss-fp32-upcast describes PyTorch's F.cross_entropy on the bf16 logits: FSDP2 "
                            "(--fsdp) with the unfused loss; Megatron's vocab-parallel loss computes in fp32")
        if self.workload.loss_holds_logits and not self.loss_autograd:
            raise SpecError("--loss-holds-logits describes a training loop around PyTorch's F.cross_entropy: FSDP2 "
                            "(--fsdp) with the unfused loss; Megatron's loss holds no logits past its forward")
        if self.fsdp:
            fsdp_policy(self.optimizer, self.policy)
            if self.workload.store_param_remainders:
                raise SpecError("--store-param-remainders is the distributed optimizer's (ZeRO-1): under --fsdp the "
                                "fp32 shard is the parameter, with no bf16 copy to hold the masters' high half")
            if self.workload.fp8_params:
                raise SpecError("--fp8-params is modelled on the distributed optimizer's layout (ZeRO-1, NeMo's "
                                "and Megatron's FP8 primary weights): under --fsdp it is not")
        else:
            check_choice(self.policy, STEP_POLICIES, "policy")

    def checked(self, model: tuple[ModelSpec, Architecture] | None = None
                ) -> tuple[Cluster, tuple[ModelSpec, Architecture], HardwareProfile]:
        """`check`, also returning the model (`model_of`) and the hardware profile: a model file
        and a profile are read here, once per simulation."""
        self.check_settings()
        check_matrix_optimizer(self.optimizer)
        if not self.fsdp:
            STEP_POLICIES[self.policy].check_optimizer(self.optimizer)
            STEP_POLICIES[self.policy].check_dp_policy(self.dp_policy)
            STEP_POLICIES[self.policy].check_overlap_step(self.options.overlap_step)
        check_tp_mode(self.tp_mode)
        # every layout, whether or not its plan schedules TP micro-groups (an elementwise optimizer's
        # does not): an unknown value is a typo, never a no-op
        check_tp_policy(self.tp_policy)
        check_geometry(self.geometry)
        self._check_elementwise_settings()
        self.options.check()
        if self.gpu_variability is not None:
            check_cv(self.gpu_variability)
        hw = load_profile(self.hardware)
        if self.workload.precision == FP8:
            check_fp8_device(hw)
        dispatcher = self.options.ep_dispatcher
        if dispatcher.flex and dispatcher.sms > hw.gpu.sms:
            raise SpecError(f"--moe-{dispatcher.moe_flex_dispatcher_backend}-num-sms {dispatcher.sms}: {hw.name} has "
                            f"{hw.gpu.sms} SMs")
        cluster = Cluster(self.gpus, self.tp, hw.node.gpus, self.pp, cp=self.cp)
        if self.cp > 1:
            self._check_cp()
        if not self.fsdp and (self.workload.seq_len // self.cp) % self.tp:
            # sequence parallelism scatters each micro-batch's [seq / cp, batch, hidden] activations
            # along the sequence over TP (Megatron's _split_along_first_dim asserts it divides)
            raise SpecError(f"seq len {self.workload.seq_len} / cp {self.cp} is not divisible by tp {self.tp} "
                            "(sequence parallelism splits each sequence's tokens over the TP group)")
        resolved = model_of(self, model)
        window = resolved[1].sliding_window
        if window is not None and self.workload.seq_len > window:
            raise SpecError(f"{resolved[0].name}'s attention slides over a window of {window} tokens (sliding_window "
                            f"in its config), shorter than --seq-len {self.workload.seq_len}: sliding-window attention "
                            f"is not modelled; simulate --seq-len {window} or less, or set sliding_window to null "
                            "for full causal attention")
        if not isinstance(self.pipeline_split, PipelineSplit):
            raise SpecError(f"pipeline_split must be a PipelineSplit, got {self.pipeline_split!r}")
        stage_layers(resolved[1].layers, self.pp, 0)
        check_split(self.pipeline_split, resolved[1].layers, self.pp, self.vp)
        check_vp(self.vp, self.pp, resolved[1].layers, self.workload.micro_batches(cluster.batch_dp),
                 self.pipeline_split)
        self._check_recompute_method(resolved[1].layers)
        check_ep(resolved[0], self.ep, cluster.dp, self.tp, self.etp, resolved[1].hidden)
        if self.options.overlap_moe_expert_parallel_comm:  # Megatron's requirements (sim.ep_overlap)
            check_ep_overlap(ep=self.ep, pp=self.pp, vp=self.vp, recompute=self.options.recompute, fsdp=self.fsdp,
                             moe=resolved[1].moe is not None)
        check_delay_wgrad(tp=self.tp, tp_comm_overlap=self.options.tp_comm_overlap,
                          delay_wgrad_compute=self.options.delay_wgrad_compute)
        check_align_grad_reduce(self.options, pp=self.pp, fsdp=self.fsdp)
        check_ub_config_applies(self.options.tp_comm_overlap_cfg, tp=self.tp,
                                tp_comm_overlap=self.options.tp_comm_overlap, fsdp=self.fsdp)
        if self.expert_buckets != AUTO_EXPERT_BUCKETS:
            check_expert_buckets(self.expert_buckets)
        check_expert_buckets_apply(self.expert_buckets, resolved[0].name, bool(resolved[0].stacks))
        if self.router_imbalance != 1.0:
            if resolved[1].moe is None:
                raise SpecError(f"a router imbalance is for a mixture-of-experts model; {resolved[0].name!r} has "
                                "no experts")
            if self.ep == 1:
                raise SpecError("a router imbalance needs expert parallelism (ep > 1): at ep 1 every GPU computes "
                                "every expert on its own tokens")
            router_imbalance(self.router_imbalance, resolved[1].moe[0], self.ep)
        if dispatcher.fake_balanced_gate and (resolved[1].moe is None or self.router_imbalance != 1.0):
            raise SpecError("fake_balanced_gate is AutoModel's balanced router of a mixture-of-experts model: it "
                            "needs experts and no router imbalance")
        if dispatcher.routing != RANDOM and resolved[1].moe is None:  # as the search refuses it (Question)
            raise SpecError(f"--routing {dispatcher.routing}: for a mixture-of-experts model's token dispatch; "
                            f"{resolved[0].name!r} has no experts")
        if self.ep > 1:
            if self.options.collectives == RUNTIME_STYLE:  # what the runtime runs of EP, whose collectives are defined
                check_runtime_experts(self.tp, self.etp)
            self.expert_cluster(cluster)
            # DeepEP's buffer has a config for some EP sizes only (`canzona.memory.DEEPEP_CONFIGS`)
            self.dispatcher_bytes(resolved[1], self.workload.seq_len)
        check_fsdp(self, cluster, resolved[0])
        self._check_one_rank_settings()
        return cluster, resolved, hw

    def dp_groups(self) -> tuple[int, ...]:
        """The ranks of each plan's DP group: the dense part's DP x CP and, under EP, the experts'
        EDP (`Cluster.dp` of `Cluster` and of `expert_cluster`)."""
        dense = dp_size(self.gpus, self.tp, self.pp)
        return (dense,) if self.ep == 1 else (dense, dp_size(self.gpus, self.etp, self.pp, self.ep))

    def one_rank_changes(self) -> dict[str, bool]:
        """Of `ONE_RANK_SETTINGS`, whether each would change this run where every DP group is one
        rank: all but two change nothing. Under EP the experts' plan is bucketed by --bucket-size
        even at EDP 1 (its bucket count, and with --align its padding, differ); the runtime's
        collectives (--collectives runtime) log a one-rank reduce-scatter per bucket, which
        --no-overlap-grad-reduce moves after the backward (the step's timing differs). The
        parameter all-gathers change nothing in either collectives' style (none are issued)."""
        return {name: False for name, _, _ in ONE_RANK_SETTINGS} | {
            "bucket_size": self.ep > 1, "options.overlap_grad_reduce": self.options.collectives == RUNTIME_STYLE}

    def at_one_rank_defaults(self) -> SimConfig:
        """This configuration with the `ONE_RANK_SETTINGS` that would change nothing here at their
        defaults, the same run (where some DP group has more ranks, or under FSDP, itself): what a
        caller that sets them for every layout (`sim.search.config_of`) runs, and `canzona
        simulate` accepts."""
        if self.fsdp or max(self.dp_groups()) > 1:
            return self
        changes = self.one_rank_changes()
        top: dict[str, Any] = {}
        options: dict[str, Any] = {}
        for name, _, default in ONE_RANK_SETTINGS:
            if not changes[name]:
                section, _, key = name.rpartition(".")
                (options if section else top)[key] = default
        return replace(self, options=replace(self.options, **options), **top)

    def _check_one_rank_settings(self) -> None:
        """`ONE_RANK_SETTINGS` off their defaults where every plan's DP group is one rank (DP x CP
        1, and under EP one EDP rank) and they change nothing (`one_rank_changes`): one SpecError
        (`canzona.plan.check_one_rank_settings`). Under FSDP `check_fsdp` has refused a one-rank
        DP group already."""
        if self.fsdp:
            return
        changes = self.one_rank_changes()
        changed = []
        for name, flag, default in ONE_RANK_SETTINGS:
            value = attrgetter(name)(self)
            if value != default and not changes[name]:
                changed.append(flag if isinstance(value, bool) else f"{flag} {value}")
        check_one_rank_settings(changed, self.dp_groups())

    def _check_elementwise_settings(self) -> None:
        """An elementwise optimizer's (AdamW's) run: its one step policy (zero1) plans with its own
        DP and TP policies, whole-matrix kernels are none, so canzona's plan settings and the
        matrix optimizer's step options would change nothing: each set off its default is one
        SpecError (named at its default it is accepted), as under --fsdp (`sim.fsdp`); and
        --no-batch-kernels with any optimizer without a batched kernel. The runtime's check
        (`canzona.step_options.check_elementwise_options`), its options named as flags."""
        given = {name: getattr(self, name) for name, _ in ELEMENTWISE_IGNORED}
        check_elementwise_options(self.optimizer, {**given, "batch_kernels": self.options.batch_kernels,
                                                   "compile_kernels": self.options.compile_kernels}, flags=True)

    def slowdown(self, hw: HardwareProfile, gpus: int) -> float:
        """The factor on phase A's compute: the expected slowest of `gpus` GPUs over the median."""
        cv = hw.gpu_time_cv if self.gpu_variability is None else self.gpu_variability
        return straggler_slowdown(cv, gpus)

    def chunks(self, layers: int, stage: int) -> list[range]:
        """The layers of each model chunk of pipeline stage `stage` (its one chunk at VP 1)."""
        return [chunk_layers(layers, self.pp, stage, c, self.vp, self.pipeline_split) for c in range(self.vp)]

    def _check_recompute_method(self, layers: int) -> None:
        """Megatron's `--recompute-method` against the layout (`canzona.recompute`): its
        `_checkpointed_forward` is Megatron's, not FSDP's checkpoint wrappers; a uniform group
        must divide every model chunk's layers."""
        # torchtitan's selective-layer: under --fsdp only (canzona.recompute)
        check_selective_ac_option(self.options.recompute, self.options.selective_ac_option, fsdp=self.fsdp)
        method, n = self.options.recompute_method, self.options.recompute_num_layers
        if method is None:
            return
        if self.fsdp:
            raise SpecError(f"--recompute-method {method} is Megatron's; under --fsdp (torchtitan's, NeMo AutoModel's "
                            "checkpoint wrappers) full recompute checkpoints every layer")
        check_method_layers(method, n, [len(c) for s in range(self.pp) for c in self.chunks(layers, s)])

    def _check_cp(self) -> None:
        """What context parallelism needs besides the cluster's divisibility (`Cluster`)."""
        if self.workload.seq_len % (2 * self.cp):
            raise SpecError(f"seq len {self.workload.seq_len} is not divisible by 2 x cp = {2 * self.cp} (context "
                            "parallelism splits each sequence into 2 x cp chunks)")
        if self.fsdp:
            raise SpecError("--fsdp with cp > 1 is not modelled (context parallelism runs on the ZeRO-1 layout)")
        if self.ep > 1:
            raise SpecError("context parallelism (cp > 1) with expert parallelism (ep > 1) is not modelled")

    @property
    def torch_fsdp2(self) -> bool:
        """An FSDP layout under torch's FSDP2 (not Megatron-FSDP): the frameworks whose loop, loss and
        optimizer state are PyTorch's (torchtitan, NeMo AutoModel, Hugging Face)."""
        return self.fsdp and self.fsdp_impl == FSDP2

    @property
    def loss_autograd(self) -> bool:
        """The loss is PyTorch's `F.cross_entropy` (`canzona.memory.MemorySetup.loss_autograd`): an
        FSDP2 layout's, whose frameworks (torchtitan, NeMo AutoModel, Hugging Face) run it, unless
        the run asks for one of Megatron's fused losses; Megatron's own (ZeRO-1, Megatron-FSDP) is
        its vocab-parallel cross-entropy."""
        return self.torch_fsdp2 and self.workload.cross_entropy == UNFUSED

    def memory_setup(self, arch: Architecture, **extra: Any) -> MemorySetup:
        """The memory model's settings of this run (`canzona.memory`), one definition for the
        simulation and the search's floor: the workload's, the options' (the recompute and its
        method, the EP overlap's one layer more), expert TP, expert parallelism with the router's
        skew and the routing (the fullest EP rank's expert activations), the micro-batches a DP rank runs (which
        cap the 1F1B micro-batches in flight), and each GPU's CP share of a micro-batch's tokens;
        `extra`: what the caller adds beyond the configuration (the plan's step settings); `arch`:
        the model's architecture (required, so no caller can drop what it sizes), whose hidden size
        sizes Transformer Engine's userbuffers under the TP communication overlap
        (`canzona.memory.userbuffer_bytes`: Megatron's layouts at TP > 1 with `tp_comm_overlap`;
        under FSDP, whose TP runs no userbuffers here: none), and with its routed experts the flex
        token dispatcher's buffers (`dispatcher_bytes`)."""
        wl = self.workload
        setup = MemorySetup.from_workload(
            wl, recompute=self.options.recompute, recompute_method=self.options.recompute_method,
            recompute_num_layers=self.options.recompute_num_layers,
            selective_ac_option=self.options.selective_ac_option, expert_tp=self.etp,
            ep_overlap=self.options.overlap_moe_expert_parallel_comm, ep=self.ep, loss_autograd=self.loss_autograd,
            router_imbalance=self.router_imbalance, routing=self.options.ep_dispatcher.load_routing,
            micro_batches=wl.micro_batches(self.gpus // (self.tp * self.pp * self.cp)), **extra)
        if self.cp > 1:  # each GPU holds the activations of its CP rank's seq / cp tokens of a micro-batch
            setup = replace(setup, seq_len=wl.seq_len // self.cp)
        if self.tp > 1 and self.options.tp_comm_overlap and not self.fsdp:
            # sized by the launcher's shape: a micro-batch's tokens on one CP rank
            setup = replace(setup, userbuffers=userbuffer_bytes(setup.seq_len * setup.micro_batch, arch.hidden,
                                                                setup.activation_bytes, setup.fp8))
        buffers = self.dispatcher_bytes(arch, setup.seq_len * setup.micro_batch)
        return replace(setup, dispatcher_buffers=buffers) if buffers else setup

    def dispatcher_bytes(self, arch: Architecture, tokens: int) -> int:
        """Bytes of the flex token dispatcher's communication buffers on each GPU, allocated once for
        the run (`canzona.memory.deepep_buffer_bytes`, `hybridep_buffer_bytes`); 0 under the alltoall
        dispatcher (whose all-to-alls take their buffers from the activations) or without experts.
        The dispatcher's group is Megatron's expert TP x EP group (`MoEFlexTokenDispatcher`:
        `group=self.tp_ep_group`); DeepEP on its `moe_deepep_num_sms` SMs; HybridEP for a micro-batch's `tokens`
        on one rank (split over TP by Megatron's sequence parallelism), `experts / ep` experts per
        rank, NVLink domains of the node's GPUs."""
        dispatcher = self.options.ep_dispatcher
        if not (dispatcher.flex and arch.experts and self.ep > 1):
            return 0
        ranks = self.ep * self.etp
        if dispatcher.moe_flex_dispatcher_backend == DEEPEP:
            return deepep_buffer_bytes(ranks, arch.hidden, dispatcher.moe_deepep_num_sms)
        per_node = load_profile(self.hardware).node.gpus
        return hybridep_buffer_bytes(ranks, min(ranks, per_node), tokens // (1 if self.fsdp else self.tp), arch.hidden,
                                     arch.experts // self.ep)

    def expert_cluster(self, cluster: Cluster) -> Cluster:
        """The same GPUs in expert order (canzona.experts): ETP groups of `etp` consecutive ranks
        in place of TP groups, EP groups of `ep` of them, EDP groups in place of DP groups."""
        return Cluster(cluster.gpus, self.etp, cluster.gpus_per_node, cluster.pp, ep=self.ep)


def model_of(cfg: SimConfig, model: tuple[ModelSpec, Architecture] | None = None) -> tuple[ModelSpec, Architecture]:
    """The spec and architecture to simulate: `model` when given (a model outside the catalog,
    e.g. a spec built with `ModelSpec.from_module`), else the catalog's `cfg.model`; checked
    against the TP size."""
    if model is None:
        return resolve_model(cfg.model, cfg.tp)
    spec, arch = model
    arch.check_tp(cfg.tp)
    spec.check_tp(cfg.tp)
    check_experts(spec, arch.moe)
    return spec, arch


@dataclass(frozen=True)
class SimResult:
    config: SimConfig
    plan: Plan
    iteration_time_s: float
    optimizer_step_s: float
    forward_backward_s: float
    grad_sync_end_s: float
    param_gather_exposed_s: float
    mfu: float
    breakdown: dict[str, float]
    optimizer_breakdown: dict[str, float]
    rank_optimizer_s: tuple[float, ...]
    memory: LayoutMemory  # the pipeline stage with the fullest GPU
    memory_capacity_bytes: float
    # phase A's simulated spans, every rank's of phase B (sim.classes.RankSpans: a sequence)
    spans: Sequence[Span] = field(repr=False)
    fell_back_to: str | None = None  # canzona replaced by its faster ZeRO-1 fallback
    # under EP: the first stage's expert plan (an EP rank's experts over EDP x ETP), and how it was
    # made (the configuration's choices, or the faster of the candidates: `expert_choices`)
    expert_plan: Plan | None = None
    expert_choice: ExpertChoice = field(default_factory=lambda: ExpertChoice())
    # with RunOptions(collectives="runtime"): (members, logged record) of every collective issued,
    # in issue order, as the runtime's logs would hold them (sim.engine.issued_records)
    collective_records: tuple = field(default=(), repr=False)
    # the factor phase A's compute was priced at: the expected slowest GPU of the job over the
    # median GPU (canzona.variability; 1: every GPU alike)
    gpu_slowdown: float = 1.0
    # the segment lists (elements per DP rank) of every gradient reduce-scatter the runs behind this
    # result route (`canzona.memory.reduce_scatter_lengths` of each stage's plans, the candidates'
    # that were not kept too: which one is kept depends on them), sorted: a run under another
    # reduce-scatter implementation that routes each of them alike is the same run
    # (`canzona.reductions.alike_impls`); none under FSDP, which has no such reduce-scatter
    reduce_scatters: tuple[tuple[int, ...], ...] = field(default=(), repr=False)
    # (m1, m2): the iteration extrapolated from runs of m1 and m2 micro-batches per DP rank
    # (sim.steady; the spans are the m2 run's); None: simulated micro-batch by micro-batch
    extrapolated_from: tuple[int, int] | None = None

    @property
    def fits(self) -> bool:
        """Every GPU's memory (docs/design.md §7.1) fits the profile's capacity."""
        return self.memory.fits(self.memory_capacity_bytes)

    def to_dict(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "policy": cfg.policy,
            "model": self.plan.model,
            "model_source": cfg.model,
            "gpus": cfg.gpus,
            "tp": cfg.tp,
            "pp": cfg.pp,
            "vp": cfg.vp,
            **({} if cfg.pipeline_split.even else {"pipeline_split": asdict(cfg.pipeline_split)}),
            "cp": cfg.cp,
            "ep": cfg.ep,
            "etp": cfg.etp,
            "expert_buckets": self.expert_choice.buckets,
            "expert_plan": None if self.expert_plan is None else {
                "dp_policy": self.expert_plan.dp_plan.policy, "tp_policy": self.expert_plan.tp_plan.policy,
                "edp": self.expert_plan.dp, "etp": self.expert_plan.tp,
                "buckets": len(self.expert_plan.dp_plan.buckets),
                "capacity": None if self.expert_plan.tp_plan.capacity is None else asdict(self.expert_plan.tp_plan.capacity),
                "groups": self.expert_plan.tp_plan.metrics.groups},
            "router_imbalance": cfg.router_imbalance,
            **({"fsdp": {"shard": cfg.gpus // (cfg.tp * cfg.hsdp_replicate), "replicate": cfg.hsdp_replicate,
                         "reshard_after_forward": cfg.reshard_after_forward, "impl": cfg.fsdp_impl}}
               if cfg.fsdp else {}),
            "dp": cfg.gpus // (cfg.tp * cfg.pp * cfg.cp),
            **({"dp_cp": cfg.gpus // (cfg.tp * cfg.pp)} if cfg.cp > 1 else {}),
            "optimizer": cfg.optimizer,
            # the fields off the optimizer's defaults (`--matrix-config`), where there are any
            **({} if cfg.matrix_config is None else
               {"matrix_config": config_changes(cfg.optimizer, cfg.matrix_config)}),
            "dp_policy": self.plan.dp_plan.policy,
            "tp_policy": self.plan.tp_plan.policy,
            "tp_mode": cfg.tp_mode,
            # the plan's settings as given, so that a run's JSON tells its plan from the default's
            "plan_settings": {"alpha": cfg.alpha, "balance_by": cfg.balance_by, "bucket_size": cfg.bucket_size,
                              "align": cfg.align, "geometry": cfg.geometry,
                              "capacity": None if cfg.capacity is None else asdict(cfg.capacity)},
            "hardware": cfg.hardware,
            # what planned the owners and priced their steps (`--cost-table`, a calibrated profile's
            # measured seconds, else the profile's analytic model): DistributedOptimizer's cost_model
            "cost_model": self.plan.cost_model,
            "workload": asdict(cfg.workload),
            "iteration_time_s": self.iteration_time_s,
            "optimizer_step_s": self.optimizer_step_s,
            "forward_backward_s": self.forward_backward_s,
            "grad_sync_end_s": self.grad_sync_end_s,
            "param_gather_exposed_s": self.param_gather_exposed_s,
            "fell_back_to": self.fell_back_to,
            "mfu": self.mfu,
            "gpu_slowdown": self.gpu_slowdown,
            **({} if self.extrapolated_from is None else
               {"extrapolated_from_micro_batches": list(self.extrapolated_from)}),
            "options": asdict(cfg.options),
            "breakdown": self.breakdown,
            "optimizer_breakdown": self.optimizer_breakdown,
            "rank_optimizer_s": list(self.rank_optimizer_s),
            "memory": self.memory.to_dict(self.memory_capacity_bytes),
            "fits": self.fits,
            "definitions": DEFINITIONS,
        }


def _plan_for(cfg: SimConfig, cluster: Cluster, spec: ModelSpec, hw: HardwareProfile,
              policy: str | None = None, expert_buckets: str | None = None,
              capacity: Capacity | None = None, empty_ok: bool = False) -> Plan:
    """The policy's plan (`cfg.policy` unless given) for one pipeline stage's `spec` (the whole
    model without PP) on `cluster`'s DP x TP groups (an expert cluster's EDP x ETP groups);
    `capacity` in place of the configuration's micro-group capacity; `empty_ok`: a spec without
    matrices gets a plan of no buckets (a dense part whose only matrices were its experts, as the
    runtime plans it)."""
    policy = STEP_POLICIES[policy or cfg.policy]
    # a replicated policy computes everything everywhere: one DP rank's plan says it all, except
    # for the runtime's collectives, which are laid out on a plan of the whole DP group
    dp = 1 if policy.replicated and cfg.options.collectives != "runtime" else cluster.dp
    settings = replace(cfg.settings, **({} if capacity is None else {"capacity": capacity}),
                       **({} if expert_buckets is None else {"expert_buckets": expert_buckets}))
    return plan_for(spec, dp, cluster.tp, cfg.optimizer, policy, settings, cfg.planning_costs(hw),
                    empty_ok=empty_ok, geometry=cfg.geometry,
                    overlap_step=cfg.options.overlap_step, matrix_config=cfg.matrix_config)


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if hi > lo:
            total += hi - lo
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def _window_breakdown(spans: list[Span], start: float, end: float) -> dict[str, float]:
    """Compute busy time, communication not hidden behind compute, and idle time inside a window."""
    comp = _union((max(s.start, start), min(s.end, end)) for s in spans if s.kind == "compute")
    comm = _union((max(s.start, start), min(s.end, end)) for s in spans if s.kind == "comm")
    compute = _length(comp)
    exposed = _length(comm) - _overlap(comp, comm)
    idle = max(0.0, (end - start) - compute - exposed)  # >= 0 up to rounding
    return {"compute_s": compute, "exposed_comm_s": exposed, "idle_s": idle}


@cyclic_gc_paused()
def simulate(cfg: SimConfig, plan: Plan | None = None, replicate_phase_a: bool = True,
             model: tuple[ModelSpec, Architecture] | None = None, *, by_class: bool = True) -> SimResult:
    """Simulate one iteration. `plan` overrides the plan the policy would make (it must match).

    With `replicate_phase_a`, forward / backward / gradient sync runs on rank 0 only and stands for
    every rank (they are identical); without it every rank runs it, for checking that claim.
    With `by_class` (and `replicate_phase_a`), the optimizer step runs once per class of ranks
    whose steps are the same (`sim.classes`, docs/design.md §9.8) and stands for the class; without
    it every rank runs it, the reference the classes are checked against (the same numbers, bit
    for bit: `tests/sim/test_sim_scale.py`).

    canzona with `zero1_fallback` (its own plan only) is also simulated as its ZeRO-1 fallback
    (`zero1-gather`: even segments, split matrices computed redundantly) and the faster of the two
    is returned, marked in `fell_back_to`. Whole matrices make the DP collectives uneven; once the
    optimizer step is a small part of the iteration (docs/design.md §9.3) that costs more than the
    optimizer work saved, and a planner should say so rather than lose.

    Under expert parallelism, where the configuration leaves the expert plan open, each of its
    candidates (`expert_choices`: the expert buckets' sizing, and under expert TP canzona's
    micro-group capacity) is simulated in the same way and the fastest kept, marked in
    `expert_choice`."""
    cluster, model, hw = cfg.checked(model)  # files are read here, not again by each run below
    lengths = _extrapolated_lengths(cfg, cluster)
    if lengths is not None and plan is None:
        # many micro-batches: two shorter iterations, extended (sim.steady)
        short, long = (simulate(with_micro_batches(cfg, n, cluster.batch_dp), None, replicate_phase_a, model,
                                by_class=by_class) for n in lengths)
        if same_choice(short, long):
            return extrapolate(cfg, short, long, lengths, cfg.workload.micro_batches(cluster.batch_dp))
    if cfg.fsdp:
        if plan is not None:
            raise SpecError("an explicit plan is for the ZeRO-1 layout; under --fsdp the simulator plans the owners")
        # under PP torchtitan's stages, each fully_shard-ed over its own DP group (sim.fsdp_pipeline)
        run = (simulate_fsdp_pipeline if cfg.pp > 1 else simulate_fsdp)(cfg, model, cluster, hw,
                                                                        layer_dims(model[1], model[0]))
        return SimResult(config=cfg, plan=run.plan, memory=run.memory, memory_capacity_bytes=hw.gpu.memory_bytes,
                         iteration_time_s=run.t_end, optimizer_step_s=run.t_end - run.t_sync,
                         grad_sync_end_s=run.t_sync, param_gather_exposed_s=run.stalls,
                         spans=tuple(run.engine.spans), collective_records=tuple(run.engine.records),
                         **timing(run.engine, cfg, model[1], model[0], hw, range(run.members), run.t_sync, run.t_end,
                                  cluster))
    # every candidate plan of the same layout, the fastest iteration kept (the first of equals):
    # the expert plan's choices (`ExpertChoice`), and canzona's ZeRO-1 fallbacks

    def best(c: SimConfig, **kw: Any) -> SimResult:
        runs = [_simulate(c, plan, replicate_phase_a, model, cluster, hw, expert=choice, by_class=by_class, **kw)
                for choice in expert_choices(c, model, cluster)]
        return _fastest(runs)

    result = best(cfg)
    if cfg.policy != "canzona" or not cfg.zero1_fallback or plan is not None or result.plan.dp == 1:
        return result
    # only the policy differs: the checks passed, and the cluster is the same
    candidates = [result, replace(best(with_policy(cfg, "zero1-gather")), config=cfg, fell_back_to="zero1-gather")]
    # two plans: the fallback may pay for one of them only (not in the runtime's collectives: it runs one policy)
    if cfg.ep > 1 and not cfg.options.overlap_step and cfg.options.collectives != RUNTIME_STYLE:
        dense = _simulate(cfg, None, replicate_phase_a, model, cluster, hw, dense_policy="zero1-gather",
                          expert=result.expert_choice, by_class=by_class)  # canzona's experts as its own run chose them
        candidates.append(replace(dense, fell_back_to=DENSE_FALLBACK))
    return _fastest(candidates)


def _fastest(runs: Sequence[SimResult]) -> SimResult:
    """The fastest of the candidate runs of one layout (the first of equals), with the
    reduce-scatters of them all (`SimResult.reduce_scatters`)."""
    kept = min(runs, key=lambda r: r.iteration_time_s)
    return replace(kept, reduce_scatters=tuple(sorted({s for r in runs for s in r.reduce_scatters})))


@dataclass(frozen=True, kw_only=True)
class ExpertChoice:
    """How the expert plan (an EP rank's experts over EDP x ETP) is made where the configuration
    leaves it open, one candidate of `simulate`: the expert buckets' sizing
    (`canzona.dp.layout.EXPERT_BUCKETS`) and the micro-group capacity of its TP scheduler (None:
    the configuration's)."""

    buckets: str = PLAN_DEFAULTS.expert_buckets
    capacity: Capacity | None = None


def expert_choices(cfg: SimConfig, model: tuple[ModelSpec, Architecture], cluster: Cluster) -> list[ExpertChoice]:
    """The expert plans `simulate` tries for `cfg` (the first is the default):
    - the bucket sizing: the configuration's (`expert_buckets`); under `auto`, under EP each sizing
      whose expert buckets differ from the default's on some stage (the same buckets make the same
      plans), at EP 1 the default (the experts share the dense part's plan);
    - under expert TP, for a scheduler with a capacity left to its search, also
      `canzona.plan.BATCH_CAPACITY` (each host's share of a micro-group one batch): the search
      prices matrices one by one, so among an EP rank's many alike experts it cuts groups of one
      or two tasks a host, which then run as that many kernels instead of one batched one."""
    if cfg.ep == 1:
        return [ExpertChoice(buckets=cfg.settings.expert_buckets)]
    spec, arch = model
    experts = cfg.expert_cluster(cluster)
    sizings = [cfg.settings.expert_buckets]
    if cfg.expert_buckets == AUTO_EXPERT_BUCKETS:
        for sizing in (s for s in EXPERT_BUCKETS if s != sizings[0]):
            for stage in range(cfg.pp):
                part = expert_part(stage_spec(spec, cfg.pp, stage, arch.layers, cfg.vp, cfg.pipeline_split), cfg.ep,
                                   cfg.etp, arch.hidden)
                if part.params and bucket_names(part, experts.dp, experts.tp, cfg.bucket_size, sizing) != \
                        bucket_names(part, experts.dp, experts.tp, cfg.bucket_size, sizings[0]):
                    sizings.append(sizing)
                    break
    policy = STEP_POLICIES[cfg.policy]
    searched = TP_REGISTRY[policy.tp_policy or cfg.tp_policy].uses_capacity and cfg.capacity is None
    capacities = [None, BATCH_CAPACITY] if searched and cfg.etp > 1 else [None]
    return [ExpertChoice(buckets=b, capacity=c) for b in sizings for c in capacities]


def timing(engine: Engine, cfg: SimConfig, arch: Architecture, spec: ModelSpec, hw: HardwareProfile,
           ranks: Iterable[int], t_sync: float, t_end: float, cluster: Cluster,
           reps: Sequence[int] | None = None) -> dict[str, Any]:
    """A `SimResult`'s breakdowns from the engine's spans: phase A's on rank 0 (which stands for
    every rank), the optimizer step's on each of `ranks` (their mean), and the MFU. `reps`: per
    rank of `ranks`, the simulated rank whose step it is (`sim.classes`; default itself)."""
    ranks = list(ranks)
    reps = ranks if reps is None else reps
    simulated_a = [s for s in engine.spans if s.phase == "A"]
    phase_a = [s for s in simulated_a if s.rank == 0]
    fb_end = max((s.end for s in simulated_a if s.kind == "compute"), default=0.0)
    by_rank: dict[int, list[Span]] = {r: [] for r in reps}
    for s in engine.spans:
        if s.phase == "B":
            by_rank[s.rank].append(s)
    a = _window_breakdown(phase_a, 0.0, t_sync)
    breakdowns = {r: _window_breakdown(spans, t_sync, t_end) for r, spans in by_rank.items()}
    opt = [breakdowns[r] for r in reps]  # in rank order, as the mean below adds them
    mean = {k: sum(o[k] for o in opt) / len(opt) for k in opt[0]}
    wl = cfg.workload
    model_flops = 3 * forward_flops(arch, spec, wl).total * wl.micro_batches(cluster.batch_dp) * cluster.batch_dp
    peak = hw.gpu.peak_flops.get(wl.dtype, hw.gpu.peak_flops["bf16"])
    mfu = model_flops / (t_end * cluster.gpus * peak) if t_end > 0 else 0.0
    return dict(forward_backward_s=fb_end, mfu=mfu, breakdown={k: a[k] + mean[k] for k in a},
                optimizer_breakdown=mean, rank_optimizer_s=tuple(o["compute_s"] for o in opt),
                gpu_slowdown=engine.slowdown)


def stage_work(cfg: SimConfig, arch: Architecture, head_dim: int, stage_model: ModelSpec, stage: int,
               rate: DeviceRate, fp8: FP8Setup | None) -> MicroBatchWork:
    """One micro-batch of `stage`'s part of the model (`stage_model`) on a rank, as the simulation
    runs it under `cfg` with `fp8`'s overheads: one definition for `_simulate` and the search's
    lower bound (`sim.search.time_floor`), which must price the same kernels."""
    wl = cfg.workload
    o = cfg.options
    # under Megatron's block method only the first N layers of each model chunk are checkpointed
    inside = inside_layers(o.recompute, o.recompute_method, o.recompute_num_layers, o.selective_ac_option,
                           cfg.chunks(arch.layers, stage))
    return micro_batch_work(stage_model, cfg.tp, wl.tokens_per_micro_batch, wl.seq_len,
                            arch.q_dim, arch.hidden, arch.vocab, rate,
                            recompute=cfg.options.recompute, checkpointed=inside, causal=wl.causal, dtype=wl.dtype,
                            head=stage == cfg.pp - 1, experts=arch.moe, ep=cfg.ep,
                            router_imbalance=cfg.router_imbalance if arch.moe else 1.0, etp=cfg.etp,
                            head_dim=head_dim, cp=cfg.cp,
                            kv_dim=arch.kv_dim, fp8=fp8,
                            attention_backend=cfg.options.attention_backend, kernels=wl.kernels,
                            # Megatron's gradient accumulation fusion: wgrad GEMMs add into main_grad
                            accumulate=wl.grad_bytes, dispatcher=cfg.options.ep_dispatcher,
                            cross_entropy=wl.cross_entropy, apply_rope_fusion=wl.apply_rope_fusion,
                            bias_activation_fusion=wl.bias_activation_fusion,
                            # Transformer Engine's userbuffers overlap cuts the overlapped GEMMs into chunks
                            overlap_chunks=gemm_chunks(o.tp_comm_overlap_cfg, cfg.tp)
                            if cfg.tp > 1 and o.tp_comm_overlap and not cfg.fsdp else None)


def _simulate(cfg: SimConfig, plan: Plan | None, replicate_phase_a: bool,
              model: tuple[ModelSpec, Architecture], cluster: Cluster, hw: HardwareProfile,
              dense_policy: str | None = None, expert: ExpertChoice = ExpertChoice(), by_class: bool = True) -> SimResult:
    """One run of a checked configuration (`SimConfig.checked` gave `model`, `cluster` and `hw`);
    `dense_policy`: under expert parallelism, another policy for the dense part (canzona's
    fallback for that part alone); `expert`: how the expert plan is made (at EP 1: the sizing of
    the experts' buckets in the one plan)."""
    if plan is not None and cfg.pp > 1:
        raise SpecError("an explicit plan is for the whole model; with pp > 1 each stage is planned by the simulator")
    if plan is not None and cfg.ep > 1:
        raise SpecError("an explicit plan is for one layout of the whole model; with ep > 1 the simulator plans the "
                        "dense part and the experts")
    expert_policy = STEP_POLICIES[cfg.policy]
    policy = STEP_POLICIES[dense_policy or cfg.policy]
    spec, arch = model
    rate = DeviceRate.from_profile(hw)
    wl = cfg.workload
    # a job waits for its slowest GPU (canzona.variability); communication kernels take SMs from compute (sim.comm_sms)
    engine = Engine(slowdown=cfg.slowdown(hw, cluster.gpus), sms=hw.gpu.sms)
    dims = layer_dims(arch, spec)
    ctxs, plans, memories = [], [], []
    expert_plans: list[Plan] = []
    experts = cfg.expert_cluster(cluster) if cfg.ep > 1 else None
    setup = cfg.memory_setup(arch, tp_mode=cfg.tp_mode,
                             reduce_scatter=cfg.options.reduce_scatter, batch_kernels=cfg.options.batch_kernels,
                             overlap_step=cfg.options.overlap_step)
    for stage in range(cfg.pp):
        stage_model = stage_spec(spec, cfg.pp, stage, arch.layers, cfg.vp, cfg.pipeline_split)
        work = stage_work(cfg, arch, dims.head_dim, stage_model, stage, rate,
                          fp8_setup(wl, hw, cluster, stage_model, stage, cfg.vp))
        expert_ctx = None
        if experts is not None and expert_params(stage_model):  # a plan of their own, over EDP (canzona.experts)
            expert_model = expert_part(stage_model, cfg.ep, cfg.etp, arch.hidden)
            expert_plan = _plan_for(cfg, experts, expert_model, hw, expert_buckets=expert.buckets,
                                    capacity=expert.capacity)
            expert_plans.append(expert_plan)
            expert_ctx = Context(engine, experts, hw, rate, arch, expert_model, wl, expert_plan, expert_policy, work,
                                 cfg.tp_mode, cfg.options, stage, tp_stream=ETP_COMM, matrix_config=cfg.matrix_config)
            stage_model = dense_part(stage_model)
        stage_plan = plan or _plan_for(cfg, cluster, stage_model, hw, policy=policy.name,
                                       expert_buckets=expert.buckets, empty_ok=expert_ctx is not None)
        policy.check_dp_plan(stage_plan.dp_plan)
        policy.check_tp_plan(stage_plan.tp_plan.policy, stage_plan.tp)
        ctxs.append(Context(engine, cluster, hw, rate, arch, stage_model, wl, stage_plan, policy, work,
                            cfg.tp_mode, cfg.options, stage, experts=expert_ctx, matrix_config=cfg.matrix_config))
        plans.append(stage_plan)
        # the dispatcher's buffers are allocated at a stage's first dispatch: none on a stage of dense layers only
        stage_setup = setup if expert_ctx is not None else replace(setup, dispatcher_buffers=0)
        memory = memory_per_gpu(stage_model, stage_plan, policy, dims, stage_setup, dp=cluster.dp, pp=cfg.pp,
                                stage=stage, vp=cfg.vp, split=cfg.pipeline_split, matrix_config=cfg.matrix_config)
        if expert_ctx is not None:
            memory = memory.with_experts(memory_per_gpu(expert_ctx.spec, expert_ctx.plan, expert_policy, dims, setup,
                                                        dp=experts.dp, pp=cfg.pp, stage=stage, vp=cfg.vp,
                                                        split=cfg.pipeline_split, matrix_config=cfg.matrix_config),
                                            cfg.ep, setup)
        memories.append(memory)
    memory = max(memories, key=lambda m: m.worst.total)

    phase = forward_backward(ctxs, all_ranks=not replicate_phase_a, vp=cfg.vp, split=cfg.pipeline_split)
    synced = phase.synced
    sync_times: list[float] = []
    synced.callbacks.append(lambda _: sync_times.append(engine.now))
    # one run of both phases: an overlapped step's micro-groups, and a plain step's prefetched
    # gathers (canzona.step_schedule), start inside phase A, as their buckets land; the rest of
    # the step waits for every stage's gradients (`synced`)
    engine.phase = "B"
    # the step simulated once per class of ranks whose steps are the same (sim.classes), unless
    # phase A runs on every rank or the runtime's collectives are logged (every rank's, by name)
    classes = [step_classes(ctx) if by_class and replicate_phase_a and not ctx.runtime_mode else every_rank(ctx)
               for ctx in ctxs]
    for stage, ctx in enumerate(ctxs):
        optimizer_step(ctx, synced, EarlyStart(phase.bucket_synced[stage], phase.backward_done[stage]), classes[stage])
    t_end = engine.run()
    if not synced.triggered:  # the events ran out with a stage's gradients unsynchronised
        raise RuntimeError("the simulated iteration deadlocked before every stage's gradients were synchronised: "
                           "a simulator bug (two ranks' programs wait for each other); please report the command")
    t_sync = sync_times[0]
    simulated_a = [s for s in engine.spans if s.phase == "A"]  # each stage's first rank (every rank without replication)
    phase_b = [s for s in engine.spans if s.phase == "B"]
    reps = [c.rep(r) for c in classes for r in range(c.first, c.first + cluster.stage_gpus)]  # per rank
    copies: dict[int, list[int]] = {}
    for r, rep in enumerate(reps):
        if rep != r:
            copies.setdefault(rep, []).append(r)
    return SimResult(
        config=cfg,
        plan=plans[0],
        iteration_time_s=t_end,
        optimizer_step_s=t_end - t_sync,
        grad_sync_end_s=t_sync,
        param_gather_exposed_s=sum(phase.stalls),
        **timing(engine, cfg, arch, spec, hw, range(cluster.gpus), t_sync, t_end, cluster, reps),
        memory=memory,
        memory_capacity_bytes=hw.gpu.memory_bytes,
        spans=RankSpans(simulated_a + phase_b, copies),
        expert_plan=expert_plans[0] if expert_plans else None,
        expert_choice=expert,
        collective_records=tuple(engine.records),
        reduce_scatters=tuple(sorted({tuple(s) for ctx in ctxs for c in (ctx, ctx.experts) if c is not None
                                      for s in reduce_scatter_lengths(c.spec, c.plan, c.policy, c.cluster.dp)})),
    )


DENSE_FALLBACK = "zero1-gather for the dense part"


def with_policy(cfg: SimConfig, name: str) -> SimConfig:
    """`cfg` under step policy `name`; `overlap_step` only where the policy can run it (canzona):
    the baselines' owners cannot start before every gradient is reduced and gathered. Under an
    elementwise policy (zero1) a matrix optimizer's configuration becomes the AdamW baseline's."""
    if cfg.fsdp:  # canzona's owner plan settings are its own: a baseline refuses them (`check_fsdp`)
        return replace(cfg, policy=name, **owner_plan_defaults(cfg.optimizer, name))
    options = cfg.options
    if options.overlap_step and not STEP_POLICIES[name].can_overlap_step:
        options = replace(options, overlap_step=False)
    optimizer = policy_optimizer(name, cfg.optimizer)
    if matrix_optimizer(optimizer).elementwise and not matrix_optimizer(cfg.optimizer).elementwise:
        # the matrix optimizer's plan and kernel settings are canzona's, not the baseline's: at their
        # defaults for it, as it runs them (a run of AdamW refuses them set: `ELEMENTWISE_IGNORED`)
        options = replace(options, batch_kernels=RunOptions.batch_kernels)
        return replace(cfg, policy=name, optimizer=optimizer, options=options, matrix_config=None,
                       **dict(ELEMENTWISE_IGNORED))
    return replace(cfg, policy=name, optimizer=optimizer, options=options)


def compared_policies(optimizer: str, fsdp: bool = False) -> tuple[str, ...]:
    """What `compare` runs for `optimizer`: a matrix optimizer's policies and the AdamW baseline
    (zero1) beside them; for AdamW itself, the policies that run it; under `fsdp`, the FSDP
    layout's policies (`FSDP_POLICIES`)."""
    if fsdp:  # an elementwise optimizer steps each rank's shards under FSDP: its own policy only
        return (default_policy(optimizer),) if matrix_optimizer(optimizer).elementwise else tuple(FSDP_POLICIES)
    if matrix_optimizer(optimizer).elementwise:
        return policies_running(optimizer)
    return tuple(STEP_POLICIES)


def compare(base: SimConfig, policies: Iterable[str] | None = None,
            progress: Callable[[str], None] | None = None) -> list[SimResult]:
    """Every policy on `base`'s layout (`compared_policies`; `with_policy`: options a baseline
    cannot run are off for it)."""
    out = []
    for name in compared_policies(base.optimizer, base.fsdp) if policies is None else policies:
        if progress:
            progress(name)
        out.append(simulate(with_policy(base, name)))
    return out


def _extrapolated_lengths(cfg: SimConfig, cluster: Cluster) -> tuple[int, int] | None:
    """The two shorter runs `simulate` extends `cfg`'s iteration from (`sim.steady`), without an
    explicit plan; None: simulated micro-batch by micro-batch (at most `EXACT_MICRO_BATCHES` per
    DP rank, or the runtime's collectives, whose records name every collective issued)."""
    if cfg.options.collectives == RUNTIME_STYLE:
        return None
    return short_lengths(cfg.workload.micro_batches(cluster.batch_dp), cfg.pp)


def check_traceable(cfg: SimConfig) -> None:
    """Refuse, before any simulation, a trace of a configuration `simulate` would extrapolate
    (more than `EXACT_MICRO_BATCHES` micro-batches per DP rank: `sim.steady`)."""
    cluster, _, _ = cfg.checked()
    m = cfg.workload.micro_batches(cluster.batch_dp)
    if _extrapolated_lengths(cfg, cluster) is not None:
        raise SpecError(f"--trace: {m} micro-batches per DP rank are simulated by extrapolation (more than "
                        f"{EXACT_MICRO_BATCHES}), with no trace of their own; trace a global batch of at most "
                        f"{EXACT_MICRO_BATCHES} micro-batches per DP rank")


def write_trace(result: SimResult, path: str | Path) -> None:
    """Chrome / Perfetto trace: one process per rank, one thread per stream. Phase A is simulated on
    each pipeline stage's first rank and identical on the stage's other ranks: they show it as one
    span per stream kind."""
    if result.extrapolated_from is not None:
        m1, m2 = result.extrapolated_from
        raise SpecError(f"no trace of an iteration extrapolated from runs of {m1} and {m2} micro-batches per DP rank "
                        f"(it has more than {EXACT_MICRO_BATCHES}): trace a run of at most that many")
    events: list[dict[str, Any]] = []
    c = result.config
    stage_gpus = c.gpus // c.pp
    reps = {stage * stage_gpus for stage in range(c.pp)}
    simulated = {s.rank for s in result.spans if s.phase == "A"}
    for s in result.spans:
        events.append({"name": s.name, "cat": s.kind, "ph": "X", "ts": s.start * 1e6,
                       "dur": (s.end - s.start) * 1e6, "pid": s.rank, "tid": s.stream})
    for rep in sorted(reps & simulated):
        phase_a = [s for s in result.spans if s.phase == "A" and s.rank == rep]
        fb_end = max((s.end for s in phase_a if s.kind == "compute"), default=0.0)
        dp_spans = [s for s in phase_a if s.stream == "dp-comm"]
        for r in range(rep, rep + stage_gpus):
            if r in simulated:
                continue
            events.append({"name": f"forward/backward (as rank {rep})", "cat": "compute", "ph": "X", "ts": 0.0,
                           "dur": fb_end * 1e6, "pid": r, "tid": "compute"})
            for s in dp_spans:
                events.append({"name": s.name, "cat": s.kind, "ph": "X", "ts": s.start * 1e6,
                               "dur": (s.end - s.start) * 1e6, "pid": r, "tid": s.stream})
    for r in range(c.gpus):
        events.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
    write_text_atomic(path, dumps_json({"traceEvents": events, "displayTimeUnit": "ms",
                                        "otherData": {"definitions": DEFINITIONS}}), "trace")
