"""Models and tokenizers made in code: a run of the trainer with no downloaded asset (a GPU machine, CI).

:func:`byte_tokenizer` builds a byte-level BPE tokenizer with a ChatML chat template from nothing (259 ids, no
merges); :func:`tiny_qwen3_config` a small Qwen3 architecture; :func:`write_random_model_dir` writes both, with
random weights, as an HF model directory that ``train.model`` (and :func:`fp8rl_jax.models.loading.load_checkpoint`,
:func:`~fp8rl_jax.models.loading.load_tokenizer_for`) accept like any downloaded checkpoint. Nothing here reads a
file or the network; the same arguments give the same weights.

Needs the ``tokenizers`` and ``safetensors`` packages (already dependencies of the project); ``transformers`` is not
used.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from fp8rl_jax.models.config import ModelConfig, hf_param_shapes

#: special tokens of :func:`byte_tokenizer`, ids 0, 1, 2 (then the 256 byte symbols)
BYTE_SPECIALS = ("<pad>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

#: norm of the component every embedding row shares under :func:`random_hf_params`'s ``eos_bias`` (against the
#: rows' own ``0.02 * sqrt(256) = 0.32`` and what the random layers add to the residual stream)
SHARED_NORM = 8.0
#: :func:`tiny_qwen3_config`'s sizes: every linear dimension a multiple of 128, so the FP8 blockwise (128x128)
#: export and the GPU's W8A8 kernels see whole blocks, as at real model sizes
TINY_QWEN3 = dict(vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=True)


def byte_tokenizer():
    """A byte-level BPE tokenizer built in code: 259 ids (``<pad>`` = 0, ``<|im_start|>`` = 1, ``<|im_end|>`` = 2,
    the eos token; then GPT-2's 256 byte symbols, no merges, so every text encodes to one id per UTF-8 byte) with a
    ChatML chat template.

    Returns:
      a :class:`fp8rl_jax.models.tokenizer.Tokenizer` (save it with ``.save(directory)``).
    """
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    from fp8rl_jax.models.tokenizer import Tokenizer, _bytes_to_unicode

    vocab = {t: i for i, t in enumerate(BYTE_SPECIALS)}
    for ch in _bytes_to_unicode().values():
        vocab[ch] = len(vocab)
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True) for t in BYTE_SPECIALS])
    return Tokenizer(hf, chat_template=CHATML_TEMPLATE, eos_token="<|im_end|>", pad_token="<pad>")


def tiny_qwen3_config(**overrides: Any) -> ModelConfig:
    """A small Qwen3 (QK-norm, GQA, tied embeddings) for :func:`byte_tokenizer`'s ids: :data:`TINY_QWEN3` sizes
    (vocab 384 >= the tokenizer's 259 ids), eos 2, pad 0, bos 1, rope_theta 1e6; ``overrides`` are HF
    ``config.json`` keys (e.g. ``num_hidden_layers=4``, ``model_type="qwen3_moe"`` with its expert fields).

    Raises:
      ValueError: an override :class:`ModelConfig` rejects (the field named), or a vocabulary smaller than the
        tokenizer's 259 ids.
    """
    d = dict(model_type="qwen3", rope_theta=1e6, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             **TINY_QWEN3)
    d.update(overrides)
    if int(d["vocab_size"]) < len(BYTE_SPECIALS) + 256:
        raise ValueError(f"vocab_size={d['vocab_size']} is smaller than the byte tokenizer's "
                         f"{len(BYTE_SPECIALS) + 256} ids")
    return ModelConfig.from_hf_dict(d)


def random_hf_params(cfg: ModelConfig, seed: int = 0, std: float = 0.02,
                     eos_bias: float = 0.0) -> dict[str, np.ndarray]:
    """Random float32 weights of ``cfg`` under their HF names (:func:`fp8rl_jax.models.config.hf_param_shapes`):
    norm weights 1, every other tensor ``std * N(0, 1)`` from ``numpy.random.default_rng(seed)`` in sorted-name
    order (so the values depend on the seed and the architecture only).

    ``eos_bias`` (0 = none): make the model end its responses early and at varied lengths, so a trainer gets
    responses of different lengths (a reward signal under a length penalty) from a model that knows nothing. Every
    embedding row gets a shared component ``SHARED_NORM * u`` (``u`` a random unit vector drawn after the weights),
    which dominates the residual stream, so the final RMSNorm's output points mostly along ``u`` (norm up to
    ``sqrt(hidden)``); the output row of ``cfg.eos_token_id`` (the tied embedding, or ``lm_head``) gets
    ``eos_bias / sqrt(hidden)`` more along ``u``, which raises the eos logit at every position by a little less than
    ``eos_bias`` nats over the other tokens' (measured at :data:`TINY_QWEN3` sizes: 5.0 gives eos a probability of
    about 0.16 per token, 4.3 nats above the mean of the others; 0 gives 0.002, i.e. 1/vocab).

    Returns:
      ``{hf_name: float32 ndarray}`` (``[out, in]`` for linears, ``[vocab, hidden]`` for the embedding).

    Raises:
      ValueError: ``eos_bias`` without an ``eos_token_id`` in ``cfg``.
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in sorted(hf_param_shapes(cfg).items()):
        if name.endswith("norm.weight"):
            out[name] = np.ones(shape, np.float32)
        else:
            out[name] = (std * rng.standard_normal(shape)).astype(np.float32)
    if eos_bias:
        if not cfg.eos_token_ids:
            raise ValueError("eos_bias needs a config with an eos_token_id")
        u = rng.standard_normal(cfg.hidden_size)
        u = (u / np.linalg.norm(u)).astype(np.float32)
        out["model.embed_tokens.weight"] += SHARED_NORM * u
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        out[head][cfg.eos_token_ids[0]] += np.float32(eos_bias / np.sqrt(cfg.hidden_size)) * u
    return out


def write_random_model_dir(directory: str | os.PathLike, seed: int = 0, eos_bias: float = 0.0, **overrides: Any) -> str:
    """Write an HF model directory with a random-init :func:`tiny_qwen3_config` model and :func:`byte_tokenizer`:
    ``config.json``, ``model.safetensors`` (float32) and ``tokenizer.json`` + ``tokenizer_config.json``.

    Args:
      directory: created if needed; existing files of those names are replaced.
      seed, eos_bias: :func:`random_hf_params`'s.
      overrides: HF config keys for :func:`tiny_qwen3_config`.

    Returns:
      ``str(directory)``, usable as ``train.model``.

    Raises:
      ValueError: as :func:`tiny_qwen3_config`. OSError: the directory cannot be written.
    """
    from fp8rl_jax.models.hf_io import save_hf_dir

    directory = os.fspath(directory)
    cfg = tiny_qwen3_config(**overrides)
    save_hf_dir(directory, cfg, random_hf_params(cfg, seed, eos_bias=eos_bias))
    byte_tokenizer().save(directory)
    return directory
