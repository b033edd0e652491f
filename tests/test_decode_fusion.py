"""Issue 29: the decode kernel with a layer's neighbours fused in (RMSNorm prologue, silu(gate) * up and residual
epilogues, unpadded rows), in interpret mode on the CPU against the unfused ops; and its CUDA lowering."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.fp8 import quantize_weight_blockwise
from fp8rl_jax.kernels.pallas_decode import decode_tiling, fused_w8a8_decode_matmul
from test_fp8_pallas import _lower_for_cuda

BF16 = jnp.bfloat16


def _rmsnorm(x, w, eps=1e-6):
    """The unfused op, as fp8rl_jax.models.layers.RMSNorm computes it (float32, cast back to x's dtype), and the
    kernel's ``norm=(sum_sq, weight, eps)``."""
    xf = x.astype(jnp.float32)
    ssq = jnp.sum(xf * xf, axis=-1, keepdims=True)
    rinv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (w.astype(jnp.float32) * (xf * rinv)).astype(x.dtype), (ssq[:, 0], w, eps)


def _case(m, n, k, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)) * 3, BF16)
    w, s = quantize_weight_blockwise(jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.float32))
    nw = jnp.asarray(1 + 0.1 * rng.standard_normal(k), BF16)
    r = jnp.asarray(rng.standard_normal((m, n)), BF16)
    return x, w, s, nw, r


@pytest.mark.parametrize("m", [1, 3, 17])
def test_norm_prologue_and_residual_epilogue_equal_the_unfused_ops(m):
    """One call = RMSNorm, then the W8A8 product, then ``residual + y``: with one split (the epilogue in the kernel)
    bit for bit (the same float32 ops on the same values, each rounding done); with three (the epilogue in the XLA
    reduction) within one bf16 step, since XLA may skip the product's rounding to bf16 before the add
    (``xla_allow_excess_precision``, on by default), as it may in the unfused engine program."""
    x, w, s, nw, r = _case(m, 256, 384, seed=m)
    xn, norm = _rmsnorm(x, nw)
    for splits in (1, 3):
        plain = fused_w8a8_decode_matmul(xn, w, s, splits=splits, interpret=True)
        want = np.asarray((r.astype(jnp.float32) + plain.astype(jnp.float32)).astype(BF16), np.float32)
        got = fused_w8a8_decode_matmul(x, w, s, splits=splits, interpret=True, norm=norm, residual=r)
        assert got.dtype == BF16 and got.shape == (m, 256)
        if splits == 1:
            np.testing.assert_array_equal(np.asarray(got, np.float32), want)
        else:  # one bf16 step of the product (and of the sum), however much the sum cancels
            scale = np.abs(np.asarray(r, np.float32)) + np.abs(np.asarray(plain, np.float32))
            assert np.all(np.abs(np.asarray(got, np.float32) - want) <= 2 ** -7 * scale + 1e-6)


@pytest.mark.parametrize("m", [1, 5])
def test_gated_epilogue_is_silu_gate_times_up(m):
    """``gated=True`` on a fused ``[gate; up]`` weight equals ``silu(gate) * up`` of the two products rounded to bf16,
    computed in float64 and rounded to bf16 once, within one bf16 step (the float32 sigmoid rounds differently)."""
    x, w, s, nw, _ = _case(m, 512, 256, seed=10 + m)
    xn, norm = _rmsnorm(x, nw)
    gu = fused_w8a8_decode_matmul(xn, w, s, splits=1, interpret=True)
    gate, up = jnp.split(gu, 2, axis=-1)
    g64, u64 = np.asarray(gate, np.float64), np.asarray(up, np.float64)
    want = g64 / (1 + np.exp(-g64)) * u64
    got = fused_w8a8_decode_matmul(x, w, s, interpret=True, norm=norm, gated=True)
    assert got.shape == (m, 256) and got.dtype == BF16
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2 ** -8, atol=1e-7)


def test_fused_arguments_are_checked_by_name():
    x, w, s, nw, r = _case(2, 256, 384)
    with pytest.raises(ValueError, match="residual"):
        fused_w8a8_decode_matmul(x, w, s, residual=r[:, :10], interpret=True)
    with pytest.raises(ValueError, match="norm="):
        fused_w8a8_decode_matmul(x, w, s, norm=(jnp.ones(3), nw, 1e-6), interpret=True)
    with pytest.raises(ValueError, match="splits=1"):
        fused_w8a8_decode_matmul(x, w, s, gated=True, splits=3, interpret=True)
    w3, s3 = quantize_weight_blockwise(jnp.ones((384, 384), jnp.float32))
    with pytest.raises(ValueError, match="halves"):
        fused_w8a8_decode_matmul(x, w3, s3, gated=True, interpret=True)


def test_tiling_prefers_one_split_when_an_epilogue_is_fused():
    assert decode_tiling(4096, 4096, fused_epilogue=True) == (16, 1) or decode_tiling(4096, 4096, fused_epilogue=True)[1] == 1
    assert decode_tiling(12288, 4096, fused_epilogue=True) == (64, 1)  # 192 programs
    bn, splits = decode_tiling(1024, 4096, fused_epilogue=False)
    assert bn == 128 and splits > 1


def test_fused_decode_kernel_lowers_for_cuda_unpadded_and_in_one_launch():
    """Lowered for CUDA: one Triton launch whose operands are the unpadded rows (no pad fusion before it) and, with one
    split, whose result is the final bf16 output (no float32 partials, no XLA reduction after it)."""
    S = jax.ShapeDtypeStruct
    e4m3 = jnp.float8_e4m3fn
    fn = lambda x, w, s, nw, r, ms: fused_w8a8_decode_matmul(x, w, s, norm=(ms, nw, 1e-6), residual=r)  # noqa: E731
    hlo, kernels = _lower_for_cuda(fn, S((3, 4096), BF16), S((4096, 4096), e4m3), S((32, 32), jnp.float32),
                                   S((4096,), BF16), S((3, 4096), BF16), S((3,), jnp.float32))
    assert len(kernels) == 1
    call = next(line for line in hlo.splitlines() if "__gpu$xla.gpu.triton" in line)
    assert "tensor<3x4096xbf16>" in call  # the rows as they are
    assert re.search(r"-> tensor<3x4096xbf16>", call)  # the final output, written by the kernel
    assert "stablehlo.pad" not in hlo
