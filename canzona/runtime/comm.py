"""Collectives of the runtime, portable to gloo and NCCL, with a log and timeouts.

Reduce-scatter(-v) runs the route `canzona.reductions.bucket_route` chooses per bucket for the
optimizer's `reduce_scatter` implementation (`native` by default: the backend's own reductions;
`exact`: one all-to-all and a sum in rank order, bit for bit at any DP size, the verification
mode). The module docstring of `canzona.reductions` says what each route does and allocates; the
simulator prices the same routes. gloo has no reduce-scatter-v and `all_gather` of uneven tensors
fails there, while `all_to_all_single` and rooted reduces take any sizes on both backends
(docs/design.md §8.1).
All-gather(-v) is one in-place broadcast per owner (pure copies, so exact whatever the route).
`benchmarks/bench_comm.py` compares the routes on the same data.

A collective's `wait()` returns once the backend has also let go of its CPU tensors (`Handoff`):
otherwise a script that ends right after its last `step()` can abort at interpreter exit.
"""

from __future__ import annotations

import hashlib
import pickle
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from canzona.errors import CanzonaError, PlanError
from canzona.reductions import (
    DEFAULT_REDUCE_SCATTER,
    EVEN,
    EXACT,
    LOOPS,
    bucket_route,
    check_reduce_scatter,
)


@dataclass(frozen=True)
class CollectiveRecord:
    step: int
    order: int
    op: str
    group: str
    name: str
    bytes_per_rank: tuple[int, ...]  # bytes each rank contributes; all-to-all: bytes sent to each member
    seq: int = 0  # issue order among the records of every log sharing this log's clock (DP and TP together)


@dataclass
class CollectiveLog:
    """What the runtime really sent, in order: checked against the collectives of a step
    (`canzona.step_collectives`), which the simulator prices. `order` counts this log's records;
    logs that share a `clock` (an optimizer's DP and TP logs) also number their records in the
    order they were issued across both (`seq`)."""

    records: list[CollectiveRecord] = field(default_factory=list)
    step: int = 0
    clock: list[int] = field(default_factory=lambda: [0])  # one counter, shared by reference

    def add(self, op: str, group: str, name: str, bytes_per_rank: Sequence[int]) -> None:
        self.records.append(CollectiveRecord(self.step, len(self.records), op, group, name, tuple(bytes_per_rank),
                                             self.clock[0]))
        self.clock[0] += 1

    def for_step(self, step: int) -> list[CollectiveRecord]:
        return [r for r in self.records if r.step == step]

    def to_dicts(self) -> list[dict]:
        return [asdict(r) for r in self.records]




class Comm:
    """One process group, its timeout, how it reduce-scatters, and the log of everything sent on it."""

    def __init__(self, group: dist.ProcessGroup | None, timeout_s: float, name: str = "dp",
                 reduce_scatter: str = DEFAULT_REDUCE_SCATTER):
        self.reduce_scatter_impl = check_reduce_scatter(reduce_scatter)
        self.group = group
        self.name = name
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.timeout = timedelta(seconds=timeout_s)
        self.log = CollectiveLog()
        self.check_device = _check_device(group)
        self.nccl = self.check_device.type == "cuda"
        self.unreleased = 0  # collectives whose tensors gloo still held RELEASE_LIMIT_S after completing
        self.in_flight_bytes = 0  # buffers allocated for collectives not yet waited for (`_holding`)
        self.peak_in_flight_bytes = 0

    def _wait(self, work, what: str, host_reads: bool = False) -> None:
        try:
            # NCCL: a wait with a timeout polls the work from the host until it completes; without
            # one it only orders the current stream after it (the process group's timeout and
            # watchdog still bound it). So only the small checks, whose values the host reads
            # anyway, wait with this group's timeout there. gloo: the host always waits, bounded.
            ok = work.wait() if self.nccl and not host_reads else work.wait(self.timeout)
        except RuntimeError as e:
            raise CanzonaError(f"{what} on group {self.name} failed or timed out after "
                               f"{self.timeout.total_seconds():g} s (a peer died or disagrees): "
                               f"{str(e).splitlines()[0]}") from None
        if ok is False:
            raise CanzonaError(f"{what} on group {self.name} timed out after {self.timeout.total_seconds():g} s")

    def _all_to_all(self, out: Tensor, inp: Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
                    what: str) -> PendingWork:
        hand = Handoff()
        work = dist.all_to_all_single(hand(out), hand(inp), list(out_splits), list(in_splits), group=self.group,
                                      async_op=True)
        return PendingWork(self, work, what, hand)

    def all_to_all(self, out: Tensor, inp: Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
                   name: str) -> PendingWork:
        """`inp[in_splits[j] block]` goes to member j; `out` receives member j's block at `out_splits[j]`.
        Logged as the bytes this rank sends to each member."""
        self.log.add("all-to-all", self.name, name, [n * inp.element_size() for n in in_splits])
        return self._all_to_all(out, inp, out_splits, in_splits, f"all-to-all of {name}")

    def all_gather_into(self, out: Tensor, inp: Tensor, name: str) -> PendingWork:
        """Every member's equal-sized `inp`, in member order, into `out`."""
        self.log.add("all-gather", self.name, name, [inp.numel() * inp.element_size()] * self.size)
        hand = Handoff()
        work = dist.all_gather_single(hand(out), hand(inp), group=self.group, async_op=True)
        return PendingWork(self, work, f"all-gather of {name}", hand)

    def _owner(self, r: int) -> int:
        """Member r's rank in the default group (what rooted collectives name)."""
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    def reduce_scatter_v(self, flat: Tensor, cuts: Sequence[int], name: str) -> PendingWork:
        """Average `flat` over ranks; rank r ends up with the mean of segment [cuts[r], cuts[r+1])
        written back into `flat`. The rest of `flat` is left as it was, except under a loop of
        reduces on gloo, which sends the other segments from a copy for that reason."""
        lengths = [b - a for a, b in zip(cuts, cuts[1:])]
        self.log.add("reduce-scatter-v", self.name, name, [flat.numel() * flat.element_size()] * self.size)
        route = bucket_route(self.reduce_scatter_impl, lengths)
        what = f"reduce-scatter of {name}"
        if self.size == 1:
            return PendingWork(self, [], what)  # the mean over one rank is its own gradient
        if route == EXACT:
            return self._reduce_exact(flat, cuts, lengths, what)
        if route == LOOPS:
            return self._reduce_loops(flat, cuts, lengths, what)
        return self._reduce_scatter(flat, cuts, lengths, route == EVEN, what)

    def _reduce_exact(self, flat: Tensor, cuts: Sequence[int], lengths: Sequence[int], what: str) -> PendingWork:
        """One all-to-all (this rank receives every rank's copy of its segment), then a sum in
        rank order: the same arithmetic as one process summing the ranks' gradients."""
        a, b = cuts[self.rank], cuts[self.rank + 1]
        mine = lengths[self.rank]
        recv = torch.empty(mine * self.size, dtype=flat.dtype, device=flat.device)

        def finish() -> None:
            parts = recv.view(self.size, mine)
            acc = parts[0]  # summed in place: the received copies are this collective's own
            for j in range(1, self.size):
                acc += parts[j]
            flat[a:b].copy_(acc.div_(self.size))

        pending = self._all_to_all(recv, flat, [mine] * self.size, lengths, what)
        pending.then = finish
        return self._holding(pending, recv)

    def _reduce_scatter(self, flat: Tensor, cuts: Sequence[int], lengths: Sequence[int], even: bool,
                        what: str) -> PendingWork:
        """The backend's reduce-scatter, in place as Megatron's distributed optimizer runs it: of
        `flat` itself when its segments are even, its sum received into this rank's own segment
        (`flat[a:b]`, the input's chunk `rank`: NCCL's in-place form, recvbuff == sendbuff + rank x
        recvcount); else of a copy with every segment padded to the longest, received into this
        rank's padded segment of the copy, then its (unpadded) sum copied into `flat[a:b]`. No
        receive buffer either way. gloo clones the input before it reduces (torch's
        `ProcessGroupGloo::reduce_scatter_tensor_coalesced`: an all-reduce of a clone, this rank's
        chunk copied out), so writing the output over the input cannot change what is summed:
        `tests/runtime/test_reductions.py` checks on gloo that the result equals the out-of-place
        collective's bit for bit and that the rest of the buffer is left as it was."""
        a, b = cuts[self.rank], cuts[self.rank + 1]
        widest = max(lengths)
        if even:
            send = flat[cuts[0]:cuts[-1]]
            out = flat[a:b]
        else:
            send = torch.zeros(self.size * widest, dtype=flat.dtype, device=flat.device)
            for r, n in enumerate(lengths):
                send[r * widest:r * widest + n].copy_(flat[cuts[r]:cuts[r + 1]])
            out = send[self.rank * widest:(self.rank + 1) * widest]
        hand = Handoff()
        # through the process group with this group's timeout: gloo's reduce-scatter ignores the one
        # given to `wait()` (measured: it waited out the process group's instead)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        opts.timeout = self.timeout
        opts.asyncOp = True
        group = self.group if self.group is not None else dist.distributed_c10d._get_default_group()
        work = group.reduce_scatter_single(hand(out), hand(send), opts)
        pending = PendingWork(self, work, what, hand)
        if even:
            pending.then = lambda: flat[a:b].div_(self.size)  # the sum is already in place
        else:
            pending.then = lambda: flat[a:b].copy_(out[:b - a]).div_(self.size)
        return self._holding(pending, *([] if even else [send]))

    def _reduce_loops(self, flat: Tensor, cuts: Sequence[int], lengths: Sequence[int], what: str) -> PendingWork:
        """One sum-reduce per non-empty segment, to its owner; on NCCL grouped into one launch.
        gloo uses a non-root's buffer as scratch, so there the other ranks' segments are sent from
        a copy (NCCL never writes a non-root's buffer)."""
        a, b = cuts[self.rank], cuts[self.rank + 1]
        scratch = flat.clone() if flat.device.type == "cpu" else flat
        hand = Handoff()
        owners = [r for r in range(self.size) if lengths[r]]

        def issue() -> list:
            return [dist.reduce(hand(flat[a:b] if r == self.rank else scratch[cuts[r]:cuts[r + 1]]), self._owner(r),
                                op=dist.ReduceOp.SUM, group=self.group, async_op=True) for r in owners]

        if flat.device.type == "cuda" and owners:
            with dist._coalescing_manager(self.group, flat.device, async_ops=True) as grouped:
                issue()
            works = list(grouped.works)  # NCCL's one work for the group
        else:
            works = issue()
        pending = PendingWork(self, works, what, hand)
        pending.then = lambda: flat[a:b].div_(self.size)
        return self._holding(pending, *([scratch] if scratch is not flat else []))

    def _holding(self, pending: PendingWork, *buffers: Tensor) -> PendingWork:
        """`pending` holds `buffers`, allocated for it, until it is waited for: counted in
        `in_flight_bytes` and its high-water mark `peak_in_flight_bytes` (what `canzona.memory`
        prices as the reduce-scatter buffers)."""
        pending.held_bytes = sum(t.numel() * t.element_size() for t in buffers)
        self.in_flight_bytes += pending.held_bytes
        self.peak_in_flight_bytes = max(self.peak_in_flight_bytes, self.in_flight_bytes)
        return pending

    def all_gather_v(self, flat: Tensor, cuts: Sequence[int], name: str) -> PendingWork:
        """Every rank receives every segment of `flat` from its owner, in place: one broadcast per
        owner of its segment, straight from and into `flat`. No send or receive buffer is built
        (the all-to-all form needs a send buffer of dp copies, and allocating it cost more than
        the copy itself: `benchmarks/bench_runtime.py` prints the comparison)."""
        lengths = [b - a for a, b in zip(cuts, cuts[1:])]
        self.log.add("all-gather-v", self.name, name, [n * flat.element_size() for n in lengths])
        hand = Handoff()
        works = [dist.broadcast(hand(flat[cuts[r]:cuts[r + 1]]), self._owner(r), group=self.group, async_op=True)
                 for r in range(self.size) if lengths[r]]
        return PendingWork(self, works, f"all-gather of {name}", hand)

    def check_agreement(self, facts: dict[str, str], advice: Mapping[str, str] | None = None) -> None:
        """Every rank must run the same plan on the same model: compare digests before any other
        collective, so a mismatch is an error instead of a hang or silent corruption."""
        error = self.agreement_error(facts, advice)
        if error is not None:
            raise PlanError(error)

    def agreement_error(self, facts: dict[str, str], advice: Mapping[str, str] | None = None) -> str | None:
        """`check_agreement`'s verdict as a message (None: every rank agrees), for callers that must
        finish further collectives before raising; `advice`: what to do, by fact, where a
        disagreement over it has a remedy the message should give."""
        names = list(facts)  # in the order given: the most telling disagreement is reported first
        digest = [hashlib.sha256(facts[k].encode()).digest()[:8] for k in names]
        mine = torch.tensor([int.from_bytes(d, "little", signed=True) for d in digest], dtype=torch.int64)
        every = torch.empty(self.size * len(names), dtype=torch.int64, device=self.check_device)
        self._gather_single(every, mine.to(self.check_device), "plan agreement check")
        table = every.view(self.size, len(names)).cpu()
        for k, name in enumerate(names):
            column = table[:, k]
            if not torch.all(column == column[0]):
                ranks = [r for r in range(self.size) if column[r] != mine[k]]
                # every member finds this column (the table is the same on all): they show each
                # other what they hold, so that each error names both sides (a plan's cost model:
                # the GPU profile each rank planned with)
                # a digest of named parts (`PartsDigest`: the weights, by parameter) also shows its
                # parts, so that the error names the first that differs
                parts = getattr(facts[name], "parts", None)
                held = self.all_gather_object(_shown(facts[name]) if parts is None else (_shown(facts[name]), parts),
                                              f"{name} disagreement")
                first = ""
                if parts is not None:
                    theirs = dict(held[ranks[0]][1])
                    differs = next((n for n, d in parts if theirs.get(n) != d), None)
                    first = f"; the first that differs: {differs!r}" if differs is not None else ""
                    held = [h[0] for h in held]
                others: dict[str, list[int]] = {}
                for r in ranks:
                    others.setdefault(held[r], []).append(r)
                there = "; ".join(f"rank(s) {rs}: {value}" for value, rs in others.items())
                remedy = f": {advice[name]}" if advice and name in advice else ""
                return (f"ranks disagree on the {name}: rank {self.rank} differs from rank(s) {ranks} "
                        f"({name} {held[self.rank]} here; {there}{first}){remedy}")
        return None

    def spread_failure(self, error: str | None, name: str, failed_what: str, logged: bool = True) -> str | None:
        """Every member learns whether any member has an error (one small all-gather, logged as
        `name` unless not `logged`: construction's before its agreement check, which is not logged
        either): returns this rank's own error, or one naming the members that failed
        (`failed_what` says what they are), or None."""
        failed = self.all_gather_values(torch.tensor([int(error is not None)]), name, logged)[:, 0]
        if error is None and failed.any():
            ranks = [int(r) for r in torch.nonzero(failed).flatten()]
            return f"{failed_what.format(ranks=ranks)} (see their error)"
        return error

    def all_gather_values(self, values: Tensor, name: str, logged: bool = True) -> Tensor:
        """Every rank's copy of a small 1-D tensor, as a (ranks, n) table (identical on every rank),
        on the CPU. The values cross the group on the device its backend carries (a CUDA device
        under a NCCL-only group, which cannot carry CPU tensors)."""
        values = values.to(self.check_device)
        every = torch.empty(self.size * values.numel(), dtype=values.dtype, device=values.device)
        if logged:
            self.log.add("all-gather", self.name, name, [values.numel() * values.element_size()] * self.size)
        self._gather_single(every, values, name)
        return every.view(self.size, -1).cpu()

    def _gather_single(self, every: Tensor, values: Tensor, what: str) -> None:
        """Every member's `values` into `every`, in member order, waited for (not logged)."""
        hand = Handoff()
        # no local name for the work handle: PendingWork must hold the only one (see Handoff)
        check = PendingWork(self, dist.all_gather_single(hand(every), hand(values), group=self.group, async_op=True),
                            what, hand)
        check.host_reads = True
        check.wait()

    def all_gather_object(self, obj: Any, name: str) -> list[Any]:
        """Every rank's picklable `obj`, in rank order, within this group's timeout (unlike
        `dist.all_gather_object`, which waits for the process group's own, often 30 minutes)."""
        blob = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = self.all_gather_values(torch.tensor([blob.numel()], dtype=torch.int64), f"{name} sizes")[:, 0]
        longest = int(sizes.max())
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:blob.numel()] = blob
        table = self.all_gather_values(padded, name)
        return [pickle.loads(table[r, :int(sizes[r])].numpy().tobytes()) for r in range(self.size)]


class PartsDigest(str):
    """A fact that digests named parts (a checksum of the weights), with each part's own digest
    (`parts`: (name, digest) pairs): `Comm.agreement_error` names the first part that differs."""

    parts: tuple[tuple[str, str], ...] = ()


def _shown(fact: str) -> str:
    """A fact as an agreement error shows it: whole where short (a name), else its first 16
    characters (a digest's are enough to tell two apart)."""
    return fact if len(fact) <= 48 else fact[:16]


# How long `PendingWork.wait` waits for gloo to let go of a completed collective's tensors: it
# takes microseconds, the GIL handed over once; past this the step goes on (the run's results do
# not depend on it, only its clean exit) and the collective is counted in `Comm.unreleased`.
RELEASE_LIMIT_S = 2.0


class Handoff:
    """The tensors handed to one collective, as fresh aliases held here until the backend has let
    go of them, then freed on the calling thread.

    Why: gloo runs a collective on a worker thread, which drops its references to the collective's
    tensors just *after* completing it, so possibly after `wait()` has returned here. While C++
    holds a tensor that has a Python object, it holds a reference to that object too, and the
    thread whose drop leaves Python the only holder gives it back under the GIL
    (`intrusive_ptr::reset_` -> `TensorImpl::decref_pyobject`, torch 2.13); the thread that drops the
    last reference of all frees the object, which inside (`THPVariable_clear`) hands the GIL over
    and takes it once more. If the main thread reaches interpreter finalization first (a script's
    last `step()`, `destroy_process_group()`, return), the worker's taking of the GIL ends the
    thread (`pthread_exit`) and the forced unwind through the work's destructor (noexcept) aborts
    the process: SIGABRT, "terminate called without an active exception", after a successful run.
    `destroy_process_group()` does not prevent it: the default group outlives it whenever
    `torch.distributed.nn` was first imported after `init_process_group` (its functions take
    `group.WORLD` as a default argument; building any `torch.optim.Optimizer` imports it), so
    gloo's threads are never joined.

    So `release` waits until the worker is done with Python: C++ holds the alias no more (use count
    one, the Python object's own) *and* has given back its reference to the Python object (the
    object's reference count is this module's alone). The worker gives it back holding the GIL, so
    once the main thread sees it, the worker has left Python. The alias is then freed here.
    (Watching the aliases through weak references, as this did first, left about one run in a
    hundred aborting on a loaded 2-core machine: a weak reference dies while the worker frees the
    object, before it takes the GIL the second time. Reading the use count alone would leave the
    moment between the worker's decrement and its taking of the GIL.)

    CUDA tensors are handed over as they are: NCCL's `wait()` only orders streams, and waiting for
    its watchdog to drop them would synchronize the host with the GPU."""

    def __init__(self) -> None:
        self.aliases: list[Tensor] = []

    def __call__(self, t: Tensor) -> Tensor:
        if t.device.type != "cpu":
            return t
        alias = t.detach()  # the same storage; a tensor object that only this and the backend hold
        self.aliases.append(alias)
        return alias

    def held(self) -> bool:
        """Whether the backend still holds an alias, or still has to give back its reference to one."""
        return any(alias._use_count() > 1 or sys.getrefcount(alias) > _OWN_REFS for alias in self.aliases)

    def release(self, limit_s: float = RELEASE_LIMIT_S) -> bool:
        """After the collective completed and its work handle was dropped: wait until the backend
        is done with every alias, then free them (False: it was not after `limit_s` seconds; they
        are dropped all the same)."""
        pause, deadline = 1e-5, None
        while held := self.held():
            now = time.monotonic()
            deadline = now + limit_s if deadline is None else deadline
            if now > deadline:
                break
            time.sleep(pause)  # without the GIL: the worker takes it to give its reference back
            pause = min(2 * pause, 1e-3)
        self.aliases.clear()
        return not held


def _own_refs() -> int:
    """The reference count `Handoff.held` reads for an alias nothing else holds (its list, the
    generator's name, getrefcount's argument), measured the same way on a tensor C++ never held."""
    probe = Handoff()
    probe.aliases.append(torch.empty(0))
    return max(sys.getrefcount(alias) for alias in probe.aliases)


_OWN_REFS = _own_refs()


class PendingWork:
    """An in-flight collective; `wait()` completes it (and its local finishing step) and returns
    once the backend has let go of its tensors (`Handoff`)."""

    def __init__(self, comm: Comm, work, what: str, handoff: Handoff | None = None):
        self.comm = comm
        self.work = work
        self.what = what
        self.then = None
        self.done = False
        self.handoff = handoff
        self.held_bytes = 0  # buffers allocated for this collective, released when it is waited for
        self.host_reads = False  # the host reads the result right after: wait with the group's timeout

    def wait(self) -> None:
        if self.done:
            return
        self._wait_backend()
        if self.then is not None:
            self.then()
        self.done = True
        self.comm.in_flight_bytes -= self.held_bytes
        if self.handoff is not None and not self.handoff.release():
            self.comm.unreleased += 1
        self.handoff = None

    def _wait_backend(self) -> None:
        works = self.work if isinstance(self.work, list) else [self.work]
        for work in works:
            self.comm._wait(work, self.what, self.host_reads)
        # the work handles hold the tensors too: dropped (with this frame's references) before
        # `Handoff.release` waits for the backend's
        self.work = None


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """A small CPU tensor on `device` without a host sync: from page-locked memory, asynchronously,
    for a CUDA device (a copy from pageable memory waits for the stream first)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _check_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the small check and agreement tensors travel: the current CUDA device where the group
    has NCCL (`init_process_group("nccl")`, or a mixed `"cpu:gloo,cuda:nccl"` group, torch's recipe for
    `dcp.async_save` and torchtitan's with async checkpointing), else the CPU (gloo).

    On a mixed group every collective of canzona's then runs on NCCL, its gradients' backend: its
    checks never meet on gloo the collectives a background `dcp.async_save` runs there, which interleave
    with them in no agreed order (a timeout, an abort, or two same-sized exchanges swapped), and its
    data collectives are waited for on the stream, as under NCCL alone, not polled from the host."""
    backend = str(dist.get_backend(group)).lower()
    nccl = backend == "nccl" or any(part.strip() == "cuda:nccl" for part in backend.split(","))
    if nccl and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
