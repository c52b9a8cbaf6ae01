"""The optimizer-step policies compared by the simulator and run by the runtime (docs/design.md §7).

One definition, shared: how each policy synchronises gradients, which DP and TP plans it uses, and
what it communicates around the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from canzona.choices import check_choice
from canzona.dp.layout import DPPlan
from canzona.dp.policies import KEEPS_GEOMETRY, check_dp_policy, keeps_geometry
from canzona.errors import SpecError
from canzona.optimizers import matrix_optimizer

PARAMS_NONE = "none"  # every rank updated everything itself
PARAMS_BY_SEGMENT = "segments"  # all-gather(-v) of each bucket on the plan's segments
PARAMS_BY_OWNER = "owners"  # owners' matrices are scattered over the bucket: all-gather what each packs


@dataclass(frozen=True, kw_only=True)
class StepPolicy:
    """A step policy's registry entry (`STEP_POLICIES`): its properties, which every part of the
    toolkit reads instead of comparing names."""

    name: str
    grad_sync: Literal["all-reduce", "reduce-scatter"]
    replicated: bool  # every DP rank computes every matrix (sc)
    dp_policy: str | None  # its own DP policy; None: the user's choice (canzona)
    tp_policy: str | None  # its own TP scheduler; None: the user's choice
    gather_split: bool  # zero1-gather: fetch the other ranks' parts of split matrices
    # after the step, over DP: PARAMS_NONE, PARAMS_BY_SEGMENT or PARAMS_BY_OWNER
    param_gather: Literal["none", "segments", "owners"]
    # runs elementwise optimizers (AdamW), each rank updating the pieces its segments hold, and
    # only those; the others run whole-matrix optimizers only
    elementwise: bool = False
    # what this policy is under an elementwise optimizer (AdamW needs no whole matrix, so
    # zero1-gather's gather has nothing to fetch: it is zero1); None: it refuses one
    elementwise_as: str | None = None

    def check_optimizer(self, optimizer: str) -> None:
        """`optimizer` is one this policy runs; raise SpecError (one line) otherwise."""
        entry = matrix_optimizer(optimizer)
        if entry.elementwise != self.elementwise:
            fits = policies_running(optimizer)
            kind = "elementwise optimizers (adamw)" if self.elementwise else "whole-matrix optimizers"
            raise SpecError(f"policy {self.name} runs {kind}; {entry.name} runs under {', '.join(fits)}")

    def check_dp_policy(self, dp_policy: str) -> None:
        """The user's DP policy is one this step policy can execute (policies with their own plan
        ignore it); raise SpecError (one line) otherwise."""
        check_dp_policy(dp_policy)
        if self.dp_policy is None and dp_policy not in KEEPS_GEOMETRY:
            raise self._needs_whole_matrices(dp_policy)

    def check_dp_plan(self, dp_plan: DPPlan) -> None:
        """The DP plan is one this policy can execute; raise SpecError (one line) otherwise. A
        policy that takes the user's DP policy (canzona) executes its whole-matrix plans, and the
        even segments its planner keeps where whole matrices plan no shorter step
        (`canzona.plan.GEOMETRIES`)."""
        if self.dp_policy is not None and dp_plan.policy != self.dp_policy:
            raise SpecError(f"policy {self.name} needs a {self.dp_policy} plan, got {dp_plan.policy}")
        if self.dp_policy is None and not (keeps_geometry(dp_plan) or dp_plan.split_compute):
            raise self._needs_whole_matrices(dp_plan.policy)

    def gathers_split(self, dp_plan: DPPlan) -> bool:
        """Ranks fetch the other ranks' parts of the matrices they compute whole that straddle a
        cut (after the reduce-scatter): zero1-gather's always, canzona's where its plan keeps
        ZeRO-1's even segments; never where an elementwise optimizer updates the pieces in place."""
        return self.gather_split or (dp_plan.split_compute and not self.elementwise)

    def reads_reduce_scatter(self, dp_plan: DPPlan) -> bool:
        """Each matrix's owner reads its gradient straight from its bucket's reduce-scatter: what
        an overlapped step and the prefetched TP gathers need (`can_overlap_step`, for this plan)."""
        return self.can_overlap_step and not self.gathers_split(dp_plan)

    def check_tp_plan(self, tp_policy: str, tp: int) -> None:
        """The plan's TP scheduler is the one this policy runs (the baselines run `tp-sync`); at
        TP = 1 nothing moves between TP ranks and any scheduler's groups run alike."""
        if tp > 1 and self.tp_policy is not None and tp_policy != self.tp_policy:
            raise SpecError(f"policy {self.name} runs TP policy {self.tp_policy}, but the plan's is {tp_policy}")

    @property
    def gathers_params(self) -> bool:
        return self.param_gather != PARAMS_NONE

    @property
    def can_overlap_step(self) -> bool:
        """Each matrix's owner reads its gradient straight from its bucket's reduce-scatter (no
        all-reduce, no second gather of split matrices), so its update can be computed as soon as
        that bucket has landed (`overlap_step`)."""
        return (self.grad_sync == "reduce-scatter" and not self.gather_split and not self.replicated
                and not self.elementwise)

    def check_overlap_step(self, overlap_step: bool) -> None:
        """`overlap_step` is an option this policy can run; raise SpecError (one line) otherwise."""
        if overlap_step and not self.can_overlap_step:
            raise SpecError(f"overlap_step needs a policy whose owners read their gradients straight from the "
                            f"reduce-scatter (canzona); {self.name} does not")

    def _needs_whole_matrices(self, dp_policy: str) -> SpecError:
        return SpecError(f"policy {self.name} needs a DP plan that keeps every matrix whole inside its "
                         f"owner's segment; {dp_policy} does not (choose one of "
                         f"{', '.join(sorted(KEEPS_GEOMETRY))})")


STEP_POLICIES: dict[str, StepPolicy] = {
    "sc": StepPolicy(name="sc", grad_sync="all-reduce", replicated=True, dp_policy="whole-start",
                     tp_policy="tp-sync", gather_split=False, param_gather=PARAMS_NONE),
    "zero1-gather": StepPolicy(name="zero1-gather", grad_sync="reduce-scatter", replicated=False,
                               dp_policy="zero1-even", tp_policy="tp-sync", gather_split=True,
                               param_gather=PARAMS_BY_SEGMENT, elementwise_as="zero1"),
    "layerwise": StepPolicy(name="layerwise", grad_sync="all-reduce", replicated=False, dp_policy="layerwise",
                            tp_policy="tp-sync", gather_split=False, param_gather=PARAMS_BY_OWNER),
    "canzona": StepPolicy(name="canzona", grad_sync="reduce-scatter", replicated=False, dp_policy=None,
                          tp_policy=None, gather_split=False, param_gather=PARAMS_BY_SEGMENT),
    # Megatron's distributed optimizer with AdamW on every parameter: what users run today
    "zero1": StepPolicy(name="zero1", grad_sync="reduce-scatter", replicated=False, dp_policy="zero1-even",
                        tp_policy="tp-sync", gather_split=False, param_gather=PARAMS_BY_SEGMENT, elementwise=True),
}
MATRIX_POLICY = "canzona"  # the default step policy of a whole-matrix optimizer
ELEMENTWISE_POLICY = "zero1"  # of an elementwise one
ELEMENTWISE_BASELINE = "adamw"  # the optimizer of the baseline row beside the matrix policies (compare)


def default_policy(optimizer: str) -> str:
    """The step policy `optimizer` runs unless told otherwise: canzona, or zero1 for AdamW."""
    return ELEMENTWISE_POLICY if matrix_optimizer(optimizer).elementwise else MATRIX_POLICY


def resolve_policy(policy: str | None, optimizer: str) -> str:
    """The step policy `policy` names for `optimizer`: its default when None, and under an
    elementwise optimizer a policy's elementwise twin (`StepPolicy.elementwise_as`: zero1-gather
    with AdamW is Megatron's distributed optimizer, zero1). Unknown names pass through, for the
    caller's check to refuse."""
    if policy is None:
        return default_policy(optimizer)
    entry = STEP_POLICIES.get(policy)
    if entry is not None and entry.elementwise_as and matrix_optimizer(optimizer).elementwise:
        return entry.elementwise_as
    return policy


def policies_running(optimizer: str) -> tuple[str, ...]:
    """The step policies that run `optimizer` (`StepPolicy.check_optimizer` accepts), in order."""
    elementwise = matrix_optimizer(optimizer).elementwise
    return tuple(name for name, p in STEP_POLICIES.items() if p.elementwise == elementwise)


def dp_policies_running(optimizer: str) -> tuple[str, ...]:
    """The DP policies of the step policies that run `optimizer` and bring their own, in order,
    each once (AdamW: zero1-even); what `canzona plan` compares for an elementwise optimizer."""
    named = (STEP_POLICIES[name].dp_policy for name in policies_running(optimizer))
    return tuple(dict.fromkeys(name for name in named if name is not None))


def policy_optimizer(policy: str, optimizer: str) -> str:
    """The optimizer policy `policy` runs in a comparison of `optimizer`'s policies: `optimizer`,
    or the elementwise baseline (AdamW) under an elementwise policy."""
    if get_step_policy(policy).elementwise and not matrix_optimizer(optimizer).elementwise:
        return ELEMENTWISE_BASELINE
    return optimizer


OWNERS_BALANCED = "balanced"  # canzona's planner assigns each matrix to an owner, balancing cost
OWNERS_ROUND_ROBIN = "round-robin"  # matrix i to rank i mod S, in the model's order
OWNERS_NONE = "every-rank"  # every rank gathers and computes every matrix


@dataclass(frozen=True, kw_only=True)
class FsdpStepPolicy:
    """A step policy under the FSDP (ZeRO-3) layout (`FSDP_POLICIES`; docs/design.md §2.8): the
    parameters, gradients and state are sharded over the shard group, and the optimizer step
    starts from each rank's reduce-scattered shard of every gradient. Simulator only for now."""

    name: str
    # who computes each matrix's update: OWNERS_BALANCED, OWNERS_ROUND_ROBIN (each owner gathers
    # its matrices' shards by an all-to-all and sends the update's shards back by another) or
    # OWNERS_NONE (every rank all-gathers every matrix and computes it, keeping its shard)
    owners: Literal["balanced", "round-robin", "every-rank"]

    @property
    def gathers_all(self) -> bool:
        return self.owners == OWNERS_NONE


FSDP_POLICIES: dict[str, FsdpStepPolicy] = {
    "canzona": FsdpStepPolicy(name="canzona", owners=OWNERS_BALANCED),
    # muon_fsdp2 and torch's examples: every rank gathers the full gradient of every matrix
    "fsdp-gather-all": FsdpStepPolicy(name="fsdp-gather-all", owners=OWNERS_NONE),
    # owners without balancing: matrix i's owner is rank i mod S
    "fsdp-owners-unbalanced": FsdpStepPolicy(name="fsdp-owners-unbalanced", owners=OWNERS_ROUND_ROBIN),
}


def get_fsdp_policy(name: str) -> FsdpStepPolicy:
    try:
        return FSDP_POLICIES[name]
    except KeyError:
        raise SpecError(f"unknown policy {name!r} under --fsdp; choose one of {', '.join(FSDP_POLICIES)}") from None


def get_step_policy(name: str) -> StepPolicy:
    return STEP_POLICIES[check_choice(name, STEP_POLICIES, "policy")]
