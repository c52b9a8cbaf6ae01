"""The training workload of one Megatron-style iteration: batch geometry and model FLOPs."""

from __future__ import annotations

from dataclasses import dataclass

from canzona.choices import check_choice
from canzona.decoder import Architecture
from canzona.errors import SpecError
from canzona.spec import DTYPE_BYTES, ModelSpec, Role
from canzona.step_options import STEP_DEFAULTS
from sim.cross_entropy import (
    DEFAULT_CROSS_ENTROPY_FUSION_IMPL,
    UNFUSED,
    cross_entropy_path,
    saved_logit_bytes,
)
from sim.eager_kernels import EAGER, FUSED, check_kernels
from sim.fp8 import FP8, check_precision

# A guard against mistakes, nothing of Megatron's: above sim.steady.EXACT_MICRO_BATCHES (256) the
# iteration is extrapolated from two shorter ones (whose cost does not grow with the count), so the
# simulation stays fast; at most 256 every micro-batch is simulated. Beyond 1M tokens a sequence is
# not a training setup.
MAX_MICRO_BATCHES = 1024
MAX_SEQ_LEN = 2**20
MAX_GLOBAL_BATCH = 2**24  # sequences; with MAX_SEQ_LEN, FLOP counts stay far inside a float


def grad_bytes_for(grad_reduce_in_fp32: bool | None, master_weights: bool = STEP_DEFAULTS.master_weights) -> int:
    """Bytes per gradient element under Megatron's DDP option `grad_reduce_in_fp32`: fp32 buffers
    and reductions (its default for bf16 training), else bf16. None: the default of a run with or
    without master weights (`Workload.master_weights`): fp32 beside fp32 masters (Megatron's,
    canzona's runtime's), the bf16 parameters' own dtype without them (DistributedOptimizer(
    master_weights=False) reduces and keeps its gradients in the parameters' dtype)."""
    if grad_reduce_in_fp32 is None:
        grad_reduce_in_fp32 = master_weights
    return DTYPE_BYTES["fp32"] if grad_reduce_in_fp32 else DTYPE_BYTES["bf16"]


def loss_bytes_for(fp32_upcast: bool) -> int:
    """Bytes a logit of the loss's saved copies (`Workload.loss_bytes`): fp32 where the loss upcasts
    the bf16 logits (Megatron's unfused loss, torchtitan's, Hugging Face's), else bf16 (NeMo
    AutoModel's MaskedCrossEntropy(fp32_upcast=False))."""
    return DTYPE_BYTES["fp32"] if fp32_upcast else DTYPE_BYTES["bf16"]


@dataclass(frozen=True)
class Workload:
    seq_len: int = 4096
    global_batch: int = 128  # sequences per iteration
    micro_batch: int = 1  # sequences per micro-batch per DP rank
    grad_bytes: int = DTYPE_BYTES["fp32"]  # Megatron reduces gradients in fp32 by default (grad_bytes_for)
    param_bytes: int = 2  # bf16 parameters are all-gathered
    activation_bytes: int = 2  # bf16 activations cross TP (sequence parallel)
    causal: bool = True
    dtype: str = "bf16"  # the model's GEMMs and activations
    # "fp8": the layers' linear GEMMs in FP8 through Transformer Engine, under `fp8_recipe`
    # ("delayed" or "current" scaling: sim.fp8); attention, norms and the head stay in `dtype`
    precision: str = "bf16"
    fp8_recipe: str = "delayed"
    # bytes a logit of the copy the loss keeps for its backward (canzona.memory.MemorySetup's
    # loss_bytes): fp32, Megatron's; 2 for a loss that does not upcast the bf16 logits
    loss_bytes: int = DTYPE_BYTES["fp32"]
    # the training loop keeps the model's logits alive through the backward, beside PyTorch's
    # F.cross_entropy (canzona.memory.MemorySetup.loss_holds_logits): NeMo AutoModel's loop holds the
    # model's output; torchtitan's deletes it before the backward and Hugging Face's Trainer drops it
    # once compute_loss returns (False). The FSDP2 frameworks' only: Megatron's loss holds none
    loss_holds_logits: bool = False
    # the runtime's DistributedOptimizer(master_weights=...), same name and default
    # (canzona.memory.MemorySetup.master_weights): True, mixed precision's fp32 masters of the bf16
    # weights (canzona's runtime; Megatron's distributed optimizer; torchtitan builds its model in
    # fp32 and FSDP2 gathers bf16 copies); False, no fp32 copy: the optimizer state that follows the
    # update and the kept gradient shards in the parameters' dtype, as DistributedOptimizer(
    # master_weights=False) and a model built in bf16 under FSDP2 with torch's AdamW (NeMo AutoModel's)
    master_weights: bool = STEP_DEFAULTS.master_weights
    # the layers' memory-bound kernels (norms, RoPE, SwiGLU, the loss): "fused" (Transformer Engine /
    # Megatron's fused kernels) or "eager" (PyTorch's eager ops, e.g. torchtitan with compile =
    # false): sim.eager_kernels
    kernels: str = FUSED
    # Megatron's TransformerConfig cross_entropy_loss_fusion / cross_entropy_fusion_impl (the loss's
    # path, sim.cross_entropy): off by default, as Megatron's and canzona's examples' upcast loss
    cross_entropy_loss_fusion: bool = False
    cross_entropy_fusion_impl: str = DEFAULT_CROSS_ENTROPY_FUSION_IMPL
    # Megatron's OptimizerConfig.store_param_remainders under its precision-aware optimizer (and
    # Apex DistributedFusedAdam's, which NeMo sets for a bf16 model with an fp32 optimizer): the
    # optimizer keeps only the 16 low bits of each fp32 master, the bf16 weight being the other
    # half (canzona.memory.MemorySetup.store_param_remainders); off: full fp32 masters, canzona's
    # runtime's and Megatron's default distributed optimizer's
    store_param_remainders: bool = False
    # FP8 primary weights (NeMo 1.x's `fp8_params`, Transformer Engine's `fp8_model_init`, Megatron's
    # `--fp8-param-gather`): under FP8 the linear layers' weights are kept in FP8 with their cached
    # transpose, no bf16 copy beside them, and the optimizer keeps full fp32 masters
    # (canzona.memory.MemorySetup.fp8_params; sim.fp8.FP8Setup.fp8_params)
    fp8_params: bool = False
    # Megatron-core's TransformerConfig options of these names (its defaults are False; NeMo's and
    # Megatron-Bridge's Llama configs set both): off, the layer runs Megatron's unfused RoPE /
    # SwiGLU (sim.unfused_kernels) instead of the fused kernels; True here, the simulator's
    # fused model, for every recipe that does not say otherwise
    apply_rope_fusion: bool = True
    bias_activation_fusion: bool = True

    def __post_init__(self) -> None:
        for field in ("seq_len", "global_batch", "micro_batch", "grad_bytes", "param_bytes", "activation_bytes",
                      "loss_bytes"):
            if getattr(self, field) < 1:
                raise SpecError(f"{field.replace('_', ' ')} must be >= 1, got {getattr(self, field)}")
        check_choice(self.dtype, DTYPE_BYTES, "dtype")
        check_precision(self.precision, self.fp8_recipe)
        check_kernels(self.kernels)
        if self.loss_bytes != DTYPE_BYTES["fp32"] and self.cross_entropy != UNFUSED:
            raise SpecError("a loss without the fp32 upcast (--no-loss-fp32-upcast) is the unfused loss on bf16 logits; "
                            "Megatron's fused cross-entropy (--cross-entropy-loss-fusion) computes in fp32")
        if self.cross_entropy != UNFUSED and self.kernels == EAGER:
            raise SpecError("cross-entropy loss fusion is Megatron's (fused kernels); eager kernels run the unfused loss")
        if not isinstance(self.master_weights, bool):
            raise SpecError(f"master_weights must be true or false, got {self.master_weights!r}")
        if not isinstance(self.loss_holds_logits, bool):
            raise SpecError(f"loss_holds_logits must be true or false, got {self.loss_holds_logits!r}")
        if not isinstance(self.store_param_remainders, bool):
            raise SpecError(f"store_param_remainders must be true or false, got {self.store_param_remainders!r}")
        if not isinstance(self.fp8_params, bool):
            raise SpecError(f"fp8_params must be true or false, got {self.fp8_params!r}")
        if not self.master_weights and (self.store_param_remainders or self.fp8_params):
            raise SpecError(f"--{'store-param-remainders' if self.store_param_remainders else 'fp8-params'} describes "
                            "how an optimizer keeps its fp32 masters: it needs master weights (not --no-master-weights)")
        if self.fp8_params and self.precision != FP8:
            raise SpecError(f"--fp8-params keeps the linear layers' weights in FP8: it needs --precision fp8 "
                            f"(got --precision {self.precision})")
        if self.fp8_params and self.store_param_remainders:
            raise SpecError("--fp8-params with --store-param-remainders: an FP8 weight does not hold an fp32 "
                            "master's high 16 bits, so the optimizer keeps full fp32 masters (NeMo sets "
                            "store_params for fp8_params)")
        for field in ("apply_rope_fusion", "bias_activation_fusion"):
            if not isinstance(getattr(self, field), bool):
                raise SpecError(f"{field} must be true or false, got {getattr(self, field)!r}")
            if not getattr(self, field) and self.kernels != FUSED:
                raise SpecError(f"{field} is Megatron's fused-kernel option; with kernels {self.kernels!r} the "
                                "layers' kernels are unfused already")
        if self.seq_len > MAX_SEQ_LEN:
            raise SpecError(f"seq len must be <= {MAX_SEQ_LEN}, got {self.seq_len}")
        if self.global_batch > MAX_GLOBAL_BATCH or self.micro_batch > self.global_batch:
            raise SpecError(f"global batch must be <= {MAX_GLOBAL_BATCH} sequences and micro batch <= global "
                            f"batch, got {self.global_batch} and {self.micro_batch}")

    @property
    def cross_entropy(self) -> str:
        """The loss's path (sim.cross_entropy): unfused, native or te."""
        return cross_entropy_path(self.cross_entropy_loss_fusion, self.cross_entropy_fusion_impl)

    @property
    def loss_copy_bytes(self) -> int:
        """Bytes a logit of the copy the loss keeps for its backward (MemorySetup.loss_bytes): none
        under Transformer Engine's fused cross-entropy, which overwrites the logits in place."""
        return saved_logit_bytes(self.cross_entropy, self.loss_bytes)

    def micro_batches(self, dp: int) -> int:
        per_step = dp * self.micro_batch
        if self.global_batch % per_step:
            raise SpecError(f"global batch {self.global_batch} is not divisible by dp x micro batch "
                            f"= {dp} x {self.micro_batch}")
        count = self.global_batch // per_step
        if count > MAX_MICRO_BATCHES:
            raise SpecError(f"global batch {self.global_batch} means {count} micro-batches per DP rank; the "
                            f"simulator runs at most {MAX_MICRO_BATCHES} (raise --micro-batch or lower "
                            "--global-batch)")
        return count

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.seq_len * self.micro_batch


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs of one micro-batch, whole model (divide by TP for one rank)."""

    per_layer: tuple[float, ...]
    head: float

    @property
    def total(self) -> float:
        return sum(self.per_layer) + self.head


def forward_flops(arch: Architecture, spec: ModelSpec, wl: Workload) -> LayerFlops:
    """`2 * params * tokens` for the layer matrices (by layer, from the spec; an expert's matrices
    over the tokens routed to it: the active parameters) and the head (`vocab x hidden`), plus
    attention scores and values (`4 * seq * q_dim` per token, halved when causal)."""
    tokens = wl.tokens_per_micro_batch
    matrices = [0.0] * arch.layers
    gemms = list(spec.own_matrices()) + \
        [p for p in spec.params if p.matrix_shape is not None or (p.role is Role.ROUTER and len(p.shape) == 2)]
    for p in gemms:
        if p.layer is not None:
            matrices[p.layer] += p.numel * arch.tokens_share(p)
    attention = 4.0 * wl.seq_len * arch.q_dim * tokens * (0.5 if wl.causal else 1.0)
    per_layer = tuple(2.0 * m * tokens + attention for m in matrices)
    return LayerFlops(per_layer, 2.0 * arch.hidden * arch.vocab * tokens)
