"""`run_ranks` leaves nothing behind and blames the right rank:

- ranks exit when their parent dies (SIGTERM or SIGKILL), even while blocked in a collective, and
  the run directory is removed; directories of parents killed outright are swept at the next run;
- a rank interrupted by SIGINT exits instead of staying alive;
- a stopped rank neither hangs the parent nor takes the blame away from itself: the error names
  it, not the peer whose collective timed out;
- a rank that saved its result and then exits non-zero (an abort while tearing down) neither stops
  peers that are still finishing nor fails the run, a rank finishing between two of the parent's
  looks is not taken for one that exited early, and a rank ends once its result is taken, whatever
  it leaves running;
- rank 0's `report_progress` calls reach the parent's `progress` callback;
- a rank's exception reaches the parent through its error file (as torch's `record` writes it): one
  line naming the rank and the error, and the rank's traceback.

Rank functions are module-level, so that spawned ranks can import them (also from the driver
scripts, which put this directory on sys.path). Each test marks its processes with an environment
variable, to find any that outlive it and kill only those.
"""

from __future__ import annotations

import json
import multiprocessing.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from canzona.errors import CanzonaError
from canzona.harness import launch
from canzona.harness.launch import RankError, report_progress, run_ranks
from canzona.harness.worker import result_path

pytestmark = pytest.mark.distributed

MARKER = "CANZONA_LAUNCH_TEST"
TESTS = Path(__file__).resolve().parent
REPO = TESTS.parents[1]
START_S = 90.0  # spawning two ranks on a busy 2-core machine
BLOCK_S = 60.0  # a blocked collective outlasts every test


# --- rank functions ------------------------------------------------------------------------------


def _ready(piddir: str, rank: int) -> None:
    tmp = Path(piddir) / f"rank{rank}.tmp"
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, Path(piddir) / f"rank{rank}.pid")


def _blocked_all_reduce(seconds: float) -> None:
    """Wait in a collective that rank 1 never joins (gloo's own timeout, independent of the group's)."""
    dist.all_reduce(torch.ones(1), async_op=True).wait(timeout=timedelta(seconds=seconds))


def blocking_worker(rank: int, world: int, piddir: str) -> None:
    """Rank 0 blocks in C (a collective), rank 1 in Python (a sleep)."""
    _ready(piddir, rank)
    if rank == 0:
        _blocked_all_reduce(BLOCK_S)
    else:
        time.sleep(BLOCK_S)


def raising_worker(rank: int, world: int, piddir: str) -> None:
    """Rank 1 raises, records its error and stays alive; rank 0 waits for it in a collective."""
    _ready(piddir, rank)
    if rank == 1:
        raise RuntimeError("rank 1 fails")
    _blocked_all_reduce(BLOCK_S)


def stopping_worker(rank: int, world: int, piddir: str) -> None:
    """Rank 1 stops itself; rank 0's collective times out (a victim, not the cause)."""
    _ready(piddir, rank)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(BLOCK_S)
    else:
        _blocked_all_reduce(3.0)


def interrupted_worker(rank: int, world: int, piddir: str) -> None:
    """Rank 1 gets SIGINT (as from Ctrl-C) while rank 0 waits for it in a collective."""
    _ready(piddir, rank)
    if rank == 1:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # not inherited as ignored
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(BLOCK_S)
    else:
        _blocked_all_reduce(BLOCK_S)


def thread_leaving_worker(rank: int, world: int) -> int:
    """Returns with a thread still running, which a process would wait for as it exits."""
    threading.Thread(target=time.sleep, args=(BLOCK_S,), daemon=False).start()
    return rank


def multiline_error_worker(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("the first line\nand more")
    return rank


def progress_worker(rank: int, world: int, pause: float) -> int:
    for step in range(1, 4):
        time.sleep(pause)
        report_progress(step, 3, f"step {step} on rank {rank}")
    return rank


def aborting_at_exit_worker(rank: int, world: int, linger: float) -> int:
    """Both ranks finish their collectives; rank 1 returns at once and aborts while its process
    exits (as gloo's teardown once did), rank 0 still works for `linger` seconds."""
    dist.all_reduce(torch.ones(1))
    if rank == 1:
        # after the result is handed over, as the process ends (a rank forked from the fork server
        # ends with os._exit: `atexit` handlers never run there, multiprocessing's finalizers do)
        multiprocessing.util.Finalize(None, os._exit, args=(134,), exitpriority=0)
    else:
        time.sleep(linger)
    return rank


# --- helpers -------------------------------------------------------------------------------------


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _marked(marker: str) -> list[int]:
    """Live ranks (not zombies) carrying this test's marker, and the fork servers that started them
    (not multiprocessing's resource tracker, which this process shares across tests). Ranks forked
    by this process's own fork server carry the environment that server started with: every live
    child of that server counts (tests run one at a time, and their ranks must all be gone)."""
    needle = f"{MARKER}={marker}".encode()
    from multiprocessing import forkserver

    own_server = forkserver._forkserver._forkserver_pid  # noqa: SLF001
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in (os.getpid(), own_server):
            continue  # this process's fork server lives on, as this process does
        pid = int(entry.name)
        try:
            environ = (entry / "environ").read_bytes()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        rank_like = b"spawn_main" in cmdline or b"multiprocessing.forkserver" in cmdline
        ours = needle in environ.split(b"\0") or (own_server is not None and _ppid(pid) == own_server)
        if rank_like and ours and _state(pid) not in (None, "Z"):
            found.append(pid)
    return found


def _kill_marked(marker: str) -> None:
    for pid in _marked(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


# how long orphaned ranks may take to notice (a 0.25 s poll) and leave: a bound, not a speed claim;
# generous because CI machines run loaded (5 s failed at a load average of 20)
ORPHAN_EXIT_S = 30


def _wait_for(condition, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            pytest.fail(f"{what} after {timeout:g} s")
        time.sleep(0.05)


def _run_dirs(tmpdir: Path) -> list[Path]:
    return sorted(tmpdir.glob(f"{launch.RUN_DIR_PREFIX}*"))


DRIVER = """
import json, sys
sys.path.insert(0, sys.argv[1])
import test_launcher as t
from canzona.errors import CanzonaError
from canzona.harness.launch import run_ranks
try:
    run_ranks(getattr(t, sys.argv[2]), 2, sys.argv[3], deadline_s=float(sys.argv[4]),
              collective_timeout_s=30)
    out = {"ok": True}
except CanzonaError as e:
    out = {"ok": False, "type": type(e).__name__, "rank": getattr(e, "rank", None), "message": str(e)}
print(json.dumps(out), flush=True)
"""


class Driver:
    """A parent process calling `run_ranks` with its own TMPDIR (for its run directory) and marker.
    Its output goes to files: a pipe would stay open as long as any rank survives."""

    def __init__(self, tmp_path: Path, worker: str, deadline_s: float = 120.0):
        self.marker = uuid.uuid4().hex
        # short: the fork server's socket lives in TMPDIR, and an AF_UNIX path holds at most 107
        # bytes, which pytest's tmp_path under xdist (.../popen-gw0/test_..._do_not_outlive_a_k0/) can pass
        self.tmpdir = Path(tempfile.mkdtemp(prefix="cz-"))
        self.piddir = tmp_path / "pids"
        self.piddir.mkdir()
        self.out, self.err = tmp_path / "driver.out", tmp_path / "driver.err"
        env = {**os.environ, MARKER: self.marker, "TMPDIR": str(self.tmpdir)}
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", DRIVER, str(TESTS), worker, str(self.piddir), str(deadline_s)],
                cwd=REPO, env=env, stdout=out, stderr=err)

    def rank_pids(self, world: int = 2) -> list[int]:
        files = [self.piddir / f"rank{r}.pid" for r in range(world)]
        _wait_for(lambda: all(f.exists() for f in files) or self.proc.poll() is not None,
                  START_S, "ranks did not start")
        assert self.proc.poll() is None, self.err.read_text()
        return [int(f.read_text()) for f in files]

    def result(self, timeout: float) -> dict:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the parent hung (waiting for a stopped rank?) for {timeout:g} s")
        assert self.proc.returncode == 0, self.err.read_text()
        return json.loads(self.out.read_text())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        _kill_marked(self.marker)
        shutil.rmtree(self.tmpdir, ignore_errors=True)


@pytest.fixture
def driver(tmp_path):
    made: list[Driver] = []

    def make(worker: str, **kwargs) -> Driver:
        made.append(Driver(tmp_path, worker, **kwargs))
        return made[-1]

    yield make
    for d in made:
        d.close()


@pytest.fixture
def marker(monkeypatch):
    """Mark the ranks that this process spawns (they inherit the environment)."""
    value = uuid.uuid4().hex
    monkeypatch.setenv(MARKER, value)
    yield value
    _kill_marked(value)


# --- tests: nothing outlives the parent ---------------------------------------------------------


@pytest.mark.parametrize("worker, sig", [
    ("blocking_worker", signal.SIGTERM),
    ("blocking_worker", signal.SIGKILL),
    ("raising_worker", signal.SIGKILL),  # rank 1 is in its stay-alive loop
], ids=["blocked-SIGTERM", "blocked-SIGKILL", "staying-alive-SIGKILL"])
def test_ranks_and_run_directory_do_not_outlive_a_killed_parent(driver, worker, sig):
    d = driver(worker)
    pids = d.rank_pids()
    if worker == "raising_worker":
        _wait_for(lambda: list(d.tmpdir.glob(f"{launch.RUN_DIR_PREFIX}*/**/error.json")), 30,
                  "rank 1 did not write its error file")
    time.sleep(0.5)  # rank 0 is inside its collective by now
    assert [p.name.split("-")[2] for p in _run_dirs(d.tmpdir)] == [str(d.proc.pid)]
    os.kill(d.proc.pid, sig)
    d.proc.wait(timeout=15)
    assert d.proc.returncode == -sig  # SIGTERM is passed on after the cleanup
    _wait_for(lambda: not _marked(d.marker), ORPHAN_EXIT_S, f"ranks {pids} still alive")
    _wait_for(lambda: not _run_dirs(d.tmpdir), ORPHAN_EXIT_S, "the run directory is still there")


def test_run_directories_of_dead_parents_are_swept(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its pid names no process (until recycled, far later)
    stale = tmp_path / f"{launch.RUN_DIR_PREFIX}{dead.pid}-abc"
    live = tmp_path / f"{launch.RUN_DIR_PREFIX}{os.getpid()}-abc"
    foreign = tmp_path / f"{launch.RUN_DIR_PREFIX}xyz"  # not ours to judge
    for d in (stale, live, foreign):
        d.mkdir()
        (d / "rank0.pt").write_text("")
    launch._sweep_stale_run_dirs(str(tmp_path))
    assert not stale.exists()
    assert live.exists() and foreign.exists()


def test_an_interrupted_rank_exits_instead_of_staying_alive(tmp_path, marker):
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(interrupted_worker, 2, str(tmp_path), deadline_s=120, collective_timeout_s=30)
    # before: rank 1 recorded the interrupt and stayed alive until rank 0's collective timed out
    assert time.monotonic() - start < BLOCK_S / 2
    assert info.value.rank == 1
    assert str(info.value) == "rank 1: KeyboardInterrupt"
    assert not _marked(marker)


# --- tests: a stopped rank ----------------------------------------------------------------------


def test_a_stopped_rank_is_blamed_and_does_not_hang_the_parent(driver):
    d = driver("stopping_worker")
    start = time.monotonic()
    out = d.result(timeout=START_S + 30)
    assert out["type"] == "RankError" and out["rank"] == 1, out
    assert "\n" not in out["message"]
    assert out["message"].startswith("rank 1: stalled without a result (stopped"), out["message"]
    assert "rank 0:" in out["message"]  # the victim's error, for context
    assert time.monotonic() - start < START_S + 30
    _wait_for(lambda: not _marked(d.marker), ORPHAN_EXIT_S, "a rank or its fork server is still alive")
    assert not _run_dirs(d.tmpdir)


def _fake(exitcode: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(exitcode=exitcode)


def _failure(at: float, error: str) -> dict:
    return {"ok": False, "at": at, "error": error, "trace": f"Traceback: {error}"}


TIMEOUT = "CanzonaError: all_reduce on group dp failed or timed out after 3 s (a peer died or disagrees)"


def test_blame_prefers_the_cause_over_its_victims():
    procs = [_fake(), _fake()]
    kw = dict(deadline_s=60.0, collective_timeout_s=5.0)
    # a rank that died on its own comes first
    err = launch._blame([_failure(1.0, TIMEOUT), None], [_fake(), _fake(-9)], set(), set(), "exited", **kw)
    assert type(err) is CanzonaError and str(err) == "rank 1 (signal SIGKILL) died without a result"
    # a stopped rank, while its peer's collective timed out
    err = launch._blame([_failure(1.0, TIMEOUT), None], procs, {0, 1}, {1}, "settled", **kw)
    assert isinstance(err, RankError) and err.rank == 1 and "stopped" in str(err)
    assert "timeout 5 s" in str(err) and "rank 0: CanzonaError" in str(err)
    assert err.trace == f"Traceback: {TIMEOUT}"
    # a rank hung outside any collective (still running after the grace period)
    err = launch._blame([_failure(1.0, TIMEOUT), None], procs, {0, 1}, set(), "settled", **kw)
    assert isinstance(err, RankError) and err.rank == 1 and "still running" in str(err)
    # a slow rank is not blamed for a peer that raised first
    err = launch._blame([None, _failure(1.0, "RuntimeError: boom")], procs, {0, 1}, set(), "settled", **kw)
    assert isinstance(err, RankError) and err.rank == 1 and str(err) == "rank 1: RuntimeError: boom"
    # nor is a rank stopped early because a peer exited
    err = launch._blame([_failure(1.0, TIMEOUT), None], procs, {1}, set(), "exited", **kw)
    assert isinstance(err, RankError) and err.rank == 0
    # the first that raised, when every rank recorded its outcome
    err = launch._blame([_failure(2.0, TIMEOUT), _failure(1.0, "ValueError: x\ny")], procs, {0, 1},
                        set(), "settled", **kw)
    assert isinstance(err, RankError) and str(err) == "rank 1: ValueError: x"
    # a plain hang
    err = launch._blame([None, None], procs, {0, 1}, {1}, "deadline", **kw)
    assert str(err) == "ranks did not finish within 60 s (a hang?); still running: rank 0, rank 1 (stopped)"


class _FinishingRank:
    """A rank that saves its result and exits just as the watch looks at it: its exit code, once
    read, is 0 and its result is there (the order a real rank does it in)."""

    def __init__(self, result: Path):
        self.result, self.pid = result, None
        self._reads = 0

    @property
    def exitcode(self) -> int | None:
        self._reads += 1
        if self._reads < 2:  # alive at the watch's first look, finished by its second
            return None
        self.result.write_bytes(b"result")
        return 0


def test_a_rank_finishing_between_two_looks_is_not_taken_for_one_that_exited_early(tmp_path):
    """CI once reported 'rank(s) [1] were stopped without a result' for a run where every rank
    succeeded: rank 0 wrote its record and exited between the supervisor's look at the records and
    its look at the exit codes, and seemed to have exited without one, so rank 1 was stopped."""
    finishing = _FinishingRank(result_path(tmp_path, 0))
    running = SimpleNamespace(exitcode=None, pid=None)  # a rank that stays alive
    error_files = {r: str(tmp_path / f"error{r}.json") for r in range(2)}  # none written
    watch = launch._Watch(tmp_path, 2, deadline_s=0.5, collective_timeout_s=1.0, progress=None)
    while not watch.ended([finishing, running], error_files):
        time.sleep(launch.MONITOR_S)
    assert watch.ending == "deadline"  # not "exited": rank 0 finished properly, rank 1 is merely slow


def test_a_rank_that_aborts_after_recording_its_result_does_not_stop_its_peers(marker):
    """CI once reported 'rank(s) [0] were stopped without a result': rank 1 recorded its result and
    then exited non-zero while tearing down, and rank 0, still finishing, was stopped. (The elastic
    agent holds a rank until every rank has returned; then it takes a non-zero exit for a failure.)"""
    assert run_ranks(aborting_at_exit_worker, 2, 2.0, deadline_s=120, collective_timeout_s=30) == [0, 1]
    assert not _marked(marker)


def test_a_rank_ends_once_its_result_is_taken_whatever_it_leaves_running(marker):
    start = time.monotonic()
    assert run_ranks(thread_leaving_worker, 2, deadline_s=120, collective_timeout_s=30) == [0, 1]
    assert time.monotonic() - start < BLOCK_S / 2  # not held until the thread ends (or the deadline)
    assert not _marked(marker)


# --- tests: progress -----------------------------------------------------------------------------


def test_rank_0_progress_reaches_the_callback(marker):
    report_progress(1, 2, "outside a rank")  # a no-op
    seen: list[tuple[int, int, str]] = []
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGURG)}
    results = run_ranks(progress_worker, 2, 0.75, deadline_s=120, collective_timeout_s=30,
                        progress=lambda done, total, what: seen.append((done, total, what)))
    assert results == [0, 1]
    assert seen == [(s, 3, f"step {s} on rank 0") for s in (1, 2, 3)]
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # restored (the run installs its own)
    assert not _marked(marker)


# --- tests: errors -------------------------------------------------------------------------------


def test_a_ranks_exception_reaches_the_parent_through_its_error_file(marker):
    with pytest.raises(RankError) as info:
        run_ranks(multiline_error_worker, 2, deadline_s=120, collective_timeout_s=30)
    assert info.value.rank == 1
    assert str(info.value) == "rank 1: ValueError: the first line"
    assert "in multiline_error_worker" in info.value.trace
    assert info.value.trace.rstrip().endswith("ValueError: the first line\nand more")
    assert not _marked(marker)
