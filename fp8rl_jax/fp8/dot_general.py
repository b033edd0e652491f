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
``"mosaic"`` is the Mosaic GPU FP8 wgmma GEMM of :mod:`fp8rl_jax.kernels.mosaic_gemm` (Hopper's FP8 tensor cores;
interpret mode where the program is not lowered for CUDA). ``"pallas"`` is the Pallas-Triton GEMM of
:mod:`fp8rl_jax.kernels.pallas_gemm` (f16 ``mma.sync`` on sm_90; explicit requests only). ``"auto"``: where the program is
lowered for CUDA, :func:`cuda_gemm_impl` picks by M (the one place): the Triton split-K decode kernel for M <= 64
(family ``decode_gemm``), the Mosaic kernel otherwise (``w8a8_gemm``), XLA's FP8 dot per K block (``"blocked"``)
for operands the Mosaic kernel cannot take (e5m2 x e4m3, per-tensor scales); ``"dequant"`` elsewhere
(:func:`fp8rl_jax.kernels.registry.choose`). All compute the same sum; only the order of float32 additions differs.

Gradients: both functions are differentiable with a straight-through estimator (``custom_vjp``): the
cotangents are those of the exact ``lax.dot_general`` on the unquantized inputs, in the inputs' precision.
For FP8 training with bf16, e5m2 or e4m3 gradients use :mod:`fp8rl_jax.fp8.training`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from fp8rl_jax.fp8.formats import (ACTIVATION_RECIPE, BLOCK_SIZE, VLLM_TENSOR_NATIVE, WEIGHT_RECIPE, QuantRecipe,
                                   block_amax, compute_scale, fp8_dtype, scale_values, to_f32_exact)
from fp8rl_jax.fp8.quant import _quantize_blocks, _quantize_groups
# mosaic_gemm and decode_gemm_mgpu register the w8a8_gemm and decode_gemm families' self-tests when imported, which
# must happen before a product chooses them (Mosaic GPU itself loads lazily)
from fp8rl_jax.kernels import decode_gemm_mgpu, mosaic_gemm  # noqa: F401
from fp8rl_jax.kernels.pallas_decode import MAX_DECODE_ROWS
from fp8rl_jax.kernels.registry import choose, run_pallas

IMPLS = ("auto", "dequant", "blocked", "pallas", "mosaic")


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


def quantize_transposed(a, oq: OperandQuant, block_size: int, ue8m0: bool):
    """Quantize ``a [B, R, C]`` in 1 x ``block_size`` groups along R (axis 1) and return it transposed, K-major:
    the operand of a product that contracts over R (FP8 training's weight gradient contracts over the tokens).

    The groups are formed in ``a``'s own layout (amax over each 128-row slab of every column, no transposed copy of
    the wide input); only the FP8 result is transposed, so the one transposed copy is of 1-byte values (XLA may
    also write it directly from the quantizing fusion). Same values as quantizing ``swapaxes(a, 1, 2)`` along its
    last axis (:func:`quantize_operand` with ``granularity="group"``): the same amax, scale and rounding per element.

    Args:
      a: ``[B, R, C]`` float array.
      oq: an :class:`OperandQuant` with ``granularity="group"``.
      block_size: group length along R.
      ue8m0: power-of-two scales.

    Returns:
      ``(qT [B, C, R] fp8, scales [B, C, ceil(R/bs)] float32)``.

    Raises:
      ValueError: ``oq.granularity`` is not ``"group"`` or ``a`` is not 3-D.
    """
    if oq.granularity != "group" or a.ndim != 3:
        raise ValueError(f"quantize_transposed needs 1x{block_size} groups of a [B, R, C] array, got "
                         f"{oq.granularity!r} and shape {tuple(a.shape)}")
    dt, mx = _fmt(oq.fp8)
    bsz, r, c = a.shape
    rb = -(-r // block_size)
    ap = a if rb * block_size == r else jnp.pad(a, ((0, 0), (0, rb * block_size - r), (0, 0)))
    ap = ap.reshape(bsz, rb, block_size, c)
    scale = compute_scale(block_amax(ap, 2), mx, ue8m0, recipe=oq.recipe)  # [B, RB, C]
    q = scale_values(to_f32_exact(ap), scale[:, :, None, :], dt, mx, recipe=oq.recipe)
    q = q.reshape(bsz, rb * block_size, c)[:, :r]
    return jnp.swapaxes(q, 1, 2), jnp.swapaxes(scale, 1, 2)


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
                  dequant_dtype=jnp.float32, w_block_scales=None, out_dtype=jnp.float32, interpret=None):
    """``y[b, m, n] = sum_kb (xq[b, m, kb] . wq[b, n, kb]) * xs[b, m, kb] * ws[b, n, kb]`` accumulated in float32.

    Args:
      xq: ``[B, M, K]`` fp8; xs: float32 ``[B, M, KB]`` (row scales).
      wq: ``[B, N, K]`` fp8; ws: float32 ``[B, N, KB]`` (row scales: a 1x128 group's scale, or a 128x128 block's
        repeated over its rows); may be None for ``"pallas"`` / ``"mosaic"`` when ``w_block_scales`` is given.
      block_size: K-block length.
      impl: ``"dequant"``, ``"blocked"``, ``"pallas"`` (needs ``w_block_scales`` ``[B, ceil(N/bs), KB]``) or
        ``"mosaic"`` (the Mosaic GPU wgmma kernel: with ``w_block_scales`` its 128x128-block form, else its 1x128
        row-scale form on ``ws``; needs one FP8 format for both operands and ``block_size == 128``).
      dequant_dtype: matmul dtype of the ``"dequant"`` path (float32 is exact for the dequantized values).
      w_block_scales: optional ``[B, ceil(N/bs), KB]`` block scales of ``wq``.
      out_dtype: result dtype (the Mosaic kernel writes it from its float32 accumulator; the others cast).
      interpret: for ``"mosaic"``: None (default) compiled where the program is lowered for CUDA and Mosaic GPU's
        interpreter elsewhere; True/False forced.

    Returns:
      ``[B, M, N]`` in ``out_dtype`` (float32 by default).

    Raises:
      ValueError: an unknown ``impl``; ``"pallas"`` without ``w_block_scales``; ``"mosaic"`` without either scale.
      NotImplementedError: ``"mosaic"`` with two FP8 formats (Mosaic GPU's wgmma takes one).
    """
    if impl == "dequant":
        xd = _dequant_rows(xq, xs, block_size, dequant_dtype)
        wd = _dequant_rows(wq, ws, block_size, dequant_dtype)
        return jnp.einsum("bmk,bnk->bmn", xd, wd, preferred_element_type=jnp.float32).astype(out_dtype)
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
        return acc.astype(out_dtype)
    if impl == "pallas":
        from fp8rl_jax.kernels.pallas_gemm import pallas_w8a8_matmul

        if w_block_scales is None:
            raise ValueError("scaled_matmul(impl='pallas') needs w_block_scales [B, ceil(N/bs), KB]")
        return jax.vmap(lambda a, b, c, d: pallas_w8a8_matmul(a, b, c, d, block_size=block_size))(
            xq, xs, wq, w_block_scales).astype(out_dtype)
    if impl == "mosaic":
        if w_block_scales is None and ws is None:
            raise ValueError("scaled_matmul(impl='mosaic') needs ws [B, N, KB] or w_block_scales [B, NB, KB]")
        w_scales, scales = ("block", w_block_scales) if w_block_scales is not None else ("row", ws)
        direct = jnp.dtype(out_dtype) in mosaic_gemm.OUT_DTYPES  # else float32 from the kernel, cast here
        y = run_pallas(mosaic_gemm.batched_w8a8_matmul, xq, xs, wq, scales, interpret=interpret,
                       block_size=block_size, out_dtype=jnp.dtype(out_dtype) if direct else jnp.float32,
                       w_scales=w_scales)
        return y if direct else y.astype(out_dtype)
    raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS[1:]}")


# ----------------------------------------------------------------------------------------------------------
# The kernel a CUDA program runs: chosen by M, in one place.

#: Canonical products with at most this many rows (one batch) are decode-sized: on CUDA they take the Triton
#: split-K decode kernel (:mod:`fp8rl_jax.kernels.pallas_decode`, family ``decode_gemm``) when it can compute them.
DECODE_MAX_ROWS = MAX_DECODE_ROWS


def mosaic_operands(x_op: OperandQuant, w_op: OperandQuant, block_size: int = BLOCK_SIZE) -> bool:
    """Whether the Mosaic GPU wgmma GEMM computes this operand pair: lhs in 1 x 128 groups, rhs in 128 x 128 blocks
    (1D2D) or 1 x 128 groups (1D1D), both in one FP8 format (Mosaic GPU's wgmma takes one element type: e5m2
    gradients x e4m3 operands cannot be a Mosaic wgmma), ``block_size`` 128."""
    return (block_size == BLOCK_SIZE and x_op.granularity == "group" and w_op.granularity in ("block", "group")
            and x_op.fp8 == w_op.fp8)


def decode_operands(x_op: OperandQuant, w_op: OperandQuant, ue8m0: bool = False) -> bool:
    """Whether the split-K decode kernel computes this pair: it quantizes the float activations itself (1 x 128
    groups, vLLM ``QuantFP8`` native rounding, :data:`~fp8rl_jax.fp8.formats.ACTIVATION_RECIPE`, no UE8M0) and reads
    a weight in 128 x 128 blocks of the same FP8 format."""
    return (x_op.granularity == "group" and w_op.granularity == "block" and x_op.fp8 == w_op.fp8
            and x_op.recipe == ACTIVATION_RECIPE and not ue8m0)


def cuda_gemm_impl(m: int, *, batch: int = 1, mosaic_ok: bool = True, decode_ok: bool = True) -> tuple[str, str]:
    """The kernel a program lowered for CUDA runs for an FP8 product of ``M`` rows: the one place that decides by M.

    Rules (``M`` is static), in order:

    * ``M <= 64`` (:data:`DECODE_MAX_ROWS`), one batch, and operands the decode kernel computes (``decode_ok``):
      ``("decode_gemm", "swapab")``, the swap-AB split-K Mosaic GPU kernel (:mod:`fp8rl_jax.kernels.decode_gemm_mgpu`,
      issue 37: weights as wgmma's A operand, tokens padded to 8..64 as its N, a 4-8 stage TMA ring, split-K chosen
      for the 132 SMs, activations quantized once outside the kernel). A decode GEMM streams the weight (``2 M`` FLOP
      per weight byte); the Triton split-K kernel it replaces (``impl="fused"``, still available by name) reached
      3-13% of an H200's HBM bandwidth;
    * operands the Mosaic kernel cannot take (``mosaic_ok=False``: e5m2 x e4m3 gradients, per-tensor scales):
      ``(None, "blocked")``, XLA's FP8 ``dot_general`` per K block (XLA's own path: no kernel family, so no
      self-test of a kernel it does not run gates it);
    * everything else, ``M >= 128`` included: ``("w8a8_gemm", "mosaic")``, the Mosaic GPU kernel on e4m3 operands
      (``wgmma...f32.e4m3.e4m3``, DeepGEMM promotion). The band ``64 < M < 128`` takes it too, with 64-row CTAs
      and 64-column tiles (:func:`fp8rl_jax.kernels.mosaic_gemm.default_config`): the Triton decode kernel is built
      for at most 64 rows (its whole M tile sits in registers beside the split-K accumulator) and the Triton
      tiled GEMM it would otherwise be runs f16 ``mma.sync``; the Mosaic 64-row configuration gives
      ``ceil(M / 64) * N / 64`` CTAs (128 at N = 4096) to stream the weight. Unmeasured (no GPU here): tune on
      the device. Batched products (``batch > 1``: FP8 training on MoE expert tiles) always take the Mosaic
      kernel (its grouped form, one weight per batch).

    Returns:
      ``(kernel family or None, impl)`` for :func:`fp8rl_jax.kernels.registry.choose` and :func:`scaled_matmul` /
      :func:`fp8rl_jax.fp8.linear.w8a8_block_matmul`.
    """
    if decode_ok and batch == 1 and m <= DECODE_MAX_ROWS:
        return "decode_gemm", "swapab"
    if not mosaic_ok:
        return None, "blocked"
    return "w8a8_gemm", "mosaic"


def quantized_matmul(xq, xs, wq, ws, *, w_scales: str = "block", impl: str = "auto", block_size: int = BLOCK_SIZE,
                     out_dtype=jnp.float32, dequant_dtype=jnp.float32):
    """FP8 product of pre-quantized canonical operands, ``[B, M, K] x [B, N, K] -> [B, M, N]``, kernel chosen by M.

    ``y[b, m, n] = sum_kb (xq . wq)[b, m, n, kb] * xs[b, m, kb] * ws'[b, n, kb]`` in float32, ``ws'`` the scale of
    ``wq[b, n, kb-block]``: ``ws[b, n // bs, kb]`` (``w_scales="block"``) or ``ws[b, n, kb]`` (``"row"``). With
    ``impl="auto"``: :func:`cuda_gemm_impl` (no decode kernel: it quantizes float activations itself) where the
    program is lowered for CUDA, ``"dequant"`` elsewhere. Used by FP8 training's e4m3 backward.

    Args:
      xq, xs: ``[B, M, K]`` FP8 and ``[B, M, KB]`` float32 scales (1 x bs groups).
      wq, ws: ``[B, N, K]`` FP8 and ``[B, ceil(N/bs), KB]`` or ``[B, N, KB]`` float32 scales.
      w_scales: ``"block"`` or ``"row"``.
      impl: ``"auto"``, ``"dequant"``, ``"blocked"`` or ``"mosaic"`` (interpret mode where not lowered for CUDA).
      block_size: bs (128).
      out_dtype: result dtype. dequant_dtype: matmul dtype of ``"dequant"``.

    Returns:
      ``[B, M, N]`` in ``out_dtype``.

    Raises:
      ValueError: an unknown ``impl`` or ``w_scales``.
    """
    if w_scales not in ("block", "row"):
        raise ValueError(f"quantized_matmul: w_scales must be 'block' or 'row', got {w_scales!r}")
    if impl not in ("auto", "dequant", "blocked", "mosaic"):
        raise ValueError(f"quantized_matmul: impl must be 'auto', 'dequant', 'blocked' or 'mosaic', got {impl!r}")
    n = wq.shape[1]

    def run(a, a_s, b, b_s, how, interpret=None):
        if how == "mosaic":
            blocks = b_s if w_scales == "block" else None
            return scaled_matmul(a, a_s, b, None if blocks is not None else b_s, block_size=block_size, impl="mosaic",
                                 w_block_scales=blocks, out_dtype=out_dtype, interpret=interpret)
        rows = jnp.repeat(b_s, block_size, axis=1)[:, :n] if w_scales == "block" else b_s
        return scaled_matmul(a, a_s, b, rows, block_size=block_size, impl=how, dequant_dtype=dequant_dtype,
                             out_dtype=out_dtype)

    if impl != "auto":
        return run(xq, xs, wq, ws, impl)
    same = jnp.dtype(xq.dtype) == jnp.dtype(wq.dtype) and block_size == BLOCK_SIZE
    family, how = cuda_gemm_impl(xq.shape[1], batch=xq.shape[0], mosaic_ok=same, decode_ok=False)
    return choose(family, xq, xs, wq, ws, kernel=lambda *a: run(*a, how, interpret=False),
                  xla=lambda *a: run(*a, "dequant"))


# ----------------------------------------------------------------------------------------------------------
# Public dot_generals.


@dataclasses.dataclass(frozen=True)
class Fp8DotConfig:
    """Static configuration of an FP8 dot_general (hashable).

    Attributes:
      scaling: ``"block"`` (W8A8 blockwise) or ``"tensor"`` (per-tensor scales).
      block_size: group/block length along K (and the weight block height), 128.
      ue8m0: power-of-two scales.
      impl: ``"auto"``, ``"dequant"``, ``"blocked"``, ``"pallas"`` or ``"mosaic"``.
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
                          w_op: OperandQuant | None = None, out_dtype=jnp.float32):
    """FP8 product of canonical operands ``x [B, M, K]``, ``w [B, N, K]`` -> ``[B, M, N]`` in ``out_dtype``.

    Both are quantized here (``x_op`` / ``w_op``, default ``cfg.operands()``) and multiplied with float32
    accumulation. ``cfg.impl == "auto"``: where the program is lowered for CUDA the kernel of
    :func:`cuda_gemm_impl` (by M: the split-K decode kernel for M <= 64, the Mosaic GPU wgmma GEMM otherwise, XLA's
    FP8 dot for operands Mosaic cannot take; through :func:`fp8rl_jax.kernels.registry.choose`), ``"dequant"`` elsewhere.

    Args:
      x: ``[B, M, K]`` float (lhs, activations or gradients); w: ``[B, N, K]`` float (rhs).
      cfg: an :class:`Fp8DotConfig`.
      x_op, w_op: the operands' quantization (default ``cfg.operands()``).
      out_dtype: result dtype (float32 by default; the Mosaic kernel writes it from its float32 accumulator).

    Returns:
      ``[B, M, N]`` in ``out_dtype``.
    """
    dx_op, dw_op = cfg.operands()
    x_op, w_op = x_op or dx_op, w_op or dw_op
    if cfg.impl != "auto":
        return _forward_with(x, w, cfg, x_op, w_op, cfg.impl, out_dtype)
    family, impl = cuda_gemm_impl(x.shape[1], batch=x.shape[0], mosaic_ok=mosaic_operands(x_op, w_op, cfg.block_size)
                                  and cfg.scaling == "block", decode_ok=decode_operands(x_op, w_op, cfg.ue8m0))
    return choose(family, x, w, kernel=lambda a, b: _forward_with(a, b, cfg, x_op, w_op, impl, out_dtype, False),
                  xla=lambda a, b: _forward_with(a, b, cfg, x_op, w_op, "dequant", out_dtype))


def _forward_with(x, w, cfg: Fp8DotConfig, x_op: OperandQuant, w_op: OperandQuant, impl: str, out_dtype,
                  interpret=None):
    bs = cfg.block_size
    if impl == "pallas" and not (mosaic_operands(x_op, w_op, bs) and w_op.granularity == "block"):
        impl = "blocked"  # the Triton GEMM needs groups x blocks of one FP8 format
    if impl == "mosaic" and not (mosaic_operands(x_op, w_op, bs) and cfg.scaling == "block"):
        impl = "blocked"  # Mosaic GPU's wgmma needs one FP8 format (see mosaic_operands)
    if cfg.scaling == "tensor" and impl != "dequant":
        # One scale per operand: a single real-FP8 dot, scaled once.
        xq, xs = quantize_operand(x, x_op, bs, cfg.ue8m0)
        wq, ws = quantize_operand(w, w_op, bs, cfg.ue8m0)
        y = lax.dot_general(xq, wq, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32)
        return (y * (xs[:, :1, :1] * ws[:, :1, :1])).astype(out_dtype)
    if impl == "swapab":  # the swap-AB decode kernel on e4m3 (decode_operands); other formats: the Triton kernel
        if x.shape[0] != 1:
            raise ValueError(f"the decode kernel takes one batch, got {x.shape[0]} (cuda_gemm_impl never picks it)")
        if jnp.dtype(_fmt(w_op.fp8)[0]) == jnp.dtype(jnp.float8_e4m3fn):
            from fp8rl_jax.kernels.decode_gemm_mgpu import decode_w8a8_matmul

            dt, mx = _fmt(w_op.fp8)
            xq, xs = quantize_operand(x, x_op, bs, False)
            wq, wsb = _quantize_blocks(w, bn=bs, bk=bs, ue8m0=False, fp8_dtype=dt, fp8_max=mx, recipe=w_op.recipe)
            return decode_w8a8_matmul(xq[0], xs[0], wq[0], wsb[0], out_dtype=out_dtype,
                                      interpret=bool(interpret) if interpret is not None else False)[None]
        impl = "fused"
    if impl == "fused":  # the split-K decode kernel quantizes x itself (decode_operands); one batch (cuda_gemm_impl)
        from fp8rl_jax.kernels.pallas_decode import fused_w8a8_decode_matmul

        dt, mx = _fmt(w_op.fp8)
        wq, wsb = _quantize_blocks(w, bn=bs, bk=bs, ue8m0=False, fp8_dtype=dt, fp8_max=mx, recipe=w_op.recipe)
        if x.shape[0] != 1:
            raise ValueError(f"the decode kernel takes one batch, got {x.shape[0]} (cuda_gemm_impl never picks it)")
        return fused_w8a8_decode_matmul(x[0], wq[0], wsb[0], block_size=bs, out_dtype=out_dtype)[None]
    xq, xs = quantize_operand(x, x_op, bs, cfg.ue8m0)
    if impl in ("pallas", "mosaic") and w_op.granularity == "block":
        dt, mx = _fmt(w_op.fp8)
        wq, wsb = _quantize_blocks(w, bn=bs, bk=bs, ue8m0=cfg.ue8m0, fp8_dtype=dt, fp8_max=mx, recipe=w_op.recipe)
        return scaled_matmul(xq, xs, wq, None, block_size=bs, impl=impl, w_block_scales=wsb, out_dtype=out_dtype,
                             interpret=interpret)
    wq, ws = quantize_operand(w, w_op, bs, cfg.ue8m0)
    return scaled_matmul(xq, xs, wq, ws, block_size=bs, impl=impl, dequant_dtype=cfg.dequant_dtype,
                         out_dtype=out_dtype, interpret=interpret)


def _out_dtype(lhs, rhs, preferred_element_type):
    if preferred_element_type is not None:
        return jnp.dtype(preferred_element_type)
    return jnp.result_type(lhs.dtype, rhs.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _fp8_dot_ste(lhs, rhs, spec: DotSpec, cfg: Fp8DotConfig, out_dtype):
    y = fp8_forward_canonical(spec.lhs_to_canonical(lhs), spec.rhs_to_canonical(rhs), cfg, out_dtype=out_dtype)
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
