"""Tabulate the runs of ``benchmarks/run_kv_mismatch.sh``: mean ``rollout_corr/k3_kl``, ``rollout_corr/kl`` and
reward over the steps every run completed, per rollout config (bf16 / FP8 linear / FP8 linear + KV) and TIS on/off.

    python benchmarks/summarize_kv_mismatch.py RUNS_DIR OUT_DIR

Copies each run's ``metrics.jsonl`` (and ``summary.json`` when present) to ``OUT_DIR/<run>_*`` and writes
``OUT_DIR/kv_mismatch.json``; prints a markdown table.
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

RUNS = [("bf16", "bf16 rollout"), ("fp8", "FP8 linear"), ("fp8_kv", "FP8 linear + FP8 KV cache")]


def main(runs_dir: str, out_dir: str) -> None:
    """Read ``RUNS_DIR/<cfg>_tis_<on|off>/metrics.jsonl``, write the table and JSON to ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    found = {}
    for cfg, _ in RUNS:
        for tis in ("on", "off"):
            d = os.path.join(runs_dir, f"{cfg}_tis_{tis}")
            p = os.path.join(d, "metrics.jsonl")
            if not os.path.exists(p):
                continue
            lines = read_metrics(p)
            if lines:
                found[(cfg, tis)] = lines
                shutil.copy(p, os.path.join(out_dir, f"{cfg}_tis_{tis}_metrics.jsonl"))
                if os.path.exists(os.path.join(d, "summary.json")):
                    shutil.copy(os.path.join(d, "summary.json"), os.path.join(out_dir, f"{cfg}_tis_{tis}_summary.json"))
    if not found:
        raise FileNotFoundError(f"no runs with metrics.jsonl under {runs_dir}")
    steps = min(len(v) for v in found.values())
    rows = []
    print(f"| rollout | TIS | steps | k3_kl mean | kl mean | reward mean |\n|---|---|---|---|---|---|")
    for cfg, label in RUNS:
        for tis in ("on", "off"):
            if (cfg, tis) not in found:
                continue
            m = found[(cfg, tis)][:steps]
            row = {"rollout": cfg, "tis": tis, "steps": steps,
                   "k3_kl_mean": float(np.mean([x["rollout_corr/k3_kl"] for x in m])),
                   "kl_mean": float(np.mean([x["rollout_corr/kl"] for x in m])),
                   "reward_mean": float(np.mean([x["reward/mean"] for x in m])),
                   "k3_kl_per_step": [x["rollout_corr/k3_kl"] for x in m]}
            rows.append(row)
            print(f"| {label} | {tis} | {steps} | {row['k3_kl_mean']:.3e} | {row['kl_mean']:.3e} | "
                  f"{row['reward_mean']:.3f} |")
    with open(os.path.join(out_dir, "kv_mismatch.json"), "w") as f:
        json.dump({"device": f"CPU ({cpu_description()}, shared)", "model": "smollm2-135m-instruct", "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main(*sys.argv[1:3])
