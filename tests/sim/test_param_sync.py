"""Where the simulated forward issues the last step's parameter all-gathers (`sim.param_sync`):
each a bucket ahead of the forward without an interleaved pipeline (Megatron's
`finish_param_sync` dispatching the next bucket group), a model chunk at a time with one (the
schedule's `param_sync_func`, the chunk's buckets in bucket order)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from sim.options import RunOptions
from sim.param_sync import aligned, chunk_issued_before
from sim.simulate import SimConfig, simulate
from sim.workload import Workload

# DP 8, no pipeline: 28 layers, canzona's buckets gathered under the first forward
CHAINED = SimConfig(model="qwen3-0.6b", gpus=8, tp=1, policy="canzona", workload=Workload(1024, 8))
# PP 2 x VP 3, DP 2: 36 layers, 6 a chunk; stage 0 holds layers 0-5, 12-17, 24-29
INTERLEAVED = SimConfig(model="qwen3-4b", gpus=4, tp=1, pp=2, vp=3, policy="canzona", workload=Workload(1024, 4))


def _gathers(result, rank: int):
    """Rank's parameter gathers under the forward (Megatron's names; the runtime's `parameters`)."""
    return sorted((s for s in result.spans if s.phase == "A" and s.rank == rank and s.stream == "dp-comm"
                   and (s.name.startswith("param gather") or "parameters" in s.name)), key=lambda s: s.start)


def _layer_starts(result, rank: int) -> dict[str, float]:
    """When each first-forward layer (micro-batch 0) starts its first block."""
    return {s.name: s.start for s in result.spans if s.phase == "A" and s.rank == rank
            and re.fullmatch(r"mb0 fwd layer \d+\.0", s.name)}


def test_each_gather_waits_for_the_forward_to_reach_the_bucket_before_it():
    """Without an interleaved pipeline a gather is issued when the forward's pre-hook has waited
    for the one before it, on the NCCL stream behind the compute issued so far: it starts at its
    predecessor's end or, where the forward is behind, exactly when the layer that waited for its
    predecessor starts. Here the gathers outrun the forward from the fourth on, each starting with a
    layer (all of them started back to back at the step's start before)."""
    r = simulate(CHAINED)
    gathers = _gathers(r, 0)
    starts = set(_layer_starts(r, 0).values())
    assert len(gathers) >= 6
    behind = 0
    for before, g in zip(gathers, gathers[1:]):
        assert g.start >= before.end - 1e-12
        if g.start > before.end + 1e-9:
            assert any(g.start == pytest.approx(t, abs=1e-12) for t in starts)
            behind += 1
    assert behind >= 3


def test_the_interleaved_schedule_gathers_a_chunk_at_a_time():
    """PP 2 x VP 3: chunks 0 and 1 before the warm-up, each in bucket order (its last layers'
    bucket first, so the chunk's first layer waits for all of it); chunk 2 before forward
    (2 - 1) * 2 - stage: stage 0's third forward (micro-batch 0 of chunk 1, layer 12), stage 1's
    second (micro-batch 1 of chunk 0, layer 6)."""
    r = simulate(INTERLEAVED)
    for rank, stage, forward_layer in [(0, 0, "mb0 fwd layer 12.0"), (2, 1, "mb1 fwd layer 6.0")]:
        gathers = _gathers(r, rank)
        assert gathers[0].name == "param gather adamw" and gathers[0].start == 0
        prefix = 1
        while prefix < len(gathers) and gathers[prefix].start == pytest.approx(gathers[prefix - 1].end, abs=1e-12):
            prefix += 1
        first, rest = gathers[1:prefix], gathers[prefix:]
        buckets = [int(g.name.rsplit(" ", 1)[1]) for g in first]
        half = len(buckets) // 2
        assert len(buckets) == 2 * half and len(rest) == half  # three chunks of as many buckets
        chunk0, chunk1 = buckets[:half], buckets[half:]
        assert chunk0 == sorted(chunk0) and chunk1 == sorted(chunk1)  # bucket order: last layers first
        assert min(chunk0) > max(chunk1)  # chunk 0 holds the earlier layers, the higher buckets
        (forward,) = [s for s in r.spans if s.phase == "A" and s.rank == rank and s.name == forward_layer]
        assert rest[0].start == pytest.approx(forward.start, abs=1e-12)
        assert all(b.start == pytest.approx(a.end, abs=1e-12) for a, b in zip(rest, rest[1:]))
        if stage == 0:  # its first layer waits for the whole of chunk 0
            assert _layer_starts(r, rank)["mb0 fwd layer 0.0"] == pytest.approx(gathers[half].end, abs=1e-12)


def test_the_chunk_dispatch_table_by_hand():
    """Megatron's `forward_step_helper_preprocess` at PP 4 x VP 4: chunk c > 1 before forward
    (c - 1) * 4 - stage; at VP 2 nothing past the first two chunks; only with a pipeline and VP."""
    for stage in range(4):
        got = {k: chunk_issued_before(k, stage, 4, 4) for k in range(32)}
        assert {k: c for k, c in got.items() if c is not None} == {4 - stage: 2, 8 - stage: 3}
        assert all(chunk_issued_before(k, stage, 4, 2) is None for k in range(16))
    assert aligned(4, 2) and not aligned(4, 1) and not aligned(1, 1)


def test_canzonas_runtime_issues_every_gather_in_its_step():
    """Nothing changes for canzona's runtime (runtime mode): its `step()` issues every gather, so
    they run back to back from the forward's start, in forward order, as before."""
    r = simulate(replace(CHAINED, options=RunOptions(collectives="runtime")))
    gathers = _gathers(r, 0)
    assert len(gathers) >= 6 and gathers[0].start == 0
    assert all(b.start == pytest.approx(a.end, abs=1e-12) for a, b in zip(gathers, gathers[1:]))
