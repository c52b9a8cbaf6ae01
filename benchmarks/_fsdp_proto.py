"""Issue 21's runtime, first slice: the optimizer step of a model sharded by torch's FSDP2
(`fully_shard`) on a 1-D mesh over the shard group, with whole-matrix owners (docs/design.md §2.8).

STATUS (prototype on branch wip-fsdp-runtime; not merged)

Works (tests/runtime/test_fsdp_runtime.py, gloo on CPU, S = 2 and 3, the tiny model fp32 sharded per
decoder layer and at the root, 3 steps; Muon with fp32 Newton-Schulz, SOAP and Shampoo with
preconditioners refreshed every 2 steps, SOAP's first step sending no update back; Muon with
`clip_grad_norm_(0.05)` each step; and a small module at S = 3 whose 2 x 16 matrix and 2-vector
leave rank 2 an EMPTY local shard, with and without clipping):
- every matrix has one owner, the planner's (`plan_for(spec, S, 1, optimizer, "canzona",
  geometry="whole")`, its placements' owners);
- the step check (`check()`, once per step, run by `clip_grad_norm_` or `step`): ONE small
  all-gather (`Comm.all_gather_values`, bounded by `timeout_s`) of, per rank, which parameters got a
  gradient, whether the rank found a local problem (a gradient not sharded as its parameter), the
  clip threshold of the call (none from `step`; ranks must agree: a second clip in the step with a
  new threshold all-gathers it once more, as the ZeRO-1 path does), and its fp64 sum of squares of
  its local gradient shards (spec order; shards are disjoint, so each element counts once; the
  ranks' sums added in rank order). Every rank then raises a CanzonaError for a problem anywhere,
  before any all-to-all: a local problem (the rank that found it names it, the others name that
  rank), clip thresholds that differ (or clipping on some ranks only), no gradient on any rank, or a
  parameter with a gradient on some ranks only (the same message everywhere, naming the parameter
  and the ranks). A parameter with a gradient on no rank takes no step. A non-finite norm raises
  (`nonfinite="raise"`, nothing updated) or skips the step on every rank (`nonfinite="skip"`,
  counted in `skipped_steps`; `clip_grad_norm_` then returns it and scales nothing);
- `clip_grad_norm_(max_norm)`: torch's rule from that global norm (coefficient max_norm / (norm +
  1e-6) when below 1) on the local gradient shards, returns the norm before clipping (fp32 tensor);
  a second call in the step sees the clipped norm (as the ZeRO-1 path's `_clip`);
- per step ONE variable-size all-to-all (`Comm.all_to_all`, bounded by `timeout_s`) carries every
  rank's local gradient rows (`p.grad.to_local()`, torch.chunk's row blocks, possibly empty) of every
  matrix to its owner, no padding; the owner concatenates the blocks in rank order and runs the
  registry's kernel (`matrix_optimizer(opt).part("kernel")`), state only on the owner;
- ONE variable-size all-to-all returns each rank its rows of every update; every rank computes the
  update's scalars itself from the registry's `scalars` part and a step count kept alike on every
  rank (as `executor.MatrixStep` does), and the owner checks its kernel's update against them;
- non-matrix parameters (the spec's `uses_matrix_optimizer` False: norms, the embedding) take
  AdamW (`kernels.adamw_step_`) elementwise on the local shard; the state is the shard's.
Exact: the parameters equal, bit for bit, the same kernels run in one process on the ranks' global
gradients (`p.grad.full_tensor()` recorded each step, fed to `harness.training.emulate`, which
clips with `clip_`; the small module's in the test's `emulate_small`), and are within 1e-5 of the
reference optimizers; the returned norm equals the rank-order fp64 sum recomputed from the recorded
gradients. The skip and raise cases (a NaN in one rank's shard) and the local-problem case (after its
first step) are bit for bit too; the missing-gradient, local-problem and clip-disagreement cases
fail every rank at the check, within seconds; a dead peer (rank 2 of 3 never calls step) is a
CanzonaError ("timed out") on the others within `timeout_s` = 2 s. (FSDP2's own
mean-reduce-scatter is not bit for bit the single-device gradient; that is upstream of this step
and not what is checked. `DTensor.full_tensor()` itself fails over gloo on an empty shard: the test
gathers those with `all_gather_object`.)

Missing (refused where detectable, otherwise simply not there):
- mixed precision (`MixedPrecisionPolicy`, bf16 params with fp32 reduce): fp32 only, refused;
- HSDP (2-D mesh, replicate x shard), FSDP with TP / EP / PP: a 1-D mesh of Shard(0) only, refused;
- stacked expert matrices (`matrix_shape`), elementwise matrix optimizers (AdamW as `optimizer`):
  refused;
- micro-group pipelining (design §2.8: K chunks per owner, the next all-to-all under this one's
  compute): one exchange each way per step, synchronous;
- batched kernels, compiled kernels, the overlap step;
- `clip_grad_norm_(norm_type=inf)`, per-group lr / param groups and schedulers (the
  configs' lr is used), `state_dict` / checkpoints;
- gradient accumulation through `set_requires_gradient_sync(False)`: untested (it should just
  work, the step reads `.grad` after the last backward);
- CUDA: buffers are made on CPU (`torch.empty` without a device), no side streams; CPU / gloo only
  (the check's table travels on `Comm.check_device`, which is CUDA under NCCL, untested);
- agreement checks between ranks on the plan, step counts and configs (the ZeRO-1 path's
  `check_agreement` and hyper-parameter digest).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from canzona.errors import CanzonaError, SpecError
from canzona.optimizers import config_from_dict, matrix_optimizer
from canzona.plan import plan_for
from canzona.runtime.comm import Comm
from canzona.runtime.gradients import (
    NONFINITE_POLICIES,
    _all_same,
    _clip_disagreement,
    _clip_word,
    combine_norm_terms,
    local_norm_term,
    ranks_of,
)
from canzona.runtime.kernels import Update, adamw_step_, apply_update_
from canzona.spec import ModelSpec


def chunk_rows(rows: int, shards: int, rank: int) -> tuple[int, int]:
    """The rows [start, end) of shard `rank` when `torch.chunk` cuts `rows` into `shards`: ceil(rows /
    shards) each, the last ranks fewer or none (FSDP2's `Shard(0)`)."""
    per = math.ceil(rows / shards) if rows else 0
    start = min(rank * per, rows)
    return start, min(start + per, rows)


class FsdpOptimizer:
    """The optimizer step of an FSDP2 model (one shard group, the default group or `group`) with
    whole-matrix owners. `named_params`: the sharded model's `named_parameters()` (DTensors,
    `Shard(0)` on a 1-D mesh); `spec`: the model's canzona `ModelSpec` (global shapes)."""

    def __init__(self, named_params: Iterable[tuple[str, Tensor]], spec: ModelSpec, optimizer: str = "muon",
                 matrix_config: dict[str, Any] | None = None, adamw_config: dict[str, Any] | None = None, *,
                 group: dist.ProcessGroup | None = None, timeout_s: float = 120.0,
                 nonfinite: str = "raise") -> None:
        from torch.distributed.tensor import DTensor, Shard

        if nonfinite not in NONFINITE_POLICIES:
            raise SpecError(f"nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, got {nonfinite!r}")
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise SpecError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")

        entry = matrix_optimizer(optimizer)
        if entry.elementwise:
            raise SpecError(f"FsdpOptimizer runs whole-matrix optimizers; {optimizer!r} is elementwise")
        self.optimizer = optimizer
        self.kernel = entry.part("kernel")
        self.scalars = entry.part("scalars")
        self.matrix_cfg = config_from_dict(optimizer, matrix_config or {})
        self.adamw_cfg = config_from_dict("adamw", adamw_config or {})
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.comm = Comm(group, timeout_s, "fsdp")  # every collective bounded by timeout_s
        self.nonfinite = nonfinite
        self.skipped_steps = 0  # steps skipped for a non-finite gradient norm (nonfinite="skip")
        self.checked: tuple[dict[str, bool], float] | None = None  # this step's check: (got, norm)
        self._clip_agreed: float | None = None  # the clip threshold this step's check agreed on
        self.params: dict[str, Tensor] = dict(named_params)
        self.spec = spec
        for name, p in self.params.items():
            pspec = spec.param(name)
            if not isinstance(p, DTensor) or p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
                raise SpecError(f"{name}: expected a DTensor Shard(0) on a 1-D mesh (fully_shard), got "
                                f"{type(p).__name__} {getattr(p, 'placements', None)}")
            if p.device_mesh.size() != self.size:
                raise SpecError(f"{name}: its mesh has {p.device_mesh.size()} ranks, the group {self.size}")
            if p.dtype != torch.float32:
                raise SpecError(f"{name}: {p.dtype}; the FSDP prototype runs fp32 parameters only")
            if tuple(p.shape) != tuple(pspec.shape):
                raise SpecError(f"{name}: shape {tuple(p.shape)}, the spec says {tuple(pspec.shape)}")
            if pspec.matrix_shape is not None:
                raise SpecError(f"{name}: stacked matrices are not supported under FSDP yet")
            start, end = chunk_rows(p.shape[0], self.size, self.rank)
            if p.to_local().shape[0] != end - start:
                raise SpecError(f"{name}: local shard of {p.to_local().shape[0]} rows, torch.chunk gives "
                                f"{end - start}")
        missing = {p.name for p in spec.params} - set(self.params)
        if missing:
            raise SpecError(f"parameters of the spec not given: {sorted(missing)[:3]}")
        # matrices in the spec's order (every rank the same): the order of the exchanges' blocks
        self.matrices = [p.name for p in spec.params if p.uses_matrix_optimizer]
        self.elementwise = [p.name for p in spec.params if not p.uses_matrix_optimizer]
        self.plan = plan_for(spec, self.size, 1, optimizer, "canzona", geometry="whole")
        owners = self.plan.dp_plan.owners()
        self.owner = {n: owners[n] for n in self.matrices}
        self.state: dict[str, dict[str, Any]] = {}  # matrices owned here (whole), elementwise shards
        self.steps: dict[str, int] = {}  # steps taken per matrix, alike on every rank

    # --- layout -------------------------------------------------------------------------------

    def _rows(self, name: str, rank: int) -> int:
        start, end = chunk_rows(self.params[name].shape[0], self.size, rank)
        return end - start

    def _row_numel(self, name: str) -> int:
        shape = self.params[name].shape
        return math.prod(shape[1:])

    def _by_owner(self) -> list[list[str]]:
        out: list[list[str]] = [[] for _ in range(self.size)]
        for n in self.matrices:
            out[self.owner[n]].append(n)
        return out

    def _local_grad(self, name: str) -> Tensor:
        return self.params[name].grad.to_local()

    def _local_problem(self) -> str | None:
        """What is wrong with this rank's gradients on its own (before any rank compares)."""
        from torch.distributed.tensor import DTensor

        for name, p in self.params.items():
            g = p.grad
            if g is None:
                continue
            if not isinstance(g, DTensor) or tuple(g.placements) != tuple(p.placements):
                return (f"{name}: its gradient on rank {self.rank} is {type(g).__name__} "
                        f"{getattr(g, 'placements', None)}, not sharded as the parameter (Shard(0))")
            local = g.to_local()
            if local.shape != p.to_local().shape or local.dtype != p.dtype:
                return (f"{name}: its local gradient on rank {self.rank} is {local.dtype} {tuple(local.shape)}, "
                        f"the local shard {p.dtype} {tuple(p.to_local().shape)}")
        return None

    def check(self, max_norm: float | None = None) -> tuple[dict[str, bool], float]:
        """The step check, once per step (clip_grad_norm_, then step): ONE small all-gather of, per
        rank, which parameters got a gradient, whether it found a local problem, the clip threshold
        of this call (`max_norm`, None from step: none; ranks must agree), and its sum of
        squares of its local gradient shards (fp64, spec order; the shards are disjoint, so every
        element counts once). Every rank then raises the same CanzonaError for a problem found
        anywhere, and computes the same global norm (the ranks' sums added in rank order). Returns
        (got: name -> a gradient on every rank, norm); a non-finite norm raises under
        nonfinite="raise"."""
        if self.checked is not None:
            if max_norm is not None and max_norm != self._clip_agreed:  # a second clip, a new threshold
                clips = self.comm.all_gather_values(torch.tensor([max_norm], dtype=torch.float64),
                                                    "clip threshold")[:, 0]
                if not _all_same(clips):
                    raise CanzonaError(_clip_disagreement(clips, self.rank, "rank"))
                self._clip_agreed = max_norm
            return self.checked
        names = [p.name for p in self.spec.params]
        problem = self._local_problem()
        got_here = [self.params[n].grad is not None for n in names]
        segments = [] if problem is not None else \
            [self._local_grad(n).reshape(-1) for n, g in zip(names, got_here) if g]
        term = local_norm_term(segments).to(torch.float64)
        header = torch.cat([torch.tensor(got_here + [problem is not None], dtype=torch.int64),
                            term.reshape(1).view(torch.int64),
                            torch.tensor([_clip_word(max_norm)], dtype=torch.float64).view(torch.int64)])
        table = self.comm.all_gather_values(header, "step check")
        flags, broken = table[:, :len(names)], table[:, len(names)]
        terms, clips = table[:, -2].view(torch.float64), table[:, -1].view(torch.float64)
        error = None
        if broken.any():
            error = problem if problem is not None else \
                f"rank(s) {ranks_of(broken != 0)} found a broken step (see their error)"
        elif not _all_same(clips):
            error = _clip_disagreement(clips, self.rank, "rank")
        elif not flags.any():
            error = ("step() found no gradient on any rank: call backward() before step(), on the "
                     "parameters given to the optimizer")
        elif not torch.all(flags == flags[0]):
            k = int(torch.nonzero((flags != flags[0]).any(dim=0))[0])
            error = (f"{names[k]!r} has a gradient on rank(s) {ranks_of(flags[:, k] != 0)} and none on rank(s) "
                     f"{ranks_of(flags[:, k] == 0)}: every rank must run the same backward (FSDP reduces "
                     "every gradient over all ranks)")
        if error is not None:
            raise CanzonaError(error)
        norm = math.sqrt(float(combine_norm_terms(terms)))
        if not math.isfinite(norm) and self.nonfinite == "raise":
            raise CanzonaError(f"the global gradient norm is {norm} (a NaN or Inf gradient): nothing was updated. "
                               "Pass nonfinite='skip' to skip such steps (counted in opt.skipped_steps)")
        self.checked = ({n: bool(flags[0, k]) for k, n in enumerate(names)}, norm)
        self._clip_agreed = max_norm
        return self.checked

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Scale the local gradient shards so that the global gradient norm is at most `max_norm`
        (torch's rule: by max_norm / (norm + 1e-6) when below 1); return the norm before clipping.
        Collective (runs the step check); call it after backward and before step()."""
        if not (isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool) and max_norm > 0):
            raise SpecError(f"max_norm must be a positive number, got {max_norm!r}")
        got, norm = self.check(float(max_norm))
        if math.isfinite(norm):
            coefficient = min(1.0, max_norm / (norm + 1e-6))
            if coefficient < 1.0:
                for n, g in got.items():
                    if g:
                        self._local_grad(n).mul_(coefficient)
                # a second call in this step sees the clipped norm (as the ZeRO-1 path's `_clip`)
                self.checked = (got, norm * coefficient)
        return torch.tensor(norm, dtype=torch.float32)

    # --- the step -----------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.checked = None
        for p in self.params.values():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        try:
            got, norm = self.check()
            if not math.isfinite(norm):  # nonfinite="skip": every rank skips alike
                self.skipped_steps += 1
                return
            self._step(got)
        finally:
            self.checked = None

    def _step(self, got: dict[str, bool]) -> None:
        # matrices without a gradient (on every rank: checked) take no step, send nothing
        by_owner = [[n for n in names if got[n]] for names in self._by_owner()]
        me = self.rank
        mine = by_owner[me]
        # 1. gradients to owners: to rank d, this rank's rows of every matrix d owns, in order
        sends = [self._local_grad(n).reshape(-1) for d in range(self.size) for n in by_owner[d]]
        in_splits = [sum(self._rows(n, me) * self._row_numel(n) for n in by_owner[d]) for d in range(self.size)]
        out_splits = [sum(self._rows(n, s) * self._row_numel(n) for n in mine) for s in range(self.size)]
        sent = torch.cat(sends) if sends else torch.empty(0)
        received = torch.empty(sum(out_splits), dtype=torch.float32)
        self.comm.all_to_all(received, sent, out_splits, in_splits, "fsdp gradients").wait()
        # 2. the owner computes its matrices whole
        blocks = list(received.split(out_splits))
        pos = [0] * self.size
        updates: dict[str, Update | None] = {}
        for n in mine:
            p = self.params[n]
            parts = []
            for s in range(self.size):
                k = self._rows(n, s) * self._row_numel(n)
                parts.append(blocks[s][pos[s]:pos[s] + k])
                pos[s] += k
            grad = torch.cat(parts).view(p.shape)
            state = self.state.setdefault(n, {})
            update = self.kernel(grad, state, self.matrix_cfg, self.matrix_cfg.lr)
            want = self.scalars(tuple(p.shape), self.matrix_cfg, self.matrix_cfg.lr, self.steps.get(n, 0))
            have = None if update is None else update.scalars
            if have != want:
                raise CanzonaError(f"{n}: the kernel's update applies as {have}, the ranks at step "
                                   f"{self.steps.get(n, 0)} would apply it as {want}")
            if update is not None:  # in the dtype it is sent and applied in (kernels.apply_update_)
                update.direction = update.direction.to(p.dtype)
            updates[n] = update
        # 3. update rows back: to rank d, d's rows of every matrix owned here that has an update
        back = []
        for d in range(self.size):
            for n in mine:
                if updates[n] is not None:
                    start, end = chunk_rows(self.params[n].shape[0], self.size, d)
                    back.append(updates[n].direction[start:end].reshape(-1))
        has_update = {n: self.scalars(tuple(self.params[n].shape), self.matrix_cfg, self.matrix_cfg.lr,
                                      self.steps.get(n, 0)) for n in self.matrices if got[n]}
        b_in = [sum(self._rows(n, d) * self._row_numel(n) for n in mine if has_update[n] is not None)
                for d in range(self.size)]
        b_out = [sum(self._rows(n, me) * self._row_numel(n) for n in by_owner[s] if has_update[n] is not None)
                 for s in range(self.size)]
        back_sent = torch.cat(back) if back else torch.empty(0)
        chunks = torch.empty(sum(b_out), dtype=torch.float32)
        self.comm.all_to_all(chunks, back_sent, b_out, b_in, "fsdp updates").wait()
        # 4. every rank applies its rows, with the scalars it computes itself
        pos_all = 0
        for s in range(self.size):
            for n in by_owner[s]:
                scalars = has_update[n]
                if scalars is None:
                    continue
                local = self.params[n].to_local()
                k = local.numel()
                chunk = chunks[pos_all:pos_all + k].view(local.shape)
                pos_all += k
                apply_update_(local, chunk, Update.of(chunk, scalars))
        for n in self.matrices:
            if got[n]:
                self.steps[n] = self.steps.get(n, 0) + 1
        # 5. AdamW on the local shards of the other parameters (an empty shard: nothing to do)
        for n in self.elementwise:
            if not got[n]:
                continue
            local = self.params[n].to_local()
            grad = self._local_grad(n)
            adamw_step_(local.view(-1), grad.reshape(-1), self.state.setdefault(n, {}), self.adamw_cfg,
                        self.adamw_cfg.lr)
