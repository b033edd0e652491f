"""Architectures of the models the paper configs name (HF ``config.json`` values), for planning without weights.

``scripts/plan.py`` and the benchmarks build Qwen3-shaped models from these when the checkpoint directory a gin
config names (``/models/Qwen3-8B-Base``) is not on this machine. Values: the models' HF ``config.json``
(Qwen/Qwen3-0.6B, Qwen/Qwen3-8B, Qwen/Qwen3-30B-A3B; the -Base variants share them).
"""

from __future__ import annotations

import os

from fp8rl_jax.models.config import ModelConfig

#: name -> HF config values (``model_type`` defaults to ``qwen3``).
QWEN3 = {
    "0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "30b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                    num_attention_heads=32, num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
                    model_type="qwen3_moe", num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
}
_ALIASES = {"qwen3-0.6b": "0.6b", "qwen3-8b": "8b", "qwen3-30b-a3b": "30b-a3b"}


def qwen3_config(size: str) -> ModelConfig:
    """The :class:`ModelConfig` of a Qwen3 model: ``size`` is a key of :data:`QWEN3` (``"8b"``).

    Raises:
      KeyError: unknown size (the known ones named).
    """
    if size not in QWEN3:
        raise KeyError(f"unknown Qwen3 preset {size!r}; known: {sorted(QWEN3)}")
    kw = dict(QWEN3[size])
    return ModelConfig(model_type=kw.pop("model_type", "qwen3"), eos_token_id=1, pad_token_id=0,
                       max_position_embeddings=40960, rope_theta=1e6, **kw)


def preset_for(source: str) -> ModelConfig | None:
    """The preset architecture a model path or name stands for (``/models/Qwen3-8B-Base`` -> 8B), or None.

    Matches the last path component, case-insensitive, with an optional ``-Base`` / ``-Instruct`` suffix.
    """
    name = os.path.basename(os.path.normpath(source)).lower()
    for suffix in ("-base", "-instruct", "-fp8"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    key = _ALIASES.get(name)
    return qwen3_config(key) if key else None
