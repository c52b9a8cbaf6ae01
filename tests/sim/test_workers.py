"""`sim.workers.stopping_pool`: interrupted, it leaves nothing running for the interpreter's exit."""

from __future__ import annotations

import time

import pytest

from sim.workers import stopping_pool


def test_an_interrupted_pool_has_ended_its_manager_thread():
    """Python 3.11 wakes the pool's manager thread at exit without the lock that its closing of the
    wake-up pipe takes (gh-125451): a thread still ending then could make the exit print "Exception
    ignored" after the CLI's one line (about 1 run in 14 of `search` under `kill -TERM -PGID`). The
    pool stopped by an exception has ended that thread before the exception goes on."""
    with pytest.raises(KeyboardInterrupt):
        with stopping_pool(2) as pool:
            running = [pool.submit(time.sleep, 30) for _ in range(2)]
            while not all(f.running() for f in running):
                time.sleep(0.01)
            manager = pool._executor_manager_thread  # noqa: SLF001 - the thread the exit would wake
            raise KeyboardInterrupt
    assert not manager.is_alive()
