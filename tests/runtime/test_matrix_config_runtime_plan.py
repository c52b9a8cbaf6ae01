"""The runtime's own plan (plan=None) is balanced for the step it runs: DistributedOptimizer(...,
matrix_config=X) plans what `canzona plan --matrix-config X` writes (a world of one gloo rank in this
process: no processes spawned)."""

from __future__ import annotations

import json

import pytest

from canzona.models import save_spec
from canzona.plan import load_plan
from canzona.runtime import DistributedOptimizer
from reference.tiny_model import TinyQwen3
from tests.cli_helpers import invoke


def _cli_plan(tmp_path, spec, optimizer: str, matrix_config: dict | None):
    path, out = tmp_path / "spec.json", tmp_path / "plan.json"
    save_spec(spec, path)
    given = [] if matrix_config is None else ["--matrix-config", json.dumps(matrix_config)]
    result = invoke("plan", "--model", path, "--dp", 1, "--tp", 1, "--optimizer", optimizer, *given, "--out", out)
    assert result.exit_code == 0, result.output
    return load_plan(out)


@pytest.mark.parametrize(("optimizer", "matrix_config"), [
    ("muon", {"ns_steps": 10}), ("muon", None), ("soap", {"max_precond_dim": 48, "precondition_frequency": 2}),
])
def test_runtime_and_cli_plan_the_same_for_a_matrix_config(one_rank, tmp_path, optimizer, matrix_config):
    model = TinyQwen3("tiny", seed=0)
    spec = model.spec()
    opt = DistributedOptimizer(model.named_parameters(), spec, optimizer, matrix_config)
    cli = _cli_plan(tmp_path, spec, optimizer, matrix_config)
    assert opt.plan.hash() == cli.hash()
    assert opt.plan.cost_model == cli.cost_model
    if matrix_config is not None:  # and not the defaults' plan: the config changed what was priced
        default = DistributedOptimizer(TinyQwen3("tiny", seed=0).named_parameters(), spec, optimizer)
        assert default.plan.hash() != opt.plan.hash()
        assert [p.cost for p in default.plan.dp_plan.placements()] != [p.cost for p in opt.plan.dp_plan.placements()]


@pytest.mark.parametrize(("optimizer", "matrix_config", "adamw_config"), [
    ("soap", {"compute_dtype": "bf16"}, None), ("shampoo", {"compute_dtype": "fp64"}, None),
    ("muon", None, {"compute_dtype": "bf16"}),
])
def test_a_compute_dtype_the_kernels_do_not_run_is_refused(one_rank, optimizer, matrix_config, adamw_config):
    """The kernels compute SOAP's, Shampoo's and AdamW's steps in the dtype of what they update (SOAP's
    and Shampoo's at least fp32: `kernels.work_dtype`), whatever `compute_dtype` says: it was accepted and ignored
    (and priced as given by the planner and the simulator) until 2026-11-30; now one SpecError at
    construction, as `canzona plan / simulate --matrix-config` give one error line."""
    from canzona.errors import SpecError

    model = TinyQwen3("tiny", seed=0)
    with pytest.raises(SpecError, match="compute_dtype must be fp32"):
        DistributedOptimizer(model.named_parameters(), model.spec(), optimizer, matrix_config, adamw_config)


def test_a_checkpoint_whose_param_group_keeps_other_state_is_refused(one_rank):
    """A checkpoint's param group records every hyper-parameter of its configuration, which loading
    restores: one whose group kept other state (SOAP's max_precond_dim 48, given to the group) would
    turn this optimizer's group (the defaults, what its plan priced) to that state. One PlanError
    naming the group, the optimizer's groups as they were. Before: loaded silently."""
    from canzona.errors import PlanError

    model = TinyQwen3("tiny", seed=0)
    saved = DistributedOptimizer([{"params": list(model.named_parameters()), "max_precond_dim": 48}], model.spec(),
                                 "soap").state_dict()
    opt = DistributedOptimizer(TinyQwen3("tiny", seed=0).named_parameters(), model.spec(), "soap")
    before = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    with pytest.raises(PlanError) as refused:
        opt.load_state_dict(saved)
    assert str(refused.value) == (
        'checkpoint was saved with soap param group 0 at {"max_precond_dim": 48}, which keeps other optimizer state '
        "than this optimizer's group 0 at {} (model.layers.0.self_attn.q_proj.weight: 32768 bytes of state there, "
        "98304 here): build the optimizer with the checkpoint's param groups and a plan made for them")
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == before
