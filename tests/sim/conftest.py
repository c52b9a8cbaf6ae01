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
