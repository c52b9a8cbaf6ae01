"""Megatron's token dispatchers under expert parallelism (sim.ep_dispatch): the expected number of
ranks and nodes a token reaches, the flex dispatcher's pricing, its options and the published rows'
settings."""

from __future__ import annotations

import math
from dataclasses import replace
from itertools import combinations

import pytest

from canzona.errors import SpecError
from canzona.hardware import load_profile
from canzona.routing import busiest_rank
from sim import published
from sim.collectives import FREE, all_to_all_cost, collective_cost
from sim.ep_dispatch import (
    DEEPEP,
    HYBRIDEP,
    EpDispatcher,
    FlexTraffic,
    alltoall_cost,
    ep_costs,
    expected_groups,
    flex_costs,
    group_hit,
    hybridep_permute_s,
    hybridep_preprocess_cost,
    measurement,
)
from sim.options import RunOptions
from sim.topology import Cluster

H100 = load_profile("h100-sxm")
RUNS = {r.id: r for r in published.load()[0]}


def _brute(experts: int, groups: int, k: int) -> float:
    """Mean distinct groups over every k-subset of the experts (contiguous equal groups)."""
    per = experts // groups
    subsets = list(combinations(range(experts), k))
    return sum(len({e // per for e in s}) for s in subsets) / len(subsets)


@pytest.mark.parametrize(("experts", "groups", "k"), [(8, 4, 3), (12, 3, 4), (10, 5, 2), (6, 2, 6)])
def test_expected_groups_is_the_mean_over_every_choice_of_experts(experts, groups, k):
    assert expected_groups(experts, groups, k) == pytest.approx(_brute(experts, groups, k), rel=1e-12)


def test_expected_groups_closed_forms():
    assert expected_groups(128, 1, 8) == 1.0  # one group always
    assert expected_groups(128, 128, 8) == pytest.approx(8.0)  # each expert its own group: k groups
    assert expected_groups(128, 16, 1) == pytest.approx(1.0)  # one expert: one group
    # Qwen3-30B-A3B (128 experts, top-8) on two nodes: each node missed with C(64, 8) / C(128, 8)
    miss = math.prod((64 - i) / (128 - i) for i in range(8))
    assert expected_groups(128, 2, 8) == pytest.approx(2 * (1 - miss))
    assert expected_groups(128, 2, 8) == pytest.approx(1.99381, abs=1e-5)
    assert expected_groups(128, 16, 8) == pytest.approx(6.5965, abs=1e-4)  # EP 16: ranks reached
    assert group_hit(128, 8, 8) == pytest.approx(expected_groups(128, 8, 8) / 8)
    with pytest.raises(SpecError, match="groups must divide"):
        expected_groups(128, 3, 8)


def test_dispatcher_options_error_lines():
    EpDispatcher().check()
    EpDispatcher(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep").check()
    cases = [
        (dict(moe_token_dispatcher_type="allgather"), "unknown --moe-token-dispatcher-type 'allgather'; choose one of "
                                                      "alltoall, flex"),
        (dict(moe_token_dispatcher_type="flex"), "--moe-token-dispatcher-type flex needs --moe-flex-dispatcher-backend"),
        (dict(moe_flex_dispatcher_backend="deepep"), "--moe-flex-dispatcher-backend deepep is for "
                                                     "--moe-token-dispatcher-type flex"),
        (dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="nccl"),
         "unknown --moe-flex-dispatcher-backend 'nccl'; choose one of deepep, hybridep"),
        # an unknown backend is named as unknown, not as one that needs the flex dispatcher
        (dict(moe_flex_dispatcher_backend="nope"), "unknown --moe-flex-dispatcher-backend 'nope'"),
        (dict(moe_hybridep_num_sms=0), "--moe-hybridep-num-sms must be a whole number of SMs >= 1, got 0"),
    ]
    for kwargs, message in cases:
        with pytest.raises(SpecError) as e:
            EpDispatcher(**kwargs).check()
        assert message in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SpecError, match="needs --moe-flex-dispatcher-backend"):
        RunOptions(ep_dispatcher=EpDispatcher(moe_token_dispatcher_type="flex")).check()


def test_the_published_rows_record_their_recipes_dispatchers():
    mb, am = RUNS["qwen3-30b-a3b-16xh100-mb"], RUNS["qwen3-30b-a3b-8xh100-automodel"]
    assert mb.ep_dispatcher == EpDispatcher(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep",
                                            moe_hybridep_num_sms=32)
    assert "moe_hybridep_num_sms = 32" in mb.recipe_source
    assert am.ep_dispatcher.moe_flex_dispatcher_backend == DEEPEP and "dispatcher: deepep" in am.recipe_source
    assert mb.sim_config().options.ep_dispatcher == mb.ep_dispatcher
    dense = RUNS["qwen3-8b-16xh100-mb"]
    assert dense.ep_dispatcher == EpDispatcher() and dense.sim_config().options.ep_dispatcher == EpDispatcher()


def test_a_row_with_a_bad_dispatcher_is_one_error_line():
    raw = {"id": "x", "model": "qwen3-30b-a3b", "source": "s", "hardware": "h100-sxm", "gpus": 16, "tp": 1, "pp": 1,
           "vp": 1, "cp": 1, "ep": 16, "global_batch": 16, "micro_batch": 1, "seq_len": 4096, "precision": "bf16",
           "optimizer": "adamw", "published": {"tokens_per_s_per_gpu": 1.0, "original": {"value": 1.0, "unit": "u"}},
           "moe_token_dispatcher_type": "flex", "recipe_source": "https://example.org/r"}
    with pytest.raises(SpecError, match=r"^row x: --moe-token-dispatcher-type flex needs"):
        published.parse_run(raw, {"s": {"url": "https://example.org", "title": "t"}}, "row x")
    bad_sms = {**raw, "moe_flex_dispatcher_backend": "hybridep", "moe_hybridep_num_sms": 0}
    with pytest.raises(SpecError, match=r"^row x: --moe-hybridep-num-sms must be .* got 0$"):
        published.parse_run(bad_sms, {"s": {"url": "https://example.org", "title": "t"}}, "row x")
    odd_deepep = {**raw, "moe_flex_dispatcher_backend": "deepep", "moe_deepep_num_sms": 21}
    with pytest.raises(SpecError, match=r"^row x: --moe-deepep-num-sms must be an even number .* got 21$"):
        published.parse_run(odd_deepep, {"s": {"url": "https://example.org", "title": "t"}}, "row x")
    deepep_sms_under_hybridep = {**raw, "moe_flex_dispatcher_backend": "hybridep", "moe_deepep_num_sms": 24}
    with pytest.raises(SpecError, match=r"^row x: --moe-deepep-num-sms 24 is DeepEP's"):
        published.parse_run(deepep_sms_under_hybridep, {"s": {"url": "https://example.org", "title": "t"}}, "row x")
    row = published.parse_run({**raw, "moe_flex_dispatcher_backend": "deepep", "moe_deepep_num_sms": 24},
                              {"s": {"url": "https://example.org", "title": "t"}}, "row x")
    assert row.ep_dispatcher.moe_deepep_num_sms == 24 == row.ep_dispatcher.sms


def _experts(gpus: int, ep: int) -> Cluster:
    return Cluster(gpus, 1, 8, ep=ep)


def _qwen3_moe_layer() -> list:
    """Qwen3-30B-A3B's first layer's stacked expert weights (128 experts of 768 x 2048 each)."""
    from canzona.models import resolve_model
    from sim.model_work import _is_expert_gemm

    return [p for p in resolve_model("qwen3-30b-a3b")[0].params if p.layer == 0 and _is_expert_gemm(p)]


def test_alltoall_is_every_pair_as_before():
    cl = _experts(16, 16)
    sent, received = 100e6, 120e6
    d, c = ep_costs(sent, received, None, cl, H100)
    assert d == c == alltoall_cost(sent, received, cl, H100)
    assert d == all_to_all_cost([sent] * 16, [received] + [sent] * 15, cl.ep_geometry(), H100)


def test_flex_across_nodes_is_priced_at_hybridep_published_h100_bandwidth():
    tokens, hidden = 4096, 2048  # the Megatron-Bridge row: one micro-batch's tokens on a rank, bf16
    t = FlexTraffic(HYBRIDEP, 32, tokens * hidden * 2, 128, 8)
    d, c = flex_costs(t, _experts(16, 16), H100)
    logical = tokens * hidden * 2 * expected_groups(128, 2, 8)
    assert d.seconds == pytest.approx(logical / 54.47e9) and c.seconds == pytest.approx(logical / 53.35e9)
    # 32 SMs: past the table's 16, whose row stands (the bandwidth levelled off from 8 SMs)
    assert measurement(HYBRIDEP, "h100-sxm", 16, 32) == measurement(HYBRIDEP, "h100-sxm", 16, 16)
    slow, _ = flex_costs(replace(t, sms=4), _experts(16, 16), H100)
    assert slow.seconds == pytest.approx(logical / 37.08e9)
    # an unbalanced router: the busiest rank's share
    assert flex_costs(replace(t, imbalance=1.5), _experts(16, 16), H100)[0].seconds == pytest.approx(1.5 * d.seconds)
    # against every pair on the NIC (the alltoall dispatcher), far less
    pairs = tokens * 8 * hidden * 2 * 15 / 16
    assert d.seconds < 0.5 * alltoall_cost(pairs, pairs, _experts(16, 16), H100).seconds


def test_hybridep_preprocessing_on_the_forward_dispatch_only():
    """The forward's dispatch all-gathers the routing map (a byte per token and expert, from every EP
    rank), scans it and syncs the host; the combine, the backward's dispatch and DeepEP do not."""
    tokens, hidden, cl = 4096, 2048, _experts(16, 16)
    back = FlexTraffic(HYBRIDEP, 32, tokens * hidden * 2, 128, 8, 1.0, tokens)
    fwd = replace(back, forward=True)
    pre = hybridep_preprocess_cost(fwd, cl, H100)
    gather = collective_cost("all-gather", tokens * 128 * 16, cl.ep_geometry(), H100)
    scan = tokens * 128 * 16 / H100.gpu.hbm_achievable_bytes_per_s
    assert pre.seconds == pytest.approx(gather.seconds + scan + 2 * H100.gpu.launch_s)
    assert gather.link == "network" and pre.seconds > gather.seconds
    (d_fwd, c_fwd), (d_back, c_back) = flex_costs(fwd, cl, H100), flex_costs(back, cl, H100)
    assert d_fwd.seconds == pytest.approx(d_back.seconds + pre.seconds) and c_fwd == c_back
    assert hybridep_preprocess_cost(back, cl, H100) == FREE
    assert hybridep_preprocess_cost(replace(fwd, backend=DEEPEP), cl, H100) == FREE
    assert hybridep_preprocess_cost(fwd, _experts(16, 1), H100) == FREE
    # inside one node the gather stays on NVLink, and is cheaper
    inside = hybridep_preprocess_cost(fwd, _experts(8, 8), H100)
    assert inside.link == "nvlink" and inside.seconds < pre.seconds


def test_measurement_choice():
    assert measurement(HYBRIDEP, "h100-sxm", 128, 16).ranks == 64  # nearest measured rank count
    assert measurement(HYBRIDEP, "h100-sxm", 8, 16).ranks == 16
    assert measurement(HYBRIDEP, "h100-sxm", 32, 8).dispatch == pytest.approx(46.54e9)
    assert measurement(HYBRIDEP, "h100-sxm", 16, 2).sms == 4  # below every measured SM count: the smallest
    assert measurement(DEEPEP, "h100-sxm", 16, 0).combine == pytest.approx(43e9)
    assert measurement(DEEPEP, "h200", 16, 20).dispatch == pytest.approx(40.89e9)  # issue #493, 2 x 8 H200
    assert measurement(HYBRIDEP, "a100-sxm", 16, 16) is None and measurement(HYBRIDEP, "h200", 16, 16) is None


def test_flex_inside_a_node_sends_each_token_once_per_rank():
    cl = _experts(8, 8)
    token_bytes = 4096 * 2048 * 2.0
    d, c = flex_costs(FlexTraffic(DEEPEP, 0, token_bytes, 128, 8), cl, H100)
    once = token_bytes * 7 * group_hit(128, 8, 8)  # each of the 7 others it reaches
    assert d == c == alltoall_cost(once, once, cl, H100)
    pairs = token_bytes * 8 * 7 / 8
    assert d.seconds < alltoall_cost(pairs, pairs, cl, H100).seconds


def test_flex_across_nodes_without_a_measurement_is_modelled():
    a100 = load_profile("a100-sxm")
    cl = _experts(16, 16)
    token_bytes = 4096 * 2048 * 2.0
    d, _ = flex_costs(FlexTraffic(HYBRIDEP, 16, token_bytes, 128, 8), cl, a100)
    remote = token_bytes * group_hit(128, 2, 8)  # one copy to the other node, on the NIC
    total = token_bytes * 15 * group_hit(128, 16, 8)  # one per other rank reached; the rest over NVLink
    assert d.algorithm == "p2p" and d.link == "network"
    assert d.transfer_s == pytest.approx(max((total - remote) / a100.node.nvlink_ring_busbw,
                                             remote / a100.network.nic_busbw))


def test_a_flex_layout_simulates_faster_and_its_search_floor_stays_below():
    """The search's time floor prices the flex dispatch with the simulator's own costs (a floor),
    and the recipe's dispatcher makes the Megatron-Bridge layout (EP 16 over two nodes) faster."""
    from canzona.cost import DeviceRate
    from canzona.models import resolve_model
    from sim.search import Question, config_of, time_floor
    from sim.simulate import simulate

    flex = EpDispatcher(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep",
                        moe_hybridep_num_sms=32)
    layout = {"tp": 1, "pp": 1, "vp": 1, "ep": 16, "micro_batch": 1, "recompute": "none"}
    times = {}
    for d in (EpDispatcher(), flex):
        q = Question(model="qwen3-30b-a3b", gpus=16, optimizer="adamw", global_batch=16, ep_dispatcher=d)
        cfg = config_of(q, layout)
        assert cfg.options.ep_dispatcher == d
        times[d.moe_token_dispatcher_type] = simulate(cfg).iteration_time_s
        assert time_floor(cfg, resolve_model(q.model), DeviceRate.from_profile(H100), H100) <= times[
            d.moe_token_dispatcher_type]
    assert times["flex"] < 0.8 * times["alltoall"]


def test_a_flex_kernel_holds_its_own_sms_beside_overlapped_compute():
    """A flex dispatch / combine holds the backend's SMs (HybridEP's moe_hybridep_num_sms, DeepEP's
    Megatron default of 20), not NCCL's: under the EP all-to-all overlap, where it runs beside
    another micro-batch's GEMMs, 32 HybridEP SMs slow the step more than 16 do, at the same measured
    bandwidth (both pick the 16-SM measurement); run alone, between kernels, the count changes nothing."""
    from sim.ep_dispatch import DEEPEP_SMS, FlexTraffic, dispatcher_sms
    from sim.search import Question, config_of
    from sim.simulate import simulate

    assert dispatcher_sms(None) is None and DEEPEP_SMS == 20
    assert dispatcher_sms(FlexTraffic("hybridep", 32, 1.0, 128, 8)) == 32
    assert measurement("hybridep", "h100-sxm", 16, 32) == measurement("hybridep", "h100-sxm", 16, 16)
    layout = {"tp": 1, "pp": 1, "vp": 1, "ep": 16, "micro_batch": 1, "recompute": "none"}
    times = {}
    for overlap in (False, True):
        for sms in (16, 32):
            d = EpDispatcher(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep",
                             moe_hybridep_num_sms=sms)
            q = Question(model="qwen3-30b-a3b", gpus=16, optimizer="adamw", global_batch=32, ep_dispatcher=d,
                         overlap_moe_expert_parallel_comm=overlap)
            times[overlap, sms] = simulate(config_of(q, layout)).forward_backward_s
    assert times[True, 32] > times[True, 16]
    assert times[False, 32] == pytest.approx(times[False, 16], rel=1e-9)


def test_deepeps_own_sms_are_taken_from_overlapped_compute():
    """DeepEP's `--moe-deepep-num-sms` (Megatron's moe_deepep_num_sms, default 20) is what its
    kernels hold beside the overlapped GEMMs: 32 slow the step more than 20 do."""
    from sim.search import Question, config_of
    from sim.simulate import simulate

    layout = {"tp": 1, "pp": 1, "vp": 1, "ep": 16, "micro_batch": 1, "recompute": "none"}
    times = {}
    for sms in (20, 32):
        d = EpDispatcher(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep",
                         moe_deepep_num_sms=sms)
        assert d.sms == sms
        q = Question(model="qwen3-30b-a3b", gpus=16, optimizer="adamw", global_batch=32, ep_dispatcher=d,
                     overlap_moe_expert_parallel_comm=True)
        times[sms] = simulate(config_of(q, layout)).forward_backward_s
    assert times[32] > times[20]


def test_expert_block_marks_the_forward_dispatch():
    """The forward block's flex traffic runs HybridEP's preprocessing; the backward's reuses the handle."""
    from canzona.cost import DeviceRate
    from sim.model_work import _expert_block

    dispatcher = EpDispatcher(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=HYBRIDEP,
                              moe_hybridep_num_sms=32)
    fwd, bwd = _expert_block("mlp", (), 4096.0, 2048, (128, 8), DeviceRate.from_profile(H100), "bf16", "none",
                             ep=16, dispatcher=dispatcher)
    assert fwd.ep_flex.forward and not bwd.ep_flex.forward
    assert fwd.ep_flex.tokens == bwd.ep_flex.tokens == 4096.0
    assert replace(fwd.ep_flex, forward=False) == bwd.ep_flex


def test_hybridep_permutes_inside_its_dispatch_and_combine():
    """HybridEP's permute (and unpermute) runs inside its dispatch (and combine): it reads the `R`
    distinct tokens the busiest rank receives and writes its `P` token-expert pairs (the unpermute the
    other way). Across nodes the measured price already holds the benchmark's copy of the `R` tokens
    out of the buffer, so only the `P - R` rows more are added; inside a node the whole pass and its
    launch; DeepEP, whose tokens Megatron permutes among the experts' kernels, adds nothing."""
    tokens, hidden, hbm = 4096, 2048, H100.gpu.hbm_achievable_bytes_per_s
    row = tokens * hidden * 2.0
    t = FlexTraffic(HYBRIDEP, 32, row, 128, 8, 1.0, tokens)
    pairs = tokens * 8
    received = 16 * tokens * group_hit(128, 16, 8)  # 27,019 of the 32,768 pairs' tokens at EP 16
    assert received == pytest.approx(27019.3, abs=0.1)
    across = hybridep_permute_s(t, _experts(16, 16), H100)
    assert across == pytest.approx((pairs - received) * hidden * 2 / hbm)
    d, c = flex_costs(t, _experts(16, 16), H100)
    logical = row * expected_groups(128, 2, 8)
    assert d.seconds == pytest.approx(logical / 54.47e9 + across)
    assert c.seconds == pytest.approx(logical / 53.35e9 + across)
    inside = hybridep_permute_s(t, _experts(8, 8), H100)
    received8 = 8 * tokens * group_hit(128, 8, 8)
    assert inside == pytest.approx((pairs + received8) * hidden * 2 / hbm + H100.gpu.launch_s)
    d8, c8 = flex_costs(t, _experts(8, 8), H100)
    once = row * 7 * group_hit(128, 8, 8)
    assert d8.seconds == pytest.approx(alltoall_cost(once, once, _experts(8, 8), H100).seconds + inside)
    assert c8 == d8
    # the busiest rank of an unbalanced router moves its share more
    assert hybridep_permute_s(replace(t, imbalance=1.3), _experts(8, 8), H100) == pytest.approx(
        1.3 * (inside - H100.gpu.launch_s) + H100.gpu.launch_s)
    assert hybridep_permute_s(replace(t, backend=DEEPEP), _experts(16, 16), H100) == 0.0
    assert hybridep_permute_s(t, _experts(16, 1), H100) == 0.0
    assert hybridep_permute_s(replace(t, tokens=0.0), _experts(16, 16), H100) == 0.0


def test_a_hybridep_expert_block_leaves_the_permute_to_its_dispatcher():
    """Under HybridEP the experts' block keeps SwiGLU only: the permute, the unpermute and the sum of
    each token's experts run inside the dispatch and combine; DeepEP's and the all-to-all's block keep
    them (Megatron permutes among the experts' kernels there)."""
    from canzona.cost import DeviceRate
    from sim.model_work import _expert_block

    rate = DeviceRate.from_profile(H100)
    tokens, hidden, ffn = 4096.0, 2048, 768
    params = [p for p in _qwen3_moe_layer() if p.role.name == "EXPERT"]
    blocks = {}
    for name, d in (("alltoall", EpDispatcher()),
                    ("deepep", EpDispatcher(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=DEEPEP)),
                    ("hybridep", EpDispatcher(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=HYBRIDEP,
                                              moe_hybridep_num_sms=32))):
        blocks[name] = _expert_block("mlp", params, tokens, hidden, (128, 8), rate, "bf16", "none", ep=16,
                                     dispatcher=d)
    assert blocks["alltoall"][0].seconds == pytest.approx(blocks["deepep"][0].seconds)
    # the busiest rank's pairs under the default random routing (canzona.routing)
    pairs = tokens * 8 * busiest_rank(experts=128, top_k=8, ep=16, tokens=tokens).pairs
    hbm = rate.hbm_bytes_per_s * rate.hbm_efficiency
    permute = pairs * (4 + 2) * hidden * 2 / hbm  # the permute and back, and the experts' sum, per pair
    for k in (0, 1):  # forward: one pass; backward: two
        saved = blocks["deepep"][k].seconds - blocks["hybridep"][k].seconds
        assert saved == pytest.approx((1 + k) * permute, rel=1e-3)
    swiglu = pairs * 1.5 * 2 * ffn * 2 / hbm
    assert swiglu > 0 and blocks["hybridep"][0].seconds > swiglu


def _automodel_fake_gate(tokens: int, experts: int, top_k: int) -> list[list[int]]:
    """AutoModel's FakeBalancedGate's expert indices without noise, token by token (its
    `arange(n_tokens * a_exp).view(-1, a_exp) % available_experts`)."""
    flat = [i % experts for i in range(tokens * top_k)]
    return [flat[t * top_k:(t + 1) * top_k] for t in range(tokens)]


@pytest.mark.parametrize(("experts", "groups", "k"), [(128, 8, 8), (128, 16, 8), (128, 32, 8), (128, 8, 6),
                                                      (12, 3, 8), (64, 8, 3)])
def test_fake_gate_groups_is_the_mean_over_the_gates_tokens(experts, groups, k):
    from sim.ep_dispatch import fake_gate_groups

    per = experts // groups
    tokens = 16384  # a rank's micro-batch of the AutoModel row (4 x 4096)
    routed = _automodel_fake_gate(tokens, experts, k)
    mean = sum(len({e // per for e in r}) for r in routed) / tokens
    assert fake_gate_groups(experts, groups, k) == pytest.approx(mean, abs=2 * k / tokens)


def test_the_fake_gate_sends_each_qwen3_token_to_one_rank_of_eight():
    """128 experts, top-8, EP 8 (16 contiguous experts a rank, AutoModel's Shard(0)): token t's
    experts 8t .. 8t+7 (mod 128) lie on one rank, and every expert gets the same pairs; uniform
    routing reaches 5.34 ranks."""
    from sim.ep_dispatch import fake_gate_groups

    routed = _automodel_fake_gate(16384, 128, 8)
    assert all(len({e // 16 for e in r}) == 1 for r in routed)
    load = [0] * 128
    for r in routed:
        for e in r:
            load[e] += 1
    assert set(load) == {16384 * 8 // 128}
    assert fake_gate_groups(128, 8, 8) == 1.0 and expected_groups(128, 8, 8) == pytest.approx(5.339, abs=1e-3)
    with pytest.raises(SpecError, match="groups must divide"):
        fake_gate_groups(128, 3, 8)


def test_flex_inside_a_node_under_the_fake_gate_sends_each_token_once():
    cl = _experts(8, 8)
    token_bytes = 4096 * 2048 * 2.0
    fake = FlexTraffic(DEEPEP, 20, token_bytes, 128, 8, fake_balanced_gate=True)
    d, c = flex_costs(fake, cl, H100)
    once = token_bytes * 7 / 8  # its one rank, another rank's for 7 tokens of 8
    assert d == c == alltoall_cost(once, once, cl, H100)
    uniform, _ = flex_costs(replace(fake, fake_balanced_gate=False), cl, H100)
    assert d.seconds < 0.3 * uniform.seconds
    # across nodes too: a token's experts on one node, one copy to it (the measured price's bytes)
    two = _experts(16, 16)
    m, _ = flex_costs(FlexTraffic(HYBRIDEP, 16, token_bytes, 128, 8, fake_balanced_gate=True), two, H100)
    assert m.transfer_s == pytest.approx(token_bytes / measurement(HYBRIDEP, "h100-sxm", 16, 16).dispatch)


def test_the_fake_gate_option_and_its_error_lines():
    EpDispatcher(fake_balanced_gate=True).check()
    with pytest.raises(SpecError, match=r"^fake_balanced_gate must be true or false, got 'yes'$"):
        EpDispatcher(fake_balanced_gate="yes").check()
    from sim.simulate import SimConfig, simulate

    cfg = SimConfig(model="qwen3-30b-a3b", gpus=8, tp=1, ep=8, optimizer="adamw", router_imbalance=1.2,
                    options=RunOptions(ep_dispatcher=EpDispatcher(fake_balanced_gate=True)))
    with pytest.raises(SpecError, match="fake_balanced_gate .* no router imbalance"):
        simulate(cfg)
    dense = SimConfig(model="qwen3-8b", gpus=8, tp=1, optimizer="adamw",
                      options=RunOptions(ep_dispatcher=EpDispatcher(fake_balanced_gate=True)))
    with pytest.raises(SpecError, match="fake_balanced_gate .* needs experts"):
        simulate(dense)


def test_the_automodel_row_runs_the_fake_gate_without_a_router_gemm():
    """The AutoModel row's recipe sets fake_balanced_gate: true; its expert block then prices no
    router GEMM (the FakeBalancedGate has no weight) and its DeepEP dispatch moves each token once."""
    from canzona.cost import DeviceRate
    from sim.model_work import _expert_block

    am = RUNS["qwen3-30b-a3b-8xh100-automodel"]
    assert am.ep_dispatcher.fake_balanced_gate and "fake_balanced_gate: true" in am.recipe_source
    assert am.sim_config().options.ep_dispatcher.fake_balanced_gate
    assert not RUNS["qwen3-30b-a3b-16xh100-mb"].ep_dispatcher.fake_balanced_gate
    rate = DeviceRate.from_profile(H100)
    params = _qwen3_moe_layer()
    assert any(p.role.name == "ROUTER" for p in params)
    blocks = {}
    for fake in (False, True):
        d = replace(am.ep_dispatcher, fake_balanced_gate=fake)
        blocks[fake] = _expert_block("mlp", params, 16384.0, 2048, (128, 8), rate, "bf16", "none", ep=8,
                                     dispatcher=d)
    assert blocks[True][0].seconds < blocks[False][0].seconds
    assert blocks[True][1].seconds < blocks[False][1].seconds
    assert blocks[True][0].ep_flex.fake_balanced_gate and blocks[True][1].ep_flex.fake_balanced_gate


def test_the_alltoall_dispatcher_exchanges_counts_and_probabilities():
    """Megatron's alltoall dispatcher (token_dispatcher.py, MoEAlltoAllTokenDispatcher): before the
    forward's token all-to-all it all-gathers every rank's int64 count per expert and syncs the host;
    beside it, and beside the backward's dispatch gradient, it sends each pair's probability by a
    second all-to-all. The combine and the backward's combine gradient move the tokens alone."""
    from sim.ep_dispatch import PROBS_BYTES, AlltoallMetadata, alltoall_metadata_costs

    pairs, busiest = 4096 * 8, 4096 * 8 * 1.01
    for ep, nodes in ((16, 2), (8, 1)):
        cl = _experts(8 * nodes, ep)
        sent, received = pairs * 4096 * (ep - 1) / ep, busiest * 4096 * (ep - 1) / ep
        fwd = AlltoallMetadata(experts=128, probs_sent=pairs * PROBS_BYTES * (ep - 1) / ep,
                               probs_received=busiest * PROBS_BYTES * (ep - 1) / ep, forward=True)
        bwd = replace(fwd, forward=False)
        tokens = alltoall_cost(sent, received, cl, H100)
        probs = alltoall_cost(fwd.probs_sent, fwd.probs_received, cl, H100)
        gather = collective_cost("all-gather", 128 * 8 * ep, cl.ep_geometry(), H100)
        d, c = ep_costs(sent, received, None, cl, H100, fwd)
        assert d.seconds == pytest.approx(tokens.seconds + probs.seconds + gather.seconds + H100.gpu.launch_s)
        assert c == tokens and d.algorithm == tokens.algorithm
        d, c = ep_costs(sent, received, None, cl, H100, bwd)
        assert d == tokens and c.seconds == pytest.approx(tokens.seconds + probs.seconds)
        assert alltoall_metadata_costs(bwd, cl, H100)[0] == FREE
        # latency-bound: the probabilities weigh a 1024th of the tokens' bytes but cost a call
        assert probs.seconds > 10 * probs.transfer_s
    # across nodes each exchange pays the network's latency, inside one node NVLink's
    assert alltoall_metadata_costs(fwd, _experts(16, 16), H100)[0].seconds > alltoall_metadata_costs(
        fwd, _experts(8, 8), H100)[0].seconds
    assert alltoall_metadata_costs(fwd, _experts(16, 1), H100) == (FREE, FREE)


def test_an_alltoall_expert_block_carries_its_metadata_and_a_flex_one_none():
    from canzona.cost import DeviceRate
    from sim.ep_dispatch import PROBS_BYTES
    from sim.model_work import _expert_block

    rate = DeviceRate.from_profile(H100)
    fwd, bwd = _expert_block("mlp", (), 4096.0, 2048, (128, 8), rate, "bf16", "none", ep=16,
                             dispatcher=EpDispatcher(routing="balanced"))
    assert fwd.ep_meta.forward and not bwd.ep_meta.forward and fwd.ep_meta.experts == 128
    assert fwd.ep_meta.probs_sent == pytest.approx(4096 * 8 * PROBS_BYTES * 15 / 16)
    assert fwd.ep_meta.probs_sent / fwd.ep_bytes == pytest.approx(PROBS_BYTES / (2048 * 2))
    flex = EpDispatcher(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=HYBRIDEP)
    f, b = _expert_block("mlp", (), 4096.0, 2048, (128, 8), rate, "bf16", "none", ep=16, dispatcher=flex)
    assert f.ep_meta is None and b.ep_meta is None
    f, b = _expert_block("mlp", (), 4096.0, 2048, (128, 8), rate, "bf16", "none", ep=1)
    assert f.ep_meta is None


def test_the_alltoall_dispatchers_metadata_lengthens_each_layers_ep_stream(monkeypatch):
    """Simulated: every MoE layer's EP stream carries the forward's count gather, host sync and
    probabilities and the backward's probability gradients; without them (the costs made free) the
    rank's EP stream is exactly that much shorter, and the iteration shorter."""
    from sim import ep_dispatch
    from sim.search import Question, config_of
    from sim.simulate import simulate
    from sim.streams import EP_COMM

    q = Question(model="qwen3-30b-a3b", gpus=16, optimizer="adamw", global_batch=16)
    cfg = config_of(q, {"tp": 1, "pp": 1, "vp": 1, "ep": 16, "micro_batch": 1, "recompute": "none"})
    # the parameter gathers in the step, not under the forward: issued a bucket ahead there
    # (`sim.param_sync`), they share the NICs with the all-to-alls at times the metadata moves
    cfg = replace(cfg, options=replace(cfg.options, ep_dispatcher=EpDispatcher(routing="balanced"),
                                       overlap_param_gather=False))

    def ep_time(result):
        return sum(s.end - s.start for s in result.spans if s.rank == 0 and s.stream == EP_COMM and s.phase == "A")

    with_meta = simulate(cfg)
    cl = cfg.expert_cluster(Cluster(16, 1, 8, 1))
    pairs = 4096 * 8
    fwd = ep_dispatch.AlltoallMetadata(experts=128, probs_sent=pairs * 4 * 15 / 16, probs_received=pairs * 4 * 15 / 16,
                                       forward=True)
    before, probs = ep_dispatch.alltoall_metadata_costs(fwd, cl, H100)
    monkeypatch.setattr(ep_dispatch, "alltoall_metadata_costs", lambda meta, experts, hw: (FREE, FREE))
    without = simulate(cfg)
    layers = 48
    assert ep_time(with_meta) - ep_time(without) == pytest.approx(layers * (before.seconds + 2 * probs.seconds),
                                                                  rel=1e-6)
    assert with_meta.iteration_time_s > without.iteration_time_s
