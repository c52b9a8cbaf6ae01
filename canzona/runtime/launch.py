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
        try:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world, timeout=timedelta(seconds=timeout_s))
        except Exception as e:  # noqa: BLE001
            if "address already in use" in str(e).lower() or "EADDRINUSE" in str(e):
                torch.save({"ok": False, "port_taken": True, "error": str(e), "trace": ""}, out)
                return
            raise
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        torch.save({"ok": True, "result": result}, out)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        torch.save({"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}, out)


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
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, end - time.monotonic()))):
                if time.monotonic() > end:
                    raise CanzonaError(f"ranks did not finish within {deadline_s:g} s (a hang?)")
        except mp.ProcessRaisedException as e:
            raise CanzonaError(f"a rank failed: {str(e).strip().splitlines()[-1]}") from None
        except mp.ProcessExitedException as e:
            raise CanzonaError(f"a rank died: {e}") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
        records = []
        for rank in range(world):
            path = Path(outdir) / f"rank{rank}.pt"
            if not path.exists():
                raise CanzonaError(f"rank {rank} exited without a result")
            records.append(torch.load(path, weights_only=False))
        if any(r.get("port_taken") for r in records):
            raise _PortTaken()
        results = []
        for rank, record in enumerate(records):
            if not record["ok"]:
                raise RankError(rank, record["error"], record["trace"])
            results.append(record["result"])
        return results


class RankError(CanzonaError):
    """A rank raised: the first line says which and what; `trace` keeps the remote traceback."""

    def __init__(self, rank: int, error: str, trace: str):
        super().__init__(f"rank {rank}: {error.splitlines()[0] if error else 'failed'}")
        self.rank = rank
        self.trace = trace

