"""Matplotlib figures for simulated comparisons."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from canzona.fileio import write_atomic
from sim.simulate import SimResult

# What `savefig` writes, chosen by the extension (checked before a comparison starts).
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def compare_plot(results: Sequence[SimResult], path: str | Path) -> None:
    """Grouped bars: iteration time and optimizer-step latency per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.config.policy for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, attr, title in ((axes[0], "iteration_time_s", "iteration time"),
                            (axes[1], "optimizer_step_s", "optimizer-step latency")):
        values = [getattr(r, attr) * 1e3 for r in results]
        bars = ax.bar(names, values, color=["#888" if n != "canzona" else "#2a7" for n in names],
                      hatch=["" if r.fits else "//" for r in results])
        # a layout that does not fit in the GPU's memory is marked, not hidden
        ax.bar_label(bars, labels=[f"{v:.0f}" + ("" if r.fits else "\ndoes not fit") for v, r in zip(values, results)],
                     fontsize=8)
        ax.set_title(title)
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.tick_params(axis="x", labelrotation=20)
    c = results[0].config
    fig.suptitle(f"{results[0].plan.model}, {c.gpus} x {c.hardware} GPUs, TP {c.tp}, {c.optimizer} "
                 f"(seq {c.workload.seq_len}, global batch {c.workload.global_batch})", fontsize=10)
    fig.tight_layout()
    try:
        write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=120), "plot")
    finally:
        plt.close(fig)
