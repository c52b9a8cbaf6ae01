"""sim.search: candidates, pruning, ranking (small model, few GPUs: fast)."""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path

import pytest

from canzona.errors import SpecError
from canzona.models import resolve_model
from canzona.reductions import DEFAULT_REDUCE_SCATTER
from sim.ep_dispatch import EpDispatcher
from sim.options import RunOptions
from sim.search import (
    LAYOUT_AXES,
    SEARCHED_SPLITS,
    Question,
    candidates,
    config_of,
    describe,
    memory_floor,
    not_in_plan,
    plan_command,
    same_run,
    search,
    time_floor,
)
from sim.simulate import simulate
from tests.sim import small_models

SMALL = Question(model="qwen3-0.6b", gpus=8, seq_len=1024, global_batch=8)
# the exactness tests' question: SMALL's model cut to 8 layers, whose every layout the reference
# simulates in seconds
EIGHT_LAYERS = replace(SMALL, model=small_models.EIGHT_LAYERS)


@pytest.fixture(scope="module")
def small():
    return search(SMALL, top=3, workers=2)


def test_every_layout_is_valid_and_fits(small):
    assert small.ranked
    for row in small.ranked:
        assert row["fits"] and row["memory_bytes"] <= row["memory_capacity_bytes"]
        assert row["tp"] * row["pp"] * row["cp"] * row["dp"] == SMALL.gpus
        assert SMALL.global_batch % (row["dp"] * row["micro_batch"]) == 0
        config_of(SMALL, row).check()  # the simulator's own rules accept it


def test_ranked_by_iteration_time(small):
    times = [r["iteration_time_s"] for r in small.ranked]
    assert times == sorted(times)


def test_floors_are_below_the_simulation():
    """The bounds that prune are lower bounds of what they stand for."""
    model = resolve_model(SMALL.model)
    from canzona.cost import DeviceRate
    from canzona.hardware import load_profile

    rate = DeviceRate.from_profile(load_profile(SMALL.hardware))
    for layout in ({"tp": 2, "pp": 2, "vp": 2, "micro_batch": 1, "recompute": "selective"},
                   {"tp": 2, "pp": 1, "vp": 1, "micro_batch": 2, "recompute": "none"},
                   {"tp": 8, "pp": 1, "vp": 1, "micro_batch": 1, "recompute": "none"},
                   {"tp": 4, "pp": 2, "vp": 1, "micro_batch": 1, "recompute": "full"}):
        for overlap in (True, False):  # TP collectives hidden behind the GEMMs, or in series
            cfg = config_of(SMALL, layout)
            cfg = replace(cfg, options=replace(cfg.options, tp_comm_overlap=overlap))
            r = simulate(cfg)
            floor = time_floor(cfg, model, rate)
            assert floor <= r.iteration_time_s
            assert memory_floor(cfg, model) <= r.memory.worst.total


# published layouts (sim.published), at a global batch of 16 to simulate in seconds: dense TP x PP x
# VP x CP, TP 1 x CP 2, PP 8 x VP 5 in FP8, TP 1 x PP 4 x VP 10 in FP8
PUBLISHED_LAYOUTS = ("llama3.1-70b-64xh100-dgxc-bf16", "llama3.1-8b-8xh100-dgxc-bf16",
                     "llama3-70b-64xh100-mb26.02-fp8", "llama2-13b-16xh100-nemo24.07-fp8")


@pytest.mark.parametrize("overlap", [True, False])  # TP collectives beside the GEMMs, or in series
@pytest.mark.parametrize("row", PUBLISHED_LAYOUTS)
def test_published_layouts_floors_are_below_the_simulation(row, overlap):
    """The floor of a published layout (CP's ring, PP x VP, FP8, overlapped TP) stays below its
    simulation; the SMs an overlapped TP reduce-scatter or a CP ring exchange takes from the GEMMs
    beside it raise it."""
    from canzona.cost import DeviceRate
    from canzona.hardware import load_profile
    from sim.published import load, select
    from sim.published_search import layout_of, question_of

    run = select(load()[0], row)[0]
    q = replace(question_of(run), global_batch=16)
    cfg = config_of(q, layout_of(run))
    # without the overlap the row's userbuffers configuration has nothing to configure: the default
    ub = cfg.options.tp_comm_overlap_cfg if overlap else RunOptions.tp_comm_overlap_cfg
    cfg = replace(cfg, options=replace(cfg.options, tp_comm_overlap=overlap, tp_comm_overlap_cfg=ub))
    model = resolve_model(q.model)
    hw = load_profile(cfg.hardware)
    rate = DeviceRate.from_profile(hw)
    r = simulate(cfg)
    floor = time_floor(cfg, model, rate, hw)
    # within 12%: the floor takes the sends as free, and the pipeline's warm-up and cool-down
    # exchanges block (sim.pipeline_p2p), most of PP 8 x VP 5's schedule at 8 micro-batches
    # (0.889 of its simulation with TP overlap; 0.910 before the rendezvous)
    assert 0.88 * r.iteration_time_s < floor <= r.iteration_time_s
    assert memory_floor(cfg, model) <= r.memory.worst.total
    no_sms = time_floor(cfg, model, rate, replace(hw, gpu=replace(hw.gpu, sms=0)))
    assert (no_sms < floor) if (cfg.tp > 1 and overlap) or cfg.cp > 1 else (no_sms == floor)


def test_moe_floors_are_below_the_simulation(monkeypatch):
    """Under expert parallelism the floor counts each expert block's dispatch and combine (and
    its ETP collectives), which the simulation runs in series with the grouped GEMMs; still a
    floor, and above the floor of the GEMMs alone."""
    from canzona.cost import DeviceRate
    from canzona.hardware import load_profile

    q = Question(model="qwen3-30b-a3b", gpus=16, optimizer="adamw", global_batch=16)
    model = resolve_model(q.model)
    hw = load_profile(q.hardware)
    rate = DeviceRate.from_profile(hw)
    for layout in ({"tp": 1, "pp": 1, "vp": 1, "ep": 16, "micro_batch": 1, "recompute": "none"},
                   {"tp": 2, "pp": 2, "vp": 1, "ep": 4, "micro_batch": 2, "recompute": "none"},
                   {"tp": 4, "pp": 1, "vp": 1, "ep": 2, "micro_batch": 1, "recompute": "full"},
                   {"tp": 2, "pp": 2, "vp": 1, "ep": 1, "micro_batch": 1, "recompute": "none"}):
        cfg = config_of(q, layout)
        cfg = replace(cfg, etp=2) if layout["tp"] == 4 else cfg  # expert TP: the ETP collectives counted
        floor = time_floor(cfg, model, rate, hw)
        r = simulate(cfg)
        assert floor <= r.iteration_time_s
        # the experts' weights and gradients count (at EP 1 in the one plan: far over the memory)
        assert memory_floor(cfg, model) <= r.memory.worst.total
        if layout["ep"] == 1:
            assert not r.fits and memory_floor(cfg, model) > hw.gpu.memory_bytes
            continue
        with monkeypatch.context() as m:  # the floor of the kernels alone (the expert collectives free)
            m.setattr("sim.search.expert_comm_floor", lambda cfg, hw: None)
            assert time_floor(cfg, model, rate, hw) < floor


def test_tp_collectives_raise_the_floor():
    """The floor counts a block's TP collectives where it must wait for them (`block_floor`)."""
    from sim.model_work import Block
    from sim.search import block_floor

    b = Block("b", first_s=1.0, middle_s=2.0, last_s=1.0)
    assert block_floor(b, 2, None, True) == 4.0  # TP 1: compute alone
    assert block_floor(b, 1, (0.5, 0.5), True) == 4.0  # hidden behind the first and last GEMMs
    assert block_floor(b, 2, (0.75, 3.0), True) == 1.5 + 2.0 + 3.0  # two gathers, a long reduce-scatter
    # without userbuffers: the forward in series; the backward's second gather beside the column data-gradient
    # GEMMs, the reduce-scatter beside their weight-gradient GEMMs (`sim.iteration._Stage.nccl_block`)
    assert block_floor(b, 1, (0.75, 3.0), False) == 0.75 + 4.0 + 3.0
    assert block_floor(b, 2, (0.75, 3.0), False) == 0.75 + 3.0 + 1.0 + 3.0  # no weight gradient split off
    split = replace(b, last_wgrad_s=0.5)
    assert block_floor(split, 2, (0.75, 3.0), False) == 0.75 + 3.0 + 0.75 + 3.0
    assert block_floor(split, 2, (0.25, 0.25), False) == 0.25 + 3.0 + 0.5 + 0.5  # both hidden
    assert block_floor(replace(b, tp_collectives=False), 2, (0.75, 3.0), False) == 4.0


def test_reduce_scatter_sms_slow_the_last_gemms():
    """`beside_kernel`: a kernel holding k of the SMs slows the GEMM beside it by c * k / sms, or
    holds it at its reduced rate for the whole GEMM when it outlasts it."""
    from sim.model_work import Block
    from sim.search import beside_kernel, block_floor

    assert beside_kernel(2.0, 1.0, 0, 100) == 2.0 == beside_kernel(2.0, 1.0, 25, 0)
    assert beside_kernel(2.0, 1.0, 25, 100) == pytest.approx(2.25)  # 1 s at 3/4 rate, then the rest
    assert beside_kernel(1.0, 3.0, 25, 100) == 3.0  # the kernel outlasts the slowed GEMM (4/3 s)
    assert beside_kernel(1.0, 1.2, 25, 100) == pytest.approx(1.3)  # 0.9 s of it done when the kernel ends
    assert beside_kernel(1.0, 1.5, 25, 100) == 1.5  # the GEMM at 3/4 rate throughout (4/3 s), then the wait
    b = Block("layer 0.1", first_s=1.0, middle_s=2.0, last_s=1.0)  # an MLP block: 16 SMs forward, 4 backward
    assert block_floor(b, 1, (0.5, 0.5), True, sms=128) == pytest.approx(3.0 + 1.0 + 0.5 * 16 / 128)
    assert block_floor(b, 2, (0.5, 0.5), True, sms=128) == pytest.approx(3.0 + 1.0 + 0.5 * 4 / 128)
    assert block_floor(b, 1, (0.5, 0.5), False, sms=128) == 0.5 + 4.0 + 0.5  # in series: no overlap


@functools.cache
def _exhaustive_small():
    """Every layout of EIGHT_LAYERS simulated (no refinement): the reference of the pruning tests,
    made once for the tests a worker runs."""
    return search(EIGHT_LAYERS, top=10**6, refine_top=0, workers=2)


def test_the_top_is_exact():
    """Branch and bound keeps the top K of the exhaustive search (no refinement: layouts only)."""
    bounded = search(EIGHT_LAYERS, top=2, refine_top=0, workers=2)
    full = _exhaustive_small()
    assert bounded.pruned_bound > 0
    key = [(r["tp"], r["pp"], r["vp"], r["micro_batch"], r["recompute"], r["iteration_time_s"]) for r in full.ranked[:2]]
    assert [(r["tp"], r["pp"], r["vp"], r["micro_batch"], r["recompute"], r["iteration_time_s"])
            for r in bounded.ranked[:2]] == key


def test_also_below_reaches_every_layout_it_names():
    """With `also_below` and `within`, every fitting layout faster than both (and the top) is
    simulated: what ranking a published layout needs (sim.published_search)."""
    full = _exhaustive_small()
    times = [r["iteration_time_s"] for r in full.ranked]
    below = times[min(6, len(times) - 1)]
    reached = search(EIGHT_LAYERS, top=1, refine_top=0, workers=2, also_below=below, within=1.0)
    key = [(r["tp"], r["pp"], r["vp"], r["micro_batch"], r["recompute"]) for r in full.ranked
           if r["iteration_time_s"] < below]
    assert len(key) > 1 and reached.simulated < full.simulated
    assert [(r["tp"], r["pp"], r["vp"], r["micro_batch"], r["recompute"]) for r in reached.ranked
            if r["iteration_time_s"] < below] == key


def test_alike_reduce_scatters_route_every_segment_list_alike():
    """`alike_impls`: even segments go the same way under all but `exact`; uneven ones far from
    even under `native` and `loops` alike; nothing routed (DP 1): every implementation is the
    same run."""
    from canzona.reductions import REDUCE_SCATTER_IMPLS, alike_impls

    assert alike_impls("native", [(4, 4, 4, 4)]) == ("native", "loops", "padded")
    assert alike_impls("native", [(4, 4, 4, 4), (1, 2, 3, 10)]) == ("native", "loops")
    assert alike_impls("native", [(4, 4, 4, 4), (16, 16, 16, 15)]) == ("native", "padded")
    assert alike_impls("exact", [(4, 4, 4, 4)]) == ("exact",)
    assert alike_impls("native", []) == REDUCE_SCATTER_IMPLS


def _in_lowest_terms(segments) -> tuple[int, ...]:
    """A segment list in elements or bytes, divided by its greatest common divisor: a route
    depends on the segments' ratios only."""
    import math

    ints = [int(s) for s in segments]
    g = math.gcd(*ints)
    return tuple(s // g for s in ints) if g else tuple(ints)


@pytest.mark.parametrize("q, layout", [
    (replace(SMALL, gpus=16, global_batch=16), {"tp": 1, "pp": 1}),  # DP 16: uneven buckets
    (replace(SMALL, gpus=16, global_batch=16), {"tp": 2, "pp": 2, "policy": "zero1-gather"}),
    (replace(SMALL, gpus=16, global_batch=16, optimizer="soap"), {"tp": 2, "pp": 1, "policy": "sc"}),
    (SMALL, {"tp": 2, "pp": 4}),  # DP 1: nothing routed
    (Question(model="qwen3-30b-a3b", gpus=16, optimizer="adamw", global_batch=16), {"tp": 1, "pp": 1, "ep": 8}),
    (Question(model="qwen3-30b-a3b", gpus=16, global_batch=16), {"tp": 2, "pp": 2, "ep": 4}),
])
def test_a_result_lists_the_segments_its_runs_route(monkeypatch, q, layout):
    """`SimResult.reduce_scatters` (from the plans) holds every segment list the simulation and
    its memory model route (recorded here by wrapping `bucket_route`, the candidates' runs
    included) and nothing else, up to the unit (elements or bytes)."""
    import canzona.reductions
    import sim.collectives

    routed: set[tuple[int, ...]] = set()
    route = canzona.reductions.bucket_route

    def recording(impl, lengths):
        routed.add(_in_lowest_terms(lengths))
        return route(impl, lengths)

    monkeypatch.setattr(canzona.reductions, "bucket_route", recording)
    monkeypatch.setattr(sim.collectives, "bucket_route", recording)
    full = next(c for c in candidates(q) if all(c[k] == v for k, v in layout.items() if k != "policy"))
    r = simulate(config_of(q, {**full, **layout}))
    assert {_in_lowest_terms(s) for s in r.reduce_scatters} == routed
    assert bool(routed) == (full["dp"] > 1)


def _expanded(result, ties: bool) -> list[tuple]:
    """Every ranked row, and with `ties` for a row simulated under the default reduce-scatter one
    more row per implementation its run names alike (what the search did not simulate again),
    as the ranking would list them: by time, then towards the defaults and the simpler layout."""
    rows = []
    for r in result.ranked:
        rows.append(r)
        if ties and not r["refined"]:
            rows += [{**r, "reduce_scatter": impl, "refined": True} for impl in r["reduce_scatter_alike"]
                     if impl != r["reduce_scatter"]]
    return sorted((r["iteration_time_s"], r["refined"], r["tp"], r["pp"], r["vp"], r["micro_batch"], r["recompute"],
                   r["policy"], r["reduce_scatter"]) for r in rows)


def test_reduce_scatter_ties_are_pruned_soundly():
    """A refinement whose reduce-scatter routes every reduction as the simulated row's is not
    simulated again, and the top of the search is that of the search that simulates it (every
    row, its time and its reduce-scatter, ties listed)."""
    q = replace(EIGHT_LAYERS, gpus=16, global_batch=16)  # DP up to 16: uneven segments to route
    pruned = search(q, top=5, refine_top=3, workers=2)
    full = search(q, top=5, refine_top=3, workers=2, prune_ties=False)
    assert pruned.pruned_ties > 0 and full.pruned_ties == 0
    assert pruned.simulated < full.simulated
    kth = sorted(r["iteration_time_s"] for r in full.ranked)[4]
    assert [r for r in _expanded(pruned, True) if r[0] <= kth] == [r for r in _expanded(full, False) if r[0] <= kth]
    for r in full.ranked:  # a simulated tie has its twin's time, bit for bit
        twin = [o for o in full.ranked if not o["refined"] and r["reduce_scatter"] in o["reduce_scatter_alike"]
                and (o["tp"], o["pp"], o["vp"], o["micro_batch"], o["recompute"], o["policy"])
                == (r["tp"], r["pp"], r["vp"], r["micro_batch"], r["recompute"], r["policy"])]
        assert all(o["iteration_time_s"] == r["iteration_time_s"] and o["memory_bytes"] == r["memory_bytes"]
                   for o in twin)


def test_a_refinement_that_runs_its_rows_run_again_is_listed_once():
    """Where canzona falls back to ZeRO-1's even segments, a reduce-scatter that canzona's own uneven
    plan would route otherwise (so not pruned before the run: `reduce_scatter_alike` spans every
    candidate plan of the layout) runs the row's run again: the search lists it once (`same_run`),
    among its ties; the search that keeps every simulated row lists the twin, and its top is the
    same once the twins are left out."""
    q = replace(EIGHT_LAYERS, gpus=64, global_batch=64)  # DP 64: canzona falls back on the best layouts
    pruned = search(q, top=5, refine_top=2, workers=2)
    full = search(q, top=5, refine_top=2, workers=2, prune_ties=False)

    def twins(result) -> list[tuple[dict, dict]]:
        return [(r, o) for r in result.ranked if r["refined"] for o in result.ranked
                if not o["refined"] and same_run(r, o)]

    found = twins(full)
    # only the run tells: the twin's reduce-scatter is not among its row's `reduce_scatter_alike`
    assert any(r["reduce_scatter"] not in o["reduce_scatter_alike"] and o["fell_back_to"] == "zero1-gather"
               for r, o in found)
    assert twins(pruned) == []
    assert pruned.pruned_ties > 0
    doubled = [id(r) for r, _ in found]
    key = ("iteration_time_s", "tp", "pp", "vp", "micro_batch", "recompute", "policy", "reduce_scatter")
    assert ([tuple(r[k] for k in key) for r in pruned.ranked[:5]]
            == [tuple(r[k] for k in key) for r in full.ranked if id(r) not in doubled][:5])


def test_axes_are_data():
    assert [a.name for a in LAYOUT_AXES] == ["tp", "pp", "pipeline_split", "vp", "cp", "ep", "micro_batch",
                                             "recompute"]


def test_the_layers_are_cut_evenly_or_with_the_embedding_and_the_loss_counted():
    """Each PP runs the even split where it divides the layers and Megatron's split with the
    embedding and the loss counted as layers where it divides those (NVIDIA's Llama 3.1 405B recipe:
    126 + 2 at PP 8 x VP 8); a PP that divides neither is not searched; without a pipeline, the
    even split only. Qwen3-0.6B's 28 layers on 8 GPUs: PP 2 both (VP over 14 or 15 layers a stage;
    not the split at VP 1, which cuts 14 + 14 as the even one does: its twin), PP 4 even, PP 8 neither."""
    from canzona.pipeline import check_split, rank_layers

    layouts = candidates(SMALL)
    splits = {(c["pp"], c["pipeline_split"]) for c in layouts}
    assert splits == {(1, "even"), (2, "even"), (2, "embedding+loss"), (4, "even")}
    assert {c["vp"] for c in layouts if c["pp"] == 2 and c["pipeline_split"] == "embedding+loss"} == {3, 5, 15}
    cuts = [(c["tp"], c["pp"], c["vp"], c["micro_batch"],
             tuple(rank_layers(28, c["pp"], s, c["vp"], SEARCHED_SPLITS[c["pipeline_split"]]) for s in range(c["pp"])))
            for c in layouts]
    assert len(cuts) == len(set(cuts))  # no layout twice under two names
    for c in layouts:
        cfg = config_of(SMALL, c)
        assert cfg.pipeline_split == SEARCHED_SPLITS[c["pipeline_split"]]
        check_split(cfg.pipeline_split, 28, c["pp"], c["vp"])
    row = {**next(c for c in layouts if c["pipeline_split"] != "even"), "dp": 4}
    assert "PP2 VP3 split embedding+loss" in describe({**row, "vp": 3})
    launcher = {"vp": 3, "micro_batch": 1, "recompute": "none", "reduce_scatter": DEFAULT_REDUCE_SCATTER,
                "fell_back_to": None}
    assert ("--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split (Megatron's)"
            in not_in_plan({**row, **launcher}))
    assert not any("account" in x for x in not_in_plan({**row, **launcher, "pipeline_split": "even"}))


def test_dense_models_search_context_parallelism():
    """CP divides what TP x PP leave and the sequence in 2 x CP chunks of at least MIN_CP_TOKENS
    per rank; its plan is for DP x CP."""
    q = Question(model="qwen3-0.6b", gpus=8, seq_len=32768, global_batch=8)
    layouts = candidates(q)
    assert {1, 2, 4, 8} <= {c["cp"] for c in layouts}
    assert {c["cp"] for c in candidates(Question(model="qwen3-0.6b", gpus=8, seq_len=4096, global_batch=8))} == {1}
    for c in layouts:
        assert c["tp"] * c["pp"] * c["cp"] * c["dp"] == q.gpus
    row = {**next(c for c in layouts if c["cp"] == 2 and c["tp"] == 1 and c["pp"] == 1),
           "dp_policy": "alpha-balanced-reorder", "tp_policy": "greedy-rollback", "expert_buckets": "size"}
    assert "--dp 8 " in plan_command(q, row)


def test_moe_searches_expert_parallelism():
    q = Question(model="qwen3-30b-a3b", gpus=16, global_batch=32)
    eps = {c["ep"] for c in candidates(q)}
    assert {1, 2, 4, 8, 16} <= eps


def test_bad_question():
    with pytest.raises(SpecError, match="gpus"):
        Question(gpus=0)
    with pytest.raises(SpecError):
        Question(optimizer="sgd")
    with pytest.raises(SpecError, match="attention backend must be one of"):
        Question(attention_backend="sdpa")


def test_published_layout_is_a_candidate():
    path = Path(__file__).resolve().parents[2] / "canzona" / "data" / "published_runs.json"
    if not path.exists():
        pytest.skip("no published runs in this checkout")
    row = next(r for r in json.loads(path.read_text())["rows"] if r["id"] == "qwen3-8b-16xh100-mb")
    q = Question(model=row["model"], gpus=row["gpus"], hardware=row["hardware"], optimizer=row["optimizer"],
                 seq_len=row["seq_len"], global_batch=row["global_batch"])
    layout = {"tp": row["tp"], "pp": row["pp"], "vp": row["vp"], "ep": row["ep"], "micro_batch": row["micro_batch"],
              "dp": row["gpus"] // (row["tp"] * row["pp"] * row["cp"])}
    assert any(all(c[k] == v for k, v in layout.items()) for c in candidates(q))


@pytest.mark.parametrize("changes, named", [
    ({"ep_dispatcher": EpDispatcher(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep")},
     "--moe-token-dispatcher-type flex, --moe-flex-dispatcher-backend deepep"),
    ({"overlap_moe_expert_parallel_comm": True}, "--overlap-moe-expert-parallel-comm"),
])
def test_a_dense_model_refuses_the_expert_dispatch_settings(changes, named):
    """They would change nothing on a dense model: refused before any work, naming them, as
    `canzona simulate` refuses them; a MoE model takes them."""
    with pytest.raises(SpecError, match=f"^{named}: .* 'qwen3-0.6b' has no experts"):
        Question(model="qwen3-0.6b", gpus=8, **changes)
    Question(model="qwen3-30b-a3b", gpus=8, **changes)


def _small_gpu(tmp_path, memory_bytes: float) -> str:
    """The H100 profile with less memory (a path `Question.hardware` takes)."""
    profile = json.loads((Path(__file__).resolve().parents[2] / "canzona" / "profiles" / "h100-sxm.json").read_text())
    profile["gpu"]["memory_bytes"] = int(memory_bytes)
    path = tmp_path / f"h100-{int(memory_bytes)}.json"
    path.write_text(json.dumps(profile))
    return str(path)


def test_each_space_searches_the_modes_the_simulator_runs_on_it():
    """The recompute modes each space tries are the simulator's for its kind of layout: a mode is
    in a space's list exactly when `SimConfig.check` takes it on the space's layouts
    (`canzona.recompute.layout_recompute_modes`, one definition)."""
    from canzona.recompute import RECOMPUTE_MODES, SELECTIVE_LAYER
    from sim.search import FSDP_SPACE, ZERO1_SPACE

    assert SELECTIVE_LAYER not in ZERO1_SPACE.recompute_modes and SELECTIVE_LAYER in FSDP_SPACE.recompute_modes
    for q, space in ((SMALL, ZERO1_SPACE), (replace(SMALL, fsdp=True), FSDP_SPACE)):
        layout = {"tp": 1, "pp": 1, "vp": 1, "cp": 1, "ep": 1, "micro_batch": 1, "hsdp_replicate": 1,
                  "reshard_after_forward": True}
        for mode in RECOMPUTE_MODES:
            try:
                config_of(q, {**layout, "recompute": mode}).check()
                runs = True
            except SpecError:
                runs = False
            assert runs == (mode in space.recompute_modes), (space.name, mode)


def test_a_zero1_search_never_queues_selective_layer(tmp_path, leave_out_optimizer_state):
    """On a 4 GB GPU some layouts of Qwen3-0.6B's shape at 8 layers do not fit even with full
    recompute: the search steps on from them to no mode the simulator refuses on a ZeRO-1 layout
    (torchtitan's selective-layer, which it used to queue after full and count as refused by the
    checks). The memory floor without the optimizer state, so that they are simulated: with it, it
    prunes them here."""
    leave_out_optimizer_state()
    q = replace(EIGHT_LAYERS, seq_len=4096, hardware=_small_gpu(tmp_path, 4e9))
    found = search(q, top=3, workers=1)
    assert any(r["recompute"] == "full" and r["recompute_method"] is None for r in found.not_fitting)
    assert not any("selective-layer" in reason for reason in found.reasons), found.reasons
    assert {r["recompute"] for r in found.ranked + found.not_fitting} <= {"none", "selective", "selective-op", "full"}
    assert all(r["selective_ac_option"] is None for r in found.ranked + found.not_fitting)


def test_the_memory_floor_counts_the_optimizer_states_mean(leave_out_optimizer_state):
    """The fp32 masters and AdamW's two moments, which the distributed optimizer spreads over the
    DP ranks, are in the floor at their mean (12 bytes an element over 8 GPUs): still below the
    simulated memory, and above the floor without them by exactly that."""
    q = replace(SMALL, optimizer="adamw")
    model = resolve_model(q.model)
    layout = next(c for c in candidates(q) if (c["tp"], c["pp"], c["micro_batch"]) == (1, 1, 1))
    cfg = config_of(q, {**layout, "recompute": "none"})
    with_state = memory_floor(cfg, model)
    leave_out_optimizer_state()
    assert with_state - memory_floor(cfg, model) == (4 + 8) * model[0].numel // 8
    assert with_state <= simulate(cfg).memory.worst.total


def test_an_odd_sequence_is_searched_without_context_parallelism():
    """CP splits the sequence into 2 x CP chunks; without CP any length runs (`canzona simulate`
    takes it), so an odd sequence keeps every layout without CP (it had none: CP 1 was asked to
    divide the sequence in two)."""
    from sim.search import Question, candidates

    for seq in (4095, 7, 1):
        layouts = candidates(Question(model="qwen3-0.6b", gpus=8, seq_len=seq, global_batch=8))
        assert layouts and {c["cp"] for c in layouts} == {1}
    assert {c["cp"] for c in candidates(Question(model="qwen3-0.6b", gpus=16, seq_len=8192, global_batch=16))} == {1, 2}


def test_not_in_plan_names_the_step_policy_the_plan_file_does_not():
    """DistributedOptimizer takes the step policy as its own option (`policy=`), the plan file holds
    the DP and TP plans only: a refined policy, or canzona's fallback to zero1-gather, is a launcher
    setting; the optimizer's default is not mentioned."""
    row = {"pp": 1, "vp": 1, "cp": 1, "micro_batch": 1, "recompute": "none", "reduce_scatter": DEFAULT_REDUCE_SCATTER,
           "fell_back_to": None, "policy": "canzona"}
    assert not any(x.startswith("policy=") for x in not_in_plan(row))
    assert "policy='layerwise' (DistributedOptimizer's option; the plan file does not name it)" in \
        not_in_plan({**row, "policy": "layerwise"})
    assert any(x.startswith("policy='zero1-gather'") for x in not_in_plan({**row, "fell_back_to": "zero1-gather"}))
    assert not any(x.startswith("policy=") for x in not_in_plan({**row, "policy": "zero1"}))  # AdamW's default


def test_a_row_pairing_zero1_gathers_dense_part_with_canzonas_experts_says_it_is_not_deployed():
    """Under EP canzona's fallback may price zero1-gather for the dense part beside canzona's experts
    (Megatron-style collectives, two step policies); the runtime runs one policy, so the printed plan
    command deploys canzona on both parts. The row said "(two plans)" among the launcher's settings,
    as if a launcher could set it."""
    from sim.simulate import DENSE_FALLBACK

    row = {"pp": 1, "vp": 1, "cp": 1, "ep": 8, "micro_batch": 1, "recompute": "none",
           "reduce_scatter": DEFAULT_REDUCE_SCATTER, "fell_back_to": DENSE_FALLBACK, "policy": "canzona"}
    notes = [x for x in not_in_plan(row) if DENSE_FALLBACK.split(" for ")[0] in x]
    assert len(notes) == 1 and "not this row's run" in notes[0] and "deploys canzona on both parts" in notes[0], notes
    assert "--no-zero1-fallback" in notes[0]
    assert not any(x.startswith("policy=") for x in not_in_plan(row))  # no policy= would deploy it either


def _zero1_row(**changes) -> dict:
    """A simulated ZeRO-1 row's keys (`run_one`'s) at TP 1 x PP 1, micro-batch 1, no recompute."""
    row = {"tp": 1, "pp": 1, "pipeline_split": "even", "vp": 1, "cp": 1, "ep": 1, "micro_batch": 1,
           "recompute": "none", "dp": 8, "policy": "canzona", "reduce_scatter": DEFAULT_REDUCE_SCATTER,
           "fell_back_to": None, "recompute_method": None, "recompute_num_layers": None,
           "selective_ac_option": None, "overlap_moe_expert_parallel_comm": False, "delay_wgrad_compute": False}
    return {**row, **changes}


def test_not_in_plan_names_megatrons_flags_for_every_layout_setting():
    """Each launcher setting is Megatron-LM's flag (a user pastes them into the launch): TP with the
    sequence parallelism and userbuffers overlap the simulator runs it with (both off in a default
    Megatron run), PP, VP, CP, EP with its dispatcher (Megatron's default is allgather), the
    micro-batch (required) and each recompute as granularity / method / layers (full needs a method
    in Megatron: every layer alone is uniform 1). They said `pp 2`, `vp 3`, `cp 2`, `micro-batch 4`,
    `recompute full`, and nothing of TP's sequence parallelism or the EP dispatcher."""
    launch = " ; ".join(not_in_plan(_zero1_row(tp=2, pp=2, vp=3, cp=2, micro_batch=4, recompute="full")))
    for flag in ("--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap",
                 "--pipeline-model-parallel-size 2", "--num-virtual-stages-per-pipeline-rank 3",
                 "--context-parallel-size 2", "--micro-batch-size 4",
                 "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"):
        assert flag in launch, (flag, launch)
    assert "--micro-batch-size 1" in not_in_plan(_zero1_row())
    block = not_in_plan(_zero1_row(recompute="full", recompute_method="block", recompute_num_layers=3))
    assert "--recompute-granularity full --recompute-method block --recompute-num-layers 3" in block
    assert "--recompute-granularity selective (the attention core)" in not_in_plan(_zero1_row(recompute="selective"))
    # torchtitan's per-op policy: no Megatron flag runs it, and the line says so rather than naming a wrong one
    op = " ".join(not_in_plan(_zero1_row(recompute="selective-op")))
    assert "Megatron-LM has no flag" in op and "--recompute-granularity" in op
    q = Question(model="qwen3-30b-a3b", gpus=16, ep_dispatcher=EpDispatcher(moe_token_dispatcher_type="flex",
                                                                              moe_flex_dispatcher_backend="deepep"))
    ep = " ; ".join(not_in_plan(_zero1_row(ep=8, dp=16), q))
    assert "--expert-model-parallel-size 8 --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep" in ep
    assert "--moe-grouped-gemm" in ep
    assert "--moe-token-dispatcher-type alltoall" in " ".join(not_in_plan(_zero1_row(ep=8, dp=16)))


def test_not_in_plan_names_the_questions_settings_a_default_megatron_run_lacks():
    """Given the question, the settings every layout was searched with that a default Megatron-LM run
    does not have: bf16, the global batch and sequence (Megatron's global batch defaults to
    micro-batch x DP), FP8 with its recipe and FP8 primary weights, bf16 gradient reductions, the
    attention backend, the fusions, and DistributedOptimizer's options off their defaults. An FP8
    search with --fp8-params printed only `micro-batch 4`: the user launched a bf16 job."""
    q = Question(model="qwen3-0.6b", gpus=8, seq_len=2048, global_batch=64, precision="fp8", fp8_params=True,
                 grad_reduce_in_fp32=False, attention_backend="flash", apply_rope_fusion=False,
                 cross_entropy_loss_fusion=True, overlap_param_gather=False, max_grad_norm=1.0)
    launch = " ; ".join(not_in_plan(_zero1_row(), q))
    for flag in ("--bf16 --global-batch-size 64 --seq-length 2048",
                 "--fp8-format hybrid --fp8-recipe delayed --fp8-param-gather", "--grad-reduce-in-bf16",
                 "--attention-backend flash", "--no-rope-fusion", "--cross-entropy-loss-fusion",
                 "overlap_param_gather=False, max_grad_norm=1.0 (DistributedOptimizer's options)"):
        assert flag in launch, (flag, launch)
    assert "--fp8-recipe tensorwise" in " ".join(not_in_plan(_zero1_row(), replace(q, fp8_recipe="current")))
    plain = " ; ".join(not_in_plan(_zero1_row(), Question(model="qwen3-0.6b", gpus=8)))
    assert not any(x in plain for x in ("fp8", "--grad-reduce-in-bf16", "--attention-backend", "fusion", "DistributedOptimizer's"))
    # a TP layout without the userbuffers overlap: sequence parallel still, no --tp-comm-overlap
    no_ub = " ".join(not_in_plan(_zero1_row(tp=2, dp=4), replace(q, tp_comm_overlap=False)))
    assert "--sequence-parallel" in no_ub and "--tp-comm-overlap" not in no_ub


def test_search_rows_carry_the_questions_launch_settings():
    """`SearchResult.to_dict` (the CLI's table and --json) gives each row the question's settings too."""
    q = replace(SMALL, precision="fp8", fp8_params=True)
    found = search(q, top=1, refine_top=1, workers=1)
    row = found.to_dict(1)["layouts"][0]
    assert any("--fp8-format hybrid --fp8-recipe delayed --fp8-param-gather" in x for x in row["not_in_plan"])


def test_fsdp_launch_names_megatron_flags_for_megatron_fsdp_and_the_questions_settings():
    """A Megatron-FSDP row runs on Megatron-LM: its micro-batch, TP, EP and recompute are Megatron's
    flags, not torchtitan's settings (it named `activation_checkpoint.mode = 'full'` for a Megatron-LM
    run); with the question, every FSDP row also names the batch, the sequence and FP8, which it left
    out (an FP8 FSDP search printed a bf16 job)."""
    q = Question(model="qwen3-1.7b", gpus=8, seq_len=8192, global_batch=64, fsdp=True, fsdp_impl="megatron-fsdp",
                 precision="fp8")
    row = {**_zero1_row(tp=2, dp=4, micro_batch=2, recompute="full"), "fsdp": True, "fsdp_impl": "megatron-fsdp",
           "hsdp_replicate": 1, "reshard_after_forward": True, "reduce_scatter": None}
    launch = " ; ".join(not_in_plan(row, q))
    for flag in ("--use-megatron-fsdp", "--tensor-model-parallel-size 2 --sequence-parallel", "--micro-batch-size 2",
                 "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
                 "--bf16 --global-batch-size 64 --seq-length 8192", "--fp8-format hybrid --fp8-recipe delayed"):
        assert flag in launch, (flag, launch)
    assert "activation_checkpoint" not in launch
    fsdp2 = " ; ".join(not_in_plan({**row, "fsdp_impl": "fsdp2", "tp": 1, "dp": 8}, replace(q, fsdp_impl="fsdp2")))
    for text in ("global batch 64", "sequence 8192", "FP8", "activation_checkpoint.mode = 'full'"):
        assert text in fsdp2, (text, fsdp2)
    assert "--use-megatron-fsdp" not in fsdp2


def test_progress_hears_a_heartbeat_while_a_simulation_runs(monkeypatch):
    """One simulation of a large layout may take minutes: while none finishes the search calls
    `progress` every `HEARTBEAT_S` with the layout None and the counts and best as they stand (what
    `canzona search` prints outside a terminal); the fastest fitting time so far comes with each."""
    import sim.search as search_mod

    monkeypatch.setattr(search_mod, "HEARTBEAT_S", 1e-3)
    seen: list[tuple] = []
    result = search(EIGHT_LAYERS, top=1, workers=1, progress=lambda *call: seen.append(call))
    beats = [call for call in seen if call[2] is None]
    finished = [call for call in seen if call[2] is not None]
    assert beats and finished
    assert [call[0] for call in seen] == sorted(call[0] for call in seen)  # a beat repeats, never runs ahead
    assert finished[-1][3] == result.ranked[0]["iteration_time_s"]
