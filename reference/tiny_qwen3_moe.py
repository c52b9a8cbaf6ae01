"""A tiny Qwen3-MoE in pure torch, whole or with its experts split over an expert-parallel group.

`reference.tiny_model`'s decoder (embedding, RMSNorms, grouped-query attention with QK norms and
RoPE, head) with each layer's MLP a mixture of experts: the top-k router and the stacked SwiGLU
experts of `reference.tiny_moe` (`mlp.gate.weight`, `mlp.experts.gate_up_proj` `[experts, 2 ffn,
hidden]`, `mlp.experts.down_proj` `[experts, hidden, ffn]`). So its parameters carry the names
and shapes transformers 5 gives `Qwen3MoeForCausalLM` (every layer sparse), and its spec is the one
the resolver reads from a `qwen3_moe` `config.json` (`canzona.models`): a plan made by
`canzona plan --model config.json --ep N` is this model's plan.

With an EP group (`ep_group`), each layer's experts are split over it as `reference.tiny_moe_ep`
splits them (EP rank `j` holds experts `[j E / ep, (j + 1) E / ep)`; tokens dispatched by
differentiable all-to-alls), from the same initial weights at every EP size: the whole model is
initialised first (`TinyQwen3.init_weights`: every weight of two or more dimensions, a stack
included, drawn from the seed in parameter order), then sliced.

What it is for: `examples/train.py` under expert parallelism, from a plan.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from canzona.decoder import DecoderConfig, build_decoder
from canzona.errors import SpecError
from canzona.spec import ModelSpec
from reference.tiny_model import TinyQwen3, TinyQwen3Config, _torch_dtype, dtype_name
from reference.tiny_moe import TinyMoeConfig, _Moe
from reference.tiny_moe_ep import _LocalExperts


def _configs(decoder: DecoderConfig, attention: dict[str, Any]) -> tuple[TinyQwen3Config, TinyMoeConfig]:
    """The decoder and the experts of a mixture-of-experts architecture this model builds: Qwen3
    attention (QK norms, no biases), every layer sparse, routed experts only, gate and up fused
    (`attention`: more `TinyQwen3Config` fields, such as rope_theta, rms_eps, max_seq_len)."""
    unsupported = ("a dense model" if not decoder.experts else
                   f"a {decoder.family} model" if not decoder.qk_norm else
                   "biases" if decoder.qkv_bias or decoder.o_bias or decoder.mlp_bias else
                   "shared experts" if decoder.shared_ffn else
                   "dense layers" if decoder.dense_layers else
                   "a router on the matrix optimizer" if decoder.router_optimizer != "adamw" else None)
    if unsupported is not None:
        raise SpecError(f"{decoder.name}: this model builds Qwen3-MoE layers (QK norms, no biases, every layer "
                        f"sparse with routed experts only), not {unsupported}")
    cfg = TinyQwen3Config(vocab=decoder.vocab, hidden=decoder.hidden, layers=decoder.layers, q_heads=decoder.q_heads,
                          kv_heads=decoder.kv_heads, head_dim=decoder.head_dim, ffn=decoder.ffn,
                          tied_embeddings=decoder.tied_embeddings, name=decoder.name, **attention)
    moe = TinyMoeConfig(layers=decoder.layers, hidden=decoder.hidden, ffn=decoder.moe_ffn, experts=decoder.experts,
                        experts_per_token=decoder.experts_per_token, vocab=decoder.vocab)
    return cfg, moe


class TinyQwen3Moe(TinyQwen3):
    """The model of a mixture-of-experts `decoder` (see the module docstring; `attention`: more
    `TinyQwen3Config` fields, such as rope_theta, rms_eps, max_seq_len). `spec()` is the
    whole model's as the resolver builds it (global expert counts, the catalog's TP dims), as
    `DistributedOptimizer` takes it under expert parallelism."""

    def __init__(self, decoder: DecoderConfig, *, ep_group: dist.ProcessGroup | None = None, seed: int = 0,
                 dtype: torch.dtype | str = torch.float32, **attention: Any) -> None:
        cfg, moe = _configs(decoder, attention)
        super().__init__(cfg, seed=seed, dtype=dtype)
        tdtype = _torch_dtype(dtype)
        for layer in self.model.layers:
            layer.mlp = _Moe(moe, stacked=True).to(tdtype)
        self.moe = moe
        self.init_weights(seed)
        spec = build_decoder(decoder)  # the resolver's (its dtype: this model's)
        self._spec = ModelSpec(spec.name, tuple(replace(p, dtype=dtype_name(tdtype)) for p in spec.params))
        if ep_group is not None:
            if moe.experts % dist.get_world_size(ep_group):
                raise SpecError(f"{dist.get_world_size(ep_group)} EP ranks do not divide the {moe.experts} experts")
            for layer in self.model.layers:
                layer.mlp.experts = _LocalExperts(layer.mlp.experts, ep_group)

    @staticmethod
    def decoder_config(decoder: DecoderConfig, attention: dict[str, Any]) -> TinyQwen3Config:
        """The attention decoder's configuration this model builds for `decoder` (a SpecError for a
        mixture of experts it does not build)."""
        return _configs(decoder, attention)[0]

    def spec(self) -> ModelSpec:
        return self._spec
