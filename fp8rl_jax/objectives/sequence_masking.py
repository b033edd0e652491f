"""Sequence-level masking transforms: off-policy sequence masking (OPSM) and trust region masking (TRM).

Both follow the transform protocol of ``rollout_correction`` (pure, jit/grad/vmap-safe, stop-gradient
outputs, ``Correction(weights, mask, metrics)``, composable with ``chain``). With
``log_rho = old_logprobs - rollout_logprobs`` on real tokens (0 on padding; padding may hold NaN/-inf):

- ``OffPolicySequenceMasking`` (DeepSeek-V3.2): drops the tokens with negative advantage of a sequence
  whose mean KL estimate ``mean_t(rollout_logprobs - old_logprobs)`` exceeds ``opsm_delta``. It needs the
  advantages, so it declares ``uses_advantages = True`` and ``chain`` / ``apply_transform`` /
  ``compute_policy_loss`` pass them.
- ``TrustRegionMasking`` (Li et al. 2025, arXiv 2512.23075): drops a whole sequence when any token's
  ``k2 = log_rho^2 / 2`` exceeds ``max_threshold`` (the token veto, max criterion) or the sequence mean of
  ``k3 = rho - 1 - log_rho`` exceeds ``avg_threshold`` (average criterion).

Metrics are float32 scalars under ``rollout_corr/``; an entirely masked batch gives 0 for every one.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Optional

import gin
import jax
import jax.numpy as jnp

from fp8rl_jax.objectives._common import (
    SAFETY_BOUND,
    broadcast_advantages,
    check_choice,
    masked_max,
    masked_mean,
    masked_sum,
)
from fp8rl_jax.objectives.rollout_correction import PREFIX, Correction, _prep, _seq_valid

__all__ = ["OffPolicySequenceMasking", "TrustRegionMasking"]


def _finalize(keep, m, metrics, apply_to) -> Correction:
    """``keep`` [B, T] 0/1 -> ``Correction`` acting on the weights or on the mask (stop-gradient)."""
    kept = jax.lax.stop_gradient(m * keep)
    metrics = jax.lax.stop_gradient({PREFIX + k: v for k, v in metrics.items()})
    return Correction(kept, m, metrics) if apply_to == "weights" else Correction(m, kept, metrics)


@gin.configurable(module="fp8rl_jax.objectives")
@dataclasses.dataclass(frozen=True)
class OffPolicySequenceMasking:
    """Off-policy sequence masking (OPSM): mask negative-advantage tokens of sequences far off-policy.

    Source: DeepSeek-AI 2025, "DeepSeek-V3.2: Pushing the Frontier of Open Large Language Models"
    (arXiv 2512.02556), sec. 3.1 "Scaling GRPO", paragraph "Off-Policy Sequence Masking": the GRPO
    per-token term is multiplied by

        M_{i,t} = 0  if  A_{i,t} < 0  and  (1/|o_i|) sum_t log(pi_old(o_{i,t}) / pi_theta(o_{i,t})) > delta
        M_{i,t} = 1  otherwise,

    where ``pi_old`` is the policy that sampled the rollout and ``pi_theta`` the policy being trained
    (slime ``--use-opsm --opsm-delta``: ``compute_opsm_mask``). Here the sampler is ``rollout_logprobs``
    and the trained side is the transform's first argument (``old_logprobs`` in the decoupled regime,
    ``sg(logprobs)`` in bypass mode, which is exactly the report's form)::

        kl_b   = sum_t m_bt (rollout_logprobs_bt - old_logprobs_bt) / sum_t m_bt      (0 for an empty row)
        drop   = m_bt * [advantages_bt < 0] * [kl_b > opsm_delta]
        keep   = 1 - drop

    No clamp is applied (the statistic is linear in the log-ratio, finite for any finite input).

    ``apply_to="weights"`` (default, the report's objective and slime: ``M`` multiplies the per-token loss,
    the ``1/|o_i|`` and ``1/G`` denominators are unchanged): ``weights = m * keep``, ``mask = m``.
    ``apply_to="mask"``: ``weights = m``, ``mask = m * keep`` (masked tokens also leave the aggregation's
    denominator). ``compute_policy_loss`` with ``RolloutCorrectionConfig.opsm_delta`` applies the keep
    weights in every regime, bypass PPO-clip included (which otherwise uses only ``Correction.mask``).

    Metrics (``rollout_corr/`` prefix; 0 on an entirely masked batch): ``opsm_masked_fraction`` (real
    tokens dropped), ``opsm_seq_masked_fraction`` (non-empty rows with a dropped token),
    ``opsm_seq_kl_mean`` / ``opsm_seq_kl_max`` (``kl_b`` over non-empty rows),
    ``opsm_seq_kl_fraction_high`` (non-empty rows with ``kl_b > opsm_delta``, whatever the advantage).

    Call: ``(old_logprobs, rollout_logprobs, response_mask, advantages)`` with log-probs float ``[B, T]``,
    ``response_mask`` ``[B, T]`` bool/int/float, ``advantages`` float ``[B]`` (broadcast over tokens) or
    ``[B, T]`` (per-token sign, as ``A_{i,t}``); padding may hold NaN/inf in every array.

    Args:
      opsm_delta: threshold ``delta >= 0`` on the mean per-token KL estimate (default 1e-4 is ours).
      apply_to: ``"weights"`` | ``"mask"``.

    Raises:
      ValueError: negative / non-finite ``opsm_delta``, bad ``apply_to`` (lists the valid ones), shape
        mismatch (names the arrays), ``advantages`` missing.
    """

    opsm_delta: float = 1e-4
    apply_to: str = "weights"
    uses_advantages: ClassVar[bool] = True

    def __post_init__(self):
        check_choice("apply_to", self.apply_to, ("weights", "mask"))
        if isinstance(self.opsm_delta, bool) or not (
            isinstance(self.opsm_delta, (int, float)) and math.isfinite(self.opsm_delta) and self.opsm_delta >= 0
        ):
            raise ValueError(f"opsm_delta must be a finite number >= 0, got {self.opsm_delta!r}")

    def __call__(self, old_logprobs, rollout_logprobs, response_mask, advantages=None) -> Correction:
        """Compute the OPSM keep mask; see the class docstring. Returns a ``Correction``."""
        if advantages is None:
            raise ValueError("OffPolicySequenceMasking needs advantages ([B] or [B, T])")
        lr, m = _prep(old_logprobs, rollout_logprobs, response_mask)
        adv = jax.lax.stop_gradient(broadcast_advantages(advantages, m.shape))
        adv = jnp.where(m != 0, adv, 0.0)
        kl = masked_mean(-lr, m, axis=-1)  # [B]: mean_t log(pi_rollout / pi_old)
        high = kl > float(self.opsm_delta)
        drop = ((adv < 0) & high[:, None] & (m != 0)).astype(jnp.float32)
        sv = _seq_valid(m)
        metrics = {
            "opsm_masked_fraction": masked_mean(drop, m),
            "opsm_seq_masked_fraction": masked_mean((masked_sum(drop, m, axis=-1) > 0).astype(jnp.float32), sv),
            "opsm_seq_kl_mean": masked_mean(kl, sv),
            "opsm_seq_kl_max": masked_max(kl, sv),
            "opsm_seq_kl_fraction_high": masked_mean(high.astype(jnp.float32), sv),
        }
        return _finalize(1.0 - drop, m, metrics, self.apply_to)


@gin.configurable(module="fp8rl_jax.objectives")
@dataclasses.dataclass(frozen=True)
class TrustRegionMasking:
    """Trust region masking (TRM) with a token veto: drop whole sequences that leave the trust region.

    Source: Li, Liu, Xu, Tong, Li, Liu, Wang 2025, "Trust Region Masking for Long-Horizon LLM
    Reinforcement Learning" (arXiv 2512.23075), sec. 4 "Trust Region Masking": the masked surrogate
    ``L_masked = E[M(x, y) A sum_t rho_t]`` with the max criterion ``M = I[max_t D_KL(c_t) <= delta]`` and
    the combined criterion adding ``(1/T) sum_t D_KL(c_t) <= delta_avg``; without stored logits the paper's
    sample-based approximations are ``k2(rho) = (log rho)^2 / 2`` for the max (symmetric: flags
    ``rho -> 0`` and ``rho -> inf``) and ``k3(rho) = rho - 1 - log rho`` for the average (unbiased for
    ``KL(pi_roll || pi)``). verl realises it (PR #4544, "trust region sequence masking - k3 KL avg and veto
    for max criterion") as ``rollout_rs="seq_max_k2,seq_mean_k3"``, which this transform equals on the mask.

    With ``r = clamp(log_rho, -20, 20)`` (verl's SAFETY_BOUND) on real tokens::

        veto_bt = [r_bt^2 / 2 > max_threshold]                  token veto (|log rho| > sqrt(2 max_threshold))
        keep_b  = [no real token vetoed] * [mean_t (exp(r) - 1 - r) <= avg_threshold]

    Either threshold may be ``None`` (criterion off), not both. An empty row is kept (it has no tokens).

    ``apply_to="mask"`` (default, verl: rejected rows leave the aggregation's denominator):
    ``weights = m``, ``mask = m * keep``. ``apply_to="weights"`` (the paper's Algorithm 1, normalised by the
    total batch size ``N``; use with ``loss_agg_mode="seq-mean-token-mean"`` for ``1/N``):
    ``weights = m * keep``, ``mask = m``.

    Metrics (``rollout_corr/`` prefix; 0 on an entirely masked batch): ``trm_masked_fraction`` (real
    tokens dropped), ``trm_seq_masked_fraction`` (non-empty rows dropped), ``trm_max_seq_masked_fraction``
    and ``trm_avg_seq_masked_fraction`` (rows failing each criterion), ``trm_token_veto_fraction`` (real
    tokens over the veto), ``trm_seq_max_k2_max``, ``trm_seq_mean_k3_mean``, ``trm_seq_mean_k3_max`` (over
    non-empty rows).

    Call: ``(old_logprobs, rollout_logprobs, response_mask)``, float ``[B, T]`` log-probs and ``[B, T]``
    mask (padding may hold NaN/inf); returns a ``Correction``.

    Args:
      max_threshold: ``delta`` of the max criterion on ``k2`` (the paper's TRM-Max used 0.05 alone, 0.1
        combined), or ``None``.
      avg_threshold: ``delta_avg`` of the average criterion on ``k3`` (0.001 alone, 0.002 combined), or
        ``None``.
      apply_to: ``"mask"`` | ``"weights"``.

    Raises:
      ValueError: both thresholds ``None``, a non-positive threshold, bad ``apply_to``, shape mismatch.
    """

    max_threshold: Optional[float] = 0.1
    avg_threshold: Optional[float] = 0.002
    apply_to: str = "mask"

    def __post_init__(self):
        check_choice("apply_to", self.apply_to, ("mask", "weights"))
        if self.max_threshold is None and self.avg_threshold is None:
            raise ValueError("TrustRegionMasking needs max_threshold and/or avg_threshold")
        for name in ("max_threshold", "avg_threshold"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise ValueError(f"{name} must be positive (or None), got {v!r}")

    @property
    def token_veto_log_ratio(self) -> Optional[float]:
        """The token veto in log-ratio units: ``sqrt(2 max_threshold)`` (``None`` when the max is off)."""
        return None if self.max_threshold is None else math.sqrt(2.0 * self.max_threshold)

    def __call__(self, old_logprobs, rollout_logprobs, response_mask) -> Correction:
        """Compute the TRM keep mask; see the class docstring. Returns a ``Correction``."""
        lr, m = _prep(old_logprobs, rollout_logprobs, response_mask)
        r = jnp.clip(lr, -SAFETY_BOUND, SAFETY_BOUND)
        k2 = 0.5 * jnp.square(r)
        k3 = jnp.expm1(r) - r
        seq_max_k2 = masked_max(k2, m, axis=-1)
        seq_mean_k3 = masked_mean(k3, m, axis=-1)
        sv = _seq_valid(m)
        ones = jnp.ones_like(sv)
        if self.max_threshold is not None:
            veto = ((k2 > float(self.max_threshold)) & (m != 0)).astype(jnp.float32)
            keep_max = (seq_max_k2 <= float(self.max_threshold)).astype(jnp.float32)
        else:
            veto, keep_max = jnp.zeros_like(m), ones
        if self.avg_threshold is not None:
            keep_avg = (seq_mean_k3 <= float(self.avg_threshold)).astype(jnp.float32)
        else:
            keep_avg = ones
        keep_row = keep_max * keep_avg
        metrics = {
            "trm_masked_fraction": masked_mean(jnp.broadcast_to(1.0 - keep_row[:, None], m.shape), m),
            "trm_seq_masked_fraction": masked_mean(1.0 - keep_row, sv),
            "trm_max_seq_masked_fraction": masked_mean(1.0 - keep_max, sv),
            "trm_avg_seq_masked_fraction": masked_mean(1.0 - keep_avg, sv),
            "trm_token_veto_fraction": masked_mean(veto, m),
            "trm_seq_max_k2_max": masked_max(seq_max_k2, sv),
            "trm_seq_mean_k3_mean": masked_mean(seq_mean_k3, sv),
            "trm_seq_mean_k3_max": masked_max(seq_mean_k3, sv),
        }
        return _finalize(jnp.broadcast_to(keep_row[:, None], m.shape), m, metrics, self.apply_to)
