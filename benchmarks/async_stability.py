#!/usr/bin/env python
"""Issue 30: does asynchronous FP8 rollout without rollout correction degrade training, and does decoupled PPO
with token TIS track the synchronous bf16 run?

Three arms at the same learning rate (quickstart task: SmolLM2-135M-Instruct, chain_sum, GRPO):

  sync_bf16     bf16 rollout, max_staleness=0, default correction (LossConfig(): decoupled, token TIS C=2)
  fp8_k_nocorr  fp8 rollout, max_staleness=K (schedule "fixed"), RolloutCorrectionConfig.disabled()
  fp8_k_tis     fp8 rollout, max_staleness=K (schedule "fixed"), RolloutCorrectionConfig.decoupled_token_is(2.0)

With ppo_epochs = num_minibatches = 1 the decoupled PPO ratio is pi / old with old = the trainer's own policy at
the step (ratio 1, no clipping); the arms 2 and 3 differ only in the token weights min(pi_old / pi_rollout, C).

Besides the trainer's metrics, every run logs ``bench/kl_ref_k3``: KL(pi_ref || pi_t) estimated with k3 on a fixed
probe, the responses of the run's step-0 batch (sampled by version 0, i.e. the reference policy, in every arm),
whose reference log-probs are the trainer's float32 log-probs before the first update.

    python benchmarks/async_stability.py --mode pilot --lrs 1e-4 3e-4 --arms fp8_k_nocorr --steps 12
    python benchmarks/async_stability.py --lr 3e-4 --seeds 0 1 2 --steps 12

Each run takes an exclusive ``flock`` on --lock (default /tmp/cpu_bench.lock) so timing benchmarks of other
processes do not overlap. Finished runs are cached in --work_dir (history.json per run) and reused (``--rerun``
forces them). The main mode writes benchmarks/results/async_stability.{json,md,png}; pilot runs found in the
cache (seed 0, other learning rates) are reported in the .md too.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ARMS = ("sync_bf16", "fp8_k_nocorr", "fp8_k_tis")
ARM_LABEL = {"sync_bf16": "sync bf16, k=0, token TIS (default)",
             "fp8_k_nocorr": "fp8, k=K, no correction",
             "fp8_k_tis": "fp8, k=K, decoupled PPO + token TIS"}
COLORS = {"sync_bf16": "C0", "fp8_k_nocorr": "C3", "fp8_k_tis": "C2"}


def run_key(arm: str, lr: float, k: int, seed: int, steps: int) -> str:
    kk = 0 if arm == "sync_bf16" else k
    return f"{arm}_lr{lr:g}_k{kk}_s{seed}_n{steps}"


def arm_settings(arm: str, k: int):
    """(TrainConfig overrides, LossConfig) of an arm."""
    from fp8rl_jax.objectives import LossConfig, RolloutCorrectionConfig

    if arm == "sync_bf16":
        return {"rollout_precision": "bf16", "max_staleness": 0}, LossConfig()
    if arm == "fp8_k_nocorr":
        return ({"rollout_precision": "fp8", "max_staleness": k, "async_schedule": "fixed"},
                LossConfig(rollout_correction=RolloutCorrectionConfig.disabled()))
    if arm == "fp8_k_tis":
        return ({"rollout_precision": "fp8", "max_staleness": k, "async_schedule": "fixed"},
                LossConfig(rollout_correction=RolloutCorrectionConfig.decoupled_token_is(threshold=2.0)))
    raise ValueError(arm)


def make_trainer_class():
    """RLTrainer that also logs ``bench/kl_ref_k3`` (KL(ref || current) on the step-0 batch, k3 estimator)."""
    import jax.numpy as jnp

    from fp8rl_jax import objectives
    from fp8rl_jax.trainer.logprobs import left_pad
    from fp8rl_jax.trainer.loop import RLTrainer

    class ProbedTrainer(RLTrainer):
        _kl_probe = None

        def _probe_logprobs(self, probe):
            pid, pmask, rid = probe[:3]
            return self._logprobs(self.model, pid, pmask, rid, self.cfg.temperature)

        def train_on(self, job, t_step=None):
            if self._kl_probe is None:  # step 0: its responses were sampled by the reference (version 0)
                rb = job.scored.rollout
                pid, pmask = left_pad(rb.prompt_token_ids, self.pad_id, bucket=8)
                probe = (jnp.asarray(pid), jnp.asarray(pmask), jnp.asarray(rb.response_token_ids),
                         jnp.asarray(rb.response_mask, jnp.float32))
                self._kl_probe = probe + (self._probe_logprobs(probe),)
            out = super().train_on(job, t_step)
            lp = self._probe_logprobs(self._kl_probe)
            m = objectives.rollout_corr_metrics(lp, self._kl_probe[4], self._kl_probe[3])
            out["bench/kl_ref_k3"] = float(m["rollout_corr/k3_kl"])  # lr = lp_now - lp_ref, samples from ref
            return out

    return ProbedTrainer


def one_run(arm: str, lr: float, k: int, seed: int, steps: int, work_dir: str, lock_path: str,
            rerun: bool, extra: dict) -> dict:
    """Train one run (under the CPU lock) or load it from the cache; returns {'history', 'wall_s', ...}."""
    key = run_key(arm, lr, k, seed, steps)
    rdir = os.path.join(work_dir, key)
    cache = os.path.join(rdir, "history.json")
    if os.path.exists(cache) and not rerun:
        with open(cache) as f:
            rec = json.load(f)
        print(f"[cache] {key}: {len(rec['history'])} steps, {rec['wall_s']:.0f} s", flush=True)
        return rec
    import gin

    from fp8rl_jax.trainer import TrainConfig
    from fp8rl_jax.trainer.run import train

    gin.clear_config()
    gin.parse_config_file(os.path.join(ROOT, "configs", "quickstart.gin"))  # chain_sum_dataset.* and train.*
    overrides, loss_config = arm_settings(arm, k)
    cfg = TrainConfig(output_dir=os.path.join(rdir, "run"), num_steps=steps, learning_rate=lr, seed=seed,
                      checkpoint_every=0, plots=False, progress_bar=False, eval_every=0, overwrite=True,
                      **overrides, **extra)
    os.makedirs(rdir, exist_ok=True)
    with open(lock_path, "a") as lockf:
        t_wait = time.perf_counter()
        fcntl.flock(lockf, fcntl.LOCK_EX)
        waited = time.perf_counter() - t_wait
        try:
            print(f"[run] {key} (waited {waited:.0f} s for the lock)", flush=True)
            t0 = time.perf_counter()
            error = None
            try:
                trainer = make_trainer_class()(cfg, loss_config=loss_config)
                history = train(cfg, trainer=trainer)
            except Exception as e:  # a crash is a result too (e.g. NaN checks); record it
                import traceback

                traceback.print_exc()
                error, history = f"{type(e).__name__}: {e}", []
                mpath = os.path.join(cfg.output_dir, "metrics.jsonl")
                if os.path.exists(mpath):
                    with open(mpath) as f:
                        history = [json.loads(line) for line in f if line.strip()]
            wall = time.perf_counter() - t0
        finally:
            fcntl.flock(lockf, fcntl.LOCK_UN)
    history = [{kk: (v if isinstance(v, (int, float)) else None) for kk, v in m.items()} for m in history
               if "reward/mean" in m]
    rec = {"key": key, "arm": arm, "lr": lr, "k": 0 if arm == "sync_bf16" else k, "seed": seed, "steps": steps,
           "wall_s": wall, "error": error, "history": history}
    with open(cache, "w") as f:
        json.dump(rec, f)
    print(f"[done] {key}: {wall:.0f} s, reward {[round(m['reward/mean'], 3) for m in history]}", flush=True)
    return rec


def series(rec: dict, name: str) -> np.ndarray:
    return np.array([np.nan if m.get(name) is None else m[name] for m in rec["history"]], dtype=np.float64)


def run_summary(rec: dict, window: int) -> dict:
    """Per-run numbers: final-window reward (by training step and by sampling version), drift, collapse."""
    r = series(rec, "reward/mean")
    k = rec["k"]
    n = len(r)
    # batch s is sampled by version max(0, s - k): the last `window` distinct sampling versions all arms share
    # are versions n-k-window .. n-k-1 (K = the async arms' staleness), i.e. steps v (sync) and v + k (async)
    out = {"reward_first3": float(np.nanmean(r[:3])) if n else math.nan,
           "reward_last_window": float(np.nanmean(r[-window:])) if n else math.nan}
    # sync/probe_abs_diff is NaN by design on async steps before the first weights apply: not a divergence
    finite = all(all(v is None or math.isfinite(v) for kk, v in m.items()
                     if kk.startswith(("reward/", "actor/", "rollout_corr/", "async/k3", "bench/")))
                 for m in rec["history"])
    for name in ("rollout_corr/k3_kl", "bench/kl_ref_k3", "actor/grad_norm", "actor/entropy"):
        s = series(rec, name) if n else np.array([])
        out[f"{name}_mean"] = float(np.nanmean(s)) if s.size and not np.all(np.isnan(s)) else math.nan
        out[f"{name}_last"] = float(s[-1]) if s.size else math.nan
    out["nonfinite"] = not finite
    out["error"] = rec.get("error")
    out["collapsed"] = bool(out["nonfinite"] or rec.get("error") or (n and out["reward_last_window"] <= 0.02 < out["reward_first3"]))
    out["wall_s"] = rec["wall_s"]
    return out


def matched_version_reward(rec: dict, versions: range) -> float:
    """Mean reward of the batches sampled by weights versions ``versions`` (step = version + k)."""
    r = series(rec, "reward/mean")
    idx = [v + rec["k"] for v in versions if v + rec["k"] < len(r)]
    return float(np.nanmean(r[idx])) if idx else math.nan


def ms(xs) -> str:
    xs = np.asarray([x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))], float)
    if xs.size == 0:
        return "n/a"
    if xs.size == 1:
        return f"{xs[0]:.4g}"
    return f"{xs.mean():.4g} ± {xs.std(ddof=1):.2g}"


def plot(recs_by_arm: dict, k: int, path: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["reward/mean", "bench/kl_ref_k3", "rollout_corr/k3_kl"]
    keys += [f"async/k3_kl/lag{k}"]  # lag 0 exists only at step 1 of the async arms (the sync arm logs no lags)
    present = set()
    for recs in recs_by_arm.values():
        for rec in recs:
            for m in rec["history"]:
                present.update(m)
    # (actor/pg_clipfrac and actor/ppo_kl are 0 by construction: one on-policy update per step, ratio pi/old = 1)
    keys += [x for x in ("actor/grad_norm", "actor/entropy", "rollout_corr/rollout_is_mean", "response_length/mean")
             if x in present]
    keys = [x for x in keys if x in present]
    ncol = 3
    nrow = math.ceil(len(keys) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(5 * ncol, 3.4 * nrow), squeeze=False)
    for ax, name in zip(axes.flat, keys):
        for arm, recs in recs_by_arm.items():
            rows = [series(rec, name) for rec in recs if rec["history"]]
            if not rows:
                continue
            n = min(len(x) for x in rows)
            arr = np.array([x[:n] for x in rows])
            log_y = "k3_kl" in name
            if np.all(np.isnan(arr)):
                continue
            x = np.arange(1, n + 1)
            mean = np.nanmean(arr, 0)
            ax.plot(x, mean, color=COLORS[arm], label=f"{ARM_LABEL[arm].replace('K', str(k))} (n={len(arr)})")
            if len(arr) > 1:
                sd = np.nanstd(arr, 0, ddof=1)
                lo = mean - sd
                if log_y:  # a log axis cannot show mean - sd <= 0: clip the band at the smallest run's value
                    lo = np.maximum(lo, np.nanmin(arr, 0))
                ax.fill_between(x, lo, mean + sd, color=COLORS[arm], alpha=0.18)
                for row in arr:
                    ax.plot(x, row, color=COLORS[arm], alpha=0.25, linewidth=0.6)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("training step")
        if "k3_kl" in name:
            ax.set_yscale("log")
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("async FP8 rollout stability (mean ± sd over seeds; thin lines = runs)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return keys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["main", "pilot"], default="main")
    p.add_argument("--lr", type=float, default=3e-4, help="learning rate of all arms (main mode)")
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-4, 3e-4], help="pilot learning rates")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--staleness", type=int, default=3, help="K of the async arms")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--window", type=int, default=4, help="final window (steps) for the reward")
    p.add_argument("--work_dir", default="/tmp/async_stability")
    p.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results", "async_stability"))
    p.add_argument("--lock", default="/tmp/cpu_bench.lock")
    p.add_argument("--rerun", action="store_true", help="ignore cached runs")
    p.add_argument("--verify_sync", default="every_step")
    args = p.parse_args(argv)
    os.makedirs(args.work_dir, exist_ok=True)
    extra = {"verify_sync": args.verify_sync}
    t_start = time.perf_counter()
    k = args.staleness

    if args.mode == "pilot":
        for lr in args.lrs:
            for arm in args.arms:
                rec = one_run(arm, lr, k, args.seeds[0], args.steps, args.work_dir, args.lock, args.rerun, extra)
                s = run_summary(rec, args.window)
                print(f"PILOT lr={lr:g} {arm}: reward first3 {s['reward_first3']:.3f} last{args.window} "
                      f"{s['reward_last_window']:.3f} kl_ref_last {s['bench/kl_ref_k3_last']:.3g} "
                      f"k3 mean {s['rollout_corr/k3_kl_mean']:.3g} collapsed {s['collapsed']} ({rec['wall_s']:.0f} s)")
        print(f"pilot wall {time.perf_counter() - t_start:.0f} s")
        return 0

    recs_by_arm = {arm: [] for arm in args.arms}
    for seed in args.seeds:  # seed-major: a cut-short session still has whole seeds of every arm
        for arm in args.arms:
            recs_by_arm[arm].append(one_run(arm, args.lr, k, seed, args.steps, args.work_dir, args.lock,
                                            args.rerun, extra))
    wall_total = time.perf_counter() - t_start

    # matched sampling versions: the last `window` versions the async arms sampled with
    v_hi = args.steps - k  # exclusive
    versions = range(max(0, v_hi - args.window), v_hi)
    table, per_run = [], []
    for arm, recs in recs_by_arm.items():
        sums = [run_summary(r, args.window) for r in recs]
        matched = [matched_version_reward(r, versions) for r in recs]
        for r, s, mv in zip(recs, sums, matched):
            per_run.append({"arm": arm, "seed": r["seed"], "lr": r["lr"], "k": r["k"], **s,
                            "reward_matched_versions": mv})
        table.append({
            "arm": arm, "label": ARM_LABEL[arm].replace("K", str(k)), "n": len(recs),
            "reward_first3": ms([s["reward_first3"] for s in sums]),
            "reward_last_window": ms([s["reward_last_window"] for s in sums]),
            "reward_matched_versions": ms(matched),
            "kl_ref_k3_last": ms([s["bench/kl_ref_k3_last"] for s in sums]),
            "rollout_k3_mean": ms([s["rollout_corr/k3_kl_mean"] for s in sums]),
            "grad_norm_mean": ms([s["actor/grad_norm_mean"] for s in sums]),
            "collapsed": sum(bool(s["collapsed"]) for s in sums),
            "wall_s_per_run": ms([s["wall_s"] for s in sums]),
        })
    cols = [("arm", "arm"), ("n", "n"), ("reward_first3", "reward steps 1-3"),
            ("reward_last_window", f"reward last {args.window} steps"),
            ("reward_matched_versions", f"reward, versions {versions.start}-{versions.stop - 1}"),
            ("kl_ref_k3_last", "KL(ref‖final) k3"), ("rollout_k3_mean", "mean rollout_corr/k3_kl"),
            ("grad_norm_mean", "mean grad_norm"), ("collapsed", "collapsed"), ("wall_s_per_run", "s/run")]
    lines = ["| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    for row in table:
        lines.append("| " + " | ".join(str(row[c[0]]) for c in cols) + " |")
    md_table = "\n".join(lines)
    print(md_table)

    # pilot runs in the cache (other learning rates, one seed)
    pilot = []
    for name in sorted(os.listdir(args.work_dir)):
        path = os.path.join(args.work_dir, name, "history.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            rec = json.load(f)
        if rec["steps"] != args.steps or (rec["lr"] == args.lr and rec["seed"] in args.seeds):
            continue
        s = run_summary(rec, args.window)
        pilot.append({"key": rec["key"], "arm": rec["arm"], "lr": rec["lr"], "seed": rec["seed"],
                      "reward": [round(m["reward/mean"], 4) for m in rec["history"]],
                      "kl_ref_k3_last": s["bench/kl_ref_k3_last"], "rollout_k3_mean": s["rollout_corr/k3_kl_mean"],
                      "collapsed": s["collapsed"], "wall_s": rec["wall_s"]})

    os.makedirs(os.path.dirname(args.results), exist_ok=True)
    png = args.results + ".png"
    plotted = plot(recs_by_arm, k, png)
    result = {
        "issue": 30, "setting": {"model": "smollm2-135m-instruct", "task": "chain_sum (configs/quickstart.gin)",
                                 "steps": args.steps, "prompts_per_step": 8, "samples_per_prompt": 4,
                                 "max_tokens": 16, "learning_rate": args.lr, "staleness_k": k,
                                 "async_schedule": "fixed", "seeds": args.seeds, "window": args.window,
                                 "matched_versions": [versions.start, versions.stop - 1],
                                 "verify_sync": args.verify_sync},
        "table": table, "per_run": per_run, "pilot": pilot, "plotted_metrics": plotted,
        "wall_s_total_this_invocation": wall_total,  # small when the runs came from the cache
        "wall_s_runs_sum": float(sum(r["wall_s"] for recs in recs_by_arm.values() for r in recs)),
        "wall_s_pilot_sum": float(sum(pr["wall_s"] for pr in pilot)),
        "curves": {arm: {str(r["seed"]): {name: series(r, name).tolist() for name in plotted} for r in recs}
                   for arm, recs in recs_by_arm.items()},
        "argv": sys.argv,
    }
    with open(args.results + ".json", "w") as f:
        json.dump(result, f, indent=1, default=lambda o: None)
    md = [f"# Async FP8 rollout stability (issue 30)", "",
          f"Command: `python {' '.join(sys.argv)}`", "",
          f"SmolLM2-135M-Instruct, chain_sum (configs/quickstart.gin), GRPO, {args.steps} steps, 8 prompts x 4 "
          f"samples, max_tokens 16, lr {args.lr:g} (all arms), K = {k} (`async_schedule='fixed'`: batch s sampled by "
          f"version max(0, s-K)), seeds {args.seeds}, mean ± sd (ddof 1) over seeds. CPU, 2 cores.", "",
          md_table, "",
          f"- `reward last {args.window} steps`: by training step; the async arms' batches there were sampled "
          f"{k} versions earlier. `reward, versions ...`: the batches sampled by the same weights versions in every "
          "arm (step = version + K for the async arms).",
          "- `KL(ref‖final) k3`: `bench/kl_ref_k3` after the last step: k3 estimate of KL(pi_ref || pi_final) on "
          "the run's step-0 batch (responses sampled by version 0), reference log-probs = the trainer's before "
          "the first update. The loss has no KL-to-reference term, so this is measured, not penalised.",
          "- `mean rollout_corr/k3_kl`: trainer (current) vs engine behaviour log-probs, mean over steps; in the "
          "async arms it includes the policy lag (split per lag in `async/k3_kl/lag*`).",
          "- collapsed: non-finite metrics, a crash, or final-window reward <= 0.02 from a first-3 reward above it.",
          "", f"Plot: `{os.path.basename(png)}` (metrics: {', '.join(plotted)}).", "",
          "## Pilot (seed 0, other learning rates / arms)", ""]
    if pilot:
        md += ["| run | reward per step | KL(ref‖final) k3 | mean rollout k3 | collapsed |", "|---|---|---|---|---|"]
        for pr in pilot:
            md.append(f"| {pr['key']} | {pr['reward']} | {pr['kl_ref_k3_last']:.3g} | {pr['rollout_k3_mean']:.3g} | "
                      f"{pr['collapsed']} |")
    else:
        md.append("(none in the cache)")
    reading = "(to be written by whoever ran it: is the effect larger than the seed spread?)"
    if os.path.exists(args.results + ".md"):  # a rerun from the cache keeps the reading written by hand
        with open(args.results + ".md") as f:
            old_md = f.read()
        if "\n## Reading\n" in old_md:
            reading = old_md.split("\n## Reading\n", 1)[1].strip()
    md += ["", "## Reading", "", reading, ""]
    with open(args.results + ".md", "w") as f:
        f.write("\n".join(md))
    print(f"wrote {args.results}.json/.md/.png; wall {wall_total:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
