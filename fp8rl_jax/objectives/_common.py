"""Shared helpers for the objectives package: masked reductions, validation, the exp safety bound.

Every reduction here is safe on an empty selection (all-masked row or batch): it returns 0 instead of
NaN, and its gradient is finite. Inputs outside ``response_mask`` are never read numerically (they are
replaced by 0 through ``jnp.where`` before any arithmetic), so padding may hold anything, even -inf.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import jax.numpy as jnp

#: verl's ``SAFETY_BOUND`` (verl/trainer/ppo/rollout_corr_helper.py): log-ratios are clamped to +-20 before
#: ``exp`` (exp(20) ~ 4.85e8), and PPO's ``negative_approx_kl`` uses the same +-20 clamp.
SAFETY_BOUND = 20.0


def as_mask(response_mask) -> jnp.ndarray:
    """``response_mask`` (bool / int / float, nonzero = real token) as a float32 0/1 array."""
    return (jnp.asarray(response_mask) != 0).astype(jnp.float32)


def check_same_shape(**arrays) -> None:
    """Raise ValueError naming the arrays when their shapes differ (``None`` entries are skipped)."""
    items = [(k, tuple(jnp.shape(v))) for k, v in arrays.items() if v is not None]
    if not items:
        return
    ref_name, ref_shape = items[0]
    for name, shape in items[1:]:
        if shape != ref_shape:
            listing = ", ".join(f"{k}{s}" for k, s in items)
            raise ValueError(f"shape mismatch: {name}{shape} vs {ref_name}{ref_shape} (got {listing})")
    if len(ref_shape) != 2:
        raise ValueError(f"{ref_name}: expected a [B, T] array, got shape {ref_shape}")


def check_choice(name: str, value, valid: Iterable) -> None:
    """Raise ValueError listing the valid values when ``value`` is not one of them."""
    valid = tuple(valid)
    if value not in valid:
        raise ValueError(f"invalid {name}={value!r}; valid values: {', '.join(repr(v) for v in valid)}")


def broadcast_advantages(advantages, shape, *, name: str = "advantages") -> jnp.ndarray:
    """``advantages`` [B] or [B, T] -> float32 [B, T]; ValueError naming the arrays on mismatch."""
    a = jnp.asarray(advantages, jnp.float32)
    if a.ndim == 1:
        if a.shape[0] != shape[0]:
            raise ValueError(f"shape mismatch: {name}{tuple(a.shape)} vs response_mask{tuple(shape)}")
        return jnp.broadcast_to(a[:, None], shape)
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"shape mismatch: {name}{tuple(a.shape)} vs response_mask{tuple(shape)}")
    return a


def masked_sum(values, mask, axis=None) -> jnp.ndarray:
    """``sum(values * mask)`` with values outside the mask replaced by 0 first (NaN/inf-safe)."""
    m = jnp.asarray(mask, jnp.float32)
    v = jnp.where(m != 0, values, 0.0)
    return jnp.sum(v * m, axis=axis)


def masked_mean(values, mask, axis=None) -> jnp.ndarray:
    """``masked_sum / count`` where the count is the mask sum; 0 where the count is 0 (never NaN)."""
    m = jnp.asarray(mask, jnp.float32)
    cnt = jnp.sum(m, axis=axis)
    s = masked_sum(values, m, axis=axis)
    return jnp.where(cnt > 0, s / jnp.where(cnt > 0, cnt, 1.0), 0.0)


def masked_max(values, mask, axis=None) -> jnp.ndarray:
    """Max over the masked entries; 0 where nothing is selected."""
    m = jnp.asarray(mask) != 0
    v = jnp.where(m, values, -jnp.inf)
    out = jnp.max(v, axis=axis)
    return jnp.where(jnp.any(m, axis=axis), out, 0.0)


def masked_min(values, mask, axis=None) -> jnp.ndarray:
    """Min over the masked entries; 0 where nothing is selected."""
    m = jnp.asarray(mask) != 0
    v = jnp.where(m, values, jnp.inf)
    out = jnp.min(v, axis=axis)
    return jnp.where(jnp.any(m, axis=axis), out, 0.0)


def masked_std(values, mask, ddof: int = 0) -> jnp.ndarray:
    """Standard deviation over the masked entries (population by default); 0 when fewer than ddof+1."""
    m = jnp.asarray(mask, jnp.float32)
    cnt = jnp.sum(m)
    mean = masked_mean(values, m)
    var_sum = masked_sum(jnp.square(jnp.where(m != 0, values, 0.0) - mean), m)
    denom = cnt - ddof
    var = jnp.where(denom > 0, var_sum / jnp.where(denom > 0, denom, 1.0), 0.0)
    return jnp.sqrt(jnp.maximum(var, 0.0))


def safe_log_ratio(a, b, mask) -> jnp.ndarray:
    """``a - b`` on real tokens, 0 on padding (so padding never produces NaN/inf downstream)."""
    m = jnp.asarray(mask) != 0
    return jnp.where(m, jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32), 0.0)


def prefix(metrics: Mapping[str, jnp.ndarray], pre: str) -> dict:
    """Return ``{pre + k: v}``."""
    return {f"{pre}{k}": v for k, v in metrics.items()}
