"""Gradient buffers, their synchronisation over DP, and the per-step soundness check
(docs/design.md §8.2, §8.3).

Per plan bucket a flat gradient buffer (and one for the AdamW parameters, sliced evenly as ZeRO-1
does). A post-accumulate-grad hook moves each parameter's gradient into its bucket and leaves a
guard in `.grad` (`canzona.runtime.grad_guard`): nothing outside the optimizer reads or writes
memory that a collective may still touch. During backward each bucket's reduce-scatter (or
all-reduce, by the step policy) starts as soon as its last gradient has arrived, in bucket order
on every rank. `prepare()` finishes the synchronisation and checks, on every rank alike, that the
step is sound before anything is updated: every rank ran backward, no gradient was dropped or
replaced after it was handed to the reduction, the ranks agree on the hyper-parameters and the
clip threshold, and the global gradient norm (one scalar per rank, carried by the same check) is
finite.
"""

from __future__ import annotations

import contextlib
import math
import re
import sys
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from canzona.dp.layout import ceil_to, even_cuts
from canzona.errors import CanzonaError
from canzona.plan import Plan
from canzona.runtime.buffers import FlatBuffer, packed_offsets
from canzona.runtime.comm import Comm, PendingWork, to_device
from canzona.runtime.grad_guard import GradGuard, GradState
from canzona.runtime.groups import groups_apart
from canzona.runtime.nonfinite import nonfinite_weights_error
from canzona.runtime.param_gather import fsdp_reads, held_by_fsdp, point_fsdp_at
from canzona.runtime.shards import is_dtensor, local_grad, local_tensor
from canzona.runtime.stacks import Stacks
from canzona.runtime.wrappers import wrapper_holding, wrapper_message
from canzona.spec import ModelSpec
from canzona.step_policies import StepPolicy

NONFINITE_POLICIES = ("raise", "skip")


@dataclass(frozen=True, kw_only=True)
class StepCheck:
    """What `prepare()` established, identically on every rank."""

    got: Tensor  # per parameter (optimizer order): 1 if it got a gradient on any rank
    norm: float  # the global 2-norm of the reduced gradients, every element counted once (nan / inf: not finite)
    # per parameter of another part (`prepare`'s `more_got`: the experts'), 1 if it got a gradient on
    # any rank of the cluster (empty when `prepare` was given none)
    more_got: Tensor


class GradientSource(Protocol):
    """Where the reduced gradients of the optimizer's flat buffers come from, once backward has
    written this step's local gradients into them (`FlatBuffer.grad`). Calls come in the same order
    on every rank: each bucket as its last gradient arrives, in bucket order, then the AdamW buffer;
    after all of them have landed, `gather_rest` for each."""

    def launch(self, buffer: FlatBuffer, cuts: tuple[int, ...], name: str) -> PendingWork:
        """Start the reduction that leaves this rank's part of `buffer.reduced` (`[cuts[r],
        cuts[r + 1])`, r its DP rank) holding the gradients' mean over the DP axis."""
        ...

    def gather_rest(self, buffer: FlatBuffer, cuts: tuple[int, ...], name: str, *, matrices: bool) -> PendingWork | None:
        """What the step policy reads beyond this rank's part (None: nothing): the rest of the
        reduced matrices (`matrices`) or of the AdamW buffer."""
        ...


class DPReduction:
    """The default source: a reduce-scatter(-v) of each flat buffer over the DP axis on its cuts
    (the route `canzona.reductions` picks); policies whose ranks read more than their part (every
    rank computing everything, the split matrices of a plan that keeps ZeRO-1's even segments:
    `StepPolicy.gathers_split`) all-gather the rest."""

    def __init__(self, dp: Comm, policy: StepPolicy, plan: Plan) -> None:
        self.dp = dp
        self.policy = policy
        self.matrices_beyond = policy.grad_sync == "all-reduce" or policy.gathers_split(plan.dp_plan)

    def launch(self, buffer: FlatBuffer, cuts: tuple[int, ...], name: str) -> PendingWork:
        return self.dp.reduce_scatter_v(buffer.grad, cuts, name)

    def gather_rest(self, buffer: FlatBuffer, cuts: tuple[int, ...], name: str, *, matrices: bool) -> PendingWork | None:
        needed = self.matrices_beyond if matrices else self.policy.replicated
        return self.dp.all_gather_v(buffer.reduced, cuts, name) if needed else None


class GradientSync:
    """Owns the flat buffers of a DP (x TP) rank and everything that happens to gradients before
    the optimizer reads them."""

    def __init__(self, params: Mapping[str, Tensor], spec: ModelSpec, plan: Plan, policy: StepPolicy,
                 dp: Comm, tp: Comm | None, reduce_dtype: torch.dtype | None,
                 nonfinite: str = "raise") -> None:
        self.params = params
        # the buffers hold entries: a parameter, or each matrix of a stacked one (`stacks`)
        self.stacks = Stacks(spec, params, plan.dp_plan.buckets)
        # a parameter's entry is the parameter itself (a DTensor's link to its buffer needs to know it
        # is one: `shards.link_data`), a stack's matrices their views of it
        tensors = {entry: params.get(entry, t) for entry, t in self.stacks.tensors().items()}
        self.plan = plan
        self.policy = policy
        self.dp = dp
        self.tp = tp
        self.nonfinite = nonfinite
        # whether this check demands that every rank's backward reached these parameters; the
        # experts' part under EP leaves that to the dense part's check: an EP rank's experts may get
        # no tokens in a step (no gradient: a zero share of the EDP sum, as a zero gradient is).
        # Which of the experts got a gradient is not this check's to say either: their stack is one
        # tensor of the model, held by every EP rank, so the dense check decides it over the whole
        # cluster (`more_got`), and the optimizer puts that verdict in place of this check's `got`
        self.checks_backward = True
        # where each buffer's reduced gradients come from: the seam a wrapper that reduces and
        # shards gradients itself plugs into (FSDP2's reduce-scatter: issue 21)
        self.source: GradientSource = DPReduction(dp, policy, plan)
        self.buckets = [FlatBuffer([p.name for p in b.params], {p.name: (p.offset, p.end) for p in b.params},
                                   b.size, tensors, reduce_dtype, data=self.stacks.bucket_data(b))
                        for b in plan.dp_plan.buckets]
        adamw_names = [p.name for p in spec.adamw_params()]
        offsets, used = packed_offsets(adamw_names, params)
        # padded as the plan's buckets are aligned (the plan fixes the layout: the memory model and the
        # collectives of a step read the same `dp_plan.align`), not by a planning setting of the caller's
        self.adamw = FlatBuffer(adamw_names, offsets, ceil_to(max(used, 1), plan.dp_plan.align * dp.size), params,
                                reduce_dtype)
        self.adamw_cuts = even_cuts(self.adamw.size, dp.size)
        self.buffer_of = {n: buf for buf in self.all_buffers() for n in buf.names}
        # FSDP2's record of each parameter it holds (FSDP2 on one rank takes this step), pointed at
        # the buffers just linked: else a model that ran a forward first gathers its old memory
        self._fsdp = point_fsdp_at(params)
        # the "got a gradient" table's position of every parameter and of every entry
        self.index = {n: i for i, n in enumerate(params)}
        self._names = list(params)
        self.index.update({e: self.index[n] for e, n in self.stacks.param_of.items()})
        self._bucket_of = {n: k for k, b in enumerate(self.buckets) for n in b.names}
        # each parameter's buckets (a stack may span several), in bucket order
        self.buckets_of = {n: sorted({self._bucket_of[e] for e in self.stacks.members[n] if e in self._bucket_of})
                            for n in params}
        # TP-replicated entries: every TP rank must hold (and be given) the same gradient; they
        # count once (on TP rank 0) in the global norm
        self._replicated = [e for p in spec.params if p.tp_dim is None for e in self.stacks.members[p.name]] \
            if tp is not None else []
        self._sync = True
        # the guard standing in each parameter's `.grad` while the buffer holds its gradient, and
        # that gradient's state (a name is absent when the buffer holds nothing of this step)
        owner = weakref.ref(self)  # hooks and guards must not keep the optimizer alive
        self._guards = {name: _guard_for(p, name, owner) for name, p in params.items()}
        # set by the optimizer when its parameter all-gathers run under the next forward: raises
        # for a gradient whose parameter's gather no forward waited for (it was read stale)
        self.read_check: Callable[[str], None] | None = None
        # set by the optimizer: a message when a module no longer holds a parameter it held at
        # construction (replaced in the model: the step would train nothing the model uses), or None
        self.replaced_check: Callable[[], str | None] | None = None
        # set by the optimizer: called once per step with every reduction launched, before they
        # are waited for, given `landed` (a matrix's reduced gradient, once its bucket has landed);
        # the TP schedule's prefetched gathers, or under overlap_step the whole early step
        self.early_work: Callable[[Callable[[str], Tensor]], None] | None = None
        # set by the optimizer: torch.amp.GradScaler's unscale of the reduced gradients, given
        # (found_inf, inv_scale) (`amp_unscale`); None: refused as any other use of `.grad`
        self.unscale: Callable[[Tensor, Tensor], None] | None = None
        # set by the optimizer on the part whose check is global (the dense one): every local weight
        # tensor of this rank by parameter name, in the optimizer's order (the same on every rank),
        # read when the gradient norm is not finite (None: not read; the experts' part, whose
        # weights the dense check reads)
        self.weights: Callable[[], Sequence[tuple[str, Tensor]]] | None = None
        self._states: dict[str, GradState] = {}
        # parameters whose `.grad` torch would hold as zeros (`zero_grad(set_to_none=False)`, or
        # `zero_()` on a guard): their guard stands in `.grad`, `ZEROED`, the buffer's content
        # stale; a step with no backward reaching them steps them with a zero gradient, as torch's
        # optimizers step a zero `.grad`, and a backward writes into the buffer as onto zeros
        self._zeroed: set[str] = set()
        # parameters whose gradient came with a graph (`backward(create_graph=True)`): a use of
        # `.grad` between backward and step() is refused naming it (`refusal`)
        self._graphed: set[str] = set()
        # the backward (autograd's graph task id) in which each parameter's gradient last reached the
        # optimizer's hook (`_arrive`): a use of its guard later in the same backward is a hook that
        # runs after the optimizer's own (`refusal`)
        self._arrived_in: dict[str, int] = {}
        # whether that arrival came inside a nested backward (an autograd Function's backward: a
        # re-entrant checkpoint segment's), looked up once per graph task (`_task_nested`); and the
        # outermost backward known to be running (a graph task with an arrival outside any segment,
        # until autograd's callback at its end): what tells a second accumulation in one backward
        # (REACHED_TWICE) from one in a second backward (SYNCED_TWICE), `_reached_twice`
        self._arrived_nested: dict[str, bool] = {}
        self._task_nested: tuple[int, bool] = (-1, False)
        self._running_top: int | None = None
        self.reset()
        self._refused_line: str | None = None  # `abandon`'s
        self._hooks = [p.register_post_accumulate_grad_hook(_on_grad_ready(owner, name)) for name, p in params.items()]

    def all_buffers(self) -> tuple[FlatBuffer, ...]:
        return (*self.buckets, self.adamw)

    def reset(self) -> None:
        """Forget this step's progress (after `step()` and `zero_grad()`)."""
        self._arrived: list[set[str]] = [set() for _ in self.buckets]
        self._launched: list[PendingWork | None] = [None] * len(self.buckets)
        self._next = 0
        self._got_grad = torch.zeros(len(self.params), dtype=torch.int64)
        self.backward = 0  # gradients a backward (or an assignment) gave this step; zeroed ones are not
        self.checked: StepCheck | None = None  # reduced and checked (by clip_grad_norm_ or step)
        # whether the model's weights were loaded (`Module.load_state_dict`) on any rank of the
        # cluster since they were last compared (`prepare`'s `loaded`), until the optimizer compares
        # them and clears it: beside the check, not in it (GradScaler's marks know the check by
        # identity, `AmpMarks`: a replaced check was unscaled twice)
        self.model_loaded = False
        # reduced (`_finish` ran): a check that refused the step leaves the gradients reduced, and a
        # step() called again must not reduce them once more (the reduction is in place)
        self._reduced = False
        self.norm_term: Tensor | None = None  # this rank's sum of squares, once checked
        self._accumulated: set[str] = set()  # autograd accumulated into its guard, not arrived yet (`accumulate`)
        # a problem met where a raise would run on one rank only, in backward or before a bucket's
        # launch, which the step's check reports on every rank (`_local_problem`): a gradient left
        # from the last step at a launch (`_take_all`: STEPPED_TWICE, UNREACHED_SINCE_STEP), one
        # dropped mid-step and written anew by a backward (`_arrive`: DROPPED_MID_STEP), a stack's
        # `.grad` changed after an earlier of its buckets launched (`_take_all`: `handed_message`),
        # a backward onto the last step's gradient or onto one being reduced, or zeroing one being
        # reduced (the guard's `refused`: STALE_GRADIENTS, SYNCED_TWICE, the zeroing's line), a
        # parameter read before its gather landed (`_arrive`: `read_check`)
        self._left: str | None = None
        # per parameter, the line of an in-place write to its guard (`written`: not done), for the
        # step's check while that gradient is held; dropped with the gradient (zeroed: `dropped`; set
        # to None: a fresh `.grad` in `_arrive`, None at a launch in `_take_all`), as torch drops the write
        self._writes: dict[str, str] = {}
        # set by a check that found some rank's step broken (`_broken`, carried over TP), on every
        # rank of the cluster alike: the optimizer then abandons the step (`abandon`)
        self.broken_refusal = False
        # the line of a step() refused without being broken (a disagreement, a NaN norm), whose
        # gradients stay for a retry: model.zero_grad() ends that step (`_end_kept`), unless it leaves
        # some of them (a `.grad` set to None alone: `KEPT_NOT_DROPPED`)
        self.kept_line: str | None = None
        # that step ended by model.zero_grad() on this rank (`_end_kept`): the next step is a fresh
        # step's in every way (a second backward without no_sync() is SYNCED_TWICE, ...) but for its
        # collectives: a bucket whose gradients are all in is handed to the reduction as in any step
        # (`_take_all`, `REDUCING`), `DEFERRED` standing in for its launch, and the reductions are
        # launched at the check once every rank ended it (`_agree_ended`)
        self._deferred = False
        # a step refused and kept, ended by zeroing its first gradient in place (model.zero_grad(
        # set_to_none=False) or a submodule's): its line and the parameters whose gradients it held,
        # so that one of them left as it was (a submodule's zeroing ended it) is named as such
        # (`_still_kept`) instead of as the last step's gradient
        self._kept_after: tuple[str, frozenset[str]] | None = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every `.grad` None, as `optimizer.zero_grad()` leaves it in torch; with `set_to_none=False`
        every `.grad` that is not None zero (its guard, `ZEROED`), as torch zeroes it. Collectives
        still in flight (a backward without its step) are completed first: they read the buffers."""
        self._drain()
        # right after step() the parameters are marked pending (`pending_params`): without this,
        # each `.grad` access would be a Python __torch_function__ call (about 1 us, not 0.05 us)
        with torch._C.DisableTorchFunctionSubclass():
            self._zeroed = set() if set_to_none else {n for n, p in self.params.items() if p.grad is not None}
            for name, p in self.params.items():
                p.grad = self._guards[name] if name in self._zeroed else None
        # after a step refused and kept, optimizer.zero_grad() ends it as model.zero_grad() does
        # (`_end_kept`): the next backward is reduced at the check once every rank agrees that it
        # ended (`_agree_ended`). Launched from backward instead, its reductions would meet a peer
        # that ended it with model.zero_grad() in that agreement's collective (a hang)
        self._forget(deferred=self.kept_line is not None or self._deferred)

    def _forget(self, deferred: bool) -> None:
        """This step's gradients dropped (`zero_grad`, `_end_kept`): no states, no progress, no
        refused step; `deferred`: the next backward is reduced at the check (`_agree_ended`)."""
        self._states.clear()
        self.reset()
        self._refused_line = None
        self._deferred = deferred

    def abandon(self, error: str) -> None:
        """A step some rank found broken was refused on every rank (`broken_refusal`): its gradients
        are as consumed as a step's, so that `model.zero_grad()` (either setting) and a backward
        start the next step afresh, as after `step()`; without one, a backward onto them is
        STALE_GRADIENTS and a `step()` with no backward names the refused step (`_refused_line`).
        The collectives are completed and this step's progress forgotten: nothing of the refused
        step's buffers enters a later reduction (a backward writes each gradient anew, a gradient
        that none reached is zero or refused at its launch). A `.grad` holding a plain tensor (a
        backward wrote a new one after a model.zero_grad() mid-step: DROPPED_MID_STEP) gets its
        guard back, so that a backward onto it is STALE_GRADIENTS, as onto any other. A refusal
        of step() called again (REFUSED_AGAIN) keeps the line of the step first refused."""
        self._drain()
        with torch._C.DisableTorchFunctionSubclass():
            for name in self._states:
                p, guard = self.params[name], self._guards[name]
                if p.grad is not None and p.grad is not guard:
                    p.grad = guard
        line = self._refused_line
        self.stepped()
        self._refused_line = line if line is not None and REFUSED_AGAIN.split("(")[0] in error else error

    def ends_kept_step(self) -> bool:
        """`zero_()` on a guard being reduced: after a step refused and kept (`kept_line`), it is
        model.zero_grad(set_to_none=False) ending that step (`_end_kept`), and the zeroing goes on
        as after a step; else it is refused (`refused`)."""
        if self.kept_line is None:
            return False
        self._end_kept()
        return True

    def _all_dropped(self) -> bool:
        """Every gradient this sync holds for the step (those with a state) was set to None or
        written anew since (model.zero_grad())."""
        with torch._C.DisableTorchFunctionSubclass():
            return all(self.params[n].grad is not self._guards[n] for n in self._states)

    def _end_kept(self) -> None:
        """model.zero_grad() (either setting) after a step refused and kept for a retry (a
        disagreement, a NaN norm): that step's gradients are dropped, as optimizer.zero_grad()
        drops them, so that the next backward and step() train as a run that skipped that batch.
        Local bookkeeping, no collective: the next step is a fresh step's (a second backward without
        no_sync() is SYNCED_TWICE, zeroing a gradient handed to the reduction is refused, ...), but
        its backward launches no reduction (`DEFERRED`): the step's check first has every rank agree
        that all ended it (`_agree_ended`), then launches them, or fails on every rank."""
        self._drain()
        error, held = self.kept_line, frozenset(self._states)
        with torch._C.DisableTorchFunctionSubclass():
            left = any(self.params[n].grad is self._guards[n] for n in held)
        self._forget(deferred=True)
        if error is not None and left:
            self._kept_after = (error, held)

    def _still_kept(self, name: str) -> bool:
        """`name`'s gradient is still that of a step refused and kept which a zeroing in place of
        some of its gradients ended (a submodule's zero_grad(set_to_none=False)): neither zeroed nor
        set to None since, nor reached by a backward."""
        if self._kept_after is None or name not in self._kept_after[1]:
            return False
        with torch._C.DisableTorchFunctionSubclass():
            return self.params[name].grad is self._guards[name] and self.guard_state(name) is GradState.STEPPED

    def _kept_line(self) -> str:
        """KEPT_NOT_DROPPED where a step refused and kept was dropped in part only (a submodule's
        zero_grad(), either setting, or .grad = None), or not at all, before a backward or step()."""
        if self.kept_line is not None:
            error, held = self.kept_line, [n for n in self.params if n in self._states]
            with torch._C.DisableTorchFunctionSubclass():
                still = [n for n in held if self.params[n].grad is self._guards[n]]
        else:
            error, held = self._kept_after
            held = [n for n in self.params if n in held]
            still = [n for n in held if self._still_kept(n)]
        gone = [n for n in held if n not in still]
        what = ("not dropped (no zero_grad() since) and a backward added to them" if not gone else
                f"dropped in part only ({_few(gone)}: a submodule's zero_grad(), or .grad = None), the rest still "
                f"kept ({_few(still)})")
        return KEPT_NOT_DROPPED.format(error=error, what=what)

    def _agree_ended(self) -> None:
        """The step's check after a step refused and kept: every rank says whether model.zero_grad()
        ended it here (1), kept it (0, a retried step()), or holds none of its gradients (2: a part
        no gradient reached, which follows the others), over DP, then TP; all ended: this step's
        gradients (deferred) are reduced as usual; some only: one error on every rank, a broken step
        (abandoned alike). Before any of this step's reductions on every rank alike."""
        if not self._deferred and self._states and self._all_dropped():
            self._end_kept()  # model.zero_grad() and no backward reaching this part since
        word = 1 if self._deferred else 0 if self._states else 2
        table = self.dp.all_gather_values(torch.tensor([word], dtype=torch.int64), "refused step ended")
        seen = {int(w) for w in table} - {2}
        if self.tp is not None:
            row = torch.tensor([int(0 in seen), int(1 in seen)], dtype=torch.int64)
            both = self.tp.all_gather_values(row, "tp refused step ended").amax(dim=0)
            seen = {w for w in (0, 1) if int(both[w])}
        if seen == {0, 1}:
            self.broken_refusal = True
            raise CanzonaError(
                "model.zero_grad() after a step() refused and kept for a retry ran on some ranks and not on others"
                f" (here: {'ran' if word == 1 else 'did not run' if word == 0 else 'no gradient held'}): call it "
                "alike on every rank, or drop the refused step with optimizer.zero_grad() on every rank; nothing "
                "was updated")
        if seen == {1} and not self._deferred:
            self._end_kept()  # a part holding none of the refused step's gradients follows the others
        self._deferred = False
        for k, pending in enumerate(self._launched):  # in bucket order, as backward launches them
            if pending is DEFERRED:
                self._launched[k] = self.source.launch(self.buckets[k], self.grad_cuts(k),
                                                       f"bucket {self.plan.dp_plan.buckets[k].index}")

    def stepped(self) -> None:
        """The step consumed the gradients: the guards say so, so that a backward cannot add onto
        them before a zero_grad (`model.zero_grad()`, `opt.zero_grad()`, or `set_to_none=False`)."""
        for name in self._states:
            self._states[name] = GradState.STEPPED
        self.reset()
        self._refused_line = None

    def _drain(self) -> None:
        for pending in self._launched:
            if pending is not None:
                pending.wait()

    @property
    def local_got(self) -> Tensor:
        """Per parameter, 1 if this rank's backward gave it a gradient this step (or its `.grad` was
        zeroed, which torch steps): what this rank's check sends; final once `prepare` has reduced."""
        return self._got_grad

    def reduced(self, name: str) -> Tensor:
        """The synchronised gradient of `name`'s local tensor (valid where this rank reads it)."""
        return self.buffer_of[name].reduced_view(name)

    def landed(self, name: str) -> Tensor:
        """`reduced(name)` once its bucket's reduce-scatter has landed (waits for it)."""
        self._launched[self._bucket_of[name]].wait()
        return self.reduced(name)

    def grad_cuts(self, k: int) -> tuple[int, ...]:
        b = self.plan.dp_plan.buckets[k]
        return b.cuts if self.policy.grad_sync == "reduce-scatter" else even_cuts(b.size, self.dp.size)

    def segments(self) -> list[Tensor]:
        """This rank's share of every reduced gradient element: its segment of each bucket, its
        slice of the AdamW buffer."""
        r = self.dp.rank
        out = [b.reduced[c[r]:c[r + 1]] for k, b in enumerate(self.buckets) for c in (self.grad_cuts(k),)]
        out.append(self.adamw.reduced[self.adamw_cuts[r]:self.adamw_cuts[r + 1]])
        return out

    def norm_segments(self) -> list[Tensor]:
        """This rank's share of the gradient elements, each element of the model counted once in the
        cluster: TP-replicated parameters count on TP rank 0 only."""
        if self.tp is None or self.tp.rank == 0:
            return self.segments()
        replicated = set(self._replicated)
        r = self.dp.rank
        out = []
        for k, buf in enumerate(self.buckets):
            c = self.grad_cuts(k)
            out += _exclude(buf, replicated, c[r], c[r + 1])
        out += _exclude(self.adamw, replicated, self.adamw_cuts[r], self.adamw_cuts[r + 1])
        return out

    # --- during backward ---------------------------------------------------------------------

    def _arrive(self, name: str) -> None:
        """`name`'s gradient of this backward is complete (post-accumulate-grad hook)."""
        if self.read_check is not None:
            try:
                self.read_check(name)
            except CanzonaError as e:
                # its parameter was read before the last step's gather landed: recorded for the
                # step's check, which fails on every rank together (a raise here, inside backward
                # on one rank, would leave the peers waiting in the collectives); the gradient goes
                # on to the reduction, so that this rank issues the same collectives as its peers
                self._record(str(e))
        self._accumulated.discard(name)
        task = torch._C._current_graph_task_id()
        self._arrived_in[name] = task
        self._arrived_nested[name] = self._nested(task)
        if not self.is_linked(name):
            # out of the buffers (`.data` assigned, a cast): its gradient stays in `.grad`, unwritten,
            # and its bucket waits (no launch with a stale entry in backward); `_take_all` leaves it
            # too and the step's check (`_local_problem`) reports it on every rank together. A raise
            # here, inside backward on one rank, would leave the peers waiting in the collective
            return
        p, guard = self.params[name], self._guards[name]
        if p.grad is not guard and p.grad is not None and self._is_own_guard(local_tensor(p.grad), name):
            # `backward(create_graph=True)` accumulated out of place (`.grad + g`: the guard's sum,
            # a guard of the same gradient carrying autograd's graph), its values taken in
            # (`accumulate`) or refused: the guard itself back in `.grad`, which keeps no graph
            p.grad = guard
        buckets = self.buckets_of[name]
        if p.grad is not guard and self.kept_line is not None and self._all_dropped():
            self._end_kept()  # model.zero_grad() after a step refused and kept: that step ends
        if p.grad is not guard and (self._reduced or any(self._launched[k] is not None for k in buckets)):
            # its guard was dropped after its gradient went to the reduction, whose buffers this
            # backward's gradient would overwrite under the collective or after the check read them:
            # left in `.grad`, unwritten, and recorded for the step's check (`_local_problem`), which
            # reports it on every rank together; a raise here, inside backward on one rank (its loop
            # dropped a batch), would leave the peers waiting in the step's collectives
            self._record(DROPPED_MID_STEP.format(name=name) if self.kept_line is None else self._kept_line())
            return
        if p.grad is guard and name not in self._states and name in self._zeroed and self._taken_as_zero(name):
            return  # a zeroed gradient taken to the reduction as zero, reached since: recorded, not taken
        if p.grad is guard and self._states.get(name) is GradState.REDUCING:
            # a second backward onto a gradient handed to the reduction (no no_sync() around the
            # first): its accumulation into the guard was recorded, not taken (`refused`); the
            # gradient stays as the first backward handed it over, in the same state (an
            # accumulating one would take the next backward's into a buffer under its collective);
            # after a step refused and kept, a backward onto its gradients
            self._record(SYNCED_TWICE if self.kept_line is None else self._kept_line())
            return
        self._zeroed.discard(name)  # a backward reached it (a zeroed guard took it in `accumulate`)
        if p.grad is not guard:
            self._writes.pop(name, None)  # a write to the gradient set to None since went with it
            # backward wrote a fresh `.grad` (the last one was dropped, or this is the step's first
            # backward), or the user assigned one: it replaces what the buffer held, as in torch
            grad = local_grad(p)
            self._write(name, grad)
            p.grad = guard
            (self._graphed.add if grad.requires_grad else self._graphed.discard)(name)
        self._got_grad[self.index[name]] = 1
        self.backward += 1
        sync = self._sync
        self._states[name] = GradState.REDUCING if sync else GradState.ACCUMULATING
        if not buckets or not sync:
            return  # AdamW parameters are reduced in step(); under no_sync() nothing is reduced yet
        if any(self._launched[k] is not None for k in buckets):
            # a second synchronising backward (its accumulation into the guard was recorded and not
            # taken, `refused`): its bucket launched already, and is not launched again
            self._record(SYNCED_TWICE)
            return
        for entry in self.stacks.members[name]:
            self._arrived[self._bucket_of[entry]].add(entry)
        self._launch_ready_buckets()

    def _nested(self, task: int) -> bool:
        """Whether graph task `task` (running now) is a nested backward: the stack walked once per
        task. A task outside any is the running outermost backward until its end (autograd's
        queued callback)."""
        if task == self._task_nested[0]:
            return self._task_nested[1]
        nested = _in_nested_backward()
        self._task_nested = (task, nested)
        if not nested:
            me = weakref.ref(self)

            def ended() -> None:
                sync = me()
                if sync is not None and sync._running_top == task:
                    sync._running_top = None

            try:
                torch.autograd.Variable._execution_engine.queue_callback(ended)
            except Exception:  # unknown then: `_reached_twice` names both causes
                return nested
            self._running_top = task
        return nested

    def _reached_twice(self, name: str) -> str:
        """A second accumulation onto `name`'s gradient, handed to the reduction by its first: in the
        same backward (a re-entrant checkpoint segment and a use elsewhere: REACHED_TWICE) or in a
        second backward (no no_sync(): SYNCED_TWICE), told apart by graph task ids (increasing: a
        segment's backward runs as a task inside the outer one) and whether each arrival was nested;
        both inside segments with tasks begun between them and no outer arrival seen (the whole
        model checkpointed), the tasks cannot tell: both named."""
        task, nested = torch._C._current_graph_task_id(), _in_nested_backward()
        first, first_nested = self._arrived_in.get(name), self._arrived_nested.get(name, False)
        if first is None or not (nested or first_nested):
            return SYNCED_TWICE
        if first_nested and not nested:
            # this (outer) task began before the segment's that first reached it: the same backward
            return REACHED_TWICE.format(name=name) if task < first else SYNCED_TWICE
        top = self._running_top
        if not first_nested:  # first reached outside any segment: is that backward still running?
            return REACHED_TWICE.format(name=name) if top == first else SYNCED_TWICE
        if task == first + 1:
            # both in segments, no task begun between them: a second backward would have begun its
            # own outermost task between them (one runs at a time), so this is the same backward
            return REACHED_TWICE.format(name=name)
        if top is not None:  # both in segments, an outermost backward known to be running
            return REACHED_TWICE.format(name=name) if top < first else SYNCED_TWICE
        return REACHED_OR_SYNCED.format(name=name)

    def _write(self, name: str, grad: Tensor, add: bool = False) -> None:
        """Parameter `name`'s local gradient into its entries' buffers (added to what they hold
        with `add`)."""
        if grad.layout != torch.strided:  # the buffers are dense; torch.optim.AdamW refuses them too
            raise CanzonaError(f"parameter {name!r} got a sparse gradient ({grad.layout}: nn.Embedding or "
                               "nn.EmbeddingBag built with sparse=True), which the optimizer's dense gradient "
                               "buffers cannot take: build the module with sparse=False")
        for entry, part in self.stacks.parts(name, grad):
            buffer = self.buffer_of[entry]
            if add:
                buffer.add(entry, part)
            else:
                buffer.write(entry, part)

    def is_linked(self, name: str) -> bool:
        """Parameter `name` still lives in the optimizer's storage (and FSDP2, where it holds it,
        gathers it from there)."""
        if name in self._fsdp and not fsdp_reads(self._fsdp[name], self.params[name]):
            return False
        if name in self.stacks.storage:
            return self.stacks.is_linked(name)
        return self.buffer_of[name].is_linked(name)

    def _launch_ready_buckets(self) -> None:
        """Launch in bucket order only, so every rank issues the same collectives in the same order."""
        while self._next < len(self.buckets) and len(self._arrived[self._next]) == len(self.buckets[self._next].names):
            self._launch(self._next)
            self._next += 1

    def _launch(self, k: int) -> None:
        if self._launched[k] is not None:  # not launched twice: every rank launches each bucket once a step
            self._record(SYNCED_TWICE)
            return
        b = self.buckets[k]
        self._take_all(b)
        # after a kept step ended here (`_deferred`), launched once every rank agrees it ended
        self._launched[k] = DEFERRED if self._deferred else \
            self.source.launch(b, self.grad_cuts(k), f"bucket {self.plan.dp_plan.buckets[k].index}")

    def _take_all(self, buffer: FlatBuffer) -> None:
        """Before a buffer is reduced: every parameter's gradient of this step is in it (a gradient
        assigned by hand is taken in; no gradient counts as zero), and every `.grad` holding one is
        its guard, now `REDUCING`."""
        for name in dict.fromkeys(self.stacks.param_of[e] for e in buffer.names):
            p, guard = self.params[name], self._guards[name]
            if p.grad is guard and name in self._zeroed and name not in self._states:
                # zeroed and reached by no backward: a zero gradient, which torch's optimizers step
                for entry in self.stacks.members[name]:
                    if self.buffer_of[entry] is buffer:
                        buffer.zero(entry)
                self._got_grad[self.index[name]] = 1
                continue
            if p.grad is guard:
                if self._still_kept(name):
                    # a step refused and kept, ended by zeroing some of its gradients in place: this
                    # one was left as that step held it (recorded, not taken; `_leave`)
                    self._leave(buffer, name, self._kept_line())
                    continue
                if self._states.get(name) is GradState.STEPPED:  # no backward reached it, no zero_grad since the step
                    # recorded, not raised: this runs before a bucket's launch, and may hold on one
                    # rank only (its loop skipped a backward and zero_grad()), its peers then waiting
                    # in the collective. The step's check (`_local_problem`) reports it on every rank
                    # together; the bucket launches with zeros in its place, and the check refuses
                    # the step, so nothing reduced is used
                    self._leave(buffer, name, UNREACHED_SINCE_STEP.format(name=name) if self.backward else
                                STEPPED_TWICE.format(name=name) if self._refused_line is None else
                                REFUSED_AGAIN.format(name=name, error=self._refused_line))
                    continue
            elif p.grad is None:
                if name in self._states and self._launched_any(name):
                    # a stack spanning buckets, its gradient taken by an earlier bucket, now under its
                    # reduction, then set to None: zeros here would tear it (part of it reduced, part
                    # zero). Refused by the step's check on every rank together, nothing updated
                    self._leave(buffer, name, handed_message(name, "dropped (zero_grad() or .grad = None)"))
                    continue
                self._zeroed.discard(name)  # set to None since (model.zero_grad())
                self._writes.pop(name, None)
                for entry in self.stacks.members[name]:
                    if self.buffer_of[entry] is buffer:
                        buffer.zero(entry)
                self._states.pop(name, None)
                continue
            else:
                if not self.is_linked(name):
                    # a gradient no hook of ours took: the parameter swapped out of the buffers with
                    # its hooks (a cast under torch's swap_module_params_on_conversion). Left as it
                    # is: the step's check (`_local_problem`) reports it on every rank together;
                    # raising here, before a launch (in backward, or on one rank), would leave the
                    # peers waiting in the collective
                    continue
                if self._launched_any(name):
                    # a stack spanning buckets, changed after an earlier of its buckets launched (its
                    # `.grad` assigned by hand, or dropped and written anew by a backward: `_arrive`
                    # recorded that): writing it in whole would write the launched buckets' entries
                    # under their reduction, and the step would read a torn gradient. Left in `.grad`,
                    # this bucket's entries zero; the step's check refuses the step on every rank
                    # together, nothing updated
                    self._leave(buffer, name, handed_message(name, "replaced"))
                    continue
                # every entry of the parameter, in this buffer and in those launched after it (a
                # stack spanning buckets: this is the first of them to launch, as the guard
                # now stands in `.grad`)
                self._write(name, local_grad(p))
                p.grad = guard
                self._got_grad[self.index[name]] = 1
                self.backward += 1
            self._states[name] = GradState.REDUCING

    def _taken_as_zero(self, name: str) -> bool:
        """Whether zeroed `name` (`ZEROED`, no backward since) went to the reduction as a zero
        gradient this step (its bucket launched: clip_grad_norm_(), GradScaler's unscale or a refused
        step() ran `_finish`, before a backward reached it): if so, recorded (TAKEN_AS_ZERO) for the
        step's check, which fails on every rank together. Before: a backward after that (under
        no_sync(), whose arrival takes nothing to the reduction) wrote its local, unreduced gradient
        over the reduced one in the buffer, and the step applied it silently."""
        if not (self._reduced or self._launched_any(name)):
            return False
        self._record(TAKEN_AS_ZERO.format(name=name))
        return True

    def _launched_any(self, name: str) -> bool:
        """Some bucket of `name` (a stack may span several) went to its reduction this step."""
        return any(self._launched[k] is not None for k in self.buckets_of[name])

    def _record(self, problem: str) -> None:
        """`problem` recorded for the step's check (`_local_problem`), unless one was already."""
        if self._left is None:
            self._left = problem

    def ungraded(self) -> list[str]:
        """The parameters no gradient reached on this rank this step (before the check takes them
        in, one assigned to `.grad` by hand too): read from the got-a-gradient flags in one pass,
        names made of those alone."""
        names = self._names
        return [names[i] for i in torch.nonzero(self._got_grad == 0).flatten().tolist()]

    def missed_gradients(self) -> Collection[str]:
        """The parameters that got no gradient this step (checked after the gradients were taken
        in: the names holding one are those with a state; one zeroed, `zero_grad(set_to_none=False)`,
        and reached by no backward has none): a module replaced without a registration
        (`ModuleList.insert`, `_modules` written, `del model.head`) leaves its old parameters none,
        which sends `param_gather.ModuleLinks` to walk its links. One still holding the last
        step's (`STEPPED`: `model.zero_grad(set_to_none=False)` no longer reaches the old module's
        gradients) got none either: the step's check refuses it (`_left`), naming the replacement
        where there is one."""
        if self._left is not None:
            return [n for n in self.params if self._states.get(n, GradState.STEPPED) is GradState.STEPPED]
        return self.params.keys() - self._states.keys() if len(self._states) < len(self.params) else ()

    def _leave(self, buffer: FlatBuffer, name: str, problem: str) -> None:
        """`name`'s entries in `buffer` zero, and `problem` recorded (`_record`)."""
        self._record(problem)
        for entry in self.stacks.members[name]:
            if self.buffer_of[entry] is buffer:
                buffer.zero(entry)

    @property
    def syncing(self) -> bool:
        """False inside `no_sync()`: the backward accumulates locally, nothing is reduced."""
        return self._sync

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # --- what the guards ask (canzona.runtime.grad_guard.GuardOwner) --------------------------

    def guard_state(self, name: str) -> GradState:
        # a guard whose name has no state was left over (its gradient was zeroed at a launch)
        if name not in self._states and name in self._zeroed:
            return GradState.ZEROED
        return self._states.get(name, GradState.STEPPED)

    def accumulate(self, name: str, grad: Tensor) -> None:
        # autograd accumulated this backward's gradient into the guard; the optimizer's own hook
        # (`_arrive`) has yet to run: a hook running now runs before it (`refusal`)
        self._accumulated.add(name)
        zeroed = self.guard_state(name) is GradState.ZEROED
        if zeroed and self._taken_as_zero(name):
            return  # not written: its buffer holds its reduced gradient (recorded, `_taken_as_zero`)
        if zeroed:  # onto zeros: the buffer's stale content is replaced
            self._zeroed.discard(name)
            self._states[name] = GradState.ACCUMULATING
            self._graphed.discard(name)
        if grad.requires_grad:  # `backward(create_graph=True)`'s (autograd's sum out of place): its values
            self._graphed.add(name)
        with torch.no_grad():
            self._write(name, grad, add=not zeroed)

    def _is_own_guard(self, grad: Tensor, name: str) -> bool:
        """`grad` is a guard of `name`'s gradient held by this optimizer (an alias of its own)."""
        return isinstance(grad, GradGuard) and grad._name == name and grad._owner() is self

    def refused(self, name: str, what: str, in_backward: bool) -> None:
        """A backward onto the last step's gradient (STALE_GRADIENTS), onto one being reduced
        (SYNCED_TWICE), or zeroing one being reduced, met on this rank: recorded (`_record`) for the
        step's check (`_local_problem`), which fails on every rank together, nothing updated; the
        gradient it would add is not taken. The last step's gradient is zeroed in the buffers not
        under a reduction (its bucket then launches with zeros, as its peers' launches); one being
        reduced is left as it is, under its collective."""
        self._zero_stepped(name)
        if self._left is None:  # the first problem is the one reported (`refusal` may walk the live objects)
            self._record(self.refusal(name, what, in_backward))

    def _zero_stepped(self, name: str) -> None:
        if self.guard_state(name) is GradState.STEPPED:
            for entry in self.stacks.members[name]:
                k = self._bucket_of.get(entry)
                if k is None or self._launched[k] is None:
                    self.buffer_of[entry].zero(entry)

    def written(self, name: str, what: str, in_backward: bool) -> None:
        """An in-place write to `name`'s guard (scaling, `fill_`, a hook editing `.grad`), not done:
        recorded for `name` (`_writes`) while its gradient is held, so that the step's check refuses
        it on every rank together; dropping that gradient drops the record, as torch's drops the write."""
        self._zero_stepped(name)
        if name not in self._writes:
            self._writes[name] = self.refusal(name, what, in_backward)

    def _held_write(self) -> str | None:
        """The first recorded write (`written`) to a gradient still held (its guard in `.grad`)."""
        with torch._C.DisableTorchFunctionSubclass():
            return next((line for n, line in self._writes.items() if self.params[n].grad is self._guards[n]), None)

    def dropped(self, name: str) -> None:
        """`zero_()` on the guard: torch keeps a zero `.grad` (see `_zeroed`)."""
        self._writes.pop(name, None)
        self._states.pop(name, None)
        self._zeroed.add(name)

    def refusal(self, name: str, what: str, in_backward: bool) -> str:
        state = self.guard_state(name)
        if state is not GradState.STEPPED or in_backward:
            wrapper = wrapper_holding(self.params.values())
            if wrapper is not None:
                return wrapper_message(wrapper)
        adds = what.split(".")[0] in ("add", "add_")
        if in_backward and adds and (state is GradState.REDUCING and self.kept_line is not None or
                                     self._still_kept(name)):
            # a backward onto the gradients of a step refused and kept, dropped in part or not at all
            return self._kept_line()
        if in_backward and self._arrived_in.get(name) == torch._C._current_graph_task_id():
            # a hook running after the optimizer's own in this backward (registered after it), which
            # took the gradient (a second accumulation in the same backward is a nested backward's)
            return HOOKED_AFTER.format(name=name, what=what)
        if in_backward and not adds:
            # not autograd's accumulation: a hook registered before the optimizer's, where autograd
            # accumulated into the guard (zeroed gradients, a no_sync() accumulation), or code run
            # before this backward's accumulation (p.register_hook(fn) editing .grad)
            return (HOOKED_ON_GUARD if name in self._accumulated else HOOKED_BEFORE).format(name=name, what=what)
        if state is GradState.STEPPED:
            if in_backward:
                return STALE_GRADIENTS.format(name=name)
            return (f"after step() the gradient of {name!r} lives in the optimizer's buffers, reduced, and is not "
                    f"readable as .grad ({what}): read the global norm from opt.clip_grad_norm_() before step(), "
                    "and call zero_grad() before the next backward")
        if state is GradState.REDUCING and not in_backward and what.split(".")[0] in ("zero_", "fill_(0)",
                                                                                      "_foreach_zero_"):
            # model.zero_grad(set_to_none=False) within a step: a batch being dropped
            if self.kept_line is not None:
                return KEPT_NOT_DROPPED.format(error=self.kept_line, what=f"zeroed in place ({what} of {name!r}: "
                                               "model.zero_grad(set_to_none=False))")
            return (f"the gradient of {name!r} is being reduced across ranks by the optimizer and cannot be zeroed "
                    f"in place ({what}: model.zero_grad(set_to_none=False) within a step?): discard a step's "
                    "gradients with optimizer.zero_grad(), which ends their reduction too")
        if in_backward:
            # a second accumulation after the gradient went to the reduction: inside a backward run
            # from an autograd Function's backward (re-entrant checkpointing), in the same backward
            return (self._reached_twice(name) if state is GradState.REDUCING else
                    f"backward cannot add into the gradient of {name!r} held by canzona's DistributedOptimizer "
                    f"this way ({what}: not autograd's accumulation)")
        if name in self._graphed:
            return (f"the gradient of {name!r} came from backward(create_graph=True): the optimizer takes its values "
                    f"and steps by them, and .grad keeps no graph ({what} between backward and step()): for a "
                    "gradient penalty take the gradients with torch.autograd.grad(loss, params, create_graph=True), "
                    "add the penalty to the loss and call backward() on the sum")
        where = ("accumulating in the optimizer's buffers (under no_sync())" if state is GradState.ACCUMULATING
                 else "zero, held by the optimizer" if state is GradState.ZEROED
                 else "being reduced across ranks by the optimizer")
        value = ("; clip by value with opt.clip_grad_value_(clip_value), not torch.nn.utils.clip_grad_value_"
                 if "clamp" in what else "")
        return (f"the gradient of {name!r} is {where}: nothing may read or change .grad between backward and step() "
                f"({what}{value}). {GUARD_ADVICE}")

    def amp_unscale(self, name: str, found_inf: Tensor, inv_scale: Tensor) -> None:
        if self.unscale is None:
            raise CanzonaError(self.refusal(name, "_amp_foreach_non_finite_check_and_unscale_",
                                            torch._C._current_graph_task_id() != -1))
        self.unscale(found_inf, inv_scale)

    # --- before the step ---------------------------------------------------------------------

    def _finish(self) -> None:
        while self._next < len(self.buckets):  # buckets whose gradients did not all arrive
            self._launch(self._next)
            self._next += 1
        self._take_all(self.adamw)
        adamw = self.source.launch(self.adamw, self.adamw_cuts, "adamw")
        if self.early_work is not None:
            self.early_work(self.landed)
        for pending in self._launched:
            pending.wait()
        adamw.wait()
        rest = [self.source.gather_rest(b, self.grad_cuts(k), f"gradients of bucket {self.plan.dp_plan.buckets[k].index}",
                                        matrices=True) for k, b in enumerate(self.buckets)]
        for pending in rest:
            if pending is not None:
                pending.wait()
        adamw_rest = self.source.gather_rest(self.adamw, self.adamw_cuts, "adamw gradients", matrices=False)
        if adamw_rest is not None:
            adamw_rest.wait()

    def local_problem(self) -> str | None:
        """What is wrong on this rank alone now (`_local_problem`), for another part's recheck."""
        return self._local_problem()

    def _local_problem(self) -> str | None:
        """What is wrong on this rank alone, if anything: a parameter moved out of the buffers or
        replaced in the model, a gradient left from the last step (no backward reached it, no zero_grad()
        since: met at a bucket's launch), or a gradient dropped or replaced after it was handed to the
        reduction (dropped, then written anew by a backward: met in that backward)."""
        left = self._left or self._held_write()
        if left is not None:
            # a module replaced in the model (its old parameters' gradients left unreached: 'still the
            # last step's') is the cause to name
            replaced = self.replaced_check() if self.replaced_check is not None else None
            return replaced or left
        unlinked = next((n for buf in self.all_buffers() for n in buf.unlinked()), None) or \
            next(self.stacks.unlinked(), None) or \
            next((n for n, record in self._fsdp.items() if not fsdp_reads(record, self.params[n])), None)
        if unlinked is not None:
            return self.unlinked_message(unlinked)
        replaced = self.replaced_check() if self.replaced_check is not None else None
        if replaced is not None:
            return replaced
        held = held_by_fsdp(self._fsdp)  # an FSDP2 model on one rank: no HSDP replicas there
        if held is not None:
            return held
        for name, p in self.params.items():
            held = name in self._states
            zeroed = name in self._zeroed and p.grad is self._guards[name]
            if (p.grad is not self._guards[name]) if held else (p.grad is not None and not zeroed):
                if held and self.kept_line is not None:  # a step refused and kept, dropped in part only
                    return self._kept_line()
                return handed_message(name, "dropped (zero_grad() or .grad = None)" if p.grad is None else "replaced")
        return None

    def prepare(self, hyper_parameters: int, max_norm: float | None = None,
                more_norm: Tensor | None = None, more_problem: str | None = None,
                more_backward: int = 0, more_got: Tensor | None = None, recheck: bool = True,
                loaded: bool = False, more_broken: bool = True) -> StepCheck:
        """Reduce the gradients and check, on every rank alike, that the step is sound; return
        which parameters got a gradient on any rank and the global gradient norm. Once per step
        (clip_grad_norm_, then step). `hyper_parameters`: this rank's digest of its param_groups;
        `max_norm`: the clip threshold this call applies (ranks must agree on both); `more_norm`:
        this rank's sum of squares of gradients held beside these buffers (the experts' under
        expert parallelism), added to its own before the ranks' are summed; `more_problem`: what
        another part's check found wrong on this rank (the experts' over EDP), which fails this
        check on every rank as this rank's own problem would, as a broken step if `more_broken`
        (the experts' check found one), else as a refusal that keeps the gradients for a retry (a
        disagreement, a NaN norm: the other ranks name it, the step is not abandoned); `more_backward`: the gradients
        another part's backward gave this rank (the experts', which may be all it trains);
        `more_got`: this rank's got-a-gradient flags of another part's parameters (the experts',
        whose stacks every EP rank holds a part of), combined over the whole cluster (DP, then TP)
        into the check's `more_got` (the same length on every rank); `loaded`: whether this rank's
        model had its weights loaded since they were last compared, combined over the cluster as
        `more_got` is, into `model_loaded`.
        A call after the check (`step()` after `clip_grad_norm_()`, a second clip) reuses it, and
        with `recheck` compares the hyper-parameters and threshold anew (`_recheck`); without, as
        the experts' part does, whose ranks the dense part's recheck covers, it costs nothing."""
        if self.kept_line is not None or self._deferred:
            self._agree_ended()
        if self.checked is not None:
            if recheck and self._recheck(hyper_parameters, max_norm, more_problem, loaded):
                # loaded after the check (between clip_grad_norm_() and step()): compared before the update
                self.model_loaded = True
            return self.checked
        if not self._reduced:
            self._finish()
            self._reduced = True
        problem = more_problem or self._local_problem()
        # 2: a broken step on this rank (abandoned on every rank); 1: another part's refusal that
        # is not one (`more_broken` False), reported on every rank, the gradients kept for a retry
        word = 0 if problem is None else 1 if more_problem is not None and not more_broken else 2
        # the header is assembled on the device the check travels on: the norm term never comes to
        # the host on its own, so the table below is the step's one read of device values
        device = self.dp.check_device
        term = local_norm_term(self.norm_segments()).to(device)
        self.norm_term = term  # this rank's own share, for another part's check (`more_norm`)
        if more_norm is not None:
            term = term + more_norm.to(device)
        sent = torch.zeros(0, dtype=torch.int64) if more_got is None else more_got.to(torch.int64)
        sent = torch.cat([sent, torch.tensor([int(loaded)], dtype=torch.int64)])  # `loaded` rides last
        header = torch.cat([
            to_device(torch.cat([self._got_grad, sent, torch.tensor(
                [self.backward + more_backward, word, hyper_parameters],
                dtype=torch.int64)]), device),
            term.reshape(1).view(torch.int64),
            to_device(torch.tensor([_clip_word(max_norm)], dtype=torch.float64), device).view(torch.int64)])
        table = self.dp.all_gather_values(header, "step check")
        flags, fired, broken, digests = table[:, :-5], table[:, -5], table[:, -4], table[:, -3]
        terms, clips = table[:, -2].view(torch.float64), table[:, -1].view(torch.float64)
        error = None
        if (broken == 2).any():
            error = self._broken(problem if word == 2 else None, broken == 2)
        elif not torch.all(digests == digests[0]):
            error = f"{digests_apart(self.dp, hyper_parameters, 'rank')}: change them alike on every rank"
        elif not _all_same(clips):
            error = _clip_disagreement(clips, self.dp.rank, "rank")
        elif broken.any():
            error = self._refused_elsewhere(problem if word == 1 else None, broken == 1)
        elif self.checks_backward and not fired.any():
            error = ("step() found no gradient on any rank: call backward() before step(), on the "
                     "parameters given to the optimizer")
        elif self.checks_backward and not fired.all():
            error = (f"rank(s) {ranks_of(fired == 0)} ran no backward in this step while others did: their "
                     "zero gradients would be averaged in")
        got, more = flags.amax(dim=0).split([len(self.params), sent.numel()])
        total = combine_norm_terms(terms)
        if self.tp is not None:
            error, total, more = self._check_tp(error, got, more, hyper_parameters, total, max_norm)
            # a TP group's failure reaches the other DP ranks too, so that every rank in the
            # cluster stops here instead of waiting in the step's collectives
            error = self.dp.spread_failure(error, "tp verdict",
                                           "the TP group of DP rank(s) {ranks} failed this step's check")
        if error is not None:
            raise CanzonaError(error)
        norm = math.sqrt(float(total))
        if not math.isfinite(norm) and self.weights is not None:
            # NaN weights make every later gradient NaN: named as such (not the data), under "skip"
            # too (no step could recover); read on this failure path only, alike on every rank
            error = nonfinite_weights_error(self.weights(), norm, [self.dp, self.tp])
            if error is not None:
                raise CanzonaError(error)
        if not math.isfinite(norm) and self.nonfinite == "raise":
            raise CanzonaError(f"the global gradient norm is {norm} (a NaN or Inf gradient, from a NaN loss, an "
                               "overflow or bad data): nothing was updated. Lower the learning rate, check the "
                               "data, or pass nonfinite='skip' to skip such steps (counted in opt.skipped_steps)")
        self.model_loaded = bool(more[-1])
        self.checked = StepCheck(got=got, norm=norm, more_got=more[:-1])
        return self.checked

    def _recheck(self, hyper_parameters: int, max_norm: float | None, more_problem: str | None = None,
                 loaded: bool = False) -> bool:
        """The check reused: param_groups may have changed since on some rank only (a learning rate
        set between `clip_grad_norm_()` and `step()`), and the threshold may be new (a second clip).
        A rank cannot tell its peers that its digest changed without a collective, so every reuse
        (clip and step are collective calls: every rank reuses alike) costs one more small
        all-gather of (digest, threshold) over DP, and under TP one over TP that also carries the
        DP verdict: every rank of the grid then fails alike (a DP group that saw a difference has
        a member in every TP group; DP groups that agree within but not with each other differ
        in every TP group). The DP row carries a third word, this rank's local problem (`more_problem`,
        or its own: a gradient dropped or replaced since the check, which a step would otherwise
        apply from the buffers as the check saw it), and a fourth, `loaded` (`prepare`'s); returns
        whether any rank of the cluster set it (combined over DP, then TP)."""
        problem = more_problem or self._local_problem()
        row = torch.cat([torch.tensor([hyper_parameters], dtype=torch.int64),
                         torch.tensor([_clip_word(max_norm)], dtype=torch.float64).view(torch.int64),
                         torch.tensor([int(problem is not None), int(loaded)], dtype=torch.int64)])
        table = self.dp.all_gather_values(row, "step recheck")
        any_loaded = int(table[:, 3].amax())
        broken = table[:, 2]
        if broken.any():
            error = self._broken(problem, broken)
        else:
            error = _recheck_error(table[:, :2], self.dp, hyper_parameters, "rank")
        row = row[:2]
        if self.tp is not None:
            table = self.tp.all_gather_values(torch.cat([torch.tensor([self._failure_word(error)]), row,
                                                         torch.tensor([any_loaded])]), "tp step recheck")
            any_loaded = int(table[:, 3].amax())
            failed = table[:, 0] != 0
            self.broken_refusal = bool((table[:, 0] == 2).any())
            if error is None and failed.any():
                error = f"the data-parallel group of TP rank(s) {ranks_of(failed)} failed the step's recheck (see their error)"
            error = error or _recheck_error(table[:, 1:3], self.tp, hyper_parameters, "TP rank")
        if error is not None:
            raise CanzonaError(error)
        return bool(any_loaded)

    def _broken(self, problem: str | None, broken: Tensor) -> str:
        """The error of a check whose table says that some rank found a broken step (`broken`: per DP
        rank, nonzero where it did): this rank's own problem, or one naming those ranks and the
        first one's problem, so that every rank's error says what went wrong. Every rank of the DP
        group calls it together (the table is the same on every rank): one more exchange, of the
        problems, on this failure path only."""
        self.broken_refusal = True
        problems = self.dp.all_gather_object(problem, "step problems")
        # a problem relayed from another group's check (under EP the experts' over EDP, whose peers
        # of the failing rank say 'rank(s) [<EDP rank>] found a broken step: ...') is not its
        # rank's own: the ranks named are those whose own problem it is (they are DP ranks too),
        # each line said once, not nested
        own = [p is not None and _relayed(p) is None for p in problems]
        if problem is not None and _relayed(problem) is None:
            return problem
        if any(own):
            ranks = [r for r, o in enumerate(own) if o]
            return f"rank(s) {ranks} found a broken step: {problems[ranks[0]]}"
        first = next(p for p in problems if p is not None)
        return f"rank(s) {ranks_of(broken != 0)} found a broken step: {_relayed(first) or first}"

    def _refused_elsewhere(self, problem: str | None, failed: Tensor) -> str:
        """The error of a check whose table says that another part's check (the experts' over EDP)
        refused this step on some ranks without finding it broken (a NaN norm, ...; a disagreement
        of the hyper-parameters or the clip threshold is this check's own, named over DP): this
        rank's own line, or one naming those ranks and the first one's line. The gradients stay
        for a retried step(), as after this check's own refusal. One more exchange, of the lines,
        on this failure path only."""
        problems = self.dp.all_gather_object(problem, "step problems")
        if problem is not None:
            return problem
        first = next(p for p in problems if p is not None)
        return f"the experts' step check failed on rank(s) {ranks_of(failed)}: {first}"

    def _failure_word(self, error: str | None) -> int:
        """What a TP check's row says of this rank's DP verdict: 0 passed, 1 failed, 2 failed as
        broken (`broken_refusal`): a DP group that found a broken step has a member in every TP
        group, so every rank of the grid learns it, and abandons the step alike."""
        return 0 if error is None else 2 if self.broken_refusal else 1

    def _check_tp(self, error: str | None, got: Tensor, more: Tensor, hyper_parameters: int, dp_total: Tensor,
                  max_norm: float | None) -> tuple[str | None, Tensor, Tensor]:
        """The TP ranks of one DP index must all pass, agree on the hyper-parameters, the clip
        threshold and on which parameters got a gradient, and hold the same gradient of every
        TP-replicated parameter: a model that forgets to reduce one (say, a QK norm's weight over
        the heads it was split by), or a scheduler stepped on one TP rank only, would otherwise
        train the replicas apart without a word. Returns this rank's error (the same on the TP
        group), the sum of squares over the whole cluster (each TP rank's DP total, in TP order)
        and `more` (another part's flags, combined over DP) combined over TP: the TP ranks of a DP
        rank may hold different EP ranks' experts, which need not agree."""
        device = self.tp.check_device
        digests = self._replicated_digests().to(device)
        words = torch.tensor([float(dp_total), _clip_word(max_norm)], dtype=torch.float64).view(torch.int64)
        row = torch.cat([to_device(torch.cat([torch.tensor([self._failure_word(error), hyper_parameters],
                                                           dtype=torch.int64), words, got, more]), device),
                         digests.view(torch.int64)])
        table = self.tp.all_gather_values(row, "tp step check")
        self.broken_refusal = bool((table[:, 0] == 2).any())
        total = combine_norm_terms(table[:, 2].view(torch.float64))
        n, m = got.numel(), more.numel()
        more = table[:, 4 + n:4 + n + m].amax(dim=0)
        if error is not None:
            return error, total, more
        failed = table[:, 0] != 0
        if failed.any():
            return (f"the data-parallel group of TP rank(s) {ranks_of(failed)} failed this step's check (see their "
                    "error)"), total, more
        hyper = table[:, 1]
        if not torch.all(hyper == hyper[0]):
            return (f"{digests_apart(self.tp, hyper_parameters, 'TP rank')} (a scheduler or an edit that ran on some "
                    "ranks only?)"), total, more
        clips = table[:, 3].view(torch.float64)
        if not _all_same(clips):
            return _clip_disagreement(clips, self.tp.rank, "TP rank"), total, more
        got_table = table[:, 4:4 + n]
        if not torch.all(got_table == got_table[0]):
            differs = int(torch.nonzero((got_table != got_table[0]).any(dim=0))[0])
            return (f"TP ranks disagree on whether {list(self.params)[differs]!r} got a gradient this step: "
                    "every TP rank must run the same backward"), total, more
        reps = table[:, 4 + n + m:].view(self.tp.size, -1, 2)
        bad = torch.nonzero((reps != reps[0]).any(dim=2).any(dim=0)).flatten()
        if bad.numel():
            name = self._replicated[int(bad[0])]
            return (f"the gradient of TP-replicated parameter {name!r} differs between TP ranks: the model "
                    "must reduce it over the TP group (as Megatron's finalize_model_grads or a Replicate "
                    "DTensor does), or the replicas drift apart"), total, more
        return None, total, more

    def _replicated_digests(self) -> Tensor:
        """Per TP-replicated parameter, (sum, position-weighted sum) in fp64 of this rank's reduced
        share of its gradient: equal on every TP rank when the gradients are equal."""
        device = self.adamw.reduced.device
        out = torch.zeros(len(self._replicated), 2, dtype=torch.float64, device=device)
        r = self.dp.rank
        for i, name in enumerate(self._replicated):
            buf = self.buffer_of[name]
            c = self.adamw_cuts if buf is self.adamw else self.grad_cuts(self._bucket_of[name])
            lo, hi = c[r], c[r + 1]
            a, b = buf.offsets[name]
            s, e = max(a, lo), min(b, hi)
            if s < e:
                part = buf.reduced[s:e].double()
                weights = torch.arange(s - a + 1, e - a + 1, dtype=torch.float64, device=part.device)
                out[i, 0], out[i, 1] = part.sum(), (part * weights).sum()  # on the device: no host read
        return out.flatten()

    def unlinked_message(self, name: str) -> str:
        wrapper = wrapper_holding(self.params.values())
        return wrapper_message(wrapper) if wrapper is not None else unlinked_message(name)


class _DeferredLaunch:
    """Stands in `GradientSync._launched` for a bucket handed to the reduction after a kept step was
    ended here, its collective not launched yet (`_deferred`): nothing to wait for."""

    def wait(self) -> None:
        pass


DEFERRED = _DeferredLaunch()


def _few(names: Sequence[str]) -> str:
    """Up to three names, and how many in all beyond."""
    shown = ", ".join(repr(n) for n in names[:3])
    return shown if len(names) <= 3 else f"{shown}, ... {len(names)} in all"


def _guard_for(p: Tensor, name: str, owner: Callable[[], GradientSync | None]) -> Tensor:
    """The guard that stands in `p.grad`: for a DTensor parameter, a DTensor over a guard with the
    parameter's placements (autograd accumulates a DTensor gradient into it, Partial included)."""
    local = local_tensor(p)
    guard = GradGuard(local, local.dtype, local.device, owner, name)
    if is_dtensor(p):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(guard, p.device_mesh, p.placements, run_check=False)
    return guard


def _on_grad_ready(owner: Callable[[], GradientSync | None], name: str) -> Callable[[Tensor], None]:
    def hook(_: Tensor) -> None:
        sync = owner()
        if sync is not None:  # the optimizer is gone: its hooks do nothing
            # the gradient's values: under `backward(create_graph=True)` it carries a graph, which
            # the buffers (leaves of no graph) do not take, as torch's optimizers step by values
            with torch.no_grad():
                sync._arrive(name)
    return hook


_RELAYED = re.compile(r"rank\(s\) \[[0-9, ]*\] found a broken step: (.*)", re.DOTALL)


def _relayed(problem: str) -> str | None:
    """The line a relayed problem (`_broken`'s, of another group) carries, or None for a rank's own."""
    match = _RELAYED.fullmatch(problem)
    return match.group(1) if match else None


def _clip_word(max_norm: float | None) -> float:
    """The clip threshold as the checks carry it (0: no clipping in this call; a positive word:
    clip_grad_norm_'s max_norm, a negative one: minus clip_grad_value_'s clip_value, NaN: a value
    either refuses, which the ranks agree on before any of them raises: `clip_threshold_word`)."""
    return 0.0 if max_norm is None else float(max_norm)


def clip_threshold_word(threshold: object, by_value: bool = False) -> float:
    """The word a clip call passes to the step check for `threshold` (max_norm, or with `by_value`
    clip_value): NaN where it is not a positive number, so that a bad value on one rank is the
    check's one disagreement on every rank, not a raise there alone while the others wait."""
    if not (isinstance(threshold, (int, float)) and not isinstance(threshold, bool) and threshold > 0):
        return math.nan
    return -float(threshold) if by_value else float(threshold)


def _all_same(values: Tensor) -> bool:
    return bool(torch.all(values == values[0])) or bool(torch.all(torch.isnan(values)))


def digests_apart(comm: Comm, digest: int, member: str) -> str:
    """What differs between the param_groups digests of `comm`'s ranks (`groups.groups_apart`):
    one more exchange, of what each digested (`GroupsDigest.rows`), on the failure path only, which
    every rank of `comm` takes together (they all read the same table)."""
    every = comm.all_gather_object(getattr(digest, "rows", None), "param_groups disagreement")
    return groups_apart(every, member)


def _recheck_error(table: Tensor, comm: Comm, digest: int, member: str) -> str | None:
    """What a (digest, threshold) table of a reused check says is wrong, or None (`digest`: this
    rank's, whose rows a disagreement's error shows the others over `comm`)."""
    digests, clips = table[:, 0], table[:, 1].view(torch.float64)
    if not torch.all(digests == digests[0]):
        return (f"{digests_apart(comm, digest, member)}, changed after clip_grad_norm_() (whose check step() "
                "reuses): change them alike on every rank; nothing was updated")
    return None if _all_same(clips) else _clip_disagreement(clips, comm.rank, member)


def _clip_disagreement(clips: Tensor, me: int, member: str) -> str:
    shown = ", ".join(_clip_shown(float(c)) for c in clips)
    return (f"{member}s disagree on the clip threshold (per {member}: {shown}; {member} {me} is this one): "
            "every rank must clip alike, or the replicas drift apart")


def _clip_shown(word: float) -> str:
    if word == 0:
        return "none"
    if math.isnan(word):
        return "a bad value (a threshold not a positive number, or norm_type not 2.0 or inf)"
    return f"max_norm={word:g}" if word > 0 else f"clip_value={-word:g}"


def local_norm_term(segments: list[Tensor]) -> Tensor:
    """One rank's share of the global gradient norm: the sum of squares of its segments, in order,
    in fp64 (accumulated in the kernel: no fp64 copy of the gradients), on the segments' device
    (read by the host only inside the step check's table)."""
    device = next((s.device for s in segments), torch.device("cpu"))
    total = torch.zeros((), dtype=torch.float64, device=device)
    for s in segments:
        if s.numel():
            total += torch.linalg.vector_norm(s, dtype=torch.float64).square()
    return total


def combine_norm_terms(terms: Tensor) -> Tensor:
    """Every rank's sum of squares, combined in rank order (reproducible in one process)."""
    return terms.sum()


def _exclude(buf: FlatBuffer, names: set[str], lo: int, hi: int) -> list[Tensor]:
    """The pieces of `buf.reduced[lo:hi]` that do not belong to `names`."""
    cut = sorted((max(a, lo), min(b, hi)) for n, (a, b) in buf.offsets.items()
                 if n in names and max(a, lo) < min(b, hi))
    out, pos = [], lo
    for s, e in cut:
        out.append(buf.reduced[pos:s])
        pos = e
    out.append(buf.reduced[pos:hi])
    return out


GUARD_ADVICE = ("Clip with opt.clip_grad_norm_(max_norm) (it returns the global norm of the reduced gradients; "
                "max_norm=inf only measures it) or DistributedOptimizer(max_grad_norm=...), not "
                "torch.nn.utils.clip_grad_norm_; with Hugging Face Trainer use canzona.integrations.hf.CanzonaTrainer, "
                "with accelerate canzona.integrations.accelerate.CanzonaAccelerator")


def handed_message(name: str, change: str) -> str:
    """A gradient `change`d ("replaced", "dropped ...") after backward handed it to the reduction."""
    return (f"the gradient of {name!r} was {change} between backward and step(), after backward had "
            f"handed it to the reduction: zero gradients before backward, not after. {GUARD_ADVICE}")


STALE_GRADIENTS = ("backward would accumulate the gradient of {name!r} onto the last step's: call "
                   "optimizer.zero_grad() or model.zero_grad() between steps (after a step the buffers hold "
                   "reduced gradients, which a backward must not add to)")
# the last step's gradient met at a step: nothing since cleared it or wrote into it (a backward
# onto it is refused in the backward, STALE_GRADIENTS), so no backward ran
STEPPED_TWICE = ("step() was called again with no backward since the last step(): the gradient of {name!r} is "
                 "still the last step's, already applied (neither zero_grad() nor a backward reached it since): "
                 "call zero_grad() and run a backward before each step()")
DROPPED_MID_STEP = ("the gradient of {name!r} was set to None (model.zero_grad(), or .grad = None) after this "
                    "step's gradients went to the reduction (a backward, clip_grad_norm_() or a refused step()), "
                    "and a backward wrote a new one: discard a step's gradients with optimizer.zero_grad(), which "
                    "ends their reduction too")
# model.zero_grad() (either setting) after a step() refused without being broken (`kept_line`)
KEPT_NOT_DROPPED = ("the last step() was refused ({error}) and its gradients were kept, reduced, for a step() "
                    "called again once that is mended; they were then {what}, which does not discard them: "
                    "drop all of a refused step's gradients with model.zero_grad() or optimizer.zero_grad(), then "
                    "run the backward again before step(); nothing was updated")
# the same, where this step's backward ran but did not reach that parameter
# the same after a step refused on every rank (`abandon`), which left its gradients as a step does
REFUSED_AGAIN = ("step() was called again with no backward since the last step() was refused ({error}): the "
                 "refused step's gradients are dropped, as a step's are: call zero_grad() (the optimizer's or the "
                 "model's) and run the step's backward again before step(); nothing was updated")
UNREACHED_SINCE_STEP = ("the gradient of {name!r} is still the last step's, already applied: this step's backward "
                        "did not reach it and no zero_grad() cleared it since (torch would apply it again): call "
                        "zero_grad() before each step's backward")
# a backward reaching a zeroed gradient that went to the reduction as zero (`_taken_as_zero`)
TAKEN_AS_ZERO = ("a backward reached the gradient of {name!r} after clip_grad_norm_(), GradScaler's unscale_() or a "
                 "refused step() had taken it to the reduction as zero (zero_grad(set_to_none=False), no backward "
                 "had reached it yet): its reduced gradient is not replaced by a local one; run every backward of "
                 "a step (no_sync() micro-batches included) before clip_grad_norm_() and unscale_()")
SYNCED_TWICE = ("gradients were synchronised twice in one step: wrap the backward of accumulation "
                "micro-batches in `with optimizer.no_sync():`")
HOOKED_AFTER = ("a gradient hook used the gradient of {name!r} ({what}) after the optimizer took it into its "
                "buffers: a hook registered with register_post_accumulate_grad_hook after building the optimizer "
                "runs after the optimizer's own; register it before building the optimizer, or transform the "
                "gradient with p.register_hook(fn), which runs before it is accumulated")

HOOKED_BEFORE = ("a gradient hook edited the gradient of {name!r} ({what}) inside backward before autograd "
                 "accumulated into it: a .grad that is not None is the optimizer's guard there (the optimizer holds "
                 "the gradient), with no values; in p.register_hook(fn), return the transformed gradient fn is given "
                 "instead of editing .grad")
REACHED_TWICE = ("the gradient of {name!r} was reached twice in one backward, after the first had been handed to "
                 "the reduction: a parameter used inside a re-entrant activation-checkpoint segment and elsewhere "
                 "(another segment, or outside any) gets a gradient from each segment's own backward; checkpoint "
                 "with use_reentrant=False (Hugging Face: gradient_checkpointing_kwargs={{'use_reentrant': False}})")
# both accumulations inside re-entrant segments, no outer backward seen: one backward or two, unknown
REACHED_OR_SYNCED = ("the gradient of {name!r} was reached again inside a re-entrant activation-checkpoint segment "
                     "after it had been handed to the reduction: either two backwards ran in one step without "
                     "no_sync() (wrap the backward of accumulation micro-batches in `with optimizer.no_sync():`), "
                     "or one backward reached it from two segments (a parameter used in both: checkpoint with "
                     "use_reentrant=False; Hugging Face: gradient_checkpointing_kwargs={{'use_reentrant': False}})")

HOOKED_ON_GUARD = ("a gradient hook used the gradient of {name!r} ({what}) while .grad was the optimizer's guard: "
                   "after zero_grad(set_to_none=False), and in each backward of a no_sync() accumulation after "
                   "its first, autograd accumulates each gradient straight into the optimizer's buffers, and .grad "
                   "holds no values during backward (a register_post_accumulate_grad_hook works in a backward after "
                   "zero_grad() with set_to_none=True, no accumulation); transform or read each backward's own "
                   "gradient with p.register_hook(fn), which runs before it is accumulated")


def _in_nested_backward() -> bool:
    """Whether this runs inside a backward started from an autograd Function's backward (what
    torch.utils.checkpoint(use_reentrant=True) does per segment): read on a refusal's path only.
    It reads torch's private BackwardCFunction.apply: a torch without it says False (only the
    refusal's wording degrades; a raise here would come inside a backward, on one rank)."""
    try:
        from torch.autograd.function import BackwardCFunction

        nested = BackwardCFunction.apply.__code__
    except Exception:
        return False
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is nested:
            return True
        frame = frame.f_back
    return False


def unlinked_message(name: str | None) -> str:
    which = f"parameter {name!r} no longer lives" if name else "parameters no longer live"
    return (f"{which} in the optimizer's buffers: the model was moved, cast or had parameters replaced "
            "after the optimizer was built (model.to(...), even from cpu to cpu:0, load_state_dict(assign=True), "
            "...); build the optimizer after those, and load weights with load_state_dict() without assign. "
            "Hugging Face Trainer and accelerate move the model themselves: use "
            "canzona.integrations.hf.CanzonaTrainer or canzona.integrations.accelerate.CanzonaAccelerator")


def ranks_of(mask: Tensor) -> list[int]:
    return [int(r) for r in torch.nonzero(mask).flatten()]
