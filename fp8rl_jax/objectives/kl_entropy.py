"""KL to a reference policy and entropy, as loss terms with verl's semantics.

verl's actor adds two optional terms to the policy loss (verl/workers/actor/dp_actor.py ``update_policy``)::

    loss = pg_loss - entropy_coeff * agg(entropy) + kl_loss_coef * agg(kl_penalty(logprob, ref_logprob))

with ``agg`` the policy loss's ``loss_agg_mode`` (:func:`fp8rl_jax.objectives.policy_loss.agg_loss`). This module
holds the per-token pieces:

* :func:`kl_penalty`: the per-token estimate of ``KL(pi || pi_ref)`` from the sampled token's log-probs, verl
  ``core_algos.kl_penalty`` / ``kl_penalty_forward`` (J. Schulman, "Approximating KL divergence", 2020,
  http://joschu.net/blog/kl-approx.html). With ``d = logprob - ref_logprob``:

  - ``"k1"`` / ``"kl"``: ``d``;
  - ``"abs"``: ``|d|``;
  - ``"k2"`` / ``"mse"``: ``d**2 / 2``;
  - ``"k3"`` / ``"low_var_kl"``: ``x = clip(-d, -20, 20)``, ``clip(exp(x) - x - 1, -10, 10)``;
  - any of them with a ``"+"`` suffix (``"k1+"``, ``"k3+"``, ...): straight-through: the *value* is the named
    estimator's, the *gradient* is ``k2``'s (``d``, the gradient of ``d**2 / 2``), because ``k2``'s gradient
    is the unbiased estimate of ``grad KL`` while ``k1``'s and ``k3``'s are not (verl ``kl_penalty``:
    ``k2 - stop_gradient(k2) + stop_gradient(forward)``; verl docs/algo/grpo.md, verl PR 2953). ``"k2+"`` and
    ``"mse+"`` are therefore ``"k2"``.

  verl's ``"full"`` (KL over the whole vocabulary) raises ``NotImplementedError`` in verl and is not offered.
* :func:`entropy_from_logits`: ``logsumexp(z) - sum(softmax(z) * z)``, verl ``verl/utils/torch_functional.py
  entropy_from_logits`` (nats; of the temperature-scaled logits, as the actor computes it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8rl_jax.objectives._common import check_same_shape, safe_log_ratio

__all__ = ["KL_LOSS_TYPES", "KL_BASE_TYPES", "kl_penalty", "entropy_from_logits"]

#: The estimators without the straight-through suffix (verl ``kl_penalty_forward``'s names).
KL_BASE_TYPES = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
#: Every valid ``kl_loss_type`` (verl ``actor.kl_loss_type``): the base names and each with a ``"+"`` suffix.
KL_LOSS_TYPES = KL_BASE_TYPES + tuple(f"{t}+" for t in KL_BASE_TYPES)

#: verl's clamps of the ``k3`` / ``low_var_kl`` estimator: the log-ratio before ``exp``, then the estimate.
K3_LOG_RATIO_BOUND = 20.0
K3_VALUE_BOUND = 10.0


def _forward(d, base: str):
    """The estimator ``base`` of the log-ratio ``d = logprob - ref_logprob`` (float32, same shape)."""
    if base in ("k1", "kl"):
        return d
    if base == "abs":
        return jnp.abs(d)
    if base in ("k2", "mse"):
        return 0.5 * jnp.square(d)
    # k3 / low_var_kl: ratio = pi_ref / pi = exp(-d); ratio - log(ratio) - 1 >= 0, clamped as verl does
    x = jnp.clip(-d, -K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
    return jnp.clip(jnp.exp(x) - x - 1.0, -K3_VALUE_BOUND, K3_VALUE_BOUND)


def kl_penalty(logprobs, ref_logprobs, kl_type: str = "low_var_kl", response_mask=None) -> jnp.ndarray:
    """Per-token KL estimate between the current policy and the reference, verl ``core_algos.kl_penalty``.

    Args:
      logprobs: current policy's log-probs of the sampled tokens, float ``[B, T]`` (differentiated).
      ref_logprobs: the reference policy's log-probs of the same tokens, float ``[B, T]`` (a constant: no gradient
        is taken through it).
      kl_type: one of :data:`KL_LOSS_TYPES` (module docstring; verl ``actor.kl_loss_type``).
      response_mask: optional ``[B, T]`` (nonzero = real token); where it is 0 the log-ratio is taken as 0, so
        padding (which may hold -inf) gives a finite 0 estimate and a 0 gradient.

    Returns:
      float32 ``[B, T]``: the estimate per token (not aggregated; aggregate with ``agg_loss`` and the loss's mask).
      For the ``"+"`` types its value is the base estimator's and its gradient w.r.t. ``logprobs`` is
      ``logprobs - ref_logprobs``.

    Raises:
      ValueError: unknown ``kl_type`` (lists the valid ones); shapes differ (names the arrays).
    """
    if kl_type not in KL_LOSS_TYPES:
        raise ValueError(f"invalid kl_loss_type={kl_type!r}; valid values: {', '.join(map(repr, KL_LOSS_TYPES))}")
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs, response_mask=response_mask)
    ref = jax.lax.stop_gradient(jnp.asarray(ref_logprobs, jnp.float32))
    if response_mask is None:
        d = jnp.asarray(logprobs, jnp.float32) - ref
    else:
        d = safe_log_ratio(logprobs, ref, response_mask)
    base = kl_type.rstrip("+")
    value = _forward(d, base)
    if not kl_type.endswith("+"):
        return value
    k2 = 0.5 * jnp.square(d)  # straight-through: k2's gradient, the named estimator's value
    return k2 - jax.lax.stop_gradient(k2) + jax.lax.stop_gradient(value)


def entropy_from_logits(logits) -> jnp.ndarray:
    """Entropy of ``softmax(logits)`` over the last axis, in nats: ``logsumexp(z) - sum(softmax(z) * z)``.

    verl ``verl/utils/torch_functional.py entropy_from_logits``. Differentiable (the entropy bonus takes its
    gradient); divide the logits by the sampling temperature first, as the actor does.

    Args:
      logits: float ``[..., V]`` (computed in float32).

    Returns:
      float32 ``[...]``.
    """
    z = jnp.asarray(logits, jnp.float32)
    return jax.nn.logsumexp(z, axis=-1) - jnp.sum(jax.nn.softmax(z, axis=-1) * z, axis=-1)
