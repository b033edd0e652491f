"""The RL loop: rollout -> reward -> advantages -> old logprobs -> corrected policy loss -> update -> sync.

One step, as in shared/DESIGN.md "One RL step": the rollout engine samples ``n`` completions for each of B
prompts with ``rollout_logprobs``; rewards and GRPO advantages are computed; the trainer recomputes
``old_logprobs`` in training precision; the loss is the PPO clipped surrogate times rollout-correction
weights (token TIS by default) from ``fp8rl_jax.objectives``; optax AdamW updates the float32 master params;
the params are exported (FP8 blockwise by default) and loaded into the engine in place.

:class:`RLTrainer` is plain Python for notebooks (``RLTrainer(TrainConfig(...)).step()``); :func:`train` is
the gin/script entry point.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from fp8rl_jax import objectives
from fp8rl_jax.data import chain_sum_dataset, get_reward_fn
from fp8rl_jax.export import export_weights
from fp8rl_jax.models.decoder import named_params
from fp8rl_jax.models.loading import build_model, load_checkpoint, load_tokenizer_for
from fp8rl_jax.rollout.engine import ENGINE_PRECISIONS, JaxRolloutEngine
from fp8rl_jax.rollout.types import RolloutEngine, SamplingParams
from fp8rl_jax.trainer.config import TrainConfig
from fp8rl_jax.trainer.logprobs import left_pad, response_logprobs

_ADVANTAGES = {"grpo": objectives.grpo_advantages, "drgrpo": objectives.drgrpo_advantages,
               "rloo": objectives.rloo_advantages}


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """optax chain: global-norm clipping, then AdamW with linear warmup to a constant learning rate."""
    lr = cfg.learning_rate if cfg.warmup_steps == 0 else optax.linear_schedule(
        cfg.learning_rate / max(cfg.warmup_steps, 1), cfg.learning_rate, cfg.warmup_steps)
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm),
                       optax.adamw(lr, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                                   weight_decay=cfg.weight_decay))


class RLTrainer:
    """GRPO trainer with an embedded (or injected) rollout engine.

    Args:
      config: the run's :class:`TrainConfig`.
      loss_config: :class:`fp8rl_jax.objectives.LossConfig` (policy loss + rollout correction); default is
        the gin-configured one (PPO clip 0.2, token-mean, token TIS C=2).
      engine: a :class:`RolloutEngine` to use instead of the embedded JAX engine (e.g. vLLM).
      dataset: a prompt dataset (default: ``chain_sum_dataset(task=config.task, seed=config.seed)``).

    Raises:
      FileNotFoundError / ValueError: bad model source, unknown reward, bad config values.
    """

    def __init__(self, config: TrainConfig, loss_config: Any = None, engine: RolloutEngine | None = None,
                 dataset: Any = None):
        self.cfg = config
        self.loss_config = loss_config if loss_config is not None else objectives.LossConfig()
        self.reward_fn = get_reward_fn(config.reward)
        model_cfg, params = load_checkpoint(config.model)
        self.model_config = model_cfg
        self.tokenizer = load_tokenizer_for(config.model)
        self.model = build_model(model_cfg, params, param_dtype=config.train_dtype, dtype=config.train_dtype)
        del params
        self.optimizer = nnx.Optimizer(self.model, make_optimizer(config), wrt=nnx.Param)
        self.dataset = dataset if dataset is not None else chain_sum_dataset(task=config.task, seed=config.seed)
        self.batches = self.dataset.iterate_batches(config.prompts_per_step, seed=config.seed)
        self.pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)
        self.eos_ids = tuple(self.tokenizer.eos_token_ids) or model_cfg.eos_token_ids
        self.export_format = ENGINE_PRECISIONS[config.rollout_precision][2]
        self.step_count = 0
        t0 = time.perf_counter()
        if engine is None:
            engine = JaxRolloutEngine(model_cfg, self.export(), precision=config.rollout_precision,
                                      pad_token_id=self.pad_id, eos_token_ids=self.eos_ids, seed=config.seed,
                                      prompt_bucket=8)
        else:
            engine.update_weights(self.export())
        self.engine = engine
        self.init_sync_s = time.perf_counter() - t0
        self._train_step = self._build_train_step()
        self._logprobs = nnx.jit(response_logprobs)

    # -- pieces -------------------------------------------------------------------------------------------
    def export(self):
        """The current params as :class:`ExportedWeights` in the engine's format (version = step count)."""
        return export_weights(named_params(self.model), self.export_format, version=self.step_count)

    def encode_prompts(self, items) -> list[list[int]]:
        """Chat-template and tokenize prompt items (generation prompt appended)."""
        return [self.tokenizer.encode(self.tokenizer.apply_chat_template(it.messages, add_generation_prompt=True))
                for it in items]

    def _build_train_step(self):
        loss_config, temperature = self.loss_config, self.cfg.temperature

        def train_step(model, optimizer, batch, on_policy: bool):
            # on_policy: one update per step, so the policy at the update IS the old policy and
            # old_logprobs = stop_gradient(logprobs) exactly; this saves the separate recompute forward.
            def loss_fn(model):
                lp = response_logprobs(model, batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"],
                                       temperature)
                old = jax.lax.stop_gradient(lp) if on_policy else batch["old_logprobs"]
                loss, metrics = objectives.compute_policy_loss(lp, old, batch["rollout_logprobs"],
                                                               batch["advantages"], batch["response_mask"],
                                                               loss_config)
                return loss, (metrics, old)

            (loss, (metrics, old)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
            optimizer.update(model, grads)
            metrics = dict(metrics)
            metrics["actor/loss"] = loss
            metrics["actor/grad_norm"] = optax.global_norm(grads)
            return metrics, old

        return nnx.jit(train_step, static_argnames="on_policy")

    # -- one RL step ----------------------------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        """Run one RL step and return its metrics (floats, verl-style names)."""
        cfg = self.cfg
        t_step = time.perf_counter()
        items = next(self.batches)
        prompts = self.encode_prompts(items)
        sp = SamplingParams(n=cfg.samples_per_prompt, temperature=cfg.temperature, top_p=cfg.top_p,
                            top_k=cfg.top_k, max_tokens=cfg.max_tokens, seed=cfg.seed * 1_000_003 + self.step_count)
        t0 = time.perf_counter()
        rb = self.engine.generate(prompts, sp)
        t_rollout = time.perf_counter() - t0

        t0 = time.perf_counter()
        texts = [self.tokenizer.decode([int(t) for t, m in zip(row, mrow) if m > 0])
                 for row, mrow in zip(rb.response_token_ids, rb.response_mask)]
        rewards = np.array([self.reward_fn(txt, items[int(i)]) for txt, i in zip(texts, rb.prompt_index)], np.float32)
        advantages = _ADVANTAGES[cfg.advantage_estimator](jnp.asarray(rewards), cfg.samples_per_prompt)
        t_reward = time.perf_counter() - t0

        t0 = time.perf_counter()
        pid, pmask = left_pad(rb.prompt_token_ids, self.pad_id, bucket=8)
        batch = {"prompt_ids": jnp.asarray(pid), "prompt_mask": jnp.asarray(pmask),
                 "response_ids": jnp.asarray(rb.response_token_ids), "response_mask": jnp.asarray(rb.response_mask),
                 "rollout_logprobs": jnp.asarray(rb.rollout_logprobs), "advantages": advantages}
        on_policy = cfg.ppo_epochs == 1 and cfg.num_minibatches == 1
        if not on_policy:  # several updates per step: old_logprobs must be fixed before the first one
            batch["old_logprobs"] = self._logprobs(self.model, batch["prompt_ids"], batch["prompt_mask"],
                                                   batch["response_ids"], cfg.temperature)
        t_old = time.perf_counter() - t0

        t0 = time.perf_counter()
        n_rows = len(rewards)
        mb = n_rows // cfg.num_minibatches
        rng = np.random.default_rng([cfg.seed, self.step_count])
        train_metrics: list[dict] = []
        for _ in range(cfg.ppo_epochs):
            order = rng.permutation(n_rows) if cfg.num_minibatches > 1 else np.arange(n_rows)
            for k in range(cfg.num_minibatches):
                idx = order[k * mb:(k + 1) * mb]
                sub = {key: v[idx] for key, v in batch.items()}
                m, old = self._train_step(self.model, self.optimizer, sub, on_policy)
                if on_policy:
                    batch["old_logprobs"] = old
                train_metrics.append(m)
        train_metrics = [{k: float(v) for k, v in m.items()} for m in train_metrics]
        t_train = time.perf_counter() - t0
        corr = objectives.rollout_corr_metrics(batch["old_logprobs"], batch["rollout_logprobs"], batch["response_mask"])

        self.step_count += 1
        t0 = time.perf_counter()
        self.engine.update_weights(self.export())
        jax.block_until_ready(jax.tree.leaves(getattr(self.engine, "state", None) or [0]))
        t_sync = time.perf_counter() - t0

        lengths = rb.response_mask.sum(-1)
        out: dict[str, float] = {
            "step": self.step_count,
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()),
            "response_length/mean": float(lengths.mean()),
            "response_length/clip_ratio": float(np.mean([r == "length" for r in rb.finish_reason])),
        }
        out.update({k: float(v) for k, v in corr.items()})
        for key in train_metrics[0]:
            out[key] = float(np.mean([m[key] for m in train_metrics]))
        out.update({"timing/rollout_s": t_rollout, "timing/reward_s": t_reward, "timing/old_logprobs_s": t_old,
                    "timing/train_s": t_train, "timing/sync_s": t_sync,
                    "timing/step_s": time.perf_counter() - t_step})
        self.last_texts = texts
        return out


def train(config: TrainConfig | None = None, **overrides) -> list[dict[str, float]]:
    """Run a whole training job; write ``metrics.jsonl`` (one line per step) and ``summary.json``.

    Args:
      config: the run config (default: ``TrainConfig()`` as bound by gin).
      overrides: field overrides applied on top (e.g. ``output_dir=...``).

    Returns:
      the list of per-step metric dicts.
    """
    import dataclasses

    cfg = config or TrainConfig()
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    os.makedirs(cfg.output_dir, exist_ok=True)
    try:
        import gin

        with open(os.path.join(cfg.output_dir, "config.gin"), "w") as f:
            f.write(gin.config_str())
    except Exception:  # gin not parsed (notebook use): nothing to record
        pass
    t0 = time.perf_counter()
    trainer = RLTrainer(cfg)
    setup_s = time.perf_counter() - t0
    history: list[dict[str, float]] = []
    metrics_path = os.path.join(cfg.output_dir, "metrics.jsonl")
    bar = None
    if cfg.progress_bar:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.num_steps, desc=f"GRPO ({cfg.rollout_precision} rollout)", unit="step")
    with open(metrics_path, "w") as f:
        for _ in range(cfg.num_steps):
            m = trainer.step()
            history.append(m)
            f.write(json.dumps(m) + "\n")
            f.flush()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{m['reward/mean']:.3f}", k3=f"{m.get('rollout_corr/k3_kl', float('nan')):.2e}",
                                s=f"{m['timing/step_s']:.1f}")
    if bar is not None:
        bar.close()
    rewards = [m["reward/mean"] for m in history]
    k = min(5, max(1, len(rewards) // 2))
    summary = {
        "num_steps": len(history), "rollout_precision": cfg.rollout_precision,
        f"reward/first_{k}_mean": float(np.mean(rewards[:k])), f"reward/last_{k}_mean": float(np.mean(rewards[-k:])),
        "rollout_corr/k3_kl_mean": float(np.mean([m.get("rollout_corr/k3_kl", math.nan) for m in history])),
        "rollout_corr/kl_mean": float(np.mean([m.get("rollout_corr/kl", math.nan) for m in history])),
        "timing/setup_s": setup_s, "timing/total_s": time.perf_counter() - t0,
        "timing/sync_s_mean": float(np.mean([m["timing/sync_s"] for m in history])),
    }
    with open(os.path.join(cfg.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2))
    return history
