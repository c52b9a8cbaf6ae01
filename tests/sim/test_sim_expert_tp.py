"""Expert tensor parallelism in the simulator (issue 20): the expert order of the GPUs (ETP
fastest, then EP, then EDP), the ETP group's all-gather and reduce-scatter around the grouped
GEMMs, the expert step's micro-groups priced on the ETP groups' links, the memory divided by ETP,
the CLI, and the expert plan's choices (bucket sizing, micro-group capacity) picked by simulated
cost."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from canzona.decoder import DecoderConfig, build_decoder
from canzona.errors import SpecError
from canzona.plan import BATCH_CAPACITY
from canzona.spec import Role
from sim.simulate import ExpertChoice, SimConfig, expert_choices, simulate
from sim.topology import Cluster
from sim.workload import Workload
from tests.cli_helpers import error_line, invoke

TINY = DecoderConfig("tiny-moe", 4, 256, 4, 4, 64, 512, 1024, False, experts=16, experts_per_token=2, moe_ffn=128)
WL = Workload(seq_len=512, global_batch=16)
MODEL = (build_decoder(TINY), TINY.architecture())


def _config(**changes) -> SimConfig:
    return SimConfig(**{**dict(model="unused", gpus=16, tp=2, workload=WL, zero1_fallback=False), **changes})


def _run(**changes):
    return simulate(_config(**changes), model=MODEL)


def test_the_expert_order_puts_etp_fastest_then_ep_then_edp():
    cl = Cluster(32, 2, 8, ep=4)  # Megatron's expert RankGenerator: order tp-ep-dp, tp = ETP
    assert cl.dp == 4 and cl.stage_gpus == 32
    assert cl.tp_group(1, 0, 2) == [12, 13]  # ETP: consecutive
    assert cl.ep_group(1, 1) == [9, 11, 13, 15]  # EP: one ETP position of 4 consecutive ETP groups
    assert cl.dp_group(1, 0, 2) == [5, 13, 21, 29]  # EDP: stride ep x etp
    assert sorted(r for g in cl.tp_groups() for r in g) == list(range(32))
    assert sorted(r for g in cl.ep_groups() for r in g) == sorted(r for g in cl.dp_groups() for r in g)
    assert [cl.dp_index(r) for r in (0, 7, 8, 31)] == [0, 0, 1, 3]
    assert cl.ep_geometry().nodes == 1 and Cluster(32, 2, 4, ep=4).ep_geometry().nodes == 2
    with pytest.raises(SpecError, match="ep x etp = 3 x 2 must divide the 8 GPUs of a node or be a multiple"):
        Cluster(48, 2, 8, ep=3)
    with pytest.raises(SpecError, match="etp=16 must divide the 8 GPUs of a node"):
        Cluster(32, 16, 8, ep=2)


def test_the_etp_groups_gather_and_reduce_scatter_the_pairs_around_the_grouped_gemms():
    two, one = _run(ep=4, etp=2), _run(ep=4)
    spans = [s for s in two.spans if s.phase == "A"]
    gathers = [s for s in spans if s.name.endswith("etp all-gather")]
    scatters = [s for s in spans if s.name.endswith("etp reduce-scatter")]
    micro_batches = WL.micro_batches(16 // 2)
    assert len(gathers) == len(scatters) == 2 * TINY.layers * micro_batches  # forward and backward
    assert all(s.stream == "etp-comm" and s.end > s.start for s in gathers + scatters)
    assert not any("etp" in s.name for s in one.spans)
    # each rank computes its ETP group's pairs on its half of the weights: the same FLOPs, in taller
    # and thinner GEMMs, so the expert blocks take about as long
    def experts_s(result):
        return sum(s.end - s.start for s in result.spans if s.phase == "A" and s.rank == 0
                   and s.kind == "compute" and s.name.endswith("experts"))
    assert 0.5 < experts_s(two) / experts_s(one) < 2.0


def test_the_expert_step_runs_micro_groups_on_the_etp_groups_links():
    canzona = _run(ep=4, etp=2)
    step = [s for s in canzona.spans if s.phase == "B" and s.stream == "etp-comm"]
    assert {s.name.split()[-1] for s in step} == {"gather", "scatter"}  # canzona: all-to-alls to and from hosts
    assert {s.rank for s in step} == set(range(16))
    baseline = _run(ep=4, etp=2, policy="zero1-gather")
    synced = [s for s in baseline.spans if s.phase == "B" and s.stream == "etp-comm"]
    assert synced and {s.name.split()[-1] for s in synced} == {"all-gather"}  # tp-sync: every shard everywhere
    # tp-sync computes every expert matrix on both ETP ranks; canzona hosts each once. At this toy
    # size a GEMM's fixed costs (launch and latency, docs/design.md §4.3) are most of its time and
    # canzona runs its matrices in more micro-groups, so the saving is below the FLOPs' half (0.77)
    def expert_compute(result):
        return max(sum(s.end - s.start for s in result.spans if s.phase == "B" and s.rank == r and
                       s.kind == "compute" and s.name.startswith("group")) for r in range(16))
    assert expert_compute(canzona) < 0.8 * expert_compute(baseline)
    assert canzona.expert_plan is not None and (canzona.expert_plan.dp, canzona.expert_plan.tp) == (2, 2)
    assert not any(s.stream == "etp-comm" for s in _run(ep=4).spans)  # ETP 1: nothing exchanged


def test_etp_divides_the_expert_weights_per_gpu():
    one, two = _run(ep=4), _run(ep=4, etp=2)
    expert_bytes = sum(p.numel for p in MODEL[0].params if p.role is Role.EXPERT) * 2
    # each GPU holds a quarter of the experts (EP 4), and at ETP 2 half of each
    saved = one.memory.worst.weights - two.memory.worst.weights
    assert saved == pytest.approx(expert_bytes / 4 / 2, rel=0.05)
    assert two.memory.worst.grads < one.memory.worst.grads


def test_a_bad_etp_is_one_spec_error_from_the_api():
    narrow = DecoderConfig(**{**TINY.__dict__, "moe_ffn": 132})  # 132-wide experts: etp 8 cannot split them
    for changes, model, needle in (
            ({"ep": 4, "etp": 3}, MODEL, "ep x etp = 4 x 3 does not divide the dp x tp = 8 x 2"),
            ({"etp": 2}, MODEL, "etp=2 needs expert parallelism (ep > 1)"),
            ({"ep": 2, "etp": 8}, (build_decoder(narrow), narrow.architecture()), "etp=8 does not divide the 132 rows"),
            ({"ep": 4, "etp": 2, "expert_buckets": "whole"}, MODEL, "unknown expert bucket sizing")):
        with pytest.raises(SpecError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            _config(**changes).check(model)


@pytest.mark.parametrize("args, needle", [
    (["--ep", "8", "--etp", "3"], "ep x etp = 8 x 3 does not divide the dp x tp = 64 x 4"),
    (["--etp", "2"], "etp=2 needs expert parallelism (ep > 1)"),
    (["--ep", "8", "--etp", "0"], "etp must be a whole number >= 1"),
    (["--ep", "8", "--etp", "2", "--expert-buckets", "whole"], "unknown expert bucket sizing 'whole'"),
])
def test_cli_etp_errors_are_one_line(args, needle):
    base = ["--model", "qwen3-30b-a3b", "--gpus", "256", "--tp", "4"]
    for command in ("simulate", "compare"):
        error_line(invoke(command, *base, *args), needle)
    plan = ["--model", "qwen3-30b-a3b", "--dp", "64", "--tp", "4"]
    error_line(invoke("plan", *plan, *args), needle)


def test_cli_etp_that_does_not_divide_the_expert_width_is_one_line():
    needle = "etp=5 does not divide the 768 rows of the 768 x 2048 matrices of expert stack"
    error_line(invoke("simulate", "--model", "qwen3-30b-a3b", "--gpus", "320", "--tp", "4", "--ep", "2", "--etp", "5",
                      "--global-batch", "160"),
               needle)
    error_line(invoke("plan", "--model", "qwen3-30b-a3b", "--dp", "80", "--tp", "4", "--ep", "2", "--etp", "5"), needle)


def test_plan_under_etp_plans_the_experts_over_edp_x_etp():
    result = invoke("plan", "--model", "qwen3-30b-a3b", "--dp", "8", "--tp", "2", "--ep", "4", "--etp", "2", "--json")
    assert result.exit_code == 0, result.stdout
    both = json.loads(result.stdout)
    assert (both["experts"]["dp_size"], both["experts"]["tp_size"]) == (2, 2)  # EDP = 8 x 2 / (4 x 2)
    assert both["experts"]["tp"]["policy"] == "greedy-rollback"


def test_the_expert_plans_simulated_are_the_sizings_and_capacities_that_differ():
    cfg = _config(ep=4, etp=2)
    cluster = cfg.check(MODEL)
    # the default bucket size already holds whole multiples of EDP: one sizing; canzona under ETP also
    # tries micro-groups of one batch a host
    assert expert_choices(cfg, MODEL, cluster) == [ExpertChoice(), ExpertChoice(capacity=BATCH_CAPACITY)]
    assert expert_choices(_config(ep=4, etp=2, policy="zero1-gather"), MODEL, cluster) == [ExpertChoice()]
    assert expert_choices(_config(ep=4), MODEL, cluster) == [ExpertChoice()]
    # the default is the runtime's sizing; `auto` also tries each sizing whose buckets differ
    odd = _config(ep=4, etp=2, bucket_size=3 * 128 * 256 // 2, policy="zero1-gather", expert_buckets="auto")
    assert expert_choices(odd, MODEL, cluster) == [ExpertChoice(), ExpertChoice(buckets="dp-multiple")]
    assert expert_choices(replace(odd, expert_buckets="size"), MODEL, cluster) == [ExpertChoice()]
    assert expert_choices(_config(ep=4, etp=2, expert_buckets="size", capacity=BATCH_CAPACITY), MODEL, cluster) == \
        [ExpertChoice()]
    assert expert_choices(_config(expert_buckets="dp-multiple"), MODEL, cluster) == [ExpertChoice(buckets="dp-multiple")]
    # the reported run is the fastest of them, and says which it was
    chosen = simulate(odd, model=MODEL)
    each = [simulate(_config(ep=4, etp=2, bucket_size=odd.bucket_size, policy="zero1-gather", expert_buckets=b),
                     model=MODEL) for b in ("size", "dp-multiple")]
    assert chosen.iteration_time_s == min(r.iteration_time_s for r in each)
    assert chosen.to_dict()["expert_buckets"] == min(each, key=lambda r: r.iteration_time_s).expert_choice.buckets


def test_even_expert_segments_spare_zero1_gather_its_redundant_expert_work():
    base = dict(ep=4, etp=2, bucket_size=3 * 128 * 256 // 2, policy="zero1-gather")
    sized, even = _run(**base, expert_buckets="size"), _run(**base, expert_buckets="dp-multiple")
    assert sized.expert_plan.dp_plan.metrics.redundant_s > 0
    assert even.expert_plan.dp_plan.metrics.redundant_s == 0
    assert even.optimizer_step_s < sized.optimizer_step_s
