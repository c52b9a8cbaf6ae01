"""Non-finite values outside the gradients (docs/design.md §8.3): NaN / Inf in a loaded optimizer
state or fp32 master, refused at the load, and in the weights, named when the step check finds a
non-finite gradient norm. torch's optimizers take both silently: a loaded NaN moment writes NaN
into the weights at the next step, and the step after that fails at the gradient norm as if the
data were bad (under `nonfinite="skip"`, every later step is skipped: nothing recovers from NaN
weights)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import Tensor

from canzona.fsdp_collectives import WEIGHTS_CHECK

if TYPE_CHECKING:
    from canzona.runtime.comm import Comm

K = TypeVar("K")

# The state fields that may hold +Inf (never NaN or -Inf): second moments whose step takes it as
# torch's AdamW does, sqrt(+Inf) in the denominator making that element's update 0, finite.
# torch.optim.AdamW keeps such an exp_avg_sq (a pure-fp16 state, `master_weights=False`, whose
# (1 - beta2) g^2 overflowed), and canzona's AdamW steps on from it bit for bit as torch's
# (tests/runtime/test_nonfinite_state.py); SOAP's (rotated) and Shampoo's grafting `exp_avg_sq`
# stay finite and equal their references alike (tests/reference/test_kernels_reference.py). Not a
# second moment that a `lerp_` updates (`second_moment`): inf + w (x - inf) is NaN, so +Inf there
# is refused as any other field's non-finite value.
SECOND_MOMENTS = frozenset({"exp_avg_sq"})


def first_nonfinite(named: Iterable[tuple[K, Tensor]], plus_inf: Callable[[K], bool] = lambda key: False) -> K | None:
    """The key of the first floating tensor of `named` that holds a NaN or an Inf (of a key for
    which `plus_inf` is true: a NaN or -Inf), or None: one reduction per tensor, its least and
    greatest element (`aminmax`, which propagates NaN; a twentieth of `isfinite(t).all()`'s time
    on the CPU, which writes a mask of the tensor first), in fp64 (no overflow), read by the host
    once per device, not per tensor."""
    found: dict[torch.device, tuple[list[K], list[Tensor]]] = {}
    for key, t in named:
        if t.is_floating_point() and t.numel():
            keys, ends = found.setdefault(t.device, ([], []))
            keys.append(key)
            t = t.detach()
            if t.element_size() == 1:  # float8, which `aminmax` cannot read: fp32 holds every value exactly
                t = t.float()
            least, greatest = torch.aminmax(_row_major(t))
            if plus_inf(key):  # +Inf allowed: the least element alone (a NaN anywhere makes it
                # NaN, -Inf is -Inf), +Inf there (every element +Inf: a one-element bias's) counted finite
                least = torch.where(least == math.inf, torch.zeros_like(least), least)
                greatest = least
            ends.append(torch.stack((least, greatest)).double())
    for keys, ends in found.values():
        finite = torch.isfinite(torch.stack(ends)).all(dim=1).cpu()
        if not bool(finite.all()):
            return keys[int(torch.nonzero(~finite)[0])]
    return None


def _row_major(t: Tensor) -> Tensor:
    """`t`, or its transpose where that is contiguous (SOAP's column-major eigenbases): the same
    elements, which a reduction over all of them reads ten times faster in memory order."""
    return t.mT if t.ndim >= 2 and not t.is_contiguous() and t.mT.is_contiguous() else t


def nonfinite_weights_error(weights: Sequence[tuple[str, Tensor]], norm: float,
                            comms: Sequence[Comm | None]) -> str | None:
    """After a step check found the global gradient norm `norm` not finite (every rank of `comms`
    alike): whether any rank holds weights that are not finite, as one message naming the
    parameter, the same on every rank of `comms`, or None (a gradient's own NaN: the data, an
    overflow). `weights`: this rank's local tensors by parameter name, in an order the same on
    every rank (the optimizer's, as the step check's table of who got a gradient): each rank sends
    the position of its first non-finite one (-1: none), one word in one small all-gather in each
    group of `comms` (this failure path only); every rank takes the first rank's. Collective."""
    bad = first_nonfinite((i, t) for i, (_, t) in enumerate(weights))
    index = -1 if bad is None else bad
    for comm in (c for c in comms if c is not None):
        table = comm.all_gather_values(torch.tensor([index], dtype=torch.int64), WEIGHTS_CHECK)[:, 0]
        found = table[table >= 0]
        index = int(found[0]) if found.numel() else -1
    if index < 0:
        return None
    return (f"the weights of {weights[index][0]!r} are not finite (NaN or Inf), and so is the global gradient "
            f"norm ({norm}): the weights, not the data, are NaN / Inf, put there by the last step (a NaN or Inf "
            "in the optimizer state, a degenerate preconditioner), a loaded checkpoint or an edit; nothing was "
            "updated, and skipping steps (nonfinite='skip') cannot recover them. Resume from a checkpoint saved "
            "before they went non-finite")


def nonfinite_state_error(state: Iterable[tuple[str, dict]]) -> str | None:
    """A message naming the first parameter and field of an optimizer state by name (its entries,
    fp32 masters included) whose floating value (tensor or number) is not finite (a second
    moment's, `SECOND_MOMENTS`: NaN or -Inf; +Inf is its legitimate overflow), or None."""
    tensors: list[tuple[tuple[str, str], Tensor]] = []
    bad: tuple[str, str] | None = None
    for name, entry in state:
        for field, value in entry.items():
            if isinstance(value, Tensor):
                tensors.append(((name, field), value))
            elif isinstance(value, float) and not math.isfinite(value):  # a step count as a float
                bad = bad or (name, field)
    bad = bad or first_nonfinite(tensors, lambda key: key[1] in SECOND_MOMENTS)
    if bad is None:
        return None
    # a second moment may hold +Inf (`SECOND_MOMENTS`)
    held = "NaN or -Inf" if bad[1] in SECOND_MOMENTS else "NaN or Inf"
    return (f"optimizer state of {bad[0]!r} is damaged: its {bad[1]!r} holds {held} (a damaged or hand-edited "
            "checkpoint; torch's optimizers load it silently, and the next step writes NaN into the weights): "
            "nothing was loaded")
