"""W8A8 blockwise FP8 matmul (weights 128x128, activations 1x128) as a plain function.

``y[m, n] = sum_kb (xq[m, kb] . wq[n, kb]) * xs[m, kb] * ws[n // 128, kb]`` with float32 accumulation
(DeepSeek-V3 / DeepGEMM / vLLM ``w8a8_block_fp8_matmul``). On CPU this is evaluated as
``dequant(xq) @ dequant(wq).T`` in float32, which is the same sum (only the order of fp32 additions differs).
"""

from __future__ import annotations

import jax.numpy as jnp

from fp8rl_jax.fp8.formats import BLOCK_SIZE
from fp8rl_jax.fp8.quant import dequantize_weight_blockwise, fake_quantize_activation


def w8a8_block_matmul(x: jnp.ndarray, weight: jnp.ndarray, weight_scale_inv: jnp.ndarray,
                      block_size: int = BLOCK_SIZE, out_dtype=None) -> jnp.ndarray:
    """FP8 W8A8 blockwise linear: ``x @ W.T`` with ``W = weight * weight_scale_inv`` blockwise.

    Args:
      x: ``[..., K]`` activations (float32/bfloat16); quantized here to e4m3 in 1 x ``block_size`` groups.
      weight: ``[N, K]`` e4m3 (vLLM layout).
      weight_scale_inv: float32 ``[ceil(N/bs), ceil(K/bs)]``.
      out_dtype: result dtype (default ``x.dtype``).

    Returns:
      ``[..., N]`` in ``out_dtype``; accumulated in float32.

    Raises:
      ValueError: ``x.shape[-1] != weight.shape[1]`` or a scale/weight mismatch.
    """
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"w8a8_block_matmul: x has K={x.shape[-1]} but weight is {tuple(weight.shape)} ([N, K])")
    out_dtype = out_dtype or x.dtype
    xd = fake_quantize_activation(x.astype(jnp.float32), block_size)
    wd = dequantize_weight_blockwise(weight, weight_scale_inv, block_size, out_dtype=jnp.float32)
    y = jnp.einsum("...k,nk->...n", xd, wd, preferred_element_type=jnp.float32)
    return y.astype(out_dtype)
