"""Simulating one representative rank per class of identical ranks changes no result: every
configuration of `scale_configs.CONFIGS` gives, bit for bit, the `to_dict()`, the spans (as a set)
and the runtime-mode collective records recorded before the change (tests/sim/data)."""

from __future__ import annotations

import json

import pytest

from sim.simulate import simulate
from tests.sim.scale_configs import CONFIGS, DATA, record

GOLDEN = json.loads(DATA.read_text())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_same_result_as_before(name: str) -> None:
    got = record(simulate(CONFIGS[name]))
    want = GOLDEN[name]
    assert got["result"] == want["result"]  # floats through repr: bit for bit
    assert got["spans"] == want["spans"]
    assert got["records"] == want["records"]
