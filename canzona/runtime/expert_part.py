"""Expert parallelism in the runtime (docs/design.md §2.7, §8.9): the experts of one EP rank, planned
and stepped over their expert-data-parallel (EDP) group beside the dense part.

Megatron's layout with expert TP 1 ("MoE parallel folding", `canzona.experts.check_ep`): the
`dp x tp` ranks of the dense part's mesh, in rank order, form `edp = dp x tp / ep` EP groups of
`ep` consecutive ranks; EP rank `j` of each holds experts `[j E / ep, (j + 1) E / ep)` of every
MoE layer, whole and stacked (local `[E / ep, m, n]` parameters under the model's names); the
ranks at position `j` of every EP group are an EDP group. At TP 1 the folding is over the DP
group; under TP an EP group may hold TP ranks of one DP rank (DP 2 x TP 2 at EP 2: the EP groups
are the TP groups) or of several. A `DistributedOptimizer` under EP runs two parts with the same
machinery:

- the dense part (everything but the experts: `canzona.experts.dense_part`) on the (DP, TP) mesh,
  as any dense model;
- `ExpertPart`: one EP rank's experts (`canzona.experts.expert_part`) planned over EDP with TP 1,
  each expert matrix owned whole by one EDP rank, its gradients reduce-scattered over EDP from the
  experts' own backward hooks, its updates computed by its owner and its parameters all-gathered
  over EDP after the step.

The expert gradients' scale: the TP ranks of a DP rank hold the same tokens, and each dispatches
its own share of them (`tp` blocks, as Megatron's sequence-parallel MoE layer holds them;
`reference/tiny_moe_ep.py`), so every token of the global batch reaches each of its experts
exactly once. A local expert's gradient holds the contributions of every token its EP group
dispatched to it (the model's dispatch all-to-all carries them back in backward), each under its
own DP rank's mean loss; the EDP group's ranks, one in every EP group, together dispatched every
token once. So the gradient of the global mean loss (the mean over the `dp` data-parallel ranks)
is the sum over EDP divided by `dp`: the mean over EDP times `edp / dp` (`expert_scale`;
`ExpertReduction`), `1 / ep` at TP 1 (`dp = edp x ep`), `tp / ep` under TP (1 at DP 2 x TP 2,
EP 2). Megatron scales them the same way (its expert gradients are summed over EDP and scaled by
`1 / dp`, `expert_gradient_scaling_factor`).

The step's checks: the expert part's own over EDP (which expert parameters got a gradient on any
EDP rank, the EDP ranks' agreement), whose error is not raised there but carried, with this rank's
share of the experts' gradient norm, into the dense part's check over DP (and TP), which every rank
of the cluster passes or fails together: one verdict on soundness, finiteness and clipping for both
parts. Whether every rank ran backward is the dense check's to say, counting both parts' gradients
(the experts may be all a run trains): experts that got no tokens on a rank (None gradients) are a
zero share of the EDP sum, not an error. Which stacks step is the dense check's to say too: it
combines every rank's got-a-gradient flags of its experts over the cluster, so that a stack (one
tensor of the model, which one process steps whole or skips) steps whole where any rank reached it,
experts no rank of their EDP group gave a gradient with zero ones, and is skipped where none did.
Every expert gradient element is counted once in the global norm: after the EDP reduce-scatter each
lives on exactly one rank of its EDP group, the EDP groups of one EP rank's experts hold distinct
experts, and the experts' share is added on every rank, TP ranks included (unlike a TP-replicated
dense parameter's, which only TP rank 0 counts).
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from canzona.errors import PlanError, SpecError
from canzona.experts import check_ep
from canzona.plan import Plan
from canzona.runtime.buffers import FlatBuffer, Piece
from canzona.runtime.comm import Comm, PendingWork
from canzona.runtime.executor import MatrixStep
from canzona.runtime.gradients import DPReduction, GradientSync
from canzona.runtime.mesh import DP, Mesh
from canzona.runtime.shards import is_dtensor, local_tensor
from canzona.spec import STACK_CLOSE, STACK_OPEN, ModelSpec, ParamSpec, stacked_matrices
from canzona.step_policies import StepPolicy
from canzona.step_schedule import TPSchedule, tp_schedule

EP, EDP = "ep", "edp"  # the expert mesh's dimension names (torchtitan's and Megatron's)


def expert_groups(mesh: DeviceMesh) -> tuple:
    """The (EDP, EP) process groups of a 2-D device mesh with dimensions named 'edp' and 'ep'
    (`init_device_mesh(device, (dp * tp // ep, ep), mesh_dim_names=("edp", "ep"))`: EP groups of
    consecutive ranks, as Megatron folds them)."""
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2 or set(mesh.mesh_dim_names or ()) != {EDP, EP}:
        raise SpecError("expert_mesh must be a 2-D DeviceMesh with dimensions named 'edp' and 'ep' "
                        "(init_device_mesh(device, (dp * tp // ep, ep), mesh_dim_names=('edp', 'ep')))")
    return mesh.get_group(EDP), mesh.get_group(EP)


def expert_scale(dp: int, edp: int) -> tuple[int, int]:
    """What the mean over EDP is multiplied by to make the global mean loss's gradient, `edp / dp`
    (see the module docstring), as (numerator, denominator) in lowest terms: the reduced gradients
    are multiplied by the first, then divided by the second (each skipped when 1), here and in the
    single-process emulation (`canzona.harness.training.expert_global_gradients`)."""
    g = math.gcd(edp, dp)
    return edp // g, dp // g


def apply_scale(t: Tensor, scale: tuple[int, int]) -> Tensor:
    """`t` times `scale[0] / scale[1]` in place (`expert_scale`'s arithmetic)."""
    num, den = scale
    if num != 1:
        t.mul_(num)
    if den != 1:
        t.div_(den)
    return t


class ExpertReduction(DPReduction):
    """The experts' gradient source: the mean over EDP (the routes and gathers of `DPReduction`),
    then scaled by `edp / dp` (`expert_scale`), on this rank's part, as it lands (see the module
    docstring)."""

    def __init__(self, edp: Comm, policy: StepPolicy, plan: Plan, scale: tuple[int, int]) -> None:
        super().__init__(edp, policy, plan)
        self.scale = scale

    def launch(self, buffer: FlatBuffer, cuts: tuple[int, ...], name: str) -> PendingWork:
        pending = super().launch(buffer, cuts, name)
        reduced = pending.then
        segment = buffer.grad[cuts[self.dp.rank]:cuts[self.dp.rank + 1]]

        def scaled() -> None:
            if reduced is not None:
                reduced()
            apply_scale(segment, self.scale)
        pending.then = scaled
        return pending


class ExpertPart:
    """One EP rank's experts as the optimizer steps them (see the module docstring). It offers what
    the step policies' parameter gathers read of an optimizer (`comm`, `dp`, `rank`, `grads`,
    `plan`) and what a checkpoint reads of one (`canzona.runtime.checkpoint.Checkpointable`: the
    optimizer's hyper-parameters, state containers and masters, its own plan, schedule and mesh,
    names local to this EP rank and `global_name`, the model's)."""

    experts = None  # a part has no part of its own

    def __init__(self, *, owner: Any, spec: ModelSpec, plan: Plan, comm: Comm, ep_comm: Comm, grads: GradientSync,
                 schedule: TPSchedule, matrix_step: MatrixStep, matrix_state: dict[str, dict],
                 matrix_steps: dict[str, int], applies: list[str]) -> None:
        self._owner = weakref.proxy(owner)  # the optimizer holds its part, not the other way round
        self.spec = spec  # the experts of one EP rank (local shapes, the model's names)
        self.plan = plan  # over EDP, TP 1
        self.comm = comm  # the EDP group
        self.ep_comm = ep_comm
        self.mesh = Mesh({DP: comm})
        self.grads = grads
        self.schedule = schedule
        self.matrix_step = matrix_step
        self.matrix_state = matrix_state
        self.matrix_steps = matrix_steps
        self.applies = applies  # the expert matrices this rank updates (and computes: TP 1)
        self.hosted = applies
        self.overlapped_steps = 0  # steps that applied the experts' updates overlap_step computed early
        self.params = dict(grads.params)
        # local matrix `stack[k]` is the model's `stack[ep_rank x matrices per EP rank + k]`
        self._global = {}
        for p in spec.stacks:
            for k, m in enumerate(stacked_matrices(p)):
                self._global[m.name] = f"{p.name}{STACK_OPEN}{ep_comm.rank * p.stack_size + k}{STACK_CLOSE}"

    @property
    def dp(self) -> int:
        return self.comm.size

    @property
    def rank(self) -> int:
        return self.comm.rank

    def global_name(self, name: str) -> str:
        return self._global.get(name, name)

    # --- what a checkpoint reads of the optimizer, for these entries ---------------------------

    @property
    def policy(self) -> StepPolicy:
        return self._owner.policy

    @property
    def optimizer(self) -> str:
        return self._owner.optimizer

    @property
    def matrix_cfg(self) -> Any:
        return self._owner.matrix_cfg

    @property
    def timeout_s(self) -> float:
        return self._owner.timeout_s

    @property
    def adamw_cfg(self) -> Any:
        return self._owner.adamw_cfg

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._owner.param_groups

    @property
    def adamw_state(self) -> dict[str, dict]:
        return self._owner.adamw_state

    @property
    def master(self) -> dict[str, Tensor]:
        return self._owner.master

    @property
    def master_weights(self) -> bool:
        return self._owner.master_weights

    def adamw_parts(self) -> Iterator[Piece]:
        return self._owner.expert_adamw_parts()

    def tensor(self, entry: str) -> Tensor:
        return self.grads.stacks.tensor(entry)

    def state_dtype(self, name: str) -> torch.dtype:
        return self.grads.buffer_of[name].reduced.dtype

    def group_config(self, g: int) -> Any:
        return self._owner.group_config(g)

    def reset_master_weights(self) -> None:
        self._owner.reset_master_weights()


def check_expert_layout(spec: ModelSpec, ep: int, dp: int, tp: int, mesh: DeviceMesh, dense_ranks: Iterable[int]) -> None:
    """What the runtime runs of expert parallelism (one SpecError otherwise, on every rank, before
    any collective): EP x EDP folded over the dense part's `dp x tp` ranks (expert TP 1), the
    expert mesh holding this rank's DP and TP groups (`dense_ranks`)."""
    edp_size = check_ep(spec, ep, dp, tp)
    shape = dict(zip(mesh.mesh_dim_names, mesh.mesh.shape))
    if shape[EDP] != edp_size:
        raise SpecError(f"the expert mesh is {shape[EDP]} x {ep} (edp x ep), but the dense part's mesh has dp x tp = "
                        f"{dp} x {tp} ranks: the expert mesh folds all of them, edp x ep = dp x tp (edp {edp_size})")
    outside = sorted(set(dense_ranks) - set(mesh.mesh.flatten().tolist()))
    if outside:
        raise SpecError(f"the expert mesh does not hold rank(s) {outside} of this rank's data- and tensor-parallel "
                        "groups: it must fold the same dp x tp ranks as the dense part's mesh")


def check_expert_stack(name: str, p: Tensor, whole: ParamSpec, ep: int) -> None:
    """The mistakes a stack of experts given at expert parallelism `ep` (1: none) is likely to show,
    each one PlanError saying what to change (`whole`: the model's stack in the spec); any other
    shape is `check_local_param`'s to refuse."""
    if ep > 1 and is_dtensor(p):
        raise PlanError(f"expert parameter {name!r} is a DTensor (global shape {tuple(p.shape)}): under expert_mesh "
                        f"each rank gives its EP rank's experts as a plain tensor, the local stack of shape "
                        f"{(whole.shape[0] // ep, *whole.shape[1:])} its experts module runs (DTensor experts, "
                        "torchtitan's layout, are not supported)")
    local = tuple(local_tensor(p).shape)
    if len(local) != len(whole.shape) or local[1:] != whole.shape[1:] or local[0] < 1:
        return
    if ep == 1 and local[0] < whole.shape[0] and whole.shape[0] % local[0] == 0:
        raise PlanError(f"parameter {name!r}: it has shape {local}, {local[0]} of the {whole.shape[0]} experts the "
                        f"model spec has: an EP rank's experts (expert parallelism {whole.shape[0] // local[0]}); "
                        "give expert_mesh (init_device_mesh(device, (dp * tp // ep, ep), mesh_dim_names=('edp', "
                        "'ep'))) with the whole model's spec")
    if ep > 1 and local == whole.shape:
        raise PlanError(f"parameter {name!r}: the model spec says {whole.shape[0]} experts, what this rank holds "
                        "(ModelSpec.from_module read the EP-sharded model); give the whole model's spec, with "
                        f"{whole.shape[0] * ep} experts at ep {ep} (e.g. read before its experts are split)")


def build_expert_part(owner: Any, params: Mapping[str, Tensor], spec: ModelSpec, plan: Plan, policy: StepPolicy,
                      comms: tuple[Comm, Comm], *, reduce_dtype: torch.dtype | None, tp_mode: str,
                      kernel: Any, batched: Any, scalars: Any, update_dtype: torch.dtype,
                      device: torch.device, overlap_step: bool = False, hooks: list | None = None) -> ExpertPart:
    """The experts' part of an optimizer: their buffers and hooks (reduced over EDP, scaled by
    `edp / dp`), their schedule at TP 1 and its executor (`overlap_step`: each matrix its own
    group, in the order its bucket is reduced, computed as it lands). `hooks` gets the gradient
    hooks as soon as they are on (the owner's finalizer removes them, a failure below included)."""
    edp, ep = comms
    # a NaN or Inf expert gradient is the dense part's global check to judge (one verdict for both)
    grads = GradientSync(params, spec, plan, policy, edp, None, reduce_dtype, nonfinite="skip")
    if hooks is not None:
        hooks.extend(grads._hooks)
    grads.source = ExpertReduction(edp, policy, plan, expert_scale(owner.dp, edp.size))
    # the dense part's check says every rank ran backward, and which experts got a gradient: a
    # stack that any rank of the cluster reached steps whole (zeros for experts no rank of their
    # EDP group gave a gradient), one that none reached is skipped, as one process does
    grads.checks_backward = False
    grad_dtype = grads.buckets[0].reduced.dtype
    schedule = tp_schedule(plan, spec, policy, edp.rank, tp_mode, grad_bytes=grad_dtype.itemsize,
                           update_bytes=update_dtype.itemsize, overlap_step=overlap_step)
    applies = [t.name for t in schedule.tasks()]
    state: dict[str, dict] = {n: {} for n in applies}
    steps = {n: 0 for n in applies}
    step = MatrixStep(schedule, None, 0, kernel, state, grad_dtype, update_dtype, device, scalars=scalars,
                      batched=batched, steps=steps)
    return ExpertPart(owner=owner, spec=spec, plan=plan, comm=edp, ep_comm=ep, grads=grads, schedule=schedule,
                      matrix_step=step, matrix_state=state, matrix_steps=steps, applies=applies)
