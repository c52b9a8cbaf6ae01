"""`--attention-backend` on the command line (Megatron's option: fused, Transformer Engine's cuDNN
attention; flash, flash-attn 2): accepted by simulate and compare, shown in the options, slower
under flash, a bad value refused with one error line."""

from __future__ import annotations

import json

from tests.cli_helpers import error_line, help_text, invoke

SIM = ["--model", "qwen3-0.6b", "--gpus", "8", "--tp", "8", "--seq-len", "4096", "--global-batch", "8",
       "--optimizer", "adamw"]


def test_simulate_takes_the_attention_backend():
    fused = json.loads(invoke("simulate", *SIM, "--json").stdout)
    result = invoke("simulate", *SIM, "--attention-backend", "flash", "--json")
    assert result.exit_code == 0, result.stderr
    flash = json.loads(result.stdout)
    assert fused["options"]["attention_backend"] == "fused" and flash["options"]["attention_backend"] == "flash"
    assert flash["iteration_time_s"] > fused["iteration_time_s"]


def test_attention_backend_is_documented():
    for command in ("simulate", "compare"):
        assert "--attention-backend" in help_text(command)


def test_bad_attention_backend_is_one_error_line():
    error_line(invoke("simulate", *SIM, "--attention-backend", "sdpa"), "attention backend must be one of fused, flash",
               "'sdpa'")
    error_line(invoke("compare", *SIM, "--attention-backend", "local"), "attention backend must be one of")
