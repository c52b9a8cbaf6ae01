"""GPU streams, kernels and collectives as SimPy processes.

Streams keep CUDA semantics: work runs in the order it was enqueued, and an op waiting for an event
blocks its stream. Each op requests its stream when created (so requests queue in program order),
then waits for its dependencies while holding it. A collective starts when every participant has
reached it on its stream, pays its latency, then moves its bytes over the fabric.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import simpy

from sim.collectives import CollectiveCost
from sim.fabric import Fabric


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


class Collective:
    def __init__(self, engine: Engine, name: str, ranks: Sequence[int], cost: CollectiveCost):
        self.engine = engine
        self.name = name
        self.ranks = tuple(ranks)
        self.cost = cost
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
        if self.cost.latency_s > 0:
            yield env.timeout(self.cost.latency_s)
        if self.cost.transfer_s > 0:
            yield self.engine.fabric.transfer(self.links(), self.cost.transfer_s)
        if self.cost.local_s > 0:
            yield env.timeout(self.cost.local_s)
        self.done.succeed()


class Engine:
    def __init__(self, slowdown: float = 1.0) -> None:
        """`slowdown`: the factor on every phase A kernel's time, the expected slowest GPU's time
        over the median GPU's (canzona.variability): phase A is simulated on one rank standing for
        every rank, and a synchronous iteration runs at its slowest GPU's pace; 1: GPUs alike."""
        self.env = simpy.Environment()
        self.slowdown = slowdown
        self.fabric = Fabric(self.env)
        self._streams: dict[tuple[int, str], simpy.Resource] = {}
        self.spans: list[Span] = []
        self.end = 0.0  # when the last op ended (`run`)
        self.phase = "A"  # the phase of the ops created from now on (their spans say it)
        # (members, logged record or {member: record}) of collectives issued with a record, in
        # issue order: what a runtime collective log would show (sim.iteration, runtime mode)
        self.records: list[tuple[tuple[int, ...], Any]] = []

    @property
    def now(self) -> float:
        return self.env.now

    def stream(self, rank: int, name: str) -> simpy.Resource:
        key = (rank, name)
        if key not in self._streams:
            self._streams[key] = simpy.Resource(self.env, capacity=1)
        return self._streams[key]

    def compute(self, rank: int, name: str, seconds: float, after: Iterable[simpy.Event] = (),
                stream: str = "compute") -> simpy.Event:
        """A kernel of `seconds` on `rank`'s stream, after `after` fire (phase A's: `slowdown` times)."""
        if self.phase == "A" and self.slowdown != 1.0:
            seconds *= self.slowdown
        return self.env.process(self._compute(rank, stream, name, seconds, list(after), self.phase))

    def _compute(self, rank: int, stream: str, name: str, seconds: float, after: list[simpy.Event], phase: str):
        with self.stream(rank, stream).request() as req:
            yield req
            if after:
                yield self.env.all_of(after)
            start = self.env.now
            if seconds > 0:
                yield self.env.timeout(seconds)
            self._record(Span(rank, stream, name, "compute", start, self.env.now, phase))

    def collective(self, name: str, ranks: Sequence[int], cost: CollectiveCost, stream: str,
                   after: dict[int, Iterable[simpy.Event]] | None = None, record: Any = None) -> dict[int, simpy.Event]:
        """One collective over `ranks`, enqueued on each rank's `stream`; per-rank done events.
        `record`: what a runtime log would hold for it (one tuple, or one per member)."""
        if record is not None:
            self.records.append((tuple(ranks), record))
        coll = Collective(self, name, ranks, cost)
        after = after or {}
        return {r: self.env.process(self._participate(coll, r, stream, list(after.get(r, ())), self.phase))
                for r in ranks}

    def _participate(self, coll: Collective, rank: int, stream: str, after: list[simpy.Event], phase: str):
        with self.stream(rank, stream).request() as req:
            yield req
            if after:
                yield self.env.all_of(after)
            coll.arrive()
            yield coll.done
            self._record(Span(rank, stream, coll.name, "comm", coll.start, self.env.now, phase))

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
