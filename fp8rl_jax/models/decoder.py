"""Flax NNX decoder for the Llama / Qwen2 / Qwen3 dense families, with HF parameter names.

Module attribute paths equal HF checkpoint names: the NNX state path
``('model', 'layers', 3, 'self_attn', 'q_proj', 'weight')`` is ``model.layers.3.self_attn.q_proj.weight``,
and linear weights are stored in HF/vLLM layout ``[out_features, in_features]``. The exception is a Qwen3-MoE
layer's experts, stacked per projection as ``mlp.experts.{gate,up,down}_proj.weight`` ``[E, out, in]``
(:mod:`fp8rl_jax.models.experts`); :func:`named_params` / :func:`load_named_params` translate them to and from the
per-expert HF names ``mlp.experts.{j}.*``. Numerics follow
``transformers`` (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``): RMSNorm in float32,
rotate-half RoPE, GQA, SwiGLU MLP, Qwen2 q/k/v bias, Qwen3 per-head q/k RMSNorm before RoPE.

Linear layers run either dense (``linear_precision="dense"``, weights in ``param_dtype``) or FP8 W8A8
blockwise (``"fp8"``: ``weight`` is e4m3 ``[N, K]`` plus ``weight_scale_inv`` f32 ``[ceil(N/128), ceil(K/128)]``,
activations quantized in 1x128 groups on the fly), the layout vLLM's blockwise FP8 checkpoints use.
Embeddings, norms and ``lm_head`` always stay in ``param_dtype``.

The same ``__call__`` serves training (no cache) and the rollout engine (a KV cache passed in and out).
Attention runs through :func:`jax.nn.dot_product_attention` except for FP8 attention (see
:meth:`Attention.forward`). The cache-less (training) forward can checkpoint each layer
(``CausalLM(remat_policy=...)``, :mod:`fp8rl_jax.models.remat`) and run identical layers as one ``lax.scan``
(``CausalLM(scan_layers=True)``) while parameters stay stored per layer under their HF names.
``Linear``, ``RMSNorm`` and ``MLP`` live in :mod:`fp8rl_jax.models.layers` (shared with the MoE block, no import
cycle) and are re-exported here.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from fp8rl_jax.fp8.kv_cache import dequantize_kv, is_fp8_cache, quantize_kv
from fp8rl_jax.kernels.pallas_attention import (decode_kernel_choice, fp8_kv_attention_dispatch, fp8_kv_decode_attention,
                                            fp8_kv_prefill_attention)
from fp8rl_jax.models.attention_impl import (dot_product_attention_dispatch, left_padded_attention, rows_with_keys,
                                             zero_rows_without_keys)
from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.experts import expert_names, is_expert_stack_name, stack_expert_tensors
from fp8rl_jax.models.layers import LINEAR_PRECISIONS, MLP, Linear, RMSNorm  # noqa: F401 (re-exported)
from fp8rl_jax.models.moe import SparseMoeBlock
from fp8rl_jax.models.remat import KEY_PROJ, OUT_PROJ, QUERY_PROJ, VALUE_PROJ, checkpoint_policy, validate_remat_policy

class KVCache(NamedTuple):
    """Preallocated per-layer key/value cache, optionally FP8 (vLLM ``kv_cache_dtype="fp8_e4m3"`` semantics).

    Attributes:
      k, v: tuples (one per layer) of ``[B, T_max, num_key_value_heads, head_dim]`` arrays (cache dtype:
        the model dtype, or ``float8_e4m3fn``).
      k_scale, v_scale: per-layer dequantization multipliers (required for an e4m3 cache: stored
        ``fp8(k / k_scale)``, read ``fp8 * k_scale``; see :mod:`fp8rl_jax.fp8.kv_cache`), else ``None``: a tuple
        of ``num_layers`` float32 scalars (:meth:`zeros` splits a ``[num_layers]`` array into one), or a float32
        ``[num_layers]`` array in a cache built directly; ``k_scale[i]`` is layer ``i``'s either way.
      q_scale: the same for attention on e4m3 queries too (FP8 attention), else ``None``.
    """

    k: tuple
    v: tuple
    k_scale: Any = None
    v_scale: Any = None
    q_scale: Any = None

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, *, k_scale=None, v_scale=None,
              q_scale=None) -> "KVCache":
        """An empty cache for ``batch`` sequences of up to ``max_len`` slots.

        ``k_scale`` / ``v_scale`` / ``q_scale`` (float32 ``[num_layers]`` or None) are held as tuples of per-layer
        scalars (:func:`_per_layer_scalars`: each layer's kernels then compile once for all layers).

        Raises:
          ValueError: an e4m3 ``dtype`` without ``k_scale``/``v_scale``, or scales not of shape ``[num_layers]``.
        """
        shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        if is_fp8_cache(dtype) and (k_scale is None or v_scale is None):
            raise ValueError("an fp8_e4m3 KV cache needs per-layer k_scale and v_scale")
        for name, sc in (("k_scale", k_scale), ("v_scale", v_scale), ("q_scale", q_scale)):
            if sc is not None and tuple(jnp.shape(sc)) != (cfg.num_hidden_layers,):
                raise ValueError(f"KVCache {name} must have shape ({cfg.num_hidden_layers},), got {jnp.shape(sc)}")
        z = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_hidden_layers))
        k_scale, v_scale, q_scale = _per_layer_scalars((k_scale, v_scale, q_scale), cfg.num_hidden_layers)
        return cls(k=z, v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_hidden_layers)), k_scale=k_scale,
                   v_scale=v_scale, q_scale=q_scale)

    def layer(self, i: int) -> tuple:
        """Layer ``i``'s ``(k, v, k_scale, v_scale, q_scale)`` as :class:`Attention` takes it (scales may be None)."""
        pick = lambda s: None if s is None else s[i]  # noqa: E731
        return (self.k[i], self.v[i], pick(self.k_scale), pick(self.v_scale), pick(self.q_scale))


def _per_layer_scalars(scales: tuple, num_layers: int) -> tuple:
    """Split each float32 ``[num_layers]`` array of ``scales`` (None passes through) into a tuple of
    ``num_layers`` float32 scalars, all behind one ``lax.optimization_barrier``.

    Why (issue 37 item 5): were layer ``i``'s attention to read ``k_scale[i]`` from the ``[num_layers]`` array, XLA
    would fuse the slice, with its constant offset ``i``, into that layer's cache-write and attention fusions; those
    fusions then differ from layer to layer, so XLA:GPU builds about 5.5 kernels per layer (36 Qwen3-8B layers: 4 s more
    backend compile, medians) where it otherwise builds each once and reuses it. Behind the barrier each layer's fusions
    take the scale as a parameter (in the decode loop, a loop-carried scalar): the same fusion in every layer. Values
    are unchanged (a slice and a barrier).
    """
    present = [jnp.asarray(s, jnp.float32) for s in scales if s is not None]
    if not present:
        return scales
    flat = iter(jax.lax.optimization_barrier(tuple(s[i] for s in present for i in range(num_layers))))
    return tuple(None if s is None else tuple(next(flat) for _ in range(num_layers)) for s in scales)


def rope_inv_freq(cfg: ModelConfig) -> jnp.ndarray:
    """RoPE inverse frequencies ``[head_dim // 2]`` (float32), with HF ``rope_type`` default/linear/llama3.

    Raises:
      ValueError: unsupported ``rope_type``.
    """
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    rs = cfg.rope_scaling or {}
    rtype = rs.get("rope_type", rs.get("type", "default"))
    if rtype in (None, "default"):
        return inv
    if rtype == "linear":
        return inv / float(rs["factor"])
    if rtype == "llama3":
        factor, lo, hi = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old = float(rs["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = jnp.where(wavelen > old / lo, inv / factor, inv)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        return jnp.where(is_mid, mid, scaled)
    raise ValueError(f"unsupported rope_type {rtype!r}; supported: default, linear, llama3")


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE. ``x [B, S, H, D]``, ``positions [B, S]`` int32 -> same shape/dtype as ``x``."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, S, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    xf = x.astype(jnp.float32)
    half = xf.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rot * sin).astype(x.dtype)


class Attention(nnx.Module):
    """GQA self-attention with optional q/k/v bias (Qwen2) and q/k RMSNorm (Qwen3).

    With ``fuse_qkv`` (the FP8 rollout engine, :mod:`fp8rl_jax.models.fused`) q/k/v are one ``qkv_proj``
    :class:`Linear` ``[(H + 2 H_kv) * D, hidden]`` with rows ``[q; k; v]`` (vLLM's ``QKVParallelLinear``): one W8A8
    product per step, the activation quantized once, split after the product; each column's product is the unfused
    one's (every part's rows a multiple of 128), so the results are the same.
    """

    def __init__(self, cfg: ModelConfig, *, linear_precision: str, param_dtype, dtype, rngs: nnx.Rngs,
                 fuse_qkv: bool = False):
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim, self.dtype = (
            cfg.num_attention_heads, cfg.num_key_value_heads, d, dtype)
        lin = dict(precision=linear_precision, param_dtype=param_dtype, dtype=dtype, rngs=rngs)
        if fuse_qkv:
            self.qkv_proj = Linear(h, (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d,
                                   use_bias=cfg.attention_bias, **lin)
            self.q_proj = self.k_proj = self.v_proj = None
        else:
            self.q_proj = Linear(h, cfg.num_attention_heads * d, use_bias=cfg.attention_bias, **lin)
            self.k_proj = Linear(h, cfg.num_key_value_heads * d, use_bias=cfg.attention_bias, **lin)
            self.v_proj = Linear(h, cfg.num_key_value_heads * d, use_bias=cfg.attention_bias, **lin)
            self.qkv_proj = None
        self.o_proj = Linear(cfg.num_attention_heads * d, h, use_bias=False, **lin)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, param_dtype)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, param_dtype)
        else:
            self.q_norm = self.k_norm = None
        # When True (see :func:`set_qkv_capture`), a cache-less forward sows the per-token max |q|, |k|, |v|
        # (after QK-norm and RoPE) for FP8 KV-scale calibration; read it with ``nnx.capture`` and
        # :func:`qkv_absmax_from_intermediates`.
        self.capture_qkv_absmax = False
        # :mod:`fp8rl_jax.models.attention_impl`: ``"auto"`` (cuDNN flash attention for cache-less forwards on a
        # CUDA GPU where cuDNN supports the call, XLA's attention otherwise), ``"xla"`` / None or ``"cudnn"``.
        self.attention_implementation = "auto"
        # On a mesh (set by fp8rl_jax.trainer.model_setup.configure_train_model): ``shape -> Sharding`` of q, k and v
        # before cuDNN attention, whose custom partitioner needs the three sharded alike; None: no constraint.
        self.qkv_sharding = None

    def __call__(self, x, positions, inv_freq, kv_mask, q_slots, cache_kv=None, cache_index=None):
        """:meth:`forward`, sowing the q/k/v maxima (``nnx.Intermediate`` ``qkv_absmax``) when capture is on.

        Returns ``(out [B, S, hidden], new_kv or None)``.
        """
        out, new_kv, amax = self.forward(x, positions, inv_freq, kv_mask, q_slots, cache_kv, cache_index)
        if amax is not None:
            self.sow(nnx.Intermediate, "qkv_absmax", amax)
        return out, new_kv

    def forward(self, x, positions, inv_freq, kv_mask, q_slots, cache_kv=None, cache_index=None, *, norm=None,
                residual=None):
        """Attention over ``x [B, S, hidden]``; returns ``(out [B, S, hidden], new_kv or None, qkv_absmax)``.

        ``norm=(sum_sq, weight, eps)`` (:meth:`RMSNorm.fused`) RMS-normalizes ``x`` before the projections and ``residual`` is added to ``out``
        (:meth:`Linear.__call__`; the FP8 engine's decode step runs them inside the q/k/v and o_proj kernels).

        ``qkv_absmax`` is float32 ``[3 (q, k, v), B, S]`` (per-token max |.| after QK-norm and RoPE, gradient
        stopped) in a cache-less forward with ``capture_qkv_absmax`` set, else None; this method never sows (it
        runs inside ``jax.checkpoint`` / ``lax.scan`` bodies), :meth:`__call__` does.

        ``cache_kv`` is ``(k, v)`` or :meth:`KVCache.layer`'s ``(k, v, k_scale, v_scale, q_scale)``. An e4m3
        cache is written as ``fp8(k / k_scale)`` and read as ``fp8 * k_scale`` (vLLM semantics); with a
        ``q_scale`` the queries are quantized too and ``QK^T`` runs on e4m3 values with float32 accumulation,
        times ``q_scale * k_scale`` (FP8 attention; the softmax probabilities stay in ``dtype``).

        Key slot ``t`` is visible to query ``i`` iff ``kv_mask[b, t] and t <= q_slots[b, i]`` (left padding and
        causality with a cache offset). Without FP8 attention the product runs through
        :func:`jax.nn.dot_product_attention` (GQA natively; ``implementation`` from ``attention_implementation``
        through :func:`fp8rl_jax.models.attention_impl.resolve_attention_implementation`: cuDNN flash attention for
        cache-less forwards on a CUDA GPU, XLA elsewhere). XLA's implementation computes ``QK^T`` with float32
        accumulation, scales by ``1/sqrt(head_dim)`` (a multiply, where the einsum path divided by
        ``sqrt(head_dim)``: at most 1 ulp apart in float32, identical for power-of-4 head dims), masks with
        ``-0.7 * float32_max``, runs the softmax in float32, casts the probabilities to ``dtype`` and multiplies by
        ``V`` in ``dtype``: the numerics of the einsum path it replaced. It still materialises the
        ``[B, H, S, T]`` scores; cuDNN's does not: a cache-less forward reaches it with each left-padded row rotated to
        right padding and cuDNN's own padding-causal mask (:func:`fp8rl_jax.models.attention_impl.left_padded_attention`:
        no bias, no fully masked row inside cuDNN). A query row with no visible key (a left-pad slot) outputs 0 on
        every path (:func:`fp8rl_jax.models.attention_impl.zero_rows_without_keys`), so its gradient is 0 too. The FP8-attention path (``q_scale``) keeps an explicit
        einsum because ``QK^T`` runs on e4m3 values rescaled by ``q_scale * k_scale`` before the softmax; so does
        ``float16`` compute with the default implementation (XLA:CPU rejects the ``F16_F16_F32`` dot algorithm JAX's XLA
        attention asks for; same numerics).

        Raises:
          ValueError: an e4m3 cache without ``k_scale``/``v_scale``.
        """
        b, s, _ = x.shape
        if self.qkv_proj is not None:  # fused [q; k; v] rows: one product, split by columns
            nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = jnp.split(self.qkv_proj(x, norm=norm), [nq, nq + nkv], axis=-1)
        else:
            x = x if norm is None else RMSNorm.apply(x, *norm)
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = checkpoint_name(q, QUERY_PROJ).reshape(b, s, self.num_heads, self.head_dim)
        k = checkpoint_name(k, KEY_PROJ).reshape(b, s, self.num_kv_heads, self.head_dim)
        v = checkpoint_name(v, VALUE_PROJ).reshape(b, s, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        qkv_absmax = None
        if self.capture_qkv_absmax and cache_kv is None:
            amax = lambda a: jnp.max(jnp.abs(a.astype(jnp.float32)), axis=(-2, -1))  # noqa: E731  [B, S]
            qkv_absmax = jax.lax.stop_gradient(jnp.stack([amax(q), amax(k), amax(v)]))
        new_kv = None
        if cache_kv is not None:
            ck, cv = cache_kv[0], cache_kv[1]
            ks, vs, qs = (tuple(cache_kv[2:]) + (None, None, None))[:3]
            if is_fp8_cache(ck):
                if ks is None or vs is None:
                    raise ValueError("an fp8_e4m3 KV cache needs k_scale and v_scale")
                ck = jax.lax.dynamic_update_slice(ck, quantize_kv(k, ks), (0, cache_index, 0, 0))
                cv = jax.lax.dynamic_update_slice(cv, quantize_kv(v, vs), (0, cache_index, 0, 0))

                def materialized(q_, ck_, cv_):
                    return self._fp8_cache_attention(q_, ck_, cv_, ks, vs, qs, kv_mask, q_slots)

                mode = decode_kernel_choice(getattr(self, "kv_attention", "auto"), s, ck.shape)
                if mode is None:
                    out = materialized(q, ck, cv)
                else:  # the e4m3 cache is read and dequantized inside the attention kernel (decode or prefill)
                    def kernel(q_, ck_, cv_, *, interpret):
                        if s == 1:
                            o = fp8_kv_decode_attention(q_[:, 0], ck_, cv_, ks, vs, kv_mask, q_slots[:, 0],
                                                        q_scale=qs, interpret=interpret)
                        else:
                            o = fp8_kv_prefill_attention(q_, ck_, cv_, ks, vs, kv_mask, q_slots, q_scale=qs,
                                                         interpret=interpret)
                        return o.reshape(b, s, self.num_heads * self.head_dim)

                    out = fp8_kv_attention_dispatch(mode, q, ck, cv, kernel=kernel, xla=materialized)
                    out = zero_rows_without_keys(out, rows_with_keys(kv_mask, q_slots))
                return self._out(out, residual), (ck, cv), qkv_absmax
            ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, cache_index, 0, 0))
            cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, cache_index, 0, 0))
            k, v = ck.astype(self.dtype), cv.astype(self.dtype)
            new_kv = (ck, cv)
        out = self._attend(q, k, v, None, kv_mask, q_slots, cache_kv is not None)
        return self._out(out, residual), new_kv, qkv_absmax

    def _out(self, out, residual):
        """``o_proj(out)`` (named for remat policies), or ``residual + o_proj(out)`` with the add fused."""
        if residual is None:
            return checkpoint_name(self.o_proj(out), OUT_PROJ)
        return self.o_proj(out, residual=residual)

    def _fp8_cache_attention(self, q, ck, cv, ks, vs, qs, kv_mask, q_slots):
        """Attention over an e4m3 cache with the cache dequantized (``fp8 * scale``) before the product; with a
        ``q_scale`` the queries are quantized too and ``QK^T`` runs on e4m3 values. Returns ``[B, S, H * D]``."""
        v = dequantize_kv(cv, vs, self.dtype)
        if qs is not None:
            return self._attend(quantize_kv(q, qs).astype(jnp.float32), ck.astype(jnp.float32), v, qs * ks, kv_mask,
                                q_slots, True)
        return self._attend(q, dequantize_kv(ck, ks, self.dtype), v, None, kv_mask, q_slots, True)

    def _attend(self, q, k, v, qk_scale, kv_mask, q_slots, has_cache):
        """Masked attention of ``q [B, S, H, D]`` over ``k, v [B, T, H_kv, D]`` -> ``[B, S, H * D]`` (see
        :meth:`forward`); ``qk_scale``: FP8 attention's ``q_scale * k_scale`` (None: plain attention)."""
        b, s = q.shape[:2]
        t = k.shape[1]
        allowed = kv_mask[:, None, :] & (jnp.arange(t)[None, None, :] <= q_slots[:, :, None])  # [B, S, T]

        def einsum_attention(q_, k_, v_):
            # FP8 attention: QK^T on e4m3 values (held in float32), rescaled by q_scale * k_scale; float16 with XLA
            # (JAX's XLA attention requests the F16_F16_F32 dot algorithm, which XLA:CPU rejects at compile time)
            g = self.num_heads // self.num_kv_heads
            qg = q_.reshape(b, s, self.num_kv_heads, g, self.head_dim)
            scores = jnp.einsum("bskgd,btkd->bkgst", qg, k_, preferred_element_type=jnp.float32)
            if qk_scale is not None:
                scores = scores * qk_scale
            scores = scores / math.sqrt(self.head_dim)
            scores = jnp.where(allowed[:, None, None], scores, -1e30)
            probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
            return jnp.einsum("bkgst,btkd->bskgd", probs, v_).reshape(b, s, self.num_heads, self.head_dim)

        def attention(impl):
            def run(q_, k_, v_):
                k_, v_ = k_.astype(q_.dtype), v_.astype(q_.dtype)
                if impl == "cudnn":  # cache-less only: rows right-aligned, cuDNN's own padding-causal mask
                    constrain = None
                    if self.qkv_sharding is not None:
                        constrain = lambda t: jax.lax.with_sharding_constraint(t, self.qkv_sharding(t.shape))  # noqa: E731
                    return left_padded_attention(q_, k_, v_, kv_mask, implementation="cudnn", constrain=constrain)
                return jax.nn.dot_product_attention(q_, k_, v_, mask=allowed[:, None], implementation=impl)
            return run

        if qk_scale is not None:
            out = einsum_attention(q, k, v)
        else:
            xla = einsum_attention if q.dtype == jnp.float16 else attention(None)
            out = dot_product_attention_dispatch(self.attention_implementation, q, k, v, has_cache, attention, xla)
        out = zero_rows_without_keys(out, rows_with_keys(kv_mask, q_slots))  # a row without a key gives 0
        return out.reshape(b, s, self.num_heads * self.head_dim)


class DecoderLayer(nnx.Module):
    """Pre-norm transformer block (HF ``LlamaDecoderLayer`` semantics).

    ``layer_idx`` selects the MLP: a Qwen3-MoE sparse layer (``cfg.is_sparse_layer(layer_idx)``) gets a
    :class:`fp8rl_jax.models.moe.SparseMoeBlock` (router ``mlp.gate`` + stacked ``mlp.experts.*``), every other
    layer the dense SwiGLU :class:`MLP` (HF ``Qwen3MoeDecoderLayer``). ``fuse_qkv`` / ``fuse_gate_up``: the
    fused ``self_attn.qkv_proj`` / ``mlp.gate_up_proj`` of the FP8 rollout engine (:mod:`fp8rl_jax.models.fused`;
    a sparse layer's experts are never fused here).
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0, *, fuse_qkv: bool = False, fuse_gate_up: bool = False,
                 **kw):
        pd = kw["param_dtype"]
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd)
        self.self_attn = Attention(cfg, fuse_qkv=fuse_qkv, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd)
        if cfg.is_sparse_layer(layer_idx):
            self.mlp = SparseMoeBlock(cfg, **kw)
        else:
            self.mlp = MLP(cfg, fuse_gate_up=fuse_gate_up, **kw)

    def __call__(self, x, positions, inv_freq, kv_mask, q_slots, cache_kv=None, cache_index=None, replay_ids=None):
        """One block: ``(x [B, S, hidden], new_kv or None, router_ids [B, S, k] int32 or None)``.

        ``replay_ids`` (int ``[B, S, k]``, ``-1`` = route normally) replays recorded experts in a sparse layer
        (R3, :meth:`fp8rl_jax.models.moe.SparseMoeBlock.forward`) and is ignored by a dense MLP; ``router_ids`` is
        the sparse layer's own top-k (None for a dense MLP). Sows ``self_attn``'s q/k/v maxima when capture is on
        (see :meth:`forward`).
        """
        x, new_kv, router_ids, amax = self.forward(x, positions, inv_freq, kv_mask, q_slots, cache_kv, cache_index,
                                                   replay_ids)
        if amax is not None:
            self.self_attn.sow(nnx.Intermediate, "qkv_absmax", amax)
        return x, new_kv, router_ids

    def forward(self, x, positions, inv_freq, kv_mask, q_slots, cache_kv=None, cache_index=None, replay_ids=None):
        """:meth:`__call__` without sowing: ``(x, new_kv or None, router_ids or None, qkv_absmax or None)``.

        ``qkv_absmax`` is :meth:`Attention.forward`'s float32 ``[3, B, S]`` (None unless capture is on and there is
        no cache). A pure function of the layer's state and inputs, so it can run under ``jax.checkpoint`` and as
        a ``lax.scan`` body (:meth:`CausalLM.hidden_states`), where the caller sows the maxima on ``self_attn``.
        """
        if self.self_attn.qkv_proj is not None:
            # the FP8 engine's fused projections: each norm goes into the next product and each residual add into
            # the product before it (one decode kernel each on CUDA: fp8rl_jax.fp8.linear.w8a8_block_matmul), the
            # same ops otherwise
            x, new_kv, amax = self.self_attn.forward(x, positions, inv_freq, kv_mask, q_slots, cache_kv, cache_index,
                                                     norm=self.input_layernorm.fused(x), residual=x)
            if isinstance(self.mlp, MLP):
                return self.mlp(x, norm=self.post_attention_layernorm.fused(x), residual=x), new_kv, None, amax
            y, router_ids = self.mlp.forward(self.post_attention_layernorm(x), replay_ids)
            return x + y, new_kv, router_ids, amax
        a, new_kv, amax = self.self_attn.forward(self.input_layernorm(x), positions, inv_freq, kv_mask, q_slots,
                                                 cache_kv, cache_index)
        x = x + a
        if isinstance(self.mlp, MLP):
            return x + self.mlp(self.post_attention_layernorm(x)), new_kv, None, amax
        y, router_ids = self.mlp.forward(self.post_attention_layernorm(x), replay_ids)
        return x + y, new_kv, router_ids, amax


class Embedding(nnx.Module):
    """Token embedding ``weight [vocab_size, hidden_size]``."""

    def __init__(self, vocab: int, dim: int, param_dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (vocab, dim), param_dtype))

    def __call__(self, ids):
        return jnp.take(self.weight[...], ids, axis=0)


class DecoderModel(nnx.Module):
    """The ``model.`` trunk: ``embed_tokens``, ``layers``, ``norm``."""

    def __init__(self, cfg: ModelConfig, *, fused_projections=(), **kw):
        from fp8rl_jax.models.fused import layer_fusion

        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, kw["param_dtype"], kw["rngs"])
        layers = []
        for i in range(cfg.num_hidden_layers):
            fuse_qkv, fuse_gate_up = layer_fusion(fused_projections, i)
            layers.append(DecoderLayer(cfg, i, fuse_qkv=fuse_qkv, fuse_gate_up=fuse_gate_up, **kw))
        self.layers = nnx.List(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kw["param_dtype"])


class CausalLM(nnx.Module):
    """Decoder-only causal LM (``*ForCausalLM``) with HF parameter names.

    Args:
      cfg: the architecture.
      linear_precision: ``"dense"`` or ``"fp8"`` (W8A8 blockwise linears; see module docstring).
      param_dtype: storage dtype of dense params (float32 for training masters, bfloat16 for rollout).
      dtype: activation/compute dtype (softmax and norms always run in float32).
      rngs: ``nnx.Rngs`` for random init (weights are normally loaded afterwards).
      remat_policy: activation checkpointing of each decoder layer in the cache-less (training) forward, one of
        :data:`fp8rl_jax.models.remat.REMAT_POLICIES` (``"none"``, ``"full"``, ``"dots_saveable"``, ...; maxtext
        ``remat_policy``). Changes memory and compute, never results. The attribute may be reassigned later.
      scan_layers: run the decoder layers of the cache-less forward as one ``jax.lax.scan`` over their stacked
        states (maxtext ``scan_layers``): one compiled layer body instead of ``num_hidden_layers`` unrolled copies
        (compile time and code size independent of depth). Parameters stay stored per layer under their HF names
        (``model.layers.{i}.*``), so every name-based path is unchanged; the forward stacks them into
        ``[num_layers, ...]`` arrays (a copy of the layer weights inside the compiled step, and the backward
        pass un-stacks the gradients: see :meth:`hidden_states`). Layers whose structure differs (a Qwen3-MoE
        dense + sparse mix) fall back to the Python loop. May be reassigned later.
      fuse_projections: FP8 only (the rollout engine): run every q/k/v and dense gate/up group that
        :func:`fp8rl_jax.models.fused.fused_projections` allows for ``cfg`` (each part's rows a multiple of 128) as one
        fused linear, vLLM's ``qkv_proj`` / ``gate_up_proj`` (rows ``[q; k; v]`` / ``[gate; up]``). The NNX state
        then holds the fused names; :func:`named_params` still returns, and :func:`load_named_params` still accepts,
        the HF names (split / concatenated), and load also takes the fused names as they are. Listed in
        :attr:`fused_projections`.

    Raises:
      ValueError: an unknown ``remat_policy`` (naming it and the valid ones); ``fuse_projections`` with a dense
        ``linear_precision``.
    """

    def __init__(self, cfg: ModelConfig, *, linear_precision: str = "dense", param_dtype=jnp.float32,
                 dtype=jnp.float32, rngs: nnx.Rngs | None = None, remat_policy: str = "none",
                 scan_layers: bool = False, fuse_projections: bool = False):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config, self.dtype, self.linear_precision = cfg, dtype, linear_precision
        self.remat_policy, self.scan_layers = validate_remat_policy(remat_policy), bool(scan_layers)
        if fuse_projections and linear_precision != "fp8":
            raise ValueError(f"fuse_projections=True needs linear_precision='fp8' (the FP8 rollout engine), got "
                             f"{linear_precision!r}")
        # the fused q/k/v and gate/up groups (static: a tuple of frozen dataclasses, part of the graphdef)
        self.fused_projections = fused_projections_for(cfg) if fuse_projections else ()
        kw = dict(linear_precision=linear_precision, param_dtype=param_dtype, dtype=dtype, rngs=rngs)
        self.model = DecoderModel(cfg, fused_projections=self.fused_projections, **kw)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, precision="dense", param_dtype=param_dtype,
                                  dtype=dtype, rngs=rngs)
        else:
            self.lm_head = None

    @property
    def is_moe(self) -> bool:
        """Whether any layer has routed experts (a Qwen3-MoE sparse layer)."""
        return any(self.config.is_sparse_layer(i) for i in range(self.config.num_hidden_layers))

    def hidden_states(self, input_ids: jax.Array, positions: jax.Array, kv_mask: jax.Array,
                      cache: KVCache | None = None, cache_index: jax.Array | int = 0, *,
                      routed_experts: jax.Array | None = None, return_routing: bool = False):
        """Final-norm hidden states.

        Args:
          input_ids: int32 ``[B, S]``.
          positions: int32 ``[B, S]`` RoPE positions (left-padded rows start at 0 on their first real token).
          kv_mask: bool ``[B, T]``: which key slots hold real tokens (``T = S`` without cache, ``T_max`` with).
          cache: optional :class:`KVCache`; the new keys/values are written at slots
            ``[cache_index, cache_index + S)``.
          cache_index: int32 scalar, first slot written.
          routed_experts: optional int ``[B, S, num_layers, k]`` recorded expert ids to replay (rollout routing
            replay, R3, arXiv 2510.11370 Sec. 3; ``k = num_experts_per_tok``); ``-1`` entries (dense layers,
            positions without a record) are routed normally. Ignored by a model without sparse layers.
          return_routing: also return each sparse layer's own top-k expert ids.

        Returns:
          ``(h [B, S, hidden] in dtype, new_cache or None)``, and with ``return_routing`` a third element: int32
          ``[B, S, num_layers, k]`` router top-k ids (``-1`` for dense layers), or None for a dense model.

        Without a cache the layers run under :attr:`remat_policy` (``jax.checkpoint`` per layer) and, with
        :attr:`scan_layers` and structurally identical layers, as a ``jax.lax.scan`` over their stacked states;
        both give the plain loop's results (same ops, same order). With a cache (the rollout engine) the layers
        always run as the plain loop.

        Raises:
          ValueError: ``routed_experts`` of the wrong shape; an unknown :attr:`remat_policy`.
        """
        b, s = input_ids.shape
        cfg = self.config
        moe = self.is_moe
        if routed_experts is not None and moe:
            want = (b, s, cfg.num_hidden_layers, cfg.num_experts_per_tok)
            if tuple(routed_experts.shape) != want:
                raise ValueError(f"routed_experts must have shape {want} ([B, S, num_layers, num_experts_per_tok]),"
                                 f" got {tuple(routed_experts.shape)}")
        inv_freq = rope_inv_freq(cfg)
        q_slots = jnp.broadcast_to(jnp.asarray(cache_index, jnp.int32) + jnp.arange(s, dtype=jnp.int32), (b, s))
        x = self.model.embed_tokens(input_ids).astype(self.dtype)
        policy = checkpoint_policy(self.remat_policy)
        if cache is None and (policy is not None or self.scan_layers):
            reps = routed_experts if moe else None
            x, router_ids = self._cacheless_layers(x, positions, inv_freq, kv_mask, q_slots, reps, policy)
            h = self.model.norm(x)
            if return_routing:
                if moe:
                    fill = jnp.full((b, s, cfg.num_experts_per_tok), -1, jnp.int32)
                    router_ids = jnp.stack([fill if r is None else r for r in router_ids], axis=2)
                return h, None, (router_ids if moe else None)
            return h, None
        new_k, new_v, routing = [], [], []
        for i, layer in enumerate(self.model.layers):
            ckv = cache.layer(i) if cache is not None else None
            rep = routed_experts[:, :, i] if (routed_experts is not None and moe) else None
            x, kv, ids = layer(x, positions, inv_freq, kv_mask, q_slots, ckv, cache_index, rep)
            if kv is not None:
                new_k.append(kv[0])
                new_v.append(kv[1])
            if return_routing and moe:
                routing.append(ids if ids is not None else jnp.full((b, s, cfg.num_experts_per_tok), -1, jnp.int32))
        h = self.model.norm(x)
        new_cache = cache._replace(k=tuple(new_k), v=tuple(new_v)) if cache is not None else None
        if return_routing:
            return h, new_cache, (jnp.stack(routing, axis=2) if moe else None)
        return h, new_cache

    def _cacheless_layers(self, x, positions, inv_freq, kv_mask, q_slots, routed_experts, policy):
        """The decoder layers without a cache, under ``jax.checkpoint(policy)`` and optionally ``lax.scan``.

        Args:
          x: ``[B, S, hidden]`` embeddings in ``dtype``; positions, inv_freq, kv_mask, q_slots: as the loop.
          routed_experts: int ``[B, S, L, k]`` R3 record or None (only passed for a MoE model).
          policy: a ``jax.checkpoint`` policy or None (no remat).

        Returns:
          ``(x [B, S, hidden], router_ids)``: ``router_ids`` a list of per-layer int32 ``[B, S, k]`` (or None for a
          dense layer). Each layer's q/k/v maxima (capture on) are sown on its own ``self_attn`` here, outside the
          checkpointed/scanned body, so ``qkv_absmax_from_intermediates`` finds them at the usual paths.

        With :attr:`scan_layers`, the layers' parameters (``nnx.Param`` states) are stacked with ``jnp.stack``
        into ``[L, ...]`` leaves inside the traced function and the scan body ``nnx.merge``s one slice; this costs
        one stacked copy of the layer weights per forward (and the backward pass un-stacks their gradients).
        Layers with a different graph structure (a dense + sparse MoE mix, or different per-layer
        ``dot_general`` objects) keep the Python loop, each layer under ``nnx.remat(policy)``. Measured on XLA:CPU
        (tests/test_remat_scan.py): remat inside the scan cuts the gradient's temp memory several-fold; in the
        unrolled loop XLA schedules the recomputations freely and the saving is small.
        """
        layers = list(self.model.layers)
        n = len(layers)

        def run(layer, x, rep):
            y, _, ids, amax = layer.forward(x, positions, inv_freq, kv_mask, q_slots, None, None, rep)
            return y, ids, amax

        scan = self.scan_layers and n > 1
        if scan:
            # Parameters are stacked and sliced; any other layer variable would be silently shared: scan only
            # without one (none exists in this model's layers).
            scan = not [v for layer in layers for _, v in nnx.iter_graph(layer)
                        if isinstance(v, nnx.Variable) and not isinstance(v, (nnx.Param, nnx.Intermediate))]
        if scan:
            with _without_capture_bookkeeping(layers):
                splits = [nnx.split(layer, nnx.Param, ...) for layer in layers]
            scan = all(g == splits[0][0] for g, _, _ in splits[1:])
        if scan:
            graphdef, rest = splits[0][0], splits[0][2]
            stacked = jax.tree.map(lambda *a: jnp.stack(a), *[p for _, p, _ in splits])
            reps = None if routed_experts is None else jnp.moveaxis(routed_experts, 2, 0)  # [L, B, S, k]

            def body(carry, xs):
                params, rep = xs
                y, ids, amax = run(nnx.merge(graphdef, params, rest), carry, rep)
                return y, (ids, amax)

            if policy is not None:
                body = jax.checkpoint(body, policy=policy, prevent_cse=False)
            x, (ids, amax) = jax.lax.scan(body, x, (stacked, reps))
            router_ids = [None] * n if ids is None else [ids[i] for i in range(n)]
            amaxes = [None] * n if amax is None else [amax[i] for i in range(n)]
        else:
            fn = run if policy is None else nnx.remat(run, policy=policy)
            router_ids, amaxes = [], []
            with _without_capture_bookkeeping(layers):
                for i, layer in enumerate(layers):
                    rep = None if routed_experts is None else routed_experts[:, :, i]
                    x, ids, amax = fn(layer, x, rep)
                    router_ids.append(ids)
                    amaxes.append(amax)
        for layer, amax in zip(layers, amaxes):
            if amax is not None:
                layer.self_attn.sow(nnx.Intermediate, "qkv_absmax", amax)
        return x, router_ids

    def logits(self, h: jax.Array) -> jax.Array:
        """``lm_head`` (or tied embeddings) applied to hidden states: ``[..., hidden] -> [..., vocab]`` float32."""
        if self.lm_head is None:
            w = self.model.embed_tokens.weight[...]
            return jnp.einsum("...h,vh->...v", h, w.astype(h.dtype), preferred_element_type=jnp.float32)
        return self.lm_head(h).astype(jnp.float32)

    def __call__(self, input_ids, positions=None, kv_mask=None, cache=None, cache_index=0):
        """Full forward: logits ``[B, S, vocab]`` float32 (and the updated cache when one is given).

        Without ``positions``/``kv_mask`` every token is real and positions are ``0..S-1``.
        """
        b, s = input_ids.shape
        if kv_mask is None:
            kv_mask = jnp.ones((b, s), bool)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        h, new_cache = self.hidden_states(input_ids, positions, kv_mask, cache, cache_index)
        logits = self.logits(h)
        return (logits, new_cache) if cache is not None else logits


@contextlib.contextmanager
def _without_capture_bookkeeping(modules):
    """Temporarily detach ``nnx.capture``'s per-module ``__captures__`` from ``modules`` and their submodules.

    ``nnx.capture`` attaches a ``__captures__`` tuple of variables to every module; ``nnx.merge`` and
    ``nnx.remat`` cannot sort those paths next to ``nnx.List`` indices (flax 0.12: ``TypeError: '<' not
    supported between 'str' and 'int'`` / "Comparator raised exception while sorting pytree dictionary keys").
    The checkpointed / scanned layer bodies never sow (their caller does, on the real modules, after this
    context), so the layers are split without them; they are restored on exit.
    """
    saved = []
    for m in modules:
        for _, mod in nnx.iter_modules(m):
            if "__captures__" in vars(mod):
                saved.append((mod, vars(mod)["__captures__"]))
                delattr(mod, "__captures__")
    try:
        yield
    finally:
        for mod, cap in saved:
            mod.__captures__ = nnx.data(cap)


def set_qkv_capture(model: nnx.Module, enabled: bool = True) -> None:
    """Make every :class:`Attention` of ``model`` sow its per-token max |q|, |k|, |v| in cache-less forwards.

    The values (after QK-norm and RoPE, what a KV cache stores) are read with ``nnx.capture`` and
    :func:`qkv_absmax_from_intermediates`; this is how the trainer calibrates FP8 KV scales from its own
    training forward without an extra pass (NeMo-RL hooks the same tensors). Decoding with a cache never sows.
    """
    for _, mod in model.iter_modules():
        if isinstance(mod, Attention):
            mod.capture_qkv_absmax = bool(enabled)


def qkv_absmax_from_intermediates(intermediates, num_layers: int) -> jax.Array:
    """Stack the sown ``qkv_absmax`` of each layer: float32 ``[num_layers, 3 (q, k, v), B, S]``.

    Args:
      intermediates: the ``nnx.Intermediate`` state returned by ``nnx.capture(fn, nnx.Intermediate)``.
      num_layers: layers expected.

    Raises:
      ValueError: a layer did not sow (capture not enabled with :func:`set_qkv_capture`, or a cached forward).
    """
    found = {}
    for path, var in nnx.to_flat_state(intermediates):
        if path and path[-1] == "qkv_absmax" and "layers" in path:
            val = var.get_value() if isinstance(var, nnx.Variable) else var
            found[int(path[path.index("layers") + 1])] = val[-1] if isinstance(val, tuple) else val
    missing = [i for i in range(num_layers) if i not in found]
    if missing:
        raise ValueError(f"no captured q/k/v maxima for layers {missing[:8]}: call set_qkv_capture(model) and run "
                         "a cache-less forward under nnx.capture(..., nnx.Intermediate)")
    return jnp.stack([found[i] for i in range(num_layers)])


def positions_from_mask(mask: jax.Array) -> jax.Array:
    """RoPE positions for left-padded rows: ``cumsum(mask) - 1`` clipped at 0. ``mask [B, S]`` -> int32 ``[B, S]``."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, bucket: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad prompts to a multiple of ``bucket``: ``(ids int32 [B, P], mask bool [B, P])``."""
    p = bucket * -(-max(len(x) for x in prompts) // bucket)
    ids = np.full((len(prompts), p), pad_id, np.int32)
    mask = np.zeros((len(prompts), p), bool)
    for i, x in enumerate(prompts):
        ids[i, p - len(x):] = x
        mask[i, p - len(x):] = True
    return ids, mask


def param_name(path: tuple) -> str:
    """NNX state path -> HF parameter name (``('model','layers',0,'mlp','up_proj','weight')`` -> dotted)."""
    return ".".join(str(p) for p in path)


def fused_projections_for(cfg: ModelConfig) -> tuple:
    """The fused q/k/v and gate/up groups of an FP8 model of ``cfg`` (:func:`fp8rl_jax.models.fused.fused_projections`
    of :func:`fp8rl_jax.models.config.hf_param_shapes`, 128-row blocks)."""
    from fp8rl_jax.models.config import hf_param_shapes
    from fp8rl_jax.models.fused import fused_projections

    return fused_projections(hf_param_shapes(cfg))


def named_params(model: nnx.Module) -> dict[str, jax.Array]:
    """All parameters as ``{hf_name: array}`` (arrays are the live values, not copies).

    A model with fused projections (``CausalLM(fuse_projections=True)``) returns its fused tensors under the HF
    names of their parts, as row slices (copies): the checkpoint naming, whatever the model stores. Likewise a
    Qwen3-MoE layer's stacked experts (``mlp.experts.gate_proj.weight [E, I, H]``, :mod:`fp8rl_jax.models.experts`)
    come out as per-expert slices (copies) under ``model.layers.{i}.mlp.experts.{j}.gate_proj.weight``, in the order
    the former per-expert layout had (:func:`fp8rl_jax.models.experts.split_expert_stacks`).
    """
    from fp8rl_jax.models.experts import split_expert_stacks

    out = split_expert_stacks({param_name(p): v[...] for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))})
    fused = getattr(model, "fused_projections", ())
    if fused:
        from fp8rl_jax.models.fused import split_tensors

        out = split_tensors(out, fused)
    return out


def _stack_host_or_device(parts: list) -> Any:
    """``np.stack`` for host (numpy) parts, :func:`jax.numpy.stack` when any part is a JAX array (through the host
    when the parts live on different devices, e.g. per-expert exports on their expert groups' sub-meshes,
    :mod:`fp8rl_jax.export_ep`)."""
    if any(isinstance(a, jax.Array) for a in parts):
        devices = {frozenset(a.devices()) for a in parts if isinstance(a, jax.Array)}
        if len(devices) == 1:
            return jnp.stack([jnp.asarray(a) for a in parts])
    return np.stack([np.asarray(a) for a in parts])


def load_named_params(model: nnx.Module, params: dict[str, Any], *, strict_extra: bool = False,
                      cast: bool = True) -> None:
    """Assign ``{hf_name: array}`` into ``model`` in place, checking names, shapes and finiteness.

    Args:
      model: a :class:`CausalLM` (dense or fp8).
      params: HF-named arrays (numpy or jax). Extra names that HF checkpoints commonly carry
        (``rotary_emb.inv_freq``; ``lm_head.weight`` of a tied model) are ignored. For a model with fused
        projections each fused tensor is taken as it is when ``params`` has it under the fused name
        (``...self_attn.qkv_proj.weight``), else concatenated from its parts' HF names
        (:func:`fp8rl_jax.models.fused.fuse_tensors`).
        A Qwen3-MoE layer's stacked experts are taken under their stacked name
        (``...mlp.experts.gate_proj.weight [E, I, H]``) or, as HF checkpoints name them, stacked from the per-expert
        tensors ``...mlp.experts.{j}.gate_proj.weight`` (:func:`fp8rl_jax.models.experts.stack_expert_tensors`;
        host numpy tensors are stacked on the host, then copied once).
      strict_extra: raise on any other unexpected name instead of ignoring it.
      cast: cast each array to the parameter's dtype (e.g. float32 checkpoint -> bfloat16 params).

    Raises:
      KeyError: a parameter the model needs is missing (all missing names listed).
      ValueError: a shape mismatch (name, expected and got shapes) or an unexpected name with ``strict_extra``.
    """
    fused = getattr(model, "fused_projections", ())
    if fused:  # each fused tensor as given, or concatenated from its parts' HF names
        from fp8rl_jax.models.fused import FUSED_SUFFIXES, fuse_tensors

        todo = [g for g in fused if f"{g.name}.weight" not in params]
        missing = [f"{p}.weight" for g in todo for p in g.parts if f"{p}.weight" not in params]
        if missing:
            raise KeyError(f"checkpoint is missing {len(missing)} parameter(s) the model needs, e.g. {missing[:5]}")
        parts = {f"{p}.{x}" for g in todo for p in g.parts for x in FUSED_SUFFIXES}
        params = fuse_tensors({k: jnp.asarray(v) if k in parts else v for k, v in params.items()}, todo)
    state = nnx.state(model, nnx.Param)
    flat = list(nnx.to_flat_state(state))
    want = {param_name(p): v for p, v in flat}
    stacks = {n: tuple(v[...].shape) for n, v in want.items() if is_expert_stack_name(n)}
    if stacks:  # per-expert HF tensors -> the model's [E, ...] stacks (host arrays stacked on the host)
        params = stack_expert_tensors(params, stacks, stack=_stack_host_or_device)
        missing = sorted(n for s in stacks if s not in params for n in expert_names(s, stacks[s][0]))
        if missing:
            raise KeyError(f"checkpoint is missing {len(missing)} parameter(s) the model needs, e.g. {missing[:5]}")
    missing = sorted(set(want) - set(params))
    if missing:
        raise KeyError(f"checkpoint is missing {len(missing)} parameter(s) the model needs, e.g. {missing[:5]}")
    extra = [k for k in params if k not in want and not k.endswith("rotary_emb.inv_freq")
             and not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if extra and strict_extra:
        raise ValueError(f"checkpoint has {len(extra)} unexpected parameter(s), e.g. {sorted(extra)[:5]}")
    for name, var in want.items():
        arr = params[name]
        if tuple(arr.shape) != tuple(var[...].shape):
            raise ValueError(f"shape mismatch for {name}: model expects {tuple(var[...].shape)}, "
                             f"checkpoint has {tuple(arr.shape)} (config and weights disagree)")
        var[...] = jnp.asarray(arr, var[...].dtype) if cast else jnp.asarray(arr)
