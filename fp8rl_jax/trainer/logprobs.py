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
from fp8rl_jax.objectives.kl_entropy import entropy_from_logits

# Positions per logits chunk: 2048 x 151936 (Qwen3 vocab) x 4 B = 1.2 GB of float32 logits at a time, against
# 8 x 1024 x 151936 x 4 B = 5 GB (twice, with log_softmax) for a [B=8, T=1024] minibatch unchunked.
DEFAULT_CHUNK_SIZE = 2048


def response_logprobs_and_routing(model: CausalLM, prompt_ids: jax.Array, prompt_mask: jax.Array,
                                  response_ids: jax.Array, temperature: float | jax.Array = 1.0,
                                  routed_experts: jax.Array | None = None, *,
                                  chunk_size: int | None = DEFAULT_CHUNK_SIZE, return_entropy: bool = False,
                                  entropy_grad: bool = False):
    """:func:`response_logprobs` plus the router's own top-k ids of every column.

    ``chunk_size`` (positions per logits chunk, see :func:`token_logprobs`) bounds the logits memory; with
    ``return_entropy`` a third element, the float32 ``[B, T]`` entropy (nats) is returned, differentiable with
    ``entropy_grad`` (the entropy bonus, ``LossConfig.entropy_coeff``), else under ``stop_gradient``.

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
    logp, entropy = token_logprobs(model.logits, h[:, p - 1:p + t - 1], response_ids, temperature,
                                   chunk_size=chunk_size, with_entropy=return_entropy, entropy_grad=entropy_grad)
    return (logp, router_ids, entropy) if return_entropy else (logp, router_ids)


def token_logprobs(logits_fn, h: jax.Array, targets: jax.Array, temperature: float | jax.Array = 1.0, *,
                   chunk_size: int | None = DEFAULT_CHUNK_SIZE, with_entropy: bool = False,
                   entropy_grad: bool = False):
    """Per-token ``log softmax(logits / temperature)[target]`` (and entropy) without materializing ``[B, T, V]``.

    The ``B * T`` positions are processed ``chunk_size`` at a time (``jax.lax.map``); each chunk's
    ``[chunk_size, V]`` float32 logits live only inside the chunk, and under autodiff the chunk is rematerialized
    (``jax.checkpoint``) so the backward pass does not keep them either: peak logits memory is
    ``chunk_size * V * 4`` bytes instead of ``B * T * V * 4`` (tunix ``compute_logps_chunk_size``, maxtext vocab
    tiling). ``log_softmax(z)[y] = z_y - logsumexp(z)``; entropy ``H = logsumexp(z) - sum(softmax(z) * z)`` (nats,
    of the temperature-scaled distribution, as verl's ``actor/entropy``), returned under ``stop_gradient`` unless
    ``entropy_grad`` (then :func:`fp8rl_jax.objectives.kl_entropy.entropy_from_logits` of the chunk, whose gradient
    flows into ``h`` and the logits function's parameters, recomputed per chunk in the backward pass like the
    log-probs).

    Args:
      logits_fn: ``[N, hidden] -> [N, V]`` float32 (e.g. :meth:`CausalLM.logits`).
      h: hidden states ``[B, T, hidden]``; position ``(b, j)`` predicts ``targets[b, j]``.
      targets: int ``[B, T]`` token ids.
      temperature: logits are divided by it (> 0).
      chunk_size: positions per chunk (> 0), or None for one chunk (the plain ``[B, T, V]`` computation). When
        ``B * T <= chunk_size`` the single chunk is computed directly (no recompute in the backward pass).
      with_entropy: also return the entropy.
      entropy_grad: the entropy carries its gradient (needs ``with_entropy``).

    Returns:
      ``(logprobs float32 [B, T], entropy float32 [B, T] or None)``.

    Raises:
      ValueError: ``chunk_size`` not a positive int, or ``targets`` not ``[B, T]`` matching ``h``.
    """
    b, t = h.shape[:2]
    if tuple(targets.shape) != (b, t):
        raise ValueError(f"targets must have shape {(b, t)} (the hidden states' [B, T]), got {tuple(targets.shape)}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)
                                   or chunk_size <= 0):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    n = b * t
    hf, tf = h.reshape(n, h.shape[-1]), targets.reshape(n).astype(jnp.int32)

    def one(hc, tc):
        z = logits_fn(hc).astype(jnp.float32) / temperature  # [c, V]
        lse = jax.nn.logsumexp(z, axis=-1)
        lp = jnp.take_along_axis(z, tc[:, None], axis=-1)[:, 0] - lse
        if not with_entropy:
            return lp, None
        if entropy_grad:
            return lp, entropy_from_logits(z)
        zs = jax.lax.stop_gradient(z)
        ent = jax.lax.stop_gradient(lse) - jnp.sum(jax.nn.softmax(zs, axis=-1) * zs, axis=-1)
        return lp, ent

    if chunk_size is None or n <= chunk_size:
        lp, ent = one(hf, tf)
    else:
        pad = (-n) % chunk_size
        hc = jnp.pad(hf, ((0, pad), (0, 0))).reshape(-1, chunk_size, hf.shape[-1])
        tc = jnp.pad(tf, (0, pad)).reshape(-1, chunk_size)
        lp, ent = jax.lax.map(jax.checkpoint(lambda a: one(*a)), (hc, tc))
        lp = lp.reshape(-1)[:n]
        ent = ent.reshape(-1)[:n] if with_entropy else None
    return lp.reshape(b, t), (ent.reshape(b, t) if with_entropy else None)


def response_logprobs(model: CausalLM, prompt_ids: jax.Array, prompt_mask: jax.Array, response_ids: jax.Array,
                      temperature: float | jax.Array = 1.0, routed_experts: jax.Array | None = None, *,
                      chunk_size: int | None = DEFAULT_CHUNK_SIZE) -> jax.Array:
    """Logprobs of ``response_ids`` given left-padded prompts.

    Args:
      model: the policy.
      prompt_ids: int32 ``[B, P]`` left-padded; ``prompt_mask`` bool ``[B, P]``.
      response_ids: int32 ``[B, T]`` (tokens after a row's end are ignored by callers via ``response_mask``).
      temperature: logits are divided by it (> 0).
      routed_experts: optional R3 record to replay, int32 ``[B, P + T, L, k]`` (-1 = route normally); ignored by
        a dense model.
      chunk_size: positions per logits chunk (:func:`token_logprobs`); None computes ``[B, T, V]`` at once.

    Returns:
      float32 ``[B, T]``.
    """
    return response_logprobs_and_routing(model, prompt_ids, prompt_mask, response_ids, temperature,
                                         routed_experts, chunk_size=chunk_size)[0]


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
