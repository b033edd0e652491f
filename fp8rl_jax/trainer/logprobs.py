"""Per-token logprobs of responses under the trainer's model (``old_logprobs`` / ``logprobs``).

Layout shared with the rollout engine: ``input_ids = [left-padded prompt (P) | response (T)]``; the hidden
state at column ``P - 1 + j`` predicts response token ``j``. Logits are divided by the sampling temperature
before ``log_softmax``, as verl's actor does, so that ``old_logprobs`` are comparable to the engine's
processed ``rollout_logprobs`` (top-k/top-p off).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.models.decoder import CausalLM, positions_from_mask


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, bucket: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad prompts to a multiple of ``bucket``: ``(ids int32 [B, P], mask bool [B, P])``."""
    p = bucket * -(-max(len(x) for x in prompts) // bucket)
    ids = np.full((len(prompts), p), pad_id, np.int32)
    mask = np.zeros((len(prompts), p), bool)
    for i, x in enumerate(prompts):
        ids[i, p - len(x):] = x
        mask[i, p - len(x):] = True
    return ids, mask


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
