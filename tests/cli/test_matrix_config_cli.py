"""`--matrix-config`: DistributedOptimizer's `matrix_config`, with the same name and default, on every
command that plans or prices a matrix step (plan, simulate, compare, search). The simulator prices the
step and the memory at it through the planner; the defaults given are none given, bit for bit; bad
input is one error line before any work."""

from __future__ import annotations

import json

import pytest

import sim.search
import sim.simulate
from canzona.cost import row_state_bytes, state_bytes
from canzona.memory import MemorySetup
from canzona.models import resolve_model, resolve_spec
from canzona.optimizers import config_from_dict
from canzona.plan import PlanSettings, load_plan, plan_for
from sim.fsdp import fsdp_memory_floor
from sim.search import Question, config_of, memory_floor, optimizer_state_floor
from sim.simulate import SimConfig, layer_dims, simulate
from sim.workload import Workload
from tests.cli_helpers import error_line, invoke

SIM = ["--model", "qwen3-0.6b", "--gpus", "8", "--tp", "1", "--seq-len", "128", "--global-batch", "8"]
TEN = '{"ns_steps": 10}'
SMALL = {"max_precond_dim": 1024}  # qwen3-0.6b's 3072-wide MLP sides stop being preconditioned
WORKLOAD = Workload(seq_len=128, global_batch=8, micro_batch=1)


def _simulate_json(*args: str) -> dict:
    result = invoke("simulate", *SIM, "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_more_newton_schulz_steps_lengthen_the_simulated_step():
    base = _simulate_json()
    longer = _simulate_json("--matrix-config", TEN)
    assert longer["matrix_config"] == {"ns_steps": 10} and "matrix_config" not in base
    assert longer["optimizer_step_s"] > 1.3 * base["optimizer_step_s"]
    assert longer["iteration_time_s"] > base["iteration_time_s"]
    # the defaults given are the same run as none given, every figure of it
    for same in ("{}", '{"ns_steps": 5}'):
        assert _simulate_json("--matrix-config", same) == base


def _run(optimizer: str, matrix_config=None, **kw) -> sim.simulate.SimResult:
    return simulate(SimConfig(model="qwen3-0.6b", gpus=8, tp=1, optimizer=optimizer, workload=WORKLOAD,
                              matrix_config=matrix_config, **kw))


def test_soap_memory_follows_max_precond_dim_as_canzona_memory_has_it():
    spec, small = resolve_spec("qwen3-0.6b", 1), config_from_dict("soap", SMALL)
    base, run = _run("soap"), _run("soap", SMALL)
    # canzona's owners hold each matrix's whole state: over the DP ranks, every matrix's once
    for result, cfg in ((base, None), (run, small)):
        assert sum(r.matrix_state for r in result.memory.ranks) == \
            sum(state_bytes("soap", p.shape, cfg) for p in spec.matrix_params())
    assert run.memory.worst.matrix_state < base.memory.worst.matrix_state
    assert run.memory.worst.step_buffers < base.memory.worst.step_buffers  # the eigensolves' workspace
    assert run.optimizer_step_s < base.optimizer_step_s


def test_fsdp_memory_and_the_search_floors_follow_the_config():
    base, run = _run("soap", fsdp=True), _run("soap", SMALL, fsdp=True)
    assert run.memory.worst.matrix_state < base.memory.worst.matrix_state
    model = resolve_spec("qwen3-0.6b", 1), resolve_model("qwen3-0.6b")[1]
    dims = layer_dims(model[1], model[0])
    fsdp = [SimConfig(model="qwen3-0.6b", gpus=8, tp=1, optimizer="soap", workload=WORKLOAD, fsdp=True,
                      matrix_config=mc) for mc in (None, SMALL)]
    assert fsdp_memory_floor(fsdp[1], model, dims) < fsdp_memory_floor(fsdp[0], model, dims)
    # the search's memory prune: the question's layouts carry the config, and the floor's row state is
    # its (Shampoo without grafting keeps no per-element moments beside its Kronecker factors)
    nograft = {"grafting": False}
    q = [Question(model="qwen3-0.6b", gpus=8, optimizer="shampoo", matrix_config=mc) for mc in (None, nograft)]
    layout = {"tp": 1, "pp": 1, "vp": 1, "cp": 1, "ep": 1, "dp": 8, "micro_batch": 1, "recompute": "none"}
    cfgs = [config_of(x, layout) for x in q]
    assert cfgs[1].matrix_config == config_from_dict("shampoo", nograft) and cfgs[0].matrix_config is None
    moments = sum(row_state_bytes("shampoo", p.shape) for p in model[0].matrix_params())
    assert moments > 0
    assert optimizer_state_floor(model[0], "shampoo", MemorySetup()) - \
        optimizer_state_floor(model[0], "shampoo", MemorySetup(), config_from_dict("shampoo", nograft)) == moments
    assert memory_floor(cfgs[0], model) - memory_floor(cfgs[1], model) == moments // 8


def test_plan_prices_the_config_as_the_planner_does(tmp_path):
    out = tmp_path / "plan.json"
    result = invoke("plan", "--model", "qwen3-0.6b", "--dp", "4", "--tp", "1", "--matrix-config", TEN, "--out", out)
    assert result.exit_code == 0, result.output
    expected = plan_for(resolve_spec("qwen3-0.6b", 1), 4, 1, "muon", "canzona", PlanSettings(),
                        matrix_config={"ns_steps": 10})
    assert load_plan(out).hash() == expected.hash()
    assert expected.hash() != plan_for(resolve_spec("qwen3-0.6b", 1), 4, 1, "muon", "canzona").hash()


def test_search_and_replay_carry_the_config():
    from cli.main import REPLAY

    cfg = SimConfig(model="qwen3-0.6b", gpus=8, tp=1, workload=WORKLOAD, matrix_config={"ns_steps": 10})
    command = REPLAY.simulate_command(cfg)
    assert "--matrix-config '{\"ns_steps\": 10}'" in command
    q = Question(model="qwen3-0.6b", gpus=8, matrix_config={"ns_steps": 10})
    row = {"dp": 8, "tp": 1, "ep": 1, "dp_policy": "alpha-balanced-reorder", "tp_policy": "tp-sync"}
    assert "--matrix-config '{\"ns_steps\": 10}'" in sim.search.plan_command(q, row)
    # the search's JSON: the question's config as the option takes it, and the best row's commands
    result = invoke("search", "--model", "qwen3-0.6b", "--gpus", "8", "--matrix-config", TEN, "--top", "1",
                    "--workers", "1", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    best = summary["layouts"][0]
    assert summary["matrix_config"] == {"ns_steps": 10}
    assert "--matrix-config '{\"ns_steps\": 10}'" in best["plan_command"]
    assert "--matrix-config '{\"ns_steps\": 10}'" in best["simulate_command"]
    assert "matrix_config={'ns_steps': 10} (DistributedOptimizer's options)" in "; ".join(best["not_in_plan"])


@pytest.fixture
def no_work(monkeypatch):
    """Bad input is refused before anything is planned, simulated or searched."""
    def refuse(*a, **k):
        raise AssertionError("bad input must be rejected before any work")

    for module, name in ((sim.simulate, "simulate"), (sim.simulate, "compare"), (sim.search, "search")):
        monkeypatch.setattr(module, name, refuse)
    import cli.main
    monkeypatch.setattr(cli.main, "make_plan", refuse)


BAD = [
    ("[1]", "JSON object"),
    ("nope", "not valid JSON"),
    ('{"ns_step": 3}', "no hyper-parameter(s) ns_step"),
    ('{"ns_steps": 0}', "ns_steps must be > 0"),
    ('{"ns_dtype": "int8"}', "ns_dtype must be one of"),
    ('{"ns_steps": 3, "ns_steps": 4}', "given twice"),
    # the step is priced kernel by kernel, one per Newton-Schulz iteration: 1e9 of them never finished
    ('{"ns_steps": 1000000000}', "ns_steps must be > 0 and < 1000"),
    ('{"ns_steps": 1e18}', "ns_steps must be > 0 and < 1000"),
]
COMMANDS = {
    "plan": ["--model", "qwen3-0.6b", "--dp", "4", "--tp", "1"],
    "simulate": SIM,
    "compare": SIM,
    "search": ["--model", "qwen3-0.6b", "--gpus", "8"],
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("text", "needle"), BAD)
def test_bad_matrix_config_is_one_error_line(no_work, command, text, needle):
    error_line(invoke(command, *COMMANDS[command], "--matrix-config", text), "--matrix-config", needle)


@pytest.mark.parametrize("command", COMMANDS)
def test_matrix_config_is_refused_with_adamw(no_work, command):
    error_line(invoke(command, *COMMANDS[command], "--optimizer", "adamw", "--matrix-config", "{}"),
               "--matrix-config", "--optimizer adamw")


@pytest.mark.parametrize(("optimizer", "dtype"), [("soap", "bf16"), ("shampoo", "bf16"), ("soap", "fp64")])
def test_a_compute_dtype_the_runtime_does_not_run_is_one_error_line(optimizer, dtype):
    """SOAP's and Shampoo's `compute_dtype`: the runtime computes their step in the wider of fp32
    and the gradients' dtype (`kernels.work_dtype`) whatever the field says, while the cost model
    priced the field: a bf16 SOAP step on a 4096 x 4096 matrix at 0.011 s, 3.0x faster than the
    fp32 one the runtime runs (0.033 s; Shampoo 2.5x), and `canzona simulate` reported it until
    2026-11-30. Now one error line, as the runtime's construction (tests/runtime/test_matrix_config_runtime_plan.py)."""
    given = json.dumps({"compute_dtype": dtype})
    for command in ("plan", "simulate"):
        args = ["--model", "qwen3-0.6b", "--dp", "8", "--tp", "1"] if command == "plan" else SIM
        error_line(invoke(command, *args, "--optimizer", optimizer, "--matrix-config", given),
                   f"{optimizer} compute_dtype must be fp32")
