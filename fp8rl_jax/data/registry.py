"""The training-task names of ``train.task`` and the one function that builds their prompt dataset."""

from __future__ import annotations

import gin

from fp8rl_jax.data.chain_sum import SUPPORTED_TASKS as REASONING_GYM_TASKS
from fp8rl_jax.data.chain_sum import chain_sum_dataset
from fp8rl_jax.data.math_eval import math_train_dataset
from fp8rl_jax.data.prompt_file import prompt_file_dataset
from fp8rl_jax.data.types import PromptDataset

#: Values of ``train.task``: reasoning-gym tasks, ``"math"`` (MATH train proxy), ``"file"`` (a verl-layout file).
TRAIN_TASKS = (*REASONING_GYM_TASKS, "math", "file")


def make_train_dataset(task: str, seed: int) -> PromptDataset:
    """The training prompt dataset of ``train.task``.

    * ``"chain_sum"`` / ``"basic_arithmetic"``: ``chain_sum_dataset(task=task, seed=seed)`` (reasoning-gym,
      procedural; ``seed`` picks the items), other fields from gin ``chain_sum_dataset.*``.
    * ``"math"``: ``math_train_dataset()`` (the 4,500 MATH test problems outside MATH-500; gin
      ``math_train_dataset.*``).
    * ``"file"``: ``prompt_file_dataset()`` with ``path`` and the other fields from gin
      (``prompt_file_dataset.path = '/data/dapo-math-17k.parquet'``).

    For ``"math"`` and ``"file"`` the items are fixed and ``seed`` is unused here (the trainer's batch order
    still depends on it through ``iterate_batches``).

    Raises:
      ValueError: unknown ``task`` (the message lists ``TRAIN_TASKS``); ``"file"`` without a gin binding for
        ``prompt_file_dataset.path``; whatever the dataset builder raises (FileNotFoundError, ImportError,
        ValueError, assets.AssetNotFoundError).
    """
    if task in REASONING_GYM_TASKS:
        return chain_sum_dataset(task=task, seed=seed)
    if task == "math":
        return math_train_dataset()
    if task == "file":
        try:
            gin.query_parameter("prompt_file_dataset.path")
        except ValueError:
            raise ValueError("train.task='file' needs the prompt file path as a gin binding: "
                             "prompt_file_dataset.path = '/path/to/train.parquet' (or .jsonl/.jsonl.gz/.json)"
                             ) from None
        return prompt_file_dataset()
    raise ValueError(f"unknown training task {task!r}; valid: {list(TRAIN_TASKS)}")
