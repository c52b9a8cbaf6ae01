"""What the expert-parallel tests share: checkpoints saved by the jobs of one spawn, resumed by
another at another layout, and the spawn's outcome replayed by every test that reads it."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import pytest

from canzona.harness.launch import run_ranks
from canzona.harness.training import TrainSpec, expert_full_parameters, many_specs_worker


def checkpoint_extras(labels: Sequence[str], saved: Sequence[str], folder: str) -> list[dict]:
    """Each job's `distributed_worker` extras: the saved ones keep their state dict and write a
    sharded checkpoint under `folder`, the others neither."""
    return [{"state_dict": label in saved, **({"save_sharded": os.path.join(folder, label)} if label in saved else {})}
            for label in labels]


def resumed_runs(out: Mapping[str, Any], jobs: Mapping[str, TrainSpec], saved: Sequence[str], folder: str,
                 world: int, key: tuple, deadline_s: float, **changes: Any) -> dict:
    """Every saved job's checkpoint, full and sharded, loaded by `world` ranks (one spawn) running
    its spec with `changes`, 2 steps on other data: `{(*key, job, form): (spec, whole-model
    parameters loaded, the ranks' results)}`."""
    runs = []
    for label in saved:
        params = expert_full_parameters(out[label], jobs[label])
        later = replace(jobs[label], steps=2, data_seed=7, **changes)
        runs += [((*key, label, "full"), later, {"load": (params, out[label][0]["state"]), "state_dict": False}),
                 ((*key, label, "sharded"), later, {"load": (params, os.path.join(folder, label)), "state_dict": False})]
    resumed = run_ranks(many_specs_worker, world, [s for _, s, _ in runs], [e for _, _, e in runs],
                        deadline_s=deadline_s, collective_timeout_s=60)
    return {label: (spec, extra["load"][0], [resumed[r][i] for r in range(world)])
            for i, (label, spec, extra) in enumerate(runs)}


def replay(got: Mapping[Any, Any], label: Any) -> Any:
    """A spawn's result for `label`, or the spawn's failure as this test's."""
    if "error" in got:
        err = got["error"]
        pytest.fail(f"a spawned group failed: {err}\n{getattr(err, 'trace', '')}")
    return got[label]
