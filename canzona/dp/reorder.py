"""Owner assignment for `alpha-balanced-reorder`: LPT with per-bucket segment caps, then local search.

Because the layout inside a bucket is free, the only coupling between buckets is the running load
of each rank, so this is multiprocessor scheduling with one side constraint: rank r's share of
bucket b may not exceed `cap_b` elements. LPT (global cost order, loads carried across buckets)
gives the start; moves and swaps of single matrices off the most loaded rank improve it, and where
two or three ranks hold few matrices between them their union is re-split exactly.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from itertools import combinations

import numpy as np

from canzona.dp.layout import DPItem

# Re-split k ranks exactly (k**n assignments) when they hold at most this many matrices together.
EXACT_RESPLIT_LIMITS = {2: 12, 3: 11, 4: 10}
RESPLIT_CANDIDATES = 6  # partners tried: the least loaded ranks
MAX_ROUNDS = 10_000


def segment_caps(buckets: Sequence[Sequence[DPItem]], dp: int, alpha: float) -> list[float]:
    """Per-bucket segment cap `(numel / dp) * dp**alpha`; alpha = 1 means no cap."""
    if alpha >= 1.0:
        return [float("inf")] * len(buckets)
    return [sum(it.numel for it in b) / dp * dp**alpha for b in buckets]


class _State:
    """Assignment of every matrix with per-rank loads and per-(bucket, rank) segment lengths."""

    def __init__(self, buckets: Sequence[Sequence[DPItem]], dp: int, alpha: float):
        self.dp = dp
        self.bucket = np.array([bi for bi, b in enumerate(buckets) for _ in b], dtype=np.int64)
        self.cost = np.array([it.cost for b in buckets for it in b], dtype=np.float64)
        self.numel = np.array([it.numel for b in buckets for it in b], dtype=np.int64)
        self.cap = np.array(segment_caps(buckets, dp, alpha), dtype=np.float64)
        self.capped = bool(np.isfinite(self.cap).any())
        self.owner = np.full(len(self.cost), -1, dtype=np.int64)
        self.loads = np.zeros(dp)
        self.seg = np.zeros((len(buckets), dp), dtype=np.int64)

    def assign(self, i: int, r: int) -> None:
        old = self.owner[i]
        if old >= 0:
            self.loads[old] -= self.cost[i]
            self.seg[self.bucket[i], old] -= self.numel[i]
        self.owner[i] = r
        self.loads[r] += self.cost[i]
        self.seg[self.bucket[i], r] += self.numel[i]

    def fits(self, i: int, r: int, leaving: int = -1) -> bool:
        """Whether rank r can take matrix i (optionally while matrix `leaving` moves off r)."""
        if not self.capped:
            return True
        b = self.bucket[i]
        room = self.cap[b] - self.seg[b, r]
        if leaving >= 0 and self.bucket[leaving] == b:
            room += self.numel[leaving]
        return self.numel[i] <= room

    def lpt(self) -> None:
        order = sorted(range(len(self.cost)), key=lambda i: (-self.cost[i], self.bucket[i], i))
        for i in order:
            ranks = np.argsort(self.loads, kind="stable")
            target = next((int(r) for r in ranks if self.fits(i, int(r))), None)
            if target is None:  # nothing fits under the cap: the shortest segment takes it
                target = int(np.argmin(self.seg[self.bucket[i]]))
            self.assign(i, target)


def _try_move(s: _State, top: int, eps: float) -> bool:
    """Move one matrix off the most loaded rank to where it lowers the pair's maximum most."""
    best, best_peak = None, s.loads[top] - eps
    for i in np.flatnonzero(s.owner == top):
        for r in range(s.dp):
            if r == top or not s.fits(i, r):
                continue
            peak = max(s.loads[top] - s.cost[i], s.loads[r] + s.cost[i])
            if peak < best_peak:
                best, best_peak = (int(i), r), peak
    if best is None:
        return False
    s.assign(*best)
    return True


def _try_swap(s: _State, top: int, eps: float) -> bool:
    """Swap a matrix on the most loaded rank with a cheaper one elsewhere."""
    others = np.flatnonzero(s.owner != top)
    if others.size == 0:
        return False
    best, best_peak = None, s.loads[top] - eps
    for i in np.flatnonzero(s.owner == top):
        delta = s.cost[i] - s.cost[others]
        peak = np.maximum(s.loads[top] - delta, s.loads[s.owner[others]] + delta)
        ok = (delta > 0) & (peak < best_peak)
        for k in np.flatnonzero(ok)[np.argsort(peak[ok], kind="stable")]:
            j = int(others[k])
            r = int(s.owner[j])
            if s.fits(i, r, leaving=j) and s.fits(j, top, leaving=int(i)):
                best, best_peak = (int(i), j, r), float(peak[k])
                break
    if best is None:
        return False
    i, j, r = best
    s.assign(i, r)
    s.assign(j, top)
    return True


@functools.cache
def _labels(ways: int, n: int) -> np.ndarray:
    """Every assignment of `n` matrices to `ways` ranks, one a row (the first matrix's rank varying
    fastest): made once for each size the local search meets, which it meets round after round."""
    labels = ((np.arange(ways**n)[:, None] // ways ** np.arange(n)) % ways).astype(np.int8)
    labels.flags.writeable = False
    return labels


def _best_split(costs: np.ndarray, ways: int) -> tuple[float, np.ndarray]:
    """Optimal assignment of `costs` (float64) to `ways` ranks by enumeration: (makespan, rank of
    each, read-only). The same few unions recur round after round and plan after plan (a search
    met 31 distinct ones in 2,341 calls, each up to 4**10 rows): each is enumerated once."""
    return _best_split_of(np.ascontiguousarray(costs, dtype=np.float64).tobytes(), ways)


@functools.lru_cache(maxsize=4096)
def _best_split_of(raw: bytes, ways: int) -> tuple[float, np.ndarray]:
    costs = np.frombuffer(raw, dtype=np.float64).copy()  # a fresh array, as the caller's indexing made
    labels = _labels(ways, costs.size)
    loads = np.stack([(labels == q) @ costs for q in range(ways)], axis=1)
    peaks = loads.max(axis=1)
    best = int(np.argmin(peaks))
    return float(peaks[best]), labels[best]


def _try_exact_resplit(s: _State, top: int, eps: float) -> bool:
    """Re-split the matrices of the most loaded rank together with one, two, then three of the least
    loaded ranks, optimally, when they hold few matrices between them (no caps). Pairs catch most
    local optima; some need three or more ranks to change at once (e.g. 2,5,5,6,6,11 on three)."""
    if s.capped:
        return False
    others = [int(r) for r in np.argsort(s.loads, kind="stable") if int(r) != top][:RESPLIT_CANDIDATES]
    for ways, limit in EXACT_RESPLIT_LIMITS.items():
        for partners in combinations(others, ways - 1):
            ranks = (top, *partners)
            union = np.flatnonzero(np.isin(s.owner, ranks))
            if union.size > limit:
                continue
            # no split of the union peaks below its mean per rank or its largest matrix: when that is
            # already the top rank's load, the enumeration (up to 4**10 rows) cannot help
            if max(s.cost[union].sum() / ways, s.cost[union].max()) >= s.loads[top] - eps:
                continue
            peak, labels = _best_split(s.cost[union], ways)
            if peak < s.loads[top] - eps:
                for k, i in enumerate(union):
                    s.assign(int(i), ranks[int(labels[k])])
                return True
    return False


def reorder_assign(buckets: Sequence[Sequence[DPItem]], dp: int, alpha: float) -> list[list[int]]:
    """Owner of every matrix, per bucket."""
    s = _State(buckets, dp, alpha)
    if len(s.cost) == 0:
        return [[] for _ in buckets]
    s.lpt()
    eps = 1e-12 * max(float(s.cost.max()), 1e-300)
    for _ in range(MAX_ROUNDS):
        top = int(np.argmax(s.loads))
        if not (_try_move(s, top, eps) or _try_swap(s, top, eps) or _try_exact_resplit(s, top, eps)):
            break
    out, k = [], 0
    for b in buckets:
        out.append([int(r) for r in s.owner[k:k + len(b)]])
        k += len(b)
    return out
