"""How a mixture-of-experts router's random routing loads the busiest expert-parallel (EP) rank
(docs/design.md §2.7, §9.3). Torch-free.

Megatron's `moe_router_force_load_balancing` (Megatron-Bridge's performance recipes set it for
every MoE model: `perf_recipes/_common.py`) replaces the router's logits by fresh standard normal
draws per token (NVIDIA/Megatron-LM megatron/core/transformer/moe/moe_utils.py, `RandomSTE.forward`:
`logits.clone().normal_()` under the expert-parallel RNG tracker; `apply_random_logits`), so each
token's top-k are k distinct experts drawn uniformly at random, afresh for every micro-batch and
every layer. Balanced in expectation, not exactly: each layer's dispatch all-to-all and the combine
after the experts wait for the EP group's busiest rank, whose token-expert pairs (and distinct
tokens) exceed the mean by a random amount. A learned router routes no more evenly than this
(its per-token choices fluctuate at least as much, around a persistent skew of its own), so this
is a lower bound for it. NeMo AutoModel's FakeBalancedGate without noise (`fake_gate_noise` 0.0)
is deterministic (`torch.arange(n_tokens * top_k) % experts`: `sim.ep_dispatch.fake_gate_groups`)
and exactly balanced: no fluctuation.

The busiest rank's expected load. An EP group of `n = ep` ranks, each with `T` tokens (its share
of the micro-batch after CP and TP / sequence-parallel splitting: `sim.model_work` passes
`tokens / cp / tp`), rank `j` holding the `m = E / n` experts `[j m, (j + 1) m)`; `N = n T` tokens
in all, each routed independently. Rank `j`'s load is a sum over the tokens, `L_j = sum_t x_tj`,
with `x_t` exchangeable over the ranks, so the loads have a common mean `mu`, variance `V` and
covariance `C` between two ranks. A Gaussian vector of that covariance is, in law,
`mu + sqrt(V - C) (Z_j - mean(Z)) + (a common term)` with `Z` independent standard normals (the
covariance `(V - C) I + C J` split along `1` and its complement), and the common term and `mean(Z)`
shift every rank alike, so (central limit theorem over the `N` tokens)

    E[max_j L_j] = mu + sqrt(V - C) e(n),   e(n) = E[max of n standard normals]

(`canzona.variability.expected_max_normal`), with `V - C = N s`, `s = (1/2) E[(x_ti - x_tj)^2]`
per token (`pair_spread`, `token_spread`):
- token-expert pairs (what the all-to-all sends and the grouped GEMMs compute): per token the
  pairs on one rank are hypergeometric (E, m, k): mean `k / n`, `s = k (E - k) / (n (E - 1))`.
  Their sum over the ranks is fixed (`N k`), `C = -V / (n - 1)`, so `sqrt(V - C) = sigma /
  sqrt(1 - 1/n)` with `sigma = sqrt(V)`; the factor on the mean `T k` is
  `1 + e(n) sqrt((E - k) / ((E - 1) T k))`;
- distinct tokens (what a flex dispatcher, DeepEP / HybridEP, sends: each token once to each
  rank holding one of its experts): per token Bernoulli(h), `h = 1 - C(E - m, k) / C(E, k)`
  (`sim.ep_dispatch.group_hit`), `s = P(rank i reached, rank j not) = C(E - m, k) / C(E, k) -
  C(E - 2m, k) / C(E, k)`; the mean is `N h`.
Qwen3-30B-A3B at EP 16 (E 128, top-8, T 4096): pairs +0.95%, distinct tokens +0.85%;
Qwen3-235B-A22B at EP 32, TP 2 (T 2048): +1.57% and +1.50%.

With a persistent skew (the user's `router_imbalance`: each rank's mean share `s_j` of the pairs,
mean 1, `canzona.experts.rank_shares`) the fluctuation rides on each rank's own mean: rank `j`'s
load is normal with mean `mu s_j` and deviation `sqrt(N s) sqrt(s_j)` (a count's variance grows
with its mean: an assumption), the ranks taken independent (the fixed sum's correlation is kept
only in `sqrt(V - C)`), and the busiest's expectation is integrated numerically (`_expected_max`);
equal shares give the closed form above exactly. Routing `balanced` prices each rank at its mean
(the skew alone, 1 without one): exact balance, for comparisons and tests that need it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from canzona.choices import check_choice
from canzona.variability import expected_max_normal

RANDOM = "random"  # each token's top-k drawn afresh at random (Megatron's forced balancing; a learned router)
BALANCED = "balanced"  # every EP rank exactly at its mean (exact balance)
ROUTINGS = (RANDOM, BALANCED)


def check_routing(value: object) -> str:
    """The routing option (`--routing`): one of `ROUTINGS`."""
    return check_choice(value, ROUTINGS, "routing")


@dataclass(frozen=True, kw_only=True)
class Busiest:
    """The busiest EP rank's expected load over the mean rank's: its token-expert pairs (the
    all-to-all's bytes, the expert GEMMs' rows) and its distinct tokens received (a flex
    dispatcher's bytes)."""

    pairs: float = 1.0
    tokens: float = 1.0


def _miss(experts: int, skipped: int, top_k: int) -> float:
    """The probability that a token's `top_k` distinct experts, drawn uniformly from `experts`,
    avoid `skipped` given ones."""
    return math.comb(experts - skipped, top_k) / math.comb(experts, top_k)


def pair_spread(experts: int, ep: int, top_k: int) -> float:
    """Per token, half the expected squared difference of two given EP ranks' pair counts (the
    variance less the covariance of the hypergeometric counts): `k (E - k) / (ep (E - 1))`."""
    if experts <= 1:
        return 0.0
    return top_k * (experts - top_k) / (ep * (experts - 1))


def token_spread(experts: int, ep: int, top_k: int) -> float:
    """Per token, half the expected squared difference of two given EP ranks' 0/1 "reached"
    indicators: the probability that one is reached and the other not."""
    m = experts // ep
    return _miss(experts, m, top_k) - _miss(experts, 2 * m, top_k)


def busiest_rank(*, experts: int, top_k: int, ep: int, tokens: float, routing: str = RANDOM,
                 shares: tuple[float, ...] | None = None) -> Busiest:
    """The busiest of `ep` EP ranks' expected pairs and distinct tokens over the mean (the module
    docstring), each rank with `tokens` tokens routed top-`top_k` of `experts`; `shares`: each rank's
    persistent mean share of the pairs (mean 1; None: all 1). Under `balanced` routing, at one rank
    or without tokens: the largest share."""
    check_routing(routing)
    shares = tuple(float(s) for s in shares) if shares is not None else (1.0,) * ep
    skew = max(shares)
    if routing == BALANCED or ep <= 1 or tokens <= 0:
        return Busiest(pairs=skew, tokens=skew)
    return _random(experts, top_k, ep, float(tokens), shares)


@lru_cache(maxsize=1024)
def _random(experts: int, top_k: int, ep: int, tokens: float, shares: tuple[float, ...]) -> Busiest:
    n = ep * tokens  # the EP group's tokens
    hit = 1.0 - _miss(experts, experts // ep, top_k)
    # each rank's deviation over its mean, at share 1: sqrt(V - C) / mu
    pair_cv = math.sqrt(n * pair_spread(experts, ep, top_k)) / (tokens * top_k)
    token_cv = math.sqrt(n * token_spread(experts, ep, top_k)) / (n * hit) if hit > 0 else 0.0
    if all(s == shares[0] for s in shares):  # the closed form (equal means s: mean s, deviation cv sqrt(s))
        s, e = max(shares[0], 0.0), expected_max_normal(ep)
        return Busiest(pairs=s + e * pair_cv * math.sqrt(s), tokens=s + e * token_cv * math.sqrt(s))
    return Busiest(pairs=_expected_max(_groups(shares, pair_cv)), tokens=_expected_max(_groups(shares, token_cv)))


def _groups(shares: tuple[float, ...], cv: float) -> tuple[tuple[float, float, int], ...]:
    """(mean, deviation, count) of the ranks with a positive share (an empty rank carries nothing
    and is never the busiest while another carries something)."""
    counts: dict[float, int] = {}
    for s in shares:
        if s > 0:
            counts[s] = counts.get(s, 0) + 1
    return tuple((s, cv * math.sqrt(s), c) for s, c in sorted(counts.items()))


def _expected_max(groups: tuple[tuple[float, float, int], ...]) -> float:
    """E[max] of independent normals, `count` of each (mean, deviation) of `groups`: `lo` plus the
    integral of `1 - F` over [lo, hi], F the maximum's distribution (the product of the normals'),
    [lo, hi] wide enough (12 deviations) that the maximum lies outside it with negligible odds."""
    if not groups or all(sd == 0 for _, sd, _ in groups):
        return max((m for m, _, _ in groups), default=0.0)
    from scipy import integrate, special  # on use, as canzona.variability's

    lo = min(m - 12 * sd for m, sd, _ in groups)
    hi = max(m + 12 * sd for m, sd, _ in groups)

    def tail(x: float) -> float:  # 1 - F(x)
        return -math.expm1(sum(c * float(special.log_ndtr((x - m) / sd)) for m, sd, c in groups))

    points = sorted({m for m, _, _ in groups if lo < m < hi})
    value, _ = integrate.quad(tail, lo, hi, points=points or None, limit=400, epsabs=1e-12, epsrel=1e-10)
    return lo + value
