"""Megatron-core's unfused RoPE and SwiGLU: what a layer runs when its recipe leaves Megatron's
`apply_rope_fusion` or `bias_activation_fusion` off (docs/design.md §9.3, `Workload`).

Both default to False in Megatron-core's `TransformerConfig`; a model provider or recipe turns them
on (NeMo's Llama configs and Megatron-Bridge's Llama bridge set both; Megatron-Bridge's Qwen3
bridge sets neither, and its Qwen3-30B-A3B 16-GPU recipe sets both itself, "Precision and fused
kernels"). Each op below is one launch, priced like the fused kernels (`sim.layer_kernels`) by the
bytes it moves at the profile's achievable HBM bandwidth; an op reads its inputs and writes its
output (autograd's backward formulas: torch's `tools/autograd/derivatives.yaml`). Per element of
the tensor, with `b` the activation dtype's bytes:

- RoPE, `_apply_rotary_pos_emb_bshd` (megatron/core/models/common/embeddings/rope_utils.py), once
  for q and once for k: `cos_ = (torch.cos(freqs) * mscale).to(t.dtype)` and the same for sin (three
  small launches each over the fp32 `positions x head_dim` table: read 4 and write 4, read 4 and
  write 4, read 4 and write b per entry); `t * cos_` (2b), `_rotate_half`'s `-x2` (b: half the
  elements, read and written) and `torch.cat((-x2, x1))` (2b), `* sin_` (2b), the sum (3b), and
  `torch.cat((t, t_pass))` with an empty `t_pass` (a copy, 2b): `12b` forward, where Transformer
  Engine's fused kernel moves `2b`. Backward: the two products' gradients (2b each, `cos_` and
  `sin_` need none), the negation's (b), `torch.chunk`'s (the halves' gradients concatenated, 2b),
  autograd adding t's gradients from the cos and the rotate paths (3b), and the empty `t_pass`
  slice's: `slice_backward` zero-fills a gradient of t's size (b) that autograd adds in too (3b):
  `14b` (fused `2b`). `t[..., :rot_dim]` over the whole head dimension is t itself (no op).
- SwiGLU, `MLP.forward`'s `glu` (megatron/core/transformer/mlp.py) on the gate and up halves of
  fc1's output (`torch.chunk`: views), per output element: `activation_func(x_glu)` (silu, 2b),
  `x_linear + glu_linear_offset` (an add of the 0.0 default, 2b) and the product (3b): `7b`
  (fused `3b`); backward: the product's two gradients (3b each), silu's backward (3b) and
  `torch.chunk`'s (both halves' gradients concatenated into fc1's width, 4b): `13b` (fused `5b`).
  The add's backward passes its gradient through. The saved tensors grow too: the product keeps
  the silu output and the offset-added up half (`2b` per output element more than the fused
  kernel's, which keeps fc1's output only: `canzona.memory.layer_activation_bytes`).

Bias-dropout-add needs no model: without a bias and at dropout 0 (these decoders), Megatron's
unfused `_bias_dropout_add_func` calls `F.dropout(x, p=0.0)`, which returns its input (torch's
`dropout` for p = 0), and adds the residual: the one add the fused path runs too.
"""

from __future__ import annotations

from canzona.cost import Kernel
from sim.layer_kernels import FP32, LayerShape, _pass


def _freqs(positions: int, head_dim: int, b: int, name: str) -> list[Kernel]:
    """cos_ or sin_ of one call: the function, `* mscale`, `.to(t.dtype)` over the fp32 table."""
    n = positions * head_dim
    return [_pass(f"{name} freqs", n, 2 * FP32 * n), _pass(f"{name} mscale", n, 2 * FP32 * n),
            _pass(f"{name} cast", n, (FP32 + b) * n)]


def rope(s: LayerShape, q_width: float, k_width: float, backward: bool, name: str, *,
         positions: int, head_dim: int) -> list[Kernel]:
    """Megatron's unfused RoPE on this rank's q and k (`q_width`, `k_width` wide), one pass;
    `positions`: the rows of the rank's frequency table (its sequence positions)."""
    b = s.act_bytes
    out: list[Kernel] = []
    for part, width in (("q", q_width), ("k", k_width)):
        n = s.tokens * width
        tag = f"{name} rope.{part}"
        if backward:
            out += [_pass(f"{tag}.grad sin", n, 2 * b * n), _pass(f"{tag}.grad neg", n / 2, b * n),
                    _pass(f"{tag}.grad chunk", n, 2 * b * n), _pass(f"{tag}.grad cos", n, 2 * b * n),
                    _pass(f"{tag}.grad add", n, 3 * b * n), _pass(f"{tag}.grad t_pass zeros", n, b * n),
                    _pass(f"{tag}.grad t_pass add", n, 3 * b * n)]
        else:
            out += _freqs(positions, head_dim, b, f"{tag} cos") + _freqs(positions, head_dim, b, f"{tag} sin")
            out += [_pass(f"{tag} mul cos", n, 2 * b * n), _pass(f"{tag} neg", n / 2, b * n),
                    _pass(f"{tag} cat", n, 2 * b * n), _pass(f"{tag} mul sin", n, 2 * b * n),
                    _pass(f"{tag} add", n, 3 * b * n), _pass(f"{tag} cat t_pass", n, 2 * b * n)]
    return out


def swiglu(s: LayerShape, width: float, backward: bool, name: str) -> list[Kernel]:
    """Megatron's unfused `glu` over `width` (this rank's gate + up columns), one pass."""
    b = s.act_bytes
    n = s.tokens * width / 2  # output elements
    if backward:
        return [_pass(f"{name} glu.grad gate", n, 3 * b * n), _pass(f"{name} glu.grad up", n, 3 * b * n),
                _pass(f"{name} silu.grad", n, 3 * b * n), _pass(f"{name} glu.grad chunk", 2 * n, 4 * b * n)]
    return [_pass(f"{name} silu", n, 2 * b * n), _pass(f"{name} glu offset", n, 2 * b * n),
            _pass(f"{name} glu mul", n, 3 * b * n)]


__all__ = ["rope", "swiglu"]
