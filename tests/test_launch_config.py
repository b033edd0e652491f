"""Launches and configs (issue 39, items 1-4): gin is the one source of the Ray launch's settings, gin includes
resolve from any working directory, the paper configs' paths are one binding each, and the help texts print their
examples intact with every binding namespace reachable (``--print_config``).

None of these start Ray: the launcher's resolution is a pure function (:mod:`fp8rl_jax.trainer.launch`) and
``scripts/launch_ray.py``'s call into :mod:`rollout_bridge.ray_launch` is replaced by a recorder.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import re
import subprocess
import sys

import gin
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
EXP1 = os.path.join(ROOT, "configs", "paper", "exp1_dense_w8a8.gin")


def _args(*gin_files, params=(), output_dir=None):
    return argparse.Namespace(gin_file=list(gin_files), gin_param=list(params), output_dir=output_dir)


def _script(name):
    """``scripts/<name>.py`` imported as a module (its ``main(argv)`` callable in-process)."""
    spec = importlib.util.spec_from_file_location(f"_script_{name}", os.path.join(ROOT, "scripts", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(autouse=True)
def _clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


@pytest.fixture
def local_paths(tmp_path):
    """A model directory and a prompt file that exist (the launch is recorded, never run: only existence matters)."""
    model = tmp_path / "Qwen3-8B-Base"
    model.mkdir()
    prompts = tmp_path / "dapo.jsonl"
    prompts.write_text('{"prompt": "1+1?", "reward_model": {"ground_truth": "2"}}\n')
    return [f'MODEL_DIR="{model}"', f'PROMPT_FILE="{prompts}"']


# ---------------------------------------------------------------------------------------------------------------
# 1. flags vs gin
# ---------------------------------------------------------------------------------------------------------------
def test_a_flag_not_given_leaves_the_binding_and_a_given_one_sets_it():
    from fp8rl_jax.trainer.launch import resolve_flag_bindings

    bound = {"train.rollout_engine": "vllm"}
    assert resolve_flag_bindings({"rollout_engine": None, "gpus_per_actor": None}, bound) == {}
    assert resolve_flag_bindings({"rollout_engine": "vllm"}, bound) == {"train.rollout_engine": "vllm"}
    assert resolve_flag_bindings({"gpus_per_actor": 2.0, "transport": "dist"}, bound) == {
        "ray_launch.gpus_per_actor": 2.0, "ray_launch.transport": "dist"}
    assert resolve_flag_bindings({"gpus_per_actor": 1.0}, {"ray_launch.gpus_per_actor": 1}) == {
        "ray_launch.gpus_per_actor": 1.0}  # the same value, written as int in gin and float on the command line


def test_a_flag_that_contradicts_a_binding_is_an_error_naming_both():
    from fp8rl_jax.trainer.launch import resolve_flag_bindings

    with pytest.raises(ValueError) as e:
        resolve_flag_bindings({"rollout_engine": "jax"}, {"train.rollout_engine": "vllm"})
    msg = str(e.value)
    assert "\n" not in msg
    assert "--rollout_engine=jax" in msg and 'train.rollout_engine = "vllm"' in msg
    with pytest.raises(ValueError, match=r"--num_rollout_actors=4 .*ray_launch\.num_rollout_actors = 2"):
        resolve_flag_bindings({"num_rollout_actors": 4}, {"ray_launch.num_rollout_actors": 2})


def test_every_launcher_flag_names_a_bindable_parameter():
    import fp8rl_jax.trainer  # noqa: F401 (registers the configurables)
    from fp8rl_jax.trainer.cli import bindable_parameters
    from fp8rl_jax.trainer.launch import FLAG_BINDINGS

    bindable = {f"{ns}.{p}" for ns, p, _ in bindable_parameters()}
    assert set(FLAG_BINDINGS.values()) <= bindable
    parser = _script("launch_ray").build_parser()
    for flag in FLAG_BINDINGS:  # each run setting's flag defaults to None: "not given" is distinguishable
        assert parser.get_default(flag) is None, flag


def test_the_paper_config_launches_vllm_actors_with_the_clusters_gpus():
    from fp8rl_jax.trainer.cli import config_from_gin_flags
    from fp8rl_jax.trainer.launch import FLAG_BINDINGS, RayLaunchConfig, launch_plan

    no_flags = dict.fromkeys(FLAG_BINDINGS)
    cfg, err = config_from_gin_flags(_args(EXP1), flag_bindings=no_flags)
    assert err is None
    kind, kw = launch_plan(cfg, RayLaunchConfig())
    assert kind == "actors" and kw["rollout_engine"] == "vllm" and kw["gpus_per_actor"] is None
    # flags set what the config leaves open
    cfg, err = config_from_gin_flags(_args(EXP1), flag_bindings={**no_flags, "gpus_per_actor": 1.0,
                                                                 "num_rollout_actors": 3})
    assert err is None
    kind, kw = launch_plan(cfg, RayLaunchConfig())
    assert (kw["gpus_per_actor"], kw["num_rollout_actors"], kw["rollout_engine"]) == (1.0, 3, "vllm")
    # and the flags land in the gin config the trainer actor re-parses
    assert "ray_launch.num_rollout_actors = 3" in gin.config_str()
    cfg, err = config_from_gin_flags(_args(EXP1, params=["ray_launch.num_trainer_processes = 2"]),
                                     flag_bindings=no_flags)
    kind, kw = launch_plan(cfg, RayLaunchConfig())
    assert kind == "multihost" and kw["num_processes"] == 2 and kw["gpus_per_process"] is None
    # a quickstart config binds no engine: the default one, or the flag's
    cfg, _ = config_from_gin_flags(_args(os.path.join(ROOT, "configs", "quickstart.gin")), flag_bindings=no_flags)
    assert launch_plan(cfg, RayLaunchConfig())[1]["rollout_engine"] == "jax"
    cfg, _ = config_from_gin_flags(_args(os.path.join(ROOT, "configs", "quickstart.gin")),
                                   flag_bindings={**no_flags, "rollout_engine": "vllm"})
    assert launch_plan(cfg, RayLaunchConfig())[1]["rollout_engine"] == "vllm"


def test_the_documented_launch_command_runs_what_the_config_says(monkeypatch, tmp_path, local_paths, capsys):
    """`launch_ray.py --address=auto --gin_file=configs/paper/<exp>.gin` (docs/REPRODUCTION.md), from outside the
    repository: the trainer gets vLLM rollout actors and the cluster's GPUs."""
    from rollout_bridge import ray_launch

    calls = []

    def record(cfg, **kw):
        calls.append((cfg, kw))
        return [{"reward/mean": 0.5, "timing/sync_s": 1.0}]

    monkeypatch.setattr(ray_launch, "launch", record)
    monkeypatch.chdir(tmp_path)
    argv = ["--address=auto", f"--gin_file={EXP1}", f"--output_dir={tmp_path / 'run'}"]
    argv += [f"--gin_param={p}" for p in local_paths]
    assert _script("launch_ray").main(argv) == 0
    (cfg, kw), = calls
    assert cfg.rollout_engine == "vllm" and kw["rollout_engine"] == "vllm"
    assert kw["gpus_per_actor"] is None and kw["address"] == "auto"
    assert "train.rollout_engine = 'vllm'" in kw["gin_config"] or 'train.rollout_engine = "vllm"' in kw["gin_config"]
    assert "vllm rollout actor" in capsys.readouterr().out


def test_the_launcher_refuses_a_flag_that_contradicts_the_config(monkeypatch, tmp_path, local_paths, capsys):
    from rollout_bridge import ray_launch

    monkeypatch.setattr(ray_launch, "launch", lambda *a, **k: pytest.fail("launched despite the contradiction"))
    argv = [f"--gin_file={EXP1}", "--rollout_engine=jax", *[f"--gin_param={p}" for p in local_paths]]
    assert _script("launch_ray").main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--rollout_engine=jax" in err and "train.rollout_engine" in err


@pytest.mark.parametrize("nodes,bundles,strategy", [
    ([8], 2, "STRICT_PACK"), ([8], 3, "STRICT_PACK"), ([8, 8], 3, "PACK"), ([8, 8], 3, "STRICT_PACK"),
    ([8, 8, 4], 3, "STRICT_SPREAD"), ([1], 2, "STRICT_PACK"), ([1], 3, "PACK"), ([2, 1], 5, "PACK"),
    ([4], 1, "PACK"), ([], 2, "PACK"), ([0, 0], 2, "PACK"),
])
def test_auto_gpus_are_the_largest_even_split_that_places(nodes, bundles, strategy):
    from fp8rl_jax.trainer.launch import auto_gpus_per_bundle

    g = auto_gpus_per_bundle(nodes, bundles, strategy)
    usable = [max(nodes)] if strategy == "STRICT_PACK" and nodes else nodes

    def capacity(per):
        per_node = [math.floor(n / per + 1e-9) for n in usable if n > 0]
        return sum(min(1, k) if strategy == "STRICT_SPREAD" else k for k in per_node)

    if sum(nodes) == 0:
        assert g == 0.0
        return
    assert g > 0 and capacity(g) >= bundles  # the bundles fit
    if g >= 1:
        assert g == int(g) and capacity(g + 1) < bundles  # whole GPUs, and one more each would not fit
    else:  # fewer GPUs than bundles: the largest share 1/m of one GPU that fits, on Ray's 0.0001 grid
        m = round(1 / g)
        assert capacity(1) < bundles and g == math.floor(10_000 / m) / 10_000
        assert m == 2 or capacity(math.floor(10_000 / (m - 1)) / 10_000) < bundles


def test_auto_gpus_examples():
    from fp8rl_jax.trainer.launch import auto_gpus_per_bundle

    assert auto_gpus_per_bundle([8], 2, "STRICT_PACK") == 4.0  # trainer + 1 actor on one 8-GPU node
    assert auto_gpus_per_bundle([8, 8], 3, "STRICT_PACK") == 2.0  # shm: one node holds all three
    assert auto_gpus_per_bundle([8, 8], 3, "PACK") == 4.0  # dist: two on one node, one on the other
    assert auto_gpus_per_bundle([1], 2, "PACK") == 0.5
    assert auto_gpus_per_bundle([], 4, "PACK") == 0.0


def test_ray_launch_bindings_are_validated_naming_the_binding():
    from fp8rl_jax.trainer.launch import RayLaunchConfig

    with pytest.raises(ValueError, match="ray_launch.transport"):
        RayLaunchConfig(transport="nccl")
    with pytest.raises(ValueError, match="ray_launch.gpus_per_actor"):
        RayLaunchConfig(gpus_per_actor=-1)
    with pytest.raises(ValueError, match="ray_launch.num_rollout_actors"):
        RayLaunchConfig(num_rollout_actors=0)


# ---------------------------------------------------------------------------------------------------------------
# 2. includes from any working directory
# ---------------------------------------------------------------------------------------------------------------
def test_includes_resolve_from_outside_the_repository(monkeypatch, tmp_path):
    from fp8rl_jax.trainer.cli import config_from_gin_flags

    monkeypatch.chdir(tmp_path)
    # two levels: exp3_fp8_kv_small -> configs/quickstart_kv.gin -> configs/quickstart.gin (repository-root names)
    cfg, err = config_from_gin_flags(_args(os.path.join(ROOT, "configs", "paper", "exp3_fp8_kv_small.gin")))
    assert err is None and cfg.kv_cache_dtype == "fp8_e4m3" and cfg.num_steps == 5
    assert cfg.model == "smollm2-135m-instruct" and cfg.max_tokens == 16  # from quickstart.gin, two includes down
    # a user's file elsewhere: a sibling include (its own folder first), and a repository-root one
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "base.gin").write_text("train.num_steps = 7\n")
    (tmp_path / "mine" / "run.gin").write_text("include 'configs/quickstart.gin'\ninclude 'base.gin'\n"
                                               "train.learning_rate = 3e-5\n")
    monkeypatch.chdir(ROOT)  # the working directory does not matter either way
    cfg, err = config_from_gin_flags(_args(str(tmp_path / "mine" / "run.gin")))
    assert err is None and (cfg.num_steps, cfg.learning_rate, cfg.max_tokens) == (7, 3e-5, 16)


def test_the_including_files_folder_comes_before_the_root(tmp_path):
    from fp8rl_jax.trainer.cli import config_from_gin_flags

    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "quickstart.gin").write_text("train.num_steps = 99\n")  # shadows the repository's
    (tmp_path / "run.gin").write_text("include 'configs/quickstart.gin'\n")
    cfg, err = config_from_gin_flags(_args(str(tmp_path / "run.gin")))
    assert err is None and cfg.num_steps == 99


def test_an_include_that_names_no_file_fails_naming_both_paths(tmp_path):
    from fp8rl_jax.trainer.cli import config_from_gin_flags

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "inner.gin").write_text("include 'configs/nope.gin'\n")
    (tmp_path / "outer.gin").write_text("include 'a/inner.gin'\n")  # the failure is one include down
    cfg, err = config_from_gin_flags(_args(str(tmp_path / "outer.gin")))
    assert cfg is None and "\n" not in err
    assert os.path.join(str(tmp_path / "a"), "configs", "nope.gin") in err
    assert os.path.join(ROOT, "configs", "nope.gin") in err and "inner.gin" in err


def test_train_print_config_from_another_directory_resolves_includes(tmp_path):
    """The user's command, from outside the repository: the includes of exp3_fp8_kv_small.gin resolve."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train.py"), "--print_config",
                        f"--gin_file={os.path.join(ROOT, 'configs', 'paper', 'exp3_fp8_kv_small.gin')}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert re.search(r'^train\.kv_cache_dtype = "fp8_e4m3"  # default: "auto"$', out, re.M)  # quickstart_kv.gin
    assert re.search(r"^train\.max_tokens = 16  # default: 32$", out, re.M)  # quickstart.gin, two includes down
    from fp8rl_jax.trainer import TrainConfig

    for f in dataclasses.fields(TrainConfig):  # every field of the main namespace, with its default
        assert re.search(rf"^train\.{f.name} = ", out, re.M), f.name
    for ns in ("LossConfig", "RolloutCorrectionConfig", "ray_launch", "distributed", "mesh", "chain_sum_dataset",
               "prompt_file_dataset"):
        assert re.search(rf"^{ns}\.\w+ = ", out, re.M), ns


# ---------------------------------------------------------------------------------------------------------------
# 3. the paper configs' paths: one binding each, named when missing
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["exp1_dense_w8a8.gin", "exp2_moe_w8a8.gin", "exp5_fp8_e2e.gin"])
def test_paper_paths_are_one_binding_each(name, local_paths):
    from fp8rl_jax.trainer.cli import config_from_gin_flags, missing_path_error

    path = os.path.join(ROOT, "configs", "paper", name)
    cfg, err = config_from_gin_flags(_args(path))
    assert err is None and cfg.model.startswith("/models/")
    assert gin.query_parameter("prompt_file_dataset.path") is not None
    cfg, err = config_from_gin_flags(_args(path, params=local_paths))
    model, prompts = (p.split("=", 1)[1].strip('"') for p in local_paths)
    assert err is None and cfg.model == model
    from fp8rl_jax.trainer.launch import resolve_macro

    assert resolve_macro(gin.query_parameter("prompt_file_dataset.path")) == prompts
    assert missing_path_error(cfg) is None


def test_a_missing_paper_path_names_the_binding_to_set(tmp_path):
    from fp8rl_jax.trainer.cli import config_from_gin_flags, missing_path_error

    gone = tmp_path / "gone"
    cfg, err = config_from_gin_flags(_args(EXP1, params=[f'MODEL_DIR="{gone}/Qwen3-8B-Base"',
                                                         f'PROMPT_FILE="{gone}/dapo.parquet"']))
    assert err is None
    msg = missing_path_error(cfg)
    assert "\n" not in msg
    assert f"{gone}/Qwen3-8B-Base" in msg and "set MODEL_DIR" in msg
    assert f"{gone}/dapo.parquet" in msg and "set PROMPT_FILE" in msg
    # bound directly (no macro): the binding itself is named
    cfg, _ = config_from_gin_flags(_args(EXP1, params=[f'train.model="{gone}/m"', f'PROMPT_FILE="{gone}/p"']))
    assert "set train.model" in missing_path_error(cfg)
    # packaged and relative (hub-style) names are not paths to check here
    cfg, _ = config_from_gin_flags(_args(os.path.join(ROOT, "configs", "quickstart.gin")))
    assert missing_path_error(cfg) is None


def test_train_stops_at_once_naming_the_binding(tmp_path):
    r = subprocess.run([sys.executable, "scripts/train.py", f"--gin_file={EXP1}",
                        f"--gin_param=MODEL_DIR=\"{tmp_path}/no_model\"", f"--output_dir={tmp_path / 'run'}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "MODEL_DIR" in err[0] and f"{tmp_path}/no_model" in err[0]
    assert not (tmp_path / "run").exists()  # before any work


# ---------------------------------------------------------------------------------------------------------------
# 4. help texts
# ---------------------------------------------------------------------------------------------------------------
def _example_lines(path):
    """The continued command lines of a script's docstring as written in the file (`... \\` + next line)."""
    text = open(path).read()
    doc = text.split('"""', 2)[1]
    lines = doc.splitlines()
    return [(a.rstrip(), b.rstrip()) for a, b in zip(lines, lines[1:]) if a.rstrip().endswith("\\")]


@pytest.mark.parametrize("script", ["launch_ray", "plan", "train"])
def test_help_prints_the_examples_intact(script):
    path = os.path.join(ROOT, "scripts", f"{script}.py")
    r = subprocess.run([sys.executable, path, "--help"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    pairs = _example_lines(path)
    if script != "train":
        assert pairs, "the docstring has multi-line examples"
    for first, second in pairs:  # each continued line is printed as written, ending in one backslash,
        assert first in out and second in out, (first, second)  # and its continuation on the next line
        assert out[out.index(first) + 1] == second
        assert first.endswith(" \\") and not first.endswith("\\\\")
    for line in out:
        assert "   --" not in line.strip() or line.lstrip().startswith("--"), line  # no two lines run together


@pytest.mark.parametrize("script", ["launch_ray", "train"])
def test_help_points_to_print_config(script):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", f"{script}.py"), "--help"],
                       capture_output=True, text=True, timeout=300)
    assert "--print_config" in r.stdout and "every bindable" in r.stdout


def test_launch_ray_print_config_shows_the_flags_as_bindings(capsys):
    assert _script("launch_ray").main(["--print_config", f"--gin_file={EXP1}", "--gpus_per_actor=2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^ray_launch\.gpus_per_actor = 2\.0  # default: None$", out, re.M)
    assert re.search(r'^train\.rollout_engine = "vllm"  # default: "jax"$', out, re.M)
    assert re.search(r"^train\.model = %MODEL_DIR  # default: ", out, re.M)
    assert re.search(r"^MODEL_DIR = ", out, re.M)
