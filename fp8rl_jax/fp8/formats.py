"""FP8 format constants and scale rules (the contract in shared/DESIGN.md).

e4m3 is ``float8_e4m3fn`` (finite-only, max 448), the format of vLLM/DeepGEMM blockwise FP8 checkpoints.
Scales follow DeepSeek-V3 / vLLM: ``s = max(amax, eps) / 448`` stored as ``scale_inv`` (the multiplier that
dequantizes, ``x ~= q * s``), optionally rounded up to a power of two (UE8M0, DeepGEMM on Blackwell).
"""

from __future__ import annotations

import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
# Floor of amax before dividing; vLLM's per_token_group_quant_fp8 uses eps=1e-10.
SCALE_EPS = 1e-10
BLOCK_SIZE = 128

FP8_DTYPES = {"e4m3": (E4M3, E4M3_MAX), "e5m2": (E5M2, E5M2_MAX)}


def fp8_dtype(name: str):
    """Return ``(jnp dtype, max finite value)`` for ``name`` in {"e4m3", "e5m2"}.

    Raises:
      ValueError: unknown format name.
    """
    try:
        return FP8_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown FP8 format {name!r}; expected one of {sorted(FP8_DTYPES)}") from None


def compute_scale(amax: jnp.ndarray, fp8_max: float = E4M3_MAX, ue8m0: bool = False, eps: float = SCALE_EPS) -> jnp.ndarray:
    """Per-block dequantization scale ``scale_inv`` from the block's absolute maximum.

    Args:
      amax: float32 array of block maxima (any shape), ``>= 0``.
      fp8_max: largest finite value of the target format (448 for e4m3).
      ue8m0: round the scale up to a power of two (``2**ceil(log2(s))``), DeepGEMM's UE8M0 scale format.
      eps: floor applied to ``amax`` so all-zero blocks get a tiny positive scale, not 0 (vLLM: 1e-10).

    Returns:
      float32 array of the same shape: ``s = max(amax, eps) / fp8_max`` (or its UE8M0 rounding).
    """
    s = jnp.maximum(amax.astype(jnp.float32), eps) / fp8_max
    if ue8m0:
        s = jnp.exp2(jnp.ceil(jnp.log2(s)))
    return s
