"""Issue 37 (3): the autotuner's sweep for the engine's decode GEMMs on this GPU, writing the table to ship.

Runs :func:`fp8rl_jax.kernels.decode_gemm_mgpu.tuned_config` with ``FP8RL_AUTOTUNE=on`` for the Qwen3-8B decode
shapes at M = 1, 8, 32 (the M buckets of b = 1, 8 and 32 decode), the user cache redirected into
``$OUT/autotuning`` (``FP8RL_AUTOTUNE_CACHE``), then prints the tuner's report and records one JSON line per key. After
the run, copy ``$OUT/autotuning/<device_kind>/<jax>/decode_gemm.json`` to
``fp8rl_jax/kernels/data/autotuning/<device_kind>/decode_gemm.json`` (the shipped table). Budget: 50 s of tuning.
"""

import json
import os
import time

OUT = os.environ.get("OUT", "runs/gpu_queue_local")
os.makedirs(OUT, exist_ok=True)
os.environ["FP8RL_AUTOTUNE"] = "on"
os.environ["FP8RL_AUTOTUNE_CACHE"] = os.path.join(OUT, "autotuning")
os.environ.setdefault("FP8RL_AUTOTUNE_BUDGET_S", "45")

import jax  # noqa: E402


def record(**row):
    """Append one measurement to $OUT/results.jsonl (flushed at once) and print it."""
    row.update(device=jax.devices()[0].device_kind, jax=jax.__version__, time=time.time())
    with open(os.path.join(OUT, "results.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def main():
    from fp8rl_jax.kernels import decode_gemm_mgpu as dg
    from fp8rl_jax.kernels import tuner

    if jax.devices()[0].platform != "gpu":
        record(what="skipped", reason="no GPU")
        return
    tuner.set_progress(lambda line: print(line, flush=True))
    for m in (1, 8, 32):
        for name, n, k in dg.QWEN3_8B_DECODE:
            cfg = dg.tuned_config(n, k, m)
            record(what="autotune_decode_gemm", shape=name, n=n, k=k, m=m, chosen=dg._config_name(cfg))
    print(tuner.format_report(), flush=True)
    record(what="report", report=tuner.report())


if __name__ == "__main__":
    main()
