"""The loss's cross-entropy paths (sim/cross_entropy.py, docs/design.md §4.3) and the optimizer's
fp32-master remainders (canzona/memory.py, §7.1), as options of the simulator and as the published
rows' recipes set them (§9.6): bytes counted by hand from the kernels' code, the default the
unfused loss and full masters, and a bad setting one line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from canzona.cost import DeviceRate
from canzona.errors import SpecError
from canzona.hardware import load_profile
from canzona.memory import MemorySetup
from canzona.models import resolve_model
from sim import cross_entropy as ce
from sim import published
from sim.model_work import micro_batch_work
from sim.simulate import SimConfig, simulate
from sim.workload import Workload

RUNS, SOURCES = published.load()
BY_ID = {r.id: r for r in RUNS}
RAWS = {r["id"]: r for r in json.loads(published.PUBLISHED_RUNS.read_text())["rows"]}


def test_each_path_moves_its_bytes_a_logit():
    """Per bf16 logit: unfused Megatron 38 forward (cast 6, max 4, subtract 8, exp 8, sum 4,
    divide 8) and 14 backward (scale 8, cast 6); native, its four compiled functions, 30 forward
    (cast and max 6; subtract, exp and sum in place 8 plus Inductor's copy-back 8; divide 8) and
    18 backward (clone for the scatter 8, scale written back 8 and cast 2); Transformer Engine's
    Triton kernels 6 forward (online-softmax read 2, gradient read 2 and write 2) and 4 backward
    (in-place scaling)."""
    t, v = 16, 100
    by_hand = {ce.UNFUSED: (6 + 4 + 8 + 8 + 4 + 8, 8 + 6), ce.NATIVE: (6 + 8 + 8 + 8, 8 + 8 + 2), ce.TE: (2 + 2 + 2, 2 + 2)}
    for path, (fwd, bwd) in by_hand.items():
        f, b = ce.loss_kernels(t, v, False, path), ce.loss_kernels(t, v, True, path)
        assert len(f) == len(b) == 1  # one launch each way
        assert f[0].bytes == pytest.approx(t * v * fwd) and b[0].bytes == pytest.approx(t * v * bwd)
    with pytest.raises(SpecError, match="unknown cross-entropy path"):
        ce.loss_kernels(t, v, False, "liger")


def test_megatron_options_select_the_path_and_default_to_unfused():
    assert Workload().cross_entropy == ce.UNFUSED  # Megatron's default, canzona's examples' upcast loss
    assert Workload(cross_entropy_loss_fusion=True).cross_entropy == ce.NATIVE  # Megatron's default impl
    assert Workload(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te").cross_entropy == ce.TE
    with pytest.raises(SpecError, match="changes nothing without --cross-entropy-loss-fusion"):
        Workload(cross_entropy_fusion_impl="te")  # the impl alone fuses nothing: a mistake, not a no-op
    with pytest.raises(SpecError, match="unknown cross_entropy_fusion_impl 'linear'"):
        Workload(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="linear")
    with pytest.raises(SpecError, match="eager kernels run the unfused loss"):
        Workload(cross_entropy_loss_fusion=True, kernels="eager")
    # memory: TE's kernels overwrite the logits with their gradient, no fp32 copy of them is kept
    assert Workload().loss_copy_bytes == 4 and Workload(cross_entropy_loss_fusion=True).loss_copy_bytes == 4
    assert Workload(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te").loss_copy_bytes == 0


def test_the_head_stage_pays_the_paths_bytes_and_nothing_else_moves():
    """On the last stage of Qwen3-0.6B (vocab 151,936) the head's forward and backward differ
    between paths by exactly the loss passes' bandwidth time; the layers are identical."""
    spec, arch = resolve_model("qwen3-0.6b", 1)
    rate = DeviceRate.from_profile(load_profile("h100-sxm"))
    t = 2048

    def work(path):
        return micro_batch_work(spec, 1, t, t, arch.q_dim, arch.hidden, arch.vocab, rate, kv_dim=arch.kv_dim,
                                cross_entropy=path)

    def seconds(path, backward):
        return sum(rate.kernel_seconds(k) for k in ce.loss_kernels(t, arch.vocab, backward, path))

    base = work(ce.UNFUSED)
    for path in (ce.NATIVE, ce.TE):
        w = work(path)
        assert w.forward == base.forward and w.backward == base.backward
        assert base.head_forward_s - w.head_forward_s == pytest.approx(seconds(ce.UNFUSED, False) - seconds(path, False))
        assert base.head_backward_s - w.head_backward_s == pytest.approx(seconds(ce.UNFUSED, True) - seconds(path, True))
        # both fused paths move fewer bytes over forward and backward (native's backward more: its clone)
        assert w.head_forward_s + w.head_backward_s < base.head_forward_s + base.head_backward_s
    assert work(ce.NATIVE).head_backward_s > base.head_backward_s
    with pytest.raises(SpecError, match="unknown cross-entropy path"):
        work("fused")


def test_store_param_remainders_keeps_half_of_each_master():
    plain, rem = MemorySetup(), MemorySetup(store_param_remainders=True)
    assert plain.master_bytes == 4 and rem.master_bytes == 2
    assert rem.update_bytes == plain.update_bytes == 4  # updates still apply to fp32 masters
    with pytest.raises(SpecError, match="needs master weights and 2-byte parameters"):
        MemorySetup(store_param_remainders=True, param_bytes=4)
    with pytest.raises(SpecError, match="without masters"):
        MemorySetup(store_param_remainders=True, master_weights=False)
    assert MemorySetup.from_workload(Workload(store_param_remainders=True)).master_bytes == 2
    with pytest.raises(SpecError, match="store_param_remainders must be"):
        Workload(store_param_remainders="yes")
    cfg = SimConfig(model="qwen3-0.6b", gpus=8, tp=1, optimizer="adamw", fsdp=True,
                    workload=Workload(global_batch=8, store_param_remainders=True))
    with pytest.raises(SpecError, match="--store-param-remainders is the distributed optimizer's"):
        cfg.check()


def test_simulation_moves_time_by_the_loss_and_memory_by_the_masters():
    base = SimConfig(model="qwen3-0.6b", gpus=8, tp=1, optimizer="adamw", workload=Workload(global_batch=16))
    r0 = simulate(base)
    te = simulate(replace(base, workload=replace(base.workload, cross_entropy_loss_fusion=True,
                                                 cross_entropy_fusion_impl="te")))
    rem = simulate(replace(base, workload=replace(base.workload, store_param_remainders=True)))
    assert te.iteration_time_s < r0.iteration_time_s
    w0, wt, wr = (r.memory.worst for r in (r0, te, rem))
    assert w0.activations - wt.activations == 4096 * 151936 * 4  # the fp32 copy of one micro-batch's logits
    assert rem.iteration_time_s == r0.iteration_time_s
    assert w0.master_weights == 2 * wr.master_weights and w0.weights == wr.weights and w0.grads == wr.grads


def test_published_rows_carry_what_their_recipes_set():
    """The DGX Cloud rows (NeMo 24.09 launcher configs: cross_entropy_loss_fusion true) run the
    native path, Megatron-Bridge's recipes TE's; NeMo 24.07's configs did not set it (unfused).
    Remainders where the optimizer keeps them: NeMo's Apex DistributedFusedAdam (bf16 model, fp32
    optimizer; not with FP8 weights, fp8_params, whose masters NeMo stores whole) and
    Megatron-Bridge's precision-aware optimizer (the Qwen3 rows); nowhere else."""
    path = {r.id: r.sim_config().workload.cross_entropy for r in RUNS}
    rem = {r.id for r in RUNS if r.sim_config().workload.store_param_remainders}
    for rid, p in path.items():
        if "dgxc" in rid:
            assert p == ce.NATIVE and "cross_entropy_loss_fusion: true" in BY_ID[rid].recipe_source
        elif BY_ID[rid].source.startswith("mb-"):
            source = BY_ID[rid].recipe_source
            assert p == ce.TE and ("'te'" in source or "impl te" in source)
        else:
            assert p == ce.UNFUSED
    expected = {r.id for r in RUNS if "nemo24.07" in r.id or ("70b" in r.id and "dgxc" in r.id)
                or ("405b" in r.id and "dgxc" in r.id and r.precision == "bf16")} | \
        {"qwen3-8b-16xh100-mb", "qwen3-30b-a3b-16xh100-mb", "qwen3-30b-a3b-16xh100-mb-perf",
         "qwen3-30b-a3b-16xh100-ab-no-overlap"}
    assert rem == expected
    assert all("store_param_remainders" in BY_ID[r].recipe_source for r in rem)


def test_bad_recipe_settings_are_one_line():
    raw = RAWS["qwen3-8b-16xh100-mb"]
    with pytest.raises(SpecError, match="cross_entropy_loss_fusion must be true, false or null"):
        published.parse_run({**raw, "cross_entropy_loss_fusion": "yes"}, SOURCES, "row")
    with pytest.raises(SpecError, match="cross_entropy_fusion_impl must be one of native, te"):
        published.parse_run({**raw, "cross_entropy_loss_fusion": None}, SOURCES, "row")
    with pytest.raises(SpecError, match="cross_entropy_fusion_impl must be one of"):
        published.parse_run({**raw, "cross_entropy_fusion_impl": "linear"}, SOURCES, "row")
    with pytest.raises(SpecError, match="fused kernels"):
        published.parse_run({**RAWS["llama3-8b-64xa100-torchtitan"], "cross_entropy_loss_fusion": True},
                            SOURCES, "row")
    with pytest.raises(SpecError, match="true on a ZeRO-1 row"):
        published.parse_run({**RAWS["qwen3-30b-a3b-8xh100-automodel"], "store_param_remainders": True},
                            SOURCES, "row")
    with pytest.raises(SpecError, match="needs recipe_source"):
        published.parse_run({**RAWS["llama3-70b-64xh100-mb26.02-fp8"], "recipe_source": ""}, SOURCES, "row")


def test_qwen3_8b_row_memory_by_the_recipe():
    """Qwen3-8B's recipe (TE cross-entropy, precision-aware optimizer): against the row with both
    unset, the fp32 copy of the micro-batch's logits (4096 x 151,936 x 4 bytes) and half of each
    DP-16 shard's fp32 masters are gone; nothing else moves."""
    run = BY_ID["qwen3-8b-16xh100-mb"]
    now = published.compare_run(run).memory
    before = published.compare_run(replace(run, cross_entropy_loss_fusion=None, cross_entropy_fusion_impl=None,
                                           store_param_remainders=None)).memory
    assert before["activations"] - now["activations"] == 4096 * 151936 * 4
    assert before["master_weights"] == 2 * now["master_weights"]
    assert before["weights"] == now["weights"] and before["grads"] == now["grads"]
    assert before["adamw_state"] == now["adamw_state"]
