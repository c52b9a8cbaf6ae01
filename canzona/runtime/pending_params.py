"""Parameters whose step all-gather is still in flight (`overlap_param_gather`), marked so that a
read of their values through torch's Python API waits for it first, whoever reads them: torch's EMA
(`AveragedModel.update_parameters`), `copy.deepcopy(model)`, pickling a parameter,
`model.parameters()` iterated by hand, a module's forward reading another module's weight.
Not every read: what reaches the storage below `__torch_function__` does not wait and sees last
step's values (or half-landed ones): a reader by `data_ptr()` alone (metadata here, kept in
flight: ctypes, a C extension handed the pointer). torch.distributed's collectives and
safetensors' `save` handed a pending tensor do wait (torch 2.13, safetensors 0.8), but only
because they call a torch function on it first (safetensors: `untyped_storage()`), a detail
of theirs that later versions need not keep; `p.to_local()` itself waits. For such readers call
`opt.wait_params()` first (`model.state_dict()` waits by itself).

The mark is the parameter's class: `step()` swaps each `nn.Parameter` it gathers to
`PendingParameter` (as torch's own `UninitializedParameter.materialize` swaps `__class__`), whose
`__torch_function__` waits for the gathers of a pending argument, swaps it back and runs the op.
Once a bucket has landed (a forward's pre-hook, `wait_params()`), its parameters are plain
`nn.Parameter`s again: the forward's own ops, and everything with `overlap_param_gather=False`, never
reach this class. What reads no values (`.grad`, shape, dtype, `requires_grad`, hooks, `_version`: `zero_grad()`
right after `step()`) runs at once and keeps the gathers in flight.

A DTensor parameter (a TP model's under ZeRO-1) is marked twice: the wrapper's class swapped to
`PendingDTensor` (DTensor's own `__torch_function__` is disabled; its ops run below it, in
`__torch_dispatch__`, where no torch function of the local tensor is called) and its local
tensor's to `PendingLocal` (what `to_local()` and `_local_tensor` hand out). Either read waits
for the gathers and unmarks both. The cost is two class swaps a DTensor parameter a step (about
what a plain parameter's one costs twice), and nothing once landed: the forward's own ops reach
neither class. A `nn.Parameter` subclass of the user's own (a quantisation library's) is marked
by a pending subclass of its class, made at its first use (`_pending_parameter_class`; before
2026-12-03 it was left unmarked, and a read outside the forwards saw last step's values,
silently); its copies and pickles (`__deepcopy__`, `__copy__`, `__reduce_ex__`) land first and
are made as the user's class makes them. A DTensor whose local tensor is itself a subclass, a
DTensor subclass, or a Parameter class that takes no subclass (its `__init_subclass__` raising
included) is left as it is (its reads outside the forwards are
`ParamsInFlight.check_read`'s error, or silent).
"""

from __future__ import annotations

import copy
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


def _pending_torch_function(func, args, kwargs):
    """What a pending tensor's `__torch_function__` does: metadata at once, else land first."""
    kwargs = kwargs or {}
    if func in _METADATA:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    # a copy's memo (`Tensor.__deepcopy__(self, memo)`) holds everything copied so far: not its arguments
    for t in (args[:1] if func is Tensor.__deepcopy__ else _tensors((args, kwargs), set())):
        if type(t) in _PENDING:
            land(t)
    return func(*args, **kwargs)  # every pending argument is unmarked now


def _land_and_copy(self: Tensor, memo: dict) -> Tensor:
    """A pending tensor's `__deepcopy__`: land it, then copy it as its own class would (torch's
    would hand the memo to `__torch_function__` as an argument, which is not walked for tensors)."""
    land(self)
    return self.__deepcopy__(memo)


def _land_and_reduce(self: Tensor, proto: int) -> object:
    """A pending user class's `__reduce_ex__` (pickling, `torch.save`): land it, then reduce it as
    its own class would (one capturing `self.__class__` would capture the pending class)."""
    land(self)
    return self.__reduce_ex__(proto)


def _land_and_shallow_copy(self: Tensor) -> Tensor:
    """A pending user class's `__copy__`: land it, then copy it as its own class would (one
    building with `type(self).__new__` would build the pending class)."""
    land(self)
    return copy.copy(self)


class PendingParameter(nn.Parameter):
    """An `nn.Parameter` whose step all-gather is in flight (the class only while it is)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _pending_torch_function(func, args, kwargs)

    # Parameter's own would build the copy with type(self) (this class) before reading `.data`
    __deepcopy__ = _land_and_copy


class PendingLocal(Tensor):
    """The local tensor of a DTensor parameter whose step all-gather is in flight."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _pending_torch_function(func, args, kwargs)

    __deepcopy__ = _land_and_copy


def _pending_parameter_class(cls: type) -> type:
    """The pending class of `cls`, an `nn.Parameter` subclass of the user's own (a quantisation
    library's): a subclass of it, made at its first mark, whose `__torch_function__` waits as
    `PendingParameter`'s does; no slots of its own, so that an instance's class can be swapped."""
    pending = _PENDING_OF.get(cls)
    if pending is None:
        pending = type(f"Pending{cls.__name__}", (cls,), {
            "__slots__": (), "__module__": __name__,
            "__doc__": f"A `{cls.__qualname__}` whose step all-gather is in flight (the class only while it is).",
            "__torch_function__": classmethod(lambda c, func, types, args=(), kwargs=None:
                                              _pending_torch_function(func, args, kwargs)),
            "__deepcopy__": _land_and_copy, "__copy__": _land_and_shallow_copy,
            "__reduce_ex__": _land_and_reduce})
        _PENDING_OF[cls] = pending
        _BASE_OF[pending] = cls
        _PENDING.add(pending)
    return pending


def _pending_dtensor_class() -> type | None:
    """`PendingDTensor`, made at the first use (torch.distributed.tensor imported then only)."""
    global _PENDING_DTENSOR
    if _PENDING_DTENSOR is None:
        from torch.distributed.tensor import DTensor

        class PendingDTensor(DTensor):
            """A DTensor parameter whose step all-gather is in flight (the class only while it is)."""

            @classmethod
            def __torch_function__(cls, func, types, args=(), kwargs=None):
                return _pending_torch_function(func, args, kwargs)

            __deepcopy__ = _land_and_copy
        _PENDING_DTENSOR = PendingDTensor
        _PENDING.add(PendingDTensor)
    return _PENDING_DTENSOR


_PENDING_DTENSOR: type | None = None
_PENDING: set[type] = {PendingParameter, PendingLocal}
# a Parameter class -> its pending class, and back (`_pending_parameter_class`)
_PENDING_OF: dict[type, type] = {nn.Parameter: PendingParameter}
_BASE_OF: dict[type, type] = {PendingParameter: nn.Parameter}
# id(a pending DTensor's local tensor) -> id(the DTensor), for `land` to find its waiter
_OWNER: dict[int, int] = {}


def _dtensor_class() -> type | None:
    import sys

    if "torch.distributed.tensor" not in sys.modules:
        return None
    from torch.distributed.tensor import DTensor
    return DTensor


def _tensors(obj: object, seen: set[int]) -> Iterable[Tensor]:
    """The tensors of a torch function's arguments (lists of them: `torch.cat`, the foreach ops);
    each container once (`seen`: one that holds itself)."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple, dict)) and id(obj) not in seen:
        seen.add(id(obj))
        for item in (obj.values() if isinstance(obj, dict) else obj):
            yield from _tensors(item, seen)


@torch.compiler.disable(reason=FULLGRAPH)
def land(p: Tensor) -> None:
    """Wait for `p`'s gathers; `p` is a plain `nn.Parameter` afterwards. If the wait raised, `p`
    stays marked: its gather did not write it, and each later read raises that error again."""
    waiter = _WAITERS.get(_OWNER.get(id(p), id(p)))
    if waiter is not None:
        waiter()
    if type(p) is PendingLocal:  # no waiter unmarked it (its DTensor was unwatched)
        _OWNER.pop(id(p), None)
        p.__class__ = Tensor
    unmark((p,))


def _parameter_class(cls: type) -> bool:
    """`nn.Parameter`, or a subclass of the user's own: not a pending class, nor a lazy module's
    `UninitializedParameter` (which swaps its own class when materialised)."""
    return issubclass(cls, nn.Parameter) and cls not in _PENDING and \
        not issubclass(cls, nn.parameter.UninitializedTensorMixin)


def markable(p: Tensor) -> bool:
    if type(p) is nn.Parameter:
        return True
    if _parameter_class(cls := type(p)):
        try:  # a class that takes no subclass, or whose instances' class cannot be swapped: left as it is
            p.__class__ = _pending_parameter_class(cls)
            p.__class__ = cls
        except Exception:  # noqa: BLE001 - a TypeError, or what its __init_subclass__ raises (a registry's rule)
            return False
        return True
    dtensor = _dtensor_class()
    return dtensor is not None and type(p) is dtensor and type(p._local_tensor) is Tensor


def watch(p: Tensor, waiter: Callable[[], None]) -> None:
    """`waiter` waits for `p`'s gathers (and unmarks it) when a read of pending `p` needs them."""
    _WAITERS[id(p)] = waiter


def unwatch(params: Iterable[Tensor]) -> None:
    for p in params:
        _WAITERS.pop(id(p), None)


def mark(params: Iterable[Tensor]) -> None:
    dtensor = _dtensor_class()
    for p in params:
        if type(p) is nn.Parameter:
            p.__class__ = PendingParameter
        elif dtensor is not None and type(p) is dtensor and type(local := p._local_tensor) is Tensor:
            # the wrapper and its local tensor; the owner first: a read of the local tensor (another
            # thread's) once it is marked finds the gathers to wait for, never none
            _OWNER[id(local)] = id(p)
            p.__class__ = _pending_dtensor_class()
            local.__class__ = PendingLocal
        elif (pending := _PENDING_OF.get(type(p))) is not None:  # of the user's own class (`markable`)
            p.__class__ = pending


def unmark(params: Iterable[Tensor]) -> None:
    for p in params:
        if (base := _BASE_OF.get(type(p))) is not None:
            p.__class__ = base
        elif type(p) is _PENDING_DTENSOR:
            p.__class__ = p.__class__.__bases__[0]
            local = p._local_tensor
            if type(local) is PendingLocal:
                _OWNER.pop(id(local), None)
                local.__class__ = Tensor
