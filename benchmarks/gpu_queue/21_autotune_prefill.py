"""Issue 37 (2, 3): the autotuner's sweep for the engine's prefill GEMMs on this GPU, writing the table to ship.

Runs :func:`fp8rl_jax.kernels.mosaic_gemm.tuned_config` with ``FP8RL_AUTOTUNE=on`` for the Qwen3-8B prefill shapes
at M = 4096 (bf16 output, 128x128 weight blocks): per shape the candidates of
:func:`fp8rl_jax.kernels.mosaic_gemm.candidate_configs` (the 128 x 128 and 64 x 64 tiles, the persistent grid of
one CTA per SM in snake bands of 8 and 16 M tiles, and that grid with two K blocks per step) are compiled, checked against the default's output and timed. The
user cache goes to ``$OUT/autotuning`` (``FP8RL_AUTOTUNE_CACHE``; 30_prefill_gemm_main.sh reads it), the tuner's
report is printed and one JSON line per shape recorded (its ``timings_us`` are the persistent-vs-not A/B). After the
run, copy ``$OUT/autotuning/<device_kind>/<jax>/w8a8_gemm.json`` to
``fp8rl_jax/kernels/data/autotuning/<device_kind>/w8a8_gemm.json`` (the shipped table). Budget: 40 s of tuning (the
queue allows 60 s a script, import and self-test included), the largest shapes first; a cut run's untuned shapes
are tuned again by the next slot's run (each run starts from an empty cache in its own ``$OUT``).
"""

import os

OUT = os.environ.get("OUT", "runs/gpu_queue_local")
os.environ["FP8RL_AUTOTUNE"] = "on"
os.environ["FP8RL_AUTOTUNE_CACHE"] = os.path.join(OUT, "autotuning")
os.environ.setdefault("FP8RL_AUTOTUNE_BUDGET_S", "40")

import jax  # noqa: E402
from _timing import record  # noqa: E402 - the queue's results file; after the tuner's settings above


def main():
    import jax.numpy as jnp

    from fp8rl_jax.kernels import mosaic_gemm as mg
    from fp8rl_jax.kernels import tuner

    print("21_autotune_prefill: start", flush=True)
    if jax.devices()[0].platform != "gpu":
        record(what="skipped", reason="no GPU")
        return
    tuner.set_progress(lambda line: print(line, flush=True))
    m = 4096
    for name, n, k in sorted(mg.QWEN3_8B_PREFILL, key=lambda s: -s[1] * s[2]):
        cfg = mg.tuned_config(m, n, k, jnp.bfloat16)
        record(what="autotune_w8a8_gemm", shape=name, n=n, k=k, m=m, chosen=mg.config_name(cfg))
    print(tuner.format_report(), flush=True)
    record(what="report", report=tuner.report())
    print("21_autotune_prefill: end", flush=True)


if __name__ == "__main__":
    main()
