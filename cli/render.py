"""Rich tables for plans, models and the model catalog."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from canzona.catalog import QWEN3_DENSE, build_qwen3
from canzona.models import ARCHITECTURE_FIELDS
from canzona.plan import Plan
from canzona.runtime.verify import REFERENCE_RTOL
from canzona.spec import ModelSpec
from cli.units import human_bytes


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def models_table() -> Table:
    t = Table(title="Model catalog (Qwen3 dense)")
    for col in ("model", "layers", "hidden", "q heads", "kv heads", "ffn", "tied", "params", "matrices"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for cfg in QWEN3_DENSE.values():
        spec = build_qwen3(cfg)
        t.add_row(cfg.name, str(cfg.layers), str(cfg.hidden), str(cfg.q_heads), str(cfg.kv_heads),
                  str(cfg.ffn), "yes" if cfg.tied_embeddings else "no", f"{spec.numel / 1e9:.2f}B",
                  str(len(spec.matrix_params())))
    t.caption = ("Any other dense decoder: --model path/to/config.json (qwen3, qwen2, llama, mistral) or a spec "
                 "file (canzona spec MODEL --out spec.json).")
    return t


_SOURCES = {"catalog": "catalog", "hf-config": "Hugging Face config.json", "spec": "canzona spec file"}


def spec_table(spec: ModelSpec, kind: str, sizes: dict[str, int], unknown: str | None) -> Table:
    """`canzona spec`: what canzona makes of a model, and what the simulator would still need."""
    t = Table(title=f"Model {spec.name} ({_SOURCES.get(kind, kind)})")
    t.add_column("quantity", no_wrap=True)
    t.add_column("value", justify="right")
    matrices = spec.matrix_params()
    t.add_row("parameters", f"{spec.numel:,} ({spec.numel / 1e9:.2f}B)")
    t.add_row("matrix-optimizer parameters", f"{len(matrices)} ({sum(p.numel for p in matrices):,} elements)")
    t.add_row("AdamW parameters", str(len(spec.adamw_params())))
    for key in ARCHITECTURE_FIELDS:
        t.add_row(f"architecture: {key}", str(sizes[key]) if key in sizes else "unknown")
    t.caption = unknown or "Matrix-optimizer parameters: 2-D, neither embedding nor head (the routing rule)."
    return t


def dp_table(plans: Sequence[Plan], chosen: Plan) -> Table:
    p0 = plans[0]
    t = Table(title=f"DP policies: {p0.model}, dp={p0.dp}, tp={p0.tp}, {p0.optimizer}, "
                    f"TP policy {p0.tp_plan.policy}")
    t.add_column("DP policy", no_wrap=True)
    for col in ("max load ms", "imb.", "LB gap", "comm", "state imb.", "atomic", "extra comm", "GPU ms"):
        t.add_column(col, justify="right")
    for p in plans:
        d = p.dp_plan.metrics
        atomic = "yes" if d.atomic else f"no ({d.atomicity_violations})"
        name = p.dp_plan.policy + (" by elements" if p.dp_plan.balance_by == "elements" else "") \
            + (" (kept whole-start)" if p.dp_plan.fell_back else "")
        t.add_row(name, _ms(d.makespan), f"{d.imbalance:.3f}", f"{d.lower_bound_gap * 100:.1f}%",
                  f"{d.comm_ratio:.2f}", f"{d.state_imbalance:.3f}", atomic,
                  human_bytes(2 * d.extra_comm_elements), _ms(p.tp_plan.metrics.makespan),
                  style="bold green" if p is chosen else None)
    t.caption = (f"Seconds from {p0.cost_model}. Load: optimizer work per DP rank (its TP group); "
                 f"lower bound {_ms(p0.dp_plan.metrics.lower_bound)} ms. Comm: longest / even "
                 "reduce-scatter segment. Extra comm: bf16 gradient bytes fetched beyond the segment. "
                 "GPU ms: optimizer compute on the slowest GPU after TP scheduling.")
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


def simulate_table(result) -> Table:
    c, b, o = result.config, result.breakdown, result.optimizer_breakdown
    loads = result.rank_optimizer_s
    mean = sum(loads) / len(loads)
    t = Table(title=f"{result.plan.model} on {c.gpus} x {c.hardware} (TP {c.tp}, DP {c.gpus // c.tp}), {c.optimizer}, "
                    f"policy {c.policy} [{result.plan.dp_plan.policy} + {result.plan.tp_plan.policy}]")
    t.add_column("quantity", no_wrap=True)
    t.add_column("ms", justify="right")
    rows = [
        ("iteration time", result.iteration_time_s),
        ("optimizer-step latency", result.optimizer_step_s),
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
    t.caption = ("Iteration: start of the first forward to parameters ready for the next. Optimizer step: "
                 f"end of gradient sync to parameters updated and gathered. Rank imbalance "
                 f"{max(loads) / mean if mean > 0 else 1.0:.3f}.")
    return t


def compare_table(results) -> Table:
    c = results[0].config
    by = {r.config.policy: r for r in results}
    t = Table(title=f"{results[0].plan.model} on {c.gpus} x {c.hardware} (TP {c.tp}), {c.optimizer}, seq {c.workload.seq_len}, "
                    f"global batch {c.workload.global_batch}")
    t.add_column("policy", no_wrap=True)
    t.add_column("plan", no_wrap=True)
    for col in ("iteration ms", "optimizer ms", "exposed comm ms", "idle ms",
                "iter vs sc", "iter vs zero1", "opt vs sc", "opt vs zero1"):
        t.add_column(col, justify="right")
    for r in results:
        o = r.optimizer_breakdown
        row = [r.config.policy, f"{r.plan.dp_plan.policy} + {r.plan.tp_plan.policy}",
               _ms(r.iteration_time_s), _ms(r.optimizer_step_s), _ms(o["exposed_comm_s"]), _ms(o["idle_s"])]
        for attr in ("iteration_time_s", "optimizer_step_s"):
            for base in ("sc", "zero1-gather"):
                row.append(_ratio(getattr(by[base], attr), getattr(r, attr)) if base in by else "-")
        t.add_row(*row, style="bold green" if r.config.policy == "canzona" else None)
    t.caption = "Speedups are baseline time / policy time (higher is better for the policy)."
    return t


_RUNG_LABELS = {"ranks": "ranks agree", "3a": "3a same kernels", "3b": "3b reference"}


def verify_table(rows) -> Table:
    """`canzona verify`: one row per (optimizer, policy, rung), PASS / FAIL; a rule between cases."""
    r0 = rows[0]
    tp = r0.get("tp", 1)
    layout = f"{r0['dp']} gloo rank(s)" if tp == 1 else f"DP {r0['dp']} x TP {tp} = {r0['dp'] * tp} gloo ranks"
    t = Table(title=f"Runtime verification (rung 3): {layout}, {r0['steps']} steps, "
                    f"global batch {r0['global_batch']}, accumulation {r0['accumulation']}, fp32")
    columns = ("optimizer", "policy", "plan") + (("TP", "mode") if tp > 1 else ()) + ("rung", "result")
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
        plan = r["plan"] if tp > 1 else f"{r['plan']} {r['plan_hash'][:8]}"  # the hash is in --json
        t.add_row(r["optimizer"], r["policy"], plan, *tp_cells,
                  _RUNG_LABELS.get(r["rung"], r["rung"]), r["result"],
                  "-" if diff is None else "inf" if diff == float("inf") else f"{diff:.2e}",
                  "[bold green]PASS[/]" if r["ok"] else "[bold red]FAIL[/]", end_section=last_of_case)
    t.caption = ("ranks agree: every DP rank holds the same parameters (as DP rank 0 of its TP index). 3a: the "
                 "distributed run equals the same kernels run in one process on the same global gradients, bit "
                 f"for bit (each rank its shard). 3b: it stays within {REFERENCE_RTOL:g} relative (max |a - b| / "
                 "max |b| per tensor) of the reference optimizers.")
    return t
