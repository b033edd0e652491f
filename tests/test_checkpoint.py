"""Orbax checkpoints of the RL trainer: exact resume, kill -9 safety, clear errors; run logging and plots.

References: the resumed run is compared against an uninterrupted run of the same config (fixed seeds, CPU,
float32 rollout); the kill -9 test compares what orbax reports as the latest checkpoint with the values the
killed process saved at that step.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import make_tiny_run_dir
from fp8rl_jax.data.types import ListDataset, PromptItem
from fp8rl_jax.trainer import RLTrainer, TrainConfig, train
from fp8rl_jax.trainer.checkpoint import CheckpointNotFoundError, CheckpointStore
from fp8rl_jax.trainer.logging import RunLogger, plot_metrics, read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def text_reward(text: str, item) -> float:
    """A deterministic reward with variance on random-model outputs (so advantages and gradients are non-zero)."""
    return float(sum(text.encode()) % 3 == 0)


def fixed_length_dataset() -> ListDataset:
    """Prompts of identical token length (one prompt bucket: every step reuses the same compiled programs)."""
    return ListDataset([PromptItem(messages=[{"role": "user", "content": f"{a}+{b}="}], answer=str(a + b),
                                   task="toy") for a in range(10) for b in range(10)], name="toy")


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """A persistent XLA compilation cache for this module: later trainers reuse the first one's programs."""
    import jax

    old = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs,
           jax.config.jax_persistent_cache_min_entry_size_bytes)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("xla_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    yield
    jax.config.update("jax_compilation_cache_dir", old[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", old[2])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_run_dir(tmp_path_factory.mktemp("tiny_ckpt"))


def _config(tiny_dir, out, **kw):
    base = dict(output_dir=str(out), model=tiny_dir, num_steps=3, prompts_per_step=2, samples_per_prompt=4,
                max_tokens=6, rollout_precision="float32", learning_rate=3e-2, progress_bar=False,
                checkpoint_every=1, keep_checkpoints=3, plots=False)
    base.update(kw)
    return TrainConfig(**base)


def _trainer(cfg):
    tr = RLTrainer(cfg, dataset=fixed_length_dataset())
    tr.reward_fn = text_reward
    return tr


def _no_timing(m):
    return {k: v for k, v in m.items() if not k.startswith(("timing/", "memory/"))}


@pytest.fixture(scope="module")
def uninterrupted(tiny_dir, tmp_path_factory, compile_cache):
    out = tmp_path_factory.mktemp("run_a")
    cfg = _config(tiny_dir, out)
    tr = _trainer(cfg)
    hist = train(cfg, trainer=tr)
    return out, hist, tr


def test_resume_equals_uninterrupted_run(uninterrupted, tiny_dir, tmp_path):
    """3 steps straight == 2 steps, stop, new process state, --resume, 1 step: same metrics, same weights."""
    from fp8rl_jax.models.decoder import named_params

    out_a, hist_a, tr_a = uninterrupted
    assert [m["step"] for m in hist_a] == [1, 2, 3]
    assert any(m["actor/grad_norm"] > 0 for m in hist_a), "degenerate run: no gradient, nothing to compare"
    out_b = tmp_path / "run_b"
    cfg2 = _config(tiny_dir, out_b, num_steps=2)
    train(cfg2, trainer=_trainer(cfg2))
    assert CheckpointStore(str(out_b / "checkpoints")).latest_step() == 2
    # a stale metrics line written after the last checkpoint (crash between log and save) must be dropped
    with open(out_b / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "reward/mean": -1.0}) + "\n")
    cfg3 = _config(tiny_dir, out_b, resume=True)
    tr_b = _trainer(cfg3)
    hist_b = train(cfg3, trainer=tr_b)
    assert [m["step"] for m in hist_b] == [1, 2, 3]
    file_b = read_metrics(str(out_b / "metrics.jsonl"))
    assert [m["step"] for m in file_b] == [1, 2, 3]
    for a, b, f in zip(hist_a, hist_b, file_b):
        assert _no_timing(a).keys() == _no_timing(b).keys()
        for k, v in _no_timing(a).items():
            assert b[k] == pytest.approx(v, rel=1e-6, abs=1e-6), (a["step"], k)
            assert f[k] == pytest.approx(v, rel=1e-6, abs=1e-6), (a["step"], k)
    pa, pb = named_params(tr_a.model), named_params(tr_b.model)
    for name in pa:
        np.testing.assert_array_equal(np.asarray(pa[name]), np.asarray(pb[name]), err_msg=name)
    assert int(tr_a.optimizer.step[...]) == int(tr_b.optimizer.step[...]) == 3
    assert tr_b.batches.position == tr_a.batches.position == 3 * 2
    summary = json.loads((out_b / "summary.json").read_text())
    assert summary["resumed_from_step"] == 2 and summary["num_steps"] == 3


def test_checkpoint_contents_keep_last_k_and_extra_state(uninterrupted, tmp_path):
    """Keep-last-k, and a restored checkpoint equals the live state it was taken from (incl. extra state)."""
    out_a, _, tr = uninterrupted
    store = CheckpointStore(str(out_a / "checkpoints"))
    assert store.all_steps() == [1, 2, 3]
    kv = {"model.layers.0.self_attn.k_scale": np.float32(0.25), "model.layers.0.self_attn.v_scale": np.float32(2.0)}
    got = {}
    tr.register_checkpoint_state("kv_scales", lambda: dict(kv), got.update)
    with pytest.raises(ValueError, match="kv_scales"):
        tr.register_checkpoint_state("kv_scales", dict, print)
    small = CheckpointStore(str(tmp_path / "ck"), max_to_keep=2, async_save=True)
    for _ in range(3):
        tr.step_count += 1
        assert tr.save_checkpoint(small)
    small.wait()
    assert small.all_steps() == [5, 6]
    state, meta = small.restore()
    assert meta["rl_step"] == 6 and meta["data_iterator"]["position"] == tr.batches.position
    live, _ = tr.checkpoint_state()
    import jax

    for a, b in zip(jax.tree.leaves(live), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tr.step_count = 0
    assert tr.restore_checkpoint(small, step=5) == 5 and got == kv
    small.close()
    tr._checkpoint_hooks.pop("kv_scales")


# orbax's failed restore (the shape mismatch below) abandons its pending read coroutines; collected later they
# print "Exception ignored in <coroutine _read_array_index_and_device_put>" (GeneratorExit) under whichever test runs
# then. They are collected at the end of this test instead, and those messages (orbax's, not ours) not reported.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_missing_checkpoint_is_a_clear_error(uninterrupted, tmp_path):
    out_a, _, tr = uninterrupted
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint in .*empty"):
        CheckpointStore(str(tmp_path / "empty")).restore()
    ck = tmp_path / "ck"
    shutil.copytree(out_a / "checkpoints", ck)
    store = CheckpointStore(str(ck))
    with pytest.raises(CheckpointNotFoundError, match=r"step 7 .* holds steps \[1, 2, 3\]"):
        store.restore(7)
    shutil.rmtree(ck / "3" / "optimizer")
    with pytest.raises(FileNotFoundError, match="missing item 'optimizer'"):
        tr.restore_checkpoint(store, step=3)
    # another model's checkpoint: shapes differ
    state, meta = store.restore(2)
    other = CheckpointStore(str(tmp_path / "other"), async_save=False)
    state["params"]["model"]["norm"]["weight"] = np.ones(7, np.float32)
    other.save(1, state, meta)
    with pytest.raises(ValueError, match="does not match"):
        tr.restore_checkpoint(other)
    gc.collect()


_SAVER = r"""
import sys, numpy as np
from fp8rl_jax.trainer.checkpoint import CheckpointStore
store = CheckpointStore(sys.argv[1], max_to_keep=2, async_save=True)
n = int(sys.argv[2])
for step in range(1, 10_000):
    state = {"params": {"w": np.full((n,), step, np.float32), "b": np.full((n // 4,), -step, np.float32)},
             "optimizer": {"mu": np.full((n // 2,), 0.5 * step, np.float32), "count": np.int32(step)}}
    print(f"saving {step}", flush=True)
    store.save(step, state, {"rl_step": step})
"""


def _tmp_dirs(d):
    return [x for x in os.listdir(d) if "tmp" in x] if os.path.isdir(d) else []


def test_kill9_mid_save_leaves_a_loadable_checkpoint(tmp_path):
    """SIGKILL a process that saves 14 MB checkpoints in a loop (async); the latest committed one loads right.

    Trial 0 kills while an orbax tmp directory exists (a write is provably interrupted); trial 1 kills at a
    random time after the first commit.
    """
    rng = np.random.default_rng(0)
    script = tmp_path / "saver.py"
    script.write_text(_SAVER)
    env = {**os.environ, "PYTHONPATH": ROOT}
    interrupted = 0
    for trial in range(2):
        d = tmp_path / f"ck{trial}"
        p = subprocess.Popen([sys.executable, str(script), str(d), str(2_000_000)], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, env=env)
        try:
            seen = 0
            while seen < 3:  # step 1 is committed once "saving 3" is printed (save(2) waits for save(1))
                line = p.stdout.readline()
                assert line, "saver died early"
                seen = int(line.split()[1])
            t_end = time.monotonic() + 60
            if trial == 0:
                while not _tmp_dirs(d) and time.monotonic() < t_end:
                    time.sleep(0.002)
            else:
                time.sleep(float(rng.uniform(0.0, 1.0)))
            had_tmp = bool(_tmp_dirs(d))
        finally:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
        interrupted += had_tmp
        store = CheckpointStore(str(d))
        step = store.latest_step()
        assert step is not None and step >= 1, os.listdir(d)
        state, meta = store.restore()
        assert meta["rl_step"] == step
        n = 2_000_000
        np.testing.assert_array_equal(state["params"]["w"], np.full((n,), step, np.float32))
        np.testing.assert_array_equal(state["params"]["b"], np.full((n // 4,), -step, np.float32))
        np.testing.assert_array_equal(state["optimizer"]["mu"], np.full((n // 2,), 0.5 * step, np.float32))
        assert int(state["optimizer"]["count"]) == step
        store.close()  # waits for orbax's background clean-up of the killed save's tmp directory
        assert not _tmp_dirs(d), "tmp directories of the killed save must be cleaned up on the next start"
    assert interrupted >= 1, "the kill did not land during a write"


def test_run_logger_resume_tensorboard_and_plots(tmp_path):
    """metrics.jsonl truncation on resume, TensorBoard scalars readable back, PNG plots per metric group."""
    hist = [{"step": s, "reward/mean": 0.1 * s, "rollout_corr/kl": 1e-3 / s, "rollout_corr/k3_kl": 2e-3 / s,
             "val/accuracy": 0.5, "timing/step_s": 1.0 + s} for s in range(1, 5)]
    log = RunLogger(str(tmp_path))
    for m in hist:
        log.log(m)
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "reward')  # torn line from a crash
    assert [m["step"] for m in read_metrics(str(tmp_path / "metrics.jsonl"))] == [1, 2, 3, 4]
    log = RunLogger(str(tmp_path), resume_step=2)
    assert log.history == hist[:2]
    log.log(dict(hist[2], **{"reward/mean": 9.0}))
    log.close()
    lines = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [m["step"] for m in lines] == [1, 2, 3] and lines[2]["reward/mean"] == 9.0
    with pytest.raises(ValueError, match="step"):
        RunLogger(str(tmp_path / "x"), tensorboard=False).log({"reward/mean": 1.0})
    # TensorBoard: read the event files back (TFRecord framing: u64 length, u32 crc, Event proto, u32 crc)
    from tensorboardX.proto import event_pb2

    scalars = []
    for name in sorted(os.listdir(tmp_path / "tensorboard")):
        data = (tmp_path / "tensorboard" / name).read_bytes()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            ev = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            scalars += [(v.tag, ev.step, v.simple_value) for v in ev.summary.value]
    reward = [(s, v) for t, s, v in scalars if t == "reward/mean"]
    assert [s for s, _ in reward] == [1, 2, 3, 4, 3]  # first writer's 4 steps; resumed writer (purge) re-logs 3
    assert reward[-1][1] == pytest.approx(9.0) and reward[0][1] == pytest.approx(0.1)
    assert ("timing/step_s", 4, pytest.approx(5.0)) in scalars
    import matplotlib.image

    paths = plot_metrics(lines, str(tmp_path / "plots"), title="t")
    assert sorted(os.path.basename(p) for p in paths) == ["mismatch_kl.png", "reward.png", "timing.png",
                                                         "validation.png"]
    for p in paths:
        img = matplotlib.image.imread(p)
        assert img.ndim == 3 and img.shape[0] > 100 and img.std() > 0
