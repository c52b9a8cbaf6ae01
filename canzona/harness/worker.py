"""What runs inside each rank that `canzona.harness.launch.run_ranks` starts.

The elastic agent calls `main` in every worker process, with the environment torchrun gives its
workers (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT of the agent's store, TORCHELASTIC_ERROR_FILE).
A rank joins the gloo group through that store, runs the job and saves its result into the run
directory; a rank that raises writes its error file (what torch's `record` writes: the exception,
its traceback, when) and stays alive until it is stopped.

Each rank watches its launcher and exits when it is gone, even while blocked in a collective,
removing the run directory: nothing outlives its caller. (The elastic agent has no such watch:
torch turns its death into a SIGINT, which a rank blocked in a collective never acts upon.)

Inside a rank, `report_progress(done, total, what)` publishes rank 0's progress to the caller.
"""

from __future__ import annotations

import json
import multiprocessing.util
import os
import shutil
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import get_error_handler

from canzona.runtime.lifecycle import EXIT_ORPHANED, POLL_S, parent_alive, watch_parent

EXIT_INTERRUPTED = 130  # a rank interrupted by SIGINT (Ctrl-C, or torch's parent-death signal)
JOB_FILE = "job.pt"  # the function and arguments every rank runs
PROGRESS_FILE = "progress.json"

# The environment as this module was imported: in a forked rank, the fork server's. What differs from
# it once the agent has started the rank was set by the agent for this rank.
_IMPORTED_ENV = dict(os.environ)

_progress_path: Path | None = None  # set in rank 0 only: the other ranks' reports are not shown
_saved = False  # this rank's result is in the run directory

# Held while writing into the run directory, and for good by a rank leaving after its launcher died,
# which removes the directory: nothing can be written into it afterwards by this rank.
_dir_lock = threading.RLock()


def result_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / f"rank{rank}.pt"


def report_progress(done: int, total: int, what: str) -> None:
    """Publish this run's progress (`done` of `total`, now doing `what`) to `run_ranks`'s caller.

    A no-op outside a rank started by `run_ranks` and on ranks other than 0. Cheap enough to call
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


def main(run_dir: str, env: dict[str, str], launcher: int, threads: int, timeout_s: float) -> None:
    """One rank: join the group, run the job in `run_dir`, leave its result or its error there."""
    _let_go_of_the_fork_server()  # a no-op in a spawned rank
    # a forked rank has the fork server's signal mask, SIGINT blocked (`launch._start_fork_server`)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    parent = _watched(launcher)
    # first: the launcher may be gone already. A thread, so that it works while the main thread is
    # blocked in C (a gloo collective), where torch's parent-death SIGINT is never acted upon.
    watch_parent(parent, lambda: _leave(EXIT_ORPHANED, parent, run_dir), POLL_S)
    # Priority 0 and made first, so that it runs after the job's own finalizers
    multiprocessing.util.Finalize(None, _end_once_released, exitpriority=0)
    _take_environment(env)
    try:
        _run(run_dir, threads, timeout_s, parent)
    finally:
        if not parent_alive(parent):  # whatever happened: do not leave the directory behind
            _leave(EXIT_ORPHANED, parent, run_dir)


def _run(run_dir: str, threads: int, timeout_s: float, parent: int) -> None:
    global _progress_path, _saved
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == 0:
        _progress_path = Path(run_dir) / PROGRESS_FILE
    torch.set_num_threads(threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this machine
    try:
        # env://: through the agent's store; a failure here fails every rank, none waits for another
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - reported through the error file
        _record_error(e)
        _leave(1, parent, run_dir)
    try:
        job = torch.load(Path(run_dir) / JOB_FILE, weights_only=False)  # written by this run's parent
        result = job["fn"](rank, world, *job["args"])
    except KeyboardInterrupt as e:
        # Ctrl-C reaches the whole process group, and torch turns the fork server's death into
        # SIGINT: either way nobody will stop this rank later, so it must not stay alive
        if parent_alive(parent):
            _record_error(e)
        _leave(EXIT_INTERRUPTED, parent, run_dir)
    except BaseException as e:  # noqa: BLE001 - reported through the error file
        _record_error(e)
        # Stay alive: a peer that vanishes mid-collective can make gloo abort its partners
        # (std::terminate), while a silent peer makes their collectives time out cleanly, and they
        # record why. The parent stops this process once they have, unless it dies first.
        try:
            while parent_alive(parent):
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            pass
        _leave(EXIT_INTERRUPTED if parent_alive(parent) else EXIT_ORPHANED, parent, run_dir)
    _save(result, result_path(run_dir, rank))
    _saved = True
    # The group is not destroyed: the agent holds this process until every rank has returned, and
    # then it ends without teardown (`_end_once_released`).


def _end_once_released() -> None:
    """End a rank whose result is saved, once the agent has let it go: multiprocessing calls this as
    the process function returns, before it joins the job's threads and child processes and before
    a spawned interpreter's teardown (gloo's can abort), none of which can change the outcome and any
    of which could hang past the deadline."""
    if not _saved:
        return  # an exception is on its way: let it end the process as it would
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a broken pipe: nothing more to say
            pass
    os._exit(0)


def _record_error(e: BaseException) -> None:
    """Write this rank's error file (TORCHELASTIC_ERROR_FILE) as torch's `record` does for an
    exception it sees: this rank catches its own, to stay alive."""
    with _dir_lock:
        get_error_handler().record_exception(e)


def _save(result: Any, path: Path) -> None:
    """Write atomically: the parent may stop this process at any moment."""
    tmp = path.with_suffix(".tmp")
    with _dir_lock:
        torch.save(result, tmp)
        os.replace(tmp, path)


def _take_environment(env: dict[str, str]) -> None:
    """Take the caller's environment as it was at the call (a forked rank starts with the fork
    server's), keeping what the agent set for this rank."""
    set_by_agent = {k: v for k, v in os.environ.items() if _IMPORTED_ENV.get(k) != v}
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(set_by_agent)


def _leave(code: int, parent: int, run_dir: str) -> NoReturn:
    """Exit now, skipping interpreter and process-group teardown (either can block on peers)."""
    _dir_lock.acquire()  # never released: this rank writes nothing after the removal
    if not parent_alive(parent):
        # nobody else will remove it; each orphan removes it after its own last write, so
        # whichever leaves last leaves nothing
        shutil.rmtree(run_dir, ignore_errors=True)
    os._exit(code)


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
