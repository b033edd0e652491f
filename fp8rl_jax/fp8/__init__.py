"""FP8 numerics: e4m3 formats, blockwise quantization (weights 128x128, activations 1x128), W8A8 matmul."""

from fp8rl_jax.fp8.formats import BLOCK_SIZE, E4M3, E4M3_MAX, compute_scale, fp8_dtype
from fp8rl_jax.fp8.linear import w8a8_block_matmul
from fp8rl_jax.fp8.quant import (
    check_finite,
    dequantize_activation_groupwise,
    dequantize_weight_blockwise,
    fake_quantize_activation,
    quantize_activation_groupwise,
    quantize_weight_blockwise,
)

__all__ = [
    "BLOCK_SIZE", "E4M3", "E4M3_MAX", "compute_scale", "fp8_dtype", "w8a8_block_matmul", "check_finite",
    "dequantize_activation_groupwise", "dequantize_weight_blockwise", "fake_quantize_activation",
    "quantize_activation_groupwise", "quantize_weight_blockwise",
]
