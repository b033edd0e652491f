#!/usr/bin/env python
"""Steps per hour of synchronous (``train.max_staleness = 0``) vs asynchronous (``max_staleness = 1, 2``) RL on
this CPU, in the single-process thread mode (``fp8rl_jax.trainer.run.train``: the producer is a background
thread of the trainer process) and in the Ray mode (``rollout_bridge.ray_launch.launch``: one trainer actor, one
rollout actor, shared-memory weight sync).

Model/task: configs/quickstart.gin (SmolLM2-135M-Instruct packaged offline, chain_sum, FP8 rollout, 8 prompts x 4
samples, 16 tokens), with num_steps, output_dir (under --work_dir), checkpoint_every=0, eval_every=0, plots=False,
progress_bar=False overridden.

Steps/hour counts only the steady-state steps: the first --skip steps (XLA compilation of the rollout and the train
step, and for k > 0 the producer filling its pipeline) are excluded: ``3600 / mean(timing/step_s)`` over steps
``skip+1 .. N``. Thread mode also records the wall clock between consecutive step ends (which includes the logging
and host-memory bookkeeping between steps); it is reported in the JSON as a cross-check.

Every run is a fresh subprocess (no in-memory compile cache shared between runs) run under an exclusive ``flock``
on --lock (default /tmp/cpu_bench.lock, shared with other CPU benchmarks). Finished runs are cached in --work_dir
(``<mode>_k<k>_s<seed>_n<steps>.json``); --rerun repeats them.

    python benchmarks/async_throughput.py --steps 6 --skip 2 --seeds 0 1 2 --ray_seeds 0 1 2
    python benchmarks/async_throughput.py --modes ray --ray_steps 5 --ray_seeds 0    # a smaller Ray grid

Writes benchmarks/results/async_throughput.{json,md}.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)

RESULTS = os.path.join(ROOT, "benchmarks", "results")
KEEP = ("step", "timing/step_s", "timing/rollout_s", "timing/reward_s", "timing/train_s", "timing/sync_s",
        "timing/verify_sync_s", "timing/export_s", "timing/old_logprobs_s", "timing/trainer_wait_s",
        "timing/rollout_wait_s", "async/staleness_mean", "async/staleness_max", "reward/mean",
        "sync/gb_per_s", "sync/payload_gb", "bench/wall_end_s")


def run_key(mode: str, k: int, seed: int, steps: int) -> str:
    return f"{mode}_k{k}_s{seed}_n{steps}"


def _config(k: int, seed: int, steps: int, out_dir: str):
    import gin

    from fp8rl_jax.trainer import TrainConfig

    gin.clear_config()
    gin.parse_config_file(os.path.join(ROOT, "configs", "quickstart.gin"))
    return TrainConfig(output_dir=out_dir, num_steps=steps, seed=seed, max_staleness=k, checkpoint_every=0,
                       eval_every=0, plots=False, progress_bar=False, overwrite=True)


def child(mode: str, k: int, seed: int, steps: int, run_dir: str) -> dict:
    """One training run in this (fresh) process; returns the per-step metrics and the run's wall time."""
    t_start = time.perf_counter()
    cfg = _config(k, seed, steps, os.path.join(run_dir, "run"))
    if mode == "thread":
        from fp8rl_jax.trainer.loop import RLTrainer
        from fp8rl_jax.trainer.run import train

        class Stamped(RLTrainer):  # wall-clock time of each step's end (cross-check of timing/step_s)
            def step(self):
                m = super().step()
                m["bench/wall_end_s"] = time.perf_counter() - t_start
                return m

        history = train(cfg, trainer=Stamped(cfg))
    else:
        import gin
        import ray

        from rollout_bridge.ray_launch import launch

        temp_dir = f"/tmp/rtp{os.getpid()}"  # Ray's unix socket paths must stay < 108 bytes
        env = {kk: os.environ[kk] for kk in ("HF_HUB_OFFLINE", "PYTHONPATH", "JAX_COMPILATION_CACHE_DIR")
               if kk in os.environ}
        try:
            history = launch(cfg, num_rollout_actors=1, rollout_engine="jax", transport="shm", cpus_per_actor=1,
                             gin_config=gin.config_str(),
                             ray_init_kwargs=dict(num_cpus=2, _temp_dir=temp_dir, include_dashboard=False,
                                                  runtime_env={"env_vars": env}))
        finally:
            ray.shutdown()
    history = [{kk: float(m[kk]) for kk in KEEP if isinstance(m.get(kk), (int, float))} for m in history
               if "reward/mean" in m]
    return {"history": history, "wall_s": time.perf_counter() - t_start}


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def one_run(mode: str, k: int, seed: int, steps: int, args) -> dict:
    key = run_key(mode, k, seed, steps)
    rdir = os.path.join(args.work_dir, key)
    cache = os.path.join(args.work_dir, key + ".json")
    if os.path.exists(cache) and not args.rerun:
        with open(cache) as f:
            rec = json.load(f)
        print(f"[cache] {key}: wall {rec['wall_s']:.0f} s", flush=True)
        return rec
    os.makedirs(rdir, exist_ok=True)
    out = os.path.join(rdir, "child.json")
    if os.path.exists(out):
        os.remove(out)
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", mode, str(k), str(seed), str(steps), rdir, out]
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if args.compile_cache:
        env["JAX_COMPILATION_CACHE_DIR"] = args.compile_cache
    with open(args.lock, "a") as lockf:
        t_wait = time.perf_counter()
        fcntl.flock(lockf, fcntl.LOCK_EX)
        waited = time.perf_counter() - t_wait
        try:
            print(f"[run] {key} (waited {waited:.0f} s for the lock; load {loadavg()})", flush=True)
            load_before = loadavg()
            t0 = time.perf_counter()
            with open(os.path.join(rdir, "log.txt"), "w") as log:
                rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.run_timeout).returncode
            wall = time.perf_counter() - t0
            load_after = loadavg()
        finally:
            fcntl.flock(lockf, fcntl.LOCK_UN)
    if rc != 0 or not os.path.exists(out):
        tail = open(os.path.join(rdir, "log.txt")).read()[-3000:]
        raise RuntimeError(f"{key} failed (exit {rc}); log tail:\n{tail}")
    with open(out) as f:
        rec = json.load(f)
    rec.update(key=key, mode=mode, k=k, seed=seed, steps=steps, outer_wall_s=wall, lock_wait_s=waited,
               loadavg_before=load_before, loadavg_after=load_after)
    with open(cache, "w") as f:
        json.dump(rec, f, indent=1)
    print(f"[done] {key}: {wall:.0f} s, step_s {[round(m['timing/step_s'], 1) for m in rec['history']]}", flush=True)
    return rec


def mean_sd(xs):
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return math.nan, math.nan
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else math.nan
    return m, sd


def summarize_run(rec: dict, skip: int) -> dict:
    # the last k steps of an asynchronous run have no batch left to produce: the trainer runs alone (pipeline drain,
    # no contention for the cores), so they are excluded too
    drain = rec["k"]
    h = rec["history"][skip:len(rec["history"]) - drain]
    g = lambda key: [m.get(key, math.nan) for m in h]  # noqa: E731
    mean = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
    step_s = mean(g("timing/step_s"))
    out = {"steps_timed": len(h), "step_s": step_s, "steps_per_hour": 3600.0 / step_s,
           "rollout_s": mean(g("timing/rollout_s")), "train_s": mean(g("timing/train_s")),
           "sync_s": mean(g("timing/sync_s")), "export_s": mean(g("timing/export_s")),
           "staleness_mean": mean(g("async/staleness_mean"))}
    if rec["k"] > 0:
        out["trainer_wait_s"] = mean(g("timing/trainer_wait_s"))
        out["rollout_wait_s"] = mean(g("timing/rollout_wait_s"))
    else:  # synchronous: the trainer thread runs the rollout itself; the engine idles while it trains and syncs
        out["trainer_wait_s"] = mean([a + b for a, b in zip(g("timing/rollout_s"), g("timing/reward_s"))])
        out["rollout_wait_s"] = mean([a + b + c for a, b, c in zip(g("timing/train_s"), g("timing/sync_s"),
                                                                    g("timing/verify_sync_s"))])
    ends = [m.get("bench/wall_end_s") for m in rec["history"]]
    ends = ends[:len(ends) - drain]
    if all(e is not None for e in ends) and len(ends) > skip + 1:
        gaps = [b - a for a, b in zip(ends[skip:-1], ends[skip + 1:])]
        out["wall_step_s"] = mean(gaps)
        out["wall_steps_per_hour"] = 3600.0 / out["wall_step_s"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", default=["thread", "ray"], choices=["thread", "ray"])
    p.add_argument("--ks", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="thread-mode seeds")
    p.add_argument("--ray_seeds", nargs="+", type=int, default=None, help="Ray-mode seeds (default: --seeds)")
    p.add_argument("--steps", type=int, default=6, help="RL steps per thread-mode run")
    p.add_argument("--ray_steps", type=int, default=None, help="RL steps per Ray-mode run (default: --steps)")
    p.add_argument("--skip", type=int, default=2, help="first steps excluded from steps/hour (compilation)")
    p.add_argument("--work_dir", default="/tmp/async_throughput")
    p.add_argument("--lock", default="/tmp/cpu_bench.lock")
    p.add_argument("--compile_cache", default="/tmp/async_throughput/jax_cache",
                   help="JAX persistent compilation cache for the runs (shortens the excluded first steps; '' off)")
    p.add_argument("--run_timeout", type=float, default=1200)
    p.add_argument("--rerun", action="store_true")
    p.add_argument("--cached_only", action="store_true", help="summarize the cached runs only (run nothing)")
    p.add_argument("--out", default=os.path.join(RESULTS, "async_throughput"))
    p.add_argument("--note", action="append", default=[], help="a paragraph added to the markdown (repeatable)")
    p.add_argument("--_child", nargs=6, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args._child:
        mode, k, seed, steps, rdir, out = args._child
        rec = child(mode, int(k), int(seed), int(steps), rdir)
        with open(out, "w") as f:
            json.dump(rec, f)
        os._exit(0)  # Ray / orbax background threads: do not wait for them at interpreter exit

    from benchmarks._common import cpu_description

    ray_seeds = args.ray_seeds if args.ray_seeds is not None else args.seeds
    ray_steps = args.ray_steps or args.steps
    os.makedirs(args.work_dir, exist_ok=True)
    grid = [(m, k, s, args.steps if m == "thread" else ray_steps)
            for m in args.modes for k in args.ks for s in (args.seeds if m == "thread" else ray_seeds)]
    # interleave k within a seed so that slow drift of the shared machine does not bias one k
    grid.sort(key=lambda x: (args.modes.index(x[0]), x[2], args.ks.index(x[1])))
    t0 = time.perf_counter()
    runs = []
    for mode, k, seed, steps in grid:
        if args.cached_only and not os.path.exists(os.path.join(args.work_dir, run_key(mode, k, seed, steps) + ".json")):
            continue
        try:
            rec = one_run(mode, k, seed, steps, args)
        except Exception as e:  # noqa: BLE001 - report the failure, keep the others
            print(f"[fail] {run_key(mode, k, seed, steps)}: {e}", flush=True)
            runs.append({"key": run_key(mode, k, seed, steps), "mode": mode, "k": k, "seed": seed,
                         "steps": steps, "error": str(e)[-2000:]})
            continue
        rec["summary"] = summarize_run(rec, args.skip)
        runs.append(rec)
    total = time.perf_counter() - t0

    rows = []
    for mode in args.modes:
        for k in args.ks:
            rs = [r for r in runs if r["mode"] == mode and r["k"] == k and "summary" in r]
            if not rs:
                continue
            S = lambda key: mean_sd([r["summary"].get(key, math.nan) for r in rs])  # noqa: E731
            row = {"mode": mode, "k": k, "n_seeds": len(rs), "seeds": [r["seed"] for r in rs], "steps": rs[0]["steps"],
                   "steps_timed": rs[0]["summary"]["steps_timed"]}
            for key in ("steps_per_hour", "step_s", "trainer_wait_s", "rollout_wait_s", "rollout_s", "train_s",
                        "sync_s", "export_s", "staleness_mean", "wall_steps_per_hour"):
                row[key], row[key + "_sd"] = S(key)
            rows.append(row)
    for row in rows:
        base = next((r for r in rows if r["mode"] == row["mode"] and r["k"] == 0), None)
        row["speedup_vs_sync"] = row["steps_per_hour"] / base["steps_per_hour"] if base else math.nan

    machine = cpu_description()
    header = (f"{'mode':<7}{'k':>2}{'seeds':>6}{'steps/h':>16}{'speedup':>9}{'step s':>13}{'trainer wait s':>17}"
              f"{'rollout wait s':>17}{'rollout s':>11}{'train s':>9}{'staleness':>10}")
    lines = [header]
    for r in rows:
        lines.append(f"{r['mode']:<7}{r['k']:>2}{r['n_seeds']:>6}{r['steps_per_hour']:>9.1f} ± {r['steps_per_hour_sd']:<4.1f}"
                     f"{r['speedup_vs_sync']:>9.2f}{r['step_s']:>7.2f} ± {r['step_s_sd']:<4.2f}"
                     f"{r['trainer_wait_s']:>17.2f}{r['rollout_wait_s']:>17.2f}{r['rollout_s']:>11.2f}"
                     f"{r['train_s']:>9.2f}{r['staleness_mean']:>10.2f}")
    print(f"\nmachine: {machine}; total wall {total:.0f} s")
    print("\n".join(lines))

    argv_shown, skip_next = [], False
    for x in sys.argv:  # the --note paragraphs are printed in the markdown, not in the command line
        if skip_next or x == "--note":
            skip_next = x == "--note"
            continue
        argv_shown.append(x if not x.startswith("--note=") else "--note=...")
    ran = [r for r in runs if "outer_wall_s" in r]
    res = {"machine": machine, "command": " ".join(["python", *argv_shown]),
           "runs_wall_s": sum(r["outer_wall_s"] for r in ran), "runs_lock_wait_s": sum(r["lock_wait_s"] for r in ran),
           "config": "configs/quickstart.gin (SmolLM2-135M-Instruct, chain_sum, fp8 rollout, 8x4 samples, 16 tokens)",
           "skip_steps": args.skip, "total_wall_s": total, "rows": rows,
           "runs": [{kk: v for kk, v in r.items()} for r in runs]}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(args.out + ".md", "w") as f:
        args.notes = args.note
        f.write(markdown(res, args, ray_seeds, ray_steps))
    print(f"wrote {args.out}.json and {args.out}.md")
    return 0


def markdown(res: dict, args, ray_seeds, ray_steps) -> str:
    rows = res["rows"]
    out = ["# Asynchronous RL throughput on a 2-core CPU (quickstart)", "",
           f"Machine: **{res['machine']}** (`lscpu`: AMD EPYC, 2 cores), CPU only, shared with other jobs.", "",
           f"Command (summary): `{res['command']}`; the runs themselves took {res['runs_wall_s'] / 60:.1f} min of "
           f"wall time under the lock plus {res['runs_lock_wait_s'] / 60:.1f} min waiting for it (this invocation: "
           f"{res['total_wall_s'] / 60:.1f} min).", "",
           f"Model/task: {res['config']}; `train.max_staleness = k`, `async_schedule = \"fixed\"` (default), "
           "checkpoint_every=0, eval_every=0.", "",
           f"Runs: thread mode {args.steps} steps x seeds {args.seeds}; Ray mode {ray_steps} steps x seeds "
           f"{ray_seeds}. **Steps/hour = 3600 / mean `timing/step_s` over steps {args.skip + 1}..N: the first "
           f"{args.skip} steps (XLA compilation of rollout + train step; pipeline fill for k > 0) are excluded, and for "
           "k > 0 also the last k steps (pipeline drain: no batch left to produce, the trainer runs alone).** "
           "Mean ± sd over seeds (sd of the per-seed means).", "",
           "| mode | k | seeds | timed steps/run | steps/h | speedup vs k=0 | step s | trainer wait s/step | rollout wait s/step | "
           "rollout s | train s | sync s | export s | staleness mean |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda x, d=2: "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{d}f}"  # noqa: E731
    for r in rows:
        out.append(f"| {r['mode']} | {r['k']} | {r['n_seeds']} | {r['steps_timed']} | {f(r['steps_per_hour'], 1)} ± "
                   f"{f(r['steps_per_hour_sd'], 1)} | {f(r['speedup_vs_sync'])} | {f(r['step_s'])} ± {f(r['step_s_sd'])} | "
                   f"{f(r['trainer_wait_s'])} | {f(r['rollout_wait_s'])} | {f(r['rollout_s'])} | {f(r['train_s'])} | "
                   f"{f(r['sync_s'])} | {f(r['export_s'])} | {f(r['staleness_mean'])} |")
    thr = [r for r in rows if r["mode"] == "thread" and not math.isnan(r.get("wall_steps_per_hour", math.nan))]
    if thr:
        out += ["", "Cross-check (thread mode): steps/h from the wall clock between consecutive step ends "
                "(includes logging between steps): " + ", ".join(
                    f"k={r['k']}: {f(r['wall_steps_per_hour'], 1)} ± {f(r['wall_steps_per_hour_sd'], 1)}" for r in thr)]
    failed = [r for r in res["runs"] if "error" in r]
    if failed:
        out += ["", "Failed runs: " + ", ".join(r["key"] for r in failed) + " (errors in the JSON)."]
    out += ["", "Wait columns: for k > 0 the trainer's `timing/trainer_wait_s` (trainer blocked waiting for the "
            "batch) and the producer's `timing/rollout_wait_s` (producer blocked waiting for a weights version). "
            "For k = 0 there is no second thread: the columns show the trainer's time spent in the rollout "
            "(`rollout_s + reward_s`, the time a disaggregated trainer would wait) and the rollout engine's idle "
            "time (`train_s + sync_s + verify_sync_s`)."]
    loads = [r.get("loadavg_before", [math.nan])[0] for r in res["runs"] if "loadavg_before" in r]
    if loads:
        out += ["", f"1-minute load average when each run started (2 cores): {min(loads):.2f}-{max(loads):.2f} "
                "(other jobs that did not take the lock were running at times; per-run values in the JSON)."]
    out += ["", "Why overlap gains little here: on one 2-core machine the producer (rollout) and the trainer are not "
            "separate devices. With k = 0 each phase gets both cores in turn; with k > 0 they run at the same time "
            "and XLA:CPU's thread pools of both sides compete for the same 2 cores (in the Ray mode as two "
            "processes, each sized for the whole machine), so the concurrent phases each slow down and the step is "
            "bounded by roughly rollout + train of CPU work either way. The overlap can only win back idle time "
            "(Python, host-side reward and bookkeeping, waits), and it costs contention, cache thrashing and the "
            "extra export copy of the asynchronous path (`timing/export_s`)."]
    for n in getattr(args, "notes", None) or []:
        out += ["", n]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
