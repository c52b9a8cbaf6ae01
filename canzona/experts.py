"""Expert parallelism (EP) and expert tensor parallelism (ETP) for mixture-of-experts models
(docs/design.md §2.7): what one EP rank holds and the groups its expert gradients are reduced over.

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

With expert TP (Megatron's `expert_tensor_parallel_size`, `etp` > 1) the folding has three
axes, ETP fastest: `dp x tp = edp x ep x etp`; the `etp` consecutive ranks of an ETP group hold
shards of the same experts, the EP group is the ranks at one ETP position of `ep` consecutive
ETP groups, and the EDP group the ranks at one (EP, ETP) position. Each expert matrix is split
over its ETP group as Megatron splits an expert MLP (`expert_tp_dim`): the first linear (gate,
up) column-parallel, rows split; the second (down) row-parallel, columns split. The expert plan
is then a plan over EDP x ETP: owners over EDP, whole matrices as before, and within each ETP
group the TP scheduler's hosts and micro-groups, exactly as a dense plan over DP x TP.
"""

from __future__ import annotations

from dataclasses import replace

from canzona.errors import SpecError
from canzona.spec import ModelSpec, ParamSpec, Role

# what a stack's last name part says when its matrices are as wide as the hidden size: the second
# linear of an expert MLP (transformers' down_proj, Mixtral's w2, Megatron's linear_fc2)
SECOND_LINEAR_NAMES = ("down", "w2", "fc2")


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
    check_whole_stacks(spec)
    for p in experts + [p for p in spec.params if p.role is Role.ROUTER]:
        count = p.shape[0]
        if (p.matrix_shape is not None or p.role is Role.ROUTER) and count != moe[0]:
            raise SpecError(f"parameter {p.name!r} has {count} experts, but the architecture of {spec.name!r} "
                            f"says {moe[0]}")


def check_whole_stacks(spec: ModelSpec) -> None:
    """A model's stacks are whole (no `tp_dim`): how experts split over TP is the layout's `etp`
    (`expert_part`), one definition, never the model's."""
    split = next((p for p in spec.stacks if p.tp_dim is not None), None)
    if split is not None:
        raise SpecError(f"parameter {split.name!r}: a stack of matrices cannot be split by TP in a model (tp_dim "
                        f"{split.tp_dim}); the model's experts are whole, and expert TP is the layout's etp")


def expert_width(spec: ModelSpec, moe: tuple[int, int], hidden: int) -> float:
    """An expert's SwiGLU width, from its weights (gate, up and down: 3 x width x hidden each)."""
    total = sum(p.numel for p in expert_params(spec))
    layers = len({p.layer for p in expert_params(spec)}) or 1
    return total / (layers * moe[0] * 3 * hidden)


def _whole(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"{name} must be a whole number >= 1, got {value!r}")
    return value


def check_ep(spec: ModelSpec, ep: int, dp: int, tp: int, etp: int = 1, hidden: int | None = None) -> int:
    """The EDP size of `ep` x `etp` on a stage of `dp x tp` GPUs, after checking that EP and
    expert TP fit the model (`hidden`: the model's hidden size, which tells which dimension of
    each expert matrix expert TP splits; needed for `etp` > 1)."""
    _whole("ep", ep)
    _whole("etp", etp)
    if etp > 1 and ep == 1:
        # at EP 1 the experts are planned with the dense part, whole on every TP rank (what the
        # runtime runs): expert TP is a layout of the expert part, which only EP makes
        raise SpecError(f"etp={etp} needs expert parallelism (ep > 1): at ep 1 the experts are planned with the "
                        "dense part, whole on every TP rank")
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
    if (dp * tp) % (ep * etp):
        raise SpecError(f"ep x etp = {ep} x {etp} does not divide the dp x tp = {dp} x {tp} GPUs of a pipeline "
                        "stage (dp x tp = edp x ep x etp)")
    if etp > 1:
        if hidden is None:
            raise SpecError("etp > 1 needs the model's hidden size, which tells each expert matrix's split")
        for p in experts:
            assert p.matrix_shape is not None
            axis = expert_tp_dim(p, hidden) - (len(p.shape) - 2)
            if p.matrix_shape[axis] % etp:
                raise SpecError(f"etp={etp} does not divide the {p.matrix_shape[axis]} {('rows', 'columns')[axis]} "
                                f"of the {p.matrix_shape[0]} x {p.matrix_shape[1]} matrices of expert stack {p.name!r}")
    return dp * tp // (ep * etp)


def expert_tp_dim(p: ParamSpec, hidden: int) -> int:
    """The dimension of stack `p` that expert TP splits, as Megatron splits an expert MLP
    (`TEGroupedMLP` / `SequentialMLP` under `expert_tensor_parallel_size`): the first linear
    (gate and up, `width x hidden` matrices) column-parallel, rows split; the second (down,
    `hidden x width`) row-parallel, columns split. Experts as wide as the hidden size are told
    apart by name (`SECOND_LINEAR_NAMES`)."""
    assert p.matrix_shape is not None
    rows, cols = p.matrix_shape
    last = p.name.rsplit(".", 1)[-1].lower()
    if cols == hidden and rows != hidden:
        axis = 0
    elif rows == hidden and cols != hidden:
        axis = 1
    elif rows == cols == hidden:
        axis = 1 if any(word in last for word in SECOND_LINEAR_NAMES) else 0
    else:
        raise SpecError(f"expert stack {p.name!r}: neither dimension of its {rows} x {cols} matrices is the hidden "
                        f"size {hidden}, so expert TP cannot tell its first linear from its second")
    return len(p.shape) - 2 + axis


def _split(p: ParamSpec, hidden: int) -> ParamSpec:
    return replace(p, tp_dim=expert_tp_dim(p, hidden))


def dense_part(spec: ModelSpec) -> ModelSpec:
    """The model without its experts: what DP x TP lays out under expert parallelism."""
    return ModelSpec(spec.name, tuple(p for p in spec.params if p.role is not Role.EXPERT))


def expert_part(spec: ModelSpec, ep: int, etp: int = 1, hidden: int | None = None) -> ModelSpec:
    """One EP rank's experts: each stack with `experts / ep` of its experts (the names are the
    model's; EP rank `j`'s stack holds experts `j E / ep` onwards); with expert TP (`etp` > 1)
    each stack split along `expert_tp_dim` (the TP size is the plan's: plan it at tp = etp)."""
    stacks = []
    for p in expert_params(spec):
        shape = (p.shape[0] // ep, *p.shape[1:])
        stack = replace(p, shape=shape)
        if etp > 1:
            if hidden is None:
                raise SpecError("etp > 1 needs the model's hidden size, which tells each expert matrix's split")
            stack = _split(stack, hidden)
        stacks.append(stack)
    return ModelSpec(f"{spec.name} experts / ep {ep}", tuple(stacks))


def router_imbalance(loads: float | tuple[float, ...] | list[float], experts: int, ep: int) -> float:
    """How much more the busiest EP rank of a group receives than the mean: `loads` is that
    factor itself (>= 1), or the router's histogram, one share of the tokens per expert (any
    non-negative scale), whose EP ranks' sums (experts in blocks of `experts / ep`) give it."""
    if isinstance(loads, (int, float)) and not isinstance(loads, bool):
        return _factor(loads, ep)
    return max(rank_shares(loads, experts, ep))


def _factor(loads: float, ep: int) -> float:
    if not 1.0 <= float(loads) < float("inf"):
        raise SpecError(f"router imbalance must be a number >= 1 (busiest EP rank / mean), got {loads!r}")
    if float(loads) > ep:  # the busiest rank holds at most every pair of its group: ep times the mean
        raise SpecError(f"router imbalance {loads!r} is at most the EP size ({ep}: the busiest EP rank holding "
                        "every token-expert pair)")
    return float(loads)


def rank_shares(loads: float | tuple[float, ...] | list[float], experts: int, ep: int) -> tuple[float, ...]:
    """Each EP rank's mean share of the token-expert pairs over the mean rank's (mean 1), the
    persistent skew a router's random fluctuation rides on (`canzona.routing`): from the router's
    histogram (as `router_imbalance`), the ranks' sums; from a number, which names only the busiest
    rank, that rank at it and the others evenly below (the least skewed spread the number allows:
    an assumption; none below 0)."""
    if isinstance(loads, (int, float)) and not isinstance(loads, bool):
        busiest = _factor(loads, ep)
        rest = max(0.0, (ep - busiest) / (ep - 1)) if ep > 1 else busiest
        return (busiest,) + (rest,) * (ep - 1)
    shares = list(loads)
    bad = [x for x in shares if not (isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < float("inf"))]
    if len(shares) != experts or bad or sum(shares) <= 0:
        # say what is wrong: the count, a value (negative, not finite), or every share zero
        why = (f"got {len(shares)} values" if len(shares) != experts else
               f"got {bad[0]!r}" if bad else "got all zero")
        raise SpecError(f"a router histogram gives one non-negative share per expert ({experts}), not all zero; {why}")
    # relative to the largest: any scale is the same histogram, and a sum of large shares (1e308
    # each) would overflow to infinity, every rank's share then NaN
    top = max(shares)
    shares = [x / top for x in shares]
    per_rank = experts // ep
    ranks = [sum(shares[j * per_rank:(j + 1) * per_rank]) for j in range(ep)]
    mean = sum(ranks) / ep
    return tuple(r / mean for r in ranks)
