"""Hugging Face models sharded by transformers' own TP plan (`from_pretrained(...,
distributed_config=DistributedConfig(tp_size=2))`, DTensor parameters on its `tp` mesh), read by
`ModelSpec.from_module` and given to `DistributedOptimizer` with a plan from `canzona plan --model
<config.json> --tp 2` (docs/design.md §2.5).

In this process: two ranks of torch's `fake` backend (its test utility `FakeStore`), so the model
holds the placements transformers gives it while no collective carries data; what is checked is
what happens before any collective (the spec, the plan's match, the optimizer's refusals). The
step itself on real ranks: tests/runtime/test_integrations_hf.py's TP scenario."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from canzona.errors import CanzonaError, PlanError, SpecError
from canzona.plan import check_plan_matches, load_plan
from canzona.spec import ModelSpec
from tests.cli_helpers import invoke

transformers = pytest.importorskip("transformers")

from canzona.runtime.modules import named_parameters  # noqa: E402
from canzona.runtime.optimizer import DistributedOptimizer  # noqa: E402
from tests.runtime.hf_tp_setup import (  # noqa: E402
    EXAMPLES,
    NORMS,
    TP,
    WHOLE_EXPERTS,
    load_sharded,
    register_head_norm,
    save_model,
)


@pytest.fixture
def two_fake_ranks(monkeypatch):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(TP)}.items():
        monkeypatch.setenv(key, value)  # transformers reads them when it builds its mesh
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=TP)
    try:
        yield
    finally:
        dist.destroy_process_group()


def hf_tp_model(folder: Path, config: str | Path, tp_plan: dict[str, str] | None = None) -> torch.nn.Module:
    """The model of an example config (its name) or of a config folder, loaded sharded by transformers."""
    return load_sharded(save_model(folder, EXAMPLES / config if isinstance(config, str) else config), tp_plan)


def cli_plan(folder: Path, config: str | Path) -> Path:
    config = EXAMPLES / config if isinstance(config, str) else config
    out = folder / f"{config.name}-tp{TP}.json"
    result = invoke("plan", "--model", config / "config.json", "--dp", 1, "--tp", TP, "--out", out)
    assert result.exit_code == 0, result.output
    return out


def dense_config(folder: Path, model_type: str) -> Path:
    """The dense example's config as another model type the config reader takes."""
    data = json.loads((EXAMPLES / "tiny_qwen3" / "config.json").read_text())
    del data["architectures"]
    data.update(model_type=model_type, _name_or_path=f"tiny-{model_type}")
    out = folder / f"tiny_{model_type}"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(data))
    return out


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2", "llama", "mistral"])
def test_the_cli_plan_matches_the_dense_model_as_transformers_shards_it(two_fake_ranks, tmp_path, model_type):
    """The config reader's splits are the ones transformers' TP plan makes: its embedding split
    over the vocabulary too (`init_parallel_plans` puts `embedding_rowwise` before
    `base_model_tp_plan`), column- and row-parallel projections, biases (qwen2) as Megatron's."""
    config = EXAMPLES / "tiny_qwen3" if model_type == "qwen3" else dense_config(tmp_path, model_type)
    spec = ModelSpec.from_module(hf_tp_model(tmp_path, config))
    assert spec.param("model.embed_tokens.weight").tp_dim == 0
    check_plan_matches(load_plan(cli_plan(tmp_path, config)), spec, dp=1, tp=TP)


def test_without_a_tp_group_the_optimizer_says_so(two_fake_ranks, tmp_path):
    """DTensors on transformers' one-dimensional `tp` mesh over every rank are a TP model, not
    FSDP2's: without the mesh the optimizer names the missing TP group (it was taken for FSDP2 and
    refused for 'a plain tensor beside FSDP2's DTensors')."""
    model = hf_tp_model(tmp_path, "tiny_qwen3")
    with pytest.raises(PlanError, match="the optimizer has no TP group"):
        DistributedOptimizer(named_parameters(model), ModelSpec.from_module(model))


def tp_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1, TP), mesh_dim_names=("dp", "tp"))


def test_norms_whose_gradients_transformers_sums_in_a_hook_are_refused(two_fake_ranks, tmp_path):
    """Qwen3's q_norm / k_norm under transformers' plan: a plain weight whose gradient its
    `replicated_with_grad_allreduce` hook sums over TP in `.grad` (a traceback in backward, the
    hook meeting canzona's gradient guard): one PlanError at construction naming the way out."""
    model = hf_tp_model(tmp_path, "tiny_qwen3")
    with pytest.raises(PlanError, match=r"'model\.layers\.0\.self_attn\.q_norm\.weight' is sharded by transformers' "
                                        r"TP style 'replicated_with_grad_allreduce'.*SequenceParallel\(sequence_dim=2\)"
                                        r".*'model\.layers\.\*\.self_attn\.q_norm': 'head_norm'"):
        DistributedOptimizer(named_parameters(model), ModelSpec.from_module(model), group=tp_mesh(),
                             plan=cli_plan(tmp_path, "tiny_qwen3"))


def test_a_collective_on_a_guarded_gradient_is_one_error_line(one_rank):
    """A hook that all-reduces `.grad` between backward and step() (transformers' grad all-reduce
    style did): the guard's one CanzonaError, not a StopIteration from inside its dispatch (the
    collective hands it the gradient inside a list)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    opt = DistributedOptimizer(named_parameters(model), ModelSpec.from_module(model))
    model(torch.ones(2, 8)).sum().backward()
    with pytest.raises(CanzonaError, match=r"^the gradient of '0\.weight' is being reduced .* \(allreduce_\.default\)"):
        dist.all_reduce(model[0].weight.grad)
    del opt


def test_experts_split_by_transformers_are_refused_naming_how_to_keep_them_whole(two_fake_ranks, tmp_path):
    """transformers' Qwen3-MoE plan splits every expert (`packed_colwise` gate/up halves,
    `rowwise` down): expert TP, which canzona does not run (the config reader keeps them whole).
    One SpecError naming the override that keeps them whole; under it, the CLI plan matches."""
    model = hf_tp_model(tmp_path, "tiny_qwen3_moe")
    with pytest.raises(SpecError, match=r"^parameter 'model\.layers\.0\.mlp\.experts\.gate_up_proj' of an experts "
                                        r"module is split over TP .*'model\.layers\.\*\.mlp\.experts': 'replicate'"):
        ModelSpec.from_module(model)
    register_head_norm()
    model = hf_tp_model(tmp_path, "tiny_qwen3_moe", NORMS | WHOLE_EXPERTS)
    check_plan_matches(load_plan(cli_plan(tmp_path, "tiny_qwen3_moe")), ModelSpec.from_module(model), dp=1, tp=TP)
