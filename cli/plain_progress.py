"""Progress as plain lines, for a stderr that is not a terminal (a pipe, a CI log, `nohup`): rich's
bar hides itself there, so a long command (a search of minutes) would print nothing until it ends.
A line at most every `EVERY_S` seconds shows the run alive and how far it is without filling a log."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

EVERY_S = 30.0  # seconds between two lines: a log line per half minute, not per simulation


@dataclass
class PlainProgress:
    """`__call__(done, total, best)` as a search reports each simulation: one line on stderr
    (`name: done of total simulated, elapsed; best so far ...`) when `every_s` has passed since the
    last one, or since the start."""

    name: str
    every_s: float
    clock: Callable[[], float] = time.monotonic
    _start: float = field(init=False)
    _last: float = field(init=False)

    def __post_init__(self) -> None:
        self._start = self._last = self.clock()

    def __call__(self, done: int, total: int, best_s: float | None) -> None:
        now = self.clock()
        if now - self._last < self.every_s:
            return
        self._last = now
        best = "" if best_s is None else f"; best so far {best_s:.4g} s an iteration"
        # sys.stderr as it is now: a test's runner swaps it in after this object is made
        print(f"{self.name}: {done} of {total} simulated, {now - self._start:.0f} s{best}", file=sys.stderr,
              flush=True)
