"""`DistributedOptimizer`: executes a `Plan` on real process groups, DP x TP.

Composed of one part per job (docs/architecture.md §3.8):
- `GradientSync` (`gradients.py`): flat per-bucket gradient buffers laid out by the plan, whose
  reduce-scatter starts from post-accumulate-grad hooks in bucket order, and the per-step checks;
- `MatrixStep` (`executor.py`): this DP rank's TP schedule (`canzona.step_schedule`) on its TP
  group: micro-groups gathered to hosts, computed, scattered back and applied, pipelined or serial
  (at TP = 1, compute and apply);
- AdamW on this rank's even slice of the flat AdamW buffer (ZeRO-1), then the parameter all-gather
  the step policy asks for (`PARAM_GATHERS`);
- the checkpoint adapter (`checkpoint.py`): layout-independent and sharded state dicts.

Each is chosen once, at construction, from the step policy's definition
(`canzona.step_policies`): `canzona` (reduce-scatter-v on the plan's segments, the plan's TP
micro-groups), `zero1-gather`, `layerwise` and `sc` (their own DP plans, `tp-sync`).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import inspect
import logging
import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from canzona.cost import CostModel
from canzona.dp.layout import BucketPlan, check_expert_buckets
from canzona.errors import CanzonaError, PlanError, SpecError
from canzona.experts import dense_part, expert_part
from canzona.fsdp_collectives import PARAMETERS_VERDICT
from canzona.optimizers import (
    AdamWConfig,
    check_matrix_optimizer,
    matrix_optimizer,
)
from canzona.plan import (
    DEFAULT_GEOMETRY,
    PLAN_DEFAULTS,
    Plan,
    PlanSettings,
    check_geometry,
    check_plan_config,
    check_plan_matches,
    check_plan_settings,
    load_plan,
    plan_for,
)
from canzona.reductions import check_reduce_scatter
from canzona.runtime import amp_handles, checkpoint, dtensor_amp
from canzona.runtime.amp_marks import AmpMarks
from canzona.runtime.batched import check_compile, matrix_kernels
from canzona.runtime.buffers import FlatBuffer, Piece, pieces_of
from canzona.runtime.comm import Comm, PartsDigest, PendingWork
from canzona.runtime.executor import MatrixStep
from canzona.runtime.expert_part import (
    EDP,
    EP,
    ExpertPart,
    build_expert_part,
    check_expert_layout,
    check_expert_stack,
    expert_groups,
)
from canzona.runtime.grad_guard import handed_inverse_scale
from canzona.runtime.gradients import (
    GradientSync,
    StepCheck,
    clip_threshold_word,
    combine_norm_terms,
    local_norm_term,
)
from canzona.runtime.groups import (
    GroupConfigs,
    build_param_groups,
    check_groups_now,
    check_members,
    defaults_of,
    group_betas,
    group_lr,
    group_matrices,
    group_members,
    hyper_parameters_digest,
    members_changed,
    user_groups,
)
from canzona.runtime.hf_tp import check_tp_styles
from canzona.runtime.kernels import (
    StepBetas,
    adamw_step_,
    autocast_off,
    eager_only,
    run_step,
    update_target,
)
from canzona.runtime.mesh import DP, TP, axis_groups, build_mesh
from canzona.runtime.model_loads import (
    LOADED_ADVICE,
    WeightVersions,
    clear_marks,
    note_writes,
    record_writes,
    renormed_in_forward,
    watch_model_loads,
)
from canzona.runtime.not_pickled import NotPickled
from canzona.runtime.optim_hooks import load_with_hooks, state_dict_with_hooks
from canzona.runtime.options import (
    COST_MODEL_ADVICE,
    COST_MODEL_FACT,
    check_step_options,
    optimizer_config,
    planning_cost_model,
)
from canzona.runtime.param_gather import (
    Holders,
    ModuleLinks,
    ParamsInFlight,
    Parents,
    check_not_unsharded,
    module_links,
    modules_holding,
    param_holders,
    replaced_parameter,
)
from canzona.runtime.shards import check_local_param, check_not_meta, is_dtensor, local_tensor
from canzona.runtime.wrappers import wrapper_message
from canzona.spec import ModelSpec, Role
from canzona.step_options import STEP_DEFAULTS, check_elementwise_options
from canzona.step_policies import (
    PARAMS_BY_OWNER,
    PARAMS_BY_SEGMENT,
    PARAMS_NONE,
    StepPolicy,
    get_step_policy,
    resolve_policy,
)
from canzona.step_schedule import TPSchedule, check_tp_mode, tp_schedule
from canzona.tp import Capacity, check_tp_policy

log = logging.getLogger("canzona")


class DistributedOptimizer(NotPickled, torch.optim.Optimizer):
    """A matrix optimizer (`canzona.optimizers.MATRIX_REGISTRY`) plus AdamW, data- and tensor-parallel;
    or, with `optimizer="adamw"`, AdamW on every parameter as Megatron's distributed optimizer runs
    it (policy `zero1`: even segments, each rank updating the pieces of matrices they hold; its
    hyper-parameters in `adamw_config`), the run to price the matrix optimizers against.

    `params`: `(name, parameter)` pairs (e.g. `model.named_parameters()`), or torch-style groups of
    them with hyper-parameter overrides (`canzona.runtime.groups`). `matrix_config` and
    `adamw_config` are the defaults of every group. `spec` describes the *global* model; under TP
    the parameters are this rank's shards (plain tensors, Megatron-annotated ones, or DTensors from
    `parallelize_module`, `canzona.runtime.shards`).

    Planning (without a `plan`): `dp_policy`, `tp_policy`, `alpha`, `bucket_size`, `align`,
    `capacity`, `balance_by` and `expert_buckets` (how buckets of stacked expert matrices are
    sized: `canzona.dp.layout.EXPERT_BUCKETS`) are `canzona.plan.PlanSettings`'s, with its defaults
    (`PLAN_DEFAULTS`), as `canzona plan` and `canzona simulate` take them; a step policy with its
    own DP or TP policy (the baselines) overrides those two; under an elementwise optimizer (AdamW)
    the settings its step does not read are refused off their defaults
    (`canzona.step_options.check_elementwise_options`, as `canzona simulate` refuses them). Without a
    `plan`, `cost_model` prices each matrix's step for the balance: None is the profile of the GPU the
    parameters are on (`canzona.hardware.profile_for_device`; the default profile's on the CPU or a
    GPU without one, as `canzona plan` without `--hardware`). Given beside a `plan`, one off its default
    must be what the plan was made with (`canzona.plan.check_plan_settings`: one PlanError otherwise,
    where it was run as the plan said, silently, until 2026-11-30). `geometry` (`canzona.plan.GEOMETRIES`):
    `"auto"` (default) keeps ZeRO-1's even segments where whole matrices plan no shorter step (the
    ranks then fetch the parts of the matrices that straddle a cut, as zero1-gather's do),
    `"whole"` always whole matrices; `overlap_step` plans whole matrices. The plan is balanced for
    the step this optimizer runs, priced at `matrix_config` (`canzona.plan.plan_for`'s option of that
    name: `canzona plan --matrix-config` writes the same plan, on the GPU its `--hardware` names).

    `group`: the data-parallel process group, or a `DeviceMesh` (1-D, or with dimensions named
    after the axes, `dp` and, for tensor parallelism, `tp`); `tp_group` gives the TP group when
    `group` is a process group. `self.mesh` holds one communicator per named axis
    (`canzona.runtime.mesh`). `tp_mode`: `pipelined` (default) or `serial` order of the TP
    micro-groups.

    `reduce_scatter`: how gradients are reduce-scattered over DP (`canzona.reductions`): `native`
    (default; the backend's own reductions, per bucket a reduce-scatter into the bucket itself
    or one reduce per owner, no receive buffer; equal to the single-process reference within
    rounding, bit for bit at DP 2), `exact` (one all-to-all and a sum in rank order: bit for bit
    at any DP size, what `canzona verify` checks, at `n x` the segment of temporary memory),
    `loops` or `padded`. `canzona simulate --reduce-scatter` prices each.

    Low-precision (bf16 / fp16) parameters get fp32 master weights, fp32 gradient reduction and
    fp32 optimizer state by default; the bf16 working copy is refreshed after each step.
    `master_weights=False` keeps everything in the parameters' dtype.

    `max_grad_norm`: clip the reduced gradients to this global 2-norm inside `step()` (Megatron's
    `clip_grad`; None: no clipping there, `clip_grad_norm_()` still clips). `nonfinite`: what a
    step whose global gradient norm is NaN or Inf does, before anything is updated: `raise` (a
    `CanzonaError` on every rank) or `skip` (every rank skips it, as `torch.amp.GradScaler`
    skips; counted in `skipped_steps` and logged on the `canzona` logger). `torch.amp.GradScaler`
    works as with torch's optimizers (`unscale_(opt)`, then `clip_grad_norm_()`; `step(opt)`;
    `update()`): it unscales the reduced gradients and finds the same inf on every rank
    (`_amp_unscale`), whatever `nonfinite` says.

    Gradients: backward hooks move each gradient into the optimizer's buffers and leave a guard
    in `.grad` until `zero_grad()` (`canzona.runtime.grad_guard`): reading or writing it between
    backward and `step()` (torch's `clip_grad_norm_`, DDP) is one error on every rank.

    `overlap_param_gather` (default, Megatron's name): `step()` launches the parameter all-gathers
    and returns; the next forward waits for each bucket just before the first module holding one of
    its parameters runs, and `state_dict()` / `load_state_dict()` of those modules, this
    optimizer's methods and `wait_params()` wait for all, and any other read of a parameter's values
    waits for its own (`canzona.runtime.param_gather`: what that covers and what it does not).
    False: the step returns with the parameters gathered.

    `overlap_step`: each micro-group's update is computed as soon as the buckets holding its
    matrices have been reduced, under the reductions still in flight (on CUDA: after backward's
    kernels, on the same stream), from a copy of its state, and held; after the step check (finite
    norm, agreement, clipping) the updates are applied and the copies adopted, bit for bit what the
    plain step computes. A step whose gradients clipping scales, or whose hyper-parameters changed
    since, drops them and runs the plain step; a skipped step drops them. Under torch.amp.GradScaler
    they are computed from the gradients times its inverse scale, the product its unscale then
    gives the reduced gradients, and kept (`_speculate`). It costs a copy of the
    state this rank hosts and every update held until the check (`canzona.memory` counts both);
    canzona's policy only (the baselines' owners need every gradient first). Without it, canzona's
    plain step still issues the TP schedule's leading gathers (`TPSchedule.prefetched`) as their
    buckets land, before the step check: they move reduced gradients only (clipping scales what
    arrived by the same factor, bit for bit), so the hosts' first compute does not wait for them.

    `batch_kernels` (default): the same-shape matrices a rank computes in one micro-group (at TP = 1:
    in consecutive ones) run as one batched kernel, their GEMMs as one `bmm` over a stack; on CPU
    the result is the per-matrix kernel's bit for bit (`canzona.runtime.batched`: how, and what
    stays per matrix). `compile_kernels`: Muon's Newton-Schulz iterations through `torch.compile`
    (inductor: a C++ compiler on CPU, Triton on CUDA, checked here); close to the eager result,
    not bit-identical (inductor reorders arithmetic), so keep it the same on every rank; with an
    optimizer without a compiled form (all but Muon) it is refused (`check_compile_kernels`).

    `expert_mesh`: expert parallelism for a mixture-of-experts model (`canzona.runtime.expert_part`):
    a 2-D `DeviceMesh` with dimensions named `edp` and `ep` folding the dense part's `dp x tp`
    ranks (Megatron's MoE parallel folding with expert TP 1: `init_device_mesh(device,
    (dp * tp // ep, ep), mesh_dim_names=("edp", "ep"))`, EP groups of `ep` consecutive ranks; its
    `ep` group is the one the model dispatches its tokens over, each TP rank its own share of its
    DP rank's tokens). Each rank then holds its EP rank's experts whole (stacks of `experts / ep`,
    under the model's names; `spec` stays the whole model's): the dense part is planned and stepped
    over DP (x TP, its parameters this rank's TP shards as without EP), the experts over their EDP
    group at TP 1, each expert matrix owned whole by one EDP rank, their gradients reduced over EDP
    and scaled to the global mean loss's (`edp / dp` times the EDP mean); one step check covers
    both parts (every expert gradient element counted once in the global norm). An expert mesh
    whose sizes or ranks do not fold the dense mesh's is one `SpecError` on every rank. `plan`
    under EP is a plan holding the experts' plan (`canzona plan --ep --out`). Checkpoints keep the
    experts under the model's names (any EP size, TP size or DP size loads them). `overlap_step`
    computes the experts' updates as their EDP buckets land, as the dense part's. Not run: expert
    TP (a plan with etp > 1 is one error), experts held as DTensors over the EP mesh (torchtitan's
    layout: one error asking for the plain local stack).

    Collective calls, which every rank must make together: construction, `step()`,
    `clip_grad_norm_()`, `state_dict()`, `sharded_state_dict()` and `load_sharded_state_dict()`.
    Each waits at most `timeout_s` for the other ranks.
    """

    def __new__(cls, params: Any = (), spec: Any = None, *args: Any, **kwargs: Any) -> Any:
        """A model sharded by torch's FSDP2 (`fully_shard`: DTensor parameters on a mesh that is more
        than a TP group) gets the FSDP step (`canzona.runtime.fsdp.FsdpOptimizer`); every other
        model this class. The parameters, often a one-shot generator, are read once here."""
        given = params if isinstance(params, (list, tuple)) else list(params)
        if cls is DistributedOptimizer:
            from canzona.runtime.fsdp import FsdpOptimizer, _flat_pairs, is_fsdp_sharded

            bound = inspect.signature(cls.__init__).bind(None, given, spec, *args, **kwargs).arguments
            group = bound.get("group")
            try:
                axes = _fsdp_axes(group, bound.get("tp_group"))
                tp_pg = axes[TP] if axes[TP] is not None and dist.get_world_size(axes[TP]) > 1 else None
                tp_ranks = dist.get_process_group_ranks(tp_pg) if tp_pg is not None else None
                dp_ranks = [int(r) for r in group.mesh.flatten().tolist()] if isinstance(group, DeviceMesh) else \
                    dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
                fsdp = is_fsdp_sharded(_flat_pairs(given), dp_ranks, tp_ranks)
            except (SpecError, ValueError, RuntimeError):
                fsdp = False  # the constructor reports what is wrong with the groups
            if fsdp:  # every option as this constructor takes it (its defaults: one definition)
                options = inspect.signature(cls.__init__).bind(None, given, spec, *args, **kwargs)
                options.apply_defaults()
                defaults = {k: p.default for k, p in options.signature.parameters.items()}
                return FsdpOptimizer({k: v for k, v in options.arguments.items() if k != "self"}, defaults)
        self = super().__new__(cls)
        self._given_params = given
        return self

    def __init__(
        self,
        params: Iterable[tuple[str, Tensor]] | Iterable[Mapping[str, Any]],
        spec: ModelSpec,
        optimizer: str = "muon",
        matrix_config: Any = None,
        adamw_config: AdamWConfig | Mapping | None = None,
        plan: Plan | str | Path | None = None,
        policy: str | None = None,
        dp_policy: str = PLAN_DEFAULTS.dp_policy,
        alpha: float = PLAN_DEFAULTS.alpha,
        bucket_size: int | None = PLAN_DEFAULTS.bucket_size,
        group: dist.ProcessGroup | DeviceMesh | None = None,
        timeout_s: float = 120.0,
        align: int = PLAN_DEFAULTS.align,
        cost_model: CostModel | None = None,
        master_weights: bool = STEP_DEFAULTS.master_weights,
        tp_group: dist.ProcessGroup | None = None,
        tp_policy: str = PLAN_DEFAULTS.tp_policy,
        tp_mode: str = STEP_DEFAULTS.tp_mode,
        reduce_scatter: str = STEP_DEFAULTS.reduce_scatter,
        max_grad_norm: float | None = STEP_DEFAULTS.max_grad_norm,
        nonfinite: str = "raise",
        overlap_param_gather: bool = STEP_DEFAULTS.overlap_param_gather,
        *,
        batch_kernels: bool = STEP_DEFAULTS.batch_kernels,
        compile_kernels: bool = STEP_DEFAULTS.compile_kernels,
        overlap_step: bool = STEP_DEFAULTS.overlap_step,
        capacity: Capacity | None = PLAN_DEFAULTS.capacity,
        balance_by: str = PLAN_DEFAULTS.balance_by,
        expert_buckets: str = PLAN_DEFAULTS.expert_buckets,
        geometry: str = DEFAULT_GEOMETRY,
        expert_mesh: DeviceMesh | None = None,
    ) -> None:
        params = self.__dict__.pop("_given_params", params)  # read once by __new__
        # everything that can be wrong locally fails here, on every rank, before any collective
        check_step_options(timeout_s=timeout_s, max_grad_norm=max_grad_norm, nonfinite=nonfinite,
                           batch_kernels=batch_kernels, compile_kernels=compile_kernels, overlap_step=overlap_step)
        self.geometry = check_geometry(geometry)
        check_expert_buckets(expert_buckets)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.timeout_s = float(timeout_s)  # what every collective call waits at most (the checkpoints' too)
        self._nonfinite = nonfinite
        self.skipped_steps = 0  # steps skipped for a non-finite gradient norm (nonfinite="skip")
        self.overlapped_steps = 0  # steps that applied the updates overlap_step computed early
        self._amp = AmpMarks()  # where GradScaler's unscale and the clip stand in this step
        self.optimizer = check_matrix_optimizer(optimizer)
        # AdamW on every parameter (the baseline): each rank updates the pieces its segments hold
        self.elementwise = matrix_optimizer(self.optimizer).elementwise
        self.policy: StepPolicy = get_step_policy(resolve_policy(policy, self.optimizer))
        self.policy.check_optimizer(self.optimizer)
        self.policy.check_overlap_step(overlap_step)
        self.overlap_step = overlap_step
        self.tp_mode = check_tp_mode(tp_mode)
        check_reduce_scatter(reduce_scatter)
        check_tp_policy(tp_policy)  # an unknown name is a typo, never a no-op (as the simulator's)
        # what this optimizer's step would not read, set (AdamW's plan settings, batch_kernels=False
        # without a batched kernel): one SpecError, as `canzona simulate` refuses the same
        check_elementwise_options(self.optimizer, {"alpha": alpha, "geometry": geometry, "tp_policy": tp_policy,
                                                   "tp_mode": tp_mode, "capacity": capacity,
                                                   "batch_kernels": batch_kernels,
                                                   "compile_kernels": compile_kernels})
        if self.elementwise and matrix_config is not None:
            raise SpecError(f"{self.optimizer} runs every parameter with adamw_config; give its hyper-parameters "
                            "there (matrix_config is for a matrix optimizer)")
        self.adamw_cfg = optimizer_config("adamw", adamw_config)
        self.matrix_cfg = self.adamw_cfg if self.elementwise else optimizer_config(self.optimizer, matrix_config)
        self.spec = spec
        # expert parallelism: the experts' EDP and EP groups (canzona.runtime.expert_part)
        expert_pgs = expert_groups(expert_mesh) if expert_mesh is not None else None
        self.ep = dist.get_world_size(expert_pgs[1]) if expert_pgs is not None else 1
        # the model as this rank holds it: under EP its stacks hold this EP rank's experts
        self._dense_spec = dense_part(spec) if self.ep > 1 else spec
        self._expert_spec = expert_part(spec, self.ep) if self.ep > 1 else None
        self._expert_names = _names(self._expert_spec) if self._expert_spec is not None else set()
        groups = user_groups(params, spec)
        self.batch_kernels, self.compile_kernels = batch_kernels, compile_kernels
        # what this rank alone may refuse (its parameters, its compiler, a plan file on its disk):
        # spread over the groups below (`_spread_refusal`); the parameters are checked before
        # anything asks the process groups, which may not exist (one line without them, then)
        axes = axis_groups(group, tp_group)
        tp_pg = axes[TP] if axes[TP] is not None and dist.get_world_size(axes[TP]) > 1 else None
        tp_ranks = dist.get_process_group_ranks(tp_pg) if tp_pg is not None else None
        self.tp = len(tp_ranks) if tp_ranks else 1
        # any exception, not only a refusal: an unexpected failure on one rank (an out-of-memory, a
        # bug) must not leave the others waiting in the agreement check either
        refusal: Exception | None = None
        try:
            if compile_kernels:  # a missing compiler fails construction, not a step
                check_compile(local_tensor(p).device.type for pairs, _ in groups for _, p in pairs)
            # which parameters the matrix optimizer's groups hold (none: every one is on AdamW)
            # (a stacked expert parameter is the matrix optimizer's: each of its matrices is one)
            matrix_names = set() if self.elementwise else {p.name for p in (*spec.matrix_params(), *spec.stacks)}
            param_groups = build_param_groups(groups, matrix_names, self.optimizer, self.matrix_cfg,
                                              self.adamw_cfg, spec)
            self.params = self._local_params(groups, tp_ranks)
            _check_not_held(self.params)
            # the modules holding each parameter now, and (the same walk of gc) the modules around them
            parents: Parents = {}
            holders = param_holders(self.params, parents)
            check_not_unsharded(self.params, holders, parents)  # FSDP2's full parameters after a forward
            check_tp_styles(holders)  # transformers' TP styles whose gradient hooks canzona cannot run
        except Exception as e:
            if not dist.is_initialized():
                raise  # no group to tell
            refusal = e
        self.mesh = build_mesh(axes, timeout_s, reduce_scatter)
        self.comm, self.tp_comm = self.mesh.comm(DP), self.mesh.comm(TP)
        self.dp, self.rank = self.comm.size, self.comm.rank
        self.tp_rank = self.tp_comm.rank if self.tp_comm else 0
        self._expert_comms: tuple[Comm, Comm] | None = None  # (EDP, EP)
        if refusal is None:
            try:
                if self.ep > 1:
                    dp_ranks = dist.get_process_group_ranks(axes[DP]) if axes[DP] is not None else \
                        range(dist.get_world_size())
                    check_expert_layout(spec, self.ep, self.dp, self.tp, expert_mesh,
                                        [*dp_ranks, *(tp_ranks or ())])
                    self._expert_comms = (Comm(expert_pgs[0], timeout_s, EDP, reduce_scatter=reduce_scatter),
                                          Comm(expert_pgs[1], timeout_s, EP))
                    for comm in self._expert_comms:  # one issue order over every log (CollectiveRecord.seq)
                        comm.log.clock = self.comm.log.clock
                settings = PlanSettings(dp_policy=dp_policy, tp_policy=tp_policy, alpha=alpha,
                                        bucket_size=bucket_size, align=align, capacity=capacity,
                                        balance_by=balance_by, expert_buckets=expert_buckets)
                # under EP the dense part's plan, holding the experts' of this EP rank over EDP (TP 1)
                self.plan = self._resolve_plan(plan, settings, cost_model)
            except Exception as e:
                refusal = e
        self._spread_refusal(refusal)
        self._expert_plan = self.plan.experts
        self._check_agreement(param_groups)

        configs = {"matrix": self.matrix_cfg, "adamw": self.adamw_cfg}
        super().__init__(param_groups, {})  # every group holds all of its optimizer's keys already
        # what LR schedulers read (OneCycleLR's momentum cycling); set after the groups are added,
        # as torch fills every key of `defaults` into every group, including the other optimizer's
        self.defaults = defaults_of(configs)
        # torch.distributed.checkpoint's get/set_optimizer_state_dict take an empty `state` for an
        # optimizer that never stepped and run a zero-gradient step to fill it (a collective, and
        # a change of momentum); this optimizer's state lives in its own structures
        self.state = checkpoint.StateHeldElsewhere(weakref.proxy(self))  # weakly: no cycle (`_Weak`)
        checkpoint.label_groups(self)  # the keys torch's flattened state dict is rebuilt from
        self._configs = GroupConfigs(configs, group_matrices(self.param_groups, self.params, spec))
        group_of = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        self._group_of = {n: group_of[id(p)] for n, p in self.params.items()}
        self._group_members = group_members(self.param_groups)  # what the step runs, group by group

        # bf16 / fp16 models: fp32 master weights, gradients reduced in fp32 and fp32 optimizer
        # state (as Megatron's distributed optimizer); master_weights=False keeps all of it in the
        # parameters' dtype
        low = {p.dtype for p in self.params.values()} & {torch.bfloat16, torch.float16}
        self.master_weights = bool(master_weights and low)
        reduce_dtype = torch.float32 if self.master_weights else None
        dense = {n: p for n, p in self.params.items() if n not in self._expert_names}
        self.grads = GradientSync(dense, self._dense_spec, self.plan, self.policy, self.comm, self.tp_comm,
                                  reduce_dtype, nonfinite)
        # its gradient hooks go when the optimizer does (`_unhook`), one that failed further down its
        # construction too (an out-of-memory: a notebook's retry left one more set on the parameters)
        hooks = list(self.grads._hooks)
        weakref.finalize(self, _unhook, hooks)
        self._index = self.grads.index
        # the entries the plan places (a stack's matrices) in their parameter's group
        self._group_of.update({e: self._group_of[n] for e, n in self.grads.stacks.param_of.items()})
        grad_dtype = self.grads.adamw.reduced.dtype if not self.grads.buckets else \
            self.grads.buckets[0].reduced.dtype  # what the matrices' gradients are reduced in
        update_dtype = torch.float32 if self.master_weights else grad_dtype
        self.schedule: TPSchedule = tp_schedule(
            self.plan, self._dense_spec, self.policy, self.rank, self.tp_mode,
            grad_bytes=grad_dtype.itemsize, update_bytes=update_dtype.itemsize, overlap_step=overlap_step)
        # the matrices whose shards this rank updates, and those whose full update (and optimizer
        # state) it computes: the same at TP = 1
        self.applies = [t.name for t in self.schedule.tasks()]
        self.hosted = [t.name for t in self.schedule.hosted(self.tp_rank)]
        self.matrix_state: dict[str, dict] = {n: {} for n in self.hosted}
        # the steps each matrix this rank applies took, kept alike on its TP ranks: the receivers of
        # update chunks compute the update's scalars from it (MatrixStep; set on load)
        self.matrix_steps: dict[str, int] = {n: 0 for n in self.applies}
        self.adamw_state: dict[str, dict] = {}
        self.master: dict[str, Tensor] = {}  # fp32 copies of what this rank updates, by name
        device = local_tensor(next(iter(self.params.values()))).device
        kernel, batched = matrix_kernels(self.optimizer, batch=batch_kernels, compile=compile_kernels)
        # an elementwise optimizer has no scalars part, and no matrix to run through the executor
        scalars = matrix_optimizer(self.optimizer).part("scalars") or _no_matrices
        self.matrix_step = MatrixStep(self.schedule, self.tp_comm, self.tp_rank, kernel, self.matrix_state,
                                      grad_dtype, update_dtype, device, scalars=scalars, batched=batched,
                                      steps=self.matrix_steps)
        self.experts: ExpertPart | None = None
        if self.ep > 1:
            self.experts = build_expert_part(
                self, {n: p for n, p in self.params.items() if n in self._expert_names}, self._expert_spec,
                self._expert_plan, self.policy, self._expert_comms, reduce_dtype=reduce_dtype,
                tp_mode=self.tp_mode, kernel=kernel, batched=batched, scalars=scalars, update_dtype=update_dtype,
                device=device, overlap_step=overlap_step, hooks=hooks)
            self._group_of.update({e: self._group_of[n] for e, n in self.experts.grads.stacks.param_of.items()})
        if self.master_weights:
            self.reset_master_weights()
        self._param_gather = PARAM_GATHERS[self.policy.param_gather]
        for grads in self._syncs():
            held = {n: h for n, h in holders.items() if n in grads.params}
            grads.replaced_check = functools.partial(_Weak(self, "_changed"), functools.partial(
                replaced_parameter, grads.params, held, ModuleLinks(module_links(held, parents),
                                                                    {n: grads.params[n] for n in held}),
                missed=_Weak(grads, "missed_gradients")))
        self._in_flight = self._params_in_flight(overlap_param_gather, holders, parents)
        # the model's weights loaded on some ranks only from now on: the next step compares them
        # (`canzona.runtime.model_loads`)
        # (`_dense_loaded`: a load or write of dense weights, the mark the TP ranks compare)
        # (`_renormed_loaded`: a load reached a weight an embedding renormalises in its forward,
        # max_norm, which the comparison after a load cannot read: the ranks compare this mark)
        # (`_experts_loaded`: a load_state_dict of experts only, which the DP ranks compare: a load on
        # some EP ranks' replicas only leaves every checksum the ranks compare equal)
        clear_marks(self)
        modules = {n: [ref() for ref, _ in refs] for n, refs in holders.items()}
        # and written in place (`note_writes`): the dense weights and the experts' apart; an embedding
        # that renormalises its rows in its forward (max_norm) writes its weight at every step
        unwatched = self._renormed = renormed_in_forward(modules)
        watch_model_loads(self, holders, unwatched, self._expert_names)
        self._weight_versions = WeightVersions(p for n, p in self.params.items()
                                               if n not in unwatched and n not in self._expert_names)
        self._expert_versions = WeightVersions(p for n, p in self.params.items()
                                               if n not in unwatched and n in self._expert_names)
        del modules
        del parents  # strong references to every live module: not kept
        self.overlap_param_gather = self._in_flight is not None
        if self._in_flight is not None:
            for grads in self._syncs():
                grads.read_check = self._in_flight.check_read
        unscale = _Weak(self, "_amp_unscale")  # one for every part: the guards tell their optimizer by it
        for grads in self._syncs():
            grads.unscale = unscale
        # the dense check is global (under EP it carries the experts' norm): it reads every weight
        params = self.params
        self.grads.weights = lambda: [(n, local_tensor(p)) for n, p in params.items()]
        if any(is_dtensor(p) for p in self.params.values()):
            # GradScaler's one op over every `.grad` then mixes guards and DTensors wrapping guards,
            # which DTensor's dispatch takes and refuses ('got mixed torch.Tensor and DTensor'):
            # the op on these gradients comes to `_amp_unscale` through dtensor_amp's handler
            dtensor_amp.install(self)
        if overlap_step:
            self.grads.early_work = functools.partial(_Weak(self, "_speculate"), self.matrix_step)
            if self.experts is not None:  # the experts' updates as their EDP buckets land
                self.experts.grads.early_work = functools.partial(_Weak(self, "_speculate"), self.experts.matrix_step)
        elif self.schedule.prefetched:
            self.grads.early_work = self.matrix_step.prefetch
        _LIVE.add(self)

    # --- construction helpers ----------------------------------------------------------------

    def _params_in_flight(self, overlap: bool, holders: Holders, parents: Parents) -> ParamsInFlight | None:
        """The step's gathers left in flight for the next forward to wait for (None: waited inside
        `step()`, as with overlap_param_gather=False, a policy that gathers nothing, or parameters
        that no module holds, which no hook could guard)."""
        if not overlap or self.policy.param_gather == PARAMS_NONE:
            return None
        modules = modules_holding(self.params, holders)
        if modules is None:
            log.warning("canzona: overlap_param_gather needs every parameter held by a module (its forward "
                        "waits for the parameters); some are not: the step gathers them before it returns")
            return None
        # the gathers in launch order (`_launch_gathers`): each part's buckets, then its AdamW buffer
        works_of, first = {}, 0
        for grads in self._syncs():
            works_of.update({name: tuple(first + k for k in grads.buckets_of[name]) or (first + len(grads.buckets),)
                             for name in grads.params})
            first += len(grads.buckets) + 1
        return ParamsInFlight(works_of, modules, self.params, parents)

    def wait_params(self) -> None:
        """Wait for the last step's parameter all-gathers (overlap_param_gather): for code that reads
        the values of parameters that `step()` does not mark (another class than `nn.Parameter`: a
        DTensor) outside a module's forward, and before a `torch.compile`d function taking the
        parameters as arguments (it would recompile at each step); reads of the others wait by
        themselves (`canzona.runtime.pending_params`). Local: no collective."""
        if self._in_flight is not None:
            self._in_flight.wait_all()

    def _local_params(self, groups: list, tp_ranks: list[int] | None) -> dict[str, Tensor]:
        params: dict[str, Tensor] = {}
        for pairs, _ in groups:
            for name, p in pairs:
                if name in params:
                    raise SpecError(f"parameter {name!r} is given twice")
                if _is_fsdp_flat_parameter(p):
                    raise SpecError(wrapper_message("FSDP (FullyShardedDataParallel)"))
                check_not_meta(name, p)
                if not p.requires_grad:
                    raise SpecError(f"parameter {name!r} does not require gradients: leave frozen parameters "
                                    "out of the optimizer and the spec (canzona.runtime.modules.named_parameters "
                                    "and ModelSpec.from_module skip them)")
                whole = self.spec.param(name)
                if whole.role is Role.EXPERT and whole.matrix_shape is not None:
                    check_expert_stack(name, p, whole, self.ep)
                local = self._expert_spec if self.ep > 1 and name in self._expert_names else self.spec
                check_local_param(name, p, local.param(name), self.tp, tp_ranks)
                params[name] = p
        missing = [p.name for p in self.spec.params if p.name not in params]
        if missing:
            raise PlanError(f"the model spec has parameters that were not given, e.g. {missing[0]}")
        return params

    def _resolve_plan(self, plan: Plan | str | Path | None, settings: PlanSettings,
                      cost_model: CostModel | None) -> Plan:
        given = plan is not None
        if plan is None:
            # balanced for the step this optimizer runs: its matrix_config's seconds and state, as
            # `canzona plan --matrix-config` and the simulator price it (an elementwise one has none)
            # the GPU's own profile where cost_model is None (`planning_cost_model`), as --hardware
            cost_model = planning_cost_model(cost_model, local_tensor(next(iter(self.params.values()))).device)
            plan = plan_for(self.spec, self.dp, self.tp, self.optimizer, self.policy, settings, cost_model,
                            ep=self.ep, geometry=self.geometry, overlap_step=self.overlap_step,
                            matrix_config=None if self.elementwise else self.matrix_cfg)
        elif not isinstance(plan, Plan):
            plan = load_plan(plan)
        check_plan_matches(plan, self.spec, dp=self.dp, tp=self.tp, ep=self.ep)
        if plan.optimizer != self.optimizer:
            raise PlanError(f"plan is for {plan.optimizer}, but the optimizer is {self.optimizer}")
        check_plan_config(plan, self.spec, None if self.elementwise else self.matrix_cfg)
        if given:  # its settings, not this optimizer's planning ones (canzona.plan.check_plan_settings)
            check_plan_settings(plan, self.policy, settings, self.geometry)
        try:
            for part in (plan, plan.experts) if plan.experts is not None else (plan,):
                self.policy.check_dp_plan(part.dp_plan)
                self.policy.check_tp_plan(part.tp_plan.policy, part.tp)
        except SpecError as e:
            raise PlanError(str(e)) from None
        return plan

    def _spread_refusal(self, refusal: Exception | None) -> None:
        """Every rank learns whether any refused what it alone checks, and raises at once: the
        refusing rank its own error, the others one naming it (before, they waited in the agreement
        check until timeout_s). Over DP, then TP: every TP group meets every DP group, so that
        reaches every rank (the experts' ranks are the dense part's, folded). Not logged, as the
        agreement check it precedes."""
        error = None if refusal is None else str(refusal)
        error = self.comm.spread_failure(error, PARAMETERS_VERDICT, "DP rank(s) {ranks} refused this optimizer",
                                         logged=False)
        if self.tp_comm is not None:
            error = self.tp_comm.spread_failure(error, PARAMETERS_VERDICT,
                                                "TP rank(s) {ranks} refused this optimizer or heard of a refusal",
                                                logged=False)
        if refusal is not None:
            raise refusal
        if error is not None:
            raise SpecError(error)

    def _check_agreement(self, param_groups: list[dict[str, Any]], weights: str = "initial") -> None:
        """Every rank runs the same plan on the same model: DP peers compare everything, TP peers
        everything but the sharded weights (which differ by design). `weights`: which weights the
        facts name ("initial" at construction; "loaded" at the first step after a model load,
        `_check_step`, whose disagreement advises loading on every rank)."""
        shared = {
            "model fingerprint": self.spec.fingerprint(),
            # the fingerprint ignores order, but buffers are laid out in spec order
            "parameter order": ",".join(p.name for p in self.spec.params),
            "optimizer configuration": repr((self.optimizer, asdict(self.matrix_cfg), asdict(self.adamw_cfg))),
            # before the plan: ranks planning on other GPUs' profiles (cost_model=None) say so
            COST_MODEL_FACT: self.plan.cost_model,
            "plan": self.plan.hash(),
            "policy": f"{self.policy.name} ({self.tp_mode}, reduce-scatter {self.comm.reduce_scatter_impl})",
            "gradient clipping and non-finite steps": f"max_grad_norm {self.max_grad_norm}, nonfinite {self._nonfinite}",
            # compiled kernels round otherwise: tp-sync ranks computing one matrix must agree
            "matrix kernels": f"batch_kernels {self.batch_kernels}, compile_kernels {self.compile_kernels}",
            "overlapped step": f"overlap_step {self.overlap_step}",
            "parameter groups": str(hyper_parameters_digest(param_groups, self.params)),
        }
        # after a load, the weights an embedding renormalises in its forward (max_norm) differ between
        # the ranks (the rows their tokens looked up): left out of that comparison
        skip = self._renormed if weights == "loaded" else set()
        dense = {n: p for n, p in self.params.items() if n not in self._expert_names and n not in skip}
        dp_facts = {**shared, "TP rank": str(self.tp_rank), f"{weights} parameters": _parameters_checksum(dense)}
        if weights == "loaded" and self._renormed:  # those weights' load on some ranks only: the marks differ
            dp_facts[RENORMED_LOADED_MARK] = "yes" if self._renormed_loaded else "no"
        # experts loaded on some EP ranks only (compared over DP and TP: EP spans either)
        if weights == "loaded" and self._expert_plan is not None:
            dp_facts[EXPERTS_LOADED_MARK] = "yes" if self._experts_loaded else "no"
        advice = {**COST_MODEL_ADVICE, **{f"{weights} {what}parameters": LOADED_ADVICE
                                          for what in ("", "TP-replicated ", "expert ")},
                  LOADED_MARK: LOADED_ADVICE, RENORMED_LOADED_MARK: LOADED_ADVICE,
                  EXPERTS_LOADED_MARK: LOADED_ADVICE} \
            if weights == "loaded" else COST_MODEL_ADVICE
        error = None
        if self._expert_plan is not None:
            # the EDP ranks of each EP rank first: the same experts, the same expert plan; their
            # verdict is a fact of the DP round (as the DP round's is of the TP round below), so
            # that every rank of the cluster fails together
            error = self._expert_comms[0].agreement_error({
                "expert plan": self._expert_plan.hash(),
                f"{weights} expert parameters": _parameters_checksum(
                    {n: self.params[n] for n in sorted(self._expert_names) if n not in skip})},
                advice)
            if error is not None:
                error = f"the expert-data-parallel group: {error}"
            dp_facts["expert parallelism"] = f"ep {self.ep}"
            dp_facts["expert-data-parallel agreement check (failed on the ranks named; see their error)"] = \
                "failed" if error is not None else "passed"
        dp_error = self.comm.agreement_error(dp_facts, advice)  # every rank joins the DP round
        error = error or dp_error
        if self.tp_comm is None:
            if error is not None:
                raise PlanError(error)
            return
        # three rounds, so that every rank of the cluster ends with an error when any group fails
        # (a DP group that failed alone would leave its TP peers waiting in the TP check); the
        # experts are not TP-replicated: the TP ranks of a DP rank may hold different EP ranks'
        replicated = {p.name: self.params[p.name] for p in self.spec.params
                      if p.tp_dim is None and p.name not in self._expert_names and p.name not in skip}
        tp_error = self.tp_comm.agreement_error({
            **shared, "DP rank": str(self.rank),
            f"{weights} TP-replicated parameters": _parameters_checksum(replicated),
            # a load of TP-sharded weights on some TP ranks only (on every DP replica of them alike)
            # leaves every checksum the TP ranks could compare equal: their marks are compared instead
            # (of the dense weights only: the TP ranks of a DP rank may hold different EP ranks' experts)
            **({LOADED_MARK: "yes" if self._dense_loaded else "no"} if weights == "loaded" else {}),
            # (and a load of experts only: the TP ranks of a DP rank may hold different EP ranks')
            **({EXPERTS_LOADED_MARK: dp_facts[EXPERTS_LOADED_MARK]} if EXPERTS_LOADED_MARK in dp_facts else {}),
            "data-parallel agreement check (failed on the ranks named; see their error)":
                "failed" if error is not None else "passed"}, advice)
        error = error or tp_error
        # logged at construction (the first step's record, `step_collectives`), not at a step's
        # comparison after a model load (`_check_step`), which no plan of a step's collectives has
        error = self.comm.spread_failure(error, "agreement verdict",
                                         "the TP group of DP rank(s) {ranks} failed the agreement check",
                                         logged=weights == "initial")
        if error is not None:
            raise PlanError(error)

    # --- gradient synchronisation ------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (micro-batches); the backward after it synchronises once."""
        with contextlib.ExitStack() as stack:
            for grads in self._syncs():
                stack.enter_context(grads.no_sync())
            yield

    def _parts(self) -> list[Any]:
        """This optimizer's dense part (itself), and its experts' part under EP."""
        return [self] if self.experts is None else [self, self.experts]

    def _comms(self) -> list[Comm]:
        """Every communicator this optimizer logs on: DP (and TP), and under EP the EDP and EP groups."""
        return [c for c in (self.comm, self.tp_comm, *(self._expert_comms or ())) if c is not None]

    def _syncs(self) -> list[GradientSync]:
        """The gradient buffers of every part."""
        return [part.grads for part in self._parts()]

    def _prepare_step(self, max_norm: float | None = None) -> StepCheck:
        self.wait_params()  # the check reads parameters (links, TP digests); the update writes them
        try:
            return self._check_step(max_norm)
        except CanzonaError as e:
            # a refused step: what was computed or gathered early for it (overlap_step's updates,
            # prefetched gathers) is dropped on every rank alike, each raising here, so that a
            # step() called again runs the plain step everywhere; a rank that kept early updates
            # made with a learning rate since put back would drop them alone, and its TP peers
            # would wait for collectives it never issues
            for part in self._parts():
                with contextlib.suppress(CanzonaError):  # a dead peer: the check's error is the one to report
                    part.matrix_step.discard()
            if self.grads.broken_refusal:
                # some rank found the step broken (a mistake of its loop's: no zero_grad(), a second
                # synchronising backward, ...), which no step() called again can mend: its gradients
                # are dropped on every rank alike (`GradientSync.abandon`), so that model.zero_grad()
                # and a backward start the next step afresh, as opt.zero_grad() does
                for grads in self._syncs():
                    with contextlib.suppress(CanzonaError):
                        grads.abandon(str(e))
            else:
                self._keep(e)
            raise

    def _keep(self, error: CanzonaError) -> None:
        """A step refused without being broken (a disagreement, a NaN norm, a hyper-parameter that
        fails validation), alike on every rank: its gradients are kept for a retried step();
        model.zero_grad() (either setting) on every rank ends that step instead, as
        optimizer.zero_grad() does (`GradientSync._end_kept`)."""
        for grads in self._syncs():
            grads.kept_line = str(error)

    def _check_step(self, max_norm: float | None) -> StepCheck:
        check = self._checked_gradients(max_norm)
        if self.grads.model_loaded:  # on some rank since the last step: every rank compares its weights
            self._check_agreement(self.param_groups, weights="loaded")
            # compared: a reuse of the check does not again
            clear_marks(self)
            self.grads.model_loaded = False
            record_writes(self)
        return check

    def _checked_gradients(self, max_norm: float | None) -> StepCheck:
        note_writes(self)  # weights written in place since the last step mark it as a load does
        # whether the parameters that got no gradient here are frozen (one that got one was trainable then)
        ungraded = self.grads.ungraded() + (self.experts.grads.ungraded() if self.experts is not None else [])
        digest = hyper_parameters_digest(self.param_groups, self.params, ungraded)
        if self.experts is None:
            return self.grads.prepare(digest, max_norm, loaded=self._model_loaded)
        # the experts' checks over EDP first, then one global verdict over DP (and TP) carrying
        # their norm; an EDP group whose check failed fails the DP check too, so that the other
        # EDP groups stop there with an error instead of waiting in the step's collectives until
        # the timeout
        experts = self.experts.grads
        reused = experts.checked is not None
        try:
            experts.prepare(digest, max_norm, recheck=False)  # a reused check: the dense recheck covers every rank
            # reused: what changed since on this rank (a gradient dropped) rides in the dense recheck
            failed, broken = (experts.local_problem() if reused else None), True
        except CanzonaError as e:
            # a broken step there is one here (abandoned on every rank); a disagreement or a NaN
            # norm is a refusal that keeps the gradients for a retried step(), as the dense one's
            failed, broken = str(e), experts.broken_refusal
        check = self.grads.prepare(digest, max_norm, more_norm=None if failed else experts.norm_term,
                                   more_problem=failed, more_backward=experts.backward, more_got=experts.local_got,
                                   loaded=self._model_loaded, more_broken=broken)
        # an expert stack steps whole where any rank of the cluster reached it (its experts without
        # tokens with zero gradients), and is skipped where none did, as one process steps the
        # model's one tensor or skips it: the dense check combined the flags of every EP rank
        experts.checked = replace(experts.checked, got=check.more_got)
        return check

    @property
    def nonfinite(self) -> str:
        """What a step with a NaN / Inf gradient norm does: `raise` or `skip` (fixed at construction,
        as the ranks must agree on it)."""
        return self._nonfinite

    @eager_only
    @torch.no_grad()
    @autocast_off()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the *reduced* gradients to a global norm of at most `max_norm`; return the norm
        before clipping (for logging). `max_norm=inf` only measures it. Collective: call it on every
        rank, after backward and before `step()`, with the same `max_norm` (ranks are checked to
        agree). Every gradient element counts once across DP and TP ranks, as in a single-device run.

        `torch.nn.utils.clip_grad_norm_` on the model cannot work here: `.grad` holds guards while
        the gradients are being reduced, and it raises (one line naming this method)."""
        self._refuse_clip_inside_no_sync("clip_grad_norm_")
        # the threshold goes through the step check's agreement first: a bad one on one rank alone
        # is a disagreement there on every rank, one the ranks agree on is refused below on each
        # (a bad norm_type too: the NaN word)
        good_type = norm_type in (2.0, math.inf)
        word = clip_threshold_word(max_norm) if good_type else math.nan
        check = self._prepare_step(word)
        if math.isnan(word):  # refused alike on every rank after the check: the step kept, as _step keeps one
            error = SpecError(f"norm_type must be 2.0 or inf, got {norm_type!r}" if not good_type else
                              f"max_norm must be a positive number (inf: measure only), got {max_norm!r}")
            self._keep(error)
            raise error
        if norm_type == math.inf:
            total = self._inf_norm()
        else:
            total = check.norm
        if math.isfinite(total):
            self._clip(float(max_norm), total)
        if math.isfinite(max_norm):  # a clip, not a measure: GradScaler's unscale must come before it
            self._amp.clipped = self.grads.checked
        return torch.tensor(total, dtype=torch.float32)

    def _refuse_clip_inside_no_sync(self, what: str) -> None:
        """A clip (`what`) between the micro-batches of an accumulation: their gradients are the last
        micro-batch's backward's to reduce, so nothing could be clipped yet."""
        if any(not grads.syncing for grads in self._syncs()):
            raise CanzonaError(f"{what} inside no_sync() (an accumulation micro-batch, whose gradients the "
                               "last micro-batch's backward reduces): clip once, after that backward (under accelerate: "
                               "`if accelerator.sync_gradients:`)")

    @eager_only
    @torch.no_grad()
    @autocast_off()
    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every *reduced* gradient element to [-clip_value, clip_value], as
        torch.nn.utils.clip_grad_value_ clamps `.grad` under DDP (a clamp commutes with the sharding:
        each element is clamped where it is held). Collective, as clip_grad_norm_(): call it on every
        rank, after backward and before `step()`; it reduces and checks the step first. The norm a
        clip_grad_norm_() after it measures is the clamped gradients' (one more small exchange, which
        also tells whether any rank clamped an element: where none did, the step's early work, an
        overlapped update or a prefetched gather, is kept);
        GradScaler's unscale must come before it, as before clip_grad_norm_(). A non-finite norm
        (nonfinite='skip', GradScaler's inf) is left to the step, unclamped.

        `torch.nn.utils.clip_grad_value_` on the model cannot work here: `.grad` holds guards while
        the gradients are being reduced; its clamp is refused at step() naming this method."""
        self._refuse_clip_inside_no_sync("clip_grad_value_")
        # agreed by the step check (beside max_norm, as minus clip_value) before anything below
        # branches on it: inf on one rank and 0.01 on another would issue the norm's all-gather on
        # one only, 0.01 and 0.02 clamp the shards apart
        word = clip_threshold_word(clip_value, by_value=True)
        check = self._prepare_step(word)
        if math.isnan(word):
            error = SpecError(f"clip_value must be a positive number, got {clip_value!r}")
            self._keep(error)
            raise error
        if math.isfinite(check.norm) and math.isfinite(clip_value):
            value = float(clip_value)
            over: Tensor | None = None  # on the device: read once, inside the norm's all-gather
            for grads in self._syncs():
                for buf in grads.all_buffers():
                    # a clamp that changes nothing is a no-op: only whether any rank changed one
                    # decides below whether the early work is dropped and the norm is the new one
                    here = (buf.reduced.abs() > value).any()
                    over = here if over is None else over | here.to(over.device)
                    buf.reduced.clamp_(-value, value)
            norm, clamped = self._two_norm(over)
            if clamped:
                for part in self._parts():  # updates or gathers computed early from the unclamped gradients
                    part.matrix_step.discard()
                before = self.grads.checked
                self.grads.checked = replace(before, norm=norm)
                self._amp.rescaled(before, self.grads.checked)
        if math.isfinite(clip_value):  # inf clamps nothing: GradScaler's unscale may follow, as after max_norm=inf
            self._amp.clipped = self.grads.checked

    def _two_norm(self, flag: Tensor | None = None) -> tuple[float, bool]:
        """The global 2-norm of the reduced gradients as they are now, as the step check sums it (each
        rank's sum of squares in fp64, summed over DP, then TP): one more small all-gather each,
        which also carries `flag` (a bool scalar); returns whether any rank of the cluster set it."""
        segments = [s for grads in self._syncs() for s in grads.norm_segments()]
        term = local_norm_term(segments)
        raised = torch.zeros((), dtype=torch.float64) if flag is None else flag.to(torch.float64)
        row = torch.stack([term, raised.to(term.device)])
        table = self.comm.all_gather_values(row, "gradient norm")
        total, raised = combine_norm_terms(table[:, 0]), table[:, 1].amax()
        if self.tp_comm is not None:
            table = self.tp_comm.all_gather_values(torch.stack([total, raised]), "gradient norm")
            total, raised = combine_norm_terms(table[:, 0]), table[:, 1].amax()
        return math.sqrt(float(total)), bool(raised)

    def _clip(self, max_norm: float, norm: float) -> None:
        """Scale the reduced gradients by `max_norm / norm` when that is below 1 (torch's rule), and
        remember the norm they now have, so that clipping twice does not clip twice."""
        coefficient = min(1.0, max_norm / (norm + 1e-6))
        if coefficient < 1.0:
            self._scale_gradients(coefficient)

    def _scale_gradients(self, coefficient: float) -> None:
        """Multiply every reduced gradient, and the checked norm, by `coefficient` (a clip, or
        GradScaler's unscale)."""
        # an overlapped step's updates were computed from the gradients before: dropped; prefetched
        # gradients are scaled where they arrived, as the buffers below
        for part in self._parts():
            part.matrix_step.clipped(coefficient)
        for grads in self._syncs():
            for buf in grads.all_buffers():
                buf.reduced.mul_(coefficient)
        before = self.grads.checked
        self.grads.checked = replace(before, norm=before.norm * coefficient)
        self._amp.rescaled(before, self.grads.checked)

    # overlap_step under GradScaler: the inverse scale the updates computed early are computed at
    # (`_speculate`), set by `_amp_unscale` while its check runs (the buckets land inside it)
    _early_scale: float = 1.0

    @torch.no_grad()
    @autocast_off()
    def _amp_unscale(self, found_inf: Tensor, inv_scale: Tensor) -> None:
        """torch.amp.GradScaler's `unscale_(opt)`, and the inf check `scaler.step(opt)` makes first
        (`inv_scale` 1: the scale then comes to `step()` as `grad_scale`), reach the guards in `.grad`
        as one foreach op per device and dtype: the first call reduces and checks the step (a
        collective, as `clip_grad_norm_()` is: GradScaler calls it on every rank alike) and unscales
        every reduced gradient; each call sets `found_inf` from the global norm, the same on every
        rank, so that every rank's scaler skips the same steps and scales alike. A NaN / Inf norm
        is the scaler's to skip, not an error (whatever `nonfinite` says)."""
        if any(not grads.syncing for grads in self._syncs()):
            raise CanzonaError("GradScaler.unscale_ inside no_sync() (an accumulation micro-batch, whose gradients the "
                               "last micro-batch's backward reduces): unscale once, after that backward")
        self._amp.unscale(lambda: self.grads.checked, lambda check: math.isfinite(check.norm), self._amp_take,
                          found_inf, inv_scale)

    def _amp_take(self, coefficient: float) -> None:
        """`AmpMarks.unscale`'s check: the step check with every non-finite norm the scaler's to skip,
        and the unscale of every reduced gradient by `coefficient`."""
        kept = [grads.nonfinite for grads in self._syncs()]
        # the updates overlap_step computes as the buckets land (in the check below) are computed
        # from the gradients as this unscale leaves them (kept by `_scale_gradients`), or, under
        # `scaler.step`'s inf check (a dummy inverse of 1), as step() will unscale them by the
        # scale it is then handed: the first step, one after a resume and a scale of 1 alike
        ahead = amp_handles.inf_check_inverse()
        self._early_scale = coefficient if ahead is None else ahead
        try:
            for grads in self._syncs():
                grads.nonfinite = "skip"
            check = self._prepare_step()
        finally:
            self._early_scale = 1.0
            for grads, policy in zip(self._syncs(), kept):
                grads.nonfinite = policy
        if math.isfinite(check.norm) and coefficient != 1.0:
            self._scale_gradients(coefficient)

    def _inf_norm(self) -> float:
        """The largest gradient magnitude in the cluster (two more small all-gathers: the step check
        carries the 2-norm only)."""
        segments = [s for grads in self._syncs() for s in grads.norm_segments() if s.numel()]
        term = max((s.abs().max().double().cpu() for s in segments), default=torch.zeros((), dtype=torch.float64))
        term = self.comm.all_gather_values(term.reshape(1), "gradient norm")[:, 0].max()
        if self.tp_comm is not None:
            term = self.tp_comm.all_gather_values(term.reshape(1), "gradient norm")[:, 0].max()
        return float(term)

    # --- the step ----------------------------------------------------------------------------

    # the step's parameter all-gathers in flight (overlap_param_gather); None until construction
    # sets it, so that what construction calls (reset_master_weights) finds nothing to wait for
    _in_flight: ParamsInFlight | None = None
    # the witness of the weights a state loaded unchecked was saved with (load_state_dict(),
    # load_sharded_state_dict() without check_weights): the next step checks the model's weights
    # against it (`checkpoint.check_loaded_weights`)
    loaded_witness: dict[str, Any] | None = None
    # the experts' part under expert parallelism (None: no EP, or not built yet)
    experts: ExpertPart | None = None

    # torch.amp.GradScaler's `step(opt)` checks for infs through the guards (`_amp_unscale`) and
    # hands the scale over as `self.grad_scale` (None once `unscale_` ran) for step() to unscale by,
    # as torch's fused optimizers take it (the unscale then runs after the check, before any clip)
    _step_supports_amp_scaling = True

    @eager_only
    @torch.no_grad()
    def step(self, closure=None):  # noqa: D401 - torch.optim signature
        return run_step(self, closure, self._step)

    def _step(self) -> None:
        checkpoint.check_weights_at_step(self)  # after load_state_dict(): its weights, before anything changes
        inverse = handed_inverse_scale(self)
        check = self._prepare_step(self.max_grad_norm)
        try:
            self._check_hyper_parameters()  # every hyper-parameter valid before anything changes
        except CanzonaError as e:
            # after the check (the hyper-parameters agreed on every rank): refused alike everywhere,
            # the gradients kept as for a NaN norm (before: unmarked, model.zero_grad() then refused)
            self._keep(e)
            raise
        if check is self._amp.unscaled:  # GradScaler's unscale_ (through a wrapper) unscaled them already
            inverse = None
        # a scale of 1 unscales nothing (x * 1.0 is x, Inf and NaN too): the early updates stand
        if inverse is not None and inverse != 1.0 and math.isfinite(check.norm):
            self._scale_gradients(inverse)
            check = self.grads.checked
        if not math.isfinite(check.norm):  # nonfinite="skip", or GradScaler's verdict (prepare raised otherwise)
            for part in self._parts():
                part.matrix_step.discard()
            self.skipped_steps += 1
            log.warning("canzona: skipped step %d: the global gradient norm is %s (%d skipped so far)",
                        self.comm.log.step + 1, check.norm, self.skipped_steps)
        else:
            if self.max_grad_norm is not None:
                self._clip(self.max_grad_norm, check.norm)
            got = [bool(g) for g in check.got.tolist()]  # a host table already: read once, not per matrix
            # AdamW runs inside the matrix phase, under its last scatter (TPSchedule.elementwise_at)
            how = dict(target=self._target, applied=self._refresh_working_copy, config=self._matrix_config,
                       got=lambda name: got[self._index[name]], elementwise=lambda: self._adamw_step(got))
            overlapped = self.matrix_step.commit(**how)
            if not overlapped:  # no overlapped step to commit: the plain one
                self.matrix_step.run(grad=self.grads.reduced, **how)
            if self.experts is not None:
                overlapped = self._expert_step() or overlapped
            self.overlapped_steps += overlapped
            self._gather_params()
        for comm in self._comms():
            comm.log.step += 1
        for grads in self._syncs():
            grads.stepped()
        record_writes(self)  # the step's own writes (its gathers in flight stay so)

    def _expert_step(self) -> bool:
        """The experts' matrices this rank owns (at TP 1: computed and applied; under overlap_step
        the updates computed as their buckets landed, committed), and their AdamW pieces under an
        elementwise optimizer; which got a gradient is the EDP check's verdict. Whether an
        overlapped step was committed."""
        part = self.experts
        got = [bool(g) for g in part.grads.checked.got.tolist()]
        index = part.grads.index
        how = dict(target=self._target, applied=self._refresh_working_copy, config=self._matrix_config,
                   got=lambda name: got[index[name]])
        overlapped = part.matrix_step.commit(**how)
        if overlapped:
            part.overlapped_steps += 1
        else:
            part.matrix_step.run(grad=part.grads.reduced, **how)
        if self.elementwise:
            self._adamw_pieces(self.expert_adamw_parts(), lambda name: got[index[name]])
        return overlapped

    def _speculate(self, matrix_step: MatrixStep, landed: Callable[[str], Tensor]) -> None:
        """overlap_step: a part's matrices' updates (the dense part's, or the experts') computed as
        their buckets land, before the step check; `step()` commits them (or drops them, and runs
        the plain step, when clipping scaled the gradients or the hyper-parameters changed since).
        Hyper-parameters that fail validation are left for `step()` to report, before anything
        changes. Under GradScaler the buckets land inside its unscale's check: the updates are
        computed from the gradients times its inverse scale (`_early_scale`), the product its
        unscale then applies to the buffers, and kept when it does."""
        try:
            self._check_hyper_parameters()
        except CanzonaError:
            # an earlier check's updates (a kept refused step's, its batch since dropped) must not
            # be committed at a later step() whose hyper-parameters read alike again
            matrix_step.discard()
            return
        matrix_step.speculate(grad=landed, config=self._matrix_config, scale=self._early_scale)

    def _gather_params(self) -> None:
        if self._in_flight is not None:
            self._in_flight.launch(self._launch_gathers)
            return
        for pending in self._launch_gathers():
            pending.wait()

    def _launch_gathers(self) -> list[PendingWork]:
        """The step policy's parameter gathers of every part (the dense part over DP, the experts
        over EDP), in the order `_params_in_flight` numbers them."""
        return [pending for part in self._parts() for pending in self._param_gather(part)]

    def _matrix_config(self, name: str) -> tuple[Any, float]:
        g = self._group_of[name]
        group = self.param_groups[g]
        return self.group_config(g), group_lr(group)

    def _target(self, name: str) -> Tensor:
        return self._master_for(name, self.tensor(name))

    def _refresh_working_copy(self, name: str) -> None:
        """After an update to a master: the working copy the next forward uses."""
        master = self.master.get(name)
        if master is not None:
            self.tensor(name).copy_(master)

    @torch.no_grad()
    def reset_master_weights(self) -> None:
        """fp32 master copies of the matrices this rank updates and of its AdamW slice, taken from
        the parameters as they are now (after loading weights into a bf16 model, say)."""
        self.wait_params()
        applies = self.applies + (self.experts.applies if self.experts is not None else [])
        self.master = {n: self.tensor(n).detach().float().clone() for n in applies}
        for piece in [*self.adamw_parts(), *self.expert_adamw_parts()]:
            self.master[piece.name] = piece.buffer.data[piece.start:piece.end].float().clone()

    def tensor(self, entry: str) -> Tensor:
        """This rank's local tensor of a plan entry: a parameter's, or one matrix of a stacked
        parameter (a view of it)."""
        for grads in self._syncs():
            if entry in grads.stacks.param_of:
                return grads.stacks.tensor(entry)
        raise KeyError(entry)

    def _master_for(self, name: str, working: Tensor) -> Tensor:
        """The tensor an update goes to (`kernels.update_target`): the fp32 master, or the parameter."""
        return update_target(self.master.get(name), working)

    def group_config(self, g: int) -> Any:
        """The optimizer config of param group `g` as its hyper-parameters say now (validated)."""
        return self._configs.config(g, self.param_groups[g])

    def _changed(self, replaced: Callable[[], str | None]) -> str | None:
        """What changed on this rank since construction that a step cannot follow (the step check's
        local problem, so that every rank fails alike): `param_groups` holding other parameters,
        or a parameter `replaced` in the model."""
        return members_changed(self.param_groups, self._group_members) or replaced()

    def _check_hyper_parameters(self) -> None:
        """Every param group's hyper-parameters valid now, over the parameters it was built with
        (one CanzonaError otherwise)."""
        check_groups_now(self.param_groups, self._group_members, self.group_config)

    def state_dtype(self, name: str) -> torch.dtype:
        """The dtype `name`'s optimizer state is kept in: its reduced gradient's (an expert matrix
        of another EP rank: the experts' here)."""
        buffer = next((g.buffer_of[name] for g in self._syncs() if name in g.buffer_of), None)
        if buffer is None and self.experts is not None:
            buffer = self.experts.grads.buckets[0]
        return buffer.reduced.dtype

    def adamw_parts(self) -> Iterator[Piece]:
        """The pieces this rank updates with AdamW (and keeps AdamW state and masters for): those
        of the AdamW parameters inside its slice of the flat AdamW buffer (all of them under a
        replicated policy), and under an elementwise optimizer the matrices' pieces inside its
        segments of the buckets too."""
        buffers = [(self.grads.adamw, self.grads.adamw_cuts)]
        if self.elementwise:
            buffers += [(b, self.grads.grad_cuts(k)) for k, b in enumerate(self.grads.buckets)]
        return self._pieces(buffers, self.rank)

    def _pieces(self, buffers: Iterable[tuple[FlatBuffer, tuple[int, ...]]], rank: int) -> Iterator[Piece]:
        """The pieces of `buffers` inside `rank`'s segments (all of them under a replicated policy)."""
        for buffer, cuts in buffers:
            lo, hi = (0, buffer.size) if self.policy.replicated else (cuts[rank], cuts[rank + 1])
            yield from pieces_of(buffer, lo, hi)

    def global_name(self, name: str) -> str:
        """An entry's name in the whole model (this part's names are the model's)."""
        return name

    def expert_adamw_parts(self) -> Iterator[Piece]:
        """Under an elementwise optimizer and EP: the experts' pieces inside this rank's EDP
        segments of the expert buckets."""
        if not (self.elementwise and self.experts is not None):
            return iter(())
        grads = self.experts.grads
        return self._pieces(((b, grads.grad_cuts(k)) for k, b in enumerate(grads.buckets)), self.experts.rank)

    def _adamw_step(self, got: Sequence[bool]) -> None:
        self._adamw_pieces(self.adamw_parts(), lambda name: got[self._index[name]])

    def _adamw_pieces(self, pieces: Iterable[Piece], got: Callable[[str], bool]) -> None:
        betas: dict[int, StepBetas] = {}  # a group's, read once this step: beta1 cast once, not per piece
        for piece in pieces:
            name = piece.name
            if got(name):
                g = self._group_of[name]
                group = self.param_groups[g]
                state = self.adamw_state.setdefault(name, {})
                data = piece.buffer.data[piece.start:piece.end]
                target = self._master_for(name, data)
                if g not in betas:
                    betas[g] = StepBetas(group_betas(group))
                adamw_step_(target, piece.buffer.reduced[piece.start:piece.end], state, self.group_config(g),
                            group_lr(group), betas[g])
                if self.master_weights:
                    data.copy_(target)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every `.grad` becomes None, or with `set_to_none=False` zero (a guard: the gradients live
        in the optimizer's buffers), as in torch: a parameter that no backward reaches before the
        next step is stepped with that zero gradient (momentum, weight decay), as torch's
        optimizers step a zero `.grad`, and skipped after set_to_none. `model.zero_grad()`, with
        either setting, works the same between steps; within one (a batch dropped after its
        backward or clip) only this one discards gradients already sent to the reduction."""
        for grads in self._syncs():
            grads.zero_grad(set_to_none)
        for part in self._parts():
            part.matrix_step.discard()  # an overlapped step computed and never committed (no step() came)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "grads", None) is not None:  # torch's __init__ adds the constructor's groups
            raise SpecError("parameters cannot be added to a DistributedOptimizer after construction: its plan "
                            "lays out every parameter; build it with all the groups")
        super().add_param_group(param_group)

    # --- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Layout-independent: per parameter name, full tensors, identical on every rank.
        Collective (every rank must call it), bounded by `timeout_s`."""
        self.wait_params()
        check_members(self.param_groups, self._group_members, checkpoint.own_comms(self), "state_dict()")
        return state_dict_with_hooks(self, lambda: checkpoint.gather_state(self))

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a `state_dict()` taken at any DP x TP layout; checks it belongs to this model and optimizer.
        The weights it was saved with are checked at the first `step()` after it, not here (torch's
        `set_state_dict` loads the model after the optimizer): another save's weights (its witness,
        a few elements of each parameter) are one CheckpointError on every rank there, before any
        update (`checkpoint.without_weights_witness(state_dict)`: unchecked, on purpose). A saved
        fp32 master that is not the model's weight cast gives way to that weight at the next step
        (`kernels.update_target`). Collective (every rank calls it with the same state dict, as
        `state_dict()` gives it): a refusal on one rank, or ranks given different state dicts, is
        one error on every rank, nothing loaded."""
        self.wait_params()
        check_members(self.param_groups, self._group_members, checkpoint.own_comms(self), "load_state_dict()")
        self.matrix_step.discard()  # computed from the state being replaced
        load_with_hooks(self, state_dict, lambda loaded: checkpoint.load_state(self, loaded))

    def sharded_state_dict(self, prefix: str = checkpoint.DCP_PREFIX) -> dict[str, Any]:
        """This rank's share of the state for `torch.distributed.checkpoint.save` (each rank writes
        only what it owns); merge it with the model's state dict to save both in one call.
        Collective, as `dcp.save` is: every rank calls it (its witness of the weights, a few
        elements of each parameter for `load_sharded_state_dict(check_weights=True)`, is gathered
        over the optimizer's DP group, then its TP group: every rank of this optimizer, no other)."""
        self.wait_params()
        check_members(self.param_groups, self._group_members, checkpoint.own_comms(self), "sharded_state_dict()")
        return checkpoint.sharded_state(self, prefix)

    def load_sharded_state_dict(self, checkpoint_id: Any, prefix: str = checkpoint.DCP_PREFIX, *,
                                check_weights: bool | None = None) -> None:
        """Load from a `torch.distributed.checkpoint` saved at any DP x TP layout (a path or a storage
        reader): each rank reads what its layout needs. Collective.

        `check_weights=True`: the model's weights were just loaded from the same save (the
        integrations' `load_state` / resume); weights that are not the checkpoint's fp32 masters
        cast to their dtype (where this optimizer keeps masters and the checkpoint has them), or
        that differ from the checkpoint's witness of them (a few elements of every parameter,
        recorded at the save: an fp32 model, `master_weights=False`), are one CheckpointError on
        every rank, nothing loaded: model files and optimizer state from two saves, say a save
        killed between them. Without it (None), the first `step()` after the load checks the
        witness (as after `load_state_dict`); `check_weights=False`: nothing checked, for weights
        changed on purpose (surgery, a merge, EMA weights). A checkpoint of an older canzona has no witness: where it has
        no masters either, nothing is checked."""
        self.wait_params()
        check_members(self.param_groups, self._group_members, checkpoint.own_comms(self), "load_sharded_state_dict()")
        self.matrix_step.discard()  # computed from the state being replaced
        checkpoint.load_sharded(self, checkpoint_id, prefix, check_weights=check_weights)


# `DistributedOptimizer(...)`'s signature is its constructor's (what `inspect`, the registries'
# tests and IDEs read), not `__new__`'s catch-all, which only picks the layout
DistributedOptimizer.__signature__ = inspect.signature(DistributedOptimizer.__init__).replace(
    parameters=list(inspect.signature(DistributedOptimizer.__init__).parameters.values())[1:])


# --- the parameter all-gather after the step, one per step policy (docs/design.md §7) ---------


def _no_matrices(shape: tuple[int, ...], cfg: Any, lr: float, steps: int) -> None:
    raise CanzonaError("an elementwise optimizer computes no whole matrix")


def _no_gather(opt: DistributedOptimizer) -> list[PendingWork]:
    return []


def _gather_segments(opt: DistributedOptimizer) -> list[PendingWork]:
    """Each rank's segment of every bucket, and its AdamW slice, to everyone."""
    pending = [opt.comm.all_gather_v(b.data, bp.cuts, f"parameters of bucket {bp.index}")
               for b, bp in zip(opt.grads.buckets, opt.plan.dp_plan.buckets)]
    pending.append(opt.comm.all_gather_v(opt.grads.adamw.data, opt.grads.adamw_cuts, "adamw parameters"))
    return pending


def _gather_owned(opt: DistributedOptimizer) -> list[PendingWork]:
    """Layerwise: owners' matrices are scattered over the bucket, so each rank packs what it owns
    and an all-gather-v of the packs rebuilds the bucket."""
    pending = [_gather_owned_bucket(opt, b, bp) for b, bp in zip(opt.grads.buckets, opt.plan.dp_plan.buckets)]
    pending.append(opt.comm.all_gather_v(opt.grads.adamw.data, opt.grads.adamw_cuts, "adamw parameters"))
    return pending


def _gather_owned_bucket(opt: DistributedOptimizer, b: FlatBuffer, bp: BucketPlan) -> PendingWork:
    owned = [[p for p in bp.params if p.owner == r] for r in range(opt.dp)]
    cuts = [0]
    for ps in owned:
        cuts.append(cuts[-1] + sum(p.numel for p in ps))
    packed = torch.empty(cuts[-1], dtype=b.data.dtype, device=b.data.device)
    pos = cuts[opt.rank]
    for p in owned[opt.rank]:
        packed[pos:pos + p.numel].copy_(b.data[p.offset:p.end])
        pos += p.numel
    pending = opt.comm.all_gather_v(packed, cuts, f"owned parameters of bucket {bp.index}")
    gather_then = pending.then

    def unpack() -> None:
        if gather_then is not None:
            gather_then()
        for r, ps in enumerate(owned):
            q = cuts[r]
            for p in ps:
                b.data[p.offset:p.end].copy_(packed[q:q + p.numel])
                q += p.numel
    pending.then = unpack
    return pending


PARAM_GATHERS: dict[str, Callable[[DistributedOptimizer], list[PendingWork]]] = {
    PARAMS_NONE: _no_gather,
    PARAMS_BY_SEGMENT: _gather_segments,
    PARAMS_BY_OWNER: _gather_owned,
}


# --- helpers ----------------------------------------------------------------------------------


# the facts of a comparison after a model load (`_check_agreement`), each rank's marks
# (`model_loads.mark_loaded`): the TP round's, whether this rank's dense weights were loaded or
# written in place since the last step; the DP round's, whether a max_norm embedding's weight was
# loaded (which the weights' checksum leaves out); both rounds', whether experts alone were loaded
LOADED_MARK = "mark of weights loaded (load_state_dict) or written in place on this rank since the last step"
RENORMED_LOADED_MARK = ("mark of weights an embedding renormalises in its forward (max_norm) loaded "
                        "(load_state_dict) on this rank since the last step")
EXPERTS_LOADED_MARK = "mark of experts loaded (load_state_dict of experts only) on this rank since the last step"


@torch.no_grad()
def _parameters_checksum(params: Mapping[str, Tensor]) -> PartsDigest:
    """Cheap and position-aware: per parameter, its sum and its row sums weighted by row index,
    reduced on the parameter's device (no copy of the weights to the host); each parameter's pair
    is kept by name (`PartsDigest.parts`), for a disagreement to name the first that differs."""
    parts = []
    for p in params.values():
        p = local_tensor(p).detach()
        rows = p.reshape(p.shape[0], -1) if p.dim() > 1 else p.reshape(1, -1)
        sums = rows.sum(dim=1, dtype=torch.float64)
        weights = torch.arange(1, sums.numel() + 1, dtype=torch.float64, device=sums.device)
        parts.append(torch.stack([sums.sum(), (sums * weights).sum()]))
    blob = torch.cat(parts).cpu().numpy().tobytes() if parts else b""
    digest = PartsDigest(hashlib.sha256(blob).hexdigest())
    digest.parts = tuple((n, blob[16 * i:16 * i + 16].hex()) for i, n in enumerate(params))
    return digest


class _Weak:
    """A method of the optimizer (or of its `GradientSync`), called through a weak reference: what
    its parts are handed (the step's checks, GradScaler's unscale, the early work) holds no cycle
    back to it, so the last reference dropped (`del opt`) frees it at once, without gc, and its
    hooks with it (`_unhook`, and its parts' own finalizers: the parameter all-gathers' module hooks,
    the load hooks)."""

    __slots__ = ("_owner", "_method")

    def __init__(self, owner: object, method: str) -> None:
        self._owner = weakref.ref(owner)
        self._method = method

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = self._owner()
        if owner is None:
            raise ReferenceError(f"the owner of {self._method} is gone")
        return getattr(owner, self._method)(*args, **kwargs)

    def __eq__(self, other: object) -> bool:  # as bound methods compare: the same owner's same method
        return isinstance(other, _Weak) and self._owner == other._owner and self._method == other._method

    def __hash__(self) -> int:
        return hash((self._owner, self._method))


def _unhook(handles: list) -> None:
    """The gradient hooks of a dropped optimizer removed (`weakref.finalize`): before, they stayed on
    the parameters for good, one more per optimizer built over the same model."""
    for handle in handles:
        handle.remove()


# every DistributedOptimizer built and not yet collected: the storage of its parameters is its own
_LIVE: weakref.WeakSet[DistributedOptimizer] = weakref.WeakSet()


def _holder(params: Mapping[str, Tensor]) -> tuple[str, DistributedOptimizer] | None:
    """A parameter among `params` whose storage a live DistributedOptimizer still holds, and that one."""
    ids = {id(p) for p in params.values()}
    for opt in list(_LIVE):
        for grads in opt._syncs():
            for name, p in grads.params.items():
                if id(p) in ids and grads.is_linked(name):
                    return name, opt
    return None


def _check_not_held(params: Mapping[str, Tensor]) -> None:
    """A second optimizer on parameters a live one holds would move them out of its buffers while
    its backward hooks and parameter all-gathers still write there (an error in the next backward,
    or ranks that disagree on the initial weights at construction, read before the old step's
    gathers landed): one error instead, before any collective. An old optimizer that is only
    unreachable is collected first."""
    if _holder(params) is None:
        return
    gc.collect()  # an optimizer's parts refer to each other: `del opt` leaves it to the collector
    held = _holder(params)
    if held is not None:
        raise SpecError(f"parameter {held[0]!r} is held by another DistributedOptimizer, still alive (built "
                        "earlier on this model, kept by a variable or a Trainer): drop every reference to it "
                        "(del opt) before building a new one on the same model, or keep training with it")


def _names(spec: ModelSpec) -> set[str]:
    return {p.name for p in spec.params}


def _fsdp_axes(group: dist.ProcessGroup | DeviceMesh | None,
               tp_group: dist.ProcessGroup | None) -> dict[str, dist.ProcessGroup | None]:
    """`axis_groups`, and for a mesh of several dimensions named neither 'dp' nor 'tp' (FSDP2's own
    mesh given whole: a pipeline stage's mesh['dp_replicate', 'dp_shard']) no TP group: its ranks
    are the data-parallel group, which only the FSDP step takes (the constructor refuses it else)."""
    try:
        return axis_groups(group, tp_group)
    except SpecError:
        if not isinstance(group, DeviceMesh) or tp_group is not None or group.ndim < 2 or \
                {DP, TP} & set(group.mesh_dim_names or ()):
            raise
        return {DP: None, TP: None}


def _is_fsdp_flat_parameter(p: Tensor) -> bool:
    """FSDP (v1) flattens a module's parameters into one FlatParameter per wrapped unit."""
    try:
        from torch.distributed.fsdp._flat_param import FlatParameter
    except ImportError:  # pragma: no cover - builds without distributed support
        return False
    return isinstance(p, FlatParameter)
