"""The Qwen3 dense model catalog (docs/design.md §2.4), the single source of these configurations."""

from __future__ import annotations

from dataclasses import dataclass

from canzona.errors import SpecError
from canzona.spec import ModelSpec, ParamSpec, Role

HEAD_DIM = 128
KV_HEADS = 8
VOCAB = 151936


@dataclass(frozen=True)
class Qwen3Config:
    name: str
    layers: int
    hidden: int
    q_heads: int
    ffn: int
    tied_embeddings: bool
    official_params: float  # as published, for the parameter-count check
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM
    vocab: int = VOCAB

    def check_tp(self, tp: int) -> None:
        """TP must split attention heads, KV heads, the MLP and the vocabulary evenly."""
        if tp < 1:
            raise SpecError(f"tp must be >= 1, got {tp}")
        for what, size in (
            ("attention heads", self.q_heads),
            ("KV heads", self.kv_heads),
            ("ffn width", self.ffn),
            ("vocabulary", self.vocab),
        ):
            if size % tp:
                raise SpecError(f"tp={tp} does not divide the {size} {what} of {self.name}")


QWEN3_DENSE: dict[str, Qwen3Config] = {
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

DEFAULT_MODEL = "qwen3-32b"


def model_names() -> list[str]:
    return list(QWEN3_DENSE)


def get_config(name: str) -> Qwen3Config:
    try:
        return QWEN3_DENSE[name.lower()]
    except KeyError:
        raise SpecError(f"unknown model {name!r}; known models: {', '.join(QWEN3_DENSE)}") from None


def build_qwen3(cfg: Qwen3Config) -> ModelSpec:
    """Parameters in forward order, Hugging Face names, Megatron TP dims."""
    h, q_out, kv_out = cfg.hidden, cfg.q_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    params: list[ParamSpec] = [
        ParamSpec("model.embed_tokens.weight", (cfg.vocab, h), Role.EMBEDDING, None, tp_dim=0)
    ]
    for i in range(cfg.layers):
        pre = f"model.layers.{i}"
        params += [
            ParamSpec(f"{pre}.input_layernorm.weight", (h,), Role.VECTOR, i),
            ParamSpec(f"{pre}.self_attn.q_proj.weight", (q_out, h), Role.MATRIX, i, tp_dim=0),
            ParamSpec(f"{pre}.self_attn.k_proj.weight", (kv_out, h), Role.MATRIX, i, tp_dim=0),
            ParamSpec(f"{pre}.self_attn.v_proj.weight", (kv_out, h), Role.MATRIX, i, tp_dim=0),
            ParamSpec(f"{pre}.self_attn.q_norm.weight", (cfg.head_dim,), Role.VECTOR, i),
            ParamSpec(f"{pre}.self_attn.k_norm.weight", (cfg.head_dim,), Role.VECTOR, i),
            ParamSpec(f"{pre}.self_attn.o_proj.weight", (h, q_out), Role.MATRIX, i, tp_dim=1),
            ParamSpec(f"{pre}.post_attention_layernorm.weight", (h,), Role.VECTOR, i),
            ParamSpec(f"{pre}.mlp.gate_proj.weight", (cfg.ffn, h), Role.MATRIX, i, tp_dim=0),
            ParamSpec(f"{pre}.mlp.up_proj.weight", (cfg.ffn, h), Role.MATRIX, i, tp_dim=0),
            ParamSpec(f"{pre}.mlp.down_proj.weight", (h, cfg.ffn), Role.MATRIX, i, tp_dim=1),
        ]
    params.append(ParamSpec("model.norm.weight", (h,), Role.VECTOR, None))
    if not cfg.tied_embeddings:
        params.append(ParamSpec("lm_head.weight", (cfg.vocab, h), Role.HEAD, None, tp_dim=0))
    return ModelSpec(cfg.name, tuple(params))


def get_model(name: str, tp: int = 1) -> ModelSpec:
    """The catalog model `name`, after checking that `tp` splits it evenly."""
    cfg = get_config(name)
    cfg.check_tp(tp)
    return build_qwen3(cfg)
