"""The tiny mixture-of-experts model (`reference.tiny_moe`) with its experts split over an
expert-parallel (EP) group, as Megatron's MoE layers run with expert TP 1.

EP rank `j` of a group of `ep` holds experts `[j E / ep, (j + 1) E / ep)` of every layer, stacked
(`mlp.experts.gate_up_proj` `[E / ep, 2 ffn, hidden]`, `mlp.experts.down_proj`): the same names as
the whole model's, local shapes. Everything else is replicated. In each MoE layer every rank routes
its own tokens, sends each (token, expert) pair to the EP rank holding the expert (one
differentiable all-to-all), runs its local experts on what it received, sends the results back
(another) and combines them with the router's weights; backward sends the gradients the same way,
so a local expert's gradient holds the contributions of every token of the EP group routed to it.
Every local expert runs every step, with no rows where no token chose it, so each stack gets a
gradient (of zeros there) as a grouped GEMM gives one.

What it is for: training the runtime under expert parallelism (`canzona.harness.training`), whose
optimizer is checked against the same kernels in one process fed the gradients the ranks recorded.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from reference.tiny_moe import TinyMoe, TinyMoeConfig, _StackedExperts


class _AllToAll(torch.autograd.Function):
    """Rows to the EP ranks (`send[r]` rows to rank r, `recv[r]` from it); backward sends the
    gradients back the same way."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = rows.new_empty(sum(recv), rows.shape[1])
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty(sum(ctx.send), grad.shape[1])
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


class _LocalExperts(_StackedExperts):
    """This EP rank's experts of one layer, and the dispatch to and from the EP group's."""

    def __init__(self, whole: _StackedExperts, group: dist.ProcessGroup) -> None:
        nn.Module.__init__(self)
        self.group = group
        self.ep = dist.get_world_size(group)
        experts = whole.gate_up_proj.shape[0]
        self.per_rank = experts // self.ep
        lo = dist.get_rank(group) * self.per_rank
        self.ffn = whole.ffn
        self.gate_up_proj = nn.Parameter(whole.gate_up_proj.detach()[lo:lo + self.per_rank].clone())
        self.down_proj = nn.Parameter(whole.down_proj.detach()[lo:lo + self.per_rank].clone())

    def forward(self, flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        tokens = torch.arange(flat.shape[0]).repeat_interleave(chosen.shape[1])
        pairs = chosen.reshape(-1)
        order = torch.argsort(pairs // self.per_rank, stable=True)  # grouped by destination rank
        send_counts = torch.bincount(pairs // self.per_rank, minlength=self.ep)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        local_ids = torch.empty(sum(recv), dtype=pairs.dtype)
        dist.all_to_all_single(local_ids, (pairs % self.per_rank)[order], recv, send, group=self.group)
        rows = _AllToAll.apply(flat[tokens[order]], send, recv, self.group)
        out = torch.zeros_like(rows)
        for e in range(self.per_rank):  # every expert runs, with no rows where none came
            at = torch.nonzero(local_ids == e).flatten()
            out = out.index_add(0, at, self.expert(e, rows[at]))
        back = _AllToAll.apply(out, recv, send, self.group)
        return torch.zeros_like(flat).index_add(0, tokens[order], back * weights.reshape(-1)[order].unsqueeze(-1))


class TinyMoeEP(nn.Module):
    """`TinyMoe(cfg, seed=seed)` with each layer's experts split over `group` (see the module
    docstring); `spec()` is the whole model's (global shapes), as the optimizer takes it."""

    def __init__(self, cfg: TinyMoeConfig, group: dist.ProcessGroup, *, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        whole = TinyMoe(cfg, seed=seed, dtype=dtype)
        self.cfg = cfg
        self._spec = whole.spec()
        self.model = whole.model
        self.lm_head = whole.lm_head
        for layer in self.model.layers:
            layer.mlp.experts = _LocalExperts(layer.mlp.experts, group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))

    def spec(self):
        return self._spec

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
