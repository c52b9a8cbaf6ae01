"""reference.CombinedOptimizer (routing, one step/zero_grad/state_dict, schedulers) and a
convergence sanity check of every reference optimizer on a least-squares problem."""

from __future__ import annotations

import copy

import pytest
import torch

from canzona.optimizers import AdamWConfig, MuonConfig, ShampooConfig, SOAPConfig
from canzona.spec import ModelSpec, ParamSpec, Role
from reference import SOAP, AdamW, CombinedOptimizer, Muon, Shampoo

SPEC = ModelSpec(
    "toy",
    (
        ParamSpec("embed", (10, 8), Role.EMBEDDING),
        ParamSpec("w1", (12, 8), Role.MATRIX, layer=0),
        ParamSpec("b1", (12,), Role.VECTOR, layer=0),
        ParamSpec("w2", (8, 12), Role.MATRIX, layer=0),
        ParamSpec("head", (3, 8), Role.HEAD),
    ),
)
MATRIX = {"muon": (Muon, MuonConfig), "soap": (SOAP, SOAPConfig), "shampoo": (Shampoo, ShampooConfig)}
LRS = {"muon": 0.02, "soap": 0.01, "shampoo": 0.01}


def make_model(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {p.name: torch.nn.Parameter(0.3 * torch.randn(p.shape, generator=gen)) for p in SPEC.params}


def toy_batch(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 10, (32,), generator=gen), torch.randint(0, 3, (32,), generator=gen)


def toy_loss(m, batch):
    tokens, targets = batch
    x = m["embed"][tokens]
    h = torch.tanh(x @ m["w1"].T + m["b1"]) @ m["w2"].T
    return torch.nn.functional.cross_entropy(h @ m["head"].T, targets)


def train(opt, model, steps, batch=None):
    batch = batch or toy_batch()
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = toy_loss(model, batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_routing_follows_the_spec_rule():
    model = make_model()
    opt = CombinedOptimizer(model.items(), SPEC, "muon")
    assert opt.matrix.param_groups[0]["params"] == [model["w1"], model["w2"]]
    assert opt.adamw.param_groups[0]["params"] == [model["embed"], model["b1"], model["head"]]
    assert opt.param_groups == opt.matrix.param_groups + opt.adamw.param_groups
    assert opt.param_groups[0]["lr"] == MuonConfig().lr and opt.param_groups[1]["lr"] == AdamWConfig().lr


@pytest.mark.parametrize("name", ["muon", "soap", "shampoo"])
def test_step_equals_the_two_reference_optimizers(name):
    cls, cfg_cls = MATRIX[name]
    matrix_cfg = cfg_cls(lr=LRS[name], weight_decay=0.01)
    a, b = make_model(), make_model()
    combined = CombinedOptimizer(a.items(), SPEC, name, matrix_config={"lr": LRS[name], "weight_decay": 0.01},
                                 adamw_config=AdamWConfig(lr=3e-3))
    separate = [cls([b["w1"], b["w2"]], lr=LRS[name], weight_decay=0.01),
                AdamW([b["embed"], b["b1"], b["head"]], lr=3e-3)]
    assert combined.matrix.param_groups[0]["lr"] == matrix_cfg.lr
    batch = toy_batch()
    for _ in range(5):
        for opt in (combined, *separate):
            opt.zero_grad()
        toy_loss(a, batch).backward()
        toy_loss(b, batch).backward()
        combined.step()
        for o in separate:
            o.step()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert set(combined.state) == set(a.values())  # live view of both sub-optimizers' state


def test_scheduler_drives_both_optimizers():
    model = make_model()
    opt = CombinedOptimizer(model.items(), SPEC, "soap", matrix_config=SOAPConfig(lr=0.01), adamw_config={"lr": 0.002})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5**k)
    train(opt, model, 1)
    sched.step()
    train(opt, model, 1)
    sched.step()
    assert opt.matrix.param_groups[0]["lr"] == pytest.approx(0.0025)
    assert opt.adamw.param_groups[0]["lr"] == pytest.approx(0.0005)


@pytest.mark.parametrize("name", ["muon", "soap", "shampoo"])
def test_state_dict_round_trip(name):
    a = make_model()
    opt = CombinedOptimizer(a.items(), SPEC, name, matrix_config={"lr": LRS[name]})
    train(opt, a, 4)
    b = {k: torch.nn.Parameter(v.detach().clone()) for k, v in a.items()}
    other = CombinedOptimizer(b.items(), SPEC, name)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert other.param_groups[0]["lr"] == LRS[name]
    assert other.param_groups[0] is other.matrix.param_groups[0]  # relinked after loading
    train(opt, a, 4)
    train(other, b, 4)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    wrong = CombinedOptimizer(b.items(), SPEC, "soap" if name != "soap" else "muon")
    with pytest.raises(ValueError, match="matrix optimizer"):
        wrong.load_state_dict(opt.state_dict())


def test_zero_grad_and_no_extra_groups():
    model = make_model()
    opt = CombinedOptimizer(model.items(), SPEC, "muon")
    toy_loss(model, toy_batch()).backward()
    opt.zero_grad()
    assert all(p.grad is None for p in model.values())
    with pytest.raises(NotImplementedError):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, 2))]})


def test_only_one_kind_of_parameter():
    model = make_model()
    opt = CombinedOptimizer([("b1", model["b1"])], SPEC, "muon")
    assert opt.matrix is None and len(opt.param_groups) == 1
    opt = CombinedOptimizer([("w1", model["w1"])], SPEC, "shampoo")
    assert opt.adamw is None and len(opt.param_groups) == 1


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ([[("nope", torch.zeros(2, 2))], SPEC], {}, "no parameter named"),
        ([[("w1", torch.zeros(12, 8)), ("w1", torch.zeros(12, 8))], SPEC], {}, "twice"),
        ([[("w1", torch.zeros(8, 12))], SPEC], {}, "shape"),
        ([[], SPEC], {}, "no parameters"),
        ([[("w1", torch.zeros(12, 8))], SPEC, "adam"], {}, "unknown optimizer"),
        ([[("w1", torch.zeros(12, 8))], SPEC, "soap"], {"matrix_config": MuonConfig()}, "SOAPConfig"),
        ([[("w1", torch.zeros(12, 8))], SPEC, "muon"], {"matrix_config": {"betas": (0.9, 0.9)}}, "no hyper-parameter"),
        ([[("w1", torch.zeros(12, 8))], SPEC, "muon"], {"matrix_config": {"lr": -1.0}}, "lr"),
        ([[("b1", torch.zeros(12))], SPEC], {"adamw_config": {"eps": 0.0}}, "eps"),
    ],
)
def test_invalid_arguments(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        CombinedOptimizer(*args, **kwargs)


@pytest.mark.parametrize("name", ["muon", "soap", "shampoo"])
def test_combined_lowers_the_toy_loss(name):
    model = make_model()
    matrix_config = {"lr": LRS[name]} if name == "muon" else {"lr": LRS[name], "precondition_frequency": 5}
    opt = CombinedOptimizer(model.items(), SPEC, name, matrix_config=matrix_config, adamw_config={"lr": 0.01})
    losses = train(opt, model, 60)
    assert losses[-1] < 0.7 * losses[0]


def least_squares():
    gen = torch.Generator().manual_seed(0)
    X, W_true = torch.randn(64, 16, generator=gen), torch.randn(16, 8, generator=gen)
    return X, X @ W_true + 0.01 * torch.randn(64, 8, generator=gen)


@pytest.mark.parametrize(
    ("cls", "hyper"),
    [
        (Muon, {"lr": 0.05, "weight_decay": 0.0}),
        (AdamW, {"lr": 0.05, "weight_decay": 0.0}),
        (SOAP, {"lr": 0.05, "weight_decay": 0.0}),
        (Shampoo, {"lr": 0.05, "precondition_frequency": 5}),
    ],
)
def test_each_optimizer_solves_least_squares(cls, hyper):
    X, Y = least_squares()
    W = torch.nn.Parameter(torch.zeros(16, 8))
    opt = cls([W], **hyper)
    losses = []
    for _ in range(100):
        opt.zero_grad()
        loss = ((X @ W - Y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.05 * losses[0]
    assert losses[50] < losses[0]
