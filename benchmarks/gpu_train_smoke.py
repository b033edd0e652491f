"""The main job on whatever JAX computes on, with no downloaded asset: ``scripts/train.py`` for a few steps.

The model is a random-init small Qwen3 (:func:`fp8rl_jax.models.synthetic.write_random_model_dir`: every linear
dimension a multiple of 128, tied embeddings, QK-norm, an eos bias so responses end at varied lengths) with a
byte-level tokenizer built in code, written as an HF directory under ``--out``; the task is reasoning-gym's chain_sum
with DAPO's length penalty over the whole budget (a random model never answers right; the penalty makes the rewards
of a group differ, so the policy gradient is not zero and the weights change every step); the rollout is FP8 (W8A8
blockwise) in the embedded engine; every weight sync is content-checked (``train.verify_sync = "every_step"``: the
engine scores a fixed probe and the trainer compares it with its own forward, raising on a mismatch).

The run passes when ``scripts/train.py`` exits 0 and :func:`check_metrics` finds, in its ``metrics.jsonl``, one line
per step, each with a finite, in-tolerance sync probe difference (``sync/probe_abs_diff`` <=
:func:`fp8rl_jax.rollout.verify.probe_tolerance` of the rollout precision), every loss and k3 value finite, and at
least one step with a non-zero gradient (else no sync carried changed weights).

Usage:
  python benchmarks/gpu_train_smoke.py --out runs/gpu/train_smoke            # 5 steps (what run_gpu.sh quick runs)
  python benchmarks/gpu_train_smoke.py --out DIR --steps 1 --max_tokens 4    # a CPU check
  python benchmarks/gpu_train_smoke.py --check DIR/run/metrics.jsonl --steps 5
Writes ``OUT/model/`` (the HF directory; ``--model_dir`` elsewhere), ``OUT/gpu_smoke.gin``, ``OUT/run/`` (the run directory) and
``OUT/train_smoke.json`` (verdict, problems, per-step loss / k3 / probe / seconds). Exit status: 0 pass, 1 fail
(each problem printed), 2 bad arguments. Nothing sets ``JAX_PLATFORMS``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: the trainer's per-step content check of the weight sync (mean |logprob difference|, NaN when not run)
PROBE_KEY = "sync/probe_abs_diff"


def _is_loss_or_k3(key: str) -> bool:
    """Whether a metrics.jsonl key is a loss (``actor/loss``, ``actor/pg_loss``, ...) or a k3 estimate
    (``rollout_corr/k3_kl``, ``async/k3_*``)."""
    leaf = key.rsplit("/", 1)[-1]
    return "loss" in leaf or "k3" in leaf


def check_metrics(path: str, steps: int, probe_tolerance: float | None = None) -> list[str]:
    """Problems of a training run's ``metrics.jsonl`` (an empty list = pass).

    Args:
      path: the run's ``metrics.jsonl`` (one JSON object per line; lines without ``reward/mean``, such as a step-0
        evaluation line, are not training steps and are skipped).
      steps: how many training steps the run must have logged (steps 1..``steps``).
      probe_tolerance: the largest allowed ``sync/probe_abs_diff`` (nats/token); None checks finiteness only.

    Returns:
      one line per problem: a missing or unreadable file, a wrong step count, a zero ``actor/grad_norm`` on every
      step, and per step a missing or non-finite sync probe (NaN is what the trainer logs when the probe did not
      run), a probe beyond ``probe_tolerance``, no ``actor/loss`` or no ``rollout_corr/k3_kl``, or any loss / k3
      value that is not a finite number.
    """
    if not os.path.isfile(path):
        return [f"{path}: no metrics file (the run did not log a step)"]
    rows, problems = [], []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                problems.append(f"{path}:{i}: not JSON ({e})")
    steps_rows = [r for r in rows if "reward/mean" in r]
    got = [r.get("step") for r in steps_rows]
    if got != list(range(1, steps + 1)):
        problems.append(f"{path}: logged steps {got}, expected 1..{steps}")
    norms = [r.get("actor/grad_norm") for r in steps_rows]
    if steps_rows and all(isinstance(g, (int, float)) and g == 0 for g in norms):
        problems.append("actor/grad_norm is 0 on every step: the weights never changed, so no sync was checked "
                        "against a new version")
    for r in steps_rows:
        s = r.get("step")
        probe = r.get(PROBE_KEY)
        if not isinstance(probe, (int, float)) or not math.isfinite(probe):
            problems.append(f"step {s}: {PROBE_KEY} = {probe!r}: the weight sync was not content-checked")
        elif probe_tolerance is not None and probe > probe_tolerance:
            problems.append(f"step {s}: {PROBE_KEY} = {probe:.3g} exceeds the tolerance {probe_tolerance:.3g}")
        for need in ("actor/loss", "rollout_corr/k3_kl"):
            if need not in r:
                problems.append(f"step {s}: no {need}")
        for key, v in sorted(r.items()):
            if _is_loss_or_k3(key) and (not isinstance(v, (int, float)) or not math.isfinite(v)):
                problems.append(f"step {s}: {key} = {v!r} is not finite")
    return problems


def write_gin(path: str, model_dir: str, args) -> None:
    """The smoke run's gin file: FP8 rollout, every sync content-checked, chain_sum, no checkpoints or plots."""
    lines = [
        f"train.model = {json.dumps(model_dir)}",
        'train.task = "chain_sum"', 'train.reward = "chain_sum"',
        f"train.num_steps = {args.steps}", f"train.prompts_per_step = {args.prompts}",
        f"train.samples_per_prompt = {args.samples}", f"train.max_tokens = {args.max_tokens}",
        f"train.rollout_precision = {json.dumps(args.rollout_precision)}",
        'train.verify_sync = "every_step"', "train.checkpoint_every = 0", "train.plots = False",
        "train.progress_bar = False", "train.learning_rate = 1e-5", "train.seed = 0",
        # responses of varied length (the model's eos bias) under DAPO's length penalty over the whole budget: the
        # rewards differ within a group even though a random model never answers right, so the advantages, the loss
        # and the gradients are not zero and every sync carries weights that changed
        f"train.overlong_buffer_len = {args.max_tokens}", "train.overlong_penalty_factor = 1.0",
        "chain_sum_dataset.min_terms = 2", "chain_sum_dataset.max_terms = 3",
        'chain_sum_dataset.system_prompt = "Answer with just the number."', "chain_sum_dataset.instruction = None",
    ]
    with open(path, "w") as f:
        f.write("# benchmarks/gpu_train_smoke.py: a random-init tiny Qwen3, byte tokenizer, FP8 rollout\n"
                + "\n".join(lines) + "\n")


def main(argv=None) -> int:
    """Build the model directory, run ``scripts/train.py``, check its metrics; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT") or os.path.join(ROOT, "runs", "gpu"),
                                                  "train_smoke"))
    ap.add_argument("--model_dir", default=None,
                    help="where to write the random model's HF directory (default OUT/model; ~5 MB)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=4, help="train.prompts_per_step")
    ap.add_argument("--samples", type=int, default=4, help="train.samples_per_prompt")
    ap.add_argument("--max_tokens", type=int, default=16)
    ap.add_argument("--rollout_precision", default="fp8", choices=("fp8", "bf16", "float32"))
    ap.add_argument("--eos_bias", type=float, default=5.0,
                    help="the random model's extra eos logit (fp8rl_jax.models.synthetic.random_hf_params)")
    ap.add_argument("--model_overrides", default="{}",
                    help='JSON of HF config keys for the tiny Qwen3 (e.g. \'{"num_hidden_layers": 1}\')')
    ap.add_argument("--gin_param", action="append", default=[], help="extra gin bindings for scripts/train.py")
    ap.add_argument("--check", default=None, metavar="METRICS_JSONL",
                    help="only check an existing metrics.jsonl (with --steps) and exit")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    try:
        overrides = json.loads(args.model_overrides)
        assert isinstance(overrides, dict)
    except (json.JSONDecodeError, AssertionError):
        ap.error(f"--model_overrides must be a JSON object, got {args.model_overrides!r}")
    sys.path.insert(0, ROOT)
    from fp8rl_jax.rollout.verify import probe_tolerance

    tol = probe_tolerance(args.rollout_precision)
    if args.check:
        problems = check_metrics(args.check, args.steps, tol)
        print("\n".join(problems) if problems else f"{args.check}: {args.steps} steps, sync probe and losses OK")
        return 1 if problems else 0

    from fp8rl_jax.models.synthetic import write_random_model_dir

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    t0 = time.perf_counter()
    model_dir = write_random_model_dir(os.path.abspath(args.model_dir or os.path.join(out, "model")), seed=0,
                                       eos_bias=args.eos_bias, **overrides)
    gin_path = os.path.join(out, "gpu_smoke.gin")
    write_gin(gin_path, model_dir, args)
    run_dir = os.path.join(out, "run")
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "train.py"), f"--gin_file={gin_path}",
           f"--output_dir={run_dir}", "--overwrite", *[f"--gin_param={p}" for p in args.gin_param]]
    print(f"model {model_dir} written in {time.perf_counter() - t0:.1f} s; running: {' '.join(cmd)}", flush=True)
    t1 = time.perf_counter()
    rc = subprocess.run(cmd, cwd=ROOT).returncode  # output streams to this process's stdout/stderr as it comes
    train_s = time.perf_counter() - t1
    metrics = os.path.join(run_dir, "metrics.jsonl")
    problems = ([f"scripts/train.py exited with status {rc}"] if rc else []) + check_metrics(metrics, args.steps, tol)
    steps = []
    if os.path.isfile(metrics):
        with open(metrics) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "reward/mean" in r:
                    steps.append({k: r.get(k) for k in ("step", "actor/loss", "rollout_corr/k3_kl", PROBE_KEY,
                                                        "reward/mean", "timing/step_s", "timing/sync_s")})
    summary = {"passed": not problems, "problems": problems, "train_exit_status": rc, "train_seconds": train_s,
               "probe_tolerance": tol, "rollout_precision": args.rollout_precision, "model_overrides": overrides,
               "command": " ".join(cmd), "steps": steps}
    with open(os.path.join(out, "train_smoke.json"), "w") as f:
        json.dump(summary, f, indent=2)
    for p in problems:
        print(f"train smoke: FAIL: {p}", flush=True)
    if not problems:
        print(f"train smoke: PASS: {args.steps} steps in {train_s:.1f} s, every sync probe within {tol:g} nats/token, "
              "every loss and k3 finite", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
