"""A sharded load (`load_sharded_state_dict`, both layouts) of a state whose floating fields were
saved in another dtype than the live state keeps them in (a run saved with a bf16 state resumed
with an fp32 one, or the reverse; a user's own conversion of the shards): each field is cast to
the dtype the live configuration gives it, as the full form (`checkpoint.checked_entries`) and
torch's `Optimizer.load_state_dict` cast, and the resume steps bit for bit as one from a save in
the live dtype holding those values. Before: it loaded, and the next step failed mid-step (a dtype
mismatch in the kernels). A value the cast overflows (fp32 above 65504 into an fp16 state) is one
error naming the field and the dtype's largest value, nothing loaded, in `exp_avg_sq` too (before,
there it became +Inf and froze the element); a +Inf already in the saved `exp_avg_sq` loads. In one process (a one-rank
gloo group); the spread of a refusal to every rank is `agree_on_save`'s (test_runtime_robustness)."""

from __future__ import annotations

import math

import pytest
import torch

from canzona.errors import CanzonaError, CheckpointError
from tests.runtime.outcomes import same
from tests.runtime.test_nonfinite_state import LAYOUTS, _weights

pytestmark = pytest.mark.distributed  # a one-rank gloo group in this process


def _converted(sharded: dict, dtype: torch.dtype) -> dict:
    """The optimizer's floating state shards (not the fp32 masters) in `dtype`."""
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() and "/master" not in k else v
            for k, v in sharded.items()}


def _round_tripped(sharded: dict, dtype: torch.dtype) -> dict:
    """`_converted` to `dtype` and back, each shard to the dtype it has live: the same values as
    a save in another dtype holds, saved in the live dtypes."""
    return {k: v.to(dtype).to(v.dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() and "/master" not in k
            else v for k, v in sharded.items()}


def _resume(model, opt, step, path) -> tuple[dict, dict]:
    """Load the sharded save at `path` into `opt` (the model's weights as saved), step once, and
    return (the weights, the state) after it."""
    opt.load_sharded_state_dict(str(path))
    step()
    model.state_dict()  # the step's parameter all-gathers waited for
    return _weights(model), opt.state_dict()


def _restore(model, weights: dict) -> None:
    """The model's weights set back to `weights` (`_weights`' copy), in place."""
    from canzona.runtime.shards import local_tensor

    model.state_dict()  # the last step's parameter all-gathers waited for
    with torch.no_grad():
        for name, p in model.named_parameters():
            local_tensor(p).copy_(weights[name])


def _stacked():
    """ZeRO-1 over a model of stacked experts (`'<param>[k]'` entries), Muon, one step taken."""
    from canzona.harness.training import TrainSpec, build_model, global_batches
    from tests.runtime.test_runtime_habits import _optimizer, _train

    spec = TrainSpec(preset="tiny-moe", optimizer="muon", steps=2, global_batch=4, seq_len=8)
    model = build_model(spec)
    opt = _optimizer(model)
    assert model.spec().stacks
    batches = list(global_batches(spec, model.spec().param("model.embed_tokens.weight").shape[0]))
    _train(model, opt, batches[:1])
    return model, opt, lambda: _train(model, opt, batches[1:2])


MAKERS = {**LAYOUTS, "zero1-stacked": lambda bf16, **kw: _stacked(),
          # SOAP keeps its moments and statistics in fp32 under a bf16 state (`work_dtype`)
          "zero1-soap": lambda bf16, **kw: LAYOUTS["zero1"](bf16, optimizer="soap", **kw)}


@pytest.mark.parametrize("layout, saved, live", [
    ("zero1", torch.bfloat16, "fp32"), ("fsdp2", torch.bfloat16, "fp32"), ("zero1-stacked", torch.bfloat16, "fp32"),
    ("zero1", torch.float32, "bf16"), ("fsdp2", torch.float32, "bf16"), ("zero1-soap", torch.bfloat16, "bf16")])
def test_a_sharded_state_saved_in_another_dtype_resumes_as_one_saved_in_the_live_dtype(one_rank, tmp_path, layout,
                                                                                       saved, live):
    import torch.distributed.checkpoint as dcp

    bf16 = live == "bf16"
    model, opt, step = MAKERS[layout](bf16, **({"master_weights": False} if bf16 else {}))
    sharded = opt.sharded_state_dict()
    # the stacks' matrices are entries of their own (`'<param>[k]'`), their state among them
    assert layout != "zero1-stacked" or any("]/momentum_buffer" in k for k in sharded)
    assert layout != "zero1-soap" or {v.dtype for v in sharded.values() if isinstance(v, torch.Tensor)} >= {
        torch.bfloat16, torch.float32}
    # the reference: the same values in the live dtypes (a bf16 save upcast; the live bf16 save)
    reference = _round_tripped(sharded, saved)
    dcp.save(_converted(sharded, saved), checkpoint_id=str(tmp_path / "other"))
    dcp.save(reference, checkpoint_id=str(tmp_path / "live"))
    weights = _weights(model)
    want = _resume(model, opt, step, tmp_path / "live")
    _restore(model, weights)
    got = _resume(model, opt, step, tmp_path / "other")
    assert same(got[0], want[0]) and same(got[1], want[1])


@pytest.mark.parametrize("lr", ["nan", "tensor"])
def test_the_cast_reads_no_live_group_values_the_load_replaces(one_rank, tmp_path, lr):
    """The live groups hold a rate the checkpoint undoes (NaN; a tensor rate, on the meta device
    where the templates are taken): the dtype of each field comes from the base configuration, so
    the load casts, restores the saved rates, and steps as from a save in the live dtype."""
    import torch.distributed.checkpoint as dcp

    model, opt, step = LAYOUTS["zero1"](False)
    sharded = opt.sharded_state_dict()
    dcp.save(_converted(sharded, torch.bfloat16), checkpoint_id=str(tmp_path / "other"))
    dcp.save(_round_tripped(sharded, torch.bfloat16), checkpoint_id=str(tmp_path / "live"))
    weights = _weights(model)
    want = _resume(model, opt, step, tmp_path / "live")
    _restore(model, weights)
    for group in opt.param_groups:
        group["lr"] = math.nan if lr == "nan" else torch.tensor(math.nan)
    got = _resume(model, opt, step, tmp_path / "other")
    assert same(got[0], want[0]) and same(got[1], want[1])


def _edited(sharded: dict, edit) -> dict:
    """`sharded` with its metadata entry's JSON edited by `edit` (None: as it is)."""
    import json

    if edit is not None:
        meta = next(k for k in sharded if "/meta" in k)
        sharded[meta] = json.dumps(edit(json.loads(sharded[meta])))
    return sharded


def _fp16_saved_as_fp32(tmp_path, field: str, value: float, edit=None):
    """canzona's pure-fp16 AdamW (its state fp16) and torch's alike, two steps each; the sharded
    save converted to fp32, one element of the first `field` set to `value`, the metadata edited
    by `edit`, written to `tmp_path`."""
    import torch.distributed.checkpoint as dcp

    from tests.runtime.test_nonfinite_state import _fp16_pair

    (model, make, step), (mine, opt), (theirs, ref) = _fp16_pair()
    sharded = _converted(opt.sharded_state_dict(), torch.float32)
    key = next(k for k in sorted(sharded) if k.rsplit("/", 1)[1].split("@")[0] == field)
    sharded[key].view(-1)[0] = value
    dcp.save(_edited(sharded, edit), checkpoint_id=str(tmp_path))
    return mine, opt, key


@pytest.mark.parametrize("field", ["exp_avg", "exp_avg_sq"])
@pytest.mark.parametrize("form", ["sharded", "load_state_dict"])
def test_a_value_the_cast_overflows_is_refused_naming_the_field_and_the_dtypes_largest(one_rank, tmp_path, form,
                                                                                      field):
    """fp32 100000 into an fp16 `exp_avg` or `exp_avg_sq` (a save of an fp32 state resumed with
    `master_weights=False`): one CheckpointError naming the parameter, the field, the value and
    float16's largest (65504), nothing loaded. Before: in `exp_avg` cast to +Inf, then refused as
    'damaged: holds NaN or Inf', naming nothing of the cause; in `exp_avg_sq` loaded as +Inf, which
    froze the element (its update exactly 0) for the rest of the run, silently."""
    model, opt, key = _fp16_saved_as_fp32(tmp_path, field, 1e5)
    before, weights = opt.state_dict(), _weights(model)
    name = key.split("/adamw/", 1)[1].rsplit("/", 1)[0]
    with pytest.raises(CheckpointError) as refused:
        if form == "sharded":
            opt.load_sharded_state_dict(str(tmp_path))
        else:  # the full form of the same values
            full = {k: v.to(torch.float32) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                    for k, v in before["state"][0].items()}
            full[field].view(-1)[0] = 1e5
            name = before["param_names"][0][0]
            opt.load_state_dict({**before, "state": {**before["state"], 0: full}})
    message = str(refused.value)
    assert f"optimizer state of {name!r} does not fit" in message, message
    assert f"its {field!r} holds 100000" in message and "float16's largest finite value 65504" in message, message
    assert "an fp32 or bf16 model" in message, message  # bf16 holds it
    assert "\n" not in message and same(opt.state_dict(), before) and same(_weights(model), weights)


@pytest.mark.parametrize("form", ["sharded", "load_state_dict"])
def test_a_plus_inf_already_saved_in_a_second_moment_loads_through_the_cast(one_rank, tmp_path, form):
    """A pure-fp16 state whose `exp_avg_sq` overflowed (+Inf, torch's AdamW keeps it), saved
    converted to fp32: the +Inf was in the save, not made by the cast, so it loads (as
    `nonfinite_state_error` allows it), every value as saved."""
    import torch.distributed.checkpoint as dcp

    from tests.runtime.test_nonfinite_state import _fp16_pair

    (model, make, step), (mine, opt), _ = _fp16_pair()
    saved = opt.state_dict()
    assert any(bool(torch.isinf(e["exp_avg_sq"]).any()) for e in saved["state"].values())
    resumed = model()
    resumed.load_state_dict(mine.state_dict())  # the weights as saved
    again = make(resumed)
    if form == "sharded":
        dcp.save(_converted(opt.sharded_state_dict(), torch.float32), checkpoint_id=str(tmp_path))
        again.load_sharded_state_dict(str(tmp_path))
    else:
        again.load_state_dict({**saved, "state": {k: {f: v.to(torch.float32) if f in ("exp_avg", "exp_avg_sq") else v
                                                      for f, v in e.items()} for k, e in saved["state"].items()}})
    got = again.state_dict()["state"]
    for key, entry in saved["state"].items():  # +Inf where it was saved, every other value as saved
        for field, value in entry.items():
            assert (torch.equal(got[key][field], value) and got[key][field].dtype == value.dtype
                    if isinstance(value, torch.Tensor) else got[key][field] == value), (key, field)


def test_the_overflow_message_of_a_bf16_state_advises_fp32_alone():
    """A bf16 target holds no more than bf16: the advice names fp32 only."""
    from canzona.runtime.checkpoint import cast_field

    with pytest.raises(CheckpointError) as refused:
        cast_field("w", "exp_avg", torch.tensor([1.0, 3.4e38]), torch.bfloat16)
    message = str(refused.value)
    assert "its 'exp_avg' holds 3.4e+38" in message and "bfloat16's largest finite value" in message, message
    assert "bf16 model" not in message and "fp32" in message, message


def test_a_finite_value_that_rounds_to_the_largest_is_no_overflow():
    """fp32 65519 rounds to fp16's 65504 (not Inf): cast, not refused; -1e5 is refused too."""
    from canzona.runtime.checkpoint import cast_field

    got = cast_field("w", "exp_avg_sq", torch.tensor([65519.0, math.inf, 0.0]), torch.float16)
    assert got.tolist() == [65504.0, math.inf, 0.0]
    with pytest.raises(CheckpointError, match="holds -100000"):
        cast_field("w", "exp_avg", torch.tensor([0.0, -1e5]), torch.float16)


def _fsdp2_saved_as_fp32(tmp_path, value: float, edit=None):
    """FSDP2 with a bf16 state (`master_weights=False`), its sharded save converted to fp32, one
    element of the first floating field set to `value`, the metadata entry's JSON edited by `edit`."""
    import torch.distributed.checkpoint as dcp

    model, opt, step = LAYOUTS["fsdp2"](True, master_weights=False)
    sharded = _converted(opt.sharded_state_dict(), torch.float32)
    key = next(k for k in sorted(sharded) if isinstance(sharded[k], torch.Tensor)
               and sharded[k].is_floating_point() and "/master" not in k and sharded[k].numel() > 1)
    sharded[key].view(-1)[1] = value
    dcp.save(_edited(sharded, edit), checkpoint_id=str(tmp_path))
    return model, opt, key


def test_the_fsdp2_load_refuses_a_value_the_cast_overflows(one_rank, tmp_path):
    """FSDP2, a bf16 state (`master_weights=False`) from a save in fp32 holding 3.4e38 (beyond
    bf16's largest) in one field: one CheckpointError naming it, nothing loaded."""
    model, opt, key = _fsdp2_saved_as_fp32(tmp_path, 3.4e38)
    field = key.rsplit("/", 1)[1].split("@")[0]
    before, weights = opt.state_dict(), _weights(model)
    with pytest.raises(CheckpointError) as refused:
        opt.load_sharded_state_dict(str(tmp_path))
    message = str(refused.value)
    assert f"its {field!r} holds 3.4e+38" in message and "bfloat16's largest finite value" in message, message
    assert "bf16 model" not in message, message
    assert same(opt.state_dict(), before) and same(_weights(model), weights)


def _other_model(meta: dict) -> dict:
    """The metadata of a save of another model: one shape and the fingerprint differ."""
    shapes = meta["model"]["shapes"]
    name = sorted(shapes)[0]
    shapes[name] = [*shapes[name][:-1], shapes[name][-1] + 1]
    meta["model"]["fingerprint"] = "0123456789abcdef"
    return meta


@pytest.mark.parametrize("layout", ["zero1", "fsdp2"])
def test_a_save_of_another_model_is_refused_as_such_before_the_cast(one_rank, tmp_path, layout):
    """A save of another model whose state the cast would overflow: refused naming the other
    model (as the full form's `read_state` checks first), not the overflow, nothing loaded.
    Before: the cast ran first, and the error named a value beyond the dtype's largest."""
    if layout == "zero1":
        model, opt, key = _fp16_saved_as_fp32(tmp_path, "exp_avg", 1e5, _other_model)
    else:
        model, opt, key = _fsdp2_saved_as_fp32(tmp_path, 3.4e38, _other_model)
    before, weights = opt.state_dict(), _weights(model)
    with pytest.raises(CanzonaError) as refused:
        opt.load_sharded_state_dict(str(tmp_path))
    message = str(refused.value)
    assert "checkpoint is of model" in message and "does not fit" not in message, message
    assert same(opt.state_dict(), before) and same(_weights(model), weights)


@pytest.mark.parametrize("bf16_piece", [0, 1], ids=["bf16-then-fp32", "fp32-then-bf16"])
def test_pieces_saved_in_mixed_dtypes_are_each_cast_once(one_rank, tmp_path, bf16_piece):
    """One field's slices saved in two dtypes (one DP rank's converted to bf16, the other's fp32),
    resumed with an fp32 state: each slice loads as saved, the fp32 one exactly. Before: the
    field was assembled in the dtype of the piece read first, so a bf16 piece first rounded the
    fp32 one to bf16 (a double rounding that depended on the read order)."""
    import torch.distributed.checkpoint as dcp

    model, opt, step = LAYOUTS["zero1"](False)
    sharded = opt.sharded_state_dict()
    key = next(k for k in sorted(sharded) if "/adamw/" in k and k.rsplit("/", 1)[1].startswith("exp_avg@")
               and sharded[k].dim() == 1 and sharded[k].numel() >= 4)
    head, offset = key.rsplit(":", 1)
    flat = sharded.pop(key)
    half = flat.numel() // 2
    mixed, reference = dict(sharded), dict(sharded)
    for i, (piece, at) in enumerate(((flat[:half], int(offset)), (flat[half:], int(offset) + half))):
        assert not torch.equal(piece.to(torch.bfloat16).float(), piece)  # bf16 rounds it
        mixed[f"{head}:{at}"] = piece.to(torch.bfloat16) if i == bf16_piece else piece.clone()
        reference[f"{head}:{at}"] = piece.to(torch.bfloat16).float() if i == bf16_piece else piece.clone()
    dcp.save(mixed, checkpoint_id=str(tmp_path / "mixed"))
    dcp.save(reference, checkpoint_id=str(tmp_path / "live"))
    opt.load_sharded_state_dict(str(tmp_path / "live"))
    want = opt.state_dict()
    opt.load_sharded_state_dict(str(tmp_path / "mixed"))
    assert same(opt.state_dict(), want)
