"""The runtime under the habits of real training loops (HF Trainer, Accelerate, torchtitan): each
habit either keeps working exactly or fails loudly on every rank; none corrupts training silently.

- `model.zero_grad()` (set_to_none) instead of `optimizer.zero_grad()`;
- `model.to(dtype)` after the optimizer was built;
- a rank that skips backward; ranks built with different initial weights;
- a checkpoint of another model;
- hyper-parameters edited in `param_groups`, no-decay groups, ranks that disagree on them;
- global gradient clipping; configuration errors; `state_dict()` with a missing peer.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from canzona.errors import PlanError, SpecError
from canzona.harness.launch import run_ranks
from canzona.harness.training import (
    TrainSpec,
    build_model,
    compare,
    distributed_worker,
    emulate,
    global_batches,
    global_gradients,
    micro_batches,
)
from canzona.runtime.checkpoint import state_by_name
from tests.runtime.outcomes import outcome as _outcome
from tests.runtime.outcomes import same, weights

pytestmark = pytest.mark.distributed  # spawns gloo process groups

DP = 2
DEADLINE_S = 180.0
STEP_TIMEOUT_S = 4.0
BASE = TrainSpec(steps=3, global_batch=4 * DP)


def _optimizer(model, **kwargs):
    from canzona.runtime import DistributedOptimizer

    return DistributedOptimizer(model.named_parameters(), model.spec(), **kwargs)


def _batch(rank: int, world: int, spec: TrainSpec = BASE):
    return micro_batches(global_batches(spec, 256)[0], rank, world, 1)[0]


# --- jobs, run in one spawned group --------------------------------------------------------------


def train_job(rank: int, world: int, spec: TrainSpec) -> dict:
    out = distributed_worker(rank, world, spec, {"state_dict": False})
    return {"params": out["params"], "norms": out["norms"]}


def bf16_checkpoint_job(rank: int, world: int) -> dict:
    """Two steps, a checkpoint (model weights + optimizer state), a fresh model and optimizer that
    load it, one more step: the fp32 masters travel with the checkpoint."""
    spec = replace(BASE, dtype="bf16")
    model = build_model(spec)
    opt = _optimizer(model)
    batches = global_batches(replace(spec, steps=3), 256)

    def train(m, o, tokens) -> None:
        o.zero_grad()
        m.loss(micro_batches(tokens, rank, world, 1)[0]).backward()
        o.step()
    for tokens in batches[:2]:
        train(model, opt, tokens)
    saved = weights(model)
    state = opt.state_dict()
    resumed = build_model(replace(spec, model_seed=7))  # other weights until the checkpoint loads
    with torch.no_grad():
        for n, p in resumed.named_parameters():
            p.copy_(saved[n])
    opt2 = _optimizer(resumed)
    opt2.load_state_dict(state)
    train(resumed, opt2, batches[2])
    train(model, opt, batches[2])
    masters = {n: s["master"].dtype for n, s in state_by_name(state)[2].items() if "master" in s}
    return {"resumed": weights(resumed),
            "uninterrupted": weights(model),
            "master dtypes": sorted({str(d) for d in masters.values()}), "with master": len(masters)}


def cast_after_build_job(rank: int, world: int) -> dict:
    model = build_model(BASE)
    opt = _optimizer(model)
    model.double()  # the user casts the model after building the optimizer

    def train() -> None:
        opt.zero_grad()
        model.loss(_batch(rank, world)).backward()
        opt.step()
    return _outcome(train)


def skipped_backward_job(rank: int, world: int) -> dict:
    model = build_model(BASE)
    opt = _optimizer(model, timeout_s=STEP_TIMEOUT_S)

    def train() -> None:
        opt.zero_grad()
        if rank != 1:  # rank 1 forgets backward (a data-loader branch, an exception swallowed)
            model.loss(_batch(rank, world)).backward()
        opt.step()
    return _outcome(train)


def different_init_job(rank: int, world: int) -> dict:
    model = build_model(replace(BASE, model_seed=rank))  # each rank seeds its own weights
    return _outcome(lambda: _optimizer(model))


def rank_zero_load_job(rank: int, world: int) -> dict:
    """The model's weights loaded on rank 0 alone after the optimizer was built (a resume written
    `if rank == 0: model.load_state_dict(...)`), then on every rank."""
    model = build_model(BASE)
    opt = _optimizer(model, timeout_s=STEP_TIMEOUT_S)
    loaded = build_model(replace(BASE, model_seed=1)).state_dict()

    def step(model, opt) -> None:
        opt.zero_grad()
        model.loss(_batch(rank, world)).backward()
        opt.step()
    if rank == 0:
        model.load_state_dict(loaded)
    before = weights(model)
    one_rank = _outcome(lambda: step(model, opt))
    untouched = _same(before, weights(model))
    model.load_state_dict(loaded)  # every rank: the step compares, agrees and trains the loaded weights
    every_rank = _outcome(lambda: step(model, opt))
    fresh = build_model(replace(BASE, model_seed=1))
    step(fresh, _optimizer(fresh))
    as_built = _same(weights(model), weights(fresh))

    def clipped() -> None:  # loaded between clip_grad_norm_() and step(), which reuses the clip's check
        opt.zero_grad()
        model.loss(_batch(rank, world)).backward()
        opt.clip_grad_norm_(1.0)
        if rank == 0:
            model.load_state_dict(build_model(replace(BASE, model_seed=2)).state_dict())
        opt.step()
    before = weights(model)
    after_clip = _outcome(clipped)
    untouched_after_clip = _same(before, weights(model))

    # written in place without load_state_dict (a resume of the user's own, an EMA swap), into a model
    # whose optimizer has not stepped yet: seen by the parameters' version counters (`WeightVersions`),
    # compared as a load is
    model = build_model(BASE)
    opt = _optimizer(model, timeout_s=STEP_TIMEOUT_S)
    other = build_model(replace(BASE, model_seed=3)).state_dict()

    def write() -> None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(other[n])
    compared = []
    check = opt._check_agreement
    opt._check_agreement = lambda *a, **k: (compared.append(k.get("weights")), check(*a, **k))[1]
    if rank == 0:
        write()
    before = weights(model)
    written_one = _outcome(lambda: step(model, opt))
    untouched_written = _same(before, weights(model))
    write()  # on every rank: one comparison, and the step trains the written weights
    written_every = _outcome(lambda: step(model, opt))
    fresh = build_model(replace(BASE, model_seed=3))
    step(fresh, _optimizer(fresh))
    as_written = _same(weights(model), weights(fresh))
    comparisons = list(compared)
    plain = [_outcome(lambda: step(model, opt)) for _ in range(2)]  # the optimizer's own writes: no comparison
    opt.zero_grad()
    model.loss(_batch(rank, world)).backward()
    opt.clip_grad_norm_(1.0)
    opt.step()  # a clip, then the step: no comparison either
    return {"one rank": one_rank, "untouched": untouched, "every rank": every_rank, "as if built from them": as_built,
            "after clip": after_clip, "untouched after clip": untouched_after_clip,
            "written on one rank": written_one, "untouched when written": untouched_written,
            "written on every rank": written_every, "as if built from the written": as_written,
            "compared": comparisons, "plain steps": plain, "compared in plain steps": compared[len(comparisons):]}


def renormed_embedding_job(rank: int, world: int) -> dict:
    """An `nn.Embedding(max_norm=...)`, whose forward rescales the rows it looks up in place (other
    rows on each rank: their tokens differ), trained two steps; and the same with the optimizer's
    record of in-place writes emptied (as before it kept one)."""
    from canzona.runtime.model_loads import WeightVersions
    from tests.runtime.test_model_loads import Renormed

    def train(before: bool) -> dict:
        model = Renormed()
        opt = _optimizer(model, timeout_s=STEP_TIMEOUT_S)
        if before:
            opt._weight_versions = opt._expert_versions = WeightVersions([])
        compared = []
        check = opt._check_agreement
        opt._check_agreement = lambda *a, **k: (compared.append(k.get("weights")), check(*a, **k))[1]

        def steps() -> None:
            for k in range(2):
                opt.zero_grad()
                model.loss(torch.arange(6) + 8 * rank + k).backward()
                opt.step()
        outcome = _outcome(steps)
        return {"outcome": outcome, "compared": list(compared), "weights": weights(model), "model": model,
                "opt": opt}
    now, before = train(False), train(True)
    model, opt = now["model"], now["opt"]

    def step() -> None:
        opt.zero_grad()
        model.loss(torch.arange(6) + 8 * rank).backward()
        opt.step()
    model.load_state_dict(Renormed().state_dict())  # on every rank: one comparison, which the forward's rows leave equal
    loaded = _outcome(step)
    if rank == 0:
        with torch.no_grad():
            model.head.bias.add_(1.0)
    written = _outcome(step)
    # the embedding alone loaded on rank 0 only (pretrained vectors): the comparison cannot read its
    # weight, so the ranks compare its load mark (review: before, no error, and the step's all-gather
    # trained a row-wise mix of the loaded and the old vectors)
    fresh = train(False)
    model, opt = fresh["model"], fresh["opt"]
    if rank == 0:
        model.embed.load_state_dict({"weight": torch.full_like(model.embed.weight, 0.1)})
    embed_on_one = _outcome(step)
    return {"outcome": now["outcome"], "compared": now["compared"], "weights": now["weights"],
            "as before": _same(now["weights"], before["weights"]), "before": before["outcome"],
            "loaded on every rank": loaded, "written on one rank": written, "embedding loaded on one rank": embed_on_one}


def group_disagreement_job(rank: int, world: int) -> dict:
    model = build_model(BASE)
    opt = _optimizer(model, timeout_s=STEP_TIMEOUT_S)
    if rank == 1:
        opt.param_groups[0]["lr"] *= 2  # one rank's scheduler went its own way

    def train() -> None:
        opt.zero_grad()
        model.loss(_batch(rank, world)).backward()
        opt.step()
    return _outcome(train)


def live_hyper_parameters_job(rank: int, world: int, spec: TrainSpec) -> dict:
    """Edit momentum and weight decay in param_groups after construction; put every AdamW
    parameter in a no-decay group."""
    model = build_model(spec)
    names = {p.name for p in model.spec().matrix_params()}
    pairs = list(model.named_parameters())
    opt = _optimizer_groups(model, [
        {"params": [(n, p) for n, p in pairs if n in names]},
        {"params": [(n, p) for n, p in pairs if n not in names], "weight_decay": 0.0},
    ])
    for g in opt.param_groups:
        if g["kind"] == "matrix":
            g["momentum"], g["weight_decay"] = 0.8, 0.0
    for tokens in global_batches(spec, 256):
        opt.zero_grad()
        model.loss(micro_batches(tokens, rank, world, 1)[0]).backward()
        opt.step()
    return weights(model)


def _optimizer_groups(model, groups):
    from canzona.runtime import DistributedOptimizer

    return DistributedOptimizer(groups, model.spec(), "muon")


def foreign_checkpoint_job(rank: int, world: int) -> dict:
    tied = build_model(BASE)
    untied = build_model(replace(BASE, preset="tiny-untied"))
    opt_tied, opt_untied = _optimizer(tied), _optimizer(untied)
    for model, opt in ((tied, opt_tied), (untied, opt_untied)):
        opt.zero_grad()
        model.loss(_batch(rank, world)).backward()
        opt.step()
    state = opt_untied.state_dict()
    renamed = opt_tied.state_dict()
    renamed["param_names"] = [["model.bogus.weight" if n == "model.norm.weight" else n for n in g]
                              for g in renamed["param_names"]]
    other = opt_tied.state_dict()
    for g in other["param_groups"]:
        g["canzona"] = json.dumps({**json.loads(g["canzona"]), "optimizer": "soap"})
    return {"other model": _outcome(lambda: opt_tied.load_state_dict(state)),
            "unknown parameter": _outcome(lambda: opt_tied.load_state_dict(renamed)),
            "other optimizer": _outcome(lambda: opt_tied.load_state_dict(other))}


def regrouped_checkpoint_job(rank: int, world: int) -> dict:
    """Groups of the same kinds in the same order, holding other parameters (the attention's or the
    MLP's matrices at the lower learning rate): each path of loading refuses the checkpoint, before
    anything changes."""
    import tempfile

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    def grouped(model, slow: str):
        """The embedding and the `slow` matrices at lr 0.01; the rest at 0.02."""
        named = list(model.named_parameters())
        low = [(n, p) for n, p in named if "embed" in n or slow in n]
        high = [(n, p) for n, p in named if all(n != m for m, _ in low)]
        return _optimizer_groups(model, [{"params": low, "lr": 0.01}, {"params": high, "lr": 0.02}])

    saved_model, model = build_model(BASE), build_model(BASE)
    saved, opt = grouped(saved_model, "self_attn"), grouped(model, "mlp")
    for m, o in ((saved_model, saved), (model, opt)):
        o.zero_grad()
        m.loss(_batch(rank, world)).backward()
        o.step()
    path = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(path)
    dcp.save(saved.sharded_state_dict(), checkpoint_id=path[0])
    before = ([(g["kind"], g["lr"]) for g in opt.param_groups], opt.state_dict())
    out = {"sharded": _outcome(lambda: opt.load_sharded_state_dict(path[0])),
           "full": _outcome(lambda: opt.load_state_dict(saved.state_dict()))}
    out["unchanged"] = [(g["kind"], g["lr"]) for g in opt.param_groups] == before[0] and \
        _same(opt.state_dict(), before[1])
    out["kinds"] = ([g["kind"] for g in saved.param_groups], [g["kind"] for g in opt.param_groups])
    return out


def _same(a, b) -> bool:
    return same(a, b)


def state_dict_timeout_job(rank: int, world: int) -> dict:
    """Rank 0 alone calls each collective checkpoint call (the habit of saving on rank 0 only)."""
    import time

    model = build_model(BASE)
    opt = _optimizer(model, timeout_s=STEP_TIMEOUT_S)
    folder = _saved_together(opt, rank)
    calls = {"state_dict": opt.state_dict, "sharded_state_dict": opt.sharded_state_dict,
             "load_sharded_state_dict": lambda: opt.load_sharded_state_dict(folder)}
    if rank == 1:
        time.sleep((len(calls) + 2) * STEP_TIMEOUT_S)  # never joins the collectives in time
        return {"error": None}
    return _timed(calls)


def _saved_together(opt, rank: int) -> str:
    """A sharded checkpoint every rank saved into one folder (rank 0's), for the calls to load."""
    import tempfile

    import torch.distributed.checkpoint as dcp

    folder = [tempfile.mkdtemp() if rank == 0 else None]
    torch.distributed.broadcast_object_list(folder)
    dcp.save(opt.sharded_state_dict(), checkpoint_id=folder[0])
    return folder[0]


def _timed(calls: dict) -> dict:
    """Each call's outcome (`_outcome`) and how long it took, in order."""
    import time

    out = {}
    for call, fn in calls.items():
        start = time.monotonic()
        out[call] = _outcome(fn)
        out[call]["seconds"] = time.monotonic() - start
    return out


def one_rank_regroups_job(rank: int, world: int) -> dict:
    """Rank 1 alone removes a parameter from its last param group after a step, then every rank
    calls each collective checkpoint call (the peers used to wait out `timeout_s`, then blame a
    rank that did not call it)."""
    model = build_model(BASE)
    opt = _optimizer(model, timeout_s=STEP_TIMEOUT_S)
    opt.zero_grad()
    model.loss(_batch(rank, world)).backward()
    opt.step()
    folder = _saved_together(opt, rank)
    saved = opt.state_dict()
    if rank == 1:
        opt.param_groups[-1]["params"].pop()
    return _timed({"state_dict": opt.state_dict, "load_state_dict": lambda: opt.load_state_dict(saved),
                   "sharded_state_dict": opt.sharded_state_dict,
                   "load_sharded_state_dict": lambda: opt.load_sharded_state_dict(folder)})


JOBS = {
    "model zero_grad": ("train_job", (replace(BASE, zero_grad="model"),)),
    "model zero_grad sc": ("train_job", (replace(BASE, zero_grad="model", policy="sc"),)),
    "clip": ("train_job", (replace(BASE, clip_norm=0.05),)),
    "clip loose": ("train_job", (replace(BASE, clip_norm=1e6),)),
    "bf16": ("train_job", (replace(BASE, dtype="bf16"),)),
    "bf16 soap sc": ("train_job", (replace(BASE, dtype="bf16", optimizer="soap", policy="sc"),)),
    "bf16 state": ("train_job", (replace(BASE, dtype="bf16", master_weights=False),)),
    "bf16 checkpoint": ("bf16_checkpoint_job", ()),
    "cast": ("cast_after_build_job", ()),
    "skipped backward": ("skipped_backward_job", ()),
    "different init": ("different_init_job", ()),
    "group disagreement": ("group_disagreement_job", ()),
    "live groups": ("live_hyper_parameters_job", (BASE,)),
    "rank zero load": ("rank_zero_load_job", ()),
    "renormed embedding": ("renormed_embedding_job", ()),
    "foreign checkpoint": ("foreign_checkpoint_job", ()),
    "regrouped checkpoint": ("regrouped_checkpoint_job", ()),
    "one rank regroups": ("one_rank_regroups_job", ()),
    "state_dict timeout": ("state_dict_timeout_job", ()),
}


def jobs_worker(rank: int, world: int, names: list[str]) -> dict:
    """Every job in one process group; a job that leaves the group unusable comes last."""
    return {name: globals()[JOBS[name][0]](rank, world, *JOBS[name][1]) for name in names}


@pytest.fixture(scope="module")
def runs() -> dict:
    # the failing jobs run in a group of their own: a timed-out collective can poison a gloo group
    healthy = [n for n in JOBS if n not in ("skipped backward", "group disagreement", "state_dict timeout")]
    first = run_ranks(jobs_worker, DP, healthy, deadline_s=DEADLINE_S, collective_timeout_s=60)
    out = {name: [first[r][name] for r in range(DP)] for name in healthy}
    for name in ("skipped backward", "group disagreement", "state_dict timeout"):
        ranks = run_ranks(jobs_worker, DP, [name], deadline_s=DEADLINE_S, collective_timeout_s=60)
        out[name] = [ranks[r][name] for r in range(DP)]
    return out


# --- silent corruption, now caught or made right ------------------------------------------------


@pytest.mark.parametrize("case", ["model zero_grad", "model zero_grad sc"])
def test_model_zero_grad_trains_exactly_like_optimizer_zero_grad(runs, case):
    spec = replace(BASE, zero_grad="model", policy="sc" if case.endswith("sc") else "canzona")
    want = emulate(spec, DP)
    for r, out in enumerate(runs[case]):
        assert compare(out["params"], want)["bit_identical"], f"rank {r}"


@pytest.mark.parametrize("case", ["bf16", "bf16 soap sc", "bf16 state"])
def test_bf16_models_equal_the_same_kernels_in_one_process(runs, case):
    """fp32 masters, fp32 reduction and fp32 state by default; master_weights=False keeps bf16."""
    spec = dict(JOBS[case][1][0].__dict__)
    want = emulate(TrainSpec(**spec), DP)
    for r, out in enumerate(runs[case]):
        assert all(p.dtype == torch.bfloat16 for p in out["params"].values())
        assert compare(out["params"], want)["bit_identical"], f"rank {r}"
    if case == "bf16":  # the masters matter: keeping bf16 state trains differently
        assert not compare(runs["bf16"][0]["params"], runs["bf16 state"][0]["params"])["bit_identical"]


def test_bf16_checkpoint_carries_fp32_masters(runs):
    for r, out in enumerate(runs["bf16 checkpoint"]):
        assert out["master dtypes"] == ["torch.float32"] and out["with master"] == len(out["resumed"])
        assert compare(out["resumed"], out["uninterrupted"])["bit_identical"], f"rank {r}"


def test_casting_the_model_after_building_is_an_error(runs):
    for out in runs["cast"]:
        assert out["canzona"] and "no longer lives in the optimizer's buffers" in out["message"], out


def test_a_rank_that_skips_backward_is_named_on_every_rank(runs):
    for out in runs["skipped backward"]:
        assert out["canzona"] and "rank(s) [1] ran no backward" in out["message"], out


def test_ranks_with_different_initial_weights_are_caught_at_construction(runs):
    for out in runs["different init"]:
        assert out["canzona"] and "disagree on the initial parameters" in out["message"], out


def test_weights_loaded_on_one_rank_after_building_are_one_error_on_every_rank_before_any_update(runs):
    for r, out in enumerate(runs["rank zero load"]):
        one = out["one rank"]
        assert one["canzona"] and "disagree on the loaded parameters" in one["message"], one
        assert "broadcast_from_rank0" in one["message"] and out["untouched"], (r, out)
        # loaded on every rank: one step from the loaded weights, as a model built from them takes
        assert out["every rank"]["error"] is None and out["as if built from them"], (r, out)
        # between clip_grad_norm_() and step(): step()'s recheck carries the mark
        clipped = out["after clip"]
        assert clipped["canzona"] and "disagree on the loaded parameters" in clipped["message"], clipped
        assert out["untouched after clip"] or r == 0, (r, out)


def test_weights_written_in_place_on_one_rank_are_one_error_on_every_rank_before_any_update(runs):
    """`p.copy_(...)` without load_state_dict (a resume of the user's own, an EMA swap) on rank 0
    alone: its version counters mark the step as a load does, and the ranks compare their weights.
    Written on every rank alike: one comparison, and the step trains the written weights exactly.
    The optimizer's own writes (steps, a clip) compare nothing."""
    for r, out in enumerate(runs["rank zero load"]):
        assert all(o["error"] is None for o in out["plain steps"]) and out["compared in plain steps"] == [], (r, out)
        one = out["written on one rank"]
        assert one["canzona"] and "disagree on the loaded parameters" in one["message"], one
        assert "written in place" in one["message"] and out["untouched when written"], (r, out)
        assert out["written on every rank"]["error"] is None and out["as if built from the written"], (r, out)
        assert out["compared"] == ["loaded", "loaded"], (r, out)


def test_an_embedding_renormalised_in_its_forward_trains_as_before_without_a_comparison(runs):
    """`nn.Embedding(max_norm=...)` writes the rows each rank looks up in its forward (under no_grad):
    not a load. Before: every step compared the weights, which differ there, and raised 'ranks
    disagree on the loaded parameters'. Now: no comparison, and the weights bit for bit those of
    the same steps without the record of in-place writes (the step's all-gather puts each row's
    owner's values back), alike on both ranks."""
    outs = runs["renormed embedding"]
    for r, out in enumerate(outs):
        assert out["outcome"]["error"] is None and out["compared"] == [], (r, out["outcome"])
        assert out["before"]["error"] is None and out["as before"], r
    assert _same(outs[0]["weights"], outs[1]["weights"])
    for r, out in enumerate(outs):
        # loaded on every rank: the comparison leaves the renormalised weight out (before: it
        # differed by the forward's rows, 'ranks disagree on the loaded parameters')
        assert out["loaded on every rank"]["error"] is None, (r, out["loaded on every rank"])
        # written on one rank: one error on every rank, naming the parameter
        one = out["written on one rank"]
        assert one["canzona"] and "disagree on the loaded parameters" in one["message"], (r, one)
        assert "the first that differs: 'head.bias'" in one["message"], (r, one)
        # the renormalised embedding alone loaded on one rank: one error on every rank, by its mark
        embed = out["embedding loaded on one rank"]
        assert embed["canzona"] and "max_norm" in embed["message"], (r, embed)


def test_ranks_disagreeing_on_hyper_parameters_fail_before_updating(runs):
    for out in runs["group disagreement"]:
        assert out["canzona"] and "disagree on the hyper-parameters in param_groups" in out["message"], out


def test_a_checkpoint_of_another_model_or_optimizer_is_refused(runs):
    for out in runs["foreign checkpoint"]:
        other, unknown, opt = out["other model"], out["unknown parameter"], out["other optimizer"]
        assert other["error"] == "PlanError" and "checkpoint is of model" in other["message"], other
        assert "lm_head.weight" in other["message"], other  # says what differs
        assert unknown["error"] == "PlanError" and "model.bogus.weight" in unknown["message"], unknown
        assert opt["error"] == "PlanError" and "checkpoint is for soap" in opt["message"], opt


def test_a_checkpoint_whose_groups_hold_other_parameters_is_refused_by_every_loader(runs):
    for out in runs["regrouped checkpoint"]:
        assert out["kinds"][0] == out["kinds"][1], out["kinds"]  # only the members differ
        for how in ("sharded", "full"):
            assert out[how]["error"] == "PlanError", (how, out[how])
            assert "hold other parameters" in out[how]["message"] and "model.layers." in out[how]["message"], out[how]
        assert out["unchanged"]


@pytest.mark.parametrize("call", ["state_dict", "sharded_state_dict", "load_sharded_state_dict"])
def test_checkpoint_calls_are_bounded_by_the_optimizer_timeout(runs, call):
    """Before, the sharded calls waited for the process group's timeout (30 minutes by default),
    then raised gloo's RuntimeError (or got it at once once the peer exited)."""
    out = runs["state_dict timeout"][0][call]
    assert out["canzona"] and "timed out" in out["message"], out
    assert f"{call}() is collective: call it on every rank" in out["message"] and "\n" not in out["message"], out
    assert out["seconds"] < 2 * STEP_TIMEOUT_S


# --- what real loops need ----------------------------------------------------------------------


def test_hyper_parameters_in_param_groups_are_live(runs):
    spec = replace(BASE, matrix_config={"momentum": 0.8, "weight_decay": 0.0}, adamw_config={"weight_decay": 0.0})
    want = emulate(spec, DP)
    for r, params in enumerate(runs["live groups"]):
        assert compare(params, want)["bit_identical"], f"rank {r}"
    assert not compare(runs["live groups"][0], emulate(BASE, DP))["bit_identical"]  # the edits mattered


def test_clip_grad_norm_uses_the_global_norm_of_reduced_gradients(runs):
    spec = replace(BASE, clip_norm=0.05)
    norms = [out["norms"] for out in runs["clip"]]
    assert norms[0] == norms[1] and len(norms[0]) == BASE.steps  # every rank clips alike
    model = build_model(BASE)
    grads, _ = global_gradients(model, BASE, global_batches(BASE, 256)[0], DP)
    first = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
    assert norms[0][0] == pytest.approx(first, rel=1e-6)
    assert norms[0][0] > 0.05  # so it really clipped
    want = emulate(spec, DP)
    for out in runs["clip"]:
        assert compare(out["params"], want)["max_rel_diff"] < 1e-5
    unclipped = emulate(BASE, DP)
    for out in runs["clip loose"]:  # a bound above the norm changes nothing, bit for bit
        assert compare(out["params"], unclipped)["bit_identical"]


@pytest.mark.parametrize("kwargs, needle", [
    ({"matrix_config": {"adjust_lr_fn": 3}}, "adjust_lr_fn must be a string"),
    ({"matrix_config": {"lr": float("nan")}}, "lr must be a finite number"),
    ({"adamw_config": {"betas": (0.9, 1.5)}}, "betas must lie in [0, 1)"),
    ({"matrix_config": {"momentum": 1.0}}, "momentum must be"),
    ({"timeout_s": 0}, "timeout_s must be a positive"),
    ({"timeout_s": float("inf")}, "timeout_s must be a positive"),
    ({"optimizer": "adam"}, "unknown optimizer"),
    ({"reduce_scatter": "nccl"}, "unknown reduce_scatter 'nccl'; choose one of native, exact, loops, padded"),
])
def test_bad_configuration_fails_before_any_collective(kwargs, needle):
    """No process group exists here: reaching a collective would raise something else."""
    model = build_model(BASE)
    with pytest.raises(SpecError, match=needle.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        _optimizer(model, **kwargs)


def test_frozen_parameter_given_to_the_optimizer_is_one_error_before_any_collective():
    model = build_model(BASE)
    model.model.norm.weight.requires_grad_(False)  # frozen, but still in model.named_parameters()
    with pytest.raises(SpecError, match="'model.norm.weight' does not require gradients: leave frozen"):
        _optimizer(model)


def test_a_model_on_the_meta_device_is_one_error_naming_to_empty_before_any_collective():
    # torchtitan's meta-device init, the optimizer built before to_empty(): before, the weights'
    # checksum raised NotImplementedError (a traceback), and one rank alone left its peers waiting
    model = build_model(BASE).to("meta")
    with pytest.raises(SpecError, match="is on the meta device .* model.to_empty"):
        _optimizer(model)


def test_bad_parameter_groups_fail_before_any_collective():
    model = build_model(BASE)
    pairs = list(model.named_parameters())
    with pytest.raises(SpecError, match="no optimizer of its parameters has hyper-parameter"):
        _optimizer_groups(model, [{"params": pairs, "momentun": 0.9}])
    with pytest.raises(SpecError, match="momentum must be"):
        _optimizer_groups(model, [{"params": pairs, "momentum": 2.0}])
    with pytest.raises(SpecError, match=r"\(name, parameter\) pairs"):
        _optimizer_groups(model, [{"params": [p for _, p in pairs]}])
    with pytest.raises(PlanError, match="not given"):
        _optimizer_groups(model, [{"params": pairs[1:]}])


def test_a_checkpoint_call_after_one_rank_edited_its_param_groups_is_one_error_on_every_rank(runs):
    """Rank 1 alone edited param_groups' membership: every rank's save or load is the same one
    error at once. Before: rank 1 raised before the collective, and its peer waited out timeout_s,
    then said state_dict() is collective / the load check timed out."""
    for call in ("state_dict", "load_state_dict", "sharded_state_dict", "load_sharded_state_dict"):
        got = [runs["one rank regroups"][r][call] for r in range(DP)]
        assert all(o["canzona"] and "['params'] was changed after construction" in o["message"] for o in got), got
        assert got[0]["message"] == got[1]["message"]
        assert all("timed out" not in o["message"] for o in got)
        assert all(o["seconds"] < STEP_TIMEOUT_S for o in got), got


def test_a_model_of_mixed_dtypes_is_one_error_naming_the_cast(one_rank):
    """A layer kept in another dtype (an fp32 norm in a bf16 model, as transformers'
    `_keep_in_fp32_modules` leaves it): the buffers hold one dtype; the error names both
    parameters and the way out."""
    model = build_model(BASE)
    model.model.norm.to(torch.bfloat16)
    with pytest.raises(SpecError, match=r"model\.norm\.weight is torch\.bfloat16 .* cast the model to one dtype "
                                        r"\(model\.to\(torch\.bfloat16\)\) before building the optimizer"):
        _optimizer(model)


@pytest.mark.parametrize("how", ["head", "block"])
def test_a_module_replaced_while_the_old_one_lives_on_is_one_error_before_any_update(one_rank, how):
    """A module swapped for a new one after building the optimizer (a new head, a block replaced),
    the old one kept alive, by a reference cycle (gc has not run yet) or a reference of the
    user's: the old module still holds the parameters the optimizer steps, but the model trains the
    new one's. One error naming the link, nothing updated; before, it trained silently (the new
    module's parameters never stepped), and was one error only when the old module was freed at
    once. A module wrapped in place (activation checkpointing after building) still trains."""
    import gc

    from torch import nn

    from canzona.errors import CanzonaError
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters
    from canzona.spec import ModelSpec

    class Wrapped(nn.Module):  # stands in for a checkpoint wrapper
        def __init__(self, inner: nn.Module):
            super().__init__()
            self._checkpoint_wrapped_module = inner

        def forward(self, x):
            return self._checkpoint_wrapped_module(x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 4))
    opt = DistributedOptimizer(list(named_parameters(model)), ModelSpec.from_module(model))
    x = torch.randn(3, 8)
    model[0] = Wrapped(model[0])  # wrapped in place: nothing replaced
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    old = model[1] if how == "head" else model[0]
    old.cycle = [old]  # freed by gc's next collection only
    model[1 if how == "head" else 0] = nn.Linear(8, 4) if how == "head" else nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    del old
    gc.disable()
    try:
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        with pytest.raises(CanzonaError, match=r"was replaced after the optimizer was built \(Sequential\.(1|0) now holds "
                                               r"another module"):
            opt.step()
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    finally:
        gc.enable()


def test_a_cast_under_torchs_swap_flag_is_one_error_naming_the_cast(one_rank):
    """`model.to(torch.bfloat16)` after building the optimizer under
    `torch.__future__.set_swap_module_params_on_conversion(True)` (torch swaps each Parameter's
    contents, its gradient hooks with them: the optimizer's never run): one CanzonaError naming
    the cast at `step()`, nothing updated (before: torch's RuntimeError 'attempting to assign a
    gradient with dtype float to a tensor with grad_dtype BFloat16' from inside the step)."""
    from torch import nn

    from canzona.errors import CanzonaError
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters
    from canzona.spec import ModelSpec

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    opt = DistributedOptimizer(list(named_parameters(model)), ModelSpec.from_module(model))
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(torch.bfloat16)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    model(torch.randn(3, 8, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    with pytest.raises(CanzonaError, match=r"no longer lives in the optimizer's buffers: the model was moved, cast"):
        opt.step()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


class _Layers(torch.nn.Module):
    def __init__(self, k: int = 3):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(k))
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def _layers_optimizer():
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters
    from canzona.spec import ModelSpec

    torch.manual_seed(0)
    model = _Layers()
    return model, DistributedOptimizer(list(named_parameters(model)), ModelSpec.from_module(model))


@pytest.mark.parametrize("how", ["list rebuilt", "same parameters in a new module"])
def test_modules_moved_or_rewrapped_with_their_parameters_still_train(one_rank, how):
    """Modules kept in their places under new parents after building the optimizer, the old
    parents still alive: a ModuleList rebuilt from the old one (kept referenced), a module
    replaced by a new one holding the same Parameter objects at the same path (torchao's
    Float8Linear.from_float) while the old one lives. Every parameter is still found by its name,
    so the step runs and updates them all (before: 'now holds another module' although nothing
    was lost)."""
    from torch import nn

    model, opt = _layers_optimizer()
    keep = []
    if how == "list rebuilt":
        old = model.layers
        model.layers = nn.ModuleList(list(old))
        keep.append(old)
    else:
        old = model.layers[1]
        new = nn.Linear(8, 8)
        new.weight, new.bias = old.weight, old.bias
        model.layers[1] = new
        keep.append(old)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(3, 8)).pow(2).mean().backward()
        opt.step()
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_layer_put_in_anothers_place_is_one_error_saying_its_parameters_left_the_model(one_rank):
    """`layers[0] = layers[1]` after building the optimizer, the old layer 0 kept: layer 0's
    parameters are in the model no longer. One error saying so (not 'was replaced'), nothing
    updated."""
    from canzona.errors import CanzonaError

    model, opt = _layers_optimizer()
    old = model.layers[0]
    model.layers[0] = model.layers[1]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    model(torch.randn(3, 8)).pow(2).mean().backward()
    with pytest.raises(CanzonaError, match=r"parameter 'layers\.0\.(weight|bias)' is no longer in the model "
                                           r"\(ModuleList\.0 now holds another of its modules\)"):
        opt.step()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    del old


def _one_step(model, opt):
    opt.zero_grad()
    model(torch.randn(3, 8)).pow(2).mean().backward()
    opt.step()


def test_two_layers_swapped_are_one_error_saying_they_moved(one_rank):
    """Two layers swapped after building the optimizer: every parameter still trains, but under
    another name than the optimizer's state (and its checkpoints) is keyed by, so a resume would
    pair layer 1's moments with layer 0's weights. One error saying the parameter moved, nothing
    updated (before: accepted, and a checkpoint's state silently mismatched on resume)."""
    from canzona.errors import CanzonaError

    model, opt = _layers_optimizer()
    model.layers[0], model.layers[1] = model.layers[1], model.layers[0]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(CanzonaError, match=r"parameter 'layers\.0\.weight' moved in the model after the optimizer "
                                           r"was built \(ModuleList\.0 now holds another of its modules\): its "
                                           r"optimizer state"):
        _one_step(model, opt)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("zeroing", ["opt.zero_grad()", "model.zero_grad(set_to_none=False)"])
@pytest.mark.parametrize("how", ["del and insert", "_modules written"])
def test_a_module_replaced_without_a_registration_is_one_error(one_rank, how, zeroing):
    """A module replaced by a path that registers no module (`ModuleList.insert` and `del`,
    `model._modules[...] = new`), after a
    clean step, the old module kept: its parameters get no gradient, which sends the check to walk
    the links. One error, nothing updated (before: the walk waited for a registration, and the
    new module trained silently, never stepped). Each step zeroing with `model.zero_grad(
    set_to_none=False)`, which no longer reaches the old module's gradients, the error is still
    the replacement (before 2026-12-03: 'still the last step's', which it blamed on a missing
    zero_grad())."""
    from torch import nn

    from canzona.errors import CanzonaError

    model, opt = _layers_optimizer()

    def _one_step(model, opt):
        if zeroing == "opt.zero_grad()":
            opt.zero_grad()
        else:
            model.zero_grad(set_to_none=False)
        model(torch.randn(3, 8)).pow(2).mean().backward()
        opt.step()

    _one_step(model, opt)
    if how == "del and insert":
        old = model.layers[1]
        del model.layers[1]
        model.layers.insert(1, nn.Linear(8, 8))
        where = r"'layers\.1\.weight' was replaced .*ModuleList\.1 now holds another module"
    else:
        old = model.head
        model._modules["head"] = nn.Linear(8, 4)
        where = r"'head\.weight' was replaced .*_Layers\.head now holds another module"
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(CanzonaError, match=where):
        _one_step(model, opt)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    del old


@pytest.mark.parametrize("keeper", ["backup list", "teacher sharing a block"])
def test_a_layer_replaced_while_another_live_module_holds_the_old_one_is_one_error(one_rank, keeper):
    """A live module outside the model holding the old layer from before construction (a backup
    `ModuleList` of the layers, a teacher model sharing a block), then the layer replaced in the
    model: the old layer's parameters are still in *a* module tree, but not where the optimizer's
    names say. One error, nothing updated (before: accepted, the backup counted as a root of the
    model, and the new layer never stepped)."""
    from torch import nn

    from canzona.errors import CanzonaError
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters
    from canzona.spec import ModelSpec

    torch.manual_seed(0)
    model = _Layers()
    keep = nn.ModuleList(list(model.layers)) if keeper == "backup list" else \
        nn.Sequential(nn.Linear(8, 8), model.layers[1])
    opt = DistributedOptimizer(list(named_parameters(model)), ModelSpec.from_module(model))
    _one_step(model, opt)
    model.layers[1] = nn.Linear(8, 8)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(CanzonaError, match=r"'layers\.1\.weight' was replaced .*ModuleList\.1 now holds another module"):
        _one_step(model, opt)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    del keep


def test_the_module_links_are_walked_only_after_a_module_was_registered(one_rank, monkeypatch):
    """The links from the model down to the parameters' holders are walked at a step only when a
    module was registered somewhere since the last walk (one process-wide hook's count); a step of
    a model whose modules stay put walks none. One layer swapped for a new one is still caught."""
    from torch import nn

    from canzona.errors import CanzonaError
    from canzona.runtime import param_gather

    walks = []
    walk = param_gather.links_changed
    monkeypatch.setattr(param_gather, "links_changed", lambda *a: walks.append(1) or walk(*a))
    model, opt = _layers_optimizer()
    handles = len(param_gather._registration_hook)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(3, 8)).pow(2).mean().backward()
        opt.step()
    assert len(walks) == 1  # the first step's
    _layers_optimizer()
    assert len(param_gather._registration_hook) == handles == 1  # one hook, whatever the optimizers
    old = model.layers[2]
    model.layers[2] = nn.Linear(8, 8)
    opt.zero_grad()
    model(torch.randn(3, 8)).pow(2).mean().backward()
    with pytest.raises(CanzonaError, match=r"ModuleList\.2 now holds another module"):
        opt.step()
    assert len(walks) == 2
    del old


class _FedBlock(torch.nn.Module):
    """A block whose forward calls `fed` only: `spare`'s parameters never get a gradient."""

    def __init__(self, fed=None):
        super().__init__()
        self.fed = fed if fed is not None else torch.nn.Linear(8, 8)
        self.spare = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.fed(x)


class _NeverFed(_Layers):
    """`_Layers` with a block holding an unused module, and an unused module of its own: their
    parameters, kept in the optimizer, never get a gradient."""

    def __init__(self):
        super().__init__()
        self.block = _FedBlock()
        self.spare = torch.nn.Linear(8, 8)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(self.block(x))


@pytest.mark.parametrize("how", ["two layers swapped through _modules", "a block made before training put in",
                                 "a layer made before training inserted"])
def test_a_module_moved_or_replaced_beside_a_parameter_that_never_gets_a_gradient_is_one_error(one_rank, how):
    """A model holding parameters that never get a gradient (unused modules', kept in the
    optimizer), its modules then moved or replaced by paths that register nothing, the new
    modules made before the training started (no registration since): two layers swapped through
    `_modules`, the block replaced by one made before training around the same `fed` layer,
    `ModuleList.insert` of a layer made before training. Some parameter got no gradient, so the
    step walks the links: one error, nothing updated (between 2026-12-03 and its revert the walk
    came only when the set of parameters without a gradient changed, which none of these
    changes, and the model trained on silently: the swapped layers' states under each other's
    names, the new block's and layer's parameters never stepped)."""
    from torch import nn

    from canzona.errors import CanzonaError
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters
    from canzona.spec import ModelSpec

    torch.manual_seed(0)
    model = _NeverFed()
    opt = DistributedOptimizer(list(named_parameters(model)), ModelSpec.from_module(model))
    made = _FedBlock(fed=model.block.fed) if how == "a block made before training put in" else nn.Linear(8, 8)
    for _ in range(3):
        _one_step(model, opt)
    old = None
    if how == "two layers swapped through _modules":
        layers = model.layers._modules
        layers["0"], layers["1"] = layers["1"], layers["0"]
        where = r"'layers\.0\.weight' moved in the model .*ModuleList\.0 now holds another of its modules"
    elif how == "a block made before training put in":
        old = model.block
        model._modules["block"] = made
        where = r"'block\.spare\.weight' was replaced .*_NeverFed\.block now holds another module"
    else:
        model.layers.insert(0, made)
        where = r"'layers\.0\.weight' moved in the model .*ModuleList\.0 now holds another"
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(CanzonaError, match=where):
        _one_step(model, opt)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    del old


@pytest.mark.parametrize("how", ["cast under the swap flag", "data moved, gradient set by hand"])
def test_a_parameter_out_of_the_buffers_is_reported_by_the_step_check_not_at_a_buckets_launch(one_rank, how):
    """A parameter no longer in the optimizer's buffers with a gradient no hook of ours took (the
    swap flag's cast; `.data` assigned, then `.grad` set by hand): the error comes from the step's
    check, which every rank runs together, not from taking the gradients in before a bucket's
    launch (one rank raising there left its peers waiting in the collective until the timeout).
    One CanzonaError, nothing updated."""
    from torch import nn

    from canzona.errors import CanzonaError
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters
    from canzona.spec import ModelSpec

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    opt = DistributedOptimizer(list(named_parameters(model)), ModelSpec.from_module(model))
    dtype = torch.float32
    opt.zero_grad()
    if how == "cast under the swap flag":
        dtype = torch.bfloat16
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            model.to(dtype)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(False)
        model(torch.randn(3, 8, dtype=dtype)).float().pow(2).mean().backward()
    else:
        model(torch.randn(3, 8)).pow(2).mean().backward()
        model[0].weight.data = model[0].weight.detach().clone()
        model[0].weight.grad = torch.ones_like(model[0].weight)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(CanzonaError, match=r"no longer lives in the optimizer's buffers") as raised:
        opt.step()
    assert not any(entry.name == "_take_all" for entry in raised.traceback)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_layer_replaced_in_a_rebuilt_list_after_the_old_list_is_freed_is_one_error(one_rank):
    """The links follow a module moved with its parameters: a ModuleList rebuilt from the old one
    (accepted at the next step), the old list freed, then a layer of the new list replaced while
    the old layer lives: one error, nothing updated (before: the links still ran through the
    freed list, and the new layer trained silently, never stepped)."""
    import gc

    from torch import nn

    from canzona.errors import CanzonaError

    model, opt = _layers_optimizer()
    model.layers = nn.ModuleList(list(model.layers))
    gc.collect()
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(3, 8)).pow(2).mean().backward()
        opt.step()
    old = model.layers[1]
    model.layers[1] = nn.Linear(8, 8)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    model(torch.randn(3, 8)).pow(2).mean().backward()
    with pytest.raises(CanzonaError, match=r"parameter 'layers\.1\.(weight|bias)' was replaced .*ModuleList\.1 now holds "
                                           r"another module"):
        opt.step()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    del old


def test_a_parameter_out_of_the_buffers_with_its_hook_is_reported_by_the_step_check_not_in_backward(one_rank):
    """`.data` assigned after the optimizer was built: the parameter keeps the optimizer's hook but
    no longer lives in its buffers. The hook (`_arrive`) no longer raises inside backward (one rank
    raising there left its peers waiting in the collective until the timeout): backward finishes,
    launching no reduction of that parameter's bucket, and the step's check, which every rank runs
    together, is the one CanzonaError, nothing updated."""
    from torch import nn

    from canzona.errors import CanzonaError
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters
    from canzona.spec import ModelSpec

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    opt = DistributedOptimizer(list(named_parameters(model)), ModelSpec.from_module(model))
    opt.zero_grad()
    model[0].weight.data = model[0].weight.detach().clone()
    model(torch.randn(3, 8)).pow(2).mean().backward()  # raised here before
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(CanzonaError, match=r"no longer lives in the optimizer's buffers"):
        opt.step()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


class _Inner(torch.nn.Module):
    """A wrapper keeping its module under `.inner`: not a recognised wrapper component, so the
    parameters' names change (`layers.0.inner.weight`)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


class _Checkpointed(_Inner):
    """A wrapper under the checkpoint wrapper's component: the canonical names stay."""

    def __init__(self, inner: torch.nn.Module):
        torch.nn.Module.__init__(self)
        self._checkpoint_wrapped_module = inner

    def forward(self, x):
        return self._checkpoint_wrapped_module(x)


@pytest.mark.parametrize("wrapper", ["renaming", "checkpoint"])
@pytest.mark.parametrize("how", ["rebuilt, old list kept", "rebuilt, old list in a cycle", "rebuilt, old list freed",
                                 "in place"])
def test_layers_wrapped_after_construction_get_one_verdict_whatever_gc_did(one_rank, how, wrapper):
    """Every layer wrapped after building the optimizer, in a rebuilt ModuleList (the old list kept
    by the user, in a reference cycle gc has not collected, or freed) or in place: the verdict is the
    construction names' whatever became of the old list. A wrapper that renames the parameters
    (`.inner`) is one error saying they moved (the optimizer state is keyed by the construction
    names), nothing updated; the checkpoint wrapper's component is no rename, and they train.
    Before: a rebuild with the old list freed, and any in-place wrap, was accepted (the renamed
    model trained on); with the old list alive it was 'was replaced'."""
    import gc

    from torch import nn

    from canzona.errors import CanzonaError

    model, opt = _layers_optimizer()
    _one_step(model, opt)
    wrap = _Inner if wrapper == "renaming" else _Checkpointed
    keep = []
    gc.disable()
    try:
        if how == "in place":
            for i in range(len(model.layers)):
                model.layers[i] = wrap(model.layers[i])
        else:
            old = model.layers
            model.layers = nn.ModuleList([wrap(layer) for layer in old])
            if how == "rebuilt, old list kept":
                keep.append(old)
            elif how == "rebuilt, old list in a cycle":
                old.cycle = [old]
            del old
            if how == "rebuilt, old list freed":
                gc.collect()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        if wrapper == "checkpoint":
            for _ in range(2):
                _one_step(model, opt)
            assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())
            return
        where = r"ModuleList\.0" if how == "in place" else r"_Layers\.layers"
        with pytest.raises(CanzonaError, match=rf"parameter 'layers\.0\.weight' moved in the model after the optimizer "
                                               rf"was built \({where} now holds another module\): its optimizer state"):
            _one_step(model, opt)
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    finally:
        gc.enable()


class _TiedLM(torch.nn.Module):
    """An embedding, two layers and a head tied to the embedding (`lm_head.weight is embed.weight`)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.lm_head = torch.nn.Linear(8, 16, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.lm_head(x)


def _replace_head(model, old_head: str, tie: bool) -> None:
    """`model.lm_head` replaced by a new head, tied to the embedding again (`tie`) or not; the old
    head freed at once, kept in a reference cycle gc has not collected, or kept by the user."""
    from torch import nn

    old = model.lm_head
    if old_head == "in a cycle":
        old.cycle = [old]
    model.lm_head = nn.Linear(8, 16, bias=False)
    if tie:
        model.lm_head.weight = model.embed.weight
    if old_head == "kept":
        model.kept_outside = [old]  # a plain list: no module of the model's tree
    del old


def _tied_lm_optimizer():
    from canzona.runtime import DistributedOptimizer
    from canzona.runtime.modules import named_parameters
    from canzona.spec import ModelSpec

    torch.manual_seed(0)
    model = _TiedLM()
    return model, DistributedOptimizer(list(named_parameters(model)), ModelSpec.from_module(model))


def _lm_step(model, opt, tokens):
    opt.zero_grad()
    model(tokens).pow(2).mean().backward()
    opt.step()


@pytest.mark.parametrize("old_head", ["freed", "in a cycle", "kept"])
def test_a_new_head_untied_from_the_embedding_is_one_error_whatever_gc_did(one_rank, old_head):
    """A model built with its head tied to the embedding, the head then replaced by a new untied
    one (`model.lm_head = nn.Linear(...)`): the model trains the new head's weight, which this
    optimizer never steps, and no longer trains the embedding through the head. One error saying
    'embed.weight' was replaced, nothing updated, whatever became of the old head. Before: an error
    only when the old head was freed at once; kept alive (a cycle, the user's reference) every
    optimizer parameter was still found by its name, and it trained silently."""
    import gc

    from canzona.errors import CanzonaError

    model, opt = _tied_lm_optimizer()
    tokens = torch.randint(0, 16, (3, 5))
    _lm_step(model, opt, tokens)
    gc.disable()
    try:
        _replace_head(model, old_head, tie=False)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(CanzonaError, match=r"parameter 'embed\.weight' was replaced after the optimizer was built"):
            _lm_step(model, opt, tokens)
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    finally:
        gc.enable()


class _Scaled(torch.nn.Linear):
    """A layer replaced by one holding the old layer's weight and bias plus a new `scale` Parameter."""

    def __init__(self, old: torch.nn.Linear):
        super().__init__(8, 8)
        self.weight, self.bias = old.weight, old.bias
        self.scale = torch.nn.Parameter(torch.ones(8))

    def forward(self, x):
        return super().forward(x) * self.scale


@pytest.mark.parametrize("old", ["freed", "in a cycle"])
@pytest.mark.parametrize("change", ["head in a Sequential", "head tied again with a bias", "layer scaled"])
def test_a_module_replaced_by_one_holding_its_parameters_and_new_ones_is_one_error(one_rank, change, old):
    """A module replaced by one holding the optimizer's Parameters (by their names, or tied again)
    plus new trainable ones (the head in an `nn.Sequential`: `lm_head.0.weight`; a head tied to the
    embedding again but with a bias: `lm_head.bias`; a layer wrapped as `_Scaled` with a new `scale`):
    the model trains the new ones, which this optimizer never steps. One error naming the new name
    and the optimizer's parameter nearest it, nothing updated, whatever became of the old module.
    Before: accepted (every optimizer parameter was found by its name), the new ones never stepped."""
    import gc

    from torch import nn

    from canzona.errors import CanzonaError

    model, opt = _tied_lm_optimizer()
    tokens = torch.randint(0, 16, (3, 5))
    _lm_step(model, opt, tokens)
    gc.disable()
    try:
        if change == "layer scaled":
            kept = model.layers[0]
            model.layers[0] = _Scaled(kept)
            nearest, new = "layers.0.weight", "layers.0.scale"
        else:
            kept = model.lm_head
            if change == "head in a Sequential":
                model.lm_head = nn.Sequential(nn.Linear(8, 16, bias=False))
                new = "lm_head.0.weight"
            else:
                model.lm_head = nn.Linear(8, 16, bias=True)
                model.lm_head.weight = model.embed.weight
                new = "lm_head.bias"
            nearest = "embed.weight"
        if old == "in a cycle":
            kept.cycle = [kept]
        del kept
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(CanzonaError, match=rf"parameter '{nearest}' was replaced after the optimizer was built "
                                               rf"\(.*'{new}'"):
            _lm_step(model, opt, tokens)
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    finally:
        gc.enable()


@pytest.mark.parametrize("old_head", ["freed", "in a cycle", "in a cycle, collected after a step"])
def test_a_new_head_tied_to_the_embedding_again_trains_as_before_whatever_gc_did(one_rank, old_head):
    """The tied head replaced by a new one tied to the embedding again: the model trains what it
    trained, every optimizer parameter where its name says, so the steps are bit for bit those of
    the untouched model, whatever became of the old head (gc run between two steps too). Before:
    the old head freed, one error ('embed.weight' was replaced: the module that held it was
    gone); kept alive in a cycle, accepted until gc collected it, then the same error at the next
    step."""
    import gc

    model, opt = _tied_lm_optimizer()
    reference, ref_opt = _tied_lm_optimizer()
    tokens = torch.randint(0, 16, (3, 5))
    _lm_step(model, opt, tokens)
    _lm_step(reference, ref_opt, tokens)
    gc.disable()
    try:
        _replace_head(model, "freed" if old_head == "freed" else "in a cycle", tie=True)
        for i in range(3):
            _lm_step(model, opt, tokens)
            _lm_step(reference, ref_opt, tokens)
            if i == 0 and old_head.endswith("after a step"):
                gc.collect()
    finally:
        gc.enable()
    assert dict(reference.named_parameters()).keys() == dict(model.named_parameters()).keys()
    assert all(torch.equal(p, dict(reference.named_parameters())[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("old_head", ["freed", "in a cycle"])
def test_a_head_tied_again_then_untied_by_a_new_parameter_is_one_error_whatever_gc_did(one_rank, old_head):
    """The tied head replaced by a new one tied to the embedding again (accepted, a step trains),
    then untied by a Parameter assigned to it (`model.lm_head.weight = nn.Parameter(...)`: no module
    registered, the embedding still gets a gradient, so no walk of the links): the model trains the
    new weight, which this optimizer never steps. One error, nothing updated, whatever became of the
    old head. Before: with the old head alive in a cycle the accepted walk moved the links but kept
    the old head as the embedding's holder (it still held it), so the untied head trained silently."""
    import gc

    from torch import nn

    from canzona.errors import CanzonaError

    model, opt = _tied_lm_optimizer()
    tokens = torch.randint(0, 16, (3, 5))
    _lm_step(model, opt, tokens)
    gc.disable()
    try:
        _replace_head(model, old_head, tie=True)
        _lm_step(model, opt, tokens)
        model.lm_head.weight = nn.Parameter(model.embed.weight.detach().clone())
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(CanzonaError, match=r"parameter 'embed\.weight' was replaced after the optimizer was built "
                                               r"\(.*'lm_head\.weight'"):
            _lm_step(model, opt, tokens)
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    finally:
        gc.enable()


@pytest.mark.parametrize("old_head", ["freed", "in a cycle"])
def test_a_tied_head_replaced_by_a_frozen_one_trains_until_it_is_unfrozen(one_rank, old_head):
    """The tied head replaced by a new frozen one (`requires_grad_(False)`, the embedding's values):
    the model trains what the optimizer steps (the embedding, the layers), so the steps run and
    leave the frozen head as it was; the head unfrozen later (`requires_grad_(True)`: no module
    registered, the embedding still gets a gradient) would train a tensor this optimizer never
    steps: one error then, nothing updated, whatever became of the old head. Before: refused at
    once, saying the model would train a tensor this optimizer never steps (untrue while frozen)."""
    import gc

    from torch import nn

    from canzona.errors import CanzonaError

    model, opt = _tied_lm_optimizer()
    tokens = torch.randint(0, 16, (3, 5))
    _lm_step(model, opt, tokens)
    gc.disable()
    try:
        old = model.lm_head
        if old_head == "in a cycle":
            old.cycle = [old]
        model.lm_head = nn.Linear(8, 16, bias=False).requires_grad_(False)
        with torch.no_grad():
            model.lm_head.weight.copy_(model.embed.weight)
        del old
        head = model.lm_head.weight.detach().clone()
        embed = model.embed.weight.detach().clone()
        for _ in range(2):
            _lm_step(model, opt, tokens)
        assert torch.equal(model.lm_head.weight, head) and not torch.equal(model.embed.weight, embed)
        model.lm_head.requires_grad_(True)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(CanzonaError, match=r"parameter 'embed\.weight' was replaced after the optimizer was built "
                                               r"\(.*'lm_head\.weight'"):
            _lm_step(model, opt, tokens)
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    finally:
        gc.enable()


@pytest.mark.parametrize("kwargs", [{}, {"overlap_step": True}], ids=["default", "overlap_step"])
def test_an_optimizer_dropped_takes_its_hooks_with_it_without_gc(one_rank, kwargs):
    """An optimizer dropped (`del opt`, gc disabled: a notebook's rebuild, an LR-finder sweep) is
    freed at once, its hooks with it: no gradient hook left on a parameter, no forward, state-dict
    or load hook on a module; a second one over the same model then trains bit for bit as torch's
    AdamW. Before: the optimizer's parts referred back to it (its checks held its bound methods),
    so only gc freed it, its module hooks staying until then, and its parameters' gradient hooks
    were never removed (one more per optimizer built, firing at every backward)."""
    import gc
    import weakref

    from canzona.runtime import DistributedOptimizer
    from reference.data import fixed_batch
    from reference.tiny_model import TinyQwen3

    mine, theirs = TinyQwen3("tiny", seed=0), TinyQwen3("tiny", seed=0)
    tokens = fixed_batch(256, 2, 16, seed=3)
    gc.collect()
    gc.disable()
    try:
        for _ in range(2):  # two dropped in turn
            opt = DistributedOptimizer(mine.named_parameters(), mine.spec(), **kwargs)  # Muon
            gone = weakref.ref(opt)
            mine.loss(tokens).backward()
            opt.step()
            opt.zero_grad()
            del opt
            assert gone() is None, "the dropped optimizer is still alive"
            assert not any(p._post_accumulate_grad_hooks for p in mine.parameters())
            assert not any(m._forward_pre_hooks or m._state_dict_pre_hooks or m._load_state_dict_pre_hooks or
                           m._load_state_dict_post_hooks for m in mine.modules())
        with torch.no_grad():
            for p, q in zip(mine.parameters(), theirs.parameters()):
                q.copy_(p)
        opt = DistributedOptimizer(mine.named_parameters(), mine.spec(), "adamw", overlap_param_gather=False)
        torch_opt = torch.optim.AdamW(theirs.parameters())
        for _ in range(3):
            for model, o in ((mine, opt), (theirs, torch_opt)):
                o.zero_grad()
                model.loss(tokens).backward()
                o.step()
        assert all(len(p._post_accumulate_grad_hooks or {}) == 1 for p in mine.parameters())
        assert all(torch.equal(p, q) for p, q in zip(mine.parameters(), theirs.parameters()))
    finally:
        gc.enable()


@pytest.mark.parametrize("fails_in", ["MatrixStep", "ParamsInFlight"])
def test_a_construction_that_fails_after_the_gradient_hooks_leaves_none(one_rank, monkeypatch, fails_in):
    """A construction that fails after its gradient hooks are on the parameters (an out-of-memory
    building the step's state or the parameter gathers' hooks; a notebook retrying a bad config),
    gc disabled: once the error is dropped no gradient hook is left on a parameter, and an optimizer
    built next puts one each. Before: the finalizer that removes them was registered at the end of
    construction, so a failure before it left the hooks on the parameters for good (one more set per
    failed try, each firing at every backward). Seen failing with the finalizer registered last."""
    import gc

    from canzona.runtime import DistributedOptimizer
    from canzona.runtime import optimizer as optimizer_module
    from canzona.runtime.modules import named_parameters
    from canzona.spec import ModelSpec

    def boom(*args, **kwargs):
        raise torch.OutOfMemoryError("out of memory (a test's)")

    mine = _TiedLM()
    spec = ModelSpec.from_module(mine)
    gc.disable()
    try:
        with monkeypatch.context() as patched:
            patched.setattr(optimizer_module, fails_in, boom)
            with pytest.raises(torch.OutOfMemoryError, match="a test's"):
                DistributedOptimizer(list(named_parameters(mine)), spec)
        assert not any(p._post_accumulate_grad_hooks for p in mine.parameters())
        opt = DistributedOptimizer(list(named_parameters(mine)), spec)
        assert all(len(p._post_accumulate_grad_hooks or {}) == 1 for p in mine.parameters())
        del opt
    finally:
        gc.enable()
