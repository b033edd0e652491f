"""Every shipped gin config parses, names only real bindings, and builds a valid TrainConfig; the paper-scale
configs carry the recipe published in verl's FP8 rollout report (docs/advance/fp8.md: Qwen3-8B-Base / Qwen3-30B-A3B
DAPO, prompt batch 32, n=16, 3 generation batches, max response 20K, token-level TIS C=2) and each experiment
differs from it only in what the experiment is about."""

from __future__ import annotations

import glob
import os

import gin
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PAPER = sorted(glob.glob(os.path.join(ROOT, "configs", "paper", "exp*.gin")))


def _config(path: str, *bindings: str):
    """(TrainConfig, LossConfig, RolloutCorrectionConfig) after parsing ``path`` as scripts/train.py does."""
    import fp8rl_jax.trainer  # noqa: F401  (registers the configurables)
    from fp8rl_jax import objectives
    from fp8rl_jax.trainer import TrainConfig

    gin.clear_config()
    gin.parse_config_files_and_bindings([path], list(bindings))
    try:
        loss = objectives.LossConfig()
        return TrainConfig(), loss, loss.rollout_correction
    finally:
        gin.clear_config()


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # gin `include` paths are relative to the repository root, as in the README


def test_every_experiment_has_a_paper_and_a_small_config():
    names = {os.path.basename(p) for p in PAPER}
    for i in range(1, 6):
        big = [n for n in names if n.startswith(f"exp{i}_") and not n.endswith("_small.gin")]
        assert len(big) == 1, f"experiment {i}: {big}"
        assert big[0].replace(".gin", "_small.gin") in names


@pytest.mark.parametrize("path", PAPER + sorted(glob.glob(os.path.join(ROOT, "configs", "*.gin"))),
                         ids=os.path.basename)
def test_config_parses_to_a_valid_train_config(path):
    cfg, loss, corr = _config(path)
    assert cfg.num_steps > 0 and cfg.prompts_per_step > 0 and cfg.samples_per_prompt > 1
    if os.path.basename(path).startswith("exp"):
        assert corr is not None and corr.rollout_is == "token" and float(corr.rollout_is_threshold) == 2.0


@pytest.mark.parametrize("path", [p for p in PAPER if not p.endswith("_small.gin")], ids=os.path.basename)
def test_paper_scale_configs_follow_the_published_dapo_recipe(path):
    cfg, loss, _ = _config(path)
    # verl docs/advance/fp8.md: prompt batch 32, n=16, rollout batch 32*3*16, max response 20K
    assert (cfg.prompts_per_step, cfg.samples_per_prompt, cfg.max_num_gen_batches) == (32, 16, 3)
    assert cfg.max_tokens == 20 * 1024 and cfg.filter_groups and cfg.reward == "math_verify"
    # DAPO clip-higher (Yu et al. 2025, eps_low 0.2, eps_high 0.28)
    assert (loss.clip_ratio_low, loss.clip_ratio_high) == (0.2, 0.28)
    assert cfg.rollout_engine == "vllm" and cfg.rollout_precision == "fp8"
    name = os.path.basename(path)
    expected = {"exp1": ("bf16", "auto", "Qwen3-8B"), "exp2": ("bf16", "auto", "Qwen3-30B-A3B"),
                "exp3": ("bf16", "fp8_e4m3", "Qwen3-8B"), "exp4": ("fp16", "auto", "Qwen3-8B"),
                "exp5": ("fp8", "auto", "Qwen3-30B-A3B")}[name[:4]]
    assert (cfg.train_precision, cfg.kv_cache_dtype) == expected[:2]
    assert expected[2] in cfg.model


def test_small_configs_differ_from_their_baseline_in_one_knob():
    """The small runs' documented comparison lines turn each experiment into its baseline."""
    small = {os.path.basename(p)[:4]: p for p in PAPER if p.endswith("_small.gin")}
    c, _, corr = _config(small["exp1"], "RolloutCorrectionConfig.rollout_is = None")
    assert corr is None or corr.rollout_is is None
    c3, _, _ = _config(small["exp3"])
    assert c3.kv_cache_dtype == "fp8_e4m3" and _config(small["exp3"], 'train.kv_cache_dtype="auto"')[0].kv_cache_dtype == "auto"
    c4, _, _ = _config(small["exp4"])
    c5, _, _ = _config(small["exp5"])
    assert (c4.train_precision, c5.train_precision) == ("fp16", "fp8")
    base = _config(small["exp4"], 'train.train_precision="bf16"')[0]
    assert base.train_precision == "bf16" and base.rollout_precision == c4.rollout_precision == "fp8"


def test_a_misspelled_binding_in_a_config_is_refused(tmp_path):
    bad = tmp_path / "bad.gin"
    bad.write_text("include 'configs/paper/exp1_dense_w8a8_small.gin'\ntrain.num_stepz = 3\n")
    with pytest.raises(ValueError, match="num_stepz"):
        _config(str(bad))
