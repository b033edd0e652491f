"""Blockwise e4m3 quantization and dequantization (jnp reference; the oracle for the Pallas kernel).

Weights use 128x128 blocks, activations 1x128 groups along the last (K) axis, as DeepSeek-V3, vLLM
(``per_block_cast_to_fp8``, ``per_token_group_quant_fp8``) and DeepGEMM. Shapes not divisible by the block
size are zero-padded for the scale computation only (the padding never enters a block's amax beyond the real
values since |0| does not raise it). Values are clipped to +-fp8_max before the cast: JAX converts overflow
to NaN, whereas the contract saturates.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fp8rl_jax.fp8.formats import BLOCK_SIZE, E4M3, E4M3_MAX, compute_scale


def _check_finite_shape(name: str, x, ndim_min: int) -> None:
    if x.ndim < ndim_min:
        raise ValueError(f"{name}: expected an array with at least {ndim_min} dims, got shape {tuple(x.shape)}")


def quantize_weight_blockwise(
    w: jnp.ndarray,
    block_size: tuple[int, int] | int = BLOCK_SIZE,
    *,
    ue8m0: bool = False,
    fp8_dtype=E4M3,
    fp8_max: float = E4M3_MAX,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Quantize a weight matrix (or a stack of them) to e4m3 with one scale per 2-D block.

    Args:
      w: ``[..., N, K]`` float array (HF/vLLM layout ``[out_features, in_features]``); leading dims are
        independent matrices (stacked layers or experts).
      block_size: ``(bn, bk)`` or an int for square blocks; vLLM's ``weight_block_size`` (default 128x128).
      ue8m0: power-of-two scales.
      fp8_dtype, fp8_max: target format (e4m3 by default).

    Returns:
      ``(q, scale_inv)``: ``q`` is ``[..., N, K]`` in ``fp8_dtype``; ``scale_inv`` is float32
      ``[..., ceil(N/bn), ceil(K/bk)]`` with ``w ~= q * scale_inv`` blockwise.

    Raises:
      ValueError: fewer than 2 dims, or a non-positive block size.
    """
    _check_finite_shape("quantize_weight_blockwise", w, 2)
    bn, bk = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    if bn <= 0 or bk <= 0:
        raise ValueError(f"block_size must be positive, got {(bn, bk)}")
    *lead, n, k = w.shape
    nb, kb = math.ceil(n / bn), math.ceil(k / bk)
    wf = w.astype(jnp.float32)
    pad = [(0, 0)] * len(lead) + [(0, nb * bn - n), (0, kb * bk - k)]
    wp = jnp.pad(wf, pad).reshape(*lead, nb, bn, kb, bk)
    amax = jnp.max(jnp.abs(wp), axis=(-3, -1))  # [..., nb, kb]
    scale = compute_scale(amax, fp8_max, ue8m0)
    q = jnp.clip(wp / scale[..., :, None, :, None], -fp8_max, fp8_max).astype(fp8_dtype)
    q = q.reshape(*lead, nb * bn, kb * bk)[..., :n, :k]
    return q, scale


def dequantize_weight_blockwise(
    q: jnp.ndarray, scale_inv: jnp.ndarray, block_size: tuple[int, int] | int = BLOCK_SIZE, out_dtype=jnp.float32
) -> jnp.ndarray:
    """Inverse of :func:`quantize_weight_blockwise`: ``q[..., n, k] * scale_inv[..., n//bn, k//bk]``.

    Args:
      q: ``[..., N, K]`` fp8 array.
      scale_inv: float32 ``[..., ceil(N/bn), ceil(K/bk)]``.
      block_size: ``(bn, bk)`` or int.
      out_dtype: result dtype (the product is formed in float32 first).

    Raises:
      ValueError: ``scale_inv``'s shape does not match ``q``'s block grid.
    """
    bn, bk = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    *lead, n, k = q.shape
    want = (*lead, math.ceil(n / bn), math.ceil(k / bk))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"scale_inv shape {tuple(scale_inv.shape)} does not match weight {tuple(q.shape)} "
                         f"with block_size {(bn, bk)}: expected {want}")
    s = jnp.repeat(jnp.repeat(scale_inv.astype(jnp.float32), bn, axis=-2), bk, axis=-1)[..., :n, :k]
    return (q.astype(jnp.float32) * s).astype(out_dtype)


def quantize_activation_groupwise(
    x: jnp.ndarray, group_size: int = BLOCK_SIZE, *, ue8m0: bool = False, fp8_dtype=E4M3, fp8_max: float = E4M3_MAX
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Quantize activations per token in 1 x ``group_size`` groups along the last axis.

    Follows vLLM's ``per_token_group_quant_fp8`` (native path): ``s = max(amax, 1e-10) / 448`` per group,
    ``q = clip(x / s, -448, 448)``.

    Args:
      x: ``[..., K]`` float array.
      group_size: elements per group (128).

    Returns:
      ``(q, scale_inv)``: ``q`` ``[..., K]`` fp8; ``scale_inv`` float32 ``[..., ceil(K/group_size)]``.
    """
    _check_finite_shape("quantize_activation_groupwise", x, 1)
    *lead, k = x.shape
    kb = math.ceil(k / group_size)
    xp = jnp.pad(x.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, kb * group_size - k)])
    xp = xp.reshape(*lead, kb, group_size)
    scale = compute_scale(jnp.max(jnp.abs(xp), axis=-1), fp8_max, ue8m0)
    q = jnp.clip(xp / scale[..., None], -fp8_max, fp8_max).astype(fp8_dtype)
    return q.reshape(*lead, kb * group_size)[..., :k], scale


def dequantize_activation_groupwise(q: jnp.ndarray, scale_inv: jnp.ndarray, group_size: int = BLOCK_SIZE,
                                    out_dtype=jnp.float32) -> jnp.ndarray:
    """Inverse of :func:`quantize_activation_groupwise`: ``q[..., k] * scale_inv[..., k // group_size]``."""
    k = q.shape[-1]
    s = jnp.repeat(scale_inv.astype(jnp.float32), group_size, axis=-1)[..., :k]
    return (q.astype(jnp.float32) * s).astype(out_dtype)


def fake_quantize_activation(x: jnp.ndarray, group_size: int = BLOCK_SIZE, *, ue8m0: bool = False) -> jnp.ndarray:
    """Quantize-dequantize round trip of activations (1 x group_size e4m3), in ``x.dtype``.

    The simulated W8A8 path on CPU: the values that a real FP8 GEMM would consume.
    """
    q, s = quantize_activation_groupwise(x, group_size, ue8m0=ue8m0)
    return dequantize_activation_groupwise(q, s, group_size, out_dtype=x.dtype)


def check_finite(name: str, x) -> None:
    """Raise ``ValueError`` naming ``name`` if a concrete array holds NaN or inf (not for traced values)."""
    if isinstance(x, jax.core.Tracer):
        return
    if not bool(jnp.all(jnp.isfinite(jnp.asarray(x, jnp.float32)))):
        raise ValueError(f"{name}: contains NaN or inf values; refusing to quantize")
