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
    naming the group, the optimizer's groups as they were. Before: loaded silently. (Such a group is
    refused at construction now: the checkpoint's group is edited, as one saved before that was.)"""
    from canzona.errors import PlanError

    model = TinyQwen3("tiny", seed=0)
    saved = DistributedOptimizer(model.named_parameters(), model.spec(), "soap").state_dict()
    saved["param_groups"][0]["max_precond_dim"] = 48
    opt = DistributedOptimizer(TinyQwen3("tiny", seed=0).named_parameters(), model.spec(), "soap")
    before = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    with pytest.raises(PlanError) as refused:
        opt.load_state_dict(saved)
    assert str(refused.value) == (
        'checkpoint was saved with soap param group 0 at {"max_precond_dim": 48}, which keeps other optimizer state '
        "than this optimizer's group 0 at {} (model.layers.0.self_attn.q_proj.weight: 32768 bytes of state there, "
        "98304 here): build the optimizer with the checkpoint's param groups and a plan made for them")
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == before


def _soap_plan():
    """The plan an optimizer builds for the tiny model at SOAP's defaults (max_precond_dim 10000)."""
    model = TinyQwen3("tiny", seed=0)
    return DistributedOptimizer(model.named_parameters(), model.spec(), "soap").plan


@pytest.mark.parametrize("planned", [True, False], ids=["plan given", "own plan"])
def test_a_group_override_that_keeps_other_state_is_refused_at_construction(one_rank, planned):
    """torch optimizers take per-group hyper-parameters, and so does this one; but the plan prices
    every matrix's state at matrix_config (its own plan as well: `plan_for` takes one config), so a
    group's max_precond_dim 48 (one-sided factors of the 64-wide matrices) would run state no plan
    priced. One PlanError at construction naming the group, the key and both values. Before:
    accepted silently, with or without a plan."""
    from canzona.errors import PlanError

    model = TinyQwen3("tiny", seed=0)
    named = list(model.named_parameters())
    groups = [{"params": named[:4]}, {"params": named[4:], "max_precond_dim": 48, "precondition_frequency": 3}]
    with pytest.raises(PlanError) as refused:
        DistributedOptimizer(groups, model.spec(), "soap", plan=_soap_plan() if planned else None)
    assert str(refused.value) == (
        "parameter group 1 sets max_precond_dim=48 (matrix_config has 10000), which keeps other soap optimizer "
        "state than the plan priced (model.layers.0.self_attn.v_proj.weight: 57344 bytes of state there, 24576 "
        "here): give the value in matrix_config, with a plan made for it, or leave the key out of the group")


def test_group_overrides_that_keep_the_same_state_are_accepted(one_rank):
    """Hyper-parameters (a frequency, a learning rate) and a state key whose value keeps the same
    state for these matrices (every side of the tiny model is under 20000 as under 10000) stay
    per-group settings."""
    model = TinyQwen3("tiny", seed=0)
    groups = [{"params": list(model.named_parameters()), "precondition_frequency": 3, "lr": 0.5,
               "max_precond_dim": 20000}]
    opt = DistributedOptimizer(groups, model.spec(), "soap", plan=_soap_plan())
    matrix = next(g for g in opt.param_groups if g["kind"] == "matrix")
    assert (matrix["precondition_frequency"], matrix["lr"], matrix["max_precond_dim"]) == (3, 0.5, 20000)


def test_a_state_key_edited_in_param_groups_is_refused_at_the_next_step(one_rank):
    """`param_groups` stays live for hyper-parameters (an lr edit changes the next step), but an
    edit of a key that keeps other state (max_precond_dim 48 mid-run) is one PlanError at the next
    step, before any update (parameters and state as they were); set back, the run goes on. Before:
    stepped silently with the full factors the executor already held, which the new value does not
    keep. The ranks' digest comparison runs first: a rank editing alone is that error."""
    import torch

    from canzona.errors import PlanError

    model = TinyQwen3("tiny", seed=0)
    opt = DistributedOptimizer(model.named_parameters(), model.spec(), "soap")

    def step():
        torch.manual_seed(1)
        for p in opt.params.values():
            p.grad = torch.randn_like(p)
        opt.step()

    step()
    g = next(i for i, group in enumerate(opt.param_groups) if group["kind"] == "matrix")
    params = {n: p.detach().clone() for n, p in opt.params.items()}
    state = {n: {k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)} for n, s in opt.matrix_state.items()}
    opt.param_groups[g]["max_precond_dim"] = 48
    opt.param_groups[g]["lr"] = 0.5  # a hyper-parameter edit beside it is no excuse
    with pytest.raises(PlanError) as refused:
        step()
    assert str(refused.value).startswith(
        f"param_groups[{g}] was set to max_precond_dim=48 (matrix_config has 10000), which keeps other soap "
        "optimizer state than the plan priced (model.layers.0.self_attn.q_proj.weight: 98304 bytes of state there, "
        "32768 here): a key that keeps other state is fixed at construction (set it back")
    assert all(torch.equal(p, params[n]) for n, p in opt.params.items())
    assert all(torch.equal(opt.matrix_state[n][k], v) for n in state for k, v in state[n].items())
    opt.param_groups[g]["max_precond_dim"] = 10000
    opt.step()  # the refused step retried with its gradients as they were (replacing them now is refused): the lr edit runs
    assert not all(torch.equal(p, params[n]) for n, p in opt.params.items())


def test_a_group_of_stacked_experts_that_keeps_other_state_is_refused_at_construction_and_in_a_checkpoint(one_rank):
    """A group holding only stacked experts (16 x 32 matrices): SOAP's max_precond_dim 16 keeps
    one-sided factors, counted per matrix of the stack. Refused as a group override, and as a
    checkpoint's group. Before: the checkpoint's group loaded silently (its members were looked up
    among the spec's single matrices, where a stack is not)."""
    from canzona.errors import PlanError
    from canzona.runtime.modules import ModelSpec
    from reference.tiny_moe import MOE_PRESETS, TinyMoe

    def groups(**override):
        named = list(TinyMoe(MOE_PRESETS["tiny-moe"], seed=0).named_parameters())
        return [{"params": [(n, p) for n, p in named if n in stacks], **override},
                {"params": [(n, p) for n, p in named if n not in stacks]}]

    spec = ModelSpec.from_module(TinyMoe(MOE_PRESETS["tiny-moe"], seed=0))
    stacks = {p.name for p in spec.stacks}
    with pytest.raises(PlanError, match=r"^parameter group 0 sets max_precond_dim=16 \(matrix_config has 10000\), "
                                        r"which keeps other soap optimizer state than the plan priced \(model\.layers"
                                        r"\.0\.mlp\.experts\.gate_up_proj: "):
        DistributedOptimizer(groups(max_precond_dim=16), spec, "soap")
    opt = DistributedOptimizer(groups(), spec, "soap")
    saved = opt.state_dict()
    saved["param_groups"][0]["max_precond_dim"] = 16  # the stacks' group
    with pytest.raises(PlanError, match=r"^checkpoint was saved with soap param group 0 at \{\"max_precond_dim\": 16\}"):
        opt.load_state_dict(saved)
    assert opt.param_groups[0]["max_precond_dim"] == 10000


@pytest.mark.parametrize("where, key, value, message", [
    ("header", "future_key", 1, "checkpoint's matrix_config has 'future_key', which this canzona's soap "
                                "configuration does not have (saved by another canzona version?)"),
    ("header", "max_precond_dim", "big", "checkpoint's matrix_config is not valid here: soap max_precond_dim "
                                         "must be a whole number, got 'big'"),
    ("header", "max_precond_dim", -3, "checkpoint's matrix_config is not valid here: soap max_precond_dim must "
                                      "be >= 0, got -3"),
    ("adamw header", "future_key", 1, "checkpoint's adamw_config has 'future_key', which this canzona's adamw "
                                      "configuration does not have (saved by another canzona version?)"),
    ("group", "max_precond_dim", None, "checkpoint's param group 0 is not valid here: soap max_precond_dim must "
                                       "be a whole number, got None"),
], ids=["unknown key", "wrong type", "out of range", "adamw unknown key", "group wrong type"])
def test_a_checkpoint_config_that_is_not_valid_here_is_one_error_before_anything_changes(one_rank, where, key,
                                                                                        value, message):
    """The configurations a checkpoint records are validated as construction validates them, before
    the kept-state comparison computes with them: one PlanError naming the entry, the optimizer as
    it was. Before: a TypeError from the comparison (SOAPConfig's unknown keyword, '<=' between int
    and str), and a group's invalid value loaded silently before that comparison existed."""
    import copy

    from canzona.errors import PlanError
    from canzona.runtime.checkpoint import HEADER_KEY

    model = TinyQwen3("tiny", seed=0)
    saved = copy.deepcopy(DistributedOptimizer(model.named_parameters(), model.spec(), "soap").state_dict())
    for group in saved["param_groups"]:
        header = json.loads(group[HEADER_KEY])
        if where != "group":
            header["adamw_config" if where == "adamw header" else "matrix_config"][key] = value
        group[HEADER_KEY] = json.dumps(header)
    if where == "group":
        saved["param_groups"][0][key] = value
    opt = DistributedOptimizer(TinyQwen3("tiny", seed=0).named_parameters(), model.spec(), "soap")
    before = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups], opt.matrix_cfg, opt.adamw_cfg
    with pytest.raises(PlanError) as refused:
        opt.load_state_dict(saved)
    assert str(refused.value) == message
    assert ([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups], opt.matrix_cfg,
            opt.adamw_cfg) == before


@pytest.mark.parametrize("key, value", [("lr", float("nan")), ("max_precond_dim", 48)], ids=["nan lr", "refused edit"])
def test_a_checkpoint_loads_over_a_group_that_holds_what_a_step_would_refuse(one_rank, key, value):
    """Loading replaces each group's hyper-parameters, so what the group holds now is not checked:
    a NaN learning rate or a refused state-key edit (which a load may be meant to undo) is
    overwritten by the checkpoint's values, as torch's load_state_dict overwrites it, and the run
    steps. Before: the kept-state comparison validated the group as it stood, and the load was
    refused with the step's error (SpecError 'lr must be a finite number', PlanError
    'param_groups[0] was set to max_precond_dim=48')."""
    import torch

    model = TinyQwen3("tiny", seed=0)
    saved = DistributedOptimizer(model.named_parameters(), model.spec(), "soap").state_dict()
    opt = DistributedOptimizer(model.named_parameters(), model.spec(), "soap")
    g = next(i for i, group in enumerate(opt.param_groups) if group["kind"] == "matrix")
    before = opt.param_groups[g][key]
    opt.param_groups[g][key] = value
    opt.load_state_dict(saved)
    assert opt.param_groups[g][key] == before
    for p in opt.params.values():
        p.grad = torch.ones_like(p)
    opt.step()
