"""Ray: a local 2-CPU cluster runs a trainer actor + 1 rollout actor for 2 quickstart steps (shared-memory sync).

Checks that the rollout actor holds exactly the trainer's exported weights after the run (fingerprints computed
independently in each process), that the token-auth secret stays under the test's temp dir (never
``~/.ray/auth_token``), and that a rollout actor dying makes the next sync fail loudly while the trainer stays
usable.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="needs the [ray] extra")
pytest.importorskip("torch", reason="needs torch (the rollout_bridge transports)")

from conftest import make_tiny_smollm2_vocab_dir  # noqa: E402

pytestmark = pytest.mark.vllm  # same optional-stack group as the vLLM bridge tests (torch + ray)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_smollm2_vocab_dir(tmp_path_factory.mktemp("tiny_ray"), head_dim=32)


def test_trainer_and_rollout_actor_two_steps(tiny_dir, tmp_path, tmp_path_factory, monkeypatch):
    from fp8rl_jax.trainer import TrainConfig
    from rollout_bridge.ray_launch import start

    home_token = os.path.expanduser("~/.ray/auth_token")
    had_home_token = os.path.exists(home_token)
    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        monkeypatch.delenv(k, raising=False)
    temp_dir = str(tmp_path_factory.mktemp("r"))  # short: Ray's unix socket paths must stay < 108 bytes
    # asynchronous (max_staleness=1): the trainer's producer thread drives two rollout actors while it trains
    cfg = TrainConfig(output_dir=str(tmp_path / "run"), model=tiny_dir, num_steps=2, prompts_per_step=2,
                      samples_per_prompt=2, max_tokens=4, rollout_precision="fp8", learning_rate=1e-2,
                      checkpoint_every=0, plots=False, progress_bar=False, max_staleness=1)
    import glob

    segments_before = set(glob.glob("/dev/shm/fp8rl_*"))
    try:
        job = start(cfg, num_rollout_actors=2, rollout_engine="jax", transport="shm", cpus_per_actor=0.5,
                    ray_init_kwargs=dict(num_cpus=2, _temp_dir=temp_dir, include_dashboard=False))
        assert os.environ["RAY_AUTH_TOKEN_PATH"].startswith(temp_dir)
        assert (os.stat(os.environ["RAY_AUTH_TOKEN_PATH"]).st_mode & 0o777) == 0o600
        history = ray.get(job.trainer.train.remote(2), timeout=600)
        assert [m["step"] for m in history] == [1, 2]
        for m in history:
            assert np.isfinite(m["actor/loss"]) and m["timing/export_s"] > 0
            assert m["sync/gb_per_s"] > 0 and m["sync/payload_gb"] > 0  # the achieved bandwidth, logged per step
        assert [m["async/staleness_max"] for m in history] == [0, 1]  # batch 1 was sampled by version 0
        stats = ray.get(job.trainer.sync_stats.remote())
        assert stats["transport"] == "shm" and stats["nbytes"] == round(history[-1]["sync/payload_gb"] * 1e9)
        assert stats["gb_per_s"] == stats["nbytes"] / stats["seconds"] / 1e9
        # the actor holds exactly what the trainer exported last (fingerprints from both processes)
        want = ray.get(job.trainer.export_digest.remote())
        got = ray.get(job.rollout[0].weights_digest.remote())
        assert set(got) == set(want) and len(want) > 10
        np.testing.assert_allclose([got[k] for k in sorted(want)], [want[k] for k in sorted(want)], rtol=1e-6)
        assert ray.get(job.rollout[0].fp8rl_weights_version.remote()) == 2

        # rollout actor 1 dies: its prompts go to actor 0 and training goes on (later syncs skip it)
        ray.kill(job.rollout[1])
        for _ in range(300):  # ray.kill is asynchronous: wait until the actor is really gone
            try:
                ray.get(job.rollout[1].fp8rl_weights_version.remote(), timeout=10)
                time.sleep(0.1)
            except ray.exceptions.GetTimeoutError:  # still alive, or dying slowly on a loaded machine: ask again
                continue
            except ray.exceptions.RayActorError:
                break
        more = ray.get(job.trainer.train.remote(3, str(tmp_path / "run_more")), timeout=600)
        assert [m["step"] for m in more][-1] == 3 and np.isfinite(more[-1]["actor/loss"])
        # step 3 trains on batch 2, sampled by version 1: installed by the producer on the live actor while the
        # trainer trained, and content-checked there (RayRolloutClient.score: a Ray run is verified like a local one)
        assert more[-1]["timing/sync_s"] > 0 and np.isfinite(more[-1]["sync/probe_abs_diff"])
        assert more[-1]["async/staleness_max"] == 1
        want = ray.get(job.trainer.export_digest.remote())
        # the last actor dies: the next sync fails loudly, the trainer and its state survive
        ray.kill(job.rollout[0])
        with pytest.raises(Exception, match="WeightSyncError.*rollout actor 0"):
            ray.get(job.trainer.sync.remote(), timeout=120)
        assert ray.get(job.trainer.step_count.remote()) == 3
        assert ray.get(job.trainer.export_digest.remote()) == want
        job.shutdown()
        assert set(glob.glob("/dev/shm/fp8rl_*")) == segments_before  # the trainer's segments were unlinked
    finally:
        ray.shutdown()
    assert os.path.exists(home_token) == had_home_token


def test_driver_reads_the_model_config_without_tensors(smollm2_path, tiny_dir, monkeypatch):
    """``start`` builds the actors' ModelConfig in the driver from metadata only: same config as load_checkpoint."""
    import types

    import gguf

    from fp8rl_jax.models import hf_io
    from fp8rl_jax.models.loading import load_checkpoint, load_model_config
    from rollout_bridge.ray_launch import _model_config

    want = {src: load_checkpoint(src)[0] for src in (smollm2_path, tiny_dir)}

    def no_tensors(*a, **k):
        raise AssertionError("load_model_config read tensor data")

    monkeypatch.setattr(gguf.quants, "dequantize", no_tensors)
    monkeypatch.setattr(hf_io, "read_safetensors", no_tensors)
    for src in (smollm2_path, tiny_dir):
        assert load_model_config(src) == want[src]
        assert _model_config(types.SimpleNamespace(model=src)) == want[src]
    assert load_model_config("smollm2-135m-instruct") == want[smollm2_path]
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model_config(str(tiny_dir) + "/nowhere")
