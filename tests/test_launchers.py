"""The tests start ranks without a race for a port (`tests/launchers.py`): `make test` runs two
spawned test files at a time, and a port picked free, closed and handed to a launcher can be
taken by the other file's ranks first (EADDRINUSE, seen once in `.ci/run`)."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
# a port handed to a launcher or to `env://` by number: what raced
HANDED_OVER = re.compile(r"--master[-_]port|MASTER_PORT['\"]|\.bind\(\(|def _?free_port|tcp://|--rdzv[-_]endpoint"
                         r"|main_process_port")


def test_no_test_hands_a_port_over_by_number():
    """The tests, and the examples and benchmarks they run, start no ranks on a port by number."""
    this = {TESTS / "launchers.py", Path(__file__).resolve()}
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for folder in ("tests", "examples", "benchmarks") for path in sorted((ROOT / folder).rglob("*.py"))
             if path not in this
             for n, line in enumerate(path.read_text().splitlines(), 1) if HANDED_OVER.search(line)]
    assert not found, "use tests/launchers.py (torchrun_command, agent_store) or a HashStore:\n" + "\n".join(found)


def test_the_launcher_asks_torchrun_for_its_own_port():
    from tests.launchers import torchrun_command

    cmd = torchrun_command(2, "script.py", "--steps", 3)
    assert "--standalone" in cmd and "--master-port" not in cmd and cmd[-3:] == ["script.py", "--steps", "3"]
    assert cmd[cmd.index("--local-addr") + 1] == "127.0.0.1"


def test_the_suite_runs_without_the_variable_that_unshares_torchruns_store():
    import os

    from tests.launchers import UNSHARED_STORE_VAR

    assert UNSHARED_STORE_VAR not in os.environ
