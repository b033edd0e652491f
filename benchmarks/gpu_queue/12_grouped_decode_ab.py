"""Issue 37: A/B of the MoE expert GEMMs at decode, Qwen3-30B-A3B shapes (128 experts; gate 768 x 2048, down
2048 x 768), in a jitted loop: the grouped swap-AB Mosaic kernel (``grouped_decode_w8a8_matmul`` at
``grouped_decode_config``'s configuration, what "auto" runs for decode-sized e4m3 experts since 2026-11-29; timed
with the tile layout, the activation quantization and the gather back that ``SparseMoeBlock`` runs around it), the
Triton grouped kernel it replaced (``grouped_w8a8_matmul``: quantization in its K loop, f16 ``mma.sync``), and bf16
``ragged_dot`` on the same rows (the reference). Routed rows: 8 (one token at top-8) and 256 (32 tokens), experts
drawn at random. Each row: microseconds per call, the used experts' weight bytes / time (TB/s), the relative error
against float32 ``ragged_dot`` (HIGHEST precision) of the dequantized W8A8 operands (the two FP8 kernels: ~1e-6, 1e-3
flags a broken one; bf16 on unquantized operands: ~3e-2, the W8A8 quantization itself). One JSON line per
measurement in $OUT/results.jsonl, as it goes (40 s budget).
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from _timing import T0, record, timed


def main():
    from fp8rl_jax.fp8.formats import ACTIVATION_RECIPE
    from fp8rl_jax.fp8.quant import _quantize_groups, quantize_weight_blockwise
    from fp8rl_jax.kernels import decode_grouped_mgpu as dgm
    from fp8rl_jax.kernels.pallas_grouped import grouped_w8a8_matmul
    from fp8rl_jax.kernels.pallas_quant import quantize_activation_groupwise_dispatch
    from fp8rl_jax.models.grouped import tile_layout

    if jax.devices()[0].platform != "gpu":
        record(what="skipped", reason="no GPU")
        return
    rng = np.random.default_rng(0)
    e = dgm.EXPERTS_30B_A3B
    for rows in (8, 256):
        for name, n, k in dgm.QWEN3_30B_A3B_EXPERTS:
            if time.time() - T0 > 40:
                record(what="stopped", reason="budget")
                return
            w = jnp.asarray(rng.standard_normal((e, n, k)) * 0.02, jnp.bfloat16)
            wq, ws = jax.vmap(quantize_weight_blockwise)(w)
            wd = wq.astype(jnp.float32) * jnp.repeat(jnp.repeat(ws, 128, 1), 128, 2)[:, :n, :k]
            ids = np.sort(np.concatenate([rng.choice(e, 8, replace=False) for _ in range(rows // 8)]))
            sizes = jnp.asarray(np.bincount(ids, minlength=e), jnp.int32)
            used = int((np.asarray(sizes) > 0).sum())
            x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
            m = dgm.decode_tile_rows(rows, e)
            g = dgm.decode_tiles(rows, e, m)

            def swapab(a, sz):  # what SparseMoeBlock._swapab_experts runs for one product, from the sorted rows
                lay = tile_layout(sz, rows, m)
                te = dgm.tile_experts(sz, lay.tile_group, g, m)
                xt = jnp.where(lay.valid[:g * m, None], a[lay.slot_row[:g * m]], 0)
                xq, xs = quantize_activation_groupwise_dispatch(xt)  # the block's quantizer (a kernel on CUDA)
                return dgm.grouped_decode_w8a8_matmul(xq, xs, wq, ws, te, tile_rows=m, num_rows=rows)[lay.row_slot]

            rq, rs = _quantize_groups(x, group_size=128, ue8m0=False, fp8_dtype=jnp.dtype(jnp.float8_e4m3fn),
                                      fp8_max=448.0, recipe=ACTIVATION_RECIPE)
            xdq = rq.astype(jnp.float32) * jnp.repeat(rs, 128, 1)[:, :k]  # the W8A8 operands, dequantized
            ref = jax.lax.ragged_dot(xdq, jnp.swapaxes(wd.astype(jnp.float32), 1, 2), sizes,
                                     preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
            runs = {
                "swapab_grouped": (swapab, (x, sizes)),  # tile layout, quantization, kernel, gather back
                "triton_grouped": (lambda a: grouped_w8a8_matmul(a, sizes, wq, ws, out_dtype=jnp.float32), (x,)),
                "bf16_ragged_dot": (lambda a: jax.lax.ragged_dot(a, jnp.swapaxes(w, 1, 2), sizes,
                                                                 preferred_element_type=jnp.float32), (x,)),
            }
            for cand, (fn, args) in runs.items():
                try:
                    s, y = timed(fn, *args)
                    err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
                    nbytes = used * n * k * (2 if cand.startswith("bf16") else 1)
                    record(what="grouped_decode", shape=name, n=n, k=k, rows=rows, experts_used=used, tile_rows=m,
                           candidate=cand, us=round(s * 1e6, 2), tb_s=round(nbytes / s / 1e12, 3), rel_err=err)
                except Exception as ex:  # noqa: BLE001 - a failing candidate is a result
                    record(what="grouped_decode", shape=name, rows=rows, candidate=cand,
                           error=f"{type(ex).__name__}: {ex}"[:300])


if __name__ == "__main__":
    main()
