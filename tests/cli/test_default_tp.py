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


def test_where_no_tp_runs_the_error_is_tp_8s_as_before():
    # at TP 8 more micro-batches than the simulator runs; at TP 1 the batch would not divide DP 256
    error_line(invoke("simulate", "--global-batch", "100000"), "at most 1024")


def test_simulate_runs_moe_fsdp_without_tp():
    r = invoke("simulate", "--fsdp", "--ep", "2", "--optimizer", "adamw", "--model", small_models.MOE_FOUR_LAYERS,
               "--gpus", "8", "--seq-len", "512", "--global-batch", "8", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["tp"] == 1
