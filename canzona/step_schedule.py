"""The TP phase of the optimizer step as ordered operations (docs/design.md §6.3).

One definition, three users: the simulator prices these operations, the runtime executes them,
and the runtime's collective log is checked against them.

For one DP rank's TP group, `tp_schedule` turns the plan's micro-groups into:
- per micro-group, the collectives with their exact byte counts: under a TP scheduler with hosts,
  one all-to-all that gathers gradient shards to their hosts and one that scatters update chunks
  back (the chunks alone: every TP rank computes how to apply them itself); under `tp-sync`, one
  all-gather of every shard, after which every TP rank computes every update;
- each TP rank's compute seconds per micro-group (its hosted tasks);
- the order of operations, pipelined or serial, identical on every TP rank of the group (so every
  rank issues the same collectives in the same order).

Pipelined order: the gather of group g+1 is issued before group g computes, the scatter of g right
after it computes, and the apply of g once group g+1 has computed, so the gather of g+1 and the
scatter of g are in flight while compute runs. Serial order: gather, compute, scatter, apply, one
group after another.

Prefetched gathers (`TPSchedule.prefetched`): under a policy whose hosts read their gradients
straight from the buckets' reduce-scatters (canzona), the gathers ahead of the first compute move
reduced gradients only, so they are issued as soon as their buckets have landed, before the step
check, instead of after it: the gather of the largest matrices runs under the last reductions
instead of between the check and the first compute (docs/design.md §6.3).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from canzona.choices import check_choice
from canzona.errors import SpecError
from canzona.plan import Plan
from canzona.spec import ModelSpec
from canzona.step_policies import StepPolicy
from canzona.tp import EVERY_RANK, MicroGroup

GATHER, COMPUTE, SCATTER, APPLY = "gather", "compute", "scatter", "apply"
PIPELINED, SERIAL = "pipelined", "serial"
TP_MODES = (PIPELINED, SERIAL)
ALL_TO_ALL, ALL_GATHER = "all-to-all", "all-gather"
TP_GROUP = "tp"  # the group name the runtime's collective log uses for TP collectives


def check_tp_mode(mode: str) -> str:
    return check_choice(mode, TP_MODES, "TP mode")


@dataclass(frozen=True)
class Task:
    """One matrix of a micro-group: its host TP rank (or `EVERY_RANK`) and its TP geometry."""

    name: str
    host: int
    shape: tuple[int, ...]  # the full matrix
    tp_dim: int | None  # None: every TP rank holds the whole matrix
    cost: float  # seconds of full-matrix optimizer work
    tp: int
    state_bytes: int = 0  # full-matrix optimizer state, held by the host (by every TP rank under tp-sync)

    @property
    def shard_shape(self) -> tuple[int, ...]:
        if self.tp_dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.tp_dim] //= self.tp
        return tuple(shape)

    @property
    def shard_numel(self) -> int:
        return math.prod(self.shard_shape)

    def hosted_on(self, tp_rank: int) -> bool:
        return self.host in (tp_rank, EVERY_RANK)


@dataclass(frozen=True)
class Exchange:
    """One collective of a TP group: `sent[s][d]` bytes go from TP rank s to TP rank d."""

    op: str  # ALL_TO_ALL or ALL_GATHER
    name: str
    sent: tuple[tuple[int, ...], ...]

    def bytes_out(self, tp_rank: int) -> int:
        return sum(self.sent[tp_rank])

    def bytes_in(self, tp_rank: int) -> int:
        return sum(row[tp_rank] for row in self.sent)

    def record(self, tp_rank: int) -> tuple[int, ...]:
        """What TP rank `tp_rank`'s collective log records: for an all-to-all, the bytes it sends
        to each member; for an all-gather, the bytes each member contributes."""
        if self.op == ALL_TO_ALL:
            return self.sent[tp_rank]
        return tuple(max(row) for row in self.sent)

    @property
    def total_bytes(self) -> int:
        return sum(map(sum, self.sent))


@dataclass(frozen=True)
class GroupStep:
    """One micro-group as executed: its tasks, its collectives (None where nothing moves) and
    each TP rank's compute seconds."""

    index: int
    tasks: tuple[Task, ...]
    gather: Exchange | None
    scatter: Exchange | None
    loads: tuple[float, ...]

    def hosted(self, tp_rank: int) -> tuple[Task, ...]:
        return tuple(t for t in self.tasks if t.hosted_on(tp_rank))

    def sources(self, tp_rank: int) -> tuple[tuple[int, tuple[Task, ...]], ...]:
        """Per other TP rank s, the tasks whose update chunks s sends to `tp_rank`."""
        return tuple((s, tuple(t for t in self.tasks if t.host == s)) for s in range(len(self.loads))
                     if s != tp_rank)

    @property
    def apply_numel(self) -> int:
        """Elements every TP rank updates (its shard of each task)."""
        return sum(t.shard_numel for t in self.tasks)


@dataclass(frozen=True)
class Op:
    kind: str  # GATHER (issue), COMPUTE (waits for its gather), SCATTER (issue), APPLY (waits for its scatter)
    group: int


@dataclass(frozen=True)
class TPSchedule:
    """What one DP rank's TP group executes in the optimizer step."""

    dp_rank: int
    tp: int
    mode: str
    groups: tuple[GroupStep, ...]
    ops: tuple[Op, ...]
    # the leading gathers (`prefetched`) are issued as their buckets land, before the step check
    prefetch: bool = False

    @cached_property
    def exchanges(self) -> tuple[Exchange, ...]:
        """The collectives in the order every TP rank issues them."""
        out = []
        for op in self.ops:
            ex = self.groups[op.group].gather if op.kind == GATHER else \
                self.groups[op.group].scatter if op.kind == SCATTER else None
            if ex is not None:
                out.append(ex)
        return tuple(out)

    @cached_property
    def prefetched(self) -> tuple[Op, ...]:
        """The gathers issued before the step check, as soon as their buckets have landed: with
        `prefetch`, every op ahead of the first compute (each a gather: pipelined, those of groups 0
        and 1; serial, group 0's). They move reduced gradients only, which nothing changes before
        the compute reads them (clipping scales what arrived by the same factor, bit for bit), so
        they need not wait for the check; the first group's gather, which holds the largest
        matrices, then no longer sits between the check and the first compute."""
        if not self.prefetch:
            return ()
        out = []
        for op in self.ops:
            if op.kind != GATHER:
                break
            out.append(op)
        return tuple(out)

    @property
    def elementwise_at(self) -> int:
        """Where the step's elementwise part (AdamW on the vectors and embeddings, disjoint from the
        matrices) runs: before the op of this index, the last apply, which waits for the last
        scatter, so that AdamW runs while that scatter is in flight instead of after it; after
        every op (index `len(ops)`) when there are none."""
        return max(len(self.ops) - 1, 0)

    def tasks(self) -> list[Task]:
        return [t for g in self.groups for t in g.tasks]

    def hosted(self, tp_rank: int) -> list[Task]:
        return [t for g in self.groups for t in g.hosted(tp_rank)]

    def state_bytes(self, tp_rank: int) -> int:
        """Optimizer-state bytes of the matrices TP rank `tp_rank` hosts (the plan's prediction)."""
        return sum(t.state_bytes for t in self.hosted(tp_rank))


def _exchanges(index: int, tasks: Sequence[Task], tp: int, grad_bytes: int,
               update_bytes: int) -> tuple[Exchange | None, Exchange | None]:
    if tp == 1:
        return None, None
    gather = [[0] * tp for _ in range(tp)]
    scatter = [[0] * tp for _ in range(tp)]
    every = [t.host == EVERY_RANK for t in tasks]
    if any(every) and not all(every):
        raise SpecError(f"micro-group {index} mixes tp-sync tasks with hosted ones")
    for t in tasks:
        for s in range(tp):
            for d in range(tp):
                if s == d:
                    continue
                if t.host == EVERY_RANK:
                    # every rank gathers every shard (a replicated matrix needs nothing)
                    if t.tp_dim is not None:
                        gather[s][d] += t.shard_numel * grad_bytes
                else:
                    if d == t.host and t.tp_dim is not None:
                        gather[s][d] += t.shard_numel * grad_bytes
                    if s == t.host:  # the chunk alone: its scalars the receiver computes itself
                        scatter[s][d] += t.shard_numel * update_bytes

    def exchange(op: str, what: str, sent: list[list[int]]) -> Exchange | None:
        if not any(map(any, sent)):
            return None
        return Exchange(op, f"group {index} {what}", tuple(map(tuple, sent)))

    if all(every):
        return exchange(ALL_GATHER, "all-gather", gather), None
    return exchange(ALL_TO_ALL, "gather", gather), exchange(ALL_TO_ALL, "scatter", scatter)


def _ops(groups: Sequence[GroupStep], mode: str) -> tuple[Op, ...]:
    def gather(g: int) -> list[Op]:
        return [Op(GATHER, g)] if groups[g].gather is not None else []

    def scatter(g: int) -> list[Op]:
        return [Op(SCATTER, g)] if groups[g].scatter is not None else []

    ops: list[Op] = []
    if mode == SERIAL:
        for g in range(len(groups)):
            ops += gather(g) + [Op(COMPUTE, g)] + scatter(g) + [Op(APPLY, g)]
        return tuple(ops)
    if groups:
        ops += gather(0)
    for g in range(len(groups)):
        if g + 1 < len(groups):
            ops += gather(g + 1)
        ops += [Op(COMPUTE, g)] + scatter(g)
        if g > 0:
            ops.append(Op(APPLY, g - 1))
    if groups:
        ops.append(Op(APPLY, len(groups) - 1))
    return tuple(ops)


def micro_groups(plan: Plan, policy: StepPolicy, dp_rank: int) -> tuple[MicroGroup, ...]:
    """The micro-groups DP rank `dp_rank`'s TP group runs. Under a replicated policy (`sc`) every DP
    rank computes every matrix: one tp-sync group of all of them."""
    groups = plan.tp_plan.groups
    if not policy.replicated:
        return groups[dp_rank]
    everything = [(n, c) for rank in groups for g in rank for n, c in zip(g.tasks, g.costs)]
    if not everything:
        return ()
    names, costs = zip(*everything)
    return (MicroGroup(tuple(names), (EVERY_RANK,) * len(names), tuple(costs)),)


class ScheduleKeys:
    """What `tp_schedule` reads of a DP rank's micro-groups, the matrices' names aside: per task
    its host and cost, and of its matrix the full shape, TP dimension, optimizer-state bytes and
    bucket (by which an overlapped step orders the groups). DP ranks with equal keys get schedules
    equal but for the names and `dp_rank` (under one mode, bytes and `overlap_step`); under a
    replicated policy every DP rank runs one schedule (key None). The simulator and the memory
    model compute one schedule per key: at DP 2048 most ranks own no matrix, and the owners fall
    into a few kinds."""

    def __init__(self, plan: Plan, spec: ModelSpec, policy: StepPolicy) -> None:
        self.plan, self.policy = plan, policy
        self.matrix = {p.name: (m.shape, m.tp_dim if plan.tp > 1 else None, p.state_bytes, k)
                       for k, b in enumerate(plan.dp_plan.buckets) for p in b.params for m in (spec.param(p.name),)}

    def __call__(self, dp_rank: int) -> tuple | None:
        if self.policy.replicated:
            return None
        return tuple((tuple(self.matrix[n] for n in g.tasks), g.hosts, g.costs)
                     for g in self.plan.tp_plan.groups[dp_rank])


def tp_schedule(plan: Plan, spec: ModelSpec, policy: StepPolicy, dp_rank: int, mode: str = PIPELINED,
                grad_bytes: int = 4, update_bytes: int = 4, *, overlap_step: bool = False) -> TPSchedule:
    """The TP phase of DP rank `dp_rank`: its micro-groups as operations, in `mode` order.

    `grad_bytes`: bytes per element of the reduced gradients that are gathered; `update_bytes`: of
    the update chunks that are scattered (the dtype updates are applied in). `overlap_step`: the
    micro-groups in the order their gradients land (by the last bucket each needs: buckets are
    reduced in index order), as an overlapped step starts them; else the plan's order, and, under a
    policy whose hosts read their gradients straight from the reduce-scatters, the leading gathers
    prefetched (`TPSchedule.prefetched`)."""
    check_tp_mode(mode)
    if not 0 <= dp_rank < plan.dp:
        raise SpecError(f"dp rank {dp_rank} is outside 0..{plan.dp - 1}")
    if overlap_step and policy.gathers_split(plan.dp_plan):
        raise SpecError(f"overlap_step needs every matrix whole in its owner's segment; this {plan.dp_plan.policy} "
                        "plan splits some between ranks (plan with geometry 'whole')")
    tp = plan.tp
    state = plan.dp_plan.state_bytes
    steps = []
    for index, group in enumerate(micro_groups(plan, policy, dp_rank)):
        tasks = []
        for name, host, cost in zip(group.tasks, group.hosts, group.costs):
            p = spec.param(name)
            tasks.append(Task(name, host, p.shape, p.tp_dim if tp > 1 else None, cost, tp, state[name]))
        gather, scatter = _exchanges(index, tasks, tp, grad_bytes, update_bytes)
        steps.append(GroupStep(index, tuple(tasks), gather, scatter, tuple(group.host_loads(tp))))
    if overlap_step:
        bucket_of = {p.name: k for k, b in enumerate(plan.dp_plan.buckets) for p in b.params}
        if tp == 1:  # nothing is exchanged: each matrix may start as soon as its own bucket lands
            tasks = sorted(((bucket_of[t.name], k, t) for k, t in enumerate(t for g in steps for t in g.tasks)),
                           key=lambda x: x[:2])
            steps = [GroupStep(i, (t,), None, None, (t.cost,)) for i, (_, _, t) in enumerate(tasks)]
        else:
            steps.sort(key=lambda g: max((bucket_of[t.name] for t in g.tasks), default=0))
    groups = tuple(steps)
    # an overlapped step issues everything early already; the baselines' gradients (and those of a
    # plan that splits matrices between ranks) are complete only after the step's own DP gathers
    # (or are all-reduced), so their gathers cannot move
    prefetch = policy.reads_reduce_scatter(plan.dp_plan) and not overlap_step
    return TPSchedule(dp_rank, tp, mode, groups, _ops(groups, mode), prefetch)
