"""Weights written in place after the optimizer was built (`canzona.runtime.model_loads.WeightVersions`),
in one process: what the version counters see, and that the optimizer's own writes (its steps, a
clip) mark nothing. The spread to every rank of a spawned group: test_runtime_training_loops
("rank zero load"), test_fsdp_runtime ("load-on-one-rank"), test_runtime_tp_robustness
("sharded_write_on_one_tp_rank")."""

from __future__ import annotations

import pytest
import torch

from canzona.runtime.model_loads import WeightVersions
from tests.runtime.test_nonfinite_state import LAYOUTS, _weights

pytestmark = pytest.mark.distributed  # a one-rank gloo group in this process (DTensor, the optimizers)


def test_writes_through_a_parameter_or_a_view_of_it_are_seen_and_reads_are_not():
    p, q = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(3))
    versions = WeightVersions([p, q])
    (p * 2).sum().backward()  # forward, backward, a gradient: no write of the weights
    p.grad.mul_(0.5)
    assert not versions.written()
    with torch.no_grad():
        p[1].add_(1.0)  # through a view
    assert versions.written() and not versions.written()  # each read takes the record anew
    with torch.no_grad():
        q.copy_(torch.ones(3))
    assert versions.written()
    q.data.fill_(2.0)  # the documented limit: `.data` has a version counter of its own
    assert not versions.written()


def test_a_dtensor_is_seen_written_through_itself_or_its_local_tensor(one_rank):
    """DTensor's in-place ops move the wrapper's counter only, a write into `to_local()` its local
    tensor's: both are summed. Another local tensor put in place (FSDP2 re-padding it at its lazy
    init, the same values) resets the record instead of marking a write."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    p = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0)]))
    versions = WeightVersions([p])
    with torch.no_grad():
        p.copy_(distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]))
    assert versions.written()
    with torch.no_grad():
        p.to_local().add_(1.0)
    assert versions.written()
    p._local_tensor = p._local_tensor.clone().add_(0.0)  # another tensor, written before it was put in place
    assert not versions.written()
    assert not versions.written()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_optimizers_own_writes_mark_nothing_and_a_write_is_one_comparison(one_rank, layout):
    """Steps and step()'s own clip leave the optimizer unmarked (under ZeRO-1: no weight
    comparison); a write on the one rank marks it once (one comparison, which agrees), and the step
    trains the written weights."""
    model, opt, step = LAYOUTS[layout]()
    compared = []
    if layout == "zero1":
        check = opt._check_agreement
        opt._check_agreement = lambda *a, **k: (compared.append(k.get("weights")), check(*a, **k))[1]
    step()
    marks = [opt._model_loaded]
    opt.max_grad_norm = 1e-3  # step()'s own clip, which scales the gradients
    step()
    assert not any(marks) and not opt._model_loaded and compared == [], (marks, compared)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    written = _weights(model)
    step()
    assert not opt._model_loaded and compared == (["loaded"] if layout == "zero1" else [])
    assert not all(torch.equal(a, b) for a, b in zip(written.values(), _weights(model).values()))


def test_grad_scaler_and_clips_mark_nothing(one_rank):
    """GradScaler's unscale_ and step, and opt.clip_grad_norm_, touch the gradients only: no
    comparison under ZeRO-1 (a false mark would cost one at every step)."""
    from tests.runtime.test_runtime_habits import _batches

    model, opt, _ = LAYOUTS["zero1"]()
    compared = []
    check = opt._check_agreement
    opt._check_agreement = lambda *a, **k: (compared.append(k.get("weights")), check(*a, **k))[1]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    for k, tokens in enumerate(_batches(0, 1)[:2]):
        opt.zero_grad()
        scaler.scale(model.loss(tokens)).backward()
        if k:
            scaler.unscale_(opt)
            opt.clip_grad_norm_(1e-3)
        scaler.step(opt)
        scaler.update()
    assert compared == [] and not opt._model_loaded and scaler.get_scale() == 2.0 ** 4
