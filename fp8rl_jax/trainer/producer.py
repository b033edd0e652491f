"""The producer side of the RL step: :class:`RolloutProducerMixin`, the rollout half of
:class:`~fp8rl_jax.trainer.loop.RLTrainer`.

It makes a step's rollout batch (generate, score, tag every response token with the weights version that sampled
it, :meth:`~RolloutProducerMixin.produce_rollout`), runs it now (``train.max_staleness = 0``) or in the background
producer of :mod:`fp8rl_jax.trainer.pipeline` (asynchronous RL: :meth:`~RolloutProducerMixin.next_rollout`,
published versions installed and content-checked between requests), and keeps the batches and versions of a
stopped producer for the next one. The consumer side (update, export, sync, metrics) stays in
:mod:`fp8rl_jax.trainer.loop`; the staleness checks and async metrics of a trained batch are
:mod:`fp8rl_jax.trainer.staleness`. Design: docs/ASYNC.md.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.rollout.engine import JaxRolloutEngine
from fp8rl_jax.rollout.types import RolloutBatch, SamplingParams
from fp8rl_jax.trainer import dapo
from fp8rl_jax.trainer.distributed import gather_rollout, process_prompt_slice
from fp8rl_jax.trainer.interrupts import deferred_sigint
from fp8rl_jax.trainer.offload import HOST as OFFLOAD_MEMORY, move_optimizer_state
from fp8rl_jax.trainer.pipeline import RolloutJob, RolloutPipeline, RolloutVersionError, scheduled_version


def sync_options(engine) -> dict:
    """:meth:`RLTrainer.export <fp8rl_jax.trainer.loop.RLTrainer.export>` options for a sync into ``engine``.

    The embedded :class:`~fp8rl_jax.rollout.engine.JaxRolloutEngine` gets its own layout (fused ``qkv_proj`` /
    ``gate_up_proj`` where it runs them, Qwen3-MoE expert stacks ``[E, N, K]`` as stacks: installed without a copy);
    any other engine, vLLM included, the HF checkpoint names (``fuse=False``, ``expert_stacks=False``).

    Returns:
      ``{"fuse": bool, "expert_stacks": bool}`` (keyword arguments of ``export``).
    """
    return {"fuse": bool(getattr(engine, "fused_projections", ())),
            "expert_stacks": isinstance(engine, JaxRolloutEngine)}


class RolloutProducerMixin:
    """The rollout producer's methods of :class:`~fp8rl_jax.trainer.loop.RLTrainer` (not used on its own).

    Uses the trainer's ``cfg``, ``engine``, ``batches``, ``tokenizer``, ``reward_fn``, ``optimizer``, ``pad_id``,
    ``step_count``, ``export`` / ``_probe_reference`` / ``_check_engine_probe`` / ``_keep_version_params`` /
    ``encode_prompts`` / ``_phase``, and the asynchronous state set up in ``RLTrainer.__init__``: ``_pipeline``,
    ``_engine_lock`` (an RLock held while the engine generates or installs), ``_carried_jobs``, ``_closed``,
    ``_unapplied``, ``_engine_version`` (-1 while an install is unchecked), ``_async_probe_diff``, ``_wait_seen``.
    """

    def _generate_rollout(self, prompts: list, sp: SamplingParams):
        """The step's rollout. With several JAX processes and the embedded engine, each process generates its own
        contiguous slice of the prompts (sampling noise is keyed by the global row, ``row_offset``) and the slices
        are all-gathered (:func:`~fp8rl_jax.trainer.distributed.gather_rollout`), so the rollout work is split
        across hosts and every process trains on the same whole batch."""
        share = process_prompt_slice(len(prompts)) if isinstance(self.engine, JaxRolloutEngine) else None
        if share is None:
            if jax.process_count() > 1 and not getattr(self, "_warned_unsplit", False):
                self._warned_unsplit = True
                warnings.warn(f"{len(prompts)} prompts per generate call do not split evenly over "
                              f"{jax.process_count()} processes (or the engine is not the embedded one): every "
                              "process generates the whole batch (set train.prompts_per_step to a multiple of the "
                              "process count to split the rollout)", RuntimeWarning, stacklevel=3)
            return self.engine.generate(prompts, sp)
        lo, hi = share
        return gather_rollout(self.engine.generate(prompts[lo:hi], sp, row_offset=lo * sp.n), prompts, lo)

    def next_rollout(self) -> RolloutJob:
        """The rollout batch of step :attr:`step_count`: made now (``max_staleness = 0``) or the producer's.

        A batch handed back by an interrupted :meth:`train_on` (Ctrl-C before its update) is used again.

        Raises:
          the producer's error (see :meth:`step`).
        """
        if self.cfg.max_staleness == 0:
            if self.step_count in self._carried_jobs:
                return self._carried_jobs.pop(self.step_count)
            self._phase("rollout")
            return self.produce_rollout(self.step_count)
        if self._pipeline is None:
            self._start_pipeline()
        self._phase("waiting for the rollout producer")
        try:
            return self._pipeline.get(self.step_count)
        except BaseException:  # the producer failed (or Ctrl-C): stop it; a later step starts a fresh one
            self.close_pipeline(timeout=2.0)
            raise

    def _return_job(self, job: RolloutJob) -> None:
        """Give back a batch whose step did not run (interrupted before its update): the next step takes it."""
        if self._pipeline is not None:
            with self._pipeline._cond:
                self._pipeline.jobs[job.step] = job
        else:
            self._carried_jobs[job.step] = job

    def _start_pipeline(self) -> None:
        """Start the background producer at the current step (after a restore: with the carried batches).

        Under ``"fixed"``, a batch whose scheduled version is no longer held (a run continued past its final
        checkpoint, whose producer had stopped) is sampled by the trainer's current version instead: less stale than
        scheduled, never more; said once.
        """
        self._reap_closed()
        cfg, t = self.cfg, self.step_count
        carried, self._carried_jobs = self._carried_jobs, {}
        floor = 0
        if cfg.async_schedule == "fixed":  # each batch not carried must be sampled by a version that still exists
            need = [s for s in range(t, min(t + cfg.max_staleness, cfg.num_steps)) if s not in carried]
            have = {self._engine_version, t, *self._unapplied}
            lost = [s for s in need if scheduled_version(s, cfg.max_staleness) not in have]
            if lost:
                floor = t
                print(f"note: continuing the asynchronous run at step {t}: batches {lost} were scheduled for weights "
                      f"versions {[scheduled_version(s, cfg.max_staleness) for s in lost]}, which are no longer held "
                      f"(the run had finished, or a checkpoint of other settings); they are sampled by version {t} "
                      "(staleness below the bound; not the batches an uninterrupted run would have made)", flush=True)
        if cfg.mismatch_split:
            self._keep_version_params(t)
        state = self.batches.state_dict() if hasattr(self.batches, "state_dict") else None
        self._wait_seen = 0.0
        # versions published to an earlier (closed) producer and not installed yet go to this one
        published, self._unapplied = dict(self._unapplied), {}
        if self._engine_version != t and t not in published:
            published[t] = (self._async_export(), self._probe_reference() if cfg.verify_sync == "every_step" else None)
        pipeline = RolloutPipeline(self._produce_async, self._apply_published, max_staleness=cfg.max_staleness,
                                   schedule=cfg.async_schedule, start_step=t, end_step=cfg.num_steps,
                                   engine_version=self._engine_version, carried=carried, data_state=state,
                                   published=published, floor_version=floor)
        weakref.finalize(self, pipeline.close, 0)  # a trainer dropped in a notebook stops its producer
        self._pipeline = pipeline

    def _async_export(self, weights=None):
        """:meth:`export` (or ``weights``) made safe to hold while the next update runs: a float32 export may alias
        the params the update donates, so it is copied; ready on return."""
        weights = self.export(**sync_options(self.engine)) if weights is None else weights
        if weights.format == "float32":
            weights.tensors = {k: jnp.copy(v) for k, v in weights.tensors.items()}
        jax.block_until_ready(list(weights.tensors.values()))
        return weights

    def close_pipeline(self, install_latest: bool = False, timeout: float = 600.0) -> None:
        """Stop the background producer, if one runs (after its current request); idempotent. Its finished batches
        and the versions it had not installed are kept for a later :meth:`step` (``train()`` called again on this
        trainer continues exactly).

        Args:
          install_latest: then sync the trainer's current version into the engine (and content-check it), so that
            the engine serves the final policy (``train()`` does this after the last step, before the last eval).
          timeout: seconds to wait for the producer's current request (``train()`` waits 2 s after an error or
            Ctrl-C; the daemon thread never blocks the process's exit). A producer still busy after it is waited for
            in full, and its batch kept, before anything else uses the engine or the prompts (next step, restore,
            checkpoint).
        """
        if self._pipeline is not None:
            self._pipeline.close(timeout)
            self._closed.append(self._pipeline)
            self._pipeline = None
        if not any(p._thread.is_alive() for p in self._closed):
            self._reap_closed()
        if install_latest and self.cfg.max_staleness > 0 and self._engine_version != self.step_count:
            self._reap_closed()
            payload = self._unapplied.get(self.step_count)
            if payload is None:
                payload = (self._async_export(), self._probe_reference() if self.cfg.verify_sync == "every_step"
                           else None)
                self._unapplied[self.step_count] = payload
            with deferred_sigint():  # never a half-installed engine labelled with a version
                self._apply_published(self.step_count, payload)
            self.last_probe_diff = self._async_probe_diff

    def _reap_closed(self) -> None:
        """Wait for stopped producers to finish their last request, then keep their batches and uninstalled versions."""
        while self._closed:
            p = self._closed.pop(0)
            p.close(timeout=None)
            self._carried_jobs.update(p.jobs)
            self._unapplied = {**self._unapplied, **p.published}  # published, never installed

    def _produce_async(self, step: int, hooks: RolloutPipeline) -> RolloutJob:
        return self.produce_rollout(step, hooks)

    def _apply_published(self, version: int, payload) -> tuple[float, float]:
        """Producer side of an asynchronous sync: install ``version`` in the engine and content-check it.

        The engine's version is unknown (-1) from the start of the install until its check passes, so a failed or
        interrupted install is never taken for a version. Returns ``(sync_s, verify_s)``. Raises StaleWeightsError
        (a failed probe) or the engine's error; the producer then stops, and a later one installs again.
        """
        weights, probe = payload
        with self._engine_lock:
            self._engine_version = -1
            t0 = time.perf_counter()
            self.engine.update_weights(weights)
            jax.block_until_ready(jax.tree.leaves(getattr(self.engine, "state", None) or [0]))
            sync_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            self._async_probe_diff = math.nan if probe is None else self._check_engine_probe(probe, int(version))
            self._engine_version = int(version)
            return sync_s, time.perf_counter() - t0

    def produce_rollout(self, step: int, hooks: RolloutPipeline | None = None) -> RolloutJob:
        """Make step ``step``'s rollout batch with the engine as it stands: generate, score, tag token versions.

        Args:
          step: the RL step the batch is for (keys the sampling seed, as in a synchronous run).
          hooks: the producer's pipeline (asynchronous mode), None when the trainer makes it itself.

        Returns:
          a :class:`~fp8rl_jax.trainer.pipeline.RolloutJob`; with a user ``train.reward_fn`` its ``extra_metrics`` hold
          ``reward/failures`` and ``reward/timeouts`` (completions of this batch scored 0 for an error / a timeout).

        Raises:
          RolloutVersionError: the engine reports another version than the one applied.
          ValueError: DAPO dynamic sampling found too few groups.
        """
        cfg = self.cfg
        timers = {"rollout": 0.0, "reward": 0.0}
        gen_batches = [0]

        def generate_scored() -> dapo.ScoredBatch:
            items = next(self.batches)
            prompts = self.encode_prompts(items)
            # gen batch k of a step draws its own noise; k = 0 keeps the (seed, step) stream of a plain step
            sp = SamplingParams(n=cfg.samples_per_prompt, temperature=cfg.temperature, top_p=cfg.top_p,
                                top_k=cfg.top_k, max_tokens=cfg.response_budget,
                                seed=cfg.seed * 1_000_003 + step + 104_729 * gen_batches[0])
            gen_batches[0] += 1
            t0 = time.perf_counter()
            with self._engine_lock:  # not while scoring: an evaluation or install may use the engine meanwhile
                rb = self._generate_versioned(prompts, sp, hooks)
            timers["rollout"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            texts = [self.tokenizer.decode([int(t) for t, m in zip(row, mrow) if m > 0])
                     for row, mrow in zip(rb.response_token_ids, rb.response_mask)]
            scores = np.array([self.reward_fn(txt, items[int(i)]) for txt, i in zip(texts, rb.prompt_index)],
                              np.float64)
            rewards = scores
            if cfg.overlong_buffer_len > 0:
                rewards = scores + dapo.overlong_penalty(np.asarray(rb.response_mask).sum(-1), cfg.response_budget,
                                                         cfg.overlong_buffer_len, cfg.overlong_penalty_factor)
            timers["reward"] += time.perf_counter() - t0
            return dapo.ScoredBatch(rb, list(items), texts, scores, rewards)

        offloaded, t_offload = 0, time.perf_counter()
        if cfg.offload_optimizer:  # the optimizer state waits in host memory while the engine generates
            offloaded = move_optimizer_state(self.optimizer, OFFLOAD_MEMORY)
        t_offload = time.perf_counter() - t_offload
        try:
            if cfg.filter_groups:
                sb, dapo_metrics = dapo.dynamic_sampling(generate_scored, cfg.prompts_per_step,
                                                         cfg.samples_per_prompt, cfg.max_num_gen_batches,
                                                         cfg.filter_groups_metric)
            else:
                sb, dapo_metrics = generate_scored(), {}
        finally:
            if cfg.offload_optimizer:
                t0 = time.perf_counter()
                move_optimizer_state(self.optimizer, "device")
                t_offload += time.perf_counter() - t0
        extra = {"timing/offload_s": t_offload, "memory/optimizer_offloaded_gb": offloaded / 2**30} \
            if cfg.offload_optimizer else {}
        take_counts = getattr(self.reward_fn, "take_counts", None)
        if take_counts is not None:  # a user train.reward_fn: completions scored 0 for an error / a timeout
            extra.update(take_counts())
        return RolloutJob(step, sb, dapo_metrics, sb.rollout.token_versions, rollout_s=timers["rollout"],
                          reward_s=timers["reward"], gen_batches=gen_batches[0], extra_metrics=extra,
                          probe_abs_diff=self._async_probe_diff if hooks is not None else math.nan,
                          data_state_after=self.batches.state_dict() if hasattr(self.batches, "state_dict") else None)

    def _check_reported_version(self, rb, version: int) -> None:
        """RolloutVersionError unless an engine that keeps ``weights_version`` reports ``version`` for ``rb``."""
        if hasattr(self.engine, "weights_version") and int(rb.weights_version) != int(version):
            raise RolloutVersionError(
                f"the rollout engine ({type(self.engine).__name__}) reports weights version {rb.weights_version} for a "
                f"batch it generated after the trainer applied version {version}: the trainer cannot name the policy "
                "that sampled it and refuses to train on it (a sync that did not land, or an engine that mislabels)")

    def _generate_versioned(self, prompts: list, sp: SamplingParams, hooks: RolloutPipeline | None):
        """:meth:`_generate_rollout` with ``token_versions`` filled; chunked with ``train.partial_rollout``."""
        version = hooks.current_version() if hooks is not None else self._engine_version
        if hooks is None or not self.cfg.partial_rollout:
            rb = self._generate_rollout(prompts, sp)
            self._check_reported_version(rb, version)
            rb.token_versions = np.where(np.asarray(rb.response_mask) > 0, version, -1).astype(np.int32)
            return rb
        # partial rollout: chunks of partial_rollout_tokens; a newer version is applied between chunks and the
        # unfinished rows continue from prompt + their tokens so far under it (all of them have the same length)
        chunk, budget = self.cfg.partial_rollout_tokens, sp.max_tokens
        first = self._generate_rollout(prompts, dataclasses.replace(sp, max_tokens=min(chunk, budget)))
        self._check_reported_version(first, version)
        n_rows, width = len(first.prompt_token_ids), first.response_token_ids.shape[1]
        ids = np.full((n_rows, budget), self.pad_id, np.int32)
        lp, mask = np.zeros((n_rows, budget), np.float32), np.zeros((n_rows, budget), np.float32)
        ver = np.full((n_rows, budget), -1, np.int32)
        ids[:, :width], lp[:, :width] = first.response_token_ids, first.rollout_logprobs
        mask[:, :width] = first.response_mask
        ver[:, :width] = np.where(np.asarray(first.response_mask) > 0, version, -1)
        finish, done, c, newest = list(first.finish_reason), width, 1, version
        while done < budget:
            live = [r for r in range(n_rows) if finish[r] == "length"]
            if not live:
                break
            version = hooks.between_chunks()
            newest = max(newest, version)
            take = min(chunk, budget - done)
            # always n_rows rows (the live ones, then repeats of the first): one program shape per chunk index,
            # compiled once per run, instead of one per count of rows still running
            padded = live + [live[0]] * (n_rows - len(live))
            cont = [list(first.prompt_token_ids[r]) + [int(t) for t in ids[r, :done]] for r in padded]
            rb = self._generate_rollout(cont, dataclasses.replace(
                sp, n=1, max_tokens=take, seed=None if sp.seed is None else sp.seed + 7_919 * c))
            self._check_reported_version(rb, version)
            rows, k = np.asarray(live), len(live)
            ids[rows, done:done + take] = rb.response_token_ids[:k]
            lp[rows, done:done + take] = rb.rollout_logprobs[:k]
            mask[rows, done:done + take] = rb.response_mask[:k]
            ver[rows, done:done + take] = np.where(np.asarray(rb.response_mask[:k]) > 0, version, -1)
            for j, r in enumerate(live):
                finish[r] = rb.finish_reason[j]
            done, c = done + take, c + 1
        return RolloutBatch(first.prompt_token_ids, ids, lp, mask, finish, first.prompt_index, weights_version=newest,
                            token_versions=ver)
