"""`canzona verify`: rung 3 of the verification ladder (docs/architecture.md §5) on spawned gloo ranks.

For each (optimizer, policy, TP scheduler, TP mode) the tiny model is trained for `steps` steps by
`dp x tp` CPU ranks running `DistributedOptimizer` (under TP on a (`dp`, `tp`) mesh, with the model
split Megatron-style or as DTensors; under expert parallelism, `ep` > 1, the tiny mixture-of-experts
model with its experts split over EP groups of `ep` consecutive ranks of the dp x tp ranks, and
under TP its dense layers split Megatron-style, `reference.tiny_moe_ep`; under `fsdp`, the tiny
model sharded by torch's FSDP2 `fully_shard` per decoder layer and at the root over the dp ranks, or
HSDP's replicas of shard groups, `DistributedOptimizer` becoming `canzona.runtime.fsdp.FsdpOptimizer`),
and the final parameters of every rank are checked three ways:

- `ranks`: every rank holds the same parameters as the first rank of its TP index (under EP, the
  same experts as the first rank of its EP index; under FSDP, the same shards as the first replica
  of its shard rank: HSDP's replicas agree), bit for bit;
- `3a`: they equal `training.emulate` (the same kernels in one process, fed the same global
  gradients; under TP or EP the ranks' recorded gradients, summed as the reductions sum them; under
  FSDP the global gradients FSDP2 reduced, gathered whole each step) bit for bit in fp32, each rank
  against its shard (under EP: and its experts; under FSDP: its box) of the full result;
- `3b`: they stay within `REFERENCE_RTOL` relative of `training.reference_run` (the reference
  optimizers of `reference/`).

Two phases, so the CLI can tell bad input from a failed run: `prepare` validates everything the
runtime would reject and builds each configuration's plan in this process (raises `CanzonaError`:
exit 2, nothing spawned); `run` trains every configuration in ONE spawned process group (a spawn
costs seconds, a tiny run a fraction of one) and returns one row dict per (optimizer, policy, rung).
A rank that fails raises `launch.RankError`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from canzona.choices import check_choice
from canzona.errors import SpecError
from canzona.optimizers import MATRIX_OPTIMIZERS
from canzona.optimizers import OPTIMIZERS as REGISTERED
from canzona.plan import PLAN_DEFAULTS, Plan, PlanSettings, plan_for
from canzona.step_options import STEP_DEFAULTS
from canzona.step_policies import (
    FSDP_POLICIES,
    STEP_POLICIES,
    default_policy,
    get_step_policy,
    policies_running,
)
from canzona.step_schedule import TP_MODES
from canzona.tp import TP_POLICIES

POLICIES: tuple[str, ...] = tuple(STEP_POLICIES)
OPTIMIZERS: tuple[str, ...] = REGISTERED
TP_SCHEDULERS: tuple[str, ...] = tuple(TP_POLICIES)
# under --fsdp: the FSDP policies the runtime runs (owners; gather-all is a simulator baseline)
FSDP_RUNTIME_POLICIES: tuple[str, ...] = tuple(n for n, p in FSDP_POLICIES.items() if not p.gathers_all)
REFERENCE_RTOL = 1e-5  # rung 3b: multi-step run against the reference optimizers
# Every rank is a process on this machine (about 300 MB each with torch), and every process holds
# all steps' batches: these bounds keep a run within a few GB.
MAX_DP = 16
MAX_RANKS = 16  # dp x tp
# Under TP each rank returns every step's gradients for the single-process check, and this process
# holds all ranks' (256 MB per rank in fp32 at the bound).
MAX_RECORDED_ELEMENTS = 2**26
MAX_STEPS = 1000
MAX_GLOBAL_BATCH = 1024
RUNGS = {
    "ranks": "every rank equals rank 0 (bit for bit)",
    "replicas": "every replica holds the same shards (bit for bit)",
    "3a": "equals the same kernels in one process (bit for bit, fp32)",
    "3b": f"within {REFERENCE_RTOL:g} relative of the reference optimizers",
}

Progress = Callable[[int, int, str], None]  # (done, total, what is running now)


@dataclass(frozen=True)
class VerifyCase:
    """One (optimizer, policy) to train and check, with the plan its ranks will execute."""

    spec: Any  # training.TrainSpec (imported lazily: torch)
    plan: Plan | None  # None: AdamW under --fsdp (no owners, no plan)

    @property
    def label(self) -> str:
        ep = f" / ep {self.spec.ep}" if self.spec.ep > 1 else ""
        if self.spec.fsdp:
            return f"{self.spec.optimizer} / {self.spec.policy} / fsdp{ep}"
        if self.spec.tp == 1:
            return f"{self.spec.optimizer} / {self.spec.policy}{ep}"
        return f"{self.spec.optimizer} / {self.spec.policy} / {self.plan.tp_plan.policy} {self.spec.tp_mode}{ep}"

    @property
    def recorded(self) -> bool:
        """Whether the check feeds the single-process runs the gradients the ranks recorded (TP and
        EP: the model is split over ranks), rather than recomputing them with the whole model."""
        return self.spec.tp > 1 or self.spec.ep > 1


def _choices(value: str, known: Sequence[str], what: str) -> list[str]:
    if value == "all":
        return list(known)
    return [check_choice(value, known, what, note=" or all")]


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"{name} must be an integer >= 1, got {value!r}")


def prepare(dp: int, optimizer: str = "muon", policy: str | None = None, steps: int = 10,
            dp_policy: str = PLAN_DEFAULTS.dp_policy, accumulation: int = 1, preset: str = "tiny",
            global_batch: int | None = None, tp: int = 1, alpha: float = PLAN_DEFAULTS.alpha,
            bucket_size: int | None = PLAN_DEFAULTS.bucket_size, seq_len: int = 16,
            tp_policy: str = PLAN_DEFAULTS.tp_policy, tp_mode: str = STEP_DEFAULTS.tp_mode,
            tp_style: str = "megatron", ep: int = 1, fsdp: bool = False,
            hsdp_replicate: int = 1) -> list[VerifyCase]:
    """Validate the request and plan every (optimizer, policy, TP scheduler, TP mode); raise
    `CanzonaError` on bad input. `optimizer`, `policy`, `tp_policy` and `tp_mode` take `all`
    (`policy="all"`: every policy that runs the optimizer; None: its default). The baselines run
    `tp-sync` whatever `tp_policy` says; at TP = 1 and under AdamW the TP choices collapse to one.

    `global_batch` defaults to `4 * dp * accumulation` (always divisible). `ep` > 1: expert
    parallelism over the DP ranks (EP groups of `ep` consecutive ranks), with a mixture-of-experts
    preset (`reference.tiny_moe.MOE_PRESETS`). `fsdp`: torch's FSDP2 over the dp ranks (HSDP with
    `hsdp_replicate` replicas), the whole-matrix optimizers under the FSDP owner policies
    (`canzona.step_policies.FSDP_POLICIES` that the runtime runs; `all`: both)."""
    from canzona.harness.training import TP_STYLES, TrainSpec
    from reference.tiny_model import check_tp, get_preset, model_spec
    from reference.tiny_moe import MOE_PRESETS

    _positive("dp", dp)
    if fsdp or hsdp_replicate != 1:
        _check_fsdp(dp, tp, ep, preset, optimizer, hsdp_replicate, fsdp)
    if dp > MAX_DP:
        raise SpecError(f"dp must be <= {MAX_DP} (every rank is a process on this machine), got {dp}")
    _positive("tp", tp)
    _positive("ep", ep)
    if dp * tp > MAX_RANKS:
        raise SpecError(f"dp x tp must be <= {MAX_RANKS} ranks (every rank is a process on this machine), "
                        f"got {dp} x {tp}")
    _positive("steps", steps)
    if steps > MAX_STEPS:
        raise SpecError(f"steps must be <= {MAX_STEPS}, got {steps}")
    _positive("accumulation", accumulation)
    _positive("seq_len", seq_len)
    tp_policies = _choices(tp_policy, TP_SCHEDULERS, "TP policy")
    tp_modes = _choices(tp_mode, TP_MODES, "TP mode")
    check_choice(tp_style, TP_STYLES, "TP style")
    if tp == 1 and tp_style != TP_STYLES[0]:  # the default names the style of no split as well
        raise SpecError(f"--tp-style {tp_style} splits the model over TP; at --tp 1 nothing is split and the run "
                        "would verify the plain model: give --tp 2 or more, or leave --tp-style out")
    if global_batch is None:
        global_batch = 4 * dp * accumulation
    _positive("global batch", global_batch)
    if global_batch > MAX_GLOBAL_BATCH:
        raise SpecError(f"global batch must be <= {MAX_GLOBAL_BATCH} sequences, got {global_batch}")
    if preset in MOE_PRESETS or ep > 1:
        mspec = _moe_spec(preset, dp, tp, ep, tp_style)
    else:
        cfg = get_preset(preset)
        if seq_len > cfg.max_seq_len:
            raise SpecError(f"seq_len {seq_len} exceeds the {preset} model's max_seq_len {cfg.max_seq_len}")
        check_tp(cfg, tp)
        if tp > 1 and tp_style == "dtensor" and cfg.tied_embeddings and not fsdp:
            raise SpecError(f"the dtensor TP style needs an untied preset ({preset} ties its embedding to the "
                            "head, which cannot be both rowwise and colwise): use tiny-untied, tiny-tp4 or small")
        mspec = model_spec(cfg)
    optimizers = _choices(optimizer, OPTIMIZERS, "optimizer")
    if fsdp:  # `all`: the whole-matrix optimizers, whose owners it checks; adamw when named
        optimizers = [o for o in optimizers if o in MATRIX_OPTIMIZERS] if optimizer == "all" else optimizers
        return _fsdp_cases(mspec, dp, tp, optimizers, policy, dp_policy, alpha, bucket_size, steps, global_batch,
                           seq_len, accumulation, preset, hsdp_replicate, tp_policy, tp_mode, ep)
    if policy is not None:
        _choices(policy, POLICIES, "policy")
    recorded = steps * sum(p.local_numel(tp) for p in mspec.params)
    if (tp > 1 or ep > 1) and recorded > MAX_RECORDED_ELEMENTS:
        raise SpecError(f"under TP or EP every rank keeps each step's gradients for the check: {steps} steps of the "
                        f"{preset} model at tp={tp} are {recorded:,} values per rank, above {MAX_RECORDED_ELEMENTS:,}; "
                        f"run at most {MAX_RECORDED_ELEMENTS // (recorded // steps)} steps")
    cases = []
    for opt in optimizers:
        if policy == "all":
            policies = list(policies_running(opt))
        else:
            policies = [policy or default_policy(opt)]
        for pol in policies:
            step = get_step_policy(pol)
            step.check_optimizer(opt)
            step.check_dp_policy(dp_policy)
            # the baselines run tp-sync; at TP = 1, and under an elementwise optimizer (AdamW's zero1
            # plans with its own TP policy), the TP choices change nothing: at their defaults, which
            # the runtime takes (it refuses others there: canzona.step_options.ELEMENTWISE_IGNORED)
            if tp == 1 or opt not in MATRIX_OPTIMIZERS:
                schedulers, modes = [PLAN_DEFAULTS.tp_policy], [STEP_DEFAULTS.tp_mode]
            else:
                schedulers, modes = [step.tp_policy] if step.tp_policy else tp_policies, tp_modes
            # so is alpha (whole-matrix balancing) under an elementwise one (`--optimizer all --alpha`)
            a = alpha if opt in MATRIX_OPTIMIZERS else PLAN_DEFAULTS.alpha
            for scheduler in schedulers:
                for mode in modes:
                    spec = TrainSpec(preset=preset, optimizer=opt, policy=pol, dp_policy=dp_policy, alpha=a,
                                     bucket_size=bucket_size, steps=steps, global_batch=global_batch,
                                     seq_len=seq_len, accumulation=accumulation, tp=tp, tp_policy=scheduler,
                                     tp_mode=mode, tp_style=tp_style, ep=ep)
                    spec.check(dp)
                    # the plan the runtime would make (DistributedOptimizer._resolve_plan), made
                    # here so that bad plan settings fail before any spawn and the table names
                    # what ran
                    plan = plan_for(mspec, dp, tp, opt, step, PlanSettings(
                        dp_policy=dp_policy, tp_policy=scheduler, alpha=a, bucket_size=bucket_size), ep=ep)
                    step.check_dp_plan(plan.dp_plan)
                    cases.append(VerifyCase(spec, plan))
    return cases


def _check_fsdp(dp: int, tp: int, ep: int, preset: str, optimizer: str, hsdp_replicate: int, fsdp: bool) -> None:
    """What `--fsdp` runs: the dense tiny presets over the DP ranks, or over DP x TP as torchtitan
    composes them (not with HSDP), the tiny MoE presets with AdamW (at `ep` > 1 in torchtitan's
    layout, `reference.tiny_moe_fsdp_ep`: TP 1, no HSDP), shard groups of at least 2 ranks."""
    from canzona.fsdp_plan import check_hsdp
    from reference.tiny_moe import HF_MOE_PRESET, MOE_PRESETS

    if fsdp and ep > 1 and (optimizer != "adamw" or tp > 1 or hsdp_replicate != 1):
        raise SpecError(f"--fsdp --ep {ep} is run with --optimizer adamw at --tp 1 without --hsdp-replicate "
                        f"(torchtitan's layout: the experts over ep x efsdp); got optimizer {optimizer}, tp {tp}, "
                        f"hsdp_replicate {hsdp_replicate}")
    if fsdp and tp > 1 and ep == 1 and (preset in MOE_PRESETS or preset == HF_MOE_PRESET):
        # before _moe_spec's 'give --ep too', which under --fsdp the check above refuses at --tp > 1
        raise SpecError(f"--fsdp --tp {tp} is verified on the dense presets; the {preset} model runs under --fsdp "
                        "at --tp 1 (with --ep, torchtitan's layout)")
    if fsdp and tp > 1 and hsdp_replicate != 1:
        raise SpecError(f"--fsdp --tp {tp} is verified without --hsdp-replicate (a 3-D mesh)")
    if dp > MAX_DP:
        raise SpecError(f"dp must be <= {MAX_DP} (every rank is a process on this machine), got {dp}")
    if fsdp and dp < 2:
        raise SpecError(f"--fsdp shards the model over the DP ranks: give --dp 2 or more, got {dp}")
    check_hsdp(fsdp, dp, hsdp_replicate)
    if (preset in MOE_PRESETS or preset == HF_MOE_PRESET) and (optimizer != "adamw" or preset not in MOE_PRESETS):
        raise SpecError(f"--fsdp runs the {preset} model's stacked experts with --optimizer adamw on the "
                        f"{', '.join(MOE_PRESETS)} presets (a whole-matrix optimizer over them is not run under FSDP2)")


def _fsdp_cases(mspec, dp: int, tp: int, optimizers: Sequence[str], policy: str | None, dp_policy: str,
                alpha: float,
                bucket_size: int | None, steps: int, global_batch: int, seq_len: int, accumulation: int,
                preset: str, hsdp_replicate: int, tp_policy: str, tp_mode: str, ep: int = 1) -> list[VerifyCase]:
    """`prepare` under `--fsdp`: per (optimizer, FSDP owner policy), the owners' plan the runtime
    makes (`canzona.fsdp_plan.fsdp_matrices`, over the shard group, x TP under FSDP x TP), made here
    so that bad settings fail before any spawn (`tp_policy` / `tp_mode`: the training spec refuses
    them off their defaults, `TrainSpec.check`)."""
    from canzona.fsdp_plan import (
        check_hsdp,
        check_owner_plan_settings,
        fsdp_matrices,
        fsdp_policy,
        owner_plan_defaults,
    )
    from canzona.harness.training import TrainSpec
    from canzona.step_policies import resolve_policy

    shard = check_hsdp(True, dp, hsdp_replicate)
    recorded = steps * sum(p.numel for p in mspec.params)
    if recorded > MAX_RECORDED_ELEMENTS:
        raise SpecError(f"under --fsdp rank 0 keeps each step's global gradients for the check: {steps} steps of "
                        f"the {preset} model are {recorded:,} values, above {MAX_RECORDED_ELEMENTS:,}; run at most "
                        f"{MAX_RECORDED_ELEMENTS // (recorded // steps)} steps")
    policies = list(FSDP_RUNTIME_POLICIES) if policy == "all" else [policy or "canzona"]
    elementwise = [o for o in optimizers if o not in MATRIX_OPTIMIZERS]  # adamw named (`all` leaves it out)
    if elementwise:  # its own policy only, no owners (`fsdp_policy`'s rule)
        policies = [resolve_policy(None if policy == "all" else policy, elementwise[0])]
        fsdp_policy(elementwise[0], policies[0])
    for pol in () if elementwise else policies:
        if pol not in FSDP_RUNTIME_POLICIES:
            what = "is a simulator baseline (every rank computes every matrix)" if pol in FSDP_POLICIES else \
                "is not an FSDP policy"
            raise SpecError(f"policy {pol!r} {what}; under --fsdp the runtime runs "
                            f"{', '.join(FSDP_RUNTIME_POLICIES)} (or all)")
    cases = []
    for opt in optimizers:
        for pol in policies:
            # canzona's owner plan settings are its own: under `all` the owners no plan places run at
            # the defaults (named alone, such a policy refuses them: `check_owner_plan_settings`)
            settings = PlanSettings(dp_policy=dp_policy, alpha=alpha, bucket_size=bucket_size)
            step = fsdp_policy(opt, pol)
            if policy == "all" and step is not None:
                settings = replace(settings, **owner_plan_defaults(step))
            spec = TrainSpec(preset=preset, optimizer=opt, policy=pol, dp_policy=settings.dp_policy,
                             alpha=settings.alpha, bucket_size=settings.bucket_size, steps=steps,
                             global_batch=global_batch, seq_len=seq_len, accumulation=accumulation, fsdp=True,
                             hsdp_replicate=hsdp_replicate, tp=tp, tp_style="dtensor", tp_policy=tp_policy,
                             tp_mode=tp_mode, ep=ep)
            spec.check(dp)
            check_owner_plan_settings(step, settings)  # AdamW's step has no owners to plan
            plan = None if step is None else fsdp_matrices(mspec, shard * tp, opt, step, settings)[1]
            cases.append(VerifyCase(spec, plan))
    return cases


def _moe_spec(preset: str, dp: int, tp: int, ep: int, tp_style: str):
    """The spec of a mixture-of-experts preset verified at `dp` x `tp` with expert parallelism `ep`
    (the experts folded over the dp x tp ranks; under TP the dense layers split Megatron-style,
    `reference.tiny_moe_ep`)."""
    from canzona.experts import check_ep
    from reference.tiny_moe import MOE_PRESETS, TinyMoe

    if preset not in MOE_PRESETS:
        raise SpecError(f"ep={ep} needs a mixture-of-experts preset ({', '.join(MOE_PRESETS)}), got {preset!r}")
    cfg = MOE_PRESETS[preset]
    if tp > 1:
        if ep == 1:
            raise SpecError(f"the {preset} model is split over TP under expert parallelism only: give --ep too")
        if tp_style != "megatron":
            raise SpecError(f"the {preset} model is split over TP Megatron-style only (tp_style megatron)")
        if cfg.vocab % tp or cfg.heads % tp:
            raise SpecError(f"tp={tp} must divide the {preset} model's vocabulary ({cfg.vocab}) and heads ({cfg.heads})")
    spec = TinyMoe(cfg).spec()
    check_ep(spec, ep, dp, tp)
    return spec


def deadline_for(cases: Sequence[VerifyCase], ranks: int) -> float:
    """Generous wall-clock bound for the spawned run (a hang must still end)."""
    work = sum(c.spec.steps * c.spec.accumulation for c in cases)
    return 120.0 + 2.0 * work * max(1, ranks)


def run(cases: Sequence[VerifyCase], dp: int, progress: Progress | None = None,
        deadline_s: float | None = None) -> list[dict[str, Any]]:
    """Train every case on `dp x tp` spawned gloo ranks (one spawn) and check rungs 3a / 3b."""
    from canzona.harness.launch import run_ranks
    from canzona.harness.training import many_specs_worker

    tick = progress or (lambda done, total, what: None)
    tp = cases[0].spec.tp if cases else 1
    baselines = _baseline_keys(cases)
    steps = sum(c.spec.steps for c in cases)  # the training advances one unit per step
    total = steps + 2 * len(baselines) + len(cases)
    done = 0
    ranks = dp * tp
    tick(done, total, f"starting {ranks} gloo rank(s) for {len(cases)} configuration(s)")
    per_rank = run_ranks(many_specs_worker, ranks, [c.spec for c in cases],
                         [{"plan": c.plan, "state_dict": False} for c in cases],
                         deadline_s=deadline_s or deadline_for(cases, ranks),
                         progress=lambda step, _, what: tick(step, total, what))
    done += steps
    rows: list[dict[str, Any]] = []
    expected: dict[str, tuple[dict, dict]] = {}
    for i, case in enumerate(cases):
        results = [r[i] for r in per_rank]
        key = f"case {i}" if case.recorded else _baseline_key(case.spec)
        if key not in expected:
            expected[key] = _expected(case.spec, dp, results, lambda what, d=done: tick(d, total, what))
            done += 2
        tick(done, total, f"checking {case.label}")
        emulated, reference = expected[key]
        rows.extend(check_case(case, dp, results, emulated, reference))
        done += 1
    tick(total, total, "done")
    return rows


def _baseline_key(spec) -> str:
    """At TP = 1, emulation and reference runs do not depend on the policy fields: share them across
    policies. (Under TP they are fed each run's own recorded gradients.)"""
    neutral = replace(spec, policy="canzona", dp_policy=PLAN_DEFAULTS.dp_policy, alpha=PLAN_DEFAULTS.alpha,
                      bucket_size=PLAN_DEFAULTS.bucket_size)
    return json.dumps(asdict(neutral), sort_keys=True, default=str)


def _baseline_keys(cases: Sequence[VerifyCase]) -> set[str]:
    return {f"case {i}" if c.recorded else _baseline_key(c.spec) for i, c in enumerate(cases)}


def _expected(spec, dp: int, results: Sequence[dict], tick: Callable[[str], None]) -> tuple[dict, dict]:
    from canzona.harness.training import (
        emulate,
        expert_global_gradients,
        global_gradients_from,
        reference_run,
    )

    grads = results[0]["grads"] if spec.fsdp else expert_global_gradients(results, spec) if spec.ep > 1 else \
        global_gradients_from(results, spec) if spec.tp > 1 else None
    tick(f"emulating {spec.optimizer} in one process")
    emulated = emulate(spec, dp, grads=grads)
    tick(f"running the reference {spec.optimizer}")
    reference = reference_run(spec, dp, grads=grads)
    return emulated, reference


def _worst(got_by_rank: Sequence[dict], want_by_rank: Sequence[dict]) -> dict[str, Any]:
    """`training.compare` of each rank with what it should hold, keeping the worst. Non-finite
    parameters fail outright: `compare` would score a NaN difference 0 (NaN is never larger than
    the running maximum)."""
    import torch

    from canzona.harness.training import compare

    out = {"bit_identical": True, "max_rel_diff": 0.0, "worst_param": "", "worst_rank": None}
    for rank, (got, want) in enumerate(zip(got_by_rank, want_by_rank)):
        bad = [n for n in want if not torch.isfinite(got[n]).all()]
        c = {"bit_identical": False, "max_rel_diff": math.inf, "worst_param": bad[0]} if bad \
            else compare(got, want)
        first_difference = not c["bit_identical"] and out["bit_identical"]
        out["bit_identical"] = out["bit_identical"] and c["bit_identical"]
        if c["max_rel_diff"] > out["max_rel_diff"] or (first_difference and out["max_rel_diff"] == 0.0):
            out.update(max_rel_diff=c["max_rel_diff"], worst_param=c["worst_param"], worst_rank=rank)
    return out


def check_case(case: VerifyCase, dp: int, results: Sequence[dict], emulated: dict,
               reference: dict) -> list[dict[str, Any]]:
    """The three rows of one case: ranks agree, rung 3a, rung 3b. `results`: every rank's
    `training.distributed_worker` result (its local parameters, losses, TP and EP coordinates);
    `emulated` and `reference` hold full tensors, which each rank is compared with its shard (under
    EP: its experts) of."""
    from canzona.harness.training import build_model, held_by

    spec = case.spec
    losses = results[0]["losses"]
    base = {
        "optimizer": spec.optimizer,
        "policy": spec.policy,
        "plan": case.plan.dp_plan.policy if case.plan is not None else None,
        "plan_hash": case.plan.hash() if case.plan is not None else None,
        "dp": dp,
        "tp": spec.tp,
        "ep": spec.ep,
        "tp_policy": case.plan.tp_plan.policy if case.plan is not None else spec.tp_policy,
        "tp_mode": spec.tp_mode,
        "steps": spec.steps,
        "accumulation": spec.accumulation,
        "global_batch": spec.global_batch,
        "final_loss": float(losses[-1]) if losses else None,
        "fsdp": spec.fsdp,
        "hsdp_replicate": spec.hsdp_replicate,
    }
    if spec.fsdp:
        return _check_fsdp_case(base, spec, results, emulated, reference)
    params = [r["params"] for r in results]

    def shards(full: dict, r: dict) -> dict:
        return held_by(full, spec, r) if spec.tp > 1 or spec.ep > 1 else full

    # every rank against the first rank of its TP index, and under EP its experts against the
    # first rank of its EP index
    stacks = {p.name for p in build_model(spec).spec().stacks} if spec.ep > 1 else set()
    first = {r["tp_rank"]: r["params"] for r in reversed(results)}
    first_ep = {r.get("ep_rank", 0): r["params"] for r in reversed(results)}

    def alike(r: dict) -> dict:
        return {n: (first_ep[r.get("ep_rank", 0)] if n in stacks else first[r["tp_rank"]])[n] for n in r["params"]}

    ranks = _worst(params, [alike(r) for r in results]) if dp > 1 else {
        "bit_identical": True, "max_rel_diff": 0.0, "worst_param": "", "worst_rank": None}
    same = _worst(params, [shards(emulated, r) for r in results])
    ref = _worst(params, [shards(reference, r) for r in results])
    alone = None if dp > 1 else "single rank" if spec.tp == 1 else "one DP rank"
    return _rung_rows(base, ("ranks", ranks), same, ref, alone)


def _rung_rows(base: dict[str, Any], first: tuple[str, dict], same: dict, ref: dict,
               alone: str | None) -> list[dict[str, Any]]:
    """The rows of one case: the first rung (the ranks or the replicas alike; `alone`: what it
    says where there is nothing to compare), 3a (the same kernels, bit for bit) and 3b (the
    reference optimizers, within REFERENCE_RTOL)."""
    rows = []
    for rung, c, ok, tol in (
        (first[0], first[1], first[1]["bit_identical"], 0.0),
        ("3a", same, same["bit_identical"], 0.0),
        ("3b", ref, ref["max_rel_diff"] <= REFERENCE_RTOL, REFERENCE_RTOL),
    ):
        if rung == first[0] and alone is not None:
            result = alone
        elif rung == "3b":
            result = "bit-identical" if c["bit_identical"] else f"max rel {_fmt(c['max_rel_diff'])}"
        else:
            result = "bit-identical" if c["bit_identical"] else "differs"
        rows.append({**base, "rung": rung, "check": RUNGS[rung], "result": result,
                     "bit_identical": c["bit_identical"], "max_rel_diff": c["max_rel_diff"],
                     "tolerance": tol, "worst_param": c["worst_param"], "worst_rank": c["worst_rank"],
                     "ok": bool(ok)})
    return rows


def _check_fsdp_case(base: dict[str, Any], spec, results: Sequence[dict], emulated: dict,
                     reference: dict) -> list[dict[str, Any]]:
    """`check_case` under FSDP: every rank's shards (its boxes of the whole tensors) against the
    first replica's of its shard rank (HSDP's replicas run alike) and against its boxes of the
    single-process results."""
    from canzona.fsdp_plan import fsdp_policy
    from canzona.harness.training import piece

    step = fsdp_policy(spec.optimizer, spec.policy)
    base = {**base, "plan": "no owners" if step is None else f"{step.owners} owners"}
    params = [r["params"] for r in results]
    first = {r["shard_rank"]: r["params"] for r in reversed(results)}

    def boxes(full: dict, r: dict) -> dict:
        return {n: piece(full[n], r["boxes"][n]) for n in r["params"]}

    replicas = _worst(params, [first[r["shard_rank"]] for r in results])
    same = _worst(params, [boxes(emulated, r) for r in results])
    ref = _worst(params, [boxes(reference, r) for r in results])
    return _rung_rows(base, ("replicas", replicas), same, ref, "one replica" if spec.hsdp_replicate == 1 else None)


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.2e}"


def report(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The `--json` object: every row and the overall verdict."""
    return {"ok": all(r["ok"] for r in rows), "checks": len(rows),
            "failed": sum(not r["ok"] for r in rows), "rows": [_jsonable(r) for r in rows]}


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    # JSON has no infinity: a non-finite difference is reported as null (and fails)
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
