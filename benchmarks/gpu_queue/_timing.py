"""What the queued decode-GEMM A/B scripts share (skipped by run_gpu.sh: its name starts with "_"): the results file
and a jitted-loop timer. A script run as ``python benchmarks/gpu_queue/NN_name.py`` finds this module beside it
(Python puts the script's folder first on ``sys.path``)."""

import json
import os
import time

import jax

from fp8rl_jax.kernels.timing import per_call_us

OUT = os.environ.get("OUT", "runs/gpu_queue_local")
os.makedirs(OUT, exist_ok=True)
#: calls per timed loop (one dispatch for all: at M = 1 the loop times the kernel, not the launch)
ITERS = 50
#: when the script started (its first import of this module)
T0 = time.time()


def record(**row):
    """Append one measurement to $OUT/results.jsonl (flushed at once) and print it, with the device kind, the jax
    version and the seconds since :data:`T0`."""
    row.update(device=jax.devices()[0].device_kind, jax=jax.__version__, time=round(time.time() - T0, 1))
    with open(os.path.join(OUT, "results.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def timed(fn, *args):
    """Seconds per call of ``fn(*args)`` inside a ``fori_loop`` of :data:`ITERS` calls (compiled first;
    :func:`fp8rl_jax.kernels.timing.per_call_us`, which keeps XLA from hoisting the call out of the loop), and one
    result of ``jax.jit(fn)(*args)``."""
    return per_call_us(fn, args, ITERS) / 1e6, jax.jit(fn)(*args)
