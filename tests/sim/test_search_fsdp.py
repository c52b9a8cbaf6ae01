"""sim.search under `fsdp`: the FSDP2 / HSDP space, its floors, its exactness against brute force."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

import canzona
from canzona.cost import DeviceRate
from canzona.errors import SpecError
from canzona.hardware import load_profile
from canzona.models import resolve_model
from canzona.step_policies import FSDP_POLICIES
from sim.ep_dispatch import EpDispatcher
from sim.fsdp import FSDP_RECOMPUTE_MODES
from sim.search import (
    FSDP_LAYOUT_AXES,
    FSDP_SPACE,
    LAYOUT_AXES,
    ZERO1_SPACE,
    Question,
    candidates,
    config_of,
    describe,
    facts_of,
    layout_of,
    memory_floor,
    not_in_plan,
    plan_command,
    refine_values,
    search,
    selective_ac_options,
    space_of,
    time_floor,
)
from sim.simulate import simulate
from tests.sim import small_models

SMALL = Question(model="qwen3-0.6b", gpus=8, seq_len=1024, global_batch=8, fsdp=True)
# the brute force's dense question: SMALL's model cut to 8 layers, every layout in seconds
EIGHT_LAYERS = replace(SMALL, model=small_models.EIGHT_LAYERS)
# a mixture-of-experts model whose layouts need recompute to fit 8 H100s at some micro-batches
MOE = Question(model="qwen3-30b-a3b", gpus=8, seq_len=4096, global_batch=16, optimizer="adamw", fsdp=True)
LLAMA = str(Path(canzona.__file__).resolve().parent / "data" / "models" / "llama3-8b.json")


def test_fsdp_axes_are_data():
    """The FSDP space's axes, with its recompute modes read from the simulator's own list and its
    refinement the FSDP step policies; without `fsdp` the ZeRO-1 space, unchanged."""
    assert [a.name for a in FSDP_LAYOUT_AXES] == ["tp", "pp", "vp", "cp", "ep", "hsdp_replicate",
                                                  "reshard_after_forward", "micro_batch", "recompute"]
    assert FSDP_SPACE.recompute_modes is FSDP_RECOMPUTE_MODES
    facts = facts_of(SMALL)
    assert list(next(a for a in FSDP_LAYOUT_AXES if a.name == "recompute").values(facts, {})) == \
        list(FSDP_RECOMPUTE_MODES)
    policy = FSDP_SPACE.refine[0]
    assert [a.name for a in FSDP_SPACE.refine] == ["policy"]  # no reduce-scatter implementation under FSDP
    assert refine_values(SMALL, policy, facts, {}) == list(FSDP_POLICIES)  # canzona (the default) first
    assert refine_values(MOE, policy, facts_of(MOE), {}) == ["zero1"]  # AdamW steps its shards: its own only
    assert space_of(SMALL) is FSDP_SPACE and space_of(Question(model="qwen3-0.6b", gpus=8)) is ZERO1_SPACE
    assert ZERO1_SPACE.layout is LAYOUT_AXES


def test_fsdp_candidates():
    """PP dividing the layers (torchtitan's even split), no virtual pipeline or context
    parallelism; HSDP's replicas divide DP; both reshard settings; what the simulator refuses (a
    shard group of one rank, HSDP or too few micro-batches under PP) is its checks'."""
    layouts = candidates(SMALL)
    assert {(c["pp"], c["vp"], c["cp"]) for c in layouts} == {(1, 1, 1), (2, 1, 1), (4, 1, 1)}  # 28 layers
    assert all(c["tp"] * c["pp"] * c["dp"] == SMALL.gpus for c in layouts)
    layouts = [c for c in layouts if c["pp"] == 1]
    assert {c["tp"] for c in layouts} == {1, 2, 4, 8}
    assert {c["reshard_after_forward"] for c in layouts} == {True, False}
    for c in layouts:
        assert c["tp"] * c["dp"] == SMALL.gpus and c["dp"] % c["hsdp_replicate"] == 0
        assert c["recompute"] == FSDP_RECOMPUTE_MODES[0]
    ok = [c for c in layouts if c["dp"] // c["hsdp_replicate"] >= 2]
    for c in ok:
        config_of(SMALL, c).check()
    with pytest.raises(SpecError, match="leaves a shard group of 1 rank"):
        config_of(SMALL, next(c for c in layouts if c["hsdp_replicate"] == c["dp"])).check()
    # the MoE model: TP only on dense models, no HSDP under EP (the simulator's rules)
    model = resolve_model(MOE.model)
    runnable = []
    for c in candidates(MOE):
        try:
            config_of(MOE, c).check(model)
        except SpecError:
            continue
        runnable.append(c)
    assert {c["tp"] for c in runnable} == {1} and {c["hsdp_replicate"] for c in runnable if c["ep"] > 1} == {1}
    assert {c["ep"] for c in runnable} == {1, 2, 4, 8}


# (question, layout): dense and MoE, HSDP, no reshard, every recompute mode, TP with and without its
# communication overlap, eager kernels, Megatron-FSDP, FP8, many micro-batches (extrapolated)
FLOOR_CASES = [
    (dict(model="qwen3-0.6b", gpus=8, seq_len=1024, global_batch=8),
     dict(tp=1, hsdp_replicate=1, reshard_after_forward=True, micro_batch=1, recompute="none"), "fsdp-gather-all"),
    (dict(model="qwen3-0.6b", gpus=8, seq_len=1024, global_batch=8),
     dict(tp=2, hsdp_replicate=2, reshard_after_forward=False, micro_batch=2, recompute="full"), None),
    (dict(model="qwen3-0.6b", gpus=16, seq_len=2048, global_batch=32, optimizer="adamw"),
     dict(tp=1, hsdp_replicate=4, reshard_after_forward=True, micro_batch=2, recompute="selective-op"), None),
    (dict(model="qwen3-0.6b", gpus=16, seq_len=2048, global_batch=32, optimizer="soap"),
     dict(tp=4, hsdp_replicate=1, reshard_after_forward=True, micro_batch=1, recompute="selective"),
     "fsdp-owners-unbalanced"),
    (dict(model=LLAMA, gpus=16, seq_len=4096, global_batch=16, kernels="eager", optimizer="adamw"),
     dict(tp=1, hsdp_replicate=2, reshard_after_forward=True, micro_batch=1, recompute="selective-op"), None),
    (dict(model="qwen3-8b", gpus=16, seq_len=4096, global_batch=32, tp_comm_overlap=False),
     dict(tp=2, hsdp_replicate=1, reshard_after_forward=False, micro_batch=2, recompute="full"), None),
    (dict(model="qwen3-8b", gpus=16, seq_len=4096, global_batch=16, fsdp_impl="megatron-fsdp"),
     dict(tp=8, hsdp_replicate=1, reshard_after_forward=True, micro_batch=1, recompute="none"), None),
    (dict(model="qwen3-30b-a3b", gpus=8, seq_len=4096, global_batch=16, optimizer="adamw"),
     dict(tp=1, ep=8, hsdp_replicate=1, reshard_after_forward=False, micro_batch=2, recompute="full"), None),
    (dict(model="qwen3-30b-a3b", gpus=16, seq_len=4096, global_batch=16, optimizer="adamw"),
     dict(tp=1, ep=4, hsdp_replicate=1, reshard_after_forward=True, micro_batch=1, recompute="selective-op"), None),
    (dict(model="qwen3-30b-a3b", gpus=8, seq_len=4096, global_batch=32, optimizer="adamw", loss_fp32_upcast=False,
          ep_dispatcher=EpDispatcher(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep",
                                     fake_balanced_gate=True)),
     dict(tp=1, ep=8, hsdp_replicate=1, reshard_after_forward=False, micro_batch=4, recompute="full"), None),
    (dict(model="qwen3-30b-a3b", gpus=8, seq_len=2048, global_batch=8, optimizer="adamw"),
     dict(tp=1, ep=1, hsdp_replicate=2, reshard_after_forward=True, micro_batch=1, recompute="none"), None),
    (dict(model="qwen3-0.6b", gpus=8, seq_len=1024, global_batch=8, precision="fp8"),
     dict(tp=2, hsdp_replicate=1, reshard_after_forward=True, micro_batch=1, recompute="none"), None),
    (dict(model="qwen3-0.6b", gpus=8, seq_len=1024, global_batch=64),
     dict(tp=1, hsdp_replicate=2, reshard_after_forward=True, micro_batch=1, recompute="none"), None),
    (dict(model="qwen3-8b", gpus=16, seq_len=4096, global_batch=32, selective_ac_option=3),
     dict(tp=2, hsdp_replicate=1, reshard_after_forward=True, micro_batch=2, recompute="selective-layer",
          selective_ac_option=3), None),
    (dict(model="qwen3-30b-a3b", gpus=8, seq_len=4096, global_batch=16, optimizer="adamw"),
     dict(tp=1, ep=8, hsdp_replicate=1, reshard_after_forward=False, micro_batch=1, recompute="selective-layer"),
     None),
    # PP x FSDP (sim.fsdp_pipeline): tied and untied heads, 2 and 4 stages, TP, both reshard settings
    (dict(model="qwen3-0.6b", gpus=8, seq_len=1024, global_batch=16),
     dict(pp=2, tp=1, hsdp_replicate=1, reshard_after_forward=True, micro_batch=1, recompute="none"), None),
    (dict(model="qwen3-0.6b", gpus=8, seq_len=1024, global_batch=16, optimizer="adamw"),
     dict(pp=4, tp=1, hsdp_replicate=1, reshard_after_forward=False, micro_batch=1, recompute="full"), None),
    (dict(model="qwen3-1.7b", gpus=16, seq_len=2048, global_batch=32),
     dict(pp=2, tp=2, hsdp_replicate=1, reshard_after_forward=False, micro_batch=2, recompute="selective-op"), None),
    (dict(model="qwen3-8b", gpus=16, seq_len=2048, global_batch=16),
     dict(pp=4, tp=1, hsdp_replicate=1, reshard_after_forward=True, micro_batch=1, recompute="none"), None),
]


@pytest.mark.parametrize("asked, layout, policy", FLOOR_CASES)
def test_fsdp_floors_are_below_the_simulation(asked, layout, policy):
    """The time and memory floors that prune FSDP layouts are lower bounds of what `simulate`
    returns for them."""
    q = Question(**asked, fsdp=True)
    cfg = config_of(q, {"pp": 1, "vp": 1, "cp": 1, "ep": 1, **layout, **({"policy": policy} if policy else {})})
    assert cfg.fsdp and cfg.hsdp_replicate == layout["hsdp_replicate"]
    model = resolve_model(q.model)
    hw = load_profile(cfg.hardware)
    r = simulate(cfg)
    floor = time_floor(cfg, model, DeviceRate.from_profile(hw), hw)
    assert 0 < floor <= r.iteration_time_s
    assert 0 < memory_floor(cfg, model) <= r.memory.worst.total


def test_fsdp_floors_are_below_every_pipeline_layout_of_a_small_question():
    """Every PP > 1 candidate the simulator runs of an 8-layer model at 8 GPUs (PP 2 and 4, TP 1
    and 2, both reshard settings, every micro-batch with at least a micro-batch a stage), each
    under one of the recompute settings in turn: both floors below the simulation."""
    q = replace(EIGHT_LAYERS, global_batch=16, optimizer="adamw")
    model = resolve_model(q.model)
    hw = load_profile(q.hardware)
    rate = DeviceRate.from_profile(hw)
    settings = FSDP_SPACE.recompute_variants(q)
    ran = set()
    for i, c in enumerate(c for c in candidates(q) if c["pp"] > 1 and c["hsdp_replicate"] == 1):
        cfg = config_of(q, {**c, **settings[i % len(settings)]})
        try:
            cfg.check(model)
        except SpecError:
            continue
        r = simulate(cfg)
        assert time_floor(cfg, model, rate, hw) <= r.iteration_time_s, c
        assert memory_floor(cfg, model) <= r.memory.worst.total, c
        ran.add((c["pp"], c["tp"]))
    assert ran == {(2, 1), (2, 2), (4, 1)}


def _fastest_setting_that_fits(q: Question, layout: dict) -> float:
    """The least time of one layout over every recompute setting the FSDP space tries (selective-
    layer at every K it tries), each simulated; infinite when none fits."""
    model = resolve_model(q.model)
    layout = {k: v for k, v in layout.items() if k not in ("recompute", "selective_ac_option")}
    best = float("inf")
    for setting in FSDP_SPACE.recompute_variants(q):
        cfg = config_of(q, {**layout, **setting})
        try:
            cfg.check(model)
        except SpecError:
            continue
        r = simulate(cfg)
        if r.fits:
            best = min(best, r.iteration_time_s)
    return best


def _brute_force(q: Question) -> float:
    """The fastest fitting layout's time over every candidate under every recompute setting."""
    return min(_fastest_setting_that_fits(q, c) for c in candidates(q))


# the MoE question's brute force is a minute of CPU: `slow`, since test_the_rounds_take_the_least_compute_that_fits
# holds the search's best to the brute force's on the same MoE model at ROUNDS_GPU_BYTES in every run
@pytest.mark.parametrize("q", [EIGHT_LAYERS, pytest.param(MOE, marks=pytest.mark.slow)], ids=["dense", "moe"])
def test_fsdp_search_best_is_the_brute_force_best(q):
    """Branch and bound with the FSDP floors and the recompute rounds finds the layout that
    simulating every FSDP candidate under every recompute mode finds (layouts only: no
    refinement), simulating far fewer."""
    found = search(q, top=1, refine_top=0, workers=1)
    assert found.ranked[0]["iteration_time_s"] == _brute_force(q)
    assert found.simulated < len(candidates(q))
    if q is MOE:  # its best layout needs recompute to fit: the recompute rounds are what found it
        assert found.ranked[0]["recompute"] != "none"


def test_fsdp_rows_carry_their_layout_and_no_plan_command():
    """A row says it is FSDP and carries HSDP's replicas and the reshard setting; it has no `canzona
    plan` command (no plan file under FSDP) but the launcher's settings."""
    found = search(SMALL, top=2, refine_top=1, workers=1)
    row = found.ranked[0]
    assert row["fsdp"] and row["fsdp_impl"] == "fsdp2" and row["reduce_scatter"] is None
    assert {"hsdp_replicate", "reshard_after_forward"} <= set(row)
    assert describe(row).startswith(f"FSDP TP{row['tp']} ")
    assert plan_command(SMALL, row) is None
    launch = not_in_plan(row)
    assert launch[0].startswith("fully_shard each decoder layer") and any("policy=" in x for x in launch)
    # the refinement: the best layout under the other FSDP step policies
    assert {r["policy"] for r in found.ranked if r["refined"]} == set(FSDP_POLICIES) - {"canzona"}
    hsdp = {**row, "hsdp_replicate": 2, "reshard_after_forward": False}
    assert "replicate 2, shard" in not_in_plan(hsdp)[0] and "reshard_after_forward=False" in not_in_plan(hsdp)
    assert "HSDP2 no-reshard" in describe(hsdp)


@pytest.mark.parametrize("changes, named", [
    ({"recompute_method": "block", "recompute_num_layers": 2}, "--recompute-method, --recompute-num-layers"),
    ({"store_param_remainders": True}, "--store-param-remainders"),
    ({"search_recompute_layers": False}, "--no-search-recompute-layers"),
])
def test_fsdp_refuses_megatron_settings(changes, named):
    with pytest.raises(SpecError, match=f"^{named}: Megatron's"):
        Question(model="qwen3-0.6b", gpus=8, fsdp=True, **changes)
    Question(model="qwen3-0.6b", gpus=8, **changes)  # the ZeRO-1 search takes them


def test_fsdp_refuses_the_ep_overlap_and_fsdp_impl_needs_fsdp():
    with pytest.raises(SpecError, match="^--overlap-moe-expert-parallel-comm: Megatron's"):
        Question(model="qwen3-30b-a3b", gpus=8, optimizer="adamw", fsdp=True, overlap_moe_expert_parallel_comm=True)
    with pytest.raises(SpecError, match="needs --fsdp"):
        Question(model="qwen3-0.6b", gpus=8, fsdp_impl="megatron-fsdp")
    with pytest.raises(SpecError, match="fsdp impl|fsdp-impl|one of"):
        Question(model="qwen3-0.6b", gpus=8, fsdp=True, fsdp_impl="nope")
    Question(model="qwen3-0.6b", gpus=8, fsdp=True, fsdp_impl="megatron-fsdp")


def _gpu_of(tmp_path, memory_bytes: float) -> str:
    """The H100 profile with another memory size (a path `Question.hardware` takes)."""
    profile = json.loads((Path(canzona.__file__).resolve().parent / "profiles" / "h100-sxm.json").read_text())
    profile["gpu"]["memory_bytes"] = int(memory_bytes)
    path = tmp_path / f"h100-{int(memory_bytes)}.json"
    path.write_text(json.dumps(profile))
    return str(path)


# the GPU memory at which qwen3-30b-a3b's FSDP layouts need recompute and selective-layer at K = 3, not 4,
# is the largest that fits (90 GB until 2026-11-30, when the loss's peak under PyTorch's F.cross_entropy,
# canzona.memory.loss_logit_bytes, took 7.5 GB more and K = 2 became the largest that fits there; 94 GB
# until the fixed allowance went from 1.95 to 0.75 GB the same day, when K = 4 fitted there)
ROUNDS_GPU_BYTES = 92.8e9


def test_the_rounds_take_the_least_compute_that_fits(tmp_path):
    """qwen3-30b-a3b under --fsdp --ep on 92.8 GB GPUs: no layout fits without recompute, and where
    both fit, selective-layer (every other layer re-run whole) computes less than selective-op,
    which re-runs every layer's experts whole (their grouped GEMMs are not `aten.mm`). The
    rounds simulate each layout with its least time floor among the settings whose memory floor
    fits, so the search's best is selective-layer's, the fastest of every setting of its layout
    (the static order, selective-op before selective-layer, found selective-op's, 0.5% slower;
    that it is the best of every layout too is the slow brute force below); of the K searched
    (2, 3, 4) the largest whose run fits, 3 (every third layer re-run: less than K = 2's)."""
    q = replace(MOE, hardware=_gpu_of(tmp_path, ROUNDS_GPU_BYTES))
    found = search(q, top=1, refine_top=0, workers=1)
    best = found.ranked[0]
    assert (best["recompute"], best["selective_ac_option"]) == ("selective-layer", 3)
    two = simulate(config_of(q, {**layout_of(best), "selective_ac_option": 2}))
    assert two.fits and two.iteration_time_s > best["iteration_time_s"]  # K = 2 fits too, and re-runs more
    assert best["iteration_time_s"] == _fastest_setting_that_fits(q, layout_of(best))
    model = resolve_model(q.model)
    hw = load_profile(q.hardware)
    rate = DeviceRate.from_profile(hw)
    layout = layout_of(best)
    op = config_of(q, {**layout, "recompute": "selective-op"})
    assert memory_floor(op, model) <= hw.gpu.memory_bytes  # selective-op fits too: compute chose
    assert time_floor(config_of(q, layout), model, rate, hw) < time_floor(op, model, rate, hw)
    assert simulate(op).iteration_time_s > best["iteration_time_s"]


@pytest.mark.slow  # a minute of CPU: every MoE layout under every setting, simulated
def test_the_rounds_best_is_the_brute_force_best_on_92_8_gb(tmp_path):
    """The same question as above: no layout under any setting beats the rounds' best."""
    q = replace(MOE, hardware=_gpu_of(tmp_path, ROUNDS_GPU_BYTES))
    assert search(q, top=1, refine_top=0, workers=1).ranked[0]["iteration_time_s"] == _brute_force(q)


def test_selective_ac_option_is_searched_and_said(tmp_path):
    """The question's --selective-ac-option K is searched beside torchtitan's default 2 and the
    next two (`SEARCHED_SELECTIVE_AC`); a row, its layout, its description and its launcher
    settings (torchtitan's activation_checkpoint config) say which K it ran."""
    q = replace(MOE, hardware=_gpu_of(tmp_path, ROUNDS_GPU_BYTES), selective_ac_option=5)
    assert selective_ac_options(q) == (2, 3, 4, 5) and selective_ac_options(MOE) == (2, 3, 4)
    assert selective_ac_options(replace(MOE, selective_ac_option=3)) == (2, 3, 4)
    assert [s for s in FSDP_SPACE.recompute_variants(q) if s["recompute"] == "selective-layer"] == \
        [{"recompute": "selective-layer", "selective_ac_option": k} for k in (2, 3, 4, 5)]
    found = search(q, top=3, refine_top=0, workers=1)
    rows = found.ranked + found.not_fitting
    ks = {r["selective_ac_option"] for r in rows if r["recompute"] == "selective-layer"}
    assert ks and ks <= set(selective_ac_options(q))
    for row in rows:
        k = row["selective_ac_option"]
        assert (k is not None) == (row["recompute"] == "selective-layer")
        if k is None:
            continue
        assert layout_of(row)["selective_ac_option"] == k
        assert config_of(q, layout_of(row)).options.selective_ac_option == k
        assert f"recompute selective-layer (every {k})" in describe(row)
        assert any(f"activation_checkpoint.mode = 'selective', activation_checkpoint.selective_ac_option = '{k}'" in x
                   for x in not_in_plan(row))
    listed = found.to_dict()["layouts"]
    assert all("selective_ac_option" in r for r in listed)
    assert found.to_dict()["selective_ac_option"] == 5
    op = {**layout_of(found.ranked[0]), "recompute": "selective-op"}
    op.pop("selective_ac_option", None)
    assert any("selective_ac_option = 'op'" in x for x in not_in_plan({**found.ranked[0], **op}))


@pytest.mark.parametrize("changes, needle", [
    ({"selective_ac_option": 0, "fsdp": True}, "whole number >= 1"),
    ({"selective_ac_option": True, "fsdp": True}, "whole number >= 1"),
    ({"selective_ac_option": 2}, "searched under --fsdp"),
])
def test_a_bad_selective_ac_option_is_one_line(changes, needle):
    with pytest.raises(SpecError, match=needle):
        Question(model="qwen3-0.6b", gpus=8, **changes)


def test_a_megatron_fsdp_search_tries_no_selective_layer():
    """Megatron-FSDP runs no torchtitan selective-layer (`sim.fsdp.fsdp_recompute_modes`): its
    search's recompute settings leave it out; FSDP2's keep it."""
    from canzona.recompute import SELECTIVE_LAYER
    from sim.search import FSDP_SPACE

    base = Question(model="qwen3-0.6b", gpus=8, seq_len=4096, global_batch=8, optimizer="adamw", fsdp=True)
    fsdp2 = [v["recompute"] for v in FSDP_SPACE.recompute_variants(base)]
    megatron = [v["recompute"] for v in FSDP_SPACE.recompute_variants(replace(base, fsdp_impl="megatron-fsdp"))]
    assert SELECTIVE_LAYER in fsdp2
    assert SELECTIVE_LAYER not in megatron and set(megatron) == set(fsdp2) - {SELECTIVE_LAYER}


def test_a_megatron_fsdp_search_refuses_selective_ac_option():
    """Megatron-FSDP's search tries no selective-layer (`sim.fsdp.fsdp_recompute_modes`), so a K
    given to it was accepted, never searched and echoed back in the question (red team): one line."""
    with pytest.raises(SpecError, match="^--selective-ac-option 3: .*megatron-fsdp"):
        Question(model="qwen3-0.6b", gpus=8, fsdp=True, fsdp_impl="megatron-fsdp", selective_ac_option=3)
    Question(model="qwen3-0.6b", gpus=8, fsdp=True, selective_ac_option=3)  # FSDP2 searches it


def test_megatron_fsdp_layouts_are_resharded_and_launched_in_its_terms():
    """Megatron-FSDP takes no reshard_after_forward (it releases each unit after its forward): the
    simulator refuses the pair with one line, its space has resharded layouts only, and the
    launcher settings of its rows name Megatron-LM's flags, not FSDP2's fully_shard calls."""
    q = replace(EIGHT_LAYERS, gpus=16, global_batch=16, fsdp_impl="megatron-fsdp")
    assert {c["reshard_after_forward"] for c in candidates(q)} == {True}
    assert {c["reshard_after_forward"] for c in candidates(replace(q, fsdp_impl="fsdp2"))} == {True, False}
    layout = next(c for c in candidates(q) if c["tp"] == 2 and c["hsdp_replicate"] == 1)
    with pytest.raises(SpecError, match="--fsdp-impl megatron-fsdp has none"):
        replace(config_of(q, layout), reshard_after_forward=False).check()
    row = {**layout, "fsdp": True, "fsdp_impl": "megatron-fsdp", "policy": "fsdp-owners", "refined": False,
           "fell_back_to": None}
    launch = " ".join(not_in_plan(row))
    assert "--use-megatron-fsdp" in launch and "--tensor-model-parallel-size" in launch
    assert "fully_shard" not in launch and "parallelize_module" not in launch
    fsdp2 = " ".join(not_in_plan({**row, "fsdp_impl": "fsdp2"}))
    assert "fully_shard each decoder layer" in fsdp2 and "--use-megatron-fsdp" not in fsdp2


def test_a_pipeline_wins_where_the_gathers_dominate():
    """qwen3-1.7b at 16 GPUs, 4096 sequences of 64 tokens: at PP 1 each DP rank runs 32 micro-batches
    of 8, FSDP2 gathering every unit for each (and reducing each one's gradients); under torch's
    pipelining a stage gathers its units once and reduce-scatters once, so PP 2 (about 0.99 s) beats
    every PP 1 layout (HSDP 8's about 1.18 s, the best before PP was searched). Its row says PP and
    its launcher torchtitan's stages."""
    q = Question(model="qwen3-1.7b", gpus=16, global_batch=4096, seq_len=64, fsdp=True)
    found = search(q, top=3, refine_top=0, workers=1)
    best = found.ranked[0]
    assert (best["pp"], best["tp"], best["dp"]) == (2, 1, 8)
    assert " PP2 " in describe(best) and any(x.startswith("pp 2 (torchtitan's PP") for x in not_in_plan(best))
    pp1 = [r for r in found.ranked if r["pp"] == 1]
    assert pp1 and min(r["iteration_time_s"] for r in pp1) > 1.15 * best["iteration_time_s"]


@pytest.mark.parametrize("reshard, torch_text, titan", [
    (True, "reshard_after_forward=True", '"always"'), (False, "reshard_after_forward=False", '"never"')])
def test_a_pipeline_rows_reshard_setting_is_said_for_torchtitan_too(reshard, torch_text, titan):
    """Under PP torchtitan's default (`fsdp_reshard_after_forward = "default"`) is `not pp_enabled`,
    not FSDP2's True: a PP row says its setting either way, as fully_shard's option and as
    torchtitan's; a PP 1 row where FSDP2's and torchtitan's default agree says only the change."""
    row = dict(fsdp=True, fsdp_impl="fsdp2", dp=8, hsdp_replicate=1, tp=1, pp=2, ep=1, micro_batch=1,
               recompute="none", reshard_after_forward=reshard, policy="canzona")
    said = [x for x in not_in_plan(row) if "reshard_after_forward" in x]
    assert len(said) == 1 and torch_text in said[0]
    assert f"parallelism.fsdp_reshard_after_forward = {titan}" in said[0]
    flat = [x for x in not_in_plan({**row, "pp": 1}) if "reshard_after_forward" in x]
    assert flat == ([] if reshard else ["reshard_after_forward=False"])
