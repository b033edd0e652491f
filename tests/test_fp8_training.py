"""FP8 training custom VJP: bf16 / e5m2 / float32 backward, vs finite differences and the bf16 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from fp8rl_jax.fp8 import training
from fp8_problems import loss64_and_grads, smooth_problem

LINEAR_DN = (((1,), (0,)), ((), ()))  # x [M, K] . w [K, N]

# Relative gradient-norm error allowed per backward precision. The forward's e4m3 error (~2-3% of y here)
# moves tanh'(y); bf16 operands add 2^-9 per element; e5m2 (2 mantissa bits, rel. rounding 2^-3) adds ~5-8%.
TOL = {"float32": 0.1, "bf16": 0.1, "e5m2": 0.2}

def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("grad", training.GRAD_PRECISIONS)
def test_grads_vs_finite_differences_and_bf16_reference(grad):
    x, w, c = smooth_problem(11)
    f = training.make_fp8_train_dot_general(grad)
    loss = lambda x, w: jnp.sum(jnp.tanh(f(x, w, LINEAR_DN)) * c)  # noqa: E731
    gx, gw = jax.grad(loss, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    assert gx.dtype == jnp.float32 and gw.dtype == jnp.float32
    loss64, gx64, gw64 = loss64_and_grads(x, w, c)
    assert _rel(gx, gx64) < TOL[grad] and _rel(gw, gw64) < TOL[grad]
    # directional finite differences of the smooth float64 loss
    rng = np.random.default_rng(12)
    gnorm = np.sqrt(np.sum(gx64**2) + np.sum(gw64**2))
    for _ in range(2):
        dx, dw = rng.standard_normal(x.shape), rng.standard_normal(w.shape)
        h = 1e-5
        fd = (loss64(x + h * dx, w + h * dw) - loss64(x - h * dx, w - h * dw)) / (2 * h)
        an = float(np.sum(np.asarray(gx, np.float64) * dx) + np.sum(np.asarray(gw, np.float64) * dw))
        assert abs(an - fd) <= TOL[grad] / 2 * gnorm * np.sqrt(np.sum(dx**2) + np.sum(dw**2))
    # vs the bf16 training reference (bf16 operands, float32 accumulation, autodiff)
    bf = lambda x, w: jnp.sum(jnp.tanh(jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),  # noqa: E731
                                               preferred_element_type=jnp.float32)) * c)
    bx, bw = jax.grad(bf, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    assert _rel(gx, np.asarray(bx, np.float64)) < TOL[grad] and _rel(gw, np.asarray(bw, np.float64)) < TOL[grad]


def test_float32_backward_is_the_exact_straight_through_vjp():
    x, w, _ = smooth_problem(13, m=5, k=130, n=40)
    f = training.make_fp8_train_dot_general("float32")
    y, vjp = jax.vjp(lambda a, b: f(a, b, LINEAR_DN), jnp.asarray(x), jnp.asarray(w))
    g = np.random.default_rng(14).standard_normal(y.shape).astype(np.float32)
    dx, dw = vjp(jnp.asarray(g))
    np.testing.assert_allclose(np.asarray(dx), g @ w.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), x.T @ g, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grad", ["bf16", "e5m2"])
def test_never_nan(grad):
    f = training.make_fp8_train_dot_general(grad)
    x = np.zeros((3, 256), np.float32)
    x[0] = 1e20
    x[1, 4] = -3e38
    w = np.zeros((256, 20), np.float32)
    w[4, 0] = 1e-30
    w[:, 1] = 1.0
    for cot in (np.zeros((3, 20), np.float32), np.full((3, 20), 1e-30, np.float32), np.full((3, 20), 1e3, np.float32)):
        _, vjp = jax.vjp(lambda a, b: f(a, b, LINEAR_DN), jnp.asarray(x), jnp.asarray(w))
        dx, dw = vjp(jnp.asarray(cot))
        assert not np.any(np.isnan(np.asarray(dx, np.float32))) and not np.any(np.isnan(np.asarray(dw, np.float32)))


def test_batched_einsum_layout_grads():
    """Batch dims and a two-dim contraction go through the canonical form and back."""
    rng = np.random.default_rng(15)
    x = jnp.asarray(rng.standard_normal((2, 5, 4, 32)).astype(np.float32))  # b, t, n, h
    w = jnp.asarray((rng.standard_normal((4, 32, 48)) / 11).astype(np.float32))  # n, h, d
    f = training.make_fp8_train_dot_general("e5m2")
    loss = lambda x, w: jnp.sum(jnp.einsum("btnh,nhd->btd", x, w, _dot_general=f) ** 2)  # noqa: E731
    ref = lambda x, w: jnp.sum(jnp.einsum("btnh,nhd->btd", x, w) ** 2)  # noqa: E731
    g = jax.grad(loss, argnums=(0, 1))(x, w)
    r = jax.grad(ref, argnums=(0, 1))(x, w)
    for a, b in zip(g, r):
        assert a.shape == b.shape
        assert _rel(a, np.asarray(b, np.float64)) < 0.2


def test_precision_switch_trains_an_nnx_linear():
    assert training.dot_general_for_precision("bf16") is jax.lax.dot_general
    with pytest.raises(ValueError, match="precision"):
        training.dot_general_for_precision("int8")
    with pytest.raises(ValueError, match="grad"):
        training.make_fp8_train_dot_general("e4m3")
    dot = training.dot_general_for_precision("fp8", fp8_grad="bf16")
    model = nnx.Linear(128, 8, dot_general=dot, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    rng = np.random.default_rng(16)
    x = jnp.asarray(rng.standard_normal((32, 128)).astype(np.float32))
    y = jnp.asarray(rng.standard_normal((32, 8)).astype(np.float32))

    @nnx.jit
    def step(model, opt):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt)) for _ in range(5)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
