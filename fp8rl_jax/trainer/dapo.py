"""DAPO's data-side techniques (Yu et al. 2025, arXiv 2503.14476, sec. 3.2-3.4), with verl's semantics.

* **Soft overlong punishment** (DAPO eq. 13; verl ``DAPORewardManager``, ``reward_model.overlong_buffer``
  {``enable``, ``len``, ``penalty_factor``}): for a response of ``L`` tokens (stop token included), budget
  ``L_max`` (``max_response_length``) and buffer ``L_b``, the reward gets
  ``min(0, (L_max - L_b - L) / L_b) * penalty_factor`` added: 0 up to ``L_max - L_b`` tokens, then linear
  down to ``-penalty_factor`` at ``L_max``.
* **Overlong filtering** (DAPO sec. 3.4): truncated responses (``finish_reason == "length"``) are masked out
  of the loss (their ``response_mask`` row is zeroed); they still count in the group statistics.
* **Dynamic sampling** (DAPO sec. 3.2, eq. 11; verl ``algorithm.filter_groups`` {``enable``, ``metric``,
  ``max_num_gen_batches``}, ``recipe/dapo/dapo_ray_trainer.py``): generate a batch of prompts, drop every
  group (the ``n`` samples of one prompt) whose filter metric has zero std (all correct or all wrong: zero
  GRPO advantage), keep generating further batches until ``prompts_per_step`` groups are kept, then keep the
  first ``prompts_per_step`` groups. A group of one sample is always kept (verl). When
  ``max_num_gen_batches > 0`` batches were generated and still too few groups are kept, raise ``ValueError``
  (verl's behaviour; ``max_num_gen_batches = 0`` means no limit).

Filter metrics (verl names): ``"acc"`` / ``"score"``: the reward function's score (before the overlong
penalty); ``"seq_reward"`` / ``"seq_final_reward"``: the reward after the overlong penalty (no KL-in-reward
here, so the two agree).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from fp8rl_jax.rollout.types import RolloutBatch

FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")


def overlong_penalty(lengths, max_response_length: int, overlong_buffer_len: int,
                     penalty_factor: float = 1.0) -> np.ndarray:
    """DAPO soft overlong punishment, ``min(0, (L_max - L_b - L) / L_b) * penalty_factor`` per response.

    Source: DAPO eq. 13 and verl ``DAPORewardManager`` (``exceed_len = L - (L_max - L_b)``,
    ``overlong_reward = min(-exceed_len / L_b * penalty_factor, 0)``).

    Args:
      lengths: ``[N]`` response lengths in tokens (stop token included), any int/float dtype.
      max_response_length: ``L_max``, the response budget in tokens (>= 1).
      overlong_buffer_len: ``L_b`` in tokens, ``1 <= L_b <= L_max``.
      penalty_factor: the penalty at ``L = L_max`` is ``-penalty_factor`` (>= 0).

    Returns:
      float64 ``[N]``, all <= 0: 0 for ``L <= L_max - L_b``, ``-penalty_factor`` at ``L = L_max`` (below that
      for ``L > L_max``, which an engine honouring the budget never returns).

    Raises:
      ValueError: ``L_b`` outside ``[1, L_max]``, negative ``penalty_factor``, or ``lengths`` not 1-D.
    """
    if max_response_length < 1:
        raise ValueError(f"max_response_length must be >= 1, got {max_response_length}")
    if not 1 <= overlong_buffer_len <= max_response_length:
        raise ValueError(f"overlong_buffer_len must be in [1, max_response_length={max_response_length}], "
                         f"got {overlong_buffer_len}")
    if penalty_factor < 0:
        raise ValueError(f"overlong_penalty_factor must be >= 0, got {penalty_factor}")
    lengths = np.asarray(lengths, np.float64)
    if lengths.ndim != 1:
        raise ValueError(f"lengths must be 1-D [N], got shape {lengths.shape}")
    expected = max_response_length - overlong_buffer_len
    return np.minimum(0.0, (expected - lengths) / overlong_buffer_len) * penalty_factor


def kept_groups(values, group_size: int) -> np.ndarray:
    """Which groups dynamic sampling keeps: population std of the group's values > 0, or a group of one.

    Args:
      values: ``[G * group_size]`` per-sample filter metric, grouped contiguously (prompt 0's samples first).
      group_size: samples per prompt ``n`` (>= 1).

    Returns:
      bool ``[G]``.

    Raises:
      ValueError: ``values`` not 1-D or its length not a multiple of ``group_size``.
    """
    v = np.asarray(values, np.float64)
    if v.ndim != 1 or group_size < 1 or v.size % group_size:
        raise ValueError(f"values must be 1-D with a length divisible by group_size={group_size}, "
                         f"got shape {v.shape}")
    g = v.reshape(-1, group_size)
    if group_size == 1:
        return np.ones(g.shape[0], bool)
    return g.std(axis=1) > 0


@dataclasses.dataclass
class ScoredBatch:
    """One generation batch after scoring. ``N = B * n`` rows grouped per prompt.

    Attributes:
      rollout: the engine's :class:`RolloutBatch` (``prompt_index`` into ``items``).
      items: the B prompt items (anything; indexed by ``rollout.prompt_index``).
      texts: N decoded completions.
      scores: float64 ``[N]``, reward-function scores (verl ``acc``/``score``).
      rewards: float64 ``[N]``, scores plus the overlong penalty (verl ``seq_reward``); what advantages use.
    """

    rollout: RolloutBatch
    items: list
    texts: list[str]
    scores: np.ndarray
    rewards: np.ndarray

    def __len__(self) -> int:
        return len(self.texts)


def select_groups(sb: ScoredBatch, groups, group_size: int) -> ScoredBatch:
    """The rows of the listed groups (int indices into the B prompts), in the given order.

    Items are re-indexed so ``rollout.prompt_index`` of the result counts ``0..len(groups)-1``.
    """
    groups = [int(g) for g in groups]
    rows = np.array([g * group_size + j for g in groups for j in range(group_size)], np.int64)
    rb = sb.rollout
    new_rb = RolloutBatch(
        prompt_token_ids=[rb.prompt_token_ids[r] for r in rows],
        response_token_ids=np.asarray(rb.response_token_ids)[rows],
        rollout_logprobs=np.asarray(rb.rollout_logprobs)[rows],
        response_mask=np.asarray(rb.response_mask)[rows],
        finish_reason=[rb.finish_reason[r] for r in rows],
        prompt_index=np.repeat(np.arange(len(groups), dtype=np.int32), group_size),
        weights_version=rb.weights_version,
        routed_experts=None if rb.routed_experts is None else np.asarray(rb.routed_experts)[rows],
        prompt_routed_experts=(None if rb.prompt_routed_experts is None
                               else [rb.prompt_routed_experts[r] for r in rows]),
        token_versions=None if rb.token_versions is None else np.asarray(rb.token_versions)[rows])
    return ScoredBatch(new_rb, [sb.items[int(rb.prompt_index[g * group_size])] for g in groups],
                       [sb.texts[r] for r in rows], sb.scores[rows], sb.rewards[rows])


def concat_scored(batches: list[ScoredBatch]) -> ScoredBatch:
    """Concatenate scored batches row-wise (``prompt_index`` offset per batch).

    Raises:
      ValueError: empty list, or response arrays with different widths ``T`` (named).
    """
    if not batches:
        raise ValueError("concat_scored needs at least one batch")
    widths = {np.asarray(b.rollout.response_token_ids).shape[1] for b in batches}
    if len(widths) != 1:
        raise ValueError(f"cannot concatenate rollouts with different response widths {sorted(widths)}")
    offsets = np.cumsum([0] + [len(b.items) for b in batches])
    rb = RolloutBatch(
        prompt_token_ids=[p for b in batches for p in b.rollout.prompt_token_ids],
        response_token_ids=np.concatenate([np.asarray(b.rollout.response_token_ids) for b in batches]),
        rollout_logprobs=np.concatenate([np.asarray(b.rollout.rollout_logprobs) for b in batches]),
        response_mask=np.concatenate([np.asarray(b.rollout.response_mask) for b in batches]),
        finish_reason=[f for b in batches for f in b.rollout.finish_reason],
        prompt_index=np.concatenate([np.asarray(b.rollout.prompt_index) + o for b, o in zip(batches, offsets)]
                                    ).astype(np.int32),
        weights_version=batches[-1].rollout.weights_version,
        # R3 routing records ride along only when every batch has one
        routed_experts=(None if any(b.rollout.routed_experts is None for b in batches)
                        else np.concatenate([np.asarray(b.rollout.routed_experts) for b in batches])),
        prompt_routed_experts=(None if any(b.rollout.prompt_routed_experts is None for b in batches)
                               else [r for b in batches for r in b.rollout.prompt_routed_experts]),
        token_versions=(None if any(b.rollout.token_versions is None for b in batches)
                        else np.concatenate([np.asarray(b.rollout.token_versions) for b in batches])))
    return ScoredBatch(rb, [it for b in batches for it in b.items], [t for b in batches for t in b.texts],
                       np.concatenate([b.scores for b in batches]), np.concatenate([b.rewards for b in batches]))


def filter_values(sb: ScoredBatch, metric: str) -> np.ndarray:
    """The per-sample values the group filter looks at (see module doc). ValueError for an unknown metric."""
    if metric in ("acc", "score"):
        return sb.scores
    if metric in ("seq_reward", "seq_final_reward"):
        return sb.rewards
    raise ValueError(f"unknown filter_groups metric {metric!r}; valid: {list(FILTER_METRICS)}")


def dynamic_sampling(generate: Callable[[], ScoredBatch], prompts_per_step: int, group_size: int,
                     max_num_gen_batches: int = 10, metric: str = "acc") -> tuple[ScoredBatch, dict[str, float]]:
    """DAPO dynamic sampling: call ``generate()`` until ``prompts_per_step`` groups with non-zero std are kept.

    Source: verl ``recipe/dapo/dapo_ray_trainer.py`` (``filter_groups``): groups are kept in generation
    order, batches are concatenated, and the result is cut to the first ``prompts_per_step`` kept groups.

    Args:
      generate: returns the next scored batch (a fresh batch of prompts, ``group_size`` samples each).
      prompts_per_step: groups to collect (verl ``data.train_batch_size``).
      group_size: samples per prompt ``n``.
      max_num_gen_batches: give up after this many ``generate()`` calls (0 = never give up).
      metric: filter metric, one of ``FILTER_METRICS``.

    Returns:
      (the ``prompts_per_step * group_size``-row batch, metrics ``{"dapo/num_gen_batches",
      "dapo/kept_groups_fraction" (kept / generated groups), "dapo/gen_reward_mean" (mean reward over all
      generated rows), "dapo/gen_score_mean"}``).

    Raises:
      ValueError: unknown ``metric``, or ``max_num_gen_batches`` batches did not yield enough groups (the
        message says how many were kept; raise the limit, set it to 0, or use easier data).
    """
    if metric not in FILTER_METRICS:
        raise ValueError(f"unknown filter_groups metric {metric!r}; valid: {list(FILTER_METRICS)}")
    kept: list[ScoredBatch] = []
    num_kept = num_generated = num_gen_batches = 0
    reward_sum = score_sum = 0.0
    rows = 0
    while num_kept < prompts_per_step:
        if max_num_gen_batches > 0 and num_gen_batches >= max_num_gen_batches:
            raise ValueError(
                f"dynamic sampling: num_gen_batches={num_gen_batches} >= max_num_gen_batches={max_num_gen_batches} "
                f"with only {num_kept}/{prompts_per_step} groups of non-zero reward std; the data may be too "
                f"easy or too hard. Raise train.max_num_gen_batches (0 = no limit) or disable train.filter_groups.")
        sb = generate()
        num_gen_batches += 1
        reward_sum += float(np.sum(sb.rewards))
        score_sum += float(np.sum(sb.scores))
        rows += len(sb)
        keep = kept_groups(filter_values(sb, metric), group_size)
        num_generated += keep.size
        num_kept += int(keep.sum())
        if keep.any():
            kept.append(select_groups(sb, np.flatnonzero(keep), group_size))
    out = concat_scored(kept)
    if len(out.items) > prompts_per_step:
        out = select_groups(out, range(prompts_per_step), group_size)
    return out, {"dapo/num_gen_batches": float(num_gen_batches),
                 "dapo/kept_groups_fraction": num_kept / max(num_generated, 1),
                 "dapo/gen_reward_mean": reward_sum / max(rows, 1),
                 "dapo/gen_score_mean": score_sum / max(rows, 1)}


def overlong_filter_mask(response_mask, finish_reason) -> np.ndarray:
    """DAPO overlong filtering: ``response_mask`` (float32 ``[N, T]``) with the rows of truncated responses
    (``finish_reason == "length"``) zeroed, so they contribute no loss. ValueError if the row counts differ."""
    m = np.array(response_mask, np.float32, copy=True)
    if m.shape[0] != len(finish_reason):
        raise ValueError(f"response_mask has {m.shape[0]} rows but finish_reason has {len(finish_reason)}")
    m[np.array([f == "length" for f in finish_reason], bool)] = 0.0
    return m
