"""What a torch.optim user sets in `param_groups` means what it means to torch.optim.AdamW and
torch.optim.Muon, or is one error before any update; never silently ignored. A world of one gloo
rank in this process (no processes spawned), against torch's optimizers in the same process."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from canzona.errors import CanzonaError, SpecError
from canzona.runtime import DistributedOptimizer
from reference.data import fixed_batch
from reference.tiny_model import TinyQwen3
from tests.runtime import scalars


def _pair(optimizer: str = "muon"):
    """(canzona's model and optimizer, torch's model and optimizers), the same weights."""
    mine, theirs = TinyQwen3("tiny", seed=0), TinyQwen3("tiny", seed=0)
    opt = DistributedOptimizer(mine.named_parameters(), mine.spec(), optimizer, overlap_param_gather=False)
    matrices = {p.name for p in mine.spec().matrix_params()} if optimizer == "muon" else set()
    named = list(theirs.named_parameters())
    torch_opts = [torch.optim.AdamW([p for n, p in named if n not in matrices])]
    if matrices:
        torch_opts.insert(0, torch.optim.Muon([p for n, p in named if n in matrices]))
    return (mine, opt), (theirs, torch_opts)


def _step(model, opts, tokens) -> None:
    for o in opts:
        o.zero_grad()
    model.loss(tokens).backward()
    for o in opts:
        o.step()


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize(("flag", "value"), [
    ("maximize", True), ("amsgrad", True), ("decoupled_weight_decay", False), ("differentiable", True),
    ("capturable", True),
])
def test_a_torch_adamw_flag_canzona_does_not_run_is_one_error_before_any_update(one_rank, flag, value):
    (model, opt), _ = _pair()
    tokens = fixed_batch(256, 2, 16, seed=3)
    _step(model, [opt], tokens)
    adamw = next(g for g in opt.param_groups if g["kind"] == "adamw")
    adamw[flag] = value  # a hand edit, as torch.optim.AdamW honours it
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    model.loss(tokens).backward()
    with pytest.raises(SpecError, match=f"{flag}={value!r} is torch.optim.AdamW's flag"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))  # nothing updated


def test_torch_adamw_flags_at_their_defaults_and_kernel_choices_step_as_torch(one_rank):
    (mine, opt), (theirs, torch_opts) = _pair()
    tokens = fixed_batch(256, 2, 16, seed=3)
    for g in opt.param_groups:
        if g["kind"] == "adamw":  # what a group copied from torch's AdamW holds
            g.update(maximize=False, amsgrad=False, decoupled_weight_decay=True, differentiable=False,
                     capturable=False, foreach=None, fused=None)
    for _ in range(2):
        _step(mine, [opt], tokens)
        _step(theirs, torch_opts, tokens)
    assert _same(mine, theirs)


def test_a_momentum_key_on_adamw_groups_without_muon_is_ignored_as_torch_ignores_it(one_rank):
    """Only beside Muon (whose `momentum` the schedulers cycle in every group) is an AdamW group's
    `momentum` its beta1; beside AdamW alone (or SOAP, Shampoo) the schedulers cycle `betas`."""
    (mine, opt), (theirs, torch_opts) = _pair("adamw")
    tokens = fixed_batch(256, 2, 16, seed=3)
    for o in (opt, *torch_opts):
        for g in o.param_groups:
            g["momentum"] = 0.5
    for _ in range(2):
        _step(mine, [opt], tokens)
        _step(theirs, torch_opts, tokens)
    assert _same(mine, theirs)



def _tensor_betas() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(0.9), torch.tensor(0.999)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("how", ["group", "edit"])
def test_tensor_betas_step_bit_for_bit_as_torch_adamw(one_rank, optimizer, how):
    """`betas` as one-element tensors (torch.optim.AdamW takes them; its step then computes the bias
    corrections in the tensors' dtype) in a param group or set by hand: canzona's AdamW steps bit for
    bit as torch's (CPU: its single-tensor path). Before: the betas were read as Python numbers and
    the bias corrections computed in float64, about 6e-7 off after two steps."""
    mine, theirs = TinyQwen3("tiny", seed=0), TinyQwen3("tiny", seed=0)
    if how == "group":
        opt = DistributedOptimizer([{"params": list(mine.named_parameters()), "betas": _tensor_betas()}],
                                   mine.spec(), optimizer, overlap_param_gather=False)
    else:
        opt = DistributedOptimizer(mine.named_parameters(), mine.spec(), optimizer, overlap_param_gather=False)
        for g in opt.param_groups:
            if g["kind"] == "adamw":
                g["betas"] = _tensor_betas()
    matrices = {p.name for p in mine.spec().matrix_params()} if optimizer == "muon" else set()
    named = list(theirs.named_parameters())
    torch_opts = [torch.optim.AdamW([p for n, p in named if n not in matrices], betas=_tensor_betas())]
    if matrices:
        torch_opts.insert(0, torch.optim.Muon([p for n, p in named if n in matrices]))
    tokens = fixed_batch(256, 2, 16, seed=3)
    for _ in range(3):
        _step(mine, [opt], tokens)
        _step(theirs, torch_opts, tokens)
        assert _same(mine, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("betas_dtype", [torch.float32, torch.float64])
def test_the_adamw_kernel_with_tensor_betas_is_torch_adamws_step(dtype, betas_dtype):
    """`adamw_step_` given tensor betas (the group's, `group_betas`: what both layouts pass) is
    torch.optim.AdamW's single-tensor step with them, bit for bit, over several steps, for
    parameters in each float dtype (torch casts beta1 to the parameter's dtype for the lerp)."""
    from canzona.optimizers import AdamWConfig
    from canzona.runtime.kernels import adamw_step_

    betas = (torch.tensor(0.9, dtype=betas_dtype), torch.tensor(0.999, dtype=betas_dtype))
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(257, generator=gen).to(dtype)
    mine, theirs = start.clone(), torch.nn.Parameter(start.clone())
    ref = torch.optim.AdamW([theirs], lr=0.01, betas=betas, weight_decay=0.1, foreach=False)
    cfg, state = AdamWConfig(lr=0.01, weight_decay=0.1), {}
    for _ in range(4):
        grad = torch.randn(257, generator=gen).to(dtype)
        theirs.grad = grad.clone()
        ref.step()
        adamw_step_(mine, grad, state, cfg, 0.01, betas=betas)
        assert torch.equal(mine, theirs.detach())


@pytest.mark.parametrize("kind", ["float32", "float64"])
def test_numpy_betas_step_bit_for_bit_as_torch_adamw(kind):
    """A group's `betas` as NumPy scalars (a schedule computed with NumPy): `group_betas` passes them
    to `adamw_step_` as they are, which steps as torch.optim.AdamW's single-tensor step does with
    them (its bias corrections in NumPy's float32 arithmetic for np.float32), bit for bit over 6
    steps. Before: made Python floats (float64 bias corrections), 2.4e-7 off after 6 steps."""
    import numpy as np

    from canzona.optimizers import AdamWConfig
    from canzona.runtime.groups import group_betas
    from canzona.runtime.kernels import adamw_step_

    betas = (getattr(np, kind)(0.9), getattr(np, kind)(0.999))
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(37, generator=gen)
    mine, theirs = start.clone(), torch.nn.Parameter(start.clone())
    ref = torch.optim.AdamW([theirs], lr=0.01, weight_decay=0.1, foreach=False)
    ref.param_groups[0]["betas"] = betas
    cfg, state = AdamWConfig(lr=0.01, weight_decay=0.1), {}
    for _ in range(6):
        grad = torch.randn(37, generator=gen)
        theirs.grad = grad.clone()
        ref.step()
        adamw_step_(mine, grad, state, cfg, 0.01, group_betas({"betas": betas}))
        assert torch.equal(mine, theirs.detach())


def test_numpy_betas_resume_bit_for_bit_from_the_sharded_form(one_rank, tmp_path):
    """np.float32 betas (stepped in float32 arithmetic, as torch's AdamW steps them): the sharded
    form keeps their numbers (JSON) and their NumPy type (its record), and the load makes them that
    NumPy type again: the resumed step is the uninterrupted one, bit for bit. Before
    (with the betas passed to the step as they are): resumed as Python floats, another rounding."""
    import numpy as np
    import torch.distributed.checkpoint as dcp

    betas = (np.float32(0.9), np.float32(0.999))
    tokens = fixed_batch(256, 2, 8, seed=3)

    def built(seed: int):
        model = TinyQwen3("tiny", seed=seed)
        return model, DistributedOptimizer([{"params": list(model.named_parameters()), "betas": betas}],
                                           model.spec(), "adamw", overlap_param_gather=False)

    model, opt = built(0)
    _step(model, [opt], tokens)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    dcp.save(opt.sharded_state_dict(), checkpoint_id=tmp_path)
    _step(model, [opt], tokens)
    again, resumed = built(1)
    again.load_state_dict(weights)
    resumed.load_sharded_state_dict(tmp_path)
    assert [type(b) for b in resumed.param_groups[0]["betas"]] == [np.float32, np.float32]
    _step(again, [resumed], tokens)
    assert _same(model, again)


@pytest.mark.parametrize("case", ["numpy saved, floats live", "floats saved, numpy live", "0-d array lr",
                                  "float saved, float16 live", "float saved, int64 live"])
def test_numpy_hyper_parameters_come_back_as_saved_from_the_sharded_form(one_rank, tmp_path, case):
    """The sharded form records each NumPy hyper-parameter's type (its dtype name; a 0-d array as
    a 0-d array, as torch's own state_dict round trip keeps it) and the load restores what was
    saved, whatever the live group holds: np.float32 betas saved resume bit for bit in an optimizer
    built with float betas; floats saved stay floats. Before: the type was guessed from the live
    group (value-dependent: 0.5 became np.float32, 0.999 stayed a float; np.float32 betas saved came
    back floats, another rounding), a 0-d array lr crashed every load (TypeError), a live np.int64
    or np.float16 overflowed (OverflowError, an overflow warning)."""
    import warnings

    import numpy as np
    import torch.distributed.checkpoint as dcp

    tokens = fixed_batch(256, 2, 8, seed=3)
    saved_kw, live_kw = {
        "numpy saved, floats live": ({"betas": (np.float32(0.9), np.float32(0.999))}, {}),
        "floats saved, numpy live": ({"betas": (0.5, 0.999)}, {"betas": (np.float32(0.9), np.float32(0.99))}),
        "0-d array lr": ({"lr": np.array(0.01)}, {"lr": np.array(0.02)}),
        "float saved, float16 live": ({"weight_decay": 1e5}, {"weight_decay": np.float16(0.1)}),
        "float saved, int64 live": ({"weight_decay": 1e20}, {"weight_decay": np.int64(0)}),
    }[case]

    def built(seed: int, kw):
        model = TinyQwen3("tiny", seed=seed)
        return model, DistributedOptimizer([{"params": list(model.named_parameters()), **kw}],
                                           model.spec(), "adamw", overlap_param_gather=False)

    model, opt = built(0, saved_kw)
    _step(model, [opt], tokens)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    dcp.save(opt.sharded_state_dict(), checkpoint_id=tmp_path)
    again, resumed = built(1, live_kw)
    again.load_state_dict(weights)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        resumed.load_sharded_state_dict(tmp_path)
    for key, value in saved_kw.items():
        got = resumed.param_groups[-1][key]
        pairs = list(zip(value, got)) if isinstance(value, tuple) else [(value, got)]
        assert type(got) is type(value)
        for v, g in pairs:
            assert type(g) is type(v) and g == v and getattr(g, "dtype", None) == getattr(v, "dtype", None)
    if case == "numpy saved, floats live":  # the resumed step is the uninterrupted one
        _step(model, [opt], tokens)
        _step(again, [resumed], tokens)
        assert _same(model, again)


def test_the_sharded_metadata_numpy_record_is_the_only_source_of_numpy_types():
    """`json_load` of the sharded metadata: a save without the NumPy record (before 2026-12-03)
    gives the plain numbers; a record gives that type (a 0-d array as one); a record its number
    does not fit (an edited file: a float recorded int64, 1e20 as int64) is one CheckpointError."""
    import json

    import numpy as np

    from canzona.errors import CheckpointError
    from canzona.runtime.checkpoint import NUMPY_TYPES_KEY, json_load

    groups = [{"lr": 0.01, "betas": [float(np.float32(0.9)), 0.999]}]
    old = json_load(json.dumps({"param_groups": groups}))
    assert old["param_groups"] == groups and type(old["param_groups"][0]["lr"]) is float
    got = json_load(json.dumps({"param_groups": groups,
                                NUMPY_TYPES_KEY: [{"lr": "ndarray:float64", "betas": ["float32", None]}]}))
    lr, (b1, b2) = got["param_groups"][0]["lr"], got["param_groups"][0]["betas"]
    assert type(lr) is np.ndarray and lr.shape == () and lr == 0.01
    assert type(b1) is np.float32 and b1 == np.float32(0.9) and type(b2) is float
    for record, value in (("int64", 0.5), ("int64", 1e20), ("float16", 1e5), ("object", 1.0), ("float32", 0.1)):
        with pytest.raises(CheckpointError, match="NumPy"):
            json_load(json.dumps({"param_groups": [{"x": value}], NUMPY_TYPES_KEY: [{"x": record}]}))


def test_tensor_betas_are_cast_once_per_group_and_step_bit_for_bit_as_torch_adamw(one_rank, monkeypatch):
    """float64 tensor betas in a group of float32 parameters (as CPU betas for CUDA parameters):
    beta1 is cast to the moments' device and dtype once per group and step, as torch.optim.AdamW's
    single-tensor step casts it once per (device, dtype) (its `beta1_dict`), and the weights are
    torch's bit for bit. Before: `adamw_step_` cast it for every AdamW piece (a blocking host-to-
    device copy per piece per step on CUDA)."""
    mine, theirs = TinyQwen3("tiny", seed=0), TinyQwen3("tiny", seed=0)
    betas = (torch.tensor(0.9, dtype=torch.float64), torch.tensor(0.999, dtype=torch.float64))
    opt = DistributedOptimizer([{"params": list(mine.named_parameters()), "betas": betas}], mine.spec(), "adamw",
                               overlap_param_gather=False)
    ref = torch.optim.AdamW(list(theirs.parameters()), betas=betas, foreach=False)
    casts = []
    to = torch.Tensor.to

    def counted(self, *args, **kwargs):
        if self is betas[0]:
            casts.append(kwargs.get("dtype"))
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counted)
    tokens = fixed_batch(256, 2, 8, seed=3)
    for _ in range(2):
        _step(mine, [opt], tokens)
        _step(theirs, [ref], tokens)
        assert _same(mine, theirs)
    # torch's step and ours, once a step each (before: ours once for each of the 24 parameters)
    assert casts == [torch.float32] * 4, casts


STEPS = 4
EDITED_BETAS = (0.8, 0.99)


def _one_cycle(opt, lr: float = 1e-3):
    max_lr = [lr] * len(opt.param_groups)
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=max_lr if len(max_lr) > 1 else lr, total_steps=STEPS)


def _edit_betas(opt) -> None:
    for g in opt.param_groups:
        if "betas" in g:
            g["betas"] = EDITED_BETAS


def test_a_betas_edit_of_an_adamw_group_after_momentum_cycling_steps_as_torch_adamw(one_rank):
    """OneCycleLR beside Muon cycles `momentum` in every group (AdamW's beta1); a later hand edit of
    an AdamW group's `betas` takes effect at the next step, as in torch.optim.AdamW under
    OneCycleLR, until the scheduler sets momentum again; and survives a save taken before that step."""
    (mine, opt), (theirs, torch_opts) = _pair()
    scheds, torch_scheds = [_one_cycle(opt)], [_one_cycle(o) for o in torch_opts]
    tokens = fixed_batch(256, 2, 16, seed=3)
    for k in range(STEPS):
        if k == 2:
            _edit_betas(opt)
            _edit_betas(torch_opts[1])
            saved = opt.state_dict(), scheds[0].state_dict(), {n: p.detach().clone() for n, p in mine.named_parameters()}
        _step(mine, [opt], tokens)
        _step(theirs, torch_opts, tokens)
        for s in (*scheds, *torch_scheds):
            s.step()
    assert _same(mine, theirs)
    adamw = next(g for g in opt.param_groups if g["kind"] == "adamw")
    assert adamw["betas"][0] == adamw["momentum"] == torch_opts[1].param_groups[0]["betas"][0]
    # resumed from the save taken with the edit pending: the same weights
    resumed = TinyQwen3("tiny", seed=0)
    with torch.no_grad():
        for n, p in resumed.named_parameters():
            p.copy_(saved[2][n])
    opt2 = DistributedOptimizer(resumed.named_parameters(), resumed.spec(), "muon", overlap_param_gather=False)
    sched2 = _one_cycle(opt2)
    opt2.load_state_dict(saved[0])
    sched2.load_state_dict(saved[1])
    for _ in range(2, STEPS):
        _step(resumed, [opt2], tokens)
        sched2.step()
    assert _same(resumed, mine)


def test_momentum_and_betas_written_past_each_other_are_one_error_before_any_update(one_rank):
    """An AdamW group beside Muon keeps its two beta1 keys agreeing on every write through the
    group; one written past that (`dict`'s own methods, a group swapped for a plain dict) that
    leaves them disagreeing is one error, not one of them silently ignored."""
    (model, opt), _ = _pair()
    sched = _one_cycle(opt)
    tokens = fixed_batch(256, 2, 16, seed=3)
    _step(model, [opt], tokens)
    sched.step()
    g = next(i for i, g in enumerate(opt.param_groups) if g["kind"] == "adamw")
    opt.param_groups[g] = {**opt.param_groups[g], "betas": EDITED_BETAS}  # a plain dict, momentum as it was
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    model.loss(tokens).backward()
    with pytest.raises(SpecError, match=r"momentum \(.*\) and betas\[0\] \(0.8\) are both its beta1 and disagree"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_muon_adjust_lr_fn_none_is_torchs_default_original(one_rank):
    """torch.optim.Muon's `adjust_lr_fn=None` (its default, "original"), in matrix_config and set in
    a group mid-run, steps as torch's Muon does."""
    mine, theirs = TinyQwen3("tiny", seed=0), TinyQwen3("tiny", seed=0)
    opt = DistributedOptimizer(mine.named_parameters(), mine.spec(), "muon", {"adjust_lr_fn": None},
                               overlap_param_gather=False)
    matrices = {p.name for p in mine.spec().matrix_params()}
    named = list(theirs.named_parameters())
    torch_opts = [torch.optim.Muon([p for n, p in named if n in matrices], adjust_lr_fn=None),
                  torch.optim.AdamW([p for n, p in named if n not in matrices])]
    tokens = fixed_batch(256, 2, 16, seed=3)
    _step(mine, [opt], tokens)
    _step(theirs, torch_opts, tokens)
    for o in (opt, torch_opts[0]):
        o.param_groups[0]["adjust_lr_fn"] = "match_rms_adamw"
    _step(mine, [opt], tokens)
    _step(theirs, torch_opts, tokens)
    for o in (opt, torch_opts[0]):
        o.param_groups[0]["adjust_lr_fn"] = None
    _step(mine, [opt], tokens)
    _step(theirs, torch_opts, tokens)
    assert _same(mine, theirs)


def _pop_last(opt) -> None:
    opt.param_groups[-1]["params"].pop()  # "stop training this one", as torch.optim follows it


def _move_one(opt) -> None:
    """A parameter moved from one AdamW group into another (its hyper-parameters would change)."""
    first, second = [g for g in opt.param_groups if g["kind"] == "adamw"][:2]
    second["params"].append(first["params"].pop())


def _append_group(opt) -> None:
    opt.param_groups.append({**opt.param_groups[-1], "params": [torch.nn.Parameter(torch.ones(3))]})


def _drop_group(opt) -> None:
    opt.param_groups.pop()


@pytest.mark.parametrize("edit", [_pop_last, _move_one, _append_group, _drop_group],
                         ids=["param-removed", "param-moved", "group-appended", "group-removed"])
def test_param_groups_membership_edited_after_construction_is_one_error_before_any_update(one_rank, edit):
    """torch.optim steps what `param_groups[i]['params']` holds at each step; canzona's plan lays out
    the parameters given at construction, so a parameter removed from, added to or moved between
    groups (or a group appended or dropped past `add_param_group`) would be ignored: one error at
    the next step, before any update, never a step that silently differs from torch's."""
    model = TinyQwen3("tiny", seed=0)
    d = [(n, p) for n, p in model.named_parameters() if p.ndim >= 2]
    nd = [(n, p) for n, p in model.named_parameters() if p.ndim < 2]
    opt = DistributedOptimizer([{"params": d}, {"params": nd, "weight_decay": 0.0}], model.spec(), "muon",
                               overlap_param_gather=False)
    tokens = fixed_batch(256, 2, 16, seed=3)
    _step(model, [opt], tokens)
    edit(opt)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    model.loss(tokens).backward()
    with pytest.raises(CanzonaError, match=r"param_groups.* after construction"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_reading_a_state_value_through_opt_state_is_one_error_naming_state_dict(one_rank):
    """`opt.state[p]` names the fields of p's state (what torch's flattened checkpoints read), but the
    state lives sharded in the optimizer's own structures: code that reads a value there as from
    torch's optimizers (logging `exp_avg`'s norm) gets one error naming where the values are, not
    an AttributeError of a None."""
    (model, opt), _ = _pair("adamw")
    _step(model, [opt], fixed_batch(256, 2, 16, seed=3))
    p = next(iter(model.parameters()))
    fields = opt.state[p]
    assert "exp_avg" in fields and "step" in fields
    for read in (lambda: fields["exp_avg"].norm(), lambda: torch.norm(fields["exp_avg"]),
                 lambda: fields["step"].item()):
        with pytest.raises(CanzonaError, match=r"opt\.state_dict\(\)\['state'\]"):
            read()
    index = [id(q) for g in opt.param_groups for q in g["params"]].index(id(p))
    assert opt.state_dict()["state"][index]["exp_avg"].shape == p.shape  # where the values are


def test_a_state_fields_values_answer_attribute_probes_as_any_object_does(one_rank):
    """`hasattr`, `getattr(..., default)` and copies of `opt.state[p]`'s values work (an attribute
    probe sees none), so tools that walk what they find keep working."""
    import copy

    (model, opt), _ = _pair("adamw")
    fields = dict(opt.state[next(iter(model.parameters()))])
    assert not hasattr(fields["exp_avg"], "device")
    assert getattr(fields["exp_avg"], "shape", None) is None
    assert set(copy.deepcopy(fields)) == set(fields)
    assert "opt.state_dict()" in repr(fields["exp_avg"])


def test_param_groups_reordered_in_place_step_as_torch(one_rank):
    """A group's parameters put in another order (sorted by name for a log) hold the same
    parameters: the step runs, as torch's does (not the membership check's error)."""
    (mine, opt), (theirs, torch_opts) = _pair()
    tokens = fixed_batch(256, 2, 16, seed=3)
    _step(mine, [opt], tokens)
    _step(theirs, torch_opts, tokens)
    for g in opt.param_groups:
        g["params"].reverse()
    _step(mine, [opt], tokens)
    _step(theirs, torch_opts, tokens)
    assert _same(mine, theirs)


def _scale_in_place(p) -> None:
    p.grad.mul_(0.5)


def _read_the_norm(p) -> None:
    p.grad.norm()


@pytest.mark.parametrize("hook", [_scale_in_place, _read_the_norm], ids=["scales-in-place", "reads-the-norm"])
def test_a_gradient_hook_registered_after_the_optimizer_is_named_not_taken_for_accumulation(one_rank, hook):
    """A `register_post_accumulate_grad_hook` registered after the optimizer runs after the
    optimizer's own, which took the gradient: one error naming the hook and the ways that work
    (before: 'gradients were synchronised twice ... no_sync()', about accumulation the loop never did).
    An in-place edit is recorded and refused by step()'s check, which every rank runs together (a
    raise inside backward on one rank would leave its peers waiting); a read raises in backward."""
    (model, opt), _ = _pair()
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    with pytest.raises(CanzonaError, match=r"register_post_accumulate_grad_hook.*before building the optimizer") as e:
        model.loss(fixed_batch(256, 2, 16, seed=3)).backward()
        opt.step()
    assert any(f.name == "_step" for f in e.traceback) == (hook is _scale_in_place), e.traceback


def test_a_gradient_hook_registered_before_the_optimizer_steps_as_torch(one_rank):
    """Registered before the optimizer, a post-accumulate-grad hook runs before the optimizer's own
    and changes what it steps, as with torch's optimizers."""
    def halve(p) -> None:
        p.grad.mul_(0.5)

    mine, theirs = TinyQwen3("tiny", seed=0), TinyQwen3("tiny", seed=0)
    for p in (*mine.parameters(), *theirs.parameters()):
        p.register_post_accumulate_grad_hook(halve)
    opt = DistributedOptimizer(mine.named_parameters(), mine.spec(), "muon", overlap_param_gather=False)
    matrices = {p.name for p in mine.spec().matrix_params()}
    named = list(theirs.named_parameters())
    torch_opts = [torch.optim.Muon([p for n, p in named if n in matrices]),
                  torch.optim.AdamW([p for n, p in named if n not in matrices])]
    tokens = fixed_batch(256, 2, 16, seed=3)
    for _ in range(2):
        _step(mine, [opt], tokens)
        _step(theirs, torch_opts, tokens)
    assert _same(mine, theirs)


@pytest.mark.parametrize("habit", ["zeroed-grads", "no_sync"])
def test_a_gradient_hook_registered_before_the_optimizer_under_accumulation_is_not_blamed_on_its_order(
        one_rank, habit):
    """Registered BEFORE the optimizer, a post-accumulate-grad hook under `zero_grad(set_to_none=
    False)` or a `no_sync()` accumulation finds `.grad` already the optimizer's guard (autograd
    accumulated into it): the error says so and names p.register_hook, not 'register it before
    building the optimizer' (what the user did)."""
    def halve(p) -> None:
        p.grad.mul_(0.5)

    model = TinyQwen3("tiny", seed=0)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(halve)
    opt = DistributedOptimizer(model.named_parameters(), model.spec(), "muon", overlap_param_gather=False)
    opt.zero_grad(set_to_none=habit != "zeroed-grads")
    if habit == "zeroed-grads":  # a first step, then its zeroed gradients
        model.loss(fixed_batch(256, 2, 16, seed=3)).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    else:
        with opt.no_sync():
            model.loss(fixed_batch(256, 2, 16, seed=3)).backward()
    model.loss(fixed_batch(256, 2, 16, seed=4)).backward()  # the hook's in-place edit recorded, not raised
    with pytest.raises(CanzonaError) as raised:
        opt.step()  # the in-place edit refused by the step's check, on every rank together
    assert any(f.name == "_step" for f in raised.traceback), raised.traceback
    message = str(raised.value)
    assert "p.register_hook" in message and "accumulat" in message, message
    assert "register it before building the optimizer" not in message, message


@pytest.mark.parametrize("save", ["state_dict", "sharded_state_dict"])
@pytest.mark.parametrize("edit", [_pop_last, _move_one, _append_group, _drop_group],
                         ids=["param-removed", "param-moved", "group-appended", "group-removed"])
def test_a_save_after_param_groups_membership_was_edited_is_the_same_one_error(one_rank, edit, save):
    """A save after such an edit wrote a checkpoint missing parameters, which no optimizer of the
    model loads (or, after a group appended, failed with a KeyError of an id): the step's error,
    before any collective."""
    model = TinyQwen3("tiny", seed=0)
    d = [(n, p) for n, p in model.named_parameters() if p.ndim >= 2]
    nd = [(n, p) for n, p in model.named_parameters() if p.ndim < 2]
    opt = DistributedOptimizer([{"params": d}, {"params": nd, "weight_decay": 0.0}], model.spec(), "muon",
                               overlap_param_gather=False)
    _step(model, [opt], fixed_batch(256, 2, 16, seed=3))
    edit(opt)
    with pytest.raises(CanzonaError, match=r"param_groups.* after construction"):
        getattr(opt, save)()



def _scaled_step(model, opt, step: int) -> float:
    """One step; the gradients' norm as canzona's clip measures it (by inf: it only measures)."""
    opt.zero_grad()
    scalars.backward(model, step)
    norm = float(opt.clip_grad_norm_(math.inf))
    opt.step()
    return norm


def test_0d_parameters_step_and_checkpoint_as_torch_adamw_beside_muon(one_rank, tmp_path):
    """0-d parameters are AdamW's, bit for bit torch.optim.AdamW (foreach) beside torch.optim.Muon
    on the matrices; the clip's norm counts them (as torch's, to the order of its sum); the full
    state dict holds their state as torch's AdamW does (tensors of shape ()), and the full, sharded
    and torch-DCP checkpoints resume them exactly."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    mine = scalars.Scaled()
    opt = scalars.canzona_optimizer(mine)
    theirs = scalars.Scaled()
    torch_opts = scalars.torch_optimizers(theirs)
    for step in range(3):
        norm = _scaled_step(mine, opt, step)
        scalars.torch_step(theirs, torch_opts, step)
        want = torch.nn.utils.get_total_norm([p.grad for p in theirs.parameters()])
        assert norm == pytest.approx(float(want), rel=1e-6)
    assert _same(mine, theirs) and mine.gate.item() != 0.0
    full = opt.state_dict()
    for name in ("gate", "logit_scale"):
        have, want = scalars.by_name(full)[name], scalars.adamw_state(torch_opts, theirs, name)
        assert have["step"] == int(want["step"])
        for field in ("exp_avg", "exp_avg_sq"):
            assert have[field].shape == () and torch.equal(have[field], want[field]), (name, field)
    dcp.save(opt.sharded_state_dict(), checkpoint_id=tmp_path / "sharded")
    dcp.save({"optim": get_optimizer_state_dict(mine, opt)}, checkpoint_id=tmp_path / "dcp")
    resumed = {}
    for form in ("full", "sharded", "dcp"):
        model = scalars.Scaled()
        model.load_state_dict(mine.state_dict())
        again = scalars.canzona_optimizer(model)
        if form == "full":
            again.load_state_dict(full)
        elif form == "sharded":
            again.load_sharded_state_dict(tmp_path / "sharded")
        else:
            state = {"optim": get_optimizer_state_dict(model, again)}
            dcp.load(state, checkpoint_id=tmp_path / "dcp")
            set_optimizer_state_dict(model, again, state["optim"])
        resumed[form] = (model, again)
    for step in range(3, 5):
        scalars.torch_step(theirs, torch_opts, step)
        for model, again in resumed.values():
            _scaled_step(model, again, step)
    for form, (model, _) in resumed.items():
        assert _same(model, theirs), form


def test_a_state_dict_saved_with_tensor_learning_rates_resumes_as_torch(one_rank):
    """A one-element tensor `lr` in `param_groups` (torch's advice for compiled optimizers; what a
    scheduler then fills in place) steps as the number it holds, and the state dict taken with it
    loads, keeping it a tensor as torch's load_state_dict does (before: one PlanError at the load,
    'lr must be a finite number, got tensor(0.0100)': a run that could not resume)."""
    (mine, opt), (theirs, torch_opts) = _pair()
    tokens = fixed_batch(256, 2, 16, seed=3)
    for o in (opt, *torch_opts):
        for g in o.param_groups:
            g["lr"] = torch.tensor(0.01)
    _step(mine, [opt], tokens)
    _step(theirs, torch_opts, tokens)
    saved, weights = opt.state_dict(), {n: p.detach().clone() for n, p in mine.named_parameters()}
    del opt
    resumed = TinyQwen3("tiny", seed=0)
    with torch.no_grad():
        for n, p in resumed.named_parameters():
            p.copy_(weights[n])
    again = DistributedOptimizer(resumed.named_parameters(), resumed.spec(), "muon", overlap_param_gather=False)
    again.load_state_dict(saved)
    assert all(isinstance(g["lr"], torch.Tensor) and g["lr"].item() == pytest.approx(0.01) for g in again.param_groups)
    _step(resumed, [again], tokens)
    _step(theirs, torch_opts, tokens)
    assert _same(resumed, theirs)


class _SparseEmbedding(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.out = torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(tokens)).sum()


def test_a_sparse_gradient_is_one_error_naming_the_module_option(one_rank):
    """`nn.Embedding(sparse=True)` hands backward a sparse gradient, which torch.optim.AdamW refuses
    at its step; the optimizer's buffers are dense: one CanzonaError naming the parameter and
    `sparse=False` (before: torch's 'copy_() between dense and sparse Tensors is not implemented'
    from inside the optimizer's gradient hook)."""
    from canzona.runtime.modules import named_parameters
    from canzona.spec import ModelSpec

    model = _SparseEmbedding()
    opt = DistributedOptimizer(list(named_parameters(model)), ModelSpec.from_module(model), "adamw",
                               overlap_param_gather=False)
    with pytest.raises(CanzonaError, match=r"'embed\.weight' got a sparse gradient.*sparse=False"):
        model(torch.tensor([1, 2, 3])).backward()
    del opt  # alive through the backward: its hooks act only while it is


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_the_state_dict_of_a_fresh_optimizer_loaded_later_resets_the_state_as_torch(one_rank, optimizer):
    """`opt.load_state_dict(initial)`, `initial` taken before any step (resetting the optimizer after
    a loss spike, between tasks): the state starts again from zero, as torch's optimizers do with
    their empty state. Its entries never stepped, so whatever weights the model now holds are not
    another save's (before: one CheckpointError at the next step, 'the model's weights differ from
    those the optimizer checkpoint was saved with')."""
    (mine, opt), (theirs, torch_opts) = _pair(optimizer)
    initial, torch_initial = opt.state_dict(), [o.state_dict() for o in torch_opts]
    tokens = fixed_batch(256, 2, 16, seed=3)
    for _ in range(2):
        _step(mine, [opt], tokens)
        _step(theirs, torch_opts, tokens)
    opt.load_state_dict(initial)
    for o, state in zip(torch_opts, torch_initial):
        o.load_state_dict(state)
    for _ in range(2):
        _step(mine, [opt], tokens)
        _step(theirs, torch_opts, tokens)
    assert _same(mine, theirs)


def test_a_torch_optimizers_state_dict_is_one_error_naming_the_way_to_migrate(one_rank):
    """A run moving to canzona from torch.optim.AdamW loads its old checkpoint's optimizer state:
    one PlanError that says what it is and what to do, nothing loaded (before: 'format mismatch:
    no canzona header in param_groups', and no way out)."""
    from canzona.errors import PlanError

    (mine, opt), (theirs, torch_opts) = _pair("adamw")
    tokens = fixed_batch(256, 2, 16, seed=3)
    _step(theirs, torch_opts, tokens)
    with pytest.raises(PlanError, match=r"torch\.optim optimizer's state dict .* model\.load_state_dict\(\) "
                                        r"and go on with this optimizer's fresh state"):
        opt.load_state_dict(torch_opts[0].state_dict())
    fresh = TinyQwen3("tiny", seed=0)
    _step(mine, [opt], tokens)  # nothing loaded: the first step is a fresh optimizer's
    _step(fresh, [torch.optim.AdamW(fresh.parameters())], tokens)
    assert _same(mine, fresh)


def test_a_loaded_tensor_learning_rate_is_the_optimizers_own_not_the_state_dicts(one_rank):
    """A scheduler fills a tensor `lr` in place; after `load_state_dict(sd)` that tensor is the
    optimizer's own, as torch's load copies the groups: `sd` stays as it was (loaded again, or
    into a second optimizer, it holds the saved rate). Before: the group held `sd`'s tensor itself."""
    (model, opt), _ = _pair()
    for g in opt.param_groups:
        g["lr"] = torch.tensor(0.01)
    _step(model, [opt], fixed_batch(256, 2, 16, seed=3))
    saved = opt.state_dict()
    opt.load_state_dict(saved)
    for g in opt.param_groups:
        g["lr"].fill_(0.5)  # what LRScheduler.step() does to a tensor lr
    assert all(g["lr"].item() == pytest.approx(0.01) for g in saved["param_groups"])
    # one tensor the groups share (a user group's rate, split by kind; torch's defaults share one
    # too) stays one after the load, as torch's one deepcopy of the groups keeps it (review: each
    # value copied alone split it, and a scheduler's fill then reached one group only)
    shared = torch.tensor(0.02)
    for g in opt.param_groups:
        g["lr"] = shared
    opt.load_state_dict(opt.state_dict())
    loaded = {id(g["lr"]) for g in opt.param_groups}
    assert len(loaded) == 1 and id(shared) not in loaded


def test_a_tensor_rate_the_groups_share_stays_shared_through_the_sharded_form(one_rank, tmp_path):
    """The sharded form's metadata numbers each tensor rate (`ref`), so that a rate the groups
    shared loads as one tensor, as the full form's one deepcopy keeps it (review: each group's came
    back its own tensor)."""
    import torch.distributed.checkpoint as dcp

    (model, opt), _ = _pair()
    shared = torch.tensor(0.02)
    for g in opt.param_groups:
        g["lr"] = shared
    _step(model, [opt], fixed_batch(256, 2, 16, seed=3))
    dcp.save(opt.sharded_state_dict(), checkpoint_id=tmp_path)
    for g in opt.param_groups:
        g["lr"] = 0.5
    opt.load_sharded_state_dict(tmp_path)
    loaded = {id(g["lr"]) for g in opt.param_groups}
    assert len(loaded) == 1 and id(shared) not in loaded and opt.param_groups[0]["lr"].item() == pytest.approx(0.02)


def test_a_tensor_rate_loads_from_the_sharded_form_on_the_device_of_the_groups_own(one_rank, tmp_path):
    """The sharded form's metadata held a tensor rate's number, dtype and shape, and it loaded on
    the CPU whatever device the run holds its rates on (a CUDA rate came back a CPU one). Now it
    loads on the device of the tensor the group holds (the "meta" device stands in for a GPU here),
    in the saved dtype; a group holding a float takes it where it was saved (the CPU here)."""
    import torch.distributed.checkpoint as dcp

    (model, opt), _ = _pair()
    for g in opt.param_groups:
        g["lr"] = torch.tensor(0.02, dtype=torch.float64)
    _step(model, [opt], fixed_batch(256, 2, 16, seed=3))
    dcp.save(opt.sharded_state_dict(), checkpoint_id=tmp_path)
    held = torch.tensor(0.5, device="meta")
    opt.param_groups[0]["lr"] = held
    for g in opt.param_groups[1:]:
        g["lr"] = 0.5
    opt.load_sharded_state_dict(tmp_path)
    first, *others = [g["lr"] for g in opt.param_groups]
    assert first is not held and first.device.type == "meta" and first.dtype == torch.float64
    assert others and all(lr.device.type == "cpu" and lr.item() == 0.02 for lr in others)


def test_a_tensor_rate_saved_from_a_device_of_a_type_this_rank_runs_loads_there() -> None:
    """The sharded form records a tensor rate's device type (the metadata is alike on every rank:
    not its index), beside the tensor's own object: a group holding no tensor takes the rate on this
    rank's device of that type ("meta" standing in for CUDA), else on the CPU, as a save that
    recorded none (before there was one) loads. The tensor's object keeps the exact keys canzona
    before 2026-12-02 reads (review: a "device" key in it made that loader take the rate for a dict)."""
    import functools
    import json

    from canzona.runtime.checkpoint import (
        TENSOR_DEVICES_KEY,
        _SharedTensors,
        json_load,
        saved_tensor_device,
    )

    encode = _SharedTensors()
    saved = json.loads(json.dumps({"lr": torch.tensor(0.02, dtype=torch.float64)}, default=encode))
    assert set(saved["lr"]) == {"canzona_tensor", "dtype", "shape", "ref"} and encode.devices == {"0": "cpu"}
    saved[TENSOR_DEVICES_KEY] = {"0": "meta"}  # as a save from a GPU records "cuda"
    text = json.dumps(saved)
    here, cpu = torch.device("meta"), torch.device("cpu")
    for own, want in ((here, here), (cpu, cpu)):
        loaded = json_load(text, functools.partial(saved_tensor_device, own=own))["lr"]
        assert loaded.device == want and loaded.dtype == torch.float64
    older = json.dumps({"lr": {"canzona_tensor": 0.02, "dtype": "float64", "shape": []}})
    assert json_load(older, functools.partial(saved_tensor_device, own=here))["lr"].device == cpu


def test_a_stepped_flag_torch_left_empty_reads_as_absent_for_the_state_and_the_weights_check(one_rank):
    """torch's unflattening writes `{}` for a field it did not find: the state's reading and the
    weights check's read it alike, as absent (stepped), so the state that loads is checked against
    the weights beside it (review: the weights check read `{}` as never stepped and skipped it)."""
    from canzona.runtime.checkpoint import STEPPED_KEY, entry_stepped

    assert entry_stepped({STEPPED_KEY: {}}) and entry_stepped({}) and not entry_stepped({STEPPED_KEY: False})
    (model, opt), _ = _pair()
    _step(model, [opt], fixed_batch(256, 2, 16, seed=3))
    saved = opt.state_dict()
    for entry in saved["state"].values():
        entry[STEPPED_KEY] = {}
    opt.load_state_dict(saved)
    assert opt.loaded_witness  # the weights beside the loaded state are checked at the next step


@pytest.mark.parametrize("kind", ["tensor", "numpy"])
def test_a_state_holding_learning_rates_of_a_schedules_type_resumes_bit_for_bit(one_rank, tmp_path, kind):
    """A learning rate kept as a one-element tensor or a NumPy scalar (which the step takes, as
    torch's optimizers take them) travels in state_dict() as it is, in the sharded form as its
    number (a tensor's with its dtype and shape, loaded a tensor again), and the optimizer loads
    either back: the resumed step is the uninterrupted one, bit for bit.
    Before: load_state_dict refused its own checkpoint ('checkpoint's param group 0 is not valid
    here: muon lr must be a finite number, got tensor(0.0005)'), and sharded_state_dict() refused
    a NumPy rate (a TypeError, 'cannot store float32 in the checkpoint's metadata')."""
    import numpy as np
    import torch.distributed.checkpoint as dcp

    as_kind = torch.tensor if kind == "tensor" else np.float32
    tokens = fixed_batch(256, 2, 16, seed=3)
    model = TinyQwen3("tiny", seed=0)
    opt = DistributedOptimizer(model.named_parameters(), model.spec(), "muon", overlap_param_gather=False)
    for group in opt.param_groups:
        group["lr"] = as_kind(group["lr"] / 2)
    _step(model, [opt], tokens)
    weights, saved = {k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict()
    dcp.save(opt.sharded_state_dict(), checkpoint_id=tmp_path / "sharded")
    _step(model, [opt], tokens)
    for form in ("full", "sharded"):
        again = TinyQwen3("tiny", seed=1)
        again.load_state_dict(weights)
        resumed = DistributedOptimizer(again.named_parameters(), again.spec(), "muon", overlap_param_gather=False)
        if form == "full":
            resumed.load_state_dict(saved)
        else:
            resumed.load_sharded_state_dict(tmp_path / "sharded")
        _step(again, [resumed], tokens)
        # the sharded form keeps a tensor rate's number, dtype and shape (JSON), and loads it a tensor
        # (review: loaded a float, the kernels applied it in double, within rounding only)
        assert _same(model, again), form
        if kind == "tensor" or form == "full":  # a NumPy rate is kept as its number by the sharded form
            assert [type(g["lr"]) for g in resumed.param_groups] == [type(g["lr"]) for g in opt.param_groups], form
        del resumed  # one optimizer at a time holds the weights' buffers


class _OddShapes(torch.nn.Module):
    """Matrices whose products round by their operands' layout on CPU (TinyQwen3's 64 / 128-sized
    ones happen not to)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = torch.nn.Linear(8, 8), torch.nn.Linear(8, 300), torch.nn.Linear(300, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).square().mean()


@pytest.mark.parametrize("form", ["full", "sharded"])
def test_soaps_eigenbases_resume_bit_for_bit_in_the_layout_its_kernel_keeps(one_rank, tmp_path, form):
    """state_dict() saves SOAP's eigenbases contiguous (rank 0's broadcast needs it); eigh and QR
    leave them column-major, and the kernel's products round by layout: a load puts them back
    column-major (`MatrixOptimizer.column_major_state`), so a resumed run is the uninterrupted one
    bit for bit. Found by the review: loaded row-major, weights differed by up to 3e-8."""
    import torch.distributed.checkpoint as dcp

    from canzona.runtime.modules import named_parameters
    from canzona.spec import ModelSpec

    def build(model):
        return DistributedOptimizer(list(named_parameters(model)), ModelSpec.from_module(model), "soap",
                                    {"precondition_frequency": 2}, overlap_param_gather=False)

    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(k)) for k in range(7)]
    model = _OddShapes()
    opt = build(model)

    def step(m, o, x):
        o.zero_grad()
        m(x).backward()
        o.step()

    for x in xs[:4]:
        step(model, opt, x)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    saved = opt.state_dict() if form == "full" else None
    if form == "sharded":
        dcp.save(opt.sharded_state_dict(), checkpoint_id=tmp_path)
    for x in xs[4:]:
        step(model, opt, x)
    del opt
    again = _OddShapes()
    again.load_state_dict(weights)
    resumed = build(again)
    resumed.load_state_dict(saved) if form == "full" else resumed.load_sharded_state_dict(tmp_path)
    for x in xs[4:]:
        step(again, resumed, x)
    assert _same(again, model)


def test_a_field_no_optimizer_keeps_is_dropped_by_the_zero1_load(one_rank):
    """The ZeRO-1 layout's side of the FSDP2 test (test_fsdp_checkpoint): a state_dict() entry
    carrying a field the optimizer does not keep (a hand edit, a converter's extra) loads as the
    checkpoint without it, and the next save does not write it again (before: kept in the
    matrices' state and saved again). Asked for by the review."""
    (mine, opt), _ = _pair()
    tokens = fixed_batch(256, 2, 16, seed=3)
    _step(mine, [opt], tokens)
    clean = opt.state_dict()
    marked = opt.state_dict()
    for entry in marked["state"].values():
        entry["note"] = torch.zeros(1)
    opt.load_state_dict(marked)
    again = opt.state_dict()
    assert not any("note" in e for e in again["state"].values())
    assert all(torch.equal(a[k], b[k]) for a, b in zip(clean["state"].values(), again["state"].values())
               for k in a if isinstance(a[k], torch.Tensor))


def test_a_learning_rate_of_shape_1_steps_as_its_0d_form(one_rank):
    """`g["lr"] = torch.tensor([lr])` (one element, shape [1]), which torch's AdamW and SGD step
    with: the same step as a 0-d tensor rate (before: a TypeError from `add_(alpha=)` inside the
    step, one weight already decayed). Found by the review."""
    (mine, opt), _ = _pair()
    (ref, ref_opt), _ = _pair()
    for o, make in ((opt, lambda v: torch.tensor([v])), (ref_opt, torch.tensor)):
        for g in o.param_groups:
            g["lr"] = make(0.01)
    tokens = fixed_batch(256, 2, 16, seed=3)
    for _ in range(2):
        _step(mine, [opt], tokens)
        _step(ref, [ref_opt], tokens)
    assert _same(mine, ref)


def test_a_backward_with_create_graph_steps_as_torch(one_rank):
    """`loss.backward(create_graph=True)` (a second-order habit: the gradient carries a graph) steps
    by the gradient's values, as torch's optimizers do (before: torch's RuntimeError on 'a leaf
    Variable that requires grad' from inside the optimizer's gradient hook). A second such backward
    accumulating onto it (under no_sync()) too, bit for bit torch's out-of-place sum (before
    (review): 'double backward is not supported')."""
    (mine, opt), (theirs, torch_opts) = _pair()
    for k in range(2):
        tokens = fixed_batch(256, 2, 16, seed=3 + k)
        for model, opts in ((mine, [opt]), (theirs, torch_opts)):
            for o in opts:
                o.zero_grad()
            model.loss(tokens).backward(create_graph=True)
            for o in opts:
                o.step()
    assert _same(mine, theirs)
    for model, opts in ((mine, [opt]), (theirs, torch_opts)):
        for o in opts:
            o.zero_grad()
        with opt.no_sync() if model is mine else contextlib.nullcontext():
            model.loss(tokens).backward(create_graph=True)
        model.loss(fixed_batch(256, 2, 16, seed=9)).backward(create_graph=True)
        for o in opts:
            o.step()
    assert _same(mine, theirs)


def test_a_backward_with_create_graph_after_zeroed_gradients_steps_as_torch(one_rank):
    """After `zero_grad(set_to_none=False)` autograd accumulates a create_graph backward out of
    place onto the zero `.grad` (`.grad + g`): taken into the buffers as onto zeros, bit for bit
    torch's, `.grad` the optimizer's guard again, with no graph. Before (review): 'backward cannot
    accumulate ... with create_graph=True: double backward is not supported'."""
    (mine, opt), (theirs, torch_opts) = _pair()
    for k in range(2):
        tokens = fixed_batch(256, 2, 16, seed=3 + k)
        for model, opts in ((mine, [opt]), (theirs, torch_opts)):
            for o in opts:
                o.zero_grad(set_to_none=False)
            model.loss(tokens).backward(create_graph=True)
            for o in opts:
                o.step()
    assert _same(mine, theirs)
    assert all(p.grad.grad_fn is None and not p.grad.requires_grad for p in mine.parameters())


def test_a_gradient_penalty_on_dot_grad_after_create_graph_is_refused_naming_autograd_grad(one_rank):
    """`gp = sum((p.grad ** 2).sum() ...); gp.backward()` after `backward(create_graph=True)` (a
    gradient penalty through `.grad`): the optimizer steps by the gradient's values and `.grad`
    keeps no graph, so one CanzonaError naming create_graph and torch.autograd.grad. Before
    (review): the generic 'nothing may read or change .grad between backward and step()'."""
    (model, opt), _ = _pair()
    opt.zero_grad()
    model.loss(fixed_batch(256, 2, 16, seed=3)).backward(create_graph=True)
    with pytest.raises(CanzonaError, match=r"came from backward\(create_graph=True\).*keeps no graph.*"
                                           r"torch\.autograd\.grad\(loss, params, create_graph=True\)"):
        sum((p.grad ** 2).sum() for p in model.parameters())


def test_the_step_reads_requires_grad_of_the_parameters_without_a_gradient_only(one_rank, monkeypatch):
    """Each step's param_groups digest (which the ranks compare) says which parameters are frozen.
    Before (review): it read every parameter's requires_grad in Python (about 0.1 us a tensor: 1.4 ms
    a step at 10,000 parameters, up to twice a step); now those of the parameters no gradient reached
    on this rank alone (one that got one was trainable at its backward), from the got-a-gradient flags."""
    import canzona.runtime.optimizer as optimizer

    (model, opt), _ = _pair()
    real, seen = optimizer.hyper_parameters_digest, []

    def digest(groups, params, ungraded=None):
        seen.append(None if ungraded is None else sorted(ungraded))
        return real(groups, params, ungraded)

    monkeypatch.setattr(optimizer, "hyper_parameters_digest", digest)
    tokens = fixed_batch(256, 2, 16, seed=3)
    _step(model, [opt], tokens)
    frozen = "model.norm.weight"
    dict(model.named_parameters())[frozen].requires_grad_(False)
    _step(model, [opt], tokens)
    assert seen == [[], [frozen]]
