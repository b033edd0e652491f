"""FP8 format constants, scale rules and the exact-rounding helpers (the contract in shared/DESIGN.md).

e4m3 is ``float8_e4m3fn`` (finite-only, max 448), the format of vLLM/DeepGEMM blockwise FP8 checkpoints.
Scales follow DeepSeek-V3 / vLLM: ``s = max(amax, eps) / 448`` stored as ``scale_inv`` (the multiplier that
dequantizes, ``x ~= q * s``), optionally rounded up to a power of two (UE8M0, DeepGEMM on Blackwell).

vLLM ships several reference quantizers that differ in rounding details (where the zero-floor is applied,
``a / 448`` versus ``a * fp32(1/448)``, ``x / s`` versus ``x * (1/s)``). A :class:`QuantRecipe` names those
details; the presets below reproduce vLLM's functions bit for bit (values as uint8 patterns, scales as
float32), see tests/test_fp8_vllm_exact.py:

===========================  =======================================================================
preset                       vLLM function it reproduces
===========================  =======================================================================
``VLLM_BLOCK_CAST``          ``vllm.utils.deep_gemm.per_block_cast_to_fp8`` (DeepGEMM's weight cast; used
                             by vLLM's online block-FP8 weight quantization). Default for weights.
``VLLM_GROUP_NATIVE``        ``QuantFP8(group_shape=(1, 128)).forward_native`` (``_quantize_group_native``)
                             run eagerly (vLLM's CPU path; on an H100 block-FP8 models run the CUDA group
                             kernel, which equals ``CONTRACT``: docs/FP8.md). Default for activations.
``VLLM_GROUP_TRITON``        ``per_token_group_quant_fp8``'s Triton kernel (GPU only; not runnable here).
``VLLM_TENSOR_NATIVE``       ``QuantFP8(PER_TENSOR / PER_TOKEN).forward_native`` (dynamic scales).
``CONTRACT``                 DESIGN.md formula ``s = max(amax, 1e-10) / 448``, ``q = clip(x / s)``.
===========================  =======================================================================

Exact arithmetic under XLA. XLA's algebraic simplifier rewrites ``A / broadcast(B)`` and ``A / constant``
into ``A * (1 / B)``, which differs from IEEE division in the last bit for ~30-55% of inputs (measured).
:func:`div_rn` defeats that rewrite so ``x / s`` really is a correctly rounded division, as it is in torch
on CPU; it also folds ``1 / (a / 448)`` into ``448 / a`` and turns ``A * (1 / B)`` back into ``A / B``, so
the scale and the per-block reciprocal pass through ``optimization_barrier`` (small arrays only). ``jnp.log2``
is not correctly rounded (measured: ``log2(2**-10 * (1 + 2**-22))`` gives
``-9.999999`` where torch gives ``-10``), so UE8M0 is computed from the float's bits by
:func:`ceil_pow2`, which equals ``2 ** ceil(RN(log2(s)))`` with a correctly rounded fp32 log2, i.e. torch's
``_ceil_to_ue8m0`` / ``exp2(ceil(log2(s)))`` on CPU. XLA CPU flushes float32 subnormals, hence integer bit
arithmetic there and in :func:`cast_to_e4m3` (which is also faster than XLA's own convert on CPU).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
# Floor of amax before dividing; vLLM's per_token_group_quant_fp8 uses eps=1e-10.
SCALE_EPS = 1e-10
BLOCK_SIZE = 128

FP8_DTYPES = {"e4m3": (E4M3, E4M3_MAX), "e5m2": (E5M2, E5M2_MAX)}


def fp8_dtype(name: str):
    """Return ``(jnp dtype, max finite value)`` for ``name`` in {"e4m3", "e5m2"}.

    Raises:
      ValueError: unknown format name.
    """
    try:
        return FP8_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown FP8 format {name!r}; expected one of {sorted(FP8_DTYPES)}") from None


@dataclasses.dataclass(frozen=True)
class QuantRecipe:
    """The rounding details of one scale rule (hashable; pass it as a static argument).

    With ``a = max(amax, amax_floor)``:
    ``s = a * fp32(1/fp8_max)`` if ``scale_by_reciprocal`` else ``a / fp8_max`` (IEEE division);
    ``s = ceil_pow2(s)`` if UE8M0 is requested; ``s = max(s, scale_floor)``;
    ``q = clip(x * (1/s))`` if ``value_by_reciprocal`` else ``clip(x / s)``, clipped to +-fp8_max, then cast
    with round-to-nearest-even.

    Attributes:
      name: the vLLM/DeepGEMM function this recipe reproduces (documentation only).
      amax_floor: floor on the block's absolute maximum, before the division (0 = none).
      scale_floor: floor on the scale, after UE8M0 rounding (0 = none).
      scale_by_reciprocal: multiply amax by the fp32 constant ``1/fp8_max`` instead of dividing.
      value_by_reciprocal: multiply values by ``1/s`` (one correctly rounded reciprocal per block).
    """

    name: str
    amax_floor: float = 0.0
    scale_floor: float = 0.0
    scale_by_reciprocal: bool = False
    value_by_reciprocal: bool = False


# vLLM's _FP8_MIN_SCALING_FACTOR = 1 / (448 * 512): a 0-amax group gets this scale.
VLLM_MIN_SCALING_FACTOR = 1.0 / (E4M3_MAX * 512.0)

VLLM_BLOCK_CAST = QuantRecipe("vllm.utils.deep_gemm.per_block_cast_to_fp8", amax_floor=1e-4,
                              value_by_reciprocal=True)
VLLM_GROUP_NATIVE = QuantRecipe("vllm QuantFP8(group (1,128)).forward_native",
                                scale_floor=VLLM_MIN_SCALING_FACTOR)
VLLM_GROUP_TRITON = QuantRecipe("vllm per_token_group_quant_fp8 (Triton kernel)", amax_floor=SCALE_EPS,
                                scale_by_reciprocal=True)
VLLM_TENSOR_NATIVE = QuantRecipe("vllm QuantFP8(PER_TENSOR/PER_TOKEN).forward_native",
                                 scale_floor=VLLM_MIN_SCALING_FACTOR, value_by_reciprocal=True)
CONTRACT = QuantRecipe("DESIGN.md: max(amax, 1e-10)/448, x/s", amax_floor=SCALE_EPS)
# Gradients (e5m2, FP8 training): only a floor that keeps the scale a normal float32.
GRAD_E5M2 = QuantRecipe("gradient e5m2 groups", amax_floor=1e-30)

WEIGHT_RECIPE = VLLM_BLOCK_CAST
ACTIVATION_RECIPE = VLLM_GROUP_NATIVE

RECIPES = {r.name: r for r in (VLLM_BLOCK_CAST, VLLM_GROUP_NATIVE, VLLM_GROUP_TRITON, VLLM_TENSOR_NATIVE,
                               CONTRACT, GRAD_E5M2)}


def div_rn(a, b, *, ptx: bool = False):
    """Correctly rounded float32 ``a / b`` (IEEE round-to-nearest-even), broadcasting like ``a / b``.

    XLA rewrites ``A / broadcast(B)`` and ``A / constant`` into ``A * (1/B)``; adding ``min(|a|, 0)`` to the
    divisor (zero unless ``a`` is NaN) hides the broadcast from that rewrite.
    Lowered for CUDA, XLA:GPU compiles a float32 division to the approximate PTX ``div.full.f32`` (up to 2 ulp off;
    seen in the sm_90a PTX of a deviceless compile), so that platform gets :func:`div_rn_f64`, one float64 division
    rounded to float32 (``jax.lax.platform_dependent``: the CPU keeps its IEEE float32 division).
    Inside a Pallas Triton kernel (``ptx=True``) Triton's ``arith.divf`` is also ``div.full.f32``, so the PTX
    ``div.rn.f32`` instruction is emitted instead.

    Args:
      a, b: float32 arrays or Python scalars (at least one an array).
      ptx: emit inline ``div.rn.f32`` (only valid inside a Pallas kernel lowered with Triton).

    Returns:
      float32 array of the broadcast shape.
    """
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    if ptx:
        from jax.experimental.pallas import triton as plgpu

        a = jnp.broadcast_to(a, shape)
        b = jnp.broadcast_to(b, shape)
        (out,) = plgpu.elementwise_inline_asm(
            "div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=r,r,r", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)])
        return out
    a, b = jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape)
    return lax.platform_dependent(a, b, cuda=div_rn_f64, default=_div_ieee)


def _div_ieee(a, b):
    """XLA's float32 division, kept a division (see :func:`div_rn`): IEEE on the CPU, ``div.full.f32`` on CUDA.

    The divisor gets ``min(|a|, 0)`` added: zero for every ``a`` but NaN (so ``inf / s`` stays ``inf``, which the
    FP8 clip saturates to the format's maximum as torch does), and not a constant to XLA, which therefore cannot
    turn ``A / broadcast(B)`` into ``A * (1 / B)``. A divisor of ``-0.0`` becomes ``+0.0`` (scales are positive)."""
    return lax.div(a, b + jnp.minimum(jnp.abs(a), 0.0))


_F64_SHIFT_DOWN, _F64_SHIFT_UP = 2.0 ** -64, 2.0 ** 64  # exact on every float32 value in float64


def div_rn_f64(a, b):
    """Correctly rounded float32 ``a / b`` through one float64 division: ``f32(f64(a) / f64(b))``.

    Rounding the float64 quotient to float32 again gives IEEE's float32 quotient: double rounding is innocuous for
    division when the wider format has at least ``2p + 2`` bits (53 >= 2 * 24 + 2; S. Figueroa, "When is double
    rounding innocuous?", SIGNUM 1995). XLA:GPU compiles a float64 division to ``div.rn.f64`` (NVPTX has no
    approximate float64 division; its float32 one is ``div.full.f32``, ``-nvptx-prec-divf32=1``), so this is the
    CUDA branch of :func:`div_rn` and of :func:`scale_values`: five operations where an integer long division of
    the significands (scales) and an approximate quotient fixed up near the FP8 rounding midpoints (values) made
    fusions of ~250 and ~130 HLO instructions at each quantization site (XLA:GPU compiled the engine's FP8 decode
    step 5.8 s slower per decoder layer with those: ``benchmarks/compile_stages.py``). Float64 is enabled for these
    operations only (``jax.enable_x64``); the inputs and the result are float32. Should XLA rewrite the division
    into ``a * (1 / b)`` (it does so for a broadcast divisor), a normal float32 result is still IEEE's: that product
    is within ``2**-52`` (relative) of the quotient, and a quotient of two float32 values that is not a rounding
    midpoint lies at least ``2**-49`` from every midpoint of the normal range (a subnormal quotient may then be
    one unit off; scales and reciprocals are never subnormal, and such values quantize to FP8 zero). Zeros,
    infinities and NaN follow IEEE.

    Args:
      a, b: float32 arrays of one shape (or broadcastable).

    Returns:
      float32 array of the broadcast shape.
    """
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    with jax.enable_x64(True):
        # LLVM folds fptrunc(fdiv(fpext a, fpext b)) back into a float32 fdiv (legal: the same value), which NVPTX
        # then emits as div.full.f32. The exact power-of-two scalings around the division hide the pattern
        # (tests/test_quant_gpu_compile.py reads div.rn.f64 in the sm_90a PTX).
        q = lax.div(a.astype(jnp.float64) * _F64_SHIFT_DOWN, b.astype(jnp.float64))
        return (q * _F64_SHIFT_UP).astype(jnp.float32)


_LN2_Q32 = np.uint32(2977044471)  # floor(ln(2) * 2**32)


def _pow2_from_int(n):
    """Exact ``2.0 ** n`` in float32 for int32 ``n`` (``n >= 128`` -> inf, ``n < -149`` -> 0), from the bits.

    Built from integer bit patterns only: XLA on CPU flushes float32 subnormals to zero in arithmetic.
    """
    normal = lax.shift_left(jnp.clip(n + 127, 1, 255).astype(jnp.int32), jnp.int32(23))
    sub = lax.shift_left(jnp.int32(1), jnp.clip(n + 149, 0, 22).astype(jnp.int32))
    bits = jnp.where(n >= -126, normal, jnp.where(n >= -149, sub, 0))
    return lax.bitcast_convert_type(bits, jnp.float32)


def ceil_pow2(s):
    """UE8M0 rounding: ``2 ** ceil(log2(s))`` with a correctly rounded float32 log2 (torch on CPU).

    ``s = 2**e * (1 + m * 2**-23)``: ``RN(log2(s))`` rounds back down to ``e`` when ``m`` is tiny, namely when
    ``log2(1 + m 2**-23)`` is below half a float32 step at ``e``; that happens for ``m <= T(e)`` with
    ``T(e) = floor(ln2 * 2**(k-1))``, ``k`` the exponent of that half step (``floor(log2 e)`` for ``e > 0``,
    ``ceil(log2 -e) - 1`` for ``e < 0``). Matches ``torch.pow(2, torch.ceil(torch.log2(s)))`` (vLLM
    ``_ceil_to_ue8m0``) on every exponent with the 80 smallest and 50 largest mantissas, subnormals included;
    ``jnp.log2`` does not. Integer bit arithmetic only (no float ops on subnormals, which XLA CPU flushes).

    Args:
      s: float32 array (its absolute value is used, as vLLM does; NaN and inf pass through; 0 gives 0).

    Returns:
      float32 array of powers of two, same shape.
    """
    s = jnp.abs(jnp.asarray(s, jnp.float32))
    bits = lax.bitcast_convert_type(s, jnp.int32)
    ef = lax.shift_right_logical(bits, jnp.int32(23))  # biased exponent field (s >= 0)
    mf = lax.bitwise_and(bits, jnp.int32(0x7FFFFF))
    # Subnormals: value = mf * 2**-149 = 2**(p-149) * (1 + frac), p = index of mf's top bit.
    p = 31 - lax.clz(jnp.maximum(mf, 1))
    sub_m = lax.bitwise_and(lax.shift_left(mf, jnp.clip(23 - p, 0, 31)), jnp.int32(0x7FFFFF))
    e = jnp.where(ef == 0, p - 149, ef - 127)
    m = jnp.where(ef == 0, sub_m, mf)
    a = jnp.abs(e)
    k = jnp.where(e > 0, 31 - lax.clz(a), 31 - lax.clz(jnp.maximum(a - 1, 0)))
    shift = jnp.clip(33 - k, 0, 31).astype(jnp.uint32)
    thr = lax.shift_right_logical(jnp.full(k.shape, _LN2_Q32, jnp.uint32), shift).astype(jnp.int32)
    thr = jnp.where((k >= 2) & (e != 0), thr, 0)
    n = jnp.where(m <= thr, e, e + 1)
    out = _pow2_from_int(n)
    out = jnp.where(bits == 0, jnp.float32(0), out)
    return jnp.where(ef == 255, s, out)  # inf / NaN pass through


def compute_scale(amax: jnp.ndarray, fp8_max: float = E4M3_MAX, ue8m0: bool = False, eps: float = SCALE_EPS,
                  *, recipe: QuantRecipe | None = None, ptx: bool = False) -> jnp.ndarray:
    """Per-block dequantization scale ``scale_inv`` from the block's absolute maximum.

    Args:
      amax: array of block maxima (any shape), ``>= 0``; computed in float32.
      fp8_max: largest finite value of the target format (448 for e4m3).
      ue8m0: round the scale up to a power of two (``2**ceil(log2(s))``), DeepGEMM's UE8M0 scale format.
      eps: floor applied to ``amax`` so all-zero blocks get a tiny positive scale (vLLM kernels: 1e-10);
        ignored when ``recipe`` is given.
      recipe: the rounding details (:class:`QuantRecipe`); default: ``max(amax, eps) / fp8_max`` with IEEE
        division (the DESIGN.md contract).
      ptx: inside a Pallas Triton kernel (see :func:`div_rn`).

    Returns:
      float32 array of the same shape, ``> 0`` for finite input (NaN/inf propagate).
    """
    if recipe is None:
        recipe = dataclasses.replace(CONTRACT, amax_floor=eps)
    a = jnp.asarray(amax).astype(jnp.float32)
    if recipe.amax_floor > 0:
        a = jnp.maximum(a, jnp.float32(recipe.amax_floor))
    if recipe.scale_by_reciprocal:
        s = a * jnp.float32(1.0 / fp8_max)
    else:
        s = div_rn(a, fp8_max, ptx=ptx)
    if ue8m0:
        s = ceil_pow2(s)
    if recipe.scale_floor > 0:
        s = jnp.maximum(s, jnp.float32(recipe.scale_floor))
    if not ptx:
        # XLA folds ``1 / (a / 448)`` into ``448 / a``; the barrier (on the small scale array only) keeps the
        # scale a value, so the reciprocal in :func:`scale_values` is ``RN(1 / s)`` as in torch.
        s = lax.optimization_barrier(s)
    return s


def to_f32_exact(x):
    """Exact upcast to float32; bfloat16 goes through its bits (``u32(bits) << 16``).

    Same values as ``x.astype(float32)``. On XLA CPU the bit form keeps the quantizer at one read of the
    input: with a plain ``convert`` next to the bf16 amax reductions, XLA rewrites the reductions' input into
    ``convert(convert(x))`` and materializes it (measured 115 ms vs 62 ms for a 64 MB bf16 weight).
    """
    if x.dtype == jnp.bfloat16:
        u = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
        return lax.bitcast_convert_type(lax.shift_left(u, jnp.uint32(16)), jnp.float32)
    return x.astype(jnp.float32)


def cast_to_e4m3(v):
    """Saturating round-to-nearest-even float32 -> ``float8_e4m3fn`` with integer bit arithmetic.

    Same bits as ``jnp.clip(v, -448, 448).astype(float8_e4m3fn)`` (tested on every e4m3 value and midpoint
    +-3 float32 ulps, both signs, the subnormal range, +-inf, 1.2M random values and a stride through all
    2**32 float32 bit patterns; NaN -> NaN, -0 -> -0), and faster on XLA CPU, where its own convert is the
    quantizer's bottleneck. The
    clip is one integer ``min`` on the magnitude bits (inf saturates to 448). Rounding: with ``eb`` the
    float32 biased exponent of ``|v|`` floored at 121 (``2**-6``, e4m3's smallest normal), ``C = 2**(eb-107)``
    has a float32 spacing equal to e4m3's spacing at ``|v|`` (``2**(e-3)``, or ``2**-9`` in the subnormal
    range), so the IEEE sum ``|v| + C`` rounds ``|v|`` to the e4m3 grid with ties to even, and
    ``bits(|v| + C) - bits(C)`` counts grid steps above ``C``; adding ``8 * (eb - 121)`` turns the count into
    the e4m3 code for normal and subnormal values alike (a carry into the next binade lands on its code).
    int32 lanes throughout (signed compares are one instruction on x86).

    Args:
      v: float array (computed in float32), any shape.

    Returns:
      ``float8_e4m3fn`` array of ``v``'s shape.
    """
    i32 = jnp.int32
    bits = lax.bitcast_convert_type(v.astype(jnp.float32), i32)
    mag0 = bits & i32(0x7FFFFFFF)
    mag = jnp.minimum(mag0, i32(0x43E00000))  # 448.0: saturate (inf included)
    eb = jnp.maximum(lax.shift_right_logical(mag, i32(23)), i32(121))
    cbits = lax.shift_left(eb, i32(23)) + i32(20 << 23)
    total = lax.bitcast_convert_type(mag, jnp.float32) + lax.bitcast_convert_type(cbits, jnp.float32)
    code = lax.bitcast_convert_type(total, i32) - cbits + lax.shift_left(eb, i32(3)) - i32(968)
    code = jnp.where(mag0 > i32(0x7F800000), i32(0x7F), code)  # NaN
    code = code | (lax.shift_right_logical(bits, i32(24)) & i32(0x80))
    return lax.bitcast_convert_type(code.astype(jnp.uint8), E4M3)


def block_amax(x, axis, *, keepdims: bool = False, ptx: bool = False):
    """Absolute maximum of ``x`` over ``axis`` as float32: ``max(max(x), -min(x))``, in ``x``'s own dtype.

    Exact (max/min/negation are exact in any float dtype). Written as two plain reductions rather than
    ``max(|x|)``: on XLA CPU the plain max/min reductions take a vectorized path (7 ms vs 52-98 ms for a 64 MB
    bf16 weight, measured) and propagate NaN, so a block holding NaN or inf gets a non-finite scale, which is
    how non-finite inputs are detected. Triton's ``maxnumf`` ignores NaN, so with ``ptx`` NaN is first mapped to
    +inf.
    """
    if ptx:
        x = jnp.where(x != x, jnp.asarray(jnp.inf, x.dtype), x)
    amax = jnp.maximum(jnp.max(x, axis=axis, keepdims=keepdims), -jnp.min(x, axis=axis, keepdims=keepdims))
    return jnp.abs(amax.astype(jnp.float32))  # abs: an all-(-0.0) block gives +0


def scale_values(x: jnp.ndarray, scale: jnp.ndarray, fp8_dtype=E4M3, fp8_max: float = E4M3_MAX, *,
                 recipe: QuantRecipe = CONTRACT, ptx: bool = False) -> jnp.ndarray:
    """Quantize ``x`` with a broadcastable ``scale``: ``cast(clip(x / scale, +-fp8_max))`` (or ``x * (1/s)``).

    Args:
      x: float array (computed in float32).
      scale: float32 array broadcastable to ``x`` (the ``scale_inv`` of each element's block).
      fp8_dtype, fp8_max: target format.
      recipe: only ``value_by_reciprocal`` is read.
      ptx: inside a Pallas Triton kernel.

    Returns:
      ``fp8_dtype`` array of ``x``'s shape. Round-to-nearest-even; never NaN for finite ``x``.
    """
    xf = x.astype(jnp.float32)
    if recipe.value_by_reciprocal:
        r = div_rn(1.0, scale, ptx=ptx)
        if not ptx:
            # XLA rewrites ``A * (1 / B)`` back into ``A / B``; the barrier on the (small, per-block) reciprocal
            # hides it from that pattern.
            r = lax.optimization_barrier(r)
        v = xf * r
    elif ptx:
        v = div_rn(xf, scale, ptx=True)
    else:  # a per-element division: IEEE on the CPU, through float64 on CUDA (div_rn_f64)
        scale = jnp.broadcast_to(jnp.asarray(scale, jnp.float32), xf.shape)
        v = lax.platform_dependent(xf, scale, cuda=div_rn_f64, default=_div_ieee)
    return _cast_fp8(v, fp8_dtype, fp8_max, ptx=ptx)


def _cast_fp8(v, fp8_dtype, fp8_max: float, *, ptx: bool):
    """``cast(clip(v, +-fp8_max))`` with round-to-nearest-even.

    e4m3 outside kernels: :func:`cast_to_e4m3` (integer bit arithmetic, faster than XLA:CPU's convert) where the
    program is lowered for the CPU; XLA's own convert where it is lowered for CUDA (one ``cvt.rn.satfinite`` per
    pair; the bit arithmetic would make XLA:GPU write int32 intermediates the size of the tensor between fusions).
    Same bits either way."""
    e4m3 = not ptx and jnp.dtype(fp8_dtype) == jnp.dtype(E4M3) and fp8_max <= E4M3_MAX
    if not e4m3:
        return jnp.clip(v, -fp8_max, fp8_max).astype(fp8_dtype)
    if fp8_max < E4M3_MAX:  # cast_to_e4m3 saturates at 448 itself
        v = jnp.clip(v, -fp8_max, fp8_max)
    return lax.platform_dependent(v, cuda=lambda a: jnp.clip(a, -E4M3_MAX, E4M3_MAX).astype(E4M3), default=cast_to_e4m3)
