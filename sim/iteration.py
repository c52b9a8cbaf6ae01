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

from canzona.catalog import Qwen3Config
from canzona.cost import DeviceRate, adamw_kernels
from canzona.dp.layout import BucketPlan
from canzona.hardware import HardwareProfile
from canzona.optimizers import default_config
from canzona.plan import Plan
from canzona.spec import ModelSpec
from canzona.step_policies import StepPolicy
from canzona.tp import MicroGroup
from sim.collectives import all_to_all_cost, collective_cost, uneven_cost
from sim.engine import Engine
from sim.topology import Cluster
from sim.workload import Workload, forward_flops

COMPUTE, TP_COMM, DP_COMM = "compute", "tp-comm", "dp-comm"




@dataclass
class Context:
    engine: Engine
    cluster: Cluster
    hw: HardwareProfile
    rate: DeviceRate
    cfg: Qwen3Config
    spec: ModelSpec
    workload: Workload
    plan: Plan
    policy: StepPolicy

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
    if not ctx.policy.gather_params:
        return list(ready.values())
    eng, dpp, nbytes = ctx.engine, ctx.plan.dp_plan, ctx.workload.param_bytes
    geo = ctx.cluster.dp_geometry()
    done: list[simpy.Event] = []
    for t in range(ctx.tp):
        group = ctx.cluster.dp_group(t)
        after = {r: [ready[r]] for r in group}
        for b in dpp.buckets:
            if dpp.policy == "layerwise":
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


def synchronous_step(ctx: Context, start: simpy.Event) -> list[simpy.Event]:
    """sc, zero1-gather, layerwise: every TP rank gathers the full matrices its DP rank computes and
    computes every one of them (TP sync)."""
    eng, cl = ctx.engine, ctx.cluster
    ready: dict[int, simpy.Event] = {}
    gathered: dict[int, simpy.Event] = {r: start for r in range(cl.gpus)}
    if ctx.policy.gather_split:
        cost = _split_gather_costs(ctx)
        for t in range(ctx.tp):
            group = cl.dp_group(t)
            gathered.update(eng.collective("gather split gradients", group, cost, DP_COMM,
                                           {r: [start] for r in group}))
    for i in range(cl.dp):
        groups = ctx.plan.tp_plan.groups[0 if ctx.policy.replicated else i]
        names = [n for g in groups for n in g.tasks]
        seconds = sum(c for g in groups for c in g.costs)
        tp_bytes = sum(ctx.full_numel(n) for n in names) * ctx.workload.grad_bytes
        members = cl.tp_group(i)
        have = {r: [gathered[r]] for r in members}
        if ctx.tp > 1:
            cost = collective_cost("all-gather", tp_bytes, cl.tp_geometry(), ctx.hw)
            have = {r: [e] for r, e in eng.collective("tp gather matrices", members, cost, TP_COMM, have).items()}
        for r in members:
            matrices = eng.compute(r, "matrix optimizer (full matrices)", seconds, have[r])
            ready[r] = _adamw_step(ctx, r, [matrices])
    return _param_gathers(ctx, ready)


def _a2a_bytes(ctx: Context, group: MicroGroup) -> tuple[list[float], list[float]]:
    """Gather stage: each TP rank sends its shard of every matrix hosted elsewhere; a host receives
    the other `tp - 1` shards of each matrix it hosts. The scatter stage mirrors it."""
    send, recv = [0.0] * ctx.tp, [0.0] * ctx.tp
    for name, host in zip(group.tasks, group.hosts):
        shard = ctx.local_numel(name) * ctx.workload.grad_bytes
        for t in range(ctx.tp):
            if t != host:
                send[t] += shard
        recv[host] += shard * (ctx.tp - 1)
    return send, recv


def canzona_step(ctx: Context, start: simpy.Event) -> list[simpy.Event]:
    """Each DP rank's TP group runs its micro-groups through the pipeline, then AdamW and the
    parameter all-gather."""
    ready: dict[int, simpy.Event] = {}
    for i in range(ctx.cluster.dp):
        members = ctx.cluster.tp_group(i)
        applied = _pipeline(ctx, members, ctx.plan.tp_plan.groups[i], start)
        for r in members:
            ready[r] = _adamw_step(ctx, r, applied[r] or [start])
    return _param_gathers(ctx, ready)


def _exchange(ctx: Context, members: Sequence[int], group: MicroGroup, name: str, gather: bool,
              after: dict[int, simpy.Event]) -> dict[int, simpy.Event]:
    """The fused all-to-all of a micro-group: shards to hosts (gather) or update chunks back."""
    if ctx.tp == 1:
        return after
    send, recv = _a2a_bytes(ctx, group)
    if not gather:
        send, recv = recv, send
    cost = all_to_all_cost(send, recv, ctx.cluster.tp_geometry(), ctx.hw)
    return ctx.engine.collective(name, members, cost, TP_COMM, {r: [after[r]] for r in members})


def _pipeline(ctx: Context, members: Sequence[int], groups: Sequence[MicroGroup],
              start: simpy.Event) -> dict[int, list[simpy.Event]]:
    """docs/design.md §6.3: gather g+1 is enqueued before the scatter of g; the apply of g is enqueued
    after the compute of g+1. Streams run in enqueue order, so communication hides behind compute."""
    eng = ctx.engine
    begin = {r: start for r in members}
    applied: dict[int, list[simpy.Event]] = {r: [] for r in members}
    if not groups:
        return applied
    gathered = {0: _exchange(ctx, members, groups[0], "group 0 gather", True, begin)}
    pending: tuple[int, dict[int, simpy.Event]] | None = None
    for g, group in enumerate(groups):
        if g + 1 < len(groups):
            gathered[g + 1] = _exchange(ctx, members, groups[g + 1], f"group {g + 1} gather", True, begin)
        loads = group.host_loads(ctx.tp)
        computed = {r: eng.compute(r, f"group {g} compute", loads[t], [gathered[g][r]])
                    for t, r in enumerate(members)}
        scattered = _exchange(ctx, members, group, f"group {g} scatter", False, computed)
        if pending is not None:
            _apply(ctx, groups, *pending, applied)
        pending = (g, scattered)
    _apply(ctx, groups, *pending, applied)
    return applied


def _apply(ctx: Context, groups: Sequence[MicroGroup], g: int, scattered: dict[int, simpy.Event],
           applied: dict[int, list[simpy.Event]]) -> None:
    """Every TP rank adds its chunk of group g's updates to its shards (memory-bound)."""
    numel = sum(ctx.local_numel(n) for n in groups[g].tasks)
    seconds = numel * 3 * 4 / ctx.rate.hbm_bytes_per_s + ctx.rate.launch_s
    for r, done in scattered.items():
        applied[r].append(ctx.engine.compute(r, f"group {g} apply", seconds, [done]))
