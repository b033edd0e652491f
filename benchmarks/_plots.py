"""One plotting helper for the small-scale experiment summaries (reward / mismatch curves with a seed band)."""

from __future__ import annotations

import os

import numpy as np


def plot_curves(curves: dict[str, list[list[float]]], out_path: str, ylabel: str, *, log_y: bool = False,
                colors: dict[str, str] | None = None) -> None:
    """Plot per-step curves, one color per label: thin lines per run, the mean, and a min-max band.

    Args:
      curves: ``{label: [run_1_values, run_2_values, ...]}`` (one value per step; runs are cut to the shortest).
      out_path: PNG path (its directory must exist).
      ylabel: y-axis label (x is the step, from 1).
      log_y: log-scale y axis (for KL-type metrics).
      colors: optional ``{label: matplotlib color}``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (label, runs) in enumerate(curves.items()):
        n = min(len(r) for r in runs)
        arr = np.array([r[:n] for r in runs], dtype=np.float64)
        x = np.arange(1, n + 1)
        color = (colors or {}).get(label, f"C{i}")
        if len(arr) > 1:
            for row in arr:
                ax.plot(x, row, color=color, alpha=0.25, linewidth=0.8)
            ax.fill_between(x, arr.min(0), arr.max(0), color=color, alpha=0.12)
        ax.plot(x, arr.mean(0), color=color, label=f"{label} (mean of {len(arr)})" if len(arr) > 1 else label)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if log_y:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    print("wrote", os.path.relpath(out_path))
