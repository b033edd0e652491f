"""FP8 ``dot_general`` (W8A8) with ``jax.lax.dot_general``'s signature, for ``nnx.Linear`` / ``nnx.Einsum``.

Blockwise (DeepSeek-V3 / DeepGEMM / vLLM ``w8a8_block_fp8_matmul``): the lhs (activations) is quantized to
e4m3 in 1 x 128 groups along the contracting dimension, the rhs (weights) in 128 x 128 blocks over
(non-contracting, contracting), both on the fly, and
``y[m, n] = sum_kb (xq[m, kb] . wq[n, kb]) * xs[m, kb] * ws[n // 128, kb]`` accumulated in float32.
Per-tensor: one scale per operand, ``y = (xq . wq) * xs * ws``.

Layout rule. Any ``dimension_numbers`` with at least one contracting dimension are accepted: batch dims go
first, the lhs free dims are flattened into M, the rhs free dims into N, the contracting dims (in the order
given) into K, so the weight is viewed as ``[N, K]``, the HF/vLLM ``[out, in]`` layout (``nnx.Linear``'s
``[in, out]`` kernel and an Einsum ``"...d,dnh->...nh"`` kernel both map onto it; multi-dim contractions such
as ``"...nh,nhd->...d"`` flatten ``(n, h)`` into K as vLLM's ``o_proj`` does).

Implementations (``impl``): ``"dequant"`` dequantizes both operands (``q * s`` rounded once to float32; exact for UE8M0
power-of-two scales) and runs one float32 (or
``dequant_dtype``) matmul; the CPU default. ``"blocked"`` multiplies real e4m3 operands per K-block with
``lax.dot_general(..., preferred_element_type=float32)`` and applies the scales in float32.
``"pallas"`` is the fused Pallas GEMM of :mod:`fp8rl_jax.fp8.pallas_gemm` (interpret mode where the program is not
lowered for CUDA). ``"auto"`` is ``"pallas"`` (``"blocked"`` for e5m2 x e4m3) where the program is lowered for CUDA and
``"dequant"`` elsewhere (:func:`fp8rl_jax.fp8.kernels.choose`). All compute the same sum; only the order of float32
additions differs.

Gradients: both functions are differentiable with a straight-through estimator (``custom_vjp``): the
cotangents are those of the exact ``lax.dot_general`` on the unquantized inputs, in the inputs' precision.
For FP8 training with bf16 or e5m2 gradients use :mod:`fp8rl_jax.fp8.training`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from fp8rl_jax.fp8.formats import (ACTIVATION_RECIPE, BLOCK_SIZE, VLLM_TENSOR_NATIVE, WEIGHT_RECIPE, QuantRecipe,
                                   block_amax, compute_scale, fp8_dtype, scale_values)
from fp8rl_jax.fp8.kernels import choose
from fp8rl_jax.fp8.quant import _quantize_blocks, _quantize_groups

IMPLS = ("auto", "dequant", "blocked", "pallas")


# ----------------------------------------------------------------------------------------------------------
# Canonical form: lhs -> X [B, M, K], rhs -> W [B, N, K], out [B, M, N] -> batch + lhs_free + rhs_free.


@dataclasses.dataclass(frozen=True)
class DotSpec:
    """Static description of a ``dot_general`` in canonical ``[B, M, K] x [B, N, K] -> [B, M, N]`` form."""

    lhs_perm: tuple
    rhs_perm: tuple
    batch_shape: tuple
    m_shape: tuple
    n_shape: tuple
    lhs_k_shape: tuple
    rhs_k_shape: tuple

    @property
    def b(self) -> int:
        return math.prod(self.batch_shape)

    @property
    def m(self) -> int:
        return math.prod(self.m_shape)

    @property
    def n(self) -> int:
        return math.prod(self.n_shape)

    @property
    def k(self) -> int:
        return math.prod(self.lhs_k_shape)

    @property
    def out_shape(self) -> tuple:
        return self.batch_shape + self.m_shape + self.n_shape

    def lhs_to_canonical(self, x):
        """lhs -> ``[B, M, K]`` (transpose + reshape)."""
        return jnp.transpose(x, self.lhs_perm).reshape(self.b, self.m, self.k)

    def rhs_to_canonical(self, w):
        """rhs -> ``[B, N, K]``."""
        return jnp.transpose(w, self.rhs_perm).reshape(self.b, self.n, self.k)

    def lhs_from_canonical(self, x):
        """Inverse of :meth:`lhs_to_canonical` (used for cotangents)."""
        x = x.reshape(self.batch_shape + self.m_shape + self.lhs_k_shape)
        return jnp.transpose(x, _inverse_perm(self.lhs_perm))

    def rhs_from_canonical(self, w):
        """Inverse of :meth:`rhs_to_canonical`."""
        w = w.reshape(self.batch_shape + self.n_shape + self.rhs_k_shape)
        return jnp.transpose(w, _inverse_perm(self.rhs_perm))


def _inverse_perm(perm):
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


def _norm_dims(dims, ndim, what):
    out = []
    for d in dims:
        d = int(d)
        if not -ndim <= d < ndim:
            raise ValueError(f"fp8 dot_general: {what} dimension {d} out of range for a {ndim}-d operand")
        out.append(d % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"fp8 dot_general: repeated {what} dimensions {tuple(dims)}")
    return tuple(out)


def dot_spec(lhs_shape, rhs_shape, dimension_numbers) -> DotSpec:
    """Validate ``dimension_numbers`` and build the canonical :class:`DotSpec`.

    Raises:
      ValueError: no contracting dimension (the blockwise layout quantizes along K, so an outer product has
        nothing to group), mismatched contracting or batch sizes, out-of-range or repeated dims.
    """
    try:
        (lc, rc), (lb, rb) = dimension_numbers
    except (TypeError, ValueError):
        raise ValueError(f"fp8 dot_general: dimension_numbers must be ((lhs_contract, rhs_contract), "
                         f"(lhs_batch, rhs_batch)), got {dimension_numbers!r}") from None
    ln, rn = len(lhs_shape), len(rhs_shape)
    lc, rc = _norm_dims(lc, ln, "lhs contracting"), _norm_dims(rc, rn, "rhs contracting")
    lb, rb = _norm_dims(lb, ln, "lhs batch"), _norm_dims(rb, rn, "rhs batch")
    if not lc:
        raise ValueError("fp8 dot_general: the FP8 blockwise layout needs at least one contracting dimension "
                         "(activations are quantized in 1x128 groups along it, weights in 128x128 blocks); "
                         "got none (an outer product). Use jax.lax.dot_general for this contraction.")
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise ValueError(f"fp8 dot_general: contracting/batch dims differ in count: {dimension_numbers!r}")
    if set(lc) & set(lb) or set(rc) & set(rb):
        raise ValueError(f"fp8 dot_general: a dimension is both batch and contracting: {dimension_numbers!r}")
    for a, b in zip(lc, rc):
        if lhs_shape[a] != rhs_shape[b]:
            raise ValueError(f"fp8 dot_general: contracting sizes differ: lhs dim {a} = {lhs_shape[a]} vs "
                             f"rhs dim {b} = {rhs_shape[b]} (shapes {tuple(lhs_shape)}, {tuple(rhs_shape)})")
    for a, b in zip(lb, rb):
        if lhs_shape[a] != rhs_shape[b]:
            raise ValueError(f"fp8 dot_general: batch sizes differ: lhs dim {a} = {lhs_shape[a]} vs "
                             f"rhs dim {b} = {rhs_shape[b]}")
    lf = tuple(d for d in range(ln) if d not in lc and d not in lb)
    rf = tuple(d for d in range(rn) if d not in rc and d not in rb)
    return DotSpec(
        lhs_perm=lb + lf + lc, rhs_perm=rb + rf + rc,
        batch_shape=tuple(lhs_shape[d] for d in lb), m_shape=tuple(lhs_shape[d] for d in lf),
        n_shape=tuple(rhs_shape[d] for d in rf), lhs_k_shape=tuple(lhs_shape[d] for d in lc),
        rhs_k_shape=tuple(rhs_shape[d] for d in rc))


# ----------------------------------------------------------------------------------------------------------
# Quantized operands in canonical form and their scaled product.


@dataclasses.dataclass(frozen=True)
class OperandQuant:
    """How one canonical operand ``[B, R, K]`` is quantized along its contracting axis K.

    Attributes:
      granularity: ``"group"`` (1 x block_size, activations), ``"block"`` (block_size x block_size, weights) or
        ``"tensor"`` (one scale).
      fp8: ``"e4m3"`` or ``"e5m2"``.
      recipe: rounding details (:class:`~fp8rl_jax.fp8.formats.QuantRecipe`).
    """

    granularity: str = "group"
    fp8: str = "e4m3"
    recipe: QuantRecipe = ACTIVATION_RECIPE


def _fmt(name):
    dt, mx = fp8_dtype(name)
    return jnp.dtype(dt), float(mx)


def quantize_operand(a, oq: OperandQuant, block_size: int, ue8m0: bool):
    """Quantize a canonical operand ``a [B, R, K]``.

    Returns:
      ``(q [B, R, K] fp8, row_scales [B, R, ceil(K/bs)] float32)``: the scale that multiplies each
      ``(row, K-block)`` (block and tensor scales broadcast to rows).
    """
    dt, mx = _fmt(oq.fp8)
    bsz, r, k = a.shape
    kb = -(-k // block_size)
    if oq.granularity == "group":
        return _quantize_groups(a, group_size=block_size, ue8m0=ue8m0, fp8_dtype=dt, fp8_max=mx, recipe=oq.recipe)
    if oq.granularity == "block":
        q, s = _quantize_blocks(a, bn=block_size, bk=block_size, ue8m0=ue8m0, fp8_dtype=dt, fp8_max=mx,
                                recipe=oq.recipe)
        return q, jnp.repeat(s, block_size, axis=1)[:, :r]
    if oq.granularity == "tensor":
        s = compute_scale(block_amax(a, None), mx, False, recipe=oq.recipe)
        q = scale_values(a, s, dt, mx, recipe=oq.recipe)
        return q, jnp.broadcast_to(s, (bsz, r, kb))
    raise ValueError(f"unknown granularity {oq.granularity!r}; expected 'group', 'block' or 'tensor'")


def _dequant_rows(q, row_scales, block_size, dtype):
    bsz, r, k = q.shape
    kb = row_scales.shape[-1]
    qf = q.astype(jnp.float32)
    if kb * block_size == k:
        out = (qf.reshape(bsz, r, kb, block_size) * row_scales[..., None]).reshape(bsz, r, k)
    else:
        out = qf * jnp.repeat(row_scales, block_size, axis=-1)[..., :k]
    return out.astype(dtype)


def scaled_matmul(xq, xs, wq, ws, *, block_size: int = BLOCK_SIZE, impl: str = "dequant",
                  dequant_dtype=jnp.float32, w_block_scales=None):
    """``y[b, m, n] = sum_kb (xq[b, m, kb] . wq[b, n, kb]) * xs[b, m, kb] * ws[b, n, kb]`` in float32.

    Args:
      xq: ``[B, M, K]`` fp8; xs: float32 ``[B, M, KB]`` (row scales).
      wq: ``[B, N, K]`` fp8; ws: float32 ``[B, N, KB]`` (row scales, block scales repeated).
      block_size: K-block length.
      impl: ``"dequant"``, ``"blocked"`` or ``"pallas"`` (``"pallas"`` needs ``w_block_scales``
        ``[B, ceil(N/bs), KB]``).
      dequant_dtype: matmul dtype of the ``"dequant"`` path (float32 is exact for the dequantized values).

    Returns:
      float32 ``[B, M, N]``.
    """
    if impl == "dequant":
        xd = _dequant_rows(xq, xs, block_size, dequant_dtype)
        wd = _dequant_rows(wq, ws, block_size, dequant_dtype)
        return jnp.einsum("bmk,bnk->bmn", xd, wd, preferred_element_type=jnp.float32)
    if impl == "blocked":
        bsz, m, k = xq.shape
        n = wq.shape[1]
        kb = xs.shape[-1]
        pad = kb * block_size - k
        if pad:
            xq = jnp.pad(xq, ((0, 0), (0, 0), (0, pad)))
            wq = jnp.pad(wq, ((0, 0), (0, 0), (0, pad)))
        xb = jnp.moveaxis(xq.reshape(bsz, m, kb, block_size), 2, 0)
        wb = jnp.moveaxis(wq.reshape(bsz, n, kb, block_size), 2, 0)
        xsb, wsb = jnp.moveaxis(xs, 2, 0), jnp.moveaxis(ws, 2, 0)

        def step(acc, inp):
            xk, wk, xsk, wsk = inp
            d = lax.dot_general(xk, wk, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32)
            return acc + d * xsk[:, :, None] * wsk[:, None, :], None

        acc, _ = lax.scan(step, jnp.zeros((bsz, m, n), jnp.float32), (xb, wb, xsb, wsb))
        return acc
    if impl == "pallas":
        from fp8rl_jax.fp8.pallas_gemm import pallas_w8a8_matmul

        if w_block_scales is None:
            raise ValueError("scaled_matmul(impl='pallas') needs w_block_scales [B, ceil(N/bs), KB]")
        return jax.vmap(lambda a, b, c, d: pallas_w8a8_matmul(a, b, c, d, block_size=block_size))(
            xq, xs, wq, w_block_scales)
    raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS[1:]}")


def kernel_impl(x_op: OperandQuant, w_op: OperandQuant) -> str:
    """The implementation a CUDA program runs for these operands: ``"pallas"`` (the W8A8 GEMM kernel) for 1x128
    groups x 128x128 blocks of one FP8 format, else ``"blocked"`` (XLA's FP8 ``dot_general`` per K-block: the
    Pallas-Triton kernel needs equal operand types, so e5m2 gradients x e4m3 weights take XLA's FP8 dot)."""
    if x_op.granularity == "group" and w_op.granularity == "block" and x_op.fp8 == w_op.fp8:
        return "pallas"
    return "blocked"


# ----------------------------------------------------------------------------------------------------------
# Public dot_generals.


@dataclasses.dataclass(frozen=True)
class Fp8DotConfig:
    """Static configuration of an FP8 dot_general (hashable).

    Attributes:
      scaling: ``"block"`` (W8A8 blockwise) or ``"tensor"`` (per-tensor scales).
      block_size: group/block length along K (and the weight block height), 128.
      ue8m0: power-of-two scales.
      impl: ``"auto"``, ``"dequant"``, ``"blocked"`` or ``"pallas"``.
      dequant_dtype: matmul dtype of the dequant path (float32 or bfloat16).
      act_recipe, weight_recipe: rounding details of the lhs and rhs quantization.
    """

    scaling: str = "block"
    block_size: int = BLOCK_SIZE
    ue8m0: bool = False
    impl: str = "auto"
    dequant_dtype: object = jnp.float32
    act_recipe: QuantRecipe = ACTIVATION_RECIPE
    weight_recipe: QuantRecipe = WEIGHT_RECIPE

    def __post_init__(self):
        if self.scaling not in ("block", "tensor"):
            raise ValueError(f"scaling must be 'block' or 'tensor', got {self.scaling!r}")
        if self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {self.impl!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    def operands(self) -> tuple[OperandQuant, OperandQuant]:
        """(lhs, rhs) quantization: 1x128 e4m3 groups x 128x128 e4m3 blocks, or per-tensor e4m3 for both."""
        if self.scaling == "block":
            return OperandQuant("group", "e4m3", self.act_recipe), OperandQuant("block", "e4m3", self.weight_recipe)
        return (OperandQuant("tensor", "e4m3", VLLM_TENSOR_NATIVE), OperandQuant("tensor", "e4m3", VLLM_TENSOR_NATIVE))


def fp8_forward_canonical(x, w, cfg: Fp8DotConfig, x_op: OperandQuant | None = None,
                          w_op: OperandQuant | None = None):
    """FP8 product of canonical operands ``x [B, M, K]``, ``w [B, N, K]`` -> float32 ``[B, M, N]``.

    ``cfg.impl == "auto"``: :func:`kernel_impl` where the program is lowered for CUDA (the ``w8a8_gemm`` kernel
    family, :func:`fp8rl_jax.fp8.kernels.choose`), ``"dequant"`` elsewhere.
    """
    dx_op, dw_op = cfg.operands()
    x_op, w_op = x_op or dx_op, w_op or dw_op
    if cfg.impl != "auto":
        return _forward_with(x, w, cfg, x_op, w_op, cfg.impl)
    return choose("w8a8_gemm", x, w, kernel=lambda a, b: _forward_with(a, b, cfg, x_op, w_op, kernel_impl(x_op, w_op)),
                  xla=lambda a, b: _forward_with(a, b, cfg, x_op, w_op, "dequant"))


def _forward_with(x, w, cfg: Fp8DotConfig, x_op: OperandQuant, w_op: OperandQuant, impl: str):
    bs = cfg.block_size
    if impl == "pallas" and kernel_impl(x_op, w_op) != "pallas":
        impl = "blocked"
    if cfg.scaling == "tensor" and impl != "dequant":
        # One scale per operand: a single real-FP8 dot, scaled once.
        xq, xs = quantize_operand(x, x_op, bs, cfg.ue8m0)
        wq, ws = quantize_operand(w, w_op, bs, cfg.ue8m0)
        y = lax.dot_general(xq, wq, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32)
        return y * (xs[:, :1, :1] * ws[:, :1, :1])
    xq, xs = quantize_operand(x, x_op, bs, cfg.ue8m0)
    if impl == "pallas":
        dt, mx = _fmt(w_op.fp8)
        wq, wsb = _quantize_blocks(w, bn=bs, bk=bs, ue8m0=cfg.ue8m0, fp8_dtype=dt, fp8_max=mx, recipe=w_op.recipe)
        return scaled_matmul(xq, xs, wq, None, block_size=bs, impl="pallas", w_block_scales=wsb)
    wq, ws = quantize_operand(w, w_op, bs, cfg.ue8m0)
    return scaled_matmul(xq, xs, wq, ws, block_size=bs, impl=impl, dequant_dtype=cfg.dequant_dtype)


def _out_dtype(lhs, rhs, preferred_element_type):
    if preferred_element_type is not None:
        return jnp.dtype(preferred_element_type)
    return jnp.result_type(lhs.dtype, rhs.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _fp8_dot_ste(lhs, rhs, spec: DotSpec, cfg: Fp8DotConfig, out_dtype):
    y = fp8_forward_canonical(spec.lhs_to_canonical(lhs), spec.rhs_to_canonical(rhs), cfg)
    return y.reshape(spec.out_shape).astype(out_dtype)


def _fp8_dot_ste_fwd(lhs, rhs, spec, cfg, out_dtype):
    return _fp8_dot_ste(lhs, rhs, spec, cfg, out_dtype), (lhs, rhs)


def _fp8_dot_ste_bwd(spec, cfg, out_dtype, res, g):
    lhs, rhs = res
    x, w = spec.lhs_to_canonical(lhs), spec.rhs_to_canonical(rhs)
    gc = g.reshape(spec.b, spec.m, spec.n)
    ct = jnp.result_type(lhs.dtype, rhs.dtype)
    dx = jnp.einsum("bmn,bnk->bmk", gc.astype(ct), w.astype(ct), preferred_element_type=jnp.float32)
    dw = jnp.einsum("bmn,bmk->bnk", gc.astype(ct), x.astype(ct), preferred_element_type=jnp.float32)
    return (spec.lhs_from_canonical(dx).astype(lhs.dtype), spec.rhs_from_canonical(dw).astype(rhs.dtype))


_fp8_dot_ste.defvjp(_fp8_dot_ste_fwd, _fp8_dot_ste_bwd)


def _check_inputs(lhs, rhs, out_sharding):
    for name, a in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"fp8 dot_general: {name} must be floating point, got {a.dtype}")
    if out_sharding is not None:
        raise NotImplementedError("fp8 dot_general: out_sharding is not supported; shard the inputs instead")


def make_fp8_dot_general(config: Fp8DotConfig | None = None, **kwargs):
    """Build a ``dot_general`` (``jax.lax.dot_general`` signature) that computes in FP8.

    Args:
      config: an :class:`Fp8DotConfig`; or pass its fields as keyword arguments.

    Returns:
      ``dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
      out_sharding=None)``: lhs = activations, rhs = weights; ``precision`` is ignored (FP8 operands,
      float32 accumulation); the result dtype is ``preferred_element_type`` or the inputs' result type.
      Differentiable (straight-through estimator, exact-dot cotangents).

    Raises (when called):
      ValueError: unsupported ``dimension_numbers`` (see :func:`dot_spec`) or non-float operands.
    """
    cfg = config or Fp8DotConfig(**kwargs)
    dot_general = wrap_dot_general(lambda lhs, rhs, spec, out_dtype: _fp8_dot_ste(lhs, rhs, spec, cfg, out_dtype))
    dot_general.fp8_config = cfg
    dot_general.__doc__ = f"FP8 dot_general ({cfg})."
    return dot_general


def wrap_dot_general(impl):
    """Give ``impl(lhs, rhs, spec, out_dtype)`` the signature of ``jax.lax.dot_general``.

    The returned function converts the operands to arrays, checks them (:func:`_check_inputs`), resolves
    ``dimension_numbers`` with :func:`dot_spec` and the result dtype from ``preferred_element_type``;
    ``precision`` is ignored (the FP8 kernels fix their own precision).

    Raises (when called):
      ValueError: unsupported ``dimension_numbers`` or non-float operands.
    """

    def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
        del precision
        lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
        _check_inputs(lhs, rhs, out_sharding)
        spec = dot_spec(lhs.shape, rhs.shape, dimension_numbers)
        return impl(lhs, rhs, spec, _out_dtype(lhs, rhs, preferred_element_type))

    return dot_general


fp8_block_dot_general = make_fp8_dot_general(Fp8DotConfig(scaling="block"))
fp8_block_dot_general.__doc__ = """W8A8 blockwise FP8 ``dot_general`` (signature of ``jax.lax.dot_general``).

lhs (activations) quantized e4m3 in 1x128 groups along the contracting dims (vLLM ``QuantFP8`` native
rounding), rhs (weights) in 128x128 blocks over ([free], [contracting]) (vLLM ``per_block_cast_to_fp8``
rounding); ``sum_kb (xq . wq) * xs * ws`` in float32; output in ``preferred_element_type`` or the inputs'
dtype. Use as ``nnx.Linear(..., dot_general=fp8_block_dot_general)``. Straight-through gradients.

Raises:
  ValueError: no contracting dimension, mismatched sizes, non-float operands.
"""

fp8_tensor_dot_general = make_fp8_dot_general(Fp8DotConfig(scaling="tensor"))
fp8_tensor_dot_general.__doc__ = """Per-tensor-scaled FP8 ``dot_general`` (signature of ``jax.lax.dot_general``).

Each operand gets one float32 scale (vLLM ``QuantFP8(PER_TENSOR)`` native rounding:
``s = max(amax/448, 1/(448*512))``, ``q = x * (1/s)``); ``y = (xq . wq) * xs * ws`` in float32.
Straight-through gradients.

Raises:
  ValueError: no contracting dimension, mismatched sizes, non-float operands.
"""


def fp8_einsum(subscripts, *operands, dot_general=None, **kwargs):
    """``jnp.einsum`` whose contractions run through an FP8 ``dot_general`` (for ``nnx.Einsum(einsum_op=...)``).

    The second operand of each pairwise contraction is the weight (rhs). Default: blockwise W8A8.
    """
    return jnp.einsum(subscripts, *operands, _dot_general=dot_general or fp8_block_dot_general, **kwargs)
