"""`exit_with_launcher()` stops a process within seconds of its launcher's death (issue 17
finding 12, the library part; `tests/examples/test_example_train.py` checks it under torchrun).

A supervisor process (a subreaper, so that the orphan becomes its child and its exit status can
be read) starts a launcher, which starts the watched process; the supervisor SIGKILLs the launcher
and times the orphan's exit: SIGTERM with the default disposition, and the hard exit after the
grace period when a SIGTERM handler keeps the process alive. A process that writes files stops at
its next write once its launcher is gone, long before its watchdog's next look
(`stop_if_orphaned`, called by `write_atomically` and `save_checkpoint`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 1.0

WATCHED = """
import os, signal, sys, time
from canzona.runtime.lifecycle import exit_with_launcher
if sys.argv[1] == "handler":  # a script's SIGTERM handler that does not exit
    signal.signal(signal.SIGTERM, lambda *a: None)
if sys.argv[1] == "writer":  # a fast loop of writes; the watchdog looks only once a minute
    from canzona.runtime.atomic_files import write_atomically
    exit_with_launcher(grace_s=float(sys.argv[3]), poll_s=60.0)
    open(sys.argv[2], "w").write(str(os.getpid()))
    for i in range(10**9):
        write_atomically(f"{sys.argv[2]}.{i}", lambda f: f.write(b"x"))
        time.sleep(0.01)
exit_with_launcher(grace_s=float(sys.argv[3]), poll_s=0.05)
open(sys.argv[2], "w").write(str(os.getpid()))
while True:
    time.sleep(60)  # interrupted by the handler's SIGTERM, and back to sleep
"""

LAUNCHER = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]])
time.sleep(120)
"""

SUPERVISOR = """
import ctypes, json, os, signal, subprocess, sys, time
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans below come to us
watched, launcher, mode, pidfile, grace = sys.argv[1:]
parent = subprocess.Popen([sys.executable, "-c", launcher, watched, mode, pidfile, grace])
end = time.monotonic() + 60
while not (os.path.exists(pidfile) and open(pidfile).read()) and time.monotonic() < end:
    time.sleep(0.02)
pid = int(open(pidfile).read())
time.sleep(0.2)
parent.kill()
parent.wait()
killed = time.monotonic()
written = lambda: len([n for n in os.listdir(os.path.dirname(pidfile)) if n.startswith("pid.")])
at_kill = written()
while time.monotonic() < killed + 30:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print(json.dumps({"after_s": time.monotonic() - killed, "at_kill": at_kill, "after": written(),
                          "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                          "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None}))
        break
    time.sleep(0.02)
else:
    os.kill(pid, signal.SIGKILL)
    print(json.dumps({"after_s": None}))
"""


@pytest.mark.parametrize("mode", ["default", "handler", "writer"])
def test_a_process_stops_when_its_launcher_is_killed(mode, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SUPERVISOR, WATCHED, LAUNCHER, mode, str(tmp_path / "pid"),
                           str(GRACE_S)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["after_s"] is not None, "the orphan was still running 30 s after its launcher died"
    if mode == "default":  # SIGTERM ends it at once
        assert result["signal"] == 15 and result["after_s"] < 5, result
    elif mode == "writer":  # stopped at its next write, not at the watchdog's look a minute later
        assert result["signal"] == 15 and result["after_s"] < 5, result
        assert result["at_kill"] > 0 and result["after"] - result["at_kill"] <= 1, result
    else:  # the handler keeps it alive: the hard exit after the grace period
        assert result["code"] == 70 and GRACE_S <= result["after_s"] < GRACE_S + 5, result


def test_a_child_forked_from_a_watched_process_writes(tmp_path):
    """The watch is the process's that called exit_with_launcher: a child it forks (a data-loader
    worker, a multiprocessing pool) has that process, alive, as its parent, and writes normally."""
    code = f"""
import multiprocessing as mp, os, sys
from canzona.runtime.lifecycle import exit_with_launcher
from canzona.runtime.atomic_files import write_atomically
exit_with_launcher(poll_s=0.05)
def child():
    write_atomically({str(tmp_path / "child.txt")!r}, lambda f: f.write(b"ok"))
p = mp.get_context("fork").Process(target=child)
p.start(); p.join(60)
sys.exit(0 if p.exitcode == 0 else 1)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "child.txt").read_bytes() == b"ok"
