"""Shared fixtures: tiny random HF checkpoints built offline with ``transformers`` (the reference)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)


def make_hf_model(arch: str, tie: bool = False, seed: int = 0, **overrides):
    """A random-weight ``transformers`` model (float32, eval mode) of the given family."""
    torch = pytest.importorskip("torch", reason="needs the [test] extra (torch)")
    transformers = pytest.importorskip("transformers", reason="needs the [test] extra (transformers)")
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[arch]
    kw = dict(TINY, tie_word_embeddings=tie, eos_token_id=3, bos_token_id=1, pad_token_id=0)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cls(**kw), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model


@pytest.fixture
def rng():
    return np.random.default_rng(0)
