"""Template of a queued GPU experiment (skipped by run_gpu.sh: its name starts with "_"). Copy to NN_name.py.

Writes one JSON line per measurement to $OUT/results.jsonl as it goes, so a run cut at 60 s keeps what finished.
"""

import json
import os
import time

import jax

OUT = os.environ.get("OUT", "runs/gpu_queue_local")
os.makedirs(OUT, exist_ok=True)


def record(**row):
    """Append one measurement to $OUT/results.jsonl (flushed at once) and print it."""
    row.update(device=jax.devices()[0].device_kind, jax=jax.__version__, time=time.time())
    with open(os.path.join(OUT, "results.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    record(what="example", value=1.0)
