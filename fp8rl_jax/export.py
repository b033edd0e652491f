"""Per-step weight export in checkpoint layout (HF/vLLM names), FP8 blockwise or dense.

``export_weights`` turns the trainer's HF-named params into :class:`ExportedWeights`: every linear weight of a
decoder layer (``q/k/v/o_proj``, ``gate/up/down_proj``) becomes e4m3 ``weight`` ``[out, in]`` plus float32
``weight_scale_inv`` ``[ceil(out/128), ceil(in/128)]`` (vLLM's blockwise FP8 checkpoint format, as in
DeepSeek-V3 / Qwen3-FP8 checkpoints); embeddings, norms, biases and ``lm_head`` stay in ``dense_dtype``
(verl/vLLM keep them unquantized). The whole export is one jitted XLA program: the linear weights are
grouped by shape and each group is quantized by one :func:`fp8rl_jax.fp8.quantize_weights_batched` call (a
Pallas kernel on GPU), bit-identical to quantizing them one at a time.

With ``kv_scales`` the per-layer FP8 attention scales ride along under vLLM's checkpoint names
``model.layers.{i}.self_attn.{k,v,q}_scale`` (float32 scalars; vLLM's loader maps them to
``...self_attn.attn.{k,v,q}_scale``), tagged with ``metadata["kv_scales_version"]``.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp

from fp8rl_jax.fp8 import BLOCK_SIZE, quantize_weights_batched
from fp8rl_jax.fp8.kv_cache import KVScales
from fp8rl_jax.rollout.types import ExportedWeights

EXPORT_FORMATS = ("fp8_blockwise", "bf16", "float32")
_LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj"
                     r"|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)\.weight$")


def is_quantized_linear(name: str) -> bool:
    """True for the decoder-layer linear weights that FP8 export quantizes (HF names).

    Attention projections, dense MLP projections and Qwen3-MoE expert projections
    (``model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight``, vLLM's per-expert checkpoint names) are
    quantized; the MoE router ``mlp.gate.weight``, embeddings, norms and ``lm_head`` are not (verl keeps the
    router in its FP8 ``ignored_layers``).
    """
    return bool(_LINEAR.match(name))


@jax.jit
def _finite_flags(params: dict) -> dict:
    # Module-level so the trainer's per-step export reuses one compiled program (a fresh jit(lambda) per
    # call recompiled every step).
    return {k: jnp.all(jnp.isfinite(v)) for k, v in params.items()}


@functools.partial(jax.jit, static_argnames=("fmt", "block_size", "ue8m0"))
def _export(params: dict, fmt: str, block_size: int, ue8m0: bool) -> dict:
    out = {}
    dense = jnp.float32 if fmt == "float32" else jnp.bfloat16
    quantized = {}
    if fmt == "fp8_blockwise":
        linears = {name: w for name, w in params.items() if is_quantized_linear(name)}
        # one quantization call per distinct (shape, dtype): e.g. all layers' q_proj stacked together
        quantized = quantize_weights_batched(linears, block_size, ue8m0, check=False) if linears else {}
    for name, w in params.items():
        if name in quantized:
            out[name], out[name + "_scale_inv"] = quantized[name]
        else:
            out[name] = w.astype(dense)
    return out


def export_weights(params: dict, fmt: str = "fp8_blockwise", *, block_size: int = BLOCK_SIZE, ue8m0: bool = False,
                   version: int = 0, check_finite: bool = True, kv_scales: KVScales | None = None,
                   kv_scales_version: int | None = None) -> ExportedWeights:
    """Export HF-named params for a rollout engine.

    Args:
      params: ``{hf_name: array}`` (the trainer's float32/bf16 params, e.g. ``named_params(model)``).
      fmt: ``"fp8_blockwise"`` | ``"bf16"`` | ``"float32"``.
      block_size: FP8 weight block edge (128).
      ue8m0: power-of-two scales.
      version: weights version recorded in the result (the trainer step).
      check_finite: refuse to export NaN/inf weights (one fused reduction; names the first bad tensor).
      kv_scales: per-layer FP8 KV-cache / attention scales (:class:`fp8rl_jax.fp8.kv_cache.KVScales`) to ship
        with the weights as ``model.layers.{i}.self_attn.{k,v,q}_scale`` float32 scalars.
      kv_scales_version: the weights version the scales were calibrated for (default ``version``); an engine
        refuses to generate from an FP8 cache whose scales are older than its weights.

    Returns:
      :class:`ExportedWeights` (device arrays; no host copy).

    Raises:
      ValueError: unknown ``fmt``, or a non-finite weight (named).
    """
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; expected one of {EXPORT_FORMATS}")
    if check_finite:
        finite = jax.device_get(_finite_flags(dict(params)))
        bad = [k for k, ok in finite.items() if not ok]
        if bad:
            raise ValueError(f"refusing to export non-finite weights: {bad[:5]} contain NaN or inf")
    tensors = _export(dict(params), fmt, block_size, ue8m0)
    metadata = {"ue8m0": ue8m0}
    if kv_scales is not None:
        scale_tensors = kv_scales.to_tensors()
        clash = sorted(set(scale_tensors) & set(tensors))
        if clash:
            raise ValueError(f"kv scale names clash with params: {clash[:5]}")
        tensors.update({k: jnp.asarray(v, jnp.float32) for k, v in scale_tensors.items()})
        metadata["kv_scales_version"] = int(version if kv_scales_version is None else kv_scales_version)
    return ExportedWeights(tensors=tensors, format=fmt, block_size=block_size, version=version,
                           metadata=metadata)
