"""`canzona search`'s rows round-trip to the commands a user runs next: each row's `simulate_command`
run as printed gives the row's iteration time, memory and step time bit for bit (and echoes its
layout), its `plan_command` writes a plan of the row's DP x CP, TP, EP and policies; every layout a
search may try is one `canzona simulate`'s flags express (`cli.replay`)."""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from canzona.errors import SpecError
from canzona.hardware import load_profile_data
from canzona.models import resolve_model
from canzona.plan import load_plan
from canzona.step_policies import STEP_POLICIES, default_policy
from sim.ep_dispatch import EpDispatcher
from sim.search import (
    AC_KEY,
    SEARCHED_SPLITS,
    Question,
    candidates,
    config_of,
    facts_of,
    space_of,
)
from sim.simulate import SimConfig, simulate
from sim.workload import Workload
from tests.cli_helpers import error_line, invoke
from tests.sim.small_models import EIGHT_LAYERS, MOE_FOUR_LAYERS

TINY_MOE = "examples/tiny_qwen3_moe/config.json"


def _profile(tmp_path: Path, gigabytes: float) -> str:
    """H100's profile with `gigabytes` of GPU memory: a small model's search then needs the pipeline,
    the recompute modes and HSDP that a large model's does (and a non-default --hardware path)."""
    data, _ = load_profile_data("h100-sxm")
    data = {**data, "name": f"h100-{gigabytes}g", "gpu": {**data["gpu"], "memory_bytes": int(gigabytes * 1e9)}}
    path = tmp_path / f"h100-{gigabytes}g.json"
    path.write_text(json.dumps(data))
    return str(path)


# each search: its arguments (a {tight} profile path is written per test) and the kinds of rows it
# returns, checked below so that a change of the ranking that loses a kind is seen
SEARCHES = {
    # the 8-layer model on 2.8 GB GPUs (4 GB until the 0.75 GB fixed allowance of 2026-11-30): PP 2 at VP 1, 2, 4, the embedding + loss split at VP 5,
    # Megatron's block recompute, selective-op
    "pipeline": (("--model", EIGHT_LAYERS, "--gpus", 16, "--seq-len", 4096, "--global-batch", 32, "--top", 6,
                  "--hardware", "{tight:2.8}"),
                 {"pp": 2, "vp": 5, "pipeline_split": "embedding+loss", "recompute_method": "block"}),
    # 32k tokens: CP 2, with the refinement's step policies and reduce-scatters (exact: padded's row ran the
    # fallen-back row's run again, listed once since 2026-11-30, `sim.search.same_run`)
    "cp": (("--model", EIGHT_LAYERS, "--gpus", 16, "--seq-len", 32768, "--global-batch", 8, "--top", 4),
           {"cp": 2, "policy": "layerwise", "reduce_scatter": "exact"}),
    # Megatron's EP overlap, delay_wgrad_compute where TE runs it (no userbuffers TP overlap), TP x EP
    "moe-overlap": (("--model", MOE_FOUR_LAYERS, "--gpus", 8, "--seq-len", 4096, "--global-batch", 16, "--top", 3,
                     "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute", "--no-tp-comm-overlap"),
                    {"ep": 8, "overlap_moe_expert_parallel_comm": True, "delay_wgrad_compute": True}),
    # the flex dispatcher, FP8, AdamW on H200: EP 1 layouts rank first (the dispatcher acts at EP > 1)
    "moe-flex-ep1": (("--model", TINY_MOE, "--gpus", 16, "--seq-len", 1024, "--global-batch", 16, "--top", 4,
                      "--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep",
                      "--precision", "fp8", "--optimizer", "adamw", "--hardware", "h200"),
                     {"ep": 1, "policy": "zero1"}),
    # FSDP on 3.8 GB GPUs: HSDP, selective-layer's K, FSDP2 kept after forward (4 GB until the loss's peak
    # under PyTorch's cross-entropy was counted, 5 GB until the 0.75 GB fixed allowance, both 2026-11-30)
    "fsdp": (("--model", EIGHT_LAYERS, "--gpus", 32, "--seq-len", 4096, "--global-batch", 64, "--top", 8, "--fsdp",
              "--selective-ac-option", 5, "--hardware", "{tight:3.8}"),
             {"hsdp_replicate": 4, "recompute": "selective-layer", "reshard_after_forward": False}),
}
# the larger searches (make test-all): Megatron's EP overlap on the interleaved pipeline, uneven split
# (top 4: since the pipeline's point-to-point rendezvous of 2026-11-30 two PP 1 layouts rank first)
SLOW_SEARCHES = {
    "moe-overlap-interleaved": (("--model", MOE_FOUR_LAYERS, "--gpus", 16, "--seq-len", 2048, "--global-batch", 16,
                                 "--top", 4, "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"),
                                {"pp": 2, "vp": 3, "pipeline_split": "embedding+loss",
                                 "overlap_moe_expert_parallel_comm": True}),
}


def _search(args: tuple, tmp_path: Path) -> dict:
    args = [_profile(tmp_path, float(a[len("{tight:"):-1])) if str(a).startswith("{tight:") else a for a in args]
    r = invoke("search", *args, "--workers", 1, "--json")
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def _echoed(row: dict, run: dict) -> dict:
    """The row's layout against what `canzona simulate` echoes of its run: equal figures could hide
    a different layout (two reduce-scatters routing alike)."""
    split = SEARCHED_SPLITS[row.get("pipeline_split", "even")]
    options = run["options"]
    pairs = {
        "tp": (row["tp"], run["tp"]), "pp": (row["pp"], run["pp"]), "vp": (row["vp"], run["vp"]),
        "cp": (row["cp"], run["cp"]), "ep": (row["ep"], run["ep"]), "dp": (row["dp"], run["dp"]),
        "split": (None if split.even else asdict(split), run.get("pipeline_split")),
        "micro_batch": (row["micro_batch"], run["workload"]["micro_batch"]),
        "policy": (row["policy"], run["policy"]),
        "recompute": (row["recompute"], options["recompute"]),
        "recompute_method": (row["recompute_method"], options["recompute_method"]),
        "recompute_num_layers": (row["recompute_num_layers"], options["recompute_num_layers"]),
        "overlap_moe_expert_parallel_comm": (row["overlap_moe_expert_parallel_comm"],
                                             options["overlap_moe_expert_parallel_comm"]),
        "delay_wgrad_compute": (row["delay_wgrad_compute"], options["delay_wgrad_compute"]),
        "expert_buckets": (row["expert_buckets"], run["expert_buckets"]),
        "fell_back_to": (row["fell_back_to"], run["fell_back_to"]),
    }
    if row[AC_KEY] is not None:
        pairs[AC_KEY] = (row[AC_KEY], options["selective_ac_option"])
    if row.get("fsdp"):
        fsdp = run["fsdp"]
        pairs |= {"hsdp_replicate": (row["hsdp_replicate"], fsdp["replicate"]),
                  "reshard_after_forward": (row["reshard_after_forward"], fsdp["reshard_after_forward"]),
                  "fsdp_impl": (row["fsdp_impl"], fsdp["impl"])}
    else:
        pairs["reduce_scatter"] = (row["reduce_scatter"], options["reduce_scatter"])
    return {k: v for k, v in pairs.items() if v[0] != v[1]}


def _check_rows(found: dict, kinds: dict, tmp_path: Path) -> None:
    rows = found["layouts"]
    for key, value in kinds.items():  # the search still returns the kinds of rows it is here for
        assert any(r.get(key) == value for r in rows), (key, value, [r.get(key) for r in rows])
    for row in rows:
        command = row["simulate_command"]
        args = shlex.split(command)
        assert args[:2] == ["canzona", "simulate"], command
        r = invoke(*args[1:], "--json")
        assert r.exit_code == 0, (command, r.stderr)
        run = json.loads(r.stdout)
        # bit for bit: the search's configuration of the row and the command line's are one
        assert (run["iteration_time_s"], run["memory"]["worst"]["total"], run["optimizer_step_s"]) == \
            (row["iteration_time_s"], row["memory_bytes"], row["optimizer_step_s"]), command
        assert not _echoed(row, run), (command, _echoed(row, run))
        if row["plan_command"] is None:  # an FSDP layout: no plan file
            assert row.get("fsdp")
            continue
        # the step policy to run is DistributedOptimizer's option, not the plan file's: said where it
        # is not the optimizer's default (a refined policy, canzona's fallback)
        deployed = row["fell_back_to"] if row["fell_back_to"] in STEP_POLICIES else row["policy"]
        named = any(x.startswith(f"policy={deployed!r}") for x in row["not_in_plan"])
        assert named == (deployed != default_policy(found["optimizer"])), (deployed, row["not_in_plan"])
        out = tmp_path / f"plan-{row['rank']}.json"
        plan_args = [str(out) if a == "plan.json" else a for a in shlex.split(row["plan_command"])[2:]]
        r = invoke("plan", *plan_args)
        assert r.exit_code == 0, (row["plan_command"], r.stderr)
        plan = load_plan(out)
        # the optimizer's DP group is DP x CP; each part's policies are the row's
        assert (plan.dp, plan.tp, plan.ep) == (row["dp"] * row["cp"], row["tp"], row["ep"]), row["plan_command"]
        for part in (plan, plan.experts) if plan.experts is not None else (plan,):
            assert (part.dp_plan.policy, part.tp_plan.policy) == (row["dp_policy"], row["tp_policy"]), \
                row["plan_command"]


@pytest.mark.parametrize("name", SEARCHES)
def test_each_rows_simulate_and_plan_commands_reproduce_it(name, tmp_path):
    args, kinds = SEARCHES[name]
    _check_rows(_search(args, tmp_path), kinds, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_SEARCHES)
def test_each_rows_commands_reproduce_it_larger(name, tmp_path):
    args, kinds = SLOW_SEARCHES[name]
    _check_rows(_search(args, tmp_path), kinds, tmp_path)


def test_the_table_prints_the_best_rows_simulate_command(tmp_path):
    args = ("--model", EIGHT_LAYERS, "--gpus", 16, "--seq-len", 4096, "--global-batch", 32, "--top", 1,
            "--hardware", _profile(tmp_path, 4), "--workers", 1)
    best = _search(args, tmp_path)["layouts"][0]
    r = invoke("search", *args, env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.stderr
    # on one line however narrow the terminal: a command line is copied whole
    assert f"  simulate: {best['simulate_command']}\n" in r.stdout
    assert f"best: {best['plan_command']}\n" in r.stdout


# questions whose every candidate layout (each recompute setting, Megatron's block at the fewest and
# most layers, each refinement value) must be a `canzona simulate` command: no simulation, so the
# whole space is covered, not only the rows a ranking happens to return
SPACE_QUESTIONS = {
    "dense": Question(model=EIGHT_LAYERS, gpus=16, seq_len=32768, global_batch=16, hardware="h200",
                      optimizer="adamw", precision="fp8", align_grad_reduce=False, tp_comm_overlap=False,
                      max_grad_norm=1.0, gpu_variability=0.0, grad_reduce_in_fp32=False),
    "knobs": Question(model=EIGHT_LAYERS, gpus=16, attention_backend="flash", cross_entropy_loss_fusion=True,
                      cross_entropy_fusion_impl="te", store_param_remainders=True, apply_rope_fusion=False,
                      bias_activation_fusion=False, overlap_grad_reduce=False, overlap_param_gather=False,
                      batch_kernels=False, precision="fp8", fp8_recipe="current"),
    "uniform": Question(model=EIGHT_LAYERS, gpus=16, recompute_method="uniform", recompute_num_layers=2),
    "fsdp": Question(model=EIGHT_LAYERS, gpus=16, fsdp=True, selective_ac_option=5),
    "fsdp-megatron": Question(model=EIGHT_LAYERS, gpus=16, fsdp=True, fsdp_impl="megatron-fsdp"),
    # the dispatcher's EP settings on EP 1 layouts too (the search applies them to every layout)
    "moe": Question(model=TINY_MOE, gpus=16, seq_len=1024, global_batch=16, overlap_moe_expert_parallel_comm=True,
                    delay_wgrad_compute=True,
                    ep_dispatcher=EpDispatcher(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep",
                                               routing="balanced")),
}


@pytest.mark.parametrize("name", SPACE_QUESTIONS)
def test_every_layout_of_the_space_is_a_simulate_command(name):
    from cli.main import REPLAY

    q = SPACE_QUESTIONS[name]
    model = resolve_model(q.model)
    space, facts = space_of(q), facts_of(q)
    expressed = 0
    for c in candidates(q, facts):
        settings = list(space.recompute_variants(q))
        if space.name == "zero1":
            layers = model[1].layers // (c["pp"] * c["vp"])
            settings += [{"recompute": "full", "recompute_method": "block", "recompute_num_layers": n}
                         for n in {1, max(1, layers - 1)}]
        settings += [{axis.name: v} for axis in space.refine for v in axis.values(facts, c)]
        for setting in settings:
            cfg = config_of(q, {**c, **setting})
            try:
                cfg.check(model)
            except SpecError:  # refused by the simulator: the search prunes it
                continue
            REPLAY.simulate_options(cfg)  # raises where the flags cannot build this configuration
            expressed += 1
    assert expressed


def test_an_ep1_layout_runs_the_dispatchers_defaults_the_same_run():
    """At EP 1 the dispatch between EP ranks' settings change nothing (`EpDispatcher.check_ep`, which
    `canzona simulate` applies): a search's EP 1 layout runs their defaults (`EpDispatcher.at_ep`),
    which simulate reproduces; FakeBalancedGate's, which acts at any EP, stays (it drops the router)."""
    from sim.simulate import simulate

    # (the routing is reset too; beside the gate, which routes its own way, it is refused: EpDispatcher.check)
    assert EpDispatcher(routing="balanced").at_ep(1) == EpDispatcher()
    flex = EpDispatcher(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep",
                        moe_hybridep_num_sms=8, fake_balanced_gate=True)
    assert flex.at_ep(2) is flex
    assert flex.at_ep(1) == EpDispatcher(fake_balanced_gate=True)
    flex.at_ep(1).check_ep(1)
    q = Question(model=TINY_MOE, gpus=16, seq_len=1024, global_batch=16, ep_dispatcher=flex)
    layout = {"tp": 1, "pp": 1, "vp": 1, "cp": 1, "ep": 1, "micro_batch": 1, "recompute": "none"}
    cfg = config_of(q, layout)
    assert cfg.options.ep_dispatcher == flex.at_ep(1)
    assert config_of(q, {**layout, "ep": 2}).options.ep_dispatcher == flex
    # the same run as with the question's settings as they were passed before
    as_asked = replace(cfg, options=replace(cfg.options, ep_dispatcher=flex))
    a, b = simulate(cfg), simulate(as_asked)
    assert (a.iteration_time_s, a.memory.worst.total, a.optimizer_step_s) == \
        (b.iteration_time_s, b.memory.worst.total, b.optimizer_step_s)


def test_a_one_rank_dp_layout_runs_the_gradient_reductions_defaults():
    """Where every DP group is one rank `canzona simulate` refuses --no-overlap-grad-reduce,
    --no-overlap-param-gather and a reduce-scatter off its default (they change nothing there:
    `SimConfig._check_one_rank_settings`), so a search's DP 1 layout runs their defaults, the same
    run, and its command omits them; a layout with DP > 1 keeps the question's overlaps, and is
    refined over every reduce-scatter."""
    from cli.main import REPLAY
    from sim.search import refine_values

    q = Question(model="qwen3-0.6b", gpus=8, seq_len=1024, global_batch=8, overlap_grad_reduce=False,
                 overlap_param_gather=False)
    one = {"tp": 8, "pp": 1, "vp": 1, "cp": 1, "micro_batch": 1, "recompute": "none"}
    cfg = config_of(q, one)
    cfg.check()  # before: '--no-overlap-grad-reduce changes nothing where each plan's DP group is one rank'
    for name in ("overlap_grad_reduce", "overlap_param_gather"):  # REPLAY builds the command's config again
        assert getattr(cfg.options, name) and getattr(REPLAY.simulate_options(cfg), name), name
        assert not getattr(config_of(q, {**one, "tp": 4}).options, name), name
    axis = next(a for a in space_of(q).refine if a.name == "reduce_scatter")
    facts = facts_of(q)
    assert refine_values(q, axis, facts, one) == ["native"]
    assert len(refine_values(q, axis, facts, {**one, "tp": 4})) > 1


def test_a_one_rank_dp_layout_runs_the_gradient_launch_and_parameter_gather_defaults():
    """Nor does the pipeline's launch of the reductions (--no-align-grad-reduce) or where the step's
    parameter gathers run (--no-overlap-param-gather) change a run whose DP groups are one rank:
    `canzona simulate` refuses them there, so a search's DP 1 layout runs their defaults and its
    command omits them; a layout with DP > 1 keeps the question's."""
    from cli.main import REPLAY

    q = Question(model="qwen3-0.6b", gpus=8, seq_len=1024, global_batch=8, align_grad_reduce=False,
                 overlap_param_gather=False)
    one = {"tp": 4, "pp": 2, "vp": 1, "cp": 1, "micro_batch": 1, "recompute": "none"}
    cfg = config_of(q, one)
    cfg.check()  # before: '--no-align-grad-reduce, --no-overlap-param-gather change nothing where ...'
    again = REPLAY.simulate_options(cfg)
    assert cfg.options.align_grad_reduce and cfg.options.overlap_param_gather
    assert again.align_grad_reduce and again.overlap_param_gather
    two = config_of(q, {**one, "tp": 2})
    assert not two.options.align_grad_reduce and not two.options.overlap_param_gather


def test_a_configuration_no_flag_sets_is_an_error_naming_it():
    """A setting `canzona simulate` has no flag for (the parameters' gathered bytes) cannot become a
    command that silently simulates something else."""
    from cli.main import REPLAY

    cfg = SimConfig(model=EIGHT_LAYERS, gpus=8, tp=1, workload=Workload(seq_len=1024, global_batch=8, param_bytes=4))
    with pytest.raises(SpecError, match="cannot express this configuration: workload differ"):
        REPLAY.simulate_command(cfg)
    assert REPLAY.simulate_command(replace(cfg, workload=replace(cfg.workload, param_bytes=Workload.param_bytes))) == \
        f"canzona simulate --model {EIGHT_LAYERS} --gpus 8 --tp 1 --seq-len 1024 --global-batch 8"


def test_the_loss_and_master_settings_round_trip():
    """NeMo AutoModel's loss (no fp32 upcast, its loop holding the logits) and its bf16-built model
    are simulate's flags, printed and read back as the same configuration."""
    from cli.main import REPLAY

    cfg = SimConfig(model=EIGHT_LAYERS, gpus=8, tp=1, fsdp=True, optimizer="adamw",
                    workload=Workload(seq_len=1024, global_batch=8, loss_bytes=2, loss_holds_logits=True,
                                      master_weights=False))
    command = REPLAY.simulate_command(cfg)
    assert "--no-loss-fp32-upcast --loss-holds-logits --no-master-weights" in command
    r = invoke(*shlex.split(command)[1:], "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["memory"] == json.loads(json.dumps(simulate(cfg).to_dict()))["memory"]


def test_the_simulate_command_quotes_what_the_shell_would_split(tmp_path):
    """A path with a space stays one argument of the printed command."""
    from cli.main import REPLAY

    spaced = tmp_path / "my profiles"
    spaced.mkdir()
    profile = _profile(spaced, 40)
    command = REPLAY.simulate_command(SimConfig(model=EIGHT_LAYERS, gpus=8, tp=1, hardware=profile,
                                         workload=Workload(seq_len=1024, global_batch=8)))
    args = shlex.split(command)
    assert args[args.index("--hardware") + 1] == profile
    r = invoke(*args[1:], "--json")
    assert r.exit_code == 0, r.stderr


def test_the_plan_command_quotes_what_the_shell_would_split(tmp_path):
    """A model or profile path with a space stays one argument of the printed `canzona plan` command
    too, and the command, pasted as printed, writes the row's plan."""
    from sim.search import plan_command

    spaced = tmp_path / "my models"
    spaced.mkdir()
    model = spaced / "eight layers.json"
    model.write_text(Path(EIGHT_LAYERS).read_text())
    profile = _profile(spaced, 40)
    q = Question(model=str(model), gpus=8, hardware=profile, seq_len=1024, global_batch=8)
    row = {"tp": 2, "dp": 4, "cp": 1, "ep": 1, "dp_policy": "alpha-balanced-reorder", "tp_policy": "greedy-rollback",
           "expert_buckets": "size"}
    args = shlex.split(plan_command(q, row, out=str(tmp_path / "the plan.json")))
    assert args[args.index("--model") + 1] == str(model)
    assert args[args.index("--hardware") + 1] == profile
    r = invoke(*args[1:])
    assert r.exit_code == 0, r.stderr
    assert (load_plan(tmp_path / "the plan.json").dp, load_plan(tmp_path / "the plan.json").tp) == (4, 2)


def test_a_search_whose_row_no_flag_expresses_is_one_error_line(monkeypatch):
    """Were a row's configuration one the flags cannot express, the search says so in one line rather
    than print a command that simulates something else."""
    import sim.search

    def unexpressible(q, row):
        cfg = config_of(q, {k: row[k] for k in ("tp", "pp", "vp", "cp", "ep", "micro_batch", "recompute")})
        return replace(cfg, workload=replace(cfg.workload, param_bytes=4))

    monkeypatch.setattr(sim.search, "row_config", unexpressible)
    error_line(invoke("search", "--model", EIGHT_LAYERS, "--gpus", 8, "--seq-len", 1024, "--global-batch", 8,
                      "--top", 1, "--workers", 1, "--json"), "cannot express this configuration")


@pytest.mark.parametrize("options", [
    # canzona's plan settings and step options, which the search keeps at their defaults
    dict(model=EIGHT_LAYERS, gpus=16, tp=2, dp_policy="whole-start", tp_policy="tp-sync", alpha=0.25,
         bucket_size=50_000_000, capacity="20ms", geometry="whole", tp_mode="serial", zero1_fallback=False,
         collectives="runtime", overlap_step=True, compile_kernels=True, seq_len=1024, global_batch=16),
    # (a capacity is canzona's micro-groups': refused under a baseline policy, which runs tp-sync)
    dict(model=EIGHT_LAYERS, gpus=16, tp=2, capacity="512MiB", seq_len=1024, global_batch=16, pp=2,
         decoder_first_pipeline_num_layers=3),
    # a router histogram and expert TP under EP
    dict(model=TINY_MOE, gpus=16, tp=2, ep=4, etp=2, router_imbalance="0.5,0.25,0.125,0.125,0,0,0,0",
         expert_buckets="auto", seq_len=1024, global_batch=16),
    dict(model=TINY_MOE, gpus=16, tp=1, ep=8, router_imbalance="1.25", seq_len=1024, global_batch=16),
])
def test_a_configuration_of_any_options_round_trips(options):
    """Beyond the search's layouts: options it never sets read back from the configuration into the
    same options' configuration (a capacity, a router histogram, a stage's layer count)."""
    from dataclasses import fields

    from typer.main import get_command

    from cli.main import REPLAY, SimOptions, _sim_config, app

    cfg = _sim_config(shared=SimOptions(**options))
    # the printed line as simulate's parser reads it (without simulating): the same configuration
    line = shlex.split(REPLAY.simulate_command(cfg))
    parsed = get_command(app).commands["simulate"].make_context("simulate", line[2:]).params
    assert _sim_config(shared=SimOptions(**{f.name: parsed[f.name] for f in fields(SimOptions)})) == cfg
