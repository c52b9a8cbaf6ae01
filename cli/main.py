"""`canzona` CLI entry point."""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from typer.core import TyperGroup

try:  # recent typer vendors click; older releases use click itself
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException

from canzona import calibration
from canzona.catalog import DEFAULT_MODEL
from canzona.cost import cost_model_for
from canzona.dp import DP_POLICIES
from canzona.dp.layout import (
    AUTO_EXPERT_BUCKETS,
    DEFAULT_EXPERT_BUCKETS,
    EXPERT_BUCKETS,
    check_expert_buckets,
    check_expert_buckets_apply,
)
from canzona.dp.policies import DP_REGISTRY, MATRICES_PER_RANK, PAPER_DP_POLICY, check_dp_policy
from canzona.errors import CanzonaError, SpecError
from canzona.experts import check_ep, dense_part, expert_part
from canzona.fileio import check_output_path, dumps_json, one_line
from canzona.hardware import DEFAULT_PROFILE, profile_file
from canzona.harness import verify as checks
from canzona.models import (
    model_file,
    read_model,
    resolve_model,
    resolve_spec,
    save_spec,
    spec_to_dict,
)
from canzona.optimizers import MATRIX_REGISTRY
from canzona.plan import (
    DEFAULT_GEOMETRY,
    GEOMETRIES,
    MAX_DP,
    ONE_RANK_PLAN_SETTINGS,
    PLAN_DEFAULTS,
    Plan,
    check_geometry,
    check_one_rank_settings,
    check_plan_matches,
    load_plan,
    make_plan,
)
from canzona.reductions import HELP as REDUCE_SCATTER_HELP
from canzona.routing import RANDOM
from canzona.step_options import STEP_DEFAULTS
from canzona.step_policies import (
    STEP_POLICIES,
    default_policy,
    dp_policies_running,
    policies_running,
)
from canzona.tp import TP_POLICIES
from cli import plain_progress
from cli.plain_progress import PlainProgress
from cli.plots import PLOT_SUFFIXES, compare_plot
from cli.render import (
    calibration_tables,
    compare_table,
    dp_table,
    models_table,
    simulate_table,
    spec_table,
    tp_table,
    verify_table,
)
from cli.replay import Replay
from cli.shared_options import takes_options
from cli.units import MATRIX_CONFIG_HELP, parse_capacity, parse_matrix_config
from sim.ep_dispatch import ALLTOALL, DEEPEP_SMS, DEFAULT_HYBRIDEP_SMS, EpDispatcher
from sim.topology import MAX_GPUS
from sim.userbuffers import DEFAULT_UB_CONFIG
from sim.workload import MAX_MICRO_BATCHES, MAX_SEQ_LEN


class OneLineErrors(TyperGroup):
    """Usage errors (`--dp abc`, an unknown option) end like every other bad input: one `error:`
    line on stderr and exit code 2, instead of click's multi-line usage box."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        args = list(sys.argv[1:] if args is None else args)
        try:
            code = super().main(args=args or ["--help"], prog_name=prog_name, complete_var=complete_var,
                                standalone_mode=False, **extra)
        except ClickException as e:
            message = " ".join(e.format_message().split())
            ctx = getattr(e, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            print(f"error: {one_line(message)}{hint}", file=sys.stderr)
            code = e.exit_code
        except typer.Abort:
            print("error: aborted", file=sys.stderr)
            code = 1
        except OSError as e:  # the output itself failed (stdout on a full disk)
            print(f"error: cannot write the output: {e.strerror or e}", file=sys.stderr)
            code = 1
        code = code if isinstance(code, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


# the matrix optimizers of the registry, each with its one line
POLICY_HELP = "Step policy: " + ", ".join(STEP_POLICIES)
# `canzona plan`'s and the simulator's (DistributedOptimizer's `cost_model`, planned the same way:
# `canzona.cost.cost_model_for(hardware, table)`)
CostTable = Annotated[Path | None, typer.Option(
    help="Measured per-matrix seconds (benchmarks/bench_kernels.py --out) the owners are planned with (the runtime's "
         "cost_model=cost_model_for(hardware, table)); shapes it lacks use --hardware.")]
OPTIMIZER_HELP = "Optimizer of the matrices: " + "; ".join(f"{e.name} ({e.summary})" for e in MATRIX_REGISTRY.values()) + "."

app = typer.Typer(
    cls=OneLineErrors,
    help="Canzona: plan, simulate and verify distributed matrix optimizers ("
         + ", ".join(e.title for e in MATRIX_REGISTRY.values() if not e.elementwise) + ").",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
# Wide tables when piped (CI logs, files); a terminal keeps its own width.
console = Console(width=None if sys.stdout.isatty() else 140)


def fail(message: str) -> None:
    """One clear line on stderr and exit code 2: how every bad input ends."""
    print(f"error: {one_line(message)}", file=sys.stderr)
    raise typer.Exit(code=2)


def emit_json(obj: object) -> None:
    """Strict JSON on stdout: a non-finite figure is an error, never `Infinity` or `NaN`."""
    try:
        text = dumps_json(obj)
    except ValueError:
        fail("the result has non-finite figures (infinite or NaN times): check the hardware profile, "
             "cost table or plan values")
    print(text)


@app.command()
def models() -> None:
    """List the model catalog."""
    console.print(models_table())


MODEL_HELP = ("Catalog model name, Hugging Face config.json (qwen3, qwen2, llama, mistral; qwen3_moe, mixtral) or "
              "canzona spec file.")


@app.command()
def spec(
    model: Annotated[str, typer.Argument(help=MODEL_HELP)],
    out: Annotated[Path | None, typer.Option(help="Write the model as a canzona spec file (.json): a template to edit.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the spec file's content as one JSON object.")] = False,
) -> None:
    """Show a model's parameters and architecture, or write them as a spec file."""
    try:
        if out is not None:
            check_output_path(out, "spec file", (".json",), inputs=(model_file(model),))
        source = read_model(model)
        sizes, unknown = source.sizes(), None
        try:
            source.architecture()
        except CanzonaError as e:  # a spec the simulator cannot use yet: say what it lacks
            unknown = str(e)
        if out is not None:
            save_spec(source.spec, out, sizes)
    except CanzonaError as e:
        fail(str(e))
    if as_json:
        emit_json(spec_to_dict(source.spec, sizes))
        return
    console.print(spec_table(source.spec, source.kind, sizes, unknown))
    if out is not None:
        console.print(f"spec written to {out}")


@app.command()
def plan(
    model: Annotated[str, typer.Option(help=MODEL_HELP)] = DEFAULT_MODEL,
    dp: Annotated[int, typer.Option(help=f"Data-parallel size (1..{MAX_DP}).")] = 32,
    tp: Annotated[int, typer.Option(help="Tensor-parallel size.")] = 8,
    optimizer: Annotated[str, typer.Option(help=OPTIMIZER_HELP)] = "muon",
    matrix_config: MatrixConfig = None,
    dp_policy: Annotated[str | None, typer.Option(
        help=f"One of: {', '.join(DP_POLICIES)} (default: {PLAN_DEFAULTS.dp_policy}; zero1-even for adamw).")] = None,
    tp_policy: TpPolicy = PLAN_DEFAULTS.tp_policy,
    alpha: Alpha = PLAN_DEFAULTS.alpha,
    bucket_size: BucketSize = PLAN_DEFAULTS.bucket_size,
    align: Align = PLAN_DEFAULTS.align,
    capacity: CapacityOpt = "auto",
    balance_by: BalanceBy = PLAN_DEFAULTS.balance_by,
    geometry: Geometry = DEFAULT_GEOMETRY,
    out: Annotated[Path | None, typer.Option(help="Write the chosen plan as JSON to this file.")] = None,
    hardware: Annotated[str, typer.Option(help="Price optimizer work on this hardware profile (name or JSON path).")] = DEFAULT_PROFILE,
    cost_table: CostTable = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the chosen plan's summary as one JSON object.")] = False,
    ep: Annotated[int, typer.Option(help="Expert parallelism of a mixture-of-experts model: plan the dense part on "
                                         "DP x TP and one EP rank's experts over the DP x TP / (EP x ETP) ranks that "
                                         "hold them (EDP) x ETP, each with the same policies.")] = 1,
    etp: Annotated[int, typer.Option(help="Expert TP under --ep (Megatron's expert_tensor_parallel_size): each "
                                          "expert matrix split over ETP ranks (gate / up rows, down columns), its "
                                          "owner's ETP group scheduled as TP micro-groups.")] = 1,
    expert_buckets: Annotated[str, typer.Option(
        help=f"How buckets of stacked expert matrices are sized: {' or '.join(EXPERT_BUCKETS)} (a whole multiple "
             "of DP alike matrices: even segments are whole matrices).")] = DEFAULT_EXPERT_BUCKETS,
) -> None:
    """Plan a layout and compare the chosen policies with the baselines."""
    try:
        matrix_cfg = parse_matrix_config(matrix_config, optimizer)  # before any work, as every bad input
        if out is not None:
            check_output_path(out, "plan", (".json",), inputs=(model_file(model), profile_file(hardware), cost_table))
        model_spec = resolve_spec(model, tp)
        # expert TP splits each expert matrix along the dimension that is not the hidden size
        hidden = resolve_model(model, tp)[1].hidden if etp > 1 and ep > 1 else None
        edp = check_ep(model_spec, ep, dp, tp, etp, hidden)
        check_expert_buckets(expert_buckets)
        check_expert_buckets_apply(expert_buckets, model_spec.name, bool(model_spec.stacks))
        cap = parse_capacity(capacity)
        # the plan the optimizer's default step policy runs (AdamW's zero1: ZeRO-1's even segments
        # and tp-sync), which the runtime holds the plan file to: canzona's plan settings would
        # change nothing there, or write a plan it refuses (as simulate, one line each)
        step = STEP_POLICIES[default_policy(optimizer)]
        # its own DP and TP policies, named, are accepted: the plan command `canzona search` prints names them
        _check_dp_policy_applies([step.name], None if dp_policy == step.dp_policy else dp_policy, alpha,
                                 PLAN_DEFAULTS.tp_policy if tp_policy == step.tp_policy else tp_policy,
                                 geometry=geometry, capacity=capacity, balance_by=balance_by)
        # with one DP rank (one EDP rank too under EP) the plan computes every matrix on it: the
        # balance's settings change only their echo in the plan file
        # (not --bucket-size: the plan file's buckets are cut by it at any DP)
        given = {"alpha": alpha, "balance_by": balance_by}
        check_one_rank_settings([f"{flag} {given[name]}" for name, flag, default in ONE_RANK_PLAN_SETTINGS
                                 if name in given and given[name] != default], (dp, edp) if ep > 1 else (dp,))
        dp_policy = dp_policy or step.dp_policy or PLAN_DEFAULTS.dp_policy
        tp_policy = step.tp_policy or tp_policy
        costs = cost_model_for(hardware, cost_table)
        # under expert parallelism two plans: the dense part on DP x TP, one EP rank's experts over EDP
        parts = [(model_spec, dp, tp)] if ep == 1 else \
            [(dense_part(model_spec), dp, tp), (expert_part(model_spec, ep, etp, hidden), edp, etp)]
        planned = [_plan_part(spec, part_dp, part_tp, optimizer, dp_policy, tp_policy, alpha, bucket_size, align,
                              cap, costs, balance_by, tables=not as_json, expert_buckets=expert_buckets,
                              geometry=check_geometry(geometry), matrix_config=matrix_cfg)
                   for spec, part_dp, part_tp in parts]
        # under expert parallelism one plan file: the dense part's plan holding the experts'
        whole = planned[0][0] if ep == 1 else replace(planned[0][0], experts=planned[1][0], ep=ep)
        if out is not None:
            _check_runnable(whole)
            whole.save(out)
        if as_json:
            emit_json(whole.summary())
            return
    except CanzonaError as e:
        fail(str(e))
    for chosen, dp_rows, tp_rows in planned:
        # canzona's geometry (`--geometry auto`) kept ZeRO-1's even segments for the DP policy asked
        kept = f"for {dp_policy}: no longer step, even segments" if chosen.dp_plan.policy != dp_policy else ""
        console.print(dp_table(dp_rows, chosen, kept))
        if tp_rows:
            console.print(tp_table(tp_rows, tp_policy))
    if out is not None:
        console.print(f"plan written to {out} (hash {whole.hash()[:12]})")


def _check_runnable(plan: Plan) -> None:
    """A plan file is for the runtime: one that no step policy running its optimizer executes (a
    layerwise DP plan under canzona's TP scheduler: canzona needs whole matrices in their owners'
    segments, the layerwise baseline runs tp-sync) would be refused when the runtime loads it, so it
    is refused before it is written, with the first policy's reason."""
    parts = (plan, plan.experts) if plan.experts is not None else (plan,)
    reasons = []
    for name in policies_running(plan.optimizer):
        step = STEP_POLICIES[name]
        try:
            for part in parts:
                step.check_dp_plan(part.dp_plan)
                step.check_tp_plan(part.tp_plan.policy, part.tp)
            return
        except SpecError as e:  # the reasons of canzona and of the baseline of this DP policy, not of the others
            if step.dp_policy in (None, plan.dp_plan.policy):
                reasons.append(str(e))
    raise SpecError(f"a {plan.dp_plan.policy} plan under {plan.tp_plan.policy} is one no step policy runs, so the "
                    f"runtime would refuse the plan file ({'; '.join(reasons)}); choose a DP policy canzona "
                    "runs, or the baseline's own TP policy (--tp-policy tp-sync)")


def _plan_part(model_spec, dp: int, tp: int, optimizer: str, dp_policy: str, tp_policy: str, alpha: float,
               bucket_size: int | None, align: int, cap, costs, balance_by: str, tables: bool,
               expert_buckets: str = DEFAULT_EXPERT_BUCKETS, geometry: str = DEFAULT_GEOMETRY,
               matrix_config: object | None = None):
    """`canzona plan` for one model (or one part of it under expert parallelism): the chosen plan
    (canzona's `geometry` applied to the DP policy asked), and with `tables` the plans of its DP
    table (every DP policy, as it plans) and TP table (every TP policy on the chosen DP plan's)."""

    def make(dpp: str, tpp: str, unit: str = balance_by, geo: str = "whole"):
        return make_plan(model_spec, dp, tp, optimizer, dpp, tpp, alpha, bucket_size, align, cap,
                         cost_model=costs, balance_by=unit, expert_buckets=expert_buckets, geometry=geo,
                         matrix_config=matrix_config)

    chosen = make(dp_policy, tp_policy, geo=geometry)
    if not tables:
        return chosen, [], []
    if chosen.elementwise:
        # the DP plans the step policies running it execute: no matrix is computed whole, so
        # the whole-matrix policies and the TP schedule do not apply
        variants = [(name, PLAN_DEFAULTS.balance_by) for name in dp_policies_running(optimizer)]
    else:
        # every DP policy, plus the paper's policy balanced by elements as the authors' code does
        variants = [(name, PLAN_DEFAULTS.balance_by) for name in DP_POLICIES]
        paper = (PAPER_DP_POLICY, PLAN_DEFAULTS.balance_by)
        variants.insert(variants.index(paper) + 1, (PAPER_DP_POLICY, "elements"))
    picked = (chosen.dp_plan.policy, chosen.dp_plan.balance_by)
    for v in ((dp_policy, balance_by), picked):
        if v not in variants:
            variants.append(v)
    dp_rows = [chosen if v == picked else make(v[0], tp_policy, v[1]) for v in variants]
    tp_rows = [] if chosen.elementwise else [
        chosen if name == tp_policy else make(chosen.dp_plan.policy, name) for name in TP_POLICIES]
    return chosen, dp_rows, tp_rows


@app.command()
def inspect(
    path: Annotated[Path, typer.Argument(help="A plan file written by `canzona plan --out`.")],
    model: Annotated[str | None, typer.Option(help="Check the plan against this model: " + MODEL_HELP[0].lower() + MODEL_HELP[1:])] = None,
    dp: Annotated[int | None, typer.Option(help="Check the plan's DP size.")] = None,
    tp: Annotated[int | None, typer.Option(help="Check the plan's TP size.")] = None,
    ep: Annotated[int | None, typer.Option(help="Check the plan's expert parallelism (1: none).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as one JSON object.")] = False,
) -> None:
    """Validate a plan file (optionally against a model and layout) and summarise it."""
    try:
        loaded = load_plan(path)
        if model is not None:
            # an expert plan with expert TP needs the hidden size to tell each matrix's split
            hidden = resolve_model(model, loaded.tp)[1].hidden if loaded.etp > 1 else None
            check_plan_matches(loaded, resolve_spec(model, loaded.tp), dp, tp, ep=ep, hidden=hidden)
            if dp is not None or tp is not None or ep is not None:  # a job's: what the runtime checks when it loads it
                _check_runnable(loaded)
        elif dp is not None or tp is not None or ep is not None:
            fail("--dp, --tp and --ep are checked together with --model")
    except CanzonaError as e:
        fail(str(e))
    if as_json:
        emit_json({**loaded.summary(), "hash": loaded.hash()})
        return
    for part in (loaded, loaded.experts) if loaded.experts is not None else (loaded,):
        console.print(dp_table([part], part))
        if not part.elementwise:
            console.print(tp_table([part], part.tp_plan.policy))
    console.print(f"{path}: valid plan{f' (EP {loaded.ep}: dense part, then experts)' if loaded.experts else ''}, "
                  f"hash {loaded.hash()[:12]}")


def _check_dp_policy_applies(policies: list[str], dp_policy: str | None, alpha: float = PLAN_DEFAULTS.alpha,
                             tp_policy: str = PLAN_DEFAULTS.tp_policy, *, geometry: str = DEFAULT_GEOMETRY,
                             tp_mode: str = STEP_DEFAULTS.tp_mode, capacity: str = "auto",
                             balance_by: str = PLAN_DEFAULTS.balance_by) -> None:
    """A --dp-policy, --alpha (which weighs the DP policy's balance), --geometry (canzona's segments)
    or a TP scheduling option (--tp-policy, its micro-groups' --tp-mode and --capacity) that none of
    the chosen step policies would use is a mistake, not a no-op: each of the others has its own DP
    policy and runs tp-sync (every TP rank the whole update: no micro-groups to order or cut). So is
    a --balance-by where no chosen policy balances anything: ZeRO-1's even segments, or a replicated
    policy (every rank every matrix). A --dp-policy given is a DP policy's name first: an empty one
    would otherwise read as the default where callers fill it in (`dp_policy or ...`)."""
    if dp_policy is not None:
        check_dp_policy(dp_policy)
    steps = [STEP_POLICIES[p] for p in policies if p in STEP_POLICIES]
    uses = "uses" if len(policies) == 1 else "use"
    balancing = [s for s in steps if s.dp_policy is None or not (s.replicated or DP_REGISTRY[s.dp_policy].splits_compute)]
    if steps and not balancing and balance_by != PLAN_DEFAULTS.balance_by:
        raise SpecError(f"--balance-by {balance_by} changes nothing under {', '.join(policies)}: "
                        f"{', '.join(sorted({str(s.dp_policy) for s in steps}))} balance{'s' if len(policies) == 1 else ''} "
                        "no cost (even segments, or every matrix on every rank)")
    own = [s.dp_policy for s in steps]
    if own and all(own):
        for flag, given in (("--dp-policy", dp_policy is not None), ("--alpha", alpha != PLAN_DEFAULTS.alpha),
                            (f"--geometry {geometry}", geometry != DEFAULT_GEOMETRY)):
            if given:
                raise SpecError(f"{flag} applies to the canzona policy only; {', '.join(policies)} {uses} "
                                f"{', '.join(sorted(set(own)))}")
    own = [s.tp_policy for s in steps]
    if own and all(own):
        for flag, given in (("--tp-policy", tp_policy != PLAN_DEFAULTS.tp_policy),
                            (f"--tp-mode {tp_mode}", tp_mode != STEP_DEFAULTS.tp_mode),
                            (f"--capacity {capacity}", capacity != "auto")):
            if given:
                raise SpecError(f"{flag} applies to the canzona policy only; {', '.join(policies)} {uses} "
                                f"{', '.join(sorted(set(own)))}")


def _sim_config(*, shared: SimOptions):
    """The simulator's configuration of `shared`'s options (the policy: `shared.policy`, None where
    the command varies it), checked: bad input fails here, before anything is simulated or drawn.
    Keyword-only, as every builder of these many same-typed options."""
    from canzona.pipeline import PipelineSplit
    from sim.simulate import SimConfig
    from sim.workload import Workload, grad_bytes_for, loss_bytes_for

    o = shared
    if o.tp is None:
        return _default_tp_config(o)
    matrix_cfg = parse_matrix_config(o.matrix_config, o.optimizer)
    _check_dp_policy_applies([o.policy or default_policy(o.optimizer)], o.dp_policy)
    split = PipelineSplit(account_for_embedding_in_pipeline_split=o.account_for_embedding_in_pipeline_split,
                          account_for_loss_in_pipeline_split=o.account_for_loss_in_pipeline_split,
                          num_layers_in_first_pipeline_stage=o.decoder_first_pipeline_num_layers,
                          num_layers_in_last_pipeline_stage=o.decoder_last_pipeline_num_layers)
    workload = Workload(o.seq_len, o.global_batch, o.micro_batch, precision=o.precision, fp8_recipe=o.fp8_recipe,
                        grad_bytes=grad_bytes_for(o.grad_reduce_in_fp32, o.master_weights), kernels=o.kernels,
                        cross_entropy_loss_fusion=o.cross_entropy_loss_fusion,
                        cross_entropy_fusion_impl=o.cross_entropy_fusion_impl,
                        store_param_remainders=o.store_param_remainders, fp8_params=o.fp8_params,
                        apply_rope_fusion=o.apply_rope_fusion,
                        bias_activation_fusion=o.bias_activation_fusion, loss_bytes=loss_bytes_for(o.loss_fp32_upcast),
                        loss_holds_logits=o.loss_holds_logits, master_weights=o.master_weights)
    config = SimConfig(model=o.model, gpus=o.gpus, tp=o.tp, optimizer=o.optimizer, policy=o.policy,
                       dp_policy=o.dp_policy or PLAN_DEFAULTS.dp_policy, tp_policy=o.tp_policy, tp_mode=o.tp_mode,
                       alpha=o.alpha, bucket_size=o.bucket_size, capacity=parse_capacity(o.capacity),
                       hardware=o.hardware, workload=workload, options=_run_options(shared=o),
                       zero1_fallback=o.zero1_fallback, pp=o.pp, vp=o.vp, cp=o.cp, ep=o.ep, etp=o.etp,
                       geometry=o.geometry, align=o.align, balance_by=o.balance_by, expert_buckets=o.expert_buckets,
                       router_imbalance=_router_imbalance(o.router_imbalance), fsdp=o.fsdp,
                       hsdp_replicate=o.hsdp_replicate, reshard_after_forward=o.reshard_after_forward,
                       fsdp_impl=o.fsdp_impl, gpu_variability=o.gpu_variability, pipeline_split=split,
                       matrix_config=matrix_cfg,
                       cost_model=None if o.cost_table is None else cost_model_for(o.hardware, o.cost_table))
    config.check()
    config.options.ep_dispatcher.check_ep(config.ep)  # the command's layout: the search's EP 1 layouts differ
    # after the configuration's own checks (an unknown name, an elementwise optimizer's settings)
    _check_dp_policy_applies([o.policy or default_policy(o.optimizer)], None, o.alpha, o.tp_policy,
                             geometry=o.geometry, tp_mode=o.tp_mode, capacity=o.capacity, balance_by=o.balance_by)
    _check_zero1_fallback_applies(config, o.policy, o.zero1_fallback)
    return config


# the options besides `sim.simulate.ONE_RANK_SETTINGS` and `canzona.step_options.ELEMENTWISE_IGNORED`
# whose refusal is of the flag (it would change nothing), not of the layout: a default TP is chosen
# with them unset
FLAG_ONLY_SETTINGS = ("dp_policy", "zero1_fallback", "tp_comm_overlap_cfg", "batch_kernels")


def _default_tp_config(shared: SimOptions):
    """`_sim_config` where --tp is not given: at the largest TP of `DEFAULT_TPS` whose layout passes
    every check, the checks themselves deciding (KV heads, the node, FSDP's shard group, experts at
    TP 1 under --fsdp, ...), so a default is one that runs. The layout alone chooses: the plan and
    step settings refused where they would change nothing (--alpha at one DP rank, say) are at
    their defaults while choosing, so such a flag is its own one error at the chosen TP rather than
    a silent other TP. Where no TP runs, the error says so, with one TP's (`_telling_tp`); where
    every TP gives the same error, no TP is the matter and it is that error alone."""
    from canzona.step_options import ELEMENTWISE_IGNORED
    from sim.simulate import ONE_RANK_SETTINGS

    unset = {*FLAG_ONLY_SETTINGS, *(name.rpartition(".")[2] for name, _, _ in ONE_RANK_SETTINGS),
             *(name for name, _ in ELEMENTWISE_IGNORED)}
    layout = replace(shared, **{name: getattr(SimOptions, name) for name in unset})
    errors: dict[int, SpecError] = {}
    for tp in DEFAULT_TPS:
        try:
            _sim_config(shared=replace(layout, tp=tp))
        except SpecError as e:
            errors[tp] = e
            continue
        return _sim_config(shared=replace(shared, tp=tp))
    if len({str(e) for e in errors.values()}) == 1:  # no TP changes it: the flag's own refusal
        raise errors[DEFAULT_TPS[0]]
    tp = _telling_tp(shared)
    raise SpecError(f"no --tp of {', '.join(map(str, DEFAULT_TPS))} runs this layout; at --tp {tp}: {errors[tp]}")


def _telling_tp(o: SimOptions) -> int:
    """Of `DEFAULT_TPS`, none of which runs `o`'s layout, the one whose error to show: the largest
    the cluster divides that leaves more than one DP rank (a smaller TP's error, a batch of too
    many micro-batches for more DP ranks say, would hide the one no TP fixes), else the largest
    the cluster divides, else the first (8, the default layout's)."""
    from canzona.hardware import load_profile
    from sim.topology import Cluster

    try:
        per_node = load_profile(o.hardware).node.gpus
    except CanzonaError:
        return DEFAULT_TPS[0]
    dps: dict[int, int] = {}
    for tp in DEFAULT_TPS:
        try:
            dps[tp] = Cluster(o.gpus, tp, per_node, o.pp, cp=o.cp).dp
        except SpecError:
            continue
    return next((tp for tp, dp in dps.items() if dp > 1), next(iter(dps), DEFAULT_TPS[0]))


def _check_zero1_fallback_applies(config, policy: str | None, zero1_fallback: bool) -> None:
    """--no-zero1-fallback where no policy run has canzona's ZeRO-1 fallback is a mistake, not a
    no-op (as --dp-policy and --alpha are): simulate runs `policy` (None: the optimizer's default,
    canzona for a matrix optimizer), compare every policy of `compared_policies`, so None stands for
    both (the default is among the compared). Under --fsdp `sim.fsdp` refuses it with its reason."""
    from sim.simulate import compared_policies

    runs = [policy] if policy is not None else list(compared_policies(config.optimizer, config.fsdp))
    if not zero1_fallback and "canzona" not in runs:
        raise SpecError(f"--no-zero1-fallback applies to the canzona policy only (its ZeRO-1 fallback); "
                        f"{', '.join(runs)} {'has' if len(runs) == 1 else 'have'} none")


def _router_imbalance(text: str) -> float | tuple[float, ...]:
    """`--router-imbalance`: one number, or a comma-separated histogram (checked against the model later)."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise SpecError(f"--router-imbalance takes a number or comma-separated numbers, got {text!r}") from None
    return values[0] if len(values) == 1 else values


def _run_options(*, shared: SimOptions):
    """The run options of `shared`'s options (keyword-only, as `_sim_config`)."""
    from sim.options import RunOptions

    o = shared
    return RunOptions(overlap_grad_reduce=o.overlap_grad_reduce, align_grad_reduce=o.align_grad_reduce,
                      overlap_param_gather=o.overlap_param_gather, tp_comm_overlap=o.tp_comm_overlap,
                      tp_comm_overlap_cfg=o.tp_comm_overlap_cfg,
                      recompute=o.recompute, recompute_method=o.recompute_method,
                      recompute_num_layers=o.recompute_num_layers, selective_ac_option=o.selective_ac_option,
                      reduce_scatter=o.reduce_scatter,
                      collectives=o.collectives, max_grad_norm=o.max_grad_norm, explicit_clip=o.explicit_clip,
                      batch_kernels=o.batch_kernels,
                      compile_kernels=o.compile_kernels, overlap_step=o.overlap_step,
                      attention_backend=o.attention_backend,
                      ep_dispatcher=_ep_dispatcher(o),
                      overlap_moe_expert_parallel_comm=o.overlap_moe_expert_parallel_comm,
                      delay_wgrad_compute=o.delay_wgrad_compute)


# the shared options that make the EP token dispatcher (`sim.ep_dispatch.EpDispatcher`, whose fields
# they are by name): simulate's and compare's run options and search's question take it whole
EP_DISPATCHER_OPTIONS = tuple(f.name for f in fields(EpDispatcher))


def _ep_dispatcher(o: SimOptions):
    """The dispatcher options of `o` (`EP_DISPATCHER_OPTIONS`) as `sim.ep_dispatch.EpDispatcher`;
    checked where the options are."""
    return EpDispatcher(**{name: getattr(o, name) for name in EP_DISPATCHER_OPTIONS})


Model = Annotated[str, typer.Option(help=MODEL_HELP)]
Gpus = Annotated[int, typer.Option(help=f"Number of GPUs (at most {MAX_GPUS}).")]
# --tp not given: the largest of these whose layout passes every check (`_sim_config`); 8 is the
# default layout's (Qwen3-32B on 256 GPUs), bit for bit as when it was the option's default
DEFAULT_TPS = (8, 4, 2, 1)
Tp = Annotated[int | None, typer.Option(
    help=f"Tensor-parallel size (inside a node; default: the largest of {', '.join(map(str, DEFAULT_TPS))} the "
         "layout runs, 1 under --fsdp with experts).", show_default=False)]
Optimizer = Annotated[str, typer.Option(help=OPTIMIZER_HELP)]
MatrixConfig = Annotated[str | None, typer.Option(help=MATRIX_CONFIG_HELP)]
DpPolicy = Annotated[str | None, typer.Option(help=f"canzona's DP policy (default {PLAN_DEFAULTS.dp_policy}; {PAPER_DP_POLICY}: the paper's); the baselines use their own.")]
TpPolicy = Annotated[str, typer.Option(help=f"canzona's TP scheduler: {', '.join(TP_POLICIES)} (the baselines run tp-sync).")]
TpMode = Annotated[str, typer.Option(help="Order of the TP micro-groups' operations: pipelined or serial.")]
Alpha = Annotated[float, typer.Option(help="Compute (1) vs segment-size (0) balance, in [0, 1].")]
SimAlpha = Annotated[float, typer.Option(
    help="Compute (1) vs segment-size (0) balance of canzona's plan, in [0, 1] (under --fsdp the balance of its "
         "owners; the baselines do not read it).")]
BucketSize = Annotated[int | None, typer.Option(
    help=f"Gradient bucket size in elements (default: about {MATRICES_PER_RANK} matrices per DP rank per bucket, "
         "at least max(40M, 1M x dp) and the largest matrix).")]
CapacityOpt = Annotated[str, typer.Option(help="Micro-group capacity: 'auto', seconds (20ms) or bytes (4GiB).")]
Geometry = Annotated[str, typer.Option(
    help=f"canzona's segments: {' or '.join(GEOMETRIES)} (auto: ZeRO-1's even segments where whole matrices plan no "
         "shorter step, each matrix that straddles a cut computed by the ranks it overlaps; whole: always whole "
         "matrices, the paper's).")]
Align = Annotated[int, typer.Option(help="Parameter start alignment in elements.")]
BalanceBy = Annotated[str, typer.Option(help="Balance 'seconds' (ours) or 'elements' (as the authors' code does).")]
Hardware = Annotated[str, typer.Option(help="Hardware profile name (h100-sxm, h200, a100-sxm) or a JSON path.")]
SeqLen = Annotated[int, typer.Option(help=f"Sequence length in tokens (at most {MAX_SEQ_LEN}).")]
GlobalBatch = Annotated[int, typer.Option(
    help=f"Sequences per iteration (at most {MAX_MICRO_BATCHES} micro-batches per DP rank).")]
MicroBatch = Annotated[int, typer.Option(help="Sequences per micro-batch per DP rank.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
OverlapGrad = Annotated[bool, typer.Option(help="Start each bucket's gradient reduce-scatter during the last backward (Megatron --overlap-grad-reduce).")]
AlignGrad = Annotated[bool, typer.Option(
    help="Under --pp with --overlap-grad-reduce, the schedule launches each model chunk's gradient reductions at once, "
         "at the same time on every pipeline stage; off: each bucket as its backward ends (Megatron --no-align-grad-reduce).")]
OverlapParams = Annotated[bool, typer.Option(help="All-gather updated parameters under the next forward (Megatron --overlap-param-gather).")]
TpOverlap = Annotated[bool, typer.Option(help="Hide sequence-parallel TP communication behind the GEMMs (Transformer Engine --tp-comm-overlap).")]
TpOverlapCfg = Annotated[str, typer.Option(
    help="The TP overlap's userbuffers configuration by its recipe name (Megatron-Bridge's tp_comm_overlap_cfg: each "
         "GEMM's overlap method, SMs, chunks and SM margin, sim.userbuffers; an unknown name lists them), e.g. "
         "userbuffers_fp8_h100_h16384_tp8_cp2_mbs1_seqlen8192, Llama 3.1 405B's H100 FP8 recipe's; with "
         "--tp-comm-overlap at --tp > 1 only.")]
EpOverlap = Annotated[bool, typer.Option(
    help="Megatron's --overlap-moe-expert-parallel-comm under --ep: the combined 1F1B schedule, one micro-batch's "
         "forward beside another's backward layer by layer, each one's dispatch / combine all-to-alls under the "
         "other's compute (--pp > 1 needs --vp > 1: the interleaved combined schedule; no full or selective-op "
         "recompute; off: Megatron's default).")]
DelayWgrad = Annotated[bool, typer.Option(
    help="Megatron's --delay-wgrad-compute under --overlap-moe-expert-parallel-comm: the experts' weight-gradient "
         "GEMMs run after the backward's dispatch gradient is issued, under it, the attention's at the end of the "
         "layer pair (off: Megatron's default).")]
AttentionBackend = Annotated[str, typer.Option(
    help="Attention kernels (Megatron's --attention-backend): fused (Transformer Engine's cuDNN attention, what "
         "auto picks on Hopper) or flash (flash-attn 2, TE 1.x's FlashAttention backend; NeMo 24.07's launcher).")]
Recompute = Annotated[str, typer.Option(help="Activation recompute: none, selective (attention core), selective-op (torchtitan's per-op policy: every other matmul and attention saved), selective-layer (torchtitan's, under --fsdp: every --selective-ac-option-th layer checkpointed) or full.")]
RecomputeMethod = Annotated[str | None, typer.Option(
    help="Megatron's --recompute-method under --recompute full: uniform (groups of --recompute-num-layers layers, "
         "each group's input stored and its forwards run again together) or block (the first "
         "--recompute-num-layers layers of each model chunk checkpointed, the rest storing everything); "
         "unset: every layer checkpointed on its own.")]
RecomputeNumLayers = Annotated[int | None, typer.Option(
    help="Megatron's --recompute-num-layers with --recompute-method: a uniform group's layers (dividing each "
         "model chunk's) or the layers of each chunk block checkpoints.")]
SelectiveAcOption = Annotated[int | None, typer.Option(
    help="torchtitan's --activation_checkpoint.selective_ac_option K under --recompute selective-layer: the K-th, "
         "2K-th, ... layer checkpointed whole, the others storing everything (unset: torchtitan's default, 2).")]
Pp = Annotated[int, typer.Option(help="Pipeline-parallel stages (1F1B); GPUs = DP x TP x PP.")]
Vp = Annotated[int, typer.Option(help="Model chunks per pipeline stage (Megatron's --virtual-pipeline-model-parallel-size): "
                                      "the interleaved 1F1B schedule, chunk c of stage r holding the model's chunk "
                                      "c x PP + r; needs --pp > 1, layers divisible by PP x VP (unless an uneven split "
                                      "below cuts them) and micro-batches per DP rank divisible by PP (1: plain 1F1B).")]
AccountEmbedding = Annotated[bool, typer.Option(
    "--account-for-embedding-in-pipeline-split",
    help="Megatron's option: the embedding counts as one layer when the layers are cut into the PP x VP model "
         "chunks ((layers + 1 [+ 1]) / (PP x VP) a chunk, the first chunk a decoder layer short); at --pp 1 a no-op, "
         "as in Megatron (which accepts it there: the one stage builds every layer); the simulator only.")]
AccountLoss = Annotated[bool, typer.Option(
    "--account-for-loss-in-pipeline-split",
    help="Megatron's option: the output layer and loss count as one layer when the layers are cut into the PP x VP "
         "model chunks (the last chunk a decoder layer short); at --pp 1 a no-op, as in Megatron (which accepts it "
         "there: the one stage builds every layer); the simulator only.")]
FirstStageLayers = Annotated[int | None, typer.Option(
    "--decoder-first-pipeline-num-layers",
    help="Megatron's option: the first pipeline stage's decoder layers (divisible by VP), the middle stages "
         "splitting what the first / last stages leave; not with the --account-for-* options; the simulator only.")]
LastStageLayers = Annotated[int | None, typer.Option(
    "--decoder-last-pipeline-num-layers",
    help="Megatron's option: the last pipeline stage's decoder layers (divisible by VP); the simulator only.")]
Cp = Annotated[int, typer.Option(help="Context parallelism (Megatron's --context-parallel-size, ring attention): each "
                                      "GPU holds seq / CP tokens of every micro-batch, attention exchanges K/V blocks "
                                      "with its CP neighbours, gradients are reduced and the optimizer step planned over "
                                      "DP x CP ranks; GPUs = DP x CP x TP x PP, seq len divisible by 2 x CP; the "
                                      "simulator only (1: none).")]
RouterImbalance = Annotated[str, typer.Option(
    help="Under --ep: the busiest EP rank's token-expert pairs over the mean (a number >= 1), or the router's "
         "histogram, one share of the tokens per expert, comma-separated (default 1: balanced).")]
Ep = Annotated[int, typer.Option(help="Expert parallelism of a mixture-of-experts model: each GPU holds experts / EP "
                                      "of every layer's experts (whole, or split over --etp), their gradients "
                                      "reduced over the DP x TP / (EP x ETP) ranks that hold the same ones; the "
                                      "simulator only.")]
Etp = Annotated[int, typer.Option(help="Expert TP under --ep (Megatron's expert_tensor_parallel_size): each expert "
                                       "matrix split over ETP consecutive ranks (gate / up rows, down columns), the "
                                       "tokens all-gathered and reduce-scattered over them around the grouped GEMMs; "
                                       "the step schedules each owner's ETP group as TP micro-groups.")]
ExpertBuckets = Annotated[str, typer.Option(
    help=f"How buckets of stacked expert matrices are sized: {', '.join(EXPERT_BUCKETS)} (DistributedOptimizer's "
         f"expert_buckets), or {AUTO_EXPERT_BUCKETS} (under --ep each sizing the expert plans differ by, the faster "
         "kept and named in --json's expert_buckets; at EP 1 the default).")]
Collectives = Annotated[str, typer.Option(help="DP collectives as Megatron runs each policy (megatron) or exactly as canzona's runtime issues them (runtime).")]
Fallback = Annotated[bool, typer.Option(help="Report canzona's ZeRO-1 fallback (zero1-gather) when it is faster, marked as such.")]
MaxGradNorm = Annotated[float | None, typer.Option(
    help="Clip the reduced gradients to this global norm inside the step (DistributedOptimizer's max_grad_norm; "
         "default: measure the norm only, as the runtime does every step).")]
ExplicitClip = Annotated[bool, typer.Option(
    help="The training loop calls DistributedOptimizer.clip_grad_norm_ before step(): price the step's recheck of "
         "the clip's check (one small all-gather over DP, one over TP; needs --collectives runtime).")]
BatchKernels = Annotated[bool, typer.Option(help="Same-shape matrices of a host as one batched kernel (DistributedOptimizer's batch_kernels).")]
CompileKernels = Annotated[bool, typer.Option(
    help="Newton-Schulz through torch.compile (DistributedOptimizer's and, under --fsdp, FsdpOptimizer's "
         "compile_kernels): priced as eager, so no simulated figure changes with it.")]
OverlapStep = Annotated[bool, typer.Option(
    help="Compute each micro-group's updates as soon as its buckets are reduced, under the remaining reductions, "
         "and apply them after the step check (DistributedOptimizer's overlap_step; canzona only, compare "
         "runs the baselines without it).")]
Fsdp = Annotated[bool, typer.Option("--fsdp", help="FSDP2 / ZeRO-3 layout: parameters, gradients and state sharded over the "
                                     "DP group (torch's fully_shard; under --tp, each TP rank's shard over its DP group, "
                                     "owners over DP x TP; under --pp, each stage's over its own DP group, torchtitan's 1F1B), "
                                     "gathered per layer in forward and backward; its "
                                     "policies: canzona, fsdp-owners-unbalanced, and in the simulator fsdp-gather-all.")]
HsdpReplicate = Annotated[int, typer.Option(help="HSDP under --fsdp: this many replicas of shard groups of DP / R ranks, "
                                                 "the reduced gradient shards all-reduced across them (1: plain FSDP).")]
ReshardAfterForward = Annotated[bool, typer.Option(
    help="Under --fsdp, FSDP2's fully_shard(reshard_after_forward=...): free each unit's gathered parameters after "
         "its forward and gather them again for its backward (FSDP2's default); --no-reshard-after-forward keeps "
         "them from the forward to the backward (one all-gather fewer per unit and micro-batch, every unit held; "
         "torchtitan's default under --pp).")]
Precision = Annotated[str, typer.Option(
    help="GEMM precision of the layers' linear modules: bf16, or fp8 (Transformer Engine's FP8 GEMMs with their "
         "casts and scaling, attention and the head in bf16; needs an FP8 GPU: h100-sxm, h200).")]
Fp8Recipe = Annotated[str, typer.Option(
    help="Under --precision fp8, Transformer Engine's scaling: delayed (amax history, one amax all-reduce per "
         "micro-batch) or current (per-tensor amax, read before each cast).")]
GpuVariability = Annotated[float | None, typer.Option(
    help="The per-GPU compute time's standard deviation over its median GPU's (default: the hardware profile's "
         "variability.time_cv): forward / backward wait for the expected slowest of the job's GPUs; 0 prices every "
         "GPU alike.")]
ReduceScatter = Annotated[str, typer.Option(help=f"How gradients are reduce-scattered, as DistributedOptimizer's reduce_scatter: {REDUCE_SCATTER_HELP}.")]
Kernels = Annotated[str, typer.Option(
    help="The layers' memory-bound kernels (norms, RoPE, SwiGLU, the loss): fused (Transformer Engine / Megatron's) "
         "or eager (PyTorch's eager ops, as torchtitan runs with compile = false; dense Llama layers).")]
FsdpImpl = Annotated[str, typer.Option(
    help="Under --fsdp, the implementation: fsdp2 (torch's fully_shard, canzona's runtime's: its all-gather copy-out "
         "and reduce-scatter copy-in on the compute stream) or megatron-fsdp (collectives on the parameter and "
         "gradient buffers in place).")]
MoeTokenDispatcherType = Annotated[str, typer.Option(
    help="Under --ep, Megatron's token dispatcher: alltoall (every token-expert pair sent, as canzona's reference EP "
         "model runs) or flex (DeepEP / HybridEP: a token crosses to each destination node and rank once).")]
MoeFlexDispatcherBackend = Annotated[str | None, typer.Option(
    help="Under --moe-token-dispatcher-type flex, its backend: deepep or hybridep (priced across nodes from their "
         "published measurements where the hardware has one).")]
MoeHybridepNumSms = Annotated[int, typer.Option(
    help="HybridEP's SMs (Megatron's --moe-hybridep-num-sms): which published measurement prices it.")]
MoeDeepepNumSms = Annotated[int, typer.Option(
    help="DeepEP's SMs (Megatron's --moe-deepep-num-sms, even): taken from the GEMMs while it runs, and its "
         "buffer's channels (two SMs each).")]
FakeBalancedGate = Annotated[bool, typer.Option(
    help="NeMo AutoModel's fake_balanced_gate (its benchmark recipes): each token to top-k consecutive experts, so "
         "a flex dispatch reaches the fewest ranks, and no router GEMM; off: a router's uniform routing.")]
Routing = Annotated[str, typer.Option(
    help="Under --ep, how the router routes each token: random (each token's top-k drawn afresh, as Megatron's "
         "--moe-router-force-load-balancing does and a learned router at least as unevenly: each layer waits for "
         "the EP group's busiest rank, canzona.routing) or balanced (every EP rank exactly its mean).")]
CrossEntropyLossFusion = Annotated[bool, typer.Option(
    help="Megatron's --cross-entropy-loss-fusion: the loss's fused cross-entropy (--cross-entropy-fusion-impl); off: "
         "the unfused fp32 upcast, softmax and loss, as Megatron's default and canzona's examples run it.")]
CrossEntropyFusionImpl = Annotated[str, typer.Option(
    help="Megatron's --cross-entropy-fusion-impl under --cross-entropy-loss-fusion: native (Megatron's "
         "torch.compile'd functions) or te (Transformer Engine's Triton kernels, the gradient written over the "
         "logits).")]
StoreParamRemainders = Annotated[bool, typer.Option(
    help="Megatron's store_param_remainders (its precision-aware optimizer; Apex DistributedFusedAdam under NeMo): "
         "keep only the low 16 bits of each fp32 master beside the bf16 weight, 2 bytes a parameter less; off: "
         "full fp32 masters, as canzona's runtime keeps them.")]
Fp8Params = Annotated[bool, typer.Option(
    help="FP8 primary weights (NeMo's fp8_params, Transformer Engine's fp8_model_init) under --precision fp8: each "
         "linear weight kept in FP8 with its cached transpose and no bf16 copy (2 bytes a weight less), the "
         "optimizer keeping full fp32 masters (not with --store-param-remainders); ZeRO-1 layouts only.")]
ApplyRopeFusion = Annotated[bool, typer.Option(
    help="Megatron's apply_rope_fusion: Transformer Engine's fused RoPE; off: Megatron-core's unfused PyTorch RoPE "
         "(its own default), as Megatron-Bridge's Qwen3 recipes run.")]
BiasActivationFusion = Annotated[bool, typer.Option(
    help="Megatron's bias_activation_fusion: the fused SwiGLU; off: Megatron-core's unfused silu and product (its "
         "own default), as Megatron-Bridge's Qwen3 8B recipe runs.")]
LossFp32Upcast = Annotated[bool, typer.Option(
    help="Whether the loss upcasts the bf16 logits to fp32 (Megatron's unfused loss, torchtitan's, Hugging Face's); "
         "off: a loss on the bf16 logits, as NeMo AutoModel's MaskedCrossEntropy(fp32_upcast=False), whose saved "
         "copies of the logits are bf16.")]
LossHoldsLogits = Annotated[bool, typer.Option(
    help="Under --fsdp (PyTorch's F.cross_entropy): the training loop keeps the model's logits through the "
         "backward, as NeMo AutoModel's does; off: torchtitan's and Hugging Face's Trainer, which drop them "
         "before it.")]
MasterWeights = Annotated[bool, typer.Option(
    help="DistributedOptimizer(master_weights=...): fp32 masters of the bf16 weights (the runtime's default); off: "
         "no fp32 copy, the gradients, the optimizer state that follows the update (Muon's momentum, AdamW's "
         "moments) and the update in the parameters' bf16, as the runtime keeps them and a model built in bf16 under "
         "--fsdp (NeMo AutoModel's).")]
GradReduceInFp32 = Annotated[bool | None, typer.Option(
    help="Megatron's DDP grad_reduce_in_fp32: fp32 gradient buffers and reductions; off: bf16, as NVIDIA's "
         "performance recipes set it (default: fp32 with master weights, Megatron's and canzona's runtime's; the "
         "parameters' bf16 without them, as the runtime reduces; under --fsdp, FSDP2's reduce_dtype).",
    show_default=False)]


Policy = Annotated[str | None, typer.Option(help=f"{POLICY_HELP} (default: canzona; zero1 for adamw).")]


@dataclass(frozen=True, kw_only=True)
class SimOptions:
    """Every option of a simulated layout and workload: one definition of their names, defaults and
    help, the options of `canzona simulate` and (less --policy, which it varies) `canzona compare`
    (`cli.shared_options.takes_options`), built into the simulator's configuration by `_sim_config`.
    A field added here is an option of both commands; tests/cli/test_shared_options.py fails on an
    option one has and the other lacks outside its allow-list."""

    model: Model = DEFAULT_MODEL
    gpus: Gpus = 256
    tp: Tp = None
    optimizer: Optimizer = "muon"
    matrix_config: MatrixConfig = None
    policy: Policy = None
    dp_policy: DpPolicy = None
    tp_policy: TpPolicy = PLAN_DEFAULTS.tp_policy
    alpha: SimAlpha = PLAN_DEFAULTS.alpha
    bucket_size: BucketSize = None
    capacity: CapacityOpt = "auto"
    hardware: Hardware = DEFAULT_PROFILE
    cost_table: CostTable = None
    seq_len: SeqLen = 4096
    global_batch: GlobalBatch = 128
    micro_batch: MicroBatch = 1
    tp_mode: TpMode = STEP_DEFAULTS.tp_mode
    overlap_grad_reduce: OverlapGrad = True
    align_grad_reduce: AlignGrad = True
    overlap_param_gather: OverlapParams = STEP_DEFAULTS.overlap_param_gather
    tp_comm_overlap: TpOverlap = True
    tp_comm_overlap_cfg: TpOverlapCfg = DEFAULT_UB_CONFIG
    recompute: Recompute = "none"
    recompute_method: RecomputeMethod = None
    recompute_num_layers: RecomputeNumLayers = None
    selective_ac_option: SelectiveAcOption = None
    reduce_scatter: ReduceScatter = STEP_DEFAULTS.reduce_scatter
    attention_backend: AttentionBackend = "fused"
    overlap_moe_expert_parallel_comm: EpOverlap = False
    delay_wgrad_compute: DelayWgrad = False
    zero1_fallback: Fallback = True
    pp: Pp = 1
    vp: Vp = 1
    cp: Cp = 1
    ep: Ep = 1
    router_imbalance: RouterImbalance = "1"
    etp: Etp = 1
    expert_buckets: ExpertBuckets = PLAN_DEFAULTS.expert_buckets
    geometry: Geometry = DEFAULT_GEOMETRY
    align: Align = PLAN_DEFAULTS.align
    balance_by: BalanceBy = PLAN_DEFAULTS.balance_by
    collectives: Collectives = "megatron"
    max_grad_norm: MaxGradNorm = STEP_DEFAULTS.max_grad_norm
    explicit_clip: ExplicitClip = False
    batch_kernels: BatchKernels = STEP_DEFAULTS.batch_kernels
    compile_kernels: CompileKernels = STEP_DEFAULTS.compile_kernels
    overlap_step: OverlapStep = STEP_DEFAULTS.overlap_step
    fsdp: Fsdp = False
    hsdp_replicate: HsdpReplicate = 1
    reshard_after_forward: ReshardAfterForward = True
    grad_reduce_in_fp32: GradReduceInFp32 = None
    precision: Precision = "bf16"
    fp8_recipe: Fp8Recipe = "delayed"
    gpu_variability: GpuVariability = None
    kernels: Kernels = "fused"
    fsdp_impl: FsdpImpl = "fsdp2"
    account_for_embedding_in_pipeline_split: AccountEmbedding = False
    account_for_loss_in_pipeline_split: AccountLoss = False
    decoder_first_pipeline_num_layers: FirstStageLayers = None
    decoder_last_pipeline_num_layers: LastStageLayers = None
    moe_token_dispatcher_type: MoeTokenDispatcherType = ALLTOALL
    moe_flex_dispatcher_backend: MoeFlexDispatcherBackend = None
    moe_hybridep_num_sms: MoeHybridepNumSms = DEFAULT_HYBRIDEP_SMS
    moe_deepep_num_sms: MoeDeepepNumSms = DEEPEP_SMS
    fake_balanced_gate: FakeBalancedGate = False
    routing: Routing = RANDOM
    cross_entropy_loss_fusion: CrossEntropyLossFusion = False
    cross_entropy_fusion_impl: CrossEntropyFusionImpl = "native"
    store_param_remainders: StoreParamRemainders = False
    fp8_params: Fp8Params = False
    loss_fp32_upcast: LossFp32Upcast = True
    loss_holds_logits: LossHoldsLogits = False
    master_weights: MasterWeights = STEP_DEFAULTS.master_weights
    apply_rope_fusion: ApplyRopeFusion = True
    bias_activation_fusion: BiasActivationFusion = True


# `canzona simulate`'s command line read back from a configuration (`cli.replay`): the search prints
# each row's, and the tests check it builds the row again, bit for bit
REPLAY = Replay(options=SimOptions, build=_sim_config, app=app)


@app.command()
@takes_options(SimOptions)
def simulate(
    shared: SimOptions,
    trace: Annotated[Path | None, typer.Option(help="Write a Chrome / Perfetto trace here.")] = None,
    as_json: AsJson = False,
) -> None:
    """Simulate one training iteration of a layout under one policy."""
    from sim.simulate import check_traceable, write_trace
    from sim.simulate import simulate as run

    try:
        config = _sim_config(shared=shared)
        if trace is not None:
            check_output_path(trace, "trace", (".json",), inputs=(model_file(config.model), profile_file(config.hardware)))
            check_traceable(config)
        result = run(config)
        if trace is not None:
            write_trace(result, trace)
    except CanzonaError as e:
        fail(str(e))
    if as_json:
        emit_json(result.to_dict())
        return
    console.print(simulate_table(result))
    if trace is not None:
        console.print(f"trace written to {trace} (open in chrome://tracing or ui.perfetto.dev)")


@app.command()
@takes_options(SimOptions, omit=("policy",))
def compare(
    shared: SimOptions,
    plot: Annotated[Path | None, typer.Option(help="Save a bar chart of the comparison here (.png, .svg or .pdf).")] = None,
    as_json: AsJson = False,
) -> None:
    """Simulate every policy on the same layout, side by side (default: Qwen3-32B on 256 H100, TP 8)."""
    from rich.progress import Progress

    from sim.simulate import compare as run
    from sim.simulate import compared_policies

    try:
        base = _sim_config(shared=shared)  # bad input fails here, before a progress bar is drawn
        if plot is not None:
            check_output_path(plot, "plot", PLOT_SUFFIXES, inputs=(model_file(base.model), profile_file(base.hardware)))
        policies = compared_policies(base.optimizer, base.fsdp)
        err = Console(stderr=True)
        with Progress(console=err, transient=True, disable=as_json or not err.is_terminal) as progress:
            task = progress.add_task("simulating", total=len(policies))

            started: list[str] = []

            def tick(name: str) -> None:  # called before each policy, so the ones before are done
                progress.update(task, completed=len(started), description=f"simulating {name}")
                started.append(name)

            results = run(base, policies, progress=tick)
            progress.update(task, completed=len(policies))
        if plot is not None:
            compare_plot(results, plot)
    except CanzonaError as e:
        fail(str(e))
    if as_json:
        emit_json([r.to_dict() for r in results])
        return
    console.print(compare_table(results))
    if plot is not None:
        console.print(f"plot written to {plot}")


# `canzona simulate`'s options that `canzona search` does not take, each with why (every other one is
# a search option with simulate's name, default and help, set on every layout searched:
# tests/cli/test_shared_options.py holds search to this list)
SEARCH_LACKS: dict[str, str] = {
    **dict.fromkeys(("tp", "pp", "vp", "cp", "ep", "micro_batch", "recompute"), "a layout axis the search explores"),
    **dict.fromkeys(("hsdp_replicate", "reshard_after_forward"), "an FSDP layout axis the search explores"),
    **dict.fromkeys(("policy", "reduce_scatter"), "tried on the best layouts (the refinement)"),
    "overlap_moe_expert_parallel_comm": "search's own option: on every layout Megatron allows it on, the others without",
    "recompute_method": "search's own option: on every layout searched with full recompute",
    **dict.fromkeys(("dp_policy", "tp_policy", "alpha", "bucket_size", "capacity", "geometry", "align", "balance_by",
                     "expert_buckets", "tp_mode", "zero1_fallback"),
                    "canzona's plan settings: the layouts are ranked under its default plan, whose canzona plan "
                    "command the search prints"),
    "etp": "expert TP is not explored: every EP layout at ETP 1",
    "router_imbalance": "a skew of EP ranks: the EP 1 layouts the search also explores would refuse it",
    **dict.fromkeys(("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"),
                    "explored: every PP the search tries runs the even split and, where they divide, the layers "
                    "with the embedding and the loss counted as layers"),
    **dict.fromkeys(("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"),
                    "a count per stage, not explored: the search cuts the layers evenly, or with the embedding "
                    "and the loss counted as layers"),
    "collectives": "the runtime's collectives (--collectives runtime) are a validation setting, not a layout's",
    "explicit_clip": "the runtime's step recheck, priced under --collectives runtime only (a validation setting)",
    "overlap_step": "canzona's own step option: the refinement tries step policies that refuse it",
    "compile_kernels": "priced as eager (sim.options.RunOptions): it changes no layout's time",
    "cost_table": "the layouts are ranked under canzona's default plan, priced on --hardware",
}
# the search's options of simulate's: every shared one a `Question` field of the same name, but the
# dispatcher's, which make its `ep_dispatcher` (`_ep_dispatcher`)
SEARCH_SHARED = tuple(f.name for f in fields(SimOptions) if f.name not in SEARCH_LACKS)


@app.command()
@takes_options(SimOptions, omit=SEARCH_LACKS)
def search(
    shared: SimOptions,
    overlap_moe_expert_parallel_comm: Annotated[bool, typer.Option(
        help="Run every layout Megatron's EP all-to-all overlap allows (--ep > 1, --pp 1 or --vp > 1, no full or "
             "selective-op recompute) with --overlap-moe-expert-parallel-comm; the others without it.")] = False,
    recompute_method: Annotated[str | None, typer.Option(
        help="Megatron's --recompute-method for every layout searched with full recompute: uniform or block "
             "(with --recompute-num-layers; a layout whose model chunks a uniform group does not divide is "
             "searched without full recompute); unset: every layer checkpointed on its own.")] = None,
    search_recompute_layers: Annotated[bool, typer.Option(
        help="Without --recompute-method: try a layout that needs full recompute first with Megatron's block method, "
             "at the fewest layers a model chunk whose memory floor fits, and with every layer checkpointed only if "
             "that run does not fit.")] = True,
    top: Annotated[int, typer.Option(help="How many of the fastest layouts to print.")] = 10,
    workers: Annotated[int | None, typer.Option(help="Simulations in parallel (default: one per core).")] = None,
    as_json: AsJson = False,
) -> None:
    """Search the layouts of a model on a number of GPUs (TP, PP, VP, CP, EP, DP, micro-batch, recompute, then step
    policy and reduce-scatter on the best; with --fsdp FSDP2 / HSDP layouts: TP, EP, HSDP replicas,
    reshard_after_forward, micro-batch, recompute (selective-layer at K 2, 3, 4 and at
    --selective-ac-option's), then the FSDP step policies): prune by the simulator's checks
    and memory, simulate the rest in parallel, print the fastest that fit and the canzona plan command of the best
    (under --fsdp, which has no plan file, what the launcher sets)."""
    import os

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from cli.render import search_table
    from sim.search import Question
    from sim.search import search as run

    try:
        if top < 1:
            raise SpecError(f"--top must be >= 1, got {top}")
        if workers is not None and not 1 <= workers <= 4 * (os.cpu_count() or 1):
            raise SpecError(f"--workers must be in 1..{4 * (os.cpu_count() or 1)}, got {workers}")
        o = shared
        question = Question(**{name: getattr(o, name) for name in SEARCH_SHARED
                               if name not in EP_DISPATCHER_OPTIONS and name != "matrix_config"},
                            ep_dispatcher=_ep_dispatcher(o), matrix_config=parse_matrix_config(o.matrix_config, o.optimizer),
                            overlap_moe_expert_parallel_comm=overlap_moe_expert_parallel_comm,
                            recompute_method=recompute_method, search_recompute_layers=search_recompute_layers)
        err = Console(stderr=True)
        # outside a terminal rich's bar hides itself: plain lines instead, --json or not (stdout stays its own)
        plain = None if err.is_terminal else PlainProgress("search", plain_progress.EVERY_S)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err, transient=True, disable=as_json or not err.is_terminal) as progress:
            task = progress.add_task("searching", total=None)

            def tick(done: int, total: int, what: str | None, best: float | None) -> None:
                if what is not None:  # a simulation finished (None: the search's heartbeat, for the plain lines)
                    progress.update(task, completed=done, total=total, description=f"simulated {what}")
                if plain is not None:
                    plain(done, total, best)

            result = run(question, workers=workers, progress=tick)
        if not result.ranked:
            smallest = result.not_fitting[0]
            raise SpecError(f"no layout of {o.model} on {o.gpus} GPUs fits: the smallest simulated needs "
                            f"{smallest['memory_bytes'] / 1e9:.1f} GB per GPU of {smallest['memory_capacity_bytes'] / 1e9:.1f}")
        # each row's `canzona simulate` command: built here, where a layout the flags cannot express
        # fails as one error line (cli.replay checks each against the row's configuration)
        summary = result.to_dict(top, simulate_command=REPLAY.simulate_command)
    except CanzonaError as e:
        fail(str(e))
    if as_json:
        emit_json(summary)
        return
    console.print(search_table(result, top))
    best = summary["layouts"][0]
    command = best["plan_command"]
    if command is None:  # an FSDP layout: no plan file (canzona plan plans ZeRO-1 layouts)
        console.print("best: no plan file (canzona plan plans ZeRO-1 layouts; canzona's FSDP optimizer places its "
                      "owners when it is built)")
        console.print(f"  set in the launcher: {'; '.join(best['not_in_plan'])}")
    else:
        # command lines as they are: never wrapped mid-line or read as rich markup, so they paste
        console.print(f"best: {command}", soft_wrap=True, markup=False, highlight=False)
        if best["not_in_plan"]:
            console.print(f"  set in the launcher, not in the plan file: {'; '.join(best['not_in_plan'])}")
    # the row's run again, bit for bit (for --trace, the memory breakdown, a comparison)
    console.print(f"  simulate: {best['simulate_command']}", soft_wrap=True, markup=False, highlight=False)


@app.command()
def verify(
    dp: Annotated[int, typer.Option(help=f"Data-parallel ranks to spawn (gloo, CPU; 1..{checks.MAX_DP}).")] = 2,
    optimizer: Annotated[str, typer.Option(help=f"{OPTIMIZER_HELP[:-1]}, or all.")] = "muon",
    policy: Annotated[str | None, typer.Option(help=f"{POLICY_HELP}, or all that run the optimizer (default: canzona; zero1 for adamw).")] = None,
    steps: Annotated[int, typer.Option(help=f"Training steps of the tiny model (at most {checks.MAX_STEPS}).")] = 10,
    dp_policy: DpPolicy = None,
    accumulation: Annotated[int, typer.Option(help="Gradient-accumulation micro-batches per step.")] = 1,
    preset: Annotated[str | None, typer.Option(
        help="Tiny model preset: tiny, tiny-untied, tiny-tp4 or small (TP 4: tiny-tp4, small); tiny-moe, the "
             "mixture of experts, or tiny-moe-attn, with attention (default: tiny, and tiny-moe under --ep).")] = None,
    global_batch: Annotated[int | None, typer.Option(
        help=f"Sequences per step (default: 4 x dp x accumulation; at most {checks.MAX_GLOBAL_BATCH}).")] = None,
    alpha: Alpha = PLAN_DEFAULTS.alpha,
    bucket_size: BucketSize = None,
    tp: Annotated[int, typer.Option(help=f"Tensor-parallel size: dp x tp ranks are spawned (at most {checks.MAX_RANKS}).")] = 1,
    tp_policy: Annotated[str, typer.Option(
        help=f"canzona's TP scheduler: {', '.join(checks.TP_SCHEDULERS)} or all (the baselines run tp-sync).")] = PLAN_DEFAULTS.tp_policy,
    tp_mode: Annotated[str, typer.Option(help="Order of the TP micro-groups' operations: pipelined, serial or all.")] = STEP_DEFAULTS.tp_mode,
    tp_style: Annotated[str, typer.Option(
        help="How the TP model is split (--tp 2 or more): megatron (explicit layers, annotated shards) or dtensor "
             "(parallelize_module).")] = "megatron",
    ep: Annotated[int, typer.Option(
        help="Expert parallelism of the mixture-of-experts preset: the dp x tp ranks form EP groups of ep "
             "consecutive ranks, each holding experts / ep of every layer; the experts are owned whole in their "
             "expert-data-parallel groups of dp x tp / ep ranks (under --tp the dense layers are split over TP).")] = 1,
    fsdp: Fsdp = False, hsdp_replicate: HsdpReplicate = 1,
    as_json: AsJson = False,
) -> None:
    """Check the distributed runtime numerically (rung 3): train the tiny model on spawned gloo ranks
    (dp x tp; under TP on a (dp, tp) mesh; under --ep with its experts split over EP groups) and
    compare every rank's parameters with the same kernels in one process (bit for bit) and the
    reference optimizers (1e-5 relative); under --fsdp the model sharded by torch's fully_shard over
    the dp ranks (per decoder layer and the root), each rank's shards checked. Exit code 1 on any
    mismatch."""
    from rich.progress import Progress

    try:
        optimizers = checks.OPTIMIZERS if optimizer == "all" else (optimizer,)
        chosen = list(STEP_POLICIES) if policy == "all" else [policy or default_policy(o) for o in optimizers]
        _check_dp_policy_applies(chosen, dp_policy)
        if preset is None:  # not `or`: an empty name is refused as an unknown preset, not read as the default
            preset = "tiny-moe" if ep > 1 else "tiny"
        cases = checks.prepare(dp, optimizer, policy, steps, dp_policy or PLAN_DEFAULTS.dp_policy, accumulation, preset,
                               global_batch, tp, alpha, bucket_size, tp_policy=tp_policy, tp_mode=tp_mode,
                               tp_style=tp_style, ep=ep, fsdp=fsdp, hsdp_replicate=hsdp_replicate)
        # after prepare's own checks of the values; a TP choice no chosen policy reads (AdamW's zero1
        # runs tp-sync) is refused, as `simulate` and the runtime refuse it, not dropped
        _check_dp_policy_applies(chosen, None, alpha, tp_policy, tp_mode=tp_mode)
    except CanzonaError as e:
        fail(str(e))
    err = Console(stderr=True)
    try:
        with Progress(console=err, transient=True, disable=as_json or not err.is_terminal) as progress:
            task = progress.add_task("verifying", total=None)

            def tick(done: int, total: int, what: str) -> None:
                progress.update(task, completed=done, total=total, description=what)

            rows = checks.run(cases, dp, progress=tick)
    except CanzonaError as e:  # a rank failed, died or hung: the run failed, the input was fine
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        raise typer.Exit(code=1) from None
    summary = checks.report(rows)
    if as_json:
        emit_json(summary)
    else:
        console.print(verify_table(rows))
        verdict = "all checks passed" if summary["ok"] else f"{summary['failed']} of {summary['checks']} checks FAILED"
        console.print(verdict, style="bold green" if summary["ok"] else "bold red")
    if not summary["ok"]:
        raise typer.Exit(code=1)


@app.command()
def calibrate(
    device: Annotated[str | None, typer.Option(help="cpu or cuda (default: cuda when available, else cpu).")] = None,
    model: Annotated[str | None, typer.Option(
        help=f"Time the optimizer kernels on this catalog model's matrix shapes (default: {calibration.DEFAULT_MODEL}).")] = None,
    shapes: Annotated[str | None, typer.Option(
        help="Time the optimizer kernels on these shapes instead, e.g. 256x512,512x512 (not with --model).")] = None,
    out: Annotated[Path | None, typer.Option(help="Write the measured hardware profile (.json) here.")] = None,
    world_size: Annotated[int | None, typer.Option(
        help=f"Also measure collectives on this many spawned gloo ranks (CPU; 2..{calibration.MAX_SPAWNED_RANKS}); under torchrun the launched group is used.")] = None,
    base: Annotated[str, typer.Option(help="Profile (name or JSON path) that supplies every figure not measured.")] = DEFAULT_PROFILE,
    quick: Annotated[bool, typer.Option(help="Fewer sizes, group sizes and repeats.")] = False,
    repeats: Annotated[int | None, typer.Option(help="Timed repeats per measurement (default 5, 3 with --quick).")] = None,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads while measuring (default: torch's).")] = None,
    name: Annotated[str | None, typer.Option(help="Profile name (default: cpu-<host> or <gpu>-<host>).")] = None,
    as_json: AsJson = False,
) -> None:
    """Measure this machine (GEMMs, optimizer kernels, solvers, launch overhead, memory bandwidth and,
    with --world-size or under torchrun, collectives) into a hardware profile for --hardware."""
    from rich.progress import Progress

    try:
        from canzona.harness import calibrate as measuring  # torch
    except ImportError as e:
        fail(f"canzona calibrate needs torch: {e}")
    try:
        settings = measuring.prepare(device, model, shapes, world_size, base, quick, repeats, name,
                                     command=" ".join(["canzona", *sys.argv[1:]]), threads=threads)
        writer = measuring.is_writer()
        if out is not None and writer:
            check_output_path(out, "hardware profile", (".json",), inputs=(profile_file(settings.base),))
    except CanzonaError as e:
        fail(str(e))
    err = Console(stderr=True)
    try:
        with Progress(console=err, transient=True, disable=as_json or not writer or not err.is_terminal) as progress:
            task = progress.add_task("calibrating", total=None)

            def tick(done: int, total: int, what: str) -> None:
                progress.update(task, completed=done, total=total, description=what)

            profile = measuring.calibrate(settings, progress=tick)
        if profile is not None and out is not None:
            calibration.write_profile(profile, out)
    except CanzonaError as e:  # a rank failed or the write failed: the input was fine
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        raise typer.Exit(code=1) from None
    except RuntimeError as e:  # torch on this device (out of memory, a missing kernel): the run failed
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: measurement failed: {one_line(first)}", file=sys.stderr)
        raise typer.Exit(code=1) from None
    if profile is None:  # a torchrun rank other than 0: it took part in the collectives
        return
    if as_json:
        emit_json(profile)
        return
    for table in calibration_tables(profile):
        console.print(table)
    if out is not None:
        console.print(f"profile written to {out}: use it with --hardware {out}")
    else:
        console.print("profile not written (give --out profile.json to keep it)")


VALIDATE_MAX_DP = 4
# `canzona validate`'s options that the runtime validation reads and the published table does not
RUNTIME_VALIDATE_OPTIONS = ("hardware", "dp", "optimizer", "policies", "rounds", "profile_out", "strict")


@app.command()
def validate(
    hardware: Annotated[str | None, typer.Option(
        help="A profile calibrated on this machine (canzona calibrate --device cpu --world-size DP --threads 1); "
             "default: calibrate one now (quick).")] = None,
    dp: Annotated[int, typer.Option(help=f"Spawned gloo ranks (2..{VALIDATE_MAX_DP}).")] = 2,
    optimizer: Optimizer = "muon",
    policies: Annotated[str, typer.Option(help="Comma-separated step policies, or all.")] = "all",
    rounds: Annotated[int, typer.Option(help="Measured rounds per policy (after 3 warm-up rounds).")] = 10,
    profile_out: Annotated[Path | None, typer.Option(help="Keep the calibrated profile here (.json; not with --hardware).")] = None,
    strict: Annotated[bool, typer.Option(help="Exit 1 unless the ranking is preserved and every step error is within 30%.")] = False,
    published: Annotated[bool, typer.Option(
        "--published", help="Instead: simulate every published run of canzona/data/published_runs.json the "
                            "simulator can express and print its error against the published tokens/s/GPU, the mean "
                            "absolute and signed errors, Kendall tau within each model and overall, and the memory fit "
                            "(rows needing what the simulator lacks are listed as not expressible, with what they need).")] = False,
    rows: Annotated[str | None, typer.Option(
        help="With --published: only the rows whose id or model contains one of these comma-separated terms.")] = None,
    search: Annotated[bool, typer.Option(
        "--search", help="With --published: also search each row's model, GPUs, hardware, optimizer, sequence and "
                         "global batch (canzona search) and print where the published layout ranks among the layouts "
                         "found and its gap to the best (aim: top five or within 5%; slow: minutes a row).")] = False,
    workers: Annotated[int | None, typer.Option(
        help="With --published: simulations in parallel, rows and searched layouts (default: one per core).")] = None,
    as_json: AsJson = False,
) -> None:
    """Check the simulator against the runtime: train a scaled-up tiny model under every policy on
    spawned gloo ranks, predict the same runs with a profile calibrated on this machine, and print
    measured vs predicted step and iteration times, the error per policy and whether the ranking is
    preserved (Kendall tau). With --published: against published training runs instead."""
    import tempfile

    from rich.progress import Progress

    from canzona.optimizers import check_matrix_optimizer

    if published or rows is not None or search or workers is not None:
        # the runtime validation's options, which the published table would drop without a word: those
        # given off their defaults (the signature's, so they are stated once)
        import inspect

        given = locals()
        defaults = inspect.signature(validate).parameters
        runtime = ["--" + name.replace("_", "-") for name in RUNTIME_VALIDATE_OPTIONS
                   if given[name] != defaults[name].default]
        if runtime:
            fail(f"{', '.join(runtime)} {'is' if len(runtime) == 1 else 'are'} for the runtime validation (canzona "
                 "validate without --published): the published table simulates each row on its own hardware, with "
                 "AdamW, and has no pass / fail gate")
        _validate_published(published, rows, as_json, search, workers)
        return
    try:
        check_matrix_optimizer(optimizer)
        # "all": the policies that run the optimizer (zero1 runs AdamW only); a named one that does not
        # is refused here, not on a rank after calibrating
        chosen = list(policies_running(optimizer)) if policies == "all" else \
            [p.strip() for p in policies.split(",") if p.strip()]
        for p in chosen:
            if p not in STEP_POLICIES:
                raise SpecError(f"unknown policy {p!r}; choose from {', '.join(STEP_POLICIES)} or all")
            STEP_POLICIES[p].check_optimizer(optimizer)
        if not chosen:
            raise SpecError("--policies names no policy")
        if not 2 <= dp <= VALIDATE_MAX_DP:
            raise SpecError(f"--dp must be in 2..{VALIDATE_MAX_DP}, got {dp}")
        if not 3 <= rounds <= 200:
            raise SpecError(f"--rounds must be in 3..200, got {rounds}")
        if profile_out is not None:
            if hardware is not None:  # nothing is calibrated, so nothing would be written
                raise SpecError("--profile-out keeps the profile canzona validate calibrates; with --hardware none is "
                                "calibrated: give one of them")
            check_output_path(profile_out, "hardware profile", (".json",))
        if hardware is not None:
            from canzona.hardware import load_profile

            load_profile(hardware)
    except CanzonaError as e:
        fail(str(e))
    from canzona import calibration
    from canzona.harness import calibrate as measuring
    from canzona.harness import validate as runtime_validation
    from cli.render import validate_table
    from sim import validate as sim_validation

    cfg = runtime_validation.VALIDATION_MODEL
    spec = runtime_validation.validation_spec(cfg)
    err = Console(stderr=True)
    try:
        with tempfile.TemporaryDirectory(prefix="canzona-validate-") as tmp, \
                Progress(console=err, transient=True, disable=as_json or not err.is_terminal) as progress:
            task = progress.add_task("validating", total=None)

            def tick(done: int, total: int, what: str) -> None:
                progress.update(task, completed=done, total=total, description=what)

            if hardware is None:
                shapes = ",".join(sorted({f"{m}x{n}" for m, n in (p.shape for p in spec.matrix_params())}))
                settings = measuring.prepare("cpu", None, shapes, dp, None, True, None, None,
                                             command="canzona validate", threads=1)
                progress.update(task, description="calibrating this machine")
                profile = measuring.calibrate(settings, progress=tick)
                hardware = str(profile_out or Path(tmp) / "profile.json")
                calibration.write_profile(profile, hardware)
            progress.update(task, description="measuring the runtime")
            measured = runtime_validation.measure(chosen, optimizer, dp, rounds, cfg=cfg, progress=tick)
            predicted = sim_validation.predict(chosen, spec, cfg.as_catalog().architecture(), dp, runtime_validation.SEQ_LEN,
                                               runtime_validation.BATCH_PER_RANK, optimizer, hardware)
            report = sim_validation.compare(measured, predicted)
    except CanzonaError as e:  # a rank failed or hung: the run failed, the input was fine
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        raise typer.Exit(code=1) from None
    ok = report.ranking_preserved and report.worst_step_error <= 0.3
    if as_json:
        emit_json({**report.to_dict(), "dp": dp, "optimizer": optimizer, "model": cfg.name,
                   "hardware": hardware if profile_out or hardware else "calibrated now", "aims_met": ok})
    else:
        console.print(validate_table(report, dp, optimizer, cfg.name))
        verdict = ("ranking preserved" if report.ranking_preserved else "ranking NOT preserved") + \
            f"; worst step error {report.worst_step_error * 100:.0f}% (aim: within 30%)"
        console.print(verdict, style="bold green" if ok else "bold yellow")
    if strict and not ok:
        raise typer.Exit(code=1)


def _validate_published(published: bool, rows: str | None, as_json: bool, search: bool = False,
                        workers: int | None = None) -> None:
    """`canzona validate --published [--search]`: the logic is sim.published's (and
    sim.published_search's)."""
    import os

    from rich.progress import Progress

    from cli.render import published_search_table, published_table
    from sim import published as runs
    from sim import published_search

    try:
        if not published:
            raise SpecError("--search ranks published rows' layouts: give it with --published" if search else
                            "--rows selects published rows: give it with --published" if rows is not None else
                            "--workers is for --published")
        if workers is not None and not 1 <= workers <= 4 * (os.cpu_count() or 1):
            raise SpecError(f"--workers must be in 1..{4 * (os.cpu_count() or 1)}, got {workers}")
        table, sources = runs.load()
        chosen = runs.select(table, rows)
        err = Console(stderr=True)
        with Progress(console=err, transient=True, disable=as_json or not err.is_terminal) as progress:
            task = progress.add_task("simulating", total=len(chosen))

            def tick(done: int, total: int, what: str) -> None:
                progress.update(task, completed=done, total=total, description=f"simulating {what}")

            report = runs.compare(chosen, sources, progress=tick, workers=workers)
            ranks = published_search.rank_runs(chosen, report.rows, workers, progress=tick) if search else None
    except CanzonaError as e:
        fail(str(e))
    if as_json:
        emit_json({**report.to_dict(), **({"search": published_search.summary(ranks)} if ranks is not None else {})})
        return
    console.print(published_table(report))
    if ranks is not None:
        console.print(published_search_table(ranks))


class _Stopped(SystemExit):
    """A signal's exit (status 128 + its number), raised where the signal arrives."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


def _stop(signum: int, frame: object) -> None:
    """SIGTERM and Ctrl-C unwind the CLI, so temporary files are removed, spawned ranks and a pool's
    workers stopped (`sim.workers`, `canzona.harness.launch`), and a progress bar closed; then
    `main` prints its one line (typer ended a KeyboardInterrupt silently, with status 130)."""
    raise _Stopped(signum)


def main() -> None:
    signal.signal(signal.SIGTERM, _stop)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where the shell ignores it (`&`)
        signal.signal(signal.SIGINT, _stop)
    try:
        app()
    except _Stopped as stopped:
        # after the unwinding: written at the signal, the line was glued to the end of a terminal's
        # progress bar (rich's, transient), which its close then left on screen (os.write: a print
        # the signal interrupted may still hold the stream)
        os.write(2, f"error: stopped by {signal.Signals(stopped.signum).name}\n".encode())
        raise


if __name__ == "__main__":
    main()
