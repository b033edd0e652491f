"""Outcome-reward advantages for group-sampled RL: GRPO, Dr. GRPO, RLOO.

Rows are grouped consecutively: a batch of ``B = P * n`` rewards holds prompt ``p``'s ``n`` samples at rows
``p*n .. p*n + n - 1`` (the layout of ``RolloutEngine.generate`` with each prompt repeated ``n`` times).
All functions return float32 ``[B]`` advantages; broadcast them over tokens with ``advantages[:, None]``
(``ppo_clip_loss`` accepts ``[B]`` directly).
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["grpo_advantages", "drgrpo_advantages", "rloo_advantages"]


def _grouped(rewards, group_size: int, fn_name: str) -> jnp.ndarray:
    r = jnp.asarray(rewards, jnp.float32)
    if r.ndim != 1:
        raise ValueError(f"{fn_name}: rewards must be [B], got shape {tuple(r.shape)}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"{fn_name}: group_size must be a positive int, got {group_size!r}")
    if r.shape[0] % group_size != 0:
        raise ValueError(
            f"{fn_name}: rewards has {r.shape[0]} rows, not a multiple of group_size={group_size}"
        )
    return r.reshape(-1, group_size)


def grpo_advantages(rewards, group_size: int, norm_by_std: bool = True, eps: float = 1e-6) -> jnp.ndarray:
    """GRPO group-normalized advantages.

    ``A_i = (r_i - mean_g) / (std_g + eps)`` (``norm_by_std=True``, GRPO: Shao et al. 2024, DeepSeekMath,
    eq. in sec. 4.1.2), or ``A_i = r_i - mean_g`` (``norm_by_std=False``: Dr. GRPO, Liu et al. 2025,
    arXiv 2503.20783). ``std_g`` is the unbiased (ddof=1) sample std, as ``torch.std`` in verl's
    ``compute_grpo_outcome_advantage`` (verl/trainer/ppo/core_algos.py, ``norm_adv_by_std_in_grpo``,
    ``epsilon=1e-6``). A group of one sample gets verl's convention ``mean=0, std=1``.

    Args:
      rewards: ``[B]`` scalar outcome rewards, any float/int dtype.
      group_size: samples per prompt ``n``; ``B`` must be a multiple of it.
      norm_by_std: divide by the group std (GRPO) or not (Dr. GRPO).
      eps: added to the std.

    Returns:
      float32 ``[B]``.

    Raises:
      ValueError: rewards not 1-D, ``group_size`` not a positive int, or ``B % group_size != 0``.
    """
    g = _grouped(rewards, group_size, "grpo_advantages")
    if group_size == 1:
        mean = jnp.zeros_like(g[:, :1])
        std = jnp.ones_like(g[:, :1])
    else:
        mean = jnp.mean(g, axis=1, keepdims=True)
        std = jnp.std(g, axis=1, keepdims=True, ddof=1)
    adv = (g - mean) / (std + eps) if norm_by_std else g - mean
    return adv.reshape(-1)


def drgrpo_advantages(rewards, group_size: int) -> jnp.ndarray:
    """Dr. GRPO advantages ``A_i = r_i - mean_g`` (no std division; Liu et al. 2025, arXiv 2503.20783).

    Same as ``grpo_advantages(rewards, group_size, norm_by_std=False)``; pair it with
    ``loss_agg_mode="seq-mean-token-sum-norm"`` for the full Dr. GRPO objective.

    Raises:
      ValueError: as ``grpo_advantages``.
    """
    return grpo_advantages(rewards, group_size, norm_by_std=False)


def rloo_advantages(rewards, group_size: int) -> jnp.ndarray:
    """REINFORCE Leave-One-Out advantages (Ahmadian et al. 2024, arXiv 2402.14740).

    ``A_i = r_i - mean_{j != i} r_j = n/(n-1) * (r_i - mean_g)`` for ``n = group_size > 1``; a group of
    one keeps ``A_i = r_i``, as verl's ``compute_rloo_outcome_advantage`` (verl/trainer/ppo/core_algos.py).

    Args:
      rewards: ``[B]`` scalar rewards; group_size: samples per prompt.

    Returns:
      float32 ``[B]``.

    Raises:
      ValueError: as ``grpo_advantages``.
    """
    g = _grouped(rewards, group_size, "rloo_advantages")
    if group_size == 1:
        return g.reshape(-1)
    n = float(group_size)
    mean = jnp.mean(g, axis=1, keepdims=True)
    return (g * n / (n - 1.0) - mean * n / (n - 1.0)).reshape(-1)
