"""The matrix phase of the optimizer step: one DP rank's TP schedule (`canzona.step_schedule`)
executed on its TP group (docs/design.md §6.3).

Per micro-group, in the schedule's order (pipelined or serial):
1. gather: one `all_to_all_single` carries each TP rank's reduced gradient shards to their hosts,
   which concatenate them along `tp_dim` in TP-rank order (under `tp-sync`: one all-gather, and
   every TP rank is a host);
2. compute: each host runs the matrix kernel on the full gradients of its tasks; optimizer state
   lives only on the host. With a batched kernel, the tasks of one compute window that share
   shape, dtype, hyper-parameters and state layout run as one batched call
   (`canzona.runtime.batched`), bit-identical to one call per matrix on CPU. A window is one
   micro-group, or, where the schedule moves nothing (TP = 1), consecutive groups up to
   `batched.MAX_BATCH_NUMEL` elements: with no collective to overlap there, computing them
   together changes no result, only when their updates are computed;
3. scatter: one `all_to_all_single` returns chunk j of each update to TP rank j (the chunks alone);
4. apply: every TP rank applies its chunk to its shard (`kernels.apply_update_`), with the update's
   scalars (scale, decay, decay order, or no update) computed by itself from what every TP rank
   knows: the matrix's shape, its hyper-parameters, whether it got a gradient (the step check's
   table) and how many steps it took (`steps`, kept alike on every TP rank). The host sends no
   scalars, so a receiver never reads a value back from the device in the step: the per-group read
   of sent scalars this replaces made the host wait for every micro-group's scatter
   (docs/design.md §8.3). Its host checks, each step and without a device read, that its kernel's
   update has exactly those scalars.

Under canzona the schedule's leading gathers (`TPSchedule.prefetched`) are issued by `prefetch`
as their buckets land, before the step check, and `run` goes on from them.

Collectives are asynchronous: in pipelined order the gather of group g+1 and the scatter of g are in
flight while g+1 computes (gloo runs them on its own threads; on CUDA they are issued from a side
stream whose work the compute stream waits for through events). At TP = 1 nothing moves and the
schedule is compute and apply per group.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from canzona.batching import MAX_BATCH_NUMEL, batches, compute_windows
from canzona.errors import CanzonaError
from canzona.runtime.batched import BatchedKernel, Kernel, batch_key
from canzona.runtime.comm import Comm, PendingWork
from canzona.runtime.kernels import ScalarsFn, Update, apply_update_
from canzona.runtime.shards import shard_of, unshard
from canzona.step_schedule import (
    ALL_GATHER,
    APPLY,
    COMPUTE,
    GATHER,
    SCATTER,
    GroupStep,
    Task,
    TPSchedule,
)


class Streams:
    """Where communication is issued. On CPU (gloo) there are no streams: gloo runs collectives on
    its own threads. On CUDA, packing and collectives go to a side stream that first waits for the
    compute stream; each block issued there records an event, and the compute stream waits for
    that event (not for the whole side stream, which may already hold the next micro-group's
    packing: waiting for all of it would serialise the pipelined order) before it reads what
    arrived. The collective's own completion is ordered by its work's `wait()`."""

    def __init__(self, device: torch.device) -> None:
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def comm(self, live: _Group, key: str) -> Iterator[None]:
        """Issue a block on the side stream; its event goes to `live.issued[key]`."""
        if self.side is None:
            yield
            return
        self.side.wait_stream(torch.cuda.current_stream(self.side.device))
        with torch.cuda.stream(self.side):
            yield
        event = torch.cuda.Event()
        event.record(self.side)
        live.issued[key] = event

    def join(self, live: _Group, key: str, *tensors: Tensor) -> None:
        """The compute stream waits for the block issued as `key`; its buffers are now in use by
        the compute stream."""
        if self.side is None:
            return
        current = torch.cuda.current_stream(self.side.device)
        current.wait_event(live.issued.pop(key))
        for t in tensors:
            t.record_stream(current)


@dataclass
class _Group:
    """One micro-group's tensors while it moves through the stages."""

    gather: PendingWork | None = None
    received: Tensor | None = None
    sent: Tensor | None = None
    updates: dict[str, Update | None] = field(default_factory=dict)
    scatter: PendingWork | None = None
    chunks: Tensor | None = None
    scatter_sent: Tensor | None = None
    issued: dict[str, Any] = field(default_factory=dict)  # CUDA events of the blocks issued on the side stream


@dataclass
class _Speculation:
    """An overlapped step's work before its commit (`MatrixStep.speculate`): the micro-groups with
    their updates and in-flight scatters, the state each update advanced (a copy: the optimizer's
    own is untouched until the commit), and the hyper-parameters each was computed with."""

    groups: list[_Group]
    states: dict[str, dict[str, Any]] = field(default_factory=dict)
    configs: dict[str, tuple[Any, float]] = field(default_factory=dict)
    # what the gradients were multiplied by before the updates were computed, which the reduced
    # gradients have yet to be (GradScaler's unscale, expected); 1.0 once they were (`clipped`)
    scale: float = 1.0


def _copy_state(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, Tensor) else copy.deepcopy(v) for k, v in state.items()}


@dataclass
class _Work:
    """One matrix to compute: where its update goes, its full gradient, state and hyper-parameters."""

    live: _Group
    name: str
    grad: Tensor
    state: dict[str, Any]
    config: Any
    lr: float


class MatrixStep:
    """Runs a `TPSchedule` for TP rank `tp_rank`. Everything it touches comes through callables,
    so the same executor serves every step policy and TP layout:

    - `grad(name)`: the reduced gradient of this rank's shard;
    - `target(name)`: the tensor this rank's chunk of the update is applied to (its shard, or its
      fp32 master), and `applied(name)` after it changed;
    - `config(name)`: the (config, lr) of the matrix's param group now;
    - `got(name)`: whether the matrix got a gradient on any rank this step (no gradient, no update).

    `kernel` computes one matrix; `batched` (None: every matrix alone) several of one batch key
    (`batched.batch_key`) at once, at most `max_batch_numel` elements a batch and a window.
    `scalars` (the optimizer's registry part, `kernels.ScalarsFn`) gives how a chunk is applied,
    from `steps`: by name, the steps each matrix of the schedule took (a step: its kernel ran on a
    gradient and the update was applied), advanced here on every TP rank alike; the optimizer sets
    it from a loaded state (`checkpoint.load_by_name`).
    """

    max_batch_numel = MAX_BATCH_NUMEL

    def __init__(self, schedule: TPSchedule, comm: Comm | None, tp_rank: int, kernel: Kernel,
                 state: dict[str, dict[str, Any]], grad_dtype: torch.dtype, update_dtype: torch.dtype,
                 device: torch.device, *, scalars: ScalarsFn, batched: BatchedKernel | None = None,
                 steps: dict[str, int] | None = None) -> None:
        self.schedule = schedule
        self.comm = comm
        self.tp_rank = tp_rank
        self.kernel = kernel
        self.batched = batched
        self.scalars = scalars
        self.steps: dict[str, int] = {} if steps is None else steps  # shared with the optimizer: filled in place
        self.windows = self._compute_windows()
        self.state = state
        self.grad_dtype = grad_dtype
        self.update_dtype = update_dtype
        self.device = device
        self.streams = Streams(device)
        # seconds per stage ("issue", "wait", "compute", "apply"), added up while a dict is set
        # here (benchmarks/bench_tp.py); host wall time, meaningful where work is synchronous (CPU)
        self.profile: dict[str, float] | None = None
        self._speculation: _Speculation | None = None
        self._prefetched: list[_Group] | None = None  # the groups whose gathers `prefetch` issued

    def _compute_windows(self) -> dict[int, tuple[int, ...]]:
        """The groups computed together (`canzona.batching.compute_windows`)."""
        return compute_windows(self.schedule.groups, self.tp_rank, self.batched is not None, self.max_batch_numel)

    @contextlib.contextmanager
    def _timed(self, stage: str) -> Iterator[None]:
        if self.profile is None:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.profile[stage] = self.profile.get(stage, 0.0) + time.perf_counter() - start

    def run(self, grad: Callable[[str], Tensor], target: Callable[[str], Tensor], applied: Callable[[str], None],
            config: Callable[[str], tuple[Any, float]], got: Callable[[str], bool],
            elementwise: Callable[[], None] = lambda: None) -> None:
        """The schedule, from its prefetched gathers (`prefetch`) where they were issued;
        `elementwise` (the AdamW step) where the schedule says (`TPSchedule.elementwise_at`)."""
        groups, self._prefetched = self._prefetched, None
        issued = set(self.schedule.prefetched) if groups is not None else set()
        if groups is None:
            groups = [_Group() for _ in self.schedule.groups]
        for k, op in enumerate(self.schedule.ops):
            if k == self.schedule.elementwise_at:
                elementwise()
            if op.kind == APPLY:
                self._apply(self.schedule.groups[op.group], groups[op.group], target, applied, config, got)
                groups[op.group] = _Group()  # free the group's buffers
            elif op not in issued:
                self._issue(op.kind, op.group, groups, grad, config, got)
        if self.schedule.elementwise_at >= len(self.schedule.ops):
            elementwise()

    # --- prefetched gathers (canzona's plain step) ----------------------------------------------

    def prefetch(self, grad: Callable[[str], Tensor]) -> None:
        """Issue the schedule's prefetched gathers (`TPSchedule.prefetched`) now, each as soon as
        `grad` returns its gradients (it waits for their bucket's reduce-scatter), before the step
        check. `run` goes on from them; `clipped` scales what they bring; `discard` drops them."""
        self.discard()
        groups = [_Group() for _ in self.schedule.groups]
        for op in self.schedule.prefetched:
            with self._timed("issue"):
                self._gather(self.schedule.groups[op.group], groups[op.group], grad)
        self._prefetched = groups

    def clipped(self, coefficient: float) -> None:
        """Clipping (or GradScaler's unscale) scaled the reduced gradients by `coefficient`. An
        overlapped step's updates were computed from them before: dropped, unless they were computed
        from the gradients times this very `coefficient` (`speculate(scale=)`: the same elementwise
        product, so the same values). What the prefetched gathers brought is scaled here by the
        same elementwise product in the same dtype, so it equals, bit for bit, what a gather issued
        now would bring (the host's own shards are read from the scaled buffers)."""
        speculation = self._speculation
        if speculation is not None and speculation.scale != 1.0 and speculation.scale == coefficient:
            speculation.scale = 1.0  # the unscale they were computed for: they stand
        elif speculation is not None:
            self.discard()
        for op in self.schedule.prefetched if self._prefetched is not None else ():
            live = self._prefetched[op.group]
            if live.gather is not None:
                with self._timed("wait"):
                    live.gather.wait()
                self.streams.join(live, GATHER, live.received, live.sent)
                live.gather = None  # arrived: `_full_grads` reads it as it is
            live.received.mul_(coefficient)

    def _issue(self, kind: str, index: int, groups: list[_Group], grad: Callable[[str], Tensor],
               config: Callable[[str], tuple[Any, float]], got: Callable[[str], bool],
               speculation: _Speculation | None = None) -> None:
        step, live = self.schedule.groups[index], groups[index]
        if kind == GATHER:
            with self._timed("issue"):
                self._gather(step, live, grad)
        elif kind == COMPUTE:
            if index in self.windows:  # else computed with the window it belongs to
                self._compute(self.windows[index], groups, grad, config, got, speculation)
        elif kind == SCATTER:
            with self._timed("issue"):
                self._scatter(step, live)

    # --- an overlapped step (overlap_step) ----------------------------------------------------

    def speculate(self, grad: Callable[[str], Tensor], config: Callable[[str], tuple[Any, float]],
                  scale: float = 1.0) -> None:
        """Gather, compute and scatter every micro-group now, in the schedule's order, each as soon
        as `grad` returns its gradients (it waits for their bucket's reduce-scatter), before the step
        check: every update is computed on a copy of its state and held, and nothing is applied.
        `commit` applies them once the check has passed; `discard` drops them. `scale`: compute
        from each gradient times `scale` (GradScaler's inverse scale, which the reduced gradients
        are expected to be multiplied by before the commit: `clipped(scale)`; else dropped)."""
        self.discard()
        speculation = _Speculation([_Group() for _ in self.schedule.groups], scale=scale)
        self._speculation = speculation

        def scaled(name: str) -> Tensor:  # the elementwise product the buffers will take (`clipped`)
            return grad(name) * scale
        read = grad if scale == 1.0 else scaled
        for op in self.schedule.ops:
            if op.kind != APPLY:  # whether a matrix got a gradient is known after the check
                self._issue(op.kind, op.group, speculation.groups, read, config, lambda _: True, speculation)

    def commit(self, target: Callable[[str], Tensor], applied: Callable[[str], None],
               config: Callable[[str], tuple[Any, float]], got: Callable[[str], bool],
               elementwise: Callable[[], None] = lambda: None) -> bool:
        """Apply the speculated step (False: there is none, or hyper-parameters changed since it was
        computed; it is dropped, `elementwise` is not run, and the caller runs the plain step). The
        matrices that got a gradient adopt their advanced state and take their update; the others
        keep theirs, as in `run`; `elementwise` runs where `run` runs it."""
        speculation = self._speculation
        if speculation is None:
            return False
        if speculation.scale != 1.0 or any(config(name) != used for name, used in speculation.configs.items()):
            # the unscale they were computed for did not come (another scale), or hyper-parameters changed
            self.discard()
            return False
        self._speculation = None
        for name, state in speculation.states.items():
            if got(name):
                kept = self.state.setdefault(name, {})
                kept.clear()
                kept.update(state)
        for k, op in enumerate(self.schedule.ops):
            if k == self.schedule.elementwise_at:
                elementwise()
            if op.kind == APPLY:
                self._apply(self.schedule.groups[op.group], speculation.groups[op.group], target, applied, config, got)
                speculation.groups[op.group] = _Group()
        if self.schedule.elementwise_at >= len(self.schedule.ops):
            elementwise()
        return True

    def discard(self) -> None:
        """Drop a speculated step, or prefetched gathers: their collectives are completed (every
        rank issued them), their buffers, updates and state copies freed."""
        speculation, self._speculation = self._speculation, None
        prefetched, self._prefetched = self._prefetched, None
        groups = (speculation.groups if speculation is not None else []) + (prefetched or [])
        for live in groups:
            for pending in (live.gather, live.scatter):
                if pending is not None:
                    pending.wait()

    # --- stage 1: gradient shards to their hosts ----------------------------------------------

    def _gather(self, step: GroupStep, live: _Group, grad: Callable[[str], Tensor]) -> None:
        me, tp = self.tp_rank, self.schedule.tp
        with self.streams.comm(live, GATHER):
            if step.gather.op == ALL_GATHER:
                mine = [grad(t.name).reshape(-1) for t in step.tasks if t.tp_dim is not None]
                live.sent = torch.cat(mine)
                live.received = torch.empty(tp * live.sent.numel(), dtype=self.grad_dtype, device=self.device)
                live.gather = self.comm.all_gather_into(live.received, live.sent, step.gather.name)
                return
            to = [[grad(t.name).reshape(-1) for t in step.tasks if t.host == d and t.tp_dim is not None]
                  if d != me else [] for d in range(tp)]
            in_splits = [sum(x.numel() for x in pieces) for pieces in to]
            live.sent = torch.cat([x for pieces in to for x in pieces]) if any(in_splits) else \
                torch.empty(0, dtype=self.grad_dtype, device=self.device)
            mine = sum(t.shard_numel for t in step.tasks if t.host == me and t.tp_dim is not None)
            out_splits = [0 if s == me else mine for s in range(tp)]
            live.received = torch.empty(sum(out_splits), dtype=self.grad_dtype, device=self.device)
            live.gather = self.comm.all_to_all(live.received, live.sent, out_splits, in_splits, step.gather.name)

    def _full_grads(self, step: GroupStep, live: _Group, grad: Callable[[str], Tensor]) -> dict[str, Tensor]:
        """The full gradient of every task hosted here, shards concatenated in TP-rank order."""
        me, tp = self.tp_rank, self.schedule.tp
        hosted = step.hosted(me)
        if live.gather is not None:
            with self._timed("wait"):
                live.gather.wait()
            self.streams.join(live, GATHER, live.received, live.sent)
        split = [t for t in hosted if t.tp_dim is not None]
        pieces: dict[str, list[Tensor]] = {t.name: [] for t in split}
        if step.gather is not None and step.gather.op == ALL_GATHER:
            per_rank = live.received.view(tp, -1)
            for s in range(tp):
                pos = 0
                for t in split:
                    pieces[t.name].append(per_rank[s, pos:pos + t.shard_numel].view(t.shard_shape))
                    pos += t.shard_numel
        else:
            pos = 0
            for s in range(tp):  # the receive buffer holds each source's shards in task order
                for t in split:
                    if s == me:
                        pieces[t.name].append(grad(t.name))
                    else:
                        pieces[t.name].append(live.received[pos:pos + t.shard_numel].view(t.shard_shape))
                        pos += t.shard_numel
        return {t.name: grad(t.name) if t.tp_dim is None else unshard(pieces[t.name], t.tp_dim) for t in hosted}

    # --- stage 2: hosts compute ---------------------------------------------------------------

    def _compute(self, window: tuple[int, ...], groups: list[_Group], grad: Callable[[str], Tensor],
                 config: Callable[[str], tuple[Any, float]], got: Callable[[str], bool],
                 speculation: _Speculation | None = None) -> None:
        work: list[_Work] = []
        for index in window:
            live = groups[index]
            for name, g in self._full_grads(self.schedule.groups[index], live, grad).items():
                if not got(name):
                    live.updates[name] = None  # as torch optimizers do: no gradient, no update, no decay
                    continue
                cfg, lr = config(name)
                if speculation is None:
                    state = self.state.setdefault(name, {})
                else:  # advanced on a copy, adopted at the commit
                    state = speculation.states[name] = _copy_state(self.state.get(name, {}))
                    speculation.configs[name] = (cfg, lr)
                work.append(_Work(live, name, g, state, cfg, lr))
        with self._timed("compute"):
            if self.batched is None:
                for w in work:
                    self._run([w])
            else:
                keyed = ((w, self._batch_key(w), w.grad.numel()) for w in work)
                for batch in batches(keyed, self.max_batch_numel):
                    self._run(batch)
        for index in window:
            groups[index].received = groups[index].sent = None

    @staticmethod
    def _batch_key(w: _Work) -> Hashable | None:
        """Matrices that may run as one batched call (None: alone)."""
        key = batch_key(w.grad, w.state)
        if key is None:
            return None
        key = (key, w.config, w.lr)
        try:
            hash(key)
        except TypeError:  # a configuration with an unhashable field: alone
            return None
        return key

    def _run(self, batch: list[_Work]) -> None:
        """Compute a batch (one batch key), one kernel call for all, and file the updates."""
        w = batch[0]  # a batch shares its configuration and lr
        if len(batch) == 1:
            updates = [self.kernel(w.grad, w.state, w.config, w.lr)]
        else:
            updates = self.batched([x.grad for x in batch], [x.state for x in batch], w.config, w.lr)
        for x, update in zip(batch, updates):
            self._check_scalars(x, update)
            if update is not None:  # in the dtype it is sent and applied in (kernels.apply_update_)
                update.direction = update.direction.to(self.update_dtype)
            x.live.updates[x.name] = update

    def _check_scalars(self, w: _Work, update: Update | None) -> None:
        """The kernel's update must have the scalars the other TP ranks apply its chunks with,
        computed from the replicated step count: a state that disagrees with that count (edited, or
        loaded on some ranks only) would otherwise scale the shards of one matrix differently.
        Python floats on the host: no device read."""
        steps = self.steps.get(w.name, 0)
        want = self.scalars(tuple(w.grad.shape), w.config, w.lr, steps)
        have = None if update is None else update.scalars
        if have != want:
            raise CanzonaError(f"{w.name}: the kernel's update applies as {have}, the TP ranks at step {steps} "
                               f"would apply it as {want}: its optimizer state and the step count every TP "
                               "rank keeps disagree (a state edited or loaded on this rank only?)")

    # --- stage 3: update chunks back ----------------------------------------------------------

    def _chunk(self, task: Task, update: Update | None, tp_rank: int) -> Tensor:
        if update is None:  # zeros keep the receive buffers' layout fixed; the receivers apply nothing
            return torch.zeros(task.shard_numel, dtype=self.update_dtype, device=self.device)
        return shard_of(update.direction, task.tp_dim, self.schedule.tp, tp_rank).reshape(-1)

    def _scatter(self, step: GroupStep, live: _Group) -> None:
        me, tp = self.tp_rank, self.schedule.tp
        with self.streams.comm(live, SCATTER):
            mine = step.hosted(me)
            parts = [[self._chunk(t, live.updates[t.name], d) for t in mine] if d != me else [] for d in range(tp)]
            in_splits = [sum(x.numel() for x in p) for p in parts]
            live.scatter_sent = torch.cat([x for p in parts for x in p]) if any(in_splits) else \
                torch.empty(0, dtype=self.update_dtype, device=self.device)
            out_splits = [sum(t.shard_numel for t in tasks) for _, tasks in step.sources(me)]
            out_splits.insert(me, 0)
            live.chunks = torch.empty(sum(out_splits), dtype=self.update_dtype, device=self.device)
            live.scatter = self.comm.all_to_all(live.chunks, live.scatter_sent, out_splits, in_splits,
                                                step.scatter.name)

    # --- stage 4: every TP rank applies its chunks --------------------------------------------

    def _apply(self, step: GroupStep, live: _Group, target: Callable[[str], Tensor], applied: Callable[[str], None],
               config: Callable[[str], tuple[Any, float]], got: Callable[[str], bool]) -> None:
        """Apply the group's updates (a speculated step computed every matrix: those without a
        gradient are skipped here), then count the step of every matrix that got a gradient, on
        every TP rank alike."""
        me = self.tp_rank
        with self._timed("apply"):
            for t in step.tasks:
                if t.hosted_on(me):
                    update = live.updates[t.name]
                    if update is not None and got(t.name):
                        chunk = shard_of(update.direction, t.tp_dim, self.schedule.tp, me)
                        self._apply_one(t, chunk.contiguous(), update, target, applied)
        if live.scatter is not None:
            with self._timed("wait"):
                live.scatter.wait()
            self.streams.join(live, SCATTER, live.chunks, live.scatter_sent)
            pos = 0  # the receive buffer holds the chunks in the order the hosts sent them
            with self._timed("apply"):
                for _source, tasks in step.sources(me):
                    for t in tasks:
                        chunk = live.chunks[pos:pos + t.shard_numel].view(t.shard_shape)
                        pos += t.shard_numel
                        if not got(t.name):
                            continue
                        cfg, lr = config(t.name)
                        scalars = self.scalars(t.shape, cfg, lr, self.steps.get(t.name, 0))
                        if scalars is not None:  # else no update this step (SOAP's first), as on the host
                            self._apply_one(t, chunk, Update.of(chunk, scalars), target, applied)
        for t in step.tasks:
            if got(t.name):
                self.steps[t.name] = self.steps.get(t.name, 0) + 1

    @staticmethod
    def _apply_one(task: Task, chunk: Tensor, update: Update, target: Callable[[str], Tensor],
                   applied: Callable[[str], None]) -> None:
        into = target(task.name)
        apply_update_(into, chunk.view(into.shape), update)
        applied(task.name)

