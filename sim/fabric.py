"""Links shared by concurrent transfers (fluid model on SimPy).

A transfer needs `work_s` seconds at full rate over a set of links. A link carrying `k` transfers
gives each `1/k` of its bandwidth; a transfer moves at the rate of its most crowded link. Whenever a
transfer starts or ends, the transfers sharing a link with it are settled at their old rate and
rescheduled at the new one.
"""

from __future__ import annotations

from collections.abc import Iterable

import simpy


class _Flow:
    __slots__ = ("links", "remaining", "rate", "since", "done", "proc")

    def __init__(self, links: tuple[str, ...], work_s: float, now: float, done: simpy.Event):
        self.links = links
        self.remaining = work_s
        self.rate = 1.0
        self.since = now
        self.done = done
        self.proc: simpy.Process | None = None


class Fabric:
    def __init__(self, env: simpy.Environment):
        self.env = env
        self._on: dict[str, set[_Flow]] = {}

    def transfer(self, links: Iterable[str], work_s: float) -> simpy.Event:
        """An event that fires when `work_s` full-rate seconds have crossed `links`."""
        done = self.env.event()
        links = tuple(sorted(set(links)))
        if work_s <= 0 or not links:
            done.succeed()
            return done
        flow = _Flow(links, work_s, self.env.now, done)
        for link in links:
            self._on.setdefault(link, set()).add(flow)
        self._reshape(self._neighbours(flow))
        flow.proc = self.env.process(self._run(flow))
        return done

    def active(self, link: str) -> int:
        return len(self._on.get(link, ()))

    def _neighbours(self, flow: _Flow) -> set[_Flow]:
        out: set[_Flow] = set()
        for link in flow.links:
            out |= self._on.get(link, set())
        return out

    def _rate(self, flow: _Flow) -> float:
        return min(1.0 / len(self._on[link]) for link in flow.links)

    def _reshape(self, flows: set[_Flow]) -> None:
        now = self.env.now
        for f in flows:
            f.remaining = max(0.0, f.remaining - (now - f.since) * f.rate)
            f.since = now
            new_rate = self._rate(f)
            if new_rate != f.rate:
                f.rate = new_rate
                if f.proc is not None and f.proc.is_alive and f.proc is not self.env.active_process:
                    f.proc.interrupt()

    def _run(self, flow: _Flow):
        while True:
            try:
                yield self.env.timeout(flow.remaining / flow.rate)
                break
            except simpy.Interrupt:
                continue
        flow.remaining = 0.0
        for link in flow.links:
            peers = self._on[link]
            peers.discard(flow)
            if not peers:
                del self._on[link]
        self._reshape({f for link in flow.links for f in self._on.get(link, ())})
        flow.done.succeed()
