"""Checkpoints of the DP runtime are layout-independent (docs/design.md §8.4): `state_dict()` is keyed
by parameter name with full tensors, identical on every rank and under every step policy; a
checkpoint taken at one DP size loads at another and continues bit for bit as the same kernels in
one process continue from it; save -> load -> save is the identity.

Chain of spawned groups (each cached, each running several configurations):
  DP 4 trains SAVE_STEPS steps under several policies and saves;
  DP 2 and DP 1 load the DP 4 checkpoint and train RESUME_STEPS more (DP 2 also round-trips it);
  DP 3 loads the DP 2 checkpoint and trains RESUME_STEPS more.
Sharded (`torch.distributed.checkpoint`): DP 2 saves, DP 3 loads with `check_weights=True`, refuses
the weights of a later step beside it (an fp32 model, and a bf16 one with `master_weights=False`: the
weights witness), and loads it rewritten without the witness (an older canzona's).
The uninterrupted comparator is `emulate`: SAVE_STEPS steps at DP 4, then (`load=`) the remaining
steps at the new DP size from the same parameters and optimizer state.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import warnings
from dataclasses import replace
from typing import Any

import pytest
import torch

from canzona.harness.launch import run_ranks
from canzona.harness.training import TrainSpec, build_model, compare, emulate, many_specs_worker
from canzona.runtime.checkpoint import state_by_name

pytestmark = pytest.mark.distributed  # spawns gloo process groups

DEADLINE_S = 120.0
OPTIMIZERS = ("muon", "soap", "shampoo")
MATRIX_CONFIG = {"muon": {}, "soap": {"precondition_frequency": 2}, "shampoo": {"precondition_frequency": 2}}
SAVE_STEPS = 3  # SOAP: initialise, update, update + refresh; Shampoo: roots at steps 1 and 3
RESUME_STEPS = 2
SAVE_POLICY = ("canzona", "alpha-balanced-reorder")
# The same run at DP 4 under another layout (one per optimizer, to keep the spawn short): the
# checkpoint must be the same, bit for bit.
OTHER_POLICY = {"muon": ("layerwise", None), "soap": ("sc", None), "shampoo": ("zero1-gather", None)}
RESUME_POLICY = {2: ("canzona", "alpha-balanced"), 1: ("sc", None), 3: ("layerwise", None)}


def save_spec(optimizer: str, policy=SAVE_POLICY) -> TrainSpec:
    return TrainSpec(optimizer=optimizer, policy=policy[0], dp_policy=policy[1] or "alpha-balanced",
                     steps=SAVE_STEPS, global_batch=12, seq_len=16, matrix_config=dict(MATRIX_CONFIG[optimizer]))


def resume_spec(optimizer: str, dp: int, steps: int = RESUME_STEPS) -> TrainSpec:
    """Fresh data (another seed) for the continuation."""
    policy = RESUME_POLICY[dp]
    return replace(save_spec(optimizer, policy), steps=steps, data_seed=7)


def _run(dp: int, jobs: list[tuple[Any, TrainSpec, dict]]) -> dict:
    try:
        results = run_ranks(many_specs_worker, dp, [s for _, s, _ in jobs], [e for _, _, e in jobs],
                            deadline_s=DEADLINE_S, collective_timeout_s=60)
    except Exception as e:  # noqa: BLE001 - replayed by every test that needs it
        return {"error": e}
    return {label: [results[r][i] for r in range(dp)] for i, (label, _, _) in enumerate(jobs)}


def _get(runs: dict, label) -> list[dict]:
    if "error" in runs:
        err = runs["error"]
        pytest.fail(f"a spawned group failed: {err}\n{getattr(err, 'trace', '')}")
    return runs[label]


@functools.cache
def saved_at_4() -> dict:
    jobs = []
    for opt in OPTIMIZERS:
        jobs.append((("save", opt, SAVE_POLICY), save_spec(opt), {}))
        jobs.append((("save", opt, OTHER_POLICY[opt]), save_spec(opt, OTHER_POLICY[opt]), {}))
    return _run(4, jobs)


def checkpoint_4(optimizer: str) -> tuple[dict, dict]:
    res = _get(saved_at_4(), ("save", optimizer, SAVE_POLICY))[0]
    return res["params"], res["state"]


@functools.cache
def resumed(dp: int) -> dict:
    """DP 2 and DP 1 resume from the DP 4 checkpoint (and round-trip it); DP 3 from DP 2's."""
    jobs = []
    for opt in OPTIMIZERS:
        ckpt = checkpoint_4(opt) if dp in (1, 2) else checkpoint_2(opt)
        jobs.append((("resume", opt), resume_spec(opt, dp), {"load": ckpt}))
        if dp in (1, 2):
            jobs.append((("round trip", opt), resume_spec(opt, dp, steps=0), {"load": ckpt}))
    if dp == 2:
        jobs.append((("other state", "soap"), other_state(resume_spec("soap", dp, steps=0)),
                     {"load": checkpoint_4("soap"), "refused": True}))
    return _run(dp, jobs)


# SOAP at max_precond_dim 48 keeps one-sided factors of the 64-wide matrices, where the checkpoints'
# configuration (the default 10000) keeps both: another state, which a plan prices (check_plan_config)
OTHER_STATE = {"max_precond_dim": 48}


def other_state(spec: TrainSpec) -> TrainSpec:
    return replace(spec, matrix_config={**spec.matrix_config, **OTHER_STATE})


def checkpoint_2(optimizer: str) -> tuple[dict, dict]:
    """What DP 2 saved after resuming: the checkpoint DP 3 loads."""
    res = _get(resumed(2), ("resume", optimizer))[0]
    return res["params"], res["state"]


def nested_equal(a: Any, b: Any, where: str = "state") -> None:
    """Exact equality of nested dicts / lists of tensors and scalars (tensors: dtype, shape, bits)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b) if isinstance(b, dict) else b}"
        for k in a:
            nested_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            nested_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def model_shapes() -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in build_model(TrainSpec()).named_parameters()}


def matrix_names() -> set[str]:
    return {p.name for p in build_model(TrainSpec()).spec().matrix_params()}


# --- the state dict's form -------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_state_dict_has_torchs_layout_with_full_tensors(optimizer):
    ranks = _get(saved_at_4(), ("save", optimizer, SAVE_POLICY))
    sd = ranks[0]["state"]
    assert set(sd) == {"state", "param_groups", "param_names"}
    groups = sd["param_groups"]
    assert [g["kind"] for g in groups] == ["matrix", "adamw"]
    # torch's layout: state by index, each group lists its indices and names, in order
    assert [i for g in groups for i in g["params"]] == list(range(len(sd["state"])))
    assert all(sd["state"][i]["canzona_stepped"] for i in sd["state"])
    header, _, state = state_by_name(sd)
    assert header["format"] == "canzona.optimizer_state" and header["version"] == 4
    assert all(json.loads(g["canzona"]) == header for g in groups)
    # the names once, at the top; the header as small whatever the model (torch's flattening
    # writes each group key once per parameter)
    names = [n for group in sd["param_names"] for n in group]
    assert len(names) == len(sd["state"]) and set(names) == set(state) and "shapes" not in header["model"]
    assert header["model"]["fingerprint"]
    assert header["optimizer"] == optimizer
    shapes = model_shapes()
    matrices = matrix_names()
    assert set(state) == set(shapes)  # every parameter got gradients, so every one has state
    for name, s in state.items():
        m, *rest = shapes[name]
        if name not in matrices:  # AdamW: full moments with the parameter's shape
            assert s["step"] == SAVE_STEPS
            assert s["exp_avg"].shape == shapes[name] and s["exp_avg_sq"].shape == shapes[name]
            continue
        n = rest[0]
        full = {"muon": {"momentum_buffer": (m, n)},
                "soap": {"exp_avg": (m, n), "exp_avg_sq": (m, n), "GG_L": (m, m), "GG_R": (n, n),
                         "Q_L": (m, m), "Q_R": (n, n)},
                "shampoo": {"exp_avg": (m, n), "exp_avg_sq": (m, n), "L": (m, m), "R": (n, n),
                            "L_root": (m, m), "R_root": (n, n)}}[optimizer]
        for key, shape in full.items():
            assert tuple(s[key].shape) == shape, (name, key)
        if optimizer == "soap":
            assert s["step"] == SAVE_STEPS - 1  # the first call only initialises the eigenbases
        elif optimizer == "shampoo":
            assert s["step"] == SAVE_STEPS


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_state_dict_is_identical_on_every_rank(optimizer):
    ranks = _get(saved_at_4(), ("save", optimizer, SAVE_POLICY))
    assert len(ranks) == 4
    for r in range(1, 4):
        nested_equal(ranks[r]["state"], ranks[0]["state"], f"rank {r}")


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_state_dict_does_not_depend_on_the_layout(optimizer):
    """Same DP size, same gradients, another partition of the work: the same checkpoint."""
    want = _get(saved_at_4(), ("save", optimizer, SAVE_POLICY))[0]
    got = _get(saved_at_4(), ("save", optimizer, OTHER_POLICY[optimizer]))
    for r, res in enumerate(got):
        nested_equal(res["state"], want["state"], f"rank {r}")
        assert compare(res["params"], want["params"])["bit_identical"]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_saved_run_equals_single_process_run(optimizer):
    params, _ = checkpoint_4(optimizer)
    assert compare(params, emulate(save_spec(optimizer), 4))["bit_identical"]


# --- resuming at another DP size --------------------------------------------------------------


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("dp,source", [(2, 4), (1, 4), (3, 2)], ids=["4-to-2", "4-to-1", "2-to-3"])
def test_checkpoint_resumes_bit_identically_at_another_dp(dp, source, optimizer):
    ckpt = checkpoint_4(optimizer) if source == 4 else checkpoint_2(optimizer)
    ranks = _get(resumed(dp), ("resume", optimizer))
    want = emulate(resume_spec(optimizer, dp), dp, load=ckpt)
    for r, res in enumerate(ranks):
        cmp = compare(res["params"], want)
        assert cmp["bit_identical"], f"rank {r} resumed at dp={dp} differs: {cmp}"
        nested_equal(res["state"], ranks[0]["state"], f"rank {r}")
    # the loaded optimizer state mattered: starting the same steps from fresh state differs
    params, state = ckpt
    fresh = emulate(resume_spec(optimizer, dp), dp, load=(params, {**state, "state": {}}))
    assert not compare(ranks[0]["params"], fresh)["bit_identical"]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_resumed_checkpoint_keeps_counting_steps(optimizer):
    _, state = checkpoint_4(optimizer)
    _, resumed_state = checkpoint_2(optimizer)
    before, after = state_by_name(state)[2], state_by_name(resumed_state)[2]
    for name, s in after.items():
        if "step" in s:
            assert s["step"] == before[name]["step"] + RESUME_STEPS, name


# --- round trip ------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("dp", [2, 1])
def test_save_load_save_is_the_identity(dp, optimizer):
    """DP 4's checkpoint loaded at another DP size and saved again, without a step in between."""
    params, state = checkpoint_4(optimizer)
    for r, res in enumerate(_get(resumed(dp), ("round trip", optimizer))):
        nested_equal(res["state"], state, f"rank {r}")
        assert compare(res["params"], params)["bit_identical"]


# --- torch.distributed.checkpoint: each rank writes what it owns, any layout reads it ----------


def bf16_spec(spec: TrainSpec) -> TrainSpec:
    """A bf16 model without fp32 masters (`master_weights=False`): the weights check has no
    masters to compare, only the witness."""
    return replace(spec, dtype="bf16", master_weights=False)


@functools.cache
def sharded(path: str) -> dict:
    """DP 2 saves a sharded checkpoint per optimizer (and runs Muon's one step further), and
    Muon's of a bf16 model without masters (and its step further); DP 3 (another policy) loads each
    with `check_weights` (the weights it was saved with), round-trips it and resumes from it; it
    refuses Muon's beside the weights of the step after (an fp32 model, and the bf16 one: no
    masters, the witness), and loads Muon's rewritten as an older canzona wrote it (no witness)."""
    muon = save_spec("muon", RESUME_POLICY[2])
    saved = _run(2, [(("save", opt), save_spec(opt, RESUME_POLICY[2]), {"save_sharded": f"{path}/{opt}"})
                     for opt in OPTIMIZERS]
                 + [(("later", "muon"), replace(muon, steps=SAVE_STEPS + 1), {}),
                    (("save", "muon bf16"), bf16_spec(muon), {"save_sharded": f"{path}/muon-bf16"}),
                    (("later", "muon bf16"), bf16_spec(replace(muon, steps=SAVE_STEPS + 1)), {})])
    if "error" in saved:
        return {"saved": saved, "loaded": saved}
    without_witness(f"{path}/muon", f"{path}/muon-older")
    jobs = []
    for opt in OPTIMIZERS:
        params = _get(saved, ("save", opt))[0]["params"]
        load = {"load": (params, f"{path}/{opt}"), "check_weights": True}
        jobs.append((("resume", opt), resume_spec(opt, 3), load))
        jobs.append((("round trip", opt), resume_spec(opt, 3, steps=0), load))
    for key, spec in (("muon", resume_spec("muon", 3, steps=0)), ("muon bf16", bf16_spec(resume_spec("muon", 3, steps=0)))):
        later = _get(saved, ("later", key))[0]["params"]
        jobs.append((("mix", key), spec, {"load": (later, f"{path}/{key.replace(' ', '-')}"), "check_weights": True,
                                          "refused": True}))
        # the same save's state_dict() (torch's form), and the sharded one without `check_weights`,
        # beside those weights: refused at the first step
        state = _get(saved, ("save", key))[0]["state"]
        jobs.append((("state dict mix", key), replace(spec, steps=1), {"load": (later, state), "refused": "step"}))
        jobs.append((("unchecked mix", key), replace(spec, steps=1),
                     {"load": (later, f"{path}/{key.replace(' ', '-')}"), "refused": "step"}))
        # `check_weights=False`: beside those weights on purpose (surgery, a merge): not checked at all
        jobs.append((("unchecked on purpose", key), replace(spec, steps=1),
                     {"load": (later, f"{path}/{key.replace(' ', '-')}"), "refused": "step", "check_weights": False}))
    params = _get(saved, ("save", "muon bf16"))[0]["params"]
    jobs.append((("round trip", "muon bf16"), bf16_spec(resume_spec("muon", 3, steps=0)),
                 {"load": (params, f"{path}/muon-bf16"), "check_weights": True}))
    params = _get(saved, ("save", "muon"))[0]["params"]
    jobs.append((("older", "muon"), resume_spec("muon", 3, steps=0),
                 {"load": (params, f"{path}/muon-older"), "check_weights": True}))
    soap = {"load": (_get(saved, ("save", "soap"))[0]["params"], f"{path}/soap"), "check_weights": True,
            "refused": True}
    jobs.append((("other state", "soap"), other_state(resume_spec("soap", 3, steps=0)), soap))
    jobs.append((("other frequency", "soap"),
                 replace(resume_spec("soap", 3, steps=0), matrix_config={"precondition_frequency": 3}), soap))
    return {"saved": saved, "loaded": _run(3, jobs)}


def sharded_meta(folder: str) -> dict:
    """The canzona metadata entry of a sharded checkpoint (read in this process)."""
    import torch.distributed.checkpoint as dcp

    key = meta_key_of(folder)
    meta = {key: ""}
    with warnings.catch_warnings():  # DCP says it loads in this process alone: as meant
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(meta, checkpoint_id=folder, no_dist=True)
    return json.loads(meta[key])


def meta_key_of(folder: str) -> str:
    """The key of the one optimizer's metadata entry in a sharded checkpoint."""
    import torch.distributed.checkpoint as dcp

    from canzona.runtime.checkpoint import DCP_PREFIX

    entries = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    [key] = [k for k in entries if k == f"{DCP_PREFIX}/meta" or k.startswith(f"{DCP_PREFIX}/meta/")]
    return key


def without_witness(folder: str, older: str) -> None:
    """`folder` written again at `older` as a canzona without the weights' witness wrote it: the
    same entries, its metadata without the witness, under the one key of every optimizer then
    (`{DCP_PREFIX}/meta`, before `checkpoint.meta_key`) (in this process: one file)."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from canzona.runtime.checkpoint import DCP_PREFIX, WITNESS_KEY

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(folder, f"{tmp}/whole.pt")
        state = torch.load(f"{tmp}/whole.pt", weights_only=False)
    meta = json.loads(state.pop(meta_key_of(folder)))
    del meta[WITNESS_KEY]
    state[f"{DCP_PREFIX}/meta"] = json.dumps(meta)
    with warnings.catch_warnings():  # DCP says it saves in this process alone: as meant
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(state, checkpoint_id=older, no_dist=True)


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory) -> dict:
    return sharded(str(tmp_path_factory.mktemp("dcp")))


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_sharded_checkpoint_reshards_exactly(sharded_runs, optimizer):
    saved = _get(sharded_runs["saved"], ("save", optimizer))[0]
    for r, out in enumerate(_get(sharded_runs["loaded"], ("round trip", optimizer))):
        nested_equal(out["state"]["state"], saved["state"]["state"], f"rank {r}")
    want = emulate(resume_spec(optimizer, 3), 3, load=(saved["params"], saved["state"]))
    for r, out in enumerate(_get(sharded_runs["loaded"], ("resume", optimizer))):
        assert compare(out["params"], want)["bit_identical"], f"rank {r}"


WEIGHTS_MIX = "CheckpointError: the model's weights differ from those the optimizer checkpoint was saved with"


@pytest.mark.parametrize("model", ["muon", "muon bf16"], ids=["fp32", "bf16-no-masters"])
def test_weights_of_another_save_are_refused_without_masters(sharded_runs, model):
    """A model without masters (fp32; bf16 with `master_weights=False`) given the weights of the
    step after the save, then the save's optimizer state with `check_weights`: one
    CheckpointError on every rank (the witness), and the optimizer state as it was. The same save
    beside its own weights loads (the resumes above, and the bf16 round trip below)."""
    results = _get(sharded_runs["loaded"], ("mix", model))
    texts = {re.sub(r"^CheckpointError: rank \d+: ", "CheckpointError: ", r["refused"]) for r in results}
    assert len(texts) == 1, texts
    text = texts.pop()
    assert text.startswith(WEIGHTS_MIX) and "sampled elements" in text and "different saves" in text, text
    for r, out in enumerate(results):
        nested_equal(out["state after"], out["state before"], f"rank {r}")


@pytest.mark.parametrize("how", ["state dict mix", "unchecked mix"])
@pytest.mark.parametrize("model", ["muon", "muon bf16"], ids=["fp32", "bf16-no-masters"])
def test_a_state_dict_beside_weights_of_another_save_is_refused_at_the_first_step(sharded_runs, model, how):
    """The same mix through `load_state_dict` (torch's form, loaded at DP 3 from DP 2), or
    `load_sharded_state_dict` without `check_weights`: the load cannot check the weights (torch's
    `set_state_dict` loads the model after the optimizer), the first step does: one
    CheckpointError on every rank, no weight updated. Before, it stepped unnoticed. The state
    dicts beside their own weights step on (every resume of this module's chain)."""
    results = _get(sharded_runs["loaded"], (how, model))
    texts = {re.sub(r"^CheckpointError: rank \d+: ", "CheckpointError: ", r["refused"]) for r in results}
    assert len(texts) == 1, texts
    text = texts.pop()
    assert text.startswith(WEIGHTS_MIX) and "sampled elements" in text and "step() refused" in text, text
    # weights changed on purpose (surgery, a merge, EMA weights): the error names the way to load anyway
    assert "checkpoint.without_weights_witness(" in text, text
    for r, out in enumerate(results):
        nested_equal(out["params after"], out["params before"], f"rank {r}")


@pytest.mark.parametrize("model", ["muon", "muon bf16"], ids=["fp32", "bf16-no-masters"])
def test_a_sharded_load_with_check_weights_false_steps_beside_other_weights(sharded_runs, model):
    """`load_sharded_state_dict(check_weights=False)` is the sharded form's way past the check
    (as `without_weights_witness` is the state dict's): weights changed on purpose step on. Before,
    False was the default and meant 'at the first step': refused, with no way to load anyway."""
    assert [r["refused"] for r in _get(sharded_runs["loaded"], ("unchecked on purpose", model))] == ["stepped"] * 3


def test_a_bf16_checkpoint_without_masters_loads_beside_its_weights_at_another_dp(sharded_runs, tmp_path_factory):
    """Saved at DP 2 by a bf16 model without masters (its witness in bf16), loaded at DP 3 with
    `check_weights` beside the weights it was saved with: the same state (nothing refused)."""
    from canzona.runtime.checkpoint import WITNESS_KEY

    folder = next(p for p in tmp_path_factory.getbasetemp().rglob("muon-bf16") if p.is_dir())
    witness = sharded_meta(str(folder))[WITNESS_KEY]
    assert set(witness) == set(model_shapes()) and {w["dtype"] for w in witness.values()} == {"bfloat16"}
    saved = _get(sharded_runs["saved"], ("save", "muon bf16"))[0]
    assert not any("master" in s for s in state_by_name(saved["state"])[2].values())  # no masters to compare
    for r, out in enumerate(_get(sharded_runs["loaded"], ("round trip", "muon bf16"))):
        nested_equal(out["state"]["state"], saved["state"]["state"], f"rank {r}")


def test_a_checkpoint_without_the_witness_still_loads(sharded_runs, tmp_path_factory):
    """A sharded checkpoint of an older canzona (its metadata without the witness) loads with
    `check_weights` (nothing to compare without masters) as the same state."""
    from canzona.runtime.checkpoint import WITNESS_KEY

    folder = next(p for p in tmp_path_factory.getbasetemp().rglob("muon") if p.is_dir())
    witness = sharded_meta(str(folder))[WITNESS_KEY]
    assert set(witness) == set(model_shapes()) and all(len(w["bits"]) == len(w["index"]) > 0 for w in witness.values())
    assert WITNESS_KEY not in sharded_meta(str(folder.with_name("muon-older")))
    saved = _get(sharded_runs["saved"], ("save", "muon"))[0]
    for r, out in enumerate(_get(sharded_runs["loaded"], ("older", "muon"))):
        nested_equal(out["state"]["state"], saved["state"]["state"], f"rank {r}")


def test_each_rank_writes_only_what_it_owns(sharded_runs, tmp_path_factory):
    import torch.distributed.checkpoint as dcp

    from canzona.runtime.checkpoint import DCP_PREFIX

    saved = _get(sharded_runs["saved"], ("save", "muon"))
    folder = next(p for p in tmp_path_factory.getbasetemp().rglob("muon") if p.is_dir())
    storage = dcp.FileSystemReader(str(folder)).read_metadata().storage_data
    files: dict[str, set[str]] = {}
    for index, info in storage.items():
        if index.fqn.startswith(f"{DCP_PREFIX}/matrix/"):
            files.setdefault(info.relative_path, set()).add(index.fqn.split("/")[2])
    owned = [set(out["owned"]) for out in saved]
    assert len(files) == 2 and sorted(map(frozenset, files.values()), key=len) == sorted(map(frozenset, owned), key=len)
    assert not set.intersection(*files.values())  # no matrix state written twice


def refused_alike(results: list[dict], line: str) -> None:
    """Every rank gave `line` (one line), its state as it was."""
    assert {r["refused"] for r in results} == {line} and "\n" not in line
    for r, out in enumerate(results):
        nested_equal(out["state after"], out["state before"], f"rank {r}")


OTHER_STATE_REFUSED = ('PlanError: checkpoint was saved with soap matrix_config {"precondition_frequency": 2}, which '
                       'keeps other optimizer state than this optimizer\'s {"max_precond_dim": 48, '
                       '"precondition_frequency": 2} (model.layers.0.self_attn.q_proj.weight: 98304 bytes of state '
                       'there, 32768 here): build the optimizer with the checkpoint\'s matrix_config and a plan made '
                       'for it')


def test_a_checkpoint_of_a_configuration_keeping_other_state_is_refused(sharded_runs):
    """SOAP saved at the default max_precond_dim, loaded by an optimizer built (and planned) at 48:
    the checkpoint's configuration would replace the optimizer's, and its state is not what the
    optimizer's plan priced (memory, step time: `check_plan_config`'s guarantee). One PlanError
    naming both configurations and what to do, on every rank, the state as it was: through
    `load_state_dict` (DP 2) and `load_sharded_state_dict` (DP 3). Before: both loaded silently
    and stepped at max_precond_dim 10000."""
    for results in (_get(resumed(2), ("other state", "soap")), _get(sharded_runs["loaded"], ("other state", "soap"))):
        refused_alike(results, OTHER_STATE_REFUSED)


def test_a_checkpoint_of_a_configuration_keeping_the_same_state_loads_with_its_hyper_parameters(sharded_runs):
    """A configuration that changes only hyper-parameters (SOAP's precondition frequency, 2 saved,
    3 here) keeps the same state: the checkpoint loads, and its hyper-parameters win, as
    torch.optim's load_state_dict restores param_groups'."""
    saved = _get(sharded_runs["saved"], ("save", "soap"))[0]["state"]
    for r, out in enumerate(_get(sharded_runs["loaded"], ("other frequency", "soap"))):
        assert out["refused"] == "loaded", out["refused"]
        nested_equal(out["state after"]["state"], saved["state"], f"rank {r}")
        groups = [g for g in out["state after"]["param_groups"] if g["kind"] == "matrix"]
        assert groups and all(g["precondition_frequency"] == 2 for g in groups), f"rank {r}"


# --- what the checkpoint module reads of the optimizer -----------------------------------------


def _only_the_view_worker(rank: int, world: int) -> dict[str, Any]:
    """Save, load and shard the state of a DP x TP optimizer through an object that offers only
    `checkpoint.Checkpointable`'s members (anything else read or written raises): the same results
    as through the optimizer itself. Then `_replicas_scenario`."""
    from canzona.runtime import DistributedOptimizer, checkpoint

    protocols = [c for c in checkpoint.Checkpointable.__mro__ if c.__module__ == checkpoint.__name__]  # with Described
    allowed = {name for c in protocols for name in (*c.__dict__.get("__annotations__", {}), *vars(c))
               if not name.startswith("_")}

    class OnlyTheView:
        def __init__(self, opt):
            object.__setattr__(self, "_opt", opt)

        def __getattr__(self, name):
            if name not in allowed:
                raise AttributeError(f"the checkpoint read {name!r}, outside its view")
            return getattr(object.__getattribute__(self, "_opt"), name)

        def __setattr__(self, name, value):
            if name not in allowed:
                raise AttributeError(f"the checkpoint wrote {name!r}, outside its view")
            setattr(object.__getattribute__(self, "_opt"), name, value)

    from torch.distributed.device_mesh import init_device_mesh

    from reference.tiny_model_tp import TinyQwen3TP

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = TinyQwen3TP("tiny", mesh.get_group("tp"))
    opt = DistributedOptimizer(model.named_parameters(), model.spec(), group=mesh, matrix_config={"ns_steps": 1})
    tokens = torch.randint(0, model.cfg.vocab, (2, 2, 8), generator=torch.Generator().manual_seed(mesh.get_local_rank("dp")))
    for step in range(2):
        opt.zero_grad()
        model.loss(tokens[step]).backward()
        opt.step()
    opt.wait_params()
    view = OnlyTheView(opt)
    full = checkpoint.gather_state(view)
    nested_equal(full, opt.state_dict())
    checkpoint.load_state(view, full)
    nested_equal(checkpoint.gather_state(view), full)
    shards, mine = checkpoint.sharded_state(view), opt.sharded_state_dict()
    assert shards.keys() == mine.keys()
    nested_equal(shards, mine, "sharded state")
    del opt
    halves = [torch.distributed.new_group(list(range(h * world // 2, (h + 1) * world // 2))) for h in range(2)]
    half = rank * 2 // world
    return {"view": True, "replicas": _replicas_scenario(halves, half),
            "apart": _replicas_apart_scenario(halves, half, rank),
            "stages": _stages_scenario(halves, half, rank)}


def _replicas_scenario(halves: list[Any], half: int) -> dict[str, Any]:
    """Two replicas of one architecture side by side, each on its own DP group of half the ranks
    (a sweep, an ensemble), other weights each: each `state_dict()` carries the witness of its own
    weights, and loads beside them. Before, the witness's gather over every rank took the first
    rank's values: the second replica's state dict held the first's, and its resume was refused."""
    from canzona.runtime import DistributedOptimizer, checkpoint

    model = build_model(TrainSpec(model_seed=half))
    opt = DistributedOptimizer(model.named_parameters(), model.spec(), group=halves[half])
    full = opt.state_dict()
    witness = checkpoint.saved_witness(full, checkpoint._global_shapes(opt))
    weights = dict(model.named_parameters())
    own = all(torch.equal(checkpoint._from_bits(w["bits"], weights[n].dtype), weights[n].detach().reshape(-1)[w["index"]])
              for n, w in witness.items())
    del opt
    opt = DistributedOptimizer(model.named_parameters(), model.spec(), group=halves[half])
    opt.load_state_dict(full)
    try:
        checkpoint.check_weights_at_step(opt)  # what the first step() checks first
        outcome = "stepped"
    except Exception as e:  # noqa: BLE001 - the test reads it
        outcome = f"{type(e).__name__}: {e}"
    return {"own witness": own and len(witness) == len(weights), "resume": outcome}


APART_STEPS = 3
APART_SAVES = ((1, 2), (2,))  # the steps after which each replica saves: every step, every other step
APART_TIMEOUT_S = 20.0


def _replicas_apart_scenario(halves: list[Any], half: int, rank: int) -> dict[str, Any]:
    """The replicas of `_replicas_scenario` save at their own steps (`APART_SAVES`), each resumes
    from its last save (a fresh model holding the saved weights, a fresh optimizer,
    `load_state_dict`, the first step checking the weights) and trains to `APART_STEPS`: the same
    weights, bit for bit, as the replica trained without a break. Each save takes the sharded form
    too (the same witness), and the resume checks the weights against it first, as
    `load_sharded_state_dict(check_weights=True)` does. Before, the witness's
    collectives ran over every rank: the first replica's second save met the second's first
    step-check and failed (a TypeError), or a save waited for the other replica until the
    timeout."""
    from canzona.runtime import DistributedOptimizer, checkpoint

    data = torch.Generator().manual_seed(100 + rank)
    tokens = [torch.randint(0, 64, (2, 8), generator=data) for _ in range(APART_STEPS)]

    def optimizer(model):
        return DistributedOptimizer(model.named_parameters(), model.spec(), group=halves[half],
                                    matrix_config={"ns_steps": 1}, timeout_s=APART_TIMEOUT_S)

    def train(model, opt, steps, on_step=lambda k: None):
        for k in steps:
            opt.zero_grad()
            model.loss(tokens[k]).backward()
            opt.step()
            on_step(k + 1)
        opt.wait_params()

    try:
        model = build_model(TrainSpec(model_seed=half))
        opt = optimizer(model)
        train(model, opt, range(APART_STEPS))
        want = {n: p.detach().clone() for n, p in model.named_parameters()}
        del opt
        model = build_model(TrainSpec(model_seed=half))
        opt = optimizer(model)
        saved: list[tuple[int, dict, dict]] = []

        def save(step: int) -> None:
            if step in APART_SAVES[half]:
                opt.wait_params()
                full, meta = opt.state_dict(), json.loads(opt.sharded_state_dict()[checkpoint.meta_key(opt)])
                same = meta[checkpoint.WITNESS_KEY] == checkpoint.saved_witness(full, checkpoint._global_shapes(opt))
                saved.append((step, full, {n: p.detach().clone() for n, p in model.named_parameters()},
                              meta[checkpoint.WITNESS_KEY] if same else None))

        train(model, opt, range(max(APART_SAVES[half])), save)
        step, state, weights, witness = saved[-1]
        if witness is None:
            return {"error": "the sharded form's witness is not the state dict's"}
        del opt
        model = build_model(TrainSpec(model_seed=half))
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(weights[n])
        opt = optimizer(model)
        checkpoint.check_weights_match(opt, {}, witness)  # load_sharded_state_dict(check_weights=True)'s check
        opt.load_state_dict(state)
        train(model, opt, range(step, APART_STEPS))
        got = dict(model.named_parameters())
        return {"bit for bit": all(torch.equal(got[n].detach(), w) for n, w in want.items())}
    except Exception as e:  # noqa: BLE001 - the test reads it
        return {"error": f"{type(e).__name__}: {e}"}


STAGE_STEPS = 3  # the save after step 2, the resume runs step 3


def _stages_scenario(halves: list[Any], half: int, rank: int) -> dict[str, Any]:
    """Pipeline stages (torchtitan's PP): each half of the ranks holds one stage (half of the model's
    parameters, under the full model's names) and its own optimizer over its own DP group; every
    stage saves in one `dcp.save` over every rank, then each stage resumes from it (a fresh model
    and optimizer, `load_sharded_state_dict(check_weights=True)`) and steps: the same weights, bit
    for bit, as the stage trained without a break. Before, both stages' optimizer metadata went
    under one key, which dcp wrote once: one stage resumed the other's metadata."""
    import tempfile

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from canzona.runtime import DistributedOptimizer

    folder = [tempfile.mkdtemp(prefix="canzona-stages-") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    data = torch.Generator().manual_seed(200 + rank)
    tokens = [torch.randint(0, 64, (2, 8), generator=data) for _ in range(STAGE_STEPS)]

    def stage(model):
        names = [n for n, _ in model.named_parameters()]
        mine = set(names[:len(names) // 2] if half == 0 else names[len(names) // 2:])
        spec = model.spec()
        spec = replace(spec, params=tuple(p for p in spec.params if p.name in mine))
        params = [(n, p) for n, p in model.named_parameters() if n in mine]
        opt = DistributedOptimizer(params, spec, group=halves[half], matrix_config={"ns_steps": 1},
                                   timeout_s=APART_TIMEOUT_S)
        return {n: p for n, p in params}, opt

    def train(model, opt, steps):
        for k in steps:
            opt.zero_grad()
            model.zero_grad()
            model.loss(tokens[k]).backward()
            opt.step()
        opt.wait_params()

    try:
        model = build_model(TrainSpec())
        params, opt = stage(model)
        train(model, opt, range(STAGE_STEPS))
        want = {n: p.detach().clone() for n, p in params.items()}
        del opt
        model = build_model(TrainSpec())
        params, opt = stage(model)
        train(model, opt, range(STAGE_STEPS - 1))
        dcp.save({**params, **opt.sharded_state_dict()}, checkpoint_id=folder[0])
        del opt
        model = build_model(TrainSpec())
        params, opt = stage(model)
        dcp.load(params, checkpoint_id=folder[0])
        opt.load_sharded_state_dict(folder[0], check_weights=True)
        train(model, opt, range(STAGE_STEPS - 1, STAGE_STEPS))
        same = all(torch.equal(params[n].detach(), w) for n, w in want.items())
        # an optimizer of neither stage's parameters (the whole model) is refused with one line
        del opt
        whole = DistributedOptimizer(model.named_parameters(), model.spec(), group=halves[half],
                                     timeout_s=APART_TIMEOUT_S)
        try:
            whole.load_sharded_state_dict(folder[0])
            refused = "loaded"
        except Exception as e:  # noqa: BLE001 - the test reads it
            refused = f"{type(e).__name__}: {e}"
        return {"bit for bit": same, "whole model": refused}
    except Exception as e:  # noqa: BLE001 - the test reads it
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


@functools.cache
def four_ranks() -> list[dict[str, Any]]:
    return run_ranks(_only_the_view_worker, 4, deadline_s=DEADLINE_S)


def test_the_checkpoint_reads_only_its_public_view():
    assert [r["view"] for r in four_ranks()] == [True] * 4


def test_replicas_on_their_own_groups_save_and_resume_their_own_weights():
    assert [r["replicas"] for r in four_ranks()] == [{"own witness": True, "resume": "stepped"}] * 4


def test_replicas_on_their_own_groups_save_at_their_own_steps_and_resume_bit_for_bit():
    """The witness's collectives run over each optimizer's own ranks: neither replica waits for the
    other's saves or first step after a load."""
    assert [r["apart"] for r in four_ranks()] == [{"bit for bit": True}] * 4


def test_pipeline_stages_saved_in_one_save_each_resume_bit_for_bit():
    """Each stage's optimizer metadata has its own key: dcp writes both."""
    refused = ("PlanError: this checkpoint holds the state of 2 canzona optimizers under 'canzona_optimizer', "
               "none over this optimizer's parameters (names): load each with the optimizer it was saved with "
               "(a pipeline stage's with its stage's)")
    assert [r["stages"] for r in four_ranks()] == [{"bit for bit": True, "whole model": refused}] * 4


# --- each optimizer loads its own checkpoint on its own ranks -------------------------------------

OWN_STEPS = 3  # the save after step 2, the resume runs step 3
OWN_TIMEOUT_S = 10.0
OWN_WAIT_S = 90.0  # how long the second replica waits for the first to be done


def _wait_for(path: Any, seconds: float) -> None:
    import time

    end = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"{path.name} never came")
        time.sleep(0.05)


def _own_ranks_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    """Two replicas, each a DistributedOptimizer on its own DP group of half the ranks, each saving
    its sharded checkpoint (`save_checkpoint` over its own group) and loading it
    (`load_sharded_state_dict`, the manifest checked) at its own time: the second replica starts
    only when the first has resumed and stepped (a file says so). Then the first replica's
    checkpoint is damaged (a byte of a data file flipped) and each replica loads its own again: one
    CheckpointError on the first replica's ranks, the second loads. Before, the load's checks and
    `dcp.load` ran over every rank: the first replica waited for the second, which never came."""
    from pathlib import Path

    import torch.distributed as dist

    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.checkpoint_files import save_checkpoint

    halves = [dist.new_group(list(range(h * world // 2, (h + 1) * world // 2))) for h in range(2)]
    half = rank * 2 // world
    group, folder, done = halves[half], Path(root) / f"replica{half}", Path(root) / "replica0.done"
    data = torch.Generator().manual_seed(300 + rank)
    tokens = [torch.randint(0, 64, (2, 8), generator=data) for _ in range(OWN_STEPS)]

    def fresh(weights: dict | None = None):
        model = build_model(TrainSpec(model_seed=half))
        if weights is not None:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(weights[n])
        return model, DistributedOptimizer(model.named_parameters(), model.spec(), group=group,
                                           matrix_config={"ns_steps": 1}, timeout_s=OWN_TIMEOUT_S)

    def train(model, opt, steps):
        for k in steps:
            opt.zero_grad()
            model.loss(tokens[k]).backward()
            opt.step()
        opt.wait_params()

    out: dict[str, Any] = {}
    try:
        if half == 1:
            _wait_for(done, OWN_WAIT_S)
        model, opt = fresh()
        train(model, opt, range(OWN_STEPS))
        want = {n: p.detach().clone() for n, p in model.named_parameters()}
        model, opt = fresh()
        train(model, opt, range(OWN_STEPS - 1))
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        save_checkpoint(opt.sharded_state_dict(), folder, process_group=group)
        model, opt = fresh(weights)
        opt.load_sharded_state_dict(folder, check_weights=True)
        loaded = opt.state_dict()
        train(model, opt, range(OWN_STEPS - 1, OWN_STEPS))
        out["resume"] = {"bit for bit": all(torch.equal(p.detach(), want[n]) for n, p in model.named_parameters())}
    except Exception as e:  # noqa: BLE001 - the test reads it
        out["resume"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        loaded = None
    finally:
        if half == 0:
            dist.barrier(group=group)
            if rank == 0:
                done.touch()
    try:
        if half == 0 and rank == 0:  # a byte of rank 0's data file flipped
            data_file = folder / "__0_0.distcp"
            raw = bytearray(data_file.read_bytes())
            raw[len(raw) // 2] ^= 0xFF
            data_file.write_bytes(bytes(raw))
        dist.barrier(group=group)
        model, opt = fresh(weights)
        opt.load_sharded_state_dict(folder)
        nested_equal(opt.state_dict(), loaded, "reloaded")
        out["damaged"] = "loaded"
    except Exception as e:  # noqa: BLE001 - the test reads it
        out["damaged"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


@functools.cache
def own_ranks_runs() -> list[dict[str, Any]]:
    import tempfile

    return run_ranks(_own_ranks_worker, 4, tempfile.mkdtemp(prefix="canzona-own-"), deadline_s=DEADLINE_S)


def test_replicas_save_and_load_their_own_sharded_checkpoints_at_their_own_times():
    """The load's checks and reads run over the optimizer's own ranks: a replica that loads while
    the other is busy elsewhere (or not yet started) resumes bit for bit."""
    assert [r["resume"] for r in own_ranks_runs()] == [{"bit for bit": True}] * 4


def test_a_damaged_file_in_one_replicas_checkpoint_is_one_error_on_its_ranks_only():
    runs = own_ranks_runs()
    first = {r["damaged"] for r in runs[:2]}
    assert len(first) == 1, first  # alike on both of its ranks
    (line,) = first
    assert line.startswith("CheckpointError: ") and "__0_0.distcp differs from the manifest" in line, line
    assert [r["damaged"] for r in runs[2:]] == ["loaded"] * 2


# --- fp32 masters saved after weights were loaded into the model ---------------------------------


def _loaded_then_saved_worker(rank: int, world: int, path: str) -> dict:
    """A bf16 model (fp32 masters): a step, then other weights loaded into the model (a rollback,
    pretrained weights) and the model and optimizer saved in one `dcp.save`; one more step straight
    on, against the save resumed with `check_weights=True` (as the integrations resume) and the
    same step. Both `state_dict()` and the sharded form must save the masters of the weights as
    they are."""
    import torch.distributed.checkpoint as dcp

    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.checkpoint import without_weights_witness

    spec = TrainSpec(dtype="bf16", steps=2, global_batch=4)
    tokens = [t[: 4 // world] for t in _global_batches(spec)]

    def built(seed: int = 0):
        model = build_model(replace(spec, model_seed=seed))
        return model, DistributedOptimizer(model.named_parameters(), model.spec())

    def step(model, opt, batch) -> None:
        opt.zero_grad()
        model.loss(batch).backward()
        opt.step()

    model, opt = built()
    step(model, opt, tokens[0])
    model.load_state_dict(build_model(replace(spec, model_seed=5)).state_dict())
    full = opt.state_dict()
    dcp.save({**{f"model/{k}": v for k, v in model.state_dict().items()}, **opt.sharded_state_dict()},
             checkpoint_id=path)
    step(model, opt, tokens[1])
    straight = {n: p.detach().clone() for n, p in model.named_parameters()}
    del opt
    kept = copy.deepcopy(full)  # what `full` must still hold after the runs that loaded it stepped
    out = {}
    # "..., optimizer first": torch's set_state_dict's order (the model's weights after the optimizer's state)
    for how in ("sharded", "state_dict", "state_dict, optimizer first", "sharded, optimizer first"):
        model, opt = built(seed=1)
        weights = {f"model/{k}": v for k, v in model.state_dict().items()}
        dcp.load(weights, checkpoint_id=path)
        try:
            if how == "state_dict, optimizer first":
                opt.load_state_dict(full)
            elif how == "sharded, optimizer first":  # unchecked: the first step checks the witness
                opt.load_sharded_state_dict(path)
            model.load_state_dict({k.removeprefix("model/"): v for k, v in weights.items()})
            if how == "sharded":
                opt.load_sharded_state_dict(path, check_weights=True)
            elif how == "state_dict":
                opt.load_state_dict(full)
            step(model, opt, tokens[1])  # the first step after load_state_dict checks the weights
        except Exception as e:  # noqa: BLE001 - the test reads it
            out[how] = f"{type(e).__name__}: {e}"
            continue
        out[how] = compare({n: p.detach().clone() for n, p in model.named_parameters()}, straight)["bit_identical"]
        del opt
    # the loads copy what they keep: the steps after them left the state dict as it was given
    out["state dict unchanged"] = all(torch.equal(a, b) for a, b in zip(_tensors(full), _tensors(kept)))
    # the state dict beside weights of no save, on purpose (without the weights' witness, which
    # its first step would refuse): every tensor off its saved master's cast, written into the
    # model before or after the load; the step must start from them, as from a fresh master of
    # each (`reset_master_weights`)
    other = {k: v * 1.5 for k, v in build_model(replace(spec, model_seed=1)).state_dict().items()}
    full = without_weights_witness(full)

    def beside_other(order: str) -> dict[str, torch.Tensor]:
        model, opt = built(seed=1)
        if order == "model first":
            model.load_state_dict(other)
            opt.load_state_dict(full)
        elif order == "optimizer first":
            opt.load_state_dict(full)
            model.load_state_dict(other)
        else:  # fresh masters
            model.load_state_dict(other)
            opt.load_state_dict(full)
            opt.reset_master_weights()
        step(model, opt, tokens[1])
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    want = beside_other("fresh masters")
    for order in ("model first", "optimizer first"):
        out[f"other weights, {order}"] = compare(beside_other(order), want)["bit_identical"]
    out["older, partial template"] = _older_into_a_template(built, step, tokens[1], kept, path)
    out["sharded reset"] = _sharded_reset(built, step, tokens, path + "-initial")
    return out


def _sharded_reset(built, step, tokens: list[torch.Tensor], path: str) -> Any:
    """torch.optim's reset (`opt.load_state_dict(initial)`, `initial` taken before the first step:
    after a loss spike, between tasks) in the sharded form: a fresh optimizer's sharded_state_dict()
    saved, two steps, then loaded back into it (`check_weights` left to the first step). Two steps
    on must be those of a fresh optimizer beside the weights as they are (torch's empty state:
    moments from zero, step counts from 1; the fp32 masters of those weights). Before: the first
    step refused the weights, as of another save than the initial state's."""
    import torch.distributed.checkpoint as dcp

    model, opt = built()
    dcp.save(opt.sharded_state_dict(), checkpoint_id=path)
    step(model, opt, tokens[0])
    step(model, opt, tokens[1])
    weights = model.state_dict()
    fresh_model, fresh = built(seed=1)
    fresh_model.load_state_dict(weights)
    try:
        opt.load_sharded_state_dict(path)
        for batch in (tokens[1], tokens[0]):
            step(model, opt, batch)
            step(fresh_model, fresh, batch)
    except Exception as e:  # noqa: BLE001 - the test reads it
        return f"{type(e).__name__}: {e}"
    return compare({n: p.detach().clone() for n, p in model.named_parameters()},
                   {n: p.detach().clone() for n, p in fresh_model.named_parameters()})["bit_identical"]


def _older_into_a_template(built, step, batch, full: dict, path: str) -> str:
    """A dcp save of `state_dict()` as an older canzona wrote it (no witness), with the model,
    loaded into a template of a fresh model and optimizer (`DefaultLoadPlanner(allow_partial_load=True)`:
    the template's witness, which the file lacks, stays), then one step: it must step. Before, the
    template's witness (the fresh model's weights) was checked against the loaded ones: refused."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    from canzona.runtime.checkpoint import HEADER_KEY, without_weights_witness

    older = without_weights_witness(full)
    older["param_groups"] = [{**g, HEADER_KEY: json.dumps({k: v for k, v in json.loads(g[HEADER_KEY]).items()
                                                           if k != "weights_witness"})} for g in older["param_groups"]]
    model, opt = built(seed=1)
    weights = {f"model/{k}": v for k, v in model.state_dict().items()}
    dcp.load(weights, checkpoint_id=path)  # the save's weights
    dcp.save({**weights, "optim": older}, checkpoint_id=path + "-older")
    del opt
    model, opt = built(seed=2)
    template = {**{f"model/{k}": v for k, v in model.state_dict().items()}, "optim": opt.state_dict()}
    dcp.load(template, checkpoint_id=path + "-older", planner=DefaultLoadPlanner(allow_partial_load=True))
    model.load_state_dict({k.removeprefix("model/"): v for k, v in template.items() if k != "optim"})
    opt.load_state_dict(template["optim"])
    try:
        step(model, opt, batch)
    except Exception as e:  # noqa: BLE001 - the test reads it
        return f"{type(e).__name__}: {e}"
    return "stepped"


def _tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor in a nested state dict, in order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    values = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else ()
    return [t for v in values for t in _tensors(v)]


def _global_batches(spec: TrainSpec) -> list[torch.Tensor]:
    from canzona.harness.training import global_batches

    return global_batches(spec, 256)


@functools.cache
def loaded_then_saved() -> dict:
    import tempfile

    out, = run_ranks(_loaded_then_saved_worker, 1, tempfile.mkdtemp(prefix="canzona-masters-") + "/ckpt",
                     deadline_s=DEADLINE_S)
    return out


def test_masters_saved_after_weights_were_loaded_into_the_model_are_theirs():
    """Before: the stale masters were saved, and the save, whole, failed its own resume check."""
    out = loaded_then_saved()
    assert (out["sharded"], out["state_dict"]) == (True, True), out


def test_a_state_dict_loaded_before_its_model_steps_on():
    """torch's `set_state_dict` loads the optimizer before the model: `load_state_dict` checks the
    weights at the first step after it, when the model's are in place (a check at the load would
    refuse this order)."""
    out = loaded_then_saved()
    # bit for bit as the model loaded first, in the layout-independent and the sharded form
    assert (out["state_dict, optimizer first"], out["sharded, optimizer first"]) == (True, True), out


def test_steps_after_a_load_leave_the_state_dict_loaded_as_it_was():
    """Before: `load_state_dict` kept the state dict's fp32 masters themselves (a same-device,
    same-dtype `.to()` is no copy), so the steps after it trained them in place: a state dict kept
    to load again (another resume of it, a rollback) held that run's masters, and the next run
    from it diverged after one step."""
    assert loaded_then_saved()["state dict unchanged"] is True


def test_an_older_state_dict_loaded_into_a_fresh_template_steps():
    assert loaded_then_saved()["older, partial template"] == "stepped"


def test_a_state_dict_beside_other_weights_steps_from_the_models_weights():
    """A state dict without the weights' witness (`checkpoint.without_weights_witness`: loaded beside
    other weights on purpose) checks no weights: fp32 masters loaded beside weights that are not
    their cast are not trained from; the step starts from the model's weights, whichever was
    loaded first (`kernels.update_target`)."""
    out = loaded_then_saved()
    assert (out["other weights, model first"], out["other weights, optimizer first"]) == (True, True), out


def test_a_fresh_optimizers_sharded_state_loaded_later_resets_the_state_as_torch():
    """`load_sharded_state_dict()` of a state saved before the first step resets the optimizer, as
    torch's optimizers reset with their initial (empty) state dict: bit for bit a fresh optimizer
    beside the weights as they are. Its entries never stepped: the weights beside it are not
    another save's (stepped state beside them still is: `..._refused_at_the_first_step`)."""
    assert loaded_then_saved()["sharded reset"] is True
