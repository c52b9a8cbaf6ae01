"""The optimizer step of a model sharded by torch's FSDP2 (`fully_shard`), with whole-matrix owners
(docs/design.md §2.8): what `DistributedOptimizer` becomes when its parameters are FSDP2's DTensors.

FSDP2 has already reduce-scattered the gradients when `step()` runs: every rank holds its piece of
every gradient (`canzona.runtime.fsdp_layout`: a row block, under FSDP x TP a TP shard's row block,
possibly empty). Each matrix has one owner in the exchange group, the planner's
(`canzona.fsdp_plan.fsdp_matrices`, balanced by cost; the same owners `canzona simulate --fsdp`
prices). The step runs in micro-groups (`canzona.fsdp_plan.owner_micro_groups`): per micro-group
one variable-size all-to-all carries every rank's pieces of the gradients to their owners (no
padding to even splits), the owners compute the whole updates (the state lives there only) while
the next micro-group's all-to-all is in flight, and one all-to-all sends each rank its pieces of the
updates, which it applies with the scalars it computes itself. Parameters the registry does not give
the matrix optimizer (norms, embeddings) take AdamW elementwise on the local shard; with
`optimizer="adamw"` (the baseline) every parameter does: no owners, no exchange, the step check,
clip, GradScaler, non-finite steps and checkpoints as above (`canzona simulate --fsdp --optimizer
adamw` prices that step).

One step check per step (`check`): one small all-gather over every rank of the mesh (replicas too)
of which parameters got a gradient, a local problem, the clip threshold, the hyper-parameters'
digest and each rank's sum of squares of the gradient pieces it sends; every rank then fails alike,
or computes the same global norm, before anything moves. A call that reuses it (`step()` after
`clip_grad_norm_()`) rechecks the digest, the threshold and whether any rank's gradients changed
since (one more small all-gather; if they did, every rank takes the check anew): replaced, added to
by a backward (version counters), or edited in place through the DTensor (torch's own
`clip_grad_norm_`, which no counter sees: each local gradient's fp32 norm, read again and compared
with the clip's, `_grad_digest`).

torch.amp.GradScaler's unscale of these gradients comes to the optimizer (`_amp_unscale`, through
`canzona.runtime.dtensor_amp`): the step check, the unscale, `found_inf` from the global norm.

Low-precision sharded parameters (a model cast to bf16 before `fully_shard`) get fp32 masters of
their local shards, fp32 gradients on the wire and fp32 optimizer state, as the ZeRO-1 path does;
`MixedPrecisionPolicy` keeps fp32 sharded parameters, so nothing more is needed there.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from canzona.batching import batches
from canzona.errors import CanzonaError, PlanError, SpecError
from canzona.fsdp_collectives import FSDP_GROUP, FSDP_WORLD_GROUP, PARAMETERS_VERDICT, RECHECK_WORDS
from canzona.fsdp_plan import (
    backward_order,
    check_owner_plan_settings,
    fsdp_matrices,
    fsdp_policy,
    fsdp_units,
    owner_micro_groups,
    stacked_experts_refusal,
)
from canzona.optimizers import check_matrix_optimizer, matrix_optimizer
from canzona.plan import PlanSettings
from canzona.runtime import dtensor_amp, fsdp_checkpoint
from canzona.runtime.amp_marks import AmpMarks
from canzona.runtime.batched import check_compile, matrix_kernels
from canzona.runtime.checkpoint import DCP_PREFIX, StateHeldElsewhere, label_groups
from canzona.runtime.comm import Comm, PendingWork
from canzona.runtime.fsdp_ep import expert_mesh_of
from canzona.runtime.fsdp_layout import (
    ParamLayout,
    exchange_ranks,
    local_box,
    new_groups,
    param_layout,
    replica_dims,
    root_mesh,
)
from canzona.runtime.grad_guard import handed_inverse_scale
from canzona.runtime.gradients import (
    _all_same,
    _clip_disagreement,
    _clip_word,
    _recheck_error,
    clip_threshold_word,
    combine_norm_terms,
    digests_apart,
    local_norm_term,
    ranks_of,
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
from canzona.runtime.kernels import (
    StepBetas,
    Update,
    adamw_step_,
    apply_update_,
    autocast_off,
    eager_only,
    run_step,
    update_target,
)
from canzona.runtime.mesh import TP
from canzona.runtime.model_loads import (
    WeightVersions,
    clear_marks,
    first_written_apart,
    loaded_on_some_ranks,
    mark_loaded,
    note_writes,
    record_writes,
    renormed_in_forward,
    watch_loads,
)
from canzona.runtime.nonfinite import nonfinite_weights_error
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
    ModuleLinks,
    Parents,
    fsdp_holders,
    fsdp_params_of,
    held_by_fsdp,
    module_links,
    replaced_message,
    replaced_parameter,
)
from canzona.runtime.shards import check_not_meta, local_tensor
from canzona.step_options import check_kernel_options
from canzona.step_policies import resolve_policy

log = logging.getLogger("canzona")

LOW_PRECISION = (torch.bfloat16, torch.float16)


def is_fsdp_sharded(pairs: Iterable[tuple[str, Tensor]], dp_ranks: Sequence[int],
                    tp_ranks: Sequence[int] | None) -> bool:
    """Whether the parameters are FSDP2's: DTensors on a mesh that holds every rank of the
    data-parallel group (`dp_ranks`) and is more than this rank's TP group. A tensor-parallel
    model's DTensors live on its TP mesh alone, which a DP group beside it is not inside of."""
    from torch.distributed.tensor import DTensor

    # a mesh of one dimension named `tp` is a TP group however many ranks it spans (transformers'
    # tp_plan and parallelize_module(model, mesh["tp"]) place parameters there), never FSDP's
    meshes = [p.device_mesh for _, p in pairs
              if isinstance(p, DTensor) and tuple(p.device_mesh.mesh_dim_names or ()) != (TP,)]
    if not meshes:
        return False
    ranks = {int(r) for r in max(meshes, key=lambda m: m.mesh.numel()).mesh.flatten().tolist()}
    return len(ranks) > 1 and set(dp_ranks) <= ranks and (tp_ranks is None or ranks != set(tp_ranks))


def _dtensors(given: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The DTensors among the given parameters; one SpecError where there is none."""
    from torch.distributed.tensor import DTensor

    dtensors = {n: p for n, p in given.items() if isinstance(p, DTensor)}
    if not dtensors:
        raise SpecError("no parameter is a DTensor: shard the model with fully_shard (at least its root)")
    return dtensors


def _flat_pairs(given: Any) -> list[tuple[str, Tensor]]:
    items = given if isinstance(given, list) else list(given)
    if items and isinstance(items[0], Mapping):
        return [pair for g in items for pair in g.get("params", ())]
    return items


# DistributedOptimizer's options of the ZeRO-1 layout that FSDP2 decides instead: refused off their
# defaults (`FsdpOptimizer`), as the simulator refuses them under --fsdp (`sim.fsdp.check_fsdp`);
# expert_buckets sizes ZeRO-1's buckets of expert stacks, which FSDP2 has none of
ZERO1_ONLY = ("reduce_scatter", "tp_policy", "tp_mode", "capacity", "overlap_param_gather", "geometry",
              "expert_buckets")


# how a rank's gradients changed since the kept check (`FsdpOptimizer._grads_since`), as its recheck sends it
_SINCE = (None, "replaced", "added", "edited")


def _note_arrival(owner: weakref.ref, name: str) -> Callable[[Tensor], None]:
    """A sharded parameter's post-accumulate-grad hook, which FSDP2 runs once it wrote the
    parameter's reduced gradient: `name` noted in the optimizer's `_arrived`. An arrival from
    another backward than the last noted (autograd's graph task id, unique per backward, set
    in FSDP2's post-backward callback too) forgets the arrivals before it: those of a batch
    discarded by `model.zero_grad(set_to_none=False)` without a step, or of an earlier
    micro-batch (a parameter the last backward did not reach is then missed: a walk, no error)."""
    def arrived(_: Tensor) -> None:
        opt = owner()
        if opt is not None:
            task = torch._C._current_graph_task_id()
            if task != opt._arrival_task:
                opt._arrived.clear()
                opt._arrival_task = task
            opt._arrived.add(name)
    return arrived


def _remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()


class FsdpOptimizer(NotPickled, torch.optim.Optimizer):
    """`DistributedOptimizer` over FSDP2 parameters (built by it: `DistributedOptimizer(
    model.named_parameters(), spec, ...)` on a `fully_shard` model returns one of these). `spec`
    describes the global model. Options are `DistributedOptimizer`'s; those of the ZeRO-1 layout
    that FSDP2 decides instead (`ZERO1_ONLY`: reduce_scatter, tp_policy, tp_mode, capacity,
    overlap_param_gather, geometry, and expert_buckets, which sizes ZeRO-1's buckets of expert stacks)
    are refused off their defaults, as `canzona simulate --fsdp` refuses them (`sim.fsdp.check_fsdp`):
    set, they would change nothing; and those it does not run yet
    are refused: `plan=` (the owners are planned at construction), `overlap_step`. Expert
    parallelism (torchtitan's layout, `canzona.runtime.fsdp_ep`) runs under `optimizer="adamw"`;
    `expert_mesh` may name the experts' mesh, which their DTensors carry. `policy`: an FSDP step policy
    with owners (`canzona.step_policies.FSDP_POLICIES`: `canzona`, the default, or
    `fsdp-owners-unbalanced`); under `optimizer="adamw"` its own, zero1 (`fsdp_policy`: each rank
    its own shards, `self.policy` None), and no matrix_config or owner plan settings."""

    # torch.amp.GradScaler's `step(opt)` checks for infs through the gradients (`_amp_unscale`) and
    # hands the scale over as `self.grad_scale` (None once `unscale_` ran) for step() to unscale by
    _step_supports_amp_scaling = True
    # the found_inf of the GradScaler call the step check was last answered for (its op's calls share it)
    _amp_found: Tensor | None = None
    # the witness of the weights a state loaded unchecked was saved with (load_state_dict(),
    # load_sharded_state_dict() without check_weights): the next step checks the model's weights
    # against it (`checkpoint.check_loaded_weights`)
    loaded_witness: dict[str, Any] | None = None

    def __init__(self, opts: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
        """`opts`: every argument of `DistributedOptimizer(...)` by name, its defaults filled in (it
        builds this class); `defaults`: its signature's defaults, by name."""
        params, spec = opts["params"], opts["spec"]
        timeout_s, max_grad_norm, nonfinite = opts["timeout_s"], opts["max_grad_norm"], opts["nonfinite"]
        check_step_options(timeout_s=timeout_s, max_grad_norm=max_grad_norm, nonfinite=nonfinite,
                           **{k: opts[k] for k in ("batch_kernels", "compile_kernels", "overlap_step", "master_weights")})
        for option in ZERO1_ONLY:  # FSDP2 decides these; set, they would change nothing
            default = defaults[option]
            if opts[option] != default:
                raise SpecError(f"{option}={opts[option]!r} is the ZeRO-1 layout's option; under FSDP2 it changes "
                                f"nothing (leave it at its default, {default!r})")
        if opts["plan"] is not None:
            raise SpecError("plan= is not taken under FSDP2: the owners are planned at construction from the "
                            "model and the mesh")
        if opts["overlap_step"]:
            raise SpecError("overlap_step is not run under FSDP2 yet: the step starts after FSDP2's last "
                            "reduce-scatter")
        self.optimizer = check_matrix_optimizer(opts["optimizer"])
        # batch_kernels=False without a batched kernel, compile_kernels=True without a compiled one, as
        # `canzona simulate --fsdp` refuses them (the other settings an elementwise step does not
        # read: ZERO1_ONLY above, check_owner_plan_settings)
        check_kernel_options(self.optimizer, opts["batch_kernels"], opts["compile_kernels"])
        entry = matrix_optimizer(self.optimizer)
        # AdamW on every parameter (the baseline): each rank steps its own shards, no owners, no
        # exchange (policy None), as `canzona simulate --fsdp --optimizer adamw` prices it
        self.elementwise = entry.elementwise
        self.policy = fsdp_policy(self.optimizer, resolve_policy(opts["policy"], self.optimizer))
        if self.policy is not None and self.policy.gathers_all:
            raise SpecError(f"policy {self.policy.name!r} is a simulator baseline (every rank computes every "
                            "matrix); the runtime runs owner policies: canzona, fsdp-owners-unbalanced")
        if self.elementwise and opts["matrix_config"] is not None:
            raise SpecError(f"{self.optimizer} runs every parameter with adamw_config; give its hyper-parameters "
                            "there (matrix_config is for a matrix optimizer)")
        settings = PlanSettings(dp_policy=opts["dp_policy"], alpha=opts["alpha"], bucket_size=opts["bucket_size"],
                                align=opts["align"], capacity=opts["capacity"], balance_by=opts["balance_by"])
        check_owner_plan_settings(self.policy, settings)  # before any collective: every rank alike
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self._nonfinite = nonfinite
        self.skipped_steps = 0
        self._amp = AmpMarks()  # where GradScaler's unscale and the clip stand in this step
        self.overlapped_steps = 0  # never: overlap_step is not run under FSDP2
        self.timeout_s = float(timeout_s)
        self.adamw_cfg = optimizer_config("adamw", opts["adamw_config"])
        self.matrix_cfg = self.adamw_cfg if self.elementwise else optimizer_config(self.optimizer, opts["matrix_config"])
        self.spec = spec
        self.batch_kernels, self.compile_kernels = opts["batch_kernels"], opts["compile_kernels"]

        groups = user_groups(params, spec)
        given = {n: p for pairs, _ in groups for n, p in pairs}
        # expert parallelism (torchtitan's layout, canzona.runtime.fsdp_ep): checked before the
        # parameters (a matrix optimizer over EP-sharded stacks is refused as such) and the mesh
        # (its refusals of meshes are the more telling), from the DTensors' meshes and placements
        self.expert_mesh = expert_mesh_of(given, self.optimizer, self.elementwise, opts["expert_mesh"])
        # the mesh first, and every rank's group over it: the parameters' refusals below are a rank's
        # own (a model materialized with to_empty() on some ranks only), and travel on that group.
        # Only what decides the mesh is refused before that group exists, raised by each rank that
        # finds it: no parameter a DTensor (DistributedOptimizer builds this class only where this
        # rank's are: a rank without any takes the ZeRO-1 layout's construction anyway), the experts'
        # mesh (above) and meshes that do not nest (root_mesh); all come from the code that sharded
        # the model, the same on every rank in practice
        self.device_mesh = root_mesh(_dtensors(given))
        me = dist.get_rank()
        world_ranks = [int(r) for r in self.device_mesh.mesh.flatten().tolist()]
        world_group, _ = new_groups([world_ranks], me, self.device_mesh)
        self.world = Comm(world_group, timeout_s, FSDP_WORLD_GROUP)  # every rank's (canzona.fsdp_collectives)
        refusal: Exception | None = None  # an unexpected failure on one rank (a bug, an OOM) too
        try:
            self.params = self._checked_params(groups)
            if self.compile_kernels:
                check_compile(p.device.type for p in self.params.values())
            matrix_names = set() if self.elementwise else {p.name for p in spec.matrix_params()}
            param_groups = build_param_groups(groups, matrix_names, self.optimizer, self.matrix_cfg,
                                              self.adamw_cfg, spec)
        except Exception as e:
            refusal = e
        # one small all-gather: the ranks that passed raise at once too, not at the layout's gather
        # after timeout_s (`Comm.spread_failure`, as DistributedOptimizer's agreement verdict)
        verdict = self.world.spread_failure(None if refusal is None else str(refusal), PARAMETERS_VERDICT,
                                            "rank(s) {ranks} of the mesh refused their parameters")
        if refusal is not None:
            raise refusal
        if verdict is not None:
            raise SpecError(verdict)

        # replicas run alike; the exchange group's ranks tile every parameter
        first = next(iter(self.params.values()))
        self.replica_dims = replica_dims(self.params, self.device_mesh)
        if self.expert_mesh is not None and self.replica_dims:  # HSDP's replicas of the experts' mesh
            raise SpecError(f"every parameter is replicated over mesh dimension(s) {self.replica_dims} beside experts "
                            "sharded over 'ep': HSDP beside expert parallelism is not run under FSDP2")
        exchange_group, self.exchange_ranks = new_groups(exchange_ranks(self.device_mesh, self.replica_dims), me,
                                                         self.device_mesh)
        self.comm = Comm(exchange_group, timeout_s, FSDP_GROUP)  # the exchange group's
        self.comm.log.clock = self.world.log.clock  # one issue order over both logs
        self.rank, self.size = self.comm.rank, self.comm.size
        self.dp = self.size  # the ranks a matrix's pieces come from (canzona.memory's and the logs' DP)
        # where this exchange group's members sit in the world check's table
        self._members = [world_ranks.index(r) for r in self.exchange_ranks]

        boxes = self.comm.all_gather_object({n: local_box(p) for n, p in self.params.items()}, "fsdp layout")
        self.layout: dict[str, ParamLayout] = {
            n: param_layout(n, tuple(p.shape), [b[n] for b in boxes]) for n, p in self.params.items()}

        # the owner plan (None: AdamW's step has no owners), priced on the GPU's own profile where
        # cost_model is None (`planning_cost_model`), as `canzona simulate --fsdp --hardware` prices it
        matrices, self.plan = ({}, None) if self.policy is None else fsdp_matrices(
            spec, self.size, self.optimizer, self.policy, settings,
            planning_cost_model(opts["cost_model"], local_tensor(first).device), matrix_config=self.matrix_cfg)
        self.owner = {n: m.owner for n, m in matrices.items()}
        # micro-groups: each owner's matrices in backward order, cut into chunks of about equal cost
        self.micro_groups = [[m.name for m in g] for g in
                             owner_micro_groups(backward_order(fsdp_units(spec, matrices)))]
        self.matrices = [p.name for p in spec.params if p.name in matrices]
        self.elementwise_names = [p.name for p in spec.params if p.name not in matrices]
        self.hosted = [n for n in self.matrices if self.owner[n] == self.rank]
        self.applies = list(self.matrices)

        self._check_agreement(param_groups, matrices)
        configs = {"matrix": self.matrix_cfg, "adamw": self.adamw_cfg}
        super().__init__(param_groups, {})
        self.defaults = defaults_of(configs)
        # torch's checkpoint API runs no zero-gradient step; its flattened form finds the fields
        self.state = StateHeldElsewhere(weakref.proxy(self))  # weakly: `del opt` frees it without gc
        label_groups(self)
        self._configs = GroupConfigs(configs, group_matrices(self.param_groups, self.params, spec))
        group_of = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        self._group_of = {n: group_of[id(p)] for n, p in self.params.items()}
        self._group_members = group_members(self.param_groups)  # what the step runs, group by group

        low = {p.dtype for p in self.params.values()} & set(LOW_PRECISION)
        self.master_weights = bool(opts["master_weights"] and low)
        # what gradients and updates travel and are computed in (fp32 beside fp32 masters)
        self.grad_dtype = self.update_dtype = torch.float32 if self.master_weights else first.dtype
        self.device = local_tensor(first).device
        self.param_dtype = first.dtype  # what the step's dtypes and masters were chosen for
        self.kernel, self.batched = matrix_kernels(self.optimizer, batch=self.batch_kernels,
                                                   compile=self.compile_kernels)
        self.scalars = entry.part("scalars")
        self.matrix_state: dict[str, dict] = {n: {} for n in self.hosted}
        self.matrix_steps: dict[str, int] = {n: 0 for n in self.matrices}
        self.adamw_state: dict[str, dict] = {}
        self.master: dict[str, Tensor] = {}
        if self.master_weights:
            self.reset_master_weights()
        # what FSDP2 shards in each parameter's place (its FSDPParam, which follows load_state_dict(
        # assign=True) and the like), or else the modules holding it: a parameter replaced since
        # is one error in the step check (`_replaced`)
        parents: Parents = {}
        self._fsdp_params, self._fsdp_groups, self._holders = fsdp_params_of(self.params, parents)
        # and the links from the model down to the modules holding them: a module replaced in its
        # parent lives on in FSDP2's record (its FSDPParam holds it), so no holder above changed,
        # while the new module's parameters train unstepped (`param_gather.ModuleLinks`); a mismatched
        # link is judged by the construction names: every parameter (the DTensor the model holds) must
        # resolve by its name from the model to the same Parameter (a backup list holding the old
        # module is no root; two layers swapped are 'moved')
        self._links = ModuleLinks(module_links({**fsdp_holders(self._fsdp_params), **self._holders}, parents),
                                  self._registered())
        # a model load on some ranks only: each holds its own shards (`canzona.runtime.model_loads`)
        clear_marks(self)
        watch_loads([*(fp._module_info.module for fp in self._fsdp_params.values()),
                     *(m for refs in self._holders.values() for ref, _ in refs if (m := ref()) is not None)],
                    self, mark_loaded)
        # and written in place (`note_writes`), but for an embedding's weight that its forward renormalises (max_norm)
        unwatched = renormed_in_forward({
            **{n: [fp._module_info.module] for n, fp in self._fsdp_params.items()},
            **{n: [ref() for ref, _ in refs] for n, refs in self._holders.items()}})
        self._weight_versions = WeightVersions({n: p for n, p in self.params.items() if n not in unwatched})
        self.checked: tuple[dict[str, bool], float] | None = None
        self._ungraded: list[str] | None = None  # the last check's parameters that got no gradient here
        self._grad_scale = 1.0  # clipping's factor, applied where low-precision gradients widen (`_grad`)
        # each gradient the kept check saw, with its version: a backward since bumps the version
        # (added to it), and one after `model.zero_grad()` leaves another tensor (`check`)
        self._versions: dict[str, tuple[weakref.ref, int]] | None = None
        # and a digest of their values (`_grad_digest`), where a reuse may follow: an in-place edit
        # through the DTensor (torch's clip_grad_norm_, `grad.mul_`) moves no local version counter
        self._digest: Tensor | None = None
        # the parameters FSDP2 wrote a reduced gradient for since the last step (or zero_grad()):
        # FSDP2 runs a sharded parameter's post-accumulate-grad hooks after writing it
        # (`_missed_gradients`); a torch that runs none leaves every parameter missed, each step's
        # check then reading every link (`ModuleLinks`: no replacement missed, a walk's cost)
        self._arrived: set[str] = set()
        self._arrival_task = -1  # the backward (graph task) `_arrived` came from
        # no hook on a parameter under FSDP2's CPU offload: one would turn its device-to-host copy of
        # the reduced gradient blocking (torch 2.13); it counts as missed every step (`_missed_gradients`)
        self._offloaded = frozenset(n for n, fp in self._fsdp_params.items() if getattr(fp, "offload_to_cpu", False))
        owner = weakref.ref(self)  # the hooks must not keep the optimizer alive
        self._arrival_hooks = [p.register_post_accumulate_grad_hook(_note_arrival(owner, n))
                               for n, p in self.params.items() if n not in self._offloaded]
        # removed when the optimizer dies: a dropped one leaves none on the model's parameters
        weakref.finalize(self, _remove_hooks, self._arrival_hooks)
        dtensor_amp.install(self)  # GradScaler's unscale of these gradients comes here (`_amp_unscale`)

    # --- construction ------------------------------------------------------------------------

    def _checked_params(self, groups: list) -> dict[str, Tensor]:
        from torch.distributed.tensor import DTensor

        params: dict[str, Tensor] = {}
        for pairs, _ in groups:
            for name, p in pairs:
                if name in params:
                    raise SpecError(f"parameter {name!r} is given twice")
                if not p.requires_grad:
                    raise SpecError(f"parameter {name!r} does not require gradients: leave frozen parameters "
                                    "out of the optimizer and the spec (canzona.runtime.modules.named_parameters "
                                    "and ModelSpec.from_module skip them)")
                if not isinstance(p, DTensor):
                    # a 0-d one cannot be sharded: torch's fully_shard refuses it
                    what = "a 0-d scalar, which fully_shard does not shard: store it as a one-element vector " \
                        "(shape (1,)) and" if p.dim() == 0 else "a plain tensor beside FSDP2's DTensors:"
                    raise SpecError(f"parameter {name!r} is {what} shard the whole model with fully_shard (at least "
                                    "its root)")
                check_not_meta(name, p)
                pspec = self.spec.param(name)
                if tuple(p.shape) != tuple(pspec.shape):
                    raise SpecError(f"parameter {name!r} has global shape {tuple(p.shape)}, the model spec says "
                                    f"{tuple(pspec.shape)}")
                if pspec.matrix_shape is not None and not self.elementwise:  # AdamW steps a stack's rows alike
                    raise SpecError(stacked_experts_refusal(self.optimizer, name))
                params[name] = p
        missing = [p.name for p in self.spec.params if p.name not in params]
        if missing:
            raise PlanError(f"the model spec has parameters that were not given, e.g. {missing[0]}")
        dtypes = {p.dtype for p in params.values()}
        if len(dtypes) > 1:
            raise SpecError(f"the sharded parameters mix dtypes {sorted(map(str, dtypes))}: FSDP2 keeps one")
        return params

    def _check_agreement(self, param_groups: list[dict[str, Any]], matrices: Mapping[str, Any]) -> None:
        """Every rank of the mesh runs the same model, owners and hyper-parameters."""
        owners = ",".join(f"{n}:{matrices[n].owner}" for n in self.matrices)
        self.world.check_agreement({
            "model fingerprint": self.spec.fingerprint(),
            "parameter order": ",".join(p.name for p in self.spec.params),
            "optimizer configuration": repr((self.optimizer, asdict(self.matrix_cfg), asdict(self.adamw_cfg))),
            # before the owners: ranks planning on other GPUs' profiles (cost_model=None) say so
            COST_MODEL_FACT: self.plan.cost_model if self.plan is not None else "none (no owners)",
            "owners": owners,
            "policy": self.policy.name if self.policy is not None else "each rank its own shards",
            "gradient clipping and non-finite steps": f"max_grad_norm {self.max_grad_norm}, nonfinite {self._nonfinite}",
            "matrix kernels": f"batch_kernels {self.batch_kernels}, compile_kernels {self.compile_kernels}",
            "parameter groups": str(hyper_parameters_digest(param_groups, self.params)),
            "mesh": f"{tuple(self.device_mesh.mesh.shape)} replicas over dims {self.replica_dims}",
        }, COST_MODEL_ADVICE)

    @torch.no_grad()
    def reset_master_weights(self) -> None:
        """fp32 master copies of this rank's shards, taken from the parameters as they are now."""
        self.master = {n: p.to_local().detach().float().clone() for n, p in self.params.items()}

    # --- hyper-parameters ----------------------------------------------------------------------

    @property
    def nonfinite(self) -> str:
        return self._nonfinite

    def group_config(self, g: int) -> Any:
        return self._configs.config(g, self.param_groups[g])

    def _config(self, name: str) -> tuple[Any, float]:
        g = self._group_of[name]
        return self.group_config(g), group_lr(self.param_groups[g])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_configs", None) is not None:
            raise SpecError("parameters cannot be added to a DistributedOptimizer after construction: its owners "
                            "are planned over every parameter; build it with all the groups")
        super().add_param_group(param_group)

    # --- the step check --------------------------------------------------------------------------

    def _local_grad(self, name: str) -> Tensor:
        return local_tensor(self.params[name].grad)  # DTensor.to_local() is an autograd call

    def _grad(self, name: str) -> Tensor:
        """This rank's piece of the gradient as the step uses it: in the dtype the step runs in,
        clipped (`clip_grad_norm_`)."""
        g = self._local_grad(name).to(self.grad_dtype)
        return g * self._grad_scale if self._grad_scale != 1.0 else g

    def _replaced(self) -> str | None:
        """A message naming a parameter that FSDP2 no longer shards (another tensor took its place
        after construction: `model.load_state_dict(..., assign=True)`, a new module or Parameter):
        FSDP2 then reduces gradients into the new tensor and trains it, which this optimizer never
        steps, while the old one would be stepped with no gradient, silently."""
        for name, fsdp_param in self._fsdp_params.items():
            if fsdp_param.sharded_param is not self.params[name]:
                return replaced_message(name, "FSDP2 now shards another tensor in its place")
        return replaced_parameter(self.params, self._holders) or \
            self._links.changed(self._registered, self._missed_gradients)

    def _registered(self) -> dict[str, Tensor]:
        """Each parameter as its module holds it now (FSDP2 registers the unsharded tensor in the
        sharded DTensor's place while a module is unsharded: the root after a forward under no_grad),
        what the links' construction names resolve to (`ModuleLinks`)."""
        out = dict(self.params)
        for name, fp in self._fsdp_params.items():
            info = fp._module_info
            out[name] = info.module._parameters.get(info.param_name, out[name])
        return out

    def _missed_gradients(self) -> list[str]:
        """The parameters that got no gradient from a backward since the last step: a module
        replaced without a registration (`ModuleList.insert`, `_modules` written, `del`) leaves its
        old parameters none, which sends `ModuleLinks` to walk its links. None in `.grad`, or no
        reduced gradient written by FSDP2 since (`_arrived`): one zeroed in place
        (`zero_grad(set_to_none=False)`, the optimizer's or the model's) stays a zero tensor, and
        FSDP2's reduced gradients share one version counter per reduction (views of its output),
        so neither the tensor nor its counter tells. FSDP2's
        `reduce_scatter_unused_params` gives every unused parameter a zero gradient: none missed."""
        arrived, offloaded = self._arrived, self._offloaded
        # a gradient under CPU offload (no arrival hook) counts as missed every step: the links are
        # walked every step (0.02 ms at 80 layers, 0.31 ms at 1,000), where telling it by its
        # values would read every offloaded gradient twice a step (12 ms per 64 MiB of fp32 here)
        return [n for n, p in self.params.items() if p.grad is None or n in offloaded or n not in arrived]

    def _changed(self) -> str | None:
        """What changed on this rank since construction that a step cannot follow: `param_groups`
        holding other parameters, or a parameter replaced in the model (`_replaced`)."""
        return members_changed(self.param_groups, self._group_members) or self._replaced()

    def _held_by_fsdp(self) -> str | None:
        """A gradient FSDP2 still holds unreduced on this rank (`param_gather.held_by_fsdp`)."""
        return held_by_fsdp(self._fsdp_params, self._fsdp_groups)

    def _local_problem(self) -> str | None:
        from torch.distributed.tensor import DTensor

        replaced = self._changed()
        if replaced is not None:
            return replaced
        held = self._held_by_fsdp()
        if held is not None:
            return held
        for name, p in self.params.items():
            local = local_tensor(p)
            if p.dtype != self.param_dtype or local.device != self.device:
                # the step would fail midway (some updates applied) or step in the wrong precision
                return (f"{name} is {p.dtype} on {local.device} on rank {dist.get_rank()}, {self.param_dtype} on "
                        f"{self.device} when the optimizer was built: the model was cast or moved after building "
                        "the optimizer; cast or move it first (before fully_shard), then build the optimizer")
        for name, p in self.params.items():
            g = p.grad
            if g is None:
                continue
            if not isinstance(g, DTensor) or tuple(g.placements) != tuple(p.placements):
                return (f"{name}: its gradient on rank {dist.get_rank()} is {type(g).__name__} "
                        f"{getattr(g, 'placements', None)}, not sharded as the parameter {tuple(p.placements)}")
            local = g.to_local()
            if local.shape != p.to_local().shape:
                return (f"{name}: its local gradient on rank {dist.get_rank()} is {tuple(local.shape)}, the local "
                        f"shard {tuple(p.to_local().shape)}")
        return None

    def check(self, max_norm: float | None = None, recheck: bool = True,
              skip_nonfinite: bool = False) -> tuple[dict[str, bool], float]:
        """The step check, once per step (`clip_grad_norm_`, then `step`): ONE small all-gather over
        every rank of the mesh. Returns (got: name -> a gradient everywhere, the global norm). A call
        that reuses it (`step()` after `clip_grad_norm_()`, a second clip) rechecks, with `recheck`,
        what may have changed since on one rank only: the hyper-parameters (a learning rate set
        between the clip and the step) and the threshold. A rank cannot tell its peers that its own
        changed without a collective, so every reuse costs one more small all-gather (clip and step
        are collective calls: every rank reuses alike); step()'s own clip (`max_grad_norm`), right
        after its check, rechecks nothing. `skip_nonfinite`: a NaN / Inf norm is returned, not raised
        (GradScaler's unscale: the scaler skips that step, whatever `nonfinite` says)."""
        note_writes(self)  # weights written in place since the last step mark it as a load does
        if self.checked is not None and recheck:
            # what changed since on this rank: the hyper-parameters, the threshold, the gradients (a
            # backward added to them, or new ones replaced them: `model.zero_grad()`, then a
            # backward). Every rank learns every rank's, so that all take the check anew together
            # (one rank alone would issue the step check where the others issue this recheck)
            # and what may have broken since on this rank alone: param_groups' membership edited, a
            # parameter replaced (every rank fails alike, none goes on into the step's collectives
            # alone); the rest of `_local_problem` (dtypes, gradients' placements) is the full
            # check's, which new gradients (`since`) take anew, and is not paid twice a clipped step
            since = self._grads_since()
            problem = self._changed() or self._held_by_fsdp()  # a backward since may leave `.grad` alone
            digest = hyper_parameters_digest(self.param_groups, self.params, self._ungraded)
            row = torch.tensor([digest, 0, _SINCE.index(since),
                                int(problem is not None), int(self._model_loaded)], dtype=torch.int64)
            assert row.numel() == RECHECK_WORDS  # the simulator's record of this all-gather
            row[1] = torch.tensor([_clip_word(max_norm)], dtype=torch.float64).view(torch.int64)[0]
            table = self.world.all_gather_values(row, "step recheck")
            changed, broken = table[:, 2], table[:, 3]
            if broken.any():
                raise CanzonaError(problem if problem is not None else
                                   f"rank(s) {ranks_of(broken != 0)} found a broken step (see their error)")
            self._check_loads(table[:, 4])  # loaded between clip_grad_norm_() and step()
            if changed.any():
                added, edited = changed == _SINCE.index("added"), changed == _SINCE.index("edited")
                if ((added | edited).any() and self._grad_scale != 1.0 and self._amp.unscaled is self.checked
                        and self._amp.clipped is not self.checked):
                    # GradScaler's unscale_ kept as a scale (every rank alike): `.grad` is still scaled, so
                    # whatever read it since (a clip of the user's own) saw values 1 / scale too large; after
                    # opt.clip_grad_norm_ (which measured them unscaled) a backward is the next check's error
                    raise CanzonaError(f"gradients changed after GradScaler's unscale_ (rank(s) "
                                       f"{ranks_of(added | edited)}; bf16 gradients, fp32 masters, whose unscale is a "
                                       "scale applied at the step: .grad still holds the scaled values, so a clip of "
                                       "them measured the scaled norm): clip with opt.clip_grad_norm_, which measures "
                                       "them unscaled, and run no backward between unscale_ and step()")
                if added.any() and self._grad_scale != 1.0:  # a clip kept as a scale cannot cover only the older part
                    raise CanzonaError(f"a backward added to gradients clip_grad_norm_() had already clipped (rank(s) "
                                       f"{ranks_of(added)}; bf16 gradients, fp32 masters): clip once, after the last "
                                       "backward before step()")
                if edited.any() and self._grad_scale != 1.0:
                    # the kept scale is not applied to the bf16 gradients themselves: whatever changed them
                    # (torch's clip_grad_norm_) measured the unclipped values, and the scale would apply twice
                    raise CanzonaError(f"gradients clip_grad_norm_() had already clipped were changed in place since "
                                       f"(rank(s) {ranks_of(edited)}; bf16 gradients, fp32 masters, whose clip is a "
                                       "scale applied at the step): clip once, with opt.clip_grad_norm_ only")
                # taken anew, as torch's clip_grad_norm_ would measure them; the old clip's scale is not theirs
                self.checked, self._grad_scale = None, 1.0
            else:
                error = _recheck_error(table[:, :2], self.world, digest, "rank")
                if error is not None:
                    raise CanzonaError(error)
        if self.checked is not None:
            return self.checked
        names = [p.name for p in self.spec.params]
        problem = self._local_problem()
        got_here = [self.params[n].grad is not None for n in names]
        # every gradient element once: each rank sums the pieces it sends (a box held by several
        # ranks of the exchange group is sent, and counted, by the lowest)
        segments = [] if problem is not None else [
            self._local_grad(n).reshape(-1) for n, g in zip(names, got_here)
            if g and self.layout[n].sources[self.rank]]
        term = local_norm_term(segments).to(torch.float64).cpu()
        # whether the parameters that got no gradient here are frozen (one that got one was trainable
        # then); the recheck looks at the same ones
        self._ungraded = [n for n, g in zip(names, got_here) if not g]
        digest = hyper_parameters_digest(self.param_groups, self.params, self._ungraded)
        header = torch.cat([torch.tensor(got_here + [problem is not None, digest, self._model_loaded],
                                         dtype=torch.int64),
                            term.reshape(1).view(torch.int64),
                            torch.tensor([_clip_word(max_norm)], dtype=torch.float64).view(torch.int64)])
        table = self.world.all_gather_values(header, "step check")
        k = len(names)
        flags, broken, digests = table[:, :k], table[:, k], table[:, k + 1]
        if not broken.any():
            self._check_loads(table[:, k + 2])
        terms, clips = table[:, -2].view(torch.float64), table[:, -1].view(torch.float64)
        error = None
        if broken.any():
            error = problem if problem is not None else \
                f"rank(s) {ranks_of(broken != 0)} found a broken step (see their error)"
        elif not _all_same(digests):
            error = f"{digests_apart(self.world, digest, 'rank')}: change them alike on every rank"
        elif not _all_same(clips):
            error = _clip_disagreement(clips, self.world.rank, "rank")
        elif not flags.any():
            error = ("step() found no gradient on any rank: call backward() before step(), on the "
                     "parameters given to the optimizer")
        elif not torch.all(flags == flags[0]):
            j = int(torch.nonzero((flags != flags[0]).any(dim=0))[0])
            error = (f"{names[j]!r} has a gradient on rank(s) {ranks_of(flags[:, j] != 0)} and none on rank(s) "
                     f"{ranks_of(flags[:, j] == 0)}: every rank must run the same backward (FSDP reduces "
                     "every gradient over all ranks)")
        if error is not None:
            raise CanzonaError(error)
        norm = math.sqrt(float(combine_norm_terms(terms[self._members])))
        if not math.isfinite(norm):
            # NaN weights make every later gradient NaN: named as such (not the data), under "skip"
            # and GradScaler too (no step could recover); read on this failure path only
            error = nonfinite_weights_error([(n, self.params[n].to_local()) for n in names], norm, [self.world])
            if error is not None:
                raise CanzonaError(error)
        if not math.isfinite(norm) and self._nonfinite == "raise" and not skip_nonfinite:
            raise CanzonaError(f"the global gradient norm is {norm} (a NaN or Inf gradient): nothing was updated. "
                               "Pass nonfinite='skip' to skip such steps (counted in opt.skipped_steps)")
        self.checked = ({n: bool(flags[0, j]) for j, n in enumerate(names)}, norm)
        # the digest is taken by the calls a reuse may follow (`_clip`, a refused `step()`)
        self._versions, self._digest = self._grad_versions(), None
        return self.checked

    def _check_loads(self, loaded: Tensor) -> None:
        """The ranks' marks of a model load since the last step (`canzona.runtime.model_loads`): on
        some ranks and not the others, one error on every rank; taken (cleared) otherwise."""
        if loaded.any() and not loaded.all():
            # on this failure path only (every rank takes it: the table is the same on all), the ranks
            # show each other which parameters they wrote since the last step, for the error to name the first
            written = self.world.all_gather_object(self._weight_versions.written_since_record(), "load disagreement")
            raise CanzonaError(loaded_on_some_ranks(ranks_of(loaded != 0), ranks_of(loaded == 0),
                                                    first_written_apart(self.params, written)))
        clear_marks(self)
        record_writes(self)

    def _grad_digest(self) -> Tensor:
        """Each local gradient's 2-norm, accumulated in fp32 (a tenth of the check's fp64 sum's time
        on CPU), as bits: equal digests leave every gradient's norm, and so the kept check's
        global norm and verdict, as they were to fp32 rounding, and a NaN or Inf is never equal
        to a finite value."""
        norms = [torch.linalg.vector_norm(self._local_grad(n), dtype=torch.float32).reshape(1)
                 for n, p in self.params.items() if p.grad is not None]
        return torch.cat(norms).view(torch.int32) if norms else torch.empty(0, dtype=torch.int32)

    @eager_only
    @torch.no_grad()
    @autocast_off()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Scale the local gradient pieces so that the global gradient norm is at most `max_norm`
        (torch's rule: by max_norm / (norm + 1e-6) when below 1); return the norm before clipping.
        Collective (runs the step check); call it after backward and before step(). `max_norm=inf`
        only measures."""
        # the threshold goes through the step check's agreement first (a bad one on one rank alone is
        # a disagreement there on every rank, not a raise on that rank while its peers wait in the
        # check); one the ranks agree on is refused after it, alike on every rank, nothing scaled
        # (a bad norm_type too: the NaN word)
        good_type = norm_type in (2.0, math.inf)
        word = clip_threshold_word(max_norm) if good_type else math.nan
        if math.isnan(word):
            self.check(word)
            raise SpecError(f"norm_type must be 2.0 or inf, got {norm_type!r}" if not good_type else
                            f"max_norm must be a positive number (inf: measure only), got {max_norm!r}")
        total = self._clip(word, norm_type)
        if math.isfinite(max_norm):  # a clip, not a measure: GradScaler's unscale must come before it
            self._amp.clipped = self.checked
        return total

    def _clip(self, max_norm: float, norm_type: float = 2.0, recheck: bool = True) -> Tensor:
        """`clip_grad_norm_`, validated; `recheck`: as `check` takes it (step()'s own clip: False)."""
        got, norm = self.check(max_norm, recheck)
        total = norm if norm_type == 2.0 else self._inf_norm(got)
        scaled = False
        if math.isfinite(total):
            coefficient = min(1.0, max_norm / (total + 1e-6))
            if coefficient < 1.0:
                scaled = self._scale_gradients(coefficient)
        if recheck and (scaled or self._digest is None):
            # a second clip or step() may reuse this check: their recheck compares with these values
            # (none follows step()'s own clip, whose check ends with the step)
            self._digest = self._grad_digest()
        return torch.tensor(total, dtype=torch.float32)

    def _scale_gradients(self, coefficient: float) -> bool:
        """Multiply the gradients the step takes, and the kept check's norm, by `coefficient` (a
        clip, or GradScaler's unscale); whether the gradients themselves were scaled (in place)."""
        before = self.checked
        got, norm = before
        # a second call in this step sees the scaled norm (as the ZeRO-1 path's `_scale_gradients`)
        self.checked = (got, norm * coefficient)
        self._amp.rescaled(before, self.checked)
        if self.master_weights:
            # low-precision gradients are scaled where the step widens them to fp32 (`_grad`), as
            # the ZeRO-1 path scales its fp32 reduced buffers: scaling the bf16 shard in place
            # would round once more
            self._grad_scale *= coefficient
            return False
        for n, g in got.items():
            if g:
                self._local_grad(n).mul_(coefficient)
        self._versions = self._grad_versions()  # here, not by a backward
        return True

    @torch.no_grad()
    @autocast_off()
    def _amp_unscale(self, found_inf: Tensor, inv_scale: Tensor) -> None:
        """torch.amp.GradScaler's `unscale_(opt)`, and the inf check `scaler.step(opt)` makes first
        (`inv_scale` 1: the scale then comes to `step()` as `grad_scale`), on FSDP2's gradients
        (`canzona.runtime.dtensor_amp` hands the op here): the first call of a step runs the step
        check (a collective, as `clip_grad_norm_()` is: GradScaler calls it on every rank alike) and
        unscales every gradient; each call sets `found_inf` from the global norm, the same on every
        rank, so that every rank's scaler skips the same steps and scales alike. A NaN / Inf norm is
        the scaler's to skip, not an error (whatever `nonfinite` says)."""
        if found_inf is not self._amp_found:
            # a new unscale_ (or step's inf check: GradScaler gives each its own found_inf, and each
            # call of the op within it the same one). A check kept from before it outlived a step the
            # loop skipped without step() (none ended it); zeroed by model.zero_grad() and a backward
            # since, those are other gradients: the check's recheck (collective, as this call is on
            # every rank) takes it anew where any rank's gradients changed
            self._amp_found = found_inf
            if self.checked is not None:
                self.check(skip_nonfinite=True)
        self._amp.unscale(lambda: self.checked, lambda check: math.isfinite(check[1]), self._amp_take,
                          found_inf, inv_scale)

    def _amp_take(self, coefficient: float) -> None:
        """`AmpMarks.unscale`'s check: the step check with a non-finite norm the scaler's to skip, and
        the unscale of every gradient by `coefficient`."""
        _, norm = self.check(skip_nonfinite=True)
        if math.isfinite(norm) and coefficient != 1.0:
            self._scale_gradients(coefficient)
        # a clip or step() reusing this check compares the gradients with these values
        self._digest = self._grad_digest()


    def _inf_norm(self, got: Mapping[str, bool]) -> float:
        # the gradients' largest magnitude as the step takes them (a clip or an unscale kept as a
        # scale for the masters included)
        local = max((float(self._local_grad(n).abs().max()) * self._grad_scale for n, g in got.items()
                     if g and self._local_grad(n).numel()), default=0.0)
        every = self.world.all_gather_values(torch.tensor([local], dtype=torch.float64), "gradient norm")[:, 0]
        return float(every.max())

    # --- the step ----------------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.checked, self._grad_scale = None, 1.0
        for p in self.params.values():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self._arrived.clear()

    @eager_only
    @torch.no_grad()
    def step(self, closure=None):  # noqa: D401 - torch.optim signature
        return run_step(self, closure, self._checked_step)

    def _checked_step(self) -> None:
        try:
            self._checked_step_now()
        finally:  # taken or refused: the arrivals were this step's (a backward after reaches anew)
            self._arrived.clear()

    def _checked_step_now(self) -> None:
        fsdp_checkpoint.check_weights_at_step(self)  # after load_state_dict(): its weights, before anything changes
        # refused by either, nothing changed: a clip already taken (the checked norm, `_grad_scale`)
        # stays for a step() called again once the cause is fixed, as the ZeRO-1 layout's scaled
        # buffers do (`check` sees a backward in between); zero_grad() forgets it
        inverse = handed_inverse_scale(self)
        got, norm = self.check(self.max_grad_norm)
        if self.checked is self._amp.unscaled:  # GradScaler's unscale_ (through a wrapper) unscaled them already
            inverse = None
        try:
            # the groups' members (since the check: a clip's) and every hyper-parameter valid before
            # anything changes
            check_groups_now(self.param_groups, self._group_members, self.group_config)
        except Exception:
            if self._digest is None:  # the check is kept for step() called again
                self._digest = self._grad_digest()
            raise
        try:
            if inverse is not None and math.isfinite(norm):
                self._scale_gradients(inverse)
                norm = self.checked[1]
            if not math.isfinite(norm):  # nonfinite="skip", or GradScaler's verdict: every rank skips alike
                self.skipped_steps += 1
                log.warning("canzona: skipped step: the global gradient norm is %s (%d skipped so far)", norm,
                            self.skipped_steps)
            else:
                if self.max_grad_norm is not None:  # right after the check above: nothing to recheck
                    self._clip(self.max_grad_norm, recheck=False)
                self._reshard()
                self._step(got)
            self.comm.log.step += 1
            self.world.log.step += 1
            record_writes(self)  # the step's own writes
        finally:
            self.checked, self._grad_scale = None, 1.0

    def _grad_versions(self) -> dict[str, tuple[weakref.ref, int]]:
        """Each gradient (a weak reference to `.grad`: a dropped one is not kept alive) with its
        version counter (a backward accumulating into it bumps it)."""
        return {n: (weakref.ref(p.grad), self._local_grad(n)._version)
                for n, p in self.params.items() if p.grad is not None}

    def _grads_since(self) -> str | None:
        """How the gradients changed since the kept check saw them: None (not at all), "added" (a
        backward accumulated into one), "replaced" (another tensor, or none, in `.grad`: set to
        None by `model.zero_grad()` and written by a backward since, or assigned) or "edited" (the
        same tensors, other values: torch's `clip_grad_norm_`, `grad.mul_()` on the DTensor,
        which change its local tensor below the version counter). The last costs one read of the
        local gradients (`_grad_digest`), no counter seeing those edits; the norm is all the kept
        check holds of their values, so each gradient's norm is what is compared."""
        seen, how = self._versions or {}, None
        for n, p in self.params.items():
            entry = seen.get(n)
            if entry is None and p.grad is None:
                continue
            if entry is None or p.grad is None or entry[0]() is not p.grad:
                return "replaced"
            if entry[1] != self._local_grad(n)._version:
                how = "added"
        if how is None and (self._digest is None or not torch.equal(self._grad_digest(), self._digest)):
            how = "edited"
        return how

    def _reshard(self) -> None:
        """Free the unsharded parameters FSDP2 still holds (a module `fully_shard`-ed with
        `reshard_after_forward=False`, the root by default, after a forward with no backward after
        it, an evaluation between backward and step(), say; `set_reshard_after_backward(False)`;
        `model.unshard()`): FSDP2's next forward would read them, the weights from before this step,
        instead of gathering the updated shards. Local, and alike on every rank."""
        for group in self._fsdp_groups:
            if not group.is_sharded:
                group.reshard()

    def _step(self, got: Mapping[str, bool]) -> None:
        groups = [[n for n in g if got[n]] for g in self.micro_groups]
        groups = [g for g in groups if g]
        scalars = {n: self.scalars(self.layout[n].shape, *self._config(n), self.matrix_steps[n])
                   for g in groups for n in g}
        # at most two micro-groups in flight each way (what canzona.memory and the simulator count)
        scattering: tuple[list[str], Tensor, PendingWork] | None = None
        pending = self._send_gradients(groups[0], 0) if groups else None
        for k, group in enumerate(groups):
            received, work = pending
            # the next micro-group's gradients travel under this one's compute
            pending = self._send_gradients(groups[k + 1], k + 1) if k + 1 < len(groups) else None
            work.wait()
            updates = self._compute(group, received, scalars)
            del received, work
            sent = self._send_updates(group, updates, scalars, k)
            if scattering is not None:  # the previous micro-group's updates arrived under this compute
                self._apply(*scattering, scalars)
            scattering = sent
        self._adamw_step(got)  # under the last scatter
        if scattering is not None:
            self._apply(*scattering, scalars)
        for n in self.matrices:
            if got[n]:
                self.matrix_steps[n] += 1

    def _sizes(self, names: Sequence[str], member: int, *, sent: bool) -> int:
        """Elements of `member`'s pieces of `names` that cross the wire: those it sends (`sent`),
        or those it receives back."""
        total = 0
        for n in names:
            lay = self.layout[n]
            if sent and not lay.sources[member]:
                continue
            total += lay.boxes[member].numel
        return total

    def _send_gradients(self, names: Sequence[str], k: int) -> tuple[Tensor, PendingWork]:
        """Every rank's pieces of the gradients of `names` to their owners (one all-to-all)."""
        me, size = self.rank, self.size
        by_owner = [[n for n in names if self.owner[n] == d] for d in range(size)]
        parts = [self._grad(n).reshape(-1) for d in range(size) for n in by_owner[d]
                 if self.layout[n].sources[me]]
        in_splits = [self._sizes(by_owner[d], me, sent=True) for d in range(size)]
        out_splits = [self._sizes(by_owner[me], s, sent=True) for s in range(size)]
        return self._exchange(parts, in_splits, out_splits, self.grad_dtype, f"gradients of micro-group {k}")

    def _exchange(self, parts: list[Tensor], in_splits: list[int], out_splits: list[int], dtype: torch.dtype,
                  what: str) -> tuple[Tensor, PendingWork]:
        """One variable-size all-to-all of `parts` (flat, member after member), started: the buffer
        it receives into and its work."""
        sent = torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=self.device)
        received = torch.empty(sum(out_splits), dtype=dtype, device=self.device)
        return received, self.comm.all_to_all(received, sent, out_splits, in_splits, what)

    def _compute(self, names: Sequence[str], received: Tensor, scalars: Mapping[str, Any]) -> dict[str, Tensor]:
        """The whole updates of the matrices of `names` this rank owns, assembled from the pieces
        received (member order, each member's pieces in `names` order), in the dtype they travel."""
        mine = [n for n in names if self.owner[n] == self.rank]
        if not mine:
            return {}
        blocks = list(received.split([self._sizes(mine, s, sent=True) for s in range(self.size)]))
        grads: dict[str, Tensor] = {}
        for n in mine:
            grads[n] = torch.empty(self.layout[n].shape, dtype=self.grad_dtype, device=received.device)
        pos = [0] * self.size
        for n in mine:
            lay = self.layout[n]
            for s in range(self.size):
                if not lay.sources[s]:
                    continue
                box = lay.boxes[s]
                grads[n][box.index()] = blocks[s][pos[s]:pos[s] + box.numel].view(box.shape)
                pos[s] += box.numel
        updates: dict[str, Update | None] = {}
        # same-shape matrices of one param group run as one batched kernel (bit for bit on CPU), by
        # canzona.batching's rules, which the simulator prices
        keyed = [(n, (self.layout[n].shape, self._group_of[n]) if self.batched is not None else None,
                  math.prod(self.layout[n].shape)) for n in mine]
        for batch in batches(keyed):
            g = self._group_of[batch[0]]
            cfg, lr = self.group_config(g), group_lr(self.param_groups[g])
            if len(batch) > 1:
                out = self.batched([grads[n] for n in batch], [self.matrix_state[n] for n in batch], cfg, lr)
                updates.update(zip(batch, out))
            else:
                for n in batch:
                    updates[n] = self.kernel(grads[n], self.matrix_state[n], cfg, lr)
        directions = {}
        for n in mine:
            update = updates[n]
            have = None if update is None else update.scalars
            if have != scalars[n]:
                raise CanzonaError(f"{n}: the kernel's update applies as {have}, the ranks at step "
                                   f"{self.matrix_steps[n]} would apply it as {scalars[n]}")
            if update is not None:
                directions[n] = update.direction.to(self.update_dtype)
        return directions

    def _send_updates(self, names: Sequence[str], directions: Mapping[str, Tensor], scalars: Mapping[str, Any],
                      k: int) -> tuple[list[str], Tensor, PendingWork]:
        """Each rank its pieces of the updates of `names` (one all-to-all from the owners)."""
        me, size = self.rank, self.size
        moving = [n for n in names if scalars[n] is not None]
        by_owner = [[n for n in moving if self.owner[n] == d] for d in range(size)]
        parts = [directions[n][self.layout[n].boxes[d].index()].reshape(-1)
                 for d in range(size) for n in by_owner[me]]
        in_splits = [self._sizes(by_owner[me], d, sent=False) for d in range(size)]
        out_splits = [self._sizes(by_owner[s], me, sent=False) for s in range(size)]
        chunks, work = self._exchange(parts, in_splits, out_splits, self.update_dtype, f"updates of micro-group {k}")
        order = [n for s in range(size) for n in by_owner[s]]
        return order, chunks, work

    def _apply(self, order: Sequence[str], chunks: Tensor, work: PendingWork, scalars: Mapping[str, Any]) -> None:
        """This rank's pieces of the updates of `order`, once their all-to-all completes."""
        work.wait()
        pos = 0
        for n in order:
            local = local_tensor(self.params[n])
            chunk = chunks[pos:pos + local.numel()].view(local.shape)
            pos += local.numel()
            target = update_target(self.master.get(n), local)
            apply_update_(target, chunk, Update.of(chunk, scalars[n]))
            if target is not local:
                local.copy_(target)

    def _adamw_step(self, got: Mapping[str, bool]) -> None:
        betas: dict[int, StepBetas] = {}  # a group's, read once this step: beta1 cast once, not per parameter
        for n in self.elementwise_names:
            if not got[n]:
                continue
            local = local_tensor(self.params[n])
            if not local.numel():
                continue
            g = self._group_of[n]
            target = update_target(self.master.get(n), local)
            grad = self._grad(n)
            if g not in betas:
                betas[g] = StepBetas(group_betas(self.param_groups[g]))
            adamw_step_(target.view(-1), grad.reshape(-1), self.adamw_state.setdefault(n, {}), self.group_config(g),
                        group_lr(self.param_groups[g]), betas[g])
            if target is not local:
                local.copy_(target)

    # --- checkpoints ---------------------------------------------------------------------------

    def state_dtype(self, name: str) -> torch.dtype:
        """The dtype the optimizer state is kept in: the gradients' on the wire (fp32 under masters)."""
        return self.grad_dtype

    def state_dict(self) -> dict[str, Any]:
        """Layout-independent (`canzona.runtime.checkpoint`): full tensors in torch.optim's layout,
        identical on every rank, the same form as the ZeRO-1 layout's, so that it loads under FSDP2
        at any size and into `DistributedOptimizer` on an unsharded model. Collective over the
        exchange group (every rank must call it), bounded by `timeout_s`."""
        check_members(self.param_groups, self._group_members, [self.world], "state_dict()")
        return state_dict_with_hooks(self, lambda: fsdp_checkpoint.gather_state(self))

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a `state_dict()` taken under FSDP2 at any size or under the ZeRO-1 layout at any
        DP x TP layout; checks it belongs to this model and optimizer, and at the first `step()`
        after it the weights (as on the ZeRO-1 path: their witness; a saved master that is not the
        weight cast gives way to it at the next step).
        Collective (every rank calls it with the same state dict, as `state_dict()` gives it): a
        refusal on one rank, or ranks given different state dicts, is one error on every rank."""
        check_members(self.param_groups, self._group_members, [self.world], "load_state_dict()")
        load_with_hooks(self, state_dict, lambda loaded: fsdp_checkpoint.load_state(self, loaded))

    def sharded_state_dict(self, prefix: str = DCP_PREFIX) -> dict[str, Any]:
        """This rank's share of the state for `torch.distributed.checkpoint.save` (each rank writes
        only what it holds), keyed as the ZeRO-1 layout's; merge it with the model's state dict to
        save both in one call. Under FSDP x TP (pieces that are not contiguous): `state_dict()`.
        Collective, as `dcp.save` is: every rank calls it (its witness of the weights, a few
        elements of each parameter for `load_sharded_state_dict(check_weights=True)`, is gathered
        over this optimizer's mesh, `world`: its ranks, no other)."""
        check_members(self.param_groups, self._group_members, [self.world], "sharded_state_dict()")
        return fsdp_checkpoint.sharded_state(self, prefix)

    def load_sharded_state_dict(self, checkpoint_id: Any, prefix: str = DCP_PREFIX, *,
                                check_weights: bool | None = None) -> None:
        """Load from a `torch.distributed.checkpoint` written by `sharded_state_dict()` under FSDP2
        at any size or under the ZeRO-1 layout (a path or a storage reader): each rank reads what
        its pieces need. Collective (dcp.load).

        `check_weights=True`, as on the ZeRO-1 path (the integrations pass it alike): the model's
        weights were just loaded from the same save; weights that are not the checkpoint's fp32
        masters cast to their dtype (where this optimizer keeps masters and the checkpoint has
        them), or that differ from the checkpoint's witness of them (a few elements of every
        parameter, recorded at the save), are one CheckpointError on every rank, nothing loaded:
        model files and optimizer state from two saves, say a save killed between them. Without
        it (None), the first `step()` after the load checks the witness (as after
        `load_state_dict`); `check_weights=False`: nothing checked (weights changed on purpose)."""
        check_members(self.param_groups, self._group_members, [self.world], "load_sharded_state_dict()")
        fsdp_checkpoint.load_sharded(self, checkpoint_id, prefix, check_weights=check_weights)

    # --- what users of torch optimizers reach for ----------------------------------------------

    def wait_params(self) -> None:
        """Nothing to wait for: FSDP2 gathers the parameters for each forward itself (the ZeRO-1
        path's method, kept so that code written for it runs)."""

    def no_sync(self) -> Any:
        """Refused with one line: FSDP2 reduces the gradients, so accumulation is FSDP2's own
        `model.set_requires_gradient_sync(False)` on all but the last micro-batch."""
        raise SpecError("under FSDP2, accumulate with model.set_requires_gradient_sync(False) on all but the last "
                        "micro-batch (FSDP2 reduces the gradients, not this optimizer)")
