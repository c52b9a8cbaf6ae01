"""The Qwen3 model catalog (docs/design.md §2.4), the single source of these configurations.

Each model is a `canzona.decoder.DecoderConfig` of the Qwen3 family (per-head q/k RMSNorm, no
biases); `Qwen3Config` makes a dense one with the family's shared sizes as defaults,
`Qwen3MoeConfig` a mixture-of-experts one (128 experts, 8 per token, 4 KV heads: the published
Qwen3-30B-A3B and Qwen3-235B-A22B `config.json`s).
"""

from __future__ import annotations

from canzona.decoder import DecoderConfig, build_decoder
from canzona.errors import SpecError
from canzona.spec import ModelSpec

HEAD_DIM = 128
KV_HEADS = 8
VOCAB = 151936


def Qwen3Config(name: str, layers: int, hidden: int, q_heads: int, ffn: int, tied_embeddings: bool,
                official_params: float = 0.0, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM,
                vocab: int = VOCAB) -> DecoderConfig:
    """A Qwen3 dense model: the family's head dimension, KV heads and vocabulary unless given."""
    return DecoderConfig(name, layers, hidden, q_heads, kv_heads, head_dim, ffn, vocab, tied_embeddings,
                         family="qwen3", qk_norm=True, official_params=official_params)


QWEN3_DENSE: dict[str, DecoderConfig] = {
    c.name: c
    for c in (
        Qwen3Config("qwen3-0.6b", 28, 1024, 16, 3072, True, 0.6e9),
        Qwen3Config("qwen3-1.7b", 28, 2048, 16, 6144, True, 1.7e9),
        Qwen3Config("qwen3-4b", 36, 2560, 32, 9728, True, 4.0e9),
        Qwen3Config("qwen3-8b", 36, 4096, 32, 12288, False, 8.2e9),
        Qwen3Config("qwen3-14b", 40, 5120, 40, 17408, False, 14.8e9),
        Qwen3Config("qwen3-32b", 64, 5120, 64, 25600, False, 32.8e9),
    )
}



def Qwen3MoeConfig(name: str, layers: int, hidden: int, q_heads: int, moe_ffn: int, official_params: float,
                   official_active_params: float, experts: int = 128, experts_per_token: int = 8,
                   kv_heads: int = 4) -> DecoderConfig:
    """A Qwen3 mixture-of-experts model: every layer sparse (no mlp_only_layers), untied embeddings;
    `ffn` (the dense MLP width no layer uses) is experts_per_token x moe_ffn, as published."""
    return DecoderConfig(name, layers, hidden, q_heads, kv_heads, HEAD_DIM, experts_per_token * moe_ffn, VOCAB,
                         False, family="qwen3_moe", qk_norm=True, official_params=official_params,
                         experts=experts, experts_per_token=experts_per_token, moe_ffn=moe_ffn,
                         official_active_params=official_active_params)


QWEN3_MOE: dict[str, DecoderConfig] = {
    c.name: c
    for c in (
        Qwen3MoeConfig("qwen3-30b-a3b", 48, 2048, 32, 768, 30.5e9, 3.3e9),
        Qwen3MoeConfig("qwen3-235b-a22b", 94, 4096, 64, 1536, 235e9, 22e9),
    )
}

CATALOG: dict[str, DecoderConfig] = {**QWEN3_DENSE, **QWEN3_MOE}

DEFAULT_MODEL = "qwen3-32b"


def model_names() -> list[str]:
    return list(CATALOG)


def get_config(name: str) -> DecoderConfig:
    try:
        return CATALOG[name.lower()]
    except KeyError:
        raise SpecError(f"unknown model {name!r}; known models: {', '.join(CATALOG)}") from None


def build_qwen3(cfg: DecoderConfig) -> ModelSpec:
    """Parameters in forward order, Hugging Face names, Megatron TP dims (`build_decoder`)."""
    return build_decoder(cfg)


def get_model(name: str, tp: int = 1) -> ModelSpec:
    """The catalog model `name`, after checking that `tp` splits it evenly."""
    cfg = get_config(name)
    cfg.check_tp(tp)
    return build_decoder(cfg)
