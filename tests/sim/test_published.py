"""The published-runs table (canzona/data/published_runs.json) and its comparison (sim.published):
the data file is well-formed, the comparison's figures follow from their definitions, rows the
simulator cannot express are reported with what they need. No test bounds the error itself."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from canzona.errors import SpecError
from canzona.models import resolve_model
from sim import published
from sim.published import PublishedReport, RowResult, kendall_tau

RUNS, SOURCES = published.load()
RAW = json.loads(published.PUBLISHED_RUNS.read_text())


def test_every_row_is_sourced_positive_and_divisible():
    assert 15 <= len(RUNS) <= 60
    assert len({r.model_name for r in RUNS}) >= 3
    for run in RUNS:
        src = SOURCES[run.source]
        assert src["url"].startswith("https://") and src["title"] and src["retrieved"]
        assert run.tokens_per_s_per_gpu > 0 and run.original_value > 0 and run.original_unit
        assert run.gpus % (run.tp * run.pp * run.cp) == 0
        assert run.dp == run.gpus // (run.tp * run.pp * run.cp)
        assert run.global_batch % (run.micro_batch * run.dp) == 0
        assert run.precision in ("bf16", "fp8") and run.optimizer == "adamw"


def test_cluster_totals_are_converted_per_gpu():
    """A source's whole-cluster figure is divided by the GPU count, a step time (the EP-overlap
    A/B's) turned into tokens by the metric's own definition, and the conversion says so."""
    for run in RUNS:
        if "whole cluster" in run.original_unit:
            assert run.tokens_per_s_per_gpu == pytest.approx(run.original_value / run.gpus, abs=0.01)
            assert str(run.gpus) in run.conversion
        elif run.original_unit.startswith("s a step"):
            assert run.original_value == run.step_time_s
            tokens = run.seq_len * run.global_batch / run.step_time_s / run.gpus
            assert run.tokens_per_s_per_gpu == pytest.approx(tokens, abs=1e-3)
            assert all(str(x) in run.conversion for x in (run.seq_len, run.global_batch, run.step_time_s, run.gpus))
        else:
            assert run.tokens_per_s_per_gpu == run.original_value


def test_torchtitan_rows_are_the_pinned_pages():
    """torchtitan's eight A100 rows (Llama 3 8B / 70B, Llama 2 13B / 70B, each activation
    checkpointing the page reports that did not run out of memory) come from one pinned version of
    its performance page: FSDP2 over 64 GPUs, the local batch as global / 64, Llama 3 at 8192
    tokens and Llama 2 at its 4096, eager kernels, fp32 gradient reduction; the selective layer rows
    say their frequency is an assumption."""
    titan = [r for r in RUNS if r.source == "torchtitan-a100"]
    assert "041336434916bdc0f88c1f89fda176fd3c2092e4" in SOURCES["torchtitan-a100"]["url"]
    assert sorted((r.model_name, r.micro_batch, r.recompute, r.tokens_per_s_per_gpu) for r in titan) == [
        ("llama2-13b", 2, "none", 2162), ("llama2-13b", 2, "selective-layer", 1914),
        ("llama2-13b", 2, "selective-op", 1904), ("llama2-70b", 1, "selective-op", 355),
        ("llama2-70b", 2, "full", 353), ("llama3-70b", 1, "full", 331),
        ("llama3-8b", 1, "selective-layer", 2904), ("llama3-8b", 1, "selective-op", 2973)]
    for r in titan:
        assert r.fsdp and r.gpus == 64 and r.tp == r.pp == r.cp == 1 and r.hardware == "a100-sxm"
        assert r.global_batch == 64 * r.micro_batch and r.kernels == "eager" and r.grad_reduce_in_fp32
        assert r.seq_len == (8192 if r.model_name.startswith("llama3") else 4096)
        assert ("**assumption**" in r.note) == (r.recompute == "selective-layer")
        assert not r.needs() and r.sim_config().options.selective_ac_option is None  # torchtitan's default, 2


def test_every_model_resolves():
    for name in {r.model_ref for r in RUNS}:
        spec, arch = resolve_model(name)
        assert arch.layers > 0 and spec.params


@pytest.mark.parametrize("model, params", [("llama2-7b", 6_738_415_616), ("llama2-13b", 13_015_864_320),
                                           ("llama2-70b", 68_976_648_192)])
def test_llama2_configs_have_the_published_parameter_counts(model, params):
    """The Llama 2 configs (NeMo 24.07's LLAMA2 rows) reproduce the parameter counts of Meta's
    checkpoints (the Hugging Face model cards' safetensors totals): a wrong width, FFN, KV-head
    count or vocabulary would move them."""
    spec, arch = resolve_model(str(published.DATA_DIR / "models" / f"{model}.json"))
    assert spec.numel == params


def test_fp8_rows_are_expressible_with_their_recipe():
    """An FP8 row is simulated in FP8 (`--precision fp8`, its scaling recipe) where nothing else
    stands in the way; CP and VP are simulated too, so no row needs them."""
    fp8 = [r for r in RUNS if r.precision == "fp8"]
    assert fp8
    for run in RUNS:
        needs = run.needs()
        assert not any(n in ("--cp", "--vp") or n.startswith("--precision") for n in needs)
        wl = run.sim_config().workload
        assert wl.precision == run.precision and wl.fp8_recipe == run.fp8_recipe
    assert {r.fp8_recipe for r in fp8} == {"delayed", "current"}
    row = next(r for r in fp8 if r.id == "llama3-8b-8xh100-nemo24.07-fp8")
    result = published.compare_run(row)
    assert result.expressible and result.error is not None and result.simulated_tokens_per_s_per_gpu > 0
    bf16 = published.compare_run(replace(row, precision="bf16"))
    assert bf16.iteration_s > result.iteration_s  # the row is simulated in FP8, not folded onto bf16


def test_nemo_24_07_rows_ran_flash_attention():
    """NeMo 24.07's launcher ran Transformer Engine's FlashAttention backend (NVTE_FUSED_ATTN=0,
    the rows' recipe_source): those rows, and only they, are simulated with --attention-backend
    flash, which is slower than the fused default on the same row."""
    for run in RUNS:
        if "nemo24.07" in run.id:
            assert run.attention_backend == "flash" and "NVTE_FUSED_ATTN: 0" in run.recipe_source
            assert run.sim_config().options.attention_backend == "flash"
        else:
            assert run.attention_backend is None and run.sim_config().options.attention_backend == "fused"
    row = next(r for r in RUNS if r.id == "llama2-7b-8xh100-nemo24.07-fp8")
    flash = published.compare_run(row)
    fused = published.compare_run(replace(row, attention_backend=None))
    assert flash.iteration_s > fused.iteration_s and flash.memory_bytes == fused.memory_bytes


def test_bad_rows_are_one_line_errors():
    raw = RAW["rows"][0]
    with pytest.raises(SpecError, match="not a whole number of micro batch"):
        published.parse_run({**raw, "global_batch": 1000}, SOURCES, "row")
    with pytest.raises(SpecError, match="positive number"):
        published.parse_run({**raw, "published": {**raw["published"], "tokens_per_s_per_gpu": 0}}, SOURCES, "row")
    with pytest.raises(SpecError, match="not one of the file's sources"):
        published.parse_run({**raw, "source": "nowhere"}, SOURCES, "row")
    with pytest.raises(SpecError, match="TP x PP x CP"):
        published.parse_run({**raw, "gpus": 12, "tp": 8}, SOURCES, "row")
    with pytest.raises(SpecError, match="fp8_recipe must be one of"):
        published.parse_run({**raw, "precision": "fp8", "fp8_recipe": "mxfp8"}, SOURCES, "row")
    with pytest.raises(SpecError, match="on an fp8 row"):
        published.parse_run({**raw, "precision": "bf16", "fp8_recipe": "current"}, SOURCES, "row")
    with pytest.raises(SpecError, match="attention_backend must be one of fused, flash"):
        published.parse_run({**raw, "attention_backend": "sdpa", "recipe_source": "https://x"}, SOURCES, "row")
    with pytest.raises(SpecError, match="needs recipe_source"):
        published.parse_run({**raw, "attention_backend": "flash", "recipe_source": ""}, SOURCES, "row")


def test_a_rows_unknown_key_is_one_line():
    """A misspelt key (fp8_param for fp8_params, recompute_layers for recompute_num_layers) was read
    as not stated and the row simulated without it, with no word: one line naming it, as a spec
    file's unknown field is."""
    raw = RAW["rows"][0]
    for key in ("fp8_param", "recompute_layers", "tp_comm_overlap_config"):
        with pytest.raises(SpecError, match=f"row: unknown key {key!r}"):
            published.parse_run({**raw, key: True}, SOURCES, "row")
    assert published.parse_run(dict(raw), SOURCES, "row").id == raw["id"]  # every key the file uses is known


def test_a_row_refused_when_simulated_names_the_row():
    """A row whose model or hardware profile the simulator refuses (read when the row is simulated,
    not when the file is loaded) failed with the simulator's words alone: which of the rows was it."""
    runs, sources = published.load()
    bad = replace(published.select(runs, "qwen3-8b-16xh100-mb")[0], hardware="h100-pcie")
    with pytest.raises(SpecError, match="^row qwen3-8b-16xh100-mb: unknown hardware 'h100-pcie'"):
        published.compare([bad], sources, workers=1)


def test_select():
    assert {r.model_name for r in published.select(RUNS, "qwen3-8b")} == {"qwen3-8b"}
    assert published.select(RUNS, None) == RUNS
    with pytest.raises(SpecError, match="no published row matches"):
        published.select(RUNS, "no-such-model")
    # a mistyped term beside good ones would drop its rows from the table without a word
    with pytest.raises(SpecError, match="no published row matches --rows term 'no-such-model' \\(the others match"):
        published.select(RUNS, "qwen3-8b,no-such-model")


def test_report_figures_follow_their_definitions():
    base = next(r for r in RUNS if not r.needs())
    a = RowResult(replace(base, id="a", tokens_per_s_per_gpu=100.0), (), 110.0, 1.0, 1.0, 2.0)
    b = RowResult(replace(base, id="b", tokens_per_s_per_gpu=200.0), (), 180.0, 1.0, 3.0, 2.0)
    c = RowResult(replace(base, id="c", model="other"), ("--cp",))
    rep = PublishedReport((a, b, c))
    assert a.error == pytest.approx(0.1) and b.error == pytest.approx(-0.1)
    assert rep.mean_abs_error == pytest.approx(0.1) and rep.mean_signed_error == pytest.approx(0.0)
    assert rep.tau_overall == 1.0 and rep.tau_by_model == {base.model_name: 1.0}
    assert a.fits and not b.fits and c.fits is None
    d = rep.to_dict()
    assert d["expressible"] == 2 and d["not_expressible"] == 1 and d["memory_fits"] == 1
    assert kendall_tau([1.0], [2.0]) is None and kendall_tau([1.0, 2.0], [2.0, 1.0]) == -1.0


def test_one_expressible_row_simulates():
    run = next(r for r in RUNS if r.id == "qwen3-30b-a3b-16xh100-mb")
    result = published.compare_run(run)
    assert result.expressible and result.simulated_tokens_per_s_per_gpu > 0 and result.error is not None
    assert result.memory_bytes > 0 and result.capacity_bytes == round(79.11 * 2**30)  # the H100's, as CUDA gives it


def test_a_rows_pipeline_split_is_read_checked_and_simulated():
    """A row's Megatron pipeline-split keys become its PipelineSplit (the simulator's option), need
    their recipe_source like every recipe setting, and bad values are one-line errors."""
    from canzona.pipeline import EVEN_SPLIT, PipelineSplit
    from sim.published_search import layout_of, outside_space, question_of

    raw = RAW["rows"][0]
    assert published.parse_run(raw, SOURCES, "row").pipeline_split == EVEN_SPLIT
    keys = {"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True,
            "decoder_last_pipeline_num_layers": 2}
    run = published.parse_run({**raw, **keys, "recipe_source": "https://recipe"}, SOURCES, "row")
    assert run.pipeline_split == PipelineSplit(account_for_embedding_in_pipeline_split=True,
                                               account_for_loss_in_pipeline_split=True,
                                               num_layers_in_last_pipeline_stage=2)
    assert run.sim_config().pipeline_split == run.pipeline_split
    assert outside_space(question_of(run), layout_of(run)).startswith(
        "pipeline split embedding and loss counted as layers, last stage 2 layers is not searched")
    with pytest.raises(SpecError, match="needs recipe_source"):
        published.parse_run({**raw, "account_for_loss_in_pipeline_split": True, "recipe_source": ""}, SOURCES, "row")
    with pytest.raises(SpecError, match="must be true or false"):
        published.parse_run({**raw, "account_for_loss_in_pipeline_split": 1, "recipe_source": "https://r"},
                            SOURCES, "row")
    with pytest.raises(SpecError, match="positive whole number of layers"):
        published.parse_run({**raw, "decoder_first_pipeline_num_layers": 0, "recipe_source": "https://r"},
                            SOURCES, "row")


def test_a_rows_recompute_method_is_read_and_checked():
    """A row's Megatron --recompute-method / --recompute-num-layers (under full recompute) are read,
    need their recipe_source like every recipe setting, reach the simulator's options, and are
    refused where Megatron refuses them (one without the other, under selective recompute) and
    on an FSDP row (its checkpoint wrappers take every layer)."""
    raw = {**RAW["rows"][0], "recompute": "full", "recipe_source": "https://recipe"}
    run = published.parse_run({**raw, "recompute_method": "block", "recompute_num_layers": 1}, SOURCES, "row")
    assert (run.recompute_method, run.recompute_num_layers) == ("block", 1)
    options = run.sim_config().options
    assert (options.recompute, options.recompute_method, options.recompute_num_layers) == ("full", "block", 1)
    assert "recompute full (block 1)" in run.layout
    assert published.parse_run(raw, SOURCES, "row").recompute_method is None  # absent: every layer
    with pytest.raises(SpecError, match="needs recipe_source"):
        published.parse_run({**raw, "recompute_method": "block", "recompute_num_layers": 1, "recipe_source": ""},
                            SOURCES, "row")
    with pytest.raises(SpecError, match="go together"):
        published.parse_run({**raw, "recompute_method": "block"}, SOURCES, "row")
    with pytest.raises(SpecError, match="is for --recompute full"):
        published.parse_run({**raw, "recompute": "selective", "recompute_method": "uniform",
                             "recompute_num_layers": 1}, SOURCES, "row")
    fsdp = next(r for r in RAW["rows"] if r.get("fsdp") and r.get("recompute") == "full")
    with pytest.raises(SpecError, match="recompute_method is Megatron's"):
        published.parse_run({**fsdp, "recompute_method": "block", "recompute_num_layers": 1}, SOURCES, "row")


def test_a_sources_layout_not_tuned_is_its_words_or_absent(tmp_path):
    """null, false or an empty string would read as a sanity-check source (a non-empty str()) and
    drop its rows from the search's aim without a word: refused, one line."""
    for bad in (None, False, "", "  "):
        data = json.loads(published.PUBLISHED_RUNS.read_text())
        first = next(iter(data["sources"]))
        data["sources"][first]["layout_not_tuned"] = bad
        path = tmp_path / "runs.json"
        path.write_text(json.dumps(data))
        with pytest.raises(SpecError, match="layout_not_tuned must be the source's words"):
            published.load(path)


def test_a_rows_split_is_in_its_report():
    from canzona.pipeline import PipelineSplit

    run = replace(RUNS[0], pipeline_split=PipelineSplit(account_for_loss_in_pipeline_split=True))
    assert published.RowResult(run).to_dict()["pipeline_split"]["account_for_loss_in_pipeline_split"] is True
    assert "pipeline_split" not in published.RowResult(RUNS[0]).to_dict()


def test_rows_simulated_in_parallel_are_the_rows_simulated_one_by_one():
    """`compare` with workers (each row in its own process) gives the report of one process, in the
    table's order, and reports progress once per row."""
    runs, sources = published.load()
    chosen = published.select(runs, "qwen3-8b-16xh100-mb,llama2-7b-8xh100")
    assert len(chosen) == 2
    seen: list[tuple[int, int]] = []
    parallel = published.compare(chosen, sources, progress=lambda done, total, _: seen.append((done, total)), workers=2)
    serial = published.compare(chosen, sources, workers=1)
    assert json.dumps(parallel.to_dict()) == json.dumps(serial.to_dict())
    assert [r.run.id for r in parallel.rows] == [r.id for r in chosen]
    assert sorted(seen) == [(1, 2), (2, 2)]


def test_a_row_refused_in_a_worker_is_the_same_error():
    """A row the simulator refuses raises its SpecError from the pool as from one process."""
    runs, sources = published.load()
    bad = replace(published.select(runs, "qwen3-8b-16xh100-mb")[0], tp=3)
    with pytest.raises(SpecError) as one:
        published.compare([bad], sources, workers=1)
    with pytest.raises(SpecError) as pool:
        published.compare([bad, *published.select(runs, "llama2-7b-8xh100")], sources, workers=2)
    assert str(pool.value) == str(one.value)


def test_a_rows_userbuffers_configuration_is_read_checked_and_simulated():
    """tp_comm_overlap_cfg: the recipe's pick, by name (sim.userbuffers); absent, the default; an
    unknown name, or one where it changes nothing (the overlap off, TP 1), is one line."""
    from sim.published_search import question_of
    from sim.userbuffers import DEFAULT_UB_CONFIG

    by_id = {r.id: r for r in RUNS}
    for rid in ("llama3.1-405b-1024xh100-mb25.11-fp8", "llama3.1-405b-1024xh100-mb26.02-fp8"):
        run = by_id[rid]
        assert run.tp_comm_overlap_cfg == "userbuffers_fp8_h100_h16384_tp8_cp2_mbs1_seqlen8192"
        assert run.sim_config().options.tp_comm_overlap_cfg == run.tp_comm_overlap_cfg
        assert question_of(run).tp_comm_overlap_cfg == run.tp_comm_overlap_cfg
        assert "comm_overlap.py" in run.recipe_source
    assert by_id["qwen3-8b-16xh100-mb"].sim_config().options.tp_comm_overlap_cfg == DEFAULT_UB_CONFIG
    raw = next(r for r in RAW["rows"] if r["id"] == "llama3-70b-64xh100-mb25.11-fp8")
    with pytest.raises(SpecError, match="row: unknown userbuffers config 'nope'; choose one of"):
        published.parse_run({**raw, "tp_comm_overlap_cfg": "nope"}, SOURCES, "row")
    with pytest.raises(SpecError, match="row: unknown userbuffers config"):
        published.parse_run({**raw, "tp_comm_overlap_cfg": ["x"]}, SOURCES, "row")
    with pytest.raises(SpecError, match="row: tp_comm_overlap_cfg: .*changes nothing with --no-tp-comm-overlap"):
        published.parse_run({**raw, "tp_comm_overlap": False}, SOURCES, "row")
    with pytest.raises(SpecError, match="row: tp_comm_overlap_cfg: .*changes nothing at --tp 1"):
        published.parse_run({**raw, "tp": 1, "gpus": 16}, SOURCES, "row")
    with pytest.raises(SpecError, match="needs recipe_source"):
        published.parse_run({**raw, "recipe_source": ""}, SOURCES, "row")


def test_the_dgx_cloud_405b_rows_run_the_launchers_model_at_its_batch():
    """DGX Cloud's Llama 3.1 405B recipe (NeMo 24.09) runs NeMo-Framework-Launcher's config, whose
    model has 16 query groups (Meta's has 8): those rows use that model file. Its batch is 252
    sequences per 576 GPUs (configure.sh), 63 micro-batches a DP rank at TP 8 x PP 9 x CP 2; the
    FP8 rows keep FP8 weights (fp8_params) and full masters, the bf16 ones the remainders."""
    rows = [r for r in RUNS if r.source == "dgxc-llama3.1-405b"]
    assert {r.precision for r in rows} == {"bf16", "fp8"} and len(rows) == 6
    _, arch = resolve_model(rows[0].model_ref)
    assert (arch.layers, arch.hidden, arch.kv_heads, arch.q_heads) == (126, 16384, 16, 128)
    for r in rows:
        assert (r.tp, r.pp, r.vp, r.cp, r.micro_batch) == (8, 9, 7, 2, 1)
        assert r.global_batch == 252 * r.gpus // 576 and r.global_batch // r.dp == 63
        assert r.tp_comm_overlap_cfg == "ub_cfg_h100_bf16_h16384_tp8_cp2_mbs1_seqlen8192"
        assert bool(r.fp8_params) == (r.precision == "fp8") != bool(r.store_param_remainders)
        assert r.tokens_per_s_per_gpu == pytest.approx(r.original_value / r.gpus, abs=0.01)
        assert r.step_time_s == pytest.approx(r.seq_len * r.global_batch / r.original_value, rel=2e-3)
