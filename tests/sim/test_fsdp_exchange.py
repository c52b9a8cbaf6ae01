"""The simulator's FSDP all-to-alls (sim.fsdp, phase B) carry the bytes the runtime sends
(`canzona.fsdp_collectives.exchange_bytes`, checked against the runtime's logs in
tests/runtime/test_fsdp_parity.py), less each rank's own piece, at uneven row blocks too."""

from __future__ import annotations

from canzona.fsdp_collectives import exchange_bytes
from canzona.fsdp_plan import FsdpMatrix, shard_numel
from sim.fsdp import _to_owners


def matrix(name: str, shape: tuple[int, int], owner: int) -> FsdpMatrix:
    return FsdpMatrix(name=name, numel=shape[0] * shape[1], shape=shape, cost=1.0, state=0, row_state=0, owner=owner)


def test_the_simulated_exchanges_are_the_runtimes_bytes():
    mats = [matrix("a", (7, 4), 0), matrix("b", (2, 16), 2), matrix("c", (32, 8), 1)]  # 3, 3, 1 and 1, 1, 0 rows
    s = 3
    grads, updates = exchange_bytes(mats, s, 4), exchange_bytes(mats, s, 4, updates=True)
    assert updates == [list(row) for row in zip(*grads)]  # each rank gets back the pieces it sent
    assert grads[2] == [shard_numel((7, 4), s, 2) * 4, shard_numel((32, 8), s, 2) * 4, 0] == [16, 320, 0]
    for sent, priced in ((grads, _to_owners(mats, s, 4)), (updates, _to_owners(mats, s, 4, updates=True))):
        assert priced == [[0.0 if d == r else float(b) for d, b in enumerate(row)] for r, row in enumerate(sent)]
