#!/usr/bin/env python
"""The autotuner's sweep on this GPU (issue 37 item 3): the engine's GEMM keys timed on the device, and the tables to
ship. The quick GPU run's ``autotune`` stage (``bash benchmarks/run_gpu.sh quick``).

    python benchmarks/autotune_sweep.py --cache DIR --ship_out DIR [--budget_s 35]

Tunes (``FP8RL_AUTOTUNE=on``, :func:`fp8rl_jax.kernels.tuner.select`) the Qwen3-8B keys in the order the quick run's
later stages use them: the swap-AB decode GEMM (:func:`fp8rl_jax.kernels.decode_gemm_mgpu.tuned_config`) at the M
buckets of b = 1 and of b = 32 (also a b = 1 prompt of 32 tokens), then the dense prefill GEMM
(:func:`fp8rl_jax.kernels.mosaic_gemm.tuned_config`) at M = 4096 (the gemm stage), 1024 (b = 32 prompts of 32) and
128 (b = 128 decode),
then the decode buckets 8 and 64 and the Qwen3-30B-A3B attention GEMMs. A key already in the shipped tables or in
``--cache`` for this JAX version is not timed again, so a run cut by its budget is continued by the next GPU run
once its tables are committed. The tuner's own budget (``--budget_s``, ``FP8RL_AUTOTUNE_BUDGET_S``) bounds the
timing; keys past it keep their defaults (reported, not cached).

Writes: the user cache under ``--cache`` (``FP8RL_AUTOTUNE_CACHE``: later stages read it with
``FP8RL_AUTOTUNE=cached``), the merged tables to ship under ``--ship_out/<device_kind>/<op>.json``
(:func:`fp8rl_jax.kernels.tuner.export_table`: copy them to ``fp8rl_jax/kernels/data/autotuning/``), the report
as ``--ship_out/autotune_report.json``. Without a GPU it says so and exits 0 (nothing to tune). Exit status 1 when a
tuning run failed (a warning of the tuner) or no key could be tuned at all.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def keys() -> list[tuple[str, int, int, int]]:
    """``[(op, N, K, M)]`` in sweep order (see the module docstring)."""
    sys.path.insert(0, ROOT)
    from fp8rl_jax.kernels.decode_gemm_mgpu import QWEN3_8B_DECODE, QWEN3_30B_A3B_DECODE
    from fp8rl_jax.kernels.mosaic_gemm import QWEN3_8B_PREFILL

    out = [("decode_gemm", n, k, m) for m in (1, 32) for _, n, k in QWEN3_8B_DECODE]
    out += [("w8a8_gemm", n, k, m) for m in (4096, 1024, 128) for _, n, k in QWEN3_8B_PREFILL]
    out += [("decode_gemm", n, k, m) for m in (8, 64) for _, n, k in QWEN3_8B_DECODE]
    out += [("decode_gemm", n, k, m) for m in (1, 32) for _, n, k in QWEN3_30B_A3B_DECODE]
    return out


def _stop(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", required=True, help="the tuner's user cache directory (FP8RL_AUTOTUNE_CACHE)")
    p.add_argument("--ship_out", required=True, help="where the merged tables to ship are written")
    p.add_argument("--budget_s", type=float, default=35.0, help="the tuner's budget (FP8RL_AUTOTUNE_BUDGET_S)")
    args = p.parse_args(argv)
    if not args.budget_s >= 0:
        p.error(f"--budget_s must be >= 0, got {args.budget_s}")
    os.environ.update({"FP8RL_AUTOTUNE": "on", "FP8RL_AUTOTUNE_CACHE": os.path.abspath(args.cache),
                       "FP8RL_AUTOTUNE_BUDGET_S": str(args.budget_s)})
    import jax
    import jax.numpy as jnp

    from fp8rl_jax.kernels import decode_gemm_mgpu as dg
    from fp8rl_jax.kernels import mosaic_gemm as mg
    from fp8rl_jax.kernels import registry, tuner

    dev = registry.cuda_device()
    if dev is None:
        print(f"autotune_sweep: no CUDA GPU in this process (devices: {jax.devices()}): nothing to tune")
        return 0
    tuner.set_progress(lambda line: print(line, flush=True))
    # the stage's timeout sends SIGTERM: end like an interrupt, so what was tuned is still exported below
    signal.signal(signal.SIGTERM, _stop)
    t0 = time.perf_counter()
    caught: list = []

    def export(interrupted: bool = False) -> list[str]:
        """The tables to ship and the report so far (after every key: a run cut later keeps them)."""
        written = [str(path) for op in ("decode_gemm", "w8a8_gemm")
                   if (path := tuner.export_table(op, dev.device_kind, args.ship_out)) is not None]
        os.makedirs(args.ship_out, exist_ok=True)
        with open(os.path.join(args.ship_out, "autotune_report.json"), "w") as f:
            json.dump({"device_kind": dev.device_kind, "jax": jax.__version__, "seconds": time.perf_counter() - t0,
                       "tuning_s": tuner.spent_s(), "budget_s": args.budget_s, "interrupted": interrupted,
                       "report": tuner.report(), "tables": written, "warnings": [str(w.message) for w in caught]},
                      f, indent=1)
        return written

    interrupted = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for op, n, k, m in keys():
                t = time.perf_counter()
                if op == "decode_gemm":
                    cfg = dg.tuned_config(n, k, m)
                    choice = dg._config_name(cfg) if cfg is not None else mg.XLA_CANDIDATE
                else:
                    cfg = mg.tuned_config(m, n, k, jnp.bfloat16)
                    choice = mg.config_name(cfg) if cfg is not None else mg.XLA_CANDIDATE
                print(f"autotune_sweep: {op} N={n} K={k} M={m}: {choice} ({time.perf_counter() - t:.1f} s)",
                      flush=True)
                export()
        except KeyboardInterrupt:
            interrupted = True
            print("autotune_sweep: stopped by a signal; exporting what was tuned", flush=True)
    written = export(interrupted)
    report = tuner.report()
    for w in caught:
        print(f"autotune_sweep: warning: {w.message}", flush=True)
    print(tuner.format_report(), flush=True)
    print(f"autotune_sweep: {len(report)} keys, {tuner.spent_s():.1f} s of tuning; tables to ship: "
          f"{', '.join(written) or 'none'}", flush=True)
    failed = [w for w in caught if "failed" in str(w.message) or "excluded" in str(w.message)]
    tuned = [r for r in report if r["source"].startswith(("tuned", "user cache", "shipped"))]
    return 1 if interrupted or failed or not tuned else 0


if __name__ == "__main__":
    sys.exit(main())
