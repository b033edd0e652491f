"""FP8 KV cache: e4m3 quantization with per-layer scalar scales, scale calibration, cache capacity math.

Semantics follow vLLM's FP8 KV cache (``kv_cache_dtype="fp8_e4m3"``, docs "Quantized KV Cache";
``BaseKVCacheMethod`` in ``vllm/model_executor/layers/quantization/kv_cache.py``):

* ``k_scale``, ``v_scale`` (and ``q_scale`` for FP8 attention) are per-layer float32 scalars and are the
  *dequantization multipliers*: the cache stores ``fp8(k / k_scale)`` (saturated to +-448) and attention reads
  ``k ~= fp8 * k_scale``. A scale of 1.0 is vLLM's default when a checkpoint carries none.
* Checkpoint names are ``model.layers.{i}.self_attn.{k,v,q}_scale``; vLLM's weight loader maps them to its
  attention module (``...self_attn.attn.k_scale``) with ``QuantizationConfig.get_cache_scale_mapper`` (pattern
  ``.{q,k,v}_scale -> .attn.{q,k,v}_scale``) and its scalar loader accepts any one-element tensor.

Calibration follows NeMo-RL's ``calibrate_qkv_fp8_scales`` (``percentile=99.9``, ``margin=1.05``:
``scale = percentile_p(amax over micro-batches) * margin / 448``, nearest-rank percentile
``sorted[round(p/100 * (n-1))]``), with plain ``amax`` (``margin=1``) as the default statistic. The amax values
come from q/k/v *after* QK-norm and RoPE (what the cache stores), captured during the trainer's own forward.

Capacity follows vLLM's paged cache report ("GPU KV cache size: N tokens", "Maximum concurrency for L tokens
per request: Xx"): the byte budget is cut into blocks of ``block_size`` tokens, each token costing
``2 * num_layers * num_kv_heads * head_dim * itemsize`` bytes; the per-layer scales are taken off the budget.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.fp8.formats import E4M3, E4M3_MAX, scale_values

# vLLM spells e4m3 as "fp8" too (CUDA: "fp8" == "fp8_e4m3").
_KV_ALIASES = {"auto": "auto", "bf16": "auto", "bfloat16": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3"}
KV_SCALE_CALIBRATIONS = ("amax", "percentile")
# Floor of a calibrated scale: an all-zero layer (e.g. v of a zeroed v_proj) keeps a positive, normal scale.
KV_SCALE_EPS = 1e-12
# vLLM's default page size (tokens per KV block) on GPU backends.
DEFAULT_BLOCK_SIZE = 16
_SCALE_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:attn\.)?([qkv])_scale$")


def normalize_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """Canonical KV-cache dtype name: ``"auto"`` (cache in the model dtype) or ``"fp8_e4m3"``.

    Accepts vLLM's spellings (``"fp8"`` is e4m3) and ``"bf16"``/``"bfloat16"`` for ``"auto"``.

    Raises:
      ValueError: any other name (``fp8_e5m2`` is not supported here), naming the valid ones.
    """
    key = str(kv_cache_dtype).lower()
    if key not in _KV_ALIASES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported; expected one of "
                         f"{sorted(_KV_ALIASES)} ('fp8' means e4m3, as in vLLM)")
    return _KV_ALIASES[key]


def kv_cache_storage_dtype(kv_cache_dtype: str, model_dtype) -> jnp.dtype:
    """The array dtype the cache is stored in: e4m3 for ``fp8_e4m3``, else ``model_dtype`` (vLLM ``auto``)."""
    return jnp.dtype(E4M3) if normalize_kv_cache_dtype(kv_cache_dtype) == "fp8_e4m3" else jnp.dtype(model_dtype)


def is_fp8_cache(x) -> bool:
    """True when ``x`` (an array, a dtype, a scalar type such as ``np.float32``, or a dtype name) is e4m3."""
    return jnp.dtype(x if isinstance(x, type) else getattr(x, "dtype", x)) == jnp.dtype(E4M3)


def quantize_kv(x: jax.Array, scale: jax.Array | float) -> jax.Array:
    """Quantize keys/values (or queries) to e4m3 with a scalar dequantization scale.

    ``q = e4m3(clip(x / scale, -448, 448))`` computed in float32 with round-to-nearest-even, the saturating
    conversion of vLLM's cache write (``scaled_convert`` with ``__NV_SATFINITE``): the project's quantizer
    :func:`fp8rl_jax.fp8.formats.scale_values` (``CONTRACT`` recipe: a correctly rounded ``x / scale``).

    Args:
      x: any float array, e.g. ``[B, S, H_kv, D]`` (bf16/f32).
      scale: float32 scalar (``k_scale``/``v_scale``/``q_scale``), > 0.

    Returns:
      ``float8_e4m3fn`` array of ``x``'s shape.
    """
    return scale_values(x, jnp.asarray(scale, jnp.float32))


def dequantize_kv(q: jax.Array, scale: jax.Array | float, dtype=jnp.bfloat16) -> jax.Array:
    """``q * scale`` in float32, cast to ``dtype`` (what attention reads from an FP8 cache; vLLM semantics)."""
    return (q.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)).astype(dtype)


def masked_row_absmax(token_absmax: jax.Array, mask: jax.Array) -> jax.Array:
    """Per-sequence maxima of captured ``|q|``, ``|k|``, ``|v|`` over real tokens only.

    Args:
      token_absmax: float32 ``[L, 3, B, S]``: per layer, (q, k, v) max-abs over heads and head_dim per token
        (what :func:`fp8rl_jax.models.decoder.qkv_absmax_from_intermediates` returns).
      mask: ``[B, S]`` bool/float, nonzero on real tokens (prompt and response, not padding).

    Returns:
      float32 ``[L, 3, B]`` (0 for a row without real tokens).

    Raises:
      ValueError: shapes that do not line up (both shapes named).
    """
    if token_absmax.ndim != 4 or token_absmax.shape[1] != 3 or tuple(token_absmax.shape[2:]) != tuple(mask.shape):
        raise ValueError(f"masked_row_absmax: token_absmax must be [L, 3, B, S] matching mask [B, S]; got "
                         f"{tuple(token_absmax.shape)} and {tuple(mask.shape)}")
    m = jnp.asarray(mask).astype(bool)[None, None]
    return jnp.max(jnp.where(m, token_absmax.astype(jnp.float32), 0.0), axis=-1)


def calibration_statistic(group_amax: np.ndarray, method: str = "amax", percentile: float = 99.9) -> np.ndarray:
    """Reduce per-group maxima ``[G, ...]`` over groups (axis 0) to one amax per entry.

    Args:
      group_amax: ``[G, ...]`` maxima, one per micro-batch (or per sequence).
      method: ``"amax"`` (max over groups) or ``"percentile"`` (NeMo-RL: nearest-rank percentile of the
        sorted group maxima, ``sorted[round(p/100 * (G-1))]``).
      percentile: ``p`` in [0, 100] for ``"percentile"``.

    Returns:
      float64 ``[...]``.

    Raises:
      ValueError: unknown method, ``p`` outside [0, 100], empty input, or non-finite maxima.
    """
    a = np.asarray(group_amax, np.float64)
    if method not in KV_SCALE_CALIBRATIONS:
        raise ValueError(f"kv scale calibration {method!r} not in {KV_SCALE_CALIBRATIONS}")
    if a.ndim < 1 or a.shape[0] == 0:
        raise ValueError(f"calibration needs at least one group of maxima, got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError("calibration maxima contain NaN/inf: the forward produced non-finite q/k/v")
    if method == "amax":
        return a.max(axis=0)
    if not 0.0 <= percentile <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {percentile}")
    rank = int(min(a.shape[0] - 1, max(0, round(percentile / 100.0 * (a.shape[0] - 1)))))
    return np.sort(a, axis=0)[rank]


class KVScales(NamedTuple):
    """Per-layer FP8 attention scales (vLLM's dequantization multipliers).

    Attributes:
      k_scale, v_scale, q_scale: float32 ``[num_layers]`` arrays (numpy or jax), > 0.
    """

    k_scale: Any
    v_scale: Any
    q_scale: Any

    @classmethod
    def from_amax(cls, amax: np.ndarray, margin: float = 1.0, fp8_max: float = E4M3_MAX) -> "KVScales":
        """``scale = max(amax * margin / fp8_max, KV_SCALE_EPS)`` from ``amax [L, 3]`` (columns q, k, v).

        Raises:
          ValueError: wrong shape, negative/non-finite amax, or ``margin <= 0``.
        """
        a = np.asarray(amax, np.float64)
        if a.ndim != 2 or a.shape[1] != 3:
            raise ValueError(f"KVScales.from_amax needs amax [num_layers, 3] (q, k, v), got {a.shape}")
        if margin <= 0:
            raise ValueError(f"kv scale margin must be > 0, got {margin}")
        if not np.all(np.isfinite(a)) or np.any(a < 0):
            raise ValueError("KVScales.from_amax: amax must be finite and >= 0")
        s = np.maximum(a * margin / fp8_max, KV_SCALE_EPS).astype(np.float32)
        return cls(k_scale=s[:, 1], v_scale=s[:, 2], q_scale=s[:, 0])

    def to_tensors(self, include_q: bool = True) -> dict[str, np.ndarray]:
        """Checkpoint tensors ``{model.layers.{i}.self_attn.{k,v,q}_scale: float32 scalar}`` (vLLM's names)."""
        out = {}
        names = (("k", self.k_scale), ("v", self.v_scale)) + ((("q", self.q_scale),) if include_q else ())
        for kind, arr in names:
            a = np.asarray(arr, np.float32)
            for i in range(a.shape[0]):
                out[f"model.layers.{i}.self_attn.{kind}_scale"] = a[i]
        return out

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, Any], num_layers: int) -> "KVScales | None":
        """Collect ``...self_attn.{k,v,q}_scale`` tensors (also the ``...self_attn.attn.*`` spelling).

        Returns ``None`` when no k/v scale is present. A missing ``q_scale`` falls back to ``k_scale`` (what
        vLLM does when a checkpoint lacks it).

        Raises:
          ValueError: only some layers' k/v scales present, a non-scalar or non-positive/non-finite scale,
            or a layer index >= ``num_layers`` (all named).
        """
        found: dict[str, dict[int, float]] = {"q": {}, "k": {}, "v": {}}
        for name, val in tensors.items():
            parsed = parse_kv_scale(name, val)
            if parsed is None:
                continue
            i, kind, v = parsed
            if i >= num_layers:
                raise ValueError(f"{name}: layer {i} does not exist (model has {num_layers} layers)")
            found[kind][i] = v
        if not found["k"] and not found["v"]:
            return None
        for kind in ("k", "v"):
            missing = sorted(set(range(num_layers)) - set(found[kind]))
            if missing:
                raise ValueError(f"kv scales incomplete: {kind}_scale missing for layers {missing[:8]}")
        k = np.array([found["k"][i] for i in range(num_layers)], np.float32)
        v = np.array([found["v"][i] for i in range(num_layers)], np.float32)
        q = np.array([found["q"].get(i, found["k"][i]) for i in range(num_layers)], np.float32)
        return cls(k_scale=k, v_scale=v, q_scale=q)


def is_kv_scale_name(name: str) -> bool:
    """True for ``model.layers.{i}.self_attn.{q,k,v}_scale`` (or the ``...self_attn.attn.`` spelling)."""
    return bool(_SCALE_NAME.match(name))


def parse_kv_scale(name: str, value: Any) -> tuple[int, str, float] | None:
    """``(layer, "q"|"k"|"v", scale)`` for a KV-scale tensor (:func:`is_kv_scale_name`), else ``None``.

    Args:
      name: HF tensor name, e.g. ``model.layers.3.self_attn.k_scale``.
      value: its value, a scalar (any shape with one element; numpy, JAX or torch-convertible).

    Raises:
      ValueError: a KV-scale name whose value is not a scalar, or not finite and > 0 (named).
    """
    m = _SCALE_NAME.match(name)
    if not m:
        return None
    if int(np.prod(np.shape(value))) != 1:
        raise ValueError(f"{name} must be a scalar, got shape {tuple(np.shape(value))}")
    v = float(np.asarray(value, np.float32).reshape(()))
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be finite and > 0, got {v}")
    return int(m.group(1)), m.group(2), v


def calibrate_kv_scales(row_amax: Sequence[Any] | np.ndarray, method: str = "amax", percentile: float = 99.9,
                        margin: float | None = None) -> KVScales:
    """Scales from one step's captured maxima.

    Args:
      row_amax: ``[L, 3, G]`` (or a list of such, concatenated along G): per layer, (q, k, v) maxima of each
        group (a sequence, or a micro-batch), e.g. :func:`masked_row_absmax` of every training micro-batch.
      method: ``"amax"`` or ``"percentile"`` (see :func:`calibration_statistic`).
      percentile: for ``"percentile"`` (NeMo-RL default 99.9).
      margin: multiplier on the statistic; default 1.0 for ``"amax"`` and 1.05 for ``"percentile"`` (NeMo-RL).

    Returns:
      :class:`KVScales` with ``scale = stat * margin / 448``.

    Raises:
      ValueError: bad shapes or values (see :func:`calibration_statistic`, :meth:`KVScales.from_amax`).
    """
    if isinstance(row_amax, (list, tuple)):
        if not row_amax:
            raise ValueError("calibrate_kv_scales: no captured maxima (did the training forward run?)")
        row_amax = np.concatenate([np.asarray(r, np.float64) for r in row_amax], axis=-1)
    a = np.asarray(row_amax, np.float64)
    if a.ndim != 3 or a.shape[1] != 3:
        raise ValueError(f"calibrate_kv_scales: row_amax must be [num_layers, 3, groups], got {a.shape}")
    stat = calibration_statistic(np.moveaxis(a, -1, 0), method, percentile)  # [L, 3]
    if margin is None:
        margin = 1.05 if method == "percentile" else 1.0
    return KVScales.from_amax(stat, margin)


# ---------------------------------------------------------------------------------------------------------
# Capacity
# ---------------------------------------------------------------------------------------------------------


def kv_cache_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str,
                             model_dtype="bfloat16") -> int:
    """Bytes one token occupies in the cache: ``2 (k and v) * L * H_kv * D * itemsize``.

    ``itemsize`` is 1 for ``fp8_e4m3`` and the model dtype's (2 for bf16) for ``auto``.
    """
    item = kv_cache_storage_dtype(kv_cache_dtype, model_dtype).itemsize
    return 2 * num_layers * num_kv_heads * head_dim * item


@dataclasses.dataclass(frozen=True)
class KVCacheCapacity:
    """What a byte budget holds (vLLM's "GPU KV cache size" / "Maximum concurrency" report).

    Attributes:
      kv_cache_dtype: ``"auto"`` or ``"fp8_e4m3"``; ``model_dtype``: dtype of an ``auto`` cache.
      memory_bytes: the budget (bytes).
      bytes_per_token: see :func:`kv_cache_bytes_per_token`.
      scale_bytes: bytes of the per-layer float32 scales (``3 * L * 4`` for fp8, else 0), taken off the budget.
      block_size: tokens per page; ``num_blocks``: whole pages that fit.
      num_tokens: ``num_blocks * block_size``.
      max_model_len: tokens per request used for the concurrency figure.
      max_concurrency: ``num_blocks / ceil(max_model_len / block_size)`` requests of full length.
    """

    kv_cache_dtype: str
    model_dtype: str
    memory_bytes: int
    bytes_per_token: int
    scale_bytes: int
    block_size: int
    num_blocks: int
    num_tokens: int
    max_model_len: int
    max_concurrency: float

    def blocks_for(self, seq_len: int) -> int:
        """Pages one sequence of ``seq_len`` tokens needs."""
        return -(-int(seq_len) // self.block_size)

    def max_sequences(self, seq_len: int) -> int:
        """How many sequences of ``seq_len`` tokens fit at once."""
        return self.num_blocks // max(1, self.blocks_for(seq_len))

    def report(self) -> str:
        """One line in vLLM's words (printed at engine start)."""
        return (f"KV cache ({self.kv_cache_dtype}, {self.bytes_per_token} B/token) in {self.memory_bytes / 2**20:.2f} "
                f"MiB: {self.num_tokens:,} tokens; maximum concurrency for {self.max_model_len:,} tokens per "
                f"request: {self.max_concurrency:.2f}x")


def kv_cache_capacity(num_layers: int, num_kv_heads: int, head_dim: int, memory_bytes: int,
                      kv_cache_dtype: str = "auto", model_dtype="bfloat16", max_model_len: int = 4096,
                      block_size: int = DEFAULT_BLOCK_SIZE) -> KVCacheCapacity:
    """Tokens and concurrency a KV-cache byte budget holds.

    Args:
      num_layers, num_kv_heads, head_dim: attention geometry.
      memory_bytes: cache budget in bytes (vLLM's ``kv_cache_memory_bytes``).
      kv_cache_dtype: ``"auto"`` | ``"fp8_e4m3"`` (aliases accepted).
      model_dtype: dtype of an ``auto`` cache.
      max_model_len: tokens per request for the concurrency figure.
      block_size: tokens per page (vLLM default 16).

    Returns:
      :class:`KVCacheCapacity`.

    Raises:
      ValueError: non-positive sizes or a budget smaller than the scales.
    """
    for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                    ("max_model_len", max_model_len), ("block_size", block_size)):
        if int(v) < 1:
            raise ValueError(f"kv_cache_capacity: {name} must be >= 1, got {v}")
    kvd = normalize_kv_cache_dtype(kv_cache_dtype)
    memory_bytes = int(memory_bytes)
    bpt = kv_cache_bytes_per_token(num_layers, num_kv_heads, head_dim, kvd, model_dtype)
    scale_bytes = 3 * num_layers * 4 if kvd == "fp8_e4m3" else 0
    if memory_bytes < scale_bytes:
        raise ValueError(f"kv_cache_memory_bytes={memory_bytes} is smaller than the scales ({scale_bytes} bytes)")
    num_blocks = (memory_bytes - scale_bytes) // (bpt * block_size)
    need = -(-max_model_len // block_size)
    return KVCacheCapacity(kv_cache_dtype=kvd, model_dtype=str(jnp.dtype(model_dtype)), memory_bytes=memory_bytes,
                           bytes_per_token=bpt, scale_bytes=scale_bytes, block_size=block_size, num_blocks=num_blocks,
                           num_tokens=num_blocks * block_size, max_model_len=max_model_len,
                           max_concurrency=num_blocks / need)
