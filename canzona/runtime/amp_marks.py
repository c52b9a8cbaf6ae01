"""Where torch.amp.GradScaler's unscale and the clip stand in the current step: one state machine
for both layouts (`DistributedOptimizer`'s ZeRO-1 step check, `FsdpOptimizer`'s), each over its own
kind of step check. A step check object stands for the gradients as they are now: taken anew after
a backward, replaced when a clip or an unscale scales them, so the marks compare by identity and
need no reset (docs/design.md §8.3).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.amp.grad_scaler import OptState

from canzona.errors import CanzonaError
from canzona.runtime import amp_handles
from canzona.runtime.grad_guard import AMP_AFTER_CLIP


@dataclass(eq=False)
class AmpMarks:
    """The step checks GradScaler and the clip last left their mark on."""

    # the check `unscale` last answered GradScaler for (its calls within one unscale_ share it)
    answered: Any = None
    # the check whose gradients GradScaler's `unscale_` unscaled, followed through clips: GradScaler
    # keys its state on the object it was handed, so `unscale_(wrapper)` then `step(opt)`
    # (accelerate's step after `scaler.unscale_(accelerated_opt)`) brings the scale again, which
    # must not unscale twice
    unscaled: Any = None
    # the check as `clip_grad_norm_(max_norm)` with a finite max_norm left it: GradScaler's unscale
    # must come before that clip
    clipped: Any = None
    # the `found_inf` tensors GradScaler handed its unscale or inf check since the last step() ran (one
    # per device, and per GradScaler state: `unscale_(wrapper)` then `step(opt)` holds two): what its
    # `update()` reads
    found: list[Tensor] = field(default_factory=list)
    # their values before a refused step() set them (`refused`), put back by a step() taken after all
    before: list[Tensor] | None = None

    def refused(self) -> None:
        """step() was refused (nothing updated) after GradScaler's unscale or inf check of this step:
        a skipped step, which GradScaler's `update()` counts as torch counts a step it skipped for an
        Inf: the scale backed off, its growth count restarted (before: counted as a step taken, the
        scale grown). Alike on every rank (a refusal is).
        GradScaler handed an object without `_step_supports_amp_scaling` (a user's proxy) takes its
        unscale-then-step path, which reads `found_inf` itself before calling step(): a step() called
        again once the cause was mended would be skipped unseen. Its state for that object is put
        back to READY, so that the call again unscales (`unscale`: answered from the check already
        unscaled, with fresh tensors GradScaler's update() then reads) and steps; not called again,
        update() reads these, set."""
        self.before = self.before or []
        self.before += [f.clone() for f in self.found[len(self.before):]]
        for f in self.found:
            f.fill_(1.0)
        stepping = amp_handles.scaler_stepping()
        if stepping is not None and not getattr(stepping[1], "_step_supports_amp_scaling", False):
            states = getattr(stepping[0], "_per_optimizer_states", None)
            state = states.get(id(stepping[1])) if isinstance(states, dict) else None
            if state is None and states is not None:
                return  # no unscale of this object yet: nothing to put back
            if not isinstance(state, dict) or "stage" not in state:
                # torch's private layout moved: say so, rather than let a retried step() be skipped unseen
                warnings.warn(
                    f"GradScaler's per-optimizer state is not as torch 2.13 keeps it (torch {torch.__version__}): "
                    "a step() called again through this wrapper after the refusal may be skipped; call "
                    "scaler.update() and take the next batch instead",
                    stacklevel=2,
                )
            elif state["stage"] is OptState.UNSCALED:
                state["stage"] = OptState.READY

    def stepped(self) -> None:
        """step() ran (taken, or skipped for a non-finite norm): a refusal before it (a step() called
        again once the cause was mended) no longer counts; GradScaler's next unscale hands new tensors."""
        if self.before is not None:
            for f, b in zip(self.found, self.before):
                f.copy_(b)
        self.found, self.before = [], None

    def rescaled(self, before: Any, after: Any) -> None:
        """A clip or an unscale scaled the gradients of check `before`, now `after`: a clip after
        GradScaler's unscale leaves them unscaled."""
        if self.unscaled is before:
            self.unscaled = after

    def unscale(self, current: Callable[[], Any], finite: Callable[[Any], bool], take: Callable[[float], None],
                found_inf: Tensor, inv_scale: Tensor) -> None:
        """GradScaler's unscale op (or `scaler.step`'s inf check, `inv_scale` 1) on the layout whose
        step check is `current()`: `take(coefficient)` runs the layout's check (a collective) and
        scales the gradients by `coefficient` where their norm is finite; once per step check. Each
        call sets `found_inf` from the global norm (`finite`), the same on every rank."""
        now = current()
        if not any(f is found_inf for f in self.found):  # until a step() runs (`stepped`)
            self.found.append(found_inf)
        if now is not None and now is self.unscaled:
            # unscaled already in this step, through a wrapper of this optimizer (GradScaler's state
            # for the optimizer itself is still READY): one optimizer, one unscale
            if not finite(now):
                found_inf.fill_(1.0)
            return
        if now is not None and now is self.clipped:
            raise CanzonaError(AMP_AFTER_CLIP)
        if self.answered is None or self.answered is not now:
            coefficient = float(inv_scale)
            take(coefficient)
            self.answered = current()
            if coefficient != 1.0:
                self.unscaled = self.answered
        if not finite(current()):
            found_inf.fill_(1.0)
