"""Rollout routing replay (R3, arXiv 2510.11370) on CPU: its step-time cost, and the train-inference mismatch it
removes, for tiny random Qwen3-MoE models with FP8 rollout (``configs/moe_tiny.gin``).

Two parts (``--part timing|mismatch|all``), both in-process with the trainer of ``scripts/train.py``
(:class:`fp8rl_jax.trainer.loop.RLTrainer`), configured by ``configs/moe_tiny.gin`` plus the overrides named below:

* ``timing``: two trainers, ``train.routing_replay`` False and True, step alternately (so CPU contention hits both
  alike); the first ``--warmup`` steps (JIT compilation) are dropped and the median of the trainer's own
  ``timing/step_s`` and ``timing/train_s`` over the next ``--steps`` steps is reported, with the relative cost of
  replay. The engine records routing for MoE models either way; the cost of that recording is measured apart
  (``generate`` with recording on vs off, same weights and seed, medians). Writes
  ``benchmarks/results/routing_replay_cpu.{json,md}``.
* ``mismatch``: for each model (``moe_tiny``: 4 experts top-2 as in the gin file; ``moe_e16k4``: 16 experts top-4,
  same other sizes) x seed (``--seeds``) x replay (off, on), a fresh run of ``--mismatch_steps`` steps; per run the
  mean over steps of ``rollout_corr/k3_kl``, ``rollout_corr/chi2_token`` and ``rollout_corr/routing_mismatch``;
  reported as mean and sample std over seeds. Writes ``benchmarks/results/routing_replay_mismatch_cpu.{json,md}``.

Random weights and the config's chain_sum reward: the reward is 0, so the advantages and the update are zero and
every step is a fresh rollout batch from the same weights (the mismatch is measured, no learning happens).

Usage:
  python benchmarks/bench_routing_replay.py                      # both parts
  python benchmarks/bench_routing_replay.py --part timing --steps 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _common import cpu_description  # noqa: E402

GIN = os.path.join(ROOT, "configs", "moe_tiny.gin")
RESULTS = os.path.join(ROOT, "benchmarks", "results")
MODELS = {"moe_tiny": dict(), "moe_e16k4": dict(num_experts=16, num_experts_per_tok=4)}
METRICS = ("rollout_corr/k3_kl", "rollout_corr/chi2_token", "rollout_corr/routing_mismatch")


def model_dir(name: str) -> str:
    """The tiny random Qwen3-MoE directory of ``name`` (written on first use; ``moe_tiny`` is the gin file's)."""
    from fp8rl_jax.models.moe import write_tiny_qwen3_moe

    path = "/tmp/tiny_qwen3_moe" if name == "moe_tiny" else f"/tmp/tiny_qwen3_{name}"
    if not os.path.exists(os.path.join(path, "config.json")):
        write_tiny_qwen3_moe(path, **MODELS[name])
    return path


def base_config(**overrides):
    """``TrainConfig`` from ``configs/moe_tiny.gin`` with ``overrides`` (quiet: no sync probe after the first,
    no k3 warning: random tiny models with FP8 rollout exceed the k3 bound by design)."""
    import gin

    from fp8rl_jax.trainer import TrainConfig

    gin.clear_config()
    gin.parse_config_file(GIN)
    cfg = TrainConfig(output_dir="/dev/null", verify_sync="first", mismatch_action="off")
    return dataclasses.replace(cfg, **overrides)


def timing(args) -> dict:
    import jax
    import numpy as np

    from fp8rl_jax.rollout.types import SamplingParams
    from fp8rl_jax.trainer.loop import RLTrainer

    path = model_dir("moe_tiny")
    trainers = {r: RLTrainer(base_config(model=path, routing_replay=r, seed=0)) for r in (False, True)}
    rows = {r: [] for r in trainers}
    for i in range(args.warmup + args.steps):
        for r, tr in trainers.items():
            m = tr.step()
            if i >= args.warmup:
                rows[r].append(m)
    med = {r: {k: statistics.median(m[f"timing/{k}"] for m in rows[r]) for k in ("step_s", "train_s", "rollout_s")}
           for r in rows}
    # the engine's routing record: generate with recording on vs off (recording is on for every MoE rollout)
    eng = trainers[False].engine
    prompts = trainers[False].encode_prompts(next(trainers[False].batches))
    sp = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=0, ignore_eos=True)
    gen = {}
    for rec in (False, True):
        eng.records_routing = rec
        eng.generate(prompts, sp)  # compile
        ts = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            jax.block_until_ready(eng.generate(prompts, sp).response_token_ids)
            ts.append(time.perf_counter() - t0)
        gen[rec] = statistics.median(ts)
    eng.records_routing = True
    res = {
        "device": cpu_description(), "config": "configs/moe_tiny.gin", "warmup_steps": args.warmup,
        "measured_steps": args.steps,
        "median_s": {("replay_on" if r else "replay_off"): v for r, v in med.items()},
        "replay_cost_step": med[True]["step_s"] / med[False]["step_s"] - 1.0,
        "replay_cost_train": med[True]["train_s"] / med[False]["train_s"] - 1.0,
        "generate_median_s": {"record_off": gen[False], "record_on": gen[True]},
        "record_cost_generate": gen[True] / gen[False] - 1.0,
        "step_s_all": {("replay_on" if r else "replay_off"): [m["timing/step_s"] for m in rows[r]] for r in rows},
        "routing_mismatch": {("replay_on" if r else "replay_off"):
                             float(np.mean([m["rollout_corr/routing_mismatch"] for m in rows[r]])) for r in rows},
    }
    lines = ["# Routing replay (R3) step-time cost, CPU", "",
             f"Device: {res['device']}. Config: `configs/moe_tiny.gin` (tiny random Qwen3-MoE, 4 experts top-2, FP8 "
             f"rollout). Median over {args.steps} steps after {args.warmup} warm-up steps, replay-off and replay-on "
             "trainers stepping alternately.", "",
             "| | replay off | replay on | cost |", "|---|---|---|---|"]
    for k in ("step_s", "train_s", "rollout_s"):
        a, b = med[False][k], med[True][k]
        lines.append(f"| `timing/{k}` | {a:.4f} s | {b:.4f} s | {100 * (b / a - 1):+.1f}% |")
    lines += ["", f"| engine `generate` ({len(prompts)} prompts x 4 samples, 8 tokens) | record off | record on | cost |",
              "|---|---|---|---|",
              f"| median s | {gen[False]:.4f} | {gen[True]:.4f} | {100 * res['record_cost_generate']:+.1f}% |", "",
              "Command: `python benchmarks/bench_routing_replay.py --part timing`"]
    return _write("routing_replay_cpu", res, lines)


def _write(name: str, res: dict, lines: list[str]) -> dict:
    """Write ``res`` to results/NAME.json and the table ``lines`` to results/NAME.md, print the table."""
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump(res, f, indent=2)
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return res


def mismatch(args) -> dict:
    import numpy as np

    from fp8rl_jax.trainer.loop import RLTrainer

    runs = []
    for name in MODELS:
        path = model_dir(name)
        for seed in args.seeds:
            for replay in (False, True):
                tr = RLTrainer(base_config(model=path, routing_replay=replay, seed=seed, num_steps=args.mismatch_steps))
                ms = [tr.step() for _ in range(args.mismatch_steps)]
                run = {"model": name, "seed": seed, "routing_replay": replay,
                       **{k: float(np.mean([m[k] for m in ms])) for k in METRICS},
                       "per_step": [{k: m[k] for k in METRICS} for m in ms]}
                runs.append(run)
                print(json.dumps({k: v for k, v in run.items() if k != "per_step"}), flush=True)
    summary = []
    for name in MODELS:
        for replay in (False, True):
            sel = [r for r in runs if r["model"] == name and r["routing_replay"] == replay]
            row = {"model": name, "routing_replay": replay, "seeds": len(sel)}
            for k in METRICS:
                vals = [r[k] for r in sel]
                row[k] = {"mean": float(np.mean(vals)), "std": float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0,
                          "min": float(np.min(vals)), "max": float(np.max(vals))}
            summary.append(row)
    res = {"device": cpu_description(), "config": "configs/moe_tiny.gin", "steps_per_run": args.mismatch_steps,
           "seeds": list(args.seeds), "models": {k: v or "as moe_tiny.gin" for k, v in MODELS.items()},
           "summary": summary, "runs": runs}
    lines = ["# Routing replay (R3): train-inference mismatch with FP8 rollout, CPU", "",
             f"Device: {res['device']}. `configs/moe_tiny.gin` (2 prompts x 4 samples, 8 tokens, FP8 W8A8 rollout, "
             f"float32 trainer); {args.mismatch_steps} steps per run, the run's mean over steps, then mean +- sample "
             f"std (min..max) over seeds {list(args.seeds)}. moe_tiny: hidden 64, 2 sparse layers, 4 experts top-2; "
             "moe_e16k4: the same with 16 experts top-4. Random weights (no learning: zero reward).", "",
             "| model | replay | k3_kl | chi2_token | routing_mismatch |", "|---|---|---|---|---|"]
    for row in summary:
        cells = [f"{row[k]['mean']:.3g} +- {row[k]['std']:.2g} ({row[k]['min']:.3g}..{row[k]['max']:.3g})"
                 for k in METRICS]
        lines.append(f"| {row['model']} | {'on' if row['routing_replay'] else 'off'} | " + " | ".join(cells) + " |")
    lines += ["", "Command: `python benchmarks/bench_routing_replay.py --part mismatch`"]
    return _write("routing_replay_mismatch_cpu", res, lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("timing", "mismatch", "all"), default="all")
    ap.add_argument("--warmup", type=int, default=2, help="timing: steps dropped (compilation)")
    ap.add_argument("--steps", type=int, default=6, help="timing: measured steps per trainer")
    ap.add_argument("--mismatch_steps", type=int, default=3, help="mismatch: steps per run")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="mismatch: seeds")
    args = ap.parse_args()
    if args.part in ("timing", "all"):
        timing(args)
    if args.part in ("mismatch", "all"):
        mismatch(args)


if __name__ == "__main__":
    main()
