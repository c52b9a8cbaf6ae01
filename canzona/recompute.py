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
- `full` (every layer): only each layer's input is stored; its whole forward runs again (torch's
  wrappers: up to their early stop, "Where the re-run stops" below), a
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
  (torchtitan, NeMo AutoModel) keeps grad on in the first forward.

- `selective-layer` (torchtitan's per-layer selective activation checkpointing,
  `--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option K`, an
  integer; the simulator's `--selective-ac-option`, default 2 as torchtitan's): every K-th
  TransformerBlock runs inside torch's `checkpoint_wrapper` with no policy (as `full` does every
  layer: only its input stored, its forward run again before its backward, up to torch's early
  stop), the others
  outside any checkpoint, storing everything. Which blocks: `_apply_ac_to_transformer_block`
  increments a counter kept on the wrapper function (`ptd_checkpoint_wrapper._count`, from 0,
  one per block `apply_ac` passes, in `model.layers` order) and wraps the block when `_count % K
  == 0`: the K-th, 2K-th, ... block, 0-based positions K - 1, 2K - 1, ...; K past the layers
  wraps none (every block stores everything, as `none`). Read from pytorch/torchtitan
  `torchtitan/parallelisms/parallelize_llama.py` at 004b3148a92b565ef0ce7a7bcc61e0159c7ec930 (the
  earlier `torchtrain/parallelisms/parallelize_llama.py` at
  00560676335496bcb220fb5ef5b44a3c6fc7e87a, the Llama 2 figures' time, has the same counter and
  modulo), default "2" ("2 = checkpoint every other layer") in `torchtitan/config_manager.py`
  at 0011fb905e9561a51af0f265e35d989f7448b1d8. torchtitan also takes K = 0 as every block; the
  simulator refuses it (`--recompute full` is that). The counter lives on the function, not on
  the model: over a rank's model chunks it runs on from one chunk to the next
  (`selective_layer_checkpointed`). It is torchtitan's, simulated under `--fsdp`; Megatron has no
  such option (its partial checkpointing is `--recompute-method block`, below, which keeps the
  same bytes and re-runs the same work for the same number of layers).

Where the re-run stops (`rerun_stops_early`). torch's non-reentrant checkpoint, which torchtitan's
and NeMo AutoModel's wrappers run (an FSDP2 layout's recompute here; Megatron-FSDP's is Megatron's,
`sim.fsdp.fsdp_checkpoint`), re-runs a checkpointed
layer's forward only until it has saved again as many tensors as the first forward saved, then
raises `_StopRecomputationError` and returns to the backward ("early stop", on by default:
pytorch/pytorch `torch/utils/checkpoint.py`, `_recomputation_hook.pack_hook`, with the frame's
`early_stop` defaulting to True, `set_checkpoint_early_stop` the switch; torchtitan's
`ptd_checkpoint_wrapper(module, preserve_rng_state=False)` at 004b3148, and the torchtrain version
at 00560676, pass nothing that turns it off). **Assumption**: the 2024 torch builds the published
torchtitan runs used stopped early by default, as every version read does. An op saves its
inputs for the backward before it runs (autograd's generated code records its `SavedVariable`s,
then dispatches the kernel), so the re-run stops on entering the layer's last op that saves
anything: in a dense Llama layer the MLP's down projection (`w2`: its `mm` saves its input and
weight), whose GEMM and the residual add after it (an add saves nothing) are not run again.
Checked on torch 2.13 (CPU): a Llama block under `checkpoint_wrapper(CheckpointImpl.NO_REENTRANT)`
re-runs wq / wk / wv / attention / wo / w1 / silu / w3 / the SwiGLU product, then goes straight to
w2's data- and weight-gradient GEMMs. Under selective-op nothing changes but the add (the down
projection's output is among those it saves, so its GEMM did not re-run anyway). Megatron's
checkpoint (`CheckpointFunction.backward` calls `run_function` on the detached inputs, then
backward through its outputs) re-runs the whole forward. Under TP the stop skips the down
projection's output reduce-scatter with its GEMM (`sim.model_work.Block.sends_output`). A
mixture-of-experts layer's last saving op depends on its dispatcher: under DeepEP's (NeMo
AutoModel's MoE layer) it is the unpermute before the combine, whose autograd function saves no
tensor, so the re-run skips the combine all-to-all and the residual add
(`sim.model_work._expert_rerun`; NVIDIA-NeMo/Automodel `components/moe/megatron/fused_a2a.py`
`FusedCombine`, `token_dispatcher.py` `_DeepepManager`); under HybridEP and the `alltoall`
dispatcher, and in a layer with a shared expert (which may run after the combine and save its
inputs there), the re-run is priced whole (conservative).

Megatron's full recompute comes with a method (`--recompute-method`, `--recompute-num-layers` N:
`RECOMPUTE_METHODS`), which the simulator's `full` takes too; without one (Megatron requires one:
its TransformerConfig raises "recompute_method must be block or uniform" under granularity full)
it is every layer, each checkpointed on its own, which is what `uniform` with N = 1 and `block`
with N at least a chunk's layers run. Read from NVIDIA/Megatron-LM
`megatron/core/transformer/transformer_block.py` (`TransformerBlock._checkpointed_forward`, over
`self.layers`: one model chunk's layers, a virtual pipeline stage's under the interleaved schedule,
since each chunk is its own TransformerBlock and `num_layers_per_pipeline_rank = len(self.layers)`)
and `megatron/training/arguments.py` (`--recompute-method`, `--recompute-num-layers`):
- `uniform`: the chunk's layers in consecutive groups of N, each group one checkpoint: only the
  group's input is stored, and its backward first runs the N layers' forwards again together, so
  the N layers' whole activations are alive at once (`checkpoint_groups`). The loop calls
  `custom(l, l + N)` while `l` < the chunk's layers and indexes every layer up to `l + N`: N must
  divide each chunk's layers or the last group runs past the chunk's end (`check_method_layers`).
- `block`: the first N layers of each chunk are checkpointed one at a time, the rest run outside
  any checkpoint and store everything (granularity `full` turns selective recompute off:
  `checkpoint_core_attention` is `recompute_granularity == 'selective'`), their forward with grad
  (`checkpointed`); N at or past the chunk's layers checkpoints them all. Under FP8 Megatron shifts
  the window one layer on while the block's input needs no gradient (`recompute_skip_num_layers`),
  which does not arise in training (the first stage's input is the trainable embedding's output,
  the others' the received activations that need their gradient).
Megatron's TransformerConfig requires N with a method under full ("recompute_num_layers must be
between 1 and num_layers_per_pipeline_rank", only N given being checked) and refuses both under
selective; arguments.py refuses a method under selective ("recompute method is not yet supported
for selective recomputing granularity"). The simulator's own times: a uniform group re-runs the
same forwards as N = 1, before the group's first backward rather than each layer's (the same work
on the same chain, in another order, as `sim.model_work.rerun_forward` says of a layer's blocks).
"""

from __future__ import annotations

from collections.abc import Sequence

from canzona.choices import check_choice
from canzona.errors import SpecError

NONE, SELECTIVE, SELECTIVE_OP, FULL = "none", "selective", "selective-op", "full"
SELECTIVE_LAYER = "selective-layer"
# every mode the simulator runs, from the least recompute (most memory) to the most, then torchtitan's
# selective-layer, whose place by memory depends on K and the layout (at TP 1 its default K = 2
# stores more than selective-op, half the layers whole; under TP less, selective-op keeping its
# row-parallel outputs whole) and by compute on the model (a mixture-of-experts layer's selective-op
# re-runs its experts whole): the FSDP search orders a layout's modes by their time floors, not by this
RECOMPUTE_MODES = (NONE, SELECTIVE, SELECTIVE_OP, FULL, SELECTIVE_LAYER)
# the modes only torchtitan's checkpoint wrappers run: simulated under --fsdp only
FSDP_ONLY_MODES = (SELECTIVE_LAYER,)
# torchtitan's --activation_checkpoint.selective_ac_option default, "2": every other layer
SELECTIVE_AC_DEFAULT = 2


# Megatron's --recompute-method under full recompute (the module docstring); None: every layer
UNIFORM, BLOCK = "uniform", "block"
RECOMPUTE_METHODS = (UNIFORM, BLOCK)


def check_recompute(mode: str) -> str:
    return check_choice(mode, RECOMPUTE_MODES, "recompute mode")


def layout_recompute_modes(fsdp: bool) -> tuple[str, ...]:
    """The recompute modes the simulator runs on a layout: under --fsdp every one, on Megatron's
    ZeRO-1 layout all but torchtitan's (`FSDP_ONLY_MODES`). One definition for the simulator's
    check (`check_selective_ac_option`) and the modes each of the search's spaces tries."""
    return RECOMPUTE_MODES if fsdp else tuple(m for m in RECOMPUTE_MODES if m not in FSDP_ONLY_MODES)


def check_recompute_method(mode: str, method: str | None, num_layers: int | None) -> None:
    """Megatron's rules for `--recompute-method` and `--recompute-num-layers` (the module
    docstring), one `SpecError` line each: both or neither, N a whole number >= 1, only with
    `full` recompute. The rule that needs the layers: `check_method_layers`."""
    if method is not None:
        check_choice(method, RECOMPUTE_METHODS, "recompute method")
    if num_layers is not None and not (isinstance(num_layers, int) and not isinstance(num_layers, bool)
                                       and num_layers >= 1):
        raise SpecError(f"--recompute-num-layers must be a whole number >= 1, got {num_layers!r}")
    if (method is None) != (num_layers is None):
        raise SpecError("--recompute-method and --recompute-num-layers go together (Megatron: a method needs "
                        "recompute_num_layers, the layers of a uniform group or the checkpointed layers of a block)")
    if method is not None and mode != FULL:
        raise SpecError(f"--recompute-method {method} is for --recompute full, got --recompute {mode} (Megatron: "
                        "recompute method is not yet supported for selective recomputing granularity)")


def check_selective_ac_option(mode: str, every: int | None, fsdp: bool = True) -> None:
    """`--selective-ac-option K` (torchtitan's `selective_ac_option` as an integer, the module
    docstring): a whole number >= 1, only with `--recompute selective-layer`, which is only
    simulated under `--fsdp` (torchtitan's). One `SpecError` line each."""
    if every is not None and not (isinstance(every, int) and not isinstance(every, bool) and every >= 1):
        raise SpecError(f"--selective-ac-option must be a whole number >= 1 (every K-th layer checkpointed; "
                        f"--recompute full checkpoints every layer), got {every!r}")
    if every is not None and mode != SELECTIVE_LAYER:
        raise SpecError(f"--selective-ac-option {every} is for --recompute selective-layer (torchtitan: an integer "
                        f"selective_ac_option is selective layer checkpointing), got --recompute {mode}")
    if mode not in layout_recompute_modes(fsdp):  # selective-layer, the one FSDP-only mode
        raise SpecError(f"--recompute {mode} is torchtitan's, simulated under --fsdp; Megatron's partial "
                        "checkpointing is --recompute full --recompute-method block --recompute-num-layers N")


def selective_ac_every(every: int | None) -> int:
    """The K of `--selective-ac-option` (None: torchtitan's default, `SELECTIVE_AC_DEFAULT`)."""
    return SELECTIVE_AC_DEFAULT if every is None else every


def selective_layer_checkpointed(every: int | None, position: int) -> bool:
    """Under `selective-layer`, whether the `position`-th layer (0-based) torchtitan's counter has
    passed on a rank is checkpointed: the counter reaches `position + 1` there, and the block is
    wrapped when that is a multiple of K."""
    return (position + 1) % selective_ac_every(every) == 0


def check_method_layers(method: str | None, num_layers: int | None, chunk_sizes: Sequence[int]) -> None:
    """Under `uniform`, N must divide every model chunk's layers (`chunk_sizes`): Megatron's loop
    indexes the last group's layers past the chunk's end otherwise. `block` takes any N."""
    if method != UNIFORM or num_layers is None:
        return
    bad = sorted({c for c in chunk_sizes if c % num_layers})
    if bad:
        raise SpecError(f"--recompute-method uniform --recompute-num-layers {num_layers}: a model chunk of {bad[0]} "
                        f"layers does not split into groups of {num_layers} (Megatron's _checkpointed_forward runs "
                        "each chunk's layers in whole groups)")


def recompute_label(mode: str, method: str | None = None, num_layers: int | None = None,
                    every: int | None = None) -> str:
    """A recompute mode for people: "full (block 4)" under Megatron's method, "selective-layer
    (every 2)" under torchtitan's, else the mode."""
    if mode == SELECTIVE_LAYER:
        return f"{mode} (every {selective_ac_every(every)})"
    return f"{mode} ({method} {num_layers})" if method is not None else mode


def torchtitan_ac(mode: str, every: int | None = None) -> str | None:
    """torchtitan's `[activation_checkpoint]` settings that run `mode` (the module docstring: its
    `mode` none / full / selective, and under selective its `selective_ac_option`, "op" or the
    layer frequency K); None for Megatron's attention-core `selective`, which torchtitan has not."""
    if mode == SELECTIVE_LAYER:
        return f"activation_checkpoint.mode = 'selective', activation_checkpoint.selective_ac_option = " \
               f"'{selective_ac_every(every)}'"
    if mode == SELECTIVE_OP:
        return "activation_checkpoint.mode = 'selective', activation_checkpoint.selective_ac_option = 'op'"
    return f"activation_checkpoint.mode = '{mode}'" if mode in (NONE, FULL) else None


def checkpointed(method: str | None, num_layers: int | None, position: int) -> bool:
    """Whether the `position`-th layer of a model chunk (0-based) runs inside a checkpoint under
    full recompute: its first forward without grad, again before its backward. `block`: the first
    N; otherwise every layer."""
    return method != BLOCK or num_layers is None or position < num_layers


def checkpoint_groups(method: str | None, num_layers: int | None, chunk_size: int) -> tuple[int, int]:
    """Of a model chunk of `chunk_size` layers under full recompute: (the checkpoints whose input
    is stored, the layers one re-run makes alive at once). Every layer alone (no method): one a
    layer, one layer; `uniform` N: one a group of N, N layers; `block` N: one for each of the first
    N (the rest store everything), one layer."""
    if method == UNIFORM and num_layers is not None:
        return -(-chunk_size // num_layers), min(num_layers, chunk_size)
    if method == BLOCK and num_layers is not None:
        return min(num_layers, chunk_size), min(1, chunk_size)
    return chunk_size, min(1, chunk_size)


def checkpointed_layers(method: str | None, num_layers: int | None,
                        chunks: Sequence[Sequence[int]]) -> frozenset[int]:
    """The layer ids of `chunks` (each model chunk's layers, in order) that run inside a checkpoint
    under full recompute (`checkpointed`)."""
    return frozenset(layer for chunk in chunks for i, layer in enumerate(chunk) if checkpointed(method, num_layers, i))


def selective_layers(every: int | None, chunks: Sequence[Sequence[int]]) -> frozenset[int]:
    """The layer ids of `chunks` (a rank's model chunks' layers, in order) that run inside a
    checkpoint under `selective-layer` (`selective_layer_checkpointed`: torchtitan's counter runs
    on over the chunks)."""
    layers = [layer for chunk in chunks for layer in chunk]
    return frozenset(layer for i, layer in enumerate(layers) if selective_layer_checkpointed(every, i))


def inside_layers(mode: str, method: str | None, num_layers: int | None, every: int | None,
                  chunks: Sequence[Sequence[int]]) -> frozenset[int] | None:
    """The layer ids of a rank's `chunks` that run inside a checkpoint where only some do:
    torchtitan's selective-layer (`selective_layers`), Megatron's method under full recompute
    (`checkpointed_layers`); None where the mode treats every layer alike."""
    if mode == SELECTIVE_LAYER:
        return selective_layers(every, chunks)
    if mode == FULL and method is not None:
        return checkpointed_layers(method, num_layers, chunks)
    return None


def reruns_whole(mode: str) -> bool:
    """Whether `mode` runs its checkpointed layers' whole forwards again before their backwards
    (`full`: every layer, or a Megatron method's; `selective-layer`: every K-th), storing only
    their inputs; its other layers store everything."""
    return mode in (FULL, SELECTIVE_LAYER)


# whose checkpoint re-runs a layer: torch's non-reentrant wrapper (torchtitan's, NeMo AutoModel's)
# or Megatron's `CheckpointFunction` (Megatron-LM's, Megatron-Bridge's)
TORCH_CHECKPOINT, MEGATRON_CHECKPOINT = "torch", "megatron"


def rerun_stops_early(checkpoint: str) -> bool:
    """Whether a re-run by `checkpoint` (`TORCH_CHECKPOINT` or `MEGATRON_CHECKPOINT`) stops at the
    layer's last saving op (the module docstring, "Where the re-run stops"): torch's
    non-reentrant checkpoint wrapper does; Megatron's `CheckpointFunction` re-runs the whole
    forward."""
    if checkpoint not in (TORCH_CHECKPOINT, MEGATRON_CHECKPOINT):
        raise ValueError(f"unknown checkpoint {checkpoint!r}")
    return checkpoint == TORCH_CHECKPOINT


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


__all__ = ["BLOCK", "FULL", "NONE", "RECOMPUTE_METHODS", "RECOMPUTE_MODES", "SELECTIVE", "SELECTIVE_AC_DEFAULT",
           "SELECTIVE_LAYER", "SELECTIVE_OP", "UNIFORM", "check_method_layers", "check_recompute",
           "check_recompute_method", "check_selective_ac_option", "checkpoint_groups", "checkpointed",
           "FSDP_ONLY_MODES", "layout_recompute_modes", "torchtitan_ac",
           "checkpointed_layers", "forward_without_grad", "rerun_stops_early", "TORCH_CHECKPOINT",
           "MEGATRON_CHECKPOINT", "inside_layers", "recompute_label", "mm_saved", "reruns_whole",
           "saved_mm_widths", "selective_ac_every", "selective_layer_checkpointed", "selective_layers"]
