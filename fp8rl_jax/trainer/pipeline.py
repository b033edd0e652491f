"""Rollout producer and trainer consumer under bounded staleness (``train.max_staleness``).

The RL step is split in two (:class:`fp8rl_jax.trainer.loop.RLTrainer`): a *producer* makes the rollout batch of
step ``s`` (generate, score, every token tagged with the weights version that sampled it) and a *consumer* (the
trainer) trains step ``s`` on it, exports version ``s + 1`` and publishes it. With ``max_staleness = 0`` the trainer
calls the producer itself, in its own thread, right before training: the synchronous loop. With ``k > 0`` a
:class:`RolloutPipeline` runs the producer in a background thread and keeps it at most ``k`` versions ahead:

- batch ``s`` starts only once version ``s - k`` is published, so when step ``s`` trains it (trainer at version
  ``s``) no token is older than ``k`` versions (staleness = trainer version - the token's version);
- ``schedule="fixed"``: batch ``s`` is sampled by exactly version ``max(0, s - k)`` (verl's one-step-off-policy for
  ``k = 1``): a run is deterministic whatever the timings, and resumes bit for bit;
- ``schedule="latest"`` (AReaL / slime style fully asynchronous): the newest published version, applied between
  generate calls (in-flight update); with ``partial_rollout`` also between chunks of one batch, so a sequence cut by
  an update continues under the new weights and its tokens carry both versions. Timing-dependent.

Weights move only between requests: the trainer hands a published version to the pipeline (no wait), and the
producer applies it (``apply``: ``engine.update_weights`` + the content probe) before its next request. A failed
apply stops the producer with the error; the engine stays on its last complete version.

Design after AReaL's ``max_head_offpolicyness`` (arXiv 2505.24298), verl's ``fully_async`` / one-step-off-policy
recipes and slime's partial rollouts; the names are this project's.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable

import numpy as np

SCHEDULES = ("fixed", "latest")


class RolloutVersionError(RuntimeError):
    """A rollout batch whose weights version the trainer cannot name, or that is not the version it applied."""


@dataclasses.dataclass
class RolloutJob:
    """One step's rollout, scored, ready to train.

    Attributes:
      step: the RL step that trains on it.
      scored: :class:`fp8rl_jax.trainer.dapo.ScoredBatch` (rows ``N``, response columns ``T``).
      dapo_metrics: DAPO dynamic-sampling metrics of the batch (``{}`` without ``filter_groups``).
      token_versions: int32 ``[N, T]``, the weights version that sampled each response token; -1 where
        ``response_mask`` is 0.
      rollout_s, reward_s: seconds spent generating and scoring.
      wait_s: seconds the producer waited for a weights version while making this batch.
      sync_s, verify_s: seconds the producer spent applying weights (and checking them) for this batch.
      gen_batches: generate calls (DAPO dynamic sampling may need several).
      extra_metrics: producer-side metrics to log with the step (e.g. optimizer offload times).
      probe_abs_diff: the content probe of the last version the producer applied (NaN: none checked).
      data_state_after: the prompt iterator's ``state_dict()`` after this batch's prompts were drawn.
    """

    step: int
    scored: Any
    dapo_metrics: dict
    token_versions: np.ndarray
    rollout_s: float = 0.0
    reward_s: float = 0.0
    wait_s: float = 0.0
    sync_s: float = 0.0
    verify_s: float = 0.0
    gen_batches: int = 1
    extra_metrics: dict = dataclasses.field(default_factory=dict)
    probe_abs_diff: float = float("nan")
    data_state_after: dict | None = None

    def __repr__(self) -> str:
        tv = self.token_versions[self.token_versions >= 0]
        versions = f"{int(tv.min())}..{int(tv.max())}" if tv.size else "none"
        rewards = np.asarray(self.scored.rewards, np.float64)
        return (f"RolloutJob(step {self.step}, {rewards.size} rows, reward mean {rewards.mean():.3f}, token versions "
                f"{versions}, rollout {self.rollout_s:.2f} s, reward {self.reward_s:.2f} s)")

    @property
    def min_version(self) -> int:
        """The oldest version among the batch's tokens (the batch's version when none were generated)."""
        v = self.token_versions[self.token_versions >= 0]
        return int(v.min()) if v.size else int(self.token_versions.max(initial=-1))


class _TrainerGone(Exception):
    """The trainer that owned the pipeline was garbage-collected: the producer stops."""


def _weak(fn):
    """A weak reference to a bound method (a plain function is held strongly): ``ref() -> fn | None``."""
    import weakref

    if hasattr(fn, "__self__") and hasattr(fn, "__func__"):
        return weakref.WeakMethod(fn)
    return lambda: fn


def check_staleness(max_staleness: int, schedule: str, partial_rollout: bool) -> None:
    """Validate the asynchronous-RL settings.

    Raises:
      ValueError: a negative ``max_staleness``, an unknown ``schedule``, or ``partial_rollout`` without the
        ``"latest"`` schedule (a fixed schedule applies no update inside a batch).
    """
    if not isinstance(max_staleness, int) or isinstance(max_staleness, bool) or max_staleness < 0:
        raise ValueError(f"train.max_staleness must be an int >= 0 (0 = synchronous), got {max_staleness!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"train.async_schedule={schedule!r} is not one of {list(SCHEDULES)}")
    if partial_rollout and (max_staleness == 0 or schedule != "latest"):
        raise ValueError("train.partial_rollout=True needs train.max_staleness > 0 and train.async_schedule='latest' "
                         "(updates land inside a batch only under the latest-version schedule)")


def scheduled_version(step: int, max_staleness: int) -> int:
    """The version that samples batch ``step`` under ``schedule="fixed"``: ``max(0, step - max_staleness)``."""
    return max(0, int(step) - int(max_staleness))


def staleness_metrics(token_versions: np.ndarray, trainer_version: int, max_staleness: int) -> dict[str, float]:
    """Per-step staleness metrics over the response tokens (``token_versions >= 0``).

    Args:
      token_versions: int32 ``[N, T]`` (-1 = no token).
      trainer_version: the trainer's version when it trains the batch (the step index).
      max_staleness: the bound; the histogram has one bin per lag ``0..max_staleness``.

    Returns:
      ``async/staleness_mean``, ``async/staleness_max`` (versions) and ``async/staleness_hist/lag{j}`` (fraction of
      tokens with lag ``j``); ``async/partial_rows`` (fraction of rows whose tokens come from more than one version).
    """
    tv = np.asarray(token_versions)
    live = tv >= 0
    lag = np.where(live, trainer_version - tv, 0)
    n = max(int(live.sum()), 1)
    out = {"async/staleness_mean": float(lag[live].mean()) if live.any() else 0.0,
           "async/staleness_max": float(lag[live].max()) if live.any() else 0.0}
    for j in range(max_staleness + 1):
        out[f"async/staleness_hist/lag{j}"] = float(((lag == j) & live).sum() / n)
    lo = np.where(live, tv, np.iinfo(np.int32).max).min(-1)
    hi = np.where(live, tv, -1).max(-1)
    out["async/partial_rows"] = float(np.mean((hi > lo) & live.any(-1)))
    return out


class RolloutPipeline:
    """The background producer of rollout batches, at most ``max_staleness`` versions ahead of the trainer.

    Args:
      produce: ``produce(step, hooks) -> RolloutJob``; makes batch ``step`` with the engine as it stands.
        ``hooks`` is this pipeline: the producer calls :meth:`current_version` to tag tokens and, with partial
        rollouts, :meth:`between_chunks` between chunks of one batch.
      apply: ``apply(version, payload) -> (sync_s, verify_s)``: install a published version in the engine (and
        check it); raises on failure.
      max_staleness: ``k >= 1``.
      schedule: ``"fixed"`` or ``"latest"`` (module docstring).
      start_step: the first batch to produce (the trainer's step count).
      engine_version: the version the engine holds now.
      end_step: produce batches ``< end_step`` only (the run's ``num_steps``).
      carried: finished jobs restored from a checkpoint (``{step: RolloutJob}``), used instead of producing.
      data_state: the prompt iterator's state where the first batch to produce draws (for checkpoints).
      published: versions already published (``{version: payload}``), e.g. to an earlier pipeline of this trainer.
      floor_version: no batch is sampled by an older version (a continuation whose scheduled versions are gone
        samples those batches from this one instead: less stale than scheduled, never more).

    Raises:
      ValueError: bad ``max_staleness`` / ``schedule``.
    """

    def __init__(self, produce: Callable[[int, "RolloutPipeline"], RolloutJob],
                 apply: Callable[[int, Any], tuple[float, float]], *, max_staleness: int, schedule: str = "fixed",
                 start_step: int = 0, end_step: int, engine_version: int = 0,
                 carried: dict[int, RolloutJob] | None = None, data_state: dict | None = None,
                 published: dict[int, Any] | None = None, floor_version: int = 0):
        check_staleness(max_staleness, schedule, False)
        if max_staleness < 1:
            raise ValueError("RolloutPipeline runs max_staleness >= 1; 0 is the trainer's synchronous path")
        # weak references to the trainer's methods: a trainer dropped in a notebook is freed, and its producer stops
        self._produce_ref, self._apply_ref = _weak(produce), _weak(apply)
        self.k, self.schedule, self.floor_version = int(max_staleness), schedule, int(floor_version)
        self.published: dict[int, Any] = dict(published or {})
        self.latest = max([int(engine_version), *self.published])  # newest published version
        self.engine_version = int(engine_version)
        self.jobs: dict[int, RolloutJob] = dict(carried or {})
        self.next_step, self.end_step = int(start_step), int(end_step)
        while self.next_step in self.jobs:
            self.next_step += 1
        self.data_state_at: dict[int, dict | None] = {self.next_step: data_state}
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._stop = False
        self._job_wait = self._job_sync = self._job_verify = 0.0
        self.trainer_wait_s = 0.0
        self._thread = threading.Thread(target=self._run, name="fp8rl-rollout-producer", daemon=True)
        self._thread.start()

    # -- trainer side ------------------------------------------------------------------------------------------
    def publish(self, version: int, payload: Any) -> None:
        """Hand version ``version`` (the trainer's export + probe reference) to the producer; returns at once."""
        with self._cond:
            self.published[int(version)] = payload
            self.latest = max(self.latest, int(version))
            self._cond.notify_all()

    def get(self, step: int, timeout: float | None = None) -> RolloutJob:
        """Wait for batch ``step``; the wait is added to :attr:`trainer_wait_s`.

        Raises:
          the producer's exception (engine failure, failed weight apply, version error), re-raised as is.
          TimeoutError: nothing arrived within ``timeout`` seconds.
        """
        t0 = time.perf_counter()
        with self._cond:
            while step not in self.jobs and self._error is None:
                if not self._thread.is_alive():
                    raise RuntimeError(f"the rollout producer stopped before batch {step}: it makes batches up to "
                                       f"train.num_steps={self.end_step} (raise num_steps to train longer)")
                if not self._cond.wait(timeout=timeout if timeout is not None else 1.0) and timeout is not None:
                    raise TimeoutError(f"no rollout batch for step {step} after {timeout} s")
            if step in self.jobs:
                job = self.jobs.pop(step)
            else:
                raise self._error
        self.trainer_wait_s += time.perf_counter() - t0
        return job

    def jobs_to_checkpoint(self, version: int) -> dict[int, RolloutJob]:
        """The batches a checkpoint of version ``version`` (trainer step count ``t``) must carry to resume exactly.

        Under ``schedule="fixed"`` batches ``t .. t+k-1`` are sampled by versions older than ``t``, whose weights
        the checkpoint does not hold: they are waited for and returned; batch ``t+k`` and later (version ``t``
        and newer) are regenerated on resume. Under ``"latest"`` nothing is carried: a resume regenerates every
        in-flight batch from the checkpoint's version (the run goes on validly but not bit for bit).

        Raises:
          the producer's exception, if it failed.
        """
        if self.schedule != "fixed":
            return {}
        last = min(int(version) + self.k, self.end_step)  # produce up to (not including) this step first
        with self._cond:
            while self._error is None and self.next_step < last:
                self._cond.wait(timeout=1.0)
            if self._error is not None:
                raise self._error
            return {s: j for s, j in self.jobs.items() if s < last}

    def close(self, timeout: float = 60.0) -> None:
        """Stop the producer after its current request and wait for it (daemon thread: never blocks exit)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout)

    # -- producer side -----------------------------------------------------------------------------------------
    @staticmethod
    def _call(ref):
        fn = ref()
        if fn is None:
            raise _TrainerGone
        return fn

    def current_version(self) -> int:
        """The version the engine serves now (the producer's view)."""
        return self.engine_version

    def between_chunks(self) -> int:
        """Apply the newest published version when there is one (partial rollouts); returns the engine's version."""
        if self.schedule == "latest":
            with self._cond:
                target = self.latest
            if target > self.engine_version:
                self._install(target)
        return self.engine_version

    def _install(self, version: int) -> None:
        with self._cond:
            payload = self.published[version]
        sync_s, verify_s = self._call(self._apply_ref)(version, payload)
        self._job_sync += sync_s
        self._job_verify += verify_s
        with self._cond:
            self.engine_version = version
            drop = [v for v in self.published if v <= version] if self.schedule == "latest" else [version]
            for v in drop:  # never needed again (fixed: installed in order, older ones may still be owed)
                del self.published[v]

    def _run(self) -> None:
        try:
            while True:
                s = self.next_step
                need = max(scheduled_version(s, self.k), self.floor_version)
                t0 = time.perf_counter()
                with self._cond:
                    while not self._stop and s < self.end_step and self.latest < need:
                        self._cond.wait()
                    if self._stop or s >= self.end_step:
                        return
                    target = need if self.schedule == "fixed" else self.latest
                self._job_wait, self._job_sync, self._job_verify = time.perf_counter() - t0, 0.0, 0.0
                if target != self.engine_version:
                    if target not in self.published:
                        raise RolloutVersionError(
                            f"batch {s} is scheduled for weights version {target} but the engine holds version "
                            f"{self.engine_version} and {target} was never published (a resume without the "
                            "checkpoint's in-flight batches?)")
                    self._install(target)
                job = self._call(self._produce_ref)(s, self)
                job.wait_s += self._job_wait
                job.sync_s += self._job_sync
                job.verify_s += self._job_verify
                with self._cond:
                    self.jobs[s] = job
                    self.data_state_at[s + 1] = job.data_state_after
                    self.data_state_at.pop(s - 2 * self.k - 2, None)
                    self.next_step = s + 1
                    self._cond.notify_all()
        except _TrainerGone:
            return
        except BaseException as e:  # noqa: BLE001 - handed to the trainer's get()
            with self._cond:
                self._error = e
                self._cond.notify_all()


def jobs_to_json(jobs: dict[int, RolloutJob]) -> dict:
    """JSON-serializable form of finished batches for a checkpoint's meta (arrays as base64 ``.npz``, exact).

    Prompt items are not kept (rewards and texts are); the routing records of R3 are.
    """
    import base64
    import io

    out = {}
    for s, j in jobs.items():
        rb = j.scored.rollout
        arrays = {"response_token_ids": rb.response_token_ids, "rollout_logprobs": rb.rollout_logprobs,
                  "response_mask": rb.response_mask, "prompt_index": rb.prompt_index,
                  "token_versions": j.token_versions, "scores": j.scored.scores, "rewards": j.scored.rewards}
        if rb.routed_experts is not None:
            arrays["routed_experts"] = np.asarray(rb.routed_experts)
        for i, r in enumerate(rb.prompt_routed_experts or []):
            arrays[f"prompt_routed_experts_{i}"] = np.asarray(r)
        buf = io.BytesIO()
        np.savez(buf, **{k: np.asarray(v) for k, v in arrays.items()})
        out[str(s)] = {"npz": base64.b64encode(buf.getvalue()).decode("ascii"),
                       "prompt_token_ids": [[int(t) for t in p] for p in rb.prompt_token_ids],
                       "finish_reason": list(rb.finish_reason), "weights_version": int(rb.weights_version),
                       "texts": list(j.scored.texts), "dapo_metrics": {k: float(v) for k, v in j.dapo_metrics.items()},
                       "prompt_routed": rb.prompt_routed_experts is not None,
                       "rollout_s": j.rollout_s, "reward_s": j.reward_s, "gen_batches": j.gen_batches,
                       "wait_s": j.wait_s, "sync_s": j.sync_s, "verify_s": j.verify_s,
                       "probe_abs_diff": None if np.isnan(j.probe_abs_diff) else float(j.probe_abs_diff),
                       "extra_metrics": {k: float(v) for k, v in j.extra_metrics.items()},
                       "items": len(j.scored.items)}
    return out


def jobs_from_json(data: dict | None) -> dict[int, RolloutJob]:
    """Inverse of :func:`jobs_to_json` (``{}`` for None). Prompt items come back as None placeholders."""
    import base64
    import io

    from fp8rl_jax.rollout.types import RolloutBatch
    from fp8rl_jax.trainer.dapo import ScoredBatch

    jobs = {}
    for key, d in (data or {}).items():
        with np.load(io.BytesIO(base64.b64decode(d["npz"]))) as z:
            a = {k: z[k] for k in z.files}
        n = len(d["prompt_token_ids"])
        prompt_routed = [a[f"prompt_routed_experts_{i}"] for i in range(n)] if d["prompt_routed"] else None
        rb = RolloutBatch(d["prompt_token_ids"], a["response_token_ids"], a["rollout_logprobs"], a["response_mask"],
                          list(d["finish_reason"]), a["prompt_index"], weights_version=int(d["weights_version"]),
                          routed_experts=a.get("routed_experts"), prompt_routed_experts=prompt_routed,
                          token_versions=a["token_versions"])
        sb = ScoredBatch(rb, [None] * int(d["items"]), list(d["texts"]), a["scores"], a["rewards"])
        jobs[int(key)] = RolloutJob(int(key), sb, dict(d["dapo_metrics"]), a["token_versions"],
                                    rollout_s=float(d["rollout_s"]), reward_s=float(d["reward_s"]),
                                    gen_batches=int(d["gen_batches"]), wait_s=float(d["wait_s"]),
                                    sync_s=float(d["sync_s"]), verify_s=float(d["verify_s"]),
                                    probe_abs_diff=(float("nan") if d["probe_abs_diff"] is None
                                                    else float(d["probe_abs_diff"])),
                                    extra_metrics=dict(d["extra_metrics"]))
    return jobs
