"""Expert parallelism on the deployment path (issue 20): `canzona plan --ep 2 --out` writes one plan
file holding the dense part's plan and the experts' (`canzona.plan.Plan.experts`), and
`examples/train.py --ep 2` trains the shipped tiny Qwen3-MoE (`examples/tiny_qwen3_moe`, every
layer sparse, 8 experts) from it under torchrun: DP 2 in EP groups of 2, each rank holding 4
experts of every layer. A run checkpointed half-way and resumed at the same layout ends bit for bit
where the straight run ends; its checkpoint holds every expert stack whole (DTensors sharded over
EP), which a run without expert parallelism resumes from; a `--ep` that is not the plan's, or a
plan with expert TP, is refused before training.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.cli_helpers import invoke
from tests.examples.test_example_train import (
    ROOT,
    checkpoint_weights,
    losses,
    refused_by_prepare,
    trained,
    worst_relative,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]  # torchrun spawns gloo ranks

CONFIG = ROOT / "examples" / "tiny_qwen3_moe" / "config.json"
STEPS, HALF = 4, 2


def moe_plan(folder: Path, dp: int, ep: int) -> Path:
    out = folder / f"plan-dp{dp}-ep{ep}.json"
    result = invoke("plan", "--model", CONFIG, "--dp", dp, "--tp", 1, "--ep", ep, "--out", out)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("ep2")
    shutil.copy(CONFIG, folder / "config.json")
    plan = moe_plan(folder, 2, 2)
    common = ("--model", "config.json", "--steps", STEPS)
    logs = {"straight": trained(folder, 2, *common, "--plan", plan, "--ep", 2, "--save", "ckpt", "--save-every",
                                HALF, "--out", "straight.pt")}
    logs["resumed"] = trained(folder, 2, *common, "--plan", plan, "--resume", f"ckpt/step_{HALF}",
                              "--out", "resumed.pt")
    logs["ep1"] = trained(folder, 2, *common, "--plan", moe_plan(folder, 2, 1), "--resume", f"ckpt/step_{HALF}",
                          "--out", "ep1.pt")
    return {"folder": folder, "plan": plan, "logs": logs,
            **{k: torch.load(folder / f"{k}.pt") for k in ("straight", "resumed", "ep1")}}


def test_the_plan_file_holds_both_parts_and_loads_back(tmp_path):
    from canzona.models import resolve_spec
    from canzona.plan import check_plan_matches, load_plan

    folder = tmp_path
    plan = load_plan(moe_plan(folder, 4, 2))
    assert plan.layout == {"dp": 4, "tp": 1, "ep": 2, "etp": 1}
    assert (plan.experts.dp, plan.experts.tp) == (2, 1)  # EDP = 4 / 2
    experts = {p.name for p in plan.experts.dp_plan.placements()}
    assert experts and all(".mlp.experts." in n for n in experts)
    assert not any(".mlp.experts." in p.name for p in plan.dp_plan.placements())
    check_plan_matches(plan, resolve_spec(CONFIG), dp=4, tp=1, ep=2)
    assert invoke("inspect", folder / "plan-dp4-ep2.json", "--model", CONFIG, "--ep", 2).exit_code == 0
    other = invoke("inspect", folder / "plan-dp4-ep2.json", "--model", CONFIG, "--ep", 4)
    assert other.exit_code == 2 and "plan is for ep=2, but the job has ep=4" in other.output


def test_trains_from_the_plan_under_expert_parallelism(runs):
    log = runs["logs"]["straight"]
    assert "dp 2 x tp 1, ep 2" in log
    got = losses(log)
    assert sorted(got) == list(range(1, STEPS + 1)) and got[STEPS] < got[1]
    # --out holds the whole model: every expert stack with all 8 experts
    assert runs["straight"]["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)


def test_a_resumed_run_ends_bit_for_bit_where_the_straight_run_ends(runs):
    assert all(torch.equal(runs["resumed"][n], t) for n, t in runs["straight"].items())
    assert losses(runs["logs"]["resumed"]) == {k: v for k, v in losses(runs["logs"]["straight"]).items() if k > HALF}


def test_the_checkpoint_holds_whole_stacks_and_resumes_without_expert_parallelism(runs):
    saved = checkpoint_weights(runs["folder"] / "ckpt" / f"step_{STEPS}", runs["straight"])
    assert all(torch.equal(saved[n], t) for n, t in runs["straight"].items())
    # EP 1 reduces the experts' gradients in another order: equal up to rounding
    assert worst_relative(runs["ep1"], runs["straight"]) < 1e-2
    assert "resumed from ckpt/step_2" in runs["logs"]["ep1"]


def test_an_ep_that_is_not_the_plans_is_refused_before_training(train_script, tmp_path, monkeypatch):
    plan = moe_plan(tmp_path, 2, 2)
    line = refused_by_prepare(train_script, monkeypatch, 2, "--model", CONFIG, "--plan", plan, "--ep", 1)
    assert "--ep 1, but" in line and "plan-dp2-ep2.json is a plan for ep 2" in line


def test_a_plan_with_expert_tp_is_refused_before_training(train_script, tmp_path, monkeypatch):
    plan = tmp_path / "plan-etp2.json"
    made = invoke("plan", "--model", CONFIG, "--dp", 4, "--tp", 1, "--ep", 2, "--etp", 2, "--out", plan)
    assert made.exit_code == 0, made.output
    assert "plan has expert TP (etp=2)" in refused_by_prepare(train_script, monkeypatch, 4, "--model", CONFIG,
                                                               "--plan", plan)
