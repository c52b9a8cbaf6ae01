"""The simulator against published training runs (`canzona validate --published`).

`canzona/data/published_runs.json` holds runs collected from public sources (NeMo / Megatron-Bridge
performance summaries and model verification cards, NVIDIA's DGX Cloud benchmarking recipes,
torchtitan's and NeMo AutoModel's performance pages), each with its source, layout and published
throughput in tokens per second per GPU. Every row the simulator can express is simulated as
published (its model, GPUs, TP / PP / CP / EP, batch, sequence, AdamW under ZeRO-1, the hardware
profile of its GPUs) and compared; a row needing what the simulator does not model yet (the
context parallelism with EP or FSDP, FSDP with AdamW, ...) is listed with what it needs and no error figure.
No row is folded onto another axis and nothing is corrected per row or per model: the errors are
the simulator's own (docs/design.md §9.6).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import canzona
from canzona.attention_rate import ATTENTION_BACKENDS, DEFAULT_ATTENTION_BACKEND
from canzona.errors import SpecError
from canzona.fileio import parse_json, read_text
from canzona.optimizers import matrix_optimizer
from canzona.pipeline import EVEN_SPLIT, PipelineSplit
from canzona.recompute import (
    RECOMPUTE_MODES,
    SELECTIVE_LAYER,
    check_recompute,
    check_recompute_method,
    recompute_label,
    selective_ac_every,
)
from sim.cross_entropy import CROSS_ENTROPY_FUSION_IMPLS, DEFAULT_CROSS_ENTROPY_FUSION_IMPL
from sim.eager_kernels import FUSED, KERNEL_MODES
from sim.ep_dispatch import ALLTOALL, DEEPEP_SMS, DEFAULT_HYBRIDEP_SMS, EpDispatcher
from sim.fp8 import DELAYED, FP8_RECIPES, PRECISIONS
from sim.fsdp_copies import FSDP2, FSDP_IMPLS
from sim.options import RunOptions
from sim.simulate import SimConfig, simulate
from sim.userbuffers import DEFAULT_UB_CONFIG, check_ub_config, check_ub_config_applies
from sim.workers import stopping_pool
from sim.workload import Workload, grad_bytes_for, loss_bytes_for

DATA_DIR = Path(canzona.__file__).resolve().parent / "data"
PUBLISHED_RUNS = DATA_DIR / "published_runs.json"
SCHEMA = "canzona.published_runs"
# the simulator's activation recompute modes (torchtitan's selective-op among them); a source's
# other modes are kept as published and make the row not expressible
SIM_RECOMPUTE = RECOMPUTE_MODES
_INTS = ("gpus", "tp", "pp", "vp", "cp", "ep", "global_batch", "micro_batch", "seq_len")


@dataclass(frozen=True)
class PublishedRun:
    """One published run as its source states it (`published_runs.json`, one row)."""

    id: str
    model: str  # a catalog name, or a config file relative to canzona/data
    source: str  # a key of the file's sources
    hardware: str  # a hardware profile (canzona/profiles)
    gpus: int
    tp: int
    pp: int
    vp: int
    cp: int
    ep: int
    fsdp: bool
    global_batch: int
    micro_batch: int
    seq_len: int
    precision: str
    optimizer: str
    recompute: str | None  # None: the source does not say (simulated without recompute)
    tokens_per_s_per_gpu: float
    original_value: float
    original_unit: str
    conversion: str = ""
    step_time_s: float | None = None
    note: str = ""
    # an FP8 row's Transformer Engine scaling recipe (sim.fp8): its source's, or "delayed" (the
    # only recipe of Transformer Engine 1.x) where the source predates current scaling
    fp8_recipe: str = DELAYED
    # Megatron's DistributedDataParallelConfig.grad_reduce_in_fp32 as the recipe sets it: the
    # dtype of the gradient buffers, reduced and read by the distributed optimizer (False: bf16);
    # None: the recipe does not say, and the simulator keeps Megatron's default for bf16, fp32
    # (`Workload.grad_bytes`; a row without master weights: bf16, `grad_bytes_for`). `recipe_source` names where the recipe says it.
    grad_reduce_in_fp32: bool | None = None
    recipe_source: str = ""
    # an FSDP row's fully_shard(reshard_after_forward=...) as its recipe runs it (SimConfig's
    # option of the same name; True, FSDP2's default, unless `recipe_source` says otherwise)
    reshard_after_forward: bool = True
    # NeMo AutoModel's MaskedCrossEntropy(fp32_upcast=...) as the recipe sets it: False, the loss
    # keeps its log-softmax in the logits' bf16 (Workload.loss_bytes 2); None: not stated, the
    # fp32 copy Megatron's loss keeps
    loss_fp32_upcast: bool | None = None
    # the recipe's training loop keeps the model's logits through the backward beside PyTorch's
    # F.cross_entropy (an FSDP2 row's: Workload.loss_holds_logits); False: it does not (torchtitan
    # deletes them), or Megatron's loss
    loss_holds_logits: bool = False
    # whether the recipe keeps fp32 masters of its bf16 weights (Workload.master_weights): False on an
    # FSDP2 row whose framework builds the model in bf16 with no fp32 copy, torch's AdamW keeping its
    # moments in bf16 (NeMo AutoModel); True (default): mixed precision's masters
    master_weights: bool = True
    # Megatron's --attention-backend as the recipe ran it (`RunOptions.attention_backend`: "fused",
    # cuDNN's kernels, or "flash", flash-attn 2); None: not stated, simulated with "fused"
    attention_backend: str | None = None
    # the recipe's memory-bound kernels (`Workload.kernels`): "fused" (Transformer Engine /
    # Megatron's, the default) or "eager" (PyTorch's eager ops: torchtitan's compile = false),
    # and an FSDP row's implementation (`SimConfig.fsdp_impl`: "fsdp2", torch's fully_shard, the
    # default, or "megatron-fsdp"); either set away from its default needs `recipe_source`
    kernels: str = FUSED
    fsdp_impl: str = FSDP2
    # the source's own words that its layout was not tuned for speed (its `layout_not_tuned`):
    # `sim.published_search` ranks such a layout but does not hold it to the search's aim, since
    # nothing says a faster layout was not there to find; "": a tuned benchmark
    layout_not_tuned: str = ""
    # Megatron's token dispatcher as the recipe ran it (`RunOptions.ep_dispatcher`, sim.ep_dispatch:
    # --moe-token-dispatcher-type, --moe-flex-dispatcher-backend, --moe-hybridep-num-sms,
    # --moe-deepep-num-sms); None: not stated, simulated with the all-to-all (the SMs: Megatron's defaults)
    moe_token_dispatcher_type: str | None = None
    moe_flex_dispatcher_backend: str | None = None
    moe_hybridep_num_sms: int | None = None
    moe_deepep_num_sms: int | None = None
    # NeMo AutoModel's fake_balanced_gate as the recipe set it (`EpDispatcher.fake_balanced_gate`);
    # None: not stated, the learned router (uniform random routing, canzona.routing)
    fake_balanced_gate: bool | None = None
    # how the recipe cut the layers over the pipeline's model chunks (Megatron's
    # account_for_embedding/loss_in_pipeline_split, decoder_first/last_pipeline_num_layers, the
    # row's keys of the same names; absent: the even split)
    pipeline_split: PipelineSplit = EVEN_SPLIT

    @property
    def ep_dispatcher(self) -> EpDispatcher:
        """The row's dispatcher (`EpDispatcher`'s defaults for what the recipe does not state)."""
        return EpDispatcher(moe_token_dispatcher_type=self.moe_token_dispatcher_type or ALLTOALL,
                            moe_flex_dispatcher_backend=self.moe_flex_dispatcher_backend,
                            moe_hybridep_num_sms=DEFAULT_HYBRIDEP_SMS if self.moe_hybridep_num_sms is None
                            else self.moe_hybridep_num_sms,
                            moe_deepep_num_sms=DEEPEP_SMS if self.moe_deepep_num_sms is None
                            else self.moe_deepep_num_sms,
                            fake_balanced_gate=False if self.fake_balanced_gate is None else self.fake_balanced_gate)
    # Megatron's overlap_moe_expert_parallel_comm as the recipe ran it (`RunOptions`, sim.ep_overlap:
    # the combined 1F1B schedule); True needs `recipe_source`
    overlap_moe_expert_parallel_comm: bool = False
    # Megatron's delay_wgrad_compute as the recipe ran it (`RunOptions`, sim.ep_overlap: the experts'
    # weight gradients under the dispatch gradient, the attention's at the pair's end); True needs
    # the overlap and `recipe_source`
    delay_wgrad_compute: bool = False
    # Transformer Engine's TP communication overlap as the recipe sets it (`RunOptions.tp_comm_overlap`);
    # None: not stated, NVIDIA's recipe default (on)
    tp_comm_overlap: bool | None = None
    # the overlap's userbuffers configuration as the recipe (or the recipe's code) picks it, by its name
    # (`RunOptions.tp_comm_overlap_cfg`, sim.userbuffers); None: not stated, the default
    tp_comm_overlap_cfg: str | None = None
    # Megatron's cross_entropy_loss_fusion / cross_entropy_fusion_impl as the recipe sets them
    # (`Workload`'s options of the same names, `sim.cross_entropy`); None: not stated, Megatron's
    # default (unfused; impl native)
    cross_entropy_loss_fusion: bool | None = None
    cross_entropy_fusion_impl: str | None = None
    # the optimizer keeps only the low 16 bits of each fp32 master beside the bf16 weight
    # (`Workload.store_param_remainders`): Megatron's precision-aware optimizer (its
    # store_param_remainders defaults to true) or NeMo's Apex DistributedFusedAdam with a bf16
    # model and fp32 optimizer; None: not stated, full fp32 masters
    store_param_remainders: bool | None = None
    # FP8 primary weights as the recipe sets them (`Workload.fp8_params`: NeMo 1.x's fp8_params, the
    # linear weights kept in FP8, full fp32 masters); None: not stated, bf16 weights with cached FP8 copies
    fp8_params: bool | None = None
    # Megatron's apply_rope_fusion / bias_activation_fusion as the recipe ran them (`Workload`'s
    # fields of those names, `sim.unfused_kernels`); None: not stated, simulated fused
    apply_rope_fusion: bool | None = None
    bias_activation_fusion: bool | None = None
    # Megatron's --recompute-method / --recompute-num-layers as the recipe ran them under full
    # recompute (`RunOptions`'s fields of these names, canzona.recompute: uniform groups or the first
    # N layers of each model chunk); None: not stated, every layer checkpointed on its own
    recompute_method: str | None = None
    recompute_num_layers: int | None = None

    @property
    def grad_bytes(self) -> int:
        """Bytes per element of the gradient buffers the run reduces (`Workload.grad_bytes`); not
        stated: fp32 beside masters (Megatron's default), the parameters' bf16 without them."""
        return grad_bytes_for(self.grad_reduce_in_fp32, self.master_weights)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def model_ref(self) -> str:
        """What `canzona.models.resolve_model` takes: the catalog name or the config's path."""
        return str(DATA_DIR / self.model) if self.model.endswith(".json") else self.model

    @property
    def model_name(self) -> str:
        return Path(self.model).stem if self.model.endswith(".json") else self.model

    @property
    def layout(self) -> str:
        parts = [f"{self.gpus} GPUs", f"TP{self.tp}", f"PP{self.pp}"]
        parts += [f"{k}{v}" for k, v in (("VP", self.vp), ("CP", self.cp), ("EP", self.ep)) if v > 1]
        parts.append(f"{'FSDP' if self.fsdp else 'DP'}{self.dp}")
        parts.append(f"GBS {self.global_batch} MBS {self.micro_batch} seq {self.seq_len} {self.precision}")
        if self.recompute not in (None, "none"):
            parts.append(f"recompute {recompute_label(self.recompute, self.recompute_method, self.recompute_num_layers)}")
        return " ".join(parts)

    def needs(self) -> tuple[str, ...]:
        """What the simulator lacks to express this run (empty: it is simulated)."""
        out = []
        if self.cp > 1 and self.ep > 1:
            out.append("--cp with --ep")
        if self.cp > 1 and self.fsdp:
            out.append("--cp with --fsdp")
        if self.recompute is not None and self.recompute not in SIM_RECOMPUTE:
            out.append(f"--recompute {self.recompute}")
        return tuple(out)

    def sim_config(self) -> SimConfig:
        """The run as the simulator takes it: AdamW under its default policy (ZeRO-1, Megatron's
        distributed optimizer), the row's GEMM precision (bf16, or FP8 under its scaling recipe),
        the recipe's gradient dtype (fp32 unless it says otherwise), NVIDIA's recipe defaults for
        the overlaps (`RunOptions`)."""
        wl = Workload(seq_len=self.seq_len, global_batch=self.global_batch, micro_batch=self.micro_batch,
                      precision=self.precision, fp8_recipe=self.fp8_recipe, grad_bytes=self.grad_bytes,
                      loss_bytes=loss_bytes_for(self.loss_fp32_upcast is not False),
                      loss_holds_logits=self.loss_holds_logits, master_weights=self.master_weights,
                      kernels=self.kernels, cross_entropy_loss_fusion=bool(self.cross_entropy_loss_fusion),
                      cross_entropy_fusion_impl=self.cross_entropy_fusion_impl or DEFAULT_CROSS_ENTROPY_FUSION_IMPL,
                      store_param_remainders=bool(self.store_param_remainders), fp8_params=bool(self.fp8_params),
                      apply_rope_fusion=self.apply_rope_fusion is not False,
                      bias_activation_fusion=self.bias_activation_fusion is not False)
        return SimConfig(model=self.model_ref, gpus=self.gpus, tp=self.tp, pp=self.pp, vp=self.vp, cp=self.cp,
                         ep=self.ep, pipeline_split=self.pipeline_split,
                         optimizer=self.optimizer, hardware=self.hardware, workload=wl, fsdp=self.fsdp,
                         fsdp_impl=self.fsdp_impl, reshard_after_forward=self.reshard_after_forward,
                         options=RunOptions(recompute=self.recompute or "none",
                                            recompute_method=self.recompute_method,
                                            recompute_num_layers=self.recompute_num_layers,
                                            attention_backend=self.attention_backend or DEFAULT_ATTENTION_BACKEND,
                                            ep_dispatcher=self.ep_dispatcher,
                                            overlap_moe_expert_parallel_comm=self.overlap_moe_expert_parallel_comm,
                                            delay_wgrad_compute=self.delay_wgrad_compute,
                                            tp_comm_overlap=self.tp_comm_overlap is not False,
                                            tp_comm_overlap_cfg=self.tp_comm_overlap_cfg or DEFAULT_UB_CONFIG))


@dataclass(frozen=True)
class RowResult:
    run: PublishedRun
    needs: tuple[str, ...] = ()
    simulated_tokens_per_s_per_gpu: float | None = None
    iteration_s: float | None = None
    memory_bytes: float | None = None  # the fullest GPU
    capacity_bytes: float | None = None
    memory: Mapping[str, Any] | None = None  # the fullest GPU's terms (`RankMemory.to_dict`), bytes

    @property
    def expressible(self) -> bool:
        return not self.needs

    @property
    def error(self) -> float | None:
        """Signed: simulated / published - 1 (positive: the simulator is optimistic)."""
        if self.simulated_tokens_per_s_per_gpu is None:
            return None
        return self.simulated_tokens_per_s_per_gpu / self.run.tokens_per_s_per_gpu - 1.0

    @property
    def fits(self) -> bool | None:
        if self.memory_bytes is None or self.capacity_bytes is None:
            return None
        return self.memory_bytes <= self.capacity_bytes

    @property
    def reason(self) -> str:
        return "" if self.expressible else "not expressible: needs " + ", ".join(self.needs)

    def to_dict(self) -> dict[str, Any]:
        r = self.run
        return {
            "id": r.id, "model": r.model_name, "source": r.source, "hardware": r.hardware, "layout": r.layout,
            "gpus": r.gpus, "tp": r.tp, "pp": r.pp, "vp": r.vp, "cp": r.cp, "ep": r.ep, "dp": r.dp, "fsdp": r.fsdp,
            "global_batch": r.global_batch, "micro_batch": r.micro_batch, "seq_len": r.seq_len,
            "precision": r.precision, "fp8_recipe": r.fp8_recipe if r.precision == "fp8" else None,
            "optimizer": r.optimizer, "recompute": r.recompute,
            **({"recompute_method": r.recompute_method, "recompute_num_layers": r.recompute_num_layers}
               if r.recompute_method is not None else {}),
            # the K a selective-layer row is simulated with: a row cannot set it, so torchtitan's default,
            # named rather than left implicit (the rows' notes call it an assumption)
            **({"selective_ac_option": selective_ac_every(None)} if r.recompute == SELECTIVE_LAYER else {}),
            "published_tokens_per_s_per_gpu": r.tokens_per_s_per_gpu,
            "published_original": {"value": r.original_value, "unit": r.original_unit, "conversion": r.conversion},
            "expressible": self.expressible, "not_expressible": self.reason or None,
            "simulated_tokens_per_s_per_gpu": self.simulated_tokens_per_s_per_gpu,
            "iteration_s": self.iteration_s, "error": self.error,
            "memory_bytes": self.memory_bytes, "capacity_bytes": self.capacity_bytes, "fits": self.fits,
            "memory": self.memory_detail(),
            "grad_reduce_in_fp32": r.grad_reduce_in_fp32, "attention_backend": r.attention_backend,
            "recipe_source": r.recipe_source or None,
            **({"reshard_after_forward": r.reshard_after_forward} if r.fsdp else {}),
            "loss_fp32_upcast": r.loss_fp32_upcast,
            **({"loss_holds_logits": r.loss_holds_logits} if r.fsdp else {}),
            "master_weights": r.master_weights,
            "kernels": r.kernels, "fsdp_impl": r.fsdp_impl if r.fsdp else None,
            **({"moe_token_dispatcher_type": r.moe_token_dispatcher_type,
                "moe_flex_dispatcher_backend": r.moe_flex_dispatcher_backend,
                "moe_hybridep_num_sms": r.moe_hybridep_num_sms, "moe_deepep_num_sms": r.moe_deepep_num_sms,
                "fake_balanced_gate": r.fake_balanced_gate}
               if r.ep > 1 else {}),
            "overlap_moe_expert_parallel_comm": r.overlap_moe_expert_parallel_comm,
            "delay_wgrad_compute": r.delay_wgrad_compute, "tp_comm_overlap": r.tp_comm_overlap,
            "tp_comm_overlap_cfg": r.tp_comm_overlap_cfg,
            "cross_entropy_loss_fusion": r.cross_entropy_loss_fusion,
            "cross_entropy_fusion_impl": r.cross_entropy_fusion_impl,
            "store_param_remainders": r.store_param_remainders,
            **({"fp8_params": r.fp8_params} if r.precision == "fp8" else {}),
            "apply_rope_fusion": r.apply_rope_fusion, "bias_activation_fusion": r.bias_activation_fusion,
            **({} if r.pipeline_split.even else {"pipeline_split": asdict(r.pipeline_split)}),
        }

    def memory_detail(self) -> dict[str, Any] | None:
        """The fullest GPU's memory by term (bytes; `canzona.memory.RankMemory`): what `memory_bytes`
        adds up (`total`), the terms left out of it (the smaller transient peak: `transient_peak`
        names the one counted), the capacity and the headroom (`free`, negative: over by that much)."""
        if self.memory is None or self.capacity_bytes is None:
            return None
        m = dict(self.memory)
        acts = m["activations"] + m["reduction"]
        return {**m, "transient_peak": "activations + reduction" if acts >= m["step_buffers"] else "step_buffers",
                "capacity": self.capacity_bytes, "free": self.capacity_bytes - m["total"]}


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Kendall's tau of two orders (scipy); None below two rows or when one side is all ties."""
    if len(a) < 2:
        return None
    from scipy.stats import kendalltau  # on use: scipy.stats is slow to import

    tau = kendalltau(a, b).statistic
    return None if tau != tau else float(tau)


@dataclass(frozen=True)
class PublishedReport:
    rows: tuple[RowResult, ...]
    sources: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    @property
    def compared(self) -> tuple[RowResult, ...]:
        return tuple(r for r in self.rows if r.expressible)

    @property
    def skipped(self) -> tuple[RowResult, ...]:
        return tuple(r for r in self.rows if not r.expressible)

    @property
    def mean_abs_error(self) -> float | None:
        errs = [abs(r.error) for r in self.compared if r.error is not None]
        return sum(errs) / len(errs) if errs else None

    @property
    def mean_signed_error(self) -> float | None:
        errs = [r.error for r in self.compared if r.error is not None]
        return sum(errs) / len(errs) if errs else None

    def _tau(self, rows: Iterable[RowResult]) -> float | None:
        rows = list(rows)
        return kendall_tau([r.run.tokens_per_s_per_gpu for r in rows],
                           [r.simulated_tokens_per_s_per_gpu for r in rows])

    @property
    def tau_overall(self) -> float | None:
        return self._tau(self.compared)

    @property
    def tau_by_model(self) -> dict[str, float | None]:
        models = sorted({r.run.model_name for r in self.compared})
        return {m: self._tau(r for r in self.compared if r.run.model_name == m) for m in models}

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": [r.to_dict() for r in self.rows],
            "expressible": len(self.compared),
            "not_expressible": len(self.skipped),
            "mean_abs_error": self.mean_abs_error,
            "mean_signed_error": self.mean_signed_error,
            "kendall_tau_overall": self.tau_overall,
            "kendall_tau_by_model": self.tau_by_model,
            "memory_fits": sum(1 for r in self.compared if r.fits),
            "sources": {k: dict(v) for k, v in self.sources.items()},
            "definitions": {
                "error": "simulated / published tokens per second per GPU - 1 (positive: the simulator is optimistic)",
                "simulated_tokens_per_s_per_gpu": "seq_len x global_batch / simulated iteration time / GPUs "
                                                  "(AdamW under ZeRO-1, the row's precision and hardware profile)",
                "kendall_tau": "scipy.stats.kendalltau of published against simulated throughput over the "
                               "expressible rows (null below two rows)",
                "memory_bytes": "the fullest GPU's memory as the simulator models it (docs/design.md §7.1)",
                "memory": "that GPU's memory by term, in bytes (canzona.memory.RankMemory): total = weights + grads + "
                          "master_weights + matrix_state + adamw_state + userbuffers + dispatcher_buffers + the larger of activations + reduction and "
                          "step_buffers (transient_peak) + overhead; free = capacity - total (negative: over)",
                "grad_reduce_in_fp32": "the recipe's gradient dtype (Megatron's DDP option; false: bf16), with "
                                       "recipe_source; null: not stated, simulated with Megatron's fp32 (bf16 on a "
                                       "row without master weights)",
                "reshard_after_forward": "an FSDP row's fully_shard option as its recipe runs it (false: every unit "
                                         "gathered from its forward to its backward), with recipe_source",
                "loss_fp32_upcast": "whether the recipe's loss upcasts the logits to fp32 (NeMo AutoModel's "
                                    "MaskedCrossEntropy option; false: its saved copy in bf16), with recipe_source; "
                                    "null: not stated, Megatron's fp32 copy",
                "loss_holds_logits": "an FSDP row's: whether the recipe's training loop keeps the model's logits "
                                     "through the backward beside PyTorch's F.cross_entropy (true: NeMo AutoModel's "
                                     "loop holds the model's output), with recipe_source",
                "master_weights": "whether the recipe keeps fp32 masters of its bf16 weights (false: a model built "
                                  "in bf16 with no fp32 copy, whose AdamW moments and gradient shards are bf16, "
                                  "NeMo AutoModel's; with recipe_source), the runtime's DistributedOptimizer option",
                "attention_backend": "the recipe's attention kernels (Megatron's --attention-backend: fused, "
                                     "cuDNN's; flash, flash-attn 2), with recipe_source; null: not stated, "
                                     "simulated as fused",
                "kernels": "the recipe's memory-bound kernels: fused (Transformer Engine / Megatron) or eager "
                           "(PyTorch eager ops, torchtitan's compile = false)",
                "fsdp_impl": "an FSDP row's implementation: fsdp2 (torch's fully_shard, with its copies on the "
                             "compute stream) or megatron-fsdp",
                "moe_token_dispatcher_type": "an EP row's token dispatcher as its recipe ran it (Megatron's option: "
                                             "alltoall, or flex with moe_flex_dispatcher_backend deepep / hybridep "
                                             "and HybridEP's moe_hybridep_num_sms or DeepEP's moe_deepep_num_sms), "
                                             "with recipe_source; null: not "
                                             "stated, simulated as alltoall",
                "fake_balanced_gate": "an EP row's router is NeMo AutoModel's FakeBalancedGate (the recipe's "
                                      "model.backend.fake_balanced_gate: each token to top-k consecutive experts, "
                                      "sim.ep_dispatch.fake_gate_groups), with recipe_source; null: the learned "
                                      "router, simulated as uniform random routing with the busiest EP rank's "
                                      "expected load (canzona.routing)",
                "overlap_moe_expert_parallel_comm": "Megatron's EP all-to-all overlap as the recipe ran it (the "
                                                    "combined 1F1B schedule, sim.ep_overlap), with recipe_source",
                "delay_wgrad_compute": "Megatron's delay_wgrad_compute as the recipe ran it (with the overlap: the "
                                       "experts' weight gradients under the dispatch gradient, the attention's at "
                                       "the layer pair's end), with recipe_source",
                "tp_comm_overlap": "Transformer Engine's TP communication overlap as the recipe sets it, with "
                                   "recipe_source; null: not stated, on (NVIDIA's recipe default)",
                "tp_comm_overlap_cfg": "the TP overlap's userbuffers configuration as the recipe (or its code) "
                                       "picks it, by name (sim.userbuffers: each GEMM's overlap method, SMs, chunks "
                                       "and SM margin), with recipe_source; null: not stated, "
                                       f"{DEFAULT_UB_CONFIG}",
                "cross_entropy_loss_fusion": "Megatron's fused cross-entropy as the recipe sets it, with "
                                             "cross_entropy_fusion_impl (native: Megatron's torch.compile'd "
                                             "functions; te: Transformer Engine's Triton kernels) and "
                                             "recipe_source; null: not stated, unfused (Megatron's default)",
                "store_param_remainders": "whether the optimizer keeps only the low 16 bits of each fp32 master "
                                          "(Megatron's precision-aware optimizer, Apex DistributedFusedAdam under "
                                          "NeMo), with recipe_source; null: not stated, full fp32 masters",
                "fp8_params": "FP8 rows: whether the recipe keeps the linear weights in FP8 (NeMo 1.x's "
                              "fp8_params, Transformer Engine's fp8_model_init: FP8 weight and its cached "
                              "transpose, no bf16 copy; full fp32 masters), with recipe_source; null: not "
                              "stated, bf16 weights with Transformer Engine's cached FP8 copies",
            },
        }


# --- the data file -----------------------------------------------------------------------------


def _positive_int(raw: Mapping[str, Any], key: str, where: str) -> int:
    v = raw.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise SpecError(f"{where}: {key} must be a whole number >= 1, got {v!r}")
    return v


def _positive(v: Any, what: str, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise SpecError(f"{where}: {what} must be a positive number, got {v!r}")
    return float(v)


def _text(raw: Mapping[str, Any], key: str, where: str) -> str:
    v = raw.get(key)
    if not isinstance(v, str) or not v.strip():
        raise SpecError(f"{where}: {key} must be a non-empty string, got {v!r}")
    return v


# a row's pipeline-split keys (Megatron's names) and PipelineSplit's fields they set
SPLIT_KEYS = {"account_for_embedding_in_pipeline_split": "account_for_embedding_in_pipeline_split",
              "account_for_loss_in_pipeline_split": "account_for_loss_in_pipeline_split",
              "decoder_first_pipeline_num_layers": "num_layers_in_first_pipeline_stage",
              "decoder_last_pipeline_num_layers": "num_layers_in_last_pipeline_stage"}


def _optional_bool(raw: Mapping[str, Any], key: str, where: str) -> bool | None:
    """A row's recipe setting that is true, false or not stated (null or absent: None)."""
    value = raw.get(key)
    if value is not None and not isinstance(value, bool):
        raise SpecError(f"{where}: {key} must be true, false or null, got {value!r}")
    return value


def _pipeline_split(raw: Mapping[str, Any], where: str) -> PipelineSplit:
    """A row's pipeline split from its keys (true / false, or a layer count); the layer arithmetic
    is checked with the model when the row is simulated (`SimConfig.check`)."""
    fields: dict[str, Any] = {}
    for key, name in SPLIT_KEYS.items():
        value = raw.get(key)
        if value is None:
            continue
        counted = key.startswith("account_for")
        if counted and not isinstance(value, bool):
            raise SpecError(f"{where}: {key} must be true or false, got {value!r}")
        if not counted and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise SpecError(f"{where}: {key} must be a positive whole number of layers, got {value!r}")
        fields[name] = value
    return PipelineSplit(**fields)


# a row's keys besides its recipe settings (`parse_run`'s `settings`)
ROW_KEYS = (*_INTS, "id", "model", "source", "hardware", "fsdp", "precision", "optimizer", "recompute", "published",
            "note", "fp8_recipe", "recipe_source")


def parse_run(raw: Any, sources: Mapping[str, Any], where: str) -> PublishedRun:
    """One row, checked: known keys, positive figures, a known source, a whole DP and whole micro-batches."""
    if not isinstance(raw, dict):
        raise SpecError(f"{where}: expected a JSON object")
    ints = {k: _positive_int(raw, k, where) for k in _INTS}
    source = _text(raw, "source", where)
    if source not in sources:
        raise SpecError(f"{where}: source {source!r} is not one of the file's sources")
    precision = _text(raw, "precision", where)
    if precision not in PRECISIONS:
        raise SpecError(f"{where}: precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    fp8_recipe = raw.get("fp8_recipe", DELAYED)
    if fp8_recipe not in FP8_RECIPES or (fp8_recipe != DELAYED and precision != "fp8"):
        raise SpecError(f"{where}: fp8_recipe must be one of {', '.join(FP8_RECIPES)} (on an fp8 row), "
                        f"got {fp8_recipe!r}")
    recompute = raw.get("recompute")
    if recompute is not None and not (isinstance(recompute, str) and recompute):
        raise SpecError(f"{where}: recompute must be a string or null, got {recompute!r}")
    if recompute in SIM_RECOMPUTE:
        check_recompute(recompute)
    fsdp = raw.get("fsdp", False)
    if not isinstance(fsdp, bool):
        raise SpecError(f"{where}: fsdp must be true or false, got {fsdp!r}")
    pub = raw.get("published")
    if not isinstance(pub, dict) or not isinstance(pub.get("original"), dict):
        raise SpecError(f"{where}: published must hold tokens_per_s_per_gpu and original {{value, unit}}")
    step = pub.get("step_time_s")
    grad_fp32 = _optional_bool(raw, "grad_reduce_in_fp32", where)
    reshard = raw.get("reshard_after_forward", True)
    if not isinstance(reshard, bool) or (not reshard and not fsdp):
        raise SpecError(f"{where}: reshard_after_forward must be true or false (false on an fsdp row only), "
                        f"got {reshard!r}")
    upcast = _optional_bool(raw, "loss_fp32_upcast", where)
    master_weights = raw.get("master_weights", True)
    if not isinstance(master_weights, bool):
        raise SpecError(f"{where}: master_weights must be true or false, got {master_weights!r}")
    holds_logits = raw.get("loss_holds_logits", False)
    if not isinstance(holds_logits, bool) or (holds_logits and not fsdp):
        raise SpecError(f"{where}: loss_holds_logits must be true or false (true on an fsdp row only: the FSDP2 "
                        f"frameworks' loops around PyTorch's F.cross_entropy), got {holds_logits!r}")
    attention = raw.get("attention_backend")
    if attention is not None and attention not in ATTENTION_BACKENDS:
        raise SpecError(f"{where}: attention_backend must be one of {', '.join(ATTENTION_BACKENDS)} or null, "
                        f"got {attention!r}")
    kernels = raw.get("kernels", FUSED)
    if kernels not in KERNEL_MODES:
        raise SpecError(f"{where}: kernels must be one of {', '.join(KERNEL_MODES)}, got {kernels!r}")
    fsdp_impl = raw.get("fsdp_impl", FSDP2)
    if fsdp_impl not in FSDP_IMPLS or (fsdp_impl != FSDP2 and not fsdp):
        raise SpecError(f"{where}: fsdp_impl must be one of {', '.join(FSDP_IMPLS)} (on an fsdp row), "
                        f"got {fsdp_impl!r}")
    ce_fusion = _optional_bool(raw, "cross_entropy_loss_fusion", where)
    ce_impl = raw.get("cross_entropy_fusion_impl")
    if ce_impl is not None and (ce_impl not in CROSS_ENTROPY_FUSION_IMPLS or not ce_fusion):
        raise SpecError(f"{where}: cross_entropy_fusion_impl must be one of {', '.join(CROSS_ENTROPY_FUSION_IMPLS)} "
                        f"(with cross_entropy_loss_fusion true) or null, got {ce_impl!r}")
    if ce_fusion and kernels != FUSED:
        raise SpecError(f"{where}: cross_entropy_loss_fusion is Megatron's, on a row with fused kernels")
    remainders = raw.get("store_param_remainders")
    if remainders is not None and (not isinstance(remainders, bool) or (remainders and fsdp)):
        raise SpecError(f"{where}: store_param_remainders must be true, false or null (true on a ZeRO-1 row, not "
                        f"fsdp), got {remainders!r}")
    fp8_params = _optional_bool(raw, "fp8_params", where)
    if fp8_params and (precision != "fp8" or fsdp or remainders):
        raise SpecError(f"{where}: fp8_params true is an FP8 ZeRO-1 row's, with full fp32 masters (not "
                        f"store_param_remainders)")
    dispatch = {k: raw.get(k) for k in ("moe_token_dispatcher_type", "moe_flex_dispatcher_backend",
                                        "moe_hybridep_num_sms", "moe_deepep_num_sms", "fake_balanced_gate")}
    split = _pipeline_split(raw, where)
    ep_overlap = raw.get("overlap_moe_expert_parallel_comm", False)
    if not isinstance(ep_overlap, bool):
        raise SpecError(f"{where}: overlap_moe_expert_parallel_comm must be true or false, got {ep_overlap!r}")
    delay_wgrad = raw.get("delay_wgrad_compute", False)
    if not isinstance(delay_wgrad, bool) or (delay_wgrad and not ep_overlap):
        raise SpecError(f"{where}: delay_wgrad_compute must be true or false (true with "
                        f"overlap_moe_expert_parallel_comm only, as Megatron asserts), got {delay_wgrad!r}")
    tp_overlap = _optional_bool(raw, "tp_comm_overlap", where)
    ub_cfg = raw.get("tp_comm_overlap_cfg")
    if ub_cfg is not None:
        check_ub_config(ub_cfg if isinstance(ub_cfg, str) else repr(ub_cfg), where=where)
        try:  # where the configuration acts: the overlap on, TP > 1, Megatron's layout
            check_ub_config_applies(ub_cfg, tp_comm_overlap=tp_overlap is not False, tp=ints["tp"], fsdp=fsdp)
        except SpecError as e:
            raise SpecError(f"{where}: tp_comm_overlap_cfg: {e}") from None
    method = {k: raw.get(k) for k in ("recompute_method", "recompute_num_layers")}
    try:  # Megatron's rules (both or neither, under full recompute); the layers' rule when simulated
        check_recompute_method(recompute if recompute in SIM_RECOMPUTE else "none", method["recompute_method"],
                               method["recompute_num_layers"])
    except SpecError as e:
        raise SpecError(f"{where}: {e}") from None
    if method["recompute_method"] is not None and fsdp:
        raise SpecError(f"{where}: recompute_method is Megatron's; an fsdp row's checkpoint wrappers take every layer")
    fusions = {k: _optional_bool(raw, k, where) for k in ("apply_rope_fusion", "bias_activation_fusion")}
    recipe_source = raw.get("recipe_source", "")
    settings = ("grad_reduce_in_fp32", "reshard_after_forward", "loss_fp32_upcast", "loss_holds_logits", "master_weights",
                "attention_backend", "kernels",
                "fsdp_impl", "cross_entropy_loss_fusion", "cross_entropy_fusion_impl", "store_param_remainders",
                "fp8_params", *dispatch, *SPLIT_KEYS, "overlap_moe_expert_parallel_comm", "delay_wgrad_compute", "tp_comm_overlap",
                "tp_comm_overlap_cfg", *fusions, *method)
    # a misspelt key would read as not stated, and the row be simulated without it, with no word
    unknown = sorted(k for k in raw if k not in (*ROW_KEYS, *settings))
    if unknown:
        raise SpecError(f"{where}: unknown key {unknown[0]!r}; a row's keys: {', '.join((*ROW_KEYS, *settings))}")
    stated = any(raw.get(k) is not None for k in settings)
    if not isinstance(recipe_source, str) or (stated and not recipe_source.startswith("https://")):
        raise SpecError(f"{where}: a recipe setting ({', '.join(settings)}) needs recipe_source, an https url and "
                        f"where the recipe sets it, got {recipe_source!r}")
    run = PublishedRun(
        id=_text(raw, "id", where), model=_text(raw, "model", where), source=source,
        hardware=_text(raw, "hardware", where), fsdp=fsdp, precision=precision,
        optimizer=_text(raw, "optimizer", where), recompute=recompute,
        tokens_per_s_per_gpu=_positive(pub.get("tokens_per_s_per_gpu"), "published tokens_per_s_per_gpu", where),
        original_value=_positive(pub["original"].get("value"), "published original value", where),
        original_unit=_text(pub["original"], "unit", where), conversion=str(pub.get("conversion", "")),
        step_time_s=None if step is None else _positive(step, "published step_time_s", where),
        note=str(raw.get("note", "")), fp8_recipe=fp8_recipe, grad_reduce_in_fp32=grad_fp32,
        recipe_source=recipe_source, reshard_after_forward=reshard, loss_fp32_upcast=upcast,
        loss_holds_logits=holds_logits, master_weights=master_weights,
        attention_backend=attention, kernels=kernels, fsdp_impl=fsdp_impl, cross_entropy_loss_fusion=ce_fusion,
        cross_entropy_fusion_impl=ce_impl, store_param_remainders=remainders, fp8_params=fp8_params,
        layout_not_tuned=sources[source].get("layout_not_tuned", ""), pipeline_split=split,
        overlap_moe_expert_parallel_comm=ep_overlap, delay_wgrad_compute=delay_wgrad, tp_comm_overlap=tp_overlap,
        tp_comm_overlap_cfg=ub_cfg, **dispatch, **fusions, **method, **ints)
    try:
        run.ep_dispatcher.check()
        if not run.needs():  # the simulator's rules between the row's settings (its model and profile are
            # read when it is simulated): a row it would refuse is refused here, naming the row
            run.sim_config().check_settings()
    except SpecError as e:
        raise SpecError(f"{where}: {e}") from None
    matrix_optimizer(run.optimizer)
    width = run.tp * run.pp * run.cp
    if run.gpus % width:
        raise SpecError(f"{where}: {run.gpus} GPUs are not a whole number of TP x PP x CP = {width} groups")
    if run.global_batch % (run.micro_batch * run.dp):
        raise SpecError(f"{where}: global batch {run.global_batch} is not a whole number of micro batch x DP "
                        f"= {run.micro_batch} x {run.dp}")
    if (run.dp * run.tp) % run.ep:
        raise SpecError(f"{where}: EP {run.ep} does not divide DP x TP = {run.dp * run.tp}")
    return run


def load(path: str | Path = PUBLISHED_RUNS) -> tuple[tuple[PublishedRun, ...], dict[str, dict[str, str]]]:
    """The rows and sources of a published-runs file, every row checked (`parse_run`)."""
    text = str(path)
    data = parse_json(read_text(Path(path), "published-runs file", SpecError), text, SpecError)
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise SpecError(f"{text}: not a published-runs file (schema {SCHEMA!r})")
    sources = data.get("sources")
    if not isinstance(sources, dict) or not sources:
        raise SpecError(f"{text}: sources must be a non-empty object")
    for key, s in sources.items():
        if not isinstance(s, dict) or not str(s.get("url", "")).startswith("https://") or not s.get("title"):
            raise SpecError(f"{text}: source {key!r} needs an https url and a title")
        untuned = s.get("layout_not_tuned", "")
        if not isinstance(untuned, str) or ("layout_not_tuned" in s and not untuned.strip()):
            raise SpecError(f"{text}: source {key!r}: layout_not_tuned must be the source's words that its layout "
                            f"was not tuned (a non-empty string), or absent; got {untuned!r}")
    rows = data.get("rows")
    if not isinstance(rows, list) or not rows:
        raise SpecError(f"{text}: rows must be a non-empty list")
    runs = tuple(parse_run(r, sources, f"{text}: row {i}") for i, r in enumerate(rows))
    ids = [r.id for r in runs]
    if len(set(ids)) != len(ids):
        raise SpecError(f"{text}: row ids must be unique")
    return runs, {k: {kk: str(vv) for kk, vv in v.items()} for k, v in sources.items()}


def select(runs: Sequence[PublishedRun], rows: str | None) -> tuple[PublishedRun, ...]:
    """The runs whose id or model contains one of the comma-separated terms (case-insensitive);
    all of them when `rows` is None."""
    if rows is None:
        return tuple(runs)
    terms = [t.strip().lower() for t in rows.split(",") if t.strip()]
    if not terms:
        raise SpecError("--rows names no row (give comma-separated parts of row ids or model names)")
    def matches(r: PublishedRun, t: str) -> bool:
        return t in r.id.lower() or t in r.model_name.lower()

    chosen = tuple(r for r in runs if any(matches(r, t) for t in terms))
    if not chosen:
        raise SpecError(f"no published row matches --rows {rows!r} (row ids: {', '.join(r.id for r in runs[:4])}, ...)")
    unmatched = [t for t in terms if not any(matches(r, t) for r in runs)]
    if unmatched:  # a mistyped term would otherwise drop its rows from the table without a word
        raise SpecError(f"no published row matches --rows term{'s' if len(unmatched) > 1 else ''} "
                        f"{', '.join(repr(t) for t in unmatched)} (the others match {len(chosen)} row{'s' if len(chosen) != 1 else ''})")
    return chosen


def compare_run(run: PublishedRun) -> RowResult:
    """Simulate one run (when expressible) and set it beside its published throughput."""
    needs = run.needs()
    if needs:
        return RowResult(run, needs)
    try:  # the model and the hardware profile are read here: a refusal names its row among the rest
        result = simulate(run.sim_config())
    except SpecError as e:
        raise SpecError(f"row {run.id}: {e}") from None
    tokens = run.seq_len * run.global_batch / result.iteration_time_s / run.gpus
    worst = result.memory.worst
    return RowResult(run, (), tokens, result.iteration_time_s, float(worst.total),
                     float(result.memory_capacity_bytes), worst.to_dict())


def compare(runs: Sequence[PublishedRun], sources: Mapping[str, Mapping[str, str]] | None = None,
            progress: Callable[[int, int, str], None] | None = None, workers: int | None = None) -> PublishedReport:
    """Every run of `runs` beside its simulation (`compare_run`), in `runs`' order; `workers` runs
    simulated at once, each in its own process (default: one per core; 1: one after another in
    this process); `progress(done, total, row id)` as each is done."""
    workers = min(workers or os.cpu_count() or 1, len(runs))
    if workers <= 1:
        out = []
        for i, run in enumerate(runs):
            if progress is not None:
                progress(i, len(runs), run.id)
            out.append(compare_run(run))
    else:
        with stopping_pool(workers) as pool:  # SIGTERM or Ctrl-C stops it at once, not after every row
            futures = {pool.submit(compare_run, run): i for i, run in enumerate(runs)}
            done: dict[int, RowResult] = {}
            for fut in as_completed(futures):
                i = futures[fut]
                done[i] = fut.result()  # a row's SpecError is raised here, as in one process
                if progress is not None:
                    progress(len(done), len(runs), runs[i].id)
        out = [done[i] for i in range(len(runs))]
    used = {r.source for r in runs}
    return PublishedReport(tuple(out), {k: v for k, v in (sources or {}).items() if k in used})
