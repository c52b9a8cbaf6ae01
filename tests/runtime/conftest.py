"""Fixtures shared by the runtime tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank():
    """A one-rank gloo group in this process (an in-memory store: no port to race for)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
