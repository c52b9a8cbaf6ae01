"""How a bucket's gradients are reduce-scattered over DP: the implementations, the per-bucket route
of the default one, and the temporary memory each allocates (docs/design.md §8.1).

Pure policy, no torch: the runtime (`canzona.runtime.comm`) runs the route chosen here, the
simulator (`sim.collectives`) prices the same route and `canzona.memory` counts its buffers, so
the three agree by construction.

Whole matrices make a bucket's segments uneven (one per DP rank, rank r's the matrices it owns).
The implementations (`reduce_scatter=` in `DistributedOptimizer`, `canzona simulate` and
`canzona compare`):

- `native` (the default): the backend's own reductions, chosen per bucket by `bucket_route`: one
  `reduce_scatter_single` of the buffer into itself when the segments are even (each rank's sum
  lands in its own segment: no receive buffer, as Megatron's distributed optimizer); the same
  collective over a padded copy (`n x` the largest segment, the sum received into it) when padding
  adds at most `PADDING_LIMIT` of the bucket; else one reduce per non-empty segment to its owner
  (grouped under NCCL's coalescing manager: one launch). The backend chooses the summation order, so results equal the reference
  within rounding (bit for bit at DP 2, where a sum of two is the same either way).
- `exact`: one all-to-all (rank r receives every rank's copy of segment r), then a local sum in
  rank order: reproducible in one process, so the distributed step equals the single-process step
  bit for bit at any DP size. The verification mode (`canzona verify`, the numerical ladder); it
  receives `(n - 1) x` the segment into each owner and makes `n` passes over it.
- `loops`: always the reduce per segment; `padded`: always the padded collective.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from canzona.choices import check_choice

REDUCE_SCATTER_IMPLS = ("native", "exact", "loops", "padded")
DEFAULT_REDUCE_SCATTER = "native"

# What a bucket is reduce-scattered with (`bucket_route`)
EVEN = "even"  # one reduce-scatter of the buffer itself: every segment the same length
PADDED = "padded"  # one reduce-scatter of a copy padded to n x the largest segment
LOOPS = "loops"  # one reduce per non-empty segment, to its owner
EXACT = "exact"  # one all-to-all, then a sum in rank order

# `native` pads a bucket when the padding adds at most this fraction of its elements: the padded
# copy costs one pass over the bucket and that much more traffic, while a loop of reduces pays one
# collective latency per owner (32 on a DP-32 group) on every bucket.
PADDING_LIMIT = 1 / 16

HELP = ("native: the backend's reductions (reduce-scatter when even or nearly so, else one reduce per owner); "
        "exact: all-to-all then a sum in rank order, bit for bit at any DP size (verification); "
        "loops: one reduce per owner; padded: reduce-scatter of a padded copy")


def check_reduce_scatter(impl: str) -> str:
    return check_choice(impl, REDUCE_SCATTER_IMPLS, "reduce_scatter", note=f" ({HELP})")


def padding(lengths: Sequence[int]) -> int:
    """Elements a padded reduce-scatter adds to the segments `lengths` (one per rank)."""
    return len(lengths) * max(lengths, default=0) - sum(lengths)


def bucket_route(impl: str, lengths: Sequence[int]) -> str:
    """The route of a reduce-scatter over segments of `lengths` elements (one per rank, in rank
    order) under implementation `impl`: `EVEN`, `PADDED`, `LOOPS` or `EXACT`."""
    check_reduce_scatter(impl)
    if impl == EXACT:
        return EXACT
    if len(set(lengths)) <= 1:
        return EVEN  # every implementation but exact runs the plain collective
    if impl == "native":
        return PADDED if padding(lengths) <= PADDING_LIMIT * sum(lengths) else LOOPS
    return impl


def alike_impls(impl: str, asked: Iterable[Sequence[float]]) -> tuple[str, ...]:
    """The implementations (`impl` among them) that route every segment list of `asked` as `impl`
    does. The implementation reaches the simulator's prices (`sim.collectives.reduce_scatter_v_cost`)
    and the memory model (`temporary_elements_by_rank`, `canzona.memory.reduction_bytes`) only
    through `bucket_route`, and each of them depends on the segments and the route alone, so a run
    under any of these, `asked` being all it routed, is the same run: the search simulates one
    (`sim.search`), `asked` being the segment lists the run's plans give
    (`sim.simulate.SimResult.reduce_scatters`, from `canzona.memory.reduce_scatter_lengths`)."""
    asked = list(asked)
    routes = [bucket_route(impl, s) for s in asked]
    return tuple(other for other in REDUCE_SCATTER_IMPLS
                 if other == impl or all(bucket_route(other, s) == r for s, r in zip(asked, routes)))


def temporary_elements(impl: str, lengths: Sequence[int], rank: int, *, scratch: bool = False) -> int:
    """Elements rank `rank` allocates for one reduce-scatter while it is in flight (freed when it
    is waited for): `exact` receives every rank's copy of its segment (and sums them in place);
    `padded` copies the bucket padded and receives its segment into that copy; `even` reduces in
    place, into the rank's own segment of the bucket (as Megatron's distributed optimizer does):
    nothing; `loops` reduces in place, except where the backend uses a non-root's buffer as
    scratch (gloo: `scratch=True`), where the segments are sent from a copy of the bucket. One
    rank alone reduces nothing (its mean is its gradient). What a backend allocates inside its
    own collective (gloo's clone of a reduce-scatter's input, NCCL's channel buffers) is not the
    caller's and not counted here."""
    return temporary_elements_by_rank(impl, lengths, scratch=scratch)[rank]


def temporary_elements_by_rank(impl: str, lengths: Sequence[int], *, scratch: bool = False) -> list[int]:
    """`temporary_elements` of every rank, the route chosen once."""
    n = len(lengths)
    if n <= 1:
        return [0] * n
    route = bucket_route(impl, lengths)
    if route == EXACT:
        return [n * mine for mine in lengths]
    if route == EVEN:
        return [0] * n
    if route == PADDED:
        return [n * max(lengths)] * n
    return [sum(lengths) if scratch else 0] * n


__all__ = [
    "DEFAULT_REDUCE_SCATTER", "EVEN", "EXACT", "HELP", "LOOPS", "PADDED", "PADDING_LIMIT", "REDUCE_SCATTER_IMPLS",
    "alike_impls", "bucket_route", "check_reduce_scatter", "padding", "temporary_elements",
    "temporary_elements_by_rank",
]
