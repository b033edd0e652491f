"""FP8 training custom VJP: bf16 / e5m2 / e4m3 / float32 backward, vs finite differences and the bf16 reference;
the e4m3 backward (DeepSeek-V3's recipe) on the Mosaic GPU kernel (interpret mode) vs a float64 evaluation of its
formula."""

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
# moves tanh'(y); bf16 operands add 2^-9 per element; e5m2 (2 mantissa bits, rel. rounding 2^-3) adds ~5-8%;
# e4m3 gradients (3 mantissa bits, 2^-4) add about half of that (measured ~3.6% in all).
TOL = {"float32": 0.1, "bf16": 0.1, "e5m2": 0.2, "e4m3": 0.15}

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


@pytest.mark.parametrize("grad", ["bf16", "e5m2", "e4m3"])
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
        training.make_fp8_train_dot_general("e3m4")
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


# -- grad="e4m3" on the Mosaic GPU kernel ---------------------------------------------------------------------------

DN_NK = (((1,), (1,)), ((), ()))  # the project's Linear: x [M, K] . w [N, K]


def _e4m3_reference(x, w, g):
    """float64 evaluation of the ``grad="e4m3"`` formulas on operands quantized by the independent numpy quantizer:
    forward ``y = Q(x) Q_b(w)^T``, input gradient ``dx = Q(g) Q_b(w)`` and weight gradient ``dw = Q(g^T) Q(x^T)^T``
    (``Q``: 1x128 groups along the last axis, ``Q_b``: 128x128 blocks; activations with vLLM's native rounding, the
    weight with vLLM's block cast, gradients with :data:`training.GRAD_E4M3`). Returns ``{name: (value, A)}`` with
    ``A`` the same product on absolute values (the tolerance's scale) and each product's K-block count."""
    import fp8_numpy_ref as ref
    from fp8rl_jax.fp8 import formats

    def groups(a, recipe):
        q, s = ref.quantize_blocks(np.asarray(a, np.float32), 1, 128, recipe)
        return ref.dequantize_blocks(q, s, 1, 128)

    wq, ws = ref.quantize_blocks(w, 128, 128, formats.WEIGHT_RECIPE)
    wd = ref.dequantize_blocks(wq, ws, 128, 128)
    out = {}
    for name, a, b in (("y", groups(x, formats.ACTIVATION_RECIPE), wd),
                       ("dx", groups(g, training.GRAD_E4M3), wd.T),
                       ("dw", groups(g.T, training.GRAD_E4M3), groups(x.T, formats.ACTIVATION_RECIPE))):
        out[name] = (a @ b.T, np.abs(a) @ np.abs(b).T, -(-a.shape[1] // 128))
    return out


@pytest.mark.parametrize("m", [17, 300])
def test_e4m3_backward_on_the_mosaic_kernel_matches_float64_formula(m):
    """``grad="e4m3"`` with the Mosaic GPU kernel for all three GEMMs (``Fp8DotConfig(impl="mosaic")``, Mosaic GPU's
    interpreter on the CPU; on CUDA "auto" picks it for M > 64): forward (1D2D), input gradient (1D2D on the e4m3
    weight transposed once) and weight gradient (1D1D, both operands quantized along the M tokens and transposed as
    e4m3) equal the float64 formulas within float32 rounding: ``(128 + KB + 2) * 2**-24`` of the product on absolute
    values (the worst-case bound of tests/test_mosaic_gemm.py; KB = the product's K blocks: 1 or 3 here). Ragged
    everywhere: M = 17 (64 x 64 tiles, one contraction block for the weight gradient) and 300 (128 x 128 tiles, three
    blocks along the tokens), N = 60, K = 90 (one column tile of the 64-wide configurations: interpret mode costs
    ~1 s per CTA)."""
    from fp8rl_jax.fp8.dot_general import Fp8DotConfig

    rng = np.random.default_rng(m)
    x = (rng.standard_normal((m, 90)) * np.exp(rng.uniform(-2, 2, (m, 1)))).astype(np.float32)
    w = (rng.standard_normal((60, 90)) * 0.1).astype(np.float32)
    g = (rng.standard_normal((m, 60)) * np.exp(rng.uniform(-2, 2, (1, 60)))).astype(np.float32)
    f = training.make_fp8_train_dot_general("e4m3", Fp8DotConfig(impl="mosaic"))
    y, vjp = jax.vjp(lambda a, b: f(a, b, DN_NK), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g))
    want = _e4m3_reference(x, w, g)
    for name, got in (("y", y), ("dx", dx), ("dw", dw)):
        val, a, kb = want[name]
        assert got.dtype == jnp.float32 and got.shape == val.shape, name
        err = np.abs(np.asarray(got, np.float64) - val)
        ratio = float(np.max(err / np.maximum((128 + kb + 2) * 2.0 ** -24 * a, 1e-300)))
        print(f"M={m} {name}: max |err| / float32 bound = {ratio:.3g}")
        assert ratio <= 1.0, name
    # "auto" on the CPU (the dequantize path) computes the same quantized products
    f_auto = training.make_fp8_train_dot_general("e4m3")
    y2, vjp2 = jax.vjp(lambda a, b: f_auto(a, b, DN_NK), jnp.asarray(x), jnp.asarray(w))
    dx2, dw2 = vjp2(jnp.asarray(g))
    for name, got in (("y", y2), ("dx", dx2), ("dw", dw2)):
        val, a, kb = want[name]
        assert np.all(np.abs(np.asarray(got, np.float64) - val) <= (128 + kb + 2) * 2.0 ** -24 * a), name


def test_quantize_transposed_equals_quantizing_the_transpose():
    """The weight gradient's operands are quantized along M in their own layout and transposed as e4m3: bit for bit
    what quantizing the transposed float array along its last axis gives (values and scales), ragged M."""
    from fp8rl_jax.fp8 import formats
    from fp8rl_jax.fp8.dot_general import OperandQuant
    from fp8rl_jax.fp8.dot_general import quantize_operand as quantize_operand_
    from fp8rl_jax.fp8.dot_general import quantize_transposed as quantize_transposed_
    from fp8_problems import quant_test_data

    a = jnp.asarray(quant_test_data((2, 300, 70), 21))
    quantize_transposed = jax.jit(quantize_transposed_, static_argnums=(1, 2, 3))
    quantize_operand = jax.jit(quantize_operand_, static_argnums=(1, 2, 3))
    for oq in (OperandQuant("group", "e4m3", training.GRAD_E4M3),
               OperandQuant("group", "e4m3", formats.ACTIVATION_RECIPE),
               OperandQuant("group", "e5m2", formats.GRAD_E5M2)):
        for ue8m0 in (False, True):
            q, s = quantize_transposed(a, oq, 128, ue8m0)
            q2, s2 = quantize_operand(jnp.swapaxes(a, 1, 2), oq, 128, ue8m0)
            assert q.shape == (2, 70, 300) and s.shape == (2, 70, 3)
            np.testing.assert_array_equal(np.asarray(q).view(np.uint8), np.asarray(q2).view(np.uint8))
            np.testing.assert_array_equal(np.asarray(s), np.asarray(s2))
    with pytest.raises(ValueError, match="groups"):
        quantize_transposed_(a, OperandQuant("block", "e4m3"), 128, False)


def test_e4m3_is_a_trainer_choice():
    """``train.fp8_train_grad`` validates against :data:`training.GRAD_PRECISIONS`, which now holds "e4m3"."""
    from fp8rl_jax.trainer.config import TrainConfig

    assert "e4m3" in training.GRAD_PRECISIONS
    assert TrainConfig(train_precision="fp8", fp8_train_grad="e4m3").fp8_train_grad == "e4m3"
