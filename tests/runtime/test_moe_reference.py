"""Experts as matrices in the single-device references and in `ModelSpec.from_module` (issue 20):
a stacked expert tensor trains exactly as one linear per expert, for every matrix optimizer, and
transformers' own mixture-of-experts models read as canzona builds them from their configs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from canzona.decoder import build_decoder
from canzona.errors import SpecError
from canzona.models import config_from_hf
from canzona.optimizers import MATRIX_REGISTRY
from canzona.runtime.modules import named_parameters
from canzona.spec import ModelSpec, Role
from reference.combined import CombinedOptimizer
from reference.tiny_moe import TinyMoe, TinyMoeConfig, expert_matrices

MATRIX_OPTIMIZERS = [name for name, entry in MATRIX_REGISTRY.items() if not entry.elementwise]
CFG = TinyMoeConfig()


def _train(model: TinyMoe, optimizer: str, steps: int = 3, **spec_options) -> TinyMoe:
    spec = ModelSpec.from_module(model, **spec_options)
    opt = CombinedOptimizer(named_parameters(model), spec, optimizer)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, CFG.vocab, (4, 6), generator=gen)
        logits = model(ids[:, :-1])
        F.cross_entropy(logits.reshape(-1, CFG.vocab), ids[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    return model


def test_the_two_storages_are_one_model():
    stacked, linears = TinyMoe(stacked=True), TinyMoe(stacked=False)
    ids = torch.randint(0, CFG.vocab, (2, 5), generator=torch.Generator().manual_seed(0))
    assert torch.equal(stacked(ids), linears(ids))
    a, b = expert_matrices(stacked), expert_matrices(linears)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_from_module_reads_experts_and_routers():
    stacked = ModelSpec.from_module(TinyMoe(stacked=True))
    gate_up = stacked.param("model.layers.0.mlp.experts.gate_up_proj")
    assert (gate_up.role, gate_up.matrix_shape) == (Role.EXPERT, (CFG.ffn, CFG.hidden))
    assert stacked.param("model.layers.1.mlp.experts.down_proj").matrix_shape == (CFG.hidden, CFG.ffn)
    assert stacked.param("model.layers.0.mlp.gate.weight").role is Role.ROUTER
    assert len([p for p in stacked.matrix_params() if p.stacked_in]) == CFG.layers * CFG.experts * 3
    linears = ModelSpec.from_module(TinyMoe(stacked=False))
    one = linears.param("model.layers.0.mlp.experts.3.up_proj.weight")
    assert (one.role, one.matrix_shape) == (Role.EXPERT, None)
    assert {p.numel for p in stacked.matrix_params()} == {p.numel for p in linears.matrix_params()}
    fused = ModelSpec.from_module(TinyMoe(stacked=True), split_fc1=False, router_optimizer="matrix")
    assert fused.param("model.layers.0.mlp.experts.gate_up_proj").matrix_shape == (2 * CFG.ffn, CFG.hidden)
    assert fused.param("model.layers.0.mlp.gate.weight").role is Role.MATRIX
    with pytest.raises(SpecError, match="router_optimizer must be one of"):
        ModelSpec.from_module(TinyMoe(), router_optimizer="sgd")


@pytest.mark.parametrize("optimizer", MATRIX_OPTIMIZERS)
def test_a_stack_trains_bit_for_bit_as_one_linear_per_expert(optimizer):
    stacked = _train(TinyMoe(stacked=True), optimizer)
    linears = _train(TinyMoe(stacked=False), optimizer)
    a, b = expert_matrices(stacked), expert_matrices(linears)
    assert all(torch.equal(a[k], b[k]) for k in a), optimizer
    assert not torch.equal(a[(0, 0, "gate")], expert_matrices(TinyMoe())[(0, 0, "gate")])  # it trained
    for name in ("model.layers.0.mlp.gate.weight", "lm_head.weight", "model.norm.weight"):
        assert torch.equal(dict(stacked.named_parameters())[name], dict(linears.named_parameters())[name])


def test_a_fused_gate_up_is_another_optimizer_step():
    split = expert_matrices(_train(TinyMoe(stacked=True), "muon"))
    fused = expert_matrices(_train(TinyMoe(stacked=True), "muon", split_fc1=False))
    assert not torch.equal(split[(0, 1, "gate")], fused[(0, 1, "gate")])


def test_zero_grad_clears_the_stacks_and_their_matrices():
    model = TinyMoe()
    opt = CombinedOptimizer(named_parameters(model), ModelSpec.from_module(model), "muon")
    model(torch.zeros(1, 3, dtype=torch.long)).sum().backward()
    opt.step()
    opt.zero_grad()
    stack = model.model.layers[0].mlp.experts.gate_up_proj
    assert stack.grad is None and all(v.grad is None for s, views in opt.stacks for v in views)


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_transformers_moe_models_read_as_canzona_builds_their_configs(kind):
    common = dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=128, num_experts_per_tok=2)
    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                                             num_experts=6, mlp_only_layers=[1])
    else:
        config = transformers.MixtralConfig(**common, intermediate_size=48, num_local_experts=4)
    model = transformers.AutoModelForCausalLM.from_config(config)
    read = ModelSpec.from_module(model)
    built = build_decoder(config_from_hf(config.to_dict(), "built"))

    def rows(spec):  # a module is read unsharded: TP dims are the plan's business, not compared
        return sorted((p.name, p.shape, p.role, p.matrix_shape, p.layer) for p in spec.params)

    assert rows(read) == rows(built)
    # the runtime trains such a model: tests/runtime/test_runtime_stacked_experts.py


def test_expert_layouts_canzona_does_not_know_are_refused_or_routed_safely():
    from torch import nn

    class Experts(nn.Module):  # Llama 4 / GPT-OSS: [experts, hidden, 2 x ffn], biases stacked
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(4, 16, 16))
            self.gate_up_proj_bias = nn.Parameter(torch.zeros(4, 16))
            self.down_proj = nn.Parameter(torch.zeros(4, 8, 16))

    class Moe(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = nn.Linear(16, 4, bias=False)
            self.shared_expert_gate = nn.Linear(16, 1, bias=False)
            self.experts = Experts()

    with pytest.raises(SpecError, match="cannot be split: give split_fc1=False"):
        ModelSpec.from_module(Moe())
    spec = ModelSpec.from_module(Moe(), split_fc1=False)
    assert spec.param("experts.gate_up_proj").matrix_shape == (16, 16)
    assert spec.param("experts.gate_up_proj_bias").role is Role.VECTOR  # one bias per expert: AdamW
    assert spec.param("shared_expert_gate.weight").role is Role.VECTOR  # one row: not a router of the experts
    assert {p.name for p in spec.adamw_params()} >= {"experts.gate_up_proj_bias", "router.weight",
                                                      "shared_expert_gate.weight"}
    # the spec agrees with an architecture of 4 experts (the router's rows)
    from canzona.experts import check_experts

    check_experts(spec, (4, 2))
    # a frozen down_proj still shows the layout; a 2-D weight on the experts module is not guessed
    model = Moe()
    model.experts.down_proj.requires_grad_(False)
    with pytest.raises(SpecError, match="cannot be split"):
        ModelSpec.from_module(model)
    model = Moe()
    model.experts.weight1 = nn.Parameter(torch.zeros(16, 4 * 8))  # Megatron's legacy GroupedMLP
    with pytest.raises(SpecError, match="does not know how its experts' matrices lie in it"):
        ModelSpec.from_module(model, split_fc1=False)
