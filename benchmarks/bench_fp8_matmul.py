"""FP8 (W8A8 blockwise) vs bf16 matmul throughput at Qwen3-8B linear shapes.

Shapes are vLLM's fused Qwen3-8B linears ``(N, K)``: qkv_proj (6144, 4096), o_proj (4096, 4096), gate_up_proj
(24576, 4096), down_proj (4096, 12288); M = tokens (1 = decode, 64, 4096 = prefill/training).

Timed per shape and M (median of repeats, after a compile/warm-up call):

* ``bf16``: ``lax.dot_general`` on bfloat16 operands, float32 accumulation (``preferred_element_type``).
* ``fp8_w8a8``: :func:`fp8rl_jax.fp8.w8a8_block_matmul` on pre-quantized weights (e4m3 + 128x128 scales, the
  rollout/inference path), activations quantized in 1x128 groups inside the call. Implementation ``auto``:
  the Pallas GEMM on a CUDA GPU, dequantize + float32 matmul elsewhere.
* ``fp8_dot_general``: :data:`fp8rl_jax.fp8.fp8_block_dot_general` (both operands quantized on the fly, the
  training path).
* on CPU also ``dequant_then_bf16``: the naive CPU FP8 path the issue compares with -- dequantize the
  pre-quantized weight to bfloat16, then a bfloat16 matmul (activations not quantized); on GPU also ``fp8_blocked`` (per-K-block real e4m3
  ``lax.dot_general``) and ``fp8_tensor`` (per-tensor scales, one real e4m3 GEMM).
* on GPU, for M >= 1024, ``gemm_<bm>x128_w<warps>_s<stages>``: the Pallas GEMM alone on pre-quantized operands
  for each tile config of ``--tiles`` (the GEMM's default tile is untuned; the best config is reported).

TFLOP/s = 2 M N K / time. ``speedup`` = fp8_w8a8 TFLOP/s / bf16 TFLOP/s.

``--loop N``: each timing is one jitted ``lax.fori_loop`` of N calls (:func:`looped`), divided by N, so a small M
measures the kernel rather than the per-call dispatch (0.1-0.5 ms on a GPU: more than an M = 1 GEMM takes);
results go to ``fp8_matmul_loop_<device>``. ``--impls`` keeps only the named implementations (fewer compiles).

Usage:
  python benchmarks/bench_fp8_matmul.py --quick     # CPU: M = 1, 64, 256
  python benchmarks/bench_fp8_matmul.py             # GPU: M = 1, 64, 4096
  python benchmarks/bench_fp8_matmul.py --m 1,64 --shapes qkv_proj,o_proj
  python benchmarks/bench_fp8_matmul.py --m 1,32,4096 --loop 20 --impls fp8_w8a8,fp8_tensor --tiles ""
Results: benchmarks/results/fp8_matmul_<device>.json and .md.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from bench_quant import device_info, timeit, write_results  # noqa: E402

from fp8rl_jax.fp8 import (dequantize_weight_blockwise, make_fp8_dot_general, quantize_weight_blockwise,  # noqa: E402
                           w8a8_block_matmul)
from fp8rl_jax.kernels.pallas_gemm import pallas_w8a8_matmul  # noqa: E402
from fp8rl_jax.fp8.quant import quantize_activation_groupwise  # noqa: E402


QWEN3_8B_FUSED = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (24576, 4096),
                  "down_proj": (4096, 12288)}
DN = (((1,), (0,)), ((), ()))


DEFAULT_TILES = "64:4:3,128:4:3,128:8:3,128:8:4"  # bm:num_warps:num_stages (bn = 128)


def parse_tiles(spec):
    """``"bm:warps:stages,..."`` -> ``[(bm, warps, stages), ...]``; raises ``ValueError`` on a malformed entry."""
    tiles = []
    for item in filter(None, spec.split(",")):
        parts = item.split(":")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"--tiles entry {item!r} is not bm:num_warps:num_stages")
        tiles.append(tuple(int(p) for p in parts))
    return tiles


def looped(fn, n):
    """``fn`` called ``n`` times in one jitted ``lax.fori_loop``; returns the last call's output.

    Each call must depend on the one before, or XLA hoists a loop-invariant call out of the loop (an
    ``optimization_barrier`` on the arguments does not stop it on XLA:CPU). So the first argument (the activations)
    is carried through the loop, and after each call its element ``[0, ..., 0]`` is set to the first element of that
    call's output (cast to its dtype): an in-place one-element update between calls, nothing a timing notices. The
    other arguments (the weights) stay loop-invariant.
    """
    def run(*args):
        out0 = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(fn, *args))

        def body(_, carry):
            a0, _ = carry
            out = fn(a0, *args[1:])
            first = jax.tree.leaves(out)[0]
            return a0.at[(0,) * a0.ndim].set(first[(0,) * first.ndim].astype(a0.dtype)), out

        return jax.lax.fori_loop(0, n, body, (args[0], out0))[1]

    return jax.jit(run)


def bench_one(m, n, k, gpu, repeats, tiles=(), loop=0, impls=None):
    kx, kw = jax.random.split(jax.random.key(m * 7 + n + k))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)  # [K, N] (nnx layout)
    wq, ws = quantize_weight_blockwise(w.T)  # [N, K] e4m3 + [N/128, K/128]
    flops = 2.0 * m * n * k
    fns = {
        "bf16": (jax.jit(lambda a, b: jax.lax.dot_general(a, b, DN, preferred_element_type=jnp.float32)), (x, w)),
        "fp8_w8a8": (jax.jit(lambda a, q, s: w8a8_block_matmul(a, q, s, out_dtype=jnp.float32)), (x, wq, ws)),
        "fp8_dot_general": (jax.jit(lambda a, b: make_fp8_dot_general()(a, b, DN, preferred_element_type=jnp.float32)),
                            (x, w)),
    }
    if gpu:
        fns["fp8_blocked"] = (jax.jit(lambda a, q, s: w8a8_block_matmul(a, q, s, out_dtype=jnp.float32, impl="blocked")),
                              (x, wq, ws))
        # the two Pallas paths side by side (fp8_w8a8 = what "auto" picks at this M)
        fns["fp8_unfused"] = (jax.jit(lambda a, q, s: w8a8_block_matmul(a, q, s, out_dtype=jnp.float32,
                                                                         impl="pallas")), (x, wq, ws))
        if m <= 256:
            fns["fp8_fused_splitk"] = (jax.jit(lambda a, q, s: w8a8_block_matmul(a, q, s, out_dtype=jnp.float32,
                                                                                  impl="fused")), (x, wq, ws))
        tensor_dg = make_fp8_dot_general(scaling="tensor", impl="blocked")
        fns["fp8_tensor"] = (jax.jit(lambda a, b: tensor_dg(a, b, DN, preferred_element_type=jnp.float32)), (x, w))
        if m >= 1024:
            xq, xs = quantize_activation_groupwise(x, check=False)
            for bm, warps, stages in tiles:
                gemm = jax.jit(lambda a, sa, q, s, bm=bm, warps=warps, stages=stages: pallas_w8a8_matmul(
                    a, sa, q, s, bm=bm, bn=128, num_warps=warps, num_stages=stages))
                fns[f"gemm_{bm}x128_w{warps}_s{stages}"] = (gemm, (xq, xs, wq, ws))
    else:
        def dequant_then_bf16(a, q, s):
            wd = dequantize_weight_blockwise(q, s, out_dtype=jnp.bfloat16)
            return jax.lax.dot_general(a, wd, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

        fns["dequant_then_bf16"] = (jax.jit(dequant_then_bf16), (x, wq, ws))
    if impls:
        fns = {name: v for name, v in fns.items() if name in impls}
    out = {}
    for name, (fn, args) in fns.items():
        if loop:
            t = timeit(looped(fn, loop), *args, repeats=repeats, min_time=0.0) / loop
        else:
            t = timeit(fn, *args, repeats=repeats, min_time=0.0)
        out[name] = {"ms": t * 1e3, "TFLOPs": flops / t / 1e12}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", default=None, help="comma-separated M values (default 1,64,4096; --quick: 1,64,256)")
    p.add_argument("--shapes", default=None, help=f"comma-separated subset of {list(QWEN3_8B_FUSED)}")
    p.add_argument("--quick", action="store_true", help="CPU-sized run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiles", default=DEFAULT_TILES,
                   help="GPU, M >= 1024: Pallas GEMM tile configs bm:num_warps:num_stages to time (bn = 128)")
    p.add_argument("--loop", type=int, default=0,
                   help="time N calls in one jitted fori_loop per timing (per-call time = loop time / N); 0 = off")
    p.add_argument("--impls", default=None,
                   help="comma list: time only these implementations (bf16, fp8_w8a8 and, on CPU, "
                        "dequant_then_bf16 always: the speedups need them)")
    args = p.parse_args(argv)
    tiles = parse_tiles(args.tiles)
    impls = {"bf16", "fp8_w8a8", "dequant_then_bf16", *args.impls.split(",")} if args.impls else None
    ms = [int(v) for v in args.m.split(",")] if args.m else ([1, 64, 256] if args.quick else [1, 64, 4096])
    names = args.shapes.split(",") if args.shapes else list(QWEN3_8B_FUSED)
    gpu = jax.default_backend() == "gpu"  # where this benchmark computes (its default device)
    info = device_info()
    print(f"device: {info}; fp8 impl: {'pallas GEMM' if gpu else 'dequantize + float32 matmul'}")
    rows = []
    for name in names:
        n, k = QWEN3_8B_FUSED[name]
        for m in ms:
            r = bench_one(m, n, k, gpu, args.repeats, tiles, loop=args.loop, impls=impls)
            row = {"shape": name, "M": m, "N": n, "K": k, **r,
                   "speedup_w8a8_vs_bf16": r["fp8_w8a8"]["TFLOPs"] / r["bf16"]["TFLOPs"]}
            gemms = {key: v for key, v in r.items() if key.startswith("gemm_")}
            if gemms:
                best = max(gemms, key=lambda key: gemms[key]["TFLOPs"])
                row["best_gemm_tile"] = best
                row["speedup_best_gemm_vs_bf16"] = gemms[best]["TFLOPs"] / r["bf16"]["TFLOPs"]
            if "dequant_then_bf16" in r:
                row["speedup_w8a8_vs_dequant_then_bf16"] = r["fp8_w8a8"]["TFLOPs"] / r["dequant_then_bf16"]["TFLOPs"]
            rows.append(row)
            cols = "  ".join(f"{key} {v['TFLOPs']:.4f} TF/s ({v['ms']:.2f} ms)" for key, v in r.items())
            best = (f"  best GEMM tile {row['best_gemm_tile']}: {row['speedup_best_gemm_vs_bf16']:.2f}x bf16"
                    if "best_gemm_tile" in row else "")
            print(f"{name:>13} M={m:<5} {cols}  w8a8/bf16 {row['speedup_w8a8_vs_bf16']:.2f}x{best}", flush=True)
    impls = {key for r in rows for key, v in r.items() if isinstance(v, dict)}
    impls = [i for i in ["bf16", "fp8_w8a8", "dequant_then_bf16", "fp8_dot_general", "fp8_blocked", "fp8_tensor",
                         "fp8_unfused", "fp8_fused_splitk"]
             if i in impls]
    payload = {"benchmark": "bench_fp8_matmul", "device": info, "command": " ".join(sys.argv), "loop": args.loop,
               "fp8_impl": "pallas" if gpu else "dequant", "rows": rows,
               "targets": {"gpu_fp8_over_bf16_at_M4096_min": 1.3}}
    md = [f"# bench_fp8_matmul on {info.get('cpu_model', info['device_kind'])} ({info['platform']})", "",
          f"Command: `{payload['command']}`; FP8 path: {payload['fp8_impl']}; jax {info['jax']}. TFLOP/s = 2MNK/t.", "",
          "| shape (N, K) | M | " + " | ".join(f"{i} TFLOP/s" for i in impls) + " | w8a8 / bf16 |"
          + (" w8a8 / dequant_then_bf16 |" if not gpu else ""),
          "|---|---:|" + "---:|" * (len(impls) + 1 + (not gpu))]
    for r in rows:
        extra = f" {r['speedup_w8a8_vs_dequant_then_bf16']:.2f} |" if not gpu else ""
        md.append(f"| {r['shape']} ({r['N']}, {r['K']}) | {r['M']} | "
                  + " | ".join(f"{r[i]['TFLOPs']:.4f}" if i in r else "-" for i in impls) + f" | {r['speedup_w8a8_vs_bf16']:.2f} |" + extra)
    tuned = [r for r in rows if "best_gemm_tile" in r]
    if tuned:
        md += ["", "Pallas GEMM alone (pre-quantized operands), best tile per shape at M >= 1024:"]
        md += [f"- {r['shape']} M={r['M']}: {r['best_gemm_tile']} {r['speedup_best_gemm_vs_bf16']:.2f}x bf16"
               for r in tuned]
    base = write_results("fp8_matmul_loop" if args.loop else "fp8_matmul", payload, md)
    print(f"wrote {base}.json and {base}.md")


if __name__ == "__main__":
    main()
