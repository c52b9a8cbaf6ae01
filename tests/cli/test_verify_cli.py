"""`canzona verify`: rung 3 on spawned gloo ranks, its JSON and table, bad input (exit 2, one line),
mismatches and rank failures (exit 1). Each real run spawns one process group (seconds), so the
real runs here are few and tiny; the verdict logic is tested on synthetic parameters."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch

from canzona.harness import verify as checks
from canzona.harness.launch import RankError
from canzona.plan import PLAN_DEFAULTS
from canzona.step_policies import STEP_POLICIES
from tests.cli_helpers import error_line, invoke

QUICK = ["--dp", "2", "--steps", "2"]


def run(*args: str):
    result = invoke("verify", *args)
    return result, result.stdout, result.stderr


def one_error_line(result, stdout: str, stderr: str, code: int = 2) -> str:
    return error_line(result, code=code)


def table_text(rows: list[dict]) -> str:
    """The table `canzona verify` prints without --json for these rows of its JSON report (the CLI
    prints `verify_table(rows)`; the tables of a run without --json: test_table_on_a_single_rank,
    test_tensor_parallel_table_with_dtensors), as the CLI's console renders it off a terminal."""
    from rich.console import Console

    from cli.render import verify_table

    console = Console(width=140, file=io.StringIO(), record=True)
    console.print(verify_table(rows))
    return console.export_text()


# --- real runs (one spawn each) -------------------------------------------------------------


@pytest.mark.distributed
def test_one_configuration_passes_every_rung():
    result, out, err = run(*QUICK, "--optimizer", "muon", "--policy", "canzona", "--json")
    assert result.exit_code == 0, (out, err)
    report = json.loads(out)
    assert report["ok"] is True and report["failed"] == 0
    rows = report["rows"]
    assert [r["rung"] for r in rows] == ["ranks", "3a", "3b"]
    for r in rows:
        assert (r["optimizer"], r["policy"], r["plan"]) == ("muon", "canzona", PLAN_DEFAULTS.dp_policy)
        assert (r["dp"], r["steps"], r["accumulation"], r["global_batch"]) == (2, 2, 1, 8)  # 4 x dp x accumulation
        assert r["ok"] is True and len(r["plan_hash"]) == 64
        assert math.isfinite(r["final_loss"])
    assert rows[1]["bit_identical"] is True and rows[1]["max_rel_diff"] == 0.0  # 3a: bit for bit
    assert rows[2]["max_rel_diff"] <= checks.REFERENCE_RTOL == rows[2]["tolerance"]


@pytest.mark.distributed
def test_expert_parallel_every_matrix_optimizer_bit_for_bit():
    """Issue 20's bar: `canzona verify --dp 2 --ep 2` for every matrix optimizer, bit for bit (EP
    groups of 2; at DP 4 each expert matrix is owned by one rank of its EDP group of 2)."""
    tables = {}
    for dp in ("2", "4"):
        result, out, err = run("--dp", dp, "--ep", "2", "--optimizer", "all", "--steps", "8", "--json")
        assert result.exit_code == 0, (out, err)
        report = json.loads(out)
        assert report["ok"] is True and report["checks"] == 3 * len(checks.OPTIMIZERS)
        for r in report["rows"]:
            assert r["ep"] == 2 and r["dp"] == int(dp)
            if r["rung"] in ("ranks", "3a"):
                assert r["bit_identical"] is True, r
        tables[dp] = table_text(report["rows"])
    assert "EP 2 (EDP 1)" in tables["2"].replace("\n", " ") and "EP 2 (EDP 2)" in tables["4"].replace("\n", " ")


@pytest.mark.distributed
def test_expert_parallel_with_a_tp_dense_part_every_optimizer_bit_for_bit():
    """`canzona verify --dp 2 --tp 2 --ep 2`: the experts folded over the 4 ranks (EDP 2), the
    attention and the head split over TP (docs/design.md §8.9)."""
    result, out, err = run("--dp", "2", "--tp", "2", "--ep", "2", "--preset", "tiny-moe-attn", "--optimizer", "all",
                           "--steps", "3", "--json")
    assert result.exit_code == 0, (out, err)
    report = json.loads(out)
    assert report["ok"] is True and report["checks"] == 3 * len(checks.OPTIMIZERS)
    for r in report["rows"]:
        assert (r["dp"], r["tp"], r["ep"]) == (2, 2, 2)
        if r["rung"] in ("ranks", "3a"):
            assert r["bit_identical"] is True, r


@pytest.mark.distributed
def test_every_policy_in_one_run():
    result, out, err = run(*QUICK, "--optimizer", "soap", "--policy", "all", "--json")
    assert result.exit_code == 0, (out, err)
    report = json.loads(out)
    matrix_policies = [n for n, p in STEP_POLICIES.items() if not p.elementwise]  # those that run SOAP
    assert report["ok"] is True and report["checks"] == 3 * len(matrix_policies)
    rows = report["rows"]
    assert [r["policy"] for r in rows[::3]] == matrix_policies
    plans = {r["policy"]: r["plan"] for r in rows}
    assert plans == {"sc": "whole-start", "zero1-gather": "zero1-even", "layerwise": "layerwise",
                     "canzona": PLAN_DEFAULTS.dp_policy}
    assert all(r["bit_identical"] for r in rows if r["rung"] in ("ranks", "3a"))
    # SOAP's eigendecompositions: the reference differs in round-off only
    assert all(0 <= r["max_rel_diff"] <= checks.REFERENCE_RTOL for r in rows if r["rung"] == "3b")
    assert len({r["final_loss"] for r in rows}) == 1  # every policy trains the same model


@pytest.mark.distributed
def test_adamw_verifies_under_its_own_policy():
    """`--optimizer adamw`: every parameter on AdamW under zero1 (its default policy), the pieces
    of split matrices updated by the ranks whose segments hold them, bit for bit."""
    result, out, err = run(*QUICK, "--optimizer", "adamw", "--json")
    assert result.exit_code == 0, (out, err)
    rows = json.loads(out)["rows"]
    assert {(r["optimizer"], r["policy"], r["plan"]) for r in rows} == {("adamw", "zero1", "zero1-even")}
    assert all(r["ok"] for r in rows) and rows[1]["bit_identical"] is True


@pytest.mark.distributed
def test_table_on_a_single_rank():
    result, out, err = run("--dp", "1", "--steps", "2", "--policy", "sc")
    assert result.exit_code == 0, (out, err)
    for text in ("Runtime verification", "sc", "whole-start", "3a same kernels", "3b reference",
                 "single rank", "PASS", "all checks passed"):
        assert text in out, text
    assert "FAIL" not in out
    assert err == ""


@pytest.mark.distributed
def test_tensor_parallel_every_tp_policy_pipelined_and_serial():
    result, out, err = run("--dp", "1", "--tp", "2", "--steps", "2", "--policy", "all", "--tp-policy", "all",
                           "--tp-mode", "all", "--json")
    assert result.exit_code == 0, (out, err)
    report = json.loads(out)
    rows = report["rows"]
    assert report["ok"] is True
    # canzona under each TP scheduler, the baselines under tp-sync; each pipelined and serial
    cases = {(r["policy"], r["tp_policy"], r["tp_mode"]) for r in rows}
    assert cases == {(p, s, m) for m in ("pipelined", "serial")
                     for p, s in [("canzona", "tp-sync"), ("canzona", "tp-chunk"), ("canzona", "greedy-rollback"),
                                  ("sc", "tp-sync"), ("zero1-gather", "tp-sync"), ("layerwise", "tp-sync")]}
    assert all(r["tp"] == 2 and r["dp"] == 1 for r in rows)
    assert all(r["bit_identical"] for r in rows if r["rung"] == "3a")
    assert {r["result"] for r in rows if r["rung"] == "ranks"} == {"one DP rank"}


@pytest.mark.distributed
def test_tensor_parallel_table_with_dtensors():
    result, out, err = run("--dp", "2", "--tp", "2", "--steps", "2", "--preset", "tiny-untied", "--tp-style",
                           "dtensor")
    assert result.exit_code == 0, (out, err)
    for text in ("DP 2 x TP 2 = 4 gloo ranks", "greedy-rollback", "pipelined", "3a same kernels", "PASS",
                 "all checks passed"):
        assert text in out, text


@pytest.mark.distributed
def test_gradient_accumulation():
    result, out, err = run("--dp", "2", "--steps", "2", "--accumulation", "2", "--json")
    assert result.exit_code == 0 and json.loads(out)["ok"] is True, (out, err)


@pytest.mark.distributed
def test_fsdp_both_owner_policies_bit_for_bit():
    """`canzona verify --fsdp`: the tiny model under torch's fully_shard over 2 ranks, both owner
    policies; every rank's shards equal the one-process kernels on FSDP2's reduced gradients."""
    result, out, err = run("--fsdp", *QUICK, "--policy", "all", "--json")
    assert result.exit_code == 0, (out, err)
    report = json.loads(out)
    assert report["ok"] is True and report["checks"] == 6
    rows = report["rows"]
    assert [r["rung"] for r in rows] == ["replicas", "3a", "3b"] * 2
    assert [r["policy"] for r in rows[::3]] == list(checks.FSDP_RUNTIME_POLICIES) == ["canzona", "fsdp-owners-unbalanced"]
    assert [r["plan"] for r in rows[::3]] == ["balanced owners", "round-robin owners"]
    for r in rows:
        assert (r["fsdp"], r["hsdp_replicate"], r["dp"], r["tp"], r["ep"], r["steps"]) == (True, 1, 2, 1, 1, 2)
        assert r["ok"] is True and math.isfinite(r["final_loss"])
        if r["rung"] == "replicas":
            assert r["result"] == "one replica"
        if r["rung"] == "3a":
            assert r["bit_identical"] is True and r["max_rel_diff"] == 0.0
        if r["rung"] == "3b":
            assert r["max_rel_diff"] <= checks.REFERENCE_RTOL == r["tolerance"]


@pytest.mark.distributed
def test_fsdp_adamw_bit_for_bit():
    """`canzona verify --fsdp --optimizer adamw`: every parameter's AdamW on its shard, no owners,
    equal to one process on FSDP2's reduced gradients (before: one error line, "adamw is elementwise")."""
    result, out, err = run("--fsdp", *QUICK, "--optimizer", "adamw", "--json")
    assert result.exit_code == 0, (out, err)
    report = json.loads(out)
    assert report["ok"] is True and [r["rung"] for r in report["rows"]] == ["replicas", "3a", "3b"]
    assert all((r["optimizer"], r["policy"], r["plan"]) == ("adamw", "zero1", "no owners") for r in report["rows"])
    assert report["rows"][1]["bit_identical"] is True


@pytest.mark.distributed
@pytest.mark.parametrize("dp,ep", [(4, 2), (2, 2), (3, 1)])
def test_fsdp_moe_adamw_bit_for_bit(dp: int, ep: int):
    """`canzona verify --fsdp --dp 4 --ep 2 --optimizer adamw`: the tiny MoE in torchtitan's layout
    (stacks Shard(0) over ep, fully_shard over efsdp, the dense part over dp; at dp 2, EDP 1), every
    rank's pieces equal to one process on the gradients FSDP2 reduced (before: one error line, "give
    --ep 1"); at EP 1 over 3 ranks the last holds no expert (before: "stacked experts are not run",
    and the check's comparison failed on the empty pieces)."""
    result, out, err = run("--fsdp", "--dp", str(dp), "--ep", str(ep), "--preset", "tiny-moe", "--optimizer",
                           "adamw", "--steps", "2", "--json")
    assert result.exit_code == 0, (out, err)
    report = json.loads(out)
    assert report["ok"] is True and [r["rung"] for r in report["rows"]] == ["replicas", "3a", "3b"]
    assert all((r["fsdp"], r["dp"], r["ep"], r["optimizer"]) == (True, dp, ep, "adamw") for r in report["rows"])
    assert report["rows"][1]["bit_identical"] is True


@pytest.mark.distributed
def test_fsdp_x_tp_bit_for_bit():
    """`--fsdp --tp 2`: torchtitan's composition (parallelize_module over tp, fully_shard over dp) on
    DP 2 x TP 2; every rank's piece (a TP shard's row block) equals the one-process kernels."""
    result, out, err = run("--fsdp", "--dp", "2", "--tp", "2", "--steps", "2", "--json")
    assert result.exit_code == 0, (out, err)
    report = json.loads(out)
    assert report["ok"] is True and [r["rung"] for r in report["rows"]] == ["replicas", "3a", "3b"]
    assert all((r["fsdp"], r["dp"], r["tp"]) == (True, 2, 2) for r in report["rows"])
    assert report["rows"][1]["bit_identical"] is True
    assert "FSDP2 x TP: DP 2 x TP 2 = 4 gloo ranks" in table_text(report["rows"])


@pytest.mark.distributed
@pytest.mark.slow
def test_hsdp_table_every_matrix_optimizer():
    """`--fsdp --hsdp-replicate 2` at DP 4: two replicas of shard groups of 2, their shards alike;
    the table names the layout."""
    result, out, err = run("--fsdp", "--dp", "4", "--hsdp-replicate", "2", "--optimizer", "all", "--steps", "2")
    assert result.exit_code == 0, (out, err)
    for text in ("HSDP 2 replicas x 2 shards = 4 gloo ranks", "replicas agree", "bit-identical", "soap", "shampoo",
                 "balanced owners", "3a same kernels", "PASS", "all checks passed"):
        assert text in out, text
    assert "FAIL" not in out and "adamw" not in out  # `all` under --fsdp: the whole-matrix optimizers


def _whole_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from canzona.harness.training import gather_whole

    mesh = init_device_mesh("cpu", (world,))
    full = {"a": torch.arange(8.0).view(2, 4), "b": torch.arange(7.0)}
    shards = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in full.items()}
    return {"rows": shards["a"].to_local().shape[0], "whole": gather_whole(shards)}


@pytest.mark.distributed
def test_gather_whole_with_an_empty_shard():
    """What verify --fsdp records each step: whole tensors from the pieces, where a rank holds none
    (2 rows over 3 ranks: 1, 1, 0), which DTensor.full_tensor cannot gather over gloo."""
    from canzona.harness.launch import run_ranks

    results = run_ranks(_whole_worker, 3, deadline_s=120.0)
    assert [r["rows"] for r in results] == [1, 1, 0]
    for r in results:
        assert torch.equal(r["whole"]["a"], torch.arange(8.0).view(2, 4))
        assert torch.equal(r["whole"]["b"], torch.arange(7.0))


# --- bad input: one line, exit 2, nothing spawned ----------------------------------------------


@pytest.mark.parametrize("args, needle", [
    (["--dp", "0"], "dp must be"),
    (["--steps", "0"], "steps must be"),
    (["--accumulation", "0"], "accumulation must be"),
    (["--optimizer", "adam"], "unknown optimizer 'adam'"),
    (["--policy", "zero3"], "unknown policy 'zero3'"),
    (["--preset", "huge"], "unknown tiny model 'huge'"),
    # an empty name was taken as the default and the run verified it
    (["--preset", ""], "unknown tiny model ''"),
    (["--dp-policy", ""], "unknown DP policy ''"),
    (["--dp", "3", "--global-batch", "8"], "not divisible by dp x accumulation"),
    (["--dp", "2", "--accumulation", "3", "--global-batch", "9"], "not divisible"),
    (["--tp", "0"], "tp must be"),
    (["--tp", "3"], "tp=3 does not divide"),
    (["--dp", "4", "--tp", "8"], "dp x tp must be <= 16"),
    (["--tp", "2", "--tp-policy", "round-robin"], "unknown TP policy 'round-robin'"),
    (["--tp", "2", "--tp-mode", "eager"], "unknown TP mode 'eager'"),
    (["--tp", "2", "--tp-style", "fsdp"], "unknown TP style 'fsdp'"),
    (["--tp", "2", "--tp-style", "dtensor"], "needs an untied preset"),
    # at TP 1 no model is split: the style was accepted and the run verified the plain model
    (["--tp-style", "dtensor", "--preset", "tiny-untied"], "--tp-style dtensor splits the model over TP"),
    (["--fsdp", "--tp-style", "dtensor", "--preset", "tiny-untied"], "--tp-style dtensor splits the model over TP"),
    (["--tp", "4", "--dp", "1", "--preset", "small", "--steps", "1000"], "keeps each step's gradients"),
    (["--dp-policy", "nope"], "unknown DP policy"),
    (["--alpha", "1.5"], "alpha"),
    (["--bucket-size", "10"], "bucket size"),
    (["--dp", "1000"], "dp must be <="),
    (["--ep", "0"], "ep must be"),
    (["--dp", "3", "--ep", "2"], "ep=2 does not divide the dp x tp = 3 x 1"),
    (["--dp", "2", "--ep", "2", "--preset", "tiny"], "needs a mixture-of-experts preset"),
    (["--dp", "2", "--tp", "2", "--preset", "tiny-moe"], "split over TP under expert parallelism only"),
    (["--dp", "2", "--ep", "2", "--tp", "2", "--tp-style", "dtensor"], "Megatron-style only"),
    (["--dp", "1", "--ep", "2", "--tp", "8", "--preset", "tiny-moe-attn"], "tp=8 must divide"),
    (["--dp", "8", "--ep", "8"], "ep=8 does not divide the 4 experts"),
    (["--dp", "2", "--ep", "2", "--policy", "zero1"], "zero1"),
    (["--fsdp", "--tp", "2", "--dp", "4", "--hsdp-replicate", "2"], "verified without --hsdp-replicate"),
    (["--fsdp", "--ep", "2"], "--fsdp --ep 2 is run with --optimizer adamw"),
    (["--fsdp", "--dp", "4", "--ep", "2", "--optimizer", "adamw", "--hsdp-replicate", "2"],
     "without --hsdp-replicate"),
    (["--fsdp", "--dp", "1"], "give --dp 2 or more"),
    # the red team's --fsdp --ep inputs: each one line before any spawn
    (["--fsdp", "--dp", "3", "--ep", "2", "--optimizer", "adamw"], "ep=2 does not divide the dp x tp = 3 x 1"),
    (["--fsdp", "--dp", "8", "--ep", "8", "--optimizer", "adamw"], "ep=8 does not divide the 4 experts"),
    (["--fsdp", "--dp", "2", "--ep", "2", "--optimizer", "adamw", "--preset", "tiny"],
     "needs a mixture-of-experts preset"),
    (["--fsdp", "--dp", "4", "--ep", "2", "--optimizer", "adamw", "--tp", "2"], "at --tp 1"),
    (["--fsdp", "--dp", "4", "--ep", "-2", "--optimizer", "adamw"], "ep must be"),
    (["--fsdp", "--dp", "4", "--ep", "2", "--optimizer", "adamw", "--steps", "0"], "steps must be"),
    # --fsdp --tp of a MoE preset: before, 'give --ep too', which --fsdp --ep at --tp 2 refuses
    (["--fsdp", "--dp", "2", "--tp", "2", "--preset", "tiny-moe", "--optimizer", "adamw"],
     "--fsdp --tp 2 is verified on the dense presets"),
    # AdamW's FSDP2 step: its own policy, no owners to plan
    (["--fsdp", "--optimizer", "adamw", "--policy", "canzona"], "each rank steps its own shards (FSDP2's), policy zero1"),
    (["--fsdp", "--optimizer", "adamw", "--alpha", "0.5"], "alpha 0.5: canzona's owner plan settings change nothing"),
    (["--fsdp", "--policy", "fsdp-gather-all"], "is a simulator baseline"),
    (["--fsdp", "--policy", "zero1"], "'zero1' is not an FSDP policy"),
    # round-robin owners: no plan places them, and the run verified the default's
    (["--fsdp", "--policy", "fsdp-owners-unbalanced", "--alpha", "0.5"], "alpha 0.5: canzona's owner plan settings"),
    (["--fsdp", "--preset", "tiny-moe"], "a whole-matrix optimizer over them is not run under FSDP2"),
    (["--hsdp-replicate", "2"], "it needs --fsdp"),
    (["--fsdp", "--dp", "4", "--hsdp-replicate", "3"], "--hsdp-replicate 3 must divide the 4"),
    (["--fsdp", "--dp", "2", "--hsdp-replicate", "2"], "shard group of 1 rank"),
    (["--fsdp", "--dp", "3", "--global-batch", "8"], "not divisible by dp x accumulation"),
    (["--fsdp", "--steps", "1000", "--preset", "small"], "rank 0 keeps each step's global gradients"),
])
def test_bad_input_is_one_line_exit_2(monkeypatch, args, needle):
    def no_spawn(*a, **k):
        raise AssertionError("bad input must fail before any spawn")

    monkeypatch.setattr(checks, "run", no_spawn)
    line = one_error_line(*run(*args))
    assert needle in line, line


def test_fsdp_all_policies_run_the_round_robin_owners_at_the_default_plan_settings():
    """`--fsdp --policy all --alpha 0.5`: canzona's owners are planned at the settings given, the
    round-robin owners (which refuse them: no plan places them) at the defaults, as `compare --fsdp`
    runs its baselines; named alone, fsdp-owners-unbalanced refuses them (the list above)."""
    cases = checks.prepare(2, "muon", "all", steps=1, fsdp=True, alpha=0.5, bucket_size=10**6)
    assert {(c.spec.policy, c.spec.alpha, c.spec.bucket_size) for c in cases} == {
        ("canzona", 0.5, 10**6), ("fsdp-owners-unbalanced", PLAN_DEFAULTS.alpha, PLAN_DEFAULTS.bucket_size)}


def test_default_global_batch_divides():
    cases = checks.prepare(3, "all", "all", steps=1, accumulation=2)
    assert {c.spec.global_batch for c in cases} == {24}
    # every registered optimizer under every policy that runs it: the matrix optimizers under the
    # four matrix policies, AdamW under zero1
    matrix = [o for o in checks.OPTIMIZERS if o != "adamw"]
    assert {(c.spec.optimizer, c.spec.policy) for c in cases} == {
        *((o, p) for o in matrix for p in checks.POLICIES if p != "zero1"), ("adamw", "zero1")}
    assert len(cases) == 4 * len(matrix) + 1


# --- failures: exit 1 ----------------------------------------------------------------------------


def test_rank_failure_is_one_line_exit_1(monkeypatch):
    def failing(*a, **k):
        raise RankError(1, "RuntimeError: boom\nmore", "Traceback ...")

    monkeypatch.setattr(checks, "run", failing)
    line = one_error_line(*run(*QUICK), code=1)
    assert line == "error: rank 1: RuntimeError: boom"


def _synthetic(dp: int = 2):
    case = checks.prepare(dp, "muon", "canzona", steps=1)[0]
    want = {"a": torch.tensor([1.0, 2.0, 4.0]), "b": torch.tensor([[0.5, -0.5]])}
    return case, want


def results(params_by_rank: list[dict]) -> list[dict]:
    """What spawned DP ranks (TP 1) return, around their final parameters."""
    return [{"params": p, "losses": [], "dp_rank": r, "tp_rank": 0, "tp_dims": {}}
            for r, p in enumerate(params_by_rank)]


def test_check_case_verdicts():
    case, want = _synthetic()
    same = [{n: t.clone() for n, t in want.items()} for _ in range(2)]
    rows = checks.check_case(case, 2, results(same), want, want)
    assert [r["ok"] for r in rows] == [True, True, True]

    off = [{n: t.clone() for n, t in want.items()} for _ in range(2)]
    off[1]["a"][2] += 4.0 * 1e-6  # rank 1 off by 1e-6 relative: 3a fails, 3b passes, ranks disagree
    ranks, same_kernels, reference = checks.check_case(case, 2, results(off), want, want)
    assert not ranks["ok"] and ranks["worst_rank"] == 1 and ranks["worst_param"] == "a"
    assert not same_kernels["ok"] and same_kernels["result"] == "differs"
    assert reference["ok"] and reference["max_rel_diff"] == pytest.approx(1e-6, rel=0.1)

    off[0]["b"][0, 0] += 1e-3  # both ranks now far from the reference
    reference = checks.check_case(case, 2, results(off), want, want)[2]
    assert not reference["ok"] and reference["worst_param"] == "b" and reference["worst_rank"] == 0


def test_non_finite_parameters_fail_and_serialise():
    case, want = _synthetic()
    nan = [{n: t.clone() for n, t in want.items()} for _ in range(2)]
    for p in nan:
        p["a"][0] = float("nan")
    rows = checks.check_case(case, 2, results(nan), want, want)
    assert not any(r["ok"] for r in rows)  # NaN equals nothing, not even rank 0's NaN
    assert rows[2]["max_rel_diff"] == math.inf and rows[2]["worst_param"] == "a"
    report = checks.report(rows)
    assert report["ok"] is False and report["failed"] == 3
    assert json.loads(json.dumps(report, allow_nan=False))["rows"][2]["max_rel_diff"] is None


def test_mismatch_exits_1_with_the_table(monkeypatch):
    case, want = _synthetic()
    bad = [{n: t + 1 for n, t in want.items()} for _ in range(2)]
    monkeypatch.setattr(checks, "run", lambda cases, dp, progress=None: checks.check_case(case, 2, results(bad), want, want))
    result, out, err = run(*QUICK)
    assert result.exit_code == 1, (out, err)
    assert "FAIL" in out and "2 of 3 checks FAILED" in out
    result, out, err = run(*QUICK, "--json")
    assert result.exit_code == 1
    assert json.loads(out)["ok"] is False


@pytest.mark.distributed
def test_progress_follows_the_training_step_by_step():
    cases = checks.prepare(2, "muon", "canzona", steps=3) + checks.prepare(2, "muon", "sc", steps=3)
    seen: list[tuple[int, int, str]] = []
    rows = checks.run(cases, 2, progress=lambda done, total, what: seen.append((done, total, what)))
    assert all(r["ok"] for r in rows)
    total = 6 + 2 * 1 + 2  # training steps, one emulation + reference pair, two checks
    assert {t for _, t, _ in seen} == {total}
    done = [d for d, _, _ in seen]
    assert done == sorted(done) and done[-1] == total
    training = [(d, w) for d, _, w in seen if "step" in w]
    assert training and training[-1] == (6, "training muon / sc on 2 rank(s): step 3 of 3")
