"""Shared FP8 test helpers.

* A smooth test problem for FP8 gradient checks (dot_general and training tests):
  ``loss(x, w) = sum(tanh(x @ w) * c)`` with float64 reference gradients written out by hand.
* Quantizer inputs over many binades and a bit-exact comparison of ``(q, scale_inv)`` pairs (Pallas kernel
  tests, on CPU in interpret mode and on a GPU).
"""

from __future__ import annotations

import numpy as np

from fp8rl_jax.fp8 import formats

#: The rounding recipes the kernel tests run (vLLM's weight cast, native and Triton group quant, the contract).
QUANT_RECIPES = [formats.VLLM_BLOCK_CAST, formats.VLLM_GROUP_NATIVE, formats.VLLM_GROUP_TRITON, formats.CONTRACT]


def smooth_problem(seed, m=6, k=200, n=70):
    """Random ``x [m, k]``, ``w [k, n]`` (scaled so ``x @ w ~ N(0, 1)``) and ``c [m, n]``, float32."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)  # y ~ N(0, 1): tanh not saturated
    c = rng.standard_normal((m, n)).astype(np.float32)
    return x, w, c


def loss64_and_grads(x, w, c):
    """The float64 loss function and its exact gradients ``dL/dx = g w^T``, ``dL/dw = x^T g``."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    g = (1 - np.tanh(x64 @ w64) ** 2) * c
    return (lambda x, w: np.sum(np.tanh(x @ w) * c)), g @ w64.T, x64.T @ g


def quant_test_data(shape, seed):
    """float32 ``shape`` array over about 12 binades, with exact zeros and one outlier (3e4) that sets its
    block's scale, pushing much of that block into e4m3's subnormal range."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * np.exp(rng.uniform(-4, 4, shape))).astype(np.float32)
    x.reshape(-1)[::97] = 0.0
    x.reshape(-1)[-1] = 3e4
    return x


def assert_same_quant(got, want):
    """``(q, scale_inv)`` pairs equal bit for bit: fp8 values as uint8 patterns, scales as float32."""
    np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint8), np.asarray(want[0]).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
