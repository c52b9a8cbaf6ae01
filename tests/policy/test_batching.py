"""`batch_kernels` in the policy core, the cost model, the simulator and the memory model
(`canzona.batching`, docs/design.md §8.7): one rule for which matrices run as one kernel, priced and
counted the way the runtime runs them (`tests/runtime/test_batched_kernels.py` checks the
runtime)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from canzona.batching import MAX_BATCH_NUMEL, batches, compute_windows, shape_batches
from canzona.cost import DeviceRate, optimizer_kernels
from canzona.errors import SpecError
from canzona.hardware import load_profile
from canzona.memory import (
    LayerDims,
    MemorySetup,
    batched_stack_bytes,
    kernel_workspace_bytes,
    memory_per_gpu,
)
from canzona.plan import make_plan
from canzona.spec import ModelSpec, ParamSpec, Role
from sim.options import RunOptions
from sim.simulate import SimConfig, simulate
from sim.workload import Workload

RATE = DeviceRate.from_profile(load_profile("h100-sxm"))


def task(name, shape, host=0):
    return SimpleNamespace(name=name, shape=shape, host=host, hosted_on=lambda r, h=host: r == h)


def group(tasks, moves=False):
    return SimpleNamespace(tasks=tasks, gather=object() if moves else None, scatter=None,
                           hosted=lambda r, ts=tasks: [t for t in ts if t.hosted_on(r)])


def test_same_shapes_batch_in_first_seen_order_within_the_cap():
    ts = [task("a", (4, 8)), task("b", (8, 4)), task("c", (4, 8)), task("d", (4, 8))]
    assert [[t.name for t in b] for b in shape_batches(ts, True)] == [["a", "c", "d"], ["b"]]
    assert [[t.name for t in b] for b in shape_batches(ts, False)] == [["a"], ["b"], ["c"], ["d"]]
    assert [[t.name for t in b] for b in shape_batches(ts, True, max_numel=64)] == [["a", "c"], ["b"], ["d"]]
    assert batches([("big", 1, 2 * MAX_BATCH_NUMEL)]) == [["big"]]  # never empty


def test_windows_join_groups_only_where_nothing_moves():
    quiet = [group([task(f"w{i}", (1024, 1024))]) for i in range(40)]
    windows = compute_windows(quiet, 0, True)
    per_window = MAX_BATCH_NUMEL // (1024 * 1024)
    assert list(windows) == list(range(0, 40, per_window))
    assert sorted(g for w in windows.values() for g in w) == list(range(40))
    assert compute_windows(quiet, 0, False) == {i: (i,) for i in range(40)}
    moving = quiet[:3] + [group([task("x", (8, 8))], moves=True)]
    assert compute_windows(moving, 0, True) == {i: (i,) for i in range(4)}


@pytest.mark.parametrize("shape", [(256, 256), (1024, 4096), (5120, 5120)])
@pytest.mark.parametrize("optimizer", ["muon", "soap", "shampoo"])
def test_a_batch_costs_at_most_its_matrices_one_by_one(optimizer, shape):
    kernels = optimizer_kernels(optimizer, shape)
    one = sum(RATE.kernel_seconds(k) for k in kernels)
    assert RATE.batched_seconds(kernels, 1) == pytest.approx(one)
    for k in (2, 8):
        batched = RATE.batched_seconds(kernels, k)
        assert batched <= k * one * (1 + 1e-12)
        # the saving is at least one launch per GEMM of every matrix but the first
        gemms = sum(x.count for x in kernels if x.kind == "gemm")
        assert k * one - batched >= (k - 1) * gemms * RATE.launch_s * (1 - 1e-9)


# a TP-1 model of many small same-shape matrices: launch-bound, where batching pays
MANY = ModelSpec("many", tuple(
    [ParamSpec("embed", (512, 256), Role.EMBEDDING, None)]
    + [ParamSpec(f"l{i}.w", (256, 256), Role.MATRIX, i) for i in range(24)]
    + [ParamSpec(f"l{i}.norm", (256,), Role.VECTOR, i) for i in range(24)]))


def test_the_simulator_prices_batched_kernels_as_the_option_says():
    steps = {}
    for batched in (True, False):
        cfg = SimConfig(model="qwen3-0.6b", gpus=8, tp=1, workload=Workload(seq_len=256, global_batch=8),
                        options=RunOptions(batch_kernels=batched), zero1_fallback=False)
        steps[batched] = simulate(cfg).optimizer_step_s
    assert steps[True] < steps[False]


def test_the_memory_model_counts_a_batchs_workspace_and_stacks():
    plan = make_plan(MANY, 1, 1, "soap", "alpha-balanced", "greedy-rollback")
    dims = LayerDims.gpt(layers=24, hidden=256, heads=4, vocab=512)
    setup = MemorySetup(seq_len=8, fixed_overhead_bytes=0, fragmentation=0.0)
    on = memory_per_gpu(MANY, plan, "canzona", dims, setup).worst
    off = memory_per_gpu(MANY, plan, "canzona", dims, replace(setup, batch_kernels=False)).worst
    ws, stack = kernel_workspace_bytes("soap", (256, 256)), batched_stack_bytes("soap", (256, 256))
    update = 256 * 256 * 4
    # per matrix alone: its workspace and update, with the previous group's update waiting to be
    # applied (pipelined); batched, all 24 in one window (TP 1) and one batch: 24 workspaces, 24
    # stacked copies and 24 updates at once
    assert off.step_buffers == ws + 2 * update
    assert on.step_buffers == 24 * (ws + stack + update)


def test_overlap_step_under_a_grad_scaler_counts_the_early_products():
    """overlap_step under torch.amp.GradScaler computes each early update from the landed gradient
    times the inverse scale (`MatrixStep.speculate(scale=)`): a product per hosted gradient, which
    a compute window holds together with its kernels' temporaries (`_full_grads` returns the
    window's). Measured on the runtime's tiny model at one rank: 32,768 bytes, its largest matrix's
    fp32 gradient, per call (`_full_grads` patched to sum what it returns). Before: not counted."""
    plan = make_plan(MANY, 1, 1, "soap", "alpha-balanced", "greedy-rollback")
    dims = LayerDims.gpt(layers=24, hidden=256, heads=4, vocab=512)
    setup = MemorySetup(seq_len=8, fixed_overhead_bytes=0, fragmentation=0.0, overlap_step=True)
    gradient = 256 * 256 * 4  # one fp32 gradient
    for batched, held in ((False, 1), (True, 24)):  # per matrix, or all 24 in one window (TP 1)
        plain = replace(setup, batch_kernels=batched)
        scaled = memory_per_gpu(MANY, plan, "canzona", dims, replace(plain, grad_scaler=True)).worst
        assert scaled.total - memory_per_gpu(MANY, plan, "canzona", dims, plain).worst.total == held * gradient
    with pytest.raises(SpecError, match="^grad_scaler must be true or false"):
        MemorySetup(grad_scaler="yes")
