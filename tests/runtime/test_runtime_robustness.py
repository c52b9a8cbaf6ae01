"""The DP runtime fails loudly and in bounded time, skips parameters without gradients as torch
optimizers do, and records what it sends (docs/architecture.md §4.4, docs/design.md §8.3).

- ranks that disagree on the plan, policy, optimizer configuration or model raise a clear error on
  every rank before any other collective; a plan for another model, DP size, optimizer or policy is
  a `PlanError`;
- a rank that dies or never joins a collective is an error within the collective timeout, and
  `run_ranks` turns failures and hangs into errors, never into a hung test;
- a parameter without a gradient in a step is neither updated nor decayed;
- `no_sync()` accumulation reduces once per bucket, and the collective log matches the plan.

Workers are module-level functions, so that the spawned ranks can import them; one spawned group
runs many jobs (`jobs_worker`), because spawning costs seconds.
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from canzona.errors import CanzonaError, PlanError
from canzona.harness.launch import RankError, run_ranks
from canzona.harness.training import (
    TrainSpec,
    build_model,
    distributed_worker,
    global_batches,
    micro_batches,
)
from canzona.plan import make_plan
from canzona.spec import ModelSpec, ParamSpec, Role
from canzona.step_collectives import step_collectives, step_records
from tests.runtime.outcomes import weights

pytestmark = pytest.mark.distributed  # spawns gloo process groups

DEADLINE_S = 120.0
STEP_TIMEOUT_S = 3.0  # the optimizer's collective timeout in the failure tests
MAIN_DP = 4
BUCKET = 16384  # five buckets on the tiny model


def _optimizer(model, spec: ModelSpec | None = None, **kwargs):
    from canzona.runtime.optimizer import DistributedOptimizer

    return DistributedOptimizer(model.named_parameters(), spec or model.spec(), **kwargs)


def _group_is_healthy(world: int) -> bool:
    """Both sides issued the same collectives so far: a fresh all-reduce pairs up and is right."""
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item() == world


def _outcome(fn) -> dict:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects the type and message
        return {"type": type(e).__name__, "is_canzona": isinstance(e, CanzonaError),
                "is_plan_error": isinstance(e, PlanError), "message": str(e)}
    return {"type": None, "is_canzona": False, "is_plan_error": False, "message": ""}


def jobs_worker(rank: int, world: int, jobs: list[tuple[str, tuple]]) -> list:
    """Run several module-level jobs `(function name, args)` in one spawned group."""
    return [globals()[name](rank, world, *args) for name, args in jobs]


# --- plan agreement and plan validation ------------------------------------------------------


def mismatch_job(rank: int, world: int, per_rank: list[dict]) -> dict:
    """Rank r constructs an optimizer from `per_rank[r]` (keys: preset, plus optimizer kwargs)."""
    kwargs = dict(per_rank[rank])
    model = build_model(TrainSpec(preset=kwargs.pop("preset", "tiny")))
    out = _outcome(lambda: _optimizer(model, **kwargs))
    out["healthy"] = _group_is_healthy(world)
    return out


def double_sync_job(rank: int, world: int) -> dict:
    """Two backward passes without `no_sync()` synchronise the same buckets twice: one error, from
    step()'s check (before: inside the second backward), nothing updated."""
    spec = TrainSpec(global_batch=4 * world)
    model = build_model(spec)
    opt = _optimizer(model, bucket_size=BUCKET)
    tokens = global_batches(spec, 256)[0]
    mbs = micro_batches(tokens, rank, world, 2)
    before = [p.detach().clone() for p in model.parameters()]
    model.loss(mbs[0]).backward()
    model.loss(mbs[1]).backward()
    out = _outcome(opt.step)
    out["unchanged"] = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    out["healthy"] = _group_is_healthy(world)
    return out


def load_failure_job(rank: int, world: int, folder: str) -> dict:
    """Every rank saves a sharded checkpoint and loads it back, rank 1's finiteness check of the
    state it read failing (a RuntimeError standing in for a bug, or a dtype it cannot reduce)."""
    import torch.distributed.checkpoint as dcp

    from canzona.runtime import checkpoint

    spec = TrainSpec(global_batch=2 * world)
    model = build_model(spec)
    opt = _optimizer(model, timeout_s=5.0)
    model.loss(micro_batches(global_batches(spec, 256)[0], rank, world, 1)[0]).backward()
    opt.step()
    dcp.save(opt.sharded_state_dict(), checkpoint_id=folder)

    def broken(state):
        raise RuntimeError("the finiteness check failed on rank 1")

    def load_with(attr: str, fails) -> dict:
        real = getattr(checkpoint, attr)
        if rank == 1:
            setattr(checkpoint, attr, fails)
        start = time.monotonic()
        try:
            out = _outcome(lambda: opt.load_sharded_state_dict(folder))
        finally:
            setattr(checkpoint, attr, real)
        out["elapsed_s"] = time.monotonic() - start
        return out

    out = load_with("nonfinite_state_error", broken)

    def cast_fails(opt, state):
        raise RuntimeError("the cast to the live state dtype failed on rank 1")

    # the cast of what a rank read to the live state's dtypes (`cast_to_live`), in the same round
    out["cast"] = load_with("cast_to_live", cast_fails)
    out["healthy"] = _group_is_healthy(world)
    return out


# --- failures: a rank that dies or never joins -----------------------------------------------


def failing_worker(rank: int, world: int, mode: str, outdir: str, overlap_step: bool = False) -> str:
    """Rank 1 fails before step() (`raise`: an exception; `exit`: the process dies; `stall`: it
    never joins the step's collectives); rank 0 records what its step() did (`overlap_step`: the
    step computing its updates under the reductions, which the missing peer never completes)."""
    spec = TrainSpec(global_batch=2 * world)
    model = build_model(spec)
    opt = _optimizer(model, timeout_s=STEP_TIMEOUT_S, overlap_step=overlap_step)
    model.loss(micro_batches(global_batches(spec, 256)[0], rank, world, 1)[0]).backward()
    done = Path(outdir) / "rank0.json"
    if rank == 1:
        if mode == "raise":
            raise RuntimeError("rank 1 fails before step()")
        if mode == "exit":
            os._exit(3)
        end = time.monotonic() + 60
        while not done.exists() and time.monotonic() < end:  # never joins; leaves once rank 0 is done
            time.sleep(0.05)
        return "stalled"
    start = time.monotonic()
    out = _outcome(opt.step)
    out["elapsed_s"] = time.monotonic() - start
    done.write_text(json.dumps(out))
    if out["type"] is not None:
        raise CanzonaError(out["message"])
    return "stepped"


def sleeping_worker(rank: int, world: int) -> None:
    time.sleep(600)


# --- parameters without gradients ------------------------------------------------------------

VOCAB, HIDDEN = 32, 16


class Branchy(nn.Module):
    """A model with a matrix and a vector that no forward uses, and a matrix only rank 0's forward
    uses. Three matrices: at DP 4 some rank owns none."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)

        def draw(*shape):
            return nn.Parameter(0.3 * torch.randn(*shape, generator=g))

        self.embed = draw(VOCAB, HIDDEN)
        self.w_used = draw(HIDDEN, HIDDEN)
        self.w_unused = draw(HIDDEN, HIDDEN)
        self.w_rank0 = draw(HIDDEN, HIDDEN)
        self.norm_used = nn.Parameter(1 + 0.1 * torch.randn(HIDDEN, generator=g))
        self.norm_unused = nn.Parameter(1 + 0.1 * torch.randn(HIDDEN, generator=g))
        self.head = draw(VOCAB, HIDDEN)

    def loss(self, tokens: torch.Tensor, branch: bool) -> torch.Tensor:
        return self(tokens, branch)  # through forward: its pre-hook waits for the parameter gathers

    def forward(self, tokens: torch.Tensor, branch: bool) -> torch.Tensor:
        x = self.embed[tokens[:, :-1]]
        h = x @ self.w_used.T
        if branch:
            h = h + torch.tanh(x @ self.w_rank0.T)
        logits = (h * self.norm_used) @ self.head.T
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    @staticmethod
    def spec() -> ModelSpec:
        m, v = Role.MATRIX, Role.VECTOR
        rows = [("embed", (VOCAB, HIDDEN), Role.EMBEDDING), ("w_used", (HIDDEN, HIDDEN), m),
                ("w_unused", (HIDDEN, HIDDEN), m), ("w_rank0", (HIDDEN, HIDDEN), m),
                ("norm_used", (HIDDEN,), v), ("norm_unused", (HIDDEN,), v),
                ("head", (VOCAB, HIDDEN), Role.HEAD)]
        return ModelSpec("branchy", tuple(ParamSpec(n, s, r, dtype="fp32") for n, s, r in rows))


BRANCHY_STEPS = 2
BRANCHY_LR = {"matrix": 0.05, "adamw": 0.05}
BRANCHY_BUCKET = HIDDEN * HIDDEN  # one matrix per bucket


def branchy_tokens(step: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (2 * world, 9), generator=g)


def branchy_job(rank: int, world: int, policy: str) -> dict:
    model = Branchy()
    opt = _optimizer(model, Branchy.spec(), policy=policy, bucket_size=BRANCHY_BUCKET,
                     matrix_config={"lr": BRANCHY_LR["matrix"]}, adamw_config={"lr": BRANCHY_LR["adamw"]})
    for step in range(BRANCHY_STEPS):
        opt.zero_grad()
        model.loss(branchy_tokens(step, world)[2 * rank:2 * rank + 2], branch=rank == 0).backward()
        opt.step()
    return {"params": weights(model),
            "owned": list(opt.applies)}


def branchy_reference(world: int) -> dict[str, torch.Tensor]:
    """torch semantics, one process: each rank's gradient, averaged in rank order (as the runtime
    reduces), `.grad = None` where no rank produced one; the reference optimizers step."""
    from reference import CombinedOptimizer

    model = Branchy()
    params = dict(model.named_parameters())
    opt = CombinedOptimizer(model.named_parameters(), Branchy.spec(), "muon",
                            {"lr": BRANCHY_LR["matrix"]}, {"lr": BRANCHY_LR["adamw"]})
    for step in range(BRANCHY_STEPS):
        tokens = branchy_tokens(step, world)
        per_rank = []
        for r in range(world):
            for p in params.values():
                p.grad = None
            model.loss(tokens[2 * r:2 * r + 2], branch=r == 0).backward()
            per_rank.append({n: p.grad for n, p in params.items()})
        for n, p in params.items():
            grads = [g[n] if g[n] is not None else torch.zeros_like(p) for g in per_rank]
            if all(g[n] is None for g in per_rank):
                p.grad = None
                continue
            acc = grads[0].clone()
            for g in grads[1:]:
                acc += g
            p.grad = acc.div_(world)
        opt.step()
    return weights(model)


# --- the collective log and the gradient-sync launch points ----------------------------------


def log_job(rank: int, world: int, spec: TrainSpec) -> dict:
    out = distributed_worker(rank, world, spec, {"state_dict": False})
    return {"log": out["log"]}


def launch_spy_job(rank: int, world: int, accumulation: int) -> list[dict]:
    """Snapshot each bucket's gradient buffer when its reduce-scatter is launched; after backward
    (before step) the buffer must still hold the same values: a bucket is only launched once all
    of its gradients of the step are accumulated. With the exact reduce-scatter, which receives
    into a buffer of its own (the native routes write the owner's sum into its segment in place
    when the collective completes, before step() waits for it)."""
    spec = TrainSpec(global_batch=2 * accumulation * world, accumulation=accumulation)
    model = build_model(spec)
    opt = _optimizer(model, bucket_size=BUCKET, reduce_scatter="exact")
    launched = []
    real = opt.comm.reduce_scatter_v

    def spy(flat, cuts, name):
        launched.append((name, flat, flat.clone()))
        return real(flat, cuts, name)

    opt.comm.reduce_scatter_v = spy
    mbs = micro_batches(global_batches(spec, 256)[0], rank, world, accumulation)
    opt.zero_grad()
    for k, mb in enumerate(mbs):
        if k < len(mbs) - 1:
            with opt.no_sync():
                (model.loss(mb) / accumulation).backward()
        else:
            (model.loss(mb) / accumulation).backward()
    report = [{"name": name, "unchanged": torch.equal(flat, snap)} for name, flat, snap in launched]
    opt.step()
    return report


# --- spawned groups (cached: one spawn serves many tests) ------------------------------------

TINY_MATCH_POLICIES = (("canzona", "alpha-balanced"), ("canzona", "alpha-balanced-reorder"),
                       ("zero1-gather", None), ("layerwise", None), ("sc", None))
LOG_SPECS = {
    **{(p, d, 1): TrainSpec(policy=p, dp_policy=d or "alpha-balanced", steps=2, global_batch=8,
                            bucket_size=BUCKET) for p, d in TINY_MATCH_POLICIES},
    **{(p, d, 2): TrainSpec(policy=p, dp_policy=d or "alpha-balanced", steps=2, global_batch=8,
                            accumulation=2, bucket_size=BUCKET) for p, d in TINY_MATCH_POLICIES[::2]},
}
BRANCHY_POLICIES = ("canzona", "sc", "layerwise", "zero1-gather")


def tiny_spec() -> ModelSpec:
    return build_model(TrainSpec()).spec()


def mismatch_cases(dp: int, plan_file: str) -> dict[str, list[dict]]:
    tiny = tiny_spec()
    untied = build_model(TrainSpec(preset="tiny-untied")).spec()
    ab1 = make_plan(tiny, dp, 1, "muon", "alpha-balanced", alpha=1.0)
    ab0 = make_plan(tiny, dp, 1, "muon", "alpha-balanced", alpha=0.0)
    ws = make_plan(tiny, dp, 1, "muon", "whole-start")
    reorder = make_plan(tiny, dp, 1, "muon", "alpha-balanced-reorder")
    assert len({ab1.hash(), ab0.hash(), ws.hash(), reorder.hash()}) == 4
    make_plan(tiny, 1, 1, "muon", "whole-start").save(plan_file)

    def one_rank_differs(same: dict, other: dict) -> list[dict]:
        return [same, other] + [same] * (dp - 2)  # rank 1 differs

    every = lambda kw: [kw] * dp  # noqa: E731
    return {
        # ranks disagree: an error on every rank, raised by the agreement check
        "plan alpha": one_rank_differs({"plan": ab1}, {"plan": ab0}),
        "plan policy": one_rank_differs({"plan": ws}, {"plan": reorder}),
        "planned alpha": one_rank_differs({"alpha": 1.0}, {"alpha": 0.0}),
        "step policy": one_rank_differs({"plan": ws, "policy": "canzona"}, {"plan": ws, "policy": "sc"}),
        "optimizer config": one_rank_differs({}, {"matrix_config": {"lr": 0.5}}),
        "reduce-scatter": one_rank_differs({}, {"reduce_scatter": "loops"}),
        "model": one_rank_differs({}, {"preset": "tiny-untied"}),
        # one rank's own refusal (a plan for another DP size, as a plan file on its disk alone
        # can be): before, the others waited in the agreement check until timeout_s (5 s here)
        "plan for another dp on one rank": one_rank_differs(
            {"timeout_s": 5.0}, {"timeout_s": 5.0, "plan": make_plan(tiny, dp * 2, 1, "muon", "alpha-balanced")}),
        # an unexpected failure on one rank at construction (a cost model of no known kind stands in
        # for an out-of-memory or a bug: an AttributeError, not a refusal): spread as a refusal is
        "unexpected failure on one rank": one_rank_differs({"timeout_s": 5.0}, {"timeout_s": 5.0, "cost_model": 12345}),
        # every rank has the same wrong plan: a local PlanError
        "plan for another dp": every({"plan": make_plan(tiny, dp * 2, 1, "muon", "alpha-balanced")}),
        "plan file for another dp": every({"plan": plan_file}),
        "plan for another model": every({"plan": make_plan(untied, dp, 1, "muon", "alpha-balanced")}),
        "plan for another optimizer": every({"plan": make_plan(tiny, dp, 1, "soap", "alpha-balanced")}),
        # SOAP's defaults precondition both sides of every matrix; max_precond_dim 64 one side of the
        # 128 x 64 ones: the plan's per-matrix state (and every figure of memory made from it) is not
        # what the job allocates (it ran: at DP 2, 606208 bytes of state per rank where the plan said 999424)
        "plan for another configuration": every({"plan": make_plan(tiny, dp, 1, "soap", "alpha-balanced"),
                                                 "optimizer": "soap", "matrix_config": {"max_precond_dim": 64}}),
        "plan for another policy": every({"plan": ab1, "policy": "sc"}),
        # planning settings beside a plan that made otherwise: they were run as the plan said, silently
        "planned bucket size beside a plan": every({"plan": ab1, "bucket_size": 4096}),
        "whole geometry beside an even plan": every({"plan": make_plan(tiny, dp, 1, "muon", "zero1-even"),
                                                     "geometry": "whole"}),
    }


MISMATCH_WANT = {
    "plan alpha": "disagree on the plan",
    "plan policy": "disagree on the plan",
    "planned alpha": "disagree on the plan",
    "step policy": "disagree on the policy",
    "optimizer config": "disagree on the optimizer configuration",
    "reduce-scatter": "disagree on the policy",
    "model": "disagree on the model fingerprint",
    "plan for another dp": f"plan is for dp={MAIN_DP * 2}, but the job has dp={MAIN_DP}",
    "plan file for another dp": f"plan is for dp=1, but the job has dp={MAIN_DP}",
    "plan for another model": "plan was made for model 'tiny-untied'",
    "plan for another optimizer": "plan is for soap",
    "plan for another configuration": "plan was made for another soap configuration",
    "plan for another policy": "needs a whole-start plan",
    "planned bucket size beside a plan": "bucket_size=4096 was given with a plan made with bucket_size=",
    "whole geometry beside an even plan": "geometry='whole' was given with a plan made with geometry='auto'",
}


@functools.cache
def main_group(plan_file: str) -> dict:
    """Every non-failing job, in one spawned group of MAIN_DP ranks."""
    cases = mismatch_cases(MAIN_DP, plan_file)
    jobs: list[tuple[tuple, str, tuple]] = []
    jobs += [(("mismatch", name), "mismatch_job", (per_rank,)) for name, per_rank in cases.items()]
    jobs += [(("double sync",), "double_sync_job", ())]
    jobs += [(("branchy", p), "branchy_job", (p,)) for p in BRANCHY_POLICIES]
    jobs += [(("log",) + key, "log_job", (spec,)) for key, spec in LOG_SPECS.items()]
    jobs += [(("spy", acc), "launch_spy_job", (acc,)) for acc in (1, 2)]
    jobs += [(("load failure",), "load_failure_job", (str(Path(plan_file).parent / "load-failure"),))]
    try:
        results = run_ranks(jobs_worker, MAIN_DP, [(fn, args) for _, fn, args in jobs],
                            deadline_s=DEADLINE_S, collective_timeout_s=60)
    except Exception as e:  # noqa: BLE001 - replayed by every test that needs it
        return {"error": e}
    return {label: [results[r][i] for r in range(MAIN_DP)] for i, (label, _, _) in enumerate(jobs)}


@pytest.fixture(scope="module")
def group(tmp_path_factory) -> dict:
    plan_file = str(tmp_path_factory.mktemp("plans") / "dp1.json")
    runs = main_group(plan_file)
    if "error" in runs:
        err = runs["error"]
        pytest.fail(f"the spawned group failed: {err}\n{getattr(err, 'trace', '')}")
    return runs


# --- tests: agreement and validation ---------------------------------------------------------


@pytest.mark.parametrize("case", list(MISMATCH_WANT))
def test_bad_or_disagreeing_plans_raise_on_every_rank(group, case):
    outs = group[("mismatch", case)]
    for r, out in enumerate(outs):
        assert out["is_plan_error"], f"rank {r}: {out}"
        assert MISMATCH_WANT[case] in out["message"], f"rank {r}: {out['message']}"
        # nothing else was sent: a fresh collective still pairs up on every rank
        assert out["healthy"], f"rank {r}"


def test_disagreement_names_the_differing_rank(group):
    outs = group[("mismatch", "plan alpha")]
    assert "rank(s) [1]" in outs[0]["message"]
    assert "rank(s) [0" in outs[1]["message"]


def test_a_refusal_on_one_rank_is_one_error_on_every_rank_at_once(group):
    """Rank 1 refuses its plan (for another DP size) at construction: it raises its own error, the
    others one naming it, and every rank issued the same collectives (a fresh one pairs up). Before,
    they waited in the agreement check until timeout_s and raised a timeout naming no cause."""
    outs = group[("mismatch", "plan for another dp on one rank")]
    assert outs[1]["is_plan_error"] and f"plan is for dp={MAIN_DP * 2}" in outs[1]["message"], outs[1]
    for r in (0, 2, 3):
        message = outs[r]["message"]
        assert outs[r]["is_canzona"] and "DP rank(s) [1] refused" in message and "see their error" in message, message
    assert all(out["healthy"] for out in outs)


def test_an_unexpected_failure_on_one_rank_at_construction_is_one_error_on_every_rank_at_once(group):
    """Rank 1 fails at construction with an exception that is not a refusal (here an
    AttributeError from a cost model of no known kind): it raises it, the others one error naming
    it, at once. Before, only refusals were spread: the others waited until timeout_s."""
    outs = group[("mismatch", "unexpected failure on one rank")]
    assert outs[1]["type"] is not None and not outs[1]["is_canzona"], outs[1]
    for r in (0, 2, 3):
        message = outs[r]["message"]
        assert outs[r]["is_canzona"] and "DP rank(s) [1] refused" in message, message
    assert all(out["healthy"] for out in outs)


def test_an_unexpected_failure_in_the_sharded_loads_checks_on_one_rank_is_one_error_on_every_rank_at_once(group):
    """`load_sharded_state_dict`, rank 1's finiteness check of what it read raising (not a
    refusal): it raises its own error, the others one naming it, at once (the load's timeout_s is
    5 s), and every rank issued the same collectives. Before, the check and the digest ran outside
    the agreement's try: rank 1 raised alone, the others waited in the agreement until timeout_s.
    Likewise the cast of what each rank read to the live state's dtypes (`cast_to_live`)."""
    every = group[("load failure",)]
    for outs in (every, [out["cast"] for out in every]):
        assert outs[1]["type"] == "RuntimeError" and "failed on rank 1" in outs[1]["message"], outs[1]
        for r in (0, 2, 3):
            message = outs[r]["message"]
            assert outs[r]["is_canzona"] and "rank(s) [1]" in message and "failed on rank 1" in message, message
        assert all(out["elapsed_s"] < 2.0 for out in outs), [out["elapsed_s"] for out in outs]
    assert all(out["healthy"] for out in every)


def test_synchronising_twice_without_no_sync_is_an_error(group):
    for r, out in enumerate(group[("double sync",)]):
        assert out["is_canzona"], f"rank {r}: {out}"
        assert "no_sync" in out["message"]
        assert out["healthy"] and out["unchanged"]


# --- tests: failures turn into errors in bounded time ----------------------------------------


def test_rank_that_raises_before_step_is_an_error_within_the_timeout(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(failing_worker, 2, "raise", str(tmp_path), deadline_s=60, collective_timeout_s=10)
    assert time.monotonic() - start < 60
    assert info.value.rank in (0, 1)
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert rank0["is_canzona"], rank0
    assert "failed or timed out" in rank0["message"]  # the peer's socket closed, or the timeout
    assert rank0["elapsed_s"] < STEP_TIMEOUT_S + 5


@pytest.mark.parametrize("overlap_step", [False, True], ids=["plain", "overlapped"])
def test_rank_that_never_joins_is_a_timeout_error_on_its_peer(tmp_path, overlap_step):
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(failing_worker, 2, "stall", str(tmp_path), overlap_step, deadline_s=60, collective_timeout_s=10)
    assert time.monotonic() - start < 60
    assert info.value.rank == 0
    assert "CanzonaError" in info.value.trace
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert rank0["is_canzona"] and "timed out" in rank0["message"], rank0
    assert STEP_TIMEOUT_S - 0.5 <= rank0["elapsed_s"] < STEP_TIMEOUT_S + 5


@pytest.mark.parametrize("overlap_step", [False, True], ids=["plain", "overlapped"])
def test_rank_process_that_dies_is_an_error_not_a_hang(tmp_path, overlap_step):
    start = time.monotonic()
    with pytest.raises(CanzonaError, match="died|exited|failed"):
        run_ranks(failing_worker, 2, "exit", str(tmp_path), overlap_step, deadline_s=60, collective_timeout_s=10)
    assert time.monotonic() - start < 60


def test_run_ranks_kills_a_hang_at_the_deadline():
    start = time.monotonic()
    with pytest.raises(CanzonaError, match="did not finish within"):
        run_ranks(sleeping_worker, 1, deadline_s=2)
    assert time.monotonic() - start < 2 + 10


# --- tests: parameters without gradients -----------------------------------------------------


@pytest.mark.parametrize("policy", BRANCHY_POLICIES)
def test_parameters_without_gradients_are_skipped_like_torch(group, policy):
    ranks = group[("branchy", policy)]
    init = dict(Branchy().named_parameters())
    for r, res in enumerate(ranks):
        got = res["params"]
        # no gradient on any rank: no update and no weight decay (both optimizers decay by default)
        for name in ("w_unused", "norm_unused"):
            assert torch.equal(got[name], init[name].detach()), f"rank {r}: {name} changed"
        # used on every rank, or on rank 0 only (then the averaged gradient updates it everywhere)
        for name in ("embed", "w_used", "w_rank0", "norm_used", "head"):
            assert not torch.equal(got[name], init[name].detach()), f"rank {r}: {name} did not change"
        for name, t in got.items():
            assert torch.equal(t, ranks[0]["params"][name]), f"rank {r} differs on {name}"
    want = branchy_reference(MAIN_DP)
    for name in ("w_unused", "norm_unused"):
        assert torch.equal(want[name], init[name].detach())  # what torch optimizers do
    for name, t in want.items():
        scale = t.abs().max().item()
        assert (ranks[0]["params"][name] - t).abs().max().item() <= 1e-5 * scale, name


def test_branchy_layout_leaves_a_rank_without_matrices(group):
    owned = [res["owned"] for res in group[("branchy", "canzona")]]
    assert sorted(n for names in owned for n in names) == ["w_rank0", "w_unused", "w_used"]
    assert any(not names for names in owned)


# --- tests: gradient sync launch points and the collective log -------------------------------


def test_buckets_launch_only_when_their_gradients_are_complete(group):
    for r, report in enumerate(group[("spy", 1)]):
        assert [x["name"] for x in report] == [f"bucket {k}" for k in range(len(report))]
        assert all(x["unchanged"] for x in report), f"rank {r}: {report}"


def test_buckets_launch_only_when_their_gradients_are_complete_under_no_sync(group):
    for r, report in enumerate(group[("spy", 2)]):
        assert all(x["unchanged"] for x in report), f"rank {r}: {report}"


@pytest.mark.parametrize("key", list(LOG_SPECS), ids=[f"{p}-{d or ''}-acc{a}" for p, d, a in LOG_SPECS])
def test_collective_log_matches_the_plan(group, key):
    """Each rank's log, step by step, is `step_collectives` of the plan the policy makes (the one
    definition the simulator prices too; tests/policy/test_step_collectives.py checks it at DP 2 and
    DP 2 x TP 2)."""
    policy, dp_policy, accumulation = key
    ranks = group[("log",) + key]
    steps = LOG_SPECS[key].steps
    plan_policy = {"zero1-gather": "zero1-even", "layerwise": "layerwise", "sc": "whole-start"}.get(policy, dp_policy)
    plan = make_plan(tiny_spec(), MAIN_DP, 1, "muon", plan_policy, bucket_size=BUCKET)
    for r, res in enumerate(ranks):
        want = step_records(step_collectives(plan, tiny_spec(), policy, dp_rank=r))
        log = res["log"]
        assert [rec["order"] for rec in log] == list(range(len(log)))
        assert [rec["step"] for rec in log] == [s for s in range(steps) for _ in want]
        for s in range(steps):
            got = [(rec["op"], rec["group"], rec["name"], tuple(rec["bytes_per_rank"]))
                   for rec in log if rec["step"] == s]
            assert got == want, f"rank {r} step {s}"
        assert log == ranks[0]["log"], f"rank {r} logged differently from rank 0"


def test_canzona_log_has_one_reduce_scatter_and_one_all_gather_per_bucket(group):
    """The headline property, stated directly: per step and bucket, one reduce-scatter-v of the
    whole bucket (size x 4 bytes from every rank) and one all-gather-v of the plan's segments,
    also when gradients are accumulated over micro-batches under no_sync()."""
    plan = make_plan(tiny_spec(), MAIN_DP, 1, "muon", "alpha-balanced", bucket_size=BUCKET)
    for acc in (1, 2):
        log = group[("log", "canzona", "alpha-balanced", acc)][0]["log"]
        for s in range(2):
            step = [rec for rec in log if rec["step"] == s]
            for b in plan.dp_plan.buckets:
                rs = [rec for rec in step if rec["op"] == "reduce-scatter-v" and rec["name"] == f"bucket {b.index}"]
                ag = [rec for rec in step if rec["op"] == "all-gather-v" and rec["name"] == f"parameters of bucket {b.index}"]
                assert len(rs) == 1 and tuple(rs[0]["bytes_per_rank"]) == (4 * b.size,) * MAIN_DP
                assert len(ag) == 1
                assert sum(ag[0]["bytes_per_rank"]) == 4 * b.size
