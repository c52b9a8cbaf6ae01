"""The loss's cross-entropy over the vocab-parallel logits, by the path Megatron runs it
(`Workload.cross_entropy_loss_fusion`, `Workload.cross_entropy_fusion_impl`, Megatron's
TransformerConfig options of the same names): each path's passes over the rank's `tokens x
vocab / tp` logits, priced by their bytes at the achievable HBM bandwidth like every memory-bound
kernel (`sim.layer_kernels`), with bf16 logits (the head's GEMM output in every Megatron run).

- **unfused** (`cross_entropy_loss_fusion` false, Megatron's default and canzona's: its runtime
  has no loss of its own, and its examples run PyTorch's unfused `F.cross_entropy`,
  `reference/tiny_model.py`'s and Hugging Face's for `examples/hf_qwen3.py`, which upcasts the
  logits to fp32): `VocabParallelCrossEntropy`, one eager op a step, 38 bytes a logit forward and
  14 backward (`sim.layer_kernels.CE_FORWARD_BYTES`, `CE_BACKWARD_BYTES`).
- **native** (`megatron/core/fusions/fused_cross_entropy.py`, the layout of Megatron-Core 0.8 /
  0.9 that NeMo 24.09 runs): the same steps in four `jit_fuser` functions, `torch.compile` from
  PyTorch 2.2 on, each priced as one Inductor kernel over the logits (pointwise work and the row
  reductions fused: an **assumption** on Inductor's scheduling). Forward: the cast and the row
  max (read 2, write 4); the subtraction of the max, `exp` and the row sum, written in place
  into the fp32 logits (read 4, write 4) plus the extra pass Inductor makes when a compiled
  function mutates its input and also reduces over it (a fresh buffer copied back: read 4,
  write 4; Megatron-LM's own later comment in that file, "NOTE on in-place semantics under
  torch.compile", describes it and splits the functions to avoid it); the division by the sum
  in place (read 4, write 4): 30 bytes. Backward: the scatter of the target's `-1` into the
  saved softmax makes Inductor clone it (read 4, write 4), then the scaling by the loss
  gradient, written back (read 4, write 4) and cast to bf16 in the same kernel (write 2): 18
  bytes. Megatron-LM's later rewrite of the file (the in-place steps compiled on their own)
  moves 40; not the path the published rows ran.
- **te** (`transformer_engine/pytorch/triton/cross_entropy.py`, Transformer Engine's Triton
  kernels, as Megatron's `te_parallel_cross_entropy` calls them): forward, an online-softmax
  pass reads the bf16 logits for each row's max and sum (2), the TP ranks exchange those three
  floats a row, and a second pass reads the logits again and writes the gradient over them in
  place (read 2, write 2): 6 bytes; backward, the in-place scaling by the per-token loss
  gradient (read 2, write 2; skipped only for a scalar gradient of 1, never Megatron's
  per-token loss): 4 bytes. The loss keeps no copy of its own: the logits hold the gradient
  (`saved_logit_bytes` 0).

Not priced: the TP all-reduces of the row statistics (`tokens` floats; three under unfused,
two under native, one all-gather under te) and the per-row gathers of the target logit.
"""

from __future__ import annotations

from canzona.cost import Kernel
from canzona.errors import SpecError
from sim import layer_kernels as lk
from sim.layer_kernels import CE_BACKWARD_BYTES, CE_FORWARD_BYTES, FP32, _pass

NATIVE, TE = "native", "te"
# Megatron's --cross-entropy-fusion-impl choices (the linear-fused 'linear' of later Megatron
# runs the head's GEMM inside the loss on Blackwell only: not modelled)
CROSS_ENTROPY_FUSION_IMPLS = (NATIVE, TE)
DEFAULT_CROSS_ENTROPY_FUSION_IMPL = NATIVE  # Megatron's default
UNFUSED = "unfused"
CROSS_ENTROPY_PATHS = (UNFUSED, NATIVE, TE)
BF16 = 2  # the logits' bytes

# bytes a logit moves, forward and backward, on each path (the module docstring)
NATIVE_FORWARD_BYTES = (BF16 + FP32) + (2 * FP32 + 2 * FP32) + 2 * FP32  # cast+max, exp+sum (+copy back), divide
NATIVE_BACKWARD_BYTES = 2 * FP32 + (2 * FP32 + BF16)  # clone for the scatter, scale written back and cast
TE_FORWARD_BYTES = BF16 + 2 * BF16  # online softmax read, gradient pass read and write
TE_BACKWARD_BYTES = 2 * BF16  # in-place scaling by the loss gradient
PATH_BYTES = {UNFUSED: (CE_FORWARD_BYTES, CE_BACKWARD_BYTES), NATIVE: (NATIVE_FORWARD_BYTES, NATIVE_BACKWARD_BYTES),
              TE: (TE_FORWARD_BYTES, TE_BACKWARD_BYTES)}


def check_cross_entropy(fusion: bool, impl: str) -> None:
    if not isinstance(fusion, bool):
        raise SpecError(f"cross_entropy_loss_fusion must be true or false, got {fusion!r}")
    if impl not in CROSS_ENTROPY_FUSION_IMPLS:
        raise SpecError(f"unknown cross_entropy_fusion_impl {impl!r}; choose one of "
                        f"{', '.join(CROSS_ENTROPY_FUSION_IMPLS)}")
    if not fusion and impl != DEFAULT_CROSS_ENTROPY_FUSION_IMPL:
        raise SpecError(f"--cross-entropy-fusion-impl {impl} changes nothing without --cross-entropy-loss-fusion: "
                        "Megatron's implementation option picks the fused loss's kernels, and the loss is unfused")


def cross_entropy_path(fusion: bool, impl: str = DEFAULT_CROSS_ENTROPY_FUSION_IMPL) -> str:
    """The path Megatron's two options select: unfused unless `fusion`, else `impl`'s."""
    check_cross_entropy(fusion, impl)
    return impl if fusion else UNFUSED


def saved_logit_bytes(path: str, loss_bytes: int) -> int:
    """Bytes a logit of the copy the loss keeps for its backward (beside the bf16 logits): none
    under TE's kernels, which overwrite the logits with their gradient; else `loss_bytes` (the
    fp32 softmax Megatron's unfused and native paths keep)."""
    return 0 if path == TE else loss_bytes


def loss_kernels(tokens: int, vocab_slice: int, backward: bool, path: str = UNFUSED) -> list[Kernel]:
    """The loss's passes over one rank's `tokens x vocab_slice` logits, as one launch of their bytes."""
    if path not in PATH_BYTES:
        raise SpecError(f"unknown cross-entropy path {path!r}; choose one of {', '.join(CROSS_ENTROPY_PATHS)}")
    if path == UNFUSED:
        return lk.loss_kernels(tokens, vocab_slice, backward)
    n = tokens * vocab_slice
    forward, back = PATH_BYTES[path]
    return [_pass(f"loss{'.grad' if backward else ''} ({path})", n, n * (back if backward else forward))]


__all__ = ["CROSS_ENTROPY_FUSION_IMPLS", "CROSS_ENTROPY_PATHS", "DEFAULT_CROSS_ENTROPY_FUSION_IMPL", "NATIVE",
           "NATIVE_BACKWARD_BYTES", "NATIVE_FORWARD_BYTES", "PATH_BYTES", "TE", "TE_BACKWARD_BYTES", "TE_FORWARD_BYTES",
           "UNFUSED", "check_cross_entropy", "cross_entropy_path", "loss_kernels", "saved_logit_bytes"]
