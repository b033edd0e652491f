"""The main job end to end on a tiny model (real loaders, real tokenizer), and clear errors on bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import make_hf_model, make_tiny_smollm2_vocab_dir
from fp8rl_jax.models.hf_io import CheckpointError, load_hf_dir
from fp8rl_jax.models.loading import build_model, load_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRED = ("step", "reward/mean", "rollout_corr/k3_kl", "rollout_corr/kl", "timing/rollout_s", "timing/train_s",
            "timing/sync_s", "memory/host_rss_gb", "memory/host_peak_rss_gb")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama with SmolLM2's real tokenizer (vocab 49152) saved as an HF directory."""
    return make_tiny_smollm2_vocab_dir(tmp_path_factory.mktemp("tiny"))


def _run_train(args, cwd=ROOT, timeout=600, env=None):
    return subprocess.run([sys.executable, "scripts/train.py", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**(os.environ if env is None else env), "HF_HUB_OFFLINE": "1"})


@pytest.mark.slow
def test_train_script_runs_quickstart_shape(tiny_dir, tmp_path):
    out = tmp_path / "run"
    r = _run_train(["--gin_file=configs/quickstart.gin", f"--gin_param=train.model='{tiny_dir}'",
                    "--gin_param=train.num_steps=2", "--gin_param=train.prompts_per_step=2",
                    "--gin_param=train.samples_per_prompt=2", "--gin_param=train.max_tokens=4",
                    "--gin_param=train.progress_bar=False", f"--output_dir={out}"])
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        for k in REQUIRED:
            assert k in m and np.isfinite(m[k]), k
        assert 0.0 <= m["reward/mean"] <= 1.0 and m["rollout_corr/k3_kl"] >= 0
    assert (out / "summary.json").exists() and "train.num_steps = 2" in (out / "config.gin").read_text()
    # what a user meets (issue 31): checkpoints stated up front and written only on interval steps + the last; the
    # first step's phases shown as they go; the run ends naming its directory, plots and TensorBoard command
    assert "checkpoints: every 10 steps and after the last one, the last 2 kept, ~" in r.stdout
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]
    assert "  rollout ..." in r.stdout and "  train step ..." in r.stdout and "  export + sync ..." in r.stdout
    assert f"run directory: {out}" in r.stdout and f"tensorboard --logdir {out / 'tensorboard'}" in r.stdout
    assert "plots: " in r.stdout and (out / "plots" / "reward.png").exists()
    # the same command again (make train passes --resume=auto): one line, no model load, summary.json untouched
    summary = (out / "summary.json").read_text()
    again = _run_train(["--gin_file=configs/quickstart.gin", f"--gin_param=train.model='{tiny_dir}'",
                        "--gin_param=train.num_steps=2", f"--output_dir={out}", "--resume=auto"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already holds the complete run (2 of 2 steps" in again.stdout and "loading" not in again.stdout
    assert (out / "summary.json").read_text() == summary


def test_a_missing_prompt_file_fails_before_the_model_loads(tiny_dir, tmp_path):
    """One line naming the file, without gin's "In call to configurable ... at 0x..." or a traceback hint."""
    r = _run_train([f"--gin_param=train.model='{tiny_dir}'", "--gin_param=train.task='file'",
                    f"--gin_param=prompt_file_dataset.path='{tmp_path / 'nope.jsonl'}'", f"--output_dir={tmp_path / 'o'}"])
    assert r.returncode == 2
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "nope.jsonl" in err[0], r.stderr[-2000:]
    assert "In call to configurable" not in r.stderr and "FP8RL_DEBUG" not in r.stderr and "loading" not in r.stdout


def test_notebook_use_without_gin(tiny_dir, tmp_path):
    """The same pieces run from Python, no gin: one RL step changes the weights the engine holds."""
    import jax.numpy as jnp

    from fp8rl_jax.trainer import RLTrainer, TrainConfig

    cfg = TrainConfig(output_dir=str(tmp_path), model=tiny_dir, num_steps=1, prompts_per_step=2,
                      samples_per_prompt=2, max_tokens=4, rollout_precision="bf16", learning_rate=1e-3,
                      progress_bar=False)
    tr = RLTrainer(cfg)
    before = np.asarray(tr.engine.model.model.layers[0].mlp.up_proj.weight[...].astype(jnp.float32))
    m = tr.step()
    after = np.asarray(tr.engine.model.model.layers[0].mlp.up_proj.weight[...].astype(jnp.float32))
    assert m["step"] == 1 and tr.engine.weights_version == 1
    if m["actor/grad_norm"] > 0:
        assert not np.array_equal(before, after)


def test_gin_typo_is_a_clear_error(tmp_path):
    r = _run_train(["--gin_file=configs/quickstart.gin", "--gin_param=train.num_stepz=3", f"--output_dir={tmp_path}"])
    assert r.returncode == 2 and "num_stepz" in r.stderr and "Traceback" not in r.stderr
    r = _run_train(["--gin_file=configs/nope.gin", f"--output_dir={tmp_path}"])
    assert r.returncode == 2 and "gin file not found: configs/nope.gin" in r.stderr
    r = _run_train(["--gin_file=configs/quickstart.gin", "--gin_param=train.rollout_precision='fp4'",
                    f"--output_dir={tmp_path}"])
    assert r.returncode == 2 and "rollout_precision" in r.stderr and "fp4" in r.stderr


def test_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_checkpoint(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(str(tmp_path / "empty"))


def test_corrupt_and_mismatched_checkpoints(tmp_path):
    make_hf_model("qwen3").save_pretrained(tmp_path)
    cfg, params, raw = load_hf_dir(str(tmp_path))
    # config/weights shape mismatch
    raw2 = dict(raw, intermediate_size=raw["intermediate_size"] + 8)
    (tmp_path / "config.json").write_text(json.dumps(raw2))
    cfg2, params2, _ = load_hf_dir(str(tmp_path))
    with pytest.raises(ValueError, match=r"shape mismatch for model.layers.0.mlp.(gate|up|down)_proj.weight"):
        build_model(cfg2, params2)
    # unknown architecture
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, model_type="gpt_neox")))
    with pytest.raises(ValueError, match="unknown architecture.*gpt_neox"):
        load_hf_dir(str(tmp_path))
    # missing tensor
    (tmp_path / "config.json").write_text(json.dumps(raw))
    p = dict(params)
    p.pop("model.layers.1.self_attn.q_norm.weight")
    with pytest.raises(KeyError, match="q_norm"):
        build_model(cfg, p)
    # truncated weights file
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated|corrupt"):
        load_hf_dir(str(tmp_path))
    f.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_hf_dir(str(tmp_path))


# -- a new user's first hour (issue 17): re-runs, --resume, bad bindings, corrupt files, Ctrl-C -------------------

def _tiny_args(tiny_dir, out, steps=1, *extra):
    return ["--gin_file=configs/quickstart.gin", f"--gin_param=train.model='{tiny_dir}'",
            f"--gin_param=train.num_steps={steps}", "--gin_param=train.prompts_per_step=2",
            "--gin_param=train.samples_per_prompt=2", "--gin_param=train.max_tokens=4",
            "--gin_param=train.checkpoint_every=1", "--gin_param=train.async_checkpoint=False",
            "--gin_param=train.progress_bar=False", "--gin_param=train.plots=False", f"--output_dir={out}", *extra]


def _one_error_line(r):
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    return errors[0]


def _snapshot(out):
    """Bytes of every file under the run directory (what a refused command must leave as it was)."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_rerun_is_refused_until_resume_or_overwrite_and_reuses_the_compilation_cache(tiny_dir, tmp_path):
    """The rerun rules, run with ``--compilation_cache_dir`` (the suite's own cache variable removed for these
    runs): the first run writes its compiled programs there, and the last run, the first one's command again
    (with --overwrite), loads every one of them (JAX logs a hit for each) and writes none."""
    out, cache = tmp_path / "try", tmp_path / "xla"
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_LOG_COMPILES="1")

    def run(*args):
        return _run_train([*args, f"--compilation_cache_dir={cache}"], env=env)

    r = run(*_tiny_args(tiny_dir, out))
    assert r.returncode == 0, r.stderr[-2000:]
    first = set(_snapshot(cache))
    assert len(first) >= 5, first  # the engine's prefill and decode, the train step, the export, ...
    before = _snapshot(out)
    line = _one_error_line(run(*_tiny_args(tiny_dir, out)))  # the same command again
    assert "already holds a run" in line and "--resume" in line and "--overwrite" in line
    assert _snapshot(out) == before  # nothing lost, nothing touched
    r = run(*_tiny_args(tiny_dir, out, 2, "--resume"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    after_resume = set(_snapshot(cache))
    r = run(*_tiny_args(tiny_dir, out, 1, "--overwrite"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["1"]
    hit_keys = set(re.findall(r"Persistent compilation cache hit for '[^']*' with key '([^']+)'", r.stderr))
    assert {f.removesuffix("-cache") for f in first} <= hit_keys, (first, hit_keys)  # every program of run 1
    assert set(_snapshot(cache)) == after_resume  # nothing compiled anew


def test_compilation_cache_off(tmp_path):
    """``--compilation_cache_dir=''`` turns JAX's cache off in the process and in the processes it starts, even where
    JAX_COMPILATION_CACHE_DIR named one: a program jitted in a child writes nothing there."""
    child = ("import jax, jax.numpy as jnp; print(jax.jit(lambda x: jnp.sin(x) * 3)(jnp.arange(7.0)).sum())")
    code = ("import os, subprocess, sys, jax; from fp8rl_jax.trainer.compile_cache import enable_compilation_cache as e, "
            "resolve_cache_dir as r; e(r('')); print(jax.config.jax_enable_compilation_cache, "
            "os.environ.get('JAX_COMPILATION_CACHE_DIR'), os.environ['JAX_ENABLE_COMPILATION_CACHE']); "
            "jax.jit(lambda x: x * 2)(1.0).block_until_ready(); "
            f"subprocess.run([sys.executable, '-c', {child!r}], check=True)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path),
                              "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[:3] == ["False", "None", "false"], out.stdout
    assert list(tmp_path.iterdir()) == []


def test_compilation_cache_default_order(tmp_path):
    """The flag ("" = off) over JAX's own variable over the NVIDIA default (XDG_CACHE_HOME) over off on CPU."""
    from fp8rl_jax.trainer.compile_cache import resolve_cache_dir

    xdg = {"XDG_CACHE_HOME": str(tmp_path)}
    assert resolve_cache_dir(str(tmp_path / "c"), {"JAX_COMPILATION_CACHE_DIR": "/x"}, True) == str(tmp_path / "c")
    assert resolve_cache_dir("", xdg, True) == ""
    assert resolve_cache_dir(None, {**xdg, "JAX_COMPILATION_CACHE_DIR": "/x"}, True) is None
    assert resolve_cache_dir(None, xdg, True) == os.path.join(str(tmp_path), "fp8rl_jax", "xla")
    assert resolve_cache_dir(None, xdg, False) is None
    home = os.path.expanduser("~")
    assert resolve_cache_dir("~/jc", {}, False) == os.path.join(home, "jc")
    assert resolve_cache_dir(None, {}, True) == os.path.join(home, ".cache", "fp8rl_jax", "xla")


def test_compilation_cache_dir_that_cannot_be_made_fails_in_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = tmp_path / "never"
    line = _one_error_line(_run_train(["--gin_file=configs/quickstart.gin", f"--output_dir={out}",
                                       f"--compilation_cache_dir={blocker / 'sub'}"]))
    assert "--compilation_cache_dir" in line and str(blocker / "sub") in line and not out.exists()


@pytest.mark.slow
def test_resume_without_a_checkpoint_says_so(tiny_dir, tmp_path):
    empty = tmp_path / "empty"
    line = _one_error_line(_run_train(_tiny_args(tiny_dir, empty, 1, "--resume")))
    assert "no checkpoint" in line and "--resume=auto" in line and not (empty / "metrics.jsonl").exists()
    r = _run_train(_tiny_args(tiny_dir, empty, 1, "--resume=auto"))  # auto: starts fresh
    assert r.returncode == 0, r.stderr[-2000:]
    assert len((empty / "metrics.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize("binding,named", [('train.learning_rate="1e-5"', "train.learning_rate='1e-5'"),
                                           ('train.temperature="hot"', "train.temperature='hot'"),
                                           ('LossConfig.clip_ratio_high="x"', "LossConfig.clip_ratio_high='x'"),
                                           ("train.num_stepz=3", "num_stepz")])
def test_wrong_bindings_fail_in_one_line_before_any_work(tmp_path, binding, named):
    out = tmp_path / "never"
    r = _run_train(["--gin_file=configs/quickstart.gin", f"--gin_param={binding}", f"--output_dir={out}"])
    assert named in _one_error_line(r)
    assert not out.exists()  # no run directory left behind


def test_a_corrupt_gguf_fails_in_one_line(tmp_path, smollm2_path):
    bad = tmp_path / "broken.gguf"
    with open(smollm2_path, "rb") as f:
        bad.write_bytes(f.read(100_000))
    line = _one_error_line(_run_train(["--gin_file=configs/quickstart.gin", f"--gin_param=train.model='{bad}'",
                                       f"--output_dir={tmp_path / 'run'}"]))
    assert "corrupt or truncated GGUF" in line


@pytest.mark.slow
def test_ctrl_c_names_the_kept_checkpoint(tiny_dir, tmp_path):
    import signal
    import time

    out = tmp_path / "int"
    p = subprocess.Popen([sys.executable, "scripts/train.py", *_tiny_args(tiny_dir, out, 50)], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"},
                         # a user's Ctrl-C: SIGINT at its default in the child (a pytest started as a background job
                         # of a non-interactive shell has SIGINT ignored, which the child would inherit and never
                         # raise KeyboardInterrupt)
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 300
    ckpts = out / "checkpoints"
    # any committed step (keep_checkpoints may already have removed step 1 when the steps are fast)
    while time.time() < deadline and p.poll() is None and not (
            ckpts.is_dir() and any(c.name.isdigit() for c in ckpts.iterdir())):
        time.sleep(0.2)
    assert p.poll() is None, "the 50-step run ended before it could be interrupted"
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert "interrupted: checkpoint of step" in err and "--resume" in err
    step = int(err.split("checkpoint of step ")[1].split()[0])
    assert (out / "checkpoints" / str(step)).is_dir()


def test_run_dir_policy_keeps_an_earlier_run(tmp_path):
    """prepare_run_dir on its own: every refusal leaves the files as they were; --overwrite clears them."""
    from fp8rl_jax.trainer.validation import RunDirError, prepare_run_dir

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    before = _snapshot(run)
    for resume, match in ((False, "already holds a run"), ("auto", "no checkpoint to continue"),
                          (True, "no checkpoint in")):
        with pytest.raises(RunDirError, match=match):
            prepare_run_dir(str(run), resume, False)
        assert _snapshot(run) == before
    with pytest.raises(RunDirError, match="contradict"):
        prepare_run_dir(str(run), True, True)
    (run / "checkpoints" / "3").mkdir()
    assert prepare_run_dir(str(run), "auto", False) == 3 and prepare_run_dir(str(run), True, False) == 3
    assert prepare_run_dir(str(run), False, True) is None and not (run / "metrics.jsonl").exists()
    assert prepare_run_dir(str(tmp_path / "fresh"), "auto", False) is None
