"""Expert tensor parallelism (issue 20) and the sizing of expert buckets, in the policy core: how an
EP rank's experts split over ETP, the plan over EDP x ETP (whole-matrix owners over EDP, hosts and
micro-groups within each ETP group), the checks of a bad `etp`, the refusal where a job would run
an ETP plan, and expert buckets sized in whole multiples of DP alike matrices."""

from __future__ import annotations

import math

import pytest

from canzona.catalog import get_config
from canzona.decoder import DecoderConfig, build_decoder
from canzona.dp.layout import DPItem, make_buckets
from canzona.errors import PlanError, SpecError
from canzona.experts import check_ep, expert_part, expert_tp_dim
from canzona.memory import LayerDims, memory_per_gpu
from canzona.plan import bucket_names, check_plan_matches, make_plan, plan_for
from canzona.spec import ModelSpec, ParamSpec, Role
from canzona.step_policies import get_step_policy
from canzona.step_schedule import ALL_GATHER, ALL_TO_ALL, tp_schedule
from canzona.tp import EVERY_RANK

TINY = DecoderConfig("tiny-moe", 4, 256, 4, 4, 64, 512, 1024, False, experts=16, experts_per_token=2, moe_ffn=128)
HIDDEN = 256


def _experts(ep: int = 4, etp: int = 2) -> ModelSpec:
    return expert_part(build_decoder(TINY), ep, etp, HIDDEN)


def test_expert_tp_splits_gate_and_up_by_rows_and_down_by_columns():
    spec = build_decoder(get_config("qwen3-30b-a3b"))
    part = expert_part(spec, 8, 2, 2048)
    gate_up, down = part.params[0], part.params[1]
    assert (gate_up.shape, gate_up.tp_dim, gate_up.local_shape(2)) == ((16, 1536, 2048), 1, (16, 768, 2048))
    assert (down.shape, down.tp_dim, down.local_shape(2)) == ((16, 2048, 768), 2, (16, 2048, 384))
    # every matrix of a stack is split along the same axis: gate / up rows (column-parallel), down columns
    gate = part.param(f"{gate_up.name}[0]")
    assert (gate.shape, gate.tp_dim, gate.local_shape(2)) == ((768, 2048), 0, (384, 2048))
    assert part.param(f"{down.name}[0]").local_shape(2) == (2048, 384)
    # the shards hold half of every expert matrix: one EP rank's experts, 1 / etp of them per GPU
    assert sum(p.local_numel(2) for p in part.matrix_params()) * 2 == sum(p.numel for p in part.matrix_params())
    # at etp 1 the expert part is as before: whole stacks
    assert all(p.tp_dim is None for p in expert_part(spec, 8).params)


def test_square_experts_are_told_apart_by_name_and_a_stack_without_the_hidden_size_is_an_error():
    up = ParamSpec("layers.0.experts.w1", (4, 8, 8), Role.EXPERT, matrix_shape=(8, 8))
    down = ParamSpec("layers.0.experts.w2", (4, 8, 8), Role.EXPERT, matrix_shape=(8, 8))
    assert (expert_tp_dim(up, 8), expert_tp_dim(down, 8)) == (1, 2)
    odd = ParamSpec("layers.0.experts.w1", (4, 6, 10), Role.EXPERT, matrix_shape=(6, 10))
    with pytest.raises(SpecError, match="neither dimension of its 6 x 10 matrices is the hidden size 8"):
        expert_tp_dim(odd, 8)


def test_a_stack_is_split_along_its_matrices_only_and_a_model_keeps_its_stacks_whole():
    with pytest.raises(SpecError, match="would split the stack's experts"):
        ParamSpec("w", (4, 6, 8), Role.EXPERT, tp_dim=0, matrix_shape=(6, 8))
    split = ParamSpec("w", (4, 12, 8), Role.EXPERT, tp_dim=1, matrix_shape=(6, 8))  # two 6 x 8 per expert
    with pytest.raises(SpecError, match="tp=4 does not divide the 6 rows of each 6 x 8 matrix of stack 'w'"):
        split.local_shape(4)  # 12 rows divide, each matrix's 6 do not
    assert split.local_shape(2) == (4, 6, 8)
    from canzona.experts import check_experts

    with pytest.raises(SpecError, match="cannot be split by TP in a model"):
        check_experts(ModelSpec("m", (split,)), (4, 1))


def test_check_ep_gives_the_edp_size_of_ep_x_etp():
    spec = build_decoder(get_config("qwen3-30b-a3b"))
    assert check_ep(spec, 8, 64, 4, 2, 2048) == 16  # 256 GPUs = 16 EDP x 8 EP x 2 ETP
    assert check_ep(spec, 8, 64, 4, 1, 2048) == check_ep(spec, 8, 64, 4) == 32


@pytest.mark.parametrize("ep, etp, dp, tp, needle", [
    (8, 3, 64, 4, "ep x etp = 8 x 3 does not divide the dp x tp = 64 x 4 GPUs"),
    (1, 2, 64, 4, "etp=2 needs expert parallelism (ep > 1)"),
    (8, 0, 64, 4, "etp must be a whole number >= 1"),
    (8, True, 64, 4, "etp must be a whole number >= 1"),
    (2, 5, 80, 4, "etp=5 does not divide the 768 rows of the 768 x 2048 matrices of expert stack"),
])
def test_a_bad_etp_is_one_spec_error(ep, etp, dp, tp, needle):
    with pytest.raises(SpecError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        check_ep(build_decoder(get_config("qwen3-30b-a3b")), ep, dp, tp, etp, 2048)


def test_the_expert_plan_owns_whole_matrices_over_edp_and_hosts_them_within_each_etp_group():
    part = _experts()
    plan = plan_for(part, 2, 2, "muon", "canzona")  # EDP 2 x ETP 2 (16 GPUs, EP 4)
    dpp = plan.dp_plan
    for b in dpp.buckets:
        for p in b.params:
            assert list(dpp.computing_ranks(b, p)) == [p.owner]  # one EDP owner, whole
            assert p.numel * 2 == math.prod(part.param(p.name).shape)  # its gradient buffer holds one shard
    hosted = {}
    for rank, groups in enumerate(plan.tp_plan.groups):
        for g in groups:
            assert all(0 <= h < 2 for h in g.hosts)
            hosted.update({t: (rank, h) for t, h in zip(g.tasks, g.hosts)})
    assert set(hosted) == {p.name for p in part.matrix_params()}  # every matrix computed once in the cluster
    assert {h for _, h in hosted.values()} == {0, 1}  # both ETP ranks host some
    # the micro-groups' exchanges move the shards over the ETP group: each task's other shard to its host
    policy = get_step_policy("canzona")
    schedule = tp_schedule(plan, part, policy, 0)
    for g in schedule.groups:
        assert g.gather.op == g.scatter.op == ALL_TO_ALL
        for t in g.tasks:
            assert t.tp_dim in (0, 1) and t.shard_numel * 2 == math.prod(t.shape)
        assert g.gather.total_bytes == sum(t.shard_numel * 4 for t in g.tasks)
    # the baselines all-gather every shard over ETP and compute every matrix on both ranks
    sync = tp_schedule(plan_for(part, 2, 2, "muon", "zero1-gather"), part, get_step_policy("zero1-gather"), 0)
    assert all(t.host == EVERY_RANK for g in sync.groups for t in g.tasks)
    assert {g.gather.op for g in sync.groups} == {ALL_GATHER}


def test_expert_memory_is_divided_by_etp_where_it_lies():
    dims = LayerDims(TINY.layers, TINY.hidden, 4, 2 * 128, TINY.vocab, 4, 64)

    def worst(etp: int, policy: str):
        part = _experts(4, etp)
        edp = 4 // etp  # 16 GPUs: EDP x EP 4 x ETP
        return memory_per_gpu(part, plan_for(part, edp, etp, "muon", policy), policy, dims).worst

    one, two = worst(1, "canzona"), worst(2, "canzona")
    expert_bytes = sum(p.numel for p in _experts(4, 1).params) * 2  # bf16 weights of one EP rank's experts
    # weights and gradient buffers (whole on every EDP rank, as ZeRO-1 keeps them): the ETP shards
    assert one.weights == pytest.approx(expert_bytes, rel=0.01)
    assert two.weights == pytest.approx(one.weights / 2, rel=0.01) and two.grads == pytest.approx(one.grads / 2, rel=0.01)
    # state: canzona hosts each matrix on one ETP rank of its EDP owner, 1 / (EDP x ETP) of them a GPU,
    # as many as at ETP 1 over twice the EDP ranks; tp-sync keeps every matrix's state on both ETP ranks
    assert two.matrix_state == pytest.approx(one.matrix_state, rel=0.1)
    assert worst(2, "zero1-gather").matrix_state == pytest.approx(2 * two.matrix_state, rel=0.1)


def test_a_job_refuses_a_plan_whose_stacks_are_split_by_tp():
    """The runtime checks every plan against its model and layout (`check_plan_matches`, as
    `DistributedOptimizer` does): a stack split by TP is expert TP, which no runtime runs yet."""
    part = _experts()
    plan = make_plan(part, 2, 2)
    check_plan_matches(plan, part)  # the simulator's and the memory model's check: the same model
    with pytest.raises(PlanError, match="expert tensor parallelism is planned and simulated, not run"):
        check_plan_matches(plan, part, dp=2, tp=2)
    check_plan_matches(make_plan(part, 2, 1), part, dp=2, tp=1)  # at TP 1 nothing is split


def test_expert_buckets_in_multiples_of_dp_alike_matrices_make_even_segments_whole():
    items = [DPItem(f"s[{k}]", 100, 1.0, 0, stack="s") for k in range(40)]
    assert [len(b) for b in make_buckets(items, 1000)] == [10] * 4  # filled to the size
    assert [len(b) for b in make_buckets(items, 1000, stack_multiple=4)] == [8] * 5  # 2 x dp
    assert [len(b) for b in make_buckets(items, 1000, stack_multiple=16)] == [16, 16, 8]  # at least dp
    assert [len(b) for b in make_buckets(items[:20] + [DPItem("w", 50, 1.0, 0)], 1000, 4)] == [1, 8, 8, 4]
    # zero1-even then cuts between whole matrices: nothing computed twice, nothing fetched
    part = _experts()
    size = 6 * 128 * 256 // 2  # six ETP shards: not a multiple of EDP 4's alike matrices
    sized = make_plan(part, 4, 2, dp_policy="zero1-even", bucket_size=size)
    even = make_plan(part, 4, 2, dp_policy="zero1-even", bucket_size=size, expert_buckets="dp-multiple")
    assert sized.dp_plan.metrics.redundant_s > 0 and not sized.dp_plan.metrics.atomic
    assert even.dp_plan.metrics.redundant_s == 0 and even.dp_plan.metrics.atomic
    assert even.dp_plan.metrics.extra_comm_elements == 0
    assert all(len(b.params) % 4 == 0 for b in even.dp_plan.buckets)
    assert bucket_names(part, 4, 2, size) != bucket_names(part, 4, 2, size, "dp-multiple")
    with pytest.raises(SpecError, match="unknown expert bucket sizing 'whole'"):
        make_plan(part, 4, 2, expert_buckets="whole")


def test_the_plan_the_runtime_makes_is_unchanged_by_the_expert_bucket_option():
    """The default settings (the runtime's and the simulator's default) size expert buckets as before."""
    from canzona.plan import PLAN_DEFAULTS, PlanSettings

    spec = build_decoder(TINY)
    assert PLAN_DEFAULTS.expert_buckets == "size"
    assert plan_for(spec, 4, 2, "muon", "canzona").hash() == \
        plan_for(spec, 4, 2, "muon", "canzona", PlanSettings(expert_buckets="size")).hash()
