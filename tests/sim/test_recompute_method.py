"""Megatron's partial full recompute, `--recompute-method uniform|block` with `--recompute-num-layers`
(canzona.recompute, canzona.memory, sim.model_work, sim.simulate, sim.search): block checkpoints the
first N layers of each model chunk and stores the rest whole; uniform checkpoints groups of N
layers, storing one input a group and re-running the group's forwards together."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canzona.cost import DeviceRate
from canzona.errors import SpecError
from canzona.hardware import load_profile
from canzona.memory import (
    LayerDims,
    MemorySetup,
    activation_breakdown,
    activation_bytes,
    layer_activation_bytes,
)
from canzona.models import resolve_model
from canzona.pipeline import chunk_layers
from canzona.recompute import (
    BLOCK,
    FULL,
    UNIFORM,
    check_method_layers,
    check_recompute_method,
    checkpoint_groups,
    checkpointed_layers,
    recompute_label,
)
from sim.model_work import micro_batch_work
from sim.search import Question, config_of, memory_floor, time_floor
from sim.simulate import SimConfig, simulate
from sim.workload import Workload

H100 = load_profile("h100-sxm")
H100_PATH = Path(__file__).resolve().parents[2] / "canzona" / "profiles" / "h100-sxm.json"
RATE = DeviceRate.from_profile(H100)
WL = Workload(seq_len=1024, global_batch=8, micro_batch=1)
# 28 layers: PP 2 x VP 2 chunks of 7
BASE = SimConfig(model="qwen3-1.7b", gpus=8, tp=2, pp=2, optimizer="adamw", workload=WL)
DIMS = LayerDims(layers=32, hidden=4096, q_heads=32, ffn=12288, vocab=151936, kv_heads=8, head_dim=128,
                 gated_mlp=True, dropout=False, qk_norm=True)


def _with(cfg: SimConfig, **options) -> SimConfig:
    return replace(cfg, options=replace(cfg.options, **options))


def _full(method=None, n=None, **kw) -> MemorySetup:
    return MemorySetup(seq_len=4096, recompute=FULL, recompute_method=method, recompute_num_layers=n, **kw)


# --- the rules -----------------------------------------------------------------------------------


def test_groups_and_checkpoints_per_chunk():
    assert checkpoint_groups(None, None, 7) == (7, 1)
    assert checkpoint_groups(UNIFORM, 1, 8) == (8, 1)
    assert checkpoint_groups(UNIFORM, 4, 8) == (2, 4)
    assert checkpoint_groups(BLOCK, 3, 8) == (3, 1)
    assert checkpoint_groups(BLOCK, 9, 8) == (8, 1)
    assert checkpoint_groups(BLOCK, 2, 0) == (0, 0)  # a chunk without decoder layers (embedding counted)
    # block: the first N of each chunk, counted per chunk (each chunk is its own TransformerBlock)
    assert checkpointed_layers(BLOCK, 2, [range(0, 4), range(8, 12)]) == {0, 1, 8, 9}
    assert checkpointed_layers(UNIFORM, 2, [range(0, 4)]) == {0, 1, 2, 3}
    assert recompute_label(FULL, BLOCK, 2) == "full (block 2)" and recompute_label(FULL) == "full"


@pytest.mark.parametrize("mode,method,n,needle", [
    (FULL, "layers", 2, "unknown recompute method 'layers'"),
    (FULL, BLOCK, None, "go together"),
    (FULL, None, 2, "go together"),
    (FULL, BLOCK, 0, "whole number >= 1"),
    (FULL, UNIFORM, True, "whole number >= 1"),
    ("selective", BLOCK, 2, "is for --recompute full"),
    ("none", UNIFORM, 1, "is for --recompute full"),
])
def test_option_errors_are_one_line(mode, method, n, needle):
    with pytest.raises(SpecError) as e:
        check_recompute_method(mode, method, n)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_uniform_groups_must_divide_every_chunk():
    check_method_layers(UNIFORM, 7, [7, 7, 0])
    check_method_layers(BLOCK, 5, [7, 7])  # block takes any N: past a chunk's layers, all of them
    with pytest.raises(SpecError, match="a model chunk of 7 layers does not split into groups of 2"):
        check_method_layers(UNIFORM, 2, [7, 7])
    # the simulator checks it against the layout's chunks (PP 2 x VP 2: 7 layers each)
    with pytest.raises(SpecError, match="groups of 14"):
        _with(replace(BASE, vp=2), recompute=FULL, recompute_method=UNIFORM, recompute_num_layers=14).check()
    _with(BASE, recompute=FULL, recompute_method=UNIFORM, recompute_num_layers=14).check()  # 14 a stage at VP 1
    with pytest.raises(SpecError, match="--fsdp"):
        _with(replace(BASE, pp=1, fsdp=True, policy="zero1"), recompute=FULL, recompute_method=BLOCK,
              recompute_num_layers=2).check()


# --- memory ----------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 2, 4]), st.sampled_from([(1, 1), (2, 1), (4, 1), (4, 2), (2, 4)]),
       st.integers(0, 3), st.sampled_from([None, 4, 16]))
def test_block_memory_lies_between_none_and_full_and_falls_with_n(tp, pp_vp, stage, micro_batches):
    """Each checkpointed layer stores its input where it stored everything: the activations fall
    as N grows, from above full (N = 1 keeps all but one layer whole) down to full's at N = a
    chunk's layers (every layer alone); they never exceed no recompute's plus one re-run. At
    N = layers - 1 the last layer, stored whole, is freed before the first re-run: with one
    micro-batch in flight that is full's peak (its last layer's re-run holds its input once)."""
    pp, vp = pp_vp
    stage = stage % pp
    chunk = len(chunk_layers(DIMS.layers, pp, stage, 0, vp))
    full = activation_bytes(DIMS, _full(micro_batches=micro_batches), tp, pp, stage, vp)
    none = activation_bytes(DIMS, replace(_full(micro_batches=micro_batches), recompute="none"), tp, pp, stage, vp)
    by_n = [activation_bytes(DIMS, _full(BLOCK, n, micro_batches=micro_batches), tp, pp, stage, vp)
            for n in range(1, chunk + 2)]
    assert all(a > b for a, b in zip(by_n, by_n[1:chunk - 1]))  # strictly fewer bytes with each layer more
    assert chunk < 2 or by_n[chunk - 2] >= by_n[chunk - 1]
    assert by_n[chunk - 1] == by_n[chunk] == pytest.approx(full, rel=1e-12)
    one_layer = layer_activation_bytes(DIMS, _full(), tp, "none")
    assert full <= min(by_n) and max(by_n) <= none + one_layer


def test_uniform_stores_one_input_a_group_and_holds_a_group_at_its_rerun():
    setup, tp = _full(UNIFORM, 4), 2
    stored = layer_activation_bytes(DIMS, setup, tp)  # a layer's input (full recompute's)
    whole = layer_activation_bytes(DIMS, setup, tp, "none")
    parts = activation_breakdown(DIMS, setup, tp)  # one stage of 32 layers, one micro-batch in flight
    assert parts["layers"] == pytest.approx(32 / 4 * stored)
    assert parts["recompute_working_set"] == pytest.approx(4 * whole - stored)  # the group's input held once
    # N = 1 is every layer alone: today's full recompute
    assert activation_bytes(DIMS, _full(UNIFORM, 1), tp, 4, 0, 2) == pytest.approx(
        activation_bytes(DIMS, _full(), tp, 4, 0, 2), rel=1e-12)


def test_method_reaches_the_simulated_memory_and_the_search_floor():
    spec_arch = resolve_model(BASE.model, BASE.tp)
    runs = {name: _with(BASE, recompute=FULL, **kw) for name, kw in (
        ("full", {}), ("block1", dict(recompute_method=BLOCK, recompute_num_layers=1)),
        ("block7", dict(recompute_method=BLOCK, recompute_num_layers=7)))}
    floors = {k: memory_floor(cfg, spec_arch) for k, cfg in runs.items()}
    assert floors["full"] < floors["block7"] < floors["block1"]
    acts = {k: simulate(cfg).memory.worst.activations for k, cfg in runs.items()}
    assert acts["full"] < acts["block7"] < acts["block1"]


# --- time ------------------------------------------------------------------------------------------


def _work(recompute: str, checkpointed=None, tp: int = 2):
    spec, arch = resolve_model("qwen3-1.7b", tp)
    return micro_batch_work(spec, tp, WL.tokens_per_micro_batch, WL.seq_len, arch.q_dim, arch.hidden, arch.vocab,
                            RATE, recompute=recompute, checkpointed=checkpointed, kv_dim=arch.kv_dim)


@pytest.mark.parametrize("tp", [1, 2])
def test_checkpointed_layers_rerun_their_forward_the_others_run_as_without_recompute(tp):
    none, full = _work("none", tp=tp), _work(FULL, tp=tp)
    assert _work(FULL, frozenset(none.layer_ids), tp) == full
    nothing = _work(FULL, frozenset(), tp)
    assert nothing.forward == none.forward and nothing.backward == none.backward
    some = _work(FULL, frozenset({0, 1}), tp)
    for k, layer in enumerate(some.layer_ids):
        assert some.backward[k] == (full if layer < 2 else none).backward[k]
        assert some.no_grad(k, FULL) == (layer < 2)  # outside a checkpoint the forward keeps its grad


def test_block_n_all_and_uniform_one_are_todays_full_recompute():
    full = simulate(_with(BASE, recompute=FULL))
    for method, n in ((BLOCK, 14), (BLOCK, 100), (UNIFORM, 1)):
        r = simulate(_with(BASE, recompute=FULL, recompute_method=method, recompute_num_layers=n))
        assert r.iteration_time_s == full.iteration_time_s
        assert r.memory.worst.total == full.memory.worst.total
    none = simulate(BASE)
    block = simulate(_with(BASE, recompute=FULL, recompute_method=BLOCK, recompute_num_layers=3))
    assert none.iteration_time_s < block.iteration_time_s < full.iteration_time_s


def test_search_floor_stays_below_the_simulated_time():
    cfg = _with(replace(BASE, vp=2), recompute=FULL, recompute_method=BLOCK, recompute_num_layers=3)
    model = resolve_model(cfg.model, cfg.tp)
    assert time_floor(cfg, model, RATE, H100) <= simulate(cfg).iteration_time_s


def test_search_runs_the_method_under_full_recompute_only():
    q = Question(model="qwen3-1.7b", gpus=8, recompute_method=BLOCK, recompute_num_layers=2)
    layout = dict(tp=2, pp=2, vp=1, cp=1, ep=1, micro_batch=1, recompute=FULL, dp=2)
    assert config_of(q, layout).options.recompute_method == BLOCK
    assert config_of(q, {**layout, "recompute": "selective"}).options.recompute_method is None
    with pytest.raises(SpecError, match="go together"):
        Question(recompute_method=BLOCK)


def test_search_tries_block_before_every_layer(tmp_path):
    """On a GPU too small for qwen3-0.6b at TP 1 without full recompute (12.5 GB), the search tries
    Megatron's block method before every layer: the fewest checkpointed layers its floor (and,
    after a run that did not fit, that run's bytes beyond its floor) admits; block's layout beats
    both plain full's and the best layout found without block."""
    import json

    from sim.search import search

    profile = json.loads(Path(H100_PATH).read_text())
    profile["gpu"]["memory_bytes"] = 12_500_000_000
    path = tmp_path / "h100-12.5gb.json"
    path.write_text(json.dumps(profile))
    q = Question(model="qwen3-0.6b", gpus=8, seq_len=4096, global_batch=8, hardware=str(path))
    on, off = (search(replace(q, search_recompute_layers=flag), top=3, workers=2) for flag in (True, False))
    best = on.ranked[0]
    assert (best["recompute"], best["recompute_method"]) == (FULL, BLOCK) and best["fits"]
    assert 1 <= best["recompute_num_layers"] < 28
    assert not any(r["recompute_method"] for r in off.ranked + off.not_fitting)
    assert best["iteration_time_s"] < off.ranked[0]["iteration_time_s"]
    plain = simulate(config_of(q, {k: best[k] for k in ("tp", "pp", "vp", "cp", "ep", "micro_batch", "recompute",
                                                        "dp")}))
    assert plain.config.options.recompute_method is None
    assert best["iteration_time_s"] < plain.iteration_time_s


def test_a_uniform_group_no_chunk_takes_is_a_refusal_not_memory(tmp_path):
    """A layout whose chunks `--recompute-method uniform` does not divide is not tried with full
    recompute: the search counts it refused by that rule, with its reason, not as over the memory
    "even with full recompute" (which it never tried). qwen3-0.6b's 28 layers: no chunk takes 5."""
    import json

    from sim.search import search

    profile = json.loads(Path(H100_PATH).read_text())
    profile["gpu"]["memory_bytes"] = 3_000_000_000  # nothing fits without full recompute
    path = tmp_path / "h100-3gb.json"
    path.write_text(json.dumps(profile))
    q = Question(model="qwen3-0.6b", gpus=8, seq_len=4096, global_batch=8, hardware=str(path),
                 recompute_method=UNIFORM, recompute_num_layers=5)
    with pytest.raises(SpecError) as e:
        search(q, top=1, workers=1)
    assert "--recompute-method uniform" in str(e.value)
    assert "0 over 3.0 GB per GPU even with full recompute" in str(e.value)
