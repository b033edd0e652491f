"""Training/inference mismatch diagnostics (verl's off-policy metrics + NeMo-RL's token_mult_prob_error).

Source of the definitions and names: verl ``compute_offpolicy_metrics`` /
``compute_rollout_corr_metrics_from_logprobs`` (verl/trainer/ppo/rollout_corr_helper.py) and NeMo-RL
``ClippedPGLossFn`` (nemo_rl/algorithms/loss/loss_functions.py; docs/guides/grpo.md "Multiplicative Token
Probability Error").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8rl_jax.objectives._common import (
    SAFETY_BOUND,
    as_mask,
    check_same_shape,
    masked_max,
    masked_mean,
    masked_min,
    masked_sum,
    safe_log_ratio,
)

__all__ = ["rollout_corr_metrics", "routing_mismatch", "token_mult_prob_error"]


def token_mult_prob_error(old_logprobs, rollout_logprobs, response_mask) -> jnp.ndarray:
    """NeMo-RL's multiplicative token probability error ``mean_m exp(|old_logprobs - rollout_logprobs|)``.

    Equals 1.0 when the trainer and the inference engine agree; NeMo-RL flags values above ~1.05
    (docs/guides/grpo.md; ``ClippedPGLossFn``: ``masked_mean(exp(|gen - prev| * mask), mask)``).
    The exponent is clamped at 20 (verl's SAFETY_BOUND) so the result stays finite.

    Args:
      old_logprobs, rollout_logprobs: float ``[B, T]``; response_mask: ``[B, T]``.

    Returns:
      float32 scalar (0 for an entirely masked batch).

    Raises:
      ValueError: shape mismatch (names the arrays).
    """
    check_same_shape(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, response_mask=response_mask)
    m = as_mask(response_mask)
    d = jnp.abs(safe_log_ratio(old_logprobs, rollout_logprobs, m))
    return masked_mean(jnp.exp(jnp.minimum(d, SAFETY_BOUND)), m)


def rollout_corr_metrics(old_logprobs, rollout_logprobs, response_mask, prefix: str = "rollout_corr/") -> dict:
    """Off-policy diagnostics between the trainer's and the inference engine's log-probs.

    With ``lr = old_logprobs - rollout_logprobs`` (log rho, rho = pi_train / pi_rollout), ``mean_m`` the
    mean over real tokens, ``mean_s`` the mean over non-empty sequences and ``lp_b = mean_t lp`` per
    sequence (verl's names and formulas, ``compute_offpolicy_metrics``):

    ==================  =============================================================================
    kl                  ``mean_m(rollout_logprobs - old_logprobs)`` (k1 of KL(pi_rollout || pi_train))
    k3_kl               ``mean_m(exp(lr) - lr - 1)`` (k3 of the same KL; Schulman's estimator)
    training_ppl        ``mean_s exp(-lp_b(old))``; ``training_log_ppl = mean_s(-lp_b(old))``
    rollout_ppl         ``mean_s exp(-lp_b(rollout))``; ``rollout_log_ppl = mean_s(-lp_b(rollout))``
    log_ppl_diff        ``mean_s(lp_b(rollout) - lp_b(old))`` (+ ``log_ppl_abs_diff``,
                        ``log_ppl_diff_max``, ``log_ppl_diff_min``)
    ppl_ratio           ``mean_s exp(lp_b(rollout) - lp_b(old))`` (training ppl / rollout ppl)
    chi2_token          ``mean_m(rho^2) - 1`` with ``rho = exp(clamp(lr, +-20))``
    chi2_seq            ``mean_s exp(2 clamp(sum_t lr, +-20)) - 1``
    token_mult_prob_error  NeMo-RL's ``mean_m exp(|lr|)`` (see ``token_mult_prob_error``)
    ==================  =============================================================================

    Differences from verl (documented in docs/ROLLOUT_CORRECTION.md): empty (all-masked) rows are left out
    of the sequence means (verl averages them in with a per-row value of ``exp(0)``), every ``exp`` takes
    an exponent clamped to +-20 (verl clamps only rho and chi2), and an entirely masked batch gives 0 for
    every metric instead of raising. Call it with the current policy's log-probs in place of
    ``old_logprobs`` for verl's ``compute_rollout_corr_metrics_from_logprobs``.

    Args:
      old_logprobs: trainer log-probs ``[B, T]`` float32.
      rollout_logprobs: inference-engine sampled-token log-probs ``[B, T]``.
      response_mask: ``[B, T]`` bool/float.
      prefix: key prefix (verl: ``"rollout_corr/"``).

    Returns:
      dict of float32 scalars, stop-gradient.

    Raises:
      ValueError: shape mismatch (names the arrays).
    """
    check_same_shape(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, response_mask=response_mask)
    m = as_mask(response_mask)
    old = jnp.where(m != 0, jnp.asarray(old_logprobs, jnp.float32), 0.0)
    roll = jnp.where(m != 0, jnp.asarray(rollout_logprobs, jnp.float32), 0.0)
    lr = old - roll
    seq_valid = (jnp.sum(m, axis=-1) > 0).astype(jnp.float32)

    def exp_safe(x):
        return jnp.exp(jnp.clip(x, -SAFETY_BOUND, SAFETY_BOUND))

    lp_old = masked_mean(old, m, axis=-1)
    lp_roll = masked_mean(roll, m, axis=-1)
    log_ppl_diff = lp_roll - lp_old
    lr_sum = masked_sum(lr, m, axis=-1)
    out = {
        "training_ppl": masked_mean(exp_safe(-lp_old), seq_valid),
        "training_log_ppl": masked_mean(-lp_old, seq_valid),
        "kl": masked_mean(roll - old, m),
        "k3_kl": masked_mean(jnp.expm1(jnp.clip(lr, -SAFETY_BOUND, SAFETY_BOUND)) - lr, m),  # expm1: exact near 0
        "rollout_ppl": masked_mean(exp_safe(-lp_roll), seq_valid),
        "rollout_log_ppl": masked_mean(-lp_roll, seq_valid),
        "log_ppl_diff": masked_mean(log_ppl_diff, seq_valid),
        "log_ppl_abs_diff": masked_mean(jnp.abs(log_ppl_diff), seq_valid),
        "log_ppl_diff_max": masked_max(log_ppl_diff, seq_valid),
        "log_ppl_diff_min": masked_min(log_ppl_diff, seq_valid),
        "ppl_ratio": masked_mean(exp_safe(log_ppl_diff), seq_valid),
        "chi2_token": jnp.where(jnp.sum(m) > 0, masked_mean(jnp.square(exp_safe(lr)), m) - 1.0, 0.0),
        "chi2_seq": jnp.where(
            jnp.sum(seq_valid) > 0,
            masked_mean(jnp.exp(2.0 * jnp.clip(lr_sum, -SAFETY_BOUND, SAFETY_BOUND)), seq_valid) - 1.0,
            0.0,
        ),
        "token_mult_prob_error": masked_mean(exp_safe(jnp.abs(lr)), m),
    }
    return jax.lax.stop_gradient({f"{prefix}{k}": v for k, v in out.items()})


def routing_mismatch(trainer_experts, rollout_experts, response_mask, moe_layers=None) -> jnp.ndarray:
    """Share of response tokens whose trainer top-k expert set differs from the rollout's (MoE routing mismatch).

    For each MoE layer ``l``: ``mean_m [sort(trainer[b, t, l]) != sort(rollout[b, t, l])]`` over real response
    tokens that have a rollout record (all ids ``>= 0``); the result is the mean over ``moe_layers``. Set
    comparison: the order of the k ids does not matter. Logged as ``rollout_corr/routing_mismatch``; the quantity
    rollout routing replay (R3, arXiv 2510.11370) removes from the trainer's forward.

    Args:
      trainer_experts: int ``[B, T, L, k]`` the trainer router's own top-k ids on the response tokens.
      rollout_experts: int ``[B, T, L, k]`` the engine's record (``RolloutBatch.routed_experts``; -1 = none).
      response_mask: ``[B, T]`` bool/float.
      moe_layers: static sequence of layer indices to average over (default: all ``L``).

    Returns:
      float32 scalar in [0, 1], stop-gradient (0 when no token has a record).

    Raises:
      ValueError: shape mismatch (names the arrays).
    """
    te, re = jnp.asarray(trainer_experts), jnp.asarray(rollout_experts)
    if te.shape != re.shape:
        raise ValueError(f"routing_mismatch: shape mismatch: trainer_experts{tuple(te.shape)} vs "
                         f"rollout_experts{tuple(re.shape)}")
    if te.ndim != 4 or tuple(te.shape[:2]) != tuple(jnp.shape(response_mask)):
        raise ValueError(f"routing_mismatch: experts must be [B, T, L, k] with [B, T] = response_mask's "
                         f"{tuple(jnp.shape(response_mask))}, got {tuple(te.shape)}")
    layers = list(range(te.shape[2])) if moe_layers is None else [int(i) for i in moe_layers]
    if not layers:
        return jnp.float32(0.0)
    te, re = te[:, :, layers], re[:, :, layers]
    differs = jnp.any(jnp.sort(te, axis=-1) != jnp.sort(re, axis=-1), axis=-1).astype(jnp.float32)  # [B, T, L']
    m = (as_mask(response_mask) != 0)[:, :, None] & jnp.all(re >= 0, axis=-1)                          # [B, T, L']
    m = m.astype(jnp.float32)
    per_layer = jnp.sum(differs * m, axis=(0, 1)) / jnp.maximum(jnp.sum(m, axis=(0, 1)), 1.0)
    return jax.lax.stop_gradient(jnp.mean(per_layer))
