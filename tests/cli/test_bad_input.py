"""Hostile and mistaken input found by trying the CLI hard: each case ends in one `error:` line and
exit code 2 before any work starts, and leaves no partial file behind."""

from __future__ import annotations

import errno
import json
import os
import re
from importlib import resources
from pathlib import Path

import pytest

import canzona.fileio as fileio
import sim.simulate
from canzona.errors import CanzonaError, PlanError, SpecError
from canzona.fileio import parse_json, read_text, write_atomic, write_text_atomic
from canzona.hardware import load_profile
from canzona.models import resolve_model
from canzona.plan import load_plan
from sim.options import RunOptions
from sim.workload import MAX_MICRO_BATCHES, Workload
from tests.cli_helpers import error_line, help_text, invoke

PLAN = ["--model", "qwen3-0.6b", "--dp", "4", "--tp", "2"]
SIM = ["--model", "qwen3-0.6b", "--gpus", "8", "--tp", "8", "--seq-len", "128", "--global-batch", "1"]


@pytest.fixture
def no_simulation(monkeypatch):
    """Output paths are checked before the (long) simulation: running it is a failure here."""
    def refuse(*a, **k):
        raise AssertionError("bad input must be rejected before simulating")

    monkeypatch.setattr(sim.simulate, "simulate", refuse)
    monkeypatch.setattr(sim.simulate, "compare", refuse)


# --- output paths -------------------------------------------------------------------------------


@pytest.mark.parametrize("name, needle", [
    ("x.xyz", "unsupported extension '.xyz'"),
    ("noext", "no extension"),
    ("missing/x.png", "does not exist"),
])
def test_plot_path_is_checked_before_simulating(tmp_path, no_simulation, name, needle):
    error_line(invoke("compare", *SIM, "--plot", tmp_path / name), needle)
    assert list(tmp_path.iterdir()) == []


def test_plot_formats_by_extension(tmp_path):
    for name in ("cmp.svg", "cmp.pdf"):
        result = invoke("compare", *SIM, "--plot", tmp_path / name)
        assert result.exit_code == 0, result.stderr
        assert f"plot written to {tmp_path / name}" in result.stdout
    assert (tmp_path / "cmp.svg").read_text().lstrip().startswith(("<?xml", "<svg"))
    assert (tmp_path / "cmp.pdf").read_bytes().startswith(b"%PDF")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cmp.pdf", "cmp.svg"]  # no temporaries left


def test_trace_and_plan_paths_are_checked_first(tmp_path, no_simulation):
    error_line(invoke("simulate", *SIM, "--trace", tmp_path / "no" / "t.json"), "does not exist")
    (tmp_path / "d.json").mkdir()
    error_line(invoke("simulate", *SIM, "--trace", tmp_path / "d.json"), "is a directory")
    error_line(invoke("plan", *PLAN, "--out", tmp_path / "d.json"), "is a directory")
    error_line(invoke("plan", *PLAN, "--out", tmp_path / "plan.txt"), "unsupported extension '.txt'")
    error_line(invoke("simulate", *SIM, "--trace", tmp_path / "trace"), "no extension")


def test_outputs_never_replace_devices_links_or_files_in_the_way(tmp_path, no_simulation):
    """Renaming over a device or a symlink would replace it (as root, /dev/null itself)."""
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    error_line(invoke("plan", *PLAN, "--out", fifo), "not a regular file")
    target = tmp_path / "real.json"
    target.write_text("keep")
    (tmp_path / "link.json").symlink_to(target)
    error_line(invoke("plan", *PLAN, "--out", tmp_path / "link.json"), "symbolic link")
    error_line(invoke("simulate", *SIM, "--trace", tmp_path / "link.json"), "symbolic link")
    assert target.read_text() == "keep" and (tmp_path / "link.json").is_symlink() and fifo.is_fifo()
    (tmp_path / "file").write_text("")
    error_line(invoke("plan", *PLAN, "--out", tmp_path / "file" / "x.json"), "is not a folder")
    error_line(invoke("plan", *PLAN, "--out", tmp_path / ("x" * 300 + ".json")), "longer than 255 bytes")
    error_line(invoke("compare", *SIM, "--plot", tmp_path / ("x" * 300 + ".png")), "longer than 255 bytes")


def test_an_output_never_replaces_the_file_the_command_reads(tmp_path, no_simulation):
    """A trace, plan, spec or plot written over the model, hardware or cost file the same command
    reads would destroy it (the next run fails on it): refused, whatever path spells it."""
    model = tmp_path / "config.json"
    model.write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
                                 "intermediate_size": 3072, "num_hidden_layers": 4, "num_attention_heads": 16,
                                 "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                                 "tie_word_embeddings": True}))
    hardware = tmp_path / "hw.json"
    hardware.write_text(resources.files("canzona").joinpath("profiles", "h100-sxm.json").read_text())
    kept = {p: p.read_bytes() for p in (model, hardware)}
    sim = ["--gpus", "8", "--tp", "1", "--seq-len", "128", "--global-batch", "8"]
    error_line(invoke("simulate", "--model", model, *sim, "--trace", model), "it is the input file")
    error_line(invoke("simulate", "--model", model, *sim, "--hardware", hardware, "--trace",
                      tmp_path / "." / "hw.json"), "it is the input file")
    error_line(invoke("compare", "--model", model, *sim, "--hardware", hardware, "--plot", hardware),
               "it is the input file")
    error_line(invoke("plan", "--model", model, "--dp", "8", "--tp", "1", "--out", model), "it is the input file")
    error_line(invoke("spec", model, "--out", model), "it is the input file")
    (tmp_path / "link.json").symlink_to(model)  # the model read through a link: still its file
    error_line(invoke("simulate", "--model", tmp_path / "link.json", *sim, "--trace", model), "it is the input file")
    assert {p: p.read_bytes() for p in (model, hardware)} == kept



def test_an_output_never_replaces_the_config_of_a_model_folder(tmp_path, no_simulation):
    """A Hugging Face model folder is read through its config.json: `canzona spec folder --out
    folder/config.json` replaced the config with a spec file (and `plan --out` then with a plan, on
    which the next run failed), the input check comparing the output with the folder, not with the
    file read. Refused as any other input file."""
    folder = tmp_path / "model"
    folder.mkdir()
    config = folder / "config.json"
    config.write_text(json.dumps({"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
                                  "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 8,
                                  "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True}))
    kept = config.read_bytes()
    sim = ["--gpus", "8", "--tp", "1", "--seq-len", "128", "--global-batch", "8"]
    error_line(invoke("spec", folder, "--out", config), "it is the input file")
    error_line(invoke("plan", "--model", folder, "--dp", "8", "--tp", "1", "--out", config), "it is the input file")
    error_line(invoke("simulate", "--model", folder, *sim, "--trace", config), "it is the input file")
    error_line(invoke("compare", "--model", folder, *sim, "--plot", folder / "config.json"), "it is the input file")
    assert config.read_bytes() == kept and [p.name for p in folder.iterdir()] == ["config.json"]


def test_an_output_never_replaces_a_shipped_profile_named_by_name(tmp_path, monkeypatch, no_simulation):
    """`--hardware h100-sxm` reads the package's own profiles/h100-sxm.json: an output at that path
    was not recognised as the input (names were compared as paths) and would have replaced the
    shipped profile. The package's folder is a copy here, so a failure harms no checkout."""
    import shutil
    from importlib import resources

    import canzona.hardware as hardware

    package = tmp_path / "canzona"
    shutil.copytree(resources.files("canzona") / "profiles", package / "profiles")
    monkeypatch.setattr(hardware.resources, "files", lambda name: package)
    shipped = package / "profiles" / "h100-sxm.json"
    kept = shipped.read_bytes()
    sim = ["--model", "qwen3-0.6b", "--hardware", "h100-sxm", "--gpus", "8", "--tp", "1", "--seq-len", "128",
           "--global-batch", "8"]
    error_line(invoke("plan", "--model", "qwen3-0.6b", "--hardware", "h100-sxm", "--dp", "8", "--tp", "1",
                      "--out", shipped), "it is the input file")
    error_line(invoke("simulate", *sim, "--trace", shipped), "it is the input file")
    assert shipped.read_bytes() == kept


def test_a_long_name_that_fits_is_written(tmp_path):
    name = "p" * 250 + ".json"
    assert invoke("plan", *PLAN, "--out", tmp_path / name, "--json").exit_code == 0
    assert [p.name for p in tmp_path.iterdir()] == [name]


def test_control_characters_in_paths_stay_on_one_line(tmp_path):
    line = error_line(invoke("inspect", tmp_path / "no\nsuch.json"))
    assert "\\n" in line or "\n" in line
    error_line(invoke("plan", *PLAN, "--out", tmp_path / "miss\ning" / "p.json"), "does not exist")


# --- files read: size, kind, nesting, numbers ---------------------------------------------------


def _file(tmp_path: Path, text: str, name: str = "f.json") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, needle", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"schema": "canzona.plan", "version": ' + "9" * 5000 + "}", "too many digits"),
    ('{"schema": "canzona.plan", "version": 1, "x": NaN}', "NaN"),
    ('{"schema": "canzona.plan", "version": 1, "x": -Infinity}', "-Infinity"),
    ("\xff\xfe", "not valid JSON"),
])
def test_inspect_hostile_json(tmp_path, text, needle):
    error_line(invoke("inspect", _file(tmp_path, text)), needle)


def test_inspect_rejects_what_is_not_a_regular_file(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it would block until a writer appears
    for path in (fifo, "/dev/zero", tmp_path):
        error_line(invoke("inspect", path), "not a regular file")
    error_line(invoke("simulate", *SIM, "--hardware", "/dev/zero"), "not a regular file")
    error_line(invoke("simulate", *SIM, "--hardware", fifo), "not a regular file")


def test_size_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(fileio, "MAX_INPUT_BYTES", 100)
    error_line(invoke("inspect", _file(tmp_path, " " * 101 + "{}")), "more than the 100")
    with pytest.raises(PlanError, match="more than the 100"):
        load_plan(_file(tmp_path, " " * 200))


def test_read_text_bounds_a_growing_file(tmp_path):
    path = _file(tmp_path, "x" * 64)
    assert read_text(path, "file", max_bytes=64) == "x" * 64
    with pytest.raises(CanzonaError, match="64 bytes"):
        read_text(path, "file", max_bytes=63)


def test_parse_json_is_strict():
    assert parse_json('{"a": [1, 2.5, "x"]}', "doc") == {"a": [1, 2.5, "x"]}
    for text in ("NaN", "Infinity", "[1, -Infinity]"):
        with pytest.raises(CanzonaError, match="not a number JSON allows"):
            parse_json(text, "doc")


def test_duplicate_keys_are_refused(tmp_path):
    """A key given twice (a profile figure edited by adding a second line) was read as its last
    value, silently: the figure the user meant may be either."""
    with pytest.raises(CanzonaError, match=r"doc: not valid JSON \(key 'hbm' given twice\)"):
        parse_json('{"gpu": {"hbm": 3.35e12, "sms": 132, "hbm": 3.35e3}}', "doc")
    assert parse_json('[{"a": 1}, {"a": 2}]', "doc") == [{"a": 1}, {"a": 2}]  # one key in each object
    text = (resources.files("canzona") / "profiles" / "h100-sxm.json").read_text()
    profile = _file(tmp_path, text.replace('"sms": 132,', '"sms": 132, "sms": 13,'), "profile.json")
    error_line(invoke("simulate", *SIM, "--hardware", profile), "given twice")


def _profile(tmp_path: Path, path: tuple[str, ...], value_json: str) -> Path:
    data = json.loads((resources.files("canzona") / "profiles" / "h100-sxm.json").read_text())
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = "__VALUE__"
    return _file(tmp_path, json.dumps(data).replace('"__VALUE__"', value_json), "profile.json")


@pytest.mark.parametrize("path, value", [
    (("gpu", "launch_s"), "NaN"),
    (("gpu", "hbm_bytes_per_s"), "Infinity"),
    (("gpu", "sms"), "true"),
    (("gpu", "peak_flops", "bf16"), "Infinity"),
    (("gpu", "peak_flops", "fp32"), "false"),
    (("network", "nic_busbw"), "1e999"),
    (("measured",), '"yes"'),
    (("solver_seconds",), '{"eigh": [[true, 0.1]]}'),
    (("solver_seconds",), '{"eigh": [[64.5, 0.1]]}'),
    (("gpu", "launch_s"), "1e305"),
    (("gpu", "elementwise_flops"), "5e-324"),
    (("node", "nvlink_ring_busbw"), "1e-300"),
    (("gpu", "peak_flops", "bf16"), str(10**400)),
    # wrong shapes and misspellings: tracebacks, or figures silently at their defaults
    (("gpu", "peak_flops"), "989e12"),
    (("gpu", "hbm_bytes_per_s"), '{"bf16": 3e12}'),
    (("gpu", "hbm_efficency"), "0.5"),
    (("gpu", "gemm_efficiency", "bf61"), "0.5"),
    (("gpu", "memory_bytes"), "5e8"),
    (("description",), "5"),
])
def test_profiles_reject_non_finite_and_boolean_numbers(tmp_path, path, value):
    profile = _profile(tmp_path, path, value)
    with pytest.raises(SpecError):
        load_profile(profile)
    error_line(invoke("simulate", *SIM, "--hardware", profile))


@pytest.mark.parametrize("path, value, needle", [
    # finite and within [1e-9, 1e18], but no device: 1e18 SMs made each SM's share of the peak nothing
    # (qwen3-0.6b on 16 GPUs: an iteration of 1.7e14 s), a 1e18 s launch or NCCL latency swamped
    # every other term (8e21 s; 1e18 s exactly), a 1e6-wide tile ran a GEMM as one tile (8e4 s)
    (("gpu", "sms"), "1e18", "gpu.sms must be at most 65536"),
    (("gpu", "gemm_tile"), "1000000", "gpu.gemm_tile must be at most 1024"),
    (("gpu", "launch_s"), "1e18", "gpu.launch_s must be at most 1 s"),
    (("nccl", "base_latency_s"), "2", "nccl.base_latency_s must be at most 1 s"),
    (("nccl", "nvlink_step_latency_s"), "1e18", "nccl.nvlink_step_latency_s must be at most 1 s"),
    (("nccl", "network_step_latency_s"), "1e18", "nccl.network_step_latency_s must be at most 1 s"),
])
def test_profile_figures_beyond_any_device_name_the_field_and_its_bound(tmp_path, path, value, needle):
    error_line(invoke("simulate", *SIM, "--hardware", _profile(tmp_path, path, value)), needle)
    at_bound = needle.rsplit(" ", 2)[1] if needle.endswith(" s") else needle.rsplit(" ", 1)[1]
    load_profile(_profile(tmp_path, path, at_bound))  # the bound itself is a device


COLLECTIVE_ROW = '["all-reduce", 2, 4096, 0.001]'


@pytest.mark.parametrize("path, value, needle", [
    # finite and within [1e-9, 1e18], but no measurement: one 1e18 s eigh priced qwen3-0.6b's Shampoo
    # step on 16 GPUs at 7.6e21 s, a 1e18 s Muon row 7e18 s, a 1e18 s collective row 3.2e20 s and a
    # fit's 1e18 s latency 4e18 s
    (("solver_seconds",), '{"eigh": [[64, 1e18]]}', "solver_seconds.eigh: 1e+18 s must be at most 86400 s"),
    (("solver_seconds",), '{"qr": [[64, 0.1], [128, 86401]]}', "solver_seconds.qr: 86401 s must be at most 86400 s"),
    (("optimizer_seconds",), '[["muon", 1024, 1024, "bf16", 1e18]]',
     "optimizer_seconds: row 0: 1e+18 s must be at most 86400 s"),
    (("collectives",), '{"backend": "gloo", "rows": [["all-reduce", 2, 4096, 1e18]]}',
     "collectives.rows: row 0: 1e+18 s must be at most 86400 s"),
    (("collectives",), '{"backend": "gloo", "rows": [' + COLLECTIVE_ROW + '], "fits": [["all-reduce", 2, 1e18, 1e9]]}',
     "collectives.fits: row 0: a latency of 1e+18 s must be at most 1 s"),
])
def test_measured_seconds_beyond_any_measurement_name_the_field_and_its_bound(tmp_path, path, value, needle):
    error_line(invoke("simulate", *SIM, "--hardware", _profile(tmp_path, path, value)), needle)
    bound = needle.rsplit(" ", 2)[1]
    at_bound = value.replace("1e18", bound).replace("86401", bound)
    load_profile(_profile(tmp_path, path, at_bound))  # the bound itself is a measurement


def test_a_cost_tables_seconds_are_bounded_as_a_profiles(tmp_path):
    """`--cost-table` rows are a profile's optimizer_seconds rows (`parse_cost_rows`): 1e18 s was a
    plan priced in exaseconds."""
    from canzona.cost import load_cost_table

    path = _file(tmp_path, '{"rows": [["muon", 1024, 1024, "bf16", 1e18]]}', "table.json")
    error_line(invoke("plan", *PLAN, "--cost-table", path), "row 0: 1e+18 s must be at most 86400 s")
    load_cost_table(str(_file(tmp_path, '{"rows": [["muon", 1024, 1024, "bf16", 86400]]}', "table.json")))


def test_profile_from_python_rejects_non_finite_numbers():
    from canzona.hardware import profile_from_dict

    data = json.loads((resources.files("canzona") / "profiles" / "h100-sxm.json").read_text())
    data["gpu"]["elementwise_flops"] = float("inf")
    with pytest.raises(SpecError, match="must be a number in"):
        profile_from_dict(data)


def test_cost_table_rejects_non_finite_and_boolean_times(tmp_path):
    from canzona.cost import load_cost_table

    for row in ('["muon", "8", 8, "fp32", 1.0]', '["muon", 8.5, 8, "fp32", 1.0]', '["muon", true, 8, "fp32", 1.0]',
                '["muon", -8, 8, "fp32", 1.0]', '["muon", 8, 8, "fp32", ' + str(10**400) + "]", '"row"'):
        path = _file(tmp_path, '{"rows": [' + row + "]}", "table.json")
        with pytest.raises(SpecError, match="row 0 must be"):
            load_cost_table(str(path))
        error_line(invoke("plan", *PLAN, "--cost-table", path), "row 0 must be")
    with pytest.raises(SpecError, match="expected an object with 'rows'"):
        load_cost_table(str(_file(tmp_path, "[]", "table.json")))
    for value in ("1e999", "true", "NaN"):
        path = _file(tmp_path, '{"rows": [["muon", 8, 8, "fp32", ' + value + "]]}", "table.json")
        with pytest.raises(SpecError):
            load_cost_table(str(path))
    with pytest.raises(SpecError, match="not a regular file"):
        load_cost_table("/dev/zero")


# --- values: finite, bounded --------------------------------------------------------------------


def test_infinite_capacity_is_rejected_and_plans_are_strict_json(tmp_path):
    error_line(invoke("plan", *PLAN, "--capacity", "1e999GiB", "--out", tmp_path / "p.json"), "finite")
    assert not (tmp_path / "p.json").exists()
    result = invoke("plan", *PLAN, "--capacity", "1.5GiB", "--out", tmp_path / "p.json", "--json")
    assert result.exit_code == 0, result.stderr
    parse_json((tmp_path / "p.json").read_text(), "plan")  # strict: no NaN / Infinity anywhere


@pytest.mark.parametrize("args, needle", [
    (["plan", "--dp", "10000000"], "dp must be in 1..65536"),
    (["simulate", "--global-batch", "100000"], "at most 1024"),
    (["compare", "--global-batch", "100000"], "at most 1024"),
    (["simulate", "--gpus", "100000"], "at most 16384 GPUs"),
    (["simulate", "--seq-len", "100000000"], "seq len must be <="),
    (["plan", "--alpha", "nan"], "alpha"),
    (["plan", "--align", str(10**400)], "align must be"),
    (["plan", "--bucket-size", str(10**400)], "bucket size must be"),
    (["simulate", "--global-batch", str(10**307), "--micro-batch", str(10**307)], "global batch must be <="),
    (["simulate", "--policy", "sc", "--dp-policy", "whole-start"], "applies to the canzona policy only"),
    # one DP rank holds every matrix (SIM: 8 GPUs at TP 8): the balance settings were accepted, the run unchanged
    (["simulate", *SIM, "--alpha", "0.5"], "--alpha 0.5 changes nothing where each plan's DP group is one rank"),
    (["compare", *SIM, "--balance-by", "elements"], "--balance-by elements changes nothing"),
    # nor do the gradients' reduction settings: that rank reduces with no other (the same --json bit for bit)
    (["simulate", *SIM, "--no-overlap-grad-reduce"],
     "--no-overlap-grad-reduce changes nothing where each plan's DP group is one rank"),
    (["simulate", *SIM, "--reduce-scatter", "exact"], "--reduce-scatter exact changes nothing"),
    (["compare", *SIM, "--bucket-size", "100000000"], "--bucket-size 100000000 changes nothing"),
    # nor does the step's parameter all-gather's overlap: one rank gathers from no other (dense, and MoE at EDP 1)
    (["simulate", *SIM, "--no-overlap-param-gather"],
     "--no-overlap-param-gather changes nothing where each plan's DP group is one rank"),
    (["compare", "--model", "qwen3-30b-a3b", "--gpus", "4", "--tp", "4", "--ep", "4", "--seq-len", "128",
      "--global-batch", "1", "--no-overlap-param-gather"], "--no-overlap-param-gather changes nothing"),
    # nor the pipeline's launch of those reductions, nor where the step's parameter gathers run:
    # there are none (simulate --json the same bit for bit but the echo, with and without each)
    (["simulate", "--model", "qwen3-0.6b", "--gpus", "8", "--tp", "4", "--pp", "2", "--seq-len", "128",
      "--global-batch", "2", "--no-align-grad-reduce"],
     "--no-align-grad-reduce changes nothing where each plan's DP group is one rank"),
    (["plan", "--model", "qwen3-0.6b", "--dp", "1", "--tp", "8", "--alpha", "0.5"],
     "--alpha 0.5 changes nothing where each plan's DP group is one rank"),
    (["plan", "--model", "qwen3-0.6b", "--dp", "1", "--tp", "8", "--balance-by", "elements"],
     "--balance-by elements changes nothing"),
    # an empty name was taken as the default DP policy
    (["simulate", "--dp-policy", ""], "unknown DP policy ''"),
    (["compare", "--dp-policy", ""], "unknown DP policy ''"),
    (["plan", "--dp-policy", ""], "unknown DP policy ''"),
    # the policies with their own DP / TP plans take no alpha or TP scheduler: a no-op given is a mistake
    (["simulate", "--policy", "sc", "--alpha", "0.3"], "--alpha applies to the canzona policy only; sc uses whole-start"),
    (["simulate", "--policy", "layerwise", "--tp-policy", "tp-chunk"], "--tp-policy applies to the canzona policy only"),
    (["plan", "--dp", "abc"], "Invalid value for '--dp'"),
    (["simulate", "--gpus", "1.5"], "Invalid value for '--gpus'"),
    (["plan", "--bogus"], "No such option: --bogus"),
    (["frobnicate"], "No such command"),
    (["inspect"], "Missing argument"),
])
def test_sizes_and_usage_errors_are_one_line(no_simulation, args, needle):
    error_line(invoke(*args), needle)


MOE_DP1 = dict(model="qwen3-30b-a3b", gpus=4, tp=4, workload=Workload(128, 1, 1))


@pytest.mark.parametrize("config", [
    # DP 1, but the optimizer's DP group is DP x CP = 2
    dict(model="qwen3-0.6b", gpus=8, tp=4, cp=2, workload=Workload(256, 1, 1), alpha=0.5, bucket_size=10**8,
         options=RunOptions(overlap_grad_reduce=False, reduce_scatter="exact", overlap_param_gather=False)),
    # DP 1, but the experts' EDP group is 2 ranks
    dict(MOE_DP1, ep=2, options=RunOptions(overlap_grad_reduce=False, reduce_scatter="exact",
                                           overlap_param_gather=False)),
    # EDP 1 too, but the experts' plan is bucketed by the size (its bucket count differs)
    dict(MOE_DP1, ep=4, bucket_size=10**8),
    # the runtime's collectives log a one-rank reduce-scatter per bucket, which the overlap moves
    dict(model="qwen3-0.6b", gpus=8, tp=8, workload=Workload(128, 1, 1),
         options=RunOptions(overlap_grad_reduce=False, collectives="runtime")),
    # --align pads each parameter's start in the buffers at any DP: memory and time differ at DP 1
    # (--align 999: 298254336 -> 298697004 gradient bytes here), and at EDP 1 under EP
    dict(model="qwen3-0.6b", gpus=8, tp=8, workload=Workload(128, 1, 1), optimizer="adamw", align=999),
    dict(MOE_DP1, ep=4, align=1),
], ids=["cp2", "edp2", "ep-bucket-size", "runtime-collectives", "align", "ep-align"])
def test_a_one_rank_dp_run_takes_the_settings_that_change_it(config):
    """The settings refused where every DP group is one rank are accepted where the simulated run
    changes with them (`SimConfig.one_rank_changes`, measured with simulate --json)."""
    sim.simulate.SimConfig(**config).check()


def test_limits_are_stated_in_help():
    assert "(1..65536)" in help_text("plan")
    sim_help = help_text("simulate")
    assert "at most 16384" in sim_help and f"{MAX_MICRO_BATCHES} micro-batches" in sim_help
    verify_help = help_text("verify")
    assert "1..16" in verify_help and "at most 1000" in verify_help and "at most 1024" in verify_help


@pytest.mark.parametrize("args, needle", [
    (["--global-batch", "1000000"], "global batch must be <= 1024"),
    (["--steps", "1000000"], "steps must be <= 1000"),
    (["--dp", "17"], "dp must be <= 16"),
    (["--dp-policy", "layerwise"], "needs a DP plan that keeps every matrix whole"),
    (["--dp-policy", "zero1-even", "--policy", "all"], "zero1-even does not"),
    (["--policy", "layerwise", "--dp-policy", "alpha-balanced"], "applies to the canzona policy only"),
    (["--policy", "sc", "--alpha", "0.5"], "--alpha applies to the canzona policy only"),
    # AdamW's zero1 runs tp-sync: its TP choices were dropped, the run verified what was not asked
    (["--optimizer", "adamw", "--tp", "2", "--tp-mode", "serial"], "--tp-mode serial applies to the canzona policy"),
    (["--optimizer", "adamw", "--tp", "2", "--tp-mode", "all"], "--tp-mode all applies to the canzona policy"),
    (["--optimizer", "adamw", "--tp", "2", "--tp-policy", "tp-chunk"], "--tp-policy applies to the canzona policy"),
])
def test_verify_rejects_before_spawning(monkeypatch, args, needle):
    from canzona.harness import verify as checks

    def no_spawn(*a, **k):
        raise AssertionError("bad input must fail before any spawn")

    monkeypatch.setattr(checks, "run", no_spawn)
    error_line(invoke("verify", *args), needle)


def test_simulator_rejects_plans_its_policy_cannot_execute(no_simulation):
    error_line(invoke("simulate", "--dp-policy", "layerwise"), "layerwise does not")
    error_line(invoke("compare", "--dp-policy", "zero1-even"), "zero1-even does not")


# --- writes are atomic --------------------------------------------------------------------------


def _no_space(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    good = tmp_path / "plan.json"
    assert invoke("plan", *PLAN, "--out", good, "--json").exit_code == 0
    before = good.read_bytes()
    monkeypatch.setattr(fileio.os, "fsync", _no_space)  # the disk fills up while writing
    error_line(invoke("plan", *PLAN, "--dp", "2", "--out", good), "No space left on device")
    error_line(invoke("simulate", *SIM, "--trace", tmp_path / "t.json"), "No space left on device")
    error_line(invoke("compare", *SIM, "--plot", tmp_path / "c.png"), "No space left on device")
    assert good.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_write_atomic_cleans_up_after_any_error(tmp_path):
    target = tmp_path / "out.txt"
    write_text_atomic(target, "old")

    def half_then_fail(tmp: Path) -> None:
        tmp.write_text("partial")
        raise RuntimeError("writer crashed")

    with pytest.raises(RuntimeError):
        write_atomic(target, half_then_fail)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]
    mask = os.umask(0)
    os.umask(mask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~mask  # as open() would create it, not 0600


# --- plan files with values beyond any real model -----------------------------------------------


def _mutated_plan(tmp_path: Path, mutate) -> Path:
    good = tmp_path / "good.json"
    assert invoke("plan", *PLAN, "--out", good, "--json").exit_code == 0
    data = json.loads(good.read_text())
    mutate(data)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    return bad


def _bucket(d: dict) -> dict:
    return d["dp_plan"]["buckets"][0]


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d["layout"].update(tp=10**9), "tp in 1..1024"),
    (lambda d: d["layout"].update(tp=10**400), "tp in 1..1024"),
    (lambda d: d["layout"].update(dp=10**6), "dp must be in 1..65536"),
    (lambda d: _bucket(d)["params"][0].__setitem__(3, 10**400), "wrong type"),
    (lambda d: _bucket(d)["params"][0].__setitem__(4, 10**400), "beyond any real model"),
    (lambda d: (_bucket(d).update(size=10**400), _bucket(d)["cuts"].__setitem__(-1, 10**400)), "size must be in"),
    (lambda d: d["tp_plan"].update(capacity={"value": 10**400, "unit": "s"}), "finite number"),
    (lambda d: d["tp_plan"]["groups"][0][0]["costs"].__setitem__(0, 10**400), "non-negative numbers"),
    (lambda d: d["dp_plan"].update(bucket_size=-1), "bucket_size in 1.."),
    (lambda d: d["dp_plan"].update(split_compute=True), "only zero1-even splits"),
    (lambda d: d["dp_plan"]["buckets"][1].update(index=_bucket(d)["index"]), "bucket indices repeat"),
    (lambda d: [p.__setitem__(3, 1e308) for b in d["dp_plan"]["buckets"] for p in b["params"]],
     "more than a float holds"),
])
def test_inspect_rejects_values_beyond_any_real_model(tmp_path, mutate, needle):
    import time

    bad = _mutated_plan(tmp_path, mutate)
    start = time.monotonic()
    error_line(invoke("inspect", bad), needle)
    error_line(invoke("inspect", bad, "--json"), needle)
    assert time.monotonic() - start < 10  # never proportional to a forged dp or tp


def test_results_never_print_non_finite_json(tmp_path):
    """Every figure of a plan or simulation that passes validation is finite: --json is strict."""
    for args in (["plan", *PLAN, "--json"], ["simulate", *SIM, "--json"], ["compare", *SIM, "--json"]):
        result = invoke(*args)
        assert result.exit_code == 0, result.stderr
        parse_json(result.stdout, "output")


def test_stdout_on_a_full_disk_is_one_error_line():
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "cli.main", "models"], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == ["error: cannot write the output: No space left on device"]


def test_sigterm_removes_the_temporary_file_of_a_write(tmp_path, monkeypatch):
    """SIGTERM unwinds the CLI like Ctrl-C (the default would kill it mid-write, leaving the
    temporary file beside the target)."""
    import signal
    import subprocess
    import sys
    import time

    code = ("import os, signal, time, pathlib; import canzona.fileio as f; from cli.main import main;"
            "orig = f.write_atomic;"
            "f.write_atomic = lambda p, w, what='file': orig(p, lambda t: (w(t), print('writing', flush=True),"
            " time.sleep(30)), what);"
            "import canzona.plan as pl; pl.write_text_atomic = lambda p, text, what='file': "
            "f.write_atomic(p, lambda t: t.write_text(text), what);"
            "import sys; sys.argv = ['canzona', 'plan', '--model', 'qwen3-0.6b', '--dp', '4', '--tp', '2',"
            f" '--out', {str(tmp_path / 'p.json')!r}, '--json']; main()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parents[2])
    deadline = time.monotonic() + 60
    while not any(tmp_path.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []



@pytest.mark.parametrize("terminal, sig", [(False, "SIGTERM"), (True, "SIGTERM"), (False, "SIGINT")],
                         ids=["pipe", "terminal", "pipe-SIGINT"])
def test_sigterm_stops_validate_and_its_workers_at_once(terminal, sig):
    """`validate --published` submits every row to its workers at once: a SIGTERM stops it in
    seconds (the pool's rows cancelled, its workers killed) with one line and no output, rather
    than after every row is simulated (`sim.workers.stopping_pool`). On a terminal (rich's
    TTY_COMPATIBLE: its progress bar drawn) the line comes after the bar is cleared: written at the
    signal, it was glued to the bar's end and the bar left on screen with it. Ctrl-C (SIGINT) the
    same (typer ended it silently, status 130)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "TTY_COMPATIBLE": "1"} if terminal else None
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "validate", "--published", "--workers", "2",
                             *(() if terminal else ("--json",))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=Path(__file__).resolve().parents[2], env=env)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    try:
        deadline = time.monotonic() + 60
        while not children.read_text().split() and time.monotonic() < deadline:  # the workers have started
            time.sleep(0.05)
        workers = [int(pid) for pid in children.read_text().split()]
        assert workers, "validate started no worker within 60 s"
        time.sleep(1.0)  # the workers are inside their first rows
        proc.send_signal(getattr(signal, sig))
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=15)
        assert time.monotonic() - t0 < 10
    finally:
        if proc.poll() is None:  # the test failed: stop what it started
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + getattr(signal, sig)
    assert out == ""
    if terminal:
        assert "\x1b[2K" in err  # the bar was drawn, and erased: nothing may follow the line
        err = err.rsplit("\x1b[2K", 1)[1]
    assert err.strip().splitlines() == [f"error: stopped by {sig}"]
    for pid in workers:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


@pytest.mark.distributed
@pytest.mark.parametrize("sig, when, group", [
    # CI time: the terminal's Ctrl-C (the whole group) and SIGTERM while the ranks run in every run;
    # the other two, which take the same paths, with the slow tests
    pytest.param("SIGTERM", "starting", False, marks=pytest.mark.slow), ("SIGTERM", "running", False),
    pytest.param("SIGINT", "starting", False, marks=pytest.mark.slow), ("SIGINT", "starting", True),
], ids=["SIGTERM-starting", "SIGTERM-running", "SIGINT-starting", "SIGINT-group-starting"])
def test_a_signal_stops_a_run_on_ranks_with_one_line(sig, when, group):
    """`validate` (the runtime measurement; `verify` and `calibrate` start their ranks the same
    way, `canzona.harness.launch`) stopped by a signal while its ranks are being started (the fork
    server still importing torch) or running ends with the CLI's one line and leaves no process
    behind. Before: torch's agent logged its death-signal warnings, and a start cut short left a
    rank forked after the CLI had gone, whose traceback (FileNotFoundError: its semaphores were
    unlinked) came last. A terminal's Ctrl-C signals the whole process group (`group`): the fork
    server, importing torch before it ignores SIGINT, printed its KeyboardInterrupt traceback."""
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "validate", "--dp", "2", "--rounds", "3",
                             "--policies", "canzona,layerwise", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=Path(__file__).resolve().parents[2])
    try:
        # the fork server (and the resource tracker) come first, then the ranks, its children
        deadline = time.monotonic() + 90
        while not (kids := _descendants(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.02)
        if when == "running":
            while len(kids := _descendants(proc.pid)) < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(kids) >= 4, "the ranks did not start within 90 s"  # a run's ranks last about 1 s
        assert kids, "validate started no process within 90 s"
        if group:
            time.sleep(1.0)  # the fork server is importing torch (about 3 s)
            os.killpg(proc.pid, getattr(signal, sig))
        else:
            proc.send_signal(getattr(signal, sig))
        out, err = proc.communicate(timeout=60)  # until every holder of stderr has closed it
    finally:
        if proc.poll() is None:  # the test failed: stop what it started
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert (proc.returncode, out) == (128 + getattr(signal, sig), "")
    assert err.strip().splitlines() == [f"error: stopped by {sig}"]
    time.sleep(0.5)
    left = [pid for pid in _descendants(proc.pid) + kids
            if Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()]
    assert left == []


def _descendants(pid: int) -> list[int]:
    """The live descendants of a process (Linux: its threads' children, recursively)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    kids = []
    for task in tasks:
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            pass
    return [d for k in kids for d in (k, *_descendants(k))]


# --- models from files: each mistake is one line, before any planning or simulation ---------------

LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
         "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 1024}
ROW = {"name": "layers.0.q_proj.weight", "shape": [64, 64], "role": "matrix", "layer": 0, "tp_dim": 0, "dtype": "bf16"}
EMBED = {"name": "embed.weight", "shape": [128, 64], "role": "embedding", "layer": None, "tp_dim": 0}


def _spec_doc(*rows, **top) -> dict:
    return {"schema": "canzona.model", "version": 1, "name": "m", "params": list(rows) or [ROW], **top}


def _without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


# (file content: dict, raw text or None for a missing file; needle; TP size)
MODEL_FILES = {
    "missing file": (None, "cannot read model file", 1),
    "malformed JSON": ('{"model_type": "llama",', "not valid JSON", 1),
    "NaN in JSON": ('{"model_type": "llama", "hidden_size": NaN}', "NaN", 1),
    "neither kind": ({"foo": 1}, "neither a Hugging Face config.json", 1),
    "a list": ([1, 2], "neither a Hugging Face config.json", 1),
    "missing config field": (_without(LLAMA, "intermediate_size"), "missing field 'intermediate_size'", 1),
    "missing model_type": (_without(LLAMA, "model_type"), "missing field 'model_type'", 1),
    "string size": ({**LLAMA, "hidden_size": "256"}, "hidden_size must be a whole number", 1),
    "boolean size": ({**LLAMA, "num_hidden_layers": True}, "num_hidden_layers must be a whole number", 1),
    "too many layers": ({**LLAMA, "num_hidden_layers": 10**6}, "num_hidden_layers must be a whole number in 1..1024", 1),
    "tie not a bool": ({**LLAMA, "tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false", 1),
    "no head_dim": ({**LLAMA, "hidden_size": 100}, "give head_dim", 1),
    "heads not multiple of kv": ({**LLAMA, "num_key_value_heads": 3}, "not a multiple of num_key_value_heads", 1),
    # the count came from transformers' default for the type, which the message did not say: the user wrote no 32
    "kv heads left out": ({**_without(LLAMA, "num_key_value_heads"), "model_type": "qwen2", "num_attention_heads": 8},
                          "num_key_value_heads 32 (transformers' default for qwen2, which the config leaves out)", 1),
    "qwen2_moe": ({**LLAMA, "model_type": "qwen2_moe", "num_experts": 60}, "mixture-of-experts", 1),
    "deepseek_v3": ({**LLAMA, "model_type": "deepseek_v3", "n_routed_experts": 256}, "mixture-of-experts", 1),
    "experts in a llama config": ({**LLAMA, "num_local_experts": 8}, "mixture-of-experts", 1),
    "more experts per token than experts": ({**LLAMA, "model_type": "mixtral", "num_local_experts": 2,
                                             "num_experts_per_tok": 4}, "num_experts_per_tok 4 is more than", 1),
    "sparse step not a number": ({**LLAMA, "model_type": "qwen3_moe", "decoder_sparse_step": "2"},
                                 "decoder_sparse_step must be a whole number", 1),
    "mlp_only_layers out of range": ({**LLAMA, "model_type": "qwen3_moe", "mlp_only_layers": [99]},
                                     "mlp_only_layers must be a list of layer indices", 1),
    "unknown model_type": ({**LLAMA, "model_type": "gpt2"}, "model_type 'gpt2' is not supported", 1),
    "tp vs heads": ({**LLAMA, "num_attention_heads": 12, "num_key_value_heads": 12, "hidden_size": 384},
                    "tp=8 does not divide the 12 attention heads", 8),
    "tp vs kv heads": (LLAMA, "tp=8 does not divide the 4 KV heads", 8),
    "tp vs vocab": ({**LLAMA, "vocab_size": 1001}, "tp=2 does not divide the 1001 vocabulary", 2),
    "wrong schema": ({**_spec_doc(), "schema": "canzona.plan"}, "schema is 'canzona.plan', not 'canzona.model'", 1),
    "wrong version": (_spec_doc(version=2), "version 2 is not supported", 1),
    "unknown top field": (_spec_doc(architecure={}), "unknown field 'architecure'", 1),
    "no params": ({**_spec_doc(), "params": []}, "params must be a non-empty list", 1),
    "no name": ({**_spec_doc(), "name": ""}, "name must be a non-empty string", 1),
    "row not an object": (_spec_doc("w"), "params[0] must be an object", 1),
    "row without name": (_spec_doc(_without(ROW, "name")), "params[0]: name must be", 1),
    "bad role": (_spec_doc({**ROW, "role": "weights"}), "role must be one of matrix, embedding, head, vector", 1),
    "bad shape": (_spec_doc({**ROW, "shape": [0, 4]}), "shape must be a list", 1),
    "shape as text": (_spec_doc({**ROW, "shape": "64x64"}), "shape must be a list", 1),
    "huge param": (_spec_doc({**ROW, "shape": [2**30, 2**30]}), "beyond any real model", 1),
    "bad layer": (_spec_doc({**ROW, "layer": -1}), "layer must be null or a whole number", 1),
    "bad tp_dim": (_spec_doc({**ROW, "tp_dim": 2}), "tp_dim must be null or a dimension", 1),
    "bad dtype": (_spec_doc({**ROW, "dtype": "int8"}), "dtype must be one of", 1),
    "unknown row field": (_spec_doc({**ROW, "bias": True}), "unknown field 'bias'", 1),
    "duplicate names": (_spec_doc(ROW, ROW), "two parameters named 'layers.0.q_proj.weight'", 1),
    "bad architecture field": (_spec_doc(architecture={"heads": 8}), "unknown architecture field 'heads'", 1),
    "bad architecture value": (_spec_doc(architecture={"layers": 0}), "architecture.layers must be", 1),
    "tp vs spec dim": (_spec_doc({**ROW, "shape": [66, 64]}), "tp=4 does not divide dimension 0 (66)", 4),
    "tp vs declared heads": (_spec_doc(architecture={"q_heads": 6}), "tp=4 does not divide the 6 attention heads", 4),
}

# Only the simulator needs the architecture: planning such a spec works.
NO_ARCHITECTURE = {
    "no embedding": (_spec_doc(ROW), "cannot infer 'hidden' of model 'm' (no embedding or head parameter)"),
    "no query projection": (_spec_doc(EMBED, {**ROW, "name": "layers.0.qkv.weight"}),
                            "cannot infer 'q_dim'"),
    "no layers": (_spec_doc(EMBED, {**ROW, "layer": None}), "cannot infer 'layers'"),
    "layer beyond the block": (_spec_doc(EMBED, {**ROW, "layer": 3}, architecture={"layers": 2}),
                               "is in layer 3, but the architecture has 2 layers"),
    # a block stating more layers than the parameters fill (a spec template edited to double the
    # depth): the layers past them were simulated as empty, the activations and MFU of 3 layers
    # beside the weights of 1 at PP 1, and at PP > 1 a stage without matrices failed to plan
    "layers past the parameters": (_spec_doc(EMBED, ROW, architecture={"layers": 3}),
                                   "layer 1 has no parameters, but the architecture has 3 layers"),
    "a layer without parameters": (_spec_doc(EMBED, ROW, {**ROW, "name": "layers.2.q_proj.weight", "layer": 2}),
                                   "layer 1 has no parameters, but the architecture has 3 layers"),
}


def _model_file(tmp_path: Path, content) -> Path:
    path = tmp_path / "model" / "config.json"
    if content is None:
        return path
    path.parent.mkdir(exist_ok=True)
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


@pytest.mark.parametrize("what", list(MODEL_FILES))
def test_bad_model_files_are_one_line(tmp_path, no_simulation, what):
    content, needle, tp = MODEL_FILES[what]
    path = _model_file(tmp_path, content)
    error_line(invoke("plan", "--model", path, "--dp", "2", "--tp", tp), needle)
    error_line(invoke("simulate", "--model", path, "--gpus", 8, "--tp", tp, "--global-batch", 8), needle)
    error_line(invoke("inspect", tmp_path / "no-plan.json", "--model", path), "cannot read plan file")
    with pytest.raises(SpecError, match=re.escape(needle)):
        resolve_model(path, tp)


@pytest.mark.parametrize("what", list(NO_ARCHITECTURE))
def test_architecture_not_inferable_is_one_line_for_the_simulator(tmp_path, no_simulation, what):
    content, needle = NO_ARCHITECTURE[what]
    path = _model_file(tmp_path, content)
    for command in ("simulate", "compare"):
        line = error_line(invoke(command, "--model", path, "--gpus", 8, "--tp", 1, "--global-batch", 8), needle)
        assert "architecture" in line
    if what != "layer beyond the block":
        assert invoke("plan", "--model", path, "--dp", "2", "--tp", "1", "--json").exit_code == 0


def test_unknown_model_name_lists_the_catalog_and_the_files_it_takes(no_simulation):
    line = error_line(invoke("simulate", "--model", "llama-3-8b"), "unknown model 'llama-3-8b'")
    assert "qwen3-0.6b" in line and "config.json" in line and "spec file" in line


def test_spec_output_path_is_checked_and_written_atomically(tmp_path):
    error_line(invoke("spec", "qwen3-0.6b", "--out", tmp_path / "spec.txt"), "unsupported extension '.txt'")
    error_line(invoke("spec", "qwen3-0.6b", "--out", tmp_path / "no" / "spec.json"), "does not exist")
    error_line(invoke("spec", tmp_path / "missing.json"), "cannot read model file")
    assert list(tmp_path.iterdir()) == []
