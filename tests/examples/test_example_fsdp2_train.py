"""`examples/fsdp2_train.py` as a user runs it under torchrun (gloo ranks): the tiny Qwen3 sharded by
FSDP2's `fully_shard` (per block, then the root; bf16 mixed precision by default) trains with
canzona's optimizer and its loss falls; bad input is one error line on every rank. Checkpoints
(torch's `get_state_dict` / `set_state_dict` with DCP, through `FsdpOptimizer.state_dict`): saved
at 2 ranks, a run at 2 continues as the straight run did, at 4 it continues (slow: the runtime's
tests reshard FSDP2 checkpoints bit for bit, tests/runtime/test_fsdp_checkpoint.py). The straight
run that saves is the one whose loss is checked: one torchrun for both."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from tests.examples import test_example_train as train_tests

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]  # torchrun spawns gloo ranks

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "fsdp2_train.py"
STEPS, HALF = 8, 4


# train.py's test helpers, for this script
torchrun = functools.partial(train_tests.torchrun, script=SCRIPT)
trained = functools.partial(train_tests.trained, script=SCRIPT)
error_lines = functools.partial(train_tests.error_lines, script=SCRIPT)
losses = train_tests.losses


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, str]:
    """The straight 2-rank run, saving at HALF and STEPS: (its folder, its log)."""
    folder = tmp_path_factory.mktemp("straight")
    return folder, trained(folder, 2, "--steps", STEPS, "--save", "ckpt", "--save-every", HALF)


def test_trains_under_fully_shard_and_the_loss_falls(straight):
    _, log = straight
    assert "2 ranks on cpu (gloo), mixed precision bf16 / fp32 reduce" in log
    seen = losses(log)
    assert sorted(seen) == list(range(1, STEPS + 1))
    assert seen[STEPS] < seen[1] - 0.05, seen
    lrs = [float(x) for x in re.findall(r"lr (\S+)", log)]
    assert lrs[0] > lrs[-1]  # the schedule decays the learning rate


@pytest.mark.slow  # a larger variant: fp32 shards and SOAP are checked bit for bit in tests/runtime/test_fsdp_*
def test_without_mixed_precision(tmp_path):
    log = trained(tmp_path, 2, "--steps", 2, "--no-mixed-precision", "--optimizer", "soap")
    assert "mixed precision off" in log and sorted(losses(log)) == [1, 2]


def test_bad_input_is_one_error_line_on_every_rank(tmp_path):
    line = error_lines(torchrun(tmp_path, 2, "--batch", 7), 2)
    assert line == "error: --batch 7 is not divisible by the 2 ranks"


@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_a_run_saved_at_2_ranks_resumes_and_continues(straight, tmp_path, ranks):
    folder, log = straight
    assert (folder / "ckpt" / f"step_{HALF}").is_dir() and (folder / "ckpt" / f"step_{STEPS}").is_dir()
    want = losses(log)
    checkpoint = folder / "ckpt" / f"step_{HALF}"
    log = trained(tmp_path, ranks, "--steps", STEPS, "--resume", checkpoint)
    assert f"resumed from {checkpoint} at step {HALF} (saved at 2 ranks)" in log
    got = losses(log)
    assert sorted(got) == list(range(HALF + 1, STEPS + 1))  # it continues where the checkpoint was
    for step, loss in got.items():
        if ranks == 2:  # the same layout: the straight run's losses (as logged, 4 decimals)
            assert loss == want[step], (step, loss, want[step])
        else:  # FSDP 2 -> 4: other reduction orders, the same training
            assert abs(loss - want[step]) <= 0.02 * want[step], (step, loss, want[step])
