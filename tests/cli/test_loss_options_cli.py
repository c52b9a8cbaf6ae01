"""`canzona simulate`'s loss and master-weights options: what each changes, and one `error:` line
where one can change nothing or is not modelled (docs/design.md §7.1)."""

from __future__ import annotations

import json

import pytest

from tests.cli_helpers import error_line, invoke

FSDP = ("simulate", "--model", "qwen3-0.6b", "--gpus", 8, "--tp", 1, "--fsdp", "--optimizer", "adamw",
        "--seq-len", 1024, "--global-batch", 8)


def _worst(*extra) -> dict:
    r = invoke(*FSDP, *extra, "--json")
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)["memory"]["worst"]


def test_the_loss_options_change_the_loss_peak_and_the_master_weights_the_state():
    """Without the upcast the three tensors at the loss's backward are bf16 (6 bytes a logit
    fewer); a loop holding its logits keeps 2 bytes a logit more; a bf16-built model halves the
    masters' and AdamW's bytes. Qwen3-0.6B: vocabulary 151,936, 1024 tokens a micro-batch."""
    logits = 1024 * 151936
    base = _worst()
    assert base["activations"] - _worst("--no-loss-fp32-upcast")["activations"] == 3 * 2 * logits
    assert _worst("--loss-holds-logits")["activations"] - base["activations"] == 2 * logits
    bf16 = _worst("--no-master-weights")
    assert bf16["master_weights"] == 0 and bf16["weights"] * 2 == base["master_weights"]
    assert bf16["adamw_state"] * 2 == base["adamw_state"]


@pytest.mark.parametrize("args, needles", [
    (("--loss-holds-logits", "--fsdp-impl", "megatron-fsdp"), ("--loss-holds-logits",)),
    (("--no-loss-fp32-upcast", "--cross-entropy-loss-fusion"), ("--no-loss-fp32-upcast",)),
])
def test_a_setting_that_cannot_apply_is_one_error_line(args, needles):
    error_line(invoke(*FSDP, *args), *needles)


def test_zero1_refuses_the_fsdp2_frameworks_settings():
    zero1 = ("simulate", "--model", "qwen3-0.6b", "--gpus", 8, "--tp", 1, "--seq-len", 1024, "--global-batch", 8)
    error_line(invoke(*zero1, "--loss-holds-logits"), "--loss-holds-logits")
    # without masters canzona's DistributedOptimizer reduces in the parameters' dtype (FSDP2: its reduce_dtype)
    error_line(invoke(*zero1, "--no-master-weights", "--grad-reduce-in-fp32"), "--no-master-weights",
               "parameters' dtype")
    error_line(invoke(*zero1, "--no-master-weights", "--store-param-remainders"), "--store-param-remainders",
               "master weights")
    error_line(invoke(*zero1, "--no-loss-fp32-upcast"), "--no-loss-fp32-upcast", "fp32")
