"""The repository's scripts (benchmarks/, examples/) loaded as modules for tests: they are not a
package, and their `__main__` blocks (launcher watches, the benchmarks' runs) must not start."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str, name: str) -> ModuleType:
    """`ROOT / relative` as module `name`, registered in `sys.modules` while it runs (its dataclasses
    look their module up) and not after."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module
