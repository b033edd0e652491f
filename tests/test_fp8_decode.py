"""The fused small-M W8A8 kernel (issue 21): activation quantization inside the kernel, split-K.

Numerics in interpret mode against (a) the unfused path (group quantization, then the tiled Pallas GEMM): bit
for bit with ``splits=1``, and (b) an independent float64 numpy reference of vLLM's blockwise W8A8 product
(tests/fp8_numpy_ref.py + ml_dtypes, no fp8rl_jax code) for every split; and the kernel's CUDA lowering (one Triton
launch, grid (N/bn, splits), e4m3 ``tt.dot``, exact division), checked without a GPU.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8_numpy_ref as ref
from fp8rl_jax.fp8 import formats, quantize_activation_groupwise
from fp8rl_jax.kernels.pallas_decode import choose_splits, fused_w8a8_decode_matmul
from fp8rl_jax.kernels.pallas_gemm import pallas_w8a8_matmul
from test_fp8_pallas import _lower_for_cuda

E4M3 = jnp.float8_e4m3fn


def _weights(rng, n, k):
    w = (rng.normal(size=(n, k)) * rng.uniform(0.01, 2.0, size=(n, 1))).astype(np.float32)
    q, s = ref.quantize_blocks(w, 128, 128, formats.WEIGHT_RECIPE)
    return q, s


def _reference(x, q, s):
    """float64 sum over 128-wide K blocks of (xq . wq) * xs * ws, with vLLM's 1x128 activation quantization."""
    xq, xs = ref.quantize_blocks(x, 1, 128, formats.ACTIVATION_RECIPE)
    return ref.dequantize_blocks(xq, xs, 1, 128) @ ref.dequantize_blocks(q, s, 128, 128).T


@pytest.mark.parametrize("m,n,k", [(1, 256, 512), (3, 384, 1024), (16, 200, 300), (40, 128, 640)])
def test_splits_1_is_bit_identical_to_the_unfused_path(m, n, k):
    rng = np.random.default_rng(m * 7 + k)
    x = rng.normal(size=(m, k)).astype(np.float32) * 3
    q, s = _weights(rng, n, k)
    fused = fused_w8a8_decode_matmul(jnp.asarray(x), jnp.asarray(q), jnp.asarray(s), splits=1, out_dtype=jnp.float32,
                                     interpret=True)
    xq, xs = quantize_activation_groupwise(jnp.asarray(x))
    unfused = pallas_w8a8_matmul(xq, xs, jnp.asarray(q), jnp.asarray(s), interpret=True)
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(unfused))


@pytest.mark.parametrize("m,n,k,splits", [(1, 256, 1024, 8), (4, 384, 768, 3), (8, 130, 512, 2), (2, 256, 2048, None)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_split_k_matches_float64_reference(m, n, k, splits, dtype):
    """Split-K reorders only the float32 additions of K-block partials: relative Frobenius error < 1e-6 in
    float32 output (a few ulps); the bf16 output adds bf16's own rounding (2**-9 relative)."""
    rng = np.random.default_rng(k + n)
    x = (rng.normal(size=(m, k)) * 2).astype(np.float32)
    x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))  # the values the kernel sees
    q, s = _weights(rng, n, k)
    y = fused_w8a8_decode_matmul(jnp.asarray(x, dtype), jnp.asarray(q), jnp.asarray(s), splits=splits,
                                 out_dtype=jnp.float32 if dtype == jnp.float32 else jnp.bfloat16, interpret=True)
    want = _reference(x, q, s)
    err = np.linalg.norm(np.asarray(y, np.float64) - want) / np.linalg.norm(want)
    assert err < (1e-6 if dtype == jnp.float32 else 4e-3), err


def test_choose_splits_fills_an_h100():
    # Qwen3-8B shapes: q_proj 4096x4096 -> 32 column programs, x 9 splits does not divide 32 K blocks -> 16
    assert choose_splits(4096, 4096) == 16
    assert choose_splits(12288 * 2, 4096) == 2  # fused gate|up: 192 columns x 2 = 384 programs
    assert choose_splits(151936, 4096) == 1  # lm_head: the columns alone fill the GPU
    assert choose_splits(1024, 384) == 3  # fewer K blocks than needed: the largest divisor


def test_bad_arguments_are_named():
    x, q, s = jnp.zeros((2, 256)), jnp.zeros((128, 256), E4M3), jnp.ones((1, 2))
    with pytest.raises(ValueError, match="splits=3 must divide the 2 K blocks"):
        fused_w8a8_decode_matmul(x, q, s, splits=3, interpret=True)
    with pytest.raises(ValueError, match="weight_scale_inv"):
        fused_w8a8_decode_matmul(x, q, jnp.ones((2, 2)), interpret=True)
    with pytest.raises(ValueError, match="same K"):
        fused_w8a8_decode_matmul(jnp.zeros((2, 128)), q, s, interpret=True)


def test_lowers_to_one_triton_launch_with_fp8_dot_for_cuda():
    """One launch, grid (N/128, splits); in the K loop: exact-division 1x128 quantization of the activation
    tile (two PTX div.rn.f32: amax / 448 and x / s), the e4m3 cast, and an e4m3 x e4m3 -> f32 tt.dot."""
    hlo, kernels = _lower_for_cuda(
        lambda x, w, s: fused_w8a8_decode_matmul(x, w, s, splits=4, interpret=False),
        jax.ShapeDtypeStruct((1, 1024), jnp.bfloat16), jax.ShapeDtypeStruct((512, 1024), E4M3),
        jax.ShapeDtypeStruct((4, 8), jnp.float32))
    assert len(kernels) == 1 and hlo.count("__gpu$xla.gpu.triton") == 1
    assert "grid_x = 4 : i32, grid_y = 4 : i32" in hlo
    ir_text = kernels[0]
    assert "arith.divf" not in ir_text and ir_text.count('"div.rn.f32 $0, $1, $2;"') == 2
    assert re.search(r"tt\.fp_to_fp %\w+, rounding = rtne : tensor<16x128xf32> -> tensor<16x128xf8E4M3FN>", ir_text)
    assert re.findall(r"tt\.dot .*: tensor<16x128xf8E4M3FN> \* tensor<128x128xf8E4M3FN> -> tensor<16x128xf32>",
                      ir_text)
