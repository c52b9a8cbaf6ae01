"""How tests start ranks as a user does (torchrun, or processes given torchrun's environment)
without a race for a free port.

Asking the system for a free port, closing it and handing its number to a launcher races: two
tests running side by side (`make test`'s spawned tests) can be given the same port, or the other
test's processes can take it before the launcher binds it (EADDRINUSE). Here the port is the one a
listening socket holds: torchrun `--standalone` binds its rendezvous store to port 0 and passes the
port the system chose to its ranks; `agent_store` does the same for processes started by hand."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

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
