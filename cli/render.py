"""Rich tables for plans, models and the model catalog."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from canzona.catalog import CATALOG, build_qwen3
from canzona.dp.layout import DEFAULT_EXPERT_BUCKETS
from canzona.harness.verify import REFERENCE_RTOL
from canzona.models import ARCHITECTURE_FIELDS
from canzona.plan import Plan
from canzona.recompute import recompute_label
from canzona.spec import ModelSpec
from canzona.step_policies import FSDP_POLICIES, get_fsdp_policy
from cli.units import human_bytes
from sim.workload import Workload

GRAD_BYTES = Workload().grad_bytes  # the gradient dtype the simulator prices (fp32, as Megatron reduces)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def models_table() -> Table:
    t = Table(title="Model catalog (Qwen3)")
    for col in ("model", "layers", "hidden", "q heads", "kv heads", "ffn", "experts", "tied", "params", "matrices"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for cfg in CATALOG.values():
        spec = build_qwen3(cfg)
        ffn, experts = (f"{cfg.moe_ffn}", f"{cfg.experts}, top {cfg.experts_per_token}") if cfg.experts else \
            (str(cfg.ffn), "-")
        t.add_row(cfg.name, str(cfg.layers), str(cfg.hidden), str(cfg.q_heads), str(cfg.kv_heads),
                  ffn, experts, "yes" if cfg.tied_embeddings else "no", f"{spec.numel / 1e9:.2f}B",
                  str(len(spec.matrix_params())))
    t.caption = ("ffn: an expert's width in a mixture-of-experts model, whose matrices count each expert's gate, "
                 "up and down. Any other decoder: --model path/to/config.json (qwen3, qwen2, llama, mistral, "
                 "qwen3_moe, mixtral) or a spec file (canzona spec MODEL --out spec.json).")
    return t


_SOURCES = {"catalog": "catalog", "hf-config": "Hugging Face config.json", "spec": "canzona spec file"}


def spec_table(spec: ModelSpec, kind: str, sizes: dict[str, int], unknown: str | None) -> Table:
    """`canzona spec`: what canzona makes of a model, and what the simulator would still need."""
    t = Table(title=f"Model {spec.name} ({_SOURCES.get(kind, kind)})")
    t.add_column("quantity", no_wrap=True)
    t.add_column("value", justify="right")
    matrices = spec.matrix_params()
    t.add_row("parameters", f"{spec.numel:,} ({spec.numel / 1e9:.2f}B)")
    t.add_row("matrix-optimizer matrices", f"{len(matrices)} ({sum(p.numel for p in matrices):,} elements)")
    if spec.stacks:
        t.add_row("of them in stacked expert tensors",
                  f"{sum(p.stack_size for p in spec.stacks)} (in {len(spec.stacks)} tensors)")
    t.add_row("AdamW parameters", str(len(spec.adamw_params())))
    for key in ARCHITECTURE_FIELDS:
        t.add_row(f"architecture: {key}", str(sizes[key]) if key in sizes else "unknown")
    t.caption = unknown or ("Matrix-optimizer matrices: 2-D parameters that are neither embedding, head nor "
                            "router, and each matrix of a stacked expert tensor (the routing rule).")
    return t


def dp_table(plans: Sequence[Plan], chosen: Plan, note: str = "") -> Table:
    """Every DP plan of `plans`, `chosen` in bold (`note`: why it is the one chosen)."""
    p0 = plans[0]
    schedule = "updates its pieces in place" if p0.elementwise else f"TP policy {p0.tp_plan.policy}"
    t = Table(title=f"DP policies: {p0.model}, dp={p0.dp}, tp={p0.tp}, {p0.optimizer}, {schedule}")
    t.add_column("DP policy", no_wrap=True)
    for col in ("max load ms", "imb.", "LB gap", "comm", "state imb.", "atomic", "extra comm", "GPU ms"):
        t.add_column(col, justify="right")
    for p in plans:
        d = p.dp_metrics
        # an elementwise optimizer needs no whole matrix: atomicity does not apply
        atomic = "-" if p.elementwise else "yes" if d.atomic else f"no ({d.atomicity_violations})"
        name = p.dp_plan.policy + (" by elements" if p.dp_plan.balance_by == "elements" else "") \
            + (" (kept whole-start)" if p.dp_plan.fell_back else "") + (f" ({note})" if note and p is chosen else "")
        t.add_row(name, _ms(d.makespan), f"{d.imbalance:.3f}", f"{d.lower_bound_gap * 100:.1f}%",
                  f"{d.comm_ratio:.2f}", f"{d.state_imbalance:.3f}", atomic,
                  human_bytes(GRAD_BYTES * d.extra_comm_elements), _ms(p.optimizer_compute_s),
                  style="bold green" if p is chosen else None)
    if p0.elementwise:
        gpu = (f"{p0.optimizer} updates the pieces of each rank's segments where they lie (no matrix "
               "is gathered, no TP schedule); GPU ms: the slowest DP rank's pieces over its TP group.")
    else:
        gpu = "GPU ms: optimizer compute on the slowest GPU after TP scheduling."
    t.caption = (f"Seconds from {p0.cost_model}. Load: optimizer work per DP rank (its TP group); "
                 f"lower bound {_ms(p0.dp_metrics.lower_bound)} ms. Comm: longest / even "
                 "reduce-scatter segment. Extra comm: fp32 gradient bytes (the simulator's default) fetched beyond the segment. "
                 + gpu)
    return t


def tp_table(plans: Sequence[Plan], chosen: str) -> Table:
    p0 = plans[0]
    t = Table(title=f"TP policies on the {p0.dp_plan.policy} DP plan (tp={p0.tp})")
    t.add_column("TP policy", no_wrap=True)
    for col in ("capacity", "groups", "max/rank", "efficiency", "group imb.", "GPU ms"):
        t.add_column(col, justify="right")
    for p in plans:
        tm, cap = p.tp_plan.metrics, p.tp_plan.capacity
        cap_text = "-" if cap is None else (f"{cap.value * 1e3:.2f} ms" if cap.unit == "s" else human_bytes(cap.value))
        t.add_row(p.tp_plan.policy, cap_text, str(tm.groups), str(tm.max_groups_per_rank),
                  f"{tm.efficiency:.2f}", f"{tm.mean_group_imbalance:.2f}", _ms(tm.makespan),
                  style="bold green" if p.tp_plan.policy == chosen else None)
    return t


def _ratio(x: float, y: float) -> str:
    return f"{x / y:.2f}x" if y > 0 else "-"


# Published iteration MFU of Megatron-LM on H100 clusters (2B-462B parameter models): 38-47%
# (Megatron-LM README, "Performance benchmarking"); shown beside the simulated figure.
PUBLISHED_MFU = "38-47% (Megatron-LM on H100)"
# The paper's headline: canzona against NVIDIA's layer-wise distributed optimizer, Qwen3 on 256 GPUs.
PAPER_RATIOS = {"iteration_time_s": 1.57, "optimizer_step_s": 5.8}


def _tp_overlap_label(o) -> str:
    """The TP overlap, naming its userbuffers configuration where it is not the default."""
    from sim.userbuffers import DEFAULT_UB_CONFIG

    cfg = o.tp_comm_overlap_cfg
    return "TP comm overlap" if cfg == DEFAULT_UB_CONFIG else f"TP comm overlap ({cfg})"


def _options_text(c) -> str:
    o = c.options
    on = [name for name, flag in (("grad-reduce overlap", o.overlap_grad_reduce),
                                  ("aligned across stages", o.overlap_grad_reduce and o.align_grad_reduce
                                   and getattr(c, "pp", 1) > 1),
                                  ("param-gather overlap", o.overlap_param_gather),
                                  (_tp_overlap_label(o), o.tp_comm_overlap),
                                  ("EP all-to-all overlap", o.overlap_moe_expert_parallel_comm),
                                  ("delayed expert wgrad", o.delay_wgrad_compute)) if flag]
    recompute = recompute_label(o.recompute, o.recompute_method, o.recompute_num_layers, o.selective_ac_option)
    return f"{', '.join(on) or 'no overlap'}; recompute {recompute}; reduce-scatter {o.reduce_scatter}"


def _vp(c) -> str:
    """The interleaved schedule's model chunks per stage, where there are several."""
    vp = getattr(c, "vp", 1)
    split = getattr(c, "pipeline_split", None)
    uneven = f" ({split.describe()})" if split is not None and not split.even else ""
    return (f" x VP {vp}" if vp > 1 else "") + uneven


def _cp(c) -> str:
    """Context parallelism, where there is some."""
    cp = getattr(c, "cp", 1)
    return f", CP {cp}" if cp > 1 else ""


def _expert_layout(c) -> str:
    """The layout's expert parallelism, and FSDP's shard group (HSDP: its replicas)."""
    shard = c.gpus // (c.tp * c.pp * c.hsdp_replicate)
    fsdp = (f", FSDP over {shard}" + (f" x {c.hsdp_replicate} replicas" if c.hsdp_replicate > 1 else "") +
            (f", owners over {shard} x TP {c.tp}" if c.tp > 1 else "") +
            ("" if c.reshard_after_forward else ", units kept gathered forward to backward") if c.fsdp else "")
    return (f", EP {c.ep}" if c.ep > 1 else "") + (f", ETP {c.etp}" if c.etp > 1 else "") + fsdp


def _plans_text(result) -> str:
    """The run's DP + TP plans; under EP the experts' too, with their bucket sizing and capacity
    where those are not the defaults."""
    if result.config.fsdp:  # the owners of the FSDP step (docs/design.md §2.8), not a ZeRO-1 plan
        if result.config.policy not in FSDP_POLICIES:  # an elementwise optimizer: FSDP2's step on the shards
            return "each rank steps its shards"
        owners = get_fsdp_policy(result.config.policy).owners
        return f"{owners} owners" + (f" ({result.plan.dp_plan.policy})" if owners == "balanced" else "")
    text = f"{result.plan.dp_plan.policy} + {result.plan.tp_plan.policy}"
    e = result.expert_plan
    if e is None:
        return text
    extras = [f"{result.expert_choice.buckets} buckets"] if result.expert_choice.buckets != DEFAULT_EXPERT_BUCKETS else []
    if result.expert_choice.capacity is not None:
        cap = result.expert_choice.capacity
        extras.append(f"{human_bytes(cap.value) if cap.unit == 'bytes' else f'{cap.value * 1e3:.2f} ms'} micro-groups")
    return f"{text}, experts {e.dp_plan.policy} + {e.tp_plan.policy}" + (f" ({', '.join(extras)})" if extras else "")


def simulate_table(result) -> Table:
    c, b, o = result.config, result.breakdown, result.optimizer_breakdown
    loads = result.rank_optimizer_s
    mean = sum(loads) / len(loads)
    fell = f", fell back to {result.fell_back_to}" if result.fell_back_to else ""
    t = Table(title=f"{result.plan.model} on {c.gpus} x {c.hardware} (TP {c.tp}{_cp(c)}, PP {c.pp}{_vp(c)}, "
                    f"DP {c.gpus // (c.tp * c.pp * getattr(c, 'cp', 1))}{_expert_layout(c)}), {c.optimizer}, "
                    f"policy {c.policy}{fell} [{_plans_text(result)}]")
    t.add_column("quantity", no_wrap=True)
    t.add_column("ms", justify="right")
    rows = [
        ("iteration time", result.iteration_time_s),
        ("optimizer-step latency", result.optimizer_step_s),
        ("parameter all-gather exposed in the forward", result.param_gather_exposed_s),
        ("forward + backward compute end", result.forward_backward_s),
        ("gradient sync end", result.grad_sync_end_s),
        ("iteration: compute (mean rank)", b["compute_s"]),
        ("iteration: exposed communication", b["exposed_comm_s"]),
        ("iteration: idle", b["idle_s"]),
        ("optimizer: compute (mean rank)", o["compute_s"]),
        ("optimizer: exposed communication", o["exposed_comm_s"]),
        ("optimizer: idle from imbalance", o["idle_s"]),
        ("optimizer compute per rank: min", min(loads)),
        ("optimizer compute per rank: mean", mean),
        ("optimizer compute per rank: max", max(loads)),
    ]
    for name, seconds in rows:
        t.add_row(name, _ms(seconds))
    t.add_row("MFU (model FLOPs / bf16 peak)", f"{result.mfu * 100:.1f}%")
    worst = result.memory.worst
    t.add_row("memory of the fullest GPU (GB)", f"{worst.total / 1e9:.1f}" + ("" if result.fits else " [bold red]NO FIT[/]"),
              end_section=False)
    for part, size in worst.components().items():
        t.add_row(f"  {part}", f"{size / 1e9:.2f}")
    t.caption = (f"{_options_text(c)}. Iteration: start of the first forward to parameters ready for the "
                 "next (steady state). Optimizer step: end of gradient sync to parameters updated "
                 f"(and gathered when the gather is not overlapped). Rank imbalance "
                 f"{max(loads) / mean if mean > 0 else 1.0:.3f}. Published MFU: {PUBLISHED_MFU}. "
                 f"Memory: {result.memory.explain(result.memory_capacity_bytes)}.")
    return t


# the baselines a comparison's speedups are against, with their column labels: under --fsdp the
# FSDP step policies' (docs/design.md §2.8), the ZeRO-1 layout's otherwise
SPEEDUP_BASELINES = {False: (("layerwise", "lw"), ("zero1-gather", "z1")),
                     True: (("fsdp-gather-all", "ga"), ("fsdp-owners-unbalanced", "un"))}


def compare_table(results) -> Table:
    c = results[0].config
    by = {r.config.policy: r for r in results}
    baselines = SPEEDUP_BASELINES[bool(c.fsdp)]
    layout = f"TP {c.tp}" + _cp(c) + (f", PP {c.pp}{_vp(c)}" if c.pp > 1 else "") + _expert_layout(c)
    t = Table(title=f"{results[0].plan.model} on {c.gpus} x {c.hardware} ({layout}), {c.optimizer}, seq {c.workload.seq_len}, "
                    f"global batch {c.workload.global_batch}")
    t.add_column("policy", no_wrap=True)
    for col in ("iter ms", "MFU", "GB/GPU", "fits", "opt ms", "opt comm", "opt idle", "gather wait",
                *(f"{what} vs {label}" for what in ("iter", "opt") for _, label in baselines)):
        t.add_column(col, justify="right", min_width=7)
    for r in results:
        o = r.optimizer_breakdown
        name = r.config.policy + (f" (fell back to {r.fell_back_to})" if r.fell_back_to else "")
        if r.config.optimizer != c.optimizer:  # the AdamW baseline beside the matrix policies
            name += f" ({r.config.optimizer})"
        fits = "yes" if r.fits else "[bold red]NO[/]"
        row = [name, _ms(r.iteration_time_s), f"{r.mfu * 100:.1f}%", f"{r.memory.worst.total / 1e9:.1f}", fits,
               _ms(r.optimizer_step_s), _ms(o["exposed_comm_s"]),
               _ms(o["idle_s"]), _ms(r.param_gather_exposed_s)]
        for attr in ("iteration_time_s", "optimizer_step_s"):
            for base, _ in baselines:
                row.append(_ratio(getattr(by[base], attr), getattr(r, attr)) if base in by else "-")
        t.add_row(*row, style="bold green" if r.config.policy == "canzona" else None)
    plans = "; ".join(f"{r.config.policy}: {_plans_text(r)}" for r in results)
    caption = [f"Plans: {plans}. opt: optimizer-step latency; opt comm / opt idle: its exposed communication and imbalance idle "
               "(mean rank); gather wait: forward stalled on the overlapped parameter all-gather (ms). "
               "Speedups are baseline time / policy time vs "
               + " and ".join(f"{name} ({label})" for name, label in baselines) + "."]
    if "canzona" in by and "layerwise" in by:
        cz, lw = by["canzona"], by["layerwise"]
        caption.append("canzona vs layerwise (the paper's baseline): iteration "
                       f"{_ratio(lw.iteration_time_s, cz.iteration_time_s)} (paper {PAPER_RATIOS['iteration_time_s']}x), "
                       f"optimizer step {_ratio(lw.optimizer_step_s, cz.optimizer_step_s)} "
                       f"(paper {PAPER_RATIOS['optimizer_step_s']}x).")
    baseline = next((r for r in results if r.config.optimizer != c.optimizer), None)
    if baseline is not None and "canzona" in by:
        cz = by["canzona"]
        caption.append(f"{c.optimizer} under canzona vs {baseline.config.optimizer} under {baseline.config.policy} "
                       f"(the run most users have today): iteration {_ratio(baseline.iteration_time_s, cz.iteration_time_s)}, "
                       f"{(cz.iteration_time_s - baseline.iteration_time_s) * 1e3:+.1f} ms per iteration.")
    caption.append(f"{_options_text(c)}. Published MFU: {PUBLISHED_MFU}.")
    caption += [r.memory.explain(r.memory_capacity_bytes) + "." for r in results if not r.fits]
    t.caption = " ".join(caption)
    return t


_RUNG_LABELS = {"ranks": "ranks agree", "replicas": "replicas agree", "3a": "3a same kernels", "3b": "3b reference"}


def verify_table(rows) -> Table:
    """`canzona verify`: one row per (optimizer, policy, rung), PASS / FAIL; a rule between cases."""
    r0 = rows[0]
    tp, ep = r0.get("tp", 1), r0.get("ep", 1)
    layout = f"{r0['dp']} gloo rank(s)" if tp == 1 else f"DP {r0['dp']} x TP {tp} = {r0['dp'] * tp} gloo ranks"
    if ep > 1:
        layout += f", EP {ep} (EDP {r0['dp'] * tp // ep})"
    fsdp, replicas = r0.get("fsdp", False), r0.get("hsdp_replicate", 1)
    if fsdp:
        layout = (f"FSDP2 x TP: DP {r0['dp']} x TP {tp} = {r0['dp'] * tp} gloo ranks" if tp > 1 else
                  f"FSDP2 over {r0['dp']} gloo ranks" if replicas == 1 else
                  f"HSDP {replicas} replicas x {r0['dp'] // replicas} shards = {r0['dp']} gloo ranks")
    t = Table(title=f"Runtime verification (rung 3): {layout}, {r0['steps']} steps, "
                    f"global batch {r0['global_batch']}, accumulation {r0['accumulation']}, fp32")
    # the TP scheduler and mode are the ZeRO-1 path's (FSDP x TP exchanges over DP x TP at once)
    columns = ("optimizer", "policy", "plan") + (("TP", "mode") if tp > 1 and not fsdp else ()) + ("rung", "result")
    for col in columns:
        t.add_column(col, no_wrap=True)
    t.add_column("max rel diff", justify="right")
    t.add_column("verdict", justify="center")

    def case(r: dict) -> tuple:
        return r["optimizer"], r["policy"], r.get("tp_policy"), r.get("tp_mode")

    for i, r in enumerate(rows):
        diff = r["max_rel_diff"]
        last_of_case = i + 1 == len(rows) or case(rows[i + 1]) != case(r)
        tp_cells = (r["tp_policy"], r["tp_mode"]) if tp > 1 else ()
        plan = r["plan"] if tp > 1 or r["plan_hash"] is None else f"{r['plan']} {r['plan_hash'][:8]}"  # the hash is in --json
        t.add_row(r["optimizer"], r["policy"], plan, *tp_cells,
                  _RUNG_LABELS.get(r["rung"], r["rung"]), r["result"],
                  "-" if diff is None else "inf" if diff == float("inf") else f"{diff:.2e}",
                  "[bold green]PASS[/]" if r["ok"] else "[bold red]FAIL[/]", end_section=last_of_case)
    agree = ("replicas agree: every HSDP replica holds the same shards as the first (one replica: nothing to "
             "compare). 3a: the distributed run equals the same kernels run in one process on the global gradients "
             "FSDP2 reduced, bit for bit (each rank its shards)") if fsdp else (
        "ranks agree: every DP rank holds the same parameters (as DP rank 0 of its TP index; under EP the same "
        "experts as the first rank of its EP index). 3a: the distributed run equals the same kernels run in one "
        "process on the same global gradients, bit for bit (each rank its shard)")
    t.caption = (f"{agree}. 3b: it stays within {REFERENCE_RTOL:g} relative (max |a - b| / max |b| per tensor) of "
                 "the reference optimizers.")
    return t


def _rate(per_s: float, unit: str) -> str:
    for prefix, size in (("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if per_s >= size:
            return f"{per_s / size:.3g} {prefix}{unit}/s"
    return f"{per_s:.3g} {unit}/s"


def _time(seconds: float) -> str:
    return f"{seconds * 1e6:.3g} us" if seconds < 1e-3 else f"{seconds * 1e3:.3g} ms"


def calibration_tables(profile: dict) -> list[Table]:
    """`canzona calibrate`: the measured figures of a profile's JSON (GEMMs, launch, bandwidth,
    solvers, optimizer kernels, collectives)."""
    cal, gpu = profile.get("calibration", {}), profile["gpu"]
    tables = []
    t = Table(title=f"Calibrated profile {profile['name']}: {cal.get('device', '?')}, torch {cal.get('torch', '?')}, "
                    f"{cal.get('repeats', '?')} repeats (median)")
    t.add_column("figure")
    t.add_column("value", justify="right")
    curve = profile.get("gemm_curve", {})
    for dtype in curve:
        t.add_row(f"GEMM peak {dtype} (best measured)", _rate(gpu["peak_flops"][dtype], "FLOP"))
    t.add_row("launch overhead", _time(gpu["launch_s"]))
    t.add_row("memory bandwidth (copy)", _rate(gpu["hbm_bytes_per_s"], "B"))
    t.add_row("memory", human_bytes(gpu["memory_bytes"]))
    t.add_row("SMs" if cal.get("device_type") == "cuda" else "logical CPUs", str(gpu["sms"]))
    t.caption = f"Figures not measured come from {cal.get('base', 'the base profile')} (see the profile's sources)."
    tables.append(t)

    if curve:
        t = Table(title="GEMM efficiency against the size of one GEMM (achieved / peak)")
        t.add_column("FLOPs of one GEMM", justify="right")
        dtypes = list(curve)
        for dtype in dtypes:
            t.add_column(dtype, justify="right")
        points = {dt: dict((f, e) for f, e in curve[dt]) for dt in dtypes}
        for flops in sorted({f for dt in dtypes for f in points[dt]}):
            t.add_row(f"{flops:.3g}", *(f"{points[dt][flops]:.3f}" if flops in points[dt] else "-" for dt in dtypes))
        tables.append(t)

    solvers = profile.get("solver_seconds", {})
    if solvers:
        t = Table(title="fp32 solvers")
        t.add_column("k", justify="right")
        ops = list(solvers)
        for op in ops:
            t.add_column(f"{op} ms", justify="right")
        by_size = {op: dict((k, s) for k, s in solvers[op]) for op in ops}
        for k in sorted({k for op in ops for k in by_size[op]}):
            t.add_row(str(k), *(_ms(by_size[op][k]) if k in by_size[op] else "-" for op in ops))
        tables.append(t)

    rows = profile.get("optimizer_seconds", [])
    if rows:
        t = Table(title="Optimizer kernels: one steady-state step plus apply")
        for col in ("optimizer", "shape", "dtype", "ms"):
            t.add_column(col, justify="right" if col == "ms" else "left")
        for opt, m, n, dtype, seconds in rows:
            t.add_row(opt, f"{m}x{n}", dtype, _ms(seconds))
        tables.append(t)

    coll = profile.get("collectives")
    if coll:
        t = Table(title=f"Collectives on {coll['backend']}, world size {cal.get('world_size', '?')}: "
                        "t = alpha + S x busfactor / busbw")
        for col in ("op", "ranks", "sizes", "alpha", "bus bandwidth"):
            t.add_column(col, justify="left" if col == "op" else "right")
        counts: dict[tuple[str, int], int] = {}
        for op, n, _, _ in coll["rows"]:
            counts[(op, n)] = counts.get((op, n), 0) + 1
        for op, n, alpha, busbw in coll.get("fits", []):
            t.add_row(op, str(n), str(counts.get((op, n), 0)), _time(alpha), _rate(busbw, "B"))
        nccl, node, net = profile["nccl"], profile["node"], profile["network"]
        t.caption = (f"Profile figures: nccl.base_latency_s {_time(nccl['base_latency_s'])}, per step "
                     f"{_time(nccl['nvlink_step_latency_s'])}; node.nvls_allreduce_busbw "
                     f"{_rate(node['nvls_allreduce_busbw'], 'B')}, node.nvlink_ring_busbw "
                     f"{_rate(node['nvlink_ring_busbw'], 'B')}, network.nic_busbw {_rate(net['nic_busbw'], 'B')}.")
        tables.append(t)
    return tables


def validate_table(report, dp: int, optimizer: str, model: str) -> Table:
    """`canzona validate`: measured against predicted, per policy."""
    t = Table(title=f"Simulator vs runtime: {model}, DP {dp} gloo ranks (CPU), {optimizer}")
    t.add_column("policy", no_wrap=True)
    for col in ("step ms measured", "predicted", "error", "iteration ms measured", "predicted", "error"):
        t.add_column(col, justify="right")
    for r in report.rows:
        t.add_row(r.policy, _ms(r.measured_step_s), _ms(r.predicted_step_s), f"{r.step_error * 100:+.0f}%",
                  _ms(r.measured_iteration_s), _ms(r.predicted_iteration_s), f"{r.iteration_error * 100:+.0f}%")
    flips = ", ".join(f"{a} < {b}" for a, b in report.discordant) or "none"
    t.caption = (f"Kendall tau of the policies' order: step {report.step_tau:.2f}, iteration {report.iteration_tau:.2f} "
                 f"(1: same order; ties lower it). Measured order predicted the other way round (beyond 5% noise): {flips}. Step: end of backward to parameters updated and gathered (optimizer.step()); "
                 "medians over interleaved rounds of the slowest rank.")
    return t


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x * 100:+.1f}%"


def _tau(x: float | None) -> str:
    return "n/a (< 2 rows)" if x is None else f"{x:.2f}"


def published_table(report) -> Table:
    """`canzona validate --published`: every published run beside its simulation (sim.published)."""
    t = Table(title="Simulator vs published runs (tokens/s/GPU; AdamW under ZeRO-1, each row's precision)")
    t.add_column("row", no_wrap=True)
    t.add_column("model", no_wrap=True)
    t.add_column("layout")
    for col in ("published", "simulated", "error", "memory / GPU"):
        t.add_column(col, justify="right")
    for r in report.rows:
        run = r.run
        pub = f"{run.tokens_per_s_per_gpu:,.0f}"
        if not r.expressible:
            t.add_row(run.id, run.model_name, f"{run.layout} ({run.hardware})", pub, r.reason, "", "")
            continue
        cap = r.capacity_bytes or 0.0
        mem = (f"{human_bytes(r.memory_bytes)} of {human_bytes(cap)}: "
               + (f"fits ({human_bytes(cap - r.memory_bytes)} free)" if r.fits
                  else f"does not fit (+{human_bytes(r.memory_bytes - cap)})"))
        t.add_row(run.id, run.model_name, f"{run.layout} ({run.hardware})", pub,
                  f"{r.simulated_tokens_per_s_per_gpu:,.0f}", _pct(r.error), mem)
    by_model = ", ".join(f"{m} {_tau(v)}" for m, v in report.tau_by_model.items()) or "none"
    mae = "n/a" if report.mean_abs_error is None else f"{report.mean_abs_error * 100:.1f}%"
    t.caption = (f"{len(report.compared)} rows simulated, {len(report.skipped)} not expressible. "
                 f"Mean absolute error {mae}, mean signed error {_pct(report.mean_signed_error) or 'n/a'} "
                 "(positive: the simulator is optimistic). "
                 f"Kendall tau overall {_tau(report.tau_overall)}; by model: {by_model}. "
                 f"Memory fits on {sum(1 for r in report.compared if r.fits)} of {len(report.compared)} "
                 "(each row's terms: --rows ID --json, rows[].memory). "
                 "No per-row or per-model correction; sources in --json and canzona/data/published_runs.json.")
    return t


def published_search_table(ranks) -> Table:
    """`canzona validate --published --search`: each published layout among the searched ones
    (sim.published_search)."""
    from sim.published_search import TOP, WITHIN

    t = Table(title=f"Published layouts among the searched ones (aim: top {TOP} or within {WITHIN:.0%} of the best)")
    for name, justify in (("row", "left"), ("published layout", "left"), ("iter ms", "right"),
                          ("best found", "left"), ("best ms", "right"), ("rank", "right"), ("gap", "right"),
                          ("aim", "left")):
        t.add_column(name, justify=justify, no_wrap=name in ("row", "rank", "gap"))
    for r in ranks:
        if r.published_s is None:
            t.add_row(r.run.id, r.run.layout, "", "not expressible: needs " + ", ".join(r.needs), "", "", "", "")
            continue
        layout = r.run.layout + ("" if r.published_fits else " (does not fit)") + \
            (f" [outside the search space: {r.outside}]" if r.outside else "")
        rank = str(r.rank) if r.rank is not None else (f"> {r.rank_at_least - 1}" if r.rank_at_least else "")
        best = r.error if r.best is None else r.best_layout
        t.add_row(r.run.id, layout, _ms(r.published_s), best, "" if r.best_s is None else _ms(r.best_s), rank,
                  _pct(r.gap), ("met" if r.meets else "not met") + ("" if r.held else " (not held: untuned)"))
    searched = [r for r in ranks if r.published_s is not None]
    held = [r for r in searched if r.held]
    untuned = len(searched) - len(held)
    t.caption = (f"{sum(1 for r in held if r.meets)} of {len(held)} searched rows held to the aim meet it"
                 + (f" ({untuned} not held: their source says the layout was not tuned)" if untuned else "")
                 + ". Rank: 1 + the layouts found that fit and are faster, under the optimizer's default step policy "
                 "and reduce-scatter.")
    return t


def search_table(result, top: int) -> Table:
    """`canzona search`: the fastest layouts that fit, one row each."""
    from sim.search import describe

    q, s = result.question, result.to_dict(top)
    searched = s["searched"]
    t = Table(title=f"{q.model} on {q.gpus} x {q.hardware}, {q.optimizer}, seq {q.seq_len}, global batch "
                    f"{q.global_batch}: the {len(s['layouts'])} fastest of {searched['fit']} runs that fit "
                    f"({'FSDP ' if q.fsdp else ''}layouts, the best under each step policy"
                    f"{'' if q.fsdp else ' and reduce-scatter'} tried; "
                    f"{searched['candidates']} candidates, {searched['pruned_by_checks']} refused by the "
                    f"simulator's checks, {searched['pruned_by_memory']} by the memory floor, {searched['pruned_by_bound']} by the "
                    f"time floor, {'' if q.fsdp else str(searched['pruned_as_ties']) + ' reduce-scatters as ties, '}"
                    f"{searched['simulated']} simulated on {searched['workers']} workers in "
                    f"{searched['wall_s']:.1f} s)")
    # FSDP layouts (`--fsdp`): HSDP's replicas and FSDP2's reshard_after_forward in place of the
    # distributed optimizer's reduce-scatter, which they do not have
    layout_columns = (("HSDP R", "right"), ("reshard", "left")) if q.fsdp else (("reduce-scatter", "left"),)
    for name, justify in (("#", "right"), ("layout", "left"), ("step policy", "left"), *layout_columns,
                          ("iter ms", "right"), ("MFU", "right"), ("GB/GPU", "right"), ("free GB", "right"),
                          ("opt ms", "right")):
        t.add_column(name, justify=justify, no_wrap=name != "step policy")
    for row in s["layouts"]:
        policy = row["policy"] + (f" (fell back to {row['fell_back_to']})" if row["fell_back_to"] else "")
        # what the fullest GPU leaves of the capacity beside the memory model's allowance (docs/design.md
        # §7.1): a layout with little free rests on that allowance, an assumption, to run at all
        free = (row["memory_capacity_bytes"] - row["memory_bytes"]) / 1e9
        fields = (str(row["hsdp_replicate"]), "after forward" if row["reshard_after_forward"] else "no") if q.fsdp \
            else (row["reduce_scatter"],)
        t.add_row(str(row["rank"]), describe(row), policy, *fields, _ms(row["iteration_time_s"]),
                  f"{row['mfu'] * 100:.1f}%", f"{row['memory_bytes'] / 1e9:.1f}", f"{free:.1f}",
                  _ms(row["optimizer_step_s"]))
    if len(s["layouts"]) > searched["exact_top"]:
        t.caption = (f"The first {searched['exact_top']} are the exhaustive search's; below them, the fastest of those "
                     "simulated (a layout pruned by the time floor may be faster).")
    return t
