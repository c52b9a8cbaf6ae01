"""How the simulated training job runs: the Megatron options that decide what overlaps what."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from canzona.attention_rate import DEFAULT_ATTENTION_BACKEND, check_attention_backend
from canzona.choices import check_choice
from canzona.errors import SpecError
from canzona.memory import check_recompute
from canzona.recompute import check_recompute_method, check_selective_ac_option
from canzona.reductions import check_reduce_scatter
from canzona.step_collectives import COLLECTIVE_STYLES as COLLECTIVE_MODES
from canzona.step_options import STEP_DEFAULTS
from sim.ep_dispatch import EpDispatcher
from sim.userbuffers import DEFAULT_UB_CONFIG, check_ub_config, check_ub_config_applies


@dataclass(frozen=True)
class RunOptions:
    """Defaults follow NVIDIA's Megatron performance recipes for large dense models on H100:
    `--overlap-grad-reduce`, `--overlap-param-gather` and Transformer Engine's TP communication
    overlap on, no activation recompute."""

    overlap_grad_reduce: bool = True  # bucket reduce-scatters start during the last backward
    # Megatron's align_grad_reduce (on unless --no-align-grad-reduce; Megatron-Bridge's
    # DistributedInitConfig.align_grad_reduce and NeMo 1.x's optim.align_grad_reduce default to it,
    # and NeMo 1.x's Apex distributed Adam always passes its grad_sync_func): under pipeline
    # parallelism with overlap_grad_reduce the schedule, not the backward hooks, launches each model
    # chunk's whole gradient reduction, pipeline rank r `r` backward steps after the chunk's last
    # micro-batch, so the ranks launch together (sim.iteration._Stage.aligned)
    align_grad_reduce: bool = True
    overlap_param_gather: bool = STEP_DEFAULTS.overlap_param_gather  # the step's parameter all-gathers run under the next forward
    tp_comm_overlap: bool = True  # sequence-parallel all-gather / reduce-scatter hidden behind GEMMs
    # the overlap's userbuffers configuration, by its recipe name (Megatron-Bridge's tp_comm_overlap_cfg,
    # sim.userbuffers: each GEMM's method, SMs, chunks and margin); the default is NVIDIA's bf16 H100
    # Llama 3 70B one. Refused where it changes nothing (sim.userbuffers.check_ub_config_applies)
    tp_comm_overlap_cfg: str = DEFAULT_UB_CONFIG
    # "none", "selective" (attention core), "selective-op" (torchtitan's per-op policy),
    # "selective-layer" (torchtitan's every K-th layer checkpointed, under --fsdp) or "full" (every
    # layer): canzona.recompute
    recompute: str = "none"
    # under full recompute, Megatron's --recompute-method ("uniform": groups of N layers, each
    # group's input stored and its forwards re-run together; "block": the first N layers of each
    # model chunk checkpointed, the rest storing everything) and --recompute-num-layers N; None:
    # every layer checkpointed on its own (canzona.recompute)
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    # under selective-layer, torchtitan's --activation_checkpoint.selective_ac_option K: every K-th
    # layer checkpointed (None: torchtitan's default, 2; canzona.recompute)
    selective_ac_option: int | None = None
    # how gradients are reduce-scattered (canzona.reductions): the runtime's option, name and default
    reduce_scatter: str = STEP_DEFAULTS.reduce_scatter
    # "megatron": each policy's DP collectives as Megatron would run them (all-reduce for sc and
    # layerwise, only the split parts of matrices for zero1-gather); "runtime": exactly the
    # collectives canzona's runtime issues and logs (canzona.step_collectives)
    collectives: str = "megatron"
    # DistributedOptimizer's max_grad_norm: clip the reduced gradients inside the step (one more
    # pass over each rank's share); None measures the norm only, as the runtime does every step
    max_grad_norm: float | None = STEP_DEFAULTS.max_grad_norm
    # the training loop calls DistributedOptimizer.clip_grad_norm_ before step(): step() reuses the
    # clip's check and rechecks its hyper-parameters and threshold (runtime collectives: one small
    # all-gather over DP, one over TP; canzona.step_collectives `clipped`)
    explicit_clip: bool = False
    # DistributedOptimizer's batch_kernels: same-shape matrices of a host as one kernel, each GEMM
    # one launch over the batch (canzona.batching, DeviceRate.batched_seconds)
    batch_kernels: bool = STEP_DEFAULTS.batch_kernels
    # DistributedOptimizer's compile_kernels: Newton-Schulz through torch.compile. Priced as eager:
    # inductor fuses the elementwise steps around GEMMs it leaves to cuBLAS (calibrate to see more)
    compile_kernels: bool = STEP_DEFAULTS.compile_kernels
    # DistributedOptimizer's overlap_step: each micro-group's gather and update computed as soon as
    # the buckets holding its matrices have been reduced (and backward's kernels are done), under
    # the remaining reductions; the updates applied after the step check (canzona only)
    overlap_step: bool = STEP_DEFAULTS.overlap_step
    # Megatron's --attention-backend: "fused" (Transformer Engine's FusedAttention, cuDNN's kernels:
    # what Megatron's "auto" picks on Hopper) or "flash" (TE's FlashAttention backend, flash-attn 2
    # under TE 1.x); priced from the FlashAttention-3 paper's series (canzona.attention_rate)
    attention_backend: str = DEFAULT_ATTENTION_BACKEND
    # Megatron's token dispatcher under expert parallelism (--moe-token-dispatcher-type, under flex
    # --moe-flex-dispatcher-backend, --moe-hybridep-num-sms and --moe-deepep-num-sms: sim.ep_dispatch), with the router's
    # --fake-balanced-gate and --routing (canzona.routing); the default, the all-to-all of every
    # token-expert pair, is what canzona's reference EP model runs
    ep_dispatcher: EpDispatcher = field(default_factory=EpDispatcher)
    # Megatron's overlap_moe_expert_parallel_comm (--overlap-moe-expert-parallel-comm, formerly
    # moe_a2a_overlap; default off): the combined 1F1B schedule, one micro-batch's forward beside
    # another's backward layer by layer, each one's EP all-to-alls under the other's compute
    # (sim.ep_overlap, which checks where Megatron allows it)
    overlap_moe_expert_parallel_comm: bool = False
    # Megatron's delay_wgrad_compute (--delay-wgrad-compute, Megatron-Bridge's CommOverlapConfig;
    # default off; only with the overlap above, as Megatron asserts): in the combined schedule the
    # experts' weight-gradient GEMMs run after the backward's dispatch gradient is issued, under it,
    # the attention's at the end of the layer pair (sim.ep_overlap)
    delay_wgrad_compute: bool = False

    def check(self) -> None:
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise SpecError(f"max_grad_norm must be a positive number, got {self.max_grad_norm!r}")
        check_recompute(self.recompute)
        check_recompute_method(self.recompute, self.recompute_method, self.recompute_num_layers)
        check_selective_ac_option(self.recompute, self.selective_ac_option)  # the layout's rule: SimConfig.check
        check_reduce_scatter(self.reduce_scatter)
        check_attention_backend(self.attention_backend)
        check_ub_config(self.tp_comm_overlap_cfg)
        check_ub_config_applies(self.tp_comm_overlap_cfg, tp_comm_overlap=self.tp_comm_overlap)  # any layout's rule
        self.ep_dispatcher.check()
        if not isinstance(self.overlap_moe_expert_parallel_comm, bool):
            raise SpecError("overlap_moe_expert_parallel_comm must be True or False, got "
                            f"{self.overlap_moe_expert_parallel_comm!r}")
        if not isinstance(self.delay_wgrad_compute, bool):
            raise SpecError(f"delay_wgrad_compute must be True or False, got {self.delay_wgrad_compute!r}")
        if self.delay_wgrad_compute and not self.overlap_moe_expert_parallel_comm:
            raise SpecError("--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm (Megatron: "
                            "overlap_moe_expert_parallel_comm must be enabled when enabling delay_wgrad_compute)")
        if not isinstance(self.overlap_step, bool):
            raise SpecError(f"overlap_step must be True or False, got {self.overlap_step!r}")
        check_choice(self.collectives, COLLECTIVE_MODES, "collectives mode")
        if not isinstance(self.explicit_clip, bool):
            raise SpecError(f"explicit_clip must be True or False, got {self.explicit_clip!r}")
        if self.explicit_clip and self.collectives != "runtime":
            # Megatron clips inside its step (no separate call to price); a flag that changes nothing is refused
            raise SpecError("--explicit-clip prices the runtime's step recheck after clip_grad_norm_: it needs "
                            "--collectives runtime (Megatron clips inside its step)")
        if not isinstance(self.align_grad_reduce, bool):
            raise SpecError(f"align_grad_reduce must be True or False, got {self.align_grad_reduce!r}")


def check_align_grad_reduce(options: RunOptions, *, pp: int, fsdp: bool) -> None:
    """`--no-align-grad-reduce` where it would change nothing, one SpecError: Megatron's
    align_grad_reduce chooses who launches the distributed optimizer's overlapped bucket
    reductions under a pipeline schedule (its `grad_sync_func`, set only with overlap_grad_reduce
    and pipeline parallelism; `sim.iteration._Stage.aligned`); FSDP2 reduce-scatters each unit as
    its backward ends, with no such switch (`sim.fsdp`)."""
    if options.align_grad_reduce:
        return
    if fsdp:
        raise SpecError("--no-align-grad-reduce is the distributed optimizer's (ZeRO-1) pipeline launch of its bucket "
                        "reductions: under --fsdp each unit's gradients are reduce-scattered as its backward ends "
                        "(torch's fully_shard has no such switch)")
    if not options.overlap_grad_reduce:
        raise SpecError("--no-align-grad-reduce changes nothing without --overlap-grad-reduce: Megatron's "
                        "align_grad_reduce chooses who launches the overlapped bucket reductions (without the overlap "
                        "every bucket is reduced after the backward)")
    if pp == 1:
        raise SpecError("--no-align-grad-reduce changes nothing at --pp 1: Megatron's align_grad_reduce sets the "
                        "pipeline schedule's grad_sync_func (without pipelining the backward hooks launch every "
                        "bucket either way)")
