"""What a torch.optim user sets in `param_groups` means what it means to torch.optim.AdamW and
torch.optim.Muon, or is one error before any update; never silently ignored. A world of one gloo
rank in this process (no processes spawned), against torch's optimizers in the same process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from canzona.errors import SpecError
from canzona.runtime import DistributedOptimizer
from reference.data import fixed_batch
from reference.tiny_model import TinyQwen3


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # no port to race for
    try:
        yield
    finally:
        dist.destroy_process_group()


def _pair(optimizer: str = "muon"):
    """(canzona's model and optimizer, torch's model and optimizers), the same weights."""
    mine, theirs = TinyQwen3("tiny", seed=0), TinyQwen3("tiny", seed=0)
    opt = DistributedOptimizer(mine.named_parameters(), mine.spec(), optimizer, overlap_param_gather=False)
    matrices = {p.name for p in mine.spec().matrix_params()} if optimizer == "muon" else set()
    named = list(theirs.named_parameters())
    torch_opts = [torch.optim.AdamW([p for n, p in named if n not in matrices])]
    if matrices:
        torch_opts.insert(0, torch.optim.Muon([p for n, p in named if n in matrices]))
    return (mine, opt), (theirs, torch_opts)


def _step(model, opts, tokens) -> None:
    for o in opts:
        o.zero_grad()
    model.loss(tokens).backward()
    for o in opts:
        o.step()


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize(("flag", "value"), [
    ("maximize", True), ("amsgrad", True), ("decoupled_weight_decay", False), ("differentiable", True),
    ("capturable", True),
])
def test_a_torch_adamw_flag_canzona_does_not_run_is_one_error_before_any_update(one_rank, flag, value):
    (model, opt), _ = _pair()
    tokens = fixed_batch(256, 2, 16, seed=3)
    _step(model, [opt], tokens)
    adamw = next(g for g in opt.param_groups if g["kind"] == "adamw")
    adamw[flag] = value  # a hand edit, as torch.optim.AdamW honours it
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    model.loss(tokens).backward()
    with pytest.raises(SpecError, match=f"{flag}={value!r} is torch.optim.AdamW's flag"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))  # nothing updated


def test_torch_adamw_flags_at_their_defaults_and_kernel_choices_step_as_torch(one_rank):
    (mine, opt), (theirs, torch_opts) = _pair()
    tokens = fixed_batch(256, 2, 16, seed=3)
    for g in opt.param_groups:
        if g["kind"] == "adamw":  # what a group copied from torch's AdamW holds
            g.update(maximize=False, amsgrad=False, decoupled_weight_decay=True, differentiable=False,
                     capturable=False, foreach=None, fused=None)
    for _ in range(2):
        _step(mine, [opt], tokens)
        _step(theirs, torch_opts, tokens)
    assert _same(mine, theirs)


def test_a_momentum_key_on_adamw_groups_without_muon_is_ignored_as_torch_ignores_it(one_rank):
    """Only beside Muon (whose `momentum` the schedulers cycle in every group) is an AdamW group's
    `momentum` its beta1; beside AdamW alone (or SOAP, Shampoo) the schedulers cycle `betas`."""
    (mine, opt), (theirs, torch_opts) = _pair("adamw")
    tokens = fixed_batch(256, 2, 16, seed=3)
    for o in (opt, *torch_opts):
        for g in o.param_groups:
            g["momentum"] = 0.5
    for _ in range(2):
        _step(mine, [opt], tokens)
        _step(theirs, torch_opts, tokens)
    assert _same(mine, theirs)
