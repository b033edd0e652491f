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
(:func:`fp8rl_jax.kernels.pallas_gemm.pallas_w8a8_matmul` after :func:`quantize_activation_groupwise`), so the two are
bit-identical (tested in interpret mode); with ``splits > 1`` only the order of the float32 additions of K-block
partials changes (a relative difference of a few float32 ulps of the row's magnitude: tested against a float64
reference). The e4m3 values and scales are vLLM's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from fp8rl_jax.fp8.formats import ACTIVATION_RECIPE, BLOCK_SIZE, block_amax, compute_scale, scale_values
from fp8rl_jax.kernels.registry import check_close, run_pallas
from fp8rl_jax.kernels.pallas_gemm import selftest_operands, w8a8_reference

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


def _decode_kernel(*refs, m, bm, kb_split, bk, fp8_dtype, fp8_max, ptx, norm, gated, residual, final):
    """Program (j, s): output columns ``[j*bn, (j+1)*bn)``, K blocks ``[s*kb_split, (s+1)*kb_split)``.

    Refs, in order: ``x [M, K]`` float (the whole, unpadded activation rows: ``bm`` rows are loaded with the rows
    past ``M`` masked to zero, so no padded copy of ``x`` is made); with ``norm``: ``sum_sq [M, 1]`` float32 and
    the RMSNorm weight ``[1, K]`` (``norm`` is then ``(1/K, eps)``); the weight tile ``[bn, kb_split*bk]`` e4m3 and its scales ``[1, kb_split]``; with
    ``gated`` a second weight tile and scales (the ``up`` rows of a fused ``[gate; up]`` weight); with ``residual``:
    ``r [M, N]``; the output: ``[M, N]`` in its dtype when ``final`` (one split: the epilogue runs here), else
    ``[splits, M, N_pad]`` float32 partial sums. Stores cover the ``M`` live rows only."""
    from jax.experimental.pallas import triton as plgpu

    refs = list(refs)
    x_ref = refs.pop(0)
    rinv_ref, nw_ref = (refs.pop(0), refs.pop(0)) if norm is not None else (None, None)
    w_ref, ws_ref = refs.pop(0), refs.pop(0)
    wu_ref, wsu_ref = (refs.pop(0), refs.pop(0)) if gated else (None, None)
    r_ref = refs.pop(0) if residual else None
    (o_ref,) = refs
    j, s = pl.program_id(0), pl.program_id(1)
    bn = w_ref.shape[0]
    live = lax.broadcasted_iota(jnp.int32, (bm, bk), 0) < m
    if norm is not None:  # RMSNorm of the rows as RMSNorm computes it: weight * (x * rsqrt(mean(x**2) + eps))
        ssq = plgpu.load(rinv_ref.at[pl.ds(0, bm), :], mask=lax.broadcasted_iota(jnp.int32, (bm, 1), 0) < m,
                         other=1.0)
        rinv = lax.rsqrt(ssq * jnp.float32(norm[0]) + jnp.float32(norm[1]))  # sum / K as XLA computes a mean

    def body(i, accs):
        col = (s * kb_split + i) * bk
        xk = plgpu.load(x_ref.at[pl.ds(0, bm), pl.ds(col, bk)], mask=live, other=0.0)
        if norm is not None:
            nw = nw_ref[:, pl.ds(col, bk)].astype(jnp.float32)
            xk = (nw * (xk.astype(jnp.float32) * rinv)).astype(xk.dtype)
        part = functools.partial(quantized_block_partial, fp8_dtype=fp8_dtype, fp8_max=fp8_max, ptx=ptx)
        out = (accs[0] + part(xk, w_ref[:, pl.ds(i * bk, bk)], ws_ref[:, pl.ds(i, 1)]),)
        if gated:
            out += (accs[1] + part(xk, wu_ref[:, pl.ds(i * bk, bk)], wsu_ref[:, pl.ds(i, 1)]),)
        return out

    zero = jnp.zeros((bm, bn), jnp.float32)
    accs = lax.fori_loop(0, kb_split, body, (zero, zero) if gated else (zero,))
    rows = lax.broadcasted_iota(jnp.int32, (bm, bn), 0) < m
    if not final:
        plgpu.store(o_ref.at[s, pl.ds(0, bm), pl.ds(j * bn, bn)], accs[0], mask=rows)
        return
    dt = o_ref.dtype
    y = accs[0].astype(dt)
    if gated:  # silu(gate) * up from the products rounded to the output dtype, in float32, rounded once
        g, u = y.astype(jnp.float32), accs[1].astype(dt).astype(jnp.float32)
        y = (g * jax.nn.sigmoid(g) * u).astype(dt)
    if residual:
        r = plgpu.load(r_ref.at[pl.ds(0, bm), pl.ds(j * bn, bn)], mask=rows, other=0.0)
        y = (r.astype(jnp.float32) + y.astype(jnp.float32)).astype(dt)
    plgpu.store(o_ref.at[pl.ds(0, bm), pl.ds(j * bn, bn)], y, mask=rows)


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
                                             "num_warps", "num_stages", "gated", "eps"))
def _fused(x, wq, ws, sum_sq=None, norm_weight=None, residual=None, *, block_size, bm, bn, splits, out_dtype,
           interpret, num_warps, num_stages, gated=False, eps=None):
    m, k = x.shape
    n_all = wq.shape[0]
    n = n_all // 2 if gated else n_all
    kb = ws.shape[1]
    np_, kp = pl.cdiv(n, bn) * bn, kb * block_size
    # the activation rows stay unpadded (masked loads); K and N are padded to whole tiles only when ragged (zero
    # columns add nothing; real checkpoints' K and N are multiples of 128, so this copies nothing; a gated weight's
    # halves are multiples of 128, checked by the caller)
    if kp != k:
        x = jnp.pad(x, ((0, 0), (0, kp - k)))
        if norm_weight is not None:
            norm_weight = jnp.pad(norm_weight, (0, kp - k))
    if not gated and (np_, kp) != (n, k):
        wq = jnp.pad(wq, ((0, np_ - n), (0, kp - k)))
    elif kp != k:
        wq = jnp.pad(wq, ((0, 0), (0, kp - k)))
    # ws needs no padding: bn divides block_size, so cdiv(np_, block_size) == cdiv(n, block_size) == ws.shape[0]
    kb_split = kb // splits
    ks = kb_split * block_size
    ratio = block_size // bn
    final = splits == 1 and np_ == n
    kwargs = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    whole = pl.BlockSpec()  # a whole array, read or written with row masks
    args, specs = [x], [whole]
    if sum_sq is not None:
        args += [sum_sq.astype(jnp.float32).reshape(m, 1), norm_weight.reshape(1, kp)]
        specs += [whole, whole]
    args += [wq, ws]
    specs += [pl.BlockSpec((bn, ks), lambda j, s: (j, s)), pl.BlockSpec((1, kb_split), lambda j, s: (j // ratio, s))]
    if gated:  # the up half of [gate; up]: rows n + j*bn, its scale rows n/128 + j // ratio
        nt, nb = n // bn, n // block_size
        args += [wq, ws]
        specs += [pl.BlockSpec((bn, ks), lambda j, s: (j + nt, s)),
                  pl.BlockSpec((1, kb_split), lambda j, s: (j // ratio + nb, s))]
    if residual is not None and final:
        args.append(residual)
        specs.append(whole)
    out_shape = (jax.ShapeDtypeStruct((m, n), out_dtype) if final
                 else jax.ShapeDtypeStruct((splits, m, np_), jnp.float32))
    out = pl.pallas_call(
        functools.partial(_decode_kernel, m=m, bm=bm, kb_split=kb_split, bk=block_size, fp8_dtype=wq.dtype,
                          fp8_max=float(jnp.finfo(wq.dtype).max), ptx=not interpret,
                          norm=None if sum_sq is None else (float(np.float32(1.0) / np.float32(k)), float(eps)),
                          gated=gated, residual=residual is not None and final, final=final),
        grid=(np_ // bn, splits),
        in_specs=specs,
        out_specs=whole,
        out_shape=out_shape,
        interpret=interpret,
        name="fp8_w8a8_decode_splitk",
        **kwargs,
    )(*args)
    if final:
        return out
    y = (out[0] if splits == 1 else jnp.sum(out, axis=0))[:, :n].astype(out_dtype)
    return y if residual is None else (residual.astype(jnp.float32) + y.astype(jnp.float32)).astype(out_dtype)


def decode_tiling(n: int, k: int, *, fused_epilogue: bool, block_size: int = BLOCK_SIZE) -> tuple[int, int]:
    """``(bn, splits)`` for the decode kernel: with a fused epilogue (gated or residual) one split and the widest
    ``bn`` in 128/64/32/16 that still gives about one program per SM (132), so the epilogue runs in the kernel;
    otherwise ``bn = 128`` and :func:`choose_splits`. A gated product's ``n`` is its output (half the weight rows)."""
    if fused_epilogue:
        for bn in (128, 64, 32, 16):
            if -(-n // bn) >= TARGET_PROGRAMS // 2:
                return bn, 1
        return 16, 1
    return block_size, choose_splits(n, k, bn=block_size, block_size=block_size)


def fused_w8a8_decode_matmul(x: jax.Array, weight: jax.Array, weight_scale_inv: jax.Array, *,
                             block_size: int = BLOCK_SIZE, out_dtype=None, splits: int | None = None,
                             bn: int | None = None, interpret: bool | None = None, num_warps: int = 4,
                             num_stages: int = 3, norm: tuple | None = None, gated: bool = False,
                             residual: jax.Array | None = None) -> jax.Array:
    """W8A8 blockwise ``x @ W.T`` for small M in one kernel: quantizes ``x`` to e4m3 1x128 groups inside it.

    Optionally with a decode layer's neighbours fused in (issue 29: fewer kernels per decode step):

    - ``norm=(sum_sq, weight, eps)``: the rows are first RMS-normalized as :class:`fp8rl_jax.models.layers.RMSNorm`
      does, ``(weight * (x * rsqrt(sum_sq / K + eps))).astype(x.dtype)`` in float32 (``sum_sq / K`` as XLA computes
      a mean: times the float32 ``1/K``), with ``sum_sq [M]`` = ``sum(x**2)`` computed by the caller (one row
      reduction), ``weight [K]`` and ``eps`` a float;
    - ``gated=True``: ``weight`` is a fused ``[gate; up]`` ``[2I, K]`` (vLLM's ``gate_up_proj``, ``I`` a multiple of
      the block size) and the result is ``silu(gate) * up`` ``[M, I]``, computed in float32 from the two products
      rounded to ``out_dtype`` and rounded once (as XLA computes the unfused
      ``silu(gate) * up`` when it fuses it); one split: each program computes a gate and an up tile;
    - ``residual [M, N]``: returns ``residual + y`` (``y`` rounded to ``out_dtype`` first, as ``x + linear(x)``).

    Args:
      x: ``[M, K]`` float32/bfloat16 activations, ``M <= 64`` advised (any M works; larger M is better served by
        the tiled GEMM, :func:`fp8rl_jax.fp8.w8a8_block_matmul` picks). The rows are read unpadded.
      weight: ``[N, K]`` e4m3 (vLLM layout); weight_scale_inv: float32 ``[ceil(N/bs), ceil(K/bs)]``.
      block_size: bs (128).
      out_dtype: result dtype (default ``x.dtype``); accumulation is float32.
      splits: split-K factor, a divisor of ``ceil(K/bs)`` (default :func:`decode_tiling`); with one split the
        kernel writes the result (epilogue included) itself, with more the float32 partial sums of the live rows are
        added by one XLA reduction fused with the cast and the residual.
      bn: output columns per program (divides ``block_size``; default :func:`decode_tiling`).
      interpret: default None: compiled where the program is lowered for CUDA, interpret mode elsewhere.
      norm, gated, residual: the fused neighbours above.

    Returns:
      ``[M, N]`` (``[M, N/2]`` gated) in ``out_dtype``.

    Raises:
      ValueError: mismatched shapes or scales, ``bn`` not dividing ``block_size``, ``splits`` not dividing the
        number of K blocks, ``gated`` with more than one split or halves not a multiple of the block size.

    Source: vLLM ``w8a8_block_fp8_matmul`` / DeepGEMM numerics; split-K as in CUTLASS/Triton "split-k" GEMMs;
    the gated epilogue as vLLM's fused ``SiluAndMul`` after ``gate_up_proj``.
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
    n_out = n // 2 if gated else n
    if gated and (n % 2 or n_out % block_size):
        raise ValueError(f"fused_w8a8_decode_matmul(gated=True): weight rows {n} must be [gate; up] halves that are "
                         f"multiples of {block_size}")
    if norm is not None:
        ms, nw, _ = norm
        if tuple(jnp.shape(ms)) not in ((m,), (m, 1)) or tuple(jnp.shape(nw)) != (k,):
            raise ValueError(f"fused_w8a8_decode_matmul: norm=(sum_sq {tuple(jnp.shape(ms))}, weight "
                             f"{tuple(jnp.shape(nw))}, eps) must be ([M]={m}, [K]={k}, a float)")
    if residual is not None and tuple(residual.shape) != (m, n_out):
        raise ValueError(f"fused_w8a8_decode_matmul: residual {tuple(residual.shape)} must be [M, N] = {(m, n_out)}")
    tbn, tsplits = decode_tiling(n_out, k, fused_epilogue=gated or residual is not None, block_size=block_size)
    bn = tbn if bn is None else int(bn)
    if block_size % bn:
        raise ValueError(f"bn={bn} must divide block_size={block_size}")
    splits = tsplits if splits is None else int(splits)
    if splits < 1 or kb % splits:
        raise ValueError(f"splits={splits} must divide the {kb} K blocks of K={k}")
    if gated and splits != 1:
        raise ValueError("fused_w8a8_decode_matmul(gated=True) needs splits=1 (the epilogue needs whole sums)")
    bm = int(max(16, pl.next_power_of_2(m)))
    ms, nw, eps = (None, None, None) if norm is None else (jnp.asarray(norm[0]).reshape(m), jnp.asarray(norm[1]),
                                                           float(norm[2]))
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if residual is not None:
        residual = residual.astype(out_dtype)
    return run_pallas(_fused, x, weight, weight_scale_inv.astype(jnp.float32), ms, nw, residual,
                      block_size=block_size, bm=bm, bn=bn, splits=splits, out_dtype=out_dtype, interpret=interpret,
                      num_warps=num_warps, num_stages=num_stages, gated=bool(gated), eps=eps)


def _selftest_decode_gemm(interpret: bool = False) -> None:
    """Self-test of the ``decode_gemm`` family: 5 float32 rows x [200, 300] e4m3 (ragged, split-K) on the default
    device; the kernel quantizes the rows itself, the reference is the float64 product of the rows quantized on the
    CPU (vLLM's rounding) and the same weights, to 1e-5 of the sum of |terms|."""
    x, xq, xs, wq, ws = selftest_operands(5, 200, 300, seed=1)
    y = fused_w8a8_decode_matmul(jnp.asarray(x), jnp.asarray(wq), jnp.asarray(ws), out_dtype=jnp.float32,
                                 interpret=interpret)
    ref, bound = w8a8_reference(xq, xs, wq, ws)
    check_close("decode GEMM M=5 N=200 K=300", y, ref, bound, 1e-5)


# Not registered as the ``decode_gemm`` family's self-test any more: "auto" picks the swap-AB Mosaic GPU kernel
# (:mod:`fp8rl_jax.kernels.decode_gemm_mgpu`, issue 37) for M <= 64; this Triton kernel runs only when asked for
# by name (``impl="fused"``), without a self-test, like every explicitly requested kernel.
