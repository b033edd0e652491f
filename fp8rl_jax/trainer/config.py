"""The RL run's configuration: one frozen dataclass, gin-configurable under the name ``train``.

Every knob a user turns is a field with a default; gin binds them as ``train.num_steps = 3`` (or
``--gin_param='train.num_steps=3'``); notebooks build ``TrainConfig(...)`` directly.
"""

from __future__ import annotations

import dataclasses

import gin

ROLLOUT_PRECISIONS = ("fp8", "bf16", "float32")
TRAIN_DTYPES = ("float32",)
ADVANTAGE_ESTIMATORS = ("grpo", "drgrpo", "rloo")


@gin.configurable("train")
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """GRPO with (FP8) rollout and rollout correction.

    Attributes:
      output_dir: run directory (``metrics.jsonl``, ``summary.json``, ``config.gin``).
      model: packaged model name (``"smollm2-135m-instruct"``), a ``.gguf`` path or an HF directory.
      task: training task for :func:`fp8rl_jax.data.chain_sum_dataset` (a reasoning-gym task name).
      reward: reward function name (:func:`fp8rl_jax.data.get_reward_fn`).
      num_steps: RL steps (one rollout + one policy update + one weight sync each).
      prompts_per_step: prompts per step (B); ``samples_per_prompt`` completions each (n, the GRPO group).
      max_tokens: response budget; ``temperature``/``top_p``/``top_k``: sampling (vLLM semantics).
      rollout_precision: ``"fp8"`` (W8A8 blockwise), ``"bf16"`` or ``"float32"`` rollout weights.
      train_dtype: trainer compute/master dtype.
      learning_rate, weight_decay, adam_b1, adam_b2, adam_eps, warmup_steps, max_grad_norm: optax AdamW with
        linear warmup and global-norm clipping.
      ppo_epochs, num_minibatches: updates per step (1 and 1 = one on-policy update, verl's default shape).
      advantage_estimator: ``"grpo"`` | ``"drgrpo"`` | ``"rloo"``.
      seed: seeds data order, sampling and init.
      progress_bar: show a tqdm bar.
    """

    output_dir: str = "runs/default"
    model: str = "smollm2-135m-instruct"
    task: str = "chain_sum"
    reward: str = "chain_sum"
    num_steps: int = 20
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    max_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    rollout_precision: str = "fp8"
    train_dtype: str = "float32"
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    ppo_epochs: int = 1
    num_minibatches: int = 1
    advantage_estimator: str = "grpo"
    seed: int = 0
    progress_bar: bool = True

    def __post_init__(self):
        def choice(name, valid):
            if getattr(self, name) not in valid:
                raise ValueError(f"train.{name}={getattr(self, name)!r} is not one of {list(valid)}")

        choice("rollout_precision", ROLLOUT_PRECISIONS)
        choice("train_dtype", TRAIN_DTYPES)
        choice("advantage_estimator", ADVANTAGE_ESTIMATORS)
        for name in ("num_steps", "prompts_per_step", "samples_per_prompt", "max_tokens", "ppo_epochs",
                     "num_minibatches"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be a positive int, got {getattr(self, name)!r}")
        if (self.prompts_per_step * self.samples_per_prompt) % self.num_minibatches:
            raise ValueError(f"prompts_per_step*samples_per_prompt={self.prompts_per_step * self.samples_per_prompt}"
                             f" is not divisible by num_minibatches={self.num_minibatches}")
        if self.learning_rate <= 0:
            raise ValueError(f"train.learning_rate must be > 0, got {self.learning_rate}")
