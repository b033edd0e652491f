"""Rollout correction: the TIS / MIS / IcePop / rejection-sampling family as composable loss transforms.

The inference engine samples from ``pi_rollout`` (e.g. FP8 vLLM) while the trainer computes ``pi_old``
(e.g. bf16). With ``log_rho = old_logprobs - rollout_logprobs`` per token, every transform here maps
``(old_logprobs, rollout_logprobs, response_mask)`` to a ``Correction``:

- ``weights`` ``[B, T]`` float32, >= 0, 0 on padding, under ``jax.lax.stop_gradient``: multiply the
  per-token policy loss (IS changes the measure, not the objective: verl rollout_corr_math.md sec. 3.2.2);
- ``mask`` ``[B, T]`` float32 0/1: ``response_mask`` AND every rejection (use it as the loss mask, so
  rejected tokens leave the aggregation's denominator, as verl's modified ``response_mask``);
- ``metrics``: float32 scalars under verl's names with the ``rollout_corr/`` prefix.

Transforms compose like ``optax.chain``: ``chain(a, b)(...)`` multiplies the weights and ANDs the masks;
each member sees the original ``response_mask`` (as in verl, where IS and RS are computed independently),
so the weights and masks of a chain do not depend on its order.

Sources: verl/trainer/ppo/rollout_corr_helper.py (``compute_rollout_correction_weights``,
``compute_rollout_rejection_mask``, ``compute_is_metrics``, ``compute_rs_metrics``, ``SAFETY_BOUND``), the
earlier verl ``mismatch_helper.compute_rollout_importance_weights`` (truncate/mask modes, geometric level,
veto), NeMo-RL ``ClippedPGLossFn`` (tis / icepop / seq-mask-tis), TRL ``GRPOConfig``
(``vllm_importance_sampling_mode``), Yao et al. 2025 "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training" (TIS), Liu, Li et al. 2025 "When Speed Kills Stability" (MIS, Geo-RS, K3-RS),
Ling team 2025 IcePop.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp

from fp8rl_jax.objectives._common import (
    SAFETY_BOUND,
    as_mask,
    check_choice,
    check_same_shape,
    masked_max,
    masked_mean,
    masked_min,
    masked_std,
    masked_sum,
    safe_log_ratio,
)

__all__ = [
    "Correction",
    "ImportanceSampling",
    "RejectionSampling",
    "Veto",
    "Identity",
    "Chain",
    "chain",
    "apply_transform",
    "token_tis",
    "parse_is_threshold",
    "IS_LEVELS",
    "IS_MODES",
    "RS_OPTIONS",
    "PREFIX",
]

PREFIX = "rollout_corr/"
IS_LEVELS = ("token", "sequence", "geometric")
IS_MODES = ("truncate", "mask")
#: verl's ``SUPPORTED_ROLLOUT_RS_OPTIONS``.
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)


class Correction(NamedTuple):
    """Output of a rollout-correction transform (a pytree).

    Attributes:
      weights: float32 ``[B, T]``, >= 0, 0 outside ``response_mask``, stop-gradient.
      mask: float32 ``[B, T]`` in {0, 1}: ``response_mask`` AND the transform's rejections.
      metrics: dict of float32 scalars, keys prefixed ``rollout_corr/``.
    """

    weights: jnp.ndarray
    mask: jnp.ndarray
    metrics: dict


def _prep(old_logprobs, rollout_logprobs, response_mask):
    check_same_shape(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, response_mask=response_mask)
    m = as_mask(response_mask)
    lr = jax.lax.stop_gradient(safe_log_ratio(old_logprobs, rollout_logprobs, m))
    return lr, m


def _log(x: float) -> float:
    """``math.log`` with ``log(0) = -inf`` (a lower bound of 0 means "no lower bound")."""
    return -math.inf if x == 0 else math.log(x)


def _seq_valid(m):
    return (jnp.sum(m, axis=-1) > 0).astype(jnp.float32)


def parse_is_threshold(threshold: Union[float, int, str]) -> tuple[Optional[float], float]:
    """Parse verl-style ``rollout_is_threshold``: ``2.0`` -> ``(None, 2.0)``; ``"0.5_2.0"`` -> ``(0.5, 2.0)``.

    A string without ``_`` is a single upper bound. Raises ValueError on non-positive or unparsable values
    and when lower > upper.
    """
    if isinstance(threshold, bool):
        raise ValueError(f"rollout_is_threshold must be a number or 'lo_hi' string, got {threshold!r}")
    if isinstance(threshold, (int, float)):
        lo, hi = None, float(threshold)
    elif isinstance(threshold, str):
        parts = threshold.strip().split("_")
        try:
            if len(parts) == 1:
                lo, hi = None, float(parts[0])
            elif len(parts) == 2:
                lo, hi = float(parts[0]), float(parts[1])
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"rollout_is_threshold: cannot parse {threshold!r}; use e.g. 2.0 or '0.5_2.0'") from None
    else:
        raise ValueError(f"rollout_is_threshold must be a number or 'lo_hi' string, got {threshold!r}")
    if not hi > 0 or (lo is not None and not lo >= 0):
        raise ValueError(f"rollout_is_threshold must be positive (lower bound >= 0), got {threshold!r}")
    if lo is not None and lo > hi:
        raise ValueError(f"rollout_is_threshold: lower {lo} > upper {hi}")
    return lo, hi


# ----------------------------------------------------------------------------------------------------------
# Importance sampling weights (TIS / MIS / IcePop / Geo)
# ----------------------------------------------------------------------------------------------------------


def _is_metrics(w, lr_metric, m, seq_level: bool, upper: float, lower: float) -> dict:
    """verl ``compute_is_metrics`` on the (unthresholded, masked) weights; empty rows left out."""
    sv = _seq_valid(m)
    cnt = jnp.sum(m)
    out = {"rollout_is_mean": masked_mean(w, m)}
    if seq_level:
        s = lr_metric  # [B] log sequence weight (unclamped)
        has_rows = jnp.sum(sv) > 0  # an entirely masked batch reports 0, not exp(0) = 1
        out["rollout_is_max"] = jnp.where(has_rows, jnp.exp(jnp.minimum(masked_max(s, sv), SAFETY_BOUND)), 0.0)
        out["rollout_is_min"] = jnp.where(has_rows, jnp.exp(jnp.minimum(masked_min(s, sv), SAFETY_BOUND)), 0.0)
        out["rollout_is_ratio_fraction_high"] = masked_mean((s > _log(upper)).astype(jnp.float32), sv)
        out["rollout_is_ratio_fraction_low"] = masked_mean((s < _log(lower)).astype(jnp.float32), sv)
    else:
        out["rollout_is_max"] = masked_max(w, m)
        out["rollout_is_min"] = masked_min(w, m)
        out["rollout_is_ratio_fraction_high"] = masked_mean((w > upper).astype(jnp.float32), m)
        out["rollout_is_ratio_fraction_low"] = masked_mean((w < lower).astype(jnp.float32), m)
    wc = jnp.clip(w, lower, upper)
    mean_c = masked_mean(wc, m)
    var = masked_mean(jnp.square(wc), m) - jnp.square(mean_c)
    out["rollout_is_std"] = jnp.where(cnt > 1, jnp.sqrt(jnp.maximum(var, 0.0)), 0.0)
    norm = wc / (mean_c + 1e-8)
    msq = masked_mean(jnp.square(norm), m)
    out["rollout_is_eff_sample_size"] = jnp.where(msq > 0, 1.0 / jnp.where(msq > 0, msq, 1.0), 0.0)
    seq_w = masked_mean(w, m, axis=-1)
    out["rollout_is_seq_mean"] = masked_mean(seq_w, sv)
    out["rollout_is_seq_std"] = masked_std(seq_w, sv, ddof=1)
    out["rollout_is_seq_max"] = masked_max(seq_w, sv)
    out["rollout_is_seq_min"] = masked_min(seq_w, sv)
    out["rollout_is_seq_max_deviation"] = masked_max(jnp.abs(seq_w - 1.0), sv)
    out["rollout_is_seq_fraction_high"] = masked_mean((seq_w > upper).astype(jnp.float32), sv)
    out["rollout_is_seq_fraction_low"] = masked_mean((seq_w < lower).astype(jnp.float32), sv)
    return out


@dataclasses.dataclass(frozen=True)
class ImportanceSampling:
    """Importance weights ``rho`` at token, sequence or geometric level, truncated (TIS) or masked (MIS).

    Levels (with ``c(x) = clamp(x, -20, 20)``, verl's SAFETY_BOUND, sums/means over real tokens):

    - ``"token"``: ``rho_t = exp(c(log_rho_t))`` (verl ``rollout_is="token"``; Yao et al. 2025 TIS).
    - ``"sequence"``: ``rho = exp(c(sum_t log_rho_t))`` broadcast over the row (verl ``"sequence"``).
    - ``"geometric"``: ``rho = exp(c(mean_t log_rho_t))`` broadcast (earlier verl ``"geometric"``).

    Modes, with ``hi = threshold`` and ``lo = threshold_lower``:

    - ``"truncate"`` (TIS): ``w = min(rho, hi)``, and ``w = max(w, lo)`` only if ``threshold_lower`` is set
      (slime ``--tis-clip-low``, NeMo-RL ``truncated_importance_sampling_ratio_min``).
    - ``"mask"`` (MIS / IcePop): ``w = rho * [lo <= rho <= hi]`` with ``lo`` defaulting to ``1/hi``
      (verl ``rollout_is_mode="mask"``; NeMo-RL ``icepop``; TRL ``token_mask`` / ``sequence_mask``).

    ``apply_to`` (mask mode only): ``"weights"`` (default: verl MIS, NeMo-RL ``icepop``, TRL ``*_mask``,
    slime ``icepop_function``: the weight is zeroed, the token stays in the aggregation's denominator) or
    ``"mask"`` (slime ``tis_mode: mask``: the weight stays ``rho``, the token leaves ``Correction.mask``).

    Then, optionally, ``veto_threshold`` ``tau``: a row whose any real token has ``log_rho < log(tau)`` gets
    weight 0 (verl ``rollout_is_veto_threshold``); and ``batch_normalize``: divide by the masked batch mean
    of the weights (token level: over tokens; sequence/geometric: over per-sequence weights of non-empty
    rows), skipped when that mean is <= 1e-8 (verl ``rollout_is_batch_normalize``).

    Metrics (before thresholding, as verl): ``rollout_is_{mean,max,min,std,eff_sample_size}``,
    ``rollout_is_ratio_fraction_{high,low}``, ``rollout_is_seq_{mean,std,max,min,max_deviation,
    fraction_high,fraction_low}``; mask mode adds ``rollout_is_{seq_,}masked_fraction``; veto adds
    ``rollout_is_veto_fraction`` and ``rollout_is_catastrophic_token_fraction``; batch normalization adds
    ``rollout_is_batch_norm_factor``. The metric thresholds are ``hi`` and ``lo`` (``1/hi`` if unset).

    Raises:
      ValueError: bad ``level``/``mode`` (lists the valid ones), non-positive thresholds, ``lo > hi``.
    """

    level: str = "token"
    mode: str = "truncate"
    threshold: float = 2.0
    threshold_lower: Optional[float] = None
    batch_normalize: bool = False
    veto_threshold: Optional[float] = None
    apply_to: str = "weights"

    def __post_init__(self):
        check_choice("rollout_is level", self.level, IS_LEVELS)
        check_choice("apply_to", self.apply_to, ("weights", "mask"))
        check_choice("rollout_is mode", self.mode, IS_MODES)
        if not self.threshold > 0:
            raise ValueError(f"rollout_is_threshold must be positive, got {self.threshold}")
        if self.threshold_lower is not None and not (0 <= self.threshold_lower <= self.threshold):
            raise ValueError(
                f"threshold_lower must be in [0, threshold={self.threshold}], got {self.threshold_lower}"
            )
        if self.veto_threshold is not None and not self.veto_threshold > 0:
            raise ValueError(f"veto_threshold must be positive, got {self.veto_threshold}")

    @property
    def lower(self) -> float:
        """The lower threshold used for masking and metrics (``threshold_lower`` or ``1/threshold``)."""
        return self.threshold_lower if self.threshold_lower is not None else 1.0 / self.threshold

    def __call__(self, old_logprobs, rollout_logprobs, response_mask) -> Correction:
        """Compute the weights; see the class docstring. Shapes ``[B, T]``; returns a ``Correction``."""
        lr, m = _prep(old_logprobs, rollout_logprobs, response_mask)
        hi, lo = float(self.threshold), float(self.lower)
        if self.level == "token":
            lr_metric = lr
            w = jnp.exp(jnp.clip(lr, -SAFETY_BOUND, SAFETY_BOUND))
        else:
            s = masked_sum(lr, m, axis=-1) if self.level == "sequence" else masked_mean(lr, m, axis=-1)
            lr_metric = s
            w = jnp.broadcast_to(jnp.exp(jnp.clip(s, -SAFETY_BOUND, SAFETY_BOUND))[:, None], m.shape)
        w = w * m
        seq_level = self.level != "token"
        metrics = _is_metrics(w, lr_metric, m, seq_level, hi, lo)
        sv = _seq_valid(m)
        out_mask = m
        if self.mode == "truncate":
            w = jnp.minimum(w, hi)
            if self.threshold_lower is not None:
                w = jnp.maximum(w, lo)
        else:
            keep = ((w >= lo) & (w <= hi)).astype(jnp.float32)
            metrics["rollout_is_masked_fraction"] = masked_mean(1.0 - keep, m)
            seq_has = (masked_sum(1.0 - keep, m, axis=-1) > 0).astype(jnp.float32)
            metrics["rollout_is_seq_masked_fraction"] = masked_mean(seq_has, sv)
            if self.apply_to == "weights":
                w = w * keep
            else:
                out_mask = m * keep
        if self.veto_threshold is not None:
            cat = ((lr < math.log(self.veto_threshold)) & (m != 0)).astype(jnp.float32)
            has = jnp.max(cat, axis=-1, keepdims=True) if cat.shape[-1] > 0 else jnp.zeros((cat.shape[0], 1))
            metrics["rollout_is_veto_fraction"] = masked_mean(has[:, 0], sv)
            metrics["rollout_is_catastrophic_token_fraction"] = masked_mean(cat, m)
            w = w * (1.0 - has)
        w = w * m
        if self.batch_normalize:
            if self.level == "token":
                mean = masked_mean(w, m)
            else:
                mean = masked_mean(masked_mean(w, m, axis=-1), sv)
            ok = mean > 1e-8
            w = jnp.where(ok, w / jnp.where(ok, mean, 1.0), w)
            # verl reports 1.0 when the mean is <= 1e-8; an entirely masked batch reports 0 (every metric is 0)
            metrics["rollout_is_batch_norm_factor"] = jnp.where(ok, mean, jnp.where(jnp.sum(m) > 0, 1.0, 0.0))
        metrics = {PREFIX + k: v for k, v in metrics.items()}
        return Correction(jax.lax.stop_gradient(w), jax.lax.stop_gradient(out_mask), jax.lax.stop_gradient(metrics))


def token_tis(old_logprobs, rollout_logprobs, response_mask, threshold: float = 2.0):
    """Token-level truncated importance sampling (TIS; Yao et al. 2025; verl ``rollout_is="token"``).

    ``w_t = min(exp(clamp(old_logprobs_t - rollout_logprobs_t, -20, 20)), threshold)`` on real tokens,
    0 on padding; under ``jax.lax.stop_gradient``.

    Args:
      old_logprobs, rollout_logprobs: float ``[B, T]``; response_mask: ``[B, T]``; threshold: ``C > 0``.

    Returns:
      ``(weights [B, T] float32, metrics)`` (metrics as ``ImportanceSampling``).

    Raises:
      ValueError: shape mismatch (names the arrays) or ``threshold <= 0``.
    """
    c = ImportanceSampling(level="token", mode="truncate", threshold=threshold)(
        old_logprobs, rollout_logprobs, response_mask
    )
    return c.weights, c.metrics


# ----------------------------------------------------------------------------------------------------------
# Rejection sampling on divergence estimators (verl rollout_rs)
# ----------------------------------------------------------------------------------------------------------


def _parse_rs(rollout_rs: str, rollout_rs_threshold) -> tuple[tuple[str, Optional[float], float], ...]:
    """Parse verl's comma-separated ``rollout_rs`` / ``rollout_rs_threshold`` into (option, lower, upper).

    Follows verl ``_parse_rollout_rs_thresholds``: one threshold shared by all options or one per option;
    ``*_k1`` options take ``"lower_upper"`` ratio bounds (a single value ``u`` means ``1/u .. u``); k2/k3
    options take one positive upper bound.
    """
    if not isinstance(rollout_rs, str) or not rollout_rs.strip():
        raise ValueError("rollout_rs must be a non-empty string (comma-separated options)")
    opts: list[str] = []
    for o in (p.strip() for p in rollout_rs.split(",")):
        if not o:
            continue
        check_choice("rollout_rs option", o, RS_OPTIONS)
        if o not in opts:
            opts.append(o)
    if not opts:
        raise ValueError(f"rollout_rs must contain at least one option; valid: {', '.join(RS_OPTIONS)}")
    if rollout_rs_threshold is None:
        raise ValueError("rollout_rs_threshold must be provided when rollout_rs is set")
    if isinstance(rollout_rs_threshold, bool) or not isinstance(rollout_rs_threshold, (int, float, str)):
        raise ValueError(f"rollout_rs_threshold must be a number or string, got {rollout_rs_threshold!r}")
    if isinstance(rollout_rs_threshold, (int, float)):
        specs = [str(rollout_rs_threshold)]
    else:
        specs = [p.strip() for p in rollout_rs_threshold.split(",") if p.strip()]
    if len(specs) not in (1, len(opts)):
        raise ValueError(
            f"rollout_rs_threshold needs 1 or {len(opts)} comma-separated entries for {opts}, got {len(specs)}"
        )
    if len(specs) == 1:
        specs = specs * len(opts)
    parsed = []
    for o, spec in zip(opts, specs):
        try:
            if o.endswith("k1"):
                if "_" in spec:
                    lo_s, hi_s = spec.split("_", 1)
                    lo, hi = float(lo_s), float(hi_s)
                else:
                    hi = float(spec)
                    lo = 1.0 / hi
            else:
                if "_" in spec:
                    raise ValueError(f"rollout_rs_threshold for {o!r} takes a single upper bound, got {spec!r}")
                lo, hi = None, float(spec)
        except (ValueError, ZeroDivisionError) as e:
            raise ValueError(f"invalid rollout_rs_threshold {spec!r} for option {o!r}: {e}") from None
        if not hi > 0 or (lo is not None and not lo > 0):
            raise ValueError(f"rollout_rs_threshold for {o!r} must be positive, got {spec!r}")
        parsed.append((o, lo, hi))
    return tuple(parsed)


def _rs_option_metrics(name, stat_tok, seq_stat, m, sv, level, upper, lower, use_lower) -> dict:
    """verl ``compute_rs_metrics`` for one option (empty rows left out of sequence statistics)."""
    p = f"rollout_rs_{name}"
    if seq_stat is None:
        seq_stat = masked_mean(stat_tok, m, axis=-1)
    out = {f"{p}_mean": masked_mean(stat_tok, m)}
    if level == "sequence":
        out[f"{p}_max"] = masked_max(seq_stat, sv)
        out[f"{p}_min"] = masked_min(seq_stat, sv)
        out[f"{p}_fraction_high"] = masked_mean((seq_stat > upper).astype(jnp.float32), sv)
        low = masked_mean((seq_stat < lower).astype(jnp.float32), sv) if use_lower else jnp.zeros((), jnp.float32)
    else:
        out[f"{p}_max"] = masked_max(stat_tok, m)
        out[f"{p}_min"] = masked_min(stat_tok, m)
        out[f"{p}_fraction_high"] = masked_mean((stat_tok > upper).astype(jnp.float32), m)
        low = masked_mean((stat_tok < lower).astype(jnp.float32), m) if use_lower else jnp.zeros((), jnp.float32)
    out[f"{p}_fraction_low"] = low
    sc = jnp.clip(stat_tok, lower if use_lower else 0.0, upper)
    mc = masked_mean(sc, m)
    var = masked_mean(jnp.square(sc), m) - jnp.square(mc)
    out[f"{p}_std"] = jnp.where(jnp.sum(m) > 1, jnp.sqrt(jnp.maximum(var, 0.0)), 0.0)
    out[f"{p}_seq_mean"] = masked_mean(seq_stat, sv)
    out[f"{p}_seq_std"] = masked_std(seq_stat, sv, ddof=1)
    out[f"{p}_seq_max"] = masked_max(seq_stat, sv)
    out[f"{p}_seq_min"] = masked_min(seq_stat, sv)
    out[f"{p}_seq_max_deviation"] = masked_max(jnp.abs(seq_stat), sv)
    out[f"{p}_seq_fraction_high"] = masked_mean((seq_stat > upper).astype(jnp.float32), sv)
    if use_lower:
        out[f"{p}_seq_fraction_low"] = masked_mean((seq_stat < lower).astype(jnp.float32), sv)
    return out


@dataclasses.dataclass(frozen=True)
class RejectionSampling:
    """Hard trust-region rejection on divergence estimators (verl ``rollout_rs``), acting on the mask.

    With ``r = c(log_rho)`` (clamped to +-20) per real token: ``k1 = -r``, ``k2 = r^2 / 2``,
    ``k3 = exp(r) - 1 - r`` (Schulman's KL estimators of KL(pi_rollout || pi_old)). Options
    (comma-separated, all must pass): ``token_k{1,2,3}`` per token; ``seq_sum_k{1,2,3}`` /
    ``seq_mean_k{1,2,3}`` the masked sum / mean per row; ``seq_max_k{2,3}`` the max per row (0 for an
    empty row). ``*_k1`` keeps ``log(lo) <= stat <= log(hi)`` (``rollout_rs_threshold="lo_hi"``; a single
    value ``u`` means ``1/u .. u``), k2/k3 keep ``stat <= hi``. Sequence options reject whole rows.

    ``apply_to="mask"`` (verl): ``weights = response_mask``, ``mask = response_mask * keep`` (rejected
    tokens leave the aggregation's denominator). ``apply_to="weights"``: ``weights = response_mask * keep``,
    ``mask = response_mask`` (rejected tokens still count in ``token-mean``'s denominator, as NeMo-RL's
    ``seq-mask-tis`` and the earlier verl veto).

    Metrics (verl names): per option ``rollout_rs_{opt}_{mean,max,min,fraction_high,fraction_low,std,
    seq_mean,seq_std,seq_max,seq_min,seq_max_deviation,seq_fraction_high[,seq_fraction_low]}``,
    ``rollout_rs_{opt}_masked_fraction`` (token fraction rejected), ``rollout_rs_{opt}_seq_masked_fraction``
    (non-empty rows with any rejected token), and overall ``rollout_rs_masked_fraction``,
    ``rollout_rs_seq_masked_fraction``. Source: verl ``compute_rollout_rejection_mask`` /
    ``compute_rs_metrics``; K3-RS and Geo-RS (``seq_mean_k1``): Liu, Li et al. 2025.

    Args:
      rollout_rs: e.g. ``"seq_mean_k3"`` or ``"token_k1,seq_max_k2"``.
      rollout_rs_threshold: float or string, one entry or one per option (comma-separated).
      apply_to: ``"mask"`` | ``"weights"``.

    Raises:
      ValueError: unknown option (lists the valid ones), missing / malformed / non-positive thresholds,
        bad ``apply_to``.
    """

    rollout_rs: str = "seq_mean_k3"
    rollout_rs_threshold: Union[str, float, None] = 0.01
    apply_to: str = "mask"

    def __post_init__(self):
        check_choice("apply_to", self.apply_to, ("mask", "weights"))
        object.__setattr__(self, "_parsed", _parse_rs(self.rollout_rs, self.rollout_rs_threshold))

    @property
    def options(self) -> tuple[tuple[str, Optional[float], float], ...]:
        """Parsed ``(option, lower_ratio_or_None, upper)`` triples."""
        return self._parsed  # type: ignore[attr-defined]

    def __call__(self, old_logprobs, rollout_logprobs, response_mask) -> Correction:
        """Compute the rejection mask; see the class docstring. Returns a ``Correction``."""
        lr, m = _prep(old_logprobs, rollout_logprobs, response_mask)
        r = jnp.clip(lr, -SAFETY_BOUND, SAFETY_BOUND)
        ks = {"k1": -r, "k2": 0.5 * jnp.square(r), "k3": jnp.expm1(r) - r}
        sv = _seq_valid(m)
        combined = jnp.ones_like(m)
        metrics: dict = {}
        for name, lo, hi in self.options:
            k = ks[name[-2:]]
            is_k1 = name.endswith("k1")
            up = math.log(hi) if is_k1 else hi
            low = math.log(lo) if is_k1 else 0.0
            seq_stat = None
            if name.startswith("token_"):
                stat = k
                keep = (stat >= low) & (stat <= up) if is_k1 else stat <= up
                level = "token"
            else:
                if name.startswith("seq_sum_"):
                    seq_stat = masked_sum(k, m, axis=-1)
                elif name.startswith("seq_mean_"):
                    seq_stat = masked_mean(k, m, axis=-1)
                else:
                    seq_stat = masked_max(k, m, axis=-1)
                keep_s = (seq_stat >= low) & (seq_stat <= up) if is_k1 else seq_stat <= up
                keep = jnp.broadcast_to(keep_s[:, None], m.shape)
                stat = jnp.broadcast_to(seq_stat[:, None], m.shape)
                level = "sequence"
            keep_f = keep.astype(jnp.float32)
            combined = combined * keep_f
            metrics.update(_rs_option_metrics(name, stat, seq_stat, m, sv, level, up, low, is_k1))
            metrics[f"rollout_rs_{name}_masked_fraction"] = masked_mean(1.0 - keep_f, m)
            seq_rej = (masked_sum(1.0 - keep_f, m, axis=-1) > 0).astype(jnp.float32)
            metrics[f"rollout_rs_{name}_seq_masked_fraction"] = masked_mean(seq_rej, sv)
        metrics["rollout_rs_masked_fraction"] = masked_mean(1.0 - combined, m)
        seq_rej = (masked_sum(1.0 - combined, m, axis=-1) > 0).astype(jnp.float32)
        metrics["rollout_rs_seq_masked_fraction"] = masked_mean(seq_rej, sv)
        metrics = {PREFIX + k: v for k, v in metrics.items()}
        kept = jax.lax.stop_gradient(m * combined)
        metrics = jax.lax.stop_gradient(metrics)
        return Correction(m, kept, metrics) if self.apply_to == "mask" else Correction(kept, m, metrics)


@dataclasses.dataclass(frozen=True)
class Veto:
    """Catastrophic-token veto: weight 0 for a row whose any real token has ``rho < tau`` (or ``rho > high``).

    ``weights = response_mask * [no real token with log_rho < log(tau) or log_rho > log(high)]`` (earlier
    verl ``rollout_is_veto_threshold``, default there 1e-4; applied to the IS weights). With
    ``apply_to="mask"`` the row leaves ``Correction.mask`` instead (slime ``rs_veto_threshold``). The optional
    upper bound ``threshold_high`` gives the two-sided sequence rejection of SkyRL
    (``outlier_token_is_threshold_low/high``) and prime-rl (``sequence_mask_low/high``): a row is dropped
    when any token's ratio leaves ``[tau, high]``. Metrics: ``rollout_is_veto_fraction`` (non-empty rows
    vetoed), ``rollout_is_catastrophic_token_fraction`` (real tokens outside the bounds).

    Raises:
      ValueError: ``threshold <= 0``, ``threshold_high <= threshold`` or bad ``apply_to``.
    """

    threshold: float = 1e-4
    apply_to: str = "weights"
    threshold_high: float | None = None

    def __post_init__(self):
        check_choice("apply_to", self.apply_to, ("weights", "mask"))
        if not self.threshold > 0:
            raise ValueError(f"veto threshold must be positive, got {self.threshold}")
        if self.threshold_high is not None and not self.threshold_high > self.threshold:
            raise ValueError(f"veto threshold_high must exceed threshold={self.threshold}, got {self.threshold_high}")

    def __call__(self, old_logprobs, rollout_logprobs, response_mask) -> Correction:
        """Compute the veto weights; returns a ``Correction`` whose mask is ``response_mask``."""
        lr, m = _prep(old_logprobs, rollout_logprobs, response_mask)
        out = lr < math.log(self.threshold)
        if self.threshold_high is not None:
            out = out | (lr > math.log(self.threshold_high))
        cat = (out & (m != 0)).astype(jnp.float32)
        has = jnp.max(cat, axis=-1) if cat.shape[-1] > 0 else jnp.zeros((cat.shape[0],), jnp.float32)
        sv = _seq_valid(m)
        metrics = {
            PREFIX + "rollout_is_veto_fraction": masked_mean(has, sv),
            PREFIX + "rollout_is_catastrophic_token_fraction": masked_mean(cat, m),
        }
        kept = jax.lax.stop_gradient(m * (1.0 - has[:, None]))
        metrics = jax.lax.stop_gradient(metrics)
        return Correction(kept, m, metrics) if self.apply_to == "weights" else Correction(m, kept, metrics)


@dataclasses.dataclass(frozen=True)
class Identity:
    """No correction: ``weights = mask = response_mask`` and no metrics (verl ``rollout_is=None``)."""

    def __call__(self, old_logprobs, rollout_logprobs, response_mask) -> Correction:
        """Return the identity ``Correction``."""
        _, m = _prep(old_logprobs, rollout_logprobs, response_mask)
        return Correction(m, m, {})


Transform = Callable[..., Correction]


def apply_transform(transform, old_logprobs, rollout_logprobs, response_mask, advantages=None) -> Correction:
    """Call a transform, passing ``advantages`` only to one that declares ``uses_advantages = True``.

    Transforms keep the three-argument protocol ``(old_logprobs, rollout_logprobs, response_mask)``; the
    few that also need the advantages (``OffPolicySequenceMasking``, a ``Chain`` containing one) take them
    as a fourth argument (``[B]`` or ``[B, T]`` float).

    Raises:
      ValueError: the transform needs advantages and ``advantages`` is ``None``.
    """
    if getattr(transform, "uses_advantages", False):
        if advantages is None:
            raise ValueError(f"{type(transform).__name__} needs advantages ([B] or [B, T])")
        return transform(old_logprobs, rollout_logprobs, response_mask, advantages)
    return transform(old_logprobs, rollout_logprobs, response_mask)


@dataclasses.dataclass(frozen=True)
class Chain:
    """Composition of transforms (``optax.chain`` style): weights multiply, masks AND, metrics merge.

    Every member receives the same (original) inputs, so the weights and mask of a chain do not depend on
    the members' order; on a metric-name clash the later member's value is kept. ``advantages`` (optional
    fourth argument, ``[B]`` or ``[B, T]``) reaches the members that declare ``uses_advantages``.
    """

    transforms: tuple = ()

    @property
    def uses_advantages(self) -> bool:
        """True when a member needs the advantages."""
        return any(getattr(t, "uses_advantages", False) for t in self.transforms)

    def __call__(self, old_logprobs, rollout_logprobs, response_mask, advantages=None) -> Correction:
        """Apply every member and combine; returns a ``Correction``."""
        _, m = _prep(old_logprobs, rollout_logprobs, response_mask)
        w, mask, metrics = m, m, {}
        for t in self.transforms:
            c = apply_transform(t, old_logprobs, rollout_logprobs, response_mask, advantages)
            w = w * c.weights
            mask = mask * c.mask
            metrics.update(c.metrics)
        return Correction(w, mask, metrics)


def chain(*transforms: Transform) -> Chain:
    """Compose rollout-correction transforms: ``chain(ImportanceSampling(...), RejectionSampling(...))``.

    Raises:
      ValueError: a member is not callable.
    """
    flat: list = []
    for t in transforms:
        if not callable(t):
            raise ValueError(f"chain: {t!r} is not a transform (callable)")
        if isinstance(t, Chain):
            flat.extend(t.transforms)
        else:
            flat.append(t)
    return Chain(tuple(flat))
