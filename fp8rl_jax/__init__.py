"""fp8rl-jax: JAX/Flax RL for LLMs with FP8 rollout.

Subpackages: ``fp8`` (FP8 numerics), ``models`` (Flax NNX decoder + checkpoint I/O), ``rollout`` (embedded
JAX engine), ``objectives`` (advantages, policy losses, rollout correction), ``data`` (tasks, rewards),
``trainer`` (the RL loop). ``fp8rl_jax`` never imports torch, vllm or ray.
"""

__version__ = "0.1.0"
