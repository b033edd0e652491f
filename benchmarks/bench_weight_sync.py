"""Seconds per weight sync for each transport vs model size, next to a plain copy of the same bytes.

For each model (``135m``: the real SmolLM2-135M-Instruct; ``0.6b`` / ``8b``: Qwen3-0.6B / Qwen3-8B shapes with
random weights) the script exports the weights as the trainer does each step (FP8 blockwise: e4m3 linears +
fp32 ``weight_scale_inv``, bf16 embeddings/norms) and times, in the same run:

* ``copy``: one plain ``copy_`` of every exported tensor into preallocated buffers in this process (the memory
  bandwidth floor for moving these bytes once; torch single-threaded on CPU, as vLLM-CPU runs);
* ``inprocess``: :class:`~rollout_bridge.transports.InProcessTransport` to a receiver in this process that
  copies every tensor into its own parameters (what vLLM's reload does with them);
* ``shm``: :class:`~rollout_bridge.transports.SharedMemoryTransport` (flattened 512 MiB buckets in shared
  memory; CUDA IPC on GPU) to a receiver in another process that copies into its parameters;
* ``dist``: :class:`~rollout_bridge.transports.TorchDistributedTransport` (gloo broadcast on CPU, NCCL on GPU)
  to the same kind of receiver process; above 2 GiB (8B) it streams one bucket at a time, so neither side holds a
  second copy of the payload (``dist_streamed``);
* ``vllm`` (with ``--vllm``, 135m only on CPU): ``VllmRolloutEngine.update_weights`` into a real in-process
  vLLM engine (dequantize to bf16 on CPU + DLPack + ``reload_weights`` + ``reset_prefix_cache``).

Each value is the median of ``--repeats`` syncs after one warm-up sync. The payload is the same bytes for every
column (dense bf16 on the vLLM column on CPU, where FP8 is served dequantized).

Usage:
  python benchmarks/bench_weight_sync.py                       # CPU: 135m, 0.6b
  python benchmarks/bench_weight_sync.py --sizes 135m --vllm   # + the real vLLM path
  python benchmarks/bench_weight_sync.py --sizes 8b              # 8B-shaped: ~20 GB peak host memory on CPU
Results: benchmarks/results/weight_sync_<device>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from fp8rl_jax.export import export_weights  # noqa: E402
from fp8rl_jax.models.config import hf_param_shapes  # noqa: E402
from rollout_bridge.dlpack import jax_to_torch  # noqa: E402
from _common import cpu_model, qwen3_config, random_param_groups  # noqa: E402
from rollout_bridge.transports import (InProcessTransport, SharedMemoryTransport, TorchDistributedTransport,  # noqa: E402
                                       WeightReceiverMixin, order_by_layer)

class CopyReceiver(WeightReceiverMixin):
    """Receiver that copies every tensor into preallocated 'parameters' (stands in for vLLM's reload copy)."""

    def __init__(self):
        self.params = {}

    def _fp8rl_load(self, named, kv_scales, version):
        import torch

        for name, t in named:
            dst = self.params.get(name)
            if dst is None:
                dst = self.params[name] = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            dst.copy_(t)


class _Local:
    name = "local"

    def __init__(self, obj):
        self.obj = obj

    def call(self, method, *args):
        import concurrent.futures

        f = concurrent.futures.Future()
        f.set_result(getattr(self.obj, method)(*args))
        return f


def _serve(conn):
    """Receiver process loop: (method, args) in, result out."""
    import torch

    torch.set_num_threads(1)  # as vLLM-CPU does for serving
    rec = CopyReceiver()
    while True:
        msg = conn.recv()
        if msg is None:
            return
        method, args = msg
        try:
            conn.send(("ok", getattr(rec, method)(*args)))
        except Exception as e:  # noqa: BLE001
            conn.send(("err", f"{type(e).__name__}: {e}"))


class _PipePending:
    def __init__(self, conn):
        self.conn = conn

    def result(self, timeout=None):
        if not self.conn.poll(timeout):
            raise TimeoutError("receiver process did not answer")
        status, val = self.conn.recv()
        if status != "ok":
            raise RuntimeError(val)
        return val


class ProcessReceiver:
    """A receiver in a spawned process, reached over a pipe (one call in flight at a time)."""

    name = "receiver-process"

    def __init__(self):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), daemon=True)
        self.proc.start()

    def call(self, method, *args):
        self.conn.send((method, args))
        return _PipePending(self.conn)

    def close(self):
        self.conn.send(None)
        self.proc.join(30)


def exported_weights(size: str):
    """(config, ExportedWeights) as the trainer exports them each step (FP8 blockwise).

    ``135m`` is the real SmolLM2-135M-Instruct; ``0.6b``/``8b`` are random Qwen3-shaped weights generated and
    exported one decoder layer at a time, so the bf16 copy of an 8B model (16 GB) never exists at once and the
    8B run fits in 24 GiB of host memory (peak: the ~9 GB FP8 payload plus one receiver copy).
    """
    from fp8rl_jax.rollout.types import ExportedWeights

    if size == "135m":
        from fp8rl_jax.models.loading import load_checkpoint

        cfg, params = load_checkpoint("smollm2-135m-instruct")
        return cfg, export_weights({k: jnp.asarray(v, jnp.bfloat16) for k, v in params.items()}, "fp8_blockwise")
    cfg = qwen3_config(size)
    tensors, first = {}, None
    for params in random_param_groups(cfg):
        first = export_weights(params, "fp8_blockwise")
        tensors.update(jax.block_until_ready(first.tensors))
        del params
    return cfg, ExportedWeights(tensors=tensors, format=first.format, block_size=first.block_size,
                                version=first.version, metadata=first.metadata)


def time_it(fn, repeats: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench_size(size: str, repeats: int, with_vllm: bool, device: str) -> dict:
    import torch

    cfg, w = exported_weights(size)
    tensors = {k: jax_to_torch(w.tensors[k]) for k in order_by_layer(w.tensors)}
    if device == "cuda":
        tensors = {k: v.cuda() for k, v in tensors.items()}
    nbytes = w.nbytes
    row = {"size": size, "params_M": sum(int(np.prod(s)) for s in hf_param_shapes(cfg).values()) / 1e6,
           "tensors": len(tensors), "payload_MB": nbytes / 2**20}
    dst = {k: torch.empty_like(v) for k, v in tensors.items()}
    row["copy_s"] = time_it(lambda: [dst[k].copy_(v) for k, v in tensors.items()], repeats)
    del dst
    local = [_Local(CopyReceiver())]
    inproc = InProcessTransport()
    row["inprocess_s"] = time_it(lambda: inproc.send(tensors, {}, 1, local), repeats)
    del local
    proc = ProcessReceiver()
    try:
        # shm holds the whole payload in shared memory while the receiver process holds its own copy: three
        # payloads at once (sender's arrays, segments, receiver). Skip it where that does not fit (8B on 24 GiB).
        need, avail = 2 * nbytes, _mem_available_bytes()
        if device == "cuda" or avail is None or need < 0.9 * avail:
            shm = SharedMemoryTransport()
            try:
                row["shm_s"] = time_it(lambda: shm.send(tensors, {}, 1, [proc], 600), repeats)
            finally:
                shm.close()
        else:
            row["shm_skipped"] = (f"needs {need / 2**30:.1f} GiB more host memory (segments + receiver copy), "
                                  f"{avail / 2**30:.1f} GiB available")
            print(f"  shm skipped for {size}: {row['shm_skipped']}", flush=True)
        dist = TorchDistributedTransport(backend="nccl" if device == "cuda" else "gloo", timeout_s=600)
        row["dist_s"] = time_it(lambda: dist.send(tensors, {}, 1, [proc], 600), repeats)
        row["dist_streamed"] = nbytes > dist.stream_threshold_bytes  # one bucket at a time above 2 GiB
        dist.close()
    finally:
        proc.close()
    if with_vllm:
        from rollout_bridge.vllm_engine import VllmRolloutEngine

        eng = VllmRolloutEngine(cfg, w, kv_cache_memory_bytes=64 << 20, max_model_len=512)
        row["vllm_target"] = eng.weight_target
        row["vllm_s"] = time_it(lambda: eng.update_weights(w), repeats)
        row["vllm_payload_MB"] = eng.last_sync.nbytes / 2**20
        eng.close()
    for k in ("inprocess", "shm", "dist", "vllm"):
        if f"{k}_s" in row:
            row[f"{k}_x_copy"] = row[f"{k}_s"] / row["copy_s"]
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="135m,0.6b", help="comma list of 135m, 0.6b, 8b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vllm", action="store_true", help="also time a real vLLM engine's update_weights")
    ap.add_argument("--out", default=None)
    ap.add_argument("--_size", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)  # the receivers' copies run single-threaded, as vLLM-CPU serves
    name = torch.cuda.get_device_name() if device == "cuda" else cpu_model()
    if args._size:  # child: one size, in a fresh process, JAX arrays explicitly on the device torch uses
        with jax.default_device(jax.devices("gpu" if device == "cuda" else "cpu")[0]):
            row = bench_size(args._size, args.repeats, args.vllm and (args._size == "135m" or device == "cuda"),
                             device)
        print("ROW " + json.dumps(row), flush=True)
        return
    rows = []
    for size in args.sizes.split(","):
        if size not in ("135m", "0.6b", "8b"):
            raise SystemExit(f"unknown size {size!r}; expected 135m, 0.6b or 8b")
        # each size in its own process: an 8B run needs its ~2x payload of host memory without the smaller
        # sizes' (and their vLLM engine's) leftovers
        cmd = [sys.executable, os.path.abspath(__file__), f"--_size={size}", f"--repeats={args.repeats}",
               *(["--vllm"] if args.vllm else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        found = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
        if proc.returncode or not found:
            raise SystemExit(f"{size}: benchmark process failed (rc {proc.returncode}; -9 = out of memory):\n"
                             f"{proc.stderr[-2000:]}")
        rows.append(json.loads(found[-1][4:]))
        print(json.dumps(rows[-1]), flush=True)
    cols = ["size", "payload_MB", "copy_s", "inprocess_s", "shm_s", "dist_s", "vllm_s"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, "-"))
                                       for c in cols) + " |")
    table = "\n".join(lines)
    notes = [f"{r['size']}: shm not run, {r['shm_skipped']}." for r in rows if "shm_skipped" in r]
    if notes:
        table += "\n\n" + "\n".join(notes)
    print(f"\nweight sync, {device} ({name}), median of {args.repeats}\n{table}")
    res = {"benchmark": "bench_weight_sync", "device": {"kind": device, "name": name, "cpu_count": os.cpu_count(),
                                                        "torch": torch.__version__, "jax": jax.__version__},
           "command": " ".join(["benchmarks/bench_weight_sync.py", *(argv or sys.argv[1:])]), "rows": rows}
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"weight_sync_{device}")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(res, f, indent=2)
    with open(out + ".md", "w") as f:
        f.write(f"# Weight sync seconds per step ({device}: {name})\n\n{table}\n\n`{res['command']}`\n")
    print(f"wrote {out}.json / .md")


def _mem_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (bytes), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


if __name__ == "__main__":
    main()
