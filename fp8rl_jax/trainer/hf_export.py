"""Export trained weights as an HF model directory that ``transformers`` and vLLM load.

Formats:

* ``"bf16"`` / ``"float32"``: every parameter in that dtype (``config.json`` ``torch_dtype`` set accordingly).
* ``"fp8"``: the blockwise FP8 checkpoint layout of DeepSeek-V3 / Qwen3-FP8 releases: every decoder-layer
  linear ``...{q,k,v,o,gate,up,down}_proj.weight`` that both loaders can read as 128x128 blockwise FP8 is
  ``float8_e4m3fn`` ``[out, in]`` plus ``..._proj.weight_scale_inv`` float32 ``[ceil(out/128), ceil(in/128)]``
  (``W ~= weight * scale_inv`` blockwise); embeddings, norms, biases, ``lm_head`` and the linears that cannot be
  blockwise FP8 (:func:`fp8rl_jax.export.fp8_unloadable_linears`: a dim above 128 that is not a multiple of 128
  for transformers, a q/k/v or gate/up shard whose rows are not a multiple of 128 for vLLM, and the rest of that
  vLLM fused layer) are bf16. ``config.json`` carries ``quantization_config = {"quant_method": "fp8", "fmt":
  "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128], "modules_to_not_convert": [...],
  "ignored_layers": [...]}``: the keys vLLM's ``Fp8Config.from_config`` reads (``quant_method``,
  ``activation_scheme``, ``weight_block_size``, ``ignored_layers``, exact module names, checked per shard of a
  fused layer by ``is_layer_skipped``) and transformers' ``FineGrainedFP8Config`` reads (``modules_to_not_convert``;
  ``lm_head`` is listed because an explicit list replaces transformers' default skip of the output embedding).
  Both lists are the same: ``["lm_head", <bf16 linears>]``.

Files: ``model.safetensors`` (or shards + ``model.safetensors.index.json``) with header metadata
``{"format": "pt"}`` and the mode of a normally created file (``0666 & ~umask``), ``config.json``, tokenizer files.

The quantization is :func:`fp8rl_jax.export.export_weights` (the same one the per-step rollout sync uses).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

HF_EXPORT_FORMATS = ("bf16", "float32", "fp8")


def fp8_quantization_config(block_size: int = 128, not_converted: list[str] | None = None) -> dict[str, Any]:
    """``config.json`` ``quantization_config`` of a blockwise FP8 (e4m3, dynamic activations) checkpoint.

    Args:
      block_size: weight block edge.
      not_converted: module names stored unquantized (bf16); when given, written as both
        ``modules_to_not_convert`` (transformers) and ``ignored_layers`` (vLLM), ``lm_head`` first. None: neither
        key (every decoder linear FP8, as for :func:`rollout_bridge.vllm_engine.write_vllm_config_dir`).
    """
    q: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                         "weight_block_size": [block_size, block_size]}
    if not_converted is not None:
        names = ["lm_head"] + sorted(set(not_converted) - {"lm_head"})
        q["modules_to_not_convert"] = names
        q["ignored_layers"] = list(names)
    return q


def bf16_fallback_summary(kept: dict[str, str], n_kept: int, n_total: int, block_size: int = 128) -> str:
    """One line naming the linears an FP8 export keeps in bf16 and why.

    Args:
      kept: ``{module: reason}`` from :func:`fp8rl_jax.export.fp8_unloadable_linears`.
      n_kept / n_total: linear weights kept in bf16 / eligible for FP8 (for the count in the message).
      block_size: FP8 weight block edge.

    Returns:
      the line (layers with the same projection and reason merged: ``self_attn.k_proj [layers 0-29] (...)``), or
      ``""`` when nothing is kept.
    """
    import re

    if not kept:
        return ""
    by_module: dict[tuple[str, str], list[int]] = {}
    for module, why in kept.items():
        m = re.match(r"^model\.layers\.(\d+)\.(.+)$", module)
        layer, part = (int(m.group(1)), m.group(2)) if m else (-1, module)
        by_module.setdefault((part, why), []).append(layer)

    def spans(layers: list[int]) -> str:
        layers, out, i = sorted(layers), [], 0
        while i < len(layers):
            j = i
            while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1:
                j += 1
            out.append(str(layers[i]) if i == j else f"{layers[i]}-{layers[j]}")
            i = j + 1
        return ",".join(out)

    by_reason: dict[tuple[str, str], list[str]] = {}  # (layers, why) -> projections
    for (part, why), layers in by_module.items():
        by_reason.setdefault((spans(layers), why), []).append(part)
    parts = [f"{', '.join(ps)} in layers {ls} ({why})" for (ls, why), ps in by_reason.items()]
    return (f"fp8 export: kept {n_kept} of {n_total} linear weights in bf16 so that transformers and vLLM load the "
            f"directory (config.json quantization_config lists them as modules_to_not_convert and ignored_layers): "
            + "; ".join(parts))


def export_hf_dir(path: str, model_config, params: dict[str, Any], *, fmt: str = "bf16", tokenizer=None,
                  block_size: int = 128, max_shard_bytes: int | None = None, log=None) -> str:
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
      log: ``callable(str)`` (e.g. ``print``) that receives :func:`bf16_fallback_summary`'s one line when an FP8
        export keeps linears in bf16.

    Returns:
      ``path``.

    Raises:
      ValueError: unknown ``fmt``; non-finite weights (named, from the export).
    """
    from fp8rl_jax.export import export_weights, fp8_unloadable_linears, is_quantized_linear
    from fp8rl_jax.models.hf_io import save_hf_dir
    from fp8rl_jax.rollout.engine import ENGINE_PRECISIONS

    if fmt not in HF_EXPORT_FORMATS:
        raise ValueError(f"unknown HF export format {fmt!r}; expected one of {HF_EXPORT_FORMATS}")
    scalars = {k: v for k, v in params.items() if np.ndim(v) == 0}  # e.g. kv scales: not quantized
    kept = fp8_unloadable_linears({k: np.shape(v) for k, v in params.items()}, block_size) if fmt == "fp8" else {}
    tensors = export_weights({k: v for k, v in params.items() if k not in scalars},
                             ENGINE_PRECISIONS[fmt][2],  # the export format of that rollout precision
                             block_size=block_size, unquantized=tuple(kept)).tensors
    out = {k: np.asarray(v) for k, v in tensors.items()}
    out.update({k: np.asarray(v, np.float32).reshape(()) for k, v in scalars.items()})
    extra = {"torch_dtype": "float32" if fmt == "float32" else "bfloat16"}
    if fmt == "fp8":
        extra["quantization_config"] = fp8_quantization_config(block_size, not_converted=list(kept))
    save_hf_dir(path, model_config, out, max_shard_bytes=max_shard_bytes, extra_config=extra)
    if kept and log is not None:
        linear = [k for k in params if is_quantized_linear(k)]
        n_kept = sum(1 for k in linear if str(tensors[k].dtype) != "float8_e4m3fn")
        log(bf16_fallback_summary(kept, n_kept, len(linear), block_size))
    if tokenizer is not None:
        tokenizer.save(path)
    return path


def export_checkpoint_to_hf(checkpoint_dir: str, path: str, *, fmt: str = "bf16", step: int | None = None,
                            model: str | None = None, log=None) -> str:
    """Export the params of an orbax run checkpoint (``<run>/checkpoints``) as an HF directory.

    Args:
      checkpoint_dir: the run's checkpoint root (or the run directory holding ``checkpoints/``).
      path: output HF directory.
      fmt: see :func:`export_hf_dir`.
      step: checkpoint step (default: latest).
      model: the model source the run started from (default: the one recorded in the checkpoint); gives the
        architecture and the tokenizer.
      log: see :func:`export_hf_dir`.

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
    return export_hf_dir(path, cfg, named_params(m), fmt=fmt, tokenizer=tok, log=log)
