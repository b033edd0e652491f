"""Seconds per weight sync, stage by stage, next to a plain memcpy of the same bytes measured in the same run.

For each model (``135m``: the real SmolLM2-135M-Instruct; ``0.6b`` / ``8b``: Qwen3-0.6B / Qwen3-8B shapes with
random weights) the script holds float32 master params in an NNX model, as the trainer does, and times:

* ``walk``: :func:`fp8rl_jax.models.decoder.named_params` (the NNX graph walk the trainer did every step) and
  ``walk_cached``: :class:`fp8rl_jax.export.ModelParamsReader` (walk once, read the Variables each step: what
  ``RLTrainer.export`` does now);
* ``export``: :func:`fp8rl_jax.export.export_weights` FP8 blockwise (e4m3 linears + fp32 ``weight_scale_inv``, bf16
  embeddings/norms), finiteness check included, until the arrays are ready; ``export_old``: the exporter of
  b0c9d22 rebuilt here (a separate finiteness program + host sync, then one program that stacks same-shaped
  linears, quantizes the stacks and slices them per layer), in the same run;
* ``handover``: :func:`rollout_bridge.dlpack.torch_sync_tensors` (wait for the arrays, one DLPack view per tensor,
  layer order);
* ``inprocess``: :class:`~rollout_bridge.transports.InProcessTransport` to a
  :class:`rollout_bridge.torch_receiver.TorchParamsReceiver` in this process, which copies every tensor into its
  own preallocated torch parameters (one byte copy per tensor: ``memcpy`` on CPU, a device copy on GPU);
* ``shm``: :class:`~rollout_bridge.transports.SharedMemoryTransport` with its defaults (CPU: streamed through a
  ring of 512 KiB slots in shared memory, :class:`~rollout_bridge.transports.ShmRingStream`, which the receiver
  empties right behind the sender, so the bytes pass between the two copies in the caches; CUDA IPC on GPU) to a
  ``TorchParamsReceiver`` in another process; on CPU also ``shm_buckets`` (``ring=False``: streamed 64 MiB
  payload-sized buckets, the receiver copies bucket k while the sender fills k+1, what receivers that keep views,
  like vLLM's, get) and ``shm_unstreamed`` (``stream=False``: fill everything, then load);
* ``dist``: :class:`~rollout_bridge.transports.TorchDistributedTransport` (gloo broadcast on CPU, NCCL on GPU)
  to the same kind of receiver process (``dist_streamed``: one bucket at a time above 2 GiB);
* ``floor``: one plain copy of ``payload`` bytes between two preallocated, already-touched buffers (GPU: one
  ``torch`` device copy; CPU: one ``numpy.copyto`` on one thread, the memcpy floor, which glibc does with
  non-temporal stores at this size) and ``floor_threads``: the same bytes split over
  :func:`rollout_bridge.transports.copy_many`'s threads (CPU; with two threads each half is still large enough
  for non-temporal stores, so this is the host's copy bandwidth; whole 0.3-3 MiB tensors are copied with
  ordinary stores, below it, which is why ``copy_many`` cuts every copy into 512 KiB ``rep movsb`` pieces that
  its threads take in turn), and ``tensor_copy``: the same bytes copied
  tensor by tensor with a dtype-typed ``torch`` ``copy_`` (what vLLM's weight loaders do with each tensor; on
  CPU about half of ``memcpy``'s bandwidth on one thread);
* ``vllm`` (with ``--vllm``, 135m only on CPU): ``VllmRolloutEngine.update_weights`` into a real in-process vLLM
  (in-process transport) and ``vllm_transfer`` the same through vLLM's weight-transfer API
  (:class:`rollout_bridge.vllm_transfer.VllmWeightTransferTransport`: vLLM's NCCL engine on CUDA, our gloo engine
  on CPU), with its achieved bandwidth ``vllm_transfer_GB_per_s``.

Ratios: ``inprocess_x_floor = (handover + inprocess) / floor`` and ``shm_x_floor = (handover + shm) / floor``
(the sync once the export exists; issue 18's goals on CPU: <= 1.2 and <= 2; likewise ``shm_buckets_x_floor``,
``shm_unstreamed_x_floor``); ``export_x_floor = export / floor`` (the FP8 quantization reads the float32 masters,
3-4x the payload's bytes, and computes, so it is not bounded by this floor on CPU). Each value is the median of
``--repeats`` after one warm-up. On CPU the floors and the shm variants are measured in ``--rounds`` interleaved
rounds (floor, threaded floor, shm, shm buckets, shm unstreamed, again and again) and each is the median over the
rounds, so a load that comes and goes hits them alike; ``other_load_cores`` is the CPU time other processes on the
host used during those rounds, in cores (``/proc/stat`` busy time minus this process's and the receiver's): 0 on a
quiet machine, up to the core count when something else competes.

Platform: whatever is present. With a CUDA GPU visible to both JAX and torch every array lives on
``jax.devices("gpu")[0]`` and the copies are device copies (synchronized before the clock stops); otherwise CPU
(``torch`` single-threaded for the receivers, as vLLM-CPU serves). Nothing sets ``JAX_PLATFORMS``.

Memory: the masters (float32: 4 bytes/param) must fit next to the payload and the receivers' copies; sizes whose
masters do not fit (8B on a 24 GiB host: 33 GB) time the transports on a payload exported one layer at a time
from bf16 and report ``export_skipped`` (walk and export are then measured only where they fit, e.g. on an 80 GB
GPU). ``export_old`` is run where the old stacks (one more float32 copy of every linear) also fit.

Usage:
  python benchmarks/bench_weight_sync.py                       # 135m, 0.6b (CPU: ~3 min)
  python benchmarks/bench_weight_sync.py --sizes 0.6b,8b       # what benchmarks/run_gpu.sh runs
  python benchmarks/bench_weight_sync.py --sizes 135m --vllm   # + the real vLLM path
Results: benchmarks/results/weight_sync_cpu.{json,md} (GPU: weight_sync_gpu_<device>.{json,md}).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from fp8rl_jax.export import export_weights  # noqa: E402
from fp8rl_jax.models.config import hf_param_shapes  # noqa: E402
from _common import cpu_description, median_seconds, qwen3_config, random_param_groups  # noqa: E402
from rollout_bridge.transports import (InProcessTransport, SharedMemoryTransport, TorchDistributedTransport,  # noqa: E402
                                       ProcessReceiver, copy_many)
from rollout_bridge.torch_receiver import TorchParamsReceiver  # noqa: E402

class _Local:
    name = "local"

    def __init__(self, obj):
        self.obj = obj

    def call(self, method, *args):
        import concurrent.futures

        f = concurrent.futures.Future()
        f.set_result(getattr(self.obj, method)(*args))
        return f


def _serve_copy_receiver() -> TorchParamsReceiver:
    """The benchmark's receiver process: one torch thread, as vLLM-CPU serves."""
    import torch

    torch.set_num_threads(1)
    return TorchParamsReceiver()


def _masters(size: str, device: str, mem_limit: int | None):
    """``(cfg, model or None, why_not)``: an NNX CausalLM holding float32 masters of ``size``, or None (+ reason)
    when 4 bytes/param plus ~3 payloads do not fit in ``mem_limit`` bytes."""
    from fp8rl_jax.models.loading import build_model

    if size == "135m":
        from fp8rl_jax.models.loading import load_checkpoint

        cfg, params = load_checkpoint("smollm2-135m-instruct")
        return cfg, build_model(cfg, params, param_dtype="float32"), None
    cfg = qwen3_config(size)
    nparams = sum(int(np.prod(s)) for s in hf_param_shapes(cfg).values())
    need = 4 * nparams + 3 * nparams  # masters + (payload ~1 B/param) x 3: export, receiver, segments
    if mem_limit is not None and need > 0.9 * mem_limit:
        return cfg, None, (f"float32 masters + payloads need ~{need / 2**30:.0f} GiB, "
                           f"{mem_limit / 2**30:.0f} GiB available on {device}")
    params = {}
    for g in random_param_groups(cfg):
        params.update({k: v.astype(jnp.float32) for k, v in g.items()})
    model = build_model(cfg, params, param_dtype="float32")
    del params
    return cfg, model, None


def exported_by_layer(cfg):
    """ExportedWeights of random Qwen3-shaped bf16 weights exported one decoder layer at a time (the payload of a
    model whose masters do not fit: the bf16 copy of an 8B model, 16 GB, never exists at once)."""
    from fp8rl_jax.rollout.types import ExportedWeights

    tensors, first = {}, None
    for params in random_param_groups(cfg):
        first = export_weights(params, "fp8_blockwise")
        tensors.update(jax.block_until_ready(first.tensors))
        del params
    return ExportedWeights(tensors=dict(sorted(tensors.items())), format=first.format,
                           block_size=first.block_size, version=first.version, metadata=first.metadata)


def old_export(params: dict):
    """The exporter of b0c9d22, for comparison in the same run: a separate finiteness program + host sync, then
    one program that stacks same-shaped linears, quantizes each stack and slices it per layer."""
    from fp8rl_jax import export as ex

    finite = jax.device_get(_old_finite_flags(params))
    assert all(bool(v) for v in finite.values())
    out, _ = ex._export(params, "fp8_blockwise", 128, False, (), check=False, stack=True)
    return out


@jax.jit
def _old_finite_flags(params):
    return {k: jnp.all(jnp.isfinite(v)) for k, v in params.items()}


def time_it(fn, repeats: int, sync=None) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` calls after one warm-up (``sync()`` before the clock stops)."""
    def once():
        out = fn()
        if sync is not None:
            sync()
        return out

    once()  # warm-up (compiles)
    return median_seconds(once, repeats)


def _shm_fits(nbytes: int) -> bool:
    """Whether the CPU shm rounds fit next to the sender's arrays: two floor buffers, the segments of the two
    payload-sized variants and the receiver's copy, ~5 payloads."""
    avail = _mem_available_bytes()
    return avail is None or 5 * nbytes < 0.9 * avail


def _cpu_seconds(pid: int | str = "self") -> float:
    """utime + stime of a process (all its threads), seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _busy_seconds() -> float:
    """CPU seconds all processes of the host spent busy (``/proc/stat``, every core)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def _interleaved(timers: dict, n_rounds: int, receiver_pid: int | None = None) -> dict:
    """Run every timer of ``timers`` once per round, ``n_rounds`` rounds; each key's median over the rounds, its
    per-round values (``<key>_rounds``) and ``other_load_cores``: CPU time other processes took meanwhile, in cores."""
    import statistics
    import time

    got = {k: [] for k in timers}
    own0 = _cpu_seconds() + (_cpu_seconds(receiver_pid) if receiver_pid else 0.0)
    busy0, t0 = _busy_seconds(), time.monotonic()
    for _ in range(max(1, n_rounds)):
        for k, timer in timers.items():
            got[k].append(timer())
    own = _cpu_seconds() + (_cpu_seconds(receiver_pid) if receiver_pid else 0.0) - own0
    out = {k: statistics.median(v) for k, v in got.items()}
    out.update({k.removesuffix("_s") + "_rounds_s": v for k, v in got.items()})
    out["other_load_cores"] = max(0.0, _busy_seconds() - busy0 - own) / (time.monotonic() - t0)
    return out


def bench_size(size: str, repeats: int, with_vllm: bool, device: str, compare_old: str, skip: set,
               n_rounds: int = 1) -> dict:
    import torch

    from fp8rl_jax.export import ModelParamsReader
    from fp8rl_jax.models.decoder import named_params
    from rollout_bridge.dlpack import torch_sync_tensors

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else None
    mem = _device_mem_bytes() if cuda else _mem_available_bytes()
    cfg, model, why = _masters(size, device, mem)
    nparams = sum(int(np.prod(s)) for s in hf_param_shapes(cfg).values())
    row = {"size": size, "params_M": nparams / 1e6}
    if model is not None:
        reader = ModelParamsReader(model)
        masters = reader()
        row["masters_MB"] = sum(int(v.nbytes) for v in masters.values()) / 2**20
        row["walk_s"] = time_it(lambda: named_params(model), repeats)
        row["walk_cached_s"] = time_it(reader, repeats)
        w = export_weights(masters, "fp8_blockwise")
        row["export_s"] = time_it(lambda: jax.block_until_ready(export_weights(reader(), "fp8_blockwise").tensors),
                                  repeats)
        old_fits = mem is None or 2 * 4 * nparams + 2 * nparams < 0.9 * mem
        if compare_old == "on" or (compare_old == "auto" and old_fits):
            ref = jax.block_until_ready(old_export(masters))
            same = all(np.array_equal(np.asarray(ref[k]).view(np.uint8), np.asarray(w.tensors[k]).view(np.uint8))
                       for k in ref)
            row["export_old_bit_identical"] = bool(same)
            del ref
            row["export_old_s"] = time_it(lambda: jax.block_until_ready(old_export(masters)), repeats)
            row["export_speedup"] = row["export_old_s"] / row["export_s"]
        del masters
    else:
        row["export_skipped"] = why
        print(f"  export not timed for {size}: {why}", flush=True)
        w = exported_by_layer(cfg)
    del model
    nbytes = w.nbytes
    row["handover_s"] = time_it(lambda: torch_sync_tensors(w, "native"), repeats)
    tensors, _ = torch_sync_tensors(w, "native")
    row.update(tensors=len(tensors), payload_MB=nbytes / 2**20)

    # the floor: one copy of the payload's bytes between preallocated, touched buffers
    if cuda:
        a = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        b.copy_(a)
        row["floor_s"] = time_it(lambda: b.copy_(a), repeats, sync)
        del a, b
    else:  # timed below, interleaved with the shm variants
        a = np.ones(nbytes, np.uint8)
        b = np.zeros_like(a)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        rounds = {"floor_1thread_s": lambda: time_it(lambda: np.copyto(b, a), repeats),
                  "floor_threads_s": lambda: time_it(lambda: copy_many([(tb, ta)]), repeats)}
    dst = {k: torch.empty_like(v) for k, v in tensors.items()}
    row["tensor_copy_s"] = time_it(lambda: [dst[k].copy_(v) for k, v in tensors.items()], repeats, sync)
    del dst
    if not cuda and ("shm" in skip or not _shm_fits(nbytes)):  # no shm rounds: the floors alone
        row.update(_interleaved(rounds, n_rounds))
        del a, b, ta, tb
    local = [_Local(TorchParamsReceiver())]
    inproc = InProcessTransport()
    row["inprocess_s"] = time_it(lambda: inproc.send(tensors, {}, 1, local), repeats, sync)
    del local
    proc = None if {"shm", "dist"} <= skip else ProcessReceiver(_serve_copy_receiver)
    try:
        # shm holds the whole payload in shared memory while the receiver process holds its own copy: three
        # payloads at once (sender's arrays, segments, receiver). Skip it where that does not fit (8B on 24 GiB).
        need, avail = 2 * nbytes, _mem_available_bytes()
        if "shm" in skip:
            pass
        elif cuda:
            shm = SharedMemoryTransport()
            try:
                row["shm_s"] = time_it(lambda: shm.send(tensors, {}, 1, [proc], 600), repeats)
                row["shm_mode"], row["shm_nbuckets"] = shm.last_mode, shm.last_buckets
            finally:
                shm.close()
        elif _shm_fits(nbytes):
            # default (ring, negotiated with the TorchParamsReceiver), payload-sized streamed buckets (ring=False:
            # what a receiver that keeps views gets), unstreamed (fill everything, then load)
            shms = {"shm_s": SharedMemoryTransport(), "shm_buckets_s": SharedMemoryTransport(ring=False),
                    "shm_unstreamed_s": SharedMemoryTransport(stream=False)}
            try:
                for key, shm in shms.items():
                    rounds[key] = (lambda shm=shm: time_it(lambda: shm.send(tensors, {}, 1, [proc], 600), repeats))
                row.update(_interleaved(rounds, n_rounds, proc.proc.pid))
                row["shm_mode"], row["shm_nbuckets"] = shms["shm_s"].last_mode, shms["shm_s"].last_buckets
                row["shm_buckets_mode"] = shms["shm_buckets_s"].last_mode
            finally:
                for shm in shms.values():
                    shm.close()
                del a, b, ta, tb
        else:
            row["shm_skipped"] = (f"needs {need / 2**30:.1f} GiB more host memory (segments + receiver copy), "
                                  f"{avail / 2**30:.1f} GiB available")
            print(f"  shm skipped for {size}: {row['shm_skipped']}", flush=True)
        if "dist" not in skip:
            dist = TorchDistributedTransport(backend="nccl" if cuda else "gloo", timeout_s=600)
            row["dist_s"] = time_it(lambda: dist.send(tensors, {}, 1, [proc], 600), repeats)
            row["dist_streamed"] = nbytes > dist.stream_threshold_bytes  # one bucket at a time above 2 GiB
            dist.close()
    finally:
        if proc is not None:
            proc.close()
    if with_vllm:
        from rollout_bridge.vllm_engine import VllmRolloutEngine

        eng = VllmRolloutEngine(cfg, w, kv_cache_memory_bytes=64 << 20, max_model_len=512)
        row["vllm_target"] = eng.weight_target
        row["vllm_s"] = time_it(lambda: eng.update_weights(w), repeats)
        row["vllm_payload_MB"] = eng.last_sync.nbytes / 2**20
        # the same engine through vLLM's own weight-transfer API (NCCL on CUDA, our gloo engine on CPU)
        from rollout_bridge.vllm_transfer import VllmWeightTransferTransport

        inproc_transport, eng.transport = eng.transport, VllmWeightTransferTransport()
        row["vllm_transfer_s"] = time_it(lambda: eng.update_weights(w), repeats)
        row["vllm_transfer_backend"] = eng.transport.backend
        row["vllm_transfer_GB_per_s"] = eng.last_sync.gb_per_s
        eng.transport.close()
        eng.transport = inproc_transport
        eng.close()
    if not cuda:
        row["floor_s"] = row["floor_1thread_s"]
    f = row["floor_s"]
    row["inprocess_x_floor"] = (row["handover_s"] + row["inprocess_s"]) / f
    if "floor_threads_s" in row:
        row["inprocess_x_floor_threads"] = (row["handover_s"] + row["inprocess_s"]) / row["floor_threads_s"]
    for k in ("shm", "shm_buckets", "shm_unstreamed"):
        if k + "_s" in row:
            row[k + "_x_floor"] = (row["handover_s"] + row[k + "_s"]) / f
    if "dist_s" in row:
        row["dist_x_floor"] = (row["handover_s"] + row["dist_s"]) / f
        row["dist_GB_per_s"] = nbytes / row["dist_s"] / 1e9  # achieved broadcast bandwidth (payload / wall)
    if "export_s" in row:
        row["export_x_floor"] = row["export_s"] / f
        row["step_inprocess_s"] = row["walk_cached_s"] + row["export_s"] + row["handover_s"] + row["inprocess_s"]
    return row


def _device_mem_bytes() -> int | None:
    """bytes_limit of JAX's first GPU (what its allocator may use), None where unknown."""
    try:
        return int(jax.devices("gpu")[0].memory_stats()["bytes_limit"])
    except Exception:  # noqa: BLE001
        return None


def _pick_device() -> str:
    """``"cuda"`` when both torch and JAX see a CUDA GPU, else ``"cpu"`` (says so when only one of them does)."""
    import torch

    try:
        jax_gpu = bool(jax.devices("gpu"))
    except RuntimeError:
        jax_gpu = False
    if jax_gpu and torch.cuda.is_available():
        return "cuda"
    if jax_gpu or torch.cuda.is_available():
        print(f"warning: a GPU is visible to {'JAX' if jax_gpu else 'torch'} only; measuring the CPU", flush=True)
    return "cpu"


COLS = [("size", "size"), ("payload_MB", "payload MB"), ("floor_s", "floor"), ("floor_threads_s", "floor (threads)"),
        ("export_s", "export"),
        ("export_old_s", "export (old)"), ("walk_s", "graph walk"), ("walk_cached_s", "cached walk"),
        ("handover_s", "DLPack handover"), ("tensor_copy_s", "per-tensor copy"), ("inprocess_s", "in-process"),
        ("inprocess_x_floor", "in-process x floor"), ("inprocess_x_floor_threads", "in-process x floor (threads)"),
        ("shm_s", "shm"), ("shm_x_floor", "shm x floor"),
        ("shm_buckets_s", "shm buckets"), ("shm_buckets_x_floor", "shm buckets x floor"),
        ("shm_unstreamed_s", "shm unstreamed"), ("shm_unstreamed_x_floor", "shm unstreamed x floor"),
        ("dist_s", "dist"), ("dist_x_floor", "dist x floor"), ("dist_GB_per_s", "dist GB/s"), ("vllm_s", "vllm"), ("vllm_transfer_s", "vllm weight-transfer API"),
        ("other_load_cores", "other load (cores)")]


def _table(rows) -> str:
    def fmt(r, c):
        v = r.get(c)
        if isinstance(v, float):
            if c == "other_load_cores":
                return f"{v:.2f}"
            return f"{v:.3g}" if "_x_floor" in c or c in ("payload_MB", "dist_GB_per_s") else f"{v * 1e3:.1f}"
        return "-" if v is None else str(v)

    lines = ["| " + " | ".join(h for _, h in COLS) + " |", "|" + "---|" * len(COLS)]
    lines += ["| " + " | ".join(fmt(r, c) for c, _ in COLS) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="135m,0.6b", help="comma list of 135m, 0.6b, 8b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5,
                    help="CPU: interleaved rounds of the floors and the shm variants (medians over the rounds)")
    ap.add_argument("--vllm", action="store_true", help="also time a real vLLM engine's update_weights")
    ap.add_argument("--compare-old", choices=("auto", "on", "off"), default="auto",
                    help="also time b0c9d22's exporter (auto: where its stacks fit in memory)")
    ap.add_argument("--skip", default="", help="comma list of transports not to run: shm, dist")
    ap.add_argument("--out", default=None)
    ap.add_argument("--_size", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    import torch

    device = _pick_device()
    if device == "cpu":
        torch.set_num_threads(1)  # the receivers' copies run single-threaded, as vLLM-CPU serves
    name = torch.cuda.get_device_name() if device == "cuda" else cpu_description()
    skip = {s for s in args.skip.split(",") if s}
    if args._size:  # child: one size, in a fresh process, JAX arrays explicitly on the device torch uses
        with jax.default_device(jax.devices("gpu" if device == "cuda" else "cpu")[0]):
            row = bench_size(args._size, args.repeats, args.vllm and (args._size == "135m" or device == "cuda"),
                             device, args.compare_old, skip, args.rounds)
        print("ROW " + json.dumps(row), flush=True)
        return
    rows = []
    for size in args.sizes.split(","):
        if size not in ("135m", "0.6b", "8b"):
            raise SystemExit(f"unknown size {size!r}; expected 135m, 0.6b or 8b")
        # each size in its own process: an 8B run needs its memory without the smaller sizes' leftovers
        cmd = [sys.executable, os.path.abspath(__file__), f"--_size={size}", f"--repeats={args.repeats}",
               f"--rounds={args.rounds}",
               f"--compare-old={args.compare_old}", f"--skip={args.skip}", *(["--vllm"] if args.vllm else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        found = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
        if proc.returncode or not found:
            raise SystemExit(f"{size}: benchmark process failed (rc {proc.returncode}; -9 = out of memory):\n"
                             f"{proc.stderr[-2000:]}")
        rows.append(json.loads(found[-1][4:]))
        print(json.dumps(rows[-1]), flush=True)
    table = _table(rows)
    notes = [f"{r['size']}: shm not run, {r['shm_skipped']}." for r in rows if "shm_skipped" in r]
    notes += [f"{r['size']}: export not timed, {r['export_skipped']}; transports timed on a payload exported one "
              "layer at a time from bf16." for r in rows if "export_skipped" in r]
    notes += [f"{r['size']}: new export output bit-identical to the old exporter's: {r['export_old_bit_identical']}"
              for r in rows if "export_old_bit_identical" in r]
    if notes:
        table += "\n\n" + "\n".join(notes)
    print(f"\nweight sync, {device} ({name}), milliseconds (median of {args.repeats}) and ratios\n{table}")
    res = {"benchmark": "bench_weight_sync", "device": {"kind": device, "name": name, "cpu_count": os.cpu_count(),
                                                        "torch": torch.__version__, "jax": jax.__version__},
           "command": " ".join(["benchmarks/bench_weight_sync.py", *(argv or sys.argv[1:])]), "rows": rows}
    slug = "cpu" if device == "cpu" else "gpu_" + "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"weight_sync_{slug}")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(res, f, indent=2)
    with open(out + ".md", "w") as f:
        f.write(f"# Weight sync per step, stage by stage ({device}: {name})\n\n"
                f"Milliseconds, median of {args.repeats} after a warm-up; `x floor` = (DLPack handover + transport) / "
                "one plain copy of the payload's bytes measured in the same run"
                + (f"; on CPU the floors and the shm variants are medians over {args.rounds} interleaved rounds, "
                   "`other load (cores)` is the CPU other processes used meanwhile" if device == "cpu" else "")
                + f". Stages: see the script's docstring.\n\n{table}\n\n`{res['command']}`\n")
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
