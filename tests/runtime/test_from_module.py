"""`ModelSpec.from_module`: specs read from live modules (canzona/runtime/modules.py).

Hugging Face Qwen3 (random init, no download) against the catalog layout, torchtitan- and
Megatron-style toys for the naming conventions, wrappers, frozen and odd parameters, the
order-free fingerprint, `describe_difference`, `order`, `tp_plan` and plans made from such specs.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

from canzona.catalog import build_qwen3, get_model
from canzona.errors import PlanError, SpecError
from canzona.plan import check_plan_matches, make_plan
from canzona.runtime.modules import backward_order, canonical_name, named_parameters
from canzona.spec import ModelSpec, ParamSpec, Role
from reference.tiny_model import TinyQwen3, get_preset, model_spec

# The catalog's TP dims (docs/design.md §2.3) over Hugging Face names; the head only when untied,
# since a pattern that matches nothing is an error.
QWEN3_TP_PLAN = {
    "*.q_proj.weight": 0, "*.k_proj.weight": 0, "*.v_proj.weight": 0,
    "*.gate_proj.weight": 0, "*.up_proj.weight": 0,
    "*.o_proj.weight": 1, "*.down_proj.weight": 1,
    "model.embed_tokens.weight": 0,
}
MATRIX_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def qwen3_tp_plan(tied: bool) -> dict[str, int]:
    return QWEN3_TP_PLAN if tied else {**QWEN3_TP_PLAN, "lm_head.weight": 0}


def tiny_preset(tied: bool) -> str:
    return "tiny" if tied else "tiny-untied"


def one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


# --- Hugging Face Qwen3 ---------------------------------------------------------------------


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def hf_qwen3(request) -> nn.Module:
    """The shape of the "tiny" / "tiny-untied" presets, as a transformers Qwen3ForCausalLM."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=request.param)
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(cfg)


def is_tied(model: nn.Module) -> bool:
    return model.config.tie_word_embeddings


def hf_loss(tokens: torch.Tensor):
    return lambda model: model(tokens, labels=tokens).loss


def test_hf_qwen3_spec_is_the_catalog_layout(hf_qwen3):
    tied = is_tied(hf_qwen3)
    spec = ModelSpec.from_module(hf_qwen3, tp_plan=qwen3_tp_plan(tied))
    catalog = model_spec(get_preset(tiny_preset(tied)))  # built by canzona.catalog, fp32
    assert spec.fingerprint() == catalog.fingerprint()
    assert set(spec.params) == set(catalog.params)  # names, shapes, roles, layers, TP dims, dtypes
    assert spec.describe_difference(catalog).startswith("same parameters in another order")
    assert spec.name == "qwen3"


def test_hf_qwen3_routing(hf_qwen3):
    spec = ModelSpec.from_module(hf_qwen3)
    matrices = {p.name for p in spec.matrix_params()}
    assert matrices == {
        f"model.layers.{i}.{'mlp' if s in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{s}.weight"
        for i in range(2) for s in MATRIX_SUFFIXES
    }
    adamw = {p.name for p in spec.adamw_params()}
    for i in range(2):
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            assert f"model.layers.{i}.{norm}.weight" in adamw
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= adamw
    assert ("lm_head.weight" in adamw) == (not is_tied(hf_qwen3))
    assert len(adamw) + len(matrices) == len(spec.params)


def test_hf_qwen3_embedding_once_and_head_role(hf_qwen3):
    spec = ModelSpec.from_module(hf_qwen3)
    roles = {p.name: p.role for p in spec.params}
    assert roles["model.embed_tokens.weight"] is Role.EMBEDDING
    assert [n for n, r in roles.items() if r is Role.EMBEDDING] == ["model.embed_tokens.weight"]
    if is_tied(hf_qwen3):
        assert "lm_head.weight" not in roles and Role.HEAD not in roles.values()
    else:
        assert roles["lm_head.weight"] is Role.HEAD
    assert spec.param("model.layers.1.self_attn.q_norm.weight").layer == 1
    assert spec.param("model.norm.weight").layer is None


def test_hf_qwen3_without_tp_plan_differs_in_tp_dims(hf_qwen3):
    spec = ModelSpec.from_module(hf_qwen3)
    catalog = model_spec(get_preset(tiny_preset(is_tied(hf_qwen3))))
    assert spec.fingerprint() != catalog.fingerprint()
    assert "tp_dim None in 'qwen3' but 0 in 'tiny" in spec.describe_difference(catalog)


def test_backward_order_is_forward_order_and_leaves_grads(hf_qwen3):
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    params = dict(hf_qwen3.named_parameters())
    kept = torch.full_like(params["model.norm.weight"], 3.0)
    params["model.norm.weight"].grad = kept
    order = backward_order(hf_qwen3, hf_loss(tokens))

    assert params["model.norm.weight"].grad is kept and torch.all(kept == 3.0)
    assert all(p.grad is None for n, p in params.items() if n != "model.norm.weight")
    assert not any(getattr(p, "_post_accumulate_grad_hooks", None) for p in params.values())
    params["model.norm.weight"].grad = None

    assert sorted(order) == sorted(n for n, _ in named_parameters(hf_qwen3))
    assert order[0] == "model.embed_tokens.weight"
    assert order[-1] == ("model.norm.weight" if is_tied(hf_qwen3) else "lm_head.weight")
    layers = [int(m.group(1)) for n in order if (m := re.match(r"model\.layers\.(\d+)\.", n))]
    assert layers == sorted(layers) and set(layers) == {0, 1}
    layer0 = [n.removeprefix("model.layers.0.") for n in order if n.startswith("model.layers.0.")]
    # what runs first in a Qwen3 block, whatever the registration order says
    assert layer0[:2] == ["input_layernorm.weight", "self_attn.q_proj.weight"]
    assert layer0[-1] == "mlp.down_proj.weight"

    spec = ModelSpec.from_module(hf_qwen3, tp_plan=qwen3_tp_plan(is_tied(hf_qwen3)), order=order)
    assert [p.name for p in spec.params] == order


def test_plan_from_module_spec_matches_the_catalog_spec(hf_qwen3):
    tied = is_tied(hf_qwen3)
    spec = ModelSpec.from_module(hf_qwen3, tp_plan=qwen3_tp_plan(tied))
    catalog = model_spec(get_preset(tiny_preset(tied)))
    plan = make_plan(spec, 2, 1, "muon")
    check_plan_matches(plan, catalog, dp=2, tp=1)
    check_plan_matches(make_plan(catalog, 2, 1, "muon"), spec, dp=2, tp=1)
    # TP 1 splits nothing: the module read without TP dims is the planned model
    check_plan_matches(plan, ModelSpec.from_module(hf_qwen3), dp=2, tp=1)
    with pytest.raises(PlanError, match="plan was made for model"):  # at TP 2 the splits are the model's
        check_plan_matches(make_plan(spec, 1, 2, "muon"), ModelSpec.from_module(hf_qwen3))


def test_reference_tiny_model_spec_from_module_is_model_spec():
    """TinyQwen3 registers in forward order, so even the order is the catalog's."""
    cfg = get_preset("tiny-untied")
    spec = ModelSpec.from_module(TinyQwen3(cfg), tp_plan=qwen3_tp_plan(False), name=cfg.name)
    assert spec == model_spec(cfg)


# --- torchtitan- and Megatron-style toys ----------------------------------------------------


class TitanBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.attention = nn.Module()
        for w in ("wq", "wk", "wv", "wo"):
            setattr(self.attention, w, nn.Linear(d, d, bias=False))
        self.feed_forward = nn.Module()
        self.feed_forward.w1 = nn.Linear(d, 2 * d, bias=False)
        self.feed_forward.w2 = nn.Linear(2 * d, d, bias=False)
        self.attention_norm = nn.RMSNorm(d)
        self.ffn_norm = nn.RMSNorm(d)


class TitanToy(nn.Module):
    """torchtitan's Llama naming: layers in a ModuleDict keyed by layer id."""

    def __init__(self, d: int = 8, vocab: int = 32, layers: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleDict({str(i): TitanBlock(d) for i in range(layers)})
        self.norm = nn.RMSNorm(d)
        self.output = nn.Linear(d, vocab, bias=False)


class ParallelWeight(nn.Module):
    """Stands in for Megatron's VocabParallelEmbedding / ColumnParallelLinear (not nn.Embedding)."""

    def __init__(self, rows: int, cols: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, cols))


class MegatronToy(nn.Module):
    def __init__(self, d: int = 8, vocab: int = 32, layers: int = 2):
        super().__init__()
        self.embedding = nn.Module()
        self.embedding.word_embeddings = ParallelWeight(vocab, d)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList()
        for _ in range(layers):
            block = nn.Module()
            block.self_attention = nn.Module()
            block.self_attention.linear_qkv = ParallelWeight(3 * d, d)
            block.self_attention.linear_proj = ParallelWeight(d, d)
            block.input_layernorm = nn.LayerNorm(d)
            self.decoder.layers.append(block)
        self.decoder.final_layernorm = nn.LayerNorm(d)
        self.output_layer = ParallelWeight(vocab, d)


class Wrapper(nn.Module):
    """DDP-, Float16Module- or torch.compile-like: the model under one attribute."""

    def __init__(self, attr: str, inner: nn.Module):
        super().__init__()
        setattr(self, attr, inner)


def test_torchtitan_names():
    spec = ModelSpec.from_module(TitanToy())
    assert spec.name == "TitanToy"
    assert spec.param("tok_embeddings.weight").role is Role.EMBEDDING
    assert spec.param("output.weight").role is Role.HEAD
    assert spec.param("layers.1.attention.wq.weight").role is Role.MATRIX
    assert spec.param("layers.1.attention.wq.weight").layer == 1
    assert spec.param("layers.0.ffn_norm.weight").role is Role.VECTOR
    assert spec.param("norm.weight").layer is None
    assert {p.name for p in spec.matrix_params()} == {
        f"layers.{i}.{w}.weight" for i in range(2)
        for w in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                  "feed_forward.w1", "feed_forward.w2")}


def test_megatron_names_inside_wrappers():
    spec = ModelSpec.from_module(Wrapper("module", Wrapper("module", MegatronToy())))
    assert spec.name == "MegatronToy"
    assert spec.param("embedding.word_embeddings.weight").role is Role.EMBEDDING
    assert spec.param("output_layer.weight").role is Role.HEAD
    qkv = spec.param("decoder.layers.1.self_attention.linear_qkv.weight")
    assert (qkv.role, qkv.layer, qkv.shape) == (Role.MATRIX, 1, (24, 8))
    assert spec.param("decoder.layers.0.input_layernorm.bias").role is Role.VECTOR
    assert spec.param("decoder.final_layernorm.weight").layer is None


def test_gpt2_style_names():
    model = nn.Module()
    model.transformer = nn.Module()
    model.transformer.wte = ParallelWeight(32, 8)
    model.transformer.wpe = ParallelWeight(16, 8)
    model.transformer.h = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
    spec = ModelSpec.from_module(model)
    assert spec.param("transformer.wte.weight").role is Role.EMBEDDING
    assert spec.param("transformer.wpe.weight").role is Role.EMBEDDING
    assert spec.param("transformer.h.1.weight").layer == 1
    assert spec.param("transformer.h.1.bias").role is Role.VECTOR


def test_get_output_embeddings_names_the_head():
    class Custom(TitanToy):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 32, bias=False)

        def get_output_embeddings(self) -> nn.Module:
            return self.proj

    spec = ModelSpec.from_module(Custom())
    assert spec.param("proj.weight").role is Role.HEAD
    assert spec.param("output.weight").role is Role.MATRIX  # HF's answer replaces the name rules


def test_wrapper_components_are_removed():
    assert canonical_name("module._orig_mod.model.layers.0.w") == "model.layers.0.w"
    assert canonical_name("a._fsdp_wrapped_module.b._checkpoint_wrapped_module.c.weight") == "a.b.c.weight"
    inner = TitanToy()
    inner.layers["0"] = Wrapper("_checkpoint_wrapped_module", inner.layers["0"])
    wrapped = Wrapper("_orig_mod", Wrapper("module", inner))
    spec = ModelSpec.from_module(wrapped)
    plain = ModelSpec.from_module(TitanToy())
    assert [p.name for p in spec.params] == [p.name for p in plain.params]
    assert spec.fingerprint() == plain.fingerprint()
    assert [n for n, _ in named_parameters(wrapped)] == [p.name for p in spec.params]


def test_the_optimizer_given_names_through_a_wrapper_names_named_parameters():
    """torchtitan's per-block activation checkpointing and torch.compile rename the parameters
    (`layers.0._checkpoint_wrapped_module.w`); `model.named_parameters()` then gives the optimizer
    names the spec (canonical) never has: the error names the way out, on every path (ZeRO-1 and
    FSDP2 both take the user's groups through `user_groups`), where it named the parameter alone."""
    from canzona.runtime.groups import user_groups

    inner = TitanToy()
    spec = ModelSpec.from_module(inner)
    inner.layers["0"] = Wrapper("_checkpoint_wrapped_module", inner.layers["0"])
    with pytest.raises(SpecError, match=r"_checkpoint_wrapped_module.*named_parameters\(model\)"):
        user_groups(inner.named_parameters(), spec)
    with pytest.raises(SpecError, match=r"named_parameters\(model\)"):
        user_groups([{"params": list(inner.named_parameters()), "weight_decay": 0.1}], spec)
    assert [n for n, _ in user_groups(named_parameters(inner), spec)[0][0]] == [p.name for p in spec.params]
    # the error names the wrappers in the name, not torch.compile's for a DDP-style `module.` (review)
    outer = Wrapper("module", TitanToy())
    with pytest.raises(SpecError, match=r"wrapper \(DDP / DataParallel / Megatron's Float16Module \(module\)\);"):
        user_groups(outer.named_parameters(), ModelSpec.from_module(outer))


def test_frozen_parameters_are_skipped():
    model = TitanToy()
    model.tok_embeddings.weight.requires_grad_(False)
    spec = ModelSpec.from_module(model)
    assert "tok_embeddings.weight" not in {p.name for p in spec.params}
    assert "tok_embeddings.weight" not in dict(named_parameters(model))


def test_parameters_of_more_than_two_dims_go_to_adamw():
    model = TitanToy()
    model.experts = nn.Parameter(torch.zeros(4, 8, 8))  # stacked expert weights
    model.conv = nn.Conv1d(8, 8, 3)
    spec = ModelSpec.from_module(model)
    for name in ("experts", "conv.weight"):
        assert spec.param(name).role is Role.MATRIX  # a weight, but not 2-D: the rule says AdamW
        assert spec.param(name) in spec.adamw_params()


def test_a_parametrized_embedding_or_head_keeps_its_role_and_weight_norms_magnitude_is_a_vector():
    """`register_parametrization` (weight_norm, spectral_norm, orthogonal) before building the
    optimizer moves a weight to `module.parametrizations.weight.original` (or `original0` and
    `original1`), a child of the module: the embedding and the head keep their roles (AdamW), and
    weight_norm's magnitude, `(out, 1)` beside its direction, is a vector like a norm's gain, as is
    the old hook's `weight_g`. Before: the embedding and the head went to the matrix optimizer,
    and so did every magnitude (a Muon step of an `(out, 1)` column is its gradient's direction)."""
    from torch.nn.utils import parametrizations

    model = TitanToy()
    parametrizations.weight_norm(model.tok_embeddings)
    parametrizations.spectral_norm(model.output)
    parametrizations.weight_norm(model.layers["0"].attention.wq)
    with warnings.catch_warnings():  # torch's FutureWarning: the hook is deprecated
        warnings.simplefilter("ignore", FutureWarning)
        torch.nn.utils.weight_norm(model.layers["1"].attention.wq)  # the old hook: weight_g, weight_v
    spec = ModelSpec.from_module(model)
    emb, out = "tok_embeddings.parametrizations.weight.original", "output.parametrizations.weight.original"
    wq0, wq1 = "layers.0.attention.wq.parametrizations.weight.original", "layers.1.attention.wq.weight"
    assert (spec.param(f"{emb}0").role, spec.param(f"{emb}1").role, spec.param(out).role) == \
        (Role.VECTOR, Role.EMBEDDING, Role.HEAD)
    assert (spec.param(f"{wq0}0").role, spec.param(f"{wq0}1").role) == (Role.VECTOR, Role.MATRIX)
    assert (spec.param(f"{wq1}_g").role, spec.param(f"{wq1}_v").role) == (Role.VECTOR, Role.MATRIX)
    assert {p.name for p in spec.matrix_params()} == \
        {p.name for p in ModelSpec.from_module(TitanToy()).matrix_params()} - \
        {"layers.0.attention.wq.weight", "layers.1.attention.wq.weight"} | {f"{wq0}1", f"{wq1}_v"}


def test_dtypes():
    model = TitanToy().to(torch.bfloat16)
    assert {p.dtype for p in ModelSpec.from_module(model).params} == {"bf16"}
    model.scale = nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(SpecError) as err:
        ModelSpec.from_module(model)
    assert "'scale'" in one_line(err) and "complex64" in str(err.value)


def test_a_0d_scalar_parameter_is_a_vector_adamw_steps_never_tp_split():
    """CLIP's logit_scale, a learnable temperature, a ReZero gate: one element, AdamW's, replicated
    under TP (a tp_plan or Megatron annotation splitting it is one SpecError naming it)."""
    model = MegatronToy()
    model.logit_scale = nn.Parameter(torch.tensor(2.5))
    model.decoder.layers[1].gate = nn.Parameter(torch.tensor(0.0))
    spec = ModelSpec.from_module(model, tp_plan={"*linear_qkv.weight": 0}, tp_size=2)
    for name, layer in (("logit_scale", None), ("decoder.layers.1.gate", 1)):
        p = spec.param(name)
        assert (p.shape, p.numel, p.role, p.layer, p.tp_dim, p.local_shape(2)) == ((), 1, Role.VECTOR, layer, None, ())
        assert p in spec.adamw_params() and not p.uses_matrix_optimizer
    with pytest.raises(SpecError) as err:
        ModelSpec.from_module(model, tp_plan={"logit_scale": 0}, tp_size=2)
    assert "'logit_scale'" in one_line(err) and "outside shape ()" in str(err.value)
    model.logit_scale.tensor_model_parallel, model.logit_scale.partition_dim = True, 0
    with pytest.raises(SpecError) as err:
        ModelSpec.from_module(model, tp_size=2)
    assert "'logit_scale'" in one_line(err) and "partition_dim 0" in str(err.value) and "0-D shape" in str(err.value)


def test_not_a_module():
    with pytest.raises(SpecError):
        ModelSpec.from_module({"w": torch.zeros(2, 2)})


# --- fingerprint and describe_difference ----------------------------------------------------


def test_fingerprint_ignores_order():
    spec = get_model("qwen3-0.6b")
    reversed_spec = ModelSpec(spec.name, tuple(reversed(spec.params)))
    assert reversed_spec.fingerprint() == spec.fingerprint()
    assert re.fullmatch(r"[0-9a-f]{16}", spec.fingerprint())
    p = spec.params[1]
    changed = ModelSpec(spec.name, (spec.params[0], ParamSpec(p.name, p.shape, Role.MATRIX, p.layer),
                                    *spec.params[2:]))
    assert changed.fingerprint() != spec.fingerprint()


def test_describe_difference_names_the_first_difference():
    cfg = get_preset("tiny")
    a = build_qwen3(cfg.as_catalog())
    params = list(a.params)
    q = a.param("model.layers.0.self_attn.q_proj.weight")
    i = params.index(q)

    def variant(*changed: ParamSpec, drop: int | None = None) -> ModelSpec:
        rows = [p for k, p in enumerate(params) if k != drop]
        rows = [next((c for c in changed if c.name == p.name), p) for p in rows]
        return ModelSpec("b", tuple(rows))

    assert a.describe_difference(variant(drop=i)) == f"parameter {q.name!r} is in 'tiny' but not in 'b'"
    extra = ModelSpec("b", (*params, ParamSpec("extra.weight", (2, 2), Role.MATRIX)))
    assert a.describe_difference(extra) == "parameter 'extra.weight' is in 'b' but not in 'tiny'"
    assert a.describe_difference(variant(ParamSpec(q.name, (8, 64), q.role, q.layer, q.tp_dim))) == \
        f"parameter {q.name!r} has shape (64, 64) in 'tiny' but (8, 64) in 'b'"
    assert a.describe_difference(variant(ParamSpec(q.name, q.shape, Role.HEAD, q.layer, q.tp_dim))) == \
        f"parameter {q.name!r} has role matrix in 'tiny' but head in 'b'"
    assert a.describe_difference(variant(ParamSpec(q.name, q.shape, q.role, q.layer, 1))) == \
        f"parameter {q.name!r} has tp_dim 0 in 'tiny' but 1 in 'b'"
    swapped = ModelSpec("tiny", (params[1], params[0], *params[2:]))
    assert a.describe_difference(swapped) == (
        f"same parameters in another order: position 0 is {params[0].name!r} in this spec, "
        f"{params[1].name!r} in the other spec")
    assert a.describe_difference(a) == "no difference between this spec and the other spec"


# --- order and tp_plan ----------------------------------------------------------------------


def test_order_must_be_a_permutation_of_the_trainable_names():
    model = TitanToy()
    names = [n for n, _ in named_parameters(model)]
    spec = ModelSpec.from_module(model, order=list(reversed(names)))
    assert [p.name for p in spec.params] == list(reversed(names))
    for order, want in (
        (names[1:], f"order is missing 1 trainable parameter(s), the first {names[0]!r}"),
        ([*names, "nope.weight"], "order names 'nope.weight', which is not a trainable parameter"),
        ([*names, names[0]], f"order lists {names[0]!r} twice"),
        ("tok_embeddings.weight", "order must be a list of parameter names"),
    ):
        with pytest.raises(SpecError) as err:
            ModelSpec.from_module(model, order=order)
        assert want in one_line(err)


def test_order_excludes_frozen_parameters():
    model = TitanToy()
    model.output.weight.requires_grad_(False)
    names = [n for n, _ in model.named_parameters()]
    with pytest.raises(SpecError) as err:
        ModelSpec.from_module(model, order=names)
    assert "'output.weight'" in one_line(err)


def test_backward_order_appends_parameters_without_gradient():
    model = TitanToy()

    def loss_fn(m: TitanToy) -> torch.Tensor:  # skips layer 1 and the final norm
        x = m.tok_embeddings(torch.tensor([[1, 2, 3]]))
        block = m.layers["0"]
        x = block.attention.wo(block.attention.wq(block.attention_norm(x)))
        return m.output(x).square().mean()

    order = backward_order(model, loss_fn)
    used = ["tok_embeddings.weight", "layers.0.attention_norm.weight", "layers.0.attention.wq.weight",
            "layers.0.attention.wo.weight", "output.weight"]
    assert order[:5] == used
    registration = [n for n, _ in named_parameters(model)]
    assert order[5:] == [n for n in registration if n not in used]
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(SpecError):
        backward_order(model, lambda m: m.output.weight)  # not a scalar


def test_tp_plan_gives_global_shapes():
    model = TitanToy()  # holds the local shards of a tp=2 model
    plan = {"layers.*.attention.wq.weight": 0, "layers.*.attention.wo.weight": 1, "output.weight": 0}
    spec = ModelSpec.from_module(model, tp_plan=plan, tp_size=2)
    wq, wo = spec.param("layers.0.attention.wq.weight"), spec.param("layers.1.attention.wo.weight")
    assert (wq.shape, wq.tp_dim, wq.local_shape(2)) == ((16, 8), 0, (8, 8))
    assert (wo.shape, wo.tp_dim, wo.local_shape(2)) == ((8, 16), 1, (8, 8))
    assert spec.param("output.weight").shape == (64, 8)
    wk = spec.param("layers.0.attention.wk.weight")
    assert (wk.shape, wk.tp_dim) == ((8, 8), None)  # unmatched: replicated
    for p in spec.params:
        assert p.local_shape(2) == tuple(dict(model.named_parameters())[p.name].shape)


def test_tp_plan_errors():
    model = TitanToy()
    cases = (
        ({"*.q_proj.weight": 0}, {}, "tp_plan pattern '*.q_proj.weight' matches no trainable parameter"),
        ({"layers.*.weight": 0, "*.wq.weight": 1}, {}, "two tp dims"),
        ({"*.wq.weight": "colwise"}, {}, "must be a dimension index"),
        ({"norm.weight": 1}, {}, "tp_dim 1 is outside shape"),
        (None, {"tp_size": 0}, "tp_size must be an integer >= 1"),
    )
    for tp_plan, extra, want in cases:
        with pytest.raises(SpecError) as err:
            ModelSpec.from_module(model, tp_plan=tp_plan, **extra)
        assert want in one_line(err)


def test_weight_norm_beside_another_parametrization_and_a_nested_one_keep_their_routes():
    """weight_norm with a second parametrization on the same tensor (its magnitude still
    `original0`, a vector), and an embedding whose original is parametrized in turn
    (`parametrizations.weight.parametrizations.original.original`, still the embedding's own). Before:
    the magnitude went to the matrix optimizer (only a lone weight_norm was looked at), the nested
    original lost the embedding's role."""
    from torch import nn
    from torch.nn.utils import parametrizations, parametrize

    class Scale(nn.Module):
        def forward(self, x):
            return 2 * x

    model = TitanToy()
    parametrizations.weight_norm(model.layers["0"].attention.wq)
    parametrize.register_parametrization(model.layers["0"].attention.wq, "weight", Scale())
    parametrize.register_parametrization(model.tok_embeddings, "weight", Scale())
    parametrize.register_parametrization(model.tok_embeddings.parametrizations.weight, "original", Scale())
    spec = ModelSpec.from_module(model)
    wq = "layers.0.attention.wq.parametrizations.weight.original"
    assert (spec.param(f"{wq}0").role, spec.param(f"{wq}1").role) == (Role.VECTOR, Role.MATRIX)
    assert spec.param("tok_embeddings.parametrizations.weight.parametrizations.original.original").role is \
        Role.EMBEDDING


def test_a_plan_made_before_parametrized_originals_were_routed_is_refused_in_one_line_naming_the_cause():
    """A plan saved before weight_norm's magnitudes and a parametrized embedding's or head's
    originals were routed as their weight (they went to the matrix optimizer then) no longer
    matches the model's spec: one PlanError line that says so and what to do (plan again)."""
    from dataclasses import replace

    from torch.nn.utils import parametrizations

    from canzona.errors import PlanError

    model = TitanToy()
    parametrizations.weight_norm(model.layers["0"].attention.wq)
    spec = ModelSpec.from_module(model)
    magnitude = "layers.0.attention.wq.parametrizations.weight.original0"
    before = ModelSpec(spec.name, tuple(replace(p, role=Role.MATRIX) if p.name == magnitude else p for p in spec.params))
    with pytest.raises(PlanError) as raised:
        check_plan_matches(make_plan(before, 2, 1, "muon"), spec, dp=2, tp=1)
    message = str(raised.value)
    assert "\n" not in message and magnitude in message
    assert re.search(r"parametrized weights' originals.* routed as the weight since .*: make the plan again", message)


def test_the_parametrized_routing_hint_is_given_only_where_the_routing_explains_the_mismatch(one_rank):
    """A plan or an optimizer state of another model (another width) refused for a weight_norm
    model: the error does not claim it was saved before parametrized originals were routed as
    their weight (before: the hint was appended to any mismatch of a model with parametrizations)."""
    from torch.nn.utils import parametrizations

    from canzona.runtime import DistributedOptimizer

    def model_of(width):
        torch.manual_seed(0)
        return nn.Sequential(parametrizations.weight_norm(nn.Linear(width, width)), nn.Linear(width, 4))

    small, big = model_of(8), model_of(16)
    spec, other = ModelSpec.from_module(small), ModelSpec.from_module(big)
    with pytest.raises(PlanError) as raised:
        check_plan_matches(make_plan(other, 2, 1, "muon"), spec, dp=2, tp=1)
    assert "parametrized weights' originals" not in str(raised.value)
    saved = DistributedOptimizer(list(named_parameters(big)), other, "adamw").state_dict()
    opt = DistributedOptimizer(list(named_parameters(small)), spec, "adamw")
    with pytest.raises(PlanError, match="checkpoint is of model") as raised:
        opt.load_state_dict(saved)
    assert "parametrized weights' originals" not in str(raised.value)


def test_a_checkpoint_saved_before_parametrized_originals_were_routed_is_refused_in_one_line_naming_the_cause(one_rank):
    """The optimizer state saved for a weight_norm model before its magnitude was routed as a
    vector: loading it is one PlanError line naming the routing change and what to do."""
    from dataclasses import replace

    from torch import nn
    from torch.nn.utils import parametrizations

    from canzona.errors import PlanError
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters

    model = nn.Sequential(parametrizations.weight_norm(nn.Linear(8, 8)), nn.Linear(8, 4))
    spec = ModelSpec.from_module(model)
    magnitude = "0.parametrizations.weight.original0"
    before = ModelSpec(spec.name, tuple(replace(p, role=Role.MATRIX) if p.name == magnitude else p for p in spec.params))
    opt = DistributedOptimizer(list(named_parameters(model)), before, "adamw")
    saved = opt.state_dict()
    del opt
    opt = DistributedOptimizer(list(named_parameters(model)), spec, "adamw")
    with pytest.raises(PlanError) as raised:
        opt.load_state_dict(saved)
    message = str(raised.value)
    assert "\n" not in message
    assert re.search(r"parametrized weights' originals.* routed as the weight since .*, and an optimizer state saved before .*: load the model.s weights", message)
