"""Issue 37 (3): the autotuner's sweep for the engine's decode GEMMs on this GPU, writing the table to ship.

Runs :func:`fp8rl_jax.kernels.decode_gemm_mgpu.tuned_config` with ``FP8RL_AUTOTUNE=on`` for the Qwen3-8B decode
shapes at M = 1, 8, 32 (the M buckets of b = 1, 8 and 32 decode), the user cache redirected into
``$OUT/autotuning`` (``FP8RL_AUTOTUNE_CACHE``), then prints the tuner's report and records one JSON line per key. After
the run, copy ``$OUT/autotuning/<device_kind>/<jax>/decode_gemm.json`` to
``fp8rl_jax/kernels/data/autotuning/<device_kind>/decode_gemm.json`` (the shipped table). Budget: 50 s of tuning.
"""

import os

OUT = os.environ.get("OUT", "runs/gpu_queue_local")
os.environ["FP8RL_AUTOTUNE"] = "on"
os.environ["FP8RL_AUTOTUNE_CACHE"] = os.path.join(OUT, "autotuning")
os.environ.setdefault("FP8RL_AUTOTUNE_BUDGET_S", "45")

import jax  # noqa: E402
from _timing import record  # noqa: E402 - the queue's results file; after the tuner's settings above


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
