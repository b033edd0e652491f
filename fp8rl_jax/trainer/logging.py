"""Run logging: ``metrics.jsonl`` (one JSON object per step), TensorBoard event files, PNG plots at the end.

* ``metrics.jsonl``: appended line by line and flushed after each step. On resume from step k, lines with
  ``step > k`` (written after the checkpoint the run resumes from) are dropped first, so the file reads as one
  uninterrupted run.
* TensorBoard: ``tensorboardX.SummaryWriter`` in ``<run>/tensorboard``; every numeric metric is a scalar
  at its ``step``; on resume ``purge_step=k+1`` tells TensorBoard to discard stale events after step k
  (tensorboardX semantics).
* Plots: :func:`plot_metrics` draws ``reward/*``, ``val/*``, ``rollout_corr/kl``/``k3_kl`` and ``timing/*``
  against the step with matplotlib's Agg backend into ``<run>/plots/*.png``.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable

METRICS_FILE = "metrics.jsonl"
PLOT_GROUPS = {
    "reward": ("reward/",),
    "validation": ("val/", "eval/"),
    "mismatch_kl": ("rollout_corr/kl", "rollout_corr/k3_kl"),
    "timing": ("timing/",),
}


def read_metrics(path: str) -> list[dict[str, Any]]:
    """All JSON lines of a ``metrics.jsonl`` (a torn last line from a crash is ignored).

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ValueError: a line other than the last is not valid JSON (names the line number).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"metrics file not found: {path}")
    with open(path) as f:
        lines = f.read().splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:  # a write cut off by a crash
                break
            raise ValueError(f"{path}: line {i + 1} is not valid JSON ({e})") from e
    return out


class RunLogger:
    """Write a run's metrics to ``metrics.jsonl`` and TensorBoard.

    Args:
      output_dir: run directory (created).
      resume_step: when resuming from a checkpoint after step k, pass k: earlier lines of ``metrics.jsonl``
        are kept (``history`` returns them), later ones dropped, TensorBoard events after k purged. ``None``
        starts a fresh file.
      tensorboard: also write TensorBoard event files.
    """

    def __init__(self, output_dir: str, resume_step: int | None = None, tensorboard: bool = True):
        os.makedirs(output_dir, exist_ok=True)
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, METRICS_FILE)
        self.history: list[dict[str, Any]] = []
        if resume_step is not None and os.path.isfile(self.path):
            self.history = [m for m in read_metrics(self.path) if int(m.get("step", 0)) <= resume_step]
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                f.writelines(json.dumps(m) + "\n" for m in self.history)
            os.replace(tmp, self.path)
        self._file = open(self.path, "a" if resume_step is not None else "w")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            # event files are named by time and host; a resumed writer gets its own suffix so that it never
            # overwrites the first writer's file when both start within the same second
            kw = ({"purge_step": resume_step + 1, "filename_suffix": f".resume{resume_step}"}
                  if resume_step is not None else {})
            self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"), **kw)

    def log(self, metrics: dict[str, Any]) -> None:
        """Append one step's metrics (must contain ``"step"``) to the JSONL file and TensorBoard.

        Raises:
          ValueError: ``metrics`` has no ``"step"``.
        """
        if "step" not in metrics:
            raise ValueError(f"metrics need a 'step' entry, got keys {sorted(metrics)[:8]}")
        self.history.append(dict(metrics))
        self._file.write(json.dumps(metrics) + "\n")
        self._file.flush()
        if self._tb is not None:
            step = int(metrics["step"])
            for k, v in metrics.items():
                # NaN means "not measured this step" (e.g. no sync checked): metrics.jsonl keeps it, TensorBoard
                # gets no point (tensorboardX would warn about it every step)
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._tb.add_scalar(k, float(v), step)
            self._tb.flush()

    def close(self) -> None:
        """Close the JSONL file and the TensorBoard writer."""
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def plot_metrics(history: Iterable[dict[str, Any]], out_dir: str, title: str = "",
                 k3_bound: float | None = None) -> list[str]:
    """Draw PNG plots of reward, validation, mismatch KL and timing metrics against the step.

    One PNG per group of :data:`PLOT_GROUPS` that has at least one finite value; a group's metrics share a
    figure (one line each). Uses matplotlib's Agg backend (no display needed).

    Args:
      history: per-step metric dicts with ``"step"``.
      out_dir: where the PNGs go (created).
      title: figure title prefix (e.g. the run name).
      k3_bound: the ``rollout_corr/k3_kl`` alarm bound (``train.mismatch_action``), drawn as a dashed line on the
        mismatch plot.

    Steps are integer ticks; the timing plot leaves out step 1 (it includes compilation) when there are more steps.

    Returns:
      the paths of the written PNG files.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = [m for m in history if "step" in m]
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for group, prefixes in PLOT_GROUPS.items():
        keys = sorted({k for m in history for k in m
                       if any(k == p or (p.endswith("/") and k.startswith(p)) for p in prefixes)})
        series = {}
        skip_first = group == "timing" and len({m["step"] for m in history}) > 2
        for k in keys:
            pts = [(m["step"], m[k]) for m in history if isinstance(m.get(k), (int, float))
                   and math.isfinite(m[k]) and not (skip_first and m["step"] <= 1)]
            if pts:
                series[k] = pts
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(8.0, 4.0))
        for k, pts in series.items():
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", markersize=3, label=k)
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if group == "mismatch_kl" and k3_bound is not None and "rollout_corr/k3_kl" in series:
            ax.axhline(k3_bound, color="red", linestyle="--", linewidth=1, label=f"k3 alarm bound {k3_bound:g}")
        ax.set_xlabel("step")
        ax.set_title(f"{title} {group}".strip() + (" (step 1, which compiles, left out)" if skip_first else ""))
        if group == "mismatch_kl" and all(y > 0 for pts in series.values() for _, y in pts):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)  # outside: hides no point
        fig.tight_layout()
        path = os.path.join(out_dir, f"{group}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
