"""`DistributedOptimizer`: executes the DP part of a `Plan` on a real process group (TP = 1).

Layout: per plan bucket, a flat gradient buffer and a flat parameter buffer laid out by the plan;
every parameter's `.data` and `.grad` are views into them. AdamW parameters share one flat buffer
sliced evenly (ZeRO-1). During backward, each bucket's reduce-scatter starts as soon as its last
gradient is accumulated (post-accumulate-grad hooks), in bucket order on every rank; `step()`
finishes the gradient sync, runs the matrix kernels on the matrices this rank computes and AdamW
on its slice, then all-gathers the updated parameters.

Policies (docs/design.md §7): `canzona` (reduce-scatter-v on the plan's segments, owners compute),
`zero1-gather` (even segments; every rank whose segment touches a matrix gathers and computes it),
`layerwise` (all-reduce; LPT owners compute; owners' parameters are gathered), `sc` (all-reduce;
every rank computes everything).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from canzona.cost import CostModel
from canzona.dp.layout import BucketPlan, ceil_to, even_cuts
from canzona.dp.policies import DEFAULT_ALIGN
from canzona.errors import CanzonaError, PlanError, SpecError
from canzona.fileio import is_finite_number
from canzona.optimizers import (
    AdamWConfig,
    check_config,
    check_matrix_optimizer,
    config_from_dict,
    default_config,
)
from canzona.plan import Plan, check_plan_matches, load_plan, make_plan
from canzona.runtime import checkpoint
from canzona.runtime.buffers import FlatBuffer, packed_offsets
from canzona.runtime.comm import Comm, PendingWork
from canzona.runtime.groups import (
    GroupConfigs,
    build_param_groups,
    hyper_parameters_digest,
    user_groups,
)
from canzona.runtime.kernels import MATRIX_KERNELS, adamw_step_, apply_update_
from canzona.spec import ModelSpec
from canzona.step_policies import StepPolicy, get_step_policy


def _config(name: str, given: Any) -> Any:
    if given is None:
        return default_config(name)
    if isinstance(given, Mapping):
        return config_from_dict(name, dict(given))
    return check_config(name, given)


class DistributedOptimizer(torch.optim.Optimizer):
    """A matrix optimizer (muon | soap | shampoo) plus AdamW, data-parallel over `group`.

    `params`: `(name, parameter)` pairs (e.g. `model.named_parameters()`), or torch-style groups of
    them with hyper-parameter overrides (`canzona.runtime.groups`). `matrix_config` and
    `adamw_config` are the defaults of every group.

    Low-precision (bf16 / fp16) parameters get fp32 master weights, fp32 gradient reduction and
    fp32 optimizer state by default; the bf16 working copy is refreshed after each step.
    `master_weights=False` keeps everything in the parameters' dtype.

    Collective calls, which every rank must make together: construction, `step()`,
    `clip_grad_norm_()` and `state_dict()`. Each waits at most `timeout_s`.
    """

    def __init__(
        self,
        params: Iterable[tuple[str, Tensor]] | Iterable[Mapping[str, Any]],
        spec: ModelSpec,
        optimizer: str = "muon",
        matrix_config: Any = None,
        adamw_config: AdamWConfig | Mapping | None = None,
        plan: Plan | str | Path | None = None,
        policy: str = "canzona",
        dp_policy: str = "alpha-balanced",
        alpha: float = 1.0,
        bucket_size: int | None = None,
        group: dist.ProcessGroup | DeviceMesh | None = None,
        timeout_s: float = 120.0,
        align: int = DEFAULT_ALIGN,
        cost_model: CostModel | None = None,
        master_weights: bool = True,
    ) -> None:
        # everything that can be wrong locally fails here, on every rank, before any collective
        if not (is_finite_number(timeout_s) and timeout_s > 0):
            raise SpecError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.optimizer = check_matrix_optimizer(optimizer)
        self.policy: StepPolicy = get_step_policy(policy)
        self.matrix_cfg = _config(self.optimizer, matrix_config)
        self.adamw_cfg = _config("adamw", adamw_config)
        self.spec = spec
        groups = user_groups(params)
        self.params: dict[str, Tensor] = {}
        for pairs, _ in groups:
            for name, p in pairs:
                if name in self.params:
                    raise SpecError(f"parameter {name!r} is given twice")
                if tuple(p.shape) != spec.param(name).shape:
                    raise PlanError(f"parameter {name!r} has shape {tuple(p.shape)}, the model spec says "
                                    f"{spec.param(name).shape}")
                self.params[name] = p
        missing = [p.name for p in spec.params if p.name not in self.params]
        if missing:
            raise PlanError(f"the model spec has parameters that were not given, e.g. {missing[0]}")
        matrix_names = [p.name for p in spec.matrix_params()]
        adamw_names = [p.name for p in spec.adamw_params()]
        param_groups = build_param_groups(groups, set(matrix_names), self.optimizer, self.matrix_cfg,
                                          self.adamw_cfg)

        self.comm = Comm(_dp_group(group), timeout_s)
        self.dp, self.rank = self.comm.size, self.comm.rank
        self.plan = self._resolve_plan(plan, dp_policy, alpha, bucket_size, align, cost_model)
        self.comm.check_agreement({
            "model fingerprint": spec.fingerprint(),
            # the fingerprint ignores order, but buffers are laid out in spec order
            "parameter order": ",".join(p.name for p in spec.params),
            "optimizer configuration": repr((self.optimizer, asdict(self.matrix_cfg), asdict(self.adamw_cfg))),
            "plan": self.plan.hash(),
            "policy": self.policy.name,
            "parameter groups": str(hyper_parameters_digest(param_groups)),
            "initial parameters": _parameters_checksum(self.params.values()),
        })

        super().__init__(param_groups, {})
        self._configs = GroupConfigs({"matrix": self.matrix_cfg, "adamw": self.adamw_cfg})
        group_of = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        self._group_of = {n: group_of[id(p)] for n, p in self.params.items()}

        # bf16 / fp16 models: fp32 master weights, gradients reduced in fp32 and fp32 optimizer
        # state (as Megatron's distributed optimizer); master_weights=False keeps all of it in the
        # parameters' dtype
        low = {p.dtype for p in self.params.values()} & {torch.bfloat16, torch.float16}
        self.master_weights = bool(master_weights and low)
        reduce_dtype = torch.float32 if self.master_weights else None
        self.buckets = [FlatBuffer([p.name for p in b.params], {p.name: (p.offset, p.end) for p in b.params},
                                   b.size, self.params, reduce_dtype) for b in self.plan.dp_plan.buckets]
        offsets, used = packed_offsets(adamw_names, self.params)
        self.adamw = FlatBuffer(adamw_names, offsets, ceil_to(max(used, 1), align * self.dp), self.params,
                                reduce_dtype)
        self.adamw_cuts = even_cuts(self.adamw.size, self.dp)
        self._buffer_of = {n: buf for buf in (*self.buckets, self.adamw) for n in buf.names}
        self._index = {n: i for i, n in enumerate(self.params)}
        self._bucket_of = {n: k for k, b in enumerate(self.buckets) for n in b.names}
        self._computes = self._matrices_computed_here()
        self.matrix_state: dict[str, dict] = {n: {} for n in self._computes}
        self.adamw_state: dict[str, dict] = {}
        self.master: dict[str, Tensor] = {}  # fp32 copies of what this rank updates, by name
        if self.master_weights:
            self.reset_master_weights()
        self._sync = True
        self._reset_step_tracking()
        for name, p in self.params.items():
            p.register_post_accumulate_grad_hook(self._hook(name))

    # --- construction helpers ----------------------------------------------------------------

    def _resolve_plan(self, plan: Plan | str | Path | None, dp_policy: str, alpha: float,
                      bucket_size: int | None, align: int, cost_model: CostModel | None) -> Plan:
        if plan is None:
            plan = make_plan(self.spec, self.dp, 1, self.optimizer, self.policy.dp_policy or dp_policy,
                             self.policy.tp_policy or "greedy-rollback", alpha, bucket_size, align,
                             cost_model=cost_model)
        elif not isinstance(plan, Plan):
            plan = load_plan(plan)
        check_plan_matches(plan, self.spec, dp=self.dp, tp=1)
        if plan.optimizer != self.optimizer:
            raise PlanError(f"plan is for {plan.optimizer}, but the optimizer is {self.optimizer}")
        try:
            self.policy.check_dp_plan(plan.dp_plan)
        except SpecError as e:
            raise PlanError(str(e)) from None
        return plan

    def _matrices_computed_here(self) -> list[str]:
        dpp = self.plan.dp_plan
        if self.policy.replicated:
            return [n for b in self.buckets for n in b.names]
        return [p.name for b in dpp.buckets for p in b.params if self.rank in dpp.computing_ranks(b, p)]

    def _reset_step_tracking(self) -> None:
        self._ready = [0] * len(self.buckets)
        self._launched: list[PendingWork | None] = [None] * len(self.buckets)
        self._next = 0
        self._got_grad = torch.zeros(len(self.params), dtype=torch.int64)
        self._grads_ready = False  # gradients reduced and checked (by clip_grad_norm_ or step)

    # --- gradient synchronisation ------------------------------------------------------------

    def _hook(self, name: str):
        buffer = self._buffer_of[name]

        def on_grad_ready(_: Tensor) -> None:
            if not buffer.is_linked(name):
                raise CanzonaError(_unlinked_message(name))
            buffer.claim(name)  # after model.zero_grad(): the fresh gradient goes into the buffer
            self._got_grad[self._index[name]] = 1
            k = self._bucket_of.get(name)
            if k is None or not self._sync:
                return  # accumulation micro-batch: nothing is synchronised yet
            if self._launched[k] is not None:
                raise CanzonaError("gradients were synchronised twice in one step: wrap the backward of "
                                   "accumulation micro-batches in `with optimizer.no_sync():`")
            self._ready[k] += 1
            self._launch_ready_buckets()
        return on_grad_ready

    def _launch_ready_buckets(self) -> None:
        """Launch in bucket order only, so every rank issues the same collectives in the same order."""
        while self._next < len(self.buckets) and self._ready[self._next] >= len(self.buckets[self._next].names):
            self._launch(self._next)
            self._next += 1

    def _grad_cuts(self, k: int) -> tuple[int, ...]:
        b = self.plan.dp_plan.buckets[k]
        return b.cuts if self.policy.grad_sync == "reduce-scatter" else even_cuts(b.size, self.dp)

    def _launch(self, k: int) -> None:
        if self._launched[k] is not None:
            raise CanzonaError("gradients were synchronised twice in one step: wrap the backward of "
                               "accumulation micro-batches in `with optimizer.no_sync():`")
        b = self.buckets[k]
        # stage() claims first: a gradient dropped by set_to_none and not recomputed counts as zero
        self._launched[k] = self.comm.reduce_scatter_v(b.stage(), self._grad_cuts(k),
                                                       f"bucket {self.plan.dp_plan.buckets[k].index}")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (micro-batches); the backward after it synchronises once."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _finish_grad_sync(self) -> None:
        while self._next < len(self.buckets):  # buckets whose gradients did not all arrive
            self._launch(self._next)
            self._next += 1
        adamw = self.comm.reduce_scatter_v(self.adamw.stage(), self.adamw_cuts, "adamw")
        for pending in self._launched:
            pending.wait()
        adamw.wait()
        if self.policy.grad_sync == "all-reduce" or self.policy.gather_split:
            gathers = [self.comm.all_gather_v(b.reduced, self._grad_cuts(k),
                                              f"gradients of bucket {self.plan.dp_plan.buckets[k].index}")
                       for k, b in enumerate(self.buckets)]
            for g in gathers:
                g.wait()
        if self.policy.replicated:
            self.comm.all_gather_v(self.adamw.reduced, self.adamw_cuts, "adamw gradients").wait()

    def _prepare_step(self) -> Tensor:
        """Reduce the gradients and check, on every rank alike, that the step is sound; return
        which parameters got a gradient on any rank. Once per step (clip_grad_norm_, then step)."""
        if self._grads_ready:
            return self._got_anywhere
        self._finish_grad_sync()
        unlinked = next((n for buf in (*self.buckets, self.adamw) for n in buf.unlinked()), None)
        header = torch.cat([self._got_grad, torch.tensor(
            [int(self._got_grad.sum()), int(unlinked is not None), hyper_parameters_digest(self.param_groups)],
            dtype=torch.int64)])
        table = self.comm.all_gather_values(header, "step check")
        flags, fired, broken, digests = table[:, :-3], table[:, -3], table[:, -2], table[:, -1]
        if broken.any():
            raise CanzonaError(_unlinked_message(unlinked) if unlinked is not None else
                               f"rank(s) {_ranks(broken != 0)}: {_unlinked_message(None)}")
        if not torch.all(digests == digests[0]):
            raise CanzonaError(f"ranks disagree on the hyper-parameters in param_groups: rank(s) "
                               f"{_ranks(digests != digests[self.rank])} differ from rank {self.rank}")
        if not fired.any():
            raise CanzonaError("step() found no gradient on any rank: call backward() before step(), on "
                               "the parameters given to the optimizer")
        if not fired.all():
            raise CanzonaError(f"rank(s) {_ranks(fired == 0)} ran no backward in this step while others "
                               "did: their zero gradients would be averaged in")
        self._got_anywhere = flags.amax(dim=0)
        self._grads_ready = True
        return self._got_anywhere

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the *reduced* gradients to a global norm of at most `max_norm`; return the norm
        before clipping (for logging). Collective: call it on every rank, after backward and before
        `step()`. Every gradient element counts once across DP ranks, as in a single-device run.

        `torch.nn.utils.clip_grad_norm_` on the model is wrong here: it sees each rank's local,
        unreduced gradients, so ranks would clip by different factors."""
        if not (is_finite_number(max_norm) and max_norm > 0):
            raise SpecError(f"max_norm must be a positive number, got {max_norm!r}")
        if norm_type not in (2.0, math.inf):
            raise SpecError(f"norm_type must be 2.0 or inf, got {norm_type!r}")
        self._prepare_step()
        segments = [b.reduced[c[self.rank]:c[self.rank + 1]] for k, b in enumerate(self.buckets)
                    for c in (self._grad_cuts(k),)]
        segments.append(self.adamw.reduced[self.adamw_cuts[self.rank]:self.adamw_cuts[self.rank + 1]])
        local = local_norm_term(segments, norm_type)
        every = self.comm.all_gather_values(local.reshape(1).cpu(), "gradient norm")[:, 0]
        total = global_norm(every, norm_type)
        coefficient = min(1.0, max_norm / (float(total) + 1e-6))
        if coefficient < 1.0:
            for buf in (*self.buckets, self.adamw):
                buf.reduced.mul_(coefficient)
        return total.to(torch.float32)

    # --- the step ----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D401 - torch.optim signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        got = self._prepare_step()
        kernel = MATRIX_KERNELS[self.optimizer]
        for name in self._computes:
            if not got[self._index[name]]:
                continue  # as torch optimizers do: no gradient, no update, no decay
            g = self._group_of[name]
            group = self.param_groups[g]
            grad = self._buffer_of[name].reduced_view(name)
            update = kernel(grad, self.matrix_state[name], self._configs.config(g, group), group["lr"])
            if update is not None:
                target = self._master_for(name, self.params[name])
                apply_update_(target, update.direction, update)
                if target is not self.params[name]:
                    self.params[name].copy_(target)  # the working copy the next forward uses
        self._adamw_step(got)
        self._gather_params()
        self.comm.log.step += 1
        self._reset_step_tracking()
        return loss

    @torch.no_grad()
    def reset_master_weights(self) -> None:
        """fp32 master copies of the matrices this rank updates and of its AdamW slice, taken from
        the parameters as they are now (after loading weights into a bf16 model, say)."""
        self.master = {n: self.params[n].detach().float().clone() for n in self._computes}
        for name, s, e, _ in self._adamw_parts():
            self.master[name] = self.adamw.data[s:e].float().clone()

    def _master_for(self, name: str, working: Tensor) -> Tensor:
        """The tensor an update goes to: the fp32 master, or the parameter itself. Weights written
        into the model since the last step (model.load_state_dict, a hand edit) win over a master
        that no longer matches them."""
        master = self.master.get(name)
        if master is None:
            return working
        if not torch.equal(master.to(working.dtype), working):
            master.copy_(working)
        return master

    def _adamw_parts(self) -> Iterator[tuple[str, int, int, int]]:
        """(name, start, end within the flat buffer, offset within the parameter) of this rank's slice."""
        lo, hi = (0, self.adamw.size) if self.policy.replicated else (self.adamw_cuts[self.rank], self.adamw_cuts[self.rank + 1])
        for name in self.adamw.names:
            a, b = self.adamw.offsets[name]
            s, e = max(a, lo), min(b, hi)
            if s < e:
                yield name, s, e, s - a

    def _adamw_step(self, got: Tensor) -> None:
        for name, s, e, _ in self._adamw_parts():
            if got[self._index[name]]:
                g = self._group_of[name]
                group = self.param_groups[g]
                state = self.adamw_state.setdefault(name, {})
                target = self._master_for(name, self.adamw.data[s:e])
                adamw_step_(target, self.adamw.reduced[s:e], state, self._configs.config(g, group), group["lr"])
                if self.master_weights:
                    self.adamw.data[s:e].copy_(target)

    def _gather_params(self) -> None:
        pending: list[PendingWork] = []
        if self.policy.gather_params:
            for k, b in enumerate(self.buckets):
                bp = self.plan.dp_plan.buckets[k]
                if self.plan.dp_plan.policy == "layerwise":
                    pending.append(self._gather_owned(b, bp))
                else:
                    pending.append(self.comm.all_gather_v(b.data, bp.cuts, f"parameters of bucket {bp.index}"))
            pending.append(self.comm.all_gather_v(self.adamw.data, self.adamw_cuts, "adamw parameters"))
        for w in pending:
            w.wait()

    def _gather_owned(self, b: FlatBuffer, bp: BucketPlan) -> PendingWork:
        """Layerwise: owners' matrices are scattered over the bucket, so each rank packs what it owns
        and an all-gather-v of the packs rebuilds the bucket."""
        owned = [[p for p in bp.params if p.owner == r] for r in range(self.dp)]
        sizes = [sum(p.numel for p in ps) for ps in owned]
        cuts = [0]
        for n in sizes:
            cuts.append(cuts[-1] + n)
        packed = torch.empty(cuts[-1], dtype=b.data.dtype, device=b.data.device)
        pos = cuts[self.rank]
        for p in owned[self.rank]:
            packed[pos:pos + p.numel].copy_(b.data[p.offset:p.end])
            pos += p.numel
        pending = self.comm.all_gather_v(packed, cuts, f"owned parameters of bucket {bp.index}")
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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffers; the `.grad` views stay attached (`set_to_none` is
        accepted for compatibility: a view cannot be None). `model.zero_grad()` works too."""
        for buf in (*self.buckets, self.adamw):
            buf.zero_grads()
        self._reset_step_tracking()

    # --- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Layout-independent: per parameter name, full tensors, identical on every rank.
        Collective (every rank must call it), bounded by `timeout_s`."""
        return checkpoint.gather_state(self)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a `state_dict()` taken at any DP size; checks it belongs to this model and optimizer."""
        checkpoint.load_state(self, state_dict)

    def sharded_state_dict(self, prefix: str = checkpoint.DCP_PREFIX) -> dict[str, Any]:
        """This rank's share of the state for `torch.distributed.checkpoint.save` (each rank writes
        only what it owns); merge it with the model's state dict to save both in one call."""
        return checkpoint.sharded_state(self, prefix)

    def load_sharded_state_dict(self, checkpoint_id: Any, prefix: str = checkpoint.DCP_PREFIX) -> None:
        """Load from a `torch.distributed.checkpoint` saved at any DP size (a path or a storage
        reader): each rank reads only what its layout needs. Collective."""
        checkpoint.load_sharded(self, checkpoint_id, prefix)


def local_norm_term(segments: Iterable[Tensor], norm_type: float = 2.0) -> Tensor:
    """One rank's share of the global gradient norm, in fp64: the sum of squares of its segments
    (in order), or their largest magnitude for the inf-norm."""
    segments = [s.double() for s in segments if s.numel()]
    if norm_type == 2.0:
        return sum((s.square().sum() for s in segments), torch.zeros((), dtype=torch.float64))
    return max((s.abs().max() for s in segments), default=torch.zeros((), dtype=torch.float64))


def global_norm(terms: Tensor, norm_type: float = 2.0) -> Tensor:
    """The norm from every rank's term, combined in rank order (reproducible in one process)."""
    return terms.sum().sqrt() if norm_type == 2.0 else terms.max()


def _unlinked_message(name: str | None) -> str:
    which = f"parameter {name!r} no longer lives" if name else "parameters no longer live"
    return (f"{which} in the optimizer's buffers: the model was moved, cast or had parameters replaced "
            "after the optimizer was built (model.to(...), load_state_dict(assign=True), ...); build the "
            "optimizer after those, and load weights with load_state_dict() without assign")


def _ranks(mask: Tensor) -> list[int]:
    return [int(r) for r in torch.nonzero(mask).flatten()]


@torch.no_grad()
def _parameters_checksum(params: Iterable[Tensor]) -> str:
    """Cheap and position-aware: per parameter, its sum and its row sums weighted by row index,
    reduced on the parameter's device (no copy of the weights to the host)."""
    parts = []
    for p in params:
        rows = p.detach().reshape(p.shape[0], -1) if p.dim() > 1 else p.detach().reshape(1, -1)
        sums = rows.sum(dim=1, dtype=torch.float64)
        weights = torch.arange(1, sums.numel() + 1, dtype=torch.float64, device=sums.device)
        parts.append(torch.stack([sums.sum(), (sums * weights).sum()]))
    blob = torch.cat(parts).cpu().numpy().tobytes() if parts else b""
    return hashlib.sha256(blob).hexdigest()


def _dp_group(group: dist.ProcessGroup | DeviceMesh | None) -> dist.ProcessGroup | None:
    """A process group, or the data-parallel group of a device mesh (1-D, or named "dp")."""
    if not isinstance(group, DeviceMesh):
        return group
    if group.ndim == 1:
        return group.get_group()
    if "dp" in (group.mesh_dim_names or ()):
        return group.get_group("dp")
    raise SpecError(f"a {group.ndim}-D device mesh needs a dimension named 'dp' (has {group.mesh_dim_names})")
