"""ZeRO-1 gradient-buffer geometry: buckets, parameter placements, rank segments, plan metrics.

A bucket is a contiguous range of the flat gradient buffer. Its reduce-scatter gives rank `r` the
segment `[cuts[r], cuts[r+1])`: segments are contiguous, in rank order, and cover the bucket, which
is what keeps ZeRO-1's communication geometry. A policy decides the parameter order inside each
bucket, the cut points, and the owner (the DP rank that computes the full-matrix update).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

from canzona.choices import check_choice
from canzona.errors import SpecError


@dataclass(frozen=True)
class DPItem:
    """One matrix as the DP partitioner sees it."""

    name: str
    numel: int  # elements in this rank's gradient buffer (local TP shard)
    cost: float  # seconds of full-matrix optimizer work
    state_bytes: int  # full-matrix optimizer state
    # the stacked parameter (a mixture-of-experts layer's experts) this matrix is one of: stack
    # matrices fill buckets of their own, in memory order and unpadded (`make_buckets`)
    stack: str | None = None


@dataclass(frozen=True)
class Placement:
    name: str
    offset: int
    numel: int
    cost: float
    state_bytes: int
    owner: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class BucketPlan:
    index: int
    params: tuple[Placement, ...]  # in layout order
    size: int  # padded length in elements
    cuts: tuple[int, ...]  # dp + 1 cut points: rank r holds [cuts[r], cuts[r + 1])

    def segment(self, rank: int) -> tuple[int, int]:
        return self.cuts[rank], self.cuts[rank + 1]

    def segment_lengths(self) -> list[int]:
        return [b - a for a, b in zip(self.cuts, self.cuts[1:])]

    def pieces(self, rank: int) -> list[tuple[str, int, int]]:
        """(name, start, end) in the bucket of each parameter's elements inside `rank`'s segment:
        what an elementwise optimizer's rank updates (and keeps state for)."""
        return pieces_inside(((p.name, p.offset, p.end) for p in self.params), *self.segment(rank))

    def ranks_overlapping(self, p: Placement) -> range:
        """Ranks whose segment holds at least one element of `p`."""
        first = bisect.bisect_right(self.cuts, p.offset) - 1
        last = bisect.bisect_right(self.cuts, p.end - 1) - 1
        return range(first, last + 1)


def pieces_inside(spans: Iterable[tuple[str, int, int]], lo: int, hi: int) -> list[tuple[str, int, int]]:
    """The parts of the (name, start, end) spans of a flat buffer that lie inside [lo, hi)."""
    return [(name, max(a, lo), min(b, hi)) for name, a, b in spans if max(a, lo) < min(b, hi)]


def ceil_to(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


# How buckets of stack matrices are sized (`make_buckets`): "size" fills them up to the bucket
# size as any bucket (what the runtime plans); "dp-multiple" gives each a whole multiple of `dp`
# alike matrices (the largest within the bucket size, at least `dp`), as the authors'
# `bucket_size_calculator` gives each expert bucket a multiple of EDP whole experts: its even
# segments are then whole matrices, so even ZeRO-1 (`zero1-even`) computes none twice.
EXPERT_BUCKETS = ("size", "dp-multiple")
DEFAULT_EXPERT_BUCKETS = EXPERT_BUCKETS[0]


# what the simulator takes for "try each sizing whose expert plans differ, keep the faster"
# (`sim.simulate.SimConfig.expert_buckets`; not a sizing: a plan has one)
AUTO_EXPERT_BUCKETS = "auto"


def check_expert_buckets(name: str) -> str:
    return check_choice(name, EXPERT_BUCKETS, "expert bucket sizing")


def check_expert_buckets_apply(name: str, model: str, stacked: bool) -> None:
    """A sizing off the default on a model with no stacked expert matrices (`stacked`: whether
    `model` has any) would size no bucket: a mistake, not a no-op (one SpecError). The default, and
    the simulator's `AUTO_EXPERT_BUCKETS` (the default at EP 1), are accepted."""
    if name not in (DEFAULT_EXPERT_BUCKETS, AUTO_EXPERT_BUCKETS) and not stacked:
        raise SpecError(f"--expert-buckets {name} sizes the buckets of stacked expert matrices; model {model!r} has "
                        "no stacked expert matrices (no experts)")


def make_buckets(items: Sequence[DPItem], bucket_size: int, stack_multiple: int | None = None) -> list[list[DPItem]]:
    """Group items (given in forward order) into buckets in backward order.

    A bucket holds at most `bucket_size` elements; the next parameter that would overflow it
    opens a new bucket, so each bucket's reduce-scatter can start as soon as backward has produced
    its gradients.

    The matrices of stacks (`DPItem.stack`: experts stored as one `[experts, m, n]` tensor) fill
    buckets of their own, never beside another parameter, and only beside matrices of as many
    elements, in forward order (each stack's matrices in memory order): read from the last bucket
    to the first, consecutive stack buckets hold their stacks exactly as the stacked parameters lie
    one after another, unpadded, so the runtime keeps them in one storage of which the parameters
    and the buckets' parameter buffers are views (`canzona.runtime.stacks`: no copy of the
    experts' weights). A bucket of alike matrices also lets `alpha-balanced-reorder` keep its
    owners' loads and segments while it lays them out in that order.

    `stack_multiple` (the DP size, under "dp-multiple": `EXPERT_BUCKETS`): a stack bucket holds
    a whole multiple of that many matrices, the largest the bucket size holds and at least one
    (a run of alike matrices that is not such a multiple ends in a bucket of what is left).
    """
    if not items:
        return []
    largest = max(it.numel for it in items)
    if bucket_size < largest:
        name = next(it.name for it in items if it.numel == largest)
        raise SpecError(
            f"bucket size {bucket_size} is smaller than the largest parameter {name} ({largest} elements)"
        )
    buckets: list[list[DPItem]] = [[]]
    filled = 0
    def full(current: list[DPItem], it: DPItem) -> bool:
        if stack_multiple is None or it.stack is None:
            return filled + it.numel > bucket_size
        per_bucket = stack_multiple * max(1, bucket_size // (stack_multiple * it.numel))
        return len(current) >= per_bucket

    for it in reversed(items):
        current = buckets[-1]
        if current and (_kind(current[-1]) != _kind(it) or full(current, it)):
            buckets.append([])
            filled = 0
        buckets[-1].append(it)
        filled += it.numel
    return [b[::-1] if is_stack_run(b) else b for b in buckets]


def _kind(it: DPItem) -> int | None:
    """What may share a bucket: other parameters (None), or stack matrices of as many elements."""
    return None if it.stack is None else it.numel


def is_stack_run(items: Sequence[DPItem]) -> bool:
    """The bucket holds stack matrices (in forward order: `make_buckets`)."""
    return bool(items) and items[0].stack is not None


def lay_out(items: Sequence[DPItem], align: int, dp: int) -> tuple[list[int], int]:
    """Offsets of `items` packed in order with each start aligned, and the padded bucket size.

    The size is a multiple of `align * dp` so that even segments start aligned too. Stack
    matrices are packed as the stacked parameters hold them, without padding (`make_buckets`).
    """
    if is_stack_run(items):
        starts = [0]
        for it in items[:-1]:
            starts.append(starts[-1] + it.numel)
        return starts, starts[-1] + items[-1].numel
    offsets, pos = [], 0
    for it in items:
        pos = ceil_to(pos, align)
        offsets.append(pos)
        pos += it.numel
    return offsets, max(ceil_to(pos, align * dp), align * dp)


def place(items: Sequence[DPItem], owners: Sequence[int], align: int, dp: int) -> tuple[tuple[Placement, ...], int]:
    offsets, size = lay_out(items, align, dp)
    placements = tuple(
        Placement(it.name, off, it.numel, it.cost, it.state_bytes, owner)
        for it, off, owner in zip(items, offsets, owners)
    )
    return placements, size


def even_cuts(size: int, dp: int) -> tuple[int, ...]:
    return tuple(r * size // dp for r in range(dp + 1))


def owner_of(offset: int, cuts: Sequence[int]) -> int:
    """The rank whose segment holds element `offset` (empty segments hold nothing)."""
    return bisect.bisect_right(cuts, offset) - 1


@dataclass(frozen=True)
class DPMetrics:
    rank_loads: tuple[float, ...]  # seconds of optimizer work per DP rank (its whole TP group)
    total: float  # seconds of distinct work: each matrix counted once
    makespan: float
    mean: float
    imbalance: float  # makespan / mean
    lower_bound: float  # max(total / dp, largest single cost)
    lower_bound_gap: float  # makespan / lower_bound - 1
    comm_ratio: float  # sum over buckets of the longest segment / sum of the even segment
    rank_state_bytes: tuple[int, ...]
    state_imbalance: float
    atomicity_violations: int  # matrices not wholly inside the segment of a rank that computes them
    extra_comm_elements: int  # gradient elements computing ranks must fetch beyond their segment
    redundant_s: float  # seconds of work computed more than once: sum of loads = total + redundant

    @property
    def atomic(self) -> bool:
        return self.atomicity_violations == 0


def _ratio(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class DPPlan:
    """The DP part of a plan. With `split_compute`, every rank whose segment overlaps a matrix
    computes its full update (ZeRO-1 + gather); otherwise only the owner does."""

    policy: str
    dp: int
    alpha: float | None
    align: int
    bucket_size: int
    split_compute: bool
    buckets: tuple[BucketPlan, ...]  # backward order
    fell_back: bool = False  # alpha-balanced kept the whole-start plan because it was not worse
    balance_by: str = "seconds"  # or "elements": the authors' code balances element counts

    def placements(self) -> list[Placement]:
        return [p for b in self.buckets for p in b.params]

    @cached_property
    def state_bytes(self) -> dict[str, int]:
        """Each matrix's full optimizer state (bytes), by name: asked once per DP rank's schedule."""
        return {p.name: p.state_bytes for p in self.placements()}

    def owners(self) -> dict[str, int]:
        return {p.name: p.owner for p in self.placements()}

    def piece_lengths(self, rank: int) -> list[int]:
        """The lengths of the pieces `rank` updates under an elementwise optimizer, every bucket's
        (`BucketPlan.pieces`)."""
        return [e - s for b in self.buckets for _, s, e in b.pieces(rank)]

    def computing_ranks(self, bucket: BucketPlan, p: Placement) -> Sequence[int]:
        return bucket.ranks_overlapping(p) if self.split_compute else (p.owner,)

    @cached_property
    def piece_metrics(self) -> DPMetrics:
        """The metrics under an elementwise optimizer (AdamW), which updates each rank's pieces
        where they lie: a rank's load and state are its pieces' shares of their matrices' cost and
        state, nothing is fetched beyond a segment and nothing computed twice, and the lower bound
        is an even split of the work (pieces split anywhere)."""
        d = self.dp
        loads, state = [0.0] * d, [0] * d
        for b in self.buckets:
            by_name = {p.name: p for p in b.params}
            for r in range(d):
                for name, start, end in b.pieces(r):
                    p = by_name[name]
                    loads[r] += p.cost * (end - start) / p.numel
                    state[r] += p.state_bytes * (end - start) // p.numel
        total = sum(p.cost for p in self.placements())
        return self._metrics(loads, state, total, lower_bound=total / d)

    def _comm_ratio(self) -> float:
        """The longest reduce-scatter segment over the even one, summed over buckets."""
        longest = sum(max(b.segment_lengths()) for b in self.buckets)
        even = sum(b.size / self.dp for b in self.buckets)
        return longest / even if even > 0 else 1.0

    @cached_property
    def metrics(self) -> DPMetrics:
        """The metrics under a whole-matrix optimizer: each matrix computed whole by the ranks
        `computing_ranks` names."""
        d = self.dp
        loads, state = [0.0] * d, [0] * d
        total, largest, redundant, violations, extra = 0.0, 0.0, 0.0, 0, 0
        for b in self.buckets:
            for p in b.params:
                total += p.cost
                largest = max(largest, p.cost)
                missing = 0
                ranks = self.computing_ranks(b, p)
                redundant += p.cost * (len(ranks) - 1)
                for r in ranks:
                    loads[r] += p.cost
                    state[r] += p.state_bytes
                    lo, hi = b.segment(r)
                    missing += p.numel - max(0, min(hi, p.end) - max(lo, p.offset))
                violations += missing > 0
                extra += missing
        return self._metrics(loads, state, total, lower_bound=max(total / d, largest), violations=violations,
                             extra=extra, redundant=redundant)

    def _metrics(self, loads: list[float], state: list[int], total: float, lower_bound: float,
                 violations: int = 0, extra: int = 0, redundant: float = 0.0) -> DPMetrics:
        makespan = max(loads) if loads else 0.0
        mean = sum(loads) / self.dp
        return DPMetrics(
            rank_loads=tuple(loads),
            total=total,
            makespan=makespan,
            mean=mean,
            imbalance=makespan / mean if mean > 0 else 1.0,
            lower_bound=lower_bound,
            lower_bound_gap=max(0.0, makespan / lower_bound - 1.0) if lower_bound > 0 else 0.0,  # >= 0 up to rounding
            comm_ratio=self._comm_ratio(),
            rank_state_bytes=tuple(state),
            state_imbalance=_ratio(state) if any(state) else 1.0,
            atomicity_violations=violations,
            extra_comm_elements=extra,
            redundant_s=redundant,
        )
