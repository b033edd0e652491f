"""Chunked per-token logprobs / entropy (issue 19 "Memory"): values and gradients against a float64 numpy
formula, and the compiled program's temporary memory no longer scales with ``B * T * V``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.trainer.logprobs import token_logprobs


def _np_reference(h, w, y, temp, weights):
    """float64: logprobs, entropy, and d(sum(weights * logprobs))/d(w, h) from softmax's closed form."""
    h, w = h.astype(np.float64), w.astype(np.float64)
    z = np.einsum("btd,vd->btv", h, w) / temp
    z = z - z.max(-1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    logp = np.log(p)
    lp = np.take_along_axis(logp, y[..., None], -1)[..., 0]
    ent = -(p * logp).sum(-1)
    onehot = np.eye(w.shape[0])[y]
    dz = weights[..., None] * (onehot - p) / temp  # d/dz of sum weights * logp_y
    return lp, ent, np.einsum("btv,btd->vd", dz, h), np.einsum("btv,vd->btd", dz, w)


@pytest.mark.parametrize("chunk_size", [None, 1, 7, 24, 4096])
def test_values_and_gradients_match_float64(chunk_size):
    rng = np.random.default_rng(0)
    b, t, d, v, temp = 3, 8, 16, 50, 0.7
    h = rng.normal(size=(b, t, d)).astype(np.float32)
    w = rng.normal(size=(v, d)).astype(np.float32) * 0.5
    y = rng.integers(0, v, (b, t))
    weights = rng.normal(size=(b, t))
    lp_ref, ent_ref, dw_ref, dh_ref = _np_reference(h, w, y, temp, weights)

    def f(w_, h_):
        lp, ent = token_logprobs(lambda x: x @ w_.T, h_, jnp.asarray(y), temp, chunk_size=chunk_size,
                                 with_entropy=True)
        return jnp.sum(lp * weights.astype(np.float32)), (lp, ent)

    (_, (lp, ent)), (dw, dh) = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(w, h)
    np.testing.assert_allclose(lp, lp_ref, atol=2e-5)
    np.testing.assert_allclose(ent, ent_ref, atol=2e-5)
    np.testing.assert_allclose(dw, dw_ref, atol=2e-4)
    np.testing.assert_allclose(dh, dh_ref, atol=2e-4)


def test_chunking_bounds_the_logits_memory():
    """B*T*V float32 logits = 2048 * 32000 * 4 B = 262 MB unchunked; chunks of 128 keep 16 MB at a time."""
    b, t, d, v = 4, 512, 64, 32000
    h = jax.ShapeDtypeStruct((b, t, d), jnp.float32)
    w = jax.ShapeDtypeStruct((v, d), jnp.float32)
    y = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def temp_bytes(chunk):
        def loss(w_, h_, y_):
            return jnp.sum(token_logprobs(lambda x: x @ w_.T, h_, y_, 1.0, chunk_size=chunk)[0])
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(w, h, y).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    full, chunked = temp_bytes(None), temp_bytes(128)
    logits_bytes = b * t * v * 4
    assert full >= logits_bytes  # the unchunked backward keeps at least one [B, T, V] float32 buffer
    assert chunked < logits_bytes / 4, (chunked, full)


def test_bad_chunk_size_and_shapes_are_named():
    h, y = jnp.zeros((2, 3, 4)), jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(lambda x: x, h, y, chunk_size=0)
    with pytest.raises(ValueError, match="targets must have shape"):
        token_logprobs(lambda x: x, h, jnp.zeros((3, 2), jnp.int32))
