"""Notebook use of one process (issue 31): a second trainer does not keep the first one's memory, a Ctrl-C (kernel
interrupt) during a step leaves the trainer usable, and the objects a notebook shows have readable reprs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import make_tiny_run_dir, make_tiny_smollm2_vocab_dir

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def _run_child(code: str, timeout: int = 600) -> str:
    import signal

    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "tests")},
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a terminal's Ctrl-C
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_a_second_trainer_does_not_keep_the_first_ones_memory(tmp_path):
    """Build a trainer (~0.5 GB of params, optimizer state and engine weights), drop it, build another: the process's
    RSS after the second is within 40% of the first's growth above the baseline (twice would be +100%)."""
    d = make_tiny_smollm2_vocab_dir(tmp_path / "m", hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                    num_attention_heads=8, num_key_value_heads=4)
    out = _run_child(f"""
        import gc, json
        from fp8rl_jax.trainer import RLTrainer, TrainConfig
        from fp8rl_jax.trainer.host_memory import release_host_memory

        def rss():
            gc.collect(); release_host_memory()
            return int(open("/proc/self/statm").read().split()[1]) * 4096

        cfg = TrainConfig(output_dir={str(tmp_path / 'o')!r}, model={d!r}, num_steps=1, prompts_per_step=2,
                          samples_per_prompt=2, max_tokens=4, progress_bar=False, checkpoint_every=0, plots=False)
        base = rss()
        tr = RLTrainer(cfg); tr.step()
        first = rss()
        del tr
        tr = RLTrainer(cfg); tr.step()
        second = rss()
        print(json.dumps([base, first, second]))
    """)
    base, first, second = __import__("json").loads(out.strip().splitlines()[-1])
    assert first - base > 300e6, (base, first)  # the check can see a second copy
    assert second - base < 1.4 * (first - base), (base, first, second)


def test_ctrl_c_during_a_step_leaves_the_trainer_usable(tmp_path):
    """SIGINT lands while the compiled update runs (and once during the sync): KeyboardInterrupt reaches the caller
    after the update and sync finished, never between the buffer donation and the write-back; the trainer then
    steps again and its engine passes the sync content check."""
    d = make_tiny_run_dir(tmp_path / "m")
    out = _run_child(f"""
        import math, os, signal, threading, time
        import numpy as np
        from fp8rl_jax.trainer import RLTrainer, TrainConfig

        cfg = TrainConfig(output_dir={str(tmp_path / 'o')!r}, model={d!r}, num_steps=5, prompts_per_step=2,
                          samples_per_prompt=2, max_tokens=4, progress_bar=False, checkpoint_every=0, plots=False,
                          learning_rate=1e-2)
        tr = RLTrainer(cfg)
        tr.step()  # compiled
        for phase_hit, delay in (("train step", 0.0), ("train step", 0.002), ("export + sync", 0.0)):
            def on_phase(name, hit=phase_hit, delay=delay):
                if name == hit:
                    threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT)).start()
                    time.sleep(delay + 0.05) if hit == "export + sync" else None
            tr.on_phase = on_phase
            before = tr.step_count
            try:
                tr.step()
                interrupted = False
            except KeyboardInterrupt:
                interrupted = True
            tr.on_phase = None
            assert interrupted, phase_hit
            assert tr.step_count in (before, before + 1)
            assert tr.engine.weights_version == tr.step_count  # the sync was not cut in two
            m = tr.step()
            assert math.isfinite(m["actor/loss"]) and tr.verify_sync() < 0.05
        print("ok", tr.step_count)
    """)
    assert out.strip().splitlines()[-1].startswith("ok")


def test_what_a_notebook_shows_has_readable_reprs(tmp_path):
    """repr of the trainer, its engine, a rollout batch, an export and a checkpoint store: one line each, naming what
    a user looks for (step, precision, shapes, version, size), never a dump of arrays."""
    from fp8rl_jax.trainer import RLTrainer, TrainConfig
    from fp8rl_jax.trainer.checkpoint import CheckpointStore

    d = make_tiny_run_dir(tmp_path / "m")
    tr = RLTrainer(TrainConfig(output_dir=str(tmp_path / "o"), model=d, num_steps=2, prompts_per_step=2,
                               samples_per_prompt=2, max_tokens=4, progress_bar=False, checkpoint_every=0, plots=False))
    job = tr.next_rollout()
    store = CheckpointStore(str(tmp_path / "c"), async_save=False)
    shown = {"trainer": repr(tr), "engine": repr(tr.engine), "batch": repr(job.scored.rollout), "job": repr(job),
             "export": repr(tr.export()), "store": repr(store)}
    store.close()
    for name, text in shown.items():
        assert "\n" not in text and len(text) < 400 and "array(" not in text and "Array(" not in text, (name, text)
    assert "step 0/2" in shown["trainer"] and "fp8" in shown["trainer"]
    assert "fp8" in shown["engine"] and "weights version 0" in shown["engine"]
    assert "4 rows x 4 tokens from 2 prompts" in shown["batch"]
    assert "format 'fp8_blockwise'" in shown["export"] and "MB" in shown["export"]
