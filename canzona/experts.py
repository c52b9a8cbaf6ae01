"""Expert parallelism (EP) for mixture-of-experts models (docs/design.md §2.7): what one EP rank
holds and the groups its expert gradients are reduced over.

Megatron's layout with expert TP 1 ("MoE parallel folding"): a pipeline stage's `dp x tp` GPUs,
in rank order, form `edp = dp x tp / ep` expert-parallel groups of `ep` consecutive ranks. EP
rank `j` of each group holds experts `[j E / ep, (j + 1) E / ep)` of every MoE layer, whole; the
ranks at the same position `j` of every group form an expert-data-parallel (EDP) group of `edp`
ranks, which hold the same experts and reduce their gradients. Everything that is not an expert
(attention, routers, shared experts, norms, embeddings) is the dense part, laid out on DP x TP
as any dense model.

So the expert part of a plan is a plan of its own: the expert matrices of one EP rank (every EP
rank's are the same shapes), owned whole over EDP with TP 1 (`expert_part`); the dense part is
the model without its experts (`dense_part`).
"""

from __future__ import annotations

from dataclasses import replace

from canzona.errors import SpecError
from canzona.spec import ModelSpec, Role


def expert_params(spec: ModelSpec) -> list:
    return [p for p in spec.params if p.role is Role.EXPERT]


def check_experts(spec: ModelSpec, moe: tuple[int, int] | None) -> None:
    """The model's experts agree with its architecture's (experts, experts_per_token): every stack
    holds that many experts and every router scores that many."""
    experts = expert_params(spec)
    if not experts:
        return
    if moe is None:
        raise SpecError(f"model {spec.name!r} has experts ({experts[0].name!r}): its architecture must give "
                        "experts and experts_per_token")
    for p in experts + [p for p in spec.params if p.role is Role.ROUTER]:
        count = p.shape[0]
        if (p.matrix_shape is not None or p.role is Role.ROUTER) and count != moe[0]:
            raise SpecError(f"parameter {p.name!r} has {count} experts, but the architecture of {spec.name!r} "
                            f"says {moe[0]}")


def expert_width(spec: ModelSpec, moe: tuple[int, int], hidden: int) -> float:
    """An expert's SwiGLU width, from its weights (gate, up and down: 3 x width x hidden each)."""
    total = sum(p.numel for p in expert_params(spec))
    layers = len({p.layer for p in expert_params(spec)}) or 1
    return total / (layers * moe[0] * 3 * hidden)


def check_ep(spec: ModelSpec, ep: int, dp: int, tp: int) -> int:
    """The EDP size of `ep` on a stage of `dp x tp` GPUs, after checking that EP fits the model."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise SpecError(f"ep must be a whole number >= 1, got {ep!r}")
    if ep == 1:
        return dp * tp
    experts = expert_params(spec)
    if not experts:
        raise SpecError(f"ep={ep}: model {spec.name!r} has no experts (expert parallelism splits a "
                        "mixture-of-experts model's experts)")
    single = next((p.name for p in experts if p.matrix_shape is None), None)
    if single is not None:
        raise SpecError(f"ep={ep}: expert parameter {single!r} is one expert's matrix; expert parallelism "
                        "needs the experts stacked (one [experts, m, n] tensor per layer and projection)")
    counts = {p.shape[0] for p in experts}
    uneven = next((n for n in sorted(counts) if n % ep), None)
    if uneven is not None:
        raise SpecError(f"ep={ep} does not divide the {uneven} experts of model {spec.name!r}")
    if (dp * tp) % ep:
        raise SpecError(f"ep={ep} does not divide the dp x tp = {dp} x {tp} GPUs of a pipeline stage")
    return dp * tp // ep


def dense_part(spec: ModelSpec) -> ModelSpec:
    """The model without its experts: what DP x TP lays out under expert parallelism."""
    return ModelSpec(spec.name, tuple(p for p in spec.params if p.role is not Role.EXPERT))


def expert_part(spec: ModelSpec, ep: int) -> ModelSpec:
    """One EP rank's experts: each stack with `experts / ep` of its experts (the names are the
    model's; EP rank `j`'s stack holds experts `j E / ep` onwards)."""
    stacks = []
    for p in expert_params(spec):
        shape = (p.shape[0] // ep, *p.shape[1:])
        stacks.append(replace(p, shape=shape))
    return ModelSpec(f"{spec.name} experts / ep {ep}", tuple(stacks))


def router_imbalance(loads: float | tuple[float, ...] | list[float], experts: int, ep: int) -> float:
    """How much more the busiest EP rank of a group receives than the mean: `loads` is that
    factor itself (>= 1), or the router's histogram, one share of the tokens per expert (any
    non-negative scale), whose EP ranks' sums (experts in blocks of `experts / ep`) give it."""
    if isinstance(loads, (int, float)) and not isinstance(loads, bool):
        if not 1.0 <= float(loads) < float("inf"):
            raise SpecError(f"router imbalance must be a number >= 1 (busiest EP rank / mean), got {loads!r}")
        return float(loads)
    shares = list(loads)
    if len(shares) != experts or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and
                                         0 <= x < float("inf") for x in shares) or sum(shares) <= 0:
        raise SpecError(f"a router histogram gives one non-negative share per expert ({experts}), not all zero; "
                        f"got {len(shares)} values")
    per_rank = experts // ep
    ranks = [sum(shares[j * per_rank:(j + 1) * per_rank]) for j in range(ep)]
    return max(ranks) / (sum(ranks) / ep)
