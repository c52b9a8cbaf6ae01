"""Plan files (docs/architecture.md §3.5, docs/design.md §5 and §6): round trips, summaries and validation of malformed files."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from canzona.catalog import get_model
from canzona.dp import DP_POLICIES
from canzona.errors import PlanError, SpecError
from canzona.plan import (
    SCHEMA,
    VERSION,
    Plan,
    PlanSettings,
    check_plan_matches,
    load_plan,
    make_plan,
    plan_from_dict,
    plan_from_json,
    validate_plan,
)
from canzona.tp import EVERY_RANK, TP_POLICIES, Capacity

SUMMARY_KEYS = {
    "dp": {"policy", "imbalance", "lower_bound_gap", "comm_ratio", "atomic", "rank_loads"},
    "tp": {"policy", "groups", "efficiency"},
}

# (model, dp, tp, optimizer, dp policy, tp policy, extra make_plan kwargs)
CASES = [
    *[("qwen3-0.6b", 4, 2, "muon", pol, "greedy-rollback", {}) for pol in DP_POLICIES],
    *[("qwen3-32b", 32, 8, "muon", pol, "greedy-rollback", {}) for pol in DP_POLICIES],
    *[("qwen3-8b", 16, 4, "soap", "alpha-balanced", tpp, {}) for tpp in TP_POLICIES],
    ("qwen3-14b", 8, 8, "shampoo", "alpha-balanced-reorder", "greedy-rollback", {"alpha": 0.5}),
    ("qwen3-4b", 3, 1, "muon", "alpha-balanced", "greedy-rollback", {"alpha": 0.0}),
    ("qwen3-1.7b", 1, 1, "soap", "zero1-even", "tp-chunk", {}),
    ("qwen3-1.7b", 6, 2, "muon", "layerwise", "greedy-rollback",
     {"capacity": Capacity(2.0**30, "bytes"), "bucket_size": 200_000_000, "align": 128}),
]


def _make(case) -> Plan:
    name, dp, tp, opt, dpp, tpp, kw = case
    return make_plan(get_model(name, tp), dp, tp, opt, dpp, tpp, **kw)


def _case_id(case) -> str:
    name, dp, tp, opt, dpp, tpp, kw = case
    return f"{name}-dp{dp}-tp{tp}-{opt}-{dpp}-{tpp}" + ("-" + "-".join(kw) if kw else "")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_round_trip_through_json_is_equal(case):
    plan = _make(case)
    back = plan_from_json(plan.to_json())
    assert back == plan
    assert back.hash() == plan.hash()
    assert back.summary() == plan.summary()
    assert back.to_json() == plan.to_json()
    assert plan_from_json(plan.to_json(indent=2)) == plan
    validate_plan(back, get_model(case[0], case[2]))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_summary_has_required_keys_and_sane_values(case):
    plan = _make(case)
    s = plan.summary()
    for section, keys in SUMMARY_KEYS.items():
        assert keys <= set(s[section]), section
    d, t = s["dp"], s["tp"]
    assert (s["model"], s["dp_size"], s["tp_size"], s["optimizer"]) == case[:4]
    assert d["policy"] == case[4] and t["policy"] == case[5]
    assert len(d["rank_loads"]) == case[1]
    assert d["imbalance"] >= 1.0 - 1e-12
    assert d["lower_bound_gap"] >= -1e-9
    assert d["comm_ratio"] >= 1.0 - 1e-12
    assert isinstance(d["atomic"], bool)
    assert d["atomic"] is (d["atomicity_violations"] == 0)
    assert t["groups"] >= 1 and 0 < t["efficiency"] <= 1.0 + 1e-12
    assert max(d["rank_loads"]) == pytest.approx(d["makespan_s"])
    json.dumps(s)  # serialisable as is


def test_policies_keep_their_defining_properties():
    model = get_model("qwen3-32b", 8)
    plans = {pol: make_plan(model, 32, 8, dp_policy=pol) for pol in DP_POLICIES}
    s = {pol: p.summary()["dp"] for pol, p in plans.items()}
    assert not s["zero1-even"]["atomic"] and s["zero1-even"]["comm_ratio"] == pytest.approx(1.0)
    assert not s["layerwise"]["atomic"]
    for pol in ("whole-start", "alpha-balanced", "alpha-balanced-reorder"):
        assert s[pol]["atomic"], pol
    assert s["alpha-balanced"]["imbalance"] <= s["whole-start"]["imbalance"]
    assert s["alpha-balanced-reorder"]["lower_bound_gap"] < 0.01  # docs/design.md §10 bar
    assert s["alpha-balanced-reorder"]["imbalance"] <= s["alpha-balanced"]["imbalance"]
    # Every matrix is placed exactly once in each plan, and TP groups hold each owner's matrices.
    names = sorted(p.name for p in model.matrix_params())
    for plan in plans.values():
        assert sorted(p.name for p in plan.dp_plan.placements()) == names


def test_hash_identifies_what_ranks_execute():
    model = get_model("qwen3-0.6b", 2)
    a = make_plan(model, 4, 2)
    assert a.hash() == make_plan(model, 4, 2).hash()  # deterministic
    assert len(a.hash()) == 64
    assert a.hash() != make_plan(model, 4, 2, dp_policy="whole-start").hash()
    assert a.hash() != make_plan(model, 4, 2, tp_policy="tp-chunk").hash()
    assert a.hash() != make_plan(model, 2, 2).hash()


def test_metrics_in_the_file_are_not_trusted():
    plan = make_plan(get_model("qwen3-0.6b", 2), 4, 2)
    d = json.loads(plan.to_json())
    d["metrics"]["dp"]["imbalance"] = 123.0
    d["metrics"]["tp"]["groups"] = -1
    back = plan_from_dict(d)
    assert back == plan and back.summary() == plan.summary()
    assert back.summary()["dp"]["imbalance"] != 123.0


def test_save_and_load(tmp_path: Path):
    model = get_model("qwen3-32b", 8)
    plan = make_plan(model, 32, 8, dp_policy="alpha-balanced-reorder")
    path = tmp_path / "plan.json"
    plan.save(path)
    text = path.read_text()
    assert text.endswith("\n")
    raw = json.loads(text)
    assert raw["schema"] == SCHEMA and raw["version"] == VERSION
    assert raw["model"] == {"name": "qwen3-32b", "fingerprint": model.fingerprint()}
    loaded = load_plan(path)
    assert loaded == plan and loaded.hash() == plan.hash()
    assert load_plan(str(path), model) == plan
    check_plan_matches(loaded, model, dp=32, tp=8)


# --- malformed files --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good() -> Plan:
    return make_plan(get_model("qwen3-0.6b", 2), 4, 2)


def _bucket_with_distinct_inner_cuts(d: dict) -> dict:
    for b in d["dp_plan"]["buckets"]:
        if len(set(b["cuts"][1:-1])) >= 2:
            return b
    raise AssertionError("no bucket with two distinct inner cuts")


def _swap_cuts(d):
    b = _bucket_with_distinct_inner_cuts(d)
    inner = b["cuts"][1:-1]
    b["cuts"][1:-1] = sorted(inner, reverse=True)


def _dup_param(d):
    b = d["dp_plan"]["buckets"][0]
    b["params"].append(list(b["params"][0]))


def _owner_out_of_range(d):
    d["dp_plan"]["buckets"][0]["params"][0][5] = 4  # dp = 4


def _overlap(d):
    params = d["dp_plan"]["buckets"][0]["params"]
    params[1][1] = params[0][1]


def _missing_task(d):
    g = d["tp_plan"]["groups"][0][0]
    for k in ("tasks", "hosts", "costs"):
        g[k].pop()
    if not g["tasks"]:
        d["tp_plan"]["groups"][0].pop(0)


def _host_out_of_range(d):
    d["tp_plan"]["groups"][0][0]["hosts"][0] = 2  # tp = 2


def _host_every_rank_outside_tp_sync(d):
    d["tp_plan"]["groups"][0][0]["hosts"][0] = EVERY_RANK


def _set(path: tuple, value) -> Callable[[dict], None]:
    def f(d):
        obj = d
        for k in path[:-1]:
            obj = obj[k]
        obj[path[-1]] = value
    return f


def _delete(path: tuple) -> Callable[[dict], None]:
    def f(d):
        obj = d
        for k in path[:-1]:
            obj = obj[k]
        del obj[path[-1]]
    return f


MALFORMED = {
    "wrong schema": (_set(("schema",), "something.else"), "not a canzona plan"),
    "no schema": (_delete(("schema",)), "not a canzona plan"),
    "wrong version": (_set(("version",), 2), "unsupported version 2"),
    "missing layout": (_delete(("layout",)), "missing field 'layout'"),
    "missing dp_plan": (_delete(("dp_plan",)), "missing field 'dp_plan'"),
    "missing cuts": (_delete(("dp_plan", "buckets", 0, "cuts")), "missing field 'cuts'"),
    "missing tp policy": (_delete(("tp_plan", "policy")), "missing field 'policy'"),
    "dp as string": (_set(("layout", "dp"), "4"), "field 'dp' has the wrong type"),
    "tp as bool": (_set(("layout", "tp"), True), "field 'tp' has the wrong type"),
    "buckets not a list": (_set(("dp_plan", "buckets"), {}), "field 'buckets' has the wrong type"),
    "fingerprint as int": (_set(("model", "fingerprint"), 7), "field 'fingerprint' has the wrong type"),
    "offset as string": (_set(("dp_plan", "buckets", 0, "params", 0, 1), "0"), "wrong type"),
    "short param row": (_set(("dp_plan", "buckets", 0, "params", 0), ["x", 0]), "each parameter must be"),
    "float cut": (_set(("dp_plan", "buckets", 0, "cuts", 1), 0.5), "cut points must be integers"),
    "alpha as string": (_set(("dp_plan", "alpha"), "1"), "alpha must be a number in [0, 1]"),
    "dp zero": (_set(("layout", "dp"), 0), "dp must be in 1..65536 and tp in 1..1024"),
    "cuts out of order": (_swap_cuts, "segments must be contiguous"),
    "last cut short": (lambda d: d["dp_plan"]["buckets"][0]["cuts"].__setitem__(-1, 1), "cover"),
    "too few cuts": (lambda d: d["dp_plan"]["buckets"][0]["cuts"].pop(1), "expected dp + 1 = 5"),
    "parameter twice": (_dup_param, "appears more than once"),
    "owner out of range": (_owner_out_of_range, "owner 4 outside 0..3"),
    "overlapping placement": (_overlap, "misplaced"),
    "misaligned placement": (lambda d: d["dp_plan"]["buckets"][0]["params"][0].__setitem__(1, 1),
                             "misplaced"),
    "unknown dp policy": (_set(("dp_plan", "policy"), "magic"), "unknown DP policy 'magic'"),
    "unknown tp policy": (_set(("tp_plan", "policy"), "magic"), "unknown TP policy 'magic'"),
    "unknown optimizer": (_set(("optimizer",), "sgd"), "unknown optimizer 'sgd'"),
    "bad capacity unit": (_set(("tp_plan", "capacity", "unit"), "ms"), "capacity unit"),
    "negative capacity": (_set(("tp_plan", "capacity", "value"), -1.0), "capacity must be a positive finite number"),
    "tp group missing a task": (_missing_task, "do not hold exactly the matrices it computes"),
    "tp group lengths differ": (lambda d: d["tp_plan"]["groups"][0][0]["hosts"].pop(), "differ in length"),
    "tp groups for too few ranks": (lambda d: d["tp_plan"]["groups"].pop(), "groups for 3 DP ranks, expected 4"),
    "host out of range": (_host_out_of_range, "host 2 outside 0..1"),
    "every-rank host outside tp-sync": (_host_every_rank_outside_tp_sync, "host -1 outside 0..1"),
    "layout dp disagrees with cuts": (_set(("layout", "dp"), 5), "expected dp + 1 = 6"),
}


def _mutated(plan: Plan, mutate: Callable[[dict], None]) -> str:
    d = json.loads(plan.to_json())
    mutate(d)
    return json.dumps(d)


def _check_one_line(err: pytest.ExceptionInfo, needle: str) -> str:
    msg = str(err.value)
    assert msg and "\n" not in msg, msg
    assert needle in msg, msg
    return msg


@pytest.mark.parametrize("what", list(MALFORMED))
def test_malformed_plan_raises_one_line_plan_error(good, what, tmp_path):
    mutate, needle = MALFORMED[what]
    text = _mutated(good, mutate)
    with pytest.raises(PlanError) as err:
        plan_from_json(text)
    _check_one_line(err, needle)
    # Through a file, the message is prefixed by the path and still one line.
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(PlanError) as err:
        load_plan(path)
    assert _check_one_line(err, needle).startswith(f"{path}: ")


@pytest.mark.parametrize(
    "text, needle",
    [
        ("{not json", "not valid JSON"),
        ("", "not valid JSON"),
        ("[1, 2, 3]", "not a JSON object"),
        ('"plan"', "not a JSON object"),
        ("null", "not a JSON object"),
    ],
)
def test_non_plan_json_raises_plan_error(text, needle, tmp_path):
    with pytest.raises(PlanError) as err:
        plan_from_json(text)
    _check_one_line(err, needle)
    path = tmp_path / "x.json"
    path.write_text(text)
    with pytest.raises(PlanError) as err:
        load_plan(path)
    _check_one_line(err, needle)


def test_unreadable_plan_paths(tmp_path):
    for path, needle in ((tmp_path / "missing.json", "No such file"), (tmp_path, "cannot read plan file")):
        with pytest.raises(PlanError) as err:
            load_plan(path)
        _check_one_line(err, needle)
        assert "cannot read plan file" in str(err.value)
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(PlanError) as err:
        load_plan(binary)
    _check_one_line(err, "cannot read plan file")


def test_plan_for_another_model(tmp_path, good):
    path = tmp_path / "plan.json"
    good.save(path)
    other = get_model("qwen3-1.7b", 2)
    with pytest.raises(PlanError) as err:
        load_plan(path, other)
    msg = _check_one_line(err, "plan was made for model 'qwen3-0.6b'")
    assert "qwen3-1.7b" in msg and str(path) in msg
    with pytest.raises(PlanError) as err:
        check_plan_matches(good, other)
    _check_one_line(err, "not 'qwen3-1.7b'")
    with pytest.raises(PlanError) as err:
        validate_plan(good, other)
    _check_one_line(err, "qwen3-1.7b")


def test_plan_with_the_right_fingerprint_but_wrong_matrices():
    """A file whose fingerprint was edited to match is still checked parameter by parameter."""
    model = get_model("qwen3-0.6b", 2)
    plan = make_plan(model, 4, 2)
    wrong_tp = make_plan(model, 4, 1)  # tp=1 shards are twice the size of tp=2 ones
    d = json.loads(wrong_tp.to_json())
    d["layout"]["tp"] = 2  # hosts are all 0, legal at tp=2: structurally valid
    d["model"]["fingerprint"] = model.fingerprint(2)  # a TP-1 plan's leaves the TP dims out
    forged = plan_from_dict(d)
    with pytest.raises(PlanError) as err:
        check_plan_matches(forged, model)
    _check_one_line(err, "does not match model 'qwen3-0.6b': model.layers.0.mlp.down_proj.weight has 3145728 elements per shard in the plan, 1572864 in the model")
    d = json.loads(plan.to_json())
    d["dp_plan"]["buckets"][0]["params"][0][0] = "model.layers.99.mlp.up_proj.weight"
    d["tp_plan"]["groups"] = [
        [{**g, "tasks": ["model.layers.99.mlp.up_proj.weight" if t == plan.dp_plan.buckets[0].params[0].name
                         else t for t in g["tasks"]]} for g in rank]
        for rank in d["tp_plan"]["groups"]
    ]
    renamed = plan_from_dict(d)
    with pytest.raises(PlanError) as err:
        check_plan_matches(renamed, model)
    _check_one_line(err, "the plan lacks model.layers.")


def test_layout_mismatch(good):
    model = get_model("qwen3-0.6b", 2)
    check_plan_matches(good, model, dp=4, tp=2)
    with pytest.raises(PlanError) as err:
        check_plan_matches(good, model, dp=8)
    _check_one_line(err, "plan is for dp=4, but the job has dp=8")
    with pytest.raises(PlanError) as err:
        check_plan_matches(good, model, tp=4)
    _check_one_line(err, "plan is for tp=2, but the job has tp=4")


def test_tp_sync_every_rank_host_is_legal():
    plan = make_plan(get_model("qwen3-0.6b", 2), 4, 2, tp_policy="tp-sync")
    hosts = {h for rank in plan.tp_plan.groups for g in rank for h in g.hosts}
    assert hosts == {EVERY_RANK}
    assert plan_from_json(plan.to_json()) == plan


# --- malformed values that once escaped as other exceptions or were accepted ---------------------


BUGS = {
    "host as string": (_set(("tp_plan", "groups", 0, 0, "hosts", 0), "0"),
                       "_validate_tp compares a str host with ints: TypeError, not PlanError"),
    "host as null": (_set(("tp_plan", "groups", 0, 0, "hosts", 0), None),
                     "_validate_tp compares None with ints: TypeError, not PlanError"),
    "tp cost as string": (_set(("tp_plan", "groups", 0, 0, "costs", 0), "x"),
                          "_tp_from calls float('x'): ValueError, not PlanError"),
    "task name as list": (_set(("tp_plan", "groups", 0, 0, "tasks", 0), ["a"]),
                          "_validate_tp puts a list in a set: TypeError, not PlanError"),
    "align zero": (_set(("dp_plan", "align"), 0),
                   "_validate_dp computes offset % 0: ZeroDivisionError, not PlanError"),
    "version true": (_set(("version",), True),
                     "plan_from_dict compares version with ==, so true (== 1) is accepted"),
    "alpha out of range": (_set(("dp_plan", "alpha"), 5.0), "alpha outside [0, 1] is accepted"),
    "negative align": (_set(("dp_plan", "align"), -64), "a negative alignment is accepted"),
    "negative cost": (_set(("dp_plan", "buckets", 0, "params", 0, 3), -1.0),
                      "a negative parameter cost is accepted"),
}


@pytest.mark.parametrize(
    "what",
    list(BUGS),
)
def test_malformed_values_raise_plan_error(good, what):
    mutate, _ = BUGS[what]
    with pytest.raises(PlanError) as err:
        plan_from_json(_mutated(good, mutate))
    assert "\n" not in str(err.value)


def test_hash_survives_round_trip_with_integer_capacity():
    plan = make_plan(get_model("qwen3-0.6b", 2), 4, 2, capacity=Capacity(2**30, "bytes"))
    back = plan_from_json(plan.to_json())
    assert back == plan
    assert back.hash() == plan.hash()


def test_hash_survives_round_trip_with_integer_table_cost():
    from canzona.cost import TableCost

    model = get_model("qwen3-0.6b", 2)
    q = model.param("model.layers.0.self_attn.q_proj.weight").shape
    table = TableCost(table={("muon", q[0], q[1], "bf16"): 1}, dtypes={"muon": "bf16"})
    plan = make_plan(model, 4, 2, cost_model=table)
    back = plan_from_json(plan.to_json())
    assert back == plan
    assert back.hash() == plan.hash()


# --- named axes -------------------------------------------------------------------------------


def test_the_layout_names_its_axes_and_refuses_unknown_ones(tmp_path):
    from canzona.plan import PLAN_AXES

    plan = make_plan(get_model("qwen3-0.6b", 2), 4, 2)
    assert plan.layout == {"dp": 4, "tp": 2} and tuple(plan.layout) == PLAN_AXES
    data = json.loads(plan.to_json())
    assert data["layout"] == plan.layout
    data["layout"]["cp"] = 2  # an axis of a later canzona (context parallelism)
    with pytest.raises(PlanError, match="layout: axis 'cp' is not one this canzona plans for"):
        plan_from_dict(data)
    del data["layout"]["cp"]
    data["layout"]["ep"] = 2  # expert parallelism without the experts' plan
    with pytest.raises(PlanError, match="layout: missing field 'etp'"):
        plan_from_dict(data)
    data["layout"]["etp"] = 1
    with pytest.raises(PlanError, match="plan: missing field 'experts'"):
        plan_from_dict(data)


# --- expert parallelism: one file, the dense part's plan holding the experts' -----------------


def _ep_plan(optimizer: str = "muon", **kw) -> Plan:
    from canzona.plan import plan_for

    return plan_for(get_model("qwen3-30b-a3b", 2), 8, 2, optimizer, "canzona", ep=4, **kw)


def test_an_expert_parallel_plan_round_trips_and_names_its_axes():
    from canzona.experts import dense_part, expert_part

    plan = _ep_plan()
    assert plan.layout == {"dp": 8, "tp": 2, "ep": 4, "etp": 1}
    assert (plan.experts.dp, plan.experts.tp, plan.experts.layout) == (4, 1, {"dp": 4, "tp": 1})  # EDP 8 x 2 / 4
    model = get_model("qwen3-30b-a3b", 2)
    assert plan.fingerprint == dense_part(model).fingerprint()
    assert plan.experts.fingerprint == expert_part(model, 4).fingerprint()
    back = plan_from_json(plan.to_json())
    assert back == plan and back.hash() == plan.hash()
    # the hash covers the experts' plan: two plans that differ only there differ
    other = _ep_plan(settings=PlanSettings(expert_buckets="dp-multiple"))
    assert other.dp_plan == plan.dp_plan and other.experts != plan.experts and other.hash() != plan.hash()
    summary = plan.summary()
    assert (summary["ep_size"], summary["etp_size"], summary["experts"]["dp_size"]) == (4, 1, 4)
    check_plan_matches(back, model, dp=8, tp=2, ep=4)


def test_a_dense_plan_file_is_unchanged_by_expert_parallelism():
    plan = make_plan(get_model("qwen3-0.6b", 2), 4, 2)
    data = json.loads(plan.to_json())
    assert "experts" not in data and set(data["layout"]) == {"dp", "tp"} and plan.ep == 1 and plan.etp == 1


@pytest.mark.parametrize("change, message", [
    (lambda d: d["layout"].update(ep=1), "layout: ep must be in 2.."),
    (lambda d: d["layout"].update(ep=8), "edp x ep x etp = 4 x 8 x 1 must be the dp x tp = 8 x 2 GPUs"),
    (lambda d: d["experts"].update(optimizer="soap"), "experts: planned for soap, the dense part for muon"),
    (lambda d: d["experts"]["layout"].update(ep=2), "experts: layout axis 'ep' is not one of dp, tp"),
    (lambda d: d["experts"]["dp_plan"]["buckets"][0]["params"][0].__setitem__(5, 99), "outside 0..3"),
    (lambda d: d.pop("experts"), "plan: missing field 'experts'"),
])
def test_a_damaged_expert_parallel_plan_is_one_error(change, message):
    data = json.loads(_ep_plan().to_json())
    change(data)
    with pytest.raises(PlanError, match=message.replace(".", r"\.").replace("(", r"\(")):
        plan_from_dict(data)


def test_an_expert_parallel_plan_is_checked_against_the_whole_model_and_the_job():
    plan = _ep_plan()
    model = get_model("qwen3-30b-a3b", 2)
    with pytest.raises(PlanError, match="plan is for ep=4, but the job has ep=2"):
        check_plan_matches(plan, model, dp=8, tp=2, ep=2)
    with pytest.raises(PlanError, match="plan is for ep=1, but the job has ep=4"):
        check_plan_matches(make_plan(model, 8, 2), model, dp=8, tp=2, ep=4)
    with pytest.raises(PlanError, match="has no experts"):
        check_plan_matches(plan, get_model("qwen3-8b", 2))
    # expert TP is planned and simulated: a job refuses it
    etp = _ep_plan(etp=2, hidden=2048)
    check_plan_matches(etp, model, hidden=2048)
    with pytest.raises(PlanError, match="expert TP \\(etp=2\\)"):
        check_plan_matches(etp, model, dp=8, tp=2, ep=4)


def test_the_runtime_mesh_holds_one_communicator_per_named_axis():
    from types import SimpleNamespace

    from canzona.runtime.comm import CollectiveLog
    from canzona.runtime.mesh import Mesh

    def comm(size, rank):
        return SimpleNamespace(size=size, rank=rank, log=CollectiveLog())

    dp, tp = comm(4, 1), comm(2, 0)
    mesh = Mesh({"dp": dp, "tp": tp})
    assert mesh.layout == {"dp": 4, "tp": 2} and mesh.comm("tp") is tp and mesh.rank("dp") == 1
    assert dp.log.clock is tp.log.clock  # one issue order over every axis's log
    alone = Mesh({"dp": comm(4, 0)})
    assert alone.comm("tp") is None and alone.size("tp") == 1 and alone.rank("tp") == 0
    with pytest.raises(SpecError, match="unknown mesh axis 'ep'"):
        alone.comm("ep")
    with pytest.raises(SpecError, match="dp always"):
        Mesh({"tp": tp})


def test_planning_settings_beside_a_plan_must_be_the_plans():
    """`check_plan_settings` (DistributedOptimizer(plan=..., dp_policy=..., ...)): settings at their
    defaults, or the plan's own, pass; another one is a PlanError naming both values; the DP and TP
    settings of a baseline (its own policies) are not compared; "auto" geometry accepts ZeRO-1's even
    segments for any whole-matrix DP policy, "whole" does not."""
    from dataclasses import replace

    from canzona.models import resolve_spec
    from canzona.plan import PlanSettings, check_plan_settings
    from canzona.step_policies import get_step_policy

    canzona, sc = get_step_policy("canzona"), get_step_policy("sc")
    spec = resolve_spec("qwen3-0.6b", 2)
    plan = make_plan(spec, 4, 2, "muon", "alpha-balanced", "greedy-rollback", alpha=0.5, bucket_size=2**26,
                     align=128, capacity=Capacity(1e-3, "s"))
    same = PlanSettings(dp_policy="alpha-balanced", tp_policy="greedy-rollback", alpha=0.5, bucket_size=2**26,
                        align=128, capacity=Capacity(1e-3, "s"))
    for ok in (PlanSettings(), same):
        check_plan_settings(plan, canzona, ok)
    for name, value in (("dp_policy", "whole-start"), ("alpha", 0.25), ("bucket_size", 2**25), ("align", 256),
                        ("balance_by", "elements"), ("tp_policy", "tp-chunk"), ("capacity", Capacity(1.0, "s"))):
        with pytest.raises(PlanError, match=f"^{name}=.* was given with a plan made with {name}="):
            check_plan_settings(plan, canzona, replace(same, **{name: value}))
        if name in ("dp_policy", "tp_policy", "capacity"):  # a baseline's own DP policy and TP scheduler
            check_plan_settings(plan, sc, replace(same, **{name: value}))
    even = make_plan(spec, 4, 2, "muon", "zero1-even")
    check_plan_settings(even, canzona, PlanSettings(dp_policy="whole-start"))  # what auto geometry may make of it
    with pytest.raises(PlanError, match="geometry='whole' was given"):
        check_plan_settings(even, canzona, PlanSettings(), geometry="whole")
    check_plan_settings(even, canzona, PlanSettings(dp_policy="zero1-even"), geometry="whole")


def test_a_tp1_plan_recording_the_tp_dims_still_matches():
    """A TP-1 plan's fingerprint leaves the TP dims out (TP 1 splits nothing); one written before it
    did records them, and is the same model's plan still."""
    model = get_model("qwen3-0.6b", 2)
    d = json.loads(make_plan(model, 4, 1).to_json())
    assert d["model"]["fingerprint"] == model.fingerprint(1) != model.fingerprint()
    d["model"]["fingerprint"] = model.fingerprint()
    check_plan_matches(plan_from_dict(d), model, dp=4, tp=1)
