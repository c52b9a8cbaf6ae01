"""A model with 0-d parameters (a ReZero gate, CLIP's logit_scale) and its single-process torch
reference: torch.optim.Muon on the matrices, torch.optim.AdamW (foreach) on the rest, fed the
gradients a `dp`-rank run reduces (each rank's, summed in rank order, divided by dp)."""

from __future__ import annotations

import torch
from torch import nn

WEIGHT_DECAY = 0.1  # AdamW's: decays the scalars too, as torch does


class Scaled(nn.Module):
    """Two linears and two 0-d parameters: a ReZero gate and CLIP's logit_scale."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)
        self.gate, self.logit_scale = nn.Parameter(torch.tensor(0.0)), nn.Parameter(torch.tensor(0.5))
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in (self.a.weight, self.a.bias, self.b.weight, self.b.bias):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the scalars act on b's whole output: under TP (a column-, b row-parallel) every TP rank
        # computes the same gradient of them, as a replicated parameter's must be
        z = self.b(torch.tanh(self.a(x)))
        return (z + self.gate * torch.tanh(z)) * self.logit_scale.exp()


def backward(model: nn.Module, step: int, rank: int = 0, world: int = 1) -> None:
    """Rank `rank`'s share of step `step`'s global batch of 8, through the loss and backward."""
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
    share = slice(rank * 8 // world, (rank + 1) * 8 // world)
    nn.functional.mse_loss(model(x[share]), y[share]).backward()


def canzona_optimizer(model: nn.Module, **kwargs):
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters
    from canzona.spec import ModelSpec

    return DistributedOptimizer(list(named_parameters(model)), ModelSpec.from_module(model), "muon",
                                adamw_config={"weight_decay": WEIGHT_DECAY}, **kwargs)


def torch_optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    named = list(model.named_parameters())
    return [torch.optim.Muon([p for _, p in named if p.ndim == 2]),
            torch.optim.AdamW([p for _, p in named if p.ndim < 2], weight_decay=WEIGHT_DECAY, foreach=True)]


def torch_step(model: nn.Module, opts: list[torch.optim.Optimizer], step: int, dp: int = 1) -> None:
    """One step of torch's optimizers on the gradients a `dp`-rank run reduces."""
    params = list(model.parameters())
    total = None
    for rank in range(dp):
        for p in params:
            p.grad = None
        backward(model, step, rank, dp)
        grads = [p.grad for p in params]
        total = grads if total is None else [t + g for t, g in zip(total, grads)]
    for p, g in zip(params, total):
        p.grad = g / dp
    for o in opts:
        o.step()


def torch_reference(steps: int, dp: int = 1) -> tuple[Scaled, list[torch.optim.Optimizer]]:
    """The model and torch's optimizers after `steps` steps."""
    model = Scaled()
    opts = torch_optimizers(model)
    for step in range(steps):
        torch_step(model, opts, step, dp)
    return model, opts


def adamw_state(opts: list[torch.optim.Optimizer], model: nn.Module, name: str) -> dict:
    """torch's AdamW state of parameter `name`."""
    return opts[1].state[model.get_parameter(name)]


def by_name(full: dict) -> dict[str, dict]:
    """A full optimizer state dict's entries by parameter name (its `param_names`)."""
    return {n: full["state"][i] for g, names in zip(full["param_groups"], full["param_names"])
            for i, n in zip(g["params"], names)}
