"""FP8 numerics: e4m3 formats, blockwise quantization (weights 128x128, activations 1x128), W8A8 matmul.

Modules: ``formats`` (constants, :class:`QuantRecipe` presets matching vLLM, exact rounding helpers),
``quant`` (jnp reference), ``pallas_quant`` (Pallas kernels + batched dispatcher), ``linear`` (W8A8 matmul on
pre-quantized weights), ``dot_general`` (FP8 ``dot_general`` for Flax layers), ``pallas_gemm`` (fused W8A8
GEMM), ``training`` (custom VJP for FP8 training). See docs/FP8.md.
"""

from fp8rl_jax.fp8.dot_general import (Fp8DotConfig, fp8_block_dot_general, fp8_einsum, fp8_tensor_dot_general,
                                       make_fp8_dot_general)
from fp8rl_jax.fp8.formats import (ACTIVATION_RECIPE, BLOCK_SIZE, CONTRACT, E4M3, E4M3_MAX, E5M2, E5M2_MAX,
                                   VLLM_BLOCK_CAST, VLLM_GROUP_NATIVE, VLLM_GROUP_TRITON, VLLM_TENSOR_NATIVE,
                                   WEIGHT_RECIPE, QuantRecipe, ceil_pow2, compute_scale, fp8_dtype)
from fp8rl_jax.fp8.linear import w8a8_block_matmul
from fp8rl_jax.fp8.pallas_quant import (pallas_quantize_activation_groupwise, pallas_quantize_weight_blockwise,
                                        quantize_weights_batched)
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
from fp8rl_jax.fp8.training import dot_general_for_precision, make_fp8_train_dot_general

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
