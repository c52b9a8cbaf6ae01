"""Weights written in place after the optimizer was built (`canzona.runtime.model_loads.WeightVersions`),
in one process: what the version counters see, and that the optimizer's own writes (its steps, a
clip) mark nothing. The spread to every rank of a spawned group: test_runtime_training_loops
("rank zero load"), test_fsdp_runtime ("load-on-one-rank"), test_runtime_tp_robustness
("sharded_write_on_one_tp_rank")."""

from __future__ import annotations

import pytest
import torch

from canzona.runtime.model_loads import (
    WeightVersions,
    clear_marks,
    first_written_apart,
    mark_loaded,
    note_writes,
    renormed_in_forward,
    watch_model_loads,
)
from tests.runtime.test_nonfinite_state import LAYOUTS, _weights

pytestmark = pytest.mark.distributed  # a one-rank gloo group in this process (DTensor, the optimizers)


def test_writes_through_a_parameter_or_a_view_of_it_are_seen_and_reads_are_not():
    p, q = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(3))
    versions = WeightVersions([p, q])
    (p * 2).sum().backward()  # forward, backward, a gradient: no write of the weights
    p.grad.mul_(0.5)
    assert not versions.written()
    with torch.no_grad():
        p[1].add_(1.0)  # through a view
    assert versions.written() and not versions.written()  # each read takes the record anew
    with torch.no_grad():
        q.copy_(torch.ones(3))
    assert versions.written()
    q.data.fill_(2.0)  # the documented limit: `.data` has a version counter of its own
    assert not versions.written()


def test_a_dtensor_is_seen_written_through_itself_or_its_local_tensor(one_rank):
    """DTensor's in-place ops move the wrapper's counter only, a write into `to_local()` its local
    tensor's: both are summed. Another local tensor put in place (FSDP2 re-padding it at its lazy
    init, the same values) resets the record instead of marking a write."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    p = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0)]))
    versions = WeightVersions([p])
    with torch.no_grad():
        p.copy_(distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]))
    assert versions.written()
    with torch.no_grad():
        p.to_local().add_(1.0)
    assert versions.written()
    p._local_tensor = p._local_tensor.clone().add_(0.0)  # another tensor, written before it was put in place
    assert not versions.written()
    assert not versions.written()


def test_the_parameters_written_since_the_record_are_named_in_order(one_rank):
    """What FSDP2's refusal of a write on some ranks only names (`written_since_record`, compared
    between the ranks by `first_written_apart`): the parameters written since the last `record`,
    whatever `written()` took since; a DTensor whose local tensor was put in place is not one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    d, e = (torch.nn.Parameter(distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0)])) for _ in range(2))
    versions = WeightVersions({"d": d, "a": a, "e": e, "b": b})
    with torch.no_grad():
        b.add_(1.0)
        d.to_local().add_(1.0)
    e._local_tensor = e._local_tensor.clone().add_(0.0)
    assert versions.written() is False  # a local tensor replaced resets the record of written()
    assert versions.written_since_record() == ["b", "d"]  # plain parameters first, then the DTensors
    assert first_written_apart(["d", "a", "e", "b"], [["b", "d"], ["b"]]) == "d"
    assert first_written_apart(["a", "b"], [["b"], ["b"]]) is None
    versions.record()
    assert versions.written_since_record() == []


def test_local_tensors_put_in_each_others_place_are_a_replacement_not_a_write(one_rank):
    """The record keeps the local tensors' ids in order: their sum (before) was unchanged by two
    local tensors swapped, and a write into one of them then read as a write of the weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    p, q = (torch.nn.Parameter(distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0)])) for _ in range(2))
    versions = WeightVersions([p, q])
    p._local_tensor, q._local_tensor = q._local_tensor, p._local_tensor
    q._local_tensor.add_(0.0)  # written before it was put in place (FSDP2 re-padding it), the same values
    assert not versions.written()
    with torch.no_grad():
        p.to_local().add_(1.0)
    assert versions.written()

@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_optimizers_own_writes_mark_nothing_and_a_write_is_one_comparison(one_rank, layout):
    """Steps and step()'s own clip leave the optimizer unmarked (under ZeRO-1: no weight
    comparison); a write on the one rank marks it once (one comparison, which agrees), and the step
    trains the written weights."""
    model, opt, step = LAYOUTS[layout]()
    compared = []
    if layout == "zero1":
        check = opt._check_agreement
        opt._check_agreement = lambda *a, **k: (compared.append(k.get("weights")), check(*a, **k))[1]
    step()
    marks = [opt._model_loaded]
    opt.max_grad_norm = 1e-3  # step()'s own clip, which scales the gradients
    step()
    assert not any(marks) and not opt._model_loaded and compared == [], (marks, compared)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    written = _weights(model)
    step()
    assert not opt._model_loaded and compared == (["loaded"] if layout == "zero1" else [])
    assert not all(torch.equal(a, b) for a, b in zip(written.values(), _weights(model).values()))


def test_grad_scaler_and_clips_mark_nothing(one_rank):
    """GradScaler's unscale_ and step, and opt.clip_grad_norm_, touch the gradients only: no
    comparison under ZeRO-1 (a false mark would cost one at every step)."""
    from tests.runtime.test_runtime_habits import _batches

    model, opt, _ = LAYOUTS["zero1"]()
    compared = []
    check = opt._check_agreement
    opt._check_agreement = lambda *a, **k: (compared.append(k.get("weights")), check(*a, **k))[1]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    for k, tokens in enumerate(_batches(0, 1)[:2]):
        opt.zero_grad()
        scaler.scale(model.loss(tokens)).backward()
        if k:
            scaler.unscale_(opt)
            opt.clip_grad_norm_(1e-3)
        scaler.step(opt)
        scaler.update()
    assert compared == [] and not opt._model_loaded and scaler.get_scale() == 2.0 ** 4


class Renormed(torch.nn.Module):
    """An embedding with `max_norm` (its forward rescales the looked-up rows in place, under
    no_grad: `torch.embedding_renorm_`), then a linear head."""

    def __init__(self, max_norm: float | None = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 8, max_norm=max_norm)  # rows of norm ~2.8: rescaled
        self.head = torch.nn.Linear(8, 4)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens)).square().mean()

    def spec(self):
        from canzona.spec import ModelSpec

        return ModelSpec.from_module(self)


def test_an_embedding_renormalised_in_its_forward_is_left_out_of_the_versions():
    bag = torch.nn.EmbeddingBag(4, 2, max_norm=2.0)
    holders = {"embed.weight": [Renormed().embed], "plain.weight": [torch.nn.Embedding(4, 2)],
               "bag.weight": [bag], "head.weight": [torch.nn.Linear(2, 2)], "gone": [None]}
    assert renormed_in_forward(holders) == {"embed.weight", "bag.weight"}
    model = Renormed()
    versions = WeightVersions([model.embed.weight])
    model.loss(torch.arange(4))
    assert versions.written()  # what the optimizers leave out: the forward writes the weight


def test_a_forward_that_renormalises_an_embedding_marks_nothing_and_other_writes_still_do(one_rank):
    """Before: every forward of an `nn.Embedding(max_norm=...)` moved its weight's version counter,
    so every step compared the weights (and over DP, whose ranks look up other rows, failed with
    'ranks disagree on the loaded parameters')."""
    from canzona.runtime import DistributedOptimizer

    model = Renormed()
    opt = DistributedOptimizer(model.named_parameters(), model.spec())
    compared = []
    check = opt._check_agreement
    opt._check_agreement = lambda *a, **k: (compared.append(k.get("weights")), check(*a, **k))[1]

    def step(k: int) -> None:
        opt.zero_grad()
        model.loss(torch.arange(k, k + 6)).backward()
        opt.step()
    step(0)
    step(1)
    assert compared == [] and not opt._model_loaded
    with torch.no_grad():
        model.head.weight.mul_(0.5)
    step(2)
    assert compared == ["loaded"]


def test_a_write_of_expert_weights_only_leaves_the_tp_mark_unset():
    """Under EP x TP the TP ranks of a DP rank may hold different EP ranks' experts: a write of one
    EP rank's experts (alike on its EDP replicas) marks a comparison, but not the mark the TP ranks
    compare (`_dense_loaded`), which would differ between them."""
    dense, expert = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))

    class Owner:
        _model_loaded = _dense_loaded = False
        _weight_versions, _expert_versions = WeightVersions([dense]), WeightVersions([expert])
    owner = Owner()
    with torch.no_grad():
        expert.add_(1.0)
    note_writes(owner)
    assert owner._model_loaded and not owner._dense_loaded
    with torch.no_grad():
        dense.add_(1.0)
    note_writes(owner)
    assert owner._model_loaded and owner._dense_loaded
    loaded = Owner()
    mark_loaded(loaded, dense=False)  # a load_state_dict into modules holding experts only
    assert loaded._model_loaded and not loaded._dense_loaded


class MoEBlock(torch.nn.Module):
    """A router (dense) beside its stacked experts, held by the one module, with a dense child."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Parameter(torch.zeros(4, 8))
        self.experts = torch.nn.Parameter(torch.zeros(4, 8, 8))
        self.norm = torch.nn.LayerNorm(8)


class LoadOwner:
    """What `watch_model_loads` needs of an optimizer: its marks and `wait_params`."""

    def wait_params(self) -> None:
        pass


def watched_moe_block() -> tuple[MoEBlock, LoadOwner]:
    """An `MoEBlock` whose loads `watch_model_loads` marks on a `LoadOwner` (its `experts` the experts)."""
    from canzona.runtime.param_gather import param_holders

    block, owner = MoEBlock(), LoadOwner()
    watch_model_loads(owner, param_holders(dict(block.named_parameters())), set(), {"experts"})
    return block, owner


def test_a_load_marks_by_the_parameters_it_wrote_in_a_module_holding_experts_and_dense_weights():
    """An experts-only `load_state_dict(..., strict=False)` into a module holding both (an MoE
    block's router beside its experts) marks the experts' load, not the dense mark the TP ranks
    compare (`_dense_loaded`): under EP x TP the TP ranks of a DP rank hold different EP ranks'
    experts, so a load of one EP rank's experts on its EDP replicas set it on some TP ranks only,
    a false 'ranks disagree on the mark of weights loaded ...'. Before, any load reaching such a
    module set the dense mark (from the model's root, even of its dense children)."""
    block, owner = watched_moe_block()

    def marks(state: dict) -> tuple[bool, bool, bool]:
        clear_marks(owner)
        block.load_state_dict(state, strict=False)
        return owner._model_loaded, owner._dense_loaded, owner._experts_loaded
    full = block.state_dict()
    assert marks({"experts": full["experts"]}) == (True, False, True)
    assert marks({"router": full["router"]}) == (True, True, False)
    assert marks({"norm.weight": full["norm.weight"]}) == (True, True, False)
    assert marks(full) == (True, True, True)
    assert marks({}) == (False, False, False)  # nothing written: nothing marked


def test_a_load_waits_for_the_steps_parameter_gathers_before_it_copies(one_rank):
    """A `load_state_dict` into a module the optimizer steps waits for the last step's parameter
    all-gathers first (a pre-hook: `wait_params`). A DTensor parameter is not marked pending, so
    before, a gather still in flight could land after the load and write the old weights over the
    loaded ones (CI saw DP replicas of a TP model disagree after such a load)."""
    from canzona.runtime import DistributedOptimizer

    model = Renormed(max_norm=None)
    opt = DistributedOptimizer(model.named_parameters(), model.spec())
    order = []
    opt.wait_params = lambda: order.append("wait")
    model.head.register_load_state_dict_post_hook(lambda *a: order.append("copied"))
    model.load_state_dict(model.state_dict())
    assert order[:1] == ["wait"] and "copied" in order, order


def test_a_load_marks_what_it_wrote_after_a_key_renaming_pre_hook_registered_after_the_optimizer():
    """A load pre-hook of the user's registered after the optimizer's (a checkpoint's old names
    renamed, as Hugging Face's do) runs after it: the keys the load writes are read as it wrote
    them (its missing keys), not from the state dict before the renaming. Before, the optimizer's
    pre-hook found none of the module's keys under the old names and marked nothing: a load
    on some ranks only went unseen."""
    block, owner = watched_moe_block()

    def rename(module, state_dict, prefix, *args):
        for old, new in (("gate", "router"), ("moe", "experts")):
            if prefix + old in state_dict:
                state_dict[prefix + new] = state_dict.pop(prefix + old)
    block.register_load_state_dict_pre_hook(rename)

    def marks(state: dict) -> tuple[bool, bool, bool]:
        clear_marks(owner)
        block.load_state_dict(state, strict=False)
        return owner._model_loaded, owner._dense_loaded, owner._experts_loaded
    full = block.state_dict()
    assert marks({"moe": full["experts"]}) == (True, False, True)
    assert marks({"gate": full["router"]}) == (True, True, False)
    assert marks({"experts": full["experts"]}) == (True, False, True)  # the new names too
    assert marks({}) == (False, False, False)
