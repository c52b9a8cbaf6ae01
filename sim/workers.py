"""A process pool that stops at once when its caller is interrupted (Ctrl-C, or SIGTERM, which the
CLI turns into `SystemExit`: `cli.main.main`).

`ProcessPoolExecutor`'s own exit waits for every submitted task, and its interpreter-exit hook for
every running one: `canzona validate --published` submits all its rows at once, so a SIGTERM sent
to it was answered only once every row was simulated. Here an exception leaving the pool's block
cancels the tasks not started and kills the running workers (they hold no file or lock: a run only
returns its result), so the caller unwinds in well under a second.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager

JOIN_S = 5.0  # per killed worker: SIGKILL ends it at once, this only bounds a wedged reap


@contextmanager
def stopping_pool(workers: int) -> Iterator[ProcessPoolExecutor]:
    """A `ProcessPoolExecutor` of `workers` processes, shut down normally (waiting for its tasks)
    when the block ends, and stopped (pending tasks cancelled, workers killed) when it raises."""
    pool = ProcessPoolExecutor(max_workers=workers)
    try:
        yield pool
    except BaseException:
        # the executor keeps no public handle on its workers (Python < 3.14 has no terminate_workers)
        processes = list((getattr(pool, "_processes", None) or {}).values())
        manager = getattr(pool, "_executor_manager_thread", None)  # shutdown drops the executor's handle
        pool.shutdown(wait=False, cancel_futures=True)
        for p in processes:
            p.kill()  # not SIGTERM: a worker inherits the CLI's handler, whose SystemExit its task loop would catch
        for p in processes:
            p.join(JOIN_S)
        if manager is not None:
            # The thread that manages the pool sees its workers gone and closes its wake-up pipe as
            # it ends. Python 3.11 wakes that thread at exit unlocked (gh-125451, fixed in 3.12 and 3.13), so a
            # pipe closed between its check and its write printed "Exception ignored" after the
            # CLI's line: the thread ends here first, and the exit finds the pipe closed.
            manager.join(JOIN_S)
        raise
    pool.shutdown(wait=True)
