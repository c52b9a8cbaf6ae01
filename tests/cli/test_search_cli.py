"""`canzona search`: the table, --json, the plan command of the best layout, bad input."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from tests.cli_helpers import error_line, invoke
from tests.sim.small_models import EIGHT_LAYERS

SMALL = ("--model", "qwen3-0.6b", "--gpus", 8, "--seq-len", 1024, "--global-batch", 8, "--workers", 2)
# the searches that check an option reaches the question and the layouts: SMALL at 8 layers
FAST = ("--model", EIGHT_LAYERS, *SMALL[2:])


@pytest.fixture(scope="module")
def as_json():
    r = invoke("search", *SMALL, "--top", 3, "--json")
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def test_json_schema(as_json):
    assert {"model", "gpus", "hardware", "optimizer", "seq_len", "global_batch", "searched", "layouts"} <= set(as_json)
    # the whole question the layouts were searched under, every setting a Question carries
    from sim.search import Question

    asked = set(Question.__dataclass_fields__)
    assert asked <= set(as_json), asked - set(as_json)
    assert as_json["ep_dispatcher"]["moe_token_dispatcher_type"] == "alltoall"
    assert {"candidates", "pruned_by_checks", "pruned_by_memory", "pruned_by_bound", "simulated", "fit",
            "workers", "wall_s"} <= set(as_json["searched"])
    assert 1 <= len(as_json["layouts"]) <= 3
    for i, row in enumerate(as_json["layouts"]):
        assert row["rank"] == i + 1
        for key in ("tp", "pp", "vp", "ep", "dp", "micro_batch", "recompute", "policy", "reduce_scatter",
                    "iteration_time_s", "mfu", "memory_bytes", "memory_capacity_bytes", "fits", "optimizer_step_s", "plan_command",
                    "simulate_command", "not_in_plan"):
            assert key in row
        assert row["fits"]
    times = [r["iteration_time_s"] for r in as_json["layouts"]]
    assert times == sorted(times)


def test_plan_command_of_the_best_runs(as_json, tmp_path):
    command = as_json["layouts"][0]["plan_command"]
    args = shlex.split(command)
    assert args[:2] == ["canzona", "plan"]
    out = tmp_path / "plan.json"
    args = [a if a != "plan.json" else str(out) for a in args[2:]]
    r = invoke("plan", *args)
    assert r.exit_code == 0, r.stderr
    assert out.exists()


def test_table_and_plan_line(as_json):
    r = invoke("search", *SMALL, "--top", 2)
    assert r.exit_code == 0, r.stderr
    # each layout's memory and what it leaves free of the GPU's capacity, as --json gives them
    assert "GB/GPU" in r.stdout and "free GB" in r.stdout
    best = as_json["layouts"][0]
    cells = [c.strip() for c in next(line for line in r.stdout.splitlines() if line.lstrip("│ ").startswith("1 ")).split("│")]
    free = f"{(best['memory_capacity_bytes'] - best['memory_bytes']) / 1e9:.1f}"
    assert f"{best['memory_bytes'] / 1e9:.1f}" in cells and free in cells, cells
    assert "best: canzona plan --model qwen3-0.6b" in r.stdout
    assert "--out plan.json" in r.stdout


@pytest.mark.parametrize("args, needle", [
    (("--gpus", 0), "gpus"),
    (("--model", "no-such-model"), "no-such-model"),
    (("--optimizer", "sgd"), "sgd"),
    (("--top", 0), "--top"),
    # no layout at all, or every layout refused for the question's own reason: the simulator's message,
    # as `canzona simulate` gives it, not a count of refusals
    (("--gpus", 11, "--model", "qwen3-0.6b", "--global-batch", 8), "11 GPUs do not fill whole nodes of 8"),
    (("--gpus", 12, "--model", "qwen3-0.6b", "--global-batch", 12), "12 GPUs do not fill whole nodes of 8"),
    (("--cross-entropy-fusion-impl", "te"), "changes nothing without --cross-entropy-loss-fusion"),
    (("--recompute-method", "block"), "go together"),
    (("--recompute-method", "uniform", "--recompute-num-layers", -1), "whole number >= 1"),
])
def test_bad_input_is_one_line(args, needle):
    error_line(invoke("search", *args), needle)


@pytest.mark.parametrize("args, dps", [
    # 16384 GPUs: TP x PP reach 32 at most (PP 4 of the 28 layers, no CP at seq 4096), DP 512 at least
    (("--gpus", 16384, "--model", "qwen3-0.6b"), "512, 1024, 2048, 4096, 8192, 16384"),
    # 256 GPUs: DP 8 at least; a batch of 4 divides none
    (("--gpus", 256, "--model", "qwen3-0.6b", "--global-batch", 4), "8, 16, 32, 64, 128, 256"),
])
def test_a_batch_no_layouts_dp_divides_says_so_of_the_whole_search(args, dps):
    """No layout's DP divides the global batch: the error says no layout of the search does, with the
    DP sizes its layouts have, not one layout's refusal (`dp x micro batch = 16384 x 1`, TP 1's, as if
    the search had tried nothing else)."""
    line = error_line(invoke("search", *args), "no layout of", f"(the GPUs over TP x PP x CP) are {dps};")
    assert "dp x micro batch" not in line


def test_a_batch_of_too_many_micro_batches_at_every_layout_says_so_of_the_search():
    """Every layout runs more micro-batches per DP rank than the simulator does: the error says what the
    search tried (its largest DP x micro-batch) and what to lower, not the simulator's advice to raise
    --micro-batch, an option search does not take (the micro-batch is an axis it explores)."""
    line = error_line(invoke("search", "--gpus", 8, "--model", "qwen3-0.6b", "--global-batch", 100000),
                      "no layout of qwen3-0.6b on 8 GPUs", "the fewest any layout has is 2500 (DP 8 x micro-batch 5",
                      "lower --global-batch")
    assert "--micro-batch" not in line



@pytest.mark.parametrize("gpus, batch, needle", [(8, 3, "give --global-batch a multiple of 2"),
                                                 (2, 1, "give --global-batch a multiple of 2"),
                                                 (1, 8, "raise --gpus")])
def test_fsdp_with_one_data_parallel_rank_at_every_layout_says_so_of_the_search(gpus, batch, needle):
    """Under --fsdp every layout's DP must leave 2 ranks to shard over; where none does (the batch only
    DP 1 divides, or one GPU), the error was FSDP's for one layout, advising --tp, an axis the search
    explores and an option it does not take. It says so of the search, and what to change."""
    line = error_line(invoke("search", "--fsdp", "--gpus", gpus, "--model", "qwen3-0.6b", "--global-batch", batch),
                      "--fsdp", needle)
    assert "--tp" not in line


def test_every_simulated_layout_refused_by_the_run_is_one_error_line(monkeypatch):
    """Were every layout simulated refused by a rule only the run knows (`sim.search._run_task`), nothing
    fits nor fails to fit: one error line with the run's reason, not an IndexError (the workers fork,
    so they run the patched `run_one`)."""
    import sim.search
    from canzona.errors import SpecError

    def refused(cfg, layout):
        raise SpecError("a rule only the run knows")

    monkeypatch.setattr(sim.search, "run_one", refused)
    error_line(invoke("search", *FAST, "--workers", 1), "no layout of", "a rule only the run knows", code=2)


@pytest.mark.parametrize("name", ["overlap_moe_expert_parallel_comm", "delay_wgrad_compute", "tp_comm_overlap",
                                  "fp8_recipe", "attention_backend", "grad_reduce_in_fp32",
                                  "cross_entropy_loss_fusion", "cross_entropy_fusion_impl", "store_param_remainders",
                                  "apply_rope_fusion", "bias_activation_fusion", "recompute_method",
                                  "recompute_num_layers", "routing", "kernels", "fsdp", "fsdp_impl",
                                  "selective_ac_option", "overlap_grad_reduce", "align_grad_reduce",
                                  "overlap_param_gather", "max_grad_norm", "batch_kernels", "gpu_variability"])
def test_run_settings_of_the_question_are_options_as_in_simulate(name):
    """The run settings `Question` carries are `search` options of the same name and default as
    `simulate`'s (and `compare`'s, where it takes them) (`--tp-comm-overlap` and the recipe
    settings were Question fields no command line set)."""
    import inspect

    from cli import main

    params = {c: inspect.signature(getattr(main, c)).parameters for c in ("simulate", "compare", "search")}
    assert name in params["simulate"] and name in params["search"]
    defaults = {c: p[name].default for c, p in params.items() if name in p}
    assert len(set(defaults.values())) == 1, defaults


def test_no_tp_comm_overlap_reaches_the_question():
    r = invoke("search", *FAST, "--top", 1, "--no-tp-comm-overlap", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["tp_comm_overlap"] is False


def test_the_recipe_settings_reach_the_question_and_the_layouts():
    """`Question`'s recipe settings, which `simulate` takes, are set from the command line too, and
    they change what is searched: bf16 gradient buffers take memory off every layout."""
    settings = ("--precision", "fp8", "--fp8-recipe", "current", "--attention-backend", "flash",
                "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te", "--store-param-remainders",
                "--no-apply-rope-fusion", "--no-bias-activation-fusion")
    r = invoke("search", *FAST, "--top", 1, *settings, "--json")
    assert r.exit_code == 0, r.stderr
    asked = json.loads(r.stdout)
    assert (asked["precision"], asked["fp8_recipe"], asked["attention_backend"]) == ("fp8", "current", "flash")
    assert asked["cross_entropy_loss_fusion"] and asked["cross_entropy_fusion_impl"] == "te"
    assert asked["store_param_remainders"] and not asked["apply_rope_fusion"] and not asked["bias_activation_fusion"]
    rows, shape = {}, ("tp", "pp", "vp", "cp", "ep", "dp", "micro_batch", "recompute", "reduce_scatter")
    for flag in ("--grad-reduce-in-fp32", "--no-grad-reduce-in-fp32"):
        r = invoke("search", *FAST, "--top", 3, "--optimizer", "adamw", flag, "--json")
        assert r.exit_code == 0, r.stderr
        rows[flag] = json.loads(r.stdout)
    assert rows["--no-grad-reduce-in-fp32"]["grad_reduce_in_fp32"] is False
    # the same layout under both settings (the ranking itself may differ: bf16 buffers move times too)
    fp32 = {tuple(row[k] for k in shape): row["memory_bytes"] for row in rows["--grad-reduce-in-fp32"]["layouts"]}
    both = [(fp32[key], row["memory_bytes"]) for row in rows["--no-grad-reduce-in-fp32"]["layouts"]
            if (key := tuple(row[k] for k in shape)) in fp32]
    assert both and all(bf16 < full for full, bf16 in both), both


def test_a_bad_recipe_setting_is_one_error_line():
    r = invoke("search", *SMALL, "--attention-backend", "nope")
    assert r.exit_code != 0
    assert error_line(r).startswith("error:") and "nope" in error_line(r)


def test_recompute_method_reaches_the_question():
    r = invoke("search", *FAST, "--top", 1, "--recompute-method", "block", "--recompute-num-layers", 2, "--json")
    assert r.exit_code == 0, r.stderr
    asked = json.loads(r.stdout)
    assert (asked["recompute_method"], asked["recompute_num_layers"]) == ("block", 2)
    row = asked["layouts"][0]  # the method only where the layout runs full recompute
    assert row["recompute_method"] == ("block" if row["recompute"] == "full" else None)


def test_fsdp_searches_fsdp_layouts():
    """`--fsdp`: every layout an FSDP one (HSDP replicas and reshard in the JSON and the table), no
    `canzona plan` command (no plan file under FSDP) but the launcher's settings."""
    r = invoke("search", *FAST, "--top", 3, "--fsdp", "--json")
    assert r.exit_code == 0, r.stderr
    asked = json.loads(r.stdout)
    assert asked["fsdp"] is True and asked["fsdp_impl"] == "fsdp2" and asked["kernels"] == "fused"
    for row in asked["layouts"]:
        assert row["fsdp"] and (row["pp"], row["vp"], row["cp"]) == (1, 1, 1)
        assert row["dp"] % row["hsdp_replicate"] == 0 and row["reshard_after_forward"] in (True, False)
        assert row["plan_command"] is None and row["not_in_plan"][0].startswith("fully_shard each decoder layer")
        assert row["reduce_scatter"] is None and row["policy"] in ("canzona", "fsdp-gather-all", "fsdp-owners-unbalanced")
    table = invoke("search", *FAST, "--top", 2, "--fsdp")
    assert table.exit_code == 0, table.stderr
    assert "HSDP R" in table.stdout and "reshard" in table.stdout and "FSDP TP" in table.stdout
    assert "best: no plan file" in table.stdout and "set in the launcher: fully_shard" in table.stdout
    assert "canzona plan --model" not in table.stdout


@pytest.mark.parametrize("args, needle", [
    (("--recompute-method", "block", "--recompute-num-layers", 2), "--recompute-method, --recompute-num-layers: "
                                                                   "Megatron's"),
    (("--store-param-remainders",), "--store-param-remainders: Megatron's"),
    (("--model", "qwen3-30b-a3b", "--optimizer", "adamw", "--overlap-moe-expert-parallel-comm"),
     "--overlap-moe-expert-parallel-comm: Megatron's"),
    (("--no-search-recompute-layers",), "--no-search-recompute-layers: Megatron's"),
    (("--fsdp-impl", "nope"), "nope"),
    (("--kernels", "nope"), "nope"),
])
def test_fsdp_with_a_megatron_option_is_one_line(args, needle):
    error_line(invoke("search", *SMALL, "--fsdp", *args), needle)


def test_fsdp_impl_without_fsdp_is_one_line():
    error_line(invoke("search", *SMALL, "--fsdp-impl", "megatron-fsdp"), "--fsdp-impl megatron-fsdp", "needs --fsdp")


def test_selective_ac_option_reaches_the_question_and_the_best_says_its_k(tmp_path):
    """`--selective-ac-option K` under --fsdp: the question carries it; on 90 GB GPUs qwen3-30b-a3b's
    best FSDP layout runs selective-layer, and the table, the JSON row and the launcher line say
    its K with torchtitan's activation_checkpoint config."""
    profile = json.loads((Path(__file__).resolve().parents[2] / "canzona" / "profiles" / "h100-sxm.json").read_text())
    profile["gpu"]["memory_bytes"] = 90_000_000_000
    path = tmp_path / "h100-90gb.json"
    path.write_text(json.dumps(profile))
    moe = ("--model", "qwen3-30b-a3b", "--gpus", 8, "--seq-len", 4096, "--global-batch", 16, "--optimizer", "adamw",
           "--fsdp", "--hardware", str(path), "--workers", 1, "--selective-ac-option", 3)
    r = invoke("search", *moe, "--top", 2, "--json")
    assert r.exit_code == 0, r.stderr
    asked = json.loads(r.stdout)
    best = asked["layouts"][0]
    assert asked["selective_ac_option"] == 3
    assert best["recompute"] == "selective-layer" and best["selective_ac_option"] in (2, 3, 4)
    k = best["selective_ac_option"]
    table = invoke("search", *moe, "--top", 2)
    assert table.exit_code == 0, table.stderr
    assert f"every {k})" in table.stdout
    assert f"activation_checkpoint.selective_ac_option = '{k}'" in table.stdout.replace("\n", " ")


@pytest.mark.parametrize("args, needle", [
    (("--selective-ac-option", 2), "searched under --fsdp"),
    (("--fsdp", "--selective-ac-option", 0), "whole number >= 1"),
])
def test_a_bad_selective_ac_option_is_one_line(args, needle):
    error_line(invoke("search", *SMALL, *args), needle)


def test_the_run_settings_search_does_not_explore_reach_every_layout():
    """simulate's run settings that no axis explores (the DP overlaps, the step's options, the GPUs'
    variability) are search options: the question carries them and the best layout's time is
    simulate's of that layout with them (every layout searched with them, not only echoed)."""
    settings = ("--no-overlap-grad-reduce", "--no-overlap-param-gather", "--max-grad-norm", "1.0",
                "--no-batch-kernels", "--gpu-variability", "0")
    r = invoke("search", *FAST, "--top", 1, *settings, "--json")
    assert r.exit_code == 0, r.stderr
    asked = json.loads(r.stdout)
    assert (asked["overlap_grad_reduce"], asked["overlap_param_gather"], asked["max_grad_norm"],
            asked["batch_kernels"], asked["gpu_variability"]) == (False, False, 1.0, False, 0.0)
    best = asked["layouts"][0]
    layout = ("--model", EIGHT_LAYERS, "--gpus", 8, "--seq-len", 1024, "--global-batch", 8, "--tp", best["tp"],
              "--pp", best["pp"], "--vp", best["vp"], "--micro-batch", best["micro_batch"], "--recompute",
              best["recompute"], "--policy", best["policy"], "--reduce-scatter", best["reduce_scatter"])
    ran = [invoke("simulate", *layout, *extra, "--json") for extra in (settings, ())]
    assert all(x.exit_code == 0 for x in ran), [x.stderr for x in ran]
    with_settings, without = (json.loads(x.stdout)["iteration_time_s"] for x in ran)
    assert best["iteration_time_s"] == pytest.approx(with_settings, rel=1e-9)
    assert with_settings != without


@pytest.mark.parametrize("args, needle", [
    (("--fsdp", "--no-align-grad-reduce"), "--no-align-grad-reduce: Megatron's"),
    (("--fsdp", "--no-overlap-param-gather"), "--no-overlap-param-gather: Megatron's"),
    (("--no-align-grad-reduce", "--no-overlap-grad-reduce"), "changes nothing without --overlap-grad-reduce"),
    (("--gpu-variability", "-1"), "variability"),
    (("--max-grad-norm", "0"), "max_grad_norm"),
    # the block-method exploration runs only without a method: turning it off beside one was accepted
    (("--no-search-recompute-layers", "--recompute-method", "block", "--recompute-num-layers", "1"),
     "--no-search-recompute-layers changes nothing with --recompute-method block"),
])
def test_a_run_setting_that_changes_nothing_or_is_bad_is_one_line(args, needle):
    error_line(invoke("search", *SMALL, *args), needle)


def test_outside_a_terminal_the_search_reports_progress_as_plain_lines(monkeypatch):
    """Under a pipe, a CI log or nohup rich's bar hides itself (stderr is no terminal, as here): the
    search then says how far it is on stderr, a plain line at most every `EVERY_S` seconds (0 here:
    one a simulation), --json keeping stdout one JSON object. Before: nothing for minutes."""
    import cli.plain_progress

    monkeypatch.setattr(cli.plain_progress, "EVERY_S", 0.0, raising=False)
    r = invoke("search", *FAST, "--workers", 1, "--top", 1, "--json")
    assert r.exit_code == 0, r.stderr
    json.loads(r.stdout)
    lines = r.stderr.splitlines()
    assert lines and all(line.startswith("search: ") and " simulated" in line for line in lines), r.stderr
    done = [int(line.split()[1]) for line in lines]
    assert done == sorted(done) and done[-1] > 1
    assert "best so far" in lines[-1] and " s " in lines[-1]
