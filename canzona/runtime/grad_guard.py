"""What a parameter's `.grad` holds while the optimizer owns its gradient (docs/design.md §8.3).

The optimizer reduces gradients out of its own flat buffers, from backward hooks, while the user's
code still runs: a collective may be reading or writing that memory until `step()`. So `.grad` is
never a view of it. Backward writes a gradient into a fresh `.grad` (torch's `set_to_none`
default), the hook moves it into the buffer and leaves a `GradGuard` in its place: a tensor with
the gradient's shape, dtype and device but no storage, whose every use is refused with one line
saying what to use instead. A guard has one of four states, kept by the optimizer:

- `ACCUMULATING` (a backward under `no_sync()`): autograd's next accumulation (`grad += g`; under
  `backward(create_graph=True)` `grad + g`, whose sum is another guard of the gradient, which the
  optimizer's hook puts back by the guard itself: `.grad` keeps no graph) is routed into the
  buffer; anything else is refused (the gradient is local and incomplete);
- `REDUCING` (after the synchronising backward, until `step()`): the gradient is being reduced
  across ranks. Reading it (torch's `clip_grad_norm_`, logging a norm, DDP's reducer) or writing
  it (`clip_grad_value_`, scaling) is refused, and so is a second backward; GradScaler's unscale
  (`_AMP_UNSCALE`) is handed to the optimizer, which unscales the reduced gradients;
- `STEPPED` (after `step()`): the buffer holds what the step consumed; a backward that would add
  onto it is refused (by the step's check, on every rank: see below);
- `ZEROED` (after `zero_()` or `optimizer.zero_grad(set_to_none=False)`): the gradient is zero,
  as torch leaves it; the next backward's accumulation is routed into the buffer, replacing what
  it held, and a step that no backward reached steps a zero gradient, as torch's optimizers do.

`zero_()` (what `model.zero_grad(set_to_none=False)` calls), `fill_(0)` (a 0-dim zero tensor too) and
`torch._foreach_zero_` (torch.optim's `zero_grad(set_to_none=False)`) zero an accumulating or stepped
gradient; a gradient being reduced cannot be zeroed. `mul_(0)` is not zeroing (torch keeps NaN * 0 = NaN):
it is an in-place write as any other.

Three of these refusals may come on one rank alone, its loop having taken a branch its peers did
not: a backward onto a `STEPPED` gradient (no `zero_grad()` since the step), a second backward onto a
`REDUCING` one (no `no_sync()`), zeroing a `REDUCING` one. A raise there would leave the peers
waiting in the step's collectives until the timeout, so they are recorded instead (`refused`), as
is any other in-place write to a guard (scaling, `fill_`, a hook editing `.grad` in backward; recorded
per gradient, `written`, and dropped with it: zeroing it or setting it to None drops the write, as in
torch; one to a `STEPPED` gradient outside backward is without effect; a read has no values to go on
with, and raises): the gradient is not taken, the rank issues the same collectives as its peers, and the step's check
fails on every rank together, naming the mistake, before anything is updated. That step is then
abandoned on every rank (its gradients left `STEPPED`, as a step leaves them): `model.zero_grad()`
or `optimizer.zero_grad()` and a backward go on as after a step. After a step refused without being broken (its
gradients kept for a retry), zeroing a `REDUCING` gradient is `model.zero_grad(set_to_none=False)`
ending that step (`GuardOwner.ends_kept_step`), not refused.

`model.zero_grad()` (set_to_none) replaces a guard by None, which the optimizer sees. Metadata
(`.shape`, `.dtype`, `is not None`) works, and so do aliases (`.detach()`, `.data`): DTensor
gradients wrap a guard as their local tensor.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from canzona.errors import CanzonaError
from canzona.runtime.amp_handles import handed_scale, inverse_of
from canzona.runtime.shards import local_tensor

aten = torch.ops.aten


class GradState(enum.Enum):
    ACCUMULATING = "accumulating"
    REDUCING = "reducing"
    STEPPED = "stepped"
    ZEROED = "zeroed"


# alias-making ops: the result is another guard of the same gradient (DTensor.from_local views its
# local tensor; `.data` and `.detach()` alias)
_ALIASES = frozenset({aten.alias.default, aten.detach.default, aten.view.default, aten._unsafe_view.default,
                      aten.reshape.default, aten.view_as.default, aten.expand.default, aten.t.default,
                      aten.transpose.int, aten.as_strided.default})
_IN_PLACE_ADDS = frozenset({aten.add_.Tensor})
# autograd's accumulation under `backward(create_graph=True)`: `.grad + g`, out of place, its sum the new `.grad`
_OUT_OF_PLACE_ADDS = frozenset({aten.add.Tensor})
_ZEROS = frozenset({aten.zero_.default})
_FOREACH_ZEROS = aten._foreach_zero_.default
# torch.amp.GradScaler's unscale (and its inf check before `scaler.step`): one foreach op over the
# `.grad` of every parameter, which the optimizer runs on the reduced gradients instead
_AMP_UNSCALE = aten._amp_foreach_non_finite_check_and_unscale_.default
# torch's loop unscales, then clips; the other order clipped the scaled gradients to max_norm / scale
# (GradScaler.step alone, after a clip, is the same order): what either optimizer then raises
# (both optimizers raise it: the words name no method only one has, as the FSDP one's clip_grad_value_)
AMP_AFTER_CLIP = ("GradScaler's unscale after a clip in the same step (clip_grad_norm_() or a clip by value): the "
                  "clip measured and clipped the scaled gradients; call scaler.unscale_(opt) first, then the clip, "
                  "then scaler.step(opt)")
# GradScaler unscales the gradients of the object it was handed in one op per device and dtype: one
# over canzona's optimizer's and others' (a user's wrapper of two optimizers) would unscale the
# first one's alone, the others' left scaled and unchecked
AMP_BESIDE_OTHERS = ("GradScaler's unscale met gradients of canzona's optimizer beside others: unscale them through "
                     "the optimizer that steps them (scaler.unscale_(opt))")



def handed_inverse_scale(optimizer: object) -> float | None:
    """The inverse of the scale `GradScaler.step(opt)` handed `optimizer` for this `step()` call
    (`grad_scale`, set for the call only, on it or on the wrapper of it GradScaler was given; None
    where none was), as GradScaler computes it (`amp_handles.inverse_of`)."""
    scale = handed_scale(optimizer)  # on the optimizer, or on the wrapper GradScaler was given
    return None if scale is None else inverse_of(scale)


class GuardOwner(Protocol):
    """What a guard asks of the optimizer (`GradientSync` implements it)."""

    def guard_state(self, name: str) -> GradState:
        """The state of `name`'s gradient."""

    def accumulate(self, name: str, grad: Tensor) -> None:
        """Add `grad` (local) to `name`'s gradient in the buffer."""

    def dropped(self, name: str) -> None:
        """`name`'s gradient was zeroed by the user: drop it (its `.grad` becomes None)."""

    def ends_kept_step(self) -> bool:
        """Whether zeroing a gradient being reduced ends a step refused and kept for a retry."""

    def refusal(self, name: str, what: str, in_backward: bool) -> str:
        """The one-line error for using `name`'s guarded gradient with op `what`."""

    def refused(self, name: str, what: str, in_backward: bool) -> None:
        """`refusal`'s error, recorded for the step's check (which fails on every rank together)
        instead of raised; `name`'s gradient is not taken."""

    def written(self, name: str, what: str, in_backward: bool) -> None:
        """An in-place write `what` to `name`'s guarded gradient, not done: `refusal`'s error recorded
        for `name` until its gradient is dropped (zeroed, set to None), for the step's check."""

    def amp_unscale(self, name: str, found_inf: Tensor, inv_scale: Tensor) -> None:
        """GradScaler's unscale of the gradients (`name`: one of them): multiply every reduced
        gradient by `inv_scale` and set `found_inf` to 1 where any is not finite, alike on every rank."""


class GradGuard(Tensor):
    """Stands in `param.grad` (or, for a DTensor parameter, in its gradient's local tensor)."""

    _owner: Callable[[], GuardOwner | None]
    _name: str

    @staticmethod
    def __new__(cls, like: Tensor | torch.Size, dtype: torch.dtype, device: torch.device,
                owner: Callable[[], GuardOwner | None], name: str) -> GradGuard:
        shape = like.shape if isinstance(like, Tensor) else like
        guard = Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        guard._owner = owner  # a weak reference: a guard left in a model must not keep the optimizer alive
        guard._name = name
        return guard

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # everything happens in __new__
        pass

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # printing must not fail (debuggers, logs)
        owner = self._owner()
        state = owner.guard_state(self._name).value if owner is not None else "released"
        return (f"GradGuard({self._name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, {state}: the "
                "gradient lives in canzona's DistributedOptimizer)")

    # `model.share_memory()` (DataLoader workers, Hogwild habits) calls `share_memory_()` on every
    # `.grad`, which torch runs on the tensor's storage: a guard's has no memory, and torch's
    # segfaulted. A guard holds no memory to share (the gradient lives in the optimizer's buffer,
    # which stays where it is): a no-op, and not shared.
    def share_memory_(self) -> GradGuard:
        return self

    def is_shared(self) -> bool:
        return False

    def _typed_storage(self) -> Any:  # torch's: a storage without memory, whose use segfaults
        raise CanzonaError(_live_owner(self).refusal(self._name, "_typed_storage", False))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        guard = next((a for a in (*args, *kwargs.values()) if isinstance(a, GradGuard)), None)
        if guard is None:  # a collective takes its tensors in a list: c10d.allreduce_([grad], ...)
            guard = next(a for a in tree_leaves((args, kwargs)) if isinstance(a, GradGuard))
        owner = _live_owner(guard)
        if func in _ALIASES:
            shape = func(torch.empty(guard.shape, dtype=guard.dtype, device="meta"), *args[1:], **kwargs).shape
            return GradGuard(shape, guard.dtype, guard.device, guard._owner, guard._name)
        if func is _AMP_UNSCALE:
            mine = _unscaler(owner)
            if any(_unscaler(_guard_owner(local_tensor(g))) != mine for g in args[0]):
                raise CanzonaError(AMP_BESIDE_OTHERS)  # alike on every rank, before any collective
            owner.amp_unscale(guard._name, args[1], args[2])
            return None
        what = func.__name__
        if args and args[0] is guard and _fills_zero(func, args[1:]):
            func, what = aten.zero_.default, "fill_(0)"  # zeroing, as zero_() is
        if func is _FOREACH_ZEROS:  # torch.optim's zero_grad(set_to_none=False): each gradient zeroed
            for g in args[0]:
                _zero(g, what) if isinstance(g, GradGuard) else g.zero_()
            return None
        if func in _ZEROS:
            _zero(guard, what)
            return guard
        state = owner.guard_state(guard._name)
        adds = func in _IN_PLACE_ADDS or func in _OUT_OF_PLACE_ADDS
        accumulation = adds and args[0] is guard and kwargs.get("alpha", 1) == 1 and not isinstance(args[1], GradGuard)
        if func in _OUT_OF_PLACE_ADDS:
            # `backward(create_graph=True)`'s accumulation (`.grad + g`; not a backward: a use of `.grad`)
            accumulation = accumulation and torch._C._current_graph_task_id() != -1
            # its sum is a fresh guard of the same gradient (autograd gives it the graph), which the
            # optimizer's hook puts back by the guard itself
            result = GradGuard(guard.shape, guard.dtype, guard.device, guard._owner, guard._name)
        else:
            result = guard
        if accumulation and state in (GradState.ACCUMULATING, GradState.ZEROED):
            owner.accumulate(guard._name, args[1])  # autograd's accumulation (under no_sync(), or onto zeros)
            return result
        in_backward = torch._C._current_graph_task_id() != -1
        if accumulation and in_backward and state in (GradState.STEPPED, GradState.REDUCING):
            # a backward onto the last step's gradient (no zero_grad() since) or onto one being
            # reduced (a second backward without no_sync()): recorded for the step's check, which
            # fails on every rank together, the gradient not taken. Raising here, inside backward
            # on one rank (its loop took a branch its peers did not), would leave its peers waiting
            # in the collectives
            owner.refused(guard._name, what, in_backward)
            return result
        # a collective (c10d.allreduce_([grad], ...)) is no write to record: it raises as a read does,
        # alike on every rank that issues it, before any rank's collective starts
        collective = func.namespace == "c10d"
        if not collective and func.overloadpacket.__name__.endswith("_") and any(isinstance(t, GradGuard) for t in tree_leaves(args[:1])):
            # any other in-place write to the gradient (scaling it, `fill_`, torch's clip_grad_value_,
            # a gradient hook editing `.grad` inside backward): not done, and recorded as above, so
            # that a write on one rank alone is one error on every rank at the step, not a raise here
            # that leaves the peers waiting. A read cannot go on without values: it raises
            for written in (t for t in tree_leaves(args[:1]) if isinstance(t, GradGuard)):
                owner = _live_owner(written)
                if in_backward or owner.guard_state(written._name) is not GradState.STEPPED:
                    owner.written(written._name, what, in_backward)
                # else a write to the last step's gradient, consumed: without effect, as every way on
                # drops it (zero_grad(), the optimizer's or the model's, either setting) or is refused
                # for its own sake (a backward onto it, step() again, a read), so recording it would
                # refuse a later sound step (after model.zero_grad(), which the optimizer does not see)
            if isinstance(args[0], (list, tuple)):  # a foreach op: it runs on the list's plain tensors
                _run_on_plain(func, args, kwargs)
            return args[0] if isinstance(args[0], Tensor) else None
        raise CanzonaError(owner.refusal(guard._name, what, in_backward))


def _fills_zero(func: Any, value: tuple) -> bool:
    """`fill_(0)`, or `fill_(v)` with `v` a 0-dim tensor holding zero: zeroing. (`mul_(0)` is not:
    torch keeps NaN * 0 = NaN, so it is an in-place write as any other.)"""
    if func is aten.fill_.Scalar:
        return value[0] == 0
    if func is aten.fill_.Tensor:
        v = value[0]
        return not isinstance(v, GradGuard) and v.dim() == 0 and bool(v == 0)
    return False


def _run_on_plain(func: Any, args: tuple, kwargs: dict) -> None:
    """A foreach op over a list mixing guards and plain tensors, run on the plain ones alone: every
    list argument of the first's length (tensors, scalars) taken at the same places."""
    n = len(args[0])
    keep = [i for i, t in enumerate(args[0]) if not isinstance(t, GradGuard)]
    if not keep:
        return

    def pick(a: Any) -> Any:
        return [a[i] for i in keep] if isinstance(a, (list, tuple)) and len(a) == n else a

    func(*(pick(a) for a in args), **{k: pick(v) for k, v in kwargs.items()})


def _zero(guard: GradGuard, what: str) -> None:
    """`zero_()` (or `fill_(0)`, `_foreach_zero_`) on a guard: the gradient is zero (`ZEROED`), as
    torch's is, after a step or between micro-batches (model.zero_grad(set_to_none=False), torch's
    zero_grad(set_to_none=False)); zeroing one being reduced is recorded for the step's check, which
    fails on every rank together (see `__torch_dispatch__`), unless it ends a step refused and kept."""
    owner = _live_owner(guard)
    state = owner.guard_state(guard._name)
    if state is GradState.REDUCING and owner.ends_kept_step():
        state = owner.guard_state(guard._name)  # after a step refused and kept: that step ended
    if state is not GradState.REDUCING:
        owner.dropped(guard._name)
        return
    owner.refused(guard._name, what, torch._C._current_graph_task_id() != -1)


def _live_owner(guard: GradGuard) -> GuardOwner:
    """The optimizer owning `guard`'s gradient; one error where it no longer exists."""
    owner = guard._owner()
    if owner is None:
        raise CanzonaError(f"the gradient of {guard._name!r} belonged to a DistributedOptimizer that no longer "
                           "exists: call model.zero_grad() before using the model with another optimizer")
    return owner


def _guard_owner(grad: Tensor) -> GuardOwner | None:
    """The gradients' owner whose guard `grad` is (a DTensor's local guard included), None for any other."""
    return grad._owner() if isinstance(grad, GradGuard) else None


def _unscaler(owner: GuardOwner | None) -> object:
    """What unscales an owner's gradients: its optimizer's unscale, the same for every owner of one
    optimizer (under EP the dense part's and the experts' gradients have owners of their own, one
    optimizer); None for a gradient no canzona optimizer owns."""
    return None if owner is None else getattr(owner, "unscale", None)
