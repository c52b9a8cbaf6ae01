"""The pipeline's point-to-point as Megatron posts it (`sim.pipeline_p2p`): a transfer starts when
its sender has produced the tensor and its receiver has posted the receive, and the warm-up's and
cool-down's exchanges block the sender's stream until they are done."""

from __future__ import annotations

import pytest

from canzona.decoder import DecoderConfig, build_decoder
from canzona.pipeline import combined_order, pipeline_order
from sim.options import RunOptions
from sim.pipeline_p2p import AfterPass, needs_receive, p2p_stream, posting
from sim.simulate import SimConfig, simulate
from sim.workload import Workload

# PP 2 x VP 2, one GPU a stage, two micro-batches: stage 0 runs its four forwards as warm-up,
# stage 1 two (Megatron's get_pp_rank_microbatches); 28 layers, 7 a chunk
TINY = SimConfig(model="qwen3-0.6b", gpus=2, tp=1, pp=2, vp=2, policy="sc", workload=Workload(512, 2))


def _span(result, rank: int, name: str, stream: str = "compute"):
    (span,) = [s for s in result.spans if s.phase == "A" and s.rank == rank and s.name == name and s.stream == stream]
    return span


def _forward_end(result, rank: int, mb: int, last_layer: int) -> float:
    """When rank's forward of micro-batch `mb` ends: its chunk's last layer's last block."""
    return max(s.end for s in result.spans if s.phase == "A" and s.rank == rank and s.kind == "compute"
               and s.name.startswith(f"mb{mb} fwd layer {last_layer}."))


def test_a_receive_posted_late_delays_its_transfer_by_hand(full_rate_compute):
    """Stage 0 posts its receive for micro-batch 0's chunk 1 (the activations stage 1's chunk 0
    sends round to it) with the send of its own micro-batch 1 chunk 0, so that transfer waits for
    it. Both ranks start their second forward together (stage 0 on micro-batch 1 once its first
    send is done, stage 1 on micro-batch 0 once it has arrived: the same transfer), and run the
    same seven layers, stage 0 the embedding first: the wrap-around send starts the embedding's
    forward after stage 1 is done, where it started at once before."""
    r = simulate(TINY)
    wrap = _span(r, 1, "mb0 chunk 0 send activations", "pp-comm 1->0")
    produced = _forward_end(r, 1, 0, 13)  # stage 1's chunk 0: layers 7..13
    posted = _forward_end(r, 0, 1, 6)  # stage 0's micro-batch 1 chunk 0: layers 0..6
    embedding = _span(r, 0, "mb1 fwd embedding")
    assert wrap.start == pytest.approx(posted, abs=1e-12)
    assert wrap.start - produced == pytest.approx(embedding.end - embedding.start, rel=1e-9)
    assert embedding.end > embedding.start
    assert embedding.start == pytest.approx(_span(r, 1, "mb0 fwd layer 7.0").start, abs=1e-12)


def test_a_receive_posted_early_changes_nothing(full_rate_compute):
    """Stage 1 posts its receive for micro-batch 1's chunk 0 when its own micro-batch 0 is done,
    before stage 0 has produced it: the send starts when its sender's last layer ends, as before."""
    r = simulate(TINY)
    send = _span(r, 0, "mb1 chunk 0 send activations", "pp-comm 0->1")
    assert _forward_end(r, 1, 0, 13) < _forward_end(r, 0, 1, 6)  # posted before it is produced
    assert send.start == pytest.approx(_forward_end(r, 0, 1, 6), abs=1e-12)
    first = _span(r, 0, "mb0 chunk 0 send activations", "pp-comm 0->1")  # posted before the first pass
    assert first.start == pytest.approx(_forward_end(r, 0, 0, 6), abs=1e-12)


def test_the_warm_up_waits_for_its_sends(full_rate_compute):
    """Megatron's warm-up exchange blocks (`send_forward_recv_forward` waits for its requests):
    stage 0's second forward starts when its first send is done, not when its first forward is."""
    r = simulate(TINY)
    send = _span(r, 0, "mb0 chunk 0 send activations", "pp-comm 0->1")
    assert send.end > send.start
    assert _span(r, 0, "mb1 fwd embedding").start == pytest.approx(send.end, abs=1e-12)


def test_plain_1f1b_synchronises_the_device_after_each_exchange(full_rate_compute):
    """Plain 1F1B batches each exchange and Megatron's `_communicate` then calls
    `torch.cuda.synchronize()` (`batch_p2p_sync`, on by default): the host issues the next pass
    once every stream of the GPU is done, its first kernel one launch (`launch_s`) later. PP 2,
    one GPU a stage, two micro-batches: stage 0's second forward starts one launch after its
    first send (`send_forward`) and stage 1's first forward one launch after its first receive
    (`recv_forward`); where a rank's exchange has nothing to move (the last stage's forward) and
    under the interleaved schedule (the test above) the next pass starts at once."""
    from canzona.hardware import load_profile

    launch = load_profile(TINY.hardware).gpu.launch_s
    assert launch > 0
    r = simulate(SimConfig(model="qwen3-0.6b", gpus=2, tp=1, pp=2, policy="sc", workload=Workload(512, 2)))
    send = _span(r, 0, "mb0 send activations", "pp-comm 0->1")
    assert _span(r, 0, "mb1 fwd embedding").start == pytest.approx(send.end + launch, abs=1e-12)
    received = _span(r, 1, "mb0 send activations", "pp-comm 0->1")
    first = min((s for s in r.spans if s.phase == "A" and s.rank == 1 and s.stream == "compute"), key=lambda s: s.start)
    assert first.name == "mb0 fwd layer 14.0"
    assert first.start == pytest.approx(received.end + launch, abs=1e-12)
    # the last stage's `send_forward_recv_backward` sends and receives nothing (Megatron returns
    # without `_communicate`): its backward follows its forward at once
    assert _span(r, 1, "mb0 bwd head").start == pytest.approx(_span(r, 1, "mb0 fwd head").end, abs=1e-12)


# PP 3 x VP 2, one GPU a stage, three micro-batches: 36 layers, 6 a chunk
PAIRED = SimConfig(model="qwen3-4b", gpus=3, tp=1, pp=3, vp=2, policy="sc", workload=Workload(256, 3))


def _pair_spans(result, rank: int, stream: str):
    return sorted((s for s in result.spans if s.phase == "A" and s.rank == rank and s.stream == stream),
                  key=lambda s: (s.start, s.end))


def test_a_pairs_two_directions_share_one_stream_past_pp_2():
    """Past PP 2 the interleaved schedule's unbatched isend / irecv between two stages run on the
    pair's NCCL communicator and its one stream (ProcessGroupNCCL's "low:high" key): stage 0's
    activations to stage 1 (two chunks of three micro-batches) and the gradients stage 1 sends back
    are on `pp-comm 0:1` on both ranks, and so run one at a time; the wrap-around from stage 2 to
    stage 0 (chunk 0 into chunk 1, three micro-batches each way) on `pp-comm 0:2`."""
    r = simulate(PAIRED)
    for rank, stream, count in [(0, "pp-comm 0:1", 12), (1, "pp-comm 0:1", 12), (0, "pp-comm 0:2", 6), (2, "pp-comm 0:2", 6)]:
        spans = _pair_spans(r, rank, stream)
        assert len(spans) == count
        assert {s.name.rsplit(" ", 1)[-1] for s in spans} == {"activations", "gradients"}
        assert all(a.end <= b.start + 1e-15 for a, b in zip(spans, spans[1:]))


def test_sharing_the_pairs_stream_changes_no_time_here(monkeypatch):
    """Megatron's order alternates a pair's two directions (a stage posts its next backward's
    receive after its backward's send, its neighbour sends that gradient after its own backward),
    so here no transfer waits behind the other direction's: the iteration takes what it takes with
    a stream a direction."""
    shared = simulate(PAIRED).iteration_time_s
    monkeypatch.setattr("sim.iteration.p2p_stream", lambda src, dst, pp, vp=1: f"pp-comm {src}->{dst}")
    assert simulate(PAIRED).iteration_time_s == shared


# a small MoE model, 8 layers, run by the combined schedule at PP 4 x VP 2 (EP 2, DP 2): four
# micro-batches, one layer a chunk
MOE = DecoderConfig("small-moe", 8, 1024, 8, 8, 128, 2048, 1024, False, experts=16, experts_per_token=2, moe_ffn=512)
COMBINED = SimConfig(model="unused", gpus=8, tp=1, pp=4, vp=2, ep=2, optimizer="adamw", policy="zero1",
                     zero1_fallback=False, workload=Workload(seq_len=512, global_batch=8), gpu_variability=0.0,
                     options=RunOptions(overlap_moe_expert_parallel_comm=True))


def test_the_combined_step_posts_the_forwards_receive_before_the_backwards_send():
    """The last stage's first steady step (forward micro-batch 1 on chunk 1, the last virtual
    stage, which sends nothing, beside the backward of micro-batch 0 on chunk 1) posts its next
    forward's receive (`pp_post_forward`) before it sends the backward's gradient to stage 2
    (`pp_post_backward`), on the pair's one stream: stage 2 sends that forward's input (its
    micro-batch 2 on chunk 1, its last warm-up forward, blocking) before it posts that gradient's
    receive, so the two transfers run in that order. The other way round, both ranks' sends are
    at the head of the pair's stream and the iteration never ends."""
    r = simulate(COMBINED, model=(build_decoder(MOE), MOE.architecture()))
    pair = sorted((s for s in r.spans if s.rank == 6 and s.stream == "pp-comm 2:3" and s.phase == "A"),
                  key=lambda s: s.start)  # stage 3's first rank
    names = [s.name for s in pair]
    activations, gradients = names.index("mb2 chunk 1 send activations"), names.index("mb0 chunk 1 send gradients")
    assert activations + 1 == gradients
    assert pair[activations].end <= pair[gradients].start + 1e-15


def test_which_stream_by_hand():
    """The pair's past PP 2 under the interleaved schedule (and the combined one, which makes the
    same calls); a direction's at PP 2 (Megatron's `_p2p_ops` puts one direction on the WORLD group
    there) and under plain 1F1B (batched, blocking)."""
    assert p2p_stream(2, 1, 4, 2) == p2p_stream(1, 2, 4, 2) == "pp-comm 1:2"
    assert p2p_stream(3, 0, 4, 2) == "pp-comm 0:3"
    assert p2p_stream(1, 0, 2, 2) == "pp-comm 1->0"
    assert p2p_stream(2, 1, 4) == "pp-comm 2->1"


def test_the_interleaved_table_by_hand():
    """PP 2 x VP 2, two micro-batches, stage 1 (warm-up 2 of 4), read off schedules.py: each
    receive posted with the send of the pass before it in its direction; the warm-up and
    cool-down blocking, the steady state waiting for the previous send; stage 1 holds the last
    virtual stage, whose backwards need no receive."""
    p = posting(1, 2, 2, 2)
    f = [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1)]
    b = [("B", 0, 1), ("B", 1, 1), ("B", 0, 0), ("B", 1, 0)]
    assert p.at_start == (f[0],)
    assert p.after == {
        f[0]: AfterPass(posts=(f[1],), blocking=True),
        f[1]: AfterPass(posts=(f[2],), blocking=True),  # then the first backward's, not needed here
        f[2]: AfterPass(posts=(f[3],)),
        f[3]: AfterPass(waits_for=f[2]),
        b[0]: AfterPass(),
        b[1]: AfterPass(posts=(b[2],), waits_for=b[0]),
        b[2]: AfterPass(posts=(b[3],), blocking=True),
        b[3]: AfterPass(blocking=True),
    }


def test_the_combined_tables_by_hand():
    """PP 4 x VP 2, four micro-batches under the combined schedule, read off schedules.py
    (`forward_backward_pipelining_with_interleaving` with `get_pp_rank_microbatches`' one warm-up
    forward more): stage 3 runs 5 of its 8 forwards as warm-up, each exchange blocking
    (`send_forward_recv_forward` without `overlap_p2p_comm`), then 3 steps of a forward beside a
    backward (`pp_post_forward`, `pp_post_backward`: each posts the next receive of its direction
    and waits for the previous send), then 5 backwards alone, blocking. It holds the last virtual
    stage (chunk 1), whose forwards send nothing and whose backwards need no receive, and leads the
    backward direction: its first steady steps post no receive (`recv_tensor_from_previous_stage`:
    stage 0 has produced nothing yet). Stage 0 runs all 8 forwards as warm-up (capped, so
    `are_all_microbatches_in_warmup`: the cool-down's `recv_backward` posts the first backward's
    receive after the last forward's exchange); its chunk 0 needs no input."""
    f = [("F", 0, 0), ("F", 1, 0), ("F", 2, 0), ("F", 3, 0), ("F", 0, 1), ("F", 1, 1), ("F", 2, 1), ("F", 3, 1)]
    b = [("B", 0, 1), ("B", 1, 1), ("B", 2, 1), ("B", 3, 1), ("B", 0, 0), ("B", 1, 0), ("B", 2, 0), ("B", 3, 0)]
    last = posting(3, 4, 4, 2, combined=True)
    assert last.at_start == (f[0],)  # recv_forward before the warm-up
    assert last.after == {
        f[0]: AfterPass(posts=(f[1],), blocking=True),
        f[1]: AfterPass(posts=(f[2],), blocking=True),
        f[2]: AfterPass(posts=(f[3],), blocking=True),
        f[3]: AfterPass(posts=(f[4],), blocking=True),
        f[4]: AfterPass(posts=(f[5],), blocking=True),  # then send_backward_recv_backward: not needed
        f[5]: AfterPass(posts=(f[6],)),  # the first steady step: no send waited for
        f[6]: AfterPass(posts=(f[7],), waits_for=f[5]),  # f[5] sent nothing: nothing to wait for
        f[7]: AfterPass(waits_for=f[6]),
        b[0]: AfterPass(),
        b[1]: AfterPass(waits_for=b[0]),
        b[2]: AfterPass(waits_for=b[1]),
        b[3]: AfterPass(posts=(b[4],), blocking=True),  # the cool-down's send_backward_recv_backward
        b[4]: AfterPass(posts=(b[5],), blocking=True),
        b[5]: AfterPass(posts=(b[6],), blocking=True),
        b[6]: AfterPass(posts=(b[7],), blocking=True),
        b[7]: AfterPass(blocking=True),
    }
    first = posting(0, 4, 4, 2, combined=True)
    assert first.at_start == ()
    blocking = AfterPass(blocking=True)
    assert first.after == {
        f[0]: blocking, f[1]: blocking, f[2]: blocking,  # chunk 0 takes no input
        f[3]: AfterPass(posts=(f[4],), blocking=True),
        f[4]: AfterPass(posts=(f[5],), blocking=True),
        f[5]: AfterPass(posts=(f[6],), blocking=True),
        f[6]: AfterPass(posts=(f[7],), blocking=True),
        f[7]: AfterPass(blocking=True, then_posts=(b[0],)),
        **{x: AfterPass(posts=(y,), blocking=True) for x, y in zip(b, b[1:])},
        b[7]: blocking,
    }


def test_the_plain_table_by_hand():
    """PP 2, two micro-batches (1F1B, every exchange blocking): stage 0 posts the backward's
    receive with its steady forward's send (`send_forward_recv_backward`), and the cool-down's
    after the last steady send (`recv_backward`); stage 1 its next forward's with its backward's
    send (`send_backward_recv_forward`)."""
    f0, f1, b0, b1 = ("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)
    first, last = posting(0, 2, 2), posting(1, 2, 2)
    assert first.at_start == ()
    assert first.after == {f0: AfterPass(blocking=True), f1: AfterPass(posts=(b0,), blocking=True),
                           b0: AfterPass(blocking=True, then_posts=(b1,)), b1: AfterPass(blocking=True)}
    assert last.at_start == (f0,)
    assert last.after == {f0: AfterPass(blocking=True), b0: AfterPass(posts=(f1,), blocking=True),
                          f1: AfterPass(blocking=True), b1: AfterPass(blocking=True)}


CASES = [(2, 1, 2), (2, 1, 5), (4, 1, 3), (4, 1, 8), (2, 2, 2), (2, 2, 6), (4, 2, 4), (4, 2, 8), (3, 4, 6),
         (8, 2, 16), (4, 5, 4), (4, 20, 32), (8, 5, 32)]


@pytest.mark.parametrize("pp,vp,m", CASES)
@pytest.mark.parametrize("combined", [False, True])
def test_every_receive_is_posted_once_before_its_pass(pp, vp, m, combined):
    if combined and vp == 1:
        return  # the combined schedule runs inside the interleaved one only
    for s in range(pp):
        order = pipeline_order(s, pp, m, vp)
        p = posting(s, pp, m, vp, combined)
        assert set(p.after) == set(order)
        where = {slot: -1 for slot in p.at_start}
        for k, slot in enumerate(order):
            for posted in p.after[slot].posts + p.after[slot].then_posts:
                assert posted not in where, f"{posted} posted twice"
                where[posted] = k
        needed = {slot for slot in order if needs_receive(slot, s, pp, vp)}
        assert set(where) == needed
        assert all(where[slot] < order.index(slot) for slot in needed)


def _programs(pp: int, vp: int, m: int, combined: bool) -> list[list[tuple]]:
    """Every rank's pipeline calls in the order it issues them, under the tables: a pass alone
    (the interleaved schedule's every pass; the combined schedule's warm-up and cool-down), or a
    combined steady step (`canzona.pipeline.combined_order`), which waits for both passes' inputs
    before its layers and then makes the forward's exchange before the backward's
    (`TransformerModelChunkSchedulePlan.run`: `pre_forward`, `pre_backward`, the layers,
    `post_forward`, `post_backward`). An exchange: the pass's send, the receives it posts, the
    waits of a blocking one, the receives posted after them, the earlier send it waits for."""
    virtual = pp * vp

    def sent_to(s: int, slot) -> tuple | None:
        kind, mb, c = slot
        v = c * pp + s
        target = (kind, v + 1 if kind == "F" else v - 1, mb)
        return target if 0 <= target[1] < virtual else None

    programs = []
    for s in range(pp):
        p = posting(s, pp, m, vp, combined)
        prog = [("post", slot) for slot in p.at_start]
        steps = combined_order(s, pp, m, vp) if combined else [(slot,) for slot in pipeline_order(s, pp, m, vp)]
        for passes in steps:
            passes = [slot for slot in passes if slot is not None]
            prog += [("run", slot) for slot in passes]
            for slot in passes:
                step, target = p.after[slot], sent_to(s, slot)
                if target is not None:
                    prog.append(("send", target))
                prog += [("post", x) for x in step.posts]
                if step.blocking:
                    prog += [("arrived", x) for x in step.posts] + ([("delivered", target)] if target else [])
                prog += [("post", x) for x in step.then_posts]
                waited = sent_to(s, step.waits_for) if step.waits_for is not None else None
                if waited is not None:
                    prog.append(("delivered", waited))
        programs.append(prog)
    return programs


@pytest.mark.parametrize("pp,vp,m", CASES)
@pytest.mark.parametrize("combined", [False, True])
def test_the_rendezvous_cannot_deadlock(pp, vp, m, combined):
    """Every rank's program (`_programs`) run in lockstep: a pass once its input has arrived,
    a transfer once its send and its receive are each at the head of their rank's queue on the
    stream of their communicator (`p2p_stream`: past PP 2 the interleaved and the combined
    schedule's two directions between a pair share one, each rank's ops in the order it issued
    them), a blocking exchange's or a waited-for send once its transfer is done. All of it finishes."""
    if combined and vp == 1:
        return
    programs = _programs(pp, vp, m, combined)

    def key(s: int, slot) -> tuple:
        kind, mb, c = slot
        return kind, c * pp + s, mb

    def ends(k: tuple) -> tuple[int, int]:
        """The stages a transfer's receive `k` goes from and to."""
        kind, v, _ = k
        return (v - 1 if kind == "F" else v + 1) % pp, v % pp

    delivered = set()
    queues: dict[tuple[int, str], list] = {}  # (stage, stream) -> its ops not done, in issue order
    pos = [0] * pp
    while any(pos[s] < len(programs[s]) for s in range(pp)):
        moved = False
        heads = {}
        for (s, _), q in queues.items():
            if q:
                heads.setdefault(q[0][1], set()).add((s, q[0][0]))
        for k, sides in heads.items():
            src, dst = ends(k)
            if {(src, "send"), (dst, "recv")} <= sides:
                stream = p2p_stream(src, dst, pp, vp)
                queues[(src, stream)].pop(0)
                queues[(dst, stream)].pop(0)
                delivered.add(k)
                moved = True
        for s in range(pp):
            while pos[s] < len(programs[s]):
                op, arg = programs[s][pos[s]]
                if op == "run":
                    ready = not needs_receive(arg, s, pp, vp) or key(s, arg) in delivered
                elif op == "arrived":
                    ready = key(s, arg) in delivered
                elif op == "delivered":
                    ready = arg in delivered
                else:
                    ready = True
                if not ready:
                    break
                if op in ("send", "post"):
                    k = arg if op == "send" else key(s, arg)
                    queues.setdefault((s, p2p_stream(*ends(k), pp, vp)), []).append(("send" if op == "send" else "recv", k))
                pos[s] += 1
                moved = True
        assert moved, f"pp {pp} vp {vp} m {m}: stuck at {[programs[s][pos[s]:pos[s] + 1] for s in range(pp)]}"
    assert not any(queues.values())
