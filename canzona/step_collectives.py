"""Every collective of one training step, as the runtime issues and logs it (docs/design.md §8.6).

One definition, two users: the simulator prices these collectives, and the runtime's collective
logs (`canzona.runtime.comm.CollectiveLog`) are checked against them record for record (op, group,
name, bytes per rank, order), on every rank, for every step policy, DP, DP x TP
(`tests/policy/test_step_collectives.py`) and DP = EDP x EP
(`tests/runtime/test_runtime_ep_collectives.py`). The TP part comes from
`canzona.step_schedule.tp_schedule`.

`step_collectives(plan, spec, policy, dp_rank, tp_rank)` lists, in the order the runtime issues
them (DP and TP interleaved), the collectives of rank (dp_rank, tp_rank) in a normal step:

1. backward: per plan bucket, in the plan's bucket order, one reduce-scatter-v of the whole bucket
   ("bucket i"), launched from gradient hooks once the bucket's gradients are complete; on the plan's
   segments under a reduce-scatter policy (canzona, zero1-gather), on even segments under an
   all-reduce policy (sc, layerwise), which finish the all-reduce by the all-gather of step 2;
2. step, before the checks: the reduce-scatter-v of the AdamW buffer ("adamw", even segments);
   then, for the all-reduce policies and the plans that split matrices between ranks
   (zero1-gather's, and canzona's where it keeps ZeRO-1's even segments:
   `StepPolicy.gathers_split`), one all-gather-v per bucket of the reduced gradients on the same
   segments ("gradients of bucket i": every rank ends with the whole bucket);
   for the replicated policy (sc), an all-gather-v of the AdamW gradients ("adamw gradients");
   under canzona's whole-matrix plans, the TP schedule's prefetched gathers
   (`TPSchedule.prefetched`: those ahead of its first compute), issued as their buckets land;
3. check: the step check over DP ("step check", which also carries each rank's share of the global
   gradient norm and its clip threshold); under TP also the TP step check ("tp step check") and
   the TP verdict over DP ("tp verdict");
4. clip, only when `clip_grad_norm_(norm_type=inf)` is called: the largest magnitude over DP, then
   over TP ("gradient norm"; the 2-norm travels in the step check); and when `clip_grad_norm_` is
   called at all (`clipped`), `step()` reuses its check and rechecks what may have changed since on
   one rank (a learning rate, a gradient dropped): the hyper-parameters' digest, the threshold and
   a local problem over DP with the model-loaded mark ("step recheck", four words), under TP the
   first two over TP with the DP verdict and the mark ("tp step recheck", four);
5. step: the TP schedule's exchanges on the TP group, in its (pipelined or serial) order, less
   those prefetched in 2;
6. params: the parameter all-gather of the policy over DP, per bucket in bucket order ("parameters
   of bucket i" on the plan's segments, or, for layerwise, "owned parameters of bucket i": what
   each owner packs), then "adamw parameters" (even segments); nothing under sc.

The DP collectives are the same on every DP rank (each record lists every member's bytes); the TP
all-to-alls differ per TP rank (a record is the bytes that rank sends to each member).

Under expert parallelism (`experts=Experts(...)`; `canzona.experts`, docs/design.md §2.7) `plan`
and `spec` are the dense part's, and the experts of the rank's EP rank, planned over its EDP group,
add the same list of their own on group "edp" (`EDP_GROUP`: the name the runtime's EDP `Comm`
logs under; expert TP's exchanges on "etp"): their buckets' reduce-scatters from their own
hooks, their AdamW buffer (which holds no parameter: one padded fp32 slice per rank, reduced and
gathered all the same), the policy's gradient gathers, their step check and their parameter
gathers. The two lists merge as the runtime issues them (`_with_experts`): backward's reductions
by the layer whose backward completes each bucket (`backward_layers`; the experts' first at the
same layer), then the experts' step collectives and check (the dense check carries their share of
the gradient norm and their got-a-gradient flags), the dense part's step collectives, checks and
clip, the dense parameter gathers, the experts'. The EP group carries nothing of the optimizer's: the token dispatch
all-to-alls are the model's (forward and backward), not logged. With a TP dense part (the
experts folded over the `dp x tp` ranks) the dense list is rank (`dp_rank`, `tp_rank`)'s as
without EP, TP exchanges and checks included, and construction's agreement verdict, on the first
step, comes before both parts' records. The runtime runs EP at expert TP 1, with one step
policy (`check_runtime_experts`); under `overlap_step` the experts' updates are computed as their
buckets land, which at expert TP 1 exchanges nothing, so their records are as without it. The
Megatron style is defined for any layout.

`style="megatron"` lists instead the DP collectives each policy runs under Megatron-LM (an
all-reduce per bucket for sc and layerwise, a reduce-scatter-v on the plan's segments otherwise;
AdamW's parameters reduced at the end of backward; the all-to-all of the parts of split matrices
that other ranks compute, zero1-gather's and canzona's even-segment plans'; no checks; the
parameter all-gathers), with the same TP exchanges: the simulator prices every collective from
these records, in either style (`sim.iteration`).

Differences between steps: the first step's DP log also holds, at its start, the agreement verdict
that construction spreads over DP under TP (`first_step=True`); construction's agreement
all-gathers of digests are not logged. A skipped step (`skipped=True`: a non-finite gradient
norm, finite weights, `nonfinite="skip"` or GradScaler's verdict) sends after the checks the
weights' finiteness ("non-finite weights": one word over DP, then over TP), and nothing after
them (no exchange still to run, no parameter gather); regular steps are as listed above. Gradient accumulation changes nothing: `no_sync()`
micro-batches launch no collective and the synchronising backward launches each bucket once (a
bucket whose gradients did not all arrive in it is launched at the start of `step()` instead,
same record, same order).

Sizes come from the plan and the spec: bucket sizes and segments from the DP plan, the AdamW
buffer (the local AdamW parameters packed end to end, padded to a multiple of `align x dp`, with
the plan's alignment, as the runtime pads it), the step checks (one 8-byte word per
parameter plus six, one of them the mark of a model loaded since the last step; under TP four
more plus two per TP-replicated parameter; under EP the dense
part's checks one more per expert stack of the EP rank: the experts' got-a-gradient flags, which
they combine over the whole cluster, so that a stack no rank reached is skipped), dtypes from the
spec: gradients are reduced in fp32 when the model has bf16 / fp16 parameters and master weights
are on (the runtime's default), otherwise in the parameters' dtype; parameters are gathered in
their own dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from canzona.choices import check_choice
from canzona.dp.layout import BucketPlan, ceil_to, even_cuts
from canzona.errors import SpecError
from canzona.fsdp_collectives import WEIGHTS_CHECK
from canzona.plan import Plan, check_plan_matches
from canzona.spec import DTYPE_BYTES, ModelSpec, ParamSpec
from canzona.step_policies import PARAMS_BY_OWNER, PARAMS_NONE, StepPolicy, get_step_policy
from canzona.step_schedule import ALL_GATHER, PIPELINED, TP_GROUP, tp_schedule

DP_GROUP = "dp"  # the name the runtime's DP Comm logs under (TP_GROUP: "tp")
# expert parallelism: the experts' groups, in place of DP and TP (the runtime's EDP Comm logs as "edp")
EDP_GROUP, ETP_GROUP = "edp", "etp"
EXPERT_GROUPS = {DP_GROUP: EDP_GROUP, TP_GROUP: ETP_GROUP}
DATA_GROUPS = (DP_GROUP, EDP_GROUP)  # the groups gradients are reduced over
REDUCE_SCATTER_V, ALL_GATHER_V = "reduce-scatter-v", "all-gather-v"
# even collectives priced by their whole buffer (`StepCollective.total`): the Megatron style's
ALL_REDUCE, REDUCE_SCATTER, DP_ALL_TO_ALL = "all-reduce", "reduce-scatter", "all-to-all"
# whose collectives: exactly the runtime's (logged and checked), or each policy's as Megatron-LM runs
# it (all-reduce for sc and layerwise, AdamW's reduced in backward, only the split parts of
# zero1-gather's matrices gathered, no checks); the simulator prices either from these records
RUNTIME_STYLE, MEGATRON_STYLE = "runtime", "megatron"
COLLECTIVE_STYLES = (MEGATRON_STYLE, RUNTIME_STYLE)
# phases: launched by gradient hooks during backward; inside step() (or clip_grad_norm_) before any
# parameter changes; the runtime's own checks; the gradient norm of clip_grad_norm_; the parameter
# all-gathers after the update
BACKWARD, STEP, CHECK, CLIP, PARAMS = "backward", "step", "check", "clip", "params"
PHASES = (BACKWARD, STEP, CHECK, CLIP, PARAMS)
AGREEMENT_VERDICT = "agreement verdict"  # construction's, spread over DP under TP (logged on the first step)
CHECK_WORD_BYTES = 8  # the step checks and verdicts are int64 (the gradient norm float64) values
LOW_PRECISION = frozenset({"bf16", "fp16"})
FP32_BYTES = DTYPE_BYTES["fp32"]


@dataclass(frozen=True)
class StepCollective:
    """One collective as the runtime logs it, plus what the simulator needs to price it."""

    op: str  # "reduce-scatter-v", "all-gather-v", "all-gather" or "all-to-all", as logged
    group: str  # DP_GROUP or TP_GROUP (under expert parallelism also EDP_GROUP, ETP_GROUP)
    name: str  # as logged
    bytes_per_rank: tuple[int, ...]  # as logged: each member's bytes (all-to-all: sent to each member)
    phase: str  # one of PHASES
    segments: tuple[int, ...] = ()  # -v ops: bytes of each member's segment, in rank order
    bucket: int | None = None  # the DP plan bucket (its index) it belongs to
    sent: tuple[tuple[int, ...], ...] = ()  # all-to-alls: bytes from member s to member d, whole group
    total: int | None = None  # even collectives of the Megatron style: bytes of the whole buffer, as priced

    def logged(self) -> tuple[str, str, str, tuple[int, ...]]:
        """(op, group, name, bytes per rank): the fields of the runtime's `CollectiveRecord`."""
        return self.op, self.group, self.name, self.bytes_per_rank


@dataclass(frozen=True)
class _Buffer:
    """One flat buffer of the runtime: its elements, and bytes per element reduced and gathered."""

    size: int
    grad_bytes: int
    param_bytes: int


@dataclass(frozen=True)
class Experts:
    """The experts of one EP rank under expert parallelism (`canzona.experts`), as the step's
    collectives see them: their own plan over EDP (x ETP, the plan's `tp`), and this rank's place in it."""

    plan: Plan  # an EP rank's experts over EDP x ETP
    spec: ModelSpec  # what `plan` was made for (`canzona.experts.expert_part`)
    edp_rank: int = 0
    etp_rank: int = 0
    # the experts' step policy where it is not the dense part's (the simulator's fallback of the
    # dense part alone to zero1-gather; the runtime runs one policy)
    policy: StepPolicy | str | None = None


def step_collectives(plan: Plan, spec: ModelSpec, policy: StepPolicy | str, dp_rank: int = 0, tp_rank: int = 0,
                     *, tp_mode: str = PIPELINED, grad_bytes: int | None = None, param_bytes: int | None = None,
                     master_weights: bool = True, first_step: bool = False,
                     inf_norm: bool = False, clipped: bool = False, overlap_step: bool = False,
                     experts: Experts | None = None, style: str = RUNTIME_STYLE,
                     skipped: bool = False) -> list[StepCollective]:
    """Every collective rank (`dp_rank`, `tp_rank`) issues in one training step, in issue order.

    `spec`: the global model the plan was made for. `grad_bytes` / `param_bytes`: bytes per element
    of reduced gradients / of gathered parameters, for every buffer; by default derived per buffer
    from the spec's dtypes and `master_weights` (as the runtime derives them). `first_step`: include
    what the first step's log also holds. `inf_norm`: `clip_grad_norm_(..., norm_type=inf)` is
    called before `step()`; `clipped`: `clip_grad_norm_` (by the 2-norm, or by the inf-norm:
    `inf_norm` implies it) is called once before `step()`. `overlap_step`: the TP schedule's exchanges run before the step checks
    (a step whose gradients clipping scales issues them again after the checks: not listed).
    `experts`: expert parallelism; `plan` and `spec` are then the dense part's
    (`canzona.experts.dense_part`), and the experts' collectives join them (`_with_experts`).
    `skipped`: the step check found a non-finite gradient norm and finite weights, and the step
    was skipped (`nonfinite="skip"`, or torch.amp.GradScaler's verdict): the weights' finiteness
    after the checks (`WEIGHTS_CHECK`, one word over DP, then TP: the runtime's
    `nonfinite.nonfinite_weights_error`), and nothing after the checks (the exchanges still to run,
    the parameter gathers; FSDP2's alike: `fsdp_collectives`). Runtime style only. A GradScaler
    step, skipped or not, also holds the step's recheck: list it with `clipped=True`.
    `style="megatron"`: the collectives each policy runs under Megatron-LM instead (`_megatron`),
    which the simulator prices by default; only the runtime's are logged."""
    check_choice(style, COLLECTIVE_STYLES, "collectives style")
    if skipped and style != RUNTIME_STYLE:
        raise SpecError("a skipped step's collectives are the runtime's (style='runtime'): Megatron-LM's checks "
                        "are not listed")
    if isinstance(policy, str):
        policy = get_step_policy(policy)
    # masters when any parameter is low-precision (the runtime decides once, for both parts)
    params = (*spec.params, *(experts.spec.params if experts is not None else ()))
    master = master_weights and any(p.dtype in LOW_PRECISION for p in params)
    options = dict(tp_mode=tp_mode, grad_bytes=grad_bytes, param_bytes=param_bytes, master=master,
                   overlap_step=overlap_step, style=style, skipped=skipped)
    # under EP the dense checks also carry the experts' got-a-gradient flags, one word per stack
    more_flags = len(experts.spec.params) if experts is not None else 0
    dense = _part(plan, spec, policy, dp_rank, tp_rank, first_step=first_step, inf_norm=inf_norm,
                  clipped=clipped or inf_norm, more_flags=more_flags, **options)
    if experts is None:
        return dense
    expert_policy = policy if experts.policy is None else experts.policy
    expert_policy = get_step_policy(expert_policy) if isinstance(expert_policy, str) else expert_policy
    if style == RUNTIME_STYLE:
        check_runtime_experts(plan.tp, experts.plan.tp)
        if expert_policy != policy:
            raise SpecError(f"the runtime runs one step policy: the experts' {expert_policy.name} is not the dense "
                            f"part's {policy.name}")
    # skipped: the experts' check looks at no weights (the dense one looks at every rank's), and
    # their parameter gathers are skipped as the dense part's
    own = [replace(c, group=EXPERT_GROUPS[c.group])
           for c in _part(experts.plan, experts.spec, expert_policy, experts.edp_rank, experts.etp_rank,
                          first_step=False, inf_norm=False, clipped=False, more_flags=0,
                          **{**options, "skipped": False}) if not (skipped and c.phase == PARAMS)]
    return _with_experts(dense, own, backward_layers(plan, spec), backward_layers(experts.plan, experts.spec))


def check_runtime_experts(tp: int, etp: int) -> None:
    """What of expert parallelism the runtime runs (one SpecError otherwise): experts without TP
    (the dense part at any TP; an overlapped step too, whose experts exchange nothing at TP 1)."""
    if etp > 1:
        raise SpecError(f"the runtime runs expert parallelism at etp 1 (got etp {etp}, at tp {tp}): its collectives "
                        "under expert TP are not defined")


def _with_experts(dense: list[StepCollective], experts: list[StepCollective], dense_layers: dict[int, int],
                  expert_layers: dict[int, int]) -> list[StepCollective]:
    """The dense part's and the experts' collectives of one step, in the order the runtime issues
    them: backward's reductions as the hooks launch them, each part's in bucket order, the two
    merged by the layer whose backward completes each bucket (`backward_layers`; at the same
    layer the experts' first: a decoder layer's MoE block follows its attention, so backward
    reaches the experts first); records of no bucket (Megatron's AdamW reduction) after them; then
    the experts' step collectives and check over EDP (the dense check carries their gradient
    norm and got-a-gradient flags), the dense part's step collectives, checks and exchanges, the dense part's parameter
    gathers, then the experts'. Construction's agreement verdict (the first step under TP) comes
    before all of them."""
    def key(c: StepCollective, part: int, k: int) -> tuple:
        layers = expert_layers if part == 0 else dense_layers
        return (math.inf if c.bucket is None else -layers[c.bucket], part, k)

    verdict = [c for c in dense if c.name == AGREEMENT_VERDICT]
    dense = [c for c in dense if c.name != AGREEMENT_VERDICT]
    backward = sorted([(key(c, part, k), c) for part, records in enumerate((experts, dense))
                       for k, c in enumerate(records) if c.phase == BACKWARD], key=lambda kc: kc[0])
    return verdict + [c for _, c in backward] + [c for c in experts if c.phase not in (BACKWARD, PARAMS)] + \
        [c for c in dense if c.phase != BACKWARD] + [c for c in experts if c.phase == PARAMS]


def backward_layers(plan: Plan, spec: ModelSpec) -> dict[int, int]:
    """Per plan bucket (by index), the layer whose backward completes its gradients: the lowest
    layer it holds (0 where none says), or a lower one an earlier bucket waits for (the runtime
    launches buckets in bucket order). What orders the reductions of two plans in one backward."""
    out: dict[int, int] = {}
    reached: int | None = None
    for b in plan.dp_plan.buckets:
        first = min((x for x in (spec.param(p.name).layer for p in b.params) if x is not None), default=0)
        reached = first if reached is None else min(reached, first)
        out[b.index] = reached
    return out


def _part(plan: Plan, spec: ModelSpec, policy: StepPolicy, dp_rank: int, tp_rank: int, *, tp_mode: str,
          grad_bytes: int | None, param_bytes: int | None, master: bool, first_step: bool,
          inf_norm: bool, clipped: bool, overlap_step: bool, style: str, more_flags: int,
          skipped: bool = False) -> list[StepCollective]:
    """`step_collectives` of one plan (a dense model, or one part of an expert-parallel one);
    `more_flags`: another part's parameters whose got-a-gradient flags its checks carry;
    `skipped`: the step was skipped (`step_collectives`)."""
    dp, tp = plan.dp, plan.tp
    if not 0 <= tp_rank < tp:
        raise SpecError(f"tp rank {tp_rank} is outside 0..{tp - 1}")
    check_plan_matches(plan, spec)
    policy.check_dp_plan(plan.dp_plan)
    policy.check_tp_plan(plan.tp_plan.policy, tp)
    buckets = plan.dp_plan.buckets
    grads = [_buffer(f"bucket {b.index}", [spec.param(p.name) for p in b.params], b.size, master, grad_bytes,
                     param_bytes) for b in buckets]
    adamw_params = spec.adamw_params()
    adamw_size = ceil_to(max(sum(p.local_numel(tp) for p in adamw_params), 1), plan.dp_plan.align * dp)
    adamw = _buffer("the AdamW buffer", adamw_params, adamw_size, master, grad_bytes, param_bytes)
    adamw_cuts = even_cuts(adamw.size, dp)
    reduce_scatter = policy.grad_sync == "reduce-scatter"

    def grad_cuts(b: BucketPlan) -> tuple[int, ...]:
        return b.cuts if reduce_scatter else even_cuts(b.size, dp)

    def v(op: str, name: str, cuts: Sequence[int], per_element: int, phase: str, bucket: int | None = None,
          whole: int | None = None) -> StepCollective:
        """A -v collective on segments `cuts`; `whole`: every member sends the whole buffer (reduce-scatter)."""
        segments = tuple(per_element * (b - a) for a, b in zip(cuts, cuts[1:]))
        sent = segments if whole is None else (whole * per_element,) * dp
        return StepCollective(op, DP_GROUP, name, sent, phase, segments, bucket)

    def check(group: str, name: str, words: int, members: int, phase: str = CHECK) -> StepCollective:
        return StepCollective(ALL_GATHER, group, name, (words * CHECK_WORD_BYTES,) * members, phase)

    # the TP schedule: gradients are gathered in the dtype of the first bucket's reduction,
    # updates scattered in the dtype they are applied in (the fp32 masters, or that dtype)
    tp_grad_bytes = grads[0].grad_bytes if grads else FP32_BYTES
    schedule = tp_schedule(plan, spec, policy, dp_rank, tp_mode, grad_bytes=tp_grad_bytes,
                           update_bytes=FP32_BYTES if master else tp_grad_bytes, overlap_step=overlap_step)
    exchanges = [StepCollective(ex.op, TP_GROUP, ex.name, ex.record(tp_rank), STEP, sent=ex.sent)
                 for ex in schedule.exchanges]
    # the leading gathers the runtime issues as their buckets land, before the checks (each
    # prefetched op is a gather that moves something: `_ops` lists no empty one)
    prefetched = len(schedule.prefetched)
    if style == MEGATRON_STYLE:
        used = sum(p.local_numel(tp) for p in adamw_params)
        return _megatron(plan, policy, grads, used, adamw, exchanges)

    out: list[StepCollective] = []
    if first_step and tp > 1:
        out.append(check(DP_GROUP, AGREEMENT_VERDICT, 1, dp))
    # 1. backward: the buckets' reduce-scatters, in bucket order
    out += [v(REDUCE_SCATTER_V, f"bucket {b.index}", grad_cuts(b), buf.grad_bytes, BACKWARD, b.index, b.size)
            for b, buf in zip(buckets, grads)]
    # 2. the AdamW reduce-scatter, and the gradient all-gathers of the policies that need whole gradients
    out.append(v(REDUCE_SCATTER_V, "adamw", adamw_cuts, adamw.grad_bytes, STEP, whole=adamw.size))
    if not reduce_scatter or policy.gathers_split(plan.dp_plan):
        out += [v(ALL_GATHER_V, f"gradients of bucket {b.index}", grad_cuts(b), buf.grad_bytes, STEP, b.index)
                for b, buf in zip(buckets, grads)]
    if policy.replicated:
        out.append(v(ALL_GATHER_V, "adamw gradients", adamw_cuts, adamw.grad_bytes, STEP))
    if overlap_step:  # computed as the buckets land, before the checks (applied after them)
        policy.check_overlap_step(True)
        out += exchanges
    else:  # the prefetched gathers, issued as their buckets land
        out += exchanges[:prefetched]
    # 3. the step checks
    # after another part's flags, each check's word of the model loaded since the last step
    # (`GradientSync.prepare`'s `loaded`, canzona.runtime.model_loads)
    flags = len(spec.params) + more_flags + 1
    out.append(check(DP_GROUP, "step check", flags + 5, dp))
    if tp > 1:
        replicated = sum(p.tp_dim is None for p in spec.params)
        out.append(check(TP_GROUP, "tp step check", 4 + flags + 2 * replicated, tp))
        out.append(check(DP_GROUP, "tp verdict", 1, dp))
    if skipped:  # a non-finite norm: the weights' finiteness, over DP then TP (one word each)
        out.append(check(DP_GROUP, WEIGHTS_CHECK, 1, dp))
        if tp > 1:
            out.append(check(TP_GROUP, WEIGHTS_CHECK, 1, tp))
    # 4. clip_grad_norm_ by the inf-norm: each rank's largest magnitude over DP, then over TP
    if inf_norm:
        out.append(check(DP_GROUP, "gradient norm", 1, dp, CLIP))
        if tp > 1:
            out.append(check(TP_GROUP, "gradient norm", 1, tp, CLIP))
    # step() after clip_grad_norm_: the check reused, (digest, threshold, local problem, the
    # model-loaded mark) rechecked
    # (the experts' part issues nothing: the dense recheck spans every rank and carries its problem)
    if clipped:
        out.append(check(DP_GROUP, "step recheck", 4, dp))
        if tp > 1:
            out.append(check(TP_GROUP, "tp step recheck", 4, tp))
    if skipped:  # nothing more: no update is exchanged or gathered
        return out
    # 5. the TP schedule, after the checks (unless overlapped), less the prefetched gathers
    if not overlap_step:
        out += exchanges[prefetched:]
    # 6. the parameter all-gathers
    if policy.param_gather != PARAMS_NONE:
        for b, buf in zip(buckets, grads):
            if policy.param_gather == PARAMS_BY_OWNER:
                packed = [sum(p.numel for p in b.params if p.owner == r) for r in range(dp)]
                cuts = [0]
                for n in packed:
                    cuts.append(cuts[-1] + n)
                out.append(v(ALL_GATHER_V, f"owned parameters of bucket {b.index}", cuts, buf.param_bytes,
                             PARAMS, b.index))
            else:
                out.append(v(ALL_GATHER_V, f"parameters of bucket {b.index}", b.cuts, buf.param_bytes, PARAMS,
                             b.index))
        out.append(v(ALL_GATHER_V, "adamw parameters", adamw_cuts, adamw.param_bytes, PARAMS))
    return out


def _megatron(plan: Plan, policy: StepPolicy, grads: Sequence[_Buffer], adamw_used: int, adamw: _Buffer,
              exchanges: list[StepCollective]) -> list[StepCollective]:
    """The DP collectives of a step as Megatron-LM runs `policy` (names as the simulator shows
    them): per bucket in backward an all-reduce of the whole bucket (sc, layerwise) or a
    reduce-scatter-v on the plan's segments; at the end of backward AdamW's parameters (their
    elements, unpadded) all-reduced or reduce-scattered; the all-to-all of the parts of
    split matrices that other ranks compute; the TP exchanges; the parameter all-gathers per bucket
    (segments, or what each owner packs) and AdamW's."""
    dp, buckets = plan.dp, plan.dp_plan.buckets
    all_reduce = policy.grad_sync == "all-reduce"
    out: list[StepCollective] = []
    for b, buf in zip(buckets, grads):
        name = f"grad sync bucket {b.index}"
        if all_reduce:
            out.append(StepCollective(ALL_REDUCE, DP_GROUP, name, (b.size * buf.grad_bytes,) * dp, BACKWARD,
                                      bucket=b.index, total=b.size * buf.grad_bytes))
        else:
            segments = tuple(n * buf.grad_bytes for n in b.segment_lengths())
            out.append(StepCollective(REDUCE_SCATTER_V, DP_GROUP, name, segments, BACKWARD, segments, b.index))
    adamw_bytes = adamw_used * adamw.grad_bytes
    if adamw_used:  # an EP rank's experts have no AdamW parameters: nothing to reduce
        out.append(StepCollective(ALL_REDUCE if all_reduce else REDUCE_SCATTER, DP_GROUP, "grad sync adamw",
                                  (adamw_bytes,) * dp, BACKWARD, total=adamw_bytes))
    if policy.gathers_split(plan.dp_plan):
        sent = [[0] * dp for _ in range(dp)]
        for b, buf in zip(buckets, grads):
            for p in b.params:
                holders = b.ranks_overlapping(p)
                for r in plan.dp_plan.computing_ranks(b, p):
                    for j in holders:
                        if j != r:
                            lo, hi = b.segment(j)
                            sent[j][r] += (min(hi, p.end) - max(lo, p.offset)) * buf.grad_bytes
        out.append(StepCollective(DP_ALL_TO_ALL, DP_GROUP, "gather split gradients", tuple(map(sum, sent)), STEP,
                                  sent=tuple(map(tuple, sent))))
    out += exchanges
    if policy.param_gather != PARAMS_NONE:
        for b, buf in zip(buckets, grads):
            if policy.param_gather == PARAMS_BY_OWNER:
                lengths = [sum(p.numel for p in b.params if p.owner == r) for r in range(dp)]
            else:
                lengths = list(b.segment_lengths())
            segments = tuple(n * buf.param_bytes for n in lengths)
            out.append(StepCollective(ALL_GATHER_V, DP_GROUP, f"param gather bucket {b.index}", segments, PARAMS,
                                      segments, b.index))
        params_bytes = adamw_used * adamw.param_bytes
        if adamw_used:
            out.append(StepCollective(ALL_GATHER, DP_GROUP, "param gather adamw", (params_bytes,) * dp, PARAMS,
                                      total=params_bytes))
    return out


def _buffer(what: str, params: Sequence[ParamSpec], size: int, master: bool, grad_bytes: int | None,
            param_bytes: int | None) -> _Buffer:
    """Bytes per element as the runtime's `FlatBuffer` holds them: the parameters' dtype (one per
    buffer), reduced in fp32 when master weights are on; an empty one (the AdamW buffer of an EP
    rank's experts) is fp32 whatever the others' bytes, as it has no parameter to take a dtype from."""
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        raise SpecError(f"parameters sharing {what} must share a dtype, got {', '.join(sorted(dtypes))}")
    if not dtypes:
        return _Buffer(size, FP32_BYTES, FP32_BYTES)
    own = DTYPE_BYTES[dtypes.pop()]
    reduced = (FP32_BYTES if master else own) if grad_bytes is None else grad_bytes
    return _Buffer(size, reduced, own if param_bytes is None else param_bytes)


def step_records(collectives: Sequence[StepCollective], group: str | None = None
                 ) -> list[tuple[str, str, str, tuple[int, ...]]]:
    """(op, group, name, bytes per rank) of each collective (of one group, if given), in order: what
    the runtime's log holds for one step."""
    return [c.logged() for c in collectives if group is None or c.group == group]
