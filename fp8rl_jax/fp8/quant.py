"""Blockwise e4m3 quantization and dequantization (jnp reference; the oracle for the Pallas kernel).

Weights use 128x128 blocks, activations 1x128 groups along the last (K) axis, as DeepSeek-V3, vLLM
(``per_block_cast_to_fp8``, ``QuantFP8`` / ``per_token_group_quant_fp8``) and DeepGEMM. Shapes not divisible
by the block size are zero-padded for the scale computation only (|0| never raises a block's amax), as vLLM
does. Values are clipped to +-fp8_max before the cast: JAX converts overflow to NaN, the contract saturates.

Rounding details follow :mod:`fp8rl_jax.fp8.formats`: by default weights reproduce vLLM's
``per_block_cast_to_fp8`` and activations ``QuantFP8(group (1,128)).forward_native`` bit for bit
(tests/test_fp8_vllm_exact.py). Every function here is jit-safe; when called eagerly with concrete arrays and
``check=True`` a NaN/inf input raises ``ValueError`` (see :func:`raise_if_nonfinite`: judged from the scales plus one fast sum, not a full
``isfinite`` pass).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from fp8rl_jax.fp8.formats import (ACTIVATION_RECIPE, BLOCK_SIZE, E4M3, E4M3_MAX, VLLM_TENSOR_NATIVE,
                                   WEIGHT_RECIPE, QuantRecipe, block_amax, compute_scale, to_f32_exact,
                                   scale_values)


def _block_pair(block_size) -> tuple[int, int]:
    bn, bk = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    if bn <= 0 or bk <= 0:
        raise ValueError(f"block_size must be positive, got {(bn, bk)}")
    return int(bn), int(bk)


def _require(name: str, x, ndim_min: int) -> None:
    if x.ndim < ndim_min:
        raise ValueError(f"{name}: expected an array with at least {ndim_min} dims, got shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name}: expected a floating-point array, got dtype {x.dtype}")


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


@jax.jit
def _sum_in_dtype(x):
    return jnp.sum(x)


def raise_if_nonfinite(name: str, x, scale) -> None:
    """Raise ``ValueError`` if a concrete input ``x`` holds NaN/inf, judged cheaply from its ``scale``.

    A block's scale is infinite when the block holds +-inf (max/min see it). NaN is not reliably propagated by
    XLA CPU's vectorized max/min reductions, so the sum of ``x`` (one fast reduction, NaN-propagating) is checked
    too, and only if that sum is non-finite (NaN, or an overflow of huge finite values) is the exact ``isfinite``
    scan run to decide.
    No-op for traced values (inside ``jit``/``grad``).
    """
    if not _is_concrete(scale) or not _is_concrete(x):
        return
    msg = f"{name}: input contains NaN or inf values; refusing to quantize"
    if not bool(jnp.all(jnp.isfinite(scale))):
        raise ValueError(msg + " (a block's scale came out non-finite)")
    if not bool(jnp.isfinite(_sum_in_dtype(x))) and not bool(jnp.all(jnp.isfinite(x))):
        raise ValueError(msg)


def check_finite(name: str, x) -> None:
    """Raise ``ValueError`` naming ``name`` if a concrete array holds NaN or inf (not for traced values)."""
    if isinstance(x, jax.core.Tracer):
        return
    if not bool(jnp.all(jnp.isfinite(jnp.asarray(x, jnp.float32)))):
        raise ValueError(f"{name}: contains NaN or inf values; refusing to quantize")


@functools.partial(jax.jit, static_argnames=("bn", "bk", "ue8m0", "fp8_dtype", "fp8_max", "recipe"))
def _quantize_blocks(w, *, bn, bk, ue8m0, fp8_dtype, fp8_max, recipe):
    *lead, n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    wp = w
    if nb * bn != n or kb * bk != k:
        wp = jnp.pad(wp, [(0, 0)] * len(lead) + [(0, nb * bn - n), (0, kb * bk - k)])
    # Block amax in two steps: across the bn rows of each block row first (a reduction over a middle axis
    # that XLA CPU vectorizes along K; faster than reducing both block axes at once from 16 MB up, see
    # `bench_quant.py --breakdown`), then over each bk-wide group of that row maximum. Exact either way.
    row_amax = block_amax(wp.reshape(*lead, nb, bn, kb * bk), -2)  # [..., nb, K] float32
    amax = jnp.max(row_amax.reshape(*lead, nb, kb, bk), axis=-1)  # [..., nb, kb]
    wp = wp.reshape(*lead, nb, bn, kb, bk)
    scale = compute_scale(amax, fp8_max, ue8m0, recipe=recipe)
    q = scale_values(to_f32_exact(wp), scale[..., :, None, :, None], fp8_dtype, fp8_max, recipe=recipe)
    q = q.reshape(*lead, nb * bn, kb * bk)
    if nb * bn != n or kb * bk != k:
        q = q[..., :n, :k]
    return q, scale


def quantize_weight_blockwise(
    w: jnp.ndarray,
    block_size: tuple[int, int] | int = BLOCK_SIZE,
    ue8m0: bool = False,
    *,
    fp8_dtype=E4M3,
    fp8_max: float = E4M3_MAX,
    recipe: QuantRecipe | None = None,
    check: bool = True,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Quantize a weight matrix (or a stack of them) to e4m3 with one scale per 2-D block.

    Default rounding = vLLM ``per_block_cast_to_fp8`` (DeepGEMM): ``s = max(amax, 1e-4) / 448`` (IEEE
    division), optional UE8M0, ``q = cast(clip(w * (1/s)))``. An all-zero block gets ``s = 1e-4/448`` and
    ``q = 0``.

    Args:
      w: ``[..., N, K]`` float array (HF/vLLM layout ``[out_features, in_features]``); leading dims are
        independent matrices (stacked layers or experts).
      block_size: ``(bn, bk)`` or an int for square blocks; vLLM's ``weight_block_size`` (default 128x128).
      ue8m0: power-of-two scales (DeepGEMM UE8M0).
      fp8_dtype, fp8_max: target format (e4m3 by default).
      recipe: rounding details (:class:`~fp8rl_jax.fp8.formats.QuantRecipe`); default
        ``formats.WEIGHT_RECIPE``.
      check: when called eagerly, raise on NaN/inf input.

    Returns:
      ``(q, scale_inv)``: ``q`` is ``[..., N, K]`` in ``fp8_dtype``; ``scale_inv`` is float32
      ``[..., ceil(N/bn), ceil(K/bk)]`` with ``w ~= q * scale_inv`` blockwise.

    Raises:
      ValueError: fewer than 2 dims, non-float dtype, a non-positive block size, or (eager, ``check``)
        NaN/inf values.
    """
    _require("quantize_weight_blockwise", w, 2)
    bn, bk = _block_pair(block_size)
    q, scale = _quantize_blocks(w, bn=bn, bk=bk, ue8m0=bool(ue8m0), fp8_dtype=jnp.dtype(fp8_dtype),
                                fp8_max=float(fp8_max), recipe=recipe or WEIGHT_RECIPE)
    if check:
        raise_if_nonfinite("quantize_weight_blockwise", w, scale)
    return q, scale


def dequantize_weight_blockwise(
    q: jnp.ndarray, scale_inv: jnp.ndarray, block_size: tuple[int, int] | int = BLOCK_SIZE, out_dtype=jnp.float32
) -> jnp.ndarray:
    """Inverse of :func:`quantize_weight_blockwise`: ``q[..., n, k] * scale_inv[..., n//bn, k//bk]``.

    The product is rounded once to float32 (exact for UE8M0 power-of-two scales: a 4-bit significand times a
    power of two), then cast to ``out_dtype``, as vLLM's ``scaled_dequantize`` computes it.

    Args:
      q: ``[..., N, K]`` fp8 array.
      scale_inv: float32 ``[..., ceil(N/bn), ceil(K/bk)]``.
      block_size: ``(bn, bk)`` or int.
      out_dtype: result dtype.

    Raises:
      ValueError: ``scale_inv``'s shape does not match ``q``'s block grid.
    """
    bn, bk = _block_pair(block_size)
    *lead, n, k = q.shape
    nb, kb = math.ceil(n / bn), math.ceil(k / bk)
    want = (*lead, nb, kb)
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"scale_inv shape {tuple(scale_inv.shape)} does not match weight {tuple(q.shape)} "
                         f"with block_size {(bn, bk)}: expected {want}")
    qf = q.astype(jnp.float32)
    if nb * bn == n and kb * bk == k:
        out = qf.reshape(*lead, nb, bn, kb, bk) * scale_inv.astype(jnp.float32)[..., :, None, :, None]
        return out.reshape(q.shape).astype(out_dtype)
    s = jnp.repeat(jnp.repeat(scale_inv.astype(jnp.float32), bn, axis=-2), bk, axis=-1)[..., :n, :k]
    return (qf * s).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("group_size", "ue8m0", "fp8_dtype", "fp8_max", "recipe"))
def _quantize_groups(x, *, group_size, ue8m0, fp8_dtype, fp8_max, recipe):
    *lead, k = x.shape
    kb = -(-k // group_size)
    xp = x
    if kb * group_size != k:
        xp = jnp.pad(xp, [(0, 0)] * len(lead) + [(0, kb * group_size - k)])
    xp = xp.reshape(*lead, kb, group_size)
    scale = compute_scale(block_amax(xp, -1), fp8_max, ue8m0, recipe=recipe)
    q = scale_values(to_f32_exact(xp), scale[..., None], fp8_dtype, fp8_max, recipe=recipe)
    q = q.reshape(*lead, kb * group_size)
    if kb * group_size != k:
        q = q[..., :k]
    return q, scale


def quantize_activation_groupwise(
    x: jnp.ndarray, group_size: int = BLOCK_SIZE, ue8m0: bool = False, *, fp8_dtype=E4M3,
    fp8_max: float = E4M3_MAX, recipe: QuantRecipe | None = None, check: bool = True,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Quantize activations per token in 1 x ``group_size`` groups along the last axis.

    Default rounding = vLLM ``QuantFP8(static=False, group_shape=(1, 128)).forward_native``
    (``_quantize_group_native``): ``s = amax / 448`` (IEEE division), optional UE8M0, then
    ``s = max(s, 1/(448*512))``; ``q = cast(clip(x / s, -448, 448))``. An all-zero group gets
    ``s = 1/(448*512)`` (= eps/448 with eps = 2**-9) and ``q = 0``. ``recipe=formats.VLLM_GROUP_TRITON``
    gives the GPU Triton kernel's rounding instead (``s = max(amax, 1e-10) * fp32(1/448)``).

    Args:
      x: ``[..., K]`` float array.
      group_size: elements per group (128).
      ue8m0: power-of-two scales.
      fp8_dtype, fp8_max: target format.
      recipe: rounding details; default ``formats.ACTIVATION_RECIPE``.
      check: when called eagerly, raise on NaN/inf input.

    Returns:
      ``(q, scale_inv)``: ``q`` ``[..., K]`` fp8; ``scale_inv`` float32 ``[..., ceil(K/group_size)]``.

    Raises:
      ValueError: 0-d or non-float input, non-positive group size, or (eager, ``check``) NaN/inf values.
    """
    _require("quantize_activation_groupwise", x, 1)
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    q, scale = _quantize_groups(x, group_size=int(group_size), ue8m0=bool(ue8m0), fp8_dtype=jnp.dtype(fp8_dtype),
                                fp8_max=float(fp8_max), recipe=recipe or ACTIVATION_RECIPE)
    if check:
        raise_if_nonfinite("quantize_activation_groupwise", x, scale)
    return q, scale


def dequantize_activation_groupwise(q: jnp.ndarray, scale_inv: jnp.ndarray, group_size: int = BLOCK_SIZE,
                                    out_dtype=jnp.float32) -> jnp.ndarray:
    """Inverse of :func:`quantize_activation_groupwise`: ``q[..., k] * scale_inv[..., k // group_size]``.

    Args:
      q: ``[..., K]`` fp8; scale_inv: float32 ``[..., ceil(K/group_size)]``; out_dtype: result dtype.

    Raises:
      ValueError: mismatched scale shape.
    """
    *lead, k = q.shape
    kb = math.ceil(k / group_size)
    if tuple(scale_inv.shape) != (*lead, kb):
        raise ValueError(f"scale_inv shape {tuple(scale_inv.shape)} does not match activations {tuple(q.shape)} "
                         f"with group_size {group_size}: expected {(*lead, kb)}")
    qf = q.astype(jnp.float32)
    if kb * group_size == k:
        out = qf.reshape(*lead, kb, group_size) * scale_inv.astype(jnp.float32)[..., None]
        return out.reshape(q.shape).astype(out_dtype)
    s = jnp.repeat(scale_inv.astype(jnp.float32), group_size, axis=-1)[..., :k]
    return (qf * s).astype(out_dtype)


def fake_quantize_activation(x: jnp.ndarray, group_size: int = BLOCK_SIZE, *, ue8m0: bool = False,
                             recipe: QuantRecipe | None = None) -> jnp.ndarray:
    """Quantize-dequantize round trip of activations (1 x group_size e4m3), returned in ``x.dtype``.

    The simulated W8A8 path on CPU: the values that a real FP8 GEMM would consume. Not differentiable in a
    useful way (use :mod:`fp8rl_jax.fp8.dot_general` / :mod:`fp8rl_jax.fp8.training` for gradients).
    """
    q, s = quantize_activation_groupwise(x, group_size, ue8m0, recipe=recipe, check=False)
    return dequantize_activation_groupwise(q, s, group_size, out_dtype=x.dtype)


@functools.partial(jax.jit, static_argnames=("fp8_dtype", "fp8_max", "recipe"))
def _quantize_tensor(x, *, fp8_dtype, fp8_max, recipe):
    scale = compute_scale(block_amax(x, None), fp8_max, False, recipe=recipe)
    return scale_values(x, scale, fp8_dtype, fp8_max, recipe=recipe), scale


def quantize_per_tensor(x: jnp.ndarray, *, fp8_dtype=E4M3, fp8_max: float = E4M3_MAX,
                        recipe: QuantRecipe = VLLM_TENSOR_NATIVE, check: bool = True):
    """Dynamic per-tensor quantization: one float32 scale for the whole array.

    Default rounding = vLLM ``QuantFP8(static=False, group_shape=PER_TENSOR).forward_native``:
    ``s = max(amax / 448, 1/(448*512))``, ``q = cast(clip(x * (1/s)))``.

    Args:
      x: float array of any shape (size >= 1).

    Returns:
      ``(q, scale_inv)``: ``q`` like ``x`` in ``fp8_dtype``; ``scale_inv`` float32 scalar (shape ``()``).

    Raises:
      ValueError: non-float or empty input; (eager, ``check``) NaN/inf values.
    """
    _require("quantize_per_tensor", x, 0)
    if x.size == 0:
        raise ValueError("quantize_per_tensor: empty array")
    q, s = _quantize_tensor(x, fp8_dtype=jnp.dtype(fp8_dtype), fp8_max=float(fp8_max), recipe=recipe)
    if check:
        raise_if_nonfinite("quantize_per_tensor", x, s)
    return q, s


def quantize_per_token(x: jnp.ndarray, *, fp8_dtype=E4M3, fp8_max: float = E4M3_MAX,
                       recipe: QuantRecipe = VLLM_TENSOR_NATIVE, check: bool = True):
    """Dynamic per-token (per-row) quantization along the last axis.

    Default rounding = vLLM ``QuantFP8(static=False, group_shape=PER_TOKEN).forward_native``.

    Returns:
      ``(q, scale_inv)``: ``q`` ``[..., K]`` fp8, ``scale_inv`` float32 ``[..., 1]``.
    """
    _require("quantize_per_token", x, 1)
    return quantize_activation_groupwise(x, x.shape[-1], False, fp8_dtype=fp8_dtype, fp8_max=fp8_max,
                                         recipe=recipe, check=check)
