"""Phase B's classes of identical ranks (docs/design.md §9.8): how 16384 GPUs simulate in seconds.

The optimizer step differs between DP ranks only through what each one's step does: its TP
schedule (which matrices its TP group computes, where, and which buckets they wait for), its
share of the gradient norm, its AdamW elements; under expert parallelism the same of its EDP rank.
At DP 2048 most DP ranks own no matrix at all, and the others fall into a few kinds: the step is
simulated once per kind, not once per rank.

Ranks are grouped in *units*: runs of `L = lcm(tp, ep x etp)` consecutive ranks of a stage, the
smallest blocks that hold whole TP groups (the dense part's DP ranks) and whole EP x ETP blocks
(the expert part's EDP ranks). Shifting a unit onto another by a multiple of `L` keeps every rank's
TP (and EP, ETP) position, so its DP (EDP) groups' position: two units whose DP and EDP ranks have
equal steps run the same program at the same moments, on links that see the same traffic. One unit
of each class is simulated; a DP (EDP) collective runs on its simulated members only (priced for
its whole group, it starts when its last member arrives, which a simulated one stands for), and
the other units' results are the simulated unit's (`RankSpans`, `sim.simulate.timing`). Each
stage's unit 0 holds the rank phase A is simulated on, whose streams and links carry phase A's work
too: it is always a class of its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from sim.engine import Span


@dataclass(frozen=True)
class StepClasses:
    """One stage's units (`unit` ranks each, from rank `first`) and, per unit, the unit simulated
    for it (itself when it is simulated)."""

    first: int
    unit: int
    of_unit: tuple[int, ...]

    @classmethod
    def every_rank(cls, first: int, ranks: int, unit: int = 1) -> StepClasses:
        """No classes: every rank simulated (runtime mode's per-rank records, phase A on every rank)."""
        return cls(first, unit, tuple(range(ranks // unit)))

    @property
    def ranks(self) -> list[int]:
        """The simulated ranks, in rank order."""
        return [self.first + u * self.unit + k for u, rep in enumerate(self.of_unit) if rep == u
                for k in range(self.unit)]

    def rep(self, rank: int) -> int:
        """The simulated rank whose step `rank`'s is."""
        u, k = divmod(rank - self.first, self.unit)
        return self.first + self.of_unit[u] * self.unit + k

    @property
    def classes(self) -> int:
        return sum(rep == u for u, rep in enumerate(self.of_unit))


class RankSpans(Sequence[Span]):
    """Phase A's spans and the simulated ranks' phase B spans, expanded on first use with a copy of
    its representative's phase B spans for every other rank (16384 GPUs: hundreds of thousands of
    spans that a run not writing a trace never reads)."""

    def __init__(self, spans: Sequence[Span], copies: dict[int, list[int]]) -> None:
        self._spans = tuple(spans)
        self._copies = {rep: ranks for rep, ranks in copies.items() if ranks}  # representative -> the ranks it stands for
        self._all: tuple[Span, ...] | None = None if self._copies else self._spans

    @property
    def simulated(self) -> tuple[Span, ...]:
        """The spans the engine made: phase A's, and phase B's of the simulated ranks."""
        return self._spans

    def _expanded(self) -> tuple[Span, ...]:
        if self._all is None:
            mine: dict[int, list[Span]] = {}
            for s in self._spans:
                if s.phase == "B" and s.rank in self._copies:
                    mine.setdefault(s.rank, []).append(s)
            out = list(self._spans)
            for rep, ranks in self._copies.items():
                spans = mine.get(rep, [])
                for r in ranks:
                    out += [Span(r, s.stream, s.name, s.kind, s.start, s.end, s.phase) for s in spans]
            self._all = tuple(out)
        return self._all

    def __len__(self) -> int:
        return len(self._expanded())

    def __getitem__(self, index: Any) -> Any:
        return self._expanded()[index]

    def __iter__(self) -> Iterator[Span]:
        return iter(self._expanded())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RankSpans | tuple | list):
            return self._expanded() == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RankSpans({len(self)} spans)"
