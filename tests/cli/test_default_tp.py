"""`canzona simulate` / `compare` without --tp: the largest TP of 8, 4, 2, 1 whose layout passes
every check (`cli.main._sim_config`), so a default is one that runs (the default layout keeps TP 8,
bit for bit); a typed --tp keeps its one error line."""

from __future__ import annotations

import json

import pytest

from cli.main import SimOptions, _sim_config
from tests.cli_helpers import error_line, invoke
from tests.sim import small_models

MOE_FSDP = ("--fsdp", "--ep", "2", "--optimizer", "adamw", "--model", "qwen3-30b-a3b", "--gpus", "8")


@pytest.mark.parametrize("given, tp", [
    (dict(), 8),  # the default layout (Qwen3-32B, 256 GPUs): TP 8, as before
    # 4 KV heads: TP 4; under --fsdp experts run at TP 1 (sim.fsdp.check_fsdp)
    (dict(model="qwen3-30b-a3b", gpus=8, ep=2, optimizer="adamw"), 4),
    (dict(model="qwen3-30b-a3b", gpus=8, ep=2, optimizer="adamw", fsdp=True), 1),
    (dict(gpus=8, fsdp=True), 4),  # TP 8 would leave a shard group of one rank
])
def test_an_untyped_tp_is_the_largest_the_layout_runs(given, tp):
    assert _sim_config(shared=SimOptions(**given)).tp == tp


def test_the_default_layout_is_the_one_at_tp_8():
    assert _sim_config(shared=SimOptions()) == _sim_config(shared=SimOptions(tp=8))


def test_a_typed_tp_keeps_its_error_line():
    error_line(invoke("simulate", *MOE_FSDP, "--tp", "8"), "tp=8 does not divide the 4 KV heads")


def test_where_no_tp_runs_the_error_is_the_defaults():
    # at TP 8 more micro-batches than the simulator runs; at TP 1 the batch would not divide DP 256
    error_line(invoke("simulate", "--global-batch", "100000"), "no --tp of 8, 4, 2, 1 runs this layout; at --tp 8: ",
               "at most 1024")


def test_where_no_tp_runs_the_error_is_not_a_tp_the_cluster_refuses():
    # TP 8 does not divide 16 GPUs over PP 4, TP 4 leaves FSDP one DP rank: the batch is the problem
    line = error_line(invoke("simulate", "--fsdp", "--optimizer", "adamw", "--gpus", "16", "--pp", "4",
                             "--global-batch", "4"), "no --tp of 8, 4, 2, 1 runs this layout; at --tp 2: ",
                      "fewer than the stages")
    assert "8 x 4" not in line


@pytest.mark.parametrize("command", ["simulate", "compare"])
def test_a_refused_flag_is_its_error_not_another_tp(command):
    # TP 8 leaves one DP rank, where --alpha changes nothing: refused, not a silent TP 4 x DP 2
    layout = ("--model", "qwen3-0.6b", "--gpus", "8", "--global-batch", "16", "--seq-len", "512")
    assert _sim_config(shared=SimOptions(model="qwen3-0.6b", gpus=8, global_batch=16, seq_len=512)).tp == 8
    error_line(invoke(command, *layout, "--alpha", "0.5"),
               "--alpha 0.5 changes nothing where each plan's DP group is one rank")


def test_simulate_runs_moe_fsdp_without_tp():
    r = invoke("simulate", "--fsdp", "--ep", "2", "--optimizer", "adamw", "--model", small_models.MOE_FOUR_LAYERS,
               "--gpus", "8", "--seq-len", "512", "--global-batch", "8", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["tp"] == 1


@pytest.mark.parametrize("flags, error", [
    (("--fsdp", "--overlap-step"), "--fsdp runs without --overlap-step"),
])
def test_an_error_every_tp_gives_alike_is_the_flags_own(flags, error):
    """A refusal no TP changes (not in `FLAG_ONLY_SETTINGS`) is its own one line, not 'no --tp of
    8, 4, 2, 1 runs this layout; at --tp 4: ...' (before)."""
    line = error_line(invoke("simulate", "--model", "qwen3-0.6b", "--gpus", "8", *flags), error)
    assert "no --tp" not in line
