"""Spawn a gloo process group on this machine, with a free port and a deadline.

`run_ranks(fn, world, *args)` starts `world` processes, each calling `fn(rank, world,
*args)` inside an initialised gloo group whose collectives time out; the return values come back
through files, in rank order. A rank that raises, dies, stalls or exceeds the deadline fails the
whole run with one clear error that names the rank at the origin, and the other ranks are stopped
(SIGTERM, then SIGKILL): a hang never outlives the deadline and no rank outlives the run.

Nothing outlives its parent either: each rank watches its parent process and exits (removing the
run's directory) when it is gone, even while blocked in a collective; SIGTERM to the parent stops
the ranks and removes the directory before the parent dies; and directories left by parents that
were killed outright are swept at the next run.

Ranks are forked from a server process that has torch and canzona's runtime imported already
(multiprocessing's forkserver: about 3 s of imports per rank saved, which dominate a small run); a
rank takes the caller's environment as it is at the call. Where forkserver is not available, ranks
are spawned.

Inside a rank, `report_progress(done, total, what)` publishes rank 0's progress; the parent passes
each new value to `run_ranks(..., progress=callback)`.
"""

from __future__ import annotations

import json
import multiprocessing.connection
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from canzona.errors import CanzonaError
from canzona.runtime.lifecycle import EXIT_ORPHANED, POLL_S, parent_alive, watch_parent

Progress = Callable[[int, int, str], None]

RUN_DIR_PREFIX = "canzona-ranks-"  # followed by the parent's pid: stale directories can be swept
PORT_ATTEMPTS = 3  # a free port can be taken by someone else before rank 0 binds it
# POLL_S (from lifecycle) also paces the parent's join loop
TERM_GRACE_S = 2.0  # after SIGTERM, before SIGKILL (SIGTERM stays pending on a stopped process)
REAP_TIMEOUT_S = 10.0  # after SIGKILL: only a process stuck in the kernel takes longer
EXIT_INTERRUPTED = 130  # a rank interrupted by SIGINT (Ctrl-C, or torch's parent-death signal)
PROGRESS_FILE = "progress.json"
JOB_FILE = "job.pt"  # the function and arguments every rank runs
# imported once by the fork server, so that every rank starts with them (what ranks run: the runtime)
PRELOAD = ("torch", "torch.distributed", "canzona.harness.launch", "canzona.runtime.optimizer",
           "canzona.harness.training", "reference.tiny_model")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- inside a rank ------------------------------------------------------------------------------

_progress_path: Path | None = None  # set in rank 0 only: the other ranks' reports are not shown

# Held while writing into the run directory, and for good by a rank leaving after its parent died,
# which removes the directory: nothing can be written into it afterwards by this rank.
_dir_lock = threading.RLock()


def report_progress(done: int, total: int, what: str) -> None:
    """Publish this run's progress (`done` of `total`, now doing `what`) to `run_ranks`'s caller.

    A no-op outside a rank spawned by `run_ranks` and on ranks other than 0. Cheap enough to call
    every step: one small write and a rename, no fsync."""
    path = _progress_path
    if path is None:
        return
    tmp = path.with_name(f"{path.name}.{threading.get_ident()}.tmp")
    try:
        with _dir_lock:
            tmp.write_text(json.dumps([int(done), int(total), str(what)]))
            os.replace(tmp, path)  # the parent never reads a half-written value
    except OSError:
        pass  # progress is advisory: a vanished run directory is handled by the watchdog


def _leave(code: int, parent: int, outdir: str) -> None:
    """Exit now, skipping interpreter and process-group teardown (either can block on peers)."""
    _dir_lock.acquire()  # never released: this rank writes nothing after the removal
    if not parent_alive(parent):
        # nobody else will remove it; each orphan removes it after its own last write, so
        # whichever leaves last leaves nothing
        shutil.rmtree(outdir, ignore_errors=True)
    os._exit(code)


def _watch_parent(parent: int, outdir: str) -> None:
    """Exit when the parent is gone. A thread, so it works while the main thread is blocked in C
    (a gloo collective), where torch's parent-death SIGINT is never acted upon."""
    watch_parent(parent, lambda: _leave(EXIT_ORPHANED, parent, outdir), POLL_S)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _start_method() -> str:
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    mp.get_context("forkserver").set_forkserver_preload(list(PRELOAD))  # no effect once it runs
    return "forkserver"


def _watched(launcher: int) -> int:
    """The process whose end means the launcher is gone: the launcher itself (a spawned rank's
    parent), or the fork server it started, which exits when the launcher does. A launcher
    already gone is watched directly: `parent_alive` is then False."""
    parent = os.getppid()
    if parent == launcher:
        return launcher
    try:
        os.kill(launcher, 0)
    except ProcessLookupError:
        return launcher
    except PermissionError:  # alive, owned by someone else: cannot be our launcher's pid reused
        pass
    return parent


def _let_go_of_the_fork_server() -> None:
    """The fork server exits when the last holder of the write end of its pipe from the launcher
    is gone, and hands that end to every process it forks (so that they could use it in turn): a
    rank keeping it would keep the server, and so itself, alive after the launcher is killed."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # noqa: SLF001 - the stdlib keeps the fd only here
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None


def _worker(rank: int, world: int, port: int, outdir: str, timeout_s: float, threads: int,
            launcher: int, env: dict[str, str]) -> None:
    _let_go_of_the_fork_server()  # a no-op in a spawned rank
    parent = _watched(launcher)
    _watch_parent(parent, outdir)  # first: the parent may already be gone
    if os.environ != env:  # a forked rank has the fork server's environment: take the caller's
        os.environ.clear()
        os.environ.update(env)
    try:
        _rank_main(rank, world, port, outdir, timeout_s, threads, parent)
    finally:
        if not parent_alive(parent):  # whatever happened: do not leave the directory behind
            _leave(EXIT_ORPHANED, parent, outdir)


def _rank_main(rank: int, world: int, port: int, outdir: str, timeout_s: float, threads: int,
               parent: int) -> None:
    global _progress_path
    if rank == 0:
        _progress_path = Path(outdir) / PROGRESS_FILE
    torch.set_num_threads(threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this machine
    out = Path(outdir) / f"rank{rank}.pt"
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001
        taken = "address already in use" in str(e).lower() or "EADDRINUSE" in str(e)
        _save({"ok": False, "port_taken": taken, "error": _describe(e),
               "trace": traceback.format_exc()}, out)
        _mark_failed(outdir, rank)
        os._exit(1)
    try:
        job = torch.load(Path(outdir) / JOB_FILE, weights_only=False)  # written by this run's parent
        record = {"ok": True, "result": job["fn"](rank, world, *job["args"])}
    except KeyboardInterrupt as e:
        # Ctrl-C reaches the whole process group, and torch turns the parent's death into SIGINT:
        # either way nobody will stop this rank later, so it must not stay alive
        if parent_alive(parent):
            _save({"ok": False, "error": _describe(e), "trace": traceback.format_exc(),
                   "at": time.time()}, out)
            _mark_failed(outdir, rank)
        _leave(EXIT_INTERRUPTED, parent, outdir)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        record = {"ok": False, "error": _describe(e), "trace": traceback.format_exc(),
                  "at": time.time()}
    _save(record, out)  # before any teardown: a failed group can abort in its destructor
    if not record["ok"]:
        # Stay alive: a peer that vanishes mid-collective can make gloo abort its partners
        # (std::terminate), while a silent peer makes their collectives time out cleanly. The parent
        # stops this process once the others have recorded their outcome, unless it dies first.
        _mark_failed(outdir, rank)
        try:
            while parent_alive(parent):
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            pass
        _leave(EXIT_INTERRUPTED if parent_alive(parent) else EXIT_ORPHANED, parent, outdir)
    dist.destroy_process_group()


def _mark_failed(outdir: str, rank: int) -> None:
    """Tell the parent, without it loading the record, that this rank's record is a failure."""
    with _dir_lock:
        (Path(outdir) / f"rank{rank}.failed").touch()


# --- in the parent ------------------------------------------------------------------------------


class _PortTaken(Exception):
    pass


class _Terminated(BaseException):
    """SIGTERM reached `run_ranks`: unwinds it so that its cleanup runs. A BaseException, so that
    an `except Exception` in a progress callback cannot swallow it."""


class _SigtermAsException:
    """While active (main thread only), SIGTERM raises `_Terminated` instead of killing the process
    outright, which would leave the ranks to their watchdogs and the run directory behind."""

    def __init__(self) -> None:
        self.previous: Any = None
        self.installed = False
        self.deferring = False
        self.received = False
        self.raised = False
        self.frame: FrameType | None = None

    def __enter__(self) -> _SigtermAsException:
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGTERM)
            # SIG_IGN: the process chose to ignore SIGTERM; None: a handler set outside Python,
            # which could not be restored
            if previous is not None and previous != signal.SIG_IGN:
                self.previous = previous
                signal.signal(signal.SIGTERM, self._handle)
                self.installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self.installed:
            signal.signal(signal.SIGTERM, self.previous)
            self.installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received:
            return  # one unwinding is enough; a second SIGTERM must not interrupt the cleanup
        self.received, self.frame = True, frame
        if not self.deferring:
            self.raised = True
            raise _Terminated()

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """Hold a SIGTERM back until the block (spawning, cleanup) is complete."""
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False
        if self.received and not self.raised:
            self.raised = True
            raise _Terminated()

    def pass_on(self) -> None:
        """After cleanup, do what SIGTERM would have done without us (handler already restored)."""
        if self.previous == signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGTERM)
        elif callable(self.previous):
            self.previous(signal.SIGTERM, self.frame)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, deadline_s: float = 300.0,
              collective_timeout_s: float = 60.0, threads: int = 1,
              progress: Progress | None = None) -> list[Any]:
    """Run `fn(rank, world, *args)` on `world` gloo ranks; return the results in rank order.

    `threads` is torch's per-rank thread count; single-process comparisons must use the same.
    `progress(done, total, what)` is called (in this process) with each new value that rank 0
    passes to `report_progress`, checked every `POLL_S` seconds."""
    if world < 1:
        raise CanzonaError(f"world size must be >= 1, got {world}")
    guard = _SigtermAsException()
    try:
        with guard:
            for _ in range(PORT_ATTEMPTS):
                try:
                    return _run_once(fn, world, args, deadline_s, collective_timeout_s, threads,
                                     progress, guard)
                except _PortTaken:
                    continue
    except _Terminated:
        guard.pass_on()
        raise CanzonaError("interrupted by SIGTERM: the ranks were stopped") from None
    raise CanzonaError(f"could not get a free port for the process group in {PORT_ATTEMPTS} attempts")


def _run_once(fn: Callable[..., Any], world: int, args: tuple, deadline_s: float,
              collective_timeout_s: float, threads: int, progress: Progress | None,
              guard: _SigtermAsException) -> list[Any]:
    _sweep_stale_run_dirs()
    outdir = ""
    procs: list[Any] = []
    error_files: list[str] = []
    try:
        with guard.deferred():  # a SIGTERM mid-spawn must not lose track of started ranks
            outdir = tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-")
            # through a file, not the processes' arguments: a fork server receives at most 256
            # file descriptors per process, and every tensor in the arguments would be one
            torch.save({"fn": fn, "args": args}, Path(outdir) / JOB_FILE)
            ctx = mp.start_processes(
                _worker, args=(world, free_port(), outdir, collective_timeout_s, threads, os.getpid(),
                               dict(os.environ)),
                nprocs=world, join=False, start_method=_start_method())
            procs, error_files = ctx.processes, ctx.error_files
        ending = _supervise(procs, Path(outdir), deadline_s, collective_timeout_s, progress)
    finally:
        with guard.deferred():
            stopped = {r for r, p in enumerate(procs) if p.exitcode is None and _is_stopped(p.pid)}
            killed = _stop(procs)
            records = [_read(Path(outdir) / f"rank{rank}.pt") for rank in range(len(procs))]
            if outdir:
                shutil.rmtree(outdir, ignore_errors=True)
            for f in error_files:  # torch's, written when a rank raises outside `_worker`'s handlers
                Path(f).unlink(missing_ok=True)
    if any(r is not None and r.get("port_taken") for r in records):
        raise _PortTaken()
    error = _blame(records, procs, killed, stopped, ending, deadline_s, collective_timeout_s)
    if error is not None:
        raise error
    return [r["result"] for r in records]


def _supervise(procs: list[Any], outdir: Path, deadline_s: float, collective_timeout_s: float,
               progress: Progress | None) -> str:
    """Wait until the ranks are done, or a failure has had its consequences; say why it ended:
    'done', 'exited' (a rank exited early), 'settled' (after a failure) or 'deadline'."""
    world = len(procs)
    end = time.monotonic() + deadline_s
    grace_end: float | None = None
    shown: tuple[int, int, str] | None = None
    while True:
        alive = [p for p in procs if p.exitcode is None]
        if not alive:
            break
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=POLL_S)
        shown = _show_progress(outdir, progress, shown)
        now = time.monotonic()
        if now > end:
            return "deadline"
        # Exit codes before the files: a rank writes its record and then exits, so one that had
        # exited before the files were looked at and has none really exited without a result
        # (looked at the other way round, a rank finishing between the two reads seemed to).
        exits = [p.exitcode for p in procs]
        recorded = [(outdir / f"rank{r}.pt").exists() for r in range(world)]
        failed = [(outdir / f"rank{r}.failed").exists() for r in range(world)]
        # A rank whose success is recorded is done whatever its exit code (an abort while tearing
        # down gloo after the record must not stop peers that are finishing their own work).
        if any(code is not None and (not recorded[r] or failed[r]) for r, code in enumerate(exits)):
            return "exited"  # it died, was interrupted or failed to join: its peers cannot complete
        if grace_end is None and any(failed):
            # the others' collectives fail within their timeout: let them record why
            grace_end = min(end, now + collective_timeout_s + 5.0)
        if grace_end is not None:
            # a stopped rank will not record anything: waiting longer for it is pointless
            settled = all(recorded[r] or exits[r] is not None or _is_stopped(p.pid)
                          for r, p in enumerate(procs))
            if settled or now > grace_end:
                return "settled"
    _show_progress(outdir, progress, shown)  # the last value may have come after the last poll
    return "done"


def _show_progress(outdir: Path, progress: Progress | None,
                   shown: tuple[int, int, str] | None) -> tuple[int, int, str] | None:
    if progress is None:
        return shown
    try:
        done, total, what = json.loads((outdir / PROGRESS_FILE).read_text())
    except (OSError, ValueError, TypeError):
        return shown  # nothing reported yet
    if (done, total, what) != shown:
        progress(done, total, what)
    return done, total, what


def _stop(procs: list[Any]) -> set[int]:
    """Stop the ranks still running (SIGTERM, a short grace, then SIGKILL, which also ends stopped
    processes) and reap every rank, so that interpreter exit never waits on one; return the ranks
    that were still running."""
    running = {r for r, p in enumerate(procs) if p.exitcode is None}
    for r in running:
        procs[r].terminate()
    grace_end = time.monotonic() + TERM_GRACE_S
    while True:
        alive = [p for p in procs if p.exitcode is None]
        if not alive or time.monotonic() > grace_end or all(_is_stopped(p.pid) for p in alive):
            break
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=0.05)
    for p in procs:
        if p.exitcode is None:
            p.kill()
    end = time.monotonic() + REAP_TIMEOUT_S
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    return running


_TIMEOUT = re.compile(r"time[ds]? ?out", re.IGNORECASE)


def _blame(records: list[dict | None], procs: list[Any], killed: set[int], stopped: set[int],
           ending: str, deadline_s: float, collective_timeout_s: float) -> CanzonaError | None:
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


def _is_stopped(pid: int | None) -> bool:
    """Stopped by a signal (SIGSTOP, SIGTSTP, ...): Linux only, False where /proc is missing."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] == ["T"]  # the name before ')' may hold spaces


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # someone else's process
    return True


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


def _save(record: dict, path: Path) -> None:
    """Write atomically: the parent may stop this process at any moment."""
    tmp = path.with_suffix(".tmp")
    with _dir_lock:
        torch.save(record, tmp)
        os.replace(tmp, path)


def _exit_status(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _read(path: Path) -> dict | None:
    try:
        return torch.load(path, weights_only=False) if path.exists() else None
    except Exception:  # noqa: BLE001 - unreadable is as good as missing: the rank is reported
        return None


class RankError(CanzonaError):
    """A rank failed (it raised, or it stalled while its peers failed): the first line says which
    and what; `trace` keeps the remote traceback (for a stall, the first peer's)."""

    def __init__(self, rank: int, error: str, trace: str):
        super().__init__(f"rank {rank}: {error.splitlines()[0] if error else 'failed'}")
        self.rank = rank
        self.trace = trace
