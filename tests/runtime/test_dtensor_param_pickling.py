"""A model whose parameters are DTensors (tensor parallelism through `parallelize_module`, or FSDP2's
`fully_shard` on a one-rank mesh, which takes the ZeRO-1 step) pickles as it does beside a torch
optimizer after canzona's optimizer has laid the parameters' local values into its buffers:
`torch.save(model.state_dict())` and `copy.deepcopy(model)` (an EMA copy) work and hold the
weights. torch 2.13's DTensor carries its local tensor's storage offset, and its pickling then
reads the data pointer of the wrapper's storage (an error), so a local value at a nonzero offset
of a buffer could not be saved (`canzona.runtime.shards.link_data`). One gloo rank in this process."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from canzona.errors import CanzonaError
from canzona.runtime import DistributedOptimizer
from canzona.spec import ModelSpec
from tests.runtime.test_fsdp_runtime import Small, small_batch


def _sharded(how: str) -> tuple[torch.nn.Module, dict]:
    model = Small()
    if how == "tp":
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"a": ColwiseParallel(), "b": RowwiseParallel()})
        return model, {"group": mesh}
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    return model, {}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@pytest.mark.parametrize("how", ["tp", "fsdp2"])
def test_a_dtensor_model_saves_and_deep_copies_after_steps(one_rank, how):
    model, kwargs = _sharded(how)
    before = io.BytesIO()
    torch.save(model.state_dict(), before)  # as beside a torch optimizer
    opt = DistributedOptimizer(model.named_parameters(), ModelSpec.from_module(Small()), "muon", **kwargs)
    for k in range(2):
        opt.zero_grad()
        model(small_batch(k, 0)).backward()
        opt.step()
    opt.wait_params()
    want = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    assert {n: _full(t) for n, t in saved.items()}.keys() == want.keys()
    assert all(torch.equal(_full(saved[n]), w) for n, w in want.items())
    if how == "fsdp2":  # every parameter a DTensor: each its own values, not the buffer around them
        # (the one at a buffer's start held it whole: the file grew by the other parameters' bytes)
        assert buf.getbuffer().nbytes == before.getbuffer().nbytes
    if how == "fsdp2":
        return  # torch's FSDP2 refuses copy.deepcopy of its modules
    opt.zero_grad()  # the gradients live in the optimizer's buffers until then (grad_guard)
    ema = copy.deepcopy(model)
    assert all(torch.equal(_full(p).detach(), want[n]) for n, p in ema.named_parameters())
    # the copy is the copy's: the next step moves the model's weights, not the copy's
    model(small_batch(2, 0)).backward()
    opt.step()
    opt.wait_params()
    assert all(torch.equal(_full(p).detach(), want[n]) for n, p in ema.named_parameters())
    assert not all(torch.equal(_full(p).detach(), want[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("how,forward_first", [("tp", False), ("fsdp2", False), ("fsdp2", True)])
def test_a_one_rank_dtensor_model_trains_as_torch_optimizers_train_it(one_rank, how, forward_first):
    """FSDP2 on one rank (nothing to shard) and TP 1 take the ZeRO-1 step over the DTensors' local
    values: bit for bit torch.optim.Muon on the matrices and AdamW on the rest, as the README says.
    `forward_first`: a forward (an eval, a sanity check) ran before the optimizer was built, so
    FSDP2's lazy init had pointed its all-gather source at the parameters' old memory; the
    optimizer must make FSDP2 read the buffers it steps (else every forward used the initial weights)."""
    model, kwargs = _sharded(how)
    if forward_first:
        with torch.no_grad():
            model(small_batch(9, 0))
        model.reshard()
    spec = ModelSpec.from_module(Small())
    opt = DistributedOptimizer(model.named_parameters(), spec, "muon", **kwargs)
    plain = Small()
    matrices = {p.name for p in spec.matrix_params()}
    named = list(plain.named_parameters())
    torch_opts = [torch.optim.Muon([p for n, p in named if n in matrices]),
                  torch.optim.AdamW([p for n, p in named if n not in matrices])]
    for k in range(3):
        for o in (opt, *torch_opts):
            o.zero_grad()
        model(small_batch(k, 0)).backward()
        plain(small_batch(k, 0)).backward()
        for o in (opt, *torch_opts):
            o.step()
    opt.wait_params()
    assert all(torch.equal(_full(p).detach(), q) for (_, p), (_, q) in zip(model.named_parameters(), named))


def test_fsdp2_gathering_elsewhere_than_the_buffers_is_an_error_not_a_silent_stale_model(one_rank):
    """Were FSDP2 to gather a parameter from memory other than the optimizer's buffers again (its
    `_sharded_param_data` repointed), the step would update weights no forward reads: the unlinked
    check says so at the next step instead (the step's check, on every rank together: not from
    inside backward, which on one rank would leave its peers waiting in a collective)."""
    model, _ = _sharded("fsdp2")
    model(small_batch(9, 0))  # FSDP2's lazy init (which repoints it once more) is behind
    model.reshard()
    opt = DistributedOptimizer(model.named_parameters(), ModelSpec.from_module(Small()), "muon")
    record = model._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
    record._sharded_param_data = record._sharded_param_data.clone()
    opt.zero_grad()
    model(small_batch(0, 0)).backward()
    before = [_full(p).detach().clone() for p in model.parameters()]
    with pytest.raises(CanzonaError, match="no longer lives in the optimizer's buffers"):
        opt.step()
    assert all(torch.equal(_full(p).detach(), q) for p, q in zip(model.parameters(), before))


def test_fsdp2_parameters_unsharded_at_construction_are_refused(one_rank):
    """The sharded parameters, given while the model holds FSDP2's unsharded ones (a forward and no
    reshard): one error naming the fix, not a model FSDP2 would swap back under the optimizer."""
    model, _ = _sharded("fsdp2")
    params = list(model.named_parameters())
    with torch.no_grad():
        model(small_batch(9, 0))
    with pytest.raises(CanzonaError, match=r"call model.reshard\(\) before building the optimizer"):
        DistributedOptimizer(params, ModelSpec.from_module(Small()), "muon")
    # the model's parameters named now: FSDP2's plain unsharded ones (before: accepted, and the first
    # backward blamed FSDP2's own read of a gradient on a user's hook)
    with pytest.raises(CanzonaError, match=r"'a.weight' is FSDP2's unsharded one just now .*model.reshard\(\)"):
        DistributedOptimizer(model.named_parameters(), ModelSpec.from_module(Small()), "muon")


@pytest.mark.parametrize("clip", [False, True])
def test_fsdp2_on_one_rank_a_gradient_fsdp2_still_holds_is_one_error_before_any_update(one_rank, clip):
    """The ZeRO-1 step over an FSDP2 model on one rank, the last backward left under
    `set_requires_gradient_sync(False)` (after a synced one, or after a clip): FSDP2 keeps that
    gradient out of `.grad`, so the step ran on the first backward's alone and FSDP2 added the held
    one to the next step's, silently. Now the error the FSDP step gives (`param_gather.held_by_fsdp`),
    and nothing is updated. Found by the review of the FSDP step's check."""
    model, kwargs = _sharded("fsdp2")
    opt = DistributedOptimizer(model.named_parameters(), ModelSpec.from_module(Small()), "muon", **kwargs)
    before = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    model(small_batch(0, 0)).backward()
    if clip:
        opt.clip_grad_norm_(1.0)
    model.set_requires_gradient_sync(False)
    model(small_batch(1, 0)).backward()
    model.set_requires_gradient_sync(True)
    with pytest.raises(CanzonaError, match=r"FSDP2 holds a gradient it has not reduced.*"
                                           r"set_requires_gradient_sync\(True\) before step\(\)"):
        opt.step()
    assert all(torch.equal(_full(p).detach(), before[n]) for n, p in model.named_parameters())
