"""Per-token logprobs of responses under the trainer's model (``old_logprobs`` / ``logprobs``).

Layout shared with the rollout engine: ``input_ids = [left-padded prompt (P) | response (T)]``; the hidden
state at column ``P - 1 + j`` predicts response token ``j``. Logits are divided by the sampling temperature
before ``log_softmax``, as verl's actor does, so that ``old_logprobs`` are comparable to the engine's
processed ``rollout_logprobs`` (top-k/top-p off).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8rl_jax.models.decoder import CausalLM, left_pad, positions_from_mask  # noqa: F401 (re-export)


def response_logprobs(model: CausalLM, prompt_ids: jax.Array, prompt_mask: jax.Array, response_ids: jax.Array,
                      temperature: float | jax.Array = 1.0) -> jax.Array:
    """Logprobs of ``response_ids`` given left-padded prompts.

    Args:
      model: the policy.
      prompt_ids: int32 ``[B, P]`` left-padded; ``prompt_mask`` bool ``[B, P]``.
      response_ids: int32 ``[B, T]`` (tokens after a row's end are ignored by callers via ``response_mask``).
      temperature: logits are divided by it (> 0).

    Returns:
      float32 ``[B, T]``.
    """
    b, p = prompt_ids.shape
    t = response_ids.shape[1]
    ids = jnp.concatenate([prompt_ids, response_ids], axis=1)
    kv_mask = jnp.concatenate([prompt_mask, jnp.ones((b, t), bool)], axis=1)
    positions = positions_from_mask(kv_mask)
    h, _ = model.hidden_states(ids, positions, kv_mask)
    logits = model.logits(h[:, p - 1:p + t - 1]) / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, response_ids[..., None], axis=-1)[..., 0]
