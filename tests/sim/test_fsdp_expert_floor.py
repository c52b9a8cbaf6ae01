"""The FSDP memory floor under EP (`sim.fsdp.fsdp_memory_floor`, the search's pruning bound) takes
the fullest rank's own torch.chunk piece of its EP rank's experts, as the runtime and
`_FsdpRun.memory` hold them (uneven where the EP rank's experts do not divide by EDP), not an
even share: it stays a lower bound of the fullest rank, and is as tight as the dense part's
rounding lets it be."""

from __future__ import annotations

import pytest

from canzona.experts import dense_part
from canzona.fsdp_plan import fsdp_persistent_memory
from canzona.spec import Role
from canzona.step_options import STEP_DEFAULTS
from sim import fsdp as sim_fsdp
from sim.fsdp import _FsdpRun, check_fsdp, fsdp_memory_floor
from sim.simulate import SimConfig, layer_dims
from sim.workload import Workload
from tests.sim import small_models

WORKLOAD = Workload(seq_len=1024, global_batch=48, micro_batch=1)


# (GPUs, EP): 128 experts, so 16 local over 3 EDP ranks (6, 5, 5), 64 over 12 (ten of 6, one of 4,
# one empty), 32 over 12 (ten of 3, one of 2, one empty), and 16 over 2 (even)
@pytest.mark.parametrize("gpus, ep", [(24, 8), (24, 2), (48, 4), (16, 8)])
def test_the_floor_takes_the_fullest_ranks_experts(gpus, ep):
    cfg = SimConfig(model=small_models.MOE_FOUR_LAYERS, gpus=gpus, tp=1, ep=ep, optimizer="adamw", fsdp=True,
                    workload=WORKLOAD)
    cluster, model, hw = cfg.checked()
    spec, arch = model
    dims = layer_dims(arch, spec)
    run = _FsdpRun(cfg, model, cluster, hw, check_fsdp(cfg, cluster, spec))
    setup = cfg.memory_setup(arch, tp_mode=STEP_DEFAULTS.tp_mode)
    memory = run.memory(setup, dims)
    floor = fsdp_memory_floor(cfg, model, dims)
    assert floor <= memory.worst.total
    # rank 0 holds the fullest piece of everything (torch.chunk's first block is its largest): the
    # floor falls short of it by the dense part's slack over its mean alone
    mb = setup.master_bytes
    dense = fsdp_persistent_memory(dense_part(spec), gpus, {}, weight_bytes=0 if mb else setup.param_bytes,
                                   grad_bytes=setup.shard_grad_bytes, master_bytes=mb,
                                   moment_bytes=setup.update_state_bytes)
    held = [d.weights + d.grads + d.master_weights + d.adamw_state for d in dense]
    slack = held[0] - sum(held) / gpus
    per_element = (setup.shard_grad_bytes + mb + (0 if mb else setup.param_bytes)
                   + setup.adamw_state_bytes(1))
    assert 0 <= memory.ranks[0].total - floor - slack < 2 * per_element  # the floor's integer division


# (GPUs, EP): 16 local experts over 3 EDP ranks (6, 5, 5); 32 over 12 (ten of 3, one of 2, one
# empty); 16 over 2 (even: every rank's step as before, the mean)
@pytest.mark.parametrize("gpus, ep", [(24, 8), (48, 4), (16, 8)])
def test_each_rank_steps_its_own_piece_of_the_experts(gpus, ep, monkeypatch):
    """AdamW's step and the gradient norm on each rank cover exactly its own elements: the dense
    part's shard and its torch.chunk piece of its EP rank's experts (rank r: EDP member r // ep),
    so the fullest rank's step is the slowest and the iteration waits for it."""
    cfg = SimConfig(model=small_models.MOE_FOUR_LAYERS, gpus=gpus, tp=1, ep=ep, optimizer="adamw", fsdp=True,
                    workload=WORKLOAD)
    cluster, model, hw = cfg.checked()
    spec, _ = model
    run = _FsdpRun(cfg, model, cluster, hw, check_fsdp(cfg, cluster, spec))
    seen: dict[str, set[int]] = {"norm": set(), "adamw": set()}

    def spy(kind, kernels):
        def wrapped(numel, *args):
            seen[kind].add(numel)
            return kernels(numel, *args)
        return wrapped

    monkeypatch.setattr(sim_fsdp, "gradient_norm_kernels", spy("norm", sim_fsdp.gradient_norm_kernels))
    monkeypatch.setattr(sim_fsdp, "adamw_kernels", spy("adamw", sim_fsdp.adamw_kernels))
    run.phase_b(run.engine.env.event().succeed())
    run.engine.run()
    experts = [p for p in spec.params if p.role is Role.EXPERT]
    local = experts[0].shape[0] // ep  # each EP rank's experts of a stack
    edp = gpus // ep
    block = -(-local // edp)  # torch.chunk's rows a member
    rows = [max(0, min(block, local - i * block)) for i in range(edp)]
    per_expert = sum(p.numel // p.shape[0] for p in experts)
    dense = -(-sum(p.numel for p in spec.params if p.role is not Role.EXPERT) // gpus)
    own = [dense + rows[r // ep] * per_expert for r in range(gpus)]
    assert seen["norm"] == seen["adamw"] == set(own)
    step = {s.rank: s.end - s.start for s in run.engine.spans if s.name == "adamw step"}
    assert sorted(step) == list(range(gpus))
    fullest, smallest = own.index(max(own)), own.index(min(own))
    if len(set(rows)) > 1:
        assert step[fullest] > step[smallest]
        assert max(step.values()) == step[fullest]
    else:  # even: the mean, as an even share priced it
        assert own == [dense + sum(p.numel for p in experts) // ep // edp] * gpus
        assert len(set(step.values())) == 1
