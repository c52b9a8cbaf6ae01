"""`--tp-comm-overlap-cfg` (`sim.userbuffers`): simulate and search take it by name; an unknown
name, or one set where it changes nothing, is one `error:` line."""

from __future__ import annotations

import json

from tests.cli_helpers import error_line, invoke
from tests.sim.small_models import EIGHT_LAYERS

DENSE = ["--model", "qwen3-0.6b", "--gpus", "16", "--tp", "2", "--seq-len", "256", "--global-batch", "16"]
FP8_405B = "userbuffers_fp8_h100_h16384_tp8_cp2_mbs1_seqlen8192"
SEARCH = ["--model", EIGHT_LAYERS, "--gpus", "8", "--seq-len", "1024", "--global-batch", "8", "--workers", "2"]


def test_simulate_runs_the_named_configuration():
    r = invoke("simulate", *DENSE, "--tp-comm-overlap-cfg", FP8_405B, "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["options"]["tp_comm_overlap_cfg"] == FP8_405B
    table = invoke("simulate", *DENSE, "--tp-comm-overlap-cfg", FP8_405B)
    assert table.exit_code == 0 and f"TP comm overlap ({FP8_405B})" in " ".join(table.stdout.split())


def test_simulate_refuses_an_unknown_or_idle_configuration():
    line = error_line(invoke("simulate", *DENSE, "--tp-comm-overlap-cfg", "userbuffers_bf16_h100_h1_tp4"),
                      "unknown userbuffers config", "'userbuffers_bf16_h100_h1_tp4'", "choose one of")
    assert FP8_405B in line and "userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192" in line
    error_line(invoke("simulate", *DENSE, "--no-tp-comm-overlap", "--tp-comm-overlap-cfg", FP8_405B),
               "changes nothing with --no-tp-comm-overlap")
    error_line(invoke("simulate", *DENSE[:4], "--tp", "1", *DENSE[6:], "--tp-comm-overlap-cfg", FP8_405B),
               "changes nothing at --tp 1")
    error_line(invoke("simulate", *DENSE, "--fsdp", "--tp-comm-overlap-cfg", FP8_405B), "not under --fsdp")


def test_search_takes_it_and_refuses_it_where_it_changes_nothing():
    r = invoke("search", *SEARCH, "--top", "1", "--tp-comm-overlap-cfg", FP8_405B, "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["tp_comm_overlap_cfg"] == FP8_405B
    error_line(invoke("search", *SEARCH, "--tp-comm-overlap-cfg", "nope"), "unknown userbuffers config")
    error_line(invoke("search", *SEARCH, "--no-tp-comm-overlap", "--tp-comm-overlap-cfg", FP8_405B),
               "changes nothing with --no-tp-comm-overlap")
    error_line(invoke("search", *SEARCH, "--fsdp", "--tp-comm-overlap-cfg", FP8_405B), "--tp-comm-overlap-cfg",
               "not searched under --fsdp")
