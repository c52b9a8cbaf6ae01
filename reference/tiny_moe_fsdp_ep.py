"""The tiny mixture-of-experts model (`reference.tiny_moe_ep`) laid out as torchtitan runs MoE
under FSDP2 with expert parallelism: each layer's expert stacks DTensors `Shard(0)` over the `ep`
axis of a 2-D `(efsdp, ep)` mesh (each EP rank its own experts), `fully_shard` of the experts
modules over `efsdp`, of the layers and the root over every rank (`dp`, the same ranks flattened).

The experts' gradients: the dispatch's all-to-all already sums the contributions of the EP group's
tokens into each local expert, so FSDP2's reduce-scatter over efsdp divides by every data-parallel
rank (torchtitan's `set_gradient_divide_factor(dp)`), not efsdp's size; gloo has no PREMUL_SUM for
that, so here the local stacks' gradients are scaled by 1 / ep before FSDP2's mean over efsdp (a
power of two in the tests: the same numbers). The experts' gradients are then the global mean
loss's, as the dense part's.

`clip_with_ep` is torchtitan's `_clip_grad_norm_with_ep`'s rule: the experts' squared norm summed
over their ep x efsdp ranks, the dense part's over dp, the two combined; here in fp64, as canzona's
step check sums, so that the clipping coefficient is the same fp32 number.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from reference.tiny_moe import TinyMoeConfig
from reference.tiny_moe_ep import TinyMoeEP, _LocalExperts

MESH_DIMS = ("efsdp", "ep")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class _ScaleGrad(torch.autograd.Function):
    """The identity; backward scales the gradient (by 1 / ep: with FSDP2's mean over efsdp, the
    mean over every dp rank, as torchtitan's `set_gradient_divide_factor(dp)` gives; gloo has no
    PREMUL_SUM for that)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


class _DTensorExperts(_LocalExperts):
    """`_LocalExperts` whose stacks are DTensors on the ep mesh: each expert runs on the local
    stack (torchtitan's GroupedExperts reads `.to_local()` alike)."""

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up, down = (_ScaleGrad.apply(_local(w), 1.0 / self.ep) for w in (self.gate_up_proj, self.down_proj))
        gate, up = gate_up[e, :self.ffn], gate_up[e, self.ffn:]
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down[e])


def fsdp_ep_model(cfg: TinyMoeConfig, ep: int, *, seed: int = 0, dtype: torch.dtype = torch.float32):
    """The model over every rank: (model, mesh (efsdp, ep), dp mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=MESH_DIMS)
    dp_mesh = mesh._flatten("dp")
    model = TinyMoeEP(cfg, mesh.get_group("ep"), seed=seed, dtype=dtype)
    for layer in model.model.layers:
        local = layer.mlp.experts
        local.__class__ = _DTensorExperts
        for name in ("gate_up_proj", "down_proj"):
            stack = getattr(local, name).detach()
            setattr(local, name, nn.Parameter(DTensor.from_local(stack, mesh["ep"], [Shard(0)],
                                                                 shape=(cfg.experts, *stack.shape[1:]),
                                                                 stride=_contiguous_stride(cfg.experts,
                                                                                           stack.shape[1:]))))
        fully_shard(local, mesh=mesh["efsdp"])
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model, mesh, dp_mesh


def _contiguous_stride(rows: int, rest: torch.Size) -> tuple[int, ...]:
    return torch.empty(rows, *rest, device="meta").stride()


def is_expert(name: str) -> bool:
    return ".mlp.experts." in name


@torch.no_grad()
def clip_with_ep(model: nn.Module, max_norm: float) -> float:
    """torchtitan's clip under EP on `model`'s gradients (`clip_named_with_ep`)."""
    return clip_named_with_ep(list(model.named_parameters()), max_norm)


@torch.no_grad()
def clip_named_with_ep(named: list[tuple[str, torch.Tensor]], max_norm: float) -> float:
    """torchtitan's clip under EP: sqrt(experts' squared norm over ep x efsdp + the dense part's
    over dp), each rank summing its own pieces (in fp64); the gradients scaled by torch's rule.
    `named`: (name, tensor) pairs whose `.grad` it clips (a model's parameters, or fp32 masters of
    them under their names). Returns the norm before clipping."""
    squares = torch.zeros(2, dtype=torch.float64)
    for name, p in named:
        if p.grad is not None:
            squares[0 if is_expert(name) else 1] += torch.linalg.vector_norm(
                _local(p.grad), dtype=torch.float64).square()
    dist.all_reduce(squares)  # both parts over every rank (each piece held once)
    norm = math.sqrt(float(squares[0]) + float(squares[1]))
    coefficient = min(1.0, max_norm / (norm + 1e-6))
    if coefficient < 1.0:
        torch._foreach_mul_([_local(p.grad) for _, p in named if p.grad is not None], coefficient)
    return norm
