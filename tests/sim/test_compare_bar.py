"""Issue 20's compare bar on Qwen3-30B-A3B, 256 GPUs, TP 4, EP 8, and the planner rule that meets it
(canzona's geometry, `canzona.plan.GEOMETRIES`): relations only, no absolute times.

The dense part there is 192 attention matrices over 64 DP ranks. Whole matrices of 2.1M and 0.26M
elements cannot cut its bucket evenly (the longest segment is 1.185x the even one), and on a DP
group spread over 32 nodes the uneven reduce-scatter and all-gather cost about 25 ms per iteration
more than even ones, more than the 0.8 ms the step saves. Under the TP micro-groups the step is the
largest matrix either way, so canzona keeps ZeRO-1's even segments for that part.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from canzona.catalog import get_config
from canzona.cost import cost_model_for
from canzona.decoder import build_decoder
from canzona.errors import SpecError
from canzona.experts import dense_part
from canzona.plan import evenly_cut, plan_for
from canzona.step_collectives import step_collectives
from canzona.step_policies import STEP_POLICIES
from canzona.step_schedule import tp_schedule
from sim.simulate import SimConfig, simulate, with_policy

BAR = SimConfig(model="qwen3-30b-a3b", gpus=256, tp=4, ep=8)


def test_canzona_meets_the_bar_with_its_own_plan():
    """`canzona compare --model qwen3-30b-a3b --gpus 256 --tp 4 --ep 8`: canzona's row steps below
    layerwise's and iterates no slower, and it is canzona's own plan, no slower than zero1-gather."""
    reported = simulate(BAR)  # the compare row: the fastest of canzona and its fallbacks
    own = simulate(replace(BAR, zero1_fallback=False))
    layerwise = simulate(with_policy(BAR, "layerwise"))
    zero1_gather = simulate(with_policy(BAR, "zero1-gather"))
    assert reported.fell_back_to is None
    assert reported.optimizer_step_s < layerwise.optimizer_step_s
    assert reported.iteration_time_s <= layerwise.iteration_time_s
    assert own.iteration_time_s <= zero1_gather.iteration_time_s
    assert own.optimizer_step_s < zero1_gather.optimizer_step_s
    # the dense part keeps ZeRO-1's even segments (its collectives are zero1-gather's), the experts
    # whole matrices (their segments are even already)
    assert own.plan.dp_plan.policy == "zero1-even" and evenly_cut(own.expert_plan.dp_plan)
    assert own.grad_sync_end_s <= zero1_gather.grad_sync_end_s * (1 + 1e-9)


def _dense_plans(model: str, dp: int, tp: int, ep: int = 1):
    spec = build_decoder(get_config(model))
    spec = dense_part(spec) if ep > 1 else spec
    costs = cost_model_for("h100-sxm")
    return (plan_for(spec, dp, tp, "muon", "canzona", cost_model=costs),
            plan_for(spec, dp, tp, "muon", "canzona", cost_model=costs, geometry="whole"), spec)


def test_even_segments_where_whole_matrices_plan_no_shorter_step():
    auto, whole, spec = _dense_plans("qwen3-30b-a3b", 64, 4, ep=8)
    assert whole.dp_plan.policy == "alpha-balanced-reorder" and not evenly_cut(whole.dp_plan)
    assert auto.dp_plan.policy == "zero1-even" and auto.dp_plan.split_compute and evenly_cut(auto.dp_plan)
    assert auto.tp_plan.metrics.makespan <= whole.tp_plan.metrics.makespan * (1 + 1e-9)
    assert auto.tp_plan.policy == whole.tp_plan.policy == "greedy-rollback"  # canzona's micro-groups kept
    canzona = STEP_POLICIES["canzona"]
    canzona.check_dp_plan(auto.dp_plan)
    # the split matrices' other parts are fetched after the reduce-scatter, so nothing is prefetched
    # before the step check and the step cannot start from the reduce-scatters (overlap_step)
    assert canzona.gathers_split(auto.dp_plan) and not canzona.reads_reduce_scatter(auto.dp_plan)
    assert not tp_schedule(auto, spec, canzona, 0).prefetched and tp_schedule(whole, spec, canzona, 0).prefetched
    names = [c.name for c in step_collectives(auto, spec, canzona, style="megatron")]
    assert "gather split gradients" in names
    assert "gradients of bucket 0" in [c.name for c in step_collectives(auto, spec, canzona)]
    with pytest.raises(SpecError, match="overlap_step needs every matrix whole"):
        tp_schedule(auto, spec, canzona, 0, overlap_step=True)
    overlapped = plan_for(spec, 64, 4, "muon", "canzona", cost_model=cost_model_for("h100-sxm"), overlap_step=True)
    assert overlapped.hash() == whole.hash()


def test_whole_matrices_stay_where_they_plan_a_shorter_step():
    """The demo layout (Qwen3-32B, 32 x TP 8): whole matrices balance a step that even segments,
    computing each straddling matrix twice, would make twice as long."""
    auto, whole, _ = _dense_plans("qwen3-32b", 32, 8)
    assert auto.hash() == whole.hash() and auto.dp_plan.policy == "alpha-balanced-reorder"


def test_the_baselines_plan_as_before():
    spec = build_decoder(get_config("qwen3-32b"))
    for name, policy in STEP_POLICIES.items():
        if policy.dp_policy is not None and not policy.elementwise:
            plans = [plan_for(spec, 128, 8, "muon", name, geometry=g) for g in ("auto", "whole")]
            assert plans[0].hash() == plans[1].hash() and plans[0].dp_plan.policy == policy.dp_policy, name


def test_geometry_has_one_default_and_a_bad_one_is_one_error():
    import inspect

    from canzona.plan import DEFAULT_GEOMETRY, make_plan
    from canzona.runtime.optimizer import DistributedOptimizer
    from cli import main as cli
    from tests.cli_helpers import error_line, invoke

    assert DEFAULT_GEOMETRY == "auto" and SimConfig().geometry == DEFAULT_GEOMETRY
    assert inspect.signature(plan_for).parameters["geometry"].default == DEFAULT_GEOMETRY
    assert inspect.signature(make_plan).parameters["geometry"].default == "whole"  # the DP policy as named
    for command in (cli.plan, cli.simulate, cli.compare, DistributedOptimizer):
        assert inspect.signature(command).parameters["geometry"].default == DEFAULT_GEOMETRY
    spec = build_decoder(get_config("qwen3-0.6b"))
    with pytest.raises(SpecError, match="unknown geometry 'even'"):
        plan_for(spec, 4, 2, "muon", "canzona", geometry="even")
    for command in ("plan", "simulate", "compare"):
        error_line(invoke(command, "--model", "qwen3-0.6b", "--geometry", "even"), "unknown geometry 'even'")
