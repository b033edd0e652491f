"""Building blocks shared by the dense decoder and the Qwen3-MoE block: :class:`Linear`, :class:`RMSNorm`, :class:`MLP`.

They live here, below both :mod:`fp8rl_jax.models.decoder` and :mod:`fp8rl_jax.models.moe`, so the decoder can
import the MoE block and the MoE block these layers without an import cycle (issue 19). The decoder re-exports
them (``from fp8rl_jax.models.decoder import Linear`` keeps working). Numerics follow ``transformers``
(``LlamaRMSNorm``, ``LlamaMLP``); the FP8 path is vLLM's W8A8 blockwise layout (see :class:`Linear`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from fp8rl_jax.fp8 import BLOCK_SIZE, E4M3, w8a8_block_matmul
from fp8rl_jax.fp8.linear import rms_norm_apply, silu_gate
from fp8rl_jax.models.config import ModelConfig

LINEAR_PRECISIONS = ("dense", "fp8")


class Linear(nnx.Module):
    """``y = x @ weight.T (+ bias)`` with HF layout ``weight [out_features, in_features]``.

    With ``precision="fp8"`` the parameters are ``weight`` (e4m3 ``[N, K]``) and ``weight_scale_inv``
    (float32 ``[ceil(N/128), ceil(K/128)]``) and the product is the W8A8 blockwise FP8 matmul
    (:func:`fp8rl_jax.fp8.w8a8_block_matmul`). A dense layer whose ``dot_general`` attribute is set (see
    :func:`fp8rl_jax.trainer.precision.apply_train_precision`) computes ``dot_general(x, weight, contract K)``
    instead of the einsum, e.g. the FP8 training product with its custom VJP.
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = False, precision: str = "dense",
                 param_dtype=jnp.float32, dtype=jnp.float32, rngs: nnx.Rngs, block_size: int = BLOCK_SIZE):
        if precision not in LINEAR_PRECISIONS:
            raise ValueError(f"linear precision {precision!r} not in {LINEAR_PRECISIONS}")
        self.precision, self.dtype, self.block_size = precision, dtype, block_size
        # Optional ``jax.lax.dot_general``-compatible product for the dense path (e.g. the FP8 training VJP of
        # :func:`fp8rl_jax.fp8.training.make_fp8_train_dot_general`); ``None`` = plain einsum.
        self.dot_general = None
        if precision == "fp8":
            self.weight = nnx.Param(jnp.zeros((out_features, in_features), E4M3))
            self.weight_scale_inv = nnx.Param(jnp.ones(
                (math.ceil(out_features / block_size), math.ceil(in_features / block_size)), jnp.float32))
        else:
            init = nnx.initializers.normal(0.02)
            self.weight = nnx.Param(init(rngs.params(), (out_features, in_features), param_dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None

    def __call__(self, x: jax.Array, *, norm: tuple | None = None, gated: bool = False,
                 residual: jax.Array | None = None) -> jax.Array:
        """``x [..., in] -> [..., out]``; optional neighbours (the FP8 engine's decode step fuses them into one kernel:
        :func:`fp8rl_jax.fp8.w8a8_block_matmul`): ``norm=(sum_sq, weight, eps)`` RMS-normalizes ``x`` first
        (:meth:`RMSNorm.fused`), ``gated`` returns ``silu(gate) * up`` of a fused ``[gate; up]`` layer, ``residual`` is
        added to the result. Without them: the plain product."""
        if self.precision == "fp8" and self.bias is None:
            return w8a8_block_matmul(x, self.weight[...], self.weight_scale_inv[...], self.block_size,
                                     out_dtype=self.dtype, norm=norm, gated=gated, residual=residual)
        if self.precision == "fp8":  # a bias comes between the product and its epilogues
            y = w8a8_block_matmul(x, self.weight[...], self.weight_scale_inv[...], self.block_size,
                                  out_dtype=self.dtype, norm=norm)
            y = y + self.bias[...].astype(y.dtype)
        else:
            y = self._dense(x if norm is None else RMSNorm.apply(x, *norm))
        if gated:
            y = silu_gate(y)
        return y if residual is None else residual + y

    def _dense(self, x: jax.Array) -> jax.Array:
        if self.dot_general is not None:
            xd = x.astype(self.dtype)
            y = self.dot_general(xd, self.weight[...].astype(self.dtype), (((xd.ndim - 1,), (1,)), ((), ())))
        else:
            y = jnp.einsum("...k,nk->...n", x.astype(self.dtype), self.weight[...].astype(self.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y


class RMSNorm(nnx.Module):
    """RMSNorm as in HF Llama: ``weight * (x / sqrt(mean(x**2) + eps))`` computed in float32."""

    def __init__(self, dim: int, eps: float, param_dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.apply(x, *self.fused(x))

    def fused(self, x: jax.Array) -> tuple:
        """``(sum_sq, weight, eps)``: this norm as a :class:`Linear`'s ``norm=`` argument, with ``sum_sq`` =
        ``sum(x**2)`` per row (float32 ``[..., 1]``: the reduction half, one XLA reduction; the rest is
        :meth:`apply`, which the FP8 engine's decode kernels run in their prologue)."""
        xf = x.astype(jnp.float32)
        return jnp.sum(xf * xf, axis=-1, keepdims=True), self.weight[...], self.eps

    @staticmethod
    def apply(x: jax.Array, sum_sq: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
        """The elementwise half: ``(weight * (x * rsqrt(sum_sq / K + eps))).astype(x.dtype)`` in float32
        (``sum_sq / K`` is ``jnp.mean``'s division, which XLA turns into a product with ``1/K``)."""
        return rms_norm_apply(x, sum_sq, weight, eps)


class MLP(nnx.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``.

    ``gate_proj``/``up_proj`` are ``[I, hidden]`` and ``down_proj`` ``[hidden, I]`` :class:`Linear` layers (dense
    or FP8 blockwise), with ``I = intermediate_size`` (default ``cfg.intermediate_size``; a Qwen3-MoE expert
    passes ``cfg.moe_intermediate_size``, giving the checkpoint names ``mlp.experts.{j}.{gate,up,down}_proj``).

    With ``fuse_gate_up`` (the FP8 rollout engine, :mod:`fp8rl_jax.models.fused`) gate and up are one
    ``gate_up_proj`` :class:`Linear` ``[2I, hidden]`` with rows ``[gate; up]`` (vLLM's
    ``MergedColumnParallelLinear``): one W8A8 product, the activation quantized once, split after the product.
    Each output column's product is the unfused one's (``I`` is a multiple of 128, so no weight block spans both),
    so the results are the same (bit for bit on CPU, tested).
    """

    def __init__(self, cfg: ModelConfig, *, intermediate_size: int | None = None, linear_precision: str,
                 param_dtype, dtype, rngs: nnx.Rngs, fuse_gate_up: bool = False):
        inter = cfg.intermediate_size if intermediate_size is None else intermediate_size
        lin = dict(precision=linear_precision, param_dtype=param_dtype, dtype=dtype, rngs=rngs)
        if fuse_gate_up:
            self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, **lin)
            self.gate_proj = self.up_proj = None
        else:
            self.gate_proj = Linear(cfg.hidden_size, inter, **lin)
            self.up_proj = Linear(cfg.hidden_size, inter, **lin)
            self.gate_up_proj = None
        self.down_proj = Linear(inter, cfg.hidden_size, **lin)

    def __call__(self, x, *, norm: tuple | None = None, residual=None):
        """``x [..., hidden] -> [..., hidden]``; ``norm=(sum_sq, weight, eps)`` RMS-normalizes ``x`` first and ``residual`` is
        added to the result (:meth:`Linear.__call__`: on the FP8 engine's decode step both run inside the kernels,
        with ``silu(gate) * up`` in the fused ``gate_up_proj``'s)."""
        if self.gate_up_proj is not None:
            h = self.gate_up_proj(x, norm=norm, gated=True)
        else:
            x = x if norm is None else RMSNorm.apply(x, *norm)
            h = jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(h, residual=residual)
