"""Checkpoints under tensor parallelism reshard exactly (docs/design.md §8.4): a checkpoint taken at
DP 2 x TP 2 loads at DP 1 x TP 4 and one taken at DP 1 x TP 4 loads at DP 2 x TP 2, both as
`state_dict()` (full tensors keyed by name) and through `torch.distributed.checkpoint` (each rank
writes only what it holds); loading and saving again is the identity, and a resumed run continues
bit for bit as the same kernels in one process continue from the checkpoint. The sharded loads
check the weights (`check_weights=True`: the fp32 model's witness, its elements in other TP
shards at the other layout) and are not refused.

Two spawned groups of 4 ranks (the tiny-tp4 preset: TP 4 needs 4 KV heads): the first trains and saves
at both layouts, the second loads each checkpoint at the other layout.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from canzona.harness.launch import run_ranks
from canzona.harness.training import (
    TrainSpec,
    compare,
    emulate,
    expected_shards,
    full_parameters,
    global_gradients_from,
    many_specs_worker,
)
from canzona.runtime.checkpoint import state_by_name

pytestmark = pytest.mark.distributed  # spawns gloo process groups

WORLD = 4
OPTIMIZERS = ("muon", "soap", "shampoo")
MATRIX_CONFIG = {"muon": {"ns_dtype": "fp32"}, "soap": {"precondition_frequency": 2},
                 "shampoo": {"precondition_frequency": 2}}
LAYOUTS = {"dp2xtp2": 2, "dp1xtp4": 4}  # -> tp
OTHER = {"dp2xtp2": "dp1xtp4", "dp1xtp4": "dp2xtp2"}
SAVE_STEPS, RESUME_STEPS = 3, 2


def save_spec(optimizer: str, layout: str) -> TrainSpec:
    # canzona with micro-groups at the first layout; a tp-sync baseline (state on every TP rank) at the other
    policy = ("canzona", "greedy-rollback") if layout == "dp2xtp2" else ("layerwise", "tp-sync")
    return TrainSpec(preset="tiny-tp4", optimizer=optimizer, steps=SAVE_STEPS, global_batch=8, seq_len=16,
                     tp=LAYOUTS[layout], policy=policy[0], tp_policy=policy[1],
                     matrix_config=dict(MATRIX_CONFIG[optimizer]))


def resume_spec(optimizer: str, layout: str, steps: int = RESUME_STEPS) -> TrainSpec:
    """Fresh data (another seed) at the other layout."""
    return replace(save_spec(optimizer, layout), steps=steps, data_seed=7)


def _get(runs: dict, key):
    if "error" in runs:
        err = runs["error"]
        pytest.fail(f"a spawned group failed: {err}\n{getattr(err, 'trace', '')}")
    return runs[key]


def _run(jobs: dict) -> dict:
    try:
        results = run_ranks(many_specs_worker, WORLD, [s for s, _ in jobs.values()],
                            [e for _, e in jobs.values()], deadline_s=300)
    except Exception as e:  # noqa: BLE001 - replayed by every test that needs it
        return {"error": e}
    return {key: [r[i] for r in results] for i, key in enumerate(jobs)}


# Shampoo's save / reshard / resume runs in `make test-all`: Muon and SOAP (state on hosts, eigenbases)
# run in `make test`, each subset in spawns of its own
SLOW_OPTIMIZERS = ("shampoo",)


def _optimizer_param(opt: str):
    return pytest.param(opt, marks=pytest.mark.slow) if opt in SLOW_OPTIMIZERS else opt


@functools.cache
def chain(folder: str, optimizers: tuple[str, ...]) -> tuple[dict, dict]:
    saves = {(opt, layout): (save_spec(opt, layout), {"save_sharded": f"{folder}/{opt}-{layout}"})
             for opt in optimizers for layout in LAYOUTS}
    saved = _run(saves)
    if "error" in saved:
        return saved, saved
    loads = {}
    for opt in optimizers:
        for layout in LAYOUTS:
            results = saved[(opt, layout)]
            params, state = full_parameters(results), results[0]["state"]
            target = OTHER[layout]
            for how, source in (("state_dict", state), ("dcp", f"{folder}/{opt}-{layout}")):
                # the sharded one with check_weights: the weights it was saved with, at another TP size
                load = {"load": (params, source), "check_weights": how == "dcp"}
                loads[("resume", how, opt, layout)] = (resume_spec(opt, target), load)
                loads[("round trip", how, opt, layout)] = (resume_spec(opt, target, steps=0), load)
    return saved, _run(loads)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("tp-dcp"))


@pytest.fixture
def runs(folder, optimizer) -> tuple[dict, dict]:
    subset = SLOW_OPTIMIZERS if optimizer in SLOW_OPTIMIZERS else \
        tuple(o for o in OPTIMIZERS if o not in SLOW_OPTIMIZERS)
    return chain(folder, subset)


def nested_equal(a, b, where: str = "") -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            nested_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


@pytest.mark.parametrize("optimizer", [_optimizer_param(o) for o in OPTIMIZERS])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_state_dict_is_full_and_identical_on_every_rank(runs, optimizer, layout):
    saved, _ = runs
    results = _get(saved, (optimizer, layout))
    state = state_by_name(results[0]["state"])[2]
    params = full_parameters(results)
    for name, s in state.items():
        for key, value in s.items():
            if isinstance(value, torch.Tensor) and key in ("exp_avg", "exp_avg_sq"):
                assert value.shape == params[name].shape, (name, key)  # full tensors, global shapes
    matrices = [n for n in params if params[n].dim() == 2 and "embed" not in n and "lm_head" not in n]
    assert all(state[n] for n in matrices)  # every matrix's state, gathered from its host
    for r in results[1:]:
        nested_equal(r["state"], results[0]["state"])


@pytest.mark.parametrize("how", ["state_dict", "dcp"])
@pytest.mark.parametrize("optimizer", [_optimizer_param(o) for o in OPTIMIZERS])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_at_one_layout_load_at_the_other(runs, how, optimizer, layout):
    saved, loaded = runs
    source = _get(saved, (optimizer, layout))
    # loading and saving again at the other layout gives the same checkpoint, bit for bit
    for r in _get(loaded, ("round trip", how, optimizer, layout)):
        nested_equal(r["state"]["state"], source[0]["state"]["state"], f"rank {r['dp_rank']}.{r['tp_rank']}")
    # and the resumed run continues as the same kernels in one process continue from it
    resumed = _get(loaded, ("resume", how, optimizer, layout))
    spec = resume_spec(optimizer, OTHER[layout])
    want = emulate(spec, spec.dp_size(WORLD), load=(full_parameters(source), source[0]["state"]),
                   grads=global_gradients_from(resumed, spec))
    for r in resumed:
        got = compare(r["params"], expected_shards(want, r["tp_dims"], spec.tp, r["tp_rank"]))
        assert got["bit_identical"], (r["dp_rank"], r["tp_rank"], got)


@pytest.mark.parametrize("optimizer", ["muon"])
def test_each_rank_writes_only_what_it_holds(runs, optimizer, tmp_path_factory):
    import torch.distributed.checkpoint as dcp

    from canzona.runtime.checkpoint import DCP_PREFIX

    saved, _ = runs
    results = _get(saved, ("muon", "dp2xtp2"))
    folder = next(p for p in tmp_path_factory.getbasetemp().rglob("muon-dp2xtp2") if p.is_dir())
    storage = dcp.FileSystemReader(str(folder)).read_metadata().storage_data
    files: dict[str, set[str]] = {}
    for index, info in storage.items():
        if index.fqn.startswith(f"{DCP_PREFIX}/matrix/") and "@" not in index.fqn:
            files.setdefault(info.relative_path, set()).add(index.fqn.split("/")[2])
    hosted = [set(r["hosted"]) for r in results]
    assert len(files) == WORLD  # every rank hosts (and writes) the state of some matrices
    assert not set.intersection(*files.values())  # no matrix state written twice
    assert sorted(map(frozenset, files.values()), key=sorted) == sorted(map(frozenset, hosted), key=sorted)
