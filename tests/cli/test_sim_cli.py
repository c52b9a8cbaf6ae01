"""The `canzona simulate` and `canzona compare` commands: JSON, trace, plot, and one-line errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from canzona.step_policies import STEP_POLICIES
from tests.cli_helpers import error_line, invoke

SMALL = ["--model", "qwen3-0.6b", "--gpus", "16", "--tp", "2", "--seq-len", "256", "--global-batch", "16"]
TINY = ["--model", "qwen3-0.6b", "--gpus", "8", "--tp", "8", "--seq-len", "128", "--global-batch", "1"]
REQUIRED = {"iteration_time_s", "optimizer_step_s", "breakdown", "rank_optimizer_s", "policy",
            "grad_sync_end_s", "optimizer_breakdown", "definitions"}
POLICY_NAMES = {"sc", "zero1-gather", "layerwise", "canzona", "zero1"}


run = invoke
assert_one_error_line = error_line


# --- simulate ---------------------------------------------------------------------------------


def test_simulate_json_prints_one_object():
    result = run("simulate", *SMALL, "--policy", "layerwise", "--json")
    assert result.exit_code == 0, result.stderr
    d = json.loads(result.stdout)
    assert isinstance(d, dict)
    assert REQUIRED <= set(d)
    assert d["policy"] == "layerwise" and d["gpus"] == 16 and d["tp"] == 2
    assert len(d["rank_optimizer_s"]) == 16
    assert d["iteration_time_s"] >= d["optimizer_step_s"] > 0
    assert set(d["breakdown"]) == {"compute_s", "exposed_comm_s", "idle_s"}
    assert len(result.stdout.strip().splitlines()) == 1


def test_simulate_json_matches_the_library():
    from sim.simulate import SimConfig, simulate
    from sim.workload import Workload

    result = run("simulate", *SMALL, "--json")
    assert result.exit_code == 0, result.stderr
    lib = simulate(SimConfig(model="qwen3-0.6b", gpus=16, tp=2, workload=Workload(256, 16)))
    assert json.loads(result.stdout) == json.loads(json.dumps(lib.to_dict()))


def test_simulate_tp_mode():
    """Serial micro-groups wait for every collective; the pipeline overlaps them with compute."""
    steps = {}
    for mode in ("pipelined", "serial"):
        result = run("simulate", *SMALL, "--tp-mode", mode, "--tp-policy", "tp-chunk", "--no-zero1-fallback",
                     "--json")
        assert result.exit_code == 0, result.stderr
        d = json.loads(result.stdout)
        assert d["tp_mode"] == mode
        steps[mode] = d["optimizer_step_s"]
    assert steps["pipelined"] < steps["serial"]


def test_simulate_run_options_reach_the_result():
    result = run("simulate", *SMALL, "--no-overlap-param-gather", "--no-tp-comm-overlap", "--recompute", "full",
                 "--reduce-scatter", "padded", "--no-zero1-fallback", "--max-grad-norm", "1.0",
                 "--no-align-grad-reduce", "--pp", "2", "--json")  # align_grad_reduce acts under --pp only
    assert result.exit_code == 0, result.stderr
    d = json.loads(result.stdout)
    assert d["options"] == {"overlap_grad_reduce": True, "align_grad_reduce": False, "overlap_param_gather": False, "tp_comm_overlap": False,
                            "tp_comm_overlap_cfg": "userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192",
                            "recompute": "full", "recompute_method": None, "recompute_num_layers": None,
                            "selective_ac_option": None, "reduce_scatter": "padded", "collectives": "megatron", "max_grad_norm": 1.0,
                                "explicit_clip": False,
                            "batch_kernels": True, "compile_kernels": False, "overlap_step": False,
                            "attention_backend": "fused",
                            "ep_dispatcher": {"moe_token_dispatcher_type": "alltoall",
                                              "moe_flex_dispatcher_backend": None, "moe_hybridep_num_sms": 16,
                                              "moe_deepep_num_sms": 20,
                                              "fake_balanced_gate": False, "routing": "random"},
                            "overlap_moe_expert_parallel_comm": False, "delay_wgrad_compute": False}
    assert d["param_gather_exposed_s"] == 0.0 and 0 < d["mfu"] < 1


def test_recompute_method_round_trips():
    """Megatron's --recompute-method / --recompute-num-layers reach the options, the table's caption
    and the time: block over the first 4 of qwen3-0.6b's 28 layers recomputes less than every layer."""
    args = [*SMALL, "--recompute", "full"]
    full = json.loads(run("simulate", *args, "--json").stdout)
    result = run("simulate", *args, "--recompute-method", "block", "--recompute-num-layers", "4", "--json")
    assert result.exit_code == 0, result.stderr
    d = json.loads(result.stdout)
    assert (d["options"]["recompute_method"], d["options"]["recompute_num_layers"]) == ("block", 4)
    assert d["iteration_time_s"] < full["iteration_time_s"]
    table = run("simulate", *args, "--recompute-method", "uniform", "--recompute-num-layers", "7")
    assert table.exit_code == 0 and "recompute full (uniform 7)" in table.stdout


def test_the_simulator_settings_are_passed_by_name():
    """`_sim_config` and `_run_options` take some thirty options, many of one type: keyword-only,
    so that no command can pass one in another's place."""
    import inspect

    from cli.main import _run_options, _sim_config

    for build in (_sim_config, _run_options):
        kinds = {p.kind for p in inspect.signature(build).parameters.values()}
        assert kinds == {inspect.Parameter.KEYWORD_ONLY}, build.__name__


def test_grad_reduce_in_fp32_halves_the_gradient_buffers():
    """--no-grad-reduce-in-fp32 (Megatron's DDP option, off in NVIDIA's performance recipes): bf16
    gradient buffers, half the default fp32's, and the same everything else of the layout."""
    fp32, bf16 = (json.loads(run("simulate", *SMALL, "--optimizer", "adamw", *flag, "--json").stdout)
                  for flag in ((), ("--no-grad-reduce-in-fp32",)))
    assert fp32["workload"]["grad_bytes"] == 4 and bf16["workload"]["grad_bytes"] == 2
    assert fp32["memory"]["worst"]["grads"] == 2 * bf16["memory"]["worst"]["grads"]
    assert fp32["memory"]["worst"]["weights"] == bf16["memory"]["worst"]["weights"]


def test_max_grad_norm_prices_the_clip_and_is_checked():
    """The runtime's max_grad_norm scales each rank's share of the gradients once more: priced."""
    steps = {}
    for extra in ([], ["--max-grad-norm", "1.0"]):
        result = run("simulate", *SMALL, "--no-zero1-fallback", *extra, "--json")
        assert result.exit_code == 0, result.stderr
        steps[bool(extra)] = json.loads(result.stdout)["optimizer_step_s"]
    assert steps[True] > steps[False]
    bad = run("simulate", *SMALL, "--max-grad-norm", "0")
    assert bad.exit_code == 2 and "error: max_grad_norm must be a positive number" in bad.stderr


def test_explicit_clip_prices_the_step_recheck():
    """--explicit-clip (the loop calls clip_grad_norm_ before step()): the runtime's step rechecks the
    clip's check with one small all-gather over DP and one over TP, which the optimizer step pays."""
    steps = {}
    for extra in ([], ["--explicit-clip"]):
        result = run("simulate", *SMALL, "--collectives", "runtime", "--no-zero1-fallback", *extra, "--json")
        assert result.exit_code == 0, result.stderr
        d = json.loads(result.stdout)
        assert d["options"]["explicit_clip"] is bool(extra)
        steps[bool(extra)] = d["optimizer_step_s"]
    assert steps[True] > steps[False]


def test_simulate_table():
    result = run("simulate", *SMALL)
    assert result.exit_code == 0, result.stderr
    for text in ("iteration time", "optimizer-step latency", "qwen3-0.6b", "canzona"):
        assert text in result.stdout


def test_simulate_trace(tmp_path):
    path = tmp_path / "t.json"
    result = run("simulate", *SMALL, "--trace", path)
    assert result.exit_code == 0, result.stderr
    assert "trace written" in result.stdout
    data = json.loads(path.read_text())
    spans = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    assert spans and all({"pid", "tid", "ts", "dur"} <= set(e) for e in spans)
    assert {e["pid"] for e in data["traceEvents"] if e.get("ph") == "M"} == set(range(16))


def test_pipeline_trace_shows_every_stage(tmp_path):
    """Each stage's first rank is simulated; the stage's other ranks show its phase A."""
    path = tmp_path / "t.json"
    result = run("simulate", "--model", "qwen3-0.6b", "--gpus", "16", "--tp", "2", "--pp", "2", "--seq-len", "256",
                 "--global-batch", "16", "--trace", path)
    assert result.exit_code == 0, result.stderr
    events = json.loads(path.read_text())["traceEvents"]
    copied = {e["pid"]: e["name"] for e in events if e.get("name", "").startswith("forward/backward (as rank")}
    assert copied[1] == "forward/backward (as rank 0)" and copied[9] == "forward/backward (as rank 8)"
    assert any(e["pid"] == 8 and "send" in e.get("name", "") for e in events)  # stage 1's own sends


def test_simulate_trace_with_json(tmp_path):
    path = tmp_path / "t.json"
    result = run("simulate", *TINY, "--trace", path, "--json")
    assert result.exit_code == 0, result.stderr
    json.loads(result.stdout)
    assert "traceEvents" in json.loads(path.read_text())


# --- compare ----------------------------------------------------------------------------------


def test_compare_json_lists_every_policy():
    result = run("compare", *SMALL, "--json")
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)
    assert isinstance(rows, list) and len(rows) == 5
    assert [r["policy"] for r in rows] == list(STEP_POLICIES)
    # the matrix policies run the optimizer asked for; zero1, beside them, the AdamW baseline
    assert [r["optimizer"] for r in rows] == ["muon"] * 4 + ["adamw"]
    assert {r["policy"] for r in rows} == POLICY_NAMES
    for r in rows:
        assert REQUIRED <= set(r)
        assert len(r["rank_optimizer_s"]) == 16


def test_compare_table():
    result = run("compare", *TINY)
    assert result.exit_code == 0, result.stderr
    for name in POLICY_NAMES:
        assert name in result.stdout
    assert "zero1 (adamw)" in result.stdout and "the run most users have today" in result.stdout


def test_compare_plot_writes_a_png(tmp_path):
    path = tmp_path / "x.png"
    result = run("compare", *TINY, "--plot", path)
    assert result.exit_code == 0, result.stderr
    assert "plot written" in result.stdout
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 1000


# --- errors -----------------------------------------------------------------------------------


BAD = [
    (["--gpus", "100", "--tp", "8"], ("100",)),
    (["--tp", "16"], ("tp=16",)),
    (["--model", "qwen3-0.6b", "--gpus", "16", "--tp", "2", "--global-batch", "3"], ("global batch",)),
    (["--hardware", "nope"], ("nope",)),
    (["--hardware", "/nonexistent/profile.json"], ("/nonexistent/profile.json",)),
    (["--optimizer", "nope"], ()),
    (["--model", "nope"], ()),
    (["--seq-len", "0"], ("seq len",)),
    (["--capacity", "lots"], ()),
    (["--tp-mode", "eager"], ("unknown TP mode 'eager'",)),
    (["--recompute", "some"], ("unknown recompute mode 'some'",)),
    (["--recompute", "full", "--recompute-method", "all"], ("unknown recompute method 'all'",)),
    (["--recompute", "full", "--recompute-method", "block"], ("go together",)),
    (["--recompute-method", "uniform", "--recompute-num-layers", "1"], ("is for --recompute full",)),
    (["--recompute", "full", "--recompute-method", "block", "--recompute-num-layers", "0"], ("whole number >= 1",)),
    (["--model", "qwen3-0.6b", "--gpus", "16", "--tp", "2", "--recompute", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "5"], ("groups of 5",)),
    (["--reduce-scatter", "ring"], ("unknown reduce_scatter 'ring'",)),
    (["--collectives", "nccl"], ("unknown collectives mode 'nccl'",)),
    (["--explicit-clip"], ("--explicit-clip", "needs --collectives runtime")),
]


@pytest.mark.parametrize("args,needles", BAD)
def test_simulate_bad_inputs_exit_2_with_one_line(args, needles):
    assert_one_error_line(run("simulate", *args), *needles)


@pytest.mark.parametrize("args,needles", BAD)
def test_compare_bad_inputs_exit_2_with_one_line(args, needles):
    assert_one_error_line(run("compare", *args), *needles)


@pytest.mark.parametrize("args,needles", BAD)
def test_compare_bad_inputs_exit_2_with_an_error_line(args, needles):
    """What holds today despite the blank line: exit 2, no traceback, the last stderr line is the error."""
    result = run("compare", *args)
    assert result.exit_code == 2, (result.stdout, result.stderr, result.exception)
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0]


def test_unknown_policy():
    assert_one_error_line(run("simulate", *TINY, "--policy", "nope"), "nope")


def test_unwritable_trace_path():
    line = assert_one_error_line(run("simulate", *TINY, "--trace", "/nonexistent/dir/t.json"))
    assert "/nonexistent/dir/t.json" in line


def test_unwritable_plot_path():
    line = assert_one_error_line(run("compare", *TINY, "--plot", "/nonexistent/dir/x.png"))
    assert "/nonexistent/dir/x.png" in line


def test_unwritable_plot_path_is_reported():
    result = run("compare", *TINY, "--plot", "/nonexistent/dir/x.png")
    assert result.exit_code == 2
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert lines == [lines[-1]] and lines[-1].startswith("error: cannot write plot /nonexistent/dir/x.png")
    assert "Traceback" not in result.output


def _profile(tmp_path, section: str, key: str, value) -> str:
    from importlib import resources

    data = json.loads((resources.files("canzona") / "profiles" / "h100-sxm.json").read_text())
    data[section][key] = value
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_malformed_profile_is_one_error_line(tmp_path):
    path = _profile(tmp_path, "network", "nic_busbw", -1)
    assert_one_error_line(run("simulate", *TINY, "--hardware", path), "nic_busbw")


def test_a_misspelt_profile_section_is_one_error_line(tmp_path):
    """A section the profile does not have (`gemm-model` for `gemm_model`) was ignored: the run
    went on with no GEMM model at all, its times silently wrong."""
    from importlib import resources

    data = json.loads((resources.files("canzona") / "profiles" / "h100-sxm.json").read_text())
    data["gemm-model"] = data.pop("gemm_model")
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    assert_one_error_line(run("simulate", *TINY, "--hardware", str(path)), "unknown profile section 'gemm-model'")
    # every section `canzona calibrate` writes is one a profile has
    from canzona.calibration import MEASURED_SECTIONS
    from canzona.hardware import PROFILE_KEYS

    assert set(MEASURED_SECTIONS) <= PROFILE_KEYS


@pytest.mark.parametrize("section,key,value", [("gpu", "sms", 0.5),
                                               ("gpu", "peak_flops", {"fp16": 1e15})], ids=["sms", "no-bf16"])
def test_bad_profile_values_do_not_crash(tmp_path, section, key, value):
    assert_one_error_line(run("simulate", *TINY, "--hardware", _profile(tmp_path, section, key, value)))


# --- the default comparison, as a user runs it -------------------------------------------------


def test_default_compare_subprocess():
    """`canzona compare` with no arguments: Qwen3-32B on 256 H100s, TP 8."""
    exe = shutil.which("canzona")
    cmd = [exe, "compare"] if exe else [sys.executable, "-m", "cli.main", "compare"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    for name in POLICY_NAMES:
        assert name in proc.stdout
    assert "qwen3-32b" in proc.stdout.lower()
    assert "256" in proc.stdout


@pytest.mark.parametrize("args, needles", [
    (["--fsdp", "--no-align-grad-reduce"], ("--no-align-grad-reduce", "under --fsdp")),
    (["--pp", "2", "--no-overlap-grad-reduce", "--no-align-grad-reduce"],
     ("changes nothing without --overlap-grad-reduce",)),
    (["--no-align-grad-reduce"], ("changes nothing at --pp 1",)),
])
def test_an_align_grad_reduce_that_changes_nothing_is_one_line(args, needles):
    """Megatron's align_grad_reduce acts only on the ZeRO-1 layout's pipeline schedule with its
    overlapped bucket reductions: off anywhere else it would be echoed back doing nothing."""
    from tests.cli_helpers import error_line, invoke

    error_line(invoke("simulate", *SMALL, *args), *needles)
    error_line(invoke("compare", *SMALL, *args), *needles)


@pytest.mark.parametrize("args, needle", [
    (["--alpha", "0.5"], "--alpha 0.5"),
    (["--geometry", "whole"], "--geometry whole"),
    (["--tp-policy", "tp-chunk"], "--tp-policy tp-chunk"),
    (["--tp-mode", "serial"], "--tp-mode serial"),
    (["--capacity", "1GiB"], "--capacity"),
    (["--no-batch-kernels"], "--no-batch-kernels changes nothing with --optimizer adamw"),
])
def test_an_elementwise_optimizers_no_op_settings_are_one_line(args, needle):
    """AdamW's one step policy (zero1) plans with its own DP and TP policies and has no batched
    kernel: canzona's plan settings and --no-batch-kernels were accepted there and changed nothing;
    at their defaults they stay accepted."""
    from tests.cli_helpers import error_line, invoke

    for command in ("simulate", "compare"):
        error_line(invoke(command, *SMALL, "--optimizer", "adamw", *args), needle)
    assert invoke("simulate", *SMALL, "--optimizer", "adamw", "--alpha", "1.0", "--tp-mode", "pipelined",
                  "--batch-kernels", "--json").exit_code == 0


@pytest.mark.parametrize("optimizer", ["adamw", "normuon"])
def test_no_batch_kernels_without_a_batched_kernel_is_its_own_error_at_the_default_tp(optimizer):
    """Without --tp the default TP is chosen with the flag unset (its refusal is of the flag, not
    of a layout: cli.main.FLAG_ONLY_SETTINGS), so the error is the flag's own. Before: "no --tp of
    8, 4, 2, 1 runs this layout; at --tp 4: --no-batch-kernels changes nothing ..."."""
    from tests.cli_helpers import error_line, invoke

    line = error_line(invoke("simulate", "--model", "qwen3-0.6b", "--gpus", "8", "--seq-len", "256", "--global-batch",
                             "8", "--optimizer", optimizer, "--no-batch-kernels"),
                      f"--no-batch-kernels changes nothing with --optimizer {optimizer}")
    assert line.startswith("error: --no-batch-kernels"), line


@pytest.mark.parametrize("policy", ["sc", "zero1-gather", "layerwise"])
@pytest.mark.parametrize("args, needle", [
    (["--geometry", "whole"], "--geometry whole"),
    (["--tp-mode", "serial"], "--tp-mode serial"),
    (["--capacity", "1GiB"], "--capacity 1GiB"),
])
def test_a_baselines_no_op_plan_settings_are_one_line(policy, args, needle):
    """The baselines (sc, zero1-gather, layerwise) plan with their own DP policy and tp-sync, so
    canzona's segment geometry and its TP micro-groups' order and capacity changed nothing there
    (the same figures to the byte), while --dp-policy, --alpha and --tp-policy were refused; at
    their defaults they stay accepted, and canzona takes them."""
    from tests.cli_helpers import error_line, invoke

    error_line(invoke("simulate", *SMALL, "--policy", policy, *args), needle, "canzona policy only", policy)
    assert invoke("simulate", *SMALL, "--policy", policy, "--geometry", "auto", "--tp-mode", "pipelined",
                  "--capacity", "auto", "--json").exit_code == 0
    assert invoke("simulate", *SMALL, "--policy", "canzona", *args, "--json").exit_code == 0


def test_align_and_balance_by_reach_the_simulator():
    """`DistributedOptimizer`'s align and balance_by (canzona.plan.PlanSettings) change the plan the
    runtime executes; simulate and compare take them by the same names and defaults (`canzona plan
    --align / --balance-by` wrote a plan file simulate could not reproduce), as `SimConfig` does."""
    from sim.simulate import SimConfig, simulate
    from sim.workload import Workload

    args = ["--align", "128", "--balance-by", "elements"]
    got = json.loads(run("simulate", *SMALL, *args, "--json").stdout)
    want = simulate(SimConfig(model="qwen3-0.6b", gpus=16, tp=2, workload=Workload(256, 16), align=128,
                              balance_by="elements")).to_dict()
    assert got == json.loads(json.dumps(want))
    assert got != json.loads(run("simulate", *SMALL, "--json").stdout)  # the plan balanced by elements
    rows = {r["policy"]: r for r in json.loads(run("compare", *SMALL, *args, "--json").stdout)}
    assert rows["canzona"] == got
    # a policy whose plan no balance unit changes (even segments, or every rank every matrix) refuses it
    for policy in ("zero1-gather", "sc"):
        error_line(run("simulate", *SMALL, "--policy", policy, "--balance-by", "elements"),
                   "--balance-by elements", "changes nothing", policy)
    error_line(run("simulate", *SMALL, "--optimizer", "adamw", "--balance-by", "elements"), "--balance-by elements")
    assert run("simulate", *SMALL, "--policy", "layerwise", "--balance-by", "elements", "--json").exit_code == 0


def test_simulate_json_records_the_plan_settings_it_ran():
    """The plan's settings are in the JSON: before, `--alpha 0.5 --align 256 --bucket-size 12345678
    --balance-by elements` gave a JSON with none of them, which could not be told from the default
    run's."""
    default = json.loads(run("simulate", *SMALL, "--json").stdout)["plan_settings"]
    result = run("simulate", *SMALL, "--alpha", "0.5", "--align", "256", "--bucket-size", "12345678",
                 "--balance-by", "elements", "--capacity", "20ms", "--json")
    assert result.exit_code == 0, result.stderr
    given = json.loads(result.stdout)["plan_settings"]
    assert given == {"alpha": 0.5, "balance_by": "elements", "bucket_size": 12345678, "align": 256,
                     "geometry": default["geometry"], "capacity": given["capacity"]}
    assert given["capacity"] is not None and default["capacity"] is None
    assert default["alpha"] != 0.5 and default["balance_by"] != "elements"
