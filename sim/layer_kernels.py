"""The memory-bound kernels and the attention core of a Megatron / Transformer Engine decoder layer,
by the bytes they move and the shape they run at (docs/design.md §9.3). These are the fused kernels
(`Workload.kernels` "fused"); PyTorch's eager ops in their place are `sim.eager_kernels`.

Memory-bound kernels (each one launch, priced by `DeviceRate` at the profile's achievable HBM
bandwidth, `gpu.hbm_efficiency`), with `b` the activation dtype's bytes, `h` the hidden size, `r`
the rows a sequence-parallel kernel sees (the rank's tokens / TP) and `T` the rank's tokens:

- RMSNorm forward: read x, write y (`2 r h b`), write the fp32 1/rms per row (`4 r`).
- RMSNorm backward: read x and dy, write dx (`3 r h b`), read the fp32 1/rms (`4 r`), and the
  weight gradient as fp32 partial sums, one row of `h` per SM written and read back by the
  reduction (`2 x sms x h x 4`; one row per SM is an assumption on TE's kernel).
- RoPE (TE's fused rotary embedding) on q and k, forward and backward alike: read and write both
  (`2 T (q + k) / tp b`); with per-head q / k norms (Qwen3) their RMSNorm too (forward `2 T (q + k)
  / tp b`, backward `3 T (q + k) / tp b`; the fp32 1/rms per head is left out).
- Residual add (Megatron's bias-dropout-add without bias or dropout): read both, write the sum
  (`3 r h b`); backward: the residual stream's gradient plus the block's (`3 r h b`).
- A mixture-of-experts layer's MLP side (`moe_mlp_side`): the same RMSNorm and residual add as
  a dense MLP block's, around the expert block (its router, grouped GEMMs and SwiGLU).
- SwiGLU forward: read gate and up, write their product (`3 T f b`, `f` = ffn / tp); backward:
  read gate, up and dy, write d(gate) and d(up) (`5 T f b`). A non-gated activation (one column
  GEMM): forward `2 T w b`, backward `3 T w b`.
- Context parallelism (TE's AttnFuncWithCPAndKVP2P): from the second ring step on, each step's
  partial output is merged into the running one with its log-sum-exp rescaling (read the step's,
  read and write the running output: `3 T q / tp b`); backward merges dQ (`3 T q / tp b`) and
  dK/dV (`3 T 2 kv / tp b`) the same way (bf16 running values: an assumption).
- Cross-entropy over the vocab-parallel logits (Megatron's VocabParallelCrossEntropy, without
  the fused loss): per logit, forward: cast to fp32 (read 2, write 4), max (read 4), subtract the
  max (read and write 4), exp (read and write 4), sum (read 4), divide by the sum into the
  softmax kept for backward (read and write 4): 38 bytes; backward: scale the softmax by the
  loss gradient (read and write 4), cast to the GEMM's dtype (read 4, write 2): 14 bytes.
- Embedding (first pipeline stage): forward gathers the tokens' rows (read and write `T h b`);
  backward zero-fills a dense gradient of the rank's vocabulary slice (write `V/tp h b`),
  scatter-adds the tokens' gradients into it (read dy, read and write the rows: `3 T h b`) and
  Megatron's DDP hook adds it into the fp32 main_grad (read `V/tp h b`, read and write
  `V/tp h 4`), every micro-batch. The linear layers' weight gradients accumulate into main_grad
  inside their GEMMs (TE's gradient_accumulation_fusion: no pass here); the norms' weights
  (`h` each) are negligible.

Attention (`attention_steps`): one fused attention call per ring step, at the efficiency its shape
reaches (`canzona.attention_rate`, converted to the power-limited clock of sustained load, as the
GEMMs are priced): without context parallelism one call over the sequence;
under CP (balanced causal split, rank i holding chunks i and 2cp-1-i of `c = seq / 2cp` tokens)
step 0 is causal over the rank's own `2c` tokens, and every later step is unmasked, either both
query chunks against the sender's first chunk (`2c x c`, ranks at or after the sender) or the
second query chunk against both (`c x 2c`): every step has the same FLOPs. Every later step has
ranks on both shapes and the ring exchanges blocks between neighbours each step, so a step lasts
the slower shape's time; an unmasked call is priced at the efficiency of its key length (the
loop each query tile runs). Without a mask every step is `2c x 2c`.
"""

from __future__ import annotations

from dataclasses import dataclass

from canzona.attention_rate import ATTENTION_BACKWARD, IMPLEMENTATION, efficiency
from canzona.cost import Kernel, elementwise_kernel

FP32 = 4
CE_FORWARD_BYTES = 2 + 4 + 4 + 8 + 8 + 4 + 8  # per logit: cast, max, subtract, exp, sum, divide
CE_BACKWARD_BYTES = 8 + 4 + 2  # scale by the loss gradient, cast back


@dataclass(frozen=True, kw_only=True)
class LayerShape:
    """One rank's share of a micro-batch in a layer: `tokens` the rank's (after CP), `tp` the
    tensor-parallel size (sequence parallel: norms and residual adds on tokens / tp rows)."""

    tokens: int
    tp: int
    hidden: int
    act_bytes: int
    sms: int = 132

    @property
    def rows(self) -> float:
        return self.tokens / self.tp


def _pass(name: str, numel: float, bytes_moved: float) -> Kernel:
    """One memory-bound launch moving `bytes_moved` bytes over `numel` elements (1 FLOP each)."""
    n = max(1, round(numel))
    return elementwise_kernel(name, n, 1.0, bytes_moved / n)


def norm_forward(s: LayerShape, name: str) -> Kernel:
    return _pass(f"{name} rmsnorm", s.rows * s.hidden, 2 * s.rows * s.hidden * s.act_bytes + FP32 * s.rows)


def norm_backward(s: LayerShape, name: str) -> Kernel:
    partials = 2 * s.sms * s.hidden * FP32
    return _pass(f"{name} rmsnorm.grad", s.rows * s.hidden,
                 3 * s.rows * s.hidden * s.act_bytes + FP32 * s.rows + partials)


def residual_add(s: LayerShape, name: str) -> Kernel:
    return _pass(f"{name} residual", s.rows * s.hidden, 3 * s.rows * s.hidden * s.act_bytes)


def rope(s: LayerShape, q_width: float, k_width: float, name: str) -> Kernel:
    """q_width, k_width: this TP rank's widths of q and k."""
    numel = s.tokens * (q_width + k_width)
    return _pass(f"{name} rope", numel, 2 * numel * s.act_bytes)


def activation(s: LayerShape, width: float, gated: bool, backward: bool, name: str) -> Kernel:
    """SwiGLU over `width` (this rank's gate + up columns) when `gated`, else one activation."""
    out = width / 2 if gated else width
    per_out = (5 if backward else 3) if gated else (3 if backward else 2)
    return _pass(f"{name} {'swiglu' if gated else 'activation'}{'.grad' if backward else ''}",
                 s.tokens * out, per_out * s.tokens * out * s.act_bytes)


def qk_norm(s: LayerShape, q_width: float, k_width: float, backward: bool, name: str) -> Kernel:
    """Per-head RMSNorm of q and k (Qwen3): read and write both (backward: read x and dy, write dx)."""
    numel = s.tokens * (q_width + k_width)
    return _pass(f"{name} qk rmsnorm{'.grad' if backward else ''}", numel, (3 if backward else 2) * numel * s.act_bytes)


def attention_block(s: LayerShape, q_width: float, k_width: float, backward: bool, name: str,
                    with_qk_norm: bool = False, rope_kernels: list[Kernel] | None = None) -> list[Kernel]:
    """`rope_kernels`: what runs instead of the fused RoPE (Megatron's unfused one: `sim.unfused_kernels`)."""
    qk = [qk_norm(s, q_width, k_width, backward, name)] if with_qk_norm else []
    pos = [rope(s, q_width, k_width, name)] if rope_kernels is None else rope_kernels
    if backward:
        return [residual_add(s, name), *pos, *qk, norm_backward(s, name)]
    return [norm_forward(s, name), *qk, *pos, residual_add(s, name)]


def mlp_block(s: LayerShape, width: float, gated: bool, backward: bool, name: str,
              activation_kernels: list[Kernel] | None = None) -> list[Kernel]:
    """`activation_kernels`: what runs instead of the fused activation (`sim.unfused_kernels`)."""
    act = [activation(s, width, gated, backward, name)] if activation_kernels is None else activation_kernels
    if backward:
        return [residual_add(s, name), *act, norm_backward(s, name)]
    return [norm_forward(s, name), *act, residual_add(s, name)]


def moe_mlp_side(s: LayerShape, backward: bool, name: str) -> list[Kernel]:
    """What a mixture-of-experts layer runs around its experts that `mlp_block` runs around a dense
    MLP's GEMMs: the pre-MLP RMSNorm and the residual add (Megatron's TransformerLayer runs its
    `pre_mlp_layernorm` and `mlp_bda` whether the MLP is dense or a MoELayer; the experts' SwiGLU and
    the router are the expert block's, `sim.model_work._expert_block`)."""
    if backward:
        return [residual_add(s, name), norm_backward(s, name)]
    return [norm_forward(s, name), residual_add(s, name)]


def ring_merges(s: LayerShape, q_width: float, kv_width: float, cp: int, backward: bool, name: str) -> list[Kernel]:
    """The merges of ring steps 1 .. cp-1 into the running output (backward: dQ and dK/dV)."""
    if cp <= 1:
        return []
    widths = (q_width, 2 * kv_width) if backward else (q_width,)
    return [_pass(f"{name} cp merge", s.tokens * w, 3 * s.tokens * w * s.act_bytes)
            for _ in range(cp - 1) for w in widths]


def loss_kernels(tokens: int, vocab_slice: int, backward: bool) -> list[Kernel]:
    n = tokens * vocab_slice
    return [_pass("loss.grad" if backward else "loss", n, n * (CE_BACKWARD_BYTES if backward else CE_FORWARD_BYTES))]


def embedding_kernels(tokens: int, vocab_slice: int, hidden: int, act_bytes: int, backward: bool) -> list[Kernel]:
    rows = tokens * hidden
    if not backward:
        return [_pass("embedding", rows, 2 * rows * act_bytes)]
    table = vocab_slice * hidden
    return [_pass("embedding.grad zero", table, table * act_bytes),
            _pass("embedding.grad", rows, 3 * rows * act_bytes),
            _pass("embedding main_grad", table, table * (act_bytes + 2 * FP32))]


def attention_steps(flops: float, seq_len: int, cp: int, causal: bool, head_dim: int, peak_flops: float,
                    backward: bool, implementation: str = IMPLEMENTATION, *, clock: float = 1.0,
                    window_s: float = 0.0) -> tuple[float, ...]:
    """Seconds of each fused-attention call of one pass on one rank: `flops` the rank's attention
    FLOPs of the forward pass (the backward does 2.5x: `ATTENTION_BACKWARD`), split over `cp`
    ring steps (the module docstring); `implementation` the throughput table's series
    (`canzona.attention_rate.ATTENTION_BACKENDS`); `clock`, `window_s`: the device's power-limited
    clock and boost window (`canzona.gemm_model`), at which a training step's attention runs
    (`canzona.attention_rate`: the measured loops ran largely at the boost clock)."""
    pass_ = "backward" if backward else "forward"
    work = flops * (ATTENTION_BACKWARD if backward else 1.0)

    def seconds(part: float, keys: float, masked: bool) -> float:
        return part / (peak_flops * efficiency(pass_, masked, keys, head_dim, implementation=implementation,
                                               clock=clock, window_s=window_s))

    if cp <= 1:
        return (seconds(work, seq_len, causal),)
    step = work / cp
    block = seq_len / cp  # the keys of one rank (2 chunks)
    if not causal:
        return (seconds(step, block, False),) * cp
    later = max(seconds(step, block / 2, False), seconds(step, block, False))
    return (seconds(step, block, True),) + (later,) * (cp - 1)
