"""Red team of 2026-12-02's FSDP2 checkpoints of stacked experts (the tiny MoE, `optimizer="adamw"`),
where the earlier tests do not go: 3 ranks (torch.chunk gives each stack's 4 experts as 2, 2, 0:
the third rank holds no expert row), a checkpoint taken at FSDP 2 resumed at FSDP 3, and a
checkpoint loaded into a model whose stacks hold another number of experts (one clear error on
every rank, the optimizer untouched, never a silent load of the experts whose names match).
"""

from __future__ import annotations

import functools
import tempfile
from dataclasses import replace
from typing import Any

import pytest

from canzona.harness.launch import run_ranks
from canzona.harness.training import TrainSpec, compare, emulate
from tests.runtime.outcomes import outcome
from tests.runtime.test_fsdp_checkpoint import (
    fsdp_model,
    nested_equal,
    resume_spec,
    resumed,
    straight,
    torch_api_resumed,
)

pytestmark = pytest.mark.distributed  # spawns gloo process groups

# 6 sequences a step: divisible by 2 and by 3 ranks
MOE = TrainSpec(preset="tiny-moe", optimizer="adamw", steps=2, global_batch=6)
BF16 = replace(MOE, dtype="bf16")
TWO_EXPERTS = "tiny-moe-2x"  # the tiny MoE with 2 experts a stack (registered in the ranks)
DEADLINE_S = 400.0


def _register_two_experts() -> None:
    from reference.tiny_moe import MOE_PRESETS

    MOE_PRESETS[TWO_EXPERTS] = replace(MOE_PRESETS["tiny-moe"], experts=2)


def save_worker(rank: int, world: int, path: str) -> dict[str, Any]:
    """FSDP 2: the uninterrupted run, its checkpoints (state_dict(), DCP of torch's API, sharded)."""
    return straight(MOE, rank, world, path)


def other_experts(rank: int, world: int, ckpt: tuple[dict, dict], path: str) -> dict[str, Any]:
    """A model whose stacks hold 2 experts (not 4) loads the 4-expert checkpoint: each form's
    outcome, and whether the optimizer's state changed."""
    _register_two_experts()
    spec = replace(MOE, preset=TWO_EXPERTS)
    out: dict[str, Any] = {}
    for form, load in (
        ("full", lambda opt: opt.load_state_dict(ckpt[1])),
        ("sharded", lambda opt: opt.load_sharded_state_dict(path + "-sharded")),
        ("sharded checked", lambda opt: opt.load_sharded_state_dict(path + "-sharded", check_weights=True)),
    ):
        model, opt = fsdp_model(spec, world)
        before = opt.state_dict()
        got = outcome(lambda load=load, opt=opt: load(opt))
        got.pop("value", None)
        got["untouched"] = nested_equal(opt.state_dict(), before)
        out[form] = got
    return out


def resume_worker(rank: int, world: int, ckpt: tuple[dict, dict], path: str, here: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # at 3 ranks: the uninterrupted run and its resumes (the third rank holds no expert row)
    for label, spec in (("fp32", MOE), ("bf16", BF16)):
        run = straight(spec, rank, world, f"{here}-{label}")
        out[label] = {"straight": run,
                      "full": resumed(spec, rank, world, run["ckpt"]),
                      "sharded": resumed(spec, rank, world, (run["ckpt"][0], f"{here}-{label}-sharded"),
                                         like=run["ckpt"][1])}
    out["fp32"]["dcp"] = outcome(lambda: torch_api_resumed(MOE, rank, world, None, f"{here}-fp32"))
    # FSDP 2's checkpoint at FSDP 3: state_dict(), the sharded form, DCP of torch's API
    out["from 2"] = {"full": resumed(MOE, rank, world, ckpt, record=True),
                     "sharded": resumed(MOE, rank, world, (ckpt[0], path + "-sharded"), like=ckpt[1]),
                     "dcp": outcome(lambda: torch_api_resumed(MOE, rank, world, None, path))}
    out["other experts"] = other_experts(rank, world, ckpt, path)
    return out


@functools.cache
def runs() -> tuple[list[dict], list[dict]]:
    root = tempfile.mkdtemp(prefix="canzona-redteam-s57-")
    saved = run_ranks(save_worker, 2, root + "/two", deadline_s=DEADLINE_S, collective_timeout_s=60)
    ckpt = saved[0]["ckpt"]
    got = run_ranks(resume_worker, 3, ckpt, root + "/two", root + "/three", deadline_s=DEADLINE_S,
                    collective_timeout_s=60)
    return saved, got


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("form", ["full", "sharded"])
def test_three_ranks_one_without_experts_resume_bit_for_bit(dtype: str, form: str) -> None:
    _, ranks = runs()
    for rank, r in enumerate(ranks):
        run, res = r[dtype]["straight"], r[dtype][form]
        assert run["untouched"] is None, (rank, run["untouched"])
        assert res["round trip"] is None, (rank, dtype, form, res["round trip"])
        exact = compare(res["final"], run["final"])
        assert exact["bit_identical"], (rank, dtype, form, exact)


def test_three_ranks_dcp_of_torchs_api_resumes_bit_for_bit() -> None:
    _, ranks = runs()
    for rank, r in enumerate(ranks):
        got = r["fp32"]["dcp"]
        assert got["error"] is None, (rank, got)
        assert nested_equal(got["value"]["state"], r["fp32"]["straight"]["ckpt"][1]) is None, rank
        assert compare(got["value"]["final"], r["fp32"]["straight"]["final"])["bit_identical"], rank


@pytest.mark.parametrize("form", ["full", "sharded", "dcp"])
def test_a_checkpoint_of_fsdp2_resumes_at_fsdp3_bit_for_bit(form: str) -> None:
    saved, ranks = runs()
    ckpt = saved[0]["ckpt"]
    want = emulate(resume_spec(MOE), 3, load=ckpt, grads=ranks[0]["from 2"]["full"]["grads"])
    for rank, r in enumerate(ranks):
        got = r["from 2"][form]
        if form == "dcp":
            assert got["error"] is None, (rank, got)
            assert nested_equal(got["value"]["state"], ckpt[1]) is None, rank
            got = got["value"]
        else:
            assert got["round trip"] is None, (rank, form, got["round trip"])
        exact = compare(got["final"], want)
        assert exact["bit_identical"], (rank, form, exact)


@pytest.mark.parametrize("form", ["full", "sharded", "sharded checked"])
def test_a_checkpoint_of_other_expert_counts_is_one_clear_error(form: str) -> None:
    _, ranks = runs()
    got = [r["other experts"][form] for r in ranks]
    for rank, g in enumerate(got):
        assert g["error"] is not None and g["canzona"], (rank, form, g)
        assert g["untouched"] is None, (rank, form, g["untouched"])
        assert "\n" not in g["message"], (rank, form, g["message"])
    assert len({g["message"] for g in got}) == 1, [g["message"] for g in got]  # the same on every rank
