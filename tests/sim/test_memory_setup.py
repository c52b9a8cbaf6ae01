"""`SimConfig.memory_setup`: one definition of the memory model's settings for the simulation and the
search's floor (docs/design.md §7.1, §9.7)."""

from __future__ import annotations

from dataclasses import replace

from canzona.memory import activation_bytes
from canzona.models import resolve_model
from canzona.recompute import FULL, UNIFORM
from sim.search import memory_floor
from sim.simulate import SimConfig, layer_dims, simulate
from sim.workload import Workload


def arch_of(cfg: SimConfig):
    return resolve_model(cfg.model, cfg.tp)[1]

# 36 layers over PP 4; 8 GPUs at TP 2: DP 1, so the global batch is each DP rank's micro-batches
FEW = SimConfig(model="qwen3-8b", gpus=8, tp=2, pp=4, optimizer="adamw",
                workload=Workload(seq_len=4096, global_batch=2, micro_batch=1))


def test_the_setup_carries_the_options_the_micro_batches_and_the_cp_share():
    cfg = replace(FEW, options=replace(FEW.options, recompute=FULL, recompute_method=UNIFORM, recompute_num_layers=9))
    setup = cfg.memory_setup(arch_of(cfg), tp_mode="serial")
    assert (setup.recompute, setup.recompute_method, setup.recompute_num_layers) == (FULL, UNIFORM, 9)
    assert setup.micro_batches == 2 and setup.seq_len == 4096 and setup.tp_mode == "serial"
    cp = SimConfig(model="qwen3-1.7b", gpus=8, tp=2, cp=2, optimizer="adamw",
                   workload=Workload(seq_len=1024, global_batch=4, micro_batch=1))
    assert cp.memory_setup(arch_of(cp)).seq_len == 512  # each CP rank holds seq / cp tokens of a micro-batch


def test_fewer_micro_batches_than_stages_hold_only_those_in_flight():
    """Stage 0 of PP 4 warms up with pp - 0 micro-batches in flight only when a DP rank runs that
    many: with 2, 1F1B never holds more than 2, in the simulation as in the search's floor."""
    spec, arch = resolve_model(FEW.model, FEW.tp)
    dims = layer_dims(arch, spec)
    setup = FEW.memory_setup(arch)
    capped = activation_bytes(dims, setup, FEW.tp, FEW.pp, 0)
    uncapped = activation_bytes(dims, replace(setup, micro_batches=None), FEW.tp, FEW.pp, 0)
    assert capped < uncapped
    result = simulate(FEW)
    assert result.memory.worst.stage == 0  # the first stage holds the most in flight
    assert result.memory.worst.activations == capped  # 2 micro-batches' layers, not 4
    assert memory_floor(FEW, (spec, arch)) <= result.memory.worst.total
