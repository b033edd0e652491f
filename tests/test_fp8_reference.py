"""The FP8 quantizers against the independent numpy reference (tests/fp8_numpy_ref.py), and properties of that
reference itself (so the reference the GPU tests trust is checked too).

Properties (from the e4m3 format and the blockwise contract in shared/DESIGN.md): scaling a block by a power of
two scales its ``scale_inv`` by the same power and leaves the e4m3 values unchanged; negating the input negates
the values and keeps the scales; the block's largest magnitude maps to +-448 (saturation, no overflow); every
element's dequantization error is at most half an e4m3 ulp of its scaled value times the scale.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fp8_numpy_ref as ref
from fp8_problems import QUANT_RECIPES, assert_same_quant, quant_test_data
from fp8rl_jax.fp8 import formats, quant
from fp8rl_jax.kernels.pallas_quant import pallas_quantize_activation_groupwise, pallas_quantize_weight_blockwise


@pytest.mark.parametrize("recipe", QUANT_RECIPES, ids=lambda r: r.name.split()[0])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_jnp_and_pallas_interpret_equal_the_numpy_reference(recipe, ue8m0):
    for shape, dtype in (((2, 129, 257), jnp.float32), ((384, 256), jnp.bfloat16)):
        x = np.asarray(jnp.asarray(quant_test_data(shape, 5)).astype(dtype))
        want = ref.quantize_blocks(x, 128, 128, recipe, ue8m0)
        assert_same_quant(quant.quantize_weight_blockwise(jnp.asarray(x), 128, ue8m0, recipe=recipe), want)
        assert_same_quant(pallas_quantize_weight_blockwise(jnp.asarray(x), 128, ue8m0, recipe=recipe,
                                                           interpret=True), want)
    a = np.asarray(jnp.asarray(quant_test_data((37, 300), 6)).astype(jnp.bfloat16))
    want = ref.quantize_blocks(a, 1, 128, recipe, ue8m0)
    assert_same_quant(quant.quantize_activation_groupwise(jnp.asarray(a), 128, ue8m0, recipe=recipe), want)
    assert_same_quant(pallas_quantize_activation_groupwise(jnp.asarray(a), 128, ue8m0, recipe=recipe,
                                                           interpret=True), want)


blocks = st.tuples(st.integers(0, 2**31 - 1), st.integers(-20, 20), st.sampled_from([False, True]))


def _block(seed, exp):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((128, 256)) * np.exp(rng.uniform(-3, 3, (128, 256)))).astype(np.float32)
    return x * np.float32(2.0**exp)


@settings(max_examples=40, deadline=None)
@given(blocks, st.integers(-8, 8))
def test_power_of_two_scale_equivariance_and_sign_symmetry(case, shift):
    seed, exp, ue8m0 = case
    x = _block(seed, exp)
    q, s = ref.quantize_blocks(x, 128, 128, formats.CONTRACT, ue8m0)
    q2, s2 = ref.quantize_blocks(x * np.float32(2.0**shift), 128, 128, formats.CONTRACT, ue8m0)
    np.testing.assert_array_equal(q2.view(np.uint8), q.view(np.uint8))
    np.testing.assert_array_equal(s2, s * np.float32(2.0**shift))
    qn, sn = ref.quantize_blocks(-x, 128, 128, formats.CONTRACT, ue8m0)
    np.testing.assert_array_equal(qn.astype(np.float32), -q.astype(np.float32))
    np.testing.assert_array_equal(sn, s)


@settings(max_examples=40, deadline=None)
@given(blocks)
def test_saturation_at_448_and_half_ulp_error(case):
    seed, exp, ue8m0 = case
    x = _block(seed, exp)
    q, s = ref.quantize_blocks(x, 128, 128, formats.CONTRACT, ue8m0)
    qf = q.astype(np.float64)
    assert np.all(np.abs(qf) <= 448.0)
    for j in range(2):  # the two 128x128 blocks
        blk, qb, sb = x[:, 128 * j:128 * (j + 1)].astype(np.float64), qf[:, 128 * j:128 * (j + 1)], float(s[0, j])
        if not ue8m0:  # amax / s == 448 up to one float32 rounding of s: the largest magnitude saturates at 448
            assert np.abs(qb).max() == 448.0
        v = blk / sb  # the exact scaled value
        # half an e4m3 ulp at |v|: ulp = 2^(floor(log2|v|) - 3) for normals, 2^-9 in the subnormal range
        e = np.floor(np.log2(np.maximum(np.abs(v), 2.0**-6)))
        half_ulp = 2.0 ** (e - 3) / 2
        err = np.abs(qb * sb - blk)
        # float32 rounding of the division x / s adds at most one float32 ulp of |v| before the e4m3 rounding
        assert np.all(err <= (half_ulp + np.abs(v) * 2.0**-23) * sb * (1 + 1e-12))


def test_the_reference_casts_like_ml_dtypes_and_floors_zero_blocks():
    x = np.zeros((128, 128), np.float32)
    q, s = ref.quantize_blocks(x, 128, 128, formats.VLLM_BLOCK_CAST)
    assert s[0, 0] == np.float32(np.float32(1e-4) / np.float32(448.0)) and not q.astype(np.float32).any()
    v = np.array([[448.0, 464.0, -1000.0, 0.0]], np.float32)
    assert np.array_equal(np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32),
                          [[448.0, 448.0, -448.0, 0.0]])
