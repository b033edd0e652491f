"""Logits of the Flax decoder vs HF ``transformers`` (torch, CPU, float32) on the same weights."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_hf_model
from fp8rl_jax.models.config import ModelConfig, hf_param_shapes
from fp8rl_jax.models.decoder import left_pad, named_params, positions_from_mask
from fp8rl_jax.models.hf_io import load_hf_dir, save_hf_dir
from fp8rl_jax.models.loading import build_model

torch = pytest.importorskip("torch", reason="needs the [test] extra (torch)")


@pytest.mark.parametrize("arch,tie", [("llama", True), ("llama", False), ("qwen2", False), ("qwen3", True)])
def test_logits_match_transformers(tmp_path, arch, tie):
    hf = make_hf_model(arch, tie=tie)
    hf.save_pretrained(tmp_path)
    cfg, params, _ = load_hf_dir(str(tmp_path))
    assert cfg.model_type == arch and cfg.tie_word_embeddings == tie
    assert cfg.attention_bias == (arch == "qwen2") and cfg.qk_norm == (arch == "qwen3")
    assert set(hf_param_shapes(cfg)) == {k for k in params if not (tie and k == "lm_head.weight")}
    model = build_model(cfg, params)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 17))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    out = np.asarray(model(jnp.asarray(ids)))
    assert np.abs(out - ref).max() < 1e-4


def test_left_padding_matches_unpadded_rows(tmp_path):
    """A left-padded batch computes, per row, what that row computes alone (transformers as reference)."""
    hf = make_hf_model("qwen3")
    hf.save_pretrained(tmp_path)
    cfg, params, _ = load_hf_dir(str(tmp_path))
    model = build_model(cfg, params)
    rows = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    ids, mask = left_pad(rows, pad_id=0, bucket=8)
    out = np.asarray(model(jnp.asarray(ids), positions_from_mask(jnp.asarray(mask)), jnp.asarray(mask)))
    for i, r in enumerate(rows):
        with torch.no_grad():
            ref = hf(torch.tensor([r])).logits.numpy()[0]
        assert np.abs(out[i, -len(r):] - ref).max() < 1e-4


def test_rope_theta_from_rope_parameters():
    """transformers 5.x keeps rope_theta under rope_parameters; 4.x at top level: both read the same."""
    base = dict(model_type="qwen3", vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=4)
    a = ModelConfig.from_hf_dict({**base, "rope_theta": 12345.0})
    b = ModelConfig.from_hf_dict({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 12345.0}})
    assert a.rope_theta == b.rope_theta == 12345.0 and b.rope_scaling is None


def test_hf_dir_round_trip_sharded(tmp_path):
    hf = make_hf_model("qwen2")
    hf.save_pretrained(tmp_path / "src")
    cfg, params, _ = load_hf_dir(str(tmp_path / "src"))
    model = build_model(cfg, params)
    save_hf_dir(str(tmp_path / "out"), cfg, named_params(model), max_shard_bytes=50_000)
    files = os.listdir(tmp_path / "out")
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1
    # transformers itself loads what we wrote, with the same logits
    import transformers

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, hf(ids).logits, atol=1e-5)
    with open(tmp_path / "out" / "model.safetensors.index.json") as f:
        assert set(json.load(f)["weight_map"]) == set(named_params(model))


@pytest.mark.slow
def test_smollm2_gguf_logits_match_transformers_gguf_loader():
    """SmolLM2-135M from the packaged GGUF: our loader + model vs transformers' own GGUF loader."""
    pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate ([test] extra)")
    import transformers

    from fp8rl_jax.assets import smollm2_gguf_path
    from fp8rl_jax.models.gguf_io import load_gguf

    path = smollm2_gguf_path()
    cfg, params = load_gguf(path)
    model = build_model(cfg, params)
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                           dtype=torch.float32).eval()
    ids = np.array([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 2, 198, 1, 4093, 198, 36, 1848, 216, 37, 446]])
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    out = np.asarray(model(jnp.asarray(ids)))
    # 30 float32 layers: transformers' own float32 logits differ from its float64 run by ~9e-5 here, so the
    # two float32 implementations agree to the float32 rounding floor (~1.2e-4 absolute on logits of
    # magnitude ~30, i.e. < 1e-5 relative), not to 1e-4 absolute.
    assert np.abs(out - ref).max() < 2e-4
    assert np.abs(out - ref).max() / np.abs(ref).max() < 1e-5
    assert (out.argmax(-1) == ref.argmax(-1)).all()
