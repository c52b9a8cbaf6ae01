"""Transformer Engine's userbuffers in the memory model (docs/design.md §7.1): under the TP
communication overlap every GPU of a TP group holds ten buffers of a micro-batch's tokens on its CP
rank by the hidden size, for the whole run, outside PyTorch's allocator; CP halves them, FP8 narrows
eight of them, TP 1, the overlap off and FSDP hold none."""

from __future__ import annotations

from dataclasses import replace

import pytest

from canzona.errors import SpecError
from canzona.memory import MemorySetup, userbuffer_bytes
from canzona.models import resolve_model
from sim import published
from sim.options import RunOptions
from sim.search import memory_floor
from sim.simulate import SimConfig, model_of, simulate
from sim.workload import Workload

RUNS, _ = published.load()
BY_ID = {r.id: r for r in RUNS}
H70 = 8192  # Llama 3 70B's hidden size


def test_ten_buffers_of_the_launchers_shape():
    # bf16: ten 8192 x 8192 buffers of 2 bytes (Llama 3 70B, sequence 8192, micro-batch 1, no CP)
    assert userbuffer_bytes(8192, H70, 2, fp8=False) == 10 * 8192 * H70 * 2 == 1_342_177_280
    # FP8: the six all-gather and two forward reduce-scatter buffers in FP8, the two bulk
    # reduce-scatters of the backward in bf16
    assert userbuffer_bytes(8192, H70, 2, fp8=True) == (8 * 1 + 2 * 2) * 8192 * H70


def test_the_setup_sizes_them_by_the_cp_ranks_tokens_and_only_under_the_overlap():
    cfg = SimConfig(model="qwen3-1.7b", gpus=16, tp=2, cp=2, optimizer="adamw",
                    workload=Workload(seq_len=8192, global_batch=32, micro_batch=2))
    _, arch = resolve_model(cfg.model, cfg.tp)
    h = arch.hidden
    assert cfg.memory_setup(arch).userbuffers == userbuffer_bytes(8192 // 2 * 2, h, 2, fp8=False)
    assert replace(cfg, cp=1).memory_setup(arch).userbuffers == 2 * cfg.memory_setup(arch).userbuffers
    assert replace(cfg, cp=1, fsdp=True).memory_setup(arch).userbuffers == 0  # FSDP's TP runs none
    assert replace(cfg, tp=1).memory_setup(arch).userbuffers == 0
    off = replace(cfg, options=RunOptions(tp_comm_overlap=False))
    assert off.memory_setup(arch).userbuffers == 0


def test_a_negative_size_is_refused():
    with pytest.raises(SpecError, match="userbuffers"):
        MemorySetup(userbuffers=-1)


def test_the_fullest_gpu_and_the_search_floor_hold_them():
    """The simulated fullest GPU and the search's memory floor (sim.search.memory_floor) both
    count them: with the overlap off, the same layout needs exactly that much less."""
    cfg = SimConfig(model="qwen3-0.6b", gpus=8, tp=2, optimizer="adamw", policy="zero1",
                    workload=Workload(seq_len=2048, global_batch=8, micro_batch=1))
    off = replace(cfg, options=RunOptions(tp_comm_overlap=False))
    on_w, off_w = simulate(cfg).memory.worst, simulate(off).memory.worst
    ub = cfg.memory_setup(model_of(cfg)[1]).userbuffers
    assert ub > 0 and on_w.userbuffers == ub and off_w.userbuffers == 0
    assert on_w.total - off_w.total == ub
    assert "userbuffers" in on_w.components() and "userbuffers" not in off_w.components()
    assert memory_floor(cfg, model_of(cfg)) - memory_floor(off, model_of(off)) == ub


def test_dgx_cloud_70b_without_cp_needs_twice_the_published_layouts():
    """DGX Cloud's Llama 3.1 70B (TP 4 with userbuffers, sequence 8192): the published CP 2 holds
    0.67 GB of userbuffers, the search's former best at 128 GPUs, TP 4 x PP 4 x VP 20 without CP,
    1.34 GB, which its memory floor counts."""
    run = BY_ID["llama3.1-70b-128xh100-dgxc-bf16"]
    cfg = run.sim_config()
    model = model_of(cfg)
    assert cfg.memory_setup(model[1]).userbuffers == 671_088_640
    no_cp = replace(cfg, cp=1, vp=20)
    assert no_cp.memory_setup(model[1]).userbuffers == 1_342_177_280
    assert memory_floor(no_cp, model) - memory_floor(replace(no_cp, options=RunOptions(tp_comm_overlap=False)),
                                                     model) == 1_342_177_280
