"""FP8 training as Megatron runs it with Transformer Engine (`--precision fp8`; docs/design.md §9.3).

What runs in FP8: the GEMMs of the transformer layers' linear modules (TE's LayerNormLinear /
Linear / GroupedLinear: q, k, v, o, gate, up, down and the experts), forward, data gradient and
weight gradient, at the device's FP8 rate (`gpu.peak_flops.fp8`). Transformer Engine's default
format is HYBRID: E4M3 for the forward's activations and weights, E5M2 for the backward's gradients
(TE's recipe API, https://docs.nvidia.com/deeplearning/transformer-engine/user-guide/api/common.html);
both are one byte, so the simulator prices them alike. What stays in bf16: attention (Megatron-Bridge's
`MixedPrecisionConfig.fp8_dot_product_attention` defaults to False, and none of its FP8 recipes turn
it on: src/megatron/bridge/training/mixed_precision.py in NVIDIA-NeMo/Megatron-Bridge), the router,
norms and element-wise kernels, and the output layer (Megatron's `output_layer` is its own
ColumnParallelLinear, not a Transformer Engine module).

What FP8 costs beside its GEMMs, each priced as a memory-bound pass by its bytes
(`canzona.cost.elementwise_kernel`) or a small collective:

- a cast of every GEMM input to FP8 with its transpose (TE's fused cast-transpose: the backward's
  weight-gradient GEMM needs the transposed operand, Hopper's FP8 GEMMs take only the TN layout):
  per micro-batch the inputs of the column GEMMs (once for the block: q, k, v share it; gate, up
  share it) and of the row GEMM, and in backward the output gradients of every GEMM; read two
  bytes, write one plus one. The weights are cast (and transposed) once per iteration and reused
  by the later micro-batches (TE's `is_first_microbatch`, which Megatron sets per iteration); with
  FP8 primary weights (`fp8_params`: NeMo's `fp8_params`, Megatron's `fp8_param_gather`) the
  optimizer writes the FP8 weight itself and the first micro-batch only transposes it (read one
  byte, write one);
- the recipe's scaling. Delayed scaling (`DelayedScaling`, the only recipe of Transformer Engine 1.x
  and NeMo 24.07's; Megatron-Bridge's `bf16_with_fp8_delayed_scaling_mixed`: amax history 1024)
  takes the scale from the amax history, so a cast is one read; after each forward and each
  backward of a micro-batch on each model chunk (Megatron-Core enters one `fp8_autocast` per
  TransformerBlock call; Transformer Engine 1.x reduces at the region's exit and at the end of its
  first module's backward) the amaxes of all the stage's FP8 tensors (TE's one global buffer) are
  all-reduced, synchronously, over the amax reduction group (Megatron's, every TP x CP x DP rank
  of the pipeline stage) and one fused kernel rolls the histories and computes the scales. Current (per-tensor) scaling (`Float8CurrentScaling`,
  Megatron-Bridge's "tensorwise", its performance recipes' `fp8_cs` with the first and last layers
  left in FP8) reads each tensor twice, once for its amax and once to cast it ("two tensor reads
  were needed - one to compute the amax, and one to apply the scaling", TE's FP8 delayed scaling
  page, https://nvidia.github.io/TransformerEngine/features/low_precision_training/fp8_delayed_scaling/fp8_delayed_scaling.html),
  and the amax of an input gathered over sequence-parallel TP ranks is all-reduced over TP before
  its cast.

Not modelled: the layer norm's fusion with the cast of its output (TE's LayerNormLinear writes FP8
directly: this prices the cast as a separate pass, slightly pessimistic), FP8 parameter all-gathers
(`fp8_param_gather`) and FP8 attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from canzona.cost import Kernel, elementwise_kernel
from canzona.errors import SpecError
from canzona.hardware import HardwareProfile
from canzona.memory import fp8_linear_params
from canzona.spec import ModelSpec
from sim.collectives import collective_cost
from sim.topology import Cluster

PRECISIONS = ("bf16", "fp8")
DELAYED, CURRENT = "delayed", "current"
FP8_RECIPES = (DELAYED, CURRENT)
FP8 = "fp8"
# Megatron-Bridge's delayed-scaling recipe (and Transformer Engine's `DelayedScaling` default)
AMAX_HISTORY = 1024
AMAX_BYTES = 4  # one fp32 amax per FP8 tensor
# bytes one cast moves per element: read the bf16 tensor (2), write its FP8 copy (1) and the FP8
# transpose (1); current scaling reads it once more for its amax
CAST_BYTES = {DELAYED: 4, CURRENT: 6}
# bytes per element of an FP8 weight's transpose under FP8 primary weights (`fp8_params`): the
# optimizer writes the FP8 weight itself (in place of the bf16 one), and the first micro-batch of
# the iteration reads it (1) and writes its cached transpose (1)
FP8_PARAMS_TRANSPOSE_BYTES = 2


def check_precision(precision: str, recipe: str = DELAYED) -> None:
    if precision not in PRECISIONS:
        raise SpecError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if recipe not in FP8_RECIPES:
        raise SpecError(f"fp8 recipe must be one of {', '.join(FP8_RECIPES)}, got {recipe!r}")
    if recipe != DELAYED and precision != FP8:  # as a published row's fp8_recipe off an fp8 row
        # no FP8 cast runs to be scaled: Megatron ignores --fp8-recipe without --fp8-format, which
        # would leave the user believing it took effect
        raise SpecError(f"--fp8-recipe {recipe} is Transformer Engine's FP8 scaling: it needs --precision fp8 "
                        f"(got --precision {precision}, whose GEMMs run without FP8 casts to scale)")


def check_fp8_device(hw: HardwareProfile) -> None:
    """FP8 GEMMs need FP8 tensor cores: a profile without `gpu.peak_flops.fp8` has none."""
    if FP8 not in hw.gpu.peak_flops:
        raise SpecError(f"{hw.name} has no FP8 tensor cores (its profile gives no gpu.peak_flops.fp8): "
                        "--precision fp8 needs a Hopper-class GPU such as h100-sxm or h200")


@dataclass(frozen=True, kw_only=True)
class FP8Setup:
    """How one pipeline stage runs its FP8 linear layers.

    `micro_batches`: the micro-batches each weight cast serves (the weights are cast on the first
    of an iteration's and cached); `chunks`: model chunks on the stage (each runs its own FP8
    region per micro-batch); `amax_reduce_s`: one all-reduce of the stage's amaxes over the amax
    reduction group (delayed scaling); `tp_amax_s`: one all-reduce of one amax over the TP group
    (current scaling of a sequence-parallel input; 0 at TP 1); `fp8_params`: the weights are kept in
    FP8 (`sim.workload.Workload.fp8_params`), so a weight's cast is its transpose only."""

    recipe: str = DELAYED
    micro_batches: int = 1
    chunks: int = 1
    amax_reduce_s: float = 0.0
    tp_amax_s: float = 0.0
    fp8_params: bool = False

    def __post_init__(self) -> None:
        check_precision(FP8, self.recipe)
        if self.micro_batches < 1 or self.chunks < 1:
            raise SpecError(f"micro batches and chunks must be >= 1, got {self.micro_batches} and {self.chunks}")

    @classmethod
    def of(cls, wl: Any, micro_batches: int, **collectives: Any) -> FP8Setup:
        """A workload's (`sim.workload.Workload`) FP8 settings, its scaling recipe and whether its
        weights are kept in FP8, over `micro_batches` a weight cast serves: one reading of them for
        the simulation (`fp8_setup`, with the stage's chunks and collectives) and the search's time
        floor (without collectives)."""
        return cls(recipe=wl.fp8_recipe, micro_batches=micro_batches, fp8_params=wl.fp8_params, **collectives)

    def cast(self, name: str, rows: float, cols: float) -> Kernel:
        """Cast a `rows x cols` bf16 tensor to FP8 with its transpose (one fused pass)."""
        count = max(1, round(rows))
        return elementwise_kernel(f"{name}.fp8_cast", count, 2, CAST_BYTES[self.recipe] * cols, FP8)

    def weight_cast(self, name: str, numel: float) -> Kernel:
        """A weight's cast and transpose (its transpose only under `fp8_params`), amortised over the
        micro-batches that reuse it."""
        moved = FP8_PARAMS_TRANSPOSE_BYTES if self.fp8_params else CAST_BYTES[self.recipe]
        k = elementwise_kernel(f"{name}.fp8_weight_cast", max(1, round(numel)), 2, moved, FP8)
        return Kernel(k.name, k.kind, k.flops, k.bytes, k.dtype, 1.0 / self.micro_batches)

    def scale_update(self, tensors: int) -> Kernel:
        """Delayed scaling's fused amax-history roll and scale update over `tensors` FP8 tensors
        (read and write every history)."""
        return elementwise_kernel("fp8.amax_and_scale_update", max(1, tensors * AMAX_HISTORY), 1, 2 * AMAX_BYTES, FP8)

    def amax_buffer_bytes(self, tensors: int) -> float:
        return float(tensors * AMAX_BYTES)


def fp8_setup(wl: Any, hw: HardwareProfile, cluster: Cluster, spec: ModelSpec, stage: int = 0,
              chunks: int = 1) -> FP8Setup | None:
    """The FP8 setup of pipeline stage `stage` of a workload (`sim.workload.Workload`); None
    under bf16. The amax reduction group is every rank of the stage (Megatron's, over TP x CP x
    DP); its buffer holds one fp32 amax per forward FP8 tensor (input, weight, output of each
    linear GEMM), a few kilobytes, so its all-reduce costs about its latency."""
    if wl.precision != FP8:
        return None
    amaxes = 3 * len(fp8_linear_params(spec)) * AMAX_BYTES
    stage_group = cluster.geometry(list(cluster.stage_ranks(stage)))
    return FP8Setup.of(wl, wl.micro_batches(cluster.batch_dp), chunks=chunks,
                       amax_reduce_s=collective_cost("all-reduce", amaxes, stage_group, hw).seconds,
                       tp_amax_s=collective_cost("all-reduce", AMAX_BYTES, cluster.tp_geometry(), hw).seconds)
