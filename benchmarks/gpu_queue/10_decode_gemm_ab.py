"""Issue 37: A/B of the FP8 decode GEMMs at Qwen3-8B shapes on the GPU, in a jitted loop (one dispatch for
``ITERS`` calls, so M = 1 times the kernel, not the launch): the swap-AB Mosaic kernel at its shipped configuration
(``choose_config``) and two neighbours (stages 4, splits doubled), the Triton split-K kernel it replaced
(``impl="fused"``), XLA's dequantize + bf16 dot, and bf16 ``dot_general`` (the roofline reference). Each row: microseconds
per call, weight bytes / time (TB/s), and the relative error against the float64-free XLA dequant path (1e-2
flags a broken candidate). One JSON line per measurement in $OUT/results.jsonl, written as it goes (60 s budget:
M = 1 and 16 on the four shapes first, M = 64 if time remains).
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from _timing import T0, record, timed


def main():
    from fp8rl_jax.fp8 import linear
    from fp8rl_jax.fp8.quant import quantize_activation_groupwise, quantize_weight_blockwise
    from fp8rl_jax.kernels.pallas_decode import fused_w8a8_decode_matmul
    from fp8rl_jax.kernels import decode_gemm_mgpu as dg

    if jax.devices()[0].platform != "gpu":
        record(what="skipped", reason="no GPU")
        return
    rng = np.random.default_rng(0)
    for m in (1, 16, 64):
        for name, n, k in dg.QWEN3_8B_DECODE:
            if time.time() - T0 > 50:
                record(what="stopped", reason="60 s budget")
                return
            w = jnp.asarray(rng.standard_normal((n, k)) * 0.02, jnp.bfloat16)
            wq, ws = quantize_weight_blockwise(w)
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
            xq, xs = quantize_activation_groupwise(x)
            ref = linear.w8a8_block_matmul(x, wq, ws, impl="dequant", out_dtype=jnp.float32)
            base = dg.choose_config(n, k, m)
            cands = {"swapab": base, "swapab_stages4": dataclasses.replace(base, stages=4)}
            if (k // 128) % (2 * base.splits) == 0:
                cands["swapab_splits2x"] = dataclasses.replace(base, splits=2 * base.splits)
            runs = {c: (lambda a, b, cc=cfg: dg.decode_w8a8_matmul(a, b, wq, ws, config=cc), (xq, xs))
                    for c, cfg in cands.items()}
            runs["triton_fused"] = (lambda a: fused_w8a8_decode_matmul(a, wq, ws, out_dtype=jnp.float32), (x,))
            runs["xla_dequant"] = (lambda a: linear.w8a8_block_matmul(a, wq, ws, impl="dequant",
                                                                      out_dtype=jnp.float32), (x,))
            runs["bf16"] = (lambda a: jnp.dot(a, w.T, preferred_element_type=jnp.float32), (x,))
            for cand, (fn, args) in runs.items():
                try:
                    s, y = timed(fn, *args)
                    err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
                    nbytes = n * k * (2 if cand == "bf16" else 1)
                    record(what="decode_gemm", shape=name, n=n, k=k, m=m, candidate=cand,
                           config=str(cands.get(cand, "")), us=round(s * 1e6, 2), tb_s=round(nbytes / s / 1e12, 3),
                           rel_err=err)
                except Exception as e:  # noqa: BLE001 - a failing candidate is a result
                    record(what="decode_gemm", shape=name, m=m, candidate=cand, error=f"{type(e).__name__}: {e}"[:300])


if __name__ == "__main__":
    main()
