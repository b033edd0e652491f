"""Blockwise e4m3 weight quantization throughput vs a plain device copy, and Qwen3-8B export time.

For each size (bytes of the bfloat16 input) the script times, in the same run:

* ``copy``: a jitted ``jnp.copy`` of the same array (reads S bytes, writes S bytes into a new buffer) -- the
  device's practical memory-bandwidth ceiling;
* ``quant``: :func:`fp8rl_jax.fp8.quantize_weights_batched` on a stack of weights (reads S bytes of bf16,
  writes S/2 bytes of e4m3 + S/32768 bytes of scales); Pallas on a CUDA GPU, the jnp reference elsewhere.

GB/s = (bytes read + bytes written) / time; ``ratio`` = quant GB/s / copy GB/s (fraction of the bandwidth
limit). Then the time to quantize every linear weight of a Qwen3-8B-shaped model (36 layers; q/k/v/o/gate/up/down
held stacked per shape, one kernel call per shape). On CPU ``--qwen-layers`` (default 1 with ``--quick``)
limits the layers actually quantized and the total is extrapolated linearly (marked in the output).

Usage:
  python benchmarks/bench_quant.py --quick                 # CPU: 1 MB .. 256 MB, 1 Qwen3-8B layer
  python benchmarks/bench_quant.py                         # GPU: 1 MB .. 1 GB, all 36 layers
  python benchmarks/bench_quant.py --sizes 1,16,256 --backend jnp
  python benchmarks/bench_quant.py --sizes 1,4,16 --breakdown   # + the amax and cast passes timed alone
Results: benchmarks/results/quant_<device>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cpu_model  # noqa: E402
from fp8rl_jax.fp8 import quantize_weights_batched  # noqa: E402


QWEN3_8B = dict(layers=36, hidden=4096, intermediate=12288, q_heads=32, kv_heads=8, head_dim=128)


def qwen3_8b_linear_shapes(cfg=QWEN3_8B):
    """``{name: (N, K)}`` of one decoder layer's linear weights (HF ``[out, in]`` layout)."""
    h, i, d = cfg["hidden"], cfg["intermediate"], cfg["head_dim"]
    return {"q_proj": (cfg["q_heads"] * d, h), "k_proj": (cfg["kv_heads"] * d, h), "v_proj": (cfg["kv_heads"] * d, h),
            "o_proj": (h, cfg["q_heads"] * d), "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def device_info():
    dev = jax.devices()[0]
    info = {"platform": dev.platform, "device_kind": dev.device_kind, "jax": jax.__version__,
            "backend_devices": len(jax.devices())}
    if dev.platform == "cpu":
        info.update(cpu_model=cpu_model(), cpu_count=os.cpu_count())
    return info


def device_slug(info):
    if info["platform"] == "cpu":
        return "cpu"
    return info["platform"] + "_" + "".join(c if c.isalnum() else "_" for c in info["device_kind"].lower()).strip("_")


def timeit(fn, *args, repeats=5, min_time=0.2):
    out = fn(*args)
    jax.block_until_ready(out)  # compile + warm up
    times = []
    t_end = time.perf_counter() + min_time
    while len(times) < repeats or (time.perf_counter() < t_end and len(times) < 50):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _breakdown_fns():
    """The jnp quantizer's two passes as separate jitted functions of ``w [L, N, K]`` (N, K multiples of 128):
    the block amax (rows first, then 128-wide groups, as ``quant._quantize_blocks``), the same amax reduced over
    both block axes at once (the earlier formulation, for comparison) and the element pass (scale multiply +
    saturating e4m3 cast, with one fixed reciprocal per block)."""
    from fp8rl_jax.fp8.formats import block_amax, cast_to_e4m3, to_f32_exact

    def amax(w):
        lsz, n, k = w.shape
        rows = block_amax(w.reshape(lsz, n // 128, 128, k), -2)
        return jnp.max(rows.reshape(lsz, n // 128, k // 128, 128), axis=-1)

    def amax_both_axes(w):
        lsz, n, k = w.shape
        return block_amax(w.reshape(lsz, n // 128, 128, k // 128, 128), (-3, -1))

    def cast(w, r):
        lsz, n, k = w.shape
        v = to_f32_exact(w).reshape(lsz, n // 128, 128, k // 128, 128) * r[:, :, None, :, None]
        return cast_to_e4m3(v).reshape(w.shape)

    return jax.jit(amax), jax.jit(amax_both_axes), jax.jit(cast)


def bench_size(mb, backend, repeats, k=4096, breakdown=False):
    n_elems = int(mb * 2**20) // 2
    rows = max(128, (n_elems // k) // 128 * 128)
    layers = 1
    if rows > 8192:  # keep single matrices Qwen-sized; stack the rest as layers
        layers = rows // 8192
        rows = 8192
    w = jax.random.normal(jax.random.key(0), (layers, rows, k), jnp.bfloat16)
    in_bytes = w.size * 2
    copy = jax.jit(jnp.copy)
    t_copy = timeit(copy, w, repeats=repeats)
    quant = jax.jit(lambda a: quantize_weights_batched([a], backend=backend, check=False)[0])
    t_q = timeit(quant, w, repeats=repeats)
    nb = -(-rows // 128) * -(-k // 128) * layers
    q_bytes = in_bytes + w.size + nb * 4
    copy_gbs = 2 * in_bytes / t_copy / 1e9
    q_gbs = q_bytes / t_q / 1e9
    out = {"size_mb": mb, "shape": [layers, rows, k], "input_bytes": in_bytes, "copy_ms": t_copy * 1e3,
           "copy_GBps": copy_gbs, "quant_ms": t_q * 1e3, "quant_GBps": q_gbs, "ratio": q_gbs / copy_gbs}
    if breakdown:
        amax, amax_both_axes, cast = _breakdown_fns()
        r = jnp.full((layers, rows // 128, k // 128), 1.37, jnp.float32)
        out["amax_ms"] = timeit(amax, w, repeats=repeats) * 1e3
        out["amax_both_axes_ms"] = timeit(amax_both_axes, w, repeats=repeats) * 1e3
        out["cast_ms"] = timeit(cast, w, r, repeats=repeats) * 1e3
        out["cast_ns_per_element"] = out["cast_ms"] * 1e6 / w.size
    del w
    return out


def bench_qwen(layers_run, backend, repeats):
    shapes = qwen3_8b_linear_shapes()
    key = jax.random.key(1)
    weights = {}
    for idx, (name, (n, k)) in enumerate(shapes.items()):
        weights[name] = jax.random.normal(jax.random.fold_in(key, idx), (layers_run, n, k), jnp.bfloat16)
    params = sum(v.size for v in weights.values())
    fn = jax.jit(lambda ws: quantize_weights_batched(ws, backend=backend, check=False))
    t = timeit(fn, weights, repeats=repeats, min_time=0.0)
    total_layers = QWEN3_8B["layers"]
    return {"layers_quantized": layers_run, "params_quantized": params, "time_ms": t * 1e3,
            "params_per_layer": params // layers_run,
            "time_all_36_layers_ms": t * 1e3 * total_layers / layers_run,
            "extrapolated": layers_run != total_layers,
            "GBps": (params * 2 + params + params // 16384 * 4) / t / 1e9}


def write_results(name, payload, rows_md):
    out_dir = os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"{name}_{device_slug(payload['device'])}")
    with open(base + ".json", "w") as f:
        json.dump(payload, f, indent=2)
    with open(base + ".md", "w") as f:
        f.write("\n".join(rows_md) + "\n")
    return base


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=None, help="comma-separated input sizes in MB (default 1..1024)")
    p.add_argument("--quick", action="store_true", help="CPU-sized run: sizes up to 256 MB, 1 Qwen3-8B layer")
    p.add_argument("--qwen-layers", type=int, default=None, help="layers of Qwen3-8B to quantize (default 36; 1 with --quick)")
    p.add_argument("--backend", default="auto", choices=["auto", "jnp", "pallas"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--breakdown", action="store_true",
                   help="also time the jnp quantizer's two passes alone (block amax; scale + e4m3 cast)")
    args = p.parse_args(argv)
    sizes = [float(s) for s in args.sizes.split(",")] if args.sizes else (
        [1, 4, 16, 64, 256] if args.quick else [1, 4, 16, 64, 256, 1024])
    qwen_layers = args.qwen_layers or (1 if args.quick else QWEN3_8B["layers"])
    info = device_info()
    on_gpu = jax.default_backend() == "gpu"  # where this benchmark computes (its default device)
    path = "pallas" if (args.backend == "pallas" or (args.backend == "auto" and on_gpu)) else "jnp"
    if path == "pallas" and not on_gpu:
        path = "pallas (interpret)"
    print(f"device: {info}  quantizer: {path}")
    rows = []
    print(f"{'MB':>7} {'shape':>18} {'copy ms':>9} {'copy GB/s':>10} {'quant ms':>9} {'quant GB/s':>11} {'ratio':>6}")
    for mb in sizes:
        r = bench_size(mb, args.backend, args.repeats, breakdown=args.breakdown)
        rows.append(r)
        print(f"{mb:7.0f} {str(tuple(r['shape'])):>18} {r['copy_ms']:9.3f} {r['copy_GBps']:10.2f} "
              f"{r['quant_ms']:9.3f} {r['quant_GBps']:11.2f} {r['ratio']:6.2f}"
              + (f"  (amax {r['amax_ms']:.3f} ms [both axes at once {r['amax_both_axes_ms']:.3f}], cast {r['cast_ms']:.3f} ms = {r['cast_ns_per_element']:.3f} ns/elem)"
                 if "amax_ms" in r else ""))
    qwen = bench_qwen(qwen_layers, args.backend, max(1, args.repeats // 2))
    tag = " (extrapolated x36 from %d layer(s))" % qwen_layers if qwen["extrapolated"] else ""
    print(f"Qwen3-8B linear weights: {qwen['params_quantized'] / 1e6:.0f}M params in {qwen['time_ms']:.1f} ms "
          f"-> all 36 layers {qwen['time_all_36_layers_ms']:.1f} ms{tag}; {qwen['GBps']:.2f} GB/s")
    payload = {"benchmark": "bench_quant", "device": info, "quantizer": path, "command": " ".join(sys.argv),
               "sizes": rows, "qwen3_8b": qwen,
               "targets": {"gpu_ratio_min": 0.70, "gpu_qwen3_8b_ms_max": 20.0, "cpu_ratio_min": 0.30}}
    md = [f"# bench_quant on {info.get('cpu_model', info['device_kind'])} ({info['platform']})", "",
          f"Command: `{payload['command']}`; quantizer: {path}; jax {info['jax']}.", "",
          "| input MB | shape [L,N,K] | copy ms | copy GB/s | quant ms | quant GB/s | quant/copy |",
          "|---:|---|---:|---:|---:|---:|---:|"]
    md += [f"| {r['size_mb']:.0f} | {tuple(r['shape'])} | {r['copy_ms']:.3f} | {r['copy_GBps']:.2f} | {r['quant_ms']:.3f} | "
           f"{r['quant_GBps']:.2f} | {r['ratio']:.2f} |" for r in rows]
    if args.breakdown:
        md += ["", "The jnp quantizer's two passes timed alone (`--breakdown`; same arrays):", "",
               "| input MB | block amax ms (rows first) | amax over both block axes at once ms | "
               "scale + e4m3 cast ms | cast ns / element |", "|---:|---:|---:|---:|---:|"]
        md += [f"| {r['size_mb']:.0f} | {r['amax_ms']:.3f} | {r['amax_both_axes_ms']:.3f} | {r['cast_ms']:.3f} | "
               f"{r['cast_ns_per_element']:.3f} |" for r in rows]
    md += ["", f"Qwen3-8B linear weights (7 per layer, stacked per shape): {qwen['layers_quantized']} layer(s), "
           f"{qwen['params_quantized'] / 1e6:.0f}M params, {qwen['time_ms']:.1f} ms; all 36 layers: "
           f"{qwen['time_all_36_layers_ms']:.1f} ms{tag}."]
    base = write_results("quant", payload, md)
    print(f"wrote {base}.json and {base}.md")


if __name__ == "__main__":
    main()
