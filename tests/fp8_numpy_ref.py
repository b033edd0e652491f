"""An independent FP8 blockwise quantizer in numpy float32/float64 + ml_dtypes (the reference for kernel tests).

Shares nothing with ``fp8rl_jax.fp8`` but the :class:`~fp8rl_jax.fp8.formats.QuantRecipe` field values (which
rounding steps a vLLM function takes). Every float32 operation is numpy's, i.e. IEEE round-to-nearest-even
on the host CPU; the e4m3 cast is ml_dtypes' (round-to-nearest-even, saturated here by a clip to +-448 first, as
the contract says). UE8M0 is ``2 ** ceil(RN_fp32(log2(s)))`` with log2 computed in float64 (the semantics of
torch's ``exp2(ceil(log2(s)))`` with a correctly rounded float32 log2).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

F32 = np.float32


def _scale(amax: np.ndarray, recipe, ue8m0: bool, fp8_max: float) -> np.ndarray:
    a = amax.astype(F32)
    if recipe.amax_floor:
        a = np.maximum(a, F32(recipe.amax_floor))
    s = a * F32(1.0 / fp8_max) if recipe.scale_by_reciprocal else a / F32(fp8_max)
    if ue8m0:
        with np.errstate(divide="ignore"):
            e = np.ceil(np.log2(s.astype(np.float64)).astype(F32))
        s = np.where(s > 0, np.exp2(e.astype(np.float64)), 0.0).astype(F32)
    if recipe.scale_floor:
        s = np.maximum(s, F32(recipe.scale_floor))
    return s.astype(F32)


def _cast(x: np.ndarray, s: np.ndarray, recipe, fp8_max: float) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        v = x * (F32(1.0) / s) if recipe.value_by_reciprocal else x / s
    v = np.clip(v.astype(F32), -F32(fp8_max), F32(fp8_max))
    return v.astype(ml_dtypes.float8_e4m3fn)


def quantize_blocks(x, bn: int, bk: int, recipe, ue8m0: bool = False, fp8_max: float = 448.0):
    """``x [..., N, K]`` (any float dtype; exact in float32) -> ``(q e4m3 [..., N, K], scale_inv f32 [..., ceil(N/bn),
    ceil(K/bk)])``, blocks zero-padded at ragged edges. ``bn = 1`` gives 1 x bk activation groups, whose scales
    are returned as ``[..., N, ceil(K/bk)]``."""
    x = np.asarray(x).astype(F32)
    *lead, n, k = x.shape
    nb, kb = -(-n // bn), -(-k // bk)
    xp = np.zeros((*lead, nb * bn, kb * bk), F32)
    xp[..., :n, :k] = x
    blocks = xp.reshape(*lead, nb, bn, kb, bk)
    amax = np.abs(blocks).max(axis=(-3, -1))  # [..., nb, kb]
    s = _scale(amax, recipe, ue8m0, fp8_max)
    q = _cast(blocks, s[..., :, None, :, None], recipe, fp8_max).reshape(*lead, nb * bn, kb * bk)
    return q[..., :n, :k], s


def dequantize_blocks(q, s, bn: int, bk: int) -> np.ndarray:
    """float64 ``q * scale_inv`` with each scale broadcast over its block (the exact product)."""
    q64 = np.asarray(q).astype(np.float64)
    n, k = q64.shape[-2:]
    s64 = np.repeat(np.repeat(np.asarray(s, np.float64), bn, axis=-2), bk, axis=-1)
    return q64 * s64[..., :n, :k]
