"""End-to-end properties on random models: every policy pair yields a plan that validates, matches
its model, survives a JSON round trip, and computes every matrix exactly once (or reports why not)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canzona.dp import DP_POLICIES
from canzona.errors import PlanError
from canzona.plan import check_plan_matches, make_plan, plan_from_json, validate_plan
from canzona.spec import ModelSpec, ParamSpec
from canzona.tp import EVERY_RANK, TP_POLICIES
from tests.policy.strategies import models


@settings(max_examples=40, deadline=None)
@given(models(), st.integers(1, 6), st.sampled_from(list(DP_POLICIES)), st.sampled_from(list(TP_POLICIES)),
       st.sampled_from(["muon", "soap", "shampoo"]), st.floats(0.0, 1.0))
def test_every_policy_pair_gives_a_valid_matching_plan(model_tp, dp, dp_policy, tp_policy, optimizer, alpha):
    model, tp = model_tp
    plan = make_plan(model, dp, tp, optimizer, dp_policy, tp_policy, alpha=alpha, align=8)
    validate_plan(plan, model)
    check_plan_matches(plan, model, dp, tp)
    assert plan_from_json(plan.to_json()) == plan

    matrices = {p.name for p in model.matrix_params()}
    owners = plan.dp_plan.owners()
    assert set(owners) == matrices

    # each matrix is computed once in the cluster: one DP rank, one host (tp-sync: all TP ranks)
    computed: dict[str, int] = {}
    for rank_groups in plan.tp_plan.groups:
        for g in rank_groups:
            for name, host in zip(g.tasks, g.hosts):
                computed[name] = computed.get(name, 0) + (tp if host == EVERY_RANK else 1)
    redundant = plan.dp_plan.split_compute or tp_policy == "tp-sync"
    if not redundant:
        assert computed == {name: 1 for name in matrices}
    else:
        assert set(computed) == matrices and all(n >= 1 for n in computed.values())


@settings(max_examples=15, deadline=None)
@given(models(), st.integers(1, 4))
def test_a_plan_does_not_match_another_model(model_tp, dp):
    model, tp = model_tp
    plan = make_plan(model, dp, tp)
    first = model.matrix_params()[0]
    bigger = ParamSpec(first.name, (first.shape[0] * 2, first.shape[1]), first.role, first.layer, first.tp_dim)
    other = ModelSpec("random", tuple(bigger if p.name == first.name else p for p in model.params))
    with pytest.raises(PlanError):
        check_plan_matches(plan, other)
