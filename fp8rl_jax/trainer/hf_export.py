"""Export trained weights as an HF model directory that ``transformers`` and vLLM load.

Formats:

* ``"bf16"`` / ``"float32"``: every parameter in that dtype (``config.json`` ``torch_dtype`` set accordingly).
* ``"fp8"``: the blockwise FP8 checkpoint layout of DeepSeek-V3 / Qwen3-FP8 releases: every decoder-layer
  linear ``...{q,k,v,o,gate,up,down}_proj.weight`` as ``float8_e4m3fn`` ``[out, in]`` plus
  ``..._proj.weight_scale_inv`` float32 ``[ceil(out/128), ceil(in/128)]`` (``W ~= weight * scale_inv``
  blockwise); embeddings, norms, biases and ``lm_head`` in bf16; ``config.json`` carries
  ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
  "weight_block_size": [128, 128]}``, the keys vLLM's ``Fp8Config.from_config`` reads (``quant_method``,
  ``activation_scheme``, ``weight_block_size``) and transformers' ``FineGrainedFP8Config`` accepts.

The quantization is :func:`fp8rl_jax.export.export_weights` (the same one the per-step rollout sync uses).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

HF_EXPORT_FORMATS = ("bf16", "float32", "fp8")


def fp8_quantization_config(block_size: int = 128) -> dict[str, Any]:
    """``config.json`` ``quantization_config`` of a blockwise FP8 (e4m3, dynamic activations) checkpoint."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [block_size, block_size]}


def export_hf_dir(path: str, model_config, params: dict[str, Any], *, fmt: str = "bf16", tokenizer=None,
                  block_size: int = 128, max_shard_bytes: int | None = None) -> str:
    """Write ``config.json`` + safetensors (+ tokenizer files) for HF-named params.

    Args:
      path: output directory (created).
      model_config: the :class:`fp8rl_jax.models.config.ModelConfig`.
      params: ``{hf_name: array}`` (float32/bf16 masters, e.g. ``named_params(model)``); extra tensors such as
        ``...self_attn.k_scale`` pass through in float32.
      fmt: ``"bf16"``, ``"float32"`` or ``"fp8"`` (see module docstring).
      tokenizer: a :class:`fp8rl_jax.models.tokenizer.Tokenizer` to save beside the weights (optional).
      block_size: FP8 weight block edge (128).
      max_shard_bytes: shard the safetensors (HF index) above this size.

    Returns:
      ``path``.

    Raises:
      ValueError: unknown ``fmt``; non-finite weights (named, from the export).
    """
    from fp8rl_jax.export import export_weights
    from fp8rl_jax.models.hf_io import save_hf_dir
    from fp8rl_jax.rollout.engine import ENGINE_PRECISIONS

    if fmt not in HF_EXPORT_FORMATS:
        raise ValueError(f"unknown HF export format {fmt!r}; expected one of {HF_EXPORT_FORMATS}")
    scalars = {k: v for k, v in params.items() if np.ndim(v) == 0}  # e.g. kv scales: not quantized
    tensors = export_weights({k: v for k, v in params.items() if k not in scalars},
                             ENGINE_PRECISIONS[fmt][2],  # the export format of that rollout precision
                             block_size=block_size).tensors
    out = {k: np.asarray(v) for k, v in tensors.items()}
    out.update({k: np.asarray(v, np.float32).reshape(()) for k, v in scalars.items()})
    extra = {"torch_dtype": "float32" if fmt == "float32" else "bfloat16"}
    if fmt == "fp8":
        extra["quantization_config"] = fp8_quantization_config(block_size)
    save_hf_dir(path, model_config, out, max_shard_bytes=max_shard_bytes, extra_config=extra)
    if tokenizer is not None:
        tokenizer.save(path)
    return path


def export_checkpoint_to_hf(checkpoint_dir: str, path: str, *, fmt: str = "bf16", step: int | None = None,
                            model: str | None = None) -> str:
    """Export the params of an orbax run checkpoint (``<run>/checkpoints``) as an HF directory.

    Args:
      checkpoint_dir: the run's checkpoint root (or the run directory holding ``checkpoints/``).
      path: output HF directory.
      fmt: see :func:`export_hf_dir`.
      step: checkpoint step (default: latest).
      model: the model source the run started from (default: the one recorded in the checkpoint); gives the
        architecture and the tokenizer.

    Returns:
      ``path``.

    Raises:
      CheckpointNotFoundError / FileNotFoundError: no checkpoint, or missing files (named).
      ValueError: the checkpoint does not fit the model's architecture.
    """
    from fp8rl_jax.models.decoder import named_params
    from fp8rl_jax.models.loading import build_model, load_checkpoint, load_tokenizer_for
    from fp8rl_jax.trainer.checkpoint import CheckpointStore, load_model_state, model_state

    if os.path.isdir(os.path.join(checkpoint_dir, "checkpoints")):
        checkpoint_dir = os.path.join(checkpoint_dir, "checkpoints")
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"checkpoint directory not found: {checkpoint_dir}")
    store = CheckpointStore(checkpoint_dir)
    try:
        _, meta = store.restore(step, items=())
        source = model or meta.get("model")
        if not source:
            raise ValueError(f"checkpoint in {checkpoint_dir} does not record its model; pass model=")
        cfg, params = load_checkpoint(source)
        m = build_model(cfg, params)
        del params
        state, _ = store.restore(step, {"params": model_state(m)}, items=("params",))
    finally:
        store.close()
    load_model_state(m, state["params"])
    try:
        tok = load_tokenizer_for(source)
    except FileNotFoundError:
        tok = None
    return export_hf_dir(path, cfg, named_params(m), fmt=fmt, tokenizer=tok)
