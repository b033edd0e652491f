"""Model names the way users write them (issue 39, item 15): ``train.model = "Qwen/Qwen3-0.6B"`` resolves from a
local Hugging Face hub cache, offline, with a clear error naming the folders searched when it is not there.

The cache is built in ``tmp_path`` in the hub's own layout (``models--Org--Name/{blobs,refs/main,snapshots/<rev>/}``,
snapshot files as relative symlinks into ``blobs/``, as ``huggingface_hub`` writes them) around a tiny random Qwen3
written by the project's own safetensors writer (:func:`fp8rl_jax.models.hf_io.save_hf_dir`).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

from conftest import make_byte_tokenizer
from fp8rl_jax import assets
from fp8rl_jax.models.config import ModelConfig, hf_param_shapes
from fp8rl_jax.models.hf_io import load_hf_dir, save_hf_dir
from fp8rl_jax.models.loading import load_checkpoint, load_model_config, load_tokenizer_for, resolve_model_source

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = "TestOrg/Tiny-Qwen3"
FOLDER = "models--TestOrg--Tiny-Qwen3"
REV_MAIN = "a" * 40
REV_OLD = "b" * 40
CACHE_ENV = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")


def _tiny_model_dir(directory, seed: int, layers: int = 1) -> str:
    """A tiny random Qwen3 (vocab 320 for the byte tokenizer) as an HF directory, with tokenizer files."""
    cfg = ModelConfig.from_hf_dict(dict(
        model_type="qwen3", vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True, eos_token_id=2,
        bos_token_id=1, pad_token_id=0, max_position_embeddings=256))
    rng = np.random.default_rng(seed)
    params = {n: (np.ones(s, np.float32) if n.endswith("norm.weight") else
                  (0.02 * rng.standard_normal(s)).astype(np.float32))
              for n, s in sorted(hf_param_shapes(cfg).items())}
    save_hf_dir(str(directory), cfg, params)
    make_byte_tokenizer(directory)
    return str(directory)


def _add_snapshot(cache, rev: str, src: str, folder: str = FOLDER, ref: str | None = "main") -> str:
    """Put ``src``'s files into ``cache`` as the hub does: content in ``blobs/``, ``snapshots/<rev>/<file>`` a relative
    symlink to its blob, ``refs/<ref>`` holding ``rev``."""
    repo = os.path.join(cache, folder)
    snap = os.path.join(repo, "snapshots", rev)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    os.makedirs(snap, exist_ok=True)
    for name in sorted(os.listdir(src)):
        blob = f"{rev[:8]}-{name}"
        shutil.copyfile(os.path.join(src, name), os.path.join(repo, "blobs", blob))
        os.symlink(os.path.join("..", "..", "blobs", blob), os.path.join(snap, name))
    if ref is not None:
        os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
        with open(os.path.join(repo, "refs", ref), "w") as f:
            f.write(rev)  # the hub writes the hash without a newline
    return snap


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No cache variable from the machine, and a HOME with no cache, so only what a test sets is searched."""
    for k in CACHE_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


@pytest.fixture
def cache(tmp_path, clean_env):
    """``$HF_HUB_CACHE`` with REPO at two revisions: ``refs/main`` -> REV_MAIN (2 layers), REV_OLD (1 layer)."""
    c = tmp_path / "hub"
    _add_snapshot(c, REV_MAIN, _tiny_model_dir(tmp_path / "src_main", seed=0, layers=2))
    _add_snapshot(c, REV_OLD, _tiny_model_dir(tmp_path / "src_old", seed=1, layers=1), ref=None)
    clean_env.setenv("HF_HUB_CACHE", str(c))
    return c


@pytest.fixture
def no_network(monkeypatch):
    """Any socket connection fails the test: resolving a cached model must not touch the network."""
    def refuse(*a, **k):
        raise AssertionError("a network connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_parse_hub_id():
    assert assets.parse_hub_id("Qwen/Qwen3-0.6B") == ("Qwen/Qwen3-0.6B", None)
    assert assets.parse_hub_id("Qwen/Qwen2.5-0.5B-Instruct@main") == ("Qwen/Qwen2.5-0.5B-Instruct", "main")
    assert assets.parse_hub_id(f"org/m@{REV_OLD}") == ("org/m", REV_OLD)
    for not_hub in ("smollm2-135m-instruct", "/models/Qwen3-8B", "a/b/c", "../x", "org/..", "org/", "/x",
                    "org/name@", "org/na me"):
        assert assets.parse_hub_id(not_hub) is None, not_hub


def test_cache_dirs_follow_huggingface_hub_order(clean_env, tmp_path):
    home_default = os.path.join(str(tmp_path / "home"), ".cache", "huggingface", "hub")
    assert assets.hf_cache_dirs() == [home_default]
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert assets.hf_cache_dirs() == [str(tmp_path / "xdg" / "huggingface" / "hub")]
    clean_env.setenv("HF_HOME", str(tmp_path / "hfhome"))
    clean_env.setenv("HF_HUB_CACHE", str(tmp_path / "hubcache"))
    assert assets.hf_cache_dirs() == [str(tmp_path / "hubcache"), str(tmp_path / "hfhome" / "hub"),
                                      str(tmp_path / "xdg" / "huggingface" / "hub")]


def test_a_hub_name_loads_the_refs_main_snapshot_offline(cache, no_network):
    snap = cache / FOLDER / "snapshots" / REV_MAIN
    assert resolve_model_source(REPO) == str(snap)
    cfg, params = load_checkpoint(REPO)
    ref_cfg, ref_params, _ = load_hf_dir(str(snap))
    assert cfg == ref_cfg and cfg.num_hidden_layers == 2
    assert set(params) == set(ref_params)
    for k in params:
        np.testing.assert_array_equal(np.asarray(params[k]), np.asarray(ref_params[k]))
    assert load_model_config(REPO) == cfg
    tok = load_tokenizer_for(REPO)
    assert tok.vocab_size == 259 and tok.eos_token == "<|im_end|>"


def test_a_revision_picks_another_snapshot(cache):
    assert load_model_config(f"{REPO}@{REV_OLD}").num_hidden_layers == 1
    assert load_model_config(f"{REPO}@main").num_hidden_layers == 2
    with pytest.raises(assets.HFCacheMissError, match="no ref or snapshot 'v9'"):
        load_model_config(f"{REPO}@v9")


def test_without_refs_main_one_snapshot_is_used_and_two_are_refused(tmp_path, clean_env):
    c = tmp_path / "hub"
    _add_snapshot(c, REV_OLD, _tiny_model_dir(tmp_path / "src", seed=0), ref=None)
    clean_env.setenv("HF_HUB_CACHE", str(c))
    assert resolve_model_source(REPO).endswith(REV_OLD)
    _add_snapshot(c, REV_MAIN, str(tmp_path / "src"), ref=None)
    with pytest.raises(assets.HFCacheMissError, match=f"2 snapshots .*{REPO}@<snapshot>"):
        resolve_model_source(REPO)


def test_the_first_cache_holding_the_model_wins(tmp_path, clean_env):
    """``$HF_HUB_CACHE`` without the model, ``$HF_HOME/hub`` with it: found in the second."""
    clean_env.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    clean_env.setenv("HF_HOME", str(tmp_path / "hfhome"))
    snap = _add_snapshot(tmp_path / "hfhome" / "hub", REV_MAIN, _tiny_model_dir(tmp_path / "src", seed=0))
    assert resolve_model_source(REPO) == snap


def test_a_missing_model_names_every_folder_searched(tmp_path, clean_env, no_network):
    clean_env.setenv("HF_HUB_CACHE", str(tmp_path / "a"))
    clean_env.setenv("HF_HOME", str(tmp_path / "b"))
    with pytest.raises(FileNotFoundError) as e:
        load_checkpoint("Qwen/Qwen3-0.6B")
    msg = str(e.value)
    assert isinstance(e.value, assets.HFCacheMissError) and "\n" not in msg
    for d in (tmp_path / "a", tmp_path / "b" / "hub", tmp_path / "home" / ".cache" / "huggingface" / "hub"):
        assert str(d / "models--Qwen--Qwen3-0.6B") in msg, msg
    assert "HF_HUB_CACHE" in msg and "huggingface-cli download Qwen/Qwen3-0.6B" in msg


def test_an_incomplete_snapshot_says_so(cache):
    os.remove(cache / FOLDER / "snapshots" / REV_MAIN / "config.json")
    with pytest.raises(assets.HFCacheMissError, match="has no config.json"):
        load_model_config(REPO)


def test_a_ref_to_a_missing_snapshot_says_so(cache):
    shutil.rmtree(cache / FOLDER / "snapshots" / REV_MAIN)
    with pytest.raises(assets.HFCacheMissError, match=f"refs.main points to snapshot {REV_MAIN}"):
        load_model_config(REPO)


def test_a_local_directory_of_that_name_comes_first(cache, tmp_path, monkeypatch):
    _tiny_model_dir(tmp_path / "work" / "TestOrg" / "Tiny-Qwen3", seed=2, layers=3)
    monkeypatch.chdir(tmp_path / "work")
    assert resolve_model_source(REPO) == REPO
    assert load_model_config(REPO).num_hidden_layers == 3


def test_other_sources_are_unchanged(tmp_path, clean_env):
    d = _tiny_model_dir(tmp_path / "plain", seed=0)
    assert resolve_model_source(d) == d and resolve_model_source("x.gguf") == "x.gguf"
    with pytest.raises(FileNotFoundError, match="nor a hub name org/name"):
        resolve_model_source("no-such-model")


@pytest.mark.slow
def test_train_script_with_a_hub_name(tmp_path, clean_env):
    """The user's command: ``train.model = "Org/Name"`` trains from the cache; not cached, it fails in one line that
    names the folders searched, before any work."""
    c = tmp_path / "hub"
    _add_snapshot(c, REV_MAIN, _tiny_model_dir(tmp_path / "src", seed=0))
    env = {**os.environ, "HF_HUB_CACHE": str(c), "HF_HUB_OFFLINE": "1"}
    args = ["--gin_file=configs/quickstart.gin", "--gin_param=train.num_steps=1",
            "--gin_param=train.prompts_per_step=2", "--gin_param=train.samples_per_prompt=2", "--gin_param=train.max_tokens=4",
            "--gin_param=train.checkpoint_every=0", "--gin_param=train.progress_bar=False",
            "--gin_param=train.plots=False"]

    def run(model, out):
        return subprocess.run([sys.executable, "scripts/train.py", *args, f"--gin_param=train.model='{model}'",
                               f"--output_dir={out}"], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)

    miss = run("Qwen/Qwen3-0.6B", tmp_path / "miss")
    errors = [line for line in miss.stderr.splitlines() if line.startswith("error:")]
    assert miss.returncode != 0 and len(errors) == 1 and "Traceback" not in miss.stderr, miss.stderr[-3000:]
    assert str(c / "models--Qwen--Qwen3-0.6B") in errors[0]
    assert not (tmp_path / "miss" / "metrics.jsonl").exists()

    ok = run(REPO, tmp_path / "ok")
    assert ok.returncode == 0, ok.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "ok" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1]
    assert f"train.model = '{REPO}'" in (tmp_path / "ok" / "config.gin").read_text()


def test_plan_reads_a_cached_hub_model_and_falls_back_to_a_preset(cache):
    """scripts/plan.py: a hub name in the cache is planned from its own config.json; one not cached from the preset of
    that name (as for the paper configs' /models/... paths), never from the network."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("plan_script", os.path.join(ROOT, "scripts", "plan.py"))
    plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan)
    cfg, label = plan._model_config(REPO)
    assert label == REPO and cfg.num_hidden_layers == 2 and cfg.hidden_size == 32
    cfg, label = plan._model_config("Qwen/Qwen3-8B")
    assert label == "preset for Qwen3-8B" and cfg.hidden_size == 4096
