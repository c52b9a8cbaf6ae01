"""Spawn a gloo process group on this machine, with a free port and a deadline.

`run_ranks(fn, world, *args)` starts `world` processes (spawn), each calling `fn(rank, world,
*args)` inside an initialised gloo group whose collectives time out; the return values come back
through files, in rank order. A rank that raises, dies or exceeds the deadline fails the whole run
with one clear error, and the other ranks are terminated: a hang never outlives the deadline.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from canzona.errors import CanzonaError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, outdir: str, timeout_s: float, threads: int,
            fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this machine
    out = Path(outdir) / f"rank{rank}.pt"
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001
        taken = "address already in use" in str(e).lower() or "EADDRINUSE" in str(e)
        _save({"ok": False, "port_taken": taken, "error": f"{type(e).__name__}: {e}",
               "trace": traceback.format_exc()}, out)
        os._exit(1)
    try:
        record = {"ok": True, "result": fn(rank, world, *args)}
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        record = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(),
                  "at": time.time()}
    _save(record, out)  # before any teardown: a failed group can abort in its destructor
    if not record["ok"]:
        # Stay alive: a peer that vanishes mid-collective can make gloo abort its partners
        # (std::terminate), while a silent peer makes their collectives time out cleanly. The parent
        # stops this process once the others have recorded their outcome.
        (Path(outdir) / f"rank{rank}.failed").touch()
        while True:
            time.sleep(1.0)
    dist.destroy_process_group()


PORT_ATTEMPTS = 3  # a free port can be taken by someone else before rank 0 binds it


class _PortTaken(Exception):
    pass


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, deadline_s: float = 300.0,
              collective_timeout_s: float = 60.0, threads: int = 1) -> list[Any]:
    """Run `fn(rank, world, *args)` on `world` gloo ranks; return the results in rank order.

    `threads` is torch's per-rank thread count; single-process comparisons must use the same."""
    if world < 1:
        raise CanzonaError(f"world size must be >= 1, got {world}")
    for _ in range(PORT_ATTEMPTS):
        try:
            return _run_once(fn, world, args, deadline_s, collective_timeout_s, threads)
        except _PortTaken:
            continue
    raise CanzonaError(f"could not get a free port for the process group in {PORT_ATTEMPTS} attempts")


def _run_once(fn: Callable[..., Any], world: int, args: tuple, deadline_s: float,
              collective_timeout_s: float, threads: int) -> list[Any]:
    with tempfile.TemporaryDirectory(prefix="canzona-ranks-") as outdir:
        ctx = mp.start_processes(_worker, args=(world, free_port(), outdir, collective_timeout_s, threads, fn, args),
                                 nprocs=world, join=False, start_method="spawn")
        end = time.monotonic() + deadline_s
        grace_end: float | None = None
        exited: str | None = None
        try:
            while not ctx.join(timeout=0.25):
                now = time.monotonic()
                if now > end:
                    raise CanzonaError(f"ranks did not finish within {deadline_s:g} s (a hang?)")
                failed = [r for r in range(world) if (Path(outdir) / f"rank{r}.failed").exists()]
                if failed and grace_end is None:
                    # the others' collectives fail within their timeout: let them record why
                    grace_end = min(end, now + collective_timeout_s + 5.0)
                settled = all((Path(outdir) / f"rank{r}.pt").exists() for r in range(world))
                if grace_end is not None and (settled or now > grace_end):
                    break
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            exited = str(e).strip().splitlines()[-1]
            grace_end = min(end, time.monotonic() + collective_timeout_s + 5.0)
            for p in ctx.processes:
                p.join(timeout=max(0.0, grace_end - time.monotonic()))
        finally:
            killed = {r for r, p in enumerate(ctx.processes) if p.is_alive()}
            for r in killed:
                ctx.processes[r].terminate()
        records = [_read(Path(outdir) / f"rank{rank}.pt") for rank in range(world)]
    if any(r is not None and r.get("port_taken") for r in records):
        raise _PortTaken()
    died = [r for r, record in enumerate(records) if record is None and r not in killed]
    if died:  # a rank that died on its own explains its peers' failures
        status = ", ".join(f"rank {r} ({_exit_status(ctx.processes[r].exitcode)})" for r in died)
        raise CanzonaError(f"{status} died without a result{f': {exited}' if exited else ''}")
    failed = [(r.get("at", 0.0), rank) for rank, r in enumerate(records) if r is not None and not r["ok"]]
    if failed:  # so does the first rank that raised (its peers' collectives lost a partner)
        _, rank = min(failed)
        raise RankError(rank, records[rank]["error"], records[rank]["trace"])
    if killed:
        raise CanzonaError(f"rank(s) {sorted(killed)} were stopped without a result")
    return [r["result"] for r in records]


def _save(record: dict, path: Path) -> None:
    """Write atomically: the parent may stop this process at any moment."""
    tmp = path.with_suffix(".tmp")
    torch.save(record, tmp)
    os.replace(tmp, path)


def _exit_status(code: int | None) -> str:
    if code is None:
        return "still running"
    return f"signal {-code}" if code < 0 else f"exit code {code}"


def _read(path: Path) -> dict | None:
    return torch.load(path, weights_only=False) if path.exists() else None


class RankError(CanzonaError):
    """A rank raised: the first line says which and what; `trace` keeps the remote traceback."""

    def __init__(self, rank: int, error: str, trace: str):
        super().__init__(f"rank {rank}: {error.splitlines()[0] if error else 'failed'}")
        self.rank = rank
        self.trace = trace

