"""Issue 37: stream-K against split-K for the Qwen3-30B-A3B fused q/k/v decode GEMM (N = 5120, K = 2048) on the GPU.

By arithmetic (``fp8rl_jax.kernels.decode_gemm_mgpu.roofline``) split-K by divisors of the 16 K blocks fills at best
0.81 of a wave on 132 SMs (320 CTAs), stream-K 0.97 (128 CTAs of 5 units), at more loop instructions per byte
(two accumulators: 0.046 against 0.029 at M = 1 in the deviceless sm_90a compile). Only the clock can say which is
faster: this times both in a jitted loop (one dispatch for ``ITERS`` calls), with the bf16 ``dot`` as the roofline
reference, at M = 1, 16 and 64. One JSON line per measurement in $OUT/results.jsonl, written as it goes (40 s
budget). The winner goes into ``choose_config`` (or the shipped autotuning table).
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from _timing import T0, record, timed


def main():
    from fp8rl_jax.fp8 import linear
    from fp8rl_jax.fp8.quant import quantize_activation_groupwise, quantize_weight_blockwise
    from fp8rl_jax.kernels import decode_gemm_mgpu as dg

    if jax.devices()[0].platform != "gpu":
        record(what="skipped", reason="no GPU")
        return
    n, k = 5120, 2048
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((n, k)) * 0.02, jnp.bfloat16)
    wq, ws = quantize_weight_blockwise(w)
    for m in (1, 16, 64):
        if time.time() - T0 > 40:
            record(what="stopped", reason="40 s budget")
            return
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        xq, xs = quantize_activation_groupwise(x)
        ref = linear.w8a8_block_matmul(x, wq, ws, impl="dequant", out_dtype=jnp.float32)
        cands = {"stream_k": dg.choose_config(n, k, m), "split_k": dg.choose_config(n, k, m, stream_k=False)}
        runs = {c: (lambda a, b, cc=cfg: dg.decode_w8a8_matmul(a, b, wq, ws, config=cc), (xq, xs))
                for c, cfg in cands.items()}
        runs["bf16"] = (lambda a: jnp.dot(a, w.T, preferred_element_type=jnp.float32), (x,))
        for cand, (fn, args) in runs.items():
            try:
                s, y = timed(fn, *args)
                nbytes = n * k * (2 if cand == "bf16" else 1)
                record(what="decode_stream_k", n=n, k=k, m=m, candidate=cand, config=str(cands.get(cand, "")),
                       us=round(s * 1e6, 2), tb_s=round(nbytes / s / 1e12, 3),
                       rel_err=float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)))
            except Exception as e:  # noqa: BLE001 - a failing candidate is a result
                record(what="decode_stream_k", m=m, candidate=cand, error=f"{type(e).__name__}: {e}"[:300])


if __name__ == "__main__":
    main()
