"""The memory-bound kernels of a Llama decoder layer as PyTorch runs them in eager mode (no
torch.compile, no fused kernels): each op one or more launches, priced like the fused ones
(`sim.layer_kernels`) by the bytes they move at the profile's achievable HBM bandwidth
(docs/design.md §9.3, `Workload.kernels`).

The ops are torchtitan's Llama 3 model code with `norm_type = "rmsnorm"` and `compile = false`,
the settings of its A100 presets (pytorch/torchtitan `torchtitan/models/llama/model.py` and
`torchtitan/models/norms.py` `RMSNorm`, `train.py`'s `loss_fn`), read with torch's op semantics
(an op reads its inputs and writes its output; autograd's backward formulas in torch's
`tools/autograd/derivatives.yaml` and `torch/csrc/autograd/FunctionsManual.cpp`). Per element, with
`b` the activation dtype's bytes (bf16: 2) and F = 4 (fp32):

- RMSNorm forward, `(x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)).type_as(x) * weight`:
  cast (b + F), pow (2F), mean (F, its row output negligible), multiply by the row's rsqrt (2F),
  cast back (F + b), multiply by the weight (2b): `4b + 7F` = 36 bytes in bf16 (the fused kernel
  moves `2b`). The per-row add and rsqrt are left out (one value a row).
- RMSNorm backward (autograd of the same ops): weight multiply: dx (2b), the weight's gradient
  `dy * normed` (3b) summed over rows (b); the cast's backward (b + F); the rsqrt multiply's:
  `dy * rsqrt` (2F) and `sum(dy * x)` per row (3F + F); mean's backward expands the row gradient
  (F written); pow's (`grad * (2 * x.pow(1))`: the pow(1) copy 2F, the scaling 2F, the product
  3F); autograd adds the two gradients of the fp32 x (3F); the first cast's backward (F + b):
  `8b + 19F` = 92 bytes in bf16 (fused: `3b`).
- RoPE (`apply_rotary_emb`) on q and k, per element of each: cast to fp32 (b + F), the complex
  multiply by freqs_cis (2F), cast back (F + b): `2b + 4F`; backward the same three in reverse
  (`2b + 4F`). **Assumption**: freqs_cis, broadcast over the batch and heads, is read once per
  sequence position and head dimension (cache-resident), negligible beside q and k.
- Grouped-query attention's `repeat_kv` (heads `n_rep = q / kv` > 1): `expand(...).reshape(...)`
  copies K and V to the query heads' width (read `kv b`, write `n_rep kv b`, each); backward
  sums the copies back (the same bytes). The fused attention reads K and V per group instead.
- The attention output's `transpose(1, 2).contiguous()` makes no copy: torch's flash-attention
  path (`_scaled_dot_product_flash_attention`) runs on the (batch, seq, heads, dim) layout and
  returns its output transposed, so the transpose back is already contiguous (and q, k, v, made
  contiguous by RoPE's cast and `repeat_kv`, reach it without copies; the same in backward).
- SwiGLU `silu(w1(x)) * w3(x)`: silu (2b) then the product (3b) per output element, `5b`
  (fused: `3b`); backward: the product's two gradients (3b each), silu's backward (3b): `9b`
  (fused `5b`).
- Residual adds: one add each (`3b`), as the fused model prices them (`sim.layer_kernels`).
- Cross-entropy, `F.cross_entropy(logits.float(), labels)` per logit: forward the cast (2 + F)
  and log_softmax (**assumption**: aten's softmax kernel reads a 128k-wide fp32 row three times,
  for the max, the exponentials' sum and the output, and writes once: 4F); nll_loss reads one
  logit a row: `2 + 5F` = 22 bytes; backward nll_loss's zero-filled gradient (F), log_softmax's
  backward (the row sum of the gradient F, then read gradient and output, write: 3F), the cast
  back (F + 2): `2 + 6F` = 26 bytes. On the bf16 logits themselves (a loss that does not upcast,
  NeMo AutoModel's `MaskedCrossEntropy(fp32_upcast=False)`) the same passes at `F` = 2 without the
  casts: `4F` = 8 bytes forward, `5F` = 10 backward (`loss_bytes`).
"""

from __future__ import annotations

from canzona.choices import check_choice
from canzona.cost import Kernel
from canzona.errors import SpecError
from sim.layer_kernels import FP32, LayerShape, _pass, residual_add

FUSED, EAGER = "fused", "eager"
# "fused": Transformer Engine / Megatron's fused kernels (sim.layer_kernels, the default);
# "eager": PyTorch's eager ops (this module), e.g. torchtitan with compile = false
KERNEL_MODES = (FUSED, EAGER)


def check_kernels(mode: str) -> str:
    return check_choice(mode, KERNEL_MODES, "kernels")


def norm_bytes(b: int, backward: bool) -> int:
    """Bytes per element of the eager RMSNorm (the module docstring)."""
    return 8 * b + 19 * FP32 if backward else 4 * b + 7 * FP32


def rope_bytes(b: int) -> int:
    """Bytes per element of q or k of the eager rotary embedding, forward or backward."""
    return 2 * b + 4 * FP32


def swiglu_bytes(b: int, backward: bool) -> int:
    """Bytes per output element of the eager SwiGLU."""
    return 9 * b if backward else 5 * b


def loss_bytes(loss_dtype_bytes: int, backward: bool) -> int:
    """Bytes a logit of PyTorch's `F.cross_entropy` on logits of `loss_dtype_bytes` (fp32: the bf16
    logits cast up first and the gradient cast back; bf16: no cast): forward the cast and
    log_softmax's three reads and one write; backward nll_loss's zero-filled gradient, log_softmax's
    backward (the gradient's row sum, then gradient and output read, the result written), the cast back."""
    cast = 2 + loss_dtype_bytes if loss_dtype_bytes > 2 else 0
    return cast + (5 if backward else 4) * loss_dtype_bytes



def norm(s: LayerShape, backward: bool, name: str) -> Kernel:
    n = s.rows * s.hidden
    return _pass(f"{name} rmsnorm{'.grad' if backward else ''} (eager)", n, n * norm_bytes(s.act_bytes, backward))


def rope(s: LayerShape, q_width: float, k_width: float, backward: bool, name: str) -> Kernel:
    n = s.tokens * (q_width + k_width)
    return _pass(f"{name} rope{'.grad' if backward else ''} (eager)", n, n * rope_bytes(s.act_bytes))


def repeat_kv(s: LayerShape, q_width: float, kv_width: float, name: str) -> list[Kernel]:
    """K's and V's copies to the query heads (forward; backward their sums: the same bytes)."""
    if kv_width >= q_width:
        return []
    n = s.tokens * kv_width
    rep = q_width / kv_width
    return [_pass(f"{name} repeat_kv {t} (eager)", n * rep, n * (1 + rep) * s.act_bytes) for t in ("k", "v")]


def attention_block(s: LayerShape, q_width: float, kv_width: float, backward: bool, name: str) -> list[Kernel]:
    """The attention block's memory-bound kernels in eager mode (q_width, kv_width: this TP rank's)."""
    kv = repeat_kv(s, q_width, kv_width, name)
    r = rope(s, q_width, kv_width, backward, name)
    if backward:
        return [residual_add(s, name), *kv, r, norm(s, True, name)]
    return [norm(s, False, name), r, *kv, residual_add(s, name)]


def mlp_block(s: LayerShape, width: float, gated: bool, backward: bool, name: str) -> list[Kernel]:
    """The MLP block's in eager mode; `width` this rank's gate + up columns (SwiGLU when `gated`)."""
    if not gated:
        raise SpecError("eager kernels are modelled for gated (SwiGLU) MLPs, as torchtitan's Llama")
    out = width / 2
    act = _pass(f"{name} swiglu{'.grad' if backward else ''} (eager)", s.tokens * out,
                s.tokens * out * swiglu_bytes(s.act_bytes, backward))
    if backward:
        return [residual_add(s, name), act, norm(s, True, name)]
    return [norm(s, False, name), act, residual_add(s, name)]


def loss_kernels(tokens: int, vocab_slice: int, backward: bool, loss_dtype_bytes: int = FP32) -> list[Kernel]:
    """PyTorch's `F.cross_entropy` over one rank's `tokens x vocab_slice` logits (`loss_bytes`)."""
    n = tokens * vocab_slice
    return [_pass(f"loss{'.grad' if backward else ''} (eager)", n, n * loss_bytes(loss_dtype_bytes, backward))]


__all__ = ["EAGER", "FUSED", "KERNEL_MODES", "attention_block", "check_kernels", "loss_kernels", "mlp_block",
           "norm_bytes", "rope_bytes", "swiglu_bytes"]
