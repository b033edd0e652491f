"""Blockwise e4m3 quantize/dequantize round trip against float64 numpy bounds (odd shapes, >448, zeros)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.fp8 import dequantize_weight_blockwise, fake_quantize_activation, quantize_weight_blockwise


@pytest.mark.parametrize("shape", [(1, 1), (129, 257), (576, 192), (256, 128)])
def test_weight_round_trip_bound(shape):
    x = np.random.default_rng(0).standard_normal(shape) * 3.0
    x[0, 0] = 1e4  # beyond 448 before scaling: its block's scale absorbs it, nothing overflows
    q, s = quantize_weight_blockwise(jnp.asarray(x, jnp.float32))
    assert s.shape == (-(-shape[0] // 128), -(-shape[1] // 128)) and s.dtype == jnp.float32
    d = np.asarray(dequantize_weight_blockwise(q, s), np.float64)
    assert np.isfinite(d).all()
    s_full = np.repeat(np.repeat(np.asarray(s, np.float64), 128, 0), 128, 1)[: shape[0], : shape[1]]
    # e4m3: 3 mantissa bits -> relative half-ulp 2^-4 for normals; absolute 2^-10 * s in the subnormal range
    bound = np.abs(x) * 2.0**-4 + s_full * 2.0**-9 + 1e-6
    assert (np.abs(d - x) <= bound).all()
    # scale = block amax / 448 (float64 reference of the contract)
    amax = np.abs(x[:128, :128]).max()
    assert abs(float(s[0, 0]) - amax / 448.0) <= 1e-6 * amax / 448.0


def test_zeros_and_saturation():
    q, s = quantize_weight_blockwise(jnp.zeros((130, 3)))
    assert (np.asarray(q, np.float32) == 0).all() and np.all(np.asarray(s) > 0)
    x = jnp.asarray([[1e30, -1e30, 1.0]])
    a = np.asarray(fake_quantize_activation(x))
    assert np.isfinite(a).all() and a[0, 0] == pytest.approx(1e30, rel=2**-4)
