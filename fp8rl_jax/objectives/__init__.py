"""Objectives: advantages (GRPO / Dr. GRPO / RLOO), policy losses (PPO clip with clip-higher and dual clip,
REINFORCE, GSPO), rollout correction (TIS / MIS / IcePop / rejection sampling / off-policy sequence masking /
trust region masking as chainable transforms), training/inference mismatch metrics, and verl's KL-to-reference and
entropy loss terms (``kl_penalty``, ``entropy_from_logits``). See docs/ROLLOUT_CORRECTION.md and docs/LOSSES.md.

The trainer calls ``compute_policy_loss(logprobs, old_logprobs, rollout_logprobs, advantages,
response_mask, LossConfig(...), ref_logprobs=..., entropy=...)``.
"""

from fp8rl_jax.objectives.advantages import drgrpo_advantages, grpo_advantages, rloo_advantages
from fp8rl_jax.objectives.kl_entropy import KL_LOSS_TYPES, entropy_from_logits, kl_penalty
from fp8rl_jax.objectives.loss import (
    LOSS_MODES,
    LOSS_TYPES,
    PRESETS,
    LossConfig,
    RolloutCorrectionConfig,
    build_transform,
    correction_transform,
    compute_policy_loss,
    rollout_correction_preset,
)
from fp8rl_jax.objectives.metrics import rollout_corr_metrics, token_mult_prob_error
from fp8rl_jax.objectives.policy_loss import LOSS_AGG_MODES, agg_loss, gspo_loss, ppo_clip_loss, reinforce_loss
from fp8rl_jax.objectives.rollout_correction import (
    IS_LEVELS,
    IS_MODES,
    RS_OPTIONS,
    Chain,
    Correction,
    Identity,
    ImportanceSampling,
    RejectionSampling,
    Veto,
    apply_transform,
    chain,
    parse_is_threshold,
    token_tis,
)
from fp8rl_jax.objectives.sequence_masking import OffPolicySequenceMasking, TrustRegionMasking

__all__ = [
    "grpo_advantages",
    "drgrpo_advantages",
    "rloo_advantages",
    "agg_loss",
    "ppo_clip_loss",
    "reinforce_loss",
    "gspo_loss",
    "LOSS_AGG_MODES",
    "token_tis",
    "ImportanceSampling",
    "RejectionSampling",
    "Veto",
    "OffPolicySequenceMasking",
    "TrustRegionMasking",
    "Identity",
    "Chain",
    "chain",
    "apply_transform",
    "Correction",
    "parse_is_threshold",
    "IS_LEVELS",
    "IS_MODES",
    "RS_OPTIONS",
    "rollout_corr_metrics",
    "token_mult_prob_error",
    "RolloutCorrectionConfig",
    "LossConfig",
    "LOSS_MODES",
    "LOSS_TYPES",
    "PRESETS",
    "rollout_correction_preset",
    "build_transform",
    "correction_transform",
    "compute_policy_loss",
    "KL_LOSS_TYPES",
    "kl_penalty",
    "entropy_from_logits",
]
