"""The interleaved 1F1B schedule (`--vp V`, Megatron's virtual pipeline): the order is a valid
schedule with Megatron's warm-up, the chunk layout, the checks, and the simulator's and memory
model's relations to plain 1F1B (no absolute times)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from canzona.catalog import get_model
from canzona.errors import SpecError
from canzona.memory import MemorySetup, activation_breakdown, layer_activation_bytes
from canzona.models import resolve_model
from canzona.pipeline import (
    check_vp,
    chunk_layers,
    interleaved_warmup,
    one_f_one_b,
    peak_in_flight,
    pipeline_order,
    rank_layers,
    stage_spec,
)
from sim.simulate import SimConfig, layer_dims, simulate
from sim.workload import Workload
from tests.cli_helpers import error_line, invoke

# --- the order --------------------------------------------------------------------------------


def _run_lockstep(pp: int, vp: int, m: int) -> None:
    """Execute every rank's order, each op once its inputs exist (the forward of virtual stage
    v - 1, the backward of v + 1 and its own forward): a valid schedule finishes, a bad one stalls."""
    orders = [pipeline_order(s, pp, m, vp) for s in range(pp)]
    done: set[tuple[str, int, int]] = set()  # (kind, micro-batch, virtual stage)
    pos = [0] * pp
    last = pp * vp - 1
    while any(pos[s] < len(orders[s]) for s in range(pp)):
        moved = False
        for s in range(pp):
            if pos[s] == len(orders[s]):
                continue
            kind, mb, c = orders[s][pos[s]]
            v = c * pp + s
            if kind == "F":
                ready = v == 0 or ("F", mb, v - 1) in done
            else:
                ready = ("F", mb, v) in done and (v == last or ("B", mb, v + 1) in done)
            if ready:
                done.add((kind, mb, v))
                pos[s] += 1
                moved = True
        assert moved, f"pp {pp} vp {vp} m {m}: the order deadlocks at {[orders[s][pos[s]:pos[s] + 1] for s in range(pp)]}"
    assert len(done) == 2 * m * pp * vp


@pytest.mark.parametrize("pp,vp,m", [(2, 2, 2), (2, 2, 8), (4, 2, 4), (4, 2, 8), (4, 3, 12), (3, 4, 6),
                                     (8, 2, 16), (2, 1, 3), (4, 1, 7)])
def test_the_order_is_a_valid_schedule(pp, vp, m):
    for s in range(pp):
        order = pipeline_order(s, pp, m, vp)
        every = [(i, c) for i in range(m) for c in range(vp)]
        assert sorted((i, c) for kind, i, c in order if kind == "F") == every  # each once forward
        assert sorted((i, c) for kind, i, c in order if kind == "B") == every  # and once backward
        assert all(order.index(("F", i, c)) < order.index(("B", i, c)) for i, c in every)
        first_backward = next(k for k, (kind, _, _) in enumerate(order) if kind == "B")
        if vp > 1:  # Megatron's warm-up, (pp - rank - 1) * 2 + (vp - 1) * pp forwards, then a forward and a backward
            warm = min((pp - s - 1) * 2 + (vp - 1) * pp, m * vp)
            assert warm == interleaved_warmup(s, pp, vp, m)
            assert first_backward == min(warm + 1, m * vp)
        else:
            assert [(k, i) for k, i, _ in order] == one_f_one_b(s, pp, m)
    _run_lockstep(pp, vp, m)


def test_the_order_runs_groups_of_pp_micro_batches_through_each_chunk():
    """Megatron's table (PP 2, VP 2, 4 micro-batches): forwards run micro-batches 0, 1 on chunk 0,
    then on chunk 1, then 2, 3 on chunk 0 and on chunk 1; backwards the chunks in reverse."""
    order = pipeline_order(1, 2, 4, 2)
    assert [(i, c) for k, i, c in order if k == "F"] == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    assert [(i, c) for k, i, c in order if k == "B"] == [(0, 1), (1, 1), (0, 0), (1, 0), (2, 1), (3, 1), (2, 0), (3, 0)]


def test_chunk_layout_is_megatrons():
    """Chunk c of rank r holds the model's chunk c * pp + r; the ranks' chunks cover every layer once."""
    assert [list(chunk_layers(8, 2, 0, c, 2)) for c in range(2)] == [[0, 1], [4, 5]]
    assert [list(chunk_layers(8, 2, 1, c, 2)) for c in range(2)] == [[2, 3], [6, 7]]
    assert rank_layers(8, 2, 1, 2) == (2, 3, 6, 7)
    assert sorted(i for s in range(4) for i in rank_layers(64, 4, s, 2)) == list(range(64))
    assert rank_layers(10, 4, 1) == tuple(range(3, 6))  # vp 1: the stage's (uneven) layers


def test_a_stage_holds_its_chunks_parameters():
    spec = get_model("qwen3-0.6b")  # 28 layers; pp 2 x vp 2: chunks of 7
    stages = [stage_spec(spec, 2, s, 28, vp=2) for s in range(2)]
    layered = sorted(p.name for p in spec.params if p.layer is not None)
    assert sorted(p.name for st in stages for p in st.params if p.layer is not None) == layered  # each once
    assert {p.name for st in stages for p in st.params} == {p.name for p in spec.params}
    assert {p.layer for p in stages[0].params if p.layer is not None} == set(range(7)) | set(range(14, 21))
    assert stages[0].params[0].name == "model.embed_tokens.weight"
    assert "model.norm.weight" in {p.name for p in stages[1].params}


@pytest.mark.parametrize("args,needle", [
    ((2, 1, 28, 8), "pp > 1"),
    ((3, 2, 28, 8), "not divisible by pp x vp"),
    ((2, 4, 32, 6), "not divisible by pp 4"),
    ((0, 2, 28, 8), "vp must be"),
])
def test_checks_are_one_line(args, needle):
    with pytest.raises(SpecError) as e:
        check_vp(*args)
    assert needle in str(e.value) and "\n" not in str(e.value)


# --- memory -----------------------------------------------------------------------------------


@pytest.mark.parametrize("pp,vp", [(2, 2), (4, 2), (4, 4), (8, 2)])
def test_stage_0_holds_megatrons_activations(pp, vp):
    """Stage 0 holds L (1 + (p - 1) / (p v)) layers' worth (Korthikanti et al. 2022), L under 1F1B."""
    spec, arch = resolve_model("qwen3-32b", 8)
    dims, setup = layer_dims(arch, spec), MemorySetup()
    per_layer = layer_activation_bytes(dims, setup, 8)
    one = activation_breakdown(dims, setup, 8, pp, 0)["layers"]
    inter = activation_breakdown(dims, setup, 8, pp, 0, vp)["layers"]
    assert math.isclose(one, dims.layers * per_layer)
    assert math.isclose(inter, dims.layers * (1 + (pp - 1) / (pp * vp)) * per_layer)
    assert inter > one
    # with the iteration's micro-batches known, the peak of the order itself (here: all of them)
    assert peak_in_flight(0, pp, 4 * pp, vp) == pp * vp + pp - 1


# --- the simulator ----------------------------------------------------------------------------

# qwen3-14b: 40 layers, 5 a chunk at pp 4 x vp 2; one GPU a stage on one node (cheap NVLink sends)
PIPE = SimConfig(model="qwen3-14b", gpus=4, tp=1, pp=4, policy="sc", zero1_fallback=False,
                 workload=Workload(seq_len=512, global_batch=8))
_cache: dict[SimConfig, object] = {}


def sim(cfg: SimConfig):
    if cfg not in _cache:
        _cache[cfg] = simulate(cfg)
    return _cache[cfg]


def _sends(result) -> list:
    return [s for s in result.spans if s.phase == "A" and s.stream.startswith("pp-comm")]


def test_interleaving_shrinks_the_bubble():
    one, two = sim(PIPE), sim(replace(PIPE, vp=2))
    assert two.breakdown["idle_s"] < one.breakdown["idle_s"]
    # the same work; the sends that overlap it differ (VP-fold), and so the SMs they take
    assert two.breakdown["compute_s"] == pytest.approx(one.breakdown["compute_s"], rel=1e-3)
    assert two.forward_backward_s <= one.forward_backward_s
    assert two.iteration_time_s <= one.iteration_time_s
    assert two.optimizer_step_s == pytest.approx(one.optimizer_step_s, rel=1e-9)  # phase B: the same parameters


def test_interleaving_keeps_the_work(full_rate_compute):
    """At full compute rate (no SMs lost to the sends), exactly the same compute seconds."""
    one, two = simulate(PIPE), simulate(replace(PIPE, vp=2))
    assert two.breakdown["compute_s"] == pytest.approx(one.breakdown["compute_s"], rel=1e-9)
    assert two.to_dict()["vp"] == 2 and one.to_dict()["vp"] == 1


def test_point_to_point_sends_cross_every_chunk_boundary():
    """Every boundary between virtual stages crosses ranks: pp * vp - 1 of them, each crossed by
    every micro-batch forward and backward (a send is a span on its sender and its receiver)."""
    m = PIPE.workload.micro_batches(1)
    for vp in (1, 2):
        assert len(_sends(sim(replace(PIPE, vp=vp)))) == 2 * 2 * m * (PIPE.pp * vp - 1)
    assert len(_sends(sim(replace(PIPE, vp=2)))) >= 2 * len(_sends(sim(PIPE)))


def test_phase_b_and_memory_take_the_ranks_chunks():
    cfg = SimConfig(model="qwen3-0.6b", gpus=8, tp=2, pp=2, vp=2, policy="canzona", zero1_fallback=False,
                    workload=Workload(256, 16))
    r = sim(cfg)
    layers = {get_model("qwen3-0.6b").param(p.name).layer for p in r.plan.dp_plan.placements()} - {None}
    assert layers == set(rank_layers(28, 2, 0, 2))  # stage 0's plan: its chunks' matrices
    one = sim(replace(cfg, vp=1))
    assert r.memory.worst.activations > one.memory.worst.activations
    assert r.memory.to_dict()["layout"]["vp"] == 2


def test_stage_ranks_stand_for_their_stage_under_interleaving():
    cfg = SimConfig(model="qwen3-0.6b", gpus=8, tp=2, pp=2, vp=2, policy="layerwise", zero1_fallback=False,
                    workload=Workload(256, 8))
    a, b = simulate(cfg), simulate(cfg, replicate_phase_a=False)
    assert a.iteration_time_s == pytest.approx(b.iteration_time_s, rel=1e-12)
    assert a.grad_sync_end_s == pytest.approx(b.grad_sync_end_s, rel=1e-12)


@pytest.mark.parametrize("change,needle", [
    (dict(pp=1, gpus=4, vp=2), "pp > 1"),
    (dict(model="qwen3-0.6b", vp=3), "not divisible by pp x vp"),
    (dict(workload=Workload(512, 6), vp=2), "not divisible by pp 4"),
])
def test_bad_layouts_are_one_error_line(change, needle):
    with pytest.raises(SpecError) as e:
        replace(PIPE, **change).check()
    assert needle in str(e.value) and "\n" not in str(e.value)


# --- the CLI ----------------------------------------------------------------------------------

CLI = ["--model", "qwen3-0.6b", "--gpus", "8", "--tp", "2", "--seq-len", "256", "--global-batch", "8",
       "--policy", "layerwise", "--pp", "2"]


def test_simulate_takes_vp_and_reports_it():
    import json

    result = invoke("simulate", *CLI, "--vp", "2", "--json")
    assert result.exit_code == 0, result.stderr
    d = json.loads(result.stdout)
    assert d["vp"] == 2 and d["pp"] == 2 and d["memory"]["layout"]["vp"] == 2


@pytest.mark.parametrize("command", ["simulate", "compare"])
@pytest.mark.parametrize("extra,needle", [
    (["--pp", "1", "--vp", "2"], "pp > 1"),
    (["--vp", "3"], "not divisible by pp x vp"),
    (["--vp", "2", "--global-batch", "6"], "not divisible by pp 2"),
])
def test_cli_bad_vp_is_one_error_line(command, extra, needle):
    args = [a for a in CLI if command == "simulate" or a not in ("--policy", "layerwise")]
    error_line(invoke(command, *args, *extra), needle)
