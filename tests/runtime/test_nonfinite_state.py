"""NaN / Inf outside the gradients (docs/design.md §8.3), in one process (a one-rank gloo group), under
both layouts: a NaN in a loaded optimizer state or fp32 master (`load_state_dict`, torch's
`set_optimizer_state_dict`, the sharded form) is one CheckpointError naming the parameter and the
field, nothing loaded; NaN weights met by the step check (a non-finite gradient norm) are one error
naming the weights, not the data, under nonfinite="raise" and "skip" alike, nothing updated.
Before: the load took the NaN, the next step wrote it into the weights, and the step after failed
at the gradient norm blaming the data (under "skip", every later step was skipped, silently).
The spread of both to every rank of a spawned group: test_runtime_habits.py ("nan weight") and
test_fsdp_runtime.py ("nan-weight")."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch

from canzona.errors import CanzonaError, CheckpointError
from canzona.harness.training import build_model
from tests.runtime.outcomes import same

pytestmark = pytest.mark.distributed  # a one-rank gloo group in this process


def _zero1(bf16: bool = False, **kwargs):
    from tests.runtime.test_runtime_habits import BASE, _batches, _optimizer, _train

    model = build_model(replace(BASE, dtype="bf16") if bf16 else BASE)
    opt = _optimizer(model, **kwargs)
    _train(model, opt, _batches(0, 1)[:1])
    return model, opt, lambda: _train(model, opt, _batches(0, 1)[1:2])


def _fsdp(bf16: bool = False, **kwargs):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from canzona.runtime import DistributedOptimizer
    from tests.runtime.test_fsdp_runtime import MUON, Small, small_batch, small_spec

    model = Small().to(torch.bfloat16 if bf16 else torch.float32)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    opt = DistributedOptimizer(model.named_parameters(), small_spec(), "muon", MUON, **kwargs)

    def step(k: int = 0) -> None:
        opt.zero_grad()
        model(small_batch(k, 0).to(model.a.weight.dtype)).float().backward()
        opt.step()

    step()
    return model, opt, lambda: step(1)


LAYOUTS = {"zero1": _zero1, "fsdp2": _fsdp}


def _weights(model) -> dict[str, torch.Tensor]:
    from canzona.runtime.shards import local_tensor

    return {n: local_tensor(p).detach().clone() for n, p in model.named_parameters()}


def _same(a, b) -> bool:
    return same(a, b, nan_equal=True)  # a weight or witness that was NaN before is NaN after


def _damaged(saved: dict, field: str, value: float) -> tuple[dict, str]:
    """`saved` with `value` in one element of the first entry's `field`, and that entry's name."""
    saved = copy.deepcopy(saved)
    names = [n for group in saved["param_names"] for n in group]
    key = next(k for k, e in saved["state"].items() if field in e)
    saved["state"][key][field].view(-1)[1] = value
    return saved, names[key]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("field, bf16, how", [
    ("momentum_buffer", False, "load_state_dict"), ("master", True, "load_state_dict"),
    ("momentum_buffer", False, "set_optimizer_state_dict")])
def test_a_nan_in_a_loaded_state_is_refused_naming_the_parameter_and_field(one_rank, layout, field, bf16, how):
    """Before: loaded; the next step wrote NaN into the weights (torch's optimizers load it alike)."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    model, opt, step = LAYOUTS[layout](bf16)
    for value in (math.nan, math.inf):
        damaged, name = _damaged(opt.state_dict(), field, value)
        before, weights = opt.state_dict(), _weights(model)
        with pytest.raises(CheckpointError) as refused:
            opt.load_state_dict(damaged) if how == "load_state_dict" else set_optimizer_state_dict(model, opt, damaged)
        message = str(refused.value)
        assert f"optimizer state of {name!r} is damaged: its {field!r} holds NaN or Inf" in message, message
        assert "\n" not in message and _same(opt.state_dict(), before) and _same(_weights(model), weights)
    step()  # the optimizer goes on as it was
    assert all(bool(torch.isfinite(w).all()) for w in _weights(model).values())


@pytest.mark.parametrize("field, value", [("exp_avg_sq", math.nan), ("exp_avg_sq", -math.inf),
                                          ("exp_avg", math.inf)], ids=["nan-second", "minus-inf-second", "inf-first"])
def test_a_second_moment_may_hold_plus_inf_alone_every_other_non_finite_value_is_refused(one_rank, field, value):
    """+Inf is a second moment's value that torch's AdamW keeps (an overflowed g^2 in a pure-fp16
    state; `nonfinite.SECOND_MOMENTS`); NaN or -Inf there, or +Inf in a first moment, are refused
    as before, nothing loaded."""
    model, opt, step = _zero1()
    damaged, name = _damaged(opt.state_dict(), field, value)
    before, weights = opt.state_dict(), _weights(model)
    with pytest.raises(CheckpointError) as refused:
        opt.load_state_dict(damaged)
    message = str(refused.value)
    assert f"optimizer state of {name!r} is damaged: its {field!r} holds NaN or" in message, message
    assert _same(opt.state_dict(), before) and _same(_weights(model), weights)


def test_the_non_finite_values_each_field_may_hold():
    """`nonfinite_state_error` alone: +Inf in `exp_avg_sq` (AdamW's, SOAP's, Shampoo's grafting
    one: their steps stay finite and equal the references, tests/reference/test_kernels_reference.py)
    is accepted; NorMuon's `second_moment`, whose `lerp_` turns +Inf into NaN, refuses it as every
    other field does."""
    from canzona.runtime.nonfinite import nonfinite_state_error

    inf = torch.tensor([1.0, math.inf])
    assert nonfinite_state_error([("w", {"exp_avg_sq": inf, "exp_avg": torch.ones(2), "step": 3})]) is None
    # every element +Inf (a one-element bias whose g^2 overflowed; found by the review: its least
    # element is +Inf too, and it was refused as "NaN or -Inf")
    for every in (torch.tensor([math.inf]), torch.full((4,), math.inf, dtype=torch.float16)):
        assert nonfinite_state_error([("b", {"exp_avg_sq": every, "exp_avg": torch.zeros_like(every)})]) is None
    for bad in ([math.inf, math.nan], [math.inf, -math.inf]):
        assert nonfinite_state_error([("b", {"exp_avg_sq": torch.tensor(bad)})]) is not None, bad
    for field in ("second_moment", "exp_avg", "momentum_buffer", "master", "GG_L"):
        refused = nonfinite_state_error([("w", {field: inf})])
        assert refused is not None and f"its {field!r} holds NaN or Inf" in refused, (field, refused)
    for bad in (math.nan, -math.inf):
        refused = nonfinite_state_error([("w", {"exp_avg_sq": torch.tensor([1.0, bad])})])
        assert refused is not None and "its 'exp_avg_sq' holds NaN or -Inf" in refused, refused


def test_a_nan_in_a_float8_field_of_a_sharded_checkpoint_is_refused_naming_it(one_rank, tmp_path):
    """A field saved in float8 (a converter's): its finiteness checked in fp32 (exact), a NaN
    refused naming it, nothing loaded. Before: the check's `aminmax` raised NotImplementedError
    (float8) on each rank, naming nothing."""
    import torch.distributed.checkpoint as dcp

    model, opt, _ = _zero1()
    sharded = opt.sharded_state_dict()
    key = next(k for k, v in sharded.items() if isinstance(v, torch.Tensor) and "/momentum_buffer" in k
               and v.numel() > 1)
    sharded[key] = sharded[key].to(torch.float8_e4m3fn)
    sharded[key].view(-1)[0] = math.nan
    dcp.save(sharded, checkpoint_id=str(tmp_path))
    before = opt.state_dict()
    with pytest.raises(CheckpointError, match="its 'momentum_buffer' holds NaN or Inf"):
        opt.load_sharded_state_dict(str(tmp_path))
    assert _same(opt.state_dict(), before)


def _fp16_pair():
    """(canzona's pure-fp16 AdamW model and optimizer, torch's, a step function for both): two
    steps each, the second with a loss scaled so that some g^2 overflow fp16 in exp_avg_sq."""
    from torch import nn

    from canzona.runtime import DistributedOptimizer
    from canzona.spec import ModelSpec

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8)).half()

    def make(m):  # eps 1e-4: fp16 cannot hold torch's 1e-8
        return DistributedOptimizer(m.named_parameters(), ModelSpec.from_module(m), "adamw", master_weights=False,
                                    overlap_param_gather=False, adamw_config={"eps": 1e-4})

    def step(m, o, k: int, scale: float = 1.0) -> None:
        o.zero_grad()
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(k)).half()
        (m(x).float().square().sum() * scale).backward()
        o.step()

    mine, theirs = model(), model()
    opt, ref = make(mine), torch.optim.AdamW(theirs.parameters(), eps=1e-4)
    for k, scale in ((0, 1.0), (1, 3000.0)):
        step(mine, opt, k, scale)
        step(theirs, ref, k, scale)
    return (model, make, step), (mine, opt), (theirs, ref)


@pytest.mark.parametrize("form", ["load_state_dict", "sharded"])
def test_a_pure_fp16_state_whose_second_moment_overflowed_resumes_bit_for_bit_as_torch_adamw(one_rank, tmp_path,
                                                                                             form):
    """torch.optim.AdamW on fp16 parameters keeps an overflowed exp_avg_sq (+Inf: its element's
    update is then exp_avg / (sqrt(inf) + eps) = 0, finite). A checkpoint of canzona's alike
    (`master_weights=False`) resumes, and steps bit for bit as torch's. Before: refused as damaged,
    so the run could not be resumed."""
    import torch.distributed.checkpoint as dcp

    (model, make, step), (mine, opt), (theirs, ref) = _fp16_pair()
    assert any(bool(torch.isinf(ref.state[p]["exp_avg_sq"]).any()) for p in theirs.parameters())
    assert all(torch.equal(a, b) for a, b in zip(mine.parameters(), theirs.parameters()))
    resumed = model()
    resumed.load_state_dict(mine.state_dict())
    again = make(resumed)
    if form == "load_state_dict":
        again.load_state_dict(opt.state_dict())
    else:
        dcp.save(opt.sharded_state_dict(), checkpoint_id=str(tmp_path))
        again.load_sharded_state_dict(str(tmp_path))
    for k in (2, 3):
        step(resumed, again, k)
        step(theirs, ref, k)
    for (name, a), b in zip(resumed.named_parameters(), theirs.parameters()):
        assert torch.equal(a, b) and bool(torch.isfinite(a).all()), name
    saved, params = again.state_dict(), dict(theirs.named_parameters())
    names = [n for group in saved["param_names"] for n in group]
    for key, entry in saved["state"].items():  # the overflowed elements stay +Inf, as torch's
        assert torch.equal(entry["exp_avg_sq"], ref.state[params[names[key]]]["exp_avg_sq"]), names[key]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bf16", [False, True], ids=["state", "master"])
def test_a_nan_in_a_sharded_checkpoint_is_refused_naming_the_parameter_and_field(one_rank, tmp_path, layout, bf16):
    """The sharded form (`sharded_state_dict` / `dcp.save` / `load_sharded_state_dict`): before, loaded."""
    import torch.distributed.checkpoint as dcp

    model, opt, _ = LAYOUTS[layout](bf16)
    sharded = opt.sharded_state_dict()
    field = "master" if bf16 else "momentum_buffer"
    key = next(k for k, v in sharded.items() if isinstance(v, torch.Tensor) and f"/{field}" in k and v.numel() > 1)
    sharded[key] = sharded[key].clone()
    sharded[key].view(-1)[0] = math.nan
    dcp.save(sharded, checkpoint_id=str(tmp_path))
    before, weights = opt.state_dict(), _weights(model)
    with pytest.raises(CheckpointError) as refused:
        opt.load_sharded_state_dict(str(tmp_path))
    message = str(refused.value)
    assert f"is damaged: its {field!r} holds NaN or Inf" in message and "\n" not in message, message
    assert _same(opt.state_dict(), before) and _same(_weights(model), weights)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-masters"])
def test_nan_weights_are_named_at_the_step_check_not_the_data(one_rank, layout, nonfinite, bf16):
    """A NaN written into a weight (an edit; or a NaN state's step): the next step's gradient norm is
    NaN, and the error names the weights, under "skip" too (no step recovers NaN weights), nothing
    updated. Before: 'a NaN loss, an overflow or bad data', or under "skip" every step skipped."""
    from canzona.runtime.shards import local_tensor

    model, opt, step = LAYOUTS[layout](bf16, nonfinite=nonfinite)
    name, p = next((n, p) for n, p in model.named_parameters() if p.ndim == 2 and local_tensor(p).numel())
    with torch.no_grad():
        local_tensor(p).view(-1)[0] = math.nan
    before, weights = opt.state_dict(), _weights(model)
    with pytest.raises(CanzonaError) as refused:
        step()
    message = str(refused.value)
    assert message.startswith(f"the weights of {name!r} are not finite (NaN or Inf)"), message
    assert "the weights, not the data" in message and "cannot recover" in message and "\n" not in message
    assert opt.skipped_steps == 0 and _same(opt.state_dict(), before) and _same(_weights(model), weights)


def test_a_digest_disagreement_in_one_group_reaches_the_next_groups_ranks_as_a_checkpoint_error():
    """`checkpoint.agree` over DP then TP: a rank whose DP round found the ranks' state dicts differ
    refuses in the TP round, and its TP peers (which read nothing wrong) name it with that message.
    Review: they raised a bare StopIteration, the refusal's reason being None. Stub groups stand in
    for the two process groups (this rank is member 0 of each)."""
    import hashlib

    from canzona.runtime.checkpoint import agree

    class Group:
        def __init__(self, name: str, table: torch.Tensor) -> None:
            self.name, self.table = name, table

        def all_gather_values(self, values: torch.Tensor, name: str) -> torch.Tensor:
            return self.table

        def all_gather_object(self, obj: object, name: str) -> list:
            return [obj, None]

    word = int.from_bytes(hashlib.sha256(b"mine").digest()[:8], "little", signed=True)
    dp = Group("dp", torch.tensor([[0, word], [0, word + 1]]))  # the DP peer read another save
    tp = Group("tp", torch.tensor([[1, word], [0, word]]))  # this rank refuses in the TP round
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[1\] of group dp were given another"):
        agree([dp, tp], None, b"mine", "load_state_dict()", "were given another state dict than this rank")


# what a run's groups may hold when a good checkpoint is loaded to recover it, by the form loaded:
# {group: {key: value}} (group 0 Muon's, 1 AdamW's; a scheduler's NaN or Inf rate, a hand edit out
# of range), each of which the next step refuses
BROKEN_GROUPS = {"load_state_dict": {0: {"lr": math.nan}, 1: {"betas": (1.5, 0.999)}},
                 "sharded": {0: {"lr": -1.0}, 1: {"lr": math.inf}},
                 "dcp": {0: {"momentum": -0.5}, 1: {"lr": math.nan}},
                 "dcp flat": {0: {"lr": math.inf}, 1: {"lr": -1.0, "betas": (0.9, -0.5)}}}


def _load_form(form: str, model, opt, folder) -> None:
    """Load the checkpoint `_save_forms` wrote in `folder` in `form`, as a user recovering a run does."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    if form == "load_state_dict":
        opt.load_state_dict(torch.load(folder / "full.pt", weights_only=True))
    elif form == "sharded":
        opt.load_sharded_state_dict(str(folder / "sharded"))
    else:  # torch's DCP: a template from the live optimizer, filled by dcp.load, set back
        options = StateDictOptions(flatten_optimizer_state_dict=form == "dcp flat")
        template = get_optimizer_state_dict(model, opt, options=options)
        dcp.load(template, checkpoint_id=str(folder / form))
        set_optimizer_state_dict(model, opt, template, options=options)


def _save_forms(model, opt, folder) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    torch.save(opt.state_dict(), folder / "full.pt")
    dcp.save(opt.sharded_state_dict(), checkpoint_id=str(folder / "sharded"))
    for flat in (False, True):
        options = StateDictOptions(flatten_optimizer_state_dict=flat)
        dcp.save(get_optimizer_state_dict(model, opt, options=options),
                 checkpoint_id=str(folder / ("dcp flat" if flat else "dcp")))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_good_checkpoint_loaded_over_groups_a_step_refuses_resumes_bit_for_bit(one_rank, tmp_path, layout):
    """A run whose group holds what a step refuses (a NaN or Inf rate from a scheduler's bug, a
    negative rate, betas or momentum out of range from a hand edit) is recovered by loading the last
    good (stepped) checkpoint, in every form: `load_state_dict(torch.load(...))`, the sharded form,
    and torch's DCP (`get_optimizer_state_dict` as the template `dcp.load` fills, nested and
    flattened, then `set_optimizer_state_dict`). Each restores the saved groups and steps on bit for
    bit as the run that went on from the save. Before: the full form's entry templates and the
    flattened form's field names took the group's configuration as it stood, so a stepped checkpoint
    was refused with the step's error (SpecError 'muon lr must be a finite number, got nan'); the
    flattened form refused an AdamW group's too; the sharded form loaded, but its JSON gave `betas`
    back a list)."""
    from tests.runtime.test_sharded_load_dtype import _restore

    model, opt, step = LAYOUTS[layout]()
    _save_forms(model, opt, tmp_path)
    weights, groups = _weights(model), [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    step()
    step()
    want = _weights(model), opt.state_dict()
    for form, broken in BROKEN_GROUPS.items():
        _restore(model, weights)
        for g, values in broken.items():
            opt.param_groups[g].update(values)
        _load_form(form, model, opt, tmp_path)
        got = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        assert got == groups, (form, got)
        step()
        step()
        assert same(_weights(model), want[0]) and same(opt.state_dict(), want[1]), form


def test_a_sharded_load_gives_the_groups_tuples_or_lists_as_they_held_them(one_rank, tmp_path):
    """The sharded form's JSON gives lists: a configuration's tuple field comes back a tuple where
    the group held one (the default), and a list where the user's group was built with one, as the
    full form's load leaves it (before the review: a user's list came back a tuple, the sharded
    form alone)."""
    import torch.distributed.checkpoint as dcp

    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters
    from tests.runtime.test_runtime_habits import BASE, _batches, _train

    def kinds(opt):
        return [(type(g.get("betas")), type(g.get("ns_coefficients"))) for g in opt.param_groups]

    for given in ({}, {"betas": [0.9, 0.95], "ns_coefficients": [3.4445, -4.7750, 2.0315]}):
        model = build_model(BASE)
        opt = DistributedOptimizer([{"params": list(named_parameters(model)), **given}], model.spec())
        _train(model, opt, _batches(0, 1)[:1])
        held = kinds(opt)
        path = str(tmp_path / f"sharded{len(given)}")
        dcp.save(opt.sharded_state_dict(), checkpoint_id=path)
        opt.load_sharded_state_dict(path)
        assert kinds(opt) == held, (given, kinds(opt), held)
