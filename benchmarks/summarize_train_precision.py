#!/usr/bin/env python
"""Collect quickstart runs trained in different precisions into a table (README.md + JSON).

    python benchmarks/summarize_train_precision.py RUN_DIR [RUN_DIR ...]

Each RUN_DIR is a ``scripts/train.py`` output directory (``metrics.jsonl``, ``config.gin``). Writes
``benchmarks/results/train_precision_cpu/{README.md, train_precision_cpu.json}`` and copies each run's
``metrics.jsonl`` and plots there as ``<train_precision>_*``. Reward first/last = mean of the first/last
min(5, n//2) steps; k3_kl and kl are the mean mismatch KL between trainer and rollout logprobs per step.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "train_precision_cpu")


def main(run_dirs):
    from fp8rl_jax.trainer.logging import read_metrics

    from _common import cpu_description
    from _plots import plot_curves

    os.makedirs(OUT, exist_ok=True)
    rows, curves = [], {}
    for d in run_dirs:
        hist = read_metrics(os.path.join(d, "metrics.jsonl"))
        if not hist:
            continue
        gin_txt = open(os.path.join(d, "config.gin")).read() if os.path.isfile(os.path.join(d, "config.gin")) else ""
        prec = next((ln.split("=")[1].strip().strip("'\"") for ln in gin_txt.splitlines()
                     if ln.startswith("train.train_precision")), "float32")
        rollout = next((ln.split("=")[1].strip().strip("'\"") for ln in gin_txt.splitlines()
                        if ln.startswith("train.rollout_precision")), "?")
        curves[prec] = hist
        r = [m["reward/mean"] for m in hist]
        k = min(5, max(1, len(r) // 2))
        rows.append({"run_dir": d, "train_precision": prec, "rollout_precision": rollout, "steps": len(hist),
                     "reward_first": float(np.mean(r[:k])), "reward_last": float(np.mean(r[-k:])), "k": k,
                     "k3_kl_mean": float(np.mean([m["rollout_corr/k3_kl"] for m in hist])),
                     "kl_mean": float(np.mean([m["rollout_corr/kl"] for m in hist])),
                     "skipped_steps": float(np.sum([m.get("actor/skipped_step", 0.0) for m in hist])),
                     "step_s_median": float(np.median([m["timing/step_s"] for m in hist]))})
        shutil.copy(os.path.join(d, "metrics.jsonl"), os.path.join(OUT, f"{prec}_metrics.jsonl"))
        for png in os.listdir(os.path.join(d, "plots")) if os.path.isdir(os.path.join(d, "plots")) else []:
            shutil.copy(os.path.join(d, "plots", png), os.path.join(OUT, f"{prec}_{png}"))
    device = f"CPU ({cpu_description()}, shared)"
    with open(os.path.join(OUT, "train_precision_cpu.json"), "w") as f:
        json.dump({"device": device, "runs": [{k: v for k, v in r.items() if k != "run_dir"} for r in rows]}, f, indent=2)
    lines = ["# Quickstart (SmolLM2-135M, chain_sum, FP8 rollout) by training precision", "",
             f"Device: {device}. Config: configs/quickstart.gin + train.train_precision (FP8 W8A8 rollout, token TIS "
             "C=2, seed 0) = configs/paper/exp4_fp16_train_fp8_rollout_small.gin / exp5_fp8_e2e_small.gin and their "
             "bf16-training baseline; steps as listed. Runs one at a time:", "",
             "    for p in bf16 fp16 fp8; do python scripts/train.py --gin_file=configs/quickstart.gin "
             "--gin_param=train.num_steps=15 --gin_param=\"train.train_precision='$p'\" "
             "--gin_param=train.checkpoint_every=0 --output_dir=runs/prec_$p; done",
             "    python benchmarks/summarize_train_precision.py runs/prec_bf16 runs/prec_fp16 runs/prec_fp8", "",
             "Reward first/last k = mean over the first/last k steps; k3_kl / kl = mean per-step mismatch between the "
             "trainer's logprobs and the FP8 rollout's.", "",
             "| train precision | rollout | steps | reward first k | reward last k | k3_kl mean | kl mean | fp16 skipped | step s (median) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['train_precision']} | {r['rollout_precision']} | {r['steps']} | {r['reward_first']:.3f} (k={r['k']}) | "
                     f"{r['reward_last']:.3f} | {r['k3_kl_mean']:.4f} | {r['kl_mean']:.4f} | {r['skipped_steps']:.0f} | "
                     f"{r['step_s_median']:.1f} |")
    plot_curves({f"{p} training": [[m["reward/mean"] for m in h]] for p, h in curves.items()},
                os.path.join(OUT, "reward.png"), "reward (mean of 32 samples)")
    plot_curves({f"{p} training": [[m["rollout_corr/k3_kl"] for m in h]] for p, h in curves.items()},
                os.path.join(OUT, "mismatch_k3.png"), "mismatch k3 KL (trainer vs FP8 rollout)", log_y=True)
    lines += ["", "![reward](reward.png) ![mismatch](mismatch_k3.png)"]
    with open(os.path.join(OUT, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
