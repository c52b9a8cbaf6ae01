"""A plan made by `canzona plan --model <a Hugging Face config.json>` deploys on
`AutoModelForCausalLM.from_config(<that config>)` with no further argument
(`CanzonaTrainer(optimizer_kwargs={"plan": ...})`, which reads the spec from the module), and trains a step; a plan for another model, or one whose TP
splits the module does not hold, is still refused. A world of one gloo rank in this process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from canzona.errors import PlanError
from canzona.plan import check_plan_matches, load_plan
from canzona.spec import ModelSpec
from tests.cli_helpers import invoke

transformers = pytest.importorskip("transformers")
from transformers import TrainingArguments  # noqa: E402

from canzona.integrations.hf import CanzonaTrainer  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CONFIGS = ("tiny_qwen3", "tiny_qwen3_moe")


def _cli_plan(tmp_path: Path, config: str, dp: int = 1, tp: int = 1) -> Path:
    out = tmp_path / f"{config}-dp{dp}-tp{tp}.json"
    result = invoke("plan", "--model", EXAMPLES / config / "config.json", "--dp", dp, "--tp", tp, "--out", out)
    assert result.exit_code == 0, result.output
    return out


def _hf_model(config: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(EXAMPLES / config))


@pytest.mark.parametrize("config", CONFIGS)
def test_a_cli_plan_deploys_on_the_hf_model_of_its_config(one_rank, tmp_path, config):
    path = _cli_plan(tmp_path, config)
    model = _hf_model(config)
    # as CanzonaTrainer builds it: the spec read from the module (ModelSpec.from_module), the Trainer's decay groups
    trainer = CanzonaTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]),
                             optimizer_kwargs={"plan": str(path)})
    opt = trainer.build_optimizer(model)
    assert opt.plan.hash() == load_plan(path).hash()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tokens = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=tokens, labels=tokens).loss.backward()
    opt.step()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters()), "a parameter was not updated"


def test_a_cli_plan_for_another_model_is_refused(tmp_path):
    dense, moe = _cli_plan(tmp_path, "tiny_qwen3"), _cli_plan(tmp_path, "tiny_qwen3_moe")
    with pytest.raises(PlanError, match="plan was made for model 'tiny-qwen3-moe'"):
        load_plan(moe, ModelSpec.from_module(_hf_model("tiny_qwen3")))
    with pytest.raises(PlanError, match="plan was made for model 'tiny-qwen3'"):
        load_plan(dense, ModelSpec.from_module(_hf_model("tiny_qwen3_moe")))


def test_a_tp_plan_needs_the_tp_splits_it_was_made_for(tmp_path):
    """At TP 2 the split dims are what the plan is for: a module read without them is refused, the
    same module with the config's splits (`tp_plan`) is the planned model."""
    plan = load_plan(_cli_plan(tmp_path, "tiny_qwen3", tp=2))
    model = _hf_model("tiny_qwen3")
    with pytest.raises(PlanError, match="plan was made for model 'tiny-qwen3'.*per shard"):
        check_plan_matches(plan, ModelSpec.from_module(model), dp=1, tp=2)
    splits = {"*.q_proj.weight": 0, "*.k_proj.weight": 0, "*.v_proj.weight": 0, "*.gate_proj.weight": 0,
              "*.up_proj.weight": 0, "*.o_proj.weight": 1, "*.down_proj.weight": 1, "model.embed_tokens.weight": 0}
    check_plan_matches(plan, ModelSpec.from_module(model, tp_plan=splits), dp=1, tp=2)
