"""Megatron's token dispatcher options on the command line (`--moe-token-dispatcher-type`,
`--moe-flex-dispatcher-backend`, `--moe-hybridep-num-sms`: sim.ep_dispatch): accepted by simulate,
shown in the options, faster under flex across two nodes, bad values refused with one error line."""

from __future__ import annotations

import json

from tests.cli_helpers import error_line, help_text, invoke

SIM = ["--model", "qwen3-30b-a3b", "--gpus", "16", "--tp", "1", "--ep", "16", "--global-batch", "16",
       "--optimizer", "adamw"]
FLEX = ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "hybridep"]


def test_simulate_takes_the_dispatcher():
    alltoall = json.loads(invoke("simulate", *SIM, "--json").stdout)
    result = invoke("simulate", *SIM, *FLEX, "--moe-hybridep-num-sms", "32", "--json")
    assert result.exit_code == 0, result.stderr
    flex = json.loads(result.stdout)
    assert alltoall["options"]["ep_dispatcher"]["moe_token_dispatcher_type"] == "alltoall"
    assert flex["options"]["ep_dispatcher"] == {"moe_token_dispatcher_type": "flex",
                                                "moe_flex_dispatcher_backend": "hybridep", "moe_hybridep_num_sms": 32,
                                                "moe_deepep_num_sms": 20, "fake_balanced_gate": False,
                                                "routing": "random"}
    assert flex["iteration_time_s"] < alltoall["iteration_time_s"]


def test_dispatcher_options_are_documented():
    text = help_text("simulate")
    for option in ("--moe-token-dispatcher-type", "--moe-flex-dispatcher-backend", "--moe-hybridep-num-sms",
                   "--moe-deepep-num-sms", "--fake-balanced-gate"):
        assert option in text


def test_bad_dispatcher_options_are_one_error_line():
    error_line(invoke("simulate", *SIM, "--moe-token-dispatcher-type", "allgather"),
               "unknown --moe-token-dispatcher-type 'allgather'", "alltoall, flex")
    error_line(invoke("simulate", *SIM, "--moe-token-dispatcher-type", "flex"), "needs --moe-flex-dispatcher-backend")
    error_line(invoke("simulate", *SIM, "--moe-flex-dispatcher-backend", "deepep"),
               "is for --moe-token-dispatcher-type flex")
    error_line(invoke("simulate", *SIM, *FLEX, "--moe-hybridep-num-sms", "0"), "--moe-hybridep-num-sms", "got 0")
    # settings that would change nothing are refused, not echoed back
    error_line(invoke("simulate", *SIM, "--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep",
                      "--moe-hybridep-num-sms", "32"), "--moe-hybridep-num-sms 32 is HybridEP's")
    dense_ep1 = ["--model", "qwen3-0.6b", "--gpus", "8", "--tp", "1", "--global-batch", "8"]
    error_line(invoke("simulate", *dense_ep1, *FLEX), "--moe-token-dispatcher-type flex", "it needs --ep > 1")
    error_line(invoke("simulate", *SIM, *FLEX, "--hardware", "a100-sxm", "--moe-hybridep-num-sms", "120"),
               "--moe-hybridep-num-sms 120: a100-sxm has 108 SMs")
    deepep = ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"]
    error_line(invoke("simulate", *SIM, *deepep, "--moe-deepep-num-sms", "21"), "--moe-deepep-num-sms", "even",
               "got 21")
    error_line(invoke("simulate", *SIM, *FLEX, "--moe-deepep-num-sms", "32"), "--moe-deepep-num-sms 32 is DeepEP's")
    error_line(invoke("simulate", *SIM, *deepep, "--hardware", "a100-sxm", "--moe-deepep-num-sms", "120"),
               "--moe-deepep-num-sms 120: a100-sxm has 108 SMs")


def test_deepeps_sms_size_its_buffer():
    """DeepEP's SMs are its buffer's channels (two SMs each, `canzona.memory.deepep_buffer_bytes`):
    Megatron's default 20 is the run's unless `--moe-deepep-num-sms` says otherwise."""
    from canzona.memory import deepep_buffer_bytes

    deepep = ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"]
    runs = {sms: json.loads(invoke("simulate", *SIM, *deepep, "--moe-deepep-num-sms", str(sms), "--json").stdout)
            for sms in (20, 32)}
    assert runs[20]["options"]["ep_dispatcher"]["moe_deepep_num_sms"] == 20
    for sms, run in runs.items():
        assert run["memory"]["worst"]["dispatcher_buffers"] == deepep_buffer_bytes(16, 2048, sms)


def test_search_takes_the_dispatcher():
    assert "--moe-token-dispatcher-type" in help_text("search")
    error_line(invoke("search", "--model", "qwen3-30b-a3b", "--gpus", "16", "--moe-token-dispatcher-type", "flex"),
               "needs --moe-flex-dispatcher-backend")


def test_fake_balanced_gate_is_an_option_of_simulate_and_search():
    """NeMo AutoModel's fake_balanced_gate (sim.ep_dispatch): each token to top-k consecutive
    experts, so a flex dispatch reaches one EP rank, not the ~5.3 of 8 a router's uniform routing
    reaches on Qwen3-30B-A3B at EP 8: the option reaches the run and the dispatch gets cheaper;
    on a dense model it is one error line, on simulate and on search."""
    one_node = ["--model", "qwen3-30b-a3b", "--gpus", "8", "--tp", "1", "--ep", "8", "--global-batch", "8",
                "--optimizer", "adamw", "--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"]
    routed = json.loads(invoke("simulate", *one_node, "--json").stdout)
    result = invoke("simulate", *one_node, "--fake-balanced-gate", "--json")
    assert result.exit_code == 0, result.stderr
    gated = json.loads(result.stdout)
    assert gated["options"]["ep_dispatcher"]["fake_balanced_gate"] is True
    assert routed["options"]["ep_dispatcher"]["fake_balanced_gate"] is False
    assert gated["iteration_time_s"] < routed["iteration_time_s"]
    assert "--fake-balanced-gate" in help_text("search")
    dense = ["--model", "qwen3-0.6b", "--gpus", "8", "--global-batch", "8"]
    error_line(invoke("simulate", *dense, "--tp", "1", "--fake-balanced-gate"), "fake_balanced_gate", "mixture-of-experts")
    error_line(invoke("search", *dense, "--fake-balanced-gate"), "--fake-balanced-gate True", "has no experts")
