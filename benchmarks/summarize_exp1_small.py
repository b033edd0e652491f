#!/usr/bin/env python
"""Experiment 1 (small): reward and mismatch curves of FP8+TIS, FP8 without TIS and bf16 rollout over 3 seeds.

    python benchmarks/summarize_exp1_small.py RUNS_DIR [OUT_DIR=benchmarks/results/exp1_small_cpu]

``RUNS_DIR`` holds ``{fp8_tis,fp8_notis,bf16}_seed{0,1,2}/metrics.jsonl`` from ``benchmarks/run_exp1_small.sh``.
Writes to ``OUT_DIR``: ``exp1_small.json`` (every curve, per-condition mean and spread), ``README.md`` (table),
``reward.png`` and ``mismatch_k3.png`` (mean over seeds with a min-max band; thin lines are the seeds) and each
run's ``metrics.jsonl`` as ``<cond>_seed<k>_metrics.jsonl``. "first"/"last" are means over the first/last 4 steps
of a run; the spread is the standard deviation of those per-seed means across seeds (ddof=1).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _common import cpu_description  # noqa: E402

from fp8rl_jax.trainer.logging import read_metrics  # noqa: E402

CONDITIONS = {"fp8_tis": "FP8 W8A8 + token TIS (C=2)", "fp8_notis": "FP8 W8A8, no TIS", "bf16": "bf16 rollout"}
COLORS = {"fp8_tis": "tab:orange", "fp8_notis": "tab:green", "bf16": "tab:blue"}


def main(runs_dir: str, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    curves: dict[str, dict[int, dict[str, list[float]]]] = {}
    for cond in CONDITIONS:
        for name in sorted(os.listdir(runs_dir)):
            if not name.startswith(cond + "_seed"):
                continue
            path = os.path.join(runs_dir, name, "metrics.jsonl")
            if not os.path.isfile(path):
                continue
            hist = read_metrics(path)
            seed = int(name.rsplit("seed", 1)[1])
            curves.setdefault(cond, {})[seed] = {
                "reward": [m["reward/mean"] for m in hist], "k3_kl": [m["rollout_corr/k3_kl"] for m in hist],
                "kl": [m["rollout_corr/kl"] for m in hist], "step_s": [m["timing/step_s"] for m in hist]}
            shutil.copy(path, os.path.join(out_dir, f"{name}_metrics.jsonl"))
    summary = {}
    for cond, seeds in curves.items():
        n = min(len(c["reward"]) for c in seeds.values())
        k = min(4, max(1, n // 2))
        first = [float(np.mean(c["reward"][:k])) for c in seeds.values()]
        last = [float(np.mean(c["reward"][n - k:n])) for c in seeds.values()]
        k3 = [float(np.mean(c["k3_kl"][:n])) for c in seeds.values()]
        sd = (lambda x: float(np.std(x, ddof=1)) if len(x) > 1 else float("nan"))
        summary[cond] = {"label": CONDITIONS[cond], "seeds": sorted(seeds), "steps": n, "k": k,
                         "reward_first_mean": float(np.mean(first)), "reward_first_sd": sd(first),
                         "reward_last_mean": float(np.mean(last)), "reward_last_sd": sd(last),
                         "reward_gain_mean": float(np.mean(np.subtract(last, first))),
                         "reward_gain_sd": sd(np.subtract(last, first).tolist()),
                         "k3_kl_mean": float(np.mean(k3)), "k3_kl_sd": sd(k3),
                         "step_s_median": float(np.median([s for c in seeds.values() for s in c["step_s"][1:n]]))}
    device = f"CPU ({cpu_description()})"
    with open(os.path.join(out_dir, "exp1_small.json"), "w") as f:
        json.dump({"device": device, "config": "configs/paper/exp1_dense_w8a8_small.gin", "summary": summary,
                   "curves": {c: {str(s): v for s, v in d.items()} for c, d in curves.items()}}, f, indent=2)
    lines = ["# Experiment 1 (small): FP8 rollout with / without TIS vs bf16, 3 seeds", "",
             f"Device: {device}. Config: `configs/paper/exp1_dense_w8a8_small.gin` (SmolLM2-135M-Instruct, one-digit "
             "chain_sum, 8 prompts x 4 samples, float32 trainer). Command: `bash benchmarks/run_exp1_small.sh "
             "runs/exp1_small` then `python benchmarks/summarize_exp1_small.py runs/exp1_small`.", "",
             "Reward = mean over the step's 32 samples; first/last = mean of the first/last k steps of each seed; "
             "+- = standard deviation across seeds.", "",
             "| rollout | seeds | steps | reward first k | reward last k | gain | mismatch k3 (mean over steps) | step s |",
             "|---|---|---|---|---|---|---|---|"]
    for cond, s in summary.items():
        lines.append(f"| {s['label']} | {len(s['seeds'])} | {s['steps']} | {s['reward_first_mean']:.3f} +- "
                     f"{s['reward_first_sd']:.3f} (k={s['k']}) | {s['reward_last_mean']:.3f} +- {s['reward_last_sd']:.3f} | "
                     f"{s['reward_gain_mean']:+.3f} +- {s['reward_gain_sd']:.3f} | {s['k3_kl_mean']:.2e} +- "
                     f"{s['k3_kl_sd']:.1e} | {s['step_s_median']:.1f} |")
    lines += ["", "![reward](reward.png) ![mismatch](mismatch_k3.png)", ""]
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    _plot(curves, out_dir)


def _plot(curves: dict, out_dir: str) -> None:
    from _plots import plot_curves

    for key, fname, ylabel in (("reward", "reward.png", "reward (mean of 32 samples)"),
                               ("k3_kl", "mismatch_k3.png", "mismatch k3 KL (trainer vs rollout)")):
        plot_curves({CONDITIONS[c]: [v[key] for v in seeds.values()] for c, seeds in curves.items()},
                    os.path.join(out_dir, fname), ylabel, log_y=key == "k3_kl",
                    colors={CONDITIONS[c]: COLORS[c] for c in curves})


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                         "results", "exp1_small_cpu"))
