"""Stacked experts in the runtime: a `[experts, m, n]` parameter is that many matrices
(docs/design.md §2.6, §8.2).

The plan places, owns and schedules each matrix of a stack (`'<param>[k]'`) on its own, and lays
stack matrices out in buckets of their own, in forward order (each stack in memory order) and
unpadded (`canzona.dp.layout.make_buckets`): read from the last to the first, a run of
consecutive such buckets holds its stacks exactly as the parameters lie one after another. So the
optimizer allocates one storage per run: each stacked parameter's `.data` is a view of its range,
each bucket's parameter buffer a view of the bucket's range, and each matrix an `m x n` view.
Nothing of the experts' weights is copied; gradients are moved into the buckets' gradient
buffers as every other parameter's are, one slice of the stack's gradient per matrix.

The rest of the runtime works on *entries*, the names a plan places: a plain parameter is one
entry (its own name), a stack one entry per matrix. Hooks, `.grad` guards and the "got a
gradient" table stay per parameter.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import Tensor

from canzona.dp.layout import BucketPlan
from canzona.errors import PlanError, SpecError
from canzona.runtime.shards import link_data, local_tensor, same_storage
from canzona.spec import ModelSpec, ParamSpec, stacked_matrices


class Stacks:
    """The model's stacked parameters: their storage, their matrices' views and names."""

    def __init__(self, spec: ModelSpec, params: Mapping[str, Tensor], buckets: Sequence[BucketPlan]) -> None:
        self.storage: dict[str, Tensor] = {}  # stack name -> its elements (the parameter is a view)
        self.views: dict[str, Tensor] = {}  # matrix name -> its m x n view of the storage
        self.members: dict[str, tuple[str, ...]] = {}  # every parameter -> its entries
        self.param_of: dict[str, str] = {}  # every entry -> its parameter
        self._bucket_data: dict[int, Tensor] = {}  # plan bucket index -> its parameter buffer
        self._params = params
        stacks = {p.name: p for p in spec.stacks}
        for name in params:
            if name not in stacks:
                self.members[name] = (name,)
                self.param_of[name] = name
        for name, pspec in stacks.items():
            self.members[name] = tuple(m.name for m in stacked_matrices(pspec))
            self.param_of.update({m: name for m in self.members[name]})
        if not stacks:
            return
        where = self._lay_out(buckets, stacks)
        for name, pspec in stacks.items():
            numel = math.prod(pspec.matrix_shape)
            flat, first = where[self.members[name][0]]
            if any(where[m] != (flat, first + k * numel) for k, m in enumerate(self.members[name])):
                raise PlanError(f"the plan does not lay the matrices of stack {name!r} out as the parameter holds "
                                "them (one after another, in order, in consecutive buckets of stack matrices "
                                "only): re-make the plan with this canzona")
            local = local_tensor(params[name])
            storage = flat[first:first + local.numel()]
            storage.copy_(local.detach().reshape(-1))
            link_data(params[name], storage.view(local.shape))
            self.storage[name] = storage
            for k, matrix in enumerate(self.members[name]):
                self.views[matrix] = storage[k * numel:(k + 1) * numel].view(pspec.matrix_shape)

    def _lay_out(self, buckets: Sequence[BucketPlan], stacks: Mapping[str, ParamSpec]) -> dict[str, tuple[Tensor, int]]:
        """Allocate one storage per run of consecutive buckets of stack matrices, the buckets laid
        from the last to the first (forward order: `canzona.dp.layout.make_buckets`), and return
        where each matrix lies (storage, element offset)."""
        runs: list[list[BucketPlan]] = []
        previous = None
        for b in buckets:
            names = [p.name for p in b.params]
            stacked = [n for n in names if self.param_of.get(n) in stacks]
            if not stacked:
                previous = None
                continue
            if len(stacked) != len(names):
                raise PlanError(f"plan bucket {b.index} holds stack matrices beside other parameters: re-make the plan "
                                "with this canzona (stack matrices fill buckets of their own)")
            if previous is None:
                runs.append([])
            runs[-1].append(b)
            previous = b
        where: dict[str, tuple[Tensor, int]] = {}
        for run in runs:
            first = local_tensor(self._params[self.param_of[run[0].params[0].name]])
            flat = torch.empty(sum(b.size for b in run), dtype=first.dtype, device=first.device)
            pos = 0
            for b in reversed(run):
                self._bucket_data[b.index] = flat[pos:pos + b.size]
                for p in b.params:
                    where[p.name] = (flat, pos + p.offset)
                pos += b.size
            for stack in {self.param_of[p.name] for b in run for p in b.params}:
                t = local_tensor(self._params[stack])
                if (t.dtype, t.device) != (first.dtype, first.device):
                    raise SpecError(f"stacked parameters sharing buckets must share dtype and device: {stack} is "
                                    f"{t.dtype} on {t.device}, another is {first.dtype} on {first.device}")
        return where

    def __bool__(self) -> bool:
        return bool(self.storage)

    def tensor(self, entry: str) -> Tensor:
        """The local tensor of an entry: a parameter's, or a matrix's view of its stack."""
        view = self.views.get(entry)
        return view if view is not None else local_tensor(self._params[entry])

    def tensors(self) -> dict[str, Tensor]:
        """Every entry's local tensor."""
        return {entry: self.tensor(entry) for entries in self.members.values() for entry in entries}

    def parts(self, name: str, grad: Tensor) -> Iterator[tuple[str, Tensor]]:
        """(entry, its part of `grad`), `grad` being parameter `name`'s (local) gradient."""
        if name not in self.storage:
            yield name, grad
            return
        flat = grad.reshape(-1)
        pos = 0
        for matrix in self.members[name]:
            view = self.views[matrix]
            yield matrix, flat[pos:pos + view.numel()].view(view.shape)
            pos += view.numel()

    def bucket_data(self, bucket: BucketPlan) -> Tensor | None:
        """The parameter buffer of a bucket of stack matrices: its range of their storage (None: a
        bucket of other parameters, whose buffer the bucket allocates)."""
        return self._bucket_data.get(bucket.index)

    def is_linked(self, name: str) -> bool:
        """Stack `name` still lives in its storage (not moved, cast or replaced)."""
        return same_storage(self._params[name], self.storage[name].view(local_tensor(self._params[name]).shape))

    def unlinked(self) -> Iterator[str]:
        return (name for name in self.storage if not self.is_linked(name))
