"""Parameters whose step all-gather is still in flight (`overlap_param_gather`), marked so that any
read of their values waits for it first, whoever reads them: torch's EMA
(`AveragedModel.update_parameters`), `copy.deepcopy(model)`, pickling a parameter,
`model.parameters()` iterated by hand, a module's forward reading another module's weight.

The mark is the parameter's class: `step()` swaps each `nn.Parameter` it gathers to
`PendingParameter` (as torch's own `UninitializedParameter.materialize` swaps `__class__`), whose
`__torch_function__` waits for the gathers of a pending argument, swaps it back and runs the op.
Once a bucket has landed (a forward's pre-hook, `wait_params()`), its parameters are plain
`nn.Parameter`s again: the forward's own ops, and everything with `overlap_param_gather=False`, never
reach this class. What reads no values (`.grad`, shape, dtype, `requires_grad`, hooks, `_version`: `zero_grad()`
right after `step()`) runs at once and keeps the gathers in flight.

Only the exact class `nn.Parameter` is marked: a DTensor or a parameter class of the user's own is
left as it is (its reads outside the forwards are `ParamsInFlight.check_read`'s error, or silent).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

# what torch.compile(fullgraph=True) says when a traced forward meets gathers in flight: a wait on a
# collective cannot be part of a graph (dynamo breaks the graph there, and fullgraph forbids breaks)
FULLGRAPH = ("canzona: a forward compiled with fullgraph=True cannot wait for the parameter all-gathers that "
             "step() left in flight (overlap_param_gather): build the DistributedOptimizer with "
             "overlap_param_gather=False (step() then returns with the parameters gathered), or compile "
             "without fullgraph (the forward then waits, eagerly, where a module needs them)")

# id(parameter) -> what waits for its gathers (and unmarks it); registered while its optimizer lives
_WAITERS: dict[int, Callable[[], None]] = {}

# what reads no values of a parameter: run without waiting
_METADATA = frozenset({
    Tensor.grad.__get__, Tensor.grad.__set__, Tensor.grad.__delete__,
    Tensor.requires_grad.__get__, Tensor.requires_grad.__set__, Tensor.requires_grad_,
    Tensor.shape.__get__, Tensor.dtype.__get__, Tensor.device.__get__, Tensor.layout.__get__,
    Tensor.ndim.__get__, Tensor.is_cuda.__get__, Tensor.is_sparse.__get__, Tensor.is_leaf.__get__,
    Tensor.grad_fn.__get__, Tensor.size, Tensor.dim, Tensor.numel, Tensor.stride,
    Tensor.storage_offset, Tensor.is_contiguous, Tensor.element_size, Tensor.data_ptr, Tensor.__len__,
    Tensor.register_hook, Tensor.register_post_accumulate_grad_hook,
    # Hugging Face's `model.dtype` / `model.device` ask the first parameter these
    Tensor.is_floating_point, Tensor.is_complex, Tensor.get_device, Tensor.nbytes.__get__,
    Tensor.itemsize.__get__,
    # the optimizer's record of in-place writes (`model_loads.WeightVersions`), read after step()
    Tensor._version.__get__,
})


class PendingParameter(nn.Parameter):
    """An `nn.Parameter` whose step all-gather is in flight (the class only while it is)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        for t in _tensors((args, kwargs)):
            if type(t) is PendingParameter:
                land(t)
        return func(*args, **kwargs)  # every pending argument is a plain parameter now

    # Parameter's own would build the copy with type(self) (this class) before reading `.data`
    def __deepcopy__(self, memo):
        land(self)
        return self.__deepcopy__(memo)


def _tensors(obj: object) -> Iterable[Tensor]:
    """The tensors of a torch function's arguments (lists of them: `torch.cat`, the foreach ops)."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


@torch.compiler.disable(reason=FULLGRAPH)
def land(p: Tensor) -> None:
    """Wait for `p`'s gathers; `p` is a plain `nn.Parameter` afterwards. If the wait raised, `p`
    stays marked: its gather did not write it, and each later read raises that error again."""
    waiter = _WAITERS.get(id(p))
    if waiter is not None:
        waiter()
    unmark((p,))


def markable(p: Tensor) -> bool:
    return type(p) is nn.Parameter


def watch(p: Tensor, waiter: Callable[[], None]) -> None:
    """`waiter` waits for `p`'s gathers (and unmarks it) when a read of pending `p` needs them."""
    _WAITERS[id(p)] = waiter


def unwatch(params: Iterable[Tensor]) -> None:
    for p in params:
        _WAITERS.pop(id(p), None)


def mark(params: Iterable[Tensor]) -> None:
    for p in params:
        p.__class__ = PendingParameter


def unmark(params: Iterable[Tensor]) -> None:
    for p in params:
        if type(p) is PendingParameter:
            p.__class__ = nn.Parameter
