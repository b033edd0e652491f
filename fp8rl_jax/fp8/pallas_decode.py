"""Fused W8A8 blockwise FP8 linear for decode (small M): activation quantization in the prologue, split-K.

Why (issue 21, shared/GPU.md): a decode step's FP8 linear used to be ~6 kernels (group quantization of the
activation rows, padding, the GEMM, a slice, a cast), and the GEMM grid ``(M/bm, N/128)`` gave 8-96 programs on
132 SMs, so the matrix-vector product ran far below HBM bandwidth. This kernel is one launch per linear:

- each program owns ``bn`` output columns and one of ``splits`` contiguous slices of K (split-K), so the grid
  ``(N/bn, splits)`` fills the GPU even at ``N = 1024``;
- for each 128-wide K block it loads the (tiny, ``bm <= 64`` rows) activation tile, quantizes it to e4m3 in 1x128
  groups exactly as vLLM's ``QuantFP8(group_shape=(1, 128))`` native path does (the same helpers as
  :func:`fp8rl_jax.fp8.quantize_activation_groupwise`: ``s = amax / 448`` with IEEE division, ``max(s, eps)``,
  ``q = cast(clip(x / s))``; PTX ``div.rn.f32`` on the GPU), multiplies e4m3 x e4m3 with float32 accumulation
  and applies both scales to the block's partial product (DeepGEMM/vLLM ``w8a8_block_fp8_matmul``
  promotion);
- the ``splits`` float32 partial sums are added by one small XLA reduction fused with the output cast.

Numerics: with ``splits=1`` the additions happen in exactly the order of the unfused path
(:func:`fp8rl_jax.fp8.pallas_gemm.pallas_w8a8_matmul` after :func:`quantize_activation_groupwise`), so the two are
bit-identical (tested in interpret mode); with ``splits > 1`` only the order of the float32 additions of K-block
partials changes (a relative difference of a few float32 ulps of the row's magnitude: tested against a float64
reference). The e4m3 values and scales are vLLM's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from fp8rl_jax.fp8.formats import ACTIVATION_RECIPE, BLOCK_SIZE, block_amax, compute_scale, scale_values
from fp8rl_jax.fp8.kernels import check_close, register_selftest, run_pallas
from fp8rl_jax.fp8.pallas_gemm import pad_to_tiles, selftest_operands, w8a8_reference

#: The fused kernel is used for ``M <= MAX_DECODE_ROWS`` (decode and small batches); larger M goes to the tiled GEMM.
MAX_DECODE_ROWS = 64
#: Programs to aim for: about two per SM of an H100 (132 SMs).
TARGET_PROGRAMS = 264


def quantized_block_partial(xk, wk, ws_block, *, fp8_dtype, fp8_max, ptx):
    """One 128-wide K block of a W8A8 product inside a kernel: ``xk [bm, bk]`` float activations quantized here in
    1 x bk groups (vLLM ``QuantFP8`` native, the helpers of :func:`fp8rl_jax.fp8.quantize_activation_groupwise`),
    times ``wk [bn, bk]`` e4m3 with float32 accumulation, scaled by the activation scales ``[bm, 1]`` and the weight
    block's ``ws_block [1, 1]``: the float32 ``[bm, bn]`` partial sum the K loop adds (DeepGEMM promotion)."""
    amax = block_amax(xk, 1, keepdims=True, ptx=ptx)  # [bm, 1]
    xs = compute_scale(amax, fp8_max, False, recipe=ACTIVATION_RECIPE, ptx=ptx)
    xq = scale_values(xk.astype(jnp.float32), xs, fp8_dtype, fp8_max, recipe=ACTIVATION_RECIPE, ptx=ptx)
    d = lax.dot_general(xq, wk, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return d * xs * ws_block


def _decode_kernel(x_ref, w_ref, ws_ref, o_ref, *, kb_split, bk, fp8_dtype, fp8_max, ptx):
    """Program (j, s): output columns ``[j*bn, (j+1)*bn)``, K blocks ``[s*kb_split, (s+1)*kb_split)``.

    x_ref ``[bm, kb_split*bk]`` float, w_ref ``[bn, kb_split*bk]`` e4m3, ws_ref ``[1, kb_split]`` float32,
    o_ref ``[bm, bn]`` float32 (this split's partial sum)."""
    bm, bn = o_ref.shape

    def body(i, acc):
        return acc + quantized_block_partial(x_ref[:, pl.ds(i * bk, bk)], w_ref[:, pl.ds(i * bk, bk)],
                                             ws_ref[:, pl.ds(i, 1)], fp8_dtype=fp8_dtype, fp8_max=fp8_max, ptx=ptx)

    o_ref[...] = lax.fori_loop(0, kb_split, body, jnp.zeros((bm, bn), jnp.float32))


def choose_splits(n: int, k: int, *, bn: int = BLOCK_SIZE, block_size: int = BLOCK_SIZE,
                  target_programs: int = TARGET_PROGRAMS) -> int:
    """Split-K factor: the smallest divisor ``s`` of ``ceil(K/block_size)`` with ``ceil(N/bn) * s >= target_programs``
    (the largest divisor if none reaches it). ``1`` when the columns alone fill the GPU."""
    kb = -(-k // block_size)
    cols = -(-n // bn)
    divisors = [d for d in range(1, kb + 1) if kb % d == 0]
    for d in divisors:
        if cols * d >= target_programs:
            return d
    return divisors[-1]


@functools.partial(jax.jit, static_argnames=("block_size", "bm", "bn", "splits", "out_dtype", "interpret",
                                             "num_warps", "num_stages"))
def _fused(x, wq, ws, *, block_size, bm, bn, splits, out_dtype, interpret, num_warps, num_stages):
    m, k = x.shape
    n = wq.shape[0]
    kb = ws.shape[1]
    mp, np_, kp = pl.cdiv(m, bm) * bm, pl.cdiv(n, bn) * bn, kb * block_size
    # whole tiles only; zero activation rows quantize to 0 with the eps scale and add nothing
    x, wq, ws = pad_to_tiles(x, wq, ws, mp, np_, kp, block_size)
    kb_split = kb // splits
    ks = kb_split * block_size
    ratio = block_size // bn
    kwargs = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    partial = pl.pallas_call(
        functools.partial(_decode_kernel, kb_split=kb_split, bk=block_size, fp8_dtype=wq.dtype,
                          fp8_max=float(jnp.finfo(wq.dtype).max), ptx=not interpret),
        grid=(np_ // bn, splits),
        in_specs=[
            pl.BlockSpec((bm, ks), lambda j, s: (0, s)),
            pl.BlockSpec((bn, ks), lambda j, s: (j, s)),
            pl.BlockSpec((1, kb_split), lambda j, s: (j // ratio, s)),
        ],
        out_specs=pl.BlockSpec((pl.squeezed, bm, bn), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((splits, mp, np_), jnp.float32),
        interpret=interpret,
        name="fp8_w8a8_decode_splitk",
        **kwargs,
    )(x, wq, ws)
    y = partial[0] if splits == 1 else jnp.sum(partial, axis=0)
    return y[:m, :n].astype(out_dtype)


def fused_w8a8_decode_matmul(x: jax.Array, weight: jax.Array, weight_scale_inv: jax.Array, *,
                             block_size: int = BLOCK_SIZE, out_dtype=None, splits: int | None = None,
                             bn: int = BLOCK_SIZE, interpret: bool | None = None, num_warps: int = 4,
                             num_stages: int = 3) -> jax.Array:
    """W8A8 blockwise ``x @ W.T`` for small M in one kernel: quantizes ``x`` to e4m3 1x128 groups inside it.

    Args:
      x: ``[M, K]`` float32/bfloat16 activations, ``M <= 64`` advised (any M works; larger M is better served by
        the tiled GEMM, :func:`fp8rl_jax.fp8.w8a8_block_matmul` picks).
      weight: ``[N, K]`` e4m3 (vLLM layout); weight_scale_inv: float32 ``[ceil(N/bs), ceil(K/bs)]``.
      block_size: bs (128).
      out_dtype: result dtype (default ``x.dtype``); accumulation is float32.
      splits: split-K factor, a divisor of ``ceil(K/bs)`` (default :func:`choose_splits`).
      bn: output columns per program (divides ``block_size``).
      interpret: default None: compiled where the program is lowered for CUDA, interpret mode elsewhere.

    Returns:
      ``[M, N]`` in ``out_dtype``.

    Raises:
      ValueError: mismatched shapes or scales, ``bn`` not dividing ``block_size``, ``splits`` not dividing the
        number of K blocks.

    Source: vLLM ``w8a8_block_fp8_matmul`` / DeepGEMM numerics; split-K as in CUTLASS/Triton "split-k" GEMMs.
    """
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fused_w8a8_decode_matmul: x {tuple(x.shape)} must be [M, K] and weight "
                         f"{tuple(weight.shape)} [N, K] with the same K")
    m, k = x.shape
    n = weight.shape[0]
    kb = -(-k // block_size)
    if tuple(weight_scale_inv.shape) != (-(-n // block_size), kb):
        raise ValueError(f"fused_w8a8_decode_matmul: weight_scale_inv {tuple(weight_scale_inv.shape)} does not "
                         f"match weight {tuple(weight.shape)} with block {block_size}")
    if block_size % bn:
        raise ValueError(f"bn={bn} must divide block_size={block_size}")
    splits = choose_splits(n, k, bn=bn, block_size=block_size) if splits is None else int(splits)
    if splits < 1 or kb % splits:
        raise ValueError(f"splits={splits} must divide the {kb} K blocks of K={k}")
    bm = int(max(16, pl.next_power_of_2(m)))
    return run_pallas(_fused, x, weight, weight_scale_inv.astype(jnp.float32), block_size=block_size, bm=bm, bn=bn,
                  splits=splits, out_dtype=jnp.dtype(out_dtype or x.dtype), interpret=interpret,
                  num_warps=num_warps, num_stages=num_stages)


def _selftest_decode_gemm(interpret: bool = False) -> None:
    """Self-test of the ``decode_gemm`` family: 5 float32 rows x [200, 300] e4m3 (ragged, split-K) on the default
    device; the kernel quantizes the rows itself, the reference is the float64 product of the rows quantized on the
    CPU (vLLM's rounding) and the same weights, to 1e-5 of the sum of |terms|."""
    x, xq, xs, wq, ws = selftest_operands(5, 200, 300, seed=1)
    y = fused_w8a8_decode_matmul(jnp.asarray(x), jnp.asarray(wq), jnp.asarray(ws), out_dtype=jnp.float32,
                                 interpret=interpret)
    ref, bound = w8a8_reference(xq, xs, wq, ws)
    check_close("decode GEMM M=5 N=200 K=300", y, ref, bound, 1e-5)


register_selftest("decode_gemm", _selftest_decode_gemm)
