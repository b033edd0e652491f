"""FP8 dot_general: error vs a float64 reference within FP8 bounds, Flax layers, layouts, gradients, NaN never."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fp8rl_jax.fp8 import dot_general as dg
from fp8rl_jax.fp8 import linear, quant
from fp8rl_jax.kernels.pallas_gemm import pallas_w8a8_matmul
from fp8_problems import loss64_and_grads, smooth_problem

LINEAR_DN = (((1,), (0,)), ((), ()))  # x [M, K] . w [K, N] (nnx.Linear kernel layout)


def _rng_arrays(m, k, n, seed=0, w_scale=0.05):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, ::7] *= 30.0  # outlier channels
    w = (rng.standard_normal((k, n)) * w_scale).astype(np.float32)
    return x, w


def fp8_error_bound(x, w, block=128):
    """A priori bound on |fp8(x) . fp8(w) - x . w| per output, float64.

    Each e4m3 operand element moves by at most 2^-4 of itself (normal range) plus 2^-10 of its block scale
    (subnormal range), see tests/test_fp8_quant.py. With ex, ew those bounds:
    |x^w^ - xw| <= ex (|w| + ew) + |x| ew, summed over K; plus float32 accumulation slack.
    """
    x = np.abs(np.asarray(x, np.float64))
    w = np.abs(np.asarray(w, np.float64))  # [K, N]
    k, n = w.shape
    kb = -(-k // block)
    xp = np.zeros((x.shape[0], kb * block))
    xp[:, :k] = x
    sx = np.repeat(xp.reshape(x.shape[0], kb, block).max(-1) / 448, block, -1)[:, :k]
    wp = np.zeros((kb * block, -(-n // block) * block))
    wp[:k, :n] = w
    sw = wp.reshape(kb, block, -1, block).max(axis=(1, 3)) / 448
    sw = np.repeat(np.repeat(sw, block, 0), block, 1)[:k, :n]
    ex = 2.0**-4 * x + 2.0**-10 * sx * 1.001
    ew = 2.0**-4 * w + 2.0**-10 * sw * 1.001
    return ex @ (w + ew) + x @ ew + 1e-5 * (x @ w) + 1e-30


@pytest.mark.parametrize("impl", ["dequant", "blocked", "pallas"])
@pytest.mark.parametrize("mkn", [(5, 300, 200), (1, 128, 128), (33, 257, 129)])
def test_block_dot_within_fp8_bound(impl, mkn):
    x, w = _rng_arrays(*mkn)
    y = np.asarray(dg.make_fp8_dot_general(impl=impl)(jnp.asarray(x), jnp.asarray(w), LINEAR_DN), np.float64)
    ref = x.astype(np.float64) @ w.astype(np.float64)
    assert np.all(np.abs(y - ref) <= fp8_error_bound(x, w))
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 0.05
    # Against the float64 product of the *quantized* operands only float32 accumulation error remains.
    xq, xs = quant.quantize_activation_groupwise(jnp.asarray(x))
    wq, ws = quant.quantize_weight_blockwise(jnp.asarray(w.T))
    xd = np.asarray(quant.dequantize_activation_groupwise(xq, xs), np.float64)
    wd = np.asarray(quant.dequantize_weight_blockwise(wq, ws), np.float64)
    exact = xd @ wd.T
    assert np.all(np.abs(y - exact) <= 1e-5 * (np.abs(xd) @ np.abs(wd.T)) + 1e-30)


def test_tensor_dot_within_bound():
    x, w = _rng_arrays(9, 256, 130, seed=1)
    ref = x.astype(np.float64) @ w.astype(np.float64)
    for f in (dg.fp8_tensor_dot_general, dg.make_fp8_dot_general(scaling="tensor", impl="blocked")):
        y = np.asarray(f(jnp.asarray(x), jnp.asarray(w), LINEAR_DN), np.float64)
        # one scale per tensor: subnormal term uses the tensor scale
        sx, sw = np.abs(x).max() / 448, np.abs(w).max() / 448
        ex = 2.0**-4 * np.abs(x) + 2.0**-10 * sx * 1.001
        ew = 2.0**-4 * np.abs(w) + 2.0**-10 * sw * 1.001
        bound = ex @ (np.abs(w) + ew) + np.abs(x) @ ew + 1e-5 * (np.abs(x) @ np.abs(w))
        assert np.all(np.abs(y - ref) <= bound)


def test_w8a8_block_matmul_and_pallas_gemm_agree():
    x, w = _rng_arrays(20, 384, 256, seed=2)
    wq, ws = quant.quantize_weight_blockwise(jnp.asarray(w.T))
    ys = {impl: np.asarray(linear.w8a8_block_matmul(jnp.asarray(x), wq, ws, impl=impl)) for impl in ("dequant", "blocked", "pallas")}
    y_dg = np.asarray(dg.make_fp8_dot_general(impl="dequant")(jnp.asarray(x), jnp.asarray(w), LINEAR_DN))
    for y in ys.values():
        np.testing.assert_allclose(y, ys["dequant"], rtol=2e-5, atol=2e-5 * np.abs(ys["dequant"]).max())
    np.testing.assert_allclose(y_dg, ys["dequant"], rtol=2e-5, atol=2e-5 * np.abs(y_dg).max())
    xq, xs = quant.quantize_activation_groupwise(jnp.asarray(x))
    y = pallas_w8a8_matmul(xq, xs, wq, ws, bm=16, bn=64, interpret=True)
    np.testing.assert_allclose(np.asarray(y), ys["dequant"], rtol=2e-5, atol=2e-5 * np.abs(y).max())
    with pytest.raises(ValueError, match="bn"):
        pallas_w8a8_matmul(xq, xs, wq, ws, bn=96, interpret=True)


def test_mosaic_impl_within_fp8_bound_and_float32_of_the_quantized_product():
    """``impl="mosaic"`` (the Mosaic GPU wgmma kernel, in Mosaic GPU's interpreter here; what "auto" runs on CUDA for
    M > 64) through the dot_general layout handling (``nnx.Linear``'s ``[K, N]`` kernel, transposed to ``[N, K]``):
    within the a-priori FP8 bound of the exact product and within float32 accumulation of the float64 product of the
    quantized operands, as the other implementations (ragged M = 33, K = 257, N = 129)."""
    x, w = _rng_arrays(33, 257, 129, seed=4)
    y = np.asarray(dg.make_fp8_dot_general(impl="mosaic")(jnp.asarray(x), jnp.asarray(w), LINEAR_DN), np.float64)
    ref = x.astype(np.float64) @ w.astype(np.float64)
    assert np.all(np.abs(y - ref) <= fp8_error_bound(x, w))
    xq, xs = quant.quantize_activation_groupwise(jnp.asarray(x))
    wq, ws = quant.quantize_weight_blockwise(jnp.asarray(w.T))
    xd = np.asarray(quant.dequantize_activation_groupwise(xq, xs), np.float64)
    wd = np.asarray(quant.dequantize_weight_blockwise(wq, ws), np.float64)
    assert np.all(np.abs(y - xd @ wd.T) <= 1e-5 * (np.abs(xd) @ np.abs(wd.T)) + 1e-30)


def test_nnx_linear_accepts_fp8_dot_general():
    x, _ = _rng_arrays(4, 256, 1, seed=3)
    ref_layer = nnx.Linear(256, 192, rngs=nnx.Rngs(0))
    fp8_layer = nnx.Linear(256, 192, dot_general=dg.fp8_block_dot_general, rngs=nnx.Rngs(0))
    y_ref = np.asarray(ref_layer(jnp.asarray(x)), np.float64)
    y = np.asarray(jax.jit(lambda m, v: m(v))(fp8_layer, jnp.asarray(x)), np.float64)
    w = np.asarray(fp8_layer.kernel[...])
    b = np.asarray(fp8_layer.bias[...])
    assert np.all(np.abs(y - y_ref) <= fp8_error_bound(x, w) + 1e-6 * np.abs(b))
    # bf16 layer and a 3-d input
    layer16 = nnx.Linear(256, 192, dot_general=dg.fp8_block_dot_general, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                         rngs=nnx.Rngs(0))
    y16 = layer16(jnp.asarray(x).reshape(2, 2, 256).astype(jnp.bfloat16))
    assert y16.shape == (2, 2, 192) and y16.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(y16)))


def test_nnx_einsum_with_fp8_einsum():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((2, 3, 256)).astype(np.float32))
    proj = nnx.Einsum("btd,dnh->btnh", (256, 4, 64), (4, 64), einsum_op=dg.fp8_einsum, rngs=nnx.Rngs(1))
    y = proj(x)
    ref = jnp.einsum("btd,dnh->btnh", x, proj.kernel[...]) + proj.bias[...]
    assert y.shape == (2, 3, 4, 64)
    assert float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)) < 0.05
    # output projection contracts two dims (n, h): they flatten into K, as vLLM's o_proj [d, n*h]
    out = nnx.Einsum("btnh,nhd->btd", (4, 64, 256), (256,), einsum_op=dg.fp8_einsum, rngs=nnx.Rngs(2))
    z = out(y)
    zref = jnp.einsum("btnh,nhd->btd", y, out.kernel[...]) + out.bias[...]
    assert float(jnp.linalg.norm(z - zref) / jnp.linalg.norm(zref)) < 0.05


def test_layouts_batch_dims_and_transposed_weights():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 7, 200)).astype(np.float32)  # experts x tokens x K
    w = rng.standard_normal((3, 150, 200)).astype(np.float32)  # experts x N x K ([out, in] layout)
    dn = (((2,), (2,)), ((0,), (0,)))
    y = np.asarray(dg.fp8_block_dot_general(jnp.asarray(x), jnp.asarray(w), dn))
    ref = np.einsum("emk,enk->emn", x.astype(np.float64), w.astype(np.float64))
    assert y.shape == (3, 7, 150)
    for e in range(3):
        assert np.all(np.abs(y[e] - ref[e]) <= fp8_error_bound(x[e], w[e].T))
    # out-of-order contracting dim on the lhs
    xt = np.swapaxes(x[0], 0, 1)  # [K, M]
    y2 = np.asarray(dg.fp8_block_dot_general(jnp.asarray(xt), jnp.asarray(w[0]), (((0,), (1,)), ((), ()))))
    np.testing.assert_array_equal(y2, y[0])


def test_unsupported_dimension_numbers_raise():
    a, b = jnp.ones((4, 8)), jnp.ones((8, 3))
    with pytest.raises(ValueError, match="at least one contracting dimension"):
        dg.fp8_block_dot_general(a, b, (((), ()), ((), ())))
    with pytest.raises(ValueError, match="contracting sizes differ"):
        dg.fp8_block_dot_general(a, jnp.ones((7, 3)), LINEAR_DN)
    with pytest.raises(ValueError, match="out of range"):
        dg.fp8_block_dot_general(a, b, (((2,), (0,)), ((), ())))
    with pytest.raises(ValueError, match="floating"):
        dg.fp8_block_dot_general(a.astype(jnp.int32), b, LINEAR_DN)
    with pytest.raises(ValueError, match="impl"):
        dg.Fp8DotConfig(impl="cuda")


def test_preferred_element_type_and_dtypes():
    x, w = _rng_arrays(3, 128, 64, seed=6)
    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    assert dg.fp8_block_dot_general(xb, wb, LINEAR_DN).dtype == jnp.bfloat16
    assert dg.fp8_block_dot_general(xb, wb, LINEAR_DN, preferred_element_type=jnp.float32).dtype == jnp.float32


def test_grads_straight_through_and_finite_differences():
    x, w, c = smooth_problem(7)
    f8 = lambda x, w: jnp.sum(jnp.tanh(dg.fp8_block_dot_general(x, w, LINEAR_DN)) * c)  # noqa: E731
    gx, gw = jax.grad(f8, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    # STE: cotangents are those of the exact matmul, evaluated at the FP8 forward's output.
    y8 = dg.fp8_block_dot_general(jnp.asarray(x), jnp.asarray(w), LINEAR_DN)
    g = np.asarray((1 - jnp.tanh(y8) ** 2) * c, np.float64)
    np.testing.assert_allclose(np.asarray(gx), g @ w.T, rtol=1e-4, atol=1e-4 * np.abs(g @ w.T).max())
    np.testing.assert_allclose(np.asarray(gw), x.T @ g, rtol=1e-4, atol=1e-4 * np.abs(x.T @ g).max())
    # The exact float64 gradient agrees with central finite differences of the smooth loss (sanity) ...
    loss64, gx64, gw64 = loss64_and_grads(x, w, c)
    gnorm = np.sqrt(np.sum(gx64**2) + np.sum(gw64**2))
    rng = np.random.default_rng(9)
    for _ in range(3):
        dx, dw = rng.standard_normal(x.shape), rng.standard_normal(w.shape)
        dnorm = np.sqrt(np.sum(dx**2) + np.sum(dw**2))
        h = 1e-5
        fd = (loss64(x + h * dx, w + h * dw) - loss64(x - h * dx, w - h * dw)) / (2 * h)
        exact = np.sum(gx64 * dx) + np.sum(gw64 * dw)
        assert abs(exact - fd) <= 1e-6 * gnorm * dnorm
        # ... and the FP8 gradient agrees with the finite differences within FP8 error.
        an = float(np.sum(np.asarray(gx, np.float64) * dx) + np.sum(np.asarray(gw, np.float64) * dw))
        assert abs(an - fd) <= 0.05 * gnorm * dnorm, (an, fd)
    rel = np.sqrt(np.sum((np.asarray(gx) - gx64) ** 2) + np.sum((np.asarray(gw) - gw64) ** 2)) / gnorm
    assert rel < 0.1, rel


def test_no_nan_on_extreme_inputs():
    x = np.zeros((4, 256), np.float32)
    x[0, :] = 1e30
    x[1, 3] = -3e38
    x[2, 5] = 1e-38
    w = np.zeros((256, 130), np.float32)
    w[:, 0] = 1e-30
    w[7, 1] = 2e4
    for f in (dg.fp8_block_dot_general, dg.fp8_tensor_dot_general):
        y, grads = jax.value_and_grad(lambda x, w: jnp.sum(f(x, w, LINEAR_DN, preferred_element_type=jnp.float32) * 1e-40),
                                      argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
        assert not np.isnan(float(y))
        assert not any(np.any(np.isnan(np.asarray(g))) for g in grads)
        out = f(jnp.asarray(x), jnp.asarray(w), LINEAR_DN)
        assert not np.any(np.isnan(np.asarray(out)))
