"""Random routing's busiest EP rank (canzona.routing, docs/design.md §2.7): the closed form against a
Monte-Carlo replica of Megatron's forced balancing, its properties, how it composes with a router
imbalance, what the simulator prices with it, and the option's errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canzona.errors import SpecError
from canzona.experts import rank_shares, router_imbalance
from canzona.routing import BALANCED, RANDOM, busiest_rank, pair_spread, token_spread
from canzona.variability import expected_max_normal
from sim.ep_dispatch import EpDispatcher, group_hit
from sim.options import RunOptions
from sim.simulate import SimConfig, simulate
from tests.cli_helpers import error_line, invoke
from tests.sim.test_expert_parallel import _run


def _monte_carlo(experts: int, ep: int, top_k: int, tokens: int, trials: int, seed: int):
    """Megatron's forced balancing, replicated: every token of the EP group draws standard normal
    logits and takes its top-k (`apply_random_logits` then top-k); per trial the busiest rank's pairs
    and distinct tokens over their expected means. Returns (mean, standard error) of each."""
    rng = np.random.default_rng(seed)
    n = ep * tokens
    logits = rng.standard_normal((trials, n, experts))
    top = np.argpartition(logits, experts - top_k, axis=2)[:, :, experts - top_k:]
    ranks = top // (experts // ep)  # (trials, tokens, k): the EP rank of each pair
    onehot = (ranks[..., None] == np.arange(ep)).sum(axis=2)  # (trials, tokens, ep): pairs per rank
    pairs = onehot.sum(axis=1).max(axis=1) / (tokens * top_k)
    distinct = (onehot > 0).sum(axis=1).max(axis=1) / (n * group_hit(experts, ep, top_k))
    return [(x.mean(), x.std(ddof=1) / math.sqrt(trials)) for x in (pairs, distinct)]


@pytest.mark.parametrize("experts, ep, top_k, tokens, trials",
                         [(16, 2, 4, 64, 400), (32, 8, 4, 32, 300), (32, 4, 8, 32, 300)])
def test_the_closed_form_matches_a_monte_carlo_of_forced_balancing(experts, ep, top_k, tokens, trials):
    (pairs, pairs_se), (distinct, distinct_se) = _monte_carlo(experts, ep, top_k, tokens, trials, seed=27)
    b = busiest_rank(experts=experts, top_k=top_k, ep=ep, tokens=tokens)
    assert b.pairs > 1.01 and b.tokens > 1.01  # a real excess to compare
    # within four standard errors and 3% of the excess (the central limit theorem's approximation)
    assert pairs == pytest.approx(b.pairs, abs=4 * pairs_se + 0.03 * (b.pairs - 1))
    assert distinct == pytest.approx(b.tokens, abs=4 * distinct_se + 0.03 * (b.tokens - 1))


def test_the_published_geometries():
    """Qwen3-30B-A3B at EP 16 (T 4096) and Qwen3-235B-A22B at EP 32, TP 2 (T 2048): 128 experts, top-8."""
    small = busiest_rank(experts=128, top_k=8, ep=16, tokens=4096)
    big = busiest_rank(experts=128, top_k=8, ep=32, tokens=2048)
    assert small.pairs == pytest.approx(1 + expected_max_normal(16) * math.sqrt(120 / (127 * 4096 * 8)))
    assert (round(small.pairs, 4), round(small.tokens, 4)) == (1.0095, 1.0085)
    assert (round(big.pairs, 4), round(big.tokens, 4)) == (1.0157, 1.0150)


def test_the_spreads_are_the_variance_less_the_covariance():
    # pairs: hypergeometric counts over ranks of fixed sum, so V - C = V / (1 - 1/ep)
    e, ep, k = 128, 16, 8
    m = e // ep
    p = m / e
    variance = k * p * (1 - p) * (e - k) / (e - 1)
    assert pair_spread(e, ep, k) == pytest.approx(variance / (1 - 1 / ep))
    # distinct tokens: Bernoulli(h) per rank, covariance P(both reached) - h^2
    h = group_hit(e, ep, k)
    both = 1 - 2 * math.comb(e - m, k) / math.comb(e, k) + math.comb(e - 2 * m, k) / math.comb(e, k)
    assert token_spread(e, ep, k) == pytest.approx(h * (1 - h) - (both - h * h))


_geometry = st.tuples(st.sampled_from([1, 2, 4, 8, 16, 32]), st.integers(1, 8), st.integers(1, 8))


@settings(max_examples=60, deadline=None)
@given(_geometry, st.integers(1, 1 << 16))
def test_the_busiest_rank_is_above_the_mean_and_tends_to_it(geometry, tokens):
    ep, per_rank, top_k = geometry
    experts = ep * per_rank
    top_k = min(top_k, experts)
    b = busiest_rank(experts=experts, top_k=top_k, ep=ep, tokens=tokens)
    more = busiest_rank(experts=experts, top_k=top_k, ep=ep, tokens=4 * tokens)
    if ep == 1:
        assert b.pairs == b.tokens == 1.0
        return
    assert b.pairs >= 1 and b.tokens >= 1
    assert more.pairs - 1 == pytest.approx((b.pairs - 1) / 2)  # the excess falls as 1 / sqrt(tokens)
    assert more.tokens - 1 == pytest.approx((b.tokens - 1) / 2)
    assert busiest_rank(experts=experts, top_k=top_k, ep=ep, tokens=tokens, routing=BALANCED).pairs == 1.0


@settings(max_examples=40, deadline=None)
@given(st.floats(1.0, 3.0), st.sampled_from([4, 16, 32]), st.sampled_from([64, 1024, 4096]))
def test_a_skew_composes_with_the_fluctuation(skew, ep, tokens):
    shares = rank_shares(skew, 128, ep)
    assert max(shares) == pytest.approx(skew) and sum(shares) == pytest.approx(ep)
    plain = busiest_rank(experts=128, top_k=8, ep=ep, tokens=tokens)
    both = busiest_rank(experts=128, top_k=8, ep=ep, tokens=tokens, shares=shares)
    # E[max] is above both the largest mean and the balanced fluctuation's expected maximum
    assert both.pairs >= max(skew, plain.pairs) - 1e-9
    assert both.pairs <= skew * plain.pairs + 1e-9
    assert busiest_rank(experts=128, top_k=8, ep=ep, tokens=tokens, shares=shares, routing=BALANCED).pairs == \
        pytest.approx(skew)


def test_the_integral_agrees_with_the_closed_form():
    """Two groups of equal shares take the numerical integral: at a vanishing difference it gives the
    closed form of equal shares; a large skew leaves the busiest at its own mean."""
    closed = busiest_rank(experts=128, top_k=8, ep=16, tokens=4096)
    near = busiest_rank(experts=128, top_k=8, ep=16, tokens=4096, shares=(1 + 1e-9,) + (1.0,) * 15)
    assert near.pairs == pytest.approx(closed.pairs, abs=1e-7)
    assert near.tokens == pytest.approx(closed.tokens, abs=1e-7)
    far = busiest_rank(experts=128, top_k=8, ep=16, tokens=4096, shares=rank_shares(1.5, 128, 16))
    assert far.pairs == pytest.approx(1.5, abs=1e-6)
    # a histogram: the ranks' sums, an empty rank never the busiest
    hist = [3.0] * 8 + [0.0] * 8 + [1.0] * 112
    assert router_imbalance(hist, 128, 16) == pytest.approx(max(rank_shares(hist, 128, 16)))
    assert busiest_rank(experts=128, top_k=8, ep=16, tokens=4096, shares=rank_shares(hist, 128, 16)).pairs >= \
        router_imbalance(hist, 128, 16)


def test_a_moe_iteration_pays_the_busiest_rank_as_a_skew_of_its_factor():
    """Random routing slows the MoE iteration exactly as a persistent skew of the busiest rank's
    factor does under exact balance (the all-to-all prices pairs: one factor), and only under EP."""
    balanced = RunOptions(ep_dispatcher=EpDispatcher(routing=BALANCED))
    random, even = _run(ep=4), _run(ep=4, options=balanced)
    assert random.forward_backward_s > even.forward_backward_s
    # the tiny model: 16 experts, top-2, 4 EP ranks, 512 tokens a micro-batch over TP 2
    factor = busiest_rank(experts=16, top_k=2, ep=4, tokens=256).pairs
    skewed = _run(ep=4, options=balanced, router_imbalance=factor)
    assert random.iteration_time_s == pytest.approx(skewed.iteration_time_s, rel=1e-9)
    assert _run(ep=1).iteration_time_s == _run(ep=1, options=balanced).iteration_time_s


def test_the_fake_balanced_gate_is_deterministic():
    from canzona.cost import DeviceRate
    from canzona.hardware import load_profile
    from sim.model_work import _expert_block
    from tests.sim.test_ep_dispatch import _qwen3_moe_layer

    rate = DeviceRate.from_profile(load_profile("h100-sxm"))
    params = [p for p in _qwen3_moe_layer() if p.role.name == "EXPERT"]
    blocks = [_expert_block("mlp", params, 4096.0, 2048, (128, 8), rate, "bf16", "none", ep=8,
                            dispatcher=EpDispatcher(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep",
                                                    fake_balanced_gate=True, routing=r))
              for r in (RANDOM, BALANCED)]
    assert blocks[0] == blocks[1]


def test_a_flex_dispatch_prices_distinct_tokens_by_their_own_factor():
    from canzona.cost import DeviceRate
    from canzona.hardware import load_profile
    from sim.model_work import _expert_block
    from tests.sim.test_ep_dispatch import _qwen3_moe_layer

    rate = DeviceRate.from_profile(load_profile("h100-sxm"))
    params = [p for p in _qwen3_moe_layer() if p.role.name == "EXPERT"]
    flex = EpDispatcher(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep")
    block = _expert_block("mlp", params, 4096.0, 2048, (128, 8), rate, "bf16", "none", ep=8, dispatcher=flex)[0]
    b = busiest_rank(experts=128, top_k=8, ep=8, tokens=4096)
    assert block.ep_flex.pair_factor == b.pairs and block.ep_flex.token_factor == b.tokens
    assert block.ep_flex.imbalance == 1.0  # the skew, which a measured price takes alone
    assert b.tokens != b.pairs


@pytest.mark.parametrize("value", ["uniform", "", "Random"])
def test_a_bad_routing_is_one_error(value):
    with pytest.raises(SpecError, match=f"unknown routing '{value}'; choose one of random, balanced"):
        EpDispatcher(routing=value).check()
    with pytest.raises(SpecError, match="unknown routing"):
        simulate(SimConfig(model="qwen3-30b-a3b", gpus=16, tp=1, ep=16, optimizer="adamw",
                           options=RunOptions(ep_dispatcher=EpDispatcher(routing=value))))


@pytest.mark.parametrize("command", [
    ("simulate", "--model", "qwen3-30b-a3b", "--gpus", "16", "--tp", "1", "--ep", "16"),
    ("search", "--model", "qwen3-30b-a3b", "--gpus", "16"),
])
def test_cli_routing_errors_are_one_line(command):
    error_line(invoke(*command, "--routing", "uniform"), "unknown routing 'uniform'; choose one of random, balanced")


@pytest.mark.parametrize("command", [
    ("simulate", "--model", "qwen3-0.6b", "--gpus", "8", "--seq-len", "256", "--global-batch", "8"),
    ("search", "--model", "qwen3-0.6b", "--gpus", "8", "--seq-len", "256", "--global-batch", "8"),
])
def test_routing_on_a_dense_model_is_refused_alike(command):
    """`--routing balanced` changes nothing on a model without experts: `simulate` refuses it as
    `search` does (one `error:` line each), rather than echoing it back without effect."""
    error_line(invoke(*command, "--routing", "balanced"), "--routing balanced", "has no experts")
    with pytest.raises(SpecError, match="has no experts"):
        SimConfig(model="qwen3-0.6b", gpus=8, optimizer="adamw",
                  options=RunOptions(ep_dispatcher=EpDispatcher(routing=BALANCED))).check()


@pytest.mark.parametrize("command", [
    ("simulate", "--model", "qwen3-30b-a3b", "--gpus", "8", "--tp", "1", "--ep", "8", "--seq-len", "256",
     "--global-batch", "8"),
    ("search", "--model", "qwen3-30b-a3b", "--gpus", "8", "--seq-len", "256", "--global-batch", "8"),
])
def test_routing_beside_the_fake_balanced_gate_is_refused(command):
    """The FakeBalancedGate routes deterministically and exactly balanced whatever `--routing` says
    (`EpDispatcher.load_routing`): `--routing balanced` beside it changed nothing and was accepted."""
    error_line(invoke(*command, "--fake-balanced-gate", "--routing", "balanced"), "--routing balanced changes nothing",
               "--fake-balanced-gate")


def test_a_router_imbalance_above_the_ep_size_is_refused():
    """The busiest of `ep` ranks holds at most every pair, `ep` times the mean: a larger factor is
    impossible (`rank_shares` gave the others no pairs and the ranks a mean above 1), one error."""
    assert rank_shares(4.0, 128, 4) == (4.0, 0.0, 0.0, 0.0)  # every pair on one rank: the limit
    for call in (router_imbalance, rank_shares):
        with pytest.raises(SpecError, match="at most the EP size"):
            call(5.0, 128, 4)
    error_line(invoke("simulate", "--model", "qwen3-30b-a3b", "--gpus", "16", "--tp", "1", "--ep", "4",
                      "--seq-len", "256", "--global-batch", "16", "--router-imbalance", "5"), "at most the EP size")


def test_a_histogram_is_read_at_any_scale_its_sum_overflowing_or_not():
    """A histogram's shares are "any non-negative scale", but each rank's sum was taken as given: 128
    equal shares of 1e308 summed to infinity, every rank's share became NaN, and the run was priced
    faster than the balanced one it is (no error, a silent wrong figure). The shares are read
    relative to the largest, so a scale changes nothing, overflowing or subnormal."""
    import json

    from tests.sim.small_models import MOE_FOUR_LAYERS

    even = rank_shares([1.0] * 128, 128, 8)
    for scale in (1e308, 1e-320, 3.0):
        assert rank_shares([scale] * 128, 128, 8) == even
    skewed = [2.0] * 16 + [1.0] * 112
    assert rank_shares([1e308 / 2 * s for s in skewed], 128, 8) == pytest.approx(rank_shares(skewed, 128, 8))
    moe = ("simulate", "--model", MOE_FOUR_LAYERS, "--gpus", "8", "--tp", "1", "--ep", "8", "--seq-len", "128",
           "--global-batch", "8", "--json")

    def iteration(*args: str) -> float:
        result = invoke(*moe, *args)
        assert result.exit_code == 0, result.stderr
        return json.loads(result.stdout)["iteration_time_s"]

    assert iteration("--router-imbalance", ",".join(["1e308"] * 128)) == iteration()
