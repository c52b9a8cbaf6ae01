"""Rich tables for plans and the model catalog."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from canzona.catalog import QWEN3_DENSE, build_qwen3
from canzona.plan import Plan
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
