"""One training iteration as SimPy programs: forward / backward with gradient sync (phase A), then
the optimizer step of a step policy (docs/design.md §7) (phase B).

Phase A is identical on every rank: micro-batches, layers, TP collectives and the DP gradient
collectives (which finish at the same moment for all members) do not depend on the rank. It is
simulated once, on rank 0, with each collective priced for its real group. Phase B differs between
ranks (who owns which matrix, which TP rank hosts it), so every GPU is simulated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import simpy

from canzona.cost import DeviceRate, adamw_kernels
from canzona.decoder import Architecture
from canzona.dp.layout import BucketPlan
from canzona.hardware import HardwareProfile
from canzona.optimizers import default_config
from canzona.plan import Plan
from canzona.spec import ModelSpec
from canzona.step_policies import PARAMS_BY_OWNER, StepPolicy
from canzona.step_schedule import (
    ALL_TO_ALL,
    COMPUTE,
    GATHER,
    SCATTER,
    Exchange,
    TPSchedule,
    tp_schedule,
)
from sim.collectives import all_to_all_cost, collective_cost, uneven_cost
from sim.engine import Engine
from sim.topology import Cluster
from sim.workload import Workload, forward_flops

TP_COMM, DP_COMM = "tp-comm", "dp-comm"


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
    tp_mode: str = "pipelined"

    @property
    def tp(self) -> int:
        return self.cluster.tp

    def local_numel(self, name: str) -> int:
        return self.spec.param(name).local_numel(self.tp)

    def full_numel(self, name: str) -> int:
        return self.spec.param(name).numel

    def adamw_local_numel(self) -> int:
        return sum(p.local_numel(self.tp) for p in self.spec.adamw_params())

    def adamw_seconds(self, numel: int) -> float:
        return sum(self.rate.kernel_seconds(k) for k in adamw_kernels(numel, default_config("adamw")))

    def flops_seconds(self, flops: float) -> float:
        g = self.hw.gpu
        return flops / (g.peak_flops["bf16"] * g.model_flops_utilization)


# --- phase A ----------------------------------------------------------------------------------


def _bucket_first_layers(ctx: Context) -> list[int]:
    """Backward reaches a bucket's gradients all computed after the lowest layer it holds."""
    firsts = []
    for b in ctx.plan.dp_plan.buckets:
        layers = [ctx.spec.param(p.name).layer for p in b.params]
        firsts.append(min((x for x in layers if x is not None), default=0))
    return firsts


def grad_sync_cost(ctx: Context, bucket: BucketPlan):
    geo = ctx.cluster.dp_geometry()
    nbytes = ctx.workload.grad_bytes
    if ctx.policy.grad_sync == "all-reduce":
        return collective_cost("all-reduce", bucket.size * nbytes, geo, ctx.hw)
    return uneven_cost("reduce-scatter", [n * nbytes for n in bucket.segment_lengths()], geo, ctx.hw)


def adamw_sync_cost(ctx: Context):
    op = "all-reduce" if ctx.policy.grad_sync == "all-reduce" else "reduce-scatter"
    return collective_cost(op, ctx.adamw_local_numel() * ctx.workload.grad_bytes, ctx.cluster.dp_geometry(), ctx.hw)


def _groups(ranks: Sequence[int], groups: Sequence[Sequence[int]]) -> list[list[int]]:
    chosen = set(ranks)
    return [[r for r in g if r in chosen] for g in groups if any(r in chosen for r in g)]


def forward_backward(ctx: Context, ranks: Sequence[int] = (0,)) -> tuple[dict[int, simpy.Event], simpy.Event]:
    """Phase A on `ranks` (by default rank 0 alone, which stands for every rank: see the module
    docstring). Collectives are priced for their real groups either way. Returns each rank's last
    backward kernel and the event of all gradients synchronised."""
    eng, wl, cl = ctx.engine, ctx.workload, ctx.cluster
    flops = forward_flops(ctx.cfg, ctx.spec, wl)
    act = wl.tokens_per_micro_batch * ctx.cfg.hidden * wl.activation_bytes
    ag = collective_cost("all-gather", act, cl.tp_geometry(), ctx.hw)
    rs = collective_cost("reduce-scatter", act, cl.tp_geometry(), ctx.hw)
    tp_groups = _groups(ranks, [cl.tp_group(i) for i in range(cl.dp)])
    dp_groups = _groups(ranks, [cl.dp_group(t) for t in range(cl.tp)])
    firsts = _bucket_first_layers(ctx)
    micro_batches = wl.micro_batches(cl.dp)

    done = eng.env.event().succeed()
    last: dict[int, simpy.Event] = {r: done for r in ranks}

    def collective(name: str, groups: list[list[int]], cost, stream: str) -> dict[int, simpy.Event]:
        out: dict[int, simpy.Event] = {}
        for g in groups:
            out.update(eng.collective(name, g, cost, stream, {r: [last[r]] for r in g}))
        return out

    def compute(name: str, seconds: float) -> None:
        for r in ranks:
            last[r] = eng.compute(r, name, seconds, [last[r]])

    def block(name: str, seconds: float) -> None:
        """Sequence-parallel block: all-gather in, compute, reduce-scatter out (TP > 1)."""
        if ctx.tp > 1:
            last.update(collective(f"{name} all-gather", tp_groups, ag, TP_COMM))
        compute(name, seconds)
        if ctx.tp > 1:
            last.update(collective(f"{name} reduce-scatter", tp_groups, rs, TP_COMM))

    syncs: list[simpy.Event] = []
    for mb in range(micro_batches):
        for layer, f in enumerate(flops.per_layer):
            for part in (1, 2):
                block(f"mb{mb} fwd layer {layer}.{part}", ctx.flops_seconds(f / 2 / ctx.tp))
        compute(f"mb{mb} fwd head", ctx.flops_seconds(flops.head / ctx.tp))
        compute(f"mb{mb} bwd head", ctx.flops_seconds(2 * flops.head / ctx.tp))
        for layer in reversed(range(len(flops.per_layer))):
            for part in (2, 1):
                block(f"mb{mb} bwd layer {layer}.{part}", ctx.flops_seconds(2 * flops.per_layer[layer] / 2 / ctx.tp))
            if mb == micro_batches - 1:
                for bi, first in enumerate(firsts):
                    if first == layer:
                        cost = grad_sync_cost(ctx, ctx.plan.dp_plan.buckets[bi])
                        syncs += collective(f"grad sync bucket {bi}", dp_groups, cost, DP_COMM).values()
    syncs += collective("grad sync adamw", dp_groups, adamw_sync_cost(ctx), DP_COMM).values()
    return dict(last), eng.env.all_of(syncs)


# --- phase B ----------------------------------------------------------------------------------


def _param_gathers(ctx: Context, ready: dict[int, simpy.Event]) -> list[simpy.Event]:
    """All-gather(-v) of the updated parameters over each DP group, bucket by bucket."""
    if not ctx.policy.gathers_params:
        return list(ready.values())
    eng, dpp, nbytes = ctx.engine, ctx.plan.dp_plan, ctx.workload.param_bytes
    geo = ctx.cluster.dp_geometry()
    done: list[simpy.Event] = []
    for t in range(ctx.tp):
        group = ctx.cluster.dp_group(t)
        after = {r: [ready[r]] for r in group}
        for b in dpp.buckets:
            if ctx.policy.param_gather == PARAMS_BY_OWNER:
                owned = [0] * ctx.cluster.dp
                for p in b.params:
                    owned[p.owner] += p.numel
                segments = owned
            else:
                segments = b.segment_lengths()
            cost = uneven_cost("all-gather", [n * nbytes for n in segments], geo, ctx.hw)
            done += eng.collective(f"param gather bucket {b.index}", group, cost, DP_COMM, after).values()
        adamw = collective_cost("all-gather", ctx.adamw_local_numel() * nbytes, geo, ctx.hw)
        done += eng.collective("param gather adamw", group, adamw, DP_COMM, after).values()
    return done


def _adamw_step(ctx: Context, rank: int, after: list[simpy.Event]) -> simpy.Event:
    numel = ctx.adamw_local_numel()
    share = numel if ctx.policy.replicated else -(-numel // ctx.cluster.dp)
    return ctx.engine.compute(rank, "adamw step", ctx.adamw_seconds(share), after)


def _split_gather_costs(ctx: Context):
    """zero1-gather: bytes each DP rank sends and receives to assemble its split matrices."""
    dpp, d, nbytes = ctx.plan.dp_plan, ctx.cluster.dp, ctx.workload.grad_bytes
    send, recv = [0.0] * d, [0.0] * d
    for b in dpp.buckets:
        for p in b.params:
            holders = b.ranks_overlapping(p)
            for r in dpp.computing_ranks(b, p):
                for j in holders:
                    if j != r:
                        lo, hi = b.segment(j)
                        part = (min(hi, p.end) - max(lo, p.offset)) * nbytes
                        send[j] += part
                        recv[r] += part
    return all_to_all_cost(send, recv, ctx.cluster.dp_geometry(), ctx.hw)


def optimizer_step(ctx: Context, start: simpy.Event) -> list[simpy.Event]:
    """Phase B of every policy: the DP-level extras (zero1-gather's split gathers), then each DP
    rank's TP group runs its step schedule (`canzona.step_schedule`: micro-groups under canzona, one
    tp-sync group under the baselines), then AdamW and the parameter all-gather."""
    eng, cl = ctx.engine, ctx.cluster
    gathered: dict[int, simpy.Event] = {r: start for r in range(cl.gpus)}
    if ctx.policy.gather_split:
        cost = _split_gather_costs(ctx)
        for t in range(ctx.tp):
            group = cl.dp_group(t)
            gathered.update(eng.collective("gather split gradients", group, cost, DP_COMM,
                                           {r: [start] for r in group}))
    ready: dict[int, simpy.Event] = {}
    schedules: dict[int, TPSchedule] = {}
    for i in range(cl.dp):
        # a replicated policy's plan is made for one DP rank (sim.simulate): every group runs it
        plan_rank = 0 if ctx.policy.replicated else i
        if plan_rank not in schedules:
            schedules[plan_rank] = tp_schedule(ctx.plan, ctx.spec, ctx.policy, plan_rank, ctx.tp_mode,
                                               ctx.workload.grad_bytes, ctx.workload.grad_bytes)
        schedule = schedules[plan_rank]
        members = cl.tp_group(i)
        applied = run_schedule(ctx, members, schedule, {r: gathered[r] for r in members})
        for r in members:
            ready[r] = _adamw_step(ctx, r, applied[r] or [gathered[r]])
    return _param_gathers(ctx, ready)


def run_schedule(ctx: Context, members: Sequence[int], schedule: TPSchedule,
                 begin: dict[int, simpy.Event]) -> dict[int, list[simpy.Event]]:
    """The schedule's operations in its order (docs/design.md §6.3). Streams run in enqueue order,
    so a collective issued before a compute overlaps it; each compute waits for its group's gather,
    each apply for its group's scatter."""
    eng = ctx.engine
    gathered: dict[int, dict[int, simpy.Event]] = {}
    computed: dict[int, dict[int, simpy.Event]] = {}
    scattered: dict[int, dict[int, simpy.Event]] = {}
    applied: dict[int, list[simpy.Event]] = {r: [] for r in members}
    for op in schedule.ops:
        group = schedule.groups[op.group]
        if op.kind == GATHER:
            gathered[op.group] = _exchange(ctx, members, group.gather, begin)
        elif op.kind == COMPUTE:
            after = gathered.get(op.group, begin)
            computed[op.group] = {r: eng.compute(r, f"group {op.group} compute", group.loads[t], [after[r]])
                                  for t, r in enumerate(members)}
        elif op.kind == SCATTER:
            scattered[op.group] = _exchange(ctx, members, group.scatter, computed[op.group])
        elif group.scatter is None:  # APPLY where the computing rank applies: inside the task's cost
            applied.update({r: applied[r] + [computed[op.group][r]] for r in members})
        else:  # APPLY of scattered chunks: every TP rank adds its chunks to its shards (memory-bound)
            seconds = group.apply_numel * 3 * 4 / ctx.rate.hbm_bytes_per_s + ctx.rate.launch_s
            for r in members:
                applied[r].append(eng.compute(r, f"group {op.group} apply", seconds, [scattered[op.group][r]]))
    return applied


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
    return ctx.engine.collective(exchange.name, members, cost, TP_COMM, {r: [after[r]] for r in members})
