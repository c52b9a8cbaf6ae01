"""Processes that do not outlive the process that launched them.

A rank started by `torchrun` (or any launcher) is its child. When the launcher is killed outright
(SIGKILL, the OOM killer), nothing stops the rank: it is re-parented and goes on training, writing
checkpoints and holding GPUs. `exit_with_launcher()` starts a watchdog thread that notices the
launcher is gone and stops the process: SIGTERM to itself first, so that a handler the script
installed can run, then a hard exit after a grace period. A thread, because the main thread may be
blocked in C (a collective), where Python never runs a signal handler:

    from canzona.runtime.lifecycle import exit_with_launcher
    exit_with_launcher()        # first thing in a torchrun script

A save must not start once the launcher is gone: the watchdog looks only every `POLL_S`, and a
fast loop would otherwise go on writing checkpoints until it does. `stop_if_orphaned()` looks at
once (one `getppid`) and stops the process the same way; `save_checkpoint` calls it first, so an
orphaned rank writes no new checkpoint.

`canzona.harness.worker` uses the same watch in the ranks that `canzona.harness.launch` starts
(`watch_parent`).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

POLL_S = 0.25  # how often the watchdog looks at the parent
EXIT_GRACE_S = 5.0  # after SIGTERM to itself, before the hard exit
EXIT_ORPHANED = 70  # the exit code of a process whose launcher died

# exit_with_launcher's (this process, its launcher, the stop): a child forked later inherits the
# module but not the watch (its parent is this process, not the launcher), so the pid says whose
_watched: tuple[int, int, Callable[[], None]] | None = None
_stopping = threading.Event()  # the stop runs once, whoever notices first


def parent_alive(parent: int) -> bool:
    """Whether `parent` is still this process's parent. An orphan is re-parented (to init or a
    subreaper), so its ppid changes; a recycled pid cannot be mistaken for the parent."""
    return os.getppid() == parent


def watch_parent(parent: int, on_gone: Callable[[], None], poll_s: float = POLL_S) -> threading.Thread:
    """Call `on_gone()` from a daemon thread as soon as `parent` is no longer this process's
    parent (at once if it already is not)."""

    def watch() -> None:
        while parent_alive(parent):
            time.sleep(poll_s)
        on_gone()

    thread = threading.Thread(target=watch, name="canzona-parent-watchdog", daemon=True)
    thread.start()
    return thread


def exit_with_launcher(grace_s: float = EXIT_GRACE_S, poll_s: float = POLL_S,
                       exit_code: int = EXIT_ORPHANED) -> threading.Thread:
    """Stop this process within about `poll_s` once the process that started it is gone.

    SIGTERM to itself first: with the default disposition the process ends at once; a script's own
    SIGTERM handler gets `grace_s` seconds to clean up, after which the process exits with
    `exit_code` without running any more Python (`os._exit`). Call it once, at the start."""
    global _watched
    parent = os.getppid()

    def stop() -> None:
        if _stopping.is_set():  # the other caller's stop is under way: it ends the process
            time.sleep(grace_s + 1.0)
            os._exit(exit_code)
        _stopping.set()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)  # a handler that returned, or a main thread blocked in C
        os._exit(exit_code)

    _watched = (os.getpid(), parent, stop)
    return watch_parent(parent, stop, poll_s)


def stop_if_orphaned() -> None:
    """If `exit_with_launcher()` watches this process and its launcher is gone, stop now, as the
    watchdog would, instead of at its next look. Does nothing otherwise (no watch, or the launcher
    is alive, or a child forked from the watched process, whose parent it is)."""
    if _watched is None:
        return
    watched, parent, stop = _watched
    if os.getpid() == watched and not parent_alive(parent):
        stop()
