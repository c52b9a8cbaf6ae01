"""Where each published layout ranks among the layouts `canzona search` finds (docs/design.md §9.7).

For a published run the simulator can express (`sim.published`), the search is asked the run's
question (its model, GPUs, hardware profile, optimizer, sequence and global batch, and whether it
ran FSDP: an FSDP row is asked among the FSDP layouts, `sim.search.FSDP_SPACE`) and the published
layout (TP, PP, VP, CP, EP, micro-batch, recompute with any Megatron recompute method; under FSDP
HSDP's replicas and reshard_after_forward) is simulated as the search would simulate it. The issue's criterion: the published layout is among the `TOP` fastest layouts found,
or within `WITHIN` of the best one.

The rank is exact without simulating the whole space: the search is run with `also_below` set to
the published layout's time and `within` to `WITHIN` (`sim.search.search`), so every layout faster
than both the published one and `1 + WITHIN` times the best, and the `TOP` fastest, are simulated.
When the published layout is slower than both, its rank is only known to be beyond them
(`rank_at_least`), and the criterion fails either way.

A run whose source says its layout was not tuned for speed (`PublishedRun.layout_not_tuned`, a
sanity-check run) is ranked the same way but not held to the criterion: a faster layout may well
have been there to find. `summary` counts the criterion over the other rows.

Layouts are compared under the search's defaults (the optimizer's default step policy and
reduce-scatter; no refinement over them), as the published runs ran. Nothing here is recorded:
the ranks are computed each time, from the simulator as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from canzona.errors import SpecError
from canzona.recompute import BLOCK
from sim.published import PublishedRun, RowResult
from sim.search import (
    RECOMPUTE_AXIS,
    SEARCHED_SPLITS,
    ZERO1_SPACE,
    Question,
    _dp,
    config_of,
    describe,
    facts_of,
    search,
    space_of,
    split_name,
)
from sim.simulate import simulate

TOP = 5  # the "among the top five found"
WITHIN = 0.05  # ... "or within 5% of the best"


def question_of(run: PublishedRun) -> Question:
    """The search's question for a published run: its model, cluster, optimizer, batch,
    precision, gradient dtype, attention backend, fused kernels, loss path, master remainders, token
    dispatcher, EP all-to-all overlap and the TP overlap's userbuffers configuration (what
    `PublishedRun.sim_config` simulates it with; the EP overlap on every layout that allows it, the
    userbuffers configuration on every layout at TP > 1), and for an FSDP row FSDP's layouts with its
    implementation."""
    cfg = run.sim_config()
    return Question(model=run.model_ref, gpus=run.gpus, hardware=run.hardware, optimizer=run.optimizer,
                    seq_len=run.seq_len, global_batch=run.global_batch, precision=run.precision,
                    fp8_recipe=run.fp8_recipe, grad_reduce_in_fp32=run.grad_reduce_in_fp32,
                    attention_backend=cfg.options.attention_backend,
                    cross_entropy_loss_fusion=cfg.workload.cross_entropy_loss_fusion,
                    cross_entropy_fusion_impl=cfg.workload.cross_entropy_fusion_impl,
                    store_param_remainders=cfg.workload.store_param_remainders,
                    fp8_params=cfg.workload.fp8_params, ep_dispatcher=run.ep_dispatcher,
                    overlap_moe_expert_parallel_comm=run.overlap_moe_expert_parallel_comm,
                    delay_wgrad_compute=run.delay_wgrad_compute, tp_comm_overlap=run.tp_comm_overlap is not False,
                    tp_comm_overlap_cfg=cfg.options.tp_comm_overlap_cfg,
                    apply_rope_fusion=run.apply_rope_fusion is not False,
                    bias_activation_fusion=run.bias_activation_fusion is not False,
                    kernels=cfg.workload.kernels, loss_fp32_upcast=run.loss_fp32_upcast is not False,
                    loss_holds_logits=cfg.workload.loss_holds_logits, master_weights=cfg.workload.master_weights,
                    fsdp=run.fsdp,
                    fsdp_impl=cfg.fsdp_impl, selective_ac_option=cfg.options.selective_ac_option)


def layout_of(run: PublishedRun) -> dict[str, Any]:
    """The published layout in the search's terms (its space's axes and DP; under full recompute
    Megatron's recompute method as the row ran it, `sim.search.METHOD_KEYS`)."""
    # a split the search explores by its name (its axis's value), another as it is (outside the space)
    out = {"tp": run.tp, "pp": run.pp, "vp": run.vp, "cp": run.cp, "ep": run.ep, "micro_batch": run.micro_batch,
           RECOMPUTE_AXIS: run.recompute or "none", "dp": run.dp, "fsdp": run.fsdp,
           "pipeline_split": split_name(run.pipeline_split) or run.pipeline_split}
    if run.fsdp:  # FSDP_SPACE's own axes: the published runs' are plain FSDP (no HSDP replicas)
        out.update(hsdp_replicate=1, reshard_after_forward=run.reshard_after_forward)
    if run.recompute_method is not None:
        out.update(recompute_method=run.recompute_method, recompute_num_layers=run.recompute_num_layers)
    return out


def split_searched(layout: dict[str, Any]) -> bool:
    """Whether `layout`'s pipeline split is one the search explores (`layout_of` names it then)."""
    return isinstance(layout.get("pipeline_split", "even"), str)


def outside_space(q: Question, layout: dict[str, Any]) -> str:
    """Why `layout` is not among the search's candidates ("" when it is): the first axis whose
    generator does not offer its value given the axes before it."""
    if bool(layout.get("fsdp")) != q.fsdp:
        return (f"{'FSDP' if layout.get('fsdp') else 'ZeRO-1'} layouts are not searched by this question "
                f"(searched: {space_of(q).name})")
    if not split_searched(layout):
        return (f"pipeline split {layout['pipeline_split'].describe()} is not searched (searched: "
                f"{', '.join(SEARCHED_SPLITS)})")
    method = layout.get("recompute_method")
    if method is not None and (method != BLOCK or space_of(q) is not ZERO1_SPACE or not q.search_recompute_layers):
        return f"recompute method {method} is not searched (the search tries Megatron's block method, at the " \
               "fewest layers that fit)"
    facts = facts_of(q)
    chosen: dict[str, Any] = {}
    for axis in space_of(q).layout:
        values = list(axis.values(facts, chosen))
        if layout[axis.name] not in values:
            return f"{axis.name} {layout[axis.name]} is not searched here (searched: {values})"
        chosen[axis.name] = layout[axis.name]
    if _dp(facts, chosen) != layout["dp"]:
        return f"dp {layout['dp']} is not what the GPUs leave ({_dp(facts, chosen)})"
    return ""


def _key(row: dict[str, Any], q: Question) -> tuple:
    """A layout's axes in `q`'s space (its recompute mode, not the method: the search's block-method
    run of the published axes is the published layout's own)."""
    return tuple(row[k] for k in space_of(q).layout_keys)


@dataclass(frozen=True)
class LayoutRank:
    """One published run's layout among the searched ones."""

    run: PublishedRun
    needs: tuple[str, ...] = ()  # what the simulator lacks to express the run (nothing searched)
    outside: str = ""  # why the published layout is not a candidate of the search ("": it is)
    published_s: float | None = None  # the published layout's simulated iteration
    published_fits: bool | None = None
    best: dict[str, Any] | None = None  # the fastest layout found that fits (the search's row)
    rank: int | None = None  # exact: 1 + the layouts found that fit and are faster
    rank_at_least: int | None = None  # when the rank is beyond what was simulated
    searched: dict[str, Any] = field(default_factory=dict)  # the search's counts and wall time
    error: str = ""  # the search found nothing (its error line)

    @property
    def best_s(self) -> float | None:
        """The fastest layout that fits: the best found, or the published one when it fits and is faster."""
        times = [self.best["iteration_time_s"]] if self.best else []
        times += [self.published_s] if self.published_s is not None and self.published_fits else []
        return min(times) if times else None

    @property
    def best_layout(self) -> str | None:
        """What `best_s` is the time of: the published layout where it fits and beats every layout found
        (one outside the search space can), else the best found (None: nothing found)."""
        if self.best is None:
            return None
        beaten = self.published_fits and self.published_s is not None and self.published_s < self.best["iteration_time_s"]
        return "the published layout" if beaten else describe(self.best)

    @property
    def gap(self) -> float | None:
        """The published layout's time over the best one's, minus one (0: it is the best)."""
        if self.published_s is None or self.best_s is None:
            return None
        return self.published_s / self.best_s - 1.0

    @property
    def held(self) -> bool:
        """Whether the criterion applies: the source tuned its layout (`PublishedRun.layout_not_tuned`)."""
        return not self.run.layout_not_tuned

    @property
    def meets(self) -> bool | None:
        """The issue's criterion: among the `TOP` fastest found or within `WITHIN` of the best."""
        if self.published_s is None:
            return None
        return (self.rank is not None and self.rank <= TOP) or (self.gap is not None and self.gap <= WITHIN)

    def to_dict(self) -> dict[str, Any]:
        r = self.run
        return {
            "id": r.id, "model": r.model_name, "hardware": r.hardware, "gpus": r.gpus, "layout": r.layout,
            "not_expressible": ", ".join(self.needs) or None, "outside_search_space": self.outside or None,
            "published_layout_iteration_s": self.published_s, "published_layout_fits": self.published_fits,
            "best_layout": self.best_layout,
            "best_iteration_s": self.best_s, "rank": self.rank, "rank_at_least": self.rank_at_least,
            "gap_to_best": self.gap, "meets": self.meets, "held_to_criterion": self.held,
            "layout_not_tuned": r.layout_not_tuned or None, "searched": self.searched, "error": self.error or None,
        }


def rank_run(run: PublishedRun, simulated: RowResult | None = None, workers: int | None = None,
             progress: Callable[[int, int, str], None] | None = None) -> LayoutRank:
    """Search `run`'s question and rank its published layout among the layouts found.
    `simulated`: the run's own simulation (`sim.published.compare_run`), reused when it is the
    configuration the search would simulate."""
    needs = run.needs()
    if needs:
        return LayoutRank(run, needs)
    q = question_of(run)
    layout = layout_of(run)
    # what the search cannot express (a split it does not explore) is simulated as the row runs
    cfg = config_of(q, layout) if split_searched(layout) else run.sim_config()
    if simulated is not None and simulated.iteration_s is not None and cfg == run.sim_config():
        t, fits = simulated.iteration_s, bool(simulated.fits)
    else:
        result = simulate(cfg)
        t, fits = result.iteration_time_s, result.fits
    outside = outside_space(q, layout)

    def tick(done: int, total: int, what: str | None, _best: float | None) -> None:
        if what is not None and progress is not None:  # a simulation finished (not the search's heartbeat)
            progress(done, total, what)

    try:
        found = search(q, top=TOP, refine_top=0, workers=workers, progress=tick, also_below=t, within=WITHIN)
    except SpecError as e:
        return LayoutRank(run, (), outside, t, fits, error=str(e))
    fit = found.ranked
    searched = {"candidates": found.candidates, "simulated": found.simulated, "fit": len(fit),
                "pruned_by_bound": found.pruned_bound, "wall_s": found.wall_s}
    if not fit:
        return LayoutRank(run, (), outside, t, fits, searched=searched, error="no searched layout fits")
    times = [row["iteration_time_s"] for row in fit]
    # what the search simulated everything below (`search`'s final bound)
    kth = times[TOP - 1] if len(times) >= TOP else float("inf")
    reach = max(kth, min(t, (1 + WITHIN) * times[0]))
    faster = sum(1 for row in fit if row["iteration_time_s"] < t and _key(row, q) != _key(layout, q))
    exact = t <= reach
    return LayoutRank(run, (), outside, t, fits, fit[0], 1 + faster if exact else None,
                      None if exact else 1 + faster, searched)


def rank_runs(runs: Sequence[PublishedRun], simulated: Sequence[RowResult] | None = None,
              workers: int | None = None, progress: Callable[[int, int, str], None] | None = None
              ) -> list[LayoutRank]:
    """`rank_run` of each run (its simulation from `simulated`, in the same order, when given)."""
    out = []
    for i, run in enumerate(runs):
        if progress is not None:
            progress(i, len(runs), f"searching {run.id}")
        out.append(rank_run(run, simulated[i] if simulated is not None else None, workers))
    return out


def summary(ranks: Sequence[LayoutRank]) -> dict[str, Any]:
    """The check over the rows: how many were searched, how many of them are held to the criterion
    (their source tuned the layout) and how many of those meet it."""
    searched = [r for r in ranks if r.published_s is not None]
    held = [r for r in searched if r.held]
    return {
        "rows": [r.to_dict() for r in ranks],
        "searched": len(searched),
        "held": len(held),
        "meets": sum(1 for r in held if r.meets),
        "outside_search_space": sum(1 for r in searched if r.outside),
        "criterion": f"the published layout is among the {TOP} fastest layouts the search finds that fit, or "
                     f"within {WITHIN:.0%} of the best one (its own time counts as a found layout's); held only where "
                     "the source tuned its layout (layout_not_tuned: the source's words that it did not)",
        "definitions": {
            "rank": "1 + the layouts found that fit and are faster than the published one, under the "
                    "optimizer's default step policy and reduce-scatter (null when beyond what was simulated: "
                    "rank_at_least)",
            "gap_to_best": "published layout's simulated iteration / the best's - 1",
        },
    }


__all__ = ["TOP", "WITHIN", "LayoutRank", "layout_of", "outside_space", "question_of", "rank_run", "rank_runs",
           "summary"]
