"""The tiny Qwen3-style decoder (reference/tiny_model.py) and its synthetic data (reference/data.py).

The model is checked against an independent functional forward written here from the Qwen3
definition (docs/design.md §2.4), against an explicit per-head GQA loop, against complex-number RoPE,
and against the catalog's naming / order / TP conventions.
"""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from canzona.catalog import build_qwen3
from canzona.errors import SpecError
from canzona.spec import Role, routes_to_matrix_optimizer
from reference.data import (
    entropy_rate,
    fixed_batch,
    shard_batch,
    synthetic_batches,
    transition_matrix,
    uniform_loss,
)
from reference.tiny_model import (
    PRESETS,
    TinyQwen3,
    TinyQwen3Config,
    apply_rope,
    check_tp,
    get_preset,
    model_spec,
    preset_names,
    rope_cos_sin,
)

ROOT = Path(__file__).resolve().parents[2]
MATRIX_SUFFIXES = {
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
}
# A small GQA shape for the fp64 reference comparisons: 3 query heads per KV head, q_out != hidden.
ODD = TinyQwen3Config(vocab=37, hidden=24, layers=2, q_heads=6, kv_heads=2, head_dim=8, ffn=40,
                      tied_embeddings=False, max_seq_len=16, rope_theta=500.0, name="odd")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny matmuls: one thread is fastest, and far faster on a loaded 2-core machine.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _tokens(cfg: TinyQwen3Config, batch: int = 2, seq: int = 12, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab, (batch, seq), generator=g)


# ---------------------------------------------------------------------------------------------
# Independent references
# ---------------------------------------------------------------------------------------------


def _rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope_complex(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE as complex multiplication, pairing dimension i with i + d/2 (HF rotate_half)."""
    d = x.shape[-1]
    half = d // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / d)
    ang = positions.to(torch.float64)[:, None] * freqs  # T x d/2
    z = torch.complex(x[..., :half].double(), x[..., half:].double()) * torch.polar(
        torch.ones_like(ang), ang
    )
    return torch.cat((z.real, z.imag), dim=-1).to(x.dtype)


def _attention_reference(sd: dict, pre: str, x: torch.Tensor, cfg: TinyQwen3Config) -> torch.Tensor:
    """Causal GQA with an explicit loop over query heads and positions (no repeat, no mask fill)."""
    b, t, _ = x.shape
    d = cfg.head_dim
    q = (x @ sd[f"{pre}.q_proj.weight"].T).view(b, t, cfg.q_heads, d)
    k = (x @ sd[f"{pre}.k_proj.weight"].T).view(b, t, cfg.kv_heads, d)
    v = (x @ sd[f"{pre}.v_proj.weight"].T).view(b, t, cfg.kv_heads, d)
    q = _rms(q, sd[f"{pre}.q_norm.weight"], cfg.rms_eps)
    k = _rms(k, sd[f"{pre}.k_norm.weight"], cfg.rms_eps)
    pos = torch.arange(t)
    q = _rope_complex(q.transpose(1, 2), pos, cfg.rope_theta)  # B x H x T x d
    k = _rope_complex(k.transpose(1, 2), pos, cfg.rope_theta)
    v = v.transpose(1, 2)
    group = cfg.q_heads // cfg.kv_heads
    out = torch.zeros(b, cfg.q_heads, t, d, dtype=x.dtype)
    for h in range(cfg.q_heads):
        kv = h // group
        for i in range(t):
            s = (k[:, kv, : i + 1] @ q[:, h, i, :, None]).squeeze(-1) / math.sqrt(d)
            out[:, h, i] = (torch.softmax(s, dim=-1)[:, None, :] @ v[:, kv, : i + 1]).squeeze(1)
    out = out.transpose(1, 2).reshape(b, t, cfg.q_heads * d)
    return out @ sd[f"{pre}.o_proj.weight"].T


def _forward_reference(model: TinyQwen3, tokens: torch.Tensor) -> torch.Tensor:
    """The whole Qwen3 forward, functionally, from the state dict's Hugging Face names."""
    cfg, sd = model.cfg, dict(model.state_dict())
    eps = cfg.rms_eps
    x = sd["model.embed_tokens.weight"][tokens]
    for i in range(cfg.layers):
        pre = f"model.layers.{i}"
        h = _rms(x, sd[f"{pre}.input_layernorm.weight"], eps)
        x = x + _attention_reference(sd, f"{pre}.self_attn", h, cfg)
        h = _rms(x, sd[f"{pre}.post_attention_layernorm.weight"], eps)
        gate = h @ sd[f"{pre}.mlp.gate_proj.weight"].T
        up = h @ sd[f"{pre}.mlp.up_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ sd[f"{pre}.mlp.down_proj.weight"].T
    x = _rms(x, sd["model.norm.weight"], eps)
    head = sd["model.embed_tokens.weight"] if cfg.tied_embeddings else sd["lm_head.weight"]
    return x @ head.T


def _perturb_norms(model: TinyQwen3, seed: int = 1) -> None:
    """Norm weights start at 1; make them random so the references check where they are applied."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"vocab": 0}, "vocab"),
        ({"hidden": -4}, "hidden"),
        ({"layers": 0}, "layers"),
        ({"layers": 2.0}, "layers"),
        ({"q_heads": 4, "kv_heads": 3}, "multiple of kv_heads"),
        ({"head_dim": 15}, "even"),
        ({"ffn": 0}, "ffn"),
        ({"rope_theta": 0.5}, "rope_theta"),
        ({"rms_eps": 0.0}, "rms_eps"),
        ({"max_seq_len": 0}, "max_seq_len"),
        ({"tied_embeddings": 1}, "tied_embeddings"),
        ({"attn_impl": "flash"}, "attn_impl"),
        ({"init_std": -1.0}, "init_std"),
    ],
)
def test_config_validation(changes, match):
    with pytest.raises(ValueError, match=match):
        TinyQwen3Config(**changes)
    with pytest.raises(SpecError):
        TinyQwen3Config(**changes)


def test_presets():
    assert preset_names() == list(PRESETS)
    assert {"tiny", "small"} <= set(PRESETS)
    tied = {PRESETS[n].tied_embeddings for n in PRESETS}
    assert tied == {True, False}
    assert get_preset("tiny", layers=3).layers == 3
    assert get_preset("tiny").hidden == 64 and get_preset("small").hidden == 128
    with pytest.raises(SpecError, match="unknown tiny model"):
        get_preset("huge")
    for name, cfg in PRESETS.items():
        assert cfg.name == name
        check_tp(cfg, 2)
    check_tp(get_preset("small"), 4)


# ---------------------------------------------------------------------------------------------
# Forward: shapes, references, causality, GQA, RoPE
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PRESETS))
def test_shapes(name):
    cfg = get_preset(name)
    model = TinyQwen3(cfg, seed=0)
    tokens = _tokens(cfg, batch=3, seq=10)
    logits = model(tokens)
    assert logits.shape == (3, 10, cfg.vocab) and logits.dtype == torch.float32
    loss = model.loss(tokens)
    assert loss.shape == () and torch.isfinite(loss)
    # An untrained model is close to the uniform guess.
    assert abs(loss.item() - math.log(cfg.vocab)) < 0.5
    assert model.hidden_states(tokens).shape == (3, 10, cfg.hidden)
    assert model.spec() == model_spec(cfg)


def test_bad_tokens():
    model = TinyQwen3("tiny")
    with pytest.raises(SpecError, match="2-D"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(SpecError, match="integer"):
        model(torch.zeros(1, 5))
    with pytest.raises(SpecError, match="max_seq_len"):
        model(torch.zeros(1, model.cfg.max_seq_len + 1, dtype=torch.long))
    with pytest.raises(SpecError, match="at least 2"):
        model.loss(torch.zeros(2, 1, dtype=torch.long))


@pytest.mark.parametrize("tied", [False, True])
def test_forward_matches_functional_reference(tied):
    cfg = ODD.replace(tied_embeddings=tied)
    model = TinyQwen3(cfg, seed=3, dtype=torch.float64)
    _perturb_norms(model)
    tokens = _tokens(cfg, batch=2, seq=9)
    torch.testing.assert_close(model(tokens), _forward_reference(model, tokens), rtol=1e-12, atol=1e-12)


def test_loss_is_next_token_cross_entropy():
    cfg = ODD
    model = TinyQwen3(cfg, seed=1, dtype=torch.float64)
    tokens = _tokens(cfg, batch=2, seq=8)
    logp = torch.log_softmax(model(tokens)[:, :-1], dim=-1)
    expected = -logp.gather(-1, tokens[:, 1:, None]).mean()
    torch.testing.assert_close(model.loss(tokens), expected, rtol=1e-12, atol=1e-12)


def test_gqa_matches_explicit_per_head_loop():
    cfg = ODD
    model = TinyQwen3(cfg, seed=5, dtype=torch.float64)
    _perturb_norms(model, seed=2)
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 7, cfg.hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_cos_sin(torch.arange(7), cfg.head_dim, cfg.rope_theta, torch.float64)
    sd = {f"p.{n}": p.detach() for n, p in attn.named_parameters()}
    expected = _attention_reference(sd, "p", x, cfg)
    torch.testing.assert_close(attn(x, cos, sin), expected, rtol=1e-12, atol=1e-12)
    # The GQA grouping matters: pairing query head j with KV head j % kv_heads gives another answer.
    perm = torch.arange(cfg.q_heads).view(cfg.kv_heads, -1).T.reshape(-1)
    d = cfg.head_dim
    shuffled = dict(sd)
    shuffled["p.q_proj.weight"] = sd["p.q_proj.weight"].view(cfg.q_heads, d, -1)[perm].reshape(-1, cfg.hidden)
    assert not torch.allclose(_attention_reference(shuffled, "p", x, cfg)[..., :1],
                              attn(x, cos, sin)[..., :1])


def test_sdpa_and_math_attention_agree():
    cfg = ODD
    tokens = _tokens(cfg, batch=2, seq=11)
    a = TinyQwen3(cfg, seed=4, dtype=torch.float64)
    b = TinyQwen3(cfg.replace(attn_impl="sdpa"), seed=4, dtype=torch.float64)
    torch.testing.assert_close(a(tokens), b(tokens), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_causal(name):
    cfg = get_preset(name)
    model = TinyQwen3(cfg, seed=0, dtype=torch.float64)
    tokens = _tokens(cfg, batch=2, seq=16)
    base = model(tokens)
    for t in (0, 7, 15):
        changed = tokens.clone()
        changed[:, t] = (changed[:, t] + 1) % cfg.vocab
        out = model(changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-13)
        assert (out[:, t:] - base[:, t:]).abs().amax(dim=-1).min() > 0  # position t and later see it


def test_rope_matches_complex_rotation():
    d, theta = 16, 10000.0
    x = torch.randn(3, 2, 9, d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9)
    cos, sin = rope_cos_sin(pos, d, theta, torch.float64)
    assert cos.shape == (9, d)
    torch.testing.assert_close(apply_rope(x, cos, sin), _rope_complex(x, pos, theta), rtol=1e-13, atol=1e-13)
    # Position 0 is the identity; rotations preserve norms.
    torch.testing.assert_close(apply_rope(x, cos, sin)[..., 0, :], x[..., 0, :], rtol=0, atol=0)
    torch.testing.assert_close(apply_rope(x, cos, sin).norm(dim=-1), x.norm(dim=-1))


@settings(max_examples=25, deadline=None)
@given(m=st.integers(0, 500), n=st.integers(0, 500), shift=st.integers(0, 500),
       half=st.integers(1, 16), seed=st.integers(0, 2**31 - 1))
def test_rope_relative_position(m, n, shift, half, seed):
    """q·k after rotation depends only on the position difference m - n."""
    d = 2 * half
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, d, dtype=torch.float64, generator=g)

    def score(pq, pk):
        cos, sin = rope_cos_sin(torch.tensor([pq, pk]), d, 10000.0, torch.float64)
        return (apply_rope(q, cos[0], sin[0]) @ apply_rope(k, cos[1], sin[1])).item()

    assert score(m, n) == pytest.approx(score(m + shift, n + shift), rel=1e-9, abs=1e-9)


# ---------------------------------------------------------------------------------------------
# Determinism, dtypes, tying
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_deterministic_init_and_forward(name):
    cfg = get_preset(name)
    rng = torch.random.get_rng_state()
    a, b = TinyQwen3(cfg, seed=7), TinyQwen3(cfg, seed=7)
    assert torch.equal(torch.random.get_rng_state(), rng), "construction must not use the global RNG"
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    tokens = _tokens(cfg)
    assert torch.equal(a(tokens), b(tokens))
    c = TinyQwen3(cfg, seed=8)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    # init_weights(seed) resets to the same values; norms are ones.
    with torch.no_grad():
        for p in c.parameters():
            p.add_(1.0)
    c.init_weights(7)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters(), strict=True))
    assert torch.equal(a.model.norm.weight, torch.ones(cfg.hidden))
    std = a.model.layers[0].mlp.gate_proj.weight.std().item()
    assert std == pytest.approx(cfg.init_std, rel=0.1)


def test_init_generator_argument():
    cfg = get_preset("tiny")
    a = TinyQwen3(cfg, seed=11)
    b = TinyQwen3(cfg, seed=0)
    b.init_weights(torch.Generator().manual_seed(11))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_fp64_and_dtype_consistency():
    cfg = get_preset("tiny-untied")
    m64 = TinyQwen3(cfg, seed=2, dtype=torch.float64)
    m32 = TinyQwen3(cfg, seed=2)  # fp32 default
    assert all(p.dtype == torch.float64 for p in m64.parameters())
    assert m64.dtype == torch.float64 and m32.dtype == torch.float32
    # Same draws, only rounded: the fp32 model is the fp64 model cast to fp32.
    for p32, p64 in zip(m32.parameters(), m64.parameters(), strict=True):
        assert torch.equal(p32, p64.float())
    tokens = _tokens(cfg)
    logits64 = m64(tokens)
    assert logits64.dtype == torch.float64
    torch.testing.assert_close(m32(tokens).double(), logits64, rtol=1e-4, atol=1e-5)
    loss = m64.loss(tokens)
    loss.backward()
    assert loss.dtype == torch.float64
    assert all(p.grad is not None and p.grad.dtype == torch.float64 for p in m64.parameters())
    assert model_spec(cfg, torch.float64).params[0].dtype == "fp64"
    assert {p.dtype for p in TinyQwen3(cfg, dtype="fp64").spec().params} == {"fp64"}
    with pytest.raises(SpecError, match="dtype"):
        TinyQwen3(cfg, dtype=torch.int32)


def test_bf16_forward_runs():
    cfg = get_preset("tiny")
    model = TinyQwen3(cfg, seed=0, dtype=torch.bfloat16)
    loss = model.loss(_tokens(cfg))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert model.spec().params[0].dtype == "bf16"


def test_tied_embeddings_share_storage():
    cfg = get_preset("tiny")
    assert cfg.tied_embeddings
    model = TinyQwen3(cfg, seed=0)
    emb = model.model.embed_tokens.weight
    assert model.lm_head.weight is emb
    assert model.lm_head.weight.data_ptr() == emb.data_ptr()
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names and names[0] == "model.embed_tokens.weight"
    # The head's gradient lands on the embedding, and a step keeps them identical.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.loss(_tokens(cfg)).backward()
    tokens_seen = set(_tokens(cfg)[:, :-1].flatten().tolist())
    unseen = next(i for i in range(cfg.vocab) if i not in tokens_seen)
    assert emb.grad[unseen].abs().sum() > 0  # only the head touches rows of unseen tokens
    opt.step()
    assert model.lm_head.weight is model.model.embed_tokens.weight

    untied = TinyQwen3(get_preset("tiny-untied"), seed=0)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert [n for n, _ in untied.named_parameters()][-1] == "lm_head.weight"


# ---------------------------------------------------------------------------------------------
# ModelSpec, routing, TP
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PRESETS))
def test_named_parameters_match_model_spec(name):
    cfg = get_preset(name)
    model = TinyQwen3(cfg, seed=0)
    spec = model_spec(cfg)
    named = list(model.named_parameters())
    assert [n for n, _ in named] == [p.name for p in spec.params]
    assert [tuple(t.shape) for _, t in named] == [p.shape for p in spec.params]
    assert sum(t.numel() for _, t in named) == spec.numel
    assert {p.dtype for p in spec.params} == {"fp32"}
    assert spec.name == cfg.name
    # Same names, roles, layers and TP dims as the catalog's builder (dtype aside).
    cat = build_qwen3(cfg.as_catalog())
    assert [(p.name, p.shape, p.role, p.layer, p.tp_dim) for p in spec.params] == [
        (p.name, p.shape, p.role, p.layer, p.tp_dim) for p in cat.params
    ]


def test_spec_conventions():
    cfg = get_preset("small")
    spec = model_spec(cfg)
    emb = spec.param("model.embed_tokens.weight")
    assert emb.role is Role.EMBEDDING and emb.tp_dim == 0 and emb.layer is None
    head = spec.param("lm_head.weight")
    assert head.role is Role.HEAD and head.tp_dim == 0
    for p in spec.params:
        if p.name.startswith("model.layers."):
            assert p.layer == int(p.name.split(".")[2])
        short = p.name.split(".")[-2]
        if short in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            assert p.tp_dim == 0 and p.role is Role.MATRIX
        elif short in ("o_proj", "down_proj"):
            assert p.tp_dim == 1 and p.role is Role.MATRIX
        elif p.shape == (cfg.hidden,) or p.shape == (cfg.head_dim,):
            assert p.tp_dim is None and p.role is Role.VECTOR
    assert spec.param("model.layers.0.self_attn.q_proj.weight").local_shape(4) == (
        cfg.q_heads * cfg.head_dim // 4, cfg.hidden)
    assert spec.param("model.layers.0.mlp.down_proj.weight").local_shape(2) == (cfg.hidden, cfg.ffn // 2)


@pytest.mark.parametrize("name", list(PRESETS))
def test_routing(name):
    cfg = get_preset(name)
    spec = model_spec(cfg)
    expected = {f"model.layers.{i}.{s}" for i in range(cfg.layers) for s in MATRIX_SUFFIXES}
    assert {p.name for p in spec.matrix_params()} == expected
    assert len(spec.matrix_params()) == 7 * cfg.layers
    adamw = {p.name for p in spec.adamw_params()}
    assert "model.embed_tokens.weight" in adamw and "model.norm.weight" in adamw
    assert ("lm_head.weight" in adamw) == (not cfg.tied_embeddings)
    # The same rule applied to the live module's parameters.
    model = TinyQwen3(cfg)
    live = {n for n, t in model.named_parameters()
            if routes_to_matrix_optimizer(spec.param(n)) and t.dim() == 2}
    assert live == expected


def test_check_tp():
    tiny, small = get_preset("tiny"), get_preset("small")
    assert check_tp(tiny, 1) == model_spec(tiny)
    check_tp(tiny, 2)
    with pytest.raises(SpecError, match="KV heads"):
        check_tp(tiny, 4)  # k_proj rows (32) split by 4, but 2 KV heads do not
    with pytest.raises(SpecError, match="tp=3"):
        check_tp(small, 3)
    with pytest.raises(SpecError, match="vocabulary"):
        check_tp(get_preset("small", vocab=510), 4)
    with pytest.raises(SpecError):
        check_tp(tiny, 0)
    for tp in (1, 2, 4):
        spec = check_tp(small, tp)
        for p in spec.params:
            assert math.prod(p.local_shape(tp)) * (tp if p.tp_dim is not None else 1) == p.numel


@settings(max_examples=15, deadline=None)
@given(
    kv=st.integers(1, 3), groups=st.integers(1, 3), half=st.integers(1, 4),
    hidden=st.integers(4, 24), ffn=st.integers(1, 24), layers=st.integers(1, 3),
    vocab=st.integers(2, 40), tied=st.booleans(),
)
def test_random_configs_match_spec(kv, groups, half, hidden, ffn, layers, vocab, tied):
    cfg = TinyQwen3Config(vocab=vocab, hidden=hidden, layers=layers, q_heads=kv * groups,
                          kv_heads=kv, head_dim=2 * half, ffn=ffn, tied_embeddings=tied,
                          max_seq_len=8)
    model = TinyQwen3(cfg, seed=0)
    spec = model_spec(cfg)
    assert [(n, tuple(t.shape)) for n, t in model.named_parameters()] == [
        (p.name, p.shape) for p in spec.params
    ]
    logits = model(_tokens(cfg, batch=1, seq=5))
    assert logits.shape == (1, 5, vocab) and torch.isfinite(logits).all()


# ---------------------------------------------------------------------------------------------
# Training sanity
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny", "tiny-untied"])
def test_adamw_lowers_loss(name):
    cfg = get_preset(name)
    model = TinyQwen3(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    held_out = fixed_batch(cfg.vocab, 16, 32, seed=99, chain_seed=1)
    with torch.no_grad():
        before = model.loss(held_out).item()
    losses = []
    for tokens in synthetic_batches(cfg.vocab, 8, 32, 40, seed=1):
        loss = model.loss(tokens)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        after = model.loss(held_out).item()
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    assert after < before - 1.0  # generalises to fresh samples of the same chain


# ---------------------------------------------------------------------------------------------
# Synthetic data
# ---------------------------------------------------------------------------------------------


def test_data_shapes_and_determinism():
    batches = list(synthetic_batches(50, 4, 12, 3, seed=5))
    assert len(batches) == 3
    for b in batches:
        assert b.shape == (4, 12) and b.dtype == torch.long
        assert int(b.min()) >= 0 and int(b.max()) < 50
    again = list(synthetic_batches(50, 4, 12, 3, seed=5))
    assert all(torch.equal(a, b) for a, b in zip(batches, again, strict=True))
    assert not torch.equal(batches[0], batches[1])
    other = list(synthetic_batches(50, 4, 12, 3, seed=6))
    assert not torch.equal(batches[0], other[0])
    # A longer run starts with the same batches; the global RNG is untouched.
    rng = torch.random.get_rng_state()
    longer = list(synthetic_batches(50, 4, 12, 5, seed=5))
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(batches, longer[:3], strict=False))
    assert torch.equal(fixed_batch(50, 4, 12, seed=5), batches[0])
    assert list(synthetic_batches(50, 4, 12, 0, seed=5)) == []


def _digest(tokens: list[torch.Tensor]) -> str:
    return hashlib.sha256(b"".join(t.numpy().tobytes() for t in tokens)).hexdigest()


def test_data_same_in_another_process():
    code = (
        "import hashlib, torch; torch.set_num_threads(2);"
        "from reference.data import synthetic_batches;"
        "bs = list(synthetic_batches(300, 5, 17, 2, seed=123));"
        "print(hashlib.sha256(b''.join(t.numpy().tobytes() for t in bs)).hexdigest())"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == _digest(list(synthetic_batches(300, 5, 17, 2, seed=123)))


def test_markov_structure():
    vocab = 64
    probs = transition_matrix(vocab, seed=3, branching=4, noise=0.05)
    assert probs.shape == (vocab, vocab) and probs.dtype == torch.float64
    torch.testing.assert_close(probs.sum(dim=1), torch.ones(vocab, dtype=torch.float64))
    assert torch.equal(probs, transition_matrix(vocab, seed=3, branching=4, noise=0.05))
    rate = entropy_rate(probs)
    assert 0 < rate < uniform_loss(vocab) - 1.0
    # Empirical bigram frequencies follow the chain.
    tokens = torch.cat(list(synthetic_batches(vocab, 32, 64, 4, seed=0, chain_seed=3)))
    prev, nxt = tokens[:, :-1].flatten(), tokens[:, 1:].flatten()
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    counts.index_put_((prev, nxt), torch.ones(prev.numel(), dtype=torch.float64), accumulate=True)
    empirical_nll = -(counts * probs.log()).sum() / counts.sum()
    assert empirical_nll.item() == pytest.approx(rate, abs=0.15)
    # Noise 0: only the `branching` successors ever follow a token.
    sparse = transition_matrix(vocab, seed=3, branching=2, noise=0.0)
    assert ((sparse > 0).sum(dim=1) == 2).all()
    toks = fixed_batch(vocab, 8, 32, seed=1, branching=2, noise=0.0, chain_seed=3)
    assert (sparse[toks[:, :-1], toks[:, 1:]] > 0).all()


def test_data_validation_and_sharding():
    with pytest.raises(SpecError, match="vocab"):
        transition_matrix(1)
    with pytest.raises(SpecError, match="branching"):
        transition_matrix(4, branching=5)
    with pytest.raises(SpecError, match="noise"):
        transition_matrix(4, noise=1.5)
    with pytest.raises(SpecError, match="batch"):
        list(synthetic_batches(10, 0, 4, 1))
    with pytest.raises(SpecError, match="steps"):
        list(synthetic_batches(10, 1, 4, -1))
    tokens = fixed_batch(10, 6, 4, seed=0)
    parts = [shard_batch(tokens, r, 3) for r in range(3)]
    assert torch.equal(torch.cat(parts), tokens)
    with pytest.raises(SpecError, match="evenly"):
        shard_batch(tokens, 0, 4)
    with pytest.raises(SpecError, match="rank"):
        shard_batch(tokens, 3, 3)


def test_data_feeds_model():
    cfg = get_preset("tiny")
    model = TinyQwen3(cfg)
    loss = model.loss(fixed_batch(cfg.vocab, 2, cfg.max_seq_len, seed=0))
    assert torch.isfinite(loss)
    assert uniform_loss(cfg.vocab) == pytest.approx(math.log(cfg.vocab))
