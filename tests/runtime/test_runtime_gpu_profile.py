"""`DistributedOptimizer(cost_model=None)` plans on the GPU's own hardware profile, as `canzona plan /
simulate --hardware` plan for it (`canzona.runtime.options.planning_cost_model`): before, every GPU
planned with the H100 profile's costs. A world of one gloo rank in this process, the GPU stood in by
`gpu_name` (the one place the runtime asks CUDA)."""

from __future__ import annotations

import warnings

import pytest

from canzona.cost import cost_model_for
from canzona.hardware import DEFAULT_PROFILE
from canzona.plan import plan_for
from canzona.runtime import DistributedOptimizer, options
from reference.tiny_model import TinyQwen3


@pytest.fixture
def on_gpu(monkeypatch):
    """Stand the parameters' device in for a GPU of the name given (a fresh warning registry)."""
    def stand_in(name: str) -> None:
        monkeypatch.setattr(options, "gpu_name", lambda device: name)
        monkeypatch.setattr(options, "_WARNED", set())
    return stand_in


def test_on_an_h200_the_runtime_plans_as_plan_hardware_h200(one_rank, on_gpu):
    on_gpu("NVIDIA H200")
    model = TinyQwen3("tiny", seed=0)
    spec = model.spec()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a GPU with a profile: no warning
        opt = DistributedOptimizer(model.named_parameters(), spec, "soap")
    assert opt.plan.cost_model == "analytic:h200"
    h200 = plan_for(spec, 1, 1, "soap", opt.policy, cost_model=cost_model_for("h200"))
    assert opt.plan.hash() == h200.hash()
    h100 = plan_for(spec, 1, 1, "soap", opt.policy)  # what it planned before, and plans on the CPU
    assert h100.cost_model == f"analytic:{DEFAULT_PROFILE}" and h100.hash() != h200.hash()


def test_on_the_cpu_nothing_changes(one_rank):
    model = TinyQwen3("tiny", seed=0)
    assert DistributedOptimizer(model.named_parameters(), model.spec()).plan.cost_model == \
        f"analytic:{DEFAULT_PROFILE}"


def test_a_cost_model_given_is_the_one_planned_with_on_any_gpu(one_rank, on_gpu):
    on_gpu("NVIDIA H200")
    model = TinyQwen3("tiny", seed=0)
    given = DistributedOptimizer(model.named_parameters(), model.spec(), cost_model=cost_model_for("a100-sxm"))
    assert given.plan.cost_model == "analytic:a100-sxm"


def test_a_gpu_without_a_profile_plans_with_the_default_and_warns_once(one_rank, on_gpu):
    on_gpu("NVIDIA H100 PCIe")
    spec = TinyQwen3("tiny", seed=0).spec()
    with pytest.warns(UserWarning, match=r"no hardware profile is the GPU 'NVIDIA H100 PCIe': canzona plans the "
                                         r"owners with the h100-sxm profile's costs; give cost_model=canzona\.cost\."
                                         r"cost_model_for") as said:
        opt = DistributedOptimizer(TinyQwen3("tiny", seed=0).named_parameters(), spec)
    assert said[0].filename == __file__  # the user's line, not canzona's
    assert opt.plan.cost_model == f"analytic:{DEFAULT_PROFILE}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once a process
        DistributedOptimizer(TinyQwen3("tiny", seed=0).named_parameters(), spec)


def test_fsdp_plans_its_owners_on_the_gpus_profile(one_rank, on_gpu):
    """FsdpOptimizer, built as DistributedOptimizer builds it on a fully_shard model of more than one
    rank (`DistributedOptimizer.__new__`): every option by name, its defaults filled in."""
    import inspect

    from torch.distributed.fsdp import fully_shard

    from canzona.fsdp_plan import fsdp_matrices
    from canzona.runtime.fsdp import FsdpOptimizer
    from canzona.runtime.modules import named_parameters

    on_gpu("NVIDIA H200")
    model = TinyQwen3("tiny", seed=0)
    spec = model.spec()
    fully_shard(model)
    bound = inspect.signature(DistributedOptimizer.__init__).bind(None, list(named_parameters(model)), spec, "soap")
    bound.apply_defaults()
    opt = FsdpOptimizer({k: v for k, v in bound.arguments.items() if k != "self"},
                        {k: p.default for k, p in bound.signature.parameters.items()})
    assert opt.plan.cost_model == "analytic:h200"
    _, h200 = fsdp_matrices(spec, 1, "soap", opt.policy, cost_model=cost_model_for("h200"))
    assert opt.plan.hash() == h200.hash()
