"""A rollout correction that drops (almost) every token says so.

Rejection-style corrections (``rollout_rs``, the veto, ``geo_rs``, TIS in mask mode) take tokens or whole rows out
of the loss. With an FP8 rollout a strict one can take out all of them: ``decoupled_geo_rs`` keeps 0% of the rows of
an FP8 batch of the quickstart (examples/correction.ipynb), and the policy then trains on nothing while the run looks
healthy. The trainer logs ``rollout_corr/kept_token_fraction`` (:func:`kept_token_fraction`) every step and
:class:`KeptFractionWatch` warns once when it stays below ``train.min_kept_fraction`` for
``train.min_kept_fraction_steps`` steps in a row.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fp8rl_jax import objectives


def _kept_token_fraction(loss_config, target, rollout_logprobs, response_mask, advantages):
    from fp8rl_jax.objectives._common import as_mask
    from fp8rl_jax.objectives.rollout_correction import apply_transform

    m = as_mask(response_mask)
    c = apply_transform(objectives.correction_transform(loss_config), target, rollout_logprobs, m, advantages)
    rc = loss_config.rollout_correction
    kept = (c.mask > 0) & (m > 0)
    if not rc.bypass_mode or rc.loss_type == "reinforce":  # bypass PPO-clip ignores the correction weights
        kept = kept & (c.weights > 0)
    real = jnp.sum(m > 0)
    return jnp.where(real > 0, jnp.sum(kept) / jnp.maximum(real, 1), jnp.nan)


_kept_token_fraction_jit = jax.jit(_kept_token_fraction, static_argnums=0)


def kept_token_fraction(loss_config, old_logprobs, rollout_logprobs, response_mask, advantages=None) -> float:
    """Fraction of the real response tokens that the rollout correction of ``loss_config`` leaves in the loss.

    A token counts as kept when it stays in the correction's mask and (unless the PPO-clip bypass mode ignores the
    weights) has a non-zero correction weight: exactly the tokens that reach the gradient through
    :func:`fp8rl_jax.objectives.compute_policy_loss`. The correction is evaluated against ``old_logprobs`` (the
    trainer's policy before the update; in bypass mode the loss uses the current policy, equal to it on the step's
    first update).

    Args:
      loss_config: :class:`fp8rl_jax.objectives.LossConfig`.
      old_logprobs, rollout_logprobs: float ``[B, T]`` trainer / engine log-probs of the sampled tokens.
      response_mask: ``[B, T]`` real response tokens.
      advantages: ``[B]`` or ``[B, T]`` (only transforms that read them, e.g. off-policy sequence masking); None = 0.

    Returns:
      the kept fraction in ``[0, 1]``; NaN for a batch without response tokens.
    """
    target = jnp.asarray(old_logprobs, jnp.float32)
    if advantages is None:
        advantages = jnp.zeros(target.shape[:1], jnp.float32)
    try:
        hash(loss_config)
        fn = _kept_token_fraction_jit
    except TypeError:  # a custom transform that is not hashable: no static argument, run it op by op
        fn = _kept_token_fraction
    return float(fn(loss_config, target, jnp.asarray(rollout_logprobs, jnp.float32), jnp.asarray(response_mask),
                    jnp.asarray(advantages, jnp.float32)))


class KeptFractionWatch:
    """Warns once when the kept token fraction stays below a threshold for several consecutive steps.

    Args:
      min_fraction: ``train.min_kept_fraction``; 0 turns the watch off.
      steps: ``train.min_kept_fraction_steps``, the consecutive steps below the threshold that trigger the warning.
    """

    def __init__(self, min_fraction: float, steps: int):
        self.min_fraction, self.steps = float(min_fraction), int(steps)
        self.below: list[float] = []
        self.warned = False

    def update(self, step: int, fraction: float) -> str | None:
        """Record step ``step``'s kept fraction; returns the warning the first time the threshold is crossed for
        :attr:`steps` steps in a row (else None; a NaN fraction, a batch with no tokens, neither counts nor resets)."""
        if self.min_fraction <= 0 or self.warned or math.isnan(fraction):
            return None
        if fraction >= self.min_fraction:
            self.below = []
            return None
        self.below.append(float(fraction))
        if len(self.below) < self.steps:
            return None
        self.warned = True
        seen = ", ".join(f"{f:.1%}" for f in self.below[-self.steps:])
        return (f"step {step}: the rollout correction kept {seen} of the response tokens "
                f"(rollout_corr/kept_token_fraction) in the last {self.steps} steps, below "
                f"train.min_kept_fraction={self.min_fraction:g}: the policy trains on (almost) nothing. Loosen the "
                "correction (its RolloutCorrectionConfig thresholds, e.g. rollout_rs_threshold, or another preset), "
                "or set train.min_kept_fraction=0 to silence this warning (train.min_kept_fraction_steps sets how many "
                "steps in a row count)")
