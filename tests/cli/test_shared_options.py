"""`canzona simulate` and `canzona compare` simulate the same layouts: every option that changes what
is simulated is an option of both, with the same name, default and help (one definition:
`cli.main.SimOptions` through `cli.shared_options.takes_options`), and compare passes each to the
simulator as simulate does."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated

import pytest
import typer

from sim.published import DATA_DIR
from tests.cli_helpers import error_line, invoke
from tests.sim.small_models import MOE_FOUR_LAYERS

# options one command has and the other deliberately lacks: compare varies the policy and draws a
# plot; simulate writes one run's trace
SIMULATE_ONLY = {"policy", "trace"}
COMPARE_ONLY = {"plot"}

# the published rows' Llama 3 8B spec file: eager kernels are modelled for dense Llama layers
LLAMA = ["--model", str(DATA_DIR / "models" / "llama3-8b.json"), "--gpus", "16", "--tp", "2", "--seq-len", "256",
         "--global-batch", "16"]
DENSE = ["--model", "qwen3-0.6b", "--gpus", "16", "--tp", "2", "--seq-len", "256", "--global-batch", "16"]
PIPELINE = [*DENSE, "--pp", "2"]
# three stages (DP 4): the even split's 10 / 9 / 9 layers against the accounting's 9 / 10 / 9
PIPELINE3 = ["--model", "qwen3-0.6b", "--gpus", "24", "--tp", "2", "--seq-len", "256", "--global-batch", "16",
             "--pp", "3"]
FSDP = [*DENSE, "--fsdp"]
# a MoE model small enough to simulate in a second, whose EP 8 spans one node
MOE = ["--model", "examples/tiny_qwen3_moe/config.json", "--gpus", "16", "--tp", "1", "--ep", "8", "--global-batch", "16",
       "--seq-len", "256"]
# Qwen3-30B-A3B's tokens and experts a layer (its depth does not change what the SMs do)
MOE_30B = ["--model", MOE_FOUR_LAYERS, "--gpus", "16", "--tp", "1", "--ep", "16", "--global-batch", "16"]
FLEX = ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "hybridep"]
DEEPEP = ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"]

# (the layout, the option): the option changes simulate's result on that layout, and compare's row
# of the same policy must be simulate's with the option
CASES = [
    (DENSE, ["--gpu-variability", "0"]),
    (LLAMA, ["--kernels", "eager"]),
    (DENSE, ["--cross-entropy-loss-fusion"]),
    ([*DENSE, "--cross-entropy-loss-fusion"], ["--cross-entropy-fusion-impl", "te"]),
    (DENSE, ["--store-param-remainders"]),
    (DENSE, ["--no-apply-rope-fusion"]),
    (DENSE, ["--no-bias-activation-fusion"]),
    (DENSE, ["--no-grad-reduce-in-fp32"]),
    # 28 layers and the two counted as layers: 30, divisible by PP 3 (one alone is refused); at PP 2
    # both give the even split's 14 / 14, and at PP 1 they are a no-op (as in Megatron)
    (PIPELINE3, ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]),
    (PIPELINE, ["--decoder-first-pipeline-num-layers", "12"]),
    (PIPELINE, ["--decoder-last-pipeline-num-layers", "12"]),
    (FSDP, ["--no-reshard-after-forward"]),
    (FSDP, ["--fsdp-impl", "megatron-fsdp"]),
    (MOE, FLEX),
    # 8 SMs: HybridEP's 8-SM measurement (32 is priced from the 16-SM one, as the default)
    ([*MOE_30B, *FLEX], ["--moe-hybridep-num-sms", "8"]),  # SMs matter where the tokens are many
    ([*MOE, *FLEX], ["--fake-balanced-gate"]),
    # DeepEP's SMs: its buffer's channels (memory) and the SMs its kernels take from the GEMMs
    ([*MOE, *DEEPEP], ["--moe-deepep-num-sms", "32"]),
    (MOE, ["--routing", "balanced"]),
    # Megatron-Bridge's FP8 userbuffers: ring-exchange forward reduce-scatters on a one-SM margin
    (DENSE, ["--tp-comm-overlap-cfg", "userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192"]),
]

# what compare lacked before its options became simulate's: each is exercised above
ADDED = {"--moe-token-dispatcher-type", "--moe-flex-dispatcher-backend", "--moe-hybridep-num-sms", "--moe-deepep-num-sms",
         "--fake-balanced-gate", "--routing", "--gpu-variability", "--reshard-after-forward", "--kernels",
         "--fsdp-impl", "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
         "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
         "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "--store-param-remainders",
         "--apply-rope-fusion", "--bias-activation-fusion", "--grad-reduce-in-fp32"}


def _params(name: str) -> dict:
    """The click parameters of command `name`, by parameter name."""
    from typer.main import get_command

    from cli.main import app

    return {p.name: p for p in get_command(app).commands[name].params}


def test_compare_has_every_option_of_simulate():
    """Fails when simulate gains an option compare lacks (or the reverse) outside the allow-lists,
    or when a shared option's flags, default or help differ."""
    simulate, compare = _params("simulate"), _params("compare")
    assert set(simulate) - set(compare) == SIMULATE_ONLY
    assert set(compare) - set(simulate) == COMPARE_ONLY
    for name in set(simulate) & set(compare):
        s, c = simulate[name], compare[name]
        assert (s.opts, s.secondary_opts, s.default, s.help) == (c.opts, c.secondary_opts, c.default, c.help), name


def test_search_takes_simulates_options_or_says_why_not():
    """Fails when search and simulate disagree on an option they share (flags, default or help),
    when simulate gains an option search neither takes nor lists with its reason
    (`cli.main.SEARCH_LACKS`), or when a shared option does not reach search's `Question`."""
    from dataclasses import fields

    from cli.main import SEARCH_LACKS, SEARCH_SHARED, SimOptions
    from sim.ep_dispatch import EpDispatcher
    from sim.search import Question

    simulate, search = _params("simulate"), _params("search")
    # search's own: options it explores otherwise (over the layouts), and its own settings
    own = {"overlap_moe_expert_parallel_comm", "recompute_method", "search_recompute_layers", "top", "workers",
           "as_json"}
    assert set(search) - set(simulate) == own - {"overlap_moe_expert_parallel_comm", "recompute_method", "as_json"}
    assert set(simulate) - set(search) == set(SEARCH_LACKS) - own | {"trace"}
    assert set(SEARCH_LACKS) | set(SEARCH_SHARED) == {f.name for f in fields(SimOptions)}
    assert all(SEARCH_LACKS.values())
    for name in set(simulate) & set(search) - own:
        s, q = simulate[name], search[name]
        assert (s.opts, s.secondary_opts, s.default, s.help) == (q.opts, q.secondary_opts, q.default, q.help), name
    for name in own & set(simulate):  # the same flag and default, search's help saying how it applies it
        assert (simulate[name].opts, simulate[name].default) == (search[name].opts, search[name].default), name
    # every shared option is a field of the question (the dispatcher's inside its EpDispatcher), whose
    # default is the command line's
    dispatcher = {f.name for f in fields(EpDispatcher)}
    asked = {f.name: f.default for f in fields(Question)}
    for name in SEARCH_SHARED:
        assert name in asked or name in dispatcher, name
        if name in asked:
            assert asked[name] == search[name].default, name


def test_every_added_option_is_exercised():
    flags = {a for layout, option in CASES for a in (*layout, *option) if a.startswith("--")}
    flags |= {"--" + a[len("--no-"):] for a in flags if a.startswith("--no-")}
    assert ADDED <= flags, ADDED - flags


def _run(command: str, *args: str):
    result = invoke(command, *args, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


# what a run computed, apart from the configuration it echoes back (`options`, `workload`,
# `pipeline_split`, `fsdp`, ...): an option echoed there has not thereby changed the simulation
SIMULATED = ("iteration_time_s", "optimizer_step_s", "forward_backward_s", "grad_sync_end_s", "param_gather_exposed_s",
             "mfu", "gpu_slowdown", "breakdown", "optimizer_breakdown", "rank_optimizer_s", "memory")


def _simulated(row: dict) -> dict:
    return {k: row[k] for k in SIMULATED}


@pytest.mark.parametrize("layout,option", CASES, ids=[" ".join(o) for _, o in CASES])
def test_compare_passes_each_option_to_the_simulator(layout, option):
    """compare's canzona row is simulate's canzona run with the same options, whose simulated times
    or memory differ from the run without the option (not merely its echo in the options): compare
    cannot have dropped it, and the layout is one where the option acts."""
    rows = {r["policy"]: r for r in _run("compare", *layout, *option)}
    simulated = _run("simulate", *layout, *option, "--policy", "canzona")
    assert rows["canzona"] == simulated
    assert _simulated(_run("simulate", *layout, "--policy", "canzona")) != _simulated(simulated)


def test_compare_refuses_a_bad_option_with_one_line():
    error_line(invoke("compare", *MOE, "--moe-token-dispatcher-type", "flex"), "needs --moe-flex-dispatcher-backend")
    error_line(invoke("compare", *DENSE, "--tp", "1", *FLEX), "--moe-token-dispatcher-type flex", "it needs --ep > 1")
    error_line(invoke("compare", *DENSE, "--kernels", "jit"), "jit")
    error_line(invoke("compare", *DENSE, "--gpu-variability", "-1"), "variability")


# --- the mechanism ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _Shared:
    size: Annotated[int, typer.Option(help="A size.")] = 3
    name: Annotated[str, typer.Option(help="A name.")] = "x"


def test_takes_options_appends_the_fields_and_hands_one_dataclass():
    import inspect

    from cli.shared_options import takes_options

    seen = []

    @takes_options(_Shared, omit=("name",))
    def command(shared: _Shared, flag: bool = False) -> None:
        seen.append((shared, flag))

    assert list(inspect.signature(command).parameters) == ["size", "flag"]
    command(size=5, flag=True)
    assert seen == [(_Shared(size=5, name="x"), True)]
    with pytest.raises(TypeError, match="no fields"):
        takes_options(_Shared, omit=("nope",))

    def again(shared: _Shared, size: int = 1) -> None: ...

    with pytest.raises(TypeError, match="declares shared options again"):
        takes_options(_Shared)(again)
