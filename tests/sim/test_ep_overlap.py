"""Megatron's EP all-to-all overlap (`overlap_moe_expert_parallel_comm`, sim.ep_overlap): the
combined 1F1B schedule's effect against a closed form, the SMs its all-to-alls take from the
compute beside them, Megatron's requirements as error lines, the search's floor under it, and the
published row that ran it."""

from __future__ import annotations

from dataclasses import replace

import pytest

import sim.simulate as simulate_module
from canzona.decoder import DecoderConfig, build_decoder
from canzona.errors import SpecError
from canzona.hardware import load_profile
from canzona.memory import MemorySetup, fullest_rank_load, layer_activation_bytes
from canzona.routing import busiest_rank
from sim import ep_dispatch
from sim.collectives import FREE
from sim.engine import Engine
from sim.ep_dispatch import alltoall_cost
from sim.options import RunOptions
from sim.published import PUBLISHED_RUNS, load, parse_run, select
from sim.simulate import SimConfig, layer_dims, simulate
from sim.topology import Cluster
from sim.workload import Workload
from tests.cli_helpers import error_line, invoke

# a small MoE model whose all-to-alls inside one node are shorter than every compute node of a
# layer (attention and experts, forward and backward): the compute-bound case of the closed form
SMALL = DecoderConfig("small-moe", 4, 1024, 8, 8, 128, 2048, 1024, False, experts=16, experts_per_token=2,
                      moe_ffn=512)
LAYERS, GPUS, EP = 4, 8, 8


def _cfg(overlap: bool, **changes) -> tuple[SimConfig, tuple]:
    base = dict(model="unused", gpus=GPUS, tp=1, ep=EP, optimizer="adamw", policy="zero1", zero1_fallback=False,
                workload=Workload(seq_len=512, global_batch=32), gpu_variability=0.0,
                options=RunOptions(overlap_moe_expert_parallel_comm=overlap))
    return SimConfig(**{**base, **changes}), (build_decoder(SMALL), SMALL.architecture())


def _run(overlap: bool, **changes):
    cfg, model = _cfg(overlap, **changes)
    return simulate(cfg, model=model)


def _no_comm_sms(monkeypatch) -> None:
    """Communication kernels take no SM from the compute (`Engine(sms=0)`): the streams alone."""
    monkeypatch.setattr(simulate_module, "Engine", lambda slowdown=1.0, sms=0: Engine(slowdown=slowdown, sms=0))


def _tokens_only(monkeypatch) -> None:
    """The alltoall dispatcher's exchanges beside the tokens (the count all-gather, the host sync, the
    probabilities: `sim.ep_dispatch.alltoall_metadata_costs`) made free, so that every dispatch and
    combine is the one token all-to-all the closed forms below count (`_all_to_all_s`)."""
    monkeypatch.setattr(ep_dispatch, "alltoall_metadata_costs", lambda meta, experts, hw: (FREE, FREE))


def _all_to_all_s() -> float:
    """One dispatch (or combine) all-to-all of SMALL's expert block, as the simulator prices it."""
    cfg, (spec, arch) = _cfg(False)
    wl = cfg.workload
    pairs = wl.tokens_per_micro_batch * 2  # tokens x experts_per_token, TP 1
    sent = pairs * arch.hidden * 2 * (EP - 1) / EP  # bf16, the share that leaves the rank
    # the busiest rank receives more under the default random routing (canzona.routing)
    busiest = busiest_rank(experts=16, top_k=2, ep=EP, tokens=wl.tokens_per_micro_batch).pairs
    experts = cfg.expert_cluster(Cluster(GPUS, 1, load_profile(cfg.hardware).node.gpus, 1))
    return alltoall_cost(sent, sent * busiest, experts, load_profile(cfg.hardware)).seconds


def test_compute_bound_overlap_hides_every_all_to_all_of_the_combined_phases(monkeypatch):
    """With every all-to-all shorter than each compute node (checked on the serial run's spans) and
    no SM taken by communication, each layer pair of a combined phase runs its four compute nodes
    back to back with its four all-to-alls under them, so the overlap saves exactly the
    all-to-alls of the m - 1 combined phases: (m - 1) x layers x 4 x one all-to-all (micro-batch 0's
    forward and the last backward run alone, as before)."""
    _no_comm_sms(monkeypatch)
    _tokens_only(monkeypatch)
    serial, overlapped = _run(False), _run(True)
    c = _all_to_all_s()
    spans = {s.name: s.end - s.start for s in serial.spans if s.rank == 0 and s.name.startswith("mb1 fwd layer 1")}
    spans.update({s.name: s.end - s.start for s in serial.spans if s.rank == 0 and s.name.startswith("mb1 bwd layer 1")})
    comm = [v for k, v in spans.items() if k.endswith(("dispatch", "combine"))]
    compute = [v for k, v in spans.items() if not k.endswith(("dispatch", "combine"))]
    assert len(comm) == 4 and len(compute) == 4
    assert comm == pytest.approx([c] * 4, rel=1e-12)
    assert c < min(compute)  # the compute-bound case
    m = 32 // GPUS
    saved = serial.iteration_time_s - overlapped.iteration_time_s
    assert saved == pytest.approx((m - 1) * LAYERS * 4 * c, rel=1e-9)
    # one micro-batch's layers either way, and under the overlap one layer more: a step builds its
    # forward layer before the paired backward layer frees its own (canzona.memory, ep_overlap_layer);
    # the per-pair terms at the fullest EP rank's load over the layers held (fullest_rank_load: under
    # random routing the 5 layers' draws average a little more than the 4 layers')
    spec, arch = build_decoder(SMALL), SMALL.architecture()
    dims = layer_dims(arch, spec)
    setup = MemorySetup(seq_len=512, micro_batch=1, ep=EP)
    one_layer = layer_activation_bytes(dims, setup, 1, expert_load=fullest_rank_load(dims, setup, 1, LAYERS + 1))
    over = [fullest_rank_load(dims, setup, 1, n) - 1 for n in (LAYERS, LAYERS + 1)]
    per_pair = layer_activation_bytes(dims, setup, 1) - layer_activation_bytes(dims, setup, 1, expert_load=0.0)
    more = LAYERS * (over[1] - over[0]) * per_pair
    assert overlapped.memory.worst.activations - serial.memory.worst.activations == pytest.approx(one_layer + more, abs=2)


def test_the_all_to_alls_take_sms_from_the_compute_beside_them(monkeypatch):
    """With NCCL's SMs held by the all-to-alls (sim.comm_sms) the compute beside them slows: the
    overlap still saves time, less than the closed form's."""
    _tokens_only(monkeypatch)
    serial, overlapped = _run(False), _run(True)
    m = 32 // GPUS
    saved = serial.iteration_time_s - overlapped.iteration_time_s
    assert 0 < saved < (m - 1) * LAYERS * 4 * _all_to_all_s()


def test_combined_schedule_order_on_the_two_streams():
    """A layer pair in Megatron's order: on the EP stream the backward's combine gradient, the
    forward's dispatch, the backward's dispatch gradient, the forward's combine; on the compute
    stream the forward's attention, the backward's experts, the forward's experts, the backward's
    attention."""
    r = _run(True)
    pair = [s for s in r.spans if s.rank == 0 and s.phase == "A"
            and (s.name.startswith("mb2 fwd layer 1") or s.name.startswith("mb1 bwd layer 2"))]
    by_stream = {}
    for s in sorted(pair, key=lambda s: s.start):
        by_stream.setdefault(s.stream, []).append(s.name)
    assert by_stream["ep-comm"] == ["mb1 bwd layer 2.experts dispatch", "mb2 fwd layer 1.experts dispatch",
                                    "mb1 bwd layer 2.experts combine", "mb2 fwd layer 1.experts combine"]
    assert by_stream["compute"] == ["mb2 fwd layer 1.0", "mb1 bwd layer 2.experts", "mb2 fwd layer 1.experts",
                                    "mb1 bwd layer 2.0"]


@pytest.mark.parametrize("changes, needle", [
    (dict(ep=1), "needs expert parallelism (--ep > 1)"),
    (dict(gpus=16, pp=2), "needs a virtual pipeline (--vp > 1)"),
    (dict(options=RunOptions(overlap_moe_expert_parallel_comm=True, recompute="full")),
     "does not run with --recompute full"),
    (dict(options=RunOptions(overlap_moe_expert_parallel_comm=True, recompute="selective-op")),
     "does not run with --recompute selective-op"),
])
def test_megatron_requirements_are_errors(changes, needle):
    cfg, model = _cfg(True, **changes)
    with pytest.raises(SpecError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        cfg.check(model)


def test_option_must_be_a_bool():
    with pytest.raises(SpecError, match="overlap_moe_expert_parallel_comm must be True or False"):
        RunOptions(overlap_moe_expert_parallel_comm="yes").check()  # type: ignore[arg-type]


# --- the interleaved combined 1F1B (PP > 1 with a virtual pipeline) ---------------------------

PP, VP, M = 2, 2, 4  # 8 layers in 4 chunks of 2; 32 sequences over DP 8: 4 micro-batches per DP rank


def _run_interleaved(overlap: bool, **changes):
    big = replace(SMALL, layers=8)
    cfg = SimConfig(**{**dict(model="unused", gpus=GPUS * PP, tp=1, pp=PP, vp=VP, ep=EP, optimizer="adamw",
                              policy="zero1", zero1_fallback=False, workload=Workload(seq_len=512, global_batch=32),
                              gpu_variability=0.0, options=RunOptions(overlap_moe_expert_parallel_comm=overlap)),
                       **changes})
    model = (build_decoder(big), big.architecture())
    cfg.check(model)
    return simulate(cfg, model=model)


def _measure(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of `intervals` as disjoint sorted ones."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _exposed(spans, rank: int) -> float:
    """Seconds the rank's EP stream is busy while its compute stream is idle."""
    comm = _measure([(s.start, s.end) for s in spans if s.rank == rank and s.stream == "ep-comm" and s.phase == "A"])
    compute = _measure([(s.start, s.end) for s in spans if s.rank == rank and s.stream == "compute" and s.phase == "A"])
    covered = sum(max(0.0, min(b, d) - max(a, c)) for a, b in comm for c, d in compute)
    return sum(b - a for a, b in comm) - covered


def test_interleaved_combined_schedule_exposes_only_the_warm_up_and_cool_down_all_to_alls(monkeypatch):
    """Closed form of the interleaved combined schedule (compute-bound all-to-alls, no SMs taken):
    on each stage every step pairing a forward chunk with a backward one hides its all-to-alls,
    and only the chunks run alone expose theirs, 2 a layer each: Megatron's warm-up forwards
    ((pp - s - 1) x 2 + (vp - 1) x pp, one more under the overlap) and as many cool-down backwards.
    Without the overlap every chunk exposes them. The compute is the same either way."""
    _no_comm_sms(monkeypatch)
    _tokens_only(monkeypatch)
    serial, overlapped = _run_interleaved(False), _run_interleaved(True)
    ep = [s.end - s.start for s in serial.spans if s.stream == "ep-comm" and s.phase == "A"]
    c = ep[0]
    assert ep == pytest.approx([c] * len(ep), rel=1e-12)
    compute = [s.end - s.start for s in serial.spans if s.stream == "compute" and s.phase == "A"
               and (".0" in s.name or s.name.endswith("experts"))]
    assert c < min(compute)  # the compute-bound case
    per_chunk = 8 // (PP * VP)
    for stage in range(PP):
        rank = stage * GPUS  # the stage's first rank, which stands for the stage
        warm = min((PP - stage - 1) * 2 + (VP - 1) * PP + 1, M * VP)
        assert _exposed(overlapped.spans, rank) == pytest.approx(2 * warm * per_chunk * 2 * c, rel=1e-9)
        assert _exposed(serial.spans, rank) == pytest.approx(M * VP * per_chunk * 2 * 2 * c, rel=1e-9)
        busy = [sum(s.end - s.start for s in r.spans if s.rank == rank and s.stream == "compute" and s.phase == "A")
                for r in (serial, overlapped)]
        assert busy[1] == pytest.approx(busy[0], rel=1e-12)
    assert overlapped.iteration_time_s < serial.iteration_time_s


def test_interleaved_combined_step_pairs_the_forward_chunk_with_the_backward_chunk():
    """A steady-state step of stage 1 (forward micro-batch 1 on chunk 1, the first forward after
    its 3 warm-up ones, beside the backward of micro-batch 0 on chunk 1): forward layer i beside
    backward layer n - 1 - i of the backward's chunk, in Megatron's order on the compute stream."""
    r = _run_interleaved(True)
    rank = GPUS  # stage 1's first rank
    # stage 1's chunks: 1 (layers 2, 3) and 3 (layers 6, 7); its steps: F(0,0) F(1,0) F(0,1) alone,
    # then F(1,1) beside B(0,1)
    names = [s.name for s in sorted((s for s in r.spans if s.rank == rank and s.stream == "compute"
                                     and s.phase == "A"), key=lambda s: s.start)]
    first = names.index("mb1 fwd layer 6.0")
    assert names[first - 1] == "mb0 bwd head"  # the backward's head runs before the layers
    assert names[first:first + 8] == [
        "mb1 fwd layer 6.0", "mb0 bwd layer 7.experts", "mb1 fwd layer 6.experts", "mb0 bwd layer 7.0",
        "mb1 fwd layer 7.0", "mb0 bwd layer 6.experts", "mb1 fwd layer 7.experts", "mb0 bwd layer 6.0"]
    assert names[first + 8] == "mb1 fwd head"  # after the backward's send: the head's forward


def test_interleaved_combined_schedule_with_unequal_chunks_runs_every_layer_once():
    """An uneven split (the embedding and the loss counted as layers: the first and the last
    chunk a layer short) pairs min(n_f, n_b) layers, then the backward's rest, then the forward's:
    every micro-batch runs every layer's forward and backward exactly once."""
    from canzona.pipeline import PipelineSplit

    split = PipelineSplit(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    big = replace(SMALL, layers=6)  # 6 + 2 = 8 slots in 4 chunks of 2
    cfg = SimConfig(model="unused", gpus=GPUS * PP, tp=1, pp=PP, vp=VP, ep=EP, optimizer="adamw", policy="zero1",
                    zero1_fallback=False, workload=Workload(seq_len=512, global_batch=32), gpu_variability=0.0,
                    pipeline_split=split, options=RunOptions(overlap_moe_expert_parallel_comm=True))
    r = simulate(cfg, model=(build_decoder(big), big.architecture()))
    for kind in ("fwd", "bwd"):
        seen = sorted(s.name for s in r.spans if s.stream == "compute" and s.name.endswith(".experts")
                      and f" {kind} " in s.name)
        assert seen == sorted(f"mb{mb} {kind} layer {k}.experts" for mb in range(M) for k in range(6))


def test_search_floor_stays_below_the_interleaved_overlapped_simulation():
    """The search's time floor (a stage's larger of its compute and its expert collectives, times
    the micro-batches) stays below the interleaved combined schedule's simulated iteration."""
    from canzona.cost import DeviceRate
    from sim.search import time_floor

    big = replace(SMALL, layers=8)
    model = (build_decoder(big), big.architecture())
    cfg = SimConfig(model="unused", gpus=GPUS * PP, tp=1, pp=PP, vp=VP, ep=EP, optimizer="adamw", policy="zero1",
                    zero1_fallback=False, workload=Workload(seq_len=512, global_batch=32),
                    options=RunOptions(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True))
    hw = load_profile(cfg.hardware)
    assert 0 < time_floor(cfg, model, DeviceRate.from_profile(hw), hw) <= simulate(cfg, model=model).iteration_time_s


def test_combined_order_is_the_interleaved_order_with_one_more_warm_up_forward():
    """`combined_order` against Megatron's rules, for small pipelines: every micro-batch-chunk's
    forward and backward once, in the interleaved schedule's order; warm-up forwards one more than
    the interleaved schedule's (capped), steady forward k + warm-up beside backward k, the rest
    cool-down backwards; at PP 1 micro-batch 0's forward alone, forward i beside backward i - 1,
    the last backward alone; and the steps of all stages run to the end (no stage waits forever
    for a neighbour's chunk)."""
    from canzona.pipeline import combined_order, interleaved_one_f_one_b, interleaved_warmup

    assert combined_order(0, 1, 3) == [(("F", 0, 0), None), (("F", 1, 0), ("B", 0, 0)),
                                       (("F", 2, 0), ("B", 1, 0)), (None, ("B", 2, 0))]
    with pytest.raises(SpecError, match="needs a virtual pipeline"):
        combined_order(0, 2, 4, 1)
    for pp, vp, m in [(2, 2, 2), (2, 2, 4), (2, 3, 6), (4, 2, 4), (4, 3, 8), (3, 2, 3), (8, 4, 16)]:
        steps = {s: combined_order(s, pp, m, vp) for s in range(pp)}
        for s, order in steps.items():
            plain = interleaved_one_f_one_b(s, pp, m, vp)
            assert [f for f, _ in order if f] == [x for x in plain if x[0] == "F"]
            assert [b for _, b in order if b] == [x for x in plain if x[0] == "B"]
            warm = min(interleaved_warmup(s, pp, vp, m) + 1, m * vp)
            assert all(b is None for _, b in order[:warm]) and all(f is None for f, _ in order[m * vp:])
            assert all(f and b for f, b in order[warm:m * vp])
        _runs_to_the_end(steps, pp, vp)


def _runs_to_the_end(steps, pp: int, vp: int) -> None:
    """Play every stage's steps: a step runs once its forward's input (the previous virtual
    stage's forward of that micro-batch) and its backward's output gradient (the next virtual
    stage's backward) are done; fail if the stages stop before all steps ran."""
    done: set[tuple[str, int, int]] = set()  # (kind, micro-batch, virtual stage)
    at = {s: 0 for s in range(pp)}
    last = pp * vp - 1
    progress = True
    while progress:
        progress = False
        for s in range(pp):
            if at[s] == len(steps[s]):
                continue
            f, b = steps[s][at[s]]
            ready = True
            if f is not None:
                v = f[2] * pp + s
                ready &= v == 0 or ("F", f[1], v - 1) in done
            if b is not None:
                v = b[2] * pp + s
                ready &= ("F", b[1], v) in done and (v == last or ("B", b[1], v + 1) in done)
            if ready:
                for x in (f, b):
                    if x is not None:
                        done.add((x[0], x[1], x[2] * pp + s))
                at[s] += 1
                progress = True
    assert all(at[s] == len(steps[s]) for s in range(pp)), at


def test_cli_errors_and_option():
    base = ("--model", "qwen3-30b-a3b", "--gpus", "16", "--tp", "1", "--optimizer", "adamw")
    error_line(invoke("simulate", *base, "--overlap-moe-expert-parallel-comm"), "needs expert parallelism")
    error_line(invoke("simulate", "--model", "qwen3-8b", "--gpus", "8", "--tp", "1", "--optimizer", "adamw",
                      "--ep", "2", "--overlap-moe-expert-parallel-comm"), "has no experts")
    error_line(invoke("simulate", *base, "--ep", "16", "--recompute", "full", "--overlap-moe-expert-parallel-comm"),
               "--recompute full")
    error_line(invoke("simulate", *base, "--ep", "8", "--fsdp", "--overlap-moe-expert-parallel-comm"))
    error_line(invoke("simulate", *base, "--ep", "8", "--pp", "2", "--overlap-moe-expert-parallel-comm"),
               "needs a virtual pipeline (--vp > 1)")
    import json

    ok = invoke("simulate", *base, "--ep", "16", "--global-batch", "32", "--overlap-moe-expert-parallel-comm", "--json")
    assert ok.exit_code == 0, ok.stderr
    assert json.loads(ok.stdout)["options"]["overlap_moe_expert_parallel_comm"] is True


def test_search_floor_stays_below_the_overlapped_simulation():
    """The search runs the overlap where the layout allows it and its floor stays a floor."""
    from canzona.cost import DeviceRate
    from canzona.models import resolve_model
    from sim.search import Question, config_of, time_floor

    q = Question(model="qwen3-30b-a3b", gpus=16, optimizer="adamw", global_batch=64,  # 4 micro-batches at DP 16
                 overlap_moe_expert_parallel_comm=True)
    model = resolve_model(q.model)
    hw = load_profile(q.hardware)
    rate = DeviceRate.from_profile(hw)
    on = config_of(q, {"tp": 1, "pp": 1, "vp": 1, "ep": 16, "micro_batch": 1, "recompute": "none"})
    assert on.options.overlap_moe_expert_parallel_comm
    off = config_of(q, {"tp": 2, "pp": 2, "vp": 1, "ep": 4, "micro_batch": 2, "recompute": "none"})
    assert not off.options.overlap_moe_expert_parallel_comm  # PP 2 without a virtual pipeline: Megatron refuses
    assert not config_of(q, {"tp": 1, "pp": 1, "vp": 1, "ep": 16, "micro_batch": 1,
                             "recompute": "full"}).options.overlap_moe_expert_parallel_comm
    r = simulate(on)
    serial = replace(on, options=replace(on.options, overlap_moe_expert_parallel_comm=False))
    assert time_floor(on, model, rate, hw) <= r.iteration_time_s < simulate(serial).iteration_time_s
    assert time_floor(on, model, rate, hw) < time_floor(serial, model, rate, hw)


def test_the_tuned_published_row_ran_the_overlap():
    """The Qwen3-30B-A3B tuned H100 run (the card's pretrain_performance item) is the functional
    row's layout with the recipe's overlap on; its source is a tuned benchmark's; nothing else ran it."""
    runs, sources = load()
    perf = select(runs, "qwen3-30b-a3b-16xh100-mb-perf")[0]
    functional = next(r for r in runs if r.id == "qwen3-30b-a3b-16xh100-mb")
    assert (perf.gpus, perf.tp, perf.pp, perf.cp, perf.ep, perf.dp) == (16, 1, 1, 1, 16, 16)
    assert (perf.global_batch, perf.micro_batch, perf.seq_len, perf.precision) == (1024, 1, 4096, "bf16")
    assert (functional.global_batch, functional.micro_batch, functional.ep) == (1024, 1, 16)
    assert perf.recompute == "none" and perf.grad_reduce_in_fp32 is False and perf.overlap_moe_expert_parallel_comm
    assert "overlap_moe_expert_parallel_comm = True" in perf.recipe_source
    assert "delay_wgrad_compute = False" in perf.recipe_source
    assert perf.seq_len * perf.global_batch / perf.step_time_s / perf.gpus == pytest.approx(
        perf.tokens_per_s_per_gpu, rel=1e-4)
    source = sources[perf.source]
    assert source["url"].endswith("#qwen3-30b-a3b-pretrain-performance-h100") and "layout_not_tuned" not in source
    assert [r.id for r in runs if r.overlap_moe_expert_parallel_comm] == [perf.id, *QWEN3_235B]
    assert not perf.delay_wgrad_compute and perf.tp_comm_overlap is None
    assert perf.sim_config().options.overlap_moe_expert_parallel_comm
    assert not functional.sim_config().options.overlap_moe_expert_parallel_comm


def test_the_ab_row_is_the_tuned_layout_without_the_overlap():
    """NVIDIA's EP-overlap A/B (Megatron-Bridge MoE comm-overlap skill, PR #5094's baseline): its
    overlap-off case is the tuned row's layout, dispatcher and settings with only the overlap off;
    its tokens follow from its step time; the simulator sees the functional row's run (whose only
    difference, natural routing, it does not model)."""
    runs, sources = load()
    by_id = {r.id: r for r in runs}
    off, perf = by_id["qwen3-30b-a3b-16xh100-ab-no-overlap"], by_id["qwen3-30b-a3b-16xh100-mb-perf"]
    layout = ("gpus", "tp", "pp", "vp", "cp", "ep", "dp", "global_batch", "micro_batch", "seq_len", "precision",
              "recompute", "grad_reduce_in_fp32", "ep_dispatcher", "cross_entropy_fusion_impl", "store_param_remainders")
    assert [getattr(off, k) for k in layout] == [getattr(perf, k) for k in layout]
    assert not off.overlap_moe_expert_parallel_comm and not off.delay_wgrad_compute
    assert off.step_time_s == 24.7138 and off.original_value == off.step_time_s
    assert off.seq_len * off.global_batch / off.step_time_s / off.gpus == pytest.approx(off.tokens_per_s_per_gpu,
                                                                                          abs=1e-3)
    assert off.sim_config() == by_id["qwen3-30b-a3b-16xh100-mb"].sim_config()
    assert "delayed wgrad stayed disabled" in off.recipe_source and "use_precision_aware_optimizer" in off.recipe_source
    assert sources[off.source]["url"].endswith("skills/nemo-mbridge-perf-moe-comm-overlap/SKILL.md")
    assert "layout_not_tuned" not in sources[off.source]


QWEN3_235B = ["qwen3-235b-a22b-256xh100-mb25.11-fp8", "qwen3-235b-a22b-256xh100-mb26.02-fp8"]


def test_the_qwen3_235b_rows_run_the_interleaved_overlap_as_their_recipe():
    """Megatron-Bridge's Qwen3-235B-A22B H100 rows (the 25.11 summary and the 26.02 archive): the
    layout of their tables, and the recipe's settings the simulator runs: the EP all-to-all overlap
    under the interleaved pipeline with delayed expert weight gradients, TP overlap off, the
    embedding and the loss counted as layers, the alltoall dispatcher, bf16 gradient reductions."""
    from canzona.pipeline import PipelineSplit

    runs, sources = load()
    rows = select(runs, "qwen3-235b-a22b")
    assert [r.id for r in rows] == QWEN3_235B
    assert [(r.source, r.global_batch, r.tokens_per_s_per_gpu) for r in rows] == [("mb-25.11", 2048, 1575),
                                                                                 ("mb-26.02", 8192, 1633)]
    for r in rows:
        assert (r.gpus, r.tp, r.pp, r.vp, r.cp, r.ep, r.dp, r.micro_batch, r.seq_len) == (256, 2, 8, 4, 1, 32, 16, 1, 4096)
        assert (r.precision, r.fp8_recipe, r.recompute, r.grad_reduce_in_fp32) == ("fp8", "current", "none", False)
        assert r.pipeline_split == PipelineSplit(account_for_embedding_in_pipeline_split=True,
                                                 account_for_loss_in_pipeline_split=True)
        options = r.sim_config().options
        assert options.overlap_moe_expert_parallel_comm and options.delay_wgrad_compute
        assert not options.tp_comm_overlap and options.ep_dispatcher.moe_token_dispatcher_type == "alltoall"
        for words in ("tp_comm_overlap=False", "delay_wgrad_compute = True", "moe_a2a_overlap True",
                      "account_for_embedding_in_pipeline_split True", "global_batch_size 2048"):
            assert words in r.recipe_source
        assert sources[r.source]["url"].startswith("https://docs.nvidia.com/nemo/megatron-bridge/")


def test_row_setting_is_checked():
    import json

    raw = json.loads(PUBLISHED_RUNS.read_text())
    row = next(r for r in raw["rows"] if r["id"] == "qwen3-30b-a3b-16xh100-mb-perf")
    with pytest.raises(SpecError, match="overlap_moe_expert_parallel_comm must be true or false"):
        parse_run({**row, "overlap_moe_expert_parallel_comm": "yes"}, raw["sources"], "row")
    with pytest.raises(SpecError, match="needs recipe_source"):
        parse_run({**row, "recipe_source": ""}, raw["sources"], "row")
    with pytest.raises(SpecError, match="delay_wgrad_compute must be true or false"):
        parse_run({**row, "overlap_moe_expert_parallel_comm": False, "delay_wgrad_compute": True}, raw["sources"], "row")
    with pytest.raises(SpecError, match="delay_wgrad_compute must be true or false"):
        parse_run({**row, "delay_wgrad_compute": "yes"}, raw["sources"], "row")
    with pytest.raises(SpecError, match="tp_comm_overlap must be true, false or null"):
        parse_run({**row, "tp_comm_overlap": 0}, raw["sources"], "row")


# --- delay_wgrad_compute ------------------------------------------------------------------------


def _compute_s(r, rank: int = 0) -> float:
    """The seconds of phase A's compute kernels on `rank` (summed, not their union)."""
    return sum(s.end - s.start for s in r.spans if s.rank == rank and s.stream == "compute" and s.phase == "A")


def test_delayed_weight_gradients_run_under_the_dispatch_gradient(monkeypatch):
    """Megatron's delay_wgrad_compute in a layer pair (compute-bound, no SMs taken): the backward's
    experts compute their data gradients, the dispatch gradient leaves the moment they end, and
    the experts' weight-gradient GEMMs (`Block.wgrad_s`) run on the compute stream under it, before
    the forward's experts; the attention's weight-gradient GEMMs (every TE linear module defers its
    own) run at the end of the pair, after its data gradients (`TransformerLayerSchedulePlan.run`:
    `b_layer.attn.backward_dw()` last), and the next layer's combine gradient leaves under them.
    The compute is the same work split apart; the combined steps hide every all-to-all either way,
    and the last backward, run alone, now hides each layer's dispatch gradient under its experts'
    weight gradients and each layer's combine gradient but the first under the layer before's
    attention weight gradients: the iteration is (2 L - 1) x one all-to-all shorter."""
    _no_comm_sms(monkeypatch)
    _tokens_only(monkeypatch)
    plain = _run(True)
    delayed = _run(True, options=RunOptions(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True))
    spans = sorted((s for s in delayed.spans if s.rank == 0 and s.phase == "A"
                    and (s.name.startswith("mb2 fwd layer 1") or s.name.startswith("mb1 bwd layer 2"))),
                   key=lambda s: s.start)
    compute = [s for s in spans if s.stream == "compute"]
    assert [s.name for s in compute] == ["mb2 fwd layer 1.0", "mb1 bwd layer 2.experts", "mb1 bwd layer 2.experts wgrad",
                                         "mb2 fwd layer 1.experts", "mb1 bwd layer 2.0",
                                         "mb1 bwd layer 2.0 delayed wgrad"]
    data, weights = compute[1], compute[2]
    gradient = next(s for s in spans if s.name == "mb1 bwd layer 2.experts combine")  # the dispatch gradient
    assert gradient.start == pytest.approx(data.end, abs=1e-12) and gradient.end < weights.end
    whole = next(s for s in plain.spans if s.rank == 0 and s.name == "mb1 bwd layer 2.experts")
    assert 0 < weights.end - weights.start < whole.end - whole.start
    assert (data.end - data.start) + (weights.end - weights.start) == pytest.approx(whole.end - whole.start, rel=1e-12)
    attn, attn_w = compute[4], compute[5]
    attn_whole = next(s for s in plain.spans if s.rank == 0 and s.name == "mb1 bwd layer 2.0")
    assert attn_w.start == pytest.approx(attn.end, abs=1e-12)
    assert (attn.end - attn.start) + (attn_w.end - attn_w.start) == pytest.approx(
        attn_whole.end - attn_whole.start, rel=1e-12)
    # the last backward, alone: the next layer's combine gradient leaves when the attention's data
    # gradients end, under its weight gradients
    for k in range(LAYERS - 1, 0, -1):
        attn = next(s for s in delayed.spans if s.rank == 0 and s.name == f"mb3 bwd layer {k}.0")
        attn_w = next(s for s in delayed.spans if s.rank == 0 and s.name == f"mb3 bwd layer {k}.0 delayed wgrad")
        nxt = next(s for s in delayed.spans if s.rank == 0 and s.name == f"mb3 bwd layer {k - 1}.experts dispatch")
        assert nxt.start == pytest.approx(attn.end, abs=1e-12) and nxt.end < attn_w.end
    c = gradient.end - gradient.start
    assert c == pytest.approx(_all_to_all_s(), rel=1e-12) and c < weights.end - weights.start
    assert _compute_s(delayed) == pytest.approx(_compute_s(plain), rel=1e-12)  # the same work
    assert plain.iteration_time_s - delayed.iteration_time_s == pytest.approx((2 * LAYERS - 1) * c, rel=1e-9)


def test_delayed_weight_gradients_are_reduced_after_they_run(monkeypatch):
    """The last micro-batch's gradient reductions (--overlap-grad-reduce, by the backward hooks at
    PP 1) wait for the weight gradients the layers deferred, the attention's included: the
    reduction that the first layer completes starts when that layer's delayed GEMMs end."""
    _no_comm_sms(monkeypatch)
    _tokens_only(monkeypatch)
    r = _run(True, options=RunOptions(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True))
    last = next(s for s in r.spans if s.rank == 0 and s.name == "mb3 bwd layer 0.0 delayed wgrad")
    syncs = [s for s in r.spans if s.rank == 0 and s.phase == "A" and "grad sync" in s.name]
    assert syncs and min(s.start for s in syncs) >= last.end - 1e-15


def test_delayed_weight_gradients_alone_and_interleaved(monkeypatch):
    """A backward chunk run alone (the cool-down) keeps Megatron's order under delay_wgrad_compute
    too: its dispatch gradient leaves when the data gradients end; every micro-batch's experts'
    weight gradients run once."""
    _no_comm_sms(monkeypatch)
    _tokens_only(monkeypatch)
    r = _run_interleaved(True, options=RunOptions(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True))
    wgrad = sorted(s.name for s in r.spans if s.name.endswith("experts wgrad"))
    assert wgrad == sorted(f"mb{mb} bwd layer {k}.experts wgrad" for mb in range(M) for k in range(8))
    last = [s for s in r.spans if s.rank == 0 and s.name.startswith(f"mb{M - 1} bwd layer 0.experts")]
    data = next(s for s in last if s.stream == "compute" and s.name.endswith("experts"))
    gradient = next(s for s in last if s.name.endswith("combine"))
    assert gradient.start == pytest.approx(data.end, abs=1e-12)


def test_delay_wgrad_compute_needs_the_overlap():
    with pytest.raises(SpecError, match="--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm"):
        RunOptions(delay_wgrad_compute=True).check()
    with pytest.raises(SpecError, match="delay_wgrad_compute must be True or False"):
        RunOptions(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=1).check()  # type: ignore[arg-type]
    base = ("--model", "qwen3-30b-a3b", "--gpus", "16", "--tp", "1", "--optimizer", "adamw", "--ep", "16")
    error_line(invoke("simulate", *base, "--delay-wgrad-compute"), "needs --overlap-moe-expert-parallel-comm")
    error_line(invoke("search", "--model", "qwen3-30b-a3b", "--gpus", "16", "--optimizer", "adamw",
                      "--delay-wgrad-compute"), "needs --overlap-moe-expert-parallel-comm")


def test_a_search_row_says_whether_its_layout_ran_the_overlap():
    """The search turns the asked overlap on only where the layout allows it (`config_of`): each
    simulated row says which it ran, and its one-line description names it, so a layout without
    it (PP 2 without a virtual pipeline here) is not read as overlapped."""
    from sim.search import Question, config_of, describe, not_in_plan, run_one

    q = Question(model="qwen3-30b-a3b", gpus=16, optimizer="adamw", global_batch=16,
                 overlap_moe_expert_parallel_comm=True)
    rows = {}
    for pp, ep in ((1, 16), (2, 8)):
        layout = {"tp": 1, "pp": pp, "pipeline_split": "even", "vp": 1, "cp": 1, "ep": ep, "micro_batch": 1,
                  "recompute": "none", "dp": 16 // pp}
        rows[pp] = run_one(config_of(q, layout), layout)
    assert rows[1]["overlap_moe_expert_parallel_comm"] is True
    assert rows[2]["overlap_moe_expert_parallel_comm"] is False
    assert describe(rows[1]).endswith(" EP overlap") and "overlap" not in describe(rows[2])
    # the launcher's setting, not the plan file's
    assert "--overlap-moe-expert-parallel-comm (Megatron's)" in not_in_plan(rows[1])
    assert not any("overlap" in x for x in not_in_plan(rows[2]))
    assert "--overlap-moe-expert-parallel-comm --delay-wgrad-compute (Megatron's)" in not_in_plan(
        {**rows[1], "delay_wgrad_compute": True})


def test_the_search_delays_weight_gradients_only_where_te_runs_it():
    """A question with delay_wgrad_compute: the overlapped layouts at TP 1, or with
    --no-tp-comm-overlap, delay their weight gradients; at TP 2 beside userbuffers Transformer
    Engine refuses it, so the layout runs the overlap without it (the row says so), as the search
    runs the overlap itself only where Megatron allows it; the simulator refuses the pair."""
    from sim.search import Question, config_of

    layout = {"tp": 2, "pp": 1, "vp": 1, "cp": 1, "ep": 8, "micro_batch": 1, "recompute": "none", "dp": 8}
    for tp_comm_overlap in (True, False):
        q = Question(model="qwen3-30b-a3b", gpus=16, optimizer="adamw", global_batch=16,
                     overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True, tp_comm_overlap=tp_comm_overlap)
        at_tp2, at_tp1 = config_of(q, layout), config_of(q, {**layout, "tp": 1, "ep": 16, "dp": 16})
        assert at_tp2.options.overlap_moe_expert_parallel_comm and at_tp1.options.delay_wgrad_compute
        assert at_tp2.options.delay_wgrad_compute is not tp_comm_overlap
        at_tp2.check()
    with pytest.raises(SpecError, match="needs --no-tp-comm-overlap"):
        replace(at_tp2, options=replace(at_tp2.options, tp_comm_overlap=True)).check()


def test_delayed_weight_gradients_in_a_steps_left_backward_layers():
    """Unequal chunks (the embedding and the loss counted as layers): a step whose backward chunk
    has more layers than its forward one runs the backward's left layers alone, as Megatron's
    `TransformerLayerSchedulePlan.run(None, b_layer)`, so under delay_wgrad_compute each keeps the
    delayed order: every micro-batch's every expert layer has its weight gradients apart, and the
    dispatch gradient leaves when the data gradients end."""
    from canzona.pipeline import PipelineSplit

    split = PipelineSplit(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    big = replace(SMALL, layers=6)  # 6 + 2 = 8 slots in 4 chunks of 2: the first and the last chunk one layer
    cfg = SimConfig(model="unused", gpus=GPUS * PP, tp=1, pp=PP, vp=VP, ep=EP, optimizer="adamw", policy="zero1",
                    zero1_fallback=False, workload=Workload(seq_len=512, global_batch=32), gpu_variability=0.0,
                    pipeline_split=split,
                    options=RunOptions(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True))
    r = simulate(cfg, model=(build_decoder(big), big.architecture()))
    wgrad = sorted(s.name for s in r.spans if s.name.endswith("experts wgrad"))
    assert wgrad == sorted(f"mb{mb} bwd layer {k}.experts wgrad" for mb in range(M) for k in range(6))
    for s in (s for s in r.spans if s.stream == "compute" and s.name.endswith(".experts") and " bwd " in s.name):
        gradient = next(g for g in r.spans if g.rank == s.rank and g.name == f"{s.name} combine")
        assert gradient.start == pytest.approx(s.end, abs=1e-12), s.name


def _spans_named(r, rank: int, prefix: str):
    return sorted((s for s in r.spans if s.rank == rank and s.phase == "A" and s.name.startswith(prefix)),
                  key=lambda s: s.start)


def _overlaps(span, others) -> float:
    return sum(max(0.0, min(span.end, o.end) - max(span.start, o.start)) for o in others)


def test_delayed_attention_weight_gradients_leave_the_reduce_scatter_exposed(monkeypatch):
    """TP 2 without userbuffers: Transformer Engine runs the column module's data-gradient
    reduce-scatter beside its weight-gradient GEMM (`_Stage.nccl_block`); under delay_wgrad_compute
    that GEMM is stashed in TE's `wgrad_store`, so the reduce-scatter has nothing beside it on the
    compute stream (the norm's backward waits for it) and the attention's delayed weight gradients,
    the row and the column module's, run after it. The compute is the same work."""
    _no_comm_sms(monkeypatch)
    _tokens_only(monkeypatch)
    options = dict(overlap_moe_expert_parallel_comm=True, tp_comm_overlap=False)
    plain = _run(True, tp=2, ep=4, options=RunOptions(**options))
    delayed = _run(True, tp=2, ep=4, options=RunOptions(**options, delay_wgrad_compute=True))
    for r, delay in ((plain, False), (delayed, True)):
        spans = _spans_named(r, 0, "mb1 bwd layer 2.0")
        compute = [s for s in spans if s.stream == "compute"]
        scatter = next(s for s in spans if s.name.endswith(" reduce-scatter"))
        beside = _overlaps(scatter, [s for s in r.spans if s.rank == 0 and s.stream == "compute"])
        if delay:
            assert beside == 0.0
            assert compute[-1].name == "mb1 bwd layer 2.0 delayed wgrad"
            assert compute[-1].start == pytest.approx(scatter.end, abs=1e-12)
        else:
            assert beside == pytest.approx(scatter.end - scatter.start, rel=1e-12)
            assert not any(s.name.endswith("delayed wgrad") for s in compute)
    whole = _spans_named(plain, 0, "mb1 bwd layer 2.0")
    parts = _spans_named(delayed, 0, "mb1 bwd layer 2.0")
    seconds = [sum(s.end - s.start for s in x if s.stream == "compute") for x in (whole, parts)]
    assert seconds[1] == pytest.approx(seconds[0], rel=1e-12)
    first = [next(s for s in x if s.name.endswith(" first")) for x in (whole, parts)]
    assert first[1].end - first[1].start < first[0].end - first[0].start  # the row module's wgrad left
    assert _compute_s(delayed) == pytest.approx(_compute_s(plain), rel=1e-12)


def test_userbuffers_refuse_a_delayed_weight_gradient():
    """Transformer Engine refuses a delayed weight gradient beside userbuffers' TP overlap
    (NotImplementedError in its linear modules' backward): at TP > 1 with tp_comm_overlap the run
    would not start, and the simulator refuses it; at TP 1, or without the overlap, it runs."""
    delayed = RunOptions(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)
    with pytest.raises(SpecError, match="--delay-wgrad-compute with --tp 2 needs --no-tp-comm-overlap"):
        _cfg(True, tp=2, ep=4, options=delayed)[0].check(_cfg(True)[1])
    _cfg(True, tp=2, ep=4, options=replace(delayed, tp_comm_overlap=False))[0].check(_cfg(True)[1])
    _cfg(True, options=delayed)[0].check(_cfg(True)[1])
    error_line(invoke("simulate", "--model", "qwen3-30b-a3b", "--gpus", "16", "--tp", "2", "--ep", "8",
                      "--optimizer", "adamw", "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"),
               "--delay-wgrad-compute with --tp 2 needs --no-tp-comm-overlap", "Userbuffers")


def test_the_chunks_first_attention_weight_gradients_run_beside_the_send(monkeypatch):
    """Megatron runs the attention weight gradients of the backward chunk's first layer after the
    step's sends ("Delay the last attn_dw in backward pass ... for overlapping with the p2p comm"),
    before the head's forward: on stage 1 (every backward chunk sends its gradient back) each send
    is issued when that layer's data gradients end (and leaves once stage 0 has posted its receive,
    sim.pipeline_p2p), those GEMMs starting then beside it, and every micro-batch's every layer's
    attention weight gradients run once."""
    _no_comm_sms(monkeypatch)
    _tokens_only(monkeypatch)
    r = _run_interleaved(True, options=RunOptions(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True))
    delayed = sorted(s.name for s in r.spans if s.name.endswith(".0 delayed wgrad"))
    assert delayed == sorted(f"mb{mb} bwd layer {k}.0 delayed wgrad" for mb in range(M) for k in range(8))
    rank = GPUS  # stage 1: its chunk 0 holds layers 2 and 3, its chunk 1 layers 6 and 7
    compute = [s for s in sorted(r.spans, key=lambda s: s.start) if s.rank == rank and s.stream == "compute"
               and s.phase == "A"]
    for mb in range(M):
        for c, first in ((0, 2), (1, 6)):
            send = next(s for s in r.spans if s.rank == rank and s.stream == "pp-comm 1->0"
                        and s.name == f"mb{mb} chunk {c} send gradients")
            attn = next(s for s in compute if s.name == f"mb{mb} bwd layer {first}.0")
            dw = next(s for s in compute if s.name == f"mb{mb} bwd layer {first}.0 delayed wgrad")
            assert send.start >= attn.end - 1e-15
            assert dw.start == pytest.approx(attn.end, abs=1e-12)
            after = compute[compute.index(dw) + 1:]
            if after and after[0].name.endswith("fwd head"):
                assert after[0].start >= dw.end - 1e-15


def test_a_dense_layers_mlp_weight_gradients_follow_its_data_gradients():
    """A dense layer in a MoE model (`dense_layers`): its `mlp` node's TE modules defer their
    weight gradients too, which Megatron's pair runs at `mlp_bwd_dw`, right after the node's data
    gradients (its dispatch gradient is a no-op node); the chunk's first layer's attention ones run
    after the layers (no send at PP 1), before the forward's head and the embedding's gradient."""
    dense = replace(SMALL, dense_layers=(0,))
    cfg, _ = _cfg(True, options=RunOptions(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True))
    r = simulate(cfg, model=(build_decoder(dense), dense.architecture()))
    names = [s.name for s in sorted((s for s in r.spans if s.rank == 0 and s.stream == "compute" and s.phase == "A"),
                                    key=lambda s: s.start)]
    i = names.index("mb1 bwd layer 0.1")
    assert names[i - 1:i + 6] == ["mb2 fwd layer 3.0", "mb1 bwd layer 0.1", "mb1 bwd layer 0.1 delayed wgrad",
                                  "mb2 fwd layer 3.experts", "mb1 bwd layer 0.0", "mb1 bwd layer 0.0 delayed wgrad",
                                  "mb2 fwd head"]


def _grad_sync_starts(r, rank: int) -> list[float]:
    return [s.start for s in r.spans if s.rank == rank and s.phase == "A" and s.stream == "dp-comm"
            and "grad sync bucket" in s.name]


def test_the_combined_schedule_launches_no_aligned_reduction_after_a_chunk_0_backward():
    """Megatron's combined 1F1B calls `backward_step_helper_postprocess` (the aligned launch of a
    chunk's gradient reductions) only `if b_model_chunk_id:` (combined_1f1b.py,
    `combined_1f1b_schedule_for_interleaved_pipelining`): after a backward of chunk 0 it launches
    nothing. PP 2 x VP 2, 4 micro-batches (8 backward steps, the last 2 on chunk 0): stage 1's
    chunk 1 (its last micro-batch at step 5) is due at step 5 + 1, a chunk-0 step, so it waits for
    "any remaining grad reductions" after the last backward; stage 0's is launched at step 5, a
    chunk-1 step, under its chunk-0 backwards, as it is without the overlap on both stages. Buckets
    of 2M elements: 8 dense and 4 expert ones a chunk."""
    combined, plain = _run_interleaved(True, bucket_size=2_000_000), _run_interleaved(False, bucket_size=2_000_000)
    for r, stage, launched_under in ((combined, 1, False), (combined, 0, True), (plain, 1, True), (plain, 0, True)):
        rank = stage * GPUS
        end = _compute_end(r, rank)
        starts = _grad_sync_starts(r, rank)
        assert len(starts) == 24  # 16 dense and 8 expert buckets over the two chunks
        under = [t for t in starts if t < end - 1e-12]
        assert len(under) == (12 if launched_under else 0), (stage, r.config.options)


def _compute_end(r, rank: int) -> float:
    return max(s.end for s in r.spans if s.rank == rank and s.phase == "A" and s.kind == "compute")


def _slow_pipeline_transfers(monkeypatch, factor: float) -> None:
    """Every pipeline point-to-point transfer priced `factor` times (`_Stage.p2p`), so that a
    receiver has posted its receive long before the sender's forward ends."""
    from sim import iteration

    init = iteration._Stage.__init__

    def slow(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.p2p = replace(self.p2p, latency_s=self.p2p.latency_s * factor, transfer_s=self.p2p.transfer_s * factor)

    monkeypatch.setattr(iteration._Stage, "__init__", slow)


def test_the_steps_forward_exchange_is_issued_on_the_communication_stream(monkeypatch):
    """Megatron runs a steady step's post_forward on the communication stream
    (`TransformerModelChunkSchedulePlan.run`: `with torch.cuda.stream(get_comm_stream())`,
    `wait_current_stream`, then `send_forward_recv_forward`): its send's kernel starts behind every
    all-to-all the rank issued before it (ProcessGroupNCCL's `syncStream`), and its wait for the
    previous forward's send (`send_next_wait_handle.wait()`) holds that stream. Hand-checked on
    the uneven split (the embedding and the loss counted as layers): stage 0's chunk 0 holds one
    layer and its chunk 1 two, so a step pairing forward chunk 0 with backward chunk 1 runs the
    backward's second layer alone after the pair, its all-to-alls after the forward's last; with
    the transfers slow the receiver has posted long before, and the forward's send leaves only
    once that layer's dispatch gradient is done (before: at the forward's end, those 3 of 11 sends
    earlier). After each step's exchange the rank's next all-to-all waits for the earlier send."""
    from canzona.pipeline import PipelineSplit, chunk_layers, combined_order
    from sim.pipeline_p2p import p2p_stream

    _slow_pipeline_transfers(monkeypatch, 20.0)
    split = PipelineSplit(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    big = replace(SMALL, layers=6)  # 6 + 2 = 8 slots in 4 chunks of 2
    m = 8
    cfg = SimConfig(model="unused", gpus=GPUS * PP, tp=1, pp=PP, vp=VP, ep=EP, optimizer="adamw", policy="zero1",
                    zero1_fallback=False, workload=Workload(seq_len=512, global_batch=8 * m), gpu_variability=0.0,
                    pipeline_split=split, options=RunOptions(overlap_moe_expert_parallel_comm=True))
    r = simulate(cfg, model=(build_decoder(big), big.architecture()))
    stream = p2p_stream(0, 1, PP, VP)
    sends = {s.name: s for s in r.spans if s.rank == 0 and s.stream == stream}
    ep = [s for s in r.spans if s.rank == 0 and s.stream == "ep-comm" and s.phase == "A"]
    steps = [(f, b) for f, b in combined_order(0, PP, m, VP) if f is not None and b is not None]
    assert [len(chunk_layers(6, PP, 0, c, VP, split)) for c in range(VP)] == [1, 2]

    def step_ops(fwd, bwd):
        (_, i, c), (_, j, cb) = fwd, bwd
        return [s for s in ep if any(s.name.startswith(f"mb{i} fwd layer {k}.") for k in chunk_layers(6, PP, 0, c, VP, split))
                or any(s.name.startswith(f"mb{j} bwd layer {k}.") for k in chunk_layers(6, PP, 0, cb, VP, split))]

    checked = 0
    for n, (fwd, bwd) in enumerate(steps):
        send = sends[f"mb{fwd[1]} chunk {fwd[2]} send activations"]
        assert send.start >= max(s.end for s in step_ops(fwd, bwd)) - 1e-15, (fwd, bwd)
        checked += fwd[2] == 0 and bwd[2] == 1
        if 0 < n < len(steps) - 1:  # the step waits for the previous step's send: its next all-to-all after it
            earlier = sends[f"mb{steps[n - 1][0][1]} chunk {steps[n - 1][0][2]} send activations"]
            assert min(s.start for s in step_ops(*steps[n + 1])) >= earlier.end - 1e-15
    assert checked == 3  # the steps pairing forward chunk 0 with backward chunk 1
