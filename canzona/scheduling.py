"""Longest-processing-time-first assignment, shared by the DP and TP policies."""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def lpt_order(costs: Sequence[float]) -> list[int]:
    """Indices by cost descending, ties by index (deterministic)."""
    return sorted(range(len(costs)), key=lambda i: (-costs[i], i))


def lpt_assign(costs: Sequence[float], bins: int, loads: Sequence[float] | None = None) -> list[int]:
    """Assign each cost to the least-loaded bin in LPT order; ties go to the lowest bin index.

    `loads` are starting loads (carried over from earlier work); they are not modified.
    """
    heap = [(float(loads[b]) if loads is not None else 0.0, b) for b in range(bins)]
    heapq.heapify(heap)
    owner = [0] * len(costs)
    for i in lpt_order(costs):
        load, b = heapq.heappop(heap)
        owner[i] = b
        heapq.heappush(heap, (load + costs[i], b))
    return owner


def bin_loads(costs: Sequence[float], owner: Sequence[int], bins: int) -> list[float]:
    loads = [0.0] * bins
    for c, b in zip(costs, owner):
        loads[b] += c
    return loads
