"""Policy-gradient losses (PPO clip with clip-higher and dual clip, REINFORCE, GSPO) and loss aggregation.

Semantics follow verl (verl/trainer/ppo/core_algos.py: ``agg_loss``, ``compute_policy_loss_vanilla``,
``compute_policy_loss_gspo``, ``compute_policy_loss_reinforce``). All functions are pure, jit/grad-safe,
and finite on empty rows, an entirely masked batch and log-ratios of any size; padded positions of the
log-prob arrays are never read numerically (they may hold -inf).

Shapes: ``logprobs``/``old_logprobs``/``rollout_logprobs``/``response_mask``/``token_weights`` are
``[B, T]`` (float32; the mask may be bool); ``advantages`` is ``[B]`` (broadcast over tokens) or ``[B, T]``.
Metrics are float32 scalars (``jnp`` arrays, not Python floats, so they live inside ``jit``).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from fp8rl_jax.objectives._common import (
    SAFETY_BOUND,
    as_mask,
    broadcast_advantages,
    check_choice,
    check_same_shape,
    masked_mean,
    masked_sum,
    safe_log_ratio,
)

__all__ = ["LOSS_AGG_MODES", "agg_loss", "ppo_clip_loss", "reinforce_loss", "gspo_loss"]

#: Valid ``loss_agg_mode`` values (verl's names).
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def agg_loss(loss_mat, response_mask, mode: str = "token-mean", loss_scale_factor: Optional[float] = None):
    """Aggregate a per-token loss matrix into a scalar, verl's ``agg_loss`` semantics.

    With ``m`` the 0/1 mask, ``L`` the loss matrix, ``n_b = sum_t m_bt`` and ``S = #{b : n_b > 0}``:

    - ``"token-mean"``: ``sum_bt L m / sum_bt m`` (DAPO token-level loss).
    - ``"seq-mean-token-sum"``: ``sum_b (sum_t L m) / S`` (empty rows excluded).
    - ``"seq-mean-token-mean"``: ``sum_b (sum_t L m / n_b) / S`` (GRPO's original; empty rows excluded).
    - ``"seq-mean-token-sum-norm"``: ``sum_bt L m / loss_scale_factor`` with the default factor ``T``
      (Dr. GRPO, Liu et al. 2025, a constant normalizer; verl divides by ``loss_mask.shape[-1]``).

    Source: verl/trainer/ppo/core_algos.py ``agg_loss`` (single data-parallel rank, ``dp_size=1``). Where
    verl would divide by zero (an entirely masked batch), the result here is 0.

    Args:
      loss_mat: float ``[B, T]``; values outside the mask are ignored (may be non-finite).
      response_mask: ``[B, T]`` bool/float, nonzero = real token.
      mode: one of ``LOSS_AGG_MODES``.
      loss_scale_factor: constant divisor for ``"seq-mean-token-sum-norm"``; ``None`` means ``T``.

    Returns:
      float32 scalar.

    Raises:
      ValueError: unknown ``mode`` (lists the valid ones) or shapes differ (names the arrays).
    """
    check_choice("loss_agg_mode", mode, LOSS_AGG_MODES)
    check_same_shape(loss_mat=loss_mat, response_mask=response_mask)
    m = as_mask(response_mask)
    if mode == "token-mean":
        return masked_mean(loss_mat, m)
    seq_sum = masked_sum(loss_mat, m, axis=-1)  # [B]
    n_tok = jnp.sum(m, axis=-1)
    if mode == "seq-mean-token-sum-norm":
        factor = float(m.shape[-1]) if loss_scale_factor is None else float(loss_scale_factor)
        if factor <= 0:
            raise ValueError(f"loss_scale_factor must be positive, got {loss_scale_factor}")
        return jnp.sum(seq_sum) / factor
    seq_valid = (n_tok > 0).astype(jnp.float32)
    if mode == "seq-mean-token-mean":
        seq_sum = seq_sum / jnp.where(n_tok > 0, n_tok, 1.0)
    return masked_mean(seq_sum, seq_valid)


def _check_inputs(logprobs, old_logprobs, advantages, response_mask, token_weights):
    check_same_shape(
        logprobs=logprobs, old_logprobs=old_logprobs, response_mask=response_mask, token_weights=token_weights
    )
    return broadcast_advantages(advantages, jnp.shape(response_mask))


def _weighted_agg(pg_losses, token_weights, m, loss_agg_mode, loss_scale_factor):
    """Multiply per-token losses by stop-gradient correction weights (0 on padding), then :func:`agg_loss`."""
    if token_weights is not None:
        w = jax.lax.stop_gradient(jnp.asarray(token_weights, jnp.float32))
        pg_losses = pg_losses * jnp.where(m != 0, w, 0.0)
    return agg_loss(pg_losses, m, loss_agg_mode, loss_scale_factor)


def ppo_clip_loss(
    logprobs,
    old_logprobs,
    advantages,
    response_mask,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: Optional[float] = None,
    token_weights=None,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: Optional[float] = None,
):
    """PPO clipped surrogate with asymmetric clip (DAPO clip-higher) and optional dual clip.

    Per token, with ``d = clamp(logprobs - old_logprobs, -20, 20)`` and ``r = exp(d)``::

        L1 = -A * r
        L2 = -A * clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)
        L  = max(L1, L2)                                  (Schulman et al. 2017, eq. 7; Yu et al. 2025 DAPO)
        L  = min(L, -A * clip_ratio_c)  where A < 0       (dual clip, Ye et al. 2020, arXiv 1912.09729)
        L  = L * token_weights                            (rollout-correction weights, stop-gradient)

    then ``agg_loss(L, response_mask, loss_agg_mode)``. Source: verl ``compute_policy_loss_vanilla``
    (verl/trainer/ppo/core_algos.py); unlike verl (which always applies ``clip_ratio_c=3.0``), the dual
    clip is off unless ``clip_ratio_c`` is given.

    Args:
      logprobs: current policy's sampled-token log-probs ``[B, T]`` (the differentiated input).
      old_logprobs: the "old" policy's log-probs ``[B, T]`` (treated as constants; stop-gradient applied).
      advantages: ``[B]`` or ``[B, T]``.
      response_mask: ``[B, T]``, nonzero = real response token.
      clip_ratio_low, clip_ratio_high: ``eps_low``, ``eps_high`` (clip-higher uses e.g. 0.2 / 0.28).
      clip_ratio_c: dual-clip constant (> 1) or ``None``.
      token_weights: optional ``[B, T]`` rollout-correction weights (stop-gradient applied here too).
      loss_agg_mode: one of ``LOSS_AGG_MODES``.
      loss_scale_factor: see ``agg_loss``.

    Returns:
      ``(loss, metrics)``: float32 scalar and ``{"actor/pg_loss", "actor/pg_clipfrac",
      "actor/pg_clipfrac_lower", "actor/ppo_kl"}`` where ``pg_clipfrac = mean_m[L2 > L1]``,
      ``pg_clipfrac_lower = mean_m[(max(L1,L2) > -A c) & (A < 0)]`` (0 without dual clip) and
      ``ppo_kl = mean_m[-d]`` (k1 estimate of KL(old || current)), all masked by ``response_mask``.

    Raises:
      ValueError: shape mismatch (names the arrays), bad ``loss_agg_mode``, ``clip_ratio_c <= 1``,
        negative clip ratios.
    """
    adv = _check_inputs(logprobs, old_logprobs, advantages, response_mask, token_weights)
    check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(f"clip ratios must be >= 0, got low={clip_ratio_low}, high={clip_ratio_high}")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")
    m = as_mask(response_mask)
    old = jax.lax.stop_gradient(jnp.asarray(old_logprobs, jnp.float32))
    adv = jax.lax.stop_gradient(jnp.where(m != 0, adv, 0.0))
    neg_kl = jnp.clip(safe_log_ratio(logprobs, old, m), -SAFETY_BOUND, SAFETY_BOUND)
    ratio = jnp.exp(neg_kl)
    l1 = -adv * ratio
    l2 = -adv * jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped = jnp.maximum(l1, l2)
    if clip_ratio_c is not None:
        l3 = -adv * clip_ratio_c
        pg_losses = jnp.where(adv < 0, jnp.minimum(l3, clipped), clipped)
        clipfrac_lower = masked_mean(((clipped > l3) & (adv < 0)).astype(jnp.float32), m)
    else:
        pg_losses = clipped
        clipfrac_lower = jnp.zeros((), jnp.float32)
    loss = _weighted_agg(pg_losses, token_weights, m, loss_agg_mode, loss_scale_factor)
    metrics = {
        "actor/pg_loss": loss,
        "actor/pg_clipfrac": masked_mean((l2 > l1).astype(jnp.float32), m),
        "actor/pg_clipfrac_lower": clipfrac_lower,
        "actor/ppo_kl": masked_mean(-neg_kl, m),
    }
    return loss, jax.lax.stop_gradient(metrics)


def reinforce_loss(
    logprobs,
    rollout_logprobs,
    advantages,
    response_mask,
    token_weights=None,
    loss_agg_mode: str = "seq-mean-token-sum",
    loss_scale_factor: Optional[float] = None,
):
    """REINFORCE / vanilla policy gradient with optional explicit IS weights (verl's bypass ``reinforce``).

    Per token ``L = -A * logprobs * w`` with ``w = token_weights`` (stop-gradient; 1 when ``None``), so
    ``grad L = -A * w * grad log pi`` (the IS-corrected policy gradient, Williams 1992). Source: verl
    ``compute_policy_loss_reinforce`` (verl/trainer/ppo/core_algos.py), whose default aggregation is
    ``"seq-mean-token-sum"``.

    Args:
      logprobs: current policy log-probs ``[B, T]`` (differentiated).
      rollout_logprobs: behaviour-policy log-probs ``[B, T]``, used only for the ``actor/ppo_kl`` metric.
      advantages: ``[B]`` or ``[B, T]``; response_mask: ``[B, T]``.
      token_weights: optional ``[B, T]`` IS weights; loss_agg_mode / loss_scale_factor: see ``agg_loss``.

    Returns:
      ``(loss, {"actor/pg_loss", "actor/ppo_kl"})`` with ``ppo_kl = mean_m[rollout_logprobs - logprobs]``.

    Raises:
      ValueError: shape mismatch (names the arrays) or bad ``loss_agg_mode``.
    """
    adv = _check_inputs(logprobs, rollout_logprobs, advantages, response_mask, token_weights)
    check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    m = as_mask(response_mask)
    adv = jax.lax.stop_gradient(jnp.where(m != 0, adv, 0.0))
    lp = jnp.where(m != 0, jnp.asarray(logprobs, jnp.float32), 0.0)
    pg_losses = -adv * lp
    loss = _weighted_agg(pg_losses, token_weights, m, loss_agg_mode, loss_scale_factor)
    kl = masked_mean(-safe_log_ratio(logprobs, rollout_logprobs, m), m)
    return loss, jax.lax.stop_gradient({"actor/pg_loss": loss, "actor/ppo_kl": kl})


def gspo_loss(
    logprobs,
    old_logprobs,
    advantages,
    response_mask,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    token_weights=None,
    loss_agg_mode: str = "seq-mean-token-mean",
    loss_scale_factor: Optional[float] = None,
):
    """GSPO: sequence-level (length-normalized) importance ratio with clipping (Zheng et al. 2025,
    arXiv 2507.18071, eq. 5-7 with the token-level GSPO-token gradient form).

    With ``n_b = sum_t m_bt`` and ``s_b = exp(sum_t m (logprobs - old) / max(n_b, 1))``, the per-token
    ratio is ``s_bt = sg[s_b] * pi_t / sg[pi_t]``, i.e. in log space
    ``log s_bt = min(logprobs - sg(logprobs) + sg(log s_b), 10)``; then
    ``L = max(-A s_bt, -A clip(s_bt, 1 - eps_low, 1 + eps_high)) * token_weights``.
    Source: verl ``compute_policy_loss_gspo`` (clamp at 10, aggregation forced to ``seq-mean-token-mean``
    there; here ``loss_agg_mode`` defaults to it but may be changed). The default clip ranges are the
    paper's (3e-4 / 4e-4).

    Args / Returns / Raises: as ``ppo_clip_loss`` (metrics ``actor/pg_loss``, ``actor/pg_clipfrac``,
    ``actor/ppo_kl``).
    """
    adv = _check_inputs(logprobs, old_logprobs, advantages, response_mask, token_weights)
    check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    m = as_mask(response_mask)
    old = jax.lax.stop_gradient(jnp.asarray(old_logprobs, jnp.float32))
    adv = jax.lax.stop_gradient(jnp.where(m != 0, adv, 0.0))
    lp = jnp.where(m != 0, jnp.asarray(logprobs, jnp.float32), 0.0)
    neg_kl = safe_log_ratio(logprobs, old, m)
    n_tok = jnp.sum(m, axis=-1)
    seq_log = jnp.sum(neg_kl * m, axis=-1) / jnp.maximum(n_tok, 1.0)
    log_s = lp - jax.lax.stop_gradient(lp) + jax.lax.stop_gradient(seq_log)[:, None]
    log_s = jnp.minimum(log_s, 10.0)
    # lower clamp only for float safety (exp underflows to 0 anyway below ~-87)
    s = jnp.exp(jnp.maximum(log_s, -SAFETY_BOUND * 4))
    l1 = -adv * s
    l2 = -adv * jnp.clip(s, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses = jnp.maximum(l1, l2)
    loss = _weighted_agg(pg_losses, token_weights, m, loss_agg_mode, loss_scale_factor)
    metrics = {
        "actor/pg_loss": loss,
        "actor/pg_clipfrac": masked_mean((l2 > l1).astype(jnp.float32), m),
        "actor/pg_clipfrac_lower": jnp.zeros((), jnp.float32),
        "actor/ppo_kl": masked_mean(-neg_kl, m),
    }
    return loss, jax.lax.stop_gradient(metrics)
