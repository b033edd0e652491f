"""FP8 numerics: e4m3 formats, blockwise quantization (weights 128x128, activations 1x128), W8A8 matmul.

Modules (the numerics contract): ``formats`` (constants, :class:`QuantRecipe` presets matching vLLM, exact rounding
helpers), ``quant`` (jnp reference quantizers), ``kv_cache`` (FP8 KV-cache scales), ``linear`` (W8A8 matmul on
pre-quantized weights), ``dot_general`` (FP8 ``dot_general`` for Flax layers; picks a kernel per product through
:func:`fp8rl_jax.kernels.registry.choose`), ``training`` (custom VJP for FP8 training). The GPU kernels themselves
live in :mod:`fp8rl_jax.kernels`. See docs/FP8.md.

The names below are imported on first use (PEP 562), so importing a submodule of :mod:`fp8rl_jax.fp8` (as every
kernel module imports ``formats``) does not import the modules that choose kernels; that keeps the imports one-way:
``fp8.formats`` / ``fp8.quant`` <- ``kernels.*`` <- ``fp8.dot_general`` / ``fp8.linear`` / ``fp8.training``.
``quantize_weights_batched`` and the two ``pallas_quantize_*`` functions stay importable from here (they are
:mod:`fp8rl_jax.kernels.pallas_quant`'s).
"""

from __future__ import annotations

import importlib

from fp8rl_jax.fp8.formats import (ACTIVATION_RECIPE, BLOCK_SIZE, CONTRACT, E4M3, E4M3_MAX, E5M2, E5M2_MAX,
                                   VLLM_BLOCK_CAST, VLLM_GROUP_NATIVE, VLLM_GROUP_TRITON, VLLM_TENSOR_NATIVE,
                                   WEIGHT_RECIPE, QuantRecipe, ceil_pow2, compute_scale, fp8_dtype)
from fp8rl_jax.fp8.quant import (
    check_finite,
    dequantize_activation_groupwise,
    dequantize_weight_blockwise,
    fake_quantize_activation,
    quantize_activation_groupwise,
    quantize_per_tensor,
    quantize_per_token,
    quantize_weight_blockwise,
)

#: name -> the module it is imported from on first use
_LAZY = {
    **dict.fromkeys(("Fp8DotConfig", "make_fp8_dot_general", "fp8_block_dot_general", "fp8_tensor_dot_general",
                     "fp8_einsum"), "fp8rl_jax.fp8.dot_general"),
    "w8a8_block_matmul": "fp8rl_jax.fp8.linear",
    **dict.fromkeys(("make_fp8_train_dot_general", "dot_general_for_precision"), "fp8rl_jax.fp8.training"),
    **dict.fromkeys(("pallas_quantize_weight_blockwise", "pallas_quantize_activation_groupwise",
                     "quantize_weights_batched"), "fp8rl_jax.kernels.pallas_quant"),
}


def __getattr__(name: str):
    """PEP 562: import :data:`_LAZY`'s names on first use. Raises AttributeError for any other name."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "BLOCK_SIZE", "E4M3", "E4M3_MAX", "E5M2", "E5M2_MAX", "compute_scale", "ceil_pow2", "fp8_dtype", "QuantRecipe",
    "VLLM_BLOCK_CAST", "VLLM_GROUP_NATIVE", "VLLM_GROUP_TRITON", "VLLM_TENSOR_NATIVE", "CONTRACT",
    "WEIGHT_RECIPE", "ACTIVATION_RECIPE",
    "w8a8_block_matmul", "check_finite",
    "dequantize_activation_groupwise", "dequantize_weight_blockwise", "fake_quantize_activation",
    "quantize_activation_groupwise", "quantize_weight_blockwise", "quantize_per_tensor", "quantize_per_token",
    "pallas_quantize_weight_blockwise", "pallas_quantize_activation_groupwise", "quantize_weights_batched",
    "Fp8DotConfig", "make_fp8_dot_general", "fp8_block_dot_general", "fp8_tensor_dot_general", "fp8_einsum",
    "make_fp8_train_dot_general", "dot_general_for_precision",
]
