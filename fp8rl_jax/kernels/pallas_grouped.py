"""Grouped (ragged) W8A8 blockwise FP8 GEMM for MoE experts: ``jax.lax.ragged_dot`` semantics on e4m3 weights.

Why (issue 21): the MoE block ran its experts as ``ragged_dot`` on *dequantized* FP8 weights, so an FP8 rollout
read every expert's e4m3 bytes, wrote them back as bf16 and read them again: more traffic than bf16 itself. This
kernel reads the e4m3 expert weights and their 128x128 ``scale_inv`` directly, like vLLM's ``fused_moe`` with
``block_shape=[128, 128]``:

- rows of ``x`` are grouped by expert (contiguous, sizes ``group_sizes``: the layout :func:`jax.lax.ragged_dot`
  takes); a static schedule of row tiles (at most ``ceil(T/bm) + E`` of them, each inside one group) is built in
  XLA from ``group_sizes``; the grid is ``(tiles, N/bn)``;
- each program loads its tile's rows (masked to its group), quantizes them to e4m3 in 1x128 groups exactly as
  vLLM's ``QuantFP8(group_shape=(1, 128))`` native path (the helpers of
  :func:`fp8rl_jax.fp8.quantize_activation_groupwise`), multiplies e4m3 x e4m3 per 128-wide K block with float32
  accumulation, applies activation and weight scales to each block's partial sum (DeepGEMM promotion), and stores
  only its group's rows; empty schedule slots do nothing.

Numerics: row for row the same additions in the same order as quantizing the rows and running
:func:`fp8rl_jax.kernels.pallas_gemm.pallas_w8a8_matmul` against that row's expert, so in interpret mode the two are
bit-identical (tested), and equal to a float64 reference of the dequantized operands within float32 rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fp8rl_jax.fp8.formats import BLOCK_SIZE
from fp8rl_jax.kernels.registry import check_close, register_selftest, run_pallas
from fp8rl_jax.kernels.pallas_decode import quantized_block_partial
from fp8rl_jax.kernels.pallas_gemm import selftest_operands, w8a8_reference


def tile_schedule(group_sizes: jax.Array, bm: int, max_tiles: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Row tiles of a grouped matrix, each inside one group: ``(tile_group, tile_start, tile_end)`` int32
    ``[max_tiles]``.

    Tile ``i`` covers rows ``[tile_start[i], min(tile_start[i] + bm, tile_end[i]))`` of group ``tile_group[i]``
    (``tile_end`` = that group's end row). Unused slots have ``tile_start == tile_end`` (no rows).
    ``max_tiles >= ceil(T / bm) + E`` always suffices (each group adds at most one partial tile).
    """
    sizes = group_sizes.astype(jnp.int32)
    e = sizes.shape[0]
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    ntiles = (sizes + bm - 1) // bm  # tiles per group
    last = jnp.cumsum(ntiles)  # one past each group's last tile index (non-decreasing)
    first = last - ntiles
    idx = jnp.arange(max_tiles, dtype=jnp.int32)
    # group of slot i: the number of groups whose tiles all come before i (groups with no tiles are skipped)
    method = "compare_all" if e * max_tiles <= 1 << 24 else "scan"  # no while loop of launches at these sizes
    g = jnp.clip(jnp.searchsorted(last, idx, side="right", method=method), 0, e - 1).astype(jnp.int32)
    local = idx - first[g]
    valid = (local < ntiles[g]) & (idx < jnp.sum(ntiles))
    start = jnp.where(valid, starts[g] + local * bm, 0).astype(jnp.int32)
    end = jnp.where(valid, ends[g], 0).astype(jnp.int32)
    return g, start, end


def _grouped_kernel(tg_ref, ts_ref, te_ref, x_ref, w_ref, ws_ref, o_ref, *, kb, bk, bm, bn, fp8_dtype, fp8_max,
                    ratio, ptx):
    i, j = pl.program_id(0), pl.program_id(1)
    g, r0, r1 = tg_ref[i], ts_ref[i], te_ref[i]

    @pl.when(r0 < r1)
    def _():
        rows = r0 + lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
        live = rows < r1  # [bm, 1]: rows of this tile's group

        def body(kk, acc):
            xk = x_ref[pl.ds(r0, bm), pl.ds(kk * bk, bk)]
            xk = jnp.where(live, xk, jnp.zeros_like(xk))  # rows of the next group must not set this tile's amax
            wk = w_ref[g, pl.ds(j * bn, bn), pl.ds(kk * bk, bk)]
            wsk = ws_ref[g, pl.ds(j // ratio, 1), pl.ds(kk, 1)]  # [1, 1]
            return acc + quantized_block_partial(xk, wk, wsk, fp8_dtype=fp8_dtype, fp8_max=fp8_max, ptx=ptx)

        acc = lax.fori_loop(0, kb, body, jnp.zeros((bm, bn), jnp.float32))
        # a masked store: rows past the group belong to another tile, which may be writing them right now
        plgpu.store(o_ref.at[pl.ds(r0, bm), pl.ds(j * bn, bn)], acc.astype(o_ref.dtype),
                    mask=jnp.broadcast_to(live, (bm, bn)))


@functools.partial(jax.jit, static_argnames=("block_size", "bm", "bn", "out_dtype", "interpret", "num_warps",
                                             "num_stages"))
def _grouped(x, group_sizes, wq, ws, *, block_size, bm, bn, out_dtype, interpret, num_warps, num_stages):
    t, k = x.shape
    e, n, _ = wq.shape
    kb = ws.shape[2]
    kp, np_ = kb * block_size, pl.cdiv(n, bn) * bn
    max_tiles = pl.cdiv(t, bm) + e
    # bm spare rows at the end so a tile's bm-row window never leaves the array (its extra rows are masked)
    x = jnp.pad(x, ((0, bm), (0, kp - k)))
    if (np_, kp) != (n, k):
        wq = jnp.pad(wq, ((0, 0), (0, np_ - n), (0, kp - k)))
    nbs = pl.cdiv(np_, block_size)
    if ws.shape[1] != nbs:
        ws = jnp.pad(ws, ((0, 0), (0, nbs - ws.shape[1]), (0, 0)))
    tg, ts, te = tile_schedule(group_sizes, bm, max_tiles)
    kwargs = {}
    if not interpret:
        kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    out = pl.pallas_call(
        functools.partial(_grouped_kernel, kb=kb, bk=block_size, bm=bm, bn=bn, fp8_dtype=wq.dtype,
                          fp8_max=float(jnp.finfo(wq.dtype).max), ratio=block_size // bn, ptx=not interpret),
        grid=(max_tiles, np_ // bn),
        out_shape=jax.ShapeDtypeStruct((t + bm, np_), out_dtype),
        interpret=interpret,
        name="fp8_w8a8_grouped_gemm",
        **kwargs,
    )(tg, ts, te, x, wq, ws)
    # rows past sum(group_sizes) belong to no tile and were never written
    return jnp.where(jnp.arange(t)[:, None] < jnp.sum(group_sizes), out[:t, :n], jnp.zeros((), out_dtype))


def grouped_w8a8_matmul(x: jax.Array, group_sizes: jax.Array, weight: jax.Array, weight_scale_inv: jax.Array, *,
                        block_size: int = BLOCK_SIZE, out_dtype=None, bm: int = 16, bn: int = BLOCK_SIZE,
                        interpret: bool | None = None, num_warps: int = 4, num_stages: int = 3) -> jax.Array:
    """``out[r] = x[r] @ W[g(r)].T`` for rows grouped by expert, W8A8 blockwise FP8 (``ragged_dot`` layout).

    Args:
      x: ``[T, K]`` float32/bfloat16 rows, sorted so that group ``e``'s rows are contiguous and in group order.
      group_sizes: int ``[E]`` rows per group; ``sum(group_sizes) <= T`` (rows past the sum are left as zeros).
      weight: ``[E, N, K]`` e4m3 expert weights (vLLM/HF layout per expert).
      weight_scale_inv: float32 ``[E, ceil(N/bs), ceil(K/bs)]``.
      block_size: bs (128). bm: rows per tile (power of two >= 16). bn: columns per program (divides bs).
      out_dtype: result dtype (default ``x.dtype``); accumulation is float32.
      interpret: default None: compiled where the program is lowered for CUDA, interpret mode elsewhere.

    Returns:
      ``[T, N]`` in ``out_dtype``.

    Raises:
      ValueError: mismatched shapes or scales, ``bn`` not dividing ``block_size``, ``bm`` not a power of two >= 16.

    Source: ``jax.lax.ragged_dot`` semantics; numerics of vLLM ``fused_moe`` with ``block_shape=[128, 128]``
    (per-token 1x128 activation groups, 128x128 weight blocks, float32 accumulation).
    """
    if x.ndim != 2 or weight.ndim != 3 or x.shape[1] != weight.shape[2]:
        raise ValueError(f"grouped_w8a8_matmul: x {tuple(x.shape)} must be [T, K] and weight {tuple(weight.shape)} "
                         "[E, N, K] with the same K")
    e, n, k = weight.shape
    if tuple(group_sizes.shape) != (e,):
        raise ValueError(f"grouped_w8a8_matmul: group_sizes {tuple(group_sizes.shape)} must be [E={e}]")
    want = (e, -(-n // block_size), -(-k // block_size))
    if tuple(weight_scale_inv.shape) != want:
        raise ValueError(f"grouped_w8a8_matmul: weight_scale_inv {tuple(weight_scale_inv.shape)} must be {want}")
    if block_size % bn:
        raise ValueError(f"bn={bn} must divide block_size={block_size}")
    if bm < 16 or bm & (bm - 1):
        raise ValueError(f"bm={bm} must be a power of two >= 16")
    return run_pallas(_grouped, x, group_sizes.astype(jnp.int32), weight, weight_scale_inv.astype(jnp.float32),
                    block_size=block_size, bm=bm, bn=bn, out_dtype=jnp.dtype(out_dtype or x.dtype),
                    interpret=interpret, num_warps=num_warps, num_stages=num_stages)


def _selftest_grouped_experts(interpret: bool = False) -> None:
    """Self-test of the ``grouped_experts`` family: 40 float32 rows in groups of 7, 0, 20, 13 over 4 experts of
    [200, 300] e4m3 (ragged; an empty group) on the default device against the float64 product of each row with its
    expert (rows quantized on the CPU with vLLM's rounding), to 1e-5 of the sum of |terms|."""
    import numpy as np

    sizes = np.array([7, 0, 20, 13], np.int32)
    ops = [selftest_operands(int(sizes.sum()), 200, 300, seed=2 + e) for e in range(len(sizes))]
    x, xq, xs = ops[0][:3]
    wq, ws = np.stack([o[3] for o in ops]), np.stack([o[4] for o in ops])
    y = grouped_w8a8_matmul(jnp.asarray(x), jnp.asarray(sizes), jnp.asarray(wq), jnp.asarray(ws),
                            out_dtype=jnp.float32, interpret=interpret)
    grp = np.repeat(np.arange(len(sizes)), sizes)
    ref = np.zeros((len(grp), 200))
    bound = np.zeros_like(ref)
    for e in range(len(sizes)):
        r = grp == e
        if r.any():
            ref[r], bound[r] = w8a8_reference(xq[r], xs[r], wq[e], ws[e])
    check_close("grouped expert GEMM 4 experts x [200, 300], groups 7/0/20/13", y, ref, bound, 1e-5)


register_selftest("grouped_experts", _selftest_grouped_experts)


def main(argv=None) -> None:
    """Time the grouped W8A8 expert GEMM (:func:`grouped_w8a8_matmul`) at Qwen3-30B-A3B's expert shapes (128 experts;
    gate/up ``[1536, 2048]`` and down ``[2048, 768]`` per expert) for ``--tokens`` routed rows (default 8,256,2048:
    decode at b = 1 and 32 with 8 experts per token, and a prefill), spread evenly over the experts, against XLA's
    bf16 ``jax.lax.ragged_dot`` on the same rows: microseconds and the e4m3 weight bytes of the experts the rows reach
    over that time (GB/s). On a GPU; ``--smoke`` runs a tiny shape in interpret mode on the CPU (numbers meaningless).

    Raises:
      SystemExit: bad flags (argparse).
    """
    import numpy as np

    from fp8rl_jax.kernels.timing import main_parser, per_call_us, print_table

    p = main_parser("pallas_grouped", main.__doc__, iters=20)
    p.add_argument("--tokens", default="8,256,2048")
    args = p.parse_args(argv)
    if args.smoke:
        experts, shapes, tokens, iters = 4, (("tiny", 128, 256),), (8,), 1
    else:
        experts, shapes = 128, (("gate_up", 1536, 2048), ("down_proj", 2048, 768))
        tokens, iters = [int(t) for t in args.tokens.split(",")], args.iters
    rng = np.random.default_rng(0)
    rows = []
    for name, n, k in shapes:
        w = jnp.asarray(rng.standard_normal((experts, n, k)) * 0.05, jnp.bfloat16)
        wq = w.astype(jnp.float8_e4m3fn)
        w_kn = jnp.swapaxes(w, 1, 2)  # ragged_dot's [E, K, N], made once outside the timed loop
        ws = jnp.ones((experts, -(-n // BLOCK_SIZE), -(-k // BLOCK_SIZE)), jnp.float32)
        for t in tokens:
            x = jnp.asarray(rng.standard_normal((t, k)), jnp.bfloat16)
            sizes = np.full(experts, t // experts, np.int32)
            sizes[: t % experts] += 1
            group_sizes = jnp.asarray(sizes)
            reached = int(np.count_nonzero(sizes))
            kernel_us = per_call_us(
                functools.partial(grouped_w8a8_matmul, out_dtype=jnp.bfloat16, interpret=True if args.smoke else None),
                (x, group_sizes, wq, ws), iters)
            xla_us = per_call_us(jax.lax.ragged_dot, (x, w_kn, group_sizes), iters)
            gb = reached * n * k / 1e9
            rows.append((name, t, reached, kernel_us, gb / kernel_us * 1e6, xla_us, 2 * gb / xla_us * 1e6,
                         xla_us / kernel_us))
    print_table("Grouped W8A8 expert GEMM vs bf16 ragged_dot", ("shape", "rows", "experts hit", "fp8 us", "fp8 GB/s", "bf16 us", "bf16 GB/s", "speedup"), rows)


if __name__ == "__main__":  # pragma: no cover
    main()
