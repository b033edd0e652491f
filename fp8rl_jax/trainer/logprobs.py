"""Per-token logprobs of responses under the trainer's model (``old_logprobs`` / ``logprobs``).

Layout shared with the rollout engine: ``input_ids = [left-padded prompt (P) | response (T)]``; the hidden
state at column ``P - 1 + j`` predicts response token ``j``. Logits are divided by the sampling temperature
before ``log_softmax``, as verl's actor does, so that ``old_logprobs`` are comparable to the engine's
processed ``rollout_logprobs`` (top-k/top-p off).

Rollout routing replay (R3, arXiv 2510.11370 Sec. 3): ``routed_experts`` int32 ``[B, P + T, L, k]`` in the same
column layout (see :func:`sequence_routing`) makes every MoE layer run the recorded experts at the columns that
have a record (``-1`` = route normally), with gate weights recomputed by this model's router.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.models.decoder import CausalLM, left_pad, positions_from_mask  # noqa: F401 (re-export)


def response_logprobs_and_routing(model: CausalLM, prompt_ids: jax.Array, prompt_mask: jax.Array,
                                  response_ids: jax.Array, temperature: float | jax.Array = 1.0,
                                  routed_experts: jax.Array | None = None):
    """:func:`response_logprobs` plus the router's own top-k ids of every column.

    Returns:
      ``(logprobs float32 [B, T], router_ids int32 [B, P + T, L, k] or None)``: ``router_ids`` is the top-k each
      MoE layer's router chose in this forward (-1 for dense layers; whether or not ``routed_experts`` replaced
      it), None for a dense model. Compare its response columns with the rollout's record for
      ``rollout_corr/routing_mismatch`` (:func:`fp8rl_jax.objectives.routing_mismatch`).

    Raises:
      ValueError: ``routed_experts`` not of shape ``[B, P + T, num_layers, num_experts_per_tok]`` (MoE model).
    """
    b, p = prompt_ids.shape
    t = response_ids.shape[1]
    ids = jnp.concatenate([prompt_ids, response_ids], axis=1)
    kv_mask = jnp.concatenate([prompt_mask, jnp.ones((b, t), bool)], axis=1)
    positions = positions_from_mask(kv_mask)
    h, _, router_ids = model.hidden_states(ids, positions, kv_mask, routed_experts=routed_experts,
                                           return_routing=True)
    logits = model.logits(h[:, p - 1:p + t - 1]) / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, response_ids[..., None], axis=-1)[..., 0], router_ids


def response_logprobs(model: CausalLM, prompt_ids: jax.Array, prompt_mask: jax.Array, response_ids: jax.Array,
                      temperature: float | jax.Array = 1.0, routed_experts: jax.Array | None = None) -> jax.Array:
    """Logprobs of ``response_ids`` given left-padded prompts.

    Args:
      model: the policy.
      prompt_ids: int32 ``[B, P]`` left-padded; ``prompt_mask`` bool ``[B, P]``.
      response_ids: int32 ``[B, T]`` (tokens after a row's end are ignored by callers via ``response_mask``).
      temperature: logits are divided by it (> 0).
      routed_experts: optional R3 record to replay, int32 ``[B, P + T, L, k]`` (-1 = route normally); ignored by
        a dense model.

    Returns:
      float32 ``[B, T]``.
    """
    return response_logprobs_and_routing(model, prompt_ids, prompt_mask, response_ids, temperature,
                                         routed_experts)[0]


def sequence_routing(prompt_routed_experts, routed_experts: np.ndarray, prompt_width: int) -> np.ndarray:
    """A rollout's routing record in the trainer's column layout: int32 ``[N, P + T, L, k]``.

    Args:
      prompt_routed_experts: N arrays ``[len(prompt_i), L, k]`` (the engine's prefill record) or None (no prompt
        record: the prompt columns are -1, i.e. routed normally by the trainer).
      routed_experts: int ``[N, T, L, k]`` response record (``RolloutBatch.routed_experts``).
      prompt_width: ``P``, the trainer's left-padded prompt width; prompt ``i`` fills its last ``len_i`` columns.

    Raises:
      ValueError: a prompt record longer than ``prompt_width`` or with another ``[L, k]``.
    """
    resp = np.asarray(routed_experts, np.int32)
    n, _, n_layers, k = resp.shape
    prompt = np.full((n, prompt_width, n_layers, k), -1, np.int32)
    if prompt_routed_experts is not None:
        for i, r in enumerate(prompt_routed_experts):
            r = np.asarray(r, np.int32)
            if r.shape[0] > prompt_width or r.shape[1:] != (n_layers, k):
                raise ValueError(f"prompt routing record {i} has shape {r.shape}, expected [<= {prompt_width}, "
                                 f"{n_layers}, {k}]")
            if r.shape[0]:
                prompt[i, prompt_width - r.shape[0]:] = r
    return np.concatenate([prompt, resp], axis=1)
