"""The rollout interface shared by the embedded JAX engine and vLLM (``rollout_bridge``).

Semantics follow vLLM's ``SamplingParams`` and its ``logprobs_mode="processed_logprobs"``: the logprob of
each sampled token is taken under the distribution it was sampled from (after temperature, top-k, top-p).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np


def check_prompt_token_ids(prompt_token_ids: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    """Validate a rollout request's prompts and return them as lists of Python ints.

    Args:
      prompt_token_ids: one sequence of token ids per prompt (any int-like values).
      vocab_size: the model's vocabulary size.

    Returns:
      ``[[int, ...], ...]``, one list per prompt.

    Raises:
      ValueError: no prompts, an empty prompt, or an id outside ``[0, vocab_size)`` (the range is named).
    """
    prompts = [[int(t) for t in p] for p in prompt_token_ids]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    flat = np.concatenate([np.asarray(p) for p in prompts])
    if flat.min() < 0 or flat.max() >= vocab_size:
        raise ValueError(f"generate: token ids must be in [0, {vocab_size}), got range [{flat.min()}, {flat.max()}]")
    return prompts


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample completions (vLLM names and meanings).

    Attributes:
      n: completions per prompt; rows of the result are grouped per prompt (prompt 0's n rows first).
      temperature: softmax temperature; 0 means greedy (argmax).
      top_p: nucleus sampling mass in (0, 1]; 1 disables.
      top_k: keep the k most likely tokens; -1 or 0 disables.
      max_tokens: response length budget (tokens).
      stop_token_ids: extra ids that end a response (the model's EOS ids are always included unless
        ``ignore_eos``); the stop token itself is part of the response (``response_mask`` 1), as in verl.
      ignore_eos: do not stop at the model's EOS ids.
      seed: PRNG seed for this call; None uses the engine's running key.

    Raises:
      ValueError: out-of-range values (named).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclasses.dataclass
class RolloutBatch:
    """Completions of one ``generate`` call. ``N = len(prompts) * n`` rows, ``T = max_tokens`` columns.

    Attributes:
      prompt_token_ids: list of N prompt id lists (each prompt repeated n times, adjacent).
      response_token_ids: int32 ``[N, T]``; positions after the end hold ``pad_token_id``.
      rollout_logprobs: float32 ``[N, T]``; sampled-token logprobs under the sampling distribution (0 where masked).
      response_mask: float32 ``[N, T]``; 1 for generated tokens (stop token included), 0 after.
      finish_reason: N strings, ``"stop"`` or ``"length"``.
      prompt_index: int32 ``[N]``, which input prompt each row answers.
      weights_version: version of the weights that produced the batch (see ``update_weights``).
      routed_experts: rollout routing record for R3 (arXiv 2510.11370): int32 ``[N, T, L, k]``, the top-k expert
        ids (descending router probability) that each MoE layer chose for response token ``j`` when the engine
        fed it to the model (``L = num_hidden_layers``, ``k = num_experts_per_tok``). ``-1`` for dense (non-MoE)
        layers, positions after a row's end (``response_mask`` 0) and tokens the engine never fed (vLLM does not
        run the last sampled token; its routing influences no scored logprob). None for dense models and for
        engines that do not record routing.
      prompt_routed_experts: the same record for the prompt tokens (prefill): N int32 arrays ``[len(prompt_i), L,
        k]`` in prompt order, or None. Token ``P - 1``'s routing decides the hidden state that predicts response
        token 0, so the trainer replays prompt routing too when it is present (see ``train.routing_replay``).
    """

    prompt_token_ids: list[list[int]]
    response_token_ids: np.ndarray
    rollout_logprobs: np.ndarray
    response_mask: np.ndarray
    finish_reason: list[str]
    prompt_index: np.ndarray
    weights_version: int = 0
    routed_experts: np.ndarray | None = None
    prompt_routed_experts: list[np.ndarray] | None = None
    token_versions: np.ndarray | None = None

    @property
    def response_lengths(self) -> np.ndarray:
        """int32 ``[N]`` generated tokens per row."""
        return self.response_mask.sum(-1).astype(np.int32)

    def __repr__(self) -> str:
        n, t = np.shape(self.response_token_ids)
        lengths = self.response_lengths if n else np.zeros(1)
        stops = sum(f == "stop" for f in self.finish_reason)
        extra = "" if self.routed_experts is None else ", routed_experts recorded"
        if self.token_versions is not None and np.any(np.asarray(self.token_versions) >= 0):
            tv = np.asarray(self.token_versions)[np.asarray(self.token_versions) >= 0]
            extra += f", token versions {int(tv.min())}..{int(tv.max())}"
        return (f"RolloutBatch({n} rows x {t} tokens from {len(set(np.asarray(self.prompt_index).tolist()))} prompts, "
                f"weights version {self.weights_version}, response length mean {float(lengths.mean()):.1f} / max "
                f"{int(lengths.max(initial=0))}, {stops} stopped / {n - stops} cut at max_tokens{extra})")


@dataclasses.dataclass
class ExportedWeights:
    """One step's weights in checkpoint layout, as the trainer hands them to a rollout engine.

    Attributes:
      tensors: ``{hf_name: array}``; linear weights ``[out, in]``. For ``format="fp8_blockwise"`` each linear
        ``...proj.weight`` is e4m3 with a float32 ``...proj.weight_scale_inv`` ``[ceil(out/128), ceil(in/128)]``
        beside it (vLLM's blockwise FP8 checkpoint names); embeddings, norms and lm_head stay ``dense_dtype``.
        With an FP8 KV cache, per-layer float32 scalars ``model.layers.{i}.self_attn.{k,v,q}_scale`` (vLLM's
        dequantization multipliers; see :mod:`fp8rl_jax.fp8.kv_cache`) ride along.
      format: ``"fp8_blockwise"`` | ``"bf16"`` | ``"float32"``.
      block_size: FP8 weight block (``[block_size, block_size]``).
      version: monotonically increasing weights version (the trainer step).
      metadata: free-form extras: ``"ue8m0"``; ``"kv_scales_version"`` (the weights version the kv scales were
        calibrated for; an FP8-cache engine refuses to generate while it is older than ``version``).
    """

    tensors: dict[str, Any]
    format: str
    block_size: int = 128
    version: int = 0
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Total bytes of all tensors."""
        return int(sum(np.prod(t.shape) * np.dtype(t.dtype).itemsize for t in self.tensors.values()))

    def __repr__(self) -> str:
        dtypes: dict[str, int] = {}
        for t in self.tensors.values():
            dtypes[str(np.dtype(t.dtype))] = dtypes.get(str(np.dtype(t.dtype)), 0) + 1
        kinds = ", ".join(f"{c} {d}" for d, c in sorted(dtypes.items()))
        return (f"ExportedWeights(version {self.version}, format {self.format!r}, block_size {self.block_size}, "
                f"{len(self.tensors)} tensors ({kinds}), {self.nbytes / 1e6:.1f} MB)")


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from an inference engine (embedded JAX engine or vLLM)."""

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling_params: SamplingParams) -> RolloutBatch:
        """Sample ``sampling_params.n`` completions per prompt."""

    def update_weights(self, weights: ExportedWeights) -> None:
        """Replace the engine's weights with ``weights`` (must match its names, shapes and format)."""

    def close(self) -> None:
        """Release the engine's resources."""
