"""HBM read and copy bandwidth on this device against its datasheet figure (what bench_rollout.py --floor uses).

The floor of a decode step is bytes / HBM read bandwidth; bench_rollout.py takes the datasheet figure and a
measured read (jnp.sum over a large array), the larger of the two. This measures both kinds of traffic at a few
sizes: a read-only reduction (``jnp.sum``) and a copy (read + write, ``x + 0`` into a new buffer), median of 5
after a warm-up, GB/s = 10^9 bytes/s. Writes ``$OUT/hbm_bandwidth.jsonl`` (one line per size, as it goes).
Under 15 s on an H100/H200; on a CPU it runs with small sizes.
"""

import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_rollout import datasheet_bandwidth_GBps  # noqa: E402

OUT = os.environ.get("OUT", "runs/gpu_queue_local/00_hbm_bandwidth")
os.makedirs(OUT, exist_ok=True)


def median_s(f, x, repeats=5):
    """Median seconds of ``f(x)`` (after one warm-up call), waiting for the device."""
    jax.block_until_ready(f(x))
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(x))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main():
    """Measure each size, append its line to $OUT/hbm_bandwidth.jsonl and print it."""
    dev = jax.devices()[0]
    sheet = datasheet_bandwidth_GBps(dev.device_kind) if dev.platform == "gpu" else None
    sizes = [1 << 28, 1 << 30, 1 << 32] if dev.platform == "gpu" else [1 << 24, 1 << 26]
    read, copy = jax.jit(jnp.sum), jax.jit(lambda a: a + 0.0)
    print(f"{dev.device_kind}: datasheet {sheet} GB/s", flush=True)
    for nbytes in sizes:
        x = jax.random.uniform(jax.random.key(0), (nbytes // 4,), jnp.float32)
        r = nbytes / median_s(read, x) / 1e9
        c = 2 * nbytes / median_s(copy, x) / 1e9
        del x
        row = {"device": dev.device_kind, "jax": jax.__version__, "bytes": nbytes, "read_GBps": r,
               "copy_GBps": c, "datasheet_GBps": sheet,
               "read_of_datasheet": r / sheet if sheet else None, "copy_of_datasheet": c / sheet if sheet else None}
        with open(os.path.join(OUT, "hbm_bandwidth.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
