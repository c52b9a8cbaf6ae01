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
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from canzona.dp.layout import BucketPlan, ceil_to, even_cuts
from canzona.dp.policies import DEFAULT_ALIGN
from canzona.errors import CanzonaError, PlanError, SpecError
from canzona.optimizers import AdamWConfig, check_matrix_optimizer, config_from_dict, default_config
from canzona.plan import Plan, check_plan_matches, load_plan, make_plan
from canzona.runtime.comm import Comm, PendingWork
from canzona.runtime.kernels import MATRIX_KERNELS, adamw_step_, apply_update_
from canzona.spec import ModelSpec
from canzona.step_policies import StepPolicy, get_step_policy

STATE_FORMAT = "canzona.optimizer_state"
STATE_VERSION = 1


def _config(name: str, given: Any) -> Any:
    if given is None:
        return default_config(name)
    if isinstance(given, Mapping):
        return config_from_dict(name, dict(given))
    if type(given) is not type(default_config(name)):
        raise SpecError(f"{name} config must be a {type(default_config(name)).__name__} or a dict")
    return given


class _Bucket:
    """Flat gradient and parameter buffers of one plan bucket, and the views into them."""

    def __init__(self, plan: BucketPlan, params: dict[str, Tensor]):
        self.plan = plan
        first = params[plan.params[0].name]
        self.grad = torch.zeros(plan.size, dtype=first.dtype, device=first.device)
        self.data = torch.zeros(plan.size, dtype=first.dtype, device=first.device)
        self.names = [p.name for p in plan.params]
        for p in plan.params:
            t = params[p.name]
            if t.dtype != first.dtype:
                raise SpecError(f"parameters of one bucket must share a dtype ({p.name} is {t.dtype})")
            self.data[p.offset:p.end].copy_(t.detach().reshape(-1))
            t.data = self.data[p.offset:p.end].view(t.shape)
            t.grad = self.grad[p.offset:p.end].view(t.shape)


class _FlatAdamW:
    """AdamW parameters in one flat buffer, sliced evenly over DP ranks (elementwise updates)."""

    def __init__(self, names: list[str], params: dict[str, Tensor], dp: int, align: int):
        self.names = names
        self.offsets: dict[str, tuple[int, int]] = {}
        pos = 0
        for n in names:
            self.offsets[n] = (pos, pos + params[n].numel())
            pos += params[n].numel()
        self.size = ceil_to(max(pos, 1), align * dp)
        self.cuts = even_cuts(self.size, dp)
        ref = params[names[0]] if names else torch.zeros(0)
        self.grad = torch.zeros(self.size, dtype=ref.dtype, device=ref.device)
        self.data = torch.zeros(self.size, dtype=ref.dtype, device=ref.device)
        for n in names:
            a, b = self.offsets[n]
            t = params[n]
            self.data[a:b].copy_(t.detach().reshape(-1))
            t.data = self.data[a:b].view(t.shape)
            t.grad = self.grad[a:b].view(t.shape)


class DistributedOptimizer(torch.optim.Optimizer):
    """A matrix optimizer (muon | soap | shampoo) plus AdamW, data-parallel over `group`."""

    def __init__(
        self,
        named_params: Iterable[tuple[str, Tensor]],
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
    ) -> None:
        self.optimizer = check_matrix_optimizer(optimizer)
        self.policy: StepPolicy = get_step_policy(policy)
        self.matrix_cfg = _config(self.optimizer, matrix_config)
        self.adamw_cfg = _config("adamw", adamw_config)
        self.spec = spec
        self.params: dict[str, Tensor] = {}
        for name, p in named_params:
            if name in self.params:
                raise SpecError(f"parameter {name!r} is given twice")
            if tuple(p.shape) != spec.param(name).shape:
                raise PlanError(f"parameter {name!r} has shape {tuple(p.shape)}, the model spec says "
                                f"{spec.param(name).shape}")
            self.params[name] = p
        missing = [p.name for p in spec.params if p.name not in self.params]
        if missing:
            raise PlanError(f"the model spec has parameters that were not given, e.g. {missing[0]}")

        self.comm = Comm(_dp_group(group), timeout_s)
        self.dp, self.rank = self.comm.size, self.comm.rank
        self.plan = self._resolve_plan(plan, dp_policy, alpha, bucket_size, align)
        self.comm.check_agreement({
            "plan": self.plan.hash(),
            "model fingerprint": spec.fingerprint(),
            "policy": self.policy.name,
            "optimizer configuration": repr((self.optimizer, asdict(self.matrix_cfg), asdict(self.adamw_cfg))),
        })

        matrix_names = [p.name for p in spec.matrix_params()]
        adamw_names = [p.name for p in spec.adamw_params()]
        super().__init__([
            {"params": [self.params[n] for n in matrix_names], "lr": self.matrix_cfg.lr, "name": "matrix"},
            {"params": [self.params[n] for n in adamw_names], "lr": self.adamw_cfg.lr, "name": "adamw"},
        ], {})

        self.buckets = [_Bucket(b, self.params) for b in self.plan.dp_plan.buckets]
        self.adamw = _FlatAdamW(adamw_names, self.params, self.dp, align)
        self._index = {n: i for i, n in enumerate(self.params)}
        self._bucket_of = {n: k for k, b in enumerate(self.buckets) for n in b.names}
        self._computes = self._matrices_computed_here()
        self.matrix_state: dict[str, dict] = {n: {} for n in self._computes}
        self.adamw_state: dict[str, dict] = {}
        self._sync = True
        self._reset_step_tracking()
        for name, p in self.params.items():
            p.register_post_accumulate_grad_hook(self._hook(name))

    # --- construction helpers ----------------------------------------------------------------

    def _resolve_plan(self, plan: Plan | str | Path | None, dp_policy: str, alpha: float,
                      bucket_size: int | None, align: int) -> Plan:
        if plan is None:
            plan = make_plan(self.spec, self.dp, 1, self.optimizer, self.policy.dp_policy or dp_policy,
                             self.policy.tp_policy or "greedy-rollback", alpha, bucket_size, align)
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
        self._got_grad = torch.zeros(len(self.params), dtype=torch.uint8)

    # --- gradient synchronisation ------------------------------------------------------------

    def _hook(self, name: str):
        def on_grad_ready(_: Tensor) -> None:
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

    def _grad_cuts(self, b: _Bucket) -> tuple[int, ...]:
        return b.plan.cuts if self.policy.grad_sync == "reduce-scatter" else even_cuts(b.plan.size, self.dp)

    def _launch(self, k: int) -> None:
        if self._launched[k] is not None:
            raise CanzonaError("gradients were synchronised twice in one step: wrap the backward of "
                               "accumulation micro-batches in `with optimizer.no_sync():`")
        b = self.buckets[k]
        self._launched[k] = self.comm.reduce_scatter_v(b.grad, self._grad_cuts(b), f"bucket {b.plan.index}")

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
        adamw = self.comm.reduce_scatter_v(self.adamw.grad, self.adamw.cuts, "adamw")
        for pending in self._launched:
            pending.wait()
        adamw.wait()
        if self.policy.grad_sync == "all-reduce" or self.policy.gather_split:
            gathers = [self.comm.all_gather_v(b.grad, self._grad_cuts(b), f"gradients of bucket {b.plan.index}")
                       for b in self.buckets]
            for g in gathers:
                g.wait()
        if self.policy.replicated:
            self.comm.all_gather_v(self.adamw.grad, self.adamw.cuts, "adamw gradients").wait()

    # --- the step ----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D401 - torch.optim signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._finish_grad_sync()
        got = self.comm.any_flags(self._got_grad, "parameters with gradients")
        matrix_lr, adamw_lr = self.param_groups[0]["lr"], self.param_groups[1]["lr"]
        kernel = MATRIX_KERNELS[self.optimizer]
        for name in self._computes:
            if not got[self._index[name]]:
                continue  # as torch optimizers do: no gradient, no update, no decay
            p = self.params[name]
            update = kernel(p.grad, self.matrix_state[name], self.matrix_cfg, matrix_lr)
            if update is not None:
                apply_update_(p, update.direction, update)
        self._adamw_step(got, adamw_lr)
        self._gather_params()
        self.comm.log.step += 1
        self._reset_step_tracking()
        return loss

    def _adamw_parts(self) -> Iterator[tuple[str, int, int, int]]:
        """(name, start, end within the flat buffer, offset within the parameter) of this rank's slice."""
        lo, hi = (0, self.adamw.size) if self.policy.replicated else (self.adamw.cuts[self.rank], self.adamw.cuts[self.rank + 1])
        for name in self.adamw.names:
            a, b = self.adamw.offsets[name]
            s, e = max(a, lo), min(b, hi)
            if s < e:
                yield name, s, e, s - a

    def _adamw_step(self, got: Tensor, lr: float) -> None:
        for name, s, e, _ in self._adamw_parts():
            if got[self._index[name]]:
                state = self.adamw_state.setdefault(name, {})
                adamw_step_(self.adamw.data[s:e], self.adamw.grad[s:e], state, self.adamw_cfg, lr)

    def _gather_params(self) -> None:
        pending: list[PendingWork] = []
        if self.policy.gather_params:
            for b in self.buckets:
                if self.plan.dp_plan.policy == "layerwise":
                    pending.append(self._gather_owned(b))
                else:
                    pending.append(self.comm.all_gather_v(b.data, b.plan.cuts, f"parameters of bucket {b.plan.index}"))
            pending.append(self.comm.all_gather_v(self.adamw.data, self.adamw.cuts, "adamw parameters"))
        for w in pending:
            w.wait()

    def _gather_owned(self, b: _Bucket) -> PendingWork:
        """Layerwise: owners' matrices are scattered over the bucket, so each rank packs what it owns
        and an all-gather-v of the packs rebuilds the bucket."""
        owned = [[p for p in b.plan.params if p.owner == r] for r in range(self.dp)]
        sizes = [sum(p.numel for p in ps) for ps in owned]
        cuts = [0]
        for n in sizes:
            cuts.append(cuts[-1] + n)
        packed = torch.empty(cuts[-1], dtype=b.data.dtype, device=b.data.device)
        pos = cuts[self.rank]
        for p in owned[self.rank]:
            packed[pos:pos + p.numel].copy_(b.data[p.offset:p.end])
            pos += p.numel
        pending = self.comm.all_gather_v(packed, cuts, f"owned parameters of bucket {b.plan.index}")
        gather_then = pending.then

        def unpack() -> None:
            gather_then()
            for r, ps in enumerate(owned):
                q = cuts[r]
                for p in ps:
                    b.data[p.offset:p.end].copy_(packed[q:q + p.numel])
                    q += p.numel
        pending.then = unpack
        return pending

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffers (the `.grad` views stay attached)."""
        for b in self.buckets:
            b.grad.zero_()
        self.adamw.grad.zero_()
        self._reset_step_tracking()

    # --- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Layout-independent: per parameter name, full tensors, identical on every rank."""
        local_matrix = {n: _to_cpu(s) for n, s in self.matrix_state.items() if s and self._first_computer(n)}
        local_adamw = {n: (off, _to_cpu(self.adamw_state[n])) for n, _, _, off in self._adamw_parts()
                       if n in self.adamw_state and (not self.policy.replicated or self.rank == 0)}
        every: list[Any] = [None] * self.dp
        dist.all_gather_object(every, (local_matrix, local_adamw), group=self.comm.group)
        state: dict[str, dict] = {}
        for matrix, _ in every:
            state.update(matrix)
        for _, adamw in every:
            for name, (offset, part) in adamw.items():
                full = state.setdefault(name, {"step": part["step"]})
                for key in ("exp_avg", "exp_avg_sq"):
                    if key not in full:
                        full[key] = torch.zeros(self.params[name].numel(), dtype=part[key].dtype)
                    full[key][offset:offset + part[key].numel()] = part[key]
        for name in self.adamw.names:
            if name in state:
                for key in ("exp_avg", "exp_avg_sq"):
                    state[name][key] = state[name][key].view(self.params[name].shape)
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "optimizer": self.optimizer,
            "matrix_config": asdict(self.matrix_cfg),
            "adamw_config": asdict(self.adamw_cfg),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "state": state,
        }

    def _first_computer(self, name: str) -> bool:
        """Replicated matrices are saved by the lowest rank that computes them."""
        if self.policy.replicated:
            return self.rank == 0
        k = self._bucket_of[name]
        p = next(p for p in self.plan.dp_plan.buckets[k].params if p.name == name)
        return self.rank == min(self.plan.dp_plan.computing_ranks(self.plan.dp_plan.buckets[k], p))

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if state_dict.get("format") != STATE_FORMAT or state_dict.get("version") != STATE_VERSION:
            raise PlanError("not a canzona optimizer state (format/version mismatch)")
        if state_dict.get("optimizer") != self.optimizer:
            raise PlanError(f"checkpoint is for {state_dict.get('optimizer')}, this optimizer runs {self.optimizer}")
        self.matrix_cfg = replace(self.matrix_cfg, **_tuples(state_dict["matrix_config"]))
        self.adamw_cfg = replace(self.adamw_cfg, **_tuples(state_dict["adamw_config"]))
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        state = state_dict["state"]
        device = next(iter(self.params.values())).device
        self.matrix_state = {n: _to_device(state[n], device) if n in state else {} for n in self._computes}
        self.adamw_state = {}
        for name, s, e, off in self._adamw_parts():
            if name in state:
                full = state[name]
                self.adamw_state[name] = {
                    "step": full["step"],
                    "exp_avg": full["exp_avg"].reshape(-1)[off:off + e - s].clone().to(device),
                    "exp_avg_sq": full["exp_avg_sq"].reshape(-1)[off:off + e - s].clone().to(device),
                }


def _dp_group(group: dist.ProcessGroup | DeviceMesh | None) -> dist.ProcessGroup | None:
    """A process group, or the data-parallel group of a device mesh (1-D, or named "dp")."""
    if not isinstance(group, DeviceMesh):
        return group
    if group.ndim == 1:
        return group.get_group()
    if "dp" in (group.mesh_dim_names or ()):
        return group.get_group("dp")
    raise SpecError(f"a {group.ndim}-D device mesh needs a dimension named 'dp' (has {group.mesh_dim_names})")


def _to_cpu(state: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.detach().to("cpu", copy=True) if isinstance(v, Tensor) else v for k, v in state.items()}


def _to_device(state: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.detach().to(device, copy=True) if isinstance(v, Tensor) else v for k, v in state.items()}


def _tuples(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
