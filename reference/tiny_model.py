"""A tiny Qwen3-style dense decoder in pure torch: the model every numerical test trains.

Architecture (as Qwen3, docs/design.md §2.4): token embedding; per layer an input RMSNorm, attention
with separate q / k / v / o projections (no biases), per-head RMSNorm on q and k over `head_dim`,
rotary embeddings (Hugging Face `rotate_half` convention), grouped-query attention with a causal
mask, a post-attention RMSNorm and a SwiGLU MLP (gate / up / down); a final RMSNorm and an output
head, optionally tied to the embedding.

Parameter names, forward order, shapes and TP dims are those of `canzona.catalog.build_qwen3`, so
`model_spec(cfg)` (built *through* the catalog) lines up with `TinyQwen3(cfg).named_parameters()`
one for one.

Initialisation is deterministic and never touches torch's global RNG: every value is drawn in
float64 from a `torch.Generator` seeded with `seed` and then cast, so the fp32 model is exactly the
fp64 model rounded to fp32.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from canzona.catalog import Qwen3Config, build_qwen3
from canzona.decoder import DecoderConfig
from canzona.errors import SpecError
from canzona.spec import ModelSpec

__all__ = [
    "PRESETS",
    "TORCH_DTYPES",
    "RMSNorm",
    "TinyQwen3",
    "TinyQwen3Config",
    "apply_rope",
    "check_tp",
    "dtype_name",
    "get_preset",
    "model_spec",
    "preset_names",
    "rope_cos_sin",
]

ATTN_IMPLS = ("math", "sdpa")

# ParamSpec dtype strings <-> torch dtypes.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def dtype_name(dtype: torch.dtype | str) -> str:
    """The ParamSpec dtype string ("fp32", ...) of a torch float dtype (or of such a string)."""
    if isinstance(dtype, str):
        if dtype not in TORCH_DTYPES:
            raise SpecError(f"unknown dtype {dtype!r}; known: {', '.join(TORCH_DTYPES)}")
        return dtype
    for name, td in TORCH_DTYPES.items():
        if td == dtype:
            return name
    raise SpecError(f"unsupported dtype {dtype}; use one of {', '.join(map(str, TORCH_DTYPES.values()))}")


def _torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    return TORCH_DTYPES[dtype_name(dtype)]


@dataclass(frozen=True)
class TinyQwen3Config:
    """Shape of a tiny Qwen3-style decoder. Invalid values raise `SpecError` (a ValueError)."""

    vocab: int = 256
    hidden: int = 64
    layers: int = 2
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    tied_embeddings: bool = True
    max_seq_len: int = 64
    init_std: float = 0.02
    attn_impl: str = "math"  # "math" (explicit, deterministic everywhere) or "sdpa"
    name: str = "tiny-qwen3"

    def __post_init__(self) -> None:
        for field in ("vocab", "hidden", "layers", "q_heads", "kv_heads", "head_dim", "ffn",
                      "max_seq_len"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecError(f"TinyQwen3Config.{field} must be a positive integer, got {value!r}")
        if self.q_heads % self.kv_heads:
            raise SpecError(
                f"TinyQwen3Config: q_heads ({self.q_heads}) must be a multiple of kv_heads "
                f"({self.kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise SpecError(
                f"TinyQwen3Config.head_dim must be even for rotary embeddings, got {self.head_dim}"
            )
        if not (isinstance(self.rope_theta, (int, float)) and math.isfinite(self.rope_theta)
                and self.rope_theta > 1):
            raise SpecError(f"TinyQwen3Config.rope_theta must be a finite number > 1, got {self.rope_theta!r}")
        if not (isinstance(self.rms_eps, (int, float)) and math.isfinite(self.rms_eps)
                and self.rms_eps > 0):
            raise SpecError(f"TinyQwen3Config.rms_eps must be a finite number > 0, got {self.rms_eps!r}")
        if not (isinstance(self.init_std, (int, float)) and math.isfinite(self.init_std)
                and self.init_std > 0):
            raise SpecError(f"TinyQwen3Config.init_std must be a finite number > 0, got {self.init_std!r}")
        if not isinstance(self.tied_embeddings, bool):
            raise SpecError(
                f"TinyQwen3Config.tied_embeddings must be a bool, got {self.tied_embeddings!r}"
            )
        if self.attn_impl not in ATTN_IMPLS:
            raise SpecError(
                f"TinyQwen3Config.attn_impl must be one of {', '.join(ATTN_IMPLS)}, got {self.attn_impl!r}"
            )
        if not isinstance(self.name, str) or not self.name:
            raise SpecError(f"TinyQwen3Config.name must be a non-empty string, got {self.name!r}")

    @property
    def kv_groups(self) -> int:
        """Query heads per KV head."""
        return self.q_heads // self.kv_heads

    def replace(self, **changes) -> TinyQwen3Config:
        return dataclasses.replace(self, **changes)

    def as_catalog(self) -> DecoderConfig:
        """The same shape as a catalog model (`canzona.catalog.Qwen3Config`; official_params = 0: not
        published)."""
        return Qwen3Config(
            name=self.name, layers=self.layers, hidden=self.hidden, q_heads=self.q_heads,
            ffn=self.ffn, tied_embeddings=self.tied_embeddings, official_params=0.0,
            kv_heads=self.kv_heads, head_dim=self.head_dim, vocab=self.vocab,
        )


# Sizes chosen so a CPU training step takes milliseconds. "tiny" and "tiny-untied" split over
# tp in {1, 2}; "tiny-tp4" (as many KV heads as query heads) and "small" over tp in {1, 2, 4}.
PRESETS: dict[str, TinyQwen3Config] = {
    "tiny": TinyQwen3Config(
        vocab=256, hidden=64, layers=2, q_heads=4, kv_heads=2, head_dim=16, ffn=128,
        tied_embeddings=True, max_seq_len=64, name="tiny",
    ),
    "tiny-untied": TinyQwen3Config(
        vocab=256, hidden=64, layers=2, q_heads=4, kv_heads=2, head_dim=16, ffn=128,
        tied_embeddings=False, max_seq_len=64, name="tiny-untied",
    ),
    "tiny-tp4": TinyQwen3Config(
        vocab=256, hidden=64, layers=2, q_heads=4, kv_heads=4, head_dim=16, ffn=128,
        tied_embeddings=False, max_seq_len=64, name="tiny-tp4",
    ),
    "small": TinyQwen3Config(
        vocab=512, hidden=128, layers=4, q_heads=8, kv_heads=4, head_dim=32, ffn=384,
        tied_embeddings=False, max_seq_len=128, name="small",
    ),
}


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str, **changes) -> TinyQwen3Config:
    """A named preset, optionally with some fields replaced (`get_preset("tiny", layers=3)`)."""
    try:
        cfg = PRESETS[name]
    except KeyError:
        raise SpecError(f"unknown tiny model {name!r}; known: {', '.join(PRESETS)}") from None
    return cfg.replace(**changes) if changes else cfg


# ---------------------------------------------------------------------------------------------
# Spec and TP checks (through the catalog, so conventions cannot drift)
# ---------------------------------------------------------------------------------------------


def model_spec(cfg: TinyQwen3Config, dtype: torch.dtype | str = "fp32") -> ModelSpec:
    """The ModelSpec of `TinyQwen3(cfg)`: forward order identical to `named_parameters()`.

    Built by `canzona.catalog.build_qwen3`, so names, roles, layer indices and TP dims are exactly
    the catalog's; only the dtype differs (the model's dtype, fp32 by default).
    """
    name = dtype_name(dtype)
    spec = build_qwen3(cfg.as_catalog())
    return ModelSpec(spec.name, tuple(dataclasses.replace(p, dtype=name) for p in spec.params))


def check_tp(cfg: TinyQwen3Config, tp: int) -> ModelSpec:
    """Raise SpecError unless `tp` splits q heads, KV heads, ffn, vocab and every TP dim evenly.

    Returns the model spec on success (so `spec = check_tp(cfg, tp)` is handy).
    """
    if isinstance(tp, bool) or not isinstance(tp, int):
        raise SpecError(f"tp must be an integer, got {tp!r}")
    cfg.as_catalog().check_tp(tp)
    spec = model_spec(cfg)
    spec.check_tp(tp)
    return spec


# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """`w * x / sqrt(mean(x^2) + eps)` over the last dim; half precision computes in fp32."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self.normalized(x)

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        """`x / sqrt(mean(x^2) + eps)`, in `x`'s dtype."""
        xf = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape `positions.shape + (head_dim,)` (HF layout: halves repeated).

    Frequencies `theta^(-2i/head_dim)`, computed in float64 and then cast to `dtype`.
    """
    if head_dim % 2:
        raise SpecError(f"head_dim must be even for rotary embeddings, got {head_dim}")
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim
    )
    angles = positions.to(torch.float64)[..., None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` (`... x T x head_dim`) by cos / sin tables broadcastable to it (HF convention:
    dimension i pairs with i + head_dim/2)."""
    return x * cos + _rotate_half(x) * sin


def _uninitialised(module: nn.Module, device) -> nn.Module:
    """Allocate a module built on the meta device, without its default (global-RNG) initialisation:
    TinyQwen3.init_weights fills it."""
    return module.to_empty(device=torch.device("cpu") if device is None else torch.device(device))


def _linear(in_features: int, out_features: int, dtype: torch.dtype, device) -> nn.Linear:
    return _uninitialised(nn.Linear(in_features, out_features, bias=False, dtype=dtype, device="meta"), device)


class Attention(nn.Module):
    def __init__(self, cfg: TinyQwen3Config, dtype: torch.dtype, device=None):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden, cfg.head_dim
        # Registration order is forward order and matches the catalog: q, k, v, q_norm, k_norm, o.
        self.q_proj = _linear(h, cfg.q_heads * d, dtype, device)
        self.k_proj = _linear(h, cfg.kv_heads * d, dtype, device)
        self.v_proj = _linear(h, cfg.kv_heads * d, dtype, device)
        self.q_norm = RMSNorm(d, cfg.rms_eps, dtype, device)
        self.k_norm = RMSNorm(d, cfg.rms_eps, dtype, device)
        self.o_proj = _linear(cfg.q_heads * d, h, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        d = cfg.head_dim
        # heads as -1: under tensor parallelism (reference.tiny_model_tp.parallelize_tiny) this
        # rank's projections give its share of the heads
        q = self.q_norm(self.q_proj(x).view(b, t, -1, d)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, -1, d)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, d).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cfg.attn_impl == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 enable_gqa=cfg.kv_groups > 1)
        else:
            out = causal_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Explicit causal GQA: q `B x Hq x T x D`, k / v `B x Hkv x T x D`; q head j reads KV head
    `j // (Hq // Hkv)` (the Hugging Face `repeat_kv` grouping)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    t = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    probs = torch.softmax(scores.float() if q.dtype in (torch.bfloat16, torch.float16) else scores,
                          dim=-1).to(q.dtype)
    return probs @ v


class MLP(nn.Module):
    def __init__(self, cfg: TinyQwen3Config, dtype: torch.dtype, device=None):
        super().__init__()
        self.gate_proj = _linear(cfg.hidden, cfg.ffn, dtype, device)
        self.up_proj = _linear(cfg.hidden, cfg.ffn, dtype, device)
        self.down_proj = _linear(cfg.ffn, cfg.hidden, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TinyQwen3Config, dtype: torch.dtype, device=None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps, dtype, device)
        self.self_attn = Attention(cfg, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps, dtype, device)
        self.mlp = MLP(cfg, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Backbone(nn.Module):
    """The `model.` prefix of the Hugging Face names."""

    def __init__(self, cfg: TinyQwen3Config, dtype: torch.dtype, device=None):
        super().__init__()
        # `_weight` skips Embedding's default init (its normal_ on meta imports torch._dynamo)
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden, _weight=torch.empty(
            cfg.vocab, cfg.hidden, dtype=dtype, device=torch.device("cpu") if device is None else device))
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.rms_eps, dtype, device)


class TinyQwen3(nn.Module):
    """Tiny Qwen3-style decoder. `TinyQwen3(cfg, seed=0)` is bitwise reproducible.

    With `cfg.tied_embeddings`, `lm_head.weight` *is* `model.embed_tokens.weight` (one Parameter),
    so `named_parameters()` lists it once, as the embedding, exactly as the catalog does.
    """

    def __init__(self, cfg: TinyQwen3Config | str = "tiny", seed: int = 0,
                 dtype: torch.dtype | str = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        if isinstance(cfg, str):
            cfg = get_preset(cfg)
        if not isinstance(cfg, TinyQwen3Config):
            raise SpecError(f"cfg must be a TinyQwen3Config or a preset name, got {type(cfg).__name__}")
        tdtype = _torch_dtype(dtype)
        self.cfg = cfg
        self.model = _Backbone(cfg, tdtype, device)
        self.lm_head = _linear(cfg.hidden, cfg.vocab, tdtype, device)
        if cfg.tied_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.init_weights(seed)

    # -- initialisation ------------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self, seed: int | torch.Generator = 0) -> None:
        """Re-initialise in place: every 2-D weight ~ N(0, init_std^2), every norm weight = 1.

        Values are drawn in float64 on the CPU from a Generator (seeded with `seed`, or the one
        given) in `named_parameters()` order and then cast, so they do not depend on dtype or
        device beyond that final rounding, and torch's global RNG is left untouched.
        """
        if isinstance(seed, torch.Generator):
            gen = seed
        else:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(int(seed))
        for _, p in self.named_parameters():
            if p.dim() >= 2:
                values = torch.randn(p.shape, generator=gen, dtype=torch.float64)
                p.copy_(values * self.cfg.init_std)
            else:
                p.fill_(1.0)

    # -- forward -------------------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def spec(self) -> ModelSpec:
        """`model_spec(self.cfg)` with this module's dtype."""
        return model_spec(self.cfg, self.dtype)

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states, `B x T x hidden`."""
        tokens = self._check_tokens(tokens)
        t = tokens.shape[1]
        positions = torch.arange(t, device=tokens.device)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, self.dtype)
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits `B x T x vocab` (the model's dtype) for LongTensor tokens `B x T`."""
        return self.lm_head(self.hidden_states(tokens))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over `tokens[:, 1:]` (fp32 at least), a scalar."""
        tokens = self._check_tokens(tokens)
        if tokens.shape[1] < 2:
            raise SpecError(f"loss needs sequences of at least 2 tokens, got {tokens.shape[1]}")
        logits = self(tokens[:, :-1])
        if logits.dtype in (torch.bfloat16, torch.float16):
            logits = logits.float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    def _check_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            raise SpecError("tokens must be a 2-D LongTensor of shape batch x seq_len")
        if tokens.dtype not in (torch.int64, torch.int32):
            raise SpecError(f"tokens must be an integer tensor, got {tokens.dtype}")
        if tokens.shape[1] > self.cfg.max_seq_len:
            raise SpecError(
                f"sequence length {tokens.shape[1]} exceeds max_seq_len {self.cfg.max_seq_len}"
            )
        if tokens.shape[0] < 1 or tokens.shape[1] < 1:
            raise SpecError(f"tokens must be non-empty, got shape {tuple(tokens.shape)}")
        return tokens
