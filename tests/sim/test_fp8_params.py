"""FP8 primary weights (`--fp8-params`, NeMo 1.x's `fp8_params`, Transformer Engine's
`fp8_model_init`; docs/design.md §7.1): under FP8 each linear weight is kept in FP8 with its cached
transpose and no bf16 copy, the optimizer keeps full fp32 masters, and a weight's per-iteration
cast is its transpose only. Refused where it cannot apply, with one error line each."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from canzona.errors import SpecError
from canzona.memory import FP8_WEIGHT_CACHE, FP32, MemorySetup, fp8_linear_params
from sim import published
from sim.fp8 import CAST_BYTES, DELAYED, FP8_PARAMS_TRANSPOSE_BYTES, FP8Setup
from sim.simulate import SimConfig, model_of, simulate
from sim.workload import Workload
from tests.cli_helpers import error_line, invoke

MODEL = "qwen3-0.6b"
SEQ = 1024


def _config(**workload) -> SimConfig:
    return SimConfig(model=MODEL, gpus=8, tp=2, optimizer="adamw", policy="zero1",
                     workload=Workload(seq_len=SEQ, global_batch=8, precision="fp8", **workload))


def test_fp8_weights_replace_the_bf16_copy_and_the_masters_are_whole():
    """The FP8 weight and its transpose are the weight: 2 bytes a linear element (the bf16 copy's),
    against 2 + 2 with the cached FP8 copy beside the bf16 weight. The masters are full fp32
    whatever the remainders default (an FP8 weight holds no high half)."""
    spec, _ = model_of(SimConfig(model=MODEL))
    linear = sum(p.local_numel(2) for p in fp8_linear_params(spec))
    cache = simulate(_config()).memory.worst
    fp8_params = simulate(_config(fp8_params=True)).memory.worst
    assert cache.weights - fp8_params.weights == 2 * linear  # the bf16 copy's two bytes
    assert FP8_WEIGHT_CACHE == 2  # what stays: the FP8 weight and its transpose
    assert fp8_params.master_weights == cache.master_weights  # full fp32, as without remainders
    remainders = simulate(_config(store_param_remainders=True)).memory.worst
    assert remainders.master_weights * 2 == fp8_params.master_weights
    assert fp8_params.activations == cache.activations


def test_the_weight_cast_is_the_transpose_only():
    setup = FP8Setup(recipe=DELAYED, micro_batches=4)
    kept = replace(setup, fp8_params=True)
    assert setup.weight_cast("w", 1000).bytes == CAST_BYTES[DELAYED] * 1000
    assert kept.weight_cast("w", 1000).bytes == FP8_PARAMS_TRANSPOSE_BYTES * 1000
    assert kept.weight_cast("w", 1000).count == setup.weight_cast("w", 1000).count == 0.25
    assert simulate(_config(fp8_params=True)).iteration_time_s <= simulate(_config()).iteration_time_s


@pytest.mark.parametrize("workload, needle", [
    ({"precision": "bf16"}, "needs --precision fp8"),
    ({"store_param_remainders": True}, "full fp32"),
    ({"fp8_params": "yes"}, "true or false"),
])
def test_a_workload_it_cannot_apply_to_is_refused(workload, needle):
    with pytest.raises(SpecError, match=needle):
        Workload(**{"precision": "fp8", "fp8_params": True, **workload})


def test_the_memory_setup_holds_the_same_rules():
    with pytest.raises(SpecError, match="needs fp8"):
        MemorySetup(fp8_params=True)
    with pytest.raises(SpecError, match="kept whole"):
        MemorySetup(fp8=True, fp8_params=True, store_param_remainders=True)
    assert MemorySetup.from_workload(Workload(precision="fp8", fp8_params=True)).fp8_params
    assert MemorySetup(fp8=True, fp8_params=True).master_bytes == FP32


def test_fsdp_refuses_it():
    cfg = SimConfig(model=MODEL, gpus=8, tp=1, fsdp=True, optimizer="adamw",
                    workload=Workload(seq_len=SEQ, global_batch=8, precision="fp8", fp8_params=True))
    with pytest.raises(SpecError, match="--fp8-params"):
        cfg.check_settings()


ZERO1 = ("simulate", "--model", MODEL, "--gpus", 8, "--tp", 2, "--optimizer", "adamw", "--seq-len", SEQ,
         "--global-batch", 8)


def test_the_option_changes_the_weights_on_the_command_line():
    def worst(*extra):
        r = invoke(*ZERO1, "--precision", "fp8", *extra, "--json")
        assert r.exit_code == 0, r.stderr
        return json.loads(r.stdout)["memory"]["worst"]

    spec, _ = model_of(SimConfig(model=MODEL))
    linear = sum(p.local_numel(2) for p in fp8_linear_params(spec))
    assert worst()["weights"] - worst("--fp8-params")["weights"] == 2 * linear


@pytest.mark.parametrize("args, needles", [
    (("--fp8-params",), ("--fp8-params", "--precision fp8")),
    (("--precision", "fp8", "--fp8-params", "--store-param-remainders"), ("--fp8-params", "--store-param-remainders")),
])
def test_a_setting_that_cannot_apply_is_one_error_line(args, needles):
    error_line(invoke(*ZERO1, *args), *needles)


def test_a_search_with_it_replays_its_rows():
    """The search takes the option (a question field of the same name) and every row's
    `simulate_command` carries it, as it carries every other simulate option."""
    r = invoke("search", "--model", MODEL, "--gpus", 8, "--optimizer", "adamw", "--seq-len", SEQ,
               "--global-batch", 8, "--precision", "fp8", "--fp8-params", "--json", "--workers", 1)
    assert r.exit_code == 0, r.stderr
    rows = json.loads(r.stdout)["layouts"]
    assert rows and all("--fp8-params" in row["simulate_command"] for row in rows)


def test_a_published_row_states_it_only_where_it_applies():
    runs, sources = published.load()
    raw = json.loads(published.PUBLISHED_RUNS.read_text())
    rows = {r["id"]: r for r in raw["rows"]}
    fp8 = rows["llama3.1-405b-576xh100-dgxc-fp8"]
    assert fp8["fp8_params"] is True and "store_param_remainders" not in fp8
    run = next(r for r in runs if r.id == fp8["id"])
    assert run.sim_config().workload.fp8_params
    with pytest.raises(SpecError, match="fp8_params true is an FP8 ZeRO-1 row"):
        published.parse_run({**rows["llama3.1-405b-576xh100-dgxc-bf16"], "fp8_params": True}, sources, "row")
    with pytest.raises(SpecError, match="fp8_params true is an FP8 ZeRO-1 row"):
        published.parse_run({**fp8, "store_param_remainders": True}, sources, "row")
    with pytest.raises(SpecError, match="fp8_params must be"):
        published.parse_run({**fp8, "fp8_params": "yes"}, sources, "row")


def test_the_time_floor_prices_the_weight_pass_as_the_simulator_does():
    """The search's time floor builds its own FP8 setup: it must carry `fp8_params`, or it prices
    every weight's full cast (4 / 6 bytes an element) where the simulator prices its transpose (2),
    a floor above the simulator's own cost that could prune a layout that wins."""
    from canzona.cost import DeviceRate
    from canzona.hardware import load_profile
    from canzona.models import resolve_model
    from sim.search import Question, candidates, config_of, space_of, time_floor

    hw = load_profile("h100-sxm")
    rate = DeviceRate.from_profile(hw)
    floors = []
    for kept in (False, True):
        q = Question(model=MODEL, gpus=8, seq_len=256, global_batch=8, optimizer="adamw", precision="fp8",
                     fp8_recipe="current", fp8_params=kept)
        layout = next(lay for lay in candidates(q) if lay["tp"] == 1 and lay["pp"] == 1)
        cfg = config_of(q, {**layout, **space_of(q).recompute_variants(q)[0]})
        floors.append(time_floor(cfg, resolve_model(q.model), rate, hw))
        assert floors[-1] <= simulate(cfg).iteration_time_s
    assert floors[1] < floors[0]  # the transpose-only pass, as the simulation's


def test_megatron_bridges_fp8_rows_keep_fp8_weights():
    """Megatron-Bridge's H100 FP8-CS recipes (fp8_cs: bf16_with_fp8_current_scaling_mixed) set
    fp8_param_gather: its ZeRO-1 FP8 rows state fp8_params with that source; its FSDP FP8 row does
    not (the option is the ZeRO-1 layout's) and says so."""
    runs, _ = published.load()
    mb_fp8 = [r for r in runs if r.source.startswith("mb-") and r.precision == "fp8"]
    assert len(mb_fp8) >= 7
    for r in mb_fp8:
        if r.fsdp:
            assert not r.fp8_params and "fp8_param_gather" in r.note
        else:
            assert r.fp8_params and "fp8_param_gather = True" in r.recipe_source
            assert not r.store_param_remainders
