"""sim.published_search: a published layout ranked among the searched ones."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sim import published
from sim.published_search import (
    TOP,
    LayoutRank,
    layout_of,
    outside_space,
    question_of,
    rank_run,
    summary,
)
from sim.search import candidates, config_of, describe, search, space_of
from tests.sim.small_models import EIGHT_LAYERS


def _run(**changes) -> published.PublishedRun:
    """A small made-up run (qwen3-0.6b on 8 GPUs): fast to search exhaustively."""
    base = dict(id="small", model="qwen3-0.6b", source="s", hardware="h100-sxm", gpus=8, tp=2, pp=1, vp=1, cp=1,
                ep=1, fsdp=False, global_batch=8, micro_batch=1, seq_len=1024, precision="bf16", optimizer="adamw",
                recompute=None, tokens_per_s_per_gpu=1.0, original_value=1.0, original_unit="tokens/s/GPU")
    return published.PublishedRun(**{**base, **changes})


def test_rank_matches_the_exhaustive_search():
    """The rank (or its lower bound) agrees with every layout simulated."""
    run = _run(model=EIGHT_LAYERS)  # every layout simulated in seconds
    r = rank_run(run, workers=2)
    full = search(question_of(run), top=10**6, refine_top=0, workers=2)
    key = ("tp", "pp", "vp", "cp", "ep", "micro_batch", "recompute")
    mine = tuple(layout_of(run)[k] for k in key)
    faster = [row for row in full.ranked
              if row["iteration_time_s"] < r.published_s and tuple(row[k] for k in key) != mine]
    assert r.published_s is not None and not r.outside
    if r.rank is not None:
        assert r.rank == 1 + len(faster)
    else:
        assert r.rank_at_least <= 1 + len(faster) and len(faster) >= TOP
    assert r.best["iteration_time_s"] == full.ranked[0]["iteration_time_s"]
    assert r.gap >= 0 and r.meets == ((r.rank is not None and r.rank <= TOP) or r.gap <= 0.05)
    assert r.to_dict()["gap_to_best"] == r.gap


def test_criterion():
    run = _run()
    best = {"iteration_time_s": 1.0, "tp": 1, "pp": 1, "vp": 1, "cp": 1, "ep": 1, "dp": 8, "micro_batch": 1,
            "recompute": "none"}
    assert LayoutRank(run, published_s=1.04, published_fits=True, best=best, rank_at_least=9).meets
    assert not LayoutRank(run, published_s=1.06, published_fits=True, best=best, rank_at_least=9).meets
    assert LayoutRank(run, published_s=1.5, published_fits=True, best=best, rank=TOP).meets
    assert LayoutRank(run, published_s=0.9, published_fits=True, best=best, rank=1).gap == 0.0
    assert LayoutRank(run, ("--precision fp8",)).meets is None


def test_the_best_named_is_the_one_whose_time_is_given():
    """A published layout outside the search space can beat every layout found: the best time is then
    its own, and the best layout named is it, not the search's best (whose time is not the one given)."""
    run = _run()
    best = {"iteration_time_s": 1.0, "tp": 1, "pp": 1, "vp": 1, "cp": 1, "ep": 1, "dp": 8, "micro_batch": 1,
            "recompute": "none"}
    beaten = LayoutRank(run, outside="an uneven split", published_s=0.9, published_fits=True, best=best, rank=1)
    assert beaten.to_dict()["best_layout"] == "the published layout" and beaten.best_s == 0.9
    slower = LayoutRank(run, published_s=1.2, published_fits=True, best=best, rank=2)
    assert slower.to_dict()["best_layout"] == describe(best) and slower.best_s == 1.0
    unfit = LayoutRank(run, published_s=0.9, published_fits=False, best=best, rank=1)  # not a layout that runs
    assert unfit.to_dict()["best_layout"] == describe(best) and unfit.best_s == 1.0


def test_an_untuned_layout_is_ranked_but_not_held_to_the_criterion():
    """A sanity-check run's layout (its source's `layout_not_tuned`) keeps its rank and gap in the
    report, and the count of rows meeting the criterion is over the tuned rows only."""
    best = {"iteration_time_s": 1.0, "tp": 1, "pp": 1, "vp": 1, "cp": 1, "ep": 1, "dp": 8, "micro_batch": 1,
            "recompute": "none"}
    tuned = LayoutRank(_run(id="tuned"), published_s=1.02, published_fits=True, best=best, rank=2)
    slow = LayoutRank(_run(id="tuned-slow"), published_s=1.6, published_fits=True, best=best, rank_at_least=9)
    untuned = LayoutRank(_run(id="check", layout_not_tuned="the card: sanity checks"), published_s=1.6,
                         published_fits=True, best=best, rank_at_least=9)
    assert tuned.held and slow.held and not untuned.held
    assert untuned.meets is False and untuned.to_dict()["gap_to_best"] == pytest.approx(0.6)
    assert untuned.to_dict()["layout_not_tuned"] == "the card: sanity checks"
    s = summary([tuned, slow, untuned])
    assert (s["searched"], s["held"], s["meets"]) == (3, 2, 1)
    assert summary([tuned, untuned])["meets"] == summary([tuned])["meets"] == 1


def test_sanity_check_sources_are_marked_untuned():
    """The Megatron-Bridge verification cards' functional runs say they are sanity checks, and
    torchtitan's performance page chose its local batch to mimic large-scale training and compare
    1D with 2D parallelism (not for speed): their rows carry the source's words; every other row's
    source tuned its layout."""
    runs, sources = published.load()
    for run in runs:
        assert run.layout_not_tuned == sources[run.source].get("layout_not_tuned", "")
    untuned = {r.id for r in runs if r.layout_not_tuned}
    titan = {r.id for r in runs if r.source == "torchtitan-a100"}
    assert len(titan) == 8 and untuned == {"qwen3-8b-16xh100-mb", "qwen3-30b-a3b-16xh100-mb"} | titan
    for r in runs:
        if r.layout_not_tuned:
            assert ("mimics the small local batch size" if r.id in titan else "sanity checks") in r.layout_not_tuned


def test_published_layouts_are_in_the_search_space():
    """Every expressible published row's layout is a candidate of its search, as the simulator
    takes it (the same configuration as `canzona validate --published` simulates)."""
    runs, _ = published.load()
    expressible = [r for r in runs if not r.needs()]
    assert expressible
    assert any(r.fsdp for r in expressible)  # FSDP rows are asked among FSDP layouts (FSDP_SPACE)
    for run in expressible:
        q = question_of(run)
        layout = layout_of(run)
        assert q.fsdp == run.fsdp, run.id
        # Qwen3-235B-A22B's and Llama 3.1 405B's embedding and loss counted as layers included
        assert outside_space(q, layout) == "", run.id
        keys = space_of(q).layout_keys
        assert any(all(c[k] == layout[k] for k in (*keys, "dp") if k != "recompute")
                   for c in candidates(q)), run.id
        assert config_of(q, layout_of(run)) == run.sim_config(), run.id
    assert {layout_of(r)["pipeline_split"] for r in expressible} == {"even", "embedding+loss"}


def test_a_rows_recompute_method_is_its_published_layouts():
    """A row run with Megatron's recompute method is simulated with it, as `canzona validate
    --published` simulates it: the layout carries the method, not the search's every-layer full
    recompute. Block is in the search's space (it tries the block method); uniform is not."""
    every = _run(recompute="full", tp=1, pp=2, micro_batch=1)
    block = replace(every, recompute_method="block", recompute_num_layers=2)
    q = question_of(block)
    assert layout_of(every).get("recompute_method") is None
    assert (layout_of(block)["recompute_method"], layout_of(block)["recompute_num_layers"]) == ("block", 2)
    cfg = config_of(q, layout_of(block))
    assert cfg == block.sim_config() and cfg.options.recompute_method == "block"
    # the first two of a stage's 14 layers checkpointed: less recompute than every layer's
    assert rank_run(block, workers=1).published_s < rank_run(every, workers=1).published_s
    assert outside_space(q, layout_of(block)) == ""
    uniform = replace(every, recompute_method="uniform", recompute_num_layers=1)
    assert outside_space(question_of(uniform), layout_of(uniform)).startswith("recompute method uniform")


def test_fsdp_rows_are_ranked_among_fsdp_layouts():
    """An FSDP run is asked among FSDP layouts (`FSDP_SPACE`): its layout, HSDP replicas and
    reshard setting included, is a candidate, and its rank agrees with the exhaustive search."""
    run = _run(fsdp=True, tp=2, reshard_after_forward=False, optimizer="muon")
    q = question_of(run)
    assert q.fsdp and space_of(q).name == "fsdp"
    layout = layout_of(run)
    assert (layout["hsdp_replicate"], layout["reshard_after_forward"]) == (1, False)
    assert outside_space(q, layout) == "" and config_of(q, layout) == run.sim_config()
    r = rank_run(run, workers=1)
    full = search(q, top=10**6, refine_top=0, workers=1)
    keys = space_of(q).layout_keys
    faster = [row for row in full.ranked if row["iteration_time_s"] < r.published_s
              and tuple(row[k] for k in keys) != tuple(layout[k] for k in keys)]
    assert r.rank == 1 + len(faster) or (r.rank is None and r.rank_at_least <= 1 + len(faster))
    assert r.best["iteration_time_s"] == full.ranked[0]["iteration_time_s"] and r.best["fsdp"]
    assert r.to_dict()["best_layout"].startswith("FSDP ")
    assert outside_space(q, {**layout, "fsdp": False}).startswith("ZeRO-1 layouts are not searched")


def test_outside_the_space_says_why():
    run = _run(micro_batch=16, global_batch=64, gpus=2, tp=1)  # micro-batches above MAX_MICRO_BATCH: not searched
    assert "micro_batch 16" in outside_space(question_of(run), layout_of(run))
    assert "vp 3" in outside_space(question_of(run), {**layout_of(run), "pp": 2, "vp": 3})


@pytest.mark.slow
def test_a_published_row_ranks():
    """One real row end to end (llama3.1-8b on 8 H100): ranked, with a gap to the best."""
    runs, _ = published.load()
    run = next(r for r in runs if r.id == "llama3.1-8b-8xh100-dgxc-bf16")
    seen: list[tuple] = []
    r = rank_run(run, workers=2, progress=lambda *call: seen.append(call))
    assert r.published_s and r.best is not None and r.gap is not None and r.gap >= 0
    # validate's (done, total, what) of each finished simulation: the search's heartbeats stay its own
    assert seen and all(len(call) == 3 and isinstance(call[2], str) for call in seen)
    assert (r.rank or r.rank_at_least) >= 1
