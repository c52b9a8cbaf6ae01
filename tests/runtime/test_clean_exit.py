"""A user's plain DP script exits 0: `DistributedOptimizer` on the tiny model, four steps,
`destroy_process_group()`, return, and the interpreter exits normally (no `os._exit`).

What used to fail (issue 17, finding 13): gloo's worker thread drops its references to a
collective's tensors just after completing it, and dropping the last C++ reference to a tensor
Python has seen takes the GIL. After the last `step()` the main thread can reach interpreter
finalization first; the worker then takes the GIL during `Py_FinalizeEx`, CPython ends the thread
(`pthread_exit`) and the unwind through gloo's noexcept destructor aborts the process (SIGABRT,
"terminate called without an active exception"). `canzona.runtime.comm.Handoff` makes every
collective's `wait()` return only once gloo has let go of its tensors.

Left alone the race hits about one run in four to eight on a 2-core machine. The script here makes
it hit every time on the old code (6 of 6 runs measured): each rank is pinned to one CPU, so the
gloo worker shares it with the main thread, which preempts it when `wait()` wakes it up; and the
GIL switch interval is raised before the last step, so a worker waiting for the GIL gets it only
when the main thread blocks, not after 5 ms. Both only widen the window the race needs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from canzona.harness.launch import run_ranks
from tests.launchers import agent_store

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]  # spawns gloo ranks

ROOT = Path(__file__).resolve().parents[2]
RUNS = 2  # the race hits every run of the old code here (above): two runs miss it with no measured chance
RANKS = 2
RUN_TIMEOUT_S = 90  # one launch; a hang fails the test instead of blocking the suite

SCRIPT = '''
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from canzona.runtime import DistributedOptimizer
from reference.tiny_model import TinyQwen3


def main() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[int(os.environ["RANK"]) % len(cpus)]})  # before gloo's threads start
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    model = TinyQwen3("tiny")
    opt = DistributedOptimizer(model.named_parameters(), model.spec(), timeout_s=60)
    tokens = torch.randint(0, model.cfg.vocab, (4, 2, 16), generator=torch.Generator().manual_seed(rank))
    for step in range(4):
        if step == 3:  # said before, not after: writing to the pipe would hand the GIL over
            print(f"rank {rank} at its last step", flush=True)
        opt.zero_grad()
        model.loss(tokens[step]).backward()
        if step == 3:
            sys.setswitchinterval(100.0)
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''


def launch(script: Path) -> list[tuple[int, str, str]]:
    """One run of `script` on RANKS gloo ranks (started as torchrun would): per rank its exit
    code, stdout and stderr."""
    with agent_store() as store_env:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **store_env, "WORLD_SIZE": str(RANKS)}
        procs = [subprocess.Popen([sys.executable, str(script)], cwd=script.parent, text=True,
                                  env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(RANKS)]
        deadline = time.monotonic() + RUN_TIMEOUT_S
        results = []
        try:
            for p in procs:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                results.append((p.returncode, out, err))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
    return results


def test_a_plain_dp_script_exits_0_every_time(tmp_path):
    script = tmp_path / "plain_dp.py"
    script.write_text(SCRIPT)
    failures = []
    for run in range(RUNS):
        for rank, (code, out, err) in enumerate(launch(script)):
            if code != 0 or f"rank {rank} at its last step" not in out:
                failures.append(f"run {run} rank {rank}: exit code {code}\n{err[-2000:]}")
    assert not failures, f"{len(failures)} rank exits of {RUNS * RANKS} failed:\n" + "\n".join(failures)


def _release_worker(rank: int, world: int) -> dict[str, list[int]]:
    import torch

    from canzona.runtime import DistributedOptimizer
    from reference.tiny_model import TinyQwen3

    seen = {}
    for route in ("exact", "loops"):
        model = TinyQwen3("tiny")
        opt = DistributedOptimizer(model.named_parameters(), model.spec(), reduce_scatter=route)
        tokens = torch.randint(0, model.cfg.vocab, (3, 2, 16), generator=torch.Generator().manual_seed(rank))
        for step in range(3):
            opt.zero_grad()
            model.loss(tokens[step]).backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
        opt.state_dict()  # all_gather_object, over all_gather_values
        seen[route] = [len(opt.comm.log.records), opt.comm.unreleased]
    return seen


def test_every_collective_is_let_go_of_before_its_wait_returns():
    """`Handoff.release` only sees the backend let go of a collective's tensors if nothing else
    holds them or the work handle (a work kept in a local variable while waiting would stall each
    wait for `RELEASE_LIMIT_S` and leave the exit unprotected): none is left over, on either
    reduce-scatter route, in construction, steps, clipping and `state_dict()`."""
    for seen in run_ranks(_release_worker, 2, deadline_s=120):
        for route, (records, unreleased) in seen.items():
            assert records > 0 and unreleased == 0, (route, records, unreleased)


UNWAITED_SAVE = '''
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from canzona.runtime import DistributedOptimizer
from reference.tiny_model import TinyQwen3


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    model = TinyQwen3("tiny")
    opt = DistributedOptimizer(model.named_parameters(), model.spec(), timeout_s=60)
    tokens = torch.randint(0, model.cfg.vocab, (4, 2, 16), generator=torch.Generator().manual_seed(rank))
    saves = dist.new_group(backend="gloo")  # async_save's own group (torchtitan's)
    for step in range(4):
        opt.zero_grad()
        model.loss(tokens[step]).backward()
        opt.step()
        if step == 1:
            state = opt.state_dict()
            torch.save(state, f"at_save{rank}.pt")
            dcp.async_save({"optim": state}, checkpoint_id="ckpt", process_group=saves)  # never waited for


if __name__ == "__main__":
    main()
'''


def _load_unwaited_save(rank: int, world: int, folder: str) -> bool:
    import torch
    import torch.distributed.checkpoint as dcp

    from canzona.runtime import DistributedOptimizer
    from reference.tiny_model import TinyQwen3
    from tests.runtime.test_runtime_habits import _nested_equal

    model = TinyQwen3("tiny")
    opt = DistributedOptimizer(model.named_parameters(), model.spec())
    state = {"optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=f"{folder}/ckpt")
    opt.load_state_dict(state["optim"])
    return _nested_equal(opt.state_dict(), torch.load(f"{folder}/at_save0.pt", weights_only=True))


def test_an_async_save_never_waited_for_is_complete_at_exit_with_the_state_at_the_call(tmp_path):
    """`dcp.async_save` whose future the script drops, two more steps, return: Python joins the
    save's thread at exit, and the folder holds the state when it was called (loaded at DP 1)."""
    script = tmp_path / "unwaited_save.py"
    script.write_text(UNWAITED_SAVE)
    for code, _, err in launch(script):
        assert code == 0, err[-2000:]
    assert run_ranks(_load_unwaited_save, 1, str(tmp_path), deadline_s=120) == [True]
