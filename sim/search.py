"""`search`: the fastest layouts of a model on a number of GPUs (docs/design.md §9.7).

The space is data: `LAYOUT_AXES` (TP, PP, the split of the layers over the chunks, VP, CP, EP, micro-batch,
recompute; DP follows from them)
and `REFINE_AXES` (step policy, reduce-scatter implementation), each an `Axis` with its candidate
generator and the `SimConfig` field it sets. A new simulator dimension (context parallelism) is
one more entry. Those are Megatron's ZeRO-1 layouts (`ZERO1_SPACE`); a question with `fsdp`
searches FSDP2 / HSDP layouts instead (`FSDP_SPACE`: `FSDP_LAYOUT_AXES`, TP, EP, HSDP's replicas,
reshard_after_forward, micro-batch, recompute, PP dividing the layers, at VP = CP = 1; `FSDP_REFINE_AXES`, the FSDP
step policies), with the same steps; its floors are FSDP's own (`fsdp_time_floor`,
`sim.fsdp.fsdp_memory_floor`).

1. **Enumerate** every combination of the layout axes (`candidates`).
2. **Prune** without simulating: the simulator's own checks (`SimConfig.check`: divisibility of
   heads, layers, experts, the batch; Megatron's interleaving rules), then a lower bound of the
   memory per GPU from `canzona.memory` (weights, gradients, activations and the allowance; the
   plan-dependent parts only add to it) against the profile's capacity.
3. **Simulate** the survivors over a process pool (one worker per core). Recompute is tried in
   rounds: a layout is simulated with one recompute setting, and with another only if that did
   not fit: of the settings whose memory floor fits and not yet tried, the one of least time floor
   (the modes' memory and compute are not ordered alike: torchtitan's selective-layer against
   selective-op, a Megatron block of a few layers against selective-op on every layer).
4. **Refine** the best `refine_top` fitting layouts over the other step policies and reduce-scatter
   implementations (the defaults are searched first). `zero1-gather` is not tried beside canzona:
   canzona's ZeRO-1 fallback already simulates it and keeps the faster.
5. **Rank** the layouts that fit by iteration time.
"""

from __future__ import annotations

import math
import os
import shlex
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from canzona.attention_rate import DEFAULT_ATTENTION_BACKEND
from canzona.catalog import DEFAULT_MODEL
from canzona.cost import DeviceRate, row_state_bytes
from canzona.errors import SpecError
from canzona.experts import dense_part, expert_params, expert_part
from canzona.hardware import DEFAULT_PROFILE, HardwareProfile, load_profile
from canzona.memory import MemorySetup, activation_bytes, state_saving_bytes
from canzona.models import resolve_model
from canzona.optimizers import (
    MATRIX_REGISTRY,
    check_matrix_optimizer,
    config_changes,
    matrix_config_for,
    matrix_config_json,
    matrix_optimizer,
)
from canzona.pipeline import EVEN_SPLIT, PipelineSplit, chunk_spec, rank_layers, stage_spec
from canzona.plan import PLAN_DEFAULTS
from canzona.recompute import (
    BLOCK,
    FULL,
    NONE,
    SELECTIVE,
    SELECTIVE_AC_DEFAULT,
    SELECTIVE_LAYER,
    check_recompute_method,
    check_selective_ac_option,
    forward_without_grad,
    layout_recompute_modes,
    recompute_label,
    selective_ac_every,
    torchtitan_ac,
)
from canzona.reductions import (
    DEFAULT_REDUCE_SCATTER,
    REDUCE_SCATTER_IMPLS,
    alike_impls,
)
from canzona.spec import DTYPE_BYTES, ModelSpec
from canzona.step_options import check_batch_kernels
from canzona.step_policies import FSDP_POLICIES, STEP_POLICIES, default_policy, policies_running
from canzona.variability import check_cv
from sim.collectives import collective_cost
from sim.comm_sms import nccl_sms
from sim.ep_dispatch import EpDispatcher, ep_costs
from sim.ep_overlap import allowed, delay_wgrad_runs
from sim.fp8 import CURRENT, DELAYED, FP8, FP8Setup, check_fp8_device
from sim.fsdp import (
    FSDP_RECOMPUTE_MODES,
    ROOT,
    copy_seconds,
    fsdp_forward_without_grad,
    fsdp_memory_floor,
    fsdp_micro_batch_work,
    fsdp_recompute_modes,
    gathered_elements,
    unit_elements,
)
from sim.fsdp_copies import FSDP2, check_fsdp_impl, reshard_options
from sim.iteration import _tp_overlap_sms, cp_ring_cost, tp_gather_bytes
from sim.model_work import Block, MicroBatchWork
from sim.options import RunOptions, check_align_grad_reduce
from sim.simulate import (
    DENSE_FALLBACK,
    SimConfig,
    compared_policies,
    layer_dims,
    simulate,
    stage_work,
)
from sim.topology import MAX_GPUS, Cluster
from sim.userbuffers import DEFAULT_UB_CONFIG
from sim.workers import stopping_pool
from sim.workload import MAX_MICRO_BATCHES, Workload, grad_bytes_for, loss_bytes_for

# canzona's ZeRO-1 fallback simulates zero1-gather and keeps the faster: trying it again is redundant
COVERED_BY_FALLBACK = {"canzona": ("zero1-gather",)}


@dataclass(frozen=True)
class Question:
    """What is searched for: a model on `gpus` GPUs of a hardware profile."""

    model: str = DEFAULT_MODEL
    gpus: int = 256
    hardware: str = DEFAULT_PROFILE
    optimizer: str = "muon"
    seq_len: int = 4096
    global_batch: int = 128
    precision: str = "bf16"  # the linear GEMMs' (sim.fp8): every layout is searched in it
    fp8_recipe: str = DELAYED  # under FP8, Transformer Engine's scaling (sim.fp8)
    # Megatron's DDP option: fp32 gradient buffers (False: bf16); None: fp32 beside master weights,
    # the parameters' dtype without (`sim.workload.grad_bytes_for`)
    grad_reduce_in_fp32: bool | None = None
    # Megatron's --attention-backend (RunOptions.attention_backend): every layout is searched with it
    attention_backend: str = DEFAULT_ATTENTION_BACKEND
    # Megatron's token dispatcher (RunOptions.ep_dispatcher): every EP layout is searched with it
    ep_dispatcher: EpDispatcher = field(default_factory=EpDispatcher)
    # Megatron's overlap_moe_expert_parallel_comm (sim.ep_overlap): not a searched axis; when set,
    # every layout that allows it (`sim.ep_overlap.allowed`: EP > 1, PP 1 or VP > 1, no full or selective-op
    # recompute) is simulated with it, the others without
    overlap_moe_expert_parallel_comm: bool = False
    # Megatron's delay_wgrad_compute (RunOptions): on the layouts run with the overlap above
    delay_wgrad_compute: bool = False
    # Transformer Engine's TP communication overlap (RunOptions.tp_comm_overlap): every layout with it,
    # in the userbuffers configuration named (RunOptions.tp_comm_overlap_cfg, sim.userbuffers) on
    # every layout at TP > 1 (at TP 1 it has nothing to overlap: the default, `config_of`)
    tp_comm_overlap: bool = True
    tp_comm_overlap_cfg: str = RunOptions.tp_comm_overlap_cfg
    # Megatron's --recompute-method / --recompute-num-layers (RunOptions's fields of these names):
    # every layout searched with full recompute runs them (None: every layer checkpointed alone);
    # a layout whose model chunks a uniform group does not divide is not tried with full recompute
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    # without a method above: a layout that needs full recompute is first tried with Megatron's
    # block method at the fewest checkpointed layers a chunk its memory floor admits, and with every
    # layer checkpointed only if that run did not fit (`search`)
    search_recompute_layers: bool = True
    # torchtitan's --activation_checkpoint.selective_ac_option K (`canzona simulate --selective-ac-option`,
    # RunOptions's field of this name; None: its default, 2): under fsdp, selective-layer is searched at
    # the K of `SEARCHED_SELECTIVE_AC` and at this one (`selective_ac_options`)
    selective_ac_option: int | None = None
    # the loss's cross-entropy path and the optimizer's master remainders (Workload's options of
    # the same names, sim.cross_entropy, canzona.memory): every layout is searched with them
    # (their defaults are Workload's: one definition)
    cross_entropy_loss_fusion: bool = Workload.cross_entropy_loss_fusion
    cross_entropy_fusion_impl: str = Workload.cross_entropy_fusion_impl
    store_param_remainders: bool = Workload.store_param_remainders
    # FP8 primary weights (Workload.fp8_params): every layout is searched with them
    fp8_params: bool = Workload.fp8_params
    # Megatron's fused RoPE and SwiGLU (Workload's fields of these names): every layout is searched with them
    apply_rope_fusion: bool = Workload.apply_rope_fusion
    bias_activation_fusion: bool = Workload.bias_activation_fusion
    # the layers' memory-bound kernels (Workload.kernels: fused, or eager as torchtitan runs with
    # compile = false) and whether the loss upcasts the logits (Workload.loss_bytes, `loss_bytes_for`:
    # False, NeMo AutoModel's fp32_upcast false): every layout is searched with them
    kernels: str = Workload.kernels
    loss_fp32_upcast: bool = True
    # under fsdp, the training loop keeps the model's logits through the backward (Workload.loss_holds_logits:
    # NeMo AutoModel's); every layout is searched with it, and a ZeRO-1 question's layouts refuse it
    loss_holds_logits: bool = Workload.loss_holds_logits
    # the runtime's DistributedOptimizer(master_weights=...) (Workload.master_weights): every layout
    # is searched with it
    master_weights: bool = Workload.master_weights
    # `canzona simulate --fsdp`'s layouts (sim.fsdp: torch's fully_shard, composed with TP as
    # torchtitan composes it) instead of Megatron's ZeRO-1 ones: the search's space is `FSDP_SPACE`
    fsdp: bool = False
    fsdp_impl: str = FSDP2  # under fsdp, which FSDP runs it (SimConfig.fsdp_impl): every layout with it
    # the run's settings the search does not explore (`canzona simulate`'s options, RunOptions's and
    # SimConfig's fields of these names, whose defaults they keep: one definition): every layout is
    # searched with them. Megatron's align_grad_reduce acts under pipeline parallelism only: a layout
    # at PP 1 runs Megatron's (no schedule function), where the simulator refuses it off
    overlap_grad_reduce: bool = RunOptions.overlap_grad_reduce
    align_grad_reduce: bool = RunOptions.align_grad_reduce
    overlap_param_gather: bool = RunOptions.overlap_param_gather
    max_grad_norm: float | None = RunOptions.max_grad_norm
    batch_kernels: bool = RunOptions.batch_kernels
    gpu_variability: float | None = SimConfig.gpu_variability
    # the matrix optimizer's configuration (SimConfig.matrix_config, the runtime's option): every layout
    # is searched with it, its memory floor's optimizer state too; held as SimConfig holds it
    matrix_config: Any = SimConfig.matrix_config

    def __post_init__(self) -> None:
        if not (isinstance(self.gpus, int) and 1 <= self.gpus <= MAX_GPUS):
            raise SpecError(f"gpus must be a whole number in 1..{MAX_GPUS}, got {self.gpus!r}")
        check_matrix_optimizer(self.optimizer)
        if self.matrix_config is not None:
            object.__setattr__(self, "matrix_config", matrix_config_for(self.optimizer, self.matrix_config))
        check_recompute_method(FULL, self.recompute_method, self.recompute_num_layers)
        if not isinstance(self.search_recompute_layers, bool):
            raise SpecError(f"search_recompute_layers must be True or False, got {self.search_recompute_layers!r}")
        for name in ("tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather", "batch_kernels"):
            if not isinstance(getattr(self, name), bool):
                raise SpecError(f"{name} must be True or False, got {getattr(self, name)!r}")
        # RunOptions's checks: the attention backend, the dispatcher, the EP overlap and delay_wgrad_compute,
        # align_grad_reduce, max_grad_norm
        replace(self.run_options(), overlap_moe_expert_parallel_comm=self.overlap_moe_expert_parallel_comm,
                delay_wgrad_compute=self.delay_wgrad_compute).check()
        check_align_grad_reduce(self.run_options(), pp=2, fsdp=False)  # a PP layout: where it acts
        check_batch_kernels(self.optimizer, self.batch_kernels, flags=True)
        if self.gpu_variability is not None:
            check_cv(self.gpu_variability)
        self.workload()  # its checks
        self._check_moe_settings()
        self._check_space_settings()
        if self.precision == FP8:
            check_fp8_device(load_profile(self.hardware))

    def _check_moe_settings(self) -> None:
        """The expert dispatch's settings change nothing on a dense model: refused, as
        `canzona simulate` refuses them, rather than echoed back without effect."""
        default = EpDispatcher()
        moe_settings = [f"--{f.name.replace('_', '-')} {getattr(self.ep_dispatcher, f.name)}"
                        for f in fields(EpDispatcher) if getattr(self.ep_dispatcher, f.name) != getattr(default, f.name)]
        moe_settings += ["--overlap-moe-expert-parallel-comm"] if self.overlap_moe_expert_parallel_comm else []
        if moe_settings and resolve_model(self.model)[1].moe is None:
            raise SpecError(f"{', '.join(moe_settings)}: for a mixture-of-experts model's token dispatch; "
                            f"{self.model!r} has no experts")

    def _check_space_settings(self) -> None:
        """Under --fsdp the settings of Megatron's ZeRO-1 layout (`MEGATRON_ONLY`) would change
        nothing, or the simulator refuses them; without it FSDP's implementation changes nothing:
        refused, one line, naming them."""
        if not isinstance(self.fsdp, bool):
            raise SpecError(f"fsdp must be True or False, got {self.fsdp!r}")
        check_fsdp_impl(self.fsdp_impl)
        check_selective_ac_option(SELECTIVE_LAYER, self.selective_ac_option)
        if not self.fsdp:
            if self.fsdp_impl != FSDP2:
                raise SpecError(f"--fsdp-impl {self.fsdp_impl}: for an FSDP layout (it needs --fsdp)")
            if self.selective_ac_option is not None:
                raise SpecError(f"--selective-ac-option {self.selective_ac_option}: torchtitan's selective-layer "
                                "recompute, searched under --fsdp (Megatron's ZeRO-1 layouts do not run it)")
            if not self.search_recompute_layers and self.recompute_method is not None:
                # the block-method exploration (`search`'s `explore`) runs only without a method
                raise SpecError(f"--no-search-recompute-layers changes nothing with --recompute-method "
                                f"{self.recompute_method}: the search explores the block method's layers only "
                                "without a method, and runs the one given as it is")
            return
        if self.selective_ac_option is not None and SELECTIVE_LAYER not in fsdp_recompute_modes(self.fsdp_impl):
            raise SpecError(f"--selective-ac-option {self.selective_ac_option}: torchtitan's selective-layer recompute, "
                            f"which --fsdp-impl {self.fsdp_impl} does not run (not searched)")
        default = {f.name: f.default for f in fields(Question)}
        named = [flag for name, flag in MEGATRON_ONLY if getattr(self, name) != default[name]]
        if named:
            raise SpecError(f"{', '.join(named)}: Megatron's (its ZeRO-1 layout's), not searched under --fsdp "
                            "(torch's fully_shard with its checkpoint wrappers)")

    def run_options(self) -> RunOptions:
        """Every candidate's run options before its own (the recompute, Megatron's EP overlap, the
        refinements' reduce-scatter, `config_of`)."""
        return RunOptions(attention_backend=self.attention_backend, ep_dispatcher=self.ep_dispatcher,
                          tp_comm_overlap=self.tp_comm_overlap, tp_comm_overlap_cfg=self.tp_comm_overlap_cfg,
                          overlap_grad_reduce=self.overlap_grad_reduce,
                          align_grad_reduce=self.align_grad_reduce, overlap_param_gather=self.overlap_param_gather,
                          max_grad_norm=self.max_grad_norm, batch_kernels=self.batch_kernels)

    def workload(self) -> Workload:
        """Every candidate's workload (the micro-batch is a layout axis: set per candidate)."""
        return Workload(seq_len=self.seq_len, global_batch=self.global_batch, precision=self.precision,
                        fp8_recipe=self.fp8_recipe,
                        grad_bytes=grad_bytes_for(self.grad_reduce_in_fp32, self.master_weights),
                        cross_entropy_loss_fusion=self.cross_entropy_loss_fusion,
                        cross_entropy_fusion_impl=self.cross_entropy_fusion_impl,
                        store_param_remainders=self.store_param_remainders, fp8_params=self.fp8_params,
                        apply_rope_fusion=self.apply_rope_fusion, bias_activation_fusion=self.bias_activation_fusion,
                        kernels=self.kernels, loss_bytes=loss_bytes_for(self.loss_fp32_upcast),
                        loss_holds_logits=self.loss_holds_logits,
                        master_weights=self.master_weights)


# the question's settings of Megatron's ZeRO-1 layout, refused under --fsdp (`Question`), with the
# option that sets them: Megatron's recompute method (and the search's exploration of its block
# method), its EP all-to-all overlap and the distributed optimizer's master remainders
MEGATRON_ONLY = (("recompute_method", "--recompute-method"), ("recompute_num_layers", "--recompute-num-layers"),
                 ("search_recompute_layers", "--no-search-recompute-layers"),
                 ("overlap_moe_expert_parallel_comm", "--overlap-moe-expert-parallel-comm"),
                 ("delay_wgrad_compute", "--delay-wgrad-compute"),
                 ("store_param_remainders", "--store-param-remainders"),
                 ("fp8_params", "--fp8-params"),
                 # Megatron's userbuffers configuration (`sim.userbuffers.check_ub_config_applies`)
                 ("tp_comm_overlap_cfg", "--tp-comm-overlap-cfg"),
                 # the distributed optimizer's bucket and step overlaps and the pipeline schedule's
                 # launch of them (`sim.fsdp.check_fsdp`, `sim.options.check_align_grad_reduce`)
                 ("overlap_grad_reduce", "--no-overlap-grad-reduce"),
                 ("align_grad_reduce", "--no-align-grad-reduce"),
                 ("overlap_param_gather", "--no-overlap-param-gather"))


@dataclass(frozen=True)
class Facts:
    """What the candidate generators read: the model's and the node's sizes."""

    layers: int
    experts: int  # 0: a dense model
    gpus: int
    gpus_per_node: int
    global_batch: int
    seq_len: int
    optimizer: str  # the step policies that run it (the refinement's)
    fsdp_impl: str = FSDP2  # under FSDP, which implementation's options the layouts have


def facts_of(q: Question) -> Facts:
    _, arch = resolve_model(q.model)
    return Facts(arch.layers, arch.moe[0] if arch.moe else 0, q.gpus, load_profile(q.hardware).node.gpus,
                 q.global_batch, q.seq_len, q.optimizer, q.fsdp_impl)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# --- the axes ------------------------------------------------------------------------------------

Layout = dict[str, Any]


@dataclass(frozen=True)
class Axis:
    """One searched dimension: `values(facts, chosen)` its candidates given the axes before it,
    `apply(kwargs, value)` how a value enters the `SimConfig` keyword arguments (default: the
    field named like the axis)."""

    name: str
    values: Callable[[Facts, Layout], Iterable[Any]]
    apply: Callable[[dict[str, Any], Any], None] | None = None

    def set(self, kwargs: dict[str, Any], value: Any) -> None:
        if self.apply is None:
            kwargs[self.name] = value
        else:
            self.apply(kwargs, value)


def _workload(kwargs: dict[str, Any], **changes: Any) -> None:
    kwargs["workload"] = replace(kwargs["workload"], **changes)


def _options(kwargs: dict[str, Any], **changes: Any) -> None:
    kwargs["options"] = replace(kwargs["options"], **changes)


def _dp(f: Facts, c: Layout) -> int:
    """The data-parallel ranks that split the batch (CP ranks share their DP rank's sequences)."""
    return f.gpus // (c["tp"] * c["pp"] * c["cp"])


# TP: inside a node (the simulator's rule); heads, KV heads, ffn and vocabulary by SimConfig.check
# PP: dividing the layers under one of the searched splits; the split: how the layers are cut over
# the chunks (`SEARCHED_SPLITS`); VP: dividing each stage's layers (Megatron's interleaving, checked
# again with the micro-batches by check_vp); CP: context parallelism (ring attention); EP: dividing
# the experts, MoE only; micro-batch: dividing each DP rank's share of the batch. DP = GPUs / (TP x
# PP x CP) is what is left.
# The splits searched: Megatron's even one, and the embedding and the loss each counted as a layer
# (`--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split`, what NVIDIA's
# recipes set where the layers alone do not divide: Llama 3.1 405B's 126 layers + 2 at PP 8 x VP 8,
# Qwen3-235B-A22B's 94 + 2 at PP 8 x VP 4); not the first / last stage counts
# (`--decoder-first/last-pipeline-num-layers`, a count per stage: `canzona simulate` takes them for
# one layout). A value is the split's name: rows stay JSON.
SEARCHED_SPLITS: dict[str, PipelineSplit] = {
    "even": EVEN_SPLIT,
    "embedding+loss": PipelineSplit(account_for_embedding_in_pipeline_split=True,
                                    account_for_loss_in_pipeline_split=True),
}


def split_name(split: PipelineSplit) -> str | None:
    """The searched split's name (None: a split the search does not explore)."""
    return next((name for name, s in SEARCHED_SPLITS.items() if s == split), None)


def _slots(f: Facts, split: str) -> int:
    """The layers the split cuts over the chunks: the decoder's, and the embedding / loss it counts."""
    return f.layers + sum(SEARCHED_SPLITS[split].accounted)


def _splits(f: Facts, c: Layout) -> list[str]:
    """The splits a PP offers: the even one alone without a pipeline, else each whose layers it divides."""
    if c["pp"] == 1:
        return ["even"]
    return [name for name in SEARCHED_SPLITS if _slots(f, name) % c["pp"] == 0]


def _vps(f: Facts, c: Layout) -> list[int]:
    """The VPs of a pipeline: each dividing a stage's share of the split's layers, but where an uneven
    split puts every layer where the even one does (at PP 2 x VP 1 the embedding and the loss each
    take a layer's place on the stage holding them): the even layout's twin, the same run."""
    pp, split = c["pp"], c["pipeline_split"]
    if pp == 1:
        return [1]
    vps = divisors(_slots(f, split) // pp)
    if split == "even":
        return vps
    return [v for v in vps if f.layers % (pp * v) or any(
        rank_layers(f.layers, pp, s, v, SEARCHED_SPLITS[split]) != rank_layers(f.layers, pp, s, v) for s in range(pp))]


TP_AXIS = Axis("tp", lambda f, c: [t for t in divisors(f.gpus_per_node) if f.gpus % t == 0])
EP_AXIS = Axis("ep", lambda f, c: [1] if not f.experts else
               [e for e in divisors(f.experts) if (_dp(f, c) * c["tp"]) % e == 0])
MICRO_BATCH_AXIS = Axis("micro_batch", lambda f, c: [] if f.global_batch % _dp(f, c) else
                        [m for m in divisors(f.global_batch // _dp(f, c)) if m <= MAX_MICRO_BATCH],
                        lambda kw, v: _workload(kw, micro_batch=v))
# the recompute modes the simulator runs on Megatron's ZeRO-1 layouts (`SimConfig.check`'s definition)
ZERO1_RECOMPUTE_MODES: tuple[str, ...] = layout_recompute_modes(fsdp=False)
LAYOUT_AXES: tuple[Axis, ...] = (
    TP_AXIS,
    Axis("pp", lambda f, c: [p for p in range(1, f.layers + 1) if f.gpus % (c["tp"] * p) == 0
                             and _splits(f, {"pp": p})]),
    Axis("pipeline_split", _splits, lambda kw, v: kw.update(pipeline_split=SEARCHED_SPLITS[v])),
    # VP: every divisor of a stage's layers, down to one layer a chunk (NeMo 24.07's Llama 2 13B /
    # 70B ran VP 10 / 20): the simulator prices each chunk boundary's point-to-point, so deep
    # interleaving is ranked, not assumed away
    Axis("vp", _vps),
    # CP: dividing what TP x PP leave, the sequence in 2 x CP chunks, each CP rank keeping at least
    # MIN_CP_TOKENS of it; not with experts (not simulated); CP 1 (no CP) at any sequence length
    Axis("cp", lambda f, c: [1] if f.experts else
         [k for k in divisors(f.gpus // (c["tp"] * c["pp"]))
          if k == 1 or (k <= MAX_CP and f.seq_len % (2 * k) == 0 and f.seq_len // k >= MIN_CP_TOKENS)]),
    EP_AXIS,
    MICRO_BATCH_AXIS,
    # the modes the simulator runs on a ZeRO-1 layout (the rounds of `search` order them per layout)
    Axis("recompute", lambda f, c: ZERO1_RECOMPUTE_MODES, lambda kw, v: _options(kw, recompute=v)),
)
MAX_CP = 8  # context-parallel ranks: the ring's steps; longer rings are for sequences beyond 32k
# a CP rank's least share of the sequence: below it each ring step's attention is too short to hide
# its K/V exchange (Megatron's recipes use CP from 8k-token sequences on); it also keeps the search
# at the default 4096-token sequence to the layouts without CP
MIN_CP_TOKENS = 4096
MAX_MICRO_BATCH = 8  # sequences per micro-batch
RECOMPUTE_AXIS = "recompute"
# under selective-layer, torchtitan's selective_ac_option K a layout (and its row) carries
AC_KEY = "selective_ac_option"


def _zero1_policies(optimizer: str) -> list[str]:
    """The optimizer's default step policy first, then every other that runs it but those its
    fallback already simulates (`COVERED_BY_FALLBACK`)."""
    own = default_policy(optimizer)
    skip = COVERED_BY_FALLBACK.get(own, ())
    return [own] + [p for p in policies_running(optimizer) if p != own and p not in skip]


def _fsdp_policies(optimizer: str) -> list[str]:
    """The FSDP layout's policies of the optimizer (`compared_policies` under fsdp: an elementwise
    one's own only), its default first (SimConfig's resolution of none)."""
    own = default_policy(optimizer)
    return [own] + [p for p in compared_policies(optimizer, fsdp=True) if p != own]


# tried on the best layouts, each value beside the defaults (the first of each)
REFINE_AXES: tuple[Axis, ...] = (
    Axis("policy", lambda f, c: _zero1_policies(f.optimizer)),
    Axis("reduce_scatter", lambda f, c: REDUCE_SCATTER_IMPLS, lambda kw, v: _options(kw, reduce_scatter=v)),
)

# FSDP layouts (`canzona simulate --fsdp`, sim.fsdp): TP (the simulator allows it on dense models
# only), EP (a MoE model's, as the ZeRO-1 space's), HSDP's replicas R (every divisor of DP; the
# simulator keeps a shard group of at least 2 ranks, and no HSDP under EP), FSDP2's
# reshard_after_forward (Megatron-FSDP: resharded only), the micro-batch and the recompute modes
# the simulator runs under FSDP (`sim.fsdp.FSDP_RECOMPUTE_MODES`, selective-layer at each K of
# `selective_ac_options`: the rounds of `search`); PP dividing the layers (sim.fsdp_pipeline:
# torchtitan's stages, split evenly; no virtual pipeline); no context parallelism (the simulator runs
# FSDP at cp 1). Which combinations the simulator runs is its own checks' to say (`SimConfig.check`,
# `check_fsdp`: under PP no EP, no HSDP, at least a micro-batch a stage).
FSDP_LAYOUT_AXES: tuple[Axis, ...] = (
    TP_AXIS,
    Axis("pp", lambda f, c: [p for p in range(1, f.layers + 1) if f.gpus % (c["tp"] * p) == 0 and f.layers % p == 0]),
    Axis("vp", lambda f, c: [1]),
    Axis("cp", lambda f, c: [1]),
    EP_AXIS,
    Axis("hsdp_replicate", lambda f, c: divisors(_dp(f, c))),
    # FSDP2's fully_shard option; Megatron-FSDP has none (`sim.fsdp_copies.reshard_options`)
    Axis("reshard_after_forward", lambda f, c: list(reshard_options(f.fsdp_impl))),
    MICRO_BATCH_AXIS,
    Axis("recompute", lambda f, c: FSDP_RECOMPUTE_MODES, lambda kw, v: _options(kw, recompute=v)),
)
# the FSDP step policies (`canzona.step_policies.FSDP_POLICIES`); no reduce-scatter implementation
# to choose (FSDP2 reduce-scatters each unit's gradients itself)
FSDP_REFINE_AXES: tuple[Axis, ...] = (Axis("policy", lambda f, c: _fsdp_policies(f.optimizer)),)


@dataclass(frozen=True)
class Space:
    """What one kind of layout searches: its layout axes (in order: each axis's values may depend
    on those before it), its refinement axes, its recompute modes (the simulator's for the kind,
    `canzona.recompute.layout_recompute_modes`; the search's rounds try a layout's least-compute
    setting first) and the `SimConfig` fields every layout of it sets from the question
    (`fixed`)."""

    name: str
    layout: tuple[Axis, ...]
    refine: tuple[Axis, ...]
    recompute_modes: tuple[str, ...]
    fixed: Callable[[Question], dict[str, Any]]
    # of `recompute_modes`, those a question's layouts run (None: all; under FSDP the
    # implementation's, `sim.fsdp.fsdp_recompute_modes`: Megatron-FSDP runs no selective-layer)
    modes_of: Callable[[Question], tuple[str, ...]] | None = None

    @property
    def layout_keys(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.layout)

    def recompute_variants(self, q: Question) -> list[Layout]:
        """The recompute settings a layout of this space is tried with: each mode, selective-layer
        at each K of `selective_ac_options` (the mode's one setting the search chooses; Megatron's
        block method under full is chosen per layout, `search`)."""
        return [{RECOMPUTE_AXIS: m, AC_KEY: k} if m == SELECTIVE_LAYER else {RECOMPUTE_AXIS: m}
                for m in self.recompute_modes if self.modes_of is None or m in self.modes_of(q)
                for k in (selective_ac_options(q) if m == SELECTIVE_LAYER else (None,))]


# torchtitan's selective-layer K the FSDP space tries (every K-th layer checkpointed): its default
# 2 and the next two, each storing less than none and re-running less than the K below it; past 4
# a model's saving is at most a quarter of none's activations, which few layouts need that much of
SEARCHED_SELECTIVE_AC = (SELECTIVE_AC_DEFAULT, 3, 4)


def selective_ac_options(q: Question) -> tuple[int, ...]:
    """The K of selective-layer the search tries: `SEARCHED_SELECTIVE_AC` and the question's
    `selective_ac_option` when it sets another. The rounds (`search`) take a layout's least time
    floor among the settings whose memory floor fits: the largest K that fits comes first."""
    return tuple(sorted({*SEARCHED_SELECTIVE_AC, selective_ac_every(q.selective_ac_option)}))


# both spaces' rounds take a layout's least-compute setting whose memory floor fits: the modes'
# order is not one of compute (a Megatron block of a few layers re-runs less than selective-op on
# every layer; qwen3-0.6b's selective-op has a lower floor than selective), and under it the search
# missed faster layouts (Qwen3-32B / 256 H100: three 2-5% faster below the top ten, design §9.7)
ZERO1_SPACE = Space("zero1", LAYOUT_AXES, REFINE_AXES, ZERO1_RECOMPUTE_MODES, lambda q: {})
FSDP_SPACE = Space("fsdp", FSDP_LAYOUT_AXES, FSDP_REFINE_AXES, FSDP_RECOMPUTE_MODES,
                   lambda q: {"fsdp": True, "fsdp_impl": q.fsdp_impl},
                   modes_of=lambda q: fsdp_recompute_modes(q.fsdp_impl))
SPACES = {False: ZERO1_SPACE, True: FSDP_SPACE}  # by `Question.fsdp` / `SimConfig.fsdp`


def space_of(q: Question) -> Space:
    return SPACES[q.fsdp]


def refine_values(q: Question, axis: Axis, facts: Facts, layout: Layout) -> list[Any]:
    values = list(axis.values(facts, layout))
    if axis.name == "reduce_scatter" and max(config_of(q, layout).dp_groups()) == 1:
        # one rank reduces nothing: every implementation is the default's run, which the simulator
        # refuses to be told (`SimConfig._check_one_rank_settings`)
        return values[:1]
    return values


def candidates(q: Question, facts: Facts | None = None, before: str | None = None) -> list[Layout]:
    """Every combination of the layout axes, before any check (recompute at its cheapest: the
    other modes are tried in rounds); `before`: of the axes before the one of that name only."""
    facts = facts or facts_of(q)
    space = space_of(q)
    out: list[Layout] = [{}]
    for axis in space.layout:
        if axis.name == before:
            break
        if axis.name == RECOMPUTE_AXIS:
            out = [{**c, axis.name: space.recompute_modes[0]} for c in out]
            continue
        out = [{**c, axis.name: v} for c in out for v in axis.values(facts, c)]
    for c in out:
        c["dp"] = _dp(facts, c)
    return out


def config_of(q: Question, layout: Layout) -> SimConfig:
    """The simulator's configuration of one layout (and refinement values, when set)."""
    space = space_of(q)
    kwargs: dict[str, Any] = dict(model=q.model, gpus=q.gpus, hardware=q.hardware, optimizer=q.optimizer,
                                  workload=q.workload(), options=q.run_options(), gpu_variability=q.gpu_variability,
                                  matrix_config=q.matrix_config,
                                  **space.fixed(q))
    for axis in space.layout + space.refine:
        if axis.name in layout:
            axis.set(kwargs, layout[axis.name])
    # the dispatch between EP ranks' settings act at EP > 1 only: at EP 1 their defaults, the same run
    # (`EpDispatcher.at_ep`), which `canzona simulate` (refusing them at EP 1) reproduces
    _options(kwargs, ep_dispatcher=q.ep_dispatcher.at_ep(kwargs.get("ep", 1)))
    if kwargs.get("pp", 1) == 1:  # Megatron's align_grad_reduce acts under a pipeline schedule only
        _options(kwargs, align_grad_reduce=RunOptions.align_grad_reduce)
    if kwargs.get("tp", 1) == 1:  # userbuffers overlap TP's exchanges: none at TP 1
        _options(kwargs, tp_comm_overlap_cfg=RunOptions.tp_comm_overlap_cfg)
    if kwargs["options"].recompute == FULL:  # the layout's method (the search's block), else the question's
        method = layout.get("recompute_method", q.recompute_method)
        if method is not None:
            _options(kwargs, recompute_method=method,
                     recompute_num_layers=layout.get("recompute_num_layers", q.recompute_num_layers))
    if kwargs["options"].recompute == SELECTIVE_LAYER:  # the layout's K, else the question's
        _options(kwargs, selective_ac_option=layout.get(AC_KEY, q.selective_ac_option))
    if q.overlap_moe_expert_parallel_comm and allowed(ep=kwargs.get("ep", 1), pp=kwargs.get("pp", 1),
                                                       vp=kwargs.get("vp", 1), recompute=kwargs["options"].recompute,
                                                       fsdp=False):
        # delay_wgrad_compute where Transformer Engine runs it (`sim.ep_overlap.delay_wgrad_runs`: not beside
        # userbuffers' TP overlap), as the EP overlap where Megatron allows it
        _options(kwargs, overlap_moe_expert_parallel_comm=True,
                 delay_wgrad_compute=q.delay_wgrad_compute and delay_wgrad_runs(tp=kwargs.get("tp", 1),
                                                                                tp_comm_overlap=q.tp_comm_overlap))
    # where one rank reduces every gradient and gathers every parameter the question's overlaps change
    # nothing: their defaults, the same run, which `canzona simulate` (refusing them there) reproduces
    return SimConfig(**kwargs).at_one_rank_defaults()


# a simulated row's recompute method, which a layout carries where the search chose it
METHOD_KEYS = ("recompute_method", "recompute_num_layers")


def layout_of(row: dict[str, Any]) -> Layout:
    """The layout a simulated row ran (its space's axes, DP, any recompute method and
    selective-layer's K)."""
    out = {k: row[k] for k in (*_row_space(row).layout_keys, "dp")}
    if row.get("recompute_method") is not None:
        out.update({k: row[k] for k in METHOD_KEYS})
    if row.get(AC_KEY) is not None:
        out[AC_KEY] = row[AC_KEY]
    return out


def row_config(q: Question, row: dict[str, Any]) -> SimConfig:
    """The configuration a simulated row ran: its layout (`layout_of`) with its refinement values
    (the step policy, and the reduce-scatter where its space has one), built by `config_of` as the
    search built it; what `canzona simulate` must be given to reproduce the row."""
    space = _row_space(row)
    return config_of(q, {**layout_of(row), **{a.name: row[a.name] for a in space.refine}})


def _row_space(row: dict[str, Any]) -> Space:
    """The space a simulated row (or a layout of it) belongs to: FSDP's rows say so (`run_one`)."""
    return SPACES[bool(row.get("fsdp", False))]


# --- pruning -------------------------------------------------------------------------------------


def memory_floor(cfg: SimConfig, model) -> int:
    """A lower bound of the fullest GPU's bytes (`canzona.memory`'s terms that need no plan): each
    stage's weights and gradient buffers (the plan's buckets only pad them): at EP 1 the whole
    stage's, experts included (one plan holds them), under EP its dense part's and one EP rank's
    experts (`canzona.experts.expert_part`, their shards under expert TP), as `sim.simulate` plans
    them; Transformer Engine's userbuffers under the TP overlap; the flex token dispatcher's buffers;
    its activations, and the allowance on top (which grows with the transient peak, at least the
    activations); and the masters and optimizer state its GPUs hold between them, spread evenly
    (`optimizer_state_floor`: the fullest holds at least the mean, whatever the plan)."""
    spec, arch = model
    dims = layer_dims(arch, spec)
    if cfg.fsdp:  # an FSDP layout's own memory model (sim.fsdp), under PP its fullest stage's
        return max(fsdp_memory_floor(cfg, model, dims, stage) for stage in _kinds(cfg.pp))
    setup = cfg.memory_setup(arch)
    worst = 0
    for stage in _kinds(cfg.pp):
        whole = stage_spec(spec, cfg.pp, stage, arch.layers, cfg.vp, cfg.pipeline_split)
        part = dense_part(whole) if cfg.ep > 1 else whole
        elements = sum(p.local_numel(cfg.tp) for p in part.params)
        if cfg.ep > 1 and expert_params(whole):
            elements += sum(p.local_numel(cfg.etp) for p in expert_part(whole, cfg.ep, cfg.etp, arch.hidden).params)
        acts = activation_bytes(dims, setup, cfg.tp, cfg.pp, stage, cfg.vp, cfg.pipeline_split)
        buffers = setup.dispatcher_buffers if expert_params(whole) else 0  # allocated at a stage's first dispatch
        # every GPU of the stage holds the terms above alike; the masters and the optimizer state
        # differ by rank, and the fullest holds at least their mean over the stage's GPUs
        state = optimizer_state_floor(whole, cfg.optimizer, setup, cfg.matrix_config) // (cfg.gpus // cfg.pp)
        worst = max(worst, elements * (setup.param_bytes + setup.grad_bytes) + setup.userbuffers
                    + buffers + acts + setup.overhead(acts) + state)
    return worst


def optimizer_state_floor(part: ModelSpec, optimizer: str, setup: MemorySetup, matrix_config: object | None = None) -> int:
    """`part`'s masters and optimizer state summed over the GPUs that hold it, at least: each
    element's master once, each matrix's row state once (`row_state_bytes`, what a shard of its
    rows holds its share of: an owner's whole state is more), every other element's AdamW state
    once (every element's, under an elementwise optimizer); without masters the state that
    follows the update in the parameters' dtype (`state_saving_bytes`: Muon's momentum is its row
    state). A step policy that keeps more (a replicated or gathered copy, a matrix's whole
    preconditioner) only adds to it. `matrix_config`: the optimizer's configuration (None: its
    defaults), whose row state it is."""
    elementwise = matrix_optimizer(optimizer).elementwise
    adamw = 0
    state = 0
    for p in part.params:
        if elementwise or not p.uses_matrix_optimizer:
            adamw += p.numel
        else:  # a stack of same-shape matrices (experts): each one's
            shape = p.matrix_shape if p.matrix_shape is not None else tuple(p.shape)
            one = row_state_bytes(optimizer, shape, matrix_config)
            saved = state_saving_bytes(optimizer, shape, setup, matrix_config)
            state += p.numel // math.prod(shape) * (one - min(saved, one))
    return setup.master_bytes * part.numel + state + setup.adamw_state_bytes(adamw)


# --- simulation ----------------------------------------------------------------------------------


def plan_command(q: Question, row: dict[str, Any], out: str = "plan.json") -> str | None:
    """The `canzona plan` command line that writes this layout's plan file; None for an FSDP
    layout, which has no plan file (`canzona plan` plans ZeRO-1 layouts; the FSDP runtime,
    `canzona.runtime.fsdp.FsdpOptimizer`, places its owners when it is built): what it needs is
    `not_in_plan`'s."""
    if row.get("fsdp"):
        return None
    # the optimizer's data-parallel group is DP x CP (CP ranks hold the same weights); paths quoted as the
    # shell needs them (a space in a model or profile path), so the printed line pastes as one command
    parts = ["canzona plan", f"--model {shlex.quote(q.model)}", f"--dp {row['dp'] * row.get('cp', 1)}",
             f"--tp {row['tp']}",
             f"--optimizer {q.optimizer}"]
    if row["dp_policy"] != PLAN_DEFAULTS.dp_policy:
        parts.append(f"--dp-policy {row['dp_policy']}")
    if row["tp_policy"] != PLAN_DEFAULTS.tp_policy:
        parts.append(f"--tp-policy {row['tp_policy']}")
    if q.hardware != DEFAULT_PROFILE:
        parts.append(f"--hardware {shlex.quote(q.hardware)}")
    if row["ep"] > 1:
        parts.append(f"--ep {row['ep']}")
        if row["expert_buckets"] != PLAN_DEFAULTS.expert_buckets:
            parts.append(f"--expert-buckets {row['expert_buckets']}")
    if q.matrix_config is not None:  # the plan balanced for the step the layouts were searched with
        parts.append(f"--matrix-config {shlex.quote(matrix_config_json(q.optimizer, q.matrix_config))}")
    parts.append(f"--out {shlex.quote(out)}")
    return " ".join(parts)


def fsdp_launch(row: dict[str, Any], q: Question | None = None) -> list[str]:
    """What an FSDP layout's launcher sets (it has no plan file): the implementation and the device
    mesh it shards over, FSDP2's reshard option, TP / EP, the micro-batch, the recompute and the
    optimizer; Megatron-FSDP's as Megatron-LM's flags (it runs on Megatron-LM). With the question,
    its settings every layout ran with: the batch, the sequence, FP8 (`_question_launch` under
    Megatron-FSDP)."""
    shard = row["dp"] // row["hsdp_replicate"]
    torch_fsdp = row["fsdp_impl"] == FSDP2
    # each implementation in its own terms: FSDP2's fully_shard calls and DTensor TP, Megatron-LM's
    # flags for Megatron-FSDP (which shards every FSDP unit after its forward: no reshard option)
    how = ("fully_shard each decoder layer, then the root," if torch_fsdp else
           "Megatron-FSDP (Megatron-LM --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params, "
           "each decoder layer an FSDP unit)")
    out = [f"{how} over a (replicate {row['hsdp_replicate']}, shard {shard}) mesh (HSDP)" if row["hsdp_replicate"] > 1
           else f"{how} over the {shard} DP ranks"]
    if row["pp"] > 1 and torch_fsdp:  # torchtitan's default under PP is `not pp_enabled`: say either setting
        reshard = row["reshard_after_forward"]
        policy = "always" if reshard else "never"
        out.append(f'reshard_after_forward={reshard} (torchtitan: parallelism.fsdp_reshard_after_forward = "{policy}"; '
                   "its default under PP does not reshard)")
    elif not row["reshard_after_forward"]:  # FSDP2's default (torchtitan's too at PP 1) reshards
        out.append("reshard_after_forward=False")
    if not torch_fsdp:  # Megatron-LM's flags, as a ZeRO-1 layout's (`not_in_plan`)
        megatron = _megatron_layout({**row, "reduce_scatter": DEFAULT_REDUCE_SCATTER, "fell_back_to": None,
                                     "policy": default_policy(q.optimizer if q else "muon")}, q)
        return out + megatron + ([] if q is None else _question_launch(q, row)) + _fsdp_policy(row)
    if row["tp"] > 1:
        out.append(f"tp {row['tp']} (parallelize_module over the TP mesh dimension, then fully_shard over DP)")
    if row["pp"] > 1:
        out.append(f"pp {row['pp']} (torchtitan's PP: each stage's layers fully_shard-ed over its DP group, "
                   "Schedule1F1B; one DistributedOptimizer a stage)")
    if row["ep"] > 1:
        out.append(f"ep {row['ep']}")
    if row["micro_batch"] > 1:
        out.append(f"micro-batch {row['micro_batch']}")
    if q is not None:  # torchtitan's [training] settings and its float8 converter
        out.append(f"global batch {q.global_batch}, sequence {q.seq_len} (torchtitan: training.global_batch_size, "
                   "training.seq_len)")
        if q.precision == FP8:
            out.append(f"FP8 linear layers, {q.fp8_recipe} scaling (torchtitan: model.converters = ['float8'])")
        if not q.master_weights:
            out.append("the model built in bf16, no fp32 copy (DistributedOptimizer(master_weights=False); torch's "
                       "AdamW on bf16 parameters)")
    if row["recompute"] != NONE:
        ac = torchtitan_ac(row["recompute"], row.get(AC_KEY))
        out.append(f"recompute {_recompute_text(row)} (a checkpoint wrapper per decoder layer; "
                   + (f"torchtitan: {ac})" if ac else "Megatron's attention-core recompute, no torchtitan setting)"))
    if q is not None and q.matrix_config is not None:  # the step every layout was priced at
        out.append(f"matrix_config={config_changes(q.optimizer, q.matrix_config)!r} (the optimizer's option)")
    return out + _fsdp_policy(row)


def _fsdp_policy(row: dict[str, Any]) -> list[str]:
    """An FSDP row's step policy as the launcher builds it."""
    out = []
    # the policies: canzona's FsdpOptimizer runs canzona and fsdp-owners-unbalanced for whole-matrix
    # optimizers; fsdp-gather-all is muon_fsdp2's (the simulator's baseline); AdamW steps the shards
    if row["policy"] not in FSDP_POLICIES:  # an elementwise optimizer's own (fsdp_policy)
        out.append("the optimizer on each rank's own shards (torch's; canzona's FSDP optimizer is for "
                   "whole-matrix optimizers)")
    elif row["policy"] == "fsdp-gather-all":
        out.append("policy fsdp-gather-all (every rank gathers every matrix, as muon_fsdp2 does; not canzona's)")
    else:
        out.append(f"DistributedOptimizer(model.named_parameters(), spec, ...) on the sharded model (an "
                   f"FsdpOptimizer), policy={row['policy']!r}")
    return out


# the step policies DistributedOptimizer runs when given none: each optimizer's default
DEFAULT_STEP_POLICIES = frozenset(default_policy(name) for name in MATRIX_REGISTRY)


def _megatron_recompute(row: dict[str, Any]) -> str:
    """A ZeRO-1 row's recompute as Megatron-LM's flags (`canzona.recompute`'s module docstring)."""
    mode = row[RECOMPUTE_AXIS]
    if mode == SELECTIVE:
        return "--recompute-granularity selective (the attention core)"
    if mode == FULL:
        method, layers = row.get("recompute_method"), row.get("recompute_num_layers")
        if method is not None:
            return f"--recompute-granularity full --recompute-method {method} --recompute-num-layers {layers}"
        # Megatron requires a method under full; every layer checkpointed on its own is uniform 1
        return ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 (every layer "
                "checkpointed on its own)")
    # torchtitan's per-op policy: Megatron's selective recomputes the attention core only, another run
    return (f"recompute {_recompute_text(row)}: torchtitan's per-op selective checkpointing, which Megatron-LM has "
            "no flag for (its --recompute-granularity selective recomputes the attention core only: another run)")


def _megatron_dispatcher(d: EpDispatcher) -> str:
    """An EP layout's token dispatcher as Megatron-LM's flags: the type always (Megatron's default,
    allgather, is not the simulated one), the flex backend and its SMs where set."""
    flags = [f"--moe-token-dispatcher-type {d.moe_token_dispatcher_type}"]
    if d.moe_flex_dispatcher_backend is not None:
        flags.append(f"--moe-flex-dispatcher-backend {d.moe_flex_dispatcher_backend}")
    default = EpDispatcher()
    flags += [f"--{name.replace('_', '-')} {getattr(d, name)}" for name in ("moe_hybridep_num_sms", "moe_deepep_num_sms")
              if getattr(d, name) != getattr(default, name)]
    return " ".join(flags)


def _question_launch(q: Question, row: dict[str, Any]) -> list[str]:
    """The question's settings every ZeRO-1 layout ran with that a default Megatron-LM run (or
    canzona's DistributedOptimizer built with its defaults) does not have, as their flags: without
    them the job launched is not the one ranked."""
    cfg = row_config(q, row)
    o, w = cfg.options, cfg.workload
    # Megatron-LM trains in fp32 and sets the global batch to micro-batch x DP unless told
    out = [f"--bf16 --global-batch-size {w.global_batch} --seq-length {w.seq_len}"]
    if resolve_model(q.model)[1].moe is not None:  # the simulator's experts are grouped GEMMs (sim.model_work)
        out.append("--moe-grouped-gemm")
    if w.precision == FP8:  # sim.fp8: TE's hybrid format (E4M3 forward, E5M2 gradients); Megatron's recipe names
        out.append(f"--fp8-format hybrid --fp8-recipe {MEGATRON_FP8_RECIPES[w.fp8_recipe]}"
                   + (" --fp8-param-gather (FP8 primary weights)" if w.fp8_params else ""))
    if w.grad_bytes < DTYPE_BYTES["fp32"]:
        out.append("--grad-reduce-in-bf16")
    if o.attention_backend != DEFAULT_ATTENTION_BACKEND:
        out.append(f"--attention-backend {o.attention_backend}")
    if w.cross_entropy_loss_fusion:
        out.append(f"--cross-entropy-loss-fusion --cross-entropy-fusion-impl {w.cross_entropy_fusion_impl}")
    out += [flag for on, flag in ((w.apply_rope_fusion, "--no-rope-fusion"),
                                  (w.bias_activation_fusion, "--no-bias-swiglu-fusion")) if not on]
    if row["pp"] > 1 and not o.align_grad_reduce:
        out.append("--no-align-grad-reduce")
    # DistributedOptimizer's own options off their defaults (its step's, canzona.step_options)
    given = [f"{name}={getattr(o, name)!r}" for name in ("overlap_param_gather", "max_grad_norm", "batch_kernels")
             if getattr(o, name) != getattr(RunOptions, name)]
    if not w.master_weights:
        given.append("master_weights=False")
    if q.matrix_config is not None:  # the step every layout was priced at, which the optimizer must run
        given.append(f"matrix_config={config_changes(q.optimizer, q.matrix_config)!r}")
    if given:
        out.append(f"{', '.join(given)} (DistributedOptimizer's options)")
    return out


# canzona's FP8 recipes (sim.fp8) by Megatron-LM's --fp8-recipe name
MEGATRON_FP8_RECIPES = {DELAYED: "delayed", CURRENT: "tensorwise"}


def not_in_plan(row: dict[str, Any], q: Question | None = None) -> list[str]:
    """What of a layout its plan file does not carry (the launcher's settings), as Megatron-LM's
    flags (Megatron-Bridge's config fields of the same names) and DistributedOptimizer's options;
    with the question, also its settings every layout ran with that a default Megatron-LM run lacks
    (`_question_launch`). An FSDP layout's (no plan file) every setting (`fsdp_launch`)."""
    if row.get("fsdp"):
        return fsdp_launch(row, q)
    return _megatron_layout(row, q) + ([] if q is None else _question_launch(q, row))


def _megatron_layout(row: dict[str, Any], q: Question | None) -> list[str]:
    """A Megatron layout's settings as Megatron-LM's flags (`not_in_plan`; Megatron-FSDP's too, at PP 1)."""
    out = []
    if row.get("tp", 1) > 1:  # the plan's TP; the simulator runs it sequence parallel, which Megatron's default is not
        tp = f"--tensor-model-parallel-size {row['tp']} --sequence-parallel"
        if q is None or q.tp_comm_overlap:  # Transformer Engine's userbuffers (config_of: at TP > 1)
            cfg = RunOptions.tp_comm_overlap_cfg if q is None else q.tp_comm_overlap_cfg
            tp += f" --tp-comm-overlap (userbuffers configuration {cfg}: Megatron-Bridge's tp_comm_overlap_cfg)"
        out.append(tp)
    if row["pp"] > 1:
        out.append(f"--pipeline-model-parallel-size {row['pp']} (canzona plan plans the whole model over DP x TP; "
                   "the runtime has no pipeline)")
    if row["vp"] > 1:
        out.append(f"--num-virtual-stages-per-pipeline-rank {row['vp']} (Megatron-Bridge: "
                   "virtual_pipeline_model_parallel_size)")
    split = SEARCHED_SPLITS[row.get("pipeline_split", "even")]
    if not split.even:  # Megatron's options, named as PipelineSplit's fields
        out.append(" ".join(f"--{f.name.replace('_', '-')}" for f in fields(split) if getattr(split, f.name) is True)
                   + " (Megatron's)")
    if row.get("cp", 1) > 1:
        out.append(f"--context-parallel-size {row['cp']} (the plan's DP is DP x CP; the runtime has no context "
                   "parallelism)")
    if row.get("ep", 1) > 1:  # the plan's EP, and the dispatcher every EP layout ran (config_of)
        dispatcher = EpDispatcher() if q is None else q.ep_dispatcher
        out.append(f"--expert-model-parallel-size {row['ep']} {_megatron_dispatcher(dispatcher)}")
    out.append(f"--micro-batch-size {row['micro_batch']}")  # Megatron requires it
    if row["recompute"] != NONE:
        out.append(_megatron_recompute(row))
    if row["reduce_scatter"] != DEFAULT_REDUCE_SCATTER:
        out.append(f"reduce_scatter={row['reduce_scatter']!r} (DistributedOptimizer's option)")
    # the step policy is DistributedOptimizer's `policy=`, not the plan file's (which holds the DP and
    # TP plans): a refined policy, or canzona's fallback to zero1-gather, must be given to it
    # (a layout not yet simulated has none: the default)
    deployed = deployed_policy(row)
    if deployed is not None and (deployed != row["policy"] or deployed not in DEFAULT_STEP_POLICIES):
        out.append(f"policy={deployed!r} (DistributedOptimizer's option; the plan file does not name it)")
    if row.get("overlap_moe_expert_parallel_comm"):  # Megatron's schedule (sim.ep_overlap), not the plan's
        out.append("--overlap-moe-expert-parallel-comm" + (" --delay-wgrad-compute" if row.get("delay_wgrad_compute")
                                                           else "") + " (Megatron's)")
    if row["fell_back_to"] == DENSE_FALLBACK:  # docs/design.md §2.7: priced under Megatron's collectives only
        out.append("canzona's experts with zero1-gather's dense part (two step policies, as Megatron's collectives "
                   "price it): not this row's run when deployed, as canzona's runtime runs one step policy and this "
                   "plan deploys canzona on both parts (priced by the row's simulate command with --no-zero1-fallback)")
    return out


def run_one(cfg: SimConfig, layout: Layout) -> dict[str, Any]:
    """Simulate one configuration (in a worker): the row of the results, small enough to send back,
    with the reduce-scatter implementations that would have made the same run (`alike_impls`)."""
    r = simulate(cfg)
    space = SPACES[cfg.fsdp]
    if cfg.fsdp:  # no plan file, no DistributedOptimizer reduce-scatter to choose (`plan_command`, `fsdp_launch`)
        plan: dict[str, Any] = {"reduce_scatter": None, "reduce_scatter_alike": [], "dp_policy": None,
                                "tp_policy": None}
    else:
        step = STEP_POLICIES[r.fell_back_to if r.fell_back_to in STEP_POLICIES else cfg.policy]
        plan = {"reduce_scatter": cfg.options.reduce_scatter,
                # the implementations that route every reduce-scatter of this run alike: the same run
                "reduce_scatter_alike": list(alike_impls(cfg.options.reduce_scatter, r.reduce_scatters)),
                # the DP / TP policies the plan is made with (the deployed step policy's own, else canzona's settings)
                "dp_policy": step.dp_policy or cfg.dp_policy,
                "tp_policy": step.tp_policy or cfg.tp_policy}
    return {
        **{k: layout[k] for k in (*space.layout_keys, "dp")},
        **({"fsdp": True, "fsdp_impl": cfg.fsdp_impl} if cfg.fsdp else {}),
        "policy": cfg.policy,
        # a value of the refinement axes other than the default (ties go to the defaults)
        "refined": any(a.name in layout for a in space.refine),
        "reduce_scatter": plan["reduce_scatter"],
        "reduce_scatter_alike": plan["reduce_scatter_alike"],
        "fell_back_to": r.fell_back_to,
        "dp_policy": plan["dp_policy"],
        "tp_policy": plan["tp_policy"],
        "expert_buckets": r.expert_choice.buckets,
        "iteration_time_s": r.iteration_time_s,
        "optimizer_step_s": r.optimizer_step_s,
        "mfu": r.mfu,
        "memory_bytes": float(r.memory.worst.total),
        "memory_capacity_bytes": float(r.memory_capacity_bytes),
        "fits": r.fits,
        # whether this layout ran Megatron's EP all-to-all overlap: the question's setting only where
        # the layout allows it (`config_of`), so a row says which it is
        "overlap_moe_expert_parallel_comm": cfg.options.overlap_moe_expert_parallel_comm,
        "delay_wgrad_compute": cfg.options.delay_wgrad_compute,
        # Megatron's recompute method the layout ran (the question's, under full recompute: `config_of`)
        "recompute_method": cfg.options.recompute_method,
        "recompute_num_layers": cfg.options.recompute_num_layers,
        # torchtitan's selective_ac_option K the layout ran under selective-layer (None otherwise)
        AC_KEY: selective_ac_every(cfg.options.selective_ac_option) if cfg.options.recompute == SELECTIVE_LAYER
        else None,
    }


def _run_task(args: tuple[SimConfig, Layout]) -> dict[str, Any]:
    cfg, layout = args
    try:
        return run_one(cfg, layout)
    except SpecError as e:  # a rule only the run itself knows: pruned, with its reason
        return {"error": str(e), **layout}


@dataclass
class SearchResult:
    question: Question
    ranked: list[dict[str, Any]]  # the simulated layouts that fit, fastest first
    not_fitting: list[dict[str, Any]]
    candidates: int
    pruned_checks: int
    pruned_memory: int
    simulated: int
    reasons: dict[str, int] = field(default_factory=dict)  # first words of each check's error: count
    wall_s: float = 0.0
    workers: int = 1
    pruned_bound: int = 0  # not simulated: their time floor is above the top layouts' times
    exact_top: int = 0  # how many of `ranked` are those of the exhaustive search (`search`'s `top`)
    # refinements not listed as rows of their own, the same run as a listed row: a reduce-scatter whose
    # routes are the simulated row's (its `reduce_scatter_alike`), not simulated, or one simulated and
    # found to run the row's run (`same_run`: canzona's fallback to ZeRO-1's even segments)
    pruned_ties: int = 0

    def to_dict(self, top: int | None = None,
                simulate_command: Callable[[SimConfig], str] | None = None) -> dict[str, Any]:
        """The question, the search's counts and the `top` layouts, each with the `canzona plan` command
        that deploys it and, given `simulate_command` (the command line of a configuration: the CLI's
        `cli.replay.simulate_command`, which owns the flags), the `canzona simulate` command that
        reproduces the row bit for bit (its configuration is `row_config`'s, as the search ran it)."""
        rows = self.ranked if top is None else self.ranked[:top]
        q = self.question

        def commands(row: dict[str, Any]) -> dict[str, Any]:
            replay = {} if simulate_command is None else {"simulate_command": simulate_command(row_config(q, row))}
            return {"plan_command": plan_command(q, row), **replay, "not_in_plan": not_in_plan(row, q)}

        return {
            **asdict(q),  # the whole question the layouts were searched under, every field of it
            # its matrix config as `--matrix-config` takes it (and simulate's JSON gives it): the fields off the defaults
            "matrix_config": None if q.matrix_config is None else config_changes(q.optimizer, q.matrix_config),
            "searched": {"candidates": self.candidates, "pruned_by_checks": self.pruned_checks,
                         "pruned_by_memory": self.pruned_memory, "pruned_by_bound": self.pruned_bound,
                         "pruned_as_ties": self.pruned_ties,
                         "simulated": self.simulated,
                         "fit": len(self.ranked), "exact_top": self.exact_top, "workers": self.workers,
                         "wall_s": self.wall_s},
            # "exact": within the search's `top`; below it a pruned layout may be faster than the row
            "layouts": [{"rank": i + 1, "exact": i < self.exact_top, **row, **commands(row)}
                        for i, row in enumerate(rows)],
        }


# after each simulation: (simulated, simulated + still to simulate, the layout, the fastest fitting
# iteration so far in seconds or None); and every `HEARTBEAT_S` while none finishes, with the layout
# None (one simulation of a large layout may take minutes: a log outside a terminal still hears)
Progress = Callable[[int, int, str | None, float | None], None]
HEARTBEAT_S = 1.0


def _kinds(pp: int) -> list[int]:
    """The stages that differ when PP divides the layers: the first (embedding), one in the middle,
    the last (head)."""
    return sorted({0, min(1, pp - 1), pp - 1})


def beside_kernel(w: float, c: float, k: int, sms: int) -> float:
    """The least seconds from the start of a GEMM of `w` full-rate seconds until both it and a
    communication kernel started no earlier (`sim.iteration._Stage.block`'s reduce-scatter after
    the middle GEMMs) and running at least `c` seconds are done, when that kernel holds `k` of the
    GPU's `sms` SMs (`sim.comm_sms`): the engine (`sim.engine.Engine._rate`) runs the GEMM at
    `max(sms - k, 1) / sms` of its rate meanwhile, so it ends `c * k / sms` later, or at `w` over
    that rate when the kernel outlasts it. Nondecreasing in `c` and in a later start of the
    kernel, so the kernel's least `c` bounds every run (sms 0 or k 0: `max(w, c)`)."""
    if not sms or not k:
        return max(w, c)
    rate = max(sms - k, 1) / sms
    return max(c, w + min(c, w / rate) * (1 - rate))


def block_floor(b: Block, gathers: int, tp_cost: tuple[float, float] | None, overlap: bool,
                stretch: float = 1.0, sms: int = 0, ring: Callable[[Block], float] | None = None,
                no_grad: bool = False, ub: str = DEFAULT_UB_CONFIG) -> float:
    """A lower bound of one sequence-parallel block on its rank's compute stream, as
    `sim.iteration._Stage.block` runs it: each block waits for the one before, so blocks add up.
    With TP collectives (`tp_cost`: the all-gather's and the reduce-scatter's least seconds, their
    latency, transfer at the full bus rate and local passes; shared links only stretch them):
    overlapped, the middle GEMMs wait for the first ones and the `gathers` all-gathers of the input,
    the block ends when its last GEMMs and the reduce-scatter started after the middle are done; in
    series (Transformer Engine without userbuffers), all-gathers, compute and reduce-scatter one
    after the other, but for the backward's re-gather of the input and its reduce-scatter, each
    beside the column GEMMs it overlaps (`sim.iteration._Stage.nccl_block`). Expert dispatch and
    pipeline sends count as free, the CP ring's exchanges only through `ring`. `stretch`: the
    factor on every phase A kernel (`SimConfig.slowdown`, the expected slowest GPU's), which
    collectives do not pay. `sms`: the GPU's SMs (0: none counted); overlapped, the
    reduce-scatter's userbuffers kernel holds `_tp_overlap_sms(b, ub)`'s SMs (`ub`: the run's
    userbuffers configuration, `sim.userbuffers`) beside the last GEMMs
    (`beside_kernel`). The backward's second gather (2-8 SMs, beside the first GEMMs and after
    the first gather) counts as free. `ring`: under CP, the least seconds of a block's attention
    ring (`cp_ring_floor`), which stand for its core's kernel seconds (inside the middle GEMMs'
    or the block's). `no_grad`: a forward without autograd
    (`canzona.recompute.forward_without_grad`), whose overlapped all-gather runs before the first
    GEMMs, run whole (`Block.without_grad`)."""
    if no_grad:
        b = b.without_grad()
    core = ring(b) - b.core_s * stretch if ring is not None and b.ring_steps else 0.0
    if tp_cost is None or not b.tp_collectives or b.ep_bytes:
        return b.seconds * stretch + core
    ag, rs = tp_cost
    if not b.sends_output:  # a re-run stopped before its row GEMMs: its input's gather(s) only
        return gathers * ag + b.seconds * stretch + core if no_grad or not overlap else \
            max(b.first_s * stretch, gathers * ag) + b.middle_s * stretch + core
    if not overlap and gathers < 2:  # NCCL's collectives (`sim.iteration._Stage.nccl_block`): forward in series
        return ag + b.seconds * stretch + core + rs
    if not overlap:  # backward: the input's re-gather beside the data-gradient GEMMs, the reduce-scatter beside
        # the weight-gradient ones (their SMs counted as free)
        wgrad = b.last_wgrad_s * stretch
        return ag + (b.first_s + b.middle_s) * stretch + core + max(b.last_s * stretch - wgrad, ag) + max(wgrad, rs)
    held = _tp_overlap_sms(b, ub)
    k = held.backward_reduce_scatter if gathers > 1 else held.forward_reduce_scatter
    first = gathers * ag + b.first_s * stretch if no_grad else max(b.first_s * stretch, gathers * ag)
    return first + b.middle_s * stretch + core + beside_kernel(b.last_s * stretch, rs, k, sms)


def stage_floor(work: MicroBatchWork, tp_cost: tuple[float, float] | None, overlap: bool,
                expert_comm: Callable[[Block], float] | None = None, stretch: float = 1.0, sms: int = 0,
                ring: Callable[[Block], float] | None = None, ep_overlap: bool = False,
                no_grad: bool = False, ub: str = DEFAULT_UB_CONFIG) -> float:
    """`block_floor` over one micro-batch's forward (one all-gather a block) and backward (two:
    the input is gathered again for the weight gradients) on a stage, with its head and embedding;
    an expert block (under EP) with `expert_comm`, its collectives' least seconds; every kernel
    `stretch` times as long, an overlapped reduce-scatter's SMs (of the GPU's `sms`) taken from
    the last GEMMs and the CP ring's exchanges counted (`ring`, `block_floor`). `ep_overlap`
    (Megatron's EP all-to-all overlap, `sim.ep_overlap`): the expert collectives run on their own
    stream beside the compute, so a micro-batch costs at least the larger of its compute stream's
    floor (expert blocks at their kernels' seconds) and its collectives' least seconds. `no_grad`:
    the forward runs without autograd (`block_floor`); the backward's re-run of it has grad. `ub`:
    the run's userbuffers configuration (`block_floor`)."""

    def floor(b: Block, gathers: int, no_grad: bool = False) -> float:
        # under full recompute the forward block runs again first, in series, collectives and all
        again = floor(b.recompute, 1) if b.recompute is not None else 0.0
        if b.ep_bytes and expert_comm is not None:
            return again + b.seconds * stretch + (0.0 if ep_overlap else expert_comm(b))
        return again + block_floor(b, gathers, tp_cost, overlap, stretch, sms, ring, no_grad, ub)

    # a layer outside any checkpoint (Megatron's block method past its first N) runs with grad
    compute = (sum(floor(b, 1, no_grad and work.checkpointed(k))
                   for k, layer in enumerate(work.forward) for b in layer)
               + sum(floor(b, 2) for layer in work.backward for b in layer)
               + (work.head_forward_s + work.head_backward_s + work.embed_forward_s + work.embed_backward_s) * stretch)
    if not ep_overlap or expert_comm is None:
        return compute
    comm = sum(expert_comm(c) for passes in (work.forward, work.backward) for layer in passes for b in layer
               for c in (b, b.recompute) if c is not None and c.ep_bytes)
    return max(compute, comm)


def expert_comm_floor(cfg: SimConfig, hw: HardwareProfile) -> Callable[[Block], float] | None:
    """Under expert parallelism (None without), the least seconds of an expert block's
    collectives, which `sim.iteration._Stage.block` runs in series with its grouped GEMMs: the
    token dispatch, under expert TP the ETP group's all-gather of the pairs and the
    reduce-scatter of the outputs, and the combine (`sim.ep_dispatch.ep_costs`), each at
    its latency plus its transfer at the full rate (shared links only stretch it) and its local
    passes; priced by the simulator's own costs on the expert cluster."""
    if cfg.ep == 1:
        return None
    experts = cfg.expert_cluster(Cluster(cfg.gpus, cfg.tp, hw.node.gpus, cfg.pp, cp=cfg.cp))
    memo: dict[tuple, float] = {}

    def comm(b: Block) -> float:
        key = (b.ep_bytes, b.ep_received, b.etp_bytes, b.ep_flex, b.ep_meta, b.sends_output)
        if key not in memo:
            dispatch, combine = ep_costs(b.ep_bytes, b.ep_received, b.ep_flex, experts, hw, b.ep_meta)
            # a re-run stopped at torch's early stop sends no combine (`Block.sends_output`)
            seconds = dispatch.seconds + (combine.seconds if b.sends_output else 0.0)
            if b.etp_bytes:
                geo = experts.tp_geometry()
                seconds += (collective_cost("all-gather", b.etp_bytes, geo, hw).seconds
                            + collective_cost("reduce-scatter", b.etp_bytes, geo, hw).seconds)
            memo[key] = seconds
        return memo[key]

    return comm


def cp_ring_floor(cfg: SimConfig, hw: HardwareProfile, stretch: float) -> Callable[[Block], float] | None:
    """Under context parallelism (None without), the least seconds of a block's attention ring as
    `sim.iteration._Stage.core` runs it: exchange i (on the CP stream, after step i - 1 and the
    exchange before it) and step i (after both) start no earlier than the later of step i - 1 and
    exchange i - 1, and step i + 1 waits for both; so each step with an exchange lasts at least
    `beside_kernel` of its kernel seconds (times `stretch`) and the exchange's least seconds, with
    the fewest SMs NCCL's kernel can hold (`sim.comm_sms.nccl_sms`, on the simulator's own ring
    price `cp_ring_cost`), and a step without one its kernel seconds."""
    if cfg.cp == 1:
        return None
    cluster = Cluster(cfg.gpus, cfg.tp, hw.node.gpus, cfg.pp, cp=cfg.cp)
    memo: dict[float, tuple[float, int]] = {}

    def exchange(sent: float) -> tuple[float, int]:
        if sent not in memo:
            cost = cp_ring_cost(sent, cluster, hw)
            # two members, a ring step's one peer each way: the fewest SMs `nccl_sms` gives the
            # exchange, however many of the group's ranks the simulator runs it on (fewer SMs: a
            # lower floor, still sound)
            memo[sent] = (cost.seconds, nccl_sms(cost, 2))
        return memo[sent]

    def ring(b: Block) -> float:
        total = 0.0
        for i in range(b.ring_steps):
            w = b.step_seconds(i) * stretch
            if i < len(b.ring_bytes):
                c, k = exchange(b.ring_bytes[i])
                total += beside_kernel(w, c, k, hw.gpu.sms)
            else:
                total += w
        return total

    return ring


def tp_costs(cfg: SimConfig, model, hw) -> tuple[float, float] | None:
    """The least seconds of a sequence-parallel all-gather and reduce-scatter of one micro-batch's
    activations over a TP group (`sim.iteration._Stage`'s costs, the all-gather's elements
    `tp_gather_bytes` each; None at TP 1)."""
    if cfg.tp == 1:
        return None
    cluster = Cluster(cfg.gpus, cfg.tp, hw.node.gpus, cfg.pp, cp=cfg.cp)
    wl = cfg.workload
    elements = wl.tokens_per_micro_batch // cfg.cp * model[1].hidden
    geo = cluster.tp_geometry()
    gathered = elements * tp_gather_bytes(wl, cfg.options.tp_comm_overlap)
    return (collective_cost("all-gather", gathered, geo, hw).seconds,
            collective_cost("reduce-scatter", elements * wl.activation_bytes, geo, hw).seconds)


def time_floor(cfg: SimConfig, model, rate: DeviceRate, hw: HardwareProfile | None = None) -> float:
    """A lower bound of the simulated iteration time: the simulator's own kernel seconds of one
    micro-batch per stage (`sim.model_work.micro_batch_work`, forward and backward with the
    recompute asked), its TP collectives where a block must wait for them and the SMs an
    overlapped reduce-scatter takes from the last GEMMs (`block_floor`), under CP each attention
    ring's exchanges with their SMs (`cp_ring_floor`), with every other collective (the DP
    reductions and gathers, their SMs), send and the optimizer step taken as free. The busiest
    stage runs all `m` micro-batches on one stream; the last stage cannot start before the first
    micro-batch's forward has crossed the first chunk of every stage before it, nor can the
    iteration end before the last backward has crossed them back (1/V of a stage's work under the
    interleaved schedule's even split; under an uneven one the chunk's own layers, `chunk_spec`).
    Under expert parallelism an expert block's dispatch and combine (and its ETP collectives)
    count (`expert_comm_floor`): the block waits for each of them. Under full recompute a backward
    block runs its forward block again first (`Block.recompute`), its TP collectives, CP ring and
    expert collectives with it, counted as the forward's. Under Megatron's
    EP all-to-all overlap the expert collectives run on their own stream, and a micro-batch costs
    at least the larger of its compute and its expert collectives (`stage_floor`). Every kernel
    counts at the simulator's factor for the slowest GPU (`SimConfig.slowdown`)."""
    spec, arch = model
    wl = cfg.workload
    hw = hw or load_profile(cfg.hardware)
    tp_cost = tp_costs(cfg, model, hw)
    expert_comm = expert_comm_floor(cfg, hw)
    stretch = cfg.slowdown(hw, cfg.gpus)  # the simulator's factor on phase A's kernels (sim.engine)
    if cfg.fsdp:
        return fsdp_time_floor(cfg, model, rate, hw, tp_cost, expert_comm, stretch)
    ring = cp_ring_floor(cfg, hw, stretch)
    m = wl.micro_batches(cfg.gpus // (cfg.tp * cfg.pp * cfg.cp))
    head_dim = layer_dims(arch, spec).head_dim
    # its casts as the simulator prices them (`sim.fp8.fp8_setup`: under FP8 primary weights a weight's
    # pass is its transpose only, which a floor at the full cast would overstate), not its amax
    # all-reduces (collectives are free here)
    fp8 = FP8Setup.of(wl, m) if wl.precision == FP8 else None

    def floor_of(part, stage: int) -> float:
        """One micro-batch of `part` (a stage's or a chunk's parameters) on pipeline rank `stage`."""
        work = stage_work(cfg, arch, head_dim, part, stage, rate, fp8)
        if stage:  # a tied embedding's copy on the last stage: the run looks up and
            # back-propagates it on virtual stage 0 only (sim.iteration._Stage.forward_start, backward_end)
            work = replace(work, embed_forward_s=0.0, embed_backward_s=0.0)
        return stage_floor(work, tp_cost, cfg.options.tp_comm_overlap, expert_comm, stretch, hw.gpu.sms,
                           ring, cfg.options.overlap_moe_expert_parallel_comm,
                           forward_without_grad(cfg.options.recompute) and not cfg.fsdp,
                           cfg.options.tp_comm_overlap_cfg)

    per_stage = [floor_of(stage_spec(spec, cfg.pp, stage, arch.layers, cfg.vp, cfg.pipeline_split), stage)
                 for stage in _kinds(cfg.pp)]
    if cfg.pp > 3:  # the middle stages are alike (PP divides the layers): one stands for them all
        per_stage[1:2] = [per_stage[1]] * (cfg.pp - 2)
    if cfg.pipeline_split.even or cfg.pp == 1:  # each chunk 1/V of its stage's layers (the first stage's first
        # one more)
        crossing = sum(per_stage[:-1]) / cfg.vp
    else:  # the first chunk of each stage before the last as the split cuts it (the embedding alone, it may be)
        firsts = [floor_of(chunk_spec(spec, cfg.pp, stage, 0, arch.layers, cfg.vp, cfg.pipeline_split), stage)
                  for stage in _kinds(cfg.pp)[:-1]]
        crossing = firsts[0] + (cfg.pp - 2) * (firsts[1] if len(firsts) > 1 else 0.0)
    return max(max(per_stage) * m, per_stage[-1] * m + crossing)


def fsdp_time_floor(cfg: SimConfig, model, rate: DeviceRate, hw: HardwareProfile,
                    tp_cost: tuple[float, float] | None, expert_comm: Callable[[Block], float] | None,
                    stretch: float) -> float:
    """`time_floor` of an FSDP layout (`sim.fsdp`): rank 0's compute stream runs every micro-batch's
    kernels one after another (`sim.fsdp.fsdp_micro_batch_work`, its own micro-batch work: no
    pipeline, the whole model), each block after its TP collectives where it must wait for them
    (`block_floor`; the SMs they take from the GEMMs counted as free) and an expert block between
    its dispatch and combine (`expert_comm_floor`), a full recompute's forward block again first,
    every forward with grad (torch's non-reentrant checkpoint wrapper) but a checkpointed layer's
    first under Megatron-FSDP's (`sim.fsdp.fsdp_forward_without_grad`: its NCCL all-gathers before
    the first GEMMs, `block_floor`'s `no_grad`), and FSDP2's copies on the
    compute stream: each unit's copy-out after its forward's all-gather and, resharded after
    forward, its backward's, and its copy-in before each reduce-scatter (`sim.fsdp.copy_seconds`).
    Every FSDP all-gather, reduce-scatter and all-reduce, and the optimizer step, count as free;
    every kernel at the simulator's factor for the slowest GPU (`stretch`)."""
    spec, arch = model
    cluster = Cluster(cfg.gpus, cfg.tp, hw.node.gpus, cfg.pp, cp=cfg.cp)
    head_dim = layer_dims(arch, spec).head_dim
    m = cfg.workload.micro_batches(cluster.dp)

    def floor_of(stage: int) -> tuple[float, dict[int, float], dict[int, float]]:
        """Pipeline stage `stage`'s (at PP 1 the model's) micro-batch kernels and its units' copies."""
        part = stage_spec(spec, cfg.pp, stage, arch.layers, split=cfg.pipeline_split)
        work = fsdp_micro_batch_work(cfg, (part, arch), cluster, hw, rate, head_dim, stage)
        compute = stage_floor(work, tp_cost, cfg.options.tp_comm_overlap, expert_comm, stretch,
                              no_grad=fsdp_forward_without_grad(cfg))
        local, expert_local = unit_elements(part, cfg.tp, cfg.ep)
        return compute, *copy_seconds(cfg, rate, gathered_elements(local, expert_local, cluster.dp * cfg.tp // cfg.ep))

    if cfg.pp == 1:
        compute, copy_out, copy_in = floor_of(0)
        # the root stays gathered through the micro-batch: one copy-out; a layer's backward copies out again
        # when its forward resharded it
        copies = sum(copy_out.values()) + sum(copy_in.values()) + \
            (sum(s for k, s in copy_out.items() if k != ROOT) if cfg.reshard_after_forward else 0.0)
        return (compute + copies * stretch) * m
    # under torch's pipelining (sim.fsdp_pipeline) each stage runs its m micro-batches on its compute
    # stream, each unit copied out at least once (the first forward gathers it) and copied in once (its
    # one reduce-scatter); the last stage starts after the first micro-batch's forward crossed every
    # stage before it, and the iteration ends after the last backward crossed them back (PP divides the
    # layers: the middle stages are alike)
    kinds = [floor_of(stage) for stage in _kinds(cfg.pp)]
    per_stage = [c * m + (sum(out.values()) + sum(into.values())) * stretch for c, out, into in kinds]
    crossing = kinds[0][0] + (cfg.pp - 2) * (kinds[1][0] if cfg.pp > 2 else 0.0)
    return max(max(per_stage), kinds[-1][0] * m + crossing)


@dataclass(order=True)
class _Pending:
    floor: float
    order: int
    cfg: SimConfig = field(compare=False)
    layout: Layout = field(compare=False)


def search(q: Question, top: int = 5, refine_top: int = 2, workers: int | None = None,
           progress: Progress | None = None, *, also_below: float = 0.0, within: float = 0.0,
           prune_ties: bool = True) -> SearchResult:
    """Search `q`'s layouts (module docstring): the `top` fastest that fit are exact (branch and
    bound on `time_floor`); `progress(done, total, what, best)` after each simulation (`Progress`). With
    `also_below` (seconds), so is every fitting layout faster than both `also_below` and `1 +
    within` times the best (what `sim.published_search` needs to rank a published layout: the
    bound is the larger of the two, and it only falls as results come in, so every layout below
    the final one was simulated). `prune_ties`: a refinement's reduce-scatter that routes every
    reduction of the simulated row as its own does is not simulated again (the same run: its
    time is the row's, and ties go to the defaults); False simulates it (the reference the
    pruning is tested against)."""
    import heapq
    import time

    start = time.perf_counter()
    facts = facts_of(q)
    space = space_of(q)
    model = resolve_model(q.model)
    hw = load_profile(q.hardware)
    rate = DeviceRate.from_profile(hw)
    capacity = hw.gpu.memory_bytes
    cands = candidates(q, facts)
    reasons: dict[str, int] = {}
    counts = {"checks": 0, "memory": 0, "bound": 0, "ties": 0, "same": 0}
    queue: list[_Pending] = []

    first: dict[str, str] = {}  # each reason's first message in full

    def refuse(e: SpecError) -> None:
        counts["checks"] += 1
        key = " ".join(str(e).split()[:4])
        reasons[key] = reasons.get(key, 0) + 1
        first.setdefault(key, str(e))

    # Megatron's block method: the ZeRO-1 layouts' (FSDP's checkpoint wrappers take every layer)
    explore = q.search_recompute_layers and q.recompute_method is None and space is ZERO1_SPACE

    def least_block(layout: Layout, room: float, above: int = 0) -> int | None:
        """The fewest layers of each model chunk, more than `above` and fewer than a chunk's (all of
        them is plain full), Megatron's block method must checkpoint for `layout`'s memory floor to
        stay within `room`; None if none does. The floor falls as N grows (each checkpointed layer
        stores its input only)."""
        lo, hi, best = above + 1, facts.layers // (layout["pp"] * layout["vp"]) - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            if memory_floor(config_of(q, {**layout, "recompute_method": BLOCK, "recompute_num_layers": mid}),
                            model) <= room:
                best, hi = mid, mid - 1
            else:
                lo = mid + 1
        return best

    # the recompute settings (`recompute_variant`) each layout (`_layout_key`) has had: queued, or
    # refused by the memory floor, which no later round changes
    tried: dict[tuple, set[tuple]] = {}
    # a layout's full recompute after its block method's run did not fit (`settle`): the block at
    # more layers, or every layer, tried beside the settings not yet tried (full is in `tried`)
    block_next: dict[tuple, Layout] = {}

    def push(layout: Layout, gap: float = 0.0) -> None:
        """Queue `layout` with the recompute setting of least compute among those not yet tried on it
        whose memory floor fits: the least time floor (`time_floor`, the bound the queue is ordered by: a layout's floors
        under two settings differ by exactly the kernels, and under full recompute the
        collectives, each runs again), `none` without comparing (it runs nothing again). Full
        recompute is first Megatron's block method (`explore`) at the fewest layers
        whose floor fits `gap` below the capacity: what a run of the layout measured beyond its
        floor (the plan's buffers, state and masters, which the recompute does not change).
        After a block run that did not fit, full is the block method's next try (`block_next`),
        weighed with the others. Nothing fits: pruned by the
        memory floor (or by the method's rule), unless every setting had been tried."""
        base = {k: v for k, v in layout.items() if k not in RECOMPUTE_KEYS}
        key = _layout_key(space, base)
        done = tried.setdefault(key, set())
        fitting: list[tuple[SimConfig, Layout]] = []
        considered, refused = 0, None
        for setting in space.recompute_variants(q):
            if setting[RECOMPUTE_AXIS] == FULL and key in block_next:
                setting = block_next[key]  # carries its method: no block chosen again below
            elif recompute_variant(setting) in done:
                continue
            chosen = {**base, **setting}
            considered += 1
            mode = chosen[RECOMPUTE_AXIS]
            if mode == FULL and explore and "recompute_method" not in chosen:
                n = least_block(chosen, capacity - gap)
                if n is not None:
                    chosen.update(recompute_method=BLOCK, recompute_num_layers=n)
            cfg = config_of(q, chosen)
            if mode == FULL and q.recompute_method is not None:
                try:  # a uniform group must divide every model chunk (checked with the mode: the layout passed)
                    cfg.check(model)
                except SpecError as e:  # refused by that rule, not by the memory
                    refused = e
                    done.add(recompute_variant(chosen))
                    continue
            if memory_floor(cfg, model) > capacity:
                done.add(recompute_variant(chosen))
                if mode == FULL:
                    block_next.pop(key, None)
                continue
            fitting.append((cfg, chosen))
            if mode == NONE:  # none runs nothing again: nothing has less compute
                break
        if not fitting:
            if refused is not None:
                refuse(refused)
            elif considered:
                counts["memory"] += 1
            return
        floors = [time_floor(cfg, model, rate, hw) for cfg, _ in fitting] if len(fitting) > 1 else [None]
        i = min(range(len(fitting)), key=lambda j: floors[j])  # ties: the space's order
        cfg, chosen = fitting[i]
        done.add(recompute_variant(chosen))
        if chosen[RECOMPUTE_AXIS] == FULL:
            block_next.pop(key, None)
        floor = floors[i] if floors[i] is not None else time_floor(cfg, model, rate, hw)
        heapq.heappush(queue, _Pending(floor, len(queue) + len(rows), cfg, chosen))

    rows: list[dict[str, Any]] = []
    for layout in cands:
        try:
            config_of(q, layout).check(model)  # the simulator's own rules
        except SpecError as e:
            refuse(e)
            continue
        push(layout)
    if not cands:  # no combination of the axes at all: the one axis that can be left empty is the micro-batch
        raise SpecError(_no_layout_divides(q, facts, model))
    if not queue and len(reasons) == 1 and counts["checks"] == len(cands):
        # every layout refused for one reason (the question's own: GPUs that fill no node, a batch
        # too large): the simulator's message, as `canzona simulate` gives it, but the batch's said of the search
        raise SpecError(_fsdp_without_shards(q, cands) or _too_many_micro_batches(q, cands, model)
                        or next(iter(first.values())))
    if not queue:
        why = "; ".join(f"{k}... ({n})" for k, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:3])
        raise SpecError(f"no layout of {q.model} on {q.gpus} GPUs passes the simulator's checks and the memory floor "
                        f"({len(cands)} candidates; {counts['checks']} refused: {why or 'none'}; {counts['memory']} "
                        f"over {capacity / 1e9:.1f} GB per GPU even with full recompute)")

    workers = workers or os.cpu_count() or 1

    def bound() -> float:
        """What a candidate's floor must not exceed to be simulated: the `top`-th best fitting time so far
        (infinite until there are `top`), or the `also_below` / `within` reach when larger."""
        times = sorted(r["iteration_time_s"] for r in rows if r["fits"])
        kth = times[top - 1] if len(times) >= top else math.inf
        return max(kth, min(also_below, (1 + within) * times[0])) if times else kth

    run_refused: list[str] = []  # the messages of the layouts the run itself refused (`_run_task`)
    fastest = [math.inf]  # the fastest fitting iteration so far (`progress`'s best)

    def settle(row: dict[str, Any]) -> None:
        if "error" in row:
            run_refused.append(row["error"])
            refuse(SpecError(row.pop("error")))
            return
        if prune_ties and row["refined"] and any(same_run(row, r) for r in rows if not r["refined"]):
            counts["same"] += 1  # its layout's run again, found by running it (`same_run`): not listed twice
            return
        rows.append(row)
        if row["fits"]:
            fastest[0] = min(fastest[0], row["iteration_time_s"])
        if not row["fits"] and not row["refined"]:
            layout = layout_of(row)
            # what the run needed beyond its floor: the room the next recompute's floor must leave
            gap = max(0.0, row["memory_bytes"] - memory_floor(config_of(q, layout), model)) if explore else 0.0
            if explore and row["recompute_method"] == BLOCK:  # the search's block did not fit: more layers, or all
                n = least_block(layout, capacity - gap, above=row["recompute_num_layers"])
                plain = n is None
                block_next[_layout_key(space, layout)] = {RECOMPUTE_AXIS: FULL,
                                                          "recompute_method": None if plain else BLOCK,
                                                          "recompute_num_layers": None if plain else n}
                # with the settings not yet tried: more block layers may re-run more than selective-op
                push(layout, gap)
                return
            # the next least-compute setting not yet tried: only for a layout that did not fit
            push(layout, gap)

    with stopping_pool(workers) as pool:  # SIGTERM or Ctrl-C: the running layouts stopped, not waited for
        running: dict[Any, _Pending] = {}

        def drain() -> None:
            done = 0
            while queue or running:
                while queue and len(running) < workers:
                    item = heapq.heappop(queue)
                    if item.floor > bound():  # no faster than the top ones already found
                        counts["bound"] += 1
                        continue
                    running[pool.submit(_run_task, (item.cfg, item.layout))] = item
                if not running:
                    continue
                finished, _ = wait(running, timeout=HEARTBEAT_S if progress else None, return_when=FIRST_COMPLETED)
                if not finished and progress:
                    progress(len(rows), len(rows) + len(queue) + len(running), None,
                             fastest[0] if fastest[0] < math.inf else None)
                for fut in finished:
                    item = running.pop(fut)
                    settle(fut.result())
                    done += 1
                    if progress:
                        label = " ".join([describe(item.layout), *(str(item.layout[a.name]) for a in space.refine
                                                                   if a.name in item.layout)])
                        progress(len(rows), len(rows) + len(queue) + len(running), label,
                                 fastest[0] if fastest[0] < math.inf else None)

        drain()
        # refinement: the best layouts under the other step policies and reduce-scatters (same bound)
        best = sorted((r for r in rows if r["fits"]), key=lambda r: r["iteration_time_s"])[:refine_top]
        for row in best:
            layout = layout_of(row)
            for axis in space.refine:
                for value in refine_values(q, axis, facts, layout)[1:]:
                    if prune_ties and axis.name == "reduce_scatter" and value in row["reduce_scatter_alike"]:
                        counts["ties"] += 1  # the same run as `row` (`canzona.reductions.alike_impls`)
                        continue
                    chosen = {**layout, axis.name: value}
                    cfg = config_of(q, chosen)
                    heapq.heappush(queue, _Pending(time_floor(cfg, model, rate, hw), len(queue) + len(rows), cfg, chosen))
        drain()

    if not rows:  # every layout simulated was refused by a rule only the run knows (`_run_task`): none to rank
        raise SpecError(f"no layout of {q.model} on {q.gpus} GPUs runs: the {len(run_refused)} simulated were refused "
                        f"by the run ({'; '.join(sorted(set(run_refused))[:3])})")
    fit = sorted((r for r in rows if r["fits"]), key=lambda r: (r["iteration_time_s"], _order(r)))
    not_fitting = sorted((r for r in rows if not r["fits"]), key=lambda r: r["memory_bytes"])
    return SearchResult(q, fit, not_fitting, len(cands), counts["checks"], counts["memory"], len(rows) + counts["same"],
                        reasons, time.perf_counter() - start, workers, counts["bound"], top,
                        counts["ties"] + counts["same"])


def deployed_policy(row: dict[str, Any]) -> str:
    """The step policy a simulated row runs: canzona's ZeRO-1 fallback where it fell back to one
    (`STEP_POLICIES`), else the row's own (None: a layout not yet simulated has none, the default)."""
    return row["fell_back_to"] if row["fell_back_to"] in STEP_POLICIES else row.get("policy")


def same_run(refined: dict[str, Any], row: dict[str, Any]) -> bool:
    """Whether a refinement's simulated row is `row`'s run again: the same layout, the same step
    policy deployed and the same iteration, step and memory to the bit. A reduce-scatter whose
    routes the refinement could not know in advance (`run_one`'s `reduce_scatter_alike` is over
    every candidate plan of the layout, canzona's own included) turns out alike where canzona fell
    back to ZeRO-1's even segments: the deployed run is the same, and a second row of it would take
    a place among the best (ties go to the defaults, the unrefined row)."""
    return (layout_of(refined) == layout_of(row) and deployed_policy(refined) == deployed_policy(row)
            and all(refined[k] == row[k] for k in ("iteration_time_s", "optimizer_step_s", "memory_bytes")))


def _check_question(q: Question, model) -> None:
    """The question's own refusal, where it has one (GPUs that fill no node): the simulator's message,
    as `canzona simulate` gives it, checked on the plainest layout at a batch its DP divides, so
    that the batch's own refusal is left to the caller's message of every layout."""
    config_of(replace(q, global_batch=q.gpus), {"tp": 1}).check(model)


def _no_layout_divides(q: Question, facts: Facts, model) -> str:
    """Why a question has no candidate (`candidates` is empty only where no layout's DP divides the global
    batch: `MICRO_BATCH_AXIS`): the question's own refusal where it has one (`_check_question`), else
    the batch's, of every layout (one layout's refusal, `dp x micro batch = N x 1` at TP 1,
    would read as if the search had tried no other DP)."""
    _check_question(q, model)
    dps = sorted({c["dp"] for c in candidates(q, facts, before=MICRO_BATCH_AXIS.name)})
    return (f"no layout of {q.model} on {q.gpus} GPUs splits the global batch {q.global_batch} over its DP ranks: "
            f"the DP sizes its layouts have (the GPUs over TP x PP x CP) are {', '.join(map(str, dps))}; give "
            f"--global-batch a multiple of one of them (the least: {dps[0]}) or fewer GPUs")


def _fsdp_without_shards(q: Question, cands: list[Layout]) -> str | None:
    """Where every layout of an --fsdp question leaves one data-parallel rank, which FSDP cannot shard
    over (`canzona.fsdp_plan.check_hsdp`), why, of the search (None elsewhere): FSDP's own message
    advises --tp, an axis the search explores and an option `canzona search` does not take."""
    if not q.fsdp or any(c["dp"] >= 2 for c in cands):
        return None
    if q.gpus < 2:
        return f"--fsdp shards over at least 2 data-parallel ranks and {q.gpus} GPU has 1: raise --gpus"
    return (f"no layout of {q.model} on {q.gpus} GPUs leaves the 2 data-parallel ranks --fsdp shards over: a layout's "
            f"DP divides the global batch {q.global_batch}, which only DP 1 does; give --global-batch a multiple of 2")


def _too_many_micro_batches(q: Question, cands: list[Layout], model) -> str | None:
    """Where every layout runs more micro-batches per DP rank than the simulator does
    (`sim.workload.MAX_MICRO_BATCHES`), why, of the search's layouts (None elsewhere): the simulator's
    own message advises --micro-batch, which `canzona search` does not take (an axis it explores up to
    `MAX_MICRO_BATCH`). The question's own refusal first (`_check_question`)."""
    _check_question(q, model)
    least = min(cands, key=lambda c: q.global_batch // (c["dp"] * c["micro_batch"]))
    fewest = q.global_batch // (least["dp"] * least["micro_batch"])
    if fewest <= MAX_MICRO_BATCHES:
        return None
    most = max(c["dp"] for c in cands) * MAX_MICRO_BATCH * MAX_MICRO_BATCHES
    return (f"no layout of {q.model} on {q.gpus} GPUs runs the global batch {q.global_batch} in at most "
            f"{MAX_MICRO_BATCHES} micro-batches per DP rank (the simulator's limit): the fewest any layout has is "
            f"{fewest} (DP {least['dp']} x micro-batch {least['micro_batch']}; the search tries micro-batches up "
            f"to {MAX_MICRO_BATCH}); lower --global-batch (at most {most} on {q.gpus} GPUs)")


# a layout's keys that say its recompute: the mode, Megatron's method, selective-layer's K
RECOMPUTE_KEYS = (RECOMPUTE_AXIS, *METHOD_KEYS, AC_KEY)


def recompute_variant(layout: Layout) -> tuple:
    """A layout's recompute setting as the rounds of `search` tell them apart: the mode and
    selective-layer's K (Megatron's block method's layers are the search's choice within full)."""
    return layout[RECOMPUTE_AXIS], layout.get(AC_KEY)


def _layout_key(space: Space, layout: Layout) -> tuple:
    """A layout's axes but its recompute."""
    return tuple(layout[k] for k in space.layout_keys if k != RECOMPUTE_AXIS)


def _order(row: dict[str, Any]) -> tuple:
    """Ties broken towards the simpler layout (under FSDP: fewer replicas, resharded after forward)."""
    return (row["refined"], row["pp"], row["vp"], row["ep"],
            _row_space(row).recompute_modes.index(row["recompute"]), -(row.get(AC_KEY) or 0), row["tp"],
            row.get("hsdp_replicate", 1),
            not row.get("reshard_after_forward", True))


def _recompute_text(row: Layout) -> str:
    """A layout's recompute, with Megatron's method where a simulated row ran one and
    selective-layer's K."""
    return recompute_label(row[RECOMPUTE_AXIS], row.get("recompute_method"), row.get("recompute_num_layers"),
                           every=row.get(AC_KEY))


def describe(layout: Layout) -> str:
    """A layout on one line (the progress bar's and the table's)."""
    fsdp = "hsdp_replicate" in layout  # an FSDP layout (FSDP_SPACE's axes)
    parts = (["FSDP", f"TP{layout['tp']}"] + ([f"PP{layout['pp']}"] if layout["pp"] > 1 else []) if fsdp
             else [f"TP{layout['tp']}", f"PP{layout['pp']}"])
    parts += [f"VP{layout['vp']}"] if layout["vp"] > 1 else []
    parts += [] if layout.get("pipeline_split", "even") == "even" else [f"split {layout['pipeline_split']}"]
    parts += [f"CP{layout['cp']}"] if layout.get("cp", 1) > 1 else []
    parts += [f"EP{layout['ep']}"] if layout["ep"] > 1 else []
    parts += [f"DP{layout['dp']}"]
    if fsdp:
        parts += [f"HSDP{layout['hsdp_replicate']}"] if layout["hsdp_replicate"] > 1 else []
        parts += [] if layout["reshard_after_forward"] else ["no-reshard"]
    parts += [f"mb{layout['micro_batch']}", f"recompute {_recompute_text(layout)}"]
    parts += ["EP overlap"] if layout.get("overlap_moe_expert_parallel_comm") else []  # a simulated row's
    return " ".join(parts)


__all__ = ["FSDP_LAYOUT_AXES", "FSDP_REFINE_AXES", "FSDP_SPACE", "SEARCHED_SPLITS", "SPACES", "ZERO1_RECOMPUTE_MODES",
           "ZERO1_SPACE", "Axis",
           "LAYOUT_AXES", "REFINE_AXES", "Question", "SearchResult", "Space", "candidates", "config_of", "fsdp_launch",
           "memory_floor", "plan_command", "recompute_variant", "row_config", "search", "selective_ac_options", "space_of",
           "split_name"]
