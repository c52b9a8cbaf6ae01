"""GPU streams, kernels and collectives as SimPy processes.

Streams keep CUDA semantics: work runs in the order it was enqueued, and an op waiting for an event
blocks its stream. Each op, when created, is chained after the op enqueued on its stream before it
(so ops run in program order), then waits for its dependencies, the stream's later ops behind it
(a chain of processes rather than a SimPy resource each op requests, and no condition event per
op: the same order and results, in less time, `benchmarks/bench_sim.py --streams`). A collective
starts when every participant has reached it on its stream, pays its latency, then moves its bytes
over the fabric.

SMs are shared (docs/design.md §9.1): a communication kernel holds SMs from its start to its end
(`sim.comm_sms`: NCCL's channels, or a userbuffers kernel's `num_sm`), and a compute kernel on the
same GPU runs at `(sms - held) / sms` of its rate meanwhile, re-settled whenever a communication
kernel starts or ends on that GPU (the fluid accounting `sim.fabric` uses for links). An engine
made with `sms=0` leaves compute at full rate.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import simpy

from sim.collectives import CollectiveCost
from sim.comm_sms import nccl_sms
from sim.fabric import Fabric


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside (as it was, after): for a simulation
    (`sim.simulate.simulate`). A run allocates millions of short-lived SimPy events and processes,
    and keeps its spans; each allocation burst sets off collections that walk every live object,
    the spans included, and free none of them (the engine's garbage goes when its last reference
    does: the same peak memory with the collector off, 448 MB on the Llama 3.1 405B row), so the
    collector took about 40% of a long run's time (`benchmarks/bench_sim.py --streams`)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@dataclass(frozen=True)
class Span:
    """Something a rank's stream did: `kind` is "compute" or "comm"."""

    rank: int
    stream: str
    name: str
    kind: str
    start: float
    end: float
    phase: str = "A"  # "A": forward, backward, gradient sync; "B": the optimizer step (sim.iteration)


def _after(prev: simpy.Event | None, after: list[simpy.Event]):
    """Wait for the stream's previous op and then each of `after`: the op starts when the last of
    them has fired, as under `all_of`, without a condition event (an event already processed
    resumes the wait at once)."""
    if prev is not None:
        yield prev
    for event in after:  # noqa: UP028 (`yield from after` would send SimPy's values into a list iterator)
        yield event


class _Kernel:
    """A compute kernel in flight: `remaining` full-rate seconds as of `since`, moving at `rate`;
    `margin`: the SMs it was launched without (`Engine.compute`)."""

    __slots__ = ("remaining", "rate", "since", "proc", "margin")

    def __init__(self, seconds: float, rate: float, now: float, proc: simpy.Process, margin: int = 0):
        self.remaining = seconds
        self.rate = rate
        self.since = now
        self.proc = proc
        self.margin = margin


class Collective:
    def __init__(self, engine: Engine, name: str, ranks: Sequence[int], cost: CollectiveCost, sms: int = 0):
        self.engine = engine
        self.name = name
        self.ranks = tuple(ranks)
        self.cost = cost
        self.sms = sms  # SMs its kernel holds on each member while it runs
        self.arrived = 0
        self.start: float | None = None
        self.done = engine.env.event()

    def links(self) -> list[str]:
        prefix = "nic" if self.cost.link == "network" else "nvl"
        return [f"{prefix}:{r}" for r in self.ranks]

    def arrive(self) -> None:
        self.arrived += 1
        if self.arrived == len(self.ranks):
            self.engine.env.process(self._run())

    def _run(self):
        env = self.engine.env
        self.start = env.now
        if self.sms:
            self.engine.hold(self.ranks, self.sms)
        if self.cost.latency_s > 0:
            yield env.timeout(self.cost.latency_s)
        if self.cost.transfer_s > 0:
            yield self.engine.fabric.transfer(self.links(), self.cost.transfer_s)
        if self.cost.local_s > 0:
            yield env.timeout(self.cost.local_s)
        if self.sms:
            self.engine.hold(self.ranks, -self.sms)
        self.done.succeed()


class Engine:
    def __init__(self, slowdown: float = 1.0, sms: int = 0,
                 comm_sms: Callable[[CollectiveCost, int], int] = nccl_sms) -> None:
        """`slowdown`: the factor on every phase A kernel's time, the expected slowest GPU's time
        over the median GPU's (canzona.variability): phase A is simulated on one rank standing for
        every rank, and a synchronous iteration runs at its slowest GPU's pace; 1: GPUs alike.
        `sms`: the GPU's SMs (0: communication takes none from compute); `comm_sms`: the SMs
        a collective's kernel holds, by its cost and its members, where the caller does not say."""
        self.env = simpy.Environment()
        self.slowdown = slowdown
        self.sms = sms
        self.comm_sms = comm_sms
        self._held: dict[int, int] = {}  # rank -> SMs held by its running communication kernels
        # rank -> its compute kernels in flight, oldest first (a list: a set's order, and so the
        # order of same-time events, would vary between runs)
        self._kernels: dict[int, list[_Kernel]] = {}
        self.fabric = Fabric(self.env)
        # (rank, stream) -> the process of the op last enqueued on it: the next op starts after it
        # ends (a CUDA stream runs its work in the order it was enqueued, one op at a time)
        self._tails: dict[tuple[int, str], simpy.Process] = {}
        self.spans: list[Span] = []
        self.end = 0.0  # when the last op ended (`run`)
        self.phase = "A"  # the phase of the ops created from now on (their spans say it)
        # (members, logged record or {member: record}) of collectives issued with a record, in
        # issue order: what a runtime collective log would show (sim.iteration, runtime mode)
        self.records: list[tuple[tuple[int, ...], Any]] = []

    @property
    def now(self) -> float:
        return self.env.now

    def _enqueue(self, rank: int, stream: str, proc_of: Callable[[simpy.Process | None], Any]) -> simpy.Process:
        """The op `proc_of(previous)` enqueued on `rank`'s `stream`: its process, after which the
        stream's next op starts; `previous`, the op before it (None: the stream was empty)."""
        key = (rank, stream)
        proc = self.env.process(proc_of(self._tails.get(key)))
        self._tails[key] = proc
        return proc

    def compute(self, rank: int, name: str, seconds: float, after: Iterable[simpy.Event] = (),
                stream: str = "compute", margin: int = 0) -> simpy.Event:
        """A kernel of `seconds` on `rank`'s stream, after `after` fire (phase A's: `slowdown` times);
        `margin`: SMs it is launched without, left to a communication kernel (Transformer Engine's
        `set_sm_margin`, sim.comm_sms), so it runs at `(sms - margin - held) / sms` of its rate."""
        if self.phase == "A" and self.slowdown != 1.0:
            seconds *= self.slowdown
        after, phase = list(after), self.phase
        return self._enqueue(rank, stream,
                             lambda prev: self._compute(rank, stream, name, seconds, prev, after, phase, margin))

    def _compute(self, rank: int, stream: str, name: str, seconds: float, prev: simpy.Process | None,
                 after: list[simpy.Event], phase: str, margin: int = 0):
        yield from _after(prev, after)
        start = self.env.now
        if seconds > 0:
            if self.sms:  # at the rate the SMs left give it, re-rated by `hold` (inline: the hot path)
                k = _Kernel(seconds, self._rate(rank, margin), start, self.env.active_process, margin)
                running = self._kernels.setdefault(rank, [])
                running.append(k)
                while True:
                    try:
                        yield self.env.timeout(k.remaining / k.rate)
                        break
                    except simpy.Interrupt:  # `hold` changed the rate and settled `remaining`
                        continue
                running.remove(k)
            else:
                yield self.env.timeout(seconds)
        self._record(Span(rank, stream, name, "compute", start, self.env.now, phase))

    def _rate(self, rank: int, margin: int = 0) -> float:
        """Compute rate on `rank` of a kernel launched without `margin` SMs: the share of SMs
        neither the margin nor a communication kernel holds (one at least)."""
        held = self._held.get(rank, 0) + margin
        return max(self.sms - held, 1) / self.sms if held else 1.0

    def hold(self, ranks: Sequence[int], sms: int) -> None:
        """A communication kernel holding `sms` SMs (negative: releasing them) starts on `ranks`:
        settle each rank's compute kernels at their old rate and reschedule them at the new one."""
        now = self.env.now
        for r in ranks:
            self._held[r] = self._held.get(r, 0) + sms
            kernels = self._kernels.get(r)
            if not kernels:
                continue
            for k in kernels:
                rate = self._rate(r, k.margin)
                if k.rate != rate:
                    k.remaining = max(0.0, k.remaining - (now - k.since) * k.rate)
                    k.since = now
                    k.rate = rate
                    k.proc.interrupt()

    def collective(self, name: str, ranks: Sequence[int], cost: CollectiveCost, stream: str,
                   after: dict[int, Iterable[simpy.Event]] | None = None, record: Any = None,
                   sms: int | None = None, members: int | None = None) -> dict[int, simpy.Event]:
        """One collective over `ranks`, enqueued on each rank's `stream`; per-rank done events.
        `record`: what a runtime log would hold for it (one tuple, or one per member); `sms`: the
        SMs its kernel holds (default: NCCL's, `comm_sms`; 0 for copy-engine transfers);
        `members`: the size of the group it is priced for, where `ranks` are only its simulated
        members (`sim.classes`; default: `ranks`)."""
        if record is not None:
            self.records.append((tuple(ranks), record))
        coll = self.rendezvous(name, ranks, cost, sms, members)
        after = after or {}
        return {r: self.join(coll, r, stream, after.get(r, ())) for r in ranks}

    def rendezvous(self, name: str, ranks: Sequence[int], cost: CollectiveCost, sms: int | None = None,
                   members: int | None = None) -> Collective:
        """A collective over `ranks` whose members each enqueue their part with `join`, each where
        its own program reaches it (a point-to-point transfer: the sender's kernel and the
        receiver's, on a stream the two directions of a pair may share, sim.pipeline_p2p).
        `members`: as `collective`'s (a kernel's channels follow its whole group's peers)."""
        size = len(ranks) if members is None else members
        held = 0 if not self.sms else (self.comm_sms(cost, size) if sms is None else sms)
        return Collective(self, name, ranks, cost, held)

    def join(self, coll: Collective, rank: int, stream: str, after: Iterable[simpy.Event] = ()) -> simpy.Event:
        """`rank`'s part of `coll`, enqueued now on its `stream` after `after`; done with the collective."""
        after, phase = list(after), self.phase
        return self._enqueue(rank, stream, lambda prev: self._participate(coll, rank, stream, prev, after, phase))

    def _participate(self, coll: Collective, rank: int, stream: str, prev: simpy.Process | None,
                     after: list[simpy.Event], phase: str):
        yield from _after(prev, after)
        coll.arrive()
        yield coll.done
        self._record(Span(rank, stream, coll.name, "comm", coll.start, self.env.now, phase))

    def stream_wait(self, rank: int, stream: str, after: Iterable[simpy.Event]) -> simpy.Event:
        """`rank`'s `stream` waits for `after` (CUDA's `cudaStreamWaitEvent`, what PyTorch's
        `Event.wait(stream)` and `Work.wait()` enqueue): the ops enqueued on it later start once
        those have fired. No span; the event: when the stream has reached this point."""
        after = list(after)
        return self._enqueue(rank, stream, lambda prev: _after(prev, after))

    def host_sync(self, rank: int, after: Iterable[simpy.Event], delay: float) -> simpy.Event:
        """`torch.cuda.synchronize()` called by `rank`'s host once `after` has fired: the host waits
        until every stream it has given work to is done, then goes on issuing. The event fires
        `delay` later, when the first kernel it then issues can start (the GPU idles while the host
        resumes; `delay`: one launch, as `sim.ep_dispatch` prices a host synchronisation)."""
        tails = [proc for (r, _), proc in self._tails.items() if r == rank]
        return self.env.process(self._host_sync([*after, *tails], delay))

    def _host_sync(self, events: list[simpy.Event], delay: float):
        yield from _after(None, events)
        if delay > 0:
            yield self.env.timeout(delay)

    def _record(self, span: Span) -> None:
        self.spans.append(span)
        self.end = max(self.end, span.end)

    def run(self) -> float:
        """Run every op; the time the last one ended. Not the clock's final time: a transfer whose
        rate changed (`Fabric._reshape`) leaves its interrupted timeout in SimPy's queue, where it
        still fires, later and doing nothing, and would move the clock past the iteration's end."""
        self.env.run()
        return self.end


def issued_records(records: Sequence[tuple[tuple[int, ...], Any]], rank: int) -> list[tuple]:
    """Of `Engine.records`, those of the collectives `rank` took part in, in issue order."""
    out = []
    for ranks, record in records:
        if rank in ranks:
            out.append(record[rank] if isinstance(record, dict) else record)
    return out
