"""The pending marks of `overlap_param_gather` (`pending_params`) against gathers that are slow or
fail, in one process: each gather here is a stand-in whose `wait()` sleeps, then writes this step's
values into the parameter's storage (as a landing all-gather does), or raises as a timed-out one does."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from canzona.errors import CanzonaError
from canzona.runtime.param_gather import ParamsInFlight

SLOW_S = 0.5


class Gather:
    """Writes `value` into `into` when waited for, after `SLOW_S`; or raises `error`."""

    def __init__(self, into: torch.Tensor, value: float, error: str | None = None) -> None:
        self.into, self.value, self.error = into, value, error

    def wait(self) -> None:
        time.sleep(SLOW_S)
        if self.error is not None:
            raise CanzonaError(self.error)
        self.into.fill_(self.value)


class Interrupted(Gather):
    """Ctrl-C arrives during its first wait; the gather itself goes on and lands at the next."""

    def wait(self) -> None:
        if not getattr(self, "interrupted", False):
            self.interrupted = True
            raise KeyboardInterrupt
        super().wait()


def _in_flight(error: str | None = None):
    """Two parameters of one module, in one bucket whose gather is in flight."""
    module = torch.nn.Linear(4, 4)
    storage = {n: p.detach() for n, p in module.named_parameters()}  # what the gather writes into
    params = dict(module.named_parameters())
    gathers = ParamsInFlight({n: (0,) for n in params}, {module: list(params)}, params)
    gathers.launch(lambda: [Gather(storage["weight"], 1.0, error)])
    return module, gathers


def test_a_read_from_another_thread_waits_for_the_gather_this_thread_is_waiting_for():
    """One thread's read waits for the gather; another thread reading the same parameter meanwhile
    sees this step's values too, not last step's (it found the gather taken and did not wait)."""
    module, gathers = _in_flight()
    first = threading.Thread(target=lambda: module.weight.sum())
    first.start()
    time.sleep(SLOW_S / 5)  # the first thread is in the gather's wait
    seen = module.weight.detach().clone()
    first.join()
    assert torch.equal(seen, torch.ones(4, 4))


def test_a_failed_gather_fails_every_later_read_of_what_it_writes():
    """A gather that failed (a peer died: the timeout's CanzonaError) leaves its parameters unwritten:
    the first read is that error, and so is every later read of them (the same read again, another
    parameter of its bucket, the module's forward), not a silent read of last step's values."""
    module, gathers = _in_flight("all-gather of bucket 0 on group dp failed or timed out after 5 s")
    for read in (lambda: module.weight.sum(), lambda: module.weight.sum(), lambda: module.bias.sum(),
                 lambda: module(torch.ones(4)), gathers.wait_all):
        with pytest.raises(CanzonaError, match="failed or timed out"):
            read()


def test_reads_of_metadata_do_not_wait():
    """What reads no values of a parameter leaves its gather in flight: `.grad`, shape, and what
    Hugging Face's `model.dtype` / `model.device` ask (`is_floating_point()`), sizes in bytes."""
    module, gathers = _in_flight()
    p = module.weight
    reads = (p.grad, p.shape, p.dtype, p.device, p.is_floating_point(), p.is_complex(), p.get_device(), p.nbytes,
             p.itemsize, p.element_size(), p.numel(), p.requires_grad, p.is_leaf)
    assert gathers.in_flight and type(p) is not torch.nn.Parameter, reads
    assert torch.equal(p.detach(), torch.ones(4, 4)) and not gathers.in_flight  # the first read of values waits


def test_the_optimizers_record_of_in_place_writes_does_not_wait():
    """`step()` ends by recording the parameters' version counters (`WeightVersions`), its gathers
    in flight: reading them lands nothing, and the gather's own landing (below the counters, as
    the step's all-gathers write) is not taken for a write of the user's."""
    from canzona.runtime.model_loads import WeightVersions

    module = torch.nn.Linear(4, 4)
    params = dict(module.named_parameters())
    gathers = ParamsInFlight({n: (0,) for n in params}, {module: list(params)}, params)
    # into the flat buffer the parameter is linked to (its own version counter, as `link_data` leaves it)
    gathers.launch(lambda: [Gather(module.weight.data, 1.0)])
    versions = WeightVersions(module.parameters())
    assert module.weight._version >= 0 and not versions.written()
    assert gathers.in_flight and type(module.weight) is not torch.nn.Parameter
    gathers.wait_all()
    assert not versions.written()
    with torch.no_grad():
        module.weight.copy_(torch.zeros(4, 4))  # a write of the user's, through the parameter
    assert versions.written() and not versions.written()  # seen once: each read takes the record anew


def test_a_wait_interrupted_by_ctrl_c_is_waited_for_again_at_the_next_read():
    """A notebook's Ctrl-C during the wait leaves the gather in flight: the next read waits for it
    and sees this step's values, not last step's."""
    module = torch.nn.Linear(4, 4)
    params = dict(module.named_parameters())
    gathers = ParamsInFlight({n: (0,) for n in params}, {module: list(params)}, params)
    gathers.launch(lambda: [Interrupted(module.weight.detach(), 1.0)])
    with pytest.raises(KeyboardInterrupt):
        module.weight.sum()
    assert torch.equal(module.weight.detach(), torch.ones(4, 4)) and not gathers.in_flight



def _dtensor_in_flight():
    """A module holding a DTensor parameter (a TP model's, on a one-rank mesh) whose gather, into
    its local tensor's storage, is in flight."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    module = torch.nn.Module()
    module.w = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 4), init_device_mesh("cpu", (1,)), [Shard(0)]))
    params = dict(module.named_parameters())
    gathers = ParamsInFlight({n: (0,) for n in params}, {module: list(params)}, params)
    # into the flat buffer the local tensor is linked to (a version counter of its own, as `link_data` leaves it)
    gathers.launch(lambda: [Gather(module.w._local_tensor.data, 1.0)])
    return module.w, gathers


@pytest.mark.distributed
@pytest.mark.parametrize("read", ["op", "to_local", "local tensor", "in-place write", "full_tensor", "deepcopy"])
def test_a_dtensor_parameter_is_marked_pending_and_a_read_of_its_values_waits(one_rank, read):
    """A DTensor parameter's read outside a forward while its gather is in flight (an op on it, its
    `to_local()`, its local tensor, an in-place write, `full_tensor()`, a deep copy) waits for the
    gather: the wrapper and its local tensor are both marked. Before, neither was: the read saw last
    step's values, and a write landed under the gather."""
    import copy

    from torch.distributed.tensor import DTensor

    p, gathers = _dtensor_in_flight()
    reads = {"op": lambda: (p * 1).to_local(), "to_local": lambda: p.to_local().clone(),
             "local tensor": lambda: p._local_tensor + 0, "full_tensor": lambda: p.full_tensor(),
             "deepcopy": lambda: copy.deepcopy(p).to_local()}
    if read == "in-place write":
        with torch.no_grad():
            p.add_(1.0)
        gathers.wait_all()
        assert torch.equal(p.to_local(), torch.full((4, 4), 2.0))  # the write is over the landed values
    else:
        assert torch.equal(reads[read](), torch.ones(4, 4))
        assert not gathers.in_flight
    assert type(p) is DTensor and type(p._local_tensor) is torch.Tensor and isinstance(p, torch.nn.Parameter)


@pytest.mark.distributed
def test_reads_of_a_pending_dtensors_metadata_do_not_wait(one_rank):
    """`.grad`, shape, placements, the optimizer's record of in-place writes: the gather stays in
    flight. A write of the user's into the pending local tensor waits for the gather and is seen
    by that record (once: each read takes the record anew). (The gather's own landing writes the
    flat buffer, whose version counter is its own, as `link_data` leaves it: it moves no counter the
    record reads, here as in a run.)"""
    from torch.distributed.tensor import DTensor

    from canzona.runtime.model_loads import WeightVersions

    p, gathers = _dtensor_in_flight()
    versions = WeightVersions([p])
    reads = (p.grad, p.shape, p.dtype, p.device, p.placements, p.device_mesh, p.requires_grad, p.numel(),
             p._local_tensor.shape, versions.written())
    assert gathers.in_flight and type(p) is not DTensor and isinstance(p, DTensor), reads
    with torch.no_grad():
        p.to_local().add_(1.0)  # lands first: the write is over this step's values
    assert type(p) is DTensor and not gathers.in_flight and torch.equal(p.to_local(), torch.full((4, 4), 2.0))
    assert versions.written() and not versions.written()


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["parameter", "dtensor", "local tensors"])
def test_a_deep_copy_of_a_model_with_a_self_referencing_attribute_lands_each_bucket_once(one_rank, kind):
    """`copy.deepcopy(model)` with two buckets in flight (children `a`, `b`), `a` holding a dict that
    holds itself: each pending parameter lands as the copy reaches it, and the copy holds this step's
    values. Before, a DTensor's copy went through its `__torch_function__` with deepcopy's memo as an
    argument, whose every container (the dict holding itself, deepcopy's keep-alive list) was
    walked for pending tensors: RecursionError. The same for a copy of the DTensors' local tensors
    (`local tensors`: a dict holding them after the self-referencing one)."""
    import copy

    root = torch.nn.Module()
    root.a, root.b = torch.nn.Module(), torch.nn.Module()
    if kind != "parameter":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (1,))
        for child in (root.a, root.b):
            child.w = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0)]))
    else:
        root.a.w, root.b.w = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4, 4))
    root.a.cfg = {}
    root.a.cfg["self"] = root.a.cfg
    params = dict(root.named_parameters())
    gathers = ParamsInFlight({"a.w": (0,), "b.w": (1,)}, {root.a: ["a.w"], root.b: ["b.w"]}, params)

    def local(p):
        return p if kind == "parameter" else p._local_tensor

    gathers.launch(lambda: [Gather(local(root.a.w).data, 1.0), Gather(local(root.b.w).data, 2.0)])
    if kind == "local tensors":
        copied = copy.deepcopy({"cfg": root.a.cfg, "a": root.a.w._local_tensor, "b": root.b.w._local_tensor})
        assert not gathers.in_flight and copied["cfg"]["self"] is copied["cfg"]
        assert type(copied["a"]) is torch.Tensor and torch.equal(copied["a"], torch.ones(4, 4))
        assert torch.equal(copied["b"], torch.full((4, 4), 2.0))
        return
    copied = copy.deepcopy(root)
    assert not gathers.in_flight
    assert torch.equal(local(copied.a.w).detach(), torch.ones(4, 4))
    assert torch.equal(local(copied.b.w).detach(), torch.full((4, 4), 2.0))
    assert copied.a.cfg["self"] is copied.a.cfg


@pytest.mark.distributed
def test_a_read_of_the_local_tensor_while_step_marks_it_waits_for_the_gather(one_rank):
    """A read of a DTensor parameter's local tensor from another thread at any point of `mark`
    (here: at each line `mark` runs, as a tracer sees it) finds the gather to wait for once the
    local tensor is marked. Before, its class was swapped before its owner was recorded: a read in
    that gap found no gather, unmarked it and saw last step's values."""
    import sys

    from canzona.runtime import pending_params

    p, gathers = _dtensor_in_flight()
    local = p._local_tensor
    pending_params.unmark([p])  # `launch` marked it: mark it again, under the tracer
    seen = []

    def tracer(frame, event, arg):
        if frame.f_code is not pending_params.mark.__code__:
            return None
        if not seen and type(local) is pending_params.PendingLocal:
            seen.append((local + 0).clone())  # the other thread's read, in this state of `mark`
        return tracer

    sys.settrace(tracer)
    try:
        pending_params.mark([p])
    finally:
        sys.settrace(None)
    assert seen and torch.equal(seen[0], torch.ones(4, 4)) and not gathers.in_flight
    p.to_local()  # unmarked, whatever order `mark` swaps the classes in
    from torch.distributed.tensor import DTensor
    assert type(p) is DTensor and type(p._local_tensor) is torch.Tensor


class UserParameter(torch.nn.Parameter):
    """A Parameter class of the user's own (as quantisation libraries define), with an attribute."""


@pytest.mark.parametrize("read", ["op", "detach", "in-place write", "deepcopy", "metadata"])
def test_a_parameter_of_a_users_own_class_is_marked_pending_and_a_read_of_its_values_waits(read):
    """A `nn.Parameter` subclass of the user's own, read outside a forward while its gather is in
    flight (an op, `detach()` as torch's EMA reads it, an in-place write, a deep copy) waits for the
    gather; metadata (`.grad`, shape) does not. Before, only `nn.Parameter` itself was marked: the
    read saw last step's values, silently, and a write landed under the gather. Unmarked, it is
    of its own class again, its attributes kept."""
    import copy

    module = torch.nn.Linear(4, 4)
    module.weight = UserParameter(torch.zeros(4, 4))
    module.weight.tag = "mine"
    params = dict(module.named_parameters())
    gathers = ParamsInFlight({n: (0,) for n in params}, {module: list(params)}, params)
    gathers.launch(lambda: [Gather(module.weight.detach(), 1.0)])
    p = module.weight
    marked = type(p) is not UserParameter
    if read == "metadata":
        assert p.grad is None and p.shape == (4, 4) and p.dtype == torch.float32 and gathers.in_flight and marked
        return
    if read == "in-place write":
        with torch.no_grad():
            p.add_(1.0)
        gathers.wait_all()
        assert torch.equal(p.detach(), torch.full((4, 4), 2.0))  # the write is over the landed values
    else:
        reads = {"op": lambda: p * 1, "detach": lambda: p.detach().clone(), "deepcopy": lambda: copy.deepcopy(p)}
        got = reads[read]()
        assert torch.equal(got.detach(), torch.ones(4, 4)) and not gathers.in_flight
        if read == "deepcopy":
            assert type(got) is UserParameter  # (torch's Parameter.__deepcopy__ copies no attributes)
    assert marked and type(p) is UserParameter and p.tag == "mine"


class RefusesSubclasses(torch.nn.Parameter):
    """A Parameter class of a library whose registry refuses subclasses it did not name."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        raise ValueError(f"only the registry's own subclasses: {cls.__name__}")


def test_a_parameter_class_that_refuses_a_subclass_is_left_unmarked():
    """A user's Parameter class whose `__init_subclass__` raises (a ValueError: a registry's
    rule) takes no pending class: left unmarked, as a class that takes no subclass is (before:
    its ValueError out of `markable`, the optimizer's construction)."""
    from canzona.runtime import pending_params

    p = RefusesSubclasses(torch.zeros(2, 2))
    assert not pending_params.markable(p) and type(p) is RefusesSubclasses


class Reducing(torch.nn.Parameter):
    """A Parameter class whose `__reduce_ex__` rebuilds it from `self.__class__`."""

    def __reduce_ex__(self, proto):
        return _rebuild_reducing, (self.__class__, self.detach().clone())


def _rebuild_reducing(cls, data):
    return cls(data)


class Copying(torch.nn.Parameter):
    """A Parameter class whose `__copy__` makes the copy with `type(self).__new__`."""

    def __copy__(self):
        new = type(self).__new__(type(self), self.detach().clone())
        new.__dict__.update(self.__dict__)
        return new


class QuickGather(Gather):
    def wait(self) -> None:
        time.sleep(0.05)
        self.into.fill_(self.value)


@pytest.mark.parametrize("how", ["pickle (__reduce_ex__ of self.__class__)", "copy.copy (__copy__ of type(self))"])
def test_a_pending_parameter_of_a_users_class_is_pickled_and_copied_as_its_class(how):
    """A user's Parameter class whose `__reduce_ex__` captures `self.__class__` (pickling,
    `torch.save`) or whose `__copy__` builds with `type(self).__new__`, read while its gather is
    in flight: the gather lands first and the copy is of the user's class with the landed values,
    the parameter unmarked. Before: the pending class leaked into them (pickle: 'Can't pickle
    PendingReducing', copy.copy: a PendingCopying copy of last step's values)."""
    import copy
    import pickle

    cls = Reducing if how.startswith("pickle") else Copying
    module = torch.nn.Linear(4, 4)
    module.weight = cls(torch.zeros(4, 4))
    params = dict(module.named_parameters())
    gathers = ParamsInFlight({n: (0,) for n in params}, {module: list(params)}, params)
    gathers.launch(lambda: [QuickGather(module.weight.detach(), 1.0)])
    p = module.weight
    assert type(p) is not cls
    got = pickle.loads(pickle.dumps(p)) if cls is Reducing else copy.copy(p)
    assert type(got) is cls and torch.equal(got.detach(), torch.ones(4, 4))
    assert type(p) is cls and not gathers.in_flight
