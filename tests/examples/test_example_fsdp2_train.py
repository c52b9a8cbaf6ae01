"""`examples/fsdp2_train.py` as a user runs it under torchrun (gloo ranks): the tiny Qwen3 sharded by
FSDP2's `fully_shard` (per block, then the root; bf16 mixed precision by default) trains with
canzona's optimizer and its loss falls; bad input is one error line on every rank. Checkpoints
(torch's `get_state_dict` / `set_state_dict` with DCP, through `FsdpOptimizer.state_dict`): saved
at 2 ranks, a run resumes at 4 and continues, at 2 it continues as the straight run did."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from tests.examples import test_example_train as train_tests

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]  # torchrun spawns gloo ranks

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "fsdp2_train.py"
STEPS, HALF = 4, 2


# train.py's test helpers, for this script
torchrun = functools.partial(train_tests.torchrun, script=SCRIPT)
trained = functools.partial(train_tests.trained, script=SCRIPT)
error_lines = functools.partial(train_tests.error_lines, script=SCRIPT)
losses = train_tests.losses


def test_trains_under_fully_shard_and_the_loss_falls(tmp_path):
    log = trained(tmp_path, 2, "--steps", 8)
    assert "2 ranks on cpu (gloo), mixed precision bf16 / fp32 reduce" in log
    seen = losses(log)
    assert sorted(seen) == list(range(1, 9))
    assert seen[8] < seen[1] - 0.05, seen
    lrs = [float(x) for x in re.findall(r"lr (\S+)", log)]
    assert lrs[0] > lrs[-1]  # the schedule decays the learning rate


@pytest.mark.slow  # a larger variant: fp32 shards and SOAP are checked bit for bit in tests/runtime/test_fsdp_*
def test_without_mixed_precision(tmp_path):
    log = trained(tmp_path, 2, "--steps", 2, "--no-mixed-precision", "--optimizer", "soap")
    assert "mixed precision off" in log and sorted(losses(log)) == [1, 2]


def test_bad_input_is_one_error_line_on_every_rank(tmp_path):
    line = error_lines(torchrun(tmp_path, 2, "--batch", 7), 2)
    assert line == "error: --batch 7 is not divisible by the 2 ranks"


def test_save_at_2_ranks_resume_at_4_continues(tmp_path):
    straight = trained(tmp_path, 2, "--steps", STEPS, "--save", "ckpt", "--save-every", HALF)
    assert (tmp_path / "ckpt" / f"step_{HALF}").is_dir() and (tmp_path / "ckpt" / f"step_{STEPS}").is_dir()
    want = losses(straight)
    for ranks in (4, 2):
        log = trained(tmp_path, ranks, "--steps", STEPS, "--resume", tmp_path / "ckpt" / f"step_{HALF}")
        assert f"resumed from {tmp_path / 'ckpt' / f'step_{HALF}'} at step {HALF} (saved at 2 ranks)" in log
        got = losses(log)
        assert sorted(got) == list(range(HALF + 1, STEPS + 1))  # it continues where the checkpoint was
        for step, loss in got.items():
            if ranks == 2:  # the same layout: the straight run's losses (as logged, 4 decimals)
                assert loss == want[step], (step, loss, want[step])
            else:  # FSDP 2 -> 4: other reduction orders, the same training
                assert abs(loss - want[step]) <= 0.02 * want[step], (step, loss, want[step])
