"""The deployment path as a user runs it: `canzona plan --out` writes a plan for the shipped Qwen3
config, and `examples/train.py` trains from it under torchrun (gloo ranks): DP 2 on 2 ranks and
DP 2 x TP 2 on 4. A run checkpointed half-way and resumed at the same layout ends bit for bit
where the straight run ends; a checkpoint resumes at another layout (TP 2 -> TP 1 and TP 1 -> TP 2,
equal up to the rounding of TP's sums); `--reduce-scatter loops` resumes bit for bit at DP 2; a
plan for another layout or model is one error line on every rank and a non-zero exit."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from canzona.runtime.launch import free_port
from tests.cli_helpers import invoke

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]  # torchrun spawns gloo ranks

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train.py"
CONFIG = ROOT / "examples" / "tiny_qwen3" / "config.json"
STEPS, HALF = 4, 2
RUN_TIMEOUT_S = 240  # one torchrun launch; a hang fails the test instead of blocking the suite


def make_plan(folder: Path, dp: int, tp: int, model: str | Path = CONFIG) -> Path:
    """`canzona plan --model ... --dp --tp --out`, through the CLI."""
    out = folder / f"plan-dp{dp}-tp{tp}-{Path(str(model)).stem}.json"
    result = invoke("plan", "--model", model, "--dp", dp, "--tp", tp, "--out", out)
    assert result.exit_code == 0, result.output
    return out


def torchrun(folder: Path, ranks: int, *args: object) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(SCRIPT), *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def trained(folder: Path, ranks: int, *args: object) -> str:
    done = torchrun(folder, ranks, *args)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def losses(log: str) -> dict[int, float]:
    return {int(m[1]): float(m[2]) for m in re.finditer(r"^step +(\d+)/\d+ +loss (\S+)", log, re.M)}


def worst_relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want)
    return max(float((got[n] - want[n]).abs().max() / want[n].abs().max()) for n in want)


def checkpoint_weights(folder: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights a checkpoint holds, read in this process (full tensors, any saved layout)."""
    import torch.distributed.checkpoint as dcp

    holder = {f"model/{n}": torch.empty_like(t) for n, t in like.items()}
    with warnings.catch_warnings():  # that it loads in this process alone: as meant
        warnings.simplefilter("ignore")
        dcp.load(holder, checkpoint_id=str(folder), no_dist=True)
    return {n[len("model/"):]: t for n, t in holder.items()}


def layout_runs(folder: Path, dp: int, tp: int) -> dict:
    """A straight run of STEPS steps that checkpoints at HALF, and a run resumed from that checkpoint."""
    plan = make_plan(folder, dp, tp)
    ranks = dp * tp
    straight = trained(folder, ranks, "--plan", plan, "--steps", STEPS, "--save", "ckpt", "--save-every", HALF,
                       "--out", "straight.pt")
    resumed = trained(folder, ranks, "--plan", plan, "--steps", STEPS, "--resume", "ckpt/step_2",
                      "--out", "resumed.pt")
    return {"folder": folder, "logs": {"straight": straight, "resumed": resumed},
            "straight": torch.load(folder / "straight.pt"), "resumed": torch.load(folder / "resumed.pt")}


@pytest.fixture(scope="module")
def dp2(tmp_path_factory) -> dict:
    return layout_runs(tmp_path_factory.mktemp("dp2"), dp=2, tp=1)


@pytest.fixture(scope="module")
def dp2_tp2(tmp_path_factory) -> dict:
    return layout_runs(tmp_path_factory.mktemp("dp2-tp2"), dp=2, tp=2)


@pytest.mark.parametrize("layout", ["dp2", "dp2_tp2"])
def test_trains_from_the_plan_and_logs_falling_loss(layout, request):
    runs = request.getfixturevalue(layout)
    log = runs["logs"]["straight"]
    assert "tiny-qwen3" in log and ("dp 2 x tp 2" if layout == "dp2_tp2" else "dp 2 x tp 1") in log
    loss = losses(log)
    assert sorted(loss) == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) for v in loss.values())
    assert loss[STEPS] < loss[1]
    assert f"saved ckpt/step_{HALF}" in log and f"saved ckpt/step_{STEPS}" in log
    assert (runs["folder"] / "ckpt" / f"step_{HALF}" / ".metadata").is_file()


@pytest.mark.parametrize("layout", ["dp2", "dp2_tp2"])
def test_a_resumed_run_ends_bit_for_bit_where_the_straight_run_ends(layout, request):
    runs = request.getfixturevalue(layout)
    straight, resumed = runs["straight"], runs["resumed"]
    assert set(resumed) == set(straight)
    for name in straight:
        assert torch.equal(resumed[name], straight[name]), name
    got, want = losses(runs["logs"]["resumed"]), losses(runs["logs"]["straight"])
    assert sorted(got) == list(range(HALF + 1, STEPS + 1))
    assert all(got[s] == want[s] for s in got)
    assert f"resumed from ckpt/step_{HALF} at step {HALF}" in runs["logs"]["resumed"]


def test_loops_reduce_scatter_resumes_bit_for_bit_at_dp_2(dp2, tmp_path):
    """`--reduce-scatter loops` (one reduce per owner): at DP 2 a sum of two is the same in any
    order, so the run resumed with it ends where the exact straight run ends."""
    plan = make_plan(tmp_path, 2, 1)
    trained(tmp_path, 2, "--plan", plan, "--steps", STEPS, "--resume", dp2["folder"] / "ckpt" / f"step_{HALF}",
            "--reduce-scatter", "loops", "--out", "loops.pt")
    got = torch.load(tmp_path / "loops.pt")
    assert all(torch.equal(got[n], t) for n, t in dp2["straight"].items())


@pytest.mark.parametrize("source", ["dp2_tp2", "dp2"])
def test_a_checkpoint_resumes_at_another_layout(source, request, tmp_path):
    """DP 2 x TP 2 -> DP 2 x TP 1 and DP 2 x TP 1 -> DP 1 x TP 2 (2 ranks each): the run continues
    from the checkpoint, equal to the straight run up to the rounding of the other layout's sums."""
    runs = request.getfixturevalue(source)
    dp, tp = (2, 1) if source == "dp2_tp2" else (1, 2)
    plan = make_plan(tmp_path, dp, tp)
    # the folder's latest checkpoint, at the last step: the weights come back exactly
    log = trained(tmp_path, dp * tp, "--plan", plan, "--steps", STEPS, "--resume", runs["folder"] / "ckpt",
                  "--out", "other.pt")
    assert f"step_{STEPS} at step {STEPS}" in log and not losses(log)
    other = torch.load(tmp_path / "other.pt")
    assert all(torch.equal(other[n], runs["straight"][n]) for n in runs["straight"])
    log = trained(tmp_path, dp * tp, "--plan", plan, "--steps", STEPS, "--resume",
                  runs["folder"] / "ckpt" / f"step_{HALF}", "--out", "other.pt")
    other, straight = torch.load(tmp_path / "other.pt"), runs["straight"]
    half = checkpoint_weights(runs["folder"] / "ckpt" / f"step_{HALF}", straight)
    moved = worst_relative(half, straight)  # how far the last HALF steps move the weights
    assert worst_relative(other, straight) < 0.05 * moved
    got, want = losses(log), losses(runs["logs"]["straight"])
    assert sorted(got) == list(range(HALF + 1, STEPS + 1))
    assert all(abs(got[s] - want[s]) < 1e-3 for s in got)


def error_lines(done: subprocess.CompletedProcess, ranks: int) -> str:
    """The one error line every rank printed (torchrun adds its own failure summary after them)."""
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == ranks and len(set(lines)) == 1, done.stderr[:3000]
    assert f'{SCRIPT.name}", line' not in done.stderr  # no traceback from the script
    assert "step" not in done.stdout
    return lines[0]


def test_a_plan_for_another_layout_is_one_error_line_on_every_rank(tmp_path):
    plan = make_plan(tmp_path, 2, 2)
    line = error_lines(torchrun(tmp_path, 2, "--plan", plan, "--steps", STEPS), 2)
    assert "dp 2 x tp 2 = 4 ranks" in line and "started 2" in line


@pytest.mark.parametrize("case", ["other model", "missing plan"])
def test_bad_input_is_one_error_line(case, tmp_path):
    if case == "other model":
        plan, needle = make_plan(tmp_path, 1, 1, model="qwen3-0.6b"), "plan was made for model 'qwen3-0.6b'"
    else:
        plan, needle = tmp_path / "missing.json", "cannot read plan file"
    line = error_lines(torchrun(tmp_path, 1, "--plan", plan, "--steps", STEPS), 1)
    assert needle in line
