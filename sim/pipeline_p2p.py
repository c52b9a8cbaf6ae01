"""When a pipeline rank posts the receive for each of its passes' inputs, and where its stream waits
for its sends: Megatron-LM's pipeline point-to-point (docs/design.md §9.3, "The pipeline's
point-to-point").

NCCL's point-to-point is a rendezvous: a send's kernel moves its data only while the peer's receive
kernel runs (an activation, tens of MB, is far beyond NCCL's buffers), and each kernel is enqueued
on its GPU behind the work its stream was given before the call. So a transfer starts when the
sender has produced its tensor and the receiver has reached the point of its program where it posts
the matching receive; and a `wait()` on a send (PyTorch's `Work.wait`: the current stream waits for
the NCCL kernel's end) holds the sender's stream until the transfer is done.

Megatron-LM's schedules (megatron/core/pipeline_parallel/schedules.py, with p2p_communication.py),
as the rows' releases run them:
- Interleaved (`forward_backward_pipelining_with_interleaving`, `overlap_p2p_comm=True`, which
  NeMo and Megatron-Bridge set with a virtual pipeline): the receive for a rank's next forward is
  posted with its current forward's send (`send_forward_recv_forward`, `recv_prev` for the next
  iteration), the receive for its next backward with its current backward's send
  (`send_backward_recv_backward`); the first forward's before the warm-up (`recv_forward`), the
  first backward's after the last warm-up forward. In the warm-up the exchange is blocking (without
  `overlap_p2p_comm_warmup_flush`, off by default, the warm-up calls `send_forward_recv_forward`
  without `overlap_p2p_comm`, which waits for its requests), and in the cool-down too
  (`send_backward_recv_backward` without it); in the steady state the calls return handles, the
  receive's waited for before the pass that needs it (`pp_pre_forward` / `pp_pre_backward`) and the
  previous send's right after the current one is posted (`send_next_wait_handle`,
  `send_prev_wait_handle`). Megatron-Core 0.8 (NeMo 24.07) waits for both of the previous
  exchange's handles before the next pass of the same direction instead: the same sends, waited
  for one pass earlier in the steady state, where the backward between gives them slack.
- Plain 1F1B (`forward_backward_pipelining_without_interleaving`, `batch_p2p_comm`): every exchange
  blocks. Warm-up: `recv_forward`, the forward, `send_forward`, so each receive is posted once the
  previous send is done; steady state: `send_forward_recv_backward` after the forward (its output
  out, the backward's gradient in, one batch) and `send_backward_recv_forward` after the backward;
  the last steady backward's `send_backward`, then the cool-down's `recv_backward`, backward,
  `send_backward`. Each call that moves something ends in `torch.cuda.synchronize()`
  (`batch_p2p_sync`, on by default: `sim.iteration._Stage.host_syncs`).

`posting` writes this down per rank, for the simulator (`sim.iteration._Stage.after_pass`); the
combined 1F1B schedule (`overlap_moe_expert_parallel_comm`, sim.ep_overlap) runs inside the
interleaved one with one warm-up forward more and the same calls around its passes: the
warm-up's and cool-down's passes run alone, each followed by its blocking exchange; a steady step
(`TransformerModelChunkSchedulePlan.run`) waits for both passes' receives (`pp_pre_forward`,
`pp_pre_backward`) before its layers, then makes the forward's exchange (`pp_post_forward`, on
the communication stream), then the backward's (`pp_post_backward`), both before the head's
forward and the embedding's gradient, as the interleaved schedule's steady state makes the
forward's before the backward's.

Which stream each transfer's kernels run on (`p2p_stream`): PyTorch's ProcessGroupNCCL gives an
unbatched `isend` / `irecv` a two-rank communicator keyed by the pair ("lowRank:highRank",
`getKeySendRecv` in `pointToPoint`) and one NCCL stream per communicator, so the pair's ops run one
after another in the order each rank issued them. Under `overlap_p2p_comm` Megatron's `_p2p_ops`
issues them unbatched (`batch_p2p_comm` must be off with it), all on the pipeline group, so a
stage's activations to the next stage and the gradients it receives back from it queue on one
stream; at PP 2, where the next and the previous stage are the same peer, `_p2p_ops` puts one
direction on the WORLD group instead (even stages send on the pipeline group and receive on WORLD),
which leaves each direction its own communicator and stream. Plain 1F1B batches each exchange
(`batch_isend_irecv`, one NCCL group on the pipeline group's communicator) and waits for it before
the next, so its transfers never queue behind one another: a stream a direction gives the same times.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from canzona.hardware import HardwareProfile
from canzona.pipeline import Slot, interleaved_warmup, pipeline_order
from sim.collectives import CollectiveCost, all_to_all_cost
from sim.streams import PP_COMM
from sim.topology import Cluster


@dataclass(frozen=True, kw_only=True)
class AfterPass:
    """What a rank does with the pipeline after a pass, once its compute is issued."""

    posts: tuple[Slot, ...] = ()  # receives posted with the pass's send
    blocking: bool = False  # the stream waits for the pass's send and the receives of `posts`
    then_posts: tuple[Slot, ...] = ()  # receives posted after that (the next, blocking call)
    waits_for: Slot | None = None  # an earlier pass whose send the stream waits for after posting


@dataclass(frozen=True, kw_only=True)
class Posting:
    """A rank's receives posted before its first pass, and what it does after each pass."""

    at_start: tuple[Slot, ...]
    after: Mapping[Slot, AfterPass]


def p2p_cost(act: float, cluster: Cluster, hw: HardwareProfile) -> CollectiveCost:
    """One micro-batch's transfer between neighbouring stages (activations forward, their gradient
    back): `act` the bytes of a rank's activations of the micro-batch, of which each TP rank sends
    its slice of the sequence (sequence parallel). Megatron's stages' (sim.iteration) and FSDP2's
    under torch's pipelining (sim.fsdp_pipeline)."""
    piece = act / cluster.tp
    return all_to_all_cost([piece, 0.0], [0.0, piece], cluster.pp_geometry(), hw)


def p2p_stream(src: int, dst: int, pp: int, vp: int = 1) -> str:
    """The stream of a transfer from stage `src` to stage `dst` (on both ranks; the module
    docstring): the pair's under the interleaved schedule's unbatched ops past PP 2 (the combined
    schedule's too: it makes the same calls), else the direction's."""
    if vp > 1 and pp > 2:
        return f"{PP_COMM} {min(src, dst)}:{max(src, dst)}"
    return f"{PP_COMM} {src}->{dst}"


def needs_receive(slot: Slot, stage: int, pp: int, vp: int) -> bool:
    """A forward needs its input from the virtual stage before it (not the model's first); a
    backward its output gradient from the one after it (not the last, which holds the loss)."""
    kind, _, chunk = slot
    v = chunk * pp + stage
    return v > 0 if kind == "F" else v < pp * vp - 1


def posting(stage: int, pp: int, micro_batches: int, vp: int = 1, combined: bool = False) -> Posting:
    """Rank `stage`'s receives and send waits under Megatron's schedule (the module docstring):
    plain 1F1B at `vp` 1, the interleaved schedule above it (`combined`: the combined 1F1B
    schedule's one warm-up forward more). Receives a pass does not need are left out."""
    at_start, after = _plain(stage, pp, micro_batches) if vp == 1 else \
        _interleaved(stage, pp, micro_batches, vp, combined)

    def keep(slots: tuple[Slot, ...]) -> tuple[Slot, ...]:
        return tuple(s for s in slots if needs_receive(s, stage, pp, vp))

    return Posting(at_start=keep(at_start),
                   after={slot: AfterPass(posts=keep(a.posts), blocking=a.blocking, then_posts=keep(a.then_posts),
                                          waits_for=a.waits_for) for slot, a in after.items()})


def _plain(stage: int, pp: int, m: int) -> tuple[tuple[Slot, ...], dict[Slot, AfterPass]]:
    """1F1B: every exchange blocks; a receive is posted with the send of the pass before it where
    the two are a steady-state pair (one batch), else once that send is done."""
    warm = min(pp - stage - 1, m)
    steady = m - warm

    def f(i: int) -> Slot:
        return "F", i, 0

    def b(i: int) -> Slot:
        return "B", i, 0

    after: dict[Slot, AfterPass] = {}
    for i in range(warm):  # recv_forward of the next forward (or the cool-down's recv_backward) after send_forward
        after[f(i)] = AfterPass(blocking=True, then_posts=(f(i + 1) if i + 1 < m else b(0),))
    for j in range(steady):
        after[f(warm + j)] = AfterPass(posts=(b(j),), blocking=True)  # send_forward_recv_backward
        if j + 1 < steady:  # send_backward_recv_forward
            after[b(j)] = AfterPass(posts=(f(warm + j + 1),), blocking=True)
        else:  # the last iteration's send_backward, then the cool-down's recv_backward
            after[b(j)] = AfterPass(blocking=True, then_posts=(b(steady),) if steady < m else ())
    for j in range(steady, m):  # cool-down: send_backward, then recv_backward of the next
        after[b(j)] = AfterPass(blocking=True, then_posts=(b(j + 1),) if j + 1 < m else ())
    return (f(0),), after


def _interleaved(stage: int, pp: int, m: int, vp: int,
                 combined: bool) -> tuple[tuple[Slot, ...], dict[Slot, AfterPass]]:
    """The interleaved schedule under `overlap_p2p_comm`: each receive posted with the send of the
    pass before it in its direction; blocking in the warm-up and cool-down, the previous send
    waited for in the steady state."""
    order = pipeline_order(stage, pp, m, vp)
    forwards = [s for s in order if s[0] == "F"]
    backwards = [s for s in order if s[0] == "B"]
    total = len(forwards)
    warm = min(interleaved_warmup(stage, pp, vp, m) + combined, total)
    steady = total - warm
    after: dict[Slot, AfterPass] = {}
    for k, slot in enumerate(forwards):
        following = (forwards[k + 1],) if k + 1 < total else ()
        if k < warm:  # blocking; the last warm-up step then posts the first backward's receive
            after[slot] = AfterPass(posts=following, blocking=True,
                                    then_posts=(backwards[0],) if k == warm - 1 else ())
        else:
            after[slot] = AfterPass(posts=following, waits_for=forwards[k - 1] if k - 1 >= warm else None)
    for k, slot in enumerate(backwards):
        following = (backwards[k + 1],) if k + 1 < total else ()
        if k < steady:
            after[slot] = AfterPass(posts=following, waits_for=backwards[k - 1] if k >= 1 else None)
        else:  # the cool-down's send_backward_recv_backward blocks
            after[slot] = AfterPass(posts=following, blocking=True)
    return (forwards[0],) + ((backwards[0],) if warm == 0 else ()), after
