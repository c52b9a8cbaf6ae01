"""The flex token dispatchers' communication buffers in the memory model (docs/design.md §7.1):
DeepEP's normal-mode `Buffer` (its NVL buffer at the largest hint of the dispatch and combine
configs, 32 MiB workspace, across nodes its RDMA buffer) and HybridEP's buffers (sized for every
token of the EP group routed to one rank), held for the whole run; the alltoall dispatcher none.
The hand computations follow deepseek-ai/DeepEP's `Config::get_nvl_buffer_size_hint` /
`get_rdma_buffer_size_hint` and HybridEP's `NVLCoordinator` / `RDMACoordinator` allocations."""

from __future__ import annotations

from dataclasses import replace

import pytest

from canzona.errors import SpecError
from canzona.memory import deepep_buffer_bytes, hybridep_buffer_bytes
from canzona.models import resolve_model
from sim.ep_dispatch import DEEPEP_SMS, EpDispatcher
from sim.options import RunOptions
from sim.search import memory_floor
from sim.simulate import SimConfig, simulate
from sim.workload import Workload

H = 2048  # Qwen3-30B-A3B's hidden size: hidden_bytes = 2 x 2048 (get_hidden_bytes)
MIB = 1024 * 1024
# bytes a received token takes in DeepEP's buffers: its hidden bytes, a SourceMeta (8), 128 int64
# indices, 128 float weights, 128 float scales
PER_TOKEN = 2 * H + 8 + 128 * 8 + 128 * 4 + 128 * 4


def align(x: int, step: int) -> int:
    return -(-x // step) * step


def test_deepep_inside_a_node():
    # EP 8, 20 SMs: 10 channels x 8 NVL ranks; both configs receive 256 tokens a channel; no RDMA
    nvl = align(10 * 8 * (2 * 1 + 3) * 4 + 10 * 8 * 256 * PER_TOKEN, 128)
    assert nvl == 125_994_624
    assert deepep_buffer_bytes(8, H, 20) == nvl + 8 * (4 + 8 + 8) + 32 * MIB == 159_549_216
    assert deepep_buffer_bytes(4, H, 20) == align(10 * 4 * 5 * 4 + 10 * 4 * 256 * PER_TOKEN, 128) + 160 + 32 * MIB
    assert deepep_buffer_bytes(8, H, 24) > deepep_buffer_bytes(8, H, 20)  # a channel per two SMs


def test_deepep_across_nodes_adds_its_rdma_buffer():
    # EP 16: 8 NVL ranks x 2 RDMA ranks, 288 NVL tokens; RDMA receive 128 rounded up to whole sends:
    # 140 for the dispatch's 20, 132 for the combine's 12 (the larger kept)
    nvl = align(10 * 8 * (2 * 2 + 3) * 4 + 10 * 8 * 288 * PER_TOKEN, 128)
    rdma = align(10 * 2 * (8 * 2 + 2) * 2 * 4 + 10 * 2 * 140 * 2 * (PER_TOKEN + 16), 128)
    assert deepep_buffer_bytes(16, H, 20) == nvl + 160 + 32 * MIB + rdma == 209_842_720


def test_deepep_refuses_an_ep_size_it_has_no_config_for():
    with pytest.raises(SpecError, match="no dispatch / combine config for 12 EP ranks"):
        deepep_buffer_bytes(12, H, 20)
    with pytest.raises(SpecError, match="even number of SMs"):
        deepep_buffer_bytes(8, H, 21)


def test_hybridep_inside_a_node_holds_the_worst_case_of_every_token_routed_to_it():
    # EP 8, 4096 tokens a rank, 16 experts a rank: 8 x 4096 tokens of bf16 values, a float
    # probability per expert of the node (128), a float scale per 128 values (16)
    assert hybridep_buffer_bytes(8, 8, 4096, H, 16) == 8 * 4096 * (2 * H + 128 * 4 + 16 * 4) == 153_092_096
    # at least 512 tokens a rank (HybridEPBuffer.__init__)
    assert hybridep_buffer_bytes(8, 8, 100, H, 16) == hybridep_buffer_bytes(8, 8, 512, H, 16)


def test_hybridep_across_nodes_adds_its_rdma_buffers():
    # EP 16 in two NVLink domains of 8, 8 experts a rank (64 a domain, 128 in all)
    nvl = 16 * 4096 * (2 * H + 64 * 4 + 16 * 4)
    dispatch = 4096 * (2 * H + 128 * 4 + 16 * 4) + 4096 * 1 * (2 * H + 64 * 4 + 16 * 4)
    combine = 2 * 4096 * 1 * (2 * H + 64 * 4)
    assert hybridep_buffer_bytes(16, 8, 4096, H, 8) == nvl + dispatch + combine == 362_283_008


DEEPEP = EpDispatcher(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep")
HYBRIDEP = EpDispatcher(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep")


def qwen3_moe(dispatcher: EpDispatcher, fsdp: bool = False) -> SimConfig:
    return SimConfig(model="qwen3-30b-a3b", gpus=8, tp=1, ep=8, optimizer="adamw", fsdp=fsdp,
                     workload=Workload(seq_len=4096, global_batch=8, micro_batch=1),
                     options=RunOptions(ep_dispatcher=dispatcher))


@pytest.mark.parametrize("fsdp", [False, True])
def test_the_breakdown_shows_them_for_a_flex_dispatcher_only_and_the_total_grows_by_them(fsdp):
    base = simulate(qwen3_moe(EpDispatcher(), fsdp)).memory.worst
    assert base.dispatcher_buffers == 0 and "dispatcher_buffers" not in base.components()
    expected = {DEEPEP: deepep_buffer_bytes(8, H, DEEPEP_SMS), HYBRIDEP: hybridep_buffer_bytes(8, 8, 4096, H, 16)}
    for dispatcher, buffers in expected.items():
        worst = simulate(qwen3_moe(dispatcher, fsdp)).memory.worst
        assert worst.dispatcher_buffers == buffers
        assert worst.components()["dispatcher_buffers"] == buffers
        assert worst.total - base.total == buffers


@pytest.mark.parametrize("fsdp", [False, True])
def test_the_search_floor_counts_them(fsdp):
    model = resolve_model("qwen3-30b-a3b")
    assert (memory_floor(qwen3_moe(DEEPEP, fsdp), model) - memory_floor(qwen3_moe(EpDispatcher(), fsdp), model)
            == deepep_buffer_bytes(8, H, DEEPEP_SMS))



def test_a_deepep_layout_of_an_ep_size_deepep_has_no_config_for_is_refused():
    # 96 experts over EP 12 (no catalog model has them: the setup is asked directly, as `check` asks it)
    cfg = SimConfig(model="qwen3-30b-a3b", gpus=24, tp=1, ep=12, optimizer="adamw",
                    workload=Workload(seq_len=4096, global_batch=24, micro_batch=1),
                    options=RunOptions(ep_dispatcher=DEEPEP))
    arch = replace(resolve_model("qwen3-30b-a3b")[1], experts=96)
    assert arch.hidden == H
    with pytest.raises(SpecError, match="no dispatch / combine config for 12 EP ranks"):
        cfg.dispatcher_bytes(arch, 4096)
    assert replace(cfg, options=RunOptions()).dispatcher_bytes(arch, 4096) == 0  # alltoall: none


def test_check_refuses_a_deepep_group_deepep_has_no_config_for():
    """`SimConfig.check` asks for the buffer, so a layout whose expert TP x EP group DeepEP has no
    config for (128 x 2 = 256 ranks) is refused before it is simulated (and the search prunes it)."""
    cfg = SimConfig(model="qwen3-30b-a3b", gpus=256, tp=1, ep=128, etp=2, optimizer="adamw",
                    workload=Workload(seq_len=4096, global_batch=256, micro_batch=1),
                    options=RunOptions(ep_dispatcher=DEEPEP))
    with pytest.raises(SpecError, match="no dispatch / combine config for 256 EP ranks"):
        cfg.check()
    replace(cfg, options=RunOptions()).check()  # the alltoall dispatcher runs it



@pytest.mark.parametrize("seq_len, fullest", [(4096, 1), (16384, 0)])
def test_a_pipeline_stage_of_dense_layers_only_allocates_none(seq_len, fullest):
    """Megatron's flex dispatcher makes its buffer at a rank's first dispatch (`fused_a2a.get_buffer`,
    HybridEP's likewise), so a pipeline stage whose layers are all dense (a model with leading dense
    layers, as DeepSeek's) holds none. Qwen3-30B-A3B with its first 24 of 48 layers dense, at PP 2:
    the MoE stage holds them; at 16384 tokens the dense stage (two micro-batches' activations in
    flight) is the fuller one, and a flex dispatcher adds nothing to it; the search's floor is set
    by the fullest stage at each length too (with the optimizer state's mean, the MoE stage's
    experts, at 4096), so the buffers add to it exactly where that is the MoE stage."""
    from canzona.decoder import build_decoder
    from canzona.experts import expert_params
    from canzona.models import read_model
    from canzona.pipeline import stage_spec

    config = replace(read_model("qwen3-30b-a3b").config, dense_layers=tuple(range(24)))
    model = (build_decoder(config), config.architecture())
    assert [bool(expert_params(stage_spec(model[0], 2, s, 48))) for s in (0, 1)] == [False, True]
    flex = replace(qwen3_moe(DEEPEP), gpus=16, pp=2, workload=Workload(seq_len=seq_len, global_batch=16, micro_batch=1))
    alltoall = replace(flex, options=RunOptions())
    worst, base = (simulate(c, model=model).memory.worst for c in (flex, alltoall))
    assert worst.stage == base.stage == fullest
    buffers = deepep_buffer_bytes(8, H, DEEPEP_SMS) if fullest == 1 else 0
    assert worst.dispatcher_buffers == buffers and worst.total - base.total == buffers
    assert memory_floor(flex, model) - memory_floor(alltoall, model) == buffers
