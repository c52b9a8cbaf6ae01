"""The FSDP2 / ZeRO-3 and HSDP layout in the simulator (issue 21, sim.fsdp): relations between its
three step policies, its memory against ZeRO-1's, HSDP's replicate all-reduce, the option's checks,
the default layout left as it was, and FSDP x TP (torchtitan's composition, as the runtime runs it:
owners over the DP x TP exchange group). Relations only, no absolute times."""

from __future__ import annotations

from dataclasses import replace

import pytest

from canzona.errors import SpecError
from canzona.plan import DEFAULT_GEOMETRY, PLAN_DEFAULTS
from canzona.step_options import STEP_DEFAULTS
from canzona.step_policies import FSDP_POLICIES, STEP_POLICIES
from canzona.tp import Capacity
from sim.options import RunOptions
from sim.simulate import SimConfig, compare, compared_policies, simulate
from sim.workload import Workload
from tests.cli_helpers import error_line, invoke

BASE = SimConfig(model="qwen3-8b", gpus=64, tp=1, fsdp=True)


@pytest.fixture(scope="module")
def results():
    return {r.config.policy: r for r in compare(BASE)}


def test_compare_runs_the_fsdp_policies(results):
    assert tuple(results) == tuple(FSDP_POLICIES) == ("canzona", "fsdp-gather-all", "fsdp-owners-unbalanced")
    # phase A is the policies' common ground: the same forward, backward and reductions
    assert len({round(r.grad_sync_end_s, 9) for r in results.values()}) == 1


def test_canzona_step_below_gather_all(results):
    cz, ga = results["canzona"], results["fsdp-gather-all"]
    assert cz.optimizer_step_s < ga.optimizer_step_s
    assert cz.iteration_time_s < ga.iteration_time_s
    # gather-all computes every matrix on every rank: each rank's compute is the whole model's
    assert min(ga.rank_optimizer_s) > 10 * max(cz.rank_optimizer_s)


def test_unbalanced_owners_no_faster(results):
    cz, rr = results["canzona"], results["fsdp-owners-unbalanced"]
    assert rr.optimizer_step_s >= cz.optimizer_step_s
    assert max(rr.rank_optimizer_s) >= max(cz.rank_optimizer_s)


def test_fsdp_memory_below_zero1(results):
    zero1 = simulate(replace(BASE, fsdp=False, policy="zero1-gather"))
    for r in results.values():
        assert r.memory.worst.total < zero1.memory.worst.total
        assert r.memory.worst.grads < zero1.memory.worst.grads


def test_per_layer_gathers_and_reduce_scatters(results):
    names = [s.name for s in results["canzona"].spans if s.phase == "A" and s.kind == "comm"]
    # 36 layers gathered in forward and in backward, reduced after backward, per micro-batch (2 here)
    assert sum("fwd all-gather layer" in n for n in names) == 36 * 2
    assert sum("bwd all-gather layer" in n for n in names) == 36 * 2
    assert sum("reduce-scatter layer" in n for n in names) == 36 * 2
    assert not any("over replicas" in n for n in names)


def test_hsdp_prices_the_replicate_all_reduce():
    r = simulate(replace(BASE, hsdp_replicate=2))
    replicas = [s for s in r.spans if "over replicas" in s.name]
    assert len(replicas) == 37 and all(s.end > s.start for s in replicas)  # 36 layers and the root, once
    assert r.to_dict()["fsdp"] == {"shard": 32, "replicate": 2, "reshard_after_forward": True,
                                   "impl": "fsdp2"}  # torch's FSDP2 by default
    assert r.memory.dp == 64 and len(r.memory.ranks) == 32


@pytest.mark.parametrize("changes, needle", [
    (dict(hsdp_replicate=3), "must divide the 64"),
    (dict(hsdp_replicate=64), "shard group of 1 rank"),
    # TP taking every GPU (canzona simulate's default --tp 8 on 8 GPUs): the layout's own DP, not HSDP's, is named
    (dict(gpus=8, tp=8), "leaves 1: lower --tp"),
    (dict(fsdp=False, hsdp_replicate=2), "needs --fsdp"),
    # FSDP x TP and FSDP x PP run (sim.fsdp_pipeline: torchtitan's 1F1B); not with a virtual pipeline
    (dict(pp=2, vp=2), "without --vp, --ep or --hsdp-replicate"),
    (dict(tp=2, options=RunOptions(overlap_step=True)), "without --overlap-step"),
    (dict(model="qwen3-30b-a3b", tp=2), "simulated for dense models"),
    # a whole-matrix optimizer over stacked experts: FsdpOptimizer refuses the stacks (adamw runs them)
    (dict(model="qwen3-30b-a3b", gpus=8), "muon over stacked experts is not run under FSDP2"),
    (dict(policy="zero1-gather"), "unknown policy 'zero1-gather' under --fsdp"),
    (dict(optimizer="adamw", policy="canzona"), "each rank steps its own shards"),
    # DistributedOptimizer's ZeRO-1 options that FsdpOptimizer takes and ignores (sim.fsdp._check_zero1_step_options)
    (dict(options=RunOptions(reduce_scatter="padded")), "--reduce-scatter padded is the distributed optimizer's"),
    (dict(geometry="whole"), "--geometry whole chooses the ZeRO-1 layout's segments"),
    (dict(tp=2, tp_policy="tp-chunk"), "--tp-policy tp-chunk schedules the ZeRO-1 layout's TP micro-groups"),
    (dict(tp=2, tp_mode="serial"), "--tp-mode serial orders the ZeRO-1 layout's TP micro-groups"),
    (dict(capacity=Capacity(2 ** 30, "bytes")), "--capacity sizes the ZeRO-1 layout's TP micro-groups"),
    (dict(optimizer="adamw", policy=None, tp_mode="serial"), "--tp-mode serial"),  # no owners: no TP schedule either
    # canzona's owner plan settings under the baselines, whose owners no plan places: the run was the default's
    (dict(policy="fsdp-gather-all", alpha=0.5), "alpha 0.5: canzona's owner plan settings change nothing"),
    (dict(policy="fsdp-owners-unbalanced", balance_by="elements", bucket_size=50_000_000),
     "balance_by elements, bucket_size 50000000: canzona's owner plan settings change nothing"),
    (dict(policy="fsdp-owners-unbalanced", dp_policy="whole-start"), "dp_policy whole-start"),
    # AdamW's FSDP step has no owners at all: the same settings changed nothing there either
    (dict(optimizer="adamw", policy=None, bucket_size=50_000_000, align=256),
     "bucket_size 50000000, align 256: canzona's owner plan settings change nothing under an elementwise"),
])
def test_bad_layouts_refused(changes, needle):
    with pytest.raises(SpecError, match=needle):
        replace(BASE, **changes).check()


def test_compare_runs_the_baselines_without_canzonas_owner_plan_settings():
    """`compare --fsdp --alpha 0.5`: canzona plans its owners at the settings given; the baselines,
    which refuse them (no plan places their owners), run at the defaults, as `with_policy` runs the
    AdamW baseline without canzona's ZeRO-1 settings."""
    cfg = SimConfig(model="qwen3-0.6b", gpus=8, tp=1, fsdp=True, alpha=0.5, bucket_size=50_000_000,
                    workload=Workload(seq_len=256, global_batch=8))
    results = compare(cfg)
    assert [r.config.policy for r in results] == list(FSDP_POLICIES)
    assert [(r.config.alpha, r.config.bucket_size) for r in results] == \
        [(0.5, 50_000_000)] + [(PLAN_DEFAULTS.alpha, PLAN_DEFAULTS.bucket_size)] * 2


def test_zero1_step_options_at_their_defaults_are_accepted():
    """The ZeRO-1 options refused under --fsdp off their defaults stay accepted at them (what a
    user who names the default asks for is what runs)."""
    replace(BASE, tp=2, options=RunOptions(reduce_scatter=STEP_DEFAULTS.reduce_scatter), geometry=DEFAULT_GEOMETRY,
            tp_policy=PLAN_DEFAULTS.tp_policy, tp_mode=STEP_DEFAULTS.tp_mode, capacity=PLAN_DEFAULTS.capacity).check()


def test_cli_refuses_bad_sizes_with_one_line():
    result = invoke("simulate", "--model", "qwen3-8b", "--gpus", 64, "--tp", 1, "--fsdp", "--hsdp-replicate", 3)
    error_line(result, "--hsdp-replicate 3 must divide")
    result = invoke("compare", "--model", "qwen3-8b", "--gpus", 64, "--hsdp-replicate", 2)
    error_line(result, "needs --fsdp")


def test_default_layout_unchanged():
    assert SimConfig().fsdp is False and SimConfig().hsdp_replicate == 1
    assert compared_policies("muon") == tuple(STEP_POLICIES)
    assert "fsdp" not in simulate(SimConfig(model="qwen3-0.6b", gpus=8, tp=2,
                                            workload=Workload(seq_len=1024, global_batch=8))).to_dict()


def test_compare_under_fsdp_gives_speedups_against_the_fsdp_baselines():
    import json

    table = invoke("compare", "--model", "qwen3-1.7b", "--gpus", 16, "--tp", 1, "--fsdp", "--global-batch", 16)
    assert table.exit_code == 0, table.output
    text = table.stdout.replace("\n", " ")
    assert "vs fsdp-gather-all (ga) and fsdp-owners-unbalanced (un)" in text and "every-rank owners" in text
    rows = {r["policy"]: r for r in json.loads(invoke("compare", "--model", "qwen3-1.7b", "--gpus", 16, "--tp", 1,
                                                       "--fsdp", "--global-batch", 16, "--json").stdout)}
    assert rows["canzona"]["optimizer_step_s"] < rows["fsdp-gather-all"]["optimizer_step_s"]


def test_gather_all_holds_every_matrixs_kronecker_factors_and_a_share_of_its_moments():
    """Every rank computing every matrix (fsdp-gather-all) keeps its row shard of the moments (Muon's
    momentum: about canzona's share of the state) but all of Shampoo's / SOAP's Kronecker factors."""
    import json

    from canzona.cost import row_state_bytes, state_bytes

    assert row_state_bytes("muon", (64, 32)) == state_bytes("muon", (64, 32))
    assert 0 < row_state_bytes("soap", (64, 32)) < state_bytes("soap", (64, 32))

    def state(optimizer: str) -> dict[str, float]:
        out = invoke("compare", "--model", "qwen3-1.7b", "--gpus", 16, "--tp", 1, "--fsdp", "--global-batch", 16,
                     "--optimizer", optimizer, "--json")
        return {r["policy"]: r["memory"]["worst"]["matrix_state"] for r in json.loads(out.stdout)}

    muon, soap = state("muon"), state("soap")
    assert muon["fsdp-gather-all"] <= muon["canzona"]
    assert soap["fsdp-gather-all"] > 5 * soap["canzona"]


def test_owners_batch_same_shape_matrices_as_the_runtime():
    """Owner policies run an owner's same-shape matrices of a micro-group as one batched kernel
    (canzona.batching, as the FSDP runtime does): over 2 GPUs each owner holds several of every
    shape, so batch_kernels prices a shorter step; gather-all (muon_fsdp2) computes each alone."""
    from sim.options import RunOptions

    small = replace(BASE, model="qwen3-0.6b", gpus=2)
    for policy, faster in (("canzona", True), ("fsdp-owners-unbalanced", True), ("fsdp-gather-all", False)):
        on = simulate(replace(small, policy=policy))
        off = simulate(replace(small, policy=policy, options=RunOptions(batch_kernels=False)))
        if faster:
            assert max(on.rank_optimizer_s) < max(off.rank_optimizer_s), policy
        else:
            assert on.rank_optimizer_s == off.rank_optimizer_s, policy


# --- FSDP x TP (docs/design.md §2.8): TP compute and collectives in phase A, FSDP's collectives on
# TP-local parameters over each TP rank's shard group, owners over the DP x TP exchange group


@pytest.fixture(scope="module")
def tp_results(results):
    out = {1: results}
    for tp in (2, 4):
        out[tp] = {r.config.policy: r for r in compare(replace(BASE, tp=tp))}
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_fsdp_tp_runs_the_three_policies(tp_results, tp):
    results = tp_results[tp]
    assert tuple(results) == tuple(FSDP_POLICIES)
    assert len({round(r.grad_sync_end_s, 9) for r in results.values()}) == 1  # phase A is common ground
    cz, ga, rr = results["canzona"], results["fsdp-gather-all"], results["fsdp-owners-unbalanced"]
    assert cz.optimizer_step_s < ga.optimizer_step_s and cz.iteration_time_s < ga.iteration_time_s
    assert min(ga.rank_optimizer_s) > 10 * max(cz.rank_optimizer_s)
    assert rr.optimizer_step_s >= cz.optimizer_step_s
    # the step runs on the whole exchange group: DP x TP = 64 ranks, one memory row each
    assert len(cz.rank_optimizer_s) == 64 and len(cz.memory.ranks) == 64 and cz.memory.tp == tp
    assert {m.tp_rank for m in cz.memory.ranks} == set(range(tp))


def test_fsdp_tp_phase_a_runs_the_tp_blocks_and_gathers_per_micro_batch(tp_results):
    r = tp_results[2]["canzona"]
    names = [s.name for s in r.spans if s.phase == "A" and s.kind == "comm"]
    micro_batches = r.config.workload.micro_batches(32)  # DP 32: twice tp 1's micro-batches per rank
    assert micro_batches == 2 * BASE.workload.micro_batches(64)
    assert sum("fwd all-gather layer" in n for n in names) == 36 * micro_batches
    assert sum("reduce-scatter layer" in n for n in names) == 36 * micro_batches
    # sequence parallel: per layer's two blocks one all-gather in forward, two in backward, one reduce-scatter each
    assert sum(" tp all-gather" in n for n in names) == 36 * 2 * (1 + 2) * micro_batches
    assert sum(" tp reduce-scatter" in n for n in names) == 36 * 2 * 2 * micro_batches
    assert not any(" tp " in s.name for s in tp_results[1]["canzona"].spans)


def test_fsdp_tp_owners_and_pieces_over_the_exchange_group(tp_results):
    """Owners are planned over DP x TP (`fsdp_matrices(spec, dp * tp)`: 64 ranks at tp 1, 2 and 4)
    and every qwen3 matrix is TP-sharded, so each rank's piece is 1/64 of each matrix at every TP:
    the same owners, the same all-to-alls over the same 64 GPUs, the same matrix state."""
    def all_to_alls(r):
        spans = [s for s in r.spans if s.phase == "B" and s.name.endswith((" gather", " scatter"))]
        return spans, {s.name: round(s.end - s.start, 12) for s in spans}

    one, one_times = all_to_alls(tp_results[1]["canzona"])
    for tp in (2, 4):
        r = tp_results[tp]["canzona"]
        spans, times = all_to_alls(r)
        assert {s.rank for s in spans} == set(range(64))  # the all-to-alls span dp x tp ranks
        assert times == one_times
        assert r.memory.worst.matrix_state == tp_results[1]["canzona"].memory.worst.matrix_state


def test_fsdp_tp_memory(tp_results):
    """Per GPU: TP-sharded parameters' shards are 1/(S x T) of them, TP-replicated ones (the norms)
    1/S, so the gradient shard at TP 2 is tp 1's plus the norms' extra, under 1% on qwen3-8b;
    activations shrink with TP (sequence parallel), so the total does; and below ZeRO-1 at the same TP."""
    from canzona.models import resolve_model

    spec, _ = resolve_model("qwen3-8b", 2)
    local = sum(p.local_numel(2) for p in spec.params)
    one, two, four = (tp_results[t]["canzona"].memory.worst for t in (1, 2, 4))
    assert two.grads == -(-local // 32) * BASE.workload.grad_bytes
    assert one.grads <= two.grads < 1.01 * one.grads
    assert two.weights + two.grads + two.master_weights < 1.01 * (one.weights + one.grads + one.master_weights)
    assert four.activations < two.activations < one.activations
    assert four.total < two.total < one.total
    zero1 = simulate(replace(BASE, tp=2, fsdp=False, policy="zero1-gather"))
    assert two.total < zero1.memory.worst.total


def test_hsdp_with_tp():
    r = simulate(replace(BASE, tp=2, hsdp_replicate=2))
    assert r.to_dict()["fsdp"] == {"shard": 16, "replicate": 2, "reshard_after_forward": True, "impl": "fsdp2"}
    assert len([s for s in r.spans if "over replicas" in s.name]) == 37  # 36 layers and the root, once
    # one replica's exchange group: its 16 DP ranks x TP 2, consecutive ranks
    assert {s.rank for s in r.spans if s.phase == "B"} == set(range(32)) and len(r.memory.ranks) == 32


def test_cli_accepts_fsdp_with_tp():
    result = invoke("simulate", "--model", "qwen3-1.7b", "--gpus", 16, "--tp", 2, "--fsdp", "--global-batch", 16)
    assert result.exit_code == 0, result.output
    assert "owners over 8 x TP 2" in " ".join(result.stdout.split())
    result = invoke("compare", "--model", "qwen3-1.7b", "--gpus", 16, "--tp", 2, "--fsdp", "--hsdp-replicate", 2,
                    "--global-batch", 16)
    assert result.exit_code == 0, result.output
    result = invoke("simulate", "--model", "qwen3-1.7b", "--gpus", 16, "--tp", 2, "--fsdp", "--pp", 2, "--vp", 2)
    error_line(result, "without --vp, --ep or --hsdp-replicate")
