"""Property: the search's pruning floors (`sim.search.time_floor`, `memory_floor`) are lower bounds
of what `simulate` returns, over random small layouts of both spaces (ZeRO-1 with pipeline,
interleaving, CP, Megatron's block method; FSDP with HSDP, reshard, selective-layer at several K).
A floor above the simulation lets branch and bound prune a layout that would have won (40
derandomized examples find the tied-embedding last-stage floor of 10869b3 reverted)."""

from __future__ import annotations

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from canzona.cost import DeviceRate
from canzona.errors import SpecError
from canzona.hardware import load_profile
from canzona.models import resolve_model
from sim.search import Question, candidates, config_of, memory_floor, space_of, time_floor
from sim.simulate import simulate


@st.composite
def layouts(draw):
    fsdp = draw(st.booleans())
    gpus = draw(st.sampled_from([4, 8]))
    kw = dict(model=draw(st.sampled_from(["qwen3-0.6b", "qwen3-1.7b"])), gpus=gpus,
              seq_len=draw(st.sampled_from([512, 1024, 2048])),
              global_batch=gpus * draw(st.sampled_from([1, 2, 4])),
              optimizer=draw(st.sampled_from(["adamw", "muon"])), fsdp=fsdp,
              tp_comm_overlap=draw(st.booleans()))
    if fsdp:
        kw["selective_ac_option"] = draw(st.sampled_from([None, 1, 3, 5]))
    try:
        q = Question(**kw)
    except SpecError:
        assume(False)
    cands = candidates(q)
    assume(cands)
    layout = {**draw(st.sampled_from(cands)), **draw(st.sampled_from(space_of(q).recompute_variants(q)))}
    if layout["recompute"] == "full" and not fsdp and draw(st.booleans()):
        layout.update(recompute_method="block", recompute_num_layers=draw(st.integers(1, 4)))
    return q, layout


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(layouts())
def test_floors_are_below_the_simulation(case):
    q, layout = case
    model = resolve_model(q.model)
    cfg = config_of(q, layout)
    try:
        cfg.check(model)
        r = simulate(cfg)
    except SpecError:
        assume(False)
    hw = load_profile(cfg.hardware)
    assert time_floor(cfg, model, DeviceRate.from_profile(hw), hw) <= r.iteration_time_s
    assert memory_floor(cfg, model) <= r.memory.worst.total
