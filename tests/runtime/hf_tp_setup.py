"""transformers' TP plan as canzona trains under it (docs/design.md §2.5), for the tests that shard
the examples' Qwen3 models with it: the overrides, and the models loaded sharded."""

from __future__ import annotations

from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TP = 2
# the per-head norms as Replicate DTensors over the heads (their gradients come Partial, summed
# by the optimizer), in place of 'replicated_with_grad_allreduce', whose hook canzona cannot run
HEAD_NORM = "head_norm"
NORMS = {f"model.layers.*.self_attn.{n}": HEAD_NORM for n in ("q_norm", "k_norm")}
# the experts whole on every TP rank (expert TP 1), in place of 'packed_colwise' / 'rowwise' / 'moe_tp_experts'
WHOLE_EXPERTS = {f"model.layers.*.mlp.experts{leaf}": "replicate" for leaf in ("", ".gate_up_proj", ".down_proj")}


def register_head_norm() -> None:
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, SequenceParallel

    ALL_PARALLEL_STYLES.register(HEAD_NORM, SequenceParallel(sequence_dim=2))


def save_model(folder: Path, config: Path) -> Path:
    """The model of the `config.json` in folder `config`, seeded, saved under `folder` (once)."""
    import transformers

    saved = folder / f"{config.name}-model"
    if not saved.exists():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(config))
        model.save_pretrained(saved)
    return saved


def load_sharded(saved: Path, tp_plan: dict[str, str] | None = None) -> torch.nn.Module:
    """The saved model loaded sharded by transformers' TP plan (`tp_plan`: its overrides)."""
    import transformers
    from transformers.distributed.configuration_utils import DistributedConfig

    return transformers.AutoModelForCausalLM.from_pretrained(
        saved, distributed_config=DistributedConfig(tp_size=TP, tp_plan=tp_plan or "auto"))
