"""Run `fn(rank, world, *args)` on a gloo process group on this machine: `run_ranks`.

The return values come back in rank order. A rank that raises, dies, stalls or outlives the
deadline fails the whole run with one clear error naming the rank at the origin (`RankError`), the
other ranks are stopped, and no rank outlives the run or its caller.

Built on torch's elastic launcher, the machinery of `torchrun` and `elastic_launch`: its
`LocalElasticAgent` starts the ranks with the environment torchrun gives its workers, hosts the
store through which they join the group, names each rank's error file (written as torch's `record`
writes it: a rank's exception and traceback reach the parent), stops the ranks (SIGTERM, a grace
period, SIGKILL), also when the caller gets SIGTERM or Ctrl-C. Ranks are forked from a
server that has torch and the runtime imported already (start method "forkserver", with those
modules preloaded: about 3 s of imports saved per rank, which dominate a small run); where
forkserver is missing, they are spawned. A rank takes the caller's environment as it is at the call.

What the elastic launcher lacks is kept here and in `canzona.harness.worker`:

- A deadline, progress, and blame for the rank at the origin of a failure. `elastic_launch` builds a
  plain `LocalElasticAgent`, whose monitor loop has no deadline, reports nothing before the group
  ends, and ends it at the first exit, naming that process. `run_ranks` builds the agent as
  `elastic_launch` does (one node, `max_restarts=0`) from a subclass that makes its own checks in
  that loop (`_monitor_workers`, the agent's documented extension point): rank 0's progress
  (`report_progress` in a rank, passed to `run_ranks(..., progress=callback)`), the deadline, and
  whether a failure has had its consequences. A rank that raises writes its error file and stays
  alive (a peer that vanishes mid-collective can make gloo abort its partners, while a silent one
  makes their collectives time out and they record why), so that the error names the first rank
  that raised, or a rank that stalled (stopped by a signal, or still running) while its peers'
  collectives timed out, rather than whichever process the agent saw exit first.
- Results through files. The agent returns values through queues, holds every rank until all have
  returned, then waits for every process to end, however long, and drops the values if one exits
  non-zero (gloo's teardown can abort at exit): each rank saves its result into the run directory
  first and ends without teardown once the agent lets it go, and a run whose ranks all saved
  theirs succeeds whatever their exit codes.
- Nothing outlives the caller. Each rank watches its launcher and exits, removing the run directory,
  when it is gone, even while blocked in a collective (the agent has no such watch: torch turns its
  death into a SIGINT, which a rank blocked in a collective never acts upon); directories left by
  callers killed outright are swept at the next run. The agent's SIGTERM handler raises at once,
  even while the ranks are being started, which left a rank being forked unknown to the agent (see
  `_Interrupts`): the run has its own handler of SIGTERM and Ctrl-C instead, which waits for the
  start to end. The caller's handlers come back after the run, and a SIGTERM that stopped the run is
  passed on to the caller's once the run is cleaned up (the run is stopped even where the caller
  ignores SIGTERM: `run_ranks` then raises). The agent's log of that stop is dropped: the caller
  reports it (the CLI in one line).
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.elastic.agent.server.api import (
    RunResult,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousStoreInfo
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

from canzona.errors import CanzonaError
from canzona.harness import worker
from canzona.harness.worker import report_progress

__all__ = ["RankError", "report_progress", "run_ranks"]

Progress = Callable[[int, int, str], None]

RUN_DIR_PREFIX = "canzona-ranks-"  # followed by the parent's pid: stale directories can be swept
MONITOR_S = 0.1  # the agent's monitor interval: how soon progress, exits and the deadline are seen
TERM_GRACE_S = 2  # after SIGTERM, before SIGKILL (SIGTERM stays pending on a stopped process)
SETTLE_S = 5.0  # after a failure, beyond the collective timeout, for the peers to record theirs
SIGNALS_VAR = "TORCHELASTIC_SIGNALS_TO_HANDLE"  # read by the agent when it starts the ranks
HOST = "127.0.0.1"
# torch's loggers of the agent's run and of its stopping the ranks (filtered by `_Interrupts`)
AGENT_LOGGERS = ("torch.distributed.elastic.agent.server.api",
                 "torch.distributed.elastic.agent.server.local_elastic_agent",
                 "torch.distributed.elastic.multiprocessing.api")
# imported once by the fork server, so that every rank starts with them (what ranks run: the runtime)
PRELOAD = ("torch", "torch.distributed", "torch.distributed.elastic.multiprocessing",
           "canzona.harness.worker", "canzona.harness.launch", "canzona.runtime.optimizer",
           "canzona.harness.training", "reference.tiny_model")


class RankError(CanzonaError):
    """A rank failed (it raised, or it stalled while its peers failed): the first line says which
    and what; `trace` keeps the remote traceback (for a stall, the first peer's)."""

    def __init__(self, rank: int, error: str, trace: str):
        super().__init__(f"rank {rank}: {error.splitlines()[0] if error else 'failed'}")
        self.rank = rank
        self.trace = trace


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, deadline_s: float = 300.0,
              collective_timeout_s: float = 60.0, threads: int = 1,
              progress: Progress | None = None) -> list[Any]:
    """Run `fn(rank, world, *args)` on `world` gloo ranks; return the results in rank order.

    `threads` is torch's per-rank thread count; single-process comparisons must use the same.
    `progress(done, total, what)` is called (in this thread) with each new value that rank 0
    passes to `report_progress`, checked every `MONITOR_S` seconds."""
    if world < 1:
        raise CanzonaError(f"world size must be >= 1, got {world}")
    _sweep_stale_run_dirs()
    on_main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if on_main else None
    with _run_dir() as run_dir:
        # through a file, not the processes' arguments: a fork server receives at most 256 file
        # descriptors per process, and every tensor in the arguments would be one
        torch.save({"fn": fn, "args": args}, run_dir / worker.JOB_FILE)
        watch = _Watch(run_dir, world, deadline_s, collective_timeout_s, progress)
        agent = _Agent(_spec(run_dir, world, threads, collective_timeout_s), watch)
        stopped_by = _run(agent, handler, on_main)
        if stopped_by is None:
            return watch.results()  # read before the directory goes
    _pass_on(stopped_by, handler)
    raise CanzonaError(f"interrupted by {stopped_by.name}: the ranks were stopped")


# --- the agent -----------------------------------------------------------------------------------


class _OneNode(StaticTCPRendezvous):
    """torchrun's rendezvous for one node, its store on a port that the system picks as the store
    binds it (port 0): no race for a free port. The ranks join the group through that store."""

    def next_rendezvous(self) -> RendezvousInfo:
        info = super().next_rendezvous()
        port = self._store.port  # noqa: SLF001 - the store exists now; the bound port is only there
        return RendezvousInfo(info.store, info.rank, info.world_size, RendezvousStoreInfo(HOST, port))


def _spec(run_dir: Path, world: int, threads: int, collective_timeout_s: float) -> WorkerSpec:
    return WorkerSpec(role="rank", local_world_size=world,
                      rdzv_handler=_OneNode(HOST, master_port=0, rank=0, world_size=1, run_id=run_dir.name,
                                            timeout=math.ceil(collective_timeout_s)),
                      entrypoint=worker.main,
                      args=(str(run_dir), dict(os.environ), os.getpid(), threads, collective_timeout_s),
                      max_restarts=0, monitor_interval=MONITOR_S)


def _start_method() -> str:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))  # once it runs: no effect
    return "forkserver"


class _Agent(LocalElasticAgent):
    """torchrun's agent, with `run_ranks`'s checks in its monitor loop (see the module docstring)."""

    def __init__(self, spec: WorkerSpec, watch: _Watch):
        super().__init__(spec, DefaultLogsSpecs(log_dir=str(watch.run_dir)), start_method=_start_method(),
                         shutdown_timeout=TERM_GRACE_S)
        self.watch = watch
        self.interrupts: _Interrupts | None = None  # set by `_run`

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        if self._pcontext is None:
            raise AssertionError("the ranks have not been started")
        procs = self._processes()
        if self.watch.ended(procs, self._pcontext.error_files):
            self.stop()
            return RunResult(state=WorkerState.FAILED)
        if not self.watch.all_saved():
            return RunResult(state=WorkerState.HEALTHY)
        result = super()._monitor_workers(worker_group)  # takes the ranks' returns: they may exit
        if result.state is WorkerState.HEALTHY:
            return result
        # every rank has saved its result: an exit code after that (an abort at exit) changes nothing
        return RunResult(state=WorkerState.SUCCEEDED, return_values=dict.fromkeys(range(len(procs))))

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        if self.interrupts is None:
            return super()._start_workers(worker_group)
        with self.interrupts.holding():  # a signal is acted upon once every rank is started
            if self._start_method == "forkserver":
                _start_fork_server()
            return super()._start_workers(worker_group)

    def stop(self) -> None:
        """Stop the ranks still running (SIGTERM, `TERM_GRACE_S`, then SIGKILL) and reap them all.
        The agent's own stop after a failure waits 30 s for a process that ignores SIGTERM."""
        for p in self._processes():
            if p.exitcode is None and _is_stopped(p.pid):
                p.kill()  # a SIGTERM would stay pending: no grace to wait out
        self._shutdown(timeout=TERM_GRACE_S)

    def _processes(self) -> list[Any]:
        """The ranks' processes (exit code, pid), once started: the process context offers pids only."""
        return [] if self._pcontext is None else self._pcontext._pc.processes  # noqa: SLF001


def _start_fork_server() -> None:
    """Start the fork server (if it is not running) with SIGINT blocked, which it keeps across its
    exec: it imports the preloaded modules (about 3 s) before it ignores SIGINT itself (discarding
    one pending), and a Ctrl-C there (a terminal signals the whole process group) printed its
    KeyboardInterrupt traceback. Its ranks unblock SIGINT (`worker.main`). Blocked in this thread
    only, a Ctrl-C to the caller meanwhile is taken by another thread for `_Interrupts`, not lost."""
    from multiprocessing import forkserver, resource_tracker

    resource_tracker.ensure_running()  # first: its own launch unblocks SIGINT in this thread
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _run(agent: _Agent, handler: Any, on_main: bool) -> signal.Signals | None:
    """Run the agent under `_Interrupts`; return the signal that stopped it, if one did.
    The caller's handlers and environment are back afterwards, and no rank is left running."""
    told = os.environ.get(SIGNALS_VAR)
    # torch's agent installs a handler for each signal named here as it starts the ranks, one that
    # raises at once, cutting the start short (see `_Interrupts`): it gets a signal that nothing
    # sends (SIGURG: out-of-band data on a socket that asked for it), so SIGTERM stays with ours
    os.environ[SIGNALS_VAR] = "SIGURG"
    kept = {s: signal.getsignal(s) for s in (signal.SIGURG, signal.SIGINT)} if on_main else {}
    interrupts = _Interrupts(kept.get(signal.SIGINT))
    agent.interrupts = interrupts
    if on_main:
        signal.signal(signal.SIGTERM, interrupts)
        if callable(kept[signal.SIGINT]):  # not where the caller ignores Ctrl-C (a background job)
            signal.signal(signal.SIGINT, interrupts)
    loggers = [logging.getLogger(name) for name in AGENT_LOGGERS]
    for logger in loggers:
        logger.addFilter(interrupts)
    try:
        agent.run()
    except SignalException as e:
        return e.sigval
    finally:
        if told is None:
            del os.environ[SIGNALS_VAR]
        else:
            os.environ[SIGNALS_VAR] = told
        if on_main:  # a handler set outside Python (None) cannot be put back: the default is
            signal.signal(signal.SIGTERM, signal.SIG_DFL if handler is None else handler)
            for sig, kept_handler in kept.items():
                signal.signal(sig, signal.SIG_DFL if kept_handler is None else kept_handler)
        try:
            agent.stop()  # however the run ended (an exception in the agent's own stop included)
        finally:
            for logger in loggers:
                logger.removeFilter(interrupts)
    return None


class _Interrupts(logging.Filter):
    """The run's handler of SIGTERM and Ctrl-C (SIGINT), and the filter of the agent's logs.

    SIGTERM raises torch's `SignalException`, on which the agent stops the ranks and `run_ranks`
    passes the signal on; SIGINT calls the caller's handler (Python's raises KeyboardInterrupt),
    which the agent's stop follows as well. Either is held while the ranks are being started
    (`holding`), and acted upon once they are: raised in the middle, the start left a rank that the
    fork server was still forking, its pid never known and so never stopped, which found its
    semaphores unlinked by the caller's exit and printed a traceback after the caller's last line.

    Once the caller is being stopped by a signal, the agent's account of stopping the ranks (the
    death signal received, each process closed via SIGTERM or SIGKILL) is dropped: the caller
    reports the stop itself (the CLI in one line)."""

    def __init__(self, sigint_handler: Any):
        super().__init__()
        self.sigint_handler = sigint_handler
        self.starting = False
        self.held: int | None = None
        self.stopping = False

    def __call__(self, signum: int, frame: Any) -> None:
        self.stopping = True
        if self.starting:
            self.held = self.held or signum
            return
        self._act(signum, frame)

    @contextmanager
    def holding(self) -> Iterator[None]:
        self.starting = True
        try:
            yield
        finally:
            self.starting = False
            if self.held is not None:
                self._act(self.held, None)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.stopping

    def _act(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and callable(self.sigint_handler):
            self.sigint_handler(signum, frame)
            return
        sig = signal.Signals(signum)
        raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)


def _pass_on(sig: signal.Signals, handler: Any) -> None:
    """Do what the signal would have done without the agent (its handler is gone by now)."""
    if handler == signal.SIG_DFL:
        os.kill(os.getpid(), sig)
    elif callable(handler):
        handler(sig, None)


# --- the checks ----------------------------------------------------------------------------------


class _Watch:
    """The run as `run_ranks` sees it: the checks the agent makes in its monitor loop (progress, the
    deadline, a failure's consequences), then the results, or the error naming the rank at the
    origin. `procs` are the ranks' processes (exit code, pid), from the agent."""

    def __init__(self, run_dir: Path, world: int, deadline_s: float, collective_timeout_s: float,
                 progress: Progress | None):
        self.run_dir, self.world, self.progress = run_dir, world, progress
        self.deadline_s, self.collective_timeout_s = deadline_s, collective_timeout_s
        self.end = time.monotonic() + deadline_s
        self.grace_end: float | None = None
        self.shown: tuple[int, int, str] | None = None
        self.procs: list[Any] = []
        self.error_files: dict[int, str] = {}
        self.ending: str | None = None  # why the run was ended: 'deadline', 'exited' or 'settled'
        self.running: set[int] = set()  # the ranks still running then, stopped by the agent
        self.stopped: set[int] = set()  # of which those stopped by a signal (process state T)

    def ended(self, procs: list[Any], error_files: dict[int, str]) -> bool:
        """Whether to end the run now: past the deadline, a rank exited early (its peers cannot
        complete), or after a failure every rank has recorded its outcome, exited or is stopped, or
        the grace period for that is over."""
        self.procs, self.error_files = procs, error_files
        self._show_progress()
        now = time.monotonic()
        if now > self.end:
            return self._end("deadline")
        # Exit codes before the files: a rank saves its result and then exits, so one that had
        # exited before the files were looked at and has none really exited without a result
        # (looked at the other way round, a rank finishing between the two reads seemed to).
        exits = [p.exitcode for p in procs]
        saved = [worker.result_path(self.run_dir, r).exists() for r in range(self.world)]
        failed = [Path(error_files[r]).exists() for r in range(self.world)]
        if any(code is not None and not saved[r] for r, code in enumerate(exits)):
            return self._end("exited")  # it died, was interrupted or failed to join
        if self.grace_end is None and any(failed):
            # the others' collectives fail within their timeout: let them record why
            self.grace_end = min(self.end, now + self.collective_timeout_s + SETTLE_S)
        if self.grace_end is not None:
            # a stopped rank will not record anything: waiting longer for it is pointless
            settled = all(saved[r] or failed[r] or exits[r] is not None or _is_stopped(p.pid)
                          for r, p in enumerate(procs))
            if settled or now > self.grace_end:
                return self._end("settled")
        return False

    def all_saved(self) -> bool:
        return all(worker.result_path(self.run_dir, r).exists() for r in range(self.world))

    def results(self) -> list[Any]:
        """The ranks' results in rank order, or the error that names the rank at the origin."""
        self._show_progress()  # the last value may have come after the last check
        records = [self._record(r) for r in range(self.world)]
        error = _blame(records, self.procs, self.running, self.stopped, self.ending, self.deadline_s,
                       self.collective_timeout_s)
        if error is not None:
            raise error
        return [r["result"] for r in records]

    def _end(self, why: str) -> bool:
        self.ending = why
        self.running = {r for r, p in enumerate(self.procs) if p.exitcode is None}
        self.stopped = {r for r in self.running if _is_stopped(self.procs[r].pid)}
        return True

    def _show_progress(self) -> None:
        if self.progress is None:
            return
        try:
            done, total, what = json.loads((self.run_dir / worker.PROGRESS_FILE).read_text())
        except (OSError, ValueError, TypeError):
            return  # nothing reported yet
        if (done, total, what) != self.shown:
            self.shown = (done, total, what)
            self.progress(done, total, what)

    def _record(self, rank: int) -> dict | None:
        """What a rank left: its result, its error, or None (nothing readable)."""
        try:
            return {"ok": True, "result": torch.load(worker.result_path(self.run_dir, rank), weights_only=False)}
        except FileNotFoundError:
            return _read_error_file(self.error_files.get(rank))
        except Exception:  # noqa: BLE001 - unreadable is as good as missing: the rank is reported
            return None


def _read_error_file(path: str | None) -> dict | None:
    """A rank's error file, as torch's `record` writes it: the exception, its traceback and when
    (the file's modification time: the timestamp inside has whole seconds, too coarse to order
    peers)."""
    if path is None:
        return None
    try:
        with open(path) as f:
            message = json.load(f)["message"]
        error, trace = message["message"], message["extraInfo"]["py_callstack"]
        at = os.stat(path).st_mtime
    except (OSError, ValueError, KeyError, TypeError):
        return None
    # `record` writes "Name: message", and "Name: " for an exception without one
    return {"ok": False, "error": error.removesuffix(": "), "trace": trace, "at": at}


_TIMEOUT = re.compile(r"time[ds]? ?out", re.IGNORECASE)


def _blame(records: list[dict | None], procs: list[Any], killed: set[int], stopped: set[int],
           ending: str | None, deadline_s: float, collective_timeout_s: float) -> CanzonaError | None:
    """The error naming the rank at the origin of a failure, or None if every rank succeeded."""
    died = [r for r, record in enumerate(records) if record is None and r not in killed]
    if died:  # a rank that died on its own explains its peers' failures
        status = ", ".join(f"rank {r} ({_exit_status(procs[r].exitcode)})" for r in died)
        return CanzonaError(f"{status} died without a result")
    failed = sorted((r.get("at", 0.0), rank) for rank, r in enumerate(records)
                    if r is not None and not r["ok"])
    stalled = [r for r in sorted(killed) if records[r] is None]
    if failed:
        first = failed[0][1]
        error, trace = records[first]["error"], records[first]["trace"]
        # A rank that stalled (stopped, or hung outside any collective) makes its peers' collectives
        # time out: they raise, but it is the cause. It only counts as stalled if it was given the
        # grace period, and if it was stopped or the first error is such a timeout; otherwise a slow
        # rank would be blamed for a peer that raised first.
        suspects = [r for r in stalled if r in stopped] or (
            stalled if _TIMEOUT.search(error) else [])
        if suspects and ending != "exited":
            rank = suspects[0]
            how = "stopped by a signal, process state T" if rank in stopped else "still running"
            also = f", and so did rank(s) {suspects[1:]}" if len(suspects) > 1 else ""
            return RankError(rank, f"stalled without a result ({how}) while its peers failed "
                             f"(process-group timeout {collective_timeout_s:g} s){also}; first peer "
                             f"error: rank {first}: {error.splitlines()[0] if error else 'failed'}",
                             trace)
        return RankError(first, error, trace)  # the first that raised (its peers lost a partner)
    if ending == "deadline":
        running = ", ".join(f"rank {r}{' (stopped)' if r in stopped else ''}" for r in sorted(killed))
        return CanzonaError(f"ranks did not finish within {deadline_s:g} s (a hang?)"
                            f"{f'; still running: {running}' if running else ''}")
    if killed:
        return CanzonaError(f"rank(s) {sorted(killed)} were stopped without a result")
    return None


def _exit_status(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _is_stopped(pid: int | None) -> bool:
    """Stopped by a signal (SIGSTOP, SIGTSTP, ...): Linux only, False where /proc is missing."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] == ["T"]  # the name before ')' may hold spaces


# --- the run directory ---------------------------------------------------------------------------


@contextmanager
def _run_dir() -> Iterator[Path]:
    """The job, the results, the error files and the progress of one run: the parent's pid in the
    name, so that a directory left by a parent killed outright can be swept."""
    path = Path(tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _sweep_stale_run_dirs(root: str | None = None) -> None:
    """Remove run directories whose parent is dead (killed outright: SIGKILL, OOM): their ranks
    remove it too, but only if they were running when their parent died."""
    base = Path(root or tempfile.gettempdir())
    try:
        entries = list(base.glob(f"{RUN_DIR_PREFIX}*"))
    except OSError:
        return
    for d in entries:
        m = re.fullmatch(rf"{re.escape(RUN_DIR_PREFIX)}(\d+)-.+", d.name)
        try:
            if not m or d.is_symlink() or not d.is_dir():
                continue
            if hasattr(os, "getuid") and d.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        if not _pid_alive(int(m[1])):
            shutil.rmtree(d, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # someone else's process
    return True
