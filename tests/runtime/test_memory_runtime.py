"""The memory model (`canzona.memory`) against the tensors the runtime allocates (docs/design.md §7.1).

A bf16 tiny model with fp32 masters, trained one step by `DistributedOptimizer` on spawned gloo
ranks (DP 4, and DP 2 x TP 2), under every step policy and reduce-scatter implementation. Per rank,
the bytes of the tensors the optimizer holds equal the model's figures exactly:

- weights: the flat parameter buffers (the plan's padded buckets and the AdamW buffer);
- gradients: one fp32 buffer per bucket (main grads), no second one in the weights' dtype;
- fp32 masters of what the rank updates; the matrix optimizer's state where it is hosted; AdamW
  state for the parameters inside the rank's slice;
- the reduce-scatter's buffers at their high-water mark (`Comm.peak_in_flight_bytes`): what
  `canzona.memory.reduction_bytes` prices, counting gloo's scratch copy for a loop of reduces
  (NCCL's reduces need none: the simulator's figure); and every byte the reduce-scatters allocate,
  measured from the outside (`tests/runtime/allocations.py`), is in that figure: an even bucket is
  reduce-scattered into itself, so a receive buffer the model omits fails the test.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest

from canzona.harness.launch import run_ranks
from canzona.harness.training import TrainSpec
from canzona.memory import LayerDims, MemorySetup, memory_per_gpu, reduction_bytes
from canzona.reductions import REDUCE_SCATTER_IMPLS
from canzona.step_policies import STEP_POLICIES, get_step_policy, policy_optimizer

pytestmark = pytest.mark.distributed

DEADLINE_S = 180.0
TIMEOUT_S = 60.0
BASE = TrainSpec(optimizer="muon", steps=1, global_batch=8, seq_len=8, bucket_size=12000, dtype="bf16",
                 matrix_config={"ns_steps": 1})
DIMS = LayerDims.gpt(layers=2, hidden=64, heads=4, vocab=256)
SETUP = MemorySetup(param_bytes=2, grad_bytes=4, fixed_overhead_bytes=0, fragmentation=0.0)
CASES = [(policy, impl) for policy in STEP_POLICIES for impl in ("native", "exact")] + \
    [("canzona", impl) for impl in REDUCE_SCATTER_IMPLS if impl not in ("native", "exact")]


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def built(spec, mesh, **options):
    """(spec, model, its ModelSpec, DistributedOptimizer) of one case: the model at the spec's TP (on
    `mesh`), the matrix optimizer's config only where the spec's optimizer is BASE's."""
    from canzona.harness.training import build_model, build_tp_model
    from canzona.runtime.optimizer import DistributedOptimizer

    spec = replace(spec, matrix_config=BASE.matrix_config if spec.optimizer == BASE.optimizer else {})
    model, mspec = build_tp_model(spec, mesh) if spec.tp > 1 else (build_model(spec), None)
    mspec = mspec or model.spec()
    opt = DistributedOptimizer(model.named_parameters(), mspec, spec.optimizer, spec.matrix_config or None,
                               policy=spec.policy, bucket_size=spec.bucket_size, group=mesh, timeout_s=TIMEOUT_S,
                               **options)
    return spec, model, mspec, opt


def allocations_worker(rank: int, world: int, tp: int) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    from canzona.harness.training import (
        global_batches,
        matrix_state_bytes,
        micro_batches,
    )
    from tests.runtime.allocations import metered

    out = []
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp")) if tp > 1 else None
    for policy, impl in CASES:
        optimizer = policy_optimizer(policy, BASE.optimizer)  # zero1: the AdamW baseline, its pieces
        spec, model, mspec, opt = built(replace(BASE, policy=policy, tp=tp, reduce_scatter=impl, optimizer=optimizer),
                                        mesh, reduce_scatter=impl)
        dp_rank = opt.rank
        seen = metered(opt.comm)
        (tokens,) = global_batches(spec, mspec.param("model.embed_tokens.weight").shape[0])
        for mb in micro_batches(tokens, dp_rank, world // tp, 1):
            model.loss(mb).backward()
        opt.step()
        opt.wait_params()
        buffers = opt.grads.all_buffers()
        out.append({
            "case": (policy, impl), "plan": opt.plan, "spec": mspec, "dp_rank": dp_rank, "tp_rank": opt.tp_rank,
            "weights": nbytes(b.data for b in buffers),
            "grads": nbytes(b.grad for b in buffers),
            "grad_dtypes": {str(b.grad.dtype) for b in buffers},
            "master_weights": nbytes(opt.master.values()),
            "matrix_state": matrix_state_bytes(opt.matrix_state),
            "adamw_state": sum(nbytes(v for v in s.values() if hasattr(v, "numel")) for s in opt.adamw_state.values()),
            "reduction": opt.comm.peak_in_flight_bytes,
            "allocated": seen.bytes,
            "adamw_size": opt.grads.adamw.size,
        })
    return out


@functools.cache
def allocations(world: int, tp: int) -> list[list[dict]]:
    return run_ranks(allocations_worker, world, tp, deadline_s=DEADLINE_S, collective_timeout_s=TIMEOUT_S)


def predicted_memory(run: dict, policy: str, impl: str, dp: int):
    """What `canzona.memory` says the run's ranks hold."""
    return memory_per_gpu(run["spec"], run["plan"], policy, DIMS, replace(SETUP, reduce_scatter=impl), dp=dp)


@pytest.mark.parametrize(("world", "tp"), [(4, 1), (4, 2)])
def test_every_persistent_buffer_is_what_the_memory_model_counts(world, tp):
    ranks = allocations(world, tp)
    dp = world // tp
    for c, (policy, impl) in enumerate(CASES):
        first = ranks[0][c]
        predicted = predicted_memory(first, policy, impl, dp)
        for got in (r[c] for r in ranks):
            want = predicted.ranks[got["dp_rank"] * tp + got["tp_rank"]]
            assert got["grad_dtypes"] == {"torch.float32"}  # one fp32 gradient buffer, no bf16 copy
            for k in ("weights", "grads", "master_weights", "matrix_state", "adamw_state"):
                assert got[k] == getattr(want, k), (policy, impl, got["dp_rank"], got["tp_rank"], k)


@pytest.mark.parametrize(("world", "tp"), [(4, 1), (4, 2)])
def test_the_reduce_scatter_buffers_peak_where_the_model_says(world, tp):
    ranks = allocations(world, tp)
    dp = world // tp
    for c, (policy, impl) in enumerate(CASES):
        first = ranks[0][c]
        step_policy = get_step_policy(policy)
        on_gloo = reduction_bytes(first["plan"], step_policy, dp, first["adamw_size"], impl, 4, scratch=True)
        on_nccl = reduction_bytes(first["plan"], step_policy, dp, first["adamw_size"], impl, 4)
        predicted = predicted_memory(first, policy, impl, dp)
        for got in (r[c] for r in ranks):
            assert got["reduction"] == on_gloo[got["dp_rank"]] == got["allocated"], (policy, impl, got["dp_rank"])
            assert predicted.ranks[got["dp_rank"] * tp + got["tp_rank"]].reduction == on_nccl[got["dp_rank"]]
        if impl == "exact" and policy == "canzona":  # the verification mode's n copies of a segment
            assert max(on_nccl) > 2 * max(reduction_bytes(first["plan"], step_policy, dp, first["adamw_size"],
                                                          "native", 4))


# --- master_weights=False: everything in the parameters' dtype ----------------------------------------

# DistributedOptimizer(master_weights=False) on a bf16 model: no masters, gradients reduced in bf16,
# the optimizer state in the parameters' dtype (docs/design.md §8.5); the memory model's
# MemorySetup(master_weights=False) with 2-byte gradients; the baseline AdamW (zero1) and Muon
# (canzona). The simulator has no such option (its runs keep fp32 masters, as the runtime's default)
NO_MASTER_CASES = (("canzona", "muon"), ("zero1", "adamw"))
NO_MASTER_SETUP = replace(SETUP, grad_bytes=2, master_weights=False)


def no_master_worker(rank: int, world: int, tp: int, cases: tuple[tuple[str, str], ...] = NO_MASTER_CASES) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    from canzona.harness.training import (
        global_batches,
        matrix_state_bytes,
        micro_batches,
    )

    out = []
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp")) if tp > 1 else None
    for policy, optimizer in cases:
        spec, model, mspec, opt = built(replace(BASE, policy=policy, tp=tp, optimizer=optimizer, master_weights=False),
                                        mesh, master_weights=False)
        (tokens,) = global_batches(spec, mspec.param("model.embed_tokens.weight").shape[0])
        for mb in micro_batches(tokens, opt.rank, world // tp, 1):
            model.loss(mb).backward()
        opt.step()
        opt.wait_params()
        buffers = opt.grads.all_buffers()
        out.append({
            "plan": opt.plan, "spec": mspec, "dp_rank": opt.rank, "tp_rank": opt.tp_rank,
            "weights": nbytes(b.data for b in buffers), "grads": nbytes(b.grad for b in buffers),
            "grad_dtypes": {str(b.grad.dtype) for b in buffers}, "master_weights": nbytes(opt.master.values()),
            "matrix_state": matrix_state_bytes(opt.matrix_state),
            "adamw_state": sum(nbytes(v for v in s.values() if hasattr(v, "numel")) for s in opt.adamw_state.values()),
            "reduction": opt.comm.peak_in_flight_bytes, "adamw_size": opt.grads.adamw.size,
        })
    return out


@functools.cache
def no_master_allocations(world: int, tp: int,
                          cases: tuple[tuple[str, str], ...] = NO_MASTER_CASES) -> list[list[dict]]:
    return run_ranks(no_master_worker, world, tp, cases, deadline_s=DEADLINE_S, collective_timeout_s=TIMEOUT_S)


def _no_master_pairs(world: int, tp: int, cases: tuple[tuple[str, str], ...] = NO_MASTER_CASES):
    """(policy, what a rank allocated, what the memory model says of that rank) of every run."""
    ranks = no_master_allocations(world, tp, cases)
    for c, (policy, _) in enumerate(cases):
        first = ranks[0][c]
        predicted = memory_per_gpu(first["spec"], first["plan"], policy, DIMS, NO_MASTER_SETUP, dp=world // tp)
        for got in (r[c] for r in ranks):
            yield policy, got, predicted.ranks[got["dp_rank"] * tp + got["tp_rank"]]


@pytest.mark.parametrize(("world", "tp"), [(2, 1), (4, 2)])
def test_without_masters_the_buffers_are_what_the_memory_model_counts(world, tp):
    """No masters, one bf16 gradient buffer per bucket, and the reduce-scatters' buffers in bf16: as
    the memory model counts them under MemorySetup(master_weights=False, grad_bytes=2)."""
    dp = world // tp
    for policy, got, want in _no_master_pairs(world, tp):
        assert got["grad_dtypes"] == {"torch.bfloat16"} and got["master_weights"] == 0
        for k in ("weights", "grads", "master_weights"):
            assert got[k] == getattr(want, k), (policy, got["dp_rank"], got["tp_rank"], k)
        on_gloo = reduction_bytes(got["plan"], get_step_policy(policy), dp, got["adamw_size"], "native", 2,
                                  scratch=True)
        assert got["reduction"] == on_gloo[got["dp_rank"]], (policy, got["dp_rank"])


@pytest.mark.parametrize(("world", "tp"), [(2, 1), (4, 2)])
def test_without_masters_the_optimizer_state_is_what_the_memory_model_counts(world, tp):
    """Without masters the runtime keeps Muon's momentum and AdamW's moments in the parameters' dtype
    (`MemorySetup.update_state_bytes`; SOAP's and Shampoo's statistics stay fp32): as the memory
    model counts them (it counted them in fp32 until 2026-11-30: twice the bytes)."""
    for policy, got, want in _no_master_pairs(world, tp):
        for k in ("matrix_state", "adamw_state"):
            assert got[k] == getattr(want, k), (policy, got["dp_rank"], got["tp_rank"], k)


# the other matrix optimizers of the registry: NorMuon's momentum follows the update (its per-row
# second moment stays fp32), SOAP's and Shampoo's moments and statistics stay fp32 (`work_dtype`)
OTHER_MATRIX_CASES = (("canzona", "normuon"), ("canzona", "soap"), ("canzona", "shampoo"))


@pytest.mark.parametrize(("world", "tp"), [(2, 1), (4, 2)])
def test_without_masters_every_matrix_optimizers_state_is_what_the_memory_model_counts(world, tp):
    """NorMuon, SOAP and Shampoo without masters: every persistent buffer as the memory model counts it."""
    for policy, got, want in _no_master_pairs(world, tp, OTHER_MATRIX_CASES):
        assert got["master_weights"] == 0
        for k in ("weights", "grads", "master_weights", "matrix_state", "adamw_state"):
            assert got[k] == getattr(want, k), (policy, got["plan"].optimizer, got["dp_rank"], got["tp_rank"], k)
