"""Tokens per second of one GRPO step, split by phase, bf16 vs FP8 rollout (and FP8 + FP8 KV cache).

Each variant is a real ``scripts/train.py`` run (default: the quickstart config, SmolLM2-135M-Instruct) in its own
process for ``--steps`` steps; the first step (JIT compilation) is dropped and the rest summarized by the median.
Phases are the trainer's own timers (``timing/*`` in ``metrics.jsonl``):

* ``rollout_s``: generation in the rollout engine (prefill + decode);
* ``reward_s``: scoring the completions;
* ``old_logprobs_s``: recomputing the trainer's logprobs of the sampled tokens (``old_logprobs``; with one PPO epoch
  they come out of the update's own forward, so this is only the bookkeeping);
* ``train_s``: forward + backward + optimizer update (and, with an FP8 KV cache, the q/k/v scale capture);
* ``sync_s``: exporting the new weights (FP8 quantization + scales) and loading them into the engine.

``tokens_per_s`` counts prompt + response tokens of the step's sequences over the whole step; ``gen_tokens_per_s``
counts only generated tokens over the rollout phase.

The ``mesh`` column is the trainer's device mesh (``mesh.shape``; ``-`` = one device, the quickstart's path).
``"--meshes=-;fsdp=2;fsdp=2,tensor=2"`` runs every variant on each; on a CPU the devices a mesh needs are faked for
that run's process (``--xla_force_host_platform_device_count``), so CPU mesh rows show the cost of the sharded
program on shared cores, not a speedup.

Usage:
  python benchmarks/bench_train_step.py                           # quickstart, bf16 / fp8 / fp8_kv, 4 steps
  python benchmarks/bench_train_step.py --variants fp8 "--meshes=-;fsdp=2"
  python benchmarks/bench_train_step.py --steps 6 --gin_param='train.max_tokens=64'
Results: ``benchmarks/results/train_step_<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _common import cpu_description  # noqa: E402

from fp8rl_jax.trainer.logging import read_metrics  # noqa: E402

PHASES = ("rollout_s", "reward_s", "old_logprobs_s", "train_s", "sync_s", "step_s")
VARIANTS = {
    "bf16": ["--gin_param=train.rollout_precision='bf16'"],
    "fp8": ["--gin_param=train.rollout_precision='fp8'"],
    "fp8_kv": ["--gin_param=train.rollout_precision='fp8'", "--gin_param=train.kv_cache_dtype='fp8_e4m3'"],
}


def summarize(metrics: list[dict], batch: int) -> dict:
    """Median phase seconds and throughputs over steps 2.. of one run (step 1 compiles)."""
    steady = metrics[1:] or metrics
    out = {p: statistics.median(m[f"timing/{p}"] for m in steady) for p in PHASES if f"timing/{p}" in steady[0]}
    resp = statistics.median(m["response_length/mean"] * batch for m in steady)
    out["response_tokens_per_step"] = resp
    prompt = statistics.median(m["prompt_length/mean"] * batch for m in steady)
    out["tokens_per_s"] = (prompt + resp) / out["step_s"]
    out["response_tokens_per_s"] = resp / out["step_s"]
    out["gen_tokens_per_s"] = resp / out["rollout_s"]
    out["rollout_share"] = out["rollout_s"] / out["step_s"]
    out["k3_kl"] = statistics.median(m["rollout_corr/k3_kl"] for m in steady)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gin_file", default=os.path.join(ROOT, "configs", "quickstart.gin"))
    ap.add_argument("--gin_param", action="append", default=[], help="extra bindings for every variant")
    ap.add_argument("--variants", default="bf16,fp8,fp8_kv")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--meshes", default="-", help="';'-separated mesh shapes ('-' = one device), e.g. '-;fsdp=2'")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    for v, mesh in [(v, m.strip()) for m in args.meshes.split(";") for v in args.variants.split(",")]:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; expected one of {tuple(VARIANTS)}")
        env = dict(os.environ)
        mesh_args = []
        if mesh not in ("-", ""):
            mesh_args = [f"--gin_param=mesh.shape='{mesh}'"]
            n = 1
            for part in mesh.split(","):
                n *= int(part.split("=")[1])
            if "nvidia" not in _device().lower():  # CPU: fake the devices for that process only
                env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}").strip()
        with tempfile.TemporaryDirectory(prefix=f"bench_train_step_{v}_") as run_dir:
            cmd = [sys.executable, os.path.join(ROOT, "scripts", "train.py"), f"--gin_file={args.gin_file}",
                   f"--gin_param=train.num_steps={args.steps}", "--gin_param=train.checkpoint_every=0",
                   "--gin_param=train.progress_bar=False", "--gin_param=train.plots=False", *VARIANTS[v], *mesh_args,
                   *[f"--gin_param={g}" for g in args.gin_param], f"--output_dir={run_dir}"]
            print(f"== {v} mesh {mesh}: {' '.join(cmd[1:])}", flush=True)
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
            if proc.returncode:
                raise SystemExit(f"{v} run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
            metrics = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
            with open(os.path.join(run_dir, "config.gin")) as f:
                gin_txt = f.read()
        batch = 1
        for key in ("train.prompts_per_step", "train.samples_per_prompt"):
            batch *= int(next(ln.split("=")[1] for ln in gin_txt.splitlines() if ln.startswith(key)))
        row = {"variant": v, "mesh": mesh or "-", "steps": len(metrics), "sequences_per_step": batch,
               **summarize(metrics, batch)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    cols = ["variant", "mesh", *PHASES, "rollout_share", "gen_tokens_per_s", "response_tokens_per_s", "tokens_per_s", "k3_kl"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, "-"))
                                       for c in cols) + " |")
    device = _device()
    command = " ".join(["python benchmarks/bench_train_step.py", *(argv if argv is not None else sys.argv[1:])])
    text = (f"# One GRPO step by phase ({device})\n\nMedian seconds of steps 2..{args.steps} "
            f"({rows[0]['sequences_per_step'] if rows else '?'} sequences per step, config "
            f"`{os.path.relpath(args.gin_file, ROOT)}`).\n\n" + "\n".join(lines) + f"\n\n`{command}`\n")
    print("\n" + text)
    kind = "gpu" if "gpu" in device.lower() or "nvidia" in device.lower() else "cpu"
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"train_step_{kind}")
    with open(out + ".json", "w") as f:
        json.dump({"benchmark": "bench_train_step", "device": device, "command": command, "rows": rows}, f, indent=2)
    with open(out + ".md", "w") as f:
        f.write(text)
    print(f"wrote {out}.json / .md")


def _device() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return "GPU: " + out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return f"CPU: {cpu_description()}"


if __name__ == "__main__":
    main()
