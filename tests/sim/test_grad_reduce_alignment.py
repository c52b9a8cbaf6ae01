"""Megatron's align_grad_reduce (`RunOptions.align_grad_reduce`, on by default): under pipeline
parallelism with overlap_grad_reduce the schedule launches each model chunk's gradient reductions
at once, pipeline rank r `r` backward steps after the chunk's last micro-batch (interleaved), or
after the last backward on every rank but the first (plain 1F1B); without it the backward hooks
launch each bucket as its last layer's backward ends. Checked on the spans of the DP stream."""

from __future__ import annotations

from dataclasses import replace

import pytest

from canzona.errors import SpecError
from canzona.models import resolve_model
from canzona.pipeline import chunk_layers, stage_spec
from canzona.step_collectives import backward_layers
from sim.options import RunOptions
from sim.simulate import SimConfig, simulate
from sim.streams import DP_COMM
from sim.workload import Workload

# qwen3-0.6b: 28 layers, chunks of 7 at PP 2 x VP 2; DP 4 of TP 2 over 16 GPUs (two nodes: the
# DP groups cross the network), 8 micro-batches
BASE = SimConfig(model="qwen3-0.6b", gpus=16, tp=2, pp=2, vp=2, optimizer="adamw", policy="zero1-gather",
                 workload=Workload(2048, 32))
ALIGNED, HOOKS = RunOptions(), RunOptions(align_grad_reduce=False)
_cache: dict[SimConfig, object] = {}


def sim(cfg: SimConfig):
    if cfg not in _cache:
        _cache[cfg] = simulate(cfg)
    return _cache[cfg]


def _syncs(result, rank: int) -> dict[int, object]:
    """Bucket index -> its gradient reduction's span on `rank` (phase A)."""
    return {int(s.name.split()[-1]): s for s in result.spans
            if s.rank == rank and s.phase == "A" and s.stream == DP_COMM and s.name.startswith("grad sync bucket")}


def _backward_end(result, rank: int) -> float:
    return max(s.end for s in result.spans if s.rank == rank and s.phase == "A" and s.kind == "compute")


def _chunk_of_buckets(result, stage: int = 0) -> dict[int, int]:
    """Stage 0's bucket index -> the model chunk whose backward completes it."""
    cfg = result.config
    model, arch = resolve_model(cfg.model, cfg.tp)
    chunk = {layer: c for c in range(cfg.vp) for layer in chunk_layers(arch.layers, cfg.pp, stage, c, cfg.vp)}
    done = backward_layers(result.plan, stage_spec(model, cfg.pp, stage, arch.layers, cfg.vp))
    return {b: chunk[layer] for b, layer in done.items()}


def test_the_default_is_megatrons():
    assert RunOptions().align_grad_reduce is True and RunOptions().overlap_grad_reduce is True


def test_interleaved_the_last_chunk_is_launched_after_the_last_backward():
    """Stage 0 under VP 2: aligned, the buckets chunk 0 completes start once every backward is done
    (its last micro-batch is the stage's last backward step) and chunk 1's under chunk 0's
    backwards; with the hooks some of chunk 0's start inside that last backward."""
    aligned, hooks = sim(replace(BASE, options=ALIGNED)), sim(replace(BASE, options=HOOKS))
    chunk = _chunk_of_buckets(aligned)
    assert set(chunk.values()) == {0, 1}  # both chunks complete buckets
    end = _backward_end(aligned, 0)
    spans = _syncs(aligned, 0)
    assert all(spans[b].start >= end - 1e-12 for b, c in chunk.items() if c == 0)
    assert all(spans[b].start < end for b, c in chunk.items() if c == 1)
    hook_spans, hook_end = _syncs(hooks, 0), _backward_end(hooks, 0)
    assert any(hook_spans[b].start < hook_end for b, c in chunk.items() if c == 0)


def test_aligned_launches_line_up_across_stages():
    """Rank r launches `r` backward steps late, the steps by which it runs ahead in the cool-down:
    the two stages' first reductions (chunk 1's) start together, where the hooks start stage 1's
    about a backward step earlier."""
    aligned, hooks = sim(replace(BASE, options=ALIGNED)), sim(replace(BASE, options=HOOKS))
    stage1 = BASE.gpus // BASE.pp  # stage 1's first rank

    def gap(r) -> float:
        return abs(_syncs(r, 0)[0].start - _syncs(r, stage1)[0].start)

    assert gap(hooks) > 0
    assert gap(aligned) < gap(hooks) / 5


def test_per_chunk_launch_hides_what_an_end_of_step_launch_exposes():
    """The schedule launches chunk 1's reductions under chunk 0's backwards: what follows stage 0's
    last backward is shorter than with every reduction after it (no overlap) by at least those."""
    aligned = sim(replace(BASE, options=ALIGNED))
    at_end = sim(replace(BASE, options=RunOptions(overlap_grad_reduce=False)))
    chunk = _chunk_of_buckets(aligned)
    hidden = sum(s.end - s.start for b, s in _syncs(aligned, 0).items() if chunk[b] == 1)
    assert hidden > 0

    def exposed(r) -> float:
        return r.grad_sync_end_s - _backward_end(r, 0)

    assert exposed(at_end) - exposed(aligned) >= 0.9 * hidden


def test_plain_1f1b_keeps_the_hooks_on_the_first_rank_only():
    """VP 1: stage 0 reduces under its last backward (the hooks), stage 1 after its last backward,
    in the bubble before stage 0 is done."""
    cfg = replace(BASE, vp=1, options=ALIGNED)
    r = sim(cfg)
    stage1 = cfg.gpus // cfg.pp
    assert min(s.start for s in _syncs(r, 0).values()) < _backward_end(r, 0)
    assert min(s.start for s in _syncs(r, stage1).values()) >= _backward_end(r, stage1) - 1e-12
    hooks = sim(replace(cfg, options=HOOKS))
    assert min(s.start for s in _syncs(hooks, stage1).values()) < _backward_end(hooks, stage1)


@pytest.mark.parametrize("change, needle", [
    (dict(pp=1, vp=1, options=HOOKS), "changes nothing at --pp 1"),
    (dict(options=RunOptions(overlap_grad_reduce=False, align_grad_reduce=False)),
     "changes nothing without --overlap-grad-reduce"),
])
def test_without_a_schedule_function_it_is_refused(change, needle):
    """Without pipelining, or without overlap_grad_reduce, Megatron sets no grad_sync_func: the
    option would change nothing, so off it is one line, not a silent no-op."""
    cfg = replace(BASE, **change)
    with pytest.raises(SpecError, match=needle) as e:
        cfg.check()
    assert "\n" not in str(e.value)
    # on, the default, it is accepted there
    cfg.__class__.check(replace(cfg, options=replace(cfg.options, align_grad_reduce=True, overlap_grad_reduce=True)))


def test_under_fsdp_it_is_refused():
    cfg = SimConfig(model="qwen3-0.6b", gpus=16, tp=2, optimizer="adamw", fsdp=True, workload=Workload(2048, 32),
                    options=HOOKS)
    with pytest.raises(SpecError, match="--no-align-grad-reduce is the distributed optimizer's"):
        cfg.check()


def test_a_bad_value_is_one_line():
    with pytest.raises(SpecError, match="align_grad_reduce must be True or False") as e:
        RunOptions(align_grad_reduce="yes").check()
    assert "\n" not in str(e.value)
