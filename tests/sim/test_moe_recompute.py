"""Activation recompute of a mixture-of-experts layer (sim.model_work, sim.iteration, sim.fsdp,
sim.search): full recompute runs the layer's whole forward again before its backward, the expert
block's token dispatch and combine (and expert TP's collectives) with it, as Megatron's
`_checkpointed_forward` and NeMo AutoModel's `checkpoint_wrapper` do; selective-op saves the
dispatch and combine outputs and recomputes the experts' kernels only; dense blocks at TP 1
without CP are as before."""

from __future__ import annotations

from dataclasses import replace

import pytest

from canzona.cost import DeviceRate
from canzona.hardware import load_profile
from canzona.models import resolve_model
from sim.ep_dispatch import DEEPEP, HYBRIDEP, EpDispatcher, ep_costs
from sim.model_work import micro_batch_work
from sim.options import RunOptions
from sim.search import time_floor
from sim.simulate import SimConfig, simulate
from sim.streams import EP_COMM, ETP_COMM
from sim.topology import Cluster
from sim.workload import Workload

H100 = load_profile("h100-sxm")
RATE = DeviceRate.from_profile(H100)
WL = Workload(seq_len=512, global_batch=8, micro_batch=1)
# one micro-batch a rank, no gradient reduction beside the backward: the backward is one chain
MOE = SimConfig(model="qwen3-30b-a3b", gpus=8, tp=1, ep=8, optimizer="adamw", workload=WL,
                options=RunOptions(overlap_grad_reduce=False))
FLEX = {"alltoall": EpDispatcher(),
        DEEPEP: EpDispatcher(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=DEEPEP),
        HYBRIDEP: EpDispatcher(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=HYBRIDEP)}


def _work(cfg: SimConfig, recompute: str):
    spec, arch = resolve_model(cfg.model)
    wl = cfg.workload
    return micro_batch_work(spec, cfg.tp, wl.tokens_per_micro_batch, wl.seq_len, arch.q_dim, arch.hidden, arch.vocab,
                            RATE, recompute=recompute, experts=arch.moe, ep=cfg.ep, etp=cfg.etp, kv_dim=arch.kv_dim,
                            dispatcher=cfg.options.ep_dispatcher)


def _with(cfg: SimConfig, **options) -> SimConfig:
    return replace(cfg, options=replace(cfg.options, **options))


def _spans(result, needle: str):
    return [s for s in result.spans if s.phase == "A" and s.kind == "comm" and s.rank == 0 and needle in s.name]


@pytest.mark.parametrize("dispatcher", sorted(FLEX))
def test_full_recompute_reruns_the_forward_expert_block(dispatcher):
    """Under full recompute each expert block's backward carries its forward block, dispatch and
    combine traffic included (HybridEP's with the forward's preprocessing: Megatron's
    `_HybridEPManager.combine` drops the handle, so the re-run dispatches without one); its own
    compute no longer holds the experts' redo."""
    cfg = _with(MOE, ep_dispatcher=FLEX[dispatcher])
    none, full = _work(cfg, "none"), _work(cfg, "full")
    for k in range(len(full.layer_ids)):
        fwd, bwd = full.forward[k][-1], full.backward[k][0]
        assert fwd.ep_bytes > 0 and bwd.recompute == fwd == none.forward[k][-1]
        assert bwd.recompute.ep_flex == fwd.ep_flex and (fwd.ep_flex is None or fwd.ep_flex.forward)
        assert bwd.seconds == pytest.approx(none.backward[k][0].seconds)  # the redo is the nested block's
        assert none.backward[k][0].recompute is None
        # the attention block (dense, no collectives re-run here) keeps its redo inside
        assert full.backward[k][-1].recompute is None
        assert full.backward[k][-1].middle_s == pytest.approx(none.backward[k][-1].middle_s + full.forward[k][0].seconds)


@pytest.mark.parametrize("fsdp", [False, True])
def test_full_recompute_dispatches_and_combines_again_on_the_ep_stream(fsdp):
    cfg = replace(MOE, fsdp=fsdp, options=RunOptions(ep_dispatcher=FLEX[DEEPEP]))
    _, arch = resolve_model(cfg.model)
    m = WL.micro_batches(8)
    none, full = (simulate(_with(cfg, recompute=r)) for r in ("none", "full"))
    # under FSDP torch's checkpoint stops the re-run before DeepEP's combine
    # (tests/sim/test_checkpoint_early_stop.py): the dispatch alone runs again
    assert bool(_spans(full, "recompute combine")) is not fsdp
    for op in ("dispatch",) if fsdp else ("dispatch", "combine"):
        assert not _spans(none, f"recompute {op}")
        again = _spans(full, f"recompute {op}")
        assert len(again) == arch.layers * m
        assert len(_spans(full, op)) == 3 * len(_spans(none, op)) // 2  # forward, recompute, backward
        assert {s.stream for s in again} == {s.stream for s in _spans(full, f"fwd layer 0.experts {op}")} == {EP_COMM}
        # the recompute's comes before the layer's backward's
        layer = [s for s in _spans(full, op) if "bwd layer 0.experts" in s.name]
        assert min(layer, key=lambda s: s.start).name.endswith(f"recompute {op}")


def _forward_again(cfg: SimConfig) -> tuple[float, float]:
    """One micro-batch's forward kernels (every layer's blocks) and its expert blocks' dispatch and
    combine at their least seconds (`sim.ep_dispatch.ep_costs`)."""
    work = _work(cfg, "full")
    experts = cfg.expert_cluster(Cluster(cfg.gpus, cfg.tp, H100.node.gpus, cfg.pp))
    kernels = sum(b.seconds for layer in work.forward for b in layer)
    comm = sum(c.seconds for layer in work.forward for b in layer if b.ep_bytes
               for c in ep_costs(b.ep_bytes, b.ep_received, b.ep_flex, experts, H100))
    return kernels, comm


def test_full_recompute_costs_at_least_the_forward_and_its_collectives_again():
    """The backward of one micro-batch grows by at least the forward's kernels and its expert
    blocks' dispatch and combine at their own prices (kernels only ever stretch)."""
    cfg = _with(MOE, ep_dispatcher=FLEX[DEEPEP])
    kernels, comm = _forward_again(cfg)
    assert comm > 0.1 * kernels
    none, full = (simulate(_with(cfg, recompute=r)).forward_backward_s for r in ("none", "full"))
    assert full - none >= (kernels + comm) * (1 - 1e-9)


def test_expert_tp_collectives_run_again_under_full_recompute():
    cfg = SimConfig(model="qwen3-30b-a3b", gpus=8, tp=2, ep=4, etp=2, optimizer="adamw", workload=WL,
                    options=RunOptions(recompute="full"))
    _, arch = resolve_model(cfg.model)
    result = simulate(cfg)
    m = WL.micro_batches(cfg.gpus // cfg.tp)
    for op in ("etp all-gather", "etp reduce-scatter"):
        again = _spans(result, f"recompute {op}")
        assert len(again) == arch.layers * m and {s.stream for s in again} == {ETP_COMM}


def test_selective_op_saves_the_dispatch_and_recomputes_the_experts_kernels():
    """torchtitan's per-op policy saves the all-to-all's (and DeepEP's, HybridEP's) outputs: no
    collective re-runs; the experts' GEMMs, permutes and SwiGLU (and the layer's pre-MLP norm and
    residual add) all run again: the forward expert block's kernels."""
    cfg = _with(MOE, ep_dispatcher=FLEX[DEEPEP])
    none, sel = _work(cfg, "none"), _work(cfg, "selective-op")
    for k in range(len(sel.layer_ids)):
        fwd, bwd = sel.forward[k][-1], sel.backward[k][0]
        assert bwd.recompute is None
        assert bwd.middle_s == pytest.approx(none.backward[k][0].middle_s + fwd.seconds)
    assert not _spans(simulate(_with(cfg, recompute="selective-op")), "recompute")


def test_dense_layers_at_tp1_and_experts_without_ep_rerun_no_collective():
    """A dense model at TP 1 without CP, and experts at EP 1, re-run no collective: their full
    recompute is the forward's kernels inside the backward block, as before (dense blocks at TP > 1
    or under CP: tests/sim/test_dense_recompute.py)."""
    for cfg in (SimConfig(model="qwen3-1.7b", gpus=8, tp=1, optimizer="adamw", workload=WL),
                replace(MOE, ep=1)):
        none, full = _work(cfg, "none"), _work(cfg, "full")
        for k in range(len(full.layer_ids)):
            for f, b, b0 in zip(full.forward[k], reversed(full.backward[k]), reversed(none.backward[k])):
                assert b.recompute is None
                assert b.middle_s == pytest.approx(b0.middle_s + f.seconds)
        assert not _spans(simulate(_with(cfg, recompute="full")), "recompute")


def test_search_floor_counts_the_recompute_and_stays_below():
    cfg = _with(MOE, ep_dispatcher=FLEX[DEEPEP])
    model = resolve_model(cfg.model)
    floors = {r: time_floor(_with(cfg, recompute=r), model, RATE, H100) for r in ("none", "full")}
    kernels, comm = _forward_again(cfg)
    m = WL.micro_batches(8)
    assert floors["full"] - floors["none"] >= m * (kernels + comm) * (1 - 1e-9)
    assert floors["full"] <= simulate(_with(cfg, recompute="full")).iteration_time_s
