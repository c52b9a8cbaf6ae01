"""The planner prices and balances the step the runtime runs: `matrix_config` (DistributedOptimizer's
option) reaches the cost model and the optimizer state, its defaults plan as none given, and a
measured table (timed at the defaults) gives way to the analytic model for another configuration."""

from __future__ import annotations

import pytest

from canzona.cost import AnalyticCost, TableCost, priced_with, state_bytes
from canzona.errors import SpecError
from canzona.models import resolve_spec
from canzona.optimizers import MuonConfig, config_from_dict, matrix_config_for
from canzona.plan import PlanSettings, make_plan, plan_for

SPEC = resolve_spec("qwen3-0.6b", 1)


def _plan(optimizer: str, matrix_config=None, cost_model=None):
    return plan_for(SPEC, 4, 1, optimizer, "canzona", PlanSettings(), cost_model, matrix_config=matrix_config)


def test_the_defaults_given_plan_as_none_given():
    base = _plan("muon")
    for given in ({}, {"ns_steps": 5}, MuonConfig()):
        plan = _plan("muon", given)
        assert plan.hash() == base.hash()
        assert plan.cost_model == base.cost_model == "analytic:" + AnalyticCost().rate.name


def test_more_newton_schulz_steps_cost_more():
    base, longer = _plan("muon"), _plan("muon", {"ns_steps": 10})
    assert longer.hash() != base.hash()
    # every matrix's step is five more Newton-Schulz iterations: more seconds, the same state
    cost = {p.name: p.cost for p in base.dp_plan.placements()}
    for p in longer.dp_plan.placements():
        assert p.cost > cost[p.name]
    assert longer.optimizer_compute_s > 1.5 * base.optimizer_compute_s


def test_soap_state_follows_max_precond_dim():
    small = config_from_dict("soap", {"max_precond_dim": 1024})
    base, plan = _plan("soap"), _plan("soap", {"max_precond_dim": 1024})
    placed = {p.name: p for p in plan.dp_plan.placements()}
    default = {p.name: p for p in base.dp_plan.placements()}
    for p in SPEC.matrix_params():
        assert placed[p.name].state_bytes == state_bytes("soap", p.shape, small)
        if max(p.shape) > 1024:  # a side no longer preconditioned: no factors of it, no eigensolves
            assert placed[p.name].state_bytes < default[p.name].state_bytes
            assert placed[p.name].cost < default[p.name].cost


def test_a_measured_table_gives_way_to_its_analytic_model_off_the_defaults():
    analytic = AnalyticCost()
    table = TableCost(table={("muon", 1024, 1024, "bf16"): 1.0}, dtypes={"muon": "bf16"}, fallback=analytic)
    ten = config_from_dict("muon", {"ns_steps": 10})
    assert priced_with(table, "muon", None) is table
    assert priced_with(table, "muon", MuonConfig()) is table
    priced = priced_with(table, "muon", ten)
    assert isinstance(priced, AnalyticCost) and priced.configs == {"muon": ten}
    assert priced.seconds("muon", (1024, 1024)) == AnalyticCost(configs={"muon": ten}).seconds("muon", (1024, 1024))
    # the plan says so: its cost model is the analytic one at the configuration, not the table
    assert _plan("muon", ten, table).cost_model == priced.name == analytic.name
    assert _plan("muon", None, table).cost_model == table.name


def test_a_config_that_changes_no_work_plans_as_the_defaults():
    """A learning rate or a weight decay (what most runtimes set) changes no kernel nor state."""
    assert _plan("muon", {"lr": 0.02, "weight_decay": 0.0}).hash() == _plan("muon").hash()


def test_refused_for_an_elementwise_optimizer_and_for_bad_values():
    with pytest.raises(SpecError, match="matrix optimizer"):
        make_plan(SPEC, 4, 1, "adamw", "zero1-even", matrix_config={})
    with pytest.raises(SpecError, match="no hyper-parameter"):
        matrix_config_for("muon", {"ns_step": 3})
    with pytest.raises(SpecError, match="MuonConfig"):
        matrix_config_for("muon", config_from_dict("soap", {}))


def test_a_plan_is_held_to_the_configuration_whose_state_it_prices():
    """A plan records each matrix's optimizer state, priced at its matrix_config: the memory model
    counts that state, so a configuration that keeps other state is one PlanError (until 2026-11-30
    the memory model counted a SOAP defaults' plan's state beside max_precond_dim 1024: 3.46 GB on
    the 0.6B model's fullest GPU at DP 4, 2.46x the 1.41 GB that configuration keeps); one that
    changes only seconds is not, and the plan's own configuration passes."""
    from canzona.errors import PlanError
    from canzona.memory import LayerDims, memory_per_gpu
    from canzona.plan import check_plan_config

    dims = LayerDims.gpt(layers=28, hidden=1024, heads=16, vocab=151936)
    small = {"max_precond_dim": 1024}
    default, priced = _plan("soap"), _plan("soap", small)
    for plan, cfg in ((default, None), (priced, small), (default, {"precondition_frequency": 3})):
        check_plan_config(plan, SPEC, cfg)
    with pytest.raises(PlanError, match="plan was made for another soap configuration: it prices .* at "):
        check_plan_config(default, SPEC, small)
    with pytest.raises(PlanError, match="another soap configuration"):
        memory_per_gpu(SPEC, default, "canzona", dims, matrix_config=config_from_dict("soap", small))
    assert memory_per_gpu(SPEC, priced, "canzona", dims, matrix_config=config_from_dict("soap", small)).worst.matrix_state \
        < memory_per_gpu(SPEC, default, "canzona", dims).worst.matrix_state
