"""Shared hypothesis strategies and independent checkers for the planner tests."""

from __future__ import annotations

import math
from collections.abc import Sequence

from hypothesis import strategies as st

from canzona.dp import DPItem
from canzona.spec import ModelSpec, ParamSpec, Role
from canzona.tp import TPTask

# Positive costs: mostly arbitrary floats, sometimes small integers so that ties are common.
costs = st.one_of(
    st.floats(min_value=1e-3, max_value=1e3, allow_nan=False, allow_infinity=False),
    st.integers(min_value=1, max_value=10).map(float),
)
alphas = st.one_of(st.just(0.0), st.just(1.0), st.floats(min_value=0.0, max_value=1.0))
aligns = st.sampled_from([1, 8, 64])


@st.composite
def dp_items(draw, min_items: int = 1, max_items: int = 40, max_numel: int = 5000,
             cost=costs) -> list[DPItem]:
    n = draw(st.integers(min_value=min_items, max_value=max_items))
    return [
        DPItem(f"p{i}", draw(st.integers(1, max_numel)), draw(cost), draw(st.integers(0, 10_000)))
        for i in range(n)
    ]


@st.composite
def bucket_sizes(draw, items: Sequence[DPItem]) -> int | None:
    """None (the default, one bucket for small instances) or a size >= the largest parameter,
    biased towards sizes that give several buckets."""
    largest = max(it.numel for it in items)
    total = sum(it.numel for it in items)
    return draw(st.one_of(
        st.none(),
        st.integers(min_value=largest, max_value=max(largest, total // 2)),
        st.integers(min_value=largest, max_value=max(largest, 2 * total)),
    ))


@st.composite
def dp_instances(draw):
    items = draw(dp_items())
    return {
        "items": items,
        "dp": draw(st.integers(1, 9)),
        "alpha": draw(alphas),
        "align": draw(aligns),
        "bucket_size": draw(bucket_sizes(items)),
    }


@st.composite
def tp_tasks_by_rank(draw, max_ranks: int = 4, max_tasks: int = 25):
    ranks = draw(st.integers(1, max_ranks))
    out, k = [], 0
    for _ in range(ranks):
        n = draw(st.integers(0, max_tasks))
        rank = []
        for _ in range(n):
            rank.append(TPTask(f"t{k}", draw(costs), draw(st.integers(1, 10_000))))
            k += 1
        out.append(rank)
    return out


def overlap(a: int, b: int, lo: int, hi: int) -> int:
    """Length of [a, b) intersected with [lo, hi)."""
    return max(0, min(b, hi) - max(a, lo))


def optimal_makespan(costs: Sequence[float], bins: int) -> float:
    """Exact minimum makespan of assigning whole jobs to `bins` identical machines
    (branch and bound; fine for a dozen jobs)."""
    jobs = sorted(costs, reverse=True)
    if not jobs:
        return 0.0
    lb = max(sum(jobs) / bins, jobs[0])
    # Start from LPT as the incumbent.
    loads = [0.0] * bins
    for c in jobs:
        loads[loads.index(min(loads))] += c
    best = [max(loads)]
    loads = [0.0] * bins

    def rec(i: int) -> None:
        if best[0] <= lb * (1 + 1e-12):
            return
        if i == len(jobs):
            best[0] = min(best[0], max(loads))
            return
        tried = set()
        for r in range(bins):
            if loads[r] in tried:
                continue  # symmetric to a machine already tried
            tried.add(loads[r])
            if loads[r] + jobs[i] >= best[0]:
                continue
            loads[r] += jobs[i]
            rec(i + 1)
            loads[r] -= jobs[i]

    rec(0)
    return best[0]


def close(a: float, b: float, rel: float = 1e-9) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-9)


@st.composite
def models(draw) -> tuple[ModelSpec, int]:
    """A small decoder-like model whose TP-split dimensions are multiples of the drawn TP size."""
    tp = draw(st.sampled_from([1, 2, 4]))
    layers = draw(st.integers(1, 4))
    hidden = tp * draw(st.integers(1, 24))
    params = [ParamSpec("embed", (tp * draw(st.integers(1, 40)), hidden), Role.EMBEDDING, None, tp_dim=0)]
    for i in range(layers):
        params.append(ParamSpec(f"l{i}.norm", (hidden,), Role.VECTOR, i))
        if draw(st.booleans()):  # a 0-d scalar (a ReZero gate): one element, AdamW's, never split
            params.append(ParamSpec(f"l{i}.gate", (), Role.VECTOR, i))
        for k in range(draw(st.integers(1, 4))):
            col = draw(st.booleans())
            rows = tp * draw(st.integers(1, 48)) if col else draw(st.integers(1, 64))
            cols = draw(st.integers(1, 64)) if col else tp * draw(st.integers(1, 48))
            params.append(ParamSpec(f"l{i}.w{k}", (rows, cols), Role.MATRIX, i, tp_dim=0 if col else 1))
    return ModelSpec("random", tuple(params)), tp
