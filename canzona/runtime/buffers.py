"""Flat parameter and gradient buffers: the parameters' `.data` are views into them, gradients are
moved into them.

The optimizer owns the storage: every parameter's `.data` is a view into one flat buffer per plan
bucket (and one for the AdamW parameters), so that a bucket's parameters can be all-gathered as
one tensor; each parameter's gradient is written into the bucket's flat gradient buffer by a
backward hook, so that the bucket can be reduce-scattered as one tensor. `.grad` is never a view
of these buffers: collectives read and write them while the user's code runs, so the parameter's
`.grad` holds a guard instead (`canzona.runtime.grad_guard`).

Training loops break the storage link in ordinary ways, and a broken link must never pass
silently: `model.to(dtype)`, `model.to(device)` (even `cpu` -> `cpu:0`, which copies) or
`load_state_dict(assign=True)` give parameters new storage, so updates would land in the buffer
and never reach the model. `unlinked` finds them.

Parameters are TP-local tensors: for DTensor parameters the local tensor lives in the buffer
(`canzona.runtime.shards`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from canzona.dp.layout import pieces_inside
from canzona.errors import SpecError
from canzona.runtime.shards import link_data, local_tensor, same_storage


class FlatBuffer:
    """Parameters `names` at `offsets[name] = (start, end)` of flat buffers of `size` elements."""

    def __init__(self, names: Sequence[str], offsets: Mapping[str, tuple[int, int]], size: int,
                 params: Mapping[str, Tensor], reduce_dtype: torch.dtype | None = None,
                 data: Tensor | None = None) -> None:
        """`data`: the parameter buffer, given when it exists already (a range of a stack's storage,
        `canzona.runtime.stacks`, whose matrices `params` are views of it); allocated, filled and
        linked to the parameters otherwise."""
        self.names = list(names)
        self.offsets = dict(offsets)
        self.size = size
        ref = local_tensor(params[self.names[0]]) if self.names else torch.zeros(0)
        for name in self.names:
            dtype, device = params[name].dtype, local_tensor(params[name]).device
            if dtype != ref.dtype or device != ref.device:
                # the advice for what differs: a cast where the dtypes do, a move where the devices do
                fixes = ([f"cast the model to one dtype (model.to({dtype if ref.dtype == torch.float32 else ref.dtype})) "
                          "before building the optimizer (a bf16 or fp16 model gets fp32 master weights)"]
                         if dtype != ref.dtype else []) + \
                    (["move the model to one device before building the optimizer"] if device != ref.device else [])
                raise SpecError(f"parameters sharing a buffer must share dtype and device: {name} is {dtype} on "
                                f"{device}, {self.names[0]} is {ref.dtype} on {ref.device}: {'; '.join(fixes)}")
        given = data is not None
        self.data = data if given else torch.zeros(size, dtype=ref.dtype, device=ref.device)
        # the gradients, accumulated over micro-batches, reduced across ranks and read by the
        # optimizer, in `reduce_dtype` (default: the parameters'). Low-precision models keep one
        # fp32 buffer, as Megatron's main grads: backward's bf16 gradient of each micro-batch is
        # widened (exactly) and added in fp32, with no second buffer in the parameters' dtype.
        # Padding between parameters stays zero.
        self.grad = torch.zeros(size, dtype=reduce_dtype or ref.dtype, device=ref.device)
        self.params = {n: params[n] for n in self.names}
        self.data_views: dict[str, Tensor] = {}
        self.grad_views: dict[str, Tensor] = {}
        for name in self.names:
            a, b = self.offsets[name]
            local = local_tensor(params[name])
            if not given:
                self.data[a:b].copy_(local.detach().reshape(-1))
            self.data_views[name] = self.data[a:b].view(local.shape)
            self.grad_views[name] = self.grad[a:b].view(local.shape)
            if not given:
                link_data(params[name], self.data_views[name])

    def write(self, name: str, grad: Tensor) -> None:
        """`name`'s gradient is `grad` (this rank's local values)."""
        self.grad_views[name].copy_(grad)

    def add(self, name: str, grad: Tensor) -> None:
        """Accumulate `grad` onto `name`'s gradient, in the buffer's dtype (`accumulate_`)."""
        accumulate_(self.grad_views[name], grad)

    def zero(self, name: str) -> None:
        """`name` has no gradient this step: it counts as zero, as torch optimizers treat None."""
        self.grad_views[name].zero_()

    @property
    def reduced(self) -> Tensor:
        """What is reduced across ranks and read by the optimizer: the gradient buffer itself."""
        return self.grad

    def reduced_view(self, name: str) -> Tensor:
        return self.grad_views[name]

    def is_linked(self, name: str) -> bool:
        """The parameter's storage is still this buffer's (not moved, cast or replaced)."""
        return same_storage(self.params[name], self.data_views[name])

    def unlinked(self) -> Iterator[str]:
        return (name for name in self.names if not self.is_linked(name))


class Piece(NamedTuple):
    """A parameter's elements that one rank updates elementwise (AdamW): `buffer[start:end]`, which
    is `[offset, offset + end - start)` of the parameter's flattened local tensor."""

    name: str
    buffer: FlatBuffer
    start: int
    end: int
    offset: int


def pieces_of(buffer: FlatBuffer, lo: int, hi: int) -> Iterator[Piece]:
    """The pieces of `buffer`'s parameters inside `[lo, hi)`, in layout order."""
    spans = ((name, *buffer.offsets[name]) for name in buffer.names)
    for name, s, e in pieces_inside(spans, lo, hi):
        yield Piece(name, buffer, s, e, s - buffer.offsets[name][0])


def accumulation_dtype(dtype: torch.dtype, master_weights: bool) -> torch.dtype:
    """What gradients of parameters of `dtype` are accumulated, reduced and updated in: fp32 for
    low-precision parameters with master weights, the parameters' dtype otherwise."""
    low = dtype in (torch.bfloat16, torch.float16)
    return torch.float32 if low and master_weights else dtype


def accumulate_(acc: Tensor, grad: Tensor) -> None:
    """`acc += grad`, in `acc`'s dtype: a bf16 gradient is widened exactly and added in fp32.
    The one definition of gradient accumulation over micro-batches, which the single-process
    references (`canzona.harness.training`) use too."""
    acc.add_(grad)  # mixed dtypes compute in the wider one, with no widened copy


def packed_offsets(names: Sequence[str], params: Mapping[str, Tensor]) -> tuple[dict[str, tuple[int, int]], int]:
    """Offsets of `names`' local tensors laid end to end, and the total size."""
    offsets, pos = {}, 0
    for name in names:
        numel = local_tensor(params[name]).numel()
        offsets[name] = (pos, pos + numel)
        pos += numel
    return offsets, pos
