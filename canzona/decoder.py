"""Decoder-only transformers of the Llama lineage (Llama, Mistral, Qwen2, Qwen3, and the
mixture-of-experts Qwen3-MoE and Mixtral) and the `Architecture` the simulator reads
(docs/design.md §2.5, §2.6).

`DecoderConfig` is the one description of such a model: the catalog's Qwen3 facts are
`DecoderConfig`s, and Hugging Face `config.json` files become `DecoderConfig`s
(`canzona.models`). `build_decoder` turns one into a `ModelSpec` with Hugging Face parameter
names in forward order and Megatron TP dims. `Architecture` holds the sizes the FLOPs and memory
models need; it comes from a `DecoderConfig`, from a spec file's `architecture` block, or from a
spec's parameters (`canzona.models.resolve_model`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from canzona.errors import SpecError
from canzona.spec import ROUTER_OPTIMIZERS, ModelSpec, ParamSpec, Role

FAMILIES = ("qwen3", "qwen2", "llama", "mistral", "qwen3_moe", "mixtral")

# Bounds far beyond any dense model (the largest have about 130 layers, hidden 25k, vocabularies
# of 256k): a forged file cannot make canzona build millions of parameters or layers.
MAX_LAYERS = 1024
MAX_DIM = 2**22


def _check_positive(owner: str, field: str, value: object, high: int = MAX_DIM) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise SpecError(f"{owner}: {field} must be a whole number in 1..{high}, got {value!r}")


def check_tp_sizes(name: str, tp: int, sizes: dict[str, int]) -> None:
    """TP must split the attention heads, KV heads, the MLP and the vocabulary evenly: each of
    those that `sizes` gives (`Architecture` field names)."""
    if tp < 1:
        raise SpecError(f"tp must be >= 1, got {tp}")
    for field, what in (("q_heads", "attention heads"), ("kv_heads", "KV heads"), ("ffn", "ffn width"),
                        ("vocab", "vocabulary")):
        size = sizes.get(field)
        if size is not None and size % tp:
            raise SpecError(f"tp={tp} does not divide the {size} {what} of {name}")


@dataclass(frozen=True)
class Architecture:
    """What the simulator's FLOPs and memory models need to know of a model, beyond its parameters.

    `layers`, `hidden`, `vocab` and `q_dim` (query projection width, heads x head_dim) are always
    known; the others may be unknown (None) when they were inferred from a spec's parameters, and
    `require` names the field a spec file must add for a consumer that needs one.
    """

    name: str
    layers: int
    hidden: int
    vocab: int
    q_dim: int
    kv_dim: int | None = None
    q_heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    ffn: int | None = None
    experts: int | None = None  # routed experts per mixture-of-experts layer (None: a dense model)
    experts_per_token: int | None = None  # top-k: the experts each token is routed to
    # the attention window of layers that attend to the last `sliding_window` tokens only (Mistral's
    # `sliding_window`, Qwen2's / Qwen3's under `use_sliding_window`); None: full causal attention.
    # The simulator prices full causal attention, so it refuses sequences longer than the window
    # (`sim.simulate.SimConfig.checked`) rather than price attention the model does not run
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if (self.experts is None) != (self.experts_per_token is None):
            raise SpecError(f"architecture of {self.name}: a mixture-of-experts model gives both experts and "
                            "experts_per_token")
        if self.experts is not None and self.experts_per_token is not None and self.experts_per_token > self.experts:
            raise SpecError(f"architecture of {self.name}: experts_per_token {self.experts_per_token} is more "
                            f"than the {self.experts} experts")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "name" and value is not None:
                _check_positive(f"architecture of {self.name}", f.name, value,
                                MAX_LAYERS if f.name == "layers" else MAX_DIM)

    @property
    def moe(self) -> tuple[int, int] | None:
        """(experts, experts_per_token) of a mixture-of-experts model; None for a dense one."""
        if self.experts is None or self.experts_per_token is None:
            return None
        return self.experts, self.experts_per_token

    def tokens_share(self, param: ParamSpec) -> float:
        """The share of a micro-batch's tokens a parameter's GEMM processes: an expert's, the
        experts each token is routed to over all experts (a balanced router); 1 otherwise."""
        if param.role is not Role.EXPERT:
            return 1.0
        if self.moe is None:
            raise SpecError(f"model {self.name!r} has experts ({param.name!r}): its architecture must give "
                            "experts and experts_per_token")
        return self.moe[1] / self.moe[0]

    def require(self, field: str) -> int:
        """The value of `field`, or one error naming the field to add to the spec file."""
        value = getattr(self, field)
        if value is None:
            raise SpecError(f"the architecture of model {self.name!r} does not give {field!r}: add it to the "
                            "\"architecture\" block of the spec file")
        return value

    def check_tp(self, tp: int) -> None:
        """TP must split the attention heads, KV heads, the MLP and the vocabulary evenly (those known)."""
        check_tp_sizes(self.name, tp, self.to_dict())

    def to_dict(self) -> dict[str, int]:
        """The known sizes, as a spec file's `architecture` block."""
        return {k: v for k, v in asdict(self).items() if k != "name" and v is not None}


@dataclass(frozen=True)
class DecoderConfig:
    """A decoder: per layer RMSNorm, attention (q, k, v, o), RMSNorm, SwiGLU MLP (gate, up, down),
    or, in a mixture-of-experts layer, a router and stacked SwiGLU experts (docs/design.md §2.6).

    `qk_norm`: per-head RMSNorm weights on q and k (Qwen3). `qkv_bias`: biases on q, k and v (Qwen2,
    or `attention_bias` of Llama and Qwen3, which also sets `o_bias`). `mlp_bias`: biases on gate, up
    and down (Llama's `mlp_bias`). `official_params`: the published size, for the catalog's
    parameter-count check (0 when there is none).
    """

    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied_embeddings: bool
    family: str = "llama"
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    official_params: float = 0.0
    # Mixture of experts (experts = 0: a dense model). Each MoE layer has a router
    # (`mlp.gate.weight`, experts x hidden) and the experts stacked as transformers 5 stores them
    # (`mlp.experts.gate_up_proj` experts x 2 moe_ffn x hidden, `mlp.experts.down_proj` experts x
    # hidden x moe_ffn); `dense_layers` keep a dense MLP of width `ffn` (Qwen3-MoE's
    # mlp_only_layers, DeepSeek's first dense layers); `shared_ffn` adds an always-on shared
    # expert of that width (DeepSeek's `mlp.shared_experts`).
    experts: int = 0
    experts_per_token: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0
    dense_layers: tuple[int, ...] = ()
    # Whether an expert's fused gate/up block is two matrices for the matrix optimizer (gate and
    # up, as a dense layer's separate projections are: the default) or one (2 moe_ffn x hidden).
    split_fc1: bool = True
    router_optimizer: str = "adamw"
    official_active_params: float = 0.0
    sliding_window: int | None = None  # `Architecture.sliding_window`

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise SpecError(f"a model name must be a non-empty string, got {self.name!r}")
        for field in ("layers", "hidden", "q_heads", "kv_heads", "head_dim", "ffn", "vocab"):
            _check_positive(self.name, field, getattr(self, field), MAX_LAYERS if field == "layers" else MAX_DIM)
        if self.family not in FAMILIES:
            raise SpecError(f"{self.name}: unknown family {self.family!r}; known: {', '.join(FAMILIES)}")
        if self.experts:
            for field in ("experts", "experts_per_token", "moe_ffn"):
                _check_positive(self.name, field, getattr(self, field))
            if self.experts_per_token > self.experts:
                raise SpecError(f"{self.name}: experts_per_token {self.experts_per_token} is more than the "
                                f"{self.experts} experts")
            if self.shared_ffn:
                _check_positive(self.name, "shared_ffn", self.shared_ffn)
            bad = [i for i in self.dense_layers if isinstance(i, bool) or not isinstance(i, int)
                   or not 0 <= i < self.layers]
            if bad:
                raise SpecError(f"{self.name}: dense layer {bad[0]!r} is not a layer in 0..{self.layers - 1}")
        elif self.experts_per_token or self.moe_ffn or self.shared_ffn or self.dense_layers:
            raise SpecError(f"{self.name}: expert settings without experts (experts = 0 is a dense model)")
        if self.router_optimizer not in ROUTER_OPTIMIZERS:
            raise SpecError(f"{self.name}: router_optimizer must be one of {', '.join(ROUTER_OPTIMIZERS)}, "
                            f"got {self.router_optimizer!r}")

    @property
    def q_dim(self) -> int:
        return self.q_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def architecture(self) -> Architecture:
        moe = (self.experts, self.experts_per_token) if self.experts else (None, None)
        return Architecture(self.name, self.layers, self.hidden, self.vocab, self.q_dim, self.kv_dim,
                            self.q_heads, self.kv_heads, self.head_dim, self.ffn, *moe,
                            sliding_window=self.sliding_window)

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.experts) and layer not in self.dense_layers

    def check_tp(self, tp: int) -> None:
        """TP must split attention heads, KV heads, the MLP and the vocabulary evenly."""
        self.architecture().check_tp(tp)


def build_decoder(cfg: DecoderConfig) -> ModelSpec:
    """Parameters in forward order, Hugging Face names, Megatron TP dims (docs/design.md §2.3).

    Biases of column-parallel layers (q, k, v, gate, up) are split with their rows; those of
    row-parallel layers (o, down) are replicated, as Megatron adds them after the reduction.
    """
    h, q_out, kv_out = cfg.hidden, cfg.q_dim, cfg.kv_dim
    params: list[ParamSpec] = [
        ParamSpec("model.embed_tokens.weight", (cfg.vocab, h), Role.EMBEDDING, None, tp_dim=0)
    ]

    def linear(name: str, out: int, inp: int, layer: int, tp_dim: int, bias: bool) -> list[ParamSpec]:
        row = [ParamSpec(f"{name}.weight", (out, inp), Role.MATRIX, layer, tp_dim=tp_dim)]
        if bias:
            row.append(ParamSpec(f"{name}.bias", (out,), Role.VECTOR, layer, tp_dim=0 if tp_dim == 0 else None))
        return row

    for i in range(cfg.layers):
        pre = f"model.layers.{i}"
        attn, mlp = f"{pre}.self_attn", f"{pre}.mlp"
        params.append(ParamSpec(f"{pre}.input_layernorm.weight", (h,), Role.VECTOR, i))
        params += linear(f"{attn}.q_proj", q_out, h, i, 0, cfg.qkv_bias)
        params += linear(f"{attn}.k_proj", kv_out, h, i, 0, cfg.qkv_bias)
        params += linear(f"{attn}.v_proj", kv_out, h, i, 0, cfg.qkv_bias)
        if cfg.qk_norm:
            params += [ParamSpec(f"{attn}.q_norm.weight", (cfg.head_dim,), Role.VECTOR, i),
                       ParamSpec(f"{attn}.k_norm.weight", (cfg.head_dim,), Role.VECTOR, i)]
        params += linear(f"{attn}.o_proj", h, q_out, i, 1, cfg.o_bias)
        params.append(ParamSpec(f"{pre}.post_attention_layernorm.weight", (h,), Role.VECTOR, i))
        if cfg.is_moe_layer(i):
            params += _moe_block(cfg, mlp, i)
            continue
        params += linear(f"{mlp}.gate_proj", cfg.ffn, h, i, 0, cfg.mlp_bias)
        params += linear(f"{mlp}.up_proj", cfg.ffn, h, i, 0, cfg.mlp_bias)
        params += linear(f"{mlp}.down_proj", h, cfg.ffn, i, 1, cfg.mlp_bias)
    params.append(ParamSpec("model.norm.weight", (h,), Role.VECTOR, None))
    if not cfg.tied_embeddings:
        params.append(ParamSpec("lm_head.weight", (cfg.vocab, h), Role.HEAD, None, tp_dim=0))
    return ModelSpec(cfg.name, tuple(params))


def _moe_block(cfg: DecoderConfig, mlp: str, layer: int) -> list[ParamSpec]:
    """A mixture-of-experts MLP in forward order: the router, the shared expert (if any, Megatron
    TP like a dense MLP), the stacked routed experts (whole on every TP rank: expert TP 1)."""
    h, e, f = cfg.hidden, cfg.experts, cfg.moe_ffn
    router_role = Role.ROUTER if cfg.router_optimizer == "adamw" else Role.MATRIX
    params = [ParamSpec(f"{mlp}.gate.weight", (e, h), router_role, layer)]
    if cfg.shared_ffn:
        shared = f"{mlp}.shared_experts"
        params += [ParamSpec(f"{shared}.gate_proj.weight", (cfg.shared_ffn, h), Role.MATRIX, layer, tp_dim=0),
                   ParamSpec(f"{shared}.up_proj.weight", (cfg.shared_ffn, h), Role.MATRIX, layer, tp_dim=0),
                   ParamSpec(f"{shared}.down_proj.weight", (h, cfg.shared_ffn), Role.MATRIX, layer, tp_dim=1)]
    fc1 = (f, h) if cfg.split_fc1 else (2 * f, h)
    params += [ParamSpec(f"{mlp}.experts.gate_up_proj", (e, 2 * f, h), Role.EXPERT, layer, matrix_shape=fc1),
               ParamSpec(f"{mlp}.experts.down_proj", (e, h, f), Role.EXPERT, layer, matrix_shape=(h, f))]
    return params
