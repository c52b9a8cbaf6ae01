"""Red-team regressions of the options `canzona simulate` and `canzona compare` share
(`cli.main.SimOptions`): an option that changes nothing where it is given is an error line, as its
siblings are."""

from __future__ import annotations

import json

from tests.cli_helpers import error_line, invoke

DENSE = ["--model", "qwen3-0.6b", "--gpus", "16", "--tp", "2", "--seq-len", "256", "--global-batch", "16"]


def test_fsdp_impl_needs_fsdp():
    """`--fsdp-impl megatron-fsdp` without --fsdp was accepted and ignored (the same run as without
    it) by simulate and, since it gained the option, compare; its sibling --no-reshard-after-forward
    is refused there, and so is a published row's fsdp_impl off an fsdp row."""
    for command in ("simulate", "compare"):
        error_line(invoke(command, *DENSE, "--fsdp-impl", "megatron-fsdp"), "--fsdp-impl megatron-fsdp",
                   "needs --fsdp")
        result = invoke(command, *DENSE, "--fsdp", "--fsdp-impl", "megatron-fsdp", "--json")
        assert result.exit_code == 0, result.stderr
        rows = json.loads(result.stdout)
        assert rows  # under --fsdp it runs
    plain = invoke("simulate", *DENSE, "--fsdp-impl", "fsdp2", "--json")  # the default, named: nothing to refuse
    assert plain.exit_code == 0, plain.stderr
