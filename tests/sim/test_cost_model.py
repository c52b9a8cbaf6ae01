"""`SimConfig.cost_model`: DistributedOptimizer's `cost_model`, same name and default (None: the
hardware profile's). A measured table plans the owners, ZeRO-1's and FSDP2's alike, and its seconds
price the step's matrix work, as the runtime given `cost_model=cost_model_for(hardware, table)` plans
them; `canzona simulate --cost-table` builds it as `canzona plan --cost-table` does."""

from __future__ import annotations

import json

import pytest

from canzona.cost import cost_model_for
from canzona.errors import CanzonaError
from sim.simulate import SimConfig, simulate
from sim.workload import Workload
from tests.sim.small_models import EIGHT_LAYERS

# every 1024 x 1024 matrix (the 8-layer Qwen3-0.6B's, whole at TP 1) measured at 1 s
ROWS = {"device": "cpu-test", "rows": [["muon", 1024, 1024, "bf16", 1.0]]}


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    path = tmp_path_factory.mktemp("costs") / "table.json"
    path.write_text(json.dumps(ROWS))
    return path


@pytest.mark.parametrize("fsdp", [False, True], ids=["zero1", "fsdp"])
def test_a_measured_table_plans_and_prices_the_step(table, fsdp):
    base = SimConfig(model=EIGHT_LAYERS, gpus=4, tp=1, fsdp=fsdp, workload=Workload(512, 4, 1))
    default = simulate(base)
    measured = simulate(SimConfig(**{**base.__dict__, "cost_model": cost_model_for(base.hardware, table)}))
    assert default.plan.cost_model == "analytic:h100-sxm"  # None: the hardware profile's, as before
    assert measured.plan.cost_model == "table:cpu-test"
    assert default.optimizer_step_s < 0.1 < 1.0 < measured.optimizer_step_s  # the measured 1 s matrices


def test_the_cli_builds_it_as_canzona_plan_does(table, tmp_path):
    from cli.main import SimOptions, _sim_config

    options = SimOptions(model=EIGHT_LAYERS, gpus=4, tp=1, global_batch=4, seq_len=512)
    assert _sim_config(shared=options).cost_model is None
    given = _sim_config(shared=SimOptions(**{**options.__dict__, "cost_table": table}))
    assert given.cost_model.name == "table:cpu-test"
    with pytest.raises(CanzonaError, match="cannot read cost table"):
        _sim_config(shared=SimOptions(**{**options.__dict__, "cost_table": tmp_path / "missing.json"}))


def test_simulate_json_names_the_cost_model_that_planned(table):
    """`canzona simulate --json` says what planned the owners and priced their steps (`cost_model`,
    as a plan file's and DistributedOptimizer's `plan.cost_model`): before, a run with `--cost-table`
    read the same as one without."""
    from tests.cli_helpers import invoke

    layout = ["--model", EIGHT_LAYERS, "--gpus", 4, "--tp", 1, "--global-batch", 4, "--seq-len", 512, "--json"]
    default, measured = (invoke("simulate", *layout, *given) for given in ([], ["--cost-table", table]))
    assert default.exit_code == 0 and measured.exit_code == 0, (default.output, measured.output)
    assert json.loads(default.stdout)["cost_model"] == "analytic:h100-sxm"
    assert json.loads(measured.stdout)["cost_model"] == "table:cpu-test"
    a100 = invoke("simulate", *layout, "--hardware", "a100-sxm")
    assert json.loads(a100.stdout)["cost_model"] == "analytic:a100-sxm"
