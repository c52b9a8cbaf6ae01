from canzona.catalog import get_model
from canzona.plan import make_plan, plan_from_json


def test_default_layout_plans_and_round_trips():
    plan = make_plan(get_model("qwen3-32b", 8), 32, 8)
    assert plan_from_json(plan.to_json()) == plan
