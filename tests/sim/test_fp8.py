"""`--precision fp8` (sim.fp8): the linear GEMMs priced at the FP8 rate, Transformer Engine's casts
and scaling present, attention and the head left in bf16, FP8 refused on a GPU without it, and
the memory TE keeps. No test bounds the simulated speed-up beyond "faster, but not 2x"."""

from __future__ import annotations

from dataclasses import replace

import pytest

from canzona.cost import DeviceRate, gemm_kernel
from canzona.errors import SpecError
from canzona.hardware import load_profile
from canzona.memory import FP8_WEIGHT_CACHE, MemorySetup, fp8_linear_params, layer_activation_bytes
from sim.collectives import collective_cost
from sim.fp8 import AMAX_BYTES, CAST_BYTES, CURRENT, DELAYED, FP8Setup, check_fp8_device, fp8_setup
from sim.model_work import _blocks_of, _fp8_block, micro_batch_work
from sim.published import load
from sim.simulate import SimConfig, layer_dims, model_of, simulate, stage_spec
from sim.workload import Workload

MODEL = "qwen3-0.6b"
TOKENS, SEQ = 4096, 4096


@pytest.fixture(scope="module")
def model():
    return model_of(SimConfig(model=MODEL))


@pytest.fixture(scope="module")
def rate():
    return DeviceRate.from_profile(load_profile("h100-sxm"))


def _work(model, rate, fp8=None, tp=1):
    spec, arch = model
    return micro_batch_work(spec, tp, TOKENS, SEQ, arch.q_dim, arch.hidden, arch.vocab, rate, fp8=fp8)


def _layer_blocks(model):
    spec, _ = model
    params = [p for p in spec.matrix_params() if p.layer == 0 and p.stacked_in is None]
    return _blocks_of(params)


def test_linear_gemms_are_priced_at_the_fp8_rate(model, rate):
    """A block's GEMM spans are the sum of its GEMMs as fp8 kernels; priced as bf16 they differ."""
    work = _work(model, rate, FP8Setup())
    block = work.forward[0][0]
    column = [p for p in _layer_blocks(model)[0] if p.tp_dim != 1]
    as_fp8 = sum(rate.kernel_seconds(gemm_kernel(p.name, TOKENS, *p.local_shape(1), "fp8")) for p in column)
    as_bf16 = sum(rate.kernel_seconds(gemm_kernel(p.name, TOKENS, *p.local_shape(1), "bf16")) for p in column)
    assert block.first_s == pytest.approx(as_fp8)
    # at these small shapes each GEMM's fixed latency (canzona.gemm_model) is a large share: 0.77
    assert as_fp8 < 0.85 * as_bf16
    # the fp8 rate is what moves them: a device whose fp8 rate is the bf16 one prices them as bf16's
    same = replace(rate, gemm_flops={**rate.gemm_flops, "fp8": rate.gemm_flops["bf16"]})  # a fresh price cache
    assert _work(model, same, FP8Setup()).forward[0][0].first_s > 1.3 * block.first_s


def test_attention_and_head_stay_bf16(model, rate):
    bf16, fp8 = _work(model, rate), _work(model, rate, FP8Setup())
    assert fp8.head_forward_s == bf16.head_forward_s and fp8.head_backward_s == bf16.head_backward_s


def test_cast_and_scaling_kernels_are_present(model, rate):
    """FP8's extra passes: the middle of every block grows by its casts (and the stage's amax
    work), current scaling costs more than delayed, and the casts move the bytes they should."""
    bf16 = _work(model, rate)
    setup = FP8Setup(micro_batches=4, amax_reduce_s=50e-6)
    fp8 = _work(model, rate, setup)
    blocks = _layer_blocks(model)
    extra = [f.middle_s - b.middle_s for f, b in zip(fp8.forward[0], bf16.forward[0])]
    casts = [_fp8_block(setup, [p for p in blk if p.tp_dim != 1], [p for p in blk if p.tp_dim == 1], TOKENS, 1,
                        rate)[0] for blk in blocks]
    assert all(c > 0 for c in casts)
    assert extra[0] == pytest.approx(casts[0])  # the amax work rides on the layer's last block
    assert extra[-1] > casts[-1] + setup.amax_reduce_s / len(fp8.layer_ids)
    assert all(f.middle_s > b.middle_s for f, b in zip(fp8.backward[0], bf16.backward[0]))
    current = _work(model, rate, replace(setup, recipe=CURRENT))
    assert current.forward[0][0].middle_s > fp8.forward[0][0].middle_s
    k = setup.cast("x", 1000, 64)
    assert k.bytes == 1000 * 64 * CAST_BYTES[DELAYED] and CAST_BYTES[CURRENT] > CAST_BYTES[DELAYED]
    # weights are cast once an iteration: more micro-batches, less cast per micro-batch
    assert setup.weight_cast("w", 10**6).count == pytest.approx(1 / 4)


def _layer_seconds(work) -> tuple[float, float]:
    """The forward and backward seconds of every layer of one micro-batch."""
    return (sum(b.seconds for layer in work.forward for b in layer),
            sum(b.seconds for layer in work.backward for b in layer))


@pytest.mark.parametrize("chunks", [1, 4])
def test_delayed_scaling_reduces_amaxes_once_per_model_chunk_and_pass(model, rate, chunks):
    """Megatron-Core enters one `fp8_autocast` per TransformerBlock forward, i.e. per model chunk
    and micro-batch (megatron/core/transformer/transformer_block.py, Megatron-Core 0.8, NeMo
    24.07's), and Transformer Engine 1.x all-reduces the amaxes at the region's exit and once more
    at the end of the backward of the region's first module (`reduce_and_update_fp8_tensors`,
    `reduce_and_update_bwd_fp8_tensors`): a stage pays the all-reduce `chunks` times a micro-batch
    in each pass, however many layers a chunk holds."""
    reduce_s = 40e-6
    free = _layer_seconds(_work(model, rate, FP8Setup(chunks=chunks)))
    paid = _layer_seconds(_work(model, rate, FP8Setup(chunks=chunks, amax_reduce_s=reduce_s)))
    assert paid[0] - free[0] == pytest.approx(chunks * reduce_s)
    assert paid[1] - free[1] == pytest.approx(chunks * reduce_s)


def test_amax_reduction_group_is_the_stage_across_nodes():
    """The amax reduction group is Megatron's TP x DP (x CP) group of the stage
    (`get_amax_reduction_group(with_context_parallel=True)`): on NeMo 24.07's Llama 2 70B layout
    (TP 4, PP 4, DP 4 on 8 nodes) 16 ranks on two nodes, priced over the network, dearer than the
    one-node TP group's all-reduce of one amax."""
    runs, _ = load()
    run = next(r for r in runs if r.id == "llama2-70b-64xh100-nemo24.07-fp8")
    cfg = run.sim_config()
    cluster, (spec, arch), hw = cfg.checked()
    stage = stage_spec(spec, cfg.pp, 0, arch.layers, cfg.vp, cfg.pipeline_split)
    setup = fp8_setup(cfg.workload, hw, cluster, stage, 0, cfg.vp)
    group = cluster.geometry(list(cluster.stage_ranks(0)))
    assert (group.size, group.nodes) == (cfg.tp * cluster.dp * cfg.cp, 2)
    assert setup.chunks == 20 and setup.micro_batches == 32
    amaxes = 3 * len(fp8_linear_params(stage)) * AMAX_BYTES
    assert setup.amax_reduce_s == collective_cost("all-reduce", amaxes, group, hw).seconds
    assert setup.amax_reduce_s > setup.tp_amax_s > 0


def test_the_simulation_gives_each_stage_its_model_chunks(monkeypatch):
    """The per-chunk count above reaches the simulation: `_simulate` builds every stage's FP8 setup
    with its VP model chunks (one `fp8_autocast` region each a micro-batch), so an interleaved
    stage pays the amax all-reduce VP times a pass, not once (the test above passes `cfg.vp`
    itself, so it cannot tell)."""
    import sim.simulate as simulate_module

    seen: list[FP8Setup] = []

    def spy(*args, **kwargs):
        setup = fp8_setup(*args, **kwargs)
        seen.append(setup)
        return setup

    monkeypatch.setattr(simulate_module, "fp8_setup", spy)
    cfg = SimConfig(model=MODEL, gpus=4, tp=1, pp=2, vp=2, optimizer="adamw",
                    workload=Workload(seq_len=512, global_batch=8, micro_batch=1, precision="fp8",
                                      fp8_recipe=DELAYED))
    simulate(cfg)
    assert len(seen) >= cfg.pp and {s.chunks for s in seen} == {cfg.vp}


def test_fp8_is_faster_than_bf16_but_not_twice():
    def run(precision):
        cfg = SimConfig(model="qwen3-32b", gpus=16, tp=8, optimizer="adamw", policy="zero1",
                        workload=Workload(seq_len=4096, global_batch=8, precision=precision))
        return simulate(cfg)

    bf16, fp8 = run("bf16"), run("fp8")
    assert bf16.iteration_time_s / 2 < fp8.iteration_time_s < 0.95 * bf16.iteration_time_s
    assert fp8.breakdown["compute_s"] < bf16.breakdown["compute_s"]


def test_fp8_needs_fp8_tensor_cores():
    with pytest.raises(SpecError, match="a100-sxm has no FP8 tensor cores"):
        check_fp8_device(load_profile("a100-sxm"))
    cfg = SimConfig(model=MODEL, gpus=8, tp=8, hardware="a100-sxm", optimizer="adamw",
                    workload=Workload(seq_len=128, global_batch=1, precision="fp8"))
    with pytest.raises(SpecError, match="no FP8 tensor cores"):
        cfg.check()
    check_fp8_device(load_profile("h200"))


def test_bad_precision_and_recipe_are_one_line_errors():
    with pytest.raises(SpecError, match="precision must be one of bf16, fp8, got 'fp4'"):
        Workload(precision="fp4")
    with pytest.raises(SpecError, match="fp8 recipe must be one of delayed, current"):
        Workload(precision="fp8", fp8_recipe="tensorwise")
    with pytest.raises(SpecError, match="micro batches"):
        FP8Setup(micro_batches=0)


def test_memory_keeps_fp8_weights_and_fp8_linear_inputs(model):
    spec, arch = model
    dims = layer_dims(arch, spec)
    bf16, fp8 = MemorySetup(seq_len=SEQ), MemorySetup(seq_len=SEQ, fp8=True)
    assert MemorySetup.from_workload(Workload(precision="fp8")).fp8
    assert not MemorySetup.from_workload(Workload()).fp8
    # the four linear inputs (QKV, output projection, MLP, second MLP linear) at 1 byte, not 2, less
    # the attention's own bf16 output, which in FP8 is no longer the projection's saved input
    saved = layer_activation_bytes(dims, bf16, 1) - layer_activation_bytes(dims, fp8, 1)
    assert saved == pytest.approx(SEQ * (2 * dims.hidden + dims.q_dim + dims.ffn) - SEQ * 2 * dims.q_dim)
    cfg = SimConfig(model=MODEL, gpus=8, tp=1, optimizer="adamw", policy="zero1",
                    workload=Workload(seq_len=SEQ, global_batch=8))
    weights = simulate(cfg).memory.worst.weights
    fp8_weights = simulate(replace(cfg, workload=replace(cfg.workload, precision="fp8"))).memory.worst.weights
    linear = sum(p.numel for p in fp8_linear_params(spec))
    assert fp8_weights - weights == FP8_WEIGHT_CACHE * linear
    assert all(p.layer is not None for p in fp8_linear_params(spec))


def test_fp8_attention_output_is_held_by_the_attention_and_by_the_projection(model):
    """Under FP8 the output projection saves the FP8 cast of its input while the fused attention
    saves its bf16 output (canzona.memory.layer_activation_bytes): both live, 3 bytes an element of
    the attention output where bf16 holds one 2-byte tensor. Not when the attention core is
    recomputed (its output is not saved) nor without flash attention (the unfused core saves its
    inputs, not its output)."""
    spec, arch = model
    dims = layer_dims(arch, spec)
    q, a, e = dims.q_dim, dims.q_heads, 2
    for tp in (1, 2):
        def layer(tp=tp, **kw):  # this iteration's TP, bound at definition
            return layer_activation_bytes(dims, MemorySetup(seq_len=SEQ, **kw), tp)
        # what selective recompute drops: the log-sum-exp, and under FP8 the attention's bf16 output
        assert layer(fp8=True) - layer(fp8=True, recompute="selective") == pytest.approx(SEQ * (4 * a + e * q) / tp)
        assert layer() - layer(recompute="selective") == pytest.approx(SEQ * 4 * a / tp)
        # without flash attention FP8 only narrows the four linear inputs
        unfused = layer(flash_attention=False) - layer(flash_attention=False, fp8=True)
        assert unfused == pytest.approx(SEQ * ((2 * dims.hidden) / tp + (q + dims.ffn) / tp))


def test_search_in_fp8_keeps_its_floors_below_the_simulation():
    """`canzona search --precision fp8`: every candidate is simulated in FP8, and the time floor
    that prunes prices FP8 GEMMs too (a bf16 floor would exceed the FP8 time and prune wrongly)."""
    from sim.search import Question, config_of, memory_floor, time_floor

    q = Question(model=MODEL, gpus=8, seq_len=1024, global_batch=8, precision="fp8")
    rate = DeviceRate.from_profile(load_profile(q.hardware))
    model = model_of(SimConfig(model=MODEL))
    cfg = config_of(q, {"tp": 2, "pp": 2, "vp": 1, "micro_batch": 1, "recompute": "none"})
    assert cfg.workload.precision == "fp8"
    r = simulate(cfg)
    assert time_floor(cfg, model, rate) <= r.iteration_time_s
    assert memory_floor(cfg, model) <= r.memory.worst.total
    with pytest.raises(SpecError, match="no FP8 tensor cores"):
        Question(model=MODEL, gpus=8, hardware="a100-sxm", precision="fp8")
    with pytest.raises(SpecError, match="precision must be one of"):
        Question(model=MODEL, gpus=8, precision="fp16x")


def test_without_userbuffers_fp8_gathers_one_byte_and_still_floors():
    """Transformer Engine without userbuffers all-gathers the FP8 cast (1 byte an element) under
    FP8, the activation dtype otherwise and under userbuffers (`sim.iteration.tp_gather_bytes`);
    the reduce-scatters stay in the activation dtype. The search's floor uses the same bytes, so
    it stays below the simulation."""
    from sim.iteration import tp_gather_bytes
    from sim.options import RunOptions
    from sim.search import Question, config_of, time_floor

    fp8, bf16 = Workload(1024, 8, precision="fp8"), Workload(1024, 8)
    assert tp_gather_bytes(fp8, userbuffers=False) == 1
    assert tp_gather_bytes(fp8, userbuffers=True) == fp8.activation_bytes == 2
    assert tp_gather_bytes(bf16, userbuffers=False) == 2
    q = Question(model=MODEL, gpus=8, seq_len=1024, global_batch=8, precision="fp8")
    rate = DeviceRate.from_profile(load_profile(q.hardware))
    model = model_of(SimConfig(model=MODEL))
    cfg = config_of(q, {"tp": 4, "pp": 1, "vp": 1, "micro_batch": 1, "recompute": "none"})
    off = replace(cfg, options=RunOptions(tp_comm_overlap=False))
    r = simulate(off)
    assert time_floor(off, model, rate) <= r.iteration_time_s
    # the simulated collectives move those bytes (the shortest of each: alone on the TP links)
    from canzona.catalog import get_config
    from sim.topology import Cluster

    hw = load_profile(q.hardware)
    geo = Cluster(8, 4, hw.node.gpus, 1).tp_geometry()
    elements = 1024 * get_config(MODEL).hidden

    def shortest(kind: str) -> float:
        return min(s.end - s.start for s in r.spans if s.rank == 0 and s.name.endswith(kind))

    assert shortest("all-gather") == pytest.approx(collective_cost("all-gather", elements, geo, hw).seconds, rel=1e-9)
    assert shortest("reduce-scatter") == pytest.approx(
        collective_cost("reduce-scatter", 2 * elements, geo, hw).seconds, rel=1e-9)
