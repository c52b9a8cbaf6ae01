"""Expert parallelism in the planner's model split and the simulator (issue 20): what one EP rank
holds, the groups its expert gradients reduce over, the token dispatch in forward and backward,
the expert step, memory, and canzona against the baselines on Qwen3-30B-A3B."""

from __future__ import annotations

import pytest

from canzona.catalog import get_config
from canzona.decoder import DecoderConfig, build_decoder
from canzona.errors import SpecError
from canzona.experts import check_ep, dense_part, expert_part
from canzona.spec import Role
from sim.simulate import DENSE_FALLBACK, SimConfig, simulate
from sim.workload import Workload
from tests.cli_helpers import error_line, invoke

TINY = DecoderConfig("tiny-moe", 4, 256, 4, 4, 64, 512, 1024, False, experts=16, experts_per_token=2, moe_ffn=128)
WL = Workload(seq_len=512, global_batch=16)


def _config(**changes) -> SimConfig:
    spec = build_decoder(TINY)
    base = dict(model="unused", gpus=16, tp=2, workload=WL, zero1_fallback=False)
    return SimConfig(**{**base, **changes}), (spec, TINY.architecture())


def _run(**changes):
    cfg, model = _config(**changes)
    return simulate(cfg, model=model)


def test_an_ep_rank_holds_experts_over_ep_and_the_rest_is_dense():
    spec = build_decoder(get_config("qwen3-30b-a3b"))
    experts, dense = expert_part(spec, 8), dense_part(spec)
    assert all(p.shape[0] == 16 and p.role is Role.EXPERT for p in experts.params)
    assert not any(p.role is Role.EXPERT for p in dense.params)
    assert dense.numel + 8 * experts.numel == spec.numel
    assert len(experts.matrix_params()) == 48 * 16 * 3
    assert check_ep(spec, 8, 64, 4) == 32  # the EDP size


@pytest.mark.parametrize("ep, dp, tp, needle", [
    (3, 64, 4, "ep=3 does not divide the 128 experts"),
    (8, 1, 4, "does not divide the dp x tp = 1 x 4 GPUs"),
    (0, 64, 4, "ep must be a whole number >= 1"),
])
def test_ep_that_does_not_fit_is_one_error(ep, dp, tp, needle):
    with pytest.raises(SpecError, match=needle):
        check_ep(build_decoder(get_config("qwen3-30b-a3b")), ep, dp, tp)


def test_ep_needs_experts_and_stacked_ones():
    with pytest.raises(SpecError, match="has no experts"):
        check_ep(build_decoder(get_config("qwen3-0.6b")), 2, 4, 1)
    from canzona.spec import ModelSpec, ParamSpec

    linears = ModelSpec("m", (ParamSpec("experts.0.w", (4, 4), Role.EXPERT),))
    with pytest.raises(SpecError, match="needs the experts stacked"):
        check_ep(linears, 2, 4, 1)


def test_tokens_are_dispatched_and_combined_over_ep_groups_and_expert_gradients_reduce_over_edp():
    result = _run(ep=4)
    spans = [s for s in result.spans if s.phase == "A"]
    dispatch = [s for s in spans if s.name.endswith("dispatch")]
    combine = [s for s in spans if s.name.endswith("combine")]
    # every MoE layer, forward and backward, each micro-batch: one dispatch and one combine
    micro_batches = WL.micro_batches(16 // 2)
    assert len(dispatch) == len(combine) == 2 * TINY.layers * micro_batches
    assert all(s.kind == "comm" and s.end > s.start for s in dispatch + combine)
    assert any(s.name.startswith("experts ") for s in spans)  # the expert buckets' reduce-scatters
    without = _run(ep=1)
    assert not any(s.name.endswith("dispatch") for s in without.spans)


def test_ep_divides_the_expert_memory():
    one, four = _run(ep=1), _run(ep=4)
    assert four.memory.worst.weights < one.memory.worst.weights
    assert four.memory.worst.grads < one.memory.worst.grads
    expert_weight_bytes = sum(p.numel for p in build_decoder(TINY).params if p.role is Role.EXPERT) * 2
    # each GPU holds a quarter of the experts' weights (and none of the others' three quarters)
    saved = one.memory.worst.weights - four.memory.worst.weights
    assert saved == pytest.approx(expert_weight_bytes * 3 / 4, rel=0.05)


def test_the_runtime_collectives_refuse_what_the_runtime_does_not_run_of_ep_and_bad_layouts_refuse_ep():
    from sim.options import RunOptions

    cfg, model = _config(ep=4, etp=2, options=RunOptions(collectives="runtime"))  # expert TP
    with pytest.raises(SpecError, match="the runtime runs expert parallelism at etp 1"):
        cfg.check(model)
    cfg, model = _config(ep=4, options=RunOptions(collectives="runtime"))  # a TP dense part: what it runs
    assert cfg.check(model) is not None
    cfg, model = _config(ep=4, tp=1, options=RunOptions(collectives="runtime", overlap_step=True))
    assert cfg.check(model) is not None  # an overlapped step under EP runs too
    cfg, model = _config(ep=4, tp=1, options=RunOptions(collectives="runtime"))
    assert cfg.check(model) is not None
    odd = DecoderConfig(**{**TINY.__dict__, "experts": 24})
    cfg = SimConfig(model="unused", gpus=48, tp=2, ep=12, workload=Workload(seq_len=512, global_batch=24))
    with pytest.raises(SpecError, match="ep=12 must divide the 8 GPUs of a node or be a multiple"):
        cfg.check((build_decoder(odd), odd.architecture()))
    cfg, model = _config(ep=16, gpus=32)  # EP groups of two whole nodes: their all-to-alls cross the NICs
    assert cfg.check(model) is not None


@pytest.mark.parametrize("policy", ["canzona", "zero1-gather", "layerwise", "sc"])
def test_under_ep_the_runtime_collectives_mode_issues_the_step_collectives_on_every_rank(policy):
    """`--collectives runtime --ep`: every rank's collectives, the dense part's over DP and the
    experts' over EDP in the order the runtime issues them (backward's merged by layer), are
    `step_collectives` of the simulator's two plans (the runtime's logs are checked against the same
    list: tests/runtime/test_runtime_ep_collectives.py). Small buckets, so that each part has several."""
    from canzona.step_collectives import EDP_GROUP, Experts, step_collectives, step_records
    from sim.engine import issued_records
    from sim.options import RunOptions

    cfg, model = _config(ep=2, gpus=4, tp=1, policy=policy, bucket_size=150_000, workload=Workload(seq_len=512, global_batch=8),
                         options=RunOptions(overlap_param_gather=False, collectives="runtime"))
    result = simulate(cfg, model=model, replicate_phase_a=False)
    spec = model[0]
    for rank in range(4):
        want = step_collectives(result.plan, dense_part(spec), policy, rank, grad_bytes=cfg.workload.grad_bytes,
                                param_bytes=cfg.workload.param_bytes,
                                experts=Experts(result.expert_plan, expert_part(spec, 2), rank // 2))
        assert [tuple(r) for r in issued_records(result.collective_records, rank)] == step_records(want), rank
        groups = [c.group for c in want if c.bucket is not None and c.phase == "backward"]
        assert groups.count("dp") > 1 and groups.count(EDP_GROUP) > 1 and groups != sorted(groups)  # interleaved


@pytest.mark.slow
def test_qwen3_30b_a3b_at_ep_8_canzona_steps_below_layerwise_and_iterates_no_slower():
    """Issue 20's bar, on canzona's own plan (the reported row: tests/sim/test_compare_bar.py)."""
    base = dict(model="qwen3-30b-a3b", gpus=256, tp=4, ep=8, zero1_fallback=False)
    canzona = simulate(SimConfig(**base))
    layerwise = simulate(SimConfig(**base, policy="layerwise"))
    assert canzona.optimizer_step_s < layerwise.optimizer_step_s
    assert canzona.iteration_time_s <= layerwise.iteration_time_s
    assert canzona.fits and canzona.memory.worst.total < simulate(SimConfig(**{**base, "ep": 1})).memory.worst.total
    # with the fallback on, the faster of canzona, zero1-gather and zero1-gather for the dense part alone
    reported = simulate(SimConfig(**{**base, "zero1_fallback": True}))
    assert reported.iteration_time_s <= canzona.iteration_time_s
    assert reported.fell_back_to in (None, "zero1-gather", DENSE_FALLBACK)


@pytest.mark.parametrize("args, needle", [
    (["--model", "qwen3-30b-a3b", "--gpus", "256", "--tp", "4", "--ep", "3"], "ep=3 does not divide the 128 experts"),
    (["--model", "qwen3-8b", "--gpus", "64", "--tp", "8", "--ep", "2"], "has no experts"),
])
def test_cli_ep_errors_are_one_line(args, needle):
    error_line(invoke("simulate", *args), needle)


def test_a_router_histogram_gives_the_busiest_ep_rank_over_the_mean():
    from canzona.experts import router_imbalance

    assert router_imbalance(1.25, 8, 4) == 1.25
    assert router_imbalance([1.0] * 8, 8, 4) == 1.0
    # experts 0-1 on EP rank 0 take half the tokens: 4 EP ranks, mean 1/4, busiest 1/2
    assert router_imbalance([3, 1, 1, 1, 0.5, 0.5, 1, 0], 8, 4) == pytest.approx((4 / 8) / (1 / 4))
    # the message says what is wrong: the count, the first bad value, or all zero
    for bad, needle in ((0.9, ">= 1"), (float("nan"), ">= 1"), ([1.0] * 7, "per expert \\(8\\).*got 7 values"),
                        ([0.0] * 8, "got all zero"), ([1, -1, 1, 1, 1, 1, 1, 1], "non-negative.*got -1$")):
        with pytest.raises(SpecError, match=needle):
            router_imbalance(bad, 8, 4)


def test_an_unbalanced_router_slows_the_expert_layers_only_under_ep():
    balanced, skewed = _run(ep=4), _run(ep=4, router_imbalance=2.0)
    assert skewed.forward_backward_s > balanced.forward_backward_s
    # at EP 1 every rank computes every expert on its own tokens: there is nothing to wait for
    cfg, model = _config(ep=1, router_imbalance=2.0)
    with pytest.raises(SpecError, match="a router imbalance needs expert parallelism"):
        cfg.check(model)


@pytest.mark.parametrize("value, needle", [
    ("0.5", "router imbalance must be a number >= 1"),
    ("1,2", "one non-negative share per expert (128)"),
    ("x", "--router-imbalance takes a number or comma-separated numbers"),
])
def test_cli_router_imbalance_errors_are_one_line(value, needle):
    error_line(invoke("simulate", "--model", "qwen3-30b-a3b", "--gpus", "256", "--tp", "4", "--ep", "8",
                      "--router-imbalance", value), needle)


def test_plan_under_ep_plans_the_dense_part_and_the_experts_with_the_same_policies(tmp_path):
    import json

    result = invoke("plan", "--model", "qwen3-30b-a3b", "--dp", "8", "--tp", "2", "--ep", "4", "--json")
    assert result.exit_code == 0, result.stdout
    both = json.loads(result.stdout)
    # the dense part's plan, holding the experts' (one plan file)
    assert (both["dp_size"], both["tp_size"], both["ep_size"], both["etp_size"]) == (8, 2, 4, 1)
    assert (both["experts"]["dp_size"], both["experts"]["tp_size"]) == (4, 1)  # EDP = 8 x 2 / 4
    assert both["experts"]["dp"]["policy"] == both["dp"]["policy"] == "alpha-balanced-reorder"
    tables = invoke("plan", "--model", "qwen3-30b-a3b", "--dp", "8", "--tp", "2", "--ep", "4")
    assert tables.exit_code == 0 and "experts / ep 4, dp=4, tp=1" in tables.stdout.replace("\n", " ")
    written = invoke("plan", "--model", "qwen3-30b-a3b", "--dp", "8", "--tp", "2", "--ep", "4", "--json",
                     "--out", str(tmp_path / "p.json"))
    assert written.exit_code == 0 and json.loads(written.stdout) == both
    assert json.loads((tmp_path / "p.json").read_text())["layout"] == {"dp": 8, "tp": 2, "ep": 4, "etp": 1}
    error_line(invoke("plan", "--model", "qwen3-8b", "--dp", "8", "--tp", "2", "--ep", "2"), "has no experts")


def test_the_experts_adamw_and_gradient_norm_are_simulated_under_ep():
    """AdamW on every parameter: the experts' pieces are updated on their EDP ranks (the step the
    memory model counts state for), and the gradient norm covers them too."""
    for ep in (1, 4):
        spans = [s for s in _run(ep=ep, optimizer="adamw", policy="zero1").spans if s.phase == "B" and s.rank == 0]
        adamw = sum(s.end - s.start for s in spans if s.name == "adamw step")
        norms = [s for s in spans if s.name == "gradient norm"]
        assert adamw > 0 and len(norms) == (2 if ep > 1 else 1)


def test_a_pipeline_stage_without_experts_has_no_expert_part():
    cfg = DecoderConfig(**{**TINY.__dict__, "dense_layers": (0, 1)})
    config = SimConfig(model="unused", gpus=16, tp=2, pp=2, ep=4, workload=WL)
    assert simulate(config, model=(build_decoder(cfg), cfg.architecture())).iteration_time_s > 0


def test_the_architecture_and_the_stacks_must_agree_on_the_experts():
    from canzona.decoder import Architecture

    arch = Architecture("tiny-moe", 4, 256, 1024, 256, experts=8, experts_per_token=2)
    cfg, _ = _config()
    with pytest.raises(SpecError, match="has 16 experts, but the architecture of 'tiny-moe' says 8"):
        cfg.check((build_decoder(TINY), arch))
