"""The extension seams (issue 19): every optimizer, DP policy, TP scheduler and step policy is a
registry entry whose fields say what the rest of the toolkit asks of it; one settings object and
one `plan_for` make every policy's plan.

- Every part an optimizer entry names resolves to something callable (a new entry with a typo
  fails here, not in a user's run), its config is the entry's, and `default_config` agrees.
- The DP and TP entries carry the properties the code used to infer from names, with the same
  answers; the step policies are keyword-only.
- `plan_for` gives each baseline its own DP / TP policies and canzona the settings', and equals
  `make_plan` with those; `PlanSettings`' defaults are `make_plan`'s.
"""

from __future__ import annotations

import inspect
from dataclasses import fields

import pytest

from canzona.dp.policies import DP_REGISTRY, KEEPS_GEOMETRY
from canzona.models import resolve_model
from canzona.optimizers import MATRIX_REGISTRY, MatrixOptimizer, default_config
from canzona.plan import PlanSettings, make_plan, plan_for
from canzona.step_policies import STEP_POLICIES, StepPolicy, policy_optimizer
from canzona.tp import TP_REGISTRY, Capacity

PARTS = ("cost_kernels", "state_bytes", "workspace_bytes", "kernel", "initial_state", "reference",
         "init_kernels", "stack_bytes", "batched", "compiled")


@pytest.mark.parametrize("name", list(MATRIX_REGISTRY))
def test_every_part_of_an_optimizer_entry_resolves(name):
    entry = MATRIX_REGISTRY[name]
    assert entry.name == name and type(default_config(name)) is entry.config
    assert entry.summary and "\n" not in entry.summary
    for part in PARTS:
        where = getattr(entry, part)
        resolved = entry.part(part)
        assert (resolved is None) == (where is None), (name, part)
        if resolved is not None:
            assert callable(resolved), (name, part)
    assert entry.batchable == (entry.batched is not None)
    assert {f.name for f in fields(MatrixOptimizer)} >= set(PARTS)


def test_dp_and_tp_entries_carry_what_names_used_to_say():
    assert KEEPS_GEOMETRY == {"whole-start", "alpha-balanced", "alpha-balanced-reorder"}
    assert {n for n, e in DP_REGISTRY.items() if e.splits_compute} == {"zero1-even"}
    assert {n for n, e in DP_REGISTRY.items() if e.takes_alpha} == {"alpha-balanced", "alpha-balanced-reorder"}
    assert {n for n, e in TP_REGISTRY.items() if e.every_rank} == {"tp-sync"}
    assert {n for n, e in TP_REGISTRY.items() if e.uses_capacity} == {"greedy-rollback"}
    assert all(e.name == n for n, e in (*DP_REGISTRY.items(), *TP_REGISTRY.items()))


def test_step_policies_are_keyword_only_entries():
    canzona = STEP_POLICIES["canzona"]
    with pytest.raises(TypeError):
        StepPolicy("x", "reduce-scatter", False, None, None, False, "segments")  # type: ignore[misc]
    assert canzona.can_overlap_step and not any(p.can_overlap_step for n, p in STEP_POLICIES.items() if n != "canzona")


def defaults(obj) -> dict:
    """The default of each field of a dataclass, or of each parameter of a function."""
    if isinstance(obj, type) and hasattr(obj, "__dataclass_fields__"):
        return {f.name: f.default for f in fields(obj)}
    return {k: p.default for k, p in inspect.signature(obj).parameters.items()}


def test_every_planning_setting_has_one_default_wherever_it_appears():
    """`canzona.plan.PLAN_DEFAULTS` is the one definition: `make_plan`, the runtime, the simulator,
    the harness and the CLI take its defaults; the runtime and the simulator take every setting
    (what is simulated can be deployed). The CLI's None DP policy means the optimizer's default
    (zero1-even for AdamW) and its `auto` capacity is the searched one (None); `canzona simulate`
    and `compare` take every setting too, so that a plan the runtime is given can be simulated."""
    from canzona.harness.training import TrainSpec
    from canzona.harness.verify import prepare
    from canzona.plan import PLAN_DEFAULTS
    from canzona.runtime.optimizer import DistributedOptimizer
    from cli import main as cli
    from sim.simulate import SimConfig

    consumers = {"make_plan": defaults(make_plan), "DistributedOptimizer": defaults(DistributedOptimizer),
                 "SimConfig": defaults(SimConfig), "TrainSpec": defaults(TrainSpec),
                 "canzona.harness.verify.prepare": defaults(prepare), "canzona plan": defaults(cli.plan),
                 "canzona simulate": defaults(cli.simulate), "canzona compare": defaults(cli.compare),
                 "canzona verify": defaults(cli.verify)}
    cli_names = ("canzona plan", "canzona simulate", "canzona compare", "canzona verify")
    exceptions = {**{(c, "dp_policy"): None for c in cli_names}, **{(c, "capacity"): "auto" for c in cli_names}}
    for f in fields(PlanSettings):
        want = getattr(PLAN_DEFAULTS, f.name)
        assert want == f.default, f.name
        for name in ("make_plan", "DistributedOptimizer", "SimConfig", "canzona simulate", "canzona compare"):
            assert f.name in consumers[name], (name, f.name)
        for name, d in consumers.items():
            if f.name in d:
                assert d[f.name] == exceptions.get((name, f.name), want), (name, f.name)
    assert SimConfig(align=128, balance_by="elements").settings == \
        PlanSettings(align=128, balance_by="elements")


def test_plan_for_gives_each_policy_its_own_plan():
    spec, _ = resolve_model("qwen3-0.6b", 2)
    settings = PlanSettings(dp_policy="alpha-balanced-reorder", tp_policy="tp-chunk", alpha=0.5,
                            capacity=Capacity(1e-3, "s"))
    for name, policy in STEP_POLICIES.items():
        optimizer = policy_optimizer(name, "muon")  # zero1: the AdamW baseline
        plan = plan_for(spec, 4, 2, optimizer, name, settings)
        assert plan.dp_plan.policy == (policy.dp_policy or settings.dp_policy), name
        assert plan.tp_plan.policy == (policy.tp_policy or settings.tp_policy), name
        want = make_plan(spec, 4, 2, optimizer, plan.dp_plan.policy, plan.tp_plan.policy, settings.alpha,
                         capacity=settings.capacity)
        assert plan.hash() == want.hash(), name


def test_every_step_option_has_one_default_wherever_it_appears():
    """`canzona.step_options.STEP_DEFAULTS` is the one definition: the runtime's keyword arguments,
    the simulator's options, the memory model's setup, the harness's TrainSpec and the CLI's flags
    of the same names take its defaults (TrainSpec's reduce_scatter is the verification mode)."""
    from canzona.harness.training import TrainSpec
    from canzona.memory import MemorySetup
    from canzona.runtime.optimizer import DistributedOptimizer
    from canzona.step_options import STEP_DEFAULTS, StepOptions
    from cli import main as cli
    from sim.options import RunOptions
    from sim.simulate import SimConfig
    from sim.workload import Workload

    consumers = {"DistributedOptimizer": defaults(DistributedOptimizer), "RunOptions": defaults(RunOptions),
                 "SimConfig": defaults(SimConfig), "Workload": defaults(Workload), "MemorySetup": defaults(MemorySetup),
                 "TrainSpec": defaults(TrainSpec), "canzona simulate": defaults(cli.simulate),
                 "canzona compare": defaults(cli.compare), "canzona verify": defaults(cli.verify)}
    exceptions = {("TrainSpec", "reduce_scatter"): "exact"}
    for f in fields(StepOptions):
        want = getattr(STEP_DEFAULTS, f.name)
        seen = [name for name, d in consumers.items() if f.name in d]
        assert "DistributedOptimizer" in seen and {"RunOptions", "SimConfig", "Workload"} & set(seen), f.name
        for name in seen:
            assert consumers[name][f.name] == exceptions.get((name, f.name), want), (name, f.name)


def test_every_runtime_option_has_a_simulator_counterpart():
    """The project's rule, enforced on `DistributedOptimizer`'s signature (which `FsdpOptimizer`
    takes whole): each keyword argument is a step option (`StepOptions`, checked above), a planning
    setting (`PlanSettings`, checked above), a simulator option of the same name and default
    (`SimConfig`, `sim.simulate.simulate`, and `canzona simulate` / `compare` where the command line
    can say it), or named in `canzona.step_options.RUNTIME_ONLY` with why the simulator has none. A
    new runtime option that is none of these fails here."""
    from canzona.plan import PlanSettings
    from canzona.runtime.optimizer import DistributedOptimizer
    from canzona.step_options import RUNTIME_ONLY, StepOptions
    from cli import main as cli
    from sim.simulate import SimConfig, simulate

    runtime = defaults(DistributedOptimizer)
    covered = {f.name for f in fields(StepOptions)} | {f.name for f in fields(PlanSettings)}
    sim = {"SimConfig": defaults(SimConfig), "sim.simulate.simulate": defaults(simulate)}
    cli_commands = {"canzona simulate": defaults(cli.simulate), "canzona compare": defaults(cli.compare)}
    # the command line's spelling of a runtime option that takes an object (the CLI cannot)
    cli_spelling = {"cost_model": "cost_table"}
    # not on a command line: compare varies the policy; a plan file is what `canzona plan` writes from
    # the settings simulate and compare take (`sim.simulate.simulate(plan=)` takes one)
    not_flags = {("canzona compare", "policy"), ("canzona simulate", "plan"), ("canzona compare", "plan")}
    assert not set(RUNTIME_ONLY) - set(runtime), "RUNTIME_ONLY names options the runtime no longer has"
    assert not set(RUNTIME_ONLY) & covered
    for name, want in runtime.items():
        if name in covered or name in RUNTIME_ONLY:
            continue
        seen = [where for where, d in sim.items() if name in d]
        assert seen, f"runtime option {name!r} has no simulator counterpart (SimConfig) nor a RUNTIME_ONLY reason"
        for where in seen:
            assert sim[where][name] == want, (where, name)
        flag = cli_spelling.get(name, name)
        for where, d in cli_commands.items():
            if flag in d:
                assert d[flag] == want, (where, flag)
            else:
                assert (where, name) in not_flags, f"{where} has no --{flag.replace('_', '-')}"


def test_every_runtime_command_flag_is_a_simulate_flag_of_the_same_default():
    """`canzona plan` writes the plan the runtime runs and `canzona verify` runs the runtime: each of
    their flags that changes what the runtime does is a `canzona simulate` flag of the same name and
    default (simulate then deploy), but those below, each with why."""
    from cli import main as cli

    simulate = defaults(cli.simulate)
    not_simulate = {
        "canzona plan": {"dp": "the layout: simulate's --gpus / (tp x pp x cp)", "out": "where the plan is written",
                         "tp": "the layout: simulate's default is the largest TP that runs"},
        "canzona verify": {"dp": "the layout: simulate's --gpus / (tp x pp x cp)",
                           "tp": "the layout: simulate's default is the largest TP that runs",
                           "steps": "how many steps the check runs", "preset": "the verification harness's model",
                           "accumulation": "the harness's micro-batches (simulate's --micro-batch, --global-batch)",
                           "global_batch": "the harness's batch (None: its preset's)",
                           "tp_style": "how the harness builds its TP model (Megatron-style layers or DTensors): the "
                                       "optimizer's work is the same"},
    }
    for command, d in (("canzona plan", defaults(cli.plan)), ("canzona verify", defaults(cli.verify))):
        for name, want in d.items():
            if name in not_simulate[command]:
                continue
            assert name in simulate, f"{command} --{name.replace('_', '-')} is no canzona simulate option"
            assert simulate[name] == want, (command, name)
