"""Activation recompute modes: what each stores for the backward and what it computes again, written
once for the memory model (`canzona.memory.layer_activation_bytes`) and the simulator's compute
(`sim.model_work`).

- `none`: every activation is stored.
- `selective` (Megatron's `--recompute-granularity selective`, Korthikanti et al. 2022,
  arXiv 2205.05198 §5): the attention core is recomputed; everything else is stored.
- `selective-op` (torchtitan's per-op selective activation checkpointing,
  `--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op`): each
  decoder layer runs under `torch.utils.checkpoint` with a policy that saves the outputs of the ops
  in torchtitan's `_save_list` (`aten.mm`, the scaled-dot-product flash / efficient attention
  kernels and `_c10d_functional.reduce_scatter_tensor`), except every second `aten.mm` of the layer
  (its forward's mm count even), and recomputes every other op. Read from pytorch/torchtitan
  `torchtitan/parallelisms/parallelize_llama.py` (`_save_list`, `_apply_ac_to_transformer_block`,
  `_custom_policy`: "Saves output of all compute ops, except every second mm"), the version the
  published torchtitan A100 figures were measured with; the counter is per checkpointed layer (a
  fresh `meta` per checkpoint context). So of a Llama layer's mms in forward order (wq, wk, wv,
  wo, w1, w3, w2) the 1st, 3rd, 5th and 7th outputs are saved (wq, wv, w1, w2) and wk, wo, w3 are
  recomputed with the norms, rotary embedding, SwiGLU and residual adds; attention is not. Mixture-
  of-experts layers' grouped expert GEMMs are not `aten.mm`: the experts' GEMMs, permutes and SwiGLU
  are recomputed whole; their token dispatch and combine are not, since torchtitan's MoE save lists
  keep `_c10d_functional.all_to_all_single`'s output (pytorch/torchtitan
  `torchtitan/models/gpt_oss/infra/parallelize.py`, `_op_sac_save_list`) and NeMo AutoModel's
  selective policy the EP collectives' (DeepEP's, HybridEP's: NVIDIA-NeMo/Automodel
  `nemo_automodel/components/moe/parallelizer.py`, `apply_ac`: "the shared policy already saves
  expert-parallel communication collectives").
- `full` (every layer): only each layer's input is stored; its whole forward runs again, a
  mixture-of-experts layer's router, token dispatch, experts and combine included: Megatron's
  `recompute_granularity="full"` runs each layer's `TransformerLayer.forward` inside
  `tensor_parallel.checkpoint` (NVIDIA/Megatron-LM `megatron/core/transformer/transformer_block.py`,
  `_checkpointed_forward`), whose `MoELayer.forward` dispatches and combines anew (`moe_layer.py`;
  the flex dispatcher's managers drop their DeepEP / HybridEP handle after each combine,
  `token_dispatcher.py`, so the re-run dispatch computes its layout, and HybridEP its preprocessing,
  again); NeMo AutoModel's `activation_checkpointing: true` wraps every decoder block in torch's
  `checkpoint_wrapper` with no policy (`apply_ac`), and its `FusedDispatch.forward` runs DeepEP's
  `get_dispatch_layout` and `dispatch` every call (`nemo_automodel/components/moe/megatron/
  fused_a2a.py`). A dense block's collectives re-run likewise: at TP > 1 the re-run
  `TELayerNormColumnParallelLinear` (QKV, fc1) all-gathers its sequence-parallel input and
  `TERowParallelLinear` (proj, fc2) reduce-scatters its output again (all-reduces without
  sequence parallelism, which the simulator does not model), and under CP TE's attention, which
  runs inside the layer, exchanges K/V around its ring again (`AttnFuncWithCPAndKVP2P.forward`,
  NVIDIA/TransformerEngine `transformer_engine/pytorch/attention/dot_product_attention/
  context_parallel.py`). Megatron's checkpoint function (`megatron/core/tensor_parallel/random.py`,
  `CheckpointFunction`; under FP8 TE's `checkpoint`, `transformer_engine/pytorch/distributed.py`)
  runs the first forward under `torch.no_grad()` and the re-run with grad: TE's userbuffers TP
  overlap (`tp_comm_overlap`) applies to the re-run as to any forward, but without grad TE's
  LayerNormLinear gathers its input with NCCL before its GEMM instead of under it
  (`transformer_engine/pytorch/module/layernorm_linear.py`, `_LayerNormLinear.forward`: the
  userbuffers all-gather is turned off when `is_grad_enabled` is false), while Linear's
  userbuffers reduce-scatter is not gated (`linear.py`). torch's non-reentrant checkpoint wrapper
  (torchtitan, NeMo AutoModel) keeps grad on in the first forward. Megatron's
  `recompute_method` "uniform" checkpoints groups of `recompute_num_layers` layers (each group's
  input stored, its layers' forwards re-run together before their backwards) and "block" only the
  first `recompute_num_layers` layers of each pipeline stage (the rest store everything); the
  simulator's `full` is every layer recomputed, each before its own backward (uniform with one
  layer a group; per-layer groups of more layers recompute the same work in another order).
"""

from __future__ import annotations

from collections.abc import Sequence

from canzona.choices import check_choice

NONE, SELECTIVE, SELECTIVE_OP, FULL = "none", "selective", "selective-op", "full"
# from the least recompute (most memory) to the most: the search tries them in this order
RECOMPUTE_MODES = (NONE, SELECTIVE, SELECTIVE_OP, FULL)


def check_recompute(mode: str) -> str:
    return check_choice(mode, RECOMPUTE_MODES, "recompute mode")


def forward_without_grad(mode: str) -> bool:
    """Whether Megatron runs each layer's first forward under `torch.no_grad()` under recompute
    `mode`: under full recompute its checkpoint function does (the module docstring), where TE's
    LayerNormLinear gathers its sequence-parallel input with NCCL before its GEMM instead of under
    it (`sim.iteration._Stage.block`, `sim.search.block_floor`); the re-run has grad."""
    return mode == FULL


def mm_saved(position: int) -> bool:
    """Under `selective-op`, whether a layer's `position`-th matrix multiply (0-based, forward order)
    has its output saved: torchtitan counts them from 1 and recomputes those with an even count."""
    return position % 2 == 0


def saved_mm_widths(widths: Sequence[float]) -> float:
    """The summed output widths of the mms `selective-op` saves, of a layer's mms in forward order."""
    return sum(w for i, w in enumerate(widths) if mm_saved(i))


__all__ = ["FULL", "NONE", "RECOMPUTE_MODES", "SELECTIVE", "SELECTIVE_OP", "check_recompute",
           "forward_without_grad", "mm_saved", "saved_mm_widths"]
