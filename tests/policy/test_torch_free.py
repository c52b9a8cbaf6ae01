"""The policy core, the simulator and the planning / simulating CLI run without torch installed
(docs/architecture.md: policy code does not import torch, so the simulator runs without it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# `sys.modules["torch"] = None` makes every `import torch` raise ImportError, as on a machine without it.
SCRIPT = textwrap.dedent("""
    import importlib, pkgutil, sys
    sys.modules["torch"] = None
    import canzona, sim
    names = [m.name for m in pkgutil.walk_packages(canzona.__path__, "canzona.")
             if not m.name.startswith(("canzona.runtime", "canzona.integrations", "canzona.harness"))]
    import canzona.harness.verify  # the harness's limits load without torch (the CLI reads them)
    names += [m.name for m in pkgutil.walk_packages(sim.__path__, "sim.")]
    for name in names:
        importlib.import_module(name)

    from canzona.catalog import get_model
    from canzona.plan import make_plan
    from sim.simulate import SimConfig, simulate
    from sim.workload import Workload

    plan = make_plan(get_model("qwen3-0.6b", 2), 4, 2, "soap", "alpha-balanced-reorder")
    assert plan.dp_plan.metrics.atomic
    result = simulate(SimConfig(model="qwen3-0.6b", gpus=16, tp=2, workload=Workload(1024, 16, 1)))
    assert result.iteration_time_s > result.optimizer_step_s > 0

    from cli.main import app
    for args in (["plan", "--model", "qwen3-0.6b", "--dp", "4", "--tp", "2", "--json"],
                 ["simulate", "--model", "qwen3-0.6b", "--gpus", "16", "--tp", "2", "--seq-len", "1024",
                  "--global-batch", "16", "--json"]):
        try:
            app(args)
        except SystemExit as e:
            assert e.code in (0, None), (args, e.code)
    print("imported", len(names), "modules without torch")
""")


def test_policy_core_simulator_and_cli_work_without_torch():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "without torch" in done.stdout
