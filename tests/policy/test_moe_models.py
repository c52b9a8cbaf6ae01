"""Mixture-of-experts models (issue 20, models and planning at expert parallelism 1): the catalog's
Qwen3-MoE models and Hugging Face qwen3_moe / mixtral configs against transformers' own modules,
experts as matrices (a stacked expert tensor is that many matrices, never one), routers on AdamW
unless asked, DeepSeek-style layouts through spec files, plans and FLOPs of such models."""

from __future__ import annotations

import json
import math

import pytest

from canzona.catalog import QWEN3_MOE, get_config
from canzona.decoder import DecoderConfig, build_decoder
from canzona.errors import SpecError
from canzona.models import read_model, resolve_model, save_spec, spec_from_dict, spec_to_dict
from canzona.plan import load_plan, make_plan
from canzona.spec import ModelSpec, ParamSpec, Role
from sim.workload import Workload, forward_flops

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


def _meta_params(config) -> dict[str, tuple[int, ...]]:
    """Every parameter of transformers' model for `config`, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def _hf_config(cfg: DecoderConfig):
    """transformers' config of a catalog MoE model, written from the catalog's fields."""
    return transformers.Qwen3MoeConfig(
        num_hidden_layers=cfg.layers, hidden_size=cfg.hidden, num_attention_heads=cfg.q_heads,
        num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim, intermediate_size=cfg.ffn,
        moe_intermediate_size=cfg.moe_ffn, num_experts=cfg.experts, num_experts_per_tok=cfg.experts_per_token,
        vocab_size=cfg.vocab, tie_word_embeddings=cfg.tied_embeddings)


def _spec_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    return {p.name: p.shape for p in spec.params}


def _active(spec: ModelSpec, cfg: DecoderConfig) -> float:
    """Parameters one token uses: experts at experts_per_token / experts."""
    return sum(p.numel * (cfg.experts_per_token / cfg.experts if p.role is Role.EXPERT else 1) for p in spec.params)


@pytest.mark.parametrize("name", list(QWEN3_MOE))
def test_catalog_moe_models_are_transformers_modules_and_their_published_sizes(name):
    cfg = get_config(name)
    spec = build_decoder(cfg)
    assert _spec_shapes(spec) == _meta_params(_hf_config(cfg))
    assert spec.numel == pytest.approx(cfg.official_params, rel=0.01)
    assert _active(spec, cfg) == pytest.approx(cfg.official_active_params, rel=0.05)


def test_qwen3_30b_a3b_has_the_published_shape():
    cfg = get_config("qwen3-30b-a3b")
    assert (cfg.layers, cfg.hidden, cfg.q_heads, cfg.kv_heads, cfg.head_dim, cfg.experts, cfg.experts_per_token,
            cfg.moe_ffn, cfg.vocab, cfg.tied_embeddings) == (48, 2048, 32, 4, 128, 128, 8, 768, 151936, False)
    assert not cfg.dense_layers


def test_a_stacked_expert_tensor_is_that_many_matrices_never_one():
    spec = build_decoder(get_config("qwen3-30b-a3b"))
    layer0 = "model.layers.0.mlp.experts"
    gate_up, down = spec.param(f"{layer0}.gate_up_proj"), spec.param(f"{layer0}.down_proj")
    assert gate_up.shape == (128, 1536, 2048) and gate_up.matrix_shape == (768, 2048)
    matrices = {p.name: p for p in spec.matrix_params()}
    assert gate_up.name not in matrices and down.name not in matrices
    # split FC1 (the default): gate and up of every expert are two matrices, in memory order
    assert [matrices[f"{layer0}.gate_up_proj[{k}]"].shape for k in range(256)] == [(768, 2048)] * 256
    assert f"{layer0}.gate_up_proj[256]" not in matrices
    assert [matrices[f"{layer0}.down_proj[{k}]"].shape for k in range(128)] == [(2048, 768)] * 128
    assert matrices[f"{layer0}.down_proj[5]"].stacked_in == (down.name, 5)
    assert spec.param(f"{layer0}.down_proj[5]").role is Role.EXPERT
    # every element of the stacks is in exactly one matrix
    stacked = sum(p.numel for p in spec.stacks)
    assert sum(p.numel for p in spec.matrix_params() if p.stacked_in) == stacked
    # the router is AdamW's by default
    assert "model.layers.0.mlp.gate.weight" in {p.name for p in spec.adamw_params()}
    assert len(spec.matrix_params()) == 48 * (4 + 2 * 128 + 128)


def test_fused_gate_up_as_one_matrix_and_routers_on_the_matrix_optimizer_are_choices():
    base = get_config("qwen3-30b-a3b")
    fused = build_decoder(DecoderConfig(**{**base.__dict__, "split_fc1": False, "router_optimizer": "matrix"}))
    matrices = {p.name: p for p in fused.matrix_params()}
    assert matrices["model.layers.3.mlp.experts.gate_up_proj[127]"].shape == (1536, 2048)
    assert "model.layers.3.mlp.experts.gate_up_proj[128]" not in matrices
    assert matrices["model.layers.3.mlp.gate.weight"].role is Role.MATRIX
    # the choice is part of the model a plan is for
    assert fused.fingerprint() != build_decoder(base).fingerprint()
    with pytest.raises(SpecError, match="router_optimizer must be one of"):
        DecoderConfig(**{**base.__dict__, "router_optimizer": "sgd"})


def _tiny_hf(model_type: str, **extra) -> dict:
    common = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=128, num_experts_per_tok=2)
    if model_type == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                                           num_experts=6, **extra).to_dict()
    return transformers.MixtralConfig(**common, intermediate_size=48, num_local_experts=4, **extra).to_dict()


@pytest.mark.parametrize("model_type, extra", [
    ("qwen3_moe", {}),
    ("qwen3_moe", {"mlp_only_layers": [1], "decoder_sparse_step": 2}),  # dense layers 0, 1 and 2
    ("mixtral", {}),
])
def test_hugging_face_moe_configs_read_as_transformers_builds_them(tmp_path, model_type, extra):
    data = _tiny_hf(model_type, **extra)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    source = read_model(path)
    assert source.kind == "hf-config"
    config_cls = {"qwen3_moe": transformers.Qwen3MoeConfig, "mixtral": transformers.MixtralConfig}[model_type]
    assert _spec_shapes(source.spec) == _meta_params(config_cls(**data))
    if extra:
        assert source.config.dense_layers == (0, 1, 2)
    arch = source.architecture()
    assert arch.moe == (data.get("num_experts") or data["num_local_experts"], 2)


def _deepseek_style() -> DecoderConfig:
    """A DeepSeek-V3-like layout: a first dense layer, a shared expert beside the routed ones."""
    return DecoderConfig("tiny-deepseek", 3, 64, 4, 4, 16, 128, 256, False, experts=8, experts_per_token=2,
                         moe_ffn=32, shared_ffn=32, dense_layers=(0,))


def test_a_deepseek_style_layout_through_a_spec_file(tmp_path):
    cfg = _deepseek_style()
    spec = build_decoder(cfg)
    path = tmp_path / "deepseek.json"
    save_spec(spec, path, cfg.architecture())
    text = path.read_text()
    assert text.count('"matrix_shape"') == 4  # the two stacks of each of the two MoE layers, nothing else
    loaded, arch = resolve_model(str(path))
    assert loaded.fingerprint() == spec.fingerprint()
    assert arch.moe == (8, 2)
    names = {p.name for p in loaded.matrix_params()}
    assert "model.layers.0.mlp.gate_proj.weight" in names  # the dense first layer
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in names
    assert "model.layers.2.mlp.experts.down_proj[7]" in names
    plan = make_plan(loaded, 2, 2, "muon")
    owners = plan.dp_plan.owners()
    assert {n for n in owners} == names  # every matrix, each expert's whole, owned once
    out = tmp_path / "plan.json"
    plan.save(out)
    assert load_plan(out, loaded).dp_plan.owners() == owners


def test_a_spec_file_with_experts_must_say_how_many_each_token_uses(tmp_path):
    cfg = _deepseek_style()
    path = tmp_path / "no-top-k.json"
    save_spec(build_decoder(cfg), path)  # no architecture block
    with pytest.raises(SpecError, match="experts_per_token"):
        resolve_model(str(path))
    doc = json.loads(path.read_text())
    doc["architecture"] = {"experts_per_token": 2}  # the experts come from the router
    path.write_text(json.dumps(doc))
    assert resolve_model(str(path))[1].moe == (8, 2)


@pytest.mark.parametrize("row, needle", [
    ({"shape": [4, 6, 8], "matrix_shape": [4, 6]}, "needs a shape of 3 or more dimensions ending in"),
    ({"shape": [4, 6, 8], "matrix_shape": [4, 8]}, "needs a shape of 3 or more dimensions ending in"),
    ({"shape": [6, 8], "matrix_shape": [6, 8]}, "needs a shape of 3 or more dimensions"),
    ({"shape": [4, 6, 8], "matrix_shape": [6]}, "matrix_shape must be null or a list of two"),
    ({"shape": [4, 6, 8], "matrix_shape": "6x8"}, "matrix_shape must be null or a list of two"),
    ({"shape": [4, 6, 8], "matrix_shape": [6, 8], "role": "vector"}, "only expert parameters stack"),
    ({"shape": [4, 6, 8], "matrix_shape": [6, 8], "role": "matrix"}, "only expert parameters stack"),
    ({"shape": [4, 6, 8]}, "must give matrix_shape"),
    ({"shape": [4, 6, 8], "matrix_shape": [6, 8], "tp_dim": 1}, "cannot be split by TP"),
    ({"name": "w[0]", "shape": [6, 8]}, "names the matrices of a stack"),
])
def test_bad_stacks_in_a_spec_file_are_one_error(row, needle):
    param = {"name": "w", "role": "expert", **row}
    doc = {"schema": "canzona.model", "version": 1, "name": "bad", "params": [param]}
    with pytest.raises(SpecError, match=needle):
        spec_from_dict(doc, "bad.json")


def test_dense_specs_write_and_fingerprint_as_before():
    spec = build_decoder(get_config("qwen3-0.6b"))
    assert all("matrix_shape" not in row for row in spec_to_dict(spec)["params"])
    assert not spec.stacks and len(spec.matrix_params()) == 196


def test_forward_flops_count_the_active_experts():
    cfg = _deepseek_style()
    spec, arch = build_decoder(cfg), cfg.architecture()
    wl = Workload(seq_len=64, global_batch=8)
    tokens = wl.tokens_per_micro_batch
    flops = forward_flops(arch, spec, wl)
    attention = 4.0 * 64 * arch.q_dim * tokens * 0.5
    for layer in range(cfg.layers):
        weights = sum(p.numel * (2 / 8 if p.role is Role.EXPERT else 1) for p in spec.params
                      if p.layer == layer and (len(p.shape) == 2 or p.matrix_shape) and
                      p.role in (Role.MATRIX, Role.EXPERT, Role.ROUTER))
        assert math.isclose(flops.per_layer[layer], 2 * weights * tokens + attention)
    # a MoE layer computes less than its parameters would at full density
    dense = sum(p.numel for p in spec.params if p.layer == 1 and len(p.shape) >= 2)
    assert flops.per_layer[1] < 2 * dense * tokens + attention


def test_every_expert_matrix_is_planned_whole_on_one_rank():
    spec = build_decoder(_deepseek_style())
    plan = make_plan(spec, 4, 1, "muon")
    placed = [p for b in plan.dp_plan.buckets for p in b.params]
    expert = [p for p in placed if "[" in p.name]
    assert len(expert) == 2 * (2 * 8 + 8)
    for p in expert:
        assert p.numel == math.prod(spec.param(p.name).shape)
    assert all(len(plan.dp_plan.computing_ranks(b, p)) == 1 for b in plan.dp_plan.buckets for p in b.params)


def test_a_parameter_spec_stack_is_checked_where_it_is_made():
    with pytest.raises(SpecError, match="matrix_shape must be two positive whole numbers"):
        ParamSpec("w", (2, 4, 4), Role.EXPERT, matrix_shape=(0, 4))
    assert ParamSpec("w", (2, 4, 4), Role.EXPERT, matrix_shape=(2, 4)).stack_size == 4

