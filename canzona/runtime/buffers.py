"""Flat parameter and gradient buffers whose slices are the model's `.data` and `.grad`.

The optimizer owns the storage: every parameter's `.data` and `.grad` are views into one flat
buffer per plan bucket (and one for the AdamW parameters), so that a bucket's gradients can be
reduce-scattered, and its parameters all-gathered, as one tensor.

Training loops break that link in ordinary ways, and a broken link must never pass silently:
- `model.zero_grad()` (torch's default `set_to_none=True`, what HF Trainer and Accelerate call)
  drops the `.grad` views; autograd then writes the next gradient into a fresh tensor. `claim`
  copies such a gradient back into the buffer and re-attaches the view; a parameter whose
  gradient was dropped and never recomputed counts as zero, as torch optimizers treat `None`.
- `model.to(dtype)`, `model.to(device)` or `load_state_dict(assign=True)` give parameters new
  storage: updates would land in the buffer and never reach the model. `unlinked` finds them.

Parameters are TP-local tensors: DTensor parameters link their local tensor to the buffer and get
a DTensor gradient over it (`canzona.runtime.shards`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import Tensor

from canzona.errors import SpecError
from canzona.runtime.shards import grad_holder, link_data, local_grad, local_tensor, same_storage


class FlatBuffer:
    """Parameters `names` at `offsets[name] = (start, end)` of flat buffers of `size` elements."""

    def __init__(self, names: Sequence[str], offsets: Mapping[str, tuple[int, int]], size: int,
                 params: Mapping[str, Tensor], reduce_dtype: torch.dtype | None = None) -> None:
        self.names = list(names)
        self.offsets = dict(offsets)
        self.size = size
        ref = local_tensor(params[self.names[0]]) if self.names else torch.zeros(0)
        for name in self.names:
            if params[name].dtype != ref.dtype or local_tensor(params[name]).device != ref.device:
                raise SpecError(f"parameters sharing a buffer must share dtype and device: {name} is "
                                f"{params[name].dtype} on {local_tensor(params[name]).device}, {self.names[0]} is "
                                f"{ref.dtype} on {ref.device}")
        self.data = torch.zeros(size, dtype=ref.dtype, device=ref.device)
        self.grad = torch.zeros(size, dtype=ref.dtype, device=ref.device)
        # what is reduced across ranks and read by the optimizer: the gradients themselves, or an
        # fp32 copy of low-precision ones (reduced and updated in fp32, as Megatron's main grads)
        self.reduced = self.grad if reduce_dtype in (None, ref.dtype) else \
            torch.zeros(size, dtype=reduce_dtype, device=ref.device)
        self.params = {n: params[n] for n in self.names}
        self.data_views: dict[str, Tensor] = {}
        self.grad_views: dict[str, Tensor] = {}
        self.grad_holders: dict[str, Tensor] = {}  # what `.grad` is while linked (a view or a DTensor)
        for name in self.names:
            a, b = self.offsets[name]
            p = params[name]
            local = local_tensor(p)
            self.data[a:b].copy_(local.detach().reshape(-1))
            self.data_views[name] = self.data[a:b].view(local.shape)
            self.grad_views[name] = self.grad[a:b].view(local.shape)
            self.grad_holders[name] = grad_holder(p, self.grad_views[name])
            link_data(p, self.data_views[name])
            p.grad = self.grad_holders[name]

    def claim(self, name: str) -> None:
        """Make the buffer hold `name`'s current gradient and its `.grad` the buffer's view again."""
        p, view = self.params[name], self.grad_views[name]
        if p.grad is self.grad_holders[name]:
            return
        fresh = local_grad(p)
        if fresh is None:  # dropped (set_to_none) and not recomputed: a zero gradient
            view.zero_()
        else:  # recomputed into a fresh tensor after set_to_none (or assigned by the user)
            view.copy_(fresh)
        p.grad = self.grad_holders[name]

    def zero_grads(self) -> None:
        """Every gradient zero and every `.grad` the buffer's view (a gradient the user assigned
        is dropped, as `optimizer.zero_grad()` drops it in torch)."""
        for name in self.names:
            self.params[name].grad = self.grad_holders[name]
        self.grad.zero_()

    def claim_all(self) -> None:
        for name in self.names:
            self.claim(name)

    def stage(self) -> Tensor:
        """Every gradient claimed and copied into `reduced`; returns `reduced`, ready to reduce."""
        self.claim_all()
        if self.reduced is not self.grad:
            self.reduced.copy_(self.grad)
        return self.reduced

    def reduced_view(self, name: str) -> Tensor:
        a, b = self.offsets[name]
        return self.reduced[a:b].view(self.data_views[name].shape)

    def is_linked(self, name: str) -> bool:
        """The parameter's storage is still this buffer's (not moved, cast or replaced)."""
        return same_storage(self.params[name], self.data_views[name])

    def unlinked(self) -> Iterator[str]:
        return (name for name in self.names if not self.is_linked(name))


def packed_offsets(names: Sequence[str], params: Mapping[str, Tensor]) -> tuple[dict[str, tuple[int, int]], int]:
    """Offsets of `names`' local tensors laid end to end, and the total size."""
    offsets, pos = {}, 0
    for name in names:
        numel = local_tensor(params[name]).numel()
        offsets[name] = (pos, pos + numel)
        pos += numel
    return offsets, pos
