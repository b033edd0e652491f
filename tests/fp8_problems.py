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


def _rn_f32(v) -> float:
    """Round a ``fractions.Fraction`` to the nearest float32 (ties to even), exactly (no float64 step)."""
    import fractions

    if v == 0:
        return 0.0
    sign = -1 if v < 0 else 1
    a = abs(v)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if fractions.Fraction(2) ** e > a:
        e -= 1
    e = max(e, -126)  # subnormals share the smallest normal's step
    step = fractions.Fraction(2) ** (e - 23)
    n, r = divmod(a, step)
    n = int(n)
    if r * 2 > step or (r * 2 == step and n % 2 == 1):
        n += 1
    return sign * float(n * step)


def _rn_e4m3_code(v: float, fp8_max: float = 448.0) -> int:
    """The e4m3fn code of float ``v`` clipped to +-fp8_max, rounded to nearest with ties to even, by exact comparison
    with the 254 finite values (independent of ml_dtypes' and any hardware cast)."""
    import fractions

    import ml_dtypes

    vals = np.arange(0, 127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)  # codes 0..126
    a = fractions.Fraction(min(abs(v), fp8_max))
    hi = int(np.searchsorted(vals, float(a)))  # first value >= a (exact: values and a are floats)
    if hi < len(vals) and fractions.Fraction(vals[hi]) == a:
        code = hi
    else:
        lo = hi - 1
        d_lo, d_hi = a - fractions.Fraction(vals[lo]), fractions.Fraction(vals[hi]) - a
        code = lo if (d_lo < d_hi or (d_lo == d_hi and lo % 2 == 0)) else hi
    return code | (0x80 if v < 0 or (v == 0 and np.signbit(v)) else 0)


def exact_quant_codes(x, idx, bn: int, bk: int, recipe, fp8_max: float = 448.0):
    """The correctly rounded e4m3 codes (uint8) of the elements ``idx`` (a tuple of index arrays into ``x [..., N,
    K]``) under ``recipe`` without UE8M0, computed in exact rational arithmetic: block amax, ``s = RN32(a / 448)`` (or
    ``RN32(a * RN32(1/448))``), the floors, ``v = RN32(x / s)`` or ``RN32(x * RN32(1 / s))``, then the e4m3 value
    nearest to ``v`` (ties to even). The arbiter when a kernel and the numpy reference disagree on a GPU machine:
    it uses neither numpy's float32 arithmetic nor ml_dtypes' cast."""
    import fractions

    Fr = fractions.Fraction
    x = np.asarray(x).astype(np.float32)
    out = []
    for pos in zip(*idx):
        *lead, i, j = pos
        blk = x[tuple(lead)][(i // bn) * bn:(i // bn + 1) * bn, (j // bk) * bk:(j // bk + 1) * bk]
        a = Fr(float(np.abs(blk).max()))
        if recipe.amax_floor:
            a = max(a, Fr(float(np.float32(recipe.amax_floor))))
        if recipe.scale_by_reciprocal:
            s = _rn_f32(a * Fr(float(np.float32(1.0 / fp8_max))))
        else:
            s = _rn_f32(a / Fr(fp8_max))
        if recipe.scale_floor:
            s = max(s, float(np.float32(recipe.scale_floor)))
        xv = Fr(float(x[pos]))
        v = _rn_f32(xv * Fr(_rn_f32(1 / Fr(s)))) if recipe.value_by_reciprocal else _rn_f32(xv / Fr(s))
        out.append(_rn_e4m3_code(v, fp8_max))
    return np.asarray(out, np.uint8)


def assert_same_quant_arbitrated(name, got, want, x, bn: int, bk: int, recipe):
    """Like :func:`assert_same_quant`, but where ``got`` and the numpy reference ``want`` differ, the exact
    arbiter (:func:`exact_quant_codes`) decides: the test fails naming whichever side is wrong at how many elements,
    so a GPU run says whether the kernel or the reference (numpy + ml_dtypes on that host) is off."""
    g = np.asarray(got[0]).view(np.uint8)
    w = np.asarray(want[0]).view(np.uint8)
    diff = np.nonzero(g != w)
    if len(diff[0]):
        ex = exact_quant_codes(x, diff, bn, bk, recipe)
        got_wrong = int(np.sum(g[diff] != ex))
        ref_wrong = int(np.sum(w[diff] != ex))
        first = tuple(int(d[0]) for d in diff)
        import hashlib

        digest = hashlib.sha256(np.ascontiguousarray(np.asarray(x, np.float32)).tobytes()).hexdigest()[:12]
        raise AssertionError(
            f"{name} (input sha256 {digest}): {len(diff[0])} of {g.size} e4m3 codes differ from the numpy reference; by exact arithmetic the "
            f"kernel is wrong at {got_wrong} and the reference at {ref_wrong} of them (first at {first}: kernel "
            f"{int(g[first])}, reference {int(w[first])}, exact {int(ex[0])})")
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
