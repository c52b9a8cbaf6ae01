"""The references on the tiny Qwen3-style model: Muon (+ AdamW for the rest) equals torch's
optimizers bit for bit over 20 training steps, and every matrix optimizer lowers the loss."""

from __future__ import annotations

import pytest
import torch

from canzona.optimizers import MuonConfig
from reference import CombinedOptimizer
from reference.data import synthetic_batches
from reference.tiny_model import TinyQwen3


def _batches(model: TinyQwen3, steps: int):
    return synthetic_batches(model.spec().param("model.embed_tokens.weight").shape[0], 4, 32, steps, seed=1)


def test_reference_muon_equals_torch_muon_on_the_tiny_model():
    ours, theirs = TinyQwen3("tiny", seed=0), TinyQwen3("tiny", seed=0)
    spec = ours.spec()
    combined = CombinedOptimizer(ours.named_parameters(), spec, "muon",
                                 {"lr": 0.02, "weight_decay": 0.1}, {"lr": 3e-3, "weight_decay": 0.01})
    matrix = [p for n, p in theirs.named_parameters() if spec.param(n).uses_matrix_optimizer]
    rest = [p for n, p in theirs.named_parameters() if not spec.param(n).uses_matrix_optimizer]
    cfg = MuonConfig()
    torch_muon = torch.optim.Muon(matrix, lr=0.02, weight_decay=0.1, momentum=cfg.momentum,
                                  nesterov=cfg.nesterov, ns_coefficients=cfg.ns_coefficients,
                                  eps=cfg.eps, ns_steps=cfg.ns_steps)
    torch_adamw = torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.01, foreach=False)
    for tokens in _batches(ours, 20):
        for model, opts in ((ours, [combined]), (theirs, [torch_muon, torch_adamw])):
            for opt in opts:
                opt.zero_grad()
            model.loss(tokens).backward()
            for opt in opts:
                opt.step()
        for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("optimizer,lr", [("muon", 0.02), ("soap", 3e-3), ("shampoo", 3e-3)])
def test_each_optimizer_lowers_the_training_loss(optimizer, lr):
    model = TinyQwen3("tiny", seed=0)
    opt = CombinedOptimizer(model.named_parameters(), model.spec(), optimizer, {"lr": lr}, {"lr": 3e-3})
    losses = []
    for tokens in _batches(model, 40):
        opt.zero_grad()
        loss = model.loss(tokens)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, (optimizer, first, last)
