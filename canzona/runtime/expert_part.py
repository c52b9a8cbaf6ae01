"""Expert parallelism in the runtime (docs/design.md §2.7, §8.9): the experts of one EP rank, planned
and stepped over their expert-data-parallel (EDP) group beside the dense part.

Megatron's layout with expert TP 1 ("MoE parallel folding", `canzona.experts`): the ranks of the
data-parallel group form EP groups of `ep` consecutive ranks; EP rank `j` of each holds experts
`[j E / ep, (j + 1) E / ep)` of every MoE layer, stacked (local `[E / ep, m, n]` parameters under
the model's names); the ranks at position `j` of every EP group are an EDP group. A
`DistributedOptimizer` under EP runs two parts with the same machinery:

- the dense part (everything but the experts: `canzona.experts.dense_part`) on the DP group, as any
  dense model;
- `ExpertPart`: one EP rank's experts (`canzona.experts.expert_part`) planned over EDP with TP 1,
  each expert matrix owned whole by one EDP rank, its gradients reduce-scattered over EDP from the
  experts' own backward hooks, its updates computed by its owner and its parameters all-gathered
  over EDP after the step.

The expert gradients' scale: a local expert's gradient holds the contributions of every token of
its EP group routed to it (the model's dispatch all-to-all carries them back in backward), each
scaled by its own rank's loss, so the gradient of the global mean loss (the mean over the `dp` data-
parallel ranks) is the sum over EDP divided by `dp = edp x ep`: the mean over EDP, divided by `ep`
(`ExpertReduction`; Megatron scales expert gradients the same way).

The step's checks: the expert part's own (which expert parameters got a gradient on any EDP rank,
the EDP ranks' agreement) run over EDP, then the dense part's over DP, which carries this rank's
share of the experts' gradient norm beside its own (every rank of the DP group holds distinct
expert gradient elements after the EDP reduce-scatter, so the DP sum counts each once): one global
norm, one verdict on finiteness and clipping for both parts.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from canzona.errors import SpecError
from canzona.experts import check_ep
from canzona.plan import Plan
from canzona.runtime.buffers import FlatBuffer, Piece
from canzona.runtime.comm import Comm, PendingWork
from canzona.runtime.executor import MatrixStep
from canzona.runtime.gradients import DPReduction, GradientSync
from canzona.runtime.mesh import DP, Mesh
from canzona.spec import STACK_CLOSE, STACK_OPEN, ModelSpec, stacked_matrices
from canzona.step_policies import StepPolicy
from canzona.step_schedule import TPSchedule, tp_schedule

EP, EDP = "ep", "edp"  # the expert mesh's dimension names (torchtitan's and Megatron's)


def expert_groups(mesh: DeviceMesh) -> tuple:
    """The (EDP, EP) process groups of a 2-D device mesh with dimensions named 'edp' and 'ep'
    (`init_device_mesh(device, (dp // ep, ep), mesh_dim_names=("edp", "ep"))`: EP groups of
    consecutive ranks, as Megatron folds them)."""
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2 or set(mesh.mesh_dim_names or ()) != {EDP, EP}:
        raise SpecError("expert_mesh must be a 2-D DeviceMesh with dimensions named 'edp' and 'ep' "
                        "(init_device_mesh(device, (dp // ep, ep), mesh_dim_names=('edp', 'ep')))")
    return mesh.get_group(EDP), mesh.get_group(EP)


class ExpertReduction(DPReduction):
    """The experts' gradient source: the mean over EDP (the routes and gathers of `DPReduction`),
    then divided by `ep`, on this rank's part, as it lands (see the module docstring)."""

    def __init__(self, edp: Comm, policy: StepPolicy, plan: Plan, ep: int) -> None:
        super().__init__(edp, policy, plan)
        self.ep = ep

    def launch(self, buffer: FlatBuffer, cuts: tuple[int, ...], name: str) -> PendingWork:
        pending = super().launch(buffer, cuts, name)
        reduced = pending.then
        segment = buffer.grad[cuts[self.dp.rank]:cuts[self.dp.rank + 1]]

        def scaled() -> None:
            if reduced is not None:
                reduced()
            segment.div_(self.ep)
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


def check_expert_layout(spec: ModelSpec, ep: int, dp: int, tp: int, edp: dist.ProcessGroup) -> None:
    """What the runtime runs of expert parallelism (one SpecError otherwise, before any collective):
    EP over the DP group of a model without TP, the expert mesh's sizes those of the DP group."""
    if tp > 1:
        raise SpecError("expert parallelism with a tensor-parallel dense part is not supported by the runtime yet "
                        "(tp must be 1 where ep > 1)")
    edp_size = check_ep(spec, ep, dp, tp)
    if dist.get_world_size(edp) != edp_size:
        raise SpecError(f"the expert mesh is {dist.get_world_size(edp)} x {ep} (edp x ep), but the data-parallel "
                        f"group has {dp} ranks: edp x ep must be dp")


def build_expert_part(owner: Any, params: Mapping[str, Tensor], spec: ModelSpec, plan: Plan, policy: StepPolicy,
                      comms: tuple[Comm, Comm], *, align: int, reduce_dtype: torch.dtype | None, tp_mode: str,
                      kernel: Any, batched: Any, scalars: Any, update_dtype: torch.dtype,
                      device: torch.device) -> ExpertPart:
    """The experts' part of an optimizer: their buffers and hooks (reduced over EDP, scaled by
    `1 / ep`), their schedule at TP 1 and its executor."""
    edp, ep = comms
    # a NaN or Inf expert gradient is the dense part's global check to judge (one verdict for both)
    grads = GradientSync(params, spec, plan, policy, edp, None, align, reduce_dtype, nonfinite="skip")
    grads.source = ExpertReduction(edp, policy, plan, ep.size)
    grad_dtype = grads.buckets[0].reduced.dtype
    schedule = tp_schedule(plan, spec, policy, edp.rank, tp_mode, grad_bytes=grad_dtype.itemsize,
                           update_bytes=update_dtype.itemsize)
    applies = [t.name for t in schedule.tasks()]
    state: dict[str, dict] = {n: {} for n in applies}
    steps = {n: 0 for n in applies}
    step = MatrixStep(schedule, None, 0, kernel, state, grad_dtype, update_dtype, device, scalars=scalars,
                      batched=batched, steps=steps)
    return ExpertPart(owner=owner, spec=spec, plan=plan, comm=edp, ep_comm=ep, grads=grads, schedule=schedule,
                      matrix_step=step, matrix_state=state, matrix_steps=steps, applies=applies)
