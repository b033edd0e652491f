"""FP8 training matmuls: forward in e4m3 blockwise, backward in bf16 / e5m2 / e4m3 / float32 (custom VJP).

The FP8-RL report's Experiment 5 ("FP8 end-to-end training") runs the trainer's linear layers in FP8. Here a
``dot_general`` built by :func:`make_fp8_train_dot_general` computes

* forward: the W8A8 blockwise product of :mod:`fp8rl_jax.fp8.dot_general` (activations e4m3 1x128 groups,
  weights e4m3 128x128 blocks, float32 accumulation);
* backward (``grad=``):

  - ``"bf16"``: ``dx = g . w``, ``dw = g^T . x`` with bfloat16 operands and float32 accumulation
    (straight-through the forward quantization);
  - ``"e5m2"``: the same products in FP8, Transformer-Engine/DeepSeek-V3 style: ``g`` quantized to e5m2 in
    1x128 groups along each product's contracting dim, ``w`` re-used as e4m3 128x128 blocks (a block is the same
    for ``w`` and ``w^T``), ``x`` quantized to e4m3 in 128-token groups along M for the weight gradient. The
    operands are of two FP8 formats, which Mosaic GPU's wgmma cannot take: on CUDA these GEMMs are XLA's FP8
    ``dot_general`` per K block;
  - ``"e4m3"``: DeepSeek-V3's recipe (arXiv 2412.19437 Sec. 3.3: all three GEMMs of a linear in e4m3 with
    fine-grained scales): the same groups as ``"e5m2"`` (``g`` in 1x128 groups along each product's contracting
    dim, ``w`` as 128x128 blocks, ``x`` in 1x128 groups along the tokens), every operand e4m3 (rounding
    :data:`GRAD_E4M3`: ``s = max(amax, 1e-30) / 448``, ``q = g / s``). Both backward GEMMs then run on the
    Mosaic GPU wgmma kernel where the program is lowered for CUDA (M >= 128; :func:`~fp8rl_jax.fp8.dot_general.
    cuda_gemm_impl`): the input gradient ``dx = g . w`` (1D2D: ``g`` groups x ``w^T`` blocks) and the weight
    gradient ``dw = g^T . x`` (1D1D: both operands in 1x128 groups along the tokens). The kernel needs both
    operands K-major (contracting dim contiguous: FP8 wgmma refuses transposed 8-bit operands): ``w^T`` is the
    e4m3 ``w`` transposed once (its 128x128 block scales transposed with it), and for the weight gradient ``g``
    and ``x`` are quantized along the tokens in their own ``[M, N]`` / ``[M, K]`` layout and only the e4m3
    results are transposed (:func:`~fp8rl_jax.fp8.dot_general.quantize_transposed`): one transposed copy per
    operand, of 1-byte values, never of the wide gradient or activation. e4m3 has one more mantissa bit than e5m2
    and far less range (448 / 2**-9 against 57344 / 2**-16); DeepSeek-V3's point is that a scale per 1x128
    group makes e4m3's range enough for gradients too;
  - ``"float32"``: exact float32 cotangents (the straight-through estimator itself).

Residuals are the unquantized inputs (as for a plain matmul). Trainer precision ``"fp8"`` is then a config
switch: :func:`dot_general_for_precision` returns the dot_general to give every ``nnx.Linear``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp8rl_jax.fp8.dot_general import (DotSpec, Fp8DotConfig, OperandQuant, _fmt, fp8_forward_canonical,
                                       quantize_operand, quantize_transposed, quantized_matmul, wrap_dot_general)
from fp8rl_jax.fp8.formats import GRAD_E5M2, QuantRecipe
from fp8rl_jax.fp8.quant import _quantize_blocks

#: backward precisions of :func:`make_fp8_train_dot_general` (``train.fp8_train_grad``)
GRAD_PRECISIONS = ("bf16", "e5m2", "e4m3", "float32")
#: rounding of e4m3 gradients (``grad="e4m3"``): ``s = max(amax, 1e-30) / 448`` (IEEE division), ``q = g / s``;
#: like :data:`~fp8rl_jax.fp8.formats.GRAD_E5M2`, only a floor that keeps the scale a normal float32
GRAD_E4M3 = QuantRecipe("gradient e4m3 groups (DeepSeek-V3)", amax_floor=1e-30)
TRAIN_PRECISIONS = ("fp32", "bf16", "fp16", "fp8")


@dataclasses.dataclass(frozen=True)
class Fp8TrainConfig:
    """Static configuration of an FP8 training dot_general (hashable).

    Attributes:
      grad: backward precision, one of ``GRAD_PRECISIONS``.
      forward: the forward :class:`~fp8rl_jax.fp8.dot_general.Fp8DotConfig` (blockwise by default).
    """

    grad: str = "bf16"
    forward: Fp8DotConfig = Fp8DotConfig()

    def __post_init__(self):
        if self.grad not in GRAD_PRECISIONS:
            raise ValueError(f"grad must be one of {GRAD_PRECISIONS}, got {self.grad!r}")


def _swap_last(a):
    return jnp.swapaxes(a, 1, 2)


def _backward(spec: DotSpec, cfg: Fp8TrainConfig, lhs, rhs, g):
    x, w = spec.lhs_to_canonical(lhs), spec.rhs_to_canonical(rhs)  # [B, M, K], [B, N, K]
    gc = g.reshape(spec.b, spec.m, spec.n)  # [B, M, N]
    if cfg.grad == "e4m3":
        dx, dw = _backward_e4m3(x, w, gc, cfg.forward, lhs.dtype, rhs.dtype)
    elif cfg.grad in ("bf16", "float32"):
        ct = jnp.bfloat16 if cfg.grad == "bf16" else jnp.float32
        dx = jnp.einsum("bmn,bnk->bmk", gc.astype(ct), w.astype(ct), preferred_element_type=jnp.float32)
        dw = jnp.einsum("bmn,bmk->bnk", gc.astype(ct), x.astype(ct), preferred_element_type=jnp.float32)
    else:  # e5m2 gradients x e4m3 operands
        fwd = cfg.forward
        g_op = OperandQuant("group", "e5m2", GRAD_E5M2)
        # dx[b, m, k] = sum_n g[b, m, n] w[b, n, k]: lhs g (groups along N), rhs w^T [B, K, N] (128x128 blocks).
        dx = fp8_forward_canonical(gc, _swap_last(w), fwd, x_op=g_op,
                                   w_op=OperandQuant("block", "e4m3", fwd.weight_recipe))
        # dw[b, n, k] = sum_m g[b, m, n] x[b, m, k]: lhs g^T [B, N, M], rhs x^T [B, K, M], both grouped along M.
        dw = fp8_forward_canonical(_swap_last(gc), _swap_last(x), fwd, x_op=g_op,
                                   w_op=OperandQuant("group", "e4m3", fwd.act_recipe))
    dx = spec.lhs_from_canonical(dx).astype(lhs.dtype)
    dw = spec.rhs_from_canonical(dw).astype(rhs.dtype)
    return dx, dw


def _backward_e4m3(x, w, gc, fwd: Fp8DotConfig, dx_dtype, dw_dtype):
    """``grad="e4m3"``: ``dx = g . w`` and ``dw = g^T . x`` with every operand e4m3 (module docstring).

    ``x [B, M, K]``, ``w [B, N, K]``, ``gc [B, M, N]`` -> ``(dx [B, M, K], dw [B, N, K])`` in the given dtypes. The
    operands are quantized here, K-major, and multiplied by :func:`~fp8rl_jax.fp8.dot_general.quantized_matmul`
    (the Mosaic GPU kernel where lowered for CUDA, unless ``fwd.impl`` names another implementation).
    """
    bs, ue8m0 = fwd.block_size, fwd.ue8m0
    impl = "blocked" if fwd.impl == "pallas" else fwd.impl  # the Triton GEMM has no 1x128-row-scale (1D1D) form
    g_op = OperandQuant("group", "e4m3", GRAD_E4M3)
    # dx[b, m, k] = sum_n g[b, m, n] w[b, n, k]: A = g in 1x128 groups along N (its own layout: K-major already);
    # B = w^T [B, K, N]: w quantized in 128x128 blocks (as the forward does), the e4m3 result transposed once.
    gq, gs = quantize_operand(gc, g_op, bs, ue8m0)
    dt, mx = _fmt("e4m3")
    wq, wsb = _quantize_blocks(w, bn=bs, bk=bs, ue8m0=ue8m0, fp8_dtype=dt, fp8_max=mx, recipe=fwd.weight_recipe)
    dx = quantized_matmul(gq, gs, jnp.swapaxes(wq, 1, 2), jnp.swapaxes(wsb, 1, 2), w_scales="block", impl=impl,
                          block_size=bs, out_dtype=dx_dtype, dequant_dtype=fwd.dequant_dtype)
    # dw[b, n, k] = sum_m g[b, m, n] x[b, m, k]: both operands in 1x128 groups along M, made K-major (M last) by
    # transposing their e4m3 values only (quantize_transposed).
    gq_t, gs_t = quantize_transposed(gc, g_op, bs, ue8m0)  # [B, N, M], [B, N, MB]
    xq_t, xs_t = quantize_transposed(x, OperandQuant("group", "e4m3", fwd.act_recipe), bs, ue8m0)  # [B, K, M]
    dw = quantized_matmul(gq_t, gs_t, xq_t, xs_t, w_scales="row", impl=impl, block_size=bs, out_dtype=dw_dtype,
                          dequant_dtype=fwd.dequant_dtype)
    return dx, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _fp8_train_dot(lhs, rhs, spec: DotSpec, cfg: Fp8TrainConfig, out_dtype):
    y = fp8_forward_canonical(spec.lhs_to_canonical(lhs), spec.rhs_to_canonical(rhs), cfg.forward,
                              out_dtype=out_dtype)
    return y.reshape(spec.out_shape).astype(out_dtype)


def _fp8_train_dot_fwd(lhs, rhs, spec, cfg, out_dtype):
    return _fp8_train_dot(lhs, rhs, spec, cfg, out_dtype), (lhs, rhs)


def _fp8_train_dot_bwd(spec, cfg, out_dtype, res, g):
    lhs, rhs = res
    return _backward(spec, cfg, lhs, rhs, g)


_fp8_train_dot.defvjp(_fp8_train_dot_fwd, _fp8_train_dot_bwd)


def make_fp8_train_dot_general(grad: str = "bf16", forward: Fp8DotConfig | None = None):
    """Build an FP8 training ``dot_general`` (``jax.lax.dot_general`` signature) with a custom VJP.

    Args:
      grad: backward precision: ``"bf16"`` (default), ``"e5m2"``, ``"e4m3"`` or ``"float32"`` (module docstring).
      forward: forward FP8 configuration (default: W8A8 blockwise, e4m3, 128).

    Returns:
      ``dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
      out_sharding=None)``; lhs = activations, rhs = weights. Cotangents come back in the inputs' dtypes.

    Raises:
      ValueError: unknown ``grad``; when called, unsupported ``dimension_numbers`` or non-float operands.
    """
    cfg = Fp8TrainConfig(grad=grad, forward=forward or Fp8DotConfig())

    dot_general = wrap_dot_general(lambda lhs, rhs, spec, out_dtype: _fp8_train_dot(lhs, rhs, spec, cfg, out_dtype))
    dot_general.fp8_train_config = cfg
    dot_general.__doc__ = f"FP8 training dot_general ({cfg})."
    return dot_general


def dot_general_for_precision(precision: str, *, fp8_grad: str = "bf16", forward: Fp8DotConfig | None = None):
    """The ``dot_general`` a trainer gives its linear layers for a training precision (a config switch).

    Args:
      precision: ``"fp32"``, ``"bf16"``, ``"fp16"`` (all: ``jax.lax.dot_general``; the dtype is the layer's
        ``dtype``) or ``"fp8"`` (:func:`make_fp8_train_dot_general`).
      fp8_grad: backward precision for ``"fp8"``.
      forward: forward FP8 configuration for ``"fp8"``.

    Raises:
      ValueError: unknown precision.
    """
    if precision not in TRAIN_PRECISIONS:
        raise ValueError(f"precision must be one of {TRAIN_PRECISIONS}, got {precision!r}")
    if precision == "fp8":
        return make_fp8_train_dot_general(fp8_grad, forward)
    return lax.dot_general
