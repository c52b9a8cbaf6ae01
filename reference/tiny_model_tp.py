"""The tiny Qwen3-style decoder under tensor parallelism, two ways users build it.

`TinyQwen3TP`: Megatron style, the single-device model with its layers swapped for parallel ones
that hold this rank's shard as plain tensors (its forward code is the single-device model's):
- column-parallel linears (q, k, v, gate, up; and the vocab-parallel output head) hold rows
  `[r * out / tp, (r + 1) * out / tp)` of the weight; their input is copied to every TP rank
  (backward: the input gradients are summed over TP);
- row-parallel linears (o, down) hold the matching columns and sum their outputs over TP;
- the vocab-parallel embedding holds a slice of the vocabulary and sums the looked-up rows over TP;
- the head's logits are gathered over TP before the loss;
- per-head QK norms act on this rank's heads only, so their weights' gradients are summed over TP
  (as Megatron does for such weights), and every other replicated weight sees replicated inputs.
Sharded weights carry Megatron's annotations (`tensor_model_parallel`, `partition_dim`).

`parallelize_tiny`: the same model as DTensors, `parallelize_module` with torch's parallel styles
(what torchtitan does): colwise / rowwise linears, a rowwise (vocab-parallel) embedding and a
colwise head with replicated output, and `SequenceParallel` over the head dimension for the QK norms,
whose gradients DTensor then reduces.

Both start from the weights of `TinyQwen3(cfg, seed)` and compute its forward pass and gradients up
to the rounding of the sums over TP. Every sum over TP here is an all-gather followed by a sum in
rank order, so all TP ranks get the same bits and a run is reproducible.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from reference.tiny_model import RMSNorm, TinyQwen3, TinyQwen3Config, check_tp, get_preset

__all__ = ["TinyQwen3TP", "parallelize_tiny", "tp_all_reduce"]


# --- collectives with their gradients -----------------------------------------------------------


def tp_all_reduce(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The sum of `x` over the group, added in rank order (the same bits on every rank)."""
    size = dist.get_world_size(group)
    if size == 1:
        return x
    every = _all_gather(x, group)
    out = every[0].clone()
    for r in range(1, size):
        out += every[r]
    return out


def _all_gather(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Every rank's `x`, stacked in rank order (flat buffers: gloo's all-gather wants them so)."""
    size = dist.get_world_size(group)
    every = torch.empty(size * x.numel(), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(every, x.contiguous().reshape(-1), group=group)
    return every.view(size, *x.shape)


class _CopyToTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over TP (the input is used by every rank)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return tp_all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Sum over TP forward (partial results); identity backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        return tp_all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    """Concatenate every rank's tensor along the last dimension; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        rank = dist.get_rank(group)
        ctx.slice = (rank * x.shape[-1], (rank + 1) * x.shape[-1])
        return torch.cat(list(_all_gather(x, group).unbind(0)), dim=-1)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        a, b = ctx.slice
        return grad[..., a:b].contiguous(), None


# --- layers -------------------------------------------------------------------------------------


def _annotate(p: nn.Parameter, dim: int) -> nn.Parameter:
    """Megatron's marks of a TP-sharded parameter (`set_tensor_model_parallel_attributes`)."""
    p.tensor_model_parallel = True
    p.partition_dim = dim
    p.partition_stride = 1
    return p


def _shard(full: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return full.detach().chunk(size, dim=dim)[rank].clone()


class ColumnParallelLinear(nn.Module):
    """`y_r = x W_r^T` with W_r this rank's rows of W (`out / tp` outputs)."""

    def __init__(self, full: nn.Linear, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group
        self.weight = _annotate(nn.Parameter(_shard(full.weight, 0, group)), 0)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(_CopyToTP.apply(x, self.group), self.weight)


class RowParallelLinear(nn.Module):
    """`y = sum_r x_r W_r^T` with W_r this rank's columns of W and x_r this rank's inputs."""

    def __init__(self, full: nn.Linear, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group
        self.weight = _annotate(nn.Parameter(_shard(full.weight, 1, group)), 1)

    def forward(self, x: Tensor) -> Tensor:
        return _ReduceFromTP.apply(F.linear(x, self.weight), self.group)


class VocabParallelEmbedding(nn.Module):
    """This rank's slice of the vocabulary; tokens outside it look up zeros, summed over TP."""

    def __init__(self, full: nn.Embedding, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group
        self.weight = _annotate(nn.Parameter(_shard(full.weight, 0, group)), 0)
        rows = self.weight.shape[0]
        self.first = dist.get_rank(group) * rows
        self.rows = rows

    def forward(self, tokens: Tensor) -> Tensor:
        local = tokens - self.first
        outside = (local < 0) | (local >= self.rows)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return _ReduceFromTP.apply(rows.masked_fill(outside[..., None], 0.0), self.group)


class HeadRMSNorm(RMSNorm):
    """A per-head norm applied to this rank's heads: its weight's gradient is summed over TP."""

    def __init__(self, full: RMSNorm, group: dist.ProcessGroup) -> None:
        super().__init__(full.weight.shape[0], full.eps, full.weight.dtype, full.weight.device)
        self.group = group
        with torch.no_grad():
            self.weight.copy_(full.weight)

    def forward(self, x: Tensor) -> Tensor:
        return _CopyToTP.apply(self.weight, self.group) * self.normalized(x)


class TinyQwen3TP(TinyQwen3):
    """`TinyQwen3(cfg, seed)` split over the TP group `group` (Megatron style, see the module
    docstring): the single-device model with its linears, embedding, head and QK norms swapped for
    their parallel versions, so its forward code, parameter names and spec are the single-device
    model's; each rank holds its shards."""

    def __init__(self, cfg: TinyQwen3Config | str = "tiny", group: dist.ProcessGroup | None = None,
                 seed: int = 0, dtype: torch.dtype | str = torch.float32) -> None:
        cfg = get_preset(cfg) if isinstance(cfg, str) else cfg
        group = group or dist.group.WORLD
        check_tp(cfg, dist.get_world_size(group))
        super().__init__(cfg, seed=seed, dtype=dtype)  # the full weights, then cut to this rank's shards
        self.group = group
        self.tp = dist.get_world_size(group)
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for name in ("q_proj", "k_proj", "v_proj"):
                setattr(attn, name, ColumnParallelLinear(getattr(attn, name), group))
            attn.o_proj = RowParallelLinear(attn.o_proj, group)
            attn.q_norm = HeadRMSNorm(attn.q_norm, group)
            attn.k_norm = HeadRMSNorm(attn.k_norm, group)
            mlp.gate_proj = ColumnParallelLinear(mlp.gate_proj, group)
            mlp.up_proj = ColumnParallelLinear(mlp.up_proj, group)
            mlp.down_proj = RowParallelLinear(mlp.down_proj, group)
        self.model.embed_tokens = VocabParallelEmbedding(self.model.embed_tokens, group)
        self.lm_head = ColumnParallelLinear(self.lm_head, group)
        if cfg.tied_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, tokens: Tensor) -> Tensor:
        """Full logits `B x T x vocab` on every TP rank (the head's are gathered over TP)."""
        return _GatherLastDim.apply(self.lm_head(self.hidden_states(tokens)), self.group)


def parallelize_tiny(model: TinyQwen3, tp_mesh) -> TinyQwen3:
    """Turn `model`'s weights into DTensors over the 1-D mesh `tp_mesh` (in place; returns it).
    A tied embedding stays replicated: one Parameter cannot be both rowwise and colwise."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    check_tp(model.cfg, tp_mesh.size())
    plan: dict = {}
    if not model.cfg.tied_embeddings:
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    for i in range(len(model.model.layers)):
        pre = f"model.layers.{i}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{pre}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{pre}.{name}"] = RowwiseParallel()
        for name in ("self_attn.q_norm", "self_attn.k_norm"):  # over the heads: dim 2 of B x T x H x D
            plan[f"{pre}.{name}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return parallelize_module(model, tp_mesh, plan)
