"""The trainer's entry point: ``compute_policy_loss`` driven by gin-configurable frozen dataclasses.

``RolloutCorrectionConfig`` uses verl's field names (verl/trainer/config/algorithm.py
``RolloutCorrectionConfig``) plus the earlier verl knobs (``rollout_is_mode``, ``rollout_is_veto_threshold``,
``geometric`` level); its classmethods mirror verl's presets. ``LossConfig`` holds the policy-loss knobs
(verl ``actor.policy_loss``/``actor`` names: ``loss_mode``, ``clip_ratio_low``, ``clip_ratio_high``,
``clip_ratio_c``, ``loss_agg_mode``), verl's actor knobs of the KL-to-reference and entropy terms (``use_kl_loss``,
``kl_loss_type``, ``kl_loss_coef``, ``entropy_coeff``, ``calculate_entropy``; :mod:`fp8rl_jax.objectives.kl_entropy`,
docs/LOSSES.md) and a ``RolloutCorrectionConfig``.

Switching the correction is one gin line, e.g.::

    RolloutCorrectionConfig.rollout_is = 'sequence'
    LossConfig.rollout_correction = @rollout_correction_preset()
    rollout_correction_preset.name = 'bypass_ppo_clip'
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Union

import gin
import jax
import jax.numpy as jnp

from fp8rl_jax.objectives._common import as_mask, check_choice, check_same_shape
from fp8rl_jax.objectives.kl_entropy import KL_LOSS_TYPES, kl_penalty
from fp8rl_jax.objectives.metrics import rollout_corr_metrics
from fp8rl_jax.objectives.policy_loss import LOSS_AGG_MODES, agg_loss, gspo_loss, ppo_clip_loss, reinforce_loss
from fp8rl_jax.objectives.rollout_correction import (
    IS_LEVELS,
    IS_MODES,
    Identity,
    ImportanceSampling,
    RejectionSampling,
    apply_transform,
    chain,
    parse_is_threshold,
)
from fp8rl_jax.objectives.sequence_masking import OffPolicySequenceMasking

__all__ = [
    "RolloutCorrectionConfig",
    "LossConfig",
    "LOSS_MODES",
    "LOSS_TYPES",
    "PRESETS",
    "rollout_correction_preset",
    "build_transform",
    "compute_policy_loss",
]

#: Policy-loss kinds (verl ``actor.policy_loss.loss_mode`` names: "vanilla" is PPO clip).
LOSS_MODES = ("vanilla", "gspo")
#: verl ``RolloutCorrectionConfig.loss_type``.
LOSS_TYPES = ("ppo_clip", "reinforce")


@gin.configurable(module="fp8rl_jax.objectives")
@dataclasses.dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Rollout-correction settings with verl's names (gin-configurable, frozen, hashable).

    Attributes:
      rollout_is: IS level ``None`` (no weights, metrics only) | ``"token"`` | ``"sequence"`` |
        ``"geometric"``. Default ``"token"`` (verl's default is ``"sequence"``; the FP8-RL report uses
        token-level TIS).
      rollout_is_threshold: upper bound ``C`` (float) or ``"lo_hi"`` string (e.g. ``"0.5_2.0"``); in
        ``truncate`` mode ``lo`` is a lower clamp, in ``mask`` mode the lower bound (default ``1/C``).
      rollout_is_mode: ``"truncate"`` (TIS) | ``"mask"`` (MIS / IcePop); the earlier verl knob.
      rollout_is_batch_normalize: normalize the weights to masked batch mean 1 (verl).
      rollout_is_veto_threshold: per-token veto ``tau`` or ``None`` (earlier verl).
      rollout_rs: rejection options, comma-separated, from ``RS_OPTIONS`` (verl), or ``None``.
      rollout_rs_threshold: float or string (see ``RejectionSampling``).
      bypass_mode: ``False`` decoupled (three policies: weights from ``old`` vs ``rollout``, PPO ratio
        ``pi / old``); ``True`` bypass (``old := rollout``; weights from ``sg(pi)`` vs ``rollout``).
      loss_type: ``"ppo_clip"`` | ``"reinforce"`` (verl: used in bypass mode). Bypass + ``ppo_clip`` applies
        the rejection mask but not the IS weights (the PPO ratio already is ``pi / pi_rollout``, verl
        ``compute_policy_loss_bypass_mode``); ``reinforce`` applies the weights to ``-A log pi``.
      opsm_delta: off-policy sequence masking threshold (DeepSeek-V3.2; slime ``--opsm-delta``) or ``None``
        (off): tokens with negative advantage of rows whose ``mean_t(rollout_logprobs - old_logprobs) >
        opsm_delta`` get weight 0 (``OffPolicySequenceMasking``), in every regime (bypass PPO-clip too).

    Raises:
      ValueError: any invalid value (lists the valid ones).
    """

    rollout_is: Optional[str] = "token"
    rollout_is_threshold: Union[float, str] = 2.0
    rollout_is_mode: str = "truncate"
    rollout_is_batch_normalize: bool = False
    rollout_is_veto_threshold: Optional[float] = None
    rollout_rs: Optional[str] = None
    rollout_rs_threshold: Union[float, str, None] = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"
    opsm_delta: Optional[float] = None

    def __post_init__(self):
        check_choice("rollout_is", self.rollout_is, (None,) + IS_LEVELS)
        check_choice("rollout_is_mode", self.rollout_is_mode, IS_MODES)
        check_choice("loss_type", self.loss_type, LOSS_TYPES)
        parse_is_threshold(self.rollout_is_threshold)
        build_transform(self)  # validates rs options / thresholds eagerly

    # --- verl presets (verl/trainer/config/algorithm.py) -------------------------------------------------
    @classmethod
    def decoupled_token_is(cls, threshold: float = 2.0):
        """Decoupled token-level TIS (verl preset)."""
        return cls(rollout_is="token", rollout_is_threshold=threshold)

    @classmethod
    def decoupled_seq_is(cls, threshold: float = 2.0):
        """Decoupled sequence-level TIS (verl preset)."""
        return cls(rollout_is="sequence", rollout_is_threshold=threshold)

    @classmethod
    def decoupled_seq_is_rs(cls, is_threshold: float = 2.0, rs_threshold="0.5_2.0"):
        """Decoupled sequence TIS + ``seq_sum_k1`` rejection (verl preset, "Seq-MIS")."""
        return cls(
            rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="seq_sum_k1",
            rollout_rs_threshold=rs_threshold,
        )

    @classmethod
    def decoupled_geo_rs(cls, rs_threshold="0.999_1.001"):
        """Decoupled Geo-RS: ``seq_mean_k1`` rejection, no weights (verl preset)."""
        return cls(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_geo_rs_seq_tis(cls, is_threshold: float = 2.0, rs_threshold="0.999_1.001"):
        """Decoupled Geo-RS + sequence TIS (verl preset)."""
        return cls(
            rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k1",
            rollout_rs_threshold=rs_threshold,
        )

    @classmethod
    def decoupled_geo_rs_token_tis(cls, is_threshold: float = 2.0, rs_threshold="0.999_1.001"):
        """Decoupled Geo-RS + token TIS (verl preset)."""
        return cls(
            rollout_is="token", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k1",
            rollout_rs_threshold=rs_threshold,
        )

    @classmethod
    def decoupled_k3_rs(cls, rs_threshold: float = 0.01):
        """Decoupled K3-RS: ``seq_mean_k3`` rejection (verl preset)."""
        return cls(rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_k3_rs_seq_tis(cls, is_threshold: float = 2.0, rs_threshold: float = 0.01):
        """Decoupled K3-RS + sequence TIS (verl preset)."""
        return cls(
            rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k3",
            rollout_rs_threshold=rs_threshold,
        )

    @classmethod
    def decoupled_k3_rs_token_tis(cls, is_threshold: float = 2.0, rs_threshold: float = 0.01):
        """Decoupled K3-RS + token TIS (verl preset)."""
        return cls(
            rollout_is="token", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k3",
            rollout_rs_threshold=rs_threshold,
        )

    @classmethod
    def bypass_ppo_clip(cls):
        """Bypass PPO clip, no correction beyond the ratio (verl preset)."""
        return cls(rollout_is=None, bypass_mode=True, loss_type="ppo_clip")

    @classmethod
    def bypass_ppo_clip_geo_rs(cls, rs_threshold="0.999_1.001"):
        """Bypass PPO clip + Geo-RS (verl preset)."""
        return cls(
            rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold, bypass_mode=True,
            loss_type="ppo_clip",
        )

    @classmethod
    def bypass_ppo_clip_k3_rs(cls, rs_threshold: float = 0.01):
        """Bypass PPO clip + K3-RS (verl preset)."""
        return cls(
            rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold, bypass_mode=True,
            loss_type="ppo_clip",
        )

    @classmethod
    def bypass_pg_is(cls, threshold: float = 2.0):
        """Bypass REINFORCE + sequence TIS (verl preset)."""
        return cls(rollout_is="sequence", rollout_is_threshold=threshold, bypass_mode=True, loss_type="reinforce")

    @classmethod
    def bypass_pg_geo_rs(cls, rs_threshold="0.999_1.001"):
        """Bypass REINFORCE + Geo-RS (verl preset)."""
        return cls(
            rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold, bypass_mode=True,
            loss_type="reinforce",
        )

    @classmethod
    def bypass_pg_geo_rs_seq_tis(cls, is_threshold: float = 2.0, rs_threshold="0.999_1.001"):
        """Bypass REINFORCE + Geo-RS + sequence TIS (verl preset)."""
        return cls(
            rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k1",
            rollout_rs_threshold=rs_threshold, bypass_mode=True, loss_type="reinforce",
        )

    @classmethod
    def bypass_pg_geo_rs_token_tis(cls, is_threshold: float = 2.0, rs_threshold="0.999_1.001"):
        """Bypass REINFORCE + Geo-RS + token TIS (verl preset)."""
        return cls(
            rollout_is="token", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k1",
            rollout_rs_threshold=rs_threshold, bypass_mode=True, loss_type="reinforce",
        )

    @classmethod
    def disabled(cls):
        """Metrics only, no correction (verl preset)."""
        return cls(rollout_is=None, rollout_rs=None)

    # --- trust region masking (arXiv 2512.23075; verl PR #4544 realises it as rollout_rs options) ---------
    @classmethod
    def decoupled_trm_rs(cls, max_threshold: float = 0.1, avg_threshold: float = 0.002):
        """Decoupled trust region masking: ``rollout_rs="seq_max_k2,seq_mean_k3"`` (the token veto on
        ``k2 = log_rho^2 / 2`` plus the sequence-mean ``k3`` bound; the mask equals ``TrustRegionMasking``).
        Defaults: the paper's combined-criterion run (sec. 4, max 0.1 + avg 0.002). verl has no preset of this
        name; it follows verl's ``{regime}_{estimator}_rs`` pattern (``decoupled_k3_rs``)."""
        return cls(rollout_is=None, rollout_rs="seq_max_k2,seq_mean_k3",
                   rollout_rs_threshold=f"{max_threshold},{avg_threshold}")

    @classmethod
    def bypass_ppo_clip_trm_rs(cls, max_threshold: float = 0.1, avg_threshold: float = 0.002):
        """Bypass PPO clip + trust region masking (as ``decoupled_trm_rs``, weights from ``sg(pi)``)."""
        return cls(rollout_is=None, rollout_rs="seq_max_k2,seq_mean_k3",
                   rollout_rs_threshold=f"{max_threshold},{avg_threshold}", bypass_mode=True, loss_type="ppo_clip")

    # --- off-policy sequence masking (DeepSeek-V3.2; slime --use-opsm --opsm-delta) ------------------------
    @classmethod
    def decoupled_opsm(cls, opsm_delta: float = 1e-4):
        """Decoupled regime, OPSM on ``mean_t(rollout - old)``, no IS weights (slime ``--use-opsm``)."""
        return cls(rollout_is=None, opsm_delta=opsm_delta)

    @classmethod
    def bypass_ppo_clip_opsm(cls, opsm_delta: float = 1e-4):
        """Bypass PPO clip + OPSM on ``mean_t(rollout - sg(pi))``: the DeepSeek-V3.2 objective (ratio
        ``pi / pi_rollout``, mask from the current policy vs the sampler; slime ``--use-opsm
        --use-rollout-logprobs``)."""
        return cls(rollout_is=None, opsm_delta=opsm_delta, bypass_mode=True, loss_type="ppo_clip")

    # --- presets of ours (MIS / IcePop family, not verl preset names) ------------------------------------
    @classmethod
    def decoupled_token_mis(cls, threshold: Union[float, str] = "0.5_2.0"):
        """Decoupled token-level masked IS (IcePop; NeMo-RL ``icepop``, TRL ``token_mask``). Ours."""
        return cls(rollout_is="token", rollout_is_threshold=threshold, rollout_is_mode="mask")

    @classmethod
    def decoupled_seq_mis(cls, threshold: Union[float, str] = 2.0):
        """Decoupled sequence-level masked IS (MIS; TRL ``sequence_mask``). Ours."""
        return cls(rollout_is="sequence", rollout_is_threshold=threshold, rollout_is_mode="mask")

    @classmethod
    def decoupled_geo_mis(cls, threshold: Union[float, str] = "0.999_1.001"):
        """Decoupled geometric-mean masked IS (earlier verl ``geometric`` + ``mask``). Ours."""
        return cls(rollout_is="geometric", rollout_is_threshold=threshold, rollout_is_mode="mask")

    @classmethod
    def bypass_pg_token_icepop(cls, threshold: Union[float, str] = "0.5_2.0"):
        """Bypass REINFORCE + token-level IcePop masking. Ours."""
        return cls(
            rollout_is="token", rollout_is_threshold=threshold, rollout_is_mode="mask", bypass_mode=True,
            loss_type="reinforce",
        )


#: Preset names accepted by ``rollout_correction_preset``.
PRESETS = tuple(
    n
    for n in (
        "decoupled_token_is decoupled_seq_is decoupled_seq_is_rs decoupled_geo_rs decoupled_geo_rs_seq_tis "
        "decoupled_geo_rs_token_tis decoupled_k3_rs decoupled_k3_rs_seq_tis decoupled_k3_rs_token_tis "
        "bypass_ppo_clip bypass_ppo_clip_geo_rs bypass_ppo_clip_k3_rs bypass_pg_is bypass_pg_geo_rs "
        "bypass_pg_geo_rs_seq_tis bypass_pg_geo_rs_token_tis disabled decoupled_token_mis decoupled_seq_mis "
        "decoupled_geo_mis bypass_pg_token_icepop decoupled_trm_rs bypass_ppo_clip_trm_rs decoupled_opsm "
        "bypass_ppo_clip_opsm"
    ).split()
)


@gin.configurable(module="fp8rl_jax.objectives")
def rollout_correction_preset(name: str = "decoupled_token_is", **kwargs) -> RolloutCorrectionConfig:
    """Build a ``RolloutCorrectionConfig`` from a preset name (verl's preset names plus ours; see ``PRESETS``).

    ``kwargs`` go to the preset (e.g. ``threshold``, ``is_threshold``, ``rs_threshold``).

    Raises:
      ValueError: unknown name (lists the valid ones).
    """
    check_choice("preset", name, PRESETS)
    return getattr(RolloutCorrectionConfig, name)(**kwargs)


def build_transform(rc: RolloutCorrectionConfig):
    """The ``chain`` of transforms a ``RolloutCorrectionConfig`` describes (``Identity`` when empty).

    Members, in order: ``ImportanceSampling`` (``rollout_is``), ``RejectionSampling`` (``rollout_rs``),
    ``OffPolicySequenceMasking`` (``opsm_delta``; the chain then needs the advantages: call it through
    ``apply_transform``). Raises ValueError on invalid settings.
    """
    parts = []
    if rc.rollout_is is not None:
        lo, hi = parse_is_threshold(rc.rollout_is_threshold)
        parts.append(
            ImportanceSampling(
                level=rc.rollout_is,
                mode=rc.rollout_is_mode,
                threshold=hi,
                threshold_lower=lo,
                batch_normalize=rc.rollout_is_batch_normalize,
                veto_threshold=rc.rollout_is_veto_threshold,
            )
        )
    if rc.rollout_rs is not None:
        parts.append(RejectionSampling(rc.rollout_rs, rc.rollout_rs_threshold))
    if rc.opsm_delta is not None:
        parts.append(OffPolicySequenceMasking(rc.opsm_delta))
    return chain(*parts) if parts else Identity()


def correction_transform(config: "LossConfig"):
    """The rollout-correction transform a :class:`LossConfig` applies: ``config.transform`` when set, followed by
    ``OffPolicySequenceMasking(opsm_delta)`` when its ``rollout_correction.opsm_delta`` is set (a custom transform
    replaces ``rollout_is`` / ``rollout_rs`` only, never the sequence masking); otherwise :func:`build_transform`.

    Raises:
      ValueError: invalid settings (from :func:`build_transform` / the transforms).
    """
    rc = config.rollout_correction
    if config.transform is None:
        return build_transform(rc)
    if rc.opsm_delta is None:
        return config.transform
    return chain(config.transform, OffPolicySequenceMasking(rc.opsm_delta))


@gin.configurable(module="fp8rl_jax.objectives")
@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Policy-loss settings (gin-configurable, frozen, hashable, usable as a jit static argument).

    Attributes:
      loss_mode: ``"vanilla"`` (PPO clip, verl's name) | ``"gspo"``.
      clip_ratio_low, clip_ratio_high: ``eps_low`` / ``eps_high`` (clip-higher: e.g. 0.2 / 0.28).
      clip_ratio_c: dual-clip constant (> 1) or ``None``.
      loss_agg_mode: one of ``LOSS_AGG_MODES`` (default ``"token-mean"``).
      loss_scale_factor: divisor of ``"seq-mean-token-sum-norm"`` (``None``: T).
      rollout_correction: a ``RolloutCorrectionConfig``; ``None`` means ``RolloutCorrectionConfig()``
        built when this config is constructed (so gin bindings of it apply): token TIS, C = 2, decoupled.
      transform: optional custom transform (e.g. ``chain(...)``) replacing the ``rollout_is``/``rollout_rs``
        part of ``rollout_correction`` (its ``bypass_mode``, ``loss_type`` and ``opsm_delta`` still apply: an
        ``opsm_delta`` is chained after the custom transform, :func:`correction_transform`).
      compute_metrics: also return ``rollout_corr/`` mismatch metrics (``rollout_corr_metrics``).
      use_kl_loss: add ``kl_loss_coef * agg(kl_penalty(logprobs, ref_logprobs, kl_loss_type))`` to the loss, the
        KL to the reference policy (the initial policy, frozen; the trainer computes its log-probs once per batch:
        :mod:`fp8rl_jax.trainer.reference`). verl ``actor.use_kl_loss`` (default False; GRPO recipes turn it on,
        DAPO's do not).
      kl_loss_type: the per-token estimator, one of :data:`fp8rl_jax.objectives.kl_entropy.KL_LOSS_TYPES`
        (``"k1"``/``"kl"``, ``"abs"``, ``"k2"``/``"mse"``, ``"k3"``/``"low_var_kl"``, each also with a ``"+"``
        straight-through suffix). verl ``actor.kl_loss_type``, default ``"low_var_kl"``.
      kl_loss_coef: its coefficient (verl ``actor.kl_loss_coef``, default 0.001).
      entropy_coeff: subtract ``entropy_coeff * agg(entropy)`` from the loss (an entropy bonus when > 0; verl
        ``actor.entropy_coeff``, default 0). Nonzero: the training forward computes the per-token entropy of the
        temperature-scaled logits with its gradient (chunked like the log-probs).
      calculate_entropy: log ``actor/entropy`` even when ``entropy_coeff == 0`` (verl ``actor.calculate_entropy``;
        an extra softmax pass per logits chunk, no gradient).

    The KL and entropy terms are aggregated with ``loss_agg_mode`` over the same mask as the policy loss (the
    response mask after rollout-correction rejection: verl's trainer replaces ``response_mask`` by the rejection
    mask before the actor aggregates any of the terms).

    Raises:
      ValueError: invalid values (lists the valid ones; a bad ``kl_loss_type`` names the binding
        ``LossConfig.kl_loss_type``).
    """

    loss_mode: str = "vanilla"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: Optional[float] = None
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None
    rollout_correction: Optional[RolloutCorrectionConfig] = None
    transform: Optional[Callable] = None
    compute_metrics: bool = True
    use_kl_loss: bool = False
    kl_loss_type: str = "low_var_kl"
    kl_loss_coef: float = 0.001
    entropy_coeff: float = 0.0
    calculate_entropy: bool = False

    def __post_init__(self):
        check_choice("loss_mode", self.loss_mode, LOSS_MODES)
        check_choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        if self.kl_loss_type not in KL_LOSS_TYPES:
            raise ValueError(f"LossConfig.kl_loss_type={self.kl_loss_type!r} is not one of {list(KL_LOSS_TYPES)} "
                             "(verl actor.kl_loss_type; a '+' suffix takes k2's gradient)")
        for name in ("kl_loss_coef", "entropy_coeff"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or abs(v) == float("inf"):
                raise ValueError(f"LossConfig.{name} must be a finite number, got {v!r}")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1.0:
            raise ValueError(f"clip_ratio_c must be > 1, got {self.clip_ratio_c}")
        if self.rollout_correction is None:
            object.__setattr__(self, "rollout_correction", RolloutCorrectionConfig())
        elif not isinstance(self.rollout_correction, RolloutCorrectionConfig):
            raise ValueError(
                f"rollout_correction must be a RolloutCorrectionConfig, got {type(self.rollout_correction)}"
            )

    @property
    def needs_entropy(self) -> bool:
        """Whether the loss needs the per-token entropy (``entropy_coeff != 0``) or logs it (``calculate_entropy``)."""
        return self.entropy_coeff != 0 or self.calculate_entropy


def compute_policy_loss(logprobs, old_logprobs, rollout_logprobs, advantages, response_mask, config=None, *,
                        ref_logprobs=None, entropy=None):
    """The whole policy loss: rollout correction + policy loss + aggregation + KL/entropy terms + metrics.

    Regimes (verl, rollout_corr_math.md):

    - decoupled (``bypass_mode=False``): ``c = T(old_logprobs, rollout_logprobs)`` with ``T`` the configured
      transform; ``vanilla``: ``ppo_clip_loss(logprobs, old_logprobs, A, c.mask, token_weights=c.weights)``;
      ``gspo``: ``gspo_loss`` likewise; ``loss_type="reinforce"``: ``reinforce_loss`` with ``c.weights``.
    - bypass (``bypass_mode=True``; ``old_logprobs`` is ignored and may be ``None``):
      ``c = T(sg(logprobs), rollout_logprobs)``; ``ppo_clip``: the policy loss with ``old := rollout`` on
      ``c.mask`` and no weights except the OPSM keep weights of ``opsm_delta``; ``reinforce``:
      ``reinforce_loss(logprobs, rollout, A, c.mask, c.weights)``.

    Transforms that need the advantages (``OffPolicySequenceMasking``) receive ``advantages``.

    Then, as verl's actor (verl/workers/actor/dp_actor.py), with ``agg`` = :func:`agg_loss` over the policy loss's
    aggregation mask (``c.mask``) and ``loss_agg_mode``::

        loss = pg_loss - entropy_coeff * agg(entropy) + kl_loss_coef * agg(kl_penalty(logprobs, ref_logprobs))

    (the entropy term when ``entropy_coeff != 0``, the KL term when ``use_kl_loss``).

    Args:
      logprobs: current policy's sampled-token log-probs ``[B, T]`` float32 (differentiated).
      old_logprobs: trainer recomputation before the update ``[B, T]`` (or ``None`` in bypass mode).
      rollout_logprobs: inference engine's log-probs ``[B, T]`` (``None`` allowed only when no correction
        and no metrics are requested, i.e. decoupled with ``rollout_is=None``, ``rollout_rs=None``,
        ``compute_metrics=False``).
      advantages: ``[B]`` or ``[B, T]``.
      response_mask: ``[B, T]`` bool/float.
      config: ``LossConfig``, a ``RolloutCorrectionConfig`` (policy-loss defaults), or ``None`` (defaults).
      ref_logprobs: the reference policy's log-probs ``[B, T]`` (constant); required with ``use_kl_loss``.
      entropy: per-token entropy ``[B, T]`` float32 of the current policy (differentiated when
        ``entropy_coeff != 0``); required when ``config.needs_entropy``.

    Returns:
      ``(loss, metrics)``: float32 scalar; dict of float32 scalars: ``actor/*`` (``pg_loss``,
      ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl``; ``kl_loss`` and ``kl_coef`` with ``use_kl_loss``;
      ``entropy`` when an entropy is given), ``rollout_corr/*`` (transform metrics and, with ``compute_metrics``,
      the mismatch metrics of ``rollout_corr_metrics``). ``actor/pg_loss`` is the policy-gradient term alone.

    Raises:
      ValueError: shape mismatches (names the arrays), invalid config, missing required log-probs or entropy.
    """
    if config is None:
        config = LossConfig()
    elif isinstance(config, RolloutCorrectionConfig):
        config = LossConfig(rollout_correction=config)
    elif not isinstance(config, LossConfig):
        raise ValueError(f"config must be a LossConfig or RolloutCorrectionConfig, got {type(config)}")
    rc = config.rollout_correction
    transform = correction_transform(config)
    check_same_shape(
        logprobs=logprobs, old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, response_mask=response_mask,
        ref_logprobs=ref_logprobs, entropy=entropy,
    )
    if config.use_kl_loss and ref_logprobs is None:
        raise ValueError("LossConfig.use_kl_loss=True needs ref_logprobs (the reference policy's log-probs)")
    if config.entropy_coeff != 0 and entropy is None:
        raise ValueError(f"LossConfig.entropy_coeff={config.entropy_coeff} needs the per-token entropy")
    needs_rollout = rc.bypass_mode or config.compute_metrics or not isinstance(transform, Identity)
    if rollout_logprobs is None and needs_rollout:
        raise ValueError(
            "rollout_logprobs is required for rollout correction, bypass mode or rollout_corr metrics "
            "(set rollout_is=None, rollout_rs=None and compute_metrics=False to run without it)"
        )
    if old_logprobs is None and not rc.bypass_mode:
        raise ValueError("old_logprobs is required in the decoupled regime (bypass_mode=False)")
    m = as_mask(response_mask)
    if rc.bypass_mode:
        target = jax.lax.stop_gradient(jnp.asarray(logprobs, jnp.float32))
        old = rollout_logprobs
    else:
        target = old_logprobs
        old = old_logprobs
    if rollout_logprobs is None:
        corr_w, corr_m, corr_metrics = m, m, {}
    else:
        corr = apply_transform(transform, target, rollout_logprobs, m, advantages)
        corr_w, corr_m, corr_metrics = corr.weights, corr.mask, corr.metrics
    agg = dict(loss_agg_mode=config.loss_agg_mode, loss_scale_factor=config.loss_scale_factor)
    if rc.loss_type == "reinforce":
        behaviour = rollout_logprobs if rollout_logprobs is not None else old
        loss, metrics = reinforce_loss(logprobs, behaviour, advantages, corr_m, token_weights=corr_w, **agg)
    else:
        weights = None if rc.bypass_mode else corr_w
        if rc.bypass_mode and rc.opsm_delta is not None:
            # bypass PPO-clip drops the IS weights, not the OPSM keep weights (DeepSeek-V3.2's M_{i,t})
            weights = OffPolicySequenceMasking(rc.opsm_delta)(target, rollout_logprobs, m, advantages).weights
        if config.loss_mode == "gspo":
            loss, metrics = gspo_loss(
                logprobs, old, advantages, corr_m, config.clip_ratio_low, config.clip_ratio_high,
                token_weights=weights, **agg,
            )
        else:
            loss, metrics = ppo_clip_loss(
                logprobs, old, advantages, corr_m, config.clip_ratio_low, config.clip_ratio_high,
                config.clip_ratio_c, token_weights=weights, **agg,
            )
    metrics = dict(metrics)
    if entropy is not None:  # verl: agg over the loss mask with the loss's mode; a bonus when entropy_coeff > 0
        ent = agg_loss(entropy, corr_m, config.loss_agg_mode, config.loss_scale_factor)
        metrics["actor/entropy"] = jax.lax.stop_gradient(ent)
        if config.entropy_coeff != 0:
            loss = loss - config.entropy_coeff * ent
    if config.use_kl_loss:
        kl = agg_loss(kl_penalty(logprobs, ref_logprobs, config.kl_loss_type, m), corr_m, config.loss_agg_mode,
                      config.loss_scale_factor)
        loss = loss + config.kl_loss_coef * kl
        metrics["actor/kl_loss"] = jax.lax.stop_gradient(kl)
        metrics["actor/kl_coef"] = jnp.asarray(config.kl_loss_coef, jnp.float32)
    metrics.update(corr_metrics)
    if config.compute_metrics and rollout_logprobs is not None:
        metrics.update(rollout_corr_metrics(target, rollout_logprobs, m))
    return loss, metrics
