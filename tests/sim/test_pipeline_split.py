"""Uneven pipeline splits (`canzona.pipeline.PipelineSplit`, Megatron's
`account_for_embedding_in_pipeline_split` / `account_for_loss_in_pipeline_split` and its first /
last stage layer counts): the layers each model chunk holds against Megatron's own arithmetic,
Megatron's refusals as one error line, the memory model per stage, and the simulator."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from canzona.errors import SpecError
from canzona.memory import MemorySetup, activation_breakdown, layer_activation_bytes
from canzona.models import resolve_model
from canzona.pipeline import (
    EVEN_SPLIT,
    PipelineSplit,
    check_split,
    check_vp,
    chunk_layers,
    chunk_spec,
    peak_in_flight,
    peak_layers_in_flight,
    pipeline_order,
    rank_layers,
    stage_spec,
)
from sim.simulate import SimConfig, layer_dims, simulate
from sim.workload import Workload
from tests.cli_helpers import error_line, invoke

BOTH = PipelineSplit(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
EMBEDDING = PipelineSplit(account_for_embedding_in_pipeline_split=True)
LOSS = PipelineSplit(account_for_loss_in_pipeline_split=True)


def megatron_chunk(layers: int, pp: int, vp: int, stage: int, chunk: int, split: PipelineSplit) -> tuple[int, int]:
    """(offset, count) of a chunk's decoder layers as Megatron-LM computes them
    (transformer_block.py get_num_layers_to_build, transformer_layer.py get_transformer_layer_offset),
    written out here independently of canzona.pipeline: the oracle."""
    first, last = split.num_layers_in_first_pipeline_stage, split.num_layers_in_last_pipeline_stage
    if first is not None or last is not None:
        middle_stages = pp - (first is not None) - (last is not None)
        middle_layers = layers - (first or 0) - (last or 0)
        per_rank = middle_layers // middle_stages if middle_stages else 0
        if stage == 0 and first is not None:
            per_rank = first
        if stage == pp - 1 and last is not None:
            per_rank = last
        count = per_rank // vp
        round_size = (first or 0) // vp + middle_layers // vp + (last or 0) // vp
        middle_rank = stage - 1 if first is not None else stage
        if vp == 1:  # Megatron's branch without a virtual pipeline
            per_middle = middle_layers // middle_stages if middle_stages else 0
            return (0 if stage == 0 else middle_rank * per_middle + (first or 0)), count
        offset = chunk * round_size if stage == 0 else \
            chunk * round_size + (first or 0) // vp + middle_rank * (middle_layers // vp // middle_stages)
        return offset, count
    e, loss = split.accounted
    total = layers + e + loss
    count = total // pp // vp
    offset = chunk * (total // vp) + stage * count
    if e and not (stage == 0 and chunk == 0):
        offset -= 1
    if e and stage == 0 and chunk == 0:
        count -= 1
    if loss and stage == pp - 1 and chunk == vp - 1:
        count -= 1
    return offset, count


CASES = [
    (94, 8, 4, BOTH),  # Qwen3-235B-A22B on Megatron-Bridge's H100 layout: (94 + 2) / 32 = 3 a chunk
    (94, 8, 1, BOTH),  # 12 a stage, the first and last 11
    (28, 2, 3, BOTH),
    (30, 4, 1, BOTH),
    (63, 8, 2, EMBEDDING),
    (63, 4, 4, LOSS),
    (2, 2, 2, BOTH),  # a chunk of one slot: the first and last chunks hold no decoder layer
    (30, 4, 2, PipelineSplit(num_layers_in_first_pipeline_stage=4, num_layers_in_last_pipeline_stage=6)),
    (61, 4, 1, PipelineSplit(num_layers_in_first_pipeline_stage=16)),
    (62, 8, 2, PipelineSplit(num_layers_in_last_pipeline_stage=6)),
    (36, 3, 2, PipelineSplit(num_layers_in_first_pipeline_stage=14, num_layers_in_last_pipeline_stage=10)),
    (36, 2, 1, PipelineSplit(num_layers_in_first_pipeline_stage=20, num_layers_in_last_pipeline_stage=16)),
]


@pytest.mark.parametrize("layers,pp,vp,split", CASES)
def test_chunks_are_megatrons(layers, pp, vp, split):
    check_split(split, layers, pp, vp)
    seen = []
    for v in range(vp):  # in virtual-stage order the chunks tile the model
        for s in range(pp):
            rng = chunk_layers(layers, pp, s, v, vp, split)
            assert (rng.start if len(rng) else megatron_chunk(layers, pp, vp, s, v, split)[0], len(rng)) == \
                megatron_chunk(layers, pp, vp, s, v, split), (s, v)
            seen += list(rng)
    assert seen == list(range(layers))


def test_qwen3_235b_on_megatron_bridge_h100_layout():
    """94 layers, PP 8 x VP 4, embedding and loss counted: every chunk 3 layers but the first (the
    embedding and layers 0, 1) and the last (layers 92, 93 and the loss)."""
    assert chunk_layers(94, 8, 0, 0, 4, BOTH) == range(0, 2)
    assert chunk_layers(94, 8, 1, 0, 4, BOTH) == range(2, 5)
    assert chunk_layers(94, 8, 0, 1, 4, BOTH) == range(23, 26)
    assert chunk_layers(94, 8, 7, 3, 4, BOTH) == range(92, 94)
    assert [len(rank_layers(94, 8, s, 4, BOTH)) for s in range(8)] == [11, 12, 12, 12, 12, 12, 12, 11]
    with pytest.raises(SpecError, match="not divisible by pp x vp"):
        check_vp(4, 8, 94)  # the even split refuses it, naming the options that cut it otherwise


def test_the_even_split_is_unchanged():
    for s in range(4):
        for c in range(2):
            assert chunk_layers(32, 4, s, c, 2, EVEN_SPLIT) == chunk_layers(32, 4, s, c, 2)
    # first / last counts equal to the even split's: the same layers
    same = PipelineSplit(num_layers_in_first_pipeline_stage=8, num_layers_in_last_pipeline_stage=8)
    assert [rank_layers(32, 4, s, 2, same) for s in range(4)] == [rank_layers(32, 4, s, 2) for s in range(4)]


def test_a_stage_holds_its_chunks_parameters():
    spec, arch = resolve_model("qwen3-0.6b", 1)
    stages = [stage_spec(spec, 2, s, arch.layers, 3, BOTH) for s in range(2)]
    assert {p.name for st in stages for p in st.params} == {p.name for p in spec.params}
    layers0 = {p.layer for p in stages[0].params if p.layer is not None}
    assert layers0 == set(range(0, 4)) | set(range(9, 14)) | set(range(19, 24))
    assert stages[0].params[0].name == "model.embed_tokens.weight"


@pytest.mark.parametrize("split", [EVEN_SPLIT, BOTH, PipelineSplit(num_layers_in_first_pipeline_stage=2)])
def test_a_stages_chunks_partition_its_parameters(split):
    """`chunk_spec`: a stage's chunks hold its parameters once each, in its order; chunk c its
    `chunk_layers`; the embedding the first stage's first chunk (alone under BOTH at PP 2 x VP 5:
    30 slots, 3 a chunk, the first one the embedding and 2 layers), the final norm and head the
    last stage's last."""
    spec, arch = resolve_model("qwen3-0.6b", 1)
    pp, vp = 2, (5 if split is BOTH else 2)
    for s in range(pp):
        chunks = [chunk_spec(spec, pp, s, c, arch.layers, vp, split) for c in range(vp)]
        names = [p.name for ch in chunks for p in ch.params]
        assert sorted(names) == sorted(p.name for p in stage_spec(spec, pp, s, arch.layers, vp, split).params)
        assert len(names) == len(set(names))
        for c, ch in enumerate(chunks):
            assert {p.layer for p in ch.params if p.layer is not None} == set(chunk_layers(arch.layers, pp, s, c, vp,
                                                                                          split))
    first = chunk_spec(spec, pp, 0, 0, arch.layers, vp, split)
    assert first.params[0].name == "model.embed_tokens.weight"
    last = chunk_spec(spec, pp, pp - 1, vp - 1, arch.layers, vp, split)
    assert any(p.layer is None and p.name != "model.embed_tokens.weight" for p in last.params)
    if split is BOTH:
        assert {p.layer for p in first.params if p.layer is not None} == {0, 1}


# --- Megatron's refusals ----------------------------------------------------------------------


@pytest.mark.parametrize("layers,pp,vp,split,needle", [
    (94, 8, 4, EMBEDDING, "95, are not divisible by pp 8"),
    (94, 4, 5, BOTH, "stage's 24 layers (embedding / loss counted) are not divisible by vp 5"),
    (30, 4, 1, PipelineSplit(account_for_loss_in_pipeline_split=True, num_layers_in_first_pipeline_stage=6),
     "cannot be combined"),
    (30, 4, 2, PipelineSplit(num_layers_in_first_pipeline_stage=3), "not divisible by vp 2"),
    (30, 4, 1, PipelineSplit(num_layers_in_first_pipeline_stage=8), "not divisible by the 3 middle stages"),
    (30, 4, 2, PipelineSplit(num_layers_in_first_pipeline_stage=4, num_layers_in_last_pipeline_stage=4),
     "a middle stage's 11 layers are not divisible by vp 2"),
    (30, 2, 1, PipelineSplit(num_layers_in_first_pipeline_stage=10, num_layers_in_last_pipeline_stage=10),
     "leave 10 layers for 0 middle stages"),
    (30, 4, 1, PipelineSplit(num_layers_in_first_pipeline_stage=20, num_layers_in_last_pipeline_stage=10),
     "leave 0 layers for 2 middle stages"),
    (30, 4, 1, PipelineSplit(num_layers_in_first_pipeline_stage=28, num_layers_in_last_pipeline_stage=8),
     "more than the model's 30"),
    (30, 4, 1, PipelineSplit(num_layers_in_first_pipeline_stage=0), "must be a whole number >= 1"),
    # Megatron's layer offset under VP divides by the middle stages: it fails without one
    (36, 2, 2, PipelineSplit(num_layers_in_first_pipeline_stage=20, num_layers_in_last_pipeline_stage=16),
     "needs a middle stage"),
    (30, 1, 1, PipelineSplit(num_layers_in_first_pipeline_stage=30), "pp > 1"),
    (30, 4, 1, PipelineSplit(account_for_loss_in_pipeline_split="yes"), "must be True or False"),
    (30, 4, 0, PipelineSplit(num_layers_in_first_pipeline_stage=6), "vp must be a whole number"),
])
def test_refused_splits_are_one_line(layers, pp, vp, split, needle):
    with pytest.raises(SpecError) as e:
        check_split(split, layers, pp, vp)
    assert needle in str(e.value) and "\n" not in str(e.value)


# --- memory -----------------------------------------------------------------------------------


def _held_by_walking(stage: int, pp: int, m: int, vp: int, sizes: list[int]) -> int:
    held, peak = 0, 0
    for kind, _, c in pipeline_order(stage, pp, m, vp):
        held += sizes[c] * (1 if kind == "F" else -1)
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("stage", range(8))
def test_activations_weigh_each_chunk_by_its_layers(stage):
    """The layers held at the peak of the interleaved order, each chunk by its own size: the first
    stage (its first chunk two layers) holds fewer than an even stage's 3 x peak_in_flight."""
    spec, arch = resolve_model("qwen3-235b-a22b", 2)
    dims, setup = layer_dims(arch, spec), replace(MemorySetup(), micro_batches=128)
    sizes = [len(chunk_layers(94, 8, stage, c, 4, BOTH)) for c in range(4)]
    held = peak_layers_in_flight(stage, 8, 128, 4, sizes)
    assert held == _held_by_walking(stage, 8, 128, 4, sizes)
    got = activation_breakdown(dims, setup, 2, 8, stage, 4, BOTH)["layers"]
    assert got == pytest.approx(held * layer_activation_bytes(dims, setup, 2), rel=1e-12)
    even = 3 * peak_in_flight(stage, 8, 128, 4)
    assert held < even if stage == 0 else held == even  # stage 0's first chunk (warm-up's most) is short


def test_the_fullest_stage_decides_the_fit():
    """The reported memory is the fullest stage's, its activations the split's for that stage."""
    cfg = SimConfig(model="qwen3-0.6b", gpus=8, tp=2, pp=2, vp=3, policy="layerwise", zero1_fallback=False,
                    workload=Workload(256, 12), pipeline_split=BOTH)
    r = simulate(cfg)
    spec, arch = resolve_model("qwen3-0.6b", 2)
    setup = replace(MemorySetup.from_workload(cfg.workload), micro_batches=6)
    acts = [activation_breakdown(layer_dims(arch, spec), setup, 2, 2, s, 3, BOTH) for s in range(2)]
    assert r.memory.worst.activations == pytest.approx(sum(acts[r.memory.stage].values()), abs=1)
    assert acts[0]["layers"] != acts[1]["layers"]  # the stages' chunks differ: [4, 5, 5] and [5, 5, 4] layers
    assert r.to_dict()["pipeline_split"]["account_for_loss_in_pipeline_split"] is True


# --- the simulator ----------------------------------------------------------------------------

PIPE = SimConfig(model="qwen3-0.6b", gpus=8, tp=2, pp=2, vp=3, policy="layerwise", zero1_fallback=False,
                 workload=Workload(256, 12))


def _layers_run(result, stage_rank: int) -> set[int]:
    names = {s.name for s in result.spans if s.phase == "A" and s.rank == stage_rank and " fwd layer " in s.name}
    return {int(n.split(" fwd layer ")[1].split(".")[0]) for n in names}


def test_each_stage_runs_its_chunks_layers():
    r = simulate(replace(PIPE, pipeline_split=BOTH))
    assert _layers_run(r, 0) == set(rank_layers(28, 2, 0, 3, BOTH))
    assert _layers_run(r, 4) == set(rank_layers(28, 2, 1, 3, BOTH))
    assert "mb0 fwd embedding" in {s.name for s in r.spans if s.rank == 0}


def test_a_chunk_without_layers_still_passes_the_micro_batches_on():
    """PP 2 x VP 15, both counted: one slot a chunk, the first chunk the embedding alone and the
    last the loss alone (Megatron allows it); every layer runs once per micro-batch."""
    r = simulate(replace(PIPE, vp=15, workload=Workload(256, 8), pipeline_split=BOTH))
    assert _layers_run(r, 0) | _layers_run(r, 4) == set(range(28))


def test_equal_first_and_last_counts_simulate_as_the_even_split():
    same = PipelineSplit(num_layers_in_first_pipeline_stage=14, num_layers_in_last_pipeline_stage=14)
    a, b = simulate(replace(PIPE, vp=1)), simulate(replace(PIPE, vp=1, pipeline_split=same))
    assert a.iteration_time_s == b.iteration_time_s and a.memory.worst.total == b.memory.worst.total


def test_moving_layers_moves_their_work():
    """PP 2, 16 / 12 layers in place of 14 / 14: the first stage's forward / backward compute grows
    by two layers' and the last stage's falls by as much."""
    even = simulate(replace(PIPE, vp=1))
    shifted = simulate(replace(PIPE, vp=1, pipeline_split=PipelineSplit(num_layers_in_first_pipeline_stage=16,
                                                                        num_layers_in_last_pipeline_stage=12)))

    def busy(r, rank):
        return sum(s.end - s.start for s in r.spans if s.phase == "A" and s.rank == rank and s.kind == "compute"
                   and " layer " in s.name)

    grown, fallen = busy(shifted, 0) - busy(even, 0), busy(even, 4) - busy(shifted, 4)
    assert grown > 0 and fallen == pytest.approx(grown, rel=0.05)
    assert busy(shifted, 0) == pytest.approx(busy(even, 0) * 16 / 14, rel=0.05)


@pytest.mark.parametrize("change,needle", [
    (dict(vp=3), "not divisible by pp x vp"),  # 28 layers over 2 x 3 chunks, no split
    (dict(vp=3, pipeline_split=EMBEDDING), "29, are not divisible by pp 2"),
    (dict(vp=3, pipeline_split="both"), "must be a PipelineSplit"),
])
def test_bad_splits_are_one_error_line(change, needle):
    with pytest.raises(SpecError) as e:
        replace(PIPE, **{"pipeline_split": EVEN_SPLIT, **change}).check()
    assert needle in str(e.value) and "\n" not in str(e.value)


# --- the CLI ----------------------------------------------------------------------------------

CLI = ["--model", "qwen3-0.6b", "--gpus", "8", "--tp", "2", "--seq-len", "256", "--global-batch", "12",
       "--policy", "layerwise", "--pp", "2", "--vp", "3"]


def test_simulate_takes_megatrons_flags():
    result = invoke("simulate", *CLI, "--account-for-embedding-in-pipeline-split",
                    "--account-for-loss-in-pipeline-split", "--json")
    assert result.exit_code == 0, result.stderr
    d = json.loads(result.stdout)
    assert d["pipeline_split"] == {"account_for_embedding_in_pipeline_split": True,
                                   "account_for_loss_in_pipeline_split": True,
                                   "num_layers_in_first_pipeline_stage": None,
                                   "num_layers_in_last_pipeline_stage": None}


def test_simulate_table_names_the_split():
    result = invoke("simulate", *CLI, "--account-for-embedding-in-pipeline-split",
                    "--account-for-loss-in-pipeline-split", env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.stderr
    assert "PP 2 x VP 3 (embedding and loss counted as layers)" in " ".join(result.stdout.split())
    assert PipelineSplit(num_layers_in_first_pipeline_stage=4).describe() == "first stage 4 layers"


@pytest.mark.parametrize("extra,needle", [
    ([], "account-for-embedding-in-pipeline-split"),  # the even split's refusal names the options
    (["--account-for-embedding-in-pipeline-split"], "not divisible by pp 2"),
    (["--decoder-first-pipeline-num-layers", "15"], "not divisible by vp 3"),
    (["--decoder-first-pipeline-num-layers", "0"], ">= 1"),
    (["--decoder-last-pipeline-num-layers", "12", "--account-for-loss-in-pipeline-split"], "cannot be combined"),
])
def test_cli_bad_splits_are_one_error_line(extra, needle):
    error_line(invoke("simulate", *CLI, *extra), needle)


# --- the search's bounds -----------------------------------------------------------------------


@pytest.mark.parametrize("split", [BOTH, PipelineSplit(num_layers_in_first_pipeline_stage=12)])
def test_the_searchs_floors_stay_below_an_uneven_split(split):
    """The floors take an uneven split (the search's embedding+loss, or a configuration's first
    stage count) and stay lower bounds: the time floor counts each earlier stage's first chunk as
    the split cuts it, the memory floor each stage's own layers."""
    from canzona.cost import DeviceRate
    from canzona.hardware import load_profile
    from sim.search import memory_floor, time_floor

    cfg = replace(PIPE, pipeline_split=split) if split is BOTH else replace(PIPE, vp=2, pipeline_split=split)
    model = resolve_model(cfg.model, cfg.tp)
    r = simulate(cfg)
    assert time_floor(cfg, model, DeviceRate.from_profile(load_profile(cfg.hardware))) <= r.iteration_time_s
    assert memory_floor(cfg, model) <= r.memory.worst.total


def test_the_time_floor_counts_an_uneven_splits_crossing():
    """At PP 2 x VP 1 the first stage is the chunk the first forward and the last backward cross,
    and the split cuts 14 + 14 layers as the even one does: the same floor (it counted no crossing
    at all under an uneven split: 13% below the even split's here, 38% on SMALL of
    tests/sim/test_search.py)."""
    from canzona.cost import DeviceRate
    from canzona.hardware import load_profile
    from sim.search import time_floor

    even = replace(PIPE, vp=1)
    model = resolve_model(even.model, even.tp)
    rate = DeviceRate.from_profile(load_profile(even.hardware))
    floors = [time_floor(replace(even, pipeline_split=split), model, rate) for split in (EVEN_SPLIT, BOTH)]
    assert floors[1] == pytest.approx(floors[0], rel=1e-12)
    assert floors[1] <= simulate(replace(even, pipeline_split=BOTH)).iteration_time_s
