"""Where models come from (docs/design.md §2.5): a catalog name, a Hugging Face `config.json` of a
dense or mixture-of-experts decoder, or a canzona spec file. `resolve_model` turns any of them into the `ModelSpec` the
planner, the simulator and the runtime consume and the `Architecture` the simulator's FLOPs model
reads; `save_spec` / `load_spec` write and read spec files.

A spec file is JSON:

    {"schema": "canzona.model", "version": 1, "name": "my-model",
     "architecture": {"layers": 2, "hidden": 64, "vocab": 256, "q_dim": 64, ...},   (optional)
     "params": [{"name": "model.embed_tokens.weight", "shape": [256, 64], "role": "embedding",
                 "layer": null, "tp_dim": 0, "dtype": "bf16"}, ...]}

`params` lists the parameters in forward order with their global shapes (`canzona.spec.ParamSpec`;
`layer`, `tp_dim`, `dtype` and `matrix_shape` may be left out: none, none, bf16, none). Experts
have role "expert": a stacked expert tensor gives `matrix_shape`, the shape of each matrix it
stacks (e.g. [768, 2048] on a [128, 1536, 2048] fused gate/up: gate and up of each expert are two
matrices), and routers role "router". The `architecture` block gives any of `Architecture`'s
sizes (a mixture-of-experts model: `experts` and `experts_per_token`); those it leaves out are
inferred from the parameters.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from canzona.catalog import CATALOG, get_config
from canzona.decoder import (
    MAX_DIM,
    MAX_LAYERS,
    Architecture,
    DecoderConfig,
    build_decoder,
    check_tp_sizes,
)
from canzona.errors import SpecError
from canzona.experts import check_experts, check_whole_stacks
from canzona.fileio import is_whole_number, parse_json, read_text, write_text_atomic
from canzona.spec import DTYPE_BYTES, ModelSpec, ParamSpec, Role

SPEC_SCHEMA = "canzona.model"
SPEC_VERSION = 1
SPEC_FIELDS = ("schema", "version", "name", "architecture", "params")
PARAM_FIELDS = ("name", "shape", "role", "layer", "tp_dim", "dtype", "matrix_shape")
ARCHITECTURE_FIELDS = ("layers", "hidden", "vocab", "q_dim", "kv_dim", "q_heads", "kv_heads", "head_dim", "ffn",
                       "experts", "experts_per_token", "sliding_window")
REQUIRED_ARCHITECTURE = ("layers", "hidden", "vocab", "q_dim")
MAX_PARAMS = 2**20
MAX_PARAM_DIM = 2**40
MAX_PARAM_NUMEL = 2**48  # elements in one parameter; far beyond any real model
MAX_NDIM = 8

SUPPORTED = "dense qwen3, qwen2, llama and mistral configs, and qwen3_moe and mixtral mixture-of-experts ones"
# What transformers (4.51 to 5.x) does with each supported model type: the default of
# num_key_value_heads when a config.json leaves it out (None: as many as the attention heads; an
# explicit null always means that), the default of head_dim (None: hidden_size / num_attention_heads),
# the per-head q/k norms, and which bias flags the model reads (Qwen2 always has q/k/v biases).
# tie_word_embeddings defaults to false for all four.
HF_TYPES: dict[str, dict[str, Any]] = {
    "qwen3": {"kv_heads": 32, "head_dim": 128, "qk_norm": True, "reads_attention_bias": True, "reads_mlp_bias": False},
    "qwen2": {"kv_heads": 32, "head_dim": None, "qk_norm": False, "reads_attention_bias": False, "reads_mlp_bias": False},
    "llama": {"kv_heads": None, "head_dim": None, "qk_norm": False, "reads_attention_bias": True, "reads_mlp_bias": True},
    "mistral": {"kv_heads": 8, "head_dim": None, "qk_norm": False, "reads_attention_bias": False, "reads_mlp_bias": False},
    "qwen3_moe": {"kv_heads": 4, "head_dim": None, "qk_norm": True, "reads_attention_bias": True, "reads_mlp_bias": False},
    "mixtral": {"kv_heads": 8, "head_dim": None, "qk_norm": False, "reads_attention_bias": False, "reads_mlp_bias": False},
}
# The mixture-of-experts types (transformers 5): the key of the expert count, of the expert MLP
# width (mixtral's experts are `intermediate_size` wide) and the defaults of the fields a config
# may leave out. qwen3_moe layers are dense where `mlp_only_layers` lists them or where
# (layer + 1) % decoder_sparse_step != 0 (Qwen3MoeDecoderLayer).
HF_MOE: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"experts": (("num_experts", "num_local_experts"), 128), "per_token": 8,
                  "width": ("moe_intermediate_size", 768), "ffn": 6144, "dense_rule": True},
    "mixtral": {"experts": (("num_local_experts", "num_experts"), 8), "per_token": 2,
                "width": ("intermediate_size", 14336), "ffn": 14336, "dense_rule": False},
}
# transformers 5 writes both types' expert count as num_local_experts (num_experts is its alias);
# the published Qwen3-MoE configs, written by transformers 4, say num_experts
HF_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")

# Module names that identify a projection when a spec has no architecture block (the spellings of
# Hugging Face, torchtitan, BERT-style and diffusers models). A fused qkv cannot be split by name.
Q_NAMES = frozenset({"q_proj", "query", "wq", "q", "to_q", "linear_q", "q_lin"})
K_NAMES = frozenset({"k_proj", "key", "wk", "k", "to_k", "linear_k", "k_lin"})
FFN_NAMES = frozenset({"gate_proj", "up_proj", "w1", "w3", "fc1"})
QK_NORM_NAMES = frozenset({"q_norm", "q_layernorm"})
TOKEN_EMBEDDING_NAMES = frozenset({"embed_tokens", "wte", "tok_embeddings", "word_embeddings", "embed_in"})


# --- Hugging Face config.json ------------------------------------------------------------------


def _whole(value: Any, key: str, where: str, high: int = MAX_DIM) -> int:
    if not is_whole_number(value, 1, high):
        raise SpecError(f"{where}: {key} must be a whole number in 1..{high}, got {value!r}")
    return value


def _hf_int(data: Mapping[str, Any], key: str, where: str, high: int = MAX_DIM) -> int:
    if data.get(key) is None:
        raise SpecError(f"{where}: missing field {key!r} (a config needs {', '.join(HF_REQUIRED)})")
    return _whole(data[key], key, where, high)


def _hf_bool(data: Mapping[str, Any], key: str, where: str) -> bool:
    value = data.get(key, False)
    if not isinstance(value, bool):
        raise SpecError(f"{where}: {key} must be true or false, got {value!r}")
    return value


def config_from_hf(data: Any, name: str, where: str = "config") -> DecoderConfig:
    """The `DecoderConfig` of a Hugging Face `config.json` (parsed) of a dense qwen3, qwen2, llama or
    mistral model, or a qwen3_moe or mixtral mixture-of-experts one (`HF_MOE`). Fields it leaves
    out take transformers' defaults for that model type (`HF_TYPES`; `tie_word_embeddings` false
    for all). Other mixture-of-experts configs and other model types are refused."""
    if not isinstance(data, dict):
        raise SpecError(f"{where}: expected a JSON object")
    model_type = data.get("model_type")
    moe = [k for k in MOE_KEYS if data.get(k) not in (None, 0, False)]
    if model_type not in HF_MOE and (moe or (isinstance(model_type, str) and (
            "moe" in model_type or model_type == "dbrx"))):
        what = f"model_type {model_type!r}" if isinstance(model_type, str) else f"field {moe[0]!r}"
        raise SpecError(f"{where}: this mixture-of-experts model is not supported ({what}); canzona reads "
                        f"{SUPPORTED}, or any model as a spec file")
    if model_type is None:
        raise SpecError(f"{where}: missing field 'model_type'; canzona reads {SUPPORTED}")
    if model_type not in HF_TYPES:
        raise SpecError(f"{where}: model_type {model_type!r} is not supported; canzona reads {SUPPORTED} "
                        "(or a canzona spec file: see `canzona spec`)")
    kind = HF_TYPES[model_type]
    layers = _hf_int(data, "num_hidden_layers", where, high=MAX_LAYERS)
    hidden = _hf_int(data, "hidden_size", where)
    heads = _hf_int(data, "num_attention_heads", where)
    if model_type in HF_MOE and data.get("intermediate_size") is None:
        ffn = HF_MOE[model_type]["ffn"]  # transformers' default: these configs may leave it out
    else:
        ffn = _hf_int(data, "intermediate_size", where)
    vocab = _hf_int(data, "vocab_size", where)
    # where the count comes from, for the error below: a default the user never wrote is named as one
    kv_source = ""
    if "num_key_value_heads" not in data:
        kv_heads = kind["kv_heads"] or heads
        if kind["kv_heads"]:
            kv_source = f" (transformers' default for {model_type}, which the config leaves out)"
    else:
        kv_heads = heads if data["num_key_value_heads"] is None else _whole(data["num_key_value_heads"],
                                                                            "num_key_value_heads", where)
    head_dim = data.get("head_dim", kind["head_dim"])
    if head_dim is None:
        if hidden % heads:
            raise SpecError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}; "
                            "give head_dim")
        head_dim = hidden // heads
    head_dim = _whole(head_dim, "head_dim", where)
    if heads % kv_heads:
        raise SpecError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                        f"{kv_heads}{kv_source}")
    attention_bias = kind["reads_attention_bias"] and _hf_bool(data, "attention_bias", where)
    return DecoderConfig(
        name, layers, hidden, heads, kv_heads, head_dim, ffn, vocab,
        tied_embeddings=_hf_bool(data, "tie_word_embeddings", where), family=model_type,
        qk_norm=kind["qk_norm"], qkv_bias=attention_bias or model_type == "qwen2", o_bias=attention_bias,
        mlp_bias=kind["reads_mlp_bias"] and _hf_bool(data, "mlp_bias", where),
        sliding_window=_hf_window(data, model_type, layers, where),
        **(_hf_experts(data, model_type, layers, where) if model_type in HF_MOE else {}),
    )


# The model types whose attention may slide over a window, and how transformers turns it on:
# mistral and mixtral whenever `sliding_window` is set (every layer); qwen2, qwen3 and qwen3_moe
# only under `use_sliding_window`, on the layers from `max_window_layers` on (transformers'
# Qwen2Attention / Qwen3Attention: `layer_idx >= max_window_layers`), so their configs' own
# `sliding_window` (4096, 32768, ...) is inert unless that is set
WINDOW_ALWAYS = frozenset({"mistral", "mixtral"})
WINDOW_GATED = {"qwen2": 28, "qwen3": 28, "qwen3_moe": 28}  # transformers' max_window_layers defaults


def _hf_window(data: Mapping[str, Any], model_type: str, layers: int, where: str) -> int | None:
    """The attention window some layers of this config use (`Architecture.sliding_window`), or None."""
    if model_type in WINDOW_GATED:
        if not _hf_bool(data, "use_sliding_window", where):
            return None
        first = data.get("max_window_layers", WINDOW_GATED[model_type])
        if not (isinstance(first, int) and not isinstance(first, bool) and first >= 0):
            raise SpecError(f"{where}: max_window_layers must be a whole number >= 0, got {first!r}")
        if first >= layers:  # no layer reaches it: full attention everywhere
            return None
    elif model_type not in WINDOW_ALWAYS:
        return None
    window = data.get("sliding_window")
    return None if window is None else _whole(window, "sliding_window", where)


def _hf_experts(data: Mapping[str, Any], model_type: str, layers: int, where: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a qwen3_moe or mixtral config (`HF_MOE`), as
    `DecoderConfig` keywords."""
    kind = HF_MOE[model_type]
    keys, default = kind["experts"]
    given = {k: data[k] for k in keys if data.get(k) is not None}
    if len(set(map(repr, given.values()))) > 1:
        raise SpecError(f"{where}: {keys[0]} and {keys[1]} disagree ({given[keys[0]]!r} and {given[keys[1]]!r})")
    key = next(iter(given), keys[0])
    experts = _whole(given.get(key, default), key, where)
    per_token = _whole(data.get("num_experts_per_tok", kind["per_token"]), "num_experts_per_tok", where)
    width_key, width_default = kind["width"]
    width = _whole(data.get(width_key, width_default), width_key, where)
    if per_token > experts:
        raise SpecError(f"{where}: num_experts_per_tok {per_token} is more than the {experts} experts")
    dense: list[int] = []
    if kind["dense_rule"]:
        only = data.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(is_whole_number(i, 0, layers - 1) for i in only):
            raise SpecError(f"{where}: mlp_only_layers must be a list of layer indices in 0..{layers - 1}, "
                            f"got {only!r}")
        step = _whole(data.get("decoder_sparse_step", 1), "decoder_sparse_step", where, high=MAX_LAYERS)
        dense = [i for i in range(layers) if i in only or (i + 1) % step]
    return {"experts": experts, "experts_per_token": per_token, "moe_ffn": width, "dense_layers": tuple(dense)}


def _name_from_file(data: Mapping[str, Any], path: Path) -> str:
    """The config's `_name_or_path`, else the file's stem (the folder's name for a `config.json`)."""
    given = data.get("_name_or_path")
    if isinstance(given, str) and given.strip():
        return given.strip()
    if path.name == "config.json" and path.resolve().parent.name:
        return path.resolve().parent.name
    return path.stem or str(path)


# --- spec files ---------------------------------------------------------------------------------


def spec_to_dict(spec: ModelSpec, architecture: Architecture | Mapping[str, int] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"schema": SPEC_SCHEMA, "version": SPEC_VERSION, "name": spec.name}
    if architecture is not None:
        block = architecture.to_dict() if isinstance(architecture, Architecture) else dict(architecture)
        out["architecture"] = {k: block[k] for k in ARCHITECTURE_FIELDS if block.get(k) is not None}
    out["params"] = [{"name": p.name, "shape": list(p.shape), "role": p.role.value, "layer": p.layer,
                      "tp_dim": p.tp_dim, "dtype": p.dtype}
                     | ({"matrix_shape": list(p.matrix_shape)} if p.matrix_shape is not None else {})
                     for p in spec.params]
    return out


def spec_to_json(spec: ModelSpec, architecture: Architecture | Mapping[str, int] | None = None) -> str:
    """The spec file's text: one parameter per line, so it reads and diffs as a table."""
    d = spec_to_dict(spec, architecture)
    head = ",\n".join(f" {json.dumps(k)}: {json.dumps(v, allow_nan=False)}" for k, v in d.items() if k != "params")
    rows = ",\n".join(f"  {json.dumps(row, allow_nan=False)}" for row in d["params"])
    return "{\n" + head + ',\n "params": [\n' + rows + "\n ]\n}\n"


def save_spec(spec: ModelSpec, path: str | Path, architecture: Architecture | Mapping[str, int] | None = None) -> None:
    """Write `spec` (and, if given, its architecture) as a spec file, atomically."""
    write_text_atomic(path, spec_to_json(spec, architecture), "spec file")


def _row(raw: Any, i: int, where: str) -> ParamSpec:
    at = f"{where}: params[{i}]"
    if not isinstance(raw, dict):
        raise SpecError(f"{at} must be an object with {', '.join(PARAM_FIELDS)}")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise SpecError(f"{at}: name must be a non-empty string, got {name!r}")
    at = f"{at} ({name!r})"
    unknown = sorted(set(raw) - set(PARAM_FIELDS))
    if unknown:
        raise SpecError(f"{at}: unknown field {unknown[0]!r}; a parameter has {', '.join(PARAM_FIELDS)}")
    shape = raw.get("shape")
    if (not isinstance(shape, list) or len(shape) > MAX_NDIM  # [] is a 0-d scalar (a logit scale, a gate)
            or not all(is_whole_number(d, 1, MAX_PARAM_DIM) for d in shape)):
        raise SpecError(f"{at}: shape must be a list of at most {MAX_NDIM} positive whole numbers ([]: a 0-d "
                        f"scalar), got {shape!r}")
    numel = 1
    for d in shape:
        numel *= d
    if numel > MAX_PARAM_NUMEL:
        raise SpecError(f"{at}: {numel} elements is beyond any real model (at most {MAX_PARAM_NUMEL})")
    role = raw.get("role")
    if role not in [r.value for r in Role]:
        raise SpecError(f"{at}: role must be one of {', '.join(r.value for r in Role)}, got {role!r}")
    layer = raw.get("layer")
    if layer is not None and not is_whole_number(layer, 0, MAX_LAYERS - 1):
        raise SpecError(f"{at}: layer must be null or a whole number in 0..{MAX_LAYERS - 1}, got {layer!r}")
    tp_dim = raw.get("tp_dim")
    if tp_dim is not None and not is_whole_number(tp_dim, 0, len(shape) - 1):
        raise SpecError(f"{at}: tp_dim must be null or a dimension of shape {shape}, got {tp_dim!r}")
    dtype = raw.get("dtype", "bf16")
    if dtype not in DTYPE_BYTES:
        raise SpecError(f"{at}: dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    matrix_shape = raw.get("matrix_shape")
    if matrix_shape is not None and (not isinstance(matrix_shape, list) or len(matrix_shape) != 2
                                     or not all(is_whole_number(d, 1, MAX_PARAM_DIM) for d in matrix_shape)):
        raise SpecError(f"{at}: matrix_shape must be null or a list of two positive whole numbers (the shape of "
                        f"each matrix the parameter stacks), got {matrix_shape!r}")
    try:
        return ParamSpec(name, tuple(shape), Role(role), layer, tp_dim, dtype,
                         tuple(matrix_shape) if matrix_shape is not None else None)
    except SpecError as e:
        raise SpecError(f"{where}: {e}") from None


def _architecture_block(raw: Any, where: str) -> dict[str, int]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise SpecError(f"{where}: architecture must be an object with any of {', '.join(ARCHITECTURE_FIELDS)}")
    unknown = sorted(set(raw) - set(ARCHITECTURE_FIELDS))
    if unknown:
        raise SpecError(f"{where}: unknown architecture field {unknown[0]!r}; known: {', '.join(ARCHITECTURE_FIELDS)}")
    block = {}
    for key, value in raw.items():
        high = MAX_LAYERS if key == "layers" else MAX_DIM
        if value is not None and not is_whole_number(value, 1, high):
            raise SpecError(f"{where}: architecture.{key} must be a whole number in 1..{high}, got {value!r}")
        if value is not None:
            block[key] = value
    return block


def spec_from_dict(data: Any, where: str = "spec") -> tuple[ModelSpec, dict[str, int]]:
    """A spec file's model and its `architecture` block (empty when absent), validated."""
    if not isinstance(data, dict):
        raise SpecError(f"{where}: expected a JSON object with schema {SPEC_SCHEMA!r}")
    if data.get("schema") != SPEC_SCHEMA:
        raise SpecError(f"{where}: schema is {data.get('schema')!r}, not {SPEC_SCHEMA!r}")
    if not is_whole_number(data.get("version"), SPEC_VERSION, SPEC_VERSION):
        raise SpecError(f"{where}: version {data.get('version')!r} is not supported (this canzona reads "
                        f"version {SPEC_VERSION})")
    unknown = sorted(set(data) - set(SPEC_FIELDS))
    if unknown:
        raise SpecError(f"{where}: unknown field {unknown[0]!r}; a spec file has {', '.join(SPEC_FIELDS)}")
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        raise SpecError(f"{where}: name must be a non-empty string, got {name!r}")
    params = data.get("params")
    if not isinstance(params, list) or not params:
        raise SpecError(f"{where}: params must be a non-empty list of parameters")
    if len(params) > MAX_PARAMS:
        raise SpecError(f"{where}: {len(params)} parameters is more than the {MAX_PARAMS} a spec may have")
    rows = tuple(_row(raw, i, where) for i, raw in enumerate(params))
    try:
        spec = ModelSpec(name, rows)
        check_whole_stacks(spec)
    except SpecError as e:
        raise SpecError(f"{where}: {e}") from None
    return spec, _architecture_block(data.get("architecture"), where)


def load_spec(path: str | Path) -> ModelSpec:
    """The model of a spec file written by `save_spec` (or by hand)."""
    return spec_from_dict(parse_json(read_text(path, "spec file", SpecError), str(path), SpecError), str(path))[0]


# --- architecture from a spec's parameters ------------------------------------------------------


def _module(name: str) -> str:
    """The module a parameter belongs to: 'model.layers.0.self_attn.q_proj.weight' -> 'q_proj'."""
    parts = name.split(".")
    return parts[-2] if len(parts) > 1 and parts[-1] in ("weight", "bias") else parts[-1]


def infer_sizes(spec: ModelSpec) -> dict[str, int]:
    """The architecture sizes a spec's parameters reveal (docs/design.md §2.5): the token embedding
    (else the head) gives vocab and hidden, layer indices give layers, the first matrix named like a
    query / key / first MLP projection gives q_dim / kv_dim / ffn, a per-head q norm gives head_dim."""
    sizes: dict[str, int] = {}
    tables = [p for p in spec.params if p.role is Role.EMBEDDING and len(p.shape) == 2]
    tables.sort(key=lambda p: (_module(p.name) not in TOKEN_EMBEDDING_NAMES, -p.shape[0]))
    tables += [p for p in spec.params if p.role is Role.HEAD and len(p.shape) == 2]
    if tables:
        sizes["vocab"], sizes["hidden"] = tables[0].shape
    layers = [p.layer for p in spec.params if p.layer is not None]
    if layers:
        sizes["layers"] = max(layers) + 1
    norm = None
    for p in spec.params:
        module = _module(p.name)
        if p.role is Role.MATRIX and len(p.shape) == 2:
            for key, names in (("q_dim", Q_NAMES), ("kv_dim", K_NAMES), ("ffn", FFN_NAMES)):
                if module in names and key not in sizes:
                    sizes[key] = p.shape[0]
        elif module in QK_NORM_NAMES and len(p.shape) == 1 and norm is None:
            norm = p.shape[0]
    stacks = [p for p in spec.params if p.role is Role.EXPERT and len(p.shape) == 3]
    routers = [p for p in spec.params if p.role is Role.ROUTER and len(p.shape) == 2]
    if stacks or routers:  # a router's rows, a stack's first dimension: one per expert
        sizes["experts"] = (stacks or routers)[0].shape[0]
    q_dim = sizes.get("q_dim")
    if norm is not None and q_dim is not None and norm < q_dim and q_dim % norm == 0:
        sizes["head_dim"] = norm  # a per-head norm (Qwen3), not one over all of q (OLMo 2)
    return sizes


def _complete(sizes: dict[str, int], name: str) -> dict[str, int]:
    """Sizes that follow from others (q_dim = q_heads x head_dim, likewise for KV), checked to agree."""
    s = {k: v for k, v in sizes.items() if v is not None}
    for dim, heads in (("q_dim", "q_heads"), ("kv_dim", "kv_heads")):
        if "head_dim" not in s and dim in s and heads in s and s[dim] % s[heads] == 0:
            s["head_dim"] = s[dim] // s[heads]
    for dim, heads in (("q_dim", "q_heads"), ("kv_dim", "kv_heads")):
        hd = s.get("head_dim")
        if dim not in s and heads in s and hd:
            s[dim] = s[heads] * hd
        if heads not in s and dim in s and hd and s[dim] % hd == 0:
            s[heads] = s[dim] // hd
        if dim in s and heads in s and hd and s[heads] * hd != s[dim]:
            raise SpecError(f"model {name!r}: {heads} {s[heads]} x head_dim {hd} is not {dim} {s[dim]}")
    return s


_HOW_TO_ADD = "add it to the \"architecture\" block of the spec file (`canzona spec MODEL --out` writes a template)"
_WHY_UNKNOWN = {
    "layers": "no parameter has a layer index",
    "hidden": "no embedding or head parameter",
    "vocab": "no embedding or head parameter",
    "q_dim": "no matrix is named like q_proj, query or wq (a fused qkv cannot be split); q_dim is heads x "
             "head_dim",
}


def architecture_from_sizes(name: str, sizes: Mapping[str, int]) -> Architecture:
    for key in REQUIRED_ARCHITECTURE:
        if sizes.get(key) is None:
            raise SpecError(f"cannot infer {key!r} of model {name!r} ({_WHY_UNKNOWN[key]}): {_HOW_TO_ADD}")
    return Architecture(name, **{k: sizes.get(k) for k in ARCHITECTURE_FIELDS})


# --- the resolver ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSource:
    """A model as read from a catalog name or a file. `kind`: catalog, hf-config or spec."""

    spec: ModelSpec
    kind: str
    config: DecoderConfig | None = None
    declared: Mapping[str, int] = field(default_factory=dict)  # a spec file's architecture block
    path: str | None = None

    def sizes(self) -> dict[str, int]:
        """Every architecture size known: the config's, else the block's over those inferred."""
        if self.config is not None:
            return self.config.architecture().to_dict()
        return _complete({**infer_sizes(self.spec), **self.declared}, self.spec.name)

    def declared_sizes(self) -> dict[str, int]:
        """The sizes the source states (a config, a spec file's block), which TP must split. Sizes
        inferred from parameters are not checked: the parameters' own `tp_dim`s are."""
        if self.config is not None:
            return self.config.architecture().to_dict()
        return _complete(dict(self.declared), self.spec.name)

    def architecture(self) -> Architecture:
        if self.config is not None:
            return self.config.architecture()  # built from it: the experts agree
        sizes = self.sizes()
        if any(p.role is Role.EXPERT for p in self.spec.params) and sizes.get("experts_per_token") is None:
            raise SpecError(f"model {self.spec.name!r} has experts but its spec does not say how many each token "
                            f"is routed to: give experts_per_token (and experts, if it has no router): {_HOW_TO_ADD}")
        arch = architecture_from_sizes(self.spec.name, sizes)
        check_experts(self.spec, arch.moe)
        deepest = max((p for p in self.spec.params if p.layer is not None), key=lambda p: p.layer, default=None)
        if deepest is not None and deepest.layer >= arch.layers:
            raise SpecError(f"model {self.spec.name!r}: parameter {deepest.name!r} is in layer {deepest.layer}, "
                            f"but the architecture has {arch.layers} layers")
        # and no layer without parameters (a block stating more layers than the parameters fill, or a
        # gap in their indices): the simulator prices each layer's work from its parameters and its
        # activations from the architecture, so an empty layer was priced half, or, alone on a
        # pipeline stage, failed to plan
        filled = {p.layer for p in self.spec.params if p.layer is not None}
        empty = [layer for layer in range(arch.layers) if layer not in filled] if filled else []
        if empty:
            raise SpecError(f"model {self.spec.name!r}: layer {empty[0]} has no parameters, but the architecture has "
                            f"{arch.layers} layers (0..{arch.layers - 1}; {len(empty)} without parameters): give each "
                            "layer's parameters, or the layers the parameters fill")
        return arch


def _looks_like_path(text: str) -> bool:
    return text.endswith(".json") or os.sep in text or "/" in text or os.path.exists(text)


def _config_of_folder(path: Path) -> Path:
    """A Hugging Face model folder's config.json; any other path itself."""
    if os.path.isdir(path) and os.path.isfile(path / "config.json"):
        return path / "config.json"
    return path


def model_file(name_or_path: str | Path) -> Path | None:
    """The file `read_model` reads for `name_or_path` (None for a catalog name): what an output must
    not replace."""
    text = str(name_or_path)
    return None if text.lower() in CATALOG else _config_of_folder(Path(text))


def read_model(name_or_path: str | Path) -> ModelSource:
    """A catalog name (case-insensitive), else a Hugging Face `config.json` (or the model folder that
    holds it) or a canzona spec file."""
    text = str(name_or_path)
    if text.lower() in CATALOG:
        cfg = get_config(text)
        return ModelSource(build_decoder(cfg), "catalog", cfg)
    if not _looks_like_path(text):
        raise SpecError(f"unknown model {text!r}: not one of the catalog's ({', '.join(CATALOG)}) nor a "
                        "file; give a Hugging Face config.json or a canzona spec file")
    path = _config_of_folder(Path(text))
    text = str(path)
    data = parse_json(read_text(path, "model file", SpecError), text, SpecError)
    if isinstance(data, dict) and "schema" in data:
        spec, block = spec_from_dict(data, text)
        return ModelSource(spec, "spec", None, block, text)
    if isinstance(data, dict) and ("model_type" in data or "hidden_size" in data or "architectures" in data):
        cfg = config_from_hf(data, _name_from_file(data, path), text)
        return ModelSource(build_decoder(cfg), "hf-config", cfg, {}, text)
    raise SpecError(f"{text}: neither a Hugging Face config.json (no 'model_type') nor a canzona spec file "
                    f"(no 'schema': {SPEC_SCHEMA!r})")


def _check_tp(source: ModelSource, tp: int) -> None:
    check_tp_sizes(source.spec.name, tp, source.declared_sizes())
    source.spec.check_tp(tp)


def resolve_spec(name_or_path: str | Path, tp: int = 1) -> ModelSpec:
    """The model's spec, after checking that `tp` splits it: the heads, KV heads, ffn and vocabulary
    of a config (or of a spec file's architecture block), and every `tp_dim` dimension of the spec.
    For planning: no architecture is required."""
    source = read_model(name_or_path)
    _check_tp(source, tp)
    return source.spec


def resolve_model(name_or_path: str | Path, tp: int = 1) -> tuple[ModelSpec, Architecture]:
    """The model's spec and architecture (for the simulator), after checking that `tp` splits it."""
    source = read_model(name_or_path)
    _check_tp(source, tp)  # first: the same error whether planning or simulating
    return source.spec, source.architecture()
