"""How tests start ranks as a user does (torchrun, or processes given torchrun's environment)
without a race for a free port.

Asking the system for a free port, closing it and handing its number to a launcher races: two
tests running side by side (`make test`'s spawned tests) can be given the same port, or the other
test's processes can take it before the launcher binds it (EADDRINUSE). Here the port is the one a
listening socket holds: torchrun `--standalone` binds its rendezvous store to port 0 and passes the
port the system chose to its ranks; `agent_store` does the same for processes started by hand."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
# torchrun on one node: its store on a port the system picks as it binds it (`--standalone`), the
# ranks told this host by address (by default the host's FQDN, which need not resolve to it)
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr", HOST)
# set, torchrun hands its ranks a port picked free and closed again (`RendezvousStoreInfo.build`):
# the race; tests/conftest.py removes it from the suite's environment, which every launch inherits
UNSHARED_STORE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def torchrun_command(ranks: int, *args: object) -> list[str]:
    """`torchrun --standalone --nproc-per-node RANKS ARGS...` (a script or `-m module`, then its arguments)."""
    return [*TORCHRUN, "--nproc-per-node", str(ranks), *map(str, args)]


ROOT = Path(__file__).resolve().parents[1]


def driver_results(ranks: int, driver: str | os.PathLike, folder: Path, timeout: float) -> list[dict[str, Any]]:
    """Run a scenario driver under torchrun in `folder` (this checkout first on the ranks' path, one
    thread each) and return what each rank saved as `rank<r>.pt`: one dict of scenario results."""
    import torch

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(torchrun_command(ranks, driver, folder), cwd=folder, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(ranks)]


def scenario(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """Each rank's result of scenario `name`; a scenario that ended in an error fails the test with it."""
    results = [r[name] for r in ranks]
    for r in results:
        assert "error" not in r, r["error"] + "\n" + r["trace"]
    return results


@contextmanager
def agent_store() -> Iterator[dict[str, str]]:
    """A TCP store listening on a port the system picked, held open for the block, and the
    environment by which ranks started by hand join it as torchrun's ranks join its agent's store
    (`init_process_group` on `env://` then connects to it instead of hosting one on rank 0)."""
    from torch.distributed import TCPStore

    store = TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    try:
        yield {"MASTER_ADDR": HOST, "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    finally:
        del store
