"""Token sampling with vLLM semantics: temperature, top-k, top-p, and processed logprobs.

The processed distribution is ``softmax(mask(logits / temperature))`` where the mask keeps the top-k tokens
and then the smallest set of tokens whose probability reaches ``top_p`` (vLLM's ``apply_top_k_top_p``).
The returned logprob of a sampled token is taken under that processed distribution, which is what vLLM returns
with ``logprobs_mode="processed_logprobs"``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30


def process_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                   use_top_k: bool, use_top_p: bool) -> jax.Array:
    """Temperature-scaled, top-k/top-p masked logits.

    Args:
      logits: float32 ``[B, V]``.
      temperature: float32 scalar > 0 (greedy is handled by the caller).
      top_k: int32 scalar, tokens kept (only read when ``use_top_k``).
      top_p: float32 scalar in (0, 1] (only read when ``use_top_p``).
      use_top_k, use_top_p: static switches (skipping the sort when unused).

    Returns:
      float32 ``[B, V]`` with removed tokens at ``-1e30``.
    """
    x = logits.astype(jnp.float32) / temperature
    if use_top_k or use_top_p:
        sorted_desc = -jnp.sort(-x, axis=-1)
        if use_top_k:
            kth = jnp.take_along_axis(sorted_desc, jnp.full((x.shape[0], 1), top_k - 1, jnp.int32), axis=-1)
            x = jnp.where(x < kth, NEG_INF, x)
            sorted_desc = jnp.where(jnp.arange(x.shape[-1])[None] >= top_k, NEG_INF, sorted_desc)
        if use_top_p:
            probs = jax.nn.softmax(sorted_desc, axis=-1)
            cum_before = jnp.cumsum(probs, axis=-1) - probs
            keep_sorted = cum_before < top_p  # always keeps the first token
            n_keep = jnp.sum(keep_sorted, axis=-1, keepdims=True)
            threshold = jnp.take_along_axis(sorted_desc, n_keep - 1, axis=-1)
            x = jnp.where(x < threshold, NEG_INF, x)
    return x


def sample_tokens(rng: jax.Array, logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  *, greedy: bool, use_top_k: bool, use_top_p: bool) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row and return its processed logprob.

    Args:
      rng: one PRNG key for the whole batch, or ``[B]`` keys (one per row: row ``i``'s token then depends only on
        ``rng[i]`` and its own logits, whatever the rest of the batch).
      logits: float32 ``[B, V]`` raw model logits.
      greedy: static; argmax decoding (logprobs then from ``log_softmax(logits)``).

    Returns:
      ``(tokens int32 [B], logprobs float32 [B])``.
    """
    if greedy:
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    else:
        x = process_logits(logits, temperature, top_k, top_p, use_top_k, use_top_p)
        if jnp.ndim(rng) == 0:
            tok = jax.random.categorical(rng, x, axis=-1).astype(jnp.int32)
        else:
            tok = jax.vmap(lambda k, row: jax.random.categorical(k, row))(rng, x).astype(jnp.int32)
        lp = jax.nn.log_softmax(x, axis=-1)
    return tok, jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]
