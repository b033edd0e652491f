"""Pallas W8A8 blockwise FP8 GEMM (DeepGEMM / vLLM ``w8a8_block_fp8_matmul`` semantics).

``y[m, n] = sum_kb (xq[m, kb] . wq[n, kb]) * xs[m, kb] * ws[n // 128, kb]``: each program owns a
``(bm, bn)`` output tile (``bn`` divides the 128-row weight block, so one weight scale per K-block), loops over
K in 128-wide blocks, multiplies real e4m3 tiles with float32 accumulation and applies both scales to the
partial product before adding it ("promotion" in float32, as DeepGEMM does). Lowered with Triton on a CUDA
GPU (Hopper: e4m3 ``tt.dot``); ``interpret=True`` elsewhere, for tests at small sizes.

Since issue 29 no ``"auto"`` path runs this kernel: Pallas' Triton lowering turns the e4m3 ``tt.dot`` into f16
``mma.sync`` on sm_90 (shared/GPU.md), so GEMMs with M > 64 rows take the Mosaic GPU wgmma kernel
(:mod:`fp8rl_jax.kernels.mosaic_gemm`, which owns the ``w8a8_gemm`` family's self-test) and decode the split-K kernel of
:mod:`fp8rl_jax.kernels.pallas_decode`. It stays for explicit ``impl="pallas"`` requests and as the reference those
kernels are tested against in interpret mode. This module also holds the self-test helpers
(:func:`selftest_operands`, :func:`w8a8_reference`) the kernel families share.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from fp8rl_jax.fp8.formats import BLOCK_SIZE
from fp8rl_jax.kernels.registry import check_close, run_pallas


def _gemm_kernel(x_ref, xs_ref, w_ref, ws_ref, o_ref, *, kb, bk):
    bm, bn = o_ref.shape

    def body(i, acc):
        xk = x_ref[:, pl.ds(i * bk, bk)]
        wk = w_ref[:, pl.ds(i * bk, bk)]
        d = lax.dot_general(xk, wk, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return acc + d * xs_ref[:, pl.ds(i, 1)] * ws_ref[:, pl.ds(i, 1)]

    acc = lax.fori_loop(0, kb, body, jnp.zeros((bm, bn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def pad_to_tiles(x, wq, ws, mp: int, np_: int, kp: int, block_size: int):
    """Zero-pad ``x [M, K]`` to ``[mp, kp]``, ``wq [N, K]`` to ``[np_, kp]`` and the weight scales to
    ``ceil(np_/block_size)`` block rows, so no kernel tile overhangs an array (Pallas' Triton lowering adds no bounds
    masks). Zero rows/columns add nothing to the product; zero K padding is vLLM's padding of a ragged last group."""
    m, k = x.shape
    n = wq.shape[0]
    if (mp, kp) != (m, k):
        x = jnp.pad(x, ((0, mp - m), (0, kp - k)))
    if (np_, kp) != (n, k):
        wq = jnp.pad(wq, ((0, np_ - n), (0, kp - k)))
    nbs = pl.cdiv(np_, block_size)
    if ws.shape[0] != nbs:
        ws = jnp.pad(ws, ((0, nbs - ws.shape[0]), (0, 0)))
    return x, wq, ws


@functools.partial(jax.jit, static_argnames=("block_size", "bm", "bn", "out_dtype", "interpret", "num_warps",
                                             "num_stages"))
def _gemm(xq, xs, wq, ws, *, block_size, bm, bn, out_dtype, interpret, num_warps, num_stages):
    m, k = xq.shape
    n = wq.shape[0]
    kb = xs.shape[1]
    mp, np_, kp = pl.cdiv(m, bm) * bm, pl.cdiv(n, bn) * bn, kb * block_size
    if mp != m:
        xs = jnp.pad(xs, ((0, mp - m), (0, 0)))
    xq, wq, ws = pad_to_tiles(xq, wq, ws, mp, np_, kp, block_size)
    ratio = block_size // bn
    kwargs = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    y = pl.pallas_call(
        functools.partial(_gemm_kernel, kb=kb, bk=block_size),
        grid=(mp // bm, np_ // bn),
        in_specs=[
            pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
            pl.BlockSpec((bm, kb), lambda i, j: (i, 0)),
            pl.BlockSpec((bn, kp), lambda i, j: (j, 0)),
            pl.BlockSpec((1, kb), lambda i, j: (j // ratio, 0)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        interpret=interpret,
        name="fp8_w8a8_block_gemm",
        **kwargs,
    )(xq, xs, wq, ws)
    return y[:m, :n]


def pallas_w8a8_matmul(xq, xs, wq, ws, *, block_size: int = BLOCK_SIZE, bm: int | None = None,
                       bn: int | None = None, out_dtype=jnp.float32, interpret: bool | None = None,
                       num_warps: int = 4, num_stages: int = 3):
    """Fused W8A8 blockwise GEMM on pre-quantized operands.

    Args:
      xq: ``[M, K]`` e4m3 activations; xs: float32 ``[M, ceil(K/bs)]`` (1 x bs group scales).
      wq: ``[N, K]`` e4m3 weights; ws: float32 ``[ceil(N/bs), ceil(K/bs)]`` (bs x bs block scales).
      block_size: bs (128).
      bm, bn: output tile (powers of two, ``bn`` divides ``block_size``, ``bm >= 16`` on GPU); default
        ``bm = clip(next_pow2(M), 16, 64)``, ``bn = 128``.
      out_dtype: result dtype (accumulation is float32).
      interpret: default None: compiled where the program is lowered for CUDA, interpret mode elsewhere.

    Returns:
      ``[M, N]`` in ``out_dtype``.

    Raises:
      ValueError: shapes/scales that do not match, or ``bn`` not dividing ``block_size``.
    """
    m, k = xq.shape
    n, k2 = wq.shape
    kb = -(-k // block_size)
    if k != k2:
        raise ValueError(f"pallas_w8a8_matmul: xq is {tuple(xq.shape)} but wq is {tuple(wq.shape)} ([N, K])")
    if tuple(xs.shape) != (m, kb) or tuple(ws.shape) != (-(-n // block_size), kb):
        raise ValueError(f"pallas_w8a8_matmul: scale shapes {tuple(xs.shape)}, {tuple(ws.shape)} do not match "
                         f"M={m}, N={n}, K={k} with block {block_size}")
    bm = bm or int(min(64, max(16, pl.next_power_of_2(m))))
    bn = bn or block_size
    if block_size % bn:
        raise ValueError(f"bn={bn} must divide block_size={block_size}")
    return run_pallas(_gemm, xq, xs.astype(jnp.float32), wq, ws.astype(jnp.float32), block_size=block_size, bm=bm, bn=bn,
                 out_dtype=jnp.dtype(out_dtype), interpret=interpret, num_warps=num_warps,
                 num_stages=num_stages)


def w8a8_reference(xq, xs, wq, ws, block_size: int = BLOCK_SIZE, w_scales: str = "block"):
    """float64 numpy ``(y, bound)`` of the W8A8 blockwise product (the formula in the module docstring) for a
    self-test: ``y = (xq * xs) @ (wq * ws).T`` with each scale broadcast over its group/block, ``bound = |.| @ |.|.T``.

    Args: ``xq [M, K]`` FP8, ``xs [M, KB]``, ``wq [N, K]`` FP8, ``ws [ceil(N/bs), KB]`` (``w_scales="block"``: 128x128
    blocks) or ``[N, KB]`` (``"row"``: 1 x bs groups of each row of ``wq``); numpy or jax arrays.

    Raises:
      ValueError: an unknown ``w_scales``.
    """
    import numpy as np

    if w_scales not in ("block", "row"):
        raise ValueError(f"w8a8_reference: w_scales must be 'block' or 'row', got {w_scales!r}")
    m, k = xq.shape
    n = wq.shape[0]
    xd = np.asarray(xq).astype(np.float64) * np.repeat(np.asarray(xs, np.float64), block_size, axis=1)[:, :k]
    wsr = np.asarray(ws, np.float64)
    if w_scales == "block":
        wsr = np.repeat(wsr, block_size, axis=0)
    wsr = np.repeat(wsr, block_size, axis=1)[:n, :k]
    wd = np.asarray(wq).astype(np.float64) * wsr
    return xd @ wd.T, np.abs(xd) @ np.abs(wd).T


def selftest_operands(m: int, n: int, k: int, seed: int = 0):
    """Ragged e4m3 operands for a self-test, quantized on the CPU by the jnp reference (vLLM's roundings):
    ``(x float32 [M, K], xq, xs, wq [N, K], ws)`` as numpy arrays."""
    import numpy as np

    from fp8rl_jax.fp8.formats import ACTIVATION_RECIPE, E4M3, E4M3_MAX, WEIGHT_RECIPE
    from fp8rl_jax.fp8.quant import _quantize_blocks, _quantize_groups

    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32) * np.logspace(-1, 1, k, dtype=np.float32)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    xq, xs = _quantize_groups(jax.device_put(x, cpu), group_size=BLOCK_SIZE, ue8m0=False, fp8_dtype=jnp.dtype(E4M3),
                              fp8_max=E4M3_MAX, recipe=ACTIVATION_RECIPE)
    wq, ws = _quantize_blocks(jax.device_put(w, cpu), bn=BLOCK_SIZE, bk=BLOCK_SIZE, ue8m0=False,
                              fp8_dtype=jnp.dtype(E4M3), fp8_max=E4M3_MAX, recipe=WEIGHT_RECIPE)
    return x, *(np.asarray(a) for a in (xq, xs, wq, ws))


def _selftest_w8a8_gemm(interpret: bool = False) -> None:
    """Check of this Triton GEMM (formerly the ``w8a8_gemm`` family's self-test; since issue 29 that family is the
    Mosaic GPU kernel's, :func:`fp8rl_jax.kernels.mosaic_gemm._selftest_w8a8_gemm`): M=65, N=200, K=300 (ragged in
    every dimension) on the default device against :func:`w8a8_reference`, to 1e-5 of the sum of |terms| (float32
    accumulation of three K-block partials; a wrong scale or tile misses it by orders of magnitude).

    Raises:
      fp8rl_jax.kernels.registry.KernelMismatch: the result is outside the tolerance.
    """
    _, xq, xs, wq, ws = selftest_operands(65, 200, 300)
    y = pallas_w8a8_matmul(*(jnp.asarray(a) for a in (xq, xs, wq, ws)), interpret=interpret)
    ref, bound = w8a8_reference(xq, xs, wq, ws)
    check_close("W8A8 GEMM M=65 N=200 K=300", y, ref, bound, 1e-5)

