"""NorMuon through the optimizer registry (issue 19: proving the seam).

- The seam: one registry entry and its own modules; the library names it in at most five files.
- The math: the reference equals an independent implementation written here from the paper's
  algorithm (arXiv 2510.05491, with the authors' rescale to the pre-normalisation norm) to 1e-12 in
  fp64 over several steps, tall and wide, with and without Nesterov, both learning-rate rules; the
  runtime kernel equals the reference bit for bit in fp32 and fp64; after one step every row of
  the normalised update has the same RMS, and its norm is the orthogonalised update's.
- The planner, the simulator, the memory model and the CLI take `--optimizer normuon`.
- The runtime: DP 2 and TP 2 (canzona and a baseline each), bit for bit the same kernels run in
  one process, within 1e-5 of the reference optimizers (one spawn).
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
import torch

import reference
from canzona.cost import state_bytes, step_flops
from canzona.harness.launch import run_ranks
from canzona.harness.training import (
    TrainSpec,
    compare,
    emulate,
    expected_shards,
    global_gradients_from,
    many_specs_worker,
    reference_run,
)
from canzona.memory import kernel_workspace_bytes
from canzona.optimizers import MATRIX_REGISTRY, NorMuonConfig, config_from_dict
from canzona.runtime.kernels import apply_update_, matrix_kernel
from tests.cli_helpers import invoke

ROOT = Path(__file__).resolve().parents[2]
FP64 = replace(NorMuonConfig(), ns_dtype="fp64")

# --- the seam -----------------------------------------------------------------------------------


def test_normuon_is_one_registry_entry_and_its_own_modules():
    entry = MATRIX_REGISTRY["normuon"]
    assert entry.config is NorMuonConfig and entry.part("reference") is reference.NorMuon
    assert not entry.batchable and entry.part("compiled") is None  # optional parts left out
    naming = sorted(str(p.relative_to(ROOT)) for folder in ("canzona", "sim", "cli", "reference")
                    for p in (ROOT / folder).rglob("*.py") if "normuon" in p.read_text().lower())
    assert len(naming) <= 5, naming


def test_its_hyper_parameters_are_checked_like_every_optimizer():
    assert config_from_dict("normuon", {"beta2": 0.9}).beta2 == 0.9
    for bad, message in (({"beta2": 1.0}, "beta2 must be >= 0 and < 1"), ({"normuon_eps": 0.0}, "normuon_eps must be > 0"),
                         ({"ns_dtype": "int8"}, "ns_dtype must be one of")):
        with pytest.raises(ValueError, match=message):
            config_from_dict("normuon", bad)


# --- the math -----------------------------------------------------------------------------------


def independent_step(p, g, buf, v, cfg: NorMuonConfig, lr: float):
    """The paper's algorithm in numpy, float64, row by row: momentum, quintic Newton-Schulz,
    v = beta2 v + (1 - beta2) mean_j O_ij^2, N_ij = O_ij / (sqrt(v_i) + eps), N scaled back to the
    norm of O, then the decoupled decay and Muon's learning-rate rule."""
    buf = cfg.momentum * buf + (1 - cfg.momentum) * g
    u = (1 - cfg.momentum) * g + cfg.momentum * buf if cfg.nesterov else buf
    x = u.T if u.shape[0] > u.shape[1] else u
    x = x / max(np.sqrt((x * x).sum()), cfg.eps)
    a, b, c = cfg.ns_coefficients
    for _ in range(cfg.ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    o = x.T if u.shape[0] > u.shape[1] else x
    rows, cols = o.shape
    v = np.array([cfg.beta2 * v[i] + (1 - cfg.beta2) * sum(o[i, j] ** 2 for j in range(cols)) / cols
                  for i in range(rows)])
    n = np.array([[o[i, j] / (math.sqrt(v[i]) + cfg.normuon_eps) for j in range(cols)] for i in range(rows)])
    n = n * (np.linalg.norm(o) / (np.linalg.norm(n) + cfg.normuon_eps))
    ratio = math.sqrt(max(1, rows / cols)) if cfg.adjust_lr_fn == "original" else 0.2 * math.sqrt(max(rows, cols))
    return p * (1 - lr * cfg.weight_decay) - lr * ratio * n, buf, v


@pytest.mark.parametrize("shape", [(12, 7), (7, 12)], ids=["tall", "wide"])
@pytest.mark.parametrize("cfg", [FP64, replace(FP64, nesterov=False, adjust_lr_fn="match_rms_adamw", beta2=0.8)],
                         ids=["nesterov", "plain"])
def test_the_reference_is_the_papers_algorithm(shape, cfg):
    gen = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=torch.float64))
    opt = reference.NorMuon([p], **{**asdict(cfg), "lr": 0.02})
    mine, buf, v = p.detach().numpy().copy(), np.zeros(shape), np.zeros(shape[0])
    for _ in range(4):
        g = torch.randn(shape, generator=gen, dtype=torch.float64)
        p.grad = g.clone()
        opt.step()
        mine, buf, v = independent_step(mine, g.numpy(), buf, v, cfg, 0.02)
        assert np.abs(p.detach().numpy() - mine).max() <= 1e-12 * np.abs(mine).max()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("shape", [(24, 16), (16, 24)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_runtime_kernel_is_the_reference_bit_for_bit(shape, dtype):
    cfg = replace(NorMuonConfig(), ns_dtype="fp64" if dtype == torch.float64 else "fp32", weight_decay=0.05)
    gen = torch.Generator().manual_seed(5)
    p = torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=dtype))
    mine = p.detach().clone()
    opt = reference.NorMuon([p], **{**asdict(cfg), "lr": 0.01})
    state: dict = {}
    for _ in range(6):
        g = torch.randn(shape, generator=gen, dtype=dtype)
        p.grad = g.clone()
        opt.step()
        update = matrix_kernel("normuon")(g.clone(), state, cfg, 0.01)
        apply_update_(mine, update.direction.to(dtype), update)
        assert torch.equal(mine, p.detach())


def test_one_step_normalises_every_neuron_and_keeps_the_norm():
    cfg = replace(FP64, weight_decay=0.0)
    g = torch.randn(16, 40, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    update = matrix_kernel("normuon")(g, {}, cfg, 1.0)
    rms = update.direction.pow(2).mean(dim=1).sqrt()
    assert torch.allclose(rms, rms[0].expand_as(rms), rtol=1e-9)  # every row (neuron) alike
    plain = matrix_kernel("muon")(g, {}, replace(reference.Muon.config(), ns_dtype="fp64", weight_decay=0.0), 1.0)
    assert update.direction.norm().item() == pytest.approx(plain.direction.norm().item(), rel=1e-9)


# --- planner, simulator, memory, CLI ------------------------------------------------------------


def test_costs_state_and_workspace_are_muons_and_the_normalisation():
    m, n = 64, 32
    assert state_bytes("normuon", (m, n)) == state_bytes("muon", (m, n)) + 4 * m
    assert kernel_workspace_bytes("normuon", (m, n)) == kernel_workspace_bytes("muon", (m, n)) + 3 * 4 * m * n
    assert step_flops("muon", (m, n)) < step_flops("normuon", (m, n)) < 1.05 * step_flops("muon", (m, n))


def test_plan_simulate_and_compare_take_it():
    import json

    plan = invoke("plan", "--optimizer", "normuon", "--model", "qwen3-0.6b", "--dp", 4, "--tp", 2, "--json")
    assert plan.exit_code == 0, plan.stderr
    assert json.loads(plan.stdout)["optimizer"] == "normuon"
    sim = invoke("simulate", "--optimizer", "normuon", "--model", "qwen3-0.6b", "--gpus", 16, "--tp", 2, "--json")
    assert sim.exit_code == 0, sim.stderr
    muon = invoke("simulate", "--optimizer", "muon", "--model", "qwen3-0.6b", "--gpus", 16, "--tp", 2, "--json")
    normuon, plain = json.loads(sim.stdout), json.loads(muon.stdout)
    assert normuon["optimizer"] == "normuon"
    assert normuon["memory"]["worst"]["matrix_state"] > plain["memory"]["worst"]["matrix_state"]
    assert "normuon (NorMuon" in " ".join(invoke("compare", "--help", env={"COLUMNS": "300"}).stdout.split())


# --- the runtime --------------------------------------------------------------------------------

NS_FP32 = {"ns_dtype": "fp32"}
SPECS = {
    "dp2 canzona": TrainSpec(optimizer="normuon", steps=3, global_batch=8, matrix_config=NS_FP32),
    "dp2 sc": TrainSpec(optimizer="normuon", policy="sc", steps=3, global_batch=8, matrix_config=NS_FP32),
    "tp2 canzona": TrainSpec(optimizer="normuon", steps=3, global_batch=4, tp=2, matrix_config=NS_FP32),
    "tp2 zero1-gather": TrainSpec(optimizer="normuon", policy="zero1-gather", steps=3, global_batch=4, tp=2,
                                  matrix_config=NS_FP32),
}


SAVE = TrainSpec(optimizer="normuon", steps=2, global_batch=8, matrix_config=NS_FP32)
RESUME = replace(SAVE, data_seed=7)  # fresh data for the continuation


def normuon_worker(rank: int, world: int) -> tuple[list[dict], dict, dict]:
    """The runs of SPECS; then a DP 2 run saved with `state_dict()` and another resumed from it."""
    from canzona.harness.training import distributed_worker

    out = many_specs_worker(rank, world, list(SPECS.values()), [{"state_dict": False}] * len(SPECS))
    saved = distributed_worker(rank, world, SAVE, {})
    resumed = distributed_worker(rank, world, RESUME, {"load": (saved["params"], saved["state"]), "state_dict": False})
    return out, saved, resumed


@pytest.fixture(scope="module")
def spawned() -> list[tuple[list[dict], dict, dict]]:
    return run_ranks(normuon_worker, 2, deadline_s=240.0, collective_timeout_s=60)


@pytest.fixture(scope="module")
def runs(spawned) -> dict[str, list[dict]]:
    return {label: [r[0][i] for r in spawned] for i, label in enumerate(SPECS)}


@pytest.mark.distributed
@pytest.mark.parametrize("label", list(SPECS))
def test_distributed_equals_the_same_kernels_in_one_process(runs, label):
    spec = SPECS[label]
    results = runs[label]
    dp = spec.dp_size(len(results))
    grads = global_gradients_from(results, spec) if spec.tp > 1 else None
    one_process = emulate(spec, dp, grads=grads)
    ref = reference_run(spec, dp, grads=grads)
    for r in results:
        tp_dims = r["tp_dims"]
        mine = expected_shards(one_process, tp_dims, spec.tp, r["tp_rank"])
        assert compare(r["params"], mine)["bit_identical"], (label, r["dp_rank"], r["tp_rank"])
        near = compare(r["params"], expected_shards(ref, tp_dims, spec.tp, r["tp_rank"]))
        assert near["max_rel_diff"] <= 1e-5, (label, near)


@pytest.mark.distributed
def test_a_checkpoint_resumes_bit_for_bit(spawned):
    """`state_dict()` carries the per-row second moment with the momentum; a run loaded from it
    continues as the same kernels in one process continue from it."""
    (_, saved, _), _ = spawned
    params, state = saved["params"], saved["state"]
    second = [s["second_moment"] for s in state["state"].values() if "second_moment" in s]
    assert second and all(v.dim() == 2 and v.shape[1] == 1 for v in second)
    want = emulate(RESUME, 2, load=(params, state))
    for _, _, resumed in spawned:
        assert compare(resumed["params"], want)["bit_identical"]
