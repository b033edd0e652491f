"""W8A8 blockwise FP8 matmul on pre-quantized weights (weights 128x128, activations 1x128), as a function.

``y[m, n] = sum_kb (xq[m, kb] . wq[n, kb]) * xs[m, kb] * ws[n // 128, kb]`` with float32 accumulation
(DeepSeek-V3 / DeepGEMM / vLLM ``w8a8_block_fp8_matmul``). Lowered for the CPU (or any non-CUDA platform) this is
evaluated as ``dequant(xq) @ dequant(wq).T`` in float32, which is the same sum (only the order of fp32 additions
differs); lowered for CUDA it runs kernels on real e4m3 operands, picked by the number of rows M
(:func:`fp8rl_jax.fp8.dot_general.cuda_gemm_impl`, the one place): the activations are quantized once
(:func:`~fp8rl_jax.kernels.pallas_quant.quantize_activation_groupwise_dispatch`: the Pallas kernel on CUDA), then
for ``M <= 64`` rows (decode) the swap-AB split-K Mosaic GPU kernel (:mod:`fp8rl_jax.kernels.decode_gemm_mgpu`,
kernel family ``decode_gemm``; e5m2 weights: the Triton kernel of :mod:`fp8rl_jax.kernels.pallas_decode`, which
quantizes in its prologue), above that the Mosaic GPU GEMM on Hopper's FP8 tensor cores (``wgmma...e4m3.e4m3``,
:mod:`fp8rl_jax.kernels.mosaic_gemm`, ``w8a8_gemm``), which writes ``out_dtype`` directly. The families' self-tests
and ``FP8RL_KERNELS`` apply (:func:`fp8rl_jax.kernels.registry.choose`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fp8rl_jax.fp8.dot_general import cuda_gemm_impl, scaled_matmul
from fp8rl_jax.fp8.formats import BLOCK_SIZE
from fp8rl_jax.kernels.registry import choose
from fp8rl_jax.kernels.mosaic_gemm import FP8_OPERAND_DTYPES
from fp8rl_jax.kernels.pallas_decode import fused_w8a8_decode_matmul
from fp8rl_jax.kernels.pallas_quant import quantize_activation_groupwise_dispatch

IMPLS = ("auto", "dequant", "blocked", "pallas", "fused", "mosaic", "swapab")


def w8a8_block_matmul(x: jnp.ndarray, weight: jnp.ndarray, weight_scale_inv: jnp.ndarray,
                      block_size: int = BLOCK_SIZE, out_dtype=None, *, impl: str = "auto", norm: tuple | None = None,
                      gated: bool = False, residual: jnp.ndarray | None = None) -> jnp.ndarray:
    """FP8 W8A8 blockwise linear: ``x @ W.T`` with ``W = weight * weight_scale_inv`` blockwise.

    With a decode layer's neighbours (issue 29; the same results as running them as separate ops): ``norm=(sum_sq,
    weight, eps)`` first RMS-normalizes the rows as :class:`fp8rl_jax.models.layers.RMSNorm` computes it
    (``(weight * (x * rsqrt(sum_sq / K + eps))).astype(x.dtype)`` in float32, ``sum_sq [..., 1]`` = ``sum(x**2)``);
    ``gated=True`` takes ``weight`` as a fused ``[gate; up]`` and returns ``silu(gate) * up``; ``residual`` is added
    to the result (``residual + y``). Lowered for CUDA with ``M <= 64`` rows they run inside the decode kernel
    (:func:`fp8rl_jax.kernels.pallas_decode.fused_w8a8_decode_matmul`: one launch instead of up to four); elsewhere
    they are the separate ops.

    Args:
      x: ``[..., K]`` activations (float32/bfloat16); quantized here to e4m3 in 1 x ``block_size`` groups
        (vLLM ``QuantFP8`` native rounding).
      weight: ``[N, K]`` e4m3 (vLLM layout).
      weight_scale_inv: float32 ``[ceil(N/bs), ceil(K/bs)]``.
      block_size: bs (128).
      out_dtype: result dtype (default ``x.dtype``).
      impl: ``"auto"`` (lowered for CUDA: :func:`~fp8rl_jax.fp8.dot_general.cuda_gemm_impl` of the row count M,
        ``"swapab"`` for ``M <= 64`` (e4m3; ``"fused"`` for e5m2), ``"mosaic"`` above; dequantize + float32 matmul
        elsewhere), ``"swapab"`` (group quantization, then the swap-AB split-K Mosaic GPU decode kernel,
        :mod:`fp8rl_jax.kernels.decode_gemm_mgpu`; the neighbours run as XLA ops around it), ``"dequant"``,
        ``"blocked"`` (per-K-block real e4m3 ``dot_general``), ``"mosaic"`` (group quantization, then the Mosaic
        GPU wgmma GEMM; Mosaic GPU's interpreter where the program is not lowered for CUDA), ``"pallas"`` (group
        quantization, then the Pallas-Triton tiled GEMM) or ``"fused"`` (one split-K Triton kernel with the
        activation quantization inside; bit-identical to ``"pallas"`` up to the order of the float32 additions of
        K-block partials).

      norm, gated, residual: the fused neighbours above (``residual [..., N]``, ``[..., N/2]`` gated).

    Returns:
      ``[..., N]`` (``[..., N/2]`` gated) in ``out_dtype``; accumulated in float32.

    Raises:
      ValueError: ``x.shape[-1] != weight.shape[1]``, a scale/weight mismatch or an unknown ``impl``.
    """
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"w8a8_block_matmul: x has K={x.shape[-1]} but weight is {tuple(weight.shape)} ([N, K])")
    n, k = weight.shape
    nb, kb = -(-n // block_size), -(-k // block_size)
    if tuple(weight_scale_inv.shape) != (nb, kb):
        raise ValueError(f"w8a8_block_matmul: weight_scale_inv {tuple(weight_scale_inv.shape)} does not match "
                         f"weight {tuple(weight.shape)} with block {block_size}: expected {(nb, kb)}")
    if impl not in IMPLS:
        raise ValueError(f"w8a8_block_matmul: impl must be one of {IMPLS}, got {impl!r}")
    out_dtype = out_dtype or x.dtype
    if impl == "auto":
        rows = math.prod(x.shape[:-1])
        mosaic_ok = block_size == BLOCK_SIZE and jnp.dtype(weight.dtype) in FP8_OPERAND_DTYPES
        family, kernel = cuda_gemm_impl(rows, mosaic_ok=mosaic_ok)
        if kernel == "swapab" and not (block_size == BLOCK_SIZE
                                       and jnp.dtype(weight.dtype) == jnp.dtype(jnp.float8_e4m3fn)):
            kernel = "fused"  # the swap-AB kernel is e4m3 x e4m3 in 128-blocks; the Triton decode kernel takes the rest
        eps = None if norm is None else float(norm[2])  # static; the arrays go through choose
        extra = (None if norm is None else tuple(norm[:2]), residual)
        return choose(family, x, weight, weight_scale_inv, extra,
                      kernel=lambda *a: _with_neighbours(*a, block_size, out_dtype, kernel, gated, eps,
                                                         interpret=False),
                      xla=lambda *a: _with_neighbours(*a, block_size, out_dtype, "dequant", gated, eps))
    return _with_neighbours(x, weight, weight_scale_inv, (None if norm is None else tuple(norm[:2]), residual),
                            block_size, out_dtype, impl, gated, None if norm is None else float(norm[2]))


def _with_neighbours(x, weight, weight_scale_inv, extra, block_size, out_dtype, impl, gated, eps, interpret=None):
    """The product with its fused neighbours: inside the decode kernel (``impl="fused"``), else as separate ops in
    the order and roundings of the model's own (RMSNorm, the product, ``silu(gate) * up``, ``residual + y``)."""
    norm, residual = extra
    norm = None if norm is None else (*norm, eps)
    n, k = weight.shape
    *lead, _ = x.shape
    if impl == "fused":
        rows = math.prod(lead)
        n_out = n // 2 if gated else n
        nrm = None if norm is None else (norm[0].reshape(rows), norm[1], norm[2])
        res = None if residual is None else residual.reshape(rows, n_out)
        y = fused_w8a8_decode_matmul(x.reshape(rows, k), weight, weight_scale_inv, block_size=block_size,
                                     out_dtype=out_dtype, norm=nrm, gated=gated, residual=res)
        return y.reshape(*lead, n_out)
    if norm is not None:
        x = rms_norm_apply(x, *norm)
    y = _matmul(x, weight, weight_scale_inv, block_size, out_dtype, impl, interpret)
    if gated:
        y = silu_gate(y)
    return y if residual is None else residual + y


def rms_norm_apply(x: jax.Array, sum_sq: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm's elementwise half: ``(weight * (x * rsqrt(sum_sq / K + eps))).astype(x.dtype)`` in float32.

    Args:
      x: ``[..., K]`` activations (any float dtype; the result has it).
      sum_sq: float32 ``[..., 1]``, ``sum(x**2)`` over the last axis (the reduction half).
      weight: ``[K]`` norm weight. eps: the variance epsilon.

    Source: HF ``LlamaRMSNorm`` (``sum_sq / K`` is ``jnp.mean``'s division). The one formula for the model's
    :class:`fp8rl_jax.models.layers.RMSNorm` and a product's unfused ``norm=`` prologue.
    """
    rinv = jax.lax.rsqrt(sum_sq / x.shape[-1] + eps)
    return (weight.astype(jnp.float32) * (x.astype(jnp.float32) * rinv)).astype(x.dtype)


def silu_gate(y: jax.Array) -> jax.Array:
    """SwiGLU's gating of a fused ``[gate; up]`` product: ``[..., 2I] -> [..., I]``, ``silu(gate) * up`` in
    ``y``'s dtype (HF ``LlamaMLP``: ``act_fn(gate_proj(x)) * up_proj(x)``)."""
    gate, up = jnp.split(y, 2, axis=-1)
    return jax.nn.silu(gate) * up


def _matmul(x, weight, weight_scale_inv, block_size, out_dtype, impl, interpret=None):
    n, k = weight.shape
    *lead, _ = x.shape
    x2 = x.reshape(1, -1, k)
    if impl in ("dequant", "blocked") or interpret:  # the portable products; the interpreter (a CPU): jnp
        cuda = False
    elif interpret is False:  # the kernel branch of w8a8_block_matmul's choose, lowered only for CUDA
        cuda = True
    else:  # an explicit kernel impl: by the platform the program is lowered for
        cuda = None
    xq, xs = quantize_activation_groupwise_dispatch(x2, block_size, fp8_dtype=jnp.dtype(weight.dtype),
                                                    fp8_max=float(jnp.finfo(weight.dtype).max), cuda=cuda)
    ws = weight_scale_inv.astype(jnp.float32)
    if impl == "swapab":  # decode: the swap-AB split-K kernel; its split sums reduce in XLA (with the neighbours)
        from fp8rl_jax.kernels.registry import on_cuda
        from fp8rl_jax.kernels.decode_gemm_mgpu import decode_w8a8_matmul

        if jnp.dtype(weight.dtype) != jnp.dtype(jnp.float8_e4m3fn) or xq.shape[1] > 64:
            raise ValueError(f"w8a8_block_matmul(impl='swapab') takes e4m3 weights and at most 64 rows, got "
                             f"{weight.dtype} and {xq.shape[1]} rows")

        def run(interp):
            return lambda a, b, c, d: decode_w8a8_matmul(a, b, c, d, interpret=interp)

        args = (xq[0], xs[0], weight, ws)
        y = run(bool(interpret))(*args) if interpret is not None else on_cuda(*args, cuda=run(False),
                                                                               default=run(True))
    elif impl == "mosaic":  # the kernel's epilogue writes out_dtype from its float32 accumulator
        y = scaled_matmul(xq, xs, weight[None], None, block_size=block_size, impl="mosaic", w_block_scales=ws[None],
                          out_dtype=out_dtype, interpret=interpret)
    elif impl == "pallas":
        y = scaled_matmul(xq, xs, weight[None], None, block_size=block_size, impl="pallas",
                          w_block_scales=ws[None])
    else:
        ws_rows = jnp.repeat(ws, block_size, axis=0)[:n]
        y = scaled_matmul(xq, xs, weight[None], ws_rows[None], block_size=block_size, impl=impl)
    return y.reshape(*lead, n).astype(out_dtype)
