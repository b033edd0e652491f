"""The RL loop: :class:`TrainConfig` (gin name ``train``), :class:`RLTrainer` (notebook use) and :func:`train`."""

from fp8rl_jax.trainer import distributed  # noqa: F401 (registers the gin configurable ``distributed``)
from fp8rl_jax.trainer import launch  # noqa: F401 (registers ``ray_launch``, so train.py accepts a Ray config too)
from fp8rl_jax.trainer.config import TrainConfig
from fp8rl_jax.trainer.loop import RLTrainer, make_optimizer
from fp8rl_jax.trainer.run import train

__all__ = ["TrainConfig", "RLTrainer", "make_optimizer", "train"]
