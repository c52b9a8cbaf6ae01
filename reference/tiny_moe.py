"""A tiny mixture-of-experts model in pure torch, its experts either stacked or one linear each.

What it is for: checking that a stacked expert tensor is that many matrices (docs/design.md §2.6),
by training the same model stored both ways. Per layer: an RMSNorm, a top-k router
(`mlp.gate.weight`, softmax over the experts, the k largest renormalised, as Qwen3-MoE with
`norm_topk_prob`), SwiGLU experts, a residual add; then a final RMSNorm and the head. Attention is
optional (`heads`, 0 by default: the dense layers are the catalog's, `reference.tiny_model`, and
this model is about the experts): with `heads` > 0 each layer starts as Qwen3-MoE's does, an
RMSNorm and the catalog's attention block (`reference.tiny_model.Attention`: q, k, v, per-head q and
k norms, RoPE, o; as many KV heads as query heads) added to the residual, which gives the model
dense matrices for the matrix optimizer beside its experts (the `tiny-moe-attn` preset).

- `stacked=True` stores the experts as transformers 5 does: `mlp.experts.gate_up_proj`
  `[experts, 2 ffn, hidden]` (gate rows, then up) and `mlp.experts.down_proj` `[experts, hidden, ffn]`;
- `stacked=False` gives every expert its own `nn.Linear`s: `mlp.experts.<e>.gate_proj` /
  `up_proj` / `down_proj`.

Both compute the same function with the same kernels (a stacked expert's gate and up are its two
row blocks, each applied by `F.linear` as its linear would be), so their gradients are equal bit
for bit, and a matrix optimizer that treats each expert matrix as a matrix trains them identically.
Initialisation draws in float64 from a seeded generator, stacked order, so both are the same model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class TinyMoeConfig:
    layers: int = 2
    hidden: int = 16
    ffn: int = 8  # each expert's width
    experts: int = 4
    experts_per_token: int = 2
    vocab: int = 32
    eps: float = 1e-6
    heads: int = 0  # attention heads (0: no attention)
    head_dim: int = 8
    rope_theta: float = 10000.0

    def attention_config(self):
        """The catalog's attention block at these sizes (`reference.tiny_model.TinyQwen3Config`)."""
        from reference.tiny_model import TinyQwen3Config

        return TinyQwen3Config(vocab=self.vocab, hidden=self.hidden, layers=self.layers, q_heads=self.heads,
                               kv_heads=self.heads, head_dim=self.head_dim, rope_theta=self.rope_theta,
                               rms_eps=self.eps, name="tiny-moe")


class _Norm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _Expert(nn.Module):
    def __init__(self, cfg: TinyMoeConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.down_proj = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _StackedExperts(nn.Module):
    def __init__(self, cfg: TinyMoeConfig) -> None:
        super().__init__()
        self.ffn = cfg.ffn
        self.gate_up_proj = nn.Parameter(torch.zeros(cfg.experts, 2 * cfg.ffn, cfg.hidden))
        self.down_proj = nn.Parameter(torch.zeros(cfg.experts, cfg.hidden, cfg.ffn))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj[e, :self.ffn], self.gate_up_proj[e, self.ffn:]
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), self.down_proj[e])

    def forward(self, flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # the experts run inside this module's forward, as transformers' fused experts modules
        # do: what reads the stacks is a forward of the module holding them (an optimizer that
        # gathers parameters under the next forward waits in that module's forward pre-hook)
        return _dispatch(flat, chosen, weights, self.gate_up_proj.shape[0], self.expert)


def _dispatch(flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, experts: int,
              expert) -> torch.Tensor:
    """Each token's output: the weighted sum of its chosen experts' outputs, expert by expert."""
    out = torch.zeros_like(flat)
    for e in range(experts):
        rows, slot = torch.nonzero(chosen == e, as_tuple=True)
        if rows.numel() == 0:
            continue
        y = expert(e, flat[rows])
        out = out.index_add(0, rows, y * weights[rows, slot].unsqueeze(-1))
    return out


class _Moe(nn.Module):
    def __init__(self, cfg: TinyMoeConfig, stacked: bool) -> None:
        super().__init__()
        self.top_k = cfg.experts_per_token
        self.gate = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = _StackedExperts(cfg) if stacked else nn.ModuleList(_Expert(cfg) for _ in range(cfg.experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.gate(flat).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(flat.dtype)
        if isinstance(self.experts, _StackedExperts):
            out = self.experts(flat, chosen, weights)
        else:
            out = _dispatch(flat, chosen, weights, self.gate.out_features, lambda e, h: self.experts[e](h))
        return out.reshape(x.shape)


class _Layer(nn.Module):
    def __init__(self, cfg: TinyMoeConfig, stacked: bool) -> None:
        super().__init__()
        if cfg.heads:  # registration order is forward order, as in Qwen3-MoE
            from reference.tiny_model import Attention

            self.input_layernorm = _Norm(cfg.hidden, cfg.eps)
            self.self_attn = Attention(cfg.attention_config(), torch.float32)
        self.post_attention_layernorm = _Norm(cfg.hidden, cfg.eps)
        self.mlp = _Moe(cfg, stacked)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if rope is not None:
            x = x + self.self_attn(self.input_layernorm(x), *rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Backbone(nn.Module):
    def __init__(self, cfg: TinyMoeConfig, stacked: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(_Layer(cfg, stacked) for _ in range(cfg.layers))
        self.norm = _Norm(cfg.hidden, cfg.eps)


# the dense parameters TP splits (by module name) and along which dimension, as Megatron splits
# them (docs/design.md §2.3): q, k, v column-parallel, o row-parallel, the embedding and the head
# vocabulary-parallel; the rest of the dense part (router, norms) replicated; the experts whole
# (`reference.tiny_moe_ep` runs the split)
TP_DIMS = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "embed_tokens": 0, "lm_head": 0}


class TinyMoe(nn.Module):
    """The model (see the module docstring); `forward(ids)` gives logits."""

    def __init__(self, cfg: TinyMoeConfig | None = None, *, stacked: bool = True, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg = cfg = cfg or TinyMoeConfig()
        self.model = _Backbone(cfg, stacked)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self._initialise(seed)
        self.to(dtype)

    @torch.no_grad()
    def _initialise(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        cfg = self.cfg

        def draw(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).float()

        self.model.embed_tokens.weight.copy_(draw(cfg.vocab, cfg.hidden, scale=1.0))
        for layer in self.model.layers:
            if cfg.heads:
                attn = layer.self_attn
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                    proj.weight.copy_(draw(*proj.weight.shape, scale=proj.weight.shape[1] ** -0.5))
                for norm in (attn.q_norm, attn.k_norm):
                    norm.weight.fill_(1.0)
            layer.mlp.gate.weight.copy_(draw(cfg.experts, cfg.hidden, scale=cfg.hidden ** -0.5))
            gate_up = draw(cfg.experts, 2 * cfg.ffn, cfg.hidden, scale=cfg.hidden ** -0.5)
            down = draw(cfg.experts, cfg.hidden, cfg.ffn, scale=cfg.ffn ** -0.5)
            experts = layer.mlp.experts
            if isinstance(experts, _StackedExperts):
                experts.gate_up_proj.copy_(gate_up)
                experts.down_proj.copy_(down)
            else:
                for e, expert in enumerate(experts):
                    expert.gate_proj.weight.copy_(gate_up[e, :cfg.ffn])
                    expert.up_proj.weight.copy_(gate_up[e, cfg.ffn:])
                    expert.down_proj.weight.copy_(down[e])
        self.lm_head.weight.copy_(draw(cfg.vocab, cfg.hidden, scale=cfg.hidden ** -0.5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states(self, ids))

    def spec(self, name: str = "tiny-moe"):
        """The model's spec as `ModelSpec.from_module` reads it (experts stacked, split FC1), with
        the TP split of its dense parameters (`TP_DIMS`) as the catalog marks a dense model's,
        whatever the TP size it runs at (so that a checkpoint taken at one loads at another)."""
        from dataclasses import replace

        from canzona.spec import ModelSpec, Role

        spec = ModelSpec.from_module(self, name=name)
        return ModelSpec(spec.name, tuple(p if p.role is Role.EXPERT else replace(p, tp_dim=TP_DIMS.get(p.name.split(".")[-2]))
                                          for p in spec.params))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over `tokens[:, 1:]`, in fp32 at least (as `TinyQwen3.loss`)."""
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def hidden_states(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The final-normed hidden states of a tiny MoE model (`TinyMoe` or its parallel versions,
    which hold the same modules under the same names)."""
    cfg = model.cfg
    rope = None
    if cfg.heads:
        from reference.tiny_model import rope_cos_sin

        positions = torch.arange(ids.shape[1], device=ids.device)
        rope = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, model.lm_head.weight.dtype)
    x = model.model.embed_tokens(ids)
    for layer in model.model.layers:
        x = layer(x, rope)
    return model.model.norm(x)


def tiny_hf_qwen3_moe(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """transformers' `Qwen3MoeForCausalLM` at a tiny size (its experts fused and stacked, as
    transformers 5 stores them), seeded, with the harness's `spec()` and `loss(tokens)`."""
    import transformers

    from canzona.spec import ModelSpec

    config = transformers.Qwen3MoeConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        vocab_size=64, intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    with torch.random.fork_rng():  # transformers initialises from the global generator
        torch.manual_seed(seed)
        model = transformers.Qwen3MoeForCausalLM(config).to(dtype)
    model.spec = lambda name="hf-qwen3-moe": ModelSpec.from_module(model, name=name)
    model.loss = lambda tokens: model(tokens, labels=tokens).loss.float()
    return model


# What the training harness builds by name (`canzona.harness.training.build_model`), beside the
# dense presets of `reference.tiny_model`: sizes that make a CPU step take milliseconds, a stack
# of 2 x 4 gate / up matrices and one of 4 down matrices per layer; `tiny-moe-attn` adds attention
# (4 heads: dense q, k, v and o matrices, split by TP 2 or 4 as Megatron splits them).
MOE_PRESETS: dict[str, TinyMoeConfig] = {
    "tiny-moe": TinyMoeConfig(layers=2, hidden=32, ffn=16, experts=4, experts_per_token=2, vocab=64),
    "tiny-moe-attn": TinyMoeConfig(layers=2, hidden=32, ffn=16, experts=4, experts_per_token=2, vocab=64, heads=4),
}
HF_MOE_PRESET = "hf-qwen3-moe"  # `tiny_hf_qwen3_moe`


def expert_matrices(model: TinyMoe) -> dict[tuple[int, int, str], torch.Tensor]:
    """Every expert matrix by (layer, expert, 'gate' | 'up' | 'down'), whichever way it is stored:
    for comparing a stacked model with a linear one."""
    out = {}
    f = model.cfg.ffn
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        for e in range(model.cfg.experts):
            if isinstance(experts, _StackedExperts):
                parts = (experts.gate_up_proj[e, :f], experts.gate_up_proj[e, f:], experts.down_proj[e])
            else:
                parts = (experts[e].gate_proj.weight, experts[e].up_proj.weight, experts[e].down_proj.weight)
            out.update({(i, e, kind): t.detach() for kind, t in zip(("gate", "up", "down"), parts)})
    return out
