"""Fixtures of the simulator's tests."""

from __future__ import annotations

import pytest

from sim import simulate as simulate_mod
from sim.engine import Engine


@pytest.fixture
def full_rate_compute(monkeypatch):
    """`simulate` in this test gives compute the GPU's full rate however communication overlaps it
    (an engine without SM sharing, docs/design.md §9.1): for tests of what a plan or schedule
    computes, whose spans must then be the priced seconds."""
    monkeypatch.setattr(simulate_mod, "Engine", lambda **kw: Engine(**{**kw, "sms": 0}))


@pytest.fixture
def leave_out_optimizer_state(monkeypatch):
    """A call that makes the search's memory floor count no masters and no optimizer state, as it
    did before `sim.search.optimizer_state_floor`: for tests whose layouts must pass the floor and
    then not fit, which the floor with them prunes first."""
    from sim import search as search_mod

    return lambda: monkeypatch.setattr(search_mod, "optimizer_state_floor", lambda *_: 0)
