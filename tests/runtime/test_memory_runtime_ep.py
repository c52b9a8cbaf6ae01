"""The memory model against what the runtime allocates, under expert parallelism (issue 20;
docs/design.md §2.7, §7.1; the dense counterpart: tests/runtime/test_memory_runtime.py).

The tiny MoE (`reference/tiny_moe_ep.py`) in bf16 with fp32 masters, trained one step by
`DistributedOptimizer(..., expert_mesh=...)` on spawned gloo ranks, DP 4 = EDP 2 x EP 2, under each
step policy (and AdamW on every parameter). Per rank, the bytes of the tensors the optimizer holds
equal the model's figures exactly, part by part and for the whole GPU:

- the dense part (`canzona.experts.dense_part`, planned over DP) against `memory_per_gpu` of its
  plan at the rank's DP rank; the experts of the rank's EP rank (`expert_part`, planned over EDP)
  against `memory_per_gpu` of the expert plan at its EDP rank: weights (the flat buffers: buckets
  and the AdamW buffer, which for the experts holds no parameter and is one padded fp32 slice per
  rank), fp32 gradient buffers, fp32 masters of what the rank updates, the matrix optimizer's state
  where it is hosted, AdamW state for the pieces inside the rank's slices;
- the whole GPU: what `canzona simulate --ep` reports (`SimResult.memory`, the dense part's memory
  `with_experts`), persistent components equal to both parts' allocations added;
- the reduce-scatter buffers at their high-water mark, on the DP and on the EDP communicator
  (`canzona.memory.reduction_bytes`, with gloo's scratch copy).

The token dispatch all-to-alls' buffers are the model's (its forward and backward), not the
optimizer's: nothing here allocates them, and the memory model counts them, if at all, as
activations, which this test does not compare.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest

from canzona.harness.launch import run_ranks
from canzona.memory import PERSISTENT, LayerDims, MemorySetup, memory_per_gpu, reduction_bytes
from canzona.step_policies import get_step_policy

pytestmark = pytest.mark.distributed

WORLD, EP = 4, 2
DEADLINE_S = 180.0
TIMEOUT_S = 60.0
BUCKET = 1024
# (policy, optimizer, reduce-scatter implementation)
CASES = [("canzona", "muon", "native"), ("canzona", "muon", "exact"), ("zero1-gather", "muon", "native"),
         ("layerwise", "soap", "native"), ("sc", "muon", "native"), ("zero1", "adamw", "native")]
SETUP = MemorySetup(param_bytes=2, grad_bytes=4, fixed_overhead_bytes=0, fragmentation=0.0)
PARTS = ("dense", "experts")


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def allocations_worker(rank: int, world: int) -> list[dict]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from canzona.harness.training import (
        TrainSpec,
        global_batches,
        matrix_state_bytes,
        micro_batches,
    )
    from canzona.runtime.optimizer import DistributedOptimizer
    from reference.tiny_moe import MOE_PRESETS
    from reference.tiny_moe_ep import TinyMoeEP

    mesh = init_device_mesh("cpu", (world // EP, EP), mesh_dim_names=("edp", "ep"))
    out = []
    for policy, optimizer, impl in CASES:
        model = TinyMoeEP(MOE_PRESETS["tiny-moe"], mesh.get_group("ep"), dtype=torch.bfloat16)
        mspec = model.spec()
        config = {"ns_steps": 1} if optimizer == "muon" else None
        opt = DistributedOptimizer(model.named_parameters(), mspec, optimizer, config, policy=policy,
                                   bucket_size=BUCKET, reduce_scatter=impl, timeout_s=TIMEOUT_S, expert_mesh=mesh)
        (tokens,) = global_batches(TrainSpec(preset="tiny-moe", steps=1, global_batch=8, seq_len=8),
                                   mspec.param("model.embed_tokens.weight").shape[0])
        for mb in micro_batches(tokens, opt.rank, world, 1):
            model.loss(mb).backward()
        opt.step()
        opt.wait_params()
        experts = set(opt.experts.grads.buffer_of)  # the expert part's entries (its matrices)

        def mine(names, part, experts=experts):
            return [n for n in names if (n in experts) == (part == "experts")]

        row = {"case": (policy, optimizer, impl), "spec": mspec, "plan": opt.plan.dense, "expert_plan": opt.experts.plan,
               "dp_rank": opt.rank, "edp_rank": opt.experts.rank}
        for part, grads, state in (("dense", opt.grads, opt.matrix_state),
                                   ("experts", opt.experts.grads, opt.experts.matrix_state)):
            buffers = grads.all_buffers()
            row[part] = {
                "weights": nbytes(b.data for b in buffers),
                "grads": nbytes(b.grad for b in buffers),
                "grad_dtypes": {str(b.grad.dtype) for b in buffers},
                "master_weights": nbytes(opt.master[n] for n in mine(opt.master, part)),
                "matrix_state": matrix_state_bytes(state),
                "adamw_state": sum(nbytes(v for v in opt.adamw_state[n].values() if hasattr(v, "numel"))
                                   for n in mine(opt.adamw_state, part)),
                "reduction": grads.dp.peak_in_flight_bytes,
                "adamw_size": grads.adamw.size,
            }
        out.append(row)
    return out


@functools.cache
def allocations() -> list[list[dict]]:
    return run_ranks(allocations_worker, WORLD, deadline_s=DEADLINE_S, collective_timeout_s=TIMEOUT_S)


def dims() -> LayerDims:
    from reference.tiny_moe import MOE_PRESETS

    moe = MOE_PRESETS["tiny-moe"]
    return LayerDims.gpt(layers=moe.layers, hidden=moe.hidden, heads=4, vocab=moe.vocab)


def part_memory(first: dict, part: str):
    """`canzona.memory` of one part on the run's own plan: the dense part over DP, the experts of
    an EP rank over EDP."""
    from canzona.experts import dense_part, expert_part

    policy, _, impl = first["case"]
    spec = dense_part(first["spec"]) if part == "dense" else expert_part(first["spec"], EP)
    plan = first["plan"] if part == "dense" else first["expert_plan"]
    return memory_per_gpu(spec, plan, policy, dims(), replace(SETUP, reduce_scatter=impl), dp=plan.dp)


@functools.cache
def simulated(c: int):
    """What `canzona simulate --ep 2` reports per GPU for case `c` on the same model (its plans are
    the runtime's: `canzona.plan.plan_for` with the runtime's bucket sizing)."""
    from canzona.decoder import Architecture
    from canzona.dp.layout import DEFAULT_EXPERT_BUCKETS
    from reference.tiny_moe import MOE_PRESETS
    from sim.options import RunOptions
    from sim.simulate import SimConfig, simulate
    from sim.workload import Workload

    policy, optimizer, impl = CASES[c]
    spec, moe = allocations()[0][c]["spec"], MOE_PRESETS["tiny-moe"]
    arch = Architecture(spec.name, moe.layers, moe.hidden, moe.vocab, moe.hidden, experts=moe.experts,
                        experts_per_token=moe.experts_per_token)
    cfg = SimConfig(model=spec.name, gpus=WORLD, tp=1, ep=EP, optimizer=optimizer, policy=policy,
                    workload=Workload(seq_len=8, global_batch=WORLD, param_bytes=2, grad_bytes=4),
                    bucket_size=BUCKET, expert_buckets=DEFAULT_EXPERT_BUCKETS, zero1_fallback=False,
                    options=RunOptions(reduce_scatter=impl))
    return simulate(cfg, model=(spec, arch)).memory


@pytest.mark.parametrize("c", range(len(CASES)), ids=["-".join(case) for case in CASES])
def test_each_parts_persistent_buffers_are_what_the_memory_model_counts(c):
    ranks = [r[c] for r in allocations()]
    for part in PARTS:
        predicted = part_memory(ranks[0], part)
        for got in ranks:
            want = predicted.ranks[got["dp_rank"] if part == "dense" else got["edp_rank"]]
            assert got[part]["grad_dtypes"] == {"torch.float32"}  # fp32 main grads, no bf16 copy
            for k in PERSISTENT:
                assert got[part][k] == getattr(want, k), (CASES[c], part, got["dp_rank"], k)


@pytest.mark.parametrize("c", range(len(CASES)), ids=["-".join(case) for case in CASES])
def test_each_gpu_holds_what_the_simulator_reports_under_ep(c):
    memory = simulated(c)
    for got in (r[c] for r in allocations()):
        want = memory.ranks[got["dp_rank"]]
        for k in PERSISTENT:
            assert got["dense"][k] + got["experts"][k] == getattr(want, k), (CASES[c], got["dp_rank"], k)


@pytest.mark.parametrize("c", range(len(CASES)), ids=["-".join(case) for case in CASES])
def test_the_reduce_scatter_buffers_of_both_parts_peak_where_the_model_says(c):
    """Each communicator's high-water mark (gloo: with the scratch copy of a loop of reduces);
    the simulator's figure (NCCL's, no scratch) adds both parts', in flight together."""
    ranks = [r[c] for r in allocations()]
    policy, _, impl = CASES[c]
    step_policy = get_step_policy(policy)
    first = ranks[0]
    nccl = {}
    for part in PARTS:
        plan = first["plan"] if part == "dense" else first["expert_plan"]
        args = (plan, step_policy, plan.dp, first[part]["adamw_size"], impl, 4)
        empty = {"adamw_grad_bytes": 4}  # fp32 either way here (masters), empty or not
        on_gloo = reduction_bytes(*args, scratch=True, **empty)
        nccl[part] = reduction_bytes(*args, **empty)
        for got in ranks:
            r = got["dp_rank"] if part == "dense" else got["edp_rank"]
            assert got[part]["reduction"] == on_gloo[r], (CASES[c], part, got["dp_rank"])
    memory = simulated(c)
    for got in ranks:
        assert memory.ranks[got["dp_rank"]].reduction == nccl["dense"][got["dp_rank"]] + nccl["experts"][got["edp_rank"]]
