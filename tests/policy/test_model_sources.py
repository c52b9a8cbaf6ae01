"""Models from anywhere (docs/design.md §2.5): catalog names, Hugging Face config.json files of dense
decoders, and canzona spec files, through one resolver, in the library and on the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from canzona.catalog import get_config, get_model
from canzona.decoder import Architecture, DecoderConfig, build_decoder
from canzona.errors import SpecError
from canzona.models import (
    infer_sizes,
    load_spec,
    read_model,
    resolve_model,
    resolve_spec,
    save_spec,
    spec_to_dict,
)
from canzona.spec import ModelSpec, ParamSpec, Role
from sim.workload import Workload, forward_flops
from tests.cli_helpers import error_line, invoke

# The config.json files of the Hugging Face model repositories (the fields that shape the model, plus
# a few that do not), written from their published values.
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 128256,
}
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 32000,
}
QWEN2_7B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
    "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
    "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064,
}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "head_dim": 128, "hidden_size": 1024,
    "intermediate_size": 3072, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 151936,
}

# Small CLI runs: a second or two each.
SIM = ["--gpus", "16", "--tp", "2", "--seq-len", "512", "--global-batch", "16"]


def write_json(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def config_file(tmp_path: Path, data: dict, folder: str = "model") -> Path:
    return write_json(tmp_path / folder / "config.json", data)


def dense_count(layers: int, h: int, heads: int, kv: int, head_dim: int, ffn: int, vocab: int, tied: bool,
                qkv_bias: bool = False, qk_norm: bool = False) -> int:
    """Parameters of a Llama-style decoder, written out by hand (not from canzona's builder)."""
    q, k = heads * head_dim, kv * head_dim
    attention = h * q + 2 * h * k + q * h + ((q + 2 * k) if qkv_bias else 0) + (2 * head_dim if qk_norm else 0)
    mlp = 3 * h * ffn
    norms = 2 * h
    return layers * (attention + mlp + norms) + vocab * h * (1 if tied else 2) + h


# --- Hugging Face configs ----------------------------------------------------------------------


def test_qwen3_8b_config_is_exactly_the_catalog_model(tmp_path):
    spec, arch = resolve_model(config_file(tmp_path, QWEN3_8B))
    catalog = get_model("qwen3-8b")
    assert spec.params == catalog.params  # names, order, shapes, roles, layers, TP dims, dtypes
    assert spec.fingerprint() == catalog.fingerprint()
    assert arch == Architecture(spec.name, 36, 4096, 151936, 4096, 1024, 32, 8, 128, 12288)
    assert get_config("qwen3-8b").architecture() == Architecture("qwen3-8b", **arch.to_dict())


def test_llama3_8b_has_8_03b_parameters(tmp_path):
    spec = resolve_spec(config_file(tmp_path, LLAMA3_8B))
    by_hand = dense_count(32, 4096, 32, 8, 128, 14336, 128256, tied=False)
    assert by_hand == 8_030_261_248
    assert spec.numel == by_hand and round(spec.numel / 1e9, 2) == 8.03
    names = [p.name for p in spec.params]
    assert names[-1] == "lm_head.weight" and not any("bias" in n or "q_norm" in n for n in names)
    assert spec.param("model.layers.0.self_attn.k_proj.weight").shape == (1024, 4096)
    assert len(spec.matrix_params()) == 7 * 32


def test_mistral_7b_has_7_24b_parameters(tmp_path):
    spec, arch = resolve_model(config_file(tmp_path, MISTRAL_7B))
    assert spec.numel == dense_count(32, 4096, 32, 8, 128, 14336, 32000, tied=False) == 7_241_732_096
    assert round(spec.numel / 1e9, 2) == 7.24
    assert (arch.vocab, arch.kv_heads, arch.head_dim) == (32000, 8, 128)


def test_an_active_sliding_window_is_read_and_longer_sequences_are_refused(tmp_path):
    """Mistral 7B v0.1 attends to the last 4096 tokens: the simulator, which prices full causal
    attention, simulates up to the window and refuses a longer sequence with one error line (it
    priced full attention over 8192 tokens silently before). Qwen2's and Qwen3's `sliding_window`
    is inert without `use_sliding_window`, and then only on the layers from `max_window_layers`."""
    mistral = config_file(tmp_path, MISTRAL_7B)
    assert resolve_model(mistral)[1].sliding_window == 4096
    assert resolve_model(config_file(tmp_path, {**MISTRAL_7B, "sliding_window": None}, "v2"))[1].sliding_window is None
    assert resolve_model(config_file(tmp_path, QWEN2_7B, "q2"))[1].sliding_window is None
    gated = {**QWEN2_7B, "use_sliding_window": True, "sliding_window": 4096}
    assert resolve_model(config_file(tmp_path, gated, "q2w"))[1].sliding_window is None  # 28 of 28 layers: none
    assert resolve_model(config_file(tmp_path, {**gated, "max_window_layers": 20}, "q2w20"))[1].sliding_window == 4096
    base = ["simulate", "--model", str(mistral), "--gpus", "8", "--tp", "1", "--global-batch", "8"]
    assert invoke(*base, "--seq-len", "4096", "--json").exit_code == 0
    error_line(invoke(*base, "--seq-len", "8192"), "window of 4096 tokens", "--seq-len 8192", "not modelled")
    error_line(invoke("search", "--model", str(mistral), "--gpus", "8", "--seq-len", "8192"), "sliding-window")
    # a spec file keeps the window in its architecture block
    out = tmp_path / "mistral.spec.json"
    assert invoke("spec", str(mistral), "--out", str(out)).exit_code == 0
    assert json.loads(out.read_text())["architecture"]["sliding_window"] == 4096
    assert resolve_model(out)[1].sliding_window == 4096


def test_qwen2_7b_has_qkv_biases_on_adamw(tmp_path):
    spec = resolve_spec(config_file(tmp_path, QWEN2_7B))
    assert spec.numel == dense_count(28, 3584, 28, 4, 128, 18944, 152064, tied=False, qkv_bias=True)
    assert spec.numel == 7_615_616_512 and round(spec.numel / 1e9, 1) == 7.6
    biases = [p for p in spec.params if p.name.endswith(".bias")]
    assert len(biases) == 3 * 28
    assert {p.name.split(".")[-2] for p in biases} == {"q_proj", "k_proj", "v_proj"}
    assert all(not p.uses_matrix_optimizer and len(p.shape) == 1 and p.tp_dim == 0 for p in biases)
    assert spec.param("model.layers.3.self_attn.k_proj.bias").shape == (512,)
    names = [p.name for p in spec.params[:6]]  # forward order: each weight, then its bias
    assert names[2:6] == ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias",
                          "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.bias"]
    assert len(spec.matrix_params()) == 7 * 28


@pytest.mark.parametrize("base", [LLAMA3_8B, QWEN3_8B, QWEN2_7B], ids=["llama", "qwen3", "qwen2"])
def test_tied_and_untied_embeddings(tmp_path, base):
    untied = resolve_spec(config_file(tmp_path, base, "untied"))
    tied = resolve_spec(config_file(tmp_path, {**base, "tie_word_embeddings": True}, "tied"))
    absent = resolve_spec(config_file(tmp_path, {k: v for k, v in base.items() if k != "tie_word_embeddings"},
                                      "absent"))
    assert untied.numel - tied.numel == base["vocab_size"] * base["hidden_size"]
    assert "lm_head.weight" in [p.name for p in untied.params]
    assert "lm_head.weight" not in [p.name for p in tied.params]
    assert absent.params == untied.params  # transformers' default: untied, for all four types


def test_head_dim_override(tmp_path):
    """A Qwen3 config whose head_dim (128) is not hidden / heads (2048 / 32 = 64)."""
    cfg = {**QWEN3_06B, "hidden_size": 2048, "num_attention_heads": 32, "head_dim": 128}
    spec, arch = resolve_model(config_file(tmp_path, cfg))
    assert spec.param("model.layers.0.self_attn.q_proj.weight").shape == (4096, 2048)
    assert spec.param("model.layers.0.self_attn.k_proj.weight").shape == (1024, 2048)
    assert spec.param("model.layers.0.self_attn.o_proj.weight").shape == (2048, 4096)
    assert spec.param("model.layers.0.self_attn.q_norm.weight").shape == (128,)
    assert (arch.q_dim, arch.head_dim, arch.hidden) == (4096, 128, 2048)
    llama = {**LLAMA3_8B, "hidden_size": 2048, "num_attention_heads": 32}
    assert resolve_model(config_file(tmp_path, llama, "l64"))[1].head_dim == 64  # hidden / heads
    assert resolve_model(config_file(tmp_path, {**llama, "head_dim": 128}, "l128"))[1].q_dim == 4096


def test_defaults_of_left_out_fields_are_transformers(tmp_path):
    """num_key_value_heads and head_dim left out take transformers' class defaults for the type."""
    def arch(base: dict, drop: tuple[str, ...], folder: str) -> Architecture:
        return resolve_model(config_file(tmp_path, {k: v for k, v in base.items() if k not in drop}, folder))[1]

    assert arch(LLAMA3_8B, ("num_key_value_heads",), "a").kv_heads == 32  # as many as the heads
    assert arch(MISTRAL_7B, ("num_key_value_heads",), "b").kv_heads == 8
    assert arch({**QWEN3_06B, "num_attention_heads": 32}, ("head_dim",), "d").head_dim == 128
    assert arch({**QWEN3_06B, "num_key_value_heads": None}, (), "e").kv_heads == 16  # null: as many as heads


def test_qwen2_default_kv_heads_is_32_as_in_transformers(tmp_path):
    cfg = {k: v for k, v in QWEN2_7B.items() if k != "num_key_value_heads"}
    cfg["num_attention_heads"] = 32
    cfg["hidden_size"] = 4096
    assert resolve_model(config_file(tmp_path, cfg))[1].kv_heads == 32


def test_bias_flags(tmp_path):
    spec = resolve_spec(config_file(tmp_path, {**LLAMA3_8B, "num_hidden_layers": 2, "attention_bias": True,
                                                "mlp_bias": True}))
    biases = {p.name.split(".")[-2]: p for p in spec.params if p.name.startswith("model.layers.0.")
              and p.name.endswith(".bias")}
    assert set(biases) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    # column-parallel biases split with their rows; row-parallel ones are replicated
    assert {n for n, p in biases.items() if p.tp_dim == 0} == {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    assert biases["o_proj"].tp_dim is None and biases["down_proj"].tp_dim is None
    # Mistral's modelling code reads no bias flag
    mistral = resolve_spec(config_file(tmp_path, {**MISTRAL_7B, "attention_bias": True}, "m"))
    assert not any(p.name.endswith(".bias") for p in mistral.params)


TINY = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 128}


@pytest.mark.parametrize("model_type, extra", [
    ("qwen3", {}), ("qwen3", {"head_dim": 32, "attention_bias": True}), ("qwen2", {"tie_word_embeddings": True}),
    ("llama", {"attention_bias": True, "mlp_bias": True}), ("llama", {"head_dim": 8}), ("mistral", {}),
])
def test_spec_equals_the_transformers_model(tmp_path, model_type, extra):
    """Names and shapes of the model transformers builds from the same config.json (no weights)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    data = {"model_type": model_type, **TINY, **extra}
    path = config_file(tmp_path, data)
    config = transformers.AutoConfig.from_pretrained(path.parent)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    theirs = {n: tuple(p.shape) for n, p in model.named_parameters()}
    spec = resolve_spec(path)
    assert {p.name: p.shape for p in spec.params} == theirs
    assert sorted(p.name for p in spec.params) == sorted(theirs)


def test_config_names_the_model(tmp_path):
    named = resolve_spec(config_file(tmp_path, {**QWEN3_06B, "_name_or_path": "Qwen/Qwen3-0.6B"}, "x"))
    assert named.name == "Qwen/Qwen3-0.6B"
    assert resolve_spec(config_file(tmp_path, QWEN3_06B, "my-model")).name == "my-model"  # the folder
    assert resolve_spec(write_json(tmp_path / "llama3.json", LLAMA3_8B)).name == "llama3"  # the stem
    folder = resolve_spec(tmp_path / "my-model")  # a model folder stands for its config.json
    assert folder.name == "my-model" and folder.params == resolve_spec(tmp_path / "my-model" / "config.json").params


# --- FLOPs ------------------------------------------------------------------------------------


def test_forward_flops_of_qwen3_32b_unchanged():
    """The value the simulator used before models came from anywhere (a `Qwen3Config` and its heads),
    and the same formula written out here."""
    spec, arch = resolve_model("qwen3-32b")
    wl = Workload()
    flops = forward_flops(arch, spec, wl)
    assert flops.total == 279601297227776.0
    assert flops.head == 6372657725440.0 and len(flops.per_layer) == 64
    tokens, h, ffn, q, kv = 4096, 5120, 25600, 64 * 128, 8 * 128
    per_layer = 2.0 * (2 * h * q + 2 * h * kv + 3 * h * ffn) * tokens + 4.0 * 4096 * q * tokens * 0.5
    assert flops.per_layer == (per_layer,) * 64
    assert forward_flops(get_config("qwen3-32b").architecture(), spec, wl) == flops


def test_forward_flops_from_a_spec_file_equal_the_config(tmp_path):
    spec, arch = resolve_model(config_file(tmp_path, LLAMA3_8B))
    path = tmp_path / "llama.json"
    save_spec(spec, path)  # no architecture block: inferred from the parameters
    spec2, arch2 = resolve_model(path)
    assert spec2 == spec
    assert arch2.to_dict() == {"layers": 32, "hidden": 4096, "vocab": 128256, "q_dim": 4096, "kv_dim": 1024,
                               "ffn": 14336}
    wl = Workload(2048)
    assert forward_flops(arch2, spec2, wl) == forward_flops(arch, spec, wl)


# --- spec files ---------------------------------------------------------------------------------


def test_spec_file_round_trip(tmp_path):
    spec, arch = resolve_model("qwen3-0.6b")
    path = tmp_path / "spec.json"
    save_spec(spec, path, arch)
    assert load_spec(path) == spec
    again, arch2 = resolve_model(path)
    assert again == spec and arch2 == arch
    data = json.loads(path.read_text())
    assert (data["schema"], data["version"], data["name"]) == ("canzona.model", 1, "qwen3-0.6b")
    assert data["params"][0] == {"name": "model.embed_tokens.weight", "shape": [151936, 1024], "role": "embedding",
                                 "layer": None, "tp_dim": 0, "dtype": "bf16"}
    assert len(path.read_text().splitlines()) == len(spec.params) + 8  # one line per parameter


def test_spec_file_round_trip_keeps_every_field(tmp_path):
    spec = ModelSpec("odd", (
        ParamSpec("emb", (50, 8), Role.EMBEDDING, None, 0, "fp32"),
        ParamSpec("blocks.0.attn.wq.weight", (8, 8), Role.MATRIX, 0, 1, "fp16"),
        ParamSpec("blocks.0.conv", (4, 2, 3), Role.MATRIX, 0, None, "fp64"),
        ParamSpec("blocks.1.scale", (8,), Role.VECTOR, 1),
        ParamSpec("head", (50, 8), Role.HEAD, None, 0),
    ))
    path = tmp_path / "odd.json"
    save_spec(spec, path)
    assert load_spec(path) == spec
    assert "architecture" not in json.loads(path.read_text())
    assert spec_to_dict(load_spec(path)) == spec_to_dict(spec)


def test_optional_param_fields_default(tmp_path):
    path = write_json(tmp_path / "s.json", {"schema": "canzona.model", "version": 1, "name": "m", "params": [
        {"name": "w", "shape": [4, 4], "role": "matrix"}]})
    assert load_spec(path).params == (ParamSpec("w", (4, 4), Role.MATRIX, None, None, "bf16"),)


def _titan_model():
    """A small torchtitan-style decoder: none of Hugging Face's names."""
    torch = pytest.importorskip("torch")
    from torch import nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wk, self.wv = nn.Linear(64, 64, bias=False), nn.Linear(64, 32, bias=False), \
                nn.Linear(64, 32, bias=False)
            self.wo = nn.Linear(64, 64, bias=False)

    class FeedForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2, self.w3 = nn.Linear(64, 128, bias=False), nn.Linear(128, 64, bias=False), \
                nn.Linear(64, 128, bias=False)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention_norm = nn.RMSNorm(64)
            self.attention = Attention()
            self.ffn_norm = nn.RMSNorm(64)
            self.feed_forward = FeedForward()

    class Titan(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = nn.Embedding(256, 64)
            self.layers = nn.ModuleDict({str(i): Block() for i in range(3)})
            self.norm = nn.RMSNorm(64)
            self.output = nn.Linear(64, 256, bias=False)

    torch.manual_seed(0)
    return Titan()


def test_from_module_spec_is_saved_loaded_and_simulated(tmp_path):
    from sim.simulate import SimConfig, simulate

    spec = ModelSpec.from_module(_titan_model(), name="titan-small")
    path = tmp_path / "titan.json"
    save_spec(spec, path)
    assert load_spec(path) == spec
    loaded, arch = resolve_model(path)
    assert arch == Architecture("titan-small", layers=3, hidden=64, vocab=256, q_dim=64, kv_dim=32, ffn=128)
    assert [p.role for p in loaded.params if p.name in ("tok_embeddings.weight", "output.weight")] == \
        [Role.EMBEDDING, Role.HEAD]
    result = simulate(SimConfig(model=str(path), gpus=8, tp=1, workload=Workload(128, 8)))
    assert result.iteration_time_s > result.optimizer_step_s > 0
    assert result.to_dict()["model"] == "titan-small"
    flops = forward_flops(arch, loaded, Workload(128, 8))
    assert len(flops.per_layer) == 3 and flops.head == 2.0 * 64 * 256 * 128


def test_a_0d_scalar_parameter_is_saved_loaded_planned_and_simulated(tmp_path):
    """A 0-d parameter (CLIP's logit_scale, a ReZero gate) is one element AdamW steps: `"shape": []`
    in a spec file, in the fingerprint, planned, and in the simulator's memory and time."""
    from sim.simulate import SimConfig, simulate

    base, arch = resolve_model("qwen3-0.6b")
    spec = ModelSpec(base.name, (*base.params, ParamSpec("logit_scale", (), Role.VECTOR),
                                 ParamSpec("model.layers.3.gate", (), Role.VECTOR, 3)))
    path = tmp_path / "scalars.json"
    save_spec(spec, path, arch)
    assert json.loads(path.read_text())["params"][-1]["shape"] == []
    loaded, loaded_arch = resolve_model(path)
    assert loaded == spec and loaded_arch == arch and loaded.fingerprint(2) != base.fingerprint(2)
    assert loaded.numel == base.numel + 2 and {"logit_scale", "model.layers.3.gate"} <= \
        {p.name for p in loaded.adamw_params()}
    assert invoke("plan", "--model", path, "--dp", "4", "--tp", "2", "--json").exit_code == 0
    assert invoke("simulate", "--model", path, "--fsdp", *SIM).exit_code == 0  # FSDP2's pricing too
    runs = [simulate(SimConfig(model=m, gpus=16, tp=2, workload=Workload(512, 16))) for m in (str(path), "qwen3-0.6b")]
    assert runs[0].iteration_time_s > 0 and runs[0].memory.worst.total >= runs[1].memory.worst.total
    with pytest.raises(SpecError, match="tp_dim 0 is outside shape"):
        ParamSpec("logit_scale", (), Role.VECTOR, None, 0)  # a scalar is never split: replicated
    row = spec_to_dict(spec)["params"][-1] | {"tp_dim": 0}
    bad = write_json(tmp_path / "bad.json", {"schema": "canzona.model", "version": 1, "name": "m", "params": [row]})
    with pytest.raises(SpecError, match=r"tp_dim must be null or a dimension of shape \[\]"):
        load_spec(bad)


@pytest.mark.parametrize("role", [r for r in Role if r is not Role.VECTOR])
def test_a_0d_scalar_of_another_role_than_vector_is_one_error(role, tmp_path):
    """An expert's or a router's count is its first dimension (`canzona.experts`): a spec file's 0-d
    router was an IndexError there; a 0-d embedding, head or matrix passed as AdamW's unnoticed."""
    row = {"name": "model.layers.0.mlp.router_scale", "shape": [], "role": role.value, "layer": 0}
    bad = write_json(tmp_path / "bad.json", {"schema": "canzona.model", "version": 1, "name": "m", "params": [row]})
    with pytest.raises(SpecError, match=f"a 0-d scalar is a vector \\(stepped by AdamW\\), not {role.value}"):
        load_spec(bad)


def test_architecture_block_fills_and_overrides_inference(tmp_path):
    spec = get_model("qwen3-0.6b")
    sizes = infer_sizes(spec)
    assert sizes == {"vocab": 151936, "hidden": 1024, "layers": 28, "q_dim": 2048, "kv_dim": 1024, "ffn": 3072,
                     "head_dim": 128}
    path = tmp_path / "s.json"
    save_spec(spec, path)
    # heads from the q/k norms' head_dim
    assert resolve_model(path)[1] == Architecture("qwen3-0.6b", 28, 1024, 151936, 2048, 1024, 16, 8, 128, 3072)
    # a block gives what names cannot: heads from q_dim and head_dim, q_dim from heads x head_dim
    data = spec_to_dict(ModelSpec("fused", (
        ParamSpec("embed.weight", (100, 32), Role.EMBEDDING, None, 0),
        ParamSpec("layers.0.qkv.weight", (96, 32), Role.MATRIX, 0, 0),
        ParamSpec("layers.0.proj.weight", (32, 32), Role.MATRIX, 0, 1),
    )), {"q_heads": 4, "head_dim": 8})
    _, arch = resolve_model(write_json(tmp_path / "fused.json", data))
    assert (arch.q_dim, arch.q_heads, arch.layers, arch.vocab, arch.kv_dim) == (32, 4, 1, 100, None)
    with pytest.raises(SpecError, match="does not give 'kv_heads'.*architecture"):
        arch.require("kv_heads")


def test_plan_needs_no_architecture_but_simulate_does(tmp_path):
    data = spec_to_dict(ModelSpec("mlp", (ParamSpec("layers.0.fc.weight", (64, 64), Role.MATRIX, 0),
                                          ParamSpec("layers.1.fc.weight", (64, 64), Role.MATRIX, 1))))
    path = write_json(tmp_path / "mlp.json", data)
    assert resolve_spec(path).numel == 2 * 64 * 64
    with pytest.raises(SpecError, match=r"cannot infer 'hidden' of model 'mlp' \(no embedding or head"):
        resolve_model(path)
    assert invoke("plan", "--model", path, "--dp", "2", "--tp", "1", "--json").exit_code == 0


def test_catalog_names_stay_case_insensitive_and_win_over_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_json(tmp_path / "qwen3-0.6b", LLAMA3_8B)
    assert resolve_spec("Qwen3-0.6B") == get_model("qwen3-0.6b")
    assert read_model("qwen3-0.6b").kind == "catalog"


def test_decoder_config_validates():
    with pytest.raises(SpecError, match="layers must be a whole number"):
        DecoderConfig("x", 0, 64, 4, 2, 16, 128, 256, True)
    with pytest.raises(SpecError, match="unknown family"):
        DecoderConfig("x", 1, 64, 4, 2, 16, 128, 256, True, family="gpt2")
    assert build_decoder(DecoderConfig("x", 1, 64, 4, 2, 16, 128, 256, True)).numel == dense_count(
        1, 64, 4, 2, 16, 128, 256, tied=True)


# --- command line -------------------------------------------------------------------------------


@pytest.fixture
def qwen3_config(tmp_path) -> Path:
    return config_file(tmp_path, QWEN3_06B, "Qwen3-0.6B")


def test_simulate_accepts_a_config_and_names_the_model(qwen3_config):
    result = invoke("simulate", "--model", qwen3_config, *SIM, "--json")
    assert result.exit_code == 0, result.stderr
    d = json.loads(result.stdout)
    assert d["model"] == "Qwen3-0.6B" and d["model_source"] == str(qwen3_config)
    catalog = json.loads(invoke("simulate", "--model", "qwen3-0.6b", *SIM, "--json").stdout)
    assert d["iteration_time_s"] == catalog["iteration_time_s"]  # the same model
    assert d["optimizer_step_s"] == catalog["optimizer_step_s"]
    table = invoke("simulate", "--model", qwen3_config, *SIM)
    assert table.exit_code == 0 and "Qwen3-0.6B on 16" in table.stdout


def test_compare_accepts_a_spec_file(tmp_path, qwen3_config):
    path = tmp_path / "spec.json"
    result = invoke("spec", qwen3_config, "--out", path)
    assert result.exit_code == 0, result.stderr
    assert "spec written to" in result.stdout and "596,049,920" in result.stdout
    rows = invoke("compare", "--model", path, *SIM, "--json")
    assert rows.exit_code == 0, rows.stderr
    rows = json.loads(rows.stdout)
    assert len(rows) == 5 and {r["model"] for r in rows} == {"Qwen3-0.6B"}
    assert {r["model_source"] for r in rows} == {str(path)}


def test_plan_out_then_inspect_round_trips_with_a_config(tmp_path, qwen3_config):
    plan = tmp_path / "plan.json"
    result = invoke("plan", "--model", qwen3_config, "--dp", "4", "--tp", "2", "--out", plan, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["model"] == "Qwen3-0.6B"
    for model in (qwen3_config, "qwen3-0.6b"):  # the same model, whatever its source
        ok = invoke("inspect", plan, "--model", model, "--dp", "4", "--tp", "2")
        assert ok.exit_code == 0, ok.stderr
        assert "valid plan" in ok.stdout
    other = config_file(tmp_path, {**QWEN3_06B, "intermediate_size": 4096}, "other")
    error_line(invoke("inspect", plan, "--model", other), "plan was made for model 'Qwen3-0.6B'")


def test_plan_and_inspect_accept_a_spec_file(tmp_path):
    spec = tmp_path / "spec.json"
    assert invoke("spec", "qwen3-0.6b", "--out", spec).exit_code == 0
    plan = tmp_path / "plan.json"
    assert invoke("plan", "--model", spec, "--dp", "4", "--tp", "2", "--out", plan, "--json").exit_code == 0
    result = invoke("inspect", plan, "--model", spec, "--dp", "4", "--tp", "2", "--json")
    assert result.exit_code == 0, result.stderr


def test_spec_command_json_and_unknown_architecture(tmp_path):
    result = invoke("spec", "qwen3-0.6b", "--json")
    assert result.exit_code == 0, result.stderr
    d = json.loads(result.stdout)
    assert d["schema"] == "canzona.model" and d["architecture"]["q_heads"] == 16
    assert len(result.stdout.strip().splitlines()) == 1
    mlp = write_json(tmp_path / "mlp.json", spec_to_dict(ModelSpec("mlp", (
        ParamSpec("layers.0.fc.weight", (64, 64), Role.MATRIX, 0),))))
    table = invoke("spec", mlp)
    assert table.exit_code == 0, table.stderr
    assert "unknown" in table.stdout and "cannot infer" in " ".join(table.stdout.split())


def test_tp_checks_stated_sizes_and_split_parameters_only(tmp_path):
    """A spec file's inferred sizes are not TP-checked (a replicated embedding need not split); the
    parameters' tp_dims and the architecture block are."""
    rows = (ParamSpec("wte.weight", (1001, 64), Role.EMBEDDING, None, None),
            ParamSpec("h.0.attn.q_proj.weight", (64, 64), Role.MATRIX, 0, 0),
            ParamSpec("h.0.attn.q_norm.weight", (64,), Role.VECTOR, 0))  # a norm over all of q: no heads
    path = write_json(tmp_path / "s.json", spec_to_dict(ModelSpec("s", rows)))
    spec, arch = resolve_model(path, tp=2)
    assert (arch.vocab, arch.q_dim, arch.head_dim, arch.q_heads) == (1001, 64, None, None)
    with pytest.raises(SpecError, match="tp=3 does not divide dimension 0 \\(64\\)"):
        resolve_spec(path, tp=3)
    stated = write_json(tmp_path / "t.json", spec_to_dict(ModelSpec("s", rows), {"vocab": 1001}))
    with pytest.raises(SpecError, match="tp=2 does not divide the 1001 vocabulary of s"):
        resolve_spec(stated, tp=2)
