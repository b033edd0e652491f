"""W8A8 blockwise FP8 matmul on pre-quantized weights (weights 128x128, activations 1x128), as a function.

``y[m, n] = sum_kb (xq[m, kb] . wq[n, kb]) * xs[m, kb] * ws[n // 128, kb]`` with float32 accumulation
(DeepSeek-V3 / DeepGEMM / vLLM ``w8a8_block_fp8_matmul``). Lowered for the CPU (or any non-CUDA platform) this is
evaluated as ``dequant(xq) @ dequant(wq).T`` in float32, which is the same sum (only the order of fp32 additions
differs); lowered for CUDA it runs kernels on real e4m3 operands, picked by the number of rows M
(:func:`fp8rl_jax.fp8.dot_general.cuda_gemm_impl`, the one place): the activations are quantized once (a Pallas
kernel of the ``quant`` family on CUDA: :func:`~fp8rl_jax.kernels.pallas_quant.quantize_activation_for_decode`, in
the decode kernel's layout, for ``M <= 64``; :func:`~fp8rl_jax.kernels.pallas_quant.
quantize_activation_groupwise_dispatch` above), then
for ``M <= 64`` rows (decode) the swap-AB split-K Mosaic GPU kernel (:mod:`fp8rl_jax.kernels.decode_gemm_mgpu`,
kernel family ``decode_gemm``; e5m2 weights: the Triton kernel of :mod:`fp8rl_jax.kernels.pallas_decode`, which
quantizes in its prologue), above that the Mosaic GPU GEMM on Hopper's FP8 tensor cores (``wgmma...e4m3.e4m3``,
:mod:`fp8rl_jax.kernels.mosaic_gemm`, ``w8a8_gemm``), which writes ``out_dtype`` directly. The families' self-tests
and ``FP8RL_KERNELS`` apply (:func:`fp8rl_jax.kernels.registry.choose`).
"""

from __future__ import annotations

import functools
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
    to the result (``residual + y``). Lowered for CUDA with ``M <= 64`` rows and e4m3 weights (the swap-AB decode
    kernel) the normalization and the padding of the tokens fuse into one XLA fusion before the decode operand
    quantizer, and ``silu(gate) * up`` and the residual into the XLA reduction of the kernel's split-K partials;
    with e5m2 weights they run inside the Triton decode kernel
    (:func:`fp8rl_jax.kernels.pallas_decode.fused_w8a8_decode_matmul`); elsewhere they are the separate ops.

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
        return _auto(x, weight, weight_scale_inv, extra, family=family, block_size=block_size,
                     out_dtype=jnp.dtype(out_dtype), kernel=kernel, gated=gated, eps=eps,
                     state=_choice_state(family, kernel))
    return _with_neighbours(x, weight, weight_scale_inv, (None if norm is None else tuple(norm[:2]), residual),
                            block_size, out_dtype, impl, gated, None if norm is None else float(norm[2]))


def _choice_state(family: str | None, kernel: str) -> tuple:
    """What the trace of :func:`_auto` reads besides its arguments, as its cache key: whether the family's kernel
    (``family`` None: XLA's own CUDA path, always) and, for the paths that quantize with it (``swapab``, ``mosaic``),
    the ``quant`` kernel are allowed (``FP8RL_KERNELS``, their self-tests, run here if not yet, where the trace would
    have run them), the CUDA device the tuner times on (kind and SMs), and the tuner's mode, tables' root and
    generation (:func:`fp8rl_jax.kernels.tuner.generation`, advanced by ``reset``). Anything else a test changes
    (a monkeypatched kernel function) needs ``jax.clear_caches()``."""
    from fp8rl_jax.kernels import registry, tuner

    use = family is None or registry.use_kernel(family)
    dev = registry.cuda_device()
    return (use, use and kernel in ("swapab", "mosaic") and registry.use_kernel("quant"),
            None if dev is None else (str(dev.device_kind), getattr(dev, "core_count", None)),
            tuner.autotune_mode(), str(tuner.cache_root()), tuner.generation())


@functools.partial(jax.jit, static_argnames=("family", "block_size", "out_dtype", "kernel", "gated", "eps", "state"))
def _auto(x, weight, weight_scale_inv, extra, *, family, block_size, out_dtype, kernel, gated, eps, state):
    """:func:`w8a8_block_matmul`'s ``"auto"`` choice, as one jitted call: the 36 layers of a Qwen3-8B engine trace
    (and lower) each (shape, neighbours) case once instead of once per layer (issue 37 item 5: 1.5 s less of the
    FP8 program's trace and lower at 36 layers; XLA inlines the calls, so the compiled program is the same).
    ``state`` (:func:`_choice_state`) keys the cache on everything else the trace reads."""
    del state
    return choose(family, x, weight, weight_scale_inv, extra,
                  kernel=lambda *a: _with_neighbours(*a, block_size, out_dtype, kernel, gated, eps,
                                                     interpret=False),
                  xla=lambda *a: _with_neighbours(*a, block_size, out_dtype, "dequant", gated, eps))


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
    ws = weight_scale_inv.astype(jnp.float32)
    if impl == "swapab":  # decode: the swap-AB split-K kernel; its split sums reduce in XLA (with the neighbours)
        return _swapab(x2[0], weight, ws, block_size, cuda, interpret).reshape(*lead, n).astype(out_dtype)
    xq, xs = quantize_activation_groupwise_dispatch(x2, block_size, fp8_dtype=jnp.dtype(weight.dtype),
                                                    fp8_max=float(jnp.finfo(weight.dtype).max), cuda=cuda)
    if impl == "mosaic":  # the kernel's epilogue writes out_dtype from its float32 accumulator
        y = scaled_matmul(xq, xs, weight[None], None, block_size=block_size, impl="mosaic", w_block_scales=ws[None],
                          out_dtype=out_dtype, interpret=interpret)
    elif impl == "pallas":
        y = scaled_matmul(xq, xs, weight[None], None, block_size=block_size, impl="pallas",
                          w_block_scales=ws[None])
    else:
        ws_rows = jnp.repeat(ws, block_size, axis=0)[:n]
        y = scaled_matmul(xq, xs, weight[None], ws_rows[None], block_size=block_size, impl=impl)
    return y.reshape(*lead, n).astype(out_dtype)


def _swapab(x, weight, ws, block_size, cuda, interpret):
    """``[M, K] -> [M, N]`` float32 by the swap-AB decode kernel, its activations quantized straight into the
    kernel's layout (:func:`~fp8rl_jax.kernels.pallas_quant.quantize_activation_for_decode`: zero-padded token rows,
    transposed scales; no pad launches) and its split-K partials summed by XLA (fused with the neighbours)."""
    from fp8rl_jax.kernels.decode_gemm_mgpu import decode_w8a8_partials_t, padded_tokens
    from fp8rl_jax.kernels.pallas_quant import quantize_activation_for_decode
    from fp8rl_jax.kernels.registry import on_cuda

    m = x.shape[0]
    n = weight.shape[0]
    if jnp.dtype(weight.dtype) != jnp.dtype(jnp.float8_e4m3fn) or m > 64 or block_size != BLOCK_SIZE:
        raise ValueError(f"w8a8_block_matmul(impl='swapab') takes e4m3 weights in {BLOCK_SIZE}-blocks and at most "
                         f"64 rows, got {weight.dtype}, block {block_size} and {m} rows")
    m_pad = padded_tokens(m)
    # the interpreter (a CPU) checks the kernel's own quantizer too; the portable path is bit-identical to it
    xq_p, xs_t = quantize_activation_for_decode(x, m_pad, cuda=cuda, interpret=True if interpret else None)

    def run(interp):
        return lambda a, b, c, d: decode_w8a8_partials_t(a, b, c, d, m=m, interpret=interp)

    args = (xq_p, xs_t, weight, ws)
    parts = run(bool(interpret))(*args) if interpret is not None else on_cuda(*args, cuda=run(False),
                                                                               default=run(True))
    return jnp.sum(parts, axis=0)[:n, :m].T
