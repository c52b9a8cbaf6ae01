"""The runtime's `master_weights` option in the simulator, with its name and default
(`Workload.master_weights`, `canzona simulate --no-master-weights`): without masters the
gradients, the optimizer state that follows the update and the update are in the parameters'
bf16, as DistributedOptimizer(master_weights=False) keeps and moves them (docs/design.md §7.1)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from canzona.errors import SpecError
from canzona.models import resolve_model
from sim.options import RunOptions
from sim.search import Question, memory_floor, not_in_plan
from sim.simulate import SimConfig, simulate
from sim.workload import Workload, grad_bytes_for
from tests.cli_helpers import invoke

MODEL = "qwen3-0.6b"
WORKLOAD = Workload(seq_len=1024, global_batch=8)


def _pair(**config) -> tuple[SimConfig, SimConfig]:
    cfg = SimConfig(model=MODEL, gpus=8, tp=1, workload=WORKLOAD, **config)
    bf16 = replace(cfg.workload, master_weights=False, grad_bytes=grad_bytes_for(None, False))
    return cfg, replace(cfg, workload=bf16)


def _seconds(result, name: str, rank: int = 0) -> float:
    """Seconds rank `rank` spent in spans whose name starts with `name`."""
    return sum(s.end - s.start for s in result.spans if s.rank == rank and s.name.startswith(name))


def test_the_default_is_the_runtimes() -> None:
    """Same name, same default: masters on, and without them the gradients in the parameters' dtype."""
    import inspect

    from canzona.runtime import DistributedOptimizer

    assert inspect.signature(DistributedOptimizer.__init__).parameters["master_weights"].default is True
    assert Workload.master_weights is True
    assert (grad_bytes_for(None), grad_bytes_for(None, False), grad_bytes_for(True, False)) == (4, 2, 4)


def test_zero1_without_masters_is_the_setup_the_runtime_allocates_and_halves_its_bytes() -> None:
    """The simulator's memory setup is the one tests/runtime/test_memory_runtime.py holds to what
    DistributedOptimizer(master_weights=False) allocates (no masters, 2-byte gradients); Muon's
    momentum is kept in bf16, the gradient buffers too, the weights are unchanged."""
    cfg, bf16 = _pair()
    arch = resolve_model(MODEL)[1]
    setup = bf16.memory_setup(arch)
    assert (setup.master_weights, setup.grad_bytes, setup.master_bytes, setup.update_bytes) == (False, 2, 0, 2)
    a, b = simulate(cfg), simulate(bf16)
    wa, wb = a.memory.worst, b.memory.worst
    assert wa.master_weights > 0 and wb.master_weights == 0
    assert wb.grads * 2 == wa.grads and wb.weights == wa.weights
    assert wb.matrix_state * 2 == wa.matrix_state  # Muon's momentum follows the update
    assert wb.adamw_state * 2 == wa.adamw_state
    # the reduce-scatters carry half the bytes (as the runtime issues them, canzona.step_collectives)
    runtime = RunOptions(collectives="runtime")
    ra, rb = simulate(replace(cfg, options=runtime)), simulate(replace(bf16, options=runtime))
    assert 0 < _seconds(rb, "bucket ") < _seconds(ra, "bucket ")


def test_adamw_without_masters_moves_half_the_bytes() -> None:
    """AdamW's pass reads and writes bf16 parameters, gradients and moments: half fp32's bytes."""
    cfg, bf16 = _pair(optimizer="adamw")
    a, b = simulate(cfg), simulate(bf16)
    assert 0 < _seconds(b, "adamw step") < _seconds(a, "adamw step")
    assert b.memory.worst.adamw_state * 2 == a.memory.worst.adamw_state


def test_fsdp_muon_without_masters_keeps_bf16_shards_and_momentum() -> None:
    """canzona's FSDP optimizer without masters: the parameters are the bf16 shards, Muon's
    momentum bf16; the exchanged gradients and updates bf16, so the step is shorter."""
    cfg, bf16 = _pair(fsdp=True)
    a, b = simulate(cfg), simulate(bf16)
    wa, wb = a.memory.worst, b.memory.worst
    assert wa.weights == 0 and wa.master_weights > 0 and wb.master_weights == 0
    assert wb.weights * 2 == wa.master_weights
    assert 0 < wb.matrix_state and wb.matrix_state * 2 == wa.matrix_state
    assert 0 < b.optimizer_step_s < a.optimizer_step_s


@pytest.mark.parametrize("fsdp", [False, True])
@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_the_search_floor_stays_below_the_run_without_masters(fsdp: bool, optimizer: str) -> None:
    """The search prunes by a floor that must not exceed the run: without masters its state and
    gradients shrink as the run's do."""
    _, bf16 = _pair(fsdp=fsdp, optimizer=optimizer)
    assert memory_floor(bf16, resolve_model(MODEL)) <= simulate(bf16).memory.worst.total


def test_the_deploy_instructions_say_it() -> None:
    """The search's launch lines for a question without masters name the runtime's option."""
    q = Question(model=MODEL, gpus=8, seq_len=1024, global_batch=8, master_weights=False)
    row = {"tp": 1, "pp": 1, "vp": 1, "cp": 1, "ep": 1, "etp": 1, "dp": 8, "micro_batch": 1, "recompute": "none",
           "policy": "canzona", "reduce_scatter": "native", "fell_back_to": None, "pipeline_split": "even"}
    lines = not_in_plan(row, q)
    assert any("master_weights=False" in line for line in lines)


def test_the_cli_simulates_it() -> None:
    base = ("simulate", "--model", MODEL, "--gpus", 8, "--tp", 1, "--seq-len", 1024, "--global-batch", 8, "--json")
    on, off = (json.loads(invoke(*base, *extra).stdout)["memory"]["worst"] for extra in ((), ("--no-master-weights",)))
    assert off["master_weights"] == 0 < on["master_weights"] and off["grads"] * 2 == on["grads"]


@pytest.mark.parametrize("master_weights", [False, True])
def test_the_fsdp_search_floor_stays_below_a_moe_run(master_weights: bool) -> None:
    """Under --fsdp at EP 1 a MoE's expert stacks keep AdamW's state (`fsdp_persistent_memory` reads
    the stacks, not their matrices): the floor counted a whole-matrix optimizer's state of every
    expert matrix, twice the run's bytes, and pruned layouts that fit. Such a run is refused now (the
    runtime's FsdpOptimizer steps no stacks with a whole-matrix optimizer); AdamW's is the one run."""
    model = "qwen3-30b-a3b"
    wl = Workload(seq_len=1024, global_batch=32, master_weights=master_weights,
                  grad_bytes=grad_bytes_for(None, master_weights))
    cfg = SimConfig(model=model, gpus=16, tp=1, fsdp=True, optimizer="adamw", workload=wl)
    assert memory_floor(cfg, resolve_model(model)) <= simulate(cfg).memory.worst.total
    for optimizer in ("soap", "shampoo"):
        with pytest.raises(SpecError, match="over stacked experts is not run under FSDP2"):
            simulate(replace(cfg, optimizer=optimizer, policy="canzona"))


def test_fsdp_applies_the_updates_in_bf16_without_masters() -> None:
    """FsdpOptimizer without masters applies its bf16 updates to the bf16 shards: the apply pass
    moves half the bytes (it was priced in fp32 whatever the masters, unlike ZeRO-1's)."""
    cfg, bf16 = _pair(fsdp=True)
    a, b = simulate(cfg), simulate(bf16)
    assert 0 < _seconds(b, "group 0 apply") < _seconds(a, "group 0 apply")


# Bytes an element of a matrix's step moves less without masters, counted from the runtime's kernels
# (canzona/runtime/kernels.py, normuon.py) with bf16 parameters, gradients and update-following state:
# Muon's momentum pass (momentum buffer read, written and read again, gradient read twice, Nesterov
# blend written: 6 x 2 bytes), the normalisation's read of that blend (2) and the apply's read and
# write of the parameter (2 x 2): 18; NorMuon's own passes run on the fp32 update, so 18 as Muon;
# SOAP's rotated Adam reads the gradient (2) and reads and writes the parameter (2 x 2), its moments
# fp32: 6; Shampoo's grafting reads the gradient (2) and its apply reads and writes the parameter
# (2 x 2): 6.
SAVED_BYTES = {"muon": 18, "normuon": 18, "soap": 6, "shampoo": 6}


@pytest.mark.parametrize("optimizer", sorted(SAVED_BYTES))
def test_a_matrix_step_moves_bf16_without_masters_and_the_plans_fp32_with(optimizer: str) -> None:
    """The step's own elementwise passes at the run's dtypes (`MemorySetup.step_dtypes`): without
    masters each element moves `SAVED_BYTES` fewer bytes, nothing else changes (GEMMs, solvers,
    FLOPs); with masters (and for fp32 parameters) every kernel is the planner's."""
    from canzona.cost import optimizer_kernels
    from canzona.memory import MemorySetup

    shape = (384, 1024)
    planned = optimizer_kernels(optimizer, shape)
    for fp32 in (MemorySetup(), MemorySetup(param_bytes=4, grad_bytes=4, master_weights=False)):
        assert optimizer_kernels(optimizer, shape, dtypes=fp32.step_dtypes) == planned
    bf16 = MemorySetup(grad_bytes=2, master_weights=False).step_dtypes
    kernels = optimizer_kernels(optimizer, shape, dtypes=bf16)
    assert [(k.name, k.kind, k.flops, k.count) for k in kernels] == [(k.name, k.kind, k.flops, k.count) for k in planned]
    assert all(a.bytes == b.bytes for a, b in zip(kernels, planned) if a.kind != "elementwise")
    saved = sum(a.bytes * a.count for a in planned) - sum(b.bytes * b.count for b in kernels)
    assert saved == SAVED_BYTES[optimizer] * shape[0] * shape[1]


@pytest.mark.parametrize("optimizer", ["muon", "soap"])
def test_zero1_prices_the_matrix_steps_kernels_at_bf16_without_masters(optimizer: str) -> None:
    """Same plan (its per-matrix seconds are the planner's, priced at fp32 as `canzona plan` and the
    runtime's own plan price them), but the simulated step runs each matrix's elementwise passes on
    bf16: rank 0's matrix compute is shorter by the bytes they no longer move (`SAVED_BYTES`) at the
    bandwidth a streaming kernel reaches, and with masters it is the plan's seconds."""
    from canzona.hardware import load_profile

    unbatched = RunOptions(batch_kernels=False)  # each matrix alone: its compute is its plan seconds
    cfg, bf16 = _pair(optimizer=optimizer, options=unbatched)
    a, b = simulate(cfg), simulate(bf16)
    assert a.plan == b.plan
    spec = resolve_model(MODEL)[0]
    mine = [(n, c) for g in a.plan.tp_plan.groups[0] for n, c in zip(g.tasks, g.costs)]
    gpu = load_profile(cfg.hardware).gpu
    saved = SAVED_BYTES[optimizer] * sum(spec.param(n).numel for n, _ in mine) / (gpu.hbm_bytes_per_s * gpu.hbm_efficiency)

    def matrices(result) -> float:
        return sum(s.end - s.start for s in result.spans
                   if s.rank == 0 and s.name.startswith("group ") and s.name.endswith(" compute"))

    assert matrices(a) == pytest.approx(sum(c for _, c in mine), rel=1e-9)
    assert saved > 0 and matrices(a) - matrices(b) == pytest.approx(saved, rel=1e-9)


def test_fsdp_prices_the_matrix_steps_kernels_at_bf16_without_masters() -> None:
    """FsdpOptimizer's matrices too (`sim.fsdp._FsdpRun.compute_seconds`, what each owner's
    compute of a micro-group takes): fewer seconds by Muon's `SAVED_BYTES` an element of its
    matrices, and with masters their plan seconds."""
    from canzona.hardware import load_profile
    from sim.fsdp import _FsdpRun, check_fsdp

    def run(cfg: SimConfig) -> _FsdpRun:
        cluster, model, hw = cfg.checked(None)
        return _FsdpRun(cfg, model, cluster, hw, check_fsdp(cfg, cluster, model[0]))

    cfg, bf16 = _pair(fsdp=True, options=RunOptions(batch_kernels=False))
    a, b = run(cfg), run(bf16)
    gpu = load_profile(cfg.hardware).gpu
    groups = a.micro_groups()
    assert groups and [[m.name for m in g] for g in groups] == [[m.name for m in g] for g in b.micro_groups()]
    for mats in groups:
        saved = SAVED_BYTES["muon"] * sum(m.numel for m in mats) / (gpu.hbm_bytes_per_s * gpu.hbm_efficiency)
        assert a.compute_seconds(mats) == sum(m.cost for m in mats)
        assert a.compute_seconds(mats) - b.compute_seconds(mats) == pytest.approx(saved, rel=1e-9)
