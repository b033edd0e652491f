"""Asynchronous RL (train.max_staleness, fp8rl_jax.trainer.pipeline): the staleness bound under random timings, the
token versions, exact resume in the middle of an asynchronous run, and an engine that reports the wrong version."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from conftest import make_tiny_run_dir


# -- the pipeline alone (no model): random timings -----------------------------------------------------------------
class _FakeScored:
    def __init__(self, versions):
        self.rollout = None
        self.versions = versions


def _run_fake(k: int, schedule: str, seed: int, steps: int = 12, chunks: int = 1):
    """Drive a RolloutPipeline with a fake producer and consumer sleeping random times; return what was trained."""
    from fp8rl_jax.trainer.pipeline import RolloutJob, RolloutPipeline

    rnd = random.Random(seed)
    applied: list[int] = []

    def apply(version, payload):
        assert payload == f"weights-{version}"  # the producer installs exactly what was published
        time.sleep(rnd.random() * 0.002)
        applied.append(version)
        return 0.0, 0.0

    def produce(step, hooks):
        row = []
        for c in range(chunks):
            if c:
                hooks.between_chunks()
            v = hooks.current_version()
            time.sleep(rnd.random() * 0.003)
            row += [v, v]
        tv = np.array([row], np.int32)
        return RolloutJob(step, _FakeScored(tv), {}, tv)

    pipe = RolloutPipeline(produce, apply, max_staleness=k, schedule=schedule, start_step=0, end_step=steps)
    trained = []
    try:
        for t in range(steps):
            job = pipe.get(t, timeout=30)
            trained.append((t, job.token_versions.copy()))
            time.sleep(rnd.random() * 0.003)  # training
            pipe.publish(t + 1, f"weights-{t + 1}")
    finally:
        pipe.close()
    return trained, applied


@pytest.mark.parametrize("schedule,chunks", [("fixed", 1), ("latest", 1), ("latest", 3)])
def test_staleness_is_never_exceeded_under_random_timings(schedule, chunks):
    """Property over 40 random timing draws per setting: every trained token is 0..k versions old; under the fixed
    schedule batch s is sampled by exactly version max(0, s-k); versions within a row never go backwards; the
    producer installs published versions in increasing order."""
    for seed in range(40):
        k = 1 + seed % 3
        trained, applied = _run_fake(k, schedule, seed, chunks=chunks)
        assert [t for t, _ in trained] == list(range(12))
        for t, tv in trained:
            lag = t - tv
            assert lag.min() >= 0 and lag.max() <= k, (seed, t, tv)
            assert np.all(np.diff(tv, axis=-1) >= 0)
            if schedule == "fixed":
                assert np.all(tv == max(0, t - k))
        assert applied == sorted(applied) and len(set(applied)) == len(applied)


def test_a_producer_failure_reaches_the_trainer():
    from fp8rl_jax.trainer.pipeline import RolloutPipeline

    def produce(step, hooks):
        raise OSError("rollout worker died")

    pipe = RolloutPipeline(produce, lambda v, p: (0.0, 0.0), max_staleness=1, end_step=4)
    with pytest.raises(OSError, match="rollout worker died"):
        pipe.get(0, timeout=30)
    pipe.close()


def test_bad_async_settings_fail_clearly(tmp_path):
    from fp8rl_jax.trainer import TrainConfig

    with pytest.raises(ValueError, match="max_staleness must be an int >= 0"):
        TrainConfig(output_dir=str(tmp_path), max_staleness=-1)
    with pytest.raises(ValueError, match="async_schedule"):
        TrainConfig(output_dir=str(tmp_path), max_staleness=1, async_schedule="newest")
    with pytest.raises(ValueError, match="partial_rollout=True needs"):
        TrainConfig(output_dir=str(tmp_path), max_staleness=1, partial_rollout=True)
    with pytest.raises(ValueError, match="offload_optimizer"):
        TrainConfig(output_dir=str(tmp_path), max_staleness=1, offload_optimizer=True)


# -- the trainer ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_run_dir(tmp_path_factory.mktemp("async_tiny"))


def _cfg(tiny_dir, out, **kw):
    from fp8rl_jax.trainer import TrainConfig

    base = dict(output_dir=str(out), model=tiny_dir, num_steps=4, prompts_per_step=2, samples_per_prompt=2,
                max_tokens=8, rollout_precision="fp8", learning_rate=5e-2, progress_bar=False, checkpoint_every=0,
                plots=False, seed=3)
    base.update(kw)
    return TrainConfig(**base)


def _reward(text, item):
    """A reward with spread on a random tiny model: the fraction of even bytes (advantages are not all zero)."""
    b = text.encode("utf-8", "replace")
    return float(np.mean([c % 2 == 0 for c in b])) if b else 0.0


def _numbers(m):
    return {k: v for k, v in m.items() if not k.startswith(("timing/", "memory/"))}


class _RecordingEngine:
    """Wraps the trainer's embedded engine: records the version it holds at every generate call."""

    def __init__(self, inner, lie_by: int = 0, drop_updates_after: int | None = None):
        self.inner, self.lie_by, self.drop_after = inner, lie_by, drop_updates_after
        self.calls: list[int] = []

        self.claimed = None  # the version a sync that did not land claims

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def weights_version(self):
        return self.inner.weights_version if self.claimed is None else self.claimed

    def generate(self, prompts, sp, **kw):
        self.calls.append(int(self.inner.weights_version))
        rb = self.inner.generate(prompts, sp, **kw)
        rb.weights_version = self.weights_version + self.lie_by
        return rb

    def update_weights(self, weights):
        if self.drop_after is not None and weights.version > self.drop_after:
            self.claimed = weights.version  # a sync that silently does not land, reported as done
            return
        self.inner.update_weights(weights)


def test_fixed_schedule_samples_each_batch_from_its_version_and_resumes_exactly(tiny_dir, tmp_path):
    """max_staleness=2, fixed: batch s comes from version max(0, s-2) (recorded by the engine itself), and a run
    checkpointed after step 2 and resumed in a new trainer reproduces the uninterrupted run's steps 3-5 bit for bit
    (the checkpoint carries batches 2 and 3, sampled by versions 0 and 1; batch 4 is regenerated)."""
    from fp8rl_jax.trainer import RLTrainer
    from fp8rl_jax.trainer.checkpoint import CheckpointStore

    cfg = _cfg(tiny_dir, tmp_path / "a", num_steps=5, max_staleness=2)
    full = RLTrainer(cfg)
    full.reward_fn = _reward
    full.engine = _RecordingEngine(full.engine)
    try:
        ref = [full.step() for _ in range(5)]
    finally:
        full.close_pipeline()
    assert full.engine.calls == [0, 0, 0, 1, 2]
    assert [m["async/staleness_max"] for m in ref] == [0, 1, 2, 2, 2]
    assert any(m["reward/std"] > 0 for m in ref)

    first = RLTrainer(cfg)
    first.reward_fn = _reward
    store = CheckpointStore(str(tmp_path / "ckpt"), async_save=False)
    try:
        got = [first.step() for _ in range(2)]
        assert first.save_checkpoint(store, force=True)
    finally:
        first.close_pipeline()
        store.close()
    second = RLTrainer(cfg)
    second.reward_fn = _reward
    store = CheckpointStore(str(tmp_path / "ckpt"), async_save=False)
    try:
        assert second.restore_checkpoint(store) == 2
        assert sorted(second._carried_jobs) == [2, 3]
        got += [second.step() for _ in range(3)]
    finally:
        second.close_pipeline()
        store.close()
    for a, b in zip(ref, got):
        assert _numbers(a) == pytest.approx(_numbers(b), rel=0, abs=0, nan_ok=True)


def test_an_engine_reporting_the_wrong_version_is_caught(tiny_dir, tmp_path):
    """The synchronous loop and the producer both refuse a batch whose engine-reported version is not the one the
    trainer applied; a sync that silently does not land (the engine keeps serving the old weights) is caught by the
    content probe before the next batch is generated from it."""
    from fp8rl_jax.rollout.verify import StaleWeightsError
    from fp8rl_jax.trainer import RLTrainer
    from fp8rl_jax.trainer.pipeline import RolloutVersionError

    for k in (0, 1):
        tr = RLTrainer(_cfg(tiny_dir, tmp_path / f"lie{k}", max_staleness=k))
        tr.engine = _RecordingEngine(tr.engine, lie_by=1)
        with pytest.raises(RolloutVersionError, match="reports weights version 1 .* applied version 0"):
            tr.step()
        tr.close_pipeline()
    tr = RLTrainer(_cfg(tiny_dir, tmp_path / "drop", max_staleness=1, learning_rate=0.5))
    tr.reward_fn = _reward
    tr.engine = _RecordingEngine(tr.engine, drop_updates_after=0)
    with pytest.raises(StaleWeightsError):
        for _ in range(4):
            tr.step()
    tr.close_pipeline()
    assert tr.engine.calls == [0, 0]  # nothing was generated from the version that did not land


def test_partial_rollout_tags_each_token_with_the_version_that_sampled_it(tiny_dir, tmp_path):
    """latest schedule + partial rollouts in chunks of 2 tokens: every chunk of every row carries the version the
    engine held when it generated that chunk (an engine wrapper records the version per call and the tokens it
    returned), versions never decrease along a row, and staleness stays within the bound."""
    from fp8rl_jax.trainer import RLTrainer

    cfg = _cfg(tiny_dir, tmp_path / "p", num_steps=4, max_staleness=1, async_schedule="latest",
               partial_rollout=True, partial_rollout_tokens=2, max_tokens=8)
    tr = RLTrainer(cfg)
    tr.reward_fn = _reward
    log: list[tuple[int, np.ndarray]] = []
    inner = tr.engine

    class Logging(_RecordingEngine):
        def generate(self, prompts, sp, **kw):
            time.sleep(0.05)  # slow rollout: the trainer's updates land between chunks
            rb = super().generate(prompts, sp, **kw)
            log.append((self.calls[-1], np.asarray(rb.response_token_ids), [list(p) for p in prompts]))
            return rb

    tr.engine = Logging(inner)
    jobs = []
    orig = tr.train_on

    def spy(job, t_step=None):
        jobs.append(job)
        return orig(job, t_step)

    tr.train_on = spy
    try:
        ms = [tr.step() for _ in range(4)]
    finally:
        tr.close_pipeline()
    for m in ms:
        assert m["async/staleness_max"] <= 1
    assert max(m["async/partial_rows"] for m in ms) > 0  # updates did land inside batches
    for job in jobs:
        rb = job.scored.rollout
        tv = np.asarray(job.token_versions)
        mask = np.asarray(rb.response_mask) > 0
        assert np.all((tv >= 0) == mask)
        for r in range(tv.shape[0]):
            live = tv[r][mask[r]]
            assert np.all(np.diff(live) >= 0)
            # each 2-token chunk came from one generate call whose recorded version is the chunk's tag
            for c0 in range(0, int(mask[r].sum()), 2):
                v = set(tv[r, c0:c0 + 2][mask[r, c0:c0 + 2]].tolist())
                assert len(v) == 1
                toks = list(rb.response_token_ids[r, c0:c0 + 2][mask[r, c0:c0 + 2]])
                prefix = list(rb.prompt_token_ids[r]) + list(rb.response_token_ids[r, :c0])
                n = 1 if c0 else cfg.samples_per_prompt  # the first chunk is one call with n samples per prompt
                hits = [ver for ver, out, prompts in log for i, p in enumerate(prompts)
                        if p == prefix and list(out[i * n + (r % n if n > 1 else 0), :len(toks)]) == toks]
                assert v.pop() in hits


def test_staleness_zero_starts_no_thread_and_generates_from_the_current_version(tiny_dir, tmp_path):
    """max_staleness=0 is the synchronous loop: no producer thread, every batch generated by the engine holding the
    trainer's current version, no async/ metrics (the metrics of the loop before asynchronous RL existed)."""
    from fp8rl_jax.trainer import RLTrainer

    before = threading.active_count()
    tr = RLTrainer(_cfg(tiny_dir, tmp_path / "s", num_steps=3))
    tr.reward_fn = _reward
    tr.engine = _RecordingEngine(tr.engine)
    ms = [tr.step() for _ in range(3)]
    assert tr._pipeline is None and threading.active_count() == before
    assert tr.engine.calls == [0, 1, 2]
    assert not any(k.startswith("async/") for m in ms for k in m)


def test_mismatch_split_separates_precision_from_policy_lag(tiny_dir, tmp_path):
    """train.mismatch_split: on the first batch (lag 0) the policy-lag part is exactly 0 and the precision part is the
    whole rollout_corr/k3_kl; once batches lag a version behind a large update, the lag part is positive."""
    from fp8rl_jax.trainer import RLTrainer

    tr = RLTrainer(_cfg(tiny_dir, tmp_path / "split", num_steps=3, max_staleness=1, mismatch_split=True,
                        learning_rate=0.3))
    tr.reward_fn = _reward
    try:
        ms = [tr.step() for _ in range(3)]
    finally:
        tr.close_pipeline()
    assert ms[0]["async/k3_policy_lag"] == 0.0
    assert ms[0]["async/k3_precision"] == pytest.approx(ms[0]["rollout_corr/k3_kl"], rel=1e-5, abs=1e-9)
    assert ms[2]["async/staleness_max"] == 1 and ms[2]["async/k3_policy_lag"] > 0


def test_resume_with_other_async_settings_is_refused_before_any_state_changes(tiny_dir, tmp_path):
    from fp8rl_jax.trainer import RLTrainer
    from fp8rl_jax.trainer.checkpoint import CheckpointStore

    tr = RLTrainer(_cfg(tiny_dir, tmp_path / "k2", max_staleness=2))
    tr.reward_fn = _reward
    store = CheckpointStore(str(tmp_path / "ck"), async_save=False)
    try:
        tr.step()
        tr.step()
        tr.save_checkpoint(store, force=True)
    finally:
        tr.close_pipeline()
        store.close()
    other = RLTrainer(_cfg(tiny_dir, tmp_path / "k1", max_staleness=1))
    store = CheckpointStore(str(tmp_path / "ck"), async_save=False)
    try:
        with pytest.raises(ValueError, match="max_staleness=2.*carries its in-flight batches .2, 3.*max_staleness=1"):
            other.restore_checkpoint(store)
    finally:
        store.close()
    assert other.step_count == 0 and other.engine.weights_version == 0


def test_an_interrupted_step_keeps_its_batch_and_a_failed_sync_is_never_trusted(tiny_dir, tmp_path):
    """Ctrl-C before the update (here: in the phase callback at "train step") changes nothing and the same batch
    trains at the retry (synchronous and asynchronous); after a failed content check is caught, the next step
    installs and checks again instead of generating from the unchecked weights."""
    from fp8rl_jax.rollout.verify import StaleWeightsError
    from fp8rl_jax.trainer import RLTrainer

    for k in (0, 1):
        tr = RLTrainer(_cfg(tiny_dir, tmp_path / f"int{k}", max_staleness=k))
        tr.reward_fn = _reward
        tr.engine = _RecordingEngine(tr.engine)
        tr.step()

        def interrupt(name):
            if name == "train step":
                raise KeyboardInterrupt

        tr.on_phase = interrupt
        with pytest.raises(KeyboardInterrupt):
            tr.step()
        tr.on_phase = None
        calls = list(tr.engine.calls)
        assert tr.step_count == 1
        m = tr.step()  # the kept batch: no new generate call for it in synchronous mode
        assert m["step"] == 2 and (k == 1 or tr.engine.calls == calls)
        tr.close_pipeline()

    tr = RLTrainer(_cfg(tiny_dir, tmp_path / "again", max_staleness=1, learning_rate=0.5))
    tr.reward_fn = _reward
    tr.engine = _RecordingEngine(tr.engine, drop_updates_after=0)
    for _ in range(2):  # the failure repeats: the version is installed and checked again, never assumed
        with pytest.raises(StaleWeightsError):
            while True:
                tr.step()
    tr.close_pipeline()
    assert tr.engine.calls == [0, 0]
