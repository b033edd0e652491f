#!/usr/bin/env python
"""Evaluate a model on GSM8K test or MATH-500 with the embedded JAX rollout engine and math-verify.

    python scripts/eval.py --model smollm2-135m-instruct --dataset gsm8k --num_examples 100 --n 1 \\
        --temperature 0 --max_tokens 256 --precision bf16 --output benchmarks/results/eval_cpu/gsm8k.json

Prints pass@1 (and mean@n, pass@n for n > 1) and the wall time, and writes a JSON with the metrics
(``val/<dataset>/...``, see ``fp8rl_jax.trainer.evaluation.evaluate``), the arguments, the device and the
per-sample completions. ``--model`` takes the same forms as ``train.model`` (packaged name, ``.gguf`` path
or HF directory). Exit status 2 with a one-line message for bad arguments or a missing model/dataset.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

PRECISIONS = ("bf16", "fp8", "float32")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="packaged name, .gguf path or HF directory")
    p.add_argument("--dataset", default="gsm8k", help="gsm8k | math500")
    p.add_argument("--num_examples", type=int, default=100, help="first N problems (0: all)")
    p.add_argument("--n", type=int, default=1, help="samples per problem")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--max_tokens", type=int, default=256, help="response budget (tokens)")
    p.add_argument("--precision", default="bf16", choices=PRECISIONS, help="rollout weights")
    p.add_argument("--batch_size", type=int, default=32, help="prompts per generate call")
    p.add_argument("--instruction", default=None,
                   help="text appended to each question (default: the \\boxed{} instruction)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="JSON file to write")
    return p


def main(argv=None) -> int:
    """Parse flags, evaluate the model, print the metrics and write the JSON; returns the exit status."""
    args = _parser().parse_args(argv)
    from fp8rl_jax.data.math_eval import EVAL_SETS
    from fp8rl_jax.trainer.cli import fail

    if args.dataset not in EVAL_SETS:
        return fail(f"unknown --dataset {args.dataset!r}; valid: {sorted(EVAL_SETS)}")
    for name in ("n", "max_tokens", "batch_size"):
        if getattr(args, name) < 1:
            return fail(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.num_examples < 0:
        return fail(f"--num_examples must be >= 0, got {args.num_examples}")

    import jax

    from fp8rl_jax.assets import AssetNotFoundError
    from fp8rl_jax.export import export_weights
    from fp8rl_jax.models.decoder import named_params
    from fp8rl_jax.models.loading import build_model, load_checkpoint, load_tokenizer_for
    from fp8rl_jax.rollout.engine import ENGINE_PRECISIONS, JaxRolloutEngine
    from fp8rl_jax.trainer.evaluation import BOXED_INSTRUCTION, evaluate

    t_start, cpu_start = time.perf_counter(), time.process_time()
    print(f"loading {args.model} and building the {args.precision} engine (the first batch also compiles)...",
          flush=True)
    try:
        model_cfg, params = load_checkpoint(args.model)
        tokenizer = load_tokenizer_for(args.model)
    except (FileNotFoundError, ValueError, AssetNotFoundError) as e:
        return fail(f"cannot load model {args.model!r}: {e}")
    model = build_model(model_cfg, params, param_dtype="float32", dtype="float32")
    del params
    weights = export_weights(named_params(model), ENGINE_PRECISIONS[args.precision][2])
    del model
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    engine = JaxRolloutEngine(model_cfg, weights, precision=args.precision, pad_token_id=int(pad),
                              eos_token_ids=tuple(tokenizer.eos_token_ids) or model_cfg.eos_token_ids,
                              seed=args.seed, prompt_bucket=64)
    del weights
    setup_s = time.perf_counter() - t_start
    instruction = BOXED_INSTRUCTION if args.instruction is None else (args.instruction or None)
    try:
        metrics = evaluate(engine, tokenizer, args.dataset, args.num_examples or None, n=args.n,
                           temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                           batch_size=args.batch_size, seed=args.seed, instruction=instruction,
                           return_samples=True, progress=True)
    except (ValueError, AssetNotFoundError) as e:
        return fail(str(e))
    samples = metrics.pop("samples")
    pre = f"val/{args.dataset}"
    total_s = time.perf_counter() - t_start
    cpu_s = time.process_time() - cpu_start  # CPU seconds of all threads: the cost on a shared machine
    device = f"{jax.devices()[0].platform}:{jax.devices()[0].device_kind} x{jax.device_count()} ({os.cpu_count()} CPU cores)"
    print(f"model={args.model} dataset={args.dataset} examples={metrics[f'{pre}/num_examples']} n={args.n} "
          f"temperature={args.temperature} max_tokens={args.max_tokens} precision={args.precision}")
    for k, v in metrics.items():
        print(f"  {k:40s} {v:.4f}" if isinstance(v, float) else f"  {k:40s} {v}")
    print(f"  accuracy (pass@1) = {100 * metrics[f'{pre}/pass@1']:.1f}%   eval {metrics[f'{pre}/time_s']:.1f} s, "
          f"setup {setup_s:.1f} s, total {total_s:.1f} s wall / {cpu_s:.1f} s CPU on {device}")
    clip = metrics.get(f"{pre}/clip_ratio", 0.0)
    if clip >= 0.5:  # most answers never finished: the score says more about the budget than the model
        print(f"  note: {100 * clip:.0f}% of the responses were cut at --max_tokens={args.max_tokens} before an answer "
              f"(val/.../clip_ratio): raise --max_tokens (step-by-step solutions take hundreds of tokens)")
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump({"args": vars(args), "device": device, "metrics": metrics, "timing/setup_s": setup_s,
                       "timing/total_s": total_s, "timing/cpu_s": cpu_s,
                       "load_average_1m": os.getloadavg()[0], "samples": samples}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
