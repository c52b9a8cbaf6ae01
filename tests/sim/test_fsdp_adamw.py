"""FSDP2 with AdamW, FSDP with expert parallelism, and torchtitan's selective-op recompute in the
simulator (issue 22): the published FSDP rows' layouts. Counts of collectives, memory terms worked
out by hand, and relations between recompute modes; no absolute times."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from canzona.errors import SpecError
from canzona.memory import LayerDims, MemorySetup, layer_activation_bytes
from canzona.models import resolve_model
from canzona.recompute import RECOMPUTE_MODES, SELECTIVE_LAYER, mm_saved
from sim import published
from sim.options import RunOptions
from sim.simulate import SimConfig, compare, compared_policies, simulate
from sim.workload import Workload
from tests.cli_helpers import error_line, invoke

SMALL = Workload(seq_len=1024, global_batch=16, micro_batch=1)
ADAMW = SimConfig(model="qwen3-1.7b", gpus=8, tp=1, optimizer="adamw", fsdp=True, workload=SMALL)
MOE = SimConfig(model="qwen3-30b-a3b", gpus=8, tp=1, ep=8, optimizer="adamw", fsdp=True,
                workload=Workload(seq_len=512, global_batch=8, micro_batch=1))


@pytest.fixture(scope="module")
def adamw():
    return simulate(ADAMW)


def _comm(result, needle: str) -> int:
    return sum(needle in s.name for s in result.spans if s.phase == "A" and s.kind == "comm")


def test_adamw_fsdp_gathers_twice_and_reduces_once_per_unit(adamw):
    layers = resolve_model("qwen3-1.7b")[1].layers
    m = SMALL.micro_batches(8)
    assert adamw.iteration_time_s > 0 and adamw.optimizer_step_s > 0
    # reshard after forward: every layer gathered before its forward and again before its backward
    assert _comm(adamw, "fwd all-gather layer") == layers * m
    assert _comm(adamw, "bwd all-gather layer") == layers * m
    assert _comm(adamw, "reduce-scatter layer") == layers * m
    # AdamW steps each rank's shards: no exchange in the step
    assert not any(s.kind == "comm" for s in adamw.spans if s.phase == "B")
    assert compared_policies("adamw", fsdp=True) == ("zero1",)
    assert [r.config.policy for r in compare(ADAMW)] == ["zero1"]


def test_adamw_fsdp_memory_is_the_sharded_terms_by_hand(adamw):
    """Rank 0 holds torch.chunk's first row block of every parameter: fp32 (the parameter is the
    fp32 shard under MixedPrecisionPolicy), its fp32 gradient, and AdamW's two fp32 moments."""
    spec, _ = resolve_model("qwen3-1.7b")
    s = 8
    held = sum(-(-p.shape[0] // s) * math.prod(p.shape[1:]) for p in spec.params)
    r0 = adamw.memory.ranks[0]
    assert r0.weights == 0 and r0.matrix_state == 0 and r0.step_buffers == 0
    assert r0.master_weights == 4 * held and r0.grads == 4 * held and r0.adamw_state == 8 * held
    # in flight: two layers' bf16 parameters gathered and one layer's fp32 gradient unsharded
    layer = sum(p.numel for p in spec.params if p.layer == 0)
    root = sum(p.numel for p in spec.params if p.layer is None)
    biggest = max(layer, root)
    assert r0.reduction == 2 * biggest * 2 + biggest * 4


def test_no_reshard_after_forward_gathers_once_and_holds_every_unit(adamw):
    """FSDP2's reshard_after_forward=False (NeMo AutoModel's MoE apply_fsdp): the backward gathers
    nothing, and at its start every unit's bf16 parameters are gathered (the root's and every
    layer's) beside one unit's fp32 gradient; the compute is the same, so the iteration is no
    slower."""
    kept = simulate(replace(ADAMW, reshard_after_forward=False))
    spec, arch = resolve_model("qwen3-1.7b")
    m = SMALL.micro_batches(8)
    assert _comm(kept, "fwd all-gather layer") == arch.layers * m
    assert _comm(kept, "bwd all-gather layer") == 0
    assert _comm(kept, "reduce-scatter layer") == arch.layers * m
    layer = sum(p.numel for p in spec.params if p.layer == 0)
    root = sum(p.numel for p in spec.params if p.layer is None)
    assert kept.memory.ranks[0].reduction == (arch.layers * layer + root) * 2 + max(layer, root) * 4
    assert kept.memory.ranks[0].reduction > adamw.memory.ranks[0].reduction
    assert kept.iteration_time_s <= adamw.iteration_time_s
    assert kept.to_dict()["fsdp"]["reshard_after_forward"] is False
    assert adamw.to_dict()["fsdp"]["reshard_after_forward"] is True


def test_no_reshard_after_forward_copies_out_only_what_it_gathers():
    """FSDP2's copy-out follows each all-gather (sim.fsdp_copies): a backward that gathers nothing
    copies nothing out. The MoE layers' copy-outs are spans of their own (the dispatch splits the
    unit's compute), so they can be counted."""
    def copy_outs(reshard: bool) -> tuple[int, int]:
        names = [s.name for s in simulate(replace(MOE, reshard_after_forward=reshard)).spans
                 if s.rank == 0 and "all-gather copy-out" in s.name]
        return len([n for n in names if " fwd " in n]), len([n for n in names if " bwd " in n])

    arch = resolve_model("qwen3-30b-a3b")[1]
    m = MOE.workload.micro_batches(8)
    assert copy_outs(True) == ((arch.layers + 1) * m, arch.layers * m)  # the root once a micro-batch
    assert copy_outs(False) == ((arch.layers + 1) * m, 0)


def test_reshard_after_forward_is_checked_and_a_cli_option():
    with pytest.raises(SpecError, match="needs --fsdp"):
        replace(ADAMW, fsdp=False, reshard_after_forward=False).check()
    with pytest.raises(SpecError, match="True or False"):
        replace(ADAMW, reshard_after_forward="no").check()
    args = ["simulate", "--model", "qwen3-1.7b", "--gpus", "8", "--tp", "1", "--optimizer", "adamw",
            "--seq-len", "1024", "--global-batch", "16", "--micro-batch", "1"]
    error_line(invoke(*args, "--no-reshard-after-forward"), "needs --fsdp")
    ok = invoke(*args, "--fsdp", "--no-reshard-after-forward", "--json")
    assert ok.exit_code == 0, ok.output
    assert '"reshard_after_forward": false' in ok.stdout


def test_fsdp_with_ep_dispatches_and_shards_the_dense_part():
    result = simulate(MOE)
    spec, arch = resolve_model("qwen3-30b-a3b")
    m = MOE.workload.micro_batches(8)
    assert result.iteration_time_s > 0
    # each MoE layer's experts between a dispatch and a combine, forward and backward
    assert _comm(result, "dispatch") == 2 * arch.layers * m == _comm(result, "combine")
    assert _comm(result, "fwd all-gather layer") == arch.layers * m
    # EP 8 of DP 8: the experts' DP group outside EP is one rank, nothing to gather or reduce for them
    assert not any(s.name.endswith(" experts") for s in result.spans if s.kind == "comm")
    r0 = result.memory.ranks[0]
    experts = sum(p.numel for p in spec.params if p.role.name == "EXPERT") // 8
    dense = sum(-(-p.shape[0] // 8) * math.prod(p.shape[1:]) for p in spec.params if p.role.name != "EXPERT")
    assert r0.grads == 4 * (dense + experts) and r0.adamw_state == 8 * (dense + experts)
    # in flight: the largest unit's dense parameters (bf16, twice) and gradient (fp32); the experts stay in place
    unit = max(sum(p.numel for p in spec.params if p.layer == k and p.role.name != "EXPERT")
               for k in [None, *range(arch.layers)])
    assert r0.reduction == 2 * unit * 2 + unit * 4
    # at 16 GPUs the experts are FSDP'd over 2 ranks: their own gathers and reduce-scatters
    wl = Workload(seq_len=512, global_batch=16, micro_batch=1)
    wider = simulate(replace(MOE, gpus=16, workload=wl))
    m = wl.micro_batches(16)
    gathers = [s.name for s in wider.spans if s.kind == "comm" and "all-gather layer" in s.name]
    assert sum(n.endswith(" experts") for n in gathers) == 2 * arch.layers * m  # beside each layer's, fwd and bwd
    assert _comm(wider, "reduce-scatter layer") == 2 * arch.layers * m  # the dense part's and the experts'
    assert wider.memory.ranks[0].adamw_state < r0.adamw_state


@pytest.mark.parametrize("changes, needle", [
    (dict(policy="canzona"), "each rank steps its own shards"),
    (dict(optimizer="muon", policy="canzona"), "with an elementwise optimizer"),
    (dict(gpus=16, hsdp_replicate=2, workload=Workload(seq_len=512, global_batch=16, micro_batch=1)),
     "without HSDP"),
    (dict(pp=2, ep=4), "without --vp, --ep or --hsdp-replicate"),
    (dict(ep=4, etp=2), "at etp 1 without HSDP"),
    (dict(router_imbalance=1.5), "without a persistent router skew"),
])
def test_bad_fsdp_combinations_refused(changes, needle):
    with pytest.raises(SpecError, match=needle):
        replace(MOE, **changes).check()


def test_cli_fsdp_adamw_and_one_line_errors():
    args = ("simulate", "--model", "qwen3-1.7b", "--gpus", 8, "--tp", 1, "--fsdp", "--optimizer", "adamw", "--global-batch", 16,
            "--seq-len", 1024)
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert "FSDP over 8), adamw, policy zero1" in " ".join(result.stdout.split())
    error_line(invoke(*args, "--policy", "canzona"), "each rank steps its own shards")
    error_line(invoke(*args, "--recompute", "selective-ops"), "unknown recompute mode 'selective-ops'")


def test_selective_op_saves_every_other_mm_by_hand():
    """Llama3-8B, per token: the layer input, wq's, wv's, w1's (gate) and w2's (down) outputs, the
    attention output and its fp32 log-sum-exp; wk, wo, w3 and the elementwise ops recomputed."""
    assert [mm_saved(i) for i in range(7)] == [True, False, True, False, True, False, True]
    dims = LayerDims(32, 4096, 32, 14336, 128256, 8, 128, gated_mlp=True, dropout=False, qk_norm=False)
    setup = MemorySetup(seq_len=8192, micro_batch=1, recompute="selective-op")
    e = setup.activation_bytes
    per_token = e * (4096 + 4096 + 1024 + 14336 + 4096) + e * 4096 + 4 * 32
    assert layer_activation_bytes(dims, setup, 1) == pytest.approx(8192 * per_token)
    # every mode that stores alike in every layer (selective-layer stores by position: its own tests)
    sizes = [layer_activation_bytes(dims, replace(setup, recompute=m), 1) for m in RECOMPUTE_MODES
             if m != SELECTIVE_LAYER]
    assert sizes == sorted(sizes, reverse=True)  # none >= selective > selective-op > full


@pytest.mark.parametrize("fsdp", [False, True])
def test_selective_op_between_none_and_full(fsdp):
    base = SimConfig(model="canzona/data/models/llama3-8b.json", gpus=8, tp=1, optimizer="adamw", fsdp=fsdp,
                     workload=Workload(seq_len=2048, global_batch=8, micro_batch=1))
    runs = {m: simulate(replace(base, options=RunOptions(recompute=m))) for m in ("none", "selective-op", "full")}
    t = {m: r.iteration_time_s for m, r in runs.items()}
    mem = {m: r.memory.worst.activations for m, r in runs.items()}
    assert t["none"] < t["selective-op"] < t["full"]
    assert mem["none"] > mem["selective-op"] > mem["full"]


def test_published_fsdp_rows_are_expressible():
    runs, _ = published.load()
    rows = [r for r in runs if r.fsdp]
    assert rows and any(r.precision == "fp8" for r in rows)
    for run in rows:
        assert run.needs() == (), run.id
    assert any(r.recompute == "selective-op" for r in rows) and any(r.ep > 1 for r in rows)
