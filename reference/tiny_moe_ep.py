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

With a tensor-parallel group (`tp_group`, Megatron's MoE parallel folding with expert TP 1: the
EP groups fold over the `dp x tp` ranks, `canzona.experts`) the dense layers are split over TP
as Megatron splits them (`reference.tiny_model_tp`: q, k, v and the vocabulary-parallel head
column-parallel, o row-parallel, the embedding vocabulary-parallel, the per-head q / k norms'
gradients summed over TP; the router and the other norms replicated, on replicated inputs), and
the experts stay whole. The TP ranks of a DP rank hold the same tokens; each dispatches its own
share of them (`tp` contiguous blocks of the layer's token rows, as Megatron's sequence-parallel
MoE layer holds them), so every token reaches its experts exactly once. The shares' outputs are
all-gathered over TP (backward: each rank keeps its share's gradient, as every TP rank computes
the same loss from the gathered rows), and the shares are cut from the replicated inputs and
routing weights (backward: the shares' gradients all-gathered, so the router's and the norms'
gradients are whole and equal on every TP rank). A local expert's gradient then holds the
contributions of every token its EP group dispatched to it, each under its DP rank's loss, as at
TP 1 (the expert gradients' scale: `canzona.runtime.expert_part`).

What it is for: training the runtime under expert parallelism (`canzona.harness.training`), whose
optimizer is checked against the same kernels in one process fed the gradients the ranks recorded.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from canzona.errors import SpecError
from reference.tiny_moe import TinyMoe, TinyMoeConfig, _StackedExperts, hidden_states


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


def _share(rows: int, tp: int, rank: int) -> tuple[int, int]:
    """TP rank `rank`'s block of `rows` token rows (`torch.tensor_split`'s: the first `rows % tp`
    blocks one row longer)."""
    base, extra = divmod(rows, tp)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def _gather_shares(x: torch.Tensor, rows: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Every TP rank's share of `rows` rows (`_share`), concatenated in rank order (padded to the
    longest share for the all-gather)."""
    from reference.tiny_model_tp import _all_gather

    tp = dist.get_world_size(group)
    longest = _share(rows, tp, 0)[1]
    padded = torch.cat([x, x.new_zeros(longest - x.shape[0], *x.shape[1:])]) if x.shape[0] < longest else x
    every = _all_gather(padded, group)
    return torch.cat([every[t][:hi - lo] for t, (lo, hi) in enumerate(_share(rows, tp, t) for t in range(tp))])


class _ShareOfTP(torch.autograd.Function):
    """This TP rank's share of replicated rows; backward all-gathers the shares' gradients (each
    rank's downstream used its share only)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.rows = group, x.shape[0]
        lo, hi = _share(x.shape[0], dist.get_world_size(group), dist.get_rank(group))
        return x[lo:hi]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_shares(grad, ctx.rows, ctx.group), None


class _GatherSharesOfTP(torch.autograd.Function):
    """Every TP rank's share, all-gathered into the replicated rows; backward keeps this rank's
    share of the gradient (every TP rank computes the same loss from the gathered rows)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.share = _share(rows, dist.get_world_size(group), dist.get_rank(group))
        return _gather_shares(x, rows, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        lo, hi = ctx.share
        return grad[lo:hi].contiguous(), None, None


class _LocalExperts(_StackedExperts):
    """This EP rank's experts of one layer, and the dispatch to and from the EP group's (under TP,
    of this TP rank's share of the tokens)."""

    def __init__(self, whole: _StackedExperts, group: dist.ProcessGroup,
                 tp_group: dist.ProcessGroup | None = None) -> None:
        nn.Module.__init__(self)
        self.group = group
        self.tp_group = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
        self.ep = dist.get_world_size(group)
        experts = whole.gate_up_proj.shape[0]
        self.per_rank = experts // self.ep
        lo = dist.get_rank(group) * self.per_rank
        self.ffn = whole.ffn
        self.gate_up_proj = nn.Parameter(whole.gate_up_proj.detach()[lo:lo + self.per_rank].clone())
        self.down_proj = nn.Parameter(whole.down_proj.detach()[lo:lo + self.per_rank].clone())

    def forward(self, flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None:
            return self._dispatch(flat, chosen, weights)
        rows, tp = flat.shape[0], self.tp_group
        lo, hi = _share(rows, dist.get_world_size(tp), dist.get_rank(tp))
        out = self._dispatch(_ShareOfTP.apply(flat, tp), chosen[lo:hi], _ShareOfTP.apply(weights, tp))
        return _GatherSharesOfTP.apply(out, rows, tp)

    def _dispatch(self, flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
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
    """`TinyMoe(cfg, seed=seed)` with each layer's experts split over `group`, and with `tp_group`
    its dense layers over TP (see the module docstring); `spec()` is the whole model's (global
    shapes, `TinyMoe.spec`'s TP split), as the optimizer takes it."""

    def __init__(self, cfg: TinyMoeConfig, group: dist.ProcessGroup, *, seed: int = 0,
                 dtype: torch.dtype = torch.float32, tp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        if tp > 1 and (cfg.vocab % tp or cfg.heads % tp):
            raise SpecError(f"tp={tp} must divide the tiny MoE's vocabulary ({cfg.vocab}) and heads ({cfg.heads})")
        whole = TinyMoe(cfg, seed=seed, dtype=dtype)
        self.cfg = cfg
        self._spec = whole.spec()
        self.model = whole.model
        self.lm_head = whole.lm_head
        self.tp_group = tp_group if tp > 1 else None
        for layer in self.model.layers:
            layer.mlp.experts = _LocalExperts(layer.mlp.experts, group, self.tp_group)
        if self.tp_group is not None:
            self._split_dense(self.tp_group)

    def _split_dense(self, tp: dist.ProcessGroup) -> None:
        """The dense layers over TP, Megatron style (`reference.tiny_model_tp`'s layers), as
        `reference.tiny_moe.TP_DIMS` says."""
        from reference.tiny_model_tp import (
            ColumnParallelLinear,
            HeadRMSNorm,
            RowParallelLinear,
            VocabParallelEmbedding,
        )

        for layer in self.model.layers:
            attn = getattr(layer, "self_attn", None)
            if attn is not None:
                for name in ("q_proj", "k_proj", "v_proj"):
                    setattr(attn, name, ColumnParallelLinear(getattr(attn, name), tp))
                attn.o_proj = RowParallelLinear(attn.o_proj, tp)
                attn.q_norm, attn.k_norm = HeadRMSNorm(attn.q_norm, tp), HeadRMSNorm(attn.k_norm, tp)
        self.model.embed_tokens = VocabParallelEmbedding(self.model.embed_tokens, tp)
        self.lm_head = ColumnParallelLinear(self.lm_head, tp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states(self, ids))
        if self.tp_group is None:
            return logits
        from reference.tiny_model_tp import _GatherLastDim

        return _GatherLastDim.apply(logits, self.tp_group)  # the vocabulary-parallel head's logits, whole

    def spec(self):
        return self._spec

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
