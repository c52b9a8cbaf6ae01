"""AdamW on every parameter (`--optimizer adamw`, policy `zero1`): the run users have today, as
Megatron's distributed optimizer runs it, in plan, simulate, compare, the memory model and the
runtime, so that a matrix optimizer can be priced against it.

The DP and DP x TP runtime is bit for bit the same kernels in one process in
`tests/runtime/test_runtime_equivalence.py` and `tests/runtime/test_runtime_tp.py` (with its
collective logs in `tests/policy/test_step_collectives.py`); here: the policy core, the CLI, and
checkpoints of its pieces across DP sizes (layout-independent and `torch.distributed.checkpoint`).
"""

from __future__ import annotations

import functools
import json

import pytest

from canzona.errors import SpecError
from canzona.models import resolve_model
from canzona.optimizers import MATRIX_OPTIMIZERS, MATRIX_REGISTRY, OPTIMIZERS
from canzona.plan import plan_for
from canzona.step_policies import STEP_POLICIES, default_policy, get_step_policy, policy_optimizer
from sim.simulate import SimConfig, compare, compared_policies, simulate
from sim.workload import Workload
from tests.cli_helpers import error_line
from tests.cli_helpers import invoke as invoke_cli

SMALL = SimConfig(model="qwen3-0.6b", gpus=16, tp=2, workload=Workload(512, 16))


# --- the policy core ----------------------------------------------------------------------------


def test_adamw_is_one_elementwise_registry_entry_with_its_own_policy():
    entry = MATRIX_REGISTRY["adamw"]
    assert entry.elementwise and not entry.batchable
    assert "adamw" in OPTIMIZERS and "adamw" not in MATRIX_OPTIMIZERS
    assert [n for n, p in STEP_POLICIES.items() if p.elementwise] == ["zero1"]
    assert default_policy("adamw") == "zero1" and default_policy("muon") == "canzona"
    assert policy_optimizer("zero1", "muon") == "adamw" and policy_optimizer("canzona", "muon") == "muon"
    zero1 = get_step_policy("zero1")
    assert zero1.dp_policy == "zero1-even" and zero1.grad_sync == "reduce-scatter"
    assert not zero1.gather_split and not zero1.can_overlap_step


@pytest.mark.parametrize("policy,optimizer", [("canzona", "adamw"), ("layerwise", "adamw"), ("zero1", "muon")])
def test_a_policy_refuses_the_other_kind_of_optimizer_in_one_line(policy, optimizer):
    spec, _ = resolve_model("qwen3-0.6b", 2)
    with pytest.raises(SpecError) as e:
        plan_for(spec, 4, 2, optimizer, policy)
    assert f"policy {policy} runs" in str(e.value) and "\n" not in str(e.value)


def test_the_plan_has_even_segments_and_no_matrix_computed_whole():
    spec, _ = resolve_model("qwen3-0.6b", 2)
    plan = plan_for(spec, 4, 2, "adamw", "zero1")
    assert plan.dp_plan.policy == "zero1-even" and plan.dp_plan.split_compute
    assert all(len(set(b.segment_lengths())) == 1 for b in plan.dp_plan.buckets)
    assert all(rank == () for rank in plan.tp_plan.groups)
    # every matrix element is in exactly one rank's pieces
    for b in plan.dp_plan.buckets:
        pieces = [e - s for r in range(4) for _, s, e in b.pieces(r)]
        assert sum(pieces) == sum(p.numel for p in b.params)


def test_the_plan_prices_each_rank_s_pieces_not_whole_matrices():
    """AdamW's ranks update their pieces where they lie: nothing is fetched beyond a segment,
    nothing computed twice, and the work splits evenly (the whole-matrix metrics of the same
    zero1-even plan count every matrix on each rank that holds part of it)."""
    spec, _ = resolve_model("qwen3-0.6b", 2)
    plan = plan_for(spec, 4, 2, "adamw", "zero1")
    m, whole = plan.dp_metrics, plan.dp_plan.metrics
    assert m is plan.dp_plan.piece_metrics
    assert m.extra_comm_elements == 0 and m.redundant_s == 0 and m.atomicity_violations == 0
    assert whole.redundant_s > 0 and whole.extra_comm_elements > 0
    assert sum(m.rank_loads) == pytest.approx(m.total) and m.total == pytest.approx(whole.total)
    assert m.lower_bound == pytest.approx(m.total / 4) and m.imbalance < 1.1
    states = sum(p.state_bytes for p in plan.dp_plan.placements())
    assert states - len(plan.dp_plan.placements()) * 4 <= sum(m.rank_state_bytes) <= states
    assert plan.optimizer_compute_s == pytest.approx(m.makespan / 2) and m.makespan > 0  # a TP group shares each piece
    summary = plan.summary()
    assert summary["tp"]["capacity"] is None and summary["tp"]["groups"] == 0
    assert summary["tp"]["optimizer_compute_s"] == plan.optimizer_compute_s
    muon = plan_for(spec, 4, 2, "muon", "canzona")
    assert muon.dp_metrics is muon.dp_plan.metrics
    assert muon.optimizer_compute_s == muon.tp_plan.metrics.makespan


def test_cli_plan_shows_only_what_runs_adamw():
    """The plan table of an elementwise optimizer lists the DP plans its step policies run, with
    no atomicity and no TP schedule (nothing is computed whole)."""
    out = invoke_cli("plan", "--model", "qwen3-0.6b", "--dp", "4", "--tp", "2", "--optimizer", "adamw")
    assert out.exit_code == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("│")]
    assert len(rows) == 1 and "zero1-even" in rows[0] and " - " in rows[0]
    assert "TP policies" not in out.stdout and "updates its pieces in place" in out.stdout
    muon = invoke_cli("plan", "--model", "qwen3-0.6b", "--dp", "4", "--tp", "2")
    assert "TP policies" in muon.stdout and "alpha-balanced" in muon.stdout


# --- the simulator and the CLI ------------------------------------------------------------------


def test_simulate_defaults_adamw_to_zero1_and_prices_its_pieces():
    r = simulate(SimConfig(model=SMALL.model, gpus=SMALL.gpus, tp=SMALL.tp, optimizer="adamw",
                           workload=SMALL.workload))
    assert r.config.policy == "zero1" and r.plan.dp_plan.policy == "zero1-even"
    assert r.memory.worst.matrix_state == 0 and r.memory.worst.adamw_state > 0
    steps = [s for s in r.spans if s.name == "adamw step"]
    assert {s.rank for s in steps} == set(range(SMALL.gpus))  # every rank updates its pieces
    muon = simulate(SMALL)
    assert r.optimizer_step_s < muon.optimizer_step_s


def test_compare_puts_the_adamw_row_beside_the_matrix_policies():
    assert compared_policies("muon") == tuple(STEP_POLICIES)
    assert compared_policies("adamw") == ("zero1",)
    rows = compare(SMALL)
    assert [(r.config.policy, r.config.optimizer) for r in rows] == \
        [("sc", "muon"), ("zero1-gather", "muon"), ("layerwise", "muon"), ("canzona", "muon"), ("zero1", "adamw")]


def test_cli_plan_simulate_and_compare_take_adamw():
    plan = invoke_cli("plan", "--model", "qwen3-0.6b", "--dp", "4", "--tp", "2", "--optimizer", "adamw", "--json")
    assert plan.exit_code == 0, plan.stderr
    assert json.loads(plan.stdout)["dp"]["policy"] == "zero1-even"
    sim = invoke_cli("simulate", "--model", "qwen3-0.6b", "--gpus", "16", "--tp", "2", "--optimizer", "adamw",
                     "--seq-len", "512", "--global-batch", "16", "--json")
    assert sim.exit_code == 0, sim.stderr
    assert json.loads(sim.stdout)["policy"] == "zero1"
    error_line(invoke_cli("simulate", "--optimizer", "adamw", "--policy", "canzona"), "policy canzona runs")


def test_zero1_gather_with_adamw_is_zero1_in_the_simulator_and_the_runtime():
    """AdamW needs no whole matrix: zero1-gather's gather has nothing to fetch, so the published
    runs' command (`--optimizer adamw --policy zero1-gather`) runs Megatron's distributed
    optimizer, as the runtime does; the whole-matrix policies still refuse AdamW."""
    from canzona.step_policies import resolve_policy

    assert resolve_policy("zero1-gather", "adamw") == "zero1"
    assert resolve_policy("zero1-gather", "muon") == "zero1-gather"
    assert resolve_policy(None, "adamw") == "zero1" and resolve_policy("canzona", "adamw") == "canzona"
    args = ("simulate", "--model", "qwen3-0.6b", "--gpus", "16", "--tp", "2", "--optimizer", "adamw",
            "--seq-len", "512", "--global-batch", "16", "--json")
    gather, zero1 = invoke_cli(*args, "--policy", "zero1-gather"), invoke_cli(*args, "--policy", "zero1")
    assert gather.exit_code == 0, gather.stderr
    assert json.loads(gather.stdout)["policy"] == "zero1"
    assert json.loads(gather.stdout)["iteration_time_s"] == json.loads(zero1.stdout)["iteration_time_s"]
    error_line(invoke_cli(*args, "--policy", "layerwise"), "policy layerwise runs")


def test_the_runtime_refuses_a_matrix_config_for_adamw_before_any_collective():
    import torch

    from canzona.runtime.optimizer import DistributedOptimizer
    from reference.tiny_model import TinyQwen3

    model = TinyQwen3("tiny", seed=0)
    with pytest.raises(SpecError, match="adamw_config"):
        DistributedOptimizer(model.named_parameters(), model.spec(), "adamw", matrix_config={"lr": 1.0})
    with pytest.raises(SpecError, match="policy canzona runs whole-matrix optimizers"):
        DistributedOptimizer(model.named_parameters(), model.spec(), "adamw", policy="canzona")
    # zero1-gather is resolved to zero1: every local check passes, and only the missing process group stops it
    with pytest.raises(ValueError, match="process group"):
        DistributedOptimizer(model.named_parameters(), model.spec(), "adamw", policy="zero1-gather")
    assert torch.distributed.is_available() and not torch.distributed.is_initialized()


# --- checkpoints of the pieces, across DP sizes ------------------------------------------------

STEPS = 3


def _spec(steps: int = STEPS, data_seed: int = 1):
    from canzona.harness.training import TrainSpec

    return TrainSpec(optimizer="adamw", steps=steps, global_batch=12, seq_len=16, bucket_size=16384,
                     data_seed=data_seed)


def _run(dp: int, jobs: list[tuple[str, object, dict]]) -> dict:
    from canzona.harness.launch import run_ranks
    from canzona.harness.training import many_specs_worker

    results = run_ranks(many_specs_worker, dp, [s for _, s, _ in jobs], [e for _, _, e in jobs], deadline_s=180.0,
                        collective_timeout_s=60)
    return {label: [results[r][i] for r in range(dp)] for i, (label, _, _) in enumerate(jobs)}


@functools.cache
def _chain(folder: str) -> dict:
    """DP 4 saves a state dict; DP 2 saves a sharded checkpoint; DP 3 loads both, round-trips each
    and resumes from each."""
    saved4 = _run(4, [("save", _spec(), {})])["save"]
    saved2 = _run(2, [("save", _spec(), {"save_sharded": folder, "state_dict": True})])["save"]
    ckpt4 = (saved4[0]["params"], saved4[0]["state"])
    ckpt2 = (saved2[0]["params"], folder)
    loaded = _run(3, [("resume 4", _spec(2, 7), {"load": ckpt4}), ("round trip 4", _spec(0), {"load": ckpt4}),
                      ("resume 2", _spec(2, 7), {"load": ckpt2}), ("round trip 2", _spec(0), {"load": ckpt2})])
    return {"saved4": saved4, "saved2": saved2, **loaded}


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict:
    return _chain(str(tmp_path_factory.mktemp("adamw-dcp")))


def _nested_equal(a, b) -> None:
    import torch

    if isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            _nested_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _nested_equal(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    else:
        assert a == b


@pytest.mark.distributed
def test_adamw_checkpoints_load_at_another_dp_size_bit_for_bit(chain):
    from canzona.harness.training import compare as compare_params
    from canzona.harness.training import emulate

    saved4, saved2 = chain["saved4"], chain["saved2"]
    assert compare_params(saved4[0]["params"], emulate(_spec(), 4))["bit_identical"]
    for source, saved in (("4", saved4), ("2", saved2)):
        for res in chain[f"round trip {source}"]:  # load at DP 3, save: the same state
            _nested_equal(res["state"], saved[0]["state"])
        want = emulate(_spec(2, 7), 3, load=(saved[0]["params"], saved[0]["state"]))
        for r, res in enumerate(chain[f"resume {source}"]):
            assert compare_params(res["params"], want)["bit_identical"], (source, r)
