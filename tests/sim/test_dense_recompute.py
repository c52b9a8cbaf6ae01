"""Full activation recompute of a dense transformer block with collectives (sim.model_work,
sim.iteration, sim.fsdp, sim.search): Megatron's `_checkpointed_forward` (and torchtitan's
checkpoint wrapper) re-runs each layer's whole forward in the backward, so at TP > 1 the re-run
issues the block's sequence-parallel all-gather and reduce-scatter again, and under CP its
attention ring's K/V exchanges; at TP 1 without CP nothing moves and the re-run stays the
forward's kernels inside the backward block (`sim.model_work.rerun_forward`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from canzona.cost import DeviceRate
from canzona.hardware import load_profile
from canzona.models import resolve_model
from sim.model_work import micro_batch_work
from sim.options import RunOptions
from sim.search import block_floor, time_floor, tp_costs
from sim.simulate import SimConfig, simulate
from sim.streams import CP_COMM, TP_COMM
from sim.workload import Workload

H100 = load_profile("h100-sxm")
RATE = DeviceRate.from_profile(H100)
WL = Workload(seq_len=1024, global_batch=8, micro_batch=1)
# no gradient reduction beside the backward: the compute stream is one chain per micro-batch
TP2 = SimConfig(model="qwen3-1.7b", gpus=8, tp=2, optimizer="adamw", workload=WL,
                options=RunOptions(overlap_grad_reduce=False))
CP2 = replace(TP2, tp=1, cp=2)


def _work(cfg: SimConfig, recompute: str):
    spec, arch = resolve_model(cfg.model, cfg.tp)
    wl = cfg.workload
    return micro_batch_work(spec, cfg.tp, wl.tokens_per_micro_batch, wl.seq_len, arch.q_dim, arch.hidden, arch.vocab,
                            RATE, recompute=recompute, cp=cfg.cp, kv_dim=arch.kv_dim)


def _with(cfg: SimConfig, **options) -> SimConfig:
    return replace(cfg, options=replace(cfg.options, **options))


def _spans(result, needle: str, stream: str | None = None):
    return [s for s in result.spans if s.phase == "A" and s.kind == "comm" and s.rank == 0 and needle in s.name
            and (stream is None or s.stream == stream)]


def _blocks(cfg: SimConfig) -> int:
    return sum(len(layer) for layer in _work(cfg, "none").forward)


@pytest.mark.parametrize("cfg", [TP2, CP2, replace(TP2, cp=2)], ids=["tp2", "cp2", "tp2-cp2"])
def test_full_recompute_carries_each_forward_block(cfg):
    """At TP > 1 every backward block, and under CP the attention block, carries its forward
    block (the none run's), which it runs again first; its own seconds no longer hold the redo. A
    block without collectives (the MLP at TP 1) keeps the redo inside."""
    none, full = _work(cfg, "none"), _work(cfg, "full")
    for k in range(len(full.layer_ids)):
        assert full.forward[k] == none.forward[k]
        for f, b, b0 in zip(full.forward[k], reversed(full.backward[k]), reversed(none.backward[k])):
            assert b0.recompute is None
            if cfg.tp == 1 and not f.ring_steps:
                assert b.recompute is None and b.middle_s == pytest.approx(b0.middle_s + f.seconds)
                continue
            assert b.recompute == f and b.seconds == pytest.approx(b0.seconds)
            assert b.ring_steps == b0.ring_steps and b.ring_bytes == b0.ring_bytes
            if cfg.cp > 1 and f.name.endswith(".0"):  # the attention block's forward ring, re-run whole
                assert b.recompute.ring_steps == cfg.cp and len(b.recompute.ring_bytes) == cfg.cp - 1


@pytest.mark.parametrize("overlap", [True, False])
def test_backward_issues_the_forward_tp_collectives_again(overlap):
    cfg = _with(TP2, tp_comm_overlap=overlap)
    m = WL.micro_batches(cfg.gpus // cfg.tp)
    none, full = (simulate(_with(cfg, recompute=r)) for r in ("none", "full"))
    assert not _spans(none, "recompute")
    for op in ("all-gather", "reduce-scatter"):
        again = _spans(full, f"recompute {op}", TP_COMM)
        forward = [s for s in _spans(full, op, TP_COMM) if " fwd " in s.name]
        # the forward's again, one for one: every block of every layer and micro-batch (a
        # pipelined reduce-scatter's parts each)
        assert len(forward) >= _blocks(cfg) * m and len(again) == len(forward)
        assert sorted(s.name.replace(" bwd ", " fwd ").replace(" recompute", "") for s in again) == \
            sorted(s.name for s in forward)
        # the recompute's come first in the block's backward, before its own
        block = [s for s in _spans(full, op, TP_COMM) if s.name.startswith("mb0 bwd layer 0.1 ")]
        assert min(block, key=lambda s: s.start).name.startswith("mb0 bwd layer 0.1 recompute")
        assert len(_spans(full, op, TP_COMM)) == len(_spans(none, op, TP_COMM)) + len(again)


def test_full_recompute_costs_at_least_the_forward_and_its_exposed_tp_collectives():
    """Without TP communication overlap the re-run's all-gather and reduce-scatter are exposed:
    each micro-batch's backward grows by at least the forward's kernels and one all-gather and one
    reduce-scatter per block at their least seconds (kernels and collectives only ever stretch)."""
    cfg = _with(TP2, tp_comm_overlap=False)
    ag, rs = tp_costs(cfg, resolve_model(cfg.model), H100)
    work = _work(cfg, "full")
    kernels = sum(b.seconds for layer in work.forward for b in layer)
    comm = _blocks(cfg) * (ag + rs)
    assert comm > 0.05 * kernels
    m = WL.micro_batches(cfg.gpus // cfg.tp)
    none, full = (simulate(_with(cfg, recompute=r)).forward_backward_s for r in ("none", "full"))
    assert full - none >= m * (kernels + comm) * (1 - 1e-9)


def test_context_parallel_ring_runs_again_under_full_recompute():
    """TE's ring attention (AttnFuncWithCPAndKVP2P) runs inside the checkpointed layer: the
    re-run forward exchanges K/V around the CP ring again, on the CP stream."""
    _, arch = resolve_model(CP2.model)
    m = WL.micro_batches(CP2.gpus // CP2.cp)
    none, full = (simulate(_with(CP2, recompute=r)) for r in ("none", "full"))
    assert not _spans(none, "recompute")
    again = _spans(full, "recompute cp ring")
    assert len(again) == arch.layers * m * (CP2.cp - 1) and {s.stream for s in again} == {CP_COMM}
    assert len(_spans(full, "cp ring")) == len(_spans(none, "cp ring")) + len(again)


def test_fsdp_with_tp_gathers_and_scatters_again():
    """torchtitan's full activation checkpointing under TP re-runs the layer's forward, its
    sequence-parallel redistributions with it (`sim.fsdp._FsdpRun._tp_block`), up to torch's
    early stop: the MLP block's output is not reduce-scattered again."""
    # TP2's --no-overlap-grad-reduce is the ZeRO-1 layout's (refused under --fsdp: sim.fsdp.check_fsdp)
    cfg = _with(replace(TP2, fsdp=True), recompute="full", overlap_grad_reduce=True)
    _, arch = resolve_model(cfg.model)
    m = WL.micro_batches(cfg.gpus // cfg.tp)
    result = simulate(cfg)
    for op, blocks in (("tp all-gather", 2), ("tp reduce-scatter", 1)):
        again = _spans(result, f"recompute {op}", TP_COMM)
        assert len(again) == arch.layers * blocks * m


@pytest.mark.parametrize("cfg", [TP2, _with(TP2, tp_comm_overlap=False), CP2, replace(TP2, cp=2, gpus=8),
                                 replace(TP2, pp=2, gpus=8)],
                         ids=["tp2", "tp2-serial", "cp2", "tp2-cp2", "tp2-pp2"])
def test_search_floor_counts_the_rerun_and_stays_below(cfg):
    model = resolve_model(cfg.model)
    floors = {r: time_floor(_with(cfg, recompute=r), model, RATE, H100) for r in ("none", "full")}
    assert floors["full"] > floors["none"]
    assert floors["full"] <= simulate(_with(cfg, recompute="full")).iteration_time_s


def _span(result, name: str):
    return next(s for s in result.spans if s.phase == "A" and s.rank == 0 and s.name == name)


def test_first_forward_under_full_recompute_gathers_before_its_gemms():
    """Megatron's checkpoint function runs a layer's first forward under torch.no_grad(), where
    TE's LayerNormLinear gathers its input with NCCL before the QKV / fc1 GEMMs instead of under
    them (userbuffers off without grad); the re-run in the backward has grad, so the overlap holds
    there as in any forward. Without recompute the gather runs under the first GEMMs."""
    none, full = (simulate(_with(TP2, recompute=r)) for r in ("none", "full"))
    for i in (0, 1):  # the attention block (QKV) and the MLP block (fc1)
        gather, first = (_span(full, f"mb0 fwd layer 3.{i} {p}") for p in ("all-gather", "first"))
        assert first.start >= gather.end
        again, again_first = (_span(full, f"mb0 bwd layer 3.{i} recompute {p}") for p in ("all-gather", "first"))
        assert again_first.start < again.end
        overlapped, none_first = (_span(none, f"mb0 fwd layer 3.{i} {p}") for p in ("all-gather", "first"))
        assert none_first.start < overlapped.end
    # the reduce-scatter still overlaps the last GEMMs: it starts before they end
    scatter = [s for s in full.spans if s.rank == 0 and s.name.startswith("mb0 fwd layer 3.1 reduce-scatter")]
    assert min(s.start for s in scatter) < _span(full, "mb0 fwd layer 3.1 last").end
    # without the overlap the first micro-batch's forward is in series either way: unchanged
    serial = _with(TP2, tp_comm_overlap=False)

    def first_forward(recompute: str):
        return [s for s in simulate(_with(serial, recompute=recompute)).spans
                if s.name.startswith("mb0 fwd layer ") and s.rank == 0]

    assert first_forward("full") == first_forward("none")


def test_floor_counts_the_no_grad_gather_in_series():
    """The search's block floor of a forward without grad (`forward_without_grad`) waits for the
    all-gather before the first GEMMs: min(first GEMMs, all-gather) more than the overlapped one."""
    b = _work(TP2, "full").forward[3][1]
    ag, rs = tp_costs(TP2, resolve_model(TP2.model), H100)
    with_grad, without = (block_floor(b, 1, (ag, rs), True, sms=H100.gpu.sms, no_grad=g) for g in (False, True))
    assert without - with_grad == pytest.approx(min(b.first_s, ag), rel=1e-9)
