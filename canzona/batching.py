"""Which matrices a host runs as one batched kernel (`batch_kernels`, docs/design.md §8.7).

Pure, no torch: the runtime's executor (`canzona.runtime.executor`) batches by these rules, and the
simulator (its compute time) and the memory model (its workspace) read the same ones.

- A compute window is one micro-group; where the schedule moves nothing (no gather or scatter in
  any group: TP 1, where every matrix is its own group), consecutive groups join up to
  `MAX_BATCH_NUMEL` hosted elements, since there is no collective to overlap with compute.
- Inside a window, matrices with the same batch key (shape, dtype and layout, state layout,
  hyper-parameters; the model's side: the shape) run as one batch, in first-seen order, at most
  `MAX_BATCH_NUMEL` elements a batch.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

# The most elements a batch (and a TP-1 window) stacks: beyond it a GEMM fills the device alone,
# and batching would only multiply the working memory (the stacks and Newton-Schulz's temporaries
# are k matrices each)
MAX_BATCH_NUMEL = 1 << 24


def batches(items: Iterable[tuple[Any, Hashable | None, int]], max_numel: int = MAX_BATCH_NUMEL) -> list[list[Any]]:
    """Split (item, key, numel) triples into batches, in first-seen order: equal keys together
    (None: alone), at most `max_numel` elements a batch (at least one item)."""
    out: list[list[Any]] = []
    open_runs: dict[Hashable, tuple[list[Any], list[int]]] = {}  # key -> (its last batch, [its numel])
    for item, key, numel in items:
        run = open_runs.get(key) if key is not None else None
        if run is not None and run[1][0] + numel <= max_numel:
            run[0].append(item)
            run[1][0] += numel
            continue
        out.append([item])
        if key is not None:
            open_runs[key] = (out[-1], [numel])
    return out


def compute_windows(groups: Sequence[Any], tp_rank: int, batched: bool,
                    max_numel: int = MAX_BATCH_NUMEL) -> dict[int, tuple[int, ...]]:
    """The schedule's groups (`step_schedule.GroupStep`) computed together, keyed by the group whose
    COMPUTE op computes them: each alone, except with `batched` where no group moves anything."""
    if not batched or any(g.gather is not None or g.scatter is not None for g in groups):
        return {i: (i,) for i in range(len(groups))}
    windows: dict[int, tuple[int, ...]] = {}
    start, numel = 0, 0
    for i, step in enumerate(groups):
        size = sum(math.prod(t.shape) for t in step.hosted(tp_rank))
        if i == 0 or numel + size > max_numel:
            start, numel = i, 0
        windows[start] = windows.get(start, ()) + (i,)
        numel += size
    return windows


def shape_batches(tasks: Iterable[Any], batched: bool, max_numel: int = MAX_BATCH_NUMEL) -> list[list[Any]]:
    """Tasks (`step_schedule.Task`) of one window as the model batches them: by shape."""
    items = [(t, tuple(t.shape) if batched else None, math.prod(t.shape)) for t in tasks]
    return batches(items, max_numel)


__all__ = ["MAX_BATCH_NUMEL", "batches", "compute_windows", "shape_batches"]
