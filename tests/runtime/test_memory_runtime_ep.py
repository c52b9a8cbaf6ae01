"""The memory model against what the runtime allocates, under expert parallelism (issue 20;
docs/design.md §2.7, §7.1; the dense counterpart: tests/runtime/test_memory_runtime.py).

The tiny MoE (`reference/tiny_moe_ep.py`) in bf16 with fp32 masters, trained one step by
`DistributedOptimizer(..., expert_mesh=...)` on spawned gloo ranks under each step policy (and
AdamW on every parameter), on two layouts of 4 ranks with EDP 2 x EP 2: DP 4 (`tiny-moe`), and
DP 2 x TP 2 (`tiny-moe-attn`: its attention, embedding and head TP-split; docs/design.md §8.9).
Per rank, the bytes of the tensors the optimizer holds equal the model's figures exactly, part by
part and for the whole GPU:

- the dense part (`canzona.experts.dense_part`, planned over DP x TP) against `memory_per_gpu` of
  its plan at the rank's DP and TP ranks; the experts of the rank's EP rank (`expert_part`, planned
  over EDP, TP 1)
  against `memory_per_gpu` of the expert plan at its EDP rank: weights (the flat buffers: buckets
  and the AdamW buffer, which for the experts holds no parameter and is one padded fp32 slice per
  rank), fp32 gradient buffers, fp32 masters of what the rank updates, the matrix optimizer's state
  where it is hosted, AdamW state for the pieces inside the rank's slices;
- the whole GPU: what `canzona simulate --ep` reports (`SimResult.memory`, the dense part's memory
  `with_experts`), persistent components equal to both parts' allocations added;
- the reduce-scatter buffers at their high-water mark, on the DP and on the EDP communicator
  (`canzona.memory.reduction_bytes`, with gloo's scratch copy), and every byte those
  reduce-scatters allocate, measured from the outside (`tests/runtime/allocations.py`); the
  simulator's figure is the same under Megatron's collectives and the runtime's (zero1 included:
  both reduce-scatter an even bucket into itself).

One spawn of 4 ranks runs every case on both layouts.

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
LAYOUTS = {1: "tiny-moe", 2: "tiny-moe-attn"}  # TP size: the preset (DP = WORLD / TP, EDP 2 x EP 2)
DEADLINE_S = 180.0
TIMEOUT_S = 60.0
BUCKET = 1024
# (policy, optimizer, reduce-scatter implementation)
CASES = [("canzona", "muon", "native"), ("canzona", "muon", "exact"), ("zero1-gather", "muon", "native"),
         ("layerwise", "soap", "native"), ("sc", "muon", "native"), ("zero1", "adamw", "native")]
RUNS = [(tp, c) for tp in LAYOUTS for c in range(len(CASES))]
IDS = [f"tp{tp}-" + "-".join(CASES[c]) for tp, c in RUNS]
SETUP = MemorySetup(param_bytes=2, grad_bytes=4, fixed_overhead_bytes=0, fragmentation=0.0)
PARTS = ("dense", "experts")


def matrix_config_of(optimizer: str) -> dict | None:
    """The matrix_config each case's optimizer runs with, which the simulator is given too (the
    runtime plans with it: same name, same pricing)."""
    return {"ns_steps": 1} if optimizer == "muon" else None


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def allocations_worker(rank: int, world: int) -> dict[int, list[dict]]:
    from torch.distributed.device_mesh import init_device_mesh

    experts = init_device_mesh("cpu", (world // EP, EP), mesh_dim_names=("edp", "ep"))
    out = {}
    for tp, preset in LAYOUTS.items():
        dense = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp")) if tp > 1 else None
        out[tp] = [case_allocations(case, preset, world // tp, dense, experts) for case in CASES]
    return out


def case_allocations(case: tuple[str, str, str], preset: str, dp: int, dense, experts,
                     master_weights: bool = True) -> dict:
    """What one step of `case` leaves allocated on this rank, part by part (`dense`: the (dp, tp)
    mesh, None at TP 1; `experts`: the (edp, ep) mesh)."""
    import torch

    from canzona.harness.training import (
        TrainSpec,
        global_batches,
        matrix_state_bytes,
        micro_batches,
    )
    from canzona.runtime.optimizer import DistributedOptimizer
    from reference.tiny_moe import MOE_PRESETS
    from reference.tiny_moe_ep import TinyMoeEP
    from tests.runtime.allocations import metered

    policy, optimizer, impl = case
    model = TinyMoeEP(MOE_PRESETS[preset], experts.get_group("ep"), dtype=torch.bfloat16,
                      tp_group=dense.get_group("tp") if dense is not None else None)
    mspec = model.spec()
    config = matrix_config_of(optimizer)
    opt = DistributedOptimizer(model.named_parameters(), mspec, optimizer, config, policy=policy, group=dense,
                               bucket_size=BUCKET, reduce_scatter=impl, timeout_s=TIMEOUT_S, expert_mesh=experts,
                               master_weights=master_weights)
    seen = {"dense": metered(opt.grads.dp), "experts": metered(opt.experts.grads.dp)}
    (tokens,) = global_batches(TrainSpec(preset=preset, steps=1, global_batch=8, seq_len=8),
                               mspec.param("model.embed_tokens.weight").shape[0])
    for mb in micro_batches(tokens, opt.rank, dp, 1):
        model.loss(mb).backward()
    opt.step()
    opt.wait_params()
    expert_entries = set(opt.experts.grads.buffer_of)  # the expert part's entries (its matrices)

    def mine(names, part):
        return [n for n in names if (n in expert_entries) == (part == "experts")]

    row = {"case": case, "spec": mspec, "plan": opt.plan.dense, "expert_plan": opt.experts.plan,
           "dp_rank": opt.rank, "tp_rank": opt.tp_rank, "edp_rank": opt.experts.rank}
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
            "allocated": seen[part].bytes,
            "adamw_size": grads.adamw.size,
        }
    return row


@functools.cache
def spawned() -> list[dict[int, list[dict]]]:
    return run_ranks(allocations_worker, WORLD, deadline_s=DEADLINE_S, collective_timeout_s=TIMEOUT_S)


def allocations(tp: int, c: int) -> list[dict]:
    """Every rank's allocations for case `c` at TP `tp`, in rank order."""
    return [r[tp][c] for r in spawned()]


def gpu(got: dict) -> int:
    """A rank's position in the dense part's (dp, tp) mesh: its `RankMemory`'s."""
    return got["dp_rank"] * got["plan"].tp + got["tp_rank"]


def dims(tp: int) -> LayerDims:
    from reference.tiny_moe import MOE_PRESETS

    moe = MOE_PRESETS[LAYOUTS[tp]]
    return LayerDims.gpt(layers=moe.layers, hidden=moe.hidden, heads=4, vocab=moe.vocab)


def part_memory(first: dict, part: str):
    """`canzona.memory` of one part on the run's own plan: the dense part over DP x TP, the
    experts of an EP rank over EDP."""
    from canzona.experts import dense_part, expert_part

    policy, _, impl = first["case"]
    spec = dense_part(first["spec"]) if part == "dense" else expert_part(first["spec"], EP)
    plan = first["plan"] if part == "dense" else first["expert_plan"]
    return memory_per_gpu(spec, plan, policy, dims(first["plan"].tp), replace(SETUP, reduce_scatter=impl), dp=plan.dp)


@functools.cache
def simulated(tp: int, c: int, collectives: str | None = None):
    """What `canzona simulate --tp <tp> --ep 2` reports per GPU for case `c` on the same model (its
    plans are the runtime's: `canzona.plan.plan_for` with the runtime's bucket sizing), under
    `collectives` (default: the runtime's for zero1, whose EP collectives it defines, else Megatron's)."""
    from canzona.dp.layout import DEFAULT_EXPERT_BUCKETS
    from sim.options import RunOptions
    from sim.simulate import SimConfig, simulate
    from sim.workload import Workload
    from tests.runtime.expert_runs import moe_architecture

    policy, optimizer, impl = CASES[c]
    spec = allocations(tp, c)[0]["spec"]
    cfg = SimConfig(model=spec.name, gpus=WORLD, tp=tp, ep=EP, optimizer=optimizer, policy=policy,
                    workload=Workload(seq_len=8, global_batch=WORLD, param_bytes=2, grad_bytes=4),
                    bucket_size=BUCKET, expert_buckets=DEFAULT_EXPERT_BUCKETS, zero1_fallback=False,
                    options=RunOptions(reduce_scatter=impl, collectives=collectives or (
                        "runtime" if policy == "zero1" else "megatron")),
                    matrix_config=matrix_config_of(optimizer))
    return simulate(cfg, model=(spec, moe_architecture(spec.name, LAYOUTS[tp]))).memory


@pytest.mark.parametrize(("tp", "c"), RUNS, ids=IDS)
def test_each_parts_persistent_buffers_are_what_the_memory_model_counts(tp, c):
    ranks = allocations(tp, c)
    for part in PARTS:
        predicted = part_memory(ranks[0], part)
        for got in ranks:
            want = predicted.ranks[gpu(got) if part == "dense" else got["edp_rank"]]
            assert got[part]["grad_dtypes"] == {"torch.float32"}  # fp32 main grads, no bf16 copy
            for k in PERSISTENT:
                assert got[part][k] == getattr(want, k), (tp, CASES[c], part, got["dp_rank"], got["tp_rank"], k)


@pytest.mark.parametrize(("tp", "c"), RUNS, ids=IDS)
def test_each_gpu_holds_what_the_simulator_reports_under_ep(tp, c):
    memory = simulated(tp, c)
    for got in allocations(tp, c):
        want = memory.ranks[gpu(got)]
        for k in PERSISTENT:
            assert got["dense"][k] + got["experts"][k] == getattr(want, k), (tp, CASES[c], gpu(got), k)


@pytest.mark.parametrize(("tp", "c"), RUNS, ids=IDS)
def test_the_reduce_scatter_buffers_of_both_parts_peak_where_the_model_says(tp, c):
    """Each communicator's high-water mark (gloo: with the scratch copy of a loop of reduces);
    the simulator's figure (NCCL's, no scratch) adds both parts', in flight together."""
    ranks = allocations(tp, c)
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
            assert got[part]["reduction"] == on_gloo[r] == got[part]["allocated"], (tp, CASES[c], part, gpu(got))
    for collectives in ("megatron", "runtime"):  # one fact: Megatron's baseline allocates what the runtime does
        memory = simulated(tp, c, collectives)
        for got in ranks:
            assert memory.ranks[gpu(got)].reduction == nccl["dense"][got["dp_rank"]] + nccl["experts"][got["edp_rank"]]


# --- master_weights=False -----------------------------------------------------------------------

# DistributedOptimizer(master_weights=False) under EP: no masters, bf16 gradient buffers in both
# parts, the state that follows the update in bf16 (the experts' Muon momentum and AdamW moments too)
NO_MASTER_CASES = [("canzona", "muon", "native"), ("zero1", "adamw", "native"), ("canzona", "normuon", "native")]


def no_master_worker(rank: int, world: int) -> dict[int, list[dict]]:
    from torch.distributed.device_mesh import init_device_mesh

    experts = init_device_mesh("cpu", (world // EP, EP), mesh_dim_names=("edp", "ep"))
    out = {}
    for tp, preset in LAYOUTS.items():
        dense = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp")) if tp > 1 else None
        out[tp] = [case_allocations(case, preset, world // tp, dense, experts, master_weights=False)
                   for case in NO_MASTER_CASES]
    return out


@functools.cache
def no_master_spawned() -> list[dict[int, list[dict]]]:
    return run_ranks(no_master_worker, WORLD, deadline_s=DEADLINE_S, collective_timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("tp", list(LAYOUTS))
@pytest.mark.parametrize("c", range(len(NO_MASTER_CASES)))
def test_without_masters_each_gpu_holds_what_the_simulator_reports_under_ep(tp, c):
    """`canzona simulate --ep 2 --no-master-weights`: per GPU, both parts' persistent buffers added."""
    from canzona.dp.layout import DEFAULT_EXPERT_BUCKETS
    from sim.options import RunOptions
    from sim.simulate import SimConfig, simulate
    from sim.workload import Workload
    from tests.runtime.expert_runs import moe_architecture

    policy, optimizer, impl = NO_MASTER_CASES[c]
    ranks = [r[tp][c] for r in no_master_spawned()]
    spec = ranks[0]["spec"]
    cfg = SimConfig(model=spec.name, gpus=WORLD, tp=tp, ep=EP, optimizer=optimizer, policy=policy,
                    workload=Workload(seq_len=8, global_batch=WORLD, param_bytes=2, grad_bytes=2, master_weights=False),
                    bucket_size=BUCKET, expert_buckets=DEFAULT_EXPERT_BUCKETS, zero1_fallback=False,
                    options=RunOptions(reduce_scatter=impl, collectives="runtime" if policy == "zero1" else "megatron"),
                    matrix_config=matrix_config_of(optimizer))
    want = simulate(cfg, model=(spec, moe_architecture(spec.name, LAYOUTS[tp]))).memory
    for got in ranks:
        assert got["dense"]["grad_dtypes"] == {"torch.bfloat16"}  # (the experts' empty AdamW buffer is fp32)
        for k in PERSISTENT:
            assert got["dense"][k] + got["experts"][k] == getattr(want.ranks[gpu(got)], k), \
                (tp, NO_MASTER_CASES[c], gpu(got), k)
