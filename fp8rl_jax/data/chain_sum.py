"""Procedural arithmetic training tasks from reasoning-gym (``chain_sum``, ``basic_arithmetic``).

reasoning-gym datasets are procedural: item ``i`` is generated from ``random.Random(seed + i)``, so a
dataset is fully determined by its config and nothing is stored. We wrap one as a ``PromptDataset`` whose
items carry the question plus a short instruction as a single user message (short prompts: the CPU
default model is SmolLM2-135M-Instruct).

Train/eval split: two datasets with seeds ``s`` and ``t`` share items when ``|s - t| < size`` (item ``i``
of seed ``s`` is item ``i + s - t`` of seed ``t``); keep held-out seeds at least ``size`` apart.
"""

from __future__ import annotations

import operator
from typing import Any

import gin

from fp8rl_jax.data.types import IndexedDataset, PromptItem

DEFAULT_INSTRUCTION = "Give the final answer as a single number."
SUPPORTED_TASKS = ("chain_sum", "basic_arithmetic")


class ReasoningGymDataset(IndexedDataset):
    """A ``PromptDataset`` over a reasoning-gym procedural dataset; items are generated on access.

    Args:
      task: reasoning-gym task name (one of ``SUPPORTED_TASKS``).
      rg_config: keyword arguments for ``reasoning_gym.create_dataset(task, **rg_config)`` (must include
        ``size`` and an int ``seed``).
      system_prompt: optional system message put before the user message.
      instruction: text appended (on a new line) to reasoning-gym's question; ``None`` or ``""`` for none.

    Item layout: ``PromptItem(messages=[(system), user], answer=<reasoning-gym answer str>, task=task,
    metadata={"index", "question" (reasoning-gym's raw question), "reasoning_gym" (its metadata dict)})``.
    ``rewards.chain_sum_reward`` rebuilds reasoning-gym's entry from these to call its ``score_answer``.

    Raises:
      ValueError: unsupported task, missing/negative seed, or a config reasoning-gym rejects.
    """

    def __init__(self, task: str, rg_config: dict, system_prompt: str | None = None,
                 instruction: str | None = DEFAULT_INSTRUCTION):
        if task not in SUPPORTED_TASKS:
            raise ValueError(f"unsupported reasoning-gym task {task!r}; supported: {', '.join(SUPPORTED_TASKS)}")
        seed = rg_config.get("seed")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be a non-negative int (reasoning-gym draws a random one for None), got {seed!r}")
        try:
            import reasoning_gym  # lazy: importing fp8rl_jax (e.g. trainer.config) must not need it

            self._rg = reasoning_gym.create_dataset(task, **rg_config)
        except (AssertionError, TypeError) as e:  # reasoning-gym validates configs with assert
            raise ValueError(f"invalid reasoning-gym config for {task!r} {rg_config}: {e}") from e
        self.task = task
        self.rg_config = dict(rg_config)
        self.system_prompt = system_prompt
        self.instruction = instruction
        self._size = int(rg_config["size"])

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index: int) -> PromptItem:
        """Generate item ``index`` (int; negative counts from the end). Raises IndexError out of range."""
        i = operator.index(index)
        if i < 0:
            i += self._size
        if not 0 <= i < self._size:
            raise IndexError(f"index {index} out of range for {self.task} dataset of size {self._size}")
        entry = self._rg[i]
        question = entry["question"]
        content = f"{question}\n{self.instruction}" if self.instruction else question
        messages = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": content})
        return PromptItem(messages=messages, answer=str(entry["answer"]), task=self.task,
                          metadata={"index": i, "question": question, "reasoning_gym": entry["metadata"]})

    def __repr__(self) -> str:
        return f"ReasoningGymDataset(task={self.task!r}, config={self.rg_config})"


@gin.configurable
def chain_sum_dataset(size: int = 10_000, seed: int = 0, min_terms: int = 2, max_terms: int = 3,
                      min_digits: int = 1, max_digits: int = 1, allow_negation: bool = False,
                      task: str = "chain_sum", system_prompt: str | None = None,
                      instruction: str | None = DEFAULT_INSTRUCTION,
                      extra_config: dict[str, Any] | None = None) -> ReasoningGymDataset:
    """Build the arithmetic training dataset (gin: ``chain_sum_dataset.*``).

    ``task="chain_sum"`` (default): reasoning-gym's additions/subtractions of ``min_terms..max_terms``
    numbers with ``min_digits..max_digits`` digits, e.g. "State the final answer to the following
    arithmetic problem: 4 + 7 - 2 =". ``task="basic_arithmetic"``: reasoning-gym's + - * / expressions with
    parentheses (its ``/`` is exact or floor division, as reasoning-gym evaluates it), e.g.
    "Calculate -3 * (4 + 1)."; its own defaults also allow negation and parentheses.

    Args:
      size: number of items (reasoning-gym's virtual size).
      seed: non-negative int; item ``i`` is drawn from ``random.Random(seed + i)`` by reasoning-gym.
      min_terms, max_terms, min_digits, max_digits, allow_negation: reasoning-gym config fields.
      task: ``"chain_sum"`` or ``"basic_arithmetic"``.
      system_prompt: optional system message.
      instruction: appended to the question in the user message.
      extra_config: further reasoning-gym config fields (e.g. ``{"operators": ("+", "-", "*"),
        "allow_parentheses": False}`` for basic_arithmetic).

    Returns:
      a ``ReasoningGymDataset`` (a ``PromptDataset``).

    Raises:
      ValueError: unsupported task or invalid config.
    """
    cfg = dict(size=size, seed=seed, min_terms=min_terms, max_terms=max_terms, min_digits=min_digits,
               max_digits=max_digits, allow_negation=allow_negation)
    cfg.update(extra_config or {})
    return ReasoningGymDataset(task, cfg, system_prompt=system_prompt, instruction=instruction)
