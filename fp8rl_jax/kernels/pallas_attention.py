"""Decode attention that reads the e4m3 KV cache and dequantizes inside the kernel (flash-decoding, split over T).

Why (issue 21): with ``kv_cache_dtype="fp8_e4m3"`` the decode step used to dequantize every layer's whole cache,
``[B, T_max, H_kv, D]`` e4m3 -> bf16, before ``jax.nn.dot_product_attention``: per layer and per token it read
1 byte, wrote 2 and read 2 again per cache element (5 bytes where the e4m3 cache needs 1), over all ``T_max`` slots
whether filled or not. This kernel reads the e4m3 cache once, only up to each row's last visible slot, and applies
the scales in float32 inside the kernel (vLLM's FP8 KV semantics: ``k ~= e4m3 * k_scale``, ``v ~= e4m3 * v_scale``).

Library first (the project rule): ``jax.nn.dot_product_attention`` (XLA / cuDNN) takes no FP8 KV with scalar
scales; tokamax 0.0.12's attention accepts quantized (qwix) K/V, but its Mosaic GPU kernel dequantizes outside
the kernel ("TODO: Support in-kernel dequantization"), its Triton kernel runs one program per query head (a GQA
group re-reads the same K/V G times) with no split of a single query over the sequence, and it brings pydantic,
qwix, typeguard and jaxtyping, which the GPU machine (no package registry) lacks. ``jax.experimental.pallas.ops.gpu``
ships a bf16 decode-attention example (read for design, no code taken): no FP8, no per-row mask. Hence this kernel.

Design (flash-decoding, Dao et al. 2023, "Flash-Decoding for long-context inference"; FlashAttention-2's online
softmax):

- grid ``(B, H_kv, splits)``: program ``(b, h, s)`` owns one KV head of one sequence and a contiguous slice of
  ``blocks_per_split * block_k`` cache slots, so even ``B = 1`` fills the GPU at long contexts. All ``G = H_q / H_kv``
  query heads of the group (padded to ``G_p >= 16`` rows for the tensor-core dot) share each K/V tile it loads: the
  cache is read once per step, not once per query head.
- per ``block_k`` tile: ``K`` e4m3 ``[block_k, D]`` is cast in registers to the compute dtype (exact: every e4m3
  value is a bf16/f16/f32 value), ``S = (q . K^T) * (k_scale * sm_scale)`` in float32 (the scale factored out of the
  dot, so no rounding of ``e4m3 * k_scale`` to bf16), masked, online-softmax (running max ``m``, sum ``l``, float32),
  ``acc = acc * exp(m_old - m_new) + P . V_e4m3`` with ``P`` cast to the compute dtype (as the materialized path casts
  its probabilities) and float32 accumulation. ``v_scale`` multiplies the combined output once.
- the loop runs only over tiles that hold a visible slot (``t <= q_slot[b]``): a dynamic trip count, so a 4k-slot
  cache that holds 600 tokens is read for 600. A tile that would overhang ``T`` is moved back to end at ``T`` and
  its already-covered slots are masked, so every load is in bounds (no masked loads, identical in interpret mode).
- the partial ``(acc, m, l)`` of every split are combined by a few XLA ops:
  ``out = v_scale * sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s``.

FP8 attention (``q_scale``, vLLM ``q_scale`` / the engine's ``fp8_attention``): the queries are quantized to e4m3
with ``q_scale`` (:func:`fp8rl_jax.fp8.kv_cache.quantize_kv`, outside the kernel: ``[B, H_q, D]`` is tiny) and
``q_e4m3 . k_e4m3`` runs on e4m3 operands with float32 accumulation, times ``q_scale * k_scale * sm_scale``.

Numerics against the materialized path (:meth:`fp8rl_jax.models.decoder.Attention.forward`): that path rounds
``e4m3 * scale`` to bf16 for K and V and normalizes the probabilities before casting them to bf16; here K and V stay
exact e4m3 times a float32 scale and the (unnormalized, running-max-relative) probabilities are cast to bf16. Both
are within bf16 rounding of the exact attention; tests/test_fp8_attention_kernel.py bounds each against a float64
reference and the engine's tokens/logprobs against each other.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from fp8rl_jax.fp8.kv_cache import is_fp8_cache, quantize_kv
from fp8rl_jax.kernels.registry import choose, register_selftest, run_pallas

#: ``kv_attention`` choices of the engine / :func:`use_fp8_kv_kernel`.
KV_ATTENTION_IMPLS = ("auto", "materialize", "pallas", "interpret")
#: Programs to aim for (about two per SM of an H100, 132 SMs), as :mod:`fp8rl_jax.kernels.pallas_decode`.
TARGET_PROGRAMS = 264
#: Smallest tile the Triton dot accepts along any dimension.
MIN_TILE = 16
# Score of a masked slot: finite, so exp(NEG - NEG) never makes a NaN; exp(NEG - real) underflows to 0.
_NEG = -1e30


def use_fp8_kv_kernel(impl: str | None) -> str | None:
    """Resolve a ``kv_attention`` choice for an e4m3 cache's decode step.

    Args:
      impl: ``"auto"`` / ``None`` (the kernel where the program is lowered for CUDA, the materialized path elsewhere:
        :func:`fp8rl_jax.kernels.registry.choose`, family ``fp8_kv_attention``), ``"materialize"`` (dequantize the
        cache, then ``jax.nn.dot_product_attention``), ``"pallas"`` (the kernel; interpret mode where the program is
        not lowered for CUDA) or ``"interpret"`` (the kernel in Pallas interpret mode, for tests).

    Returns:
      ``None`` (materialize), ``"auto"``, ``"pallas"`` or ``"interpret"``.

    Raises:
      ValueError: another name (the valid ones named).
    """
    impl = "auto" if impl is None else impl
    if impl not in KV_ATTENTION_IMPLS:
        raise ValueError(f"kv_attention={impl!r} is not one of {KV_ATTENTION_IMPLS}")
    return None if impl == "materialize" else impl


def decode_kernel_choice(impl: str | None, num_queries: int, cache_shape) -> str | None:
    """How an attention call over an e4m3 cache may use this module's kernels: ``None`` (never), ``"auto"``,
    ``"pallas"`` or ``"interpret"`` (see :func:`use_fp8_kv_kernel`).

    The hook of :meth:`fp8rl_jax.models.decoder.Attention.forward`: a decode step (``num_queries == 1``,
    :func:`fp8_kv_decode_attention`) or a prefill (``num_queries > 1``, :func:`fp8_kv_prefill_attention`) over a cache
    the kernels take (``T >= 16`` slots, ``head_dim`` a power of two >= 16) may use them; other shapes keep the
    materialized path.

    Args:
      impl: a :data:`KV_ATTENTION_IMPLS` name (None = ``"auto"``).
      num_queries: query tokens per row in this call (``S``).
      cache_shape: ``[B, T, H_kv, D]`` of the cache.

    Raises:
      ValueError: an unknown ``impl``.
    """
    use = use_fp8_kv_kernel(impl)
    _, t, _, d = cache_shape
    fits = num_queries >= 1 and t >= MIN_TILE and d >= MIN_TILE and not d & (d - 1)
    return use if fits else None


def fp8_kv_attention_dispatch(mode: str, *args, kernel, xla):
    """Run an attention over an e4m3 cache (decode or prefill) as :func:`decode_kernel_choice`'s ``mode`` says.

    Args:
      mode: ``"auto"``: through :func:`fp8rl_jax.kernels.registry.choose`, family ``fp8_kv_attention``
        (``kernel(*args, interpret=False)`` where lowered for CUDA, ``xla(*args)`` elsewhere); ``"pallas"``: the
        kernel (interpret mode where not lowered for CUDA); ``"interpret"``: the kernel in interpret mode.
      args: the attention's arrays, passed to either callable unchanged.
      kernel: ``kernel(*args, interpret=...)``, :func:`fp8_kv_decode_attention` or :func:`fp8_kv_prefill_attention`
        with its static settings bound. xla: the materialized path, same result shapes and dtypes.

    Returns: what the chosen callable returns. Raises what they raise (shape errors are named there)."""
    if mode == "auto":
        return choose("fp8_kv_attention", *args, kernel=functools.partial(kernel, interpret=False), xla=xla)
    return kernel(*args, interpret=True if mode == "interpret" else None)


def choose_splits(batch: int, num_kv_heads: int, num_blocks: int, target_programs: int = TARGET_PROGRAMS) -> int:
    """Sequence splits: enough for ``batch * num_kv_heads * splits >= target_programs``, at most one per tile."""
    return int(max(1, min(num_blocks, -(-target_programs // max(1, batch * num_kv_heads)))))


def _kernel_query(q, q_scale, k_scale, sm_scale):
    """``(q_in, scales, sm_scale)``: the queries the kernels take (e4m3 with ``q_scale``, else as given), the float32
    ``[1]`` scales the kernel reads (``(k_scale,)`` or ``(k_scale, q_scale)``) and the Python float ``sm_scale``
    (default ``D ** -0.5``). The kernel forms ``S = (q_in . K^T) * c`` itself (:func:`_score_multiplier`): computed
    in XLA, ``c`` would be one more launch per layer and decode step (its consumer is the kernel, nothing to fuse
    into)."""
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    ks = jnp.asarray(k_scale, jnp.float32).reshape(1)
    if q_scale is None:
        return q, (ks,), sm_scale
    qs = jnp.asarray(q_scale, jnp.float32)
    return quantize_kv(q, qs), (ks, qs.reshape(1)), sm_scale


def _score_multiplier(scale_refs, sm_scale: float):
    """Inside a kernel: ``c = k_scale * sm_scale``, or ``(q_scale * k_scale) * sm_scale`` with FP8 attention, in
    float32 (the rounding of each product as XLA's float32 multiply)."""
    ks = scale_refs[0][...]
    c = ks if len(scale_refs) == 1 else scale_refs[1][...] * ks
    return c * jnp.float32(sm_scale)


def _online_softmax(q, k_ref, v_ref, mask_ref, c, *, start0, n, t, bk, limit, compute_dtype, precision):
    """The flash loop both kernels run: ``n`` tiles of ``bk`` slots from ``start0`` of one KV head's ``[T, D]`` e4m3
    K/V, online softmax per query row. Row ``r`` sees slot ``pos`` iff ``mask_ref[pos]`` and ``pos <= limit[r]``;
    ``S = (q . K^T) * c`` in float32, ``P`` cast to the compute dtype for ``P . V``. A tile that would overhang ``T``
    is moved back to end at ``T`` and its already-covered slots are masked (every load in bounds).

    Returns: ``(acc [R, D], m [R], l [R])`` float32 (unnormalized output, running max and sum)."""
    rows, d = q.shape
    lane = lax.broadcasted_iota(jnp.int32, (bk,), 0)

    def body(i, carry):
        acc, m, l = carry
        nominal = start0 + i * bk
        start = jnp.minimum(nominal, t - bk)
        pos = start + lane
        col = (mask_ref[pl.ds(start, bk)] != 0) & (pos >= nominal)  # [bk]
        valid = col[None, :] & (pos[None, :] <= limit[:, None])  # [R, bk]
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        kq = k if q.dtype == k.dtype else k.astype(compute_dtype)
        sc = lax.dot_general(q, kq, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                             precision=precision) * c
        sc = jnp.where(valid, sc, _NEG)
        m_new = jnp.maximum(m, jnp.max(sc, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(valid, jnp.exp(sc - m_new[:, None]), 0.0)
        l = l * alpha + jnp.sum(p, axis=1)
        pv = lax.dot_general(p.astype(compute_dtype), v.astype(compute_dtype), (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32, precision=precision)
        return acc * alpha[:, None] + pv, m_new, l

    init = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), _NEG, jnp.float32), jnp.zeros((rows,), jnp.float32))
    return lax.fori_loop(0, n, body, init)


def _kernel(*refs, n_scales, sm_scale, bk, blocks_per_split, t, compute_dtype, precision):
    """Program ``(b, h, s)``: one KV head of one sequence over slots ``[s * blocks_per_split * bk, ...)``.

    ``refs``: ``n_scales`` float32 ``()`` scale refs (``k_scale``, then ``q_scale`` with FP8 attention:
    :func:`_score_multiplier`), then slot_ref ``()`` int32 last visible slot of row b; mask_ref ``[T]`` int8
    (row b of ``kv_mask``); q_ref ``[G_p, D]`` (compute dtype, or e4m3 for FP8 attention); k_ref, v_ref ``[T, D]``
    e4m3 (row b, KV head h of the cache, strided, no copy); o_ref ``[G_p, D]``, m_ref / l_ref ``[G_p]`` float32
    (this split's unnormalized output, running max and sum)."""
    scale_refs, (slot_ref, mask_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref) = refs[:n_scales], refs[n_scales:]
    gp = q_ref.shape[0]
    split_start = pl.program_id(2) * (blocks_per_split * bk)
    hi = jnp.minimum(slot_ref[...] + 1, t)  # visible slots are < hi
    n = jnp.clip((hi - split_start + bk - 1) // bk, 0, blocks_per_split)
    acc, m, l = _online_softmax(q_ref[...], k_ref, v_ref, mask_ref, _score_multiplier(scale_refs, sm_scale),
                                start0=split_start, n=n, t=t, bk=bk,
                                limit=jnp.broadcast_to(hi - 1, (gp,)), compute_dtype=compute_dtype,
                                precision=precision)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(jax.jit, static_argnames=("sm_scale", "bk", "splits", "blocks_per_split", "gp", "out_dtype",
                                             "interpret", "num_warps", "num_stages"))
def _decode(q, k_cache, v_cache, scales, v_scale, kv_mask, q_slot, *, sm_scale, bk, splits, blocks_per_split, gp,
            out_dtype, interpret, num_warps, num_stages):
    b, hq, d = q.shape
    _, t, hkv, _ = k_cache.shape
    g = hq // hkv
    compute_dtype = jnp.dtype(out_dtype)
    # fp8 queries (FP8 attention) stay e4m3; otherwise the dot runs in the compute dtype
    q4 = q.reshape(b, hkv, g, d)
    if not is_fp8_cache(q4):
        q4 = q4.astype(compute_dtype)
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, gp - g), (0, 0)))  # zero rows: [B, H_kv, G_p, D], tiny
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None  # IEEE float32, not TF32
    kwargs = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    sq = pl.squeezed
    o, m, l = pl.pallas_call(
        functools.partial(_kernel, n_scales=len(scales), sm_scale=sm_scale, bk=bk, blocks_per_split=blocks_per_split,
                          t=t, compute_dtype=compute_dtype, precision=precision),
        grid=(b, hkv, splits),
        in_specs=[
            *[pl.BlockSpec((sq,), lambda i, h, s: (0,))] * len(scales),  # k_scale (, q_scale)
            pl.BlockSpec((sq,), lambda i, h, s: (i,)),  # last visible slot of row i
            pl.BlockSpec((sq, t), lambda i, h, s: (i, 0)),  # kv_mask row
            pl.BlockSpec((sq, sq, gp, d), lambda i, h, s: (i, h, 0, 0)),  # the group's queries
            pl.BlockSpec((sq, t, sq, d), lambda i, h, s: (i, 0, h, 0)),  # K cache row i, head h (strided view)
            pl.BlockSpec((sq, t, sq, d), lambda i, h, s: (i, 0, h, 0)),  # V cache
        ],
        out_specs=[
            pl.BlockSpec((sq, sq, sq, gp, d), lambda i, h, s: (i, h, s, 0, 0)),
            pl.BlockSpec((sq, sq, sq, gp), lambda i, h, s: (i, h, s, 0)),
            pl.BlockSpec((sq, sq, sq, gp), lambda i, h, s: (i, h, s, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, splits, gp, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, splits, gp), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, splits, gp), jnp.float32)],
        interpret=interpret,
        name="fp8_kv_decode_attention",
        **kwargs,
    )(*scales, q_slot, kv_mask, q4, k_cache, v_cache)
    # combine the splits (flash-decoding's second stage): [B, H_kv, G_p, D]
    mx = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - mx)  # 0 for a split that saw no visible slot
    den = jnp.sum(w * l, axis=2)
    num = jnp.sum(w[..., None] * o, axis=2)
    out = num * (v_scale / jnp.where(den > 0, den, 1.0))[..., None]
    return out[:, :, :g].reshape(b, hq, d).astype(out_dtype)


def fp8_kv_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, k_scale, v_scale,
                            kv_mask: jax.Array, q_slot: jax.Array, *, q_scale=None, sm_scale: float | None = None,
                            block_k: int = 128, splits: int | None = None, interpret: bool | None = None,
                            num_warps: int = 4, num_stages: int = 2) -> jax.Array:
    """Attention of one new token per row over an e4m3 KV cache, dequantized inside the kernel.

    ``out[b, h] = sum_t softmax_t(sm_scale * q[b, h] . K[b, t, h // G]) V[b, t, h // G]`` over visible slots
    (``kv_mask[b, t] and t <= q_slot[b]``), with ``K = k_cache * k_scale``, ``V = v_cache * v_scale`` (vLLM's FP8 KV
    cache semantics, :mod:`fp8rl_jax.fp8.kv_cache`), ``G = H_q / H_kv`` consecutive query heads per KV head (GQA, the
    grouping of ``jax.nn.dot_product_attention``), float32 softmax and accumulation.

    Args:
      q: ``[B, H_q, D]`` queries (bf16 / f16 / f32), after QK-norm and RoPE; the output has this dtype.
      k_cache, v_cache: ``[B, T, H_kv, D]`` ``float8_e4m3fn``, the layout of :class:`fp8rl_jax.models.decoder.KVCache`
        (read in place, no transposed copy); ``T >= 16``.
      k_scale, v_scale: float32 scalars (per-layer dequantization multipliers, > 0).
      kv_mask: bool ``[B, T]``, True on slots holding real tokens (left padding is False).
      q_slot: int ``[B]``, the query's own slot (causality: slots ``<= q_slot`` are visible; the engine's
        ``cache_index``).
      q_scale: float32 scalar for FP8 attention (queries quantized to e4m3 with it, ``QK^T`` on e4m3 operands), or
        None.
      sm_scale: softmax scale (default ``D ** -0.5``, Llama / Qwen2 / Qwen3).
      block_k: slots per tile (a power of two >= 16; lowered to the largest power of two <= T when T is smaller).
      splits: sequence splits (default :func:`choose_splits`: about :data:`TARGET_PROGRAMS` programs).
      interpret: Pallas interpret mode (default None: compiled where the program is lowered for CUDA, interpret
        mode elsewhere).
      num_warps, num_stages: Triton launch parameters (GPU only).

    Returns:
      ``[B, H_q, D]`` in ``q.dtype``. A row with no visible slot gets zeros (never NaN).

    Raises:
      ValueError: a cache that is not e4m3, mismatched shapes, ``H_q`` not a multiple of ``H_kv``, ``D`` not a power
        of two >= 16, ``T < 16``, or ``block_k`` not a power of two >= 16 (each named).

    Source: flash-decoding (split-K over the sequence + log-sum-exp combine); vLLM's FP8 KV cache semantics.
    """
    if not (is_fp8_cache(k_cache) and is_fp8_cache(v_cache)):
        raise ValueError(f"fp8_kv_decode_attention needs an e4m3 cache, got {k_cache.dtype} / {v_cache.dtype}")
    if q.ndim != 3 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"fp8_kv_decode_attention: q {tuple(q.shape)} must be [B, H_q, D] and k/v caches "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)} the same [B, T, H_kv, D]")
    b, hq, d = q.shape
    _, t, hkv, _ = k_cache.shape
    if k_cache.shape[0] != b or k_cache.shape[3] != d or hq % hkv:
        raise ValueError(f"fp8_kv_decode_attention: q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}"
                         " (same B and D, H_q a multiple of H_kv)")
    if tuple(kv_mask.shape) != (b, t) or tuple(jnp.shape(q_slot)) != (b,):
        raise ValueError(f"fp8_kv_decode_attention: kv_mask {tuple(kv_mask.shape)} must be [B, T] = {(b, t)} and "
                         f"q_slot {tuple(jnp.shape(q_slot))} [B] = {(b,)}")
    if d < MIN_TILE or d & (d - 1):
        raise ValueError(f"fp8_kv_decode_attention: head_dim {d} must be a power of two >= {MIN_TILE}")
    if block_k < MIN_TILE or block_k & (block_k - 1):
        raise ValueError(f"fp8_kv_decode_attention: block_k {block_k} must be a power of two >= {MIN_TILE}")
    if t < MIN_TILE:
        raise ValueError(f"fp8_kv_decode_attention: the cache has {t} slots, fewer than one {MIN_TILE}-slot tile")
    bk = min(block_k, 1 << (t.bit_length() - 1))
    num_blocks = -(-t // bk)
    splits = choose_splits(b, hkv, num_blocks) if splits is None else int(splits)
    if splits < 1:
        raise ValueError(f"fp8_kv_decode_attention: splits={splits} must be >= 1")
    blocks_per_split = -(-num_blocks // min(splits, num_blocks))
    splits = -(-num_blocks // blocks_per_split)
    g = hq // hkv
    gp = max(MIN_TILE, int(pl.next_power_of_2(g)))
    qin, scales, sm = _kernel_query(q, q_scale, k_scale, sm_scale)
    return run_pallas(_decode, qin, k_cache, v_cache, scales, jnp.asarray(v_scale, jnp.float32),
                   kv_mask.astype(jnp.int8), jnp.asarray(q_slot, jnp.int32), sm_scale=sm, bk=bk, splits=splits,
                   blocks_per_split=blocks_per_split, gp=gp, out_dtype=jnp.dtype(q.dtype), interpret=interpret,
                   num_warps=num_warps, num_stages=num_stages)


def _prefill_kernel(*refs, n_scales, sm_scale, bk, t, compute_dtype, precision):
    """Program ``(b, h, r)``: rows ``[r * R, (r + 1) * R)`` of KV head ``h``'s (query position, head) pairs.

    ``refs``: vs_ref ``()`` float32 ``v_scale``, ``n_scales`` float32 ``()`` scale refs (``k_scale``, then
    ``q_scale``: :func:`_score_multiplier`), then slot_ref ``[R]`` int32 (each row's last visible slot; -1
    for padding rows); mask_ref ``[T]`` int8; q_ref ``[R, D]``; k_ref, v_ref ``[T, D]`` e4m3 (row b, KV head h of the
    cache, strided); o_ref ``[R, D]`` in the output dtype (normalized, times ``v_scale``)."""
    vs_ref, scale_refs = refs[0], refs[1:1 + n_scales]
    slot_ref, mask_ref, q_ref, k_ref, v_ref, o_ref = refs[1 + n_scales:]
    slots = slot_ref[...]
    n = (jnp.minimum(jnp.max(slots) + 1, t) + bk - 1) // bk  # the tiles holding a slot some row sees
    acc, _, l = _online_softmax(q_ref[...], k_ref, v_ref, mask_ref, _score_multiplier(scale_refs, sm_scale), start0=0,
                                n=n, t=t, bk=bk, limit=slots, compute_dtype=compute_dtype, precision=precision)
    o_ref[...] = (acc * (vs_ref[...] / jnp.where(l > 0, l, 1.0))[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "bk", "rows", "out_dtype", "interpret", "num_warps",
                                             "num_stages"))
def _prefill(q, k_cache, v_cache, scales, v_scale, kv_mask, q_slots, *, sm_scale, bk, rows, out_dtype, interpret,
             num_warps, num_stages):
    b, s, hq, d = q.shape
    _, t, hkv, _ = k_cache.shape
    g = hq // hkv
    compute_dtype = jnp.dtype(out_dtype)
    # rows of KV head h: its G query heads at every position, position-major: [B, H_kv, S * G, D]
    q4 = jnp.transpose(q.reshape(b, s, hkv, g, d), (0, 2, 1, 3, 4)).reshape(b, hkv, s * g, d)
    if not is_fp8_cache(q4):
        q4 = q4.astype(compute_dtype)
    slot = jnp.repeat(q_slots.astype(jnp.int32), g, axis=1)  # [B, S * G]
    pad = -(-(s * g) // rows) * rows - s * g
    if pad:
        q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, pad), (0, 0)))
        slot = jnp.pad(slot, ((0, 0), (0, pad)), constant_values=-1)  # padding rows see nothing
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None  # IEEE float32, not TF32
    kwargs = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    sq = pl.squeezed
    nrows = s * g + pad
    out = pl.pallas_call(
        functools.partial(_prefill_kernel, n_scales=len(scales), sm_scale=sm_scale, bk=bk, t=t,
                          compute_dtype=compute_dtype, precision=precision),
        grid=(b, hkv, nrows // rows),
        in_specs=[
            *[pl.BlockSpec((sq,), lambda i, h, r: (0,))] * (1 + len(scales)),  # v_scale, k_scale (, q_scale)
            pl.BlockSpec((sq, rows), lambda i, h, r: (i, r)),  # each row's last visible slot
            pl.BlockSpec((sq, t), lambda i, h, r: (i, 0)),  # kv_mask row
            pl.BlockSpec((sq, sq, rows, d), lambda i, h, r: (i, h, r, 0)),  # the tile's query rows
            pl.BlockSpec((sq, t, sq, d), lambda i, h, r: (i, 0, h, 0)),  # K cache row i, head h (strided view)
            pl.BlockSpec((sq, t, sq, d), lambda i, h, r: (i, 0, h, 0)),  # V cache
        ],
        out_specs=pl.BlockSpec((sq, sq, rows, d), lambda i, h, r: (i, h, r, 0)),
        out_shape=jax.ShapeDtypeStruct((b, hkv, nrows, d), out_dtype),
        interpret=interpret,
        name="fp8_kv_prefill_attention",
        **kwargs,
    )(v_scale.reshape(1), *scales, slot, kv_mask, q4, k_cache, v_cache)
    out = out[:, :, :s * g].reshape(b, hkv, s, g, d)
    return jnp.transpose(out, (0, 2, 1, 3, 4)).reshape(b, s, hq, d)


def fp8_kv_prefill_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, k_scale, v_scale,
                             kv_mask: jax.Array, q_slots: jax.Array, *, q_scale=None, sm_scale: float | None = None,
                             block_k: int = 64, block_rows: int = 64, interpret: bool | None = None,
                             num_warps: int = 4, num_stages: int = 2) -> jax.Array:
    """Attention of several new tokens per row (prefill, or a chunk of it) over an e4m3 KV cache, dequantized inside
    the kernel (flash attention over the cache: online softmax per tile, no ``[B, H, S, T]`` scores, no bf16 copy of
    the cache).

    ``out[b, s, h] = sum_t softmax_t(sm_scale * q[b, s, h] . K[b, t, h // G]) V[b, t, h // G]`` over the slots
    visible to that query (``kv_mask[b, t] and t <= q_slots[b, s]``), ``K = k_cache * k_scale``,
    ``V = v_cache * v_scale``: :func:`fp8_kv_decode_attention`'s semantics for ``S`` queries. Grid ``(B, H_kv,
    ceil(S * G / block_rows))``: each program takes ``block_rows`` consecutive (position, query head) rows of one KV
    head's group, so the group's heads share each K/V tile, and loops over the tiles up to its rows' last visible
    slot (a dynamic trip count).

    Args:
      q: ``[B, S, H_q, D]`` queries after QK-norm and RoPE (bf16 / f16 / f32; the output dtype).
      k_cache, v_cache: ``[B, T, H_kv, D]`` ``float8_e4m3fn`` (read in place); ``T >= block_k``.
      k_scale, v_scale: float32 scalars.
      kv_mask: bool ``[B, T]``. q_slots: int ``[B, S]``, each query's own slot.
      q_scale: float32 scalar for FP8 attention (queries quantized to e4m3, ``QK^T`` on e4m3 operands), or None.
      sm_scale: softmax scale (default ``D ** -0.5``).
      block_k: slots per tile (a power of two >= 16). block_rows: query rows per program (a power of two >= 16).
      interpret: default None: compiled where the program is lowered for CUDA, interpret mode elsewhere.

    Returns:
      ``[B, S, H_q, D]`` in ``q.dtype``. A query with no visible slot gets zeros.

    Raises:
      ValueError: a cache that is not e4m3, mismatched shapes, ``H_q`` not a multiple of ``H_kv``, ``D`` not a power
        of two >= 16, ``T < block_k``, or a tile size that is not a power of two >= 16.

    Source: FlashAttention-2's online softmax (Dao 2023) over vLLM's FP8 KV cache semantics.
    """
    if not (is_fp8_cache(k_cache) and is_fp8_cache(v_cache)):
        raise ValueError(f"fp8_kv_prefill_attention needs an e4m3 cache, got {k_cache.dtype} / {v_cache.dtype}")
    if q.ndim != 4 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"fp8_kv_prefill_attention: q {tuple(q.shape)} must be [B, S, H_q, D] and k/v caches "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)} the same [B, T, H_kv, D]")
    b, s, hq, d = q.shape
    _, t, hkv, _ = k_cache.shape
    if k_cache.shape[0] != b or k_cache.shape[3] != d or hq % hkv:
        raise ValueError(f"fp8_kv_prefill_attention: q {tuple(q.shape)} does not fit the cache "
                         f"{tuple(k_cache.shape)} (same B and D, H_q a multiple of H_kv)")
    if tuple(kv_mask.shape) != (b, t) or tuple(jnp.shape(q_slots)) != (b, s):
        raise ValueError(f"fp8_kv_prefill_attention: kv_mask {tuple(kv_mask.shape)} must be [B, T] = {(b, t)} and "
                         f"q_slots {tuple(jnp.shape(q_slots))} [B, S] = {(b, s)}")
    for name, v in (("head_dim", d), ("block_k", block_k), ("block_rows", block_rows)):
        if v < MIN_TILE or v & (v - 1):
            raise ValueError(f"fp8_kv_prefill_attention: {name} {v} must be a power of two >= {MIN_TILE}")
    if t < MIN_TILE:
        raise ValueError(f"fp8_kv_prefill_attention: the cache has {t} slots, fewer than one {MIN_TILE}-slot tile")
    bk = min(block_k, 1 << (t.bit_length() - 1))
    qin, scales, sm = _kernel_query(q, q_scale, k_scale, sm_scale)
    return run_pallas(_prefill, qin, k_cache, v_cache, scales, jnp.asarray(v_scale, jnp.float32),
                      kv_mask.astype(jnp.int8), jnp.asarray(q_slots, jnp.int32), sm_scale=sm, bk=bk, rows=block_rows,
                      out_dtype=jnp.dtype(q.dtype), interpret=interpret, num_warps=num_warps, num_stages=num_stages)

def _selftest_fp8_kv_attention(interpret: bool = False) -> None:
    """Self-test of the ``fp8_kv_attention`` family: 2 rows x 4 query heads over a 40-slot e4m3 cache of 2 KV heads
    (left padding; decode: the query at slot 33 / 39, two splits; prefill: 5 causal queries per row) on the default
    device against the float64 formula on the dequantized cache, to 1e-5 relative (float32 softmax and
    accumulation).

    Raises:
      KernelMismatch: the outputs differ by more.
    """
    import numpy as np

    from fp8rl_jax.kernels.registry import check_close

    rng = np.random.default_rng(0)
    b, t, hkv, g, d = 2, 40, 2, 2, 64
    q = rng.standard_normal((b, hkv * g, d)).astype(np.float32)
    kc, vc = (rng.standard_normal((b, t, hkv, d)).astype(np.float32).astype(jnp.float8_e4m3fn) for _ in range(2))
    ks, vs = np.float32(0.05), np.float32(0.02)
    mask = np.ones((b, t), bool)
    mask[0, :6] = False
    slot = np.array([33, 39], np.int32)
    out = fp8_kv_decode_attention(jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), ks, vs, jnp.asarray(mask),
                                  jnp.asarray(slot), splits=2, block_k=16, interpret=interpret)
    k64 = np.repeat(kc.astype(np.float64) * float(ks), g, axis=2)  # [B, T, H_q, D]
    v64 = np.repeat(vc.astype(np.float64) * float(vs), g, axis=2)
    sc = np.einsum("bhd,bthd->bht", q.astype(np.float64), k64) / np.sqrt(d)
    vis = mask & (np.arange(t)[None] <= slot[:, None])
    sc = np.where(vis[:, None], sc, -np.inf)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref = np.einsum("bht,bthd->bhd", p, v64)
    check_close("FP8-KV decode attention B=2 T=40", out, ref, np.einsum("bht,bthd->bhd", p, np.abs(v64)), 1e-5)
    # prefill: 5 queries per row at slots 20..24 / 35..39 (causal), 16-row tiles
    qp = rng.standard_normal((b, 5, hkv * g, d)).astype(np.float32)
    slots = np.stack([np.arange(20, 25), np.arange(35, 40)]).astype(np.int32)
    out = fp8_kv_prefill_attention(jnp.asarray(qp), jnp.asarray(kc), jnp.asarray(vc), ks, vs, jnp.asarray(mask),
                                   jnp.asarray(slots), block_k=16, block_rows=16, interpret=interpret)
    sc = np.einsum("bshd,bthd->bsht", qp.astype(np.float64), k64) / np.sqrt(d)
    vis = mask[:, None, :] & (np.arange(t)[None, None, :] <= slots[:, :, None])
    sc = np.where(vis[:, :, None, :], sc, -np.inf)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    check_close("FP8-KV prefill attention B=2 S=5 T=40", out, np.einsum("bsht,bthd->bshd", p, v64),
                np.einsum("bsht,bthd->bshd", p, np.abs(v64)), 1e-5)


register_selftest("fp8_kv_attention", _selftest_fp8_kv_attention)


__all__ = ["KV_ATTENTION_IMPLS", "TARGET_PROGRAMS", "choose_splits", "decode_kernel_choice", "fp8_kv_decode_attention",
           "fp8_kv_prefill_attention",
           "use_fp8_kv_kernel", "fp8_kv_attention_dispatch"]


def main(argv=None) -> None:
    """Time the decode attention over an e4m3 KV cache (:func:`fp8_kv_decode_attention`) at Qwen3-8B's attention
    shape (32 query / 8 KV heads of 128) with ``--context`` slots (default 4096) for batch sizes ``--batch`` (default
    1,32,128), against XLA: ``jax.nn.dot_product_attention`` over a bf16 cache, and over the e4m3 cache dequantized
    first (the materialized path). Microseconds per step and the cache bytes read over that time (GB/s; issue 37 item
    6: FP8 + e4m3 KV at least as fast as FP8 with a bf16 cache at 4k context). On a GPU; ``--smoke`` runs a tiny
    shape in interpret mode on the CPU (numbers meaningless).

    Raises:
      SystemExit: bad flags (argparse).
    """
    import numpy as np

    from fp8rl_jax.kernels.timing import main_parser, per_call_us, print_table

    p = main_parser("pallas_attention", main.__doc__, iters=20)
    p.add_argument("--batch", default="1,32,128")
    p.add_argument("--context", type=int, default=4096)
    args = p.parse_args(argv)
    if args.smoke:
        batches, t, hq, hkv, d, iters = (1,), 32, 4, 2, 16, 1
    else:
        batches, t, hq, hkv, d, iters = [int(b) for b in args.batch.split(",")], args.context, 32, 8, 128, args.iters
    rng = np.random.default_rng(0)
    scale = jnp.float32(0.05)
    rows = []
    for b in batches:
        q = jnp.asarray(rng.standard_normal((b, hq, d)), jnp.bfloat16)
        kf = jnp.asarray(rng.standard_normal((b, t, hkv, d)), jnp.bfloat16)
        vf = jnp.asarray(rng.standard_normal((b, t, hkv, d)), jnp.bfloat16)
        k8, v8 = (kf / scale).astype(jnp.float8_e4m3fn), (vf / scale).astype(jnp.float8_e4m3fn)
        mask = jnp.ones((b, t), bool)
        slot = jnp.full((b,), t - 1, jnp.int32)

        def bf16_cache(q, k, v, mask):
            return jax.nn.dot_product_attention(q[:, None], k, v, mask=mask[:, None, None, :])[:, 0]

        def materialized(q, k, v, mask):
            return bf16_cache(q, k.astype(jnp.bfloat16) * scale.astype(jnp.bfloat16),
                              v.astype(jnp.bfloat16) * scale.astype(jnp.bfloat16), mask)

        def kernel(q, k, v, mask, slot):
            return fp8_kv_decode_attention(q, k, v, scale, scale, mask, slot, interpret=True if args.smoke else None)

        gb8, gb16 = 2 * b * t * hkv * d / 1e9, 4 * b * t * hkv * d / 1e9
        bf_us = per_call_us(bf16_cache, (q, kf, vf, mask), iters)
        mat_us = per_call_us(materialized, (q, k8, v8, mask), iters)
        k_us = per_call_us(kernel, (q, k8, v8, mask, slot), iters)
        rows.append((b, t, bf_us, gb16 / bf_us * 1e6, mat_us, k_us, gb8 / k_us * 1e6, bf_us / k_us))
    print_table("FP8 KV decode attention vs XLA", ("batch", "context", "bf16 cache us", "bf16 GB/s", "e4m3 materialized us", "e4m3 kernel us",
                 "kernel GB/s", "kernel vs bf16"), rows)


if __name__ == "__main__":  # pragma: no cover
    main()
