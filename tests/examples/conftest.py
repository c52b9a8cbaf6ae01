"""Fixtures the example scripts' tests share."""

from __future__ import annotations

import pytest

from tests.scripts import load_script


@pytest.fixture(scope="module")
def train_script():
    """examples/train.py as a module (its launcher watch starts only as __main__)."""
    return load_script("examples/train.py", "examples_train")
