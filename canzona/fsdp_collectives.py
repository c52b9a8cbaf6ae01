"""Every collective of one FSDP2 optimizer step, as the runtime (`canzona.runtime.fsdp`) issues and
logs it (docs/design.md §2.8), torch-free: one definition, two users. The runtime's logs
(`opt.world.log` and `opt.comm.log`, merged in issue order) equal `fsdp_step_collectives` record
for record (tests/runtime/test_fsdp_parity.py), and the simulator (`sim/fsdp.py`, phase B) prices
the micro-groups' all-to-alls from `exchange_bytes` and, under `--collectives runtime`, the
checks' all-gathers from `fsdp_step_collectives`.

`fsdp_step_collectives(spec, shard, member, owners, micro_groups, ...)` lists what member `member`
of a shard group of `shard` ranks (one replica under HSDP) issues in one step, in order:

1. the step check: one all-gather over every rank of the mesh (group "fsdp-world", replicas too) of
   one 8-byte word per parameter and five more (a local problem, the hyper-parameters' digest,
   the mark of a model loaded since the last step, the rank's fp64 sum of squares, the clip
   threshold), at the first `clip_grad_norm_` or at `step()`; where the norm it finds is not
   finite, right after it one "non-finite weights" all-gather (one word: the position of a
   parameter whose weights on this rank are NaN / Inf, which fails the step on every rank, naming
   them);
2. per `clip_grad_norm_` call after the first, and at `step()` after any: one "step recheck"
   all-gather (five words: the hyper-parameters' digest, the threshold, whether the rank's
   gradients changed since (then every rank takes the step check of 1. anew, not counted here),
   a local problem and the model-loaded mark),
   which the reused check costs (a learning rate set on one rank between the clip and the step
   must fail every rank; `step()`'s own clipping, `max_grad_norm`, right after its check,
   rechecks nothing); one "gradient norm" all-gather (one word) for `norm_type=inf`;
3. where the norm is not finite (the step skipped under `nonfinite="skip"`), nothing more; else per
   micro-group that
   has a gradient, on the shard group ("fsdp"): the all-to-all of the gradients' pieces to their
   owners ("gradients of micro-group k"), and after the next micro-group's, the all-to-all of the
   updates' pieces back ("updates of micro-group k"), issued even where it carries nothing (SOAP's
   first step computes no update).

An all-to-all's record is the bytes this member sends to each member, itself included (its own
piece is copied, not sent: the simulator prices the other members' only). Each member's piece is
its `torch.chunk` row block (`canzona.fsdp_plan.shard_numel`); one element size for gradients and
updates (the runtime's: fp32 under master weights, else the parameters' dtype). Construction's
own all-gathers (the parameters' verdict, the layout's boxes) are not listed. FSDP x TP (pieces that are TP shards' row
blocks) is not covered.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from canzona.fsdp_plan import shard_numel
from canzona.spec import ModelSpec

FSDP_GROUP = "fsdp"  # the exchange group's name in the runtime's logs
FSDP_WORLD_GROUP = "fsdp-world"  # every rank of the mesh: the step check and the agreement check
ALL_GATHER, ALL_TO_ALL = "all-gather", "all-to-all"
CHECK_WORD_BYTES = 8  # the step check's words are int64 (the norm term and threshold: float64)
CHECK_EXTRA_WORDS = 5  # beyond one per parameter: problem, digest, model loaded, norm term, clip threshold
# construction's first collective, over every rank of the mesh: whether any rank refused its parameters
PARAMETERS_VERDICT = "parameters verdict"
# where a step's norm is not finite, the all-gather of whether a rank's weights are (one word;
# `runtime.nonfinite`, under both layouts)
WEIGHTS_CHECK = "non-finite weights"
# a reused check's recheck: digest, clip threshold, the gradients changed since, a local problem, model loaded
RECHECK_WORDS = 5


class Exchanged(Protocol):
    """A matrix as an exchange sees it (`canzona.fsdp_plan.FsdpMatrix` is one)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def owner(self) -> int | None: ...


@dataclass(frozen=True)
class FsdpCollective:
    """One collective as the runtime logs it; all-to-alls also carry the whole group's bytes."""

    op: str
    group: str
    name: str
    bytes_per_rank: tuple[int, ...]  # all-gather: each member's; all-to-all: sent to each member
    sent: tuple[tuple[int, ...], ...] = ()  # all-to-alls: bytes from member s to member d

    def logged(self) -> tuple[str, str, str, tuple[int, ...]]:
        """(op, group, name, bytes per rank): the fields of the runtime's `CollectiveRecord`."""
        return self.op, self.group, self.name, self.bytes_per_rank


def exchange_bytes(mats: Sequence[Exchanged], shard: int, element_bytes: int, *,
                   updates: bool = False) -> list[list[int]]:
    """sent[s][d]: the bytes member s sends member d in one micro-group's all-to-all of `mats`
    (each with its owner), self included. Gradients: s's row blocks of the matrices d owns.
    Updates (`updates`): d's row blocks of the matrices s owns."""
    sent = [[0] * shard for _ in range(shard)]
    for m in mats:
        if m.owner is None:
            continue
        for r in range(shard):
            n = shard_numel(m.shape, shard, r) * element_bytes
            if updates:
                sent[m.owner][r] += n
            else:
                sent[r][m.owner] += n
    return sent


@dataclass(frozen=True)
class _Matrix:
    shape: tuple[int, ...]
    owner: int | None


def fsdp_step_collectives(spec: ModelSpec, shard: int, member: int, owners: Mapping[str, int],
                          micro_groups: Sequence[Sequence[str]], *, element_bytes: int, world: int | None = None,
                          clips: Sequence[tuple[float, float]] = (), max_grad_norm: float | None = None,
                          got: Collection[str] | None = None, no_update: Collection[str] = (),
                          skipped: bool = False) -> list[FsdpCollective]:
    """What member `member` of the shard group issues in one step, in order (the module's list).

    `owners` and `micro_groups`: the runtime's (`FsdpOptimizer.owner`, `.micro_groups`: from
    `canzona.fsdp_plan`). `world`: the ranks of the mesh (replicas x `shard`; default `shard`).
    `clips`: the `clip_grad_norm_(max_norm, norm_type)` calls before `step()`; `max_grad_norm`:
    the optimizer's own (its clip, right after the check, issues nothing). `got`: the parameters
    with a gradient (default: all). `no_update`: the matrices whose step computes no update (SOAP's
    first). `skipped`: the step found a non-finite norm (and finite weights) and skipped
    (`nonfinite="skip"`)."""
    world = shard if world is None else world
    out: list[FsdpCollective] = []

    def gather(name: str, words: int) -> None:
        out.append(FsdpCollective(ALL_GATHER, FSDP_WORLD_GROUP, name, (words * CHECK_WORD_BYTES,) * world))

    checked = False

    def check() -> None:  # FsdpOptimizer.check (the threshold changes no record)
        nonlocal checked
        if not checked:
            gather("step check", len(spec.params) + CHECK_EXTRA_WORDS)
            if skipped:  # the weights looked at inside it (`runtime.nonfinite.nonfinite_weights_error`)
                gather(WEIGHTS_CHECK, 1)
            checked = True
        else:
            gather("step recheck", RECHECK_WORDS)

    for _, norm_type in clips:
        check()
        if norm_type == math.inf:
            gather("gradient norm", 1)
    check()  # step()'s (its own clip, max_grad_norm, after it: no record)
    if skipped:  # the weights were finite (looked at in the first check): skipped
        return out

    shapes = {p.name: tuple(p.shape) for p in spec.params}
    has = set(shapes) if got is None else set(got)
    groups = [[n for n in g if n in has] for g in micro_groups]
    groups = [g for g in groups if g]

    def exchange(k: int, updates: bool) -> FsdpCollective:
        mats = [_Matrix(shapes[n], owners[n]) for n in groups[k] if not (updates and n in no_update)]
        sent = exchange_bytes(mats, shard, element_bytes, updates=updates)
        name = f"{'updates' if updates else 'gradients'} of micro-group {k}"
        return FsdpCollective(ALL_TO_ALL, FSDP_GROUP, name, tuple(sent[member]), tuple(map(tuple, sent)))

    # the next micro-group's gradients travel under this one's compute, then its updates go back
    if groups:
        out.append(exchange(0, False))
    for k in range(len(groups)):
        if k + 1 < len(groups):
            out.append(exchange(k + 1, False))
        out.append(exchange(k, True))
    return out
