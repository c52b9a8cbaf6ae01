"""The deployment path as a user runs it: `canzona plan --out` writes a plan for the shipped Qwen3
config, and `examples/train.py` trains from it under torchrun (gloo ranks): DP 2 on 2 ranks and
DP 2 x TP 2 on 4. A run checkpointed half-way and resumed at the same layout ends bit for bit
where the straight run ends; a checkpoint resumes at another layout (TP 2 -> TP 1 and TP 1 -> TP 2,
equal up to the rounding of TP's sums); at DP 2 the resumed run takes `--reduce-scatter loops`,
bit for bit all the same; a
plan for another layout or model is one error line on every rank and a non-zero exit.

Issue 17: checkpoints carry a manifest and leave no staging folders; flags given on resume win and
are logged (the optimizer's param_groups and the schedule follow them); ranks given different
arguments and a crafted checkpoint are one error line on every rank, an output path that cannot
be written is refused before training; the ranks stop within seconds of torchrun's SIGKILL, leaving only complete checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import signal
import subprocess
import time
import warnings
from pathlib import Path

import pytest
import torch

from canzona.errors import CanzonaError
from canzona.models import resolve_spec
from canzona.optimizers import MATRIX_REGISTRY, default_config
from canzona.runtime.checkpoint_files import (
    MANIFEST,
    SafeFileSystemReader,
    latest_checkpoint,
    verify_checkpoint,
)
from tests.cli_helpers import invoke
from tests.launchers import torchrun_command

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]  # torchrun spawns gloo ranks

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train.py"
CONFIG = ROOT / "examples" / "tiny_qwen3" / "config.json"
STEPS, HALF = 4, 2
RUN_TIMEOUT_S = 240  # one torchrun launch; a hang fails the test instead of blocking the suite


def make_plan(folder: Path, dp: int, tp: int, model: str | Path = CONFIG, *extra: object) -> Path:
    """`canzona plan --model ... --dp --tp [extra] --out`, through the CLI."""
    out = folder / f"plan-dp{dp}-tp{tp}-{Path(str(model)).stem}{''.join(str(e) for e in extra)}.json"
    result = invoke("plan", "--model", model, "--dp", dp, "--tp", tp, *extra, "--out", out)
    assert result.exit_code == 0, result.output
    return out


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def torchrun(folder: Path, ranks: int, *args: object, script: Path = SCRIPT) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_command(ranks, script, *args), cwd=folder, env=ENV, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)


def trained(folder: Path, ranks: int, *args: object, script: Path = SCRIPT) -> str:
    done = torchrun(folder, ranks, *args, script=script)
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


def layout_runs(folder: Path, dp: int, tp: int, *resume_flags: object) -> dict:
    """A straight run of STEPS steps that checkpoints at HALF, and a run resumed from that checkpoint
    (given `resume_flags` too: flags that change neither the training nor the checkpoint's record)."""
    plan = make_plan(folder, dp, tp)
    ranks = dp * tp
    straight = trained(folder, ranks, "--plan", plan, "--steps", STEPS, "--save", "ckpt", "--save-every", HALF,
                       "--out", "straight.pt")
    resumed = trained(folder, ranks, "--plan", plan, "--steps", STEPS, "--resume", "ckpt/step_2",
                      *resume_flags, "--out", "resumed.pt")
    return {"folder": folder, "logs": {"straight": straight, "resumed": resumed},
            "straight": torch.load(folder / "straight.pt"), "resumed": torch.load(folder / "resumed.pt")}


# DP 2 x TP 2 is four ranks: `make test-all` (the runtime's TP tests check DP 2 x TP 2 in `make test`)
LAYOUTS = ["dp2", pytest.param("dp2_tp2", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def dp2(tmp_path_factory) -> dict:
    """Resumed with `--reduce-scatter loops` (one reduce per owner; the straight run's is the default,
    native): at DP 2 a sum of two is the same in any order, so the resumed run ends bit for bit where
    the straight run ends only if the checkpoint restores the run exactly and loops reduces as the
    default does (one launch for both checks, which had a resumed run each; reduce-scatter is no
    flag a checkpoint records, so no `resume:` line either way)."""
    return layout_runs(tmp_path_factory.mktemp("dp2"), 2, 1, "--reduce-scatter", "loops")


@pytest.fixture(scope="module")
def dp2_tp2(tmp_path_factory) -> dict:
    return layout_runs(tmp_path_factory.mktemp("dp2-tp2"), dp=2, tp=2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_trains_from_the_plan_and_logs_falling_loss(layout, request):
    runs = request.getfixturevalue(layout)
    log = runs["logs"]["straight"]
    assert "tiny-qwen3" in log and ("dp 2 x tp 2" if layout == "dp2_tp2" else "dp 2 x tp 1") in log
    loss = losses(log)
    assert sorted(loss) == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) for v in loss.values())
    assert loss[STEPS] < loss[1]
    assert f"saved ckpt/step_{HALF}" in log and f"saved ckpt/step_{STEPS}" in log
    ckpt = runs["folder"] / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == [f"step_{HALF}", f"step_{STEPS}"]  # no staging folders
    manifest = verify_checkpoint(ckpt / f"step_{HALF}")
    dp, tp = (2, 2) if layout == "dp2_tp2" else (2, 1)
    assert manifest.info["step"] == HALF and (manifest.info["dp"], manifest.info["tp"]) == (dp, tp)
    assert manifest.world == dp * tp and len(manifest.files) == dp * tp + 1  # a file per rank, .metadata


@pytest.mark.parametrize("layout", LAYOUTS)
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
    assert "resume:" not in runs["logs"]["resumed"]  # the same flags: nothing to report


def test_a_nan_gradient_stops_the_run_before_it_reaches_the_weights_or_a_checkpoint(dp2, tmp_path):
    """A learning rate of 1e12 makes the second step's gradients NaN: every rank stops with one
    error line before updating, and no checkpoint holds weights updated with NaN gradients."""
    plan = make_plan(tmp_path, 2, 1)
    done = torchrun(tmp_path, 2, "--plan", plan, "--steps", STEPS, "--lr", 1e12, "--adamw-lr", 1e12,
                    "--save", "ckpt", "--save-every", 1)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert sorted(e.split(":")[1] for e in errors) == [" rank 0", " rank 1"], done.stderr[-3000:]
    assert all("the global gradient norm is nan" in e and "nothing was updated" in e for e in errors)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_1"]  # the last sound step
    weights = checkpoint_weights(tmp_path / "ckpt" / "step_1", dp2["straight"])
    assert all(bool(torch.isfinite(t).all()) for t in weights.values())


def test_an_adamw_plan_trains_under_its_own_step_policy(tmp_path):
    """`canzona plan --optimizer adamw` (what `canzona search --optimizer adamw` prints to deploy) runs
    under ZeRO-1, the policy it was planned for, at AdamW's learning rate (the script looked up a
    matrix optimizer's rate and ran canzona's policy: a KeyError on every rank)."""
    plan = make_plan(tmp_path, 2, 1, CONFIG, "--optimizer", "adamw")
    log = trained(tmp_path, 2, "--plan", plan, "--steps", STEPS)
    assert "adamw" in log
    steps = losses(log)
    assert len(steps) == STEPS and steps[STEPS] < steps[1], steps


SOAP_CONFIG = '{"max_precond_dim": 48}'  # keeps other state than the defaults: the plan records it


def test_a_plan_made_with_a_matrix_config_trains_at_it(tmp_path):
    """`canzona plan --matrix-config X` deploys with `examples/train.py --matrix-config X` (the script
    had no such option: a state-changing plan could not be run). The optimizer refuses a plan priced
    at another configuration (check_plan_config), so a run that trains ran X."""
    plan = make_plan(tmp_path, 1, 1, CONFIG, "--optimizer", "soap", "--matrix-config", SOAP_CONFIG)
    steps = losses(trained(tmp_path, 1, "--plan", plan, "--steps", 2, "--matrix-config", SOAP_CONFIG))
    assert len(steps) == 2 and all(math.isfinite(v) for v in steps.values()), steps


@pytest.mark.parametrize(("given", "needle"), [
    (None, "plan was made for another soap configuration"),
    ('{"max_precond_dim": 64}', "plan was made for another soap configuration"),
    ('{"bogus": 1}', "--matrix-config: "),
    ('{"lr": 0.1}', "--matrix-config: give lr with --lr"),
    ('[1]', "--matrix-config takes a JSON object"),
])
def test_a_matrix_config_the_plan_was_not_made_at_is_refused_before_training(given, needle, train_script, tmp_path,
                                                                              monkeypatch):
    plan = make_plan(tmp_path, 1, 1, CONFIG, "--optimizer", "soap", "--matrix-config", SOAP_CONFIG)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    flags = [] if given is None else ["--matrix-config", given]
    with pytest.raises(CanzonaError) as refused:
        train_script.prepare(train_script.parse_args(["--plan", str(plan), *flags]))
    assert needle in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_a_matrix_config_changed_on_resume_is_refused_when_it_keeps_other_state_and_logged_otherwise(tmp_path):
    """A SOAP run at the defaults, resumed with `--matrix-config`: one that keeps other optimizer state
    (max_precond_dim 48: identity factors where the checkpoint holds full ones) is one error line
    before training, as another model or data stream is; one that keeps the same state (a
    precondition frequency) wins and is logged, as a changed --lr is. Before: both resumed
    silently, the first stepping the checkpoint's state under the other configuration."""
    plan = make_plan(tmp_path, 1, 1, CONFIG, "--optimizer", "soap")
    trained(tmp_path, 1, "--plan", plan, "--steps", HALF, "--save", "ckpt")
    other = make_plan(tmp_path, 1, 1, CONFIG, "--optimizer", "soap", "--matrix-config", SOAP_CONFIG)
    line = error_lines(torchrun(tmp_path, 1, "--plan", other, "--steps", STEPS, "--resume", "ckpt",
                                "--matrix-config", SOAP_CONFIG), 1)
    assert line.startswith(f"error: --resume ckpt/step_{HALF}: the checkpoint's run had --matrix-config {{}}") and \
        SOAP_CONFIG in line and "keeps other optimizer state" in line, line
    frequency = '{"precondition_frequency": 3}'
    log = trained(tmp_path, 1, "--plan", plan, "--steps", STEPS, "--resume", "ckpt", "--matrix-config", frequency,
                  "--save", "again")
    assert f"resume: --matrix-config {frequency} (the checkpoint's run had {{}})" in log.splitlines(), log
    assert saved_entry(tmp_path / "again" / f"step_{STEPS}", "train")["matrix_config"] == frequency
    # the optimizer's own record agrees: its header's matrix_config and its groups both the command
    # line's (before: the header kept the checkpoint's frequency, 10, beside groups at 3)
    meta = saved_meta(tmp_path / "again" / f"step_{STEPS}")
    assert meta["matrix_config"]["precondition_frequency"] == 3, meta["matrix_config"]
    assert [g["precondition_frequency"] for g in meta["param_groups"] if g["kind"] == "matrix"] == [3]


@pytest.mark.parametrize("source", [pytest.param("dp2_tp2", marks=pytest.mark.slow), "dp2"])
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


def error_lines(done: subprocess.CompletedProcess, ranks: int, script: Path = SCRIPT) -> str:
    """The one error line every rank printed (torchrun adds its own failure summary after them)."""
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == ranks and len(set(lines)) == 1, done.stderr[:3000]
    assert f'{script.name}", line' not in done.stderr  # no traceback from the script
    assert "step" not in done.stdout
    return lines[0]


def test_a_plan_for_another_layout_is_one_error_line_on_every_rank(tmp_path):
    plan = make_plan(tmp_path, 2, 2)
    done = torchrun(tmp_path, 2, "--plan", plan, "--steps", STEPS)
    line = error_lines(done, 2)
    assert "dp 2 x tp 2 = 4 ranks" in line and "started 2" in line
    assert "exitcode  : 2" in done.stderr  # bad input: refused before training


def refused_by_prepare(train_script, monkeypatch, world: int, *argv: object) -> str:
    """The one-line error `prepare` (every rank's local checks, no collective) raises for `argv` on
    rank 0 of `world`: bad input the script refuses before its process group is used. That each
    rank prints such an error as one `error:` line, without a traceback, and exits 2 is the
    torchrun tests' (`test_a_plan_for_another_layout_is_one_error_line_on_every_rank`)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(CanzonaError) as refused:
        train_script.prepare(train_script.parse_args([str(a) for a in argv]))
    assert "\n" not in str(refused.value), str(refused.value)
    return str(refused.value)


@pytest.mark.parametrize("case", ["other model", "missing plan"])
def test_bad_input_is_one_error_line(case, train_script, tmp_path, monkeypatch):
    if case == "other model":
        plan, needle = make_plan(tmp_path, 1, 1, model="qwen3-0.6b"), "plan was made for model 'qwen3-0.6b'"
    else:
        plan, needle = tmp_path / "missing.json", "cannot read plan file"
    assert needle in refused_by_prepare(train_script, monkeypatch, 1, "--plan", plan, "--steps", STEPS)


# --- issue 17: resume semantics, ranks that disagree, outputs, orphans ----------------------------


def saved_entry(folder: Path, key: str) -> object:
    """A JSON entry of a checkpoint, read safely in this process."""
    holder = {key: ""}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_load(holder, folder)
    return json.loads(holder[key])


def saved_meta(folder: Path) -> object:
    """The optimizer's metadata entry of a checkpoint (its one key: `checkpoint.meta_key`)."""
    from canzona.runtime.checkpoint import DCP_PREFIX

    entries = SafeFileSystemReader(folder, verify_checkpoint(folder)).read_metadata().state_dict_metadata
    [key] = [k for k in entries if k.startswith(f"{DCP_PREFIX}/meta/")]
    return saved_entry(folder, key)


def dcp_load(holder: dict, folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load(holder, storage_reader=SafeFileSystemReader(folder, verify_checkpoint(folder)), no_dist=True)


CHANGED = {"--lr": ("0.01", "0.02"), "--adamw-lr": ("0.001", "0.003"), "--weight-decay": ("0.05", "0.1"),
           "--warmup": ("0.5", "0.1"), "--clip": ("0.5", "1.0")}  # flag: (given on resume, the checkpoint's)


def test_flags_given_on_resume_win_and_are_logged(dp2, tmp_path):
    plan = make_plan(tmp_path, 2, 1)
    flags = [x for flag, (value, _) in CHANGED.items() for x in (flag, value)]
    log = trained(tmp_path, 2, "--plan", plan, "--steps", STEPS, "--resume", dp2["folder"] / "ckpt" / f"step_{HALF}",
                  *flags, "--save", "ckpt")
    assert [line for line in log.splitlines() if line.startswith("resume:")] == [
        f"resume: {flag} {now} (the checkpoint's run had {before})" for flag, (now, before) in CHANGED.items()]
    # the learning rate of each resumed step follows the new peak on the new schedule: warm-up
    # over round(0.5 x 4) = 2 steps, then cosine to 10% at step 4 (the old one: 0.01100, 0.00464)
    lrs = {int(m[1]): float(m[2]) for m in re.finditer(r"^step +(\d+)/\d+ .* lr (\S+)", log, re.M)}
    assert lrs == {3: 0.01, 4: 0.0055}
    # what the optimizer ran with, as its state records it at the end: the new peaks and decay
    meta = saved_meta(tmp_path / "ckpt" / f"step_{STEPS}")
    decays = [g["weight_decay"] for g in meta["param_groups"]]
    assert decays == [0.05, 0.05, 0.0]  # matrices and the embedding; then the norms
    # its header's configurations too (before: the checkpoint's, 0.02 and 0.003, beside these groups)
    assert (meta["matrix_config"]["lr"], meta["adamw_config"]["lr"]) == (0.01, 0.001)
    for group in meta["param_groups"]:
        peak = 0.01 if group["kind"] == "matrix" else 0.001
        assert group["initial_lr"] == peak and math.isclose(group["lr"], 0.1 * peak)
    run = saved_entry(tmp_path / "ckpt" / f"step_{STEPS}", "train")
    assert {f"--{k.replace('_', '-')}": str(v) for k, v in run["flags"].items() if k != "steps"} == {
        flag: now for flag, (now, _) in CHANGED.items()}


DIFFERENT_RANK_1 = """import os, runpy, sys
if os.environ["RANK"] == "1":  # argparse takes the last of a repeated flag
    sys.argv += ["--clip", "0.5", "--seq-len", "16"]
sys.argv[0] = {script!r}
runpy.run_path({script!r}, run_name="__main__")
"""


def test_ranks_given_different_arguments_are_one_error_line_naming_the_flags(tmp_path):
    plan = make_plan(tmp_path, 2, 1)
    wrapper = tmp_path / "different_rank_1.py"
    wrapper.write_text(DIFFERENT_RANK_1.format(script=str(SCRIPT)))
    line = error_lines(torchrun(tmp_path, 2, "--plan", plan, "--steps", STEPS, script=wrapper), 2)
    assert line == ("error: the ranks were given different arguments: --clip (rank(s) [1] differ from rank 0), "
                    "--seq-len (rank(s) [1] differ from rank 0); give every rank the same")


def crafted_checkpoint(folder: Path) -> None:
    """Random bytes as `.metadata`, under a manifest that matches them and names the right model."""
    folder.mkdir()
    (folder / ".metadata").write_bytes(os.urandom(512))
    data = (folder / ".metadata").read_bytes()
    spec = resolve_spec(str(CONFIG), 1)
    (folder / MANIFEST).write_text(json.dumps({
        "format": "canzona.checkpoint", "version": 1, "world": 1,
        "info": {"model": spec.name, "fingerprint": spec.fingerprint(), "step": HALF},
        "files": {".metadata": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}}))


def test_a_crafted_checkpoint_is_one_error_line(tmp_path):
    plan = make_plan(tmp_path, 1, 1)
    crafted_checkpoint(tmp_path / "ckpt")
    line = error_lines(torchrun(tmp_path, 1, "--plan", plan, "--steps", STEPS, "--resume", "ckpt"), 1)
    assert line.startswith("error: ckpt/.metadata: not DCP metadata, not loaded (")




@pytest.mark.parametrize("optimizer", [n for n, e in MATRIX_REGISTRY.items() if not e.elementwise])
def test_every_matrix_optimizer_has_a_default_lr_of_its_own(optimizer, train_script):
    """Without --lr a plan's matrix optimizer steps at its own rate: the example's tuned one, else
    its config default (`default_config`), never AdamW's --adamw-lr (a fourth optimizer missing
    from a hand list once did)."""
    from types import SimpleNamespace

    args = train_script.parse_args(["--plan", "p.json", "--adamw-lr", "0.5"])
    lr = train_script.hyper_flags(SimpleNamespace(plan=SimpleNamespace(optimizer=optimizer)), args)["lr"]
    assert lr == train_script.TUNED_LR.get(optimizer, default_config(optimizer).lr) != 0.5


@pytest.mark.parametrize("case", ["--out a symbolic link", "--out a folder", "--save a file"])
def test_an_unusable_output_is_refused_before_training(case, train_script, tmp_path, monkeypatch):
    """`prepare` (what every rank checks before training; the torchrun tests above show how its
    error becomes one line on every rank) refuses the path, and leaves what is there alone."""
    plan = make_plan(tmp_path, 1, 1)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere.pt").write_bytes(b"keep")
    if case == "--out a symbolic link":
        (tmp_path / "final.pt").symlink_to("elsewhere.pt")
        flags, needle = ["--out", "final.pt"], "--out final.pt: a symbolic link"
    elif case == "--out a folder":
        (tmp_path / "final.pt").mkdir()
        flags, needle = ["--out", "final.pt"], "--out final.pt: a folder"
    else:
        flags, needle = ["--save", "elsewhere.pt"], "--save elsewhere.pt: not a folder"
    with pytest.raises(CanzonaError) as refused:
        train_script.prepare(train_script.parse_args(["--plan", str(plan), *flags]))
    assert str(refused.value).startswith(needle)
    assert (tmp_path / "elsewhere.pt").read_bytes() == b"keep"
    assert train_script.prepare(train_script.parse_args(["--plan", str(plan), "--out", "new.pt"])).resume is None


def test_a_failed_final_write_names_the_checkpoint_that_holds_the_weights(train_script, tmp_path):
    (tmp_path / "step_4").mkdir()
    with pytest.raises(CanzonaError) as failed:
        train_script.write_final_weights(str(tmp_path / "gone" / "final.pt"), {"w": torch.ones(2)},
                                         tmp_path / "step_4")
    assert "--out" in str(failed.value) and f"they are in the checkpoint {tmp_path / 'step_4'}" in str(failed.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4"]


def process_state(pid: int) -> str | None:
    """A process's state letter; None once it is gone (a zombie counts as gone: it runs nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None
    return None if state in ("Z", "X") else state


def visible_checkpoints(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if re.fullmatch(r"step_\d+", p.name)} if folder.is_dir() else set()


def test_ranks_stop_within_seconds_when_torchrun_is_killed(tmp_path):
    plan = make_plan(tmp_path, 2, 1)
    log = tmp_path / "log"
    with open(log, "w") as out:
        launcher = subprocess.Popen(torchrun_command(2, SCRIPT, "--plan", plan, "--steps", 10_000, "--save", "ckpt",
                                                     "--save-every", 1), cwd=tmp_path, env=ENV, stdout=out,
                                    stderr=subprocess.STDOUT)
    ranks: list[int] = []
    try:
        end = time.monotonic() + RUN_TIMEOUT_S
        while "saved ckpt/step_2" not in log.read_text() and launcher.poll() is None and time.monotonic() < end:
            time.sleep(0.1)
        assert "saved ckpt/step_2" in log.read_text(), log.read_text()[-3000:]
        ranks = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(p) == launcher.pid]
        assert len(ranks) == 2
        launcher.kill()  # SIGKILL: torchrun stops nothing
        launcher.wait()
        at_kill = visible_checkpoints(tmp_path / "ckpt")
        killed = time.monotonic()
        while any(process_state(r) for r in ranks) and time.monotonic() < killed + 30:
            time.sleep(0.05)
        stopped_after = time.monotonic() - killed
        assert stopped_after < 10, f"ranks still running {stopped_after:.1f} s after torchrun died"
        after = visible_checkpoints(tmp_path / "ckpt")
        time.sleep(1.0)
        assert visible_checkpoints(tmp_path / "ckpt") == after  # nothing is written any more
        # at most the save under way when torchrun died: a rank looks at its launcher before it
        # starts one (`stop_if_orphaned`), however late its watchdog thread is scheduled
        assert len(after - at_kill) <= 1
        for name in after:  # every visible checkpoint is complete and verified
            verify_checkpoint(tmp_path / "ckpt" / name)
        assert latest_checkpoint(tmp_path / "ckpt") == tmp_path / "ckpt" / max(after, key=lambda n: int(n[5:]))
    finally:
        launcher.kill()
        for r in ranks:  # only if the test failed: no rank outlives it
            if process_state(r):
                os.kill(r, signal.SIGKILL)


def _ppid(proc: Path) -> int | None:
    try:
        return int((proc / "stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return None
